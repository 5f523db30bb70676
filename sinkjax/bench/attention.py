"""Benchmark: forward+backward time, peak memory and FLOP/s of each attention backend.

    python -m sinkjax.bench.attention [--seq 512 1024 ...] [--heads 4] [--head-dim 64] [--dtype float32]
        [--block-q 128 --block-k 64] [--block-q-dkv 64 --block-kv-dkv 64 --block-q-dq 64 --block-kv-dq 64]

Tiles: --block-q/--block-k set every pass (the `flash_attention(block_q=, block_k=)` shorthand); the four backward
options then override the dK/dV and dQ passes (`sinkjax.kernels.BlockSizes`). Unset tiles are the backend defaults.

The loss differentiates through both outputs (out and LSE), as sink-aware training does. Peak memory is XLA's
compiled memory analysis (temporaries + outputs + arguments of the fwd+bwd program); on GPU/TPU the device's
peak allocator statistic is shown too when available. FLOP/s counts the useful causal FLOPs:
fwd 2 matmuls + bwd 5 matmuls over the lower triangle = 7 * 2 * B*H*T^2*D / 2.

Rows `jax.nn.dpa` (XLA's own) and `jax.nn.cudnn` (`jax.nn.dot_product_attention(implementation="cudnn")`, GPUs
only) are stock kernels that return no LSE: they differentiate sum(out^2) alone, the speed a kernel gets by dropping
the LSE gradient that sink-aware training needs. Row `cudnn` is sinkjax's cuDNN backend (`sinkjax.kernels.cudnn`:
the same fused kernels, with the LSE gradient) and row `mosaic_gpu` tokamax's Mosaic-GPU kernels with the LSE gradient
(`sinkjax.kernels.mosaic_gpu`), so `--impls jax.nn.cudnn cudnn mosaic_gpu pallas_gpu` puts the cost of the LSE gradient,
the FA3-class kernel and the Triton kernel side by side. --kv-heads below --heads gives GQA / MQA shapes (K and V with fewer heads).
The last column is each row's time over the first backend's in --impls at the same T.

A backend with no form on this platform (cudnn and jax.nn.cudnn off an NVIDIA GPU, mosaic_gpu without tokamax off a
GPU, torch.sdpa without torch) gets a row saying it was skipped, as does a configuration over --max-gib or out of device
memory; a backend that fails to compile or run otherwise (on a GPU: any of them) gets a row with its error, the other
rows still run, and the exit status is 1.
"""
from __future__ import annotations

import dataclasses
import sys
import time

import jax
import jax.numpy as jnp

from sinkjax import options
from sinkjax.errors import ConfigError
from sinkjax.config import declare
from sinkjax.kernels import IMPLS, BlockSizes, default_impl, flash_attention

_BWD_TILES = ("block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq")
STOCK = ("jax.nn.dpa", "jax.nn.cudnn")     # stock kernels without an LSE


@dataclasses.dataclass
class AttentionBenchOptions:
  """The bench_attention.* options (`python -m sinkjax.bench.attention`; each flag the alias of its key)."""
  seq: list[int] = declare([512, 1024, 2048, 4096, 8192], ">=1", alias="--seq", nargs="+", metavar="T",
                       help="sequence lengths to time")
  batch: int = declare(1, ">=1", alias="--batch", help="rows")
  heads: int = declare(4, ">=1", alias="--heads", help="query heads")
  kv_heads: int | None = declare(None, ">=1", alias="--kv-heads", help="K/V heads (GQA; default: --heads)")
  head_dim: int = declare(64, ">=1", alias="--head-dim", help="head dimension")
  dtype: str = declare("float32", choices=("float32", "bfloat16"), alias="--dtype", help="q/k/v dtype")
  block_q: int | None = declare(None, ">=1", alias="--block-q", help="query tile of every pass (default: the backend's)")
  block_k: int | None = declare(None, ">=1", alias="--block-k", help="key tile of every pass (default: the backend's)")
  block_q_dkv: int | None = declare(None, ">=1", alias="--block-q-dkv",
                                help="block_q_dkv of BlockSizes: overrides --block-q/--block-k for that backward tile")
  block_kv_dkv: int | None = declare(None, ">=1", alias="--block-kv-dkv",
                                 help="block_kv_dkv of BlockSizes: overrides --block-q/--block-k for that backward "
                                      "tile")
  block_q_dq: int | None = declare(None, ">=1", alias="--block-q-dq",
                               help="block_q_dq of BlockSizes: overrides --block-q/--block-k for that backward tile")
  block_kv_dq: int | None = declare(None, ">=1", alias="--block-kv-dq",
                                help="block_kv_dq of BlockSizes: overrides --block-q/--block-k for that backward tile")
  repeats: int = declare(3, ">=1", alias="--repeats", help="timed runs per row (the fastest is shown)")
  impls: list[str] | None = declare(None, alias="--impls", nargs="+", metavar="IMPL",
                                help="backends to run (default: reference, xla, the platform's Pallas backend, "
                                     "jax.nn.dpa); also cudnn (sinkjax's cuDNN backend, GPU), jax.nn.cudnn (GPU) and "
                                     "torch.sdpa: stock fused attention, fwd+bwd without the LSE term")
  max_gib: float = declare(12.0, ">0", alias="--max-gib", help="skip configurations whose program needs more")


COMMAND = options.Command(prog="python -m sinkjax.bench.attention", description=__doc__,
                          sections={"bench_attention": AttentionBenchOptions},
                          raw_description=True)


def block_sizes(opts: AttentionBenchOptions) -> BlockSizes:
  """The tiles of the options: block_q/block_k for every pass, the backward tiles on top."""
  uniform = BlockSizes.uniform(opts.block_q, opts.block_k)
  bwd = {name: getattr(opts, name) for name in _BWD_TILES if getattr(opts, name) is not None}
  return dataclasses.replace(uniform, **bwd)


def _loss_fn(impl, blocks):
  if impl in STOCK:
    kind = "cudnn" if impl == "jax.nn.cudnn" else None

    def loss(q, k, v):
      out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=kind)
      return jnp.sum(out.astype(jnp.float32) ** 2)
    return loss

  def loss(q, k, v):
    out, lse = flash_attention(q, k, v, causal=True, impl=impl, block_sizes=blocks)
    return jnp.sum(out.astype(jnp.float32) ** 2) + jnp.sum(jax.nn.sigmoid(lse))
  return loss


def bench_one(impl, B, T, H, D, dtype, blocks, repeats, max_bytes, kv_heads=None):
  ks = jax.random.split(jax.random.PRNGKey(0), 3)
  q = jax.random.normal(ks[0], (B, T, H, D), dtype)
  k, v = (jax.random.normal(x, (B, T, kv_heads or H, D), dtype) for x in ks[1:])
  f = jax.jit(jax.value_and_grad(_loss_fn(impl, blocks), (0, 1, 2)))
  why = unavailable_here(impl, current_platform())
  if why:
    return dict(impl=impl, T=T, skipped=why)
  try:
    compiled = f.lower(q, k, v).compile()
  except Exception as e:  # pylint: disable=broad-except   # one failing backend must not hide the others' rows
    if "RESOURCE_EXHAUSTED" in str(e):          # e.g. the autotuner's buffers of a materialized T x T program
      return dict(impl=impl, T=T, skipped="out of device memory")
    return dict(impl=impl, T=T, error=f"{type(e).__name__}: {' '.join(str(e).split())[:160]}")
  mem = compiled.memory_analysis()
  peak = None
  if mem is not None:
    peak = mem.temp_size_in_bytes + mem.output_size_in_bytes + mem.argument_size_in_bytes
  if peak is not None and peak > max_bytes:
    return dict(impl=impl, T=T, skipped=f"needs {peak / 2**30:.1f} GiB")
  try:
    jax.block_until_ready(compiled(q, k, v))
  except Exception as e:  # pylint: disable=broad-except
    if "RESOURCE_EXHAUSTED" in str(e):
      return dict(impl=impl, T=T, skipped="out of device memory")
    return dict(impl=impl, T=T, error=f"{type(e).__name__}: {' '.join(str(e).split())[:160]}")
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v))
    times.append(time.perf_counter() - t0)
  t = min(times)
  flops = 7 * 2 * B * H * T * T * D / 2
  return dict(impl=impl, T=T, ms=t * 1e3, peak_mib=None if peak is None else peak / 2**20,
              tflops=flops / t / 1e12)


def current_platform() -> str:
  """The platform this process runs on ("gpu", "tpu", "cpu")."""
  return jax.default_backend()


def unavailable_here(impl: str, platform: str) -> str | None:
  """Why `impl` has no form on `platform` (a skipped row, not a failure), or None. On a GPU every backend has one."""
  if platform == "gpu":
    return None
  if impl in ("cudnn", "jax.nn.cudnn"):
    return "cuDNN runs only on NVIDIA GPUs"
  if impl == "mosaic_gpu":
    from sinkjax.kernels import mosaic_gpu  # pylint: disable=import-outside-toplevel
    try:
      mosaic_gpu._tokamax()  # pylint: disable=protected-access   # off a GPU its CPU form needs tokamax
    except ImportError as e:
      return " ".join(str(e).split())[:80]
  return None


def bench_torch(B, T, H, D, dtype, repeats):
  """PyTorch's `scaled_dot_product_attention` (causal; on a CPU its fused flash kernel), fwd+bwd of the same
  sum(out^2) loss, without an LSE term (torch returns none), in this process' torch threads; for comparison only."""
  try:
    import torch  # pylint: disable=import-outside-toplevel
  except ImportError:
    return dict(impl="torch.sdpa", T=T, skipped="torch is not installed: pip install torch")
  tdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[jnp.dtype(dtype).name]
  gen = torch.Generator().manual_seed(0)
  q, k, v = (torch.randn(B, H, T, D, generator=gen).to(tdtype).requires_grad_() for _ in range(3))

  def step():
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.autograd.grad(out.float().pow(2).sum(), (q, k, v))
  step()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    step()
    times.append(time.perf_counter() - t0)
  t = min(times)
  return dict(impl="torch.sdpa", T=T, ms=t * 1e3, peak_mib=None, tflops=7 * 2 * B * H * T * T * D / 2 / t / 1e12)


def _tiles_text(blocks: BlockSizes) -> str:
  given = {k: v for k, v in dataclasses.asdict(blocks).items() if v is not None}
  return " ".join(f"{k}={v}" for k, v in given.items()) or "backend defaults"


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, _: run(sections["bench_attention"]))


def _default_impls(dtype) -> list[str]:
  """reference, xla, the platform's auto backend for `dtype` (cudnn / mosaic_gpu take bf16 / f16 only), jax.nn.dpa."""
  auto = default_impl()
  if auto in ("cudnn", "mosaic_gpu") and jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    auto = "pallas_gpu"                           # what impl="auto" falls back to for such a call
  return ["reference", "xla"] + ([auto] if auto != "xla" else []) + ["jax.nn.dpa"]


def run(opts: AttentionBenchOptions) -> int:
  """Times every backend at every sequence length and prints one row each; 1 when a backend failed."""
  try:
    blocks = block_sizes(opts)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  dtype = jnp.dtype(opts.dtype)
  impls = opts.impls or _default_impls(dtype)
  unknown = [i for i in opts.impls or () if i not in (*IMPLS, *STOCK, "torch.sdpa")]
  if unknown:
    raise ConfigError(f"--impls: unknown backend(s) {' '.join(unknown)}; choose from "
                      f"{' '.join((*IMPLS, *STOCK, 'torch.sdpa'))}")
  if opts.kv_heads and opts.heads % opts.kv_heads:
    raise ConfigError(f"--heads {opts.heads} is not a multiple of --kv-heads {opts.kv_heads}")
  print(f"# attention fwd+bwd, causal, B={opts.batch} H={opts.heads} KV={opts.kv_heads or opts.heads} "
        f"D={opts.head_dim} {opts.dtype}, "
        f"platform={current_platform()} ({jax.devices()[0].device_kind}), tiles {_tiles_text(blocks)}")
  print(f"{'T':>6} {'backend':>12} {'time ms':>10} {'peak MiB':>10} {'TFLOP/s':>9} {'vs ' + impls[0]:>14}")
  failed = []
  for T in opts.seq:
    ref_ms = None
    for impl in impls:
      if impl == "torch.sdpa" and opts.kv_heads not in (None, opts.heads):
        r = dict(impl=impl, T=T, skipped="GQA shapes are not timed for torch here")
      elif impl == "torch.sdpa":
        r = bench_torch(opts.batch, T, opts.heads, opts.head_dim, dtype, opts.repeats)
      else:
        r = bench_one(impl, opts.batch, T, opts.heads, opts.head_dim, dtype, blocks, opts.repeats,
                      opts.max_gib * 2**30, opts.kv_heads)
      if "error" in r:
        failed.append(f"{impl} (T={T})")
        print(f"{T:>6} {impl:>12} {'-':>10} {'-':>10} {'-':>9} {'-':>14}  (FAILED: {r['error']})", flush=True)
        continue
      if "skipped" in r:
        print(f"{T:>6} {impl:>12} {'-':>10} {'-':>10} {'-':>9} {'-':>14}  ({r['skipped']})")
        continue
      if impl == impls[0]:
        ref_ms = r["ms"]
      rel = f"{r['ms'] / ref_ms:.2f}x" if ref_ms else "-"
      peak = f"{r['peak_mib']:.1f}" if r["peak_mib"] is not None else "n/a"
      print(f"{T:>6} {impl:>12} {r['ms']:>10.1f} {peak:>10} {r['tflops']:>9.4f} {rel:>14}", flush=True)
  if failed:
    print(f"{len(failed)} FAILED: {' '.join(failed)}")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
