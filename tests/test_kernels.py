"""flash_attention: every backend against the materialized reference, forward and backward through out AND lse.

Pallas backends are checked in their own files (interpret mode + cross-lowering); here: the reference itself against
an independent library (jax.nn.dot_product_attention), the blockwise XLA backend against the reference, the
dispatcher's BlockSizes (validation, and which tile each backend's passes run with), and the per-shard wrapper.
Tests taking the `x64` fixture run twice, the second time with jax_enable_x64 on, as scientific users run (that second run marked slow;
`x64_always`: both by default).
"""
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import jaxprs_in_params
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sinkjax import sharding
from sinkjax.kernels import BlockSizes, flash_attention


def _x64(request):
  before = jax.config.jax_enable_x64
  with jax.enable_x64(request.param):
    assert jnp.arange(1).dtype == (jnp.int64 if request.param else jnp.int32)
    yield request.param
  assert jax.config.jax_enable_x64 == before


@pytest.fixture(params=[False, True], ids=["x32", "x64"])
def x64_always(request):
  """Runs a test with jax_enable_x64 off, then on, both in the default suite (the kernels' lowerings and
  cotangents). `jax.enable_x64` is a context setting restored on exit, so it cannot leak into the other tests of the
  same xdist worker; the asserts check both ends. (Imported by the Pallas test files too.)"""
  yield from _x64(request)


@pytest.fixture(params=[False, pytest.param(True, marks=pytest.mark.slow)], ids=["x32", "x64"])
def x64(request):
  """As `x64_always`, with the x64 run marked slow: the numerical comparisons, whose x64 runs repeat the x32 ones'
  compiles (~250 s of the default suite's time); the default suite checks x64 through `x64_always` and
  test_float64_inputs_under_x64."""
  yield from _x64(request)


def make_inputs(B=2, T=37, S=None, Hq=4, Hkv=2, D=16, dtype=jnp.float32, seed=0, logit_scale=1.0):
  S = S or T
  ks = jax.random.split(jax.random.PRNGKey(seed), 5)
  q = (jax.random.normal(ks[0], (B, T, Hq, D)) * logit_scale).astype(dtype)
  k = jax.random.normal(ks[1], (B, S, Hkv, D)).astype(dtype)
  v = jax.random.normal(ks[2], (B, S, Hkv, D)).astype(dtype)
  w = jax.random.normal(ks[3], (B, T, Hq, D))
  u = jax.random.normal(ks[4], (B, Hq, T))
  return q, k, v, w, u


def packed_segments(B, T):
  """Row 0: three documents then padding; row 1: one document; row 2 (if any): all padding."""
  rows = []
  for b in range(B):
    if b == 0:
      a, c = T // 4, T // 2
      rows.append([1] * a + [2] * (c - a) + [3] * (T - c - 5) + [0] * 5)
    elif b == 1:
      rows.append([7] * T)
    else:
      rows.append([0] * T)
  return jnp.array(rows, jnp.int32)


def loss_both_outputs(q, k, v, w, u, **kw):
  """Uses out and lse, as sink-aware training does: sum(out*w) + sum(sigmoid(lse - c)*u)."""
  out, lse = flash_attention(q, k, v, **kw)
  return jnp.sum(out.astype(jnp.float32) * w) + jnp.sum(jax.nn.sigmoid(lse - 0.3) * u)


def assert_close(a, b, rtol, atol, what):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  assert np.all(np.isfinite(a)), f"{what}: non-finite values"
  np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, err_msg=what)


def compare(impl, *, causal=True, seg=None, block_k=None, block_sizes=None, tol=(2e-5, 2e-5), **shape):
  q, k, v, w, u = make_inputs(**shape)
  kw = dict(causal=causal, segment_ids=seg)
  blocks = dict(block_k=block_k, block_sizes=block_sizes)
  fwd = jax.jit(flash_attention, static_argnames=("impl", "block_k", "block_sizes", "causal"))
  out, lse = fwd(q, k, v, impl=impl, **blocks, **kw)
  out_r, lse_r = fwd(q, k, v, impl="reference", **kw)
  rtol, atol = tol
  finite = np.isfinite(np.asarray(lse_r))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  assert_close(out, out_r, rtol, atol, "out")
  assert_close(np.where(finite, lse, 0), np.where(finite, lse_r, 0), rtol, atol, "lse")
  grad = jax.jit(jax.grad(loss_both_outputs, (0, 1, 2)), static_argnames=("impl", "block_k", "block_sizes", "causal"))
  g = grad(q, k, v, w, u, impl=impl, **blocks, **kw)
  g_r = grad(q, k, v, w, u, impl="reference", **kw)
  scale = max(float(jnp.abs(x.astype(jnp.float32)).max()) for x in g_r)
  for name, a, b in zip("qkv", g, g_r):
    assert_close(a, b, rtol, atol * scale, f"d{name}")


def test_reference_matches_jax_dot_product_attention():
  """The oracle itself against an independent implementation (jax.nn.dot_product_attention, GQA, causal)."""
  q, k, v, *_ = make_inputs(T=33)
  out, lse = flash_attention(q, k, v, impl="reference")
  expected = jax.nn.dot_product_attention(q, k, v, is_causal=True)
  assert_close(out, expected, 1e-5, 1e-5, "out")
  # lse by hand for one row: log sum_j exp(q_t.k_j / sqrt(D)) over j <= t
  t, h = 20, 3
  z = np.asarray(q[0, t, h]) @ np.asarray(k[0, : t + 1, h // 2]).T / np.sqrt(16)
  np.testing.assert_allclose(float(lse[0, h, t]), np.log(np.exp(z.astype(np.float64)).sum()), rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("block_k", [8, 16, 64])
def test_xla_matches_reference_f32(causal, block_k):
  compare("xla", causal=causal, block_k=block_k)


def test_xla_packed_segments_with_padding(x64):
  B, T = 3, 45
  compare("xla", seg=packed_segments(B, T), block_k=16, B=B, T=T)


def test_xla_distinct_forward_and_backward_tiles(x64):
  """Forward key tile 8, backward key tile 16 (neither divides T = 45): same values and gradients as the reference."""
  B, T = 3, 45
  compare("xla", seg=packed_segments(B, T), block_sizes=BlockSizes(block_k=8, block_kv_dkv=16), B=B, T=T)


def test_xla_gqa_mqa_and_mha():
  for hq, hkv in [(4, 1), (4, 4), (6, 2)]:
    compare("xla", block_k=16, Hq=hq, Hkv=hkv, T=24)


def test_xla_large_logits():
  """Logits of magnitude ~ hundreds: online softmax must rescale without overflow."""
  compare("xla", block_k=8, logit_scale=30.0, tol=(2e-5, 5e-5))


def test_xla_cross_attention_t_not_s(x64):
  """T != S, bottom-right-aligned causal mask and pair-form segment ids (decode against a cache)."""
  B, T, S = 2, 5, 29
  q_seg = jnp.ones((B, T), jnp.int32)
  kv_seg = jnp.ones((B, S), jnp.int32).at[1, 20:].set(0)      # row 1: only 20 cache slots filled
  for causal in (True, False):
    compare("xla", causal=causal, seg=(q_seg, kv_seg), block_k=8, B=B, T=T, S=S)


def test_xla_causal_row_tiles_skip_masked_tiles(x64):
  """Causal attention cut into query row blocks, each scanning only the keys it can see (the upper triangle is never
  computed): row tiles that do and do not divide T, with packed segments and padding, and T != S both ways (a row
  block that sees no key at all when T > S gets zero output, lse -inf, zero gradients)."""
  B, T = 3, 45
  for bq, bq_dkv in [(16, 8), (7, 45), (64, 16)]:
    compare("xla", seg=packed_segments(B, T), B=B, T=T,
            block_sizes=BlockSizes(block_q=bq, block_k=8, block_q_dkv=bq_dkv, block_kv_dkv=16))
  for T, S in [(5, 29), (29, 5)]:
    compare("xla", block_sizes=BlockSizes.uniform(4, 8), B=2, T=T, S=S)


def test_eager_calls_reuse_one_compiled_kernel():
  """Called outside jit, the kernel is compiled once per shape and then reused (a custom_vjp called eagerly is
  otherwise traced and compiled again on every call: ~0.3 s per layer of a toy model), and gives what the traced
  kernel gives."""
  from sinkjax.kernels import flash
  q, k, v, _, _ = make_inputs(T=19, Hq=6, Hkv=3)                       # a shape no other test uses
  before = flash._flash_eager._cache_size()
  outs = [flash_attention(q, k, v, impl="xla", block_k=8) for _ in range(3)]
  assert flash._flash_eager._cache_size() == before + 1
  traced = jax.jit(lambda q, k, v: flash_attention(q, k, v, impl="xla", block_k=8))(q, k, v)
  for a, b in zip(outs[-1], traced):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_xla_bf16(x64):
  compare("xla", block_k=16, dtype=jnp.bfloat16, tol=(3e-2, 3e-2))


def test_float64_inputs_under_x64():
  """With x64 on, jnp arrays default to float64: xla and the reference take them (out in float64, lse float32),
  the Pallas backends (no float64 on TPUs and in Triton dots) refuse them with a message saying what to do."""
  with jax.enable_x64(True):
    q, k, v, w, u = make_inputs(T=24, dtype=jnp.float64)
    compare("xla", block_k=8, T=24, dtype=jnp.float64)
    assert flash_attention(q, k, v, impl="xla")[0].dtype == jnp.float64
    for impl in ("pallas_gpu", "pallas_tpu"):
      with pytest.raises(ValueError, match=r"float32 or bfloat16 q, k, v; got float64.*astype\(jnp.float32\)"):
        flash_attention(q, k, v, impl=impl, interpret=True)


def test_padding_rows_zero_output_neg_inf_lse_no_nan():
  B, T = 3, 24
  seg = packed_segments(B, T)
  q, k, v, w, u = make_inputs(B=B, T=T)
  for impl in ("reference", "xla"):
    out, lse = flash_attention(q, k, v, segment_ids=seg, impl=impl, block_k=8)
    pad = np.asarray(seg) == 0
    assert np.all(np.asarray(out)[pad] == 0)
    assert np.all(np.isneginf(np.asarray(lse).transpose(0, 2, 1)[pad]))
    g = jax.grad(loss_both_outputs, (0, 1, 2))(q, k, v, w, u, segment_ids=seg, impl=impl, block_k=8)
    for x in g:
      assert np.all(np.isfinite(np.asarray(x)))
    assert np.all(np.asarray(g[0])[pad] == 0)


def test_lse_cotangent_alone_is_used():
  """A loss on the LSE only: a kernel that dropped the LSE cotangent would return zero gradients."""
  q, k, v, _, u = make_inputs(T=16)
  f = lambda q, k, impl: jnp.sum(flash_attention(q, k, v, impl=impl, block_k=8)[1] * u)
  g = jax.grad(f, (0, 1))(q, k, "xla")
  g_r = jax.grad(f, (0, 1))(q, k, "reference")
  assert float(jnp.abs(g[0]).max()) > 1e-2
  for a, b in zip(g, g_r):
    assert_close(a, b, 2e-5, 2e-5, "dlse path")


def test_auto_on_cpu_is_xla_and_errors():
  from sinkjax.kernels import default_impl
  assert default_impl("cpu") == "xla" and default_impl("tpu") == "pallas_tpu" and default_impl("gpu") == "pallas_gpu"
  q, k, v, *_ = make_inputs(T=8)
  with pytest.raises(ValueError, match="impl must be one of"):
    flash_attention(q, k, v, impl="triton")
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    flash_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
  with pytest.raises(ValueError, match="batch, time, heads"):
    flash_attention(q[0], k, v)


def _sharded_matches_reference(mesh, batch_spec, head_spec, **axes):
  """Inside a sharded jit under `mesh`, the xla kernel runs per shard (shard_map over batch and heads) and its
  gradients match the single-device reference."""
  q, k, v, w, u = make_inputs(B=8, T=32, Hq=4, Hkv=2)
  seg = jnp.ones((8, 32), jnp.int32).at[0, 20:].set(0)
  kw = dict(segment_ids=seg, block_k=8, **axes)
  g_ref = jax.grad(loss_both_outputs, (0, 1, 2))(q, k, v, w, u, impl="reference", segment_ids=seg)
  spec = NamedSharding(mesh, P(batch_spec, None, head_spec, None))
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    f = jax.jit(jax.grad(lambda q, k, v: loss_both_outputs(q, k, v, w, u, impl="xla", **kw), (0, 1, 2)))
    assert "shard_map" in str(jax.make_jaxpr(f)(*args))
    g = f(*args)
  assert g[0].sharding.spec == spec.spec
  for a, b in zip(g, g_ref):
    assert_close(a, b, 2e-5, 2e-5, "sharded grad")


@pytest.mark.parametrize("shape", [(2, 2, 2), (8, 1, 1), (1, 4, 2)])
def test_sharded_jit_8_devices(shape, x64):
  """The default axes: batch over ("data", "fsdp"), heads over "tensor", the names `sinkjax.sharding` uses."""
  assert jax.device_count() == 8, "conftest sets 8 simulated CPU devices"
  mesh = Mesh(np.array(jax.devices()).reshape(shape), sharding.AXES)
  _sharded_matches_reference(mesh, sharding.BATCH_AXES, sharding.HEAD_AXIS)


def test_sharded_jit_custom_axis_names():
  """A mesh with other axis names: passing them as batch_axes / head_axis runs the kernel per shard."""
  mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("replica", "model"))
  _sharded_matches_reference(mesh, "replica", "model", batch_axes=("replica",), head_axis="model")


def test_mesh_axis_defaults_and_errors():
  """The wrapper's default axes are sharding.py's constants (one home), and bad names are a clear ValueError."""
  params = inspect.signature(flash_attention).parameters
  assert params["batch_axes"].default is sharding.BATCH_AXES
  assert params["head_axis"].default is sharding.HEAD_AXIS
  q, k, v, *_ = make_inputs(T=8)
  with pytest.raises(ValueError, match="head_axis 'data' is also one of batch_axes"):
    flash_attention(q, k, v, head_axis="data")
  with pytest.raises(ValueError, match="batch_axes must be mesh axis names"):
    flash_attention(q, k, v, batch_axes=(0,))


def test_block_sizes_errors_name_the_argument():
  q, k, v, *_ = make_inputs(T=8)
  with pytest.raises(ValueError, match=r"block_sizes\.block_q_dkv must be a positive integer"):
    BlockSizes(block_q_dkv=0)
  with pytest.raises(ValueError, match=r"block_sizes\.block_k must be a positive integer"):
    BlockSizes(block_k=2.5)
  with pytest.raises(ValueError, match="block_q must be a positive integer"):
    flash_attention(q, k, v, impl="xla", block_q=-16)
  with pytest.raises(ValueError, match="not both"):
    flash_attention(q, k, v, impl="xla", block_k=8, block_sizes=BlockSizes(block_k=8))
  with pytest.raises(TypeError, match="block_sizes must be a sinkjax.kernels.BlockSizes"):
    flash_attention(q, k, v, impl="xla", block_sizes={"block_k": 8})
  # Triton tiles are powers of two; a bad backward tile is reported at the forward call already.
  with pytest.raises(ValueError, match="powers of two; got block_q_dkv=48"):
    flash_attention(q, k, v, impl="pallas_gpu", interpret=True, block_sizes=BlockSizes(block_q_dkv=48))
  with pytest.raises(ValueError, match="powers of two; got block_q=24"):
    flash_attention(q, k, v, impl="pallas_gpu", interpret=True, block_q=24)


def _pass_grids(impl, T, **kw):
  """{pass name: grid} of the Pallas calls (or the lengths of the scans, for xla) in the traced fwd+bwd program."""
  q = jnp.zeros((1, T, 4, 128), jnp.float32)
  kv = jnp.zeros((1, T, 2, 128), jnp.float32)

  def loss(q, k, v):
    out, lse = flash_attention(q, k, v, impl=impl, **kw)
    return jnp.sum(out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  found = {}

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        found[eqn.params["name"]] = tuple(eqn.params["grid_mapping"].grid)
      if eqn.primitive.name == "scan":
        found.setdefault("scan", []).append(eqn.params["length"])
      for sub in jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, kv, kv).jaxpr)
  return found


def test_each_pass_runs_with_its_own_tiles():
  """Tracing only: the forward, dK/dV and dQ passes are cut by their own BlockSizes fields."""
  # xla: the forward scans 512 / 64 key blocks, the fused backward 512 / 128 (one query block of 512 rows); on a CPU
  # the backward's 2 (batch row, KV head) pairs take one lax.map step each (G 2 x 512 x 128 = _CPU_TILE elements) ...
  assert _pass_grids("xla", 512, block_sizes=BlockSizes(512, 64, 512, 128))["scan"] == [8, 2, 4]
  # ... and with causal row blocks (forward 256 rows, backward 128) each row block scans only the keys it sees.
  assert _pass_grids("xla", 512, block_sizes=BlockSizes(256, 64, 128, 128))["scan"] == [4, 8, 1, 2, 3, 4]
  # pallas_gpu, grid (tiles of the outer axis, B, Hq): query tiles for forward and dq, key tiles for dk/dv.
  grids = _pass_grids("pallas_gpu", 512, block_sizes=BlockSizes(64, 16, 16, 32, 128, 64), interpret=True)
  assert grids == {"sinkjax_flash_fwd": (8, 1, 4), "sinkjax_flash_bwd_dq": (4, 1, 4),
                   "sinkjax_flash_bwd_dkv": (16, 1, 4)}
  # pallas_tpu: (B, Hq, nq, nk) for forward and dq, (B, Hkv, nk, G * nq) for dk/dv, with G = 2.
  grids = _pass_grids("pallas_tpu", 512, block_sizes=BlockSizes(128, 256, 512, 128, 256, 512), interpret=True)
  assert grids == {"sinkjax_flash_fwd": (1, 4, 4, 2), "sinkjax_flash_bwd_dkv": (1, 2, 4, 2 * 1),
                   "sinkjax_flash_bwd_dq": (1, 4, 2, 1)}
  # The block_q / block_k shorthand fills every pass.
  grids = _pass_grids("pallas_tpu", 512, block_q=128, block_k=256, interpret=True)
  assert grids == {"sinkjax_flash_fwd": (1, 4, 4, 2), "sinkjax_flash_bwd_dkv": (1, 2, 2, 2 * 4),
                   "sinkjax_flash_bwd_dq": (1, 4, 4, 2)}


@pytest.mark.parametrize("shape,dtype", [((7, 5), jnp.float32), ((2, 9, 5), jnp.float32), ((2, 9, 5), jnp.bfloat16)])
def test_dense_dot_general_matches_float64_with_its_gradients(shape, dtype):
  """kernels.dense.dot_general (the dense layers' dot, a custom weight-gradient VJP on CPU) against the float64 oracle
  (numpy on the same inputs): same values, dx = u W^T and dW = x^T u, for token-major inputs of any rank, within the
  input dtype's rounding. (XLA:CPU's own bfloat16 dot is no oracle: its weight gradient moved from 0.022 to 0.052
  off float64 between jax 0.10 and 0.12.) The dtypes are lax.dot_general's."""
  from sinkjax.kernels import dense  # pylint: disable=import-outside-toplevel
  kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, shape).astype(dtype)
  w = jax.random.normal(kw, (shape[-1], 3)).astype(dtype)
  u = jax.random.normal(kg, shape[:-1] + (3,))
  dims = (((x.ndim - 1,), (0,)), ((), ()))
  loss = lambda dot: lambda x, w: jnp.sum(dot(x, w, dims).astype(jnp.float32) * u)
  got = jax.jit(jax.value_and_grad(loss(dense.dot_general), (0, 1)))(x, w)
  want = jax.eval_shape(jax.value_and_grad(loss(jax.lax.dot_general), (0, 1)), x, w)
  x64, w64, u64 = (np.asarray(a, np.float64) for a in (x, w, u))
  xf, uf = x64.reshape(-1, shape[-1]), u64.reshape(-1, 3)
  oracle = (np.sum((xf @ w64) * uf), (uf @ w64.T).reshape(shape), xf.T @ uf)
  # float32: summation order; bfloat16: the products and the outputs rounded to 8 bits (2^-8 relative per term)
  rel = 1e-5 if dtype == jnp.float32 else 2.0 ** -6
  for a, spec, b, what in zip(jax.tree.leaves(got), jax.tree.leaves(want), oracle, ("value", "dx", "dw")):
    assert a.dtype == spec.dtype and a.shape == spec.shape, what
    scale = float(np.abs(b).max()) if what != "value" else float(np.sum(np.abs((xf @ w64) * uf)))
    assert_close(a, b, 0, rel * scale, what)


# ---------------------------------------------------------------- edge cases from other projects' attention test grids
# (jax's tests/nn_test.py and pallas attention tests, tokamax's, FlashAttention's test_flash_attn.py), on every backend
# with a CPU form: Pallas interpreted, mosaic_gpu's CPU form where tokamax is installed (Python >= 3.12).

_TOKAMAX = __import__("importlib").util.find_spec("tokamax") is not None
CPU_IMPLS = ["reference", "xla", "pallas_tpu", "pallas_gpu",
             pytest.param("mosaic_gpu", marks=pytest.mark.skipif(not _TOKAMAX, reason="mosaic_gpu needs tokamax "
                                                                 "(Python >= 3.12)"))]


@pytest.mark.parametrize("impl", CPU_IMPLS)
@pytest.mark.parametrize("T,S", [(0, 8), (8, 0), (0, 0)])
def test_empty_queries_or_keys(impl, T, S):
  """T = 0 or S = 0 (FlashAttention's seqlen grid reaches 0 in varlen batches): empty / all-zero out (no key seen: the
  reference module's formula, and jax.nn.dot_product_attention on jax 0.12, give the same), lse -inf, zero gradients
  of the right shapes. The xla and Pallas backends divided by a zero block count before."""
  from sinkjax.kernels import reference
  B, H, D = 1, 2, 16
  q, k, v = (jnp.ones((B, n, H, D), jnp.float32) for n in (T, S, S))
  out, lse = flash_attention(q, k, v, causal=False, impl=impl)
  ones_q, ones_kv = jnp.ones((B, T), jnp.int32), jnp.ones((B, S), jnp.int32)
  out_r, lse_r = reference.attention(q, k, v, ones_q, ones_kv, causal=False, scale=0.25)
  assert out.shape == out_r.shape == (B, T, H, D) and lse.shape == lse_r.shape == (B, H, T)
  assert not np.any(np.asarray(out)) and not np.any(np.asarray(out_r))
  assert np.all(np.asarray(lse) == -np.inf) and np.all(np.asarray(lse_r) == -np.inf)

  def loss(q, k, v):
    o, l = flash_attention(q, k, v, causal=True, impl=impl)
    return jnp.sum(o) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0))
  grads = jax.grad(loss, (0, 1, 2))(q, k, v)
  for g, x in zip(grads, (q, k, v)):
    assert g.shape == x.shape and not np.any(np.asarray(g))


@pytest.mark.parametrize("paired", [True, False], ids=["paired", "self"])
@pytest.mark.parametrize("impl", CPU_IMPLS + ["auto"])
def test_nan_in_padding_rows_reaches_no_valid_row(impl, paired):
  """A NaN (or inf) in a padding row (segment id 0) of q, k or v: valid rows' out, lse and every gradient equal the
  reference formula's on the same inputs with those rows zero (the reference module called directly, differentiated
  by autodiff), and the padding rows' gradients are 0. Before, 0 * NaN in the masked matmuls made every dq / dk NaN
  on every backend. Paired ids (cross-attention, T != S) and one [B, T] array (packed documents: mosaic_gpu's key-range
  route)."""
  from sinkjax.kernels import reference
  B, T, S, Hq, Hkv, D = 2, 8, 12 if paired else 8, 2, 1, 16
  q, k, v, w, u = make_inputs(B=B, T=T, S=S, Hq=Hq, Hkv=Hkv, D=D, seed=4)
  q_seg = jnp.array([[1] * 6 + [0] * 2, [0] + [3] * 7], jnp.int32)
  kv_seg = jnp.array([[1] * 9 + [0] * 3, [0] * 2 + [3] * 10], jnp.int32) if paired else \
      jnp.array([[1] * 3 + [2] * 3 + [0] * 2, [0] + [3] * 7], jnp.int32)
  q_seg = q_seg if paired else kv_seg
  ids = (q_seg, kv_seg) if paired else q_seg
  pad_q, pad_kv = ((s == 0)[:, :, None, None] for s in (q_seg, kv_seg))
  bad = lambda x, pad, val: jnp.where(pad, val, x)
  q_bad, k_bad, v_bad = bad(q, pad_q, jnp.nan), bad(k, pad_kv, jnp.inf), bad(v, pad_kv, jnp.nan)
  q0, k0, v0 = bad(q, pad_q, 0.0), bad(k, pad_kv, 0.0), bad(v, pad_kv, 0.0)
  wrap = lambda o, l: jnp.sum(o.astype(jnp.float32) * w) + jnp.sum(jnp.where(jnp.isfinite(l), l, 0.0) * u)

  def loss(q, k, v):
    o, l = flash_attention(q, k, v, causal=True, segment_ids=ids, impl=impl)
    return wrap(o, l), (o, l)

  def ref_loss(q, k, v):
    o, l = reference.attention(q, k, v, q_seg, kv_seg, causal=True, scale=1 / np.sqrt(D))
    return wrap(o, l), (o, l)
  (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2), has_aux=True))(q_bad, k_bad, v_bad)
  (_, (out_r, lse_r)), ref = jax.value_and_grad(ref_loss, (0, 1, 2), has_aux=True)(q0, k0, v0)
  np.testing.assert_allclose(np.asarray(out), np.asarray(out_r), atol=2e-5, err_msg="out")
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), np.isfinite(np.asarray(lse_r)))
  fin = np.isfinite(np.asarray(lse_r))
  np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(lse_r)[fin], atol=2e-5, err_msg="lse")
  for name, g, r, pad in zip(("dq", "dk", "dv"), grads, ref, (pad_q, pad_kv, pad_kv)):
    assert_close(g, r, rtol=1e-4, atol=1e-4, what=name)
    assert not np.any(np.asarray(jnp.where(pad, g, 0.0))), name


def test_paired_ids_causal_aligns_by_the_padded_lengths():
  """docs/KERNEL.md's example: paired ids packing documents of different query / key lengths. Causal is bottom-right
  over the padded arrays (offset S - T = 2), not per document as FlashAttention's varlen aligns (document 1: 2
  queries, 3 keys, so its query 0 would see keys 0 and 1 there): query 0 sees keys 0, 1, 2; query 2 (document 2's
  first) sees keys s <= 4 of document 2, i.e. 3 and 4. The xla backend follows the same mask."""
  from sinkjax.kernels import reference
  q_ids = jnp.array([[1, 1, 2, 2, 2]], jnp.int32)
  kv_ids = jnp.array([[1, 1, 1, 2, 2, 2, 2]], jnp.int32)
  mask = np.asarray(reference.attention_mask(q_ids, kv_ids, causal=True))[0].astype(int)
  np.testing.assert_array_equal(mask, [[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 0, 0],
                                       [0, 0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1]])
  q, k, v, _, _ = make_inputs(B=1, T=5, S=7, Hq=1, Hkv=1, D=8)
  out, _ = flash_attention(q, k, v, causal=True, segment_ids=(q_ids, kv_ids), impl="xla")
  p = np.asarray(jax.nn.softmax(jnp.where(mask[:, None] > 0, jnp.einsum("thd,shd->ths", q[0], k[0]) / np.sqrt(8),
                                          -jnp.inf), axis=-1))        # [T, H, S], by hand from the mask above
  np.testing.assert_allclose(np.asarray(out[0]), np.einsum("ths,shd->thd", p, np.asarray(v[0])), atol=1e-5)
