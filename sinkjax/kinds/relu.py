"""ReLU attention ([Sink-MoE]'s non-softmax control): weights ReLU(q.k / sqrt(D)) / T, no normalization."""
from __future__ import annotations

import jax.numpy as jnp

from sinkjax import attention as variants
from sinkjax.errors import ConfigError
from sinkjax.kinds import AttentionKind, register


class Relu(AttentionKind):
  name = "relu"
  softmax = False

  def check(self, cfg):
    for key in ("sliding_window", "sink_tokens"):
      if getattr(cfg, key):
        raise ConfigError(f"model.{key} needs a softmax variant (vanilla, sink or gated), got relu")

  def attend(self, layer, x, q, k, v, kw, kv_heads=None):
    return variants.relu_attention(q, k, v, segment_ids=kw.get("segment_ids"))

  def weights(self, layer, q, k, seg):
    B, T, Hq, _ = q.shape
    return variants.relu_attention_weights(q, k, segment_ids=seg), jnp.zeros((B, T, Hq), jnp.float32)


RELU = register(Relu())
