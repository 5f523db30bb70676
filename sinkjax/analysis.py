"""Attention-sink diagnostics of a trained `Transformer`: per-batch statistics of the model's own forward pass.

There is one forward pass: `recorded_forward` calls the model with `record_trace=True`, and each layer records what it
attended with (q/k/v, the gate, its materialized attention weights from `Attention.attention_weights`, which know
the variant, sliding windows and sink tokens) and each block its output; value zeroing ([Sink-MoE] App. A) is the
model's `zero_first_token_value` option. Everything here is a pure function of the model and a batch; the recorded
values are removed again, so the model is left as it was.

Statistics (all accumulated as sums and counts so that several batches combine into exact means):
- first-token attention per layer/head, the F-Attn of [GatedAttn] Table 4: mean over the valid, non-first queries of
  the attention weight A_{t,first(t)} on the first token of the query's own segment: its document's BOS under
  data.packing=document, the row's first token (the paper's k_0, whatever it is) under data.packing=stream, whose
  rows are one segment. "Document" below means such a segment. For sink attention the
  weight is taken in the softmax that includes the sink logit, and the weight on the sink itself (= 1 - G) is
  reported beside it.
- sink ratio alpha[l,h] ([Sink-MoE] eq. 9): (1/T) sum_i A_{i,first} over ALL valid queries, the first one included;
  selective value zeroing acts on heads with alpha > tau.
- value norms ([Sink-MoE] Fig. 2): ||v_t||_2 (per KV head, averaged over heads) at documents' first tokens, at the
  other tokens, and by in-document position.
- gate statistics ([GatedAttn] Table 4 "Gate Score", Fig. 3): mean of G over the tokens that count for head
  importance, the fraction of gate values below `SPARSE_GATE` and a histogram on [0, 1]; an elementwise gate
  contributes each of its elements.
- massive activations ([GatedAttn] Table 4 "M-Act"): max |h| of the hidden state after each block over valid tokens,
  also split into documents' first tokens and the rest.
- far-context attention (`far_attention`, a head ranking for the per-head cache of `sinkjax.cache_policy`): per
  head, the attention weight a query puts on the keys that a sinks + window cache (S sinks, W slots) has evicted by
  then, i.e. what the head loses when it streams; separate from the statistics above (it needs S and W).
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sinkjax.attention import document_first_index
from sinkjax.layers import pop_head_importance
from sinkjax.model import Transformer

SPARSE_GATE = 0.1        # a gate value below this counts as "closed" (gate sparsity)
GATE_BINS = 20           # histogram bins on [0, 1]
POSITION_BINS = 64       # value norm by in-document position: positions 0 .. POSITION_BINS-1


class LayerTrace(NamedTuple):
  """What one block computed, recorded by the model's own forward pass (`Transformer(..., record_trace=True)`). Shapes:
  q [B,T,Hq,D], k/v [B,T,Hkv,D] (Hq when values were zeroed), gate [B,T,Hq] or [B,T,Hq,D], weights [B,Hq,T,T],
  sink_weight [B,T,Hq] (the weight outside the sequence keys: on the sink logit and on learnable sink tokens), hidden
  [B,T,d_model] (after the block); weights / sink_weight / hidden are None when only values were zeroed."""
  q: jax.Array
  k: jax.Array
  v: jax.Array
  gate: jax.Array
  weights: jax.Array
  sink_weight: jax.Array
  hidden: jax.Array


def _segments(segment_ids, B: int, T: int):
  return jnp.ones((B, T), jnp.int32) if segment_ids is None else jnp.broadcast_to(segment_ids, (B, T))


def document_starts(segment_ids):
  """[B,T] bool: the token is the first of its document (and not padding)."""
  T = segment_ids.shape[1]
  first = document_first_index(segment_ids, T)
  return (first == jnp.arange(T)[None, :]) & (segment_ids != 0)


def recorded_forward(model: Transformer, tokens, *, segment_ids=None, positions=None, zero_first_token_value=None,
                     keep_weights: bool = True):
  """(logits [B,T,V], [LayerTrace per layer] or None): the model's own forward pass with its layers recording
  (`record_trace=True`) what the diagnostics need, and optionally the first token's value zeroed where
  `zero_first_token_value` [L, Hq] ([Sink-MoE] App. A; L the layers with heads). keep_weights=False records nothing (BPB-only passes). The model's
  sown values are removed again, so it stays as it was."""
  logits = model(tokens, segment_ids=segment_ids, positions=positions, record_trace=keep_weights,
                 zero_first_token_value=zero_first_token_value)
  pop_head_importance(model)
  if not keep_weights:
    return logits, None
  traces = []
  for block in model.layers:                   # layers with heads record a trace (not linear attention's)
    if hasattr(block.attn, "trace"):
      t = block.attn.trace.get_value()
      traces.append(LayerTrace(t["q"], t["k"], t["v"], t["gate"], t["weights"], t["outside"],
                               block.hidden.get_value()))
      del block.attn.trace
    del block.hidden
  return logits, traces


def head_blocks(model: Transformer) -> list:
  """The blocks whose mixer has heads, in layer order (rows of every [L, H] the analyses report)."""
  return [model.layers[i] for i in model.cfg.head_layers]


def token_nll(logits, targets):
  """Per-token negative log-likelihood in nats, [B,T]."""
  logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  return -jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def nll_sums(nll, batch):
  """Sums behind val_loss and BPB from per-token NLL [B,T] in nats.

  nll / tokens: over the loss_mask targets (val_loss = nll / tokens). bpb_nll / bytes: BPB = bpb_nll / ln 2 / bytes,
  nanochat's evaluate_bpb: a target with 0 bytes (a BOS, which carries loss under data.packing=stream) counts in
  neither sum. Under data.packing=document BOS targets are already out of the loss mask.
  """
  mask = batch["loss_mask"].astype(jnp.float32)
  nbytes = jnp.where(mask > 0, batch["target_bytes"], 0).astype(jnp.float32)
  return {"nll": (nll * mask).sum(), "tokens": mask.sum(), "bpb_nll": jnp.where(nbytes > 0, nll, 0.0).sum(),
          "bytes": nbytes.sum()}


def lm_sums(logits, batch):
  """`nll_sums` of the model's logits [B,T,V]."""
  return nll_sums(token_nll(logits, batch["targets"]), batch)


def _first_token_weight(weights, first):
  """A[b,h,t,first(t)] -> [B,T,H]."""
  w = jnp.take_along_axis(weights, first[:, None, :, None], axis=-1)[..., 0]      # [B,H,T]
  return jnp.swapaxes(w, 1, 2)


def layer_statistics(attn, trace: LayerTrace, segment_ids, importance_mask):
  """Sums and counts of one layer's diagnostics (see the module docstring); every entry is an array."""
  seg = segment_ids
  B, T = seg.shape
  first = document_first_index(seg, T)
  valid = seg != 0
  starts = document_starts(seg)
  later = valid & ~starts                                                        # non-first queries
  f = lambda m: m.astype(jnp.float32)

  a_first = _first_token_weight(trace.weights, first)                            # [B,T,H]
  stats = {
      "first_attn_sum": (a_first * f(later)[..., None]).sum((0, 1)),             # [H]
      "sink_weight_sum": (trace.sink_weight * f(later)[..., None]).sum((0, 1)),
      "later_count": f(later).sum(),
      "alpha_sum": (a_first * f(valid)[..., None]).sum((0, 1)),                  # eq. 9, all valid queries
      "valid_count": f(valid).sum(),
  }

  vnorm = jnp.linalg.norm(trace.v.astype(jnp.float32), axis=-1).mean(-1)         # [B,T], mean over heads
  pos = jnp.arange(T)[None, :] - first
  in_range = valid & (pos < POSITION_BINS)
  onehot = jax.nn.one_hot(jnp.where(in_range, pos, 0), POSITION_BINS) * f(in_range)[..., None]
  stats.update({
      "vnorm_first_sum": (vnorm * f(starts)).sum(), "first_count": f(starts).sum(),
      "vnorm_later_sum": (vnorm * f(later)).sum(),
      "vnorm_pos_sum": (onehot * vnorm[..., None]).sum((0, 1)), "vnorm_pos_count": onehot.sum((0, 1)),
  })

  g = trace.gate.astype(jnp.float32)
  gmask = importance_mask if g.ndim == 3 else importance_mask[..., None]
  gmask = jnp.broadcast_to(gmask[..., None], g.shape).astype(jnp.float32)
  bins = jnp.clip(jnp.floor(g * GATE_BINS), 0, GATE_BINS - 1).astype(jnp.int32)
  stats.update({
      "gate_sum": (g * gmask).sum(), "gate_count": gmask.sum(),
      "gate_closed": ((g < SPARSE_GATE) * gmask).sum(),
      "gate_hist": (jax.nn.one_hot(bins, GATE_BINS) * gmask[..., None]).reshape(-1, GATE_BINS).sum(0),
  })

  act = jnp.abs(trace.hidden.astype(jnp.float32)).max(-1)                        # [B,T]
  stats.update({
      "max_act": jnp.where(valid, act, 0.0).max(),
      "max_act_first": jnp.where(starts, act, 0.0).max(),
      "max_act_later": jnp.where(later, act, 0.0).max(),
  })
  return stats


def batch_statistics(model: Transformer, batch):
  """The recorded forward on one batch -> dict of per-layer stacked sums/counts (leading axis L)."""
  tokens = batch["inputs"]
  B, T = tokens.shape
  seg = _segments(batch.get("segment_ids"), B, T)
  _, traces = recorded_forward(model, tokens, segment_ids=seg, positions=batch.get("positions"))
  per_layer = []
  for block, trace in zip(head_blocks(model), traces):
    per_layer.append(layer_statistics(block.attn, trace, seg, block.attn.importance_mask(seg, B, T)))
  return jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


def far_attention_sums(weights, segment_ids, sink_size, window):
  """What one layer's heads would lose under a sinks + window cache: weights [B,H,T,T] (the recorded attention),
  segment_ids [B,T] -> {"far_sum": [H], "far_count": []}. For a query at in-document position t, the cache (S sink
  slots + a ring of the W - S newest tokens, `sinkjax.cache`) holds document positions 0..S-1 and t-(W-S)+1..t; the
  far keys are the others, S <= j <= t-(W-S). far_sum adds their weight over the queries that have any (t >= W,
  once the cache is full), far_count counts those queries; their ratio is the head's mean far-context mass."""
  B, T = segment_ids.shape
  first = document_first_index(segment_ids, T)                                  # [B,T]
  q = jnp.arange(T)[None, :, None]                                              # query index
  k = jnp.arange(T)[None, None, :]                                              # key index
  far = (k - first[:, :, None] >= sink_size) & (q - k >= window - sink_size) \
      & (segment_ids[:, None, :] == segment_ids[:, :, None])                    # [B,T(query),T(key)]
  counted = (segment_ids != 0) & (jnp.arange(T)[None] - first >= window)        # queries whose cache has evicted
  mass = (weights.astype(jnp.float32) * far[:, None].astype(jnp.float32)).sum(-1)          # [B,H,T]
  return {"far_sum": (mass * counted[:, None].astype(jnp.float32)).sum((0, 2)),
          "far_count": counted.astype(jnp.float32).sum()}


def batch_far_attention(model: Transformer, batch, sink_size, window):
  """The recorded forward on one batch -> `far_attention_sums` per layer with heads, stacked (leading axis L)."""
  tokens = batch["inputs"]
  B, T = tokens.shape
  seg = _segments(batch.get("segment_ids"), B, T)
  _, traces = recorded_forward(model, tokens, segment_ids=seg, positions=batch.get("positions"))
  per_layer = [far_attention_sums(trace.weights, seg, sink_size, window) for trace in traces]
  return jax.tree.map(lambda *xs: jnp.stack(xs), *per_layer)


def far_attention(model: Transformer, batches, *, sink_size: int, window: int) -> np.ndarray:
  """[L, Hq] mean far-context attention mass of each head over `batches` (dicts with inputs, optional segment_ids
  and positions; see `far_attention_sums`): the share of a query's attention that a sinks + window cache of
  `window` slots, `sink_size` of them sinks, no longer holds."""
  totals = None
  for batch in batches:
    new = batch_far_attention_jit(model, {k: jnp.asarray(v) for k, v in batch.items()}, jnp.int32(sink_size),
                                  jnp.int32(window))
    totals = new if totals is None else jax.tree.map(jnp.add, totals, new)
  t = {k: np.asarray(v, np.float64) for k, v in totals.items()}
  if not np.all(t["far_count"] > 0):
    raise ValueError(f"far_attention: no query lies {window} or more tokens into its document; give longer rows")
  return t["far_sum"] / t["far_count"][:, None]


def zeroed_lm_sums(model: Transformer, batch, zero_first_token_value):
  """`lm_sums` of the model's forward with the first token's value zeroed where `zero_first_token_value` [L,Hq]."""
  tokens = batch["inputs"]
  logits, _ = recorded_forward(model, tokens, segment_ids=batch.get("segment_ids"),
                               positions=batch.get("positions"), zero_first_token_value=zero_first_token_value,
                               keep_weights=False)
  return lm_sums(logits, batch)


def combine(totals, new):
  """Adds one batch's statistics to running totals (max for the activation maxima)."""
  if totals is None:
    return new
  return {k: (jnp.maximum if k.startswith("max_act") else jnp.add)(totals[k], new[k]) for k in totals}


def summarize(totals) -> dict:
  """Turns accumulated statistics into the report's per-layer quantities (plain Python lists)."""
  t = {k: np.asarray(v, np.float64) for k, v in totals.items()}
  first_attn = t["first_attn_sum"] / t["later_count"][:, None]      # [L,H]
  sink_w = t["sink_weight_sum"] / t["later_count"][:, None]
  alpha = t["alpha_sum"] / t["valid_count"][:, None]
  v_first = t["vnorm_first_sum"] / t["first_count"]
  v_later = t["vnorm_later_sum"] / t["later_count"]
  with_pos = t["vnorm_pos_count"][0] > 0
  hist = t["gate_hist"]
  return {
      "first_token_attention": first_attn.mean(-1).tolist(),
      "first_token_attention_per_head": first_attn.tolist(),
      "sink_logit_attention": sink_w.mean(-1).tolist(),
      "sink_ratio_alpha": alpha.tolist(),
      "first_token_value_norm": v_first.tolist(),
      "other_value_norm": v_later.tolist(),
      "value_norm_ratio": (v_first / v_later).tolist(),
      "value_norm_by_position": (t["vnorm_pos_sum"][:, with_pos] / t["vnorm_pos_count"][:, with_pos]).tolist(),
      "gate_mean": (t["gate_sum"] / t["gate_count"]).tolist(),
      "gate_sparsity": (t["gate_closed"] / t["gate_count"]).tolist(),
      "gate_histogram": {"edges": [i / GATE_BINS for i in range(GATE_BINS + 1)],
                         "density": (hist / hist.sum(-1, keepdims=True)).tolist()},
      "max_activation": t["max_act"].tolist(),
      "max_activation_first_token": t["max_act_first"].tolist(),
      "max_activation_other": t["max_act_later"].tolist(),
      "m_act": float(t["max_act"].mean()),
  }


class model_jit:  # pylint: disable=invalid-name  (used like a decorator / jax.jit)
  """`fn(model, *args)` compiled with jax.jit over the model's (graphdef, state): its outputs are only `fn`'s. (nnx.jit
  also returns the model's state, a second, unaliased copy of every weight per device: 2.03 GiB per chip for
  Llama-3.1-8B's eval batch on v5litepod-16.) The model is read, never updated; `lower` gives the compiled program's
  lowering for `sinkjax.compile`. `compiler_options` (`sinkjax.sharding.compiler_options`: mesh.collective_matmul on
  TPU) selects one jitted program per set of options."""

  def __init__(self, fn):
    self.fn = fn
    self._jitted = {}

  def jitted(self, compiler_options: dict | None = None):
    key = tuple(sorted((compiler_options or {}).items()))
    if key not in self._jitted:
      self._jitted[key] = jax.jit(lambda graphdef, state, *args: self.fn(nnx.merge(graphdef, state), *args),
                                  static_argnums=0, compiler_options=compiler_options)
    return self._jitted[key]

  def __call__(self, model, *args, compiler_options: dict | None = None):
    return self.jitted(compiler_options)(*nnx.split(model), *args)

  def lower(self, model, *args, compiler_options: dict | None = None):
    return self.jitted(compiler_options).lower(*nnx.split(model), *args)


batch_statistics_jit = model_jit(batch_statistics)
batch_far_attention_jit = model_jit(batch_far_attention)
zeroed_lm_sums_jit = model_jit(zeroed_lm_sums)
