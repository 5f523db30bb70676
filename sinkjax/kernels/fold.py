"""The LSE cotangent folded into the forward output: how a stock flash backward takes the gradient of the LSE.

A flash-attention backward that reads the forward output O only through D_i = rowsum(dO_i o O_i) computes
dS = P o (dP - D). sinkjax's contract needs dS = P o (dP - D + g) with g the LSE cotangent (`flash.py`). Giving such a
backward a substitute output O' with rowsum(dO o O') = D - g makes it compute exactly that; per row i:

  O'_i = O_i - (g_i / |dO_i|) (dO_i / |dO_i|)        rowsum(dO_i o O'_i) = D_i - g_i |dO_i|^2 / |dO_i|^2 = D_i - g_i

(written with the unit vector dO_i / |dO_i| so that nothing overflows: the correction is at most 2^40 per element on
the rows it is used for). It is exact in exact arithmetic; in floating point D' carries the rounding of O' to the
kernel's input dtype (bfloat16: ~2^-9 |g_i|, the precision the kernel's own bf16 matmuls keep).

Rows where dO_i vanishes next to g_i (|dO_i| <= 2^-40 |g_i|, dO_i = 0 included) cannot carry g_i through O': there
D_i = rowsum(0 o O') = 0 whatever O' is. Their dO_i is replaced by a substitute direction, dO'_i = delta e_0 with
delta = 2^(e - 40) for |g_i| = m 2^e (0.5 <= m < 1, so delta is exact in bfloat16), and O'_i[0] = -g_i / delta
(|O'_i[0]| in [2^39, 2^40)), so D'_i = -g_i. The substitute adds delta P^T e_0 to dV and delta P (V[:, 0] - O_i[0]) to
dS: 2^-40 |g_i| relative, below float32 rounding; the dropped dO_i was at most as large. A |g_i| below 2^-86 (whose
delta would underflow bfloat16) is dropped (the row is left as it was): a gradient term under 1e-26.

Used by the cudnn backend (cuDNN's fused backward takes O and dO, not D) and testable on any backend: the `xla`
backend's backward given (O', dO', g = 0) returns the gradients of (O, dO, g) (tests/test_kernels.py).
"""
from __future__ import annotations

import jax.numpy as jnp

_F32 = jnp.float32
BITS = 40            # the substitute's scale: correction elements stay below 2^BITS, its error is 2^-BITS relative
_MIN_EXP = -126 + BITS    # |g| = m 2^e with e below this: delta = 2^(e - BITS) would be subnormal in bfloat16


def fold_lse_cotangent(out, dout, dlse, dtype=None):
  """(O', dO') in `dtype` (default out.dtype) such that a backward reading O only through rowsum(dO o O) computes the
  contract's gradients of (out, lse) for cotangents (dout, dlse).

  out, dout: [B, T, H, D]; dlse: float32 [B, H, T], already zero where the LSE is -inf (rows with no visible key)."""
  dtype = dtype or out.dtype
  o, do = out.astype(_F32), dout.astype(_F32)
  g = jnp.swapaxes(dlse.astype(_F32), 1, 2)[..., None]                        # [B, T, H, 1]
  norm = jnp.sqrt(jnp.sum(do * do, axis=-1, keepdims=True))
  substitute = (g != 0) & (norm <= jnp.abs(g) * 2.0 ** -BITS)
  # ordinary rows: O - (g / |dO|) (dO / |dO|); norm > 0 there unless g == 0 (then no change)
  safe = jnp.where(norm > 0, norm, 1.0)
  o_fold = o - (g / safe) * (do / safe)
  # substitute rows: dO' = delta e_0, O'[0] = -g / delta
  _, e = jnp.frexp(g)
  usable = substitute & (e >= _MIN_EXP)
  delta = jnp.ldexp(jnp.ones_like(g), e - BITS)
  first = (jnp.arange(o.shape[-1]) == 0)
  o_sub = jnp.where(first, -g / delta, o)
  do_sub = jnp.where(first, delta, 0.0)
  o_new = jnp.where(usable, o_sub, jnp.where(substitute, o, o_fold))
  do_new = jnp.where(usable, do_sub, do)
  return o_new.astype(dtype), do_new.astype(dtype)
