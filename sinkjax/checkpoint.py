"""Checkpoints of a run: Orbax `CheckpointManager` in RUN_DIR/checkpoints, plus the params-only loader.

Each step directory holds three Orbax items:
  params  the model parameters (nnx.State of nnx.Param, float32 master weights)
  train   optimizer state, step, RNG key and the consecutive non-finite counter
  data    the Grain training-iterator state (so a resumed run reads exactly the batches it would have read)
Params are a separate item so that `sinkjax.run.load_run` (evaluation, generation, conversion) restores them alone,
onto any number of devices, without knowing the optimizer. The run directory around the checkpoints (config.yaml,
loading a run, preparing one) is `sinkjax.run`'s.
"""
from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import pathlib
import sys
import tempfile
import time
import traceback
import warnings

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from sinkjax import paths
from sinkjax.config import CheckpointConfig
from sinkjax.errors import UserError

CHECKPOINT_DIR = "checkpoints"

# Orbax notes that say nothing to a user: restoring items saved without per-item metadata (ours), and the
# consequences of opening a manager read-only (eval, generate, export). Other absl warnings still show.
_ORBAX_NOISE = ("Metadata file does not exist", "read_only=True, setting", "Given directory is read only")


class _QuietOrbax(logging.Filter):
  def filter(self, record: logging.LogRecord) -> bool:
    return not any(text in record.getMessage() for text in _ORBAX_NOISE)


logging.getLogger("absl").addFilter(_QuietOrbax())


class CheckpointError(UserError):
  """A user-facing checkpoint problem (missing run dir / checkpoint, mismatching run)."""


class SettingsMismatch(CheckpointError):
  """A readable checkpoint that does not fit this run's settings: a configuration change, not damage (it is never
  set aside)."""


class DataStateMismatch(SettingsMismatch):
  """A checkpoint whose data-iterator state does not fit this run's data pipeline."""


class TrainStateMismatch(SettingsMismatch):
  """A checkpoint whose optimizer / train state has another structure than this run's."""


def _key_structure(state, out=None) -> set[str]:
  """The names of the fields anywhere in a JSON-like iterator state: which transformations the pipeline has, without
  what varies as it runs (values, list lengths, index-keyed buffers)."""
  out = set() if out is None else out
  if isinstance(state, dict):
    for k, v in state.items():
      if not str(k).lstrip("-").isdigit():
        out.add(str(k))
      _key_structure(v, out)
  elif isinstance(state, (list, tuple)):
    for v in state:
      _key_structure(v, out)
  return out


def _shapes(tree) -> list[tuple[int, ...]]:
  return sorted(tuple(int(d) for d in x.shape) for x in jax.tree.leaves(tree))


def abstract_with_shardings(tree, shardings):
  """`jax.ShapeDtypeStruct`s of `tree` (arrays or shapes) placed by the matching tree of `shardings`."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpointer:
  """Saves and restores the training state of one run directory (only the latest `keep` steps are kept)."""

  def __init__(self, run_dir: str | pathlib.Path, cfg: CheckpointConfig, *, read_only: bool = False):
    run_dir = paths.as_path(run_dir, "run directory")
    # Orbax wants absolute local paths; a gs:// directory is Orbax's own business (its commit protocol on GCS).
    self.directory = (run_dir if paths.is_remote(run_dir) else paths.as_path(os.path.abspath(run_dir))) \
        / CHECKPOINT_DIR
    self.read_only = read_only
    keep = ocp.checkpoint_managers.LatestN(cfg.keep)
    if cfg.keep_steps:      # checkpoint.keep_steps: the latest `keep` and these, whatever their age
      keep = ocp.checkpoint_managers.AnyPreservationPolicy(
          [keep, ocp.checkpoint_managers.CustomSteps([int(s) for s in cfg.keep_steps])])
    options = ocp.CheckpointManagerOptions(preservation_policy=keep, enable_async_checkpointing=cfg.async_save,
                                           create=not read_only, read_only=read_only)
    self.manager = ocp.CheckpointManager(self.directory, options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, params, train_state, data_iterator, *, force: bool = False) -> bool:
    """Saves (asynchronously when configured) and returns whether a checkpoint was written.

    Refuses non-finite parameters: the trainer skips non-finite updates, so this is an invariant.
    """
    finite = jax.tree.reduce(lambda a, b: a & b, jax.tree.map(lambda x: jnp.isfinite(x).all(), params), True)
    assert bool(finite), f"refusing to checkpoint non-finite parameters at step {step}"
    args = ocp.args.Composite(params=ocp.args.StandardSave(params), train=ocp.args.StandardSave(train_state),
                              data=grain.checkpoint.CheckpointSave(data_iterator))
    try:
      return self.manager.save(step, args=args, force=force)
    except Exception as e:  # pylint: disable=broad-except
      raise _write_error(self.directory, step, e) from e

  def restore(self, step: int, abstract_params, abstract_train, data_iterator):
    """Restores (params, train_state) into the shapes and shardings of the given `jax.ShapeDtypeStruct` trees,
    and sets `data_iterator` to the saved position in place."""
    self._check_train_structure(step, abstract_train)
    args = ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params),
                              train=ocp.args.StandardRestore(abstract_train))
    try:
      out = self.manager.restore(step, args=args)
    except ValueError as e:
      if "tree structures do not match" not in str(e):
        raise
      raise self._train_mismatch(step, "another tree structure") from e
    self._check_data_state(step, data_iterator)
    try:
      self.manager.restore(step, args=ocp.args.Composite(data=grain.checkpoint.CheckpointRestore(data_iterator)))
    except (KeyError, TypeError, AttributeError, IndexError) as e:
      # The state file was read (a damaged one fails to parse: ValueError) but does not fit this pipeline.
      raise self._data_mismatch(step, _first_line(e)) from e
    return out["params"], out["train"]

  def _data_mismatch(self, step: int, what: str) -> DataStateMismatch:
    return DataStateMismatch(
        f"checkpoint step {step} in {self.directory} holds the position of a data pipeline built with other "
        f"settings ({what}): resume with the data.* settings and the number of JAX processes it was trained with "
        f"(data.packing, data.shuffle_batches, data.num_workers, data.source)")

  def _check_data_state(self, step: int, data_iterator) -> None:
    """Raises DataStateMismatch when the saved iterator state of this process does not have the structure (nested
    keys) of `data_iterator`'s, or was written by another number of processes. Unreadable files are left to the
    restore (a damaged checkpoint is set aside there)."""
    folder = self.directory / str(step) / "data"
    pi, pc = jax.process_index(), jax.process_count()
    path = folder / f"process_{pi}-of-{pc}.json"
    if not path.is_file():
      others = sorted(p.name for p in folder.glob("process_*-of-*.json")) if folder.is_dir() else []
      if others:
        raise self._data_mismatch(step, f"written by another number of processes: {others[0]}, this is "
                                        f"process {pi} of {pc}")
      return
    try:
      saved = json.loads(path.read_text())
      if isinstance(saved, str):          # grain stores the state as a JSON string inside the file
        saved = json.loads(saved)
      want = data_iterator.get_state()
    except Exception:  # pylint: disable=broad-except
      return
    if _key_structure(saved) != _key_structure(want):
      raise self._data_mismatch(step, "its iterator state has other fields")

  def _check_train_structure(self, step: int, abstract_train) -> None:
    """Raises TrainStateMismatch when the saved train state's leaves (shapes) differ from the target's."""
    try:
      md = ocp.StandardCheckpointer().metadata(self.directory / str(step) / "train")
      saved = _shapes(getattr(getattr(md, "item_metadata", md), "tree", md))
    except Exception:  # pylint: disable=broad-except
      return           # unreadable metadata: the restore itself reports it (and sets the step aside)
    want = _shapes(abstract_train)
    if saved != want:
      raise self._train_mismatch(step, f"{len(saved)} arrays where this run expects {len(want)}")

  def _train_mismatch(self, step: int, what: str) -> TrainStateMismatch:
    return TrainStateMismatch(
        f"checkpoint step {step} in {self.directory} holds an optimizer state of another structure ({what}): "
        f"train.optimizer, train.grad_clip (on/off) or lora.* changed since it was written; resume with the "
        f"settings it was trained with, or start a new run.dir with train.init_from={self.directory.parent} to "
        f"begin from its weights")

  def restore_latest(self, abstract_params, abstract_train, data_iterator):
    """(step, params, train_state) of the newest checkpoint that restores; see `restore_newest`."""
    return restore_newest(self, lambda s: self.restore(s, abstract_params, abstract_train, data_iterator))

  def save_params(self, step: int, params) -> None:
    """A params-only checkpoint (what the converters write: a model without optimizer or data state), waited for."""
    try:
      self.manager.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)), force=True)
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise _write_error(self.directory, step, e) from e

  def restore_params(self, step: int, abstract_params):
    out = self.manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params)))
    return out["params"]

  def wait(self) -> None:
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # pylint: disable=broad-except
      raise _write_error(self.directory, self.latest_step(), e) from e

  def close(self) -> None:
    try:
      self.wait()
    finally:
      self.manager.close()

  def set_aside(self, step: int):
    """Renames an unreadable step directory to STEP.corrupt-TIME (kept for inspection; Orbax ignores it, so the
    step can be saved again) and returns the new path; None when read-only or the rename fails."""
    src = self.directory / str(step)
    if self.read_only or not src.is_dir():
      return None
    dst = self.directory / f"{step}.corrupt-{int(time.time())}"
    try:
      if paths.is_remote(src):
        src.rename(dst)              # an object store: copy + delete of the step's objects
      else:
        os.rename(src, dst)
    except Exception:  # pylint: disable=broad-except
      return None
    self.manager.reload()
    return dst


def _first_line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


def _root_line(e: BaseException, limit: int = 160) -> str:
  """The first line of the innermost cause of `e` (Orbax wraps TensorStore's precise error), shortened."""
  while e.__cause__ is not None:
    e = e.__cause__
  text = _first_line(e).split(". See full TensorStore details")[0]
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _os_error(e: BaseException) -> OSError | None:
  """The OSError somewhere in the cause / context chain of `e` (Orbax wraps errors of its writer threads)."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno is not None:
      return e
    e = e.__cause__ or e.__context__
  return None


def _write_error(directory, step, e: BaseException) -> "CheckpointError":
  """A one-line CheckpointError for a failed checkpoint write (full disk, unwritable directory, ...)."""
  os_err = _os_error(e)
  if os_err is not None and os_err.errno == errno.ENOSPC:
    why = "the disk is full (No space left on device); free space or set run.dir on a larger disk"
  elif os_err is not None and os_err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
    why = f"{os_err.strerror or 'permission denied'}; set run.dir=SOMEWHERE_WRITABLE"
  elif os_err is not None:
    why = os_err.strerror or _first_line(os_err)
  else:
    why = _first_line(e)
  return CheckpointError(f"could not write the checkpoint of step {step} to {directory}: {why}")


@contextlib.contextmanager
def _captured_stderr():
  """Everything this process writes to its stderr meanwhile (file descriptor 2: TensorStore's C++ logs, tracebacks
  that asyncio prints from TensorStore's callback threads, Python's own writes) goes to a temporary file; yields a
  function that reads what was captured. Tasks that die with the failed restore are collected before the end, so
  their "exception was never retrieved" reports land here too."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile(mode="w+b") as tmp:
    os.dup2(tmp.fileno(), 2)
    try:
      yield lambda: (tmp.seek(0), tmp.read().decode(errors="replace"))[1]
    finally:
      gc.collect()
      time.sleep(0.05)                    # callbacks of TensorStore threads that were already under way
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)


def _keep_log(ckpt: "Checkpointer", step: int, moved, text: str, error: BaseException) -> str:
  """Writes what a failed restore printed, and its exception, beside the damaged checkpoint (its set-aside directory,
  else RUN_DIR/checkpoints/restore-STEP.log); returns where, or '' when nothing could be written."""
  path = (moved / "restore-errors.log") if moved is not None else ckpt.directory / f"restore-{step}.log"
  body = f"restoring checkpoint step {step} failed:\n{''.join(traceback.format_exception(error))}\n" \
         f"what the libraries printed meanwhile:\n{text}"
  try:
    path.write_text(body)
  except Exception:  # pylint: disable=broad-except  # read-only run directories (eval, generate)
    return ""
  return str(path)


def restore_newest(ckpt: "Checkpointer", restore_one, max_fallbacks: int | None = None):
  """Restores the newest step that restores cleanly: a step whose restore raises (a truncated or corrupted file,
  a step directory that lost an item) is set aside when writable, what the libraries printed about it is kept in a
  log beside it instead of the terminal, and the next older one is tried; one warning line then names the unreadable
  step(s), the step resumed from and the log. Raises CheckpointError when none restores. Returns (step, *restored)."""
  steps = sorted(ckpt.all_steps(), reverse=True)
  if not steps:
    raise CheckpointError(f"{ckpt.directory} holds no complete checkpoint")
  errors, logs = [], []
  for step in steps[:max_fallbacks]:
    failure = None
    with _captured_stderr() as captured:
      try:
        out = restore_one(step)
      except Exception as e:  # pylint: disable=broad-except
        failure = e
      text = captured()
    if isinstance(failure, SettingsMismatch):
      sys.stderr.write(text)             # what was printed meanwhile is shown: nothing is lost
      raise failure                      # the checkpoint is fine; the settings differ: nothing is set aside
    if failure is None:
      sys.stderr.write(text)             # a clean restore's own messages, if any, are shown as usual
      if errors:
        warnings.warn(f"resumed from checkpoint step {step}: the newer {', '.join(errors)} could not be restored"
                      + (f" (set aside; what went wrong: {', '.join(logs)})" if logs else ""), RuntimeWarning,
                      stacklevel=3)
      return (step, *(out if isinstance(out, tuple) else (out,)))
    moved = ckpt.set_aside(step)
    errors.append(f"step {step} ({_root_line(failure)})")
    log = _keep_log(ckpt, step, moved, text, failure)
    if log:
      logs.append(log)
  raise CheckpointError(f"no checkpoint in {ckpt.directory} could be restored ({'; '.join(errors)})"
                        + (f"; details in {', '.join(logs)}" if logs else ""))
