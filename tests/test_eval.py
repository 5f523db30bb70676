"""Evaluation (`sinkjax.eval`, `sinkjax.analysis`, multiple choice through `sinkjax.lm_eval`) checked against independent computations.

The models are trained in this file on a byte-level "memorize a phrase" task with optax (a few dozen steps), so
that the numbers are those of a model that has learned something, not of an initialization. Batches are built
here by hand (BOS-prefixed packed documents), independently of the data pipeline. Value zeroing after prefill is
checked on models with random parameters and hand-built stream rows instead, against a KV cache zeroed by hand.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from sinkjax import analysis
from sinkjax import eval as ev
from sinkjax.cache import KVCache
from sinkjax.config import ModelConfig
from sinkjax.layers import pop_head_importance
from sinkjax.model import Transformer, forward_with_importance

BOS = 256                                     # byte tokenizer: ids 0..255 are bytes, BOS = 256
PHRASE = "the quick brown fox jumps over the lazy dog. "
REPO = pathlib.Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------------------------
# Hand-built data and training
# ---------------------------------------------------------------------------------------------------------------

def phrase_doc(rng, n: int) -> bytes:
  """n bytes of the repeated phrase starting at a random offset."""
  start = int(rng.integers(len(PHRASE)))
  return ((PHRASE * (n // len(PHRASE) + 2))[start:start + n]).encode()


def packed_batch(docs_per_row: list[list[bytes]], T: int) -> dict:
  """Rows of BOS-prefixed documents packed one after another (padding at the end), in the pipeline's format."""
  B = len(docs_per_row)
  x = np.zeros((B, T + 1), np.int32)
  seg = np.zeros((B, T + 1), np.int32)
  pos = np.zeros((B, T + 1), np.int32)
  for b, docs in enumerate(docs_per_row):
    t = 0
    for d, doc in enumerate(docs, 1):
      ids = [BOS] + list(doc)
      n = min(len(ids), T + 1 - t)
      x[b, t:t + n], seg[b, t:t + n], pos[b, t:t + n] = ids[:n], d, np.arange(n)
      t += n
  same = (seg[:, :-1] == seg[:, 1:]) & (seg[:, :-1] != 0)
  return {"inputs": x[:, :-1], "targets": x[:, 1:], "segment_ids": seg[:, :-1], "positions": pos[:, :-1],
          "loss_mask": same.astype(np.float32), "target_bytes": same.astype(np.int32)}


def phrase_batch(rng, B: int = 8, T: int = 48) -> dict:
  """Two or three phrase documents per row, the last row ending in padding."""
  rows = []
  for b in range(B):
    lens = rng.integers(8, 24, size=3)
    docs = [phrase_doc(rng, int(n)) for n in lens]
    rows.append(docs[:2] if b == B - 1 else docs)
  return packed_batch(rows, T)


def tiny_config(attention: str, **kw) -> ModelConfig:
  base = dict(attention=attention, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8,
              vocab_size=257, dtype="float32", max_seq_len=64, attn_impl="reference")
  base.update(kw)
  return ModelConfig(**base)


def train(cfg: ModelConfig, make_batch, steps: int, lr: float = 1e-2, seed: int = 0) -> Transformer:
  """Plain optax Adam on the mean next-token cross-entropy (the model forward of training)."""
  model = Transformer(cfg, rngs=nnx.Rngs(seed))
  opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, batch):
    def loss_fn(model):
      logits, _ = forward_with_importance(model, batch["inputs"], segment_ids=batch["segment_ids"],
                                          positions=batch["positions"])   # pops the sown importances
      nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
      return (nll * batch["loss_mask"]).sum() / batch["loss_mask"].sum()
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  rng = np.random.default_rng(seed)
  for _ in range(steps):
    step(model, opt, {k: jnp.asarray(v) for k, v in make_batch(rng).items()})
  return model


@pytest.fixture(scope="module")
def models():
  """A vanilla and a sink model trained the same way on the phrase task."""
  return {a: train(tiny_config(a), phrase_batch, steps=60) for a in ("vanilla", "sink")}


@pytest.fixture(scope="module")
def eval_batches():
  rng = np.random.default_rng(123)
  return [phrase_batch(rng) for _ in range(2)]


# ---------------------------------------------------------------------------------------------------------------
# Independent references (numpy)
# ---------------------------------------------------------------------------------------------------------------

_forward = nnx.jit(lambda model, x, seg, pos: forward_with_importance(model, x, segment_ids=seg, positions=pos))
_recorded = nnx.jit(lambda model, x, seg, pos: analysis.recorded_forward(model, x, segment_ids=seg,
                                                                                  positions=pos))


def forward(model, batch):
  """(logits, importance) of the model's own forward pass (jitted; the importances are popped)."""
  return _forward(model, *(jnp.asarray(batch[k]) for k in ("inputs", "segment_ids", "positions")))


def recorded(model, batch):
  return _recorded(model, *(jnp.asarray(batch[k]) for k in ("inputs", "segment_ids", "positions")))


def np_log_softmax(logits):
  logits = np.asarray(logits, np.float64)
  m = logits.max(-1, keepdims=True)
  return logits - m - np.log(np.exp(logits - m).sum(-1, keepdims=True))


def direct_bpb(model, batches) -> float:
  """Sum of token NLL in bits over real next tokens / UTF-8 bytes of those targets (bytes counted from the ids)."""
  bits = nbytes = 0.0
  for b in batches:
    logits = np.asarray(forward(model, b)[0])
    logp = np_log_softmax(logits)
    seg = b["segment_ids"]
    for r in range(seg.shape[0]):
      for t in range(seg.shape[1] - 1):
        if seg[r, t] != 0 and seg[r, t] == seg[r, t + 1]:        # the target is the next token of the document
          tok = int(b["targets"][r, t])
          bits += -logp[r, t, tok] / math.log(2)
          nbytes += len(bytes([tok]))
    # the final position's target (beyond the row) belongs to the document when the mask says so
    last = b["loss_mask"][:, -1] > 0
    for r in np.nonzero(last)[0]:
      tok = int(b["targets"][r, -1])
      bits += -logp[r, -1, tok] / math.log(2)
      nbytes += 1
  return bits / nbytes


def layer_inputs(model, batch):
  """The normed input of every attention layer: embedding for layer 0, the previous block's output after that."""
  _, traces = recorded(model, batch)
  e = np.asarray(model.embed(jnp.asarray(batch["inputs"])), np.float64)
  x0 = e / np.sqrt((e * e).mean(-1, keepdims=True) + 1e-6)
  xs = [jnp.asarray(x0, jnp.float32)] + [t.hidden for t in traces[:-1]]
  return [model.layers[l].attn_norm(x) for l, x in enumerate(xs)]


def np_first_token_attention(model, batch) -> np.ndarray:
  """[L]: softmax(q k^T / sqrt(D)) over causal same-document keys (plus the sink column for sink attention),
  weight on the document's first key, averaged over heads and non-first valid queries."""
  seg = np.asarray(batch["segment_ids"])
  B, T = seg.shape
  out = []
  for l, h in enumerate(layer_inputs(model, batch)):
    attn = model.layers[l].attn
    q, k, _ = (np.asarray(a, np.float64) for a in attn.project(h, jnp.asarray(batch["positions"])))
    k = np.repeat(k, attn.num_heads // attn.num_kv_heads, axis=2)
    vals = []
    for b in range(B):
      for t in range(T):
        keys = [j for j in range(t + 1) if seg[b, j] == seg[b, t]]
        if seg[b, t] == 0 or keys[0] == t:                       # padding, or the document's first token as query
          continue
        z = np.einsum("hd,shd->hs", q[b, t], k[b, keys]) / math.sqrt(attn.head_dim)     # [H, keys]
        if attn.attention == "sink":
          z = np.concatenate([z, np.asarray(attn.sink[...], np.float64)[:, None]], axis=1)
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        vals.extend(p[:, 0])
    out.append(np.mean(vals))
  return np.array(out)


# ---------------------------------------------------------------------------------------------------------------
# Language-model metrics
# ---------------------------------------------------------------------------------------------------------------

def test_val_bpb_equals_direct_token_nll_in_bits_per_byte(models, eval_batches):
  for model in models.values():
    got = ev.language_model_metrics(model, eval_batches)
    want = direct_bpb(model, eval_batches)
    np.testing.assert_allclose(got["val_bpb"], want, rtol=1e-5)
    assert got["val_bpb"] < 5.0, "the trained model should beat the uniform 8 bits/byte clearly"
    np.testing.assert_allclose(got["val_loss"], want * math.log(2), rtol=1e-5)   # 1 byte per token here


def test_importance_equals_training_time_importance(models, eval_batches):
  for model in models.values():
    b = eval_batches[0]
    _, imp = forward(model, b)
    got = ev.language_model_metrics(model, [b])
    np.testing.assert_allclose(np.array(got["importance"]), np.asarray(imp), rtol=1e-6, atol=1e-7)
    imp = np.asarray(imp, np.float64)
    cv = imp.std(-1) / imp.mean(-1)
    np.testing.assert_allclose(got["cv_per_layer"], cv, rtol=1e-5)
    np.testing.assert_allclose(got["head_imbalance"], cv.mean(), rtol=1e-5)


def test_importance_over_batches_is_token_weighted(models, eval_batches):
  model = models["vanilla"]
  imps, counts = [], []
  for b in eval_batches:
    _, imp = forward(model, b)
    seg = b["segment_ids"]
    starts = (b["positions"] == 0) & (seg != 0)
    imps.append(np.asarray(imp))
    counts.append(((seg != 0) & ~starts).sum())                # vanilla: document-first tokens do not count
  want = sum(i * c for i, c in zip(imps, counts)) / sum(counts)
  np.testing.assert_allclose(ev.language_model_metrics(model, eval_batches)["importance"], want, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------------
# Instrumented forward and sink diagnostics
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attention,gate", [("vanilla", "headwise"), ("sink", "headwise"), ("gated", "headwise"),
                                            ("gated", "elementwise"), ("relu", "headwise")])
def test_recorded_forward_is_the_model_forward(attention, gate):
  model = Transformer(tiny_config(attention, gate=gate, attn_impl="auto"), rngs=nnx.Rngs(1))
  # output projections start at zero; perturb every parameter so that every block matters
  params = nnx.state(model, nnx.Param)
  leaves, tdef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(2), len(leaves))
  nnx.update(model, jax.tree.unflatten(tdef, [p + 0.2 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]))
  b = phrase_batch(np.random.default_rng(0))
  args = dict(segment_ids=jnp.asarray(b["segment_ids"]), positions=jnp.asarray(b["positions"]))
  want, _ = forward(model, b)
  got, traces = recorded(model, b)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  # the materialized weights reproduce each layer's attention output: out = sum_s A_ts v_s (times the output gate
  # for gated attention); this is what makes them "the attention weights of the model"
  for block, tr, h in zip(model.layers, traces, layer_inputs(model, b)):
    attn = block.attn
    out, _ = attn.attend(h, tr.q, tr.k, tr.v, args["segment_ids"])
    v = jnp.repeat(tr.v, attn.num_heads // attn.num_kv_heads, axis=2)
    mixed = jnp.einsum("bhts,bshd->bthd", tr.weights, v)
    if attention == "gated":
      mixed = mixed * (tr.gate if tr.gate.ndim == 4 else tr.gate[..., None])
    np.testing.assert_allclose(mixed, out, rtol=1e-4, atol=1e-5)


def test_first_token_attention_equals_materialized_softmax_first_column(models, eval_batches):
  for name, model in models.items():
    b = eval_batches[0]
    got = ev.sink_diagnostics(model, [b])
    np.testing.assert_allclose(got["first_token_attention"], np_first_token_attention(model, b), rtol=1e-4,
                               atol=1e-6, err_msg=name)


def test_vanilla_first_token_attention_is_one_minus_importance(models, eval_batches):
  """For vanilla attention G = 1 - A_first (eq. 4): the diagnostics (materialized weights) and the importance
  (the kernel's LSE) measure the same thing over the same tokens."""
  model = models["vanilla"]
  d = ev.sink_diagnostics(model, eval_batches)
  imp = np.array(ev.language_model_metrics(model, eval_batches)["importance"])
  np.testing.assert_allclose(d["first_token_attention"], 1.0 - imp.mean(-1), rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(d["gate_mean"], imp.mean(-1), rtol=1e-4, atol=1e-5)


def test_sink_weight_is_one_minus_gate(models, eval_batches):
  model = models["sink"]
  b = eval_batches[0]
  d = ev.sink_diagnostics(model, [b])
  seg = jnp.asarray(b["segment_ids"])
  _, traces = recorded(model, b)
  later = np.asarray((seg != 0) & (jnp.asarray(b["positions"]) != 0))
  for l, tr in enumerate(traces):
    want = (1.0 - np.asarray(tr.gate))[later].mean()             # G = sigma(LSE - sink) from the kernel
    np.testing.assert_allclose(d["sink_logit_attention"][l], want, rtol=1e-4)
    total = np.asarray(tr.weights).sum(-1) + np.swapaxes(np.asarray(tr.sink_weight), 1, 2)   # [B,H,T]
    valid = np.asarray(b["segment_ids"] != 0)
    np.testing.assert_allclose(total, np.broadcast_to(valid[:, None, :], total.shape), atol=1e-5)


def test_value_norm_and_activation_statistics(models, eval_batches):
  model = models["vanilla"]
  b = eval_batches[0]
  d = ev.sink_diagnostics(model, [b])
  seg, pos = b["segment_ids"], b["positions"]
  _, traces = recorded(model, b)
  first, other = (seg != 0) & (pos == 0), (seg != 0) & (pos != 0)
  for l, tr in enumerate(traces):
    vn = np.linalg.norm(np.asarray(tr.v, np.float64), axis=-1).mean(-1)
    np.testing.assert_allclose(d["first_token_value_norm"][l], vn[first].mean(), rtol=1e-5)
    np.testing.assert_allclose(d["other_value_norm"][l], vn[other].mean(), rtol=1e-5)
    np.testing.assert_allclose(d["value_norm_by_position"][l][3], vn[(seg != 0) & (pos == 3)].mean(), rtol=1e-5)
    np.testing.assert_allclose(d["max_activation"][l], np.abs(np.asarray(tr.hidden))[seg != 0].max(), rtol=1e-6)
  hist = np.array(d["gate_histogram"]["density"])
  np.testing.assert_allclose(hist.sum(-1), 1.0, rtol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# Value zeroing ([Sink-MoE] App. A)
# ---------------------------------------------------------------------------------------------------------------

def test_value_zeroing_all_heads_changes_bpb_and_tau_one_changes_nothing(models, eval_batches):
  model = models["vanilla"]
  d = ev.sink_diagnostics(model, eval_batches)
  bpb = ev.language_model_metrics(model, eval_batches)["val_bpb"]
  vz = ev.value_zeroing(model, eval_batches, d["sink_ratio_alpha"], tau=1.0)
  assert vz["num_heads_selected"] == 0
  np.testing.assert_allclose(vz["bpb_none"], bpb, rtol=1e-6)
  np.testing.assert_allclose(vz["bpb_selected"], bpb, rtol=1e-6)
  assert abs(vz["bpb_all"] - bpb) > 1e-4
  vz0 = ev.value_zeroing(model, eval_batches, d["sink_ratio_alpha"], tau=0.0)   # every head has alpha > 0
  assert vz0["num_heads_selected"] == vz0["num_heads"]
  np.testing.assert_allclose(vz0["bpb_selected"], vz0["bpb_all"], rtol=1e-6)


def test_value_zeroing_matches_zeroing_the_value_by_hand(models, eval_batches):
  """One layer, one head: zeroing by the model (zero_first_token_value) = attention recomputed with v_first := 0."""
  model = models["vanilla"]
  b = eval_batches[0]
  seg, pos = jnp.asarray(b["segment_ids"]), jnp.asarray(b["positions"])
  L, H = len(model.layers), model.cfg.num_heads
  zero = np.zeros((L, H), bool)
  zero[0, 1] = True
  _, traces = analysis.recorded_forward(model, jnp.asarray(b["inputs"]), segment_ids=seg, positions=pos,
                                            zero_first_token_value=jnp.asarray(zero))
  tr = traces[0]
  v = np.asarray(tr.v)                                                 # [B,T,Hq,D] after zeroing
  starts = np.asarray(b["positions"] == 0) & np.asarray(b["segment_ids"] != 0)
  assert np.all(v[starts][:, 1] == 0)
  assert np.all(np.abs(v[starts][:, 0]) > 0) and np.all(np.abs(v[~starts][:, 1]).sum(-1) > 0)


# Value zeroing after prefill ([Sink-MoE] App. A's definition: the first value zeroed in the KV cache) and the
# teacher-forced one scored on the same window, on models with every parameter random (the default init zeroes output
# projections and the LM head, which would make every value, and so value zeroing, invisible in the logits)

RANDOM_VOCAB = 40


def random_model(num_kv_heads=4, attention="vanilla"):
  cfg = tiny_config(attention, num_kv_heads=num_kv_heads, vocab_size=RANDOM_VOCAB, attn_impl="auto")
  graphdef, state = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
  leaves, treedef = jax.tree.flatten(state)
  rng = np.random.RandomState(1)
  leaves = [jnp.asarray(rng.normal(size=x.shape) * (0.5 if x.ndim < 2 else x.shape[0] ** -0.5), x.dtype)
            for x in leaves]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def log_probs(logits, targets):
  return np.take_along_axis(np_log_softmax(logits), np.asarray(targets)[..., None], -1)[..., 0]


def hand_zeroed_cache_logprobs(model, inputs, targets, P, zero_lh):
  """The reference: prefill through the model, zero slot 0 of the value cache by hand, decode token by token (each
  call jitted: eager, every op of every step compiles on its own)."""
  B, T = inputs.shape
  cache = KVCache.for_model(model.cfg, B, T)
  call = nnx.jit(lambda m, x, c: m(x, cache=c))
  _, cache = call(model, jnp.asarray(inputs[:, :P]), cache)
  v = [np.array(x) for x in cache.v]
  for l, h in zip(*np.nonzero(zero_lh)):
    v[l][:, 0, h, :] = 0.0
  cache = dataclasses.replace(cache, v=tuple(jnp.asarray(x) for x in v))
  out = []
  for t in range(P, T):
    logits, cache = call(model, jnp.asarray(inputs[:, t:t + 1]), cache)
    out.append(log_probs(logits[:, 0], targets[:, t]))
  return np.stack(out, 1)


@pytest.mark.parametrize("attention", ["vanilla", pytest.param("sink", marks=pytest.mark.slow),
                                       pytest.param("gated", marks=pytest.mark.slow)])
def test_value_zeroing_after_prefill_equals_a_hand_zeroed_cache(attention):
  model = random_model(attention=attention)
  rng = np.random.RandomState(2)
  seq = rng.randint(1, RANDOM_VOCAB, size=(2, 13))
  inputs, targets, P = seq[:, :-1], seq[:, 1:], 5
  zero = np.array([[True, False, True, False], [False, False, False, True]])
  got = np.asarray(ev.prefill_zeroed_logprobs(model, inputs, targets, zero, P))
  want = hand_zeroed_cache_logprobs(model, inputs, targets, P, zero)
  assert got.shape == (2, 12 - P)
  np.testing.assert_allclose(got, want, atol=2e-5)
  # Zeroing nothing is the plain causal forward over the whole row (positions P.. of its log-probs) ...
  none = np.asarray(ev.prefill_zeroed_logprobs(model, inputs, targets, np.zeros_like(zero), P))
  full = log_probs(model(jnp.asarray(inputs)), targets)
  pop_head_importance(model)
  np.testing.assert_allclose(none, full[:, P:], atol=2e-5)
  # ... and zeroing does change what the continuation sees.
  assert np.abs(got - none).max() > 1e-4


def test_value_zeroing_after_prefill_zeroes_whole_gqa_groups_only():
  model = random_model(num_kv_heads=2)
  seq = np.random.RandomState(3).randint(1, RANDOM_VOCAB, size=(1, 9))
  group = np.array([[True, True, False, False], [False, False, False, False]])      # KV head 0 of layer 0
  got = np.asarray(ev.prefill_zeroed_logprobs(model, seq[:, :-1], seq[:, 1:], group, 4))
  np.testing.assert_allclose(got, hand_zeroed_cache_logprobs(model, seq[:, :-1], seq[:, 1:], 4,
                                                             np.array([[True, False], [False, False]])), atol=2e-5)
  with pytest.raises(ValueError, match="GQA group"):
    ev.prefill_zeroed_logprobs(model, seq[:, :-1], seq[:, 1:], np.eye(2, 4, dtype=bool), 4)


def stream_batch(seq, target_bytes=1):
  """A data.packing=stream row batch by hand: one document per row, every target scored, one byte per target."""
  inputs, targets = seq[:, :-1], seq[:, 1:]
  B, T = inputs.shape
  return {"inputs": inputs, "targets": targets, "segment_ids": np.ones((B, T), np.int32),
          "positions": np.tile(np.arange(T, dtype=np.int32), (B, 1)), "loss_mask": np.ones((B, T), np.float32),
          "target_bytes": np.full((B, T), target_bytes, np.int32)}


def test_teacher_forced_value_zeroing_scores_the_after_prefill_window():
  """Both definitions score targets P..T-1: with nothing zeroed they are the same model on the same targets, so
  their BPB agree (one through the KV cache token by token, one in a single forward); with every head zeroed the
  teacher-forced BPB is the hand-computed mean NLL of those targets of the zeroed forward, in bits."""
  model = random_model()
  seq = np.random.RandomState(4).randint(1, RANDOM_VOCAB, size=(2, 13))
  batch, P = stream_batch(seq), 5
  alpha = np.zeros((2, 4))
  tf = ev.teacher_forced_value_zeroing(model, [batch], alpha, tau=0.75, prompt_len=P)
  ap = ev.prefill_value_zeroing(model, [batch], alpha, tau=0.75, prompt_len=P)
  assert tf["prompt_len"] == P and tf["bpb_none"] == pytest.approx(ap["bpb_none"], abs=1e-5)
  logits, _ = analysis.recorded_forward(model, jnp.asarray(batch["inputs"]),
                                        segment_ids=jnp.asarray(batch["segment_ids"]),
                                        positions=jnp.asarray(batch["positions"]),
                                        zero_first_token_value=jnp.ones((2, 4), bool), keep_weights=False)
  want = -log_probs(logits, batch["targets"])[:, P:].mean() / math.log(2)
  assert tf["bpb_all"] == pytest.approx(float(want), abs=1e-5)
  whole = ev.teacher_forced_value_zeroing(model, [batch], alpha, tau=0.75, prompt_len=0)   # the old window
  assert abs(whole["bpb_none"] - tf["bpb_none"]) > 1e-4                                      # the window matters
  assert np.asarray(batch["loss_mask"]).min() == 1                                            # not mutated


# ---------------------------------------------------------------------------------------------------------------
# Multiple choice: lm-eval's loglikelihood requests answered by sinkjax.lm_eval (what sinkjax.eval --mc was)
# ---------------------------------------------------------------------------------------------------------------

def _lm(model):
  pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (pip install 'sinkjax[eval]')")
  from sinkjax.config import Config
  from sinkjax.data import ByteTokenizer
  from sinkjax.lm_eval import SinkjaxLM
  return SinkjaxLM.from_model(model, Config(model=model.cfg), ByteTokenizer(), batch_size=2, max_length=64)


def _loglikelihoods(lm, pairs):
  from lm_eval.api.instance import Instance
  return [lp for lp, _ in lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)],
                                           disable_tqdm=True)]


def test_choice_logprobs_equal_direct_computation(models):
  model = models["sink"]
  items = [{"context": "the quick brown", "choices": [" fox", " dog jumps", "x"], "label": 0},
           {"context": "lazy", "choices": [" dog.", " cat"], "label": 0}]
  got = _loglikelihoods(_lm(model), [(it["context"], ch) for it in items for ch in it["choices"]])
  seqs = [([BOS] + list(it["context"].encode()) + list(ch.encode()), 1 + len(it["context"].encode()))
          for it in items for ch in it["choices"]]
  # one unpadded-style forward for all: every row is filled up to a common length with ordinary tokens of the
  # same document (no padding segment), which causal attention keeps from influencing the positions scored
  T = max(len(ids) for ids, _ in seqs)
  x = np.full((len(seqs), T), ord("z"), np.int32)
  for r, (ids, _) in enumerate(seqs):
    x[r, :len(ids)] = ids
  logp = np_log_softmax(forward(model, {"inputs": x, "segment_ids": np.ones_like(x), "positions":
                                        np.broadcast_to(np.arange(T), x.shape)})[0])
  want = [sum(logp[r, t - 1, ids[t]] for t in range(start, len(ids))) for r, (ids, start) in enumerate(seqs)]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_mc_scorer_picks_the_memorized_continuation(models):
  """The models were trained to continue one fixed phrase: the phrase's continuation is the forced answer."""
  items = [{"context": "the quick brown", "choices": [" cat jumps", " fox jumps", " dog jumps"], "label": 1},
           {"context": "jumps over the", "choices": [" lazy dog.", " quick dog", " lazy fox."], "label": 0},
           {"context": "fox jumps", "choices": [" under", " after", " over "], "label": 2}]
  for model in models.values():
    lps = _loglikelihoods(_lm(model), [(it["context"], ch) for it in items for ch in it["choices"]])
    at = 0
    for it in items:
      n = len(it["choices"])
      assert int(np.argmax(lps[at:at + n])) == it["label"], (it, lps[at:at + n])
      at += n


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

def _cli_error(capsys, argv) -> str:
  assert ev.main(argv) == 1
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and err.startswith("sinkjax.eval: error:"), err
  return err


def test_cli_errors_are_one_line(tmp_path, capsys):
  assert "does not exist" in _cli_error(capsys, ["--checkpoint", str(tmp_path / "nope")])
  (tmp_path / "run").mkdir()
  assert "not a run directory" in _cli_error(capsys, ["--checkpoint", str(tmp_path / "run")])
  err = _cli_error(capsys, ["--checkpoint", str(tmp_path / "run"), "--mc", "items.jsonl"])   # moved, with a pointer
  assert "python -m sinkjax.lm_eval --checkpoint" in err and "--mc items.jsonl" in err, err
  assert "--tau" in _cli_error(capsys, ["--checkpoint", str(tmp_path / "run"), "--tau", "1.5"])
  with pytest.raises(SystemExit) as e:
    ev.main([])                                                         # --checkpoint is required
  assert e.value.code == 2


def test_rows_are_at_most_the_model_context_when_data_seq_len_exceeds_it(models, tmp_path, capsys):
  """A run whose data.seq_len (128) exceeds its model.max_seq_len (64) is evaluated on rows of the model's context:
  the whole file, packed as a stream by hand into rows of 64 + 1 tokens (BOS before each document, the last partial
  row dropped), scored by the model's forward pass and summed in numpy, is the report's val_bpb and val_loss."""
  from sinkjax.config import Config
  from sinkjax.run import save_params_run
  from tests.helpers import call_main
  model, T = models["vanilla"], 64
  cfg = Config()
  cfg.model, cfg.data.seq_len = tiny_config("vanilla", max_seq_len=T), 2 * T
  save_params_run(tmp_path / "run", cfg, model)
  rng = np.random.default_rng(7)
  docs = [phrase_doc(rng, int(n)) for n in rng.integers(60, 140, size=4)]
  (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d.decode()}) + "\n" for d in docs))
  res = call_main(ev.main, ["--checkpoint", tmp_path / "run", "--data", tmp_path / "docs.jsonl", "--split", "all",
                            "--packing", "stream", "--out", tmp_path / "eval"], capsys)
  assert res.returncode == 0, res.stderr[-2000:]
  report = json.loads((tmp_path / "eval" / "report.json").read_text())
  stream = np.asarray([t for d in docs for t in [BOS, *d]], np.int32)
  rows = stream[:len(stream) // (T + 1) * (T + 1)].reshape(-1, T + 1)
  batch = {"inputs": rows[:, :-1], "segment_ids": np.ones((len(rows), T), np.int32),
           "positions": np.broadcast_to(np.arange(T, dtype=np.int32), (len(rows), T))}
  logp = np_log_softmax(forward(model, batch)[0])
  nll = -np.take_along_axis(logp, rows[:, 1:, None], axis=-1)[..., 0]        # every target, BOS included
  byte = rows[:, 1:] != BOS                                                   # a BOS target has no bytes
  np.testing.assert_allclose(report["val_bpb"], nll[byte].sum() / math.log(2) / byte.sum(), rtol=1e-5)
  np.testing.assert_allclose(report["val_loss"], nll.mean(), rtol=1e-5)
  assert report["seq_len"] == T and report["eval_rows"] == len(rows)


@pytest.mark.slow
def test_sink_model_puts_less_attention_on_the_first_token_than_vanilla():
  """A trigger-conditional LM task (after [SinkNecessary]): documents are BOS, a key letter, then a deterministic
  alphabet walk (the next letter is the current one + 1, no attention needed) interrupted by '#' triggers after
  which the key letter must be copied. Attention is useful only at triggers; elsewhere a vanilla head has to park
  its weight somewhere harmless and forms a sink on the first token, while a sink-attention head parks it on
  its sink logit. Both models are trained identically (1 layer, 600 Adam steps, seed 0). The sink that forms in
  this short run is partial (the strongest vanilla head puts ~0.28 of its weight on the first token) and its size
  depends on the seed; the test pins the seed rather than claiming every seed separates this clearly."""
  def trigger_batch(rng, B=16, T=64):
    rows = []
    for _ in range(B):
      key = int(rng.integers(97, 123))
      doc, c = [key], int(rng.integers(97, 123))
      while len(doc) < T:
        if rng.random() < 0.15:
          doc += [ord("#"), key]
          c = key
        else:
          c = 97 + (c - 97 + 1) % 26
          doc.append(c)
      rows.append([bytes(doc[:T])])
    return packed_batch(rows, T)

  test = [trigger_batch(np.random.default_rng(99))]
  fta = {}
  for a in ("vanilla", "sink"):
    model = train(tiny_config(a, num_layers=1, d_model=64, num_heads=4, num_kv_heads=4, head_dim=16),
                  trigger_batch, steps=600, lr=1e-2)
    fta[a] = np.array(ev.sink_diagnostics(model, test)["first_token_attention_per_head"])
  # the strongest first-token head of vanilla is a sink; no sink-attention head comes close
  assert fta["vanilla"].max() > 0.15 and fta["vanilla"].max() > 2 * fta["sink"].max(), fta
  assert fta["vanilla"].mean() > fta["sink"].mean(), fta


@pytest.mark.slow
def test_cli_end_to_end_on_a_run_of_the_training_cli(tmp_path):
  """python -m sinkjax.train on a small text corpus, then python -m sinkjax.eval: every report key and
  figure exists, and val_bpb on the training's validation batches equals the trainer's own last val_bpb."""
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  rng = np.random.default_rng(0)
  for i in range(40):
    (corpus / f"doc{i:02d}.txt").write_bytes(phrase_doc(rng, int(rng.integers(100, 400))))
  run_dir = tmp_path / "run"
  train_cmd = [sys.executable, "-m", "sinkjax.train", "--config", str(REPO / "configs" / "tiny.yaml"),
               "model.num_layers=2", "model.d_model=64", "model.head_dim=16", "data.seq_len=64",
               f"data.source={corpus}", "data.val_fraction=0.3", "train.batch_size=8", "train.steps=20",
               "train.eval_every=20", "train.eval_batches=2", "checkpoint.every=20", f"run.dir={run_dir}"]
  subprocess.run(train_cmd, check=True, capture_output=True, cwd=tmp_path)
  out = tmp_path / "eval"
  res = subprocess.run([sys.executable, "-m", "sinkjax.eval", "--checkpoint", str(run_dir), "--out", str(out)],
                       capture_output=True, text=True, cwd=tmp_path)
  assert res.returncode == 0, res.stderr
  report = json.loads((out / "report.json").read_text())
  for key in ("val_bpb", "val_loss", "importance", "head_imbalance", "cv_per_layer", "first_token_attention",
              "sink_logit_attention", "first_token_value_norm", "other_value_norm", "gate_mean", "gate_sparsity",
              "max_activation", "value_zeroing"):
    assert key in report, key
  assert np.array(report["importance"]).shape == (2, 4)
  for name in ("importance", "first_token_attention", "value_norm", "gate_histogram", "loss", "head_imbalance"):
    assert (out / f"{name}.png").stat().st_size > 1000, name
  assert "![importance](importance.png)" in (out / "report.md").read_text()
  last = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if "val_bpb" in l][-1]
  np.testing.assert_allclose(report["val_bpb"], last["val_bpb"], rtol=1e-5)


def test_figures_and_table_name_the_model_layers_with_heads(tmp_path, monkeypatch):
  """On a model whose heads sit in some layers only (Qwen3-Next: layers 3 and 7 of 8, the rest linear attention),
  every per-layer figure and the markdown table name rows by the model's layer index, not 0..L-1."""
  from sinkjax import plots
  L, H, P, bins = 2, 3, 4, 5
  rng = np.random.RandomState(0)
  report = {"attention": "gated", "packing": "document", "layers_with_heads": [3, 7],
            "importance": rng.rand(L, H).tolist(), "first_token_attention_per_head": rng.rand(L, H).tolist(),
            "sink_logit_attention": None, "value_norm_by_position": rng.rand(L, P).tolist(),
            "gate_histogram": {"edges": [i / bins for i in range(bins + 1)], "density": rng.rand(L, bins).tolist()}}
  seen, save = {}, plots._save
  def record(fig, path, **kw):
    ax = fig.axes[0]
    legend = ax.get_legend()
    seen[pathlib.Path(path).name] = {"x": [t.get_text() for t in ax.get_xticklabels()],
                                     "y": [t.get_text() for t in ax.get_yticklabels()],
                                     "legend": [t.get_text() for t in legend.get_texts()] if legend else []}
    return save(fig, path, **kw)
  monkeypatch.setattr(plots, "_save", record)
  ev.write_figures(report, tmp_path, None)
  assert seen["importance.png"]["y"] == ["3", "7"]
  assert seen["first_token_attention.png"]["x"] == ["3", "7"]
  assert [t for t in seen["value_norm.png"]["legend"] if t.startswith("layer")] == ["layer 3", "layer 7"]
  assert [t for t in seen["gate_histogram.png"]["legend"] if t.startswith("layer")] == ["layer 3", "layer 7"]
  with pytest.raises(ValueError, match="3 layer indices for 2 rows"):
    plots.plot_value_norms(report["value_norm_by_position"], tmp_path / "v.png", layers=[1, 2, 3])
  # The table: a full report's per-layer rows, one per layer with heads, under the model's index.
  z = [0.0] * L
  report.update(run_dir="r", step=1, eval_batches=1, eval_tokens=8, eval_bytes=8, data_source="x", val_bpb=1.0,
                val_loss=1.0, head_imbalance=0.1, first_token_attention=z, m_act=1.0, cv_per_layer=z,
                first_token_value_norm=z, other_value_norm=z, gate_mean=z, gate_sparsity=z, max_activation=z,
                gate_sparsity_threshold=0.1,
                value_zeroing={"tau": 0.5, "num_heads_selected": 0, "num_heads": 6, "bpb_none": 1.0, "bpb_all": 1.0,
                               "bpb_selected": 1.0})
  rows = [line.split("|")[1].strip() for line in ev.markdown(report, []).splitlines()
          if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
  assert rows == ["3", "7"]


# ---------------------------------------------------------------------------------------------------------------
# Sizing to the data and the memory
# ---------------------------------------------------------------------------------------------------------------

def _rows_with(lengths: list[int], T: int) -> dict:
  """One row per entry: a document of that many tokens (0: an all-padding row), in the pipeline's format."""
  n = len(lengths)
  b = {f: np.zeros((n, T), np.int32) for f in ev.MODEL_FEATURES}
  for r, k in enumerate(lengths):
    b["inputs"][r, :k] = np.arange(1, k + 1)
    b["targets"][r, :k] = np.arange(2, k + 2)
    b["segment_ids"][r, :k] = 1
    b["positions"][r, :k] = np.arange(k)
    b["loss_mask"][r, :k] = 1
    b["target_bytes"][r, :k] = 1
  return b


def test_sized_batches_cut_rows_to_the_data_and_batch_to_the_budget():
  """Rows packed at seq_len 512 whose documents reach token 70 at most: cut to 128 tokens (70 rounded up to 64s),
  the trailing all-padding rows dropped, as many rows per batch as the budget holds by row_bytes (hand sums), the
  diagnostics on the first rows in batches whose [T, T] maps fit."""
  m = tiny_config("vanilla")
  T = 512
  lengths = [70, 12, 33, 5, 64, 9, 0, 0]                      # two batches of 4 rows; the last two rows padding
  rows = _rows_with(lengths, T)
  batches = [{f: v[:4] for f, v in rows.items()}, {f: v[4:] for f, v in rows.items()}]
  vocab = -(-257 // m.vocab_pad_to) * m.vocab_pad_to                 # the LM head's rows
  per_row = 128 * (12 * vocab + 4 * (8 * m.d_model + 2 * m.mlp_width))
  assert ev.row_bytes(m, 128) == per_row
  diag_row = per_row + m.num_layers * 128 * 4 * (m.num_heads * 128 + (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
                                                 + 2 * m.d_model)
  assert ev.row_bytes(m, 128, diagnostics=True) == diag_row
  got, diag, plan = ev.sized_batches(batches, m, batch_rows=None, default_rows=4, budget=2 * diag_row + 5)
  fit = (2 * diag_row + 5) // per_row
  size = min(4, fit, 6)
  assert plan == {"rows": 6, "seq_len": 128, "batch_size": size, "diagnostic_rows": 6,
                  "memory_budget": 2 * diag_row + 5}
  assert len(got) == -(-6 // size) and all(b["inputs"].shape == (size, 128) for b in got)
  flat = {f: np.concatenate([b[f] for b in got])[:6] for f in ev.MODEL_FEATURES}
  for f in ev.MODEL_FEATURES:
    np.testing.assert_array_equal(flat[f], rows[f][:6, :128])
    assert not np.concatenate([b[f] for b in got])[6:].any()           # filling rows are padding (loss_mask 0)
  assert [b["inputs"].shape for b in diag] == [(2, 128)] * 3          # 2 rows' maps fit the budget
  # --batch-size wins over the budget; a small budget still runs one row at a time
  assert ev.sized_batches(batches, m, batch_rows=5, default_rows=4, budget=1)[2]["batch_size"] == 5
  assert ev.sized_batches(batches, m, batch_rows=None, default_rows=4, budget=1)[2]["batch_size"] == 1


def test_out_of_memory_is_one_line_with_the_fix(tmp_path, monkeypatch, capsys):
  from sinkjax.config import Config
  from sinkjax.run import save_params_run
  from tests.helpers import call_main
  cfg = Config()
  cfg.model = tiny_config("vanilla")
  cfg.data.seq_len = 64
  save_params_run(tmp_path / "run", cfg, Transformer(cfg.model, rngs=nnx.Rngs(0)))
  (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": PHRASE * 2}) + "\n" for _ in range(6)))

  def oom(*args, **kw):
    raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 27000000000 bytes.")
  monkeypatch.setattr(ev, "evaluate", oom)
  res = call_main(ev.main, ["--checkpoint", tmp_path / "run", "--data", tmp_path / "docs.jsonl", "--split", "all"],
                  capsys)
  lines = [l for l in res.stderr.splitlines() if l.strip()]
  assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
  assert lines[-1].startswith("sinkjax.eval: error: out of memory scoring batches of 9 rows x 64 tokens: lower "
                              "--batch-size (e.g. --batch-size 2)"), lines          # 6 documents of 90 bytes


@pytest.mark.parametrize("attention", ["vanilla", "sink", "gated"])
def test_recorded_and_zeroed_forwards_are_the_same_with_the_layers_scanned(attention):
  """sinkjax.eval scans the layers (model.scan_layers=true: compile time independent of depth); the recorded traces,
  the hidden states and the value-zeroed logits equal those of the layers run one by one (to float32 rounding: the
  scan and the unrolled layers fuse differently; SmolLM2's eval gave bit-identical numbers both ways)."""
  cfg = tiny_config(attention, num_layers=3)
  model = Transformer(cfg, rngs=nnx.Rngs(1))
  params = nnx.state(model, nnx.Param)
  leaves, tdef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  nnx.update(model, jax.tree.unflatten(tdef, [p + 0.2 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]))
  scanned = Transformer(dataclasses.replace(cfg, scan_layers=True), rngs=nnx.Rngs(1))
  nnx.update(scanned, nnx.state(model, nnx.Param))
  b = phrase_batch(np.random.default_rng(0))
  args = dict(segment_ids=jnp.asarray(b["segment_ids"]), positions=jnp.asarray(b["positions"]))
  zero = jnp.asarray(np.random.default_rng(1).random((3, cfg.num_heads)) < 0.5)
  out = {}
  for name, m in (("one by one", model), ("scanned", scanned)):
    logits, traces = analysis.recorded_forward(m, jnp.asarray(b["inputs"]), **args)
    zeroed, _ = analysis.recorded_forward(m, jnp.asarray(b["inputs"]), **args, zero_first_token_value=zero,
                                          keep_weights=False)
    out[name] = (logits, traces, zeroed)
  (logits, traces, zeroed), (s_logits, s_traces, s_zeroed) = out["one by one"], out["scanned"]
  np.testing.assert_allclose(s_logits, logits, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(s_zeroed, zeroed, rtol=1e-5, atol=1e-5)
  assert not np.allclose(zeroed, logits, atol=1e-3)        # the zeroing did something
  for a, c in zip(traces, s_traces):
    for x, y in zip(a, c):
      if x is not None:                                     # hidden states reach |h| ~ 15
        np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-4)
