"""`python -m sinkjax.bench.trainer`: the trainer's step decomposed into rows (docs/PERF.md, the trainer gap on an
H100). Checked here: the block timing's arithmetic under a fake clock, the one-segment batch by hand, the chip
mapping, and that every row runs the trainer's own step on a CPU (no timing is asserted)."""
import pathlib

import numpy as np
import pytest

from sinkjax.bench import trainer as bench_trainer

TINY = str(pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml")


def test_time_blocks_is_the_median_block_over_its_steps(monkeypatch):
  """Each row runs one untimed block of 2 calls, then `rounds` timed blocks of `steps` calls, round-robin with the
  order rotating each round; the result is the median block time / steps. With a clock that advances 1 s per call, a row whose calls cost k ticks
  gives k s per step."""
  clock = [0.0]
  monkeypatch.setattr(bench_trainer.time, "perf_counter", lambda: clock[0])
  calls = []

  def runner(name, cost):
    def run(n):
      calls.append((name, n))
      clock[0] += cost * n
    return run
  res = bench_trainer.time_blocks({"a": runner("a", 3.0), "b": runner("b", 0.5)}, steps=4, rounds=3)
  assert res == {"a": 3.0, "b": 0.5}
  assert calls == [("a", 2), ("b", 2)] + [("a", 4), ("b", 4), ("b", 4), ("a", 4), ("a", 4), ("b", 4)]


def test_one_segment_batch_by_hand():
  batch = {"inputs": np.arange(6, dtype=np.int32).reshape(2, 3), "targets": np.ones((2, 3), np.int32),
           "segment_ids": np.array([[1, 1, 2], [1, 2, 2]], np.int32),
           "positions": np.array([[0, 1, 0], [0, 0, 1]], np.int32),
           "loss_mask": np.array([[1, 0, 1], [1, 1, 0]], np.float32)}
  out = bench_trainer.one_segment(batch)
  np.testing.assert_array_equal(out["segment_ids"], [[1, 1, 1], [1, 1, 1]])
  np.testing.assert_array_equal(out["positions"], [[0, 1, 2], [0, 1, 2]])
  np.testing.assert_array_equal(out["loss_mask"], np.ones((2, 3)))
  np.testing.assert_array_equal(out["inputs"], batch["inputs"])
  np.testing.assert_array_equal(batch["segment_ids"], [[1, 1, 2], [1, 2, 2]])     # the input is not changed


def test_chip_of_device_kinds():
  kind = lambda k: type("D", (), {"device_kind": k})()
  assert bench_trainer.chip_of(kind("NVIDIA H100 80GB HBM3")) == "h100"
  assert bench_trainer.chip_of(kind("NVIDIA H200")) == "h200"
  assert bench_trainer.chip_of(kind("TPU v5 lite")) == "v5e"
  assert bench_trainer.chip_of(kind("cpu")) is None


@pytest.mark.slow  # ~14 s of compiling: the CLI of a benchmark (as bench.train's and bench.attention's are)
def test_every_row_runs_the_trainers_step_on_a_cpu(capsys):
  """tiny.yaml shrunk to 1 layer, 8 rows x 64 tokens (over the test session's 8 CPU devices): one round of one step per row; the table has every row with a positive
  time, and the CPU has no peak figures, so no MFU and no estimate."""
  assert bench_trainer.main(["--config", TINY, "train.batch_size=8", "data.seq_len=64",
                             "model.max_seq_len=64", "model.num_layers=1", "--steps", "1", "--rounds", "1"]) == 0
  out = capsys.readouterr().out
  rows = {line.split("|")[1].strip(): line.split("|")[2:-1] for line in out.splitlines()
          if line.startswith("| ") and not line.startswith("| row")}
  assert list(rows) == list(bench_trainer._ROWS)
  assert all(float(cells[0]) > 0 and cells[2].strip() == "-" for cells in rows.values())
  assert "no roofline estimate: no peak figures for cpu" in out
