"""FineWeb-Edu for the paper's from-scratch runs: how many shards a config needs, and a resumable download.

    python -m sinkjax.data.fineweb --tokens-for configs/paper/d20_sink_aux.yaml [section.key=value ...]
    python -m sinkjax.data.fineweb --shards 217 --out data/fineweb-edu            # or --out gs://BUCKET/data/fineweb-edu
    python -m sinkjax.data.fineweb --tokens-for configs/paper/d20_sink_aux.yaml --out gs://BUCKET/data/fineweb-edu

The copy is nanochat's (`nanochat/dataset.py` at 9d4c9b7): karpathy/fineweb-edu-100b-shuffle on the Hugging Face
hub, FineWeb-Edu's sample-100BT (HuggingFaceFW/fineweb-edu, [Sink-MoE] §5.1's corpus) shuffled and repacked into
1,823 parquet files `shard_00000.parquet` ... `shard_01822.parquet` (column `text`) of about 250 million characters
each (nanochat's repackaging script). nanochat validates on the last file; so does this command: `--shards N` fetches
the training shards 0 .. N-2 into OUT and the last shard (01822) into OUT/val, which the paper configs read as

    data.source=OUT/shard_*.parquet data.val_source=OUT/val/shard_01822.parquet

(unlike nanochat, whose validation file is the last one *downloaded*, this one is the same however many are
fetched). A shard already in OUT is skipped; a partial download (OUT/NAME.tmp, local OUT only) continues with an HTTP
range request where the server allows one, else starts again; a file appears under its name only when complete.

`--tokens-for CONFIG` prints what the config trains on: its parameters (model.vocab_size, else the tokenizer's, else
nanochat's 65,536), steps (train.steps, else train.tokens_per_param x parameters / tokens per step: 20 tokens per
parameter in the paper configs), the tokens those steps read, the characters that is at `--chars-per-token`
(nanochat's 4.8 for its 65,536-token BPE on this corpus, an estimate: measure yours with sinkjax.data.tokenizer), and
the shards: ceil(characters / 250e6) training shards + 1 validation shard. Given --out as well, it downloads them.
"""
from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request

from sinkjax import errors, options, paths
from sinkjax.config import declare

BASE_URL = "https://huggingface.co/datasets/karpathy/fineweb-edu-100b-shuffle/resolve/main"
NUM_SHARDS = 1823                    # shard_00000 ... shard_01822 (nanochat's MAX_SHARD = 1822)
CHARS_PER_SHARD = 250_000_000        # nanochat's repackaging: each shard holds about this many characters
CHARS_PER_TOKEN = 4.8                # nanochat's estimate for its 65,536-token BPE on this corpus
DEFAULT_VOCAB = 65_536               # nanochat's tokenizer (the paper configs take the tokenizer's vocabulary)
ATTEMPTS = 5
CHUNK = 1 << 20


def shard_name(index: int) -> str:
  return f"shard_{index:05d}.parquet"


def shards_for_tokens(tokens: int, chars_per_token: float = CHARS_PER_TOKEN,
                      chars_per_shard: int = CHARS_PER_SHARD) -> int:
  """Training shards that hold `tokens` tokens at `chars_per_token` (the validation shard not counted)."""
  return max(1, math.ceil(tokens * chars_per_token / chars_per_shard))


def plan(cfg, vocab_size: int | None = None, chars_per_token: float = CHARS_PER_TOKEN) -> dict:
  """What a config trains on: {params, vocab_size, steps, tokens, chars, train_shards, shards (with validation)}."""
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from sinkjax.model import Transformer, count_params  # pylint: disable=import-outside-toplevel
  from sinkjax.train import total_steps  # pylint: disable=import-outside-toplevel
  m = cfg.model
  if m.vocab_size == 0:
    m.vocab_size = vocab_size or _tokenizer_vocab(cfg) or DEFAULT_VOCAB
  abstract = nnx.eval_shape(lambda: Transformer(m, rngs=nnx.Rngs(0)))
  params = count_params(abstract)
  steps = total_steps(cfg, params)
  tokens = steps * cfg.train.batch_size * cfg.data.seq_len
  chars = tokens * chars_per_token
  train_shards = shards_for_tokens(tokens, chars_per_token)
  return {"params": params, "vocab_size": m.vocab_size, "steps": steps, "tokens": tokens, "chars": chars,
          "train_shards": train_shards, "shards": train_shards + 1}


def _tokenizer_vocab(cfg) -> int | None:
  """The vocabulary of data.tokenizer when it can be read here, else None."""
  if cfg.data.tokenizer == "bytes":
    return None
  try:
    from sinkjax.data.tokenizers import build_tokenizer  # pylint: disable=import-outside-toplevel
    return build_tokenizer(cfg.data).vocab_size
  except Exception:  # pylint: disable=broad-except  # not downloaded / trained yet: nanochat's size
    return None


# ------------------------------------------------------------------------------------------------------ download
def _fetch(url: str, tmp: pathlib.Path) -> None:
  """Downloads url into tmp, continuing a partial tmp with a range request (a server answering 200 restarts it)."""
  have = tmp.stat().st_size if tmp.exists() else 0
  req = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
  with urllib.request.urlopen(req, timeout=60) as resp:    # noqa: S310 (an https URL or the user's --base-url)
    mode = "ab" if have and resp.status == 206 else "wb"
    with open(tmp, mode) as f:
      while chunk := resp.read(CHUNK):
        f.write(chunk)


def download_shard(index: int, out: str, base_url: str = BASE_URL, log=print, sleep=time.sleep) -> str:
  """OUT/shard_NNNNN.parquet (or OUT/val/... for the last shard) downloaded unless already there; returns its path."""
  name = shard_name(index)
  dest = f"{out.rstrip('/')}/{'val/' if index == NUM_SHARDS - 1 else ''}{name}"
  if paths.as_path(dest).exists():
    log(f"  {name}: already in {dest}")
    return dest
  url = f"{base_url.rstrip('/')}/{name}"
  remote = paths.is_remote(dest)
  with tempfile.TemporaryDirectory(prefix="sinkjax-fineweb-") as staging:
    tmp = pathlib.Path(staging if remote else os.path.dirname(dest)) / (name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(1, ATTEMPTS + 1):
      try:
        _fetch(url, tmp)
        break
      except urllib.error.HTTPError as e:
        if e.code not in (408, 429) and e.code < 500:
          raise errors.UserError(f"{url} answered HTTP {e.code} ({e.reason}); check --base-url and the shard "
                              f"range (0 .. {NUM_SHARDS - 1})") from None
        why = f"HTTP {e.code}"
      except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e) if isinstance(e, urllib.error.URLError) else e
        if isinstance(reason, socket.gaierror):        # no name resolution: retrying will not help, say so now
          host = urllib.parse.urlsplit(url).hostname
          raise errors.UserError(f"cannot resolve {host} ({reason.strerror or reason}): this machine has no DNS for "
                              "it (offline, or a closed network); download on a machine with internet access, or "
                              "point --base-url at a mirror you can reach (HF_ENDPOINT / a proxy)") from None
        why = paths.describe(reason)
      if attempt == ATTEMPTS:
        raise errors.UserError(f"{url} failed {ATTEMPTS} times (last: {why}); rerun to resume, or check the network "
                            "(HF_ENDPOINT / a proxy) and --base-url") from None
      log(f"  {name}: attempt {attempt} failed ({why}); retrying in {2 ** attempt} s")
      sleep(2 ** attempt)
    if remote:
      paths.copy_file(str(tmp), dest)
    else:
      os.replace(tmp, dest)
  log(f"  {name}: {dest}")
  return dest


def download(num_shards: int, out: str, base_url: str = BASE_URL, log=print) -> list[str]:
  """The first num_shards - 1 training shards and the validation shard (the last) into OUT; returns their paths."""
  if not 2 <= num_shards <= NUM_SHARDS:
    raise errors.UserError(f"--shards must be in [2, {NUM_SHARDS}] (training shards + the validation shard), "
                        f"got {num_shards}")
  paths.check_bucket(out, "--out")
  indices = list(range(num_shards - 1)) + [NUM_SHARDS - 1]
  log(f"sinkjax.data.fineweb: {num_shards - 1} training shard(s) + validation shard {NUM_SHARDS - 1} from "
      f"{base_url} into {out}")
  return [download_shard(i, out, base_url, log) for i in indices]


# ----------------------------------------------------------------------------------------------------------- CLI
@dataclasses.dataclass
class FineWebOptions:
  """The fineweb.* options (`python -m sinkjax.data.fineweb`; each flag the alias of its key)."""
  tokens_for: str = declare("", alias="--tokens-for", metavar="CONFIG",
                        help="a training config: print its parameters, steps, tokens and the shards they need "
                             "(downloaded too when --out is given); section.key=value words override it")
  shards: int | None = declare(None, ">=2", alias="--shards", metavar="N",
                           help="shards to download: N - 1 training shards and the validation shard (at most "
                                f"{NUM_SHARDS})")
  out: str = declare("", alias="--out", help="directory or gs:// / s3:// prefix to download into (validation shard in "
                                         "OUT/val)")
  vocab_size: int | None = declare(None, ">=1", alias="--vocab-size", metavar="N",
                               help="vocabulary for the parameter count when the config has none and its tokenizer is "
                                    f"not there yet (default {DEFAULT_VOCAB:,}, nanochat's)")
  chars_per_token: float = declare(CHARS_PER_TOKEN, ">0", alias="--chars-per-token", metavar="C",
                               help="characters per token of the tokenizer on FineWeb-Edu (nanochat's)")
  base_url: str = declare(BASE_URL, alias="--base-url", metavar="URL", help="where shard_NNNNN.parquet files are served")


COMMAND = options.Command(
    prog="python -m sinkjax.data.fineweb", sections={"fineweb": FineWebOptions}, run_overrides=True,
    description="FineWeb-Edu shards (nanochat's copy, karpathy/fineweb-edu-100b-shuffle): the number a config needs "
                "at its tokens per parameter, and a resumable download to a local directory or a bucket.")


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, overrides: plan_and_download(sections["fineweb"], overrides))


def plan_and_download(opts: FineWebOptions, overrides: list[str] | tuple = ()) -> int:
  """Prints opts.tokens_for's plan (its config with `overrides`) and / or downloads the shards into opts.out."""
  if overrides and not opts.tokens_for:
    raise errors.UserError(f"overrides {' '.join(overrides)} need --tokens-for CONFIG")
  if not opts.tokens_for and (opts.shards is None or not opts.out):
    raise errors.UserError("give --tokens-for CONFIG (the shards a config needs) or --shards N --out DIR")
  num = opts.shards
  if opts.tokens_for:
    from sinkjax import config as config_lib  # pylint: disable=import-outside-toplevel
    cfg = config_lib.load_config(opts.tokens_for, overrides)
    pl = plan(cfg, opts.vocab_size, opts.chars_per_token)
    print(f"{opts.tokens_for}: {pl['params']:,} parameters (vocabulary {pl['vocab_size']:,}), {pl['steps']:,} steps "
          f"x {cfg.train.batch_size * cfg.data.seq_len:,} tokens = {pl['tokens']:,} tokens "
          f"({pl['tokens'] / pl['params']:.2f} per parameter) ~ {pl['chars'] / 1e9:.1f}e9 characters at "
          f"{opts.chars_per_token} per token: {pl['train_shards']} training shard(s) of "
          f"{CHARS_PER_SHARD / 1e6:.0f}e6 characters + 1 validation shard = --shards {pl['shards']}")
    num = num or pl["shards"]
  if opts.out:
    download(num, opts.out, opts.base_url)
  return 0


if __name__ == "__main__":
  sys.exit(main())
