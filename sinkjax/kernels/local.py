"""Sliding-window (local) causal attention: query t sees keys s with t - window < s <= t (GPT-OSS, Mistral).

Blockwise in plain jnp: queries are cut into blocks of `window` rows and each block attends only its own key block
and the one before, so memory is O(T * 2 * window) instead of O(T^2). It is differentiated by JAX autodiff (no custom
VJP), so gradients flow through BOTH outputs, the LSE included, as the sink-aware losses need. The materialized
reference (`reference.attention(..., window=)`) is its test oracle and the path for T != S (decoding).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention(q, k, v, q_seg, kv_seg, *, scale: float, window: int):
  """Causal self-attention (T == S) restricted to the last `window` keys: (out [B,T,Hq,D] in q.dtype, lse [B,Hq,T])."""
  B, T, Hq, D = q.shape
  Hkv = k.shape[2]
  assert k.shape[1] == T, "local attention is self-attention (T == S); use the reference with a window otherwise"
  C = max(1, min(window, T))
  n = -(-T // C)
  pad = n * C - T

  def blocks(x, fill=0):
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
    return x.reshape((B, n, C) + x.shape[2:])

  def with_previous(x):   # [B,n,C,...] -> [B,n,2C,...]: block i-1 (zeros before the first) then block i
    prev = jnp.pad(x, [(0, 0), (1, 0)] + [(0, 0)] * (x.ndim - 2))[:, :-1]
    return jnp.concatenate([prev, x], axis=2)

  qb = blocks(q).astype(jnp.float32)                                      # [B,n,C,Hq,D]
  kb = with_previous(blocks(k)).astype(jnp.float32)                       # [B,n,2C,Hkv,D]
  vb = with_previous(blocks(v)).astype(jnp.float32)
  qs, ks = blocks(q_seg), with_previous(blocks(kv_seg))                   # [B,n,C], [B,n,2C] (0 = padding)
  t = jnp.arange(n)[:, None] * C + jnp.arange(C)[None, :]                 # [n,C] query positions
  s = (jnp.arange(n)[:, None] - 1) * C + jnp.arange(2 * C)[None, :]       # [n,2C] key positions
  visible = (s[:, None, :] <= t[:, :, None]) & (s[:, None, :] > t[:, :, None] - window) & (s[:, None, :] >= 0)
  mask = visible[None] & (qs[..., :, None] == ks[..., None, :]) & (qs[..., :, None] != 0)   # [B,n,C,2C]

  G = Hq // Hkv
  qg = qb.reshape(B, n, C, Hkv, G, D)
  z = jnp.einsum("bncjgd,bnsjd->bnjgcs", qg, kb, precision=jax.lax.Precision.HIGHEST) * scale
  m = mask[:, :, None, None]                                              # [B,n,1,1,C,2C]
  any_valid = m.any(-1, keepdims=True)
  z = jnp.where(m, z, -jnp.inf)
  z = jnp.where(any_valid, z, 0.0)        # rows without a visible key: finite logsumexp, zeroed below
  lse = jax.nn.logsumexp(z, axis=-1, keepdims=True)
  p = jnp.exp(z - lse) * any_valid
  out = jnp.einsum("bnjgcs,bnsjd->bncjgd", p, vb, precision=jax.lax.Precision.HIGHEST)
  out = out.reshape(B, n * C, Hq, D)[:, :T].astype(q.dtype)
  lse = jnp.where(any_valid[..., 0], lse[..., 0], -jnp.inf)               # [B,n,Hkv,G,C]
  lse = jnp.moveaxis(lse, 1, 3).reshape(B, Hq, n * C)[:, :, :T]
  return out, lse
