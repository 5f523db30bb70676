"""Benchmark of the trainer's own step: where `python -m sinkjax.train`'s time per step goes, and how it compares
with the compiler's roofline estimate.

    python -m sinkjax.bench.trainer --config configs/streaming_vanilla.yaml [section.key=value ...]
                                    [--steps 20] [--rounds 3] [--no-estimate]

It builds the trainer of the config (`sinkjax.train.Trainer`: its mesh, jitted step with shardings and donation,
its real data iterator over the config's data) in a temporary run directory, and times, round-robin, blocks of
`--steps` consecutive steps of each row (the block ends when its last step's results are on the device):

  data            the host side of a batch alone: `next(train_iter)` and `to_global_batch` (placed on the devices)
  step, packed    the trainer's jitted step on one fixed batch from the data (its segments as packed), no host work
  step, 1 segment the same step on a batch of one document per row (positions 0..T-1): what `bench.train` feeds
  step, batch re-sent      the fixed packed batch, copied from the host to the devices again before every step
  step, batches on device  a different packed batch every step, all of them placed on the devices beforehand
  trainer.step    `Trainer.step()`: a fresh batch from the iterator, then the step, as the loop calls it
  train loop      the loop of `sinkjax.train.train` without evaluation and checkpoints: each step dispatched, then
                  the previous step's metrics taken to the host and logged (`step_done`: the non-finite guard, the
                  loss, the records every train.log_every steps), so the device runs one step ahead of the host
  bench.train     `sinkjax.bench.train`'s step of the same config (jitted without shardings or donation, a fixed
                  one-segment batch, each step waited for)

The table gives ms per step (median block over the rounds, divided by --steps), tokens/s, and MFU with nanochat's
FLOP count (`sinkjax.compile.model_flops_per_step`: 6N + attention) over the chip's peak (`sinkjax.hlo.CHIPS`).
Unless --no-estimate, the trainer's step is also compiled as `sinkjax.compile` does and its roofline estimate
(`compile.speed_report`: compiled FLOPs, HBM bytes, collective bytes at the chip's peaks) is printed beside the
measurement: an estimate is a lower bound on the step time, so measured / estimate says how far the step is from it.
On a GPU the Pallas attention kernel is a Triton custom call that XLA's HLO does not cost: the estimate leaves
attention's FLOPs out there.
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":
  errors.require_extra("sinkjax.bench.trainer")   # before the imports below, which need the train extra

import dataclasses
import pathlib
import statistics
import sys
import tempfile
import time

import jax
import numpy as np

from sinkjax import options
from sinkjax.config import declare
from sinkjax.markdown import table

_ROWS = ("data", "step, packed", "step, 1 segment", "step, batch re-sent", "step, batches on device", "trainer.step",
         "train loop", "bench.train")


def chip_of(device) -> str | None:
  """The `sinkjax.hlo.CHIPS` key of a device, or None when its peak figures are not known."""
  kind = device.device_kind.lower()
  for chip, names in (("h100", ("h100",)), ("h200", ("h200",)), ("v5e", ("v5 lite", "v5e")), ("v5p", ("v5p",)),
                     ("v6e", ("v6", "trillium")), ("v4", ("v4",))):
    if any(n in kind for n in names):
      return chip
  return None


def one_segment(batch: dict) -> dict:
  """The batch with one document per row: segment ids 1, positions 0..T-1 (inputs and targets unchanged)."""
  B, T = batch["inputs"].shape
  out = dict(batch)
  out["segment_ids"] = np.ones((B, T), np.int32)
  out["positions"] = np.tile(np.arange(T, dtype=np.int32), (B, 1))
  out["loss_mask"] = np.ones((B, T), np.float32)
  return out


def time_blocks(runners: dict, steps: int, rounds: int) -> dict:
  """{row: median over rounds of (wall seconds of a block of `steps` calls) / steps}; each runner(steps) runs its
  block and waits for its results. One untimed block of every row first (compiles, caches). Round r starts at row r
  (the order rotates): a row that follows the data iterator's rows runs while the iterator's prefetch threads still
  work, which on an H100 made the same step 20 ms slower than in another place of the round."""
  for run in runners.values():
    run(2)
  walls = {name: [] for name in runners}
  names = list(runners)
  for r in range(rounds):
    for name in names[r % len(names):] + names[:r % len(names)]:
      run = runners[name]
      t0 = time.perf_counter()
      run(steps)
      walls[name].append((time.perf_counter() - t0) / steps)
  return {name: statistics.median(w) for name, w in walls.items()}


def build_runners(trainer, cfg, rows=_ROWS) -> tuple:
  """The `rows` of the table (see the module docstring) as block runners over one trainer, and the metrics logger
  the train loop row writes to (close it after timing)."""
  from sinkjax.bench import train as bench_train  # pylint: disable=import-outside-toplevel
  from sinkjax.data import to_global_batch  # pylint: disable=import-outside-toplevel
  from sinkjax.metrics import MetricsLogger  # pylint: disable=import-outside-toplevel
  from sinkjax.step import TRAIN_FEATURES  # pylint: disable=import-outside-toplevel
  from sinkjax.train import step_done  # pylint: disable=import-outside-toplevel

  def host_batch():
    return {k: v for k, v in next(trainer.train_iter).items() if k in TRAIN_FEATURES}

  packed = host_batch()
  fixed = {"step, packed": to_global_batch(packed, trainer.batch_sh),
           "step, 1 segment": to_global_batch(one_segment(packed), trainer.batch_sh)}

  on_device = [to_global_batch(host_batch(), trainer.batch_sh) for _ in range(8)]

  def resent(n):
    m = None
    for _ in range(n):
      trainer.state, m = trainer.train_step(trainer.state, to_global_batch(packed, trainer.batch_sh), trainer.rest)
    jax.block_until_ready(m)

  def batches_on_device(n):
    m = None
    for i in range(n):
      trainer.state, m = trainer.train_step(trainer.state, on_device[i % len(on_device)], trainer.rest)
    jax.block_until_ready(m)

  def data(n):
    for _ in range(n):
      jax.block_until_ready(to_global_batch(host_batch(), trainer.batch_sh))

  def fixed_step(name):
    def run(n):
      m = None
      for _ in range(n):
        trainer.state, m = trainer.train_step(trainer.state, fixed[name], trainer.rest)
      jax.block_until_ready(m)
    return run

  def trainer_steps(n):
    m = None
    for _ in range(n):
      m = trainer.step()
    jax.block_until_ready(m)

  log = MetricsLogger(cfg, trainer.run_dir, lr_schedule=trainer.lr_schedule, start=0, stop_at=10 ** 9,
                      progress=False)
  counter = [0]

  def train_loop(n):
    pending = None
    for _ in range(n):
      counter[0] += 1
      m = trainer.step()
      if pending is not None:
        step_done(cfg, log, *pending)
      pending = (counter[0], m, None)
    step_done(cfg, log, *pending)

  def bench_step(n):
    if not bench:      # compiled on first use: a row not asked for costs nothing
      bench.append(bench_train.jax_runner(cfg, one_segment(packed))[0])
    for _ in range(n):
      bench[0]()
  bench = []

  runners = {"data": data, "step, packed": fixed_step("step, packed"),
             "step, 1 segment": fixed_step("step, 1 segment"), "step, batch re-sent": resent,
             "step, batches on device": batches_on_device, "trainer.step": trainer_steps,
             "train loop": train_loop, "bench.train": bench_step}
  return {name: runners[name] for name in rows}, log


def estimate(trainer, cfg) -> dict | None:
  """`sinkjax.compile`'s speed report of the trainer's compiled step on these devices (None: chip not known)."""
  from sinkjax import compile as compile_lib  # pylint: disable=import-outside-toplevel
  from sinkjax import hlo  # pylint: disable=import-outside-toplevel
  devices = trainer.mesh.devices.flatten()
  chip = chip_of(devices[0])
  if chip is None:
    return None
  lowered, _ = trainer.lower()
  report = compile_lib.speed_report(lowered.compile(), hlo.CHIPS[chip],
                                    compile_lib.model_flops_per_step(cfg, trainer.num_params), len(devices))
  report["chip"] = chip
  return report


def measure(opts: TrainerBenchOptions, overrides: list[str] | tuple = ()) -> None:
  """Times opts.rows of opts.config (with the config overrides `overrides`) and prints the table."""
  from sinkjax import compile as compile_lib  # pylint: disable=import-outside-toplevel
  from sinkjax import hlo  # pylint: disable=import-outside-toplevel
  from sinkjax.config import load_config  # pylint: disable=import-outside-toplevel
  from sinkjax.train import Trainer  # pylint: disable=import-outside-toplevel
  with tempfile.TemporaryDirectory(prefix="sinkjax-bench-trainer-") as tmp:
    cfg = load_config(opts.config, list(overrides) + [f"run.dir={tmp}/run", "train.eval_batches=0",
                                                           "checkpoint.async_save=false"])
    trainer = Trainer(cfg)
    cfg = trainer.cfg
    B, T = cfg.train.batch_size, cfg.data.seq_len
    devices = trainer.mesh.devices.flatten()
    chip = chip_of(devices[0])
    model_flops = compile_lib.model_flops_per_step(cfg, trainer.num_params)
    print(f"# {opts.config} {' '.join(overrides)}: {cfg.model.attention}, {trainer.num_params:,} params, "
          f"{B} x {T} tokens per step, {cfg.model.dtype}, remat {cfg.model.remat} ({cfg.model.remat_policy}), "
          f"packing {cfg.data.packing}; {len(devices)} x {devices[0].device_kind}; "
          f"{opts.rounds} rounds of {opts.steps} steps per row", flush=True)
    est = None if opts.no_estimate else estimate(trainer, cfg)
    runners, log = build_runners(trainer, cfg, opts.rows)
    try:
      res = time_blocks(runners, opts.steps, opts.rounds)
    finally:
      log.close()
    peak = hlo.CHIPS[chip].peak_flops * len(devices) if chip else None
    mfu = lambda name: f"{model_flops / res[name] / peak:.1%}" if peak and name != "data" else "-"
    print("", *table(["row", "ms / step", "tokens/s", f"MFU (6N + attention{', ' + chip + ' peak' if chip else ''})"],
                     ([name, f"{res[name] * 1e3:.2f}", f"{B * T / res[name]:,.0f}", mfu(name)] for name in opts.rows),
                     "lrrr"), sep="\n")
    step = res.get("step, packed") or res.get("trainer.step") or res.get("train loop")
    if est is not None and step:
      terms = est["estimated_seconds_by_term"]
      print(f"\nroofline estimate ({est['chip']}, sinkjax.compile): compute {terms['compute'] * 1e3:.2f} ms, HBM "
            f"{terms['hbm'] * 1e3:.2f} ms, ICI {terms['ici'] * 1e3:.2f} ms -> >= "
            f"{est['estimated_step_seconds'] * 1e3:.2f} ms ({est['estimated_bound']}-bound; compiled FLOPs "
            f"{est['flops_per_step']:.3e}, recomputed {est['recompute_flops_per_step']:.3e}, model "
            f"{model_flops:.3e}); measured step {step * 1e3:.2f} ms = "
            f"{step / est['estimated_step_seconds']:.2f}x the estimate")
    elif not opts.no_estimate and est is None:
      print(f"\nno roofline estimate: no peak figures for {devices[0].device_kind} (sinkjax.hlo.CHIPS)")
    if opts.profile:
      profile(trainer, runners[opts.rows[0]], opts.steps, opts.profile)


def profile(trainer, run, steps: int, out_dir: str) -> None:
  """`steps` steps of one row traced by jax.profiler into out_dir, the step's compiled text beside it (step.hlo.txt),
  and the trace summarised by kernel category (`sinkjax.bench.profile_summary`)."""
  from sinkjax.bench import profile_summary  # pylint: disable=import-outside-toplevel
  out = pathlib.Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  hlo = trainer.lower()[0].compile().as_text()
  (out / "step.hlo.txt").write_text(hlo)
  run(1)
  with jax.profiler.trace(str(out / "trace")):
    run(steps)
  s = profile_summary.summarize(out / "trace", [hlo], steps)
  print(f"\nprofile of {steps} steps ({out / 'trace'}), device time by kernel category (sinkjax.bench.profile_summary):")
  print(profile_summary.format_summary(s))


@dataclasses.dataclass
class TrainerBenchOptions:
  """The bench_trainer.* options (`python -m sinkjax.bench.trainer`; each flag the alias of its key). Its --config is
  the training config timed, so the command has no file of options."""
  config: str = declare("", alias="--config", metavar="CONFIG", required=True, help="the training config (a YAML file or a packaged name)")
  steps: int = declare(20, ">=1", alias="--steps", help="steps per timed block")
  rounds: int = declare(3, ">=1", alias="--rounds", help="timed blocks per row (median)")
  no_estimate: bool = declare(False, alias="--no-estimate", help="skip the roofline estimate (one more compile)")
  profile: str | None = declare(None, alias="--profile", metavar="DIR",
                            help="after timing, trace --steps steps of the first row into DIR and print the device "
                                 "time per kernel category (sinkjax.bench.profile_summary)")
  rows: list[str] = declare(list(_ROWS), choices=_ROWS, alias="--rows", nargs="+", metavar="ROW",
                        help=f"rows to time (default all: {', '.join(repr(r) for r in _ROWS)})")


COMMAND = options.Command(prog="python -m sinkjax.bench.trainer", description=__doc__,
                          sections={"bench_trainer": TrainerBenchOptions}, run_overrides=True, options_file=None,
                          raw_description=True)


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, overrides: measure(sections["bench_trainer"], overrides))


if __name__ == "__main__":
  sys.exit(main())
