"""Packed documents as contiguous runs of segment ids: what the fused GPU kernels (cuDNN's packed layout, tokamax's
per-query key ranges) need to know about a row of segment ids. Pure jnp; ids are int32 [B, T], 0 = padding."""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax


def runs(seg, M: int):
  """Contiguous runs of equal non-zero ids per row: (run index per token [B, T] (valid where seg != 0), number of
  runs [B], run lengths and start positions [B, M] (runs past M dropped))."""
  B, T = seg.shape
  prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=0)
  valid = seg != 0
  start = valid & ((seg != prev) | (jnp.arange(T)[None, :] == 0))
  run = jnp.cumsum(start.astype(jnp.int32), axis=1) - 1
  n_runs = start.sum(axis=1, dtype=jnp.int32)
  one_hot = (run[..., None] == jnp.arange(M, dtype=jnp.int32)) & valid[..., None]          # [B, T, M]
  lengths = one_hot.sum(axis=1, dtype=jnp.int32)
  starts = jnp.sum(jnp.where(one_hot & start[..., None], jnp.arange(T, dtype=jnp.int32)[None, :, None], 0), axis=1)
  return run, n_runs, lengths, starts


def distinct_ids(seg):
  """Number of distinct non-zero ids per row [B]."""
  s = jnp.sort(seg, axis=1)
  new = (s != jnp.pad(s[:, :-1], ((0, 0), (1, 0)), constant_values=0)) & (s != 0)
  return new.sum(axis=1, dtype=jnp.int32)


def one_run_each(seg):
  """[B] bool: every non-zero id of the row forms one contiguous run (packed documents do)."""
  T = seg.shape[1]
  prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=0)
  starts = (seg != 0) & ((seg != prev) | (jnp.arange(T)[None, :] == 0))
  return starts.sum(axis=1, dtype=jnp.int32) == distinct_ids(seg)


def document_ranges(seg):
  """(start, end), int32 [B, T] each: the positions [start, end) of each token's run (its document); both 0 for
  padding tokens (id 0), an empty range."""
  B, T = seg.shape
  pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  prev = jnp.pad(seg[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  nxt = jnp.pad(seg[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
  start = lax.cummax(jnp.where(seg != prev, pos, 0), axis=1)
  end = lax.cummin(jnp.where(seg != nxt, pos + 1, T), axis=1, reverse=True)
  pad = seg == 0
  return jnp.where(pad, 0, start).astype(jnp.int32), jnp.where(pad, 0, end).astype(jnp.int32)


def route(q_seg, kv_seg):
  """0 (one non-padding segment per row: no ranges needed), 1 (self-attention whose ids are contiguous runs, one per
  id: per-query key ranges) or 2 (anything else), as an int32 scalar."""
  first = kv_seg[:, :1]
  plain = jnp.all(kv_seg == first) & jnp.all(q_seg == first) & jnp.all(first != 0)
  if q_seg.shape != kv_seg.shape:
    return jnp.where(plain, 0, 2).astype(jnp.int32)
  ranged = jnp.all(q_seg == kv_seg) & jnp.all(one_run_each(q_seg))
  return jnp.where(plain, 0, jnp.where(ranged, 1, 2)).astype(jnp.int32)
