"""[Sink-MoE] on a real pretrained model: head importance (Fig. 4 / App. C) and head pinning (App. D).

    python -m sinkjax.experiments.heads_real --run runs/smollm2 --out runs/heads_real [--results docs/results/heads_real]

`--run` is an imported real model (docs/CONVERT.md: SmolLM2-135M-Instruct from its GGUF file). The study, run by run,
resumable (an interrupted study picks up at the first unfinished step; a finished step is never redone):

1. **Corpus** (`english_corpus`): English prose from this machine, offline: Python's own help topics
   (pydoc_data.topics) and the docstrings of the standard library's modules, classes and functions (>= 300 characters,
   at least 75 % letters and spaces, cut at a paragraph end near 600 characters), deduplicated and split by a hash of
   the text into `analysis` (>= 500 documents), `train` (fine-tuning) and `heldout`. Technical English, not GSM8K:
   [Sink-MoE] App. C uses 500 GSM8K samples, which this machine cannot download.
2. **Fig. 4 / App. C** (`analysis.json`): eq. 5 importance per head of the pretrained model over every `analysis`
   document (one document per segment, rows of 256 tokens, no BOS: this tokenizer adds none, so eq. 4's first key is
   each document's first token), eq. 6 imbalance and per-layer CV, beside the same architecture at random init
   (sinkjax's initialisation) on the same rows; first-token attention and value norms per head on the first
   rows.
3. **App. D, head pinning** (`runs/<arm>_<kind>_s<seed>/`): fine-tunes (configs/finetune_smollm2.yaml, on `train`)
   with the base loss (`base`), eq. 7 (`eq7`: λ 1e-2 on all heads) and eq. 8 (`eq8`: λ 1e-2, m = 2 shared heads per
   layer fixed up front as the paper does: the top-2 heads of each layer by the pretrained model's importance on
   `analysis`), LoRA with 3 seeds per arm (a seed fixes the adapters' init and the data order of every arm, so arms
   are paired by seed) and full fine-tuning with one seed per arm; then held-out loss / BPB and importance per head on
   `heldout`, with the shared heads' and routed heads' importance and the routed heads' CV.
4. **Report** (`results.md`, `results.json`, figures): each arm against `base`, paired by seed, with
   `sinkjax.experiments.stats.paired_effect` (paired t with t_{n-1}, exact permutation and sign tests, the smallest
   detectable effect beside every "not detected"); a claim the tests do not support is not made. The fine-tuning
   runs are walked by `sinkjax.experiments.runner`: every run's raw files (its record, metrics.jsonl, config.yaml)
   are copied to `--results`/raw/ with the commit that made them; a study refuses to aggregate runs of different
   commits.
"""
from __future__ import annotations

from sinkjax import cli

if __name__ == "__main__":
  cli.require_extra("sinkjax.experiments.heads_real")

import argparse
import ast
import hashlib
import json
import os
import pathlib
import sys
import sysconfig
import time

import numpy as np

from sinkjax.experiments import runner, stats
from sinkjax.experiments.runner import StudyError, one_commit

CONFIG = pathlib.Path(__file__).resolve().parents[2] / "configs" / "finetune_smollm2.yaml"
ARMS = {"base": (0.0, 0), "eq7": (1e-2, 0), "eq8": (1e-2, 2)}     # name -> (lambda, m)
ARM_TITLES = {"base": "base loss", "eq7": "eq. 7 (all heads, λ 1e-2)", "eq8": "eq. 8 (m = 2 shared, λ 1e-2)"}
LORA_SEEDS = (0, 1, 2)
FULL_SEEDS = (0,)
FULL_LR = 3e-5
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


def english_documents() -> list[str]:
  """The corpus's documents, deduplicated, in a fixed order (see the module docstring)."""
  from pydoc_data.topics import topics   # pylint: disable=import-outside-toplevel
  texts = [topics[k] for k in sorted(topics)]
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  skip = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "pydoc_data"}
  for dirpath, dirnames, files in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in skip)
    for name in sorted(files):
      if name.endswith(".py"):
        texts += list(_docstrings(pathlib.Path(dirpath) / name))
  seen, out = set(), []
  for t in texts:
    p = _prose(t)
    if p is not None and p not in seen:
      seen.add(p)
      out.append(p)
  return out


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
      tmp = files[n].with_suffix(".tmp")
      tmp.write_text("".join(json.dumps({"text": t}) + "\n" for t in d))
      os.replace(tmp, files[n])
  return {n: {"path": str(f), "documents": sum(1 for _ in f.open())} for n, f in files.items()}


# ------------------------------------------------------------------------------------------------------ helpers

_read, _write = runner.read_json, runner.write_json
RAW_FILES = ("record.json", "metrics.jsonl", "config.yaml")     # what each fine-tuning run keeps in RESULTS/raw/NAME
STUDY_FILES = ("analysis.json", "before.json", "corpus.json")    # the study's own records, kept in RESULTS


def _batches(cfg, tok, source: str, seq_len: int, batch_size: int, max_docs: int | None = None):
  import dataclasses  # pylint: disable=import-outside-toplevel
  from sinkjax.data import make_eval_batches  # pylint: disable=import-outside-toplevel
  data = dataclasses.replace(cfg.data, source=source, seq_len=seq_len, packing="document", format="text")
  counts = {}
  batches = make_eval_batches(data, tok, batch_size=batch_size, num_batches=None, split="all", max_docs=max_docs,
                              counts=counts)
  return batches, counts["documents"]


_COMMIT: dict = {}


def _commit() -> dict:
  """The commit of the code this process runs: HEAD when the study started (the shared checkout's HEAD may move while
  a long study runs; the code loaded at the start is what made every record)."""
  if not _COMMIT:
    _COMMIT.update(runner.git_commit())
  return dict(_COMMIT)


def _log(msg: str) -> None:
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ Fig. 4 / App. C

def analyse(run: str, corpus: dict, out: pathlib.Path) -> dict:
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
  batches, ndocs = _batches(cfg, tok, corpus["analysis"]["path"], ANALYSIS_SEQ, 8)
  _log(f"analysis: {ndocs} documents in {len(batches)} batches of 8 x {ANALYSIS_SEQ}")
  lm = eval_lib.language_model_metrics(model, batches)
  _log(f"pretrained: imbalance {lm['head_imbalance']:.4f}, val_bpb {lm['val_bpb']:.4f}")
  diag = eval_lib.sink_diagnostics(model, batches[:4])
  rand = []
  for seed in RANDOM_SEEDS:
    r = eval_lib.language_model_metrics(Transformer(cfg.model, rngs=nnx.Rngs(seed)), batches)
    rand.append({"seed": seed, "importance": r["importance"], "head_imbalance": r["head_imbalance"],
                 "cv_per_layer": r["cv_per_layer"]})
    _log(f"random init {seed}: imbalance {r['head_imbalance']:.4f}")
  rec = {"run": str(run), "documents": ndocs, "rows": int(sum(len(b["inputs"]) for b in batches)),
         "seq_len": ANALYSIS_SEQ, "eval_tokens": lm["eval_tokens"], "val_bpb": lm["val_bpb"],
         "val_loss": lm["val_loss"], "importance": lm["importance"], "head_imbalance": lm["head_imbalance"],
         "cv_per_layer": lm["cv_per_layer"], "diagnostic_rows": int(sum(len(b["inputs"]) for b in batches[:4])),
         "first_token_attention_per_head": diag["first_token_attention_per_head"],
         "first_token_value_norm": diag["first_token_value_norm"], "other_value_norm": diag["other_value_norm"],
         "random_init": rand, "seconds": time.perf_counter() - t0, **_commit()}
  _write(out / "analysis.json", rec)
  _write(out / "shared_heads.json", {"importance": lm["importance"], "source": "analysis.json"})
  return rec


# ---------------------------------------------------------------------------------------------------- App. D

def run_name(arm: str, kind: str, seed: int) -> str:
  return f"{arm}_{kind}_s{seed}"


def plan() -> list[tuple[str, str, int]]:
  """(arm, lora|full, seed) in the order they run: LoRA seed by seed (each seed's three arms together, so an
  interrupted study has whole pairs), then full fine-tuning."""
  return ([(arm, "lora", s) for s in LORA_SEEDS for arm in ARMS] + [(arm, "full", s) for s in FULL_SEEDS
                                                                     for arm in ARMS])


def _heldout_eval(run_dir, corpus: dict) -> dict:
  from sinkjax import eval as eval_lib  # pylint: disable=import-outside-toplevel
  from sinkjax import lora  # pylint: disable=import-outside-toplevel
  from sinkjax.run import load_run  # pylint: disable=import-outside-toplevel
  model, cfg, tok, step = load_run(run_dir, overrides=["model.dtype=float32"])
  batches, ndocs = _batches(cfg, tok, corpus["heldout"]["path"], 128, 8)
  lm = eval_lib.language_model_metrics(lora.merge(model), batches)
  return {"step": step, "documents": ndocs, **{k: lm[k] for k in ("val_loss", "val_bpb", "eval_tokens",
                                                                  "importance", "head_imbalance", "cv_per_layer")}}


def before(run: str, corpus: dict, out: pathlib.Path) -> dict:
  rec = _read(out / "before.json")
  if rec is None:
    rec = {**_heldout_eval(run, corpus), **_commit()}
    _write(out / "before.json", rec)
  return rec


def pinning_study(out: pathlib.Path, results: pathlib.Path) -> runner.Study:
  """The runner of the fine-tuning runs: OUT/runs/NAME, finished once record.json (stamped with the study's commit)
  is written, raw files kept in RESULTS/raw/NAME ("raw", not "runs", which .gitignore ignores)."""
  return runner.Study(out, record="record.json", raw=results / "raw", raw_files=RAW_FILES, commit=_commit())


def finetune_overrides(run: str, arm: str, kind: str, seed: int, corpus: dict, out: pathlib.Path,
                       steps: int | None) -> tuple[str, ...]:
  """What one fine-tuning run (in OUT/runs/NAME) sets on top of configs/finetune_smollm2.yaml."""
  lam, m = ARMS[arm]
  run_dir = out / "runs" / run_name(arm, kind, seed)
  overrides = [f"train.init_from={run}", f"data.source={corpus['train']['path']}", f"run.dir={run_dir}",
               f"train.seed={seed}", f"loss.aux_weight={lam}", f"loss.num_shared_heads={m}",
               f"loss.shared_heads_from={out / 'shared_heads.json' if m else ''}"]
  if kind == "full":
    overrides += ["lora.rank=0", f"train.adamw_lr={FULL_LR}"]
  if steps is not None:
    overrides.append(f"train.steps={steps}")
  return tuple(overrides)


def finetune(run: str, arm: str, kind: str, seed: int, corpus: dict, out: pathlib.Path,
             steps: int | None) -> runner.Run:
  """One fine-tuning run and its held-out evaluation, for the runner (which writes record.json)."""
  overrides = finetune_overrides(run, arm, kind, seed, corpus, out, steps)
  lam, m = ARMS[arm]

  def do(run_dir):
    from sinkjax import config as config_lib  # pylint: disable=import-outside-toplevel
    from sinkjax.train import train  # pylint: disable=import-outside-toplevel
    cfg = config_lib.load_config(str(CONFIG), list(overrides))
    t0 = time.perf_counter()
    summary = train(cfg, progress=False)
    seconds = time.perf_counter() - t0
    ev = _heldout_eval(run_dir, corpus)
    return {"name": run_dir.name, "arm": arm, "kind": kind, "seed": seed, "aux_weight": lam, "num_shared_heads": m,
            "steps": summary["steps"], "final_loss": summary["final_loss"], "train_seconds": seconds, **ev}, \
        "fine-tuned + evaluated"
  return runner.Run(run_name(arm, kind, seed), do, overrides)


def keep_raw(out: pathlib.Path, results: pathlib.Path) -> None:
  """The study's records (`STUDY_FILES`) and every finished run's own files (`RAW_FILES`), to `results`."""
  runner.copy_files(out, results, STUDY_FILES)
  for run_dir in sorted((out / "runs").glob("*")):
    if (run_dir / "record.json").is_file():
      runner.copy_files(run_dir, results / "raw" / run_dir.name, RAW_FILES)


# ------------------------------------------------------------------------------------------------------ report

def role_metrics(before_imp, after_imp, shared_imp, m: int = 2) -> dict:
  """Importance after fine-tuning of the shared heads (top-m per layer of `shared_imp`, the pretrained importance
  eq. 8 fixed) and the routed rest, and the routed heads' CV (eq. 8's target); plus the overall imbalance."""
  a, s = np.asarray(after_imp, np.float64), np.asarray(shared_imp, np.float64)
  shared = np.zeros(s.shape, bool)
  np.put_along_axis(shared, np.argsort(-s, -1)[:, :m], True, -1)
  routed = a[~shared].reshape(a.shape[0], -1)
  return {"shared_importance": float(a[shared].mean()), "routed_importance": float(routed.mean()),
          "routed_cv": float(np.mean(routed.std(-1) / np.maximum(routed.mean(-1), 1e-12))),
          "mean_importance": float(a.mean()),
          "imbalance": float(np.mean(a.std(-1) / np.maximum(a.mean(-1), 1e-12)))}


METRICS = (("imbalance", "head imbalance (eq. 6)"), ("mean_importance", "mean importance"),
           ("shared_importance", "shared heads' importance"), ("routed_importance", "routed heads' importance"),
           ("routed_cv", "routed heads' CV"), ("val_loss", "held-out loss (nats/token)"))


def summarize(out: pathlib.Path) -> dict:
  analysis = _read(out / "analysis.json")
  bef = _read(out / "before.json")
  records = [r for _, _, _, r in _records(out)]
  if analysis is None or bef is None:
    raise StudyError(f"{out} has no finished analysis yet; run the study first")
  commit = one_commit(records + [analysis, bef])
  shared_imp = analysis["importance"]
  rows = {}
  for r in records:
    rows[(r["arm"], r["kind"], r["seed"])] = {**role_metrics(bef["importance"], r["importance"], shared_imp),
                                              "val_loss": r["val_loss"], "val_bpb": r["val_bpb"]}
  before_row = {**role_metrics(bef["importance"], bef["importance"], shared_imp), "val_loss": bef["val_loss"],
                "val_bpb": bef["val_bpb"]}
  effects = {}
  for arm in ARMS:
    if arm == "base":
      continue
    for key, what in METRICS:
      seeds = [s for s in LORA_SEEDS if (arm, "lora", s) in rows and ("base", "lora", s) in rows]
      if len(seeds) >= 2:
        d = [rows[(arm, "lora", s)][key] - rows[("base", "lora", s)][key] for s in seeds]
        effects[f"{arm}.{key}"] = stats.paired_effect(d, what=f"{ARM_TITLES[arm]} − base loss, {what} (LoRA)")
  rand = analysis["random_init"]
  return {"commit": commit, "analysis": {k: analysis[k] for k in ("documents", "rows", "eval_tokens", "val_bpb",
                                                                   "head_imbalance", "cv_per_layer")},
          "random_imbalance": [r["head_imbalance"] for r in rand], "before": before_row,
          "rows": {f"{a}_{k}_s{s}": v for (a, k, s), v in rows.items()}, "effects": effects}


def _records(out: pathlib.Path):
  for arm, kind, seed in plan():
    r = _read(out / "runs" / run_name(arm, kind, seed) / "record.json")
    if r is not None:
      yield arm, kind, seed, r


def markdown(summary: dict, corpus: dict) -> str:
  a = summary["analysis"]
  lines = ["# [Sink-MoE] on a real pretrained model: SmolLM2-135M-Instruct", "",
           f"Commit `{summary['commit']}`. Corpus (offline English, `heads_real.english_corpus`): "
           + ", ".join(f"{n} {c['documents']} documents" for n, c in corpus.items()) + ".", "",
           "## Fig. 4 / App. C: head importance", "",
           f"{a['documents']} documents, {a['rows']} rows of {ANALYSIS_SEQ} tokens, {a['eval_tokens']:,} scored "
           f"tokens (val_bpb {a['val_bpb']:.4f}). Head imbalance (eq. 6) **{a['head_imbalance']:.4f}**; the same "
           f"architecture at random init: {', '.join(f'{x:.4f}' for x in summary['random_imbalance'])}.",
           "", "![importance](analysis.png)", "", "## App. D: head pinning", "",
           "| run | imbalance | mean imp. | shared imp. | routed imp. | routed CV | held-out loss |",
           "|---|---|---|---|---|---|---|"]
  fmt_row = lambda n, r: (f"| {n} | {r['imbalance']:.4f} | {r['mean_importance']:.4f} | {r['shared_importance']:.4f} | "
                          f"{r['routed_importance']:.4f} | {r['routed_cv']:.4f} | {r['val_loss']:.4f} |")
  lines.append(fmt_row("before fine-tuning", summary["before"]))
  lines += [fmt_row(n, r) for n, r in summary["rows"].items()]
  lines += ["", "Each arm against the base loss, LoRA, paired by seed:", ""]
  lines += [f"- {e['sentence']}" for e in summary["effects"].values()]
  lines += ["", "![pinning](pinning.png)", ""]
  return "\n".join(lines)


def report(out: pathlib.Path, results: pathlib.Path, corpus: dict) -> dict:
  summary = summarize(out)
  results.mkdir(parents=True, exist_ok=True)
  _write(results / "results.json", summary)
  from sinkjax import plots  # pylint: disable=import-outside-toplevel
  plots.plot_head_analysis(_read(out / "analysis.json"), results / "analysis.png")
  if summary["rows"]:
    plots.plot_pinning(summary, results / "pinning.png", arms=list(ARMS), metrics=METRICS[:5])
  (results / "results.md").write_text(markdown(summary, corpus))
  return summary


# ------------------------------------------------------------------------------------------------------ driver

def build_parser() -> argparse.ArgumentParser:
  p = cli.Parser(prog="python -m sinkjax.experiments.heads_real", description=__doc__.split("\n\n")[0])
  p.add_argument("--run", required=True, help="the imported real model's run directory (sinkjax.convert.hf)")
  p.add_argument("--out", required=True, help="the study's working directory (runs, records; resumable)")
  p.add_argument("--results", default=None, help="where the raw files, results.md and figures go (default OUT/results)")
  p.add_argument("--steps", type=int, default=None, help="fine-tuning steps (default: configs/finetune_smollm2.yaml)")
  p.add_argument("--only", choices=("analysis", "pinning", "report"), default=None, help="one part only")
  return p


def main(argv=None) -> int:
  args = build_parser().parse_args(argv)

  def study():
    if not pathlib.Path(args.run, "config.yaml").is_file():
      raise StudyError(f"--run {args.run} is not a run directory; import the model first (docs/CONVERT.md)")
    import sinkjax.eval, sinkjax.lora, sinkjax.run, sinkjax.train  # pylint: disable=import-outside-toplevel,unused-import,redefined-outer-name
    _commit()                     # the code is loaded: the commit that made every record of this process
    out = pathlib.Path(args.out)
    results = pathlib.Path(args.results) if args.results else out / "results"
    corpus = english_corpus(out / "corpus")
    _write(out / "corpus.json", corpus)
    _log("corpus: " + ", ".join(f"{n} {c['documents']}" for n, c in corpus.items()))
    if args.only in (None, "analysis", "pinning"):
      analyse(args.run, corpus, out)
    if args.only == "analysis":       # Fig. 4 on its own: the heatmap from analysis.json, no fine-tuning needed
      runner.copy_files(out, results, ("analysis.json", "corpus.json"))
      from sinkjax import plots  # pylint: disable=import-outside-toplevel
      figure = plots.plot_head_analysis(_read(out / "analysis.json"), results / "analysis.png")
      _log(f"wrote {figure} (Fig. 4: importance of the pretrained model and of a random init)")
      return
    if args.only in (None, "pinning"):
      before(args.run, corpus, out)
      runner.copy_files(out, results, STUDY_FILES)

      def done(i, n, res):
        if res.record is None:
          _log(f"[{i}/{n}] {res.run.name}: {res.what}")
        else:
          _log(f"[{i}/{n}] {res.run.name}: held-out loss {res.record['val_loss']:.4f}, imbalance "
               f"{res.record['head_imbalance']:.4f} ({res.seconds:.0f} s)")
      pinning_study(out, results).walk([finetune(args.run, arm, kind, seed, corpus, out, args.steps)
                                        for arm, kind, seed in plan()], done)
    keep_raw(out, results)
    summary = report(out, results, corpus)
    _log(f"wrote {results}/results.md ({len(summary['rows'])} fine-tuned runs)")
  return cli.run_main("sinkjax.experiments.heads_real", study)


if __name__ == "__main__":
  sys.exit(main())
