"""Does a config fit a TPU slice? `python -m sinkjax.compile --config CONFIG --topology TOPO [key=value ...]
[--json FILE]`.

Compiles the training step `sinkjax.train` would run (the same `train.Program`: state shapes, shardings,
micro-batching, optimizer, donation) and its eval step with the real XLA:TPU and Mosaic compilers, for compile-only
devices of TOPO (libtpu, the `tpu` extra, runs on any host: no TPU needed), and prints per-chip memory against the
chip's HBM. TOPO is a JAX topology name (`v5e:4x8`, `v4:2x2x4`, `v5p:2x4x4`, `v6e:2x4`) or a Cloud TPU accelerator
type (`v5litepod-32`, `v4-32`, `v5p-64`, `v6e-8`); `2x` in front (`2xv5litepod-32`) asks for that many slices
(multi-slice, over DCN). Reads no data: the vocabulary is the tokenizer file's when it exists, else model.vocab_size.
Exit 0 when the step fits, 1 (one line: what is needed, what helps) when it does not or on a user error.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
from sinkjax.cli import UserError

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
  token, times the step's tokens (forward + backward)."""
  from sinkjax.model import padded_vocab  # pylint: disable=import-outside-toplevel
  m, T = cfg.model, cfg.data.seq_len
  embedding = padded_vocab(m) * m.d_model
  per_token = 6 * (num_params - embedding) + 12 * m.num_layers * m.num_heads * m.head_dim * T
  return per_token * cfg.train.batch_size * T


def attention_kernel(hlo: str, impl: str) -> str:
  """Which attention kernel the compiled program holds, read from its HLO (not from the settings)."""
  if "tpu_custom_call" in hlo:
    return "mosaic"
  if "__gpu$xla.gpu.triton" in hlo:     # Pallas's Triton custom call; bare "triton" is also XLA:GPU's own GEMM fusions
    return "triton"
  if impl in ("pallas_tpu", "pallas_gpu") and "callback" in hlo:
    return "pallas-interpreter"
  return impl


def _memory(compiled) -> dict:
  ma = compiled.memory_analysis()
  out = {"arguments": ma.argument_size_in_bytes, "temporaries": ma.temp_size_in_bytes,
         "outputs": ma.output_size_in_bytes, "aliased": ma.alias_size_in_bytes,
         "generated_code": getattr(ma, "generated_code_size_in_bytes", 0)}
  out["total"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"] + out["generated_code"]
  return out


_OOM = re.compile(r"\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)")


def compile_config(cfg, topo: Topology, *, eval_step: bool = True, decode: tuple | None = None, devices=None) -> dict:
  """Compiles cfg's train (and eval) step for the topology, and with decode = (rows, capacity) the KV-cache decode
  step of `sinkjax.generate`; returns the report (see `main` for its keys)."""
  from sinkjax import sharding as sharding_lib  # pylint: disable=import-outside-toplevel
  from sinkjax.kernels import default_impl  # pylint: disable=import-outside-toplevel
  from sinkjax.train import Program  # pylint: disable=import-outside-toplevel
  if devices is None:
    devices = gpu_devices(topo) if topo.platform == "gpu" else tpu_devices(topo)
  mesh = sharding_lib.make_mesh(cfg.mesh, devices)
  program = Program(cfg, mesh)
  impl = cfg.model.attn_impl if cfg.model.attn_impl != "auto" else default_impl(sharding_lib.mesh_platform(mesh))
  rows_per_chip = program.micro // sharding_lib.batch_shards(mesh)
  report = {
      "topology": topo.name, "slices": topo.slices, "chips": len(devices), "device_kind": devices[0].device_kind,
      "mesh": dict(mesh.shape), "hbm_per_chip_bytes": topo.hbm_bytes, "num_params": program.num_params,
      "tokens_per_chip_per_micro_step": rows_per_chip * cfg.data.seq_len, "rows_per_chip": rows_per_chip,
      "grad_accum": cfg.train.grad_accum, "remat": cfg.model.remat,
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
  report["attention_kernel"] = attention_kernel(compiled.as_text(), impl)
  report["fits"] = report["per_chip_bytes"]["total"] <= topo.hbm_bytes
  if eval_step:
    try:
      report["eval_per_chip_bytes"] = _memory(eval_lowered.compile())
    except Exception as e:  # pylint: disable=broad-except
      report["eval_per_chip_bytes"] = {"error": " ".join(str(e).split())[:200]}
  if decode:
    report["decode_rows"], report["decode_capacity"] = decode
    try:
      report["decode_per_chip_bytes"] = _memory(program.lower_decode(*decode).compile())
    except Exception as e:  # pylint: disable=broad-except
      report["decode_per_chip_bytes"] = {"error": " ".join(str(e).split())[:200]}
  return report


def _gib(b) -> str:
  return f"{b / GIB:.2f}"


def print_report(config: str, r: dict) -> None:
  mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
  rows = [
      ("slice", f"{r['topology']}" + (f" x {r['slices']} slices" if r["slices"] > 1 else "")
       + f": {r['chips']} x {r['device_kind']}, {_gib(r['hbm_per_chip_bytes'])} GiB HBM each"),
      ("mesh", mesh),
      ("tokens / chip / micro-step", f"{r['tokens_per_chip_per_micro_step']:,} ({r['rows_per_chip']} rows; "
                                     f"train.grad_accum={r['grad_accum']}, model.remat={r['remat']})"),
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
  rows.append(("fits", "yes" if r["fits"] else "NO"))
  print(f"sinkjax.compile: {config}")
  for k, v in rows:
    print(f"  {k:<28} {v}")


TABLE_HEADER = ("| config (overrides) | slice | mesh | tokens / chip / micro-step | GiB per chip (args + temps) "
                "| HBM GiB | fits | attention | compile s |\n|---|---|---|---:|---:|---:|---|---|---:|")


def markdown_row(r: dict) -> str:
  """One row of docs/TPU.md's table from a --json report."""
  b = r["per_chip_bytes"]
  parts = f" ({_gib(b['arguments'])} + {_gib(b['temporaries'])})" if "arguments" in b else " (compiler's count)"
  mesh = "x".join(str(v) for v in r["mesh"].values())
  name = r.get("config", "?") + (" " + " ".join(r["overrides"]) if r.get("overrides") else "")
  return (f"| `{name}` | {r['topology']}{' x' + str(r['slices']) if r['slices'] > 1 else ''} | {mesh} | "
          f"{r['tokens_per_chip_per_micro_step']:,} | {_gib(b['total'])}{parts} | {_gib(r['hbm_per_chip_bytes'])} | "
          f"{'yes' if r['fits'] else 'no'} | {r['attention_kernel']} | {r['compile_seconds']:.0f} |")


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


def main(argv=None) -> int:
  from sinkjax import cli  # pylint: disable=import-outside-toplevel
  cli.require_extra("sinkjax.compile")   # it builds the trainer's step (sinkjax.train): the train extra
  parser = cli.Parser(prog="python -m sinkjax.compile",
                      description="Compile the training step of a config for a TPU slice or NVIDIA GPUs with "
                                  "compile-only devices (libtpu or JAX's CUDA plugin; no TPU or GPU needed) and report "
                                  "whether it fits the chips' memory.")
  parser.add_argument("--config", help="YAML config file (configs/...)")
  parser.add_argument("--topology",
                      help="v5e:4x8 | v5litepod-32 | v4-32 | v5p-64 | v6e-8 | 2xv5litepod-32 (two slices) ... | "
                           "h100:8 (one node of 8 NVIDIA H100) | h100:2x8 (nodes x GPUs)")
  parser.add_argument("--table", nargs="+", metavar="JSON",
                      help="instead of compiling: print the Markdown table of these --json reports (docs/TPU.md)")
  parser.add_argument("--json", default=None, metavar="FILE", help="also write the report as JSON")
  parser.add_argument("--no-eval", action="store_true", help="skip the eval step")
  parser.add_argument("--decode", metavar="ROWSxSLOTS", default=None,
                      help="also compile sinkjax.generate's decode step: ROWS sequences against a full KV cache of "
                           "SLOTS positions, e.g. 64x4096")
  parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
  args = parser.parse_args(argv)
  if args.table:
    print(TABLE_HEADER)
    for path in args.table:
      with open(path) as f:
        print(markdown_row(json.load(f)))
    return 0
  if not args.config or not args.topology:
    parser.error("--config and --topology are required (or --table JSON ...)")
  return cli.run_main("sinkjax.compile", lambda: _run(args), extra_errors=(CompileError,))


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


def _run(args) -> int:
  from sinkjax import config as config_lib  # pylint: disable=import-outside-toplevel
  topo = parse_topology(args.topology)
  if topo.platform == "gpu":
    prepare_gpu()
  cfg = config_lib.load_config(args.config, args.overrides)
  if cfg.train.init_from:             # fine-tuning: the model is the imported run's (its config.yaml alone is read)
    from sinkjax import run as run_lib  # pylint: disable=import-outside-toplevel
    run_lib.adopt_init_model(cfg)
  _vocab(cfg)
  report = compile_config(cfg, topo, eval_step=not args.no_eval, decode=_decode_shape(args.decode))
  report["config"] = args.config
  report["overrides"] = list(args.overrides)
  print_report(args.config + (" " + " ".join(args.overrides) if args.overrides else ""), report)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  if not report["fits"]:
    print(f"sinkjax.compile: {_hints(report)}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
