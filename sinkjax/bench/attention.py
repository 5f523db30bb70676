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
the same fused kernels, with the LSE gradient), so `--impls jax.nn.cudnn cudnn pallas_gpu` puts the cost of the LSE
gradient and the Triton kernel side by side. --kv-heads below --heads gives GQA / MQA shapes (K and V with fewer heads).
The last column is each row's time over the first backend's in --impls at the same T.
"""
from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from sinkjax import cli
from sinkjax.kernels import BlockSizes, default_impl, flash_attention

_BWD_TILES = ("block_q_dkv", "block_kv_dkv", "block_q_dq", "block_kv_dq")
STOCK = ("jax.nn.dpa", "jax.nn.cudnn")     # stock kernels without an LSE


def block_sizes(args) -> BlockSizes:
  """The tiles from the command line: --block-q/--block-k for every pass, the backward options on top."""
  uniform = BlockSizes.uniform(args.block_q, args.block_k)
  bwd = {name: getattr(args, name) for name in _BWD_TILES if getattr(args, name) is not None}
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
  try:
    compiled = f.lower(q, k, v).compile()
  except jax.errors.JaxRuntimeError as e:       # e.g. the autotuner's buffers of a materialized T x T program
    if "RESOURCE_EXHAUSTED" not in str(e):
      raise
    return dict(impl=impl, T=T, skipped="out of device memory")
  except (NotImplementedError, ValueError, RuntimeError) as e:    # cuDNN off a GPU, or a shape it does not take
    if impl not in ("jax.nn.cudnn", "cudnn"):
      raise
    return dict(impl=impl, T=T, skipped=" ".join(str(e).split())[:80])
  mem = compiled.memory_analysis()
  peak = None
  if mem is not None:
    peak = mem.temp_size_in_bytes + mem.output_size_in_bytes + mem.argument_size_in_bytes
  if peak is not None and peak > max_bytes:
    return dict(impl=impl, T=T, skipped=f"needs {peak / 2**30:.1f} GiB")
  jax.block_until_ready(compiled(q, k, v))
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(q, k, v))
    times.append(time.perf_counter() - t0)
  t = min(times)
  flops = 7 * 2 * B * H * T * T * D / 2
  return dict(impl=impl, T=T, ms=t * 1e3, peak_mib=None if peak is None else peak / 2**20,
              tflops=flops / t / 1e12)


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


def main(argv=None):
  p = cli.Parser(prog="python -m sinkjax.bench.attention", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--heads", type=int, default=4)
  p.add_argument("--kv-heads", type=int, default=None, help="K/V heads (GQA; default: --heads)")
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  p.add_argument("--block-q", type=int, default=None, help="query tile of every pass (default: the backend's)")
  p.add_argument("--block-k", type=int, default=None, help="key tile of every pass (default: the backend's)")
  for name in _BWD_TILES:
    p.add_argument("--" + name.replace("_", "-"), dest=name, type=int, default=None,
                   help=f"{name} of BlockSizes: overrides --block-q/--block-k for that backward tile")
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--impls", nargs="+", default=None,
                 help="backends to run (default: reference, xla, the platform's Pallas backend, jax.nn.dpa); "
                      "also cudnn (sinkjax's cuDNN backend, GPU), jax.nn.cudnn (GPU) and torch.sdpa: stock fused "
                      "attention, fwd+bwd without the LSE term")
  p.add_argument("--max-gib", type=float, default=12.0, help="skip configurations whose program needs more")
  args = p.parse_args(argv)
  try:
    blocks = block_sizes(args)
  except ValueError as e:
    p.error(str(e))
  platform = jax.default_backend()
  impls = args.impls or ["reference", "xla"] + ([default_impl()] if default_impl() != "xla" else []) + ["jax.nn.dpa"]
  dtype = jnp.dtype(args.dtype)
  if args.kv_heads and args.heads % args.kv_heads:
    p.error(f"--heads {args.heads} is not a multiple of --kv-heads {args.kv_heads}")
  print(f"# attention fwd+bwd, causal, B={args.batch} H={args.heads} KV={args.kv_heads or args.heads} "
        f"D={args.head_dim} {args.dtype}, "
        f"platform={platform} ({jax.devices()[0].device_kind}), tiles {_tiles_text(blocks)}")
  print(f"{'T':>6} {'backend':>12} {'time ms':>10} {'peak MiB':>10} {'TFLOP/s':>9} {'vs ' + impls[0]:>14}")
  for T in args.seq:
    ref_ms = None
    for impl in impls:
      if impl == "torch.sdpa" and args.kv_heads not in (None, args.heads):
        r = dict(impl=impl, T=T, skipped="GQA shapes are not timed for torch here")
      elif impl == "torch.sdpa":
        r = bench_torch(args.batch, T, args.heads, args.head_dim, dtype, args.repeats)
      else:
        r = bench_one(impl, args.batch, T, args.heads, args.head_dim, dtype, blocks, args.repeats,
                      args.max_gib * 2**30, args.kv_heads)
      if "skipped" in r:
        print(f"{T:>6} {impl:>12} {'-':>10} {'-':>10} {'-':>9} {'-':>14}  ({r['skipped']})")
        continue
      if impl == impls[0]:
        ref_ms = r["ms"]
      rel = f"{r['ms'] / ref_ms:.2f}x" if ref_ms else "-"
      peak = f"{r['peak_mib']:.1f}" if r["peak_mib"] is not None else "n/a"
      print(f"{T:>6} {impl:>12} {r['ms']:>10.1f} {peak:>10} {r['tflops']:>9.4f} {rel:>14}", flush=True)


if __name__ == "__main__":
  main()
