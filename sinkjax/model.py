"""The decoder-only language model of the paper's baseline (nanochat-style GPT, 000 Table 1).

Pre-norm blocks with parameter-free RMSNorm, RoPE, QK-norm, ReLU^2 MLP (4x), untied embeddings, no biases,
logit soft-cap, GQA option; the attention variant comes from `sinkjax.layers.Attention`. Model code knows nothing
about training: the loss, the aux loss and the optimizer live in `sinkjax.train`.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from sinkjax.config import ModelConfig
from sinkjax.layers import MLP, Attention, RMSNorm, default_positions, pop_head_importance

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    dt, pdt = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
    self.attn_norm = RMSNorm(cfg.d_model)
    self.attn = Attention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, attention=cfg.attention,
                          gate=cfg.gate, qk_norm=cfg.qk_norm, rope_theta=cfg.rope_theta, sink_init=cfg.sink_init,
                          gate_bias_init=cfg.gate_bias_init, impl=cfg.attn_impl, dtype=dt, param_dtype=pdt,
                          rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model)
    self.mlp = MLP(cfg.d_model, cfg.mlp_ratio * cfg.d_model, kind=cfg.mlp, dtype=dt, param_dtype=pdt, rngs=rngs)

  def __call__(self, x, segment_ids, positions):
    x = x + self.attn(self.attn_norm(x), segment_ids=segment_ids, positions=positions)
    return x + self.mlp(self.mlp_norm(x))


class Transformer(nnx.Module):
  """tokens [B,T] -> logits [B,T,V] (float32, soft-capped). Records per-layer head importance (see layers)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if cfg.vocab_size < 1:
      raise ValueError("model.vocab_size must be set (the trainer fills it from the tokenizer)")
    self.cfg = cfg
    dt, pdt = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt,
                           embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model)
    self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dt, param_dtype=pdt,
        kernel_init=nnx.initializers.zeros_init(), rngs=rngs)

  def __call__(self, tokens, *, segment_ids=None, positions=None):
    B, T = tokens.shape
    if positions is None:
      positions = default_positions(segment_ids, B, T)
    x = _norm(self.embed(tokens))            # nanochat normalizes the embedding output
    for block in self.layers:
      if self.cfg.remat:
        x = nnx.remat(lambda blk, h: blk(h, segment_ids, positions))(block, x)
      else:
        x = block(x, segment_ids, positions)
    x = self.final_norm(x)
    logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
    logits = logits.astype(jnp.float32)
    cap = self.cfg.logit_softcap
    return cap * jnp.tanh(logits / cap) if cap > 0 else logits


def _norm(x, eps=1e-6):
  xf = x.astype(jnp.float32)
  return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype)


def forward_with_importance(model: Transformer, tokens, *, segment_ids=None, positions=None):
  """(logits, importance [L,H]) in one call; the importances are popped so the model stays clean."""
  logits = model(tokens, segment_ids=segment_ids, positions=positions)
  return logits, pop_head_importance(model)


def count_params(model: nnx.Module) -> int:
  return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def param_count_formula(cfg: ModelConfig) -> int:
  """Closed-form parameter count of `Transformer` for a config (used by tests and the token budget)."""
  d, hq, hkv, hd, v = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
  attn = d * hq * hd + 2 * d * hkv * hd + hq * hd * d
  if cfg.attention == "sink":
    attn += hq
  if cfg.attention == "gated":
    w = hq if cfg.gate == "headwise" else hq * hd
    attn += d * w + w
  mlp = (3 if cfg.mlp == "swiglu" else 2) * d * cfg.mlp_ratio * d
  return v * d * (1 if cfg.tie_embeddings else 2) + cfg.num_layers * (attn + mlp)
