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

import numpy as np

from sinkjax.config import ModelConfig
from sinkjax.convert.hf import ConvertError

TORCH_RMS_EPS = float(np.finfo(np.float32).eps)      # F.rms_norm(x, shape) with eps=None on float32 inputs
GPT_CONFIG_KEYS = ("sequence_len", "vocab_size", "n_layer", "n_head", "n_kv_head", "n_embd")
LATER_KEYS = ("window_pattern",)                     # GPTConfig fields of the later architecture (6bb9240)


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
  from flax import nnx  # pylint: disable=import-outside-toplevel
  check_exportable(model.cfg)
  flat = {path: np.asarray(var.get_value(), np.float32)
          for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  return {name: np.ascontiguousarray(flat[path].T) if transpose else flat[path]
          for name, path, transpose in _pairs(model.cfg)}


def _to_numpy(value) -> np.ndarray:
  if hasattr(value, "detach"):                        # a torch tensor (bfloat16 has no numpy dtype: go via float32)
    return value.detach().float().cpu().numpy()
  return np.asarray(value, np.float32)
