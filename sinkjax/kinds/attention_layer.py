"""The attention layer as a mixer: model.layer_types "full" (every key) and "sliding" (the last
model.sliding_window keys), a `sinkjax.layers.Attention` of the variant model.attention names."""
from __future__ import annotations

from sinkjax.kinds import MixerKind, register
from sinkjax.layers import Attention


class AttentionLayer(MixerKind):
  heads = True
  hf_module = "self_attn"

  def __init__(self, name: str, sliding: bool):
    self.name, self.sliding = name, sliding

  def build(self, cfg, layer, rngs):
    return Attention.from_config(cfg.attention_config(layer), rngs=rngs)


FULL = register(AttentionLayer("full", sliding=False))
SLIDING = register(AttentionLayer("sliding", sliding=True))
