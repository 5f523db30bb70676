"""Throughput of the data pipeline: `python -m sinkjax.bench.data [--seconds S] [--workers 0 2] [--source SRC]`.

Builds the training iterator (default corpus, bytes tokenizer, batch 16 unless told otherwise) for seq_len 256 and
1024, pulls batches for a fixed wall time after a short warm-up, and prints a Markdown table of tokens/s
(tokens = batch x seq_len input positions per batch) together with the start-up time to the first batch.
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":
  errors.require_extra("sinkjax.bench.data")   # before the imports below, which need the train extra

import dataclasses
import os
import platform
import sys
import time

from sinkjax import options
from sinkjax.config import DataConfig, declare
from sinkjax.data import build_tokenizer, make_train_iterator
from sinkjax.markdown import table


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


@dataclasses.dataclass
class DataBenchOptions:
  """The bench_data.* options (`python -m sinkjax.bench.data`; each flag the alias of its key)."""
  source: str = declare("default", alias="--source", help="data.source (default: the embedded corpus)")
  tokenizer: str = declare("bytes", alias="--tokenizer", help="data.tokenizer")
  seq_len: list[int] = declare([256, 1024], ">=1", alias="--seq-len", nargs="+", metavar="T",
                           help="data.seq_len values to try")
  batch: int = declare(16, ">=1", alias="--batch", help="rows per batch")
  workers: list[int] = declare([0, 2], ">=0", alias="--workers", nargs="+", metavar="N",
                           help="data.num_workers values to try")
  prefetch: int = declare(2, ">=1", alias="--prefetch", help="data.prefetch")
  seconds: float = declare(5.0, ">0", alias="--seconds", help="measured wall time per configuration")


COMMAND = options.Command(prog="python -m sinkjax.bench.data", description=__doc__.splitlines()[0],
                          sections={"bench_data": DataBenchOptions})


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, _: print_table(sections["bench_data"]))


def print_table(opts: DataBenchOptions) -> None:
  """Measures every seq_len x workers configuration, then prints the Markdown table."""
  rows = [measure(DataConfig(source=opts.source, tokenizer=opts.tokenizer, seq_len=seq_len, num_workers=workers,
                             prefetch=opts.prefetch), opts.batch, opts.seconds)
          for seq_len in opts.seq_len for workers in opts.workers]
  print(f"data pipeline throughput: source={opts.source} tokenizer={opts.tokenizer} batch={opts.batch} "
        f"prefetch={opts.prefetch}; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"Python {platform.python_version()}")
  print()
  print("\n".join(table(["seq_len", "batch", "workers", "first batch (s)", "batches", "batches/s", "tokens/s",
                         "loss-mask fraction"],
                        ([r["seq_len"], r["batch"], r["workers"], f"{r['first_s']:.2f}", r["batches"],
                          f"{r['batches_per_s']:.1f}", f"{r['tokens_per_s']:,.0f}", f"{r['loss_frac']:.4f}"]
                         for r in rows), "r" * 8)))


if __name__ == "__main__":
  sys.exit(main())
