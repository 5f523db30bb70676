"""Linear attention: Qwen3-Next's Gated DeltaNet (`sinkjax.deltanet`) as a decoder layer's mixer, model.layer_types
"linear". No heads to balance (head importance and the aux loss skip it); its decode state is the conv window and
the recurrent state (`DeltaNetState`), which a KV cache carries for it (`sinkjax.cache.StateLayerCache`); no RoPE,
so a streaming cache evicts nothing from it."""
from __future__ import annotations

import jax.numpy as jnp

from sinkjax.errors import ConfigError
from sinkjax.deltanet import DeltaNetConfig, DeltaNetState, GatedDeltaNet
from sinkjax.kinds import MixerKind, register


def deltanet_config(cfg) -> DeltaNetConfig:
  """The Gated DeltaNet of a `ModelConfig`: model.linear_* (0 = num_heads heads of head_dim), norm_eps, dtypes."""
  return DeltaNetConfig(
      hidden_size=cfg.d_model, linear_num_key_heads=cfg.linear_key_heads or cfg.num_heads,
      linear_num_value_heads=cfg.linear_value_heads or cfg.num_heads,
      linear_key_head_dim=cfg.linear_key_head_dim or cfg.head_dim,
      linear_value_head_dim=cfg.linear_value_head_dim or cfg.head_dim,
      linear_conv_kernel_dim=cfg.linear_conv_kernel, rms_norm_eps=cfg.norm_eps, chunk_size=cfg.linear_chunk_size,
      dtype=cfg.dtype, param_dtype=cfg.param_dtype)


class LinearAttention(GatedDeltaNet):
  """`GatedDeltaNet` called as an attention layer is (`Block` does not know which it holds). With a cache view
  (`sinkjax.cache.StateLayerCache`) it continues from the view's state: T == 1 a recurrent step, T > 1 a chunk."""

  def __call__(self, x, *, segment_ids=None, positions=None, cache=None, record_trace: bool = False,
               zero_first_token_value=None):
    if cache is None:
      return super().__call__(x, segment_ids=segment_ids)
    y, state = super().__call__(x, segment_ids=segment_ids, state=cache.state)
    return y, cache.replace(state)


class Linear(MixerKind):
  name = "linear"
  heads = False
  hf_module = "linear_attn"

  def build(self, cfg, layer, rngs):
    self.check(cfg)
    return LinearAttention(deltanet_config(cfg), rngs=rngs)

  def check(self, cfg):
    """A ConfigError when the model.linear_* keys give no Gated DeltaNet (asked when the config is validated with
    this kind registered, and when a layer is built)."""
    try:
      deltanet_config(cfg)
    except ValueError as e:
      raise ConfigError(f"model.layer_types names linear layers: {e}") from None

  def init_state(self, cfg, batch):
    return _zero_state(cfg, batch)


def _zero_state(cfg, batch):
  d = deltanet_config(cfg)
  return DeltaNetState(
      jnp.zeros((batch, d.linear_conv_kernel_dim - 1, d.conv_dim), jnp.dtype(d.dtype)),
      jnp.zeros((batch, d.linear_num_value_heads, d.linear_key_head_dim, d.linear_value_head_dim), jnp.float32))


LINEAR = register(Linear())
