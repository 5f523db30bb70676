"""Training: `python -m sinkjax.train --config configs/NAME.yaml [section.key=value ...]`.

The story, top to bottom: read the config, build tokenizer and data, build the model and optimizer on the mesh,
resume from RUN_DIR/checkpoints if a checkpoint exists, then loop: one jitted step per optimizer update (gradient
accumulation inside it), validation BPB every train.eval_every steps, logs every train.log_every steps, checkpoints
every checkpoint.every steps and at the end (and on SIGTERM / SIGINT, at the same step in every process of a
multi-process run: `sinkjax.distributed.StopVote`). Plots are written when the run ends.

Loss = masked mean cross-entropy + the sink-aware load-balancing loss on the layer x head importances
(`sinkjax.balance.aux_loss`, eq. 7 or eq. 8; skipped entirely when loss.aux_weight is 0). The model computes in
model.dtype (bfloat16 by default) on float32 master weights. A step whose loss, gradient norm or updated
parameters are non-finite leaves parameters and optimizer state untouched; train.max_nonfinite such steps in a row
stop the run (no checkpoint is written from a non-finite state).

Run directory: config.yaml (the resolved config), checkpoints/ (Orbax), metrics.jsonl, tb/ (TensorBoard),
loss.png, head_imbalance.png, importance.png. Only process 0 writes logs.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import pathlib
import signal
import sys
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

from sinkjax import balance, distributed, optim, plots
from sinkjax import lora as lora_lib
from sinkjax import checkpoint as ckpt_lib
from sinkjax import config as config_lib
from sinkjax import sharding as sharding_lib
from sinkjax.config import Config, ConfigError
from sinkjax.model import Transformer, count_params, forward_with_importance

TRAIN_FEATURES = ("inputs", "targets", "segment_ids", "positions", "loss_mask")
EVAL_FEATURES = TRAIN_FEATURES + ("target_bytes",)
# Model keys that may change when resuming a run (they do not change the parameters).
RESUMABLE_MODEL_KEYS = ("dtype", "remat", "attn_impl")


class TrainError(RuntimeError):
  """The run had to stop (e.g. non-finite losses); the message says why and what to change."""


class Interrupted(Exception):
  def __init__(self, signum: int, step: int):
    super().__init__(f"stopped by {signal.Signals(signum).name} at step {step}; checkpoint saved, rerun the same "
                     "command to resume")
    self.signum = signum


# --------------------------------------------------------------------------------------------------------------
# The step (pure functions of the train state; jitted once in `Trainer`)
# --------------------------------------------------------------------------------------------------------------

def token_losses(model, batch):
  """(per-token NLL [B,T] float32, importance [L,H]) of a batch."""
  logits, imp = forward_with_importance(model, batch["inputs"], segment_ids=batch["segment_ids"],
                                        positions=batch["positions"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]), imp


def loss_fn(params, graphdef, rest, batch, total_weight, loss_cfg, shared, num_micro):
  """One micro-batch's share of the step loss: CE summed over it / tokens of the whole step + aux / micro-batches.

  Summed over the micro-batches this is the masked mean CE over the global batch plus the mean aux loss.
  """
  nll, imp = token_losses(nnx.merge(graphdef, params, rest), batch)
  ce_sum = jnp.sum(nll * batch["loss_mask"])
  if loss_cfg.aux_weight > 0:
    aux = balance.aux_loss(imp, loss_cfg.aux_weight, loss_cfg.num_shared_heads, shared)
  else:
    aux = jnp.zeros((), jnp.float32)
  return ce_sum / total_weight + aux / num_micro, (ce_sum, aux, imp)


def _all_finite(tree):
  return jax.tree.reduce(lambda a, b: a & b, jax.tree.map(lambda x: jnp.isfinite(x).all(), tree), jnp.array(True))


def make_train_step(cfg: Config, graphdef, rest, tx: optax.GradientTransformation, shared=None):
  """train_step(state, batch, rest=None) -> (state, metrics); batch arrays are [global_batch, T].

  `state["params"]` holds the trained parameters (the LoRA adapters when lora.rank > 0); `rest` is the rest of the
  model (the frozen base weights with LoRA, empty otherwise). Pass it as the third argument so that jit sees it as
  an input rather than a constant baked into the program; None falls back to the `rest` given here.
  """
  default_rest = rest
  A = cfg.train.grad_accum
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

  def train_step(state, batch, rest=None):
    rest = default_rest if rest is None else rest
    params = state["params"]
    total = jnp.maximum(batch["loss_mask"].sum(), 1.0)
    run = lambda mb: grad_fn(params, graphdef, rest, mb, total, cfg.loss, shared, A)
    if A == 1:
      (_, (ce_sum, aux, imp)), grads = run(batch)
    else:
      # [B, ...] -> [A, B/A, ...] taking every A-th row, so each micro-batch stays split over the batch axes.
      micro = jax.tree.map(lambda x: jnp.swapaxes(x.reshape(x.shape[0] // A, A, *x.shape[1:]), 0, 1), batch)

      def body(acc, mb):
        (_, out), g = run(mb)
        return jax.tree.map(jnp.add, acc, (g, *out)), None

      L, H = cfg.model.num_layers, cfg.model.num_heads
      zero = (jax.tree.map(jnp.zeros_like, params), jnp.zeros(()), jnp.zeros(()), jnp.zeros((L, H)))
      (grads, ce_sum, aux, imp), _ = jax.lax.scan(body, zero, micro)
      aux, imp = aux / A, imp / A
    ce = ce_sum / total
    loss = ce + aux
    grad_norm = optax.global_norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_params = optax.apply_updates(params, updates)
    ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & _all_finite(new_params)
    keep_if_ok = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
    new_state = {
        "params": keep_if_ok(new_params, params),
        "opt_state": keep_if_ok(opt_state, state["opt_state"]),
        "step": state["step"] + 1,
        "rng": jax.random.split(state["rng"])[0],
        "nonfinite": jnp.where(ok, 0, state["nonfinite"] + 1),
    }
    metrics = {"loss": loss, "ce_loss": ce, "aux_loss": aux, "importance": imp,
               "head_imbalance": balance.head_imbalance(imp), "grad_norm": grad_norm,
               "finite": ok, "nonfinite": new_state["nonfinite"]}
    return new_state, metrics

  return train_step


def make_eval_step(graphdef, rest):
  """eval_step(params, batch, rest=None) -> (sum of NLL in nats, sum of target bytes) over the batch's loss-mask
  tokens (`rest` as in `make_train_step`)."""
  default_rest = rest

  def eval_step(params, batch, rest=None):
    nll, _ = token_losses(nnx.merge(graphdef, params, default_rest if rest is None else rest), batch)
    return jnp.sum(nll * batch["loss_mask"]), jnp.sum(batch["target_bytes"] * (batch["loss_mask"] > 0))
  return eval_step


# --------------------------------------------------------------------------------------------------------------
# Setup helpers
# --------------------------------------------------------------------------------------------------------------

def total_steps(cfg: Config, num_params: int) -> int:
  """train.steps, or the token budget train.tokens_per_param x parameters / tokens per step when it is 0."""
  if cfg.train.steps > 0:
    return cfg.train.steps
  tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
  return max(1, math.ceil(cfg.train.tokens_per_param * num_params / tokens_per_step))


def _fixed_shared_heads(cfg: Config):
  """The [L,H] shared-head mask of loss.shared_heads_from (report.json, metrics.jsonl or a run dir), or None."""
  src = cfg.loss.shared_heads_from
  if not src:
    return None
  path = pathlib.Path(src)
  if path.is_dir():
    path = path / "eval" / "report.json" if (path / "eval" / "report.json").is_file() else path / "metrics.jsonl"
  if not path.is_file():
    raise ConfigError(f"loss.shared_heads_from {src!r}: no report.json or metrics.jsonl there")
  try:
    if path.suffix == ".jsonl":
      imp = [r["importance"] for r in plots.read_metrics(path) if "importance" in r][-1]
    else:
      imp = json.loads(path.read_text())["importance"]
  except (KeyError, IndexError, ValueError):
    raise ConfigError(f"loss.shared_heads_from {src!r}: {path.name} holds no 'importance'") from None
  imp = np.asarray(imp, np.float32)
  want = (cfg.model.num_layers, cfg.model.num_heads)
  if imp.shape != want:
    raise ConfigError(f"loss.shared_heads_from {src!r}: importance is {list(imp.shape)}, the model needs "
                      f"{list(want)} (layers x heads)")
  if cfg.loss.num_shared_heads == 0:
    raise ConfigError("loss.shared_heads_from needs loss.num_shared_heads > 0 (how many heads per layer to share)")
  return np.asarray(balance.shared_head_mask(imp, cfg.loss.num_shared_heads))


# Model keys that a fine-tuning config repeats for reference; they must equal the train.init_from run's.
INIT_CHECKED_KEYS = ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim")


def _adopt_init_model(cfg: Config) -> Config | None:
  """train.init_from: reads that run's config and makes its model section this run's (model.dtype, remat and
  attn_impl stay this config's), after checking the shape keys (INIT_CHECKED_KEYS) this config repeats.

  Returns the init run's config, or None without train.init_from. Changes `cfg` in place.
  """
  src = cfg.train.init_from
  if not src:
    return None
  try:
    init_cfg = ckpt_lib.read_run_config(src)
  except (ckpt_lib.CheckpointError, ConfigError) as e:
    raise ConfigError(f"train.init_from {src!r}: {e}") from None
  if init_cfg.lora.rank:
    raise ConfigError(f"train.init_from {src!r} is a LoRA run; export it with merged adapters (python -m "
                      "sinkjax.convert.hf --export RUN --out HF_DIR), import that (--hf-dir HF_DIR --out NEW_RUN) and "
                      "start from NEW_RUN")
  diff = [f"model.{k}={getattr(init_cfg.model, k)} (this config: {getattr(cfg.model, k)})"
          for k in INIT_CHECKED_KEYS if getattr(cfg.model, k) != getattr(init_cfg.model, k)]
  if diff:
    raise ConfigError(f"train.init_from {src!r} holds a different model: {', '.join(diff)}; set these keys to the "
                      "imported model's (e.g. as overrides)")
  cfg.model = dataclasses.replace(init_cfg.model, **{k: getattr(cfg.model, k) for k in RESUMABLE_MODEL_KEYS})
  config_lib.validate(cfg)
  return init_cfg


def _restore_init_params(cfg: Config, init_cfg: Config, mesh):
  """The parameters (nnx.State of nnx.Param, no adapters) of the latest checkpoint of train.init_from, placed with
  the training shardings."""
  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)
  target = ckpt_lib.abstract_with_shardings(abstract, sharding_lib.state_shardings(mesh, abstract))
  init_ckpt = ckpt_lib.Checkpointer(cfg.train.init_from, init_cfg.checkpoint, read_only=True)
  try:
    step = init_ckpt.latest_step()
    if step is None:
      raise ConfigError(f"train.init_from {cfg.train.init_from!r} has no checkpoint")
    return init_ckpt.restore_params(step, target)
  finally:
    init_ckpt.close()


def _params_signature(model_cfg) -> dict:
  d = dataclasses.asdict(model_cfg)
  return {k: v for k, v in d.items() if k not in RESUMABLE_MODEL_KEYS}


def prepare_run_dir(cfg: Config) -> tuple[pathlib.Path, bool]:
  """Checks that run.dir is usable (writable; if it holds a run, the same model) before anything is written.

  Returns (run_dir, has_checkpoint).
  """
  run_dir = pathlib.Path(cfg.run.dir)
  has_ckpt = (run_dir / ckpt_lib.CHECKPOINT_DIR).is_dir() and any(
      p.name.isdigit() for p in (run_dir / ckpt_lib.CHECKPOINT_DIR).iterdir())
  if (run_dir / ckpt_lib.CONFIG_FILE).is_file() and has_ckpt:
    try:
      old = ckpt_lib.read_run_config(run_dir)
    except ConfigError as e:
      raise ConfigError(f"run.dir {run_dir} holds a run whose config.yaml is unreadable ({e}); pick another run.dir")
    if _params_signature(old.model) != _params_signature(cfg.model) or old.data.tokenizer != cfg.data.tokenizer:
      diff = [k for k, v in _params_signature(cfg.model).items() if _params_signature(old.model).get(k) != v]
      diff += ["data.tokenizer"] if old.data.tokenizer != cfg.data.tokenizer else []
      raise ConfigError(f"run.dir {run_dir} already holds a run with a different model ({', '.join(diff)}); "
                        "pick another run.dir or delete that one")
  try:
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = run_dir / f".write-test-{os.getpid()}"
    probe.write_text("")
    probe.unlink()
  except OSError as e:
    raise ConfigError(f"run.dir {run_dir} is not writable ({e.strerror or e}); set run.dir=SOMEWHERE_WRITABLE") \
        from None
  return run_dir, has_ckpt


def _legacy_data_settings(cfg: Config) -> None:
  """Resuming a run whose config.yaml predates data.shuffle_batches: its iterator state is of the unshuffled
  pipeline, so keep it unshuffled (with a note) rather than refuse to resume."""
  path = pathlib.Path(cfg.run.dir) / ckpt_lib.CONFIG_FILE
  if not path.is_file():
    return
  try:
    data = (yaml.safe_load(path.read_text()) or {}).get("data") or {}
  except (OSError, yaml.YAMLError, AttributeError):
    return             # prepare_run_dir reports an unreadable config.yaml
  if isinstance(data, dict) and "shuffle_batches" not in data and cfg.data.shuffle_batches:
    if jax.process_index() == 0:
      print(f"sinkjax.train: {path} predates data.shuffle_batches; resuming with data.shuffle_batches=0 "
            "(the order it was trained with)", flush=True)
    cfg.data.shuffle_batches = 0


def _write_atomic(path: pathlib.Path, text: str) -> None:
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text)
  os.replace(tmp, path)


def _truncate_metrics(path: pathlib.Path, after_step: int) -> None:
  """On resume, drop records logged after the checkpoint we restart from (they will be logged again)."""
  if path.is_file():
    keep = [r for r in plots.read_metrics(path) if r.get("step", 0) <= after_step]
    _write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


class _SignalFlag:
  """Turns SIGTERM/SIGINT into a flag the loop checks after each step (a second signal kills as usual)."""

  def __init__(self):
    self.signum = None
    self._old = {}

  def __enter__(self):
    if threading.current_thread() is threading.main_thread():   # signal handlers only work there
      for s in (signal.SIGTERM, signal.SIGINT):
        self._old[s] = signal.signal(s, self._handle)
    return self

  def _handle(self, signum, frame):
    del frame
    self.signum = signum
    for s, h in self._old.items():
      signal.signal(s, h)

  def __exit__(self, *exc):
    for s, h in self._old.items():
      signal.signal(s, h)


# --------------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------------

def train(cfg: Config, *, progress: bool = True) -> dict:
  """Trains (or resumes) the run of `cfg`; returns a summary {steps, final_loss, val_bpb, run_dir, ...}."""
  from sinkjax.data import build_tokenizer, make_eval_batches, make_train_iterator, to_global_batch

  cfg = copy.deepcopy(cfg)          # filled in below (vocab_size, steps); the caller's config stays as given
  t_start = time.perf_counter()
  is_main = jax.process_index() == 0
  init_cfg = _adopt_init_model(cfg)  # fine-tuning: the model section of train.init_from
  tok = build_tokenizer(cfg.data)
  if cfg.model.vocab_size == 0:
    cfg.model.vocab_size = tok.vocab_size
  elif cfg.model.vocab_size < tok.vocab_size:
    raise ConfigError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's "
                      f"({tok.vocab_size}); set it to 0 to take the tokenizer's")
  mesh = sharding_lib.make_mesh(cfg.mesh)
  A = cfg.train.grad_accum
  micro = cfg.train.batch_size // A
  shards, procs = sharding_lib.batch_shards(mesh), jax.process_count()
  if micro % shards or micro % procs:
    raise ConfigError(f"the micro-batch train.batch_size / train.grad_accum = {micro} must be divisible by the "
                      f"{shards} batch shards (mesh.data x mesh.fsdp) and {procs} processes")
  shared = _fixed_shared_heads(cfg)

  # Model and optimizer state, created directly with their shardings.
  seed = cfg.train.seed
  # With lora.rank > 0 the targeted projections get adapters; the optimizer then sees only them (nnx.LoRAParam)
  # and the frozen base weights travel as `rest`, an argument of the jitted step. Without LoRA `rest` is empty.
  trainable = lora_lib.trainable(cfg.lora)

  def build_model():
    return lora_lib.apply(Transformer(cfg.model, rngs=nnx.Rngs(seed)), cfg.lora, nnx.Rngs(seed + 1))

  abstract_model = nnx.eval_shape(build_model)
  assert not jax.tree.leaves(nnx.state(abstract_model, nnx.Not(nnx.Param))), \
      "the model holds non-parameter state; the trainer needs to carry it"
  graphdef, abstract_params, abstract_rest = nnx.split(abstract_model, trainable, ...)
  has_rest = bool(jax.tree.leaves(abstract_rest))
  num_params = count_params(abstract_model)
  num_trainable = sum(x.size for x in jax.tree.leaves(abstract_params))
  steps = total_steps(cfg, num_params)
  cfg.train.steps = steps
  stop_at = min(cfg.train.stop_at_step or steps, steps)
  tx, lr_schedule = optim.build_optimizer(cfg, steps)

  # Data: validated before anything is written to run.dir.
  _legacy_data_settings(cfg)
  if cfg.data.format == "sft":     # JSONL prompt/response or chat; loss on the response tokens
    from sinkjax.data.sft import make_sft_eval_batches as make_eval_batches  # noqa: F811
    from sinkjax.data.sft import make_sft_iterator as make_train_iterator  # noqa: F811
  train_iter = make_train_iterator(cfg.data, tok, batch_size=cfg.train.batch_size // procs, seed=seed)
  eval_batches = make_eval_batches(cfg.data, tok, batch_size=micro // procs, num_batches=cfg.train.eval_batches) \
      if cfg.train.eval_batches > 0 else []
  run_dir, has_ckpt = prepare_run_dir(cfg)

  def init_state():
    _, params, rest = nnx.split(build_model(), trainable, ...)
    return {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
            "rng": jax.random.PRNGKey(seed), "nonfinite": jnp.zeros((), jnp.int32)}, rest

  state_shapes, rest_shapes = jax.eval_shape(init_state)
  state_sh = sharding_lib.state_shardings(mesh, state_shapes)
  rest_sh = sharding_lib.state_shardings(mesh, rest_shapes)

  # The checkpoint's params item holds every parameter (adapters and frozen base), so that load_run, evaluation
  # and export read a LoRA run on its own.
  def full_params(params, rest):
    return nnx.merge_state(params, rest) if has_rest else params

  def split_params(full):
    return tuple(nnx.split_state(full, trainable, ...)) if has_rest else (full, rest_shapes)
  batch_sh = sharding_lib.batch_sharding(mesh)
  donate = (0,) if jax.default_backend() != "cpu" else ()  # CPU: async checkpoints may alias the buffers
  train_step = jax.jit(make_train_step(cfg, graphdef, None, tx, None if shared is None else jnp.asarray(shared)),
                       in_shardings=(state_sh, batch_sh, rest_sh),
                       out_shardings=(state_sh, sharding_lib.replicated(mesh)), donate_argnums=donate)
  eval_step = jax.jit(make_eval_step(graphdef, None), in_shardings=(state_sh["params"], batch_sh, rest_sh),
                      out_shardings=sharding_lib.replicated(mesh))

  ckpt = ckpt_lib.Checkpointer(run_dir, cfg.checkpoint)
  start = ckpt.latest_step() if has_ckpt else None
  if start is not None:
    target = ckpt_lib.abstract_with_shardings(state_shapes, state_sh)
    params_target = full_params(target.pop("params"), ckpt_lib.abstract_with_shardings(rest_shapes, rest_sh))
    start, params, train_state = ckpt.restore_latest(params_target, target, train_iter)
    params, rest = split_params(params)
    state = {"params": params, **train_state}
  else:
    start = 0
    state, rest = jax.jit(init_state, out_shardings=(state_sh, rest_sh))()
    if init_cfg is not None:       # fine-tuning: the base weights of train.init_from (fresh adapters with LoRA)
      base = _restore_init_params(cfg, init_cfg, mesh)
      if has_rest:
        rest = jax.device_put(base, rest_sh)
      else:
        state["params"] = jax.device_put(base, state_sh["params"])

  metrics_path = run_dir / "metrics.jsonl"
  writer = None
  distributed.barrier("sinkjax.train: run dir read")   # every process has read config.yaml before it is rewritten
  if is_main:
    resolved = config_lib.to_dict(cfg)
    resolved["train"]["stop_at_step"] = 0           # a property of this invocation, not of the run
    _write_atomic(run_dir / ckpt_lib.CONFIG_FILE, yaml.safe_dump(resolved, sort_keys=False))
    _truncate_metrics(metrics_path, start)
    from tensorboardX import SummaryWriter
    writer = SummaryWriter(str(run_dir / "tb"))
    tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
    print(f"sinkjax.train: {cfg.model.attention} attention, {num_params:,} params"
          + (f" ({num_trainable:,} trained: LoRA rank {cfg.lora.rank})" if cfg.lora.rank else "")
          + (f" from {cfg.train.init_from}" if cfg.train.init_from else "") + f", {steps} steps x "
          f"{tokens_per_step:,} tokens ({steps * tokens_per_step / num_params:.1f} tokens/param), mesh "
          f"{dict(mesh.shape)}, run dir {run_dir}" + (f", resuming from step {start}" if start else ""), flush=True)

  from tqdm import tqdm
  bar = tqdm(total=steps, initial=start, unit="step", dynamic_ncols=True, disable=not (is_main and progress),
             mininterval=1.0)
  metrics_file = open(metrics_path, "a") if is_main else None
  tokens_per_step = cfg.train.batch_size * cfg.data.seq_len
  summary = {"run_dir": str(run_dir), "steps": steps, "start_step": start, "num_params": num_params,
             "trainable_params": num_trainable,
             "final_loss": None, "val_bpb": None, "last_importance": None}
  ema = [None]

  def evaluate(params) -> float:
    nll = nbytes = 0.0
    for b in eval_batches:
      n, by = jax.device_get(eval_step(params, to_global_batch({k: b[k] for k in EVAL_FEATURES}, batch_sh), rest))
      nll, nbytes = nll + float(n), nbytes + float(by)
    return nll / math.log(2) / max(nbytes, 1.0)

  def finish_step(step: int, m, val_bpb):
    """Host side of a step, one step behind the device: non-finite accounting, progress bar, logs."""
    small = jax.device_get({k: m[k] for k in ("loss", "finite", "nonfinite")})
    if int(small["nonfinite"]) >= cfg.train.max_nonfinite:
      raise TrainError(f"the loss, gradient or update was non-finite for {int(small['nonfinite'])} steps in a row "
                       f"(up to step {step}); updates were skipped and no checkpoint was written from them. Lower "
                       f"the learning rates or train.grad_clip, or raise train.max_nonfinite")
    loss = float(small["loss"])
    if math.isfinite(loss):
      ema[0] = loss if ema[0] is None else 0.9 * ema[0] + 0.1 * loss
    now = time.perf_counter()
    dt = now - timer["t"] - timer["paused"]
    tps = (step - timer["step"]) * tokens_per_step / dt if dt > 0 and step > timer["step"] else 0.0
    if not (step % cfg.train.log_every == 0 or step == 1 or step == stop_at or val_bpb is not None):
      bar.update(1)
      if ema[0] is not None:
        bar.set_postfix(loss=f"{ema[0]:.3f}", refresh=False)
      return
    m = jax.device_get(m)
    rec = {"step": step, "loss": float(m["loss"]), "ce_loss": float(m["ce_loss"]),
           "aux_loss": float(m["aux_loss"]), "head_imbalance": float(m["head_imbalance"]),
           "importance": np.asarray(m["importance"]).round(6).tolist(), "grad_norm": float(m["grad_norm"]),
           "lr": float(lr_schedule(step - 1)), "tokens_per_s": round(tps, 1), "tokens": step * tokens_per_step,
           "finite": bool(m["finite"]), "elapsed_s": round(now - t_start, 2)}
    if val_bpb is not None:
      rec["val_bpb"] = val_bpb
      summary["val_bpb"] = val_bpb
    summary["final_loss"] = rec["loss"]
    summary["last_importance"] = rec["importance"]
    timer.update(t=now, step=step, paused=0.0)
    bar.update(1)
    bar.set_postfix(loss=f"{ema[0] if ema[0] is not None else float('nan'):.3f}", tok_s=f"{tps:,.0f}", refresh=False)
    if is_main:
      metrics_file.write(json.dumps(rec) + "\n")
      metrics_file.flush()
      for k in ("loss", "ce_loss", "aux_loss", "head_imbalance", "grad_norm", "lr", "tokens_per_s", "val_bpb"):
        if k in rec:
          writer.add_scalar(f"train/{k}" if k != "val_bpb" else "val/bpb", rec[k], step)
      if val_bpb is not None:
        bar.write(f"step {step}: loss {rec['loss']:.4f}  val_bpb {val_bpb:.4f}  head_imbalance "
                  f"{rec['head_imbalance']:.4f}  {tps:,.0f} tok/s")

  pending = None       # (step, metrics, val_bpb) of the previous step, handled once the next one is queued
  timer = {"t": time.perf_counter(), "step": start, "paused": 0.0}
  prof_last = cfg.train.profile_start + cfg.train.profile_steps - 1
  # A resumed run past profile_start traces what is left of the range; past it, nothing.
  prof_first = max(cfg.train.profile_start, start + 1) if cfg.train.profile_steps > 0 else 0
  prof_dir = run_dir / "profile" / (f"process_{jax.process_index()}" if jax.process_count() > 1 else "")
  profiling = False
  stop_vote = distributed.StopVote(mesh)
  try:
    with _SignalFlag() as sig, jax.set_mesh(mesh):   # the mesh is active: attention runs per shard
      for step in range(start + 1, stop_at + 1):
        if step == prof_first and step <= prof_last:
          jax.profiler.start_trace(str(prof_dir))
          profiling = True
        batch = next(train_iter)
        vote = stop_vote.cast(sig.signum)      # every process stops at the same step, whichever got the signal
        state, m = train_step(state, to_global_batch({k: batch[k] for k in TRAIN_FEATURES}, batch_sh), rest)
        if pending is not None:
          finish_step(*pending)
        if profiling and (step == prof_last or step == stop_at):
          jax.block_until_ready(m)
          jax.profiler.stop_trace()
          profiling = False
          if is_main:
            bar.write(f"profile of steps {prof_first}-{step} written to {prof_dir} "
                      f"(tensorboard --logdir {run_dir}, or ui.perfetto.dev with its trace.json.gz)")
        t0 = time.perf_counter()
        signum = stop_vote.result(vote)
        val_bpb = None
        if eval_batches and ((cfg.train.eval_every > 0 and step % cfg.train.eval_every == 0) or step == steps):
          val_bpb = evaluate(state["params"])
        saving = step % cfg.checkpoint.every == 0 or step == stop_at or signum is not None
        if saving:
          ckpt.save(step, full_params(state["params"], rest), {k: v for k, v in state.items() if k != "params"},
                    train_iter, force=True)
        timer["paused"] += time.perf_counter() - t0
        pending = (step, m, val_bpb)
        if saving:     # log a checkpointed step now: the next step may never finish (a process of the job died)
          finish_step(*pending)
          pending = None
        if signum is not None:
          raise Interrupted(signum, step)
      if pending is not None:
        finish_step(*pending)
  finally:
    bar.close()
    ckpt.close()
    if hasattr(train_iter, "close"):
      train_iter.close()
    if is_main:
      metrics_file.close()
      writer.close()
    if profiling:        # last: a failing profiler must not keep the checkpoint from being committed
      try:
        jax.profiler.stop_trace()
      except Exception as e:  # pylint: disable=broad-except
        warnings.warn(f"could not finish the profile in {prof_dir}: {e}", RuntimeWarning, stacklevel=2)

  if is_main and start >= stop_at:
    print(f"nothing to do: {run_dir} is already at step {start} of {steps} (raise train.steps to continue)")
  if is_main and summary["last_importance"] is not None:
    plots.plot_training_curves(metrics_path, run_dir)
    plots.plot_importance_heatmap(summary["last_importance"], run_dir / "importance.png",
                                  f"head importance at step {stop_at} ({cfg.model.attention})")
    print(f"done: step {stop_at}/{steps}, loss {summary['final_loss']:.4f}"
          + (f", val_bpb {summary['val_bpb']:.4f}" if summary["val_bpb"] is not None else "")
          + f", {time.perf_counter() - t_start:.0f}s; run dir {run_dir}", flush=True)
  summary["end_step"] = stop_at
  return summary


# --------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------

class _Parser(argparse.ArgumentParser):
  def error(self, message):
    print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> int:
  parser = _Parser(prog="python -m sinkjax.train",
                   description="Train a sink-aware language model. Every config key can be overridden as "
                               "section.key=value (e.g. train.steps=100 model.attention=sink run.dir=runs/x). "
                               "Rerunning with the same run.dir resumes from its latest checkpoint.")
  parser.add_argument("--config", required=True, help="YAML config file (see configs/; tiny.yaml runs on a CPU)")
  parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
  args = parser.parse_args(argv)
  from sinkjax.data import DataError
  try:
    distributed.maybe_initialize()    # before anything touches JAX devices
    train(config_lib.load_config(args.config, args.overrides))
  except Interrupted as e:
    print(f"sinkjax.train: {e}", file=sys.stderr)
    return 128 + e.signum
  except (ConfigError, DataError, ckpt_lib.CheckpointError, TrainError) as e:
    print(f"sinkjax.train: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
