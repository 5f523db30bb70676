"""Layer kinds (`sinkjax.kinds`): a kind is one module plus its registration.

From this file alone a toy attention variant and a toy mixer are registered, named in a config, and trained a step
through the real train step; their forward passes are checked against formulas written here. The built-in linear
kind (Gated DeltaNet) trains beside attention, scanned and rematerialized with the same step as the per-layer loop,
and the parameter count of such a model follows the closed form.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sinkjax import attention as variants
from sinkjax import kinds, optim
from sinkjax.config import ConfigError, ModelConfig, load_config
from sinkjax.model import Transformer, count_params, forward_with_importance
from tests.helpers import TINY, param_count_formula
from tests.test_train import _setup

SMALL = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=16",
         "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=4", "model.dtype=float32"]


class Tempered(kinds.AttentionKind):
  """Toy variant: vanilla attention whose heads are scaled by a learned sigmoid(t_h), reported as the gate."""
  name = "tempered_test"

  def parameters(self, layer, cfg, rngs):
    layer.temper = nnx.Param(jnp.zeros((cfg.num_heads,), jnp.float32))

  def attend(self, layer, x, q, k, v, kw, kv_heads=None):
    out, _ = variants.vanilla_attention(q, k, v, **kw)
    g = jax.nn.sigmoid(layer.temper[...])
    B, T = q.shape[:2]
    return out * g[None, None, :, None].astype(out.dtype), jnp.broadcast_to(g, (B, T, g.shape[0]))


class CumMean(kinds.MixerKind):
  """Toy mixer without heads: y_t = (mean of x_1..x_t) W."""
  name = "cummean_test"

  def build(self, cfg, layer, rngs):
    return CumMeanLayer(cfg.d_model, rngs)


class CumMeanLayer(nnx.Module):
  def __init__(self, d, rngs):
    self.proj = nnx.Linear(d, d, use_bias=False, rngs=rngs)

  def __call__(self, x, *, segment_ids=None, positions=None, cache=None, record_trace=False, zero_first_token_value=None):
    mean = jnp.cumsum(x, axis=1) / jnp.arange(1, x.shape[1] + 1)[None, :, None]
    return self.proj(mean)


kinds.register(Tempered())
kinds.register(CumMean())


def _step(overrides, steps=4):
  """(cfg, jitted train step, start state, one batch): test_train's set-up at 4 float32 rows."""
  return _setup(["train.batch_size=4", "model.dtype=float32"] + overrides, steps)


def test_a_variant_registered_here_trains_with_its_importance_and_aux_loss():
  cfg, step, state, batch = _step(["model.attention=tempered_test", "loss.aux_weight=0.1"])
  new, m = step(state, batch)
  assert bool(m["finite"])
  np.testing.assert_allclose(np.asarray(m["importance"]), 0.5, atol=1e-6)       # sigmoid(0) in every head
  for _ in range(2):                        # LM head, then o_proj start at zero: the third step reaches the toy
    new, m = step(new, batch)
  t0 = np.asarray(state["params"]["layers"][0]["attn"]["temper"][...])
  t1 = np.asarray(new["params"]["layers"][0]["attn"]["temper"][...])
  assert np.abs(t1 - t0).max() > 0                                                 # it gets gradients
  labels = optim.param_labels(state["params"])
  assert labels["layers"][0]["attn"]["temper"].value == "scalar"


def test_a_mixer_registered_here_runs_without_heads():
  """[cummean, full]: the toy layer is the formula; importance covers layer 1 alone; a train step runs."""
  cfg = ModelConfig(num_layers=2, d_model=16, num_heads=2, num_kv_heads=2, head_dim=8, vocab_size=31,
                    layer_types=["cummean_test", "full"], dtype="float32")
  model = Transformer(cfg, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 5, 16))
  w = np.asarray(model.layers[0].attn.proj.kernel[...])
  want = np.cumsum(np.asarray(x), 1) / np.arange(1, 6)[None, :, None] @ w
  np.testing.assert_allclose(np.asarray(model.layers[0].attn(x)), want, atol=1e-5)
  _, imp = forward_with_importance(model, jnp.zeros((2, 6), jnp.int32))
  assert imp.shape == (1, 2) and cfg.head_layers == (1,)
  _, step, state, batch = _step(["model.layer_types=[cummean_test,full]", "loss.aux_weight=0.01"])
  _, m = step(state, batch)
  assert bool(m["finite"]) and np.asarray(m["importance"]).shape == (1, 2)


def test_unknown_kinds_are_refused_in_one_line():
  for bad, key in (("model.attention=nope", "model.attention"), ("model.layer_types=[nope,full]", "model.layer_types")):
    with pytest.raises(ConfigError, match=key) as e:
      load_config(TINY, SMALL + [bad])
    assert "\n" not in str(e.value) and "vanilla" in str(e.value) or "full" in str(e.value)
  with pytest.raises(ConfigError, match="gate_bias configures gated attention"):
    load_config(TINY, SMALL + ["model.gate_bias=false"])


# Each variant's own options with a value that is not the default (written here, not read from the registry, so an
# option dropped from a kind's `options` is seen): every one is refused alike on every other variant.
OWN_OPTIONS = {"gated": {"gate": "elementwise", "gate_position": "value", "gate_shared": True,
                         "gate_activation": "silu", "gate_input": "independent", "gate_bias": False,
                         "gate_bias_init": 1.0},
               "sink": {"sink_init": 0.5}}


@pytest.mark.parametrize("variant,key,value", [(v, k, x) for v, opts in OWN_OPTIONS.items() for k, x in opts.items()])
def test_a_variants_own_option_is_refused_alike_on_every_other_variant(variant, key, value):
  """issue 66: Attention(attention='sink', gate='elementwise') was accepted silently while gate_bias=False was
  refused. On its own variant the option builds; on each other variant, the layer and the config refuse it in the
  same one line."""
  from sinkjax.layers import Attention
  Attention(16, 2, attention=variant, rngs=nnx.Rngs(0), **{key: value})
  for other in ("vanilla", "sink", "gated", "relu"):
    if other == variant:
      continue
    want = (f"model.{key} configures {variant} attention: set model.attention={variant} (got {other!r}) or leave "
            "it at its default")
    with pytest.raises(ConfigError) as e:
      Attention(16, 2, attention=other, rngs=nnx.Rngs(0), **{key: value})
    assert str(e.value) == f"Attention({key}=...) configures {variant} attention: set attention={variant} (got " \
                           f"{other!r}) or leave it at its default"          # the layer's spelling of the same line
    with pytest.raises(ConfigError) as e:
      load_config(TINY, SMALL + [f"model.attention={other}", f"model.{key}={value}"])
    assert str(e.value) == want


LINEAR = ["model.layer_types=[linear,full,linear,full]", "model.num_layers=4", "model.attention=gated",
          "model.gate=elementwise", "loss.aux_weight=0.01", "model.linear_chunk_size=8", "model.rope_partial=0.5",
          "train.muon_ns_dtype=float32"]    # Newton-Schulz in bf16 would turn f32 rounding into bf16 ulps


def _same_step(a, b):
  """Both configs take the same step from the same start; returns the start state."""
  _, step_a, state_a, batch = _step(a)
  _, step_b, state_b, _ = _step(b)
  sa, ma = step_a(state_a, batch)
  sb, mb = step_b(state_b, batch)
  for k in ("loss", "aux_loss", "grad_norm"):
    np.testing.assert_allclose(float(ma[k]), float(mb[k]), rtol=2e-5, err_msg=k)
  assert np.asarray(ma["importance"]).shape == (2, 2)
  np.testing.assert_allclose(np.asarray(ma["importance"]), np.asarray(mb["importance"]), atol=1e-6)
  for x, y in zip(jax.tree.leaves(sa["params"]), jax.tree.leaves(sb["params"])):
    # The chunked delta rule is not bitwise the same inside a scan: a few embedding rows' tiny AdamW updates move
    # by ~1e-4 relative (measured 1.04e-4); a wrong layer order or state would move whole tensors.
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2e-5, rtol=1e-3)
  return state_a


@pytest.mark.slow   # four train-step compiles (~35 s); test_train checks by default that scanned and per-layer attention steps agree
def test_linear_layers_scanned_and_rematerialized_give_the_per_layer_step():
  """Gated DeltaNet between gated attention layers (Qwen3-Next's mix): a scan over (linear, full) groups with remat
  takes the per-layer loop's step; importances [2 attention layers, H]; the conv kernel trains with AdamW."""
  state = _same_step(LINEAR, LINEAR + ["model.scan_layers=true", "model.remat=true"])
  labels = optim.param_labels(state["params"])["layers"][0]["attn"]
  assert labels["conv_weight"].value == "scalar" and labels["in_proj_qkvz"]["kernel"].value == "matrix"


@pytest.mark.slow
def test_gradient_accumulation_with_linear_layers():
  """Two micro-batches take one batch's step (without the aux term, which is not linear in the batch). Slow (~45 s):
  test_train.py::test_gradient_accumulation_matches_one_batch covers the accumulation by default, and the test above
  the linear layers' step."""
  plain = LINEAR + ["loss.aux_weight=0.0"]
  _same_step(plain, plain + ["train.grad_accum=2"])


def test_parameter_count_of_a_mixed_model_follows_the_closed_form():
  cfg = ModelConfig(num_layers=4, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, vocab_size=50,
                    layer_types=["linear", "linear", "linear", "full"], attention="gated", gate="elementwise",
                    gate_bias=False, linear_key_heads=2, linear_value_heads=4, linear_key_head_dim=4,
                    linear_value_head_dim=6, mlp="swiglu", moe_experts=3, moe_top_k=2, moe_router="softmax_topk",
                    moe_shared_hidden=12, norm_scale=True, attn_bias=False)
  assert count_params(Transformer(cfg, rngs=nnx.Rngs(0))) == param_count_formula(cfg)
