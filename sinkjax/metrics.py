"""What a training run writes while it runs: metrics.jsonl, TensorBoard scalars (an object-store run directory
included), W&B (`sinkjax.tracking`), the progress bar and the closing plots (`MetricsLogger`), and a jax.profiler
trace of chosen steps (`Profiler`). `sinkjax.train`'s loop only calls them."""
from __future__ import annotations

import io
import json
import math
import shutil
import sys
import tempfile
import time
import warnings

import jax
import numpy as np
from tqdm import tqdm

from sinkjax import paths, plots, tracking
from sinkjax.config import Config
from sinkjax.run import read_metrics


def _tensorboardx():
  """tensorboardX, imported without torch where torch is installed and not yet loaded: its writer module imports
  torch only to recognise torch tensors, which sinkjax never logs, and that import is ~2 s of every run's start
  (measured: `import sinkjax.train` 5.3 s with it, 3.0 s without). `sys.modules[name] = None` makes `import name`
  raise ImportError, the case tensorboardX handles; the entry is removed afterwards, so torch imports as usual."""
  if "torch" in sys.modules or "tensorboardX" in sys.modules:
    import tensorboardX
    return tensorboardX
  sys.modules["torch"] = None
  try:
    import tensorboardX
  finally:
    del sys.modules["torch"]
  return tensorboardX


class _ObjectRecordWriter:
  """A TensorBoard event file on an object store through `sinkjax.paths`: the events are kept in memory and the
  whole object is uploaded at each flush (what tensorboardX does for gs:// itself, but through the same client,
  credentials and emulator settings as every other file of the run)."""

  def __init__(self, path: str):
    self.path = paths.as_path(path)
    self.buffer = io.BytesIO()

  def write(self, data: bytes) -> None:
    self.buffer.write(data)

  def flush(self) -> None:
    self.path.write_bytes(self.buffer.getvalue())

  def close(self) -> None:
    self.flush()


class _ObjectRecordWriterFactory:
  def open(self, path: str) -> _ObjectRecordWriter:
    return _ObjectRecordWriter(path)

  def directory_check(self, path: str) -> None:   # object stores have no directories to create
    del path


def _register_tensorboard_object_stores() -> None:
  for scheme in paths.REMOTE_SCHEMES:
    _tensorboardx().record_writer.register_writer_factory(scheme, _ObjectRecordWriterFactory())


class MetricsLogger:
  """The host side of each step, one step behind the device: the progress bar (its `loss` is an EMA, labelled
  `loss(ema)`; the logged lines are the step's own loss), metrics.jsonl records, TensorBoard scalars and W&B every
  train.log_every steps, and the run summary. Only process 0 writes."""

  FLUSH_S = 30.0       # object stores: the longest metrics.jsonl goes without an upload while training

  def __init__(self, cfg: Config, run_dir, *, lr_schedule, start: int, stop_at: int, progress: bool):
    self.cfg, self.run_dir, self.lr_schedule, self.stop_at = cfg, run_dir, lr_schedule, stop_at
    self.is_main = jax.process_index() == 0
    self.path = run_dir / "metrics.jsonl"
    self.tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    self.ema = None
    self.t_start = time.perf_counter()
    self.timer = {"t": self.t_start, "step": start, "paused": 0.0}
    self.summary = {"run_dir": str(run_dir), "steps": cfg.train.steps, "start_step": start, "final_loss": None,
                    "val_bpb": None, "last_importance": None}
    # Weights & Biases with logging.wandb (sinkjax.tracking), started first: a failing wandb.init leaves no bar behind
    self.tracker = tracking.start(cfg, run_dir) if self.is_main else None
    self.bar = tqdm(total=cfg.train.steps, initial=start, unit="step", dynamic_ncols=True, mininterval=1.0,
                    disable=not (self.is_main and progress))
    self.file = self.writer = None
    # Object stores have no append: there metrics.jsonl is rewritten whole (one upload, atomic) at most every
    # FLUSH_S seconds, at every checkpointed step (`flush`) and at the end, so every record a resume keeps is stored.
    self.remote = paths.is_remote(run_dir)
    self.lines: list[str] = []
    self.uploaded_at = time.perf_counter()
    if self.is_main:
      self._truncate(start)
      _register_tensorboard_object_stores()
      self.writer = _tensorboardx().SummaryWriter(str(run_dir / "tb"))
      if not self.remote:
        self.file = open(self.path, "a")  # pylint: disable=consider-using-with

  def _truncate(self, after_step: int) -> None:
    """On resume, drop records logged after the checkpoint we restart from (they will be logged again)."""
    if self.path.is_file():
      keep = [r for r in read_metrics(self.path) if r.get("step", 0) <= after_step]
      self.lines = [json.dumps(r) + "\n" for r in keep]
      paths.write_atomic(self.path, "".join(self.lines))

  def paused(self, seconds: float) -> None:
    """Time spent outside the step (evaluation, checkpoints), left out of tokens/s."""
    self.timer["paused"] += seconds

  def step_done(self, step: int, m, val_bpb) -> None:
    loss = float(jax.device_get(m["loss"]))
    if math.isfinite(loss):
      self.ema = loss if self.ema is None else 0.9 * self.ema + 0.1 * loss
    self.bar.update(1)
    ema = {"loss(ema)": f"{self.ema:.3f}"} if self.ema is not None else {}
    if not (step % self.cfg.train.log_every == 0 or step == 1 or step == self.stop_at or val_bpb is not None):
      self.bar.set_postfix(ema, refresh=False)
      return
    rec = self._record(step, jax.device_get(m), val_bpb)
    self.bar.set_postfix({**ema, "tok/s": f"{rec['tokens_per_s']:,.0f}"}, refresh=False)
    if self.is_main:
      self._write(rec)

  def _record(self, step: int, m, val_bpb) -> dict:
    now = time.perf_counter()
    dt = now - self.timer["t"] - self.timer["paused"]
    tps = (step - self.timer["step"]) * self.tokens_per_step / dt if dt > 0 and step > self.timer["step"] else 0.0
    self.timer.update(t=now, step=step, paused=0.0)
    rec = {"step": step, "loss": float(m["loss"]), "ce_loss": float(m["ce_loss"]),
           "aux_loss": float(m["aux_loss"]), "head_imbalance": float(m["head_imbalance"]),
           "importance": np.asarray(m["importance"]).round(6).tolist(), "grad_norm": float(m["grad_norm"]),
           "lr": float(self.lr_schedule(step - 1)), "tokens_per_s": round(tps, 1),
           "tokens": step * self.tokens_per_step, "finite": bool(m["finite"]),
           "elapsed_s": round(now - self.t_start, 2)}
    if val_bpb is not None:
      rec["val_bpb"] = self.summary["val_bpb"] = val_bpb
    self.summary["final_loss"], self.summary["last_importance"] = rec["loss"], rec["importance"]
    return rec

  def _write(self, rec: dict) -> None:
    if self.remote:
      self.lines.append(json.dumps(rec) + "\n")
      if time.perf_counter() - self.uploaded_at >= self.FLUSH_S:
        self.flush()
    else:
      self.file.write(json.dumps(rec) + "\n")
      self.file.flush()
    for k in ("loss", "ce_loss", "aux_loss", "head_imbalance", "grad_norm", "lr", "tokens_per_s", "val_bpb"):
      if k in rec:
        self.writer.add_scalar(f"train/{k}" if k != "val_bpb" else "val/bpb", rec[k], rec["step"])
    if self.tracker is not None:
      self.tracker.log(rec)
    if "val_bpb" in rec:
      self.bar.write(f"step {rec['step']}: loss {rec['loss']:.4f}  val_bpb {rec['val_bpb']:.4f}  head_imbalance "
                     f"{rec['head_imbalance']:.4f}  {rec['tokens_per_s']:,.0f} tok/s")

  def flush(self) -> None:
    """Stores every record logged so far (an object store: one whole-object upload of metrics.jsonl)."""
    if not self.is_main:
      return
    if self.remote:
      paths.write_atomic(self.path, "".join(self.lines))
      self.uploaded_at = time.perf_counter()
    else:
      self.file.flush()

  def note(self, text: str) -> None:
    if self.is_main:
      self.bar.write(text)

  def close(self) -> None:
    self.bar.close()
    if self.is_main:
      self.flush()
      if self.file is not None:
        self.file.close()
      self.writer.close()
      if self.tracker is not None:
        self.tracker.finish()

  def finish(self) -> None:
    """Plots and the closing line (process 0)."""
    if not self.is_main:
      return
    s, cfg = self.summary, self.cfg
    if s["last_importance"] is not None:
      plots.plot_training_curves(read_metrics(self.path), self.run_dir)
      plots.plot_importance_heatmap(s["last_importance"], self.run_dir / "importance.png",
                                    f"head importance at step {self.stop_at} ({cfg.model.attention})",
                                    layers=cfg.model.head_layers)
      print(f"done: step {self.stop_at}/{cfg.train.steps}, loss {s['final_loss']:.4f}"
            + (f", val_bpb {s['val_bpb']:.4f}" if s["val_bpb"] is not None else "")
            + f", {time.perf_counter() - self.t_start:.0f}s; run dir {self.run_dir}", flush=True)


class Profiler:
  """A jax.profiler trace of steps [train.profile_start, + train.profile_steps) into RUN_DIR/profile (a resumed
  run past profile_start traces what is left of the range; past it, nothing)."""

  def __init__(self, cfg: Config, run_dir, start: int, stop_at: int):
    t = cfg.train
    self.first = max(t.profile_start, start + 1) if t.profile_steps > 0 else 0
    self.last = min(t.profile_start + t.profile_steps - 1, stop_at)
    self.dir = run_dir / "profile" / (f"process_{jax.process_index()}" if jax.process_count() > 1 else "")
    self.run_dir, self.active = run_dir, False
    self.staging = None     # an object-store run dir: the trace is written locally, then uploaded

  def before(self, step: int) -> None:
    if step == self.first and step <= self.last:
      if paths.is_remote(self.dir):
        self.staging = tempfile.TemporaryDirectory(prefix="sinkjax-profile-")
      jax.profiler.start_trace(self.staging.name if self.staging else str(self.dir))
      self.active = True

  def after(self, step: int, m, log: MetricsLogger) -> None:
    if self.active and step == self.last:
      jax.block_until_ready(m)
      jax.profiler.stop_trace()
      self.active = False
      if self.staging is not None:
        with paths.staged_dir(self.dir) as out:
          shutil.copytree(self.staging.name, out, dirs_exist_ok=True)
        self.staging.cleanup()
      log.note(f"profile of steps {self.first}-{step} written to {self.dir} (tensorboard --logdir {self.run_dir}, "
               "or ui.perfetto.dev with its trace.json.gz)")

  def close(self) -> None:
    if self.active:      # last: a failing profiler must not keep the checkpoint from being committed
      try:
        jax.profiler.stop_trace()
      except Exception as e:  # pylint: disable=broad-except
        warnings.warn(f"could not finish the profile in {self.dir}: {e}", RuntimeWarning, stacklevel=2)
