"""nanochat's own code as a test oracle: its GPT (9d4c9b7 and 6bb9240) imported from a tree on disk.

The trees live in a directory given by SINKJAX_NANOCHAT_PEERS (holding nanochat-9d4c9b7/ and nanochat-6bb9240/, as
../shared/peers/ does next to a checkout); tests skip with the reason when it or torch is absent. Both trees are
the package `nanochat`, so each is imported with sys.modules cleared around it and kept as module objects.
"""
from __future__ import annotations

import functools
import os
import pathlib
import sys
import types

import pytest

TREES = ("nanochat-9d4c9b7", "nanochat-6bb9240")


def peers_dir() -> pathlib.Path | None:
  env = os.environ.get("SINKJAX_NANOCHAT_PEERS")
  path = pathlib.Path(env) if env else pathlib.Path(__file__).resolve().parents[2] / "shared" / "peers"
  return path if path.is_dir() else None


def _flash_attn_stand_in():
  """The `kernels` hub package nanochat 6bb9240 imports FlashAttention-3 from, computed with torch's SDPA:
  flash_attn_func(q, k, v, causal, window_size) on [B, T, H, D]; window (left, 0) = `left` earlier keys + itself."""
  import torch  # pylint: disable=import-outside-toplevel
  import torch.nn.functional as F  # pylint: disable=import-outside-toplevel

  def flash_attn_func(q, k, v, causal=True, window_size=(-1, 0)):
    T, S = q.shape[1], k.shape[1]
    t = torch.arange(T)[:, None] + (S - T)
    s = torch.arange(S)[None, :]
    mask = s <= t
    if window_size[0] >= 0:
      mask &= t - s <= window_size[0]
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                       enable_gqa=q.shape[2] != k.shape[2])
    return y.transpose(1, 2)

  iface = types.SimpleNamespace(flash_attn_func=flash_attn_func)
  module = types.ModuleType("kernels")
  module.get_kernel = lambda name: types.SimpleNamespace(flash_attn_interface=iface)
  return module


@functools.lru_cache(maxsize=None)
def load(tree: str) -> types.SimpleNamespace:
  """{gpt, muon} modules of one nanochat tree; pytest.skip if the tree or torch is missing."""
  pytest.importorskip("torch", reason="nanochat parity tests need torch (pip install torch, CPU build)")
  root = peers_dir()
  if root is None or not (root / tree / "nanochat" / "gpt.py").is_file():
    pytest.skip(f"nanochat reference code not found: set SINKJAX_NANOCHAT_PEERS to a directory holding {tree}/ "
                f"(../shared/peers in this project's workspace)")
  saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "nanochat" or k.startswith("nanochat.")}
  had_kernels = sys.modules.get("kernels")
  sys.modules["kernels"] = _flash_attn_stand_in()
  sys.path.insert(0, str(root / tree))
  try:
    import nanochat.gpt as gpt  # pylint: disable=import-outside-toplevel
    import nanochat.muon as muon  # pylint: disable=import-outside-toplevel
  finally:
    sys.path.remove(str(root / tree))
    for k in [k for k in sys.modules if k == "nanochat" or k.startswith("nanochat.")]:
      del sys.modules[k]
    sys.modules.update(saved)
    if had_kernels is None:
      sys.modules.pop("kernels", None)
    else:
      sys.modules["kernels"] = had_kernels
  return types.SimpleNamespace(gpt=gpt, muon=muon, root=root / tree)
