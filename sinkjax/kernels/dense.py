"""`dot_general` for the dense layers (`nnx.Linear(..., dot_general=dense.dot_general)`): lax.dot_general, with a
custom VJP on CPU that computes the weight gradient as a plain row-major matmul.

x [..., in] @ w [in, out]: autodiff's weight gradient is dW = x^T dy contracted over every token. XLA:CPU lowers it
to a dot contracting dimension 0 of both operands that its YNNPACK matmuls do not take: it runs on the Eigen path
after a transposing copy of dy, at about half the rate of the forward matmuls (52 vs 80-95 GFLOP/s on one core at
4 x 256, T 512; docs/PERF.md, "Training step on a CPU"). Here the narrower of x and dy is transposed once (behind an
optimization barrier so XLA cannot fold the transpose back into the dot) and dW is an ordinary row-major matmul:
x^T @ dy ([in, tokens] x [tokens, out]) when in <= out, else (dy^T @ x)^T. Same products; the sums may run in another
order (the losses of the issue's AdamW step came out bit-identical, a Muon run differed in the last bits).
Other platforms (cuBLAS and the TPU take transposed operands natively) and other dimension numbers run
lax.dot_general as it is, which is also the reference the tests compare with.
"""
from __future__ import annotations

import functools

import jax

from sinkjax.sharding import target_platform


def _dense(x, w, preferred_element_type):
  return jax.lax.dot_general(x, w, (((x.ndim - 1,), (0,)), ((), ())), preferred_element_type=preferred_element_type)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dense_cpu(x, w, preferred_element_type):
  return _dense(x, w, preferred_element_type)


def _dense_cpu_fwd(x, w, preferred_element_type):
  return _dense(x, w, preferred_element_type), (x, w)


def _dense_cpu_bwd(preferred_element_type, res, g):
  del preferred_element_type
  x, w = res
  dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ())), preferred_element_type=x.dtype)
  x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
  nn = lambda a, b: jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=w.dtype)
  if x2.shape[1] <= g2.shape[1]:       # transpose the narrower operand: [in, tokens] x [tokens, out]
    dw = nn(jax.lax.optimization_barrier(x2.T), g2)
  else:                                # [out, tokens] x [tokens, in], then the small [out, in] result transposed
    dw = jax.lax.optimization_barrier(nn(jax.lax.optimization_barrier(g2.T), x2)).T     # (not folded into the dot)
  return dx, dw


_dense_cpu.defvjp(_dense_cpu_fwd, _dense_cpu_bwd)


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, out_sharding=None):
  """Drop-in for lax.dot_general as nnx.Linear calls it; the CPU weight-gradient path for x [..., in] @ w [in, out]."""
  dense = dimension_numbers == (((lhs.ndim - 1,), (0,)), ((), ())) and rhs.ndim == 2
  if dense and precision is None and out_sharding is None and target_platform() == "cpu":
    return _dense_cpu(lhs, rhs, preferred_element_type)
  return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision=precision,
                             preferred_element_type=preferred_element_type, out_sharding=out_sharding)
