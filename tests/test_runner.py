"""The study runner (`sinkjax.experiments.runner`) on a toy study of three runs whose `do` writes files instead of
training: finished runs are skipped, an interrupted run resumes from what it left, a run another process holds is
skipped and made later, records carry the study's commit and runs of two commits are refused in one line, and each
run's raw files (not its checkpoints) are copied to RAW/NAME. The drivers' old commands name the study file that
replaced them and fail."""
import json
import subprocess
import sys

import pytest

from sinkjax.experiments import runner

NAMES = ("a", "b", "c")
RAW = ("record.json", "metrics.jsonl", "config.yaml")
COMMIT = {"commit": "abc123", "dirty": False}


class Toy:
  """Runs of 4 "steps" each: `do` appends one metrics line per step and keeps a partial marker (the step reached)
  as training keeps checkpoints; `interrupt` names runs that stop after 2 steps the first time (a killed process)."""

  def __init__(self, interrupt=()):
    self.calls, self.interrupt = [], set(interrupt)

  def run(self, name):
    def do(run_dir):
      self.calls.append(name)
      partial = run_dir / "partial.json"
      start = json.loads(partial.read_text())["step"] if partial.is_file() else 0
      (run_dir / "config.yaml").write_text(f"name: {name}\n")
      (run_dir / "checkpoints").mkdir(exist_ok=True)
      (run_dir / "checkpoints" / "state").write_text("big")
      for step in range(start + 1, 5):
        with open(run_dir / "metrics.jsonl", "a") as f:
          f.write(json.dumps({"step": step}) + "\n")
        partial.write_text(json.dumps({"step": step}))
        if step == 2 and name in self.interrupt:
          self.interrupt.discard(name)
          raise KeyboardInterrupt
      return {"name": name, "steps": 4, "started_at": start}, "made"
    return runner.Run(name, do, (f"train.seed={NAMES.index(name)}",))

  def runs(self):
    return [self.run(n) for n in NAMES]


def study(tmp_path, commit=COMMIT):
  return runner.Study(tmp_path / "out", raw=tmp_path / "raw", raw_files=RAW, commit=commit)


def test_walks_in_order_stamps_the_commit_and_skips_finished_runs(tmp_path):
  toy, seen = Toy(), []
  results = study(tmp_path).walk(toy.runs(), lambda i, n, r: seen.append((i, n, r.run.name, r.what)))
  assert toy.calls == ["a", "b", "c"] and seen == [(1, 3, "a", "made"), (2, 3, "b", "made"), (3, 3, "c", "made")]
  for r in results:
    rec = json.loads((tmp_path / "out" / "runs" / r.run.name / "record.json").read_text())
    assert rec == r.record == {"name": r.run.name, "steps": 4, "started_at": 0, "commit": "abc123", "dirty": False}
    assert not (tmp_path / "out" / "runs" / r.run.name / f".{r.run.name}.lock").exists()   # the lock went with it
  again = study(tmp_path).walk(toy.runs())
  assert toy.calls == ["a", "b", "c"]                                   # nothing made twice
  assert [r.what for r in again] == [runner.SKIPPED] * 3 and not any(r.ran for r in again)
  assert [r.record for r in again] == [r.record for r in results]


def test_an_interrupted_run_resumes_where_it_stopped(tmp_path):
  toy = Toy(interrupt={"b"})
  with pytest.raises(KeyboardInterrupt):
    study(tmp_path).walk(toy.runs())
  s = study(tmp_path)
  assert [s.state(n) for n in NAMES] == ["done", "started", "to do"]
  assert not (tmp_path / "out" / "runs" / "b" / "record.json").exists()
  assert not (tmp_path / "out" / "runs" / "b" / ".b.lock").exists()     # released on the way out
  results = s.walk(toy.runs())
  assert toy.calls == ["a", "b", "b", "c"]
  b = results[1]
  assert b.ran and b.resumed and b.record["started_at"] == 2 and not results[2].resumed
  steps = [json.loads(l)["step"] for l in (tmp_path / "out" / "runs" / "b" / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2, 3, 4]                                          # steps 1-2 once, then 3-4 after the resume


def test_a_run_locked_by_another_process_is_skipped_then_made(tmp_path):
  lock = tmp_path / "out" / "runs" / "b" / ".b.lock"
  lock.parent.mkdir(parents=True)
  holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                             "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)", str(lock)],
                            stdout=subprocess.PIPE, text=True)
  toy = Toy()
  try:
    assert holder.stdout.readline().strip() == "locked"
    results = study(tmp_path).walk(toy.runs())
    assert toy.calls == ["a", "c"]
    assert results[1].what == runner.LOCKED and results[1].record is None and not results[1].ran
    assert not (tmp_path / "raw" / "b").exists()
  finally:
    holder.kill()
    holder.wait()
  results = study(tmp_path).walk(toy.runs())                            # the holder is gone: b is made now
  assert toy.calls == ["a", "c", "b"] and [r.ran for r in results] == [False, True, False]


def test_runs_of_two_commits_are_refused_in_one_line(tmp_path):
  toy = Toy()
  study(tmp_path).walk(toy.runs()[:2])
  study(tmp_path, {"commit": "def456", "dirty": True}).walk(toy.runs())
  s = study(tmp_path)
  records = list(s.records(NAMES).values())
  assert [r["commit"] for r in records] == ["abc123", "abc123", "def456"]
  with pytest.raises(runner.StudyError) as e:
    runner.one_commit(records)
  msg = str(e.value)
  assert "\n" not in msg and "abc123: a, b" in msg and "def456: c" in msg
  assert runner.one_commit(records[:2]) == "abc123" and runner.one_commit([]) is None


def test_raw_files_are_the_runs_own_files_without_checkpoints(tmp_path):
  study(tmp_path).walk(Toy().runs())
  for n in NAMES:
    raw, run_dir = tmp_path / "raw" / n, tmp_path / "out" / "runs" / n
    assert sorted(p.name for p in raw.iterdir()) == sorted(RAW)
    for f in RAW:
      assert (raw / f).read_bytes() == (run_dir / f).read_bytes()


def test_a_record_do_writes_itself_is_kept_and_runs_may_be_files(tmp_path):
  """The paper study's `do` leaves its record to the runner unstamped; the streaming study keeps one file per run
  (layout "."): a record file in the study's own directory."""
  def do(run_dir):
    (run_dir / "x.json").write_text(json.dumps({"own": 1}))
    return {"returned": 1}, "made"
  s = runner.Study(tmp_path, layout=".", record="{name}.json", stamp=False, commit=COMMIT)
  r = s.walk_one(runner.Run("x", do))
  assert r.record == {"returned": 1} and json.loads((tmp_path / "x.json").read_text()) == {"own": 1}
  r = s.walk_one(runner.Run("y", lambda d: ({"y": 2}, "made")))
  assert json.loads((tmp_path / "y.json").read_text()) == {"y": 2}      # stamp=False: no commit added
  assert s.state("y") == "done" and s.state("z") == "to do" and sorted(p.name for p in tmp_path.iterdir()) == [
      "x.json", "y.json"]


def test_a_study_without_a_recipe_reads_its_drivers_own_section(tmp_path):
  """configs/studies/streaming_real.yaml trains nothing: no base:, a `streaming:` section its driver declares with
  declare(); overrides reach that section and the axes; a section or config key the driver does not read is one error."""
  from sinkjax.experiments import streaming_real
  plan = runner.load_plan(streaming_real.STUDY_FILE, ["streaming.tokens=4096", "axes.random_map=[3, 9]",
                                                      f"study.out={tmp_path}"])
  opts = plan.options({"streaming": streaming_real.StreamingOptions})["streaming"]
  assert (opts.tokens, opts.full_heads, opts.chunk) == (4096, 0.25, 64) and plan.study.driver == "streaming"
  assert streaming_real.plan(plan.axes["random_map"])[-4:] == ["hybrid_random3_w256", "hybrid_random9_w256", "full",
                                                               "check"]
  layer = runner.load_plan(streaming_real.STUDY_FILE, ["streaming.scope=layer"]).options(
      {"streaming": streaming_real.StreamingOptions})["streaming"]  # the hybrid alone, ranked within each layer
  assert streaming_real.plan([0, 1], layer.scope) == ["importance", "hybrid_importance_w256", "hybrid_random0_w256",
                                                      "hybrid_random1_w256"]
  far = runner.load_plan(streaming_real.STUDY_FILE.with_name("streaming_far.yaml")).options(
      {"streaming": streaming_real.StreamingOptions})["streaming"]  # two rankings, each measured, then each a hybrid
  assert (far.scope, far.rankings) == ("layer", ["far_attention", "importance"])
  assert streaming_real.plan([0], far.scope, far.rankings) == [
      "far_attention", "importance", "hybrid_far_attention_w256", "hybrid_importance_w256", "hybrid_random0_w256"]
  with pytest.raises(Exception, match="streaming.rankings"):
    runner.load_plan(streaming_real.STUDY_FILE, ["streaming.rankings=[alpha]"]).options(
        {"streaming": streaming_real.StreamingOptions})
  with pytest.raises(runner.StudyError, match="unknown section foo"):
    runner.load_plan(streaming_real.STUDY_FILE, ["foo.x=1"]).options({"streaming": streaming_real.StreamingOptions})
  with pytest.raises(runner.StudyError, match="need a recipe"):
    runner.load_plan(streaming_real.STUDY_FILE, ["train.steps=3"])
  with pytest.raises(Exception, match="streaming.full_heads must be in"):
    runner.load_plan(streaming_real.STUDY_FILE, ["streaming.full_heads=2"]).options(
        {"streaming": streaming_real.StreamingOptions})


def test_the_old_study_kind_key_is_refused_naming_study_driver(tmp_path):
  """`study.kind` (the key before it was `study.driver`: `kinds/` are the layer kinds) is refused in one line that
  names `study.driver`, in a study file and as an override; each committed study file names its driver."""
  import pathlib
  from sinkjax import config as config_lib
  from sinkjax.experiments import streaming_real
  old = tmp_path / "old.yaml"
  old.write_text(pathlib.Path(streaming_real.STUDY_FILE).read_text().replace("  driver: streaming", "  kind: streaming"))
  for args in ((old, ()), (streaming_real.STUDY_FILE, ["study.kind=streaming"])):
    with pytest.raises(config_lib.ConfigError, match=r"unknown config key study.kind in .*; it is study.driver now$"):
      runner.load_plan(*args)
  for path in sorted(pathlib.Path(streaming_real.STUDY_FILE).parent.glob("*.yaml")):
    assert runner.load_plan(path).study.driver in runner.STUDY_DRIVERS, path


# What each study driver's own command was before the study runner took over (#50: earlier docs and shell histories
# hold these lines), and the study file that now runs it.
MOVED = {"heads_real": (["--run", "x", "--out", "y"], "heads_fig4.yaml"),
         "heads_pinning": (["--run", "x", "--out", "y", "--only", "null"], "heads_pinning.yaml"),
         "paper": (["--scale", "cpu", "--dry-run"], "paper_cpu.yaml"),
         "passkey": (["--make-data", "out.jsonl"], "passkey_tiny.yaml"),
         "streaming_real": (["--checkpoint", "runs/smollm2", "--report"], "streaming_real.yaml"),
         "trigger": (["--quick", "--out", "d"], "trigger.yaml")}


@pytest.mark.parametrize("name", sorted(MOVED))
def test_a_driver_that_was_a_command_names_its_study_file(name, capsys, monkeypatch):
  """`python -m sinkjax.experiments.NAME ...` (its module run as __main__, in this process) runs nothing: one line
  naming the study runner's spelling with an existing study file, and exit status 2, whatever the old flags."""
  import runpy
  from tests.helpers import ROOT
  argv, study_file = MOVED[name]
  monkeypatch.setattr(sys, "argv", [f"sinkjax.experiments.{name}", *argv])
  monkeypatch.delitem(sys.modules, f"sinkjax.experiments.{name}", raising=False)   # runpy runs a fresh copy
  with pytest.raises(SystemExit) as e:
    runpy.run_module(f"sinkjax.experiments.{name}", run_name="__main__")
  out = capsys.readouterr()
  assert e.value.code == 2 and out.out == "", (e.value.code, out.out)
  assert out.err.count("\n") == 1 and out.err.startswith(f"sinkjax.experiments.{name}: error: no longer a command; "
                                                         f"run python -m sinkjax.experiments.study "
                                                         f"configs/studies/{study_file}"), out.err
  assert (ROOT / "configs" / "studies" / study_file).is_file()


def test_the_old_fig4_command_fails_in_one_line():
  """The issue's own check, as a user runs it: `python -m sinkjax.experiments.heads_real --run x --out y` exits
  non-zero with at most 3 lines of output (it used to exit 0 and print nothing)."""
  r = subprocess.run([sys.executable, "-m", "sinkjax.experiments.heads_real", "--run", "x", "--out", "y"],
                     capture_output=True, text=True, timeout=120)
  assert r.returncode != 0 and len((r.stdout + r.stderr).strip().splitlines()) <= 3, r
  assert "configs/studies/heads_fig4.yaml" in r.stderr, r.stderr
