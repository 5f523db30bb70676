"""Vanilla softmax attention ([Sink-MoE] eq. 1; Llama, Qwen): the implicit gate of eq. 4 is its importance."""
from __future__ import annotations

from sinkjax import attention as variants
from sinkjax.kinds import AttentionKind, register


class Vanilla(AttentionKind):
  name = "vanilla"
  skips_first_token = True          # G_t = 1 - A_{t,1} is 0 at a document's first query by construction

  def attend(self, layer, x, q, k, v, kw, kv_heads=None):
    return variants.vanilla_attention(q, k, v, **kw)

  def hf_tensors(self, cfg):
    return {}


VANILLA = register(Vanilla())
