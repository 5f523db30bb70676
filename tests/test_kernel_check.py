"""`sinkjax.bench.kernel_check` (the device correctness check) on a CPU with the xla backend: it passes a correct
backend and fails one whose backward drops the LSE cotangent; `launch/gpu_measure.sh --check` runs every stage."""
import importlib.util
import os
import pathlib
import re
import subprocess
import tarfile

import jax.numpy as jnp
import pytest

from sinkjax.bench import kernel_check
from sinkjax.kernels import BlockSizes, xla

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


SMALL = ["--seq", "32", "--head-dim", "16", "--cases", "mha", "--dtype", "float32"]


def test_o_through_d_passes_a_backward_that_reads_o_only_through_d(monkeypatch, capsys):
  """The O-through-D check run on the `xla` backward (which reads O only through D by construction) passes it."""
  monkeypatch.setattr(kernel_check, "O_THROUGH_D", ("xla",))
  assert kernel_check.main(["--impls", "xla", *SMALL]) == 0
  out = capsys.readouterr().out
  assert "xla reads O only through D: grads vs" in out and ": yes" in out and "all passed" in out


def test_o_through_d_fails_a_backward_that_reads_o_beyond_d(monkeypatch, capsys):
  """A backward that also reads O elsewhere (here it adds O minus the recomputed forward output to dq: nothing for the
  true O, so every case passes) fails the O-through-D check, and the run exits 1: the fold's premise is a verdict
  like any case's, not a printed line."""
  bwd = xla.bwd

  def reads_o(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, **kw):
    dq, dk, dv = bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, **kw)
    fresh, _ = xla.fwd(q, k, v, q_seg, kv_seg, causal=kw["causal"], scale=kw["scale"],
                       block_sizes=kw.get("block_sizes", BlockSizes()))
    return (dq + (out.astype(jnp.float32) - fresh.astype(jnp.float32))).astype(dq.dtype), dk, dv
  monkeypatch.setattr(xla, "bwd", reads_o)
  monkeypatch.setattr(kernel_check, "O_THROUGH_D", ("xla",))
  assert kernel_check.main(["--impls", "xla", *SMALL]) == 1
  out = capsys.readouterr().out
  assert "| mha | xla |" in out and "| yes |" in out and "| NO |" not in out          # the cases pass ...
  assert re.search(r"xla reads O only through D: .* given O \+ W (\S+) .*: NO", out), out   # ... the premise not
  assert "1 FAILED" in out


def test_a_backend_skipped_on_a_gpu_fails(monkeypatch, capsys):
  """On a GPU a backend must run: one skipped there (here a faked reason for cudnn) fails the check, where the dry run
  on a CPU passes with the same row."""
  monkeypatch.setattr(kernel_check, "unavailable_here", lambda impl, gpu: "faked" if impl == "cudnn" else None)
  assert kernel_check.main(["--impls", "xla", "cudnn", *SMALL]) == 0                    # a CPU: skipped, passes
  assert "| every case | cudnn | skipped: faked |" in capsys.readouterr().out
  monkeypatch.setattr(kernel_check, "on_gpu", lambda: True)
  assert kernel_check.main(["--impls", "xla", "cudnn", *SMALL]) == 1
  out = capsys.readouterr().out
  assert "| every case | cudnn | skipped on a GPU: faked |" in out and "1 FAILED" in out


def test_nothing_is_skipped_on_a_gpu(monkeypatch, capsys):
  """A GPU run checks every GPU backend by default and skips none: cuDNN on a (faked) GPU is run, and here, where it
  cannot compile, fails with its error instead of a skipped row."""
  assert kernel_check.default_impls(True) == ["cudnn", "mosaic_gpu", "pallas_gpu"]
  assert all(kernel_check.unavailable_here(i, True) is None for i in kernel_check.GPU_IMPLS)
  monkeypatch.setattr(kernel_check, "on_gpu", lambda: True)
  assert kernel_check.main(["--impls", "cudnn", *SMALL]) == 1
  out = capsys.readouterr().out
  assert "skipped" not in out and "| mha | cudnn | error: " in out
  assert "cudnn reads O only through D: error" in out and "2 FAILED" in out


@pytest.mark.slow
def test_gpu_measure_dry_run(tmp_path):
  """The device script's kernel stages with small shapes on this CPU (on request there: check_all, the attention
  micro-benchmarks, the d20 step and its profile; the default stages' dry run: tests/test_side_by_side.py)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}      # one device, as on a one-GPU machine
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
  with tarfile.open(tmp_path / "out" / "gpu_measure.tgz") as tar:     # the stages' one bundle
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
