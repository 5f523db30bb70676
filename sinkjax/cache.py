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

Per-head policy (`HybridKVCache`, DuoAttention's split of full and streaming heads). Each KV head of each layer is
either *full* (every position, at its true position) or *streaming* (S sinks + a ring of W - S recent tokens, at
positions within the ring as above). The hybrid holds two caches of the layout above: `full`, C slots of only the
full heads of each layer, and `ring`, W slots of only the streaming heads; the split is static (part of the pytree
structure), so shapes are fixed, the decode step compiles once and a streaming head costs O(W) memory, not O(C).
The attention layer attends each group with its own positions (`LayerCache.groups`) and puts the heads back in
order. A layer whose heads are all in one group computes exactly what the plain cache of that kind computes.

Chunks (scoring in blocks). A cache put in append mode (`cache.appending()`) takes T >= 1 new tokens per step and
gives each of them exactly what T decode steps would have given it: query a (absolute index) sees the keys the cache
would hold after writing a (the S sinks, the last C - S tokens up to a, nothing evicted before it), at the positions
token-by-token decoding rotates them to. The keys are [sinks, once per query | the cache before the chunk | the
chunk], the per-query eviction a mask over them (`chunk_visibility`). RoPE is relative, so the window and the chunk
are rotated once for the whole chunk, in the frame of its first query (position shift o = max(0, a_0 - C + 1)), and
query a at a - o: distances a - b, as decoding has them. The sinks sit outside the shift (query a sees sink b at
distance min(a, C - 1) - b, learnable sink tokens likewise), so they get one copy per query rotated by that query's
own shift, visible to that query only (S T extra keys; learnable sink tokens through `Attention.attend`'s
sink_offset). Each query is then one T = 1 softmax over the shared keys (`jax.vmap`; the keys are not copied per
query). Positions past o differ from decoding's by the chunk offset, so f32 rounding of the RoPE angles differs
(equal in exact arithmetic). The chunk is written after it is attended (T <= C - S keeps its slots distinct).

Cached attention lives here, beside the views it reads: `decode(layer, x, view)` runs the new tokens of an
`Attention` layer against its view (the layer's projections, RoPE and variant switch, the cache's positions).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


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
  appends = False

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

  def groups(self) -> tuple:
    """((kv_heads, cache), ...) to attend separately; kv_heads None = every head (a uniform cache: one group)."""
    return ((None, self),)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ChunkLayerCache:
  """What one attention layer sees in a step that appends T >= 1 tokens (append mode, see the module docstring).

  k, v [B, C, Hkv, D] (un-rotated keys) as they were before the chunk; length: tokens written before it;
  sink_size: S (static).
  """
  k: jax.Array
  v: jax.Array
  length: jax.Array
  sink_size: int = dataclasses.field(metadata=dict(static=True))
  appends = True

  @property
  def capacity(self) -> int:
    return self.k.shape[1]

  def held_tokens(self):
    """(absolute index [C] of the token in each slot, filled [C] bool) before the chunk."""
    j = jnp.arange(self.capacity, dtype=jnp.int32)
    S, C, L = self.sink_size, self.capacity, self.length
    newest = slot_of(L - 1, S, C)
    wrapped = L - 1 - (newest - j) % (C - S)
    return jnp.where((L <= C) | (j < S), j, wrapped).astype(jnp.int32), j < L

  def write(self, k, v) -> "ChunkLayerCache":
    """Stores the chunk's k/v [B,T,Hkv,D] in the slots of its tokens (distinct: T <= C - S, checked by KVCache)."""
    slots = slot_of(self.length + jnp.arange(k.shape[1], dtype=jnp.int32), self.sink_size, self.capacity)
    put = lambda buf, x: buf.at[:, slots].set(x.astype(buf.dtype), unique_indices=True)
    return dataclasses.replace(self, k=put(self.k, k), v=put(self.v, v))

  def groups(self) -> tuple:
    return ((None, self),)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SplitLayerCache:
  """One layer of a `HybridKVCache`: the view of its full heads and the view of its streaming heads.

  full_heads / ring_heads: the layer's KV head indices in each (static); `full` and `ring` hold only those heads, in
  that order. `write` / `prefill` take every head's k/v [B,T,Hkv,D] and store each head in its own group.
  """
  full: LayerCache
  ring: LayerCache
  full_heads: tuple = dataclasses.field(metadata=dict(static=True))
  ring_heads: tuple = dataclasses.field(metadata=dict(static=True))

  @property
  def appends(self) -> bool:
    return self.full.appends

  def _store(self, method: str, k, v) -> "SplitLayerCache":
    def put(view, heads):
      if not heads:
        return view
      idx = np.asarray(heads)
      return getattr(view, method)(jnp.take(k, idx, axis=2), jnp.take(v, idx, axis=2))
    return dataclasses.replace(self, full=put(self.full, self.full_heads), ring=put(self.ring, self.ring_heads))

  def write(self, k, v) -> "SplitLayerCache":
    return self._store("write", k, v)

  def prefill(self, k, v) -> "SplitLayerCache":
    return self._store("prefill", k, v)

  def groups(self) -> tuple:
    """The non-empty groups, full first; a group holding every head of the layer is (None, view), as a uniform
    cache's only group."""
    num_heads = len(self.full_heads) + len(self.ring_heads)
    every = tuple(range(num_heads))
    return tuple((None if heads == every else heads, view)
                 for heads, view in ((self.full_heads, self.full), (self.ring_heads, self.ring)) if heads)


# ----------------------------------------------------------------------------------------------------------------
# Cached attention: one new token of an attention layer against its cache view
# ----------------------------------------------------------------------------------------------------------------

def take_heads(a, heads, axis: int):
  """a restricted to the heads `heads` (a tuple of indices) along `axis`; a itself for None."""
  return a if heads is None else jnp.take(a, jnp.asarray(heads, jnp.int32), axis=axis)


def query_heads(kv_heads, group: int) -> tuple:
  """The query heads that read the KV heads `kv_heads` (GQA: query head i reads KV head i // group)."""
  return tuple(h * group + i for h in kv_heads for i in range(group))


def decode(layer, x, cache):
  """New tokens x [B,T,d_model] through `layer` (a `sinkjax.layers.Attention`) against its cache view: store the
  tokens' un-rotated k/v and attend each head group of the cache (one for a uniform view; full and streaming heads of
  a `SplitLayerCache`) with that group's positions; heads back in order. T = 1 (decoding) against a `LayerCache`,
  T >= 1 (a chunk) against an append-mode view (`ChunkLayerCache`), which attends first and writes after. Returns
  (y [B,T,d_model], updated view)."""
  B, T = x.shape[:2]
  q, k, v = layer.project_unrotated(x)
  if cache.appends:
    groups = cache.groups()
    outs = [_attend_chunk(layer, x, q, take_heads(k, kv_heads, 2), take_heads(v, kv_heads, 2), view, kv_heads)
            for kv_heads, view in groups]
    cache = cache.write(k, v)
  else:
    cache = cache.write(k, v)
    groups = cache.groups()
    outs = [_attend_group(layer, x, q, view, kv_heads) for kv_heads, view in groups]
  if len(groups) == 1 and groups[0][0] is None:
    out = outs[0]
  else:                                   # query heads of the groups, concatenated -> layer order
    group = layer.num_heads // layer.num_kv_heads
    order = [i for kv_heads, _ in groups for i in query_heads(kv_heads or range(layer.num_kv_heads), group)]
    out = jnp.take(jnp.concatenate(outs, axis=2), jnp.asarray(np.argsort(order)), axis=2)
  return layer.o_proj(out.reshape(B, T, layer.num_heads * layer.head_dim)), cache


def _attend_group(layer, x, q, cache, kv_heads):
  """Attention of the new token's queries [B,1,Hq,D] (un-rotated) over one cache group's KV heads `kv_heads` (None
  = all): every cached key rotated to its position within that cache (true positions in a full cache;
  StreamingLLM's shifted positions in a sink + window ring), the query to the newest position, the whole
  fixed-size cache attended with empty slots masked by kv segment 0."""
  B = x.shape[0]
  n, C, window = layer.num_sink_tokens, cache.capacity, layer.cfg.sliding_window
  q = take_heads(q, None if kv_heads is None else query_heads(kv_heads, layer.num_heads // layer.num_kv_heads), 2)
  q = layer.rotate(q, jnp.full((B, 1), cache.query_position + n, jnp.int32), "q")
  k_all = layer.rotate(cache.k, jnp.broadcast_to(cache.key_positions + n, (B, C)), "k")
  visible = cache.valid
  if window:                              # slots are not in age order once a streaming ring wraps
    visible &= cache.key_positions > cache.query_position - window
  seg = (jnp.ones((B, 1), jnp.int32), jnp.broadcast_to(visible, (B, C)).astype(jnp.int32))
  out, _ = layer.attend(x, q, k_all, cache.v, seg, impl="reference", slide=False,   # T = 1: [C]-wide softmax
                        kv_heads=kv_heads)
  return out


def chunk_visibility(view: ChunkLayerCache, num_new: int, window: int = 0):
  """Which keys each query of a chunk sees, and where: (visible [T, S T + C + T] bool, key positions [S T + C + T],
  query positions [T], sink shift [T]) over the keys [sink copies (query-major) | cache slots | chunk], in the
  chunk's frame (see the module docstring); `window` is the model's sliding window (0 = none), applied by position
  as decoding does."""
  S, C, T = view.sink_size, view.capacity, num_new
  R = C - S
  a = view.length + jnp.arange(T, dtype=jnp.int32)                 # absolute index of each query
  shift = jnp.maximum(a - C + 1, 0)                                 # decoding's position shift at query a
  o = shift[0]
  held, filled = view.held_tokens()
  b = jnp.concatenate([jnp.tile(jnp.arange(S, dtype=jnp.int32), T), held, a])          # token index of each key
  owner = jnp.concatenate([jnp.repeat(jnp.arange(T, dtype=jnp.int32), S), jnp.full((C + T,), -1, jnp.int32)])
  is_copy = owner >= 0
  kept = jnp.concatenate([b[:S * T] < view.length, filled & (held >= S), jnp.ones((T,), bool)])
  aq = a[:, None]
  visible = kept[None] & (b[None] <= aq) & jnp.where(is_copy[None], owner[None] == jnp.arange(T)[:, None],
                                                     (b[None] < S) | (b[None] > aq - R))
  key_pos = jnp.where(is_copy, b + jnp.take(shift, jnp.maximum(owner, 0)) - o, b - o)
  if window:                              # decoding's rule: key position > query position - window
    distance = jnp.where(is_copy[None] | (b[None] < S), (aq - shift[:, None]) - b[None], aq - b[None])
    visible &= distance < window
  return visible, key_pos, a - o, shift - o


def _attend_chunk(layer, x, q, k, v, cache: ChunkLayerCache, kv_heads):
  """Attention of a chunk's queries [B,T,Hq,D] (un-rotated; those of `kv_heads`' query heads are taken here) over
  one group's keys before the chunk and the chunk's own k, v [B,T,Hkv',D]: each query a T = 1 softmax (as in
  `_attend_group`) over the keys it would see when decoded, see `chunk_visibility`."""
  B, T = x.shape[:2]
  n, S = layer.num_sink_tokens, cache.sink_size
  q = take_heads(q, None if kv_heads is None else query_heads(kv_heads, layer.num_heads // layer.num_kv_heads), 2)
  visible, key_pos, q_pos, sink_shift = chunk_visibility(cache, T, layer.cfg.sliding_window)
  sinks = lambda a: jnp.tile(a[:, :S], (1, T, 1, 1))
  k_all = jnp.concatenate([sinks(cache.k), cache.k, k.astype(cache.k.dtype)], axis=1)
  v_all = jnp.concatenate([sinks(cache.v), cache.v, v.astype(cache.v.dtype)], axis=1)
  k_all = layer.rotate(k_all, jnp.broadcast_to(key_pos + n, k_all.shape[:2]), "k")
  q = layer.rotate(q, jnp.broadcast_to(q_pos + n, (B, T)), "q")
  ones = jnp.ones((B, 1), jnp.int32)

  def one_query(x_t, q_t, visible_t, shift_t):
    seg = (ones, jnp.broadcast_to(visible_t, (B, visible_t.shape[0])).astype(jnp.int32))
    out, _ = layer.attend(x_t[:, None], q_t[:, None], k_all, v_all, seg, impl="reference", slide=False,
                          kv_heads=kv_heads, sink_offset=shift_t)
    return out[:, 0]
  return jax.vmap(one_query, in_axes=(1, 1, 0, 0), out_axes=1)(x, q, visible, sink_shift)


def check_prefill(num_new: int, limit: int) -> None:
  if num_new > limit:
    raise ValueError(f"cannot prefill {num_new} tokens into a cache of size {limit}; prefill at most the cache size "
                     "and decode the rest")


def check_chunk(num_new: int, ring: int) -> None:
  if num_new > ring:
    raise ValueError(f"a chunk of {num_new} tokens exceeds the {ring} window slots of the cache; score in chunks of "
                     f"at most {ring}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StateLayerCache:
  """What a layer whose decode state is not keys and values (linear attention, `sinkjax.kinds.linear`) sees in a
  step: that state (the mixer continues from it and returns `replace(new state)`). Eviction does not apply to it."""
  state: object
  appends = False

  def replace(self, state) -> "StateLayerCache":
    return dataclasses.replace(self, state=state)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
  """The whole model's cache (an explicit pytree: pass it into a jitted step and get the new one back). `states`:
  per layer, the decode state of a layer that keeps no keys and values (its k / v hold 0 heads), None for attention
  layers; () when every layer attends."""
  k: tuple
  v: tuple
  length: jax.Array
  sink_size: int = dataclasses.field(metadata=dict(static=True))
  append: bool = dataclasses.field(default=False, metadata=dict(static=True))
  states: tuple = ()

  @classmethod
  def create(cls, num_layers: int, batch: int, capacity: int, num_kv_heads, head_dim: int, *,
             sink_size: int = 0, dtype=jnp.float32) -> "KVCache":
    """An empty cache. Streaming: sink_size = S, capacity = W (window incl. sinks). Full: sink_size = 0.
    num_kv_heads: one count for every layer, or one per layer (the groups of a `HybridKVCache`)."""
    if not 0 <= sink_size < capacity:
      raise ValueError(f"need 0 <= sink size < cache size, got sink size {sink_size} and cache size {capacity}")
    heads = [num_kv_heads] * num_layers if isinstance(num_kv_heads, int) else list(num_kv_heads)
    assert len(heads) == num_layers, (heads, num_layers)
    zeros = lambda: tuple(jnp.zeros((batch, capacity, h, head_dim), dtype) for h in heads)
    return cls(k=zeros(), v=zeros(), length=jnp.zeros((), jnp.int32), sink_size=sink_size)

  @classmethod
  def for_model(cls, cfg, batch: int, capacity: int, *, sink_size: int = 0) -> "KVCache":
    """An empty cache shaped for a `ModelConfig` (in its compute dtype), with the decode state of every layer whose
    kind keeps one instead of keys and values (`sinkjax.kinds.MixerKind.init_state`)."""
    states = _layer_states(cfg, batch)
    heads = [cfg.num_kv_heads if s is None else 0 for s in states]
    cache = cls.create(cfg.num_layers, batch, capacity, heads, cfg.head_dim, sink_size=sink_size,
                       dtype=jnp.dtype(cfg.dtype))
    return dataclasses.replace(cache, states=tuple(states)) if any(s is not None for s in states) else cache

  @property
  def capacity(self) -> int:
    return self.k[0].shape[1]

  @property
  def nbytes(self) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(self))

  @property
  def kv_bytes(self) -> int:
    """Bytes of the key and value arrays (the cache memory a table reports; `nbytes` adds the 4-byte counter)."""
    return sum(x.nbytes for x in self.k + self.v)

  @property
  def max_prefill(self) -> int:
    """The most tokens one prefill may write (the rest of a longer prompt goes through the decode step)."""
    return self.capacity

  @property
  def max_chunk(self) -> int:
    """The most tokens one append-mode step may take: the window's C - S slots (a chunk's slots are distinct)."""
    return self.capacity - self.sink_size

  def appending(self) -> "KVCache":
    """This cache in append mode: a step of T >= 1 tokens attends what it holds, each token as if decoded one by one
    (chunked scoring; see the module docstring)."""
    return dataclasses.replace(self, append=True)

  def layers(self, num_new: int) -> list:
    """Per-layer views for a step that adds `num_new` tokens (1 = decode; > 1 = prefill of an empty cache; in append
    mode, `ChunkLayerCache`s for a chunk of at most C - S tokens); a `StateLayerCache` for a layer with a state."""
    if self.append:
      check_chunk(num_new, self.max_chunk)
      views = self._chunk_views()
    else:
      check_prefill(num_new, self.max_prefill)
      views = self._views(num_new)
    if not self.states:
      return views
    return [v if s is None else StateLayerCache(s) for v, s in zip(views, self.states)]

  def _chunk_views(self) -> list[ChunkLayerCache]:
    return [ChunkLayerCache(k, v, self.length, self.sink_size) for k, v in zip(self.k, self.v)]

  def _views(self, num_new: int) -> list[LayerCache]:
    after = self.length + num_new
    positions, valid = slot_positions(after, self.sink_size, self.capacity)
    slot = slot_of(self.length, self.sink_size, self.capacity)
    query = jnp.minimum(after, self.capacity) - 1
    return [LayerCache(k, v, slot, positions, query, valid) for k, v in zip(self.k, self.v)]

  def advance(self, layers: list[LayerCache], num_new: int) -> "KVCache":
    """The cache after a step: the layers' updated arrays (and states) and `num_new` more tokens counted."""
    kv = [(k, v) if isinstance(c, StateLayerCache) else (c.k, c.v) for c, k, v in zip(layers, self.k, self.v)]
    states = tuple(c.state if isinstance(c, StateLayerCache) else None for c in layers) if self.states else ()
    return dataclasses.replace(self, k=tuple(k for k, _ in kv), v=tuple(v for _, v in kv),
                               length=self.length + num_new, states=states)

  def occupied(self):
    """Number of filled slots (the cache size a streaming table reports)."""
    return jnp.minimum(self.length, self.capacity)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HybridKVCache:
  """Per-head cache policy: `full` (C slots, sink_size 0) holds each layer's full KV heads, `ring` (W slots with S
  sinks) its streaming heads; `full_heads` [L][Hkv] (static) says which is which. Same protocol as `KVCache`
  (`layers`, `advance`), so the model and the jitted steps take either."""
  full: KVCache
  ring: KVCache
  full_heads: tuple = dataclasses.field(metadata=dict(static=True))

  @classmethod
  def create(cls, full_heads, batch: int, capacity: int, window: int, head_dim: int, *, sink_size: int,
             dtype=jnp.float32) -> "HybridKVCache":
    """An empty hybrid cache: full_heads [L][Hkv] bools (True = full, `capacity` slots; False = streaming, `window`
    slots of which `sink_size` sinks)."""
    mask = tuple(tuple(bool(f) for f in row) for row in full_heads)
    counts = [sum(row) for row in mask]
    full = KVCache.create(len(mask), batch, capacity, counts, head_dim, dtype=dtype)
    ring = KVCache.create(len(mask), batch, window, [len(row) - c for row, c in zip(mask, counts)], head_dim,
                          sink_size=sink_size, dtype=dtype)
    return cls(full=full, ring=ring, full_heads=mask)

  @classmethod
  def for_model(cls, cfg, full_heads, batch: int, capacity: int, window: int, *,
                sink_size: int) -> "HybridKVCache":
    if any(s is not None for s in _layer_states(cfg, 1)):
      raise ValueError("a per-head cache policy needs attention in every layer, and this model has layers of a kind "
                       "with its own decode state (model.layer_types): use a full or sink + window cache")
    assert len(full_heads) == cfg.num_layers and all(len(r) == cfg.num_kv_heads for r in full_heads), full_heads
    return cls.create(full_heads, batch, capacity, window, cfg.head_dim, sink_size=sink_size,
                      dtype=jnp.dtype(cfg.dtype))

  @property
  def length(self):
    return self.full.length

  @property
  def nbytes(self) -> int:
    return self.full.nbytes + self.ring.nbytes

  @property
  def kv_bytes(self) -> int:
    return self.full.kv_bytes + self.ring.kv_bytes

  @property
  def max_prefill(self) -> int:
    """The smaller capacity among the caches that hold any head (a cache without heads limits nothing)."""
    return min(c.capacity for c in self._held())

  def appending(self) -> "HybridKVCache":
    """Both caches in append mode (see `KVCache.appending`)."""
    return dataclasses.replace(self, full=self.full.appending(), ring=self.ring.appending())

  def _held(self) -> list:
    """The caches that hold any head."""
    return [c for c, n in ((self.full, sum(map(sum, self.full_heads))),
                           (self.ring, sum(len(r) - sum(r) for r in self.full_heads))) if n]

  @property
  def max_chunk(self) -> int:
    return min(c.max_chunk for c in self._held())

  def layers(self, num_new: int) -> list[SplitLayerCache]:
    """Per-layer views (see `KVCache.layers`); a cache that holds no head limits nothing (its writes are skipped)."""
    if self.full.append:
      check_chunk(num_new, self.max_chunk)
      views = zip(self.full._chunk_views(), self.ring._chunk_views())
    else:
      check_prefill(num_new, self.max_prefill)
      views = zip(self.full._views(num_new), self.ring._views(num_new))
    out = []
    for row, (full, ring) in zip(self.full_heads, views):
      out.append(SplitLayerCache(full, ring, tuple(h for h, f in enumerate(row) if f),
                                 tuple(h for h, f in enumerate(row) if not f)))
    return out

  def advance(self, layers: list[SplitLayerCache], num_new: int) -> "HybridKVCache":
    return dataclasses.replace(self, full=self.full.advance([c.full for c in layers], num_new),
                               ring=self.ring.advance([c.ring for c in layers], num_new))


def _layer_states(cfg, batch: int) -> list:
  """Per layer of a `ModelConfig`: the decode state its kind keeps instead of keys and values, or None."""
  if cfg.attention_only:
    return [None] * cfg.num_layers
  return [cfg.mixer(i).init_state(cfg, batch) for i in range(cfg.num_layers)]


def make_cache(cfg, batch: int, capacity: int, *, sink_size: int = 0, full_heads=None, window: int = 0):
  """The cache of a generation or scoring run: a `KVCache` of `capacity` slots with `sink_size` sinks, or, with
  `full_heads` ([L][Hkv] bools), a `HybridKVCache` whose full heads keep `capacity` slots and whose streaming heads
  keep `window` (sinks included)."""
  if full_heads is None:
    return KVCache.for_model(cfg, batch, capacity, sink_size=sink_size)
  return HybridKVCache.for_model(cfg, full_heads, batch, capacity, window, sink_size=sink_size)


def shard_cache(cache, mesh):
  """`cache` (a `KVCache` / `HybridKVCache`; concrete, traced inside a jitted step, or abstract ShapeDtypeStructs)
  placed on `mesh`: each key / value array [B, C, Hkv, D] with its rows over the batch axes ("data", "fsdp") and its
  KV heads over "tensor", each only where the axes divide that dimension (else it stays whole); everything else
  (the counter, other decode state) replicated. Concrete arrays are moved, traced ones constrained
  (`with_sharding_constraint`), abstract ones given the sharding. `mesh` None: the cache unchanged."""
  if mesh is None:
    return cache
  from jax.sharding import NamedSharding, PartitionSpec as P  # pylint: disable=import-outside-toplevel
  from sinkjax.sharding import BATCH_AXES, HEAD_AXIS  # pylint: disable=import-outside-toplevel
  sizes = dict(mesh.shape)
  rows = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
  heads = HEAD_AXIS if sizes.get(HEAD_AXIS, 1) > 1 else None

  def kv_spec(shape) -> P:
    spec = [rows if rows and shape[0] % int(np.prod([sizes[a] for a in rows])) == 0 else None, None,
            heads if heads and shape[2] % sizes[heads] == 0 else None]
    while spec and spec[-1] is None:
      spec.pop()
    return P(*spec)

  def place(x, spec):
    sharding = NamedSharding(mesh, spec)
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.core.Tracer):
      return jax.lax.with_sharding_constraint(x, sharding)
    return jax.device_put(x, sharding)

  def one(c):
    if isinstance(c, HybridKVCache):
      return dataclasses.replace(c, full=one(c.full), ring=one(c.ring))
    rest = {f.name: jax.tree.map(lambda x: place(x, P()), getattr(c, f.name)) for f in dataclasses.fields(c)
            if f.name not in ("k", "v") and not f.metadata.get("static")}
    return dataclasses.replace(c, k=tuple(place(x, kv_spec(x.shape)) for x in c.k),
                               v=tuple(place(x, kv_spec(x.shape)) for x in c.v), **rest)
  return one(cache)
