"""The allowed values of every enumerated setting, in one place (no jax import: the config reads them at parse time).

`sinkjax.config.CHOICES` maps config keys to these tuples; the modules that implement a setting check their
arguments against the same tuple, so a value is added in one place.
"""
import sys


class Registered:
  """The built-in names of a `sinkjax.kinds` registry plus those registered there since (read live, so a kind a
  user registers is a valid config value at once). The built-in names are here because a config may name a built-in
  kind before the module that registers it (`sinkjax.layers`, `sinkjax.model`) is imported."""

  def __init__(self, builtin: tuple, table: str):
    self.builtin, self.table = builtin, table

  def names(self) -> tuple:
    kinds = sys.modules.get("sinkjax.kinds")
    return tuple(dict.fromkeys(self.builtin + tuple(getattr(kinds, self.table, ()) if kinds else ())))

  def __iter__(self):
    return iter(self.names())

  def __contains__(self, name) -> bool:
    return name in self.names()

  def __len__(self) -> int:
    return len(self.names())

  def __repr__(self) -> str:
    return repr(self.names())


ATTENTION_VARIANTS = Registered(("vanilla", "sink", "gated", "relu"), "ATTENTION")   # model.attention (kinds.ATTENTION)
PAPER_VARIANTS = ("vanilla", "sink", "gated")   # [Sink-MoE]'s three variants, in its tables' order (the grid, its reports)
GATE_KINDS = ("headwise", "elementwise")
GATE_POSITIONS = ("sdpa", "value")                        # [GatedAttn] G1 | G2
GATE_ACTIVATIONS = ("sigmoid", "ns_sigmoid", "silu", "silu_additive")
GATE_INPUTS = ("dependent", "independent")
MLP_KINDS = ("relu2", "swiglu", "clamped_swiglu")
MOE_ROUTERS = ("topk_softmax", "softmax_topk", "softmax_topk_norm")   # model.moe_router (layers.moe_tokens)
ROPE_SCALINGS = ("none", "llama3", "yarn")
ROPE_STYLES = ("llama", "nanochat")
INITS = ("default", "nanochat")
DTYPES = ("float32", "bfloat16", "float16")
PARAM_DTYPES = ("float32", "bfloat16")
ATTN_IMPLS = ("auto", "reference", "xla", "pallas_tpu", "pallas_gpu", "cudnn", "mosaic_gpu")
OPTIMIZERS = ("muon", "adamw")
NS_DTYPES = ("bfloat16", "float32")
LOSS_IMPLS = ("autodiff", "fused")   # train.loss_impl (sinkjax.step)
GPU_GEMMS = ("auto", "cublas")       # train.gpu_gemm (sinkjax.train.step_compiler_options)
DATA_FORMATS = ("text", "sft")
PACKINGS = ("stream", "document")
COLLECTIVE_MATMULS = ("gather", "windowed")  # mesh.collective_matmul (sharding.compiler_options)
ADD_BOS = ("auto", "true", "false")         # data.add_bos (sinkjax.data.tokenizers)
LAYER_TYPES = Registered(("full", "sliding", "linear"), "MIXERS")    # model.layer_types entries (kinds.MIXERS)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
REMAT_POLICIES = ("nothing", "dots", "save_qkv_proj", "save_out_proj", "save_attention", "offload_dots",
                  "offload_qkv_proj", "offload_out_proj", "offload_attention")   # sinkjax.model.REMAT_POLICIES
