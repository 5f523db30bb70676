"""Hugging Face import/export and LoRA fine-tuning, checked against transformers itself.

Tiny random Llama 3 (llama3 RoPE scaling), Qwen3 and GPT-OSS models are built with transformers (nothing is
downloaded), their weights randomized at a scale where every component matters (norm scales, biases, sinks, the
MoE router and the SwiGLU clamp), saved with save_pretrained, and compared logit for logit.
"""
from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from tests.helpers import randomize_hf_weights
from flax import nnx

torch = pytest.importorskip("torch", reason="oracle tests need torch: pip install -e \".[oracle]\" (CPU build, see README)")
transformers = pytest.importorskip("transformers", reason="oracle tests need transformers: pip install -e \".[oracle]\"")
pytest.importorskip("safetensors")

from sinkjax import balance, lora  # noqa: E402
from sinkjax import run as run_lib  # noqa: E402
from sinkjax.config import LoRAConfig, ModelConfig  # noqa: E402
from sinkjax.convert import hf as convert_hf  # noqa: E402
from sinkjax.convert.hf import ConvertError, load_hf  # noqa: E402
from sinkjax.model import Transformer, forward_with_importance  # noqa: E402

VOCAB = 97
ATOL = 1e-4


def _hf_config(family: str):
  common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256)
  if family == "llama":
    return transformers.LlamaConfig(
        **common, intermediate_size=96, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32), rope_theta=500000.0)
  if family == "qwen3":
    return transformers.Qwen3Config(**common, intermediate_size=96, head_dim=32, tie_word_embeddings=True,
                                    rope_theta=1e6)
  return transformers.GptOssConfig(
      **common, intermediate_size=48, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
      swiglu_limit=1.5,        # small, so the clamp acts on these random weights
      rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                        original_max_position_embeddings=64))


_CLASSES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}


def _write_tokenizer(path):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"<s>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module", params=["llama", "qwen3", "gpt_oss"])
def hf_model(request, tmp_path_factory):
  """(family, directory, transformers model) of a tiny randomized checkpoint saved as safetensors."""
  family = request.param
  torch.manual_seed(0)
  model = getattr(transformers, _CLASSES[family])(_hf_config(family)).eval()
  randomize_hf_weights(model)
  path = tmp_path_factory.mktemp(family)
  model.save_pretrained(path, safe_serialization=True)
  _write_tokenizer(path)
  return family, path, model


def _tokens(n=2, t=21, seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (n, t))


def _forward(model, tokens):
  """model(tokens), jitted (functional split/merge: the model's graph is static, its state an argument)."""
  graphdef, state = nnx.split(model)
  return _apply_jit(graphdef)(state, tokens)


_JITS = {}


def _apply_jit(graphdef, what="logits"):
  key = (id(graphdef), what)
  if key not in _JITS:
    def f(state, tokens):
      model = nnx.merge(graphdef, state)
      return model(tokens) if what == "logits" else forward_with_importance(model, tokens)[1]
    _JITS[key] = (graphdef, jax.jit(f))           # keep graphdef alive so its id is not reused
  return _JITS[key][1]


def _importance(model, tokens):
  graphdef, state = nnx.split(model)
  return _apply_jit(graphdef, "importance")(state, tokens)


def _finetune(model, loss_of_model, steps: int, lr: float):
  """Adam on the LoRA adapters only: the optimizer state and the gradient cover nnx.LoRAParam, the base weights
  ride along frozen in `rest`. Updates `model` in place; returns the losses."""
  graphdef, adapters, rest = nnx.split(model, nnx.LoRAParam, ...)
  tx = optax.adam(lr)
  opt_state = tx.init(adapters)

  @jax.jit
  def step(adapters, opt_state):
    loss, grads = jax.value_and_grad(lambda a: loss_of_model(nnx.merge(graphdef, a, rest)))(adapters)
    updates, opt_state = tx.update(grads, opt_state, adapters)
    return optax.apply_updates(adapters, updates), opt_state, loss

  losses = []
  for _ in range(steps):
    adapters, opt_state, loss = step(adapters, opt_state)
    losses.append(float(loss))
  nnx.update(model, adapters)
  return losses


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def test_import_matches_transformers_logits(hf_model):
  family, path, ref_model = hf_model
  tokens = _tokens()
  model = load_hf(path)
  assert model.cfg.logit_softcap == 0 and not model.cfg.embed_norm
  ours = np.asarray(_forward(model, jnp.asarray(tokens)))
  ref = _hf_logits(ref_model, tokens)
  np.testing.assert_allclose(ours, ref, atol=ATOL, rtol=0)
  if family == "gpt_oss":     # the sliding window really restricts: T > window, and layer 0 is a sliding layer
    assert model.cfg.layer_types == ["sliding", "full"] and tokens.shape[1] > model.cfg.sliding_window


def test_export_round_trip_loads_in_transformers(hf_model, tmp_path):
  family, path, ref_model = hf_model
  model = load_hf(path)
  out = convert_hf.save_hf(model, tmp_path / "export")
  assert json.loads((out / "config.json").read_text())["model_type"] == family
  back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  tokens = _tokens(seed=1)
  np.testing.assert_allclose(_hf_logits(back, tokens), _hf_logits(ref_model, tokens), atol=ATOL, rtol=0)


def test_cli_run_dir_then_export(hf_model, tmp_path, capsys):
  """--hf-dir writes a run directory that load_run reads (tokenizer included); --export gives it back."""
  family, path, ref_model = hf_model
  if family != "llama":
    pytest.skip("one family suffices for the command line")
  from sinkjax.run import load_run
  run = tmp_path / "run"
  cmd = [sys.executable, "-m", "sinkjax.convert.hf"]
  subprocess.run(cmd + ["--hf-dir", str(path), "--out", str(run), "--dtype", "float32"], check=True)
  model, cfg, tok, _ = load_run(run)
  assert cfg.data.tokenizer.endswith("tokenizer.json") and tok.vocab_size == VOCAB
  tokens = _tokens(seed=2)
  np.testing.assert_allclose(np.asarray(_forward(model, jnp.asarray(tokens))), _hf_logits(ref_model, tokens),
                             atol=ATOL)
  subprocess.run(cmd + ["--export", str(run), "--out", str(tmp_path / "hf")], check=True)
  back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
  np.testing.assert_allclose(_hf_logits(back, tokens), _hf_logits(ref_model, tokens), atol=ATOL)
  capsys.readouterr()
  assert convert_hf.main(["--hf-dir", str(path), "--out", str(run)]) != 0
  err = capsys.readouterr().err.strip()
  assert err.startswith("sinkjax.convert.hf: error:") and "already holds" in err and "\n" not in err


def test_sharded_checkpoint_with_index(hf_model, tmp_path):
  family, path, ref_model = hf_model
  if family != "qwen3":
    pytest.skip("sharding is format-level; one family suffices")
  ref_model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="60KB")
  assert (tmp_path / "model.safetensors.index.json").is_file()
  tokens = _tokens(seed=3)
  np.testing.assert_allclose(np.asarray(_forward(load_hf(tmp_path), jnp.asarray(tokens))),
                             _hf_logits(ref_model, tokens), atol=ATOL)


def test_refuses_pickled_weights(tmp_path, capsys):
  cfg = _hf_config("llama")
  cfg.save_pretrained(tmp_path)
  (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
  with pytest.raises(ConvertError, match="pickled"):
    load_hf(tmp_path)
  assert convert_hf.main(["--hf-dir", str(tmp_path), "--out", str(tmp_path / "run")]) != 0
  err = capsys.readouterr().err.strip()
  assert err.startswith("sinkjax.convert.hf: error:") and "pickled" in err and "\n" not in err


def test_mxfp4_dequantization_matches_transformers():
  from transformers.integrations.mxfp4 import convert_moe_packed_tensors
  rng = np.random.default_rng(0)
  blocks = rng.integers(0, 256, (2, 6, 2, 16), dtype=np.uint8)
  scales = rng.integers(120, 134, (2, 6, 2), dtype=np.uint8)
  ref = convert_moe_packed_tensors(torch.tensor(blocks), torch.tensor(scales), dtype=torch.float32).numpy()
  np.testing.assert_array_equal(convert_hf._dequantize_mxfp4(blocks, scales), ref)


def test_nanochat_model_unchanged_by_new_defaults():
  """The new architecture keys default to the nanochat model: no parameters for norms, biases or experts."""
  cfg = ModelConfig(vocab_size=50, num_layers=2, d_model=32, num_heads=4, num_kv_heads=4, head_dim=8)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert not any("scale" in n or "bias" in n or "router" in n for n in names)
  with pytest.raises(ConvertError, match="embed_norm"):
    convert_hf.family_of(cfg)


# ------------------------------------------------------------------------------------------------------------------
# LoRA
# ------------------------------------------------------------------------------------------------------------------

def _tiny(attention="vanilla", **kw):
  cfg = ModelConfig(vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
                    mlp="swiglu", mlp_hidden=48, logit_softcap=0.0, embed_norm=False, norm_scale=True,
                    qk_norm=False, dtype="float32", attention=attention, attn_impl="reference", **kw)
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  # Non-zero output projections (the nanochat init zeroes them), so every layer affects the logits.
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if path[-2] in ("o_proj", "down_proj", "lm_head"):
      var.set_value(0.2 * jax.random.normal(jax.random.PRNGKey(len(path) + path[1] if path[0] == "layers" else 7),
                                            var.shape))
  return model


def _lm_loss(model, tokens):
  logits = model(tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def test_lora_trains_only_adapters_and_merges_exactly(tmp_path):
  model = _tiny()
  lcfg = LoRAConfig(rank=4, alpha=8.0)
  lora.apply(model, lcfg, nnx.Rngs(1))
  base = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
          if not isinstance(v, nnx.LoRAParam)}
  adapters = nnx.state(model, nnx.LoRAParam)
  assert len(jax.tree.leaves(adapters)) == 2 * 2 * 7        # A and B on q,k,v,o,gate,up,down of 2 layers
  tokens = jnp.asarray(_tokens(4, 17))
  assert lora.trainable(lcfg) is nnx.LoRAParam
  losses = _finetune(model, lambda m: _lm_loss(m, tokens), steps=6, lr=1e-2)
  assert losses[-1] < losses[0]
  for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    if isinstance(v, nnx.LoRAParam):
      continue
    np.testing.assert_array_equal(np.asarray(v.get_value()), base[p], err_msg=str(p))
  assert any(np.abs(np.asarray(v)).max() > 0 for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
             if p[-1] == "lora_b")
  adapted = np.asarray(_forward(model, tokens))
  lora.merge(model)
  assert not jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
  np.testing.assert_allclose(np.asarray(_forward(model, tokens)), adapted, atol=1e-5)
  # ... and the merged export gives transformers the adapted model.
  out = convert_hf.save_hf(model, tmp_path / "merged")
  back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  np.testing.assert_allclose(_hf_logits(back, np.asarray(tokens)), adapted, atol=ATOL)


def test_lora_rank_zero_is_off_and_targets_select():
  model = _tiny()
  lora.apply(model, LoRAConfig(rank=0), nnx.Rngs(0))
  assert not jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
  lora.apply(model, LoRAConfig(rank=2, targets=["q_proj", "v_proj"]), nnx.Rngs(0))
  assert isinstance(model.layers[0].attn.q_proj, lora.LoRALinear)
  assert isinstance(model.layers[0].attn.k_proj, nnx.Linear)
  assert isinstance(model.layers[0].mlp.up_proj, nnx.Linear)


def test_lora_adapters_are_float32_over_a_bfloat16_base():
  """A bfloat16 base (GPT-OSS on a v5litepod-16 is imported so) keeps its weights; the adapters the optimizer updates
  are float32."""
  from sinkjax.layers import Attention
  attn = Attention(32, 4, num_kv_heads=2, param_dtype="bfloat16", rngs=nnx.Rngs(0))
  lora.apply(attn, LoRAConfig(rank=2), nnx.Rngs(1))
  assert attn.q_proj.kernel[...].dtype == jnp.bfloat16
  assert {v.dtype for v in jax.tree.leaves(nnx.state(attn, nnx.LoRAParam))} == {jnp.dtype(jnp.float32)}


def test_shared_heads_from_pretrained_importance():
  """Fixed shared set: the top-m heads of the pretrained model's measured importance (eq. 8)."""
  model = _tiny()
  batches = [{"inputs": _tokens(2, 16, s), "segment_ids": np.ones((2, 16), np.int32),
              "positions": np.tile(np.arange(16), (2, 1))} for s in range(2)]
  imp = run_lib.head_importance_of(model, batches)
  expected = np.mean([np.asarray(_importance(model, jnp.asarray(b["inputs"]))) for b in batches], 0)
  np.testing.assert_allclose(imp, expected, rtol=1e-5)
  mask = np.asarray(balance.shared_head_mask(imp, 1))
  assert (mask.sum(1) == 1).all() and (np.argmax(imp, 1) == np.argmax(mask, 1)).all()


@pytest.mark.slow
def test_eq8_keeps_shared_heads_while_eq7_pins():
  """App. D: on a model whose heads are unequal, LoRA fine-tuning with eq. 7 drags the dominant head toward the rest,
  while eq. 8 (m = 1) leaves the top head's importance in place and balances the routed heads among themselves."""
  tokens = jnp.asarray(_tokens(4, 32, seed=5))
  sinks = jnp.array([-4.0, 0.5, 1.5, 3.0])          # head 0 dominant (G ~ 1), the others collapsed to varying degree

  def run(num_shared):
    model = _tiny("sink")
    for block in model.layers:
      block.attn.sink.set_value(sinks)
    imp0 = np.asarray(_importance(model, tokens))
    lora.apply(model, LoRAConfig(rank=4, alpha=8.0), nnx.Rngs(3))

    def loss_fn(m):
      logits, imp = forward_with_importance(m, tokens[:, :-1])
      ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      return ce + balance.aux_loss(imp, 1.0, num_shared)

    _finetune(model, loss_fn, steps=150, lr=3e-3)
    return imp0, np.asarray(_importance(model, tokens))

  def routed_cv(imp):
    r = imp[:, 1:]
    return (r.std(1) / r.mean(1)).mean()

  imp0, imp7 = run(0)
  _, imp8 = run(1)
  assert (np.argmax(imp0, 1) == 0).all()
  drift7, drift8 = np.abs(imp7[:, 0] - imp0[:, 0]).mean(), np.abs(imp8[:, 0] - imp0[:, 0]).mean()
  assert drift8 < 0.5 * drift7, (drift7, drift8)
  assert routed_cv(imp8) < 0.5 * routed_cv(imp0), (routed_cv(imp0), routed_cv(imp8))


def test_sft_batches_put_loss_on_response_tokens_only(tmp_path):
  from sinkjax.config import DataConfig
  from sinkjax.data import build_tokenizer
  from sinkjax.data.sft import make_sft_iterator
  from sinkjax.data.tokenizers import ChatTemplate, _read_side_files
  recs = [{"prompt": f"add {i} and {i}", "response": f"{2 * i}"} for i in range(9)]
  recs.append({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
  (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
  cfg = DataConfig(source=str(tmp_path / "d.jsonl"), seq_len=48, val_fraction=0.2, prefetch=0)
  tok = build_tokenizer(cfg)
  batch = next(make_sft_iterator(cfg, tok, batch_size=4, seed=0))
  for row in range(4):
    m = batch["loss_mask"][row] > 0
    seg = batch["segment_ids"][row]
    learned = tok.decode(batch["targets"][row][m])
    assert learned and "add" not in learned and "User" not in learned        # prompts are context only
    assert set(seg[m]) <= set(seg[seg > 0]) and batch["target_bytes"][row].sum() == len(learned.encode())
  # A chat template renders turns incrementally; the assistant turn (with its end marker) is the response.
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}"}))
  pieces = ChatTemplate.from_files(_read_side_files(tmp_path)).pieces(recs[-1]["messages"])
  assert pieces == [("<user>hi</s>", False), ("<assistant>", False), ("hello</s>", True)]
  # transformers 5 writes the template to chat_template.jinja: the same template, read from there.
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}"
                                                "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]"
                                                "{% endif %}")
  pieces = ChatTemplate.from_files(_read_side_files(tmp_path)).pieces(recs[-1]["messages"])
  assert pieces == [("[user]hi</s>", False), ("[assistant]", False), ("hello</s>", True)]


def test_eval_diagnostics_of_an_imported_model_equal_transformers(hf_model):
  """Eval's first-token attention and value zeroing on an imported model equal transformers' own eager attention
  weights and a forward whose value projections are zeroed at the first token by hand (teacher-forced, all heads)."""
  from sinkjax import analysis
  family, path, ref = hf_model
  model = load_hf(path)
  tokens = _tokens(seed=5)
  B, T = tokens.shape
  batch = {"inputs": jnp.asarray(tokens), "targets": jnp.asarray(np.roll(tokens, -1, 1)),
           "segment_ids": jnp.ones((B, T), jnp.int32), "positions": jnp.broadcast_to(jnp.arange(T), (B, T)),
           "loss_mask": jnp.ones((B, T), jnp.float32), "target_bytes": jnp.ones((B, T), jnp.int32)}
  stats = analysis.summarize(analysis.batch_statistics_jit(model, batch))
  ref.set_attn_implementation("eager")
  with torch.no_grad():
    attn = ref(torch.tensor(tokens), output_attentions=True).attentions       # per layer [B, H, T, T]
  want = np.stack([a[:, :, 1:, 0].float().numpy().mean((0, 2)) for a in attn])
  np.testing.assert_allclose(np.asarray(stats["first_token_attention_per_head"]), want, atol=1e-4)
  # value zeroing, all heads: transformers with every layer's v_proj output set to 0 at position 0
  L, H = len(model.layers), model.cfg.num_heads
  hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, out: torch.cat([0 * out[:, :1], out[:, 1:]], 1))
           for layer in ref.model.layers]
  try:
    hf_logits = _hf_logits(ref, tokens)
  finally:
    for h in hooks:
      h.remove()
  logp = hf_logits - hf_logits.max(-1, keepdims=True)
  logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
  hf_nll = -np.take_along_axis(logp, np.asarray(batch["targets"])[..., None], -1).sum()
  ours = analysis.zeroed_lm_sums_jit(model, batch, jnp.ones((L, H), bool))
  np.testing.assert_allclose(float(ours["nll"]), hf_nll, rtol=1e-4)
  unzeroed = analysis.lm_sums(_forward(model, jnp.asarray(tokens)), batch)
  assert abs(float(unzeroed["nll"]) - hf_nll) > 1e-2            # the zeroing changed something
