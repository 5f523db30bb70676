"""Run under launch/local.sh (tests/test_multihost.py): each process holds rows of a different used length and
`eval.sized_batches` must cut every process' rows to the same length, the longest of all (prints one JSON line)."""
import json
import sys

import jax
import numpy as np

from sinkjax import distributed


def main() -> None:
  distributed.maybe_initialize()
  from sinkjax import config, eval as ev   # pylint: disable=import-outside-toplevel,redefined-builtin
  cfg = config.load_config(sys.argv[sys.argv.index("--config") + 1], ["model.num_layers=2", "model.d_model=32", "model.num_heads=2",
                                                 "model.num_kv_heads=2", "model.head_dim=16"])
  used = (70, 150)[jax.process_index()]        # tokens used per row: process 1's rows are the longer ones
  rows, T = 4, 256
  seg = np.zeros((rows, T), np.int32)
  seg[:, :used] = 1
  batch = {"inputs": seg, "targets": seg, "segment_ids": seg, "positions": np.tile(np.arange(T, dtype=np.int32), (rows, 1)),
           "loss_mask": seg.astype(np.float32), "target_bytes": seg}
  assert set(batch) == set(ev.MODEL_FEATURES)
  out, _, plan = ev.sized_batches([batch], cfg.model, batch_rows=None, default_rows=rows, budget=1 << 30)
  print(json.dumps({"process": jax.process_index(), "seq_len": plan["seq_len"],
                    "shapes": [list(np.shape(b["segment_ids"])) for b in out]}), flush=True)


if __name__ == "__main__":
  sys.exit(main())
