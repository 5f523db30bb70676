"""`flash_attention`: attention that returns a differentiable log-sum-exp, on every backend.

One `jax.custom_vjp` wraps all the fast backends; its backward consumes the cotangents of BOTH outputs:
with D_i = rowsum(dO o O) and the LSE cotangent g_i, dS = P o (dP - D_i + g_i). This is what lets the sink and
gate terms of sink-aware training (all functions of the LSE) send gradient into q and k.

The kernel's inputs and outputs carry `jax.ad_checkpoint.checkpoint_name`s (`CHECKPOINT_NAMES`), applied inside the
forward rule so that the residuals the backward reads are the named values: a remat policy that saves
"attention_out" and "attention_lse" (`sinkjax.model.REMAT_POLICIES`) keeps them, and the kernel's forward is not
run again in the backward.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import math
import re

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from sinkjax.choices import ATTN_IMPLS
from sinkjax.kernels import local, reference
from sinkjax.kernels.blocks import BlockSizes, check_tile
from sinkjax.sharding import BATCH_AXES, HEAD_AXIS, target_platform

IMPLS = ATTN_IMPLS
_BACKEND_MODULES = {"xla": "sinkjax.kernels.xla", "pallas_tpu": "sinkjax.kernels.pallas_tpu",
                    "pallas_gpu": "sinkjax.kernels.pallas_gpu", "cudnn": "sinkjax.kernels.cudnn",
                    "mosaic_gpu": "sinkjax.kernels.mosaic_gpu"}
_HARDWARE = {"pallas_tpu": "tpu", "pallas_gpu": "gpu", "cudnn": "gpu", "mosaic_gpu": "gpu"}
# GPUs of compute capability >= 9.0 (Hopper, Blackwell) by name, for compile-only devices, which carry only a name
_HOPPER_OR_LATER = re.compile(r"\b(G?H\d{2,3}|G?B\d{3}|RTX PRO 6000 Blackwell)\b")
# Names of the flash kernel's inputs (q, k, v as attended: after QK-norm and RoPE) and outputs, for remat policies.
CHECKPOINT_NAMES = ("attention_q", "attention_k", "attention_v", "attention_out", "attention_lse")
# The name scope of the kernels' forward and backward (HLO op_name metadata): what sinkjax.bench.profile_summary counts
# as attention in a profile.
NAME_SCOPE = "sinkjax_attention"


@dataclasses.dataclass(frozen=True)
class _Static:
  impl: str
  causal: bool
  scale: float
  block_sizes: BlockSizes
  interpret: bool
  segmented: bool = True      # segment ids were given (False: all ones, which cudnn and pallas_tpu run without ids)


def _backend(impl: str):
  return importlib.import_module(_BACKEND_MODULES[impl])


def hopper_or_later(device=None) -> bool:
  """Whether `device` (default: the active mesh's device, else the default backend's first) is an NVIDIA GPU of
  compute capability >= 9.0: read from a real device's `compute_capability`, else from the name a compile-only
  device carries ("NVIDIA H100 80GB HBM3")."""
  if device is None:
    mesh = jax.sharding.get_abstract_mesh()
    device = getattr(mesh, "abstract_device", None) if not mesh.empty else None
    device = device or jax.devices()[0]
  try:
    cc = getattr(device, "compute_capability", None)
  except Exception:  # pylint: disable=broad-except   # a device of another platform may raise on unknown attributes
    cc = None
  if cc:
    return tuple(int(x) for x in str(cc).split(".")[:2]) >= (9, 0)
  return bool(_HOPPER_OR_LATER.search(getattr(device, "device_kind", "") or ""))


# Whether impl="auto" picks cuDNN on Hopper. On since the device check of 2026-11-29 (launch/gpu_measure.sh on one H200,
# docs/results/gpu_h200/): cuDNN's backward reads O only through D = rowsum(dO * O), which the LSE gradient's fold
# (sinkjax.kernels.fold) rests on, every case (GQA, packed documents, sink + aux) within the bf16 tolerance, and it is
# the fastest backend there (0.92-1.02x jax.nn.cudnn's time, 2.4-3.5x faster than pallas_gpu; the d20 step 547 ms
# against Triton's 631). False puts auto back on pallas_gpu; impl="cudnn" / "pallas_gpu" choose either explicitly.
CUDNN_IN_AUTO = True
# Whether impl="auto" picks tokamax's Mosaic-GPU kernels (`mosaic_gpu`) on Hopper and later where tokamax is installed,
# ahead of cudnn. Off after the same device run: correct (reads O only through D; every case passes) but 1.01-1.19x
# cuDNN's time at the kernel level on the H200 (tokamax has no autotuning data for that chip; its default tiles ran) and
# level at the d20 step (546.2 ms against cuDNN's 546.6), so auto keeps cuDNN (docs/PERF.md, "On an NVIDIA H200").
MOSAIC_IN_AUTO = False


def _tokamax_installed() -> bool:
  return importlib.util.find_spec("tokamax") is not None


def default_impl(platform: str | None = None, device=None) -> str:
  """The backend `impl="auto"` picks for a platform (default: the target's, `sinkjax.sharding.target_platform`):
  Pallas on TPU; on NVIDIA GPUs cuDNN on Hopper and later (`hopper_or_later`; CUDNN_IN_AUTO, on since the device
  check), Pallas (Triton) before Hopper; blockwise XLA elsewhere. `flash_attention` falls back from cudnn to
  pallas_gpu for a call cuDNN does not take (`sinkjax.kernels.cudnn.unsupported`: float32 inputs, T != S causal,
  paired segment ids)."""
  platform = platform or target_platform()
  if platform == "tpu":
    return "pallas_tpu"
  if platform in ("gpu", "cuda"):
    if MOSAIC_IN_AUTO and hopper_or_later(device) and _tokamax_installed():
      return "mosaic_gpu"
    return "cudnn" if CUDNN_IN_AUTO and hopper_or_later(device) else "pallas_gpu"
  return "xla"


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _flash_vjp(q, k, v, q_seg, kv_seg, st: _Static):
  return _fwd(q, k, v, q_seg, kv_seg, st)[0]


_SEGMENTED_KW = ("cudnn", "pallas_tpu", "mosaic_gpu")     # backends that take `segmented` (they skip the ids when False)


def _kw(st):
  kw = dict(causal=st.causal, scale=st.scale, block_sizes=st.block_sizes, interpret=st.interpret)
  if st.impl in _SEGMENTED_KW:
    kw["segmented"] = st.segmented
  return kw


def _fwd(q, k, v, q_seg, kv_seg, st):
  q, k, v = (checkpoint_name(x, name) for x, name in zip((q, k, v), CHECKPOINT_NAMES))
  with jax.named_scope(NAME_SCOPE):
    out, lse = _backend(st.impl).fwd(q, k, v, q_seg, kv_seg, **_kw(st))
  out, lse = checkpoint_name(out, CHECKPOINT_NAMES[3]), checkpoint_name(lse, CHECKPOINT_NAMES[4])
  return (out, lse), (q, k, v, q_seg, kv_seg, out, lse)


def _bwd(st, res, cts):
  q, k, v, q_seg, kv_seg, out, lse = res
  dout, dlse = cts
  with jax.named_scope(NAME_SCOPE):
    dq, dk, dv = _backend(st.impl).bwd(q, k, v, q_seg, kv_seg, out, lse, dout.astype(q.dtype),
                                       dlse.astype(jnp.float32), **_kw(st))
  return dq, dk, dv, None, None


_flash_vjp.defvjp(_fwd, _bwd)

# Called eagerly (outside any jit), a custom_vjp over the kernels' loops is traced and compiled again on every call
# (0.3 s per layer of a 2-layer toy model, ~70 s for a 30-layer forward on 2 CPU cores); through jit it is compiled
# once per shape. Inside a traced program the kernel is called directly, so compiled programs are unchanged.
_flash_eager = jax.jit(_flash_vjp, static_argnums=(5,))


def _is_eager(*xs) -> bool:
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def _segments(segment_ids, B, T, S):
  if segment_ids is None:
    return jnp.ones((B, T), jnp.int32), jnp.ones((B, S), jnp.int32)
  if isinstance(segment_ids, (tuple, list)):
    q_seg, kv_seg = segment_ids
  else:
    if T != S:
      raise ValueError(f"segment_ids of shape [B,T] needs T == S (got T={T}, S={S}); "
                       "pass a (q_segment_ids, kv_segment_ids) pair instead")
    q_seg = kv_seg = segment_ids
  if q_seg.shape != (B, T) or kv_seg.shape != (B, S):
    raise ValueError(f"segment ids must be [B,T]={B, T} and [B,S]={B, S}; got {q_seg.shape} and {kv_seg.shape}")
  return q_seg.astype(jnp.int32), kv_seg.astype(jnp.int32)


def _zero_padding(q, k, v, q_seg, kv_seg):
  """q, k, v with their padding rows (segment id 0) set to 0 by a select: a NaN or inf there cannot reach a valid row's
  output or gradient (0 * NaN is NaN in every kernel's masked matmuls), and their gradients are 0, as the contract
  says."""
  keep = lambda x, seg: jnp.where((seg != 0)[:, :, None, None], x, jnp.zeros((), x.dtype))
  return keep(q, q_seg), keep(k, kv_seg), keep(v, kv_seg)


def _check_shapes(q, k, v):
  """(B, T, S, Hq, Hkv, D) of valid q [B,T,Hq,D], k/v [B,S,Hkv,D]; a ValueError naming the mismatch otherwise."""
  if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
    raise ValueError(f"q, k, v must be [batch, time, heads, head_dim]; got {q.shape}, {k.shape}, {v.shape}")
  B, T, Hq, D = q.shape
  if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
    raise ValueError(f"k and v must be [B, S, Hkv, D] matching q {q.shape}; got k {k.shape}, v {v.shape}")
  S, Hkv = k.shape[1], k.shape[2]
  if Hq % Hkv:
    raise ValueError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")
  return B, T, S, Hq, Hkv, D


def _block_sizes(block_sizes, block_q, block_k) -> BlockSizes:
  """The BlockSizes to run with: `block_sizes` as given, or the `block_q`/`block_k` shorthand for every pass."""
  check_tile("block_q", block_q)
  check_tile("block_k", block_k)
  if block_sizes is None:
    return BlockSizes.uniform(block_q, block_k)
  if not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a sinkjax.kernels.BlockSizes; got {type(block_sizes).__name__}")
  if block_q is not None or block_k is not None:
    raise ValueError("pass either block_sizes or the block_q/block_k shorthand, not both")
  return block_sizes


def flash_attention(q, k, v, *, causal: bool = True, segment_ids=None, scale: float | None = None,
                    impl: str = "auto", interpret: bool | None = None, block_sizes: BlockSizes | None = None,
                    block_q: int | None = None, block_k: int | None = None, window: int | None = None,
                    batch_axes=BATCH_AXES, head_axis: str | None = HEAD_AXIS, platform: str | None = None):
  """Multi-head attention returning `(out, lse)`, differentiable through both.

  Args:
    q: [B, T, Hq, D] queries. k, v: [B, S, Hkv, D] keys and values, Hq % Hkv == 0 (GQA/MQA).
    causal: bottom-right aligned causal mask (query t sees keys s <= t + S - T).
    segment_ids: int [B, T] (self-attention, T == S) or a pair ([B, T], [B, S]). Tokens attend only within equal
      ids; id 0 is padding: its rows give zero output and lse = -inf, with zero (never NaN) gradients, and are read as
      zeros (a NaN in a padding row of q, k or v reaches no other row).
    scale: logit scale, default 1/sqrt(D).
    impl: "auto" | "reference" | "xla" | "pallas_tpu" | "pallas_gpu" | "cudnn" (NVIDIA, bfloat16/float16; see
      `sinkjax.kernels.cudnn` for its segment-id routes) | "mosaic_gpu" (tokamax's Pallas Mosaic-GPU kernels,
      Hopper+, bfloat16/float16, needs tokamax; off a GPU its CPU-runnable form: `sinkjax.kernels.mosaic_gpu`). "auto" = `default_impl`, with cudnn falling back to
      pallas_gpu for a call cuDNN does not take.
    interpret: Pallas interpret mode; None = only when the program is not compiled for the backend's hardware.
    platform: the platform the program is compiled for ("tpu", "gpu", "cpu"); None = the active mesh's devices' (a
      mesh of compile-only TPU devices on a CPU host says "tpu"), else the default backend's. It picks
      `impl="auto"` (pallas_tpu / cudnn or pallas_gpu / xla) and interpret mode.
    block_sizes: `BlockSizes` with separate tiles for the forward, dK/dV and dQ passes (None fields and None =
      backend defaults; see `sinkjax.kernels.blocks` for which backend reads which field).
    block_q, block_k: shorthand for `BlockSizes.uniform(block_q, block_k)`: one tile for every pass.
    window: sliding-window attention (causal only): query t also needs s > t + S - T - window. Runs the blockwise
      jnp `local` kernel (self-attention) or the reference (T != S), both differentiated by autodiff.
    batch_axes, head_axis: mesh axes the per-shard wrapper splits batch and kv heads over when a mesh is active
      (defaults: `sinkjax.sharding.BATCH_AXES`, `HEAD_AXIS`); axes the mesh lacks are skipped.

  Returns:
    out [B, T, Hq, D] in q.dtype and lse float32 [B, Hq, T] (natural log). T = 0 or S = 0: zeros and -inf (no row sees a
    key), with zero gradients, on every backend.
  """
  B, T, S, Hq, Hkv, D = _check_shapes(q, k, v)
  if impl not in IMPLS:
    raise ValueError(f"impl must be one of {IMPLS}; got {impl!r}")
  blocks = _block_sizes(block_sizes, block_q, block_k)
  batch_axes, head_axis = _mesh_axes(batch_axes, head_axis)
  scale = float(1.0 / math.sqrt(D) if scale is None else scale)
  q_seg, kv_seg = _segments(segment_ids, B, T, S)
  if T == 0 or S == 0:                  # no queries or no keys: every row sees nothing (the kernels' grids need both)
    return jnp.zeros((B, T, Hq, D), q.dtype), jnp.full((B, Hq, T), -jnp.inf, jnp.float32)
  if segment_ids is not None:
    q, k, v = _zero_padding(q, k, v, q_seg, kv_seg)
  if window:
    if not causal:
      raise ValueError("window (sliding-window attention) needs causal=True")
    if T == S:
      return local.attention(q, k, v, q_seg, kv_seg, scale=scale, window=int(window))
    return reference.attention(q, k, v, q_seg, kv_seg, causal=True, scale=scale, window=int(window))
  target = platform or target_platform()
  if impl == "auto":
    impl = default_impl(target)
    if impl == "cudnn" and _cudnn_unsupported(q, k, causal, segment_ids, T, S):
      impl = "pallas_gpu"
    if impl == "mosaic_gpu" and _mosaic_unsupported(q):
      impl = "pallas_gpu"
  if impl == "reference":
    return reference.attention(q, k, v, q_seg, kv_seg, causal=causal, scale=scale)
  if impl in _HARDWARE and jnp.float64 in (q.dtype, k.dtype, v.dtype):
    raise ValueError(f"impl={impl!r} takes float32 or bfloat16 q, k, v; got {q.dtype}, {k.dtype}, {v.dtype} (with "
                     "jax_enable_x64 on, jnp/jax.random default to float64: cast with .astype(jnp.float32))")
  if interpret is None:                 # the compile target's hardware, not the host's (a TPU step on a CPU host)
    interpret = impl in _HARDWARE and target != _HARDWARE[impl]
  st = _Static(impl, bool(causal), scale, blocks, bool(interpret), segment_ids is not None)
  if _is_eager(q, k, v, q_seg, kv_seg) and jax.sharding.get_abstract_mesh().empty:
    return _flash_eager(q, k, v, q_seg, kv_seg, st)
  fn = lambda q, k, v, q_seg, kv_seg: _flash_vjp(q, k, v, q_seg, kv_seg, st)
  return _per_shard(fn, B, Hkv, batch_axes, head_axis)(q, k, v, q_seg, kv_seg)


def _cudnn_unsupported(q, k, causal, segment_ids, T, S):
  from sinkjax.kernels import cudnn  # pylint: disable=import-outside-toplevel
  return cudnn.unsupported(q.dtype, q.shape[3], T, S, causal, pair=isinstance(segment_ids, (tuple, list)))


def _mosaic_unsupported(q):
  from sinkjax.kernels import mosaic_gpu  # pylint: disable=import-outside-toplevel
  return mosaic_gpu.unsupported(q.dtype, q.shape[3])


def _mesh_axes(batch_axes, head_axis):
  """Normalizes the wrapper's axis names: a str or a sequence of str for the batch, a str or None for heads."""
  if isinstance(batch_axes, str):
    batch_axes = (batch_axes,)
  batch_axes = tuple(batch_axes or ())
  if not all(isinstance(a, str) for a in batch_axes):
    raise ValueError(f"batch_axes must be mesh axis names (str); got {batch_axes!r}")
  if head_axis is not None and not isinstance(head_axis, str):
    raise ValueError(f"head_axis must be a mesh axis name (str) or None; got {head_axis!r}")
  if head_axis in batch_axes:
    raise ValueError(f"head_axis {head_axis!r} is also one of batch_axes {batch_axes}")
  return batch_axes, head_axis


def _per_shard(fn, batch: int, kv_heads: int, batch_axes=BATCH_AXES, head_axis: str | None = HEAD_AXIS):
  """Runs the kernel once per shard when a mesh is active (`jax.set_mesh`): batch split over `batch_axes`, kv heads
  over `head_axis`. Attention is independent per (batch row, head), so no communication is needed. Axes the mesh
  lacks (or of size 1) are skipped; without an active mesh (or when the shapes don't divide) the kernel is left to
  XLA's partitioner."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return fn
  batch_axes = tuple(a for a in batch_axes if a in mesh.axis_names and mesh.shape[a] > 1)
  head_axis = head_axis if head_axis in mesh.axis_names and mesh.shape[head_axis] > 1 else None
  n_batch = math.prod(mesh.shape[a] for a in batch_axes)
  if batch % n_batch:
    batch_axes = ()
  if head_axis and kv_heads % mesh.shape[head_axis]:
    head_axis = None
  if not batch_axes and head_axis is None:
    return fn
  P = jax.sharding.PartitionSpec
  b = batch_axes or None
  qkv, seg = P(b, None, head_axis, None), P(b, None)
  return jax.shard_map(fn, mesh=mesh, in_specs=(qkv, qkv, qkv, seg, seg),
                       out_specs=(qkv, P(b, head_axis, None)), check_vma=False)
