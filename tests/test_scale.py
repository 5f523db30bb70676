"""Scale out and never lose a run: logical-axis sharding rules, the same losses on every mesh, checkpoints that
move between device counts, kill -9 in the middle of training, a corrupted latest checkpoint, a failed write.

tests/test_train.py covers exact resume, SIGTERM and non-finite steps; this file does not repeat them. The pytest
process has 8 CPU devices (conftest.py); single-device runs go to subprocesses. Shapes are tiny (2-core CPU).
"""
import errno
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from sinkjax import optim
from sinkjax import sharding as sharding_lib
from sinkjax.config import MeshConfig, load_config
from sinkjax.model import Transformer
from sinkjax.train import train
from tests.helpers import ROOT, TINY, command_env, losses, start_command

# vocab 260 (>= the byte tokenizer's 257) divides the tensor axis, so the vocab rule is exercised.
SMALL = ["model.num_layers=1", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=16",
         "model.vocab_size=260", "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=8",
         "train.log_every=1", "train.eval_batches=0", "checkpoint.every=100", "loss.aux_weight=0.0001"]
MESHES = [(8, 1, 1), (2, 2, 2), (1, 4, 2)]


def cli(args, extra, devices=1):
  return start_command("sinkjax.train", *args, env={**extra, "PYTHONWARNINGS": "default"}, devices=devices)


def py(code, extra, devices=1):
  return subprocess.run([sys.executable, "-c", code], cwd=ROOT, text=True, capture_output=True, timeout=300,
                        env=command_env({**extra, "PYTHONWARNINGS": "default"}, devices))


def _mesh_ov(m):
  return [f"mesh.data={m[0]}", f"mesh.fsdp={m[1]}", f"mesh.tensor={m[2]}"]


def _steps(run_dir):
  d = pathlib.Path(run_dir) / "checkpoints"
  return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


# ------------------------------------------------------------------------------------------------------------
# Rules
# ------------------------------------------------------------------------------------------------------------

def test_param_spec_rules():
  """Each parameter's logical axes, named where it is created, map to the mesh by LOGICAL_RULES."""
  ms = {"data": 2, "fsdp": 2, "tensor": 2}
  spec = lambda axes, shape, m=ms: sharding_lib.mesh_spec(axes, shape, m)
  assert spec(("vocab", "embed"), (260, 32)) == P("tensor", "fsdp")
  assert spec(("vocab", "embed"), (257, 32)) == P(None, "fsdp")          # vocab not divisible: left whole
  assert spec(("expert", "embed", "mlp"), (4, 32, 64)) == P(None, "fsdp", "tensor")
  assert spec(None, (2,)) == P() and spec(None, ()) == P()
  assert spec(("vocab", "embed"), (260, 32), None) == P("tensor", "fsdp")  # no mesh shape: rules only
  cfg = load_config(TINY, SMALL + ["model.attention=gated", "model.gate_shared=true", "model.sink_tokens=2"])
  cfg.model.vocab_size = 260
  model = nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0)))
  got = {"/".join(map(str, p)): sharding_lib.mesh_spec(sharding_lib.logical_axes(v), v.shape, ms)
         for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  assert got["embed/embedding"] == P("tensor", "fsdp") and got["lm_head/kernel"] == P("fsdp", "tensor")
  assert got["layers/0/attn/q_proj/kernel"] == P("fsdp", "tensor")
  assert got["layers/0/attn/o_proj/kernel"] == P("tensor", "fsdp")
  assert got["layers/0/mlp/down_proj/kernel"] == P("tensor", "fsdp")
  assert got["layers/0/attn/gate_proj/kernel"] == P("fsdp")              # one shared gate: not split
  assert got["layers/0/attn/sink_states"] == P(None, "fsdp")
  assert got["layers/0/attn/gate_proj/bias"] == P()                      # vectors are replicated

  # Optimizer-state leaves (optax keeps the params tree inside mu / nu) get their parameter's spec.
  cfg = load_config(TINY, SMALL)
  mesh = sharding_lib.make_mesh(MeshConfig(2, 2, 2))
  params = nnx.split(nnx.eval_shape(lambda: Transformer(cfg.model, rngs=nnx.Rngs(0))), nnx.Param, ...)[1]
  tx, _ = optim.build_optimizer(cfg, 10)
  sh = sharding_lib.state_shardings(mesh, jax.eval_shape(lambda: {"params": params, "opt_state": tx.init(params)}))
  by_path = {jax.tree_util.keystr(p): s.spec for p, s in jax.tree_util.tree_leaves_with_path(sh)}
  q = [v for k, v in by_path.items() if "q_proj" in k]
  assert len(q) >= 2 and all(s == P("fsdp", "tensor") for s in q), q   # the param and its momentum
  emb = [v for k, v in by_path.items() if "'embedding'" in k]
  assert len(emb) == 3 and all(s == P("tensor", "fsdp") for s in emb), emb   # param, mu, nu


# ------------------------------------------------------------------------------------------------------------
# Meshes
# ------------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mesh_runs(tmp_path_factory, compile_cache):
  """3 steps of the same tiny run on each mesh; the (1,1,1) one in a 1-device subprocess."""
  base = tmp_path_factory.mktemp("meshes")
  ov = SMALL + ["train.steps=3"]
  one = cli(["--config", TINY, *ov, *_mesh_ov((1, 1, 1)), f"run.dir={base / 'm111'}"], compile_cache)
  dirs = {(1, 1, 1): base / "m111"}
  for m in MESHES:
    dirs[m] = base / ("m" + "".join(map(str, m)))
    train(load_config(TINY, ov + _mesh_ov(m) + [f"run.dir={dirs[m]}"]), progress=False)
  out, err = one.communicate(timeout=300)
  assert one.returncode == 0, err
  return dirs


@pytest.mark.slow    # ~2 min on a 2-core CPU: four compilations of the step
def test_meshes_give_the_samelosses(mesh_runs):
  ref = losses(mesh_runs[(1, 1, 1)])
  assert [s for s, _ in ref] == [1, 2, 3]
  for m in MESHES:
    got = losses(mesh_runs[m])
    assert [s for s, _ in got] == [1, 2, 3], m
    np.testing.assert_allclose([l for _, l in got], [l for _, l in ref], rtol=2e-5, err_msg=str(m))


def test_parameters_are_sharded_by_the_rules():
  """On a (2,2,2) mesh, the trainer's shardings put each parameter where the rules say, and a step keeps them."""
  from sinkjax.step import make_train_step
  cfg = load_config(TINY, SMALL)
  mesh = sharding_lib.make_mesh(MeshConfig(2, 2, 2))
  model = Transformer(cfg.model, rngs=nnx.Rngs(0))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx, _ = optim.build_optimizer(cfg, 10)
  state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
           "rng": jax.random.PRNGKey(0), "nonfinite": jnp.zeros((), jnp.int32)}
  state_sh = sharding_lib.state_shardings(mesh, state)
  state = jax.device_put(state, state_sh)
  B, T = 8, 32
  batch = {"inputs": jnp.ones((B, T), jnp.int32), "targets": jnp.ones((B, T), jnp.int32),
           "segment_ids": jnp.ones((B, T), jnp.int32), "positions": jnp.tile(jnp.arange(T), (B, 1)),
           "loss_mask": jnp.ones((B, T), jnp.float32)}
  batch = jax.device_put(batch, sharding_lib.batch_sharding(mesh))
  step = jax.jit(make_train_step(cfg, graphdef, rest, tx), in_shardings=(state_sh, sharding_lib.batch_sharding(mesh)),
                 out_shardings=(state_sh, sharding_lib.replicated(mesh)))
  with jax.set_mesh(mesh):
    new, m = step(state, batch)
  assert bool(m["finite"])
  p = new["params"]
  assert p["embed"]["embedding"].value.sharding.spec == P("tensor", "fsdp")
  assert p["lm_head"]["kernel"].value.sharding.spec == P("fsdp", "tensor")
  attn, mlp = p["layers"][0]["attn"], p["layers"][0]["mlp"]
  assert attn["q_proj"]["kernel"].value.sharding.spec == P("fsdp", "tensor")
  assert attn["o_proj"]["kernel"].value.sharding.spec == P("tensor", "fsdp")
  assert mlp["down_proj"]["kernel"].value.sharding.spec == P("tensor", "fsdp")
  assert attn["sink"].value.sharding.spec == P()
  q = attn["q_proj"]["kernel"].value
  assert q.shape == (32, 32) and q.addressable_shards[0].data.shape == (16, 16)   # split 2 x 2
  assert len({s.device for s in q.addressable_shards}) == 8


# ------------------------------------------------------------------------------------------------------------
# Checkpoints across device counts
# ------------------------------------------------------------------------------------------------------------

_LOAD = ("import sys, json, numpy as np, jax\nfrom flax import nnx\nfrom sinkjax.run import load_run\n"
         "m, cfg, tok, _ = load_run(sys.argv[1] if len(sys.argv) > 1 else {d!r})\n"
         "print(len(jax.devices()), json.dumps([float(np.asarray(x, np.float64).sum()) "
         "for x in jax.tree.leaves(nnx.state(m, nnx.Param))]))\n")


def _param_sums(run_dir):
  from sinkjax.run import load_run
  m, _, _, _ = load_run(run_dir)
  return [float(np.asarray(x, np.float64).sum()) for x in jax.tree.leaves(nnx.state(m, nnx.Param))]


@pytest.mark.slow    # ~2 min on a 2-core CPU: four compilations of the step
def test_checkpoint_moves_between_device_counts(mesh_runs, tmp_path, compile_cache):
  import json
  # Saved on 8 devices ((2,2,2), sharded) -> loaded on 1.
  r = py(_LOAD.format(d=str(mesh_runs[(2, 2, 2)])), compile_cache, devices=1)
  assert r.returncode == 0, r.stderr
  n, sums = r.stdout.split(maxsplit=1)
  assert n == "1"
  np.testing.assert_allclose(json.loads(sums), _param_sums(mesh_runs[(2, 2, 2)]), rtol=1e-6)
  # Saved on 1 device -> loaded on 8, and the whole train state resumes on a (1,4,2) mesh.
  one = mesh_runs[(1, 1, 1)]
  np.testing.assert_allclose(_param_sums(one), _param_sums(mesh_runs[(8, 1, 1)]), rtol=1e-4, atol=1e-4)
  import shutil
  moved = tmp_path / "moved"
  shutil.copytree(one, moved)
  out = train(load_config(TINY, SMALL + ["train.steps=4", *_mesh_ov((1, 4, 2)), f"run.dir={moved}"]),
              progress=False)
  assert out["start_step"] == 3 and out["end_step"] == 4
  assert [s for s, _ in losses(moved)] == [1, 2, 3, 4]
  assert np.isfinite(losses(moved)[-1][1])


# ------------------------------------------------------------------------------------------------------------
# Never lose a run
# ------------------------------------------------------------------------------------------------------------

KILL_OV = ["model.num_layers=1", "model.d_model=32", "data.seq_len=32", "model.max_seq_len=32", "train.batch_size=4",
           "checkpoint.every=2", "checkpoint.async_save=true", "train.eval_batches=0", "train.log_every=1"]


def test_kill_9_resumes_from_the_last_complete_checkpoint(tmp_path, compile_cache):
  run_dir = tmp_path / "run"
  proc = cli(["--config", TINY, *KILL_OV, "train.steps=100000", f"run.dir={run_dir}"], compile_cache)
  try:
    deadline = time.time() + 240
    while time.time() < deadline and len(_steps(run_dir)) < 2 and proc.poll() is None:
      time.sleep(0.05)
    assert proc.poll() is None, proc.communicate()[1]
    assert len(_steps(run_dir)) >= 2, "no checkpoint appeared"
  finally:
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
  assert proc.returncode == -signal.SIGKILL
  complete = _steps(run_dir)            # Orbax renames a step into place only once it is complete
  last = complete[-1]
  target = last + 3
  again = cli(["--config", TINY, *KILL_OV, "train.steps=100000", f"train.stop_at_step={target}",
               f"run.dir={run_dir}"], compile_cache)       # the same schedule (train.steps), three more steps
  out, err = again.communicate(timeout=300)
  assert again.returncode == 0, err
  assert f"resuming from step {last}" in out, out
  assert f"done: step {target}/100000" in out, out
  assert [s for s, _ in losses(run_dir)] == list(range(1, target + 1))
  assert _steps(run_dir)[-1] == target


@pytest.mark.parametrize("item", ["params", pytest.param("train", marks=pytest.mark.slow)])  # the same path
def test_corrupted_latest_checkpoint_falls_back_with_a_warning(tmp_path, compile_cache, capfd, item):
  """Damaged array files in the newest checkpoint: the run resumes from the previous one and ends with the losses
  of an undisturbed run; the terminal gets one warning line naming both steps, and what TensorStore and asyncio
  printed about the damage (hundreds of lines) is kept in a log beside the set-aside step instead."""
  run_dir = tmp_path / "run"
  ov = SMALL + ["checkpoint.every=2", f"run.dir={run_dir}"]
  train(load_config(TINY, ov + ["train.steps=4"]), progress=False)
  assert _steps(run_dir) == [2, 4]
  # Every data file of the item. OCDBT appends: some `d/` files hold superseded b-tree versions that a restore never
  # reads, and which file is biggest depends on the writer threads' timing. Damaging only the biggest file let the
  # restore succeed (correctly: nothing it read was damaged) in a CI run; damaging one of those alone is harmless.
  victims = [p for p in (run_dir / "checkpoints" / "4" / item).rglob("*") if p.is_file() and p.parent.name == "d"]
  assert victims
  for victim in victims:
    data = bytearray(victim.read_bytes())
    data[len(data) // 3:] = b"\x07" * (len(data) - len(data) // 3)
    victim.write_bytes(bytes(data))
  capfd.readouterr()
  with pytest.warns(RuntimeWarning, match="resumed from checkpoint step 2: the newer step 4 .* could not be restored"):
    out = train(load_config(TINY, ov + ["train.steps=6"]), progress=False)
  printed = [l for l in capfd.readouterr().err.splitlines() if l.strip()]
  assert len(printed) <= 2, printed
  assert out["start_step"] == 2 and out["end_step"] == 6
  assert [s for s, _ in losses(run_dir)] == [1, 2, 3, 4, 5, 6]
  assert _steps(run_dir) == [2, 4, 6]   # step 4 written again; the damaged one set aside
  moved = [p for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("4.corrupt-")]
  assert len(moved) == 1 and "restoring checkpoint step 4 failed" in (moved[0] / "restore-errors.log").read_text()
  whole = tmp_path / "whole"
  train(load_config(TINY, SMALL + ["checkpoint.every=2", f"run.dir={whole}", "train.steps=6"]), progress=False)
  assert losses(run_dir) == losses(whole)


def test_failed_checkpoint_write_is_one_clear_line(tmp_path):
  from sinkjax import checkpoint as ckpt_lib
  cfg = load_config(TINY, SMALL)
  ck = ckpt_lib.Checkpointer(tmp_path, cfg.checkpoint)

  def full(*a, **k):
    raise RuntimeError("writer thread failed") from OSError(errno.ENOSPC, "No space left on device")

  ck.manager.save = full
  params = {"w": jnp.ones((2,))}
  with pytest.raises(ckpt_lib.CheckpointError, match="disk is full") as e:
    ck.save(2, params, {"step": jnp.zeros((), jnp.int32)}, None)
  assert "\n" not in str(e.value) and "step 2" in str(e.value)
  ck.manager.close()
