"""Which KV heads keep a full cache: the per-head policy of `sinkjax.cache.HybridKVCache`, from measured importance.

A policy is an [L][Hkv] boolean map, True = full (every position), False = streaming (sinks + window). It comes from
- importance ([Sink-MoE] eq. 5), as `sinkjax.train` logs it per step in metrics.jsonl (last record) and `sinkjax.eval`
  writes it into report.json: the heads with the LOWEST importance (gate near 0, most sink-like) stream;
- or eval's sink ratio alpha ([Sink-MoE] eq. 9, report.json `sink_ratio_alpha`): the heads with the HIGHEST alpha
  stream;
- or far-context attention (`sinkjax.analysis.far_attention`: the attention weight on the keys a sinks + window cache
  has evicted, i.e. what a head loses when it streams; the streaming study's far_attention.json, key
  `far_attention`, docs/STREAMING.md): the heads with the LOWEST far-context attention stream;
- or an explicit map (a JSON [L][Hkv] of booleans or 0/1);
- or a random choice of the same size (the control for the two above).

Amount F: a fraction in [0, 1] (0 = every head streams, 1 = every head full) or an integer count > 1 of full heads,
per layer (scope "layer": every layer keeps round(F Hkv) full heads, chosen within the layer) or over the whole
model (scope "global": round(F L Hkv) heads, the top of one ranking across layers). Rounding is half up.

GQA: the scores are per query head, the cache policy is per KV head. Rule "any": a KV head scores as its most
important query head (max importance, min alpha), i.e. it keeps a full cache if any query head of its group needs it;
rule "mean": the group's mean. By default each source's own rule (`SOURCE_GQA`): "any" for importance and alpha,
"mean" for far-context attention (a streamed KV head takes the far context from all its query heads, so the mean
ranks as their sum). Ties go to the lower head index.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

from sinkjax import paths
from sinkjax.errors import UserError
from sinkjax.config import declare

SOURCES = ("importance", "alpha", "far_attention")
SCOPES = ("layer", "global")
GQA_RULES = ("any", "mean")
SOURCE_GQA = {"importance": "any", "alpha": "any", "far_attention": "mean"}    # each source's own GQA rule
REPORT_KEYS = {"importance": "importance", "alpha": "sink_ratio_alpha", "far_attention": "far_attention"}
HINTS = {"alpha": "; alpha is in eval's report.json (run python -m sinkjax.eval first)",
         "far_attention": "; far_attention is in the streaming study's far_attention.json (configs/studies/"
                          "streaming_far.yaml): give it as --head-scores"}


class PolicyError(UserError):
  """A bad head-policy input (the message says what to change)."""


def parse_amounts(text: str, flag: str = "--full-heads") -> list[float]:
  """'0,0.25,1' or '3' -> [0.0, 0.25, 1.0] / [3.0]: fractions in [0, 1] or integer counts > 1."""
  out = []
  for part in text.split(","):
    try:
      value = float(part)
    except ValueError:
      raise PolicyError(f"{flag} takes fractions in [0, 1] or head counts, comma-separated; got {part!r}") from None
    if not (0 <= value <= 1 or (value > 1 and value == int(value))):
      raise PolicyError(f"{flag} {part} is neither a fraction in [0, 1] nor a whole number of heads")
    out.append(value)
  return out


def full_count(amount: float, num_heads: int, what: str) -> int:
  """Heads kept full out of `num_heads` for an amount (fraction: rounded half up; count: as is, <= num_heads)."""
  if amount <= 1:
    return math.floor(amount * num_heads + 0.5)
  if amount > num_heads:
    raise PolicyError(f"--full-heads {amount:g} exceeds the {num_heads} KV heads {what}; give at most "
                      f"{num_heads} or a fraction")
  return int(amount)


def scores_file(path):
  """A run dir -> its eval/report.json if present, else its metrics.jsonl; a file stays itself (local or a
  gs:// / s3:// URL)."""
  path = paths.as_path(path, "head scores")
  if path.is_dir():
    report = path / "eval" / "report.json"
    path = report if report.is_file() else path / "metrics.jsonl"
  if not path.is_file():
    raise PolicyError(f"head scores: {path} does not exist; give a report.json, a metrics.jsonl or a run directory")
  return path


def read_scores(path, source: str, shape: tuple[int, int]) -> np.ndarray:
  """[L, Hq] per-head scores, higher = more in need of a full cache: importance, far-context attention, or
  -alpha."""
  path = scores_file(path)
  key = REPORT_KEYS[source]
  try:
    if path.suffix == ".jsonl":
      # here, not at the top: sinkjax.run imports Orbax, and the commands' argument parsing stays light
      from sinkjax.run import read_metrics  # pylint: disable=import-outside-toplevel
      values = [r[key] for r in read_metrics(path) if key in r][-1]
    else:
      values = json.loads(path.read_text())[key]
    scores = np.asarray(values, np.float64)
  except IndexError:
    raise PolicyError(f"{path} holds no {key!r}{HINTS.get(source, '')}") from None
  except (KeyError, TypeError, ValueError):
    raise PolicyError(f"{path} holds no {key!r} [layers x heads] array") from None
  if scores.shape != tuple(shape):
    raise PolicyError(f"{path}: {key} is {list(scores.shape)}, the model has {list(shape)} (layers x query heads)")
  return -scores if source == "alpha" else scores


def kv_scores(scores: np.ndarray, num_kv_heads: int, rule: str = "any") -> np.ndarray:
  """[L, Hq] query-head scores -> [L, Hkv] (query head i belongs to KV head i // (Hq / Hkv))."""
  L, Hq = scores.shape
  grouped = scores.reshape(L, num_kv_heads, Hq // num_kv_heads)
  return grouped.max(-1) if rule == "any" else grouped.mean(-1)


def top_heads(kv: np.ndarray, amount: float, scope: str) -> np.ndarray:
  """[L, Hkv] bool: the highest-scoring heads full, per layer or across layers (ties: lower index first)."""
  L, H = kv.shape
  full = np.zeros((L, H), bool)
  if scope == "layer":
    count = full_count(amount, H, "per layer")
    for layer in range(L):
      full[layer, np.argsort(-kv[layer], kind="stable")[:count]] = True
    return full
  count = full_count(amount, L * H, "in the model")
  full.reshape(-1)[np.argsort(-kv.reshape(-1), kind="stable")[:count]] = True
  return full


def random_heads(shape: tuple[int, int], amount: float, scope: str, seed: int) -> np.ndarray:
  """The random control: as many full heads as `top_heads` picks (per layer or overall), chosen uniformly."""
  rng = np.random.default_rng(seed)
  return top_heads(rng.random(shape), amount, scope)


def read_map(path, shape: tuple[int, int]) -> np.ndarray:
  """An explicit policy: JSON [L][Hkv] of booleans or 0/1 (True/1 = full)."""
  path = paths.as_path(path, "--full-heads-from")
  if not path.is_file():
    raise PolicyError(f"--full-heads-from {path} does not exist")
  try:
    raw = json.loads(path.read_text())
    arr = np.asarray(raw)
  except ValueError:
    raise PolicyError(f"--full-heads-from {path}: not a JSON [layers][kv heads] array of booleans or 0/1") from None
  if arr.shape != tuple(shape):
    raise PolicyError(f"--full-heads-from {path}: shape {list(arr.shape)}, the model needs {list(shape)} "
                      "(layers x KV heads)")
  if not all(isinstance(x, bool) or x in (0, 1) for x in arr.reshape(-1).tolist()):
    raise PolicyError(f"--full-heads-from {path}: entries must be true/false or 0/1")
  return arr.astype(bool)


def describe(full: np.ndarray) -> str:
  """'5/16 full heads' (+ per layer when it differs between layers)."""
  per_layer = full.sum(1)
  text = f"{int(full.sum())}/{full.size} full heads"
  return text if len(set(per_layer.tolist())) == 1 else text + f" (per layer {per_layer.tolist()})"


def as_tuple(full: np.ndarray) -> tuple:
  """[L][Hkv] nested tuples (the static, hashable form a `HybridKVCache` keeps)."""
  return tuple(tuple(bool(x) for x in row) for row in np.asarray(full))


# ---------------------------------------------------------------------------------------------------- the options


@dataclasses.dataclass
class CacheOptions:
  """The cache.* options: the head policy of `sinkjax.generate` and the passkey study files (each flag the
  alias of its key: `--full-heads 0.5` = `cache.full_heads=0.5`)."""
  full_heads: str | None = declare(None, alias="--full-heads", metavar="F[,F...]",
                               help="per-head cache: keep a full cache for a fraction F in [0, 1] (or an integer count "
                                    "> 1) of the KV heads, the rest sinks + window; chosen by importance (lowest = "
                                    "streaming)")
  full_heads_from: str | None = declare(None, alias="--full-heads-from", metavar="FILE",
                                    help="per-head cache from an explicit JSON [layers][kv heads] map of booleans or "
                                         "0/1")
  full_heads_random: str | None = declare(None, alias="--full-heads-random", metavar="SEED[,SEED...]",
                                      help="the random control: the same number of full heads chosen at random "
                                           "(generation: instead of by importance; tables: extra rows per seed)")
  full_heads_by: str = declare("importance", choices=SOURCES, alias="--full-heads-by",
                           help="importance (training's metrics.jsonl or eval's report.json; lowest streams), alpha "
                                "(eval's sink ratio; highest streams) or far_attention (the streaming study's "
                                "far_attention.json as --head-scores; lowest streams)")
  full_heads_scope: str = declare("layer", choices=SCOPES, alias="--full-heads-scope",
                              help="layer: F of each layer's heads; global: F of all heads, ranked across layers")
  full_heads_gqa: str = declare("source", choices=("source",) + GQA_RULES, alias="--full-heads-gqa",
                            help="GQA: a KV head scores as its best query head (any), the group mean (mean), or by "
                                 "the source's own rule (source: any for importance and alpha, mean for "
                                 "far_attention)")
  head_scores: str | None = declare(None, alias="--head-scores", metavar="PATH",
                                help="report.json, metrics.jsonl or run dir to read importance/alpha from (default: "
                                     "the checkpoint's eval/report.json, else its metrics.jsonl)")


def check(opts: CacheOptions) -> None:
  """Checks that need no model: amounts, seeds, exclusive options (PolicyError, one line)."""
  if opts.full_heads is not None and opts.full_heads_from is not None:
    raise PolicyError("give --full-heads F (chosen by importance) or --full-heads-from FILE (a map), not both")
  if opts.full_heads_random is not None and opts.full_heads is None:
    raise PolicyError("--full-heads-random needs --full-heads F (how many heads to choose at random)")
  if opts.full_heads is not None:
    parse_amounts(opts.full_heads)
  parse_seeds(opts.full_heads_random)


def parse_seeds(text: str | None) -> list[int]:
  if text is None:
    return []
  try:
    return [int(s) for s in text.split(",")]
  except ValueError:
    raise PolicyError(f"--full-heads-random takes integer seeds, comma-separated; got {text!r}") from None


def wanted(opts: CacheOptions) -> bool:
  """Whether the options ask for a per-head (hybrid) cache."""
  return opts.full_heads is not None or opts.full_heads_from is not None


def policies_from(opts: CacheOptions, cfg, run_dir, *, by_importance: bool = True) -> list[tuple[str, np.ndarray]]:
  """(label, [L][Hkv] bool map) for every policy the options ask for: the map of full_heads_from, or per amount F
  the importance-chosen split (when `by_importance`) and one random split per full_heads_random seed."""
  L, Hq, Hkv = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads
  if opts.full_heads_from is not None:
    return [(f"map {pathlib.Path(opts.full_heads_from).name}", read_map(opts.full_heads_from, (L, Hkv)))]
  amounts, seeds = parse_amounts(opts.full_heads), parse_seeds(opts.full_heads_random)
  out = []
  if by_importance:
    rule = SOURCE_GQA[opts.full_heads_by] if opts.full_heads_gqa == "source" else opts.full_heads_gqa
    kv = kv_scores(read_scores(opts.head_scores or run_dir, opts.full_heads_by, (L, Hq)), Hkv, rule)
    out += [(f"F={a:g} by {opts.full_heads_by}", top_heads(kv, a, opts.full_heads_scope)) for a in amounts]
  out += [(f"F={a:g} random (seed {s})", random_heads((L, Hkv), a, opts.full_heads_scope, s))
          for s in seeds for a in amounts]
  return out
