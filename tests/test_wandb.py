"""Weights & Biases tracking of training (`logging.wandb`, `sinkjax.tracking`), offline: nothing is sent, no key.

A short `python -m sinkjax.train` run with `WANDB_MODE=offline` writes W&B's offline run files; they are read back
here with W&B's own protobuf records (the `.wandb` file is a LevelDB-style log of `wandb_internal_pb2.Record`s,
read by the small reader below, independent of sinkjax) and compared with the run's `metrics.jsonl`: the same steps
and values, the per-head importance, the resolved config. Running the same command with more steps resumes from the
checkpoint and continues the same W&B run id (stored in RUN_DIR/wandb_id).
"""
from __future__ import annotations

import glob
import json
import os
import pathlib
import struct
import subprocess
import sys

import pytest

from tests.helpers import run_command

wandb = pytest.importorskip("wandb", reason="wandb is not installed (pip install 'sinkjax[wandb]')")

REPO = pathlib.Path(__file__).resolve().parents[1]
BLOCK = 32768           # the LevelDB log block W&B's store uses; records: crc32 (4) length (2) type (1) payload
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_wandb_records(path) -> list:
  """Every `Record` protobuf of an offline `.wandb` file."""
  from wandb.proto import wandb_internal_pb2 as pb
  data = pathlib.Path(path).read_bytes()
  assert data[:4] == b":W&B", data[:8]
  out, buf, off = [], b"", 7                   # 7-byte file header: ":W&B", magic 0xBEE1, version
  while off + 7 <= len(data):
    left = BLOCK - off % BLOCK
    if left < 7:                               # a block's tail too short for a header is padding
      off += left
      continue
    _, length, kind = struct.unpack("<IHB", data[off:off + 7])
    if length == 0 and kind == 0:
      off += left
      continue
    payload, off = data[off + 7:off + 7 + length], off + 7 + length
    if kind == FULL:
      buf = payload
    elif kind == FIRST:
      buf = payload
      continue
    elif kind == MIDDLE:
      buf += payload
      continue
    else:
      buf += payload
    rec = pb.Record()
    rec.ParseFromString(buf)
    out.append(rec)
  return out


def offline_run(records) -> dict:
  """{run_id, history: {step: {key: value}}, config: {section: value}} of one offline run's records."""
  run = {"run_id": None, "history": {}, "config": {}}
  for rec in records:
    kind = rec.WhichOneof("record_type")
    if kind == "run":
      run["run_id"] = rec.run.run_id
    elif kind == "history":
      row = {(it.key or "/".join(it.nested_key)): json.loads(it.value_json) for it in rec.history.item}
      run["history"][int(row["_step"])] = row
    elif kind == "config":
      for it in rec.config.update:
        run["config"][it.key or "/".join(it.nested_key)] = json.loads(it.value_json)
  return run


def train(run_dir, steps: int, wandb_dir, *extra, env=None):
  return run_command(
      "sinkjax.train", "--config", REPO / "configs" / "tiny.yaml", "model.num_layers=1", "model.d_model=32",
      "model.head_dim=8", "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=8", f"train.steps={steps}",
      "train.log_every=2", "train.eval_every=3", "train.eval_batches=1", "checkpoint.every=3", f"run.dir={run_dir}",
      "logging.wandb=true", "logging.wandb_project=sinkjax-test", "logging.wandb_tags=[tiny,offline]", *extra,
      cwd=run_dir.parent, env={"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true",
                               "WANDB_CONSOLE": "off", **(env or {})})


def metrics(run_dir) -> dict:
  return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


# The resume (a second training command, ~9 s) is slow; by default the first run's W&B history is checked.
@pytest.mark.parametrize("resume", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_offline_run_holds_the_history_and_a_resume_continues_the_run_id(tmp_path, compile_cache, resume):
  run_dir, wandb_dir = tmp_path / "run", tmp_path / "wandb_dir"
  wandb_dir.mkdir()
  res = train(run_dir, 6, wandb_dir, env=compile_cache)      # the resume below reuses the compiled steps
  assert res.returncode == 0, res.stderr[-3000:]
  run_id = (run_dir / "wandb_id").read_text().strip()
  first = glob.glob(str(wandb_dir / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
  assert len(first) == 1, first
  one = offline_run(read_wandb_records(first[0]))
  assert one["run_id"] == run_id
  logged = metrics(run_dir)
  assert sorted(one["history"]) == sorted(logged) == [1, 2, 3, 4, 6]
  for step, rec in logged.items():
    row = one["history"][step]
    for key in ("loss", "ce_loss", "aux_loss", "head_imbalance", "grad_norm", "lr", "tokens_per_s", "tokens"):
      assert row[key] == pytest.approx(rec[key], rel=1e-12, abs=0), (step, key)
    assert ("val_bpb" in row) == ("val_bpb" in rec) and row.get("val_bpb") == pytest.approx(rec.get("val_bpb"))
    for l, heads in enumerate(rec["importance"]):
      for h, v in enumerate(heads):
        assert row[f"importance/layer{l}_head{h}"] == pytest.approx(v, rel=1e-12)
  cfg = one["config"]
  assert cfg["model"]["attention"] == "sink" and cfg["train"]["steps"] == 6
  assert cfg["logging"]["wandb_tags"] == ["tiny", "offline"] and cfg["run"]["dir"] == str(run_dir)

  if not resume:
    return
  # the same command with more steps resumes from the checkpoint of step 6 and continues the same W&B run
  res = train(run_dir, 10, wandb_dir, env=compile_cache)
  assert res.returncode == 0, res.stderr[-3000:]
  assert "resuming from step 6" in res.stdout
  assert (run_dir / "wandb_id").read_text().strip() == run_id
  files = sorted(glob.glob(str(wandb_dir / "wandb" / "offline-run-*" / "run-*.wandb")))
  assert len(files) == 2 and all(pathlib.Path(f).name == f"run-{run_id}.wandb" for f in files), files
  two = offline_run(read_wandb_records([f for f in files if f != first[0]][0]))
  assert two["run_id"] == run_id
  logged = metrics(run_dir)
  assert sorted(two["history"]) == [8, 9, 10] and sorted(logged) == [1, 2, 3, 4, 6, 8, 9, 10]
  for step in (8, 9, 10):
    assert two["history"][step]["loss"] == pytest.approx(logged[step]["loss"], rel=1e-12)
  assert two["config"]["train"]["steps"] == 10              # the resumed run's resolved config


def test_missing_wandb_is_one_line_naming_the_extra(tmp_path):
  code = ("import sys; sys.modules['wandb'] = None\n"
          "from sinkjax.train import main\n"
          f"sys.exit(main(['--config', {str(REPO / 'configs' / 'tiny.yaml')!r}, 'run.dir={tmp_path / 'run'}', "
          "'logging.wandb=true']))")
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert res.returncode == 1
  assert res.stderr.strip() == ("sinkjax.train: error: logging.wandb=true needs the wandb package: pip install "
                                "'sinkjax[wandb]'")
  assert not (tmp_path / "run").exists()                    # refused before anything was written
