"""The optimizer of the paper's recipe ([Sink-MoE] Table 1, i.e. nanochat 9d4c9b7's `setup_optimizers`), as one
optax chain.

Parameters are routed by their nnx path (`param_labels`):
  matrix   kernels inside the blocks (attention q/k/v/o, gate projections, MLP; MoE experts [E, in, out] per expert)
           -> Muon at train.matrix_lr. Gate projections are hidden matrices like q/k/v, so they go where those go.
  embed    the token embedding and the learnable sink tokens (`sink_states`, embedding-like) -> AdamW, train.embed_lr
  unembed  the LM head                                                                  -> AdamW, train.unembed_lr
  A parameter created with `sinkjax.sharding.optimizer_group(...)` metadata goes to that group whatever its path
  (Gated DeltaNet's depthwise conv kernel [K, C] is labelled "scalar": no matrix for Muon).
  scalar   everything else: sink logits, gate biases / input-independent gate logits, norm scales, biases, the
           per-layer resid/x0 lambdas -> AdamW at train.scalar_lr without decay. nanochat 9d4c9b7 has no such
           parameters (its norms are parameter-free, no biases); Muon orthogonalizes matrices and has no meaning for
           vectors, so they take AdamW like nanochat's embeddings (and like its later resid/x0 lambdas).
As in nanochat, the AdamW learning rates of the embedding and unembedding are scaled by (d_model / 768) ** -0.5
(the values are tuned at width 768) and AdamW uses betas (0.8, 0.95), eps 1e-10. The whole chain is preceded by
global-norm clipping over all parameters (train.grad_clip; 0 disables) and every group follows one schedule:
optional linear warmup, constant, then linear decay to 0 over the final train.decay_frac of the steps (nanochat's
`get_lr_multiplier`: step s of N has multiplier (N - s) / round(0.2 N) in the warmdown). No batch-size scaling.

Muon (`scale_by_muon`) is nanochat's (Keller Jordan's): momentum buffer m <- beta m + (1 - beta) g, Nesterov
g' = (1 - beta) g + beta m (no bias correction, unlike optax.contrib.muon), Newton-Schulz with the quintic
coefficients (3.4445, -4.7750, 2.0315) in train.muon_ns_dtype (nanochat: bfloat16) after Frobenius normalization
(eps 1e-7), then the update times max(1, fan_out / fan_in) ** 0.5 (nanochat's max(1, rows/cols) in torch's (out, in)
layout; Flax kernels are (in, out)). beta follows an optax schedule from train.muon_momentum_start to
train.muon_momentum over train.muon_momentum_warmup steps (nanochat: 0.85 -> 0.95 over 300).
Under a mesh of several devices (`jax.set_mesh`, as the trainer and `sinkjax.compile` trace the step) the matrices
are orthogonalized distributed, as nanochat's DistMuon does: those of one (wide) shape are stacked, padded with zero
matrices to a multiple of the device count and split over all devices, so each device runs Newton-Schulz on its
share only (instead of every device running all of them on row-sharded operands with replicated [m, m] products:
7.5 GB of HBM traffic per chip and step on d20 over v5e-32, docs/TPU.md); the results go back to the leaves'
shardings. The same arithmetic per matrix, so the same update up to the matmuls' summation order. On one device
the matrices of one shape are stacked the same way (train.muon_stack, on by default): one batched matmul per
iteration for all of them, where unscanned layers (model.scan_layers false) would launch one per parameter and layer.
`train.optimizer: adamw` replaces all of it by plain AdamW at train.adamw_lr on the same schedule.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx

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
  if names[0] == "layers" and leaf.ndim >= 2:
    return "matrix"
  return "scalar"


def param_labels(params):
  """The optimizer group of every parameter (a pytree shaped like `params`): the group its nnx.Variable was created
  with (`optimizer_group` metadata) where it has one, else by path and shape (`param_label`)."""
  is_var = lambda x: isinstance(x, nnx.Variable)
  marked = {}

  def note(path, leaf):
    if is_var(leaf) and leaf.get_metadata().get("optimizer_group"):
      marked[tuple(path)] = leaf.get_metadata()["optimizer_group"]

  jax.tree_util.tree_map_with_path(note, params, is_leaf=is_var)
  if not marked:
    return jax.tree_util.tree_map_with_path(param_label, params)

  def label(path, leaf):
    for n in range(len(path), 0, -1):           # a Variable's array sits below the Variable's own path
      if tuple(path[:n]) in marked:
        return marked[tuple(path[:n])]
    return param_label(path, leaf)

  return jax.tree_util.tree_map_with_path(label, params)


NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_EPS = 1e-7


def newton_schulz(g, steps: int = 5, dtype=jnp.bfloat16, eps: float = NS_EPS):
  """Keller Jordan's quintic Newton-Schulz orthogonalization of a matrix (nanochat `zeropower_via_newtonschulz5`),
  computed in `dtype` on the wide orientation; returns g's dtype."""
  x = g.astype(dtype)
  tall = x.shape[-2] > x.shape[-1]
  x = _ns_wide(x.T if tall else x, steps, eps)
  return (x.T if tall else x).astype(g.dtype)


def _ns_wide(x, steps: int, eps: float):
  """Newton-Schulz on a wide matrix [m, n], m <= n, in x's dtype (a zero matrix stays zero)."""
  a, b, c = NS_COEFFS
  x = x / (jnp.linalg.norm(x.astype(jnp.float32)).astype(x.dtype) + eps)
  for _ in range(steps):
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x


def _directions(leaves, steps: int, dtype, devices: int = 1, axes: tuple = (), explicit: bool = False):
  """`newton_schulz` of every matrix of `leaves` ([..., m, n] each), batched: the matrices of one wide shape are
  stacked [N, m, n] (tall ones transposed) and orthogonalized together, then unstacked. On several devices the stack
  is padded with zeros to a multiple of `devices` and split over the mesh axes `axes` for the iterations (each leaf
  goes back to its own sharding by XLA's propagation)."""
  mats, groups = [], {}
  for i, g in enumerate(leaves):
    x = g.reshape((-1,) + g.shape[-2:]).astype(dtype)
    tall = x.shape[-2] > x.shape[-1]
    x = jnp.swapaxes(x, -1, -2) if tall else x
    mats.append((x, tall))
    groups.setdefault(x.shape[-2:], []).append(i)
  out = [None] * len(leaves)
  spec = jax.sharding.PartitionSpec(axes, None, None)
  for idx in groups.values():
    stack = jnp.concatenate([mats[i][0] for i in idx])
    n = stack.shape[0]
    if devices > 1:
      stack = jnp.pad(stack, ((0, -n % devices), (0, 0), (0, 0)))
      stack = jax.sharding.reshard(stack, spec) if explicit else jax.lax.with_sharding_constraint(stack, spec)
    stack = jax.vmap(lambda x: _ns_wide(x, steps, NS_EPS))(stack)
    start = 0
    for i in idx:
      x, tall = mats[i]
      o = stack[start:start + x.shape[0]]
      start += x.shape[0]
      o = jnp.swapaxes(o, -1, -2) if tall else o
      out[i] = o.reshape(leaves[i].shape).astype(leaves[i].dtype)
  return out


def _shape_scale(shape) -> float:
  """Muon's max(1, fan_out / fan_in) ** 0.5 of a kernel of `shape` (Flax's (in, out) layout)."""
  return max(1.0, shape[-1] / shape[-2]) ** 0.5


def _mesh_devices():
  """(devices, axis names, whether any axis is Explicit) of the active mesh (`jax.set_mesh`) when it has more than
  one device, else (1, (), False)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or mesh.size <= 1:
    return 1, (), False
  explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  return mesh.size, tuple(mesh.axis_names), explicit


class MuonState(NamedTuple):
  count: jax.Array
  momentum: optax.Updates


def scale_by_muon(beta: optax.ScalarOrSchedule = 0.95, ns_steps: int = 5, ns_dtype=jnp.bfloat16, stack: bool = True
                  ) -> optax.GradientTransformation:
  """nanochat's Muon direction (see the module docstring), before the learning rate: orthogonalized Nesterov
  momentum times max(1, fan_out / fan_in) ** 0.5. Leaves with more than 2 dims ([E, in, out] MoE experts) are
  orthogonalized per leading index. stack: on one device, the matrices of one shape orthogonalized as one batch
  (several devices always stack them, to split the batch)."""

  def init_fn(params):
    return MuonState(jnp.zeros([], jnp.int32), jax.tree.map(jnp.zeros_like, params))

  def direction(g):
    o = newton_schulz(g, ns_steps, ns_dtype)
    return o * _shape_scale(g.shape)

  def update_fn(updates, state, params=None):
    del params
    b = beta(state.count) if callable(beta) else beta
    mom = jax.tree.map(lambda m, g: b * m + (1 - b) * g, state.momentum, updates)
    nesterov = jax.tree.map(lambda m, g: (1 - b) * g + b * m, mom, updates)
    devices, axes, explicit = _mesh_devices()
    if devices == 1 and not stack:
      out = jax.tree.map(lambda g: jax.vmap(direction)(g.reshape((-1,) + g.shape[-2:])).reshape(g.shape), nesterov)
    else:
      leaves, treedef = jax.tree.flatten(nesterov)
      ortho = _directions(leaves, ns_steps, ns_dtype, devices, axes, explicit)
      out = treedef.unflatten([o * _shape_scale(g.shape) for o, g in zip(ortho, leaves)])
    return out, MuonState(optax.safe_increment(state.count), mom)

  return optax.GradientTransformation(init_fn, update_fn)


def muon(cfg_train, lr: optax.Schedule) -> optax.GradientTransformation:
  t = cfg_train
  beta = optax.linear_schedule(t.muon_momentum_start, t.muon_momentum, t.muon_momentum_warmup) \
      if t.muon_momentum_warmup > 0 else t.muon_momentum
  decay = [optax.add_decayed_weights(t.weight_decay)] if t.weight_decay else []
  return optax.chain(scale_by_muon(beta, ns_dtype=jnp.dtype(t.muon_ns_dtype), stack=t.muon_stack), *decay,
                     optax.scale_by_learning_rate(lr))


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
      "matrix": muon(t, sched(t.matrix_lr)),
      "embed": _adamw(sched(t.embed_lr * width_scale), t.weight_decay),
      "unembed": _adamw(sched(t.unembed_lr * width_scale), t.weight_decay),
      "scalar": _adamw(sched(t.scalar_lr), 0.0),
  }
  return optax.chain(*clip, optax.partition(groups, param_labels)), sched(t.matrix_lr)
