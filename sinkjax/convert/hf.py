"""Hugging Face checkpoints <-> sinkjax: Llama 3, Qwen2.5, Qwen3, Qwen3-MoE and GPT-OSS, in both directions.

    from sinkjax.convert.hf import load_hf
    model = load_hf("path/to/hf_dir")          # a sinkjax Transformer; model(tokens) -> logits
    model = load_hf("path/to/hf_dir", mesh=MeshConfig(data=1, fsdp=8))     # each parameter sharded as it is read
    python -m sinkjax.convert.hf --hf-dir DIR --out RUN_DIR        # import into a run directory
    python -m sinkjax.convert.hf --hf-dir DIR --out RUN_DIR mesh.data=1 mesh.fsdp=8   # ... through a sharded model
    python -m sinkjax.convert.hf --hf-dir MODEL.gguf --out RUN_DIR # a GGUF file (dequantized; sinkjax.convert.gguf)
    python -m sinkjax.convert.hf --export RUN_DIR --out DIR        # export (LoRA adapters merged) for transformers

The Hugging Face architectures are configurations of the one sinkjax `Transformer` (model.* keys), not copies of it,
each one declarative `Family` spec in `SPECS` (config keys both ways, per-layer tensor names and transforms, the
ModelConfig fields it fixes, which also decide what exports to it):
  llama      vanilla attention, GQA, RoPE (+ llama3 scaling), learnable RMSNorm scales, SwiGLU, no QK-norm
  qwen2      Qwen2.5: the same with q/k/v biases and no o_proj bias (model.attn_out_bias false)
  qwen3      per-head q/k RMSNorm (learnable scale) and an explicit head_dim
  qwen3_moe  Qwen3's attention; every layer a routed SwiGLU MoE (softmax over all experts, top-k, renormalised
             with norm_topk_prob: model.moe_router softmax_topk[_norm]), no shared expert
  gpt_oss    sink attention (learned per-head sinks), alternating sliding-window / full layers, q/k/v/o biases,
             YaRN RoPE, and a top-k routed MoE MLP with GPT-OSS's clamped SwiGLU (experts with biases)
and all of them: no embedding norm, no logit soft-cap. Weights are read from safetensors only (one file, several,
or an index json; MXFP4-quantized GPT-OSS experts are dequantized); pickled `.bin` checkpoints are refused, since
loading them executes code. Linear weights are transposed ([out, in] in torch, [in, out] in Flax).

Weights are read one tensor at a time, converted to model.param_dtype and transformed on the host, and placed at once
(`sinkjax.convert.place`): whole on the default device, or, with a mesh (mesh.* keys), straight into each parameter's
training sharding, so the host holds one tensor (plus its transform) and no device a whole sharded parameter; the
import then writes the Orbax checkpoint from the sharded arrays. `place_hf` / `convert` report what that took.

An import writes the model's tokenizer into the run (RUN_DIR/tokenizer/: tokenizer.json and the files beside it that
say its BOS / EOS / chat template, sinkjax.data.tokenizers.SIDE_FILES; generation_config.json made from config.json's
ids when the model has none) and records the model's context length (max_position_embeddings) as data.seq_len; an
export writes those files back beside the weights.
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":
  errors.require_extra("sinkjax.convert.hf")   # before the imports below, which need the train extra

import contextlib
import dataclasses
import json
import math
import pathlib
import re
import sys
import tempfile
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax import checkpoint, deltanet, distributed, lora, options, paths
from sinkjax import config as config_lib
from sinkjax import run as run_lib
from sinkjax import sharding as sharding_lib
from sinkjax.config import Config, ModelConfig
from sinkjax.convert import ConvertError
from sinkjax.convert import gguf as gguf_lib
from sinkjax.convert.place import HostMeter, LoadInfo, Placer, fresh_bytes, resolve_mesh
from sinkjax.data.tokenizers import SIDE_FILES
from sinkjax.layers import hf_attention_tensors
from sinkjax.model import Transformer

_IGNORED = re.compile(r"rotary_emb\.inv_freq$")          # buffers some older checkpoints carry
_FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                       np.float32)


# ----------------------------------------------------------------------------------------------------------------
# Families: one declarative spec each
# ----------------------------------------------------------------------------------------------------------------

_REQUIRED = object()


@dataclasses.dataclass(frozen=True)
class Key:
  """A config.json key <-> a ModelConfig field: read on import (`default` when absent; a key without one must be
  there; `also`: other names it may have there), written on export. `values` maps its config.json values to the
  field's (an export needs the field to be one of them)."""
  hf: str
  field: str
  default: Any = _REQUIRED
  values: dict | None = None
  also: tuple = ()

  def read(self, hf: dict, family: str):
    value = next((hf[k] for k in (self.hf, *self.also) if hf.get(k) is not None), self.default)
    if value is _REQUIRED or value is None and self.default is _REQUIRED:
      raise ConvertError(f"the config.json of this {family} model lacks {self.hf}")
    if self.values is not None:
      return self.values[value]
    return type(getattr(ModelConfig(), self.field))(value)      # the field's type (JSON gives 7 for 7.0)

  def write(self, m: ModelConfig):
    ours = getattr(m, self.field)
    return ours if self.values is None else {v: k for k, v in self.values.items()}[ours]


@dataclasses.dataclass(frozen=True)
class Tensor:
  """One tensor of every layer (its name after `model.layers.{i}.`) <-> sinkjax parameter(s) (their paths after
  ("layers", i)), by a transform `how` (TRANSFORMS):
    copy        the same array
    transpose   a torch Linear weight [out, in] <-> a Flax kernel [in, out]
    interleave  a fused gate_up [..., 2h], gate at even and up at odd columns (GPT-OSS) <-> `ours` = (gate, up)
    experts     one torch Linear weight per expert, "{e}" in the name (Qwen3-MoE) <-> a stacked kernel [E, in, out]
  `when` names a ModelConfig bool field the tensor exists under (e.g. "mlp_bias")."""
  hf: str
  ours: tuple
  how: str = "copy"
  when: str = ""


def _fused(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
  both = np.empty(gate.shape[:-1] + (2 * gate.shape[-1],), gate.dtype)
  both[..., 0::2], both[..., 1::2] = gate, up
  return both


_T = lambda a: np.ascontiguousarray(np.swapaxes(a, -1, -2))
# Import directions give views where they can (a transpose, the even / odd columns): the placing path copies only the
# slices each device gets, so the host holds the checkpoint tensor once, not twice.
TRANSFORMS = {   # how: (checkpoint arrays -> parameter arrays, parameter arrays -> checkpoint arrays)
    "copy": (lambda ts: ts, lambda ps: ps),
    "transpose": (lambda ts: [np.swapaxes(ts[0], -1, -2)], lambda ps: [_T(ps[0])]),
    "interleave": (lambda ts: [ts[0][..., 0::2], ts[0][..., 1::2]], lambda ps: [_fused(*ps)]),
    "experts": (lambda ts: [np.stack([t.T for t in ts])], lambda ps: [_T(p) for p in ps[0]]),
    "centred": (lambda ts: [ts[0] + 1], lambda ps: [ps[0] - 1]),     # zero-centred RMSNorm: scale = 1 + weight
    "conv": (lambda ts: [np.ascontiguousarray(ts[0][:, 0, :].T)], lambda ps: [np.ascontiguousarray(ps[0].T[:, None])]),
}


def _q_gate(m: ModelConfig) -> tuple:
  """Qwen3-Next's q_proj [H * 2D, d], per head D query rows then D gate rows <-> q_proj and gate_proj kernels
  [d, H * D] (gated attention's elementwise G1 gate)."""
  H, D = m.num_heads, m.head_dim

  def split(ts):
    w = ts[0].reshape(H, 2, D, -1)
    return [np.swapaxes(w[:, 0].reshape(H * D, -1), 0, 1), np.swapaxes(w[:, 1].reshape(H * D, -1), 0, 1)]

  def join(ps):
    q, g = (p.T.reshape(H, D, -1) for p in ps)
    return [np.ascontiguousarray(np.stack([q, g], axis=1).reshape(H * 2 * D, -1))]

  return split, join


CONFIG_TRANSFORMS = {"q_gate": _q_gate}       # transforms that depend on the model's shapes: how -> f(m) -> pair


def _transform(how: str, m: ModelConfig) -> tuple:
  """(import, export) functions of transform `how` for a model of config `m`."""
  return CONFIG_TRANSFORMS[how](m) if how in CONFIG_TRANSFORMS else TRANSFORMS[how]


@dataclasses.dataclass(frozen=True)
class Family:
  """A Hugging Face architecture as a configuration of the one sinkjax `Transformer`, both directions.

  fixed: ModelConfig fields the architecture sets on import and a model needs to export as it.
  keys: config.json keys that vary within the architecture (`Key`), beyond the ones every family shares (sizes,
    heads, RoPE, norm eps, tied embeddings, context length: `_shared_config`).
  supports: (config.json key, the one value supported, why): another value is refused on import, and the value
    is written on export.
  extra: config.json keys written on export only.
  mlp: the MLP / MoE tensors of a layer (attention's names come from `layers.hf_attention_tensors`, the norms'
    are shared).
  attention: the attention tensors of a layer, where they are not `layers.hf_attention_tensors`' (Qwen3-Next's
    q_proj holds the gate too).
  norms: the transform of every RMSNorm scale ("centred": Qwen3-Next's zero-centred norms, scale = 1 + weight).
  moe: routed experts (model.moe_experts > 0). sliding: sliding / full layers from layer_types + sliding_window.
  linear: linear-attention (Gated DeltaNet) / full layers from layer_types (`linear_attention`), their tensors
    under `linear_attn.` (`sinkjax.deltanet.HF_TENSOR_NAMES`).
  partial_rope: the config's partial_rotary_factor is read (model.rope_partial); other families refuse it.
  """
  model_type: str
  architecture: str
  fixed: dict
  keys: tuple = ()
  supports: tuple = ()
  extra: dict = dataclasses.field(default_factory=dict)
  mlp: tuple = ()
  moe: bool = False
  sliding: bool = False
  attention: tuple | None = None
  norms: str = "copy"
  linear: bool = False
  partial_rope: bool = False


_PROJ = ("gate_proj", "up_proj", "down_proj")
DENSE_MLP = tuple(Tensor(f"mlp.{p}.weight", ("mlp", p, "kernel"), "transpose") for p in _PROJ) + \
    tuple(Tensor(f"mlp.{p}.bias", ("mlp", p, "bias"), when="mlp_bias") for p in _PROJ)
_SILU = ("hidden_act", "silu", "the MLP is SwiGLU here")
_NO_SLIDING = ("use_sliding_window", False, "Qwen's sliding-window layers (max_window_layers) are not mapped; the "
               "released models set it false")
_ATTN_BIAS = Key("attention_bias", "attn_bias", False)
_ALL_MOE = "every layer must be an MoE layer here; dense layers between are not mapped"

LLAMA = Family(
    "llama", "LlamaForCausalLM", fixed=dict(attention="vanilla", qk_norm=False, mlp="swiglu", attn_out_bias=True),
    keys=(_ATTN_BIAS, Key("mlp_bias", "mlp_bias", False)), supports=(_SILU,), mlp=DENSE_MLP)
QWEN2 = Family(
    "qwen2", "Qwen2ForCausalLM", fixed=dict(attention="vanilla", qk_norm=False, mlp="swiglu", attn_bias=True,
                                            attn_out_bias=False, mlp_bias=False),
    supports=(_SILU, _NO_SLIDING), extra={"sliding_window": None}, mlp=DENSE_MLP)
QWEN3 = Family(
    "qwen3", "Qwen3ForCausalLM", fixed=dict(attention="vanilla", qk_norm=True, mlp="swiglu", attn_out_bias=True,
                                            mlp_bias=False),
    keys=(_ATTN_BIAS,), supports=(_SILU, _NO_SLIDING), extra={"sliding_window": None}, mlp=DENSE_MLP)
QWEN3_MOE = Family(
    "qwen3_moe", "Qwen3MoeForCausalLM", fixed=dict(attention="vanilla", qk_norm=True, mlp="swiglu",
                                                   attn_out_bias=True, mlp_bias=False),
    keys=(_ATTN_BIAS, Key("num_experts", "moe_experts", also=("num_local_experts",)),   # transformers 5 saves the latter
          Key("num_experts_per_tok", "moe_top_k"), Key("moe_intermediate_size", "mlp_hidden"),
          Key("norm_topk_prob", "moe_router", False, {False: "softmax_topk", True: "softmax_topk_norm"})),
    supports=(_SILU, _NO_SLIDING, ("decoder_sparse_step", 1, _ALL_MOE), ("mlp_only_layers", [], _ALL_MOE)),
    extra={"sliding_window": None, "output_router_logits": False},
    mlp=(Tensor("mlp.gate.weight", ("mlp", "router", "kernel"), "transpose"),
         Tensor("mlp.experts.{e}.gate_proj.weight", ("mlp", "gate_kernel"), "experts"),
         Tensor("mlp.experts.{e}.up_proj.weight", ("mlp", "up_kernel"), "experts"),
         Tensor("mlp.experts.{e}.down_proj.weight", ("mlp", "down_kernel"), "experts")),
    moe=True)
GPT_OSS = Family(
    "gpt_oss", "GptOssForCausalLM", fixed=dict(attention="sink", qk_norm=False, mlp="clamped_swiglu", mlp_bias=True,
                                               moe_router="topk_softmax", attn_out_bias=True),
    keys=(_ATTN_BIAS, Key("num_local_experts", "moe_experts"), Key("num_experts_per_tok", "moe_top_k"),
          Key("swiglu_limit", "swiglu_limit", 7.0), Key("swiglu_alpha", "swiglu_alpha", 1.702)),
    extra={"router_aux_loss_coef": 0.0, "output_router_logits": False},
    mlp=(Tensor("mlp.router.weight", ("mlp", "router", "kernel"), "transpose"),
         Tensor("mlp.router.bias", ("mlp", "router", "bias")),
         Tensor("mlp.experts.gate_up_proj", (("mlp", "gate_kernel"), ("mlp", "up_kernel")), "interleave"),
         Tensor("mlp.experts.gate_up_proj_bias", (("mlp", "gate_bias"), ("mlp", "up_bias")), "interleave"),
         Tensor("mlp.experts.down_proj", ("mlp", "down_kernel")),
         Tensor("mlp.experts.down_proj_bias", ("mlp", "down_bias"))),
    moe=True, sliding=True)

_SHARED_EXPERT = tuple(Tensor(f"mlp.shared_expert.{p}.weight", ("mlp", "shared_expert", p, "kernel"), "transpose",
                              when="moe_shared_hidden") for p in _PROJ) + \
    (Tensor("mlp.shared_expert_gate.weight", ("mlp", "shared_expert_gate", "kernel"), "transpose",
            when="moe_shared_hidden"),)
QWEN3_NEXT = Family(
    "qwen3_next", "Qwen3NextForCausalLM",
    fixed=dict(attention="gated", gate="elementwise", gate_bias=False, qk_norm=True, mlp="swiglu", mlp_bias=False,
               attn_bias=False, attn_out_bias=True),
    keys=QWEN3_MOE.keys[1:] + (
        Key("shared_expert_intermediate_size", "moe_shared_hidden", 0),
        Key("linear_num_key_heads", "linear_key_heads"), Key("linear_num_value_heads", "linear_value_heads"),
        Key("linear_key_head_dim", "linear_key_head_dim"), Key("linear_value_head_dim", "linear_value_head_dim"),
        Key("linear_conv_kernel_dim", "linear_conv_kernel", 4)),
    supports=(_SILU, ("attention_bias", False, "its gate is half of q_proj, which then has no bias"),
              ("decoder_sparse_step", 1, _ALL_MOE), ("mlp_only_layers", [], _ALL_MOE)),
    extra={"output_router_logits": False, "router_aux_loss_coef": 0.0},
    attention=(Tensor("self_attn.q_proj.weight", (("attn", "q_proj", "kernel"), ("attn", "gate_proj", "kernel")),
                      "q_gate"),
               *(Tensor(f"self_attn.{p}.weight", ("attn", p, "kernel"), "transpose")
                 for p in ("k_proj", "v_proj", "o_proj")),
               *(Tensor(f"self_attn.{n}.weight", ("attn", n, "scale"), "centred") for n in ("q_norm", "k_norm"))),
    mlp=QWEN3_MOE.mlp + _SHARED_EXPERT, moe=True, norms="centred", linear=True, partial_rope=True)

SPECS = {f.model_type: f for f in (LLAMA, QWEN2, QWEN3, QWEN3_MOE, GPT_OSS, QWEN3_NEXT)}     # the registry, by model_type
FAMILIES = tuple(SPECS)
ARCHITECTURES = {name: f.architecture for name, f in SPECS.items()}


def _spec(family: str) -> Family:
  if family not in SPECS:
    raise ConvertError(f"model_type {family!r} is not supported; supported: {', '.join(SPECS)}")
  return SPECS[family]


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
  rope["partial_rotary_factor"] = float(rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
  return rope


def _shared_config(hf: dict, dtype: str, param_dtype: str) -> ModelConfig:
  """The ModelConfig fields every family reads alike: sizes, heads, RoPE (default | llama3 | yarn), norms, context,
  tied embeddings; no embedding norm, no logit soft-cap, learnable norm scales, a SwiGLU MLP."""
  heads = hf["num_attention_heads"]
  rope = _rope(hf)
  max_len = int(hf.get("max_position_embeddings") or 2048)
  m = ModelConfig(
      num_layers=hf["num_hidden_layers"], d_model=hf["hidden_size"], num_heads=heads,
      num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, vocab_size=hf["vocab_size"],
      mlp="swiglu", mlp_hidden=hf["intermediate_size"], qk_norm=False, logit_softcap=0.0,
      rope_theta=float(rope["rope_theta"]), max_seq_len=max_len, tie_embeddings=bool(hf.get("tie_word_embeddings")),
      norm_scale=True, norm_eps=float(hf.get("rms_norm_eps", 1e-6)), embed_norm=False,
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
  return m


def model_config_from_hf(hf: dict, *, dtype: str = "float32", param_dtype: str = "float32") -> ModelConfig:
  """The sinkjax ModelConfig of a Hugging Face config.json (a family of SPECS: Llama 3, Qwen2.5, Qwen3, Qwen3-MoE,
  GPT-OSS)."""
  family = hf.get("model_type")
  spec = _spec(family)
  for key, value, why in spec.supports:
    if hf.get(key) not in (None, value):
      raise ConvertError(f"{family} with {key}={json.dumps(hf[key])} is not supported ({why})")
  m = _shared_config(hf, dtype, param_dtype)
  for name, value in spec.fixed.items():
    setattr(m, name, value)
  for key in spec.keys:
    setattr(m, key.field, key.read(hf, family))
  partial = _rope(hf)["partial_rotary_factor"]
  if partial != 1.0 and not spec.partial_rope:
    raise ConvertError(f"{family} with partial_rotary_factor={partial} is not supported (only qwen3_next rotates part "
                       "of each head)")
  m.rope_partial = partial
  if spec.linear:
    every = int(hf.get("full_attention_interval") or 4)
    types = hf.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                      for i in range(m.num_layers)]
    kinds = {"linear_attention": "linear", "full_attention": "full"}
    if any(t not in kinds for t in types):
      raise ConvertError(f"{family} layer_types must be linear_attention | full_attention, got "
                         f"{next(t for t in types if t not in kinds)!r}")
    m.layer_types = [kinds[t] for t in types]
  if spec.sliding:
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(m.num_layers)]
    m.layer_types = ["sliding" if t == "sliding_attention" else "full" for t in types]
    m.sliding_window = int(hf.get("sliding_window") or 0)
    if not m.sliding_window:
      m.layer_types = ["full"] * m.num_layers
  try:
    config_lib.validate(Config(model=m))
  except config_lib.ConfigError as e:
    raise ConvertError(f"the checkpoint's config maps to an invalid sinkjax config: {e}") from None
  return m


def _field(value) -> str:
  return json.dumps(value) if isinstance(value, (bool, str)) else str(value)


def _mismatches(spec: Family, m: ModelConfig) -> list[str]:
  """What `m` would need to change to export as `spec` (empty: it exports as it)."""
  # No attention biases: o_proj has none whatever model.attn_out_bias says.
  m = dataclasses.replace(m, attn_out_bias=m.attn_out_bias or not m.attn_bias)
  out = [f"model.{k}={_field(v)}" for k, v in spec.fixed.items() if getattr(m, k) != v]
  if bool(m.moe_experts) != spec.moe:
    out.append("model.moe_experts > 0" if spec.moe else "model.moe_experts=0")
  if m.sliding_window and not spec.sliding:
    out.append("model.sliding_window=0")
  if "linear" in m.layer_types and not spec.linear:
    out.append("no linear layers in model.layer_types")
  if m.rope_partial != 1.0 and not spec.partial_rope:
    out.append("model.rope_partial=1")
  if m.moe_shared_hidden and spec.moe and not any(t.when == "moe_shared_hidden" for t in spec.mlp):
    out.append("model.moe_shared_hidden=0")
  for key in spec.keys:
    if key.values is not None and getattr(m, key.field) not in key.values.values():
      out.append(f"model.{key.field} in {'|'.join(key.values.values())}")
  return out


def family_of(m: ModelConfig) -> str:
  """The Hugging Face architecture (a family of SPECS) a sinkjax model config can be exported as (ConvertError if
  none)."""
  problems = []
  if m.embed_norm:
    problems.append("model.embed_norm must be false")
  if m.logit_softcap:
    problems.append("model.logit_softcap must be 0")
  if m.sink_tokens:
    problems.append("model.sink_tokens must be 0")
  misses = {name: _mismatches(spec, m) for name, spec in SPECS.items()}
  family = next((name for name, miss in misses.items() if not miss), None)
  if family is None:
    fewest = min(len(miss) for miss in misses.values())
    nearest = [f"{name} needs {', '.join(miss)}" for name, miss in misses.items() if len(miss) == fewest]
    problems.append(f"no family ({', '.join(SPECS)}) has this architecture; the nearest: {'; '.join(nearest)}")
  if problems:
    raise ConvertError("this model cannot be exported to Hugging Face: " + "; ".join(problems))
  return family


def hf_config(m: ModelConfig, family: str, dtype: str = "float32") -> dict:
  """config.json for transformers (both the >= 5 `rope_parameters` and the older rope_theta/rope_scaling keys)."""
  spec = _spec(family)
  m = dataclasses.replace(m, mlp_hidden=m.mlp_width)
  rope = {"rope_type": "default", "rope_theta": m.rope_theta}
  if m.rope_partial != 1.0:
    rope["partial_rotary_factor"] = m.rope_partial
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
      "architectures": [spec.architecture], "model_type": family, "vocab_size": m.vocab_size,
      "hidden_size": m.d_model, "intermediate_size": m.mlp_width,
      "num_hidden_layers": m.num_layers, "num_attention_heads": m.num_heads,
      "num_key_value_heads": m.num_kv_heads, "head_dim": m.head_dim, "hidden_act": "silu",
      "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
      "tie_word_embeddings": m.tie_embeddings, "attention_dropout": 0.0,
      "rope_theta": m.rope_theta, "rope_scaling": scaling, "rope_parameters": rope, "torch_dtype": dtype,
      "dtype": dtype, "use_cache": True,
  }
  out.update({key.hf: key.write(m) for key in spec.keys})
  out.update({key: value for key, value, _ in spec.supports})
  out.update(spec.extra)
  if spec.linear:
    out["layer_types"] = [f"{t}_attention" for t in (m.layer_types or ["full"] * m.num_layers)]
  if spec.sliding:
    types = m.layer_types or (["sliding"] * m.num_layers if m.sliding_window else ["full"] * m.num_layers)
    out.update(sliding_window=m.sliding_window or None, layer_types=[f"{t}_attention" for t in types])
  return out


# ----------------------------------------------------------------------------------------------------------------
# Tensors: (Hugging Face names, sinkjax parameter paths, transform) of every mapped tensor
# ----------------------------------------------------------------------------------------------------------------

def _tensors(m: ModelConfig, family: str) -> list[tuple[tuple[str, ...], tuple[tuple, ...], str]]:
  spec = _spec(family)
  out = [(("model.embed_tokens.weight",), (("embed", "embedding"),), "copy"),
         (("model.norm.weight",), (("final_norm", "scale"),), spec.norms)]
  if not m.tie_embeddings:
    out.append((("lm_head.weight",), (("lm_head", "kernel"),), "transpose"))
  attn = list(spec.attention) if spec.attention is not None else \
      [Tensor("self_attn." + name, ("attn", *path), "transpose" if t else "copy")       # the same in every layer
       for name, (path, t) in hf_attention_tensors(m.attention_config()).items()]
  linear = [Tensor("linear_attn." + name, ("attn", *path.split(".")), {"T": "transpose", None: "copy"}.get(how, how))
            for path, (name, how) in deltanet.HF_TENSOR_NAMES.items()]
  shared = [Tensor("input_layernorm.weight", ("attn_norm", "scale"), spec.norms),
            Tensor("post_attention_layernorm.weight", ("mlp_norm", "scale"), spec.norms)]
  shared += [t for t in spec.mlp if not t.when or getattr(m, t.when)]
  for i in range(m.num_layers):
    layer = (linear if m.layer_types and m.layer_types[i] == "linear" else attn) + shared
    for t in layer:
      names = tuple(f"model.layers.{i}." + t.hf.format(e=e) for e in range(m.moe_experts)) if t.how == "experts" \
          else (f"model.layers.{i}.{t.hf}",)
      paths = t.ours if isinstance(t.ours[0], tuple) else (t.ours,)        # a tensor split in two (interleave, q_gate)
      out.append((names, tuple(("layers", i, *p) for p in paths), t.how))
  return out


# ----------------------------------------------------------------------------------------------------------------
# Reading safetensors
# ----------------------------------------------------------------------------------------------------------------

def _host_device():
  """A CPU device of this process: where safetensors' flax reader puts a tensor on its way to numpy (None, the
  default device, where JAX runs without its CPU backend)."""
  try:
    return jax.local_devices(backend="cpu")[0]
  except RuntimeError:
    return None


class _Tensors:
  """Lazy access to the tensors of every *.safetensors file of a directory (sharded or not), read one at a time."""

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
    # framework="flax" reads every dtype (numpy has no bfloat16); the tensor lands on a CPU device, never a chip
    self._handles = [safe_open(str(f), framework="flax") for f in files]
    self._where = {name: h for h in self._handles for name in h.keys()}
    self._host = _host_device()

  def names(self) -> set[str]:
    return set(self._where)

  def get(self, name: str, dtype=np.float32, meter: HostMeter | None = None) -> np.ndarray:
    """The tensor as a host numpy array of `dtype` (MXFP4 `name_blocks` / `name_scales` pairs are dequantized),
    read alone from its file; `meter` is told what this holds (and held for a moment on the way)."""
    with jax.default_device(self._host):
      if name not in self._where and name + "_blocks" in self._where:
        raw = [np.asarray(self._where[name + s].get_tensor(name + s)) for s in ("_blocks", "_scales")]
        value = _dequantize_mxfp4(*raw)
      else:
        raw = [np.asarray(self._where[name].get_tensor(name))]
        value = raw[0]
    out = value.astype(dtype, copy=False)
    if meter is not None:
      meter.hold(out.nbytes, name, transient=fresh_bytes([value], [out]) + fresh_bytes(raw, [value, out]))
    return out


def _dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
  """GPT-OSS's MXFP4 experts: blocks uint8 [E, out, G, 16] (two FP4 e2m1 values per byte, low nibble first),
  scales uint8 [E, out, G] (power-of-two exponents biased by 127) -> float32 [E, in = G*32, out]."""
  lo, hi = _FP4_VALUES[blocks & 0x0F], _FP4_VALUES[blocks >> 4]
  vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], blocks.shape[-1] * 2)   # [E, out, G, 32]
  vals = np.ldexp(vals, scales.astype(np.int32)[..., None] - 127)
  return np.swapaxes(vals.reshape(*vals.shape[:-2], -1), 1, 2)


def _unused(names: set[str], used: set[str], m: ModelConfig) -> set[str]:
  quantized = {n[:-len(suffix)] for n in names for suffix in ("_blocks", "_scales") if n.endswith(suffix)}
  left = {n for n in names if n not in used and not _IGNORED.search(n)}
  left -= {n + s for n in quantized & used for s in ("_blocks", "_scales")}
  if m.tie_embeddings:
    left.discard("lm_head.weight")        # some tied checkpoints store the (identical) head anyway
  return left


def _check_names(tensors: _Tensors, hf_dir, m: ModelConfig, family: str) -> None:
  """ConvertError, before anything is read, when the directory lacks a tensor the model needs or holds one it does
  not map."""
  names = tensors.names()
  available = names | {n[:-len("_blocks")] for n in names if n.endswith("_blocks")}
  used = set()
  for hf_names, _, _ in _tensors(m, family):
    missing = [n for n in hf_names if n not in available]
    if missing:
      raise ConvertError(f"{hf_dir} lacks the tensor {missing[0]} that a {family} model of this config needs")
    used.update(hf_names)
  extra = _unused(names, used, m)
  if extra:
    raise ConvertError(f"{hf_dir} has tensors this converter does not map (e.g. {sorted(extra)[0]}); "
                       "is config.json the one these weights belong to?")


def _read_params(tensors: _Tensors, m: ModelConfig, family: str, dtype, put, meter: HostMeter) -> None:
  """`put(path, array)` for every parameter, read group by group (the checkpoint tensor(s) of one parameter, or of
  the two a fused tensor splits into), each converted to `dtype` and transformed (TRANSFORMS) on the host; the arrays
  of a group are dropped before the next is read, so the host holds one group at a time (`meter` counts it)."""
  for hf_names, paths, how in _tensors(m, family):
    ins = [tensors.get(n, dtype, meter) for n in hf_names]
    outs = _transform(how, m)[0](ins)
    meter.hold(fresh_bytes(outs, ins), hf_names[0] if len(hf_names) == 1 else f"{hf_names[0]} .. {hf_names[-1]}")
    for path, value in zip(paths, outs):
      put(path, value)
    del ins, outs, value
    meter.release()


def params_from_hf(hf_dir: str | pathlib.Path, m: ModelConfig, family: str) -> dict[tuple, np.ndarray]:
  """{sinkjax parameter path: float32 array} of a Hugging Face directory's weights, all of them in host memory at
  once (`place_hf` places them one at a time instead)."""
  tensors = _Tensors(pathlib.Path(hf_dir))
  _check_names(tensors, hf_dir, m, family)
  out = {}
  _read_params(tensors, m, family, np.float32, out.__setitem__, HostMeter())
  return out


def params_to_hf(model, family: str) -> dict[str, np.ndarray]:
  """{Hugging Face tensor name: float32 array} of a sinkjax model (LoRA adapters must be merged first)."""
  m = model.cfg
  flat = {path: np.asarray(var.get_value(), np.float32) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}

  def param(path):
    if path in flat:
      return flat[path]
    assert path[-1] == "scale", path          # a parameter-free RMSNorm exports as a unit scale
    return np.ones((m.head_dim if path[-2] in ("q_norm", "k_norm") else m.d_model,), np.float32)

  out = {}
  for hf_names, paths, how in _tensors(m, family):
    out.update(zip(hf_names, _transform(how, m)[1]([param(p) for p in paths])))
  return out


# ----------------------------------------------------------------------------------------------------------------
# Models: every parameter placed as it is read (sinkjax.convert.place)
# ----------------------------------------------------------------------------------------------------------------

class Placed(NamedTuple):
  """What `place_hf` gives back: the model and what placing it took (`place.LoadInfo`: mesh, parameter bytes per
  device, the host's high-water mark)."""
  model: Any
  info: LoadInfo


def model_with_params(m: ModelConfig, params: dict[tuple, np.ndarray], *, mesh=None):
  """A Transformer of config `m` holding `params` (every parameter must be given, with its shape), placed on `mesh`
  as `place_hf` places them (default: whole on the default device)."""
  placer = Placer(m, resolve_mesh(mesh))
  for path in placer.abstract:
    if path in params:
      placer.put(path, params[path])
  return placer.model()[0]


def _place_dir(hf_dir, m: ModelConfig, family: str, mesh) -> Placed:
  tensors = _Tensors(pathlib.Path(hf_dir))
  _check_names(tensors, hf_dir, m, family)
  placer = Placer(m, resolve_mesh(mesh))
  _read_params(tensors, m, family, placer.dtype, placer.put, placer.host)
  return Placed(*placer.model())


def place_hf(path: str | pathlib.Path, *, mesh=None, dtype: str = "float32", param_dtype: str = "float32") -> Placed:
  """`load_hf`'s model with what placing it took (`Placed(model, info)`)."""
  hf = read_hf_config(path)
  m = model_config_from_hf(hf, dtype=dtype, param_dtype=param_dtype)
  return _place_dir(path, m, hf["model_type"], mesh)


def load_hf(path: str | pathlib.Path, *, dtype: str = "float32", param_dtype: str = "float32", mesh=None):
  """A sinkjax `Transformer` with the weights of a Hugging Face model directory (config.json + *.safetensors).

  `model(tokens)` gives the same logits as transformers' `AutoModelForCausalLM` (float32: to ~1e-5). The config is
  `model.cfg` (a ModelConfig; `model_config_from_hf` builds it). Placement (`mesh`): None, whole on the default
  device; a `jax.sharding.Mesh` of the ("data", "fsdp", "tensor") axes or a MeshConfig (the mesh.* keys), each
  parameter read alone and put straight into its training sharding there (`sinkjax.convert.place`): the host holds
  one checkpoint tensor at a time, no device a whole sharded parameter. `place_hf` also says what that took.
  """
  return place_hf(path, mesh=mesh, dtype=dtype, param_dtype=param_dtype).model


# ----------------------------------------------------------------------------------------------------------------
# Run directories (import) and Hugging Face directories (export)
# ----------------------------------------------------------------------------------------------------------------

class Converted(NamedTuple):
  """What `convert` gives back: the run's config and what placing the model took (`place.LoadInfo`)."""
  cfg: Config
  info: LoadInfo


def convert(hf_dir: str | pathlib.Path, run_dir: str | pathlib.Path, *, dtype: str = "bfloat16",
            param_dtype: str = "float32", overrides=(), mesh=None) -> Converted:
  """Imports a Hugging Face directory into a run directory (config.yaml + Orbax checkpoint at step 0) that
  `sinkjax.run.load_run`, evaluation, generation and fine-tuning (train.init_from) read. Either may be a gs:// or
  s3:// URL (a remote Hugging Face directory is downloaded to a temporary directory first).

  Placement: `overrides` naming mesh.* keys (`mesh.fsdp=8`, as on the command line; recorded in the run's
  config.yaml) or a `jax.sharding.Mesh` as `mesh` put each parameter, as it is read, straight into its training
  sharding on that mesh, and Orbax writes the checkpoint from the sharded arrays (each process its own devices'
  shards); without either, the model is placed whole on the default device."""
  paths.check_bucket(run_dir, "--out")
  run_dir = paths.as_path(run_dir, "--out")
  if (run_dir / checkpoint.CHECKPOINT_DIR).exists():
    raise ConvertError(f"{run_dir} already holds a checkpoint; give a new --out directory")
  bad = [o for o in overrides if not str(o).strip().startswith("mesh.")]
  if bad:
    raise ConvertError(f"an import takes mesh.* overrides only, got {bad[0]!r} (the model's keys come from its "
                       "config.json; --dtype and --param-dtype set its dtypes)")
  distributed.barrier("sinkjax.convert.hf: --out checked")      # before any process writes there
  paths.check_bucket(hf_dir, "--hf-dir")
  gguf_file = None if paths.is_remote(hf_dir) else gguf_lib.find_gguf(hf_dir)
  with contextlib.ExitStack() as stack:
    if gguf_file is not None:
      local = pathlib.Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="sinkjax-gguf-")))
      streamed = gguf_lib.to_hf_dir(gguf_file, local)
      if jax.process_index() == 0:        # the GGUF step's own host mark, before the placer's (the summary line)
        print(f"{gguf_file.name}: {gguf_lib.summary(streamed)}")
    else:
      local = stack.enter_context(paths.local_dir(hf_dir, "--hf-dir"))
    hf = read_hf_config(local)
    m = model_config_from_hf(hf, dtype="float32", param_dtype=param_dtype)
    cfg = Config(model=dataclasses.replace(m, dtype=dtype))
    cfg.data.seq_len = m.max_seq_len                # the context the model was trained for
    cfg.run.dir = str(run_dir)
    config_lib.apply_overrides(cfg, list(overrides))
    if mesh is None and (run_lib.asks_for_mesh(overrides) or jax.process_count() > 1):
      mesh = sharding_lib.make_mesh(cfg.mesh)     # several processes write one checkpoint: a global mesh
    model, info = _place_dir(local, m, hf["model_type"], mesh)
    if (local / "tokenizer.json").is_file():
      cfg.data.tokenizer = str(run_dir / TOKENIZER_DIR / "tokenizer.json")
      if jax.process_index() == 0:
        _write_tokenizer(local, run_dir / TOKENIZER_DIR)
    else:
      print(f"warning: {hf_dir} has no tokenizer.json; data.tokenizer stays 'bytes'", file=sys.stderr)
  config_lib.validate(cfg)
  run_lib.save_params_run(run_dir, cfg, model)
  return Converted(cfg, info)


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


@dataclasses.dataclass
class HFConvertOptions:
  """The convert.* options (`python -m sinkjax.convert.hf`; each flag the alias of its key): --hf-dir imports,
  --export exports; other section.key=value words are the mesh.* keys an import places the model on."""
  hf_dir: str = config_lib.declare(
      "", alias="--hf-dir", other_aliases=("--gguf",), metavar="HF_DIR",
      help="what to import: a Hugging Face model directory (config.json + *.safetensors), a .gguf file or a directory "
           "holding one (dequantized; needs the gguf extra)")
  export: str = config_lib.declare("", alias="--export", metavar="RUN_DIR",
                               help="run directory to export (LoRA adapters are merged)")
  out: str = config_lib.declare("", alias="--out", metavar="OUT", required=True,
                            help="the run directory (import) or Hugging Face directory (export)")
  dtype: str | None = config_lib.declare(
      None, choices=("float32", "bfloat16", "float16"), alias="--dtype",
      help="import: model.dtype of the run (default bfloat16); export: tensor dtype (default float32)")
  param_dtype: str = config_lib.declare("float32", choices=("float32", "bfloat16"), alias="--param-dtype",
                                    help="import: model.param_dtype (stored weights)")
  step: int | None = config_lib.declare(None, ">=0", alias="--step", help="export: checkpoint step (default: latest)")


COMMAND = options.Command(
    prog="python -m sinkjax.convert.hf", sections={"convert": HFConvertOptions}, run_overrides=True,
    description="Import a Hugging Face checkpoint (Llama 3, Qwen2.5, Qwen3, Qwen3-MoE, GPT-OSS; safetensors) into a "
                "sinkjax run directory, or export a run back to a Hugging Face directory. Import: section.key=value "
                "words are the mesh to place the model on as it is read (e.g. mesh.data=1 mesh.fsdp=8; FSDP / tensor "
                "as in training); default: whole on one device.")


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, overrides: run(sections["convert"], overrides))


def run(opts: HFConvertOptions, overrides: list[str] | tuple = ()) -> None:
  """Imports opts.hf_dir (placed on the mesh of the mesh.* `overrides`) or exports opts.export into opts.out."""
  if bool(opts.hf_dir) == bool(opts.export):
    raise ConvertError("give one of --hf-dir DIR (import) or --export RUN_DIR (export)")
  if opts.hf_dir:
    distributed.maybe_initialize()    # before anything touches JAX devices (a job of several processes)
    cfg, info = convert(opts.hf_dir, opts.out, dtype=opts.dtype or "bfloat16", param_dtype=opts.param_dtype,
                        overrides=overrides)
    m = cfg.model
    if jax.process_index() == 0:
      print(f"imported {opts.hf_dir} -> {opts.out}: {m.num_layers} layers, d_model {m.d_model}, "
            f"{m.num_heads}/{m.num_kv_heads} heads, attention {m.attention}, vocab {m.vocab_size}; {info.summary()}")
  elif overrides:
    raise ConvertError(f"--export takes no overrides, got {overrides[0]!r}")
  else:
    print(f"exported {opts.export} -> {export(opts.export, opts.out, dtype=opts.dtype or 'float32', step=opts.step)}")


if __name__ == "__main__":
  sys.exit(main())
