"""Several processes on one machine (launch/local.sh, jax.distributed over 127.0.0.1 with the gloo CPU collectives):
the code path of a TPU pod or a SLURM job, minus the network.

A 2-process x 4-device run trains and logs each step once; its checkpoint evaluates in one process; the processes
agree on stopping (StopVote), so a SIGTERM to one of them saves the same step everywhere; the launcher ends the job
when a process dies and leaves no orphan; SFT data is split between processes. Runs of sinkjax.train under the
launcher take ~40 s each on a 2-core CPU, so only one is in the default suite; the others are marked slow.
Every subprocess is bounded by a timeout: a hang fails the test instead of stalling the suite.
"""
import itertools
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from sinkjax.run import read_metrics
from tests.helpers import losses, run_command

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = "configs/tiny.yaml"
OV = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=16",
      "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=8", "train.log_every=1", "train.eval_every=0",
      "train.eval_batches=1", "checkpoint.every=3"]


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


_DEFAULT_SIGINT_EXEC = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                        "os.execvp(sys.argv[1], sys.argv[1:])")


class Launch:
  """`launch/local.sh --processes N ...` in the background, its stdout / stderr in files (read while it runs)."""
  _count = itertools.count()

  def __init__(self, tmp, args, *, module=None, procs=2, devices=4, grace=30, env=None):
    n = next(self._count)
    self.out, self.err = tmp / f"launch{n}.out", tmp / f"launch{n}.err"
    cmd = ["bash", "launch/local.sh", "--processes", str(procs), "--devices-per-process", str(devices), "--port",
           str(free_port()), "--grace", str(grace), "--platform", "cpu"] + (["--module", module] if module else [])
    path = os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore",
           "TMPDIR": str(tmp), **(env or {})}     # the launcher's pipes: a killed launcher leaves them in tmp
    with open(self.out, "w") as out, open(self.err, "w") as err:
      # SIGINT at its default in the launcher, as a terminal gives it: a test run started in the background (`cmd &`
      # in a script, nohup) passes SIGINT down ignored, and bash cannot trap a signal ignored on entry.
      self.proc = subprocess.Popen([sys.executable, "-c", _DEFAULT_SIGINT_EXEC] + cmd + ["--", *args], cwd=ROOT,
                                   env=env, stdout=out, stderr=err, start_new_session=True)
    self.grace = grace

  def text(self) -> tuple[str, str]:
    return self.out.read_text(), self.err.read_text()

  def pids(self, timeout=60) -> list[int]:
    """The pids of the processes, from the launcher's start message."""
    deadline = time.time() + timeout
    while time.time() < deadline:
      m = re.search(r"pids ([\d ]+)", self.text()[1])
      if m:
        return [int(p) for p in m.group(1).split()]
      time.sleep(0.1)
    self.stop()
    pytest.fail(f"the launcher printed no pids: {self.text()}")

  def wait(self, timeout) -> tuple[int, str, str]:
    """(exit status, stdout, stderr); a launcher still running after `timeout` seconds is stopped and fails the test."""
    try:
      rc = self.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      state = _proc_state(self.proc.pid)            # what the launcher was doing (twice in CI: after its last line)
      self.stop()
      pytest.fail(f"the launcher was still running after {timeout}s ({state}): {self.text()}")
    time.sleep(0.2)       # the line printers write the last lines as the processes' pipes close
    return (rc, *self.text())

  def stop(self):
    self.proc.send_signal(signal.SIGTERM)      # passed on; after --grace the launcher kills what is left
    try:
      self.proc.wait(timeout=self.grace + 30)
    except subprocess.TimeoutExpired:
      os.killpg(self.proc.pid, signal.SIGKILL)


@pytest.fixture
def launch(tmp_path):
  """launch(args, **options) -> a started Launch; whatever still runs when the test ends is stopped."""
  runs = []

  def start(args, **kw):
    runs.append(Launch(tmp_path, args, **kw))
    return runs[-1]
  yield start
  for run in runs:
    if run.proc.poll() is None:
      run.stop()


def _proc_state(pid: int) -> str:
  """The kernel's view of a process and its children: state, wait channel, command line (for a failure message)."""
  out, children = [], pathlib.Path(f"/proc/{pid}/task/{pid}/children")
  for p in [pid] + ([int(c) for c in children.read_text().split()] if children.exists() else []):
    try:
      stat = pathlib.Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0]
      wchan = pathlib.Path(f"/proc/{p}/wchan").read_text()
      cmd = pathlib.Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
      out.append(f"pid {p} state {stat} wchan {wchan or '-'} cmd {cmd}")
    except OSError as e:
      out.append(f"pid {p}: {e}")
  return "; ".join(out)


def gone(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] == "Z"     # a zombie has ended
  except FileNotFoundError:
    return True


def wait_for(cond, timeout, what, launch=None):
  deadline = time.time() + timeout
  while time.time() < deadline:
    if cond():
      return
    time.sleep(0.1)
  if launch is not None:
    launch.stop()
  pytest.fail(f"timed out after {timeout}s waiting for {what}" + (f": {launch.text()}" if launch else ""))


def _steps(run_dir):
  d = pathlib.Path(run_dir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


# gloo's connection report, "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is :
# 1", printed from several threads at once: its pieces arrive cut and mixed, down to a lone "1" on a line of its own.
_GLOO_WORDS = {"[Gloo]", "Rank", "is", "connected", "to", "peer", "ranks", "Expected", "number", "of", ":", "."}


def _gloo_piece(line: str) -> bool:
  """True where the line holds nothing but words and numbers of gloo's connection report."""
  words = re.findall(r"\[Gloo\]|[A-Za-z]+|\d+|\S", line)
  return all(w in _GLOO_WORDS or w.isdigit() for w in words)


def _lines(text, tag):
  """The lines of process `tag` ("[p0]"), without the prefix, without the pieces of gloo's connection reports and
  without the empty lines they leave behind."""
  return [l[len(tag) + 1:] for l in text.splitlines()
          if l.startswith(tag + " ") and l[len(tag) + 1:].strip() and not _gloo_piece(l[len(tag) + 1:])]


def test_the_gloo_filter_keeps_every_line_of_ours():
  """The pieces seen in CI's logs are dropped; sinkjax's own lines, a step line included, are kept."""
  pieces = ["1", "[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1",
            "[Gloo] Rank [Gloo] Rank 0 is connected to 1", "peer ranks. Expected number of connected peer ranks is : 1"]
  ours = ["step 6: loss 3.2792  val_bpb 5.2416  head_imbalance 0.0288  329 tok/s", "done: step 6/6, loss 3.2792",
          "process 1 of 2", "resuming from step 4"]
  text = "\n".join(f"[p1] {l}" for l in pieces + ours)
  assert _lines(text, "[p1]") == ours


# ------------------------------------------------------------------------------------------------------------
# The launcher and the agreement, with a stand-in program (tests/multihost_worker.py)
# ------------------------------------------------------------------------------------------------------------

def test_the_launcher_shows_no_piece_of_gloo_s_report(launch):
  """launch/local.sh keeps gloo's connection reports, cut up as they reach it, out of the terminal, the lone number
  after one included; a process's own lines stay, a number alone and a line of the report's words among them (they
  follow a line of the process's own)."""
  rc, out, err = launch(["gloo"], module="multihost_worker", devices=1).wait(timeout=60)
  assert rc == 0, err
  for i in (0, 1):
    got = [l.split(" ", 1)[1] for l in out.splitlines() if l.startswith(f"[p{i}] ")]
    assert got == [f"process {i} is here", "1", "connected to 2 of 2"], out


def test_a_failing_process_ends_the_job(launch):
  """Process 1 exits with 3 while the others hang (ignoring SIGTERM): the launcher kills them after --grace and
  exits with 3."""
  t0 = time.time()
  run = launch(["fail"], module="multihost_worker", procs=3, devices=1, grace=2)
  pids = run.pids()
  rc, _, err = run.wait(timeout=60)
  assert rc == 3, err
  assert time.time() - t0 < 30
  assert "process 1 exited with status 3" in err and "killing the 2 process(es)" in err
  assert "Killed" not in err                         # bash's own job reports stay out of the output
  wait_for(lambda: all(gone(p) for p in pids), 10, "the hanging processes to be gone")


def test_sigterm_and_sigint_to_the_launcher_reach_every_process(launch):
  for sig, status in ((signal.SIGTERM, 143), (signal.SIGINT, 130)):
    run = launch(["term"], module="multihost_worker", devices=1, grace=10)
    wait_for(lambda: run.text()[0].count("ready") == 2, 60, "both processes to be ready", run)
    run.proc.send_signal(sig)
    rc, out, err = run.wait(timeout=180)     # CI on a loaded 2-core machine once took 61.6 s for both signals
    assert rc == status, err
    assert sorted(_lines(out, "[p0]") + _lines(out, "[p1]")) == \
        ["process 0 got SIGTERM", "process 1 got SIGTERM", "ready", "ready"], out


def test_processes_agree_on_a_signal_only_one_of_them_got(launch):
  """Two processes x 3 CPU devices join one job; process 1 alone votes SIGTERM and both read 15, then nobody does
  and both read None."""
  run = launch(["vote"], module="multihost_worker", devices=3)
  rc, out, err = run.wait(timeout=180)
  assert rc == 0, err
  for i in (0, 1):
    # only the report lines: a cut-up piece of gloo's multi-threaded chatter (e.g. a lone "5") may carry no marker
    reports = [l for l in _lines(out, f"[p{i}]") if l.startswith("process ")]
    assert reports == [f"process {i} of 2: 3 local devices of 6, votes 15 None"], out


def test_processes_stop_when_the_launcher_is_killed(tmp_path, launch):
  """No orphans: after a SIGKILL of the launcher, each process notices its parent is gone and stops itself with
  SIGTERM (so training would save, agreed, and exit)."""
  run = launch(["orphan", str(tmp_path)], module="multihost_worker", devices=1)
  pids = run.pids()
  wait_for(lambda: run.text()[0].count("ready") == 2, 120, "both processes to be ready", run)
  run.proc.kill()
  run.proc.wait(timeout=10)
  wait_for(lambda: all((tmp_path / f"stopped_{i}").is_file() for i in (0, 1)), 30, "both processes to stop")
  wait_for(lambda: all(gone(p) for p in pids), 10, "the processes to be gone")


# ------------------------------------------------------------------------------------------------------------
# Training
# ------------------------------------------------------------------------------------------------------------

def test_incomplete_process_settings_are_one_line():
  env = {**os.environ, "SINKJAX_NUM_PROCESSES": "2", "SINKJAX_PROCESS_ID": "0", "JAX_PLATFORMS": "cpu"}
  env.pop("SINKJAX_COORDINATOR", None)
  r = subprocess.run([sys.executable, "-m", "sinkjax.train", "--config", TINY], cwd=ROOT, env=env,
                     capture_output=True, text=True, timeout=120)
  assert r.returncode == 1 and r.stderr.strip().count("\n") == 0, r.stderr
  assert "SINKJAX_COORDINATOR not set" in r.stderr



def test_two_processes_train_log_once_and_evaluate_in_one(tmp_path, compile_cache, launch):
  """2 processes x 4 CPU devices train tiny.yaml: only process 0 prints and writes metrics / TensorBoard, each step
  once, the loss goes down, both processes' data-iterator states are in the checkpoint, and one process evaluates
  the checkpoint to the validation BPB the two computed together at the last step."""
  run_dir = tmp_path / "run"
  rc, out, err = launch(["--config", TINY, *OV, "train.steps=6", f"run.dir={run_dir}"],
                        env=compile_cache).wait(timeout=400)
  assert rc == 0, err
  assert len(_lines(out, "[p0]")) >= 2 and not _lines(out, "[p1]"), out     # process 1 prints nothing
  assert "[p0] done: step 6/6" in out and "all 2 processes finished" in err
  recs = read_metrics(run_dir / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]
  assert recs[-1]["loss"] < recs[0]["loss"] - 1.0, [r["loss"] for r in recs]
  assert len([p for p in (run_dir / "tb").iterdir() if p.name.startswith("events")]) == 1
  assert _steps(run_dir) == [3, 6]
  data = run_dir / "checkpoints" / "6" / "data"
  assert sorted(p.name for p in data.glob("process_*")) == ["process_0-of-2.json", "process_1-of-2.json"]

  r = run_command("sinkjax.eval", "--checkpoint", run_dir, "--batches", "1", env=compile_cache, timeout=300)
  assert r.returncode == 0, r.stderr
  report = json.loads((run_dir / "eval" / "report.json").read_text())
  # The eval batch is the training micro-batch of 8 rows: the 4 + 4 validation rows the two processes evaluated.
  assert report["step"] == 6 and report["val_bpb"] == pytest.approx(recs[-1]["val_bpb"], rel=1e-5)


def test_evaluation_rows_are_cut_to_one_length_in_every_process(launch):
  """eval.sized_batches cuts rows to the longest used row of ALL processes (rounded up to 64): process 0's rows use
  70 tokens, process 1's 150, so both cut to 192 (a per-process cut, 128 and 192, would give global arrays of two
  shapes)."""
  rc, out, err = launch(["--config", TINY], module="multihost_sized", devices=1).wait(timeout=300)
  assert rc == 0, err
  got = sorted((json.loads(line.split("]", 1)[1]) for line in out.splitlines() if '"seq_len"' in line),
               key=lambda g: g["process"])
  assert [g["process"] for g in got] == [0, 1], out
  assert [g["seq_len"] for g in got] == [192, 192] and all(g["shapes"] == [[4, 192]] for g in got), got


@pytest.mark.slow    # three 2-process runs and a refused single-process one: ~3 min on a 2-core CPU
def test_stop_and_resume_equals_the_uninterrupted_run(tmp_path, compile_cache, launch):
  ov = OV + ["train.steps=6", "loss.aux_weight=0.0001"]
  whole, part = tmp_path / "whole", tmp_path / "part"
  rc, _, err = launch(["--config", TINY, *ov, f"run.dir={whole}"], env=compile_cache).wait(400)
  assert rc == 0, err
  rc, _, err = launch(["--config", TINY, *ov, f"run.dir={part}", "train.stop_at_step=4"],
                      env=compile_cache).wait(400)
  assert rc == 0, err
  assert _steps(part) == [3, 4] and len(losses(part)) == 4
  rc, out, err = launch(["--config", TINY, *ov, f"run.dir={part}"], env=compile_cache).wait(400)
  assert rc == 0, err
  assert "resuming from step 4" in out
  assert losses(part) == losses(whole) and len(losses(whole)) == 6
  assert read_metrics(part / "metrics.jsonl")[-1]["val_bpb"] == read_metrics(whole / "metrics.jsonl")[-1]["val_bpb"]

  # One process cannot take over the two processes' data positions: refused in one line, checkpoint untouched.
  env = {**os.environ, **compile_cache, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  r = subprocess.run([sys.executable, "-m", "sinkjax.train", "--config", TINY, *OV, "train.steps=8",
                      f"run.dir={whole}"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  lines = [l for l in r.stderr.splitlines() if l.strip() and "WARNING" not in l]
  assert r.returncode == 1 and len(lines) == 1 and "another number of processes" in lines[0], r.stderr
  assert _steps(whole) == [3, 6]


@pytest.mark.slow    # ~1.5 min: a 2-process run, killed, and its rerun
def test_kill_9_of_one_process_ends_the_job_and_a_rerun_resumes(tmp_path, compile_cache, launch):
  run_dir = tmp_path / "run"
  ov = OV + ["checkpoint.every=2", "train.eval_batches=0"]
  run = launch(["--config", TINY, *ov, "train.steps=100000", f"run.dir={run_dir}"], env=compile_cache,
               grace=20)
  pids = run.pids()
  wait_for(lambda: len(_steps(run_dir)) >= 2, 300, "two checkpoints", run)
  t0 = time.time()
  os.kill(pids[1], signal.SIGKILL)
  rc, _, err = run.wait(timeout=120)
  assert rc != 0 and time.time() - t0 < 120, err
  assert "process 1 exited with status 137" in err
  wait_for(lambda: all(gone(p) for p in pids), 10, "no process left behind")

  last = _steps(run_dir)[-1]
  rc, out, err = launch(["--config", TINY, *ov, f"train.steps={last + 2}", f"run.dir={run_dir}"],
                        env=compile_cache).wait(400)
  assert rc == 0, err
  assert f"resuming from step {last}" in out and f"done: step {last + 2}/{last + 2}" in out
  assert [s for s, _ in losses(run_dir)] == list(range(1, last + 3))


@pytest.mark.slow    # ~1 min: one 2-process run
def test_sigterm_to_one_process_saves_the_same_step_everywhere(tmp_path, compile_cache, launch):
  run_dir = tmp_path / "run"
  ov = OV + ["checkpoint.every=1000", "train.eval_batches=0"]
  run = launch(["--config", TINY, *ov, "train.steps=100000", f"run.dir={run_dir}"], env=compile_cache)
  pids = run.pids()
  wait_for(lambda: len(losses(run_dir)) >= 3, 300, "three logged steps", run)
  os.kill(pids[1], signal.SIGTERM)
  rc, _, err = run.wait(timeout=120)
  assert rc == 128 + signal.SIGTERM, err
  stops = {i: re.findall(r"stopped by SIGTERM at step (\d+)", "\n".join(_lines(err, f"[p{i}]"))) for i in (0, 1)}
  assert len(stops[0]) == 1 and stops[0] == stops[1], err
  step = int(stops[0][0])
  assert _steps(run_dir) == [step] and losses(run_dir)[-1][0] == step
  assert sorted(p.name for p in (run_dir / "checkpoints" / str(step) / "data").glob("process_*")) == \
      ["process_0-of-2.json", "process_1-of-2.json"]


@pytest.mark.slow    # ~40 s: one 2-process run
def test_nonfinite_stop_is_the_same_in_every_process(tmp_path, compile_cache, launch):
  """The non-finite counter comes from the (global) step metrics: both processes stop at the same step."""
  ov = OV + ["train.optimizer=adamw", "train.adamw_lr=1e39", "train.max_nonfinite=2", "train.steps=20",
             f"run.dir={tmp_path / 'run'}"]
  rc, _, err = launch(["--config", TINY, *ov], env=compile_cache).wait(400)
  assert rc == 1, err
  for i in (0, 1):
    errors = [l for l in _lines(err, f"[p{i}]") if "error:" in l]
    assert len(errors) == 1 and "non-finite for 2 steps in a row (up to step 2)" in errors[0], err


# ------------------------------------------------------------------------------------------------------------
# SFT data per process
# ------------------------------------------------------------------------------------------------------------

def test_sft_batches_are_split_between_processes(tmp_path):
  """16 examples, one per row (12 train, 4 validation): with a global batch of 4, each training batch of the two
  processes holds disjoint rows whose union is the global batch of one process, and one epoch (3 global batches)
  visits every training row exactly once. Validation batches split the same way."""
  from sinkjax.config import DataConfig
  from sinkjax.data import build_tokenizer
  from sinkjax.data.sft import make_sft_eval_batches, make_sft_iterator, sft_rows
  recs = [{"prompt": f"question number {i:02d}", "response": f"answer {i:02d}"} for i in range(16)]
  (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
  cfg = DataConfig(source=str(tmp_path / "d.jsonl"), seq_len=40, val_fraction=0.25, prefetch=0)
  tok = build_tokenizer(cfg)
  train_rows = {r["inputs"].tobytes() for r in sft_rows(cfg, tok, "train")}
  assert len(train_rows) == 12                                  # one example per row
  key = lambda batch: [row.tobytes() for row in batch["inputs"]]
  its = [make_sft_iterator(cfg, tok, batch_size=2, seed=7, process_index=p, process_count=2) for p in (0, 1)]
  ref = make_sft_iterator(cfg, tok, batch_size=4, seed=7, process_index=0, process_count=1)
  epoch = []
  for _ in range(3):
    mine = [key(next(it)) for it in its]
    assert not set(mine[0]) & set(mine[1])
    assert mine[0] + mine[1] == key(next(ref))
    epoch += mine[0] + mine[1]
  assert sorted(epoch) == sorted(train_rows)

  val = [make_sft_eval_batches(cfg, tok, batch_size=1, num_batches=2, process_index=p, process_count=2)
         for p in (0, 1)]
  one = make_sft_eval_batches(cfg, tok, batch_size=2, num_batches=2, process_index=0, process_count=1)
  assert len(val[0]) == len(val[1]) == len(one) == 2
  for k in range(2):
    np.testing.assert_array_equal(np.concatenate([val[0][k]["inputs"], val[1][k]["inputs"]]), one[k]["inputs"])
