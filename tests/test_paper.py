"""The paper study (`sinkjax.experiments.paper`, study drivers paper and dose): the Table 1 statistics against hand
computations, and its study files run end to end on 2-step runs (every artefact written, a rerun skips finished runs,
bad keys are one-line errors). Its after-prefill value zeroing is `sinkjax.eval`'s, tested in tests/test_eval.py."""
import json
import math

import numpy as np
import pytest

from sinkjax.experiments import paper, paper_report, runner, study
from tests.helpers import call_main, one_error_line, run_command


def test_table1_means_stds_and_paired_differences_by_hand():
  bpb = {("base", 0): 2.0, ("aux", 0): 1.9, ("base", 1): 2.2, ("aux", 1): 2.15, ("base", 2): 2.1}
  recs = [{"variant": "sink", "loss": l, "seed": s, "val_bpb": v, "head_imbalance": 0.1 * (s + 1)}
          for (l, s), v in bpb.items()]
  t = paper_report.table1(recs)["sink"]
  assert t["base"]["seeds"] == [0, 1, 2] and t["aux"]["seeds"] == [0, 1]
  assert t["base"]["val_bpb"]["mean"] == pytest.approx(2.1)
  assert t["base"]["val_bpb"]["std"] == pytest.approx(0.1)                     # sqrt((0.01 + 0.01 + 0) / 2)
  d = t["aux_minus_base"]
  assert d["seeds"] == [0, 1]                                                 # seed 2 has no aux run: not paired
  np.testing.assert_allclose(d["val_bpb"]["values"], [-0.1, -0.05])
  assert d["val_bpb"]["mean"] == pytest.approx(-0.075)
  assert d["val_bpb"]["std"] == pytest.approx(math.sqrt(2 * 0.025 ** 2))
  assert d["head_imbalance"]["values"] == pytest.approx([0.0, 0.0])


def test_head_roles_names_the_heads_that_lost_their_role():
  before = np.array([[0.9, 0.2, 0.3], [0.1, 0.8, 0.4]])
  after = np.array([[0.5, 0.6, 0.4], [0.2, 0.9, 0.5]])                          # layer 0's top head changed
  r = paper.head_roles(before, after, m=1)
  assert r["shared_heads"] == [[0], [1]] and r["layers_top_changed"] == [0]
  assert r["shared_before"] == pytest.approx(0.85) and r["shared_after"] == pytest.approx(0.7)
  assert r["routed_after"] == pytest.approx((0.6 + 0.4 + 0.2 + 0.5) / 4)
  cv = lambda x: np.std(x) / np.mean(x)
  assert r["routed_cv_before"] == pytest.approx((cv([0.2, 0.3]) + cv([0.1, 0.4])) / 2)


# ------------------------------------------------------------------------------------------------ the runner

def run_study(name, *args, capsys):
  """`python -m sinkjax.experiments.study configs/studies/NAME.yaml ARGS`, called in this process."""
  return call_main(study.main, [paper.STUDIES / f"{name}.yaml", *args], capsys)


@pytest.mark.parametrize("args,needle", [
    (["axes.model.attention=[vanilla,foo]"], "foo"),
    (["train.steps=two"], "train.steps"),
    (["axes.train.seed=[]"], "axis train.seed must be a non-empty list"),
    (["study.driver=bogus"], "study.driver"),
])
def test_bad_keys_are_one_line_errors(args, needle, capsys):
  assert needle in one_error_line(run_study("paper_smoke", *args, "--dry-run", capsys=capsys))


def test_another_scale_in_the_same_out_is_a_one_line_error(tmp_path, capsys):
  (tmp_path / "study.json").write_text(json.dumps({"scale": "cpu", "steps": None}))
  assert "scale cpu" in one_error_line(run_study("paper_smoke", f"study.out={tmp_path}", capsys=capsys))


def test_a_study_out_of_the_flag_era_resumes_at_its_own_steps(tmp_path):
  """OUT/study.json written before study files said steps None for the scale's own: the same scale at its own steps
  (paper_smoke.yaml: 2) resumes there, other steps do not."""
  (tmp_path / "study.json").write_text(json.dumps({"scale": "smoke", "steps": None}))
  paper._lock(tmp_path, plan())                               # pylint: disable=protected-access
  assert json.loads((tmp_path / "study.json").read_text()) == {"scale": "smoke", "steps": 2}
  (tmp_path / "study.json").write_text(json.dumps({"scale": "smoke", "steps": None}))
  with pytest.raises(paper.StudyError, match="scale smoke with 2 steps"):
    paper._lock(tmp_path, plan("paper_smoke", "train.steps=5"))  # pylint: disable=protected-access


def test_a_second_invocation_on_the_same_out_is_a_one_line_error(tmp_path, capsys):
  """Another process holding OUT's lock (a running study) stops a second invocation before it trains anything."""
  import subprocess
  import sys
  holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time; f = open(sys.argv[1], 'a+'); "
                             "fcntl.flock(f, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)",
                             str(tmp_path / ".study.lock")], stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline().strip() == "locked"
    assert "another invocation of the study is running" in one_error_line(
        run_study("paper_smoke", f"study.out={tmp_path}", capsys=capsys))
    assert not (tmp_path / "runs").exists()
  finally:
    holder.kill()
    holder.wait()


def test_study_file_runs_from_the_study_command(tmp_path, capsys):
  """`python -m sinkjax.experiments.study FILE key=value --dry-run`: the file's grid with the overrides, seed-major;
  a bad study key is one line naming it."""
  res = call_main(study.main, [str(paper.STUDIES / "paper_cpu_dose.yaml"), f"study.out={tmp_path}",
                               "axes.train.seed=[7]", "axes.loss.aux_weight=[0, 0.01]", "--dry-run"], capsys)
  names = [line.split()[1].rstrip(":") for line in res.stdout.splitlines() if line.startswith("[")]
  assert res.returncode == 0 and names == ["gated_base_s7", "gated_lam0.01_s7"], res.stderr
  res = call_main(study.main, [str(paper.STUDIES / "paper_cpu.yaml"), "study.eval_batches=0", "--dry-run"], capsys)
  assert res.returncode != 0 and "study.eval_batches must be >= 1" in res.stderr and res.stderr.count("\n") == 1


def test_dry_run_lists_the_grid_seed_major(tmp_path, capsys):
  res = run_study("paper_cpu", "axes.train.seed=[4,5]", "axes.model.attention=[sink,gated]", f"study.out={tmp_path}",
                  "--dry-run", capsys=capsys)
  names = [line.split()[1].rstrip(":") for line in res.stdout.splitlines() if line.startswith("[")]
  assert res.returncode == 0 and names == ["sink_base_s4", "sink_aux_s4", "gated_base_s4", "gated_aux_s4", "sink_base_s5",
                               "sink_aux_s5", "gated_base_s5", "gated_aux_s5"]
  assert not (tmp_path / "runs").exists()


FIGURES = ("table1_bpb.png", "imbalance_curves.png", "first_token_attention.png", "value_zeroing.png",
           "importance.png")


def check_artefacts(out, names):
  for f in ("results.json", "results.md") + FIGURES:
    assert (out / f).stat().st_size > 0, f
  res = json.loads((out / "results.json").read_text())
  assert sorted(f"{r['variant']}_{r['loss']}_s{r['seed']}" for r in res["runs"]) == sorted(names)
  for r in res["runs"]:
    ev = json.loads((out / "runs" / f"{r['variant']}_{r['loss']}_s{r['seed']}" / "paper_eval.json").read_text())
    assert r["val_bpb"] == ev["val_bpb"] and r["imbalance_curve"][-1][0] == 2
    raw = out / "raw" / f"{r['variant']}_{r['loss']}_s{r['seed']}"       # the run's own files, kept without checkpoints
    assert sorted(p.name for p in raw.iterdir()) == sorted(paper.RAW_FILES)
    assert json.loads((raw / "paper_eval.json").read_text())["importance"] == ev["importance"]
    assert json.loads((raw / "done.json").read_text())["commit"] == r["commit"] == res["commit"]
    for defn in ("teacher_forced", "after_prefill"):
      vz = r[f"value_zeroing_{defn}"]
      assert all(math.isfinite(vz[k]) for k in ("bpb_none", "bpb_all", "bpb_selected"))
  md = (out / "results.md").read_text()
  assert "after prefill" in md and "teacher-forced" in md and "configs/nanochat.yaml" in md
  return res


def run_cli(*args):
  return run_command("sinkjax.experiments.study", paper.STUDIES / "paper_smoke.yaml", *args, timeout=900)


def test_grid_runner_writes_every_artefact_and_a_rerun_skips_finished_runs(tmp_path, capsys):
  """The study command trains and evaluates the grid; run again it skips what finished, and --report-only trains
  nothing (those two call its main in this process: the same code without a second interpreter's start-up)."""
  argv = ["axes.model.attention=[sink]", "axes.train.seed=[0]", f"study.out={tmp_path}"]
  p = run_cli(*argv)
  assert p.returncode == 0, p.stderr[-2000:]
  assert "[1/2] sink_base_s0: trained + evaluated" in p.stdout and "[2/2] sink_aux_s0: trained + evaluated" in p.stdout
  res = check_artefacts(tmp_path, ["sink_base_s0", "sink_aux_s0"])
  base, aux = (json.loads((tmp_path / "runs" / n / "paper_eval.json").read_text())["val_bpb"]
               for n in ("sink_base_s0", "sink_aux_s0"))
  assert res["table1"]["sink"]["aux_minus_base"]["val_bpb"]["values"] == pytest.approx([aux - base])
  stamp = (tmp_path / "runs" / "sink_base_s0" / "done.json").stat().st_mtime_ns
  p = run_study("paper_smoke", *argv, capsys=capsys)
  assert p.returncode == 0 and p.stdout.count("done before, skipped") == 2 and "sinkjax.train" not in p.stdout
  assert (tmp_path / "runs" / "sink_base_s0" / "done.json").stat().st_mtime_ns == stamp
  # A bigger grid with --report-only trains nothing and reports what finished.
  p = run_study("paper_smoke", *argv, "axes.train.seed=[0,1]", "--report-only", capsys=capsys)
  assert p.returncode == 0 and "sinkjax.train" not in p.stdout and not (tmp_path / "runs" / "sink_base_s1").exists()
  assert "Finished runs: 2 of 4" in (tmp_path / "results.md").read_text()
  # A dose study in another study.out stands on the grid's results.json, written at this checkout's commit: its
  # lambda 0 run is the grid's sink_base_s0 (reused, not retrained), lambda 1e-2 is trained.
  dose = tmp_path / "dose"
  p = run_study("paper_smoke", "study.driver=dose", "axes.model.attention=[sink]", "axes.train.seed=[0]",
                "axes.loss.aux_weight=[0, 1e-2]", f"study.out={dose}", f"study.reuse={tmp_path / 'results.json'}",
                capsys=capsys)
  assert p.returncode == 0, p.stderr
  assert "[1/2] sink_base_s0: reused from" in p.stdout and "[2/2] sink_lam0.01_s0 (lambda 0.01): trained" in p.stdout
  d = json.loads((dose / "dose.json").read_text())
  assert d["reuse"]["reused"] and [r["name"] for r in d["runs"]] == ["sink_base_s0", "sink_lam0.01_s0"]
  assert d["runs"][0]["val_bpb"] == base and d["runs"][0]["source"].startswith("committed main grid")
  assert not (dose / "runs" / "sink_base_s0").exists() and d["commit"] == res["commit"]


@pytest.mark.slow
def test_whole_grid_with_two_seeds_and_finetuning(tmp_path):
  p = run_cli("axes.train.seed=[0,1]", f"study.out={tmp_path}", "study.finetune=true")
  assert p.returncode == 0, p.stderr[-2000:]
  names = [f"{v}_{l}_s{s}" for v in paper.VARIANTS for l in paper.LOSSES for s in (0, 1)]
  res = check_artefacts(tmp_path, names)
  assert (tmp_path / "finetune.png").stat().st_size > 0
  ft = json.loads((tmp_path / "finetune.json").read_text())
  assert set(ft) == set(paper.VARIANTS)
  for v, r in ft.items():
    assert set(r["modes"]) == set(paper.FINETUNE_MODES)
    assert r["before"]["importance"] == json.loads(
        (tmp_path / "runs" / f"{v}_base_s0" / "paper_eval.json").read_text())["importance"]
  assert res["finetune"] == ft and "eq. 8" in (tmp_path / "results.md").read_text()


# ------------------------------------------------------------------------------------------------ dose study

def plan(name="paper_smoke", *overrides):
  return runner.load_plan(paper.STUDIES / f"{name}.yaml", list(overrides))


def test_dose_grid_names_reuse_the_main_grids_runs():
  specs = paper.specs_of(plan("paper_cpu_dose", "axes.loss.aux_weight=[0, 1e-4, 1e-3, 1e-2]", "axes.train.seed=[0,1]"))
  assert [s.name for s in specs[:4]] == ["gated_base_s0", "gated_aux_s0", "gated_lam0.001_s0", "gated_lam0.01_s0"]
  assert [s.lam for s in specs[:4]] == [0.0, 1e-4, 1e-3, 1e-2] and {s.seed for s in specs[4:]} == {1}
  assert [paper.loss_label(lam) for lam in (0.0, 1e-4, 1e-8, 3e-3)] == ["base", "aux", "lam1e-08", "lam0.003"]
  cfg = paper.run_config(plan(), specs[3], "RUN")
  assert cfg.loss.aux_weight == 1e-2 and cfg.model.attention == "gated" and cfg.train.seed == 0
  assert cfg.model.num_layers == 2 and cfg.train.steps == 2 and cfg.data.packing == "stream"   # paper_smoke's shape


def test_a_new_axis_is_one_line_of_the_grid(tmp_path):
  """An axis added in YAML (or as axes.KEY=[...]) multiplies the grid, names each run after its value and sets the
  key in that run's config; the study's other keys stay."""
  f = tmp_path / "gates.yaml"
  f.write_text(f"base: {paper.STUDIES / 'paper_smoke.yaml'}\naxes:\n  model.attention: [gated]\n"
               "  model.gate: [headwise, elementwise]\n")
  p = runner.load_plan(f, ["axes.train.seed=[3]"])
  specs = paper.specs_of(p)
  assert [s.name for s in specs] == ["gated_base_s3_gateheadwise", "gated_base_s3_gateelementwise",
                                     "gated_aux_s3_gateheadwise", "gated_aux_s3_gateelementwise"]
  cfgs = [paper.run_config(p, s, "R") for s in specs]
  assert [c.model.gate for c in cfgs] == ["headwise", "elementwise"] * 2
  assert {c.model.num_layers for c in cfgs} == {2} and p.study.scale == "smoke"
  # the reports group seeds by arm (variant and the new axis' value), so the two gates are two rows of Table 1
  assert [s.arm for s in specs] == ["gated_gateheadwise", "gated_gateelementwise"] * 2
  recs = [{"variant": s.arm, "loss": s.loss, "seed": seed, "val_bpb": 2.0 + 0.1 * i + 0.01 * seed,
           "head_imbalance": 0.1} for seed in (0, 1) for i, s in enumerate(specs)]
  t1 = paper_report.table1_cells(recs)
  assert list(t1) == ["gated_gateheadwise", "gated_gateelementwise"]
  assert t1["gated_gateelementwise"]["aux"]["mean"] == pytest.approx(2.3 + 0.005)        # (2.30 + 2.31) / 2


def _with_this_commit(tmp_path):
  """The committed main grid's results.json as if its runs had been made with this checkout's commit."""
  committed = json.loads(paper_report.GRID.read_text())
  committed["commit"] = paper.git_commit()["commit"]
  for r in committed["runs"]:
    r["commit"] = committed["commit"]
  path = tmp_path / "this_commit.json"
  path.write_text(json.dumps(committed))
  return committed, path


def test_dose_reuses_committed_runs_only_of_this_commit_and_recipe(tmp_path):
  runs, why = paper.reusable_records(paper_report.GRID, plan("paper_cpu"))
  assert runs == {} and not why["reused"]
  if why["recipe_differences"]["changed"] or why["recipe_differences"]["gone"]:
    pytest.skip(f"this checkout's recipe differs from the committed study's: {why['recipe_differences']}")
  assert "one commit" in why["reason"] and "unrecorded" in why["reason"]      # made before commits were recorded
  committed, path = _with_this_commit(tmp_path)
  runs, why = paper.reusable_records(path, plan("paper_cpu"))
  assert why["reused"] and ("gated", "aux", 2) in runs and len(runs) == len(committed["runs"])
  changed = json.loads(json.dumps(committed))
  changed["recipe"]["train"]["matrix_lr"] = 0.03
  (tmp_path / "results.json").write_text(json.dumps(changed))
  runs, why = paper.reusable_records(tmp_path / "results.json", plan("paper_cpu"))
  assert runs == {} and not why["reused"] and why["recipe_differences"]["changed"] == {
      "train.matrix_lr": [0.03, committed["recipe"]["train"]["matrix_lr"]]}
  assert paper.reusable_records(path, plan("paper_smoke"))[0] == {}
  assert paper.reusable_records(path, plan("paper_cpu", "train.steps=50"))[0] == {}


def test_runs_of_different_commits_are_not_aggregated():
  same = [{"name": "a", "commit": "abc"}, {"name": "b", "commit": "abc"}]
  assert paper.one_commit(same) == "abc" and paper.one_commit([]) is None
  with pytest.raises(paper.StudyError) as e:
    paper.one_commit(same + [{"name": "c", "commit": "def"}, {"name": "d"}])
  msg = str(e.value)
  assert "\n" not in msg and "abc: a, b" in msg and "def: c" in msg and "unrecorded: d" in msg


def test_keep_raw_copies_the_runs_own_files_not_its_checkpoints(tmp_path):
  run = tmp_path / "runs" / "x"
  (run / "checkpoints").mkdir(parents=True)
  for name in paper.RAW_FILES:
    (run / name).write_text(name)
  runner.copy_files(run, tmp_path / "raw" / "x", paper.RAW_FILES)
  assert sorted(p.name for p in (tmp_path / "raw" / "x").iterdir()) == sorted(paper.RAW_FILES)
  assert (tmp_path / "raw" / "x" / "metrics.jsonl").read_text() == "metrics.jsonl"


def test_dose_dry_run_marks_the_reused_runs(tmp_path, capsys):
  _, path = _with_this_commit(tmp_path)
  res = run_study("paper_cpu_dose", "axes.loss.aux_weight=[0,1e-4,1e-2]", "axes.train.seed=[0]",
                  f"study.out={tmp_path / 'out'}", f"study.reuse={path}", "--dry-run", capsys=capsys)
  lines = [l for l in res.stdout.splitlines() if l.startswith("[")]
  assert res.returncode == 0 and len(lines) == 3 and all("gated" in l for l in lines)
  assert "reused" in lines[0] and "reused" in lines[1] and "to do" in lines[2] and "gated_lam0.01_s0" in lines[2]


# ------------------------------------------------------------------------------------------------ the report

RESULTS = paper_report.REPO / "docs" / "results"


@pytest.mark.parametrize("grid,dose", [("paper_cpu", "paper_cpu_dose"), ("paper_cpu_r2", "paper_cpu_r2_dose")])
def test_report_write_regenerates_the_committed_reports(grid, dose, tmp_path, capsys):
  """`paper_report --write` on copies of a committed grid (and dose study) writes the committed stats.md / .json
  (and dose.md / dose_stats.json) again, its default options as docs/RESULTS.md gives the commands: the main grid's
  retrains (paper_cpu_repro) only beside the main grid (another --grid's runs of the same names are other runs)."""
  copies = {}
  for name, f in ((grid, "results.json"), (dose, "dose.json")):
    if name:
      copies[name] = tmp_path / name / f
      copies[name].parent.mkdir()
      copies[name].write_bytes((RESULTS / name / f).read_bytes())
  argv = ["--grid", copies[grid], "--dose", copies[dose] if dose else "none", "--write"]
  if grid == "paper_cpu":
    argv += ["--repro", paper_report.REPRO]                 # the default beside docs/results/paper_cpu/results.json
  assert call_main(paper_report.main, argv, capsys).returncode == 0
  for name, files in ((grid, ("stats.md", "stats.json")), (dose, ("dose.md", "dose_stats.json"))):
    for f in files if name else ():
      got = (tmp_path / name / f).read_text().replace(str(tmp_path), "docs/results")
      assert got == (RESULTS / name / f).read_text(), f"{name}/{f}"
