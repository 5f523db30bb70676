"""[Sink-MoE] on a real pretrained model: head importance (Fig. 4 / App. C) beside a random init, and the offline
English corpus the real-model studies share (`english_corpus`: Python's help topics and the standard library's
docstrings, split by a hash into analysis / train / heldout); a study file of driver importance.

    python -m sinkjax.experiments.study configs/studies/heads_fig4.yaml [study.run=RUN] [study.out=OUT] ...

What is measured and how: docs/RESULTS.md, "Fig. 4 / App. C". App. D (head pinning) is
`sinkjax.experiments.heads_pinning`; the first 30-step pinning study (docs/results/heads_real/) was made by this
module at commit 9125455.
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":   # a command until the study runner (#50) ran it
  errors.moved("sinkjax.experiments.heads_real",
            "python -m sinkjax.experiments.study configs/studies/heads_fig4.yaml (--run RUN: study.run=RUN; --out "
            "OUT: study.out=OUT)")

import ast
import functools
import hashlib
import json
import os
import pathlib
import sysconfig
import time

from sinkjax import paths
from sinkjax.experiments import runner
from sinkjax.experiments.runner import StudyError

ANALYSIS_DOCS, HELDOUT_DOCS = 512, 64
ANALYSIS_SEQ = 256
RANDOM_SEEDS = (0,)


# ------------------------------------------------------------------------------------------------------ corpus

def _prose(text: str) -> str | None:
  """The text cut at a paragraph end near 600 characters, if it is English prose (>= 300 characters, >= 75 %
  letters and spaces, no code-looking lines); else None."""
  text = text.strip()
  if len(text) < 300:
    return None
  if len(text) > 700:
    cut = text.rfind("\n\n", 300, 700)
    cut = cut if cut > 0 else text.rfind(". ", 300, 700) + 1
    text = text[:cut].strip() if cut > 0 else text[:600]
  letters = sum(c.isalpha() or c == " " for c in text)
  if letters < 0.75 * len(text) or ">>>" in text or "::" in text:
    return None
  return text


def _docstrings(path: pathlib.Path):
  try:
    tree = ast.parse(path.read_text(encoding="utf-8"))
  except (SyntaxError, UnicodeDecodeError, ValueError):
    return
  for node in [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                      ast.AsyncFunctionDef))]:
    doc = ast.get_docstring(node)
    if doc:
      yield doc


def stdlib_docstrings():
  """The docstrings of the standard library's modules, classes and functions, in file order (no tests, no
  site-packages, no help topics)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data"}
  for dirpath, dirnames, files in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in skip)
    for name in sorted(files):
      if name.endswith(".py"):
        yield from _docstrings(pathlib.Path(dirpath) / name)


def prose_documents(texts) -> list[str]:
  """The texts that are prose (`_prose`, cut near 600 characters), deduplicated, in their order."""
  seen, out = set(), []
  for t in texts:
    p = _prose(t)
    if p is not None and p not in seen:
      seen.add(p)
      out.append(p)
  return out


def english_documents() -> list[str]:
  """The corpus's documents: the prose of the help topics (in key order) and of the standard library's docstrings,
  each cut near 600 characters, deduplicated."""
  from pydoc_data.topics import topics   # pylint: disable=import-outside-toplevel
  return prose_documents([*(topics[k] for k in sorted(topics)), *stdlib_docstrings()])


def english_corpus(out: pathlib.Path) -> dict:
  """Writes analysis.jsonl / heldout.jsonl / train.jsonl under `out` (once) and returns their paths and sizes."""
  out.mkdir(parents=True, exist_ok=True)
  names = ("analysis", "heldout", "train")
  files = {n: out / f"{n}.jsonl" for n in names}
  if not all(f.is_file() for f in files.values()):
    docs = sorted(english_documents(), key=lambda t: hashlib.sha1(t.encode()).hexdigest())
    if len(docs) < ANALYSIS_DOCS + HELDOUT_DOCS + 200:
      raise StudyError(f"only {len(docs)} English documents found in this Python's standard library")
    parts = {"analysis": docs[:ANALYSIS_DOCS], "heldout": docs[ANALYSIS_DOCS:ANALYSIS_DOCS + HELDOUT_DOCS],
             "train": docs[ANALYSIS_DOCS + HELDOUT_DOCS:]}
    for n, d in parts.items():
      paths.write_atomic(files[n], "".join(json.dumps({"text": t}) + "\n" for t in d))
  return {n: {"path": str(f), "documents": sum(1 for _ in f.open())} for n, f in files.items()}


# ------------------------------------------------------------------------------------------------------ helpers

_read, _write = runner.read_json, runner.write_json


def doc_batches(cfg, tok, source: str, seq_len: int, batch_size: int, max_docs: int | None = None):
  import dataclasses  # pylint: disable=import-outside-toplevel
  from sinkjax.data import make_eval_batches  # pylint: disable=import-outside-toplevel
  data = dataclasses.replace(cfg.data, source=source, seq_len=seq_len, packing="document", format="text")
  counts = {}
  batches = make_eval_batches(data, tok, batch_size=batch_size, num_batches=None, split="all", max_docs=max_docs,
                              counts=counts)
  return batches, counts["documents"]


# The commit of the code this process runs: HEAD when the study started (the shared checkout's HEAD may move while a
# long study runs; the code loaded at the start is what made every record).
commit = functools.cache(runner.git_commit)


def log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ Fig. 4 / App. C

def analyse(run: str, corpus: dict, out: pathlib.Path, seeds=RANDOM_SEEDS) -> dict:
  """analysis.json: the pretrained model's and random inits' importance over the analysis documents."""
  rec = _read(out / "analysis.json")
  if rec is not None:
    return rec
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from sinkjax import eval as eval_lib  # pylint: disable=import-outside-toplevel
  from sinkjax.model import Transformer  # pylint: disable=import-outside-toplevel
  from sinkjax.run import load_run  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  # the layers as one scan: the same numbers, a compile that does not grow with depth (sinkjax.eval does the same)
  model, cfg, tok, _ = load_run(run, overrides=["model.dtype=float32", "model.scan_layers=true"])
  batches, ndocs = doc_batches(cfg, tok, corpus["analysis"]["path"], ANALYSIS_SEQ, 8)
  log(f"analysis: {ndocs} documents in {len(batches)} batches of 8 x {ANALYSIS_SEQ}")
  lm = eval_lib.language_model_metrics(model, batches)
  log(f"pretrained: imbalance {lm['head_imbalance']:.4f}, val_bpb {lm['val_bpb']:.4f}")
  diag = eval_lib.sink_diagnostics(model, batches[:4])
  rand = []
  for seed in seeds:
    r = eval_lib.language_model_metrics(Transformer(cfg.model, rngs=nnx.Rngs(seed)), batches)
    rand.append({"seed": seed, "importance": r["importance"], "head_imbalance": r["head_imbalance"],
                 "cv_per_layer": r["cv_per_layer"]})
    log(f"random init {seed}: imbalance {r['head_imbalance']:.4f}")
  rec = {"run": str(run), "documents": ndocs, "rows": int(sum(len(b["inputs"]) for b in batches)),
         "seq_len": ANALYSIS_SEQ, "eval_tokens": lm["eval_tokens"], "val_bpb": lm["val_bpb"],
         "val_loss": lm["val_loss"], "importance": lm["importance"], "head_imbalance": lm["head_imbalance"],
         "cv_per_layer": lm["cv_per_layer"], "diagnostic_rows": int(sum(len(b["inputs"]) for b in batches[:4])),
         "first_token_attention_per_head": diag["first_token_attention_per_head"],
         "first_token_value_norm": diag["first_token_value_norm"], "other_value_norm": diag["other_value_norm"],
         "random_init": rand, "seconds": time.perf_counter() - t0, **commit()}
  _write(out / "analysis.json", rec)
  return rec


# ------------------------------------------------------------------------------------------------------ driver

def run_plan(plan: runner.Plan, *, dry_run: bool = False, report_only: bool = False) -> None:
  """A driver-importance study file, run (`sinkjax.experiments.study`): the corpus, analysis.json (once; a rerun reuses
  it) and the Fig. 4 heatmap, both in study.results (default OUT/results)."""
  for axis in set(plan.axes) - {"random_init"}:
    raise StudyError(f"{plan.path}: the importance study's one axis is random_init (the random inits' seeds), "
                     f"got {axis}")
  seeds = tuple(int(s) for s in plan.axes.get("random_init", RANDOM_SEEDS))
  out = pathlib.Path(plan.study.out)
  results = plan.results()
  rec = _read(out / "analysis.json")
  if rec is not None and [r["seed"] for r in rec["random_init"]] != list(seeds):
    raise StudyError(f"{out}/analysis.json holds random inits {[r['seed'] for r in rec['random_init']]}, not "
                     f"{list(seeds)}: give the study another study.out")
  if dry_run:
    print(f"{out / 'analysis.json'}: {'done' if rec else 'to do'} (random inits {list(seeds)})")
    return
  if not report_only:
    if not pathlib.Path(plan.study.run, "config.yaml").is_file():
      raise StudyError(f"study.run {plan.study.run!r} is not a run directory; import the model first (docs/CONVERT.md)")
    import sinkjax.eval, sinkjax.run  # pylint: disable=import-outside-toplevel,unused-import,redefined-outer-name
    commit()                      # the code is loaded: the commit that made every record of this process
    corpus = english_corpus(out / "corpus")
    _write(out / "corpus.json", corpus)
    log("corpus: " + ", ".join(f"{n} {c['documents']}" for n, c in corpus.items()))
    analyse(plan.study.run, corpus, out, seeds)
  elif rec is None:
    raise StudyError(f"{out} holds no analysis.json; run the study first")
  runner.copy_files(out, results, ("analysis.json", "corpus.json"))
  from sinkjax import plots  # pylint: disable=import-outside-toplevel
  figure = plots.plot_head_analysis(_read(out / "analysis.json"), results / "analysis.png")
  log(f"wrote {figure} (Fig. 4: importance of the pretrained model and of a random init)")
