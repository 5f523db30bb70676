"""Head importance, head imbalance and the sink-aware load-balancing loss ([Sink-MoE] §4, eq. 5-8)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def head_importance(gate, mask=None):
  """Head importance, [Sink-MoE] eq. 5: Imp^h = (1/|T|) sum_{(i,t) in T} G_{i,t}^h, the mean gate of head h over the
  valid tokens T of the batch. One layer's; stack the layers' into imp_lh [L, H] (`pop_head_importance` does).

  gate: [B,T,H] or [B,T,H,D] (an elementwise gate is averaged over the head dimension first), as the attention
  variants return it. mask: [B,T] bool of valid tokens (padding and, for vanilla attention, document-first tokens
  excluded, their gate being 0 by construction); None = every token. Returns [H] float32.
  """
  gate = gate.astype(jnp.float32)
  if gate.ndim == 4:
    gate = gate.mean(-1)
  if mask is None:
    return gate.mean((0, 1))
  m = mask.astype(jnp.float32)[..., None]
  return (gate * m).sum((0, 1)) / jnp.maximum(m.sum((0, 1)), 1.0)


def _cv_squared(x, weights=None):
  """Squared coefficient of variation along the last axis (population variance), optionally over a subset."""
  if weights is None:
    weights = jnp.ones_like(x)
  n = weights.sum(-1)
  mean = (x * weights).sum(-1) / n
  var = (((x - mean[..., None]) ** 2) * weights).sum(-1) / n
  return var / jnp.maximum(mean, 1e-12) ** 2


def head_imbalance(imp_lh):
  """Head imbalance, [Sink-MoE] eq. 6: (1/N_L) sum_l CV({Imp^{l,h}}_h), CV = std / mean across the heads of a layer
  (population std). imp_lh: [L, H]. Returns a float32 scalar: 0 = every head of every layer equally used."""
  return jnp.sqrt(_cv_squared(jnp.asarray(imp_lh, jnp.float32))).mean()


def shared_head_mask(imp_lh, num_shared: int):
  """[L,H] bool, True for the top-`num_shared` heads of each layer by importance (no gradient)."""
  imp = jax.lax.stop_gradient(jnp.asarray(imp_lh))
  if num_shared == 0:
    return jnp.zeros(imp.shape, bool)
  _, top = jax.lax.top_k(imp, num_shared)
  return jnp.zeros(imp.shape, bool).at[jnp.arange(imp.shape[0])[:, None], top].set(True)


def top_m_mask(shared_from, m: int) -> np.ndarray:
  """[L,H] bool on the host (numpy): the top-m heads of each layer of `shared_from`, eq. 8's shared set."""
  s = np.asarray(shared_from, np.float64)
  shared = np.zeros(s.shape, bool)
  np.put_along_axis(shared, np.argsort(-s, -1)[:, :m], True, -1)
  return shared


def head_roles(imp_lh, shared_from, m: int) -> dict:
  """Eq. 8's roles read on the host (numpy): in `imp_lh` [L,H], the mean importance of the shared heads (the top-m
  per layer of `shared_from`, the importance that fixed them: `top_m_mask`) and of the routed rest, the routed heads'
  CV (eq. 8's target), every head's imbalance (eq. 6) and the mean importance."""
  a = np.asarray(imp_lh, np.float64)
  shared = top_m_mask(shared_from, m)
  routed = a[~shared].reshape(a.shape[0], -1)
  cv = lambda x: float(np.mean(x.std(-1) / np.maximum(x.mean(-1), 1e-12)))
  return {"imbalance": cv(a), "shared_importance": float(a[shared].mean()), "routed_importance": float(routed.mean()),
          "routed_cv": cv(routed), "mean_importance": float(a.mean())}


def aux_loss(imp_lh, weight: float = 1e-4, num_shared: int = 0, shared=None):
  """The sink-aware load-balancing loss of [Sink-MoE] §4, added to the LM loss: a float32 scalar.

  num_shared == 0: eq. 7, L_aux = lambda sum_l N_h CV({Imp^{l,h}}_h)^2, lambda = `weight` (the paper: 1e-4 from
  scratch), N_h the heads per layer.
  num_shared == m > 0: eq. 8, the top-m heads per layer are "shared" (chosen without gradient, or given as
  `shared`, an [L,H] bool mask fixed up front) and L_aux = lambda sum_l (N_h - m) CV(routed)^2 balances the rest
  (the paper: lambda = 1e-2 when fine-tuning). imp_lh: [L, H] importances (eq. 5; `pop_head_importance`); its
  gradient reaches the gates, through the attention kernel's LSE for vanilla and sink attention.
  """
  imp = jnp.asarray(imp_lh, jnp.float32)
  L, H = imp.shape
  if shared is None:
    shared = shared_head_mask(imp, num_shared)
  else:
    shared = jnp.asarray(shared, bool)
  routed = (~shared).astype(jnp.float32)
  n_routed = routed.sum(-1)
  return weight * (n_routed * _cv_squared(imp, routed)).sum()
