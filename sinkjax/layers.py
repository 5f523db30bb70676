"""Flax NNX layers: sink-aware multi-head attention and the pieces of the decoder block.

`Attention` is the drop-in layer: q/k/v/o projections, GQA, RoPE, optional QK-norm, and one of the attention
variants of `sinkjax.attention` (chosen by name; this module is the only place that switches on it). Every call
records the per-head importance of its gate (eq. 5) with `nnx.sow` under the name `head_importance`, so a host
model collects them after its forward pass with `pop_head_importance(model)` -> [L, H] and adds
`sinkjax.balance.aux_loss`. Linen users get the same layer from `linen_attention(...)` (via `nnx.bridge`), whose
importances land in the `intermediates` collection.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sinkjax import attention as variants
from sinkjax.balance import head_importance

ATTENTION_VARIANTS = ("vanilla", "sink", "gated", "relu")
GATE_KINDS = ("headwise", "elementwise")


class RMSNorm(nnx.Module):
  """RMSNorm over the last axis; parameter-free by default (the paper's baseline), with an optional scale."""

  def __init__(self, dim: int, *, eps: float = 1e-6, use_scale: bool = False, param_dtype=jnp.float32):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype)) if use_scale else None

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.scale is not None:
      y = y * self.scale[...].astype(jnp.float32)
    return y.astype(x.dtype)


def rope_frequencies(head_dim: int, theta: float):
  return 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))


def apply_rope(x, positions, inv_freq):
  """Rotary embedding, split-halves convention (Llama / nanochat). x [B,T,H,D], positions int [B,T]."""
  angles = positions[..., None].astype(jnp.float32) * inv_freq          # [B,T,D/2]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def default_positions(segment_ids, B: int, T: int):
  """Position within each document (0 at its first token) for packed rows; plain arange without segments."""
  if segment_ids is None:
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  first = variants.document_first_index(segment_ids, T)
  return jnp.arange(T, dtype=jnp.int32)[None, :] - first


class Attention(nnx.Module):
  """Causal multi-head attention with a per-head gate: vanilla, sink (GPT-OSS), gated (Qwen, G1) or ReLU.

  Args:
    attention: "vanilla" | "sink" | "gated" | "relu".
    gate: "headwise" (one gate per head, paper eq. 2) | "elementwise" (one per head dim, Qwen3-Next); gated only.
    sink_init: initial sink logit per head (sink attention).
    gate_bias_init: initial bias of the gate projection (gated attention); sigmoid(0) = 0.5.
    impl: `flash_attention` backend ("auto" picks Pallas on TPU/GPU, blockwise XLA on CPU).
  """

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
               *, attention: str = "vanilla", gate: str = "headwise", qk_norm: bool = True,
               rope_theta: float = 10000.0, use_bias: bool = False, sink_init: float = 0.0,
               gate_bias_init: float = 0.0, impl: str = "auto", dtype=jnp.float32, param_dtype=jnp.float32,
               zero_init_output: bool = True, rngs: nnx.Rngs):
    if attention not in ATTENTION_VARIANTS:
      raise ValueError(f"attention must be one of {ATTENTION_VARIANTS}, got {attention!r}")
    if gate not in GATE_KINDS:
      raise ValueError(f"gate must be one of {GATE_KINDS}, got {gate!r}")
    num_kv_heads = num_kv_heads or num_heads
    head_dim = head_dim or d_model // num_heads
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    self.attention, self.gate_kind, self.impl = attention, gate, impl
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.rope_theta = rope_theta
    lin = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.q_proj = nnx.Linear(d_model, num_heads * head_dim, **lin)
    self.k_proj = nnx.Linear(d_model, num_kv_heads * head_dim, **lin)
    self.v_proj = nnx.Linear(d_model, num_kv_heads * head_dim, **lin)
    out_init = nnx.initializers.zeros_init() if zero_init_output else nnx.initializers.lecun_normal()
    self.o_proj = nnx.Linear(num_heads * head_dim, d_model, kernel_init=out_init, **lin)
    self.q_norm = RMSNorm(head_dim) if qk_norm else None
    self.k_norm = RMSNorm(head_dim) if qk_norm else None
    self.sink = nnx.Param(jnp.full((num_heads,), sink_init, param_dtype)) if attention == "sink" else None
    width = num_heads if gate == "headwise" else num_heads * head_dim
    self.gate_proj = nnx.Linear(d_model, width, use_bias=True, dtype=dtype, param_dtype=param_dtype,
                                bias_init=nnx.initializers.constant(gate_bias_init),
                                rngs=rngs) if attention == "gated" else None

  def project(self, x, positions):
    """q [B,T,Hq,D], k/v [B,T,Hkv,D] with QK-norm and RoPE applied."""
    B, T, _ = x.shape
    q = self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    inv_freq = rope_frequencies(self.head_dim, self.rope_theta)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v

  def attend(self, x, q, k, v, segment_ids):
    """The variant switch: (out [B,T,Hq,D], gate [B,T,Hq] or [B,T,Hq,D])."""
    kw = dict(segment_ids=segment_ids)
    if self.attention == "vanilla":
      return variants.vanilla_attention(q, k, v, impl=self.impl, **kw)
    if self.attention == "sink":
      return variants.sink_attention(q, k, v, self.sink[...], impl=self.impl, **kw)
    if self.attention == "gated":
      B, T, _ = x.shape
      logits = self.gate_proj(x).astype(jnp.float32)
      shape = (B, T, self.num_heads) if self.gate_kind == "headwise" else (B, T, self.num_heads, self.head_dim)
      return variants.gated_attention(q, k, v, logits.reshape(shape), impl=self.impl, **kw)
    return variants.relu_attention(q, k, v, **kw)

  def importance_mask(self, segment_ids, B: int, T: int):
    """Tokens that count for head importance: non-padding, and for vanilla not a document's first token."""
    valid = jnp.ones((B, T), bool) if segment_ids is None else segment_ids != 0
    if self.attention == "vanilla":
      first = variants.document_first_index(segment_ids, T)
      valid &= first != jnp.arange(T)[None, :]
    return valid

  def __call__(self, x, *, segment_ids=None, positions=None):
    B, T, _ = x.shape
    if positions is None:
      positions = default_positions(segment_ids, B, T)
    q, k, v = self.project(x, positions)
    out, gate = self.attend(x, q, k, v, segment_ids)
    self.sow(nnx.Intermediate, "head_importance", head_importance(gate, self.importance_mask(segment_ids, B, T)))
    return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


def pop_head_importance(model: nnx.Module):
  """Removes the importances recorded by every `Attention` layer of `model` during its last forward pass and
  returns them stacked in layer order, [L, H] (the input of `head_imbalance` / `aux_loss`)."""
  imps = []
  for _, node in nnx.iter_graph(model):
    if isinstance(node, Attention) and hasattr(node, "head_importance"):
      imps.append(node.head_importance.get_value()[-1])
      del node.head_importance
  if not imps:
    raise ValueError("no Attention layer recorded head importance; call the model before pop_head_importance")
  return jnp.stack(imps)


def linen_attention(*args, **kwargs):
  """The same `Attention` layer as a Flax Linen module (through `nnx.bridge.to_linen`).

  Use it like any Linen module: `y = linen_attention(d_model, heads, ...)(x, segment_ids=...)` inside a
  `@nn.compact` method; apply the host model with `mutable=["intermediates"]` to read `head_importance`
  (see `collect_linen_importance`).
  """
  return nnx.bridge.to_linen(Attention, *args, **kwargs)


def collect_linen_importance(intermediates) -> jax.Array:
  """[L, H] importances from a Linen `intermediates` collection, in the order the layers were called."""
  found = []

  def visit(tree):
    if isinstance(tree, dict):
      for key, val in tree.items():
        if key == "head_importance":
          found.append(val[-1] if isinstance(val, (tuple, list)) else val)
        else:
          visit(val)

  visit(jax.tree_util.tree_map(lambda x: x, intermediates, is_leaf=lambda x: isinstance(x, tuple)))
  if not found:
    raise ValueError("no head_importance in intermediates; apply the model with mutable=['intermediates']")
  return jnp.stack(found)


class MLP(nnx.Module):
  """ReLU^2 MLP (nanochat baseline) or SwiGLU (Llama/Qwen), no biases."""

  def __init__(self, d_model: int, hidden: int, *, kind: str = "relu2", dtype=jnp.float32,
               param_dtype=jnp.float32, zero_init_output: bool = True, rngs: nnx.Rngs):
    lin = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
    self.kind = kind
    self.up_proj = nnx.Linear(d_model, hidden, **lin)
    self.gate_proj = nnx.Linear(d_model, hidden, **lin) if kind == "swiglu" else None
    out_init = nnx.initializers.zeros_init() if zero_init_output else nnx.initializers.lecun_normal()
    self.down_proj = nnx.Linear(hidden, d_model, kernel_init=out_init, **lin)

  def __call__(self, x):
    h = self.up_proj(x)
    h = jax.nn.silu(self.gate_proj(x)) * h if self.kind == "swiglu" else jnp.square(jax.nn.relu(h))
    return self.down_proj(h)
