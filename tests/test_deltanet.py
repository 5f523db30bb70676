"""Gated DeltaNet (sinkjax.deltanet): the chunked and recurrent gated delta rule agree with each other (value and
gradient) and with transformers' torch reference functions; the conv matches transformers'; the NNX layer matches
`Qwen3NextGatedDeltaNet` with the same weights, full sequence and prefill + decode steps (and transformers' own
cached decode); packed documents equal the documents run alone. Tiny shapes, float32."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sinkjax import deltanet as dn

try:
  import torch
  import transformers
  from transformers.models.qwen3_next import modeling_qwen3_next as hf
except ImportError:
  torch = transformers = hf = None
oracle = pytest.mark.skipif(hf is None, reason="oracle tests need torch and transformers >= 4.57 with Qwen3-Next: "
                            "pip install -e \".[oracle]\" (CPU build)")

B, T, HK, HV, DK, DV = 2, 37, 2, 4, 8, 6
CHUNK = 8          # T is not a multiple of it


def _inputs(seed=0, T=T, B=B):
  r = np.random.default_rng(seed)
  f = lambda *s: r.normal(size=s).astype(np.float32)
  return dict(q=f(B, T, HK, DK), k=f(B, T, HK, DK), v=f(B, T, HV, DV),
              g=-r.uniform(0.01, 1.5, size=(B, T, HV)).astype(np.float32),
              beta=r.uniform(0.05, 1, size=(B, T, HV)).astype(np.float32)), f(B, HV, DK, DV)


PACKED = np.array([[1] * 10 + [2] * 17 + [3] * 10,            # documents across and inside chunks
                   [0] * 5 + [1] * 8 + [2] * 24], np.int32)    # left padding (id 0), a document of one chunk


@pytest.mark.parametrize("segment_ids", [None, PACKED], ids=["one_document", "packed"])
def test_chunked_equals_recurrent_in_value_and_gradient(segment_ids):
  x, s0 = _inputs()
  r = np.random.default_rng(1)
  w_out, w_state = r.normal(size=(B, T, HV, DV)), r.normal(size=(B, HV, DK, DV))

  def loss(rule, x, s0, **kw):
    out, state = rule(**x, initial_state=s0, segment_ids=segment_ids, use_qk_l2norm=True, **kw)
    return jnp.sum(out * w_out) + jnp.sum(state * w_state), (out, state)

  grad = lambda rule, **kw: jax.jit(jax.grad(lambda x, s0: loss(rule, x, s0, **kw), argnums=(0, 1), has_aux=True))(
      x, s0)
  (gx_c, gs_c), (out_c, st_c) = grad(dn.gated_delta_rule_chunked, chunk_size=CHUNK)
  (gx_r, gs_r), (out_r, st_r) = grad(dn.gated_delta_rule_recurrent)
  np.testing.assert_allclose(out_c, out_r, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(st_c, st_r, atol=1e-5, rtol=1e-5)
  for name in x:
    np.testing.assert_allclose(gx_c[name], gx_r[name], atol=1e-5, rtol=1e-5, err_msg=name)
  np.testing.assert_allclose(gs_c, gs_r, atol=1e-5, rtol=1e-5)
  assert all(np.isfinite(a).all() for a in jax.tree.leaves((gx_c, gs_c)))


@pytest.mark.parametrize("C", [64, 37, 1])
def test_unit_lower_inverse_is_the_inverse(C):
  """The chunk's system as the rule builds it (beta_i k_i.k_j below the diagonal, unit keys, decays in (0, 1]) and
  a random one with entries in (-1, 1), against numpy's float64 inverse, to float32 accuracy of the result's scale."""
  r = np.random.default_rng(C)
  k = r.normal(size=(3, C, 16))
  k /= np.linalg.norm(k, axis=-1, keepdims=True)
  system = r.uniform(0, 1, size=(3, C, 1)) * (k @ k.transpose(0, 2, 1)) * r.uniform(0, 1, size=(3, C, C))
  for a in (np.tril(system, -1), np.tril(r.uniform(-1, 1, size=(3, C, C)), -1)):
    ref = np.linalg.inv(np.eye(C) + a)
    got = np.asarray(dn.unit_lower_inverse(jnp.asarray(a, jnp.float32)))
    assert np.abs(got - ref).max() <= 1e-6 * max(1.0, np.abs(ref).max())


def test_chunked_is_stable_under_strong_decay():
  """Gates of -60 per token: exp(cumulative log-gate) underflows within a chunk; no NaN, and still the recurrence."""
  x, s0 = _inputs(2)
  x["g"] = x["g"] * 40
  out_c, st_c = jax.jit(lambda x: dn.gated_delta_rule_chunked(**x, initial_state=s0, chunk_size=16,
                                                                use_qk_l2norm=True))(x)
  out_r, st_r = jax.jit(lambda x: dn.gated_delta_rule_recurrent(**x, initial_state=s0, use_qk_l2norm=True))(x)
  g = jax.jit(jax.grad(lambda g: dn.gated_delta_rule_chunked(**{**x, "g": g}, chunk_size=16,
                                                             use_qk_l2norm=True)[0].sum()))
  assert np.isfinite(out_c).all() and np.isfinite(g(x["g"])).all()
  np.testing.assert_allclose(out_c, out_r, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(st_c, st_r, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Against transformers' torch implementation
# ---------------------------------------------------------------------------------------------------------------



def _torch(a):
  return torch.from_numpy(np.asarray(a))


@oracle
@pytest.mark.parametrize("l2", [True, False])
def test_rule_matches_transformers(l2):
  x, s0 = _inputs(3)
  tx = {n: _torch(a) for n, a in x.items()}
  for ours, theirs, kw in [(dn.gated_delta_rule_chunked, hf.torch_chunk_gated_delta_rule, dict(chunk_size=CHUNK)),
                           (dn.gated_delta_rule_recurrent, hf.torch_recurrent_gated_delta_rule, {})]:
    out, state = ours(**x, initial_state=s0, use_qk_l2norm=l2, **kw)
    ref_out, ref_state = theirs(*tx.values(), initial_state=_torch(s0), output_final_state=True,
                                use_qk_l2norm_in_kernel=l2, **kw)
    np.testing.assert_allclose(out, ref_out.numpy(), atol=1e-5, rtol=1e-5, err_msg=ours.__name__)
    np.testing.assert_allclose(state, ref_state.numpy(), atol=1e-5, rtol=1e-5, err_msg=ours.__name__)


def _documents(segment_ids):
  """(row, start, stop) of every document of every row."""
  out = []
  for b, row in enumerate(segment_ids):
    edges = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]] + [len(row)]
    out += [(b, s, e) for s, e in zip(edges, edges[1:])]
  return out


@oracle
def test_packed_documents_equal_documents_alone():
  """With segment ids, each document's output and the row's final state are transformers' on that document alone
  (the first from the initial state, every later one from zero)."""
  x, s0 = _inputs(4)
  out, state = dn.gated_delta_rule_chunked(**x, initial_state=s0, segment_ids=PACKED, chunk_size=CHUNK,
                                           use_qk_l2norm=True)
  for b, s, e in _documents(PACKED):
    piece = {n: _torch(a[b:b + 1, s:e]) for n, a in x.items()}
    ref_out, ref_state = hf.torch_recurrent_gated_delta_rule(
        *piece.values(), initial_state=_torch(s0[b:b + 1]) if s == 0 else None, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(out[b:b + 1, s:e], ref_out.numpy(), atol=1e-5, rtol=1e-5)
    if e == T:
      np.testing.assert_allclose(state[b:b + 1], ref_state.numpy(), atol=1e-5, rtol=1e-5)


@oracle
def test_conv_matches_transformers():
  r = np.random.default_rng(5)
  K, Cn = 4, 12
  x, w = r.normal(size=(B, T, Cn)).astype(np.float32), r.normal(size=(Cn, 1, K)).astype(np.float32)
  weight = w[:, 0, :].T
  ref = hf.causal_conv1d_fn(_torch(x).transpose(1, 2), _torch(w[:, 0]), None, activation="silu").transpose(1, 2)
  y, state = dn.causal_conv1d(x, weight)
  np.testing.assert_allclose(y, ref.numpy(), atol=1e-6, rtol=1e-6)
  np.testing.assert_allclose(state, x[:, -(K - 1):], atol=0)
  # transformers' decode step keeps the last K inputs [B, C, K]; ours the last K-1, time first.
  conv_state = torch.zeros(B, Cn, K)
  conv_state[..., -(K - 1):] = _torch(x[:, :K - 1]).transpose(1, 2)
  ours = x[:, :K - 1]
  for t in range(K - 1, K + 3):
    ref_t = hf.causal_conv1d_update(_torch(x[:, t:t + 1]).transpose(1, 2), conv_state, _torch(w[:, 0]), None, "silu")
    y_t, ours = dn.causal_conv1d_step(x[:, t], weight, ours)
    np.testing.assert_allclose(y_t, ref_t[..., 0].numpy(), atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(ours, conv_state[..., 1:].transpose(1, 2).numpy(), atol=0)
    np.testing.assert_allclose(y_t, ref.numpy()[:, t], atol=1e-6, rtol=1e-6)
  # packed documents: each document convolved alone (zero history)
  y, state = dn.causal_conv1d(x, weight, segment_ids=PACKED)
  for b, s, e in _documents(PACKED):
    alone = hf.causal_conv1d_fn(_torch(x[b:b + 1, s:e]).transpose(1, 2), _torch(w[:, 0]), None, activation="silu")
    np.testing.assert_allclose(y[b:b + 1, s:e], alone.transpose(1, 2).numpy(), atol=1e-6, rtol=1e-6)
  last = PACKED[:, -1:] == PACKED[:, -(K - 1):]
  np.testing.assert_allclose(state, np.where(last[..., None], x[:, -(K - 1):], 0), atol=0)


# ---------------------------------------------------------------------------------------------------------------
# The layer against Qwen3NextGatedDeltaNet
# ---------------------------------------------------------------------------------------------------------------

D_MODEL = 32


def _hf_layer(seed=0):
  config = transformers.Qwen3NextConfig(
      hidden_size=D_MODEL, linear_num_key_heads=HK, linear_num_value_heads=HV, linear_key_head_dim=DK,
      linear_value_head_dim=DV, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_hidden_layers=1,
      layer_types=["linear_attention"], num_attention_heads=2, num_key_value_heads=1, head_dim=16, vocab_size=64,
      num_experts=0, intermediate_size=64)
  torch.manual_seed(seed)
  layer = hf.Qwen3NextGatedDeltaNet(config, 0).eval()
  with torch.no_grad():     # every parameter away from its initial value, so each one matters
    layer.dt_bias.uniform_(-1, 1)
    layer.norm.weight.uniform_(0.5, 1.5)
    layer.A_log.copy_(torch.empty(HV).uniform_(0.1, 4).log())
  return config, layer


def _ours(config, layer, chunk_size=CHUNK):
  ours = dn.GatedDeltaNet(dn.DeltaNetConfig.from_hf(config, chunk_size=chunk_size), rngs=nnx.Rngs(0))
  dn.load_hf_state_dict(ours, {n: t.detach().numpy() for n, t in layer.state_dict().items()})
  return ours


def _x(seed=0, T=T, B=B):
  return np.random.default_rng(seed).normal(size=(B, T, D_MODEL)).astype(np.float32)


@oracle
def test_layer_matches_transformers_full_sequence():
  config, layer = _hf_layer()
  ours = _ours(config, layer)
  x = _x()
  with torch.no_grad():
    ref = layer(_torch(x)).numpy()
  np.testing.assert_allclose(ours(jnp.asarray(x)), ref, atol=1e-4, rtol=1e-4)


@oracle
def test_prefill_then_decode_equals_full_sequence_and_transformers_cache():
  """Prefill 13 tokens (chunked, returns the state), then decode the rest one by one (recurrent step): every output
  equals transformers' full-sequence output at that position and its own cached decode."""
  config, layer = _hf_layer(1)
  ours = _ours(config, layer)
  x, T0 = _x(1, T=21), 13
  with torch.no_grad():
    full = layer(_torch(x)).numpy()
    cache = transformers.DynamicCache(config=config)
    cached = [layer(_torch(x[:, :T0]), cache=cache)]
    cached += [layer(_torch(x[:, t:t + 1]), cache=cache) for t in range(T0, x.shape[1])]
  cached = torch.cat(cached, 1).numpy()
  np.testing.assert_allclose(cached, full, atol=1e-4, rtol=1e-4)      # transformers agrees with itself

  step = nnx.jit(lambda layer, x, state: layer(x, state=state))
  y, state = ours(jnp.asarray(x[:, :T0]), state=ours.init_state(B))
  assert state.conv.shape == (B, 3, 2 * HK * DK + HV * DV) and state.recurrent.shape == (B, HV, DK, DV)
  ys = [y]
  for t in range(T0, x.shape[1]):
    y, state = step(ours, jnp.asarray(x[:, t:t + 1]), state)
    ys.append(y)
  ys = np.concatenate(ys, 1)
  np.testing.assert_allclose(ys, full, atol=1e-4, rtol=1e-4)
  np.testing.assert_allclose(ys, cached, atol=1e-4, rtol=1e-4)
  hf_layer_cache = cache.layers[0]
  np.testing.assert_allclose(state.recurrent, hf_layer_cache.recurrent_states[0].numpy(), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(state.conv, hf_layer_cache.conv_states[0][..., 1:].transpose(1, 2).numpy(), atol=1e-6)


@oracle
def test_padding_and_packing_match_transformers():
  """A left-padded row (segment id 0) equals transformers with its attention mask on the real tokens, and gives
  zeros on the padding; a packed row equals each document run alone."""
  config, layer = _hf_layer(2)
  ours = _ours(config, layer)
  x = _x(2, T=24)
  segment_ids = np.array([[0] * 7 + [1] * 17, [1] * 9 + [2] * 15], np.int32)
  y = np.asarray(ours(jnp.asarray(x), segment_ids=jnp.asarray(segment_ids)))
  with torch.no_grad():
    masked = layer(_torch(x[:1]), attention_mask=_torch(segment_ids[:1] != 0).long()).numpy()
    alone = [(s, e, layer(_torch(x[1:, s:e])).numpy()) for b, s, e in _documents(segment_ids) if b == 1]
  np.testing.assert_allclose(y[0, 7:], masked[0, 7:], atol=1e-4, rtol=1e-4)
  np.testing.assert_array_equal(y[0, :7], 0)
  for s, e, ref in alone:
    np.testing.assert_allclose(y[1:, s:e], ref, atol=1e-4, rtol=1e-4)


@oracle
def test_tensor_names_round_trip_and_errors():
  config, layer = _hf_layer()
  sd = {n: t.detach().numpy() for n, t in layer.state_dict().items()}
  assert {name for name, _ in dn.HF_TENSOR_NAMES.values()} == set(sd)
  ours = _ours(config, layer)
  back = dn.hf_state_dict(ours, prefix="model.layers.0.linear_attn.")
  assert set(back) == {"model.layers.0.linear_attn." + n for n in sd}
  for n, a in sd.items():
    np.testing.assert_array_equal(back["model.layers.0.linear_attn." + n], a)
  with pytest.raises(KeyError, match="A_log is missing"):
    dn.load_hf_state_dict(ours, {n: a for n, a in sd.items() if n != "A_log"})
  wrong = dn.GatedDeltaNet(dn.DeltaNetConfig.from_hf(config, linear_value_head_dim=4), rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="does not match the checkpoint"):
    dn.load_hf_state_dict(wrong, sd)
  with pytest.raises(ValueError, match="must be a multiple"):
    dn.DeltaNetConfig(32, 3, 4, 8, 8)
