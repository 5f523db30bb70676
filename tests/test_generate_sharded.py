"""Generating where a model trained: `sinkjax.generate`'s Generator and lm_eval's generation on a mesh, the KV cache
split over rows and heads, and `sinkjax.compile --decode` compiling the Generator's own decode step.

The test session has 8 CPU devices (conftest.py). The run is test_eval_sharded's tiny random sink-attention model
(2 KV heads). The reference for every generated token is independent of the cache: greedy decoding by a full causal
forward pass over each row's whole sequence so far (rows right-padded; causal attention keeps the padding out of the
positions read). The cache's per-device bytes are checked against its shapes divided by hand.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from sinkjax import generate as gen
from sinkjax import sharding as sharding_lib
from sinkjax.cache import KVCache
from sinkjax.config import MeshConfig
from sinkjax.run import load_run
from tests.test_eval_sharded import FSDP8, one_device, reference, run_dir, sharded  # noqa: F401  (fixtures)

DATA4_TENSOR2 = ["mesh.data=4", "mesh.fsdp=1", "mesh.tensor=2"]
PROMPTS = ["the sink holds what", "while other heads attend to the words", "the", "gate lets through",
           "words before the sink holds", "other heads", "the gate lets through while other", "attend"]


@pytest.fixture(scope="module")
def data_tensor(run_dir):  # noqa: F811
  """The run restored on a data=4 x tensor=2 mesh (heads and MLP split over tensor)."""
  return load_run(run_dir, overrides=DATA4_TENSOR2, mesh="run")


@nnx.jit
def _forward(model, tokens):
  return model(tokens)


def greedy_reference(model, prompts: list[list[int]], n: int) -> list[list[int]]:
  """n greedy tokens after each prompt by full forward passes (no cache): the argmax at each row's last position."""
  seqs = [list(p) for p in prompts]
  width = max(map(len, seqs)) + n
  for _ in range(n):
    x = np.zeros((len(seqs), width), np.int32)
    for r, s in enumerate(seqs):
      x[r, :len(s)] = s
    logits = np.asarray(_forward(model, jnp.asarray(x)))
    for r, s in enumerate(seqs):
      s.append(int(logits[r, len(s) - 1].argmax()))
  return [s[len(p):] for s, p in zip(seqs, prompts)]


def on_mesh(model, mesh):
  """The model whole on every device of `mesh`."""
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, jax.device_put(state, sharding_lib.replicated(mesh)))


def cache_specs(cache) -> set:
  return {x.sharding.spec for x in cache.k + cache.v}


@pytest.mark.parametrize("mesh_cfg,rows_spec,heads", [
    (MeshConfig(data=1, fsdp=8, tensor=1), ("data", "fsdp"), 1),       # rows over fsdp
    (MeshConfig(data=4, fsdp=1, tensor=2), ("data", "fsdp"), 2),       # rows over data, KV heads over tensor
])
def test_the_cache_is_split_over_rows_and_kv_heads(reference, mesh_cfg, rows_spec, heads):  # noqa: F811
  """8 rows on an 8-device mesh: each device holds 1/8 of every key / value array (rows / (data x fsdp), KV heads /
  tensor), + the 4-byte counter; placed when created and after prefill and decode steps."""
  model, _, _, _ = reference
  mesh = sharding_lib.make_mesh(mesh_cfg)
  g = gen.Generator(on_mesh(model, mesh), capacity=24, batch=8)
  cache = g.new_cache()
  m = model.cfg
  whole = 2 * m.num_layers * 8 * 24 * m.num_kv_heads * m.head_dim * 4          # by hand, float32
  assert cache.kv_bytes == whole
  axes = tuple(a for a in rows_spec if mesh.shape[a] > 1)
  want = P(axes, None, "tensor") if heads > 1 else P(axes)
  assert cache_specs(cache) == {want}
  held = sharding_lib.bytes_per_device(cache)
  assert sorted(held) == sorted(d.id for d in jax.devices())
  assert max(held.values()) <= whole / 8 + 4 and g.cache_bytes_per_device() == max(held.values())
  seen = []
  g.generate_batch([[1, 2, 3]] * 8, 3, temperature=0.0, on_step=lambda c: seen.append(cache_specs(c)))
  assert seen == [{want}, {want}]                       # the decode step kept the placement
  _, _, after = g.prefill_fn(g.state, g.new_cache(), g._put(np.ones((8, 3), np.int32), rows=True),  # pylint: disable=protected-access
                             g._put(np.asarray(jax.random.PRNGKey(0))), *g._knobs(0.0, 0, 1.0))  # pylint: disable=protected-access
  assert cache_specs(after) == {want}


def test_a_cache_the_mesh_does_not_divide_stays_whole(reference):  # noqa: F811
  """3 rows on 8 batch shards, 2 KV heads on tensor=4: those dimensions stay whole (no error); the divisible rest
  is still split."""
  model, _, _, _ = reference
  mesh = sharding_lib.make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
  assert cache_specs(gen.Generator(model, capacity=8, batch=3, mesh=mesh).new_cache()) == {P()}
  assert cache_specs(gen.Generator(model, capacity=8, batch=4, mesh=mesh).new_cache()) == {P(("data",))}
  abstract = gen.Generator(model, capacity=8, batch=4, mesh=mesh).abstract_cache()
  assert isinstance(abstract, KVCache) and {x.sharding.spec for x in abstract.k} == {P(("data",))}


@pytest.mark.parametrize("placed", ["fsdp8", pytest.param("data4_tensor2", marks=pytest.mark.slow)])
def test_greedy_rows_on_the_mesh_equal_one_device_and_the_full_forward(reference, sharded, data_tensor,  # noqa: F811
                                                                        placed):
  """8 prompts of different lengths as one batch (rows split over the mesh): every row's greedy tokens equal those
  of the model on one device, generated one prompt at a time, and the full-forward reference."""
  model, _, tok, _ = reference
  run = {"fsdp8": sharded, "data4_tensor2": data_tensor}[placed]
  prompts = [tok.encode_document(p) for p in PROMPTS]
  assert len(set(map(len, prompts))) > 4
  n = 6
  got = gen.Generator(run.model, capacity=max(map(len, prompts)) + n, batch=8).generate_batch(
      prompts, n, temperature=0.0)
  want = greedy_reference(model, prompts, n)
  assert got == want
  one = gen.Generator(model, capacity=max(map(len, prompts)) + n)
  assert [one.generate(p, n, temperature=0.0) for p in prompts[:2]] == want[:2]


@pytest.mark.slow   # lm-eval's twin (~15 s) of the greedy rows on the mesh above
def test_lm_eval_generation_and_loglikelihoods_batched_on_the_mesh_equal_one_device(run_dir, reference):  # noqa: F811
  """lm_eval's generate_until with mesh.data=4 mesh.tensor=2, 8 requests as one batch (`until` strings, different
  lengths): the texts the one-device model gives one request at a time, which are the full-forward reference's;
  the log-likelihoods of the same mesh as one device's (f32, 1e-5)."""
  from lm_eval.api.instance import Instance
  from sinkjax import lm_eval as sj
  model, cfg, tok, _ = reference
  lm = sj.SinkjaxLM(checkpoint=str(run_dir), overrides=DATA4_TENSOR2, batch_size=8)
  assert dict(lm.mesh.shape) == {"data": 4, "fsdp": 1, "tensor": 2}
  ref = sj.SinkjaxLM.from_model(model, cfg, tok, batch_size=1, mesh=one_device())
  reqs = [Instance("generate_until", {}, (p, {"until": ["gate"] if i % 3 == 0 else [], "max_gen_toks": 5}), i)
          for i, p in enumerate(PROMPTS)]
  got = lm.generate_until(reqs, disable_tqdm=True)
  assert got == ref.generate_until(reqs, disable_tqdm=True)
  full = greedy_reference(model, [lm.tok_encode(p) for p in PROMPTS], 5)
  for i, (text, toks) in enumerate(zip(got, full)):
    whole = tok.decode(toks)
    assert text == (whole.split("gate")[0] if i % 3 == 0 else whole), (i, text, whole)
  pairs = [("the sink holds", " what the gate"), ("while other heads attend to", " the words"), ("the", " sink")]
  ll = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
  for (a, ga), (b, gb) in zip(lm.loglikelihood(ll, disable_tqdm=True), ref.loglikelihood(ll, disable_tqdm=True)):
    assert a == pytest.approx(b, abs=1e-5) and ga == gb and math.isfinite(a)


@pytest.mark.slow    # a 2-process job: ~1-2 min on a busy 2-core CPU
def test_two_process_generate_gives_the_one_device_tokens_and_prints_once(run_dir, reference, tmp_path):  # noqa: F811
  """launch/local.sh --module sinkjax.generate -- generate ... mesh.fsdp=8 with 8 prompts (one row each, split over the 8
  devices of 2 processes): process 0 prints every prompt's continuation, the full-forward reference's greedy tokens,
  and the summary line; process 1 prints nothing."""
  from tests.test_multihost import Launch, _lines
  args = ["generate", "--checkpoint", str(run_dir), "--max-new-tokens", "5", "--temperature", "0", "--no-stop", *FSDP8]
  for p in PROMPTS:
    args += ["--prompt", p]
  job = Launch(tmp_path, args, module="sinkjax.generate")
  try:
    rc, stdout, stderr = job.wait(timeout=400)
  finally:
    if job.proc.poll() is None:
      job.stop()
  assert rc == 0, stderr
  model, _, tok, _ = reference
  want = greedy_reference(model, [tok.encode_document(p) for p in PROMPTS], 5)
  p0 = _lines(stdout, "[p0]")
  for p, toks in zip(PROMPTS, want):
    assert p + tok.decode(toks, skip_special_tokens=False) in p0, (p, p0)
  assert sum(l.startswith("[8 rows, 40 tokens in ") for l in p0 + _lines(stderr, "[p0]")) == 1, (stdout, stderr)
  assert not [l for l in _lines(stdout, "[p1]") + _lines(stderr, "[p1]") if l.startswith("[8 rows") or
              any(p in l for p in PROMPTS)]


# ---------------------------------------------------------------------------------------------------------------
# sinkjax.compile --decode / --eval lower the functions generate and eval run
# ---------------------------------------------------------------------------------------------------------------

def test_compile_decode_lowers_the_generators_own_step(run_dir, sharded):  # noqa: F811
  """`sinkjax.compile`'s decode lowering (abstract parameters placed as load_run places them) is the Generator's
  `decode_fn` itself, and its HLO text is that of the step generate runs on the loaded run (fsdp=8, 8 rows)."""
  from sinkjax import compile as compile_lib
  mesh = sharding_lib.mesh_of(nnx.state(sharded.model, nnx.Param))
  g, lowered = compile_lib.decode_program(sharded.cfg, mesh, rows=8, capacity=16)
  assert isinstance(g, gen.Generator) and g.decode_fn.__wrapped__.func is gen.decode_step
  run_gen = gen.Generator(sharded.model, capacity=16, batch=8)
  with jax.set_mesh(mesh):
    concrete = run_gen.decode_fn.lower(run_gen.state, run_gen.new_cache(), run_gen._put(np.zeros(8, np.int32), True),  # pylint: disable=protected-access
                                       run_gen._put(np.asarray(jax.random.PRNGKey(0))), *run_gen._knobs(0.0, 0, 1.0))  # pylint: disable=protected-access
  assert lowered.as_text() == concrete.as_text()
  assert lowered.as_text() == run_gen.lower_decode().as_text()


def test_compile_eval_lowers_the_function_eval_runs(run_dir, sharded):  # noqa: F811
  """`sinkjax.compile --eval ROWS` lowers `sinkjax.eval`'s own batch function for the placed model and a batch split
  over the batch axes: the HLO text of eval's call on the loaded run (fsdp=8) and its placed batches."""
  from sinkjax import compile as compile_lib
  from sinkjax import eval as ev
  from sinkjax.data import make_eval_batches
  mesh = sharding_lib.mesh_of(nnx.state(sharded.model, nnx.Param))
  batch = ev.place_batches(make_eval_batches(sharded.cfg.data, sharded.tokenizer, batch_size=8, num_batches=1),
                           mesh)[0]
  with jax.set_mesh(mesh):
    concrete = ev._lm_batch_jit.lower(sharded.model, batch)  # pylint: disable=protected-access
  assert compile_lib.eval_program(sharded.cfg, mesh, 8).as_text() == concrete.as_text()
