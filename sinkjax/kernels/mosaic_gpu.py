"""Flash attention through tokamax's Pallas Mosaic-GPU kernels (Hopper, Blackwell), with the LSE gradient.

Implements the backend contract stated in `xla.py` (and used by `flash.py`):
  fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes, interpret, segmented) -> (out, lse)
  bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes, interpret, segmented)

The kernels are tokamax's (`tokamax._src.ops.attention.pallas_mosaic_gpu`: the FA3-class forward on sm80/90/100 and
`pallas_mosaic_gpu_vjp`: the backward on sm90/100, bfloat16 / float16), called as two ops rather than through their
`custom_vjp`, whose backward drops the LSE cotangent (`op.Op.__call__` keeps `dout[0]`):
  * forward with residuals: (out, (m, l)), m the row max of the scaled logits in natural log, l the softmax
    denominator relative to exp(m) (the sm90 kernel stores m_i / log2(e) and l_i), so the contract's
    lse = m + log l.
  * backward: vjp((m, l), O, dO, q, k, v, **the forward's arguments). Given (m = lse, l = 1) it forms the same
    P = exp(s - lse), and it reads O only through D = rowsum(dO o O): the sm90 backward computes
    `delta = einsum("qhd,qhd->hq", out, dout)` in JAX before its two kernels and passes the kernels delta, never out
    (`pallas_mosaic_gpu_vjp_kernel_sm90.flash_attention_vjp_kernel`, tokamax 0.0.17). The LSE cotangent g therefore
    enters through a substitute output O' with rowsum(dO o O') = D - g (`sinkjax.kernels.fold`), as for cuDNN; the
    device check (`python -m sinkjax.bench.kernel_check`) confirms it on the GPU (gradients unchanged by O + w, w
    orthogonal to dO).

Masks. tokamax takes per-query key ranges [k_start, k_end) beside its causal mask (bottom-right aligned here:
offset S - T). Packed documents are contiguous runs of equal segment ids, so a query's keys start at its document's
first position and end after its last: route 0 (no ids, or one non-padding segment per row) runs the plain causal
kernel, route 1 (self-attention, every id one contiguous run) the key-range kernel, and anything else (paired q / kv
ids, an id in two runs) sinkjax's blockwise `xla` backend, picked per call at run time (`lax.switch`). Rows with no
visible key (padding, id 0) are set to the contract's (out 0, lse -inf, zero gradients).

Off the GPU (`interpret=True`: tests on a CPU) the same two calls run the op's CPU-runnable form: tokamax's own XLA
forward (`base.DotProductAttention`, which returns the same residuals (m, l)) and `_cpu_vjp`, FlashAttention-2's
backward over the same tokamax mask that, like the sm90 backward, reads O only through D. This checks everything
sinkjax adds (the residual conversion, the key ranges, GQA, the fold) against the float64 oracle on any machine; the
Mosaic kernels themselves run only on a GPU (lowered for a compile-only H100 in tests/test_mosaic_gpu.py). tokamax's
own XLA backward cannot stand in: it differentiates the forward again and never reads O, so a folded O' changes
nothing there.

tokamax (Python >= 3.12, jax >= 0.11.1) is imported lazily: other backends never need it.
"""
from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
from jax import lax

from sinkjax.kernels import fold, segments
from sinkjax.kernels.blocks import BlockSizes

_F32 = jnp.float32
CUSTOM_CALLS = ("mosaic_gpu",)     # what its kernels lower to (custom calls `mosaic_gpu_v2` on jax 0.12)


def _tokamax():
  """(base, forward op module, vjp op module, gpu_utils, config) of tokamax, or an ImportError saying how to get it."""
  try:
    # pylint: disable=import-outside-toplevel
    from tokamax._src import config as tk_config
    from tokamax._src import gpu_utils
    from tokamax._src.ops.attention import base, pallas_mosaic_gpu, pallas_mosaic_gpu_vjp
  except ImportError as e:
    raise ImportError("impl='mosaic_gpu' needs tokamax (Python >= 3.12, jax >= 0.11.1): pip install 'tokamax>=0.0.17' "
                      f"(or pick impl='cudnn' / 'pallas_gpu'); import failed: {e}") from e
  return base, pallas_mosaic_gpu, pallas_mosaic_gpu_vjp, gpu_utils, tk_config


def unsupported(q_dtype, head_dim: int) -> str | None:
  """Why the Mosaic-GPU kernels cannot run this call (None if they can)."""
  if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"the Mosaic-GPU backward takes bfloat16 or float16 q, k, v; got {jnp.dtype(q_dtype).name}"
  if head_dim % 8 or head_dim > 256:
    return f"the Mosaic-GPU kernels need a head dim <= 256 and a multiple of 8; got {head_dim}"
  return None


@contextlib.contextmanager
def _hopper_target(gpu_utils, tk_config):
  """tokamax picks its sm90 kernels from the default device's compute capability. A compile-only H100 (an abstract
  mesh on a CPU host) has none: there it is told it targets sm90 (tokamax's own `cross_compile` switch lifts the
  device check). On a real GPU nothing changes."""
  if jax.devices()[0].platform == "gpu":
    yield
    return
  saved = gpu_utils.is_sm80, gpu_utils.is_sm90, gpu_utils.is_sm100
  gpu_utils.is_sm80, gpu_utils.is_sm90, gpu_utils.is_sm100 = (lambda d=None: False), (lambda d=None: True), \
      (lambda d=None: False)
  try:
    with tk_config.cross_compile(True):
      yield
  finally:
    gpu_utils.is_sm80, gpu_utils.is_sm90, gpu_utils.is_sm100 = saved


def _mask(base, q_seg, T: int, S: int, causal: bool, ranged: bool):
  """tokamax's Mask: bottom-right causal (offset S - T) and, for packed documents, each query's document as its key
  range [start, end) (k_start, k_end [B, 1, T]; padding queries get an empty range)."""
  causal_mask = base.CausalMask(offset=S - T) if causal else None
  if not ranged:
    return base.Mask(causal_mask=causal_mask)
  start, end = segments.document_ranges(q_seg)
  return base.Mask(causal_mask=causal_mask, k_start=start[:, None, :], k_end=end[:, None, :])


def _visible(q_seg, T: int, S: int, causal: bool, ranged: bool):
  """[B, 1, T]: whether a query sees any key (the contract's rows with lse -inf are those that see none)."""
  t = jnp.arange(T, dtype=jnp.int32)[None, :]
  lo, hi = segments.document_ranges(q_seg) if ranged else (jnp.zeros_like(q_seg), jnp.full_like(q_seg, S))
  if causal:
    hi = jnp.minimum(hi, t + (S - T) + 1)
  return (hi > lo)[:, None, :]


def _cpu_vjp(residuals, out, dout, q, k, v, *, mask, logits_scale, **_):
  """FlashAttention-2's backward in XLA over tokamax's mask and residuals (m, l), reading O only through
  D = rowsum(dO o O): the CPU-runnable form of the Mosaic-GPU backward's arithmetic (`dS = P o (dP - D)`)."""
  m, l = residuals                                                            # [B, H, T]
  B, T, Hq, _ = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  rep = Hq // Hkv                                       # tokamax's GQA: query heads [g * rep, (g + 1) * rep) see kv g
  kr, vr = (jnp.repeat(x.astype(_F32), rep, axis=2) for x in (k, v))
  qf, of, dof = q.astype(_F32), out.astype(_F32), dout.astype(_F32)
  s = jnp.einsum("bqhd,bkhd->bhqk", qf, kr) * logits_scale
  allowed = mask.as_array(T, S)                         # None for an empty mask (non-causal, no key ranges): all
  allowed = True if allowed is None else allowed
  p = jnp.where(allowed, jnp.exp(s - m[..., None]) / l[..., None], 0.0)
  delta = jnp.einsum("bqhd,bqhd->bhq", of, dof)                               # D: the only use of O
  dp = jnp.einsum("bqhd,bkhd->bhqk", dof, vr)
  ds = p * (dp - delta[..., None])
  dq = jnp.einsum("bhqk,bkhd->bqhd", ds, kr) * logits_scale
  dk = jnp.einsum("bhqk,bqhd->bkhd", ds, qf) * logits_scale
  dv = jnp.einsum("bhqk,bqhd->bkhd", p, dof)
  group = lambda x: x.reshape(B, S, Hkv, rep, -1).sum(axis=3)
  return dict(q=dq.astype(q.dtype), k=group(dk).astype(k.dtype), v=group(dv).astype(v.dtype))


def _ops(interpret: bool):
  """(forward op, vjp function, context): the Mosaic-GPU ops, or off the GPU their CPU-runnable form."""
  base, mgpu, mvjp, gpu_utils, tk_config = _tokamax()
  if interpret:
    return base, base.DotProductAttention(), _cpu_vjp, contextlib.nullcontext()
  return base, mgpu.PallasMosaicGpuFlashAttention(), mvjp.PallasMosaicGpuFlashAttentionVjp(), \
      _hopper_target(gpu_utils, tk_config)


def _op_kwargs(base, q_seg, T, S, causal, scale, ranged):
  return dict(mask=_mask(base, q_seg, T, S, causal, ranged), logits_scale=float(scale))


def _kernel_fwd(q, k, v, q_seg, *, causal, scale, interpret, ranged):
  T, S = q.shape[1], k.shape[1]
  base, op, _, ctx = _ops(interpret)
  with ctx:
    out, (m, l) = op(q, k, v, return_residuals=True, **_op_kwargs(base, q_seg, T, S, causal, scale, ranged))
  lse = m.astype(_F32) + jnp.log(l.astype(_F32))
  seen = _visible(q_seg, T, S, causal, ranged)                                  # [B, 1, T]
  lse = jnp.where(seen, lse, -jnp.inf)
  out = jnp.where(jnp.swapaxes(seen, 1, 2)[..., None], out, 0).astype(q.dtype)
  return out, lse


def _kernel_bwd(q, k, v, q_seg, out, lse, dout, g, *, causal, scale, interpret, ranged):
  T, S = q.shape[1], k.shape[1]
  base, _, vjp, ctx = _ops(interpret)
  o2, do2 = fold.fold_lse_cotangent(out, dout, g, q.dtype)
  finite = jnp.isfinite(lse)
  # P = exp(s - lse) / 1; rows with no visible key get m = +inf, so P = 0 there (tokamax pads its own rows so)
  residuals = (jnp.where(finite, lse, jnp.inf), jnp.ones_like(lse))
  kw = _op_kwargs(base, q_seg, T, S, causal, scale, ranged)
  with ctx:
    if interpret:
      grads = vjp(residuals, o2, do2, q, k, v, **kw)
    else:
      grads = vjp(residuals, o2, do2, q, k, v, **_bound(base, q, k, v, kw))
  return grads["q"], grads["k"], grads["v"]


def _bound(base, q, k, v, kw):
  """The forward op's canonical arguments (precision, logits dtype, ...), as tokamax hands them to its vjp."""
  bound = dict(base.DotProductAttention().bind(q, k, v, **kw).kwargs)
  bound.pop("return_residuals", None)
  return bound


def _fallback():
  from sinkjax.kernels import xla  # pylint: disable=import-outside-toplevel
  return xla


def _check(q, interpret):
  why = unsupported(q.dtype, q.shape[3])
  if why and not interpret:
    raise ValueError(f"impl='mosaic_gpu': {why}; impl='pallas_gpu' or 'xla' takes it")


def fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes=BlockSizes(), interpret=None, segmented=True):
  """(out, lse) of the backend contract."""
  _check(q, interpret)
  kw = dict(causal=causal, scale=scale, interpret=bool(interpret))
  if not segmented:
    return _kernel_fwd(q, k, v, q_seg, ranged=False, **kw)
  branches = [
      lambda q, k, v, qs, ks: _kernel_fwd(q, k, v, qs, ranged=False, **kw),
      lambda q, k, v, qs, ks: _kernel_fwd(q, k, v, qs, ranged=True, **kw),
      lambda q, k, v, qs, ks: _fallback().fwd(q, k, v, qs, ks, causal=causal, scale=scale, block_sizes=block_sizes,
                                              interpret=interpret),
  ]
  return lax.switch(segments.route(q_seg, kv_seg), branches, q, k, v, q_seg, kv_seg)


def bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes=BlockSizes(), interpret=None,
        segmented=True):
  """(dq, dk, dv): tokamax's backward given O' and dO' (`fold`), so that dS = P o (dP - D + g)."""
  _check(q, interpret)
  g = jnp.where(jnp.isfinite(lse), dlse, 0.0)
  kw = dict(causal=causal, scale=scale, interpret=bool(interpret))

  def kernel(ranged, q, k, v, qs, ks, out, lse, dout, g):
    dq, dk, dv = _kernel_bwd(q, k, v, qs, out, lse, dout, g, ranged=ranged, **kw)
    if not ranged:
      return dq, dk, dv
    zero_pad = lambda x, s: jnp.where((s != 0)[:, :, None, None], x, 0).astype(x.dtype)
    return zero_pad(dq, qs), zero_pad(dk, ks), zero_pad(dv, ks)

  def fallback(q, k, v, qs, ks, out, lse, dout, g):
    return tuple(_fallback().bwd(q, k, v, qs, ks, out, lse, dout, g, causal=causal, scale=scale,
                                 block_sizes=block_sizes, interpret=interpret))

  args = (q, k, v, q_seg, kv_seg, out, lse, dout, g)
  if not segmented:
    return kernel(False, *args)
  branches = [functools.partial(kernel, False), functools.partial(kernel, True), fallback]
  return lax.switch(segments.route(q_seg, kv_seg), branches, *args)
