"""Passkey retrieval: a number hidden at a chosen depth of filler text, asked for at the end, scored under each KV
cache (full, sinks + window, per-head hybrids by importance or at random).

    python -m sinkjax.experiments.passkey --checkpoint RUN_DIR [--lengths 128,256,512] [--full-heads 0.25,0.5 ...]
    python -m sinkjax.experiments.passkey --make-data OUT.jsonl [--docs 20000] [--max-len 512]
    python -m sinkjax.experiments.study configs/studies/passkey_tiny.yaml [study.run=RUN_DIR] [cache.full_heads=0.5]

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
  """The `passkey:` section of a kind-passkey study file (each flag the alias of its key: `--window 64` =
  `passkey.window=64`). The hybrid caches' head policy is not here: it is the `cache:` section (`SECTIONS`)."""
  samples: int = key(8, ">=1", alias="--samples", help="keys per length and depth")
  sink_size: int = key(4, ">=0", alias="--sink-size", help="sinks of streaming heads")
  window: int = key(64, ">=1", alias="--window", help="slots of streaming heads, sinks included")
  seed: int = key(0, ">=0", alias="--seed", help="the keys drawn (probe) / the documents (--make-data)")


# The sections of a kind-passkey study file besides study: and axes:, and of the probe's flags: its own keys and the
# per-head cache policy of `sinkjax.generate` (cache.full_heads, ...), declared once in `sinkjax.cache_policy`.
SECTIONS = {"passkey": PasskeyOptions, "cache": cache_policy.CacheOptions}


class PasskeyError(UserError):
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
    raise PasskeyError(f"--lengths: {length} tokens cannot hold the needle and the question ({fixed} tokens)")
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


def write_training_data(path: str, docs: int, max_len: int, text_fraction: float, seed: int) -> int:
  lines = [json.dumps({"text": t}) for t in training_documents(docs, max_len, text_fraction, seed)]
  pathlib.Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")
  return len(lines)


# ----------------------------------------------------------------------------------------------------------- probe


def cache_modes(sink_size: int, window: int, policies) -> list[tuple[str, dict, np.ndarray | None]]:
  """(name, cache arguments of `streaming_scores` without capacity, [L][Hkv] map or None) of every mode probed."""
  modes = [("full cache", {}, None), (f"sinks + window (S={sink_size}, W={window})",
                                      dict(sink_size=sink_size, window=window), None)]
  modes += [(f"hybrid {label}", dict(sink_size=sink_size, window=window, full_heads=cache_policy.as_tuple(full)),
             full) for label, full in policies]
  return modes


def _mode_cache(kw: dict, total: int) -> dict:
  """`streaming_scores` arguments: a full cache of `total` slots, a streaming one of W, or a hybrid (full heads
  `total`, streaming heads W)."""
  if not kw:
    return dict(capacity=total)
  if "full_heads" not in kw:
    return dict(capacity=kw["window"], sink_size=kw["sink_size"])
  return dict(capacity=total, **kw)


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
    for name, kw, full in cache_modes(sink_size, window, policies):
      cache_kw = _mode_cache(kw, ids.shape[1])
      _, hit = streaming_scores(model, ids, **cache_kw)
      right, digits = key_outcomes(hit, answer)
      n_full = every if not kw else (0 if full is None else int(np.sum(full)))
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


# ---------------------------------------------------------------------------------------------------- command line


@dataclasses.dataclass
class ProbeOptions:
  """The probe command's own options (`python -m sinkjax.experiments.passkey`; in a study file: study.run, study.out
  and `axes: length, depth`)."""
  checkpoint: str | None = key(None, alias="--checkpoint", metavar="RUN_DIR", help="run directory of a training run")
  lengths: str = key("128,256,512", alias="--lengths", metavar="N[,N...]", help="prompt lengths in tokens")
  depths: str = key("0,0.25,0.5,0.75,1", alias="--depths", metavar="D[,D...]", help="needle depths in [0, 1]")
  out: str | None = key(None, alias="--out", metavar="DIR",
                        help="where results.json and results.md go (default RUN_DIR/passkey)")


@dataclasses.dataclass
class MakeDataOptions:
  """--make-data: a training mix of passkey documents and corpus text instead of a probe."""
  make_data: str | None = key(None, alias="--make-data", metavar="OUT.jsonl",
                              help="write a training mix instead of probing")
  docs: int = key(20000, ">=1", alias="--docs", help="--make-data: passkey documents")
  max_len: int = key(512, ">=1", alias="--max-len", help="--make-data: longest passkey document in bytes")
  text_fraction: float = key(0.3, "[0,1)", alias="--text-fraction", help="--make-data: share of corpus text bytes")


COMMAND = options.Command(
    prog="python -m sinkjax.experiments.passkey", description=__doc__.split("\n\n")[0],
    sections={"probe": ProbeOptions, **SECTIONS, "mix": MakeDataOptions})


def _numbers(text: str, kind, flag: str, ok) -> list:
  try:
    values = [kind(x) for x in text.split(",")]
  except ValueError:
    raise PasskeyError(f"{flag} takes comma-separated numbers, got {text!r}") from None
  bad = [v for v in values if not ok(v)]
  if bad:
    raise PasskeyError(f"{flag}: {bad[0]} is out of range")
  return values


def make_data(path: str, docs: int, max_len: int, text_fraction: float, seed: int) -> None:
  shortest = len(passkey_text("0" * KEY_DIGITS, 0, 0.0)[0]) + KEY_DIGITS + 1
  if max_len < shortest:
    raise PasskeyError(f"--max-len must be >= {shortest} (a needle and the question)")
  n = write_training_data(path, docs, max_len, text_fraction, seed)
  print(f"wrote {n} documents ({docs} passkey) to {path}")


def run_probe(checkpoint: str, *, lengths, depths, samples: int, sink_size: int, window: int, seed: int,
              policies=(), out: str | None = None) -> None:
  """The probe of one run (`probe`) at every length and depth, for every cache mode; results.json / results.md in
  `out` (default RUN_DIR/passkey). `policies`: (label, [L][Hkv] map) of the hybrid caches (`sinkjax.cache_policy`)."""
  logging.getLogger("absl").setLevel(logging.ERROR)     # Orbax's read-only notices are not the user's concern
  if not 0 <= sink_size < window:
    raise PasskeyError("0 <= --sink-size < --window (passkey.sink_size < passkey.window)")
  model, _, tok, _ = load_run(checkpoint)
  for label, full in policies:
    print(f"hybrid {label}: {cache_policy.describe(full)}", file=sys.stderr)
  records = probe(model, tok, lengths=lengths, depths=depths, samples=samples, sink_size=sink_size, window=window,
                  policies=policies, seed=seed)
  out = paths.as_path(out or f"{str(checkpoint).rstrip('/')}/passkey", "--out")
  out.mkdir(parents=True, exist_ok=True)
  table = format_results(records)
  (out / "results.json").write_text(json.dumps(records, indent=1))
  (out / "results.md").write_text(table + "\n")
  print(table)


def run_study(run: str, lengths, depths, opts: PasskeyOptions, cache: cache_policy.CacheOptions,
              out: str | None = None) -> None:
  """The probe of `run` at every length x depth for every cache mode: the full cache, sinks + window, and the
  hybrid caches that the head policy `cache` asks for (none when it asks for none)."""
  if not run:
    raise PasskeyError("give --checkpoint RUN_DIR (study.run) (or --make-data OUT.jsonl)")
  cache_policy.check(cache)
  policies = cache_policy.policies_from(cache, read_run_config(run).model, run) if cache_policy.wanted(cache) else []
  run_probe(run, lengths=lengths, depths=depths, samples=opts.samples, sink_size=opts.sink_size, window=opts.window,
            seed=opts.seed, policies=policies, out=out)


def run_plan(plan: runner.Plan, *, dry_run: bool = False, report_only: bool = False) -> None:
  """A kind-passkey study file, run (`sinkjax.experiments.study`): the probe of study.run at every length x depth of
  its axes, for every cache mode."""
  sections = plan.options(SECTIONS)
  for axis in set(plan.axes) - {"length", "depth"}:
    raise PasskeyError(f"{plan.path}: the passkey study's axes are length and depth, got {axis}")
  lengths, depths = plan.axes.get("length", [128, 256, 512]), plan.axes.get("depth", [0, 0.25, 0.5, 0.75, 1])
  if dry_run or report_only:
    print(f"{plan.study.run}: lengths {lengths} x depths {depths}, {sections['passkey'].samples} keys each"
          + (" (the probe writes its report as it runs)" if report_only else ""))
    return
  run_study(plan.study.run, [int(x) for x in lengths], [float(x) for x in depths], sections["passkey"],
            sections["cache"], out=plan.study.out or None)


def run(sections: dict) -> None:
  """The command from its typed sections: --make-data's training mix, else the probe of --checkpoint."""
  probe_, opts, cache, data = (sections[name] for name in COMMAND.sections)
  if data.make_data is not None:
    return make_data(data.make_data, data.docs, data.max_len, data.text_fraction, opts.seed)
  lengths = _numbers(probe_.lengths, int, "--lengths", lambda v: v >= 1)
  depths = _numbers(probe_.depths, float, "--depths", lambda v: 0 <= v <= 1)
  return run_study(probe_.checkpoint, lengths, depths, opts, cache, out=probe_.out)


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, _: run(sections))


if __name__ == "__main__":
  sys.exit(main())
