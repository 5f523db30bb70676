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
its share of dQ) key blocks of `block_kv_dkv`; queries are never tiled.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from sinkjax.kernels.blocks import BlockSizes

DEFAULT_BLOCK_SIZES = BlockSizes(block_k=512, block_kv_dkv=512)
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


def _block_mask(q_seg, seg_blk, k_idx, causal, T, S):
  """[B, 1, 1, T, bk] visibility of one key block (broadcasts over [B, Hkv, G, T, bk])."""
  mask = (q_seg[:, :, None] == seg_blk[:, None, :]) & (q_seg[:, :, None] != 0)
  if causal:
    q_pos = jnp.arange(T, dtype=jnp.int32)[:, None] + (S - T)
    mask &= k_idx[None, :] <= q_pos
  return mask[:, None, None]


def _grouped(q, Hkv):
  B, T, Hq, D = q.shape
  return q.reshape(B, T, Hkv, Hq // Hkv, D)


def fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes=BlockSizes(), interpret=None):
  del interpret
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  qg = _grouped(q, Hkv)
  blocks = _key_blocks(k, v, kv_seg, block_sizes.or_defaults(DEFAULT_BLOCK_SIZES).block_k)

  def step(carry, blk):
    m, l, acc = carry
    k_blk, v_blk, seg_blk, k_idx = blk
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k_blk, preferred_element_type=_F32) * scale
    s = jnp.where(_block_mask(q_seg, seg_blk, k_idx, causal, T, S), s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(-1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)       # rows with nothing visible yet
    alpha = jnp.exp(m - m_safe)
    p = jnp.exp(s - m_safe[..., None])
    l = l * alpha + p.sum(-1)
    pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v_blk, preferred_element_type=_F32)
    acc = acc * alpha[..., None] + pv
    return (m_new, l, acc), None

  init = (jnp.full((B, Hkv, G, T), -jnp.inf, _F32), jnp.zeros((B, Hkv, G, T), _F32),
          jnp.zeros((B, Hkv, G, T, D), _F32))
  (m, l, acc), _ = jax.lax.scan(step, init, blocks)
  valid = l > 0
  lse = jnp.where(valid, m + jnp.log(jnp.where(valid, l, 1.0)), -jnp.inf)
  out = acc / jnp.where(valid, l, 1.0)[..., None]
  out = jnp.moveaxis(out, 3, 1).reshape(B, T, Hq, D).astype(q.dtype)
  return out, lse.reshape(B, Hq, T)


def bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes=BlockSizes(), interpret=None):
  """dS = P o (dP - rowsum(dO o O) + dLSE): the LSE cotangent enters every score's gradient."""
  del interpret
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  qg = _grouped(q, Hkv)
  dog = _grouped(dout, Hkv)
  finite = jnp.isfinite(lse)
  lse_g = jnp.where(finite, lse, 0.0).reshape(B, Hkv, G, T)
  dlse_g = jnp.where(finite, dlse, 0.0).reshape(B, Hkv, G, T)
  delta = jnp.einsum("btkgd,btkgd->bkgt", dog.astype(_F32), _grouped(out, Hkv).astype(_F32))
  row_term = dlse_g - delta                                   # [B,Hkv,G,T]
  blocks = _key_blocks(k, v, kv_seg, block_sizes.or_defaults(DEFAULT_BLOCK_SIZES).block_kv_dkv)

  def step(dq, blk):
    k_blk, v_blk, seg_blk, k_idx = blk
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k_blk, preferred_element_type=_F32) * scale
    s = jnp.where(_block_mask(q_seg, seg_blk, k_idx, causal, T, S), s, -jnp.inf)
    p = jnp.exp(s - lse_g[..., None])
    dv = jnp.einsum("bkgts,btkgd->bskd", p.astype(dout.dtype), dog, preferred_element_type=_F32)
    dp = jnp.einsum("btkgd,bskd->bkgts", dog, v_blk, preferred_element_type=_F32)
    ds = (p * (dp + row_term[..., None])).astype(q.dtype)
    dq = dq + jnp.einsum("bkgts,bskd->btkgd", ds, k_blk, preferred_element_type=_F32)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, qg, preferred_element_type=_F32)
    return dq, (dk, dv)

  dq, (dk, dv) = jax.lax.scan(step, jnp.zeros((B, T, Hkv, G, D), _F32), blocks)
  unsplit = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, -1, Hkv, D)[:, :S]
  dq = (dq * scale).reshape(B, T, Hq, D).astype(q.dtype)
  return dq, (unsplit(dk) * scale).astype(k.dtype), unsplit(dv).astype(v.dtype)
