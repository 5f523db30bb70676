"""Text generation, chat and streaming perplexity with a fixed-shape KV cache: `python -m sinkjax.generate SUBCOMMAND`.

    python -m sinkjax.generate generate --checkpoint RUN_DIR --prompt TEXT [--prompt TEXT ...] --max-new-tokens N \\
        [--temperature T] [--top-k K] [--top-p P] [--seed S] [--no-stop] \\
        [--cache full|streaming|hybrid] [--sink-size S --window W] [--full-heads F | --full-heads-from MAP.json] \\
        [section.key=value ...]
    python -m sinkjax.generate chat --checkpoint RUN_DIR [--prompt TEXT ...] [--system TEXT] [--echo] \\
        [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S] [--no-stop]
    python -m sinkjax.generate perplexity FILE --checkpoint RUN_DIR [--sink-size S] [--window W] [--max-tokens N] \\
        [--chunk T] [--full-heads F[,F...] [--full-heads-random SEED[,...]] | --full-heads-from MAP.json]

Each subcommand has its own options (`--help` after its name): `generate` and `chat` share the sampling.* section,
`generate` and `perplexity` the head policy (cache.*, `sinkjax.cache_policy.CacheOptions`). The command line before
the subcommands (`--chat`, `--ppl FILE`, `--ppl-chunk T`, no subcommand) is refused in one line that spells it anew.

Works for every attention variant (vanilla, sink, gated) and for models with learnable sink tokens. Overrides
change the run's config (`model.dtype=float32`); a `mesh.*` override (`mesh.fsdp=8`) restores the parameters into
their training placement on that mesh (`sinkjax.run.load_run(mesh="run")`) instead of whole on every device, and the
summary line of `generate` gives the KV cache's bytes per device, the mesh, the parameter bytes per device and the
devices' peak memory. Several `--prompt`s are generated together, one row each (any lengths,
`Generator.generate_batch`), rows and the KV cache split over mesh.data x mesh.fsdp where they divide, the cache's KV
heads over mesh.tensor. Under a launcher (`launch/local.sh --module sinkjax.generate -- generate ARGS`, the TPU VM and
SLURM scripts) the processes join with `jax.distributed` as sinkjax.train's do, all run the same generation, and
process 0 alone prints; `chat` and `perplexity` run in one process.

Tokens as the model's tokenizer wants them (`sinkjax.data.tokenizers`): a `generate` prompt gets BOS only where the
tokenizer adds one and is printed before its continuation. `chat` holds a conversation whose user turns are the
`--prompt`s in order or, without one, the lines of stdin (an empty line or end of input ends it): for each turn the
whole conversation (after `--system`, if given) is rendered through the tokenizer's chat template with the
assistant's generation prompt, and the reply alone is printed (`--echo` prints the rendering before it; `run_chat`:
one full cache of up to 4,096 tokens, replies of up to 512 tokens by default). Generation stops at the model's stop
ids (generation_config.json's EOS, the tokenizer's EOS, or BOS for sinkjax's own runs; `--no-stop` goes on) and
prints every token it produced, special ones included, but the stop token.

Cache of `generate` (see `sinkjax.cache`): per layer fixed-size [B, C, Hkv, D] key/value arrays plus a token counter,
so the prefill compiles once (for this prompt's length) and the decode step compiles once and is reused for every
token.
- `--cache full`: C = prompt + N tokens; nothing is evicted (positions past `model.max_seq_len` are allowed, with a
  warning: the model never saw them in training).
- `--cache streaming --sink-size S --window W`: StreamingLLM. C = W: the first S tokens ("attention sinks") stay
  forever, the other W - S slots are a ring buffer of the most recent tokens (the middle is evicted). Memory is
  constant in the number of generated tokens and generation can run past `model.max_seq_len`.
RoPE: keys are stored un-rotated and rotated at each step to their position *within the cache* (sinks 0..S-1, then
the window in age order), the query to the last position: StreamingLLM's position shift, so relative distances
never exceed W and the eviction leaves no gap. Learnable sink tokens (`model.sink_tokens` = n) are parameters of
each attention layer, not cache entries: they are never evicted and hold positions 0..n-1, shifting everything
else by n.

- `--cache hybrid` (implied by `--full-heads F` or `--full-heads-from MAP`): a per-head policy (`HybridKVCache`,
  DuoAttention's split): a fraction F (or a count) of the KV heads keep a full cache at their true positions, the
  others sinks + window as above. The full heads are those with the highest measured importance ([Sink-MoE] eq. 5; from
  the run's metrics.jsonl or eval's report.json) or lowest sink ratio alpha, per layer or globally; see
  `sinkjax.cache_policy` for the flags (--full-heads-by/-scope/-gqa, --head-scores, --full-heads-random).

A prompt longer than a streaming cache is prefilled up to W tokens and the rest is fed through the decode step
(the same compiled function), which is exactly what token-by-token streaming would compute.

`perplexity FILE` scores the file (BOS, where the tokenizer adds one, + its tokens, first `--max-tokens`) under three
caches: full, window-only (S = 0, the same W) and sinks + window, plus a hybrid row per --full-heads F (and per
random seed, or the --full-heads-from map), and prints a StreamingLLM-style table with each cache's key/value memory
in bytes. It scores in blocks (`--chunk` T positions per step against the cache, `sinkjax.cache`'s append mode): each
position sees exactly the keys, at the positions, that one decode step per token gives it (`--chunk 1`), for every
cache, so the numbers are those of token-by-token streaming (up to f32 rounding) at a fraction of the steps.
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":
  errors.require_extra("sinkjax.generate")   # before the imports below: without the train extra, one line naming it

import contextlib
import dataclasses
import functools
import logging
import math
import shlex
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax import cache_policy, distributed, options, paths
from sinkjax import sharding as sharding_lib
from sinkjax.cache import KVCache, make_cache, shard_cache
from sinkjax.errors import UserError
from sinkjax.config import declare
from sinkjax.markdown import table
from sinkjax.run import asks_for_mesh, load_run


class UsageError(UserError):
  """A bad command line (the message says what to change)."""


# ----------------------------------------------------------------------------------------------------------------
# Sampling


def sample_logits(logits, key, temperature, top_k, top_p):
  """Next tokens [B] from logits [B, V]: greedy when temperature <= 0, else softmax(logits / temperature)
  restricted to the top_k largest (0 = all) and to the smallest set of tokens with mass >= top_p (1 = all).

  All three knobs may be traced scalars, so changing them never recompiles.
  """
  logits = logits.astype(jnp.float32)
  V = logits.shape[-1]
  greedy = jnp.argmax(logits, axis=-1)
  scaled = logits / jnp.maximum(temperature, 1e-6)
  desc = jnp.sort(scaled, axis=-1)[..., ::-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, V), V)
  kth = jnp.take_along_axis(desc, jnp.broadcast_to(k - 1, desc.shape[:-1] + (1,)).astype(jnp.int32), axis=-1)
  scaled = jnp.where(scaled < kth, -jnp.inf, scaled)
  # nucleus: keep sorted token i if the mass strictly before it is < top_p (so the top token always stays)
  probs = jax.nn.softmax(scaled, axis=-1)
  desc = jnp.sort(probs, axis=-1)[..., ::-1]            # the same values, so the threshold compares exactly
  before = jnp.cumsum(desc, axis=-1) - desc
  kept = jnp.where(before < top_p, desc, jnp.inf).min(axis=-1, keepdims=True)
  scaled = jnp.where(probs < kept, -jnp.inf, scaled)
  sampled = jax.random.categorical(key, scaled, axis=-1)
  return jnp.where(temperature > 0, sampled, greedy).astype(jnp.int32)


# ----------------------------------------------------------------------------------------------------------------
# Generation


def prefill_step(graphdef, mesh, state, cache, tokens, key, temperature, top_k, top_p):
  """A prompt's tokens [B, T] into an empty cache: (next tokens [B] sampled from the last position, logits [B, T, V],
  the cache placed by `shard_cache` on `mesh`)."""
  logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache)
  return sample_logits(logits[:, -1], key, temperature, top_k, top_p), logits, shard_cache(cache, mesh)


def decode_step(graphdef, mesh, state, cache, token, key, temperature, top_k, top_p):
  """One token per row [B] against the cache: (next tokens [B], logits [B, V], the cache placed by `shard_cache` on
  `mesh`, so its rows and KV heads stay where `Generator.new_cache` put them)."""
  logits, cache = nnx.merge(graphdef, state)(token[:, None], cache=cache)
  return sample_logits(logits[:, -1], key, temperature, top_k, top_p), logits[:, -1], shard_cache(cache, mesh)


class Generator:
  """A model with a jitted prefill and a jitted decode step over a fixed-shape `KVCache` (`capacity` slots,
  `sink_size` sinks) or, with `full_heads` ([L][Hkv] bools), a `HybridKVCache` whose full heads keep `capacity`
  slots and whose streaming heads keep `window` (with `sink_size` sinks), for `batch` rows.

  The model is split once into (graphdef, state); both functions take the state as an argument, so one compile of
  each serves a whole generation (`prefill_fn` / `decode_fn` are the `jax.jit` objects of `prefill_step` /
  `decode_step`; `lower_decode` lowers the latter without running it, which is what `sinkjax.compile --decode`
  compiles). Placement follows the parameters' mesh (`mesh`, default the mesh they are placed on; none for arrays
  on one device): the steps run under `jax.set_mesh(mesh)`, the cache's rows are split over the batch axes and its
  KV heads over "tensor" where they divide (`sinkjax.cache.shard_cache`, kept by both steps), the prompt's rows
  like the cache's. In a job of several processes every process runs the same loop on the same prompts; each
  fills its own devices' part of every input and reads the whole output.
  """

  def __init__(self, model: nnx.Module, *, capacity: int, sink_size: int = 0, batch: int = 1, full_heads=None,
               window: int = 0, mesh=None, collective_matmul: str = "gather"):
    self.cfg = model.cfg
    self.capacity, self.sink_size, self.batch = capacity, sink_size, batch
    self.full_heads, self.window = full_heads, window
    self.graphdef, self.state = nnx.split(model)
    self.mesh = sharding_lib.mesh_of(self.state) if mesh is None else mesh
    if self.mesh is None:
      self.rows = self.whole = None
    else:
      self.whole = sharding_lib.replicated(self.mesh)
      self.rows = (sharding_lib.batch_sharding(self.mesh) if batch % sharding_lib.batch_shards(self.mesh) == 0
                   else self.whole)
    options = sharding_lib.compiler_options(collective_matmul, self.mesh)   # mesh.collective_matmul on TPU
    step = lambda f: jax.jit(functools.partial(f, self.graphdef, self.mesh), donate_argnums=(1,),
                             compiler_options=options)
    self.prefill_fn, self.decode_fn = step(prefill_step), step(decode_step)
    self.sample_fn = jax.jit(sample_logits)
    self._empty = lambda: shard_cache(make_cache(self.cfg, batch, capacity, sink_size=sink_size,
                                                 full_heads=full_heads, window=window), self.mesh)
    self._new_cache = jax.jit(self._empty)

  def _context(self):
    return contextlib.nullcontext() if self.mesh is None else jax.set_mesh(self.mesh)

  def _put(self, x, rows: bool = False):
    """A host value every process holds as a global array: split like the rows (`rows`) or whole."""
    if self.mesh is None:
      return jnp.asarray(x)
    return sharding_lib.put_global(x, self.rows if rows else self.whole)

  def new_cache(self):
    """An empty cache, created in place on the mesh (no device ever holds the whole of a split cache)."""
    with self._context():
      return self._new_cache()

  def abstract_cache(self):
    """The cache's shapes with the shardings `new_cache` gives them (nothing is allocated)."""
    return shard_cache(jax.eval_shape(self._empty), self.mesh)

  def cache_bytes_per_device(self) -> int:
    """Bytes of the cache one device holds (its shards of every array, from the shardings `new_cache` gives)."""
    return int(sum(math.prod(x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape)
                   * x.dtype.itemsize for x in jax.tree.leaves(self.abstract_cache())))

  def _knobs(self, temperature, top_k, top_p) -> tuple:
    return (self._put(np.float32(temperature)), self._put(np.int32(top_k)), self._put(np.float32(top_p)))

  def lower_decode(self):
    """`decode_fn` lowered for this placement with abstract arguments (the parameters as they are placed, the cache
    as `new_cache` places it, one token per row split like the rows): what runs, compiled without running it."""
    spec = lambda x, s=None: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s or getattr(x, "sharding", None))
    token = jax.ShapeDtypeStruct((self.batch,), jnp.int32, sharding=self.rows)
    scalars = [jax.ShapeDtypeStruct((), d, sharding=self.whole) for d in (jnp.float32, jnp.int32, jnp.float32)]
    key = jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=self.whole)
    with self._context():
      return self.decode_fn.lower(jax.tree.map(spec, self.state), self.abstract_cache(), token, key, *scalars)

  def generate(self, prompt_ids, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
               top_p: float = 1.0, seed: int = 0, stop_token=None, on_token=None,
               on_step=None) -> list[int]:
    """Samples up to `max_new_tokens` tokens after `prompt_ids` ([batch, P] or, for one row, [P]); returns those of
    the first row.

    on_token(token_id) is called as each token of the first row is produced (for streaming output); on_step(cache)
    after every decode step. Stops early after producing `stop_token` (an id or a collection of ids; not included in
    the result).
    """
    rows = np.asarray(prompt_ids, np.int32).reshape(self.batch, -1)
    token = None if on_token is None else (lambda row, tok: on_token(tok) if row == 0 else None)
    return self.generate_batch(list(rows), max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               seed=seed, stop_token=stop_token, on_token=token, on_step=on_step)[0]

  def generate_batch(self, prompts, max_new_tokens: int, *, temperature: float = 1.0, top_k: int = 0,
                     top_p: float = 1.0, seed: int = 0, key=None, stop_token=None, stop=None, on_token=None,
                     on_step=None, prefill_to=None) -> list[list[int]]:
    """Up to `max_new_tokens` tokens after each of `prompts` (at most `batch` non-empty token lists of any lengths),
    one row each, generated together; returns one list per prompt.

    Rows of different lengths need no padding: the shortest prompt (up to the cache's prefill limit) is prefilled for
    every row, then each step feeds every row its next prompt token while it has one, else the token it sampled, so
    each row's cache holds exactly its own sequence, as if it were generated alone. A row stops after producing a
    stop id (`stop_token`: an id or ids, not included), `max_new_tokens` tokens, or when `stop(row, tokens)` says so;
    the loop ends when every row has. on_token(row, token) as each token is produced; on_step(cache) after every
    decode step in which every row generates. Sampling: one key per step (`key`, raw uint32, else from `seed`)
    shared by the rows; a row's step i draws with fold_in(key, i) once every row is past its prompt, so one row
    alone draws as `generate` does. prefill_to(n): a length >= n to prefill instead (right-padded; then cut back to
    n, a full cache only), so that few prefill shapes compile for many prompt lengths.
    """
    n, B = len(prompts), self.batch
    if not 0 < n <= B or not all(len(p) for p in prompts):
      raise ValueError(f"need 1..{B} non-empty prompts, got {[len(p) for p in prompts]}")
    stops = set() if stop_token is None else ({int(stop_token)} if isinstance(stop_token, (int, np.integer))
                                              else {int(t) for t in stop_token})
    rows = [list(p) for p in prompts] + [list(prompts[0])] * (B - n)     # filler rows: done from the start
    lengths = np.asarray([len(r) for r in rows])
    with self._context():
      cache = self.new_cache()
      head = min(int(lengths.min()), cache.max_prefill)
      width = head if prefill_to is None else min(max(prefill_to(head), head), cache.max_prefill)
      if width > head and not (isinstance(cache, KVCache) and cache.sink_size == 0):
        raise ValueError("prefill_to pads the prefill of a full KVCache only")
      grid = np.zeros((B, max(int(lengths.max()), width)), np.int32)
      for r, row in enumerate(rows):
        grid[r, :len(row)] = row
      last = int(lengths.max())
      knobs = self._knobs(temperature, top_k, top_p)
      base = np.asarray(jax.random.PRNGKey(seed) if key is None else key)
      draw = lambda i: self._put(np.asarray(jax.random.fold_in(base, i)))
      nxt, logits, cache = self.prefill_fn(self.state, cache, self._put(grid[:, :width], rows=True),
                                           draw(max(0, head - last)), *knobs)
      if width > head:   # the logits at head - 1 saw only real tokens (causal); the later slots are overwritten
        cache = dataclasses.replace(cache, length=self._put(np.asarray(head, np.int32)))
        nxt = self.sample_fn(logits[:, head - 1], draw(max(0, head - last)), *knobs)
      del logits
      out = [[] for _ in range(B)]
      done = [r >= n for r in range(B)]
      pos = head                        # tokens in the cache; nxt was sampled at position pos - 1
      while True:
        toks = distributed.to_host(nxt)
        for r in range(B):
          if done[r] or pos < lengths[r]:
            continue
          tok = int(toks[r])
          if tok in stops:
            done[r] = True
            continue
          out[r].append(tok)
          if on_token is not None:
            on_token(r, tok)
          if len(out[r]) >= max_new_tokens or (stop is not None and stop(r, out[r])):
            done[r] = True
        if all(done):
          return out[:n]
        feed = np.where(pos < lengths, grid[:, min(pos, grid.shape[1] - 1)], toks).astype(np.int32)
        nxt, _, cache = self.decode_fn(self.state, cache, self._put(feed, rows=True), draw(max(0, pos + 1 - last)),
                                       *knobs)
        if on_step is not None and pos >= last:
          on_step(cache)
        pos += 1


def cache_plan(cache: str, prompt_len: int, max_new_tokens: int, sink_size: int | None, window: int | None,
               default_window: int) -> tuple[int, int]:
  """(capacity, sink_size) for the CLI's cache options; raises UsageError on bad combinations."""
  if cache == "full":
    if sink_size is not None or window is not None:
      raise UsageError("--sink-size/--window only apply to --cache streaming")
    return prompt_len + max_new_tokens, 0
  sink_size = 4 if sink_size is None else sink_size
  window = default_window if window is None else window
  check_window(sink_size, window)
  return window, sink_size


def check_window(sink_size: int, window: int) -> None:
  if sink_size < 0:
    raise UsageError(f"--sink-size must be >= 0, got {sink_size}")
  if window <= sink_size:
    raise UsageError(f"--window (the whole cache, sinks included) must exceed --sink-size; got window {window}, "
                     f"sink size {sink_size}")


class TextStream:
  """Prints decoded text as tokens arrive, holding back an incomplete UTF-8 character (shown as U+FFFD)."""

  def __init__(self, tokenizer, out=None, skip_special_tokens: bool = True):
    self.tok, self.out, self.ids, self.printed = tokenizer, sys.stdout if out is None else out, [], ""
    self.skip = skip_special_tokens

  def text(self) -> str:
    return self.tok.decode(self.ids, skip_special_tokens=self.skip)

  def __call__(self, token: int) -> None:
    self.ids.append(token)
    text = self.text()
    stable = text[:-1] if text.endswith("\ufffd") else text
    if stable.startswith(self.printed) and len(stable) > len(self.printed):
      self.out.write(stable[len(self.printed):])
      self.out.flush()
      self.printed = stable

  def finish(self) -> None:
    text = self.text()
    if text.startswith(self.printed):
      self.out.write(text[len(self.printed):])
    self.out.write("\n")
    self.out.flush()


# ----------------------------------------------------------------------------------------------------------------
# Streaming perplexity


def _scores(logits, targets):
  """(log-probability of each target, whether it is the argmax) for logits [..., V] and targets [...]."""
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits, axis=-1), targets[..., None], axis=-1)[..., 0]
  return logp, jnp.argmax(logits, axis=-1) == targets


@functools.partial(jax.jit, static_argnums=0)
def _prefill_scores(graphdef, state, cache, tokens):
  logits, cache = nnx.merge(graphdef, state)(tokens, cache=cache)
  return _scores(logits[:, :-1], tokens[:, 1:]), logits[:, -1], cache


@functools.partial(jax.jit, static_argnums=0)
def _chunk_scores(graphdef, state, cache, inputs, targets):
  """(cache, scores) of targets [n, B, T] fed inputs [n, B, T] a chunk of T at a time through an append-mode cache
  (one `lax.scan` over the n chunks)."""
  model = nnx.merge(graphdef, state)

  def step(cache, xs):
    tok, target = xs
    logits, cache = model(tok, cache=cache)
    return cache, _scores(logits, target)

  return jax.lax.scan(step, cache, (inputs, targets))


@functools.partial(jax.jit, static_argnums=0)
def _decode_scores(graphdef, state, cache, inputs, targets):
  """Scores of targets [N, B] fed inputs [N, B] one step at a time through the cache (one `lax.scan`)."""
  model = nnx.merge(graphdef, state)

  def step(cache, xs):
    tok, target = xs
    logits, cache = model(tok[:, None], cache=cache)
    return cache, _scores(logits[:, 0], target)

  return jax.lax.scan(step, cache, (inputs, targets))[1]


def streaming_scores(model: nnx.Module, ids, *, capacity: int, sink_size: int = 0, full_heads=None,
                     window: int = 0, chunk: int | None = None) -> tuple[np.ndarray, np.ndarray]:
  """(nll [B, N-1] float64 natural log, hit [B, N-1] bool) of ids[:, 1:] given everything before, token by token
  through the cache of `make_cache(capacity, sink_size, full_heads, window)`; hit = the target is the argmax (so
  greedy decoding from the true prefix would produce it). ids: [B, N] or [N] (then B = 1).

  The first min(N, cache.max_prefill) tokens are prefilled at once (nothing is evicted before the cache is full, so
  this equals feeding them one by one); the rest go through the decode step inside one `lax.scan`. The jitted
  steps are shared by calls of the same shapes and cache layout.

  chunk = T: score in blocks instead, T positions per step against an append-mode cache (`sinkjax.cache`, module
  docstring): every position sees exactly the keys, at the positions, that it sees token by token, for every cache
  (full, window, sinks + window, hybrid); T is capped at the smallest window's C - S. One compile for the full
  chunks, one for the remainder.
  """
  ids = np.atleast_2d(np.asarray(ids, np.int32))
  N = ids.shape[1]
  graphdef, state = nnx.split(model)
  cache = make_cache(model.cfg, ids.shape[0], capacity, sink_size=sink_size, full_heads=full_heads, window=window)
  if chunk is not None:
    return _blockwise_scores(graphdef, state, cache, ids, chunk)
  head = min(N, cache.max_prefill)
  (lp, hit), last, cache = _prefill_scores(graphdef, state, cache, jnp.asarray(ids[:, :head]))
  parts = [(lp, hit)]
  if head < N:
    parts.append(tuple(x[:, None] for x in _scores(last, jnp.asarray(ids[:, head]))))
    if head + 1 < N:
      lp, hit = _decode_scores(graphdef, state, cache, jnp.asarray(ids[:, head:N - 1].T), jnp.asarray(ids[:, head + 1:].T))
      parts.append((lp.T, hit.T))
  return (-np.concatenate([np.asarray(p[0], np.float64) for p in parts], axis=1),
          np.concatenate([np.asarray(p[1]) for p in parts], axis=1))


def _blockwise_scores(graphdef, state, cache, ids, chunk: int):
  """`streaming_scores` in chunks of `chunk` positions (see there)."""
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1 positions, got {chunk}")
  chunk = min(chunk, cache.max_chunk)
  cache = cache.appending()
  inputs, targets = ids[:, :-1], ids[:, 1:]
  n = inputs.shape[1] // chunk
  parts = []
  if n:
    split = lambda a: jnp.asarray(a[:, :n * chunk].reshape(a.shape[0], n, chunk).transpose(1, 0, 2))
    cache, (lp, hit) = _chunk_scores(graphdef, state, cache, split(inputs), split(targets))
    parts.append(tuple(np.asarray(x).transpose(1, 0, 2).reshape(ids.shape[0], n * chunk) for x in (lp, hit)))
  if n * chunk < inputs.shape[1]:
    rest = lambda a: jnp.asarray(a[None, :, n * chunk:])
    _, (lp, hit) = _chunk_scores(graphdef, state, cache, rest(inputs), rest(targets))
    parts.append((np.asarray(lp[0]), np.asarray(hit[0])))
  return (-np.concatenate([np.asarray(p[0], np.float64) for p in parts], axis=1),
          np.concatenate([p[1] for p in parts], axis=1))


def streaming_nll(model: nnx.Module, ids, *, capacity: int, sink_size: int = 0, full_heads=None,
                  window: int = 0, chunk: int | None = None) -> np.ndarray:
  """Negative log-likelihood [N-1] (float64, natural log) of one sequence's ids[1:], see `streaming_scores`."""
  return streaming_scores(model, ids, capacity=capacity, sink_size=sink_size, full_heads=full_heads,
                          window=window, chunk=chunk)[0][0]


def kv_bytes(cfg, capacity: int, *, sink_size: int = 0, full_heads=None, window: int = 0, batch: int = 1) -> int:
  """Key/value memory of a cache (`make_cache`'s arguments), from its shapes (nothing is allocated)."""
  shapes = jax.eval_shape(lambda: make_cache(cfg, batch, capacity, sink_size=sink_size, full_heads=full_heads,
                                             window=window))
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes) if x.ndim == 4))


def perplexity_table(model, ids, *, sink_size: int, window: int, policies=(), chunk: int | None = 64) -> list[dict]:
  """Full cache, window-only (S = 0), sinks + window, and a hybrid per (label, [L][Hkv] map) of `policies`, over
  the same tokens, scored in blocks of `chunk` positions (None: one decode step per token; the same numbers, see
  `streaming_scores`); one record per mode with its key/value memory in bytes and seconds."""
  n_learned = getattr(model.cfg, "sink_tokens", 0)
  N, every = len(ids), model.cfg.num_layers * model.cfg.num_kv_heads
  modes = [("full cache", dict(capacity=N), every, f"{N}"),
           (f"window only (S=0, W={window})", dict(capacity=window), 0, f"{min(N, window)}"),
           (f"sinks + window (S={sink_size}, W={window})", dict(capacity=window, sink_size=sink_size), 0,
            f"{min(N, window)}")]
  for label, full in policies:
    modes.append((f"hybrid {label} (S={sink_size}, W={window})",
                  dict(capacity=N, sink_size=sink_size, window=window, full_heads=cache_policy.as_tuple(full)),
                  int(np.sum(full)), f"{N} / {min(N, window)}"))
  rows = []
  for i, (name, kw, n_full, peak) in enumerate(modes):
    how = "one decode step each" if chunk is None else f"in blocks of up to {chunk}"
    print(f"[{i + 1}/{len(modes)}] {name}: {N} tokens, {how}...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    nll = streaming_nll(model, ids, chunk=chunk, **kw)
    beyond = nll[window - 1:]              # targets at positions >= window: predicted after eviction began
    rows.append(dict(mode=name, tokens=N, full_heads=n_full, heads=every, ppl=math.exp(nll.mean()),
                     ppl_first_window=math.exp(nll[:window - 1].mean()),
                     ppl_beyond_window=math.exp(beyond.mean()) if len(beyond) else float("nan"),
                     peak_cache=peak, kv_bytes=kv_bytes(model.cfg, **kw), learned_sinks=n_learned,
                     seconds=time.perf_counter() - t0))
  return rows


def format_table(rows: list[dict], window: int) -> str:
  extra = f" (+{rows[0]['learned_sinks']} learned sink tokens)" if rows and rows[0]["learned_sinks"] else ""
  return "\n".join(table(
      ["mode", "full heads", "tokens", "PPL", f"PPL (first {window})", f"PPL (after {window})", f"peak cache{extra}",
       "KV cache bytes"],
      ([r["mode"], f"{r['full_heads']}/{r['heads']}", r["tokens"], f"{r['ppl']:.3f}", f"{r['ppl_first_window']:.3f}",
        f"{r['ppl_beyond_window']:.3f}", r["peak_cache"], f"{r['kv_bytes']:,}"] for r in rows), "lrrrrrrr"))


# ----------------------------------------------------------------------------------------------------------------
# Command line


@dataclasses.dataclass
class _RunOption:
  """The run every subcommand reads (each subcommand's section starts with it)."""
  checkpoint: str = declare("", alias="--checkpoint", metavar="CHECKPOINT", required=True,
                        help="run directory of a training run")


@dataclasses.dataclass
class SamplingOptions:
  """The sampling.* options of `generate` and `chat` (`--temperature 0` = `sampling.temperature=0`)."""
  temperature: float = declare(1.0, ">=0", alias="--temperature", help="0 = greedy")
  top_k: int = declare(0, ">=0", alias="--top-k", help="sample from the k most likely tokens (0 = all)")
  top_p: float = declare(1.0, "(0,1]", alias="--top-p", help="nucleus sampling mass in (0, 1] (1 = all)")
  seed: int = declare(0, alias="--seed", help="the sampling seed")
  no_stop: bool = declare(False, alias="--no-stop",
                      help="keep going after the model emits a stop token (its EOS; BOS for sinkjax's own runs)")


@dataclasses.dataclass
class GenerateOptions(_RunOption):
  """The generate.* options of `python -m sinkjax.generate generate` (each flag the alias of its key: `--prompt X` =
  `generate.prompt=X`; sampling is the sampling.* section, the head policy the cache.* section,
  `sinkjax.cache_policy.CacheOptions`)."""
  prompt: list | None = declare(None, alias="--prompt", metavar="PROMPT", required=True,
                            help="text to continue (BOS is prepended where the tokenizer adds one); repeat it for a "
                                 "batch of prompts, generated together (one row each, split over the mesh's batch axes "
                                 "when they divide)")
  max_new_tokens: int | None = declare(None, ">=1", alias="--max-new-tokens", required=True,
                                   help="number of tokens to generate")
  cache: str | None = declare(None, choices=("full", "streaming", "hybrid"), alias="--cache",
                          help="full (default), streaming, or hybrid (per-head; implied by --full-heads/"
                               "--full-heads-from)")
  sink_size: int | None = declare(None, ">=0", alias="--sink-size",
                              help="streaming (heads): first tokens kept forever (default 4)")
  window: int | None = declare(None, ">=1", alias="--window",
                           help="streaming (heads): cache size W incl. sinks (default: training data.seq_len)")


CHAT_MAX_NEW_TOKENS = 512      # a reply's length when --max-new-tokens is not given
CHAT_CAPACITY = 4096           # a conversation's cache (at most model.max_seq_len): the history it can hold


@dataclasses.dataclass
class ChatOptions(_RunOption):
  """The chat.* options of `python -m sinkjax.generate chat` (sampling: the sampling.* section)."""
  prompt: list | None = declare(None, alias="--prompt", metavar="PROMPT",
                            help="a user turn; repeat it for the turns of one conversation, in order (without it: each "
                                 "line of stdin is a turn, an empty line ends it)")
  system: str | None = declare(None, alias="--system", help="a system message before the first user turn")
  echo: bool = declare(False, alias="--echo",
                   help="print the conversation as the model reads it (the chat template's rendering) before each "
                        "reply")
  max_new_tokens: int = declare(CHAT_MAX_NEW_TOKENS, ">=1", alias="--max-new-tokens",
                            help="the longest reply, in tokens")


@dataclasses.dataclass
class PerplexityOptions(_RunOption):
  """The perplexity.* options of `python -m sinkjax.generate perplexity FILE` (FILE: the one word without "=", or
  --file; the head policy: the cache.* section, whose --full-heads / --full-heads-random take lists here)."""
  file: str = declare("", alias="--file", metavar="FILE", required=True,
                  help="the text to score under full / window-only / sinks + window caches")
  sink_size: int = declare(4, ">=0", alias="--sink-size", help="first tokens kept forever by the streaming caches")
  window: int | None = declare(None, ">=1", alias="--window",
                           help="the streaming caches' size W incl. sinks (default: training data.seq_len)")
  max_tokens: int = declare(4096, ">=2", alias="--max-tokens", help="score at most this many tokens")
  chunk: int = declare(64, ">=1", alias="--chunk",
                   help="positions scored per step against the cache (capped at W - S; the same numbers as 1 = one "
                        "decode step per token, which is slower)")


PROG = "python -m sinkjax.generate"
COMMANDS = {
    "generate": options.Command(
        prog=f"{PROG} generate", run_overrides=True,
        sections={"generate": GenerateOptions, "sampling": SamplingOptions, "cache": cache_policy.CacheOptions},
        description="continue each --prompt (a batch of them together) with a full, streaming or per-head cache"),
    "chat": options.Command(
        prog=f"{PROG} chat", run_overrides=True, sections={"chat": ChatOptions, "sampling": SamplingOptions},
        description="a conversation through the tokenizer's chat template: the --prompt turns, or stdin's lines"),
    "perplexity": options.Command(
        prog=f"{PROG} perplexity", run_overrides=True, positional="perplexity.file",
        sections={"perplexity": PerplexityOptions, "cache": cache_policy.CacheOptions},
        description="streaming perplexity of FILE under full, window-only, sinks + window and per-head caches"),
}


def cache_mode(opts: GenerateOptions, cache: cache_policy.CacheOptions) -> str:
  """The cache `generate` uses: --cache, else hybrid with a head policy (--full-heads / --full-heads-from) and full
  without one; the policy's own checks (`cache_policy.check`), one policy value, and S < W when both are given."""
  cache_policy.check(cache)
  mode = opts.cache or ("hybrid" if cache_policy.wanted(cache) else "full")
  if mode != "hybrid" and cache_policy.wanted(cache):
    raise UsageError(f"--full-heads/--full-heads-from make a hybrid cache; drop --cache {mode}")
  if mode == "hybrid" and not cache_policy.wanted(cache):
    raise UsageError("--cache hybrid needs --full-heads F or --full-heads-from FILE")
  for flag, value in (("--full-heads", cache.full_heads), ("--full-heads-random", cache.full_heads_random)):
    if value is not None and "," in value:
      raise UsageError(f"generation takes one {flag} value (lists are for the perplexity subcommand's table)")
  if mode == "full" and (opts.sink_size is not None or opts.window is not None):
    raise UsageError("--sink-size/--window only apply to --cache streaming or hybrid")
  if opts.sink_size is not None and opts.window is not None:
    check_window(opts.sink_size, opts.window)
  return mode


def loaded_run(opts: _RunOption, run_overrides, *, one_process: str | None = None):
  """(model, cfg, tokenizer) of the run opts.checkpoint, with the run's config overrides; a `mesh.*` override
  restores the parameters into their training placement on that mesh (`load_run(mesh="run")`). `one_process`: what
  refuses to run in a job of several processes (said in one line)."""
  distributed.maybe_initialize()    # before anything touches JAX devices (a job of several processes)
  paths.check_bucket(opts.checkpoint, "--checkpoint")
  if not paths.as_path(opts.checkpoint, "--checkpoint").is_dir():
    raise UsageError(f"run directory {opts.checkpoint} does not exist")
  if one_process and jax.process_count() > 1:
    raise UsageError(f"{one_process} runs in one process (all its devices); start it without a launcher")
  logging.getLogger("absl").setLevel(logging.ERROR)     # Orbax's read-only notices are not the user's concern
  model, cfg, tok, _ = load_run(opts.checkpoint, None, run_overrides,
                                mesh="run" if asks_for_mesh(run_overrides) else None)
  return model, cfg, tok


def on_its_mesh(model):
  """The mesh the parameters are placed on, active (as in training: the kernels follow the mesh)."""
  return jax.set_mesh(sharding_lib.mesh_of(nnx.state(model, nnx.Param)))


def run_perplexity(opts: PerplexityOptions, cache: cache_policy.CacheOptions, model, cfg, tok) -> None:
  """The streaming-perplexity table of opts.file (BOS, where the tokenizer adds one, + its first max_tokens tokens)
  under every cache, printed."""
  window = cfg.data.seq_len if opts.window is None else opts.window
  check_window(opts.sink_size, window)
  policies = cache_policy.policies_from(cache, cfg.model, opts.checkpoint) if cache_policy.wanted(cache) else []
  text = paths.as_path(opts.file, "FILE").read_bytes().decode("utf-8", errors="replace")
  ids = tok.encode_document(text)[:opts.max_tokens]
  if len(ids) <= window:
    print(f"note: {len(ids)} tokens do not exceed the window ({window}); all modes see the same context",
          file=sys.stderr)
  for label, full in policies:
    print(f"hybrid {label}: {cache_policy.describe(full)}", file=sys.stderr)
  rows = perplexity_table(model, ids, sink_size=opts.sink_size, window=window, policies=policies,
                          chunk=None if opts.chunk == 1 else opts.chunk)
  print(f"streaming perplexity of {opts.file} ({len(ids)} tokens) under {opts.checkpoint} "
        f"(attention={cfg.model.attention}, sink_tokens={cfg.model.sink_tokens}, trained at "
        f"seq_len {cfg.data.seq_len})")
  print(format_table(rows, window))


def prompt_ids(tok, prompt: str, *, chat: bool = False, system: str | None = None) -> tuple[str, list[int]]:
  """(text, ids) of a prompt as the model reads it: through the tokenizer's chat template with `chat` (the rendered
  text tokenized without added special tokens, as transformers does), else with BOS where the tokenizer adds one.
  A tokenizer without a chat template gets sinkjax's plain "User: ... / Assistant: " layout."""
  if chat:
    text = tok.chat.prompt(prompt, system)
    return text, list(tok.encode(text))
  return prompt, tok.encode_document(prompt)


def run_generate(opts: GenerateOptions, sampling: SamplingOptions, cache: cache_policy.CacheOptions, model, cfg,
                 tok) -> None:
  """Generates after each --prompt with the cache `cache_mode` picks; process 0 alone prints (one prompt: streamed as
  it comes; several: one after the other once the batch is done), each prompt before its continuation, and writes
  the summary line."""
  first = jax.process_index() == 0
  mode = cache_mode(opts, cache)
  ids = [prompt_ids(tok, p)[1] for p in opts.prompt]
  longest = max(map(len, ids))
  streaming = "streaming" if mode == "hybrid" else mode     # the hybrid's streaming heads use S, W
  window, sink_size = cache_plan(streaming, longest, opts.max_new_tokens, opts.sink_size, opts.window,
                                 cfg.data.seq_len)
  capacity, full_heads, note = window, None, f"{mode} cache of {window} slots"
  if mode == "hybrid":
    ((label, full),) = cache_policy.policies_from(cache, cfg.model, opts.checkpoint,
                                                  by_importance=cache.full_heads_random is None)
    capacity, full_heads = longest + opts.max_new_tokens, cache_policy.as_tuple(full)
    note = (f"hybrid cache {label}, {cache_policy.describe(full)} of {capacity} slots, the others {window} slots "
            f"with {sink_size} sinks")
  if capacity > cfg.model.max_seq_len and mode != "streaming" and first:
    print(f"warning: a full cache of {capacity} tokens exceeds model.max_seq_len={cfg.model.max_seq_len}; "
          "positions past it were never trained (try --cache streaming)", file=sys.stderr)
  rows = len(ids)
  gen = Generator(model, capacity=capacity, sink_size=sink_size, full_heads=full_heads, window=window, batch=rows,
                  collective_matmul=cfg.mesh.collective_matmul)
  stream = TextStream(tok, skip_special_tokens=False) if rows == 1 and first else None
  if stream is not None:
    stream.out.write(opts.prompt[0])
  t0 = time.perf_counter()
  outs = gen.generate_batch(ids, opts.max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                            top_p=sampling.top_p, seed=sampling.seed,
                            stop_token=None if sampling.no_stop else tok.stop_ids,
                            on_token=None if stream is None else lambda row, t: stream(t))
  dt = time.perf_counter() - t0
  if not first:
    return
  if stream is not None:
    stream.finish()
  else:
    for text, out in zip(opts.prompt, outs):
      print(text + tok.decode(out, skip_special_tokens=False))
  if mode == "streaming":
    note += f", {sink_size} sinks"
  if any(len(out) < opts.max_new_tokens for out in outs):
    note = f"stopped at a stop token ({', '.join(map(str, tok.stop_ids))}); " + note
  where = sharding_lib.placement(nnx.state(model, nnx.Param))
  peak = where["peak_device_memory"]
  count = f"{len(outs[0])} tokens" if rows == 1 else f"{rows} rows, {sum(map(len, outs))} tokens"
  kv = kv_bytes(cfg.model, capacity, sink_size=sink_size, full_heads=full_heads, window=window, batch=rows)
  print(f"[{count} in {dt:.2f}s incl. compilation; {note}; KV cache {kv:,} bytes, "
        f"{gen.cache_bytes_per_device():,} per device; mesh "
        f"{where['mesh']}, {where['param_bytes_per_device']:,} parameter bytes per device, peak device "
        f"memory {'n/a' if peak is None else f'{peak:,} bytes'}]", file=sys.stderr)


def _stdin_turns(lines):
  """The user turns typed on `lines` (a prompt on a terminal), up to an empty line or the end of input."""
  interactive = lines is sys.stdin and sys.stdin.isatty()
  while True:
    if interactive:
      print("> ", end="", file=sys.stderr, flush=True)
    line = lines.readline()
    if not line.strip():
      return
    yield line.strip()


def run_chat(opts: ChatOptions, sampling: SamplingOptions, model, cfg, tok, lines=None, out=None) -> list[dict]:
  """A conversation: its user turns are opts.prompt in order, else the lines of `lines` (default stdin; an empty line
  or end of input ends it). For each turn the whole conversation so far (after --system) is rendered through the
  tokenizer's chat template and the reply generated and printed (streamed; stopped at the tokenizer's stop ids unless
  --no-stop, a note on stderr where a reply ends at --max-new-tokens instead). One full cache of CHAT_CAPACITY slots (at most the model's context) serves every turn, prefills padded
  to a multiple of 256 tokens, so few shapes compile. Returns the messages."""
  out = sys.stdout if out is None else out
  capacity = min(CHAT_CAPACITY, cfg.model.max_seq_len or CHAT_CAPACITY)
  gen = Generator(model, capacity=capacity, collective_matmul=cfg.mesh.collective_matmul)
  messages = [{"role": "system", "content": opts.system}] if opts.system else []
  if tok.chat.plain:
    print("note: the tokenizer has no chat template; turns are laid out as \"User: ... Assistant: \"", file=sys.stderr)
  if opts.prompt is None:
    print(f"sinkjax.generate: chatting with {opts.checkpoint} (up to {capacity:,} tokens of history; an empty line "
          "or Ctrl-D ends it)", file=sys.stderr, flush=True)
  for turn in (_stdin_turns(sys.stdin if lines is None else lines) if opts.prompt is None else opts.prompt):
    messages.append({"role": "user", "content": turn})
    text = tok.chat.render(messages)
    if opts.echo:
      out.write(text)
    ids = list(tok.encode(text))
    if len(ids) + opts.max_new_tokens > capacity:
      limit = (f"the model's context (model.max_seq_len={capacity:,} tokens)" if capacity == cfg.model.max_seq_len
               else f"the chat's cache of {capacity:,} tokens")
      raise UsageError(f"the conversation ({len(ids):,} tokens) and a reply of --max-new-tokens "
                       f"{opts.max_new_tokens} exceed {limit}; start a new conversation or lower --max-new-tokens")
    stream = TextStream(tok, out=out, skip_special_tokens=False)
    reply = gen.generate_batch([ids], opts.max_new_tokens, temperature=sampling.temperature, top_k=sampling.top_k,
                               top_p=sampling.top_p, seed=sampling.seed + len(messages),
                               stop_token=None if sampling.no_stop else tok.stop_ids,
                               on_token=lambda row, t: stream(t), prefill_to=lambda n: -(-n // 256) * 256)[0]
    stream.finish()
    if len(reply) == opts.max_new_tokens and not sampling.no_stop:
      print(f"note: the reply reached --max-new-tokens {opts.max_new_tokens} before a stop token", file=sys.stderr)
    messages.append({"role": "assistant", "content": tok.decode(reply)})
  return messages


# The flags of the command line before generate / chat / perplexity were subcommands: the subcommand each one means.
RETIRED = {"--chat": "chat", "--ppl": "perplexity", "--ppl-chunk": "perplexity"}


def new_spelling(argv: list[str]) -> list[str] | None:
  """A command line written before the subcommands (no subcommand first, or a `RETIRED` flag anywhere) as the
  subcommands spell it (`--chat` goes, `--ppl FILE` is perplexity's FILE, `--ppl-chunk T` its `--chunk T`); None for
  one spelled so already."""
  flags = [w.partition("=")[0] for w in argv]
  retired = [RETIRED[f] for f in flags if f in RETIRED]
  if not argv or (argv[0] in (*COMMANDS, "-h", "--help") and not retired):
    return None
  rest = argv[1:] if argv[0] in COMMANDS else argv
  sub = ("perplexity" if "perplexity" in retired else "chat" if retired else
         argv[0] if argv[0] in COMMANDS else "generate")
  new, operand = [], []
  words = iter(rest)
  for word in words:
    flag, eq, value = word.partition("=")
    if flag == "--chat":
      continue
    if flag in ("--ppl", "--ppl-chunk"):
      value = value if eq else next(words, "FILE" if flag == "--ppl" else "T")
      if flag == "--ppl":
        operand = [value]
      else:
        new += ["--chunk", value]
      continue
    new.append(word)
  return [sub, *operand, *new]


def main(argv=None) -> int:
  argv = [str(a) for a in (sys.argv[1:] if argv is None else argv)]
  new = new_spelling(argv)
  if new is not None:
    print(f"{PROG}: error: generate, chat and perplexity are subcommands now: {PROG} {shlex.join(new)} (see --help)",
          file=sys.stderr)
    return 2

  def generate(sections, run_overrides):
    opts, cache = sections["generate"], sections["cache"]
    cache_mode(opts, cache)                         # a bad cache: before the run is loaded
    if not all(opts.prompt):
      raise UsageError("--prompt is empty; give some text to continue")
    model, cfg, tok = loaded_run(opts, run_overrides)
    with on_its_mesh(model):
      run_generate(opts, sections["sampling"], cache, model, cfg, tok)

  def chat(sections, run_overrides):
    opts = sections["chat"]
    if opts.prompt is not None and not all(opts.prompt):
      raise UsageError("--prompt is empty; give a turn or leave --prompt out to type the turns")
    model, cfg, tok = loaded_run(opts, run_overrides, one_process="a conversation")
    with on_its_mesh(model):
      run_chat(opts, sections["sampling"], model, cfg, tok)

  def perplexity(sections, run_overrides):
    opts, cache = sections["perplexity"], sections["cache"]
    cache_policy.check(cache)
    if not paths.as_path(opts.file, "FILE").is_file():
      raise UsageError(f"perplexity: file {opts.file} does not exist")
    if opts.window is not None:
      check_window(opts.sink_size, opts.window)
    model, cfg, tok = loaded_run(opts, run_overrides, one_process="perplexity")
    with on_its_mesh(model):
      run_perplexity(opts, cache, model, cfg, tok)

  return options.main_of(PROG, __doc__.split("\n\n")[0], COMMANDS, argv,
                         {"generate": generate, "chat": chat, "perplexity": perplexity})


if __name__ == "__main__":
  sys.exit(main())
