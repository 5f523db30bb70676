"""Flash attention as Pallas TPU (Mosaic) kernels, forward and backward, with a differentiable LSE.

Backend contract: see `xla.py`. Layout inside the kernels is head-major ([B, H, T, D]); sequences are padded
to a multiple of the block (padded keys get segment 0 and are never attended, padded query rows are sliced
off). Three kernels:

  forward   grid (B, Hq, nq, nk), kv axis "arbitrary"; online softmax with m/l/acc in VMEM scratch; the LSE is
            written transposed, rows along lanes ([B, Hq, 8, T]: not a 128-lane padded [B, Hq, T, 128]).
  dk/dv     grid (B, Hkv, nk, G * nq): the reduction axis walks the G query heads of a kv head and all query
            blocks, so GQA groups are summed inside the kernel. Scores are computed transposed ([bk, bq]) so
            that per-query-row quantities (lse, dlse - D) are lane vectors.
  dq        grid (B, Hq, nq, nk), kv axis "arbitrary".

With D_i = rowsum(dO o O) and g_i = dlse_i: dS = P o (dP - D_i + g_i), dq = scale dS K, dk = scale dS^T Q,
dv = P^T dO. Rows whose lse is not finite (nothing visible) have P = 0 and their dlse is ignored.

Causal masking is bottom-right aligned (query t sees keys s <= t + S - T). Under causal masking kv blocks that
are entirely above the diagonal are skipped (`pl.when`), and their index maps are clamped to the last/first
needed block so no DMA is issued for them.

Each pass has its own tiles (`BlockSizes`: forward block_q x block_k, dk/dv block_q_dkv x block_kv_dkv, dq
block_q_dq x block_kv_dq), and the sequences are padded per pass. Tiles are multiples of 128 (rounded up; both
sequence axes appear as the lane axis of some tile) and at most the sequence length rounded up to 128. Defaults:
512 x 512 for the forward, 256 x 256 for both backward passes (which keep several [bq, bk] f32 tiles live).
Index arithmetic (grid ids, index maps, block bounds) is explicitly int32, so the kernels lower the same under
jax_enable_x64.

`segmented=False` (static: the caller passed no segment ids, e.g. `data.packing: stream` rows, one segment each)
drops the segment-id inputs: no [rows, 128] id columns or [8, cols] id rows are streamed, and the mask is the causal
one (which already hides padded keys from every real query row) or, without causal masking, `key < S`. On a d20
step those ids were ~9 GB of HBM traffic per chip (docs/TPU.md).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from sinkjax.kernels.blocks import BlockSizes, visible_tiles

DEFAULT_BLOCK_SIZES = BlockSizes(block_q=512, block_k=512, block_q_dkv=256, block_kv_dkv=256, block_q_dq=256,
                                 block_kv_dq=256)
NUM_LANES = 128
NUM_SUBLANES = 8
_F32 = jnp.float32
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)   # finite "minus infinity" for the running max
_NT = (((1,), (1,)), ((), ()))                      # a @ b.T
_NN = (((1,), (0,)), ((), ()))                      # a @ b


def _round_up(x, m):
  return -(-x // m) * m


def _block(n, b):
  """(block, padded length) for a sequence of length n: blocks are multiples of 128, at most round_up(n, 128)."""
  b = min(_round_up(b, NUM_LANES), _round_up(n, NUM_LANES))
  return b, _round_up(n, b)


def _i32(x):
  """x as an int32 scalar: lax.div/rem do not promote Python ints, which are int64 under jax_enable_x64."""
  return jnp.asarray(x, jnp.int32)


def _interpret(interpret):
  return pltpu.InterpretParams() if interpret else False


def _precision(dtype):
  return lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else lax.Precision.DEFAULT


def _dot(a, b, dims, precision):
  return lax.dot_general(a, b, dims, precision=precision, preferred_element_type=_F32)


def _kv_last(i, bq, bk, nk, off):
  """Last kv block that query block i can see under causal masking (clamped to [0, nk-1])."""
  return jnp.minimum(lax.div(jnp.maximum(i * bq + bq - 1 + off, 0), _i32(bk)), nk - 1)


def _q_first(j, bq, bk, nq, off):
  """First query block that can see kv block j under causal masking (clamped to [0, nq-1])."""
  return jnp.minimum(lax.div(jnp.maximum(j * bk - off, 0), _i32(bq)), nq - 1)


def _run_block(step, causal, i, j, bq, bk, off):
  """Runs step(diag) for the (query block i, kv block j) tile unless causal masking hides all of it.

  diag says whether the tile straddles the causal diagonal and so needs the elementwise causal mask; tiles
  entirely below it only apply the segment mask.
  """
  if not causal:
    step(False)
    return
  visible = j * bk <= i * bq + bq - 1 + off                  # some key visible to the last query row
  full = j * bk + bk - 1 <= i * bq + off                     # every key visible to the first query row
  pl.when(visible & jnp.logical_not(full))(lambda: step(True))
  pl.when(full)(lambda: step(False))


class _Geom:
  """Static shapes, one pass's tiles and the padded / transposed layouts of that pass's inputs."""

  def __init__(self, q, k, tile, causal):
    self.B, self.T, self.Hq, self.D = q.shape
    self.S, self.Hkv = k.shape[1], k.shape[2]
    self.G = self.Hq // self.Hkv
    self.bq, self.Tp = _block(self.T, tile[0])
    self.bk, self.Sp = _block(self.S, tile[1])
    self.nq, self.nk = self.Tp // self.bq, self.Sp // self.bk
    self.off = self.S - self.T
    self.causal = causal

  def heads(self, x, n, n_pad):
    """[B, n, H, D] -> [B, H, n_pad, D]."""
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, n_pad - n), (0, 0))) if n_pad != n else x

  def seg_col(self, seg, n, n_pad):
    """[B, n] -> [B, n_pad, 128] (ids along sublanes, for a [rows, 1] column)."""
    seg = jnp.pad(seg, ((0, 0), (0, n_pad - n)))
    return jnp.broadcast_to(seg[:, :, None], (self.B, n_pad, NUM_LANES))

  def seg_row(self, seg, n, n_pad):
    """[B, n] -> [B, 8, n_pad] (ids along lanes, for a [1, cols] row)."""
    seg = jnp.pad(seg, ((0, 0), (0, n_pad - n)))
    return jnp.broadcast_to(seg[:, None, :], (self.B, NUM_SUBLANES, n_pad))

  def row_stat(self, x):
    """[B, Hq, T] f32 -> [B, Hq, 8, Tp] (per-query-row statistic along lanes), padding with 0."""
    x = jnp.pad(x, ((0, 0), (0, 0), (0, self.Tp - self.T)))
    return jnp.broadcast_to(x[:, :, None, :], (self.B, self.Hq, NUM_SUBLANES, self.Tp))

  def tiles(self) -> int:
    """(query block, kv block) tiles computed per (batch row, query head): causally hidden ones are skipped."""
    return visible_tiles(self.nq, self.nk, self.bq, self.bk, self.off, self.causal)

  def kv_block(self):
    """Index map helper (i, j) -> the kv block to fetch: under causal masking blocks past the diagonal are clamped
    to the last needed one, so no DMA is issued for the skipped steps."""
    if not self.causal:
      return lambda i, j: j
    return lambda i, j: jnp.minimum(j, _kv_last(i, self.bq, self.bk, self.nk, self.off))


def _mask(q_seg, kv_seg, q_start, k_start, shape, causal, off, q_axis=0, kv_len=None):
  """Visibility of a score tile whose axis `q_axis` runs over queries (0: [bq, bk]; 1: transposed [bk, bq]), from
  segment ids given as a column and a row that broadcast to it (0 = padding); without ids (`q_seg` None) from the
  key positions alone: causal, else `key < kv_len` where keys were padded (None: every key of the tile is visible)."""
  k_pos = lambda: k_start + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis)
  mask = None if q_seg is None else (q_seg == kv_seg) & (q_seg != 0)
  if causal:
    q_pos = q_start + lax.broadcasted_iota(jnp.int32, shape, q_axis)
    vis = k_pos() <= q_pos + off
    mask = vis if mask is None else mask & vis
  elif mask is None and kv_len is not None:
    mask = k_pos() < kv_len
  return mask


def _masked(mask, x, fill):
  return x if mask is None else jnp.where(mask, x, fill)


def _refs(refs, segmented):
  """A kernel's refs after q, k, v (and dO) as (first ids, second ids, the rest): ids None when not segmented."""
  if segmented:
    return refs[0], refs[1], refs[2:]
  return None, None, refs


def _col(ref):
  """An id column block [1, rows, 128] as [rows, 1] (None without ids)."""
  return None if ref is None else ref[0, :, 0:1]


def _row(ref):
  """An id row block [1, 8, cols] as [1, cols] (None without ids)."""
  return None if ref is None else ref[0, 0:1, :]


# ----------------------------------------------------------------------------------------------------------------
# Forward.


def _fwd_kernel(q_ref, k_ref, v_ref, *refs, scale, causal, off, bq, bk, nk, precision, segmented, kv_len):
  qs_ref, ks_ref, (o_ref, lse_ref, m_sc, l_sc, acc_sc) = _refs(refs, segmented)
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, _MASK, _F32)
    l_sc[...] = jnp.zeros(l_sc.shape, _F32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, _F32)

  def _step(diag):
    q = q_ref[0, 0]                                           # [bq, D]
    k = k_ref[0, 0]                                           # [bk, D]
    s = _dot(q, k, _NT, precision) * scale                    # [bq, bk] f32
    mask = _mask(_col(qs_ref), _row(ks_ref), i * bq, j * bk, s.shape, diag, off,
                 kv_len=kv_len)
    s = _masked(mask, s, _MASK)
    m_prev = m_sc[...]                                        # [bq, 128], lane-replicated
    m_next = jnp.maximum(m_prev, s.max(axis=1)[:, None])
    alpha = jnp.exp(m_prev - m_next)
    p = _masked(mask, jnp.exp(s - m_next[:, 0:1]), 0.0)
    l_sc[...] = alpha * l_sc[...] + p.sum(axis=1)[:, None]
    m_sc[...] = m_next
    v = v_ref[0, 0]
    pv = _dot(p.astype(v.dtype), v, _NN, precision)           # [bq, D]
    acc_sc[...] = alpha[:, 0:1] * acc_sc[...] + pv

  _run_block(_step, causal, i, j, bq, bk, off)

  @pl.when(j == nk - 1)
  def _finish():
    l = l_sc[...]                                             # [bq, 128]
    valid = l > 0.0                                           # false on rows with no visible key
    l_safe = jnp.where(valid, l, 1.0)
    o_ref[0, 0] = jnp.where(valid[:, 0:1], acc_sc[...] / l_safe[:, 0:1], 0.0).astype(o_ref.dtype)
    lse = jnp.where(valid, m_sc[...] + jnp.log(l_safe), -jnp.inf)            # [bq, 128], lane-replicated
    lse_ref[0, 0] = lse.T[:NUM_SUBLANES]                      # [8, bq]: rows along lanes, 16x less than [bq, 128]


_SEMANTICS = pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"))


# Cost estimates (`pl.CostEstimate`, what XLA's cost analysis and scheduler see of a Mosaic call): per computed tile,
# the MXU work of its matmuls (2 bq bk D flops each), one exp per score, and the HBM bytes the grid's DMAs move
# (a tile's blocks are fetched once per grid step; id columns are 128-lane padded, per-row statistics 8-sublane).
def _fwd_cost(g, itemsize, segmented=True):
  n = g.B * g.Hq * g.tiles()
  rows = g.B * g.Hq * g.Tp
  ids = int(segmented)
  return pl.CostEstimate(
      flops=int(n * 4 * g.bq * g.bk * g.D),                                 # q k^T, p v
      transcendentals=int(n * (g.bq * g.bk + g.bq)),                        # exp(s - m), exp(m_prev - m_next)
      bytes_accessed=int(rows * (2 * g.D * itemsize + NUM_SUBLANES * 4 + ids * NUM_LANES * 4)  # q, out; lse, q ids
                         + n * (2 * g.bk * g.D * itemsize + ids * NUM_SUBLANES * g.bk * 4)))   # k, v, kv ids per tile


def _dkv_cost(g, itemsize, segmented=True):
  n = g.B * g.Hq * g.tiles()                                                # G query heads per kv head
  ids = int(segmented)
  return pl.CostEstimate(
      flops=int(n * 8 * g.bq * g.bk * g.D),                                 # k q^T, p^T do, v do^T, ds^T q
      transcendentals=int(n * g.bq * g.bk),
      bytes_accessed=int(n * (2 * g.bq * g.D * itemsize + (2 + ids) * NUM_SUBLANES * g.bq * 4)  # q, do, lse, rt, ids
                         + g.B * g.Hkv * g.Sp * (4 * g.D * itemsize + ids * NUM_LANES * 4)))  # k, v in; dk, dv out


def _dq_cost(g, itemsize, segmented=True):
  n = g.B * g.Hq * g.tiles()
  ids = int(segmented)
  return pl.CostEstimate(
      flops=int(n * 6 * g.bq * g.bk * g.D),                                 # q k^T, do v^T, ds k
      transcendentals=int(n * g.bq * g.bk),
      bytes_accessed=int(n * (2 * g.bk * g.D * itemsize + ids * NUM_SUBLANES * g.bk * 4)   # k, v, kv ids per tile
                         + g.B * g.Hq * g.Tp * (3 * g.D * itemsize + ids * NUM_LANES * 4 + 2 * NUM_SUBLANES * 4)))


def _query_block_specs(g):
  """BlockSpecs of a (B, Hq, nq, nk) grid: q-like [bq, D] tiles, kv [bk, D] tiles of kv head h // G (causally
  clamped), q segment column, kv segment row and per-row statistics, in that order."""
  kv_j = g.kv_block()
  q_spec = pl.BlockSpec((1, 1, g.bq, g.D), lambda b, h, i, j: (b, h, i, 0))
  kv_spec = pl.BlockSpec((1, 1, g.bk, g.D), lambda b, h, i, j: (b, lax.div(h, _i32(g.G)), kv_j(i, j), 0))
  q_col = pl.BlockSpec((1, g.bq, NUM_LANES), lambda b, h, i, j: (b, i, 0))
  kv_row = pl.BlockSpec((1, NUM_SUBLANES, g.bk), lambda b, h, i, j: (b, 0, kv_j(i, j)))
  stat = pl.BlockSpec((1, 1, NUM_SUBLANES, g.bq), lambda b, h, i, j: (b, h, 0, i))
  return q_spec, kv_spec, q_col, kv_row, stat


def _kv_len(g, causal):
  """The key length a mask without ids must apply: only without causal masking and where keys were padded."""
  return g.S if not causal and g.Sp != g.S else None


def fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes=BlockSizes(), interpret=False, segmented=True):
  g = _Geom(q, k, block_sizes.or_defaults(DEFAULT_BLOCK_SIZES).fwd, causal)
  B, Hq, D, bq, bk = g.B, g.Hq, g.D, g.bq, g.bk
  qh = g.heads(q, g.T, g.Tp)
  kh, vh = g.heads(k, g.S, g.Sp), g.heads(v, g.S, g.Sp)
  q_spec, kv_spec, q_col, kv_row, _ = _query_block_specs(g)
  ids = [g.seg_col(q_seg, g.T, g.Tp), g.seg_row(kv_seg, g.S, g.Sp)] if segmented else []
  kernel = functools.partial(_fwd_kernel, scale=scale, causal=causal, off=g.off, bq=bq, bk=bk, nk=g.nk,
                             precision=_precision(q.dtype), segmented=segmented, kv_len=_kv_len(g, causal))
  out, lse = pl.pallas_call(
      kernel,
      grid=(B, Hq, g.nq, g.nk),
      in_specs=[q_spec, kv_spec, kv_spec] + ([q_col, kv_row] if segmented else []),
      out_specs=[q_spec, pl.BlockSpec((1, 1, NUM_SUBLANES, bq), lambda b, h, i, j: (b, h, 0, i))],
      out_shape=[jax.ShapeDtypeStruct((B, Hq, g.Tp, D), q.dtype),
                 jax.ShapeDtypeStruct((B, Hq, NUM_SUBLANES, g.Tp), _F32)],
      scratch_shapes=[pltpu.VMEM((bq, NUM_LANES), _F32), pltpu.VMEM((bq, NUM_LANES), _F32),
                      pltpu.VMEM((bq, D), _F32)],
      compiler_params=_SEMANTICS,
      interpret=_interpret(interpret),
      cost_estimate=_fwd_cost(g, q.dtype.itemsize, segmented),
      name="sinkjax_flash_fwd",
  )(qh, kh, vh, *ids)
  out = jnp.swapaxes(out[:, :, :g.T], 1, 2)
  return out, lse[:, :, 0, :g.T]


# ----------------------------------------------------------------------------------------------------------------
# Backward.


def _dkv_kernel(q_ref, k_ref, v_ref, do_ref, *refs, scale, causal, off, bq, bk, nq, G, precision, segmented,
                kv_len):
  kss_ref, qsr_ref, (lse_ref, rt_ref, dk_ref, dv_ref, dk_sc, dv_sc) = _refs(refs, segmented)
  j, t = pl.program_id(2), pl.program_id(3)
  i = lax.rem(t, jnp.int32(nq))

  @pl.when(t == 0)
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, _F32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, _F32)

  def _step(diag):
    q, k, v, do = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], do_ref[0, 0]
    s_t = _dot(k, q, _NT, precision) * scale                  # [bk, bq]
    mask = _mask(_row(qsr_ref), _col(kss_ref), i * bq, j * bk, s_t.shape, diag,
                 off, q_axis=1, kv_len=kv_len)
    lse = lse_ref[0, 0, 0:1, :]                               # [1, bq], 0 on rows with nothing visible
    p_t = _masked(mask, jnp.exp(s_t - lse), 0.0)
    dv_sc[...] += _dot(p_t.astype(do.dtype), do, _NN, precision)
    dp_t = _dot(v, do, _NT, precision)                        # [bk, bq]
    ds_t = p_t * (dp_t + rt_ref[0, 0, 0:1, :])                # rt = dlse - rowsum(dO o O)
    dk_sc[...] += _dot(ds_t.astype(q.dtype), q, _NN, precision)

  _run_block(_step, causal, i, j, bq, bk, off)

  @pl.when(t == G * nq - 1)
  def _finish():
    dk_ref[0, 0] = (dk_sc[...] * scale).astype(dk_ref.dtype)
    dv_ref[0, 0] = dv_sc[...].astype(dv_ref.dtype)


def _dq_kernel(q_ref, k_ref, v_ref, do_ref, *refs, scale, causal, off, bq, bk, nk, precision, segmented, kv_len):
  qs_ref, ksr_ref, (lse_ref, rt_ref, dq_ref, dq_sc) = _refs(refs, segmented)
  i, j = pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, _F32)

  def _step(diag):
    q, k, v, do = q_ref[0, 0], k_ref[0, 0], v_ref[0, 0], do_ref[0, 0]
    s = _dot(q, k, _NT, precision) * scale                    # [bq, bk]
    mask = _mask(_col(qs_ref), _row(ksr_ref), i * bq, j * bk, s.shape, diag, off,
                 kv_len=kv_len)
    lse = lse_ref[0, 0, 0, :][:, None]                        # [bq, 1]
    p = _masked(mask, jnp.exp(s - lse), 0.0)
    dp = _dot(do, v, _NT, precision)                          # [bq, bk]
    ds = p * (dp + rt_ref[0, 0, 0, :][:, None])
    dq_sc[...] += _dot(ds.astype(k.dtype), k, _NN, precision)

  _run_block(_step, causal, i, j, bq, bk, off)

  @pl.when(j == nk - 1)
  def _finish():
    dq_ref[0, 0] = (dq_sc[...] * scale).astype(dq_ref.dtype)


def bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes=BlockSizes(), interpret=False,
        segmented=True):
  bs = block_sizes.or_defaults(DEFAULT_BLOCK_SIZES)
  finite = jnp.isfinite(lse)
  delta = jnp.einsum("bthd,bthd->bht", dout.astype(_F32), out.astype(_F32), precision=lax.Precision.HIGHEST)
  lse = jnp.where(finite, lse, 0.0)
  rt = jnp.where(finite, dlse.astype(_F32) - delta, 0.0)                  # dlse - rowsum(dO o O)
  args = (q, k, v, dout.astype(q.dtype), q_seg, kv_seg, lse, rt)
  kw = dict(scale=scale, causal=causal, precision=_precision(q.dtype), interpret=_interpret(interpret),
            segmented=segmented)
  dk, dv = _dkv(_Geom(q, k, bs.dkv, causal), *args, **kw)
  dq = _dq(_Geom(q, k, bs.dq, causal), *args, **kw)
  return dq, dk, dv


def _dkv(g, q, k, v, dout, q_seg, kv_seg, lse, rt, *, scale, causal, precision, interpret, segmented):
  """dk, dv on a (B, Hkv, nk, G * nq) grid; step t covers query head kh * G + t // nq, query block t % nq."""
  B, Hkv, G, D, bq, bk, nq, off = g.B, g.Hkv, g.G, g.D, g.bq, g.bk, g.nq, g.off
  if causal:
    q_i = lambda j, t: jnp.maximum(lax.rem(t, _i32(nq)), _q_first(j, bq, bk, nq, off))
  else:
    q_i = lambda j, t: lax.rem(t, _i32(nq))
  head = lambda kh_, t: kh_ * G + lax.div(t, _i32(nq))
  q_spec = pl.BlockSpec((1, 1, bq, D), lambda b, kh_, j, t: (b, head(kh_, t), q_i(j, t), 0))
  kv_spec = pl.BlockSpec((1, 1, bk, D), lambda b, kh_, j, t: (b, kh_, j, 0))
  stat = pl.BlockSpec((1, 1, NUM_SUBLANES, bq), lambda b, kh_, j, t: (b, head(kh_, t), 0, q_i(j, t)))
  kernel = functools.partial(_dkv_kernel, scale=scale, causal=causal, off=off, bq=bq, bk=bk, nq=nq, G=G,
                             precision=precision, segmented=segmented, kv_len=_kv_len(g, causal))
  id_specs = [pl.BlockSpec((1, bk, NUM_LANES), lambda b, kh_, j, t: (b, j, 0)),
              pl.BlockSpec((1, NUM_SUBLANES, bq), lambda b, kh_, j, t: (b, 0, q_i(j, t)))] if segmented else []
  ids = [g.seg_col(kv_seg, g.S, g.Sp), g.seg_row(q_seg, g.T, g.Tp)] if segmented else []
  dk, dv = pl.pallas_call(
      kernel,
      grid=(B, Hkv, g.nk, G * nq),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec, *id_specs, stat, stat],
      out_specs=[kv_spec, kv_spec],
      out_shape=[jax.ShapeDtypeStruct((B, Hkv, g.Sp, D), k.dtype),
                 jax.ShapeDtypeStruct((B, Hkv, g.Sp, D), v.dtype)],
      scratch_shapes=[pltpu.VMEM((bk, D), _F32), pltpu.VMEM((bk, D), _F32)],
      compiler_params=_SEMANTICS,
      interpret=interpret,
      cost_estimate=_dkv_cost(g, q.dtype.itemsize, segmented),
      name="sinkjax_flash_bwd_dkv",
  )(g.heads(q, g.T, g.Tp), g.heads(k, g.S, g.Sp), g.heads(v, g.S, g.Sp), g.heads(dout, g.T, g.Tp), *ids,
    g.row_stat(lse), g.row_stat(rt))
  return jnp.swapaxes(dk[:, :, :g.S], 1, 2), jnp.swapaxes(dv[:, :, :g.S], 1, 2)


def _dq(g, q, k, v, dout, q_seg, kv_seg, lse, rt, *, scale, causal, precision, interpret, segmented):
  """dq on a (B, Hq, nq, nk) grid, kv axis "arbitrary"."""
  q_spec, kv_spec, q_col, kv_row, stat = _query_block_specs(g)
  kernel = functools.partial(_dq_kernel, scale=scale, causal=causal, off=g.off, bq=g.bq, bk=g.bk, nk=g.nk,
                             precision=precision, segmented=segmented, kv_len=_kv_len(g, causal))
  ids = [g.seg_col(q_seg, g.T, g.Tp), g.seg_row(kv_seg, g.S, g.Sp)] if segmented else []
  dq = pl.pallas_call(
      kernel,
      grid=(g.B, g.Hq, g.nq, g.nk),
      in_specs=[q_spec, kv_spec, kv_spec, q_spec] + ([q_col, kv_row] if segmented else []) + [stat, stat],
      out_specs=q_spec,
      out_shape=jax.ShapeDtypeStruct((g.B, g.Hq, g.Tp, g.D), q.dtype),
      scratch_shapes=[pltpu.VMEM((g.bq, g.D), _F32)],
      compiler_params=_SEMANTICS,
      interpret=interpret,
      cost_estimate=_dq_cost(g, q.dtype.itemsize, segmented),
      name="sinkjax_flash_bwd_dq",
  )(g.heads(q, g.T, g.Tp), g.heads(k, g.S, g.Sp), g.heads(v, g.S, g.Sp), g.heads(dout, g.T, g.Tp), *ids,
    g.row_stat(lse), g.row_stat(rt))
  return jnp.swapaxes(dq[:, :, :g.T], 1, 2)
