"""Sink attention (GPT-OSS, [Sink-MoE] eq. 3): a learned logit per head joins the softmax with a zero value."""
from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from sinkjax import attention as variants
from sinkjax.cache import query_heads, take_heads
from sinkjax.kinds import AttentionKind, register


class Sink(AttentionKind):
  name = "sink"
  options = ("sink_init",)          # set on another variant, refused (`AttentionKind.options`)

  def parameters(self, layer, cfg, rngs):
    """`sink` [Hq], initialized to model.sink_init (a vector: AdamW at the scalar rate)."""
    layer.sink = nnx.Param(jnp.full((cfg.num_heads,), cfg.sink_init, jnp.dtype(cfg.param_dtype)))

  def attend(self, layer, x, q, k, v, kw, kv_heads=None):
    heads = None if kv_heads is None else query_heads(kv_heads, layer.num_heads // layer.num_kv_heads)
    return variants.sink_attention(q, k, v, take_heads(layer.sink[...], heads, 0), **kw)

  def outside_columns(self, layer, q, B, Hq, T):
    return [jnp.broadcast_to(layer.sink[...].astype(jnp.float32)[None, :, None, None], (B, Hq, T, 1))]

  def hf_tensors(self, cfg):
    return {"sinks": (("sink",), False)}         # GPT-OSS's `self_attn.sinks`


SINK = register(Sink())
