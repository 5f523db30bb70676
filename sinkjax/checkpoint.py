"""Checkpoints of a run: Orbax `CheckpointManager` in RUN_DIR/checkpoints, plus the params-only loader.

Each step directory holds three Orbax items:
  params  the model parameters (nnx.State of nnx.Param, float32 master weights)
  train   optimizer state, step, RNG key and the consecutive non-finite counter
  data    the Grain training-iterator state (so a resumed run reads exactly the batches it would have read)
Params are a separate item so that `load_run` (evaluation, generation, conversion) restores them alone, onto any
number of devices, without knowing the optimizer.
"""
from __future__ import annotations

import pathlib

import grain
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx

from sinkjax import config as config_lib
from sinkjax import sharding as sharding_lib
from sinkjax.config import CheckpointConfig, Config, MeshConfig

CONFIG_FILE = "config.yaml"
CHECKPOINT_DIR = "checkpoints"


class CheckpointError(ValueError):
  """A user-facing checkpoint problem (missing run dir / checkpoint, mismatching run)."""


def abstract_with_shardings(tree, shardings):
  """`jax.ShapeDtypeStruct`s of `tree` (arrays or shapes) placed by the matching tree of `shardings`."""
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class Checkpointer:
  """Saves and restores the training state of one run directory (only the latest `keep` steps are kept)."""

  def __init__(self, run_dir: str | pathlib.Path, cfg: CheckpointConfig, *, read_only: bool = False):
    self.directory = pathlib.Path(run_dir).absolute() / CHECKPOINT_DIR
    options = ocp.CheckpointManagerOptions(max_to_keep=cfg.keep, enable_async_checkpointing=cfg.async_save,
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
    return self.manager.save(step, args=args, force=force)

  def restore(self, step: int, abstract_params, abstract_train, data_iterator):
    """Restores (params, train_state) into the shapes and shardings of the given `jax.ShapeDtypeStruct` trees,
    and sets `data_iterator` to the saved position in place."""
    args = ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params),
                              train=ocp.args.StandardRestore(abstract_train),
                              data=grain.checkpoint.CheckpointRestore(data_iterator))
    out = self.manager.restore(step, args=args)
    return out["params"], out["train"]

  def restore_params(self, step: int, abstract_params):
    out = self.manager.restore(step, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract_params)))
    return out["params"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def read_run_config(run_dir: str | pathlib.Path) -> Config:
  path = pathlib.Path(run_dir) / CONFIG_FILE
  if not path.is_file():
    raise CheckpointError(f"{run_dir} is not a run directory (no {CONFIG_FILE}); pass the run.dir of a training run")
  return config_lib.load_config(str(path))


def load_run(run_dir: str | pathlib.Path, step: int | None = None):
  """(model, cfg, tokenizer) of a training run, parameters restored from its latest (or given) checkpoint.

  Restores only the parameters, replicated over the devices of this process, whatever mesh trained them.
  """
  from sinkjax.data import build_tokenizer  # the data package imports heavy readers lazily; keep startup light
  from sinkjax.model import Transformer

  run_dir = pathlib.Path(run_dir)
  if not run_dir.is_dir():
    raise CheckpointError(f"run directory {run_dir} does not exist")
  cfg = read_run_config(run_dir)
  if not (run_dir / CHECKPOINT_DIR).is_dir():
    raise CheckpointError(f"{run_dir} has no checkpoint ({CHECKPOINT_DIR}/ is missing); train it first")
  ckpt = Checkpointer(run_dir, cfg.checkpoint, read_only=True)
  steps = ckpt.all_steps()
  if not steps:
    raise CheckpointError(f"{run_dir} has no checkpoint in {CHECKPOINT_DIR}/; train it first")
  if step is None:
    step = max(steps)
  elif step not in steps:
    raise CheckpointError(f"{run_dir} has no checkpoint at step {step} (available: {sorted(steps)})")
  tokenizer = build_tokenizer(cfg.data)
  if cfg.model.vocab_size == 0:
    cfg.model.vocab_size = tokenizer.vocab_size
  mesh = sharding_lib.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1))
  abstract_model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
  graphdef, abstract_params, rest = nnx.split(abstract_model, nnx.Param, ...)
  params = ckpt.restore_params(step, abstract_with_shardings(abstract_params,
                                                              sharding_lib.state_shardings(mesh, abstract_params)))
  ckpt.close()
  return nnx.merge(graphdef, params, rest), cfg, tokenizer
