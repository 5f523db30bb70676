"""Why a different batch every step costs more than one batch re-sent (docs/journal.md, 2026-11-26, "H100,
second window": streaming_vanilla +52 ms per step): the trainer's step timed per batch, cycling, and with the embedding's
gradient computed another way, plus a profile of each for the kernels' times.

    python launch/gpu_batch_cost.py --config configs/streaming_vanilla.yaml [overrides] [--out DIR] [--steps 10]

Rows (ms per step, median of --rounds blocks of --steps steps, each block waited for):
  batch i        the jitted step on device batch i alone, i = 0..7 (the data's first eight batches)
  cycle          the eight in turn, one per step (what the trainer does)
Then the same with the token embedding looked up another way (--forms): `nnx-embed` as flax's nnx.Embed does it
(the table cast to the compute dtype, then gathered: the gradient a bf16 scatter-add of [B*T, d] into [V, d]; sinkjax
did this before 2026-11-26), `one-hot` (one_hot(tokens) @ E, the gradient a matmul), `library` (sinkjax's
`Transformer.embed_tokens` as it is: gathered from the float32 table, cast after, the scatter-add in float32); with
--profile a jax.profiler trace (trace.json.gz) of 5 steps on batch 0 and of 5 cycling steps of each form, in --out.
Per batch it prints the count of the commonest token id (the scatter's contention) and the number of documents.
(The logs in docs/results/gpu_h100/batch_cost/ name the forms as they were then: `take` for nnx-embed, `take-f32`
for library.)
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np


def _lookup(rows_of):
  """Transformer.embed_tokens with the rows looked up by rows_of(nnx.Embed module, tokens)."""
  def embed_tokens(self, tokens):
    from sinkjax import model as model_lib  # pylint: disable=import-outside-toplevel
    x = rows_of(self.embed, tokens)
    return model_lib._norm(x, self.cfg.norm_eps) if self.cfg.embed_norm else x  # pylint: disable=protected-access
  return embed_tokens


def _one_hot(embed, tokens):
  table = embed.embedding[...].astype(embed.dtype or embed.embedding[...].dtype)
  return jax.nn.one_hot(tokens, table.shape[0], dtype=table.dtype) @ table


FORMS = {"nnx-embed": _lookup(lambda embed, tokens: embed(tokens)), "one-hot": _lookup(_one_hot), "library": None}


def run(cfg_path, overrides, out: Path, steps: int, rounds: int, form: str, single: int, profile: bool) -> dict:
  from sinkjax.config import load_config  # pylint: disable=import-outside-toplevel
  from sinkjax.data import to_global_batch  # pylint: disable=import-outside-toplevel
  from sinkjax.step import TRAIN_FEATURES  # pylint: disable=import-outside-toplevel
  from sinkjax.train import Trainer  # pylint: disable=import-outside-toplevel
  from sinkjax import model as model_lib  # pylint: disable=import-outside-toplevel
  original = model_lib.Transformer.embed_tokens
  if FORMS[form] is not None:
    model_lib.Transformer.embed_tokens = FORMS[form]
  try:
    with tempfile.TemporaryDirectory(prefix="sinkjax-batch-cost-") as tmp:
      cfg = load_config(cfg_path, list(overrides) + [f"run.dir={tmp}/run", "train.eval_batches=0",
                                                     "checkpoint.async_save=false"])
      trainer = Trainer(cfg)
      host = [{k: v for k, v in next(trainer.train_iter).items() if k in TRAIN_FEATURES} for _ in range(8)]
      dev = [to_global_batch(b, trainer.batch_sh) for b in host]

      def block(batches, n):
        m = None
        for i in range(n):
          trainer.state, m = trainer.train_step(trainer.state, batches[i % len(batches)], trainer.rest)
        jax.block_until_ready(m)

      rows = {f"batch {i}": [dev[i]] for i in range(single)}
      rows["cycle"] = dev
      for b in rows.values():
        block(b, 2)
      walls = {name: [] for name in rows}
      for _ in range(rounds):
        for name, b in rows.items():
          t0 = time.perf_counter()
          block(b, steps)
          walls[name].append((time.perf_counter() - t0) / steps * 1e3)
      res = {name: statistics.median(w) for name, w in walls.items()}
      for name, b in (("fixed", [dev[0]]), ("cycle", dev)) if profile else ():
        d = Path(tempfile.mkdtemp(prefix="sinkjax-profile-"))
        with jax.profiler.trace(str(d), create_perfetto_trace=True):
          block(b, 5)
        for f in d.glob("plugins/profile/*/*.trace.json.gz"):
          f.rename(out / f"profile_{form}_{name}.trace.json.gz")
      stats = []
      for b in host:
        counts = np.bincount(np.asarray(b["inputs"]).ravel())
        seg = np.asarray(b["segment_ids"])
        docs = sum(len(np.unique(r[r > 0])) for r in seg)
        stats.append((int(counts.max()), int((counts > 0).sum()), docs))
      return {"ms": res, "stats": stats}
  finally:
    model_lib.Transformer.embed_tokens = original


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", required=True)
  p.add_argument("overrides", nargs="*")
  p.add_argument("--out", default="/tmp/sinkjax-batch-cost")
  p.add_argument("--steps", type=int, default=10)
  p.add_argument("--rounds", type=int, default=3)
  p.add_argument("--forms", nargs="+", default=list(FORMS), choices=list(FORMS))
  p.add_argument("--single", type=int, default=8, help="rows of one batch alone (0..8)")
  p.add_argument("--profile", action="store_true", help="write the traces")
  a = p.parse_args(argv)
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  print(f"# {a.config} {' '.join(a.overrides)} on {jax.devices()[0].device_kind}; {a.rounds} rounds of {a.steps} "
        "steps per row", flush=True)
  results = {form: run(a.config, a.overrides, out, a.steps, a.rounds, form, a.single, a.profile)
             for form in a.forms}
  names = list(next(iter(results.values()))["ms"])
  stats = next(iter(results.values()))["stats"]
  print("\n| row | commonest token count | distinct tokens | documents | "
        + " | ".join(f"ms/step, {f}" for f in a.forms) + " |")
  print("|---|---:|---:|---:|" + "---:|" * len(a.forms))
  for name in names:
    s = stats[int(name.split()[1])] if name.startswith("batch") else ("", "", "")
    print(f"| {name} | {s[0]} | {s[1]} | {s[2]} | " + " | ".join(f"{results[f]['ms'][name]:.2f}" for f in a.forms)
          + " |")
  return 0


if __name__ == "__main__":
  sys.exit(main())
