"""LoRA fine-tuning (Hu et al. 2021; [Sink-MoE] §5 fine-tunes Llama 3 / Qwen3 with rank 16 and eq. 8).

    model = lora.apply(model, cfg.lora, rngs)           # targeted projections become LoRALinear (base frozen)
    opt = nnx.Optimizer(model, tx, wrt=lora.trainable(cfg.lora))   # the optimizer only sees the adapters
    model = lora.merge(model)                            # W + (alpha/r) A B, plain nnx.Linear again (export)

A `LoRALinear` keeps the base `kernel` / `bias` under the same names as the `nnx.Linear` it replaces (so a base
checkpoint's paths are unchanged) and adds `lora_a` [in, r] and `lora_b` [r, out] as `nnx.LoRAParam` (B starts at
zero, so the adapted model starts equal to the base). Targets name projections: q_proj/k_proj/v_proj/o_proj of
`Attention`, gate_proj/up_proj/down_proj of a dense `MLP` (MoE experts and routers are not adapted; the gate
projection of gated attention is not an MLP projection and is not adapted either).

Adapters only: loading runs and measuring a run's importances for eq. 8 live in `sinkjax.run`.
"""
from __future__ import annotations

import jax.numpy as jnp
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
    # Adapters are float32 even over a bfloat16 base (what the optimizer updates stays exact; they are small).
    init = nnx.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")
    adapter_dtype = jnp.promote_types(base.param_dtype, jnp.float32)
    self.lora_a = nnx.LoRAParam(init(rngs.params(), (self.in_features, rank), adapter_dtype))
    self.lora_b = nnx.LoRAParam(jnp.zeros((rank, self.out_features), adapter_dtype))

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
