"""nanochat checkpoints <-> sinkjax: the paper's baseline GPT (commit 9d4c9b7) and its later architecture (6bb9240).

    python -m sinkjax.convert.nanochat --checkpoint DIR [--step N] [--tokenizer tokenizer.json] --out RUN_DIR
    python -m sinkjax.convert.nanochat --export RUN_DIR --out DIR [--step N]

nanochat's GPT is a configuration of the one sinkjax `Transformer` (model.* keys, `model_config_from_nanochat`):
vanilla attention, RMSNorm without parameters (torch's default eps), the normed embedding, RoPE in nanochat's sign
with bfloat16 tables and QK-norm after it (model.rope_style=nanochat), ReLU^2 MLP 4x, untied embedding and LM head
padded to a multiple of 64 rows (model.vocab_pad_to), logit soft-cap 15. The later architecture adds per-layer
`resid_lambdas` / `x0_lambdas` (model.residual_scalars) and a sliding-window pattern (GPTConfig.window_pattern, e.g.
"SSSL", tiled over layers, the last layer always L): an S layer's FA3 window (seq_len // 2, 0) lets a query see
seq_len // 2 earlier keys and itself, i.e. model.sliding_window = seq_len // 2 + 1 on model.layer_types "sliding";
an L layer (window seq_len) is full attention for every sequence up to the model's sequence_len.

Weights: `model_{step:06d}.pt` read with `torch.load(weights_only=True)` only (no pickled code runs) and
`meta_{step:06d}.json` for GPTConfig (`model_config`). nanochat's own tokenizer.pkl is never unpickled: pass its
tokenizer as a Hugging Face tokenizer.json, or use the byte tokenizer when the vocabulary is 256 + specials.
Linear weights are transposed ([out, in] in torch, [in, out] in Flax).
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":
  errors.require_extra("sinkjax.convert.nanochat")   # before the imports below, which need the train extra

import dataclasses
import io
import json
import pathlib
import re
import sys
from typing import Any

import numpy as np
from flax import nnx

from sinkjax import checkpoint, lora, options, paths
from sinkjax import config as config_lib
from sinkjax import run as run_lib
from sinkjax.config import Config, DataConfig, ModelConfig
from sinkjax.convert import ConvertError
from sinkjax.convert.hf import model_with_params
from sinkjax.data import build_tokenizer

TORCH_RMS_EPS = float(np.finfo(np.float32).eps)      # F.rms_norm(x, shape) with eps=None on float32 inputs
GPT_CONFIG_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")
LATER_KEYS = ("window_pattern",)                     # GPTConfig fields of the later architecture (6bb9240)
_MODEL_FILE = re.compile(r"model_(\d{6})\.pt")


def layer_types_of(pattern: str, num_layers: int) -> list[str]:
  """nanochat's `_compute_window_sizes` as model.layer_types: the pattern tiled over layers, the last layer L."""
  pattern = pattern.upper()
  if not pattern or any(c not in "SL" for c in pattern):
    raise ConvertError(f"window_pattern {pattern!r} must be a non-empty string of S and L (nanochat GPTConfig)")
  kinds = ["sliding" if pattern[i % len(pattern)] == "S" else "full" for i in range(num_layers)]
  kinds[-1] = "full"
  return kinds


def model_config_from_nanochat(gpt: dict, *, residual_scalars: bool | None = None, dtype: str = "float32",
                               param_dtype: str = "float32") -> ModelConfig:
  """The ModelConfig of a nanochat GPTConfig (meta json's `model_config`). residual_scalars defaults to "the
  config is of the later architecture" (it names a window_pattern)."""
  unknown = sorted(set(gpt) - set(GPT_CONFIG_KEYS) - set(LATER_KEYS))
  missing = [k for k in GPT_CONFIG_KEYS if k not in gpt]
  if unknown or missing:
    raise ConvertError(f"model_config has unknown keys {unknown} / lacks {missing}: not a nanochat 9d4c9b7 or "
                       f"6bb9240 GPTConfig")
  d, heads, kv, layers, seq = (int(gpt[k]) for k in ("n_embd", "n_head", "n_kv_head", "n_layer", "sequence_len"))
  if d % heads or heads % kv:
    raise ConvertError(f"n_embd {d} must be divisible by n_head {heads}, and n_head by n_kv_head {kv}")
  later = "window_pattern" in gpt
  kinds = layer_types_of(gpt["window_pattern"], layers) if later else []
  sliding = "sliding" in kinds
  return ModelConfig(
      attention="vanilla", num_layers=layers, d_model=d, num_heads=heads, num_kv_heads=kv, head_dim=d // heads,
      vocab_size=int(gpt["vocab_size"]), vocab_pad_to=64, mlp="relu2", mlp_ratio=4, qk_norm=True,
      logit_softcap=15.0, rope_theta=10000.0, max_seq_len=seq, tie_embeddings=False, dtype=dtype,
      param_dtype=param_dtype, norm_scale=False, norm_eps=TORCH_RMS_EPS, embed_norm=True, init="nanochat",
      rope_style="nanochat", residual_scalars=later if residual_scalars is None else residual_scalars,
      layer_types=kinds if sliding else [], sliding_window=seq // 2 + 1 if sliding else 0)


def gpt_config_of(m: ModelConfig) -> dict:
  """The nanochat GPTConfig kwargs (meta json's `model_config`) of a nanochat-shaped ModelConfig."""
  gpt = dict(sequence_len=m.max_seq_len, vocab_size=m.vocab_size, n_layer=m.num_layers, n_head=m.num_heads,
             n_kv_head=m.num_kv_heads, n_embd=m.d_model)
  if m.residual_scalars or m.layer_types:
    gpt["window_pattern"] = "".join("S" if t == "sliding" else "L" for t in (m.layer_types or ["full"] *
                                                                                 m.num_layers))
  return gpt


def check_exportable(m: ModelConfig) -> None:
  """A ModelConfig nanochat's GPT can hold exactly, or ConvertError naming the first difference."""
  want = model_config_from_nanochat(gpt_config_of(m), residual_scalars=m.residual_scalars)
  for key in ("attention", "head_dim", "vocab_pad_to", "mlp", "mlp_ratio", "mlp_hidden", "qk_norm", "logit_softcap",
              "rope_theta", "tie_embeddings", "norm_scale", "embed_norm", "rope_style", "sink_tokens",
              "attn_bias", "mlp_bias", "moe_experts", "rope_scaling", "sliding_window", "layer_types"):
    if getattr(m, key) != getattr(want, key):
      raise ConvertError(f"model.{key}={getattr(m, key)!r} has no nanochat equivalent (nanochat: "
                         f"{getattr(want, key)!r}); only vanilla nanochat-shaped runs export to nanochat")
  if m.layer_types and m.layer_types[-1] != "full":
    raise ConvertError("nanochat's last layer is always full attention; this run's last layer is sliding")


def _pairs(m: ModelConfig) -> list[tuple[str, tuple, bool]]:
  """(nanochat state-dict name, sinkjax param path, transpose) for every parameter."""
  pairs = [("transformer.wte.weight", ("embed", "embedding"), False), ("lm_head.weight", ("lm_head", "kernel"), True)]
  for i in range(m.num_layers):
    for module, proj, name in (("attn", "q_proj", "attn.c_q"), ("attn", "k_proj", "attn.c_k"),
                               ("attn", "v_proj", "attn.c_v"), ("attn", "o_proj", "attn.c_proj"),
                               ("mlp", "up_proj", "mlp.c_fc"), ("mlp", "down_proj", "mlp.c_proj")):
      pairs.append((f"transformer.h.{i}.{name}.weight", ("layers", i, module, proj, "kernel"), True))
  if m.residual_scalars:
    pairs += [("resid_lambdas", ("resid_lambdas",), False), ("x0_lambdas", ("x0_lambdas",), False)]
  return pairs


def params_from_nanochat(state_dict: dict, m: ModelConfig) -> dict[tuple, np.ndarray]:
  """{sinkjax param path: float32 array} from a nanochat state dict (names with or without torch.compile's
  `_orig_mod.` prefix; tensors or arrays, any float dtype)."""
  sd = {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}
  pairs = _pairs(m)
  unknown = sorted(set(sd) - {name for name, _, _ in pairs})
  missing = [name for name, _, _ in pairs if name not in sd]
  if unknown or missing:
    what = f"unknown tensors {unknown[:3]}" if unknown else f"missing tensors {missing[:3]}"
    raise ConvertError(f"the checkpoint does not fit its model_config ({what}); is it a nanochat GPT state dict?")
  out = {}
  for name, path, transpose in pairs:
    value = _to_numpy(sd[name])
    out[path] = np.ascontiguousarray(value.T) if transpose else value
  return out


def params_to_nanochat(model) -> dict[str, np.ndarray]:
  """{nanochat state-dict name: float32 array} of a sinkjax model (merge LoRA adapters first)."""
  check_exportable(model.cfg)
  flat = {path: np.asarray(var.get_value(), np.float32)
          for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  return {name: np.ascontiguousarray(flat[path].T) if transpose else flat[path]
          for name, path, transpose in _pairs(model.cfg)}


def _to_numpy(value) -> np.ndarray:
  if hasattr(value, "detach"):                        # a torch tensor (bfloat16 has no numpy dtype: go via float32)
    return value.detach().float().cpu().numpy()
  return np.asarray(value, np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Checkpoint files (import) and run directories (export)
# ----------------------------------------------------------------------------------------------------------------

def _torch():
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ConvertError("reading/writing nanochat checkpoints needs torch: pip install torch --index-url "
                       "https://download.pytorch.org/whl/cpu") from None
  return torch


def checkpoint_files(directory, step: int | None = None) -> tuple[Any, Any, int]:
  """(model_{step:06d}.pt, meta_{step:06d}.json, step) in a nanochat checkpoint directory (local or gs:// / s3://);
  newest step by default."""
  paths.check_bucket(directory, "--checkpoint")
  directory = paths.as_path(directory, "--checkpoint")
  if not directory.is_dir():
    raise ConvertError(f"--checkpoint {directory} is not a directory (give nanochat's base_checkpoints/dNN folder)")
  steps = sorted(int(m.group(1)) for p in directory.iterdir() if (m := _MODEL_FILE.fullmatch(p.name)))
  if not steps:
    raise ConvertError(f"{directory} has no model_NNNNNN.pt file: not a nanochat checkpoint directory")
  if step is None:
    step = steps[-1]
  elif step not in steps:
    raise ConvertError(f"{directory} has no checkpoint at step {step} (available: {steps})")
  model_path, meta_path = directory / f"model_{step:06d}.pt", directory / f"meta_{step:06d}.json"
  if not meta_path.is_file():
    raise ConvertError(f"{meta_path.name} is missing beside {model_path.name}: nanochat writes both")
  return model_path, meta_path, step


def read_checkpoint(directory, step: int | None = None) -> tuple[dict, dict, int]:
  """(state dict of numpy-convertible tensors, meta json, step). Weights are read with weights_only=True: a file
  that needs arbitrary unpickling (code, custom classes) is refused, never executed."""
  torch = _torch()
  model_path, meta_path, step = checkpoint_files(directory, step)
  try:
    meta = json.loads(meta_path.read_text())
  except json.JSONDecodeError as e:
    raise ConvertError(f"{meta_path} is not valid JSON ({e.msg})") from None
  if not isinstance(meta.get("model_config"), dict):
    raise ConvertError(f"{meta_path} has no model_config: not a nanochat meta file")
  try:
    src = io.BytesIO(model_path.read_bytes()) if paths.is_remote(model_path) else str(model_path)
    state = torch.load(src, map_location="cpu", weights_only=True)
  except Exception as e:  # pylint: disable=broad-except  (torch raises UnpicklingError, RuntimeError, EOFError...)
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ConvertError(f"{model_path.name} is not a plain tensor state dict readable with weights_only=True "
                       f"({first[:160]}); refusing to unpickle it") from None
  if not isinstance(state, dict) or not all(hasattr(v, "shape") for v in state.values()):
    raise ConvertError(f"{model_path.name} does not hold a state dict of tensors")
  return state, meta, step


def _tokenizer_setting(model_cfg: ModelConfig, tokenizer: str | None, run_dir) -> str:
  """data.tokenizer of the imported run: a copy of --tokenizer inside it, or "bytes" when the vocabulary is the byte
  tokenizer's; checked against the model's vocabulary."""
  if tokenizer is None:
    if model_cfg.vocab_size != 257:
      raise ConvertError(f"the model's vocabulary has {model_cfg.vocab_size} tokens: give its tokenizer as "
                         f"--tokenizer tokenizer.json (nanochat's tokenizer.pkl is never unpickled here)")
    return "bytes"
  if not paths.as_path(tokenizer, "--tokenizer").is_file():
    raise ConvertError(f"--tokenizer {tokenizer} does not exist (give a Hugging Face tokenizer.json)")
  if str(tokenizer).endswith(".pkl"):
    raise ConvertError("--tokenizer must be a Hugging Face tokenizer.json: a pickle is never loaded here")
  size = build_tokenizer(DataConfig(tokenizer=str(tokenizer))).vocab_size
  if size != model_cfg.vocab_size:
    raise ConvertError(f"--tokenizer {tokenizer} has {size} tokens but the model's vocab_size is "
                       f"{model_cfg.vocab_size}; give the tokenizer the model was trained with")
  run_dir.mkdir(parents=True, exist_ok=True)
  paths.copy_file(tokenizer, run_dir / "tokenizer.json")
  dst = run_dir / "tokenizer.json"
  return str(dst) if paths.is_remote(dst) else str(pathlib.Path(dst).resolve())


def convert(checkpoint_dir, run_dir, *, step: int | None = None, tokenizer: str | None = None,
            dtype: str = "bfloat16", param_dtype: str = "float32") -> tuple[Config, int]:
  """Imports a nanochat checkpoint into a run directory (config.yaml + Orbax checkpoint at step 0) that
  `load_run`, eval, generate and train.init_from read. Returns (config, nanochat step)."""
  paths.check_bucket(run_dir, "--out")
  run_dir = paths.as_path(run_dir, "--out")
  if (run_dir / checkpoint.CHECKPOINT_DIR).exists():
    raise ConvertError(f"{run_dir} already holds a checkpoint; give a new --out directory")
  state, meta, step = read_checkpoint(checkpoint_dir, step)
  names = {k.removeprefix("_orig_mod.") for k in state}
  m = model_config_from_nanochat(meta["model_config"], residual_scalars="resid_lambdas" in names,
                                 param_dtype=param_dtype)
  model = model_with_params(m, params_from_nanochat(state, m))
  cfg = Config(model=dataclasses.replace(m, dtype=dtype))
  cfg.data.packing = "stream"
  cfg.data.seq_len = m.max_seq_len
  cfg.data.tokenizer = _tokenizer_setting(m, tokenizer, run_dir)
  cfg.run.dir = str(run_dir)
  config_lib.validate(cfg)
  run_lib.save_params_run(run_dir, cfg, model)
  return cfg, step


def export(run_dir, out_dir, *, step: int | None = None):
  """Writes model_{step:06d}.pt + meta_{step:06d}.json (LoRA adapters merged) that nanochat's
  `GPT(GPTConfig(**meta["model_config"]))` loads with strict=True; the run's tokenizer.json is copied beside.
  `out_dir` may be a gs:// / s3:// URL (written locally, then uploaded)."""
  torch = _torch()
  paths.check_bucket(out_dir, "--out")
  model, cfg, _, step = run_lib.load_run(run_dir, step=step)
  check_exportable(cfg.model)
  tensors = params_to_nanochat(lora.merge(model))
  with paths.staged_dir(out_dir) as local:
    torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, local / f"model_{step:06d}.pt")
    meta = {"step": step, "model_config": gpt_config_of(cfg.model), "val_bpb": None,
            "user_config": {"exported_from": str(run_dir)}}
    (local / f"meta_{step:06d}.json").write_text(json.dumps(meta, indent=2))
    if cfg.data.tokenizer != "bytes" and paths.as_path(cfg.data.tokenizer).is_file():
      paths.copy_file(cfg.data.tokenizer, local / "tokenizer.json")
  return out_dir


@dataclasses.dataclass
class NanochatConvertOptions:
  """The convert.* options (`python -m sinkjax.convert.nanochat`; each flag the alias of its key): --checkpoint
  imports, --export exports."""
  checkpoint: str = config_lib.declare("", alias="--checkpoint", metavar="DIR",
                                   help="nanochat checkpoint directory to import")
  export: str = config_lib.declare("", alias="--export", metavar="RUN_DIR",
                               help="run directory to export (LoRA adapters are merged)")
  out: str = config_lib.declare("", alias="--out", metavar="OUT", required=True,
                            help="the run directory (import) or nanochat directory (export)")
  step: int | None = config_lib.declare(None, ">=0", alias="--step", help="checkpoint step (default: the newest)")
  tokenizer: str | None = config_lib.declare(
      None, alias="--tokenizer",
      help="import: the model's tokenizer as a Hugging Face tokenizer.json (copied into the run); not needed for a "
           "257-token byte vocabulary")
  dtype: str = config_lib.declare("bfloat16", choices=("float32", "bfloat16"), alias="--dtype",
                              help="import: model.dtype (compute) of the run")


COMMAND = options.Command(
    prog="python -m sinkjax.convert.nanochat", sections={"convert": NanochatConvertOptions},
    description="Import a nanochat checkpoint (model_NNNNNN.pt + meta_NNNNNN.json, commit 9d4c9b7 or the later "
                "6bb9240 architecture) into a sinkjax run directory, or export a run to nanochat's format.")


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, _: run(sections["convert"]))


def run(opts: NanochatConvertOptions) -> None:
  """Imports opts.checkpoint or exports opts.export into opts.out."""
  if bool(opts.checkpoint) == bool(opts.export):
    raise ConvertError("give one of --checkpoint DIR (import) or --export RUN_DIR (export)")
  if opts.checkpoint:
    cfg, step = convert(opts.checkpoint, opts.out, step=opts.step, tokenizer=opts.tokenizer, dtype=opts.dtype)
    m = cfg.model
    kind = "6bb9240 (resid/x0 lambdas, windows)" if m.residual_scalars else "9d4c9b7"
    print(f"imported {opts.checkpoint} step {step} -> {opts.out}: nanochat {kind}, {m.num_layers} layers, "
          f"d_model {m.d_model}, {m.num_heads}/{m.num_kv_heads} heads, vocab {m.vocab_size}")
  else:
    print(f"exported {opts.export} -> {export(opts.export, opts.out, step=opts.step)}")


if __name__ == "__main__":
  sys.exit(main())
