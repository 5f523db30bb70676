"""Passkey retrieval: a number hidden at a chosen depth of filler text, asked for at the end.

    python -m sinkjax.experiments.passkey --checkpoint RUN_DIR [--lengths 128,256,512] [--depths 0,0.25,0.5,0.75,1]
        [--samples 8] [--sink-size 4 --window 64] [--full-heads 0.25,0.5 ...] [--full-heads-random 0,1,2] [--out DIR]
    python -m sinkjax.experiments.passkey --make-data OUT.jsonl [--docs 20000] [--max-len 512]
        [--text-fraction 0.5] [--seed 0]

The probe (the passkey test of Landmark Attention / LongLoRA): BOS, filler sentences ("The grass is green. The sky
is blue. ..."), at depth d of the filler the needle "The pass key is 71829. Remember it. 71829 is the pass key. ",
more filler, then "What is the pass key? The pass key is ". A sample counts as retrieved when greedy decoding
continues with the key's digits. That is measured with teacher forcing (`sinkjax.generate.streaming_scores`): greedy
decoding produces the key iff every key token is the argmax given the correct ones before it, so one pass of the
cached decode step over prompt + key gives the exact greedy result for a whole batch of samples.

Cache modes, one table each: the full cache; sinks + window (every head streaming); and for each --full-heads F the
hybrid cache whose full heads are chosen by importance (`sinkjax.cache_policy`) and, per --full-heads-random seed,
the same number chosen at random. Accuracy is reported by context length and depth and writes `results.json`
(one record per mode, length and depth) and `results.md` into --out.

--make-data writes a training JSONL (field `text`) for a model that can take the probe: --docs passkey documents
(random key, random depth, lengths up to --max-len tokens of the byte tokenizer) mixed with chunks of the embedded
corpus's training split (`data.source=default`, so its validation files stay held out) making up --text-fraction
of the bytes. Train on it with `data.source=OUT.jsonl`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

import numpy as np

FILLER = ("The grass is green. ", "The sky is blue. ", "The sun is yellow. ", "Here we go. ",
          "There and back again. ")
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "What is the pass key? The pass key is "
KEY_DIGITS = 5


class PasskeyError(ValueError):
  """A bad command line (the message says what to change)."""


# ----------------------------------------------------------------------------------------------------- samples


def random_key(rng: np.random.Generator) -> str:
  return str(rng.integers(10 ** (KEY_DIGITS - 1), 10 ** KEY_DIGITS))


def passkey_text(key: str, num_sentences: int, depth: float) -> tuple[str, str]:
  """(prompt, answer) with `num_sentences` filler sentences and the needle after round(depth * num_sentences)."""
  before = round(depth * num_sentences)
  filler = [FILLER[i % len(FILLER)] for i in range(num_sentences)]
  return "".join(filler[:before]) + NEEDLE.format(key=key) + "".join(filler[before:]) + QUESTION, key


@dataclasses.dataclass(frozen=True)
class PasskeyBatch:
  """Samples of one (context length, depth) cell, all of one token length: ids [N, T] (BOS, prompt, key tokens),
  the key tokens in the last `answer_len` positions."""
  ids: np.ndarray
  answer_len: int
  depth: float

  @property
  def context(self) -> int:
    return self.ids.shape[1] - self.answer_len


def passkey_batch(tokenizer, length: int, depth: float, samples: int, seed: int) -> PasskeyBatch:
  """`samples` probes whose prompt (BOS included) has at most `length` tokens, as many filler sentences as fit.

  The prompt is tokenized piece by piece (filler sentences, needle, question), so its length does not depend on
  the key; the key is tokenized alone. Every sample of a batch then has the same shape.
  """
  rng = np.random.default_rng([seed, length, round(depth * 1000)])
  sentence = [tokenizer.encode(s) for s in FILLER]
  fixed = 1 + len(tokenizer.encode(NEEDLE.format(key="0" * KEY_DIGITS))) + len(tokenizer.encode(QUESTION))
  n, used = 0, fixed
  while used + len(sentence[n % len(FILLER)]) <= length:
    used += len(sentence[n % len(FILLER)])
    n += 1
  rows, answer_len = [], None
  for _ in range(samples):
    key = random_key(rng)
    before = round(depth * n)
    filler = [sentence[i % len(FILLER)] for i in range(n)]
    answer = tokenizer.encode(key)
    ids = ([tokenizer.bos_id] + sum(filler[:before], []) + tokenizer.encode(NEEDLE.format(key=key))
           + sum(filler[before:], []) + tokenizer.encode(QUESTION) + answer)
    answer_len = len(answer) if answer_len is None else answer_len
    if len(answer) != answer_len or len(ids) != used + answer_len:
      raise PasskeyError(f"the tokenizer splits keys or needles unevenly ({tokenizer!r}); the probe needs a "
                         "tokenizer whose 5-digit numbers all have the same length (e.g. data.tokenizer=bytes)")
    rows.append(ids)
  return PasskeyBatch(np.asarray(rows, np.int32), answer_len, depth)


# -------------------------------------------------------------------------------------------------- training data


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
  from sinkjax.data.sources import DefaultSource
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


def write_training_data(path: str, docs: int, max_len: int, text_fraction: float, seed: int) -> int:
  lines = [json.dumps({"text": t}) for t in training_documents(docs, max_len, text_fraction, seed)]
  pathlib.Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
  return len(lines)
