"""launch/gpu_measure.sh's stages (against a stand-in Python, so that each takes milliseconds), the side by side's
result file, and nanochat's runner (launch/nanochat_step.py) where a Python with torch is at hand; the whole dry run
(`bash launch/gpu_measure.sh --check`, minutes on a small CPU) is the slow test at the end."""
from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from sinkjax.bench import side_by_side as sbs
from sinkjax.config import load_config

REPO = pathlib.Path(__file__).resolve().parents[1]

# A stand-in for python3: each sinkjax command prints a line and does what $FAKE_<STAGE> says (ok by default).
FAKE_PYTHON = r"""#!/usr/bin/env bash
echo "fake python: $*"
out=""; prev=""
for a in "$@"; do [ "$prev" = --out ] && out=$a; prev=$a; done
case "$*" in
  *sinkjax.bench.side_by_side*--ab*)
    [ "${FAKE_AB:-ok}" = ok ] || { echo "arm B failed"; exit 1; }
    echo '{"lever": "x", "b_over_a": 1.01}' ;;
  *sinkjax.bench.side_by_side*)
    echo "side by side started"
    [ "${FAKE_SBS:-ok}" = hang ] && sleep 60
    [ "${FAKE_SBS:-ok}" = fail ] && { echo "sinkjax sink+aux: FAILED: its process exited 1"; exit 1; }
    printf '{"device": "NVIDIA H100 80GB HBM3", "commit": "abc", "rows": []}\n' > "$out" ;;
  *sinkjax.bench.kernel_check*)
    if [ "${FAKE_CHECK:-ok}" = compile_error ]; then
      echo "| mha | cudnn | error: cuDNN graph failed to compile |  |  |  |  |  | no |"; echo "1 FAILED"; exit 1
    fi
    echo "all passed" ;;
  *sinkjax.bench.attention*)
    if [ "${FAKE_ATTN:-ok}" = compile_error ]; then
      echo "  4096        cudnn          -          -         -              -  (CUDNN_STATUS_NOT_SUPPORTED: no engine)"
    elif [ "${FAKE_ATTN:-ok}" = oom ]; then
      echo "  16384  jax.nn.cudnn          -          -         -              -  (out of device memory)"
    fi
    echo "  4096     mosaic_gpu      1.234      10.0     100.0             512" ;;
  *) echo "ok" ;;
esac
"""


@pytest.fixture
def stand_in(tmp_path):
  """A checkout holding launch/gpu_measure.sh and a levers file, a stand-in python3 and nvidia-smi, and $OUT."""
  repo = tmp_path / "repo"
  (repo / "launch").mkdir(parents=True)
  shutil.copy(REPO / "launch" / "gpu_measure.sh", repo / "launch")
  (repo / "launch" / "gpu_levers.txt").write_text("# levers\nfirst: a.b=1\n\nsecond: c.d=2 e.f=3   # two\n")
  bin_ = tmp_path / "bin"
  bin_.mkdir()
  (bin_ / "python3").write_text(FAKE_PYTHON)
  (bin_ / "nvidia-smi").write_text("#!/usr/bin/env bash\necho 'name, memory.total'\necho 'NVIDIA H100, 81559 MiB'\n")
  for f in bin_.iterdir():
    f.chmod(0o755)
  env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_MEASURE", "SINKJAX_TORCH", "OUT"))}
  env.update(PATH=f"{bin_}:{env['PATH']}", OUT=str(tmp_path / "out"), GPU_MEASURE_DIR=str(tmp_path / "logs"),
             GPU_MEASURE_CACHE=str(tmp_path / "cache"))
  return repo, env, tmp_path


def _measure(repo, env, *args, timeout=60):
  return subprocess.run(["bash", "launch/gpu_measure.sh", *args], cwd=repo, env=env, capture_output=True, text=True,
                        timeout=timeout)


def _stages(tmp):
  return [json.loads(line) for line in (tmp / "out" / "stages.jsonl").read_text().splitlines()]


def _bundled(tmp):
  with tarfile.open(tmp / "out" / "gpu_measure.tgz") as t:
    return {pathlib.PurePath(n).name: t.extractfile(n).read().decode() for n in t.getnames()
            if t.getmember(n).isfile()}


def test_the_default_stages_run_in_order_and_come_back_in_out(stand_in):
  repo, env, tmp = stand_in
  r = _measure(repo, env)
  assert r.returncode == 0, r.stdout + r.stderr
  assert [s["stage"] for s in _stages(tmp)] == ["install", "env", "side_by_side", "check", "ab_first", "ab_second"]
  assert all(s["status"] == "passed" for s in _stages(tmp))
  logs = _bundled(tmp)
  for stage in ("install", "env", "side_by_side", "check", "ab_first", "ab_second"):
    assert f"{stage}.log" in logs and json.loads(logs[f"{stage}.stage.json"])["stage"] == stage
  assert "--ab second --levers launch/gpu_levers.txt" in logs["ab_second.log"]
  assert "kernel_check --seq 512 --impls cudnn" in logs["check.log"]          # cuDNN, O through D included
  assert json.loads((tmp / "out" / "side_by_side.json").read_text())["device"].startswith("NVIDIA H100")
  assert "every stage passed" in r.stdout


def test_a_backend_that_fails_to_compile_fails_its_stage_and_the_script(stand_in):
  repo, env, tmp = stand_in
  r = _measure(repo, {**env, "FAKE_CHECK": "compile_error"})
  assert r.returncode == 1
  status = {s["stage"]: s for s in _stages(tmp)}
  assert status["check"]["status"] == "failed" and status["check"]["exit"] == 1
  assert status["ab_first"]["status"] == "passed"                           # the later stages still ran
  assert "cuDNN graph failed to compile" in _bundled(tmp)["check.log"]
  assert "1 stage(s) failed: check (exit 1)" in r.stdout


def test_an_attention_backend_without_a_figure_fails_the_stage_though_the_benchmark_exits_0(stand_in):
  repo, env, tmp = stand_in
  r = _measure(repo, {**env, "FAKE_ATTN": "compile_error"}, "attn_mha", "attn_d20")
  assert r.returncode == 1
  assert {s["stage"]: s["status"] for s in _stages(tmp)} == {"attn_mha": "failed", "attn_d20": "failed"}
  assert "CUDNN_STATUS_NOT_SUPPORTED" in _stages(tmp)[0]["why"]
  r = _measure(repo, {**env, "FAKE_ATTN": "oom"}, "attn_mha")               # too big for the device: not a failure
  assert r.returncode == 0, r.stdout
  r = _measure(repo, {**env, "FAKE_ATTN": "compile_error"}, "--check", "attn_mha")   # a CPU skips cuDNN by design
  assert r.returncode == 0, r.stdout


def test_a_failed_side_by_side_fails_the_script(stand_in):
  repo, env, tmp = stand_in
  r = _measure(repo, {**env, "FAKE_SBS": "fail"}, "side_by_side")
  assert r.returncode == 1 and _stages(tmp)[0]["status"] == "failed"
  assert not (tmp / "out" / "side_by_side.json").exists()


def test_each_stage_log_is_in_out_when_the_stage_ends_so_a_call_cut_off_keeps_it(stand_in):
  """The call killed during the side by side (the device call's limit): env's log is already in $OUT's bundle, and
  the running stage's output so far in $OUT/running.log."""
  repo, env, tmp = stand_in
  proc = subprocess.Popen(["bash", "launch/gpu_measure.sh", "env", "side_by_side"], cwd=repo,
                          env={**env, "FAKE_SBS": "hang"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                          start_new_session=True)
  try:
    running = tmp / "out" / "running.log"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (running.exists() and "side by side started" in running.read_text()):
      time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  assert "side by side started" in running.read_text()
  logs = _bundled(tmp)
  assert "env.log" in logs and "NVIDIA H100" in logs["env.log"]
  assert [s["stage"] for s in _stages(tmp)] == ["env"]


def test_the_budget_cuts_a_stage_and_fails_what_it_leaves_unrun(stand_in):
  repo, env, tmp = stand_in
  t0 = time.monotonic()
  r = _measure(repo, {**env, "FAKE_SBS": "hang", "GPU_MEASURE_BUDGET": "12"}, "side_by_side", "check")
  assert time.monotonic() - t0 < 40                     # the stage's 230 s limit was cut to the 12 s left
  assert r.returncode == 1
  s = {x["stage"]: x for x in _stages(tmp)}
  assert s["side_by_side"]["why"].startswith("ran past its") and s["side_by_side"]["limit"] <= 12
  assert s["check"]["status"] == "failed" and s["check"]["why"] == "not run: no time left in the budget"


def test_the_default_limits_fit_the_budget_with_the_committed_levers():
  """The default stages' own limits on a GPU (install, env, side_by_side, check, one ab_ per lever) sum to at most
  the 480 s budget, so no stage is cut short by design."""
  text = (REPO / "launch" / "gpu_measure.sh").read_text()

  def limit(stage):
    line = next(ln for ln in text.splitlines() if f"run_stage {stage} " in ln and "--check" not in ln
                and "seq 64" not in ln and "nothing to install" not in ln and "import jax, flax, optax;" not in ln)
    return int(line.split(f"run_stage {stage} ")[1].split()[0])
  levers = sbs.read_levers(REPO / "launch" / "gpu_levers.txt")
  total = limit("install") + limit("env") + limit("side_by_side") + limit("check") + \
      len(levers) * limit('"$1"')
  assert 'BUDGET=${GPU_MEASURE_BUDGET:-480}' in text
  assert total <= 480, total


def _doc():
  return {"device": "NVIDIA H100 80GB HBM3", "commit": "abc1234",
          "rows": [{"name": "nanochat", "tokens_per_s": 100.0, "mfu": 40.0},
                   {"name": "sinkjax sink+aux", "tokens_per_s": 110.0, "mfu": 44.0},
                   {"name": "sinkjax vanilla", "tokens_per_s": 112.0, "mfu": 45.0}]}


def test_validate_refuses_a_result_that_misses_a_row_or_a_number():
  sbs.validate(_doc())
  for broken, msg in ((lambda d: d["rows"].pop(0), "misses the row(s) nanochat"),
                      (lambda d: d["rows"].pop(2), "sinkjax vanilla"),
                      (lambda d: d["rows"][1].update(mfu=float("nan")), "not a positive number"),
                      (lambda d: d["rows"][0].pop("tokens_per_s"), "not a positive number"),
                      (lambda d: d.pop("commit"), "device and commit")):
    d = _doc()
    broken(d)
    with pytest.raises(ValueError, match=re.escape(msg)):
      sbs.validate(d)


def _opts(tmp_path, **kw):
  return sbs.SideBySideOptions(out=str(tmp_path / "side_by_side.json"), **kw)


def test_side_by_side_writes_every_row_or_no_file(tmp_path, monkeypatch, capsys):
  results = {"nanochat": {"tokens_per_s": 100.0, "mfu": 40.0, "device": "NVIDIA H100 80GB HBM3", "compiled": True},
             "sinkjax sink+aux": {"tokens_per_s": 125.0, "mfu": 50.0, "device": "NVIDIA H100 80GB HBM3"},
             "sinkjax vanilla": {"tokens_per_s": 130.0, "mfu": 52.0, "device": "NVIDIA H100 80GB HBM3"}}
  calls = []

  def fake_child(name, cmd, timeout):
    calls.append((name, cmd))
    return (dict(results[name]), "") if name in results else (None, "its process exited 1")
  monkeypatch.setattr(sbs, "run_child", fake_child)
  assert sbs.side_by_side(_opts(tmp_path), ["model.attn_impl=xla"]) == 0
  doc = json.loads((tmp_path / "side_by_side.json").read_text())
  sbs.validate(doc)
  assert [r["name"] for r in doc["rows"]] == ["nanochat", "sinkjax sink+aux", "sinkjax vanilla"]
  assert doc["rows"][1] == {"name": "sinkjax sink+aux", "tokens_per_s": 125.0, "mfu": 50.0}
  assert doc["device"] == "NVIDIA H100 80GB HBM3" and doc["commit"]
  assert "| sinkjax sink+aux | NVIDIA H100 80GB HBM3 |" in capsys.readouterr().out
  nanochat_cmd = calls[0][1]          # nanochat's runner at the same shape as the sinkjax rows
  assert nanochat_cmd[1].endswith("launch/nanochat_step.py") and "--no-compile" not in nanochat_cmd
  assert nanochat_cmd[nanochat_cmd.index("--depth") + 1] == "20" and "--row" in calls[1][1]
  assert calls[1][1][-1] == "model.attn_impl=xla"
  (tmp_path / "side_by_side.json").unlink()
  del results["sinkjax vanilla"]
  assert sbs.side_by_side(_opts(tmp_path), []) == 1
  assert not (tmp_path / "side_by_side.json").exists()
  assert "sinkjax vanilla | - |" in capsys.readouterr().out


def test_the_table_gives_each_row_as_a_multiple_of_nanochat(tmp_path, monkeypatch, capsys):
  monkeypatch.setattr(sbs, "run_child", lambda name, cmd, timeout: (
      {"tokens_per_s": {"nanochat": 80.0, "sinkjax sink+aux": 100.0, "sinkjax vanilla": 60.0}[name], "mfu": 1.0,
       "device": "d"}, ""))
  assert sbs.side_by_side(_opts(tmp_path), []) == 0
  out = capsys.readouterr().out
  assert "| 1.250x |" in out and "| 0.750x |" in out and "| 1.000x |" in out


def test_the_levers_file_and_its_errors(tmp_path):
  assert sbs.read_levers(REPO / "launch" / "gpu_levers.txt")        # the committed file parses
  # each committed lever's overrides are keys and values of the GPU config (a typo would cost a GPU call)
  for name in ("gpu_levers.txt", "gpu_levers_more.txt"):
    for lever, overrides in sbs.read_levers(REPO / "launch" / name).items():
      assert load_config(str(REPO / "configs" / "d20_gpu.yaml"), overrides), (name, lever)
  p = tmp_path / "levers.txt"
  p.write_text("# c\none: a.b=1 c.d=x  # note\ntwo: e.f=\n")
  assert sbs.read_levers(p) == {"one": ["a.b=1", "c.d=x"], "two": ["e.f="]}
  for bad in ("one a.b=1\n", "one:\n", "one: a.b\n", "o-ne: a.b=1\n", "one: a=1\none: b=2\n"):
    p.write_text(bad)
    with pytest.raises(sbs.errors.UserError, match="levers.txt:"):
      sbs.read_levers(p)


def test_ab_takes_its_a_arm_from_the_baseline_and_fails_when_b_fails(tmp_path, monkeypatch, capsys):
  levers = tmp_path / "levers.txt"
  levers.write_text("fast: model.remat_policy=dots\n")
  base = tmp_path / "sbs.json"
  base.write_text(json.dumps({**_doc(), "detail": {"sinkjax sink+aux": {"tokens_per_s": 100.0, "mfu": 40.0}}}))
  calls = []

  def child(name, cmd, timeout):
    calls.append(cmd)
    return ({"tokens_per_s": 120.0, "mfu": 48.0}, "") if "model.remat_policy=dots" in cmd else (None, "exit 1")
  monkeypatch.setattr(sbs, "run_child", child)
  assert sbs.ab(sbs.SideBySideOptions(ab="fast", levers=str(levers), baseline=str(base)), []) == 0
  assert len(calls) == 1 and calls[0][calls[0].index("--row") + 1] == "sinkjax sink+aux"
  line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
  assert line["b_over_a"] == pytest.approx(1.2)
  monkeypatch.setattr(sbs, "run_child", lambda name, cmd, timeout: (None, "its process exited 1"))
  assert sbs.ab(sbs.SideBySideOptions(ab="fast", levers=str(levers), baseline=str(base)), []) == 1
  with pytest.raises(sbs.errors.UserError, match="no such lever"):
    sbs.ab(sbs.SideBySideOptions(ab="slow", levers=str(levers)), [])


def test_run_child_reports_a_failed_or_silent_process(tmp_path):
  ok, why = sbs.run_child("x", [sys.executable, "-c", "print('{\"tokens_per_s\": 1.0, \"mfu\": 2.0}')"], 30)
  assert ok == {"tokens_per_s": 1.0, "mfu": 2.0} and why == ""
  assert sbs.run_child("x", [sys.executable, "-c", "raise SystemExit(3)"], 30) == (None, "its process exited 3")
  assert sbs.run_child("x", [sys.executable, "-c", "print('done')"], 30) == (None, "its process printed no result")
  got, why = sbs.run_child("x", [sys.executable, "-c", "import time\nfor _ in range(50): print(1, flush=True); "
                                 "time.sleep(0.1)"], 1)
  assert got is None and why == "ran past its 1 s"
  t0 = time.monotonic()
  assert sbs.run_child("x", [sys.executable, "-c", "import time; time.sleep(60)"], 1) == (None, "ran past its 1 s")
  assert time.monotonic() - t0 < 30                          # a silent process is stopped at its limit too


def test_a_stage_stopped_at_its_limit_takes_its_row_process_along(tmp_path):
  """SIGTERM to the side by side (what `timeout` sends at a stage's limit) kills the row's process group, which runs
  in a session of its own: no row goes on holding the device during the next stage."""
  pid_file = tmp_path / "pid"
  child = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(120)"
  parent = subprocess.Popen([sys.executable, "-c", f"from sinkjax.bench import side_by_side as s; "
                             f"s.run_child('row', [{sys.executable!r}, '-c', {child!r}], 300)"],
                            stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline and not (pid_file.exists() and pid_file.read_text()):
    time.sleep(0.1)
  pid = int(pid_file.read_text())
  parent.send_signal(signal.SIGTERM)
  assert parent.wait(timeout=30) == 128 + signal.SIGTERM
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline and pathlib.Path(f"/proc/{pid}").exists() and \
      "zombie" not in pathlib.Path(f"/proc/{pid}/status").read_text().lower():
    time.sleep(0.1)
  status = pathlib.Path(f"/proc/{pid}/status")
  assert not status.exists() or "zombie" in status.read_text().lower()


def test_heads_follow_base_train_s_rule():
  """nanochat's base_train.py: width 64 x depth, the head count dividing the width nearest to width / 128."""
  sys.path.insert(0, str(REPO / "launch"))
  try:
    import nanochat_step  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.remove(str(REPO / "launch"))
  assert [nanochat_step.heads_for(64 * d) for d in (2, 3, 20, 26, 32)] == [1, 2, 10, 13, 16]
  assert nanochat_step.heads_for(64 * 5) == 2       # round(2.5) is 2 in Python, as in base_train.py
  assert nanochat_step.heads_for(64 * 7) == 4       # 448 / 128 = 3.5 -> 4, which divides 448


def _torch_python():
  """A Python that imports torch ($SINKJAX_TORCH_PYTHON, else this one), or None."""
  for py in filter(None, (os.environ.get("SINKJAX_TORCH_PYTHON"), sys.executable)):
    if subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0:
      return py
  return None


def _nanochat_tree():
  tree = sbs.nanochat_dir(sbs.SideBySideOptions())
  return tree if (tree / "nanochat" / "gpt.py").is_file() else None


def test_nanochat_runner_counts_flops_as_estimate_flops():
  """The runner's FLOPs per token are nanochat's estimate_flops, checked by hand: 6 x (parameters - embedding) +
  12 x L x H x D x T, at depth 2 (128 wide, one head of 128), vocabulary 512, T 64."""
  py, tree = _torch_python(), _nanochat_tree()
  if py is None or tree is None:
    pytest.skip("needs a Python with torch (SINKJAX_TORCH_PYTHON) and nanochat's tree (SINKJAX_NANOCHAT_PEERS)")
  r = subprocess.run([py, str(REPO / "launch" / "nanochat_step.py"), "--tree", str(tree), "--depth", "2", "--batch",
                      "2", "--seq", "64", "--vocab", "512", "--warmup", "1", "--steps", "1", "--no-compile"],
                     capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  got = json.loads(r.stdout.strip().splitlines()[-1])
  d, L, V, T = 128, 2, 512, 64
  params = V * d + L * (4 * d * d + 8 * d * d) + d * V       # wte, blocks (q k v proj, MLP 4x), lm_head
  assert got["params"] == params and got["heads"] == 1
  assert got["flops_per_token"] == 6 * (params - V * d) + 12 * L * 1 * d * T
  assert got["mfu"] == pytest.approx(100 * got["flops_per_token"] * got["tokens_per_s"] / 989e12)
  assert got["compiled"] is False and got["device"] == "cpu"


@pytest.mark.slow
def test_the_dry_run_passes_every_stage(tmp_path):
  """`bash launch/gpu_measure.sh --check`: every default stage on this CPU, nanochat at depth 2 included (minutes)."""
  py, tree = _torch_python(), _nanochat_tree()
  if py is None or tree is None:
    pytest.skip("needs a Python with torch (SINKJAX_TORCH_PYTHON) and nanochat's tree (SINKJAX_NANOCHAT_PEERS)")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}    # conftest's 8 host devices: the d20 mesh is one
  env = {**env, "OUT": str(tmp_path / "out"), "GPU_MEASURE_DIR": str(tmp_path / "logs"),
         "GPU_MEASURE_PYTHON": sys.executable, "SINKJAX_TORCH_PYTHON": py,
         "SINKJAX_NANOCHAT_PEERS": str(tree.parent), "PYTHONPATH": str(REPO)}
  r = subprocess.run(["bash", "launch/gpu_measure.sh", "--check"], cwd=REPO, env=env, capture_output=True, text=True,
                     timeout=1900)
  assert r.returncode == 0, r.stdout[-3000:]
  doc = json.loads((tmp_path / "out" / "side_by_side.json").read_text())
  sbs.validate(doc)
  assert {s["stage"] for s in map(json.loads, (tmp_path / "out" / "stages.jsonl").read_text().splitlines())} >= \
      {"side_by_side", "check", *(f"ab_{n}" for n in sbs.read_levers(REPO / "launch" / "gpu_levers.txt"))}


def test_the_sinkjax_rows_are_nanochats_step_on_synthetic_data():
  """Each sinkjax row's config, as `--row` loads it: nanochat's step (32 rows x 2,048 tokens, depth 20, vocabulary
  65,536: base_train.py's device_batch_size and max_seq_len) in 16-row micro-steps, on the embedded byte data (a GPU
  machine holds no FineWeb-Edu shards), the row's variant and aux weight on top of configs/d20_gpu.yaml."""
  from sinkjax.config import load_config
  o = sbs.SideBySideOptions()
  config, base = sbs.default_config()
  for row, (attention, aux) in {"sinkjax sink+aux": ("sink", 1e-4), "sinkjax vanilla": ("vanilla", 0.0)}.items():
    cfg = load_config(str(REPO / config), base + sbs.shape_overrides(o) + sbs.ROWS[row])
    assert (cfg.train.batch_size, cfg.train.grad_accum, cfg.data.seq_len) == (32, 2, 2048)
    assert (cfg.model.num_layers, cfg.model.vocab_size) == (20, 65536)
    assert (cfg.data.source, cfg.data.val_source, cfg.data.tokenizer) == ("default", "", "bytes")
    assert (cfg.model.attention, cfg.loss.aux_weight) == (attention, aux)
    assert (cfg.train.loss_impl, cfg.model.scan_layers, cfg.mesh.fsdp) == ("fused", False, 1)
