"""Flash attention for NVIDIA GPUs: Pallas kernels lowered through Triton, forward and backward.

Implements the backend contract stated in `xla.py` (and used by `flash.py`):
  fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_q, block_k, interpret) -> (out, lse)
  bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_q, block_k, interpret) -> (dq, dk, dv)

Layout: q [B,T,Hq,D], k/v [B,S,Hkv,D]; query head h reads kv head h // (Hq // Hkv) through the BlockSpec index map
(k/v are never repeated). Segment ids are int32 [B,T] / [B,S], 0 = padding. Causal masking is bottom-right aligned
(query t sees key s <= t + S - T).

Kernels (all on a (blocks, B, heads) grid, f32 accumulation, online softmax in base 2 with the logit scale folded
into one multiply; the LSE is returned in natural log):
  * forward: one program per (query block, batch, query head) loops over key blocks, up to the causal diagonal.
  * dq: one program per (query block, batch, query head) loops over key blocks (same bound as the forward).
  * dk/dv: one program per (key block, batch, query head) loops over query blocks from the causal diagonal on; for
    GQA the per-query-head partials (f32) are summed over the group outside the kernel.
The backward uses dS = P o (dP - D + g) with D = rowsum(dO o O) and g the LSE cotangent, computed in a small jnp
preprocessing step together with a finite base-2 LSE (rows with lse = -inf have no visible key, so P = 0 there
and their dlse is dropped: no NaN reaches any gradient).

Shapes the hardware does not like are padded inside: T and S up to multiples of the blocks (padded keys and
queries get segment 0, padded query rows are sliced off), the head dim up to a power of two >= 16.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

DEFAULT_BLOCK_Q = 128        # forward
DEFAULT_BLOCK_K = 64
DEFAULT_BWD_BLOCK_Q = 64     # backward (both kernels)
DEFAULT_BWD_BLOCK_K = 64
NUM_STAGES = 2

_F32 = jnp.float32
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def _block(requested: int | None, default: int, length: int) -> int:
  """A power-of-two block >= 16 (Triton's dot minimum), no larger than the padded sequence needs."""
  b = default if requested is None else int(requested)
  if b <= 0 or b & (b - 1):
    raise ValueError(f"pallas_gpu block sizes must be powers of two; got {b}")
  return max(16, min(b, _next_pow2(length)))


def _num_warps(head_dim_padded: int) -> int:
  return 4 if head_dim_padded <= 64 else 8


def _precision(dtype):
  # Triton lowers DEFAULT f32 dots to TF32; the contract promises f32 accuracy for f32 inputs.
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def _dot(a, b, *, trans_a=False, trans_b=False, precision=None):
  dims = (((0 if trans_a else 1,), (1 if trans_b else 0,)), ((), ()))
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)


def _pad_axis(x, axis, new, value=0):
  pad = new - x.shape[axis]
  if pad == 0:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, pad)
  return jnp.pad(x, widths, constant_values=value)


def _ceil_to(n, m):
  return -(-n // m) * m


def _mask(q_seg, k_seg, q_pos, k_pos, causal, offset):
  """[bq, bk] visibility from segment ids (0 = padding) and the bottom-right-aligned causal rule."""
  mask = (q_seg[:, None] == k_seg[None, :]) & (q_seg[:, None] != 0)
  if causal:
    mask &= k_pos[None, :] <= q_pos[:, None] + offset
  return mask


def _kv_upper(i, bq, bk, nk, causal, offset):
  """Number of key blocks a query block must visit (causal: up to the diagonal)."""
  if not causal:
    return nk
  last = jnp.maximum((i + 1) * bq + offset, 0)          # keys < (i+1)*bq + offset may be visible
  return jnp.minimum(lax.div(last + (bk - 1), bk), nk)


# ----------------------------------------------------------------------------------------------------- forward


def _fwd_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, o_ref, lse_ref, *, scale2, causal, offset, bq, bk, nk,
                precision):
  i = pl.program_id(0)
  q = q_ref[...]                                          # [bq, Dp]
  q_seg = qseg_ref[...]                                   # [bq]
  q_pos = i * bq + jnp.arange(bq, dtype=jnp.int32)
  dp_ = q.shape[-1]

  def body(j, carry):
    acc, m, l = carry
    start = pl.multiple_of(j * bk, bk)
    k = k_ref[pl.ds(start, bk), :]
    v = v_ref[pl.ds(start, bk), :]
    k_seg = kvseg_ref[pl.ds(start, bk)]
    s = _dot(q, k, trans_b=True, precision=precision) * scale2          # base-2 logits [bq, bk]
    k_pos = start + jnp.arange(bk, dtype=jnp.int32)
    s = jnp.where(_mask(q_seg, k_seg, q_pos, k_pos, causal, offset), s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)   # rows with nothing visible yet
    alpha = jnp.exp2(m - m_safe)
    p = jnp.exp2(s - m_safe[:, None])
    l = l * alpha + jnp.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.astype(v.dtype), v, precision=precision)
    return acc, m_new, l

  init = (jnp.zeros((bq, dp_), _F32), jnp.full((bq,), -jnp.inf, _F32), jnp.zeros((bq,), _F32))
  acc, m, l = lax.fori_loop(0, _kv_upper(i, bq, bk, nk, causal, offset), body, init)
  valid = l > 0.0
  l_safe = jnp.where(valid, l, 1.0)
  o_ref[...] = jnp.where(valid[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(valid, m * _LN2 + jnp.log(l_safe), -jnp.inf)


def _prepare(q, k, v, q_seg, kv_seg, bq, bk):
  """Pads T, S to the blocks (segment 0) and D to a power of two >= 16."""
  B, T, Hq, D = q.shape
  S = k.shape[1]
  Dp = max(16, _next_pow2(D))
  Tp, Sp = _ceil_to(T, bq), _ceil_to(S, bk)
  q = _pad_axis(_pad_axis(q, 1, Tp), 3, Dp)
  k = _pad_axis(_pad_axis(k, 1, Sp), 3, Dp)
  v = _pad_axis(_pad_axis(v, 1, Sp), 3, Dp)
  q_seg = _pad_axis(q_seg.astype(jnp.int32), 1, Tp)
  kv_seg = _pad_axis(kv_seg.astype(jnp.int32), 1, Sp)
  return q, k, v, q_seg, kv_seg, Tp, Sp, Dp


def fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_q=None, block_k=None, interpret=False):
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  bq = _block(block_q, DEFAULT_BLOCK_Q, T)
  bk = _block(block_k, DEFAULT_BLOCK_K, S)
  qp, kp, vp, qsp, kvsp, Tp, Sp, Dp = _prepare(q, k, v, q_seg, kv_seg, bq, bk)
  nq, nk = Tp // bq, Sp // bk
  kernel = functools.partial(_fwd_kernel, scale2=float(scale) * _LOG2E, causal=bool(causal), offset=S - T,
                             bq=bq, bk=bk, nk=nk, precision=_precision(q.dtype))
  out, lse = pl.pallas_call(
      kernel,
      grid=(nq, B, Hq),
      in_specs=[
          pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // G, 0)),
          pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // G, 0)),
          pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),
          pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0)),
      ],
      out_specs=[
          pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
          pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),
      ],
      out_shape=[jax.ShapeDtypeStruct((B, Tp, Hq, Dp), q.dtype),
                 jax.ShapeDtypeStruct((B, Hq, Tp), _F32)],
      compiler_params=plgpu.CompilerParams(num_warps=_num_warps(Dp), num_stages=NUM_STAGES),
      interpret=bool(interpret),
      name="sinkjax_flash_fwd",
  )(qp, kp, vp, qsp, kvsp)
  return out[:, :T, :, :D], lse[:, :, :T]


# ---------------------------------------------------------------------------------------------------- backward


def _dq_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, do_ref, lse_ref, c_ref, dq_ref, *, scale, scale2, causal,
               offset, bq, bk, nk, precision):
  i = pl.program_id(0)
  q = q_ref[...]
  do = do_ref[...]
  q_seg = qseg_ref[...]
  lse2 = lse_ref[...]                                     # finite base-2 LSE [bq]
  c = c_ref[...]                                          # dlse - rowsum(dO o O) [bq]
  q_pos = i * bq + jnp.arange(bq, dtype=jnp.int32)

  def body(j, dq):
    start = pl.multiple_of(j * bk, bk)
    k = k_ref[pl.ds(start, bk), :]
    v = v_ref[pl.ds(start, bk), :]
    k_seg = kvseg_ref[pl.ds(start, bk)]
    s = _dot(q, k, trans_b=True, precision=precision) * scale2
    k_pos = start + jnp.arange(bk, dtype=jnp.int32)
    s = jnp.where(_mask(q_seg, k_seg, q_pos, k_pos, causal, offset), s, -jnp.inf)
    p = jnp.exp2(s - lse2[:, None])
    dp = _dot(do, v, trans_b=True, precision=precision)
    ds = p * (dp + c[:, None])
    return dq + _dot(ds.astype(k.dtype), k, precision=precision)

  dq = lax.fori_loop(0, _kv_upper(i, bq, bk, nk, causal, offset), body, jnp.zeros(q.shape, _F32))
  dq_ref[...] = (dq * scale).astype(dq_ref.dtype)


def _dkv_kernel(q_ref, k_ref, v_ref, qseg_ref, kvseg_ref, do_ref, lse_ref, c_ref, dk_ref, dv_ref, *, scale, scale2,
                causal, offset, bq, bk, nq, precision):
  j = pl.program_id(0)
  k = k_ref[...]                                          # [bk, Dp]
  v = v_ref[...]
  k_seg = kvseg_ref[...]
  k_pos = j * bk + jnp.arange(bk, dtype=jnp.int32)

  def body(i, carry):
    dk, dv = carry
    start = pl.multiple_of(i * bq, bq)
    q = q_ref[pl.ds(start, bq), :]
    do = do_ref[pl.ds(start, bq), :]
    q_seg = qseg_ref[pl.ds(start, bq)]
    lse2 = lse_ref[pl.ds(start, bq)]
    c = c_ref[pl.ds(start, bq)]
    q_pos = start + jnp.arange(bq, dtype=jnp.int32)
    s = _dot(q, k, trans_b=True, precision=precision) * scale2                 # [bq, bk]
    s = jnp.where(_mask(q_seg, k_seg, q_pos, k_pos, causal, offset), s, -jnp.inf)
    p = jnp.exp2(s - lse2[:, None])
    dv = dv + _dot(p.astype(do.dtype), do, trans_a=True, precision=precision)
    dp = _dot(do, v, trans_b=True, precision=precision)
    ds = p * (dp + c[:, None])
    dk = dk + _dot(ds.astype(q.dtype), q, trans_a=True, precision=precision)
    return dk, dv

  if causal:
    # Query t sees key s iff t >= s - offset: start at the query block holding the first such t.
    lower = lax.div(jnp.maximum(j * bk - offset, 0), bq)
    lower = jnp.minimum(lower, nq)
  else:
    lower = 0
  zeros = jnp.zeros(k.shape, _F32)
  dk, dv = lax.fori_loop(lower, nq, body, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_q=None, block_k=None,
        interpret=False):
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  bq = _block(block_q, DEFAULT_BWD_BLOCK_Q, T)
  bk = _block(block_k, DEFAULT_BWD_BLOCK_K, S)
  qp, kp, vp, qsp, kvsp, Tp, Sp, Dp = _prepare(q, k, v, q_seg, kv_seg, bq, bk)
  nq, nk = Tp // bq, Sp // bk
  dout = dout.astype(q.dtype)
  dop = _pad_axis(_pad_axis(dout, 1, Tp), 3, Dp)

  # Row terms (f32, [B, Hq, T]): base-2 LSE and c = dlse - rowsum(dO o O); zero on rows with no visible key.
  finite = jnp.isfinite(lse)
  delta = jnp.einsum("bthd,bthd->bht", dout.astype(_F32), out.astype(_F32))
  lse2 = _pad_axis(jnp.where(finite, lse * _LOG2E, 0.0).astype(_F32), 2, Tp)
  c = _pad_axis(jnp.where(finite, dlse.astype(_F32) - delta, 0.0), 2, Tp)

  common = dict(scale=float(scale), scale2=float(scale) * _LOG2E, causal=bool(causal), offset=S - T, bq=bq, bk=bk,
                precision=_precision(q.dtype))
  params = plgpu.CompilerParams(num_warps=_num_warps(Dp), num_stages=NUM_STAGES)

  dq = pl.pallas_call(
      functools.partial(_dq_kernel, nk=nk, **common),
      grid=(nq, B, Hq),
      in_specs=[
          pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),         # q
          pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // G, 0)),    # k
          pl.BlockSpec((None, Sp, None, Dp), lambda i, b, h: (b, 0, h // G, 0)),    # v
          pl.BlockSpec((None, bq), lambda i, b, h: (b, i)),                         # q_seg
          pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0)),                         # kv_seg
          pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),         # dout
          pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),                # lse2
          pl.BlockSpec((None, None, bq), lambda i, b, h: (b, h, i)),                # c
      ],
      out_specs=pl.BlockSpec((None, bq, None, Dp), lambda i, b, h: (b, i, h, 0)),
      out_shape=jax.ShapeDtypeStruct((B, Tp, Hq, Dp), q.dtype),
      compiler_params=params,
      interpret=bool(interpret),
      name="sinkjax_flash_bwd_dq",
  )(qp, kp, vp, qsp, kvsp, dop, lse2, c)

  # Per query head; for GQA the group partials stay f32 until summed below.
  dkv_dtype = k.dtype if G == 1 else _F32
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, nq=nq, **common),
      grid=(nk, B, Hq),
      in_specs=[
          pl.BlockSpec((None, Tp, None, Dp), lambda j, b, h: (b, 0, h, 0)),         # q
          pl.BlockSpec((None, bk, None, Dp), lambda j, b, h: (b, j, h // G, 0)),    # k
          pl.BlockSpec((None, bk, None, Dp), lambda j, b, h: (b, j, h // G, 0)),    # v
          pl.BlockSpec((None, Tp), lambda j, b, h: (b, 0)),                         # q_seg
          pl.BlockSpec((None, bk), lambda j, b, h: (b, j)),                         # kv_seg
          pl.BlockSpec((None, Tp, None, Dp), lambda j, b, h: (b, 0, h, 0)),         # dout
          pl.BlockSpec((None, None, Tp), lambda j, b, h: (b, h, 0)),                # lse2
          pl.BlockSpec((None, None, Tp), lambda j, b, h: (b, h, 0)),                # c
      ],
      out_specs=[
          pl.BlockSpec((None, bk, None, Dp), lambda j, b, h: (b, j, h, 0)),
          pl.BlockSpec((None, bk, None, Dp), lambda j, b, h: (b, j, h, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((B, Sp, Hq, Dp), dkv_dtype),
                 jax.ShapeDtypeStruct((B, Sp, Hq, Dp), dkv_dtype)],
      compiler_params=params,
      interpret=bool(interpret),
      name="sinkjax_flash_bwd_dkv",
  )(qp, kp, vp, qsp, kvsp, dop, lse2, c)

  if G > 1:
    dk = dk.reshape(B, Sp, Hkv, G, Dp).sum(3)
    dv = dv.reshape(B, Sp, Hkv, G, Dp).sum(3)
  dq = dq[:, :T, :, :D]
  return dq, dk[:, :S, :, :D].astype(k.dtype), dv[:, :S, :, :D].astype(v.dtype)
