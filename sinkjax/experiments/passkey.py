"""Passkey retrieval: a number hidden at a chosen depth of filler text, asked for at the end, scored under each KV
cache (full, sinks + window, per-head hybrids by importance or at random).

    python -m sinkjax.experiments.study configs/studies/passkey_tiny.yaml [study.run=RUN_DIR] [cache.full_heads=0.5]

The texts and the training mix are `sinkjax.data.passkey`'s. The probe, its exact greedy scoring by teacher forcing,
the files and the training data: docs/STREAMING.md, "Passkey retrieval by cache".
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":   # a command until the study runner (#50) ran it
  errors.moved("sinkjax.experiments.passkey",
            "python -m sinkjax.experiments.study configs/studies/passkey_tiny.yaml (study.run=RUN); its training mix "
            "(--make-data OUT.jsonl): python -m sinkjax.data.passkey --out OUT.jsonl")

import dataclasses
import json
import logging
import sys

import numpy as np

from sinkjax import cache_policy, paths
from sinkjax import config as config_lib
from sinkjax.errors import UserError
from sinkjax.config import declare
from sinkjax.data.passkey import FILLER, KEY_DIGITS, NEEDLE, QUESTION, random_key
from sinkjax.experiments import runner
from sinkjax.generate import kv_bytes, streaming_scores
from sinkjax.markdown import table
from sinkjax.run import load_run, read_run_config

STUDY_FILE = config_lib.configs_dir() / "studies" / "passkey_tiny.yaml"


@dataclasses.dataclass
class PasskeyOptions:
  """The `passkey:` section of a driver-passkey study file. The hybrid caches' head policy is its `cache:` section."""
  samples: int = declare(8, ">=1")            # keys per length and depth
  sink_size: int = declare(4, ">=0")          # sinks of streaming heads
  window: int = declare(64, ">=1")            # slots of streaming heads, sinks included
  seed: int = declare(0, ">=0")               # the keys drawn


# The sections of a driver-passkey study file besides study: and axes:: its own keys and the per-head cache policy of
# `sinkjax.generate` (cache.full_heads, ...), declared once in `sinkjax.cache_policy`.
SECTIONS = {"passkey": PasskeyOptions, "cache": cache_policy.CacheOptions}


class PasskeyError(UserError):
  """A bad study file (the message says what to change)."""


# ----------------------------------------------------------------------------------------------------- samples


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
  depths, rows = sorted({r["depth"] for r in records}), []
  for mode, context in dict.fromkeys((r["mode"], r["context"]) for r in records):
    cell = {r["depth"]: r for r in records if r["mode"] == mode and r["context"] == context}
    acc, r = [cell[d]["accuracy"] for d in depths], cell[depths[0]]
    digits = np.mean([cell[d].get("digit_accuracy", np.nan) for d in depths])
    rows.append([mode, f"{r['full_heads']}/{r['heads']}", context, *(f"{a:.2f}" for a in acc), f"{np.mean(acc):.2f}",
                 f"{digits:.2f}", f"{r['kv_bytes']:,}"])
  lines = table(["mode", "full heads", "context", *(f"depth {d:g}" for d in depths), "mean", "digits right",
                 "KV bytes"], rows, "lrr" + "r" * (len(depths) + 3))
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------ the study


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
  """A driver-passkey study file, run (`sinkjax.experiments.study`): the probe of study.run at every length x depth of
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

