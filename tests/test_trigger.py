"""Trigger-conditional task of [SinkNecessary] (sinkjax.experiments.trigger) and ReLU attention
([SinkNecessary] §3.4)."""
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sinkjax.attention import relu_attention, relu_attention_weights
from sinkjax.experiments import runner, study
from sinkjax.experiments import trigger as tr
from tests.helpers import ROOT, call_main, one_error_line


# ------------------------------------------------------------------------------------------------ the task

def test_targets_hand_checked_sequence():
  # T = 5, d = 5: [BOS, trigger, other | 2 content coords]; trigger at (1-indexed) position 3.
  x = np.array([[1, 0, 0, 0.0, 0.0],      # BOS
                [0, 0, 1, 0.2, -0.4],     # non-trigger
                [0, 1, 0, 0.6, 0.8],      # trigger
                [0, 0, 1, -0.9, 0.1],     # non-trigger (after the trigger)
                [0, 0, 1, 0.3, 0.3]], np.float32)
  y = np.asarray(tr.task_targets(jnp.asarray(x)[None]))[0]
  want = np.zeros_like(x)
  want[2] = [0.0, 0.5, 0.5, 0.4, 0.2]     # mean of x_2 and x_3 (BOS excluded, trigger included)
  np.testing.assert_allclose(y, want, atol=1e-7)

  # Trigger right after BOS: the target is the trigger token itself.
  x2 = np.array([[1, 0, 0, 0.0], [0, 1, 0, 0.7], [0, 0, 1, -0.5]], np.float32)
  y2 = np.asarray(tr.task_targets(jnp.asarray(x2)[None]))[0]
  np.testing.assert_allclose(y2, [[0, 0, 0, 0], [0, 1, 0, 0.7], [0, 0, 0, 0]], atol=1e-7)


def test_make_batch_matches_section_3_2():
  B, T, d = 96, 8, 6
  x, y, tpos = map(np.asarray, tr.make_batch(jax.random.key(3), B, T, d))
  assert x.shape == y.shape == (B, T, d) and tpos.shape == (B,)
  assert set(np.unique(tpos)) == set(range(1, T))                  # uniform on {2..T} (1-indexed)
  for b in range(B):
    t = tpos[b]
    np.testing.assert_array_equal(x[b, 0], np.eye(d)[0])            # BOS: coordinate 1 only
    for i in range(1, T):
      np.testing.assert_array_equal(x[b, i, :3], [0, 1, 0] if i == t else [0, 0, 1])
      assert np.all(np.abs(x[b, i, 3:]) < 1) and np.all(x[b, i, 3:] != 0)   # U(-1,1) content
    want = np.zeros((T, d), np.float32)
    want[t] = x[b, 1:t + 1].mean(0)
    np.testing.assert_allclose(y[b], want, atol=1e-6)
  # Ablation without BOS: position 1 is an ordinary token and is averaged too.
  xn, yn, tn = map(np.asarray, tr.make_batch(jax.random.key(5), 16, T, d, bos=False))
  assert np.all(xn[:, :, 0] == 0) and np.all(xn[:, 0, 3:] != 0)
  for b in range(16):
    np.testing.assert_allclose(yn[b, tn[b]], xn[b, :tn[b] + 1].mean(0), atol=1e-6)
  # Fixed trigger position for the figures.
  _, _, tfix = tr.make_batch(jax.random.key(4), 4, T, d, trigger_pos=5)
  np.testing.assert_array_equal(np.asarray(tfix), 5)


# ------------------------------------------------------------------------------------------ ReLU attention

def test_relu_attention_hand_computed():
  # D = 1, scale 1: z_tj = q_t k_j. Divisor n_t = #non-BOS positions <= t, clamped to 1 at BOS.
  q = jnp.array([1.0, 2.0, 0.5]).reshape(1, 3, 1, 1)
  k = jnp.array([1.0, 1.0, 3.0]).reshape(1, 3, 1, 1)
  v = jnp.array([10.0, 20.0, 30.0]).reshape(1, 3, 1, 1)
  out, gate = relu_attention(q, k, v, scale=1.0)
  # t=1 (BOS): relu(1)/1 * 10 = 10.  t=2: (relu(2)*10 + relu(2)*20)/1 = 60.
  # t=3: (relu(.5)*10 + relu(.5)*20 + relu(1.5)*30)/2 = 30.
  np.testing.assert_allclose(np.asarray(out).ravel(), [10.0, 60.0, 30.0], rtol=1e-6)
  # gate = non-BOS mass: 0, 2, (0.5 + 1.5)/2 = 1.
  np.testing.assert_allclose(np.asarray(gate).ravel(), [0.0, 2.0, 1.0], rtol=1e-6)
  # Negative scores are cut to zero.
  out2, _ = relu_attention(-q, k, v, scale=1.0)
  np.testing.assert_allclose(np.asarray(out2).ravel(), 0.0)


def _relu_numpy(q, k, v, seg, scale, bos):
  B, T, Hq, D = q.shape
  rep = Hq // k.shape[2]
  out = np.zeros((B, T, Hq, D))
  gate = np.zeros((B, T, Hq))
  for b in range(B):
    for t in range(T):
      if seg[b, t] == 0:
        continue
      keys = [j for j in range(t + 1) if seg[b, j] == seg[b, t]]
      n = max(1, sum(1 for j in keys if not bos[b, j]))
      for h in range(Hq):
        for j in keys:
          a = max(0.0, float(q[b, t, h] @ k[b, j, h // rep]) * scale) / n
          out[b, t, h] += a * v[b, j, h // rep]
          gate[b, t, h] += 0.0 if bos[b, j] else a
  return out, gate


def test_relu_attention_matches_formula_segments_gqa_bos_mask():
  B, T, Hq, Hkv, D = 2, 7, 4, 2, 3
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (B, T, Hq, D))
  k = jax.random.normal(ks[1], (B, T, Hkv, D))
  v = jax.random.normal(ks[2], (B, T, Hkv, D))
  seg = np.array([[1, 1, 1, 2, 2, 2, 0], [3, 3, 3, 3, 3, 3, 3]])
  scale = 0.7
  # Default BOS = first token of each segment.
  bos = np.array([[1, 0, 0, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]], bool)
  out, gate = relu_attention(q, k, v, segment_ids=jnp.asarray(seg), scale=scale)
  w_out, w_gate = _relu_numpy(*map(np.asarray, (q, k, v)), seg, scale, bos)
  np.testing.assert_allclose(np.asarray(out), w_out, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gate), w_gate, atol=1e-5)
  assert np.all(np.asarray(out)[0, 6] == 0)                        # padding row
  # Explicit bos_mask, no segments, default scale 1/sqrt(D).
  bos2 = np.zeros((B, T), bool)
  bos2[:, 0] = bos2[1, 2] = True
  out, gate = relu_attention(q, k, v, bos_mask=jnp.asarray(bos2))
  w_out, w_gate = _relu_numpy(*map(np.asarray, (q, k, v)), np.ones((B, T), int), 1 / np.sqrt(D), bos2)
  np.testing.assert_allclose(np.asarray(out), w_out, atol=1e-5)
  np.testing.assert_allclose(np.asarray(gate), w_gate, atol=1e-5)
  # Weights are finite and differentiable.
  g = jax.grad(lambda q: relu_attention(q, k, v, segment_ids=jnp.asarray(seg))[0].sum())(q)
  assert np.all(np.isfinite(np.asarray(g)))
  w = relu_attention_weights(q, k, scale=scale)
  assert w.shape == (B, Hq, T, T) and float(jnp.min(w)) >= 0


# ------------------------------------------------------------------------------- Theorem 3 ([SinkNecessary] App. F)

def _theorem3_params(d):
  """App. F: W_V = W_O = I and q_i.k_j = x_{i,2} (x_{j,2} + x_{j,3}) (trigger query, any non-BOS key)."""
  e = np.eye(d, dtype=np.float32)
  wq = np.outer(e[1], e[0])                      # x -> x_2 e_1   (coordinate 2 = trigger indicator)
  wk = np.outer(e[1] + e[2], e[0])               # x -> (x_2 + x_3) e_1
  return [{"wq": jnp.asarray(wq)[:, None, :], "wk": jnp.asarray(wk)[:, None, :],
           "wv": jnp.asarray(e)[:, None, :], "wo": jnp.asarray(e)[None]}]


def test_theorem3_relu_construction_zero_loss_no_sink():
  T, d = 16, 16
  params = _theorem3_params(d)
  x, y, tpos = tr.make_batch(jax.random.key(7), 512, T, d)
  rec = tr.evaluate(params, "relu", x, y, tpos)
  assert rec["final_loss"] < 1e-12 and rec["max_abs_error"] < 1e-5
  assert rec["baseline_loss"] > 1e-3
  assert rec["bos_attention_nontrigger"] == 0.0 and rec["bos_attention_trigger"] == 0.0
  _, maps = tr.forward_maps(params, x, "relu")
  attn = np.asarray(maps["attn"])[0, :, 0]                          # [B,T,T]
  t = np.asarray(tpos)
  for b in range(8):
    rows = np.arange(T) != t[b]
    assert np.all(attn[b, rows] == 0)                               # no attention at all off the trigger
    np.testing.assert_allclose(attn[b, t[b], 1:t[b] + 1], 1.0 / t[b], rtol=1e-6)
    assert attn[b, t[b], 0] == 0


def test_sink_and_gated_maps_consistent():
  T, d = 8, 6
  x, y, tpos = tr.make_batch(jax.random.key(1), 4, T, d)
  for variant in ("softmax", "sink", "gated"):
    params = tr.init_params(jax.random.key(2), variant, 2, 2, d, init_std=0.3)
    if variant == "sink":
      params = [dict(p, sink=jnp.array([0.5, -1.0])) for p in params]
    pred, maps = tr.forward_maps(params, x, variant)
    np.testing.assert_allclose(np.asarray(pred), np.asarray(jax.jit(tr.forward, static_argnums=2)(params, x, variant)),
                               atol=1e-6)
    rows = np.asarray(maps["attn"]).sum(-1)                         # [L,B,H,T]
    if variant == "sink":                                           # real keys share the gate sigma(LSE - sink)
      np.testing.assert_allclose(rows, np.swapaxes(np.asarray(maps["gate"]), 2, 3), atol=1e-5)
    else:
      np.testing.assert_allclose(rows, 1.0, atol=1e-5)
    rec = tr.evaluate(params, variant, x, y, tpos)
    assert len(rec["bos_attention_nontrigger_per_head"]) == 2
    assert len(rec["bos_attention_nontrigger_per_head"][0]) == 2


def test_value_norms_by_hand():
  """BOS and non-BOS value norms per layer and head: layer 0 from x, layer 1 from x plus what layer 0 wrote
  (`forward` of the first layer alone), each by numpy."""
  T, d = 8, 6
  x, y, tpos = tr.make_batch(jax.random.key(3), 5, T, d)
  params = tr.init_params(jax.random.key(4), "softmax", 2, 3, d, init_std=0.3)
  got = tr.value_norms(params, x, "softmax")
  h1 = np.asarray(x) + np.asarray(tr.forward(params[:1], x, "softmax"))
  for layer, h in enumerate((np.asarray(x), h1)):
    v = np.einsum("btd,dhe->bthe", h, np.asarray(params[layer]["wv"]))
    o = np.einsum("bthe,hed->bthd", v, np.asarray(params[layer]["wo"]))
    for key, a in (("value", v), ("output", o)):
      n = np.linalg.norm(a, axis=-1)                                # [B,T,H]; BOS is position 0 of every row
      np.testing.assert_allclose(got[f"bos_{key}_norm_per_head"][layer], n[:, 0].mean(0), rtol=1e-5)
      np.testing.assert_allclose(got[f"{key}_norm_per_head"][layer], n[:, 1:].reshape(-1, 3).mean(0), rtol=1e-5)
  assert "bos_value_norm_per_head" in tr.evaluate(params, "softmax", x, y, tpos)
  x, _, _ = tr.make_batch(jax.random.key(3), 5, T, d, bos=False)
  got = tr.value_norms(params, x, "softmax")
  assert got["bos_value_norm_per_head"] is None and len(got["value_norm_per_head"]) == 2


# ------------------------------------------------------------------------------------------------ study file

QUICK = ROOT / "configs" / "studies" / "trigger_quick.yaml"


def test_study_file_bad_values_are_one_line(capsys):
  """A bad key of the trigger: section or a bad axis value is one line naming it, status 1, before any training."""
  for argv, says in ((["trigger.seq_len=2"], "trigger.seq_len must be >= 3"),
                     (["axes.variant=[softmax,foo]"], "unknown variant 'foo'"),
                     (["trigger.max_steps=-3"], "trigger.max_steps"), (["trigger.bogus=1"], "trigger.bogus"),
                     (["axes.shape=[2y2]"], "LAYERSxHEADS"), (["axes.seed=[0,1]"], "axes are shape and variant")):
    assert says in one_error_line(call_main(study.main, [QUICK, *argv, "--dry-run"], capsys)), argv


def test_study_files_are_the_papers_grid():
  """trigger.yaml: App. A's settings over 1x1, 2x2, 4x4 x the four variants (shape outermost); trigger_quick.yaml: its
  1x1 row with the smaller step cap."""
  full = runner.load_plan(ROOT / "configs" / "studies" / "trigger.yaml")
  o = full.options({"trigger": tr.TriggerOptions})["trigger"]
  assert (o.lr_single, o.lr_multi, o.batch_size, o.seq_len, o.dim, o.stop_error, o.max_steps) == (
      1e-3, 1e-4, 128, 16, 16, 5e-3, 50000)
  assert tr._grid(full)[:5] == [("softmax", 1, 1), ("relu", 1, 1), ("sink", 1, 1), ("gated", 1, 1), ("softmax", 2, 2)]
  quick = runner.load_plan(QUICK)
  assert [g[1:] for g in tr._grid(quick)] == [(1, 1)] * 4
  assert quick.options({"trigger": tr.TriggerOptions})["trigger"].max_steps == 20000


@pytest.mark.slow   # the study command's twin (~25 s) of the in-process trigger tests
def test_study_smoke(tmp_path):
  out = tmp_path / "trig"
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  argv = [sys.executable, "-m", "sinkjax.experiments.study", str(QUICK), f"study.out={out}", "trigger.max_steps=3",
          "trigger.eval_size=16", "trigger.seq_len=6", "trigger.dim=5", "trigger.progress=false"]
  r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  recs = json.loads((out / "results.json").read_text())
  assert [rec["variant"] for rec in recs] == ["softmax", "relu", "sink", "gated"]
  for rec in recs:
    assert rec["layers"] == 1 and rec["heads"] == 1 and rec["steps"] == 3 and rec["commit"]
    for key in ("final_loss", "baseline_loss", "bos_attention_nontrigger", "bos_attention_trigger"):
      assert isinstance(rec[key], float) and np.isfinite(rec[key])
    assert rec["baseline_loss"] > 0
  assert "sink_attention_nontrigger" in recs[2] and "gate_trigger" in recs[3]
  assert all(isinstance(rec["solved"], bool) and rec["heldout_max_abs_error"] >= 0 for rec in recs)
  assert (out / "attention_1L1H.png").stat().st_size > 0
  assert "final_loss" in r.stdout and "baseline" in r.stdout
  again = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)    # resumes: nothing to train
  assert again.returncode == 0 and json.loads((out / "results.json").read_text()) == recs


@pytest.mark.slow
def test_quick_training_softmax_sinks_relu_does_not(tmp_path):
  recs = {}
  for variant in ("softmax", "relu"):
    params, info = tr.train(variant, 1, 1, lr=1e-3, max_steps=5000, seed=0, progress=False)
    x, y, tpos = tr.make_batch(jax.random.key(99), 500, 16, 16)
    recs[variant] = tr.evaluate(params, variant, x, y, tpos)
    assert info["converged"]
    assert recs[variant]["final_loss"] < 1e-2 * recs[variant]["baseline_loss"]
  assert recs["softmax"]["bos_attention_nontrigger"] > 0.95
  assert recs["relu"]["bos_attention_nontrigger"] < 0.05


def test_solved_is_judged_on_a_held_out_batch():
  """`solved` applies the stop rule to the batch it is given (the study passes a held-out one): its error is
  max |pred - y| computed by hand, and the rule holds just above that error and fails just below it."""
  T, d = 8, 6
  x, y, _ = tr.make_batch(jax.random.key(5), 7, T, d)
  params = tr.init_params(jax.random.key(6), "softmax", 1, 1, d, init_std=0.3)
  got = tr.solved_on_heldout(params, "softmax", x, y, 5e-3)
  want = float(np.max(np.abs(np.asarray(tr.forward(params, x, "softmax")) - np.asarray(y))))
  assert got["heldout_max_abs_error"] == pytest.approx(want) and got["solved"] == (want < 5e-3)
  assert tr.solved_on_heldout(params, "softmax", x, y, want * 1.01)["solved"]
  assert not tr.solved_on_heldout(params, "softmax", x, y, want * 0.99)["solved"]
