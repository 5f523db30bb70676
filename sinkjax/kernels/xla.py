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
The row blocks are a static Python loop (T / block_q of them); non-causal attention is never row-tiled.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sinkjax.kernels.blocks import BlockSizes

DEFAULT_BLOCK_SIZES = BlockSizes(block_q=128, block_k=512, block_q_dkv=128, block_kv_dkv=512)
_F32 = jnp.float32


def _key_blocks(k, v, kv_seg, block_k):
  """Pads the key axis to a multiple of block_k (padding gets segment 0, hence is never attended) and splits it."""
  B, S, Hkv, D = k.shape
  bk = min(block_k, S)
  nk = -(-S // bk)
  pad = nk * bk - S
  if pad:
    k = jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0)))
    kv_seg = jnp.pad(kv_seg, ((0, 0), (0, pad)))
  split = lambda x: jnp.moveaxis(x.reshape(B, nk, bk, *x.shape[2:]), 1, 0)
  k_idx = jnp.arange(nk * bk, dtype=jnp.int32).reshape(nk, bk)
  return split(k), split(v), split(kv_seg), k_idx


def _block_mask(q_seg, seg_blk, k_idx, causal, T, S, q_start=0):
  """[B, 1, 1, Tq, bk] visibility of one key block for the queries q_start .. q_start + Tq - 1 of T (broadcasts over
  [B, Hkv, G, Tq, bk])."""
  mask = (q_seg[:, :, None] == seg_blk[:, None, :]) & (q_seg[:, :, None] != 0)
  if causal:
    q_pos = jnp.arange(q_seg.shape[1], dtype=jnp.int32)[:, None] + (q_start + S - T)
    mask &= k_idx[None, :] <= q_pos
  return mask[:, None, None]


def _grouped(q, Hkv):
  B, T, Hq, D = q.shape
  return q.reshape(B, T, Hkv, Hq // Hkv, D)


def _row_blocks(T, S, causal, block_q):
  """[(first query, end query, end key)]: the query row blocks and the keys [0, end key) that each can see."""
  if not causal or block_q is None or block_q >= T:
    return [(0, T, S)]
  return [(r, min(r + block_q, T), min(S, max(min(r + block_q, T) + S - T, 0))) for r in range(0, T, block_q)]


def fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes=BlockSizes(), interpret=None):
  del interpret
  T, S = q.shape[1], k.shape[1]
  bs = block_sizes.or_defaults(DEFAULT_BLOCK_SIZES)
  parts = [_fwd_rows(q[:, r0:r1], k[:, :e], v[:, :e], q_seg[:, r0:r1], kv_seg[:, :e], causal=causal, scale=scale,
                     block_k=bs.block_k, q_start=r0, T=T, S=S) for r0, r1, e in _row_blocks(T, S, causal, bs.block_q)]
  if len(parts) == 1:
    return parts[0]
  return jnp.concatenate([o for o, _ in parts], axis=1), jnp.concatenate([l for _, l in parts], axis=2)


def _fwd_rows(q, k, v, q_seg, kv_seg, *, causal, scale, block_k, q_start, T, S):
  """(out, lse) of the queries q (rows q_start.. of T) against the keys k, v (the first keys of S)."""
  B, Tq, Hq, D = q.shape
  Hkv = k.shape[2]
  G = Hq // Hkv
  qg = _grouped(q, Hkv)

  def step(carry, blk):
    m, l, acc = carry
    k_blk, v_blk, seg_blk, k_idx = blk
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k_blk, preferred_element_type=_F32) * scale
    s = jnp.where(_block_mask(q_seg, seg_blk, k_idx, causal, T, S, q_start), s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)       # rows with nothing visible yet
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[..., None])
    l = l * alpha + p.sum(-1)
    pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v_blk, preferred_element_type=_F32)
    acc = acc * alpha[..., None] + pv
    return (m_new, l, acc), None

  init = (jnp.full((B, Hkv, G, Tq), -jnp.inf, _F32), jnp.zeros((B, Hkv, G, Tq), _F32),
          jnp.zeros((B, Hkv, G, Tq, D), _F32))
  if k.shape[1] == 0:         # a row block that sees no key (T > S): nothing to scan
    m, l, acc = init
  else:
    (m, l, acc), _ = jax.lax.scan(step, init, _key_blocks(k, v, kv_seg, block_k))
  valid = l > 0
  lse = jnp.where(valid, m + jnp.log(jnp.where(valid, l, 1.0)), -jnp.inf)
  out = acc / jnp.where(valid, l, 1.0)[..., None]
  out = jnp.moveaxis(out, 3, 1).reshape(B, Tq, Hq, D).astype(q.dtype)
  return out, lse.reshape(B, Hq, Tq)


def bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes=BlockSizes(), interpret=None):
  """dS = P o (dP - rowsum(dO o O) + dLSE): the LSE cotangent enters every score's gradient."""
  del interpret
  T, S = q.shape[1], k.shape[1]
  bs = block_sizes.or_defaults(DEFAULT_BLOCK_SIZES)
  dq_parts, dk, dv = [], None, None
  for r0, r1, e in _row_blocks(T, S, causal, bs.block_q_dkv):
    dq_r, dk_r, dv_r = _bwd_rows(q[:, r0:r1], k[:, :e], v[:, :e], q_seg[:, r0:r1], kv_seg[:, :e], out[:, r0:r1],
                                 lse[:, :, r0:r1], dout[:, r0:r1], dlse[:, :, r0:r1], causal=causal, scale=scale,
                                 block_k=bs.block_kv_dkv, q_start=r0, T=T, S=S)
    dq_parts.append(dq_r)
    if e < S:                 # keys this row block cannot see get no gradient from it
      pad = ((0, 0), (0, S - e), (0, 0), (0, 0))
      dk_r, dv_r = jnp.pad(dk_r, pad), jnp.pad(dv_r, pad)
    dk, dv = (dk_r, dv_r) if dk is None else (dk + dk_r, dv + dv_r)
  dq = dq_parts[0] if len(dq_parts) == 1 else jnp.concatenate(dq_parts, axis=1)
  return dq.astype(q.dtype), (dk * scale).astype(k.dtype), dv.astype(v.dtype)


def _bwd_rows(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_k, q_start, T, S):
  """(dq, dk, dv) in float32 of the queries q (rows q_start.. of T) against the keys k, v (the first keys of S);
  dk without the factor `scale`."""
  B, Tq, Hq, D = q.shape
  Se, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  if Se == 0:
    return jnp.zeros((B, Tq, Hq, D), _F32), jnp.zeros(k.shape, _F32), jnp.zeros(v.shape, _F32)
  qg = _grouped(q, Hkv)
  dog = _grouped(dout, Hkv)
  finite = jnp.isfinite(lse)
  lse_g = jnp.where(finite, lse, 0.0).reshape(B, Hkv, G, Tq)
  dlse_g = jnp.where(finite, dlse, 0.0).reshape(B, Hkv, G, Tq)
  delta = jnp.einsum("btkgd,btkgd->bkgt", dog.astype(_F32), _grouped(out, Hkv).astype(_F32))
  row_term = dlse_g - delta                                   # [B,Hkv,G,Tq]
  blocks = _key_blocks(k, v, kv_seg, block_k)

  def step(dq, blk):
    k_blk, v_blk, seg_blk, k_idx = blk
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k_blk, preferred_element_type=_F32) * scale
    s = jnp.where(_block_mask(q_seg, seg_blk, k_idx, causal, T, S, q_start), s, -jnp.inf)
    p = jnp.exp(s - lse_g[..., None])
    dv = jnp.einsum("bkgts,btkgd->bskd", p.astype(dout.dtype), dog, preferred_element_type=_F32)
    dp = jnp.einsum("btkgd,bskd->bkgts", dog, v_blk, preferred_element_type=_F32)
    ds = (p * (dp + row_term[..., None])).astype(q.dtype)
    dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds, k_blk, preferred_element_type=_F32)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, qg, preferred_element_type=_F32)
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros((B, Tq, Hkv, G, D), _F32), blocks)
  unsplit = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, -1, Hkv, D)[:, :Se]
  return (dq * scale).reshape(B, Tq, Hq, D), unsplit(dk), unsplit(dv)
