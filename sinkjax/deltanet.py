"""Gated DeltaNet (Qwen3-Next's linear-attention layer) in JAX: the gated delta rule in its chunked (training,
prefill) and recurrent (decode) forms, the causal depthwise conv, and the Flax NNX layer `GatedDeltaNet` whose
parameters map one to one onto transformers' `Qwen3NextGatedDeltaNet` (`HF_TENSOR_NAMES`).

The gated delta rule, per value head, with state S [Dk, Dv], decay g_t <= 0 (log space) and rate beta_t in (0, 1):
  S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T,   o_t = S_t^T q_t
with q scaled by Dk^-0.5 (after the optional L2 norm of q and k, eps 1e-6 inside the root, as FLA / transformers).

Layout, as the rest of sinkjax: q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; g, beta [B, T, Hv]; outputs [B, T, Hv, Dv];
recurrent state [B, Hv, Dk, Dv] float32. Hv may be a multiple of Hk: value head h reads key head h // (Hv / Hk)
(transformers' `repeat_interleave`). Every product is accumulated in float32 whatever the input dtype.

`segment_ids` [B, T] (packed documents; id 0 padding is a document of its own): the state is reset where the id
changes, and the conv never mixes documents, so each document sees exactly what it would see alone. A left-padded
row therefore starts its prompt from a zero state (transformers zeroes the padded inputs, which gives the same state).
Without segment ids a row is one document, continuing from `initial_state` / the conv state when given.
"""
from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax.kernels import dense
from sinkjax.sharding import logical, optimizer_group

L2NORM_EPS = 1e-6


# ---------------------------------------------------------------------------------------------------------------
# The gated delta rule
# ---------------------------------------------------------------------------------------------------------------

def l2norm(x, eps: float = L2NORM_EPS):
  """x * rsqrt(sum(x^2) + eps) over the last axis (FLA's and transformers' `l2norm`)."""
  return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
  """float32 q, k, v, g, beta with the key heads repeated to the value heads (axis -2), q/k L2-normed if asked and
  q scaled (default Dk^-0.5)."""
  Hk, Hv = k.shape[-2], v.shape[-2]
  if Hv % Hk or q.shape[-2] != Hk:
    raise ValueError(f"value heads ({Hv}) must be a multiple of the query/key heads ({q.shape[-2]}, {Hk})")
  q, k, v, g, beta = (a.astype(jnp.float32) for a in (q, k, v, g, beta))
  if use_qk_l2norm:
    q, k = l2norm(q), l2norm(k)
  if Hv != Hk:
    q, k = (jnp.repeat(a, Hv // Hk, axis=-2) for a in (q, k))
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  return q * scale, k, v, g, beta


def document_starts(segment_ids, T: int):
  """bool [B, T]: the token starts a new document within the row (never at t = 0, which continues any carried
  state), or None without segment ids."""
  if segment_ids is None:
    return None
  return jnp.concatenate([jnp.zeros_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)


def gated_delta_rule_step(q, k, v, g, beta, state, *, scale=None, use_qk_l2norm: bool = False, reset=None):
  """One token of the gated delta rule: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], state [B, Hv, Dk, Dv]
  (float32) -> (o [B, Hv, Dv] float32, new state). `reset` bool [B]: start from a zero state (a new document)."""
  q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
  return _step(q, k, v, g, beta, state.astype(jnp.float32), reset)


def _step(q, k, v, g, beta, state, reset):
  decay = jnp.exp(g)[..., None, None]
  if reset is not None:
    decay = jnp.where(reset[:, None, None, None], 0.0, decay)
  state = state * decay
  delta = beta[..., None] * (v - jnp.einsum("bhkv,bhk->bhv", state, k))
  state = state + k[..., :, None] * delta[..., None, :]
  return jnp.einsum("bhkv,bhk->bhv", state, q), state


def gated_delta_rule_recurrent(q, k, v, g, beta, *, initial_state=None, segment_ids=None, scale=None,
                               use_qk_l2norm: bool = False):
  """The gated delta rule token by token (`lax.scan`; decode, and the oracle of the chunked form).
  Shapes in the module docstring -> (out [B, T, Hv, Dv] in v.dtype, final state [B, Hv, Dk, Dv] float32)."""
  dtype = v.dtype
  B, T, Hk, Dk = k.shape
  q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
  Hv, Dv = v.shape[-2:]
  state = jnp.zeros((B, Hv, Dk, Dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
  starts = document_starts(segment_ids, T)
  time_major = lambda a: jnp.moveaxis(a, 1, 0)
  xs = tuple(map(time_major, (q, k, v, g, beta))) + ((None,) if starts is None else (time_major(starts),))

  def body(state, x):
    o, state = _step(*x[:5], state, x[5])
    return state, o

  state, out = jax.lax.scan(body, state, xs)
  return jnp.moveaxis(out, 0, 1).astype(dtype), state


def unit_lower_inverse(a):
  """(I + a)^-1 for strictly lower triangular a [..., C, C], by block doubling: the inverse's diagonal blocks of
  size 2s from those of size s, [[X11, 0], [A21, X22]]^-1 = [[X11^-1, 0], [-X22^-1 A21 X11^-1, X22^-1]], matmuls
  only (C padded to a power of two). As accurate as a triangular solve (float32: 1.3e-7 vs 1.6e-7 for C = 64) and
  37x faster on XLA:CPU, whose batched triangular_solve is a slow sequential loop (180 ms vs 5 ms for 128 systems
  of 64 with 64 right-hand sides)."""
  C = a.shape[-1]
  P, batch = 1 << (C - 1).bit_length(), a.shape[:-2]
  if P != C:
    a = jnp.pad(a, [(0, 0)] * len(batch) + [(0, P - C), (0, P - C)])
  inv, s = jnp.ones(batch + (P, 1, 1), a.dtype), 1            # the diagonal blocks of the inverse, of size s
  while s < P:
    m = P // (2 * s)
    low = a.reshape(batch + (m, 2, s, m, 2, s))[..., :, 1, :, :, 0, :]               # [..., m, s, m, s]
    low = jnp.moveaxis(jnp.diagonal(low, axis1=-4, axis2=-2), -1, -3)              # A21 of each block [..., m, s, s]
    x11, x22 = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
    inv = jnp.concatenate([jnp.concatenate([x11, jnp.zeros_like(x11)], -1),
                           jnp.concatenate([-x22 @ low @ x11, x22], -1)], -2)
    s *= 2
  return inv.reshape(batch + (P, P))[..., :C, :C]


def gated_delta_rule_chunked(q, k, v, g, beta, *, chunk_size: int = 64, initial_state=None, segment_ids=None,
                             scale=None, use_qk_l2norm: bool = False):
  """The gated delta rule by chunks (training and prefill): within a chunk of C tokens, parallel (the WY / UT
  form: one unit-lower-triangular inverse per chunk, `unit_lower_inverse`), across chunks a `lax.scan` over the state. Equal to
  `gated_delta_rule_recurrent` in value and gradient. Any T (padded to the chunk with tokens of k = beta = g = 0,
  which leave the state unchanged). Shapes in the module docstring -> (out [B, T, Hv, Dv] in v.dtype, final state
  [B, Hv, Dk, Dv] float32).

  Within a chunk, with Gamma_i = g_1 + ... + g_i and the delta d_j = beta_j (v_j - k_j^T S_{j-1}^-), S^- the state
  after the decay of step j:
    d + tril_-1(beta_i exp(Gamma_i - Gamma_j) k_i.k_j) d = beta v - beta exp(Gamma) k S_0       (solved for d)
    o_i = exp(Gamma_i) q_i^T S_0 + sum_{j<=i} exp(Gamma_i - Gamma_j) (q_i.k_j) d_j
    S_C = exp(Gamma_C) S_0 + sum_j exp(Gamma_C - Gamma_j) k_j d_j^T
  The decays between tokens are exp of sums of g over (j, i] (taken from a masked cumulative sum, not a difference
  of two large cumulative sums), masked to -inf before the exp wherever j > i or j and i lie in different
  documents, so nothing overflows and no inf * 0 arises, forward or backward.
  """
  dtype = v.dtype
  B, T, Hk, Dk = k.shape
  q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
  Hv, Dv = v.shape[-2:]
  C = chunk_size
  pad = -T % C
  N = (T + pad) // C
  starts = document_starts(segment_ids, T)
  doc = jnp.zeros((B, T), jnp.int32) if starts is None else jnp.cumsum(starts, axis=1, dtype=jnp.int32)
  if pad:
    q, k, v = (jnp.pad(a, ((0, 0), (0, pad), (0, 0), (0, 0))) for a in (q, k, v))
    g, beta = (jnp.pad(a, ((0, 0), (0, pad), (0, 0))) for a in (g, beta))
    doc = jnp.pad(doc, ((0, 0), (0, pad)), mode="edge")          # padding continues the last document
  # [B, T, H, D] -> [N, B, H, C, D]; [B, T, H] -> [N, B, H, C]; doc [B, T] -> [N, B, 1, C]
  chunked = lambda a: jnp.moveaxis(a.reshape((B, N, C) + a.shape[2:]), (1, 2), (0, 3))
  q, k, v, g, beta = map(chunked, (q, k, v, g, beta))
  doc = chunked(doc[..., None])
  before = jnp.concatenate([doc[:1, ..., :1], doc[:-1, ..., -1:]], 0)   # the document of the token before each chunk

  same = doc[..., :, None] == doc[..., None, :]                           # [N, B, 1, C(i), C(j)]
  lower = jnp.tril(jnp.ones((C, C), bool))
  # log decay from token j to token i: sum of g over (j, i], by a cumulative sum down i of g_i masked to i > j
  seg = jnp.cumsum(jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), g[..., :, None], 0.0), axis=-2)
  decay = jnp.exp(jnp.where(lower & same, seg, -jnp.inf))               # [N, B, H, C, C]
  cum = jnp.cumsum(g, axis=-1)
  carried = doc == before                                                 # token i still reads the incoming state
  decay_in = jnp.exp(jnp.where(carried, cum, -jnp.inf))                   # exp(Gamma_i), 0 after a reset
  decay_out = decay[..., -1, :]                                            # exp(Gamma_C - Gamma_j), same doc as C
  decay_chunk = decay_in[..., -1, None, None]                              # exp(Gamma_C)

  strict = jnp.tril(jnp.ones((C, C), bool), -1)
  kk = jnp.einsum("nbhid,nbhjd->nbhij", k, k) * beta[..., :, None] * decay
  inverse = unit_lower_inverse(jnp.where(strict, kk, 0.0))                # (I + tril_-1(...))^-1
  values = inverse @ (beta[..., None] * v)                                 # [N, B, H, C, Dv]
  keys_in = inverse @ ((beta * decay_in)[..., None] * k)                   # [N, B, H, C, Dk]
  attn = jnp.einsum("nbhid,nbhjd->nbhij", q, k) * decay
  q_in = q * decay_in[..., None]
  k_out = k * decay_out[..., None]

  def body(state, x):
    values, keys_in, attn, q_in, k_out, decay_chunk = x
    d = values - jnp.einsum("bhck,bhkv->bhcv", keys_in, state)
    o = jnp.einsum("bhck,bhkv->bhcv", q_in, state) + jnp.einsum("bhij,bhjv->bhiv", attn, d)
    state = state * decay_chunk + jnp.einsum("bhck,bhcv->bhkv", k_out, d)
    return state, o

  state = jnp.zeros((B, Hv, Dk, Dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)
  state, out = jax.lax.scan(body, state, (values, keys_in, attn, q_in, k_out, decay_chunk))
  out = jnp.moveaxis(out, (0, 3), (1, 2)).reshape(B, N * C, Hv, Dv)[:, :T]
  return out.astype(dtype), state


# ---------------------------------------------------------------------------------------------------------------
# The causal depthwise conv
# ---------------------------------------------------------------------------------------------------------------

def causal_conv1d(x, weight, *, state=None, segment_ids=None, activation: bool = True):
  """Causal depthwise conv over time: y_t = SiLU(sum_j weight[j] x_{t-K+1+j}), x [B, T, C], weight [K, C]
  (transformers' `conv1d.weight` [C, 1, K] as weight[:, 0, :].T); no bias (Qwen3-Next has none).
  `state` [B, K-1, C]: the K-1 inputs before x, oldest first (zeros = a fresh start). With `segment_ids`, inputs of
  another document count as zero (the state belongs to the first token's document).
  -> (y [B, T, C] in x.dtype, new state [B, K-1, C]: the last K-1 inputs, those of other documents than the last
  token's zeroed, so a decode step continues the last document only)."""
  B, T, Cn = x.shape
  K = weight.shape[0]
  state = jnp.zeros((B, K - 1, Cn), x.dtype) if state is None else state.astype(x.dtype)
  xs = jnp.concatenate([state, x], axis=1)                                 # [B, K-1+T, C]
  if segment_ids is not None:
    doc = jnp.cumsum(document_starts(segment_ids, T), axis=1, dtype=jnp.int32)
    doc = jnp.concatenate([jnp.zeros((B, K - 1), jnp.int32), doc], axis=1)
  xf, w = xs.astype(jnp.float32), weight.astype(jnp.float32)
  y = jnp.zeros((B, T, Cn), jnp.float32)
  for j in range(K):
    tap = xf[:, j:j + T]
    if segment_ids is not None:
      tap = jnp.where((doc[:, j:j + T] == doc[:, K - 1:])[..., None], tap, 0.0)
    y = y + tap * w[j]
  if activation:
    y = jax.nn.silu(y)
  new_state = xs[:, T:]
  if segment_ids is not None:
    new_state = jnp.where((doc[:, T:] == doc[:, -1:])[..., None], new_state, 0)
  return y.astype(x.dtype), new_state


def causal_conv1d_step(x, weight, state, *, activation: bool = True):
  """One token of `causal_conv1d`: x [B, C], state [B, K-1, C] -> (y [B, C], new state)."""
  y, state = causal_conv1d(x[:, None], weight, state=state, activation=activation)
  return y[:, 0], state


# ---------------------------------------------------------------------------------------------------------------
# The layer
# ---------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class DeltaNetConfig:
  """The fields of a transformers `Qwen3NextConfig` that a Gated DeltaNet layer reads, plus how it computes."""
  hidden_size: int
  linear_num_key_heads: int
  linear_num_value_heads: int
  linear_key_head_dim: int
  linear_value_head_dim: int
  linear_conv_kernel_dim: int = 4
  rms_norm_eps: float = 1e-6
  chunk_size: int = 64
  dtype: str = "float32"
  param_dtype: str = "float32"

  def __post_init__(self):
    if self.linear_num_value_heads % self.linear_num_key_heads:
      raise ValueError(f"linear_num_value_heads ({self.linear_num_value_heads}) must be a multiple of "
                       f"linear_num_key_heads ({self.linear_num_key_heads})")
    if self.linear_conv_kernel_dim < 1 or self.chunk_size < 1:
      raise ValueError("linear_conv_kernel_dim and chunk_size must be >= 1")

  @classmethod
  def from_hf(cls, hf, **overrides) -> DeltaNetConfig:
    """From a transformers config (or its dict), `overrides` replacing its fields; only SiLU, transformers'
    `hidden_act` for Qwen3-Next, is built."""
    get = hf.get if isinstance(hf, dict) else lambda name, default=None: getattr(hf, name, default)
    if get("hidden_act", "silu") != "silu":
      raise ValueError(f"Gated DeltaNet is built with hidden_act silu only, the config has {get('hidden_act')!r}")
    names = ("hidden_size", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps")
    return cls(**{**{n: get(n) for n in names}, **overrides})

  @property
  def key_dim(self) -> int:
    return self.linear_num_key_heads * self.linear_key_head_dim

  @property
  def value_dim(self) -> int:
    return self.linear_num_value_heads * self.linear_value_head_dim

  @property
  def conv_dim(self) -> int:
    """Channels of the conv: q, k and v of every head, in that order."""
    return 2 * self.key_dim + self.value_dim


class DeltaNetState(NamedTuple):
  """Decode state of one Gated DeltaNet layer, per batch row: `conv` [B, K-1, conv_dim] (the last K-1 conv inputs,
  oldest first, in the layer's dtype; transformers keeps [B, conv_dim, K], whose last K-1 columns these are,
  transposed) and `recurrent` [B, Hv, Dk, Dv] float32 (transformers' recurrent state, same layout)."""
  conv: jax.Array
  recurrent: jax.Array


class GatedRMSNorm(nnx.Module):
  """transformers' `Qwen3NextRMSNormGated`: RMSNorm over the head dim (scale initialized to 1, not zero-centred),
  then times SiLU(z)."""

  def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32):
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))

  def __call__(self, x, z):
    xf = x.astype(jnp.float32)
    y = (xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
    y = self.scale[...] * y
    return (y.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class GatedDeltaNet(nnx.Module):
  """Qwen3-Next's linear-attention mixer: x -> in_proj_qkvz / in_proj_ba -> causal conv (SiLU) on q, k, v ->
  gated delta rule (L2-normed q, k; beta = sigmoid(b), g = -exp(A_log) softplus(a + dt_bias)) -> gated RMSNorm
  with z -> out_proj. Parameters as transformers' `Qwen3NextGatedDeltaNet` (`HF_TENSOR_NAMES`); the projections
  keep transformers' per-key-head interleaved output order, so loading is a transpose.

  `layer(x, segment_ids=None)` -> y [B, T, d]; with `state` (a `DeltaNetState`, e.g. `init_state(B)`) returns
  (y, new state): T == 1 is a recurrent decode step, T > 1 a chunked prefill continuing from the state. Tokens of
  segment id 0 (padding) give y = 0. There is no per-head gate for head importance: this layer has nothing to
  balance.
  """

  def __init__(self, cfg: DeltaNetConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pdt, dt = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
    lin = dict(use_bias=False, dtype=dt, param_dtype=pdt, dot_general=dense.dot_general, rngs=rngs)
    d, Hv = cfg.hidden_size, cfg.linear_num_value_heads
    self.in_proj_qkvz = nnx.Linear(d, 2 * cfg.key_dim + 2 * cfg.value_dim, kernel_metadata=logical("embed", "heads"),
                                   **lin)
    self.in_proj_ba = nnx.Linear(d, 2 * Hv, kernel_metadata=logical("embed", "heads"), **lin)
    K = cfg.linear_conv_kernel_dim
    bound = K ** -0.5                     # torch's Conv1d default for a depthwise kernel: fan_in = K
    self.conv_weight = nnx.Param(jax.random.uniform(rngs.params(), (K, cfg.conv_dim), pdt, -bound, bound),
                                 **logical(None, None), **optimizer_group("scalar"))   # [K, C]: no Muon
    self.dt_bias = nnx.Param(jnp.ones((Hv,), pdt))
    self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (Hv,), jnp.float32, 0.01, 16)).astype(pdt))
    self.norm = GatedRMSNorm(cfg.linear_value_head_dim, eps=cfg.rms_norm_eps, param_dtype=pdt)
    self.out_proj = nnx.Linear(cfg.value_dim, d, kernel_metadata=logical("heads", "embed"), **lin)

  def init_state(self, batch: int) -> DeltaNetState:
    """The zero decode state of `batch` rows."""
    cfg = self.cfg
    return DeltaNetState(
        jnp.zeros((batch, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim), jnp.dtype(cfg.dtype)),
        jnp.zeros((batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                  jnp.float32))

  def project(self, x):
    """(qkv [B, T, conv_dim] before the conv, z [B, T, Hv, Dv], b, a [B, T, Hv]): transformers'
    `fix_query_key_value_ordering` of the interleaved projections."""
    cfg = self.cfg
    B, T, _ = x.shape
    Hk, Dk, Dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // Hk
    qkvz = self.in_proj_qkvz(x).reshape(B, T, Hk, 2 * Dk + 2 * r * Dv)
    q, k, v, z = jnp.split(qkvz, [Dk, 2 * Dk, 2 * Dk + r * Dv], axis=-1)
    b, a = jnp.split(self.in_proj_ba(x).reshape(B, T, Hk, 2 * r), [r], axis=-1)
    qkv = jnp.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
    return qkv, z.reshape(B, T, -1, Dv), b.reshape(B, T, -1), a.reshape(B, T, -1)

  def __call__(self, x, *, segment_ids=None, state: DeltaNetState | None = None):
    cfg = self.cfg
    B, T, _ = x.shape
    qkv, z, b, a = self.project(x)
    conv_state = None if state is None else state.conv
    qkv, conv_state = causal_conv1d(qkv, self.conv_weight[...], state=conv_state, segment_ids=segment_ids)
    q, k, v = jnp.split(qkv, [cfg.key_dim, 2 * cfg.key_dim], axis=-1)
    q = q.reshape(B, T, -1, cfg.linear_key_head_dim)
    k = k.reshape(B, T, -1, cfg.linear_key_head_dim)
    v = v.reshape(B, T, -1, cfg.linear_value_head_dim)
    beta = jax.nn.sigmoid(b.astype(jnp.float32))
    g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
        a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
    rule = dict(initial_state=None if state is None else state.recurrent, segment_ids=segment_ids,
                use_qk_l2norm=True)
    if state is not None and T == 1:
      o, recurrent = gated_delta_rule_recurrent(q, k, v, g, beta, **rule)
    else:
      o, recurrent = gated_delta_rule_chunked(q, k, v, g, beta, chunk_size=cfg.chunk_size, **rule)
    o = self.norm(o.astype(v.dtype), z)
    y = self.out_proj(o.reshape(B, T, cfg.value_dim))
    if segment_ids is not None:
      y = jnp.where((segment_ids != 0)[..., None], y, 0).astype(y.dtype)
    return y if state is None else (y, DeltaNetState(conv_state, recurrent))


# ---------------------------------------------------------------------------------------------------------------
# transformers' tensor names
# ---------------------------------------------------------------------------------------------------------------

# module attribute path -> (tensor name under transformers' `...layers.{i}.linear_attn.`, how the array changes
# from transformers to sinkjax). "T": a torch Linear weight [out, in] transposed to the kernel [in, out].
# "conv": conv1d.weight [C, 1, K] -> [K, C]. None: as it is. Every tensor maps one to one (no fusing, no reordering).
HF_TENSOR_NAMES = {
    "in_proj_qkvz.kernel": ("in_proj_qkvz.weight", "T"),
    "in_proj_ba.kernel": ("in_proj_ba.weight", "T"),
    "conv_weight": ("conv1d.weight", "conv"),
    "dt_bias": ("dt_bias", None),
    "A_log": ("A_log", None),
    "norm.scale": ("norm.weight", None),
    "out_proj.kernel": ("out_proj.weight", "T"),
}

_FROM_HF = {"T": lambda w: w.T, "conv": lambda w: w[:, 0, :].T, None: lambda w: w}
_TO_HF = {"T": lambda w: w.T, "conv": lambda w: w.T[:, None, :], None: lambda w: w}


def _variable(module, path: str):
  for name in path.split("."):
    module = getattr(module, name)
  return module


def load_hf_state_dict(layer: GatedDeltaNet, state_dict: dict, prefix: str = "") -> None:
  """Copies one transformers `linear_attn` module's tensors (numpy arrays, names `prefix + HF name`, e.g. prefix
  "model.layers.0.linear_attn.") into `layer`, in its param_dtype."""
  for path, (name, change) in HF_TENSOR_NAMES.items():
    if prefix + name not in state_dict:
      raise KeyError(f"{prefix + name} is missing from the state dict: pass the tensors of one linear_attn module")
    var = _variable(layer, path)
    value = _FROM_HF[change](np.asarray(state_dict[prefix + name]))
    if value.shape != var.shape:
      raise ValueError(f"{prefix + name} has shape {value.shape} after {change or 'no'} transform, the layer expects "
                       f"{var.shape}: the DeltaNetConfig does not match the checkpoint")
    var[...] = jnp.asarray(value, var.dtype)


def hf_state_dict(layer: GatedDeltaNet, prefix: str = "") -> dict:
  """The layer's parameters as transformers names them (numpy arrays, the inverse of `load_hf_state_dict`)."""
  return {prefix + name: _TO_HF[change](np.asarray(_variable(layer, path)[...]))
          for path, (name, change) in HF_TENSOR_NAMES.items()}
