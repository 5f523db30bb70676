"""[StreamingLLM] on real weights: streaming perplexity of a pretrained model under full, window-only, sinks + window
and per-head caches (full heads chosen by a ranking, against random maps of the same size); a study file of driver
streaming.

    python -m sinkjax.experiments.study configs/studies/streaming_real.yaml [study.run=RUN] [study.out=OUT]
        [streaming.tokens=8192] [streaming.full_heads=0.25] [streaming.scope=layer] [axes.random_map=[0,1,2]]
        ["streaming.rankings=[importance,far_attention]"]

Rankings (`streaming.rankings`), each measured on a text other than the scored one and made a map by
`sinkjax.cache_policy.top_heads`:
- importance: [Sink-MoE] eq. 5 over stdlib docstrings (a KV head as its best query head, `cache_policy` rule "any");
- far_attention: what a head loses when it streams, `sinkjax.analysis.far_attention` (the attention weight on the
  keys the sinks + window cache of the hybrid has evicted) over a calibration text, the same docstrings joined into
  one text and cut into rows of FAR_SEQ tokens; a KV head as the mean of its query heads (rule "mean": a streamed KV
  head takes the far context from all of them, so the mean ranks as their sum).

Each run writes its own raw file OUT/<name>.json (per-position NLLs, cache, timing, commit) and is never redone; the
report reads only those (refusing runs of different commits or token sequences). The texts, the runs, the check
against token-by-token decoding and the statistics (the importance map's rank among the random maps as an exact
permutation statement, `stats.paired_effect` over the maps): docs/STREAMING.md, "On real weights".
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":   # a command until the study runner (#50) ran it
  errors.moved("sinkjax.experiments.streaming_real",
            "python -m sinkjax.experiments.study configs/studies/streaming_real.yaml (--checkpoint RUN: "
            "study.run=RUN; --out DIR: study.out=DIR; --report: --report-only)")

import dataclasses
import hashlib
import json
import logging
import math
import pathlib
import sys
import time

import numpy as np

from sinkjax import cache_policy, stats
from sinkjax import config as config_lib
from sinkjax.config import declare
from sinkjax.experiments import runner
from sinkjax.experiments.runner import StudyError
from sinkjax.markdown import table

SINKS = 4
WINDOWS = (256, 1024)
HYBRID_WINDOW = 256
IMPORTANCE_SEQ, IMPORTANCE_DOCS = 256, 256
CHECK_TOKENS = 320
FAR_ROWS, FAR_SEQ = 2, 2048   # far_attention's calibration: rows x tokens of the joined docstrings
FAR_CHARS = 12 * FAR_ROWS * FAR_SEQ   # the calibration text's prefix that is encoded (ample: ~4 characters a token)
RANKINGS = ("importance", "far_attention")
MAP_SOURCE = {"importance": "importance", "far_attention": "far-context attention"}
BLOCK = 512               # per-block comparison of two maps
CURVE = 256               # running mean of the figure
STUDY_FILE = config_lib.configs_dir() / "studies" / "streaming_real.yaml"


@dataclasses.dataclass
class StreamingOptions:
  """The `streaming:` section of a driver-streaming study file."""
  tokens: int = declare(8192, ">=1")          # tokens of the help topics scored (>= 2048: twice the largest window)
  full_heads: float = declare(0.25, "(0,1)")  # the hybrid's fraction of KV heads kept full
  chunk: int = declare(64, ">=1")             # positions scored per step
  scope: str = declare("global", choices=cache_policy.SCOPES)   # the hybrid's full heads ranked over the model or per layer
  rankings: list[str] = declare(["importance"], choices=RANKINGS)  # the rankings that each pick a hybrid's full heads


# ------------------------------------------------------------------------------------------------------------ texts

def prose_paragraphs(text: str) -> list[str]:
  """The paragraphs of a help topic that are prose: no indented line (code and grammar), no ">>>", >= 75 % letters
  and spaces; heading underlines (*** / ===) dropped."""
  out = []
  for para in text.split("\n\n"):
    lines = [ln for ln in para.strip("\n").split("\n") if ln.strip() and set(ln.strip()) - set("*=-^~")]
    if not lines or any(ln[:1].isspace() for ln in lines):
      continue
    p = "\n".join(lines)
    if ">>>" in p or sum(c.isalpha() or c == " " for c in p) < 0.75 * len(p):
      continue
    out.append(p)
  return out


def scored_text() -> str:
  from pydoc_data.topics import topics   # pylint: disable=import-outside-toplevel
  return "\n\n".join(p for k in sorted(topics) for p in prose_paragraphs(topics[k]))


def importance_documents() -> list[str]:
  """Prose docstrings of the standard library (heads_real's rule), deduplicated, in file order; no help topics."""
  from sinkjax.experiments import heads_real  # pylint: disable=import-outside-toplevel
  return heads_real.prose_documents(heads_real.stdlib_docstrings())


def calibration_text() -> str:
  """far_attention's calibration text: `importance_documents` joined as one text, paragraphs apart like the scored
  help topics (so a head can reach far back), in file order; no help topics."""
  return "\n\n".join(importance_documents())


# ------------------------------------------------------------------------------------------------------------ runs

def plan(random_maps, scope: str = "global", rankings=("importance",)) -> list[str]:
  """Run names in the order they run (cheap first); `random_maps`: the random maps' seeds; `rankings`: a measurement
  run and a hybrid each. Scope "layer" is the study of the hybrid alone (ranked and random maps within each layer, a
  study.out of its own): the caches that need no map are the global study's."""
  hybrids = [f"hybrid_{r}_w{HYBRID_WINDOW}" for r in rankings] + [f"hybrid_random{s}_w{HYBRID_WINDOW}"
                                                                   for s in random_maps]
  if scope == "layer":
    return [*rankings] + hybrids
  names = [*rankings]
  for w in WINDOWS:
    names += [f"sinks{SINKS}_w{w}", f"window_w{w}"]
  return names + hybrids + ["full", "check"]


def measure_importance(model, cfg, tok, work: pathlib.Path) -> dict:
  from sinkjax.experiments.heads_real import doc_batches  # pylint: disable=import-outside-toplevel
  from sinkjax.run import head_importance_of  # pylint: disable=import-outside-toplevel
  docs = importance_documents()[:IMPORTANCE_DOCS]
  src = work / "importance_docs.jsonl"
  src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  batches, n_docs = doc_batches(cfg, tok, str(src), IMPORTANCE_SEQ, 8)
  imp = head_importance_of(model, batches)
  tokens = int(sum(int((b["segment_ids"] != 0).sum()) for b in batches))
  return {"importance": np.asarray(imp).round(6).tolist(), "documents": n_docs, "rows": 8 * len(batches),
          "tokens": tokens, "text": "stdlib docstrings (heads_real prose rule), first 256 in file order"}


def measure_far_attention(model, tok) -> dict:
  """far_attention [L, Hq] (`sinkjax.analysis.far_attention`, the hybrid's S and W) over FAR_ROWS rows of FAR_SEQ
  tokens of `calibration_text`."""
  from sinkjax import analysis  # pylint: disable=import-outside-toplevel
  ids = np.asarray(tok.encode_document(calibration_text()[:FAR_CHARS])[:FAR_ROWS * FAR_SEQ], np.int32)
  if len(ids) < FAR_ROWS * FAR_SEQ:
    raise StudyError(f"the calibration text gives {len(ids)} tokens, fewer than {FAR_ROWS} rows of {FAR_SEQ}")
  rows = ids.reshape(FAR_ROWS, FAR_SEQ)
  far = analysis.far_attention(model, [{"inputs": row[None]} for row in rows], sink_size=SINKS,
                               window=HYBRID_WINDOW)
  return {"far_attention": np.asarray(far).round(6).tolist(), "rows": FAR_ROWS, "seq_len": FAR_SEQ,
          "tokens": int(ids.size), "sink_size": SINKS, "window": HYBRID_WINDOW,
          "ids_sha256": hashlib.sha256(ids.tobytes()).hexdigest(),
          "text": f"stdlib docstrings (heads_real prose rule), in file order, joined by blank lines (the first "
                  f"{FAR_CHARS} characters encoded), cut into rows"}


def score_run(name: str, model, ids, scores: dict, opts: StreamingOptions) -> dict:
  from sinkjax.generate import kv_bytes, streaming_nll  # pylint: disable=import-outside-toplevel
  cfg = model.cfg
  N, shape = len(ids), (cfg.num_layers, cfg.num_kv_heads)
  rec = {"name": name}
  if name == "full":
    kw = dict(capacity=N)
    rec.update(kind="full", window=None, sink_size=0)
  elif name.startswith(("sinks", "window")):
    w = int(name.rsplit("_w", 1)[1])
    kw = dict(capacity=w, sink_size=SINKS if name.startswith("sinks") else 0)
    rec.update(kind="sinks" if kw["sink_size"] else "window", window=w, sink_size=kw["sink_size"])
  else:
    w = int(name.rsplit("_w", 1)[1])
    ranking = name[len("hybrid_"):].rsplit("_w", 1)[0]
    if ranking in RANKINGS:
      kv = cache_policy.kv_scores(np.asarray(scores[ranking]), cfg.num_kv_heads, cache_policy.SOURCE_GQA[ranking])
      full = cache_policy.top_heads(kv, opts.full_heads, opts.scope)
      rec.update(map_source=MAP_SOURCE[ranking], ranking=ranking, gqa=cache_policy.SOURCE_GQA[ranking])
    else:
      seed = int(name.split("random", 1)[1].split("_", 1)[0])
      full = cache_policy.random_heads(shape, opts.full_heads, opts.scope, seed)
      rec.update(map_source=f"random seed {seed}", seed=seed)
    kw = dict(capacity=N, sink_size=SINKS, window=w, full_heads=cache_policy.as_tuple(full))
    rec.update(kind="hybrid", window=w, sink_size=SINKS, full_heads=opts.full_heads, scope=opts.scope,
               map=np.asarray(full).astype(int).tolist())
  t0 = time.perf_counter()
  nll = streaming_nll(model, ids, chunk=opts.chunk, **kw)
  rec.update(seconds=round(time.perf_counter() - t0, 1), chunk=opts.chunk, tokens=N,
             nll=[float(f"{x:.7g}") for x in np.asarray(nll, np.float64)],
             kv_bytes=kv_bytes(cfg, **kw))
  return rec


def check_run(model, ids, chunk: int) -> dict:
  from sinkjax.generate import streaming_nll  # pylint: disable=import-outside-toplevel
  ids = ids[:CHECK_TOKENS]
  out = {"name": "check", "tokens": len(ids), "chunk": chunk, "modes": {}}
  for mode, kw in (("sinks", dict(capacity=HYBRID_WINDOW, sink_size=SINKS)), ("full", dict(capacity=len(ids)))):
    t0 = time.perf_counter()
    steps = streaming_nll(model, ids, **kw)
    t1 = time.perf_counter()
    blocks = streaming_nll(model, ids, chunk=chunk, **kw)
    t2 = time.perf_counter()
    out["modes"][mode] = {"max_abs_diff": float(np.abs(blocks - steps).max()), "seconds_steps": round(t1 - t0, 1),
                          "seconds_blocks": round(t2 - t1, 1), "ppl_steps": math.exp(steps.mean()),
                          "ppl_blocks": math.exp(blocks.mean())}
  return out


def study(checkpoint: str, out: pathlib.Path, opts: StreamingOptions, random_maps) -> None:
  from sinkjax.run import load_run  # pylint: disable=import-outside-toplevel
  logging.getLogger("absl").setLevel(logging.ERROR)
  out.mkdir(parents=True, exist_ok=True)
  runs = runner.Study(out, layout=".", record="{name}.json")      # the commit: HEAD as the study starts
  model, cfg, tok, _ = load_run(checkpoint, overrides=["model.dtype=float32"])
  text = scored_text()
  ids = tok.encode_document(text)[:opts.tokens]
  if len(ids) < opts.tokens:
    raise StudyError(f"the help topics give {len(ids)} tokens, fewer than streaming.tokens {opts.tokens}")
  meta = {"checkpoint": str(checkpoint), "tokens": len(ids), "text_chars": len(tok.decode(ids)),
          "text": "pydoc_data.topics prose paragraphs (sinkjax.experiments.streaming_real.prose_paragraphs), key order",
          "ids_sha256": hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest(), "dtype": "float32",
          "python": sys.version.split()[0]}

  def do(name):
    def run(_):
      print(f"[streaming_real] {name} ...", file=sys.stderr, flush=True)
      t0 = time.perf_counter()
      if name == "importance":
        rec = {"name": name, **measure_importance(model, cfg, tok, out)}
        (out / "importance_docs.jsonl").unlink(missing_ok=True)
      elif name == "far_attention":
        rec = {"name": name, **measure_far_attention(model, tok)}
      elif name == "check":
        rec = check_run(model, ids, opts.chunk)
      else:
        scores = {r: runner.read_json(runs.record_path(r))[r] for r in opts.rankings}
        rec = score_run(name, model, ids, scores, opts)
      rec.update(meta=meta, wall_seconds=round(time.perf_counter() - t0, 1))
      return rec, "scored"
    return run

  def done(_i, _n, res):
    if res.record is None:
      print(f"[streaming_real] {res.run.name}: {res.what}", file=sys.stderr, flush=True)
    elif res.ran:
      rec = res.record
      print(f"[streaming_real] {rec['name']}: {rec['wall_seconds']} s" +
            (f", ppl {math.exp(np.mean(rec['nll'])):.3f}" if "nll" in rec else ""), file=sys.stderr, flush=True)
  runs.walk([runner.Run(name, do(name)) for name in plan(random_maps, opts.scope, opts.rankings)], done)
  report(out)


# ---------------------------------------------------------------------------------------------------------- report

def load(out: pathlib.Path) -> dict:
  runs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json")) if p.name != "results.json"}
  scored = [r for r in runs.values() if "nll" in r]
  if len({r["meta"]["ids_sha256"] for r in scored}) > 1:
    raise StudyError(f"{out}: runs over different token sequences; give each study its own study.out")
  if not runs:
    raise StudyError(f"{out} holds no raw run files; run the study (study.run) first, or give its study.out")
  runner.one_commit(list(runs.values()))
  return runs


def summary(runs: dict) -> dict:
  """Every number the report quotes, from the raw runs."""
  rows = []
  for r in runs.values():
    if "nll" not in r:
      continue
    nll = np.asarray(r["nll"], np.float64)
    w = r["window"] or HYBRID_WINDOW
    rows.append({"name": r["name"], "kind": r["kind"], "window": r["window"], "sink_size": r["sink_size"],
                 "full_heads": int(np.sum(r["map"])) if "map" in r else None, "map_source": r.get("map_source"),
                 "scope": r.get("scope", "global" if "map" in r else None), "ppl": math.exp(nll.mean()), "ppl_first": math.exp(nll[:w - 1].mean()),
                 "ppl_after": math.exp(nll[w - 1:].mean()), "kv_bytes": r["kv_bytes"], "seconds": r["seconds"],
                 "commit": r["commit"]})
  out = {"rows": rows}
  hyb = {r["name"]: np.asarray(r["nll"], np.float64) for r in runs.values() if r.get("kind") == "hybrid"}
  randoms = sorted((n for n in hyb if "random" in n), key=lambda n: runs[n]["seed"])
  ranked = [(r, f"hybrid_{r}_w{HYBRID_WINDOW}") for r in RANKINGS if f"hybrid_{r}_w{HYBRID_WINDOW}" in hyb]
  ppl = {n: math.exp(hyb[n].mean()) for n in hyb}
  nb = min((len(x) for x in hyb.values()), default=0) // BLOCK
  won = lambda a, b: int(np.sum(hyb[a][:nb * BLOCK].reshape(nb, BLOCK).mean(1) <
                                hyb[b][:nb * BLOCK].reshape(nb, BLOCK).mean(1)))   # blocks where a's NLL is lower
  if len(randoms) >= 2:
    out["hybrid"] = {}
    for ranking, name in ranked:          # each ranked map against the random maps of its size (paired over maps)
      rank = 1 + sum(ppl[n] < ppl[name] for n in randoms)
      out["hybrid"][ranking] = {
          "ppl": ppl[name], "random_ppl": [ppl[n] for n in randoms], "random_seeds": [runs[n]["seed"] for n in randoms],
          "full_heads": int(np.sum(runs[name]["map"])), "heads": int(np.size(runs[name]["map"])),
          "rank": rank, "maps": 1 + len(randoms), "p_rank": rank / (1 + len(randoms)),
          "blocks": nb, "blocks_won": [won(name, n) for n in randoms],
          "effect": stats.paired_effect([ppl[n] - ppl[name] for n in randoms], nd=3,
                                        what=f"perplexity, random map - {MAP_SOURCE[ranking]} map")}
  if len(ranked) == 2:                    # the two ranked maps against each other: one pair, descriptive
    (ra, a), (rb, b) = ranked
    out["between"] = {"maps": [ra, rb], "ppl_diff": ppl[b] - ppl[a], "blocks": nb, "blocks_won": won(b, a),
                      "heads_shared": int(np.sum(np.asarray(runs[a]["map"]) & np.asarray(runs[b]["map"])))}
  if "check" in runs:
    out["check"] = runs["check"]["modes"]
  if "importance" in runs:
    imp = np.asarray(runs["importance"]["importance"])
    out["importance"] = {k: runs["importance"][k] for k in ("documents", "rows", "tokens")}
    out["importance"]["low"] = int(np.sum(imp < 0.1))
  if "far_attention" in runs:
    far = runs["far_attention"]
    out["far_attention"] = {k: far[k] for k in ("rows", "seq_len", "tokens", "sink_size", "window")}
    out["far_attention"]["mean"] = float(np.mean(far["far_attention"]))
  return out


def _label(row) -> str:
  """A cache's name in the table and the figure, from its raw run file or its summary row."""
  if row["kind"] == "full":
    return "full cache"
  if row["kind"] == "window":
    return f"window only (W {row['window']})"
  if row["kind"] == "sinks":
    return f"{row['sink_size']} sinks + window (W {row['window']})"
  within = ", within each layer" if row.get("scope") == "layer" else ""
  return f"hybrid, {row['map_source']}{within} (W {row['window']}, {row['sink_size']} sinks)"


def figure(runs: dict, path: pathlib.Path) -> None:
  """streaming_real.png (`plots.plot_streaming`): the full cache, window-only and sinks + window at each W and the
  importance hybrid as lines, the random hybrids as a band."""
  from sinkjax import plots  # pylint: disable=import-outside-toplevel
  order = ["full", *[f"{k}_w{w}" for w in WINDOWS for k in ("window", f"sinks{SINKS}")],
           *[f"hybrid_{r}_w{HYBRID_WINDOW}" for r in RANKINGS]]
  lines = [(_label(runs[n]), runs[n]["nll"]) for n in order if n in runs]
  randoms = [r["nll"] for r in runs.values() if r.get("map_source", "").startswith("random")]
  plots.plot_streaming(lines, randoms, path, window=CURVE,
                       title="SmolLM2-135M-Instruct, streaming perplexity on Python's help topics (float32)")


def report(out: pathlib.Path) -> dict:
  runs = load(out)
  s = summary(runs)
  order = lambda r: (r["kind"] != "full", r["kind"] == "hybrid", r["window"] or 0, r["kind"], r["name"])
  heads = lambda r: "90/90" if r["kind"] == "full" else f"{r['full_heads'] or 0}/90"
  lines = table(["cache", "full KV heads", "PPL", "PPL (first W)", "PPL (after W)", "KV cache bytes", "seconds"],
                ([_label(r), heads(r), f"{r['ppl']:.3f}", f"{r['ppl_first']:.3f}", f"{r['ppl_after']:.3f}",
                  f"{r['kv_bytes']:,}", f"{r['seconds']:.0f}"] for r in sorted(s["rows"], key=order)), "lrrrrrr")
  for ranking, h in s.get("hybrid", {}).items():
    lines += ["", f"{MAP_SOURCE[ranking].capitalize()} map: rank {h['rank']} of {h['maps']} maps (p = {h['rank']}/"
              f"{h['maps']} = {h['p_rank']:.3f} were it one more random map). {h['effect']['sentence']}",
              f"512-token blocks won by the {MAP_SOURCE[ranking]} map, per random map: {h['blocks_won']} of "
              f"{h['blocks']}."]
  if "between" in s:
    b = s["between"]
    lines += ["", f"{MAP_SOURCE[b['maps'][1]].capitalize()} map - {MAP_SOURCE[b['maps'][0]]} map: perplexity "
              f"{b['ppl_diff']:+.3f}; 512-token blocks won by the {MAP_SOURCE[b['maps'][1]]} map: {b['blocks_won']} "
              f"of {b['blocks']}; full heads in both maps: {b['heads_shared']}."]
  (out / "results.md").write_text("\n".join(lines) + "\n")
  runner.write_json(out / "results.json", s)
  figure(runs, out / "streaming_real.png")
  print("\n".join(lines))
  return s


def run_plan(plan_: runner.Plan, *, dry_run: bool = False, report_only: bool = False) -> None:
  """A driver-streaming study file, run (`sinkjax.experiments.study`): every run not yet scored, then the report."""
  opts = plan_.options({"streaming": StreamingOptions})["streaming"]
  for axis in set(plan_.axes) - {"random_map"}:
    raise StudyError(f"{plan_.path}: the streaming study's one axis is random_map (the random maps' seeds), got {axis}")
  seeds = [int(x) for x in plan_.axes.get("random_map", range(6))]
  out = pathlib.Path(plan_.study.out)
  if dry_run:
    print("\n".join(f"{n}: {'done' if (out / f'{n}.json').is_file() else 'to do'}"
                    for n in plan(seeds, opts.scope, opts.rankings)))
  elif report_only:
    report(out)
  elif not plan_.study.run:
    raise StudyError("give study.run=RUN_DIR (an imported model) or report only (--report-only)")
  elif len(seeds) < 2 or opts.tokens < 2 * max(WINDOWS):
    raise StudyError("two random maps or more (axes.random_map) and streaming.tokens >= 2048, please")
  else:
    study(plan_.study.run, out, opts, seeds)
