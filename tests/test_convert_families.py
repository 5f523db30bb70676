"""The Qwen2.5 (`qwen2`) and Qwen3-MoE (`qwen3_moe`) families of sinkjax.convert.hf, checked against transformers.

Tiny random `Qwen2ForCausalLM` (q/k/v biases, no o bias, tied embeddings) and `Qwen3MoeForCausalLM` (QK-norm, routed
SwiGLU experts; norm_topk_prob false and true) are built with transformers (nothing is downloaded), their weights
randomized at a scale where every component matters (norm scales, biases, the router), saved with save_pretrained,
and compared logit for logit, after an export back, and token for token in greedy generation with the KV cache.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest

from tests.helpers import randomize_hf_weights
from flax import nnx

torch = pytest.importorskip("torch", reason="oracle tests need torch: pip install -e \".[oracle]\" (CPU build, see README)")
transformers = pytest.importorskip("transformers", reason="oracle tests need transformers: pip install -e \".[oracle]\"")
safetensors = pytest.importorskip("safetensors")

from sinkjax.config import ModelConfig  # noqa: E402
from sinkjax.convert import hf as convert_hf  # noqa: E402
from sinkjax.convert.hf import ConvertError, load_hf  # noqa: E402
from sinkjax.generate import Generator  # noqa: E402

VOCAB = 97
ATOL = 1e-4
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=128, rope_theta=1e6)


def _hf_config(name: str):
  if name == "qwen2":          # Qwen2.5-0.5B's shape of config: tied embeddings, sliding window off
    return transformers.Qwen2Config(**_COMMON, intermediate_size=96, tie_word_embeddings=True,
                                    use_sliding_window=False, max_window_layers=1)
  return transformers.Qwen3MoeConfig(**_COMMON, intermediate_size=96, moe_intermediate_size=32, head_dim=32,
                                     num_experts=4, num_experts_per_tok=2, norm_topk_prob=name == "qwen3_moe_norm",
                                     tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["qwen2", "qwen3_moe", "qwen3_moe_norm"])
def hf_model(request, tmp_path_factory):
  """(family, directory, transformers model) of a tiny randomized checkpoint saved as safetensors."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(_hf_config(request.param)).eval()
  randomize_hf_weights(model)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path, safe_serialization=True)
  return model.config.model_type, path, model


def _tokens(n=2, t=13, seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (n, t))


def _logits(model, tokens):
  graphdef, state = nnx.split(model)
  return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, tokens))


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def _names(path):
  with safetensors.safe_open(str(path / "model.safetensors"), "np") as f:
    return set(f.keys())


def test_import_matches_transformers_logits(hf_model):
  family, path, ref = hf_model
  model = load_hf(path)
  m = model.cfg
  if family == "qwen2":
    assert m.attn_bias and not m.attn_out_bias and m.tie_embeddings and not m.qk_norm and not m.sliding_window
    assert model.layers[0].attn.o_proj.bias is None and model.layers[0].attn.q_proj.bias is not None
  else:
    assert m.qk_norm and (m.moe_experts, m.moe_top_k, m.mlp_hidden) == (4, 2, 32)
    assert m.moe_router == ("softmax_topk_norm" if ref.config.norm_topk_prob else "softmax_topk")
    assert model.layers[0].mlp.router.bias is None
  tokens = _tokens()
  np.testing.assert_allclose(_logits(model, tokens), _hf_logits(ref, tokens), atol=ATOL, rtol=0)


def test_export_round_trip_loads_in_transformers(hf_model, tmp_path):
  """The export holds the checkpoint's own tensor names (per-expert weights for Qwen3-MoE, no o_proj bias for
  Qwen2) and transformers loads it to the original model's logits."""
  family, path, ref = hf_model
  out = convert_hf.save_hf(load_hf(path), tmp_path / "export")
  assert json.loads((out / "config.json").read_text())["model_type"] == family
  assert _names(out) == _names(path)
  back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  assert back.config.to_dict().get("norm_topk_prob") == ref.config.to_dict().get("norm_topk_prob")
  tokens = _tokens(seed=1)
  np.testing.assert_allclose(_hf_logits(back, tokens), _hf_logits(ref, tokens), atol=ATOL, rtol=0)


def test_greedy_generation_with_the_cache_equals_transformers(hf_model):
  family, path, ref = hf_model
  if ref.config.to_dict().get("norm_topk_prob"):
    pytest.skip("the routers differ in the logits alone (test_import_matches_transformers_logits)")
  prompt, n_new = [int(t) for t in _tokens(1, 7, seed=2)[0]], 12
  ours = Generator(load_hf(path), capacity=len(prompt) + n_new).generate(prompt, n_new, temperature=0.0)
  with torch.no_grad():
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=n_new, do_sample=False, eos_token_id=None,
                        pad_token_id=0)[0, len(prompt):].tolist()
  assert ours == want


def test_refused_configs_say_so_in_one_line():
  qwen2 = _hf_config("qwen2").to_dict()
  m = convert_hf.model_config_from_hf({**qwen2, "use_sliding_window": False, "sliding_window": 131072})
  assert m.sliding_window == 0 and not m.layer_types            # the released Qwen2.5 configs: window off
  with pytest.raises(ConvertError, match="use_sliding_window=true is not supported") as e:
    convert_hf.model_config_from_hf({**qwen2, "use_sliding_window": True, "sliding_window": 8})
  assert "\n" not in str(e.value)
  moe = _hf_config("qwen3_moe").to_dict()
  for key, value in (("decoder_sparse_step", 2), ("mlp_only_layers", [0])):
    with pytest.raises(ConvertError, match=f"{key}=.*every layer must be an MoE layer") as e:
      convert_hf.model_config_from_hf({**moe, key: value})
    assert "\n" not in str(e.value)


def _exportable(**kw) -> ModelConfig:
  return ModelConfig(**{**dict(vocab_size=VOCAB, num_layers=1, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                                mlp="swiglu", logit_softcap=0.0, embed_norm=False, norm_scale=True, qk_norm=False),
                        **kw})


def test_family_of_reads_the_architecture():
  """Which family a model exports as follows its attention biases, QK-norm and MLP, as the specs state."""
  assert convert_hf.family_of(_exportable()) == "llama"
  assert convert_hf.family_of(_exportable(attn_bias=True)) == "llama"                       # o_proj biased too
  assert convert_hf.family_of(_exportable(attn_bias=True, attn_out_bias=False)) == "qwen2"
  assert convert_hf.family_of(_exportable(attn_out_bias=False)) == "llama"                  # no biases at all
  assert convert_hf.family_of(_exportable(qk_norm=True)) == "qwen3"
  moe = dict(qk_norm=True, moe_experts=4, moe_top_k=2)
  assert convert_hf.family_of(_exportable(**moe, moe_router="softmax_topk")) == "qwen3_moe"
  with pytest.raises(ConvertError, match=r"qwen3_moe needs model.moe_router in softmax_topk\|"):
    convert_hf.family_of(_exportable(**moe))             # GPT-OSS's biased router has no Qwen3-MoE form
