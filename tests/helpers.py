"""Helpers shared by several test files: independent references that the tests compare the code against."""
from sinkjax.config import ModelConfig


def param_count_formula(cfg: ModelConfig) -> int:
  """Closed-form parameter count of `sinkjax.model.Transformer` for a config, written out from the architecture."""
  d, hq, hkv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  v = -(-cfg.vocab_size // cfg.vocab_pad_to) * cfg.vocab_pad_to        # embedding / LM-head rows, padded
  attn = d * hq * hd + 2 * d * hkv * hd + hq * hd * d
  if cfg.attention == "sink":
    attn += hq
  attn += cfg.sink_tokens * d              # learnable sink tokens (sink_states of each layer)
  if cfg.attention == "gated":            # gate heads: Hq at G1, Hkv at G2, 1 head-shared
    gh = 1 if cfg.gate_shared else (hq if cfg.gate_position == "sdpa" else hkv)
    w = gh if cfg.gate == "headwise" else gh * hd
    attn += (d * w + w) if cfg.gate_input == "dependent" else w
  if cfg.attn_bias:
    attn += hq * hd + 2 * hkv * hd + d
  if cfg.norm_scale:                       # attention/MLP norms per block (+ QK-norms); final norm below
    attn += 2 * d + (2 * hd if cfg.qk_norm else 0)
  h = cfg.mlp_width
  gated = cfg.mlp != "relu2"
  mlp = (3 if gated else 2) * d * h + (((2 if gated else 1) * h + d) if cfg.mlp_bias else 0)
  if cfg.moe_experts:
    mlp = cfg.moe_experts * mlp + d * cfg.moe_experts + cfg.moe_experts     # experts + router
  final = (d if cfg.norm_scale else 0) + (2 * cfg.num_layers if cfg.residual_scalars else 0)
  return v * d * (1 if cfg.tie_embeddings else 2) + cfg.num_layers * (attn + mlp) + final
