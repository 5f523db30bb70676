"""Where arrays live: the device mesh and every placement decision of training, in one place.

The mesh has the axes ("data", "fsdp", "tensor") from `cfg.mesh`; -1 in one of them takes the devices the others
leave. It is built with `jax.sharding.Mesh`, whose axes are *Auto*: we place the inputs and the state, and GSPMD
propagates shardings through the step. Batches are split over ("data", "fsdp"). Parameters and optimizer state are
sharded by logical axis rules (MaxText style), all in `param_spec`: each parameter gets logical axes from its path
(`logical_axes`), and `LOGICAL_RULES` maps them to mesh axes: embed -> "fsdp" (FSDP: every weight matrix is split
along d_model), heads / mlp / vocab -> "tensor". A dimension the mesh axis does not divide stays whole; vectors and
scalars are replicated. Optimizer-state leaves carry their parameter's path as a suffix (optax keeps the params
tree inside mu / nu / momentum), so they get the same spec.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sinkjax.config import ConfigError, MeshConfig

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"          # attention heads; also where the kernel's per-shard wrapper splits them


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


# Logical axis -> mesh axis. An axis missing here (or None) is not sharded.
LOGICAL_RULES = {"embed": "fsdp", "vocab": "tensor", "heads": "tensor", "q_heads": "tensor", "kv_heads": "tensor",
                 "mlp": "tensor", "expert": None}

# (path suffix, logical axes), first match wins; the suffix is matched against the end of the parameter's path.
_PARAM_AXES = (
    (("embed", "embedding"), ("vocab", "embed")),
    (("lm_head", "kernel"), ("embed", "vocab")),
    (("q_proj", "kernel"), ("embed", "q_heads")),
    (("k_proj", "kernel"), ("embed", "kv_heads")),
    (("v_proj", "kernel"), ("embed", "kv_heads")),
    (("o_proj", "kernel"), ("q_heads", "embed")),
    (("attn", "gate_proj", "kernel"), ("embed", "heads")),
    (("sink_states",), (None, "embed")),
    (("up_proj", "kernel"), ("embed", "mlp")),
    (("gate_proj", "kernel"), ("embed", "mlp")),
    (("down_proj", "kernel"), ("mlp", "embed")),
    (("router", "kernel"), ("embed", None)),
    (("gate_kernel",), ("expert", "embed", "mlp")),
    (("up_kernel",), ("expert", "embed", "mlp")),
    (("down_kernel",), ("expert", "mlp", "embed")),
)


def path_names(path) -> tuple:
  """A pytree / nnx path as plain names and indices, without nnx's trailing "value"."""
  out = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
  return out[:-1] if out and out[-1] == "value" else out


def logical_axes(path: tuple, shape: tuple) -> tuple | None:
  """The logical axes of a parameter (or of an optimizer-state leaf holding its path), or None (replicate)."""
  if len(shape) < 2:
    return None
  names = path_names(path)
  for suffix, axes in _PARAM_AXES:
    if len(axes) == len(shape) and names[-len(suffix):] == suffix:
      return axes
  return None


def param_spec(path: tuple, shape: tuple, mesh_shape=None) -> P:
  """The partition spec of one parameter (or of an optimizer-state leaf shaped like it), from its nnx path.

  `mesh_shape` ({axis: size}) lets a dimension the mesh axis does not divide stay unsharded; without it every
  rule applies. Unknown parameters, vectors and scalars are replicated.
  """
  axes = logical_axes(path, tuple(shape))
  if axes is None:
    return P()
  spec, used = [], set()
  for dim, logical in zip(shape, axes):
    mesh_axis = LOGICAL_RULES.get(logical) if logical else None
    if mesh_axis is not None and mesh_shape is not None:
      size = mesh_shape.get(mesh_axis)
      if size is None or dim % size:
        mesh_axis = None
    if mesh_axis in used:
      mesh_axis = None
    used.add(mesh_axis)
    spec.append(mesh_axis)
  while spec and spec[-1] is None:
    spec.pop()
  return P(*spec)


def state_shardings(mesh: Mesh, tree):
  """NamedShardings for a pytree of (abstract) arrays: params, optimizer state, or the whole train state."""
  def one(path, leaf):
    return NamedSharding(mesh, param_spec(path_names(path), getattr(leaf, "shape", ()), dict(mesh.shape)))
  return jax.tree_util.tree_map_with_path(one, tree)


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
