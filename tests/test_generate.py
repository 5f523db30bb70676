"""Generation with a KV cache, StreamingLLM's sink + window cache, learnable sink tokens, the generate CLI.

References are independent of the cache code: a full causal forward pass over the whole sequence, a forward pass
over exactly the tokens a streaming cache keeps, and a materialized-softmax attention written out here in numpy.
"""
import dataclasses

import numpy as np
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from sinkjax import generate as gen_lib
from sinkjax.cache import KVCache, slot_of, slot_positions
from sinkjax.config import MeshConfig, ModelConfig
from sinkjax.layers import Attention, pop_head_importance
from sinkjax.model import Transformer
from tests.helpers import rms_norm, rope

VOCAB = 50


def random_model(num_layers=2, seed=0, vocab_size=VOCAB, dtype="float32", **kw):
  """A small f32 model with every parameter random (the default init zeroes the output projections, which would
  make all logits equal and greedy decoding a sequence of ties)."""
  cfg = ModelConfig(num_layers=num_layers, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                    vocab_size=vocab_size, dtype=dtype, **kw)
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed))))
  leaves, treedef = jax.tree.flatten(state)
  rng = np.random.RandomState(seed)
  leaves = [jnp.asarray(rng.normal(size=x.shape) * (0.5 if x.ndim < 2 else x.shape[0] ** -0.5), x.dtype)
            for x in leaves]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), cfg


PROMPT = [3, 14, 15, 9, 26, 5]


@nnx.jit
def forward(model, tokens):
  """The plain causal forward pass (the reference the cache paths are compared with)."""
  logits = model(tokens)
  pop_head_importance(model)              # keep the model's graph unchanged, so this compiles once per shape
  return logits


@pytest.mark.parametrize("attention,sink_tokens", [("vanilla", 0), ("sink", 0), ("gated", 0), ("vanilla", 2)])
def test_greedy_with_cache_is_argmax_of_full_recomputation(attention, sink_tokens):
  model, _ = random_model(attention=attention, sink_tokens=sink_tokens)
  n_new = 12
  gen = gen_lib.Generator(model, capacity=len(PROMPT) + n_new)
  out = gen.generate(PROMPT, n_new, temperature=0.0)
  assert len(out) == n_new
  seq = jnp.asarray([PROMPT + out])
  logits = forward(model, seq)            # causal: position t's logits are a recomputation over tokens <= t
  expect = np.asarray(jnp.argmax(logits[0, len(PROMPT) - 1:-1], axis=-1))
  np.testing.assert_array_equal(np.asarray(out), expect)
  assert gen.prefill_fn._cache_size() == 1 and gen.decode_fn._cache_size() == 1     # one compile each


@pytest.mark.parametrize("attention,sink_tokens", [("vanilla", 0), ("gated", 2)])
def test_streaming_with_window_larger_than_text_equals_full_cache(attention, sink_tokens):
  model, _ = random_model(attention=attention, sink_tokens=sink_tokens)
  ids = np.random.RandomState(0).randint(0, VOCAB, size=40)
  full = gen_lib.streaming_nll(model, ids, capacity=40)
  stream = gen_lib.streaming_nll(model, ids, capacity=64, sink_size=4)
  np.testing.assert_array_equal(stream, full)         # bit for bit: empty slots contribute exactly nothing
  logp = jax.nn.log_softmax(forward(model, jnp.asarray(ids[None]))[0, :-1])
  ref = -np.take_along_axis(np.asarray(logp), ids[1:, None], axis=1)[:, 0]
  np.testing.assert_allclose(full, ref, rtol=0, atol=1e-5)


def test_slot_layout_keeps_sinks_and_the_most_recent_tokens():
  S, C = 2, 6
  slots = [int(slot_of(a, S, C)) for a in range(12)]
  assert slots == [0, 1, 2, 3, 4, 5, 2, 3, 4, 5, 2, 3]
  # after 9 tokens the cache holds tokens 0, 1 (sinks) and 5, 6, 7, 8, in slots 0, 1, 5, 2, 3, 4
  pos, valid = slot_positions(9, S, C)
  assert valid.all()
  token_in_slot = {0: 0, 1: 1, 5: 5, 2: 6, 3: 7, 4: 8}
  rank = {tok: r for r, tok in enumerate([0, 1, 5, 6, 7, 8])}
  assert [int(p) for p in pos] == [rank[token_in_slot[j]] for j in range(C)]
  pos, valid = slot_positions(3, S, C)
  assert list(np.asarray(pos)) == list(range(C)) and list(np.asarray(valid)) == [1, 1, 1, 0, 0, 0]


@pytest.mark.parametrize("attention,sink_tokens", [("vanilla", 0), ("sink", 2)])
def test_streaming_decode_equals_forward_over_kept_tokens(attention, sink_tokens):
  """One layer: cached k/v depend only on their own token, so after eviction a decode step must equal a plain
  forward pass over [first S tokens; last W - S tokens] at positions 0..W-1 (StreamingLLM's position shift)."""
  model, _ = random_model(num_layers=1, attention=attention, sink_tokens=sink_tokens)
  S, W, N = 3, 10, 31
  ids = np.random.RandomState(1).randint(0, VOCAB, size=N)
  nll = gen_lib.streaming_nll(model, ids, capacity=W, sink_size=S)
  blocks = gen_lib.streaming_nll(model, ids, capacity=W, sink_size=S, chunk=6)     # scored in blocks, the same
  for t in (W, W + 1, W + 7, N - 2):      # predicting ids[t + 1] after tokens 0..t
    kept = np.concatenate([ids[:S], ids[t + 1 - (W - S):t + 1]])
    logp = jax.nn.log_softmax(forward(model, jnp.asarray(kept[None]))[0, -1])
    np.testing.assert_allclose(nll[t], -float(logp[ids[t + 1]]), rtol=0, atol=1e-5)
    np.testing.assert_allclose(blocks[t], -float(logp[ids[t + 1]]), rtol=0, atol=1e-5)


BLOCKWISE = {   # id: (attention, sink tokens, cache, chunk, layers, other model settings)
    "full": ("vanilla", 0, dict(capacity=41), 8, 1, {}),                       # 40 targets: 8 divides
    "window-only": ("vanilla", 0, dict(capacity=10), 7, 1, {}),                # 7 does not
    "sinks+window": ("vanilla", 0, dict(capacity=10, sink_size=3), 64, 1, {}),  # capped at C - S = 7
    "sinks+window-divides": ("gated", 0, dict(capacity=10, sink_size=2), 8, 1, {}),
    "sink-tokens": ("sink", 2, dict(capacity=10, sink_size=3), 5, 2, {}),
    "sliding-layer": ("sink", 0, dict(capacity=10, sink_size=3), 6, 2,
                      dict(sliding_window=5, layer_types=["sliding", "full"])),
}


@pytest.mark.parametrize("case", BLOCKWISE)
def test_blockwise_scores_equal_token_by_token(case):
  """Scoring in blocks (`chunk`) gives every target of 41 tokens the log-prob (and argmax hit) of the decode steps:
  a full cache, a window of 10 (the ring wraps three times) with and without sinks, learnable sink tokens, a gate, a
  sliding-window layer; chunks that divide the 40 targets and chunks that leave a remainder."""
  attention, sink_tokens, cache, chunk, layers, extra = BLOCKWISE[case]
  model, _ = random_model(num_layers=layers, attention=attention, sink_tokens=sink_tokens, **extra)
  ids = np.random.RandomState(0).randint(0, VOCAB, size=41)
  ref, ref_hit = gen_lib.streaming_scores(model, ids, **cache)
  nll, hit = gen_lib.streaming_scores(model, ids, chunk=chunk, **cache)
  np.testing.assert_allclose(nll, ref, rtol=0, atol=1e-5)
  np.testing.assert_array_equal(hit, ref_hit)


def test_a_chunk_longer_than_the_window_is_refused():
  cache = KVCache.create(1, 1, 8, 2, 4, sink_size=2).appending()
  assert cache.layers(6)[0].capacity == 8
  with pytest.raises(ValueError, match="exceeds the 6 window slots"):
    cache.layers(7)


def test_streaming_memory_is_flat_and_runs_past_max_seq_len():
  model, cfg = random_model(attention="sink", sink_tokens=2, max_seq_len=32)
  gen = gen_lib.Generator(model, capacity=16, sink_size=4)
  seen = []
  out = gen.generate(PROMPT, 60, temperature=1.0, seed=1,
                     on_step=lambda c: seen.append((jax.tree.map(lambda x: x.shape, c), c.nbytes, int(c.length))))
  assert len(out) == 60
  assert len(PROMPT) + 60 > cfg.max_seq_len
  shapes, nbytes, lengths = zip(*seen)
  assert all(s == shapes[0] for s in shapes) and len(set(nbytes)) == 1
  assert lengths[-1] == len(PROMPT) + 59 > 16
  assert gen.decode_fn._cache_size() == 1


def test_sliding_window_layers_decode_like_the_full_forward():
  """Sliding-window layers (HF option) keep their window in the decode step, where it is applied by position."""
  model, _ = random_model(attention="sink", sliding_window=5, layer_types=["sliding", "full"])
  n_new = 10
  out = gen_lib.Generator(model, capacity=len(PROMPT) + n_new).generate(PROMPT, n_new, temperature=0.0)
  logits = forward(model, jnp.asarray([PROMPT + out]))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.argmax(logits[0, len(PROMPT) - 1:-1], axis=-1)))


def test_prompt_longer_than_streaming_cache_is_streamed():
  model, _ = random_model(num_layers=1, attention="vanilla")
  prompt = list(np.random.RandomState(2).randint(0, VOCAB, size=25))
  S, W = 2, 8
  out = gen_lib.Generator(model, capacity=W, sink_size=S).generate(prompt, 1, temperature=0.0)
  kept = prompt[:S] + prompt[-(W - S):]
  assert out == [int(jnp.argmax(forward(model, jnp.asarray([kept]))[0, -1]))]


# ---------------------------------------------------------------------------------------------------------------
# Learnable sink tokens


@pytest.mark.parametrize("attention", ["vanilla", "sink"])
def test_sink_tokens_hand_built_positions_and_visibility(attention):
  """Packed row [doc 1 (3 tokens), doc 2 (2 tokens), padding]: each query sees the 2 sink tokens (keys at RoPE
  positions 0, 1, projected by the layer's own k/v and k-norm) plus its own document's earlier tokens at positions
  2, 3, ... (restarting per document). Everything is recomputed in float64 numpy from the layer's weights."""
  n, d, H, D = 2, 16, 2, 8
  layer = Attention(d, H, H, D, attention=attention, sink_tokens=n, attn_impl="xla", zero_init_output=False,
                    rngs=nnx.Rngs(0), **({"sink_init": 0.3} if attention == "sink" else {}))
  x = jax.random.normal(jax.random.key(1), (1, 6, d))
  seg = jnp.asarray([[1, 1, 1, 2, 2, 0]])
  y = np.asarray(layer(x, segment_ids=seg))
  imp = pop_head_importance(layer)

  W = lambda lin: np.asarray(lin.kernel[...], np.float64)
  xs, sinks = np.asarray(x[0], np.float64), np.asarray(layer.sink_states[...], np.float64)
  proj = lambda z, lin, h: (z @ W(lin)).reshape(len(z), h, D)
  q = rope(rms_norm(proj(xs, layer.q_proj, H)), np.array([0, 1, 2, 0, 1, 0]) + n)
  k = rope(rms_norm(proj(xs, layer.k_proj, H)), np.array([0, 1, 2, 0, 1, 0]) + n)
  v = proj(xs, layer.v_proj, H)
  ks = rope(rms_norm(proj(sinks, layer.k_proj, H)), np.arange(n))
  vs = proj(sinks, layer.v_proj, H)
  docs, out, gates = [1, 1, 1, 2, 2, 0], np.zeros((6, H, D)), np.zeros((6, H))
  for t in range(5):
    own = [s for s in range(t + 1) if docs[s] == docs[t]]
    keys, vals = np.concatenate([ks, k[own]]), np.concatenate([vs, v[own]])
    z = np.einsum("hd,shd->hs", q[t], keys) / np.sqrt(D)
    if attention == "sink":                    # the GPT-OSS logit joins the denominator with zero value
      sink = np.asarray(layer.sink[...], np.float64)
      zmax = np.maximum(z.max(-1), sink)
      p = np.exp(z - zmax[:, None]) / (np.exp(z - zmax[:, None]).sum(-1) + np.exp(sink - zmax))[:, None]
      gates[t] = p.sum(-1)
    else:
      p = np.exp(z - z.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      gates[t] = 1 - p[:, 0]                  # vanilla: 1 - attention on sink token 0
    out[t] = np.einsum("hs,shd->hd", p, vals)
  ref = out.reshape(6, H * D) @ W(layer.o_proj)
  np.testing.assert_allclose(y[0], ref, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(np.asarray(imp)[0], gates[:5].mean(0), rtol=1e-4, atol=1e-5)


def test_sink_prefix_gradients_match_concatenated_softmax():
  """attend_prefix merges through the two LSEs; its gradients (through output AND LSE, via a vanilla gate loss)
  equal autodiff of a softmax over the explicitly concatenated [sink keys; causal keys]."""
  from sinkjax.attention import vanilla_attention
  B, T, H, D, n = 1, 7, 2, 8, 3
  kq, kk, kv, kp, kpv = jax.random.split(jax.random.key(0), 5)
  q, k, v = (jax.random.normal(key, (B, T, H, D)) for key in (kq, kk, kv))
  pk, pv = (jax.random.normal(key, (B, n, H, D)) for key in (kp, kpv))

  def ours(q, k, v, pk, pv):
    out, gate = vanilla_attention(q, k, v, prefix=(pk, pv), impl="xla")
    return jnp.sum(out * jnp.cos(out)) + jnp.sum(gate ** 2)

  def concat(q, k, v, pk, pv):
    kk_, vv_ = jnp.concatenate([pk, k], 1), jnp.concatenate([pv, v], 1)
    z = jnp.einsum("bthd,bshd->bhts", q, kk_) / np.sqrt(D)
    mask = np.concatenate([np.ones((T, n), bool), np.tril(np.ones((T, T), bool))], 1)
    p = jax.nn.softmax(jnp.where(mask, z, -jnp.inf), -1)
    out = jnp.einsum("bhts,bshd->bthd", p, vv_)
    gate = jnp.swapaxes(1 - p[..., 0], 1, 2)
    return jnp.sum(out * jnp.cos(out)) + jnp.sum(gate ** 2)

  args = (q, k, v, pk, pv)
  np.testing.assert_allclose(jax.jit(ours)(*args), jax.jit(concat)(*args), rtol=1e-5)
  for g1, g2 in zip(jax.jit(jax.grad(ours, argnums=range(5)))(*args),
                    jax.jit(jax.grad(concat, argnums=range(5)))(*args)):
    np.testing.assert_allclose(g1, g2, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("attention", ["vanilla", pytest.param("sink", marks=pytest.mark.slow),
                                       pytest.param("gated", marks=pytest.mark.slow)])
def test_sink_token_model_trains(attention):
  cfg = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=VOCAB,
                    dtype="float32", attention=attention, sink_tokens=2)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  rng = np.random.RandomState(0)
  tokens = jnp.asarray(np.tile(rng.randint(0, VOCAB, size=(1, 8)), (4, 3)))      # a repeated pattern, packed
  seg = jnp.asarray(np.repeat([[1] * 10 + [2] * 10 + [3] * 3 + [0]], 4, 0))

  def loss_fn(model):
    logits = model(tokens[:, :-1], segment_ids=seg[:, :-1])
    pop_head_importance(model)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    valid = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    return jnp.sum(nll * valid) / valid.sum()

  @nnx.jit
  def step(model, opt):
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss, grads

  before = np.asarray(model.layers[0].attn.sink_states[...])
  losses = []
  for _ in range(8):
    loss, grads = step(model, opt)
    losses.append(float(loss))
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
  assert np.abs(np.asarray(grads["layers"][0]["attn"]["sink_states"])).sum() > 0
  assert losses[-1] < losses[0] - 0.5
  assert not np.allclose(before, np.asarray(model.layers[0].attn.sink_states[...]))


def test_param_count_includes_sink_tokens():
  from sinkjax.model import count_params
  from tests.helpers import param_count_formula
  cfg = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=VOCAB,
                    attention="gated", sink_tokens=3)
  assert count_params(Transformer(cfg, rngs=nnx.Rngs(0))) == param_count_formula(cfg)


# ---------------------------------------------------------------------------------------------------------------
# Sampling and the command line


def test_sampling_knobs():
  logits = jnp.asarray([[0.0, 3.0, 1.0, 2.0, -1.0]])
  keys = jax.random.split(jax.random.key(0), 400)
  draw = jax.jit(jax.vmap(lambda key, t, k, p: gen_lib.sample_logits(logits, key, t, k, p)[0],
                          in_axes=(0, None, None, None)))
  s = lambda t, k, p: set(np.asarray(draw(keys, jnp.float32(t), jnp.int32(k), jnp.float32(p))).tolist())
  assert s(0.0, 0, 1.0) == {1}                          # temperature 0 = greedy
  assert s(1.0, 1, 1.0) == {1}                          # top-1
  assert s(1.0, 2, 1.0) == {1, 3}                       # top-2
  # probabilities ~ [.03, .64, .09, .23, .01]: top-p 0.8 keeps {1, 3}, top-p 0.5 only {1}
  assert s(1.0, 0, 0.8) == {1, 3}
  assert s(1.0, 0, 0.5) == {1}
  assert s(5.0, 0, 1.0) == {0, 1, 2, 3, 4}              # high temperature: everything
  frac = np.mean(np.asarray(draw(keys, jnp.float32(1.0), jnp.int32(0), jnp.float32(1.0))) == 1)
  assert abs(frac - 0.636) < 0.08                       # plain sampling follows softmax(logits)


@pytest.mark.parametrize("argv,message", [
    (["generate", "--checkpoint", "/nonexistent/run", "--prompt", "hi", "--max-new-tokens", "3"], "does not exist"),
    (["generate", "--checkpoint", "{tmp}", "--prompt", "", "--max-new-tokens", "3"], "prompt is empty"),
    (["generate", "--checkpoint", "{tmp}", "--prompt", "hi", "--max-new-tokens", "0"],
     "config key generate.max_new_tokens (--max-new-tokens) must be >= 1, got 0"),
    (["generate", "--checkpoint", "{tmp}", "--prompt", "hi", "--max-new-tokens", "3", "--cache", "streaming",
      "--sink-size", "8", "--window", "8"], "must exceed --sink-size"),
    (["generate", "--checkpoint", "{tmp}", "--prompt", "hi", "--max-new-tokens", "3", "--sink-size", "-1",
      "--window", "8", "--cache", "streaming"], "config key generate.sink_size (--sink-size) must be >= 0, got -1"),
    (["generate", "--checkpoint", "{tmp}", "--prompt", "hi", "--max-new-tokens", "3", "--window", "8"],
     "only apply to"),
    (["generate", "--checkpoint", "{tmp}", "--prompt", "hi", "--max-new-tokens", "3", "--cache", "ring"],
     "config key generate.cache (--cache) must be one of full|streaming|hybrid, got 'ring'"),
    (["generate", "--checkpoint", "{tmp}", "--prompt", "hi", "--max-new-tokens", "3", "--top-p", "0"],
     "config key sampling.top_p (--top-p) must be in (0, 1], got 0.0"),
    (["generate", "--checkpoint", "{tmp}", "--prompt", "hi", "--max-new-tokens", "3", "--frob"],
     "unrecognized arguments: --frob"),
    (["perplexity", "/nonexistent.txt", "--checkpoint", "{tmp}"], "does not exist"),
    (["perplexity", "{file}", "--checkpoint", "{tmp}", "--sink-size", "8", "--window", "8"], "must exceed"),
    (["chat", "--checkpoint", "{tmp}", "--prompt", ""], "prompt is empty"),
    (["generate", "--prompt", "hi", "--max-new-tokens", "3"], "--checkpoint"),
    (["generate", "--checkpoint", "{tmp}", "--prompt", "hi", "--max-new-tokens", "3"], "not a run directory"),
])
def test_cli_errors_are_one_line(argv, message, tmp_path, capsys):
  """A bad value is one line and status 1 (a range or a choice: the key's declaration names the key and its flag);
  a command line argparse refuses (an unknown flag, a missing required option), one line and status 2
  (sinkjax.errors, sinkjax.options)."""
  argv = [a.replace("{tmp}", str(tmp_path)).replace("{file}", __file__) for a in argv]
  try:
    status = gen_lib.main(argv)
  except SystemExit as e:
    status = e.code
  err = capsys.readouterr().err.strip()
  parsing = message in ("unrecognized arguments: --frob", "--checkpoint")       # the two that argparse refuses
  assert status == (2 if parsing else 1), (status, err)
  assert len(err.splitlines()) == 1 and message in err, err
  assert err.startswith("python -m sinkjax.generate" if parsing else "sinkjax.generate: error:"), err


@pytest.mark.parametrize("old,new", [
    ("--checkpoint r --prompt hi --max-new-tokens 3 --cache streaming",
     "generate --checkpoint r --prompt hi --max-new-tokens 3 --cache streaming"),
    ("--checkpoint r --chat --prompt hi --system 'be brief' --echo", "chat --checkpoint r --prompt hi --system "
     "'be brief' --echo"),
    ("--checkpoint r --chat", "chat --checkpoint r"),
    ("--ppl t.txt --checkpoint r --ppl-chunk 8 --full-heads 0,0.5", "perplexity t.txt --checkpoint r --chunk 8 "
     "--full-heads 0,0.5"),
    ("--checkpoint=r --ppl=t.txt --ppl-chunk=1", "perplexity t.txt --checkpoint=r --chunk 1"),
    ("generate --checkpoint r --chat --prompt hi", "chat --checkpoint r --prompt hi"),
    ("model.dtype=float32 --checkpoint r --prompt hi --max-new-tokens 3",
     "generate model.dtype=float32 --checkpoint r --prompt hi --max-new-tokens 3"),
])
def test_the_command_line_before_the_subcommands_is_refused_with_its_new_spelling(old, new, capsys):
  """`--chat`, `--ppl FILE`, `--ppl-chunk T` and a line without a subcommand: status 2 and one line that spells the
  same request with the subcommands (as written here by hand), which parses."""
  import shlex
  assert gen_lib.main(shlex.split(old)) == 2
  err = capsys.readouterr().err.strip()
  assert err == ("python -m sinkjax.generate: error: generate, chat and perplexity are subcommands now: "
                 f"python -m sinkjax.generate {new} (see --help)"), err
  assert gen_lib.new_spelling(shlex.split(new)) is None


def test_cli_help(capsys):
  with pytest.raises(SystemExit) as e:
    gen_lib.main(["--help"])
  assert e.value.code == 0 and "--sink-size" in capsys.readouterr().out
  for sub, own, not_own in (("generate", "--cache", "--system"), ("chat", "--system", "--cache"),
                            ("perplexity", "--chunk", "--prompt")):
    with pytest.raises(SystemExit) as e:
      gen_lib.main([sub, "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and own in out and not_own not in out, (sub, out)


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory):
  """A run directory of a random byte-level model (its tokenizer has no chat template: "User: / Assistant:")."""
  from sinkjax.config import Config
  from sinkjax.run import save_params_run
  cfg = Config()
  model, cfg.model = random_model(vocab_size=257, max_seq_len=512)
  run = tmp_path_factory.mktemp("chat") / "run"
  save_params_run(run, cfg, model)
  return run, model


def _greedy_reference(model, ids, n):
  """n greedy tokens by full recomputation: the argmax of the plain causal forward over the whole sequence at its
  last position (right-padded to a multiple of 64 tokens, which that position never sees, so few shapes compile)."""
  seq = list(ids)
  for _ in range(n):
    width = -(-len(seq) // 64) * 64
    logits = np.asarray(forward(model, jnp.asarray([seq + [0] * (width - len(seq))])))
    seq.append(int(np.argmax(logits[0, len(seq) - 1])))
  return seq[len(ids):]


def test_chat_prints_the_reply_and_the_rendering_only_with_echo(byte_run, capsys):
  from sinkjax.data import ByteTokenizer
  run, model = byte_run
  tok = ByteTokenizer()
  rendered = tok.chat.prompt("hi")
  reply = tok.decode(_greedy_reference(model, tok.encode(rendered), 6))
  argv = ["chat", "--checkpoint", str(run), "--prompt", "hi", "--max-new-tokens", "6", "--temperature", "0",
          "--no-stop"]
  assert gen_lib.main(argv) == 0
  assert capsys.readouterr().out == reply + "\n"
  assert gen_lib.main(argv + ["--echo"]) == 0
  assert capsys.readouterr().out == rendered + reply + "\n"


def test_chat_without_a_prompt_holds_a_conversation(byte_run, capsys):
  """Each line is a user turn (or each --prompt, in order); the whole conversation (the earlier replies included) is
  rendered through the chat layout for the next reply, which is the greedy continuation of that rendering (5 tokens,
  no stop: each reply says so on stderr)."""
  import io
  from sinkjax.data import ByteTokenizer
  run, model = byte_run
  tok = ByteTokenizer()
  opts = gen_lib.ChatOptions(checkpoint=str(run), max_new_tokens=5)
  out = io.StringIO()
  cfg = type("C", (), {"model": model.cfg, "mesh": MeshConfig()})     # what run_chat reads of a run's config
  messages = gen_lib.run_chat(opts, gen_lib.SamplingOptions(temperature=0.0), model, cfg, tok,
                              lines=io.StringIO("hello\nand then?\n\nnot read\n"), out=out)
  assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
  first = tok.decode(_greedy_reference(model, tok.encode(tok.chat.render(messages[:1])), 5))
  second = tok.decode(_greedy_reference(model, tok.encode(tok.chat.render(messages[:3])), 5))
  assert messages[1]["content"] == first and messages[3]["content"] == second
  assert out.getvalue() == first + "\n" + second + "\n"
  assert capsys.readouterr().err.count("note: the reply reached --max-new-tokens 5 before a stop token") == 2
  turns = dataclasses.replace(opts, prompt=["hello", "and then?"])      # --prompt twice: the same two turns
  assert gen_lib.run_chat(turns, gen_lib.SamplingOptions(temperature=0.0), model, cfg, tok,
                          out=io.StringIO()) == messages


def _until_stop(tokens, stop):
  return tokens[:tokens.index(stop)] if stop in tokens else tokens


def test_a_conversation_reply_ends_at_the_tokenizer_stop_id(byte_run):
  """A reply stops at the tokenizer's stop ids (not included) and the next turn renders the reply as it stopped.
  The stop id is one the greedy reply is known to produce (a token of the reference's first turn, first produced
  at its third step or later); the reference is the greedy continuation by full recomputation, cut before it."""
  import io
  from sinkjax.data import ByteTokenizer
  run, model = byte_run
  tok, n = ByteTokenizer(), 8
  first_turn = [{"role": "user", "content": "what is it?"}]
  free = _greedy_reference(model, tok.encode(tok.chat.render(first_turn)), n)
  stop = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
  tok.stop_ids = [stop]                                  # e.g. a tokenizer whose end of turn is this byte
  opts = gen_lib.ChatOptions(checkpoint=str(run), max_new_tokens=n)
  cfg = type("C", (), {"model": model.cfg, "mesh": MeshConfig()})
  messages = gen_lib.run_chat(opts, gen_lib.SamplingOptions(temperature=0.0), model, cfg, tok,
                              lines=io.StringIO("what is it?\nand then?\n"), out=io.StringIO())
  assert messages[1]["content"] == tok.decode(free[:free.index(stop)]) and free.index(stop) < n
  second = _until_stop(_greedy_reference(model, tok.encode(tok.chat.render(messages[:3])), n), stop)
  assert messages[3]["content"] == tok.decode(second)


def test_generate_stops_at_the_tokenizer_stop_id(byte_run, capsys, monkeypatch):
  """`generate` without --no-stop ends at the tokenizer's stop ids (not printed) and says so on stderr; with --no-stop
  it goes on to --max-new-tokens. The stop id is one the greedy continuation is known to produce (first produced at
  its third step or later; the reference: full recomputation), given to the run's tokenizer as its stop id."""
  from sinkjax.data import tokenizers
  run, model = byte_run
  tok, n = tokenizers.ByteTokenizer(), 12
  free = _greedy_reference(model, tok.encode_document("def f"), n)
  stop = next(t for i, t in enumerate(free) if i >= 2 and t not in free[:i])
  argv = ["generate", "--checkpoint", str(run), "--prompt", "def f", "--max-new-tokens", str(n), "--temperature", "0"]
  assert gen_lib.main(argv + ["--no-stop"]) == 0
  out = capsys.readouterr()
  assert out.out == "def f" + tok.decode(free, skip_special_tokens=False) + "\n" and "stopped" not in out.err
  init = tokenizers.ByteTokenizer.__init__
  def with_stop(self, *args, **kwargs):                 # e.g. a tokenizer whose end of text is this byte
    init(self, *args, **kwargs)
    self.stop_ids = [stop]
  monkeypatch.setattr(tokenizers.ByteTokenizer, "__init__", with_stop)
  assert gen_lib.main(argv) == 0
  out = capsys.readouterr()
  assert out.out == "def f" + tok.decode(free[:free.index(stop)], skip_special_tokens=False) + "\n", out.out
  assert f"[{free.index(stop)} tokens in " in out.err and f"stopped at a stop token ({stop})" in out.err, out.err


def test_a_chat_past_the_models_context_is_refused_in_one_line(byte_run, capsys):
  """The chat's cache is the model's context (model.max_seq_len 512 here, below the chat's 4,096 slots): a
  conversation and reply that fill it exactly run; one token more is one line and status 1, before anything runs."""
  from sinkjax.data import ByteTokenizer
  run, model = byte_run
  tok, n = ByteTokenizer(), 4
  assert model.cfg.max_seq_len == 512 < gen_lib.CHAT_CAPACITY
  overhead = len(tok.encode(tok.chat.render([{"role": "user", "content": ""}])))
  fits = "x" * (512 - n - overhead)
  assert len(tok.encode(tok.chat.render([{"role": "user", "content": fits}]))) + n == 512
  argv = ["chat", "--checkpoint", str(run), "--max-new-tokens", str(n), "--temperature", "0", "--no-stop", "--prompt"]
  assert gen_lib.main(argv + [fits]) == 0
  assert capsys.readouterr().out == tok.decode(_greedy_reference(model, tok.encode(tok.chat.prompt(fits)), n)) + "\n"
  assert gen_lib.main(argv + [fits + "x"]) == 1
  out = capsys.readouterr()
  assert out.out == "" and out.err.strip().splitlines() == [        # the plain layout's note, then the error
      'note: the tokenizer has no chat template; turns are laid out as "User: ... Assistant: "',
      "sinkjax.generate: error: the conversation (509 tokens) and a reply of --max-new-tokens 4 exceed the model's "
      "context (model.max_seq_len=512 tokens); start a new conversation or lower --max-new-tokens"], out.err
