"""Runs in a bucket (issue 21): run.dir, data and checkpoints on gs://, against a GCS emulator on 127.0.0.1.

Every client is pointed at the emulator through its own setting (tests/gcs_emulator.py), set before the
subprocess starts; the bucket's contents are read back through the emulator's JSON API, not through the code under
test. References are the same commands on a local run directory."""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from tests import gcs_emulator
from tests.helpers import one_error_line

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
SMALL = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=32",
         "model.max_seq_len=64", "data.seq_len=64", "train.batch_size=4", "train.eval_batches=1", "train.log_every=1",
         "train.eval_every=0", "checkpoint.every=2", "checkpoint.async_save=false"]

pytestmark = pytest.mark.skipif(gcs_emulator.missing() is not None, reason=str(gcs_emulator.missing()))


@pytest.fixture(scope="module")
def gcs():
  em = gcs_emulator.Emulator(buckets=("bucket",))
  yield em
  em.stop()


def _env(em=None, **extra) -> dict:
  env = {k: v for k, v in os.environ.items()
         if k not in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "XLA_FLAGS")}   # one CPU device
  env.update(em.env if em is not None else {})
  env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
  env.update(extra)
  return env


def _run(module: str, args: list[str], cwd, em=None, timeout: int = 600, **extra) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=_env(em, **extra), capture_output=True,
                        text=True, timeout=timeout)


def _losses(text: str) -> dict[int, float]:
  return {r["step"]: r["loss"] for r in (json.loads(line) for line in text.splitlines() if line.strip())}


@pytest.mark.slow   # the whole CLI cycle against the emulator, 5 commands (~90 s); by default the bucket's errors are checked
def test_train_stop_resume_and_eval_in_a_bucket(gcs, tmp_path):
  """A run stopped at step 2 and resumed from gs:// logs the losses of an uninterrupted local run; config.yaml,
  metrics.jsonl, TensorBoard events, plots and checkpoints are objects in the bucket, nothing lands in a local
  'gs:' folder; eval reads the run from the bucket and writes its report there."""
  ref = _run("sinkjax.train", ["--config", TINY, f"run.dir={tmp_path / 'local'}", "train.steps=4", *SMALL], tmp_path)
  assert ref.returncode == 0, ref.stderr[-3000:]
  want = _losses((tmp_path / "local" / "metrics.jsonl").read_text())

  url = "gs://bucket/r1"
  first = _run("sinkjax.train", ["--config", TINY, f"run.dir={url}", "train.steps=4", "train.stop_at_step=2", *SMALL],
               tmp_path, gcs)
  assert first.returncode == 0, first.stderr[-3000:]
  assert "r1/checkpoints/2/commit_success.txt" in gcs.objects()
  second = _run("sinkjax.train", ["--config", TINY, f"run.dir={url}", "train.steps=4", *SMALL], tmp_path, gcs)
  assert second.returncode == 0, second.stderr[-3000:]
  assert "resuming from step 2" in second.stdout

  got = _losses(gcs.read("bucket", "r1/metrics.jsonl").decode())
  assert sorted(got) == sorted(want) == [1, 2, 3, 4]
  for step, loss in want.items():
    assert got[step] == pytest.approx(loss, rel=1e-6, abs=1e-6), step
  names = gcs.objects()
  for name in ("r1/config.yaml", "r1/loss.png", "r1/importance.png", "r1/head_imbalance.png",
               "r1/checkpoints/4/commit_success.txt"):
    assert name in names
  assert any(n.startswith("r1/tb/events.out.tfevents") for n in names)
  assert gcs.read("bucket", "r1/loss.png")[:8] == b"\x89PNG\r\n\x1a\n"
  assert not list(tmp_path.glob("gs*")), list(tmp_path.iterdir())

  ev = _run("sinkjax.eval", ["--checkpoint", url, "--batches", "1", "--batch-size", "2"], tmp_path, gcs)
  assert ev.returncode == 0, ev.stderr[-3000:]
  ev_local = _run("sinkjax.eval", ["--checkpoint", str(tmp_path / "local"), "--batches", "1", "--batch-size", "2"],
                  tmp_path)
  assert ev_local.returncode == 0, ev_local.stderr[-3000:]
  report = json.loads(gcs.read("bucket", "r1/eval/report.json"))
  local_report = json.loads((tmp_path / "local" / "eval" / "report.json").read_text())
  assert report["step"] == 4 and report["run_dir"] == url
  assert report["val_bpb"] == pytest.approx(local_report["val_bpb"], rel=1e-6)
  assert "r1/eval/report.md" in gcs.objects()
  assert not list(tmp_path.glob("gs*"))


@pytest.mark.parametrize("run_dir, needle", [
    ("gs://no-such-bucket/r", "bucket gs://no-such-bucket does not exist"),
    ("hdfs://cluster/r", "unsupported URL scheme hdfs://"),
    ("gs:///r", "names no bucket"),
])
def test_bad_urls_are_one_line_errors(gcs, tmp_path, run_dir, needle):
  r = _run("sinkjax.train", ["--config", TINY, f"run.dir={run_dir}", "train.steps=1", *SMALL], tmp_path, gcs)
  line = one_error_line(r)
  assert line.startswith("sinkjax.train: error:") and needle in line, line
  assert not list(tmp_path.iterdir())          # nothing written locally (no 'gs:' or 'hdfs:' folder)


def test_missing_credentials_is_a_one_line_error(tmp_path):
  """Without an emulator and without usable credentials (a key file that does not exist), the run stops before
  writing anything, naming the fix."""
  r = _run("sinkjax.train", ["--config", TINY, "run.dir=gs://bucket/r", "train.steps=1", *SMALL], tmp_path,
           GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "missing-key.json"), timeout=300)
  line = one_error_line(r)
  assert "no Google Cloud credentials" in line and "GOOGLE_APPLICATION_CREDENTIALS" in line, line
  assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("module, args, flag", [
    ("sinkjax.eval", ["--checkpoint", "gs://bucket/r"], "--checkpoint"),
    ("sinkjax.generate", ["generate", "--checkpoint", "gs://bucket/r", "--prompt", "hi", "--max-new-tokens", "1"],
     "--checkpoint"),
])
def test_missing_credentials_name_the_flag_whose_path_failed(tmp_path, module, args, flag):
  r = _run(module, args, tmp_path, GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "missing-key.json"), timeout=300)
  line = one_error_line(r)
  assert f"{flag} 'gs://bucket/r': no Google Cloud credentials" in line, line


def test_missing_client_library_names_the_extra(monkeypatch):
  from sinkjax import paths
  monkeypatch.setitem(paths.REMOTE_SCHEMES, "gs", ("sinkjax_no_such_module", "pip install 'sinkjax[gcs]'"))
  with pytest.raises(paths.StorageError, match=r"needs the sinkjax_no_such_module package.*sinkjax\[gcs\]"):
    paths.as_path("gs://bucket/run", "run.dir")
  assert paths.as_path("runs/x").name == "x"      # local paths never need it
  assert not paths.is_remote("runs/x") and paths.scheme("s3://b/x") == "s3"


@pytest.mark.slow
def test_kill_and_resume_in_a_bucket(gcs, tmp_path):
  """kill -9 during training into gs://, then the same command: it resumes from the last committed checkpoint,
  finishes, and metrics.jsonl holds every step once, with the losses of an uninterrupted local run."""
  args = ["--config", TINY, "train.steps=40", *SMALL]
  ref = _run("sinkjax.train", [*args, f"run.dir={tmp_path / 'local'}"], tmp_path)
  assert ref.returncode == 0, ref.stderr[-3000:]
  want = _losses((tmp_path / "local" / "metrics.jsonl").read_text())
  proc = subprocess.Popen([sys.executable, "-m", "sinkjax.train", *args, "run.dir=gs://bucket/k1"], cwd=tmp_path,
                          env=_env(gcs), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 300
    while not any(n.startswith("k1/checkpoints/") and n.endswith("/commit_success.txt") and
                  n.split("/")[2] not in ("2",) for n in gcs.objects()):
      assert proc.poll() is None and time.time() < deadline, "training ended or stalled before its 2nd checkpoint"
      time.sleep(0.2)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  again = _run("sinkjax.train", [*args, "run.dir=gs://bucket/k1"], tmp_path, gcs)
  assert again.returncode == 0, again.stderr[-3000:]
  assert "resuming from step" in again.stdout
  lines = [json.loads(x) for x in gcs.read("bucket", "k1/metrics.jsonl").decode().splitlines() if x.strip()]
  assert [r["step"] for r in lines] == list(range(1, 41))
  for r in lines:
    assert r["loss"] == pytest.approx(want[r["step"]], rel=1e-6, abs=1e-6), r["step"]


@pytest.mark.slow
def test_data_generate_and_convert_from_a_bucket(gcs, tmp_path):
  """data.source=gs://bucket/docs/*.jsonl trains like the same files on disk; generate's perplexity reads the run and
  its FILE from the bucket; the Hugging Face converter exports to and imports from gs://."""
  docs = tmp_path / "docs"
  docs.mkdir()
  for i in range(3):
    text = "".join(json.dumps({"text": f"document {i}.{j}: " + "the sink takes the attention. " * (5 + j)}) + "\n"
                   for j in range(40))
    (docs / f"part{i}.jsonl").write_text(text)
    gcs.upload("bucket", f"docs/part{i}.jsonl", text.encode())
  gcs.upload("bucket", "docs/notes.md", b"not data")          # not matched by the glob
  args = ["--config", TINY, "train.steps=2", *SMALL, "model.attention=vanilla", "model.mlp=swiglu",  # exportable
          "model.embed_norm=false", "model.logit_softcap=0"]
  ref = _run("sinkjax.train", [*args, f"data.source={docs}/*.jsonl", f"run.dir={tmp_path / 'local'}"], tmp_path)
  assert ref.returncode == 0, ref.stderr[-3000:]
  r = _run("sinkjax.train", [*args, "data.source=gs://bucket/docs/*.jsonl", "run.dir=gs://bucket/d1"], tmp_path, gcs)
  assert r.returncode == 0, r.stderr[-3000:]
  got = _losses(gcs.read("bucket", "d1/metrics.jsonl").decode())
  want = _losses((tmp_path / "local" / "metrics.jsonl").read_text())
  assert got == pytest.approx(want, rel=1e-6)

  gcs.upload("bucket", "texts/ppl.txt", b"the sink takes the attention. " * 20)
  (tmp_path / "ppl.txt").write_bytes(b"the sink takes the attention. " * 20)
  g = _run("sinkjax.generate", ["perplexity", "gs://bucket/texts/ppl.txt", "--checkpoint", "gs://bucket/d1"], tmp_path,
           gcs)
  g_local = _run("sinkjax.generate", ["perplexity", str(tmp_path / "ppl.txt"), "--checkpoint", str(tmp_path / "local")],
                 tmp_path)
  assert g.returncode == 0 and g_local.returncode == 0, g.stderr[-3000:] + g_local.stderr[-3000:]
  table = lambda out: [line for line in out.splitlines() if line.startswith("|")]  # noqa: E731  (header names paths)
  assert table(g.stdout) and table(g.stdout) == table(g_local.stdout)

  ex = _run("sinkjax.convert.hf", ["--export", "gs://bucket/d1", "--out", "gs://bucket/hf/d1"], tmp_path, gcs)
  assert ex.returncode == 0, ex.stderr[-3000:]
  assert {"hf/d1/config.json", "hf/d1/model.safetensors"} <= set(gcs.objects())
  im = _run("sinkjax.convert.hf", ["--hf-dir", "gs://bucket/hf/d1", "--out", "gs://bucket/d1-imported",
                                   "--dtype", "float32"], tmp_path, gcs)
  assert im.returncode == 0, im.stderr[-3000:]
  g2 = _run("sinkjax.generate", ["perplexity", "gs://bucket/texts/ppl.txt", "--checkpoint", "gs://bucket/d1-imported"],
            tmp_path, gcs)
  assert g2.returncode == 0, g2.stderr[-3000:]
  assert table(g2.stdout) == table(g.stdout)
  ft = _run("sinkjax.train", [*args, "train.steps=1", "train.init_from=gs://bucket/d1-imported",
                              "run.dir=gs://bucket/ft"], tmp_path, gcs)
  assert ft.returncode == 0, ft.stderr[-3000:]
  assert "from gs://bucket/d1-imported" in ft.stdout
  assert "ft/checkpoints/1/commit_success.txt" in gcs.objects()
  assert not list(tmp_path.glob("gs*"))


@pytest.mark.slow
def test_two_processes_share_a_bucket_run(gcs, tmp_path):
  """launch/local.sh with 2 processes x 2 devices and run.dir=gs://: one checkpoint holds both processes' shards
  and data states, process 0 alone writes metrics.jsonl / config / TensorBoard, and eval reads the run back."""
  r = subprocess.run(["bash", str(ROOT / "launch" / "local.sh"), "--processes", "2", "--devices-per-process", "2",
                      "--", "--config", TINY, "run.dir=gs://bucket/mh", "train.steps=4", "train.eval_every=4",
                      *SMALL], cwd=tmp_path, env=_env(gcs), capture_output=True, text=True, timeout=900)
  assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
  names = set(gcs.objects())
  for p in (0, 1):
    assert f"mh/checkpoints/4/data/process_{p}-of-2.json" in names
    assert f"mh/checkpoints/4/params/array_metadatas/process_{p}" in names
  assert "mh/checkpoints/4/commit_success.txt" in names
  assert len([n for n in names if n.startswith("mh/tb/")]) == 1
  records = [json.loads(x) for x in gcs.read("bucket", "mh/metrics.jsonl").decode().splitlines() if x.strip()]
  assert [rec["step"] for rec in records] == [1, 2, 3, 4]
  ev = _run("sinkjax.eval", ["--checkpoint", "gs://bucket/mh", "--batches", "1", "--batch-size", "4"], tmp_path, gcs)
  assert ev.returncode == 0, ev.stderr[-3000:]
  assert json.loads(gcs.read("bucket", "mh/eval/report.json"))["step"] == 4
  assert not list(tmp_path.glob("gs*"))


@pytest.mark.slow
def test_paper_study_writes_to_a_bucket_and_resumes_from_it(gcs, tmp_path):
  """A paper study with study.out=gs://... makes its runs in a local mirror, uploads each finished run and the
  results; a rerun from an empty mirror (another machine) finds the finished run in the bucket and skips it."""
  argv = [str(ROOT / "configs" / "studies" / "paper_smoke.yaml"), "axes.model.attention=[sink]", "axes.train.seed=[0]",
          "study.out=gs://bucket/study"]
  first = _run("sinkjax.experiments.study", argv, tmp_path, gcs, SINKJAX_MIRROR_DIR=str(tmp_path / "m1"))
  assert first.returncode == 0, first.stderr[-3000:]
  names = set(gcs.objects())
  for name in ("study/results.json", "study/results.md", "study/table1_bpb.png", "study/runs/sink_base_s0/done.json",
               "study/runs/sink_aux_s0/paper_eval.json", "study/runs/sink_aux_s0/metrics.jsonl"):
    assert name in names, name
  again = _run("sinkjax.experiments.study", argv, tmp_path, gcs, SINKJAX_MIRROR_DIR=str(tmp_path / "m2"))
  assert again.returncode == 0, again.stderr[-3000:]
  assert again.stdout.count("done before, skipped") == 2, again.stdout
  assert json.loads(gcs.read("bucket", "study/results.json"))["runs"]
  assert not list(tmp_path.glob("gs*"))
