"""Passkey retrieval: a number hidden at a chosen depth of filler text, asked for at the end, scored under each KV
cache (full, sinks + window, per-head hybrids by importance or at random).

    python -m sinkjax.experiments.study configs/studies/passkey_tiny.yaml [study.run=RUN_DIR] [cache.full_heads=0.5]
    python -m sinkjax.experiments.passkey --make-data OUT.jsonl [--docs 20000] [--max-len 512]   # a training mix

The probe, its exact greedy scoring by teacher forcing, the files and the training data: docs/STREAMING.md,
"Passkey retrieval by cache".
"""
from __future__ import annotations

from sinkjax import cli

if __name__ == "__main__":
  cli.require_extra("sinkjax.experiments.passkey")   # before the imports below, which need the train extra

import dataclasses
import json
import logging
import pathlib
import sys

import numpy as np

from sinkjax import cache_policy, options, paths
from sinkjax.cli import UserError
from sinkjax.config import key
from sinkjax.experiments import runner
from sinkjax.data.sources import DefaultSource
from sinkjax.generate import kv_bytes, streaming_scores
from sinkjax.run import load_run, read_run_config

FILLER = ("The grass is green. ", "The sky is blue. ", "The sun is yellow. ", "Here we go. ",
          "There and back again. ")
# The key is marked with "#" so that a byte-level model finds it by the previous token alone (one-token induction):
# a tiny model trained for minutes on a CPU did not learn to match the classic "...pass key is " context (with
# "The sky is" in the filler it must look five bytes back) within 500 steps; with the marker it does.
NEEDLE = "The pass key is #{key}. Remember it. #{key} is the pass key. "
QUESTION = "What is the pass key? The pass key is #"
KEY_DIGITS = 5
STUDY_FILE = runner.REPO / "configs" / "studies" / "passkey_tiny.yaml"


@dataclasses.dataclass
class PasskeyOptions:
  """The `passkey:` section of a kind-passkey study file. The hybrid caches' head policy is its `cache:` section."""
  samples: int = key(8, ">=1")            # keys per length and depth
  sink_size: int = key(4, ">=0")          # sinks of streaming heads
  window: int = key(64, ">=1")            # slots of streaming heads, sinks included
  seed: int = key(0, ">=0")               # the keys drawn


# The sections of a kind-passkey study file besides study: and axes:: its own keys and the per-head cache policy of
# `sinkjax.generate` (cache.full_heads, ...), declared once in `sinkjax.cache_policy`.
SECTIONS = {"passkey": PasskeyOptions, "cache": cache_policy.CacheOptions}


@dataclasses.dataclass
class MakeDataOptions:
  """The options of `python -m sinkjax.experiments.passkey`: the training mix it writes."""
  out: str = key("", alias="--make-data", metavar="OUT.jsonl", required=True,
                 help="the training JSONL to write (field text; train on it with data.source=OUT.jsonl)")
  docs: int = key(20000, ">=1", alias="--docs", help="passkey documents")
  max_len: int = key(512, ">=1", alias="--max-len", help="longest passkey document in bytes")
  text_fraction: float = key(0.3, "[0,1)", alias="--text-fraction", help="share of the bytes that are corpus text")
  seed: int = key(0, ">=0", alias="--seed", help="the documents drawn")


COMMAND = options.Command(prog="python -m sinkjax.experiments.passkey", description="A training mix for the passkey "
                          "probe (the probe: python -m sinkjax.experiments.study configs/studies/passkey_tiny.yaml).",
                          sections={"make_data": MakeDataOptions})


class PasskeyError(UserError):
  """A bad study file or command line (the message says what to change)."""


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
  keys: tuple = ()

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
  if length < fixed:
    raise PasskeyError(f"axes.length: {length} tokens cannot hold the needle and the question ({fixed} tokens)")
  n, used = 0, fixed
  while used + len(sentence[n % len(FILLER)]) <= length:
    used += len(sentence[n % len(FILLER)])
    n += 1
  rows, answer_len, keys = [], None, []
  for _ in range(samples):
    key = random_key(rng)
    keys.append(key)
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
  return PasskeyBatch(np.asarray(rows, np.int32), answer_len, depth, tuple(keys))


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


# ----------------------------------------------------------------------------------------------------------- probe


def cache_modes(sink_size: int, window: int, policies, total: int) -> list[tuple[str, dict, np.ndarray | None]]:
  """(name, `streaming_scores` cache arguments, [L][Hkv] map or None) of every mode probed on `total` tokens: the
  full cache, sinks + window (every head streaming), and each hybrid of `policies` (full heads `total` slots)."""
  modes = [("full cache", dict(capacity=total), None),
           (f"sinks + window (S={sink_size}, W={window})", dict(capacity=window, sink_size=sink_size), None)]
  return modes + [(f"hybrid {label}", dict(capacity=total, sink_size=sink_size, window=window,
                                           full_heads=cache_policy.as_tuple(full)), full) for label, full in policies]


def key_outcomes(hit: np.ndarray, answer_len: int) -> tuple[list[bool], list[int]]:
  """Per key (row of `hit`, [N, T] bool: each target the greedy choice given the right tokens before it): whether
  the whole key is right and how many of its answer_len tokens are."""
  ans = np.asarray(hit, bool)[:, -answer_len:]
  return ans.all(axis=1).tolist(), ans.sum(axis=1).astype(int).tolist()


def probe(model, tokenizer, *, lengths, depths, samples: int, sink_size: int, window: int, policies=(),
          seed: int = 0) -> list[dict]:
  """Passkey accuracy per cache mode, context length and depth (one record each)."""
  cfg, records = model.cfg, []
  every = cfg.num_layers * cfg.num_kv_heads
  for length in lengths:
    batches = [passkey_batch(tokenizer, length, d, samples, seed) for d in depths]
    ids = np.concatenate([b.ids for b in batches])
    answer = batches[0].answer_len
    for name, cache_kw, full in cache_modes(sink_size, window, policies, ids.shape[1]):
      _, hit = streaming_scores(model, ids, **cache_kw)
      right, digits = key_outcomes(hit, answer)
      n_full = every if "sink_size" not in cache_kw else (0 if full is None else int(np.sum(full)))   # full: no sinks
      for i, b in enumerate(batches):
        cell = slice(i * samples, (i + 1) * samples)
        records.append(dict(mode=name, context=b.context, depth=b.depth, accuracy=float(np.mean(right[cell])),
                            digit_accuracy=float(np.sum(digits[cell]) / (samples * answer)), samples=samples,
                            full_heads=n_full, heads=every, kv_bytes=kv_bytes(cfg, **cache_kw),
                            full_map=None if full is None else np.asarray(full, bool).astype(int).tolist(),
                            keys=list(b.keys), key_right=right[cell], digits_right=digits[cell]))
  return records


def format_results(records: list[dict]) -> str:
  """One markdown table: a row per mode and context length, a column per depth (whole-key accuracy), the mean, and
  the mean per-digit accuracy (the share of key tokens that are the greedy choice given the right ones before)."""
  depths = sorted({r["depth"] for r in records})
  lines = ["| mode | full heads | context | " + " | ".join(f"depth {d:g}" for d in depths)
           + " | mean | digits right | KV bytes |",
           "|---|---:|---:|" + "---:|" * len(depths) + "---:|---:|---:|"]
  keys = list(dict.fromkeys((r["mode"], r["context"]) for r in records))
  for mode, context in keys:
    rows = {r["depth"]: r for r in records if r["mode"] == mode and r["context"] == context}
    acc = [rows[d]["accuracy"] for d in depths]
    r = rows[depths[0]]
    digits = np.mean([rows[d].get("digit_accuracy", np.nan) for d in depths])
    lines.append(f"| {mode} | {r['full_heads']}/{r['heads']} | {context} | " + " | ".join(f"{a:.2f}" for a in acc)
                 + f" | {np.mean(acc):.2f} | {digits:.2f} | {r['kv_bytes']:,} |")
  return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------- the commands


def make_data(opts: MakeDataOptions) -> None:
  """--make-data: `opts.docs` passkey documents (random key and depth, up to `opts.max_len` bytes) mixed with chunks
  of the embedded corpus's training split (its validation files stay held out), `opts.text_fraction` of the bytes."""
  shortest = len(passkey_text("0" * KEY_DIGITS, 0, 0.0)[0]) + KEY_DIGITS + 1
  if opts.max_len < shortest:
    raise PasskeyError(f"--max-len must be >= {shortest} (a needle and the question)")
  lines = [json.dumps({"text": t}) for t in training_documents(opts.docs, opts.max_len, opts.text_fraction, opts.seed)]
  pathlib.Path(opts.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
  print(f"wrote {len(lines)} documents ({opts.docs} passkey) to {opts.out}")


def _axis(plan: runner.Plan, name: str, default: list, kind, ok) -> list:
  values = plan.axes.get(name, default)
  try:
    values = [kind(v) for v in values]
  except (TypeError, ValueError):
    values = [None]
  if not all(v is not None and ok(v) for v in values):
    raise PasskeyError(f"{plan.path}: axis {name} must list {kind.__name__}s "
                       + ("of at least 1 token" if kind is int else "in [0, 1]") + f", got {plan.axes[name]}")
  return values


def run_plan(plan: runner.Plan, *, dry_run: bool = False, report_only: bool = False) -> None:
  """A kind-passkey study file, run (`sinkjax.experiments.study`): the probe of study.run at every length x depth of
  its axes for every cache mode (the full cache, sinks + window, and the hybrids its `cache:` policy asks for), then
  results.json (a record per mode, length and depth, with every key's outcome) and results.md in study.out."""
  sections = plan.options(SECTIONS)
  opts, cache = sections["passkey"], sections["cache"]
  for axis in set(plan.axes) - {"length", "depth"}:
    raise PasskeyError(f"{plan.path}: the passkey study's axes are length and depth, got {axis}")
  lengths = _axis(plan, "length", [128, 256, 512], int, lambda v: v >= 1)
  depths = _axis(plan, "depth", [0, 0.25, 0.5, 0.75, 1], float, lambda v: 0 <= v <= 1)
  run = plan.study.run
  if dry_run or report_only:
    print(f"{run}: lengths {lengths} x depths {depths}, {opts.samples} keys each"
          + (" (the probe writes its report as it runs)" if report_only else ""))
    return
  if not run:
    raise PasskeyError("give study.run=RUN_DIR (the run probed)")
  if opts.sink_size >= opts.window:
    raise PasskeyError("passkey.sink_size must be < passkey.window")
  cache_policy.check(cache)
  policies = cache_policy.policies_from(cache, read_run_config(run).model, run) if cache_policy.wanted(cache) else []
  logging.getLogger("absl").setLevel(logging.ERROR)     # Orbax's read-only notices are not the user's concern
  model, _, tok, _ = load_run(run)
  for label, full in policies:
    print(f"hybrid {label}: {cache_policy.describe(full)}", file=sys.stderr)
  records = probe(model, tok, lengths=lengths, depths=depths, samples=opts.samples, sink_size=opts.sink_size,
                  window=opts.window, policies=policies, seed=opts.seed)
  out = paths.as_path(plan.study.out or f"{run.rstrip('/')}/passkey", "study.out")
  out.mkdir(parents=True, exist_ok=True)
  table = format_results(records)
  (out / "results.json").write_text(json.dumps(records, indent=1))
  (out / "results.md").write_text(table + "\n")
  print(table)


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, _: make_data(sections["make_data"]))


if __name__ == "__main__":
  sys.exit(main())
