"""Pallas TPU backend vs the materialized reference, in TPU interpret mode on CPU, plus lowering for real TPUs.

Interpret mode (`pltpu.InterpretParams`) is ~100x slower than XLA, so shapes are small; blocks of 128 with
T up to 160 still give multi-block grids (partially masked and skipped causal blocks, padded tails).
Tests taking the `x64` fixture run twice, the second time with jax_enable_x64 on (that second run marked slow;
`x64_always`: both by default).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sinkjax.kernels import BlockSizes, flash_attention
from tests.test_kernels import x64, x64_always  # noqa: F401  (pytest fixtures: jax_enable_x64 off, then on)

F32_TOL = 2e-5
BF16_TOL = 2e-2


def _segments(B, T, S):
  """Packed documents, trailing padding (id 0) and, when B > 1, one fully padded query row."""
  q_seg = np.ones((B, T), np.int32)
  kv_seg = np.ones((B, S), np.int32)
  q_seg[:, T // 3:] = 2
  kv_seg[:, max(0, S - T) + T // 3:] = 2
  q_seg[:, T - 7:] = 0
  kv_seg[:, S - 5:] = 0
  if B > 1:
    q_seg[-1] = 0
  return jnp.asarray(q_seg), jnp.asarray(kv_seg)


def _run(impl, q, k, v, w, u, **kw):
  def loss(q, k, v):
    out, lse = flash_attention(q, k, v, impl=impl, **kw)
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jax.nn.sigmoid(lse - 0.3) * u), (out, lse)
  # jit: tracing the interpreted kernels once is much cheaper than op-by-op dispatch.
  (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, lse, grads


def _block_kw(blocks):
  """A BlockSizes (separate forward / dK,dV / dQ tiles), or a (block_q, block_k) pair for the shorthand."""
  return dict(block_sizes=blocks) if isinstance(blocks, BlockSizes) else dict(block_q=blocks[0], block_k=blocks[1])


def _close(name, got, want, tol):
  got = np.asarray(got.astype(jnp.float32))
  want = np.asarray(want.astype(jnp.float32))
  assert np.isfinite(got).all(), f"{name}: non-finite values"
  scale = max(float(np.abs(want).max()), 1e-6)
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale, err_msg=name)


DISTINCT = BlockSizes(128, 256, 256, 128, 128, 256)     # forward 128 x 256, dK/dV 256 x 128, dQ 128 x 256
# Interpret mode costs ~7 s a case: the cases marked slow repeat what a default case covers (the same layout in
# another dtype, or the same path on other tiles).
CASES = [
    # B, T, S, Hq, Hkv, D, causal, dtype, segments, q_mult, blocks
    pytest.param(2, 160, 160, 4, 2, 64, True, jnp.float32, True, 1.0, (128, 128), id="f32-causal-gqa-seg-ragged"),
    pytest.param(1, 100, 160, 2, 1, 128, False, jnp.float32, True, 1.0, (128, 128), id="f32-noncausal-cross-seg", marks=pytest.mark.slow),
    pytest.param(1, 160, 32, 2, 2, 64, True, jnp.float32, False, 1.0, (128, 128), id="f32-causal-T>S-empty-block"),
    pytest.param(1, 128, 128, 2, 2, 64, True, jnp.float32, False, 30.0, (None, None), id="f32-causal-large-logits", marks=pytest.mark.slow),
    pytest.param(2, 160, 160, 4, 2, 64, True, jnp.bfloat16, True, 1.0, (128, 128), id="bf16-causal-gqa-seg-ragged", marks=pytest.mark.slow),
    pytest.param(1, 96, 96, 2, 1, 128, False, jnp.bfloat16, False, 30.0, (None, None), id="bf16-noncausal-mqa-large"),
    pytest.param(2, 160, 160, 4, 2, 64, True, jnp.float32, True, 1.0, DISTINCT, id="f32-causal-gqa-seg-distinct-tiles"),
    pytest.param(1, 100, 160, 2, 1, 128, False, jnp.float32, True, 1.0, DISTINCT, id="f32-noncausal-cross-distinct"),
    # without segment ids the kernels stream no ids (segmented=False): padded query rows and keys by position alone
    pytest.param(2, 160, 160, 4, 2, 64, True, jnp.float32, False, 1.0, (128, 128), id="f32-causal-gqa-noseg-ragged"),
    pytest.param(1, 100, 160, 2, 1, 128, False, jnp.float32, False, 1.0, DISTINCT, id="f32-noncausal-cross-noseg"),
]


@pytest.mark.parametrize("B,T,S,Hq,Hkv,D,causal,dtype,segments,q_mult,blocks", CASES)
def test_matches_reference(B, T, S, Hq, Hkv, D, causal, dtype, segments, q_mult, blocks, x64):
  ks = jax.random.split(jax.random.PRNGKey(T * 7 + S + Hq), 5)
  q = (jax.random.normal(ks[0], (B, T, Hq, D)) * q_mult).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, Hkv, D)).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, Hkv, D)).astype(dtype)
  w = jax.random.normal(ks[3], (B, T, Hq, D))
  u = jax.random.normal(ks[4], (B, Hq, T))
  seg = _segments(B, T, S) if segments else None
  kw = dict(causal=causal, segment_ids=seg)
  out, lse, grads = _run("pallas_tpu", q, k, v, w, u, interpret=True, **_block_kw(blocks), **kw)
  out_r, lse_r, grads_r = _run("reference", q, k, v, w, u, **kw)
  tol = F32_TOL if dtype == jnp.float32 else BF16_TOL

  assert out.dtype == dtype and out.shape == q.shape
  assert lse.dtype == jnp.float32 and lse.shape == (B, Hq, T)
  finite = np.isfinite(np.asarray(lse_r))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  assert (np.asarray(lse)[~finite] == -np.inf).all()
  # Rows with no visible key output exactly zero.
  empty = ~finite.transpose(0, 2, 1)                            # [B, T, Hq]
  assert (np.asarray(out.astype(jnp.float32))[empty] == 0).all()
  if segments:
    assert empty.any()
  _close("out", out, out_r, tol)
  _close("lse", jnp.where(finite, lse, 0.0), jnp.where(finite, lse_r, 0.0), tol)
  for name, g, g_r in zip(("dq", "dk", "dv"), grads, grads_r):
    assert g.dtype == dtype
    _close(name, g, g_r, tol)


def test_lse_cotangent_alone(x64_always):
  """Gradient through the LSE only (out unused) must match: checks the dlse term of dS on its own."""
  B, T, H, D = 1, 64, 2, 64
  ks = jax.random.split(jax.random.PRNGKey(3), 4)
  q, k, v = (jax.random.normal(kk, (B, T, H, D), jnp.float32) for kk in ks[:3])
  u = jax.random.normal(ks[3], (B, H, T), jnp.float32)
  seg = _segments(B, T, T)

  def loss(impl, **kw):
    def f(q, k, v):
      return jnp.sum(jnp.tanh(flash_attention(q, k, v, causal=True, segment_ids=seg, impl=impl, **kw)[1]) * u)
    return jax.jit(jax.grad(f, argnums=(0, 1, 2)))(q, k, v)

  for name, g, g_r in zip(("dq", "dk", "dv"), loss("pallas_tpu", interpret=True), loss("reference")):
    _close(name, g, g_r, F32_TOL)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape,blocks", [((1, 1024, 1024, 2, 2, 128), (None, None)),
                                          ((2, 1000, 1000, 4, 1, 128), (256, 128)),
                                          ((1, 512, 1024, 2, 2, 64), (128, 256)),
                                          ((2, 1000, 1000, 4, 2, 128), BlockSizes(256, 512, 512, 128, 128, 384))],
                         ids=["T1024-default", "T1000-gqa-ragged", "cross-D64", "T1000-gqa-distinct-tiles"])
@pytest.mark.parametrize("segmented", [True, False], ids=["seg", "noseg"])
def test_lowers_for_tpu(dtype, shape, blocks, segmented, x64_always):
  """Forward and jax.grad lower to Mosaic TPU custom calls (no execution; the CPU has no TPU); without segment ids
  the kernels take no id operands."""
  B, T, S, Hq, Hkv, D = shape
  q = jax.ShapeDtypeStruct((B, T, Hq, D), dtype)
  k = jax.ShapeDtypeStruct((B, S, Hkv, D), dtype)
  q_seg = jnp.ones((B, T), jnp.int32).at[:, T // 2:].set(2)
  kv_seg = jnp.ones((B, S), jnp.int32).at[:, S - T + T // 2:].set(2)

  def f(q, k, v):
    return flash_attention(q, k, v, causal=True, segment_ids=(q_seg, kv_seg) if segmented else None,
                           impl="pallas_tpu", interpret=False, **_block_kw(blocks))

  def loss(q, k, v):
    out, lse = f(q, k, v)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jax.nn.sigmoid(lse))

  fwd_txt = jax.jit(f).trace(q, k, k).lower(lowering_platforms=("tpu",)).as_text()
  assert fwd_txt.count("tpu_custom_call") == 1
  grad_txt = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, k, k).lower(lowering_platforms=("tpu",)).as_text()
  assert grad_txt.count("tpu_custom_call") == 3                 # forward, dk/dv, dq
