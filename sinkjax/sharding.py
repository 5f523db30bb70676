"""Where arrays live: the device mesh and every placement decision of training, in one place.

The mesh has the axes ("data", "fsdp", "tensor") from `cfg.mesh`; -1 in one of them takes the devices the others
leave. It is built with `jax.sharding.Mesh`, whose axes are *Auto*: we place the inputs and the state, and GSPMD
propagates shardings through the step. Batches are split over ("data", "fsdp"). Parameters are sharded by logical
axis rules (MaxText style): each parameter names its logical axes where it is created (`logical(...)` metadata in
`sinkjax.layers` / `sinkjax.model`, e.g. a q projection ("embed", "q_heads")), and `LOGICAL_RULES`, here only, maps
them to mesh axes: embed -> "fsdp" (FSDP: every weight matrix is split along d_model), heads / mlp / vocab ->
"tensor". A dimension the mesh axis does not divide stays whole; vectors and scalars are replicated. Optimizer-state
leaves are nnx Variables with their parameter's metadata (optax maps over the params), so they get the same spec.
"""
from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sinkjax.errors import ConfigError

AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")
HEAD_AXIS = "tensor"          # attention heads; also where the kernel's per-shard wrapper splits them


def target_platform() -> str:
  """The platform the program being traced is compiled for: that of the active mesh's devices (`jax.set_mesh`;
  compile-only TPU or GPU devices on a CPU host included), else the default backend's. "tpu", "gpu" or "cpu".

  Every platform-dependent choice (the attention kernel, Pallas interpret mode, the CPU-only code paths) asks this,
  never `jax.default_backend()` alone: a step compiled for a TPU slice on a CPU host must not get the host's code."""
  mesh = jax.sharding.get_abstract_mesh()
  device = None if mesh.empty else getattr(mesh, "abstract_device", None)
  platform = device.platform if device is not None else jax.default_backend()
  return "gpu" if platform in ("cuda", "rocm") else platform


def per_batch_shard(fn, batch: int):
  """`fn(x, weights)` run once per batch shard when a mesh is active (`jax.set_mesh`): x [B, ...] split over the
  mesh's batch axes, `weights` (a pytree) whole on every shard (gathered first where sharded, as FSDP does anyway),
  the output split like x. For computations that are independent per row but whose shapes are not (a sort of the
  tokens, `ragged_dot`), which XLA's partitioner would otherwise run on the whole gathered batch everywhere. The
  weights' cotangents are summed over the shards (shard_map's transpose of an unsplit input). Without an active
  mesh, with no batch axis of size > 1, or when B does not divide, `fn` itself."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn
  axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names and mesh.shape[a] > 1)
  if not axes or batch % math.prod(mesh.shape[a] for a in axes):
    return fn
  return jax.shard_map(fn, mesh=mesh, in_specs=(P(axes), P()), out_specs=P(axes), check_vma=False)


def mesh_platform(mesh: Mesh) -> str:
  """The platform of a concrete mesh's devices ("tpu", "gpu" or "cpu")."""
  platform = mesh.devices.flat[0].platform
  return "gpu" if platform in ("cuda", "rocm") else platform


def make_mesh(mesh_cfg, devices=None) -> Mesh:
  """A ("data", "fsdp", "tensor") mesh over `devices` (default: all) of the sizes of `mesh_cfg` (a
  `sinkjax.config.MeshConfig`: .data, .fsdp, .tensor), -1 filling the remaining devices."""
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


# mesh.collective_matmul -> XLA:TPU compile options. Passed per program (`jax.jit(compiler_options=...)`), not through
# LIBTPU_INIT_ARGS, which libtpu reads once when it starts and applies to every program of the process: so one
# process (`sinkjax.compile --vary`) can compile both, and a user's LIBTPU_INIT_ARGS cannot silently undo the setting.
COLLECTIVE_MATMUL_OPTIONS = {
    "gather": {"xla_tpu_enable_windowed_einsum_for_all_gather": False,
               "xla_tpu_enable_windowed_einsum_for_reduce_scatter": False},
    "windowed": {"xla_tpu_enable_windowed_einsum_for_all_gather": True,
                 "xla_tpu_enable_windowed_einsum_for_reduce_scatter": True},
}


def compiler_options(collective_matmul: str, mesh: Mesh | None) -> dict | None:
  """The XLA compile options of a program on `mesh` (`jax.jit(..., compiler_options=)`): on TPU, those of the
  `mesh.collective_matmul` setting; elsewhere, or for arrays on no mesh, none (other compilers refuse XLA:TPU's
  options). The train and eval steps, `sinkjax.eval`'s batch functions and the Generator's steps all take them."""
  if mesh is None or mesh_platform(mesh) != "tpu":
    return None
  return dict(COLLECTIVE_MATMUL_OPTIONS[collective_matmul])


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Batches [B, ...]: the batch axis split over ("data", "fsdp"), the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES))


def batch_shards(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"]


# Logical axis -> mesh axis. An axis missing here (or None) is not sharded.
LOGICAL_RULES = {"embed": "fsdp", "vocab": "tensor", "heads": "tensor", "q_heads": "tensor", "kv_heads": "tensor",
                 "mlp": "tensor", "expert": None}

def logical(*axes) -> dict:
  """Variable metadata naming a parameter's logical axes (one per dimension; None = never sharded), given where the
  parameter is created: `nnx.Param(value, **logical("expert", "embed", "mlp"))`, `nnx.Linear(...,
  kernel_metadata=logical("embed", "mlp"))`. Optimizer-state leaves shaped like a parameter (optax maps over the
  params' nnx.Variables) carry the same metadata, so they are placed like it. No sharding happens at creation."""
  return {"out_sharding": tuple(axes), "eager_sharding": False}


def optimizer_group(group: str) -> dict:
  """Variable metadata putting a parameter in an optimizer group of `sinkjax.optim` (matrix | scalar | embed |
  unembed) whatever its path and shape, given where it is created like `logical`:
  `nnx.Param(value, **logical(None, None), **optimizer_group("scalar"))` (a depthwise conv kernel is no matrix for
  Muon). Read by `sinkjax.optim.param_labels`."""
  return {"optimizer_group": group}


def path_names(path) -> tuple:
  """A pytree / nnx path as plain names and indices, without nnx's trailing "value"."""
  out = tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)
  return out[:-1] if out and out[-1] == "value" else out


def logical_axes(leaf) -> tuple | None:
  """The logical axes recorded on a parameter (an nnx.Variable, or any leaf), or None (replicate)."""
  if not isinstance(leaf, nnx.Variable):
    return None
  axes = leaf.get_metadata().get("out_sharding")
  return tuple(axes) if axes else None


def mesh_spec(axes: tuple | None, shape: tuple, mesh_shape=None) -> P:
  """Logical axes -> a PartitionSpec by `LOGICAL_RULES`. `mesh_shape` ({axis: size}) lets a dimension the mesh
  axis does not divide stay whole; a mesh axis is used once; no axes (vectors, scalars, unknown) = replicated."""
  if axes is None or len(axes) != len(shape):
    return P()
  spec, used = [], set()
  for dim, name in zip(shape, axes):
    mesh_axis = LOGICAL_RULES.get(name) if name else None
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
  """NamedShardings for a pytree holding nnx Variables (params, optimizer state, the whole train state, concrete or
  abstract), each from the logical axes its parameter was created with; other leaves are replicated."""
  def one(leaf):
    if isinstance(leaf, nnx.Variable) and not hasattr(leaf.get_value(), "shape"):
      return jax.tree.map(lambda _: replicated(mesh), leaf)        # e.g. optax's MaskedNode: keep its structure
    shape = tuple(getattr(leaf, "shape", ()))
    sharding = NamedSharding(mesh, mesh_spec(logical_axes(leaf), shape, dict(mesh.shape)))
    return leaf.replace(sharding) if isinstance(leaf, nnx.Variable) else sharding
  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


# ---------------------------------------------------------------------------------------------------------------
# Where a placed model lives: its mesh, its bytes per device, the devices' peak memory
# ---------------------------------------------------------------------------------------------------------------

def mesh_of(tree) -> Mesh | None:
  """The mesh of the first array of `tree` placed with a NamedSharding (None when no array is)."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding):
      return sharding.mesh
  return None


def bytes_per_device(tree) -> dict[int, int]:
  """{device id: bytes} of the arrays of `tree` held by each of this process' devices, summed over the shards each
  array's sharding puts there (`addressable_shards`); a replicated array counts whole on every device."""
  out: dict[int, int] = {}
  for leaf in jax.tree.leaves(tree):
    for shard in getattr(leaf, "addressable_shards", ()):
      out[shard.device.id] = out.get(shard.device.id, 0) + shard.data.nbytes
  return out


def peak_device_memory(devices=None) -> int | None:
  """The largest `peak_bytes_in_use` of this process' devices (`device.memory_stats()`), or None where the backend
  keeps no statistics (CPU)."""
  peaks = []
  for device in jax.local_devices() if devices is None else devices:
    stats = device.memory_stats() or {}
    if "peak_bytes_in_use" in stats:
      peaks.append(int(stats["peak_bytes_in_use"]))
  return max(peaks) if peaks else None


def placement(tree) -> dict:
  """Where the arrays of `tree` (a model's parameters) live, for reports: mesh ({axis: size}, null when not on a
  mesh), param_bytes (all of them, once), param_bytes_per_device (the most any of this process' devices holds, from
  the shardings) and peak_device_memory (bytes, `peak_device_memory`; null on backends without statistics)."""
  mesh = mesh_of(tree)
  per_device = bytes_per_device(tree)
  return {"mesh": None if mesh is None else {k: int(v) for k, v in mesh.shape.items()},
          "param_bytes": int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))),
          "param_bytes_per_device": max(per_device.values()) if per_device else 0,
          "peak_device_memory": peak_device_memory()}


def put_global(x, sharding):
  """A host array that every process holds whole (the same value) as a global jax.Array placed by `sharding`: each
  process fills only its own devices' shards (`jax.device_put` of one process' value cannot span processes)."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])
