"""The optimizer of the paper's nanochat-style recipe (000 Table 1), as one optax transformation.

Parameters are routed by their nnx path (`param_labels`):
  matrix   2-D kernels inside the blocks (attention q/k/v/o and gate projections, MLP)  -> Muon, train.matrix_lr
  embed    the token embedding and the learnable sink tokens (`sink_states`, embedding-like) -> AdamW, train.embed_lr
  unembed  the LM head                                                                  -> AdamW, train.unembed_lr
  scalar   everything else: sinks, gate biases, norm scales                             -> AdamW, train.scalar_lr
As in nanochat, the AdamW learning rates of the embedding and unembedding are scaled by (d_model / 768) ** -0.5
(the values in the config are tuned at width 768) and AdamW uses betas (0.8, 0.95), eps 1e-10. The whole chain is
preceded by global-norm clipping (train.grad_clip; 0 disables) and every group follows one schedule: optional
linear warmup, constant, then linear decay to 0 over the final train.decay_frac of the steps.
`train.optimizer: adamw` replaces all of it by plain AdamW at train.adamw_lr on the same schedule.
"""
from __future__ import annotations

import jax
import optax

from sinkjax.config import Config
from sinkjax.sharding import path_names

LABELS = ("matrix", "embed", "unembed", "scalar")


def lr_schedule(peak: float, steps: int, warmup_steps: int = 0, decay_frac: float = 0.2) -> optax.Schedule:
  """0 -> peak linearly over `warmup_steps`, flat, then peak -> 0 linearly over the last `decay_frac` of steps."""
  decay = max(int(round(decay_frac * steps)), 0)
  warmup = min(warmup_steps, max(steps - decay, 0))
  parts, boundaries = [], []
  if warmup > 0:
    parts.append(optax.linear_schedule(0.0, peak, warmup))
    boundaries.append(warmup)
  parts.append(optax.constant_schedule(peak))
  if decay > 0:
    boundaries.append(steps - decay)
    parts.append(optax.linear_schedule(peak, 0.0, decay))
  return optax.join_schedules(parts, boundaries) if boundaries else parts[0]


def param_label(path, leaf) -> str:
  names = path_names(path)
  if names[0] == "embed" or "sink_states" in names:
    return "embed"
  if names[0] == "lm_head":
    return "unembed"
  if names[0] == "layers" and leaf.ndim == 2:
    return "matrix"
  return "scalar"


def param_labels(params):
  """The optimizer group of every parameter (a pytree shaped like `params`)."""
  return jax.tree_util.tree_map_with_path(param_label, params)


def _adamw(lr, weight_decay):
  return optax.adamw(lr, b1=0.8, b2=0.95, eps=1e-10, weight_decay=weight_decay)


def build_optimizer(cfg: Config, steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
  """(optimizer, schedule of the reference learning rate) for a run of `steps` optimizer steps.

  The reference learning rate (what metrics.jsonl logs as `lr`) is train.matrix_lr for Muon and train.adamw_lr
  for AdamW; every group's rate is its own peak times the same schedule.
  """
  t = cfg.train
  sched = lambda peak: lr_schedule(peak, steps, t.warmup_steps, t.decay_frac)
  clip = [optax.clip_by_global_norm(t.grad_clip)] if t.grad_clip > 0 else []
  if t.optimizer == "adamw":
    return optax.chain(*clip, optax.adamw(sched(t.adamw_lr), b1=0.9, b2=0.95, weight_decay=t.weight_decay)), \
        sched(t.adamw_lr)
  width_scale = (cfg.model.d_model / 768) ** -0.5
  groups = {
      "matrix": optax.contrib.muon(sched(t.matrix_lr), beta=0.95, nesterov=True, weight_decay=t.weight_decay),
      "embed": _adamw(sched(t.embed_lr * width_scale), t.weight_decay),
      "unembed": _adamw(sched(t.unembed_lr * width_scale), t.weight_decay),
      "scalar": _adamw(sched(t.scalar_lr), 0.0),
  }
  return optax.chain(*clip, optax.partition(groups, param_labels)), sched(t.matrix_lr)
