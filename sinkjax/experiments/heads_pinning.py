"""[Sink-MoE] App. D (head pinning) on SmolLM2-135M at one epoch of this corpus, with per-document held-out losses;
study files of driver pinning (heads_pinning.yaml: LoRA; heads_pinning_full.yaml: every weight) and pinning_null.

    python -m sinkjax.experiments.study configs/studies/heads_pinning.yaml [study.run=RUN] [study.results=DIR]
        [axes.train.seed=[0,1]] [study.allow_dirty=true] [--report-only]
    python -m sinkjax.experiments.study configs/studies/heads_pinning_null.yaml     # the null arm (null.json)

Resumable, in order: eq. 8's shared heads fixed up front (`shared_heads`), the pretrained model on every held-out
document (`step0`), then per seed the arms eq. 7, eq. 8 and base (`ARMS`) for one epoch, each evaluated per document
(`doc_eval`) at `EVAL_STEPS` and its end; the report tests every contrast over seeds (paired t), over documents
(bootstrap, sign-flip permutation) and over both (`stats.crossed`), with Holm's correction per column over `FAMILY`,
and draws the figures (`FIGURES`). A dirty checkout is refused unless study.allow_dirty; an interrupted run is dropped
and made again from step 0. The setup and the readings: docs/RESULTS.md, "App. D at one epoch of this corpus".
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":   # a command until the study runner (#50) ran it
  errors.moved("sinkjax.experiments.heads_pinning",
            "python -m sinkjax.experiments.study configs/studies/heads_pinning.yaml (--run RUN: study.run=RUN; --out "
            "OUT: study.out=OUT; the null arm: heads_pinning_null.yaml)")

import functools
import json
import math
import pathlib
import re
import shutil
import time

import numpy as np

from sinkjax import balance, stats
from sinkjax import config as config_lib
from sinkjax.experiments import heads_real, runner
from sinkjax.experiments.runner import StudyError, one_commit
from sinkjax.markdown import table

ARMS = {"base": (0.0, 0), "eq7": (1e-2, 0), "eq8": (1e-2, 2)}     # name -> (lambda, m): base loss, eq. 7, eq. 8
ARM_TITLES = {"base": "base", "eq7": "eq. 7", "eq8": "eq. 8"}
CONTRASTS = (("eq8", "eq7"), ("eq7", "base"), ("eq8", "base"))        # the paper's point first
SEEDS = (0, 1, 2)
EVAL_STEPS = (30, 100)                      # besides step 0 and the end
DOC_TOKENS = 208                            # a held-out document's first DOC_TOKENS + 1 tokens are scored
SHARED_DOCS = 128
PLAN_ARMS = ("eq7", "eq8", "base")           # within a seed: the paper's contrast first
METRICS = (("val_loss", "held-out loss (nats/token)"), ("imbalance", "head imbalance (eq. 6)"),
           ("shared_importance", "shared heads' importance"), ("routed_importance", "routed heads' importance"),
           ("routed_cv", "routed heads' CV"), ("mean_importance", "mean importance"))
# Holm's family: no test in it is a linear function of others. eq. 8 − base is the sum of the two contrasts in it, and
# the mean importance is (m·shared + (H − m)·routed)/H of each document: they are reported, outside the family.
FAMILY_CONTRASTS = CONTRASTS[:2]
FAMILY_METRICS = tuple(k for k, _ in METRICS if k != "mean_importance")
FAMILY = ("Holm's family: the 10 tests of eq. 8 − eq. 7 and eq. 7 − base on held-out loss, imbalance, shared and "
          "routed heads' importance and routed CV, per column; outside it (Holm —) eq. 8 − base, the sum of the "
          "other two contrasts, and the mean importance, a fixed weighted mean of the shared and routed heads'")
FIGURES = ("pinning_importance.png", "pinning_curve.png")
RAW_FILES = ("record.json", "metrics.jsonl", "config.yaml")
STUDY_FILE = config_lib.configs_dir() / "studies" / "heads_pinning.yaml"

_read, _write, _log, _commit = runner.read_json, runner.write_json, heads_real.log, heads_real.commit


def run_name(arm: str, seed: int, kind: str = "lora") -> str:
  return f"{arm}_{kind}_s{seed}"


def tuning_kind(plan: runner.Plan) -> str:
  """"lora" (the study config's LoRA adapters) or "full" (lora.rank 0: every weight; heads_pinning_full.yaml)."""
  return "full" if plan.config({}, "RUN_DIR").lora.rank == 0 else "lora"


def run_order(seeds=SEEDS) -> list[tuple[str, int]]:
  """(arm, seed) in the order they run: seed by seed, each seed's three arms together, eq. 7 and eq. 8 first."""
  return [(arm, s) for s in seeds for arm in PLAN_ARMS]


# ------------------------------------------------------------------------------------------------ the documents

def doc_rows(tok, path, T: int = DOC_TOKENS) -> tuple[dict, int]:
  """One row per document of the JSONL file: its first T + 1 tokens (no BOS: as the training rows), padding after;
  features as the pipeline's (`inputs`, `targets`, `segment_ids` 1 on the document, `positions`, `loss_mask` on
  its targets). Returns (features [N, T], how many documents were cut at T + 1 tokens)."""
  docs = [json.loads(line)["text"] for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
  n = len(docs)
  tokens = np.zeros((n, T + 1), np.int32)
  length = np.zeros(n, np.int64)
  cut = 0
  for i, text in enumerate(docs):
    ids = np.asarray(tok.encode_with_bytes(text)[0], np.int32)
    cut += len(ids) > T + 1
    ids = ids[:T + 1]
    tokens[i, :len(ids)] = ids
    length[i] = len(ids)
  on = np.arange(T + 1)[None, :] < length[:, None]
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": on[:, :-1].astype(np.int32),
          "positions": np.where(on[:, :-1], np.arange(T)[None, :], 0).astype(np.int32),
          "loss_mask": (on[:, 1:] & on[:, :-1]).astype(np.float32)}, cut


@functools.lru_cache(maxsize=4)
def _doc_fn(graphdef, chunk: int):
  """The jitted per-row forward of `doc_eval` (one compile per model structure and shape in a process)."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from sinkjax.step import token_losses  # pylint: disable=import-outside-toplevel

  @jax.jit
  def run(state, rows):
    def one(row):
      nll, imp = token_losses(nnx.merge(graphdef, state), jax.tree.map(lambda x: x[None], row))
      return jnp.sum(nll[0] * row["loss_mask"]), imp
    return jax.lax.map(one, rows, batch_size=chunk)
  return run


def doc_eval(model, rows: dict, shared_imp, m: int = 2, chunk: int = 8) -> dict:
  """Per document (one row each): summed and mean NLL of its targets, and role metrics of its own importance
  (`balance.head_roles` with the shared set = top-m of `shared_imp` per layer); plus `importance`, the mean over
  documents of their importances [L, H]. Each row is its own forward pass (a vmap over rows in chunks of `chunk`), so
  a document's importance is its own."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  graphdef, state = nnx.split(model)
  nll_sum, imp = jax.device_get(_doc_fn(graphdef, chunk)(state, {k: jnp.asarray(v) for k, v in rows.items()}))
  tokens, nll_sum = rows["loss_mask"].sum(-1).astype(np.float64), np.asarray(nll_sum, np.float64)
  roles = [balance.head_roles(x, shared_imp, m) for x in imp]
  return {"tokens": tokens.astype(int).tolist(), "nll_sum": nll_sum.tolist(),
          "val_loss": (nll_sum / np.maximum(tokens, 1.0)).tolist(), **{k: [r[k] for r in roles] for k in roles[0]},
          "importance": np.asarray(imp, np.float64).mean(0).tolist()}


def eval_checkpoint(run_dir, step: int | None, corpus: dict, shared_imp) -> dict:
  """`doc_eval` of a run's checkpoint (adapters folded in) on the held-out documents, with its step and timing."""
  from sinkjax import lora  # pylint: disable=import-outside-toplevel
  from sinkjax.run import load_run  # pylint: disable=import-outside-toplevel
  t0 = time.perf_counter()
  model, _, tok, got = load_run(run_dir, step=step, overrides=["model.dtype=float32"])
  rows, cut = doc_rows(tok, corpus["heldout"]["path"])
  ev = doc_eval(lora.merge(model), rows, shared_imp)
  return {"step": int(got), "documents": len(ev["tokens"]), "doc_tokens": DOC_TOKENS, "documents_cut": cut,
          **ev, "seconds": time.perf_counter() - t0, **_commit()}


# ---------------------------------------------------------------------------------------------- study records

def shared_heads(run: str, corpus: dict, out: pathlib.Path) -> dict:
  """shared_heads.json: the pretrained importance over the first SHARED_DOCS analysis documents (what eq. 8's
  shared set is taken from: loss.shared_heads_from)."""
  rec = _read(out / "shared_heads.json")
  if rec is None:
    from sinkjax import eval as eval_lib  # pylint: disable=import-outside-toplevel
    from sinkjax.run import load_run  # pylint: disable=import-outside-toplevel
    t0 = time.perf_counter()
    model, cfg, tok, _ = load_run(run, overrides=["model.dtype=float32"])
    batches, ndocs = heads_real.doc_batches(cfg, tok, corpus["analysis"]["path"], heads_real.ANALYSIS_SEQ, 8,
                                         max_docs=SHARED_DOCS)
    lm = eval_lib.language_model_metrics(model, batches)
    rec = {"importance": lm["importance"], "documents": ndocs, "seq_len": heads_real.ANALYSIS_SEQ,
           "eval_tokens": lm["eval_tokens"], "source": "analysis documents", "seconds": time.perf_counter() - t0,
           **_commit()}
    _write(out / "shared_heads.json", rec)
  return rec


def step0(run: str, corpus: dict, out: pathlib.Path, shared_imp) -> dict:
  rec = _read(out / "nll_step0.json")
  if rec is None:
    rec = eval_checkpoint(run, None, corpus, shared_imp)
    rec["step"] = 0                         # the imported model: every run's step 0
    _write(out / "nll_step0.json", rec)
  return rec


def finetune_overrides(run: str, arm: str, seed: int, corpus: dict, out: pathlib.Path, steps: int,
                       kind: str = "lora") -> list[str]:
  """What one run sets on top of the study's config: the arm's λ and m (eq. 8's shared set fixed up front from
  OUT/shared_heads.json), one epoch of all train documents (data.val_source = the
  held-out ones, never evaluated by train), and checkpoints at the evaluated steps only (checkpoint.keep_steps)."""
  lam, m = ARMS[arm]
  return [f"train.init_from={run}", f"data.source={corpus['train']['path']}",
          f"run.dir={out / 'runs' / run_name(arm, seed, kind)}",
          f"train.seed={seed}", f"loss.aux_weight={lam}", f"loss.num_shared_heads={m}",
          f"loss.shared_heads_from={out / 'shared_heads.json' if m else ''}", f"train.steps={steps}",
          f"data.val_source={corpus['heldout']['path']}", "train.eval_batches=0", "loss.aux_term=true",
          f"checkpoint.every={steps}", "checkpoint.keep=1",
          f"checkpoint.keep_steps={json.dumps([s for s in _eval_steps(steps) if s < steps])}"]


def epoch_steps(plan: runner.Plan, corpus: dict) -> int:
  """Optimizer steps in one pass over the train documents: their packed rows (data.seq_len, data.packing) over
  train.batch_size."""
  from sinkjax.data import build_tokenizer, make_eval_batches  # pylint: disable=import-outside-toplevel
  from sinkjax.run import read_run_config  # pylint: disable=import-outside-toplevel
  cfg = plan.config({}, "RUN_DIR", [f"data.source={corpus['train']['path']}"])
  cfg.data.tokenizer = read_run_config(plan.study.run).data.tokenizer
  batches = make_eval_batches(cfg.data, build_tokenizer(cfg.data), batch_size=1, num_batches=None, split="all")
  rows = sum(int(b["segment_ids"].any()) for b in batches)
  return math.ceil(rows / cfg.train.batch_size)


def _empty(run_dir: pathlib.Path) -> bool:
  """Empties an interrupted run's directory (all but the runner's lock file); True when there was something."""
  dropped = False
  for p in run_dir.iterdir():
    if p.name.startswith(".") and p.name.endswith(".lock"):
      continue
    dropped = True
    shutil.rmtree(p) if p.is_dir() else p.unlink()    # pylint: disable=expression-not-assigned
  return dropped


def _eval_steps(steps: int) -> list[int]:
  return sorted({s for s in EVAL_STEPS if s < steps} | {steps})


def finetune(plan: runner.Plan, arm: str, seed: int, corpus: dict, steps: int, shared_imp) -> runner.Run:
  """One fine-tuning run from step 0 (an interrupted one is dropped first), its evaluations at `_eval_steps`
  (nll_step<S>.json) and its record."""
  kind = tuning_kind(plan)
  overrides = finetune_overrides(plan.study.run, arm, seed, corpus, pathlib.Path(plan.study.out), steps, kind)
  lam, m = ARMS[arm]

  def do(run_dir):
    from sinkjax.train import train  # pylint: disable=import-outside-toplevel
    dropped = _empty(run_dir)
    if dropped:
      _log(f"{run_dir.name}: an interrupted run was dropped; made again from step 0")
    cfg = plan.config({}, run_dir, overrides)
    t0 = time.perf_counter()
    summary = train(cfg, progress=False)
    seconds = time.perf_counter() - t0
    evals = {}
    for s in _eval_steps(steps):
      ev = eval_checkpoint(run_dir, s, corpus, shared_imp)
      if ev["step"] != s:
        raise StudyError(f"{run_dir}: checkpoint of step {s} missing (restored {ev['step']}); rerun the study")
      _write(run_dir / f"nll_step{s}.json", ev)
      evals[s] = ev
    end = evals[steps]
    return {"name": run_dir.name, "arm": arm, "kind": kind, "seed": seed, "aux_weight": lam, "num_shared_heads": m,
            "lora_rank": cfg.lora.rank, "adamw_lr": cfg.train.adamw_lr, "steps": summary["steps"], "final_loss": summary["final_loss"],
            "train_seconds": seconds, "eval_seconds": sum(e["seconds"] for e in evals.values()),
            "eval_steps": sorted(evals), "dropped_interrupted": dropped,
            **{k: float(np.mean(end[k])) for k, _ in METRICS}, "importance": end["importance"]}, "fine-tuned + evaluated"
  return runner.Run(run_name(arm, seed, kind), do, tuple(overrides))


# ---------------------------------------------------------------------------------------------- the null arm

def same_program(a: str, b: str) -> bool:
  """Two lowered programs (StableHLO text) are one program apart from their constants' values: line for line equal
  once every `dense<...>` literal is masked. A λ = 0 step that left the aux term out lowers fewer lines."""
  mask = lambda text: [re.sub(r"dense<[^>]*>", "dense<_>", line) for line in text.splitlines()]   # noqa: E731
  return mask(a) == mask(b)


def null_check(plan: runner.Plan) -> dict:
  """The null arm (configs/studies/heads_pinning_null.yaml: a tiny model, float32 on this CPU): each run of the
  file's grid (optimizer x attention x λ, the aux term traced in all) trains train.steps steps from one init (seed 0)
  on one batch and is compared with the first run of its optimizer and attention (λ 0): its train step's lowered
  program (`same_program`), and every parameter after step 1 and after the last step: bit-identical or not, the
  largest absolute difference, the elements that differ, and which parameters differ after step 1."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from flax import nnx  # pylint: disable=import-outside-toplevel
  from sinkjax import optim  # pylint: disable=import-outside-toplevel
  from sinkjax.data import build_tokenizer, make_train_iterator  # pylint: disable=import-outside-toplevel
  from sinkjax.model import Transformer  # pylint: disable=import-outside-toplevel
  from sinkjax.step import TRAIN_FEATURES, make_train_step  # pylint: disable=import-outside-toplevel

  def params_after(cfg):
    tok = build_tokenizer(cfg.data)
    cfg.model.vocab_size = tok.vocab_size
    graphdef, params, rest = nnx.split(Transformer(cfg.model, rngs=nnx.Rngs(0)), nnx.Param, ...)
    tx, _ = optim.build_optimizer(cfg, 20)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
             "rng": jax.random.PRNGKey(0), "nonfinite": jnp.zeros((), jnp.int32)}
    it = make_train_iterator(cfg.data, tok, batch_size=cfg.train.batch_size, seed=0)
    batch = {k: v for k, v in next(it).items() if k in TRAIN_FEATURES}
    it.close()
    step = jax.jit(make_train_step(cfg, graphdef, rest, tx))
    program = step.lower(state, batch).as_text()
    out = []
    for _ in range(cfg.train.steps):
      state, _ = step(state, batch)
      out.append({jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(
          state["params"])})
    return out[0], out[-1], program

  def compare(a, b):
    d = {k: np.abs(a[k].astype(np.float64) - b[k].astype(np.float64)) for k in a}
    return {"bit_identical": all(np.array_equal(a[k], b[k]) for k in a),
            "max_abs_diff": float(max(v.max() for v in d.values())),
            "elements_differing": int(sum((v > 0).sum() for v in d.values())),
            "elements": int(sum(v.size for v in d.values()))}

  rows, refs = [], {}
  for run in plan.runs():
    cfg = plan.config(run, "RUN_DIR")
    setup, lam, steps = (cfg.train.optimizer, cfg.model.attention), cfg.loss.aux_weight, cfg.train.steps
    first, last, program = params_after(cfg)
    ref = refs.setdefault(setup, (first, last, program))
    c1, cn = compare(ref[0], first), compare(ref[1], last)
    again = any(r["aux_weight"] == lam and (r["optimizer"], r["attention"]) == setup for r in rows)
    label = f"lambda {lam:g}".replace("e-0", "e-") + (", again" if again else "")
    rows.append({"optimizer": setup[0], "attention": setup[1], "label": label, "aux_weight": lam,
                 "same_program": same_program(ref[2], program), "after_step_1": c1, f"after_step_{steps}": cn,
                 "differ_after_step_1": sorted(k for k in first if not np.array_equal(ref[0][k], first[k]))})
    _log(f"null check {'/'.join(setup)} {label}: step 1 {c1['max_abs_diff']:.3g}, step {steps} "
         f"{cn['max_abs_diff']:.3g}")
  recipe = pathlib.Path(plan.recipe).resolve()
  recipe = recipe.relative_to(runner.REPO) if recipe.is_relative_to(runner.REPO) else recipe   # a base elsewhere
  return {"what": f"{recipe} with {' '.join(plan.overrides)}, seed 0, one batch repeated for {steps} steps, float32 "
                  "on the CPU; every parameter compared with the first lambda = 0 run of its setup",
          "steps": steps, "runs": rows, **_commit()}


# ------------------------------------------------------------------------------------------------------ report

def _doc_file(results: pathlib.Path, name: str, step: int) -> dict:
  return _read(results / "raw" / name / f"nll_step{step}.json")


def summarize(results: pathlib.Path, seeds=SEEDS, kind: str = "lora") -> dict:
  """Everything results.md and the figures show, from the raw files under `results` (RESULTS/raw/NAME/ and
  RESULTS/*.json): per effect at the end step the t over seeds, the bootstrap and sign-flip over documents and the
  crossed seeds x documents test (`stats.crossed`; at least 2 seeds), Holm over `FAMILY_CONTRASTS` x `FAMILY_METRICS`
  per column; the curve (mean and per seed); the importance maps of the pretrained model and of each arm at the end
  (mean over seeds) and eq. 8's shared heads."""
  shared = _read(results / "shared_heads.json")
  s0 = _read(results / "nll_step0.json")
  if shared is None or s0 is None:
    raise StudyError(f"{results} holds no shared_heads.json / nll_step0.json; run the study first")
  name = lambda a, s: run_name(a, s, kind)  # noqa: E731
  recs = {(a, s): r for a, s in run_order(seeds) if (r := _read(results / "raw" / name(a, s) / "record.json"))}
  commit = one_commit(list(recs.values()) + [shared, s0])
  dirty = sorted({bool(r.get("dirty")) for r in list(recs.values()) + [shared, s0]})
  steps = sorted({r["steps"] for r in recs.values()})
  if len(steps) > 1:
    raise StudyError(f"runs of different lengths cannot be aggregated: {steps}")
  end = steps[0] if steps else None
  curve, maps = {}, {"pretrained": s0["importance"]}
  for arm in ARMS:
    ss = [s for s in seeds if (arm, s) in recs]
    for st in ([0] + _eval_steps(end)) if ss else []:
      files = [s0 if st == 0 else _doc_file(results, name(arm, s), st) for s in ss]
      per_seed = {k: [float(np.mean(f[k])) for f in files] for k, _ in METRICS}
      curve[f"{arm}@{st}"] = {**{k: float(np.mean(v)) for k, v in per_seed.items()}, "seeds": len(ss),
                              "per_seed": per_seed}
    if ss:
      maps[arm] = np.mean([_doc_file(results, name(arm, s), end)["importance"] for s in ss], axis=0).tolist()
  effects = []
  for treated, control in CONTRASTS:
    ss = [s for s in seeds if (treated, s) in recs and (control, s) in recs]
    if not ss:
      continue
    a = {s: _doc_file(results, name(treated, s), end) for s in ss}
    b = {s: _doc_file(results, name(control, s), end) for s in ss}
    for key, what in METRICS:
      table = np.array([np.asarray(a[s][key]) - np.asarray(b[s][key]) for s in ss])    # seeds x documents
      per_seed = table.mean(1).tolist()
      docs = stats.bootstrap_flip(table.mean(0))
      t, cr = (stats.t_interval(per_seed), stats.crossed(table)) if len(ss) >= 2 else ({}, {})   # 1 seed: documents
      e = {"contrast": f"{treated}-{control}", "metric": key,
           "what": f"{ARM_TITLES[treated]} − {ARM_TITLES[control]}, {what}", "seeds": ss,
           "mean": float(np.mean(per_seed)), "per_seed": per_seed, "documents": int(table.shape[1]),
           "doc_low": docs["low"], "doc_high": docs["high"], "p_doc": docs["p"],
           "t_low": t.get("low"), "t_high": t.get("high"), "t": t.get("t"), "p_t": t.get("p"),
           "crossed_low": cr.get("low"), "crossed_high": cr.get("high"), "crossed_df": cr.get("df"),
           "p_crossed": cr.get("p"),
           "in_family": (treated, control) in FAMILY_CONTRASTS and key in FAMILY_METRICS}
      effects.append(e)
  for col in ("p_t", "p_doc", "p_crossed"):
    adj = stats.holm([e[col] if e["in_family"] else None for e in effects])
    for e, p in zip(effects, adj):
      e[col + "_holm"] = p
  times = [r["train_seconds"] for r in recs.values()]
  m = ARMS["eq8"][1]
  return {"commit": commit, "dirty": dirty, "kind": kind, "steps": end, "runs": sorted(name(a, s) for a, s in recs),
          "seeds": sorted({s for _, s in recs}), "train_seconds": [min(times), max(times)] if times else None,
          "dropped_interrupted": sorted(r["name"] for r in recs.values() if r.get("dropped_interrupted")),
          "documents": s0["documents"], "shared_heads_documents": shared["documents"], "num_shared_heads": m,
          "shared_heads": balance.top_m_mask(shared["importance"], m).tolist(), "family": FAMILY, "curve": curve,
          "importance": maps, "effects": effects}


def _f(x, nd=4) -> str:
  return "—" if x is None else f"{x:+.{nd}f}"


def _pf(p) -> str:
  return "—" if p is None else (f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}")


def _interval(lo, hi) -> str:
  return "—" if lo is None else f"[{_f(lo)}, {_f(hi)}]"


def markdown(summary: dict) -> str:
  how = "full fine-tuning (every weight)" if summary.get("kind") == "full" else "LoRA"
  one = len(summary["seeds"]) < 2
  seeds_note = ("One seed: document-level only (the t over seeds and the crossed test need at least 2 seeds: —)."
                if one else f"{len(summary['seeds'])} seeds.")
  lines = [f"# [Sink-MoE] App. D at one epoch on SmolLM2-135M: head pinning, {how}", "",
           f"Commit `{summary['commit']}`, dirty: {summary['dirty']}. Runs: {', '.join(summary['runs'])} "
           f"({summary['steps']} steps each; train time {summary['train_seconds'][0]:.0f}–"
           f"{summary['train_seconds'][1]:.0f} s per run, from the records). Held-out: {summary['documents']} "
           f"documents, each scored alone (its first {DOC_TOKENS + 1} tokens). Shared heads: top-2 per layer of the "
           f"pretrained importance over {summary['shared_heads_documents']} analysis documents.", "",
           "## Effects at the end step", "",
           f"{seeds_note} Per seed: the mean over documents; t over seeds (t_(n-1)). Per document: the difference "
           "averaged over seeds, 95 % bootstrap interval and sign-flip permutation p (10,000 draws each: 0.0002 is "
           "the least p). Crossed: the seeds x documents table of differences read with the random-effects model "
           "d = mu + seed + document + residual (two-way ANOVA; Satterthwaite's df), which carries both sources of "
           f"variance. {summary['family']}.", "",
           *table(["effect", "mean", "95 % t-interval (seeds)", "p (t)", "Holm", "95 % bootstrap (documents)",
                   "p (documents)", "Holm", "95 % interval (seeds × documents)", "df", "p (crossed)", "Holm"],
                  ([e["what"], _f(e["mean"]), _interval(e["t_low"], e["t_high"]), _pf(e["p_t"]), _pf(e["p_t_holm"]),
                    _interval(e["doc_low"], e["doc_high"]), _pf(e["p_doc"]), _pf(e["p_doc_holm"]),
                    _interval(e["crossed_low"], e["crossed_high"]),
                    "—" if e["crossed_df"] is None else f"{e['crossed_df']:.1f}", _pf(e["p_crossed"]),
                    _pf(e["p_crossed_holm"])] for e in summary["effects"])),
           "", "## The curve (mean over seeds of each run's mean over documents)", "",
           *table(["arm @ step", "seeds", *(w for _, w in METRICS)],
                  ([k, row["seeds"], *(f"{row[m]:.4f}" for m, _ in METRICS)] for k, row in summary["curve"].items())),
           "", "## Figures", "",
           f"`{FIGURES[0]}`: per-head importance (eq. 5, mean over the held-out documents and the seeds) of the "
           "pretrained model and of each arm at the end, and each arm's change against the pretrained model; eq. 8's "
           f"shared heads boxed. `{FIGURES[1]}`: the curve, every seed's value and the arms' means."]
  return "\n".join(lines) + "\n"


def report(results: pathlib.Path, seeds=SEEDS, kind: str = "lora") -> dict:
  """results.json, results.md and the two figures (`FIGURES`, sinkjax.plots.plot_pinning) of `summarize`."""
  from sinkjax import plots  # pylint: disable=import-outside-toplevel
  summary = summarize(results, seeds, kind)
  _write(results / "results.json", summary)
  (results / "results.md").write_text(markdown(summary))
  plots.plot_pinning(summary, results / FIGURES[0], results / FIGURES[1], arms=ARM_TITLES,
                     metrics=dict(METRICS))
  return summary


# ------------------------------------------------------------------------------------------------------ driver

def null_study(plan: runner.Plan, dry_run: bool, report_only: bool) -> None:
  """A driver-pinning_null study (configs/studies/heads_pinning_null.yaml): `null_check`, written to RESULTS/null.json."""
  path = plan.results() / "null.json"
  if dry_run or report_only:
    print(f"{path}: {'done' if path.is_file() else 'to do'} ({len(plan.runs())} runs)")
    return
  _write(path, null_check(plan))
  _log(f"wrote {path}")


def run_plan(plan: runner.Plan, *, dry_run: bool = False, report_only: bool = False) -> None:
  """The pinning study file, run (`sinkjax.experiments.study`'s driver pinning): shared heads, step 0, every seed's
  three arms, then the report (see the module docstring)."""
  st = plan.study
  out, results = pathlib.Path(st.out), plan.results()
  if st.driver == "pinning_null":
    return null_study(plan, dry_run, report_only)
  if set(plan.axes) - {"train.seed"}:
    raise StudyError(f"{plan.path}: the pinning study's one axis is train.seed (its arms are heads_pinning.ARMS), "
                     f"got {', '.join(plan.axes)}")
  seeds = tuple(int(s) for s in plan.axes.get("train.seed", SEEDS))
  kind = tuning_kind(plan)
  if dry_run:
    for i, (arm, s) in enumerate(run_order(seeds), 1):
      d = out / "runs" / run_name(arm, s, kind)
      state = "done" if (d / "record.json").is_file() else "started (dropped, made again)" if d.is_dir() else "to do"
      print(f"[{i}/{len(seeds) * len(ARMS)}] {run_name(arm, s, kind)}: λ {ARMS[arm][0]:g}, m {ARMS[arm][1]} -> {d} ({state})")
    return
  if report_only:
    summary = report(results, seeds, kind)
    _log(f"wrote {results}/results.md ({len(summary['runs'])} runs)")
    return
  if not pathlib.Path(st.run, "config.yaml").is_file():
    raise StudyError(f"study.run {st.run} is not a run directory; import the model first (docs/CONVERT.md)")
  import sinkjax.eval, sinkjax.lora, sinkjax.run, sinkjax.train  # pylint: disable=import-outside-toplevel,unused-import,redefined-outer-name
  c = _commit()
  if c["dirty"] and not st.allow_dirty:
    raise StudyError(f"the checkout ({c['commit']}) has uncommitted changes to tracked files; commit them (every "
                     "record names its commit) or set study.allow_dirty=true (every file then says dirty)")
  out.mkdir(parents=True, exist_ok=True)
  lock = runner.exclusive(out)  # noqa: F841  # pylint: disable=unused-variable
  corpus = heads_real.english_corpus(out / "corpus")
  _write(out / "corpus.json", {**corpus, **c})
  steps = plan.config({}, "RUN_DIR").train.steps or epoch_steps(plan, corpus)
  sizes = ", ".join(f"{n} {v['documents']}" for n, v in corpus.items())
  _log(f"corpus: {sizes}; {steps} steps per run")
  sh = shared_heads(st.run, corpus, out)
  step0(st.run, corpus, out, sh["importance"])
  runner.copy_files(out, results, ("shared_heads.json", "nll_step0.json", "corpus.json"))
  study = runner.Study(out, record="record.json", raw=results / "raw", commit=c,
                      raw_files=RAW_FILES + tuple(f"nll_step{s}.json" for s in _eval_steps(steps)))

  def done(i, n, res):
    if res.record is None:
      _log(f"[{i}/{n}] {res.run.name}: {res.what}")
    else:
      _log(f"[{i}/{n}] {res.run.name}: held-out loss {res.record['val_loss']:.4f}, imbalance "
           f"{res.record['imbalance']:.4f}, train {res.record['train_seconds']:.0f} s ({res.seconds:.0f} s)")
  study.walk([finetune(plan, arm, s, corpus, steps, sh["importance"]) for arm, s in run_order(seeds)], done)
  summary = report(results, seeds, kind)
  _log(f"wrote {results}/results.md ({len(summary['runs'])} runs)")
