"""The model of the paper's baseline: its size (the configs of Table 1) and its forward pass.

The forward pass is compared with an independent re-implementation in plain jnp that materializes the attention
matrix (GPT-OSS's "append a sink column, softmax, drop it" for sinks; 1 - A[t, first token of t's document] for the
implicit gate of vanilla attention), fed with the model's own state dict.
"""
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sinkjax.config import load_config
from sinkjax.model import Transformer, count_params, forward_with_importance
from tests.helpers import rms_norm, rope

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
VOCAB = 65536                                     # nanochat's tokenizer (the configs take it from data.tokenizer)
SIZES = {"d20": (20, 10, 1280), "d26": (26, 13, 1664), "d32": (32, 16, 2048)}    # layers, heads, width (paper)


def expected_params(layers, heads, width, head_dim, vocab, attention):
  """Counted by hand: untied embedding + unembedding, per layer q,k,v,o (MHA, no biases), ReLU^2 MLP 4x, plus
  one sink logit per head (sink) or a headwise gate projection with bias (gated); norms have no parameters."""
  inner = heads * head_dim
  per_layer = 4 * width * inner + 2 * width * 4 * width
  per_layer += {"vanilla": 0, "sink": heads, "gated": width * heads + heads}[attention]
  return 2 * vocab * width + layers * per_layer


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("variant", ["vanilla", "sink", "gated"])
@pytest.mark.parametrize("loss", ["base", "aux"])
def test_paper_run_configs(size, variant, loss):
  cfg = load_config(str(CONFIGS / "paper" / f"{size}_{variant}_{loss}.yaml"))
  layers, heads, width = SIZES[size]
  m = cfg.model
  assert (m.num_layers, m.num_heads, m.num_kv_heads, m.d_model, m.head_dim) == (layers, heads, heads, width, 128)
  assert m.attention == variant and (variant != "gated" or m.gate == "headwise")
  assert cfg.loss.aux_weight == (1e-4 if loss == "aux" else 0.0)
  assert cfg.train.optimizer == "muon" and cfg.train.matrix_lr == 0.02 and cfg.train.decay_frac == 0.2
  assert cfg.train.steps == 0 and cfg.train.tokens_per_param == 20        # Chinchilla budget
  assert cfg.run.dir == f"runs/{size}_{variant}_{loss}"


@pytest.mark.parametrize("size", sorted(SIZES))
@pytest.mark.parametrize("variant", ["vanilla", "sink", "gated"])
def test_paper_param_count(size, variant):
  cfg = load_config(str(CONFIGS / "paper" / f"{size}_{variant}_base.yaml"), [f"model.vocab_size={VOCAB}"])
  abstract = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
  assert count_params(abstract) == expected_params(*SIZES[size], 128, VOCAB, variant)


def test_paper_sizes_match_their_names():
  """0.6B / 1B / 2B as the paper calls them (vanilla, 65k vocabulary)."""
  counts = {s: expected_params(*SIZES[s], 128, VOCAB, "vanilla") for s in SIZES}
  assert 0.55e9 < counts["d20"] < 0.65e9
  assert 0.95e9 < counts["d26"] < 1.1e9
  assert 1.8e9 < counts["d32"] < 2.2e9


# ------------------------------------------------------------------------------------------------------------
# Independent forward pass
# ------------------------------------------------------------------------------------------------------------

def reference_forward(sd, cfg, tokens, seg):
  """logits [B,T,V] and importance [L,H] from the state dict `sd`, attention materialized."""
  B, T = tokens.shape
  H, D = cfg.num_heads, cfg.head_dim
  idx = np.arange(T)
  first = np.zeros((B, T), np.int64)                                     # first token of each token's document
  for b in range(B):
    for t in range(T):
      first[b, t] = t if t == 0 or seg[b, t] != seg[b, t - 1] else first[b, t - 1]
  pos = jnp.asarray(idx[None, :] - first)
  valid = seg != 0
  allowed = (idx[None, :, None] >= idx[None, None, :]) & (seg[:, :, None] == seg[:, None, :]) & valid[:, :, None]
  allowed = jnp.asarray(allowed)[:, None]                                # [B,1,T,S]

  x = rms_norm(sd["embed"]["embedding"][tokens])
  imps = []
  for l in range(cfg.num_layers):
    p = sd["layers"][l]
    a = p["attn"]
    h = rms_norm(x)
    q = (h @ a["q_proj"]["kernel"]).reshape(B, T, H, D)
    k = (h @ a["k_proj"]["kernel"]).reshape(B, T, H, D)
    v = (h @ a["v_proj"]["kernel"]).reshape(B, T, H, D)
    q, k = rope(rms_norm(q), pos, cfg.rope_theta), rope(rms_norm(k), pos, cfg.rope_theta)
    z = jnp.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D)
    z = jnp.where(allowed, z, -jnp.inf)
    if cfg.attention == "sink":
      zs = jnp.concatenate([z, jnp.broadcast_to(a["sink"][None, :, None, None], (B, H, T, 1))], axis=-1)
      A = jax.nn.softmax(zs, axis=-1)[..., :-1]                          # drop the sink column
      gate = A.sum(-1)                                                   # share of the real keys, [B,H,T]
      mask = valid
    else:
      A = jax.nn.softmax(jnp.where(allowed.any(-1, keepdims=True), z, 0.0), axis=-1)
      A = jnp.where(allowed, A, 0.0)
      if cfg.attention == "vanilla":
        gate = 1.0 - jnp.take_along_axis(A, jnp.asarray(first)[:, None, :, None], axis=-1)[..., 0]
        mask = valid & (first != idx[None, :])
    o = jnp.einsum("bhts,bshd->bthd", A, v)
    if cfg.attention == "gated":
      g = jax.nn.sigmoid(h @ a["gate_proj"]["kernel"] + a["gate_proj"]["bias"])   # [B,T,H]
      o = o * g[..., None]
      gate = jnp.swapaxes(g, 1, 2)
      mask = valid
    w = jnp.asarray(mask, jnp.float32)[:, None, :]
    imps.append((gate * w).sum((0, 2)) / w.sum((0, 2)))
    x = x + o.reshape(B, T, H * D) @ a["o_proj"]["kernel"]
    m = p["mlp"]
    x = x + jnp.square(jax.nn.relu(rms_norm(x) @ m["up_proj"]["kernel"])) @ m["down_proj"]["kernel"]
  logits = rms_norm(x) @ sd["lm_head"]["kernel"]
  return cfg.logit_softcap * jnp.tanh(logits / cfg.logit_softcap), jnp.stack(imps)


@pytest.mark.parametrize("variant", ["vanilla", "sink", "gated"])
def test_forward_matches_materialized_reference(variant):
  cfg = load_config(str(CONFIGS / "tiny.yaml"), [
      f"model.attention={variant}", "model.num_layers=2", "model.d_model=32", "model.num_heads=4",
      "model.num_kv_heads=4", "model.head_dim=8", "model.vocab_size=50", "model.dtype=float32"]).model
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  # Random values everywhere (the model zero-initializes its output projections and LM head).
  params = nnx.state(model, nnx.Param)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  leaves = [0.3 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  nnx.update(model, jax.tree.unflatten(treedef, leaves))
  sd = nnx.to_pure_dict(nnx.state(model, nnx.Param))

  rng = np.random.default_rng(0)
  tokens = rng.integers(0, cfg.vocab_size, (2, 12)).astype(np.int32)
  seg = np.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3], np.int32)       # two documents; padding at the end
  logits, imp = forward_with_importance(model, jnp.asarray(tokens), segment_ids=jnp.asarray(seg))
  ref_logits, ref_imp = reference_forward(sd, cfg, tokens, seg)
  real = seg != 0
  np.testing.assert_allclose(np.asarray(logits)[real], np.asarray(ref_logits)[real], atol=2e-4, rtol=2e-4)
  np.testing.assert_allclose(np.asarray(imp), np.asarray(ref_imp), atol=2e-5, rtol=1e-4)
  assert np.asarray(imp).shape == (cfg.num_layers, cfg.num_heads)
  assert np.ptp(np.asarray(logits)[real]) > 1.0                          # a non-trivial function was compared


def test_embedding_gradient_accumulates_in_float32():
  """In a bfloat16 model the embedding's gradient sums, per table row, the cotangents of every position holding that
  token; it must be summed in float32 (the table's dtype), not in bfloat16. Against np.add.at in float64 of the same
  bfloat16 cotangents: 4,096 positions of one token, where a bfloat16 running sum (8 bits) is off by percents."""
  cfg = load_config(str(CONFIGS / "tiny.yaml"), [
      "model.num_layers=1", "model.d_model=32", "model.num_heads=4", "model.num_kv_heads=4", "model.head_dim=8",
      "model.vocab_size=64", "model.dtype=bfloat16", "model.param_dtype=float32", "model.embed_norm=false"]).model
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  tokens = np.where(rng.random((8, 1024)) < 0.5, 7, rng.integers(0, 64, (8, 1024))).astype(np.int32)
  cot = jnp.asarray(rng.normal(size=(8, 1024, 32)) + 1.0, jnp.bfloat16)     # a mean, so the sums grow
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def f(p):
    x = nnx.merge(graphdef, p, rest).embed_tokens(jnp.asarray(tokens))
    assert x.dtype == jnp.bfloat16
    return jnp.sum(x.astype(jnp.float32) * cot.astype(jnp.float32))

  grad = np.asarray(jax.grad(f)(params)["embed"]["embedding"][...])
  want = np.zeros((grad.shape[0], 32))
  np.add.at(want, tokens.ravel(), np.asarray(cot.astype(jnp.float32), np.float64).reshape(-1, 32))
  assert (tokens == 7).sum() > 4000
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-3)
