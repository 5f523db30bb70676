"""A hybrid cache's streaming perplexity in one forward pass: per-head attention masks that give every query exactly
what `sinkjax.cache.HybridKVCache` gives it when the text is decoded token by token, with the map (which KV heads
keep a full cache) an array argument, so one compilation scores any number of maps of a text.

What a query sees (sinkjax/cache.py's module docstring). A *full* KV head: every key b <= a at its true position
(distance a - b). A *streaming* KV head (S sinks, W slots, ring R = W - S): the keys S <= b <= a with b > a - R at
distance a - b, and the sinks b < S (b <= a) at distance min(a, W - 1) - b: positions are within the cache, so past
the window the sinks sit at a fixed distance from the query instead of their true one. RoPE is relative, so the
first is the causal attention of a plain forward pass with a mask, and the second is S extra keys per query whose
scores are those of the query rotated to position min(a, W - 1) against the sink keys at 0..S-1. One softmax per
query head over [its S sink scores | its T ordinary scores] with the head's mask (a full head masks the sink block,
a streaming head the ordinary scores of keys < S and of keys the ring has evicted).

`gated_attention_outputs` is the same pair of masks with both attended: per query head the full head's output and the
streaming head's, which DuoAttention mixes with a gate per KV head (`sinkjax.experiments.duo_attention`).

Scope: attention-only models whose layers are vanilla softmax attention without learnable sink tokens or a sliding
window of their own (SmolLM2 and the Llama-style imports); anything else is refused. The scores are materialized
([Hq, T, T] per layer), which is what a 2,048-token text costs on a CPU and the point here: one pass per map.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def check_model(cfg) -> None:
  """Raises ValueError unless the one-pass hybrid is exactly the cache path for this model (see module docstring)."""
  bad = []
  if cfg.attention != "vanilla":
    bad.append(f"attention {cfg.attention!r} (vanilla only)")
  if getattr(cfg, "sink_tokens", 0):
    bad.append("learnable sink tokens")
  if not cfg.attention_only:
    bad.append("layers without attention")
  if any(cfg.attention_config(i).sliding_window for i in range(cfg.num_layers)):
    bad.append("a sliding window")
  if bad:
    raise ValueError("one-pass hybrid scoring covers vanilla attention-only models; this one has " + ", ".join(bad) +
                     ": score it with sinkjax.generate.streaming_nll")


def masks(T: int, sink_size: int, window: int, start: int = 0):
  """(causal [T, start + T], streaming [T, start + T] over the ordinary keys, sinks [T, S] over the sink block)
  visibility, bool, of the queries start..start+T-1 over the keys 0..start+T-1."""
  a = start + np.arange(T)[:, None]
  b = np.arange(start + T)[None, :]
  causal = b <= a
  streaming = causal & (b >= sink_size) & (b > a - (window - sink_size))
  sinks = np.arange(sink_size)[None, :] <= a
  return causal, streaming, sinks


def _scores(layer, q0, k0, sink_size: int, window: int, start: int = 0):
  """Attention logits of one layer's queries at positions start.. over keys at 0..: (ordinary [B, Hq, Tq, Tk] at true
  positions, sink block [B, Hq, Tq, S] with the query at min(a, W - 1)); q0 / k0 un-rotated."""
  B, Tq = q0.shape[:2]
  Tk = k0.shape[1]
  group = layer.num_heads // layer.num_kv_heads
  pos_q = jnp.broadcast_to(start + jnp.arange(Tq, dtype=jnp.int32), (B, Tq))
  q = layer.rotate(q0, pos_q, "q")
  k = jnp.repeat(layer.rotate(k0, jnp.broadcast_to(jnp.arange(Tk, dtype=jnp.int32), (B, Tk)), "k"), group, axis=2)
  q_sink = layer.rotate(q0, jnp.minimum(pos_q, window - 1), "q")
  scale = 1.0 / math.sqrt(layer.head_dim)
  hi = jax.lax.Precision.HIGHEST
  z = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32), precision=hi) * scale
  z_sink = jnp.einsum("bthd,bshd->bhts", q_sink.astype(jnp.float32), k[:, :sink_size].astype(jnp.float32),
                      precision=hi) * scale
  return z, z_sink


def _softmax_out(z, z_sink, visible, visible_sink, v_all):
  """softmax over [sink block | ordinary keys] with masks [B|1, Hq, T, S + T], times values [B, S + T, Hq, D]."""
  logits = jnp.concatenate([z_sink, z], axis=-1)
  vis = jnp.concatenate([visible_sink, visible], axis=-1)
  p = jax.nn.softmax(jnp.where(vis, logits, -jnp.inf), axis=-1)
  return jnp.einsum("bhts,bshd->bthd", p, v_all.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)


def _values(layer, v, sink_size: int):
  group = layer.num_heads // layer.num_kv_heads
  v = jnp.repeat(v, group, axis=2)
  return jnp.concatenate([v[:, :sink_size], v], axis=1)


def _project(layer, x, prefix):
  """(q0 of x's tokens, k0 and v over prefix + x's tokens, (k0, v) of x's tokens alone); prefix: (k0, v) or None."""
  q0, k0, v = layer.project_unrotated(x)
  own = (k0, v)
  if prefix is not None:
    k0, v = (jnp.concatenate([p.astype(a.dtype), a], axis=1) for p, a in zip(prefix, own))
  return q0, k0, v, own


def hybrid_attention(layer, x, full_kv, sink_size: int, window: int, prefix=None):
  """One attention layer's output [B, T, d_model] for the tokens x (after `prefix`'s, (k0, v) [B, P, Hkv, D] of the
  P tokens before them, or None) with KV head h full where full_kv[h] (float or bool [Hkv]), else streaming: the
  per-head masks of the module docstring. Returns (output, (k0, v) of x's tokens)."""
  B, T, _ = x.shape
  start = 0 if prefix is None else prefix[0].shape[1]
  q0, k0, v, own = _project(layer, x, prefix)
  z, z_sink = _scores(layer, q0, k0, sink_size, window, start)
  causal, streaming, sinks = (jnp.asarray(m) for m in masks(T, sink_size, window, start))
  full_q = jnp.repeat(jnp.asarray(full_kv) > 0.5, layer.num_heads // layer.num_kv_heads)[None, :, None, None]
  visible = jnp.where(full_q, causal[None, None], streaming[None, None])
  visible_sink = jnp.logical_and(~full_q, sinks[None, None])
  out = _softmax_out(z, z_sink, visible, visible_sink, _values(layer, v, sink_size)).astype(x.dtype)
  return layer.o_proj(out.reshape(B, T, layer.num_heads * layer.head_dim)), own


def gated_attention(layer, x, gate_kv, sink_size: int, window: int, prefix=None):
  """One attention layer with DuoAttention's mix per KV head h: gate_kv[h] * full output + (1 - gate_kv[h]) *
  streaming output (`gate_kv` float [Hkv]; 1 = full, 0 = streaming; the same masks as `hybrid_attention`, whose
  arguments and returns it has)."""
  B, T, _ = x.shape
  start = 0 if prefix is None else prefix[0].shape[1]
  q0, k0, v, own = _project(layer, x, prefix)
  z, z_sink = _scores(layer, q0, k0, sink_size, window, start)
  causal, streaming, sinks = (jnp.asarray(m)[None, None] for m in masks(T, sink_size, window, start))
  v_all = _values(layer, v, sink_size)
  full = _softmax_out(z, z_sink, causal, jnp.zeros_like(sinks), v_all)
  stream = _softmax_out(z, z_sink, streaming, sinks, v_all)
  g = jnp.repeat(jnp.asarray(gate_kv, jnp.float32), layer.num_heads // layer.num_kv_heads)[None, None, :, None]
  out = (g * full + (1.0 - g) * stream).astype(x.dtype)
  return layer.o_proj(out.reshape(B, T, layer.num_heads * layer.head_dim)), own


def hidden_with(model, tokens, per_layer, attention_fn, *, sink_size: int, window: int, prefix=None):
  """The residual stream after the last block [B, T, d_model] of `tokens` (following the tokens whose per-layer
  (k0, v) `prefix` holds, or none), each block's attention `attention_fn(layer, x, per_layer[i], sink_size, window,
  prefix[i])` (`hybrid_attention` with a map row, `gated_attention` with a gate row); and the per-layer (k0, v) of
  `tokens`."""
  x = x0 = model.embed_tokens(tokens)
  kv = []
  for i, block in enumerate(model.layers):
    x = model.block_input(i, x, x0)
    y, own = attention_fn(block.attn, block.attn_norm(x), per_layer[i], sink_size, window,
                          None if prefix is None else prefix[i])
    kv.append(own)
    x = x + y
    x = x + block.mlp(block.mlp_norm(x))
  return x, kv


def token_nll(model, hidden, targets):
  """NLL [B, T] of targets [B, T] (the token after each hidden state) from the hidden states (float32, natural
  log)."""
  logits = model.logits(hidden)
  lse = jax.nn.logsumexp(logits, axis=-1)
  return lse - jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]


class HybridScorer:
  """Scores hybrid maps of one model on token sequences: `scorer(ids, full_map)` -> NLL [N-1] (float64) of ids[1:]
  under the hybrid cache whose KV head (l, h) is full where full_map[l][h] (sinks + window otherwise), compiled once
  per sequence length (the map is an array argument). Until a query is W tokens in, every cache holds everything:
  the first W tokens' keys, values and NLLs do not depend on the map, so they are computed once per sequence (and
  kept for its later maps) and each map runs only the later tokens."""

  def __init__(self, model, *, sink_size: int, window: int):
    check_model(model.cfg)
    if not 0 <= sink_size < window:
      raise ValueError(f"need 0 <= sink size < window, got {sink_size} and {window}")
    self.cfg = model.cfg
    self.graphdef, self.state = nnx.split(model)
    self.sink_size, self.window = sink_size, window
    self._prefixes = {}                   # (ids, P) -> (NLL of the first P targets, per-layer k0 / v)
    kw = dict(sink_size=sink_size, window=window)
    L, H = model.cfg.num_layers, model.cfg.num_kv_heads

    def prefix(state, tokens, targets):
      m = nnx.merge(self.graphdef, state)
      h, kv = hidden_with(m, tokens, jnp.ones((L, H)), hybrid_attention, **kw)
      return token_nll(m, h, targets)[0], kv

    def rest(state, kv, tokens, targets, full_map):
      m = nnx.merge(self.graphdef, state)
      h, _ = hidden_with(m, tokens, full_map, hybrid_attention, prefix=kv, **kw)
      return token_nll(m, h, targets)[0]
    self._prefix, self._rest = jax.jit(prefix), jax.jit(rest)

  def __call__(self, ids, full_map) -> np.ndarray:
    full = np.asarray(full_map, np.float32)
    L, H = self.cfg.num_layers, self.cfg.num_kv_heads
    if full.shape != (L, H):
      raise ValueError(f"map of shape {list(full.shape)}, the model needs [{L}, {H}] (layers x KV heads)")
    ids = np.asarray(ids, np.int32)
    P = min(self.window, len(ids) - 1)
    key = (ids.tobytes(), P)
    if key not in self._prefixes:
      nll0, kv = self._prefix(self.state, jnp.asarray(ids[None, :P]), jnp.asarray(ids[None, 1:P + 1]))
      self._prefixes[key] = (np.asarray(nll0, np.float64), kv)
    nll0, kv = self._prefixes[key]
    if P == len(ids) - 1:
      return nll0
    nll = self._rest(self.state, kv, jnp.asarray(ids[None, P:-1]), jnp.asarray(ids[None, P + 1:]), jnp.asarray(full))
    return np.concatenate([nll0, np.asarray(nll, np.float64)])
