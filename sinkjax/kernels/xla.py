"""Blockwise flash attention in plain JAX: an online-softmax scan over key blocks, forward and backward.

Memory is O(T * block_k) per head instead of O(T * S): only one [T, block_k] tile of scores exists at a time.
Runs everywhere XLA does; the default on CPU and the fallback for the Pallas backends.

Backend contract (shared by every non-reference backend, see `flash.py`):
  fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes, interpret) -> (out, lse)
  bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes, interpret) -> (dq, dk, dv)
with q [B,T,Hq,D], k/v [B,S,Hkv,D], segment ids int32 [B,T] / [B,S] (0 = padding), out [B,T,Hq,D] in q.dtype,
lse float32 [B,Hq,T] (-inf on rows with no visible key) and `block_sizes` a `BlockSizes` (None fields = the
backend's `DEFAULT_BLOCK_SIZES`). Index arithmetic is int32 throughout, so the backends run under jax_enable_x64.

Tiles here: the forward scans key blocks of `block_k`, the backward (one fused scan: each key block's dK, dV and
its share of dQ) key blocks of `block_kv_dkv`. Causal attention also cuts the queries into row blocks (`block_q`
forward, `block_q_dkv` backward) and each row block scans only the keys it can see, so the masked upper triangle
is never computed: at T = S = 512 with 128-row blocks, 10 of 16 tiles (docs/PERF.md, "Training step on a CPU").
The row blocks are a static Python loop (T / block_q of them); non-causal attention is never row-tiled. Inside,
everything is head-major ([B, Hkv, G, T, D] queries, [B, Hkv, S, D] keys): q, k, v (and dO, O) are transposed once
per call, not once per row block and pass.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sinkjax.kernels.blocks import BlockSizes

DEFAULT_BLOCK_SIZES = BlockSizes(block_q=128, block_k=512, block_q_dkv=128, block_kv_dkv=512)
_F32 = jnp.float32


def _key_blocks(k, v, kv_seg, block_k):
  """Pads the key axis of head-major k, v [B, Hkv, S, D] to a multiple of block_k (padding gets segment 0, hence is
  never attended) and splits it: ([nk, B, Hkv, bk, D] twice, [nk, B, bk], key indices [nk, bk])."""
  B, Hkv, S, D = k.shape
  bk = min(block_k, S)
  nk = -(-S // bk)
  pad = nk * bk - S
  if pad:
    k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    kv_seg = jnp.pad(kv_seg, ((0, 0), (0, pad)))
  split = lambda x: jnp.moveaxis(x.reshape(B, Hkv, nk, bk, D), 2, 0)
  k_idx = jnp.arange(nk * bk, dtype=jnp.int32).reshape(nk, bk)
  return split(k), split(v), jnp.moveaxis(kv_seg.reshape(B, nk, bk), 1, 0), k_idx


def _block_mask(q_seg, seg_blk, k_idx, causal, T, S, q_start=0):
  """[B, 1, 1, Tq, bk] visibility of one key block for the queries q_start .. q_start + Tq - 1 of T (broadcasts over
  [B, Hkv, G, Tq, bk])."""
  mask = (q_seg[:, :, None] == seg_blk[:, None, :]) & (q_seg[:, :, None] != 0)
  if causal:
    q_pos = jnp.arange(q_seg.shape[1], dtype=jnp.int32)[:, None] + (q_start + S - T)
    mask &= k_idx[None, :] <= q_pos
  return mask[:, None, None]


def _query_major(x, Hkv):
  """[B, T, Hq, D] -> [B, Hkv, G, T, D] (the G = Hq / Hkv query heads of each KV head)."""
  B, T, Hq, D = x.shape
  return jnp.moveaxis(x.reshape(B, T, Hkv, Hq // Hkv, D), 1, 3)


def _key_major(x):
  """[B, S, Hkv, D] -> [B, Hkv, S, D]."""
  return jnp.swapaxes(x, 1, 2)


def _row_blocks(T, S, causal, block_q):
  """[(first query, end query, end key)]: the query row blocks and the keys [0, end key) that each can see."""
  if not causal or block_q is None or block_q >= T:
    return [(0, T, S)]
  return [(r, min(r + block_q, T), min(S, max(min(r + block_q, T) + S - T, 0))) for r in range(0, T, block_q)]


def fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes=BlockSizes(), interpret=None):
  del interpret
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  bs = block_sizes.or_defaults(DEFAULT_BLOCK_SIZES)
  qh, kh, vh = _query_major(q, Hkv), _key_major(k), _key_major(v)
  parts = [_fwd_rows(qh[:, :, :, r0:r1], kh[:, :, :e], vh[:, :, :e], q_seg[:, r0:r1], kv_seg[:, :e], causal=causal,
                     scale=scale, block_k=bs.block_k, q_start=r0, T=T, S=S)
           for r0, r1, e in _row_blocks(T, S, causal, bs.block_q)]
  out, lse = parts[0] if len(parts) == 1 else (jnp.concatenate(x, axis=3) for x in zip(*parts))
  out = jnp.moveaxis(out, 3, 1).reshape(B, T, Hq, D).astype(q.dtype)
  return out, lse.reshape(B, Hq, T)


def _fwd_rows(qh, kh, vh, q_seg, kv_seg, *, causal, scale, block_k, q_start, T, S):
  """(out float32 [B, Hkv, G, Tq, D], lse [B, Hkv, G, Tq]) of the head-major queries qh (rows q_start.. of T)
  against the head-major keys kh, vh (the first keys of S)."""
  B, Hkv, G, Tq, D = qh.shape

  def step(carry, blk):
    m, l, acc = carry
    k_blk, v_blk, seg_blk, k_idx = blk
    s = jnp.einsum("bkgtd,bksd->bkgts", qh, k_blk, preferred_element_type=_F32) * scale
    s = jnp.where(_block_mask(q_seg, seg_blk, k_idx, causal, T, S, q_start), s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)       # rows with nothing visible yet
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[..., None])
    l = l * alpha + p.sum(-1)
    pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(vh.dtype), v_blk, preferred_element_type=_F32)
    acc = acc * alpha[..., None] + pv
    return (m_new, l, acc), None

  init = (jnp.full((B, Hkv, G, Tq), -jnp.inf, _F32), jnp.zeros((B, Hkv, G, Tq), _F32),
          jnp.zeros((B, Hkv, G, Tq, D), _F32))
  if kh.shape[2] == 0:        # a row block that sees no key (T > S): nothing to scan
    m, l, acc = init
  else:
    (m, l, acc), _ = jax.lax.scan(step, init, _key_blocks(kh, vh, kv_seg, block_k))
  valid = l > 0
  lse = jnp.where(valid, m + jnp.log(jnp.where(valid, l, 1.0)), -jnp.inf)
  return acc / jnp.where(valid, l, 1.0)[..., None], lse


def bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes=BlockSizes(), interpret=None):
  """dS = P o (dP - rowsum(dO o O) + dLSE): the LSE cotangent enters every score's gradient."""
  del interpret
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  bs = block_sizes.or_defaults(DEFAULT_BLOCK_SIZES)
  qh, kh, vh, oh, doh = _query_major(q, Hkv), _key_major(k), _key_major(v), _query_major(out, Hkv), \
      _query_major(dout, Hkv)
  finite = jnp.isfinite(lse)
  lse_g = jnp.where(finite, lse, 0.0).reshape(B, Hkv, G, T)
  dlse_g = jnp.where(finite, dlse, 0.0).reshape(B, Hkv, G, T)
  dq_parts, dk, dv = [], None, None
  for r0, r1, e in _row_blocks(T, S, causal, bs.block_q_dkv):
    rows = lambda x: x[:, :, :, r0:r1]
    dq_r, dk_r, dv_r = _bwd_rows(rows(qh), kh[:, :, :e], vh[:, :, :e], q_seg[:, r0:r1], kv_seg[:, :e], rows(oh),
                                 rows(lse_g), rows(doh), rows(dlse_g), causal=causal, scale=scale,
                                 block_k=bs.block_kv_dkv, q_start=r0, T=T, S=S)
    dq_parts.append(dq_r)
    if e < S:                 # keys this row block cannot see get no gradient from it
      pad = ((0, 0), (0, 0), (0, S - e), (0, 0))
      dk_r, dv_r = jnp.pad(dk_r, pad), jnp.pad(dv_r, pad)
    dk, dv = (dk_r, dv_r) if dk is None else (dk + dk_r, dv + dv_r)
  dq = dq_parts[0] if len(dq_parts) == 1 else jnp.concatenate(dq_parts, axis=3)
  dq = (jnp.moveaxis(dq, 3, 1) * scale).reshape(B, T, Hq, D).astype(q.dtype)
  return dq, (_key_major(dk) * scale).astype(k.dtype), _key_major(dv).astype(v.dtype)


def _bwd_rows(qh, kh, vh, q_seg, kv_seg, oh, lse_g, doh, dlse_g, *, causal, scale, block_k, q_start, T, S):
  """(dq [B, Hkv, G, Tq, D], dk, dv [B, Hkv, Se, D]) in float32, head-major, of the queries qh (rows q_start.. of T)
  against the keys kh, vh (the first Se keys of S); dq and dk without the factor `scale`. lse_g / dlse_g: finite."""
  B, Hkv, G, Tq, D = qh.shape
  Se = kh.shape[2]
  if Se == 0:
    return jnp.zeros(qh.shape, _F32), jnp.zeros(kh.shape, _F32), jnp.zeros(vh.shape, _F32)
  delta = jnp.einsum("bkgtd,bkgtd->bkgt", doh.astype(_F32), oh.astype(_F32))
  row_term = dlse_g - delta                                   # [B,Hkv,G,Tq]

  def step(dq, blk):
    k_blk, v_blk, seg_blk, k_idx = blk
    s = jnp.einsum("bkgtd,bksd->bkgts", qh, k_blk, preferred_element_type=_F32) * scale
    s = jnp.where(_block_mask(q_seg, seg_blk, k_idx, causal, T, S, q_start), s, -jnp.inf)
    p = jnp.exp(s - lse_g[..., None])
    dv = jnp.einsum("bkgts,bkgtd->bksd", p.astype(doh.dtype), doh, preferred_element_type=_F32)
    dp = jnp.einsum("bkgtd,bksd->bkgts", doh, v_blk, preferred_element_type=_F32)
    ds = (p * (dp + row_term[..., None])).astype(qh.dtype)
    dq = dq + jnp.einsum("bkgts,bksd->bkgtd", ds, k_blk, preferred_element_type=_F32)
    dk = jnp.einsum("bkgts,bkgtd->bksd", ds, qh, preferred_element_type=_F32)
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros((B, Hkv, G, Tq, D), _F32), _key_blocks(kh, vh, kv_seg, block_k))
  unsplit = lambda x: jnp.moveaxis(x, 0, 2).reshape(B, Hkv, -1, D)[:, :, :Se]
  return dq, unsplit(dk), unsplit(dv)
