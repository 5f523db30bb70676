"""The LSE cotangent folded into the output (`sinkjax.kernels.fold`): a backward that sees only (O', dO') and no LSE
cotangent returns the gradients of (O, dO, g). Checked through the `xla` backend's backward (which reads O only
through rowsum(dO o O), as cuDNN's does) against the materialized reference differentiated by JAX autodiff (an
independent oracle), with rows of every kind: ordinary, dO = 0 with g != 0, dO tiny next to g, dO = 0 and g = 0,
padding (lse = -inf), and a g of 1e10."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sinkjax.kernels import fold, reference, xla
from tests.test_kernels import assert_close, make_inputs, packed_segments


def _reference_grads(q, k, v, seg, dout, dlse, causal=True):
  scale = 1.0 / np.sqrt(q.shape[-1])
  f = lambda q, k, v: reference.attention(q, k, v, seg, seg, causal=causal, scale=scale)
  (out, lse), vjp = jax.vjp(f, q, k, v)
  return out, lse, vjp((dout, jnp.where(jnp.isfinite(lse), dlse, 0.0)))


def _cotangents(B, T, Hq, D, seed=3):
  ks = jax.random.split(jax.random.PRNGKey(seed), 2)
  dout = jax.random.normal(ks[0], (B, T, Hq, D))
  dlse = jax.random.normal(ks[1], (B, Hq, T))
  dout = dout.at[0, 3].set(0.0)                               # dO = 0, g != 0: the substitute direction
  dout = dout.at[0, 4].set(1e-30 * dout[0, 4])                # dO tiny next to g: substitute too
  dout, dlse = dout.at[0, 5].set(0.0), dlse.at[0, :, 5].set(0.0)   # dO = 0 and g = 0: nothing to fold
  dlse = dlse.at[1, :, 6].set(1e10)                           # a huge g with an ordinary dO
  return dout, dlse


@pytest.mark.parametrize("causal", [True, False])
def test_folded_backward_equals_the_lse_gradient(causal):
  B, T, Hq, Hkv, D = 3, 40, 4, 2, 16
  q, k, v, _, _ = make_inputs(B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, seed=1)
  seg = packed_segments(B, T)                                 # documents, padding rows, an all-padding row
  dout, dlse = _cotangents(B, T, Hq, D)
  out, lse, want = jax.jit(_reference_grads, static_argnums=6)(q, k, v, seg, dout, dlse, causal)
  g = jnp.where(jnp.isfinite(lse), dlse, 0.0)
  o2, do2 = jax.jit(fold.fold_lse_cotangent)(out, dout, g)
  bwd = jax.jit(lambda *a: xla.bwd(*a, causal=causal, scale=1.0 / np.sqrt(D)))
  got = bwd(q, k, v, seg, seg, o2, lse, do2, jnp.zeros_like(dlse))
  scale_of = lambda x: float(jnp.max(jnp.abs(x)))
  for name, a, b in zip(("dq", "dk", "dv"), got, want):
    assert_close(a, b, rtol=1e-4, atol=1e-5 * scale_of(b), what=name)
  # and the same backward given g directly agrees (the identity, not just the oracle)
  direct = bwd(q, k, v, seg, seg, out, lse, dout, g)
  for name, a, b in zip(("dq", "dk", "dv"), got, direct):
    assert_close(a, b, rtol=1e-4, atol=1e-5 * scale_of(b), what=name + " vs direct")


def _within(a, b, rel):
  """|a - b| <= rel * (1 + |b|) elementwise (b spans 1 to 1e10)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  bad = np.abs(a - b) > rel * (1 + np.abs(b))
  assert not bad.any(), f"{bad.sum()} rows off: {a[bad][:4]} vs {b[bad][:4]}"


def test_fold_rows_by_kind():
  """What each kind of row becomes: D' = rowsum(dO' o O') = D - g on every row with g != 0 (including dO = 0); the
  substitute rows carry a power of two in dO'[0] and nothing else; rows with g = 0 are left alone; bf16 output
  keeps D' to bf16 precision."""
  B, T, H, D = 2, 8, 2, 16
  out = jax.random.normal(jax.random.PRNGKey(0), (B, T, H, D))
  dout, dlse = _cotangents(B, T, H, D)
  o2, do2 = jax.jit(fold.fold_lse_cotangent)(out, dout, dlse)
  d_old = jnp.einsum("bthd,bthd->bht", dout, out)
  d_new = jnp.einsum("bthd,bthd->bht", do2, o2)
  _within(d_new, d_old - dlse, 1e-5)
  sub = np.asarray(do2[0, 3])                                 # dO = 0 row: the substitute, one power of two per head
  assert np.all(sub == sub[:, :1]) and np.all(sub > 0)        # spread over every element
  m, _ = np.frexp(sub)
  assert np.all(m == 0.5)                                     # a power of two: exact in bfloat16 and float16
  assert np.all(np.abs(np.asarray(o2[0, 3])) < 2.0 ** fold.BITS)
  np.testing.assert_array_equal(o2[0, 5], out[0, 5])          # dO = 0 and g = 0: untouched
  np.testing.assert_array_equal(do2[0, 5], dout[0, 5])
  ob, dob = jax.jit(fold.fold_lse_cotangent, static_argnums=3)(out, dout, dlse, jnp.bfloat16)
  d_bf = jnp.einsum("bthd,bthd->bht", dob.astype(jnp.float32), ob.astype(jnp.float32))
  assert np.all(np.isfinite(np.asarray(d_bf)))
  _within(d_bf, d_old - dlse, 2e-2)


@pytest.mark.parametrize("dtype,tol", [(jnp.float16, 5e-3), (jnp.bfloat16, 2e-2)])
def test_folded_backward_in_half_precision_with_large_g(dtype, tol):
  """The fold in the kernel's own input dtype (what cuDNN / tokamax are given): float16's largest value is 65,504, so
  the substitute row's O'[0] must stay below it (2^12 there, `fold.bits`) where bfloat16 takes 2^40. Rows with dO = 0
  and a large g (300, and 3e3 with an ordinary dO) and small g (1e-3): the `xla` backward given the float16 / bfloat16
  (O', dO') and q, k, v against the reference's autodiff in float32 on the same rounded inputs, relative to each
  gradient's largest value."""
  B, T, Hq, Hkv, D = 2, 24, 4, 2, 16
  q, k, v, _, _ = make_inputs(B=B, T=T, Hq=Hq, Hkv=Hkv, D=D, seed=5, dtype=dtype)
  seg = packed_segments(B, T)
  dout, dlse = _cotangents(B, T, Hq, D)
  dout = dout.at[1, ::3].set(0.0)                             # many dO = 0 rows ...
  dlse = dlse.at[1, :, ::3].set(300.0)                        # ... with a large g
  dlse = dlse.at[1, :, 1].set(3e3).at[1, :, 2].set(1e-3)      # a larger g with an ordinary dO; a small g
  f32 = lambda x: x.astype(jnp.float32)
  out, lse, want = jax.jit(_reference_grads)(f32(q), f32(k), f32(v), seg, dout, dlse)
  g = jnp.where(jnp.isfinite(lse), dlse, 0.0)
  o2, do2 = jax.jit(fold.fold_lse_cotangent, static_argnums=3)(out.astype(dtype), dout.astype(dtype), g, dtype)
  assert o2.dtype == dtype and bool(jnp.all(jnp.isfinite(o2.astype(jnp.float32))))
  assert float(jnp.max(jnp.abs(o2.astype(jnp.float32)))) < 2.0 ** (fold.bits(dtype) + 1)
  bwd = jax.jit(lambda *a: xla.bwd(*a, causal=True, scale=1.0 / np.sqrt(D)))
  got = bwd(q, k, v, seg, seg, o2, lse, do2, jnp.zeros_like(dlse))
  for name, a, b in zip(("dq", "dk", "dv"), got, want):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), f"{name}: non-finite values"
    err = np.max(np.abs(a - b)) / np.max(np.abs(b))
    assert err < tol, f"{name}: {err:.1e} relative"
  assert float(jnp.max(jnp.abs(want[0]))) > 100                # the large g dominates dq: the test is not vacuous


def test_fold_bits_by_dtype():
  assert fold.bits(jnp.bfloat16) == fold.bits(jnp.float32) == fold.BITS == 40
  assert fold.bits(jnp.float16) == fold.F16_BITS and 2.0 ** (fold.F16_BITS + 1) < float(jnp.finfo(jnp.float16).max)
