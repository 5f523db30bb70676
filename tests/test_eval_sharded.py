"""Evaluating where a model trained: a run loaded with `mesh.*` overrides holds each parameter in its training
placement (FSDP over d_model), and eval, generate and lm_eval on that mesh give the one-device answers.

The test session has 8 CPU devices (conftest.py). The model is a tiny random one (every parameter perturbed, so no
zero-initialized projection makes the outputs trivial), saved as a params-only run the way the converters write
one. The references are the same model restored onto a mesh of one device and run there, and, for the per-device
bytes, the parameter shapes divided by hand. The command-line generation, lm_eval's generation and the 2-process
jobs are marked slow (each compiles the model again or starts a job: 15 s to 2 min on a busy 2-core CPU).
"""
from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

from sinkjax import config as config_lib
from sinkjax import eval as ev
from sinkjax import generate as gen
from sinkjax import sharding as sharding_lib
from sinkjax.config import MeshConfig
from sinkjax.data import build_tokenizer, make_eval_batches
from sinkjax.model import Transformer
from sinkjax.run import load_run, save_params_run
from tests.helpers import TINY

FSDP8 = ["mesh.data=1", "mesh.fsdp=8"]
MODEL = ["model.num_layers=2", "model.d_model=32", "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=16",
         "model.max_seq_len=64", "data.seq_len=32", "model.dtype=float32", "model.attn_impl=reference",
         "train.batch_size=8", "train.eval_batches=2"]
WORDS = "the sink holds what the gate lets through while other heads attend to the words before".split()


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
  """A params-only run of a tiny random sink-attention model over a small JSONL corpus."""
  root = tmp_path_factory.mktemp("sharded_run")
  rng = np.random.default_rng(0)
  with open(root / "docs.jsonl", "w") as f:
    for _ in range(60):
      f.write(json.dumps({"text": " ".join(rng.choice(WORDS, size=int(rng.integers(8, 30))))}) + "\n")
  cfg = config_lib.load_config(TINY, MODEL + [f"data.source={root / 'docs.jsonl'}", "data.val_fraction=0.5"])
  cfg.model.vocab_size = build_tokenizer(cfg.data).vocab_size
  model = Transformer(cfg.model, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model, nnx.Param)
  keys = iter(jax.random.split(jax.random.key(1), len(jax.tree.leaves(params))))
  params = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape, x.dtype), params)
  save_params_run(root / "run", cfg, nnx.merge(graphdef, params))
  return root / "run"


def one_device() -> Mesh:
  return sharding_lib.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1])


@pytest.fixture(scope="module")
def reference(run_dir):
  """The run restored onto one device."""
  return load_run(run_dir, mesh=one_device())


@pytest.fixture(scope="module")
def sharded(run_dir):
  """The run restored with mesh.fsdp=8, as the command lines do with those overrides."""
  return load_run(run_dir, overrides=FSDP8, mesh="run")


def test_fsdp8_holds_an_eighth_of_the_matrices_per_device(run_dir, sharded):
  params = nnx.state(sharded.model, nnx.Param)
  leaves = jax.tree.leaves(params)
  assert dict(sharding_lib.mesh_of(params).shape) == {"data": 1, "fsdp": 8, "tensor": 1}
  # by hand: every matrix of this model has a d_model = 32 dimension, split 8 ways; vectors and scalars stay whole
  matrices = sum(x.nbytes for x in leaves if x.ndim >= 2)
  small = sum(x.nbytes for x in leaves if x.ndim < 2)
  assert matrices > 20 * small
  held = {}
  for x in leaves:
    for shard in x.addressable_shards:
      held[shard.device.id] = held.get(shard.device.id, 0) + shard.data.nbytes
  assert sorted(held) == sorted(d.id for d in jax.devices())
  for device, nbytes in held.items():
    assert nbytes <= matrices / 8 + small, (device, nbytes)
  assert sharding_lib.bytes_per_device(params) == held
  # the default placement (no mesh asked for): whole on every device
  whole = nnx.state(load_run(run_dir).model, nnx.Param)
  assert set(sharding_lib.bytes_per_device(whole).values()) == {matrices + small}


def test_eval_on_the_fsdp8_mesh_equals_one_device(run_dir, reference, tmp_path):
  """python -m sinkjax.eval --checkpoint RUN mesh.fsdp=8: val_bpb, importance and value zeroing as on one device;
  the report says where the weights lived."""
  out = tmp_path / "eval"
  assert ev.main(["--checkpoint", str(run_dir), "--out", str(out), *FSDP8]) == 0
  report = json.loads((out / "report.json").read_text())
  model, cfg, tok, _ = reference
  batches = make_eval_batches(cfg.data, tok, batch_size=8, num_batches=2)
  ref = ev.language_model_metrics(model, batches)
  assert report["eval_tokens"] == ref["eval_tokens"] > 0
  assert report["val_bpb"] == pytest.approx(ref["val_bpb"], abs=1e-5)
  np.testing.assert_allclose(report["importance"], ref["importance"], atol=1e-5)
  alpha = ev.sink_diagnostics(model, batches)["sink_ratio_alpha"]
  np.testing.assert_allclose(report["sink_ratio_alpha"], alpha, atol=1e-5)
  assert report["value_zeroing"]["bpb_all"] == pytest.approx(
      ev.zeroed_bpb(model, batches, np.ones_like(np.asarray(alpha), bool)), abs=1e-5)
  params = jax.tree.leaves(nnx.state(model, nnx.Param))
  total = sum(x.nbytes for x in params)
  assert report["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1} and report["processes"] == 1
  assert report["param_bytes"] == total
  assert report["param_bytes_per_device"] <= sum(x.nbytes for x in params if x.ndim >= 2) / 8 + \
      sum(x.nbytes for x in params if x.ndim < 2)
  assert report["peak_device_memory"] is None            # the CPU backend keeps no memory statistics


@pytest.mark.slow   # a twin (~10 s) of test_generate_sharded's greedy rows on the fsdp8 mesh
def test_greedy_generation_on_the_fsdp8_mesh_equals_one_device(reference, sharded):
  """The Generator (what `python -m sinkjax.generate` runs) gives the same greedy tokens on both placements."""
  model, _, tok, _ = reference
  prompt = tok.encode_document("the sink holds what")
  want = gen.Generator(model, capacity=len(prompt) + 12).generate(prompt, 12, temperature=0.0)
  with jax.set_mesh(sharding_lib.mesh_of(nnx.state(sharded.model, nnx.Param))):
    got = gen.Generator(sharded.model, capacity=len(prompt) + 12).generate(prompt, 12, temperature=0.0)
  assert got == want and len(want) == 12


@pytest.mark.slow    # a third load and compile of the model: ~40 s on a busy 2-core CPU
def test_generate_command_on_the_fsdp8_mesh_reports_where_the_weights_live(run_dir, reference, sharded, capfd):
  """python -m sinkjax.generate generate ... mesh.fsdp=8 generates on that mesh; its summary line names the mesh, the
  parameter bytes per device (as the arrays' shards hold them) and no peak memory (the CPU keeps no statistics)."""
  capfd.readouterr()
  assert gen.main(["generate", "--checkpoint", str(run_dir), "--prompt", "the sink holds what", "--max-new-tokens", "12",
                   "--temperature", "0", "--no-stop", *FSDP8]) == 0
  err = capfd.readouterr().err
  assert err.startswith("[12 tokens in "), err
  params = jax.tree.leaves(nnx.state(reference.model, nnx.Param))
  per_device = max(sharding_lib.bytes_per_device(nnx.state(sharded.model, nnx.Param)).values())
  assert per_device < sum(x.nbytes for x in params) / 4
  assert f"mesh {{'data': 1, 'fsdp': 8, 'tensor': 1}}, {per_device:,} parameter bytes per device, peak device " \
         "memory n/a]" in err, err


def test_lm_eval_loglikelihoods_on_the_fsdp8_mesh_equal_one_device(run_dir, reference):
  """SinkjaxLM with overrides mesh.fsdp=8 (as `python -m sinkjax.lm_eval ... mesh.fsdp=8` builds it): the
  log-likelihoods and greedy flags of a batch of requests as the model on one device gives them."""
  from sinkjax import lm_eval as sj
  model, cfg, tok, _ = reference
  lm = sj.SinkjaxLM(checkpoint=str(run_dir), overrides=FSDP8, batch_size=8)
  assert lm._placed and dict(lm.mesh.shape) == {"data": 1, "fsdp": 8, "tensor": 1}
  assert lm.get_model_info()["param_bytes_per_device"] < lm.get_model_info()["param_bytes"] / 4
  ref = sj.SinkjaxLM.from_model(model, cfg, tok, batch_size=8, mesh=one_device())
  texts = [("the sink holds", " what the gate"), ("while other heads attend to", " the words"),
           ("the", " sink"), ("lets through while", " other heads attend"), ("words before the", " gate")]
  reqs = [(None, tok.encode_document(c), tok.encode(x)) for c, x in texts]
  got, want = lm._loglikelihood_tokens(reqs, disable_tqdm=True), ref._loglikelihood_tokens(reqs, disable_tqdm=True)
  for (lp_g, greedy_g), (lp_w, greedy_w) in zip(got, want):
    assert lp_g == pytest.approx(lp_w, abs=1e-5) and greedy_g == greedy_w
  assert all(math.isfinite(lp) and lp < 0 for lp, _ in want)


@pytest.mark.slow    # prefill and decode compiled on both placements: ~40 s on a busy 2-core CPU
def test_lm_eval_generation_on_the_fsdp8_mesh_equals_one_device(run_dir, reference):
  """lm_eval's generate_until path (`_generate`) on the placed weights: the greedy tokens of one device."""
  from sinkjax import lm_eval as sj
  model, cfg, tok, _ = reference
  lm = sj.SinkjaxLM(checkpoint=str(run_dir), overrides=FSDP8)
  ref = sj.SinkjaxLM.from_model(model, cfg, tok, mesh=one_device())
  ids = tok.encode_document("the sink holds what")
  kw = dict(temperature=0.0, top_k=0, top_p=1.0)
  want = ref._generate(ids, 6, [], **kw)
  assert lm._generate(ids, 6, [], **kw) == want and len(want) > 0


# ---------------------------------------------------------------------------------------------------------------
# Two processes x 4 devices (launch/local.sh, jax.distributed over 127.0.0.1 with gloo), as the training test
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.slow    # a 2-process job: ~1-2 min on a busy 2-core CPU
def test_two_process_eval_gives_the_one_device_answer_and_one_report(run_dir, reference, tmp_path):
  from tests.test_multihost import Launch, _lines
  out = tmp_path / "eval"
  job = Launch(tmp_path, ["--checkpoint", str(run_dir), "--out", str(out), *FSDP8], module="sinkjax.eval")
  try:
    rc, stdout, stderr = job.wait(timeout=400)
  finally:
    if job.proc.poll() is None:
      job.stop()
  assert rc == 0, stderr
  p0 = [l for l in _lines(stdout, "[p0]") if l.startswith("sinkjax.eval:")]
  assert len(p0) == 1 and not [l for l in _lines(stdout, "[p1]") if l.startswith("sinkjax.eval:")], stdout
  report = json.loads((out / "report.json").read_text())
  assert report["processes"] == 2 and report["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
  model, cfg, tok, _ = reference
  ref = ev.language_model_metrics(model, make_eval_batches(cfg.data, tok, batch_size=8, num_batches=2))
  assert report["eval_tokens"] == ref["eval_tokens"]
  assert report["val_bpb"] == pytest.approx(ref["val_bpb"], abs=1e-5)
  np.testing.assert_allclose(report["importance"], ref["importance"], atol=1e-5)


@pytest.mark.slow    # a 2-process lm-eval job: ~1-2 min on a busy 2-core CPU
def test_two_process_lm_eval_gives_the_one_device_loglikelihoods_and_one_output(run_dir, reference, tmp_path):
  """python -m sinkjax.lm_eval --mc FILE mesh.fsdp=8 under the launcher: every choice's log-likelihood as the model
  on one device scores it; one results file, one table (process 0)."""
  from sinkjax import lm_eval as sj
  from tests.test_lm_eval import results_of, samples_of
  from tests.test_multihost import Launch, _lines
  items = [{"context": "the sink holds", "choices": [" what", " the gate", " words"], "label": 0},
           {"context": "while other heads", "choices": [" attend", " sink"], "label": 0},
           {"context": "the words before", "choices": [" the", " while other"], "label": 1}]
  mc = tmp_path / "toy.jsonl"
  mc.write_text("".join(json.dumps(i) + "\n" for i in items))
  out = tmp_path / "lm_eval"
  job = Launch(tmp_path, ["--checkpoint", str(run_dir), "--mc", str(mc), "--batch-size", "8", "--output-path",
                          str(out), "--log-samples", "--bootstrap-iters", "0", *FSDP8], module="sinkjax.lm_eval")
  try:
    rc, stdout, stderr = job.wait(timeout=500)
  finally:
    if job.proc.poll() is None:
      job.stop()
  assert rc == 0, stderr
  assert any("mc_toy" in l for l in _lines(stdout, "[p0]")) and not any("mc_toy" in l for l in _lines(stdout, "[p1]"))
  assert results_of(out)["results"]["mc_toy"]                # exactly one results file
  samples = samples_of(out)["mc_toy"]
  model, cfg, tok, _ = reference
  ref = sj.SinkjaxLM.from_model(model, cfg, tok, batch_size=8, mesh=one_device())
  for doc_id, item in enumerate(items):
    want = ref._loglikelihood_tokens([(None, *ref._encode_pair(item["context"], c)) for c in item["choices"]],
                                     disable_tqdm=True)
    got = [r[0] for r in samples[doc_id]["resps"]]
    assert len(got) == len(want)
    for (lp_g, greedy_g), (lp_w, greedy_w) in zip(got, want):
      assert float(lp_g) == pytest.approx(lp_w, abs=1e-5) and (greedy_g in (True, "True")) == greedy_w
