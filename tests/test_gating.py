"""The gating ablations of [GatedAttn] (Table 1 / Table 4): gate position G1 (after SDPA) / G2 (after the value
projection), headwise / elementwise, head-specific / head-shared, sigmoid / NS-sigmoid / SiLU / additive SiLU, and an
input-independent gate.

References are written out here: a materialized causal softmax in numpy and each gate as [GatedAttn] §2.2 defines it,
y' = y * f(z) (multiplicative) or y' = y + SiLU(z) (additive), with z = x W + b (or a learned logit).
"""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sinkjax import analysis
from sinkjax.attention import gated_attention, value_gated_attention
from sinkjax.cache import KVCache
from sinkjax.config import ModelConfig
from sinkjax.layers import Attention, pop_head_importance
from sinkjax.model import Transformer, count_params
from tests.helpers import param_count_formula

B, T, HQ, HKV, D, DM, VOCAB = 2, 8, 4, 2, 8, 32, 50
ACTIVATIONS = ("sigmoid", "ns_sigmoid", "silu", "silu_additive")


def sigmoid(z):
  return 1.0 / (1.0 + np.exp(-z))


def np_gate(y, z, activation):
  """[GatedAttn] eq. 5 and variants; z [B,T,Hg] (headwise) or [B,T,Hg,D], Hg = H or 1 (head-shared) broadcast over
  heads."""
  z = z[..., None] if z.ndim == 3 else z
  return {"sigmoid": lambda: y * sigmoid(z), "ns_sigmoid": lambda: y * (0.5 + 0.5 * sigmoid(z)),
          "silu": lambda: y * z * sigmoid(z), "silu_additive": lambda: y + z * sigmoid(z)}[activation]()


def np_score(z, activation):
  """The gate score: the sigmoid (NS-sigmoid: its own factor); the SiLU forms report sigma(z)."""
  return 0.5 + 0.5 * sigmoid(z) if activation == "ns_sigmoid" else sigmoid(z)


def np_causal_attention(q, k, v):
  """Materialized causal softmax attention, GQA by repeating k/v; q [B,T,Hq,D], k/v [B,T,Hkv,D]."""
  q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
  rep = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
  z = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
  z = np.where(np.tril(np.ones((q.shape[1], k.shape[1]), bool)), z, -np.inf)
  p = np.exp(z - z.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  return np.einsum("bhts,bshd->bthd", p, v)


def qkv(seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (jax.random.normal(ks[0], (B, T, HQ, D)), jax.random.normal(ks[1], (B, T, HKV, D)),
          jax.random.normal(ks[2], (B, T, HKV, D)))


def logits_for(heads, granularity, shared, seed=7):
  shape = (B, T, 1 if shared else heads) + (() if granularity == "headwise" else (D,))
  return jax.random.normal(jax.random.PRNGKey(seed), shape) * 2


# Every activation with a head-specific headwise and a head-shared elementwise gate; the other two with sigmoid.
GATES = [(a, g, s) for a in ACTIVATIONS for g, s in (("headwise", False), ("elementwise", True))] + \
    [("sigmoid", "elementwise", False), ("sigmoid", "headwise", True)]


@pytest.mark.parametrize("activation,granularity,shared", GATES)
def test_g1_gates_the_sdpa_output(activation, granularity, shared):
  """G1: out = SDPA(q, k, v) gated by z of the query token; G has the query heads' shape."""
  q, k, v = qkv()
  z = logits_for(HQ, granularity, shared)
  out, gate = gated_attention(q, k, v, z, activation=activation, impl="xla")
  zn = np.asarray(z, np.float64)
  np.testing.assert_allclose(out, np_gate(np_causal_attention(q, k, v), zn, activation), atol=2e-5, rtol=1e-5)
  expect_shape = (B, T, HQ) + (() if granularity == "headwise" else (D,))
  np.testing.assert_allclose(gate, np.broadcast_to(np_score(zn, activation), expect_shape), rtol=1e-6)


@pytest.mark.parametrize("activation,granularity,shared", GATES)
def test_g2_gates_each_value_before_attention(activation, granularity, shared):
  """G2: v'_j = gate(v_j, z_j) per KV head (z from the key token), then SDPA; G is repeated to the query heads."""
  q, k, v = qkv()
  z = logits_for(HKV, granularity, shared)
  out, gate = value_gated_attention(q, k, v, z, activation=activation, impl="xla")
  zn = np.asarray(z, np.float64)
  np.testing.assert_allclose(out, np_causal_attention(q, k, np_gate(np.asarray(v, np.float64), zn, activation)),
                             atol=2e-5, rtol=1e-5)
  score = np.broadcast_to(np_score(zn, activation), (B, T, HKV) + zn.shape[3:])
  np.testing.assert_allclose(gate, np.repeat(score, HQ // HKV, axis=2), rtol=1e-6)


LAYER_OPTIONS = [
    {},
    {"gate": "elementwise"},
    {"gate_shared": True},
    {"gate_position": "value"},
    {"gate_position": "value", "gate": "elementwise", "gate_shared": True},
    {"gate_activation": "silu_additive", "gate": "elementwise"},
    {"gate_activation": "ns_sigmoid"},
    {"gate_activation": "silu", "gate_position": "value"},
    {"gate_input": "independent", "gate": "elementwise"},
    {"gate_input": "independent", "gate_position": "value", "gate_shared": True},
]


def randomize(module, seed):
  """Every parameter random (the default init zeroes o_proj and starts gates at a constant)."""
  graphdef, state = nnx.split(module)
  leaves, treedef = jax.tree.flatten(state)
  rng = np.random.RandomState(seed)
  leaves = [jnp.asarray(rng.normal(size=x.shape) * (0.5 if x.ndim < 2 else x.shape[0] ** -0.5), x.dtype)
            for x in leaves]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@pytest.mark.parametrize("opts", LAYER_OPTIONS, ids=lambda o: "-".join(f"{v}" for v in o.values()) or "default")
def test_attention_layer_matches_the_papers_gate(opts):
  """Attention(attention="gated", **opts) = o_proj(gated attention) with the gate computed here from its weights;
  the recorded head importance is the mean gate score per query head."""
  layer = randomize(Attention(DM, HQ, HKV, D, attention="gated", qk_norm=False, rngs=nnx.Rngs(0), **opts), 1)
  x = jax.random.normal(jax.random.PRNGKey(3), (B, T, DM))
  y = layer(x)
  imp = layer.head_importance.get_value()

  act = opts.get("gate_activation", "sigmoid")
  value = opts.get("gate_position") == "value"
  gh = 1 if opts.get("gate_shared") else (HKV if value else HQ)
  zshape = (B, T, gh) + ((D,) if opts.get("gate") == "elementwise" else ())
  xn = np.asarray(x, np.float64)
  if opts.get("gate_input") == "independent":
    assert layer.gate_proj is None
    z = np.broadcast_to(np.asarray(layer.gate_logit[...], np.float64), (B, T, layer.gate_logit.shape[0]))
  else:
    z = xn @ np.asarray(layer.gate_proj.kernel[...], np.float64) + np.asarray(layer.gate_proj.bias[...])
  z = z.reshape(zshape)
  q, k, _ = layer.project(x, jnp.broadcast_to(jnp.arange(T)[None], (B, T)))     # RoPE: tested elsewhere
  v = (xn @ np.asarray(layer.v_proj.kernel[...], np.float64)).reshape(B, T, HKV, D)
  if value:
    out = np_causal_attention(q, k, np_gate(v, z, act))
    score = np.repeat(np.broadcast_to(np_score(z, act), (B, T, HKV) + zshape[3:]), HQ // HKV, axis=2)
  else:
    out = np_gate(np_causal_attention(q, k, v), z, act)
    score = np.broadcast_to(np_score(z, act), (B, T, HQ) + zshape[3:])
  expect = out.reshape(B, T, HQ * D) @ np.asarray(layer.o_proj.kernel[...], np.float64)
  np.testing.assert_allclose(y, expect, atol=1e-4, rtol=1e-4)
  score = score.mean(-1) if score.ndim == 4 else score
  np.testing.assert_allclose(imp, score.mean((0, 1)), rtol=1e-5)


def gate_params(layer):
  return sum(p.size for p in jax.tree.leaves(nnx.state(layer, nnx.Param))) - \
      sum(p.size for p in jax.tree.leaves(nnx.state(Attention(DM, HQ, HKV, D, rngs=nnx.Rngs(0)), nnx.Param)))


@pytest.mark.parametrize("gate", ["headwise", "elementwise"])
def test_gate_parameter_counts(gate):
  """Gate parameters (x W + b): head-specific G1 has Hq outputs per granularity unit, G2 Hkv, head-shared 1 (1/H of
  G1's); the input-independent gate is the learned logits alone (no projection)."""
  make = lambda **kw: Attention(DM, HQ, HKV, D, attention="gated", gate=gate, rngs=nnx.Rngs(0), **kw)
  unit = 1 if gate == "headwise" else D
  g1, g2, shared = make(), make(gate_position="value"), make(gate_shared=True)
  assert g1.gate_proj.kernel.shape == (DM, HQ * unit) and g1.gate_logit is None
  assert gate_params(g1) == HQ * unit * (DM + 1)
  assert gate_params(g2) == HKV * unit * (DM + 1)
  assert gate_params(shared) * HQ == gate_params(g1)
  for kw, heads in (({}, HQ), ({"gate_shared": True}, 1), ({"gate_position": "value"}, HKV)):
    ind = make(gate_input="independent", **kw)
    assert ind.gate_proj is None and ind.gate_logit.shape == (heads * unit,) and gate_params(ind) == heads * unit
  assert np.all(np.asarray(make(gate_input="independent").gate_logit[...]) == 0.0)     # [GatedAttn]: zero-initialized


def test_default_gated_attention_is_unchanged():
  """No option given: the G1 layer as before (q/k/v/o + a headwise gate projection with bias, same init stream),
  and out = SDPA * sigmoid(x W + b)."""
  layer = Attention(DM, HQ, HKV, D, attention="gated", rngs=nnx.Rngs(0))
  shapes = {"/".join(map(str, p)): v.shape for p, v in nnx.to_flat_state(nnx.state(layer, nnx.Param))}
  assert shapes == {"q_proj/kernel": (DM, HQ * D), "k_proj/kernel": (DM, HKV * D), "v_proj/kernel": (DM, HKV * D),
                    "o_proj/kernel": (HQ * D, DM), "gate_proj/kernel": (DM, HQ), "gate_proj/bias": (HQ,)}
  vanilla = Attention(DM, HQ, HKV, D, rngs=nnx.Rngs(0))
  for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
    np.testing.assert_array_equal(getattr(layer, name).kernel[...], getattr(vanilla, name).kernel[...])
  assert (layer.cfg.gate_position, layer.cfg.gate_shared, layer.cfg.gate_activation, layer.cfg.gate_input) == \
      ("sdpa", False, "sigmoid", "dependent")
  cfg = ModelConfig()
  assert (cfg.gate_position, cfg.gate_shared, cfg.gate_activation, cfg.gate_input) == \
      ("sdpa", False, "sigmoid", "dependent")


MODEL_OPTIONS = [      # every option at least once (the default model is test_model's)
    {"gate_position": "value", "gate": "elementwise", "gate_activation": "silu_additive"},
    {"gate_shared": True, "gate": "elementwise", "gate_activation": "ns_sigmoid"},
    {"gate_input": "independent", "gate_activation": "silu"},
    {"gate_input": "independent", "gate_position": "value", "gate_shared": True},
]


@nnx.jit
def forward(model, tokens):
  """Logits and [L, H] importances of the plain forward pass."""
  logits = model(tokens)
  return logits, pop_head_importance(model)


def tiny_model(seed=0, num_layers=1, **opts):
  cfg = ModelConfig(num_layers=num_layers, d_model=DM, num_heads=HQ, num_kv_heads=HKV, head_dim=D, vocab_size=VOCAB,
                    dtype="float32", attention="gated", **opts)
  return randomize(Transformer(cfg, rngs=nnx.Rngs(seed)), seed), cfg


@pytest.mark.parametrize("opts", MODEL_OPTIONS, ids=lambda o: "-".join(f"{v}" for v in o.values()) or "default")
def test_tiny_model_trains_one_step(opts):
  """Forward + one SGD step of a 1-layer Transformer: finite loss and gradients, the gate parameters get gradient,
  importance is [L, H] in [0, 1], and the parameter count matches `param_count_formula`."""
  model, cfg = tiny_model(**opts)
  assert count_params(model) == param_count_formula(cfg)
  tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 17), 0, VOCAB)
  opt = nnx.Optimizer(model, optax.sgd(1e-2), wrt=nnx.Param)

  def loss_fn(model):
    logits = model(tokens[:, :-1])
    imp = pop_head_importance(model)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), imp

  @nnx.jit
  def step(model, opt):
    (loss, imp), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    return loss, imp, grads

  before = jax.tree.leaves(nnx.state(model, nnx.Param))
  loss, imp, grads = step(model, opt)
  after = jax.tree.leaves(nnx.state(model, nnx.Param))
  assert np.isfinite(loss) and all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert all(np.all(np.isfinite(a)) for a in after) and any(np.any(a != b) for a, b in zip(after, before))
  attn_grads = grads["layers"][0]["attn"]
  g = attn_grads["gate_logit" if opts.get("gate_input") == "independent" else "gate_proj"]
  assert any(np.abs(np.asarray(a)).max() > 0 for a in jax.tree.leaves(g))
  assert imp.shape == (1, HQ) and np.all((imp >= 0) & (imp <= 1))


def test_eval_statistics_report_table4_columns():
  """Gate-score mean, first-token attention and max activation ([GatedAttn] Table 4) come out of the eval diagnostics;
  the gate mean is the mean of the gate score the layers record as importance."""
  model, _ = tiny_model(gate_position="value", gate="elementwise")
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 16), 0, VOCAB)
  report = analysis.summarize(analysis.batch_statistics_jit(model, {"inputs": tokens}))
  imp = np.asarray(forward(model, tokens)[1])
  np.testing.assert_allclose(report["gate_mean"], imp.mean(-1), rtol=1e-4)     # equal-sized heads, no padding
  assert all(0 <= a <= 1 for a in report["first_token_attention"])
  assert all(np.isfinite(m) and m > 0 for m in report["max_activation"])


def test_value_gate_with_kv_cache_matches_full_forward():
  """G2 gates values where they are projected, so a KV cache holds gated values: prefill + one-token decode steps
  give the logits of the full causal forward pass."""
  model, cfg = tiny_model(gate_position="value", gate="elementwise")
  tokens = jax.random.randint(jax.random.PRNGKey(4), (1, 8), 0, VOCAB)
  full, _ = forward(model, tokens)
  with_cache = nnx.jit(lambda model, tokens, cache: model(tokens, cache=cache))
  logits, cache = with_cache(model, tokens[:, :6], KVCache.for_model(cfg, 1, 8))
  steps = [logits]
  for t in range(6, 8):
    logits, cache = with_cache(model, tokens[:, t:t + 1], cache)
    steps.append(logits)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), full, atol=1e-4, rtol=1e-4)
