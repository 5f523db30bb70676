"""Passkey retrieval's texts: a number hidden at a chosen depth of filler text and asked for at the end (the probe:
`sinkjax.experiments.passkey`), and a training mix that teaches a small model the task.

    python -m sinkjax.data.passkey --out OUT.jsonl [--docs 20000] [--max-len 512] [--text-fraction 0.3] [--seed 0]

The mix: `--docs` passkey documents (prompt + key + ".", random key and depth, up to `--max-len` bytes) shuffled with
chunks of the embedded corpus's training split (its validation files stay held out), `--text-fraction` of the bytes;
one JSONL record {"text": ...} per document (train on it with data.source=OUT.jsonl). docs/STREAMING.md, "Passkey
retrieval by cache".
"""
from __future__ import annotations

import dataclasses
import json
import sys

import numpy as np

from sinkjax import options, paths
from sinkjax.config import declare
from sinkjax.data.sources import DataError, DefaultSource

FILLER = ("The grass is green. ", "The sky is blue. ", "The sun is yellow. ", "Here we go. ",
          "There and back again. ")
# The key is marked with "#" so that a byte-level model finds it by the previous token alone (one-token induction):
# a tiny model trained for minutes on a CPU did not learn to match the classic "...pass key is " context (with
# "The sky is" in the filler it must look five bytes back) within 500 steps; with the marker it does.
NEEDLE = "The pass key is #{key}. Remember it. #{key} is the pass key. "
QUESTION = "What is the pass key? The pass key is #"
KEY_DIGITS = 5


def random_key(rng: np.random.Generator) -> str:
  return str(rng.integers(10 ** (KEY_DIGITS - 1), 10 ** KEY_DIGITS))


def passkey_text(key: str, num_sentences: int, depth: float) -> tuple[str, str]:
  """(prompt, answer) with `num_sentences` filler sentences and the needle after round(depth * num_sentences)."""
  before = round(depth * num_sentences)
  filler = [FILLER[i % len(FILLER)] for i in range(num_sentences)]
  return "".join(filler[:before]) + NEEDLE.format(key=key) + "".join(filler[before:]) + QUESTION, key


def training_documents(docs: int, max_len: int, text_fraction: float, seed: int) -> list[str]:
  """`docs` passkey documents (prompt + key + "."), lengths spread up to `max_len` bytes, shuffled together with
  chunks of the embedded corpus's training split adding up to `text_fraction` of all bytes."""
  rng = np.random.default_rng(seed)
  bare = len(passkey_text("0" * KEY_DIGITS, 0, 0.0)[0]) + KEY_DIGITS + 1
  per_sentence = np.mean([len(s) for s in FILLER])
  most = max(0, int((max_len - bare) / per_sentence))
  out = []
  for _ in range(docs):
    prompt, key = passkey_text(random_key(rng), int(rng.integers(0, most + 1)), float(rng.random()))
    out.append(prompt + key + ".")
  key_bytes = sum(len(d) for d in out)
  want = key_bytes * text_fraction / (1 - text_fraction) if text_fraction < 1 else 0
  out += corpus_chunks(int(want), max_len, rng)
  rng.shuffle(out)
  return out


def corpus_chunks(total: int, chunk: int, rng: np.random.Generator) -> list[str]:
  """About `total` characters of the embedded corpus's training split, in random chunks of `chunk` characters."""
  src = DefaultSource("train", 0.02)
  out, got = [], 0
  while got < total:
    text = src[int(rng.integers(len(src)))][0]
    if len(text) <= chunk:
      continue
    start = int(rng.integers(len(text) - chunk))
    out.append(text[start:start + chunk])
    got += chunk
  return out


@dataclasses.dataclass
class PasskeyDataOptions:
  """The options of `python -m sinkjax.data.passkey`: the training mix it writes."""
  out: str = declare("", alias="--out", metavar="OUT.jsonl", required=True,
                 help="the training JSONL to write (field text; train on it with data.source=OUT.jsonl)")
  docs: int = declare(20000, ">=1", alias="--docs", help="passkey documents")
  max_len: int = declare(512, ">=1", alias="--max-len", help="longest passkey document in bytes")
  text_fraction: float = declare(0.3, "[0,1)", alias="--text-fraction", help="share of the bytes that are corpus text")
  seed: int = declare(0, ">=0", alias="--seed", help="the documents drawn")


COMMAND = options.Command(prog="python -m sinkjax.data.passkey", description="A training mix for the passkey probe "
                          "(the probe: python -m sinkjax.experiments.study configs/studies/passkey_tiny.yaml).",
                          sections={"passkey_data": PasskeyDataOptions})


def make_data(opts: PasskeyDataOptions) -> None:
  """Writes the mix (see the module docstring)."""
  shortest = len(passkey_text("0" * KEY_DIGITS, 0, 0.0)[0]) + KEY_DIGITS + 1
  if opts.max_len < shortest:
    raise DataError(f"--max-len must be >= {shortest} (a needle and the question)")
  lines = [json.dumps({"text": t}) for t in training_documents(opts.docs, opts.max_len, opts.text_fraction, opts.seed)]
  paths.write_atomic(opts.out, "\n".join(lines) + "\n")
  print(f"wrote {len(lines)} documents ({opts.docs} passkey) to {opts.out}")


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, _: make_data(sections["passkey_data"]))


if __name__ == "__main__":
  sys.exit(main())
