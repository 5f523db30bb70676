"""Hugging Face checkpoints <-> sinkjax: Llama 3, Qwen3 and GPT-OSS, in both directions.

    from sinkjax.convert.hf import load_hf
    model = load_hf("path/to/hf_dir")          # a sinkjax Transformer; model(tokens) -> logits
    python -m sinkjax.convert.hf --hf-dir DIR --out RUN_DIR        # import into a run directory
    python -m sinkjax.convert.hf --hf-dir MODEL.gguf --out RUN_DIR # a GGUF file (dequantized; sinkjax.convert.gguf)
    python -m sinkjax.convert.hf --export RUN_DIR --out DIR        # export (LoRA adapters merged) for transformers

The Hugging Face architectures are configurations of the one sinkjax `Transformer` (model.* keys), not copies of it:
  Llama 3   vanilla attention, GQA, RoPE (+ llama3 scaling), learnable RMSNorm scales, SwiGLU, no QK-norm
  Qwen3     the same with per-head q/k RMSNorm (learnable scale) and an explicit head_dim
  GPT-OSS   sink attention (learned per-head sinks), alternating sliding-window / full layers, q/k/v/o biases,
            YaRN RoPE, and a top-k routed MoE MLP with GPT-OSS's clamped SwiGLU (experts with biases)
and all of them: no embedding norm, no logit soft-cap. Weights are read from safetensors only (one file, several,
or an index json; MXFP4-quantized GPT-OSS experts are dequantized); pickled `.bin` checkpoints are refused, since
loading them executes code. Linear weights are transposed ([out, in] in torch, [in, out] in Flax).

An import writes the model's tokenizer into the run (RUN_DIR/tokenizer/: tokenizer.json and the files beside it that
say its BOS / EOS / chat template, sinkjax.data.tokenizers.SIDE_FILES; generation_config.json made from config.json's
ids when the model has none) and records the model's context length (max_position_embeddings) as data.seq_len; an
export writes those files back beside the weights.
"""
from __future__ import annotations

from sinkjax import cli

if __name__ == "__main__":
  cli.require_extra("sinkjax.convert.hf")   # before the imports below, which need the train extra

import contextlib
import dataclasses
import json
import math
import pathlib
import re
import sys
import tempfile

import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax import checkpoint, lora, paths
from sinkjax import config as config_lib
from sinkjax import run as run_lib
from sinkjax.config import Config, ModelConfig
from sinkjax.convert import ConvertError
from sinkjax.convert import gguf as gguf_lib
from sinkjax.data.tokenizers import SIDE_FILES
from sinkjax.layers import hf_attention_tensors
from sinkjax.model import Transformer

FAMILIES = ("llama", "qwen3", "gpt_oss")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt_oss": "GptOssForCausalLM"}
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")          # buffers some older checkpoints carry
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------------

def read_hf_config(hf_dir: str | pathlib.Path) -> dict:
  path = pathlib.Path(hf_dir) / "config.json"
  if not pathlib.Path(hf_dir).is_dir():
    raise ConvertError(f"--hf-dir {hf_dir} is not a directory (give a Hugging Face model directory)")
  if not path.is_file():
    raise ConvertError(f"{hf_dir} has no config.json; give a Hugging Face model directory (save_pretrained output)")
  try:
    return json.loads(path.read_text())
  except json.JSONDecodeError as e:
    raise ConvertError(f"{path} is not valid JSON ({e.msg})") from None


def _rope(hf: dict) -> dict:
  """The RoPE parameters of an HF config, whichever format it uses (`rope_parameters` in transformers >= 5,
  `rope_theta` + `rope_scaling` before)."""
  rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
  rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
  rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
  if rope.get("partial_rotary_factor", 1.0) != 1.0 or hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise ConvertError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
  return rope


def model_config_from_hf(hf: dict, *, dtype: str = "float32", param_dtype: str = "float32") -> ModelConfig:
  """The sinkjax ModelConfig of a Hugging Face config.json (Llama 3, Qwen3 or GPT-OSS)."""
  family = hf.get("model_type")
  if family not in FAMILIES:
    raise ConvertError(f"model_type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
  if family != "gpt_oss" and hf.get("hidden_act", "silu") != "silu":
    raise ConvertError(f"hidden_act {hf.get('hidden_act')!r} is not supported (Llama/Qwen3 use silu)")
  heads = hf["num_attention_heads"]
  rope = _rope(hf)
  max_len = int(hf.get("max_position_embeddings") or 2048)
  m = ModelConfig(
      num_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, vocab_size=hf["vocab_size"],
      mlp="swiglu", mlp_hidden=hf["intermediate_size"], qk_norm=family == "qwen3", logit_softcap=0.0,
      rope_theta=float(rope["rope_theta"]), max_seq_len=max_len, tie_embeddings=bool(hf.get("tie_word_embeddings")),
      norm_scale=True, norm_eps=float(hf.get("rms_norm_eps", 1e-6)), embed_norm=False,
      attn_bias=bool(hf.get("attention_bias", False)), mlp_bias=bool(hf.get("mlp_bias", False)),
      dtype=dtype, param_dtype=param_dtype)
  kind = rope["rope_type"]
  if kind == "llama3":
    m.rope_scaling, m.rope_factor = "llama3", float(rope["factor"])
    m.rope_low_freq_factor, m.rope_high_freq_factor = float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    m.rope_original_max_seq_len = int(rope.get("original_max_position_embeddings") or max_len)
  elif kind == "yarn":
    m.rope_scaling = "yarn"
    m.rope_original_max_seq_len = int(rope["original_max_position_embeddings"])
    m.rope_factor = float(rope.get("factor") or max_len / m.rope_original_max_seq_len)
    m.rope_beta_fast, m.rope_beta_slow = float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1)
    m.rope_truncate = bool(rope.get("truncate", True))
    factor = rope.get("attention_factor")
    if factor is None and rope.get("mscale") and rope.get("mscale_all_dim"):
      ms = lambda s: 0.1 * s * math.log(m.rope_factor) + 1.0 if m.rope_factor > 1 else 1.0
      factor = ms(rope["mscale"]) / ms(rope["mscale_all_dim"])
    m.rope_attention_factor = float(factor or 0.0)
  elif kind != "default":
    raise ConvertError(f"rope_type {kind!r} is not supported (default | llama3 | yarn)")
  if family == "qwen3" and hf.get("use_sliding_window"):
    raise ConvertError("Qwen3 with use_sliding_window is not supported (sliding windows need sink attention here)")
  if family == "gpt_oss":
    m.attention, m.mlp, m.mlp_bias = "sink", "clamped_swiglu", True
    m.moe_experts, m.moe_top_k = hf["num_local_experts"], hf["num_experts_per_tok"]
    m.swiglu_limit, m.swiglu_alpha = float(hf.get("swiglu_limit", 7.0)), float(hf.get("swiglu_alpha", 1.702))
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(m.num_layers)]
    m.layer_types = ["sliding" if t == "sliding_attention" else "full" for t in types]
    m.sliding_window = int(hf.get("sliding_window") or 0)
    if not m.sliding_window:
      m.layer_types = ["full"] * m.num_layers
  cfg = Config(model=m)
  try:
    config_lib.validate(cfg)
  except config_lib.ConfigError as e:
    raise ConvertError(f"the checkpoint's config maps to an invalid sinkjax config: {e}") from None
  return m


def family_of(m: ModelConfig) -> str:
  """The Hugging Face architecture a sinkjax model config can be exported as (ConvertError if none)."""
  problems = []
  if m.embed_norm:
    problems.append("model.embed_norm must be false")
  if m.logit_softcap:
    problems.append("model.logit_softcap must be 0")
  if m.sink_tokens:
    problems.append("model.sink_tokens must be 0")
  attn = hf_attention_tensors(m.attention_config())      # None: an attention transformers does not have
  sinks = attn is not None and "sinks" in attn
  if sinks and m.moe_experts and m.mlp == "clamped_swiglu" and not m.qk_norm and m.mlp_bias:
    family = "gpt_oss"
  elif attn is not None and not sinks and not m.moe_experts and m.mlp == "swiglu" and not m.sliding_window:
    family = "qwen3" if m.qk_norm else "llama"
    if m.attn_bias and m.qk_norm:
      problems.append("Qwen3 has no attention biases here (model.attn_bias)")
  else:
    family = None
    problems.append("the architecture must be Llama/Qwen3-like (vanilla attention, swiglu MLP) or GPT-OSS-like "
                    "(sink attention, clamped_swiglu MoE with biases)")
  if problems:
    raise ConvertError("this model cannot be exported to Hugging Face: " + "; ".join(problems))
  return family


def hf_config(m: ModelConfig, family: str, dtype: str = "float32") -> dict:
  """config.json for transformers (both the >= 5 `rope_parameters` and the older rope_theta/rope_scaling keys)."""
  rope = {"rope_type": "default", "rope_theta": m.rope_theta}
  orig = m.rope_original_max_seq_len or m.max_seq_len
  if m.rope_scaling == "llama3":
    rope.update(rope_type="llama3", factor=m.rope_factor, low_freq_factor=m.rope_low_freq_factor,
                high_freq_factor=m.rope_high_freq_factor, original_max_position_embeddings=orig)
  elif m.rope_scaling == "yarn":
    rope.update(rope_type="yarn", factor=m.rope_factor, beta_fast=m.rope_beta_fast, beta_slow=m.rope_beta_slow,
                truncate=m.rope_truncate, original_max_position_embeddings=orig)
    if m.rope_attention_factor:
      rope["attention_factor"] = m.rope_attention_factor
  scaling = None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
  out = {
      "architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": m.vocab_size,
      "hidden_size": m.d_model, "intermediate_size": m.mlp_width,
      "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim, "hidden_act": "silu",
      "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
      "tie_word_embeddings": m.tie_embeddings, "attention_bias": m.attn_bias, "attention_dropout": 0.0,
      "rope_theta": m.rope_theta, "rope_scaling": scaling, "rope_parameters": rope, "torch_dtype": dtype,
      "dtype": dtype, "use_cache": True,
  }
  if family == "llama":
    out["mlp_bias"] = m.mlp_bias
  if family == "qwen3":
    out.update(use_sliding_window=False, sliding_window=None, max_window_layers=m.num_layers,
               layer_types=["full_attention"] * m.num_layers)
  if family == "gpt_oss":
    types = m.layer_types or (["sliding"] * m.num_layers if m.sliding_window else ["full"] * m.num_layers)
    out.update(num_local_experts=m.moe_experts, num_experts_per_tok=m.moe_top_k, swiglu_limit=m.swiglu_limit,
               swiglu_alpha=m.swiglu_alpha, sliding_window=m.sliding_window or None,
               layer_types=[f"{t}_attention" for t in types], router_aux_loss_coef=0.0,
               output_router_logits=False)
  return out


# ----------------------------------------------------------------------------------------------------------------
# Tensor names: (Hugging Face name, sinkjax parameter path, transpose?) for every 1:1 tensor
# ----------------------------------------------------------------------------------------------------------------

def _pairs(m: ModelConfig, family: str) -> list[tuple[str, tuple, bool]]:
  pairs = [("model.embed_tokens.weight", ("embed", "embedding"), False),
           ("model.norm.weight", ("final_norm", "scale"), False)]
  if not m.tie_embeddings:
    pairs.append(("lm_head.weight", ("lm_head", "kernel"), True))
  attn = hf_attention_tensors(m.attention_config()).items()       # the same names in every layer
  for i in range(m.num_layers):
    hf, ours = f"model.layers.{i}.", ("layers", i)
    pairs += [(hf + "input_layernorm.weight", ours + ("attn_norm", "scale"), False),
              (hf + "post_attention_layernorm.weight", ours + ("mlp_norm", "scale"), False)]
    pairs += [(hf + "self_attn." + name, ours + ("attn", *path), transpose) for name, (path, transpose) in attn]
    if family == "gpt_oss":
      pairs += [(hf + "mlp.router.weight", ours + ("mlp", "router", "kernel"), True),
                (hf + "mlp.router.bias", ours + ("mlp", "router", "bias"), False),
                (hf + "mlp.experts.down_proj", ours + ("mlp", "down_kernel"), False),
                (hf + "mlp.experts.down_proj_bias", ours + ("mlp", "down_bias"), False)]
    else:
      for p in ("gate_proj", "up_proj", "down_proj"):
        pairs.append((hf + f"mlp.{p}.weight", ours + ("mlp", p, "kernel"), True))
        if m.mlp_bias:
          pairs.append((hf + f"mlp.{p}.bias", ours + ("mlp", p, "bias"), False))
  return pairs


def _interleaved(m: ModelConfig) -> list[tuple[str, tuple, tuple]]:
  """GPT-OSS stores each expert's gate and up projections interleaved along the last axis (gate at even columns,
  up at odd): (HF name, gate path, up path)."""
  out = []
  for i in range(m.num_layers):
    hf, ours = f"model.layers.{i}.mlp.experts.", ("layers", i, "mlp")
    out += [(hf + "gate_up_proj", ours + ("gate_kernel",), ours + ("up_kernel",)),
            (hf + "gate_up_proj_bias", ours + ("gate_bias",), ours + ("up_bias",))]
  return out


# ----------------------------------------------------------------------------------------------------------------
# Reading safetensors
# ----------------------------------------------------------------------------------------------------------------

class _Tensors:
  """Lazy access to the tensors of every *.safetensors file of a directory (sharded or not)."""

  def __init__(self, hf_dir: pathlib.Path):
    from safetensors import safe_open  # pylint: disable=import-outside-toplevel
    files = sorted(hf_dir.glob("*.safetensors"))
    if not files:
      pickled = sorted(p.name for p in hf_dir.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
      if pickled:
        raise ConvertError(f"{hf_dir} holds only pickled weights ({pickled[0]}); loading them would execute code. "
                           "Re-save the model with safetensors (save_pretrained(..., safe_serialization=True))")
      raise ConvertError(f"{hf_dir} has no *.safetensors weights")
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
      files = sorted({hf_dir / f for f in json.loads(index.read_text())["weight_map"].values()})
      missing = [f.name for f in files if not f.is_file()]
      if missing:
        raise ConvertError(f"{index} names {missing[0]}, which is missing from {hf_dir}")
    self._handles = [safe_open(str(f), framework="flax") for f in files]
    self._where = {name: h for h in self._handles for name in h.keys()}

  def names(self) -> set[str]:
    return set(self._where)

  def get(self, name: str) -> np.ndarray:
    """The tensor as float32 numpy (MXFP4 `name_blocks` / `name_scales` pairs are dequantized)."""
    if name not in self._where and name + "_blocks" in self._where:
      return _dequantize_mxfp4(np.asarray(self._where[name + "_blocks"].get_tensor(name + "_blocks")),
                               np.asarray(self._where[name + "_scales"].get_tensor(name + "_scales")))
    return np.asarray(self._where[name].get_tensor(name), np.float32)


def _dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """GPT-OSS's MXFP4 experts: blocks uint8 [E, out, G, 16] (two FP4 e2m1 values per byte, low nibble first),
  scales uint8 [E, out, G] (power-of-two exponents biased by 127) -> float32 [E, in = G*32, out]."""
  lo, hi = _FP4_VALUES[blocks & 0x0F], _FP4_VALUES[blocks >> 4]
  vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)   # [E, out, G, 32]
  vals = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127)
  return np.swapaxes(vals.reshape(*vals.shape[:-2], -1), 1, 2)


def _unused(names: set[str], m: ModelConfig, family: str) -> set[str]:
  used = {hf for hf, _, _ in _pairs(m, family)} | {hf for hf, _, _ in (_interleaved(m) if family == "gpt_oss" else [])}
  quantized = {n[:-len(suffix)] for n in names for suffix in ("_blocks", "_scales") if n.endswith(suffix)}
  left = {n for n in names if n not in used and not _IGNORED.search(n)}
  left -= {n + s for n in quantized & used for s in ("_blocks", "_scales")}
  if m.tie_embeddings:
    left.discard("lm_head.weight")        # some tied checkpoints store the (identical) head anyway
  return left


def params_from_hf(hf_dir: str | pathlib.Path, m: ModelConfig, family: str) -> dict[tuple, np.ndarray]:
  """{sinkjax parameter path: float32 array} of a Hugging Face directory's weights."""
  tensors = _Tensors(pathlib.Path(hf_dir))
  names = tensors.names()
  available = names | {n[:-len("_blocks")] for n in names if n.endswith("_blocks")}
  out = {}
  for hf, path, transpose in _pairs(m, family):
    if hf not in available:
      raise ConvertError(f"{hf_dir} lacks the tensor {hf} that a {family} model of this config needs")
    t = tensors.get(hf)
    out[path] = np.ascontiguousarray(t.T) if transpose else t
  if family == "gpt_oss":
    for hf, gate, up in _interleaved(m):
      if hf not in available:
        raise ConvertError(f"{hf_dir} lacks the tensor {hf}")
      t = tensors.get(hf)
      out[gate], out[up] = np.ascontiguousarray(t[..., 0::2]), np.ascontiguousarray(t[..., 1::2])
  extra = _unused(names, m, family)
  if extra:
    raise ConvertError(f"{hf_dir} has tensors this converter does not map (e.g. {sorted(extra)[0]}); "
                       "is config.json the one these weights belong to?")
  return out


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------

def model_with_params(m: ModelConfig, params: dict[tuple, np.ndarray]):
  """A Transformer of config `m` holding `params` (every parameter must be given, with its shape)."""
  abstract = nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0)))
  graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
  pdt = jnp.dtype(m.param_dtype)
  leaves, missing = [], []
  for path, var in nnx.to_flat_state(state):
    if path not in params:
      missing.append(".".join(map(str, path)))
      continue
    value = params[path]
    assert value.shape == var.shape, f"{path}: checkpoint shape {value.shape} != model shape {var.shape}"
    leaves.append((path, var.replace(jnp.asarray(value, pdt))))
  if missing:
    raise ConvertError(f"no weights for the model parameters {', '.join(missing[:3])}")
  return nnx.merge(graphdef, nnx.from_flat_state(leaves), rest)


def load_hf(path: str | pathlib.Path, *, dtype: str = "float32", param_dtype: str = "float32"):
  """A sinkjax `Transformer` with the weights of a Hugging Face model directory (config.json + *.safetensors).

  `model(tokens)` gives the same logits as transformers' `AutoModelForCausalLM` (float32: to ~1e-5). The config is
  `model.cfg` (a ModelConfig; `model_config_from_hf` builds it).
  """
  hf = read_hf_config(path)
  m = model_config_from_hf(hf, dtype=dtype, param_dtype=param_dtype)
  return model_with_params(m, params_from_hf(path, m, hf["model_type"]))


def params_to_hf(model, family: str) -> dict[str, np.ndarray]:
  """{Hugging Face tensor name: float32 array} of a sinkjax model (LoRA adapters must be merged first)."""
  m = model.cfg
  flat = {path: np.asarray(var.get_value(), np.float32) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  out = {}
  for hf, path, transpose in _pairs(m, family):
    if path not in flat:                  # a parameter-free RMSNorm exports as a unit scale
      assert path[-1] == "scale", path
      out[hf] = np.ones((m.head_dim if path[-2] in ("q_norm", "k_norm") else m.d_model,), np.float32)
      continue
    out[hf] = np.ascontiguousarray(flat[path].T) if transpose else flat[path]
  if family == "gpt_oss":
    for hf, gate, up in _interleaved(m):
      g, u = flat[gate], flat[up]
      both = np.empty(g.shape[:-1] + (2 * g.shape[-1],), np.float32)
      both[..., 0::2], both[..., 1::2] = g, u
      out[hf] = both
  return out


# ----------------------------------------------------------------------------------------------------------------
# Run directories (import) and Hugging Face directories (export)
# ----------------------------------------------------------------------------------------------------------------

def convert(hf_dir: str | pathlib.Path, run_dir: str | pathlib.Path, *, dtype: str = "bfloat16",
            param_dtype: str = "float32") -> Config:
  """Imports a Hugging Face directory into a run directory (config.yaml + Orbax checkpoint at step 0) that
  `sinkjax.run.load_run`, evaluation, generation and fine-tuning (train.init_from) read. Either may be a gs:// or
  s3:// URL (a remote Hugging Face directory is downloaded to a temporary directory first)."""
  paths.check_bucket(run_dir, "--out")
  run_dir = paths.as_path(run_dir, "--out")
  if (run_dir / checkpoint.CHECKPOINT_DIR).exists():
    raise ConvertError(f"{run_dir} already holds a checkpoint; give a new --out directory")
  paths.check_bucket(hf_dir, "--hf-dir")
  gguf_file = None if paths.is_remote(hf_dir) else gguf_lib.find_gguf(hf_dir)
  with contextlib.ExitStack() as stack:
    if gguf_file is not None:
      local = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sinkjax-gguf-")))
      gguf_lib.to_hf_dir(gguf_file, local)
    else:
      local = stack.enter_context(paths.local_dir(hf_dir, "--hf-dir"))
    model = load_hf(local, dtype="float32", param_dtype=param_dtype)
    cfg = Config(model=dataclasses.replace(model.cfg, dtype=dtype))
    if (local / "tokenizer.json").is_file():
      cfg.data.tokenizer = str(_write_tokenizer(local, run_dir / TOKENIZER_DIR))
    else:
      print(f"warning: {hf_dir} has no tokenizer.json; data.tokenizer stays 'bytes'", file=sys.stderr)
  cfg.data.seq_len = cfg.model.max_seq_len        # the context the model was trained for
  cfg.run.dir = str(run_dir)
  config_lib.validate(cfg)
  run_lib.save_params_run(run_dir, cfg, model)
  return cfg


TOKENIZER_DIR = "tokenizer"     # RUN_DIR/tokenizer/: an imported model's tokenizer files


def _write_tokenizer(src: pathlib.Path, dst) -> pathlib.Path:
  """Copies tokenizer.json and its side files from a Hugging Face directory to `dst` (local or a bucket); a model
  without generation_config.json gets one with config.json's bos / eos ids (what transformers' generate reads).
  Returns dst/tokenizer.json."""
  dst = paths.as_path(dst)
  dst.mkdir(parents=True, exist_ok=True)
  for name in ("tokenizer.json",) + SIDE_FILES:
    if (src / name).is_file():
      paths.copy_file(src / name, dst / name)
  if not (src / "generation_config.json").is_file():
    hf = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    gen = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf.get(k) is not None}
    if gen:
      (dst / "generation_config.json").write_text(json.dumps(gen, indent=2))
  return dst / "tokenizer.json"


def save_hf(model, out_dir: str | pathlib.Path, *, dtype: str = "float32", tokenizer: str | None = None,
            max_shard_bytes: int = 5 * 2**30):
  """Writes config.json + safetensors (sharded with an index beyond `max_shard_bytes`) that transformers loads,
  into a local directory or a gs:// / s3:// URL (written locally, then uploaded)."""
  paths.check_bucket(out_dir, "--out")
  with paths.staged_dir(out_dir) as local:
    _write_hf(model, local, dtype=dtype, max_shard_bytes=max_shard_bytes)
    if tokenizer and paths.as_path(tokenizer).is_dir():
      tokenizer = paths.as_path(tokenizer) / "tokenizer.json"
    if tokenizer and paths.as_path(tokenizer).is_file():
      src = paths.as_path(tokenizer)
      paths.copy_file(src, local / "tokenizer.json")
      for extra in SIDE_FILES:        # its BOS / EOS / chat template (sinkjax.data.tokenizers), chat_template.jinja too
        if (src.parent / extra).is_file():
          paths.copy_file(src.parent / extra, local / extra)
  return out_dir


def _write_hf(model, out_dir: pathlib.Path, *, dtype: str, max_shard_bytes: int) -> None:
  from safetensors.flax import save_file  # pylint: disable=import-outside-toplevel
  family = family_of(model.cfg)
  tensors = params_to_hf(model, family)
  jdt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[dtype]
  shards, size = [[]], 0
  for name in sorted(tensors):
    nbytes = tensors[name].size * jnp.dtype(jdt).itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append(name)
    size += nbytes
  weight_map = {}
  for k, names in enumerate(shards):
    fname = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file({n: jnp.asarray(tensors[n], jdt) for n in names}, str(out_dir / fname), metadata={"format": "pt"})
    weight_map.update({n: fname for n in names})
  if len(shards) > 1:
    total = sum(t.size for t in tensors.values()) * jnp.dtype(jdt).itemsize
    (out_dir / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": int(total)}, "weight_map": weight_map}, indent=2))
  (out_dir / "config.json").write_text(json.dumps(hf_config(model.cfg, family, dtype), indent=2))


def export(run_dir: str | pathlib.Path, out_dir: str | pathlib.Path, *, dtype: str = "float32",
           step: int | None = None):
  """Exports a run (its LoRA adapters merged into the base weights) as a Hugging Face directory."""
  model, cfg, _, _ = run_lib.load_run(run_dir, step=step)
  model = lora.merge(model)
  tok = cfg.data.tokenizer if cfg.data.tokenizer != "bytes" else None
  return save_hf(model, out_dir, dtype=dtype, tokenizer=tok)


def main(argv=None) -> int:
  parser = cli.Parser(
      prog="python -m sinkjax.convert.hf",
      description="Import a Hugging Face checkpoint (Llama 3, Qwen3, GPT-OSS; safetensors) into a sinkjax run "
                  "directory, or export a run back to a Hugging Face directory.")
  src = parser.add_mutually_exclusive_group(required=True)
  src.add_argument("--hf-dir", "--gguf", dest="hf_dir",
                   help="what to import: a Hugging Face model directory (config.json + *.safetensors), a .gguf file "
                        "or a directory holding one (dequantized; needs the gguf extra)")
  src.add_argument("--export", metavar="RUN_DIR", help="run directory to export (LoRA adapters are merged)")
  parser.add_argument("--out", required=True, help="the run directory (import) or Hugging Face directory (export)")
  parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16", "float16"),
                      help="import: model.dtype of the run (default bfloat16); export: tensor dtype (default float32)")
  parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"),
                      help="import: model.param_dtype (stored weights)")
  parser.add_argument("--step", type=int, default=None, help="export: checkpoint step (default: latest)")
  args = parser.parse_args(argv)

  def action():
    if args.hf_dir:
      cfg = convert(args.hf_dir, args.out, dtype=args.dtype or "bfloat16", param_dtype=args.param_dtype)
      m = cfg.model
      print(f"imported {args.hf_dir} -> {args.out}: {m.num_layers} layers, d_model {m.d_model}, "
            f"{m.num_heads}/{m.num_kv_heads} heads, attention {m.attention}, vocab {m.vocab_size}")
    else:
      print(f"exported {args.export} -> {export(args.export, args.out, dtype=args.dtype or 'float32', step=args.step)}")
  return cli.run_main("sinkjax.convert.hf", action)


if __name__ == "__main__":
  sys.exit(main())
