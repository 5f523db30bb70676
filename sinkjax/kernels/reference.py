"""Materialized-softmax attention: the oracle every other backend is tested against.

It is differentiated by plain JAX autodiff (no custom VJP), so its gradients are an independent check of the
hand-written backward passes of the other backends.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(q_seg: jax.Array, kv_seg: jax.Array, causal: bool, window: int | None = None) -> jax.Array:
  """Boolean [B, T, S]: query t may attend key s.

  Tokens attend within equal non-zero segment ids; causal masking is bottom-right aligned
  (query t sits at key position t + S - T), which is ordinary causal masking when T == S.
  `window` (causal only): query t sees only keys s > t + S - T - window (sliding-window layers).
  """
  T, S = q_seg.shape[1], kv_seg.shape[1]
  mask = (q_seg[:, :, None] == kv_seg[:, None, :]) & (q_seg[:, :, None] != 0)
  if causal:
    q_pos = jnp.arange(T)[:, None] + (S - T)
    mask &= jnp.arange(S)[None, :] <= q_pos
    if window:
      mask &= jnp.arange(S)[None, :] > q_pos - window
  return mask


def attention_weights(q, k, q_seg, kv_seg, *, causal: bool, scale: float, window: int | None = None):
  """Scores, mask and softmax weights, all materialized: ([B,Hq,T,S] f32 logits, [B,T,S] mask, [B,Hq,T,S] probs).

  Fully masked rows get all-zero weights. Used by the reference backend and by evaluation code that needs the
  attention map itself (e.g. first-token attention figures).
  """
  B, T, Hq, D = q.shape
  Hkv = k.shape[2]
  kk = jnp.repeat(k, Hq // Hkv, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), kk.astype(jnp.float32),
                 precision=jax.lax.Precision.HIGHEST) * scale
  mask = attention_mask(q_seg, kv_seg, causal, window)
  any_valid = mask.any(-1)[:, None, :, None]                      # [B,1,T,1]
  s_masked = jnp.where(mask[:, None], s, -jnp.inf)
  # Rows with no visible key are replaced by zeros so that logsumexp and its gradient stay finite;
  # their weights are then zeroed and their LSE set to -inf.
  s_safe = jnp.where(any_valid, s_masked, 0.0)
  lse = jax.nn.logsumexp(s_safe, axis=-1, keepdims=True)
  p = jnp.exp(s_safe - lse) * any_valid
  return s, mask, p, jnp.where(any_valid[..., 0], lse[..., 0], -jnp.inf)


def attention(q, k, v, q_seg, kv_seg, *, causal: bool, scale: float, window: int | None = None):
  """(out [B,T,Hq,D] in q.dtype, lse float32 [B,Hq,T])."""
  Hq, Hkv = q.shape[2], k.shape[2]
  _, _, p, lse = attention_weights(q, k, q_seg, kv_seg, causal=causal, scale=scale, window=window)
  vv = jnp.repeat(v, Hq // Hkv, axis=2).astype(jnp.float32)
  out = jnp.einsum("bhts,bshd->bthd", p, vv, precision=jax.lax.Precision.HIGHEST)
  return out.astype(q.dtype), lse
