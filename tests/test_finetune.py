"""Fine-tuning end to end: import a tiny random Hugging Face Llama, LoRA-fine-tune it on SFT data with the trainer
(train.init_from, data.format sft, eq. 8), check that only the adapters moved, and export it back to transformers.
"""
from __future__ import annotations

import json

import jax
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="oracle tests need torch: pip install -e \".[oracle]\" (CPU build, see README)")
transformers = pytest.importorskip("transformers", reason="oracle tests need transformers: pip install -e \".[oracle]\"")
pytest.importorskip("safetensors")
pytest.importorskip("tokenizers")

from sinkjax import lora, optim  # noqa: E402
from sinkjax.run import load_run  # noqa: E402
from sinkjax.config import Config, ModelConfig  # noqa: E402
from sinkjax.model import Transformer  # noqa: E402
from tests.helpers import run_ok  # noqa: E402


VOCAB = 64


def _write_tokenizer(path):
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"<s>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
  tok = Tokenizer(models.WordLevel(vocab, unk_token="w1"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.save(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory):
  """(base run dir, fine-tuned run dir, tmp dir) after importing a tiny Llama and fine-tuning it for 4 steps."""
  tmp = tmp_path_factory.mktemp("finetune")
  torch.manual_seed(0)
  hf_cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=96, max_position_embeddings=128,
                                    tie_word_embeddings=False)
  hf = transformers.LlamaForCausalLM(hf_cfg).eval()
  hf_dir = tmp / "hf"
  hf.save_pretrained(hf_dir, safe_serialization=True)
  _write_tokenizer(hf_dir)
  base = tmp / "base"
  run_ok("sinkjax.convert.hf", "--hf-dir", str(hf_dir), "--out", str(base))
  # A learnable task: the response repeats the prompt.
  rng = np.random.default_rng(0)
  with open(tmp / "sft.jsonl", "w") as f:
    for _ in range(24):
      words = " ".join(f"w{i}" for i in rng.integers(2, VOCAB, 6))
      f.write(json.dumps({"prompt": words, "response": words}) + "\n")
  run = tmp / "sft_run"
  run_ok("sinkjax.train", "--config", "configs/finetune_llama3.yaml",
         "model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
         "model.dtype=float32", f"train.init_from={base}", f"data.source={tmp / 'sft.jsonl'}",
         f"data.tokenizer={hf_dir / 'tokenizer.json'}", "data.seq_len=32", "data.val_fraction=0.25",
         "train.batch_size=8", "train.steps=6", "train.warmup_steps=0", "train.adamw_lr=0.01", "train.log_every=1",
         "train.eval_every=0", "train.eval_batches=1", "checkpoint.async_save=false", "lora.rank=4",
         f"run.dir={run}")
  return base, run, tmp


def test_finetune_trains_only_adapters(finetuned):
  base, run, _ = finetuned
  recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  losses = [r["loss"] for r in recs]
  assert [r["step"] for r in recs] == list(range(1, 7))
  assert all(np.isfinite(losses)) and all(r["finite"] for r in recs)
  assert min(losses[-2:]) < losses[0], losses
  # eq. 8: aux loss on with num_shared_heads = 2 of 4 heads.
  assert all(r["aux_loss"] > 0 for r in recs) and len(recs[-1]["importance"]) == 2
  assert np.isfinite(recs[-1]["val_bpb"])

  base_model, _, _, _ = load_run(base)
  model, cfg, _, _ = load_run(run)
  assert cfg.lora.rank == 4 and cfg.loss.num_shared_heads == 2 and cfg.data.format == "sft"
  assert cfg.model.mlp == base_model.cfg.mlp and cfg.model.vocab_size == VOCAB   # the imported run's model
  assert isinstance(model.layers[0].attn.q_proj, lora.LoRALinear)
  want = dict(nnx.to_flat_state(nnx.state(base_model, nnx.Param)))
  got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  adapters = {p for p, v in got.items() if isinstance(v, nnx.LoRAParam)}
  assert adapters and set(got) - adapters == set(want)
  for p, v in want.items():
    np.testing.assert_array_equal(np.asarray(got[p].get_value()), np.asarray(v.get_value()), err_msg=str(p))
  assert any(np.abs(np.asarray(got[p].get_value())).max() > 0 for p in adapters if p[-1] == "lora_b")


def test_finetune_export_loads_in_transformers(finetuned):
  _, run, tmp = finetuned
  out = tmp / "exported"
  run_ok("sinkjax.convert.hf", "--export", str(run), "--out", str(out))
  model, _, _, _ = load_run(run)
  tokens = np.random.default_rng(1).integers(0, VOCAB, (1, 12))
  ours = np.asarray(model(jax.numpy.asarray(tokens)))
  back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    ref = back(torch.tensor(tokens)).logits.float().numpy()
  np.testing.assert_allclose(ref, ours, atol=2e-4)


def test_sink_states_go_to_adamw_with_the_embeddings():
  cfg = ModelConfig(num_layers=1, d_model=32, num_heads=2, num_kv_heads=2, head_dim=16, vocab_size=50,
                    sink_tokens=2)
  params = nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)), nnx.Param)
  labels = {"/".join(map(str, p)): label for p, label in nnx.to_flat_state(optim.param_labels(params))}
  sinks = [k for k in labels if k.endswith("sink_states")]
  assert sinks and all(labels[k] == "embed" for k in sinks)
  assert labels["embed/embedding"] == "embed"
  assert any(v == "matrix" for k, v in labels.items() if k.startswith("layers"))
  full = Config(model=cfg)
  full.train.steps = 2
  tx, _ = optim.build_optimizer(full, 2)
  tx.init(params)            # the partition covers every label


def test_eval_on_imported_model_gives_importance_heatmap(finetuned):
  """sinkjax.eval on a converted Hugging Face model: the layer x head importance ([Sink-MoE] Fig. 4) and its heatmap,
  with importance = 1 - mean first-token attention per head (vanilla gate) as reported alongside."""
  base, _, tmp = finetuned
  rng = np.random.default_rng(2)
  with open(tmp / "text.jsonl", "w") as f:
    for _ in range(400):           # the eval reads the validation split (2 % of the documents)
      f.write(json.dumps({"text": " ".join(f"w{i}" for i in rng.integers(2, VOCAB, 20))}) + "\n")
  out = tmp / "eval_base"
  run_ok("sinkjax.eval", "--checkpoint", str(base), "--data", str(tmp / "text.jsonl"), "--batches", "2",
         "--batch-size", "4", "--out", str(out))
  report = json.loads((out / "report.json").read_text())
  imp = np.asarray(report["importance"])
  assert imp.shape == (2, 4) and np.all((imp > 0) & (imp < 1))
  assert (out / "importance.png").stat().st_size > 0
  np.testing.assert_allclose(np.asarray(report["first_token_attention_per_head"]), 1 - imp, atol=2e-3)


def test_eval_reads_an_sft_run_with_its_own_examples(finetuned):
  """sinkjax.eval on the SFT run itself: its validation batches are its held-out SFT examples (data.format sft),
  loss on the response tokens only, so the report's BPB is over response bytes."""
  _, run, tmp = finetuned
  out = tmp / "eval_sft"
  run_ok("sinkjax.eval", "--checkpoint", str(run), "--batches", "1", "--batch-size", "4", "--out", str(out))
  report = json.loads((out / "report.json").read_text())
  assert np.isfinite(report["val_bpb"]) and report["eval_tokens"] > 0
  from sinkjax.data import build_tokenizer, make_eval_batches
  from sinkjax.run import read_run_config
  cfg = read_run_config(run)
  batch = make_eval_batches(cfg.data, build_tokenizer(cfg.data), batch_size=4, num_batches=1)[0]
  assert 0 < batch["loss_mask"].sum() < (batch["segment_ids"] != 0).sum()      # prompts carry no loss
  assert report["eval_tokens"] == int(batch["loss_mask"].sum())


def _other_tokenizer(path):
  """A tokenizer of the same size as the model's whose ids mean other words (w1 <-> w2 swapped)."""
  from tokenizers import Tokenizer, models, pre_tokenizers
  vocab = {"<s>": 0, **{f"w{i}": i for i in range(1, VOCAB)}}
  vocab["w1"], vocab["w2"] = 2, 1
  tok = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  path.mkdir(parents=True, exist_ok=True)
  tok.save(str(path / "tokenizer.json"))
  return path / "tokenizer.json"


def _finetune_cfg(base, tmp, *overrides):
  from sinkjax.config import load_config
  return load_config("configs/finetune_llama3.yaml", [
      "model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
      f"train.init_from={base}", f"data.source={tmp / 'sft.jsonl'}", f"run.dir={tmp / 'never'}", *overrides])


def test_an_imported_model_is_finetuned_on_its_own_tokenizer(finetuned):
  """The fine-tune configs inherit base.yaml (whose data.tokenizer is a 65,536-token BPE): they name the model's own
  tokenizer (data.tokenizer ''), so init_from's RUN/tokenizer is the one used; a tokenizer with the same vocabulary
  elsewhere is accepted, one with another vocabulary (or base.yaml's path) is refused in one line before any step."""
  from sinkjax.config import ConfigError
  from sinkjax.data import build_tokenizer
  from sinkjax.run import adopt_init_model
  base, _, tmp = finetuned
  cfg = _finetune_cfg(base, tmp)
  adopt_init_model(cfg)
  assert cfg.data.tokenizer == str(base / "tokenizer" / "tokenizer.json")
  cfg = _finetune_cfg(base, tmp, f"data.tokenizer={tmp / 'hf' / 'tokenizer.json'}")   # the same vocabulary, a copy
  adopt_init_model(cfg)
  assert build_tokenizer(cfg.data).encode("w1 w2") == [1, 2]
  other = _other_tokenizer(tmp / "other")
  with pytest.raises(ConfigError, match="is not the vocabulary of train.init_from.*data.tokenizer=''"):
    adopt_init_model(_finetune_cfg(base, tmp, f"data.tokenizer={other}"))
  with pytest.raises(ConfigError, match="does not exist.*own tokenizer"):
    adopt_init_model(_finetune_cfg(base, tmp, "data.tokenizer=data/tokenizer/tokenizer.json"))


def test_train_refuses_another_vocabulary_before_any_step(finetuned, tmp_path, capsys):
  from sinkjax import train
  from tests.helpers import call_main, one_error_line
  base, _, tmp = finetuned
  other = _other_tokenizer(tmp_path / "other")
  run_dir = tmp_path / "run"
  res = call_main(train.main, ["--config", "configs/finetune_llama3.yaml", "model.num_layers=2", "model.d_model=64",
                               "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=16",
                               f"train.init_from={base}", f"data.source={tmp / 'sft.jsonl'}",
                               f"data.tokenizer={other}", f"run.dir={run_dir}"], capsys)
  assert "is not the vocabulary of train.init_from" in one_error_line(res)
  assert not (run_dir / "checkpoints").exists()


def test_load_run_refuses_a_tokenizer_override_of_another_vocabulary(finetuned, tmp_path):
  """eval / lm_eval / generate load a run through load_run: data.tokenizer may be overridden only by a tokenizer with
  the run's own vocabulary."""
  from sinkjax.config import ConfigError
  base, run, _ = finetuned
  other = _other_tokenizer(tmp_path / "other")
  with pytest.raises(ConfigError, match=f"is not the vocabulary of run {run}"):
    load_run(run, overrides=[f"data.tokenizer={other}"])
  loaded = load_run(run, overrides=[f"data.tokenizer={base / 'tokenizer'}"])
  assert loaded.tokenizer.encode("w5") == [5]
