"""The three attention variants of the paper ([Sink-MoE] §2-3) as pure functions over `flash_attention`.

Each returns `(out, gate)`: `out` [B,T,Hq,D] and the per-head gate G [B,T,Hq] (or [B,T,Hq,D] for an elementwise
gate) that the load-balancing loss averages into head importance (eq. 5). None materializes attention weights: the
implicit gates of vanilla and sink attention are functions of the kernel's LSE (eq. 4, App. B), and gradient flows
through it.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sinkjax.choices import GATE_ACTIVATIONS
from sinkjax.kernels import flash_attention
from sinkjax.kernels.reference import attention_mask


def _heads_last(lse):
  return jnp.swapaxes(lse, 1, 2)      # [B,Hq,T] -> [B,T,Hq]


def attend_prefix(q, out, lse, prefix, *, scale, q_valid=None):
  """Merges attention over `prefix` keys into a flash result through the two LSEs (learnable sink tokens,
  [StreamingLLM]).

  prefix = (k_p, v_p), each [B or 1, n, Hkv, D]: n keys visible to EVERY query (every segment of a packed row and
  every cache slot), which segment-equality masking cannot express. Their attention is a tiny closed-form [T, n]
  softmax, merged as lse = logaddexp(lse_seq, lse_p), out = e^(lse_seq - lse) out_seq + e^(lse_p - lse) out_p:
  exactly softmax over [prefix; keys], differentiable through both LSEs. Padding queries (q_valid False) keep a
  zero output and lse = -inf. Returns (out in q.dtype, lse [B,Hq,T], prefix logits z_p [B,Hq,T,n] float32).
  """
  k_p, v_p = prefix
  B, T, Hq, D = q.shape
  n, Hkv = k_p.shape[1], k_p.shape[2]
  kk = jnp.broadcast_to(jnp.repeat(k_p, Hq // Hkv, axis=2), (B, n, Hq, D)).astype(jnp.float32)
  vv = jnp.broadcast_to(jnp.repeat(v_p, Hq // Hkv, axis=2), (B, n, Hq, D)).astype(jnp.float32)
  z_p = jnp.einsum("bthd,bnhd->bhtn", q.astype(jnp.float32), kk, precision=jax.lax.Precision.HIGHEST) * scale
  lse_p = jax.nn.logsumexp(z_p, axis=-1)                                           # [B,Hq,T]
  out_p = jnp.einsum("bhtn,bnhd->bthd", jax.nn.softmax(z_p, axis=-1), vv, precision=jax.lax.Precision.HIGHEST)
  lse_all = jnp.logaddexp(lse, lse_p)
  w_seq, w_p = (_heads_last(jnp.exp(x - lse_all))[..., None] for x in (lse, lse_p))
  merged = w_seq * out.astype(jnp.float32) + w_p * out_p
  if q_valid is not None:
    merged = jnp.where(q_valid[:, :, None, None], merged, 0.0)
    lse_all = jnp.where(q_valid[:, None, :], lse_all, -jnp.inf)
  return merged.astype(q.dtype), lse_all, z_p


def _query_valid(segment_ids, B: int, T: int):
  if segment_ids is None:
    return None
  q_seg = segment_ids[0] if isinstance(segment_ids, (tuple, list)) else segment_ids
  return jnp.broadcast_to(q_seg, (B, T)) != 0


def _flash(q, k, v, segment_ids, scale, impl, prefix, kernel_kwargs):
  """flash_attention (causal) plus the optional always-visible prefix keys: (out, lse, prefix logits or None)."""
  B, T, _, D = q.shape
  scale = 1.0 / math.sqrt(D) if scale is None else scale
  out, lse = flash_attention(q, k, v, causal=True, segment_ids=segment_ids, scale=scale, impl=impl,
                             **kernel_kwargs)
  if prefix is None:
    return out, lse, None
  return attend_prefix(q, out, lse, prefix, scale=scale, q_valid=_query_valid(segment_ids, B, T))


def document_first_index(segment_ids, T: int):
  """For each position, the index of the first token of its segment (packed batches); shape [B, T].

  Segments are contiguous runs of equal ids. With no segment ids every position's first token is 0.
  """
  if segment_ids is None:
    return jnp.zeros((1, T), jnp.int32)
  idx = jnp.arange(T, dtype=jnp.int32)
  prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  starts = segment_ids != prev
  return jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def document_last_index(segment_ids, T: int):
  """For each position, the index of the last token of its segment; shape [B, T] (see document_first_index)."""
  if segment_ids is None:
    return jnp.full((1, T), T - 1, jnp.int32)
  return T - 1 - jnp.flip(document_first_index(jnp.flip(segment_ids, axis=1), T), axis=1)


@jax.custom_vjp
def _take_segment_first(x, first, last):
  """x[b, first[b, t]] for every t ([B,T,...]), first/last = the bounds of t's contiguous segment.

  The same as `jnp.take_along_axis`, but its gradient is a segmented sum by prefix sums instead of the gather's
  transpose, a scatter-add in which every token of a document adds into the same row (atomics that serialize on
  GPUs: +12 % on the whole train step of a vanilla model with the aux loss, docs/PERF.md).
  """
  return jnp.take_along_axis(x, first.reshape(first.shape + (1,) * (x.ndim - 2)), axis=1)


def _take_segment_first_fwd(x, first, last):
  return _take_segment_first(x, first, last), (first, last)


def _take_segment_first_bwd(res, g):
  first, last = res
  expand = lambda i: i.reshape(i.shape + (1,) * (g.ndim - 2))
  # Prefix sums in (at least) float32; a segment's sum is a difference of two of them, exact to ~eps * |row sum|.
  csum = jnp.cumsum(g.astype(jnp.promote_types(g.dtype, jnp.float32)), axis=1)
  upto_last = jnp.take_along_axis(csum, expand(last), axis=1)
  before_first = jnp.where(expand(first) > 0, jnp.take_along_axis(csum, expand(jnp.maximum(first - 1, 0)), axis=1),
                           0.0)
  is_first = first == jnp.arange(first.shape[1], dtype=first.dtype)[None, :]
  dx = jnp.where(expand(is_first), upto_last - before_first, 0.0).astype(g.dtype)  # g: x's dtype
  return dx, None, None


_take_segment_first.defvjp(_take_segment_first_fwd, _take_segment_first_bwd)


def vanilla_attention(q, k, v, *, segment_ids=None, scale=None, impl="auto", prefix=None, **kernel_kwargs):
  """Causal softmax attention and its implicit gate ([Sink-MoE] eq. 4): G_t = 1 - A_{t,first}, the attention weight
  a query does NOT put on the first key it sees (its document's first token: the "sink").

  q [B,T,Hq,D], k/v [B,S,Hkv,D] (GQA: Hq % Hkv == 0); segment_ids int [B,T] (tokens attend within equal ids, 0 =
  padding) or None; scale None = 1/sqrt(D); impl: the `flash_attention` backend; kernel_kwargs (window=,
  block_q=, ...) go to the kernel. Returns (out [B,T,Hq,D] in q.dtype, G [B,T,Hq] float32).
  Rows of one segment (segment_ids all equal, e.g. data.packing=stream, or None) make it the row's first token.

  Stable form (SPEC): G = -expm1(z_first - LSE), exact as A_first -> 1, no attention weights needed.
  A query that is its document's first token (or padding) has G = 0.
  With learnable sink tokens (`prefix`, see `attend_prefix`) the "first token" is the first sink token, which every
  query sees: G_t = 1 - A_{t,sink_0} is then defined (and usually > 0) for every non-padding query.
  With a (q_seg, kv_seg) pair (decoding against a KV cache) the first key is the first slot of the query's segment.
  With a sliding `window` (nanochat's later architecture), a query whose window has left its first key behind puts
  no weight on it: G = 1 there (eq. 4 literally).
  """
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  scale = 1.0 / math.sqrt(D) if scale is None else scale
  out, lse, z_p = _flash(q, k, v, segment_ids, scale, impl, prefix, kernel_kwargs)
  lse_t = _heads_last(lse)
  if prefix is not None:
    delta = jnp.minimum(jnp.where(jnp.isfinite(lse_t), _heads_last(z_p[..., 0]) - lse_t, 0.0), 0.0)
    return out, jnp.where(jnp.isfinite(lse_t), -jnp.expm1(delta), 0.0)
  if isinstance(segment_ids, (tuple, list)):
    q_seg, kv_seg = (jnp.broadcast_to(s, shape) for s, shape in zip(segment_ids, ((B, T), (B, S))))
    first = jnp.argmax(q_seg[:, :, None] == kv_seg[:, None, :], axis=-1).astype(jnp.int32)   # [B,T]
    own = jnp.arange(T, dtype=jnp.int32)[None, :] + (S - T)            # bottom-right aligned key index of t
    k_first = jnp.take_along_axis(k, first[:, :, None, None], axis=1)        # [B,T,Hkv,D]
  else:                         # packed segments, or none (one document: first = 0, last = T - 1)
    first = jnp.broadcast_to(document_first_index(segment_ids, T), (B, T))
    last = jnp.broadcast_to(document_last_index(segment_ids, T), (B, T))
    own = jnp.arange(T)[None, :]
    k_first = _take_segment_first(k, first, last)                            # [B,T,Hkv,D]
  k_first = jnp.repeat(k_first, Hq // Hkv, axis=2)
  z_first = jnp.einsum("bthd,bthd->bth", q.astype(jnp.float32), k_first.astype(jnp.float32)) * scale
  valid = (first != own)[:, :, None] & jnp.isfinite(lse_t)
  # z_first <= LSE in exact arithmetic; the clamp keeps rounding from producing a negative gate.
  delta = jnp.minimum(jnp.where(valid, z_first - lse_t, 0.0), 0.0)
  gate = jnp.where(valid, -jnp.expm1(delta), 0.0)
  window = kernel_kwargs.get("window")
  if window:                    # a sliding window that no longer sees the first key: A[t, first] = 0, G = 1
    gate = jnp.where(((own - first) >= window)[:, :, None] & jnp.isfinite(lse_t), 1.0, gate)
  return out, gate


def sink_attention(q, k, v, sink, *, segment_ids=None, scale=None, impl="auto", prefix=None, **kernel_kwargs):
  """GPT-OSS sink attention ([Sink-MoE] eq. 1): a learnable logit `sink` [Hq] joins each softmax denominator with
  zero value, A_tj = exp(z_tj) / (sum_j' exp(z_tj') + exp(sink)); causal.

  Shapes and arguments as `vanilla_attention`'s; returns (out [B,T,Hq,D], G [B,T,Hq] float32).
  out = flash_out * sigma(LSE - sink), gate = sigma(LSE - sink) = 1 - A_{t,sink} (eq. 4 in its LSE form, eq. 23;
  the factorization of eq. 3): identical in value and gradient to
  appending a sink column to the logits, taking the softmax and dropping the column. With sink tokens (`prefix`)
  LSE covers them too (they are ordinary keys, unlike the value-less sink logit).
  """
  out, lse, _ = _flash(q, k, v, segment_ids, scale, impl, prefix, kernel_kwargs)
  gate = jax.nn.sigmoid(_heads_last(lse) - sink.astype(jnp.float32))          # [B,T,Hq]; 0 on padding
  out = (out.astype(jnp.float32) * gate[..., None]).astype(q.dtype)
  return out, gate




def gate_score(gate_logits, activation: str = "sigmoid"):
  """The gate score G of gate logits z (what head importance averages, [Sink-MoE] eq. 5; [GatedAttn] Table 4
  "Gate Score").

  sigmoid: sigma(z). ns_sigmoid: 0.5 + 0.5 sigma(z), the factor itself ([GatedAttn] §4.2, Table 4 row 7).
  silu / silu_additive: sigma(z), the sigmoid factor of SiLU(z) = z sigma(z). SiLU multiplies (silu) by an unbounded,
  possibly negative factor, or adds (silu_additive) without any factor, so neither has a gate score of its own;
  sigma(z) keeps G in [0, 1] (importance and its CV stay defined) and is the share of z that SiLU lets through.
  """
  if activation not in GATE_ACTIVATIONS:
    raise ValueError(f"gate activation must be one of {GATE_ACTIVATIONS}, got {activation!r}")
  s = jax.nn.sigmoid(gate_logits.astype(jnp.float32))
  return 0.5 + 0.5 * s if activation == "ns_sigmoid" else s


def apply_gate(y, gate_logits, activation: str = "sigmoid"):
  """Gating of [GatedAttn] eq. 5 and its variants on y [B,T,H,D] (SDPA output at G1, values at G2) -> (y', G).

  gate_logits z: [B,T,Hg] (headwise: one score per head, broadcast over D) or [B,T,Hg,D] (elementwise), with
  Hg = H (head-specific) or 1 (head-shared: the same score for every head); B and T may be 1 (input-independent).
  Multiplicative: y' = y * f(z), f = sigmoid | ns_sigmoid (0.5 + 0.5 sigmoid) | silu (Table 1 row 15).
  Additive (silu_additive, Table 1 row 14): y' = y + SiLU(z) ([GatedAttn] §2.2 (4b) with the SiLU of (5)).
  G = `gate_score(z)` broadcast to [B,T,H] (headwise) or [B,T,H,D] (elementwise), float32.
  """
  z = gate_logits.astype(jnp.float32)
  headwise = z.ndim == 3
  zz = z[..., None] if headwise else z
  yf = y.astype(jnp.float32)
  if activation == "silu_additive":
    out = yf + jax.nn.silu(zz)
  elif activation == "silu":
    out = yf * jax.nn.silu(zz)
  else:
    out = yf * gate_score(zz, activation)
  score = gate_score(z, activation)
  score = jnp.broadcast_to(score, y.shape[:3] if headwise else y.shape)
  return out.astype(y.dtype), score


def gated_attention(q, k, v, gate_logits, *, activation="sigmoid", segment_ids=None, scale=None, impl="auto",
                    prefix=None, **kernel_kwargs):
  """Qwen-style gated attention ([GatedAttn] G1, after SDPA), causal: out = sdpa_out * sigmoid(gate_logits)
  (`apply_gate`), with the explicit gate G_t = sigmoid(x_t W_theta) of [Sink-MoE] eq. 2 (the caller computes the
  logits z = x W_theta (+ b) from the layer's input; `sinkjax.layers.Attention` does).

  q, k, v, segment_ids, scale, impl: as `vanilla_attention`'s. gate_logits: [B,T,Hq] (headwise, eq. 2: one gate per
  head and token) or [B,T,Hq,D] (elementwise, Qwen3-Next); Hq may be 1 (head-shared). `activation`: see
  `apply_gate`. Returns (out [B,T,Hq,D], G [B,T,Hq] or [B,T,Hq,D] float32). `prefix`: sink tokens.
  """
  out, _, _ = _flash(q, k, v, segment_ids, scale, impl, prefix, kernel_kwargs)
  return apply_gate(out, gate_logits, activation)


def value_gated_attention(q, k, v, gate_logits, *, activation="sigmoid", values_gated=False, segment_ids=None,
                          scale=None, impl="auto", prefix=None, **kernel_kwargs):
  """[GatedAttn] G2, gating after the value projection: v'_j = v_j * sigmoid(x_j W) (`apply_gate`), then causal SDPA.

  gate_logits: [B,S,Hkv] or [B,S,Hkv,D] (Hkv may be 1, head-shared), from each KEY token's own input x_j, so the
  gate is fixed per value and cannot depend on the query ([GatedAttn] §4.2 (iii)). values_gated=True: `v` already
  holds the gated values (a layer gates them where they are projected, so that a KV cache stores gated values) and
  only the score of `gate_logits` is computed; it may then belong to the query tokens (T) instead.
  Returns (out [B,T,Hq,D], G): the value gate of each token repeated to the query heads of its KV group,
  [B,·,Hq] or [B,·,Hq,D] (the gate a head applies to that token's value).
  """
  if not values_gated:
    v, _ = apply_gate(v, gate_logits, activation)
  out, _, _ = _flash(q, k, v, segment_ids, scale, impl, prefix, kernel_kwargs)
  score = gate_score(gate_logits, activation)                      # [B,·,Hkv or 1(,D)]
  return out, jnp.repeat(score, q.shape[2] // score.shape[2], axis=2)


def _bos_and_counts(segment_ids, bos_mask, B: int, T: int):
  """BOS flags [B,T] and, per query, the number of visible non-BOS keys (ReLU attention's divisor)."""
  if segment_ids is None:
    seg = jnp.ones((B, T), jnp.int32)
  else:
    seg = jnp.broadcast_to(segment_ids, (B, T)).astype(jnp.int32)
  if bos_mask is None:
    first = jnp.broadcast_to(document_first_index(segment_ids, T), (B, T))
    bos = first == jnp.arange(T, dtype=jnp.int32)[None, :]
  else:
    bos = jnp.broadcast_to(bos_mask, (B, T)).astype(bool)
  bos = bos & (seg != 0)
  return seg, bos


def relu_attention_weights(q, k, *, segment_ids=None, scale=None, bos_mask=None):
  """Materialized causal ReLU attention weights ([SinkNecessary] §3.4), float32 [B,Hq,T,S=T].

  alpha_{t,j} = ReLU(z_tj) / n_t for visible keys j <= t (same segment), z_tj = q_t.k_j * scale, where
  n_t = max(1, #{j <= t in t's segment : j is not BOS}). The BOS key is NOT removed from the numerator: it
  receives ReLU(z_t,BOS)/n_t like any other key (this is the "BOS attention" that the paper shows can be zero);
  it is only left out of the count. At a BOS query n_t would be 0, so it is clamped to 1 (as in the paper's code).
  BOS defaults to the first token of each segment (position 0 without segment ids); `bos_mask` [B,T] bool overrides.
  Padding rows (segment id 0) are all zero.
  """
  B, T, Hq, D = q.shape
  Hkv = k.shape[2]
  scale = 1.0 / math.sqrt(D) if scale is None else scale
  seg, bos = _bos_and_counts(segment_ids, bos_mask, B, T)
  kk = jnp.repeat(k, Hq // Hkv, axis=2)
  z = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kk.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST) * scale
  mask = attention_mask(seg, seg, True)                                          # [B,T,S]
  n = jnp.sum(mask & ~bos[:, None, :], axis=-1).astype(jnp.float32)             # [B,T]
  n = jnp.maximum(n, 1.0)
  return jnp.where(mask[:, None], jax.nn.relu(z), 0.0) / n[:, None, :, None]


def relu_attention(q, k, v, *, segment_ids=None, scale=None, bos_mask=None):
  """Causal ReLU attention of [SinkNecessary] §3.4 (not a softmax, so weights are materialized and there is no LSE).

  out_t = sum_{j<=t} ReLU(q_t.k_j * scale) / n_t * v_j with n_t the number of non-BOS positions up to t (see
  `relu_attention_weights`). Layout [B,T,H,D]; GQA (Hq % Hkv == 0) is allowed.

  Returns (out [B,T,Hq,D] in q.dtype, gate [B,T,Hq] float32). The gate is the attention mass on non-BOS keys,
  G_t = sum_{j not BOS} alpha_tj: the analogue of vanilla attention's 1 - A_{t,first} (it is 0 at a BOS query and
  on padding). Unlike the softmax gates it is not bounded by 1 (ReLU weights are unnormalized).
  """
  B, T, Hq, D = q.shape
  Hkv = k.shape[2]
  w = relu_attention_weights(q, k, segment_ids=segment_ids, scale=scale, bos_mask=bos_mask)   # [B,H,T,S]
  _, bos = _bos_and_counts(segment_ids, bos_mask, B, T)
  vv = jnp.repeat(v, Hq // Hkv, axis=2).astype(jnp.float32)
  out = jnp.einsum("bhts,bshd->bthd", w, vv, precision=jax.lax.Precision.HIGHEST)
  gate = jnp.swapaxes(jnp.sum(jnp.where(bos[:, None, None, :], 0.0, w), axis=-1), 1, 2)   # [B,T,Hq]
  return out.astype(q.dtype), gate
