"""The three variants and the balance loss against materialized-attention formulas ([Sink-MoE] eq. 1-8, App. B)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sinkjax import balance
from sinkjax.attention import gated_attention, sink_attention, vanilla_attention
from sinkjax.balance import aux_loss, head_imbalance, head_importance

jax.config.update("jax_default_matmul_precision", "highest")


def inputs(B=2, T=20, Hq=4, Hkv=2, D=8, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return tuple(jax.random.normal(k_, (B, T, h, D)) for k_, h in zip(ks, (Hq, Hkv, Hkv)))


def materialized_probs(q, k, seg=None, sink=None):
  """Causal softmax written out in full; with `sink`, a sink column is appended to the logits and dropped after
  the softmax (GPT-OSS). Returns probabilities [B,H,T,S] and, with a sink, the sink column [B,H,T]."""
  B, T, Hq, D = q.shape
  kk = jnp.repeat(k, Hq // k.shape[2], axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q, kk) / np.sqrt(D)
  mask = jnp.tril(jnp.ones((T, T), bool))[None]
  if seg is not None:
    mask = mask & (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] != 0)
  s = jnp.where(mask[:, None], s, -1e30)
  if sink is None:
    return jax.nn.softmax(s, -1), None
  col = jnp.broadcast_to(sink[None, :, None, None], s.shape[:-1] + (1,))
  p = jax.nn.softmax(jnp.concatenate([s, col], -1), -1)
  return p[..., :-1], p[..., -1]


def materialized_out(p, v):
  Hq = p.shape[1]
  return jnp.einsum("bhts,bshd->bthd", p, jnp.repeat(v, Hq // v.shape[2], axis=2))


def first_index(seg):
  seg = np.asarray(seg)
  out = np.zeros_like(seg)
  for b in range(seg.shape[0]):
    for t in range(seg.shape[1]):
      j = t
      while j > 0 and seg[b, j - 1] == seg[b, t]:
        j -= 1
      out[b, t] = j
  return out


SEG = jnp.array([[1] * 6 + [2] * 10 + [0] * 4, [5] * 20])


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_sink_attention_equals_sink_column_softmax(impl):
  q, k, v = inputs()
  sink = jnp.array([0.5, -1.0, 2.0, 0.0])
  w = jax.random.normal(jax.random.PRNGKey(9), q.shape)
  u = jax.random.normal(jax.random.PRNGKey(8), q.shape[:3])

  def ours(q, k, v, sink):
    out, gate = sink_attention(q, k, v, sink, segment_ids=SEG, impl=impl)
    return jnp.sum(out * w) + jnp.sum(gate * u), (out, gate)

  def formula(q, k, v, sink):
    p, p_sink = materialized_probs(q, k, SEG, sink)
    valid = (SEG != 0)[:, :, None]
    out = materialized_out(p, v) * valid[..., None]
    gate = jnp.where(valid, 1 - jnp.swapaxes(p_sink, 1, 2), 0.0)
    return jnp.sum(out * w) + jnp.sum(gate * u), (out, gate)

  (l1, (o1, g1)), d1 = jax.jit(jax.value_and_grad(ours, (0, 1, 2, 3), has_aux=True))(q, k, v, sink)
  (l2, (o2, g2)), d2 = jax.jit(jax.value_and_grad(formula, (0, 1, 2, 3), has_aux=True))(q, k, v, sink)
  np.testing.assert_allclose(o1, o2, atol=1e-5)
  np.testing.assert_allclose(g1, g2, atol=1e-5)
  for name, a, b in zip(["q", "k", "v", "sink"], d1, d2):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4, err_msg=f"d{name}")


@pytest.mark.parametrize("impl", ["xla", "reference"])
def test_vanilla_gate_is_one_minus_first_token_weight_packed(impl):
  q, k, v = inputs()
  u = jax.random.normal(jax.random.PRNGKey(3), q.shape[:3])
  first = first_index(SEG)
  valid = (np.asarray(SEG) != 0) & (first != np.arange(20)[None])

  def formula(q, k):
    p, _ = materialized_probs(q, k, SEG)
    a_first = jnp.take_along_axis(p, jnp.asarray(first)[:, None, :, None], axis=-1)[..., 0]
    return jnp.where(valid[:, :, None], 1 - jnp.swapaxes(a_first, 1, 2), 0.0)

  attend = jax.jit(lambda q, k: vanilla_attention(q, k, v, segment_ids=SEG, impl=impl))
  ours = lambda q, k: attend(q, k)[1]

  np.testing.assert_allclose(ours(q, k), formula(q, k), atol=1e-6)
  d1 = jax.jit(jax.grad(lambda q, k: jnp.sum(ours(q, k) * u), (0, 1)))(q, k)
  d2 = jax.jit(jax.grad(lambda q, k: jnp.sum(formula(q, k) * u), (0, 1)))(q, k)
  for a, b in zip(d1, d2):
    np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-4)
  out = attend(q, k)[0]
  p, _ = materialized_probs(q, k, SEG)
  np.testing.assert_allclose(out, materialized_out(p, v) * (SEG != 0)[:, :, None, None], atol=1e-5)


def test_vanilla_gate_stable_near_total_sink():
  """Sink weights up to 1 - 1e-7: |G - G_exact| <= 1e-5, and relative error <= 1e-3 wherever G >= 1e-2
  (G_exact in float64 numpy). 1 - A_first computed naively in f32 would lose all digits near 1 - 1e-7."""
  T, D = 12, 16
  rng = np.random.default_rng(0)
  e1 = np.zeros(D)
  e1[0] = 1.0
  strengths = np.linspace(0.0, 24.0, 32)                  # how strongly every query points at key 0
  q = np.stack([np.tile(e1 * 4.0, (T, 1))] * len(strengths))[:, :, None, :]
  k = rng.normal(size=(len(strengths), T, 1, D)) * 0.3
  k[:, 0, 0, :] = strengths[:, None] * e1 * np.sqrt(D) / 4.0   # z_t0 = strength for every t
  v = rng.normal(size=k.shape)
  _, gate = jax.jit(lambda q, k, v: vanilla_attention(q, k, v, impl="xla"))(
      jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32))
  z = np.einsum("btd,bsd->bts", q[:, :, 0], k[:, :, 0]) / np.sqrt(D)
  z = np.where(np.tril(np.ones((T, T), bool)), z, -np.inf)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  exact = 1.0 - p[:, :, 0]
  exact[:, 0] = 0.0
  got = np.asarray(gate[:, :, 0], np.float64)
  assert exact[:, 1:].min() < 1e-6, "the sweep must reach near-total sinks"
  assert np.abs(got - exact).max() <= 1e-5
  big = exact >= 1e-2
  assert np.all(np.abs(got - exact)[big] / exact[big] <= 1e-3)


@pytest.mark.parametrize("granularity", ["headwise", "elementwise"])
def test_gated_attention_is_sdpa_times_sigmoid(granularity):
  q, k, v = inputs()
  shape = q.shape[:3] if granularity == "headwise" else q.shape
  logits = jax.random.normal(jax.random.PRNGKey(5), shape) * 3
  out, gate = gated_attention(q, k, v, logits, segment_ids=SEG, impl="xla")
  p, _ = materialized_probs(q, k, SEG)
  g = 1 / (1 + np.exp(-np.asarray(logits)))
  g = g[..., None] if granularity == "headwise" else g
  expected = materialized_out(p, v) * (SEG != 0)[:, :, None, None] * g
  np.testing.assert_allclose(out, expected, atol=1e-5)
  np.testing.assert_allclose(gate, 1 / (1 + np.exp(-np.asarray(logits))), rtol=1e-6)


def test_balance_hand_values():
  imp = jnp.array([[0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.5, 0.5], [0.9, 0.1, 0.5, 0.5]])
  # layer 0: mean .25, pop. var .0125 -> CV^2 = .2, CV = .4472; layer 1: 0; layer 2: mean .5, var .08 -> CV^2 .32
  cv = np.array([np.sqrt(0.2), 0.0, np.sqrt(0.32)])
  np.testing.assert_allclose(head_imbalance(imp), cv.mean(), rtol=1e-6)
  np.testing.assert_allclose(aux_loss(imp, weight=1e-4), 1e-4 * 4 * (0.2 + 0 + 0.32), rtol=1e-5)
  # eq. 8, m = 1: drop the top head per layer. layer 0: {.1,.2,.3}: mean .2, var .02/3 -> CV^2 1/6;
  # layer 1: three equal -> 0; layer 2: drop .9 -> {.1,.5,.5}: mean 11/30, var = 0.03556 -> CV^2 0.26446
  l2 = np.array([0.1, 0.5, 0.5])
  cv2 = l2.var() / l2.mean() ** 2
  np.testing.assert_allclose(aux_loss(imp, weight=1.0, num_shared=1), 3 * (1 / 6 + 0 + cv2), rtol=1e-5)
  # m = 2: layer 0 {.1,.2}: mean .15, var .0025 -> 1/9; layer 2: drop .9 and one .5 -> {.1,.5}: var .04/.09
  np.testing.assert_allclose(aux_loss(imp, weight=1.0, num_shared=2), 2 * (1 / 9 + 0 + 0.04 / 0.09), rtol=1e-5)
  # a fixed shared set given up front
  shared = jnp.zeros((3, 4), bool).at[:, 0].set(True)
  l0 = np.array([0.2, 0.3, 0.4])
  l2 = np.array([0.1, 0.5, 0.5])
  want = 3 * (l0.var() / l0.mean() ** 2 + 0 + l2.var() / l2.mean() ** 2)
  np.testing.assert_allclose(aux_loss(imp, weight=1.0, num_shared=1, shared=shared), want, rtol=1e-5)


def test_aux_loss_gradient_zero_iff_balanced_and_shared_selection_has_no_gradient():
  g = jax.grad(aux_loss)(jnp.full((2, 4), 0.3), 1.0)
  assert float(jnp.abs(g).max()) < 1e-6
  imp = jnp.array([[0.1, 0.2, 0.3, 0.9]])
  g = jax.grad(aux_loss)(imp, 1.0, 1)
  assert float(g[0, 3]) == 0.0, "the shared (top-1) head gets no gradient"
  assert float(jnp.abs(g[0, :3]).max()) > 0


def test_head_importance_masks_and_elementwise():
  gate = jnp.arange(24, dtype=jnp.float32).reshape(1, 6, 4) / 24
  mask = jnp.array([[False, True, True, False, True, False]])
  np.testing.assert_allclose(head_importance(gate, mask), np.asarray(gate)[0, [1, 2, 4]].mean(0), rtol=1e-6)
  ge = jnp.stack([gate, 1 - gate], -1)                    # elementwise gate: mean over head dim first
  np.testing.assert_allclose(head_importance(ge), np.full(4, 0.5), rtol=1e-6)


def test_aux_loss_gradient_through_kernel_matches_materialized():
  """d aux_loss / d(q, k) through the LSE-based gates equals the gradient through materialized softmax."""
  q, k, v = inputs(B=2, T=16, Hq=4, Hkv=4)
  seg = SEG[:, :16]
  first = first_index(seg)
  valid = jnp.asarray((np.asarray(seg) != 0) & (first != np.arange(16)[None]))

  def via_kernel(q, k):
    imp = jnp.stack([head_importance(vanilla_attention(q * s, k, v, segment_ids=seg, impl="xla")[1], valid)
                     for s in (1.0, 2.0)])
    return aux_loss(imp, 1.0)

  def via_formula(q, k):
    imps = []
    for s in (1.0, 2.0):
      p, _ = materialized_probs(q * s, k, seg)
      a_first = jnp.take_along_axis(p, jnp.asarray(first)[:, None, :, None], axis=-1)[..., 0]
      imps.append(head_importance(jnp.swapaxes(1 - a_first, 1, 2), valid))
    return aux_loss(jnp.stack(imps), 1.0)

  (l1, d1), (l2, d2) = (jax.jit(jax.value_and_grad(f, (0, 1)))(q, k) for f in (via_kernel, via_formula))
  np.testing.assert_allclose(l1, l2, rtol=1e-5)
  for a, b in zip(d1, d2):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)


def test_segment_first_gather_gradient_matches_scatter():
  """The prefix-sum gradient of the vanilla gate's first-key gather equals the gather's own transpose (scatter-add)."""
  from sinkjax.attention import _take_segment_first, document_first_index, document_last_index
  seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 3, 3, 0, 0],
                     [5, 5, 5, 5, 5, 5, 5, 5, 5, 5],
                     [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]], jnp.int32)
  T = seg.shape[1]
  first, last = document_first_index(seg, T), document_last_index(seg, T)
  np.testing.assert_array_equal(np.asarray(last[0]), [2, 2, 2, 4, 4, 7, 7, 7, 9, 9])
  x = jax.random.normal(jax.random.PRNGKey(0), (3, T, 2, 4))
  w = jax.random.normal(jax.random.PRNGKey(1), (3, T, 2, 4))
  ref = jax.grad(lambda x: jnp.sum(jnp.take_along_axis(x, first[:, :, None, None], axis=1) * w))(x)
  got = jax.grad(lambda x: jnp.sum(_take_segment_first(x, first, last) * w))(x)
  np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(_take_segment_first(x, first, last)),
                                np.asarray(jnp.take_along_axis(x, first[:, :, None, None], axis=1)))


def test_head_roles_by_hand():
  shared_from = np.array([[0.9, 0.1, 0.5], [0.2, 0.3, 0.8]])          # top-2 per layer: {0, 2}, {2, 1}
  after = np.array([[0.6, 0.2, 0.4], [0.1, 0.5, 0.7]])
  r = balance.head_roles(after, shared_from, m=2)
  assert r["shared_importance"] == pytest.approx(np.mean([0.6, 0.4, 0.5, 0.7]))
  assert r["routed_importance"] == pytest.approx(np.mean([0.2, 0.1]))
  assert r["routed_cv"] == pytest.approx(0.0)                          # one routed head per layer
  cv = lambda x: np.std(x) / np.mean(x)
  assert r["imbalance"] == pytest.approx((cv(after[0]) + cv(after[1])) / 2)
  assert r["mean_importance"] == pytest.approx(after.mean())
