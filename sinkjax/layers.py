"""Flax NNX layers: sink-aware multi-head attention and the pieces of the decoder block.

`Attention` is the drop-in layer: q/k/v/o projections, GQA, RoPE, optional QK-norm, and one of the attention
variants of `sinkjax.attention` (chosen by name; this module is the only place that switches on it). Every call
records the per-head importance of its gate (eq. 5) with `nnx.sow` under the name `head_importance`, so a host
model collects them after its forward pass with `pop_head_importance(model)` -> [L, H] and adds
`sinkjax.balance.aux_loss`. Linen users get the same layer from `linen_attention(...)` (via `nnx.bridge`), whose
importances land in the `intermediates` collection.

Gating ablations ([GatedAttn] Tables 1 and 4; gated attention only, `Attention(...)` arguments and the same-named
`model.*` config keys). With z = x W + b from the layer's normed input x (the defaults give the G1 gate,
out = SDPA(q, k, v) * sigmoid(z), headwise or elementwise as `gate`):
- gate_position: "sdpa" (G1, the gate of the query token scales the SDPA output) | "value" (G2: each value is gated
  by its own token, v'_j = v_j * g(x_j), before attention; one score per KV head, shape n x k (x dk) in Table 1).
  G2 is applied in `project_unrotated`, so KV caches and sink tokens hold gated values.
- gate_shared: head-shared (Table 1 rows 12-13): W maps to one score per token (headwise) or dk scores (elementwise)
  used by every head, 1/H of the head-specific gate's parameters. (The paper obtains it by averaging a head-specific
  projection over heads, which is the same function class.)
- gate_activation: "sigmoid" | "ns_sigmoid" (y * (0.5 + 0.5 sigmoid(z)), Table 4 row 7) | "silu" (y * SiLU(z),
  Table 1 row 15) | "silu_additive" (y + SiLU(z), Table 1 row 14).
- gate_input: "dependent" | "independent" (Table 4 row 6): z is a learned logit per gate head (and dim), initialized
  to gate_bias_init (the paper: 0), with no projection.
The gate G recorded as head importance (and reported by `sinkjax.eval` as gate_mean) is
`sinkjax.attention.gate_score`: the sigmoid score (0.5 + 0.5 sigmoid for ns_sigmoid); for the SiLU forms sigma(z),
the sigmoid factor of SiLU(z) = z sigma(z), since SiLU has no [0, 1] score of its own. At G2 each query head reports
its KV group's gate of the query token's own value (the gate a token's value carries); a shared gate is the same
for every head, so its importance CV is 0 and the aux loss has nothing to balance.
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax import attention as variants
from sinkjax.choices import (ATTENTION_VARIANTS, GATE_INPUTS, GATE_KINDS, GATE_POSITIONS, INITS, MLP_KINDS,
                             ROPE_STYLES)
from sinkjax.balance import head_importance
from sinkjax.kernels import dense
from sinkjax.kernels.reference import attention_weights as reference_weights
from sinkjax.sharding import logical, target_platform



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


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Long-context RoPE frequency scaling, as Hugging Face's `rope_type` (modeling_rope_utils): "llama3" (Llama 3.1)
  or "yarn" (GPT-OSS, YaRN). `original_max_seq_len` is the pretraining context the correction is relative to."""
  kind: str = "none"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_seq_len: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float = 0.0     # yarn: multiplier of cos/sin; 0 = 0.1 ln(factor) + 1

  def cos_sin_scale(self) -> float:
    if self.kind != "yarn":
      return 1.0
    if self.attention_factor:
      return self.attention_factor
    return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None = None):
  """Inverse frequencies [head_dim/2] of RoPE, optionally rescaled for long context (llama3 / yarn)."""
  inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
  if scaling is None or scaling.kind == "none":
    return inv_freq
  if scaling.kind == "llama3":
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band between interpolated.
    old = scaling.original_max_seq_len
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(medium, smoothed, scaled)
  if scaling.kind == "yarn":
    # YaRN: interpolate (divide by factor) the low frequencies, extrapolate the high ones, linear ramp between.
    def correction_dim(rotations):
      return head_dim * math.log(scaling.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
      high += 0.001
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return inv_freq / scaling.factor * (1 - extrapolation) + inv_freq * extrapolation
  raise ValueError(f"unknown RoPE scaling {scaling.kind!r} (none|llama3|yarn)")


def apply_rope(x, positions, inv_freq, scale: float = 1.0, style: str = "llama"):
  """Rotary embedding, split-halves convention. x [B,T,H,D], positions int [B,T].
  `scale` multiplies cos and sin (YaRN's attention factor).

  style "llama" (Hugging Face): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
  style "nanochat" (nanochat's `apply_rotary_emb`): the opposite rotation, (x1 cos + x2 sin, x2 cos - x1 sin), with
  cos/sin tables rounded to bfloat16 as nanochat keeps them. The two are not interchangeable for trained weights:
  q R(-a) . k R(-b) = q . k R(a - b) while q R(a) . k R(b) = q . k R(b - a).
  """
  angles = positions[..., None].astype(jnp.float32) * inv_freq          # [B,T,D/2]
  cos, sin = _materialized(jnp.cos(angles) * scale, jnp.sin(angles) * scale)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  if style == "nanochat":
    cos, sin = (t.astype(jnp.bfloat16).astype(jnp.float32) for t in (cos, sin))
    sin = -sin
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _materialized(*xs):
  """xs [..., n] as they are (bit for bit: x * 1 + 0 * others), passed through an exact f32 matmul by the identity.

  A matmul is never fused into its consumers, so XLA computes the values once. Without it XLA:CPU fuses the cos/sin
  of RoPE into every consumer, forward and backward, recomputing them per element of q and k (per head and half:
  8x the [B, T, D/2] that are needed; ~6 % of a CPU train step at 4 x 256, T 512, docs/PERF.md). Other platforms
  get xs untouched."""
  if target_platform() != "cpu":
    return xs
  x = jnp.concatenate(xs, axis=-1)
  x = jnp.einsum("...i,ij->...j", x, jnp.eye(x.shape[-1], dtype=x.dtype), precision=jax.lax.Precision.HIGHEST)
  return jnp.split(x, len(xs), axis=-1)


def default_positions(segment_ids, B: int, T: int):
  """Position within each document (0 at its first token) for packed rows; plain arange without segments."""
  if segment_ids is None:
    return jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  first = variants.document_first_index(segment_ids, T)
  return jnp.arange(T, dtype=jnp.int32)[None, :] - first


def matrix_init(init: str, fan_in: int) -> dict:
  """kernel_init for the input-side matrices of a block: nanochat's uniform(-s, s), s = sqrt(3 / fan_in) (std
  1/sqrt(fan_in), no outliers), or flax's default (lecun normal, the same std, truncated) for init="default"."""
  if init == "default":
    return {}
  s = math.sqrt(3.0 / fan_in)
  return {"kernel_init": lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -s, s)}


class Attention(nnx.Module):
  """Causal multi-head attention with a per-head gate: vanilla, sink (GPT-OSS), gated (Qwen, G1) or ReLU.

  Args:
    attention: "vanilla" | "sink" | "gated" | "relu".
    gate: "headwise" (one gate per head, [Sink-MoE] eq. 2) | "elementwise" (one per head dim, Qwen3-Next); gated only.
    sink_init: initial sink logit per head (sink attention).
    gate_bias_init: initial bias of the gate projection (gated attention); sigmoid(0) = 0.5.
    gate_position, gate_shared, gate_activation, gate_input: the gating ablations of [GatedAttn] (gated only; the
      defaults are the G1 gate above; see the module docstring, "Gating ablations").
    impl: `flash_attention` backend ("auto" picks Pallas on TPU/GPU, blockwise XLA on CPU).
    norm_scale, norm_eps: learnable scale and epsilon of the QK-norms (Qwen3: scaled; nanochat: parameter-free).
    rope_style: "llama" (HF sign, QK-norm before RoPE) | "nanochat" (nanochat's rotation sign and bfloat16 tables,
      QK-norm after RoPE; see `apply_rope`).
    init: "default" (flax's lecun-normal kernels) | "nanochat" (q/k/v and gate projections uniform with std
      1/sqrt(d_model), as nanochat's `init_weights`); output projections start at zero either way.
    rope_scaling: a `RopeScaling` (llama3 / yarn long-context frequencies), None = plain RoPE.
    sliding_window: > 0 makes this a sliding-window layer: query t sees keys t - window < s <= t (GPT-OSS).
    sink_tokens: n learnable sink tokens ([StreamingLLM]): n d_model vectors `sink_states` of this layer, projected by
      its own k_proj/v_proj (and k_norm), prepended to the keys/values at RoPE positions 0..n-1 while the sequence
      is shifted to positions n, n+1, ...; every query sees them (all packed segments, all cache slots) and a
      streaming KV cache never evicts them (they are parameters, not cache entries). Not for ReLU attention.
  """

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None,
               *, attention: str = "vanilla", gate: str = "headwise", qk_norm: bool = True,
               gate_position: str = "sdpa", gate_shared: bool = False, gate_activation: str = "sigmoid",
               gate_input: str = "dependent",
               rope_theta: float = 10000.0, use_bias: bool = False, sink_init: float = 0.0,
               gate_bias_init: float = 0.0, impl: str = "auto", dtype=jnp.float32, param_dtype=jnp.float32,
               zero_init_output: bool = True, sink_tokens: int = 0, norm_scale: bool = False,
               norm_eps: float = 1e-6, rope_scaling: RopeScaling | None = None, sliding_window: int = 0,
               rope_style: str = "llama", init: str = "default", rngs: nnx.Rngs):
    if attention not in ATTENTION_VARIANTS:
      raise ValueError(f"attention must be one of {ATTENTION_VARIANTS}, got {attention!r}")
    if gate not in GATE_KINDS:
      raise ValueError(f"gate must be one of {GATE_KINDS}, got {gate!r}")
    for name, val, allowed in (("gate_position", gate_position, GATE_POSITIONS),
                               ("gate_activation", gate_activation, variants.GATE_ACTIVATIONS),
                               ("gate_input", gate_input, GATE_INPUTS)):
      if val not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {val!r}")
    self.gate_position, self.gate_shared = gate_position, gate_shared
    self.gate_activation, self.gate_input = gate_activation, gate_input
    num_kv_heads = num_kv_heads or num_heads
    head_dim = head_dim or d_model // num_heads
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    if rope_style not in ROPE_STYLES or init not in INITS:
      raise ValueError(f"rope_style must be one of {ROPE_STYLES} and init one of {INITS}, got {rope_style!r}, "
                       f"{init!r}")
    self.rope_style = rope_style
    self.attention, self.gate_kind, self.impl = attention, gate, impl
    self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
    self.rope_theta = rope_theta
    self.rope_scaling = rope_scaling
    if sliding_window and attention == "relu":
      raise ValueError("sliding_window needs a softmax variant (vanilla, sink or gated), got 'relu'")
    self.sliding_window = sliding_window
    lin = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, dot_general=dense.dot_general, rngs=rngs)
    def proj(n_in, n_out, axes, **kw):
      return nnx.Linear(n_in, n_out, kernel_metadata=logical(*axes), **lin, **kw)
    self.q_proj = proj(d_model, num_heads * head_dim, ("embed", "q_heads"), **matrix_init(init, d_model))
    self.k_proj = proj(d_model, num_kv_heads * head_dim, ("embed", "kv_heads"), **matrix_init(init, d_model))
    self.v_proj = proj(d_model, num_kv_heads * head_dim, ("embed", "kv_heads"), **matrix_init(init, d_model))
    out_init = nnx.initializers.zeros_init() if zero_init_output else nnx.initializers.lecun_normal()
    self.o_proj = proj(num_heads * head_dim, d_model, ("q_heads", "embed"), kernel_init=out_init)
    norm = dict(eps=norm_eps, use_scale=norm_scale, param_dtype=param_dtype)
    self.q_norm = RMSNorm(head_dim, **norm) if qk_norm else None
    self.k_norm = RMSNorm(head_dim, **norm) if qk_norm else None
    self.sink = nnx.Param(jnp.full((num_heads,), sink_init, param_dtype)) if attention == "sink" else None
    # Gate heads Hg: the heads of the gated tensor (query heads at G1, KV heads at G2), 1 when head-shared.
    self.gate_heads = 1 if gate_shared else (num_heads if gate_position == "sdpa" else num_kv_heads)
    width = self.gate_heads * (1 if gate == "headwise" else head_dim)
    dependent = attention == "gated" and gate_input == "dependent"
    self.gate_proj = nnx.Linear(d_model, width, use_bias=True, dtype=dtype, param_dtype=param_dtype,
                                dot_general=dense.dot_general, bias_init=nnx.initializers.constant(gate_bias_init),
                                rngs=rngs,
                                kernel_metadata=logical("embed", "heads"),
                                **matrix_init(init, d_model)) if dependent else None
    # Input-independent gate: learned logits, flat [width] like gate_proj's bias (a vector, so the optimizer gives it
    # AdamW at the scalar rate, not Muon).
    self.gate_logit = nnx.Param(jnp.full((width,), gate_bias_init, param_dtype)
                                ) if attention == "gated" and not dependent else None
    if sink_tokens < 0 or (sink_tokens and attention == "relu"):
      raise ValueError(f"sink_tokens must be >= 0 and needs a softmax variant (got {sink_tokens}, {attention!r})")
    self.num_sink_tokens = sink_tokens
    self.sink_states = nnx.Param(0.02 * jax.random.normal(rngs.params(), (sink_tokens, d_model), param_dtype),
                                 **logical(None, "embed")) if sink_tokens else None

  def project(self, x, positions):
    """q [B,T,Hq,D], k/v [B,T,Hkv,D] with QK-norm and RoPE applied; `positions` are document positions (0 at a
    document's first token), shifted here by the number of sink tokens, which hold positions 0..n-1."""
    q, k, v = self.project_unrotated(x)
    positions = positions + self.num_sink_tokens
    return self.rotate(q, positions, "q"), self.rotate(k, positions, "k"), v

  def project_unrotated(self, x):
    """q, k, v before RoPE (what a KV cache stores, see `sinkjax.cache`); QK-norm applied here unless it comes after
    RoPE (rope_style "nanochat"), in which case `rotate` applies it."""
    B, T, _ = x.shape
    q = self.q_proj(x).reshape(B, T, self.num_heads, self.head_dim)
    k = self.k_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(B, T, self.num_kv_heads, self.head_dim)
    if self.attention == "gated" and self.gate_position == "value":
      # G2 gates each value where it is made, so KV caches and sink tokens hold gated values; `attend` reports it.
      v, _ = variants.apply_gate(v, self.gate_logits(x), self.gate_activation)
    if self.q_norm is not None and self.rope_style != "nanochat":
      q, k = self.q_norm(q), self.k_norm(k)
    return q, k, v

  def rotate(self, x, positions, which: str):
    """RoPE at int positions [B,T] of queries (which="q") or keys ("k"), then their QK-norm where it follows RoPE
    (the one place this layer's rotary settings apply)."""
    scaling = self.rope_scaling
    y = apply_rope(x, positions, rope_frequencies(self.head_dim, self.rope_theta, scaling),
                   1.0 if scaling is None else scaling.cos_sin_scale(), self.rope_style)
    if self.q_norm is not None and self.rope_style == "nanochat":
      y = (self.q_norm if which == "q" else self.k_norm)(y)
    return y

  def sink_kv(self, B: int, kv_heads=None):
    """Keys/values of the learnable sink tokens, ([B,n,Hkv,D] rotated to positions 0..n-1, [B,n,Hkv,D]), or None;
    only the KV heads `kv_heads` (a tuple of indices) when given."""
    if self.sink_states is None:
      return None
    n = self.num_sink_tokens
    _, k, v = self.project_unrotated(self.sink_states[...][None])
    k = self.rotate(k, jnp.arange(n, dtype=jnp.int32)[None], "k")
    k, v = (_take_heads(a, kv_heads, 2) for a in (k, v))
    return tuple(jnp.broadcast_to(a, (B,) + a.shape[1:]) for a in (k, v))

  def gate_logits(self, x, kv_heads=None):
    """Gate logits z (gated attention) for inputs x [B,T,d_model]: [B,T,Hg] (headwise) or [B,T,Hg,D] (elementwise),
    Hg = `gate_heads`; an input-independent gate broadcasts its learned logits over B and T. With `kv_heads`, only
    the gate heads that belong to those KV heads (a head-shared gate belongs to all)."""
    B, T, _ = x.shape
    if self.gate_proj is not None:
      z = self.gate_proj(x)
    else:
      z = jnp.broadcast_to(self.gate_logit[...], (B, T) + self.gate_logit.shape)
    shape = (B, T, self.gate_heads) + (() if self.gate_kind == "headwise" else (self.head_dim,))
    z = z.astype(jnp.float32).reshape(shape)
    if kv_heads is None or self.gate_shared:
      return z
    return _take_heads(z, self.query_heads(kv_heads) if self.gate_position == "sdpa" else kv_heads, 2)

  def query_heads(self, kv_heads):
    """The query heads that read the KV heads `kv_heads` (GQA: query head i reads KV head i // (Hq / Hkv))."""
    group = self.num_heads // self.num_kv_heads
    return tuple(h * group + i for h in kv_heads for i in range(group))

  def attend(self, x, q, k, v, segment_ids, *, impl=None, slide=True, kv_heads=None):
    """The variant switch: (out [B,T,Hq,D], gate [B,T,Hq] or [B,T,Hq,D]). Sink tokens join every variant here.
    slide=False leaves out the sliding window (the KV-cache decode step applies it by cache position instead).
    kv_heads: q, k, v hold only these KV heads (a tuple of indices) and their query heads, and so do the per-head
    parameters used here (a head group of a `sinkjax.cache.HybridKVCache`); None = every head."""
    impl = impl or self.impl
    kw = dict(segment_ids=segment_ids)
    if self.sliding_window and slide:
      kw["window"] = self.sliding_window
    if self.sink_states is not None:
      kw["prefix"] = self.sink_kv(x.shape[0], kv_heads)
    if self.attention == "vanilla":
      return variants.vanilla_attention(q, k, v, impl=impl, **kw)
    if self.attention == "sink":
      sink = _take_heads(self.sink[...], None if kv_heads is None else self.query_heads(kv_heads), 0)
      return variants.sink_attention(q, k, v, sink, impl=impl, **kw)
    if self.attention == "gated":
      gate_kw = dict(activation=self.gate_activation, impl=impl, **kw)
      if self.gate_position == "value":                  # G2: v was gated in project_unrotated
        return variants.value_gated_attention(q, k, v, self.gate_logits(x, kv_heads), values_gated=True, **gate_kw)
      return variants.gated_attention(q, k, v, self.gate_logits(x, kv_heads), **gate_kw)
    return variants.relu_attention(q, k, v, **kw)

  def importance_mask(self, segment_ids, B: int, T: int):
    """Tokens that count for head importance: non-padding, and for vanilla not a document's first token (the row's
    first token under data.packing=stream, whose rows are one segment), unless there are sink tokens: the gate's
    "first token" is then sink token 0, so no query has G = 0 by construction."""
    valid = jnp.ones((B, T), bool) if segment_ids is None else segment_ids != 0
    if self.attention == "vanilla" and self.sink_states is None:
      first = variants.document_first_index(segment_ids, T)
      valid &= first != jnp.arange(T)[None, :]
    return valid

  def __call__(self, x, *, segment_ids=None, positions=None, cache=None, record: bool = False,
               zero_first_value=None):
    """y [B,T,d_model]; with `cache` (a `sinkjax.cache.LayerCache`) returns (y, updated cache) instead: T == 1
    decodes one token against the cache, T > 1 prefills an empty cache (plain causal self-attention over x).

    For `sinkjax.analysis` (the one forward pass: analysis never re-implements it):
      record: also sow `trace`, a dict of what this layer attended with: q, k, v (rotated, as attended; K/V repeated
        to the query heads when values are zeroed), gate, and its materialized attention weights
        (`attention_weights`: the weights on the sequence keys and the weight outside them).
      zero_first_value: bool [Hq]; zero the value vector of every document's first token (a row's first token
        without segment ids) in those query heads before attention ([Sink-MoE] App. A, value zeroing).
    """
    B, T, _ = x.shape
    if cache is not None and T == 1:
      return self._decode(x, cache)
    if positions is None:
      positions = default_positions(segment_ids, B, T)
    q0, k0, v = self.project_unrotated(x)
    positions = positions + self.num_sink_tokens           # sink tokens hold positions 0..n-1
    q, k = self.rotate(q0, positions, "q"), self.rotate(k0, positions, "k")
    if zero_first_value is not None:
      k, v = self.zero_first_values(k, v, segment_ids, zero_first_value)
    out, gate = self.attend(x, q, k, v, segment_ids)
    y = self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))
    if cache is not None:
      return y, cache.prefill(k0, v)
    keep_last = dict(reduce_fn=lambda _, new: new, init_fn=lambda: None)
    if record:
      weights, outside = self.attention_weights(q, k, segment_ids)
      self.sow(nnx.Intermediate, "trace", dict(q=q, k=k, v=v, gate=gate, weights=weights, outside=outside),
               **keep_last)
    # Each call replaces the previous record (instead of sow's default of appending to a tuple), so a model that is
    # called repeatedly without popping keeps a fixed graph: no growth and no re-tracing under nnx.jit.
    self.sow(nnx.Intermediate, "head_importance", head_importance(gate, self.importance_mask(segment_ids, B, T)),
             **keep_last)
    return y

  def zero_first_values(self, k, v, segment_ids, heads):
    """(k, v) repeated to the Hq query heads (so one head of a GQA group can be zeroed alone; repeating K/V does not
    change attention) with v zeroed at every document's first token in the query heads where `heads` [Hq]."""
    B, T = v.shape[:2]
    rep = self.num_heads // self.num_kv_heads
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
    starts = variants.document_first_index(segment_ids, T) == jnp.arange(T)[None, :]
    if segment_ids is not None:
      starts &= segment_ids != 0
    kill = starts[:, :, None, None] & jnp.asarray(heads, bool)[None, None, :, None]
    return k, jnp.where(kill, jnp.zeros_like(v), v)

  def attention_weights(self, q, k, segment_ids):
    """This layer's attention weights, materialized, in the softmax it actually uses: (A [B,Hq,T,T] on the
    sequence keys, the weight outside them [B,T,Hq]: on the sink logit (sink attention, a column with zero value,
    GPT-OSS) plus on the learnable sink tokens). Sliding windows apply; gated attention gives the softmax before
    its output gate; ReLU attention its ReLU weights. Padding queries are all zero."""
    B, T, Hq, D = q.shape
    seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else jnp.broadcast_to(segment_ids, (B, T))
    if self.attention == "relu":
      return variants.relu_attention_weights(q, k, segment_ids=seg), jnp.zeros((B, T, Hq), jnp.float32)
    scale = 1.0 / math.sqrt(D)
    logits, mask, _, _ = reference_weights(q, k, seg, seg, causal=True, scale=scale,
                                           window=self.sliding_window or None)
    columns = [jnp.where(mask[:, None], logits, -jnp.inf)]                          # [B,Hq,T,T]
    if self.sink_states is not None:
      k_p = jnp.repeat(self.sink_kv(B)[0], Hq // k.shape[2], axis=2)
      columns.append(jnp.einsum("bthd,bnhd->bhtn", q.astype(jnp.float32), k_p.astype(jnp.float32),
                                precision=jax.lax.Precision.HIGHEST) * scale)
    if self.attention == "sink":
      columns.append(jnp.broadcast_to(self.sink[...].astype(jnp.float32)[None, :, None, None], (B, Hq, T, 1)))
    z = jnp.concatenate(columns, axis=-1)
    valid = (seg != 0)[:, None, :, None]
    p = jax.nn.softmax(jnp.where(valid, z, 0.0), axis=-1) * valid
    return p[..., :T], jnp.swapaxes(p[..., T:].sum(-1), 1, 2)

  def _decode(self, x, cache):
    """One new token: store its un-rotated k/v in the cache and attend each head group of the cache (one for a
    `LayerCache`; full and streaming heads of a `SplitLayerCache`) with that group's positions; heads back in order."""
    B = x.shape[0]
    q, k, v = self.project_unrotated(x)
    cache = cache.write(k, v)
    groups = cache.groups()
    outs = [self._attend_cached(x, q, view, kv_heads) for kv_heads, view in groups]
    if len(groups) == 1 and groups[0][0] is None:
      out = outs[0]
    else:                                   # query heads of the groups, concatenated -> layer order
      order = [i for kv_heads, _ in groups for i in self.query_heads(kv_heads or range(self.num_kv_heads))]
      out = jnp.take(jnp.concatenate(outs, axis=2), jnp.asarray(np.argsort(order)), axis=2)
    return self.o_proj(out.reshape(B, 1, self.num_heads * self.head_dim)), cache

  def _attend_cached(self, x, q, cache, kv_heads):
    """Attention of the new token's queries [B,1,Hq,D] (un-rotated) over one cache group's KV heads `kv_heads` (None
    = all): every cached key rotated to its position within that cache (true positions in a full cache;
    StreamingLLM's shifted positions in a sink + window ring), the query to the newest position, the whole
    fixed-size cache attended with empty slots masked by kv segment 0."""
    B = x.shape[0]
    n, C = self.num_sink_tokens, cache.capacity
    q = _take_heads(q, None if kv_heads is None else self.query_heads(kv_heads), 2)
    q = self.rotate(q, jnp.full((B, 1), cache.query_position + n, jnp.int32), "q")
    k_all = self.rotate(cache.k, jnp.broadcast_to(cache.key_positions + n, (B, C)), "k")
    visible = cache.valid
    if self.sliding_window:                 # slots are not in age order once a streaming ring wraps
      visible &= cache.key_positions > cache.query_position - self.sliding_window
    seg = (jnp.ones((B, 1), jnp.int32), jnp.broadcast_to(visible, (B, C)).astype(jnp.int32))
    out, _ = self.attend(x, q, k_all, cache.v, seg, impl="reference", slide=False,   # T = 1: [C]-wide softmax
                         kv_heads=kv_heads)
    return out


def _take_heads(a, heads, axis: int):
  """a restricted to the heads `heads` (a tuple of indices) along `axis`; a itself for None."""
  return a if heads is None else jnp.take(a, jnp.asarray(heads, jnp.int32), axis=axis)


def pop_head_importance(model: nnx.Module):
  """Removes the importances recorded by every `Attention` layer of `model` during its last forward pass and
  returns them stacked in layer order, [L, H] (the input of `head_imbalance` / `aux_loss`)."""
  imps = []
  for _, node in nnx.iter_graph(model):
    if isinstance(node, Attention) and hasattr(node, "head_importance"):
      imps.append(node.head_importance.get_value())
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


def mlp_activation(kind: str, gate, up, *, limit: float = 7.0, alpha: float = 1.702):
  """The MLP nonlinearity on the up (and gate) projections.

  relu2: ReLU(up)^2 (nanochat; no gate). swiglu: SiLU(gate) * up (Llama, Qwen).
  clamped_swiglu (GPT-OSS experts): gate <= limit, -limit <= up <= limit, then gate * sigmoid(alpha gate) * (up + 1).
  """
  if kind == "relu2":
    return jnp.square(jax.nn.relu(up))
  if kind == "swiglu":
    return jax.nn.silu(gate) * up
  if kind == "clamped_swiglu":
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return gate * jax.nn.sigmoid(gate * alpha) * (up + 1)
  raise ValueError(f"MLP kind must be one of {MLP_KINDS}, got {kind!r}")


class MLP(nnx.Module):
  """ReLU^2 MLP (nanochat baseline), SwiGLU (Llama/Qwen) or clamped SwiGLU (GPT-OSS); biases optional."""

  def __init__(self, d_model: int, hidden: int, *, kind: str = "relu2", use_bias: bool = False,
               limit: float = 7.0, alpha: float = 1.702, dtype=jnp.float32, param_dtype=jnp.float32,
               zero_init_output: bool = True, init: str = "default", rngs: nnx.Rngs):
    if kind not in MLP_KINDS:
      raise ValueError(f"MLP kind must be one of {MLP_KINDS}, got {kind!r}")
    lin = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype, dot_general=dense.dot_general, rngs=rngs)
    self.kind, self.limit, self.alpha = kind, limit, alpha
    into = dict(kernel_metadata=logical("embed", "mlp"), **lin, **matrix_init(init, d_model))
    self.up_proj = nnx.Linear(d_model, hidden, **into)
    self.gate_proj = nnx.Linear(d_model, hidden, **into) if kind != "relu2" else None
    out_init = nnx.initializers.zeros_init() if zero_init_output else nnx.initializers.lecun_normal()
    self.down_proj = nnx.Linear(hidden, d_model, kernel_init=out_init, kernel_metadata=logical("mlp", "embed"), **lin)

  def __call__(self, x):
    gate = self.gate_proj(x) if self.gate_proj is not None else None
    return self.down_proj(mlp_activation(self.kind, gate, self.up_proj(x), limit=self.limit, alpha=self.alpha))


class MoE(nnx.Module):
  """Top-k routed mixture of MLP experts (GPT-OSS): router logits -> top-k -> softmax over the k -> weighted sum.

  Expert weights are stacked [E, ...]; tokens are sorted by expert and run through `jax.lax.ragged_dot`, so the
  compute is that of the k chosen experts per token (not all E).
  """

  def __init__(self, d_model: int, hidden: int, num_experts: int, top_k: int, *, kind: str = "clamped_swiglu",
               use_bias: bool = True, limit: float = 7.0, alpha: float = 1.702, dtype=jnp.float32,
               param_dtype=jnp.float32, zero_init_output: bool = True, rngs: nnx.Rngs):
    if kind == "relu2":
      raise ValueError("MoE experts need a gated kind (swiglu | clamped_swiglu)")
    self.kind, self.limit, self.alpha, self.top_k, self.dtype = kind, limit, alpha, top_k, dtype
    self.router = nnx.Linear(d_model, num_experts, use_bias=True, dtype=jnp.float32, param_dtype=param_dtype,
                             kernel_metadata=logical("embed", None),
                             rngs=rngs)
    init = nnx.initializers.lecun_normal(in_axis=1, out_axis=2, batch_axis=(0,))
    E = num_experts
    expert_in = logical("expert", "embed", "mlp")
    self.gate_kernel = nnx.Param(init(rngs.params(), (E, d_model, hidden), param_dtype), **expert_in)
    self.up_kernel = nnx.Param(init(rngs.params(), (E, d_model, hidden), param_dtype), **expert_in)
    down = jnp.zeros((E, hidden, d_model), param_dtype) if zero_init_output else \
        init(rngs.params(), (E, hidden, d_model), param_dtype)
    self.down_kernel = nnx.Param(down, **logical("expert", "mlp", "embed"))
    zeros = lambda n: nnx.Param(jnp.zeros((E, n), param_dtype)) if use_bias else None
    self.gate_bias, self.up_bias, self.down_bias = zeros(hidden), zeros(hidden), zeros(d_model)

  def __call__(self, x):
    B, T, D = x.shape
    xf = x.reshape(B * T, D)
    logits = self.router(xf.astype(jnp.float32))                          # [N, E]
    top_logits, experts = jax.lax.top_k(logits, self.top_k)               # [N, k]
    weights = jax.nn.softmax(top_logits, axis=-1)
    flat = experts.reshape(-1)                                            # [N*k], token-major
    order = jnp.argsort(flat, stable=True)
    expert_of_row = flat[order]
    token_of_row = order // self.top_k
    sizes = jnp.bincount(flat, length=self.gate_kernel.shape[0]).astype(jnp.int32)
    dt = self.dtype
    rows = xf[token_of_row].astype(dt)

    def proj(h, kernel, bias):
      y = jax.lax.ragged_dot(h, kernel[...].astype(dt), sizes, preferred_element_type=jnp.float32)
      return y if bias is None else y + bias[...][expert_of_row].astype(jnp.float32)

    h = mlp_activation(self.kind, proj(rows, self.gate_kernel, self.gate_bias),
                       proj(rows, self.up_kernel, self.up_bias), limit=self.limit, alpha=self.alpha)
    y = proj(h.astype(dt), self.down_kernel, self.down_bias) * weights.reshape(-1)[order][:, None]
    out = jnp.zeros((B * T, D), jnp.float32).at[token_of_row].add(y)
    return out.reshape(B, T, D).astype(x.dtype)
