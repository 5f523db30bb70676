"""Analysis is the model: `sinkjax.analysis` reads what the model's own forward pass records, so its logits are the
model's and its diagnostics equal an independent materialized computation, for every variant, with the embedding
norm on and off, sliding windows and learnable sink tokens (which a second copy of the forward pass used to miss)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sinkjax import analysis
from sinkjax.config import ModelConfig
from sinkjax.model import Transformer
from tests.helpers import rms_norm, rope

B, T, V = 2, 12, 40
SEG = np.array([[1] * 5 + [2] * 7, [1] * 9 + [0] * 3], np.int32)        # two documents; padding at the end
CASES = {
    "vanilla": dict(attention="vanilla"),
    "vanilla-no-embed-norm": dict(attention="vanilla", embed_norm=False),
    "vanilla-window": dict(attention="vanilla", layer_types=["sliding", "full"], sliding_window=3),
    "sink-window": dict(attention="sink", layer_types=["sliding", "sliding"], sliding_window=4),
    "sink-tokens": dict(attention="sink", sink_tokens=2),
    "gated-sink-tokens-no-embed-norm": dict(attention="gated", sink_tokens=2, embed_norm=False),
    "vanilla-residual-scalars": dict(attention="vanilla", residual_scalars=True),
}


def perturbed_model(**kw):
  cfg = ModelConfig(num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=V,
                    dtype="float32", max_seq_len=64, **kw)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  params = nnx.state(model, nnx.Param)
  leaves, tdef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(1), len(leaves))
  nnx.update(model, jax.tree.unflatten(tdef, [p + 0.3 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]))
  return model


# ---------------------------------------------------------------------------------------------------------------
# The reference: the whole network in float64 numpy from the state dict, attention materialized
# ---------------------------------------------------------------------------------------------------------------

def reference(sd, cfg, tokens, seg):
  """(logits [B,T,V], per layer: A [B,H,T,T] on the sequence keys, weight outside them [B,T,H], v [B,T,Hkv,D])."""
  f64 = lambda a: np.asarray(a, np.float64)
  H, K, D, n, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sink_tokens, cfg.norm_eps
  idx = np.arange(T)
  first = np.array([[min(s for s in range(t + 1) if all(seg[b, s:t + 1] == seg[b, t])) for t in idx]
                    for b in range(B)])
  pos = idx[None] - first + n
  valid = seg != 0
  x = x0 = f64(sd["embed"]["embedding"])[tokens]
  if cfg.embed_norm:
    x = x0 = rms_norm(x, eps)
  layers = []
  for l in range(cfg.num_layers):
    if cfg.residual_scalars:
      x = f64(sd["resid_lambdas"])[l] * x + f64(sd["x0_lambdas"])[l] * x0
    a = {k: jax.tree.map(f64, v) for k, v in sd["layers"][l]["attn"].items()}
    h = rms_norm(x, eps)
    proj = lambda z, name, heads: (z @ a[name]["kernel"]).reshape(z.shape[:-1] + (heads, D))
    q, k, v = rope(rms_norm(proj(h, "q_proj", H), eps), pos, cfg.rope_theta), \
        rope(rms_norm(proj(h, "k_proj", K), eps), pos, cfg.rope_theta), proj(h, "v_proj", K)
    k, vv = np.repeat(k, H // K, 2), np.repeat(v, H // K, 2)
    window = cfg.sliding_window if cfg.layer_types and cfg.layer_types[l] == "sliding" else 10**9
    allowed = (idx[None, :, None] >= idx[None, None, :]) & (idx[None, :, None] - idx[None, None, :] < window) \
        & (seg[:, :, None] == seg[:, None, :]) & valid[:, :, None]
    z = np.where(allowed[:, None], np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(D), -np.inf)
    cols = [z]
    if n:
      st = a["sink_states"]
      kp = np.repeat(rope(rms_norm(proj(st, "k_proj", K), eps), np.arange(n), cfg.rope_theta), H // K, 1)
      vp = np.repeat(proj(st, "v_proj", K), H // K, 1)
      cols.append(np.where(valid[:, None, :, None], np.einsum("bthd,nhd->bhtn", q, kp) / np.sqrt(D), -np.inf))
    if cfg.attention == "sink":
      cols.append(np.broadcast_to(a["sink"][None, :, None, None], (B, H, T, 1)))
    zz = np.concatenate(cols, -1)
    zz = np.where(valid[:, None, :, None], zz, 0.0)
    p = np.exp(zz - zz.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True) * valid[:, None, :, None]
    A = p[..., :T]
    out = np.einsum("bhts,bshd->bthd", A, vv)
    if n:
      out += np.einsum("bhtn,nhd->bthd", p[..., T:T + n], vp)
    if cfg.attention == "gated":
      out *= 1 / (1 + np.exp(-(h @ a["gate_proj"]["kernel"] + a["gate_proj"]["bias"])))[..., None]
    layers.append((A, np.swapaxes(p[..., T:].sum(-1), 1, 2), v))
    x = x + out.reshape(B, T, H * D) @ a["o_proj"]["kernel"]
    m = sd["layers"][l]["mlp"]
    x = x + np.square(np.maximum(rms_norm(x, eps) @ f64(m["up_proj"]["kernel"]), 0)) @ f64(m["down_proj"]["kernel"])
  logits = rms_norm(x, eps) @ f64(sd["lm_head"]["kernel"])
  return cfg.logit_softcap * np.tanh(logits / cfg.logit_softcap), layers, first


@pytest.mark.parametrize("case", sorted(CASES))
def test_diagnostics_equal_materialized_reference_and_logits_equal_the_model(case):
  model = perturbed_model(**CASES[case])
  cfg = model.cfg
  tokens = np.random.default_rng(0).integers(0, V, (B, T)).astype(np.int32)
  batch = {"inputs": jnp.asarray(tokens), "segment_ids": jnp.asarray(SEG)}
  ref_logits, ref_layers, first = reference(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg, tokens, SEG)
  own = np.asarray(model(batch["inputs"], segment_ids=batch["segment_ids"]))
  rec, traces = nnx.jit(lambda m, x, s: analysis.recorded_forward(m, x, segment_ids=s))(
      model, batch["inputs"], batch["segment_ids"])
  real = SEG != 0
  np.testing.assert_allclose(np.asarray(rec), own, atol=2e-5)           # the analysis forward is the model's (jit vs eager)
  np.testing.assert_allclose(own[real], ref_logits[real], atol=2e-4)
  assert np.ptp(own[real]) > 1.0
  stats = analysis.summarize(analysis.batch_statistics_jit(model, batch))
  later = real & (first != np.arange(T)[None])
  starts = real & (first == np.arange(T)[None])
  for l, (A, outside, v) in enumerate(ref_layers):
    np.testing.assert_allclose(np.asarray(traces[l].weights), A, atol=1e-5)
    a_first = np.take_along_axis(A, np.broadcast_to(first[:, None, :, None], A.shape[:3] + (1,)), -1)[..., 0]
    np.testing.assert_allclose(stats["first_token_attention_per_head"][l],
                               np.swapaxes(a_first, 1, 2)[later].mean(0), atol=1e-5)
    np.testing.assert_allclose(stats["sink_logit_attention"][l], outside[later].mean(), atol=1e-5)
    norms = np.linalg.norm(v, axis=-1).mean(-1)                                    # [B,T], mean over KV heads
    np.testing.assert_allclose(stats["first_token_value_norm"][l], norms[starts].mean(), rtol=1e-5)
    np.testing.assert_allclose(stats["other_value_norm"][l], norms[later].mean(), rtol=1e-5)


def test_recording_leaves_the_model_clean():
  model = perturbed_model(attention="sink")
  tokens = jnp.zeros((1, 8), jnp.int32)
  analysis.recorded_forward(model, tokens)
  assert not any(isinstance(v, nnx.Intermediate) for _, v in nnx.iter_graph(model))


@pytest.mark.parametrize("sink_size,window", [(1, 4), (2, 3), (0, 2)])
def test_far_attention_is_the_weight_a_sinks_window_cache_evicts(sink_size, window):
  """far_attention[l, h] = the mean, over the queries whose sinks + window cache has evicted a token, of the
  reference attention on exactly the evicted keys: document positions S .. t-(W-S), counted by a loop over (t, j)."""
  model = perturbed_model(attention="vanilla")
  tokens = np.random.default_rng(2).integers(0, V, (B, T)).astype(np.int32)
  _, ref_layers, first = reference(nnx.to_pure_dict(nnx.state(model, nnx.Param)), model.cfg, tokens, SEG)
  got = analysis.far_attention(model, [{"inputs": tokens, "segment_ids": SEG}], sink_size=sink_size, window=window)
  for l, (A, _, _) in enumerate(ref_layers):
    want, queries = np.zeros(A.shape[1]), 0
    for b in range(B):
      for t in range(T):
        pos = t - first[b, t]
        if SEG[b, t] == 0 or pos < window:
          continue
        queries += 1
        ring = set(range(pos - (window - sink_size) + 1, pos + 1))              # the newest W - S, then the sinks
        want += sum(A[b, :, t, first[b, t] + j] for j in range(pos + 1) if j >= sink_size and j not in ring)
    assert queries > 0 and want.max() > 0.01
    np.testing.assert_allclose(got[l], want / queries, atol=1e-5)
