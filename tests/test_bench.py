"""sinkjax.bench.train: the nanochat peer row (present, or skipped with a one-line note), Muon's FLOP count and the
round-robin timing (settling calls, paired per-round ratios); sinkjax.bench.attention's failed and skipped rows."""
import math
import pathlib
import re

import jax.numpy as jnp
import pytest

from sinkjax.bench import train as bench
from sinkjax.config import load_config
from sinkjax.model import count_params, Transformer
from flax import nnx
from tests import nanochat_peer

SMALL = ["model.vocab_size=257", "model.num_layers=1", "model.d_model=16", "model.num_heads=2", "model.num_kv_heads=2",
         "model.head_dim=8", "data.seq_len=8", "model.max_seq_len=8", "train.batch_size=2", "model.dtype=float32",
         "model.attention=vanilla"]


@pytest.mark.slow   # the whole benchmark, six train-step compiles (~38 s)
def test_missing_nanochat_tree_skips_the_row_with_a_note(tmp_path, capsys):
  """No tree at --nanochat: the benchmark still runs its sinkjax rows and says in one line why nanochat is absent."""
  missing = tmp_path / "no-such-tree"
  bench.main(["--layers", "1", "--d-model", "16", "--heads", "2", "--head-dim", "8", "--seq", "8", "--batch", "2",
              "--variants", "vanilla", "--repeats", "1", "--nanochat", str(missing)])
  out = capsys.readouterr().out
  notes = [line for line in out.splitlines() if "nanochat:" in line]
  assert len(notes) == 1 and f"no nanochat tree at {missing}" in notes[0] and "--nanochat DIR" in notes[0]
  assert "| nanochat GPT" not in out
  assert "| sinkjax sink, AdamW, aux on |" in out and "| sinkjax vanilla, AdamW, aux off |" in out


def test_nanochat_row_is_nanochats_own_model_at_the_same_shape():
  """The peer is nanochat's GPT at the bench's shape: it trains (finite loss going down over a few steps on one batch)
  and has exactly the parameters of sinkjax's model with nanochat's vocabulary padding (64)."""
  peer = nanochat_peer.load(bench.NANOCHAT_TREE)          # skips without torch or the tree
  cfg = load_config("configs/tiny.yaml", SMALL)
  run, n, note = bench.nanochat_runner(peer.root, cfg, bench.random_batch(2, 8))
  assert run is not None, note
  losses = [float(run()) for _ in range(3)]
  assert all(math.isfinite(l) for l in losses) and losses[2] < losses[1] < losses[0], losses
  padded = load_config("configs/tiny.yaml", SMALL + ["model.vocab_pad_to=64"])
  assert n == count_params(Transformer(padded.model, rngs=nnx.Rngs(0)))


def test_nanochat_needs_head_dim_times_heads_equal_width(tmp_path):
  """nanochat derives head_dim = width / heads: any other shape is skipped with the reason, not run wrongly."""
  tree = tmp_path / "tree"
  (tree / "nanochat").mkdir(parents=True)
  (tree / "nanochat" / "gpt.py").write_text("raise AssertionError('must not be imported')\n")
  pytest.importorskip("torch")
  cfg = load_config("configs/tiny.yaml", SMALL + ["model.head_dim=4"])
  run, n, note = bench.nanochat_runner(tree, cfg, bench.random_batch(2, 8))
  assert run is None and n is None and "head_dim = width / heads" in note


def test_newton_schulz_flops_by_hand():
  """One layer, width 8, 2 heads x 4, MLP 32: Muon orthogonalizes q, k, v, o (8 x 8) and the MLP (8 x 32, 32 x 8).
  Per 5 iterations: 8 x 8 -> 5 (4*8*8*8 + 2*8^3) = 15,360; 8 x 32 -> 5 (4*8*8*32 + 2*8^3) = 46,080."""
  cfg = load_config("configs/tiny.yaml", ["model.vocab_size=257", "model.num_layers=1", "model.d_model=8",
                                          "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=4",
                                          "model.attention=vanilla"])
  assert bench.newton_schulz_flops(bench.model_params(cfg)) == 4 * 15_360 + 2 * 46_080


def test_default_nanochat_dir_follows_the_environment(monkeypatch, tmp_path):
  monkeypatch.setenv("SINKJAX_NANOCHAT_PEERS", str(tmp_path))
  assert bench.default_nanochat_dir() == tmp_path / "nanochat-9d4c9b7"
  monkeypatch.delenv("SINKJAX_NANOCHAT_PEERS")
  assert bench.default_nanochat_dir() == pathlib.Path(bench.__file__).resolve().parents[3] / "shared" / "peers" / \
      "nanochat-9d4c9b7"


def test_round_robin_settles_each_row_and_pairs_rounds():
  """Each round calls every runner once untimed (the switch from the previous row) and once timed; the per-round
  wall times come back in order, and the peer ratio is the median of per-round quotients (by hand)."""
  calls = []
  runners = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
  rounds = {}
  res = bench.time_round_robin(runners, repeats=3, warmup=2, settle=1, rounds=rounds)
  assert calls == ["a", "a", "b", "b"] + ["a", "a", "b", "b"] * 3
  assert set(res) == {"a", "b"} and [len(rounds[n]) for n in "ab"] == [3, 3]
  assert bench.paired_ratio([2.0, 4.0, 6.0], [1.0, 2.0, 2.0]) == (2.0, 2.0, 3.0)
  assert bench.paired_ratio([1.0, 1.0], [2.0, 0.5]) == (1.25, 0.5, 2.0)


@pytest.mark.slow   # four fresh processes, two jax compiles (~40 s)
def test_apart_runs_each_arm_in_its_own_process_and_reads_the_ratio(capsys):
  """--apart 2: each round times both arms in fresh processes, the first alternating; the summary is the geometric
  mean of the printed per-round ratios with the t-interval scipy gives on their logs."""
  from scipy import stats as sps
  peer = nanochat_peer.load(bench.NANOCHAT_TREE)          # skips without torch or the tree
  assert bench.main(["--apart", "2", "--layers", "1", "--d-model", "16", "--heads", "2", "--head-dim", "8", "--seq",
                     "8", "--batch", "2", "--repeats", "2", "--nanochat", str(peer.root)]) == 0
  out = capsys.readouterr().out
  rows = [line.split("|")[1:-1] for line in out.splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
  assert [r[1].strip() for r in rows] == ["sinkjax", "nanochat"]
  for r in rows:                                 # the quotient of the printed times, within their rounding (0.05 ms)
    s_ms, n_ms, ratio = float(r[2]), float(r[4]), float(r[6].strip().rstrip("x"))
    assert ratio == pytest.approx(n_ms / s_ms, abs=1e-3 + n_ms / s_ms * (0.05 / s_ms + 0.05 / n_ms)), r
  logs = [math.log(float(r[6].strip().rstrip("x"))) for r in rows]
  ci = sps.ttest_1samp(logs, 0.0).confidence_interval()
  got = re.search(r"geometric mean ([\d.]+)x, 95 % t-interval ([\d.]+)-([\d.]+)x", out)   # from the ratios as printed
  assert [float(x) for x in got.groups()] == pytest.approx(                                # (3 decimals)
      [math.exp(sum(logs) / 2), math.exp(ci.low), math.exp(ci.high)], rel=1e-2, abs=1e-3)


def test_apart_runs_nanochat_under_the_torch_python_when_one_is_named(monkeypatch, capsys):
  """--apart: with $SINKJAX_TORCH_PYTHON set, nanochat's process runs under that interpreter and sinkjax's under this
  one (each child's command recorded; the children's JSON lines faked); unset, both run under this one."""
  import subprocess
  import sys
  import types
  calls = []

  def fake_run(cmd, **kw):
    calls.append((cmd[0], cmd[-1]))
    return types.SimpleNamespace(returncode=0, stderr="", stdout='{"ms": %s, "cpu_s": 1.0}\n' % (
        "100.0" if cmd[-1] == "sinkjax" else "110.0"))
  monkeypatch.setattr(subprocess, "run", fake_run)
  monkeypatch.setenv("SINKJAX_TORCH_PYTHON", "/opt/torch/bin/python")
  assert bench.main(["--apart", "2", "--repeats", "1"]) == 0
  assert calls == [(sys.executable, "sinkjax"), ("/opt/torch/bin/python", "nanochat"),
                   ("/opt/torch/bin/python", "nanochat"), (sys.executable, "sinkjax")]
  assert "geometric mean 1.100x" in capsys.readouterr().out
  calls.clear()
  monkeypatch.delenv("SINKJAX_TORCH_PYTHON")
  assert bench.main(["--apart", "2", "--repeats", "1"]) == 0
  assert {c[0] for c in calls} == {sys.executable}


# ------------------------------------------------------------------------------------- sinkjax.bench.attention

ATTN = ["--seq", "16", "--heads", "2", "--head-dim", "8", "--repeats", "1"]


def test_attention_bench_fails_when_a_named_backend_fails_to_compile(monkeypatch, capsys):
  """A backend named in --impls whose program fails to compile (here the xla kernel's forward raises while traced):
  its row carries the error, the other rows still run, and the exit status is 1 (it was a 'skipped' row, status 0)."""
  from sinkjax.bench import attention
  from sinkjax.kernels import xla

  def broken(*a, **kw):
    raise NotImplementedError("broken kernel")
  monkeypatch.setattr(xla, "fwd", broken)
  assert attention.main(["--impls", "reference", "xla", *ATTN]) == 1
  out = capsys.readouterr().out
  assert re.search(r"16 +xla +- .*\(FAILED: NotImplementedError: broken kernel\)", out), out
  assert re.search(r"16 +reference +\d+\.\d", out), out                                 # the other row still timed
  assert "1 FAILED: xla (T=16)" in out


def test_attention_bench_skips_only_what_has_no_form_here(monkeypatch, capsys):
  """Off a GPU cuDNN has no form: its rows say so and the run passes (the dry run of launch/gpu_measure.sh). On a GPU
  (faked) nothing is skipped: cuDNN's compile error (here, on this CPU) fails the run."""
  from sinkjax.bench import attention
  assert attention.main(["--impls", "xla", "cudnn", "jax.nn.cudnn", *ATTN]) == 0
  out = capsys.readouterr().out
  assert re.search(r"16 +cudnn +- .*\(cuDNN runs only on NVIDIA GPUs\)", out) and "FAILED" not in out, out
  monkeypatch.setattr(attention, "current_platform", lambda: "gpu")
  assert attention.main(["--impls", "xla", "cudnn", *ATTN]) == 1
  out = capsys.readouterr().out
  assert re.search(r"16 +cudnn +- .*\(FAILED: ValueError: impl='cudnn'", out) and "1 FAILED: cudnn (T=16)" in out, out


def test_attention_bench_names_an_unknown_backend(capsys):
  from sinkjax.bench import attention
  assert attention.main(["--impls", "xla", "cuddn", *ATTN]) == 1
  err = capsys.readouterr().err
  assert "unknown backend(s) cuddn" in err and len(err.strip().splitlines()) == 1
