"""Flax NNX layers: sink-aware multi-head attention and the pieces of the decoder block.

`Attention` is the drop-in layer: q/k/v/o projections, GQA, RoPE, optional QK-norm, and one of the attention
variants of `sinkjax.attention`, the registered kind `model.attention` names (`sinkjax.kinds`: this module imports the
built-in ones, vanilla, sink, gated and relu, so they register; nothing switches on a kind's name), built from its
named keywords (the model.* keys of the same names) or, as the model builds it, from an `AttentionConfig` (a view of
the model config, checked once: `Attention.from_config`). Every call
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

import functools
import inspect
import math

import jax
from jax.ad_checkpoint import checkpoint_name
import jax.numpy as jnp
from flax import nnx

from sinkjax import attention as variants
from sinkjax import cache as cache_lib
from sinkjax import kinds
from sinkjax.balance import head_importance
from sinkjax.cache import take_heads
from sinkjax.kinds import gated, relu, sink, vanilla  # noqa: F401  (the built-in variants this layer runs register)
from sinkjax.kinds.gated import Gate  # noqa: F401  (re-exported: layers.Gate)
from sinkjax.choices import MLP_KINDS, MOE_ROUTERS
from sinkjax.config import AttentionConfig, RopeScaling  # noqa: F401  (RopeScaling re-exported for layer users)
from sinkjax.initializers import matrix_init
from sinkjax.kernels import dense
from sinkjax.kernels.reference import attention_weights as reference_weights
from sinkjax.sharding import logical, per_batch_shard, target_platform



def named_signature(cls):
  """Class decorator: `inspect.signature(cls)` (and so `help`, IDEs) shows `cls.__init__`'s arguments. An
  nnx.Module's metaclass defines `__call__(*args, **kwargs)`, which `inspect` would report instead."""
  init = inspect.signature(cls.__init__)
  cls.__signature__ = init.replace(parameters=list(init.parameters.values())[1:])
  return cls


@named_signature
class RMSNorm(nnx.Module):
  """RMSNorm over the last axis: y = x / sqrt(mean(x^2) + eps) (* scale), computed in float32, returned in x's dtype.

  dim: the normalized (last) axis' size. eps: added to the mean square. use_scale: a learnable scale [dim] (init
  1; Hugging Face's Llama / Qwen); off = parameter-free, the paper's baseline. param_dtype: the scale's dtype.
  """

  def __init__(self, dim: int, *, eps: float = 1e-6, use_scale: bool = False, param_dtype=jnp.float32):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype)) if use_scale else None

  def __call__(self, x):
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
    if self.scale is not None:
      y = y * self.scale[...].astype(jnp.float32)
    return y.astype(x.dtype)


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
  if style == "nanochat":
    cos, sin = (t.astype(jnp.bfloat16).astype(jnp.float32) for t in (cos, sin))
    sin = -sin
  # In x's dtype, tables cast to it, as both references rotate (HF's `q * cos + rotate_half(q) * sin` after
  # `cos.to(q.dtype)`, nanochat's bfloat16 tables on bfloat16 q/k). In float32 a bfloat16 q and k would make XLA:TPU
  # write a float32 copy of each beside the projection (docs/TPU.md, issue 49).
  cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
  x1, x2 = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


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


@named_signature
class Attention(nnx.Module):
  """Causal multi-head self-attention with a per-head gate G, as one Flax NNX layer: x [B,T,d_model] -> y [B,T,d_model].

  y = o_proj(attention(RoPE(q_norm(x W_q)), RoPE(k_norm(x W_k)), x W_v)) with the variant `attention` names:
  "vanilla" (softmax; implicit gate G = 1 - A[t, first key], [Sink-MoE] eq. 4), "sink" (GPT-OSS: a learned logit per
  head joins the softmax with a zero value; G = sigmoid(LSE - sink), eq. 23), "gated" (Qwen, [GatedAttn] G1:
  out = SDPA * sigmoid(x W_g + b); G = the sigmoid, eq. 2) or "relu" ([SinkNecessary]'s ReLU attention). Every call
  records G averaged over the valid tokens, the head importance Imp [H] of eq. 5, with `nnx.sow` under
  `head_importance`: after your model's forward pass `pop_head_importance(model)` -> [L, H], the input of
  `sinkjax.balance.aux_loss` (eq. 7 / 8).

  What a call does (`__call__(x, *, segment_ids=None, positions=None, ...)`):
  - Always causal: query t sees keys 0..t only (and only those of its own segment when `segment_ids` [B,T] int are
    given: packed documents, id 0 = padding, whose rows output 0). There is no non-causal mode.
  - Applies RoPE itself, at `positions` [B,T] int: by default each token's position within its segment (0 at a
    segment's first token), or 0..T-1 without segment_ids. Pass `positions=` for anything else (e.g. a row cut from
    the middle of a document). Do not rotate q/k yourself.
  - Attention runs in the flash kernel `sinkjax.kernels.flash_attention` (no T x T weights are materialized); the
    gate's gradient flows through the kernel's log-sum-exp.

  Arguments (the same names as the model.* config keys, docs/TRAINING.md; `from_config` builds one from a model's):
    d_model, num_heads: the width of x and the number of query heads Hq.
    num_kv_heads: key/value heads (GQA; a divisor of num_heads); None = num_heads.
    head_dim: per-head width D; None = d_model // num_heads.
    attention: "vanilla" | "sink" | "gated" | "relu" (above).
    attn_impl: the kernel backend: "auto" (pallas_tpu on TPU, pallas_gpu or cudnn on NVIDIA GPUs, xla elsewhere) |
      "reference" (materialized, the oracle) | "xla" (blockwise, O(T x block) memory) | "pallas_tpu" |
      "pallas_gpu" | "cudnn" (docs/KERNEL.md).
    gate: gated attention's gate shape: "headwise" (one score per head and token, [Sink-MoE] eq. 2; the default) |
      "elementwise" (one per head dimension, Qwen3-Next; importance averages it over the dimension).
    gate_position, gate_shared, gate_activation, gate_input, gate_bias: [GatedAttn]'s ablations, gated attention
      only (this module's docstring, "Gating ablations"): "sdpa" (G1) | "value" (G2); one gate shared by all heads;
      "sigmoid" | "ns_sigmoid" | "silu" | "silu_additive"; "dependent" (z = x W + b) | "independent" (a learned
      logit); whether z = x W has the bias b.
    gate_bias_init: initial b of the gate (gated attention): 0 starts every gate at sigmoid(0) = 0.5.
    sink_init: initial sink logit of every head (sink attention).
    sink_tokens: n > 0 prepends n learnable sink tokens ([StreamingLLM]) to the keys of every query (any variant but
      relu); the sequence's RoPE positions then start at n.
    qk_norm: RMSNorm on each head's q and k (before RoPE; after it with rope_style "nanochat").
    norm_scale, norm_eps: the QK-norms' learnable scale (off: parameter-free, the paper's) and epsilon.
    rope_theta: RoPE's base. rope_style: "llama" (Hugging Face's rotation) | "nanochat" (the opposite sign, bfloat16
      tables, QK-norm after RoPE). rope_partial: the fraction of head dims rotated (the first ones).
    rope: a `RopeScaling` (llama3 / yarn long-context frequencies); None = plain RoPE.
    sliding_window: > 0: each query sees only its last sliding_window keys (itself included); 0 = all.
    attn_bias, attn_out_bias: biases on q/k/v/o_proj (attn_out_bias: o_proj's too when attn_bias).
    init: "default" | "nanochat" (q/k/v weights uniform with std 1/sqrt(d_model)).
    zero_init_output: o_proj starts at zero (nanochat's init: a residual block starts as the identity).
    dtype, param_dtype: compute and parameter dtypes ("float32" | "bfloat16" | "float16", or a jnp dtype).
    rngs: `nnx.Rngs` for the initial weights.
  A bad value is a one-line `sinkjax.config.ConfigError` in these words ("Attention(attention=...) must be one of
  vanilla|sink|gated|relu, got 'x'"); an unknown keyword a TypeError.

  Parameters: q/k/v/o_proj, q_norm/k_norm (qk_norm), `sink` [Hq] (sink attention), `gate_proj` or `gate_logit`
  (gated attention, see `Gate`) and `sink_states` [n, d_model]: n sink tokens projected by this layer's k_proj/v_proj
  (and k_norm), prepended to the keys/values at RoPE positions 0..n-1 while the sequence moves to n, n+1, ...; every
  query sees them (all packed segments, all cache slots) and a streaming KV cache never evicts them. Decoding with a
  KV cache is `sinkjax.cache.decode`. Linen: `linen_attention(...)` takes the same arguments.
  """

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None, *,
               attention: str = "vanilla", attn_impl: str = "auto",
               gate: str = "headwise", gate_position: str = "sdpa", gate_shared: bool = False,
               gate_activation: str = "sigmoid", gate_input: str = "dependent", gate_bias: bool = True,
               gate_bias_init: float = 0.0, sink_init: float = 0.0, sink_tokens: int = 0,
               qk_norm: bool = True, norm_scale: bool = False, norm_eps: float = 1e-6,
               rope_theta: float = 10000.0, rope_style: str = "llama", rope_partial: float = 1.0,
               rope: RopeScaling | None = None, sliding_window: int = 0,
               attn_bias: bool = False, attn_out_bias: bool = True, init: str = "default",
               zero_init_output: bool = True, dtype: str | jnp.dtype = "float32",
               param_dtype: str | jnp.dtype = "float32", rngs: nnx.Rngs):
    keys = {name: value for name, value in locals().items() if name in AttentionConfig.KEYS}   # the model.* keys
    for name in ("dtype", "param_dtype"):
      keys[name] = keys[name] if isinstance(keys[name], str) else jnp.dtype(keys[name]).name
    cfg = AttentionConfig.of(**keys, **(rope or RopeScaling()).model_keys(), zero_init_output=zero_init_output)
    d, H, Hkv, D = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg, self.attention, self.num_sink_tokens = cfg, cfg.attention, cfg.sink_tokens
    self.num_heads, self.num_kv_heads, self.head_dim = H, Hkv, D
    pdt = jnp.dtype(cfg.param_dtype)
    lin = dict(use_bias=cfg.attn_bias, dtype=jnp.dtype(cfg.dtype), param_dtype=pdt, dot_general=dense.dot_general,
               rngs=rngs)
    proj = lambda n_in, n_out, axes, **kw: nnx.Linear(n_in, n_out, kernel_metadata=logical(*axes), **lin, **kw)
    self.q_proj = proj(d, H * D, ("embed", "q_heads"), **matrix_init(cfg.init, d))
    self.k_proj = proj(d, Hkv * D, ("embed", "kv_heads"), **matrix_init(cfg.init, d))
    self.v_proj = proj(d, Hkv * D, ("embed", "kv_heads"), **matrix_init(cfg.init, d))
    out_init = nnx.initializers.zeros_init() if cfg.zero_init_output else nnx.initializers.lecun_normal()
    self.o_proj = nnx.Linear(H * D, d, kernel_init=out_init, kernel_metadata=logical("q_heads", "embed"),
                             **{**lin, "use_bias": cfg.attn_bias and cfg.attn_out_bias})
    norm = dict(eps=cfg.norm_eps, use_scale=cfg.norm_scale, param_dtype=pdt)
    self.q_norm = RMSNorm(D, **norm) if cfg.qk_norm else None
    self.k_norm = RMSNorm(D, **norm) if cfg.qk_norm else None
    self.kind.parameters(self, cfg, rngs)          # the variant's own: sink (sink), gate / gate_proj / gate_logit
    for name in ("sink", "gate", "gate_proj", "gate_logit"):
      if not hasattr(self, name):                  # (after them: an attribute set to None first would be static)
        setattr(self, name, None)
    self.sink_states = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.sink_tokens, d), pdt),
                                 **logical(None, "embed")) if cfg.sink_tokens else None

  @classmethod
  def from_config(cls, cfg: AttentionConfig, *, rngs: nnx.Rngs) -> Attention:
    """The layer an `AttentionConfig` describes (a model's: `ModelConfig.attention_config(layer)`, which is how
    `sinkjax.model` builds its layers): the keywords above read from it under the same names."""
    return cls(**{name: getattr(cfg, name) for name in _config_keywords()}, rngs=rngs)

  @property
  def kind(self) -> kinds.AttentionKind:
    """The registered variant this layer runs (`sinkjax.kinds`, by model.attention)."""
    return kinds.ATTENTION[self.attention]

  @property
  def has_outside_weight(self) -> bool:
    """Whether attention weight can fall outside the sequence keys: on a sink logit or on sink tokens."""
    return self.sink is not None or self.sink_states is not None

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
    # Named for model.remat_policy=save_qkv_proj: the projections' own outputs, so that a rematerialized layer's
    # backward recomputes QK-norm and RoPE (elementwise) but not these matmuls (QK-norm's backward needs its input).
    q = checkpoint_name(self.q_proj(x), "q_proj").reshape(B, T, self.num_heads, self.head_dim)
    k = checkpoint_name(self.k_proj(x), "k_proj").reshape(B, T, self.num_kv_heads, self.head_dim)
    v = checkpoint_name(self.v_proj(x), "v_proj").reshape(B, T, self.num_kv_heads, self.head_dim)
    v = self.kind.values(self, x, v)
    if self.q_norm is not None and self.cfg.rope_style != "nanochat":
      q, k = self.q_norm(q), self.k_norm(k)
    return q, k, v

  def rotate(self, x, positions, which: str):
    """RoPE at int positions [B,T] of queries (which="q") or keys ("k"), then their QK-norm where it follows RoPE
    (the one place this layer's rotary settings apply)."""
    scaling = self.cfg.rope
    rotary = self.cfg.rotary_dim
    y = apply_rope(x[..., :rotary], positions, rope_frequencies(rotary, self.cfg.rope_theta, scaling),
                   1.0 if scaling is None else scaling.cos_sin_scale(), self.cfg.rope_style)
    if rotary < self.head_dim:                          # partial RoPE (Qwen3-Next): the rest passes unrotated
      y = jnp.concatenate([y, x[..., rotary:]], axis=-1)
    if self.q_norm is not None and self.cfg.rope_style == "nanochat":
      y = (self.q_norm if which == "q" else self.k_norm)(y)
    return y

  def sink_kv(self, B: int, kv_heads=None, offset=0):
    """Keys/values of the learnable sink tokens, ([B,n,Hkv,D] rotated to positions offset..offset+n-1 (0..n-1 but
    in a chunk scored against a streaming cache, `sinkjax.cache`), [B,n,Hkv,D]), or None; only the KV heads
    `kv_heads` (a tuple of indices) when given."""
    if self.sink_states is None:
      return None
    _, k, v = self.project_unrotated(self.sink_states[...][None])
    k = self.rotate(k, offset + jnp.arange(self.num_sink_tokens, dtype=jnp.int32)[None], "k")
    k, v = (take_heads(a, kv_heads, 2) for a in (k, v))
    return tuple(jnp.broadcast_to(a, (B,) + a.shape[1:]) for a in (k, v))

  def gate_logits(self, x, kv_heads=None):
    """Gate logits of inputs x [B,T,d_model] (gated attention; `Gate.logits`)."""
    return self.gate.logits(self.gate_proj, self.gate_logit, x, kv_heads)

  def attend(self, x, q, k, v, segment_ids, *, impl=None, slide=True, kv_heads=None, sink_offset=0):
    """The variant switch: (out [B,T,Hq,D], gate [B,T,Hq] or [B,T,Hq,D]). Sink tokens join every variant here.
    slide=False leaves out the sliding window (the KV-cache decode step applies it by cache position instead).
    kv_heads: q, k, v hold only these KV heads (a tuple of indices) and their query heads, and so do the per-head
    parameters used here (a head group of a `sinkjax.cache.HybridKVCache`); None = every head. sink_offset: see
    `sink_kv`."""
    kw = dict(segment_ids=segment_ids, impl=impl or self.cfg.attn_impl)
    if self.cfg.sliding_window and slide:
      kw["window"] = self.cfg.sliding_window
    if self.sink_states is not None:
      kw["prefix"] = self.sink_kv(x.shape[0], kv_heads, sink_offset)
    return self.kind.attend(self, x, q, k, v, kw, kv_heads)

  def importance_mask(self, segment_ids, B: int, T: int):
    """Tokens that count for head importance: non-padding, and for vanilla not a document's first token (the row's
    first token under data.packing=stream, whose rows are one segment), unless there are sink tokens: the gate's
    "first token" is then sink token 0, so no query has G = 0 by construction."""
    valid = jnp.ones((B, T), bool) if segment_ids is None else segment_ids != 0
    if self.kind.skips_first_token and self.sink_states is None:
      first = variants.document_first_index(segment_ids, T)
      valid &= first != jnp.arange(T)[None, :]
    return valid

  def __call__(self, x, *, segment_ids=None, positions=None, cache=None, record_trace: bool = False,
               zero_first_token_value=None):
    """y [B,T,d_model]; with `cache` (a `sinkjax.cache.LayerCache`) returns (y, updated cache) instead: T == 1
    decodes one token against the cache (`sinkjax.cache.decode`), T > 1 prefills an empty cache (plain causal
    self-attention over x), or, with an append-mode view, attends a chunk against the cache (`sinkjax.cache.decode`).

    For `sinkjax.analysis` (the one forward pass: analysis never re-implements it):
      record_trace: also sow `trace`, a dict of what this layer attended with: q, k, v (rotated, as attended; K/V repeated
        to the query heads when values are zeroed), gate, and its materialized attention weights
        (`attention_weights`: the weights on the sequence keys and the weight outside them).
      zero_first_token_value: bool [Hq]; zero the value vector of every document's first token (a row's first token
        without segment ids) in those query heads before attention ([Sink-MoE] App. A, value zeroing).
    """
    B, T, _ = x.shape
    if cache is not None and (T == 1 or cache.appends):
      return cache_lib.decode(self, x, cache)
    if positions is None:
      positions = default_positions(segment_ids, B, T)
    q0, k0, v = self.project_unrotated(x)
    positions = positions + self.num_sink_tokens           # sink tokens hold positions 0..n-1
    q, k = self.rotate(q0, positions, "q"), self.rotate(k0, positions, "k")
    if zero_first_token_value is not None:
      k, v = zero_first_token_values(self, k, v, segment_ids, zero_first_token_value)
    out, gate = self.attend(x, q, k, v, segment_ids)
    y = self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))
    if cache is not None:
      return y, cache.prefill(k0, v)
    keep_last = dict(reduce_fn=lambda _, new: new, init_fn=lambda: None)
    if record_trace:
      weights, outside = attention_weights(self, q, k, segment_ids)
      self.sow(nnx.Intermediate, "trace", dict(q=q, k=k, v=v, gate=gate, weights=weights, outside=outside),
               **keep_last)
    # Each call replaces the previous record (instead of sow's default of appending to a tuple), so a model that is
    # called repeatedly without popping keeps a fixed graph: no growth and no re-tracing under nnx.jit.
    self.sow(nnx.Intermediate, "head_importance", head_importance(gate, self.importance_mask(segment_ids, B, T)),
             **keep_last)
    return y


@functools.cache
def _config_keywords() -> tuple:
  """`Attention`'s arguments but rngs: every one an `AttentionConfig` attribute of the same name."""
  return tuple(name for name in inspect.signature(Attention).parameters if name != "rngs")


def zero_first_token_values(layer: Attention, k, v, segment_ids, heads):
  """(k, v) repeated to the Hq query heads (so one head of a GQA group can be zeroed alone; repeating K/V does not
  change attention) with v zeroed at every document's first token in the query heads where `heads` [Hq]."""
  T = v.shape[1]
  rep = layer.num_heads // layer.num_kv_heads
  k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  starts = variants.document_first_index(segment_ids, T) == jnp.arange(T)[None, :]
  if segment_ids is not None:
    starts &= segment_ids != 0
  kill = starts[:, :, None, None] & jnp.asarray(heads, bool)[None, None, :, None]
  return k, jnp.where(kill, jnp.zeros_like(v), v)


def attention_weights(layer: Attention, q, k, segment_ids):
  """A layer's attention weights, materialized, in the softmax it actually uses: (A [B,Hq,T,T] on the sequence keys,
  the weight outside them [B,T,Hq]: on the sink logit (sink attention, a column with zero value, GPT-OSS) plus on
  the learnable sink tokens). Sliding windows apply; gated attention gives the softmax before its output gate; ReLU
  attention its ReLU weights. Padding queries are all zero."""
  B, T, Hq, D = q.shape
  seg = jnp.ones((B, T), jnp.int32) if segment_ids is None else jnp.broadcast_to(segment_ids, (B, T))
  own = layer.kind.weights(layer, q, k, seg)
  if own is not None:                                     # not a softmax over the keys (ReLU attention)
    return own
  scale = 1.0 / math.sqrt(D)
  logits, mask, _, _ = reference_weights(q, k, seg, seg, causal=True, scale=scale,
                                         window=layer.cfg.sliding_window or None)
  columns = [jnp.where(mask[:, None], logits, -jnp.inf)]                          # [B,Hq,T,T]
  if layer.sink_states is not None:
    k_p = jnp.repeat(layer.sink_kv(B)[0], Hq // k.shape[2], axis=2)
    columns.append(jnp.einsum("bthd,bnhd->bhtn", q.astype(jnp.float32), k_p.astype(jnp.float32),
                              precision=jax.lax.Precision.HIGHEST) * scale)
  columns += layer.kind.outside_columns(layer, q, B, Hq, T)
  z = jnp.concatenate(columns, axis=-1)
  valid = (seg != 0)[:, None, :, None]
  p = jax.nn.softmax(jnp.where(valid, z, 0.0), axis=-1) * valid
  return p[..., :T], jnp.swapaxes(p[..., T:].sum(-1), 1, 2)


def hf_attention_tensors(cfg: AttentionConfig) -> dict | None:
  """The tensors of an `Attention` with `cfg` under transformers' names (after `self_attn.`): {HF name: (path in the
  layer, transpose?)}, for the variants transformers has: vanilla (Llama, Qwen3) and sink (GPT-OSS's `sinks`);
  None for the others (gated, ReLU, sink tokens). Torch linear weights are [out, in], ours [in, out]."""
  extra = kinds.attention_kind(cfg.attention).hf_tensors(cfg)
  if extra is None or cfg.sink_tokens:
    return None
  out = {}
  for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
    out[f"{p}.weight"] = ((p, "kernel"), True)
    if cfg.attn_bias and (p != "o_proj" or cfg.attn_out_bias):
      out[f"{p}.bias"] = ((p, "bias"), False)
  if cfg.qk_norm:
    out.update({f"{n}.weight": ((n, "scale"), False) for n in ("q_norm", "k_norm")})
  return {**out, **extra}


def pop_head_importance(model: nnx.Module):
  """Removes the importances recorded by every `Attention` layer of `model` during its last forward pass and
  returns them stacked in layer order, [L, H]: row l is layer l's Imp^{l,h} of [Sink-MoE] eq. 5 (its gate G averaged
  over the call's valid tokens, `sinkjax.balance.head_importance`), the input of `head_imbalance` (eq. 6) and
  `aux_loss` (eq. 7 / 8). Call it inside the traced loss function, after the forward pass, so the loss's gradient
  flows into the gates; a ValueError when no layer recorded one (the model was not called since the last pop)."""
  imps = []
  for _, node in nnx.iter_graph(model):
    if isinstance(node, Attention) and hasattr(node, "head_importance"):
      imps.append(node.head_importance.get_value())
      del node.head_importance
  if not imps:
    raise ValueError("no Attention layer recorded head importance; call the model before pop_head_importance")
  return jnp.stack(imps)


def linen_attention(*args, name: str | None = None, **kwargs):
  """The same `Attention` layer as a Flax Linen module (through `nnx.bridge.to_linen`): `Attention`'s arguments
  (`help(sinkjax.layers.Attention)`) but `rngs`, which Linen supplies, and the Linen module's `name`.

  Use it like any Linen module: `y = linen_attention(d_model, heads, ...)(x, segment_ids=...)` inside a
  `@nn.compact` method; apply the host model with `mutable=["intermediates"]` to read `head_importance`
  (see `collect_linen_importance`). A wrong argument is a TypeError here, as it is for `Attention`.
  """
  _LINEN_ARGS.bind(*args, **kwargs)
  return nnx.bridge.to_linen(Attention, *args, name=name, **kwargs)


def _linen_signature() -> tuple[inspect.Signature, inspect.Signature]:
  """(Attention's arguments without rngs, the same with the keyword-only `name`): what linen_attention checks its
  arguments against, and the signature help() shows."""
  init = inspect.signature(Attention.__init__)
  args = [p for n, p in init.parameters.items() if n not in ("self", "rngs")]
  shown = args + [inspect.Parameter("name", inspect.Parameter.KEYWORD_ONLY, default=None, annotation="str | None")]
  return init.replace(parameters=args, return_annotation=inspect.Signature.empty), \
      init.replace(parameters=shown, return_annotation="flax.linen.Module")


_LINEN_ARGS, linen_attention.__signature__ = _linen_signature()


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


@named_signature
class MLP(nnx.Module):
  """x [..., d_model] -> down_proj(act(x)) [..., d_model]: ReLU^2 (nanochat, the paper's baseline), SwiGLU
  (Llama/Qwen) or clamped SwiGLU (GPT-OSS); `mlp_activation` says each.

  d_model, hidden: the input / output width and the hidden width (the paper: 4 x d_model).
  kind: "relu2" (up_proj only) | "swiglu" | "clamped_swiglu" (gate_proj and up_proj). use_bias: biases on every
  projection. limit, alpha: clamped_swiglu's clamp and sigmoid slope. dtype, param_dtype: compute / parameter dtypes.
  zero_init_output: down_proj starts at zero (a residual block starts as the identity). init: "default" |
  "nanochat" (the input matrices uniform with std 1/sqrt(d_model)). rngs: `nnx.Rngs`.
  """

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


@named_signature
class MoE(nnx.Module):
  """Top-k routed mixture of MLP experts: router logits -> top-k experts -> their outputs, weighted (`router`):
  topk_softmax (GPT-OSS) softmax over the k best logits of a router with a bias; softmax_topk (Qwen3-MoE,
  norm_topk_prob false) the k best of the softmax over all experts, as they are; softmax_topk_norm (norm_topk_prob
  true) those renormalised to sum 1. The softmax_topk routers have no bias.

  Expert weights are stacked [E, ...]; tokens are sorted by expert and run through `jax.lax.ragged_dot`, so the
  compute is that of the k chosen experts per token (not all E).

  d_model, hidden: widths; num_experts (E), top_k (k). kind, use_bias, limit, alpha, dtype, param_dtype,
  zero_init_output: as `MLP`'s, for every expert (a gated kind: swiglu | clamped_swiglu). router: as above.
  shared_hidden: > 0 adds a shared SwiGLU expert of that width every token takes, scaled by sigmoid(x w)
  (Qwen3-Next). rngs: `nnx.Rngs`.
  """

  def __init__(self, d_model: int, hidden: int, num_experts: int, top_k: int, *, kind: str = "clamped_swiglu",
               use_bias: bool = True, limit: float = 7.0, alpha: float = 1.702, dtype=jnp.float32,
               param_dtype=jnp.float32, zero_init_output: bool = True, router: str = "topk_softmax",
               shared_hidden: int = 0, rngs: nnx.Rngs):
    if kind == "relu2":
      raise ValueError("MoE experts need a gated kind (swiglu | clamped_swiglu)")
    if router not in MOE_ROUTERS:
      raise ValueError(f"MoE router must be one of {MOE_ROUTERS}, got {router!r}")
    self.kind, self.limit, self.alpha, self.top_k, self.dtype = kind, limit, alpha, top_k, dtype
    self.routing = router
    self.router = nnx.Linear(d_model, num_experts, use_bias=router == "topk_softmax", dtype=jnp.float32,
                             param_dtype=param_dtype,
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
    # Qwen3-Next: a shared SwiGLU expert every token takes, scaled by sigmoid(x w) (`shared_expert_gate`).
    self.shared_expert = MLP(d_model, shared_hidden, kind="swiglu", dtype=dtype, param_dtype=param_dtype,
                             zero_init_output=zero_init_output, rngs=rngs) if shared_hidden else None
    self.shared_expert_gate = nnx.Linear(d_model, 1, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                                         kernel_metadata=logical("embed", None), rngs=rngs) if shared_hidden else None

  def __call__(self, x):
    names = ("gate_kernel", "up_kernel", "down_kernel", "gate_bias", "up_bias", "down_bias")
    weights = {n: getattr(self, n)[...] for n in names if getattr(self, n) is not None}
    weights["router_kernel"] = self.router.kernel[...]
    if self.router.bias is not None:
      weights["router_bias"] = self.router.bias[...]
    route = functools.partial(moe_tokens, top_k=self.top_k, kind=self.kind, limit=self.limit, alpha=self.alpha,
                              dtype=self.dtype, router=self.routing)
    # Per batch shard: the sort by expert is then over the shard's own tokens (one global sort would gather every
    # token of the step onto every device: GPT-OSS-20B on 16 chips needed 222 GiB per chip).
    y = per_batch_shard(route, x.shape[0])(x, weights)
    if self.shared_expert is None:
      return y
    scale = jax.nn.sigmoid(self.shared_expert_gate(x).astype(jnp.float32))
    return (y.astype(jnp.float32) + scale * self.shared_expert(x).astype(jnp.float32)).astype(y.dtype)


def moe_tokens(x, w: dict, *, top_k: int, kind: str, limit: float, alpha: float, dtype,
               router: str = "topk_softmax"):
  """`MoE` over x [B, T, D] with its weights as arrays (router_kernel, optional router_bias, gate/up/down_kernel,
  optional gate/up/down_bias): route (`router`, see `MoE`), sort the token copies by expert, three `ragged_dot`s,
  scatter-add back."""
  B, T, D = x.shape
  xf = x.reshape(B * T, D)
  logits = xf.astype(jnp.float32) @ w["router_kernel"].astype(jnp.float32)
  if "router_bias" in w:
    logits = logits + w["router_bias"].astype(jnp.float32)
  if router == "topk_softmax":
    top_logits, experts = jax.lax.top_k(logits, top_k)                                          # [N, k]
    weights = jax.nn.softmax(top_logits, axis=-1)
  else:
    weights, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)
    if router == "softmax_topk_norm":
      weights = weights / weights.sum(axis=-1, keepdims=True)
  flat = experts.reshape(-1)                                                                    # [N*k], token-major
  order = jnp.argsort(flat, stable=True)
  expert_of_row = flat[order]
  token_of_row = order // top_k
  sizes = jnp.bincount(flat, length=w["gate_kernel"].shape[0]).astype(jnp.int32)
  rows = xf[token_of_row].astype(dtype)

  def proj(h, name):
    y = jax.lax.ragged_dot(h, w[f"{name}_kernel"].astype(dtype), sizes, preferred_element_type=jnp.float32)
    bias = w.get(f"{name}_bias")
    return y if bias is None else y + bias[expert_of_row].astype(jnp.float32)

  h = mlp_activation(kind, proj(rows, "gate"), proj(rows, "up"), limit=limit, alpha=alpha)
  y = proj(h.astype(dtype), "down") * weights.reshape(-1)[order][:, None]
  out = jnp.zeros((B * T, D), jnp.float32).at[token_of_row].add(y)
  return out.reshape(B, T, D).astype(x.dtype)
