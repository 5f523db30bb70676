"""Qwen3-Next (`qwen3_next`): gated full attention (an elementwise G1 gate from a doubled q projection, partial RoPE,
zero-centred norms) between Gated DeltaNet layers, a shared-expert MoE; checked against transformers.

A tiny random `Qwen3NextForCausalLM` (4 layers: 3 linear + 1 full, as the released model's pattern) is built with
transformers, its weights randomized at test scale, saved with save_pretrained, and compared logit for logit, after an
export back, and token for token in greedy generation with the cache (DeltaNet's recurrent state included). Head
importance and the aux loss cover the full-attention layers only (eq. 5 recomputed by hand from the layer's input).
"""
from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import randomize_hf_weights

torch = pytest.importorskip("torch", reason="oracle tests need torch: pip install -e \".[oracle]\" (CPU build, see README)")
transformers = pytest.importorskip("transformers", reason="oracle tests need transformers: pip install -e \".[oracle]\"")
safetensors = pytest.importorskip("safetensors")
if not hasattr(transformers, "Qwen3NextForCausalLM"):
  pytest.skip("this transformers has no Qwen3-Next (needs >= 4.57)", allow_module_level=True)

from sinkjax import balance  # noqa: E402
from sinkjax.convert import hf as convert_hf  # noqa: E402
from sinkjax.convert.hf import ConvertError, load_hf  # noqa: E402
from sinkjax.generate import Generator  # noqa: E402
from sinkjax.model import forward_with_importance  # noqa: E402
from tests.test_convert_families import _hf_logits, _names  # noqa: E402  (the families' oracle helpers)

VOCAB = 97
ATOL = 1e-4
# transformers' logits within 1e-4 in float32: compiled as users compile (tests/conftest.py's cheaper mode moves them
# by up to 1.3e-4 through rounding)
pytestmark = pytest.mark.usefixtures("optimized_compile")


def _hf_config(**kw):
  return transformers.Qwen3NextConfig(**{**dict(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
      num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
      linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
      moe_intermediate_size=32, shared_expert_intermediate_size=48, norm_topk_prob=True, max_position_embeddings=256,
      layer_types=["linear_attention"] * 3 + ["full_attention"], partial_rotary_factor=0.25,
      tie_word_embeddings=False), **kw})


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
  """(directory, transformers model) of a tiny randomized Qwen3-Next saved as safetensors."""
  torch.manual_seed(0)
  model = transformers.Qwen3NextForCausalLM(_hf_config()).eval()
  randomize_hf_weights(model)
  path = tmp_path_factory.mktemp("qwen3_next")
  model.save_pretrained(path, safe_serialization=True)
  return path, model


@pytest.fixture(scope="module")
def ours(hf_model):
  return load_hf(hf_model[0])


def _tokens(n=2, t=21, seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (n, t))




def test_import_maps_the_architecture_and_matches_transformers_logits(hf_model, ours):
  m = ours.cfg
  assert m.layer_types == ["linear", "linear", "linear", "full"] and m.rope_partial == 0.25
  assert (m.attention, m.gate, m.gate_bias, m.moe_shared_hidden, m.moe_router) == \
      ("gated", "elementwise", False, 48, "softmax_topk_norm")
  assert (m.linear_key_heads, m.linear_value_heads, m.linear_key_head_dim, m.linear_value_head_dim) == (2, 4, 8, 8)
  assert type(ours.layers[0].attn).__name__ == "LinearAttention" and ours.layers[3].attn.gate_proj.bias is None
  tokens = _tokens()
  got = np.asarray(nnx.jit(lambda model, x: model(x))(ours, jnp.asarray(tokens)))
  np.testing.assert_allclose(got, _hf_logits(hf_model[1], tokens), atol=ATOL, rtol=0)


def test_export_round_trip_loads_in_transformers(hf_model, ours, tmp_path):
  """The export holds the checkpoint's tensor names (q_proj with its gate rows, zero-centred norms as weights, the
  DeltaNet's conv1d [C, 1, K]) and transformers loads it to the original model's logits."""
  path, ref = hf_model
  out = convert_hf.save_hf(ours, tmp_path / "export")
  config = json.loads((out / "config.json").read_text())
  assert config["model_type"] == "qwen3_next" and config["layer_types"] == ref.config.layer_types
  assert config["rope_parameters"]["partial_rotary_factor"] == 0.25
  assert _names(out) == _names(path)
  with safetensors.safe_open(str(out / "model.safetensors"), "np") as f, \
       safetensors.safe_open(str(path / "model.safetensors"), "np") as g:
    for name in ("model.layers.3.self_attn.q_proj.weight", "model.norm.weight", "model.layers.0.linear_attn.conv1d.weight"):
      np.testing.assert_allclose(f.get_tensor(name), g.get_tensor(name), atol=1e-6, rtol=0)
  back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  tokens = _tokens(seed=1)
  np.testing.assert_allclose(_hf_logits(back, tokens), _hf_logits(ref, tokens), atol=ATOL, rtol=0)


def test_greedy_generation_with_the_cache_equals_transformers(hf_model, ours):
  """Prefill (chunked delta rule) then decode steps (recurrent form, conv window) carried in the cache."""
  ref = hf_model[1]
  prompt, n_new = [int(t) for t in _tokens(1, 9, seed=2)[0]], 12
  got = Generator(ours, capacity=len(prompt) + n_new).generate(prompt, n_new, temperature=0.0)
  with torch.no_grad():
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(prompt):].tolist()
  assert got == want


def test_importance_and_aux_loss_cover_the_full_attention_layers_only(ours):
  """[L_full, H] importances: eq. 5 for layer 3's elementwise gate, recomputed from its normed input by hand (the
  gate is sigmoid of a half of q_proj, averaged over tokens and head dims); the aux loss balances that row."""
  tokens = jnp.asarray(_tokens(2, 17, seed=3))
  _, imp = nnx.jit(forward_with_importance)(ours, tokens)          # one compile, not op by op (~10 s eager)
  assert imp.shape == (1, 4) and ours.cfg.head_layers == (3,)
  nnx.jit(lambda model, x: model(x, record_trace=True))(ours, tokens)
  x = np.asarray(nnx.pop(ours, nnx.Intermediate)["layers"][2]["hidden"].value, np.float64)      # layer 3's input
  scale = np.asarray(ours.layers[3].attn_norm.scale[...], np.float64)
  xn = x / np.sqrt((x * x).mean(-1, keepdims=True) + ours.cfg.norm_eps) * scale
  z = xn @ np.asarray(ours.layers[3].attn.gate_proj.kernel[...], np.float64)
  want = (1 / (1 + np.exp(-z))).reshape(2, 17, 4, 16).mean((0, 1, 3))
  np.testing.assert_allclose(np.asarray(imp[0]), want, atol=1e-5, rtol=0)
  cv2 = want.var() / want.mean() ** 2
  np.testing.assert_allclose(float(balance.aux_loss(imp, 0.1)), 0.1 * 4 * cv2, rtol=1e-4)


@pytest.mark.slow   # ~21 s; test_deltanet checks that prefill then decode continues the DeltaNet state
def test_scored_in_chunks_against_the_cache_equals_the_forward_pass(ours):
  """Append-mode chunks continue the DeltaNet state (and attend the KV cache): the same log-probabilities as one
  forward pass over the whole sequence."""
  from sinkjax.generate import streaming_nll
  ids = [int(t) for t in _tokens(1, 40, seed=4)[0]]
  logits = np.asarray(ours(jnp.asarray([ids])), np.float64)[0]
  logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
  want = -logp[np.arange(39), ids[1:]]
  got = np.asarray(streaming_nll(ours, ids, capacity=64, chunk=16))
  np.testing.assert_allclose(got.reshape(-1)[-39:], want, atol=2e-4, rtol=0)


def test_unsupported_qwen3_next_configs_say_so_in_one_line():
  base = _hf_config().to_dict()
  for key, value, why in (("decoder_sparse_step", 2, "every layer must be an MoE layer"),
                          ("attention_bias", True, "no bias"),
                          ("layer_types", ["linear_attention", "sliding_attention"] * 2, "linear_attention")):
    with pytest.raises(ConvertError, match=why) as e:
      convert_hf.model_config_from_hf({**base, key: value})
    assert "\n" not in str(e.value)
  with pytest.raises(ConvertError, match="partial_rotary_factor"):
    convert_hf.model_config_from_hf({**_hf_config().to_dict(), "model_type": "qwen3", "rope_parameters": {
        "rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}})
