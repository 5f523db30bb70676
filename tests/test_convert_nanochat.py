"""`python -m sinkjax.convert.nanochat`: nanochat checkpoint directories in (both architectures, the forms
nanochat's own loader accepts), runs that load_run / eval / generate / train.init_from use, export back, and
one-line errors for bad input."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from tests import nanochat_peer
from tests.helpers import run_ok
from tests.test_nanochat import perturbed_nanochat
from sinkjax.run import load_run
from sinkjax.convert import nanochat as nc

torch = pytest.importorskip("torch", reason="nanochat checkpoints are torch files (pip install torch, CPU build)")

BYTES = dict(sequence_len=32, vocab_size=257, n_layer=2, n_head=2, n_kv_head=2, n_embd=64)   # the byte vocabulary


def write_checkpoint(directory, model, gpt_kwargs, step, *, compiled=False, bf16_embedding=False):
  """What nanochat's save_checkpoint writes (torch.save of the state dict + meta json), optionally as a
  torch.compile'd model's keys (`_orig_mod.` prefix) and with the bf16 embedding of a CUDA run."""
  directory.mkdir(parents=True, exist_ok=True)
  sd = {("_orig_mod." if compiled else "") + k: v.clone() for k, v in model.state_dict().items()}
  if bf16_embedding:
    key = ("_orig_mod." if compiled else "") + "transformer.wte.weight"
    sd[key] = sd[key].bfloat16()
  torch.save(sd, directory / f"model_{step:06d}.pt")
  (directory / f"meta_{step:06d}.json").write_text(json.dumps({"step": step, "model_config": gpt_kwargs}))


def byte_model(tree, seed=0):
  import types
  kwargs = dict(BYTES, **({"window_pattern": "SL"} if tree == "nanochat-6bb9240" else {}))
  peer = nanochat_peer.load(tree)
  torch.manual_seed(seed)
  model = peer.gpt.GPT(peer.gpt.GPTConfig(**kwargs))
  model.init_weights()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return types.SimpleNamespace(peer=peer, model=model, kwargs=kwargs)


@pytest.mark.parametrize("tree", ["nanochat-9d4c9b7", "nanochat-6bb9240"])
def test_import_newest_step_then_logits_match(tree, tmp_path):
  """Newest step by default, `_orig_mod.` keys and a bf16 embedding accepted; the run's model gives nanochat's
  logits (embedding rounded to bf16 on both sides)."""
  nm = byte_model(tree)
  old = byte_model(tree, seed=5)
  write_checkpoint(tmp_path / "ckpt", old.model, nm.kwargs, 100)
  write_checkpoint(tmp_path / "ckpt", nm.model, nm.kwargs, 200, compiled=True, bf16_embedding=True)
  cfg, step = nc.convert(tmp_path / "ckpt", tmp_path / "run", dtype="float32")
  assert step == 200 and cfg.data.packing == "stream" and cfg.data.tokenizer == "bytes"
  assert cfg.model.residual_scalars == (tree == "nanochat-6bb9240")
  model, _, _, _ = load_run(tmp_path / "run")
  with torch.no_grad():
    nm.model.transformer.wte.weight.copy_(nm.model.transformer.wte.weight.bfloat16().float())
    tokens = np.random.default_rng(0).integers(0, 257, (2, 32))
    ref = nm.model(torch.tensor(tokens)).numpy()
  np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), ref, atol=1e-4, rtol=0)


@pytest.mark.slow   # the CLI chain (~45 s) over what the in-process import tests above check
def test_cli_import_eval_generate_finetune_export(tmp_path):
  """The whole path from the command line: import, eval, generate, fine-tune from it (train.init_from), export the
  fine-tuned run, and nanochat loads the export strictly with the fine-tuned run's logits."""
  nm = byte_model("nanochat-9d4c9b7")
  write_checkpoint(tmp_path / "ckpt", nm.model, nm.kwargs, 7)
  run = tmp_path / "run"
  out = run_ok("sinkjax.convert.nanochat", "--checkpoint", tmp_path / "ckpt", "--out", run, "--dtype", "float32")
  assert "step 7" in out.stdout
  (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": f"document {i} " * 30}) + "\n" for i in range(200)))
  run_ok("sinkjax.eval", "--checkpoint", run, "--data", tmp_path / "docs.jsonl", "--batches", "1", "--batch-size", "2",
         "--out", tmp_path / "eval")
  assert np.isfinite(json.loads((tmp_path / "eval" / "report.json").read_text())["val_bpb"])
  run_ok("sinkjax.generate", "generate", "--checkpoint", run, "--prompt", "doc", "--max-new-tokens", "5", "--temperature", "0")
  tuned = tmp_path / "tuned"
  run_ok("sinkjax.train", "--config", run / "config.yaml", f"train.init_from={run}", f"run.dir={tuned}",
         f"data.source={tmp_path / 'docs.jsonl'}", "data.seq_len=32", "train.batch_size=8", "train.steps=2",
         "train.eval_batches=0", "checkpoint.async_save=false", "train.muon_ns_dtype=float32")
  run_ok("sinkjax.convert.nanochat", "--export", tuned, "--out", tmp_path / "back")
  meta = json.loads((tmp_path / "back" / "meta_000002.json").read_text())
  back = nm.peer.gpt.GPT(nm.peer.gpt.GPTConfig(**meta["model_config"]))
  back.load_state_dict(torch.load(tmp_path / "back" / "model_000002.pt", weights_only=True), strict=True)
  tuned_model, _, _, _ = load_run(tuned)
  tokens = np.random.default_rng(3).integers(0, 257, (1, 32))
  with torch.no_grad():
    np.testing.assert_allclose(back(torch.tensor(tokens)).numpy(), np.asarray(tuned_model(jnp.asarray(tokens))),
                               atol=1e-4, rtol=0)
  start, _, _, _ = load_run(run)
  assert not np.allclose(np.asarray(start(jnp.asarray(tokens))), np.asarray(tuned_model(jnp.asarray(tokens))))


class NotATensor:          # a pickled class instance: weights_only=True must refuse to load it
  pass


def error_line(capsys, *argv):
  assert nc.main(list(argv)) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("sinkjax.convert.nanochat: error: "), err
  return err[0]


def test_bad_input_is_one_line(tmp_path, capsys):
  nm = byte_model("nanochat-9d4c9b7")
  out = ["--out", str(tmp_path / "run")]
  assert "is not a directory" in error_line(capsys, "--checkpoint", str(tmp_path / "nowhere"), *out)
  (tmp_path / "empty").mkdir()
  assert "no model_NNNNNN.pt" in error_line(capsys, "--checkpoint", str(tmp_path / "empty"), *out)
  write_checkpoint(tmp_path / "ok", nm.model, nm.kwargs, 3)
  assert "no checkpoint at step 4" in error_line(capsys, "--checkpoint", str(tmp_path / "ok"), "--step", "4", *out)
  (tmp_path / "ok" / "meta_000003.json").rename(tmp_path / "meta.json")
  assert "meta_000003.json is missing" in error_line(capsys, "--checkpoint", str(tmp_path / "ok"), *out)
  # a full pickle (an arbitrary object besides the tensors) is refused, not executed
  write_checkpoint(tmp_path / "pickle", nm.model, nm.kwargs, 1)
  torch.save({"weights": nm.model.state_dict(), "extra": NotATensor()}, tmp_path / "pickle" / "model_000001.pt")
  assert "refusing to unpickle" in error_line(capsys, "--checkpoint", str(tmp_path / "pickle"), *out)
  # unknown tensors (not a nanochat GPT) and unknown model_config keys
  write_checkpoint(tmp_path / "extra", nm.model, nm.kwargs, 1)
  sd = nm.model.state_dict()
  sd["transformer.h.0.attn.bias"] = torch.zeros(3)
  torch.save(sd, tmp_path / "extra" / "model_000001.pt")
  assert "unknown tensors" in error_line(capsys, "--checkpoint", str(tmp_path / "extra"), *out)
  write_checkpoint(tmp_path / "cfg", nm.model, dict(nm.kwargs, n_mlp=4), 1)
  assert "unknown keys ['n_mlp']" in error_line(capsys, "--checkpoint", str(tmp_path / "cfg"), *out)
  # a vocabulary that is not the byte tokenizer's needs --tokenizer; a pickle tokenizer is refused
  big = dict(nm.kwargs, vocab_size=300)
  torch.manual_seed(0)
  write_checkpoint(tmp_path / "big", nm.peer.gpt.GPT(nm.peer.gpt.GPTConfig(**big)), big, 1)
  assert "--tokenizer tokenizer.json" in error_line(capsys, "--checkpoint", str(tmp_path / "big"), *out)
  (tmp_path / "tokenizer.pkl").write_bytes(b"\x80\x04N.")
  assert "a pickle is never loaded" in error_line(capsys, "--checkpoint", str(tmp_path / "big"), "--tokenizer",
                                                  str(tmp_path / "tokenizer.pkl"), *out)
  assert not (tmp_path / "run" / "checkpoints").exists()
