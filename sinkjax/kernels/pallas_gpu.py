"""Flash attention for NVIDIA GPUs: Pallas kernels lowered through Triton, forward and backward.

Implements the backend contract stated in `xla.py` (and used by `flash.py`):
  fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes, interpret) -> (out, lse)
  bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes, interpret) -> (dq, dk, dv)

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

Each pass has its own tiles (`BlockSizes`: forward block_q x block_k, dk/dv block_q_dkv x block_kv_dkv, dq
block_q_dq x block_kv_dq; powers of two). Shapes the hardware does not like are padded inside, per pass: T and S
up to multiples of that pass's tiles (padded keys and queries get segment 0, padded query rows are sliced off), the
head dim up to a power of two >= 16. Index arithmetic is explicitly int32 (grid ids, loop bounds), so the kernels
trace the same under jax_enable_x64.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sinkjax.kernels.blocks import BlockSizes, visible_tiles

DEFAULT_BLOCK_SIZES = BlockSizes(block_q=128, block_k=64, block_q_dkv=64, block_kv_dkv=64, block_q_dq=64,
                                 block_kv_dq=64)
NUM_STAGES = 2

_F32 = jnp.float32
_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def _next_pow2(n: int) -> int:
  return 1 << max(0, (int(n) - 1).bit_length())


def _tiles(block_sizes: BlockSizes, T: int, S: int) -> BlockSizes:
  """Every pass's tiles, defaults filled in: powers of two >= 16 (Triton's dot minimum), no larger than the padded
  sequence needs. All six are checked on every call, so a bad backward tile fails at the forward already."""
  bs = block_sizes.or_defaults(DEFAULT_BLOCK_SIZES)
  tiles = {}
  for name, b in dataclasses.asdict(bs).items():
    if b & (b - 1):
      raise ValueError(f"pallas_gpu tiles must be powers of two; got {name}={b}")
    length = S if name.split("_")[1] in ("k", "kv") else T
    tiles[name] = max(16, min(b, _next_pow2(length)))
  return BlockSizes(**tiles)


def _i32(x):
  """x as an int32 scalar: lax.div/fori_loop do not promote Python ints, which are int64 under jax_enable_x64."""
  return jnp.asarray(x, jnp.int32)


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
    return _i32(nk)
  last = jnp.maximum((i + 1) * bq + offset, 0)          # keys < (i+1)*bq + offset may be visible
  return jnp.minimum(lax.div(last + (bk - 1), _i32(bk)), nk)


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
  acc, m, l = lax.fori_loop(_i32(0), _kv_upper(i, bq, bk, nk, causal, offset), body, init)
  valid = l > 0.0
  l_safe = jnp.where(valid, l, 1.0)
  o_ref[...] = jnp.where(valid[:, None], acc / l_safe[:, None], 0.0).astype(o_ref.dtype)
  lse_ref[...] = jnp.where(valid, m * _LN2 + jnp.log(l_safe), -jnp.inf)


def _prepare(q, k, v, q_seg, kv_seg, bq, bk):
  """Pads T, S to the tiles (segment 0) and D to a power of two >= 16."""
  T, S, D = q.shape[1], k.shape[1], q.shape[3]
  Dp = max(16, _next_pow2(D))
  Tp, Sp = _ceil_to(T, bq), _ceil_to(S, bk)
  q = _pad_axis(_pad_axis(q, 1, Tp), 3, Dp)
  k = _pad_axis(_pad_axis(k, 1, Sp), 3, Dp)
  v = _pad_axis(_pad_axis(v, 1, Sp), 3, Dp)
  q_seg = _pad_axis(q_seg.astype(jnp.int32), 1, Tp)
  kv_seg = _pad_axis(kv_seg.astype(jnp.int32), 1, Sp)
  return q, k, v, q_seg, kv_seg, Tp, Sp, Dp


# BlockSpecs on a (tile, b, h) grid. `tiled`: the array is cut into blocks of n along its sequence axis and the
# program reads block `tile`; otherwise the program reads the whole (padded) sequence of n.
def _seq_spec(n, Dp, tiled, G=1):
  """[B, N, H, Dp] (q, k, v, dout, outputs); kv arrays take G = Hq // Hkv so query head h reads kv head h // G."""
  return pl.BlockSpec((None, n, None, Dp), lambda t, b, h: (b, t if tiled else 0, h // G, 0))


def _seg_spec(n, tiled):
  """[B, N] segment ids."""
  return pl.BlockSpec((None, n), lambda t, b, h: (b, t if tiled else 0))


def _row_spec(n, tiled):
  """[B, Hq, N] per-query-row statistics (lse, c)."""
  return pl.BlockSpec((None, None, n), lambda t, b, h: (b, h, t if tiled else 0))


def _call(kernel, *, grid, in_specs, out_specs, out_shape, Dp, interpret, name, cost):
  """The pass as a pallas_call. Compiled for a GPU, the kernel's name carries its cost estimate
  (`<name>__cost_f<flops>_t<transcendentals>_b<bytes>`, `sinkjax.hlo.GPU_COST_NAME`): Pallas's Triton lowering
  drops `cost_estimate`, and the name is what the compiled program keeps (its metadata), so `sinkjax.compile` can
  count the kernel's FLOPs and bytes."""
  if not interpret:
    name = f"{name}__cost_f{cost.flops}_t{cost.transcendentals}_b{cost.bytes_accessed}"
  return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, out_shape=out_shape,
                        compiler_params=plgpu.CompilerParams(num_warps=_num_warps(Dp), num_stages=NUM_STAGES),
                        interpret=bool(interpret), cost_estimate=cost, name=name)


def _cost(matmuls, *, B, Hq, Tp, Sp, Dp, bq, bk, causal, offset, itemsize, per_tile_rows, per_tile_cols, once):
  """`pl.CostEstimate` of a pass that computes the causally visible (bq, bk) tiles of every (batch row, query head):
  `matmuls` [bq, bk] x Dp matmuls (2 bq bk Dp flops each) and one exp2 per score per tile; bytes: per tile, the
  loop's `per_tile_rows` [bq, Dp] and `per_tile_cols` [bk, Dp] loads (plus their ids and row terms), and `once`
  [Tp or Sp, Dp] arrays read or written once per program. (The Triton lowering ignores the estimate; `_call` puts
  it in the kernel's name for `sinkjax.compile`.)"""
  n = B * Hq * visible_tiles(Tp // bq, Sp // bk, bq, bk, offset, causal)
  return pl.CostEstimate(
      flops=int(n * matmuls * 2 * bq * bk * Dp), transcendentals=int(n * bq * bk),
      bytes_accessed=int(n * (per_tile_rows * bq * (Dp * itemsize + 12) + per_tile_cols * bk * (Dp * itemsize + 4))
                         + B * Hq * once))


def fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes=BlockSizes(), interpret=False):
  B, T, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  bq, bk = _tiles(block_sizes, T, S).fwd
  qp, kp, vp, qsp, kvsp, Tp, Sp, Dp = _prepare(q, k, v, q_seg, kv_seg, bq, bk)
  kernel = functools.partial(_fwd_kernel, scale2=float(scale) * _LOG2E, causal=bool(causal), offset=S - T,
                             bq=bq, bk=bk, nk=Sp // bk, precision=_precision(q.dtype))
  q_spec, kv_spec = _seq_spec(bq, Dp, True), _seq_spec(Sp, Dp, False, Hq // Hkv)
  out, lse = _call(
      kernel, grid=(Tp // bq, B, Hq),
      in_specs=[q_spec, kv_spec, kv_spec, _seg_spec(bq, True), _seg_spec(Sp, False)],
      out_specs=[q_spec, _row_spec(bq, True)],
      out_shape=[jax.ShapeDtypeStruct((B, Tp, Hq, Dp), q.dtype), jax.ShapeDtypeStruct((B, Hq, Tp), _F32)],
      Dp=Dp, interpret=interpret, name="sinkjax_flash_fwd",
      cost=_cost(2, B=B, Hq=Hq, Tp=Tp, Sp=Sp, Dp=Dp, bq=bq, bk=bk, causal=causal, offset=S - T,
                 itemsize=q.dtype.itemsize, per_tile_rows=0, per_tile_cols=2,           # k, v per tile
                 once=Tp * (2 * Dp * q.dtype.itemsize + 8)),                           # q in, out, lse, q ids
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

  dq = lax.fori_loop(_i32(0), _kv_upper(i, bq, bk, nk, causal, offset), body, jnp.zeros(q.shape, _F32))
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
    lower = lax.div(jnp.maximum(j * bk - offset, 0), _i32(bq))
    lower = jnp.minimum(lower, nq)
  else:
    lower = _i32(0)
  zeros = jnp.zeros(k.shape, _F32)
  dk, dv = lax.fori_loop(lower, _i32(nq), body, (zeros, zeros))
  dk_ref[...] = (dk * scale).astype(dk_ref.dtype)
  dv_ref[...] = dv.astype(dv_ref.dtype)


def bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes=BlockSizes(), interpret=False):
  T, S = q.shape[1], k.shape[1]
  tiles = _tiles(block_sizes, T, S)
  dout = dout.astype(q.dtype)
  # Row terms (f32, [B, Hq, T]): base-2 LSE and c = dlse - rowsum(dO o O); zero on rows with no visible key.
  finite = jnp.isfinite(lse)
  delta = jnp.einsum("bthd,bthd->bht", dout.astype(_F32), out.astype(_F32))
  lse2 = jnp.where(finite, lse * _LOG2E, 0.0).astype(_F32)
  c = jnp.where(finite, dlse.astype(_F32) - delta, 0.0)
  args = (q, k, v, q_seg, kv_seg, dout, lse2, c)
  kw = dict(scale=float(scale), scale2=float(scale) * _LOG2E, causal=bool(causal), offset=S - T,
            precision=_precision(q.dtype))
  dq = _dq(args, tiles.dq, kw, interpret)
  dk, dv = _dkv(args, tiles.dkv, kw, interpret)
  return dq, dk, dv


def _prepare_bwd(q, k, v, q_seg, kv_seg, dout, lse2, c, bq, bk):
  """`_prepare` plus dout padded like q and the row terms padded along T."""
  qp, kp, vp, qsp, kvsp, Tp, Sp, Dp = _prepare(q, k, v, q_seg, kv_seg, bq, bk)
  dop = _pad_axis(_pad_axis(dout, 1, Tp), 3, Dp)
  return (qp, kp, vp, qsp, kvsp, dop, _pad_axis(lse2, 2, Tp), _pad_axis(c, 2, Tp)), (Tp, Sp, Dp)


def _dq(args, tile, kw, interpret):
  """dq on a (query block, batch, query head) grid, tiles block_q_dq x block_kv_dq."""
  q, k = args[0], args[1]
  B, T, Hq, D = q.shape
  bq, bk = tile
  padded, (Tp, Sp, Dp) = _prepare_bwd(*args, bq, bk)
  q_spec, kv_spec, row = _seq_spec(bq, Dp, True), _seq_spec(Sp, Dp, False, Hq // k.shape[2]), _row_spec(bq, True)
  dq = _call(
      functools.partial(_dq_kernel, bq=bq, bk=bk, nk=Sp // bk, **kw), grid=(Tp // bq, B, Hq),
      #         q       k        v        q_seg                 kv_seg                dout    lse2 c
      in_specs=[q_spec, kv_spec, kv_spec, _seg_spec(bq, True), _seg_spec(Sp, False), q_spec, row, row],
      out_specs=q_spec, out_shape=jax.ShapeDtypeStruct((B, Tp, Hq, Dp), q.dtype),
      Dp=Dp, interpret=interpret, name="sinkjax_flash_bwd_dq",
      cost=_cost(3, B=B, Hq=Hq, Tp=Tp, Sp=Sp, Dp=Dp, bq=bq, bk=bk, causal=kw["causal"], offset=kw["offset"],
                 itemsize=q.dtype.itemsize, per_tile_rows=0, per_tile_cols=2,           # k, v per tile
                 once=Tp * (3 * Dp * q.dtype.itemsize + 12)),                          # q, dout in, dq out, rows
  )(*padded)
  return dq[:, :T, :, :D]


def _dkv(args, tile, kw, interpret):
  """dk, dv on a (key block, batch, query head) grid, tiles block_q_dkv x block_kv_dkv; GQA groups summed after."""
  q, k, v = args[:3]
  B, _, Hq, D = q.shape
  S, Hkv = k.shape[1], k.shape[2]
  G = Hq // Hkv
  bq, bk = tile
  padded, (Tp, Sp, Dp) = _prepare_bwd(*args, bq, bk)
  q_spec, kv_spec, row = _seq_spec(Tp, Dp, False), _seq_spec(bk, Dp, True, G), _row_spec(Tp, False)
  out_spec = _seq_spec(bk, Dp, True)                       # per query head
  dtype = k.dtype if G == 1 else _F32                      # GQA: the group partials stay f32 until summed
  dk, dv = _call(
      functools.partial(_dkv_kernel, bq=bq, bk=bk, nq=Tp // bq, **kw), grid=(Sp // bk, B, Hq),
      #         q       k        v        q_seg                 kv_seg               dout    lse2 c
      in_specs=[q_spec, kv_spec, kv_spec, _seg_spec(Tp, False), _seg_spec(bk, True), q_spec, row, row],
      out_specs=[out_spec, out_spec], out_shape=[jax.ShapeDtypeStruct((B, Sp, Hq, Dp), dtype)] * 2,
      Dp=Dp, interpret=interpret, name="sinkjax_flash_bwd_dkv",
      cost=_cost(4, B=B, Hq=Hq, Tp=Tp, Sp=Sp, Dp=Dp, bq=bq, bk=bk, causal=kw["causal"], offset=kw["offset"],
                 itemsize=q.dtype.itemsize, per_tile_rows=2, per_tile_cols=0,           # q, dout per tile
                 once=Sp * (2 * Dp * q.dtype.itemsize + 2 * Dp * jnp.dtype(dtype).itemsize + 4)),  # k, v; dk, dv
  )(*padded)
  if G > 1:
    dk = dk.reshape(B, Sp, Hkv, G, Dp).sum(3)
    dv = dv.reshape(B, Sp, Hkv, G, Dp).sum(3)
  return dk[:, :S, :, :D].astype(k.dtype), dv[:, :S, :, :D].astype(v.dtype)
