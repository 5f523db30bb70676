"""The paper studies' reports: the tests of the committed cpu grid and dose study, computed from their raw files (no
training, no model), and [Sink-MoE] Table 1 with Figs. 5 and 8 from finished run directories.

    python -m sinkjax.experiments.paper_report [--grid RESULTS.json] [--dose DOSE.json|none] [--write]
    python -m sinkjax.experiments.paper_report --runs 'gs://BUCKET/runs/d20_*' [--runs 'runs/d26_*' ...] [--out DIR]

What is tested and how (`sinkjax.stats`), and what each file holds: docs/RESULTS.md and docs/EVAL.md;
tests/test_results_docs.py recomputes what the docs quote from the raw files with scipy.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import sys

import numpy as np
import yaml

from sinkjax import choices, options, paths, stats
from sinkjax.errors import UserError
from sinkjax.config import declare
from sinkjax.experiments import runner
from sinkjax.lm_eval_tasks import TABLE1_COLUMNS
from sinkjax.markdown import table

REPO = runner.REPO
GRID = REPO / "docs" / "results" / "paper_cpu" / "results.json"
DOSE = REPO / "docs" / "results" / "paper_cpu_dose" / "dose.json"
REPRO = REPO / "docs" / "results" / "paper_cpu_repro"
SMALL_LAMBDA = 1e-8         # the dose study's smallest λ: a small treatment under Muon, not a null (docs/RESULTS.md)
VARIANTS = choices.PAPER_VARIANTS
LOSSES = {"base": 0.0, "aux": 1e-4}   # loss label -> loss.aux_weight: the paper's lambda from scratch (eq. 7)


def _by(records, variant, loss_or_lambda, key) -> dict:
  """{seed: record[key]} of the records of one variant and loss label ("base" / "aux") or lambda (a float)."""
  arm = ((lambda r: r["loss"] == loss_or_lambda) if isinstance(loss_or_lambda, str) else
         (lambda r: float(r["lambda"]) == float(loss_or_lambda)))
  return {r["seed"]: r[key] for r in records if r["variant"] == variant and arm(r)}


def _paired(records, variant, treated, control, key: str = "val_bpb") -> tuple[list[int], list[float]]:
  """(seeds, treated - control per seed) of one variant's `key` (`stats.paired`; arms as `_by` names them)."""
  return stats.paired(_by(records, variant, treated, key), _by(records, variant, control, key))


def aux_term(record, lam: float) -> float:
  """lambda * sum_l H * CV(Imp[l,:])^2 (eq. 7) at the run's held-out importances (cv_per_layer)."""
  cv = np.asarray(record["cv_per_layer"], np.float64)
  return lam * len(record["importance"][0]) * float((cv ** 2).sum())


def table1(records: list[dict]) -> dict:
  """[Sink-MoE] Table 1 from run records ({variant, loss: "base" | "aux", seed, val_bpb, head_imbalance}): per
  variant, val BPB and final head imbalance of base and aux over seeds (`stats.seed_stats`), and the paired per-seed
  difference aux - base (seeds where both finished). The one computation behind paper.py's results.json and this
  report's stats.json."""
  out = {}
  for v in dict.fromkeys(r["variant"] for r in records):
    by = {(r["loss"], r["seed"]): r for r in records if r["variant"] == v}
    row = {}
    for loss in ("base", "aux"):
      rs = sorted((r for (l, _), r in by.items() if l == loss), key=lambda r: r["seed"])
      if rs:
        row[loss] = {"seeds": [r["seed"] for r in rs], "val_bpb": stats.seed_stats([r["val_bpb"] for r in rs]),
                     "head_imbalance": stats.seed_stats([r["head_imbalance"] for r in rs])}
    paired = sorted(s for (l, s) in by if l == "aux" and ("base", s) in by)
    if paired:
      row["aux_minus_base"] = {
          "seeds": paired,
          "val_bpb": stats.seed_stats([by["aux", s]["val_bpb"] - by["base", s]["val_bpb"] for s in paired]),
          "head_imbalance": stats.seed_stats([by["aux", s]["head_imbalance"] - by["base", s]["head_imbalance"]
                                              for s in paired])}
    out[v] = row
  return out


# ---------------------------------------------------------------------------------------------------- main grid

PAPER_BPB_EFFECTS = (0.003, 0.006)   # [Sink-MoE] Table 1's aux - base gains, in BPB (the sizes power is asked for)


def grid_stats(grid: dict) -> dict:
  """Every test of the main grid: aux - base per variant (BPB and final imbalance, paired by seed), the variants'
  base BPB against vanilla (Welch, unpaired), and the power of the design."""
  runs = grid["runs"]
  diff = {(v, key): _paired(runs, v, "aux", "base", key)
          for v in VARIANTS for key in ("val_bpb", "head_imbalance")}
  effects = {f"{v} {name}": stats.paired_effect(diff[v, key][1], nd=nd, what=f"{v}, {what} aux − base")
             for key, name, what, nd in (("val_bpb", "BPB", "val BPB", 4),
                                         ("head_imbalance", "imbalance", "final head imbalance", 3))
             for v in VARIANTS}
  base_bpb = lambda v: list(_by(runs, v, "base", "val_bpb").values())
  variants = {f"{v} − vanilla": stats.welch(base_bpb(v), base_bpb("vanilla")) for v in ("sink", "gated")}
  return {"effects": effects, "variants_base_bpb": variants,
          "power": power_figures([diff[v, "val_bpb"][1] for v in VARIANTS], n=len(diff["gated", "val_bpb"][1])),
          "finetune": finetune_summary(grid.get("finetune")), "table1": table1_cells(runs),
          "seeds": diff["gated", "val_bpb"][0], "aux_terms": _aux_terms(runs), "value_norm_ratio": _vnr(runs),
          "value_zeroing": _value_zeroing(runs), "timing": _timing(runs), "curves": _curves(runs),
          "first_token": _first_token(runs)}


def power_figures(groups, n: int, effects=PAPER_BPB_EFFECTS) -> dict:
  """What a design of n seeds can resolve at the noise of these arms: the SD of a paired BPB difference pooled over
  the arms (each about its own mean), the smallest effect detectable at n (power 0.8, two-sided 0.05), and the
  seeds needed for each of the paper's effect sizes."""
  sd, df = stats.pooled_sd(groups)
  return {"sd": sd, "df": df, "n": n, "arms": len(groups), "detectable": stats.detectable_effect(sd, n),
          "seeds_needed": {f"{e:g}": stats.seeds_needed(e, sd) for e in effects}}


DOMINANT = 0.9        # a head with held-out importance above this before fine-tuning is listed head by head


def finetune_summary(ft: dict | None, variant: str = "gated") -> dict | None:
  """One variant's fine-tuning (one seed): the shared (top-1) / routed means before and after each mode, and every
  head whose importance before exceeds DOMINANT (the heads that carry their layer), before and after each mode."""
  if not ft or variant not in ft:
    return None
  g = ft[variant]
  before = np.asarray(g["before"]["importance"], np.float64)
  modes = list(g["modes"])
  after = {m: np.asarray(g["modes"][m]["importance"], np.float64) for m in modes}
  heads = []
  for l, h in zip(*np.nonzero(before > DOMINANT)):
    heads.append({"layer": int(l), "head": int(h), "shared": bool(h == int(np.argmax(before[l]))),
                  "before": float(before[l, h]), **{m: float(after[m][l, h]) for m in modes}})
  summary = {m: {k: g["modes"][m]["roles"][k] for k in ("shared_before", "shared_after", "routed_before",
                                                         "routed_after", "routed_cv_after")} |
             {"val_bpb": g["modes"][m]["val_bpb"], "head_imbalance": g["modes"][m]["head_imbalance"]}
             for m in modes}
  return {"base_run": g["base_run"], "before": {"val_bpb": g["before"]["val_bpb"],
                                                "head_imbalance": g["before"]["head_imbalance"]},
          "modes": summary, "dominant_heads": heads}


def _aux_terms(runs) -> dict:
  """Mean over seeds of the aux term lambda * sum_l H CV_l^2 at the aux runs' held-out importances."""
  return {v: float(np.mean([aux_term(r, 1e-4) for r in runs if r["variant"] == v and r["loss"] == "aux"]))
          for v in VARIANTS}


def _vnr(runs) -> dict:
  """value_norm_ratio (||v of the first token|| / mean ||v|| of the others, per layer): mean over heads and seeds
  per layer, and the range over every head-averaged layer of every seed, per variant and loss."""
  out = {}
  for v in VARIANTS:
    for loss in ("base", "aux"):
      a = np.array([r["value_norm_ratio"] for r in runs if r["variant"] == v and r["loss"] == loss], np.float64)
      a = a.reshape(a.shape[0], a.shape[1], -1).mean(-1)                   # [seeds, L]
      out[f"{v} {loss}"] = {"per_layer": a.mean(0).tolist(), "min": float(a.min()), "max": float(a.max())}
  return out


def _value_zeroing(runs) -> dict:
  """all - none BPB per definition, mean and range over the runs of each variant (both losses)."""
  out = {}
  for v in VARIANTS:
    rs = [r for r in runs if r["variant"] == v]
    row = {}
    for defn in ("teacher_forced", "after_prefill", "teacher_forced_window"):
      vals = [r[f"value_zeroing_{defn}"]["bpb_all"] - r[f"value_zeroing_{defn}"]["bpb_none"] for r in rs
              if f"value_zeroing_{defn}" in r]
      if vals:
        row[defn] = {"mean": float(np.mean(vals)), "min": float(min(vals)), "max": float(max(vals)), "n": len(vals)}
    out[v] = row
  return out


def _timing(runs) -> dict:
  return {**{f"{k}_{f.__name__}": float(f(r[k] for r in runs)) for k in ("train_seconds", "eval_seconds")
             for f in (min, max)}, "n": len(runs)}


def _curves(runs) -> dict:
  """The imbalance curves (training batches, every 10 steps) at the steps the docs quote, per variant and loss."""
  out = {}
  for v in VARIANTS:
    for loss in ("base", "aux"):
      rs = sorted((r for r in runs if r["variant"] == v and r["loss"] == loss), key=lambda r: r["seed"])
      out[f"{v} {loss}"] = {
          **{f"step{t}": [{int(s): y for s, y in r["imbalance_curve"]}.get(t) for r in rs] for t in (1, 20)},
          "max": [max(y for _, y in r["imbalance_curve"]) for r in rs],
          "min_after_step1": [min(y for s, y in r["imbalance_curve"] if s > 1) for r in rs],
          "final": [r["imbalance_curve"][-1][1] for r in rs], "seeds": [r["seed"] for r in rs]}
    base = [r["imbalance_curve"] for r in runs if r["variant"] == v and r["loss"] == "base"]
    aux = [r["imbalance_curve"] for r in runs if r["variant"] == v and r["loss"] == "aux"]
    steps = sorted(set.intersection(*(set(int(s) for s, _ in c) for c in base + aux)))
    grid = lambda cs: np.array([[dict((int(s), y) for s, y in c)[t] for t in steps] for c in cs])
    b, a = grid(base), grid(aux).mean(0)
    out[f"{v} aux mean vs base"] = {"steps": len(steps), "below_base_mean": int((a < b.mean(0)).sum()),
                                    "inside_base_band": int(((a >= b.min(0)) & (a <= b.max(0))).sum())}
  return out


def _first_token(runs) -> dict:
  """Ranges over every layer of every run of a variant (both losses, all seeds): F-Attn per layer, alpha per layer
  (mean over heads), the largest alpha of any head, and the sink logit's weight per layer (sink attention)."""
  out = {}
  for v in VARIANTS:
    rs = [r for r in runs if r["variant"] == v]
    f = np.array([r["first_token_attention"] for r in rs])
    a = np.array([r["sink_ratio_alpha"] for r in rs])
    out[v] = {"f_attn_min": float(f.min()), "f_attn_max": float(f.max()),
              "alpha_layer_min": float(a.mean(-1).min()), "alpha_layer_max": float(a.mean(-1).max()),
              "alpha_head_max": float(a.max())}
    if rs[0]["sink_logit_attention"] is not None:
      sl = np.array([r["sink_logit_attention"] for r in rs])
      out[v].update(sink_logit_min=float(sl.min()), sink_logit_max=float(sl.max()))
  return out


def effect_cells(e: dict, nd: int) -> list[str]:
  """The cells an effect row shows: per seed, mean, 95 % t-interval, paired t p, the exact permutation p and sign
  test p, then the reading (with the smallest detectable effect when not detected)."""
  t = e["t"]
  cells = [", ".join(stats.fmt(x, nd) for x in e["diffs"]), stats.fmt(e["mean"], nd),
           f"{stats.fmt(t['low'], nd)} … {stats.fmt(t['high'], nd)}", stats.fmt_p(t["p"])]
  reading = e["reading"] if e["detected"] else f"not detected (detectable: ±{e['detectable']:.{nd}f})"
  return cells + [stats.fmt_p(e["permutation"]["p"]), stats.fmt_p(e["sign_test"]["p_two_sided"]), reading]


def effects_table(rows, head: str = "effect") -> list[str]:
  """One row per (label, effect, decimals): `effect_cells` (stats.md, dose.md)."""
  cols = ["per seed", "mean", "95 % t-interval", "paired t p", "permutation p", "sign test p", "reading"]
  return table([head, *cols], ([label, *effect_cells(e, nd)] for label, e, nd in rows), "llrlrrr")


def power_lines(pw: dict, what: str, unit: str = "BPB", nd: int = 4) -> list[str]:
  need = ", ".join(f"{k} {unit}: {v}" for k, v in pw["seeds_needed"].items())
  return [f"**Power ({what})**: the SD of one paired difference, pooled over {pw['arms']} arms ({pw['df']} df), "
          f"is {pw['sd']:.{nd}f}; with n = {pw['n']} seeds the smallest mean effect the paired t-test detects (power "
          f"{stats.POWER:g}, two-sided {stats.ALPHA:g}) is ±{pw['detectable']:.{nd}f} {unit}. Seeds needed, at this "
          f"noise, for an effect of {need}.", ""]


def table1_lines(gs: dict) -> list[str]:
  """[Sink-MoE] Table 1 of a from-scratch grid, its one rendering (the study's results.md and stats.md): per variant
  val BPB mean ± std of base and base + aux over seeds, the paired aux - base differences with their tests
  (gs["effects"]["VARIANT BPB"]; "—" where fewer than two seeds pair) and the final head imbalance base → aux per
  seed. gs["table1"] is `table1_cells`'s."""
  rows = []
  for v, t in gs["table1"].items():
    e = gs["effects"].get(f"{v} BPB")
    imb = ", ".join(f"{a:.3f} → {b:.3f}" for a, b in zip(*(t.get(k, {}).get("head_imbalance", []) for k in LOSSES)))
    rows.append([v, stats.mean_std(t.get("base")), stats.mean_std(t.get("aux")),
                 *(effect_cells(e, 4)[:5] if e is not None else ["—"] * 5), imb or "—"])
  return table(["attention", "base", "base + aux", "aux − base, per seed", "mean", "95 % t-interval", "paired t p",
                "permutation p", "head imbalance base → aux, per seed"], rows, "llllrlrr")


def table1_cells(runs) -> dict:
  """`table1` as Table 1's rendering reads it: per variant (or arm of a study with more axes, in the runs' order)
  and loss, the val BPB's mean ± std over seeds and values, and the final head imbalance per seed."""
  t1 = table1(runs)
  return {v: {loss: {"mean": r["val_bpb"]["mean"], "std": r["val_bpb"]["std"], "val_bpb": r["val_bpb"]["values"],
                     "head_imbalance": r["head_imbalance"]["values"], "seeds": r["seeds"]}
              for loss, r in row.items() if loss in LOSSES} for v, row in t1.items()}


def table1_effects(runs) -> dict:
  """{"VARIANT BPB": the paired aux - base effect's tests} of each variant with at least two paired seeds."""
  diffs = {v: _paired(runs, v, "aux", "base")[1] for v in dict.fromkeys(r["variant"] for r in runs)}
  return {f"{v} BPB": stats.paired_effect(d, what=f"{v}, val BPB aux − base") for v, d in diffs.items()
          if len(d) >= 2}


def value_sections(gs: dict) -> list[str]:
  """value_norm_ratio and value zeroing (both definitions, on the same window) of the grid report."""
  cell = lambda d: f"{d['mean']:+.4f} ({d['min']:+.4f} … {d['max']:+.4f})" if d else "not scored (see below)"
  lines = ["## value_norm_ratio (‖v₀‖ / mean ‖v‖ of the other tokens; < 1: the first token's value is smaller)", "",
           *table(["run", "per layer (mean over heads and seeds)", "range over layers and seeds"],
                  ([k, " ".join(f"{x:.3f}" for x in r["per_layer"]), f"{r['min']:.3f}–{r['max']:.3f}"]
                   for k, r in gs["value_norm_ratio"].items())),
           "", "## Value zeroing, all heads − none (BPB), per variant over both losses and three seeds", "",
           *table(["variant", "teacher-forced, targets 0–255", "after prefill, targets 64–255",
                   "teacher-forced, targets 64–255"],
                  ([v, *(cell(row.get(d)) for d in ("teacher_forced", "after_prefill", "teacher_forced_window"))]
                   for v, row in gs["value_zeroing"].items()))]
  if gs.get("repro"):
    same = all(r["val_bpb_diff"] == 0 and r["importance_max_abs_diff"] < 1e-6 for r in gs["repro"])
    lines += ["", "### Retrained main-grid runs, scored both ways on the same window", "",
              "Each retrained with the main grid's config and seed (`docs/results/paper_cpu_repro/`). " +
              ("They are the committed models (val BPB and importances equal), so these scores re-score them."
               if same else "They are not the committed models (val BPB or importances differ), so they do not "
               "re-score those: they are fresh runs of the same configs, on which the two definitions are compared."),
              "", *table(["run", "val BPB committed → retrained", "max abs importance difference",
                          "after prefill, committed"],
                         ([r["name"], f"{r['committed_val_bpb']:.6f} → {r['val_bpb']:.6f}",
                           f"{r['importance_max_abs_diff']:.1e}", f"{r['committed_after_prefill_all_minus_none']:+.4f}"]
                          for r in gs["repro"]), "llrr"),
              "", *window_lines([r for r in gs["repro"] if "tf_window" in r])]
  if gs.get("window_dose"):
    lines += ["", "### Dose-study runs, scored both ways on the same window", "", *window_lines(gs["window_dose"])]
  rows = [r for r in gs.get("repro", []) + gs.get("window_dose", []) if "tf_window" in r]
  if rows:
    rng = lambda k: f"{min(r[k] for r in rows):+.4f} … {max(r[k] for r in rows):+.4f}"
    gap = max(abs(r["tf_window"] - r["ap_window"]) for r in rows)
    lines += ["", f"Over these {len(rows)} runs, all heads − none: teacher-forced on targets 0–255 {rng('tf_whole')}; "
              f"on targets 64–255 teacher-forced {rng('tf_window')} and after prefill {rng('ap_window')}, the two "
              f"definitions at most {gap:.4f} apart on any run."]
  return lines


def finetune_lines(ft: dict | None, variant: str = "gated") -> list[str]:
  """The fine-tuning section (eq. 7 vs eq. 8) of one variant's `finetune_summary` (stats.md, results.md), or nothing
  without study.finetune."""
  if not ft:
    return []
  modes, b = ft["modes"], ft["before"]
  return ["", f"## Fine-tuning, {variant} ({ft['base_run']}, one seed, 100 steps)", "",
          *table(["mode", "val BPB", "imbalance", "shared (top-1 per layer) before → after", "routed before → after",
                  "routed CV after"],
                 [f"| before | {b['val_bpb']:.4f} | {b['head_imbalance']:.3f} | | | |",
                  *([m, f"{r['val_bpb']:.4f}", f"{r['head_imbalance']:.3f}",
                     f"{r['shared_before']:.3f} → {r['shared_after']:.3f}",
                     f"{r['routed_before']:.3f} → {r['routed_after']:.3f}", f"{r['routed_cv_after']:.3f}"]
                    for m, r in modes.items())], "lrrllr"),
          "", f"Every head with importance > {DOMINANT} before fine-tuning (shared = the layer's top-1, what eq. 8 "
          "with m = 1 protects):", "",
          *table(["layer", "head", "role", "before", *modes],
                 ([h["layer"], h["head"], "shared" if h["shared"] else "routed",
                   *(f"{h[k]:.3f}" for k in ("before", *modes))] for h in ft["dominant_heads"]),
                 "lllr" + "r" * len(modes))]


def grid_markdown(gs: dict, grid_path: str) -> str:
  c, t = gs["curves"], gs["timing"]
  lines = [
      "# Main cpu grid: tests", "",
      f"Generated by `python -m sinkjax.experiments.paper_report --write` from `{grid_path}` (no training). "
      "Tests (`sinkjax.stats`): per-seed paired differences with the 95 % t-interval (t_2 = 4.30 at "
      "3 seeds), the exact permutation and sign tests (least two-sided p with 3 seeds: 0.25), and the smallest "
      "detectable effect beside every \"not detected\".", "",
      *power_lines(gs["power"], "main grid, BPB aux − base"),
      f"Vanilla's and sink's aux terms are small: at their held-out importances "
      f"{gs['aux_terms']['vanilla']:.1e} (vanilla) and {gs['aux_terms']['sink']:.1e} (sink), next to a loss of "
      f"~1.3 (gated: {gs['aux_terms']['gated']:.1e}). They are still treatments, not null arms: under Muon from a "
      "zero-initialised LM head the first update follows the aux gradient at a size the optimizer sets rather than "
      "λ (docs/RESULTS.md, \"The null arm, measured\"), so their differences are effects, each read against its own "
      "SD.", "",
      "## Table 1 analogue with its tests", "", *table1_lines(gs), "", "## Effects", "",
      *effects_table([(e["what"], e, 3 if ("imbalance" in k or "head" in k) else 4)
                      for k, e in gs["effects"].items()]), "",
      *(f"- {e['sentence']}" for e in gs["effects"].values()), "",
      "## Variants against vanilla, base runs (Welch's t, unpaired)", "",
      *table(["comparison", "difference of means", "95 % interval", "Welch df", "p"],
             ([f"{k}, val BPB", f"{w['diff']:+.4f}", f"{w['low']:+.4f} … {w['high']:+.4f}", f"{w['df']:.1f}",
               stats.fmt_p(w["p"])] for k, w in gs["variants_base_bpb"].items()), "lrlrr"), "",
      *value_sections(gs),
      "", "## First-token attention and sink ratio (ranges over every layer of every run of a variant)", "",
      *table(["variant", "F-Attn per layer", "α per layer (mean over heads)", "largest α of any head",
              "sink-logit weight per layer"],
             ([v, *(f"{r[k + '_min']:.3f}–{r[k + '_max']:.3f}" for k in ("f_attn", "alpha_layer")),
               f"{r['alpha_head_max']:.3f}",
               f"{r['sink_logit_min']:.3f}–{r['sink_logit_max']:.3f}" if "sink_logit_min" in r else "-"]
              for v, r in gs["first_token"].items())),
      "", "## Imbalance curves (training batches, logged every 10 steps), per seed", "",
      *table(["run", "step 1", "step 20", "max", "final"],
             ([k, *(", ".join(f"{x:.3f}" for x in r[q]) for q in ("step1", "step20", "max", "final"))]
              for k, r in c.items() if "steps" not in r)),
      *finetune_lines(gs.get("finetune"))]
  lines += ["", "## Imbalance curves: the mean aux curve against the base runs", "",
            "At the steps all six runs of a variant logged:", ""]
  for v in VARIANTS:
    r = c[f"{v} aux mean vs base"]
    lines.append(f"- {v}: below the base mean at {r['below_base_mean']} of {r['steps']} steps, inside the base "
                 f"runs' min–max band at {r['inside_base_band']} of {r['steps']}")
  lines += ["", "## Time", "",
            f"Training {t['train_seconds_min']:.0f}–{t['train_seconds_max']:.0f} s per run, evaluation "
            f"{t['eval_seconds_min']:.0f}–{t['eval_seconds_max']:.0f} s ({t['n']} runs, `train_seconds` / "
            "`eval_seconds` of results.json; the machine was shared, so these measure its load as much as the runs).",
            ""]
  return "\n".join(lines)


# ------------------------------------------------------------------------------- value zeroing on one window

def repro_runs(repro_dir: pathlib.Path, grid: dict) -> list[dict]:
  """Main-grid runs retrained, their raw files in repro_dir/raw/NAME (done.json + paper_eval.json) with the
  committed record of the same name: whether the retrained model is the committed one (val BPB and importances equal) and its value
  zeroing scored both ways."""
  committed = {f"{r['variant']}_{r['loss']}_s{r['seed']}": r for r in grid["runs"]}
  out = []
  for d in sorted((repro_dir / "raw").glob("*_s*")) if (repro_dir / "raw").is_dir() else []:
    ev, done = runner.read_json(d / "paper_eval.json"), runner.read_json(d / "done.json")
    if ev is None or done is None or d.name not in committed:
      continue
    c = committed[d.name]
    out.append({"name": d.name, "committed_val_bpb": c["val_bpb"], "val_bpb": ev["val_bpb"],
                "val_bpb_diff": ev["val_bpb"] - c["val_bpb"],
                "importance_max_abs_diff": float(np.abs(np.subtract(ev["importance"], c["importance"])).max()),
                "committed_after_prefill_all_minus_none": (c["value_zeroing_after_prefill"]["bpb_all"]
                                                           - c["value_zeroing_after_prefill"]["bpb_none"]),
                **_vz_both(ev)})
  return out


def _vz_both(ev: dict) -> dict:
  """all - none BPB of the three scorings of one evaluation, and the teacher-forced vs after-prefill `none` on the
  same window (the same model on the same tokens: equal up to rounding)."""
  tf, ap, tw = (ev["value_zeroing_teacher_forced"], ev["value_zeroing_after_prefill"],
                ev.get("value_zeroing_teacher_forced_window"))
  out = {"tf_whole": tf["bpb_all"] - tf["bpb_none"], "ap_window": ap["bpb_all"] - ap["bpb_none"],
         "prompt_len": ap["prompt_len"]}
  if tw is not None:
    out.update(tf_window=tw["bpb_all"] - tw["bpb_none"], none_gap=tw["bpb_none"] - ap["bpb_none"])
  return out


def window_lines(rows: list[dict]) -> list[str]:
  return table(["run", "teacher-forced, targets 0–255", "teacher-forced, targets 64–255", "after prefill, targets "
                "64–255", "none: teacher-forced − after prefill (64–255)"],
               ([r["name"], *(f"{r[k]:+.4f}" for k in ("tf_whole", "tf_window", "ap_window")), f"{r['none_gap']:+.1e}"]
                for r in rows), "lrrrr")


# --------------------------------------------------------------------------------------------------- dose study

# The committed dose.json predates the runner's commit records: its lambda 0 / 1e-4 runs are the main grid's (made
# with 9d017eb), the others were made with 2e0c6b5 (docs/RESULTS.md, "Two codes"). Runs made since carry "commit".
LEGACY_COMMITS = {"committed main grid": "9d017eb", "": "2e0c6b5"}


def commit_of(record: dict) -> str:
  """The commit a run was made with: its own record, else the committed dose study's (`LEGACY_COMMITS`)."""
  if record.get("commit"):
    return record["commit"]
  return next(c for prefix, c in LEGACY_COMMITS.items() if str(record.get("source", "")).startswith(prefix))


QUANTITIES = (("val_bpb", "val BPB", 4), ("head_imbalance", "final head imbalance", 3))


def _effect(diffs, quantity, lam, control, nd, variant) -> dict:
  e = stats.paired_effect(diffs, what=f"{variant} λ = {lam:g} − λ = {control:g}, {quantity}", nd=nd)
  return {**e, "lambda": lam, "control": control, "quantity": quantity}


def _dose_effects(runs, variant, lam, control) -> list[dict]:
  """lambda - control per seed: val BPB, final imbalance and (rank-matched) importance of the strongest head per
  layer and of the others."""
  out = []
  for key, name, nd in QUANTITIES:
    _, d = _paired(runs, variant, lam, control, key)
    out.append(_effect(d, name, lam, control, nd, variant))
  top, rest = _rank_diffs(runs, variant, lam, control)
  out.append(_effect(top, "strongest head per layer", lam, control, 3, variant))
  out.append(_effect(rest, "other heads", lam, control, 3, variant))
  return out


def dose_stats(dose: dict, grid: dict | None) -> dict:
  """Every test of the dose study: each lambda against lambda 0 (paired by seed), the smallest lambda (1e-8, a small
  treatment under Muon) against lambda 0 in its own section, the lambdas made on its commit against it, every dose's BPB difference averaged
  per seed, and the power of the design (BPB with the main grid's arms, imbalance)."""
  runs = dose["runs"]
  lambdas = sorted({float(r["lambda"]) for r in runs})
  variant = dose["variants"][0]
  commits = {}
  for r in runs:
    commits.setdefault(f"{float(r['lambda']):g}", set()).add(commit_of(r))
  mixed = {k: sorted(v) for k, v in commits.items() if len(v) > 1}
  if mixed:
    raise ValueError(f"dose study: an arm mixes commits {mixed}; rerun it on one commit")
  commits = {k: v.pop() for k, v in commits.items()}
  per_lambda = {}
  for lam in lambdas:
    rs = sorted((r for r in runs if float(r["lambda"]) == lam), key=lambda r: r["seed"])
    per_lambda[lam] = {
        "seeds": [r["seed"] for r in rs], **{k: [r[k] for r in rs] for k in ("val_bpb", "head_imbalance")},
        "aux_term": [aux_term(r, lam) for r in rs],
        "final_train_loss": [r.get("final_train_loss") for r in rs],
        "train_seconds": [r.get("train_seconds") for r in rs],
        "importance_by_rank": [np.sort(np.asarray(r["importance"]), -1)[:, ::-1].mean(0).tolist() for r in rs],
        "mean_importance": [float(np.mean(r["importance"])) for r in rs],
        "source": [r.get("source", "") for r in rs], "commit": commits[f"{lam:g}"]}
  doses = [lam for lam in lambdas if lam not in (0.0, SMALL_LAMBDA)]
  effects = [e for lam in doses for e in _dose_effects(runs, variant, lam, 0.0)]
  small, same_commit = [], []
  if SMALL_LAMBDA in lambdas:
    small = _dose_effects(runs, variant, SMALL_LAMBDA, 0.0)
    same_commit = [e for lam in doses if commits[f"{lam:g}"] == commits[f"{SMALL_LAMBDA:g}"]
                   for e in _dose_effects(runs, variant, lam, SMALL_LAMBDA)[:2]]
  bpb = {lam: dict(zip(*_paired(runs, variant, lam, 0.0))) for lam in doses}
  seeds = sorted(set.intersection(*(set(v) for v in bpb.values()))) if bpb else []
  every = [bpb[lam][s] for lam in doses for s in seeds]
  pooled = {"doses": [f"{lam:g}" for lam in doses], "positive": sum(x > 0 for x in every), "n": len(every),
            "per_seed_mean": stats.paired_effect([float(np.mean([bpb[lam][s] for lam in doses])) for s in seeds],
                                                 what=f"{variant}, val BPB of every dose − λ = 0, mean over doses "
                                                      "per seed")} if len(seeds) > 1 else None
  groups = [e["diffs"] for e in effects + small if e["quantity"] == "val BPB"]
  if grid is not None:
    groups += [_paired(grid["runs"], v, "aux", "base")[1] for v in ("vanilla", "sink")]
  n = len(seeds) or 1
  power = {"bpb": power_figures(groups, n) if n > 1 else None,
           "imbalance": power_figures([e["diffs"] for e in effects + small if e["quantity"] == "final head "
                                       "imbalance"], n, effects=(0.05, 0.1)) if n > 1 else None}
  return {"variant": variant, "lambdas": lambdas, "commits": commits, "per_lambda":
          {f"{k:g}": v for k, v in per_lambda.items()}, "effects": effects, "small_lambda": small,
          "same_commit": same_commit, "all_doses_bpb": pooled, "power": power}


def _rank_diffs(runs, variant, lam, control=0.0) -> tuple[list[float], list[float]]:
  """Per seed: (strongest head per layer, mean over layers) and (the other heads, mean over layers and heads) of
  the lambda run minus the control run, head ranks matched within each layer."""
  ranked = lambda l: {r["seed"]: np.sort(np.asarray(r["importance"]), -1)[:, ::-1] for r in runs
                      if r["variant"] == variant and float(r["lambda"]) == float(l)}
  base, treat = ranked(control), ranked(lam)
  seeds = sorted(set(base) & set(treat))
  return ([float((treat[s][:, 0] - base[s][:, 0]).mean()) for s in seeds],
          [float((treat[s][:, 1:] - base[s][:, 1:]).mean()) for s in seeds])


def dose_effects_lines(effects: list[dict], head: str = "effect (paired with)") -> list[str]:
  """One row per lambda and quantity (RESULTS.md copies these tables)."""
  return effects_table([(f"λ = {e['lambda']:g} − {e['control']:g}, {e['quantity']}", e,
                         4 if e["quantity"] == "val BPB" else 3) for e in effects], head)


def dose_markdown(dose: dict, ds: dict, dose_path: str, grid_path: str) -> str:
  commits = ", ".join(f"λ {k}: {v}" for k, v in ds["commits"].items())
  source = (", same recipe, checked by `paper.recipe_differences`" if (dose.get("reuse") or {}).get("reused") else
            ": the grid's runs in the dose study's directory")          # study.reuse, else study.out's own runs
  lines = ["# Dose study: gated attention × λ × seeds", "",
           f"Generated by `python -m sinkjax.experiments.paper_report --write` from `{dose_path}` (runs: "
           f"`{dose['command']}`). λ = 0 and 1e-4 are the main grid's gated base / aux runs (`{grid_path}`{source}). "
           f"Commits: {commits}.", ""]
  if ds["power"]["bpb"]:
    lines += power_lines(ds["power"]["bpb"], "BPB, dose arms and the main grid's arms")
  ranks = {lam: np.array(r["importance_by_rank"]).mean(0) for lam, r in ds["per_lambda"].items()}
  lines += table(["λ", "val BPB per seed", "mean ± std", "final head imbalance per seed", "mean",
                  "aux term at the end (held-out)", "mean importance", "strongest / others (mean over layers)"],
                 ([lam, ", ".join(f"{x:.4f}" for x in r["val_bpb"]),
                   stats.mean_std(stats.seed_stats(r["val_bpb"])), ", ".join(f"{x:.3f}" for x in r["head_imbalance"]),
                   f"{np.mean(r['head_imbalance']):.3f}",
                   f"{np.mean(r['aux_term']):.1e}", f"{np.mean(r['mean_importance']):.3f}",
                   f"{ranks[lam][0]:.3f} / {ranks[lam][1:].mean():.3f}"] for lam, r in ds["per_lambda"].items()))
  lines += ["", "## Tests (paired with λ = 0, per seed)", "", *dose_effects_lines(ds["effects"]), ""]
  if ds["small_lambda"]:
    other = ds["commits"][f"{SMALL_LAMBDA:g}"] != ds["commits"]["0"]
    lines += [f"## λ = {SMALL_LAMBDA:g} against λ = 0: a small treatment, not a null", "",
              f"Under Muon from a zero-initialised LM head λ = {SMALL_LAMBDA:g} is a treatment, not a null arm: the "
              "first update of the parameters behind the head follows the aux gradient, at a size the optimizer sets "
              "rather than λ (docs/RESULTS.md, \"The null arm, measured\"). Its differences against λ = 0 are read "
              "as an effect" + (", and they also carry a code change (the two arms' commits differ)." if other
                                 else "."), "",
              *dose_effects_lines(ds["small_lambda"]), ""]
  if ds["same_commit"]:
    lines += ["## The same commit: against λ = 1e-8", "",
              *dose_effects_lines(ds["same_commit"], "effect (paired with λ = 1e-8, same commit)"), ""]
  if ds["all_doses_bpb"]:
    a = ds["all_doses_bpb"]
    lines += [f"BPB: {a['positive']} of the {a['n']} dose differences against λ = 0 are positive. "
              f"{a['per_seed_mean']['sentence']}", ""]
  lines += [f"- {e['sentence']}" for e in ds["effects"] + ds["small_lambda"] + ds["same_commit"]] + [""]
  lines += ["![imbalance and BPB per λ](dose_imbalance.png)", "", "![importance by rank](dose_importance.png)", ""]
  return "\n".join(lines)


def _jsonable(x):
  if isinstance(x, dict):
    return {str(k): _jsonable(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [_jsonable(v) for v in x]
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return str(x)
  return x


# ------------------------------------------------------------------------------------------- run directories

def find_runs(patterns: list[str]) -> list[str]:
  """The run directories (holding config.yaml) that the local or remote globs match, sorted."""
  runs = []
  for pat in patterns:
    found = [f.rsplit("/", 1)[0] for f in paths.expand_glob(pat.rstrip("/") + "/config.yaml")]
    if not found:
      raise UserError(f"--runs {pat!r} matches no run directory (none holds config.yaml)")
    runs += [r for r in found if r not in runs]
  return sorted(runs)


def read_run(run: str) -> dict:
  """What Table 1 and Figs. 5 / 8 need of one run directory."""
  from sinkjax.run import read_metrics  # pylint: disable=import-outside-toplevel
  cfg = yaml.safe_load(paths.as_path(f"{run}/config.yaml").read_text()) or {}
  model, loss = cfg.get("model") or {}, cfg.get("loss") or {}
  metrics = read_metrics(f"{run}/metrics.jsonl") if paths.as_path(f"{run}/metrics.jsonl").is_file() else []
  report = f"{run}/eval/report.json"
  bpb, bpb_from = None, None
  if paths.as_path(report).is_file():
    bpb, bpb_from = json.loads(paths.as_path(report).read_text())["val_bpb"], "eval/report.json"
  elif any("val_bpb" in r for r in metrics):
    bpb, bpb_from = [r["val_bpb"] for r in metrics if "val_bpb" in r][-1], "metrics.jsonl"
  tasks = {}
  for f in sorted(paths.expand_glob(f"{run}/lm_eval/**/results_*.json"), key=lambda f: f.rsplit("/", 1)[-1]):
    tasks.update(json.loads(paths.as_path(f).read_text()).get("results") or {})   # names carry the date: later wins
  scores = {}
  for col, task, keys in TABLE1_COLUMNS:
    got = [tasks[task][k] for k in keys if k in tasks.get(task, {})]
    if got:
      scores[col] = 100.0 * float(got[0])
  aux = float(loss.get("aux_weight") or 0.0)
  layers = int(model.get("num_layers") or model.get("depth") or 0)
  return {"run": run, "attention": model.get("attention", "vanilla"), "loss": "aux" if aux > 0 else "base",
          "aux_weight": aux, "size": f"d{layers}" + (f" ({model['d_model']} wide)" if model.get("d_model") else ""),
          "layers": layers, "val_bpb": bpb, "val_bpb_from": bpb_from, "scores": scores,
          "curves": {k: [(r["step"], r[k]) for r in metrics if k in r] for k in ("loss", "head_imbalance", "val_bpb")}}


def _mean(xs):
  xs = [x for x in xs if x is not None]
  return float(np.mean(xs)) if xs else None


def runs_table(runs: list[dict]) -> list[dict]:
  """Table 1's rows: one per (size, attention, loss), sizes by depth, attention in VARIANTS order, base before aux;
  BPB and columns averaged over the cell's runs; Average over the ten columns; `delta` (aux rows) = Average - base."""
  order = {v: i for i, v in enumerate(VARIANTS)}
  cells = {}
  for r in runs:
    cells.setdefault((r["layers"], r["size"], r["attention"], r["loss"]), []).append(r)
  rows = []
  for (layers, size, att, loss), rs in sorted(cells.items(), key=lambda kv: (kv[0][0], kv[0][1], order.get(
      kv[0][2], 99), kv[0][2], kv[0][3] != "base")):
    cols = {c: _mean([r["scores"].get(c) for r in rs]) for c, _, _ in TABLE1_COLUMNS}
    full = all(v is not None for v in cols.values())
    rows.append({"size": size, "attention": att, "loss": loss, "runs": [r["run"] for r in rs],
                 "val_bpb": _mean([r["val_bpb"] for r in rs]), "columns": cols,
                 "average": float(np.mean(list(cols.values()))) if full else None, "delta": None})
  for row in rows:
    if row["loss"] == "aux":
      base = [b for b in rows if (b["size"], b["attention"], b["loss"]) == (row["size"], row["attention"], "base")]
      if base and base[0]["average"] is not None and row["average"] is not None:
        row["delta"] = row["average"] - base[0]["average"]
  return rows


def runs_markdown(rows: list[dict]) -> str:
  """Table 1 as the paper lays it out (a size heading row, then attention / loss / BPB / ten columns / Average)."""
  cols = [c for c, _, _ in TABLE1_COLUMNS]
  fmt = lambda x, nd=2: "—" if x is None else f"{x:.{nd}f}"
  lines, size = [], None
  for row in rows:
    if row["size"] != size:
      size = row["size"]
      lines.append(f"| *{size}* |" + " |" * (len(cols) + 3))
    avg = fmt(row["average"]) + ("" if row["delta"] is None else
                                 f" {'↑' if row['delta'] >= 0 else '↓'} {abs(row['delta']):.2f}")
    n = f" ({len(row['runs'])} runs)" if len(row["runs"]) > 1 else ""
    att = row["attention"].capitalize() if row["loss"] == "base" or not any(
        r["loss"] == "base" and r["attention"] == row["attention"] and r["size"] == size for r in rows) else ""
    lines.append([att, ("base" if row["loss"] == "base" else "base+aux") + n, fmt(row["val_bpb"], 4),
                  *(fmt(row["columns"][c]) for c in cols), avg])
  return "\n".join(table(["Attention", "Training loss", "Validation BPB (↓)", *cols, "Average"], lines,
                         "llr" + "r" * len(cols) + "r")) + "\n"


def runs_report(patterns: list[str], out: str | None) -> str:
  """Reads the runs, prints Table 1 (and where each BPB came from); with `out` writes table1.md / table1.json and the
  figures there. Returns the markdown."""
  runs = [read_run(r) for r in find_runs(patterns)]
  rows = runs_table(runs)
  md = runs_markdown(rows)
  print(md, end="")
  for r in runs:
    missing = [c for c, _, _ in TABLE1_COLUMNS if c not in r["scores"]]
    print(f"  {r['run']}: {r['attention']} {r['loss']}, BPB from {r['val_bpb_from'] or 'nowhere'}"
          + (f"; no lm-eval result for {', '.join(missing)}" if missing else ""))
  if out:
    with paths.staged_dir(out) as d:
      (d / "table1.md").write_text(md)
      (d / "table1.json").write_text(json.dumps(_jsonable({"rows": rows, "columns": [
          {"column": c, "task": t, "metrics": list(k)} for c, t, k in TABLE1_COLUMNS]}), indent=1))
      from sinkjax import plots  # pylint: disable=import-outside-toplevel
      plots.plot_runs(runs, d, VARIANTS)
    print(f"wrote {out}/table1.md, table1.json, fig5_imbalance.png, fig8_loss_bpb.png")
  return md


@dataclasses.dataclass
class ReportOptions:
  """The report.* options of `python -m sinkjax.experiments.paper_report` (each flag the alias of its key)."""
  runs: list[str] = declare([], alias="--runs", metavar="GLOB",
                        help="run directories (local or gs:// globs; repeatable): Table 1 and Figs. 5 / 8 from them")
  out: str = declare("", alias="--out", help="with --runs: where table1.md / .json and the figures go")
  grid: str = declare(str(GRID), alias="--grid", help="the main grid's results.json")
  dose: str = declare(str(DOSE), alias="--dose", help="the dose study's dose.json ('none': skip)")
  repro: str = declare("", alias="--repro", help="retrains of the --grid's runs (raw/NAME/paper_eval.json; 'none': "
                   "skip); default: docs/results/paper_cpu_repro, the default grid's, with the default --grid only")
  write: bool = declare(False, alias="--write", help="write stats.md / stats.json (and the dose report) next to the inputs")


COMMAND = options.Command(prog="python -m sinkjax.experiments.paper_report", description=__doc__.split("\n\n")[0],
                          sections={"report": ReportOptions})


def stats_report(grid_path: pathlib.Path, dose_path: pathlib.Path | None, repro: pathlib.Path | None,
                 write: bool) -> None:
  """Prints every test of the main grid (and of the dose study, given one); with `write`, writes stats.md /
  stats.json next to the grid's results.json and dose.md, dose_stats.json and the dose figures next to dose.json."""
  if not grid_path.is_file():
    raise UserError(f"--grid {grid_path}: no such results.json")
  grid = json.loads(grid_path.read_text())
  dose = json.loads(dose_path.read_text()) if dose_path is not None and dose_path.is_file() else None
  gs = grid_stats(grid)
  gs["repro"] = repro_runs(repro, grid) if repro is not None else []
  gs["window_dose"] = [{"name": f"{r['variant']}_{r['loss']}_s{r['seed']}", **_vz_both(r)} for r in
                       (dose or {}).get("runs", []) if "value_zeroing_teacher_forced_window" in r]
  rel = lambda q: str(q.resolve().relative_to(REPO)) if q.resolve().is_relative_to(REPO) else str(q)
  print(f"main grid ({rel(grid_path)}):")
  pw = gs["power"]
  print(f"  power: paired BPB SD {pw['sd']:.4f} (pooled, {pw['df']} df); detectable at n = {pw['n']}: "
        f"±{pw['detectable']:.4f}; seeds needed: {pw['seeds_needed']}")
  for e in gs["effects"].values():
    print(f"  - {e['sentence']}")
  if write:
    (grid_path.parent / "stats.md").write_text(grid_markdown(gs, rel(grid_path)))
    (grid_path.parent / "stats.json").write_text(json.dumps(_jsonable(gs), indent=1))
  if dose is None:
    return
  ds = dose_stats(dose, grid)
  print(f"dose study ({rel(dose_path)}): commits {ds['commits']}")
  for lam, r in ds["per_lambda"].items():
    print(f"  lambda {lam}: val BPB {np.mean(r['val_bpb']):.4f} ({', '.join(f'{x:.4f}' for x in r['val_bpb'])}), "
          f"imbalance {np.mean(r['head_imbalance']):.3f} ({', '.join(f'{x:.3f}' for x in r['head_imbalance'])})")
  for e in ds["effects"] + ds["small_lambda"] + ds["same_commit"]:
    print(f"  - {e['sentence']}")
  if write:
    from sinkjax import plots  # pylint: disable=import-outside-toplevel  # matplotlib: slow to import
    plots.plot_dose(dose, ds, dose_path.parent)
    (dose_path.parent / "dose.md").write_text(dose_markdown(dose, ds, rel(dose_path), rel(grid_path)))
    (dose_path.parent / "dose_stats.json").write_text(json.dumps(_jsonable(ds), indent=1))


def report(o: ReportOptions) -> None:
  if o.runs:
    runs_report(o.runs, o.out or None)
    return
  # paper_cpu_repro retrains the committed main grid's runs: paired by name with another grid's, they would not compare
  repro = o.repro or ("none" if pathlib.Path(o.grid).resolve() != GRID.resolve() else str(REPRO))
  stats_report(pathlib.Path(o.grid), None if o.dose == "none" else pathlib.Path(o.dose),
               None if repro == "none" else pathlib.Path(repro), o.write)


def main(argv=None) -> int:
  return options.main(COMMAND, argv, lambda sections, _: report(sections["report"]))


if __name__ == "__main__":
  sys.exit(main())
