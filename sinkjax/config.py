"""Typed configuration: small YAML files that inherit from a base, overridable as `dotted.key=value`.

Every key is declared here with its type and default, so an unknown key or a value of the wrong type is an error
that names the key. A YAML file may start with `base: other.yaml` (relative to itself) to inherit.
"""
from __future__ import annotations

import dataclasses
import pathlib
import typing
from typing import Any

import yaml


class ConfigError(ValueError):
  """A user-facing configuration problem (the message says what to change)."""


@dataclasses.dataclass
class ModelConfig:
  attention: str = "vanilla"        # vanilla | sink | gated | relu
  gate: str = "headwise"            # headwise | elementwise (gated attention)
  num_layers: int = 4
  d_model: int = 256
  num_heads: int = 4
  num_kv_heads: int = 4
  head_dim: int = 64
  vocab_size: int = 0               # 0 = take it from the tokenizer
  mlp_ratio: int = 4
  mlp: str = "relu2"                # relu2 | swiglu
  qk_norm: bool = True
  logit_softcap: float = 15.0       # 0 disables
  rope_theta: float = 10000.0
  max_seq_len: int = 2048
  sink_tokens: int = 0              # learnable sink tokens prepended to K/V (seed 001)
  sink_init: float = 0.0            # initial sink logit (sink attention)
  gate_bias_init: float = 0.0       # initial gate bias (gated attention): sigmoid(0) = 0.5
  tie_embeddings: bool = False
  dtype: str = "bfloat16"           # compute dtype; params stay in param_dtype
  param_dtype: str = "float32"
  remat: bool = False
  attn_impl: str = "auto"           # flash_attention backend


@dataclasses.dataclass
class LossConfig:
  aux_weight: float = 0.0           # lambda of eq. 7/8 (paper: 1e-4 from scratch, 1e-2 fine-tuning)
  num_shared_heads: int = 0         # m of eq. 8; 0 = eq. 7
  shared_heads_from: str = ""       # a run dir / report.json whose importances fix the shared set up front


@dataclasses.dataclass
class DataConfig:
  source: str = "default"           # default | path/glob of .txt/.jsonl/.parquet | tfds:NAME
  seq_len: int = 256
  text_field: str = "text"
  tokenizer: str = "bytes"          # bytes | path to a Hugging Face tokenizer.json
  tfds_dir: str = ""
  train_split: str = "train"
  val_split: str = "validation"
  val_fraction: float = 0.02        # for sources without a validation split
  num_workers: int = 0              # grain worker processes (0 = in-process)
  prefetch: int = 2


@dataclasses.dataclass
class TrainConfig:
  batch_size: int = 16              # sequences per optimizer step (global)
  grad_accum: int = 1               # micro-batches per step
  steps: int = 0                    # 0 = token budget of tokens_per_param x parameters
  tokens_per_param: float = 20.0
  seed: int = 0
  log_every: int = 10
  eval_every: int = 100
  eval_batches: int = 8
  optimizer: str = "muon"           # muon | adamw
  matrix_lr: float = 0.02           # Muon, for hidden weight matrices
  embed_lr: float = 0.2             # AdamW, embeddings (nanochat-style)
  unembed_lr: float = 0.004         # AdamW, unembedding
  scalar_lr: float = 0.04           # AdamW, scalars/vectors (sinks, gate biases, norms)
  adamw_lr: float = 3e-4            # plain AdamW (optimizer: adamw)
  weight_decay: float = 0.0
  grad_clip: float = 1.0
  warmup_steps: int = 0
  decay_frac: float = 0.2           # linear decay to 0 over the final fraction of steps
  max_nonfinite: int = 5            # consecutive non-finite losses before the run stops


@dataclasses.dataclass
class CheckpointConfig:
  every: int = 200
  keep: int = 3
  async_save: bool = True


@dataclasses.dataclass
class RunConfig:
  dir: str = "runs/tiny"


@dataclasses.dataclass
class MeshConfig:
  data: int = -1                    # -1 fills the remaining devices
  fsdp: int = 1
  tensor: int = 1


@dataclasses.dataclass
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  loss: LossConfig = dataclasses.field(default_factory=LossConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  run: RunConfig = dataclasses.field(default_factory=RunConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)


CHOICES = {
    "model.attention": ("vanilla", "sink", "gated", "relu"),
    "model.gate": ("headwise", "elementwise"),
    "model.mlp": ("relu2", "swiglu"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.param_dtype": ("float32", "bfloat16"),
    "model.attn_impl": ("auto", "reference", "xla", "pallas_tpu", "pallas_gpu"),
    "train.optimizer": ("muon", "adamw"),
}


def _coerce(key: str, value: Any, typ: type) -> Any:
  """Checks/converts one leaf value; strings from the command line are parsed as YAML scalars first."""
  if isinstance(value, str) and typ is not str:
    try:
      value = yaml.safe_load(value)
    except yaml.YAMLError:
      pass
  if typ is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
    value = str(value)
  if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
    raise ConfigError(f"config key {key} must be {typ.__name__}, got {value!r}")
  if key in CHOICES and value not in CHOICES[key]:
    raise ConfigError(f"config key {key} must be one of {'|'.join(CHOICES[key])}, got {value!r}")
  return value


def _apply(obj: Any, tree: dict, prefix: str = "") -> None:
  hints = typing.get_type_hints(type(obj))
  for name, value in tree.items():
    key = f"{prefix}{name}"
    if name not in hints:
      known = ", ".join(f"{prefix}{f.name}" for f in dataclasses.fields(obj))
      raise ConfigError(f"unknown config key {key} (known here: {known})")
    typ = hints[name]
    if dataclasses.is_dataclass(typ):
      if not isinstance(value, dict):
        raise ConfigError(f"config key {key} must be a mapping of sub-keys, got {value!r}")
      _apply(getattr(obj, name), value, key + ".")
    else:
      setattr(obj, name, _coerce(key, value, typ))


def _read_yaml(path: pathlib.Path, seen: tuple = ()) -> dict:
  if not path.is_file():
    raise ConfigError(f"config file {path} does not exist (see configs/ for the available ones)")
  if path.resolve() in seen:
    raise ConfigError(f"config file {path} inherits from itself through 'base:'")
  try:
    tree = yaml.safe_load(path.read_text()) or {}
  except yaml.YAMLError as e:
    raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
  if not isinstance(tree, dict):
    raise ConfigError(f"config file {path} must be a mapping of sections (model:, train:, ...)")
  base = tree.pop("base", None)
  if base is None:
    return tree
  merged = _read_yaml(path.parent / base, seen + (path.resolve(),))
  _deep_merge(merged, tree)
  return merged


def _deep_merge(dst: dict, src: dict) -> None:
  for k, v in src.items():
    if isinstance(v, dict) and isinstance(dst.get(k), dict):
      _deep_merge(dst[k], v)
    else:
      dst[k] = v


def parse_override(text: str) -> tuple[str, str]:
  if "=" not in text:
    raise ConfigError(f"override {text!r} must look like section.key=value (e.g. train.steps=100)")
  key, value = text.split("=", 1)
  return key.strip(), value


def load_config(path: str | None = None, overrides: list[str] | tuple = ()) -> Config:
  """Reads a YAML config (with `base:` inheritance), applies `dotted.key=value` overrides and validates."""
  cfg = Config()
  if path:
    _apply(cfg, _read_yaml(pathlib.Path(path)))
  for text in overrides:
    key, value = parse_override(text)
    tree: dict = {}
    node = tree
    parts = key.split(".")
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = value
    _apply(cfg, tree)
  validate(cfg)
  return cfg


def from_dict(tree: dict) -> Config:
  cfg = Config()
  _apply(cfg, tree)
  validate(cfg)
  return cfg


def to_dict(cfg: Config) -> dict:
  return dataclasses.asdict(cfg)


def validate(cfg: Config) -> None:
  m = cfg.model
  if m.num_heads % max(m.num_kv_heads, 1) or m.num_kv_heads < 1:
    raise ConfigError(f"model.num_heads ({m.num_heads}) must be a positive multiple of model.num_kv_heads "
                      f"({m.num_kv_heads})")
  for key, val in (("model.num_layers", m.num_layers), ("model.d_model", m.d_model),
                   ("model.head_dim", m.head_dim), ("data.seq_len", cfg.data.seq_len),
                   ("train.batch_size", cfg.train.batch_size), ("train.grad_accum", cfg.train.grad_accum),
                   ("train.log_every", cfg.train.log_every), ("checkpoint.every", cfg.checkpoint.every)):
    if val < 1:
      raise ConfigError(f"config key {key} must be >= 1, got {val}")
  if cfg.train.batch_size % cfg.train.grad_accum:
    raise ConfigError(f"train.batch_size ({cfg.train.batch_size}) must be divisible by train.grad_accum "
                      f"({cfg.train.grad_accum})")
  if not 0 <= cfg.loss.num_shared_heads < m.num_heads:
    raise ConfigError(f"loss.num_shared_heads must be in [0, model.num_heads) = [0, {m.num_heads}), "
                      f"got {cfg.loss.num_shared_heads}")
  if cfg.loss.aux_weight < 0:
    raise ConfigError(f"loss.aux_weight must be >= 0, got {cfg.loss.aux_weight}")
