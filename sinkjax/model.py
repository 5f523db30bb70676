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
from sinkjax.layers import MLP, Attention, MoE, RMSNorm, RopeScaling, default_positions, pop_head_importance

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def rope_scaling(cfg: ModelConfig) -> RopeScaling | None:
  if cfg.rope_scaling == "none":
    return None
  return RopeScaling(cfg.rope_scaling, cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                     cfg.rope_original_max_seq_len or cfg.max_seq_len, cfg.rope_beta_fast, cfg.rope_beta_slow,
                     cfg.rope_truncate, cfg.rope_attention_factor)


def layer_window(cfg: ModelConfig, layer: int) -> int:
  """The sliding window of layer `layer` (0 = full attention): model.layer_types, else every layer alike."""
  kind = cfg.layer_types[layer] if cfg.layer_types else "sliding"
  return cfg.sliding_window if kind == "sliding" else 0


def mlp_hidden(cfg: ModelConfig) -> int:
  return cfg.mlp_hidden or cfg.mlp_ratio * cfg.d_model


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, *, layer: int = 0, rngs: nnx.Rngs):
    dt, pdt = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
    norm = dict(eps=cfg.norm_eps, use_scale=cfg.norm_scale, param_dtype=pdt)
    self.attn_norm = RMSNorm(cfg.d_model, **norm)
    self.attn = Attention(cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, attention=cfg.attention,
                          gate=cfg.gate, qk_norm=cfg.qk_norm, rope_theta=cfg.rope_theta, sink_init=cfg.sink_init,
                          gate_bias_init=cfg.gate_bias_init, impl=cfg.attn_impl, dtype=dt, param_dtype=pdt,
                          gate_position=cfg.gate_position, gate_shared=cfg.gate_shared,
                          gate_activation=cfg.gate_activation, gate_input=cfg.gate_input,
                          sink_tokens=cfg.sink_tokens, use_bias=cfg.attn_bias, norm_scale=cfg.norm_scale,
                          norm_eps=cfg.norm_eps, rope_scaling=rope_scaling(cfg),
                          sliding_window=layer_window(cfg, layer), rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, **norm)
    mlp = dict(kind=cfg.mlp, use_bias=cfg.mlp_bias, limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha, dtype=dt,
               param_dtype=pdt, rngs=rngs)
    self.mlp = MoE(cfg.d_model, mlp_hidden(cfg), cfg.moe_experts, cfg.moe_top_k, **mlp) if cfg.moe_experts else \
        MLP(cfg.d_model, mlp_hidden(cfg), **mlp)

  def __call__(self, x, segment_ids, positions, cache=None):
    """x -> x; with a `LayerCache`, (x, updated cache)."""
    h = self.attn(self.attn_norm(x), segment_ids=segment_ids, positions=positions, cache=cache)
    h, cache = h if cache is not None else (h, None)
    x = x + h
    x = x + self.mlp(self.mlp_norm(x))
    return x if cache is None else (x, cache)


class Transformer(nnx.Module):
  """tokens [B,T] -> logits [B,T,V] (float32, soft-capped). Records per-layer head importance (see layers)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    if cfg.vocab_size < 1:
      raise ValueError("model.vocab_size must be set (the trainer fills it from the tokenizer)")
    self.cfg = cfg
    dt, pdt = DTYPES[cfg.dtype], DTYPES[cfg.param_dtype]
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, dtype=dt, param_dtype=pdt,
                           embedding_init=nnx.initializers.normal(1.0), rngs=rngs)
    self.layers = nnx.List([Block(cfg, layer=i, rngs=rngs) for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, use_scale=cfg.norm_scale, param_dtype=pdt)
    self.lm_head = None if cfg.tie_embeddings else nnx.Linear(
        cfg.d_model, cfg.vocab_size, use_bias=False, dtype=dt, param_dtype=pdt,
        kernel_init=nnx.initializers.zeros_init(), rngs=rngs)

  def __call__(self, tokens, *, segment_ids=None, positions=None, cache=None):
    """logits; with a `sinkjax.cache.KVCache`, (logits, updated cache): T == 1 decodes one token against the cache,
    T > 1 prefills an EMPTY cache with a prompt (positions 0..T-1). Generation lives in `sinkjax.generate`."""
    B, T = tokens.shape
    if positions is None:
      positions = default_positions(segment_ids, B, T)
    x = self.embed(tokens)
    if self.cfg.embed_norm:                  # nanochat normalizes the embedding output (HF models do not)
      x = _norm(x, self.cfg.norm_eps)
    if cache is not None:
      layer_caches = cache.layers(T)
      for i, block in enumerate(self.layers):
        x, layer_caches[i] = block(x, segment_ids, positions, cache=layer_caches[i])
      return self._logits(x), cache.advance(layer_caches, T)
    for block in self.layers:
      if self.cfg.remat:
        x = nnx.remat(lambda blk, h: blk(h, segment_ids, positions))(block, x)
      else:
        x = block(x, segment_ids, positions)
    return self._logits(x)

  def _logits(self, x):
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
  attn += cfg.sink_tokens * d              # learnable sink tokens (sink_states of each layer)
  if cfg.attention == "gated":            # gate heads: Hq at G1, Hkv at G2, 1 head-shared (layers.Attention)
    gh = 1 if cfg.gate_shared else (hq if cfg.gate_position == "sdpa" else hkv)
    w = gh if cfg.gate == "headwise" else gh * hd
    attn += (d * w + w) if cfg.gate_input == "dependent" else w
  if cfg.attn_bias:
    attn += hq * hd + 2 * hkv * hd + d
  if cfg.norm_scale:                       # attention/MLP norms per block (+ QK-norms); final norm below
    attn += 2 * d + (2 * hd if cfg.qk_norm else 0)
  h = mlp_hidden(cfg)
  gated = cfg.mlp != "relu2"
  mlp = (3 if gated else 2) * d * h + (((2 if gated else 1) * h + d) if cfg.mlp_bias else 0)
  if cfg.moe_experts:
    mlp = cfg.moe_experts * mlp + d * cfg.moe_experts + cfg.moe_experts     # experts + router
  final = d if cfg.norm_scale else 0
  return v * d * (1 if cfg.tie_embeddings else 2) + cfg.num_layers * (attn + mlp) + final
