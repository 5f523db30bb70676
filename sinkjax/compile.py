"""Does a config fit a TPU slice? `python -m sinkjax.compile --config CONFIG --topology TOPO [key=value ...]
[--json FILE]`.

Compiles the training step `sinkjax.train` would run (the same `train.JittedSteps`: state shapes, shardings,
micro-batching, optimizer, donation) and its eval step with the real XLA:TPU and Mosaic compilers, for compile-only
devices of TOPO (libtpu, the `tpu` extra, runs on any host: no TPU needed), and prints per-chip memory against the
chip's HBM. TOPO is a JAX topology name (`v5e:4x8`, `v4:2x2x4`, `v5p:2x4x4`, `v6e:2x4`) or a Cloud TPU accelerator
type (`v5litepod-32`, `v4-32`, `v5p-64`, `v6e-8`); `2x` in front (`2xv5litepod-32`) asks for that many slices
(multi-slice, over DCN). Reads no data: the vocabulary is the tokenizer file's when it exists, else model.vocab_size.
Exit 0 when the step fits, 1 (one line: what is needed, what helps) when it does not or on a user error.

It also reports speed, per chip, from the compiled program (read by `sinkjax.hlo`: `hlo_costs`, `roofline`): FLOPs
per step with every loop trip counted (scanned layers, loss chunks, micro-batches) and the Pallas kernels' cost
estimates, the part that remat recomputes, HBM bytes, collective bytes by kind, and a roofline step-time estimate
with the MFU bound it implies (chip figures: `hlo.CHIPS`). `--search` compiles one candidate per remat policy (and
grad_accum) and picks the fastest estimated step that fits.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import sys
import time
from sinkjax import errors, hlo, options
from sinkjax.errors import UserError
from sinkjax.config import declare
from sinkjax.markdown import row, table

# Compile-only TPU devices need libtpu's plugin, which takes a lock file per host; other JAX processes on this host
# (a training run that touched the plugin while choosing its backend) would hold it. Compiling needs no exclusive chip.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

GIB = 1024 ** 3

# Per chip: (JAX topology prefix, device kind, HBM GiB, Cloud TPU types count TensorCores (2 per chip) or chips).
GENERATIONS = {
    "v4": dict(hbm_gib=32, per_chip_in_type=2, config={"chip_config_name": "megacore"}),
    "v5e": dict(hbm_gib=16, per_chip_in_type=1, config={}),
    "v5p": dict(hbm_gib=95, per_chip_in_type=2, config={}),
    "v6e": dict(hbm_gib=32, per_chip_in_type=1, config={}),
}
_TYPE_PREFIX = {"v4": "v4", "v5litepod": "v5e", "v5e": "v5e", "v5p": "v5p", "v6e": "v6e"}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
              512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}

# NVIDIA GPUs: compile-only CUDA devices from XLA's GPU target config (shipped in sinkjax/target_configs/; the `gpu`
# extra's CUDA plugin compiles, no GPU needed). `h100:8` is one node of 8 GPUs, `h100:2x8` two such nodes.
GPUS = {"h100": dict(target_config="h100_sxm.txtpb", max_per_node=8)}


class CompileError(UserError):
  """A user-facing problem with the command's arguments or environment (one line)."""


@dataclasses.dataclass
class Topology:
  name: str            # the JAX topology name, e.g. v5e:4x8
  generation: str      # v4 | v5e | v5p | v6e | h100
  slices: int
  hbm_bytes: int
  platform: str = "tpu"  # tpu | gpu


def parse_topology(text: str) -> Topology:
  """A JAX topology name or a Cloud TPU accelerator type, optionally with `Nx` slices in front; or NVIDIA GPUs as
  `h100:GPUS` (one node) / `h100:NODESxGPUS`."""
  if text.strip().lower().startswith(tuple(GPUS)):
    return _parse_gpu_topology(text.strip().lower())
  slices = 1
  m = re.fullmatch(r"(\d+)x(v.+)", text.strip())
  if m:
    slices, text = int(m.group(1)), m.group(2)
  text = text.strip().lower()
  m = re.fullmatch(r"(v4|v5e|v5p|v6e):(\d+(?:x\d+)+)", text)
  if m:
    gen = m.group(1)
  else:
    m = re.fullmatch(r"(v4|v5litepod|v5e|v5p|v6e)-(\d+)", text)
    if not m:
      raise CompileError(f"--topology {text!r}: give a JAX topology (v5e:4x8, v4:2x2x4, v5p:2x4x4, v6e:2x4) or a "
                         "Cloud TPU type (v5litepod-32, v4-32, v5p-64, v6e-8)")
    gen = _TYPE_PREFIX[m.group(1)]
    chips, rem = divmod(int(m.group(2)), GENERATIONS[gen]["per_chip_in_type"])
    shapes = _SHAPES_3D if gen in ("v4", "v5p") else _SHAPES_2D
    if rem or chips not in shapes:
      raise CompileError(f"--topology {text!r}: no {gen} slice of that size (chips: {', '.join(map(str, shapes))})")
    text = f"{gen}:{shapes[chips]}"
  if slices < 1:
    raise CompileError(f"--topology: the slice count must be >= 1, got {slices}")
  return Topology(text, gen, slices, GENERATIONS[gen]["hbm_gib"] * GIB)


def _parse_gpu_topology(text: str) -> Topology:
  m = re.fullmatch(r"([a-z0-9]+):(?:(\d+)x)?(\d+)", text)
  if not m or m.group(1) not in GPUS:
    raise CompileError(f"--topology {text!r}: give GPUs as {'|'.join(GPUS)}:GPUS (one node, e.g. h100:8) or "
                       "NODESxGPUS (h100:2x8)")
  gpu, nodes, per_node = m.group(1), int(m.group(2) or 1), int(m.group(3))
  if nodes < 1 or not 1 <= per_node <= GPUS[gpu]["max_per_node"]:
    raise CompileError(f"--topology {text!r}: 1 to {GPUS[gpu]['max_per_node']} GPUs per node and at least one node "
                       f"(more GPUs: NODESxGPUS, e.g. {gpu}:2x8)")
  name = f"{gpu}:{per_node}" if nodes == 1 else f"{gpu}:{nodes}x{per_node}"
  return Topology(name, gpu, 1, _gpu_memory_bytes(_target_config(gpu)), platform="gpu")


def _target_config(gpu: str) -> str:
  """XLA's GpuTargetConfigProto (text format) for the GPU, as shipped with sinkjax."""
  from importlib import resources  # pylint: disable=import-outside-toplevel
  return resources.files("sinkjax").joinpath("target_configs", GPUS[gpu]["target_config"]).read_text()


def _gpu_memory_bytes(target_config: str) -> int:
  """The device memory the target config states (what the CUDA driver reports for the GPU)."""
  return int(re.search(r"device_memory_size:\s*(\d+)", target_config).group(1))


def cuda_plugin_installed() -> bool:
  """Whether JAX's CUDA PJRT plugin (jax[cuda12] / jax[cuda13]) is installed; it is not imported here."""
  import importlib.util  # pylint: disable=import-outside-toplevel
  try:
    return any(importlib.util.find_spec(f"jax_plugins.xla_cuda{v}") for v in (12, 13))
  except ModuleNotFoundError:        # no jax_plugins namespace at all
    return False


def prepare_gpu() -> None:
  """Checks for the CUDA plugin and, before JAX starts its backends, tells it not to start the GPU one (there is no
  GPU): the plugin is then registered for topologies only."""
  if not cuda_plugin_installed():
    raise CompileError("compiling for NVIDIA GPUs needs JAX's CUDA plugin: pip install 'sinkjax[gpu]'")
  import jax  # pylint: disable=import-outside-toplevel
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  if not xla_bridge.backends_are_initialized() and not jax.config.jax_platforms:
    jax.config.update("jax_platforms", "cpu")


def gpu_devices(topo: Topology):
  """Compile-only CUDA devices of the topology (XLA:GPU and Triton compile; no GPU present). JAX must register its
  CUDA plugin without starting it: `jax_platforms` is set to "cpu" here unless JAX's backends already started or
  JAX_PLATFORMS says otherwise."""
  prepare_gpu()
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  spec = topo.name.split(":", 1)[1]
  nodes, per_node = spec.split("x") if "x" in spec else ("1", spec)
  # "<partitions>x<hosts per partition>x<devices per host>": an H100 node is its own NVLink domain (a partition).
  shape = f"{nodes}x1x{per_node}"
  try:
    return topologies.get_topology_desc(platform="cuda", target_config=_target_config(topo.generation),
                                        topology=shape).devices
  except NotImplementedError:
    raise CompileError("JAX's CUDA plugin is installed but did not register (JAX started its backends before "
                       "sinkjax.compile could say not to start the GPU one): run with JAX_PLATFORMS=cpu") from None
  except Exception as e:  # pylint: disable=broad-except  # JaxRuntimeError from the plugin
    raise CompileError(f"--topology {topo.name}: the CUDA plugin refused it ({' '.join(str(e).split())[:200]})") \
        from None


def _accelerator_type(topo: Topology) -> str:
  """The Cloud TPU accelerator type of one slice of the topology (what a TPU VM's metadata would say)."""
  chips = math.prod(int(n) for n in topo.name.split(":")[1].split("x"))
  prefix = "v5litepod" if topo.generation == "v5e" else topo.generation
  return f"{prefix}-{chips * GENERATIONS[topo.generation]['per_chip_in_type']}"


def tpu_devices(topo: Topology):
  """Compile-only devices of the topology (libtpu's compiler; no TPU present)."""
  # Off a TPU VM libtpu asks the (absent) metadata server what it runs on and prints warnings when it gets no
  # answer; these settings are what that answer would be.
  for key, value in (("TPU_SKIP_MDS_QUERY", "1"), ("TPU_ACCELERATOR_TYPE", _accelerator_type(topo)),
                     ("TPU_WORKER_HOSTNAMES", "localhost")):
    os.environ.setdefault(key, value)
  try:
    import libtpu  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
  except ImportError:
    raise CompileError("compiling for TPU needs libtpu: pip install 'sinkjax[tpu]'") from None
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel
  kw = dict(GENERATIONS[topo.generation]["config"])
  if topo.slices > 1:
    kw["num_slices"] = topo.slices
  try:
    return topologies.get_topology_desc(topology_name=topo.name, platform="tpu", **kw).devices
  except Exception as e:  # pylint: disable=broad-except  # JaxRuntimeError from libtpu
    raise CompileError(f"--topology {topo.name}: libtpu refused it ({' '.join(str(e).split())[:200]})") from None


def model_flops_per_step(cfg, num_params: int) -> int:
  """nanochat's estimate (`estimate_flops`): 6 x non-embedding parameters + 12 x layers x heads x head_dim x T, per
  token, times the step's tokens (forward + backward). With LoRA the base weights are frozen: their backward computes
  input gradients only, 4 x instead of 6 x (the adapters are a rounding error at the ranks used). The attention term
  counts the layers with heads (linear-attention layers have no T^2 term)."""
  from sinkjax.model import padded_vocab  # pylint: disable=import-outside-toplevel
  m, T = cfg.model, cfg.data.seq_len
  embedding = padded_vocab(m) * m.d_model
  weights = 4 if cfg.lora.rank else 6
  per_token = weights * (num_params - embedding) + 12 * len(m.head_layers) * m.num_heads * m.head_dim * T
  return per_token * cfg.train.batch_size * T


def _memory(compiled) -> dict:
  ma = compiled.memory_analysis()
  out = {"arguments": ma.argument_size_in_bytes, "temporaries": ma.temp_size_in_bytes,
         "outputs": ma.output_size_in_bytes, "aliased": ma.alias_size_in_bytes,
         "generated_code": getattr(ma, "generated_code_size_in_bytes", 0)}
  out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"] + out["generated_code"]
  return out


_OOM = re.compile(r"\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def compile_config(cfg, topo: Topology, *, eval_step: bool = True, decode: tuple | None = None, devices=None,
                   eval_rows: int | None = None, hlo_path: str | None = None) -> dict:
  """Compiles cfg's train (and eval) step for the topology; with decode = (rows, capacity) the decode step
  `sinkjax.generate` runs (`decode_program`), with eval_rows the batch function `sinkjax.eval` runs
  (`eval_program`); returns the report (see `main` for its keys). hlo_path: also write the compiled train step's
  text there (gzipped when it ends in .gz)."""
  from sinkjax import sharding as sharding_lib  # pylint: disable=import-outside-toplevel
  from sinkjax.kernels import default_impl  # pylint: disable=import-outside-toplevel
  from sinkjax.train import JittedSteps  # pylint: disable=import-outside-toplevel
  if devices is None:
    devices = gpu_devices(topo) if topo.platform == "gpu" else tpu_devices(topo)
  mesh = sharding_lib.make_mesh(cfg.mesh, devices)
  program = JittedSteps(cfg, mesh)
  impl = cfg.model.attn_impl if cfg.model.attn_impl != "auto" else default_impl(sharding_lib.mesh_platform(mesh))
  rows_per_chip = program.micro // sharding_lib.batch_shards(mesh)
  report = {
      "topology": topo.name, "slices": topo.slices, "chips": len(devices), "device_kind": devices[0].device_kind,
      "mesh": dict(mesh.shape), "hbm_per_chip_bytes": topo.hbm_bytes, "num_params": program.num_params,
      "tokens_per_chip_per_micro_step": rows_per_chip * cfg.data.seq_len, "rows_per_chip": rows_per_chip,
      "grad_accum": cfg.train.grad_accum, "remat": cfg.model.remat, "remat_policy": cfg.model.remat_policy,
      "collective_matmul": cfg.mesh.collective_matmul,
      "model_flops_per_step": model_flops_per_step(cfg, program.num_params),
  }
  t0 = time.perf_counter()
  train_lowered, eval_lowered = program.lower()
  try:
    compiled = train_lowered.compile()
  except Exception as e:  # pylint: disable=broad-except  # XlaRuntimeError RESOURCE_EXHAUSTED
    m = _OOM.search(str(e))
    if "RESOURCE_EXHAUSTED" not in str(e) or not m:
      raise
    report.update(fits=False, compile_seconds=round(time.perf_counter() - t0, 1), attention_kernel=impl,
                  per_chip_bytes={"total": int(float(m.group(1)) * GIB)}, available_bytes=int(float(m.group(2)) * GIB))
    return report
  report["compile_seconds"] = round(time.perf_counter() - t0, 1)
  report["per_chip_bytes"] = _memory(compiled)
  text = compiled.as_text()
  report["attention_kernel"] = hlo.attention_kernel(text, impl)
  if hlo_path:
    import gzip  # pylint: disable=import-outside-toplevel
    with (gzip.open(hlo_path, "wt") if hlo_path.endswith(".gz") else open(hlo_path, "w")) as f:
      f.write(text)
  report["fits"] = report["per_chip_bytes"]["total"] <= topo.hbm_bytes
  report.update(speed_report(compiled, hlo.CHIPS[topo.generation], report["model_flops_per_step"], len(devices), text))
  if eval_step:
    try:
      report["eval_per_chip_bytes"] = _memory(eval_lowered.compile())
    except Exception as e:  # pylint: disable=broad-except
      report["eval_per_chip_bytes"] = {"error": " ".join(str(e).split())[:200]}
  if decode:
    report["decode_rows"], report["decode_capacity"] = decode
    try:
      report["decode_per_chip_bytes"] = _memory(decode_program(cfg, mesh, *decode)[1].compile())
    except Exception as e:  # pylint: disable=broad-except
      report["decode_per_chip_bytes"] = {"error": " ".join(str(e).split())[:200]}
  if eval_rows:
    report["sinkjax_eval_rows"] = eval_rows
    try:
      report["sinkjax_eval_per_chip_bytes"] = _memory(eval_program(cfg, mesh, eval_rows).compile())
    except Exception as e:  # pylint: disable=broad-except
      report["sinkjax_eval_per_chip_bytes"] = {"error": " ".join(str(e).split())[:200]}
  return report


def _placed_model(cfg, mesh):
  """The run's model as `sinkjax.run.load_run(mesh=mesh)` restores it, abstract: every parameter a ShapeDtypeStruct
  with its training placement on `mesh` (LoRA adapters included, as load_run gives them)."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from sinkjax import lora  # pylint: disable=import-outside-toplevel
  from sinkjax import sharding as sharding_lib  # pylint: disable=import-outside-toplevel
  from sinkjax.checkpoint import abstract_with_shardings  # pylint: disable=import-outside-toplevel
  from sinkjax.model import Transformer  # pylint: disable=import-outside-toplevel
  model = nnx.eval_shape(lambda: lora.apply(Transformer(cfg.model, rngs=nnx.Rngs(0)), cfg.lora, nnx.Rngs(1)))
  graphdef, state = nnx.split(model)
  return nnx.merge(graphdef, abstract_with_shardings(state, sharding_lib.state_shardings(mesh, state)))


def decode_program(cfg, mesh, rows: int, capacity: int):
  """(generator, lowered): `sinkjax.generate.Generator` over the run's model placed on `mesh` as `sinkjax.generate
  ... mesh.*=...` places it, for `rows` rows and a full KV cache of `capacity` slots, and its own `decode_fn` (the
  step generate and lm_eval run) lowered with abstract arguments (`Generator.lower_decode`: the cache and the tokens
  as the Generator places them)."""
  from sinkjax.generate import Generator  # pylint: disable=import-outside-toplevel
  gen = Generator(_placed_model(cfg, mesh), capacity=capacity, batch=rows, mesh=mesh,
                  collective_matmul=cfg.mesh.collective_matmul)
  return gen, gen.lower_decode()


def eval_program(cfg, mesh, rows: int):
  """`sinkjax.eval`'s batch function (`eval._lm_batch_jit`: the model's forward, BPB sums and importance) lowered
  for the run's model placed on `mesh` and a batch of `rows` rows of data.seq_len tokens split over the batch axes
  (whole on every device when they do not divide), as `sinkjax.eval ... mesh.*=...` runs it."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from sinkjax import eval as eval_lib  # pylint: disable=import-outside-toplevel
  from sinkjax import sharding as sharding_lib  # pylint: disable=import-outside-toplevel
  sharding = sharding_lib.batch_sharding(mesh) if rows % sharding_lib.batch_shards(mesh) == 0 else \
      sharding_lib.replicated(mesh)
  batch = {k: jax.ShapeDtypeStruct((rows, cfg.data.seq_len), jnp.float32 if k == "loss_mask" else jnp.int32,
                                   sharding=sharding) for k in eval_lib.MODEL_FEATURES}
  model = _placed_model(cfg, mesh)          # outside the mesh context: there nnx would read logical axes as mesh axes
  with jax.set_mesh(mesh):
    return eval_lib._lm_batch_jit.lower(model, batch,  # pylint: disable=protected-access
                                        compiler_options=eval_lib.model_options(model, cfg.mesh.collective_matmul))


# ----------------------------------------------------------------------------------------------------------------
# Speed: the report's keys from `sinkjax.hlo`'s walk of the compiled program and its roofline estimate; separate
# from the memory report above (`compile_config` adds these keys).


def speed_report(compiled, chip: hlo.Chip, model_flops_per_step: float, chips: int, text: str | None = None) -> dict:
  """The report's speed keys from a compiled train step (see `main` for their meaning); `text` its text when at hand."""
  costs = hlo.hlo_costs(text if text is not None else compiled.as_text())
  out = {"flops_per_step": costs["flops"], "recompute_flops_per_step": costs["recompute_flops"],
         "hbm_bytes_per_step": costs["hbm_bytes"], "host_bytes_per_step": costs["host_bytes"],
         "collective_bytes_per_step": costs["collective_bytes"], "ici_bytes_per_step": costs["ici_bytes"],
         "loops_of_unknown_trips": costs["loops_of_unknown_trips"], "chip_figures": dataclasses.asdict(chip),
         "hbm_breakdown": costs["breakdown"],
         # XLA:TPU's own cost model: the cycles it estimates for its fusions and copies (window_config
         # estimated_cycles), loop trips counted, at the chip's clock; the Pallas kernels and collectives are not in it
         "xla_fusion_seconds": costs["breakdown"]["xla_cycles"] / chip.clock_hz if chip.clock_hz else None}
  out.update(hlo.roofline(costs, chip, model_flops_per_step / chips))
  return out


def print_breakdown(r: dict, top: int = 12) -> None:
  """The report's `hbm_breakdown`: HBM bytes and FLOPs per category and pass, and the instructions that move the
  most, with the trips of the loops around them and where in sinkjax they come from."""
  b = r.get("hbm_breakdown")
  if not b:
    return
  total = r["hbm_bytes_per_step"] or 1.0
  print("  where the HBM bytes go (per chip and step; FLOPs of the fused work):")
  clock = r.get("chip_figures", {}).get("clock_hz")
  print(f"    {'category':<30} {'HBM GB':>9} {'share':>6} {'FLOPs':>10} {'instructions':>12}"
        + (f" {'XLA est. s':>10}" if clock else ""))
  for name, c in sorted(b["by_category"].items(), key=lambda kv: -kv[1]["hbm_bytes"]):
    if c["instructions"]:
      print(f"    {name:<30} {c['hbm_bytes'] / 1e9:9.2f} {100 * c['hbm_bytes'] / total:5.1f}% {c['flops']:10.3e} "
            f"{c['instructions']:12d}" + (f" {c.get('xla_cycles', 0) / clock:10.4f}" if clock else ""))
  print("    by pass: " + ", ".join(f"{k} {v['hbm_bytes'] / 1e9:.2f} GB" for k, v in b["by_pass"].items()))
  print(f"  top {min(top, len(b['top']))} instructions by HBM bytes (trips: the loops around it, outermost first):")
  for i in b["top"][:top]:
    loops = " x ".join(str(lp["trips"]) for lp in i["loops"]) or "1"
    src = " < ".join(i["source"]) or i["op_name"]
    print(f"    {i['hbm_bytes'] / 1e9:8.2f} GB {i['flops']:9.2e} F  trips {loops:<8} {i['category']:<14.14} "
          f"{i['phase']:<9} {i['opcode']} {i['type'][:60]}  [{src}]")
  lines = b.get("by_source", [])[:top]
  if lines:
    print(f"  top {len(lines)} source lines by HBM bytes (every instruction whose innermost sinkjax line it is):")
    for i in lines:
      print(f"    {i['hbm_bytes'] / 1e9:8.2f} GB {i['flops']:9.2e} F  {i['instructions']:5d} instr.  "
            f"{i['category']:<14.14} {i['phase']:<9} {i['source'] or '(no sinkjax line)'}")


def speed_rows(r: dict) -> list:
  """The printed report's speed lines (none when the step did not compile)."""
  if "flops_per_step" not in r:
    return []
  model = r["model_flops_per_step"] / r["chips"]
  c, t = r["collective_bytes_per_step"], r["estimated_seconds_by_term"]
  gb = lambda b: f"{b / 1e9:.2f}"
  rows = [("FLOPs / chip / step", f"{r['flops_per_step']:.3e} compiled ({r['recompute_flops_per_step']:.3e} "
                                  f"recomputed); model {model:.3e} (6N + attention)"),
          ("HBM GB / chip / step", gb(r["hbm_bytes_per_step"]) + (f" (host offload {gb(r['host_bytes_per_step'])})"
                                                                  if r["host_bytes_per_step"] else "")),
          ("collective GB / chip / step", ", ".join(f"{k} {gb(v)}" for k, v in c.items() if v)
           + f" (ICI traffic {gb(r['ici_bytes_per_step'])})"),
          ("step time (estimate)", f"compute {t['compute']:.3g} s, HBM {t['hbm']:.3g} s, ICI {t['ici']:.3g} s"
                                   + (f", instructions in sequence {t['sequential']:.3g} s" if "sequential" in t else "")
                                   + " -> "
                                   f">= {r['estimated_step_seconds']:.3g} s ({r['estimated_bound']}-bound roofline, "
                                   f"not a measurement); MFU <= {100 * r['estimated_mfu']:.0f}%")]
  if r.get("xla_fusion_seconds"):
    rows.append(("XLA:TPU's cycle estimate", f"{r['xla_fusion_seconds']:.3g} s for its fusions and copies (its own "
                                             "cost model; kernels and collectives not in it)"))
  if r.get("loops_of_unknown_trips"):
    rows.append(("note", f"{r['loops_of_unknown_trips']} loop(s) of unknown trip count counted once"))
  return rows


# ----------------------------------------------------------------------------------------------------------------
# --search: compile candidate remat policies (and accumulations) and pick the fastest estimated step that fits.

SEARCH_POLICIES = ("nothing", "dots", "save_qkv_proj", "save_out_proj", "save_attention")


def search(cfg_path: str, overrides: list, topo: Topology, policies=SEARCH_POLICIES, accums=(None,),
           load=None, on_result=None, vary: dict | None = None) -> dict:
  """Compiles the config once per (remat policy, train.grad_accum, values of the `vary` keys) candidate with
  model.remat=true and returns {"candidates": [reports], "picked": the fitting report of least estimated step time,
  or None}; on_result(report) is called as each candidate is done. `vary` ({"mesh.collective_matmul": ["gather",
  "windowed"]}) adds the product of those keys' values; each report's `varied` names its values."""
  import itertools  # pylint: disable=import-outside-toplevel
  from sinkjax import config as config_lib  # pylint: disable=import-outside-toplevel
  load = load or (lambda ov: config_lib.load_config(cfg_path, ov))
  devices = gpu_devices(topo) if topo.platform == "gpu" else tpu_devices(topo)
  vary = vary or {}
  candidates = []
  for values in itertools.product(*vary.values()):
    varied = [f"{k}={v}" for k, v in zip(vary, values)]
    for accum in accums:
      for policy in policies:
        ov = list(overrides) + varied + ["model.remat=true", f"model.remat_policy={policy}"] + \
            ([f"train.grad_accum={accum}"] if accum else [])
        r = compile_config(load(ov), topo, eval_step=False, devices=devices)
        r["overrides"], r["varied"] = ov, varied
        candidates.append(r)
        if on_result:
          on_result(r)
  fits = [r for r in candidates if r["fits"]]
  return {"candidates": candidates, "picked": min(fits, key=lambda r: r["estimated_step_seconds"]) if fits else None}


SEARCH_HEADER = "\n".join(table(["remat_policy", "grad_accum", "rows / chip", "GiB / chip", "fits", "FLOPs / chip",
                                 "recomputed", "HBM GB", "ICI GB", "est. step s", "bound", "MFU <="], (),
                                "lrrrlrrrrrlr"))


def print_search(result: dict) -> None:
  """The search's Markdown table, the pick marked."""
  print(SEARCH_HEADER)
  for r in result["candidates"]:
    print_search_row(r, r is result["picked"])


def print_search_row(r: dict, picked: bool = False) -> None:
  picked = (" " + " ".join(r["varied"]) if r.get("varied") else "") + (" **picked**" if picked else "")
  head = [f"{r['remat_policy']}{picked}", r["grad_accum"], r["rows_per_chip"], _gib(r["per_chip_bytes"]["total"])]
  if "flops_per_step" not in r:                        # did not fit: no cost figures
    print(row(head + ["no"]) + " |" * 7, flush=True)
    return
  print(row(head + ["yes" if r["fits"] else "no", f"{r['flops_per_step']:.3e}", f"{r['recompute_flops_per_step']:.3e}",
                    f"{r['hbm_bytes_per_step'] / 1e9:.1f}", f"{r['ici_bytes_per_step'] / 1e9:.2f}",
                    f"{r['estimated_step_seconds']:.3g}", r["estimated_bound"], f"{100 * r['estimated_mfu']:.0f}%"]),
        flush=True)


def _gib(b) -> str:
  return f"{b / GIB:.2f}"


def print_report(config: str, r: dict, top: int = 12) -> None:
  mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items()) + (
      f" (mesh.collective_matmul={r['collective_matmul']})" if "collective_matmul" in r else "")
  rows = [
      ("slice", f"{r['topology']}" + (f" x {r['slices']} slices" if r["slices"] > 1 else "")
       + f": {r['chips']} x {r['device_kind']}, {_gib(r['hbm_per_chip_bytes'])} GiB HBM each"),
      ("mesh", mesh),
      ("tokens / chip / micro-step", f"{r['tokens_per_chip_per_micro_step']:,} ({r['rows_per_chip']} rows; "
                                     f"train.grad_accum={r['grad_accum']}, model.remat={r['remat']}, "
                                     f"model.remat_policy={r.get('remat_policy')})"),
      ("parameters", f"{r['num_params']:,}"),
      ("model FLOPs / step", f"{r['model_flops_per_step']:.3e}"),
      ("attention kernel", r["attention_kernel"]),
      ("compile", f"{r['compile_seconds']:.1f} s"),
  ]
  b = r["per_chip_bytes"]
  if "arguments" in b:
    rows.append(("per chip (GiB)", f"arguments {_gib(b['arguments'])}, temporaries {_gib(b['temporaries'])}, "
                                   f"outputs {_gib(b['outputs'])}, aliased {_gib(b['aliased'])}, "
                                   f"total {_gib(b['total'])} of {_gib(r['hbm_per_chip_bytes'])}"))
  else:
    rows.append(("per chip (GiB)", f"total {_gib(b['total'])} (the compiler's count) of "
                                   f"{_gib(r.get('available_bytes', r['hbm_per_chip_bytes']))} available"))
  if "eval_per_chip_bytes" in r:
    e = r["eval_per_chip_bytes"]
    rows.append(("eval step (GiB)", f"total {_gib(e['total'])}" if "total" in e else e["error"]))
  if "decode_per_chip_bytes" in r:
    d = r["decode_per_chip_bytes"]
    rows.append(("decode step (GiB)", f"{r['decode_rows']} rows x {r['decode_capacity']} KV slots: arguments "
                 f"{_gib(d['arguments'])} (weights + cache), total {_gib(d['total'])}" if "total" in d else d["error"]))
  if "sinkjax_eval_per_chip_bytes" in r:
    e = r["sinkjax_eval_per_chip_bytes"]
    rows.append(("sinkjax.eval batch (GiB)", f"{r['sinkjax_eval_rows']} rows: arguments {_gib(e['arguments'])}, "
                 f"total {_gib(e['total'])}" if "total" in e else e["error"]))
  rows += speed_rows(r)
  rows.append(("fits", "yes" if r["fits"] else "NO"))
  print(f"sinkjax.compile: {config}")
  for k, v in rows:
    print(f"  {k:<28} {v}")
  print_breakdown(r, top)


TABLE_HEADER = "\n".join(table(["config (overrides)", "slice", "mesh", "tokens / chip / micro-step",
                                "GiB per chip (args + temps)", "HBM GiB", "fits", "attention", "compile s"], (),
                               "lllrrrllr"))


def markdown_row(r: dict) -> str:
  """One row of docs/TPU.md's table from a --json report."""
  b = r["per_chip_bytes"]
  parts = f" ({_gib(b['arguments'])} + {_gib(b['temporaries'])})" if "arguments" in b else " (compiler's count)"
  mesh = "x".join(str(v) for v in r["mesh"].values())
  name = r.get("config", "?") + (" " + " ".join(r["overrides"]) if r.get("overrides") else "")
  return row([f"`{name}`", r["topology"] + (f" x{r['slices']}" if r["slices"] > 1 else ""), mesh,
              f"{r['tokens_per_chip_per_micro_step']:,}", f"{_gib(b['total'])}{parts}", _gib(r["hbm_per_chip_bytes"]),
              "yes" if r["fits"] else "no", r["attention_kernel"], f"{r['compile_seconds']:.0f}"])


def _vocab(cfg) -> None:
  """model.vocab_size from the tokenizer file when it exists (the trainer's rule), else as configured."""
  from sinkjax import paths  # pylint: disable=import-outside-toplevel
  from sinkjax.train import check_vocab  # pylint: disable=import-outside-toplevel
  tok = cfg.data.tokenizer
  if tok == "bytes" or paths.as_path(tok, "data.tokenizer").is_file():
    from sinkjax.data import build_tokenizer  # pylint: disable=import-outside-toplevel
    check_vocab(cfg.model, build_tokenizer(cfg.data).vocab_size)
  elif cfg.model.vocab_size == 0:
    raise CompileError(f"data.tokenizer {tok} does not exist here and model.vocab_size is 0: give the vocabulary "
                       "size, e.g. model.vocab_size=65536 (nanochat's tokenizer)")


def _adopt_init_model(cfg) -> None:
  """train.init_from: the model is the imported run's (its config.yaml alone is read). Where that run is not here
  (not imported yet, or imported elsewhere) and the config's own model section names its vocabulary (a config that
  spells out the published model, as configs/finetune_qwen3_4b.yaml does), it is sized from that section instead,
  said in one line; otherwise the import is needed (ConfigError, one line)."""
  from sinkjax import paths  # pylint: disable=import-outside-toplevel
  from sinkjax import run as run_lib  # pylint: disable=import-outside-toplevel
  src = cfg.train.init_from
  if cfg.model.vocab_size and not paths.as_path(f"{src.rstrip('/')}/{run_lib.CONFIG_FILE}").exists():
    print(f"sinkjax.compile: train.init_from {src} is not here (no {run_lib.CONFIG_FILE}); sized from this config's "
          "model section", file=sys.stderr)
    return
  run_lib.adopt_init_model(cfg)


def _hints(r: dict) -> str:
  need, have = r["per_chip_bytes"]["total"], r.get("available_bytes", r["hbm_per_chip_bytes"])
  tips = []
  if not r["remat"]:
    tips.append("model.remat=true")
  if r["rows_per_chip"] > 1:
    tips.append(f"train.grad_accum={r['grad_accum'] * 2}")
  tips.append("a larger slice (more chips for mesh.fsdp)")
  return (f"does not fit: {_gib(need)} GiB per chip needed, {_gib(have)} GiB available on "
          f"{r['device_kind']}; try {', or '.join(tips)}")


@dataclasses.dataclass
class CompileOptions:
  """The compile.* options (`python -m sinkjax.compile`; each flag the alias of its key: `--topology v5e:4x8` =
  `compile.topology=v5e:4x8`). Its --config is the training config compiled, so the command has no file of options."""
  config: str = declare("", alias="--config", metavar="CONFIG",
                    help="a YAML config file, or a packaged config by name (paper/d20_sink_aux; sinkjax.train's "
                         "--help lists them)")
  topology: str = declare("", alias="--topology",
                      help="v5e:4x8 | v5litepod-32 | v4-32 | v5p-64 | v6e-8 | 2xv5litepod-32 (two slices) ... | "
                           "h100:8 (one node of 8 NVIDIA H100) | h100:2x8 (nodes x GPUs)")
  table: list = declare([], alias="--table", nargs="+",
                    metavar="JSON",
                    help="instead of compiling: print the Markdown table of these --json reports (docs/TPU.md)")
  json: str | None = declare(None, alias="--json", metavar="FILE", help="also write the report as JSON")
  no_eval: bool = declare(False, alias="--no-eval", help="skip the eval step")
  decode: str | None = declare(None, alias="--decode", metavar="ROWSxSLOTS",
                           help="also compile the decode step sinkjax.generate and sinkjax.lm_eval run (Generator's): "
                                "ROWS sequences against a full KV cache of SLOTS positions, e.g. 64x4096")
  eval: int | None = declare(None, ">=1", alias="--eval", metavar="ROWS",
                         help="also compile the batch function sinkjax.eval runs (forward, BPB and importance) on ROWS "
                              "rows of data.seq_len tokens")
  search: str | None = declare(None, alias="--search", const=",".join(SEARCH_POLICIES), metavar="POLICY,...",
                           help="compile each model.remat_policy (default: " + ", ".join(SEARCH_POLICIES) + ") with "
                                "model.remat=true and pick the fastest estimated step that fits; prints the table")
  accum: str | None = declare(None, alias="--accum", metavar="N,...",
                          help="with --search: also try these train.grad_accum values (fewer rows per chip each)")
  vary: list = declare([], alias="--vary",
                   metavar="section.key=V1,V2",
                   help="with --search: also try each of these values of a config key (repeatable; candidates are "
                        "the product), e.g. --vary mesh.collective_matmul=gather,windowed")
  hlo: str | None = declare(None, alias="--hlo", metavar="FILE",
                        help="also write the compiled train step's text (HLO after optimization; .gz: gzipped), what "
                             "the speed figures are read from")
  top: int = declare(12, ">=0", alias="--top", metavar="N",
                 help="print the N instructions that move the most HBM bytes (the report's hbm_breakdown; --json keeps "
                      "25)")


COMMAND = options.Command(
    prog="python -m sinkjax.compile", sections={"compile": CompileOptions}, run_overrides=True, options_file=None,
    description="Compile the training step of a config for a TPU slice or NVIDIA GPUs with compile-only devices "
                "(libtpu or JAX's CUDA plugin; no TPU or GPU needed) and report whether it fits the chips' memory.")


def main(argv=None) -> int:
  errors.require_extra("sinkjax.compile")   # it builds the trainer's step (sinkjax.train): the train extra

  def compile_or_table(sections, overrides) -> int:
    opts = sections["compile"]
    if opts.table:
      print(TABLE_HEADER)
      for path in opts.table:
        with open(path) as f:
          print(markdown_row(json.load(f)))
      return 0
    if not opts.config or not opts.topology:
      options.build_parser(COMMAND).error("--config and --topology are required (or --table JSON ...)")
    return _run(opts, overrides)
  return options.main(COMMAND, argv, compile_or_table, extra_errors=(CompileError,))


def _decode_shape(text: str | None) -> tuple | None:
  """--decode ROWSxSLOTS -> (rows, slots)."""
  if text is None:
    return None
  try:
    rows, slots = (int(x) for x in text.lower().split("x"))
  except ValueError:
    raise CompileError(f"--decode takes ROWSxSLOTS (e.g. 64x4096), got {text!r}") from None
  if rows < 1 or slots < 2:
    raise CompileError(f"--decode {text}: need at least 1 row and 2 slots")
  return rows, slots


def _run(opts: CompileOptions, overrides: list[str] | tuple = ()) -> int:
  """Compiles opts.config (with the config overrides `overrides`) for opts.topology; exit status (1: no fit)."""
  from sinkjax import config as config_lib  # pylint: disable=import-outside-toplevel
  topo = parse_topology(opts.topology)
  if topo.platform == "gpu":
    prepare_gpu()
  cfg = config_lib.load_config(opts.config, overrides)
  if cfg.train.init_from:             # fine-tuning: the model is the imported run's (or the config's, _adopt_init_model)
    _adopt_init_model(cfg)
  _vocab(cfg)
  if opts.search:
    return _run_search(opts, overrides, topo, cfg)
  if opts.vary:
    raise CompileError("--vary goes with --search (it adds candidates); to compile one setting give it as an "
                       "override, e.g. mesh.collective_matmul=windowed")
  report = compile_config(cfg, topo, eval_step=not opts.no_eval, decode=_decode_shape(opts.decode),
                          eval_rows=opts.eval, hlo_path=opts.hlo)
  report["config"] = opts.config
  report["overrides"] = list(overrides)
  print_report(opts.config + (" " + " ".join(overrides) if overrides else ""), report, opts.top)
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump(report, f, indent=1)
  if not report["fits"]:
    print(f"sinkjax.compile: {_hints(report)}", file=sys.stderr)
    return 1
  return 0


def _run_search(opts: CompileOptions, overrides: list[str] | tuple, topo: Topology, cfg) -> int:
  from sinkjax import config as config_lib  # pylint: disable=import-outside-toplevel
  policies = tuple(p.strip() for p in opts.search.split(",") if p.strip())
  bad = [p for p in policies if p not in config_lib.CHOICES["model.remat_policy"]]
  if bad:
    raise CompileError(f"--search {','.join(bad)}: not a model.remat_policy (choices: "
                       f"{', '.join(config_lib.CHOICES['model.remat_policy'])})")
  try:
    accums = tuple(int(a) for a in opts.accum.split(",")) if opts.accum else (None,)
  except ValueError:
    raise CompileError(f"--accum takes integers separated by commas, e.g. 1,2; got {opts.accum!r}") from None
  vary = {}
  for item in opts.vary:
    k, eq, values = item.partition("=")
    if not eq or not values.strip(",") or "." not in k:
      raise CompileError(f"--vary takes section.key=V1,V2 (e.g. mesh.collective_matmul=gather,windowed), got {item!r}")
    vary[k.strip()] = [v.strip() for v in values.split(",") if v.strip()]
    for v in vary[k.strip()]:        # a bad key or value fails here, before minutes of compiling
      config_lib.load_config(opts.config, list(overrides) + [f"{k.strip()}={v}"])

  def load(ov):
    c = config_lib.load_config(opts.config, ov)
    if c.train.init_from:
      _adopt_init_model(c)
    c.model.vocab_size = cfg.model.vocab_size
    return c

  print(f"sinkjax.compile --search: {opts.config} {' '.join(overrides)} on {topo.name} (estimates, not "
        "measurements; rows as they compile, then the table with the pick)\n" + SEARCH_HEADER, flush=True)
  result = search(opts.config, overrides, topo, policies, accums, load=load, on_result=print_search_row,
                  vary=vary)
  print()
  print_search(result)
  if opts.json:
    with open(opts.json, "w") as f:
      json.dump({**result, "picked": result["picked"] and result["candidates"].index(result["picked"])}, f, indent=1)
  if result["picked"] is None:
    print("sinkjax.compile: no candidate fits; try --accum 2,4 or a larger slice", file=sys.stderr)
    return 1
  p = result["picked"]
  print(f"picked: model.remat_policy={p['remat_policy']}" + (f" train.grad_accum={p['grad_accum']}"
                                                            if opts.accum else "")
        + "".join(f" {v}" for v in p["varied"]))
  return 0


if __name__ == "__main__":
  sys.exit(main())
