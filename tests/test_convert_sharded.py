"""Importing a Hugging Face checkpoint onto a mesh: each parameter read alone from the safetensors and placed straight
into its training sharding (sinkjax.convert.place), checked on the 8 CPU devices of the test session (conftest.py).

Tiny random transformers models (a Llama, and a GPT-OSS for the stacked expert tensors, fused gate/up split, biases
and sinks) are saved as safetensors and imported with mesh.fsdp=8. The references: the sharding rule written out by
hand (every kernel and the embedding split 8 ways along d_model, biases / norm scales / sinks whole), the sizes of the
checkpoint's tensors read from the safetensors headers, transformers' logits and the one-device import's.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import randomize_hf_weights

torch = pytest.importorskip("torch", reason="oracle tests need torch: pip install -e \".[oracle]\" (CPU build, see README)")
transformers = pytest.importorskip("transformers", reason="oracle tests need transformers: pip install -e \".[oracle]\"")
safetensors = pytest.importorskip("safetensors")

from sinkjax import sharding as sharding_lib  # noqa: E402
from sinkjax.config import MeshConfig  # noqa: E402
from sinkjax.convert import hf as convert_hf  # noqa: E402
from sinkjax.run import load_run  # noqa: E402

VOCAB = 256          # the embedding and LM head are then the Llama's largest tensors
D_MODEL = 64
FSDP8 = MeshConfig(data=1, fsdp=8, tensor=1)


def _hf_config(family: str):
  common = dict(vocab_size=VOCAB, hidden_size=D_MODEL, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128)
  if family == "llama":
    return transformers.LlamaConfig(**common, intermediate_size=96, rms_norm_eps=1e-5, tie_word_embeddings=False)
  common["num_hidden_layers"] = 1         # one compile of an MoE forward costs seconds; placement is per tensor
  return transformers.GptOssConfig(**common, intermediate_size=48, head_dim=16, num_local_experts=4,
                                   num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.5,
                                   rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0,
                                                     original_max_position_embeddings=32))


@pytest.fixture(scope="module", params=["llama", "gpt_oss"])
def hf_model(request, tmp_path_factory):
  """(directory, transformers model) of a tiny randomized checkpoint saved as safetensors."""
  torch.manual_seed(0)
  model = transformers.AutoModelForCausalLM.from_config(_hf_config(request.param)).eval()
  randomize_hf_weights(model)
  path = tmp_path_factory.mktemp(request.param)
  model.save_pretrained(path, safe_serialization=True)
  return path, model


def _checkpoint_tensor_bytes(path) -> dict[str, int]:
  """{name: bytes} of every tensor of the saved checkpoint, from the safetensors header (float32: 4 per element)."""
  out = {}
  for f in path.glob("*.safetensors"):
    with safetensors.safe_open(str(f), "np") as h:
      for name in h.keys():
        s = h.get_slice(name)
        assert s.get_dtype() == "F32"
        out[name] = 4 * int(np.prod(s.get_shape()))
  return out


def _tokens(seed=0):
  return np.random.default_rng(seed).integers(0, VOCAB, (2, 11))


def _logits(model, tokens):
  graphdef, state = nnx.split(model)
  mesh = sharding_lib.mesh_of(state)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    return np.asarray(jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))(state, jnp.asarray(tokens)))


def _hf_logits(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens)).logits.float().numpy()


def _split_by_hand(path) -> bool:
  """FSDP as training does it, written out: every weight matrix (a kernel, the embedding) is split along d_model;
  biases, norm scales and sinks stay whole."""
  return path[-1].endswith("kernel") or path[-1] == "embedding"


def test_fsdp8_import_holds_an_eighth_per_device_and_one_tensor_on_the_host(hf_model):
  path, ref = hf_model
  model, info = convert_hf.place_hf(path, mesh=FSDP8)
  params = nnx.to_flat_state(nnx.state(model, nnx.Param))
  devices = sorted(d.id for d in jax.devices())
  assert len(devices) == 8 and info.mesh == {"data": 1, "fsdp": 8, "tensor": 1}
  want = dict.fromkeys(devices, 0)
  for p, var in params:
    x = var.get_value()
    held = {s.device.id: s.data.nbytes for s in x.addressable_shards}
    assert sorted(held) == devices, p
    share = x.nbytes // 8 if _split_by_hand(p) else x.nbytes
    if _split_by_hand(p):
      assert D_MODEL in x.shape and x.nbytes % 8 == 0, p
    assert set(held.values()) == {share}, (p, x.shape, x.sharding.spec)
    for d in devices:
      want[d] += share
  assert info.device_bytes == want                       # the loader's own accounting = the arrays' shardings
  total = sum(v.get_value().nbytes for _, v in params)
  whole = sum(v.get_value().nbytes for p, v in params if not _split_by_hand(p))
  assert info.param_bytes == total and info.device_peak_bytes <= (total - whole) / 8 + whole
  # the host held one checkpoint tensor at a time: the largest one (transposes and the fused gate/up split are views)
  sizes = _checkpoint_tensor_bytes(path)
  assert info.host_peak_bytes == max(sizes.values()) < sum(sizes.values()) / 3
  assert info.host_peak_tensor in {n for n, b in sizes.items() if b == max(sizes.values())}
  # the model it made: transformers' logits, and the one-device import's
  tokens = _tokens()
  ours = _logits(model, tokens)
  np.testing.assert_allclose(ours, _hf_logits(ref, tokens), atol=1e-4, rtol=0)
  one = convert_hf.place_hf(path)
  assert one.info.mesh is None and set(one.info.device_bytes.values()) == {total}
  np.testing.assert_allclose(ours, _logits(one.model, tokens), atol=1e-5, rtol=0)


def test_cli_import_onto_fsdp8_writes_a_run_that_restores_sharded(hf_model, tmp_path, capsys):
  """python -m sinkjax.convert.hf --hf-dir D --out RUN mesh.data=1 mesh.fsdp=8: the run records the mesh, the
  summary line says what each device and the host held, and load_run(mesh="run") restores the weights sharded."""
  path, ref = hf_model
  if "llama" not in path.name:
    pytest.skip("one family suffices for the command line")
  run = tmp_path / "run"
  assert convert_hf.main(["--hf-dir", str(path), "--out", str(run), "--dtype", "float32", "mesh.data=1",
                          "mesh.fsdp=8"]) == 0
  line = capsys.readouterr().out.strip().splitlines()[-1]
  sizes = _checkpoint_tensor_bytes(path)
  assert "mesh data=1 fsdp=8 tensor=1" in line and f"at most {max(sizes.values()):,} bytes at once" in line
  model, cfg, _, _ = load_run(run, mesh="run")
  assert (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor) == (1, 8, 1)
  for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    x = var.get_value()
    want = x.nbytes // 8 if _split_by_hand(p) else x.nbytes
    assert {s.data.nbytes for s in x.addressable_shards} == {want}, p
  tokens = _tokens(seed=1)
  np.testing.assert_allclose(_logits(model, tokens), _hf_logits(ref, tokens), atol=1e-4, rtol=0)
  capsys.readouterr()
  assert convert_hf.main(["--hf-dir", str(path), "--out", str(tmp_path / "r2"), "model.d_model=8"]) != 0
  err = capsys.readouterr().err.strip()
  assert "mesh.* overrides only" in err and "\n" not in err


def test_bfloat16_parameters_are_converted_as_each_tensor_is_read(hf_model):
  """model.param_dtype=bfloat16: every placed parameter is the float32 checkpoint value rounded to bfloat16, and the
  host held the largest float32 tensor and its bfloat16 copy, for a moment, at most."""
  path, _ = hf_model
  model, info = convert_hf.place_hf(path, mesh=FSDP8, param_dtype="bfloat16")
  f32 = dict(nnx.to_flat_state(nnx.state(convert_hf.load_hf(path), nnx.Param)))
  for p, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    x = var.get_value()
    assert x.dtype == jnp.bfloat16, p
    np.testing.assert_array_equal(np.asarray(x), np.asarray(f32[p].get_value()).astype(jnp.bfloat16), err_msg=str(p))
  largest = max(_checkpoint_tensor_bytes(path).values())
  assert info.host_peak_bytes == largest + largest // 2
  assert info.param_bytes == sum(v.get_value().nbytes for _, v in f32.items()) // 2


@pytest.mark.slow    # a 2-process job (launch/local.sh, jax.distributed over 127.0.0.1 with gloo): ~30-60 s
def test_two_process_import_writes_one_run_that_restores(hf_model, tmp_path):
  """2 processes x 4 devices, mesh.fsdp=8: each process fills its own devices' shards, one summary line (process 0),
  and the checkpoint Orbax writes from the sharded arrays restores to transformers' logits."""
  from tests.test_multihost import Launch, _lines
  path, ref = hf_model
  if "llama" not in path.name:
    pytest.skip("one family suffices for the multi-process job")
  run = tmp_path / "run"
  job = Launch(tmp_path, ["--hf-dir", str(path), "--out", str(run), "--dtype", "float32", "mesh.data=1",
                          "mesh.fsdp=8"], module="sinkjax.convert.hf")
  try:
    rc, stdout, stderr = job.wait(timeout=400)
  finally:
    if job.proc.poll() is None:
      job.stop()
  assert rc == 0, stderr
  assert len([l for l in _lines(stdout, "[p0]") if l.startswith("imported")]) == 1, stdout
  assert not [l for l in _lines(stdout, "[p1]") if l.startswith("imported")], stdout
  model, cfg, _, _ = load_run(run, mesh="run")
  assert (cfg.mesh.data, cfg.mesh.fsdp) == (1, 8)
  tokens = _tokens(seed=2)
  np.testing.assert_allclose(_logits(model, tokens), _hf_logits(ref, tokens), atol=1e-4, rtol=0)
