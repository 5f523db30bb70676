"""Flash attention through cuDNN's fused attention (NVIDIA, Hopper and later), with the LSE gradient.

Implements the backend contract stated in `xla.py` (and used by `flash.py`):
  fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes, interpret, segmented) -> (out, lse)
  bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes, interpret, segmented)
`segmented` (static) says whether the caller passed segment ids; without them the ids are all ones.

The calls are JAX's own cuDNN primitives (`jax._src.cudnn.fused_attention_stablehlo`, the custom calls
`__cudnn$fmhaSoftmax` and `__cudnn$fmhaSoftmaxBackward`), bound directly rather than through
`jax.nn.dot_product_attention`, whose VJP drops the LSE cotangent and whose returned LSE is bf16:
  * forward in training mode: (out, softmax statistics, float32 [B, H, T]); the statistics are the LSE of the scaled
    logits in natural log (max + log sum exp, FlashAttention-2's L), which is this contract's lse.
  * backward: (q, k, v, stats, O, dO) -> (dq, dk, dv). It reads O only through D = rowsum(dO o O) (FlashAttention-2's
    preprocessing), so the LSE cotangent g enters through a substitute output O' with rowsum(dO o O') = D - g
    (`sinkjax.kernels.fold`, which also handles rows with dO = 0 and g != 0). That cuDNN reads O only through D is
    checked on the device by `python -m sinkjax.bench.kernel_check` (gradients unchanged by O + w, w orthogonal to dO).

Masks and segments. Causal masking needs T == S (cuDNN's causal mask is top-left aligned; the contract's bottom-right
one differs when T != S). Segment ids take one of three routes, picked per call at run time (`lax.switch`; each row's
ids must form contiguous runs, one run per id, as packed documents do: see `route`):
  0 plain: every row is one non-padding segment (the `stream` packing's all-ones ids): plain causal cuDNN.
  1 packed: at most MAX_SEGMENTS runs per row, q and kv ids equal (self-attention): cuDNN's packed layout (per-row
    sequence lengths and offsets; Hopper and later); padding tokens (id 0) are in no segment, and their rows are set
    to the contract's (out 0, lse -inf, zero gradients).
  2 otherwise: the `pallas_gpu` (Triton) kernel, forward and backward.
Without segment ids (`segmented=False`) route 0 is taken statically.

Packed statistics: cuDNN's stats tensor then has one row of T per segment ([B * MAX_SEGMENTS, H, T], segments of all
rows in order, each from its own position 0); `_packed_lse` gathers it into [B, H, T] and `_packed_stats` scatters it
back for the backward. This layout is read from JAX's abstract shapes and XLA's cuDNN graph (a padded-batch view of
the segments); the device check compares route 1's LSE with the reference.
"""
from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax._src.cudnn import fused_attention_stablehlo as _fa

from sinkjax.kernels import fold, segments
from sinkjax.kernels.blocks import BlockSizes

MAX_SEGMENTS = 16        # packed route: runs per row cuDNN is compiled for (its stats are B * MAX_SEGMENTS x H x T)
_F32 = jnp.float32
_BTNH = _fa.AttentionLayout.BTNH.value
CUSTOM_CALLS = ("__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward")


def unsupported(q_dtype, head_dim: int, T: int, S: int, causal: bool, pair: bool = False) -> str | None:
  """Why cuDNN cannot run this call (None if it can): dtypes, head dim, causal alignment, paired segment ids."""
  if jnp.dtype(q_dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    return f"cuDNN's fused attention takes bfloat16 or float16 q, k, v; got {jnp.dtype(q_dtype).name}"
  if head_dim % 8 or head_dim > 256:
    return f"cuDNN's fused attention needs a head dim <= 256 and a multiple of 8; got {head_dim}"
  if causal and T != S:
    return f"cuDNN's causal mask is top-left aligned: causal attention needs T == S here (got T={T}, S={S})"
  if pair:
    return "cuDNN pairs packed documents by position: segment ids must be one [B, T] array (self-attention)"
  return None


def _check(q, k, causal, interpret):
  if interpret:
    raise ValueError("impl='cudnn' runs only on NVIDIA GPUs (cuDNN custom calls; there is no interpret mode): use "
                     "impl='xla' or 'reference' elsewhere")
  why = unsupported(q.dtype, q.shape[3], q.shape[1], k.shape[1], causal)
  if why:
    raise ValueError(f"impl='cudnn': {why}; impl='pallas_gpu' takes it")


def _empty(dtype):
  return jnp.zeros((0,), dtype)


# jax 0.12 gave the primitives flex attention's score modifier: their CUDA lowerings require `score_mod_name` and
# `score_mod_jaxpr` (None: no modifier), which jax 0.10 / 0.11 do not know
_SCORE_MOD = "score_mod_name" in inspect.signature(_fa._dot_product_attention_fwd_cuda_lowering).parameters


def _params(scale, mask):
  params = dict(scale=float(scale), seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=mask,
                layout=_BTNH, sliding_window_length=None)
  if _SCORE_MOD:
    params.update(score_mod_name=None, score_mod_jaxpr=None)
  return params


def _mask(causal: bool, packed: bool):
  M = _fa.MaskType
  if packed:
    return M.PADDING_CAUSAL if causal else M.PADDING
  return M.CAUSAL if causal else M.NO_MASK


# ------------------------------------------------------------------------------------------------------ routes


def route(q_seg, kv_seg, M: int = MAX_SEGMENTS):
  """0 (one full segment per row: plain cuDNN), 1 (packed documents, <= M runs per row, one run per id, q and kv ids
  equal: cuDNN's packed layout) or 2 (anything else: the Triton kernel), as an int32 scalar."""
  first = kv_seg[:, :1]
  plain = jnp.all(kv_seg == first) & jnp.all(q_seg == first) & jnp.all(first != 0)
  if q_seg.shape != kv_seg.shape:
    return jnp.where(plain, 0, 2).astype(jnp.int32)
  _, n_runs, _, _ = segments.runs(q_seg, M)
  packed = jnp.all(q_seg == kv_seg) & jnp.all(n_runs <= M) & jnp.all(n_runs == segments.distinct_ids(q_seg))
  return jnp.where(plain, 0, jnp.where(packed, 1, 2)).astype(jnp.int32)


def _seqlens_offsets(seg, heads: int, head_dim: int, M: int):
  """cuDNN's packed-layout operands for one side: sequence lengths [B, M] and element offsets [B, M + 1] of every
  segment, shifted left over the whole batch (cuDNN numbers the segments of all rows in one sequence) and padded
  with 0 / the end of the buffer, as `jax._src.cudnn`'s `_fix_seqlen_offsets` does (with this side's own head
  count: jax 0.10.2 multiplies the kv offsets by the query heads)."""
  B, T = seg.shape
  _, n_runs, lengths, starts = segments.runs(seg, M)
  has = jnp.arange(M)[None, :] < n_runs[:, None]
  seqlen = jnp.where(has, lengths, -1)
  offsets = jnp.where(has, starts + (jnp.arange(B, dtype=jnp.int32) * T)[:, None], -1)
  offsets = jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1)

  def shift_left(x, fill):
    flat = x.reshape(-1)
    idx = jnp.nonzero(flat >= 0, size=flat.size, fill_value=flat.size)[0]
    return jnp.take(flat, idx, fill_value=fill).reshape(x.shape)

  i32 = lambda x: x.astype(jnp.int32)   # cuDNN's operands are int32 (also under jax_enable_x64)
  return i32(shift_left(seqlen, 0)), i32(shift_left(offsets, B * T) * (heads * head_dim))


def _token_slots(seg, M: int):
  """For every token: its segment's global number (segments of all rows in order) and its position in it; [B, T]
  each, valid where seg != 0."""
  run, n_runs, _, starts = segments.runs(seg, M)
  before = jnp.cumsum(n_runs) - n_runs                                       # segments in earlier rows
  safe_run = jnp.clip(run, 0, M - 1)
  glob = before[:, None] + safe_run
  local = jnp.arange(seg.shape[1], dtype=jnp.int32)[None, :] - jnp.take_along_axis(starts, safe_run, axis=1)
  return glob, local


def _packed_lse(stats, seg, M: int):
  """[B * M, H, T] per-segment statistics -> contract lse [B, H, T] (-inf on padding tokens)."""
  glob, local = _token_slots(seg, M)
  lse = stats[glob, :, local]                                                 # [B, T, H]
  lse = jnp.where((seg != 0)[..., None], lse, -jnp.inf)
  return jnp.swapaxes(lse, 1, 2)


def _packed_stats(lse, seg, M: int):
  """The inverse of `_packed_lse` for the backward: contract lse (finite where seg != 0) -> [B * M, H, T]."""
  B, H, T = lse.shape
  glob, local = _token_slots(seg, M)
  glob = jnp.where(seg != 0, glob, B * M)                                     # padding: dropped (out of range)
  vals = jnp.swapaxes(jnp.where(jnp.isfinite(lse), lse, 0.0), 1, 2)           # [B, T, H]
  return jnp.zeros((B * M, H, T), _F32).at[glob, :, local].set(vals, mode="drop")


# ------------------------------------------------------------------------------------------------------ passes


def _fwd_call(q, k, v, causal, scale, packed_operands=None):
  e = _empty(q.dtype)
  seqs = (e, e, e, e) if packed_operands is None else packed_operands
  out, stats = _fa._dot_product_attention_fwd_p.bind(
      q, k, v, e, *seqs, e, e, **_params(scale, _mask(causal, packed_operands is not None)), is_training=True)
  return out, stats


def _bwd_call(q, k, v, stats, out, dout, causal, scale, packed_operands=None):
  e = _empty(q.dtype)
  seqs = (e, e, e, e) if packed_operands is None else packed_operands
  return _fa._dot_product_attention_bwd_p.bind(
      q, k, v, e, *seqs, e, e, stats, out, dout, **_params(scale, _mask(causal, packed_operands is not None)))


def _packed_operands(q, k, q_seg, kv_seg, M):
  q_len, q_off = _seqlens_offsets(q_seg, q.shape[2], q.shape[3], M)
  kv_len, kv_off = _seqlens_offsets(kv_seg, k.shape[2], k.shape[3], M)
  return q_len, kv_len, q_off, kv_off


def _plain_fwd(q, k, v, causal, scale):
  out, stats = _fwd_call(q, k, v, causal, scale)
  return out, stats.astype(_F32)


def _packed_fwd(q, k, v, q_seg, kv_seg, causal, scale, M):
  out, stats = _fwd_call(q, k, v, causal, scale, _packed_operands(q, k, q_seg, kv_seg, M))
  valid = (q_seg != 0)[:, :, None, None]
  return jnp.where(valid, out, 0).astype(q.dtype), _packed_lse(stats.astype(_F32), q_seg, M)


def _fallback():
  from sinkjax.kernels import pallas_gpu  # pylint: disable=import-outside-toplevel
  return pallas_gpu


def fwd(q, k, v, q_seg, kv_seg, *, causal, scale, block_sizes=BlockSizes(), interpret=None, segmented=True,
        max_segments: int = MAX_SEGMENTS):
  """(out, lse) of the backend contract."""
  _check(q, k, causal, interpret)
  if not segmented:
    return _plain_fwd(q, k, v, causal, scale)
  branches = [
      lambda q, k, v, qs, ks: _plain_fwd(q, k, v, causal, scale),
      lambda q, k, v, qs, ks: _packed_fwd(q, k, v, qs, ks, causal, scale, max_segments),
      lambda q, k, v, qs, ks: _fallback().fwd(q, k, v, qs, ks, causal=causal, scale=scale, block_sizes=block_sizes,
                                              interpret=False),
  ]
  if q_seg.shape != kv_seg.shape:
    branches[1] = branches[2]
  return lax.switch(route(q_seg, kv_seg, max_segments), branches, q, k, v, q_seg, kv_seg)


def bwd(q, k, v, q_seg, kv_seg, out, lse, dout, dlse, *, causal, scale, block_sizes=BlockSizes(), interpret=None,
        segmented=True, max_segments: int = MAX_SEGMENTS):
  """(dq, dk, dv): cuDNN's backward given O' and dO' (`fold`), so that dS = P o (dP - D + g)."""
  _check(q, k, causal, interpret)
  finite = jnp.isfinite(lse)
  g = jnp.where(finite, dlse, 0.0)

  def plain(q, k, v, qs, ks, out, lse, dout, g):
    o2, do2 = fold.fold_lse_cotangent(out, dout, g, q.dtype)
    return tuple(_bwd_call(q, k, v, jnp.where(jnp.isfinite(lse), lse, 0.0), o2, do2, causal, scale))

  def packed(q, k, v, qs, ks, out, lse, dout, g):
    o2, do2 = fold.fold_lse_cotangent(out, dout, g, q.dtype)
    stats = _packed_stats(lse, qs, max_segments)
    dq, dk, dv = _bwd_call(q, k, v, stats, o2, do2, causal, scale, _packed_operands(q, k, qs, ks, max_segments))
    zero_pad = lambda x, s: jnp.where((s != 0)[:, :, None, None], x, 0).astype(x.dtype)
    return zero_pad(dq, qs), zero_pad(dk, ks), zero_pad(dv, ks)

  def fallback(q, k, v, qs, ks, out, lse, dout, g):
    return tuple(_fallback().bwd(q, k, v, qs, ks, out, lse, dout, g, causal=causal, scale=scale,
                                 block_sizes=block_sizes, interpret=False))

  args = (q, k, v, q_seg, kv_seg, out, lse, dout, g)
  if not segmented:
    return plain(*args)
  branches = [plain, packed if q_seg.shape == kv_seg.shape else fallback, fallback]
  return lax.switch(route(q_seg, kv_seg, max_segments), branches, *args)
