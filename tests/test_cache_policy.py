"""Per-head KV cache policy (HybridKVCache): full heads at true positions, streaming heads as sinks + window.

References are independent of the hybrid code: today's uniform caches (full / streaming `KVCache`), a per-head
masked attention written out in float64 numpy with each head's own visible keys and positions, the closed-form
memory of the cache, hand-ranked head choices, and greedy decoding for the passkey probe's teacher forcing.
"""
import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sinkjax import cache as cache_lib
from sinkjax import cache_policy as cp
from sinkjax import generate as gen_lib
from sinkjax.cache import HybridKVCache, KVCache
from sinkjax.layers import Attention
from tests.helpers import rms_norm, rope
from tests.test_generate import random_model

KNOBS = (jnp.float32(0.0), jnp.int32(0), jnp.float32(1.0))



# token-by-token decode loops: more time running than compiling, so compiled as users do (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("optimized_compile")

def teacher_forced_logits(gen, tokens, prefill: int) -> np.ndarray:
  """Logits after tokens[:prefill] (one prefill) and after each later token (one decode step each)."""
  key = jax.random.key(0)
  _, logits, cache = gen.prefill_fn(gen.state, gen.new_cache(), jnp.asarray([tokens[:prefill]]), key, *KNOBS)
  out = [np.asarray(logits[0, -1])]
  for tok in tokens[prefill:]:
    _, logits, cache = gen.decode_fn(gen.state, cache, jnp.asarray([tok], jnp.int32), key, *KNOBS)
    out.append(np.asarray(logits[0]))
  return np.stack(out)


slow = pytest.mark.slow


@pytest.mark.parametrize("attention,sink_tokens", [("sink", 0), ("gated", 2), pytest.param("vanilla", 0, marks=slow),
                                                   pytest.param("gated", 0, marks=slow)])
def test_every_head_full_is_the_full_cache_bit_for_bit(attention, sink_tokens):
  model, cfg = random_model(attention=attention, sink_tokens=sink_tokens)
  tokens = list(np.random.RandomState(3).randint(0, 50, size=20))
  every = [[True] * cfg.num_kv_heads] * cfg.num_layers
  full = teacher_forced_logits(gen_lib.Generator(model, capacity=20), tokens, 5)
  hybrid = gen_lib.Generator(model, capacity=20, sink_size=2, window=6, full_heads=every)
  assert isinstance(hybrid.new_cache(), HybridKVCache)
  np.testing.assert_array_equal(teacher_forced_logits(hybrid, tokens, 5), full)


@pytest.mark.parametrize("attention,sink_tokens", [("vanilla", 0), ("sink", 2), pytest.param("gated", 0, marks=slow),
                                                   pytest.param("sink", 0, marks=slow)])
def test_no_head_full_is_the_streaming_cache_bit_for_bit(attention, sink_tokens):
  model, cfg = random_model(attention=attention, sink_tokens=sink_tokens)
  ids = np.random.RandomState(4).randint(0, 50, size=30)       # 30 tokens through 8 slots: the ring wraps
  none = [[False] * cfg.num_kv_heads] * cfg.num_layers
  stream = gen_lib.streaming_nll(model, ids, capacity=8, sink_size=2)
  hybrid = gen_lib.streaming_nll(model, ids, capacity=30, sink_size=2, window=8, full_heads=none)
  np.testing.assert_array_equal(hybrid, stream)


# ---------------------------------------------------------------------------------------------------------------
# A mixed policy against per-head masked attention in numpy


def kept_keys(t: int, full: bool, S: int, W: int) -> tuple[np.ndarray, np.ndarray, int]:
  """(token indices, their RoPE positions, the query's position) that one head sees when token t is decoded."""
  if full or t < W:
    idx = np.arange(t + 1)
  else:
    idx = np.concatenate([np.arange(S), np.arange(t - (W - S) + 1, t + 1)])
  pos = idx if full else np.arange(len(idx))
  return idx, pos, int(pos[-1])


def reference_decode(layer, x, t: int, full_kv, S: int, W: int) -> np.ndarray:
  """The layer's output for token t [d_model], float64, every query head attending its KV head's own key set."""
  W_ = lambda lin: np.asarray(lin.kernel[...], np.float64)
  H, Hkv, D, n = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.num_sink_tokens
  xs = np.asarray(x[0], np.float64)
  proj = lambda z, lin, h: (z @ W_(lin)).reshape(len(z), h, D)
  q, k, v = rms_norm(proj(xs, layer.q_proj, H)), rms_norm(proj(xs, layer.k_proj, Hkv)), proj(xs, layer.v_proj, Hkv)
  if n:
    sinks = np.asarray(layer.sink_states[...], np.float64)
    ks, vs = rope(rms_norm(proj(sinks, layer.k_proj, Hkv)), np.arange(n)), proj(sinks, layer.v_proj, Hkv)
  out = np.zeros((H, D))
  for i in range(H):
    h = i // (H // Hkv)
    idx, pos, qpos = kept_keys(t, full_kv[h], S, W)
    keys = rope(k[idx][:, h:h + 1], pos + n)[:, 0]
    vals = v[idx][:, h]
    if n:
      keys, vals = np.concatenate([ks[:, h], keys]), np.concatenate([vs[:, h], vals])
    z = keys @ rope(q[t:t + 1, i:i + 1], np.array([qpos + n]))[0, 0] / np.sqrt(D)
    extra = np.asarray(layer.sink[...], np.float64)[i] if layer.attention == "sink" else -np.inf
    m = max(z.max(), extra)
    p = np.exp(z - m) / (np.exp(z - m).sum() + np.exp(extra - m))
    out[i] = p @ vals
    if layer.attention == "gated":
      g = xs[t] @ W_(layer.gate_proj) + np.asarray(layer.gate_proj.bias[...], np.float64)
      out[i] *= 1 / (1 + np.exp(-g[i]))
  return out.reshape(-1) @ W_(layer.o_proj)


def _sink_init(attention: str) -> dict:
  """A nonzero initial sink logit where the variant has sinks (the option is refused on the others)."""
  return {"sink_init": 0.3} if attention == "sink" else {}


MIXED = [(a, n, f) for a in ("vanilla", "sink", "gated") for n in (0, 2) for f in ((False, True), (True, False))]
MIXED_DEFAULT = {("vanilla", 2, (False, True)), ("sink", 0, (True, False)), ("gated", 2, (True, False))}


@pytest.mark.parametrize("attention,sink_tokens,full_kv",
                         [c if c in MIXED_DEFAULT else pytest.param(*c, marks=slow) for c in MIXED])
def test_mixed_policy_equals_per_head_masked_attention(attention, sink_tokens, full_kv):
  """GQA (4 query heads on 2 KV heads): one KV head full, the other sinks + window, decoded token by token past
  the point where the ring wraps; each output equals the float64 reference within float32 rounding."""
  d, H, Hkv, D, S, W, P, N = 16, 4, 2, 8, 2, 6, 3, 14
  layer = Attention(d, H, Hkv, D, attention=attention, sink_tokens=sink_tokens, attn_impl="xla",
                    zero_init_output=False, rngs=nnx.Rngs(1), **_sink_init(attention))
  x = jax.random.normal(jax.random.key(2), (1, N, d))
  cache = HybridKVCache.create([full_kv], 1, N, W, D, sink_size=S)
  step = nnx.jit(lambda layer, xt, view: layer(xt, cache=view))
  views = cache.layers(P)
  _, views[0] = step(layer, x[:, :P], views[0])
  cache = cache.advance(views, P)
  for t in range(P, N):
    views = cache.layers(1)
    y, views[0] = step(layer, x[:, t:t + 1], views[0])
    cache = cache.advance(views, 1)
    np.testing.assert_allclose(np.asarray(y[0, 0]), reference_decode(layer, x, t, full_kv, S, W),
                               rtol=1e-4, atol=1e-5, err_msg=f"token {t}")
  assert cache.full.k[0].shape == (1, N, 1, D) and cache.ring.k[0].shape == (1, W, 1, D)


@pytest.mark.parametrize("attention,sink_tokens,full_kv,chunk", [
    ("sink", 2, (False, True), 3), ("gated", 2, (True, False), 3), ("vanilla", 0, (False, True), 3),
    ("sink", 2, (False, True), 4), pytest.param("gated", 2, (True, False), 4, marks=slow)])
def test_chunks_equal_per_head_masked_attention(attention, sink_tokens, full_kv, chunk):
  """Scoring in blocks: an append-mode hybrid cache fed chunks of 3 or 4 tokens (15 = 5 chunks of 3, or 3 of 4 + 3),
  from empty past the point where the ring wraps; each token's output equals the float64 per-head reference of
  decoding it (its own sinks, window and StreamingLLM positions) within float32 rounding."""
  d, H, Hkv, D, S, W, N = 16, 4, 2, 8, 2, 7, 15
  layer = Attention(d, H, Hkv, D, attention=attention, sink_tokens=sink_tokens, attn_impl="xla",
                    zero_init_output=False, rngs=nnx.Rngs(1), **_sink_init(attention))
  x = jax.random.normal(jax.random.key(2), (1, N, d))
  cache = HybridKVCache.create([full_kv], 1, N, W, D, sink_size=S).appending()
  step = nnx.jit(lambda layer, xt, view: layer(xt, cache=view))
  for start in range(0, N, chunk):
    T = min(chunk, N - start)
    views = cache.layers(T)
    y, views[0] = step(layer, x[:, start:start + T], views[0])
    cache = cache.advance(views, T)
    for j in range(T):
      np.testing.assert_allclose(np.asarray(y[0, j]), reference_decode(layer, x, start + j, full_kv, S, W),
                                 rtol=1e-4, atol=1e-5, err_msg=f"token {start + j}")
  assert int(cache.length) == N


@pytest.mark.parametrize("attention,sink_tokens,chunk", [pytest.param("sink", 2, 5, marks=slow), ("vanilla", 0, 4)])
def test_blockwise_hybrid_scores_equal_token_by_token(attention, sink_tokens, chunk):
  """A mixed [L][Hkv] map, 29 tokens through W = 8 (S = 2) streaming heads: chunks of 4 (28 targets, divides) or 5
  (does not) score every target as the decode steps do."""
  model, cfg = random_model(attention=attention, sink_tokens=sink_tokens)
  ids = np.random.RandomState(5).randint(0, 50, size=29)
  mixed = [[True, False], [False, True]]
  kw = dict(capacity=29, sink_size=2, window=8, full_heads=mixed)
  ref, ref_hit = gen_lib.streaming_scores(model, ids, **kw)
  nll, hit = gen_lib.streaming_scores(model, ids, chunk=chunk, **kw)
  np.testing.assert_allclose(nll, ref, rtol=0, atol=1e-5)
  np.testing.assert_array_equal(hit, ref_hit)


# ---------------------------------------------------------------------------------------------------------------
# Memory and compilation


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cache_memory_matches_the_formula(dtype):
  """2 (k and v) x batch x head_dim x bytes x sum over layers of (full heads x C + streaming heads x W)."""
  _, cfg = random_model(num_layers=3, dtype=dtype)
  full = [[True, False], [False, False], [True, True]]
  B, C, W, D, item = 2, 100, 16, cfg.head_dim, np.dtype(jnp.dtype(dtype)).itemsize
  formula = 2 * B * D * item * sum(sum(row) * C + (len(row) - sum(row)) * W for row in full)
  cache = HybridKVCache.for_model(cfg, full, B, C, W, sink_size=4)
  assert cache.kv_bytes == formula == 2 * B * D * item * (3 * C + 3 * W)
  assert gen_lib.kv_bytes(cfg, C, sink_size=4, full_heads=full, window=W, batch=B) == formula
  assert KVCache.for_model(cfg, B, C).kv_bytes == 2 * B * D * item * 3 * 2 * C
  assert gen_lib.kv_bytes(cfg, W, sink_size=4, batch=B) == 2 * B * D * item * 3 * 2 * W


def test_hybrid_decode_step_is_traced_once(monkeypatch):
  """A Python counter inside the traced decode path: tracing runs it once per layer and head group, so 40 decode
  steps that each re-traced would count 40 times as much. The cache keeps its shapes and bytes throughout."""
  model, cfg = random_model(attention="sink", sink_tokens=1)
  full = [[True, False], [False, False]]
  calls = []
  original = cache_lib._attend_group
  monkeypatch.setattr(cache_lib, "_attend_group", lambda *a: calls.append(1) or original(*a))
  gen = gen_lib.Generator(model, capacity=50, sink_size=2, window=8, full_heads=full)
  seen = []
  out = gen.generate([1, 2, 3], 41, temperature=1.0, seed=0,
                     on_step=lambda c: seen.append((jax.tree.map(lambda a: a.shape, c), c.kv_bytes)))
  assert len(out) == 41 and len(seen) == 40 and all(s == seen[0] for s in seen)
  assert len(calls) == 3                   # layer 0: full + streaming group; layer 1: streaming only
  assert gen.decode_fn._cache_size() == 1 and gen.prefill_fn._cache_size() == 1


def test_greedy_with_mixed_policy_continues_like_teacher_forcing():
  """Generation and scoring share the cache: greedy tokens of the Generator are the argmax hits of
  streaming_scores over the same sequence (what the passkey probe relies on)."""
  model, cfg = random_model(attention="gated", sink_tokens=1)
  full = [[False, True], [True, False]]
  prompt = list(np.random.RandomState(5).randint(0, 50, size=12))
  out = gen_lib.Generator(model, capacity=30, sink_size=2, window=8, full_heads=full).generate(
      prompt, 18, temperature=0.0)
  nll, hit = gen_lib.streaming_scores(model, [prompt + out], capacity=30, sink_size=2, window=8, full_heads=full)
  assert hit[0, len(prompt) - 1:].all() and nll.shape == (1, 29)


# ---------------------------------------------------------------------------------------------------------------
# Choosing the heads


IMPORTANCE = np.array([[0.9, 0.1, 0.5, 0.6],       # 2 layers x 4 query heads; KV head = query head // 2
                       [0.2, 0.3, 0.95, 0.05]])


def test_importance_choice_per_layer_global_and_gqa_rules():
  any_kv = cp.kv_scores(IMPORTANCE, 2, "any")      # max of each pair: [[.9, .6], [.3, .95]]
  mean_kv = cp.kv_scores(IMPORTANCE, 2, "mean")    # [[.5, .55], [.25, .5]]
  np.testing.assert_allclose(any_kv, [[0.9, 0.6], [0.3, 0.95]])
  np.testing.assert_allclose(mean_kv, [[0.5, 0.55], [0.25, 0.5]])
  assert cp.top_heads(any_kv, 0.5, "layer").tolist() == [[True, False], [False, True]]
  assert cp.top_heads(mean_kv, 0.5, "layer").tolist() == [[False, True], [False, True]]
  assert cp.top_heads(any_kv, 2, "global").tolist() == [[True, False], [False, True]]
  assert cp.top_heads(mean_kv, 0.5, "global").tolist() == [[True, True], [False, False]]
  assert cp.top_heads(any_kv, 0, "layer").sum() == 0 and cp.top_heads(any_kv, 1, "global").all()
  assert cp.top_heads(any_kv, 0.75, "global").sum() == 3            # round(0.75 x 4) = 3
  assert cp.top_heads(np.zeros((1, 4)), 0.5, "layer").tolist() == [[True, True, False, False]]   # ties: low index


def test_alpha_streams_the_highest_sink_ratio(tmp_path):
  alpha = 1 - IMPORTANCE
  (tmp_path / "report.json").write_text(json.dumps({"importance": IMPORTANCE.tolist(),
                                                    "sink_ratio_alpha": alpha.tolist()}))
  by_alpha = cp.top_heads(cp.kv_scores(cp.read_scores(tmp_path / "report.json", "alpha", (2, 4)), 2), 0.5, "layer")
  assert by_alpha.tolist() == [[True, False], [False, True]]       # KV head with the lowest alpha of its layer


def test_far_attention_streams_the_least_far_context_by_the_group_mean(tmp_path):
  """Source far_attention (the streaming study's far_attention.json, docs/STREAMING.md): the KV head whose query
  heads put the most attention on evicted keys, summed over the group (rule "mean" by default), keeps a full cache;
  a file without the key says where the scores come from."""
  far = np.array([[0.9, 0.0, 0.5, 0.5],            # pairs: max [.9, .5], mean [.45, .5]
                  [0.2, 0.3, 0.1, 0.6]])           #        max [.3, .6], mean [.25, .35]
  (tmp_path / "far_attention.json").write_text(json.dumps({"name": "far_attention", "far_attention": far.tolist()}))
  opts = cp.CacheOptions(full_heads="0.5", full_heads_by="far_attention",
                         head_scores=str(tmp_path / "far_attention.json"))
  cfg = types.SimpleNamespace(num_layers=2, num_heads=4, num_kv_heads=2)
  [(label, full)] = cp.policies_from(opts, cfg, tmp_path)
  assert label == "F=0.5 by far_attention" and full.tolist() == [[False, True], [False, True]]
  [(_, by_any)] = cp.policies_from(dataclasses.replace(opts, full_heads_gqa="any"), cfg, tmp_path)
  assert by_any.tolist() == [[True, False], [False, True]]                      # the explicit rule still applies
  [(_, by_importance)] = cp.policies_from(dataclasses.replace(opts, full_heads_by="importance", head_scores=None),
                                          cfg, _importance_run(tmp_path))
  assert by_importance.tolist() == [[True, False], [False, True]]               # importance keeps rule "any"
  with pytest.raises(cp.PolicyError, match="far_attention is in the streaming study's far_attention.json"):
    cp.read_scores(_importance_run(tmp_path) / "metrics.jsonl", "far_attention", (2, 4))


def _importance_run(tmp_path):
  (tmp_path / "run").mkdir(exist_ok=True)
  (tmp_path / "run" / "metrics.jsonl").write_text(json.dumps({"step": 1, "importance": IMPORTANCE.tolist()}) + "\n")
  return tmp_path / "run"


def test_scores_from_metrics_last_record_and_run_dir(tmp_path):
  lines = [{"step": 10, "importance": np.zeros((2, 4)).tolist()}, {"step": 20, "loss": 1.0},
           {"step": 30, "importance": IMPORTANCE.tolist()}]
  (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
  np.testing.assert_allclose(cp.read_scores(tmp_path, "importance", (2, 4)), IMPORTANCE)
  (tmp_path / "eval").mkdir()
  (tmp_path / "eval" / "report.json").write_text(json.dumps({"importance": (IMPORTANCE / 2).tolist()}))
  np.testing.assert_allclose(cp.read_scores(tmp_path, "importance", (2, 4)), IMPORTANCE / 2)   # eval preferred
  with pytest.raises(cp.PolicyError, match="holds no 'sink_ratio_alpha'"):
    cp.read_scores(tmp_path / "metrics.jsonl", "alpha", (2, 4))
  with pytest.raises(cp.PolicyError, match=r"the model has \[3, 4\]"):
    cp.read_scores(tmp_path, "importance", (3, 4))


def test_random_control_has_the_same_count():
  for scope, amount in (("layer", 0.5), ("global", 3), ("layer", 1)):
    chosen = {tuple(cp.random_heads((4, 4), amount, scope, seed).reshape(-1)) for seed in range(6)}
    ref = cp.top_heads(np.arange(16.0).reshape(4, 4), amount, scope)
    assert all(np.reshape(c, (4, 4)).sum(1).tolist() == ref.sum(1).tolist() if scope == "layer"
               else sum(c) == ref.sum() for c in chosen)
  assert len({tuple(cp.random_heads((4, 4), 0.5, "layer", s).reshape(-1)) for s in range(6)}) > 1
  np.testing.assert_array_equal(cp.random_heads((4, 4), 0.5, "global", 7), cp.random_heads((4, 4), 0.5, "global", 7))


def test_amounts_and_maps(tmp_path):
  assert cp.parse_amounts("0,0.25,1,3") == [0.0, 0.25, 1.0, 3.0]
  for bad in ("1.5", "-0.1", "x", "0.5,,1"):
    with pytest.raises(cp.PolicyError):
      cp.parse_amounts(bad)
  with pytest.raises(cp.PolicyError, match="exceeds the 2 KV heads per layer"):
    cp.top_heads(np.zeros((2, 2)), 3, "layer")
  good = tmp_path / "map.json"
  good.write_text("[[1, 0], [true, false]]")
  assert cp.read_map(good, (2, 2)).tolist() == [[True, False], [True, False]]
  for text, msg in (("[[1, 0, 1], [0, 0, 0]]", "shape"), ("[[1, 2], [0, 0]]", "true/false or 0/1"),
                    ("not json", "not a JSON")):
    good.write_text(text)
    with pytest.raises(cp.PolicyError, match=msg):
      cp.read_map(good, (2, 2))


# ---------------------------------------------------------------------------------------------------------------
# Command lines


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A saved run (random sink-attention model with GQA, byte tokenizer) with a metrics.jsonl of importances."""
  from sinkjax.config import Config, DataConfig
  from sinkjax.run import save_params_run as save_run
  model, cfg = random_model(attention="sink", vocab_size=257, max_seq_len=256)
  path = tmp_path_factory.mktemp("hybrid_run")
  save_run(path, Config(model=cfg, data=DataConfig(seq_len=32)), model)
  (path / "metrics.jsonl").write_text(json.dumps({"step": 1, "importance": IMPORTANCE.tolist()}) + "\n")
  return path


def run_cli(main, argv, capsys):
  code = main([str(a) for a in argv])
  out = capsys.readouterr()
  return code, out.out, out.err


def test_generate_with_full_heads(run_dir, capsys):
  code, out, err = run_cli(gen_lib.main, ["generate", "--checkpoint", run_dir, "--prompt", "abc", "--max-new-tokens", 5,
                                          "--temperature", 0, "--no-stop", "--full-heads", 0.5, "--window", 8,
                                          "--sink-size", 2], capsys)
  assert code == 0, err
  # per layer the KV head whose best query head is more important: [[0.9, 0.6], [0.3, 0.95]] -> heads 0 and 1
  bytes_ = 2 * 8 * 4 * (2 * (4 + 5) + 2 * 8)      # 2 full heads x (prompt + new) slots, 2 streaming x W slots
  assert "hybrid cache F=0.5 by importance, 2/4 full heads of 9 slots" in err and f"KV cache {bytes_:,} bytes" in err


@pytest.mark.slow
def test_ppl_table_rows_per_fraction(run_dir, tmp_path, capsys):
  """F = 1 and F = 0 reproduce the full and sink + window rows exactly; every row's bytes match the formula."""
  text = tmp_path / "t.txt"
  text.write_text("".join(chr(97 + (i * 7) % 26) for i in range(80)))
  code, out, err = run_cli(gen_lib.main, ["perplexity", text, "--checkpoint", run_dir, "--window", 16, "--sink-size", 2,
                                          "--full-heads", "0,0.5,1", "--full-heads-random", 3], capsys)
  assert code == 0, err
  rows = {r.split(" | ")[0].strip("| "): r.split(" | ") for r in out.splitlines() if r.startswith("| ")}
  N, W = 81, 16
  expect = {"full cache": 4 * N, "sinks + window (S=2, W=16)": 4 * W,
            "hybrid F=0 by importance (S=2, W=16)": 4 * W, "hybrid F=0.5 by importance (S=2, W=16)": 2 * N + 2 * W,
            "hybrid F=1 by importance (S=2, W=16)": 4 * N, "hybrid F=0.5 random (seed 3) (S=2, W=16)": 2 * N + 2 * W}
  for mode, head_slots in expect.items():
    assert int(rows[mode][-1].strip(" |").replace(",", "")) == 2 * 8 * 4 * head_slots, mode
  assert rows["hybrid F=1 by importance (S=2, W=16)"][3:6] == rows["full cache"][3:6]
  assert rows["hybrid F=0 by importance (S=2, W=16)"][3:6] == rows["sinks + window (S=2, W=16)"][3:6]
  assert rows["hybrid F=0.5 by importance (S=2, W=16)"][1] == "2/4"


@pytest.mark.parametrize("argv,message", [
    (["--full-heads", "1.5"], "neither a fraction in [0, 1] nor a whole number"),
    (["--full-heads", "-0.5"], "neither a fraction"),
    (["--full-heads", "3"], "exceeds the 2 KV heads per layer"),
    (["--full-heads", "5", "--full-heads-scope", "global"], "exceeds the 4 KV heads in the model"),
    (["--full-heads-from", "{map}"], "shape [1, 2], the model needs [2, 2]"),
    (["--full-heads-from", "/nonexistent.json"], "does not exist"),
    (["--full-heads", "0.5", "--full-heads-from", "{map}"], "not both"),
    (["--full-heads-random", "1"], "needs --full-heads F"),
    (["--full-heads", "0.5", "--full-heads-random", "x"], "integer seeds"),
    (["--full-heads", "0.5", "--full-heads-by", "alpha"], "alpha is in eval's report.json"),
    (["--full-heads", "0.5", "--head-scores", "/nonexistent"], "does not exist"),
    (["--full-heads", "0.5", "--cache", "full"], "drop --cache full"),
    (["--cache", "hybrid"], "needs --full-heads F or --full-heads-from"),
    (["--full-heads", "0,0.5"], "one --full-heads value"),
])
def test_cli_errors_are_one_line(argv, message, run_dir, tmp_path, capsys):
  (tmp_path / "map.json").write_text("[[true, false]]")
  argv = [a.replace("{map}", str(tmp_path / "map.json")) for a in argv]
  code, _, err = run_cli(gen_lib.main, ["generate", "--checkpoint", run_dir, "--prompt", "hi", "--max-new-tokens", 2]
                         + argv, capsys)
  assert code != 0
  assert len(err.strip().splitlines()) == 1 and err.startswith("sinkjax.generate: error:") and message in err, err


# ---------------------------------------------------------------------------------------------------------------
# Passkey probe


def test_passkey_samples_hide_the_key_at_the_depth():
  from sinkjax.data.passkey import QUESTION
  from sinkjax.data.tokenizers import ByteTokenizer
  from sinkjax.experiments import passkey
  tok = ByteTokenizer()
  for depth in (0.0, 0.5, 1.0):
    batch = passkey.passkey_batch(tok, 300, depth, 4, seed=1)
    assert batch.ids.shape[0] == 4 and batch.answer_len == 5 and batch.context <= 300
    for row in batch.ids:
      assert row[0] == tok.bos_id
      text = tok.decode(row)
      key = text[-5:]
      prompt = text[:-5]
      assert prompt.endswith(QUESTION) and f"The pass key is #{key}. Remember it. #{key} is" in prompt
      before = prompt[:prompt.index("The pass key is")].count(". ")
      total = prompt.count(". ") - 3                      # all sentences but the needle's two and the question's
      assert before == round(depth * total)
  assert passkey.passkey_batch(tok, 300, 0.5, 2, seed=1).context + 20 > 300     # no room for another sentence


def test_passkey_training_mix(tmp_path):
  from sinkjax.data import passkey
  docs = passkey.training_documents(50, 256, 0.5, seed=0)
  keyed = [d for d in docs if d.endswith(".") and passkey.QUESTION in d]
  assert len(keyed) == 50 and all(len(d) <= 256 for d in keyed)
  for d in keyed:
    key = d[-6:-1]
    assert f"The pass key is #{key}. Remember it." in d
  text_bytes = sum(len(d) for d in docs if d not in keyed)
  assert 0.4 < text_bytes / sum(len(d) for d in docs) < 0.6


@pytest.mark.parametrize("argv,message", [
    (["study.run={run}", "axes.length=[50]"], "cannot hold the needle"),
    (["study.run={run}", "axes.depth=[0,1.5]"], "axis depth must list floats in [0, 1]"),
    (["study.run={run}", "passkey.window=4", "passkey.sink_size=4"], "passkey.sink_size must be < passkey.window"),
    (["study.run="], "give study.run=RUN_DIR"),
])
def test_passkey_study_errors(argv, message, run_dir, tmp_path, capsys):
  from sinkjax.experiments import passkey, study
  argv = [str(passkey.STUDY_FILE), "cache.full_heads=null", "cache.full_heads_random=null", f"study.out={tmp_path}",
          *(a.replace("{run}", str(run_dir)) for a in argv)]
  code, _, err = run_cli(study.main, argv, capsys)
  assert code != 0 and len(err.strip().splitlines()) == 1 and message in err, err


def test_passkey_make_data_errors(tmp_path, capsys):
  from sinkjax.data import passkey
  code, _, err = run_cli(passkey.main, ["--out", tmp_path / "d.jsonl", "--max-len", "20"], capsys)
  assert code != 0 and len(err.strip().splitlines()) == 1 and "--max-len must be >=" in err, err
  assert not (tmp_path / "d.jsonl").exists()
  with pytest.raises(SystemExit) as e:
    passkey.main(["--docs", "5"])
  assert e.value.code == 2 and "the following arguments are required: --out" in capsys.readouterr().err


@pytest.mark.slow
def test_passkey_probe_end_to_end(run_dir, tmp_path, capsys):
  """Every mode x length x depth gets a record; the accuracy is the greedy exact match of the key, checked against
  `Generator.generate` for the hybrid mode."""
  from sinkjax.run import load_run
  from sinkjax.experiments import passkey
  from sinkjax.experiments import study
  code, out, err = run_cli(study.main, [passkey.STUDY_FILE, f"study.run={run_dir}", "axes.length=[120]",
                                        "axes.depth=[0,1]", "passkey.samples=3", "passkey.window=16",
                                        "passkey.sink_size=2", "cache.full_heads=0.5", "cache.full_heads_random=null",
                                        f"study.out={tmp_path}"], capsys)
  assert code == 0, err
  records = json.loads((tmp_path / "results.json").read_text())
  assert {r["mode"] for r in records} == {"full cache", "sinks + window (S=2, W=16)", "hybrid F=0.5 by importance"}
  assert len(records) == 3 * 2 and "| hybrid F=0.5 by importance | 2/4 |" in out
  model, _, tok, _ = load_run(run_dir)
  full = [[True, False], [False, True]]
  gen = gen_lib.Generator(model, capacity=records[0]["context"] + 5, sink_size=2, window=16, full_heads=full)
  for depth in (0.0, 1.0):
    batch = passkey.passkey_batch(tok, 120, depth, 3, seed=0)
    right = sum(gen.generate(list(row[:-5]), 5, temperature=0.0) == list(row[-5:]) for row in batch.ids)
    rec = [r for r in records if r["mode"].startswith("hybrid") and r["depth"] == depth][0]
    assert rec["full_map"] == np.asarray(full, int).tolist()          # the map each hybrid row used, stored
    assert rec["accuracy"] == right / 3
    # digits right: each key token the greedy choice given the right tokens before it (one-token generations)
    digits = [gen.generate(list(row[:len(row) - 5 + i]), 1, temperature=0.0) == [row[len(row) - 5 + i]]
              for row in batch.ids for i in range(5)]
    assert rec["digit_accuracy"] == pytest.approx(np.mean(digits))
