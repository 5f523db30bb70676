"""The tpu study (configs/studies/paper_tpu.yaml, `sinkjax.experiments.paper_tpu`): configs/paper/'s grid on a TPU slice, one launch per run through
launch/tpu_vm.sh, resumable from the bucket. Checked against a GCS emulator on 127.0.0.1 (the bucket) and the fake
gcloud of tests/test_launch.py (the slice: every SSH command runs here, as one worker, whose `python -m
sinkjax.train` is a stand-in that writes what a finished run leaves in the bucket); no network."""
import json
import os
import pathlib
import shlex
import subprocess
import sys

import pytest

from sinkjax.experiments import study as study_cmd
from tests import gcs_emulator
from tests.helpers import call_main, one_error_line
from tests.test_launch import FAKE_GCLOUD

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(gcs_emulator.missing() is not None, reason=str(gcs_emulator.missing()))
STUDY = ROOT / "configs" / "studies" / "paper_tpu.yaml"
SLICE = ["tpu.name=sj", "tpu.zone=us-central1-a"]


@pytest.fixture
def gcs():
  em = gcs_emulator.Emulator(buckets=("bucket",))
  yield em
  em.stop()


# The worker's `python -m sinkjax.train ARGS`: records ARGS and leaves in the bucket what a run of train.steps
# leaves there (its resolved config.yaml and a complete checkpoint at the last step, Orbax's GCS commit marker);
# any other use of the interpreter is the real one (the worker's setup calls pip: recorded, not run).
FAKE_TRAIN = r"""
import json, os, sys, urllib.parse, urllib.request
args = sys.argv[1:]
with open(os.path.join(os.environ["FAKE"], "train_calls"), "a") as f:
  f.write(json.dumps(args) + "\n")
kv = dict(a.split("=", 1) for a in args if "=" in a and not a.startswith("-"))
bucket, prefix = kv["run.dir"][len("gs://"):].split("/", 1)
steps = int(kv["train.steps"])
def put(name, data):
  url = (os.environ["STORAGE_EMULATOR_HOST"] + f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name="
         + urllib.parse.quote(f"{prefix}/{name}", safe=""))
  urllib.request.urlopen(urllib.request.Request(url, data=data, method="POST")).read()
put("config.yaml", f"train:\n  steps: {steps}\n".encode())
put(f"checkpoints/{steps}/commit_success.txt", b"")
"""
FAKE_PYTHON = """#!/usr/bin/env bash
if [[ "${1:-} ${2:-}" == "-m pip" ]]; then echo "$*" >> "$FAKE/pip"; exit 0; fi
if [[ "${1:-} ${2:-}" == "-m sinkjax.train" ]]; then shift 2; exec %(py)s "$FAKE/fake_train.py" "$@"; fi
exec %(py)s "$@"
"""


def _paper(em, *args, fake=None, timeout=300):
  env = {k: v for k, v in os.environ.items() if k not in ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")}
  env.update(em.env)
  if fake is not None:
    env.update(FAKE=str(fake), PATH=f"{fake / 'bin'}:{env['PATH']}")
  return subprocess.run([sys.executable, "-m", "sinkjax.experiments.study", str(STUDY), *map(str, args)],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _finished(em, name, steps, latest=None):
  """What a run of `steps` steps leaves in the bucket once it has checkpointed step `latest` (default: the last)."""
  em.upload("bucket", f"runs/{name}/config.yaml", f"train:\n  steps: {steps}\n".encode())
  em.upload("bucket", f"runs/{name}/checkpoints/{latest or steps}/commit_success.txt", b"")


def test_dry_run_prints_one_babysit_launch_per_config_and_skips_finished_runs(gcs):
  r = _paper(gcs, "study.out=gs://bucket", *SLICE, "--dry-run")
  assert r.returncode == 0, r.stderr
  lines = [l for l in r.stdout.splitlines() if l.startswith("[")]
  configs = sorted(p.stem for p in (ROOT / "configs" / "paper").glob("d*_*_*.yaml"))
  assert len(configs) == 18 and len(lines) == 18
  assert sorted(l.split("]", 1)[1].split(":")[0].strip() for l in lines) == configs
  for line in lines:
    name = line.split("]", 1)[1].split(":")[0].strip()
    cmd = shlex.split(line.split(" -> ", 1)[1])
    assert cmd[:3] == ["bash", "launch/tpu_vm.sh", "babysit"], cmd
    assert cmd[cmd.index("--job") + 1] == name and cmd[cmd.index("--type") + 1] == "v5litepod-32"
    assert cmd[cmd.index("--") + 1:] == [
        "--config", f"configs/paper/{name}.yaml", f"run.dir=gs://bucket/runs/{name}",
        "data.source=gs://bucket/data/fineweb-edu/shard_*.parquet",
        "data.val_source=gs://bucket/data/fineweb-edu/val/shard_01822.parquet",
        "data.tokenizer=gs://bucket/data/tokenizer/tokenizer.json"]
    assert "to do ->" in line, line
  # The sizes in order, each size's six runs in the configs' variant / loss order.
  assert [l.split("]", 1)[1].split(":")[0].strip() for l in lines][:6] == [
      "d20_vanilla_base", "d20_vanilla_aux", "d20_sink_base", "d20_sink_aux", "d20_gated_base", "d20_gated_aux"]
  # What the bucket holds decides: a finished run is skipped, a started one resumes from its checkpoint.
  _finished(gcs, "d20_sink_base", 21400)
  _finished(gcs, "d20_sink_aux", 21400, latest=8000)
  r = _paper(gcs, "study.out=gs://bucket", *SLICE, "axes.size=[d20]", "axes.variant=[sink]", "axes.seed=[0,1]",
             "--dry-run")
  assert r.returncode == 0, r.stderr
  lines = [l for l in r.stdout.splitlines() if l.startswith("[")]
  assert lines[0] == "[1/4] d20_sink_base: finished at step 21400, skipped"
  assert lines[1].startswith("[2/4] d20_sink_aux: resumes from step 8000 of 21400 -> bash launch/tpu_vm.sh")
  assert lines[2].startswith("[3/4] d20_sink_base_s1: to do -> ") and lines[2].endswith(" train.seed=1")
  assert "1 of 4 runs finished in gs://bucket/runs" in r.stdout


def test_grid_errors_are_one_line(capsys):
  cases = {("study.out=runs/paper", *SLICE): "the tpu study needs study.out=gs://BUCKET",
           ("study.out=gs://bucket", "tpu.zone=z"): "the tpu study needs tpu.name",
           ("study.out=gs://bucket", *SLICE, "axes.size=[d40]"): "axis size: a subset of d20, d26, d32",
           ("study.out=gs://bucket", *SLICE, "tpu.data=data"): "tpu.data must be in the bucket",
           ("study.out=gs://bucket", *SLICE, "axes.depth=[1]"): "the tpu study's axes are seed, size, variant, loss"}
  for args, msg in cases.items():
    assert msg in one_error_line(call_main(study_cmd.main, [STUDY, *args, "--dry-run"], capsys)), args


def test_report_only_is_table1_of_the_finished_runs(gcs, tmp_path):
  """--report-only launches nothing: Table 1 and Figs. 5 / 8 of the runs in OUT/runs, in OUT/report
  (`paper_report.runs_report`); one line when there are none."""
  r = _paper(gcs, "study.out=gs://bucket", "--report-only")
  assert r.returncode == 1 and "matches no run directory" in r.stderr, r.stderr
  gcs.upload("bucket", "runs/d20_sink_base/config.yaml", b"model: {attention: sink, num_layers: 20}\n")
  r = _paper(gcs, "study.out=gs://bucket", "--report-only")
  assert r.returncode == 0 and "| Sink | base |" in r.stdout, r.stderr
  assert "| Sink | base |" in gcs.read("bucket", "report/table1.md").decode()
  assert {"report/table1.json", "report/fig5_imbalance.png", "report/fig8_loss_bpb.png"} <= set(gcs.objects())


def test_grid_launches_through_tpu_vm_sh_and_resumes_where_the_bucket_says(gcs, tmp_path):
  """Two runs, one finished already: one launch (babysit on the fake slice: set up, started, finished), with the
  bucket's data, tokenizer and run dir; the rerun launches nothing. Missing data stops the grid before any launch."""
  (tmp_path / "bin").mkdir()
  (tmp_path / "bin" / "gcloud").write_text(FAKE_GCLOUD)
  venv = tmp_path / "home" / "sinkjax-venv" / "bin"
  venv.mkdir(parents=True)
  (venv / "python").write_text(FAKE_PYTHON % {"py": shlex.quote(sys.executable)})
  (tmp_path / "fake_train.py").write_text(FAKE_TRAIN)
  for f in (tmp_path / "bin" / "gcloud", venv / "python"):
    f.chmod(0o755)
  grid = ["study.out=gs://bucket", *SLICE, "axes.size=[d20]", "axes.variant=[sink]", "tpu.steps=3", "tpu.interval=0"]
  # No data in the bucket: one line naming what stages it, nothing launched.
  r = _paper(gcs, *grid, fake=tmp_path)
  assert r.returncode == 1 and "no tokenizer at gs://bucket/data/tokenizer/tokenizer.json" in r.stderr, r.stderr
  gcs.upload("bucket", "data/tokenizer/tokenizer.json", b"{}")
  gcs.upload("bucket", "data/fineweb-edu/val/shard_01822.parquet", b"")
  r = _paper(gcs, *grid, fake=tmp_path)
  assert r.returncode == 1 and ("0 training shards in gs://bucket/data/fineweb-edu, d20_sink_base reads 1: python -m "
                                "sinkjax.data.fineweb --tokens-for configs/paper/d20_sink_base.yaml --out "
                                "gs://bucket/data/fineweb-edu") in r.stderr, r.stderr
  assert not (tmp_path / "calls").exists()
  gcs.upload("bucket", "data/fineweb-edu/shard_00000.parquet", b"")
  _finished(gcs, "d20_sink_base", 3)
  r = _paper(gcs, *grid, fake=tmp_path)
  assert r.returncode == 0, (r.stdout, r.stderr)
  assert "[1/2] d20_sink_base: finished at step 3, skipped" in r.stdout
  assert "[2/2] d20_sink_aux: finished at step 3" in r.stdout and "every run finished" in r.stdout
  trains = [json.loads(l) for l in (tmp_path / "train_calls").read_text().splitlines()]
  assert trains == [["--config", "configs/paper/d20_sink_aux.yaml", "run.dir=gs://bucket/runs/d20_sink_aux",
                     "data.source=gs://bucket/data/fineweb-edu/shard_*.parquet",
                     "data.val_source=gs://bucket/data/fineweb-edu/val/shard_01822.parquet",
                     "data.tokenizer=gs://bucket/data/tokenizer/tokenizer.json", "train.steps=3"]]
  calls = (tmp_path / "calls").read_text()
  assert "tpu_worker.sh start d20_sink_aux" in calls and "d20_sink_base" not in calls   # one launch, the unfinished
  assert (tmp_path / "home" / "sinkjax" / "configs" / "paper" / "d20_sink_aux.yaml").is_file()   # set up by babysit
  before = calls
  r = _paper(gcs, *grid, fake=tmp_path)
  assert r.returncode == 0 and "2 of 2 runs finished" in r.stdout, r.stderr
  assert (tmp_path / "calls").read_text() == before                                  # nothing launched again
