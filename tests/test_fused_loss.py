"""train.loss_impl=fused (`sinkjax.step.fused_ce_sum`): the cross-entropy whose gradient is formed in its forward pass
gives the loss and gradients of a materialized reference (the whole [B, T, V] logits, soft-capped, `log_softmax`,
`jax.grad`) in float32, with masked positions, targets out of range where masked, vocabulary padding, tied embeddings
and a block size that does not divide T; and its gradient program runs the LM head's logits matmul once. Also the
other one-GPU step setting, train.gpu_gemm (the step's compile options).
"""
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sinkjax.config import ModelConfig, load_config
from sinkjax.model import Transformer
from sinkjax.step import fused_ce_sum, loss_fn, make_train_step
from tests.helpers import TINY

B, T, D = 2, 11, 16


def _reference(h, w, targets, weights, vocab, cap):
  """sum(weights * NLL) of cap * tanh((h @ w)[:vocab] / cap) (no cap: the plain logits), all materialized."""
  z = jnp.einsum("btd,dv->btv", h, w)[..., :vocab]
  if cap > 0:
    z = cap * jnp.tanh(z / cap)
  logp = jax.nn.log_softmax(z, axis=-1)
  picked = jnp.take_along_axis(logp, jnp.clip(targets, 0, vocab - 1)[..., None], axis=-1)[..., 0]
  return -jnp.sum(weights * picked)


def _model(vocab=37, pad_to=8, tied=False, cap=15.0):
  cfg = ModelConfig(num_layers=1, d_model=D, num_heads=2, num_kv_heads=2, head_dim=8, vocab_size=vocab,
                    vocab_pad_to=pad_to, tie_embeddings=tied, logit_softcap=cap, dtype="float32", init="nanochat")
  return Transformer(cfg, rngs=nnx.Rngs(0))


def _inputs(vocab, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 4)
  x = jax.random.normal(k[0], (B, T, D)) * 3
  targets = jax.random.randint(k[1], (B, T), 0, vocab)
  weights = (jax.random.uniform(k[2], (B, T)) > 0.3).astype(jnp.float32) * jax.random.uniform(k[3], (B, T), minval=0.5)
  targets = jnp.where(weights > 0, targets, -1)       # ignored positions carry a target out of range
  return x, targets, weights


@pytest.mark.parametrize("tied,cap,chunk", [(False, 15.0, 4), (False, 0.0, 0), (True, 15.0, 0), (True, 2.0, 5),
                                            (False, 15.0, 11)])
def test_fused_matches_materialized_reference(tied, cap, chunk):
  """Loss, d hidden, d LM head (or embedding), d weights against the materialized formula: float32, to 1e-5."""
  vocab = 37                                          # padded to 40: three padding rows the loss must ignore
  model = _model(vocab, tied=tied, cap=cap)
  # Larger head weights than the init, so the soft-cap bends the logits and the gradient is far from zero.
  key = ("embed", "embedding") if tied else ("lm_head", "kernel")
  mod = getattr(model, key[0])
  getattr(mod, key[1]).value = jax.random.normal(jax.random.PRNGKey(7), getattr(mod, key[1]).value.shape) * 2
  x, targets, weights = _inputs(vocab)
  w_of = (lambda m: m.embed.embedding[...].T) if tied else (lambda m: m.lm_head.kernel[...])
  graphdef, state = nnx.split(model)

  def fused(x, state, weights):
    return fused_ce_sum(nnx.merge(graphdef, state), x, targets, weights, chunk)

  def reference(x, state, weights):
    m = nnx.merge(graphdef, state)
    return _reference(m.final_norm(x), w_of(m), targets, weights, vocab, cap)

  got, got_g = jax.value_and_grad(fused, argnums=(0, 1, 2))(x, state, weights)
  want, want_g = jax.value_and_grad(reference, argnums=(0, 1, 2))(x, state, weights)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  kept = weights > 0       # d weights = the token's NLL, defined where its target is a token (the ignored are not)
  got_g, want_g = (g[:2] + (jnp.where(kept, g[2], 0.0),) for g in (got_g, want_g))
  for a, b in zip(jax.tree.leaves(got_g), jax.tree.leaves(want_g)):
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  head_grad = getattr(got_g[1], key[0])[key[1]].value
  assert float(jnp.abs(head_grad).max()) > 1e-2                # a real gradient, not a zero one that matches
  # Without differentiation (the primal path) the same value.
  np.testing.assert_allclose(fused(x, state, weights), want, rtol=1e-5)


def test_fused_loss_fn_and_step_match_autodiff():
  """The whole micro-batch loss (`loss_fn`, aux term on) and the train step's update with train.loss_impl=fused
  agree with the autodiff path (loss_chunk 8 of T 32: its blocks are recomputed in the backward)."""
  from sinkjax import optim    # pylint: disable=import-outside-toplevel
  from sinkjax.data import build_tokenizer, make_train_iterator    # pylint: disable=import-outside-toplevel
  from sinkjax.step import TRAIN_FEATURES    # pylint: disable=import-outside-toplevel
  small = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=2",
           "model.head_dim=16", "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=4",
           "loss.aux_weight=0.01", "train.loss_chunk=8", "model.dtype=float32"]
  results = {}
  for impl in ("autodiff", "fused"):
    cfg = load_config(TINY, small + [f"train.loss_impl={impl}"])
    tok = build_tokenizer(cfg.data)
    cfg.model.vocab_size = tok.vocab_size
    graphdef, params, rest = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)), nnx.Param, ...)
    it = make_train_iterator(cfg.data, tok, batch_size=cfg.train.batch_size, seed=0)
    batch = {k: v for k, v in next(it).items() if k in TRAIN_FEATURES}
    it.close()
    total = jnp.maximum(batch["loss_mask"].sum(), 1.0)
    grad_fn = jax.jit(jax.value_and_grad(
        lambda p, r, b, t: loss_fn(p, graphdef, r, b, t, cfg.loss, None, 1, 8, impl), has_aux=True))
    (loss, _), grads = grad_fn(params, rest, batch, total)
    tx, _ = optim.build_optimizer(cfg, 10)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
             "rng": jax.random.PRNGKey(0), "nonfinite": jnp.zeros((), jnp.int32)}
    new_state, metrics = jax.jit(make_train_step(cfg, graphdef, rest, tx))(state, batch)
    results[impl] = (loss, grads, metrics["ce_loss"], new_state["params"])
  (l0, g0, c0, p0), (l1, g1, c1, p1) = results["autodiff"], results["fused"]
  np.testing.assert_allclose(l1, l0, rtol=1e-5)
  np.testing.assert_allclose(c1, c0, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-6)
  for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p0)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def _vocab_dots(impl, chunk):
  """The dot_generals with a vocabulary-sized operand in the jaxpr of the loss's gradient."""
  model = _model(vocab=40, pad_to=8)
  x, targets, weights = _inputs(40)
  graphdef, state = nnx.split(model)

  def loss(x, state):
    m = nnx.merge(graphdef, state)
    if impl == "fused":
      return fused_ce_sum(m, x, targets, weights, chunk)
    from sinkjax.step import chunked_nll    # pylint: disable=import-outside-toplevel
    return jnp.sum(chunked_nll(m.logits, x, targets, chunk) * weights)

  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, state)
  count = 0

  def walk(jp):
    nonlocal count
    for eqn in jp.eqns:
      if eqn.primitive.name == "dot_general" and any(40 in v.aval.shape for v in eqn.invars + eqn.outvars):
        count += 1
      for v in eqn.params.values():
        for sub in v if isinstance(v, (tuple, list)) else (v,):
          if isinstance(sub, (jax.extend.core.ClosedJaxpr, jax.extend.core.Jaxpr)):
            walk(getattr(sub, "jaxpr", sub))
  walk(jaxpr.jaxpr)
  return count


def test_fused_runs_the_logits_matmul_once():
  """The gradient of the chunked autodiff loss holds the logits matmul twice (forward, recomputed in the backward)
  plus its two gradient matmuls; the fused loss's holds it once."""
  assert _vocab_dots("autodiff", 4) == 4
  assert _vocab_dots("fused", 4) == 3


def test_gpu_gemm_cublas_turns_off_triton_matmuls_on_gpu_only():
  """train.gpu_gemm=cublas adds XLA's xla_gpu_enable_triton_gemm=false to a GPU mesh's step options and nothing
  elsewhere (auto: nothing anywhere). A stand-in mesh: only its devices' platform is read."""
  from types import SimpleNamespace    # pylint: disable=import-outside-toplevel
  from sinkjax.train import step_compiler_options    # pylint: disable=import-outside-toplevel
  mesh_of = lambda platform: SimpleNamespace(devices=np.array([SimpleNamespace(platform=platform)], dtype=object))
  cublas = load_config(TINY, ["train.gpu_gemm=cublas"])
  assert step_compiler_options(cublas, mesh_of("cuda")) == {"xla_gpu_enable_triton_gemm": False}
  assert step_compiler_options(cublas, mesh_of("cpu")) is None
  assert step_compiler_options(load_config(TINY, []), mesh_of("cuda")) is None
