"""The paths a job on a TPU pod slice reads and writes must be in a bucket: checked before anything is launched.

    python -m sinkjax.pod_paths [--worker-local-paths] MODULE -- ARGS...

`launch/tpu_vm.sh run` / `babysit` run this on the launching machine with the program's arguments (so every launch
of the tpu study, `sinkjax.experiments.paper_tpu`, is checked too). The workers of a slice share
nothing but the bucket, and `~/sinkjax` on each is replaced by the next `setup`: a relative data, tokenizer or run
path there is never what a user means. Checked: for `sinkjax.train`, the config after its `base:` files and the
overrides (`data.source`, `data.val_source`, `data.tokenizer`, `data.tfds_dir` of a `tfds:` source,
`train.init_from`, `loss.shared_heads_from`, `run.dir`); for any module, those keys among its `key=value` overrides
and its `--checkpoint`, `--data` and `--tokenizer` flags. Each must be a bucket URL (gs://, s3://), empty or a special
value (`default`, `bytes`, `tfds:NAME`). An absolute local path passes with --worker-local-paths (a disk mounted on
every worker); a relative one never does. Prints nothing when the paths are sound; otherwise one line naming the
first key and the fix, exit status 2. Imports only the config (no JAX): it runs where the launcher runs.
"""
from __future__ import annotations

import os
import sys

from sinkjax import config as config_lib
from sinkjax import paths
from sinkjax.errors import ConfigError, UserError

# (config key, the values that are no path, an example of the bucket form)
KEYS = (("data.source", ("", "default"), "data.source=gs://BUCKET/data/fineweb-edu/shard_*.parquet"),
        ("data.val_source", ("",), "data.val_source=gs://BUCKET/data/fineweb-edu/val/shard_01822.parquet"),
        ("data.tokenizer", ("", "bytes"), "data.tokenizer=gs://BUCKET/data/tokenizer/tokenizer.json"),
        ("train.init_from", ("",), "train.init_from=gs://BUCKET/runs/NAME"),
        ("loss.shared_heads_from", ("",), "loss.shared_heads_from=gs://BUCKET/importance.json"),
        ("run.dir", (), "run.dir=gs://BUCKET/runs/NAME"))
FLAGS = {"--checkpoint": "gs://BUCKET/runs/NAME", "--data": "gs://BUCKET/data/FILE.jsonl",
         "--tokenizer": "gs://BUCKET/data/tokenizer/tokenizer.json"}


class PodPathError(ConfigError):
  """A path a pod job would resolve on its workers' own disks."""


def _check_one(what: str, value: str, fix: str, where: str, worker_local: bool) -> None:
  if paths.is_remote(value) or (worker_local and os.path.isabs(value)):
    return
  kind = "an absolute path on each worker's own disk" if os.path.isabs(value) else "a path relative to ~/sinkjax " \
      "on each worker, which the next setup replaces"
  hint = "; or --worker-local-paths for a disk every worker mounts" if os.path.isabs(value) else ""
  raise PodPathError(f"{what} is {value!r}{where}: on a pod slice that is {kind}; give the bucket's, e.g. {fix}{hint}")


def _get(cfg, dotted: str):
  section, key = dotted.split(".")
  return getattr(getattr(cfg, section), key)


def check_config(cfg, where: str = "", *, worker_local: bool = False) -> None:
  """PodPathError unless every path key of the resolved config `cfg` is in a bucket (or not a path)."""
  for key, specials, fix in KEYS:
    value = (_get(cfg, key) or "").strip()
    if value in specials or (key == "data.source" and value.startswith("tfds:")):
      continue
    _check_one(key, value, fix, where, worker_local)
  if cfg.data.source.strip().startswith("tfds:") and cfg.data.tfds_dir:
    _check_one("data.tfds_dir", cfg.data.tfds_dir, "data.tfds_dir=gs://BUCKET/tensorflow_datasets", where,
               worker_local)


def check(module: str, args, *, worker_local: bool = False, root: str | None = None) -> None:
  """PodPathError (one line) unless the paths `python -m module args` reads and writes on the workers are in a
  bucket. `root`: the checkout a relative --config resolves in (the workers run from their copy of it)."""
  args = list(args)
  config, overrides = None, []
  i = 0
  while i < len(args):
    a = args[i]
    flag, eq, value = a.partition("=")
    if flag.startswith("--") and flag in (*FLAGS, "--config"):
      if not eq:
        if i + 1 >= len(args):
          break                                  # the program's own parser will say so
        value = args[i + 1]
        i += 1
      if flag == "--config":
        config = value
      else:
        _check_one(flag, value, FLAGS[flag], "", worker_local)
    elif not a.startswith("-") and "=" in a and "." in a.split("=", 1)[0]:
      overrides.append(a)
    i += 1
  if module == "sinkjax.train" and config is not None:
    path = config if paths.is_remote(config) or os.path.isabs(config) else os.path.join(root or os.getcwd(), config)
    cfg = config_lib.load_config(path, overrides)
    check_config(cfg, f" (from {config} and the overrides)", worker_local=worker_local)
    return
  keys = {k: (specials, fix) for k, specials, fix in KEYS}
  for text in overrides:
    key, value = text.split("=", 1)
    if key in keys:
      specials, fix = keys[key]
      value = value.strip()
      if value in specials or (key == "data.source" and value.startswith("tfds:")):
        continue
      _check_one(key, value, fix, "", worker_local)


def main(argv=None) -> int:
  argv = sys.argv[1:] if argv is None else list(argv)
  worker_local = "--worker-local-paths" in argv[:2]
  if worker_local:
    argv.remove("--worker-local-paths")
  if len(argv) < 2 or argv[1] != "--":
    print("usage: python -m sinkjax.pod_paths [--worker-local-paths] MODULE -- ARGS...", file=sys.stderr)
    return 2
  try:
    check(argv[0], argv[2:], worker_local=worker_local,
          root=os.environ.get("SINKJAX_CHECKOUT") or os.getcwd())
  except UserError as e:                        # PodPathError, or the config itself is wrong (file, key, value)
    print(f"{e}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
