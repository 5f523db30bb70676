"""Typed configuration: small YAML files that inherit from a base, overridable as `dotted.key=value`.

Every key is declared here with its type and default, so an unknown key or a value of the wrong type is an error
that names the key. A YAML file may start with `base: other.yaml` (relative to itself) to inherit.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import os
import pathlib
import re
import typing
from typing import Any

import yaml

from sinkjax import choices, kinds, paths   # kinds: the registry alone (no kind, no jax; sinkjax/kinds/__init__.py)
from sinkjax.errors import ConfigError  # noqa: F401  (re-exported: sinkjax.config.ConfigError)


# pylint: disable-next=redefined-builtin
def declare(default, range: str | None = None, *, choices=None, alias: str | None = None, help: str | None = None,
        metavar: str | None = None, required: bool = False, nargs: str | None = None, const: str | None = None,
        other_aliases: tuple = (), formerly: str | None = None):
  """A config key's one declaration: its default (the annotation gives its type), the range a number must lie in
  (a name of `_RANGE_TESTS`: ">=1", "(0,1)", ...) and the values a string may take (`sinkjax.choices`). A command's
  option (`sinkjax.options`) also names the short flag people type (`alias="--tau"`; `other_aliases`: more spellings
  of the same flag, `--gguf` for `--hf-dir`), its help text (None: a
  hidden option), the flag's metavar, whether the command needs it (`required`), and for the flag alone: "+" (a
  list flag taking several values at once) or the value of the flag given without one (`const`). `formerly`: the
  key's old name in its section, which is then refused in one line naming this one (`renamed`)."""
  meta = {}
  if range is not None:
    meta["range"] = range
  if choices is not None:
    meta["choices"] = choices
  meta.update({k: v for k, v in dict(alias=alias, help=help, metavar=metavar, nargs=nargs, const=const,
                                      formerly=formerly).items()
               if v is not None})
  if required:
    meta["required"] = True
  if other_aliases:
    meta["other_aliases"] = tuple(other_aliases)
  if isinstance(default, list):           # a fresh list per instance
    return dataclasses.field(default_factory=lambda: list(default), metadata=meta)
  return dataclasses.field(default=default, metadata=meta)


def renamed(section_cls, name: str) -> str | None:
  """The key of the section (a dataclass declared with `declare`) that was once spelled `name` (`declare(formerly=name)`)."""
  return next((f.name for f in dataclasses.fields(section_cls) if f.metadata.get("formerly") == name), None)


def _declared(config_cls) -> tuple[dict, dict]:
  """(CHOICES, RANGES): {"section.key": allowed} of every field of every section declared with `declare`."""
  choices_, ranges = {}, {}
  for section in dataclasses.fields(config_cls):
    for f in dataclasses.fields(section.default_factory):
      if "choices" in f.metadata:
        choices_[f"{section.name}.{f.name}"] = f.metadata["choices"]
      if "range" in f.metadata:
        ranges[f"{section.name}.{f.name}"] = f.metadata["range"]
  return choices_, ranges




@dataclasses.dataclass(kw_only=True)
class AttentionSection:
  """The attention keys: the model.* keys an attention layer reads besides the model's shapes, dtypes, attn_bias,
  attn_impl and rope_* (`AttentionConfig` is the view of them one `sinkjax.layers.Attention` is built from), one
  part of `ModelConfig` (flat model.* keys like the others). norm_scale, norm_eps and init apply to the rest of the
  model too. The gate options are gated attention's ([GatedAttn]; layers' "Gating ablations"; which of them only
  gated reads, `sinkjax.kinds.gated.GATE_OPTIONS`)."""
  attention: str = declare("vanilla", choices=choices.ATTENTION_VARIANTS) # vanilla | sink | gated | relu
  gate: str = declare("headwise", choices=choices.GATE_KINDS) # headwise | elementwise (gated attention)
  gate_position: str = declare("sdpa", choices=choices.GATE_POSITIONS) # sdpa: out = SDPA * g(x_t) (G1) | value: v_j * g(x_j) before attention (G2)
  gate_shared: bool = False         # head-shared: one score per token (headwise) / per dim (elementwise) for all
                                    # heads, from a projection with 1/H of the outputs
  gate_activation: str = declare("sigmoid", choices=choices.GATE_ACTIVATIONS) # y * sigmoid(z) | y * ns_sigmoid(z) = 0.5 + 0.5 sigmoid | y * silu(z)
                                    # | silu_additive: y + SiLU(z)  (z = x W + b)
  gate_input: str = declare("dependent", choices=choices.GATE_INPUTS) # dependent: z = x W + b | independent: z = a learned logit per head (and dim),
                                    # initialized to gate_bias_init ([GatedAttn] Table 4 row 6: 0)
  gate_bias: bool = True            # the b of z = x W + b (Qwen3-Next's gate, a half of its q projection, has none)
  gate_bias_init: float = declare(0.0, "any") # initial gate bias (gated attention): sigmoid(0) = 0.5
  sink_init: float = declare(0.0, "any") # initial sink logit (sink attention)
  sink_tokens: int = declare(0, ">=0")  # learnable sink tokens prepended to K/V ([StreamingLLM])
  qk_norm: bool = True
  norm_scale: bool = False          # learnable RMSNorm scales (block, final and QK norms), as HF Llama/Qwen
  norm_eps: float = declare(1e-6, ">0") # RMSNorm epsilon (HF: rms_norm_eps)
  rope_theta: float = declare(10000.0, ">0")
  rope_style: str = declare("llama", choices=choices.ROPE_STYLES) # llama | nanochat: nanochat's rotation sign, bfloat16 cos/sin tables and
                                    # QK-norm after RoPE (layers.apply_rope)
  rope_partial: float = declare(1.0, ">0") # the fraction of each head's dims RoPE rotates (the first ones; Qwen3-Next 0.25)
  sliding_window: int = declare(0, ">=0") # > 0: "sliding" layers see only the last sliding_window keys (incl. self)
  attn_out_bias: bool = True        # with attn_bias: o_proj's bias too (Qwen2 has q/k/v biases only)
  init: str = declare("default", choices=choices.INITS) # default | nanochat: LM head N(0, 0.001) instead of zeros, block input
                                    # matrices uniform with std 1/sqrt(d_model) instead of truncated normal


@dataclasses.dataclass
class PaperModel:
  """The model section's core: the paper's model ([Sink-MoE] Table 1, nanochat's GPT), its attention variants and
  gate ablations, and how it is computed (dtypes, remat, scan, kernel). One of the three parts of `ModelConfig`;
  the model.* keys stay flat (a YAML never names the part)."""
  num_layers: int = declare(4, ">=1")
  d_model: int = declare(256, ">=1")
  num_heads: int = declare(4, ">=1")
  num_kv_heads: int = declare(4, ">=1")
  head_dim: int = declare(64, ">=1")
  vocab_size: int = declare(0, ">=0")   # 0 = take it from the tokenizer
  mlp_ratio: int = declare(4, ">=1")
  mlp: str = declare("relu2", choices=choices.MLP_KINDS) # relu2 | swiglu
  logit_softcap: float = declare(15.0, ">=0") # 0 disables
  max_seq_len: int = declare(2048, ">=1")
  # Gating ablations of [GatedAttn] (Tables 1 and 4), gated attention only; the defaults are its best gate (G1).
  tie_embeddings: bool = False
  dtype: str = declare("bfloat16", choices=choices.DTYPES) # compute dtype; params stay in param_dtype
  param_dtype: str = declare("float32", choices=choices.PARAM_DTYPES)
  remat: bool = False               # recompute each layer's activations in the backward (per layer, model.remat_policy)
  remat_policy: str = declare("nothing", choices=choices.REMAT_POLICIES) # nothing: keep only each layer's input | dots: also its weight matmuls' results
                                    # | save_attention, save_qkv_proj, ... (sinkjax.model.REMAT_POLICIES)
  scan_layers: bool = False         # the layers as one lax.scan over stacked weights (one layer or repeating group)
  attn_impl: str = declare("auto", choices=choices.ATTN_IMPLS) # flash_attention backend


@dataclasses.dataclass
class ImportedArchitecture:
  """Architecture options of imported Hugging Face models (sinkjax.convert.hf: Llama 3, Qwen2.5, Qwen3, Qwen3-MoE,
  GPT-OSS); the defaults are the paper's model, so a config that never imports leaves them alone."""
  mlp_hidden: int = declare(0, ">=0")   # MLP hidden width; 0 = mlp_ratio * d_model
  mlp_bias: bool = False            # biases in the MLP / expert projections (GPT-OSS)
  swiglu_limit: float = declare(7.0, ">0") # clamped_swiglu: gate <= limit, |up| <= limit (GPT-OSS)
  swiglu_alpha: float = declare(1.702, ">0") # clamped_swiglu: gate * sigmoid(alpha * gate) * (up + 1)
  moe_experts: int = declare(0, ">=0")  # > 0: the MLP is a top-k routed mixture of this many experts (GPT-OSS)
  moe_top_k: int = declare(1, ">=1")    # experts per token; their softmaxed router logits weight the outputs
  moe_router: str = declare("topk_softmax", choices=choices.MOE_ROUTERS) # topk_softmax: softmax over the k best router logits, router with a bias (GPT-OSS)
                                    # | softmax_topk: softmax over all experts, the k best probabilities as they are
                                    # | softmax_topk_norm: those renormalised to sum 1 (both: no bias; Qwen3-MoE)
  embed_norm: bool = True           # RMSNorm on the embedding output (nanochat does; HF models do not)
  attn_bias: bool = False           # biases in the q/k/v/o projections (GPT-OSS)
  rope_scaling: str = declare("none", choices=choices.ROPE_SCALINGS) # none | llama3 | yarn (HF rope_type), applied to rope_theta's frequencies
  rope_factor: float = declare(1.0, ">0") # llama3 / yarn: context extension factor
  rope_low_freq_factor: float = declare(1.0, ">0") # llama3
  rope_high_freq_factor: float = declare(4.0, ">0") # llama3
  rope_original_max_seq_len: int = declare(0, ">=0") # llama3 / yarn: pretraining context; 0 = max_seq_len
  rope_beta_fast: float = declare(32.0, ">0") # yarn
  rope_beta_slow: float = declare(1.0, ">0") # yarn
  rope_truncate: bool = True        # yarn: round the correction range to whole dimensions
  rope_attention_factor: float = declare(0.0, ">=0") # yarn: cos/sin multiplier; 0 = 0.1 ln(factor) + 1
  layer_types: list = dataclasses.field(default_factory=list)   # per layer full|sliding|linear (or a kind
                                    # registered in sinkjax.kinds); [] = all full (all sliding when sliding_window > 0)
  moe_shared_hidden: int = declare(0, ">=0") # > 0: a shared SwiGLU expert of this width beside the routed ones, scaled by
                                    # sigmoid(x w) (Qwen3-Next's shared_expert / shared_expert_gate)
  # "linear" layers (Gated DeltaNet, sinkjax.kinds.linear; Qwen3-Next's linear_*): 0 = num_heads heads of head_dim
  linear_key_heads: int = declare(0, ">=0")
  linear_value_heads: int = declare(0, ">=0") # a multiple of linear_key_heads
  linear_key_head_dim: int = declare(0, ">=0")
  linear_value_head_dim: int = declare(0, ">=0")
  linear_conv_kernel: int = declare(4, ">=1") # the causal depthwise conv's width
  linear_chunk_size: int = declare(64, ">=1") # the chunked form's chunk (training, prefill)


@dataclasses.dataclass
class NanochatCompatibility:
  """nanochat's conventions (configs/nanochat.yaml, sinkjax.convert.nanochat); the defaults are this project's."""
  depth: int = declare(0, ">=0")        # > 0: nanochat base_train's shapes from the depth: num_layers = depth,
                                    # d_model = 64 depth, heads = the divisor of d_model nearest d_model / 128,
                                    # num_kv_heads = num_heads, head_dim = d_model / heads (`resolve_depth`)
  vocab_pad_to: int = declare(1, ">=1") # embedding / LM-head rows rounded up to a multiple (nanochat: 64); logits are
                                    # sliced back to vocab_size before the soft-cap
  residual_scalars: bool = False    # per-layer resid_lambdas / x0_lambdas of nanochat's later GPT (6bb9240)



@dataclasses.dataclass
class ModelConfig(NanochatCompatibility, ImportedArchitecture, PaperModel, AttentionSection):
  """The model.* keys: `PaperModel` (the paper's model), `ImportedArchitecture` (Hugging Face imports) and
  `NanochatCompatibility`, one flat section in YAML and on the command line (fields in that order)."""

  # Hashable by value (lists as tuples): the model keeps its config as static graph metadata, and nnx.jit / jax.jit
  # caches key on it, so an unhashable config would re-trace on every call.
  def __hash__(self):
    return hash(tuple((f.name, tuple(v) if isinstance(v, list) else v)
                      for f in dataclasses.fields(self) for v in [getattr(self, f.name)]))

  @property
  def attention_only(self) -> bool:
    """Whether every layer is attention (full or sliding): the kinds registry need not be asked about any."""
    return all(t in ("full", "sliding") for t in self.layer_types)

  def mixer(self, layer: int) -> kinds.MixerKind:
    """The registered mixer kind of layer `layer` (its model.layer_types entry; "full" when the list is empty)."""
    return kinds.mixer_of(self, layer)

  @property
  def head_layers(self) -> tuple:
    """Indices of the layers with heads (their head importances stack to [len, num_heads]; sinkjax.kinds)."""
    if self.attention_only:
      return tuple(range(self.num_layers))
    return kinds.head_layers(self)

  @property
  def mlp_width(self) -> int:
    """The MLP hidden width: model.mlp_hidden, or mlp_ratio x d_model when it is 0."""
    return self.mlp_hidden or self.mlp_ratio * self.d_model

  def attention_config(self, layer: int | None = None) -> AttentionConfig:
    """The view of this config that the attention layer `layer` is built from: its sliding window is 0 on a "full"
    layer of model.layer_types (None: model.sliding_window as set). Making it checks the attention keys."""
    return AttentionConfig(self, full=bool(layer is not None and self.layer_types
                                            and self.layer_types[layer] == "full"))


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """Long-context RoPE frequency scaling, as Hugging Face's `rope_type` (modeling_rope_utils): "llama3" (Llama 3.1)
  or "yarn" (GPT-OSS, YaRN). `original_max_seq_len` is the pretraining context the correction is relative to."""
  kind: str = "none"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_seq_len: int = 8192
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  attention_factor: float = 0.0     # yarn: multiplier of cos/sin; 0 = 0.1 ln(factor) + 1

  def cos_sin_scale(self) -> float:
    if self.kind != "yarn":
      return 1.0
    if self.attention_factor:
      return self.attention_factor
    return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0

  def model_keys(self) -> dict:
    """These settings as the model.rope_* keys they come from (`AttentionConfig.rope` reads them back)."""
    return {"rope_scaling": self.kind, "rope_factor": self.factor, "rope_low_freq_factor": self.low_freq_factor,
            "rope_high_freq_factor": self.high_freq_factor, "rope_original_max_seq_len": self.original_max_seq_len,
            "rope_beta_fast": self.beta_fast, "rope_beta_slow": self.beta_slow, "rope_truncate": self.truncate,
            "rope_attention_factor": self.attention_factor}


# The model.* keys an `AttentionConfig` reads besides `AttentionSection`'s: shapes, dtypes, biases, kernel, RoPE scaling.
_LAYER_KEYS = ("d_model", "num_heads", "num_kv_heads", "head_dim", "dtype", "param_dtype", "attn_bias", "attn_impl",
               "max_seq_len", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
               "rope_original_max_seq_len", "rope_beta_fast", "rope_beta_slow", "rope_truncate",
               "rope_attention_factor")
_RENAMED = {"use_bias": "attn_bias", "impl": "attn_impl"}     # the layer keywords before the view


@functools.cache
def _model_hints() -> dict:
  return typing.get_type_hints(ModelConfig)


def keyword_spelling(message: str, caller: str = "Attention") -> str:
  """A config error about model.* keys in the words of a constructor that takes them as keywords: the key it is
  about as `caller(name=...)` (`caller(name=value)` where the message gives the value in parentheses), the others
  it names as `name` / `name=value`. "model.attention must be one of ..." -> "Attention(attention=...) must be one
  of ..."; "... set model.attention=gated ..." -> "... set attention=gated ..."."""
  message = message.removeprefix("config key ")
  message = re.sub(r"^model\.(\w+) \(([^)]*)\)", rf"{caller}(\1=\2)", message)
  message = re.sub(r"^model\.(\w+)", rf"{caller}(\1=...)", message)
  message = re.sub(r"model\.(\w+) \(([^)]*)\)", r"\1=\2", message)
  return re.sub(r"model\.(\w+)", r"\1", message)


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
  """What one `sinkjax.layers.Attention` is built from: a view of the model config (`ModelConfig.attention_config`),
  checked once, when it is made (a ConfigError names the key). It reads the model's attention keys
  (`AttentionSection`) and `_LAYER_KEYS` under their model.* names and adds what is the layer's own: whether it is a
  "full" layer of model.layer_types (no sliding window), whether o_proj starts at zero, the model.rope_* keys as one
  `RopeScaling` (`rope`), the head dims RoPE rotates. Standalone users pass the same model.* keys as keywords
  (`AttentionConfig.of`; `Attention(d_model, num_heads, ...)`, whose arguments are these attributes' names, the
  rope_* keys as one `rope=`). Hashed by value (layers keep it as static graph
  metadata); layers of one kind get equal views, so blocks stack for the layer scan."""
  model: ModelConfig
  full: bool = False                # a "full" layer of model.layer_types: model.sliding_window does not apply
  zero_init_output: bool = True     # o_proj starts at zero

  KEYS = frozenset([f.name for f in dataclasses.fields(AttentionSection)] + list(_LAYER_KEYS))

  def __post_init__(self):
    _check_attention(self)

  def __getattr__(self, name: str):
    if name in AttentionConfig.KEYS:
      return getattr(self.model, name)
    raise AttributeError(f"AttentionConfig has no {name!r} (it reads the model.* keys {sorted(AttentionConfig.KEYS)})")

  @classmethod
  def of(cls, d_model: int, num_heads: int, num_kv_heads: int | None = None, head_dim: int | None = None, *,
         zero_init_output: bool = True, caller: str = "Attention", **keys) -> AttentionConfig:
    """A standalone layer's view: model.* attention keys as keywords (`KEYS`; num_kv_heads None = num_heads,
    head_dim None = d_model // num_heads, dtype float32 unless given), each checked as the config checks it (type,
    choices, range). Errors are one line in the keywords' words, `caller(name=...)` (`keyword_spelling`), not the
    config's model.name; a key it does not read is a TypeError naming the ones it does."""
    for name in keys:
      if name in _RENAMED:
        raise TypeError(f"the attention keyword {name}= is spelled {_RENAMED[name]}= (the model.{_RENAMED[name]} key)")
      if name not in cls.KEYS:
        raise TypeError(f"an attention layer takes the model.* keys {', '.join(sorted(cls.KEYS))}; got {name}=")
    given = {"dtype": "float32", **keys, "d_model": d_model, "num_heads": num_heads,
             "num_kv_heads": num_kv_heads or num_heads, "head_dim": head_dim}
    try:
      hints = _model_hints()
      given = {name: _coerce(f"model.{name}", value, hints[name]) for name, value in given.items() if value is not None}
      given["head_dim"] = _coerce("model.head_dim", given.get("head_dim", given["d_model"] // given["num_heads"]), int)
      return cls(ModelConfig(**given), zero_init_output=zero_init_output)
    except ConfigError as e:
      raise ConfigError(keyword_spelling(str(e), caller)) from None

  @property
  def sliding_window(self) -> int:
    """The last keys each query sees (incl. itself): model.sliding_window, 0 (all) on a "full" layer."""
    return 0 if self.full else self.model.sliding_window

  @property
  def rope(self) -> RopeScaling | None:
    """The model.rope_* keys as one `RopeScaling` (llama3 / yarn long-context frequencies); None = plain RoPE."""
    m = self.model
    if m.rope_scaling == "none":
      return None
    return RopeScaling(m.rope_scaling, m.rope_factor, m.rope_low_freq_factor, m.rope_high_freq_factor,
                       m.rope_original_max_seq_len or m.max_seq_len, m.rope_beta_fast, m.rope_beta_slow,
                       m.rope_truncate, m.rope_attention_factor)

  @property
  def rotary_dim(self) -> int:
    """Head dims RoPE rotates: head_dim x rope_partial (even), the first ones."""
    return int(self.head_dim * self.rope_partial)


@dataclasses.dataclass
class LossConfig:
  aux_weight: float = declare(0.0, ">=0") # lambda of eq. 7/8 (paper: 1e-4 from scratch, 1e-2 fine-tuning)
  num_shared_heads: int = declare(0, ">=0") # m of eq. 8; 0 = eq. 7
  shared_heads_from: str = ""       # a run dir / report.json whose importances fix the shared set up front
  aux_term: bool = True             # trace the aux term in the step at every lambda, 0 included, so that lambda = 0
                                    # and lambda > 0 compile one program and differ only by the weight (a null arm
                                    # is null); false drops it from the program (lambda must be 0: sinkjax.bench.train)


@dataclasses.dataclass
class LoRAConfig:
  """Low-rank adapters (Hu et al. 2021) on the named projections; the base weights are frozen (sinkjax.lora)."""
  rank: int = declare(0, ">=0")         # 0 = off (full training); the paper fine-tunes with rank 16
  alpha: float = declare(32.0, ">0")    # the update is (alpha / rank) * x A B
  targets: list = dataclasses.field(
      default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])


@dataclasses.dataclass
class DataConfig:
  source: str = declare("default", alias="--data", metavar="SOURCE",   # --data: the flag of commands that read a
                    help="the text: 'default' (the embedded corpus), a path / glob of .txt / .jsonl / .parquet "
                         "files, or tfds:NAME")                         # run's data (eval: COMMAND.run_keys)
  val_source: str = ""              # a path/glob of files that IS the validation split (nanochat: the last shard);
                                    # then the whole data.source trains. "" = split data.source (val_split/fraction)
  seq_len: int = declare(256, ">=1")
  text_field: str = "text"
  tokenizer: str = "bytes"          # bytes | path to a Hugging Face tokenizer.json (or the directory holding it)
  add_bos: str = declare("auto", choices=choices.ADD_BOS) # auto | true | false: BOS before each document / prompt. auto: as the tokenizer's
                                    # own encoding does for a model's tokenizer (sinkjax.data.tokenizers), always for
                                    # bytes and a bare tokenizer.json (sinkjax's BOS-separated documents)
  tfds_dir: str = ""
  train_split: str = "train"
  val_split: str = "validation"
  val_fraction: float = declare(0.02, "(0,1)") # for sources without a validation split
  num_workers: int = declare(0, ">=0")  # grain worker processes (0 = in-process)
  prefetch: int = declare(2, ">=1")
  shuffle_batches: int = declare(8, ">=0") # packed rows are shuffled within windows of this many batches (0 = off): the
                                    # rows of one long document land in different batches
  format: str = declare("text", choices=choices.DATA_FORMATS) # text (packed documents) | sft (JSONL prompt/response or chat messages; loss
                                    # on the response tokens, sinkjax.data.sft)
  packing: str = declare("document", choices=choices.PACKINGS, alias="--packing", # how text becomes rows (data.pipeline):
                     help="how the text becomes rows: document (documents packed, attention masked between them) "
                          "or stream (rows cut from one stream of documents)")
                                    # document: documents packed with segment ids; attention masked between them,
                                    #   RoPE positions restart at each BOS, the vanilla gate's first key is the
                                    #   document's BOS, no loss on BOS targets
                                    # stream: nanochat's (the paper's baseline): rows cut from one stream of
                                    #   BOS-prefixed documents, plain causal attention over the row, the gate's first
                                    #   key is the row's first token, loss on every target


@dataclasses.dataclass
class TrainConfig:
  batch_size: int = declare(16, ">=1")  # sequences per optimizer step (global)
  grad_accum: int = declare(1, ">=1")   # micro-batches per step
  steps: int = declare(0, ">=0")        # 0 = token budget of tokens_per_param x parameters
  tokens_per_param: float = declare(20.0, ">0")
  seed: int = declare(0, ">=0")
  log_every: int = declare(10, ">=1")
  eval_every: int = declare(100, ">=0") # validation BPB every this many steps and at the end (0 = only at the end)
  eval_batches: int = declare(8, ">=0") # validation batches of train.batch_size / train.grad_accum rows (0 = none)
  optimizer: str = declare("muon", choices=choices.OPTIMIZERS) # muon | adamw
  matrix_lr: float = declare(0.02, ">=0") # Muon, for hidden weight matrices
  embed_lr: float = declare(0.2, ">=0") # AdamW, embeddings (nanochat-style)
  unembed_lr: float = declare(0.004, ">=0") # AdamW, unembedding
  scalar_lr: float = declare(0.04, ">=0") # AdamW, scalars/vectors (sinks, gate biases, norms)
  adamw_lr: float = declare(3e-4, ">=0") # plain AdamW (optimizer: adamw)
  weight_decay: float = declare(0.0, ">=0")
  grad_clip: float = declare(1.0, ">=0")
  warmup_steps: int = declare(0, ">=0")
  decay_frac: float = declare(0.2, "[0,1]") # linear decay to 0 over the final fraction of steps
  muon_momentum: float = declare(0.95, "[0,1)") # Muon's momentum after warmup
  muon_momentum_start: float = declare(0.85, "[0,1]") # ... linearly from this value over muon_momentum_warmup steps (nanochat)
  muon_momentum_warmup: int = declare(300, ">=0") # 0 = muon_momentum from the first step
  muon_ns_dtype: str = declare("bfloat16", choices=choices.NS_DTYPES) # dtype of Muon's Newton-Schulz iteration (nanochat: bfloat16)
  muon_stack: bool = True           # one device: Newton-Schulz on the matrices of one shape stacked, one batched
                                    # matmul per iteration for all of them; false: one per parameter (sinkjax.optim)
  max_nonfinite: int = declare(5, ">=1") # consecutive non-finite steps (loss, gradient or update) before the run stops
  epochs: int = declare(0, ">=0")       # data.format=sft: stop after this many passes over the training examples, with a
                                    # checkpoint (train.steps 0: the steps those passes make); 0 = no limit
  stop_at_step: int = declare(0, ">=0") # end this invocation after this step with a checkpoint, schedule unchanged
                                    # (chunked jobs on preemptible machines); 0 = run to train.steps
  loss_chunk: int = declare(0, ">=0")   # > 0: logits and cross-entropy this many positions of every row at a time, never
                                    # [tokens, vocab] at once (recomputed in the backward); 0 = all positions at once
  loss_impl: str = declare("autodiff", choices=choices.LOSS_IMPLS) # the cross-entropy's gradient: autodiff (its
                                    # backward; with loss_chunk it computes each block's logits again) | fused: formed
                                    # in the forward pass block by block (softmax - one-hot), so the LM head's logits
                                    # matmul runs once a step (sinkjax.step.fused_ce_sum; docs/PERF.md, d20)
  gpu_gemm: str = declare("auto", choices=choices.GPU_GEMMS) # the GPU programs' matmuls: auto (XLA picks Triton or
                                    # cuBLAS per matmul) | cublas: all through cuBLAS (XLA's xla_gpu_enable_triton_gemm
                                    # off; sinkjax.train.step_compiler_options). No effect on CPU and TPU
  init_from: str = ""               # fine-tuning: a run dir (e.g. from sinkjax.convert.hf) whose weights start the run
  profile_start: int = declare(0, ">=0") # jax.profiler trace of steps [profile_start, profile_start + profile_steps)
  profile_steps: int = declare(0, ">=0") # into RUN_DIR/profile (TensorBoard's profile plugin, or Perfetto); 0 = off


@dataclasses.dataclass
class CheckpointConfig:
  every: int = declare(200, ">=1")      # save every this many steps, and always at the end / on SIGTERM or SIGINT
  keep: int = declare(3, ">=1")         # most recent checkpoints kept in RUN_DIR/checkpoints
  keep_steps: list = dataclasses.field(default_factory=list)  # also saved at these steps and never deleted
  async_save: bool = True           # write in a background thread while training continues


@dataclasses.dataclass
class RunConfig:
  dir: str = "runs/tiny"


@dataclasses.dataclass
class LoggingConfig:
  """Trackers besides metrics.jsonl and TensorBoard (written by process 0; sinkjax.tracking)."""
  wandb: bool = False               # send every metrics.jsonl record and the resolved config to Weights & Biases
  wandb_project: str = "sinkjax"    # (pip install 'sinkjax[wandb]'; WANDB_MODE=offline runs without network or key)
  wandb_entity: str = ""            # team or user; "" = the API key's default entity
  wandb_name: str = ""              # the run's display name; "" = the run directory's name
  wandb_tags: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class MeshConfig:
  data: int = declare(-1, "-1|>=1")     # -1 fills the remaining devices
  fsdp: int = declare(1, "-1|>=1")
  tensor: int = declare(1, "-1|>=1")
  # How XLA:TPU runs a matmul whose weight FSDP splits (docs/TPU.md, "Collective matmuls"): gather = all-gather the
  # weight whole, one matmul, reduce-scatter its gradient (XLA:TPU's windowed einsums off) | windowed = XLA:TPU's
  # windowed einsums where its heuristic picks them (a loop of per-shard matmuls overlapping the collective-permutes;
  # with the weight split along the contracted d_model, each trip adds a whole-output partial sum in HBM).
  # Compile options of the TPU programs (`sharding.compiler_options`); no effect on CPU and GPU.
  collective_matmul: str = declare("gather", choices=choices.COLLECTIVE_MATMULS)
@dataclasses.dataclass
class Config:
  model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
  loss: LossConfig = dataclasses.field(default_factory=LossConfig)
  data: DataConfig = dataclasses.field(default_factory=DataConfig)
  train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
  checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
  lora: LoRAConfig = dataclasses.field(default_factory=LoRAConfig)
  run: RunConfig = dataclasses.field(default_factory=RunConfig)
  mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
  logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)




# The range of every numeric key (checked when a config is loaded, before anything is written anywhere). Where 0 or
# -1 has a meaning, the comment at the key's declaration above says which ("0 = the token budget", ...).
# CHOICES / RANGES: every enumerated / numeric key's allowed values, read from its declaration above (`declare`).
CHOICES, RANGES = _declared(Config)
_MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                   if f.default is not dataclasses.MISSING}
_RANGE_TESTS = {
    "any": (lambda v: True, "finite"),
    ">=0": (lambda v: v >= 0, ">= 0"),
    ">=1": (lambda v: v >= 1, ">= 1"),
    ">0": (lambda v: v > 0, "> 0"),
    ">=2": (lambda v: v >= 2, ">= 2"),
    "(0,1]": (lambda v: 0 < v <= 1, "in (0, 1]"),
    "[0,1]": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "[0,1)": (lambda v: 0 <= v < 1, "in [0, 1)"),
    "(0,1)": (lambda v: 0 < v < 1, "in (0, 1)"),
    "-1|>=1": (lambda v: v == -1 or v >= 1, "-1 (fill the remaining devices) or >= 1"),
}


def _check_range(key: str, value, spec: str | None = None) -> None:
  """A numeric value outside `spec` (default RANGES[key]; or a NaN / infinity) is a ConfigError naming the key and
  its range."""
  ok, text = _RANGE_TESTS[spec or RANGES[key]]
  if not math.isfinite(value) or not ok(value):
    raise ConfigError(f"config key {key} must be {text}, got {value!r}")


def _coerce(key: str, value: Any, typ: type, declared: dict | None = None) -> Any:
  """Checks/converts one leaf value; strings from the command line are parsed as YAML scalars first. `declared`:
  the key's declaration (its field's metadata: range, choices) where `key` is not one of `Config`'s (a command's
  option, whose `key` names its flag too)."""
  allowed = CHOICES.get(key) if declared is None else declared.get("choices")
  spec = RANGES.get(key) if declared is None else declared.get("range")
  if isinstance(value, str) and typ is not str:
    try:
      value = yaml.safe_load(value)
    except yaml.YAMLError:
      pass
  if typ is float and isinstance(value, str):
    try:
      value = float(value)              # YAML 1.1 reads "1e-2" (no dot) as a string
    except ValueError:
      pass
  if typ is float and isinstance(value, int) and not isinstance(value, bool):
    value = float(value)
  if typ is str and isinstance(value, (int, float)) and not isinstance(value, bool):
    value = str(value)
  if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
    raise ConfigError(f"config key {key} must be {typ.__name__}, got {value!r}")
  if allowed is not None and value not in allowed:
    raise ConfigError(f"config key {key} must be one of {'|'.join(allowed)}, got {value!r}")
  if typ in (int, float) and (declared is None or spec is not None):
    _check_range(key, value, spec)
  return value


def _flat_spelling(name: str, tree: dict) -> str:
  """The one-line refusal of a model.* mapping (`model: {attention: {kind: gated}}`, `model.linear.key_heads=2`):
  the model.* keys are flat, so it names the flat key of its first sub-key."""
  text = f"config key model.{name} is not a section: the model.* keys are flat"
  if not tree:
    return text
  sub = next(iter(tree))
  flat = "attention" if (name, sub) == ("attention", "kind") else sub if name == "attention" else f"{name}_{sub}"
  return f"{text}, write model.{name}.{sub} as model.{flat}"


def _apply(obj: Any, tree: dict, source: str, prefix: str = "") -> None:
  """Sets the keys of `tree` on the config `obj`; an error names the key and `source` (a file, the command line)."""
  hints = typing.get_type_hints(type(obj))
  for name, value in tree.items():
    key = f"{prefix}{name}"
    if isinstance(obj, ModelConfig) and isinstance(value, dict):
      raise ConfigError(f"{_flat_spelling(name, value)} (in {source})")
    if name not in hints:
      raise ConfigError(f"unknown config key {key} in {source}{_suggest(obj, name, prefix)}")
    typ = hints[name]
    if dataclasses.is_dataclass(typ):
      if not isinstance(value, dict):
        raise ConfigError(f"config key {key} in {source} must be a mapping of sub-keys, got {value!r}")
      _apply(getattr(obj, name), value, source, key + ".")
    else:
      try:
        setattr(obj, name, _coerce(key, value, typ))
      except ConfigError as e:
        raise ConfigError(f"{e} (in {source})") from None


def _suggest(obj: Any, name: str, prefix: str) -> str:
  """'; it is S.new now' for a renamed key, '; it belongs in S.name' for a key of another section, else '; did you
  mean X?' with the nearest keys."""
  new = renamed(type(obj), name)
  if new:
    return f"; it is {prefix}{new} now"
  if prefix:
    elsewhere = [f"{section}.{name}" for section, typ in typing.get_type_hints(Config).items()
                 if name in {f.name for f in dataclasses.fields(typ)}]
    if elsewhere:
      return f"; it belongs in {' or '.join(elsewhere)}"
  here = [f.name for f in dataclasses.fields(obj)]
  near = difflib.get_close_matches(name, here, n=3, cutoff=0.6)
  if near:
    return f"; did you mean {' or '.join(prefix + n for n in near)}?"
  return f" (the sections are {', '.join(here)})" if not prefix else \
      f" (the keys of {prefix[:-1]} are declared in sinkjax/config.py)"


_PACKAGE = pathlib.Path(__file__).resolve().parent


def configs_dir() -> pathlib.Path:
  """The packaged configs: sinkjax/configs/ in an installed wheel (pyproject.toml maps the repository's top-level
  configs/ there), the checkout's configs/ when sinkjax runs from a checkout (an editable install, PYTHONPATH)."""
  packaged = _PACKAGE / "configs"
  return packaged if packaged.is_dir() else _PACKAGE.parent / "configs"


def packaged_names(sub: str = "") -> list[str]:
  """The names of the packaged YAML files under configs/SUB (`tiny`, `paper/d20_sink_aux`; with sub="studies",
  `trigger_quick`); the configs leave the study files out."""
  root = configs_dir() / sub
  names = [p.relative_to(root).with_suffix("").as_posix() for p in sorted(root.rglob("*.yaml"))]
  return [n for n in names if sub or not n.startswith("studies/")]


def packaged_list(sub: str = "") -> str:
  """The packaged names in a line: `base, d20, ..., tiny; paper/: d20_gated_aux, ...`."""
  groups: dict[str, list[str]] = {}
  for name in packaged_names(sub):
    folder, _, stem = name.rpartition("/")
    groups.setdefault(folder, []).append(stem)
  return "; ".join((f"{folder}/: " if folder else "") + ", ".join(stems) for folder, stems in groups.items())


def find_packaged(name, sub: str = "") -> pathlib.Path | None:
  """The packaged file a bare name means (`tiny`, `tiny.yaml`, `paper/d20_sink_aux`, or `configs/tiny.yaml` as the
  README writes it; under configs/SUB for sub="studies"), or None: a URL, an absolute path or an existing file is
  the file it names."""
  text = os.fspath(name) if isinstance(name, os.PathLike) else str(name)
  if "://" in text or not text or os.path.isabs(os.path.expanduser(text)) or os.path.isfile(os.path.expanduser(text)):
    return None
  return packaged_file(text, sub)


def packaged_file(text: str, sub: str = "") -> pathlib.Path | None:
  """The packaged file under configs/SUB that `text` names (`tiny`, `paper/d20_sink_aux.yaml`), or None."""
  rel = pathlib.PurePath(text).as_posix().removeprefix("configs/")
  if sub:
    rel = rel.removeprefix(sub + "/")
  root = configs_dir() / sub
  for candidate in (root / rel, root / (rel + ".yaml")):
    if candidate.is_file() and candidate.resolve().is_relative_to(root.resolve()):
      return candidate
  return None


def yaml_error(what: str, error: yaml.YAMLError) -> str:
  """One line for a YAML syntax error: `WHAT:LINE:COLUMN is not valid YAML: the problem (and its context's line)`."""
  mark = getattr(error, "problem_mark", None)
  where = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
  problem = getattr(error, "problem", None) or str(error).splitlines()[0]
  context, context_mark = getattr(error, "context", None), getattr(error, "context_mark", None)
  if context and context_mark is not None:
    problem += f" ({context} at line {context_mark.line + 1})"
  return f"{what}{where} is not valid YAML: {problem}"


def read_yaml_file(path, what: str) -> Any:
  """The YAML document in `path`; a syntax error is a ConfigError naming the file, its line and column."""
  try:
    return yaml.safe_load(path.read_text())
  except yaml.YAMLError as e:
    raise ConfigError(yaml_error(f"{what} {path}", e)) from None


def _read_yaml(path, seen: tuple = ()) -> list[tuple[str, dict]]:
  """[(file, tree)] in the order they apply: the `base:` chain first, then the file itself."""
  if not path.is_file():
    raise ConfigError(f"config file {path} does not exist: give a YAML file or a packaged config by name "
                      f"({packaged_list()})")
  if str(path.resolve()) in seen:
    raise ConfigError(f"config file {path} inherits from itself through 'base:'")
  tree = read_yaml_file(path, "config file") or {}
  if not isinstance(tree, dict):
    raise ConfigError(f"config file {path} must be a mapping of sections (model:, train:, ...)")
  base = tree.pop("base", None)
  if base is None:
    return [(str(path), tree)]
  parent = path.parent / str(base)
  if not parent.is_file():          # base: a packaged config by name (`base: tiny`) from a file of one's own
    parent = packaged_file(str(base)) or parent
  return _read_yaml(parent, seen + (str(path.resolve()),)) + [(str(path), tree)]


def parse_override(text: str) -> tuple[str, str]:
  if "=" not in text:
    raise ConfigError(f"override {text!r} must look like section.key=value (e.g. train.steps=100)")
  key, value = text.split("=", 1)
  return key.strip(), value


def load_config(path: str | None = None, overrides: list[str] | tuple = ()) -> Config:
  """Reads a YAML config (with `base:` inheritance), applies `dotted.key=value` overrides and validates. `path` is a
  file, or the name of a packaged config (`tiny`, `paper/d20_sink_aux`: `find_packaged`) when no such file exists."""
  cfg = Config()
  if path:
    for source, tree in _read_yaml(find_packaged(path) or paths.as_path(path, "config file")):
      _apply(cfg, tree, source)
  return apply_overrides(cfg, overrides)


def apply_overrides(cfg: Config, overrides: list[str] | tuple = ()) -> Config:
  """`dotted.key=value` overrides applied to `cfg` in place (as on the command lines), then validated."""
  for text in overrides:
    key, value = parse_override(text)
    tree: dict = {}
    node = tree
    parts = key.split(".")
    for p in parts[:-1]:
      node = node.setdefault(p, {})
    node[parts[-1]] = value
    _apply(cfg, tree, f"the override {text!r}")
  validate(cfg)
  return cfg


def to_dict(cfg: Config) -> dict:
  return dataclasses.asdict(cfg)


SHAPE_KEYS = ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim")


def depth_shapes(depth: int, head_dim: int = 128) -> dict:
  """nanochat base_train's model shape for a depth: d_model = 64 depth, the head count nearest d_model / head_dim
  that divides d_model (search outward from the ideal, larger first), no GQA."""
  d = 64 * depth
  ideal = max(1, round(d / head_dim))
  heads = next(c for off in range(d) for c in (ideal + off, ideal - off) if c > 0 and d % c == 0)
  return dict(num_layers=depth, d_model=d, num_heads=heads, num_kv_heads=heads, head_dim=d // heads)


def resolve_depth(m: ModelConfig) -> None:
  """Fills the shape keys from model.depth (> 0); a shape key set to something else is an error naming both."""
  if m.depth <= 0:
    return
  default = ModelConfig()
  for key, value in depth_shapes(m.depth).items():
    given = getattr(m, key)
    if given not in (value, getattr(default, key)):
      raise ConfigError(f"model.{key}={given} contradicts model.depth={m.depth} (which gives {value}): drop one, "
                        f"or set model.depth=0 to give every shape key yourself")
    setattr(m, key, value)


def _check_ranges(cfg: Config) -> None:
  """RANGES over the whole config (a config built in code never went through `_coerce`)."""
  for key, spec in RANGES.items():
    section, name = key.split(".")
    value = getattr(getattr(cfg, section), name)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConfigError(f"config key {key} must be a number, got {value!r}")
    _check_range(key, value)


def validate(cfg: Config) -> None:
  _check_ranges(cfg)
  m = cfg.model
  resolve_depth(m)
  m.attention_config()                   # checks the attention keys (the registered variants' own checks too)
  if cfg.train.batch_size % cfg.train.grad_accum:
    raise ConfigError(f"train.batch_size ({cfg.train.batch_size}) must be divisible by train.grad_accum "
                      f"({cfg.train.grad_accum})")
  if not cfg.loss.aux_term and cfg.loss.aux_weight > 0:
    raise ConfigError(f"loss.aux_term=false drops the aux loss but loss.aux_weight is {cfg.loss.aux_weight:g}; "
                      "set loss.aux_weight=0 or loss.aux_term=true")
  if cfg.loss.num_shared_heads >= m.num_heads:
    raise ConfigError(f"loss.num_shared_heads must be in [0, model.num_heads) = [0, {m.num_heads}), "
                      f"got {cfg.loss.num_shared_heads}")
  if cfg.train.profile_steps > 0 and cfg.train.profile_start < 1:
    raise ConfigError(f"train.profile_steps > 0 needs train.profile_start >= 1 (a step number; pick one after the "
                      f"first, which compiles), got {cfg.train.profile_start}")
  if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in cfg.checkpoint.keep_steps):
    raise ConfigError(f"checkpoint.keep_steps must be a list of step numbers >= 1, got {cfg.checkpoint.keep_steps!r}")
  _validate_architecture(m)
  _validate_lora(cfg.lora)
  if cfg.data.format == "sft" and cfg.data.packing == "stream":
    raise ConfigError("data.packing=stream cuts plain text into rows, but data.format=sft keeps its own layout (one "
                      "example per segment): set data.packing=document")


LAYER_TYPES = choices.LAYER_TYPES
LORA_TARGETS = choices.LORA_TARGETS


def _validate_architecture(m: ModelConfig) -> None:
  """The options of imported models (HF architectures): values in range and combinations the model supports."""
  if m.moe_experts and not 1 <= m.moe_top_k <= m.moe_experts:
    raise ConfigError(f"model.moe_top_k must be in [1, model.moe_experts={m.moe_experts}], got {m.moe_top_k}")
  bad = [t for t in m.layer_types if t not in LAYER_TYPES]
  if bad:
    raise ConfigError(f"model.layer_types entries must be {'|'.join(LAYER_TYPES)}, got {bad[0]!r}")
  if m.layer_types and len(m.layer_types) != m.num_layers:
    raise ConfigError(f"model.layer_types has {len(m.layer_types)} entries but model.num_layers is {m.num_layers}")
  if "sliding" in m.layer_types and not m.sliding_window:
    raise ConfigError("model.layer_types names sliding layers: set model.sliding_window > 0")
  if m.moe_shared_hidden and not m.moe_experts:
    raise ConfigError("model.moe_shared_hidden is the shared expert of an MoE: set model.moe_experts > 0")
  for t in dict.fromkeys(m.layer_types):
    if t in kinds.MIXERS:                 # registered (a built-in one once sinkjax.model is imported)
      kinds.MIXERS[t].check(m)


def _check_attention(a: AttentionConfig) -> None:
  """What an attention layer may be built from: known choices, whole GQA groups, and each option where its variant
  is. The variants' own checks (`AttentionKind.options`, `.check`) are asked of the registered ones: all built-in
  ones once `sinkjax.layers` is imported, and always when a layer is built (this runs when its view is made)."""
  for name in ("attention", "gate", "gate_position", "gate_activation", "gate_input", "rope_style", "rope_scaling",
               "init"):
    allowed = CHOICES[f"model.{name}"]
    if getattr(a, name) not in allowed:
      raise ConfigError(f"model.{name} must be one of {'|'.join(allowed)}, got {getattr(a, name)!r}")
  if a.num_heads % a.num_kv_heads:
    raise ConfigError(f"model.num_heads ({a.num_heads}) must be a multiple of model.num_kv_heads "
                      f"({a.num_kv_heads})")
  if a.rotary_dim % 2 or not 0 < a.rope_partial <= 1:
    raise ConfigError(f"model.rope_partial must be in (0, 1] and rotate an even number of the {a.head_dim} head dims, "
                      f"got {a.rope_partial}")
  if a.sink_tokens < 0:
    raise ConfigError(f"model.sink_tokens must be >= 0, got {a.sink_tokens}")
  kind = kinds.ATTENTION.get(a.attention)      # None: a built-in variant not imported yet (its name is valid)
  default = _MODEL_DEFAULTS
  for other in kinds.ATTENTION.values():
    changed = [k for k in other.options if other is not kind and getattr(a, k) != default[k]]
    if changed:
      raise ConfigError(f"model.{changed[0]} configures {other.name} attention: set model.attention={other.name} "
                        f"(got {a.attention!r}) or leave it at its default")
  if kind is not None:
    kind.check(a)


def _validate_lora(lora: LoRAConfig) -> None:
  bad = [t for t in lora.targets if t not in LORA_TARGETS]
  if bad or (lora.rank and not lora.targets):
    raise ConfigError(f"lora.targets must be a non-empty list of {'|'.join(LORA_TARGETS)}, got {lora.targets!r}")


def apply_section(section, tree: dict, source: str, name: str):
  """Sets a command's own section (a dataclass declared with `declare`, kept outside `Config`: e.g. a study's `study:`)
  from a mapping, checked as Config's keys are (types, choices, ranges; errors name NAME.key and `source`)."""
  added = {}
  for f in dataclasses.fields(section):
    for meta, table in (("choices", CHOICES), ("range", RANGES)):
      if meta in f.metadata:
        table[f"{name}.{f.name}"] = added[f"{name}.{f.name}", meta] = f.metadata[meta]
  try:
    _apply(section, tree, source, name + ".")
  finally:                              # the tables stay Config's own (validate walks RANGES over Config)
    for (k, meta) in added:
      (CHOICES if meta == "choices" else RANGES).pop(k, None)
  return section
