"""The real TPU compilers on compile-only devices (libtpu on this host, no TPU): the Pallas TPU kernel compiles with
Mosaic for every TPU generation, kernels follow the target rather than the host, and `sinkjax.compile` reports what
the compiler says (memory per chip, fits or not), measuring that rematerialization lowers temporaries.

Needs libtpu (`pip install 'sinkjax[tpu]'`; .ci/run adds it); skipped with the reason where it is absent."""
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # other JAX processes of this host may hold libtpu's lock
pytest.importorskip("libtpu", reason="libtpu not installed: pip install 'sinkjax[tpu]' (the TPU compile tests)")

from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from sinkjax import compile as compile_lib  # noqa: E402
from sinkjax.attention import gated_attention, sink_attention  # noqa: E402
from sinkjax.config import load_config  # noqa: E402
from sinkjax.kernels import BlockSizes, flash_attention  # noqa: E402
from tests.helpers import call_main  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny.yaml")
GENERATIONS = {"v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}


def _devices(name):
  return compile_lib.tpu_devices(compile_lib.parse_topology(name))


def test_topology_names():
  """Cloud TPU types count TensorCores on v4 / v5p (2 per chip) and chips on v5e / v6e."""
  cases = {"v5litepod-32": ("v5e:4x8", 16), "v5e:2x4": ("v5e:2x4", 16), "v4-32": ("v4:2x2x4", 32),
           "v5p-64": ("v5p:2x4x4", 95), "v6e-8": ("v6e:2x4", 32), "2xv5litepod-16": ("v5e:4x4", 16)}
  for text, (name, gib) in cases.items():
    t = compile_lib.parse_topology(text)
    assert (t.name, t.hbm_bytes) == (name, gib * 2 ** 30), text
  assert compile_lib.parse_topology("2xv5litepod-16").slices == 2
  for bad in ("v5litepod-3", "tpu-8", "v4-3"):
    with pytest.raises(compile_lib.CompileError, match="--topology"):
      compile_lib.parse_topology(bad)
  assert len(_devices("v5litepod-8")) == 8 and len(_devices("v4-16")) == 8      # one device per chip (megacore)


def _compiled_attention(devices, fn, B, T, S, Hq, Hkv, D, dtype=jnp.bfloat16, segments=False):
  """fn(q, k, v, seg) -> (out, lse) compiled forward + backward for the devices, under their mesh (batch split)."""
  mesh = Mesh(np.array(devices).reshape(len(devices), 1, 1), ("data", "fsdp", "tensor"))
  sh = NamedSharding(mesh, P("data"))
  args = [jax.ShapeDtypeStruct((B, T, Hq, D), dtype, sharding=sh), jax.ShapeDtypeStruct((B, S, Hkv, D), dtype, sharding=sh),
          jax.ShapeDtypeStruct((B, S, Hkv, D), dtype, sharding=sh),
          jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sh) if segments else None]

  def loss(q, k, v, seg):
    out, lse = fn(q, k, v, seg)
    return jnp.sum(out.astype(jnp.float32)) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0))

  with jax.set_mesh(mesh):
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*args).compile().as_text()


@pytest.mark.parametrize("gen", sorted(GENERATIONS))
def test_pallas_tpu_kernel_compiles_with_mosaic(gen):
  """Sink attention with GQA and segment ids, causal, head dim 128, forward + backward (through the LSE): Mosaic
  kernels in the program, no interpreter callbacks."""
  devices = _devices(GENERATIONS[gen])
  sink = jnp.zeros((8,), jnp.float32)
  hlo = _compiled_attention(devices, lambda q, k, v, seg: sink_attention(q, k, v, sink, segment_ids=seg,
                                                                          impl="pallas_tpu"),
                            len(devices), 256, 256, 8, 2, 128, segments=True)
  assert "tpu_custom_call" in hlo and "callback" not in hlo


@pytest.mark.parametrize("case", ["non-causal d64", "gated elementwise", "blocks 256/128", "float32 gqa 4:1"])
def test_pallas_tpu_kernel_variants_compile_on_v5e(case):
  devices = _devices("v5e:2x2")
  B, T, Hq, Hkv, D = 4, 256, 4, 4, 128
  if case == "non-causal d64":
    fn = lambda q, k, v, seg: flash_attention(q, k, v, causal=False, impl="pallas_tpu")
    D = 64
  elif case == "gated elementwise":
    fn = lambda q, k, v, seg: gated_attention(q, k, v, jnp.zeros(q.shape, jnp.float32), segment_ids=seg,
                                              impl="pallas_tpu")
  elif case == "blocks 256/128":
    blocks = BlockSizes(block_q=256, block_k=128, block_q_dkv=128, block_kv_dkv=256, block_q_dq=256, block_kv_dq=128)
    fn = lambda q, k, v, seg: flash_attention(q, k, v, segment_ids=seg, block_sizes=blocks, impl="pallas_tpu")
    T = 512
  else:
    fn = lambda q, k, v, seg: flash_attention(q, k, v, segment_ids=seg, impl="pallas_tpu")
    Hkv = 1
  hlo = _compiled_attention(devices, fn, B, T, T, Hq, Hkv, D, jnp.float32 if "float32" in case else jnp.bfloat16,
                            segments=True)
  assert "tpu_custom_call" in hlo and "callback" not in hlo


def test_auto_follows_the_target_not_the_host():
  """On this CPU host, impl="auto" under a mesh of TPU devices is the Mosaic kernel (not the interpreter, not xla);
  without a mesh it is the host's xla kernel."""
  assert jax.default_backend() == "cpu"
  hlo = _compiled_attention(_devices("v5e:2x2"), lambda q, k, v, seg: flash_attention(q, k, v, segment_ids=seg),
                            4, 256, 256, 4, 4, 128, segments=True)
  assert "tpu_custom_call" in hlo and "callback" not in hlo
  from sinkjax.kernels import default_impl
  assert default_impl() == "xla" and default_impl("tpu") == "pallas_tpu" and default_impl("gpu") == "pallas_gpu"


# One layer and AdamW keep each compile short; the structure (FSDP mesh, kernel, micro-batching) is the trainer's.
SMALL = ["model.num_layers=1", "train.optimizer=adamw", "model.d_model=128", "model.num_heads=2", "model.num_kv_heads=2", "model.head_dim=64",
         "data.seq_len=256", "model.max_seq_len=256", "model.vocab_size=257", "train.batch_size=8", "mesh.data=1"]


# Slow (two XLA:TPU compiles, ~21 s with the suite running): by default the command compiles and reports its numbers
# in test_a_config_that_cannot_fit_is_one_line_and_exit_1, and test_compile_speed checks the report against hand counts.
@pytest.mark.slow
@pytest.mark.parametrize("topology, chips", [("v5e:2x2", 4), ("v5e:2x4", 8)])
def test_compile_reports_what_the_compiler_says(tmp_path, topology, chips):
  """The CLI's table and JSON carry memory_analysis()'s numbers for the train step it built (checked against a
  separate compile of the same JittedSteps), per chip of a 4- and an 8-chip slice."""
  out = tmp_path / "r.json"
  r = subprocess.run([sys.executable, "-m", "sinkjax.compile", "--config", TINY, "--topology", topology, "--json",
                      str(out), "--no-eval", *SMALL, f"mesh.fsdp={chips}"], cwd=ROOT, capture_output=True, text=True,
                     timeout=600, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-2000:]
  rep = json.loads(out.read_text())
  assert rep["fits"] and rep["chips"] == chips and rep["mesh"] == {"data": 1, "fsdp": chips, "tensor": 1}
  assert rep["attention_kernel"] == "mosaic" and rep["tokens_per_chip_per_micro_step"] == 8 // chips * 256
  from sinkjax.train import JittedSteps
  from sinkjax import sharding
  cfg = load_config(TINY, SMALL + [f"mesh.fsdp={chips}"])
  program = JittedSteps(cfg, sharding.make_mesh(cfg.mesh, _devices(topology)))
  ma = program.lower()[0].compile().memory_analysis()
  b = rep["per_chip_bytes"]
  assert (b["arguments"], b["temporaries"], b["outputs"], b["aliased"]) == (
      ma.argument_size_in_bytes, ma.temp_size_in_bytes, ma.output_size_in_bytes, ma.alias_size_in_bytes)
  assert rep["num_params"] == program.num_params
  assert f"total {b['total'] / 2 ** 30:.2f} of 16.00" in r.stdout and "fits                         yes" in r.stdout


@pytest.mark.slow   # an XLA:TPU compile of the decode step (~18 s); the train step's is checked by default
def test_decode_step_compiles_and_holds_its_cache():
  """--decode ROWSxSLOTS compiles sinkjax.generate's decode step for the slice: its per-chip arguments hold this
  chip's share of the KV cache (2 x layers x rows / shards x slots x kv heads x head dim, in model.dtype) and this
  chip's share of the float32 weights (at most half of them on 4 chips) besides."""
  cfg = load_config(TINY, SMALL + ["mesh.fsdp=4", "model.num_layers=2"])
  rep = compile_lib.compile_config(cfg, compile_lib.parse_topology("v5e:2x2"), eval_step=False, decode=(8, 256))
  d = rep["decode_per_chip_bytes"]
  assert "error" not in d, d
  m = cfg.model
  kv = 2 * m.num_layers * (8 // 4) * 256 * m.num_kv_heads * m.head_dim * jnp.dtype(m.dtype).itemsize
  assert kv <= d["arguments"] <= kv + 4 * rep["num_params"] // 2, (d, kv)      # weights: FSDP-sharded over 4
  assert (rep["decode_rows"], rep["decode_capacity"]) == (8, 256)
  with pytest.raises(compile_lib.CompileError, match="ROWSxSLOTS"):
    compile_lib._decode_shape("8by512")
  # Each block's weights wait for its input (one optimization barrier per layer), so the compiler cannot gather
  # every layer's weights ahead (GPT-OSS-20B's decode on v5litepod-16: 21.4 -> 6.1 GiB of temporaries).
  from sinkjax import sharding
  from sinkjax.train import JittedSteps
  program = JittedSteps(cfg, sharding.make_mesh(cfg.mesh, _devices("v5e:2x2")))
  assert program.lower_decode(8, 256).as_text().count("stablehlo.optimization_barrier") == m.num_layers


def test_a_config_that_cannot_fit_is_one_line_and_exit_1(tmp_path):
  big = ["model.num_layers=1", "train.optimizer=adamw", "model.d_model=1024", "model.num_heads=8", "model.num_kv_heads=8",
         "model.head_dim=128", "data.seq_len=2048", "model.max_seq_len=2048", "model.vocab_size=32768",
         "train.batch_size=512", "mesh.data=1", "mesh.fsdp=4"]
  r = subprocess.run([sys.executable, "-m", "sinkjax.compile", "--config", TINY, "--topology", "v5e:2x2",
                      "--no-eval", *big], cwd=ROOT, capture_output=True, text=True, timeout=600,
                     env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 1, r.stderr[-2000:]
  err = [l for l in r.stderr.splitlines() if l.strip()]
  assert len(err) == 1 and "does not fit" in err[0] and "GiB per chip needed" in err[0], r.stderr[-2000:]
  assert "model.remat=true" in err[0] and "fits                         NO" in r.stdout


def test_user_errors_are_one_line(tmp_path, capsys):
  """(The command's main, called in this process: both errors come before any compile.)"""
  for args, needle in ((["--topology", "v9x-8"], "--topology 'v9x-8'"),
                       (["--topology", "v5e:2x2", "data.tokenizer=/nonexistent/tokenizer.json"], "model.vocab_size=")):
    r = call_main(compile_lib.main, ["--config", TINY, *args], capsys)
    err = [l for l in r.stderr.splitlines() if l.strip()]
    assert r.returncode == 1 and len(err) == 1 and needle in err[0], r.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ fine-tuning on TPU

FINETUNE_TPU = ("llama3", "qwen3", "qwen3_4b", "gptoss")        # the configs docs/TPU.md sizes for v5litepod-16


def _tpu_fit_settings() -> dict:
  """The key=value settings docs/TPU.md's fine-tuning compile command gives (what the configs must carry)."""
  text = (ROOT / "docs" / "TPU.md").read_text()
  cmd = text[text.index("**Fine-tuning on v5litepod-16**"):].split("`,", 1)[0]
  found = dict(w.split("=", 1) for w in cmd.split() if "=" in w and not w.startswith("train.init_from"))
  assert set(found) == {"model.scan_layers", "train.loss_chunk", "mesh.data", "mesh.fsdp"}, found
  return {**found, "model.remat": "true"}          # remat: every candidate of that search (--search sets the policy)


@pytest.mark.parametrize("name", FINETUNE_TPU)
def test_finetune_configs_carry_their_tpu_fit(name):
  """Each TPU fine-tuning config sets, itself, what docs/TPU.md says it needs to fit v5litepod-16."""
  cfg = load_config(str(ROOT / "configs" / f"finetune_{name}.yaml"))
  for key, want in _tpu_fit_settings().items():
    section, k = key.split(".")
    got = getattr(getattr(cfg, section), k)
    assert str(got).lower() == want.lower(), (name, key, got, want)


def test_finetune_config_compiles_from_its_own_model_section_without_the_import(tmp_path, capsys):
  """configs/finetune_qwen3_4b.yaml spells out Qwen3-4B, so `sinkjax.compile` sizes it with no imported run (one
  line says so) and compiles it with the config's own TPU settings: FSDP over every chip, scanned and rematerialized
  layers (the model shrunk to 2 layers x 128 and rows of 256 here, to compile in seconds; the full size is the slow
  test below). A config whose model section names no vocabulary still needs its import (one line). (The command's
  main, called in this process.)"""
  out, missing = tmp_path / "r.json", tmp_path / "not_imported"
  small = ["model.num_layers=2", "model.d_model=128", "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=32",
           "model.mlp_hidden=256", "model.vocab_size=1024", "data.seq_len=256", "train.batch_size=4",
           f"train.init_from={missing}", "data.tokenizer=bytes"]
  r = call_main(compile_lib.main, ["--config", str(ROOT / "configs/finetune_qwen3_4b.yaml"), "--topology", "v5e:2x2",
                                   "--no-eval", "--json", str(out), *small], capsys)
  assert r.returncode == 0, r.stderr[-2000:]
  assert f"train.init_from {missing} is not here (no config.yaml); sized from this config's model section" in r.stderr
  rep = json.loads(out.read_text())
  assert rep["fits"] and rep["mesh"] == {"data": 1, "fsdp": 4, "tensor": 1}
  assert rep["remat"] and rep["remat_policy"] == "save_out_proj" and rep["tokens_per_chip_per_micro_step"] == 256
  r = call_main(compile_lib.main, ["--config", str(ROOT / "configs/finetune_llama3.yaml"), "--topology", "v5e:2x2",
                                   f"train.init_from={missing}"], capsys)
  err = [l for l in r.stderr.splitlines() if l.strip()]
  assert r.returncode == 1 and len(err) == 1 and f"train.init_from {str(missing)!r}" in err[0], r.stderr[-2000:]


def _imported_config(hf_json: str, out: pathlib.Path, param_dtype: str) -> pathlib.Path:
  """A run directory holding only the config.yaml an import of that Hugging Face config.json writes (docs/TPU.md's
  recipe: no weights needed to compile)."""
  import yaml
  from sinkjax import config as config_lib
  from sinkjax.convert.hf import model_config_from_hf
  m = model_config_from_hf(json.loads((ROOT / hf_json).read_text()), param_dtype=param_dtype)
  c = config_lib.Config(model=m)
  c.data.seq_len = m.max_seq_len
  out.mkdir(parents=True, exist_ok=True)
  (out / "config.yaml").write_text(yaml.safe_dump(config_lib.to_dict(c), sort_keys=False))
  return out


HF_CONFIGS = "docs/results/tpu_compile/decode/hf_config"
# config -> (the imported run's Hugging Face config and parameter dtype (None: the config's own model section),
# GiB per chip docs/TPU.md reports at v5litepod-16). Qwen3-8B's config.json is not in the repository.
FULL_SIZE = {"qwen3_4b": (None, None, 5.44), "llama3": (f"{HF_CONFIGS}/Llama-3.1-8B.json", "float32", 8.41),
             "gptoss": (f"{HF_CONFIGS}/gpt-oss-20b.json", "bfloat16", 15.44)}


@pytest.mark.slow   # full-size XLA:TPU compiles: 2-8 min each on 2 cores
@pytest.mark.parametrize("name", sorted(FULL_SIZE))
def test_finetune_configs_fit_v5litepod_16_as_they_stand(tmp_path, name):
  """With nothing but train.init_from given (the import's config.yaml), each fine-tuning config fits v5litepod-16,
  with the per-chip memory docs/TPU.md reports (within 3 %)."""
  hf, dtype, gib = FULL_SIZE[name]
  init = [f"train.init_from={_imported_config(hf, tmp_path / 'base', dtype)}"] if hf else []
  out = tmp_path / "r.json"
  r = subprocess.run([sys.executable, "-m", "sinkjax.compile", "--config", f"configs/finetune_{name}.yaml",
                      "--topology", "v5litepod-16", "--no-eval", "--json", str(out), *init], cwd=ROOT,
                     capture_output=True, text=True, timeout=1800, env={**os.environ, "JAX_PLATFORMS": "cpu"})
  assert r.returncode == 0, r.stderr[-2000:]
  rep = json.loads(out.read_text())
  assert rep["fits"] and rep["mesh"] == {"data": 1, "fsdp": 16, "tensor": 1}, rep
  assert rep["per_chip_bytes"]["total"] / 2 ** 30 == pytest.approx(gib, rel=0.03), rep["per_chip_bytes"]
