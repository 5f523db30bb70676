"""The Mosaic-GPU backend (`impl="mosaic_gpu"`, tokamax's Pallas Mosaic-GPU kernels) against the float64 oracle
through its CPU-runnable form, and its kernels lowered for a compile-only H100 (nothing runs on a GPU here).

On the CPU the backend's two calls run tokamax's XLA forward (the same residuals (m, l) as the kernel) and a
FlashAttention-2 backward that reads O only through D = rowsum(dO o O), as tokamax's sm90 backward does: the LSE
cotangent reaches q and k only through sinkjax's fold (`sinkjax.kernels.fold`). tokamax needs Python >= 3.12: on the
Python 3.11 leg these tests skip with that reason."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tokamax", reason="impl='mosaic_gpu' needs tokamax (Python >= 3.12, jax >= 0.11.1)")

from sinkjax.kernels import flash_attention, segments  # noqa: E402
from tests.helpers import compile_only_gpu  # noqa: E402
from tests.test_kernels import make_inputs, packed_segments  # noqa: E402


def _loss(q, k, v, w, u, **kw):
  out, lse = flash_attention(q, k, v, **kw)
  return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(lse), jnp.sin(lse), 0.0) * u)


def _against_float64(seg, T=48, S=None, Hq=4, Hkv=2, D=16, causal=True, tol=2e-5):
  """out, lse and the gradients of both (through sin(lse)) of mosaic_gpu in float32 against the reference in
  float64 (jax_enable_x64 on for the oracle only)."""
  q, k, v, w, u = make_inputs(B=seg.shape[0] if seg is not None and not isinstance(seg, tuple) else 2, T=T, S=S,
                              Hq=Hq, Hkv=Hkv, D=D)
  kw = dict(causal=causal, segment_ids=seg)
  out, lse = jax.jit(functools.partial(flash_attention, impl="mosaic_gpu", **kw))(q, k, v)
  grads = jax.jit(jax.grad(functools.partial(_loss, impl="mosaic_gpu", **kw), (0, 1, 2)))(q, k, v, w, u)
  with jax.enable_x64(True):
    q64, k64, v64, w64, u64 = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, w, u))
    out_r, lse_r = flash_attention(q64, k64, v64, impl="reference", **kw)
    ref = jax.grad(functools.partial(_loss, impl="reference", **kw), (0, 1, 2))(q64, k64, v64, w64, u64)
    out_r, lse_r, ref = np.asarray(out_r), np.asarray(lse_r), [np.asarray(g) for g in ref]
  finite = np.isfinite(lse_r)
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  np.testing.assert_allclose(np.asarray(out), out_r, atol=tol, rtol=tol, err_msg="out")
  np.testing.assert_allclose(np.where(finite, lse, 0), np.where(finite, lse_r, 0), atol=tol, rtol=tol, err_msg="lse")
  for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
    np.testing.assert_allclose(np.asarray(g), r, atol=tol * np.abs(r).max(), rtol=0, err_msg=name)
  return grads


def test_document_ranges_by_hand():
  seg = jnp.array([[1, 1, 2, 2, 2, 0, 0], [0, 3, 3, 0, 4, 4, 4]], jnp.int32)
  start, end = segments.document_ranges(seg)
  np.testing.assert_array_equal(start, [[0, 0, 2, 2, 2, 0, 0], [0, 1, 1, 0, 4, 4, 4]])
  np.testing.assert_array_equal(end, [[2, 2, 5, 5, 5, 0, 0], [0, 3, 3, 0, 7, 7, 7]])
  # routes: one segment per row -> 0; packed documents -> 1; an id in two runs, or paired ids -> 2
  assert int(segments.route(jnp.ones((2, 7), jnp.int32), jnp.ones((2, 7), jnp.int32))) == 0
  assert int(segments.route(seg, seg)) == 1
  twice = jnp.array([[1, 1, 2, 2, 1, 1, 1]], jnp.int32)
  assert int(segments.route(twice, twice)) == 2
  assert int(segments.route(jnp.ones((1, 5), jnp.int32), jnp.ones((1, 7), jnp.int32))) == 0
  assert int(segments.route(seg[:1, :5], seg[:1])) == 2


def test_packed_documents_gqa_against_float64():
  """Route 1 (per-query key ranges): three documents, padding, a one-document row; GQA 4:2."""
  _against_float64(packed_segments(2, 48))


def test_plain_and_fallback_routes_against_float64():
  """Route 0 (no segment ids: tokamax's causal mask alone), cross-attention T != S (bottom-right causal offset),
  and route 2 (an id in two runs: sinkjax's blockwise xla backend)."""
  _against_float64(None, Hq=3, Hkv=1)
  _against_float64(None, T=24, S=40, causal=True)
  twice = jnp.array([[1] * 10 + [2] * 20 + [1] * 18, [4] * 48], jnp.int32)
  _against_float64(twice)


def test_lse_cotangent_reaches_q_and_k_only_through_the_fold(monkeypatch):
  """A loss of the LSE alone (dout = 0) gives the reference's dq, dk and dv = 0 (to the fold's substitute direction,
  2^-40 of the cotangent: `fold`); without the fold (O' = O) the backward, which reads O only through D, would return
  zero dq and dk."""
  q, k, v, _, u = make_inputs(T=32)
  seg = packed_segments(2, 32)

  def grads(impl):
    def loss(q, k, v):
      lse = flash_attention(q, k, v, causal=True, segment_ids=seg, impl=impl)[1]
      return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u)
    return jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v)

  ref, got = grads("reference"), grads("mosaic_gpu")
  for name, a, b in zip(("dq", "dk", "dv"), got, ref):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5 * float(jnp.abs(b).max()) + 1e-7, err_msg=name)
  assert float(jnp.abs(got[0]).max()) > 0 and float(jnp.abs(got[2]).max()) < 2.0 ** -30
  from sinkjax.kernels import fold  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(fold, "fold_lse_cotangent", lambda out, dout, g, dtype=None: (out, dout))
  unfolded = grads("mosaic_gpu")
  assert float(jnp.abs(unfolded[0]).max()) == 0.0 and float(jnp.abs(unfolded[1]).max()) == 0.0


def test_cpu_backward_reads_out_only_through_d():
  """The property the fold rests on, for the CPU form (tokamax's sm90 backward: `delta = einsum(out, dout)`; on a GPU
  `sinkjax.bench.kernel_check` checks the kernel): gradients unchanged when O moves orthogonally to dO."""
  from sinkjax.kernels import mosaic_gpu  # pylint: disable=import-outside-toplevel
  q, k, v, w, _ = make_inputs(T=16)
  base = mosaic_gpu._tokamax()[0]                                   # pylint: disable=protected-access
  mask = base.Mask(causal_mask=base.CausalMask())
  out, (m, l) = base.DotProductAttention()(q, k, v, mask=mask, return_residuals=True)
  dout = w.astype(out.dtype)
  ortho = jax.random.normal(jax.random.PRNGKey(3), out.shape)
  ortho = ortho - jnp.sum(ortho * dout, -1, keepdims=True) / jnp.sum(dout * dout, -1, keepdims=True) * dout
  a = mosaic_gpu._cpu_vjp((m, l), out, dout, q, k, v, mask=mask, logits_scale=0.25)    # pylint: disable=protected-access
  b = mosaic_gpu._cpu_vjp((m, l), out + ortho, dout, q, k, v, mask=mask, logits_scale=0.25)  # noqa: E501  pylint: disable=protected-access
  for name in "qkv":
    np.testing.assert_allclose(np.asarray(a[name]), np.asarray(b[name]), atol=1e-5, err_msg=name)


def test_unsupported_inputs_are_named():
  q, k, v, _, _ = make_inputs(T=16)
  spec = jax.ShapeDtypeStruct(q.shape, jnp.float32)
  with compile_only_gpu(), pytest.raises(ValueError, match="mosaic_gpu.*bfloat16 or float16.*float32"):
    jax.jit(functools.partial(flash_attention, impl="mosaic_gpu", interpret=False)).trace(spec, spec, spec)


def test_lowers_for_a_compile_only_h100():
  """Forward and gradient (LSE cotangent included) lowered for CUDA without a GPU: tokamax's Mosaic-GPU kernels, one
  forward custom call and the backward's two (dq; dk, dv) in the gradient."""
  B, T, Hq, Hkv, D = 1, 1024, 4, 2, 128
  qs, ks = (jax.ShapeDtypeStruct((B, T, h, D), jnp.bfloat16) for h in (Hq, Hkv))
  attn = functools.partial(flash_attention, causal=True, impl="mosaic_gpu")

  def loss(q, k, v):
    out, lse = attn(q, k, v)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jax.nn.sigmoid(lse))

  counts = []
  for f in (attn, jax.grad(loss, argnums=(0, 1, 2))):
    with compile_only_gpu():
      text = jax.jit(f).trace(qs, ks, ks).lower(lowering_platforms=("cuda",)).as_text()
    counts.append(len(re.findall(r"custom_call @mosaic_gpu", text)))
  assert counts == [1, 3]


def test_non_causal_against_float64():
  """Non-causal calls (tokamax's empty mask, whose `as_array` is None: the CPU backward took it as an array before),
  without ids, with packed documents (every route is traced: `lax.switch`) and cross-attention."""
  _against_float64(None, causal=False)
  _against_float64(packed_segments(2, 48), causal=False)
  _against_float64(None, T=24, S=40, causal=False)


def test_non_causal_lowers_for_a_compile_only_h100(monkeypatch):
  """The GPU path's routes for non-causal calls, forward and gradient, with packed-document ids (both kernel routes
  traced): tokamax runs non-causal forwards as a persistent kernel sized by the device's SM count, which a
  compile-only device lacks (given here: an H100's 132)."""
  import types  # pylint: disable=import-outside-toplevel
  from tokamax._src import mosaic_gpu as tk_mosaic  # pylint: disable=import-outside-toplevel
  monkeypatch.setattr(tk_mosaic, "backend", types.SimpleNamespace(
      get_default_device=lambda: types.SimpleNamespace(core_count=132)))
  qs, ks = (jax.ShapeDtypeStruct((1, 256, h, 64), jnp.bfloat16) for h in (4, 2))
  seg = jax.ShapeDtypeStruct((1, 256), jnp.int32)
  attn = functools.partial(flash_attention, causal=False, impl="mosaic_gpu")

  def loss(q, k, v, s):
    out, lse = attn(q, k, v, segment_ids=s)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  counts = []
  for f in (lambda q, k, v, s: attn(q, k, v, segment_ids=s), jax.grad(loss, argnums=(0, 1, 2))):
    with compile_only_gpu():
      text = jax.jit(f).trace(qs, ks, ks, seg).lower(lowering_platforms=("cuda",)).as_text()
    counts.append(len(re.findall(r"custom_call @mosaic_gpu", text)))
  assert counts == [2, 6]                   # two forward routes; in the gradient theirs and two backward calls each


def test_float16_backward_with_large_lse_cotangent():
  """float16 (which the Mosaic-GPU kernels take) with dO = 0 rows and a large LSE cotangent (300): the backend's
  backward (the fold's substitute in float16, `fold.bits`, then the CPU form's FA2 backward; tokamax's XLA forward
  has no float16 CPU matmul, so out and lse come from the reference) against the reference's autodiff in float32 on
  the same float16 inputs, relative to each gradient's largest value (packed documents: the key-range route)."""
  from sinkjax.bench import kernel_check  # pylint: disable=import-outside-toplevel
  from sinkjax.kernels import mosaic_gpu, reference  # pylint: disable=import-outside-toplevel
  B, T, H, D = 2, 32, 2, 16
  q, k, v, w, u, _ = kernel_check._inputs(B, T, H, H, D, jnp.float16)   # pylint: disable=protected-access
  u = u * 300.0                                                 # w is 0 on every 7th row: dO = 0 there
  seg = packed_segments(B, T)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  attn = lambda q, k, v: reference.attention(q, k, v, seg, seg, causal=True, scale=D ** -0.5)
  (out, lse), vjp = jax.vjp(attn, *f32)
  want = vjp((w, jnp.where(jnp.isfinite(lse), u, 0.0)))
  got = jax.jit(lambda *a: mosaic_gpu.bwd(*a, causal=True, scale=D ** -0.5, interpret=True))(
      q, k, v, seg, seg, out.astype(jnp.float16), lse, w.astype(jnp.float16), u)
  assert float(jnp.max(jnp.abs(want[0]))) > 50
  for name, a, b in zip(("dq", "dk", "dv"), got, want):
    err = kernel_check._rel(a, b)                                # pylint: disable=protected-access
    assert err < 1e-2, (name, err)
