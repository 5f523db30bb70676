"""LoRA fine-tuning (Hu et al. 2021; paper 000 §5 fine-tunes Llama 3 / Qwen3 with rank 16 and eq. 8).

    model = lora.apply(model, cfg.lora, rngs)           # targeted projections become LoRALinear (base frozen)
    opt = nnx.Optimizer(model, tx, wrt=lora.trainable(cfg.lora))   # the optimizer only sees the adapters
    model = lora.merge(model)                            # W + (alpha/r) A B, plain nnx.Linear again (export)

A `LoRALinear` keeps the base `kernel` / `bias` under the same names as the `nnx.Linear` it replaces (so a base
checkpoint's paths are unchanged) and adds `lora_a` [in, r] and `lora_b` [r, out] as `nnx.LoRAParam` (B starts at
zero, so the adapted model starts equal to the base). Targets name projections: q_proj/k_proj/v_proj/o_proj of
`Attention`, gate_proj/up_proj/down_proj of a dense `MLP` (MoE experts and routers are not adapted; the gate
projection of gated attention is not an MLP projection and is not adapted either).

Also here, for eq. 8 with a fixed shared set (loss.shared_heads_from): `head_importance_of` runs a pretrained model
over a few batches and `shared_heads_of_run` takes the top-m heads per layer.
"""
from __future__ import annotations

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax.config import LoRAConfig
from sinkjax.layers import MLP, Attention

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


class LoRALinear(nnx.Module):
  """y = x W + b + (alpha / r) x A B, with W, b the frozen base (nnx.Param) and A, B the adapters (nnx.LoRAParam)."""

  def __init__(self, base: nnx.Linear, rank: int, alpha: float, *, rngs: nnx.Rngs):
    self.in_features, self.out_features = base.in_features, base.out_features
    self.dtype, self.param_dtype = base.dtype, base.param_dtype
    self.kernel, self.bias = base.kernel, base.bias
    self.rank, self.scale = rank, alpha / rank
    # A: Kaiming-uniform as in the reference implementation (peft); B: zeros, so training starts at the base model.
    init = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
    self.lora_a = nnx.LoRAParam(init(rngs.params(), (self.in_features, rank), base.param_dtype))
    self.lora_b = nnx.LoRAParam(jnp.zeros((rank, self.out_features), base.param_dtype))

  def __call__(self, x):
    dt = self.dtype or x.dtype
    x = x.astype(dt)
    y = x @ self.kernel[...].astype(dt)
    if self.bias is not None:
      y = y + self.bias[...].astype(dt)
    return y + ((x @ self.lora_a[...].astype(dt)) @ self.lora_b[...].astype(dt)) * jnp.asarray(self.scale, dt)

  def merged_kernel(self):
    return self.kernel[...] + (self.lora_a[...] @ self.lora_b[...]) * self.scale


def _targets(model: nnx.Module, targets) -> list[tuple[nnx.Module, str]]:
  """(parent module, attribute) of every projection named in `targets`."""
  found = []
  for _, node in nnx.iter_graph(model):
    names = ATTENTION_TARGETS if isinstance(node, Attention) else MLP_TARGETS if isinstance(node, MLP) else ()
    for name in names:
      if name in targets and isinstance(getattr(node, name, None), (nnx.Linear, LoRALinear)):
        found.append((node, name))
  return found


def apply(model: nnx.Module, lora_cfg: LoRAConfig, rngs: nnx.Rngs) -> nnx.Module:
  """Replaces the targeted projections of `model` by `LoRALinear` (in place; returns the model). rank 0: no-op."""
  if lora_cfg.rank == 0:
    return model
  found = _targets(model, lora_cfg.targets)
  if not found:
    raise ValueError(f"lora.targets {lora_cfg.targets} match no projection of this model")
  for parent, name in found:
    base = getattr(parent, name)
    if isinstance(base, nnx.Linear):
      setattr(parent, name, LoRALinear(base, lora_cfg.rank, lora_cfg.alpha, rngs=rngs))
  return model


def merge(model: nnx.Module) -> nnx.Module:
  """Folds every adapter into its base weight, W <- W + (alpha/r) A B, leaving plain nnx.Linear (in place)."""
  for _, node in list(nnx.iter_graph(model)):
    if not isinstance(node, (Attention, MLP)):
      continue
    for name in ATTENTION_TARGETS + MLP_TARGETS:
      layer = getattr(node, name, None)
      if isinstance(layer, LoRALinear):
        lin = nnx.Linear(layer.in_features, layer.out_features, use_bias=layer.bias is not None, dtype=layer.dtype,
                         param_dtype=layer.param_dtype, kernel_init=nnx.initializers.zeros_init(),
                         rngs=nnx.Rngs(0))
        lin.kernel.set_value(layer.merged_kernel().astype(layer.param_dtype))
        if layer.bias is not None:
          lin.bias.set_value(layer.bias[...])
        setattr(node, name, lin)
  return model


def trainable(lora_cfg: LoRAConfig):
  """The nnx filter of the parameters an optimizer updates: the adapters with LoRA, every parameter without."""
  return nnx.LoRAParam if lora_cfg.rank else nnx.Param


def load_run(run_dir: str | pathlib.Path, step: int | None = None):
  """(model, cfg, tokenizer) of a run, adapters included: `sinkjax.checkpoint.load_run`, which applies LoRA
  itself when the run's lora.rank > 0 (kept here for callers that import it from sinkjax.lora)."""
  from sinkjax import checkpoint  # pylint: disable=import-outside-toplevel
  return checkpoint.load_run(run_dir, step)


# ------------------------------------------------------------------------------------------------------------------
# Eq. 8 with a fixed shared set: importances of the pretrained model
# ------------------------------------------------------------------------------------------------------------------

def head_importance_of(model: nnx.Module, batches) -> np.ndarray:
  """Mean [L, H] head importance (eq. 5) of `model` over `batches` (dicts with inputs, segment_ids, positions)."""
  from sinkjax.model import forward_with_importance  # pylint: disable=import-outside-toplevel

  graphdef, state = nnx.split(model)

  @jax.jit
  def one(state, inputs, segment_ids, positions):
    m = nnx.merge(graphdef, state)
    return forward_with_importance(m, inputs, segment_ids=segment_ids, positions=positions)[1]

  imps = [np.asarray(one(state, jnp.asarray(b["inputs"]), jnp.asarray(b["segment_ids"]), jnp.asarray(b["positions"])))
          for b in batches]
  if not imps:
    raise ValueError("head_importance_of needs at least one batch")
  return np.mean(imps, axis=0)


def shared_heads_of_run(run_dir: str | pathlib.Path, num_shared: int, *, num_batches: int = 4,
                        batch_size: int = 4, data_cfg=None) -> tuple[np.ndarray, np.ndarray]:
  """(importance [L,H], shared mask [L,H] bool: the top-`num_shared` heads of each layer) of a pretrained run,
  measured on `num_batches` validation batches of `data_cfg` (default: the run's own data section)."""
  from sinkjax.balance import shared_head_mask  # pylint: disable=import-outside-toplevel
  from sinkjax.data import make_eval_batches  # pylint: disable=import-outside-toplevel
  model, cfg, tokenizer = load_run(run_dir)
  batches = make_eval_batches(data_cfg or cfg.data, tokenizer, batch_size=batch_size, num_batches=num_batches)
  imp = head_importance_of(model, batches)
  return imp, np.asarray(shared_head_mask(imp, num_shared))


def write_importance(run_dir: str | pathlib.Path, out: str | pathlib.Path, **kw) -> pathlib.Path:
  """Measures a run's head importances and writes {"importance": [[...]]} to `out` (a file that
  loss.shared_heads_from accepts, as it accepts an eval report.json)."""
  import json  # pylint: disable=import-outside-toplevel
  imp, _ = shared_heads_of_run(run_dir, 0, **kw)
  out = pathlib.Path(out)
  out.parent.mkdir(parents=True, exist_ok=True)
  out.write_text(json.dumps({"importance": np.round(imp, 6).tolist(), "source": str(run_dir)}))
  return out
