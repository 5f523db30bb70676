"""[Sink-MoE]'s from-scratch study with error bars (study drivers paper and dose): attention variants x lambda x seeds.

    python -m sinkjax.experiments.study configs/studies/paper_cpu.yaml [key=value ...] [--dry-run] [--report-only]

Each run is `sinkjax.train.train` on the study file's recipe and shape (configs/studies/paper_{cpu,gpu,smoke}.yaml, the
dose study paper_cpu_dose.yaml), then evaluated with `sinkjax.eval` (val BPB, importance, head imbalance, first-token
attention, sink ratio, value zeroing teacher-forced and after prefill as [Sink-MoE] App. A defines it). study.out holds
runs/NAME (done.json once trained, paper_eval.json once evaluated: a rerun skips both), raw/NAME (each run's files to
commit, no checkpoints), results.json (one commit per study), results.md and the figures; with study.finetune=true
also finetune/ and finetune.json (eq. 7 vs eq. 8, App. D). A dose study writes dose.json (its report: `paper_report`).
docs/RESULTS.md reads them.
"""
from __future__ import annotations

from sinkjax import errors

if __name__ == "__main__":   # a command until the study runner (#50) ran it
  errors.moved("sinkjax.experiments.paper",
            "python -m sinkjax.experiments.study configs/studies/paper_cpu.yaml (--scale X: paper_X.yaml; --out DIR: "
            "study.out=DIR; --dry-run and --report-only as before)")

import dataclasses
import json
import os
import pathlib
import platform
import time

import jax
import numpy as np

from sinkjax import balance, paths
from sinkjax import config as config_lib
from sinkjax.errors import UserError
from sinkjax.experiments import runner
from sinkjax.experiments.paper_report import (LOSSES, VARIANTS, finetune_lines, finetune_summary, table1, table1_cells,
                                              table1_effects, table1_lines)
from sinkjax.experiments.runner import StudyError, git_commit, one_commit, read_json, write_json
from sinkjax.markdown import table
from sinkjax.stats import mean_std, seed_stats

TAU = 0.75                                     # [Sink-MoE] App. A: selective zeroing of heads with alpha > tau
STUDIES = config_lib.configs_dir() / "studies"


@dataclasses.dataclass(frozen=True)
class RunSpec:
  variant: str
  loss: str                        # "base" | "aux" | a dose label "lam<lambda>" (loss_label)
  seed: int
  aux_weight: float | None = None  # lambda; None: LOSSES[loss]
  extra: tuple = ()                # ((key, value), ...): the study's axes beyond attention, lambda and seed

  @property
  def arm(self) -> str:
    """What the reports group seeds by: the attention variant, and the value of each other axis."""
    return self.variant + "".join(f"_{k.rsplit('.', 1)[-1]}{v}" for k, v in self.extra)

  @property
  def name(self) -> str:
    return f"{self.variant}_{self.loss}_s{self.seed}" + self.arm[len(self.variant):]

  @property
  def lam(self) -> float:
    return LOSSES[self.loss] if self.aux_weight is None else float(self.aux_weight)

  @property
  def overrides(self) -> tuple[str, ...]:
    """What this run sets on top of the recipe and the scale."""
    return (f"model.attention={self.variant}", f"loss.aux_weight={self.lam}", f"train.seed={self.seed}",
            *(f"{k}={v}" for k, v in self.extra))


def loss_label(lam: float) -> str:
  """The run-name label of lambda: "base" (0) and "aux" (1e-4) as in the main grid, so the dose study reuses those
  runs; any other lambda "lam<lambda>" (e.g. lam0.001)."""
  for k, v in LOSSES.items():
    if float(lam) == v:
      return k
  return f"lam{float(lam):g}"


def specs_of(plan: runner.Plan) -> list[RunSpec]:
  """The study's runs in its axes' order: attention, lambda and seed from the axes (else the study's config), any
  other axis carried in the run's name and overrides; lambda 0 and 1e-4 are named base / aux (`loss_label`), so a
  dose study's runs of those lambdas are the main grid's."""
  fixed = plan.config({}, "RUN_DIR")
  out = []
  for run in plan.runs():
    run = dict(run)
    variant = str(run.pop("model.attention", fixed.model.attention))
    lam = float(run.pop("loss.aux_weight", fixed.loss.aux_weight))
    seed = int(run.pop("train.seed", fixed.train.seed))
    if variant not in VARIANTS:
      raise StudyError(f"{plan.path}: model.attention {variant!r} is not one of the paper's {', '.join(VARIANTS)}")
    out.append(RunSpec(variant, loss_label(lam), seed, lam, tuple(run.items())))
  return out


def run_config(plan: runner.Plan, spec: RunSpec, run_dir, *, extra=()):
  """The resolved `Config` of one run: the study's recipe and shape, the run's variant, lambda, seed and other axes."""
  return plan.config({}, run_dir, [*spec.overrides, *extra])


# ------------------------------------------------------------------------------------------------ training

RAW_FILES = ("done.json", "paper_eval.json", "metrics.jsonl", "config.yaml")   # what a run keeps in OUT/raw/NAME


def train_run(cfg, run_dir: pathlib.Path, commit: dict | None = None) -> tuple[dict, bool]:
  """(done.json's record, whether it trained now): trains (or resumes) the run unless done.json says it finished;
  `commit` (default: this checkout's) is what done.json records the run was made with."""
  from sinkjax.train import train  # lazy: the train extra (study's main checks it)
  done = read_json(run_dir / "done.json")
  if done is not None and done.get("steps") == cfg.train.steps:
    return done, False
  t0 = time.perf_counter()
  summary = train(cfg, progress=False)
  done = {"steps": summary["steps"], "end_step": summary["end_step"], "val_bpb": summary["val_bpb"],
          "final_loss": summary["final_loss"], "num_params": summary["num_params"],
          "train_seconds": time.perf_counter() - t0, **(commit or git_commit())}
  write_json(run_dir / "done.json", done)
  return done, True


# ----------------------------------------------------------------------------------------------------- evaluation

def _held_out(run_dir: pathlib.Path, study: runner.StudySection) -> tuple:
  """(the run's model, restored from its latest checkpoint; the study's held-out batches of its data: eval_batches
  batches of train.batch_size rows)."""
  from sinkjax.data import make_eval_batches  # lazy: the train extra (study's main checks it)
  from sinkjax.run import load_run  # lazy: the train extra (study's main checks it)
  model, cfg, tok, _ = load_run(run_dir)
  return model, make_eval_batches(cfg.data, tok, batch_size=cfg.train.batch_size, num_batches=study.eval_batches)


EVAL_KEYS = ("val_bpb", "val_loss", "importance", "head_imbalance", "cv_per_layer", "first_token_attention",
             "first_token_attention_per_head", "sink_logit_attention", "sink_ratio_alpha", "value_norm_ratio",
             "gate_mean", "m_act")


def evaluate_run(run_dir: pathlib.Path, study: runner.StudySection, *, tau: float = TAU) -> dict:
  """paper_eval.json's record: `sinkjax.eval.evaluate` on the run's held-out batches (teacher-forced value zeroing
  included) plus its after-prefill value zeroing (`prefill_value_zeroing`) and the teacher-forced one on the same
  targets (`teacher_forced_value_zeroing`)."""
  from sinkjax import eval as eval_lib  # lazy: the train extra (study's main checks it)
  t0 = time.perf_counter()
  model, batches = _held_out(run_dir, study)
  report = eval_lib.evaluate(model, batches, tau=tau)
  rec = {k: report[k] for k in EVAL_KEYS}
  vz = report["value_zeroing"]
  rec["value_zeroing_teacher_forced"] = {k: vz[k] for k in ("tau", "bpb_none", "bpb_all", "bpb_selected",
                                                            "num_heads_selected", "num_heads")}
  rec["value_zeroing_after_prefill"] = eval_lib.prefill_value_zeroing(
      model, batches, report["sink_ratio_alpha"], tau=tau, prompt_len=study.prompt_len)
  rec["value_zeroing_teacher_forced_window"] = eval_lib.teacher_forced_value_zeroing(
      model, batches, report["sink_ratio_alpha"], tau=tau, prompt_len=study.prompt_len)
  rec.update(eval_tokens=report["eval_tokens"], eval_seconds=time.perf_counter() - t0)
  return rec


def imbalance_curve(run_dir: pathlib.Path) -> list[list[float]]:
  """[[step, head_imbalance], ...] of the run's metrics.jsonl (the training batches' importances, eq. 6)."""
  from sinkjax.run import read_metrics  # lazy: the train extra (study's main checks it)
  return [[r["step"], r["head_imbalance"]] for r in read_metrics(run_dir / "metrics.jsonl")
          if r.get("head_imbalance") is not None]


# ------------------------------------------------------------------------------------------------- aggregation

def arms(records: list[dict]) -> dict:
  """{(variant, loss): its records}, in the records' order."""
  out = {}
  for r in records:
    out.setdefault((r["variant"], r["loss"]), []).append(r)
  return out


def value_zeroing_table(records: list[dict]) -> list[dict]:
  """Per variant and loss: mean over seeds of BPB with no / all / alpha > tau zeroing, in both definitions."""
  rows = []
  for (v, loss), rs in arms(records).items():
    row = {"variant": v, "loss": loss, "n": len(rs)}
    for defn in ("teacher_forced", "after_prefill"):
      for k in ("bpb_none", "bpb_all", "bpb_selected", "num_heads_selected"):
        row[f"{defn}.{k}"] = seed_stats([r[f"value_zeroing_{defn}"][k] for r in rs])
    rows.append(row)
  return rows


# ------------------------------------------------------------------------------------------------------ outputs

def results_markdown(res: dict) -> str:
  m, sc = res["machine"], res["scale"]
  mean = lambda a: " ".join(f"{x:.3f}" for x in np.mean(a, 0))          # per layer, over seeds
  lines = [
      "# [Sink-MoE] from scratch: base vs base + aux, with seeds", "",
      f"Command: `{res['command']}`", "",
      f"Machine: {m['cpu_count']} CPU cores, JAX {m['jax']} on {m['backend']} ({m['devices']}); load average "
      f"{m['load_start']} at the start, {m['load_end']} at the end (other jobs shared the machine).", "",
      "## Recipe", "",
      f"`configs/nanochat.yaml` (the paper's baseline, nanochat 9d4c9b7: Muon lr 0.02 for matrices with momentum "
      f"0.85 → 0.95 over 300 steps and Newton–Schulz in {res['recipe']['train']['muon_ns_dtype']}, AdamW for "
      f"embeddings / LM head / scalars, no warmup, linear decay to 0 over the final 20 %, clipping 1.0, nanochat's "
      f"init, logit soft-cap 15, QK-norm, ReLU², untied embeddings, `data.packing={res['recipe']['data']['packing']}`)"
      f" on the embedded corpus (`data.source=default`, byte tokenizer), scale `{sc['name']}`: {sc['note']}. "
      f"base: `loss.aux_weight=0`; base + aux: `loss.aux_weight=1e-4` (eq. 7). Overrides: "
      f"`{' '.join(sc['overrides'])}`.", "",
      f"Finished runs: {len(res['runs'])} of {res['grid_size']} in the requested grid "
      f"(seeds {res['seeds']}, variants {res['variants']}).", "",
      "## Table 1 analogue: validation BPB", "",
      *table1_lines({"table1": table1_cells(res["runs"]), "effects": table1_effects(res["runs"])}), "",
      "std is over seeds (ddof 1); the paired difference is taken per seed (same data order and init seed), so seed "
      "noise shared by base and aux cancels; its tests are `paper_report`'s (the same table as stats.md). "
      "[Sink-MoE] Table 1 reports aux − base of −0.0007 to −0.0055 BPB.", "",
      "![table 1](table1_bpb.png)", "", "## Fig. 5 analogue: head imbalance during training", "",
      "![imbalance](imbalance_curves.png)", "",
      "## First-token attention and sink ratio", "",
      *table(["attention", "loss", "F-Attn per layer (mean over heads and seeds)", "mean alpha per layer",
              "sink-logit weight per layer"],
             ([v, loss, mean([r["first_token_attention"] for r in rs]),
               mean(np.mean([r["sink_ratio_alpha"] for r in rs], -1)),
               mean([r["sink_logit_attention"] for r in rs]) if rs[0]["sink_logit_attention"] is not None else "-"]
              for (v, loss), rs in arms(res["runs"]).items())), "",
      "![first token](first_token_attention.png)", "",
      f"## Value zeroing ([Sink-MoE] App. A, τ = {TAU})", "",
      "Teacher-forced: the first token's value is zeroed inside one forward pass over the whole row, so every query "
      "(the prompt's too) sees it zeroed (`sinkjax.eval`). After prefill (the paper's): the first "
      f"{res['scale']['prompt_len']} tokens of a row are prefilled into the KV cache with their values intact, the "
      "first token's value is then zeroed in the cache, and the rest of the row is decoded token by token against "
      "it; BPB over those continuation tokens (the `none` column uses the same tokens).", "",
      *table(["attention", "loss", "definition", "BPB none", "BPB all heads", "BPB alpha > τ",
              "heads with alpha > τ"],
             ([r["variant"], r["loss"], name, *(mean_std(r[f"{defn}.{k}"]) for k in ("bpb_none", "bpb_all",
                                                                                       "bpb_selected")),
               mean_std(r[f"{defn}.num_heads_selected"], 1)] for r in res["value_zeroing"]
              for defn, name in (("teacher_forced", "teacher-forced"), ("after_prefill", "after prefill (paper)")))),
      "", "![value zeroing](value_zeroing.png)", "",
      "## Head importance", "", "![importance](importance.png)", ""]
  if res.get("finetune"):
    lines += ["## Fine-tuning: eq. 7 vs eq. 8 ([Sink-MoE] App. D, head pinning)", "",
              f"Each base run of the first seed fine-tuned from its final checkpoint (`train.init_from`) with the same "
              f"recipe, λ = {FINETUNE_LAMBDA:g}, m = {FINETUNE_SHARED} shared head per layer (the top-m heads per "
              "layer of the base run's held-out importance).", "", "![fine-tuning](finetune.png)"]
    for v in res["finetune"]:
      lines += finetune_lines(finetune_summary(res["finetune"], v), v)
  return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ fine-tuning

FINETUNE_LAMBDA = 1e-2           # [Sink-MoE] §5.1: lambda for fine-tuning
FINETUNE_SHARED = 1              # m shared heads per layer (eq. 8)
FINETUNE_MODES = {               # name -> (aux_weight, num_shared_heads, shared set fixed from the base run)
    "none": (0.0, 0, False),
    "eq7": (FINETUNE_LAMBDA, 0, False),
    "eq8_fixed": (FINETUNE_LAMBDA, FINETUNE_SHARED, True),
    "eq8_repicked": (FINETUNE_LAMBDA, FINETUNE_SHARED, False),
}
FINETUNE_TITLES = {"none": "no aux loss", "eq7": "eq. 7 (all heads)", "eq8_fixed": "eq. 8, shared fixed up front",
                   "eq8_repicked": "eq. 8, shared re-picked each step"}


def finetune_run(plan: runner.Plan, base_dir: pathlib.Path, spec: RunSpec, mode: str, run_dir: pathlib.Path,
                 commit: dict | None = None) -> dict:
  """Fine-tunes the trained base run `base_dir` (train.init_from) with `mode`'s loss and returns the held-out
  val BPB, importance and head imbalance (finetune_eval.json's record)."""
  from sinkjax import eval as eval_lib  # lazy: the train extra (study's main checks it)
  weight, m, fixed = FINETUNE_MODES[mode]
  extra = [f"train.init_from={base_dir}", f"loss.aux_weight={weight}", f"loss.num_shared_heads={m}"]
  if fixed:
    extra.append(f"loss.shared_heads_from={base_dir / 'paper_eval.json'}")
  cfg = run_config(plan, spec, run_dir, extra=[*extra, f"train.steps={plan.study.finetune_steps}"])
  done, _ = train_run(cfg, run_dir, commit)
  model, batches = _held_out(run_dir, plan.study)
  lm = eval_lib.language_model_metrics(model, batches)
  rec = {"mode": mode, "aux_weight": weight, "num_shared_heads": m, "shared_fixed": fixed, "steps": done["steps"],
         **{k: lm[k] for k in ("val_bpb", "importance", "head_imbalance")}}
  return rec


def head_roles(before, after, m: int = FINETUNE_SHARED) -> dict:
  """How the heads' roles moved from `before` to `after` [L,H] (`balance.head_roles`, the shared heads the top-m per
  layer before): their importance before / after, the routed heads' CV, and the layers whose top-m set changed."""
  top_b, top_a = (np.argsort(-np.asarray(x, np.float64), -1)[:, :m] for x in (before, after))
  b, a = (balance.head_roles(x, before, m) for x in (before, after))
  changed = [l for l in range(len(top_b)) if set(top_b[l]) != set(top_a[l])]
  return {"shared_heads": top_b.tolist(), "shared_before": b["shared_importance"], "shared_after": a["shared_importance"],
          "routed_before": b["routed_importance"], "routed_after": a["routed_importance"],
          "routed_cv_before": b["routed_cv"], "routed_cv_after": a["routed_cv"], "imbalance_before": b["imbalance"],
          "imbalance_after": a["imbalance"], "layers_top_changed": changed, "top_heads_after": top_a.tolist()}


def run_finetune(plan: runner.Plan, specs: list[RunSpec], root: pathlib.Path, commit: dict | None = None) -> dict:
  """Every trained base run of the first requested seed, fine-tuned in each FINETUNE_MODES mode (runs
  OUT/finetune/NAME_MODE, finished once finetune_eval.json is written; done.json records `commit`)."""
  study = runner.Study(root, layout="finetune/{name}", record="finetune_eval.json", stamp=False, commit=commit)
  out = {}
  bases = [s for s in specs if s.loss == "base" and s.seed == specs[0].seed]
  for i, spec in enumerate(bases):
    base_dir = root / "runs" / spec.name
    before = read_json(base_dir / "paper_eval.json")
    res = {"base_run": spec.name, "before": {k: before[k] for k in ("val_bpb", "importance", "head_imbalance")},
           "modes": {}}
    for j, mode in enumerate(FINETUNE_MODES):
      t0 = time.perf_counter()
      do = lambda d, spec=spec, mode=mode, base_dir=base_dir: (
          finetune_run(plan, base_dir, spec, mode, d, study.commit), "fine-tuned")
      rec = study.walk_one(runner.Run(f"{spec.name}_{mode}", do)).record
      if rec is None:
        raise StudyError(f"fine-tuning run {spec.name}_{mode} is being made by another process; rerun when it ends")
      rec["roles"] = head_roles(before["importance"], rec["importance"])
      res["modes"][mode] = rec
      print(f"[finetune {i * len(FINETUNE_MODES) + j + 1}/{len(bases) * len(FINETUNE_MODES)}] {spec.name} {mode}: "
            f"val_bpb {rec['val_bpb']:.4f}, imbalance {rec['head_imbalance']:.3f} "
            f"({time.perf_counter() - t0:.0f} s)", flush=True)
    out[spec.variant] = res
  return out


# ----------------------------------------------------------------------------------------------------- results

def scale_record(plan: runner.Plan) -> dict:
  """What results.json / dose.json record of the study's scale: its name, overrides, evaluation sizes and note (the
  keys the committed studies have), and the study file with its axes."""
  st = plan.study
  return {"name": st.scale or pathlib.Path(plan.path).stem, "overrides": list(plan.overrides),
          "eval_batches": st.eval_batches, "prompt_len": st.prompt_len, "finetune_steps": st.finetune_steps,
          "note": st.note, "study": plan.path, "axes": plan.axes}


def _lock(out: pathlib.Path, plan: runner.Plan) -> None:
  """OUT/study.json pins the scale and steps: runs of another size in the same directory would not compare."""
  want = {"scale": scale_record(plan)["name"], "steps": plan.config({}, "RUN_DIR").train.steps}
  have = read_json(out / "study.json")
  if have is not None and have.get("steps", 0) is None:     # written before study files: None = the scale's steps
    have = {**have, "steps": runner.load_plan(plan.path).config({}, "RUN_DIR").train.steps}
  if have is not None and have != want:
    raise StudyError(f"study.out {out} holds a study of scale {have['scale']} with {have['steps']} steps; use that, "
                     "or another study.out")
  write_json(out / "study.json", want)


def run_record(spec: RunSpec, run_dir: pathlib.Path) -> dict | None:
  """What results.json / dose.json keep of a trained and evaluated run (None: not finished)."""
  done, ev = read_json(run_dir / "done.json"), read_json(run_dir / "paper_eval.json")
  if done is None or ev is None:
    return None
  return {"variant": spec.arm, "attention": spec.variant, "loss": spec.loss, "lambda": spec.lam, "seed": spec.seed,
          "name": spec.name, "run_dir": str(run_dir), "commit": done.get("commit"),
          "final_train_loss": done["final_loss"], "train_seconds": done["train_seconds"], **ev,
          "imbalance_curve": imbalance_curve(run_dir)}


def collect(out: pathlib.Path, specs: list[RunSpec]) -> list[dict]:
  """Every trained and evaluated main-grid run in OUT/runs: those of `specs` and those another invocation made
  (named VARIANT_LOSS_sSEED); dose-study runs (lambda labels) are dose.json's."""
  known = {s.name: s for s in specs if s.loss in LOSSES}
  for d in sorted((out / "runs").glob("*_s*")):
    parts = d.name.rsplit("_", 2)
    if d.name not in known and len(parts) == 3 and parts[0] in VARIANTS and parts[1] in LOSSES and \
        parts[2][1:].isdigit():
      known[d.name] = RunSpec(parts[0], parts[1], int(parts[2][1:]))
  records = [r for name, spec in known.items() if (r := run_record(spec, out / "runs" / name)) is not None]
  order = {v: i for i, v in enumerate(VARIANTS)}
  return sorted(records, key=lambda r: (order[r["attention"]], r["variant"], list(LOSSES).index(r["loss"]), r["seed"]))


def write_results(out: pathlib.Path, plan: runner.Plan, specs, machine: dict, ft: dict | None) -> dict:
  """results.json, results.md and the figures from every finished run in OUT."""
  records = collect(out, specs)
  if not records:
    raise StudyError(f"no finished runs in {out}/runs yet")
  commit = one_commit(records)
  recipe = config_lib.to_dict(run_config(plan, specs[0], "RUN_DIR"))
  machine = {**machine, "load_end": [round(x, 2) for x in os.getloadavg()]}
  res = {"command": plan.command, "scale": scale_record(plan), "commit": commit, "recipe": recipe, "machine": machine,
         "seeds": sorted({s.seed for s in specs}), "variants": list(dict.fromkeys(s.variant for s in specs)),
         "grid_size": len(specs), "runs": records,
         "table1": table1(records), "value_zeroing": value_zeroing_table(records), "finetune": ft}
  curves = {k: [r["imbalance_curve"] for r in rs] for k, rs in arms(records).items()}
  from sinkjax import plots  # lazy: matplotlib, slow to import and the train extra's
  figures = [plots.plot_table1(res["table1"], out / "table1_bpb.png"),
             plots.plot_imbalance_curves(curves, out / "imbalance_curves.png"),
             plots.plot_first_token(records, out / "first_token_attention.png"),
             plots.plot_value_zeroing(res["value_zeroing"], out / "value_zeroing.png", TAU),
             plots.plot_importance_grid(records, out / "importance.png")]
  if ft:
    figures.append(plots.plot_finetune(ft, out / "finetune.png", titles=FINETUNE_TITLES, lam=FINETUNE_LAMBDA,
                                       m=FINETUNE_SHARED))
  res["figures"] = [p.name for p in figures]
  write_json(out / "results.json", res)
  (out / "results.md").write_text(results_markdown(res))
  return res


# ------------------------------------------------------------------------------------------------- dose study

def recipe_differences(plan: runner.Plan, committed: dict) -> dict:
  """How the config this checkout resolves for the committed study's first run differs from the recipe stored in
  its results.json: {"changed": {key: [committed, now]}, "new": [keys this checkout has that it lacks],
  "gone": [keys it has that this checkout lacks]}. Reuse requires "changed" and "gone" empty (a key added since,
  at a default that keeps the old behaviour, is listed but does not block)."""
  first = committed["runs"][0]
  spec = RunSpec(first.get("attention", first["variant"]), first["loss"], first["seed"])
  now = runner.flatten(config_lib.to_dict(run_config(plan, spec, "RUN_DIR")))
  then = runner.flatten(committed["recipe"])
  changed = {k: [then[k], now[k]] for k in then if k in now and then[k] != now[k]}
  return {"changed": changed, "new": sorted(set(now) - set(then)), "gone": sorted(set(then) - set(now))}


def reusable_records(path, plan: runner.Plan) -> tuple[dict, dict]:
  """({(variant, loss, seed): record}, why) of the committed main-grid study at `path` whose runs the dose study can
  stand on instead of retraining (lambda 0 = base, 1e-4 = aux): only when it is the same scale, its recipe matches
  this study's (`recipe_differences`: the steps included) and its runs were made with this checkout's commit;
  otherwise ({}, why not)."""
  if not path or not pathlib.Path(path).is_file():
    return {}, {"reused": False, "reason": f"no committed results at {path or '(study.reuse unset)'}"}
  committed = json.loads(pathlib.Path(path).read_text())
  why = {"path": str(path), "command": committed.get("command")}
  name = scale_record(plan)["name"]
  if committed["scale"]["name"] != name:
    return {}, {**why, "reused": False, "reason": f"scale {committed['scale']['name']}; this study: scale {name}"}
  diff = recipe_differences(plan, committed)
  why.update(recipe_differences=diff)
  if diff["changed"] or diff["gone"]:
    return {}, {**why, "reused": False, "reason": "the recipe differs"}
  now = git_commit()["commit"]
  then = committed.get("commit") or "unrecorded"
  if then != now:
    return {}, {**why, "reused": False, "reason": f"its runs were made with commit {then}, this checkout is {now}: "
                "the arms of one study run on one commit"}
  return {(r["variant"], r["loss"], r["seed"]): r for r in committed["runs"]}, {**why, "reused": True}


def write_dose(out: pathlib.Path, plan: runner.Plan, specs: list[RunSpec], machine: dict, reuse: dict,
               why: dict) -> dict:
  """dose.json: every finished run of the dose grid, from OUT/runs when evaluated there, else the committed main
  grid's record (`reusable_records`); its statistics, dose.md and figures are `paper_report`'s."""
  records = []
  for spec in specs:
    if (r := run_record(spec, out / "runs" / spec.name)) is not None:
      records.append({**r, "source": r["run_dir"]})
    elif (spec.variant, spec.loss, spec.seed) in reuse:
      r = dict(reuse[spec.variant, spec.loss, spec.seed])
      records.append({**r, "lambda": spec.lam, "source": f"committed main grid ({r.pop('run_dir', '')})"})
  if not records:
    raise StudyError(f"no finished dose runs in {out}/runs and nothing reusable")
  res = {"command": plan.command, "scale": scale_record(plan), "lambdas": sorted({s.lam for s in specs}),
         "seeds": sorted({s.seed for s in specs}), "variants": list(dict.fromkeys(s.variant for s in specs)),
         "grid_size": len(specs), "reuse": why, "commit": one_commit(records), "machine": machine, "runs": records}
  write_json(out / "dose.json", res)
  print(f"wrote {out / 'dose.json'} ({len(records)} finished runs of {len(specs)}); statistics, dose.md and "
        f"figures: python -m sinkjax.experiments.paper_report --dose {out / 'dose.json'} --write", flush=True)
  return res


# ------------------------------------------------------------------------------------------------ the runs

def paper_run(plan: runner.Plan, spec: RunSpec, commit: dict | None = None) -> runner.Run:
  """One run of a study for the runner: trains it (unless done.json says it finished; done.json records `commit`)
  and evaluates it (`evaluate_run`, the record the runner writes to paper_eval.json)."""
  def do(run_dir):
    try:
      _, trained = train_run(run_config(plan, spec, run_dir), run_dir, commit)
      rec = evaluate_run(run_dir, plan.study)
    except UserError as e:              # a bad config, data or checkpoint, a failed run: which run it was
      raise StudyError(f"run {spec.name}: {e}") from e
    return rec, "trained + evaluated" if trained else "evaluated (trained before)"
  return runner.Run(spec.name, do, spec.overrides)


def run_study(plan: runner.Plan, specs: list[RunSpec], out: pathlib.Path, *, report_only: bool = False,
              sync=lambda: 0) -> dict:
  """Trains and evaluates every run of the grid not yet done (a progress line each; a dose study's runs that the
  main grid at study.reuse holds are not retrained), then writes the results: results.json, results.md and the
  figures (with study.finetune also finetune.json), or a dose study's dose.json; `sync` (a bucket mirror's) runs
  after each run."""
  machine = {"cpu_count": os.cpu_count(), "platform": platform.platform(), "jax": jax.__version__,
             "backend": jax.default_backend(), "devices": ", ".join(sorted({d.device_kind for d in jax.devices()})),
             "load_start": [round(x, 2) for x in os.getloadavg()]}
  t_start, dose = time.perf_counter(), plan.study.driver == "dose"
  reuse, why = reusable_records(plan.study.reuse, plan) if dose else ({}, {})
  if dose:
    print(f"reuse of {plan.study.reuse}: {why.get('reused')} {why.get('reason', '')}", flush=True)
  # run NAME in OUT/runs/NAME, finished once paper_eval.json is written (done.json, the training record, carries the
  # commit), its raw files kept in OUT/raw/NAME
  study = runner.Study(out, record="paper_eval.json", raw=out / "raw", raw_files=RAW_FILES, stamp=False)
  for i, spec in enumerate([] if report_only else specs, 1):
    head = f"[{i}/{len(specs)}] {spec.name}"
    if (spec.variant, spec.loss, spec.seed) in reuse and study.state(spec.name) != "done":
      print(f"{head}: reused from {plan.study.reuse}", flush=True)
      continue
    res = study.walk_one(paper_run(plan, spec, study.commit))
    rec = res.record
    print(f"{head}{f' (lambda {spec.lam:g})' if dose else ''}: {res.what}" + ("" if rec is None else
          f"; val_bpb {rec['val_bpb']:.4f}, head imbalance {rec['head_imbalance']:.3f} ({res.seconds:.0f} s; "
          f"study {time.perf_counter() - t_start:.0f} s)"), flush=True)
    sync()
  if dose:
    res = write_dose(out, plan, specs, machine, reuse, why)
  else:
    finetune = plan.study.finetune and not report_only
    ft = run_finetune(plan, specs, out, study.commit) if finetune else read_json(out / "finetune.json")
    if finetune:
      write_json(out / "finetune.json", ft)
    res = write_results(out, plan, specs, machine, ft)
  sync()
  return res


def list_grid(plan: runner.Plan, specs: list[RunSpec]) -> None:
  """Lists the grid and each run's state; trains nothing."""
  out = pathlib.Path(plan.study.out)
  reuse = reusable_records(plan.study.reuse, plan)[0] if plan.study.driver == "dose" else {}
  print(f"{plan.path}: scale {scale_record(plan)['name']}: {plan.study.note}")
  for i, s in enumerate(specs, 1):
    d = out / "runs" / s.name
    state = ("evaluated" if (d / "paper_eval.json").is_file() else "trained" if (d / "done.json").is_file() else
             "started" if d.is_dir() else "reused from study.reuse" if (s.variant, s.loss, s.seed) in reuse else
             "to do")
    print(f"[{i}/{len(specs)}] {s.name}: {s.variant} attention, loss.aux_weight={s.lam:g}, seed {s.seed}"
          f" -> {d} ({state})")


def run_plan(plan: runner.Plan, *, dry_run: bool = False, report_only: bool = False) -> None:
  """A paper or dose study file, run (`sinkjax.experiments.study`'s drivers paper and dose): the grid trained and
  evaluated in study.out (a gs:// / s3:// one is made locally, then uploaded), then its results."""
  specs = specs_of(plan)
  if dry_run:
    list_grid(plan, specs)
    return
  if plan.config({}, "RUN_DIR").model.dtype == "bfloat16" and jax.default_backend() == "cpu":
    raise StudyError(f"{plan.path} trains in bfloat16 for a GPU (JAX sees only the CPU); use paper_cpu.yaml")
  mirror = paths.Mirror(plan.study.out)     # study.out may be gs:// / s3://: the runs are made locally, then uploaded
  local = mirror.local
  try:
    local.mkdir(parents=True, exist_ok=True)
    # held while the study runs; --report-only trains nothing and may run beside a study that is training
    lock = None if report_only else runner.exclusive(local, "study.out")  # noqa: F841  # pylint: disable=unused-variable
    _lock(local, plan)
  except OSError as e:
    raise StudyError(f"study.out {local}: {e.strerror or e}") from None
  res = run_study(plan, specs, local, report_only=report_only, sync=mirror.sync)
  if plan.study.driver == "paper":
    url = plan.study.out.rstrip("/")
    print(f"wrote {url}/results.json, {url}/results.md and {len(res['figures'])} figures "
          f"({len(res['runs'])} finished runs)")
