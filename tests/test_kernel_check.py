"""`sinkjax.bench.kernel_check` (the device correctness check) on a CPU with the xla backend: it passes a correct
backend and fails one whose backward drops the LSE cotangent; `launch/gpu_measure.sh --check` runs every stage."""
import importlib.util
import os
import pathlib
import subprocess
import tarfile

import jax.numpy as jnp
import pytest

from sinkjax.bench import kernel_check
from sinkjax.kernels import xla

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_passes_a_correct_backend(capsys):
  assert kernel_check.main(["--seq", "32", "--head-dim", "16", "--cases", "gqa_docs", "sink_aux_gqa_docs"]) == 0
  out = capsys.readouterr().out
  assert "| gqa_docs | xla |" in out and "all passed" in out


def test_fails_a_backend_without_the_lse_gradient(monkeypatch, capsys):
  bwd = xla.bwd
  monkeypatch.setattr(xla, "bwd", lambda *a, **kw: bwd(*a[:8], jnp.zeros_like(a[8]), **kw))
  errs = kernel_check.check_case("gqa", 8, 2, "none", "xla", B=1, T=32, D=16, dtype=jnp.float32)
  assert errs["out"] < 1e-5 and errs["dq"] > 1e-2 and errs["dk"] > 1e-2
  assert kernel_check.main(["--seq", "32", "--head-dim", "16", "--cases", "gqa"]) == 1
  assert "1 FAILED" in capsys.readouterr().out


@pytest.mark.slow
def test_gpu_measure_dry_run(tmp_path):
  """The device script's kernel stages with small shapes on this CPU (on request there: check_all, the attention
  micro-benchmarks, the d20 step and its profile; the default stages' dry run: tests/test_side_by_side.py)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}      # one device, as on the lent machine
  stages = ("check_all", "attn_mha", "attn_d64", "attn_gqa", "attn_d20", "trainer_d20", "trainer_d20_mosaic")
  r = subprocess.run(["bash", "launch/gpu_measure.sh", "--check", *stages], cwd=ROOT, capture_output=True, text=True,
                     timeout=900, env={**env, "GPU_MEASURE_DIR": str(tmp_path / "work"), "OUT": str(tmp_path / "out"),
                                       "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")})
  assert r.returncode == 0, r.stderr[-2000:]
  for stage in stages:
    assert f"== {stage}: passed" in r.stdout, r.stdout[-3000:]
  assert "all passed" in r.stdout and "| attention |" in r.stdout and "runs only on NVIDIA GPUs" in r.stdout
  for impl in ("cudnn", "mosaic_gpu", "pallas_gpu"):                     # the three GPU backends' rows
    assert f"| {impl} |" in r.stdout, impl
  assert "| every case | cudnn | skipped: cuDNN's custom calls run only on NVIDIA GPUs" in r.stdout
  assert ("| mha | mosaic_gpu | " in r.stdout) == (importlib.util.find_spec("tokamax") is not None)   # its CPU form
  assert "| mha | pallas_gpu | " in r.stdout and "FAILED" not in r.stdout                                # interpreted
  assert "gpu_measure: every stage passed" in r.stdout
  with tarfile.open(tmp_path / "out" / "gpu_measure.tgz") as tar:     # the device tool's one bundle
    names = tar.getnames()
  assert {"./check_all.log", "./trainer_d20.log", "./trainer_d20_mosaic.log", "profile_d20/step.hlo.txt"} <= set(names)
  assert any(n.endswith(".trace.json.gz") for n in names), names


def test_gpu_measure_fails_when_a_stage_fails(tmp_path):
  """A stage whose command fails (here every `python3` exits 1, as one without jax would) or an unknown stage makes
  the script exit 1 and name them."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "python3").write_text("#!/bin/sh\necho no jax here >&2\nexit 1\n")
  (bin_dir / "python3").chmod(0o755)
  env = {**os.environ, "OUT": str(tmp_path / "out"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
  r = subprocess.run(["bash", "launch/gpu_measure.sh", "--check", "check", "attn_d20", "no_such_stage"], cwd=ROOT,
                     capture_output=True, text=True, timeout=120, env=env)
  assert r.returncode == 1, r.stdout
  assert "3 stage(s) failed: check (exit 1) attn_d20 (exit 1) no_such_stage (unknown stage)" in r.stdout, r.stdout
