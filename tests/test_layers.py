"""The attention layer dropped into host models written here (NNX and Linen), trained with the aux loss."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sinkjax.balance import aux_loss, head_imbalance
from sinkjax.layers import Attention, apply_rope, collect_linen_importance, linen_attention, pop_head_importance

VOCAB, D, H = 16, 32, 4


def batch(key, B=8, T=24):
  start = jax.random.randint(key, (B, 1), 0, VOCAB)
  return (start + jnp.arange(T + 1)[None] * 5) % VOCAB


class NNXHost(nnx.Module):
  def __init__(self, attention, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.layers = nnx.List([Attention(D, H, 2, 8, attention=attention, rngs=rngs) for _ in range(2)])
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for layer in self.layers:
      x = x + layer(x)
    return self.head(x)


def unbalance_nnx(model, attention):
  """Start far from balance so the aux loss has something to do."""
  for layer in model.layers:
    if attention == "sink":
      layer.sink[...] = jnp.array([-3.0, 0.0, 3.0, 6.0])
    else:
      layer.gate_proj.bias[...] = jnp.array([-3.0, -1.0, 1.0, 3.0])


@pytest.mark.parametrize("attention", ["sink", "gated"])
def test_nnx_host_trains_and_aux_loss_balances(attention):
  @nnx.jit
  def step(model, opt, tokens, aux_weight):              # one compile for both runs: the weight is an argument
    def loss_fn(model):
      logits = model(tokens[:, :-1])
      lm = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      imp = pop_head_importance(model)
      return lm + aux_loss(imp, aux_weight), (lm, head_imbalance(imp))
    (_, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    opt.update(model, grads)
    return aux

  def run(aux_weight):
    model = NNXHost(attention, nnx.Rngs(0))
    unbalance_nnx(model, attention)
    opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    hist = [step(model, opt, batch(jax.random.PRNGKey(i)), jnp.float32(aux_weight)) for i in range(40)]
    return np.array([[float(a), float(b)] for a, b in hist])

  with_aux, without = run(1.0), run(0.0)
  assert with_aux[-1, 0] < with_aux[0, 0] - 0.3, "LM loss must drop"
  assert with_aux[-1, 1] < 0.5 * with_aux[0, 1], "aux loss must pull head imbalance down"
  assert with_aux[-1, 1] < without[-1, 1], "imbalance ends lower with the aux loss than without"


class LinenHost(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D)(tokens)
    for i in range(2):
      x = x + linen_attention(D, H, 2, 8, attention="sink", name=f"attn{i}")(x)
    return nn.Dense(VOCAB)(x)


def test_linen_twin_trains_with_aux_loss():
  model = LinenHost()
  tokens = batch(jax.random.PRNGKey(0))
  params = model.init(jax.random.PRNGKey(0), tokens[:, :-1])["params"]
  for i in range(2):                                 # unbalance the sinks (same values as the NNX test)
    leaf = params[f"attn{i}"]["sink"]
    params[f"attn{i}"]["sink"] = jax.tree.map(lambda _: jnp.array([-3.0, 0.0, 3.0, 6.0]), leaf)
  tx = optax.adam(1e-2)
  opt_state = tx.init(params)

  @jax.jit
  def step(params, opt_state, tokens):
    def loss_fn(params):
      logits, state = model.apply({"params": params}, tokens[:, :-1], mutable=["intermediates"])
      lm = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
      imp = collect_linen_importance(state["intermediates"])
      return lm + aux_loss(imp, 1.0), (lm, head_imbalance(imp), imp)
    (_, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state)
    return optax.apply_updates(params, updates), opt_state, aux

  hist = []
  for i in range(40):
    params, opt_state, (lm, hi, imp) = step(params, opt_state, batch(jax.random.PRNGKey(i)))
    assert imp.shape == (2, H)
    hist.append((float(lm), float(hi)))
  assert hist[-1][0] < hist[0][0] - 0.3
  assert hist[-1][1] < 0.5 * hist[0][1]


def test_importance_is_recorded_per_layer_in_order():
  """pop_head_importance returns [L,H] in layer order and equals the mean gate computed directly."""
  model = NNXHost("sink", nnx.Rngs(1))
  for i, layer in enumerate(model.layers):
    layer.sink[...] = jnp.full((H,), float(i) * 5.0)      # later layers have a stronger sink
  tokens = batch(jax.random.PRNGKey(2))[:, :-1]
  model(tokens)
  imp = pop_head_importance(model)
  assert imp.shape == (2, H) and float(imp[1].mean()) < float(imp[0].mean())
  with pytest.raises(ValueError, match="call the model"):
    pop_head_importance(model)                              # popped: nothing left


def test_rope_rotates_pairs_and_preserves_relative_positions():
  """Split-halves RoPE against a hand rotation, and q.k depends only on the position difference."""
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 1, 1, 4))
  inv = jnp.array([1.0, 0.01])
  y = apply_rope(x, jnp.array([[3]]), inv)
  a, b, c, d = np.asarray(x[0, 0, 0])
  want = [a * np.cos(3) - c * np.sin(3), b * np.cos(0.03) - d * np.sin(0.03),
          c * np.cos(3) + a * np.sin(3), d * np.cos(0.03) + b * np.sin(0.03)]
  np.testing.assert_allclose(y[0, 0, 0], want, rtol=1e-5)
  q, k = jax.random.normal(jax.random.PRNGKey(1), (2, 1, 1, 1, 8))
  inv = 1.0 / 10000 ** (jnp.arange(0, 8, 2) / 8)
  dot = lambda i, j: float(jnp.sum(apply_rope(q, jnp.array([[i]]), inv) * apply_rope(k, jnp.array([[j]]), inv)))
  np.testing.assert_allclose(dot(7, 3), dot(104, 100), rtol=1e-4)


def test_repeated_calls_without_pop_keep_a_fixed_graph():
  """Calling a model under nnx.jit without popping must not grow the record or re-trace every call."""
  model = NNXHost("vanilla", nnx.Rngs(0))
  traces = []

  @nnx.jit
  def fwd(model, tokens):
    traces.append(1)
    return model(tokens)

  tokens = batch(jax.random.PRNGKey(0))[:, :-1]
  for _ in range(4):
    fwd(model, tokens)
  assert len(traces) <= 2, f"traced {len(traces)} times"
  assert model.layers[0].head_importance.get_value().shape == (H,)
  assert pop_head_importance(model).shape == (2, H)


def test_transformer_under_nnx_jit_traces_once():
  """The model keeps its config as static metadata; it must hash by value so jit caches hit."""
  from sinkjax.config import ModelConfig
  from sinkjax.model import Transformer, forward_with_importance
  cfg = ModelConfig(vocab_size=50, num_layers=2, d_model=32, num_heads=2, num_kv_heads=2, head_dim=16,
                    dtype="float32", layer_types=[])
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  traces = []

  @nnx.jit
  def fwd(model, tokens):
    traces.append(1)
    return forward_with_importance(model, tokens)[0]

  for _ in range(3):
    fwd(model, jnp.zeros((1, 8), jnp.int32))
  assert len(traces) == 1


def test_moe_runs_per_batch_shard_and_matches_the_unsharded_layer():
  """Under a mesh the MoE routes each batch shard's own tokens (shard_map: no global sort that gathers the step's
  tokens onto every device, which made GPT-OSS-20B need 222 GiB per chip); output and every gradient equal the layer
  without a mesh (the expert weights' cotangents summed over the shards)."""
  from jax.sharding import NamedSharding, PartitionSpec
  from sinkjax import sharding
  from sinkjax.config import MeshConfig
  from sinkjax.layers import MoE
  moe = MoE(16, 24, 4, 2, kind="swiglu", zero_init_output=False, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (8, 6, 16))
  graphdef, state = nnx.split(moe)
  loss = lambda s, x: jnp.sum(jnp.sin(nnx.merge(graphdef, s)(x)))
  want = jax.value_and_grad(loss, argnums=(0, 1))(state, x)
  mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=4, tensor=1))
  with jax.set_mesh(mesh):
    xs = jax.device_put(x, NamedSharding(mesh, PartitionSpec(("data", "fsdp"))))
    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    assert "manual_computation" in step.lower(state, xs).as_text()
    got = step(state, xs)
  np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5)
