"""Training: the step learns, the aux loss has the right gradient, the CLI handles user errors in one line,
checkpoints resume exactly, SIGTERM saves, non-finite steps are skipped and stop the run, and a CLI run leaves a
complete run directory.

The models here are a few thousand parameters so that the file runs in a few minutes on a 2-core CPU; a per-module
JAX compilation cache (also handed to the CLI subprocesses) lets repeated runs of one shape compile once.
"""
import hashlib
import os
import pathlib
import re
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from sinkjax import balance, optim
from sinkjax import train as train_lib
from sinkjax.config import ConfigError, load_config
from sinkjax.data import build_tokenizer, make_train_iterator
from sinkjax.errors import Interrupted
from sinkjax.model import Transformer
from sinkjax.run import read_metrics
from sinkjax.step import TRAIN_FEATURES, make_train_step
from sinkjax.train import TrainError, train
from tests.helpers import TINY, call_main, finish, losses, one_error_line, start_command
SMALL = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=16",
         "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=16", "train.log_every=1", "train.eval_batches=1",
         "train.eval_every=0", "checkpoint.every=100"]
# For the loop's own checks (run directory, checkpoints kept, profiler, signals), where the optimizer is not what is
# tested: AdamW's step compiles in about 60 % of Muon's time (Muon, the default, is trained by the step tests below,
# test_exact_resume and the CLI smoke run).
ADAMW = ["train.optimizer=adamw"]


# ------------------------------------------------------------------------------------------------------------
# The step
# ------------------------------------------------------------------------------------------------------------

def _setup(overrides, steps=20):
  cfg = load_config(TINY, SMALL + overrides)
  tok = build_tokenizer(cfg.data)
  cfg.model.vocab_size = tok.vocab_size
  graphdef, params, rest = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)), nnx.Param, ...)
  tx, _ = optim.build_optimizer(cfg, steps)
  state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
           "rng": jax.random.PRNGKey(0), "nonfinite": jnp.zeros((), jnp.int32)}
  it = make_train_iterator(cfg.data, tok, batch_size=cfg.train.batch_size, seed=0)
  batch = {k: v for k, v in next(it).items() if k in TRAIN_FEATURES}
  it.close()
  return cfg, jax.jit(make_train_step(cfg, graphdef, rest, tx)), state, batch


@pytest.mark.parametrize("variant", ["vanilla", "sink", "gated"])
def test_loss_finite_and_decreasing(variant, compile_cache):
  """Repeating one batch of real text, the loss (CE + aux at the paper's 1e-4) goes down at every step."""
  cfg, step, state, batch = _setup([f"model.attention={variant}", "loss.aux_weight=0.0001"])
  losses = []
  for _ in range(6):
    state, m = step(state, batch)
    losses.append(float(m["loss"]))
    assert bool(m["finite"]) and np.isfinite(np.asarray(m["importance"])).all()
    assert float(m["aux_loss"]) > 0
  assert losses[0] == pytest.approx(np.log(cfg.model.vocab_size), rel=1e-3)   # zero-initialized LM head
  assert all(b < a for a, b in zip(losses, losses[1:])), losses
  assert losses[-1] < losses[0] - 1.0, losses


def test_null_weight_is_null(compile_cache):
  """The aux term is traced at every weight, 0 included, so lambda = 1e-30 runs the program of lambda = 0 with one
  constant changed: the lowered text of the two steps is the same once lambda's constant is swapped (a step that
  built the aux term only for lambda > 0 lowers a smaller program at 0 and fails here, even though its parameters
  below stay bit-identical on the CPU); with AdamW, five steps give bit-identical parameters (as two lambda = 0 runs
  do), and lambda = 1e-8 does not (its gradient is above the CE gradient's rounding). loss.aux_term=false compiles
  another program."""
  def setup(lam):
    return _setup(["train.optimizer=adamw", "model.attention=vanilla", f"loss.aux_weight={lam}"])

  def lowered(lam):
    _, step, state, batch = setup(lam)
    return step.lower(state, batch).as_text()

  def params(lam):
    _, step, state, batch = setup(lam)
    for _ in range(5):
      state, _ = step(state, batch)
    return [np.asarray(x) for x in jax.tree.leaves(state["params"])]
  zero, tiny = lowered(0.0), lowered(1e-30)
  assert "dense<1.000000e-30>" in tiny
  assert tiny.replace("dense<1.000000e-30>", "dense<0.000000e+00>") == zero     # one program, one constant apart
  ref = params(0.0)
  same = lambda other: all(np.array_equal(a, b) for a, b in zip(ref, other, strict=True))
  assert same(params(0.0))
  assert same(params(1e-30))
  assert not same(params(1e-8))


def test_stream_rows_train_without_segment_ids(compile_cache):
  """data.packing=stream rows are one segment, so the step leaves their ids out (the TPU kernels then stream none):
  the step on ids scrambled to anything gives the loss of the step on the pipeline's all-ones ids; a document-packed
  step does read them."""
  for packing, same in (("stream", True), ("document", False)):
    cfg, step, state, batch = _setup([f"data.packing={packing}", "model.attention=sink", "loss.aux_weight=0.01",
                                      "train.optimizer=adamw"])  # the loss alone: AdamW's step compiles faster
    scrambled = {**batch, "segment_ids": (np.arange(batch["segment_ids"].size).reshape(
        batch["segment_ids"].shape) % 3 + 1).astype(np.int32)}
    a, b = step(state, batch)[1], step(state, scrambled)[1]
    assert (float(a["loss"]) == float(b["loss"])) is same, packing


def test_aux_term_false_needs_zero_weight():
  with pytest.raises(ConfigError, match="loss.aux_term=false drops the aux loss but loss.aux_weight is 0.01"):
    load_config(TINY, SMALL + ["loss.aux_term=false", "loss.aux_weight=0.01"])


def test_gradient_accumulation_matches_one_batch(compile_cache):
  """Two micro-batches of 8 rows give the same update as one batch of 16 (masked-mean CE over the whole batch)."""
  _, step1, state1, batch = _setup(["loss.aux_weight=0.0"])
  _, step2, state2, _ = _setup(["loss.aux_weight=0.0", "train.grad_accum=2"])
  batch["loss_mask"][0, :7] = 0.0          # unequal token counts per micro-batch: a per-micro mean would differ
  s1, m1 = step1(state1, batch)
  s2, m2 = step2(state2, batch)
  assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-6)
  np.testing.assert_allclose(float(m1["grad_norm"]), float(m2["grad_norm"]), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)


def test_remat_lowers_temporaries():
  """Measured, not assumed: the compiled train step of the same scanned model needs fewer temporary bytes with
  model.remat=true than without (it keeps each layer's input instead of all its activations). On the host's CPU
  compiler, which does no rematerialization of its own (test_compile_speed checks the policies' recomputed FLOPs in
  XLA:TPU's programs)."""
  from sinkjax import sharding as sharding_lib
  from sinkjax.train import JittedSteps
  # Four scanned layers (one body to compile) whose activations dominate the step (241 -> 90 MB of temporaries).
  ov = ["model.num_layers=4", "train.optimizer=adamw", "model.d_model=256", "model.num_heads=4", "model.num_kv_heads=4",
        "model.head_dim=64", "data.seq_len=256", "model.max_seq_len=256", "model.vocab_size=257", "train.batch_size=8",
        "mesh.data=1", "mesh.fsdp=1", "model.scan_layers=true", "model.attn_impl=xla"]
  temps = {}
  for remat in (False, True):
    cfg = load_config(TINY, ov + [f"model.remat={str(remat).lower()}"])
    program = JittedSteps(cfg, sharding_lib.make_mesh(cfg.mesh, jax.devices("cpu")[:1]))
    temps[remat] = program.lower()[0].compile().memory_analysis().temp_size_in_bytes
  assert temps[True] < 0.7 * temps[False], temps


@pytest.mark.slow   # ~23 s; remat, LoRA and mixed layers are each checked by default
def test_remat_with_lora_and_mixed_layers_trains():
  """Per-layer remat (the path of non-uniform layers, e.g. GPT-OSS's alternating sliding windows) with LoRA's split
  parameters: the same step as without remat (nnx.remat on the module used to fail here: it wrote back into them)."""
  ov = ["lora.rank=4", "model.sliding_window=4", "model.layer_types=[full,sliding]", "model.num_layers=2",
        "model.scan_layers=true"]
  losses = []
  for remat in ("false", "true"):
    cfg = load_config(TINY, SMALL + ov + [f"model.remat={remat}", "model.vocab_size=257"])
    from sinkjax.train import TrainedParams
    params = TrainedParams(cfg)
    graphdef, trained, rest = params.split_model(params.build_model())
    tx, _ = optim.build_optimizer(cfg, 10)
    state = {"params": trained, "opt_state": tx.init(trained), "step": jnp.zeros((), jnp.int32),
             "rng": jax.random.PRNGKey(0), "nonfinite": jnp.zeros((), jnp.int32)}
    tok = build_tokenizer(cfg.data)
    it = make_train_iterator(cfg.data, tok, batch_size=cfg.train.batch_size, seed=0)
    batch = {k: v for k, v in next(it).items() if k in TRAIN_FEATURES}
    it.close()
    _, m = jax.jit(make_train_step(cfg, graphdef, rest, tx))(state, batch)
    losses.append((float(m["loss"]), float(m["grad_norm"])))
  np.testing.assert_allclose(losses[0], losses[1], rtol=2e-6)


def _assert_same_step(step_a, state_a, step_b, state_b, batch):
  """Both steps on one batch: the same loss, aux loss, gradient norm and importances (to float32 rounding), and the
  same updates of the weights. The updates are compared relative to their own size: Muon orthogonalises the gradient
  with Newton-Schulz iterations in bfloat16 (nanochat's), which turns float32 rounding differences of the gradient
  (a loss summed in another order) into bfloat16-sized differences of the update (seen on jax 0.12's XLA:CPU: up to
  3.7 % of the largest update element, on 1 of 4,096; tolerance 1/16); a wrong gradient moves it by its own size."""
  before = [np.asarray(x, np.float64) for x in jax.tree.leaves(state_a["params"])]
  sa, ma = step_a(state_a, batch)
  sb, mb = step_b(state_b, batch)
  for k in ("loss", "aux_loss", "grad_norm"):
    np.testing.assert_allclose(float(ma[k]), float(mb[k]), rtol=2e-6, err_msg=k)
  np.testing.assert_allclose(np.asarray(ma["importance"]), np.asarray(mb["importance"]), atol=1e-6)
  for a, b, p in zip(jax.tree.leaves(sa["params"]), jax.tree.leaves(sb["params"]), before):
    da, db = np.asarray(a, np.float64) - p, np.asarray(b, np.float64) - p
    np.testing.assert_allclose(da, db, atol=max(1e-6, 2.0 ** -4 * float(np.abs(da).max())))


@pytest.mark.parametrize("memory", [pytest.param(["model.scan_layers=true"], marks=pytest.mark.slow),
                                    pytest.param(["model.remat=true"], marks=pytest.mark.slow), ["train.loss_chunk=7"],
                                    ["model.scan_layers=true", "model.remat=true", "model.remat_policy=dots",
                                     "train.loss_chunk=16"], ["train.loss_impl=fused", "train.loss_chunk=7"]])
def test_memory_settings_change_nothing_but_memory(memory, compile_cache):
  """Scanned layers, rematerialization and the chunked loss (7 does not divide 32 positions: padded blocks) give the
  step of the plain per-layer loop with whole [B,T,V] logits: loss, aux loss, importances and updated weights (gated
  attention with per-layer residual scalars: every parameter kind and the aux gradient through the gates). Scan alone
  and remat alone are slow: by default the last case scans with remat, and test_scan_over_alternating_layers_... and
  test_remat_with_lora_and_mixed_layers_trains take the scanned and the per-layer remat paths."""
  ov = ["model.attention=gated", "model.residual_scalars=true", "loss.aux_weight=0.01", "model.num_layers=3"]
  _, step_a, state_a, batch = _setup(ov)
  _, step_b, state_b, _ = _setup(ov + memory)
  batch["loss_mask"][0, :5] = 0.0
  _assert_same_step(step_a, state_a, step_b, state_b, batch)


def test_scan_layers_runs_as_one_scan_and_falls_back_for_mixed_layers():
  """model.scan_layers puts one lax.scan over the layers in the program; layers that repeat with a period (GPT-OSS's
  alternating sliding / full) scan over the repeating group; layers with no period run one by one."""
  def program(extra, layers=3):
    cfg = load_config(TINY, SMALL + ["model.vocab_size=257", f"model.num_layers={layers}", "model.scan_layers=true",
                                     *extra])
    graphdef, state = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)))
    return str(jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.zeros((2, 8), jnp.int32)))
  def layer_scans(length, text):       # the kernel's own pair loop is a scan too, of another length
    return re.compile(rf"scan\[[^\]]*length={length}\b").findall(text)
  assert len(layer_scans(3, program([]))) == 1
  assert not layer_scans(3, program(["model.sliding_window=4", "model.layer_types=[full,sliding,full]"]))
  pairs = program(["model.sliding_window=4", "model.layer_types=[sliding,full,sliding,full,sliding,full]"], 6)
  assert len(layer_scans(3, pairs)) == 1          # three groups of (sliding, full)


def test_scan_over_alternating_layers_is_the_per_layer_step(compile_cache, optimized_compile):
  """A scan over (sliding, full) pairs gives the per-layer loop's step: loss, importances in layer order, weights
  (within 1e-6: compiled with every optimization, as the cheaper test mode differs by 1e-5 between the two forms)."""
  ov = ["model.attention=sink", "loss.aux_weight=0.01", "model.num_layers=4", "model.sliding_window=3",
        "model.layer_types=[sliding,full,sliding,full]", "model.remat=true"]
  _, step_a, state_a, batch = _setup(ov)
  _, step_b, state_b, _ = _setup(ov + ["model.scan_layers=true"])
  _assert_same_step(step_a, state_a, step_b, state_b, batch)


def test_aux_term_is_zero_when_weight_is_zero(compile_cache):
  _, step, state, batch = _setup(["loss.aux_weight=0.0", "model.attention=sink", "train.optimizer=adamw"])
  _, m = step(state, batch)             # metrics alone: AdamW's step compiles faster than Muon's
  assert float(m["aux_loss"]) == 0.0 and float(m["loss"]) == float(m["ce_loss"])
  assert float(m["head_imbalance"]) > 0          # importances are still measured


def test_aux_loss_gradient_vanishes_only_at_balance():
  grad = jax.grad(lambda imp: balance.aux_loss(imp, 1e-4, 0))
  equal = jnp.full((3, 4), 0.7)
  assert np.abs(np.asarray(grad(equal))).max() == 0.0
  unequal = equal.at[1, 2].set(0.2)
  g = np.asarray(grad(unequal))
  assert np.abs(g[1]).min() > 0                   # every head of the unbalanced layer is pushed
  assert np.abs(g[[0, 2]]).max() == 0.0           # balanced layers are left alone
  # Finite differences agree with the autodiff gradient of eq. 7 = 1e-4 * sum_l H * CV^2.
  eps = 1e-3
  fd = (balance.aux_loss(unequal.at[1, 0].add(eps), 1e-4, 0) - balance.aux_loss(unequal.at[1, 0].add(-eps), 1e-4, 0))
  assert float(fd) / (2 * eps) == pytest.approx(g[1, 0], rel=1e-2)


def test_optimizer_groups():
  cfg = load_config(TINY, SMALL + ["model.attention=gated", "model.vocab_size=257"])
  params = nnx.state(Transformer(cfg.model, rngs=nnx.Rngs(0)), nnx.Param)
  labels = {"/".join(map(str, p)): l for p, l in nnx.to_flat_state(optim.param_labels(params))}
  assert labels["embed/embedding"] == "embed" and labels["lm_head/kernel"] == "unembed"
  for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"):
    assert labels[f"layers/0/attn/{name}/kernel"] == "matrix"
  assert labels["layers/1/mlp/up_proj/kernel"] == "matrix"
  assert labels["layers/0/attn/gate_proj/bias"] == "scalar"
  sched = optim.lr_schedule(1.0, 100, warmup_steps=10, decay_frac=0.2)
  assert [float(sched(s)) for s in (0, 5, 10, 50, 80, 90, 100)] == pytest.approx([0, .5, 1, 1, 1, .5, 0])


# ------------------------------------------------------------------------------------------------------------
# The loop, checkpoints, CLI
# ------------------------------------------------------------------------------------------------------------

def test_exact_resume(tmp_path, compile_cache):
  """k steps, stop with a checkpoint, resume to 2k == 2k uninterrupted: bitwise equal losses and parameters
  (optimizer state, RNG and the data iterator position are restored; gradient accumulation on)."""
  ov = SMALL + ["train.steps=6", "train.grad_accum=2", "loss.aux_weight=0.0001"]
  whole = train(load_config(TINY, ov + [f"run.dir={tmp_path / 'a'}"]), progress=False)
  first = train(load_config(TINY, ov + [f"run.dir={tmp_path / 'b'}", "train.stop_at_step=3"]), progress=False)
  assert first["end_step"] == 3 and len(losses(tmp_path / "b")) == 3
  second = train(load_config(TINY, ov + [f"run.dir={tmp_path / 'b'}"]), progress=False)
  assert second["start_step"] == 3
  assert losses(tmp_path / "a") == losses(tmp_path / "b")
  assert len(losses(tmp_path / "a")) == 6 and whole["val_bpb"] == second["val_bpb"]

  from sinkjax.run import load_run
  (ma, _, _, _), (mb, cfg, tok, _) = load_run(tmp_path / "a"), load_run(tmp_path / "b")
  for x, y in zip(jax.tree.leaves(nnx.state(ma, nnx.Param)), jax.tree.leaves(nnx.state(mb, nnx.Param))):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  assert cfg.model.vocab_size == tok.vocab_size == 257


def _files(run_dir: pathlib.Path) -> dict:
  """{path: (sha256, mtime)} of every file under run_dir."""
  return {str(p.relative_to(run_dir)): (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns)
          for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_a_finished_run_run_again_changes_nothing(tmp_path, compile_cache, capsys):
  """`python -m sinkjax.train --config X` again on a finished run: every file of the run directory keeps its bytes
  (and is not even rewritten), no file appears (no TensorBoard event file, no rewritten config.yaml), and the one line
  it prints says how to extend the run (train.steps=N)."""
  argv = ["--config", TINY, *SMALL, *ADAMW, "train.steps=2", f"run.dir={tmp_path}"]
  assert call_main(train_lib.main, argv, capsys).returncode == 0
  before = _files(tmp_path)
  assert "config.yaml" in before and "metrics.jsonl" in before and any(k.startswith("tb/") for k in before)
  time.sleep(0.01)                         # a rewrite would show in the modification times
  again = call_main(train_lib.main, argv, capsys)
  assert again.returncode == 0, again.stderr[-2000:]
  assert _files(tmp_path) == before
  assert again.stdout.strip().splitlines() == [
      f"sinkjax.train: nothing to do: {tmp_path} is at step 2 of train.steps=2 and was left as it is; "
      "train.steps=N with N > 2 extends it"], again.stdout


def test_checkpoint_keep_steps_are_saved_and_never_deleted(tmp_path, compile_cache):
  """checkpoint.keep_steps: a step off the checkpoint.every cadence is saved, and outlives checkpoint.keep (1 here);
  the rest are rolled as before (the latest one only)."""
  train(load_config(TINY, SMALL + ADAMW + ["train.steps=7", "checkpoint.every=2", "checkpoint.keep=1",
                                   "checkpoint.keep_steps=[3]", "checkpoint.async_save=false",
                                   f"run.dir={tmp_path}"]), progress=False)
  assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [3, 7]
  with pytest.raises(ConfigError, match="keep_steps"):
    load_config(TINY, ["checkpoint.keep_steps=[0]"])


@pytest.mark.slow  # two training commands (~18 s); resuming with changed settings is checked by default in
                   # test_config (another step count) and test_exact_resume
def test_resume_with_other_data_settings_is_refused_not_set_aside(tmp_path, compile_cache):
  """A checkpoint whose data-iterator state does not fit the pipeline (data.shuffle_batches changed) is a settings
  error: one clear message, and the checkpoint stays where it is (it is not damaged, so it is not moved away)."""
  from sinkjax.checkpoint import DataStateMismatch
  ov = SMALL + ["train.steps=2", f"run.dir={tmp_path}"]
  train(load_config(TINY, ov + ["data.shuffle_batches=0"]), progress=False)
  before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
  with pytest.raises(DataStateMismatch, match="data.shuffle_batches"):
    train(load_config(TINY, SMALL + ["train.steps=3", f"run.dir={tmp_path}"]), progress=False)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before
  again = train(load_config(TINY, SMALL + ["train.steps=3", f"run.dir={tmp_path}", "data.shuffle_batches=0"]),
                progress=False)
  assert again["start_step"] == 2 and again["end_step"] == 3


def test_data_state_checked_before_restore(tmp_path):
  """The saved iterator state is checked against this pipeline before grain restores it: other transformations
  (worker processes, row shuffle) or another process count are settings errors, found before any batch is drawn,
  and restore_latest leaves the checkpoint in place."""
  import dataclasses
  from sinkjax.checkpoint import Checkpointer, DataStateMismatch
  from sinkjax.config import CheckpointConfig
  cfg = load_config(TINY, SMALL)
  tok = build_tokenizer(cfg.data)
  mk = lambda **kw: make_train_iterator(dataclasses.replace(cfg.data, **kw), tok, batch_size=4, seed=0)
  params = {"w": jnp.ones((2, 3))}
  train_state = {"step": jnp.zeros((), jnp.int32)}
  ck = Checkpointer(tmp_path, CheckpointConfig(async_save=False))
  it = mk()
  next(it)
  ck.save(1, params, train_state, it, force=True)
  ck.wait()
  it.close()
  abstract = lambda t: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), t)
  for kw in ({"shuffle_batches": 0}, {"num_workers": 1}):
    other = mk(**kw)
    try:
      with pytest.raises(DataStateMismatch, match="data.shuffle_batches"):
        ck.restore_latest(abstract(params), abstract(train_state), other)
    finally:
      other.close()
  same = mk()
  assert ck.restore_latest(abstract(params), abstract(train_state), same)[0] == 1
  same.close()
  data = tmp_path / "checkpoints" / "1" / "data"
  (data / "process_0-of-1.json").rename(data / "process_0-of-2.json")
  with pytest.raises(DataStateMismatch, match="another number of processes"):
    ck.restore_latest(abstract(params), abstract(train_state), mk())
  assert ck.all_steps() == [1]
  ck.close()


@pytest.mark.slow   # the same refusal as the data-settings test below, for the optimizer (~18 s)
def test_resume_with_another_optimizer_is_refused_not_set_aside(tmp_path, compile_cache):
  from sinkjax.checkpoint import TrainStateMismatch
  train(load_config(TINY, SMALL + ["train.steps=2", f"run.dir={tmp_path}"]), progress=False)
  before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
  for change in ("train.optimizer=adamw", "train.grad_clip=0"):
    with pytest.raises(TrainStateMismatch, match="train.optimizer"):
      train(load_config(TINY, SMALL + ["train.steps=3", f"run.dir={tmp_path}", change]), progress=False)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before


def test_profiler_trace_of_chosen_steps(tmp_path, compile_cache):
  from sinkjax.config import ConfigError
  with pytest.raises(ConfigError, match="train.profile_start"):
    load_config(TINY, SMALL + ["train.profile_steps=2"])
  train(load_config(TINY, SMALL + ADAMW + ["train.steps=3", "train.profile_start=2", "train.profile_steps=1",
                                   f"run.dir={tmp_path}"]), progress=False)
  files = [p for p in (tmp_path / "profile").rglob("*") if p.is_file()]
  assert any(p.name.endswith(".xplane.pb") for p in files), files
  traces = [p for p in files if p.name.endswith(".trace.json.gz")]
  if traces:   # the Chrome/Perfetto trace holds the jitted train step
    import gzip
    assert "train_step" in gzip.decompress(traces[0].read_bytes()).decode(errors="replace")


def test_load_run_errors(tmp_path):
  from sinkjax.checkpoint import CheckpointError
  from sinkjax.run import load_run
  with pytest.raises(CheckpointError, match="does not exist"):
    load_run(tmp_path / "missing")
  with pytest.raises(CheckpointError, match="not a run directory"):
    load_run(tmp_path)


def test_sigterm_saves_a_checkpoint_and_resumes(tmp_path, compile_cache):
  run_dir = tmp_path / "run"
  ov = SMALL + ADAMW + ["train.steps=200", f"run.dir={run_dir}"]
  metrics = run_dir / "metrics.jsonl"

  def send_when_logging():
    deadline = time.time() + 240
    while time.time() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
      time.sleep(0.05)
    os.kill(os.getpid(), signal.SIGTERM)

  threading.Thread(target=send_when_logging, daemon=True).start()
  with pytest.raises(Interrupted) as e:
    train(load_config(TINY, ov), progress=False)
  assert e.value.signum == signal.SIGTERM
  stopped = losses(run_dir)[-1][0]
  assert 2 <= stopped < 200
  steps = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
  assert steps == [stopped]
  resumed = train(load_config(TINY, ov + ["train.stop_at_step=" + str(stopped + 1)]), progress=False)
  assert resumed["start_step"] == stopped and resumed["end_step"] == stopped + 1


def test_nonfinite_updates_are_skipped_and_stop_the_run(tmp_path, compile_cache):
  """A learning rate beyond float32 (1e39: finite in the config, inf on the device) makes every update non-finite:
  none is applied, the run stops after train.max_nonfinite of them, and what was checkpointed meanwhile is the
  finite, untouched model."""
  run_dir = tmp_path / "run"
  cfg = load_config(TINY, SMALL + ["train.optimizer=adamw", "train.adamw_lr=1e39", "train.max_nonfinite=3",
                                   "train.steps=20", "checkpoint.every=2", f"run.dir={run_dir}"])
  with pytest.raises(TrainError, match="non-finite for 3 steps in a row"):
    train(cfg, progress=False)
  recs = read_metrics(run_dir / "metrics.jsonl")
  assert recs and all(not r["finite"] for r in recs)
  assert len({r["loss"] for r in recs}) == 1        # parameters never changed
  from sinkjax.run import load_run
  model, _, _, _ = load_run(run_dir)
  assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def _digest(run_dir):
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(pathlib.Path(run_dir).rglob("*"))
          if p.is_file()}


def test_cli_smoke_and_user_errors(tmp_path, compile_cache, capsys):
  """configs/tiny.yaml through the CLI leaves a complete run directory; user errors are one line on stderr with
  a non-zero exit and leave an existing run directory untouched. One error case runs as a command beside the smoke
  run; the others call the command's main in this process meanwhile (the same code after the interpreter starts)."""
  run_dir = tmp_path / "tiny"
  smoke = start_command("sinkjax.train", "--config", "configs/tiny.yaml", "train.steps=4", "train.batch_size=4",
                        "train.log_every=2", "train.eval_every=2", "train.eval_batches=1", "checkpoint.every=2",
                        f"run.dir={run_dir}", env=compile_cache)
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  bad = {
      "unknown key": (["train.bogus=1"], "unknown config key train.bogus"),
      "wrong type": (["train.steps=many"], "train.steps must be int"),
      "bad choice": (["model.attention=linear"], "model.attention must be one of"),
      "missing data": (["data.source=/nonexistent/fineweb/*.parquet"], "/nonexistent/fineweb"),
      "unwritable run dir": ([f"run.dir={blocker}/run"], "is not writable"),
      "not an override": (["steps"], "must look like section.key=value"),
  }
  as_command = start_command("sinkjax.train", "--config", "configs/tiny.yaml", *bad["unknown key"][0],
                             env=compile_cache)
  for name, (args, expect) in bad.items():
    line = one_error_line(call_main(train_lib.main, ["--config", TINY, *args], capsys))
    assert expect in line, (name, line)
  assert bad["unknown key"][1] in one_error_line(finish(as_command))
  assert "does not exist" in one_error_line(call_main(train_lib.main, ["--config", tmp_path / "nope.yaml"], capsys))
  assert "--config" in one_error_line(call_main(train_lib.main, [], capsys), status=2)
  help_ = call_main(train_lib.main, ["--help"], capsys)
  assert help_.returncode == 0 and help_.stdout.startswith("usage:") and "section.key=value" in help_.stdout

  smoke = finish(smoke)
  out = smoke.stdout
  assert smoke.returncode == 0, smoke.stderr
  names = {p.name for p in run_dir.iterdir()}
  assert {"checkpoints", "metrics.jsonl", "config.yaml", "tb", "loss.png", "head_imbalance.png",
          "importance.png"} <= names
  assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
  assert any(p.name.startswith("events.out.tfevents") for p in (run_dir / "tb").iterdir())
  recs = read_metrics(run_dir / "metrics.jsonl")
  assert [r["step"] for r in recs] == [1, 2, 4]
  for r in recs:
    assert {"step", "loss", "aux_loss", "head_imbalance", "importance", "tokens_per_s", "lr"} <= set(r)
    assert np.asarray(r["importance"]).shape == (4, 4)
  assert "val_bpb" in recs[1] and "val_bpb" in recs[2] and "val_bpb" not in recs[0]
  saved = load_config(str(run_dir / "config.yaml"))
  assert saved.model.vocab_size == 257 and saved.train.steps == 4
  assert "val_bpb" in out and "done: step 4/4" in out

  # An existing run directory survives a mismatching command untouched.
  before = _digest(run_dir)
  line = one_error_line(call_main(train_lib.main, ["--config", TINY, "model.num_layers=3",
                                                   f"run.dir={run_dir}"], capsys))
  assert "different model (num_layers)" in line
  assert _digest(run_dir) == before


# ------------------------------------------------------------------------------------------------------------
# SFT: train.epochs and truncated examples
# ------------------------------------------------------------------------------------------------------------

def _sft_corpus(tmp_path):
  """24 examples in sinkjax's plain layout (byte tokenizer): BOS + "User: " + p + "\\n\\n" + "Assistant: " + r +
  "\\n\\n" = 22 + len(p) + len(r) tokens; rows of data.seq_len + 1 = 64. Every 4th (3, 7, ...) is validation
  (data.val_fraction 0.25), 18 train. Of those, 0 and 5 have 82 tokens (truncated, response left), 9 a 60-character
  prompt (69 tokens before its response: dropped), the others 52 (one per row: two never fit). So 17 rows, 2
  truncated, 1 dropped."""
  import json
  lines = []
  for i in range(24):
    p, r = f"q{i:02d}" + "?" * 7, f"a{i:02d}" + "!" * 17
    if i in (0, 5):
      r += "!" * 30
    if i == 9:
      p += "?" * 50
    lines.append(json.dumps({"prompt": p, "response": r}))
  path = tmp_path / "sft.jsonl"
  path.write_text("\n".join(lines) + "\n")
  return ["data.format=sft", f"data.source={path}", "data.seq_len=63", "model.max_seq_len=64", "data.packing=document",
          "data.val_fraction=0.25", "train.batch_size=8", "model.num_layers=1", "model.d_model=32", "model.num_heads=2",
          "model.num_kv_heads=2", "model.head_dim=16", "train.log_every=1", "train.eval_batches=1",
          "train.eval_every=0", "checkpoint.every=100"]


def test_sft_epochs_bound_the_iterator_and_the_steps(tmp_path):
  """train.epochs=1: 17 rows // 8 per batch = 2 whole batches, then StopIteration (the rows of a partial batch left
  out; two processes get a batch each per step, and equally many); epoch_steps gives the same count (train.steps 0
  becomes it); the counts say 2 truncated and 1 dropped of 18."""
  from sinkjax.data import sft
  cfg = load_config(TINY, _sft_corpus(tmp_path))
  tok = build_tokenizer(cfg.data)
  counts = {}
  it = sft.make_sft_iterator(cfg.data, tok, batch_size=8, epochs=1, process_index=0, process_count=1, counts=counts)
  batches = list(it)
  assert len(batches) == 2 == sft.epoch_steps(cfg.data, tok, batch_size=8, epochs=1)
  assert counts == {"documents": 18, "truncated": 2, "dropped": 1, "rows": 17}
  rows = [tuple(r) for b in batches for r in b["inputs"]]
  assert len(set(rows)) == 16                               # no row twice within the pass
  two = [list(sft.make_sft_iterator(cfg.data, tok, batch_size=4, epochs=3, process_index=i, process_count=2))
         for i in range(2)]
  assert len(two[0]) == len(two[1]) == 3 * 17 // 8 == sft.epoch_steps(cfg.data, tok, batch_size=8, epochs=3)
  assert sft.truncation_note(counts, 63) == (
      "sinkjax.data.sft: 2 of 18 training examples longer than data.seq_len + 1 = 64 tokens, truncated; 1 dropped "
      "(no response token within the row); raise data.seq_len to keep them whole")


@pytest.mark.slow      # ~50 s on the shared 2-core machine: a compile of train + eval steps on 8 devices
def test_sft_epochs_end_the_run_with_a_checkpoint(tmp_path, capsys, compile_cache):
  """train.epochs=2 with train.steps=7: the data runs out after 2 x 17 // 8 = 4 steps; the run ends there with a
  checkpoint (evaluated, logged) and says so; the truncation line is printed once and the summary counts. A text run
  refuses train.epochs."""
  run = tmp_path / "two"
  s = train(load_config(TINY, _sft_corpus(tmp_path) + ["train.epochs=2", "train.steps=7", f"run.dir={run}"]),
            progress=False)
  out = capsys.readouterr().out
  assert s["end_step"] == 4 and s["val_bpb"] is not None
  assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4]
  assert "train.epochs=2 pass(es) over the training examples end at step 4 of 7; checkpoint at step 4" in out
  assert sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()) == [4]
  assert s["sft_examples"] == {"documents": 18, "truncated": 2, "dropped": 1, "rows": 17}
  assert len([l for l in out.splitlines() if l.startswith("sinkjax.data.sft: 2 of 18 training examples")]) == 1
  from sinkjax.config import ConfigError
  with pytest.raises(ConfigError, match="train.epochs applies to data.format=sft"):
    train(load_config(TINY, SMALL + ["train.epochs=1", f"run.dir={tmp_path / 'text'}"]), progress=False)


@pytest.mark.slow      # a CLI-free training run: ~40 s on the shared 2-core machine
def test_a_run_with_val_source_says_when_its_data_repeats(tmp_path, capfd, compile_cache):
  """A training run on a small data.source with data.val_source: validation BPB is measured on the val file, and the
  stderr carries exactly one second-epoch line (the 6 documents, 138 tokens with their BOS, fill 4 rows of 33; 8 steps
  x 16 rows read them about 30 times)."""
  import json
  train_f, val_f = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
  train_f.write_text("".join(json.dumps({"text": f"document {i} " * 2}) + "\n" for i in range(6)))
  val_f.write_text(json.dumps({"text": "held out text " * 8}) + "\n")
  s = train(load_config(TINY, SMALL + ["train.steps=8", f"data.source={train_f}", f"data.val_source={val_f}",
                                       "data.packing=stream", f"run.dir={tmp_path / 'run'}"]), progress=False)
  err = capfd.readouterr().err
  lines = [l for l in err.splitlines() if "second epoch" in l]
  assert len(lines) == 1 and "every one of the 6 blocks of 1 file(s)" in lines[0], err
  assert s["val_bpb"] is not None
