"""The optimizer groups and nanochat's Muon pieces that the training parity test (test_nanochat.py) does not reach:
MoE expert matrices orthogonalized per expert, the momentum warmup schedule, the shape scale."""
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax import optim
from sinkjax.config import Config, ModelConfig
from sinkjax.model import Transformer


def test_moe_experts_are_matrices_orthogonalized_per_expert():
  cfg = ModelConfig(num_layers=1, d_model=16, num_heads=2, num_kv_heads=2, head_dim=8, vocab_size=32, mlp="swiglu",
                    moe_experts=3, moe_top_k=1, mlp_hidden=24, dtype="float32")
  params = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
  labels = {"/".join(map(str, p)): l for p, l in nnx.to_flat_state(optim.param_labels(params))}
  for name in ("gate_kernel", "up_kernel", "down_kernel"):
    assert labels[f"layers/0/mlp/{name}"] == "matrix"
  assert labels["layers/0/mlp/router/bias"] == "scalar"
  g = jax.random.normal(jax.random.key(0), (3, 16, 24))
  tx = optim.scale_by_muon(beta=0.0, ns_dtype=jnp.float32)          # beta 0: the direction of g itself
  out, _ = tx.update({"w": g}, tx.init({"w": g}))
  scale = max(1.0, 24 / 16) ** 0.5                                   # fan_out / fan_in in Flax's (in, out) layout
  for e in range(3):
    np.testing.assert_allclose(np.asarray(out["w"][e]), scale * np.asarray(optim.newton_schulz(g[e], 5, jnp.float32)),
                               rtol=1e-5, atol=1e-6)
    s = np.linalg.svd(np.asarray(out["w"][e]) / scale, compute_uv=False)
    assert 0.5 < s.min() and s.max() < 1.5                           # Keller's quintic: singular values ~U(0.5, 1.5)


def test_momentum_warms_up_like_base_train():
  """beta(step) = 0.85 + 0.1 min(step / 300, 1) (base_train's get_muon_momentum), through Muon's own count."""
  cfg = Config()
  tx = optim.muon(cfg.train, lambda count: 1.0)
  w = {"w": jnp.ones((4, 4))}
  state = tx.init(w)
  g = {"w": jnp.eye(4)}
  for step in range(3):
    mom_before = state[0].momentum["w"]
    _, state = tx.update(g, state, w)
    beta = 0.85 + 0.1 * min(step / 300, 1)
    np.testing.assert_allclose(np.asarray(state[0].momentum["w"]), beta * np.asarray(mom_before) + (1 - beta) * np.eye(4),
                               rtol=1e-6)


def test_muon_under_a_mesh_orthogonalizes_each_matrix_on_one_device():
  """Under a mesh of 8 devices (jax.set_mesh, as the trainer traces its step) Muon stacks the matrices of one wide
  shape (tall ones transposed), pads to a multiple of 8 and splits the stack over the devices: the directions equal
  newton_schulz of each matrix alone (float32, to rounding), leaves of 3 dims per leading index, and the compiled
  step runs Newton-Schulz on its own matrices only (one [16, 24] matrix per device, no stacked Gram products)."""
  mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))   # sinkjax.sharding's kind
  keys = jax.random.split(jax.random.key(1), 3)
  tree = {"a": jax.random.normal(keys[0], (3, 16, 24)),        # 3 wide [16, 24]
          "b": jax.random.normal(keys[1], (24, 16)),           # tall: its transpose joins a's shape
          "c": jax.random.normal(keys[2], (3, 8, 8))}          # another shape
  tx = optim.scale_by_muon(beta=0.0, ns_dtype=jnp.float32)
  with jax.set_mesh(mesh):
    placed = jax.device_put(tree, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    step = jax.jit(lambda t: tx.update(t, tx.init(t))[0])
    out = step(placed)
    hlo = step.lower(placed).compile().as_text()
  for name, g in tree.items():
    mats = g.reshape((-1,) + g.shape[-2:])
    scale = max(1.0, g.shape[-1] / g.shape[-2]) ** 0.5
    want = np.stack([scale * np.asarray(optim.newton_schulz(m, 5, jnp.float32)) for m in mats]).reshape(g.shape)
    np.testing.assert_allclose(np.asarray(out[name]), want, rtol=2e-5, atol=2e-6, err_msg=name)
  # per device: the [16, 24] group (4 matrices, padded to 8) is one matrix, the [8, 8] group (3 -> 8) one matrix
  assert "f32[1,16,24]" in hlo and not re.search(r"f32\[[2-8],16,16\]", hlo)   # no Gram products of the stack


def _quintic_newton_schulz(g, steps=5):
  """Keller Jordan's quintic iteration written out in float64 numpy (nanochat's zeropower_via_newtonschulz5): on the
  wide orientation, after Frobenius normalization."""
  a, b, c = 3.4445, -4.7750, 2.0315
  x = np.asarray(g, np.float64)
  tall = x.shape[0] > x.shape[1]
  x = x.T if tall else x
  x = x / (np.linalg.norm(x) + 1e-7)
  for _ in range(steps):
    A = x @ x.T
    x = a * x + (b * A + c * A @ A) @ x
  return x.T if tall else x


def test_muon_on_one_device_stacks_the_matrices_of_one_shape():
  """train.muon_stack (default): on one device the matrices of one wide shape (tall ones transposed) are
  orthogonalized as one batch, as unscanned layers' per-layer parameters would otherwise each launch their own
  iterations. Both settings give every matrix the quintic iteration written out in float64 (to float32 rounding); the
  stacked update's jaxpr holds one set of 15 matmuls per shape (2 shapes: 30) where the per-parameter one holds 15 per
  leaf (4 leaves: 60)."""
  keys = jax.random.split(jax.random.key(2), 4)
  tree = {"a": jax.random.normal(keys[0], (3, 16, 24)),        # 3 wide [16, 24]
          "b": jax.random.normal(keys[1], (24, 16)),           # tall: its transpose joins a's shape
          "c": jax.random.normal(keys[2], (8, 8)),             # another shape, two leaves of it
          "d": jax.random.normal(keys[3], (8, 8))}
  dots = {}
  for stack in (True, False):
    tx = optim.scale_by_muon(beta=0.0, ns_dtype=jnp.float32, stack=stack)
    update = lambda t: tx.update(t, tx.init(t))[0]
    out = jax.jit(update)(tree)
    for name, g in tree.items():
      mats = np.asarray(g).reshape((-1,) + g.shape[-2:])
      scale = max(1.0, g.shape[-1] / g.shape[-2]) ** 0.5
      want = np.stack([scale * _quintic_newton_schulz(m) for m in mats]).reshape(g.shape)
      np.testing.assert_allclose(np.asarray(out[name]), want, rtol=1e-4, atol=2e-5, err_msg=f"{name} stack={stack}")
    jaxpr = jax.make_jaxpr(update)(tree)
    dots[stack] = sum(e.primitive.name == "dot_general" for e in jaxpr.eqns)
  assert dots == {True: 30, False: 60}
