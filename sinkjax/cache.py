"""Fixed-shape KV cache for generation: a full cache, or StreamingLLM's attention-sink + recent-window cache.

Layout. Per layer, keys and values of shape [B, C, Hkv, D] (C = capacity, fixed for the whole generation, so the
decode step compiles once) and one shared counter `length` = tokens written so far (it keeps counting after the
cache is full). Slots 0..S-1 hold the first S tokens and are never evicted ("attention sinks", S = `sink_size`);
slots S..C-1 are a ring buffer holding the most recent C - S tokens, so the token with absolute index a lives in
slot a (a < S) or S + (a - S) mod (C - S). A full cache is the same structure with S = 0 and C large enough that
the ring never wraps; until it wraps a streaming cache is exactly a full cache.

RoPE. Keys are stored *un-rotated* (after QK-norm, before RoPE). Each decode step rotates every cached key to its
position *within the cache* (sinks 0..S-1, then the window in age order S..C-1) and the query to the last of those
positions, as StreamingLLM does: relative distances stay inside what the model saw in training however long the
stream runs, and an evicted middle leaves no gap. The cost is one rotation of the cache per layer per step (the
same order as the attention itself). Learnable sink tokens (`model.sink_tokens` = n) are parameters, not cache
entries: they sit at positions 0..n-1 and every cache position is shifted by n (done by the attention layer).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def slot_of(index, sink_size: int, capacity: int):
  """Slot of the token with absolute index `index` (int array)."""
  ring = capacity - sink_size
  return jnp.where(index < sink_size, index, sink_size + (index - sink_size) % ring)


def slot_positions(length, sink_size: int, capacity: int):
  """(positions [C] int32, valid [C] bool) of every slot once `length` tokens have been written.

  A slot's position is its rank in the kept sequence [sinks; window oldest..newest], so the newest token sits at
  min(length, C) - 1; before the ring wraps this is just the slot index.
  """
  j = jnp.arange(capacity, dtype=jnp.int32)
  ring = capacity - sink_size
  newest = slot_of(length - 1, sink_size, capacity)
  wrapped = sink_size + ring - 1 - (newest - j) % ring
  positions = jnp.where((length <= capacity) | (j < sink_size), j, wrapped)
  return positions.astype(jnp.int32), j < length


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerCache:
  """What one attention layer sees in one step: its cache arrays and where the new token goes.

  k, v [B, C, Hkv, D] (un-rotated keys); slot: where a decoded token is written; key_positions [C] / valid [C]:
  positions and occupancy of the slots after that write; query_position: the new token's position.
  """
  k: jax.Array
  v: jax.Array
  slot: jax.Array
  key_positions: jax.Array
  query_position: jax.Array
  valid: jax.Array

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  def write(self, k, v) -> "LayerCache":
    """Stores one token's k/v [B,1,Hkv,D] at `slot` (evicting the oldest window entry once the ring is full)."""
    put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), self.slot, axis=1)
    return dataclasses.replace(self, k=put(self.k, k), v=put(self.v, v))

  def prefill(self, k, v) -> "LayerCache":
    """Stores a prompt's k/v [B,T,Hkv,D] in slots 0..T-1 of an empty cache (T <= C, checked by KVCache)."""
    put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x.astype(buf.dtype), 0, axis=1)
    return dataclasses.replace(self, k=put(self.k, k), v=put(self.v, v))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """The whole model's cache (an explicit pytree: pass it into a jitted step and get the new one back)."""
  k: tuple
  v: tuple
  length: jax.Array
  sink_size: int = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def create(cls, num_layers: int, batch: int, capacity: int, num_kv_heads: int, head_dim: int, *,
             sink_size: int = 0, dtype=jnp.float32) -> "KVCache":
    """An empty cache. Streaming: sink_size = S, capacity = W (window incl. sinks). Full: sink_size = 0."""
    if not 0 <= sink_size < capacity:
      raise ValueError(f"need 0 <= sink size < cache size, got sink size {sink_size} and cache size {capacity}")
    zeros = lambda: tuple(jnp.zeros((batch, capacity, num_kv_heads, head_dim), dtype) for _ in range(num_layers))
    return cls(k=zeros(), v=zeros(), length=jnp.zeros((), jnp.int32), sink_size=sink_size)

  @classmethod
  def for_model(cls, cfg, batch: int, capacity: int, *, sink_size: int = 0) -> "KVCache":
    """An empty cache shaped for a `ModelConfig` (in its compute dtype)."""
    from sinkjax.model import DTYPES
    return cls.create(cfg.num_layers, batch, capacity, cfg.num_kv_heads, cfg.head_dim, sink_size=sink_size,
                      dtype=DTYPES[cfg.dtype])

  @property
  def capacity(self) -> int:
    return self.k[0].shape[1]

  @property
  def nbytes(self) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(self))

  def layers(self, num_new: int) -> list[LayerCache]:
    """Per-layer views for a step that adds `num_new` tokens (1 = decode; > 1 = prefill of an empty cache)."""
    if num_new > self.capacity:
      raise ValueError(f"cannot prefill {num_new} tokens into a cache of size {self.capacity}; prefill at most "
                       "the cache size and decode the rest")
    after = self.length + num_new
    positions, valid = slot_positions(after, self.sink_size, self.capacity)
    slot = slot_of(self.length, self.sink_size, self.capacity)
    query = jnp.minimum(after, self.capacity) - 1
    return [LayerCache(k, v, slot, positions, query, valid) for k, v in zip(self.k, self.v)]

  def advance(self, layers: list[LayerCache], num_new: int) -> "KVCache":
    """The cache after a step: the layers' updated arrays and `num_new` more tokens counted."""
    return dataclasses.replace(self, k=tuple(c.k for c in layers), v=tuple(c.v for c in layers),
                               length=self.length + num_new)

  def occupied(self):
    """Number of filled slots (the cache size a streaming table reports)."""
    return jnp.minimum(self.length, self.capacity)
