"""Gated attention ([GatedAttn]; Qwen3-Next): out = SDPA(q, k, v) * g(z), z = x W + b from the layer's normed input,
headwise or elementwise, with the ablations of layers' "Gating ablations" (position G1 / G2, head-shared, activation,
input-independent logits). Its explicit gate G is the head importance (eq. 2 / 5)."""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
from flax import nnx

from sinkjax import attention as variants
from sinkjax.cache import query_heads, take_heads
from sinkjax.initializers import matrix_init
from sinkjax.kernels import dense
from sinkjax.kinds import AttentionKind, register
from sinkjax.sharding import logical

# The model.* keys only gated attention reads: set on another variant, they are refused (`AttentionKind.options`).
GATE_OPTIONS = ("gate", "gate_position", "gate_shared", "gate_activation", "gate_input", "gate_bias",
                "gate_bias_init")


@dataclasses.dataclass(frozen=True)
class Gate:
  """The gate of gated attention: its shape, where it acts, its activation.

  A static part of the layer (equal in every layer, so blocks still stack for the layer scan). Its parameters stay on
  the `Attention` as `gate_proj` (z = x W + b; W only with model.gate_bias=false, Qwen3-Next) or `gate_logit`
  (input-independent z), the names checkpoints hold. `heads` (Hg): the heads of the gated tensor, query heads at G1
  and KV heads at G2, 1 when head-shared.
  """
  kind: str             # headwise | elementwise
  position: str         # sdpa (G1) | value (G2)
  shared: bool
  activation: str
  dependent: bool       # z = x W + b; else learned logits
  heads: int
  head_dim: int
  group: int            # query heads per KV head

  @classmethod
  def of(cls, cfg) -> Gate:
    """The gate of an `AttentionConfig` (its model.gate* keys and head shapes)."""
    heads = 1 if cfg.gate_shared else cfg.num_heads if cfg.gate_position == "sdpa" else cfg.num_kv_heads
    return cls(cfg.gate, cfg.gate_position, cfg.gate_shared, cfg.gate_activation, cfg.gate_input == "dependent",
               heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads)

  @property
  def shape(self) -> tuple:
    """z per token: (Hg,) headwise, (Hg, D) elementwise."""
    return (self.heads,) if self.kind == "headwise" else (self.heads, self.head_dim)

  def parameters(self, cfg, rngs: nnx.Rngs) -> tuple:
    """(gate_proj, gate_logit), one of them None: the projection d_model -> Hg (x D) with bias gate_bias_init
    (none with model.gate_bias=false), or the learned logits initialized to gate_bias_init ([GatedAttn]: 0), flat
    like that bias (a vector, so the optimizer gives it AdamW at the scalar rate, not Muon)."""
    width, pdt = math.prod(self.shape), jnp.dtype(cfg.param_dtype)
    if not self.dependent:
      return None, nnx.Param(jnp.full((width,), cfg.gate_bias_init, pdt))
    proj = nnx.Linear(cfg.d_model, width, use_bias=cfg.gate_bias, dtype=jnp.dtype(cfg.dtype), param_dtype=pdt,
                      dot_general=dense.dot_general, bias_init=nnx.initializers.constant(cfg.gate_bias_init),
                      rngs=rngs, kernel_metadata=logical("embed", "heads"), **matrix_init(cfg.init, cfg.d_model))
    return proj, None

  def logits(self, gate_proj, gate_logit, x, kv_heads=None):
    """z [B,T,Hg] or [B,T,Hg,D] (float32) for inputs x [B,T,d_model]; an input-independent gate broadcasts its
    logits. With `kv_heads`, only the gate heads of those KV heads (a head-shared gate belongs to all)."""
    B, T, _ = x.shape
    z = gate_proj(x) if gate_proj is not None else jnp.broadcast_to(gate_logit[...], (B, T) + gate_logit.shape)
    z = z.astype(jnp.float32).reshape((B, T) + self.shape)
    if kv_heads is None or self.shared:
      return z
    return take_heads(z, kv_heads if self.position == "value" else query_heads(kv_heads, self.group), 2)

  def attend(self, q, k, v, z, **kw):
    """(out, G) of attention with this gate of logits z; at G2 `v` holds values the layer gated already."""
    if self.position == "value":
      return variants.value_gated_attention(q, k, v, z, activation=self.activation, values_gated=True, **kw)
    return variants.gated_attention(q, k, v, z, activation=self.activation, **kw)


class Gated(AttentionKind):
  name = "gated"
  options = GATE_OPTIONS

  def parameters(self, layer, cfg, rngs):
    layer.gate = Gate.of(cfg)
    layer.gate_proj, layer.gate_logit = layer.gate.parameters(cfg, rngs)

  def values(self, layer, x, v):
    # G2 gates each value where it is made, so KV caches and sink tokens hold gated values; `attend` reports it.
    if layer.gate.position != "value":
      return v
    return variants.apply_gate(v, layer.gate_logits(x), layer.gate.activation)[0]

  def attend(self, layer, x, q, k, v, kw, kv_heads=None):
    return layer.gate.attend(q, k, v, layer.gate_logits(x, kv_heads), **kw)


GATED = register(Gated())
