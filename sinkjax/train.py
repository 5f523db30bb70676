"""Training: `python -m sinkjax.train --config configs/NAME.yaml [section.key=value ...]`.

The story, top to bottom: read the config, build tokenizer and data, build the model and optimizer on the mesh,
resume from RUN_DIR/checkpoints if a checkpoint exists, then loop: one jitted step per optimizer update (gradient
accumulation inside it), validation BPB every train.eval_every steps, logs every train.log_every steps, checkpoints
every checkpoint.every steps and at the end (and on SIGTERM / SIGINT, at the same step in every process of a
multi-process run: `sinkjax.distributed.StopVote`). Plots are written when the run ends.

Loss = masked mean cross-entropy + the sink-aware load-balancing loss on the layer x head importances
(`sinkjax.balance.aux_loss`, eq. 7 or eq. 8; traced at every loss.aux_weight, 0 included, so that a λ = 0 arm
runs the same program as λ > 0; loss.aux_term=false leaves it out). The model computes in
model.dtype (bfloat16 by default) on float32 master weights. A step whose loss, gradient norm or updated
parameters are non-finite leaves parameters and optimizer state untouched; train.max_nonfinite such steps in a row
stop the run (no checkpoint is written from a non-finite state).

Run directory: config.yaml (the resolved config), checkpoints/ (Orbax), metrics.jsonl, tb/ (TensorBoard),
loss.png, head_imbalance.png, importance.png. Only process 0 writes logs. The same command again resumes an
unfinished run from its latest checkpoint; on a finished one it writes nothing (every file stays as it was) and says
that `train.steps=N`, N above the run's, extends it.
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":
  errors.require_extra("sinkjax.train")    # before the imports below: without the train extra, one line naming it

import copy
import dataclasses
import math
import sys
import time

import jax
import jax.numpy as jnp
import yaml
from flax import nnx

from sinkjax import distributed, optim, options, paths, tracking
from sinkjax import lora as lora_lib
from sinkjax import checkpoint as ckpt_lib
from sinkjax import config as config_lib
from sinkjax import run as run_lib
from sinkjax import sharding as sharding_lib
from sinkjax.cache import make_cache
from sinkjax.errors import Interrupted, UserError
from sinkjax.config import Config, ConfigError, declare
from sinkjax.data import build_tokenizer, make_eval_batches, make_train_iterator, sft, to_global_batch
from sinkjax.metrics import MetricsLogger, Profiler
from sinkjax.step import EVAL_FEATURES, TRAIN_FEATURES, make_eval_step, make_train_step
from sinkjax.model import Transformer, count_params

class TrainError(UserError):
  """The run had to stop (e.g. non-finite losses); the message says why and what to change."""


# --------------------------------------------------------------------------------------------------------------
# Setup helpers
# --------------------------------------------------------------------------------------------------------------

def check_vocab(m, tokenizer_vocab: int) -> None:
  """model.vocab_size 0 takes the tokenizer's; a smaller one than the tokenizer's is an error."""
  if m.vocab_size == 0:
    m.vocab_size = tokenizer_vocab
  elif m.vocab_size < tokenizer_vocab:
    raise ConfigError(f"model.vocab_size ({m.vocab_size}) is smaller than the tokenizer's ({tokenizer_vocab}); set "
                      "it to 0 to take the tokenizer's")


def total_steps(cfg: Config, num_params: int) -> int:
  """train.steps, or the token budget train.tokens_per_param x parameters / tokens per step when it is 0."""
  if cfg.train.steps > 0:
    return cfg.train.steps
  tokens_per_step = cfg.train.batch_size * cfg.data.seq_len       # nanochat: target_tokens // total_batch_size
  return max(1, int(cfg.train.tokens_per_param * num_params) // tokens_per_step)


# --------------------------------------------------------------------------------------------------------------
# The run: model, optimizer and data on the mesh, restored or initialized
# --------------------------------------------------------------------------------------------------------------

class TrainedParams:
  """Which parameters the optimizer trains. Without LoRA all of them (`rest` is empty); with lora.rank > 0 only the
  adapters (nnx.LoRAParam), and the frozen base weights travel as `rest`, an argument of the jitted step. The
  checkpoint's params item always holds every parameter, so load_run, evaluation and export read a run on its own."""

  def __init__(self, cfg: Config):
    self.cfg = cfg
    self.filter = lora_lib.trainable(cfg.lora)

  def build_model(self):
    seed = self.cfg.train.seed
    return lora_lib.apply(Transformer(self.cfg.model, rngs=nnx.Rngs(seed)), self.cfg.lora, nnx.Rngs(seed + 1))

  def split_model(self, model):
    """(graphdef, trained params, rest)."""
    return nnx.split(model, self.filter, ...)

  def full(self, params, rest):
    return nnx.merge_state(params, rest) if self.cfg.lora.rank else params

  def split(self, full, rest_shapes):
    return tuple(nnx.split_state(full, self.filter, ...)) if self.cfg.lora.rank else (full, rest_shapes)


def step_compiler_options(cfg: Config, mesh) -> dict | None:
  """The XLA compile options of the train and eval steps on `mesh`: mesh.collective_matmul's on TPU
  (`sharding.compiler_options`); on a GPU with train.gpu_gemm=cublas, XLA's Triton matmuls off, so every matmul is a
  cuBLAS call (the d20 step's weight-gradient matmuls ran at 564 TFLOP/s in Triton against cuBLAS's ~709 on an H200;
  docs/PERF.md, "d20 on one GPU: the step's levers")."""
  options = sharding_lib.compiler_options(cfg.mesh.collective_matmul, mesh)
  if cfg.train.gpu_gemm == "cublas" and mesh is not None and sharding_lib.mesh_platform(mesh) == "gpu":
    options = {**(options or {}), "xla_gpu_enable_triton_gemm": False}
  return options


class JittedSteps:
  """The jitted train and eval steps of a config on a mesh, with the state's shapes and shardings: the part of a run
  that is compiled. `Trainer` runs it; `sinkjax.compile` lowers and compiles the same object for the devices of a
  TPU slice or GPU node that need not be present (compile-only devices), so what it reports is what training runs.
  Resolves cfg.train.steps (the token budget) and needs cfg.model.vocab_size set."""

  def __init__(self, cfg: Config, mesh, shared=None):
    self.cfg, self.mesh, self.shared = cfg, mesh, shared
    self.micro = self._micro_batch()
    self.params = TrainedParams(cfg)
    abstract_model = nnx.eval_shape(self.params.build_model)
    assert not jax.tree.leaves(nnx.state(abstract_model, nnx.Not(nnx.Param))), \
        "the model holds non-parameter state; the trainer needs to carry it"
    self.graphdef, abstract_params, _ = self.params.split_model(abstract_model)
    self.num_params = count_params(abstract_model)
    self.num_trainable = sum(x.size for x in jax.tree.leaves(abstract_params))
    cfg.train.steps = total_steps(cfg, self.num_params)
    self.tx, self.lr_schedule = optim.build_optimizer(cfg, cfg.train.steps)
    self._jit_steps()

  def _micro_batch(self) -> int:
    micro = self.cfg.train.batch_size // self.cfg.train.grad_accum
    shards, procs = sharding_lib.batch_shards(self.mesh), jax.process_count()
    if micro % shards or micro % procs:
      raise ConfigError(f"the micro-batch train.batch_size / train.grad_accum = {micro} must be divisible by the "
                        f"{shards} batch shards (mesh.data x mesh.fsdp) and {procs} processes")
    return micro

  def _init_state(self):
    _, params, rest = self.params.split_model(self.params.build_model())
    return {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.PRNGKey(self.cfg.train.seed), "nonfinite": jnp.zeros((), jnp.int32)}, rest

  def _jit_steps(self) -> None:
    mesh = self.mesh
    self.state_shapes, self.rest_shapes = jax.eval_shape(self._init_state)
    self.state_sh = sharding_lib.state_shardings(mesh, self.state_shapes)
    self.rest_sh = sharding_lib.state_shardings(mesh, self.rest_shapes)
    self.batch_sh = sharding_lib.batch_sharding(mesh)
    self.donate = (0,) if sharding_lib.mesh_platform(mesh) != "cpu" else ()  # CPU: async checkpoints may alias
    shared = None if self.shared is None else jnp.asarray(self.shared)
    options = step_compiler_options(self.cfg, mesh)
    self.train_step = jax.jit(make_train_step(self.cfg, self.graphdef, None, self.tx, shared),
                              in_shardings=(self.state_sh, self.batch_sh, self.rest_sh),
                              out_shardings=(self.state_sh, sharding_lib.replicated(mesh)),
                              donate_argnums=self.donate, compiler_options=options)
    self.eval_step = jax.jit(make_eval_step(self.graphdef, None, self.cfg.train.loss_chunk),
                             in_shardings=(self.state_sh["params"], self.batch_sh, self.rest_sh),
                             out_shardings=sharding_lib.replicated(mesh), compiler_options=options)

  def abstract_batch(self, rows: int, features=TRAIN_FEATURES) -> dict:
    """Shapes of a global batch of `rows` rows as the data pipeline makes it (float32 loss mask, int32 the rest)."""
    T = self.cfg.data.seq_len
    return {k: jax.ShapeDtypeStruct((rows, T), jnp.float32 if k == "loss_mask" else jnp.int32,
                                    sharding=self.batch_sh) for k in features}

  def lower(self):
    """(train step, eval step) lowered for this mesh's devices with abstract arguments: nothing is allocated."""
    state = ckpt_lib.abstract_with_shardings(self.state_shapes, self.state_sh)
    rest = ckpt_lib.abstract_with_shardings(self.rest_shapes, self.rest_sh)
    with jax.set_mesh(self.mesh):       # as in the loop: attention runs per shard, kernels follow the mesh
      train = self.train_step.lower(state, self.abstract_batch(self.cfg.train.batch_size), rest)
      evals = self.eval_step.lower(state["params"], self.abstract_batch(self.micro, EVAL_FEATURES), rest)
    return train, evals

  def lower_decode(self, rows: int, capacity: int):
    """`sinkjax.generate`'s decode step (the model on one new token per row against a full KV cache of `capacity`
    slots; the cache donated) lowered for this mesh: parameters placed as in training, the cache and the tokens
    split over the batch axes when `rows` divides (else whole on every device)."""
    graphdef = self.graphdef

    def decode(params, rest, cache, token):
      logits, cache = nnx.merge(graphdef, params, rest)(token[:, None], cache=cache)
      return logits[:, -1], cache

    split = rows % sharding_lib.batch_shards(self.mesh) == 0
    place = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=(
        self.batch_sh if split and x.ndim and x.shape[0] == rows else sharding_lib.replicated(self.mesh)))
    cache = jax.tree.map(place, jax.eval_shape(lambda: make_cache(self.cfg.model, rows, capacity)))
    params = ckpt_lib.abstract_with_shardings(self.state_shapes["params"], self.state_sh["params"])
    rest = ckpt_lib.abstract_with_shardings(self.rest_shapes, self.rest_sh)
    with jax.set_mesh(self.mesh):
      return jax.jit(decode, donate_argnums=(2,)).lower(params, rest, cache, place(jax.ShapeDtypeStruct((rows,),
                                                                                                       jnp.int32)))


class Trainer(JittedSteps):
  """Everything one training invocation holds, built in the order that lets bad settings fail before anything is
  written: config and tokenizer, mesh, the program (model and optimizer shapes, jitted steps), data, run directory,
  then the state (restored from RUN_DIR/checkpoints, or initialized, from train.init_from when fine-tuning)."""

  def __init__(self, cfg: Config):
    cfg = copy.deepcopy(cfg)                 # filled in below (vocab_size, steps); the caller's stays as given
    paths.check_bucket(cfg.run.dir, "run.dir")  # a bucket that is missing or unreachable: say so before any work
    self.init_cfg = run_lib.adopt_init_model(cfg)  # fine-tuning: the model section of train.init_from
    self.tok = build_tokenizer(cfg.data)
    check_vocab(cfg.model, self.tok.vocab_size)
    given_steps = cfg.train.steps
    if cfg.train.epochs and cfg.data.format != "sft":
      raise ConfigError("train.epochs applies to data.format=sft; a text run is sized by train.steps (it says when "
                        "its data starts a second epoch)")
    if cfg.train.epochs and not cfg.train.steps:      # the schedule ends where the passes over the examples do
      cfg.train.steps = sft.epoch_steps(cfg.data, self.tok, batch_size=cfg.train.batch_size, epochs=cfg.train.epochs)
    super().__init__(cfg, sharding_lib.make_mesh(cfg.mesh), run_lib.fixed_shared_heads(cfg))
    self.stop_at = min(cfg.train.stop_at_step or cfg.train.steps, cfg.train.steps)
    run_lib.legacy_data_settings(cfg)          # data: validated before anything is written to run.dir
    procs = jax.process_count()
    self.data_counts = {}     # SFT: examples, truncated, dropped, rows of the training split
    sft_kw = {"epochs": cfg.train.epochs, "counts": self.data_counts} if cfg.data.format == "sft" else {}
    self.train_iter = make_train_iterator(cfg.data, self.tok, batch_size=cfg.train.batch_size // procs,
                                          seed=cfg.train.seed, **sft_kw)
    self.eval_batches = make_eval_batches(cfg.data, self.tok, batch_size=self.micro // procs,
                                          num_batches=cfg.train.eval_batches) if cfg.train.eval_batches > 0 else []
    self.run_dir, has_ckpt = run_lib.prepare_run_dir(cfg)
    if has_ckpt:
      run_lib.check_step_change(cfg, self.run_dir, given_steps)
      run_lib.note_resume_changes(cfg, self.run_dir)
    self.ckpt = ckpt_lib.Checkpointer(self.run_dir, cfg.checkpoint)
    self.start = self._restore() if has_ckpt and self.ckpt.latest_step() is not None else self._initialize()

  def _restore(self) -> int:
    target = ckpt_lib.abstract_with_shardings(self.state_shapes, self.state_sh)
    params_target = self.params.full(target.pop("params"),
                                     ckpt_lib.abstract_with_shardings(self.rest_shapes, self.rest_sh))
    start, params, train_state = self.ckpt.restore_latest(params_target, target, self.train_iter)
    params, self.rest = self.params.split(params, self.rest_shapes)
    self.state = {"params": params, **train_state}
    return start

  def _initialize(self) -> int:
    self.state, self.rest = jax.jit(self._init_state, out_shardings=(self.state_sh, self.rest_sh))()
    if self.init_cfg is not None:       # fine-tuning: the base weights of train.init_from (fresh adapters w/ LoRA)
      base = run_lib.restore_init_params(self.cfg, self.init_cfg, self.mesh)
      if self.cfg.lora.rank:
        self.rest = jax.device_put(base, self.rest_sh)
      else:
        self.state["params"] = jax.device_put(base, self.state_sh["params"])
    return 0

  def write_config(self) -> None:
    """config.yaml (the resolved config) and the opening line, on process 0."""
    distributed.barrier("sinkjax.train: run dir read")   # every process has read config.yaml before it is rewritten
    if jax.process_index() != 0:
      return
    cfg = self.cfg
    resolved = config_lib.to_dict(cfg)
    resolved["train"]["stop_at_step"] = 0           # a property of this invocation, not of the run
    paths.write_atomic(self.run_dir / run_lib.CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False))
    tokens = cfg.train.batch_size * cfg.data.seq_len
    print(f"sinkjax.train: {cfg.model.attention} attention, {self.num_params:,} params"
          + (f" ({self.num_trainable:,} trained: LoRA rank {cfg.lora.rank})" if cfg.lora.rank else "")
          + (f" from {cfg.train.init_from}" if cfg.train.init_from else "") + f", {cfg.train.steps} steps x "
          f"{tokens:,} tokens ({cfg.train.steps * tokens / self.num_params:.1f} tokens/param), mesh "
          f"{dict(self.mesh.shape)}, run dir {self.run_dir}" + (f", resuming from step {self.start}" if self.start
                                                                 else ""), flush=True)
    if self.data_counts:
      print(sft.truncation_note(self.data_counts, cfg.data.seq_len), flush=True)

  def nothing_to_do(self) -> dict:
    """A run already at the step this invocation would stop at: one line (process 0) saying so and how to go on,
    nothing written to the run directory; the summary `train` returns."""
    cfg, start = self.cfg, self.start
    if jax.process_index() == 0:
      how = (f"train.steps=N with N > {cfg.train.steps} extends it" if start >= cfg.train.steps else
             f"it stopped at train.stop_at_step; without it (or with a later one) it goes on to {cfg.train.steps}")
      print(f"sinkjax.train: nothing to do: {self.run_dir} is at step {start} of train.steps={cfg.train.steps} and "
            f"was left as it is; {how}", flush=True)
    return {"run_dir": str(self.run_dir), "steps": cfg.train.steps, "start_step": start, "end_step": start,
            "final_loss": None, "val_bpb": None, "last_importance": None, "num_params": self.num_params,
            "trainable_params": self.num_trainable}

  def evaluate(self) -> float:
    """Validation BPB of the current parameters over the eval batches (nanochat's rule, `analysis.nll_sums`)."""
    nll = nbytes = 0.0
    for b in self.eval_batches:
      batch = to_global_batch({k: b[k] for k in EVAL_FEATURES}, self.batch_sh)
      n, by = jax.device_get(self.eval_step(self.state["params"], batch, self.rest))
      nll, nbytes = nll + float(n), nbytes + float(by)
    return nll / math.log(2) / max(nbytes, 1.0)

  def save(self, step: int) -> None:
    state = self.state
    self.ckpt.save(step, self.params.full(state["params"], self.rest),
                   {k: v for k, v in state.items() if k != "params"}, self.train_iter, force=True)

  def step(self):
    """One optimizer step on the next batch; returns its (device) metrics."""
    batch = next(self.train_iter)
    self.state, m = self.train_step(self.state, to_global_batch({k: batch[k] for k in TRAIN_FEATURES},
                                                                self.batch_sh), self.rest)
    return m

  def close(self) -> None:
    self.ckpt.close()
    if hasattr(self.train_iter, "close"):
      self.train_iter.close()


# --------------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------------

def step_done(cfg: Config, log: MetricsLogger, step: int, m, val_bpb) -> None:
  """The host side of a finished step (one behind the device): the non-finite guard's verdict, then the logs."""
  nonfinite = int(jax.device_get(m["nonfinite"]))
  if nonfinite >= cfg.train.max_nonfinite:
    raise TrainError(f"the loss, gradient or update was non-finite for {nonfinite} steps in a row (up to step "
                     f"{step}); updates were skipped and no checkpoint was written from them. Lower the learning "
                     f"rates or train.grad_clip, or raise train.max_nonfinite")
  log.step_done(step, m, val_bpb)


def train(cfg: Config, *, progress: bool = True) -> dict:
  """Trains (or resumes) the run of `cfg`; returns a summary {steps, final_loss, val_bpb, run_dir, ...}."""
  tracking.require(cfg)     # logging.wandb without the wandb package: one line, before anything is written
  trainer = Trainer(cfg)
  if trainer.start >= trainer.stop_at:   # finished, or at train.stop_at_step already: the run dir is left as it is
    trainer.close()
    return trainer.nothing_to_do()
  trainer.write_config()
  cfg, start, stop_at = trainer.cfg, trainer.start, trainer.stop_at
  log = MetricsLogger(cfg, trainer.run_dir, lr_schedule=trainer.lr_schedule, start=start, stop_at=stop_at,
                      progress=progress)
  profiler = Profiler(cfg, trainer.run_dir, start, stop_at)
  stop_vote = distributed.StopVote(trainer.mesh)
  pending = None       # (step, metrics, val_bpb) of the previous step, logged once the next one is queued
  data_end = None      # train.epochs: the last step before the data ran out
  try:
    with distributed.SignalFlag() as sig, jax.set_mesh(trainer.mesh):   # the mesh is active: attention runs per shard
      for step in range(start + 1, stop_at + 1):
        profiler.before(step)
        vote = stop_vote.cast(sig.signum)      # every process stops at the same step, whichever got the signal
        try:
          m = trainer.step()
        except StopIteration:                  # train.epochs passes are done (every process: equal batch counts)
          data_end = step - 1
          break
        if pending is not None:
          step_done(cfg, log, *pending)
        profiler.after(step, m, log)
        signum = stop_vote.result(vote)
        t0 = time.perf_counter()
        val_bpb = trainer.evaluate() if trainer.eval_batches and (
            (cfg.train.eval_every > 0 and step % cfg.train.eval_every == 0) or step == cfg.train.steps) else None
        saving = (step % cfg.checkpoint.every == 0 or step in cfg.checkpoint.keep_steps or step == stop_at
                  or signum is not None)
        if saving:
          trainer.save(step)
        log.paused(time.perf_counter() - t0)
        pending = (step, m, val_bpb)
        if saving:     # log a checkpointed step now: the next step may never finish (a process of the job died)
          step_done(cfg, log, *pending)
          log.flush()
          pending = None
        if signum is not None:
          raise Interrupted(signum, step)
      if data_end is not None:
        pending = _end_of_data(trainer, log, pending, data_end)
      if pending is not None:
        step_done(cfg, log, *pending)
  finally:
    log.close()
    trainer.close()
    profiler.close()
  log.finish()
  log.summary.update(end_step=stop_at if data_end is None else data_end, num_params=trainer.num_params,
                     trainable_params=trainer.num_trainable)
  if trainer.data_counts:
    log.summary["sft_examples"] = {k: trainer.data_counts[k] for k in ("documents", "truncated", "dropped", "rows")}
  return log.summary


def _end_of_data(trainer: Trainer, log: MetricsLogger, pending, data_end: int):
  """The data's train.epochs passes ended after step `data_end`: that step is evaluated, checkpointed and logged
  (unless it already was), and the run ends there. Returns what is left pending (None)."""
  cfg = trainer.cfg
  if jax.process_index() == 0:
    print(f"sinkjax.train: train.epochs={cfg.train.epochs} pass(es) over the training examples end at step "
          f"{data_end} of {cfg.train.steps}; checkpoint at step {data_end}, run ends", flush=True)
  log.stop_at = data_end
  if pending is None:            # the last step was checkpointed and logged already (or none ran in this invocation)
    return None
  step, m, val_bpb = pending
  if val_bpb is None and trainer.eval_batches:
    val_bpb = trainer.evaluate()
  trainer.save(step)
  step_done(cfg, log, step, m, val_bpb)
  return None


# --------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class TrainCommandOptions:
  """The train_command.* option (`python -m sinkjax.train`): the run's config file; every other section.key=value word
  is an override of it (`train.steps=100`). Its --config is that config, so the command has no file of options."""
  config: str = declare("", alias="--config", metavar="CONFIG", required=True,
                    help="a YAML config file, or a packaged config by name (tiny runs on a CPU): "
                         + config_lib.packaged_list())


COMMAND = options.Command(
    prog="python -m sinkjax.train", sections={"train_command": TrainCommandOptions}, run_overrides=True,
    options_file=None,
    description="Train a sink-aware language model. Every config key can be overridden as section.key=value (e.g. "
                "train.steps=100 model.attention=sink run.dir=runs/x). Rerunning with the same run.dir resumes from "
                "its latest checkpoint; a finished run is left as it is (train.steps=N, N above its own, extends it).")


def main(argv=None) -> int:
  def run(sections, overrides):
    distributed.maybe_initialize()    # before anything touches JAX devices
    train(config_lib.load_config(sections["train_command"].config, overrides))
  return options.main(COMMAND, argv, run)


if __name__ == "__main__":
  sys.exit(main())
