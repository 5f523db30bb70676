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
  sub = do2[0, 3]                                             # dO = 0 row: the substitute
  assert np.all(np.asarray(sub[:, 1:]) == 0) and np.all(np.asarray(sub[:, 0]) > 0)
  m, _ = np.frexp(np.asarray(sub[:, 0]))
  assert np.all(m == 0.5)                                     # a power of two: exact in bfloat16
  np.testing.assert_array_equal(o2[0, 5], out[0, 5])          # dO = 0 and g = 0: untouched
  np.testing.assert_array_equal(do2[0, 5], dout[0, 5])
  ob, dob = jax.jit(fold.fold_lse_cotangent, static_argnums=3)(out, dout, dlse, jnp.bfloat16)
  d_bf = jnp.einsum("bthd,bthd->bht", dob.astype(jnp.float32), ob.astype(jnp.float32))
  assert np.all(np.isfinite(np.asarray(d_bf)))
  _within(d_bf, d_old - dlse, 2e-2)
