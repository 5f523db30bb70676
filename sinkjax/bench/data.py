"""Throughput of the data pipeline: `python -m sinkjax.bench.data [--seconds S] [--workers 0 2] [--source SRC]`.

Builds the training iterator (default corpus, bytes tokenizer, batch 16 unless told otherwise) for seq_len 256 and
1024, pulls batches for a fixed wall time after a short warm-up, and prints a Markdown table of tokens/s
(tokens = batch x seq_len input positions per batch) together with the start-up time to the first batch.
"""
from __future__ import annotations

from sinkjax import cli

if __name__ == "__main__":
  cli.require_extra("sinkjax.bench.data")   # before the imports below, which need the train extra

import os
import platform
import sys
import time

from sinkjax.config import DataConfig
from sinkjax.data import build_tokenizer, make_train_iterator


def measure(cfg: DataConfig, batch_size: int, seconds: float, warmup: int = 3) -> dict:
  tok = build_tokenizer(cfg)
  t0 = time.perf_counter()
  it = make_train_iterator(cfg, tok, batch_size=batch_size, seed=0, process_index=0, process_count=1)
  try:
    next(it)
    first = time.perf_counter() - t0
    for _ in range(warmup):
      next(it)
    n, real = 0, 0.0
    t1 = time.perf_counter()
    while time.perf_counter() - t1 < seconds:
      b = next(it)
      n += 1
      real += float(b["loss_mask"].sum())
    dt = time.perf_counter() - t1
  finally:
    it.close()
  tokens = n * batch_size * cfg.seq_len
  return {"seq_len": cfg.seq_len, "batch": batch_size, "workers": cfg.num_workers, "first_s": first,
          "batches": n, "tokens_per_s": tokens / dt, "batches_per_s": n / dt, "loss_frac": real / max(tokens, 1)}


def main(argv=None) -> int:
  p = cli.Parser(prog="python -m sinkjax.bench.data", description=__doc__.splitlines()[0])
  p.add_argument("--source", default="default", help="data.source (default: the embedded corpus)")
  p.add_argument("--tokenizer", default="bytes", help="data.tokenizer")
  p.add_argument("--seq-len", type=int, nargs="+", default=[256, 1024])
  p.add_argument("--batch", type=int, default=16)
  p.add_argument("--workers", type=int, nargs="+", default=[0, 2], help="data.num_workers values to try")
  p.add_argument("--prefetch", type=int, default=2)
  p.add_argument("--seconds", type=float, default=5.0, help="measured wall time per configuration")
  args = p.parse_args(argv)
  return cli.run_main("sinkjax.bench.data", lambda: print_table(args))


def print_table(args) -> None:
  """Measures every seq_len x workers configuration, then prints the Markdown table."""
  rows = [measure(DataConfig(source=args.source, tokenizer=args.tokenizer, seq_len=seq_len, num_workers=workers,
                             prefetch=args.prefetch), args.batch, args.seconds)
          for seq_len in args.seq_len for workers in args.workers]
  print(f"data pipeline throughput: source={args.source} tokenizer={args.tokenizer} batch={args.batch} "
        f"prefetch={args.prefetch}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}")
  print()
  print("| seq_len | batch | workers | first batch (s) | batches | batches/s | tokens/s | loss-mask fraction |")
  print("|---:|---:|---:|---:|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['seq_len']} | {r['batch']} | {r['workers']} | {r['first_s']:.2f} | {r['batches']} | "
          f"{r['batches_per_s']:.1f} | {r['tokens_per_s']:,.0f} | {r['loss_frac']:.4f} |")


if __name__ == "__main__":
  sys.exit(main())
