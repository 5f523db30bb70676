"""Layer kinds: what a decoder block mixes its tokens with, one registered spec each.

Two registries, both open to users (`register`):
- `ATTENTION`: the softmax-family variants of `sinkjax.layers.Attention` (vanilla, sink, gated, relu), chosen by
  `model.attention`. They share the layer's q/k/v/o projections, RoPE, QK-norm, sink tokens and KV caches; an
  `AttentionKind` adds what is its own: its parameters (the sink logit, the gate), its attention (over the flash
  kernel), the per-head gate G it reports as head importance (eq. 4), the extra columns of its materialized weights,
  its transformers tensor names and its config checks. One module each: `kinds.vanilla`, `kinds.sink`,
  `kinds.gated`, `kinds.relu`.
- `MIXERS`: what a layer of `model.layer_types` holds: "full" and "sliding" are the attention layer above (with or
  without its sliding window), "linear" is Gated DeltaNet (`kinds.linear`, Qwen3-Next's linear attention). A
  `MixerKind` builds the module, says whether it has heads to balance (head importance and the aux loss skip layers
  without), gives its decode state when it is not a KV cache (the recurrent state of linear attention) and its
  transformers module name.

A new kind is one module that defines its class and calls `register(...)`; nothing else switches on kind names.
Optimizer groups are labelled where a parameter is created (`sinkjax.sharding.optimizer_group("scalar")` as
Variable metadata, read by `sinkjax.optim.param_labels`), like logical axes.

This module is the floor the kinds stand on: the registries and the base classes, importing nothing of sinkjax (and
no jax), so `sinkjax.config` asks it which kinds exist, what each refuses and which mixer a layer has
(`ModelConfig.mixer`, which `sinkjax.cache` asks for a layer's own decode state). The built-in kinds import it and register when they are imported: the attention
variants by `sinkjax.layers`, which runs them (a standalone `Attention(..., attention="sink")` needs nothing else),
the mixers by `sinkjax.model`, which builds its layers from them. `sinkjax.choices` names the built-ins a config may
use before they are imported.
"""
from __future__ import annotations

from typing import Any

ATTENTION: dict[str, "AttentionKind"] = {}
MIXERS: dict[str, "MixerKind"] = {}


def register(kind):
  """Adds an `AttentionKind` or `MixerKind` instance to its registry under `kind.name` (replacing one of that name)
  and returns it. Registering at import time of the kind's module is enough: configs name it from then on."""
  if not kind.name:
    raise ValueError(f"{type(kind).__name__} needs a name to be registered")
  table = ATTENTION if isinstance(kind, AttentionKind) else MIXERS if isinstance(kind, MixerKind) else None
  if table is None:
    raise TypeError(f"register takes an AttentionKind or a MixerKind, got {type(kind).__name__}")
  table[kind.name] = kind
  return kind


def attention_kind(name: str) -> "AttentionKind":
  """The registered attention variant `name` (a one-line error naming the registered ones otherwise)."""
  if name not in ATTENTION:
    raise ValueError(f"model.attention must be one of {'|'.join(ATTENTION)}, got {name!r}")
  return ATTENTION[name]


class AttentionKind:
  """One softmax-family variant of `sinkjax.layers.Attention`. The defaults are plain softmax attention."""
  name: str = ""
  softmax: bool = True              # sliding windows and learnable sink tokens need a softmax over the keys
  skips_first_token: bool = False   # its gate is 0 at a document's first query by construction (vanilla, eq. 4)
  options: tuple = ()               # model.* keys only this variant reads (an error elsewhere when changed)

  def check(self, cfg) -> None:
    """Refuses an `AttentionConfig` this variant cannot run (a `sinkjax.errors.ConfigError`, one line naming the
    key). Called when the config is validated (once the kind is registered) and when a layer is built."""

  def parameters(self, layer, cfg, rngs) -> None:
    """Adds the variant's own parameters to the layer (as attributes: their names are the checkpoint paths)."""

  def values(self, layer, x, v):
    """The values the layer stores and attends (G2 gates them where they are made); v by default."""
    return v

  def attend(self, layer, x, q, k, v, kw: dict, kv_heads=None):
    """(out [B,T,Hq,D], gate G [B,T,Hq] or [B,T,Hq,D]) over the flash kernel; kw: segment_ids, impl and the
    window / sink-token prefix the layer sets. kv_heads: q, k, v hold only these KV heads (a head group)."""
    raise NotImplementedError(f"attention kind {self.name!r} defines no attend")

  def outside_columns(self, layer, q, B: int, Hq: int, T: int) -> list:
    """Columns [B,Hq,T,n] of the materialized softmax beyond the sequence and sink-token keys (the sink logit)."""
    return []

  def weights(self, layer, q, k, seg):
    """Materialized weights when they are not a softmax over the keys (ReLU attention): (A [B,Hq,T,T], outside
    [B,T,Hq]); None for a softmax variant."""
    return None

  def hf_tensors(self, cfg) -> dict | None:
    """Extra transformers tensors of this variant (after `self_attn.`): {HF name: (path in the layer, transpose?)};
    None when transformers has no model with this variant."""
    return None


class MixerKind:
  """What one decoder layer mixes tokens with. `build` returns an nnx.Module called as `Attention` is:
  `mixer(x, segment_ids=, positions=, cache=, record_trace=, zero_first_token_value=)` -> y, or (y, new cache view) with a cache."""
  name: str = ""
  heads: bool = False               # sows `head_importance` [H] per call (balanced by the aux loss)
  hf_module: str = ""               # transformers' module in a decoder layer (self_attn | linear_attn)

  def build(self, cfg, layer: int, rngs):
    raise NotImplementedError(f"mixer kind {self.name!r} defines no build")

  def check(self, cfg) -> None:
    """Refuses a `ModelConfig` this mixer cannot run (one line naming the key)."""

  def init_state(self, cfg, batch: int) -> Any:
    """The decode state of one such layer for `batch` rows when it is not a KV cache; None: the layer uses the KV
    cache (`sinkjax.cache`)."""
    return None


def mixer_of(cfg, layer: int) -> MixerKind:
  """The mixer of layer `layer` of a `ModelConfig`: its model.layer_types entry ("full" when the list is empty)."""
  kind = cfg.layer_types[layer] if cfg.layer_types else "full"
  if kind not in MIXERS:
    raise ValueError(f"model.layer_types entries must be {'|'.join(MIXERS)}, got {kind!r}")
  return MIXERS[kind]


def head_layers(cfg) -> tuple:
  """Indices of the layers with heads to balance (their importances stack to [len, H] in layer order)."""
  return tuple(i for i in range(cfg.num_layers) if mixer_of(cfg, i).heads)

