"""flash_attention: every backend against the materialized reference, forward and backward through out AND lse.

Pallas backends are checked in their own files (interpret mode + cross-lowering); here: the reference itself against
an independent library (jax.nn.dot_product_attention), and the blockwise XLA backend against the reference.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sinkjax.kernels import flash_attention


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


def compare(impl, *, causal=True, seg=None, block_k=None, tol=(2e-5, 2e-5), **shape):
  q, k, v, w, u = make_inputs(**shape)
  kw = dict(causal=causal, segment_ids=seg)
  fwd = jax.jit(flash_attention, static_argnames=("impl", "block_k", "causal"))
  out, lse = fwd(q, k, v, impl=impl, block_k=block_k, **kw)
  out_r, lse_r = fwd(q, k, v, impl="reference", **kw)
  rtol, atol = tol
  finite = np.isfinite(np.asarray(lse_r))
  np.testing.assert_array_equal(np.isfinite(np.asarray(lse)), finite)
  assert_close(out, out_r, rtol, atol, "out")
  assert_close(np.where(finite, lse, 0), np.where(finite, lse_r, 0), rtol, atol, "lse")
  grad = jax.jit(jax.grad(loss_both_outputs, (0, 1, 2)), static_argnames=("impl", "block_k", "causal"))
  g = grad(q, k, v, w, u, impl=impl, block_k=block_k, **kw)
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


def test_xla_packed_segments_with_padding():
  B, T = 3, 45
  compare("xla", seg=packed_segments(B, T), block_k=16, B=B, T=T)


def test_xla_gqa_mqa_and_mha():
  for hq, hkv in [(4, 1), (4, 4), (6, 2)]:
    compare("xla", block_k=16, Hq=hq, Hkv=hkv, T=24)


def test_xla_large_logits():
  """Logits of magnitude ~ hundreds: online softmax must rescale without overflow."""
  compare("xla", block_k=8, logit_scale=30.0, tol=(2e-5, 5e-5))


def test_xla_cross_attention_t_not_s():
  """T != S, bottom-right-aligned causal mask and pair-form segment ids (decode against a cache)."""
  B, T, S = 2, 5, 29
  q_seg = jnp.ones((B, T), jnp.int32)
  kv_seg = jnp.ones((B, S), jnp.int32).at[1, 20:].set(0)      # row 1: only 20 cache slots filled
  for causal in (True, False):
    compare("xla", causal=causal, seg=(q_seg, kv_seg), block_k=8, B=B, T=T, S=S)


def test_xla_bf16():
  compare("xla", block_k=16, dtype=jnp.bfloat16, tol=(3e-2, 3e-2))


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
    flash_attention(q, k, v, impl="cudnn")
  with pytest.raises(ValueError, match="multiple of key/value heads"):
    flash_attention(q, k[:, :, :1].repeat(3, 2), v[:, :, :1].repeat(3, 2))
  with pytest.raises(ValueError, match="batch, time, heads"):
    flash_attention(q[0], k, v)


@pytest.mark.parametrize("shape", [(2, 2, 2), (8, 1, 1), (1, 4, 2)])
def test_sharded_jit_8_devices(shape):
  """Inside a sharded jit with an active mesh, the kernel runs per shard (shard_map over batch and heads) and
  matches the single-device reference, forward and backward."""
  assert jax.device_count() == 8, "conftest sets 8 simulated CPU devices"
  mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "fsdp", "tensor"))
  q, k, v, w, u = make_inputs(B=8, T=32, Hq=4, Hkv=2)
  seg = jnp.ones((8, 32), jnp.int32).at[0, 20:].set(0)
  kw = dict(segment_ids=seg, block_k=8)
  g_ref = jax.grad(loss_both_outputs, (0, 1, 2))(q, k, v, w, u, impl="reference", segment_ids=seg)
  spec = NamedSharding(mesh, P(("data", "fsdp"), None, "tensor", None))
  with jax.set_mesh(mesh):
    args = [jax.device_put(x, spec) for x in (q, k, v)]
    f = jax.jit(jax.grad(lambda q, k, v: loss_both_outputs(q, k, v, w, u, impl="xla", **kw), (0, 1, 2)))
    assert "shard_map" in str(jax.make_jaxpr(f)(*args))
    g = f(*args)
  assert g[0].sharding.spec == spec.spec
  for a, b in zip(g, g_ref):
    assert_close(a, b, 2e-5, 2e-5, "sharded grad")
