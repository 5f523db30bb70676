"""Blockwise flash attention in plain JAX: an online-softmax scan over key blocks, forward and backward.

Memory is O(T * block_k) per head instead of O(T * S): only one [T, block_k] tile of scores exists at a time.
Runs everywhere XLA does; the default on CPU and the fallback for the Pallas backends.

Backend contract (shared by every non-reference backend, see `flash.py`):
  fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes, interpret) -> (out, lse)
  bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes, interpret) -> (dq, dk, dv)
(the cudnn backend also takes `segmented`: whether segment ids were given, `cudnn.py`)
with q [B,T,Hq,D], k/v [B,S,Hkv,D], segment ids int32 [B,T] / [B,S] (0 = padding), out [B,T,Hq,D] in q.dtype,
lse float32 [B,Hq,T] (-inf on rows with no visible key) and `block_sizes` a `BlockSizes` (None fields = the
backend's `DEFAULT_BLOCK_SIZES`). Index arithmetic is int32 throughout, so the backends run under jax_enable_x64.

Tiles here: the forward scans key blocks of `block_k`, the backward (one fused scan: each key block's dK, dV and
its share of dQ) key blocks of `block_kv_dkv`. Causal attention also cuts the queries into row blocks (`block_q`
forward, `block_q_dkv` backward) and each row block scans only the keys it can see, so the masked upper triangle
is never computed: at T = S = 512 with 128-row blocks, 10 of 16 tiles (docs/PERF.md, "Training step on a CPU").
The row blocks are a static Python loop (T / block_q of them); non-causal attention is never row-tiled.

Layout. The kernel is written for one (batch row, KV head) pair: its G = Hq / Hkv query heads [G, T, D] against
keys [S, D]. Every matmul takes its operands in the row-major form a CPU matmul library wants (contracting the
lhs' last and the rhs' first dimension): scores q @ K^T read keys stored transposed (K^T [D, S], made once per
call), dV and dK come out transposed (dV^T = dO^T P, dK^T = Q^T dS, so neither P nor dS, the big [Tq, bk] tiles,
is ever transposed; only the small [T, D] operands are). The pairs are then batched: on accelerators all at once
(vmap); on a CPU `_CPU_TILE` elements of score tile at a time (`lax.map` with a batch size: 2 pairs at 128 x 512),
so that the ~10 elementwise passes over each tile run in cache instead of streaming B x H tiles through memory.
Both made the issue-20 shape's attention (B 8, H 4, T 512, D 64, float32, fwd + bwd) ~1.5x faster on 2 cores, level
with PyTorch's fused CPU flash kernel (which has no LSE gradient term to compute; docs/PERF.md).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sinkjax.kernels.blocks import BlockSizes
from sinkjax.sharding import target_platform

DEFAULT_BLOCK_SIZES = BlockSizes(block_q=128, block_k=512, block_q_dkv=128, block_kv_dkv=512)
_F32 = jnp.float32
_CPU_TILE = 2 * 128 * 512     # score-tile elements per lax.map step on a CPU (pairs x G x rows x keys)


def _row_blocks(T, S, causal, block_q):
  """[(first query, end query, end key)]: the query row blocks and the keys [0, end key) that each can see."""
  if not causal or block_q is None or block_q >= T:
    return [(0, T, S)]
  return [(r, min(r + block_q, T), min(S, max(min(r + block_q, T) + S - T, 0))) for r in range(0, T, block_q)]


def _blocks(x, axis, bk):
  """x cut along `axis` into blocks of bk (zero-padded: padded keys get segment 0, so they are never attended), the
  block index moved to the front (what lax.scan steps over)."""
  n = x.shape[axis]
  nk = -(-n // bk)
  if nk * bk != n:
    x = jnp.pad(x, [(0, nk * bk - n if a == axis else 0) for a in range(x.ndim)])
  x = x.reshape(x.shape[:axis] + (nk, bk) + x.shape[axis + 1:])
  return jnp.moveaxis(x, axis, 0)


def _unblock(x, axis, n):
  """The inverse of `_blocks` for an output stacked by lax.scan: blocks joined along `axis`, the padding cut off."""
  x = jnp.moveaxis(x, 0, axis)
  x = x.reshape(x.shape[:axis] + (-1,) + x.shape[axis + 2:])
  return jax.lax.slice_in_dim(x, 0, n, axis=axis)


def _key_ids(ks, bk):
  """Segment ids of one pair's keys cut into blocks of bk (padding: segment 0) and the blocks' key indices."""
  ksb = _blocks(ks, 0, bk)
  return ksb, jnp.arange(ksb.shape[0] * bk, dtype=jnp.int32).reshape(-1, bk)


def _query_pairs(x, Hkv):
  """Queries (or dO) [B, T, Hq, D] -> per pair: [B * Hkv, G, T, D]."""
  B, T, Hq, D = x.shape
  return jnp.transpose(x.reshape(B, T, Hkv, Hq // Hkv, D), (0, 2, 3, 1, 4)).reshape(B * Hkv, Hq // Hkv, T, D)


def _minor(x, B, Hkv):
  """Keys or values [B, S, Hkv, D] -> per pair, transposed: [B * Hkv, D, S]."""
  return jnp.transpose(x, (0, 2, 3, 1)).reshape(B * Hkv, x.shape[3], x.shape[1])


def _mask(qs, ks_blk, k_idx, causal, T, S, q_start):
  """[Tq, bk] visibility of one key block for the queries q_start.. of T."""
  mask = (qs[:, None] == ks_blk[None, :]) & (qs[:, None] != 0)
  if causal:
    q_pos = jnp.arange(qs.shape[0], dtype=jnp.int32)[:, None] + (q_start + S - T)
    mask &= k_idx[None, :] <= q_pos
  return mask


def _pairs(B, Hkv, q, k, v, q_seg, kv_seg):
  """Per (batch row, kv head) pair: q [N, G, T, D], kT [N, D, S], k and v [N, S, D], segment ids [N, T], [N, S]."""
  S, D = k.shape[1], k.shape[3]
  qh = _query_pairs(q, Hkv)
  kh = jnp.swapaxes(k, 1, 2).reshape(B * Hkv, S, D)
  vh = jnp.swapaxes(v, 1, 2).reshape(B * Hkv, S, D)
  return qh, kh, _minor(k, B, Hkv), vh, jnp.repeat(q_seg, Hkv, axis=0), jnp.repeat(kv_seg, Hkv, axis=0)


def _unpairs_q(x, B, Hkv):
  """[N, G, T, D] -> [B, T, Hq, D]."""
  N, G, T, D = x.shape
  return jnp.transpose(x.reshape(B, Hkv, G, T, D), (0, 3, 1, 2, 4)).reshape(B, T, Hkv * G, D)


def _map_pairs(f, xs, tile: int):
  """f (written for one pair) over the leading pair axis of every array in xs: vmapped on accelerators; on a CPU in
  steps of as many pairs as fit `_CPU_TILE` score elements (`tile` = elements of one pair's score tile)."""
  n = xs[0].shape[0]
  per_step = max(1, _CPU_TILE // tile)
  if target_platform() != "cpu" or per_step >= n:
    return jax.vmap(f)(*xs)
  return jax.lax.map(lambda a: f(*a), xs, batch_size=per_step)


def fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes=BlockSizes(), interpret=None):
  """(out, lse) of the backend contract above."""
  del interpret
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  bs = block_sizes.or_defaults(DEFAULT_BLOCK_SIZES)
  qh, _, kT, vh, qs, ks = _pairs(B, Hkv, q, k, v, q_seg, kv_seg)
  rows = _row_blocks(T, S, causal, bs.block_q)

  def one(qh, kT, vh, qs, ks):
    parts = [_fwd_rows(qh[:, r0:r1], kT[:, :e], vh[:e], qs[r0:r1], ks[:e], causal=causal, scale=scale,
                       block_k=bs.block_k, q_start=r0, T=T, S=S) for r0, r1, e in rows]
    return parts[0] if len(parts) == 1 else tuple(jnp.concatenate(x, axis=1) for x in zip(*parts))

  tile = G * max(r1 - r0 for r0, r1, _ in rows) * min(bs.block_k, S)
  out, lse = _map_pairs(one, (qh, kT, vh, qs, ks), tile)
  return _unpairs_q(out, B, Hkv).astype(q.dtype), lse.reshape(B, Hq, T)


def _fwd_rows(qh, kT, vh, qs, ks, *, causal, scale, block_k, q_start, T, S):
  """(out float32 [G, Tq, D], lse [G, Tq]) of one pair's queries qh (rows q_start.. of T) against its first Se keys
  of S (kT [D, Se], vh [Se, D]), scanning key blocks of block_k."""
  G, Tq, D = qh.shape
  Se = kT.shape[1]
  init = (jnp.full((G, Tq), -jnp.inf, _F32), jnp.zeros((G, Tq), _F32), jnp.zeros((G, Tq, D), _F32))
  if Se == 0:
    m, l, acc = init
  else:
    bk = min(block_k, Se)

    def step(carry, blk):
      m, l, acc = carry
      kT_blk, v_blk, ks_blk, k_idx = blk
      s = jnp.einsum("gtd,ds->gts", qh, kT_blk, preferred_element_type=_F32) * scale
      s = jnp.where(_mask(qs, ks_blk, k_idx, causal, T, S, q_start)[None], s, -jnp.inf)
      m_new = jnp.maximum(m, s.max(-1))
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp(m - m_safe)
      p = jnp.exp(s - m_safe[..., None])
      l = l * alpha + p.sum(-1)
      pv = jnp.einsum("gts,sd->gtd", p.astype(vh.dtype), v_blk, preferred_element_type=_F32)
      return (m_new, l, acc * alpha[..., None] + pv), None

    ksb, k_idx = _key_ids(ks, bk)
    (m, l, acc), _ = jax.lax.scan(step, init, (_blocks(kT, 1, bk), _blocks(vh, 0, bk), ksb, k_idx))
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
  qh, kh, kT, _, qs, ks = _pairs(B, Hkv, q, k, v, q_seg, kv_seg)
  vT = _minor(v, B, Hkv)
  doh = _query_pairs(dout, Hkv)
  delta = jnp.einsum("bthd,bthd->bht", dout.astype(_F32), out.astype(_F32))
  finite = jnp.isfinite(lse)
  lse_g = jnp.where(finite, lse, 0.0).reshape(B * Hkv, G, T)
  row_g = (jnp.where(finite, dlse, 0.0) - delta).reshape(B * Hkv, G, T)
  rows = _row_blocks(T, S, causal, bs.block_q_dkv)

  def one(qh, kh, kT, vT, doh, qs, ks, lse_g, row_g):
    qT, doT = jnp.swapaxes(qh, 1, 2), jnp.swapaxes(doh, 1, 2)
    dq_parts, dkT, dvT = [], None, None
    for r0, r1, e in rows:
      dq_r, dk_r, dv_r = _bwd_rows(qh[:, r0:r1], qT[:, :, r0:r1], kh[:e], kT[:, :e], vT[:, :e], qs[r0:r1], ks[:e],
                                   doh[:, r0:r1], doT[:, :, r0:r1], lse_g[:, r0:r1], row_g[:, r0:r1],
                                   causal=causal, scale=scale, block_k=bs.block_kv_dkv, q_start=r0, T=T, S=S)
      dq_parts.append(dq_r)
      if e < S:                 # keys this row block cannot see get no gradient from it
        dk_r, dv_r = (jnp.pad(x, ((0, 0), (0, S - e))) for x in (dk_r, dv_r))
      dkT, dvT = (dk_r, dv_r) if dkT is None else (dkT + dk_r, dvT + dv_r)
    dq = dq_parts[0] if len(dq_parts) == 1 else jnp.concatenate(dq_parts, axis=1)
    return dq, dkT, dvT

  tile = G * max(r1 - r0 for r0, r1, _ in rows) * min(bs.block_kv_dkv, S)
  dq, dkT, dvT = _map_pairs(one, (qh, kh, kT, vT, doh, qs, ks, lse_g, row_g), tile)
  from_minor = lambda x: jnp.transpose(x.reshape(B, Hkv, D, S), (0, 3, 1, 2))
  return (_unpairs_q(dq * scale, B, Hkv).astype(q.dtype), from_minor(dkT * scale).astype(k.dtype),
          from_minor(dvT).astype(v.dtype))


def _bwd_rows(qh, qT, kh, kT, vT, qs, ks, doh, doT, lse_g, row_g, *, causal, scale, block_k, q_start, T, S):
  """(dq [G, Tq, D], dK^T, dV^T [D, Se]) in float32 of one pair's queries (rows q_start.. of T; qh and its transpose
  qT) against its first Se keys (kh, kT, vT); dq and dK without the factor `scale`. lse_g finite; row_g = dLSE - D."""
  G, Tq, D = qh.shape
  Se = kh.shape[0]
  if Se == 0:
    return jnp.zeros(qh.shape, _F32), jnp.zeros(kT.shape, _F32), jnp.zeros(vT.shape, _F32)

  def step(dq, blk):
    k_blk, kT_blk, vT_blk, ks_blk, k_idx = blk
    s = jnp.einsum("gtd,ds->gts", qh, kT_blk, preferred_element_type=_F32) * scale
    s = jnp.where(_mask(qs, ks_blk, k_idx, causal, T, S, q_start)[None], s, -jnp.inf)
    p = jnp.exp(s - lse_g[..., None])
    dvT = jnp.einsum("gdt,gts->ds", doT, p.astype(doh.dtype), preferred_element_type=_F32)
    dp = jnp.einsum("gtd,ds->gts", doh, vT_blk, preferred_element_type=_F32)
    ds = (p * (dp + row_g[..., None])).astype(qh.dtype)
    dq = dq + jnp.einsum("gts,sd->gtd", ds, k_blk, preferred_element_type=_F32)
    dkT = jnp.einsum("gdt,gts->ds", qT, ds, preferred_element_type=_F32)
    return dq, (dkT, dvT)

  bk = min(block_k, Se)
  ksb, k_idx = _key_ids(ks, bk)
  xs = (_blocks(kh, 0, bk), _blocks(kT, 1, bk), _blocks(vT, 1, bk), ksb, k_idx)
  dq, (dkT, dvT) = jax.lax.scan(step, jnp.zeros((G, Tq, D), _F32), xs)
  return dq, _unblock(dkT, 1, Se), _unblock(dvT, 1, Se)
