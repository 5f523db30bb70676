"""Placing imported parameters: each one, as it is read, straight into its sharding on a mesh.

The converters read a checkpoint tensor by tensor and hand each parameter to a `Placer`: with a mesh, the parameter
goes into the NamedSharding of the logical axes it was created with (`sharding.state_shardings` of the abstract model,
as training places it: FSDP over d_model, tensor over heads / MLP / vocab) through `jax.make_array_from_callback`, so
every device receives only its own slice and, under jax.distributed, each process fills only its own devices; without
one, whole on the default device (what a one-chip import always did). No device ever holds a whole copy of a
sharded parameter, and the host holds one checkpoint tensor (plus its transform) at a time.

The placer keeps its own accounting (`LoadInfo`): the parameter bytes placed on each device, summed over each placed
array's `addressable_shards`, and the most host memory the converter's arrays held at once (`HostMeter`).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from sinkjax import sharding as sharding_lib
from sinkjax.config import MeshConfig
from sinkjax.convert import ConvertError
from sinkjax.model import Transformer


def resolve_mesh(mesh) -> Mesh | None:
  """None (the default device), a `jax.sharding.Mesh` of the ("data", "fsdp", "tensor") axes, or a MeshConfig (the
  mesh.* keys, built over all devices by `sharding.make_mesh`)."""
  if mesh is None or isinstance(mesh, Mesh):
    return mesh
  if isinstance(mesh, MeshConfig):
    return sharding_lib.make_mesh(mesh)
  raise ValueError(f"mesh must be None, a MeshConfig or a jax.sharding.Mesh, got {type(mesh).__name__}")


@dataclasses.dataclass(frozen=True)
class LoadInfo:
  """What placing a model took, as the placer counted it.

  mesh: {axis: size} of the mesh the parameters went to (None: whole on the default device).
  param_bytes: every parameter, once. device_bytes: {device id: bytes of parameter shards placed there}, over this
    process' devices. host_peak_bytes: the most the converter's host arrays held at once: the checkpoint tensor(s)
    of one parameter as read (with, for a moment, their stored form while converted to the parameter dtype) and the
    copies its transform made (a transpose or a fused split is a view; an experts stack or an MXFP4 dequantization is
    a copy). host_peak_tensor: the checkpoint tensor(s) being read then.
  """
  mesh: dict | None
  param_bytes: int
  device_bytes: dict
  host_peak_bytes: int
  host_peak_tensor: str

  @property
  def device_peak_bytes(self) -> int:
    """The most parameter bytes any one of this process' devices holds."""
    return max(self.device_bytes.values(), default=0)

  def summary(self) -> str:
    where = "the default device" if self.mesh is None else \
        "mesh " + " ".join(f"{k}={v}" for k, v in self.mesh.items())
    return (f"{self.param_bytes:,} parameter bytes placed on {where}, at most {self.device_peak_bytes:,} per device; "
            f"the host held at most {self.host_peak_bytes:,} bytes at once ({self.host_peak_tensor})")

  def as_dict(self) -> dict:
    return {"mesh": self.mesh, "param_bytes": self.param_bytes, "param_bytes_per_device": self.device_peak_bytes,
            "host_peak_bytes": self.host_peak_bytes, "host_peak_tensor": self.host_peak_tensor}


class HostMeter:
  """The bytes of host arrays a converter holds at once, and the most it held (with what it was reading then)."""

  def __init__(self):
    self.held, self.peak, self.at = 0, 0, ""

  def hold(self, nbytes: int, what: str, transient: int = 0) -> None:
    """`nbytes` more are held from now on; `transient` more were held for a moment on the way (a tensor's stored
    form while it is converted)."""
    if self.held + nbytes + transient > self.peak:
      self.peak, self.at = self.held + nbytes + transient, what
    self.held += nbytes

  def release(self) -> None:
    """Everything held so far is dropped (the parameter it made is placed)."""
    self.held = 0


def fresh_bytes(outputs, inputs) -> int:
  """Bytes of the `outputs` that are not views of the `inputs` (what a transform newly allocated)."""
  return sum(o.nbytes for o in outputs if not any(np.may_share_memory(o, i) for i in inputs))


class Placer:
  """Puts the parameters of a `Transformer` of config `m` where they belong, one at a time (module docstring); the
  abstract model (`nnx.eval_shape`) gives each parameter's shape and logical axes, so nothing is materialized first.
  `put` every parameter, then `model()`."""

  def __init__(self, m, mesh: Mesh | None = None):
    abstract = nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0)))
    self.graphdef, state, self.rest = nnx.split(abstract, nnx.Param, ...)
    self.abstract = dict(nnx.to_flat_state(state))
    self.shardings = {} if mesh is None else \
        {p: v.get_value() for p, v in nnx.to_flat_state(sharding_lib.state_shardings(mesh, state))}
    self.mesh = mesh
    self.dtype = jnp.dtype(m.param_dtype)
    self.host = HostMeter()
    self.placed: dict = {}
    self.device_bytes: dict[int, int] = {}

  def put(self, path: tuple, value: np.ndarray) -> None:
    """Places the host array `value` as the parameter at `path` (in the model's param_dtype)."""
    var = self.abstract[path]
    assert value.shape == var.shape, f"{path}: checkpoint shape {value.shape} != model shape {var.shape}"
    value = np.asarray(value).astype(self.dtype, copy=False)
    sharding = self.shardings.get(path)
    if sharding is None:
      array = jnp.asarray(value)
    else:           # each device's slice only, copied from the host array; other processes' devices are skipped
      array = jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])
    for shard in array.addressable_shards:
      self.device_bytes[shard.device.id] = self.device_bytes.get(shard.device.id, 0) + shard.data.nbytes
    self.placed[path] = var.replace(array)

  def model(self):
    """(the Transformer holding the placed parameters, LoadInfo). ConvertError if a parameter was never put."""
    missing = [".".join(map(str, p)) for p in self.abstract if p not in self.placed]
    if missing:
      raise ConvertError(f"no weights for the model parameters {', '.join(missing[:3])}")
    leaves = [(p, self.placed[p]) for p in self.abstract]
    model = nnx.merge(self.graphdef, nnx.from_flat_state(leaves), self.rest)
    info = LoadInfo(mesh=None if self.mesh is None else {k: int(v) for k, v in self.mesh.shape.items()},
                    param_bytes=int(sum(np.prod(v.shape) * self.dtype.itemsize for v in self.abstract.values())),
                    device_bytes=dict(sorted(self.device_bytes.items())), host_peak_bytes=self.host.peak,
                    host_peak_tensor=self.host.at)
    return model, info
