"""Where arrays live: the device mesh and every placement decision of training, in one place.

The mesh has the axes ("data", "fsdp", "tensor") from `cfg.mesh`; -1 in one of them takes the devices the others
leave. It is built with `jax.sharding.Mesh`, whose axes are *Auto*: we place the inputs and the state, and GSPMD
propagates shardings through the step. Batches are split over ("data", "fsdp"); parameters and optimizer state are
replicated for now. `param_spec` is the single function to extend for FSDP / tensor parallelism (logical axis
rules): everything else asks it.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sinkjax.config import ConfigError, MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


def make_mesh(mesh_cfg: MeshConfig, devices=None) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh over `devices` (default: all), -1 filling the remaining devices."""
  devices = list(jax.devices() if devices is None else devices)
  sizes = [mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor]
  free = [i for i, s in enumerate(sizes) if s == -1]
  if len(free) > 1 or any(s == 0 or s < -1 for s in sizes):
    raise ConfigError(f"mesh sizes must be positive with at most one -1, got data={sizes[0]} fsdp={sizes[1]} "
                      f"tensor={sizes[2]}")
  fixed = math.prod(s for s in sizes if s != -1)
  if free:
    if len(devices) % fixed:
      raise ConfigError(f"mesh: {len(devices)} devices are not divisible by the fixed axes (product {fixed})")
    sizes[free[0]] = len(devices) // fixed
  if math.prod(sizes) != len(devices):
    raise ConfigError(f"mesh data*fsdp*tensor = {math.prod(sizes)} but there are {len(devices)} devices "
                      f"(set one of mesh.data/fsdp/tensor to -1)")
  return Mesh(np.asarray(devices).reshape(sizes), AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches [B, ...]: the batch axis split over ("data", "fsdp"), the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def batch_shards(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


def param_spec(path: tuple, shape: tuple) -> P:
  """The partition spec of one parameter (or of an optimizer-state leaf shaped like it), from its nnx path.

  Replicated for now. A later change maps logical axes (embed, heads, mlp, vocab) to ("fsdp", "tensor") here.
  """
  del path, shape
  return P()


def state_shardings(mesh: Mesh, tree):
  """NamedShardings for a pytree of (abstract) arrays: params, optimizer state, or the whole train state."""
  def one(path, leaf):
    return NamedSharding(mesh, param_spec(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path),
                                          getattr(leaf, "shape", ())))
  return jax.tree_util.tree_map_with_path(one, tree)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
