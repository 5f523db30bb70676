"""One-pass hybrid scoring (`sinkjax.experiments.head_masks`) against the cache path it stands for: token-by-token
decoding through a `HybridKVCache` (`generate.streaming_nll` without chunks) and the chunked cache path, on a tiny
random model whose text runs well past the window, for hybrid maps, every head full and no head full; DuoAttention's
gated mix at gates 1 and 0 against the same cache paths."""
import numpy as np
import pytest

import jax.numpy as jnp

from sinkjax import generate as gen_lib
from sinkjax.experiments import head_masks
from tests.test_generate import random_model

S, W, N = 2, 8, 30            # 30 tokens through an 8-slot ring with 2 sinks: it wraps several times


def _ids():
  return np.random.RandomState(7).randint(0, 50, size=N)


@pytest.fixture(scope="module")
def tiny():
  model, cfg = random_model(num_layers=3)
  return model, cfg, head_masks.HybridScorer(model, sink_size=S, window=W)


def _maps(cfg):
  L, H = cfg.num_layers, cfg.num_kv_heads
  rng = np.random.RandomState(0)
  mixed = [np.eye(H, dtype=bool)[rng.randint(H)] for _ in range(L)]
  return {"mixed": np.asarray(mixed), "every": np.ones((L, H), bool), "none": np.zeros((L, H), bool)}


@pytest.mark.parametrize("which", ["mixed", "every", "none"])
def test_one_pass_equals_token_by_token_cache(tiny, which):
  model, cfg, scorer = tiny
  full = _maps(cfg)[which]
  steps = gen_lib.streaming_nll(model, _ids(), capacity=N, sink_size=S, window=W,
                                full_heads=tuple(tuple(bool(x) for x in r) for r in full))
  np.testing.assert_allclose(scorer(_ids(), full), steps, atol=2e-5, rtol=0)


def test_one_pass_equals_chunked_cache_and_maps_differ(tiny):
  model, cfg, scorer = tiny
  full = _maps(cfg)["mixed"]
  blocks = gen_lib.streaming_nll(model, _ids(), capacity=N, sink_size=S, window=W, chunk=5,
                                 full_heads=tuple(tuple(bool(x) for x in r) for r in full))
  one = scorer(_ids(), full)
  np.testing.assert_allclose(one, blocks, atol=2e-5, rtol=0)
  other = scorer(_ids(), ~full)            # the map matters: another map scores other NLLs past the window
  assert np.abs(other - one)[W:].max() > 1e-3
  np.testing.assert_allclose(other[:W - 1], one[:W - 1], atol=2e-5)   # before eviction every cache is full


def test_plain_streaming_and_full_cache(tiny):
  model, cfg, scorer = tiny
  L, H = cfg.num_layers, cfg.num_kv_heads
  np.testing.assert_allclose(scorer(_ids(), np.zeros((L, H))),
                             gen_lib.streaming_nll(model, _ids(), capacity=W, sink_size=S), atol=2e-5, rtol=0)
  np.testing.assert_allclose(scorer(_ids(), np.ones((L, H))),
                             gen_lib.streaming_nll(model, _ids(), capacity=N), atol=2e-5, rtol=0)


@pytest.mark.parametrize("gate", [1.0, 0.0])
def test_gated_mix_at_its_ends_is_full_or_streaming(tiny, gate):
  model, cfg, _ = tiny
  L, H = cfg.num_layers, cfg.num_kv_heads
  tokens = jnp.asarray(_ids(), jnp.int32)[None]
  h, _ = head_masks.hidden_with(model, tokens, jnp.full((L, H), gate), head_masks.gated_attention, sink_size=S,
                                window=W)
  nll = np.asarray(head_masks.token_nll(model, h[:, :-1], tokens[:, 1:])[0], np.float64)
  ref = gen_lib.streaming_nll(model, _ids(), capacity=N) if gate else gen_lib.streaming_nll(
      model, _ids(), capacity=W, sink_size=S)
  np.testing.assert_allclose(nll, ref, atol=2e-5, rtol=0)


def test_gated_mix_is_linear_in_the_gate(tiny):
  """A gate between the ends mixes the two attention outputs: layer output at g = g * (at 1) + (1 - g) * (at 0)
  (o_proj is linear and has no bias here)."""
  model, cfg, _ = tiny
  layer = model.layers[0].attn
  x = jnp.asarray(np.random.RandomState(1).normal(size=(1, N, cfg.d_model)), jnp.float32)
  at = lambda g: np.asarray(head_masks.gated_attention(layer, x, jnp.asarray([g, 0.25]), S, W)[0])
  np.testing.assert_allclose(at(0.3), 0.3 * at(1.0) + 0.7 * at(0.0), atol=1e-5)


def test_refuses_a_model_it_does_not_cover():
  model, _ = random_model(attention="sink")
  with pytest.raises(ValueError, match="vanilla"):
    head_masks.HybridScorer(model, sink_size=S, window=W)
