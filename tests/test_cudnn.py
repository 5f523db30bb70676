"""The cudnn backend (`sinkjax.kernels.cudnn`) without a GPU: its segment routes and packed-layout operands checked
by hand and against JAX's own `_fix_seqlen_offsets`, its refusals, `impl="auto"` on Hopper, and the backend compiled
for compile-only H100 devices (JAX's CUDA plugin, the `gpu` extra): cuDNN's fused forward and backward custom calls
in the program, with the LSE gradient. Its numbers are checked on a GPU by `python -m sinkjax.bench.kernel_check`."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.cudnn import fused_attention_stablehlo as fa
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sinkjax import compile as compile_lib
from sinkjax import hlo as hlo_lib
from sinkjax.kernels import cudnn, flash
from sinkjax.kernels import flash_attention

needs_plugin = pytest.mark.skipif(
    not compile_lib.cuda_plugin_installed(),
    reason="JAX's CUDA plugin is not installed (the `gpu` extra, ~5.5 GB; CI's `.[test]` leaves it out): "
           "pip install 'sinkjax[gpu]' for the cuDNN compile tests")
FWD, BWD = cudnn.CUSTOM_CALLS


_route = jax.jit(cudnn.route, static_argnums=2)


def test_routes_by_hand():
  one = jnp.ones((2, 8), jnp.int32)
  docs = jnp.array([[1, 1, 2, 2, 2, 3, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]], jnp.int32)
  assert int(_route(one, one, 16)) == 0
  assert int(_route(7 * one, 7 * one, 16)) == 0                      # any non-zero id
  assert int(_route(docs, docs, 16)) == 1
  assert int(_route(docs, docs, 2)) == 2                       # three runs in row 0 > M
  repeated = jnp.array([[1, 1, 2, 2, 1, 1, 0, 0], [1] * 8], jnp.int32)  # id 1 in two runs: one document to the contract
  assert int(_route(repeated, repeated, 16)) == 2
  assert int(_route(docs, docs.at[0, 1].set(2), 16)) == 2            # q and kv ids differ
  assert int(_route(one.at[1, 7].set(0), one.at[1, 7].set(0), 16)) == 1   # one document and a padding token


def test_packed_operands_match_jax_for_mha_and_count_kv_heads_for_gqa():
  """MHA: the same sequence lengths and offsets as jax's `_fix_seqlen_offsets` given the [B, M] / [B, M + 1] form
  its docstring describes; GQA: the kv offsets count the kv heads (jax 0.10.2 multiplies them by the query heads)."""
  B, T, H, D, M = 2, 8, 4, 16, 4
  seg = jnp.array([[1, 1, 2, 2, 2, 3, 0, 0], [4, 4, 4, 4, 4, 4, 5, 5]], jnp.int32)
  seqlen, offsets = jax.jit(cudnn._seqlens_offsets, static_argnums=(1, 2, 3))(seg, H, D, M)
  jax_seqlen = jnp.array([[2, 3, 1, -1], [6, 2, -1, -1]], jnp.int32)
  jax_offsets = jnp.array([[0, 2, 5, -1, -1], [0, 6, -1, -1, -1]], jnp.int32)
  q = jnp.zeros((B, T, H, D), jnp.bfloat16)
  want = jax.jit(fa._fix_seqlen_offsets)(jax_seqlen, jax_seqlen, jax_offsets, jax_offsets, q, q)
  np.testing.assert_array_equal(seqlen, want[0])
  np.testing.assert_array_equal(offsets, want[2])
  assert seqlen.reshape(-1).tolist() == [2, 3, 1, 6, 2, 0, 0, 0]
  assert (offsets.reshape(-1) // (H * D)).tolist() == [0, 2, 5, 8, 14] + [B * T] * 5
  _, kv_offsets = jax.jit(cudnn._seqlens_offsets, static_argnums=(1, 2, 3))(seg, 1, D, M)
  assert (kv_offsets.reshape(-1)[:5] // D).tolist() == [0, 2, 5, 8, 14]


def test_packed_stats_layout_round_trip():
  """Segment g's statistics sit in row g, from its own position 0: token (b, t) of the 3rd segment overall (row 0's
  third) at t = 5 reads stats[2, h, 0]; padding tokens read -inf; the backward's scatter inverts the gather."""
  B, T, H, M = 2, 8, 3, 4
  seg = jnp.array([[1, 1, 2, 2, 2, 3, 0, 0], [4, 4, 4, 4, 4, 4, 5, 5]], jnp.int32)
  stats = jax.random.normal(jax.random.PRNGKey(0), (B * M, H, T))
  lse = jax.jit(cudnn._packed_lse, static_argnums=2)(stats, seg, M)
  np.testing.assert_array_equal(lse[0, :, 5], stats[2, :, 0])
  np.testing.assert_array_equal(lse[0, :, 3], stats[1, :, 1])
  np.testing.assert_array_equal(lse[1, :, 7], stats[4, :, 1])          # row 1's second segment is the 5th overall
  assert np.all(np.isneginf(np.asarray(lse[0, :, 6:])))
  back = jax.jit(cudnn._packed_stats, static_argnums=2)(lse, seg, M)
  np.testing.assert_array_equal(jax.jit(cudnn._packed_lse, static_argnums=2)(back, seg, M), lse)


def test_unsupported_calls_say_why():
  assert "bfloat16" in cudnn.unsupported(jnp.float32, 128, 64, 64, True)
  assert "head dim" in cudnn.unsupported(jnp.bfloat16, 100, 64, 64, True)
  assert "T == S" in cudnn.unsupported(jnp.bfloat16, 128, 32, 64, True)
  assert cudnn.unsupported(jnp.bfloat16, 128, 32, 64, False) is None
  assert "one [B, T] array" in cudnn.unsupported(jnp.bfloat16, 128, 64, 64, True, pair=True)
  q = jnp.zeros((1, 16, 2, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match="only on NVIDIA GPUs"):        # on this CPU
    flash_attention(q, q, q, impl="cudnn")


def test_hopper_or_later_by_name_and_capability():
  class Dev:
    def __init__(self, kind, cc=None):
      self.device_kind, self.compute_capability = kind, cc
  assert flash.hopper_or_later(Dev("NVIDIA H100 80GB HBM3"))
  assert flash.hopper_or_later(Dev("NVIDIA H200"))
  assert flash.hopper_or_later(Dev("NVIDIA GH200 480GB"))
  assert flash.hopper_or_later(Dev("NVIDIA B200"))
  assert not flash.hopper_or_later(Dev("NVIDIA A100-SXM4-80GB"))
  assert flash.hopper_or_later(Dev("whatever", "9.0")) and not flash.hopper_or_later(Dev("NVIDIA H100", "8.0"))
  # auto is cuDNN on Hopper and later since the device check (flash.CUDNN_IN_AUTO), Triton before
  assert flash.default_impl("gpu", Dev("NVIDIA H100 80GB HBM3")) == "cudnn"
  assert flash.default_impl("gpu", Dev("NVIDIA H200")) == "cudnn"
  assert flash.default_impl("gpu", Dev("whatever", "9.0")) == "cudnn"
  assert flash.default_impl("gpu", Dev("NVIDIA A100-SXM4-80GB")) == "pallas_gpu"


def test_auto_order_follows_the_switches(monkeypatch):
  """The device run's decisions are two switches: cuDNN off puts Hopper back on Triton; Mosaic GPU on (where tokamax
  is installed) puts it ahead of cuDNN on Hopper only."""
  class Dev:
    device_kind, compute_capability = "NVIDIA H100 80GB HBM3", None
  assert flash.MOSAIC_IN_AUTO is False      # tokamax's kernels measured slower than cuDNN on the H200: not in auto
  monkeypatch.setattr(flash, "CUDNN_IN_AUTO", False)
  assert flash.default_impl("gpu", Dev()) == "pallas_gpu"
  monkeypatch.setattr(flash, "CUDNN_IN_AUTO", True)
  monkeypatch.setattr(flash, "MOSAIC_IN_AUTO", True)
  monkeypatch.setattr(flash, "_tokamax_installed", lambda: True)
  assert flash.default_impl("gpu", Dev()) == "mosaic_gpu"
  monkeypatch.setattr(flash, "_tokamax_installed", lambda: False)
  assert flash.default_impl("gpu", Dev()) == "cudnn"
  Dev.device_kind = "NVIDIA A100-SXM4-80GB"
  monkeypatch.setattr(flash, "_tokamax_installed", lambda: True)
  assert flash.default_impl("gpu", Dev()) == "pallas_gpu"


def _h100_mesh(n=1):
  devices = compile_lib.gpu_devices(compile_lib.parse_topology(f"h100:{n}"))
  return Mesh(np.array(devices).reshape(n, 1, 1), ("data", "fsdp", "tensor"))


def _targets(hlo):
  return re.findall(r'custom_call_target="([^"]+)"', hlo)


@needs_plugin
@pytest.mark.parametrize("segmented", [False, True], ids=["no_segments", "segments"])
def test_cudnn_compiles_for_h100_with_the_lse_gradient(segmented):
  """Sink-style loss through out and LSE, GQA 8:2, bf16, D 128, under a mesh of two compile-only H100s: impl="auto" is
  cuDNN's fused forward and backward (no Triton call without segment ids; with them, the Triton fallback of route 2
  beside cuDNN's plain and packed calls)."""
  mesh = _h100_mesh(2)
  sh = NamedSharding(mesh, P("data"))
  B, T, Hq, Hkv, D = 2, 512, 8, 2, 128
  q = jax.ShapeDtypeStruct((B, T, Hq, D), jnp.bfloat16, sharding=sh)
  kv = jax.ShapeDtypeStruct((B, T, Hkv, D), jnp.bfloat16, sharding=sh)
  seg = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sh)

  def loss(q, k, v, s):
    out, lse = flash_attention(q, k, v, segment_ids=s if segmented else None)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jax.nn.sigmoid(lse))

  with jax.set_mesh(mesh):
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, seg).compile().as_text()
  targets = _targets(hlo)
  assert FWD in targets and BWD in targets and "callback" not in hlo
  assert ("__gpu$xla.gpu.triton" in targets) == segmented
  assert hlo_lib.attention_kernel(hlo, "auto") == "cudnn"


@needs_plugin
def test_auto_falls_back_to_triton_where_cudnn_cannot():
  """float32 inputs (cuDNN takes bf16/f16) on an H100: impl="auto" compiles the Triton kernel, no cuDNN call."""
  mesh = _h100_mesh(1)
  spec = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.float32, sharding=NamedSharding(mesh, P()))
  with jax.set_mesh(mesh):
    hlo = jax.jit(jax.grad(lambda q: jnp.sum(flash_attention(q, q, q)[1]))).lower(spec).compile().as_text()
  targets = _targets(hlo)
  assert "__gpu$xla.gpu.triton" in targets and FWD not in targets


class _EmulatedCudnn:
  """cuDNN's two custom calls emulated on the CPU, from their operands alone, with the `xla` backend (whose backward
  reads O only through D, as cuDNN's does): plain calls as causal attention over whole rows; packed calls decode the
  segments from cuDNN's own operands (shifted-left lengths and element offsets) and keep the statistics one row of T
  per segment, NaN wherever cuDNN leaves memory unwritten (padding rows of out and of the gradients)."""

  def __init__(self, M):
    self.M = M

  def segments(self, q_len, q_off, B, T, H, D):
    """[B, T] ids (1 + segment number, 0 outside) and [B, T] (segment number, position in it) from the operands."""
    lens = q_len.reshape(-1)
    starts = q_off.reshape(-1)[:lens.size] // (H * D)          # [B, M + 1] offsets: the segments' come first
    pos = jnp.arange(B * T)
    inside = (pos[None, :] >= starts[:, None]) & (pos[None, :] < starts[:, None] + lens[:, None]) & \
        (lens[:, None] > 0)                                                  # [segments, B * T]
    seg_no = jnp.argmax(inside, axis=0)
    ids = jnp.where(inside.any(0), seg_no + 1, 0).reshape(B, T)
    local = (pos - starts[seg_no]).reshape(B, T)
    return ids, seg_no.reshape(B, T), local

  def fwd(self, q, k, v, causal, scale, packed=None):
    from sinkjax.kernels import xla
    B, T, H, D = q.shape
    if packed is None:
      ones = jnp.ones((B, T), jnp.int32)
      return xla.fwd(q, k, v, ones, ones, causal=causal, scale=scale)
    ids, seg_no, local = self.segments(packed[0], packed[2], B, T, H, D)
    out, lse = xla.fwd(q, k, v, ids, ids, causal=causal, scale=scale)
    stats = jnp.full((B * self.M, H, T), jnp.nan).at[seg_no, :, local].set(
        jnp.where((ids != 0)[..., None], jnp.swapaxes(lse, 1, 2), jnp.nan))
    return jnp.where((ids != 0)[:, :, None, None], out, jnp.nan), stats

  def bwd(self, q, k, v, stats, out, dout, causal, scale, packed=None):
    from sinkjax.kernels import xla
    B, T, H, D = q.shape
    zero = jnp.zeros((B, H, T))
    if packed is None:
      ones = jnp.ones((B, T), jnp.int32)
      return xla.bwd(q, k, v, ones, ones, out, stats, dout, zero, causal=causal, scale=scale)
    ids, seg_no, local = self.segments(packed[0], packed[2], B, T, H, D)
    lse = jnp.swapaxes(stats[seg_no, :, local], 1, 2)
    grads = xla.bwd(q, k, v, ids, ids, out, jnp.where((ids != 0)[:, None, :], lse, -jnp.inf), dout, zero,
                    causal=causal, scale=scale)
    return tuple(jnp.where((ids != 0)[:, :, None, None], g, jnp.nan) for g in grads)


def _emulate_cudnn(monkeypatch):
  """The cudnn backend's custom calls replaced by `_EmulatedCudnn`, its fallback route by `xla`."""
  from sinkjax.kernels import xla
  emu = _EmulatedCudnn(cudnn.MAX_SEGMENTS)
  monkeypatch.setattr(cudnn, "_fwd_call", lambda q, k, v, causal, scale, packed_operands=None:
                      emu.fwd(q, k, v, causal, scale, packed_operands))
  monkeypatch.setattr(cudnn, "_bwd_call", lambda q, k, v, stats, out, dout, causal, scale, packed_operands=None:
                      emu.bwd(q, k, v, stats, out, dout, causal, scale, packed_operands))
  monkeypatch.setattr(cudnn, "_fallback", lambda: xla)


@pytest.mark.parametrize("kind", ["none", pytest.param("ones", marks=pytest.mark.slow), "docs",
                                  pytest.param("many_docs", marks=pytest.mark.slow)])
def test_backend_end_to_end_with_emulated_cudnn(kind, monkeypatch):
  """The cudnn backend through `flash_attention` (its custom_vjp, routes, packed operands, statistics gather and
  scatter, padding masks, the O' fold) on the emulated custom calls, against the reference's autodiff: out, lse and
  dq, dk, dv of a loss through both outputs, GQA 4:2, bf16. `many_docs` takes route 2 (the fallback, here `xla`)."""
  from sinkjax.bench import kernel_check
  _emulate_cudnn(monkeypatch)
  B, T, Hq, Hkv, D = 2, 64, 4, 2, 16
  q, k, v, w, u, _ = kernel_check._inputs(B, T, Hq, Hkv, D, jnp.bfloat16)
  seg = kernel_check.segments(kind, B, T)
  expected_route = {"none": None, "ones": 0, "docs": 1, "many_docs": 2}[kind]
  if seg is not None:
    assert int(_route(seg, seg, cudnn.MAX_SEGMENTS)) == expected_route

  def loss(q, k, v, impl):
    out, lse = flash_attention(q, k, v, segment_ids=seg, impl=impl, interpret=False)
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u), (out, lse)

  grad = lambda impl: jax.jit(lambda q, k, v: jax.value_and_grad(loss, (0, 1, 2), has_aux=True)(q, k, v, impl))
  (_, (o1, l1)), g1 = grad("cudnn")(q, k, v)
  (_, (o0, l0)), g0 = grad("reference")(q, k, v)
  for name, a, b in (("out", o1, o0), ("lse", l1, l0)) + tuple(zip(("dq", "dk", "dv"), g1, g0)):
    err = kernel_check._rel(a, b)
    assert err < 2e-2, (name, err)


def test_packed_operands_are_int32_under_x64():
  with jax.enable_x64(True):
    seg = jnp.array([[1, 1, 2, 0]], jnp.int32)
    seqlen, offsets = jax.jit(cudnn._seqlens_offsets, static_argnums=(1, 2, 3))(seg, 2, 8, 4)
    assert seqlen.dtype == offsets.dtype == jnp.int32


def test_primitives_lower_for_cuda_on_the_installed_jax():
  """The forward and backward custom calls, bound with `_params`, through jax's own CUDA lowering rules (no plugin or
  GPU needed; runs on both CI legs): jax 0.12's rules require `score_mod_name` / `score_mod_jaxpr`, which jax 0.10 /
  0.11 do not take, and a call missing them failed only at lowering (the cuDNN compile tests, which need the plugin)."""
  qs = jax.ShapeDtypeStruct((1, 256, 4, 64), jnp.bfloat16)
  stats = jax.ShapeDtypeStruct((1, 4, 256), jnp.float32)
  fwd = jax.jit(lambda q, k, v: cudnn._fwd_call(q, k, v, True, 0.125))
  bwd = jax.jit(lambda q, k, v, s, o, do: cudnn._bwd_call(q, k, v, s, o, do, True, 0.125))
  for fn, args, target in ((fwd, (qs, qs, qs), "__cudnn$fmhaSoftmax"),
                           (bwd, (qs, qs, qs, stats, qs, qs), "__cudnn$fmhaSoftmaxBackward")):
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert re.findall(r'custom_call @(__cudnn\$\w+)', text) == [target]


@pytest.mark.parametrize("kind", ["none", "docs"])
def test_float16_large_lse_cotangent_and_nan_padding_with_emulated_cudnn(kind, monkeypatch):
  """float16 (which cuDNN takes; largest value 65,504) through the whole backend on the emulated calls: rows with
  dO = 0 and a large LSE cotangent (300: the fold's substitute rows, whose O' overflowed float16 at 2^39 before), and,
  with packed documents, NaN in the padding rows of q, k and v. Against the reference's autodiff in float32 on the
  same float16 inputs (padding rows zero there), relative to each value's largest."""
  from sinkjax.bench import kernel_check
  from sinkjax.kernels import reference
  _emulate_cudnn(monkeypatch)
  B, T, Hq, Hkv, D = 2, 64, 4, 2, 16
  q, k, v, w, u, _ = kernel_check._inputs(B, T, Hq, Hkv, D, jnp.float16)
  u = u * 300.0                                                 # large g; w is 0 on every 7th row (dO = 0)
  seg = kernel_check.segments(kind, B, T)
  pad = jnp.zeros((B, T, 1, 1), bool) if seg is None else (seg == 0)[:, :, None, None]
  q0, k0, v0 = (jnp.where(pad, jnp.zeros((), x.dtype), x) for x in (q, k, v))
  qn, kn, vn = (jnp.where(pad, jnp.array(jnp.nan, x.dtype), x) for x in (q, k, v))
  ids = jnp.ones((B, T), jnp.int32) if seg is None else seg

  def loss(out, lse):
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u), (out, lse)

  run = jax.jit(jax.value_and_grad(lambda q, k, v: loss(*flash_attention(q, k, v, segment_ids=seg, impl="cudnn",
                                                                         interpret=False)), (0, 1, 2), has_aux=True))
  ref = jax.jit(jax.value_and_grad(lambda q, k, v: loss(*reference.attention(q, k, v, ids, ids, causal=True,
                                                                             scale=D ** -0.5)), (0, 1, 2),
                                   has_aux=True))
  (_, (o1, l1)), g1 = run(qn, kn, vn)
  f32 = lambda x: x.astype(jnp.float32)
  (_, (o0, l0)), g0 = ref(f32(q0), f32(k0), f32(v0))
  assert float(jnp.max(jnp.abs(g0[0]))) > 50                   # the large g dominates dq
  for name, a, b in (("out", o1, o0), ("lse", l1, l0)) + tuple(zip(("dq", "dk", "dv"), g1, g0)):
    err = kernel_check._rel(a, b)
    assert err < 1e-2, (name, err)
