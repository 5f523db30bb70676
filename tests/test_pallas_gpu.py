"""The Pallas/Triton GPU backend against the materialized reference (interpret mode on CPU), plus lowering checks
for the real CUDA target (Triton lowering runs on CPU; nothing is compiled or executed for the GPU).

On a machine with a GPU the same tests run the compiled kernels for real:

    JAX_PLATFORMS=cuda python -m pytest tests/test_pallas_gpu.py

(the conftest's default JAX_PLATFORMS=cpu is only a default). The reference then runs with float32 matmuls at
HIGHEST precision, since XLA's default on GPUs is TF32, while the kernel keeps float32 dots exact for f32 inputs.

Tests taking the `x64` fixture run twice, the second time with jax_enable_x64 on (that second run marked slow;
`x64_always`: both by default)."""
import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sinkjax.kernels import BlockSizes, flash_attention
from tests.helpers import compile_only_gpu
from tests.test_kernels import x64, x64_always  # noqa: F401  (pytest fixtures: jax_enable_x64 off, then on)

ON_GPU = jax.default_backend() == "gpu"
INTERPRET = not ON_GPU            # interpret mode on CPU; the compiled Triton kernels on a GPU


def _reference_precision():
  """Exact float32 matmuls for the reference on a GPU (XLA's default there is TF32); a no-op on CPU."""
  return jax.default_matmul_precision("highest") if ON_GPU else contextlib.nullcontext()


def _segments(B, T, pattern):
  """Packed segments with trailing padding; with `pattern == "packed"` the last batch row is all padding."""
  if pattern == "none":
    return None
  seg = np.zeros((B, T), np.int32)
  a, b = int(T * 0.4), int(T * 0.85)
  seg[:, :a] = 1
  seg[:, a:b] = 2
  seg[-1] = 0                                                 # a fully padded batch row
  if B > 2:
    seg[1, :] = 3                                             # a row with one segment and no padding
  return jnp.asarray(seg)


def _inputs(B, T, S, Hq, Hkv, D, dtype, q_mult=1.0, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = (jax.random.normal(ks[0], (B, T, Hq, D), jnp.float32) * q_mult).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, Hkv, D), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, Hkv, D), jnp.float32).astype(dtype)
  w = jax.random.normal(ks[3], (B, T, Hq, D), jnp.float32)
  u = jax.random.normal(ks[4], (B, Hq, T), jnp.float32)
  return q, k, v, w, u


def _run(impl, q, k, v, w, u, **kw):
  if impl != "reference":
    kw = dict(kw, interpret=INTERPRET)

  def loss(q, k, v):
    out, lse = flash_attention(q, k, v, impl=impl, **kw)
    return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jax.nn.sigmoid(lse - 0.3) * u), (out, lse)

  with _reference_precision() if impl == "reference" else contextlib.nullcontext():
    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
  return out, lse, grads


def _block_kw(blocks):
  """A BlockSizes (separate forward / dK,dV / dQ tiles), or a (block_q, block_k) pair for the shorthand."""
  return dict(block_sizes=blocks) if isinstance(blocks, BlockSizes) else dict(block_q=blocks[0], block_k=blocks[1])


def _close(name, got, want, tol):
  got = np.asarray(jnp.asarray(got, jnp.float32))
  want = np.asarray(jnp.asarray(want, jnp.float32))
  assert not np.isnan(got).any(), f"{name}: NaN"
  np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{name}: -inf pattern")
  fin = np.isfinite(want)
  g, w = got[fin], want[fin]
  scale = max(1.0, float(np.abs(w).max())) if w.size else 1.0
  np.testing.assert_allclose(g, w, rtol=tol, atol=tol * scale, err_msg=name)


CASES = [
    # name, B, T, S, Hq, Hkv, D, causal, segments, blocks, q_mult
    ("causal_packed_gqa", 3, 100, 100, 4, 2, 64, True, "packed", (32, 16), 1.0),
    ("noncausal_packed_gqa", 3, 100, 100, 4, 2, 64, False, "packed", (16, 32), 1.0),
    ("causal_plain_mha", 2, 64, 64, 2, 2, 64, True, "none", (16, 16), 1.0),
    ("causal_d48", 2, 72, 72, 4, 2, 48, True, "packed", (32, 32), 1.0),
    ("large_logits", 2, 64, 64, 4, 2, 64, True, "packed", (32, 16), 30.0),
    ("noncausal_large_logits_d48", 2, 48, 48, 2, 1, 48, False, "packed", (16, 16), 30.0),
    ("cross_causal_s_gt_t", 1, 40, 90, 4, 2, 64, True, "none", (16, 32), 1.0),
    ("cross_causal_t_gt_s", 1, 90, 40, 4, 2, 64, True, "none", (16, 16), 1.0),
    ("default_blocks", 2, 200, 200, 2, 1, 32, True, "packed", (None, None), 1.0),
    # Forward, dK/dV and dQ each on their own tiles (and so each pass padded differently).
    ("distinct_tiles_causal_packed", 3, 100, 100, 4, 2, 64, True, "packed", BlockSizes(32, 16, 16, 64, 64, 16), 1.0),
    ("distinct_tiles_noncausal", 2, 72, 72, 4, 2, 48, False, "packed", BlockSizes(16, 64, 64, 16, 32, 32), 1.0),
    ("distinct_tiles_cross_s_gt_t", 1, 40, 90, 4, 2, 64, True, "none", BlockSizes(16, 32, 32, 16, 16, 64), 1.0),
    ("distinct_tiles_backward_only", 2, 64, 64, 4, 2, 64, True, "packed", BlockSizes(block_q_dq=16), 1.0),
]


_BF16_CASES = ("causal_packed_gqa", "noncausal_packed_gqa", "causal_d48", "large_logits",
               "distinct_tiles_causal_packed")  # keeps the suite quick
# Interpret mode costs ~6 s a case. By default: causal and non-causal, packed and plain, GQA, d 48, large logits,
# cross attention, distinct tiles, and bf16 once; the rest (other combinations of the same paths) are marked slow.
_DEFAULT = {("causal_packed_gqa", "f32"), ("noncausal_large_logits_d48", "f32"), ("cross_causal_t_gt_s", "f32"),
            ("distinct_tiles_causal_packed", "f32"), ("distinct_tiles_cross_s_gt_t", "f32"), ("large_logits", "bf16")}


def _param(case, dtype, name):
  marks = () if (case[0], name) in _DEFAULT else pytest.mark.slow
  return pytest.param(case, dtype, id=f"{case[0]}-{name}", marks=marks)


_PARAMS = [_param(c, jnp.float32, "f32") for c in CASES] + [
    _param(c, jnp.bfloat16, "bf16") for c in CASES if c[0] in _BF16_CASES]


@pytest.mark.parametrize("case,dtype", _PARAMS)
def test_matches_reference(case, dtype, x64):
  _, B, T, S, Hq, Hkv, D, causal, seg_pattern, blocks, q_mult = case
  q, k, v, w, u = _inputs(B, T, S, Hq, Hkv, D, dtype, q_mult)
  seg = _segments(B, T, seg_pattern) if S == T else None
  kw = dict(causal=causal, segment_ids=seg)
  ref_out, ref_lse, ref_g = _run("reference", q, k, v, w, u, **kw)
  out, lse, g = _run("pallas_gpu", q, k, v, w, u, **_block_kw(blocks), **kw)

  assert out.dtype == q.dtype and out.shape == q.shape
  assert lse.dtype == jnp.float32 and lse.shape == (B, Hq, T)
  for x, ref in zip(g, (q, k, v)):
    assert x.dtype == ref.dtype and x.shape == ref.shape
  tol = 2e-5 if dtype == jnp.float32 else 2e-2
  # Large logits amplify the last-bit differences of the scores (~|s| * eps) in softmax and its gradients.
  gtol = tol * (2 if q_mult > 1 and dtype == jnp.float32 else 1)
  _close("out", out, ref_out, tol)
  _close("lse", lse, ref_lse, tol)
  for name, x, ref in zip(("dq", "dk", "dv"), g, ref_g):
    _close(name, x, ref, gtol)

  if seg is not None:
    pad = np.asarray(seg) == 0
    np.testing.assert_array_equal(np.asarray(out, np.float32)[pad], 0.0)
    assert np.isneginf(np.asarray(lse).transpose(0, 2, 1)[pad]).all()
    np.testing.assert_array_equal(np.asarray(g[0], np.float32)[pad], 0.0)  # padded queries: dq = 0
    np.testing.assert_array_equal(np.asarray(g[1], np.float32)[pad], 0.0)  # padded keys: dk = dv = 0
    np.testing.assert_array_equal(np.asarray(g[2], np.float32)[pad], 0.0)


def test_lse_cotangent_alone_reaches_q_and_k(x64_always):
  """A loss of the LSE only (dout = 0) must still produce the reference dq and dk (dv = 0)."""
  q, k, v, _, u = _inputs(2, 48, 48, 2, 1, 32, jnp.float32)
  seg = _segments(2, 48, "packed")

  def grads(impl, **kw):
    def loss(q, k, v):
      lse = flash_attention(q, k, v, causal=True, segment_ids=seg, impl=impl, **kw)[1]
      return jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * u)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

  with _reference_precision():
    ref = grads("reference")
  got = grads("pallas_gpu", interpret=INTERPRET, block_q=16, block_k=16)
  for name, x, r in zip(("dq", "dk", "dv"), got, ref):
    _close(name, x, r, 2e-5)
  assert float(jnp.abs(got[0]).max()) > 0 and float(jnp.abs(got[2]).max()) == 0.0


# ------------------------------------------------------------------------------------ lowering for real CUDA


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_lowers_for_cuda(dtype, x64_always):
  B, T, H, D = 1, 2048, 4, 128
  seg = jnp.concatenate([jnp.ones((B, 1000), jnp.int32), jnp.full((B, 1000), 2, jnp.int32),
                         jnp.zeros((B, 48), jnp.int32)], axis=1)
  spec = jax.ShapeDtypeStruct((B, T, H, D), dtype)
  attn = functools.partial(flash_attention, causal=True, segment_ids=seg, impl="pallas_gpu", interpret=False)

  def fwd(q, k, v):
    return attn(q, k, v)

  def loss(q, k, v):
    out, lse = attn(q, k, v)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jax.nn.sigmoid(jnp.where(jnp.isfinite(lse), lse, 0.0)))

  for f in (fwd, jax.grad(loss, argnums=(0, 1, 2))):
    with compile_only_gpu():
      text = jax.jit(f).trace(spec, spec, spec).lower(lowering_platforms=("cuda",)).as_text()
    assert "triton" in text


@pytest.mark.parametrize("blocks", [(32, 128), BlockSizes(32, 128, 64, 32, 16, 64)], ids=["shorthand", "distinct"])
def test_lowers_for_cuda_odd_shapes(blocks, x64_always):
  """GQA with a non-power-of-two group, head dim 80 (padded to 128), T != S, lengths not multiples of blocks;
  one tile pair for every pass, or distinct forward / dK,dV / dQ tiles."""
  B, T, S, Hq, Hkv, D = 2, 1100, 1300, 6, 2, 80
  q = jax.ShapeDtypeStruct((B, T, Hq, D), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((B, S, Hkv, D), jnp.bfloat16)
  segs = (jnp.ones((B, T), jnp.int32), jnp.ones((B, S), jnp.int32))

  def loss(q, k, v):
    out, lse = flash_attention(q, k, v, causal=True, segment_ids=segs, impl="pallas_gpu", interpret=False,
                               **_block_kw(blocks))
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(lse)

  with compile_only_gpu():
    text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(q, kv, kv).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("triton") == 3                                # forward, dq, dk/dv kernels


@pytest.mark.skipif(not ON_GPU, reason="runs the compiled kernels; needs a GPU (JAX_PLATFORMS=cuda)")
@pytest.mark.parametrize("blocks", [(32, 128), BlockSizes(32, 128, 64, 32, 16, 64)], ids=["shorthand", "distinct"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_odd_shapes_on_gpu(dtype, blocks):
  """The odd shapes of the lowering test above, compiled and run on the GPU against the reference."""
  q, k, v, w, u = _inputs(2, 1100, 1300, 6, 2, 80, dtype)
  segs = (jnp.ones((2, 1100), jnp.int32).at[1, 900:].set(0), jnp.ones((2, 1300), jnp.int32).at[1, 1000:].set(0))
  kw = dict(causal=True, segment_ids=segs)
  ref_out, ref_lse, ref_g = _run("reference", q, k, v, w, u, **kw)
  out, lse, g = _run("pallas_gpu", q, k, v, w, u, **_block_kw(blocks), **kw)
  tol = 5e-5 if dtype == jnp.float32 else 3e-2
  _close("out", out, ref_out, tol)
  _close("lse", lse, ref_lse, tol)
  for name, x, ref in zip(("dq", "dk", "dv"), g, ref_g):
    _close(name, x, ref, tol)
