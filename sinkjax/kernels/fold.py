"""The LSE cotangent folded into the forward output: how a stock flash backward takes the gradient of the LSE.

A flash-attention backward that reads the forward output O only through D_i = rowsum(dO_i o O_i) computes
dS = P o (dP - D). sinkjax's contract needs dS = P o (dP - D + g) with g the LSE cotangent (`flash.py`). Giving such a
backward a substitute output O' with rowsum(dO o O') = D - g makes it compute exactly that; per row i:

  O'_i = O_i - (g_i / |dO_i|) (dO_i / |dO_i|)        rowsum(dO_i o O'_i) = D_i - g_i |dO_i|^2 / |dO_i|^2 = D_i - g_i

(written with the unit vector dO_i / |dO_i| so that nothing overflows: the correction is at most 2^BITS per element on
the rows it is used for, BITS = `bits(dtype)`: 40 in bfloat16 and float32, 14 in float16, whose largest value is
65,504). It is exact in exact arithmetic; in floating point D' carries the rounding of O' to the kernel's input dtype
(bfloat16: ~2^-9 |g_i|, float16: ~2^-11 |g_i|, the precision the kernel's own matmuls keep).

Rows where dO_i vanishes next to g_i (|dO_i| <= 2^-BITS |g_i|, dO_i = 0 included) cannot carry g_i through O': there
D_i = rowsum(0 o O') = 0 whatever O' is. Their dO_i is replaced by a substitute direction spread over the D elements,
dO'_i = delta 1 with delta = 2^max(e - BITS - L, E) for |g_i| = m 2^e (0.5 <= m < 1), 2^L <= D < 2^(L+1) and E the
dtype's smallest normal exponent (-126; -14 in float16), so delta is a normal power of two, exact in the dtype; and
O'_i = -g_i / (delta D) 1 (each element below 2^BITS), so D'_i = -g_i. The substitute adds delta P_is to every element
of dV's row s and delta P_is (V_s . 1) to dS_is, beside the P_is g_i carried: at most 2^-(BITS + L) |g_i| and
2^-BITS |g_i| max|V| (bfloat16: 2^-40 relative, below float32 rounding; float16 at D = 128: 2^-21 and 2^-14, under
float16's own rounding), plus at most 2^E P_is where delta sits at its floor (|g_i| tiny); the dropped dO_i was at most
as large.

Used by the cudnn backend (cuDNN's fused backward takes O and dO, not D) and testable on any backend: the `xla`
backend's backward given (O', dO', g = 0) returns the gradients of (O, dO, g) (tests/test_kernels.py).
"""
from __future__ import annotations

import jax.numpy as jnp

_F32 = jnp.float32
BITS = 40            # the substitute's scale: correction elements stay below 2^BITS, its error is 2^-BITS relative
F16_BITS = 14        # float16's (largest value 65,504 < 2^16: 2^14 leaves room for |O| and the rounding)


def bits(dtype) -> int:
  """The substitute's scale in `dtype`: BITS, or F16_BITS where 2^BITS would overflow (float16)."""
  return F16_BITS if jnp.finfo(dtype).maxexp <= BITS + 2 else BITS


def fold_lse_cotangent(out, dout, dlse, dtype=None):
  """(O', dO') in `dtype` (default out.dtype) such that a backward reading O only through rowsum(dO o O) computes the
  contract's gradients of (out, lse) for cotangents (dout, dlse).

  out, dout: [B, T, H, D]; dlse: float32 [B, H, T], already zero where the LSE is -inf (rows with no visible key)."""
  dtype = jnp.dtype(dtype or out.dtype)
  n_bits, min_exp = bits(dtype), int(jnp.finfo(dtype).minexp)
  o, do = out.astype(_F32), dout.astype(_F32)
  g = jnp.swapaxes(dlse.astype(_F32), 1, 2)[..., None]                        # [B, T, H, 1]
  norm = jnp.sqrt(jnp.sum(do * do, axis=-1, keepdims=True))
  substitute = (g != 0) & (norm <= jnp.abs(g) * 2.0 ** -n_bits)
  # ordinary rows: O - (g / |dO|) (dO / |dO|); norm > 0 there unless g == 0 (then no change)
  safe = jnp.where(norm > 0, norm, 1.0)
  o_fold = o - (g / safe) * (do / safe)
  # substitute rows: dO' = delta 1, O' = -g / (delta D) 1 (delta a normal power of two of `dtype`; every element of O'
  # below 2^n_bits in magnitude)
  n = o.shape[-1]
  _, e = jnp.frexp(g)
  delta = jnp.ldexp(jnp.ones_like(g), jnp.maximum(e - n_bits - (n.bit_length() - 1), min_exp))
  o_sub = jnp.broadcast_to(-g / (delta * n), o.shape)
  do_sub = jnp.broadcast_to(delta, do.shape)
  o_new = jnp.where(substitute, o_sub, o_fold)
  do_new = jnp.where(substitute, do_sub, do)
  return o_new.astype(dtype), do_new.astype(dtype)
