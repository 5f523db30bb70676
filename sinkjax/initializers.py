"""How a block's weight matrices start (model.init), for every module that creates one: the attention projections
and the MLP (`sinkjax.layers`) and the gate projection of gated attention (`sinkjax.kinds.gated`)."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def matrix_init(init: str, fan_in: int) -> dict:
  """kernel_init for the input-side matrices of a block: nanochat's uniform(-s, s), s = sqrt(3 / fan_in) (std
  1/sqrt(fan_in), no outliers), or flax's default (lecun normal, the same std, truncated) for init="default"."""
  if init == "default":
    return {}
  s = math.sqrt(3.0 / fan_in)
  return {"kernel_init": lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -s, s)}
