"""The run directory as one concept: what is in it, how it is read, prepared and started from.

A run directory (`run.dir`) holds `config.yaml` (the resolved config), `checkpoints/` (Orbax, `sinkjax.checkpoint`),
`metrics.jsonl`, TensorBoard events (`tb/`) and plots. This module is where a run is read back (`load_run`,
`read_run_config`), checked before training writes into it (`prepare_run_dir`), started from another run
(`train.init_from`: `adopt_init_model`, `restore_init_params`, `save_params_run` for converters) and where the
importances of a run are measured for eq. 8's fixed shared heads (`head_importance_of`, `shared_heads_of_run`,
`fixed_shared_heads`); `read_metrics` reads its metrics.jsonl. `sinkjax.checkpoint` is Orbax only; `sinkjax.lora`
is adapters only.
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from sinkjax import balance, lora, paths
from sinkjax import config as config_lib
from sinkjax import sharding as sharding_lib
from sinkjax.checkpoint import CHECKPOINT_DIR, CheckpointError, Checkpointer, abstract_with_shardings, restore_newest
from sinkjax.config import Config, ConfigError, MeshConfig
from sinkjax.data import DataError, build_tokenizer, make_eval_batches
from sinkjax.data.tokenizers import same_vocabulary
from sinkjax.model import Transformer, forward_with_importance

CONFIG_FILE = "config.yaml"
# Model keys a resumed or fine-tuning run may change: they do not change the parameters.
RESUMABLE_MODEL_KEYS = ("dtype", "remat", "remat_policy", "scan_layers", "attn_impl")
# Model keys that a fine-tuning config repeats for reference; they must equal the train.init_from run's.
INIT_CHECKED_KEYS = ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim")
# data.* keys added after runs were made, with the value every run made before them used.
LEGACY_DATA_SETTINGS = {"shuffle_batches": 0, "packing": "document"}


def read_metrics(metrics_path) -> list[dict]:
  """The records of a metrics.jsonl file (a truncated last line, e.g. from a killed run, is skipped)."""
  records = []
  for line in paths.as_path(metrics_path).read_text().splitlines():
    try:
      records.append(json.loads(line))
    except json.JSONDecodeError:
      continue
  return records


class LoadedRun(NamedTuple):
  """What `load_run` gives back, `LoadedRun(model, cfg, tokenizer, step)`: the model (a `sinkjax.model.Transformer`,
  adapters included for a LoRA run), its resolved `Config`, its tokenizer (`sinkjax.data.build_tokenizer`'s, as
  training used it) and the checkpoint step it actually restored (an older one than the newest when the newest is
  unreadable). `tokens(text)` encodes text as the model read it in training."""
  model: Any
  cfg: Config
  tokenizer: Any
  step: int

  def tokens(self, text: str) -> jax.Array:
    """`text` as the model's input, int32 [1, T]: BOS first where training puts one before every document (the
    bytes tokenizer and sinkjax's own BPE always; a Hugging Face model's tokenizer where its own encoding does,
    data.add_bos), then the text's tokens. `model(run.tokens(text))` gives its logits [1, T, vocab]; the tokenizer's
    own `encode(text)` adds no BOS."""
    return jnp.asarray([self.tokenizer.encode_document(text)], jnp.int32)


def read_run_config(run_dir: str | pathlib.Path) -> Config:
  path = paths.as_path(run_dir, "run directory") / CONFIG_FILE
  if not path.is_file():
    raise CheckpointError(f"{run_dir} is not a run directory (no {CONFIG_FILE}); pass the run.dir of a training run")
  return config_lib.load_config(path)


def asks_for_mesh(overrides) -> bool:
  """Whether command-line overrides name a `mesh.*` key: the CLIs then place the model on the run's mesh."""
  return any(str(o).strip().startswith("mesh.") for o in overrides or ())


def load_run(run_dir: str | pathlib.Path, step: int | None = None, overrides=(), *, mesh=None) -> LoadedRun:
  """A training run's model with the parameters of its latest (or given) checkpoint, as a `LoadedRun(model, cfg,
  tokenizer, step)`; only the parameters are restored (no optimizer state). `run.model(run.tokens(text))` gives
  logits. A LoRA run comes back with its adapters (`sinkjax.lora.merge` folds them in). `overrides`
  (`section.key=value`, as on the command lines) change the run's config first (e.g. model.dtype=float32,
  data.source=FILE, mesh.fsdp=8); a shape key that no longer matches the checkpoint is refused by the restore.

  Placement (`mesh`): None (the default), every parameter whole on every device of `jax.devices()` (replicated: a
  data=-1 mesh; on a machine without an accelerator, the CPU), whatever mesh trained the run; "run", a mesh built from the run's `mesh.*` keys (after the overrides) with each parameter placed
  as training places it (`sharding.state_shardings`: FSDP over d_model, tensor over heads / MLP / vocab); or a
  `jax.sharding.Mesh` of the ("data", "fsdp", "tensor") axes. Orbax reads each device's shards of each parameter
  straight from the checkpoint into that device: no process or device holds a whole unsharded copy of a sharded
  parameter. `sharding.mesh_of(model)` gives the mesh back."""
  paths.check_bucket(run_dir, "run directory")
  run_dir = paths.as_path(run_dir, "run directory")
  if not run_dir.is_dir():
    raise CheckpointError(f"run directory {run_dir} does not exist")
  cfg = read_run_config(run_dir)
  own_tokenizer = cfg.data.tokenizer
  if overrides:
    config_lib.apply_overrides(cfg, overrides)
  if not (run_dir / CHECKPOINT_DIR).is_dir():
    raise CheckpointError(f"{run_dir} has no checkpoint ({CHECKPOINT_DIR}/ is missing); train it first")
  ckpt = Checkpointer(run_dir, cfg.checkpoint, read_only=True)
  steps = ckpt.all_steps()
  if not steps:
    raise CheckpointError(f"{run_dir} has no checkpoint in {CHECKPOINT_DIR}/; train it first")
  if step is not None and step not in steps:
    raise CheckpointError(f"{run_dir} has no checkpoint at step {step} (available: {sorted(steps)})")
  tokenizer = model_tokenizer(cfg, own_tokenizer, f"run {run_dir}", "its")
  if mesh is None:
    mesh = sharding_lib.make_mesh(MeshConfig(data=-1, fsdp=1, tensor=1))
  elif isinstance(mesh, str):
    if mesh != "run":
      raise ValueError(f"mesh must be None, 'run' or a jax.sharding.Mesh, got {mesh!r}")
    mesh = sharding_lib.make_mesh(cfg.mesh)
  abstract_model = nnx.eval_shape(lambda: lora.apply(Transformer(cfg.model, rngs=nnx.Rngs(0)), cfg.lora,
                                                     nnx.Rngs(1)))
  graphdef, abstract_params, rest = nnx.split(abstract_model, nnx.Param, ...)
  target = abstract_with_shardings(abstract_params, sharding_lib.state_shardings(mesh, abstract_params))
  try:
    if step is not None:
      params = ckpt.restore_params(step, target)
    else:
      step, params = restore_newest(ckpt, lambda s: ckpt.restore_params(s, target))
  finally:
    ckpt.close()
  return LoadedRun(nnx.merge(graphdef, params, rest), cfg, tokenizer, step)


def save_params_run(run_dir: str | pathlib.Path, cfg: Config, model) -> None:
  """A run directory holding only a model (config.yaml + a params-only checkpoint at step 0), as the converters
  write it; `load_run`, evaluation, generation and train.init_from read it."""
  paths.check_bucket(run_dir, "--out")
  run_dir = paths.as_path(run_dir, "--out")
  run_dir.mkdir(parents=True, exist_ok=True)
  (run_dir / CONFIG_FILE).write_text(yaml.safe_dump(config_lib.to_dict(cfg), sort_keys=False))
  ckpt = Checkpointer(run_dir, dataclasses.replace(cfg.checkpoint, async_save=False))
  try:
    ckpt.save_params(0, nnx.state(model, nnx.Param))
  finally:
    ckpt.close()


# ---------------------------------------------------------------------------------------------------------------
# Training into a run directory
# ---------------------------------------------------------------------------------------------------------------

def _params_signature(model_cfg) -> dict:
  d = dataclasses.asdict(model_cfg)
  return {k: v for k, v in d.items() if k not in RESUMABLE_MODEL_KEYS}


def prepare_run_dir(cfg: Config) -> tuple[Any, bool]:
  """Checks that run.dir is usable (its bucket reachable, writable; if it holds a run, the same model) before
  anything is written.

  Returns (run_dir as an `etils.epath.Path`, has_checkpoint).
  """
  paths.check_bucket(cfg.run.dir, "run.dir")
  run_dir = paths.as_path(cfg.run.dir, "run.dir")
  has_ckpt = (run_dir / CHECKPOINT_DIR).is_dir() and any(
      p.name.isdigit() for p in (run_dir / CHECKPOINT_DIR).iterdir())
  if (run_dir / CONFIG_FILE).is_file() and has_ckpt:
    try:
      old = read_run_config(run_dir)
    except ConfigError as e:
      raise ConfigError(f"run.dir {run_dir} holds a run whose config.yaml is unreadable ({e}); pick another run.dir")
    if _params_signature(old.model) != _params_signature(cfg.model) or old.data.tokenizer != cfg.data.tokenizer:
      diff = [k for k, v in _params_signature(cfg.model).items() if _params_signature(old.model).get(k) != v]
      diff += ["data.tokenizer"] if old.data.tokenizer != cfg.data.tokenizer else []
      raise ConfigError(f"run.dir {run_dir} already holds a run with a different model ({', '.join(diff)}); "
                        "pick another run.dir or delete that one")
  if jax.process_index() != 0 and paths.is_remote(run_dir):
    return run_dir, has_ckpt             # one shared directory: process 0 checks that it takes writes
  try:
    run_dir.mkdir(parents=True, exist_ok=True)
    probe = run_dir / f".write-test-{os.getpid()}-{jax.process_index()}"
    probe.write_text("")
    probe.unlink()
  except Exception as e:  # pylint: disable=broad-except  # OSError locally; HTTP / auth errors on object stores
    why = (e.strerror if isinstance(e, OSError) and e.strerror else None) or paths.describe(e)
    raise ConfigError(f"run.dir {run_dir} is not writable ({why}); set run.dir=SOMEWHERE_WRITABLE") from None
  return run_dir, has_ckpt


def check_step_change(cfg: Config, run_dir, given_steps: int) -> None:
  """Resuming with another total step count than the run was started with (its config.yaml's train.steps; the
  count is what the learning-rate schedule is laid out over). Raising it with an explicit train.steps extends the
  run, said in one line before anything happens; a count derived from the token budget (train.steps=0) that differs,
  or an explicit lower one, is a ConfigError: the user did not ask to change the run."""
  path = run_dir / CONFIG_FILE
  if not path.is_file():
    return
  old, new = read_run_config(run_dir).train.steps, cfg.train.steps
  if old in (0, new):
    return
  if given_steps == 0:
    raise ConfigError(f"run.dir {run_dir} was started with train.steps={old}, and train.steps=0 now derives {new} "
                      f"from the token budget: pass train.steps={old} to resume it as it is, train.steps={new} to "
                      "change its length, or pick another run.dir")
  if new < old:
    raise ConfigError(f"train.steps={new} is below the {old} steps the run in {run_dir} was started with (its "
                      f"learning-rate schedule would change mid-run): to stop early keep train.steps={old} and set "
                      f"train.stop_at_step={new}, or pick another run.dir")
  if jax.process_index() == 0:
    print(f"sinkjax.train: extending the run in {run_dir} from {old} to {new} steps (train.steps={new}); the "
          f"learning-rate schedule is laid out anew over {new} steps", flush=True)


def note_resume_changes(cfg: Config, run_dir) -> None:
  """One line listing the settings a resume changes against the run's config.yaml (train.steps has its own rule in
  `check_step_change`; the model and data keys that cannot change are refused elsewhere)."""
  path = run_dir / CONFIG_FILE
  if not path.is_file() or jax.process_index() != 0:
    return
  flat = lambda d, pre="": {k2: v2 for k, v in d.items() for k2, v2 in (
      flat(v, f"{pre}{k}.").items() if isinstance(v, dict) else [(f"{pre}{k}", v)])}
  old, new = flat(config_lib.to_dict(read_run_config(run_dir))), flat(config_lib.to_dict(cfg))
  skip = {"train.steps", "train.stop_at_step", "run.dir", "model.vocab_size"}
  changed = [f"{k} {old[k]!r} -> {v!r}" for k, v in new.items() if k not in skip and k in old and old[k] != v]
  if changed:
    print(f"sinkjax.train: resuming {run_dir} with changed settings: {', '.join(changed)}", flush=True)


def legacy_data_settings(cfg: Config) -> None:
  """Resuming a run whose config.yaml predates a key of LEGACY_DATA_SETTINGS: its iterator state is of the pipeline
  it was trained with (unshuffled rows, document packing), so keep that (with a note) rather than refuse to resume."""
  path = paths.as_path(cfg.run.dir, "run.dir") / CONFIG_FILE
  if not path.is_file():
    return
  try:
    data = (yaml.safe_load(path.read_text()) or {}).get("data") or {}
  except (OSError, yaml.YAMLError, AttributeError):
    return             # prepare_run_dir reports an unreadable config.yaml
  if not isinstance(data, dict):
    return
  for key, old in LEGACY_DATA_SETTINGS.items():
    if key not in data and getattr(cfg.data, key) != old:
      if jax.process_index() == 0:
        print(f"sinkjax.train: {path} predates data.{key}; resuming with data.{key}={old} (what it was trained "
              "with)", flush=True)
      setattr(cfg.data, key, old)


def adopt_init_model(cfg: Config) -> Config | None:
  """train.init_from: reads that run's config and makes its model section this run's (model.dtype, remat and
  attn_impl stay this config's), after checking the shape keys (INIT_CHECKED_KEYS) this config repeats. A config
  that names no tokenizer (data.tokenizer bytes) takes the init run's, so an imported model is fine-tuned on its own
  tokens.

  Returns the init run's config, or None without train.init_from. Changes `cfg` in place.
  """
  src = cfg.train.init_from
  if not src:
    return None
  try:
    init_cfg = read_run_config(src)
  except (CheckpointError, ConfigError) as e:
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
  if _names_no_tokenizer(cfg.data.tokenizer):
    cfg.data.tokenizer = init_cfg.data.tokenizer   # the model's own tokenizer (an import's RUN/tokenizer/), not bytes
  model_tokenizer(cfg, init_cfg.data.tokenizer, f"train.init_from {src!r}", "the imported model's")
  config_lib.validate(cfg)
  return init_cfg


def _names_no_tokenizer(spec) -> bool:
  return str(spec or "").strip() in ("", "bytes")


def model_tokenizer(cfg: Config, own: str, whose: str, owner: str):
  """The tokenizer of `cfg.data.tokenizer` for a model whose own tokenizer is `own` (the data.tokenizer its run was
  trained or imported with), checked where a model and a tokenizer meet (train.init_from, load_run's overrides):
  another tokenizer is accepted only when its vocabulary is the model's own (the same token -> id table, so the
  same embedding rows) and fits the embedding (the run's own tokenizer is taken as the run was made: an import
  without a tokenizer reads as bytes). A model's ids read through another vocabulary are
  never what a user means; a mismatch is a ConfigError (one line) before any step or forward pass. Sets
  model.vocab_size from the tokenizer where the config leaves it 0."""
  try:
    tokenizer = build_tokenizer(cfg.data)
  except DataError as e:
    if str(cfg.data.tokenizer).strip() == str(own).strip():
      raise
    raise ConfigError(f"{e}; {whose}'s own tokenizer is data.tokenizer={own!r}: set that, or data.tokenizer='' "
                      "to use it") from None
  if str(cfg.data.tokenizer).strip() != str(own).strip():
    try:
      own_tok = build_tokenizer(dataclasses.replace(cfg.data, tokenizer=own))
    except DataError as e:
      raise ConfigError(f"{whose}: its own tokenizer cannot be read to compare with data.tokenizer "
                        f"{cfg.data.tokenizer!r} ({e})") from None
    if not same_vocabulary(tokenizer, own_tok):
      raise ConfigError(f"data.tokenizer {cfg.data.tokenizer!r} ({tokenizer.vocab_size:,} tokens) is not the "
                        f"vocabulary of {whose} ({owner} own tokenizer {own!r}, {own_tok.vocab_size:,} tokens): "
                        "its ids would index other embedding rows; drop data.tokenizer (data.tokenizer='') to use "
                        "the model's own")
  if cfg.model.vocab_size == 0:
    cfg.model.vocab_size = tokenizer.vocab_size
  elif tokenizer.vocab_size > cfg.model.vocab_size and str(cfg.data.tokenizer).strip() != str(own).strip():
    raise ConfigError(f"data.tokenizer {cfg.data.tokenizer!r} has {tokenizer.vocab_size:,} tokens, more than the "
                      f"{cfg.model.vocab_size:,} rows of {whose}'s embedding (model.vocab_size); use the model's own "
                      "tokenizer")
  return tokenizer


def restore_init_params(cfg: Config, init_cfg: Config, mesh):
  """The parameters (nnx.State of nnx.Param, no adapters) of the latest checkpoint of train.init_from, placed with
  the training shardings."""
  abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)
  target = abstract_with_shardings(abstract, sharding_lib.state_shardings(mesh, abstract))
  init_ckpt = Checkpointer(cfg.train.init_from, init_cfg.checkpoint, read_only=True)
  try:
    step = init_ckpt.latest_step()
    if step is None:
      raise ConfigError(f"train.init_from {cfg.train.init_from!r} has no checkpoint")
    return init_ckpt.restore_params(step, target)
  finally:
    init_ckpt.close()


# ---------------------------------------------------------------------------------------------------------------
# Eq. 8 with a fixed shared set: the importances of a run
# ---------------------------------------------------------------------------------------------------------------

def head_importance_of(model: nnx.Module, batches) -> np.ndarray:
  """Mean [L, H] head importance (eq. 5) of `model` over `batches` (dicts with inputs, segment_ids, positions)."""
  graphdef, state = nnx.split(model)

  @jax.jit
  def one(state, inputs, segment_ids, positions):
    m = nnx.merge(graphdef, state)
    return forward_with_importance(m, inputs, segment_ids=segment_ids, positions=positions)[1]

  imps = [np.asarray(one(state, jnp.asarray(b["inputs"]), jnp.asarray(b["segment_ids"]), jnp.asarray(b["positions"])))
          for b in batches]
  if not imps:
    raise ValueError("head_importance_of needs at least one batch")
  return np.mean(imps, axis=0)


def shared_heads_of_run(run_dir: str | pathlib.Path, num_shared: int, *, num_batches: int = 4,
                        batch_size: int = 4, data_cfg=None) -> tuple[np.ndarray, np.ndarray]:
  """(importance [L,H], shared mask [L,H] bool: the top-`num_shared` heads of each layer) of a pretrained run,
  measured on `num_batches` validation batches of `data_cfg` (default: the run's own data section)."""
  loaded = load_run(run_dir)
  batches = make_eval_batches(data_cfg or loaded.cfg.data, loaded.tokenizer, batch_size=batch_size,
                              num_batches=num_batches)
  imp = head_importance_of(loaded.model, batches)
  return imp, np.asarray(balance.shared_head_mask(imp, num_shared))


def _recorded_importance(path):
  """The last importance [L,H] in a metrics.jsonl, or the importance of an eval report.json."""
  if path.suffix == ".jsonl":
    return [r["importance"] for r in read_metrics(path) if "importance" in r][-1]
  return json.loads(path.read_text())["importance"]


def fixed_shared_heads(cfg: Config):
  """The [L,H] shared-head mask of loss.shared_heads_from (report.json, metrics.jsonl or a run dir), or None."""
  src = cfg.loss.shared_heads_from
  if not src:
    return None
  path = paths.as_path(src, "loss.shared_heads_from")
  if path.is_dir():
    path = path / "eval" / "report.json" if (path / "eval" / "report.json").is_file() else path / "metrics.jsonl"
  if not path.is_file():
    raise ConfigError(f"loss.shared_heads_from {src!r}: no report.json or metrics.jsonl there")
  try:
    imp = np.asarray(_recorded_importance(path), np.float32)
  except (KeyError, IndexError, ValueError):
    raise ConfigError(f"loss.shared_heads_from {src!r}: {path.name} holds no 'importance'") from None
  want = (len(cfg.model.head_layers), cfg.model.num_heads)
  if imp.shape != want:
    raise ConfigError(f"loss.shared_heads_from {src!r}: importance is {list(imp.shape)}, the model needs "
                      f"{list(want)} (layers with heads x heads)")
  if cfg.loss.num_shared_heads == 0:
    raise ConfigError("loss.shared_heads_from needs loss.num_shared_heads > 0 (how many heads per layer to share)")
  return np.asarray(balance.shared_head_mask(imp, cfg.loss.num_shared_heads))
