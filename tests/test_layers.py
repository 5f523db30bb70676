"""The attention layer dropped into host models written here (NNX and Linen), trained with the aux loss."""
import inspect

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


def test_linen_attention_shows_and_checks_attentions_arguments():
  """help(linen_attention) shows Attention's arguments (rngs aside: Linen supplies it) and the Linen `name`, with
  their defaults; a wrong argument is a TypeError when the module is made, as for Attention."""
  import inspect
  import pydoc
  shown, init = inspect.signature(linen_attention).parameters, inspect.signature(Attention.__init__).parameters
  assert list(shown) == [n for n in init if n not in ("self", "rngs")] + ["name"]
  assert all(shown[n].default == init[n].default and shown[n].kind == init[n].kind for n in init if n in shown)
  text = pydoc.render_doc(linen_attention, renderer=pydoc.plaintext)
  assert "linen_attention(d_model: 'int', num_heads: 'int', num_kv_heads" in text and "gate_bias: 'bool' = True" in text
  with pytest.raises(TypeError, match="bogus"):
    linen_attention(D, H, bogus=1)
  with pytest.raises(TypeError, match="num_heads"):
    linen_attention(D)


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


# ---------------------------------------------------------------------------------------------------------------
# The layer's face: what `help(Attention)` and `inspect.signature` promise a user
# ---------------------------------------------------------------------------------------------------------------

def test_the_layers_a_user_builds_with_name_every_argument():
  """`inspect.signature` of each module a user builds shows its own named arguments (no *args / **options; an nnx
  Module would show its metaclass's (*args, **kwargs)), and `Attention`'s keywords are exactly the model.* keys an
  `AttentionConfig` reads (the rope_* keys as one `rope=RopeScaling`, max_seq_len only its fallback) with the config's
  defaults (dtypes: float32 for a layer on its own): a key added to the config without a keyword here fails."""
  from sinkjax import config as c
  from sinkjax.layers import MLP, MoE, RMSNorm
  from sinkjax.model import Block, Transformer
  for cls in (Attention, RMSNorm, MLP, MoE, Block, Transformer):
    kinds_ = {p.kind for p in inspect.signature(cls).parameters.values()}
    assert not kinds_ & {inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL}, cls
  params = inspect.signature(Attention).parameters
  rope_keys = set(c.RopeScaling().model_keys())
  assert set(params) - {"rngs", "rope", "zero_init_output"} == c.AttentionConfig.KEYS - rope_keys - {"max_seq_len"}
  defaults = {**c.ModelConfig().__dict__, "dtype": "float32", "num_kv_heads": None, "head_dim": None}
  for name, p in params.items():
    if name in c.AttentionConfig.KEYS and name not in ("d_model", "num_heads"):
      assert p.default == defaults[name], (name, p.default, defaults[name])
  assert params["rope"].default is None and params["zero_init_output"].default is True


def test_a_bad_layer_argument_is_refused_in_the_layers_words():
  """A standalone layer's errors name its keywords (`Attention(attention=...)`), not the trainer's model.* keys, in one
  line; the trainer's config keeps its own spelling."""
  from sinkjax.config import ConfigError, ModelConfig
  cases = {(("attention", "nope"),): r"Attention\(attention=\.\.\.\) must be one of vanilla\|sink\|gated\|relu"
                                     r"(\|\w+)*, got 'nope'",          # (and kinds registered since: test_kinds)
           (("attn_impl", "fast"),): r"Attention\(attn_impl=\.\.\.\) must be one of auto\|reference\|xla",
           (("dtype", "float33"),): r"Attention\(dtype=\.\.\.\) must be one of float32\|bfloat16\|float16",
           (("num_kv_heads", 3),): r"Attention\(num_heads=4\) must be a multiple of num_kv_heads=3",
           (("attention", "sink"), ("gate_position", "value")):
               r"Attention\(gate_position=\.\.\.\) configures gated attention: set attention=gated \(got 'sink'\)",
           (("sink_tokens", -1),): r"Attention\(sink_tokens=\.\.\.\) must be >= 0, got -1"}
  for given, message in cases.items():
    with pytest.raises(ConfigError, match=f"^{message}") as e:
      Attention(D, H, rngs=nnx.Rngs(0), **dict(given))
    assert "\n" not in str(e.value) and "model." not in str(e.value)
  with pytest.raises(ConfigError, match=r"^model\.attention must be one of vanilla"):
    ModelConfig(attention="nope").attention_config()


def test_from_config_builds_the_layer_the_keywords_build():
  """`Attention.from_config` (how the model builds its layers) gives the layer the same keywords give: the same
  parameters and the same output, a "full" layer of a sliding model without the window, RoPE scaling included."""
  from sinkjax.config import ModelConfig, RopeScaling
  m = ModelConfig(d_model=D, num_heads=H, num_kv_heads=2, head_dim=8, attention="gated", gate="elementwise",
                  sliding_window=3, layer_types=["full", "sliding"], num_layers=2, rope_scaling="yarn",
                  rope_factor=4.0, max_seq_len=16, dtype="float32", attn_impl="reference")
  x = jax.random.normal(jax.random.key(0), (2, 10, D))
  for layer, window in ((0, 0), (1, 3)):
    built = Attention.from_config(m.attention_config(layer), rngs=nnx.Rngs(3))
    spelled = Attention(D, H, 2, 8, attention="gated", gate="elementwise", sliding_window=window,
                        rope=RopeScaling("yarn", 4.0, original_max_seq_len=16), attn_impl="reference",
                        zero_init_output=True, rngs=nnx.Rngs(3))
    for one in (built, spelled):                                                # o_proj off zero
      nnx.update(one, jax.tree.map(lambda p: p + 0.1, nnx.state(one, nnx.Param)))
    assert jax.tree.structure(nnx.state(built)) == jax.tree.structure(nnx.state(spelled))
    np.testing.assert_array_equal(np.asarray(built(x)), np.asarray(spelled(x)))


@pytest.mark.parametrize("attention", ["vanilla", "sink", "gated", "relu"])
def test_the_layer_is_causal_and_rotates_at_document_positions(attention):
  """What its docstring promises: y[t] depends on x[0..t] only; without `positions` a token's RoPE position is its
  place in its segment (0 at the segment's first token): a document packed after another gives the outputs it gives
  alone; an explicit `positions=` is used as given."""
  layer = Attention(D, H, 2, 8, attention=attention, zero_init_output=False, attn_impl="reference", rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (1, 12, D))
  later = x.at[:, 7:].set(jax.random.normal(jax.random.key(2), (1, 5, D)))
  np.testing.assert_allclose(np.asarray(layer(x)[:, :7]), np.asarray(layer(later)[:, :7]), atol=1e-6)
  assert not np.allclose(np.asarray(layer(x)[:, 7:]), np.asarray(layer(later)[:, 7:]))
  segments = jnp.array([[1] * 5 + [2] * 7])
  packed = layer(x, segment_ids=segments)
  np.testing.assert_allclose(np.asarray(packed[:, 5:]), np.asarray(layer(x[:, 5:])), atol=1e-5)
  np.testing.assert_array_equal(np.asarray(layer(x, positions=jnp.arange(12)[None])), np.asarray(layer(x)))
  spread = layer(x, positions=3 * jnp.arange(12)[None])          # other distances between the tokens
  assert not np.allclose(np.asarray(spread[:, 1:]), np.asarray(layer(x)[:, 1:]), atol=1e-4)
