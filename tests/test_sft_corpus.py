"""The paper's fine-tuning setup: AceReason-1.1-SFT records converted into sinkjax SFT JSONL, configs/finetune_qwen3_4b.yaml
against Qwen3-4B's config.json, and every setting the paper does not state marked "our choice"."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from sinkjax import config as config_lib
from sinkjax.errors import UserError
from sinkjax.config import DataConfig
from sinkjax.convert import hf
from sinkjax.run import RESUMABLE_MODEL_KEYS
from sinkjax.data import acereason, sft
from tests.helpers import ROOT

# Qwen3-4B's config.json as published (Qwen/Qwen3-4B on the Hugging Face hub)
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 2560, "initializer_range": 0.02,
    "intermediate_size": 9728, "max_position_embeddings": 40960, "max_window_layers": 36, "model_type": "qwen3",
    "num_attention_heads": 32, "num_hidden_layers": 36, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": True,
    "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936}


def test_qwen3_4b_config_is_the_hf_config(tmp_path):
  """Every architecture key of the config equals what the importer reads from Qwen3-4B's config.json (written here), and
  transformers' Qwen3Config of that file has the shapes the issue names."""
  import transformers
  (tmp_path / "config.json").write_text(json.dumps(QWEN3_4B))
  want = hf.model_config_from_hf(hf.read_hf_config(tmp_path), dtype="bfloat16")
  got = config_lib.load_config(str(ROOT / "configs" / "finetune_qwen3_4b.yaml")).model
  # how the model is computed (dtype, remat policy, scan: run.RESUMABLE_MODEL_KEYS) is the config's own, not the
  # architecture; model.dtype is bfloat16 on both sides
  diff = {f.name: (getattr(got, f.name), getattr(want, f.name)) for f in dataclasses.fields(want)
          if getattr(got, f.name) != getattr(want, f.name) and f.name not in set(RESUMABLE_MODEL_KEYS) - {"dtype"}}
  assert diff == {}
  t = transformers.Qwen3Config.from_pretrained(tmp_path)
  assert (t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.head_dim,
          t.intermediate_size, t.vocab_size, t.tie_word_embeddings) == (36, 2560, 32, 8, 128, 9728, 151936, True)
  assert (got.num_layers, got.d_model, got.num_heads, got.num_kv_heads, got.head_dim, got.mlp_hidden, got.vocab_size,
          got.tie_embeddings, got.rope_theta) == (36, 2560, 32, 8, 128, 9728, 151936, True, 1e6)


# Settings the paper ([Sink-MoE] §5.3) does not state, and the ones it does (rank 16, lambda 1e-2)
UNSTATED = ("num_shared_heads", "alpha", "targets", "seq_len", "val_fraction", "optimizer", "adamw_lr",
            "warmup_steps", "decay_frac", "batch_size")
STATED = ("rank", "aux_weight")


@pytest.mark.parametrize("name", ["finetune_qwen3_4b", "finetune_qwen3", "finetune_llama3", "finetune_gptoss"])
def test_unstated_settings_are_marked_our_choice(name):
  lines = (ROOT / "configs" / f"{name}.yaml").read_text().splitlines()
  key_line = {m.group(1): l for l in lines if (m := re.match(r"  (\w+):", l))}
  for key in UNSTATED:
    assert "# our choice" in key_line[key] or "; our choice" in key_line[key], (name, key_line[key])
  for key in STATED:
    assert "our choice" not in key_line[key] and "paper" in key_line[key], (name, key_line[key])
  steps = key_line["steps"]
  assert "our choice" in steps or key_line.get("epochs", "").startswith("  epochs: 1 "), (name, steps)


def _records():
  return [{"category": "math", "source": "s", "input": "What is 2+2?", "output": "<think>\n2+2=4\n</think>\n\n4"},
          {"category": "code", "source": "s", "input": "Print hi.", "output": "print('hi')"},
          {"category": "math", "source": "s", "input": "Naïve €?", "output": "ok 🙂"}]


def test_acereason_records_become_sft_examples(tmp_path):
  """parquet and JSONL records -> {"messages": [user input, assistant output]} lines that sinkjax.data.sft reads
  back as the same conversations; --category and --limit; one-line errors."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  recs = _records()
  pq.write_table(pa.Table.from_pylist(recs), tmp_path / "train-00000.parquet", row_group_size=2)
  (tmp_path / "more.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs[:1]))
  out = tmp_path / "sft.jsonl"
  n = acereason.convert(str(tmp_path / "*.*"), str(out))
  assert n == {"read": 4, "written": 4}
  convs = sft.read_examples(str(out))
  want = [[{"role": "user", "content": r["input"]}, {"role": "assistant", "content": r["output"]}]
          for r in recs[:1] + recs]                         # more.jsonl sorts before train-00000.parquet
  assert convs == want
  assert acereason.main(["--source", str(tmp_path / "*.parquet"), "--out", str(out), "--category", "math",
                         "--limit", "1"]) == 0
  assert sft.read_examples(str(out)) == [want[1]]
  assert acereason.convert(str(tmp_path / "*.parquet"), str(out), category="math") == {"read": 3, "written": 2}
  (tmp_path / "bad").mkdir()
  (tmp_path / "bad" / "b.jsonl").write_text(json.dumps({"prompt": "x", "answer": "y"}) + "\n")
  with pytest.raises(UserError, match=r"b.jsonl:1: an AceReason-1.1-SFT record needs 'input' and 'output' strings "
                                      r"\(has: prompt, answer\)"):
    acereason.convert(str(tmp_path / "bad" / "*.jsonl"), str(tmp_path / "o.jsonl"))
  with pytest.raises(UserError, match="gave no example of category 'poetry'"):
    acereason.convert(str(tmp_path / "*.parquet"), str(tmp_path / "o.jsonl"), category="poetry")
  # the written file is an SFT source as it stands
  assert len(sft.sft_rows(DataConfig(source=str(out), format="sft", seq_len=64), _byte_tok(), "all")) >= 1


def _byte_tok():
  from sinkjax.data import build_tokenizer
  return build_tokenizer(DataConfig())
