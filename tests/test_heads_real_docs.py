"""docs/RESULTS.md's real-model numbers recomputed from the study's raw files (docs/results/heads_real/), with numpy
and scipy written here (not the study's code): the imbalance (eq. 6 as the mean over layers of std / mean across
heads), the counts and ranges quoted, every column of each fine-tuning run's row (imbalance, held-out loss, shared /
routed heads' importance, routed CV, with the shared heads chosen here), every cell of the 30-step effects table
(per-seed differences, mean, t-interval, paired t p, Holm p), and the provenance quoted (commit, dirty files, the
interrupted run, run times)."""
import json
import pathlib
import re

import numpy as np
import pytest
from scipy import stats as sps

ROOT = pathlib.Path(__file__).resolve().parents[1]
RAW = ROOT / "docs" / "results" / "heads_real"
DOC = " ".join((ROOT / "docs" / "RESULTS.md").read_text().split("\n"))   # quotes may wrap

pytestmark = pytest.mark.skipif(not (RAW / "analysis.json").is_file(), reason="the study's raw files are not here")


def _cv(imp):
  imp = np.asarray(imp, np.float64)
  return imp.std(-1) / imp.mean(-1)


def test_analysis_numbers():
  a = json.loads((RAW / "analysis.json").read_text())
  imp = np.asarray(a["importance"])
  rnd = np.asarray(a["random_init"][0]["importance"])
  assert imp.shape == (30, 9) and a["documents"] == 512 >= 500
  assert f"**{_cv(imp).mean():.4f}**" in DOC and f"| {_cv(rnd).mean():.4f} |" in DOC
  assert f"{(imp < 0.1).sum()} of 270 (min {imp.min():.3f})" in DOC
  cv = _cv(imp)
  assert f"layers 0–11 ≤ {cv[:12].max():.2f}; layers 12–29 {cv[12:].min():.3f}–{cv[12:].max():.3f}" in DOC
  assert f"{a['rows']} rows, {a['eval_tokens']:,} scored tokens, val BPB {a['val_bpb']:.3f}" in DOC
  assert f"all {rnd.min():.3f}–{rnd.max():.3f}" in DOC and f"≤ {_cv(rnd).max():.3f}" in DOC
  fta = np.asarray(a["first_token_attention_per_head"])
  assert f"{(fta > 0.75).sum()} heads with first-token attention above 0.75 on the first {a['diagnostic_rows']} rows" \
      in DOC


def _shared():
  imp0 = np.asarray(json.loads((RAW / "analysis.json").read_text())["importance"])
  shared = np.zeros(imp0.shape, bool)
  np.put_along_axis(shared, np.argsort(-imp0, axis=-1)[:, :2], True, axis=-1)
  return shared


def _roles(imp, shared):
  imp = np.asarray(imp, np.float64)
  routed = imp[~shared].reshape(imp.shape[0], -1)
  return {"imbalance": _cv(imp).mean(), "shared": imp[shared].mean(), "routed": routed.mean(),
          "cv": (routed.std(-1) / routed.mean(-1)).mean()}


def test_finetuning_rows():
  shared = _shared()
  recs = [json.loads(p.read_text()) for p in sorted((RAW / "raw").glob("*/record.json"))]
  recs.append({"name": "before fine-tuning", **json.loads((RAW / "before.json").read_text())})
  for r in recs:
    row = re.search(rf"\| {re.escape(r['name'])} \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \| ([^|]+) \|", DOC)
    assert row, r["name"]
    want = _roles(r["importance"], shared)
    got = [float(row.group(i)) for i in range(1, 6)]
    assert got == pytest.approx([want["imbalance"], r["val_loss"], want["shared"], want["routed"], want["cv"]],
                                abs=6e-5), r["name"]


def _holm(p):
  order = np.argsort(p)
  out, run = np.empty(len(p)), 0.0
  for k, i in enumerate(order):
    run = max(run, min(1.0, p[i] * (len(p) - k)))
    out[i] = run
  return out


def test_thirty_step_effects_table():
  """Every cell of the 30-step LoRA effects table, from the runs' records: per-seed differences, mean, t-interval
  (scipy's t quantile), the paired t p (scipy.stats.ttest_rel) and Holm over the table's tests."""
  shared = _shared()
  m = lambda name: _roles(json.loads((RAW / "raw" / name / "record.json").read_text())["importance"], shared) | {
      "loss": json.loads((RAW / "raw" / name / "record.json").read_text())["val_loss"]}
  names = {"base": "base", "eq7": "eq. 7", "eq8": "eq. 8"}
  what = {"loss": "held-out loss (nats/token)", "imbalance": "head imbalance", "shared": "shared heads' importance",
          "routed": "routed heads' importance", "cv": "routed heads' CV"}
  rows, ps = [], []
  for t, c in (("eq8", "eq7"), ("eq7", "base"), ("eq8", "base")):
    for key, w in what.items():
      a = [m(f"{t}_lora_s{s}")[key] for s in range(3)]
      b = [m(f"{c}_lora_s{s}")[key] for s in range(3)]
      d = np.subtract(a, b)
      half = sps.t.ppf(0.975, 2) * d.std(ddof=1) / np.sqrt(3)
      p = sps.ttest_rel(a, b).pvalue
      rows.append((f"{names[t]} − {names[c]}, {w}", d, half, p))
      ps.append(p)
  lines = [ln for ln in (ROOT / "docs" / "RESULTS.md").read_text().splitlines()]
  start = next(i for i, ln in enumerate(lines) if ln.startswith("| effect (LoRA, 30 steps) |"))
  table = [ln for ln in lines[start + 2:start + 2 + len(rows)]]
  assert table[0].startswith("| eq. 8 − eq. 7, held-out loss")          # the paper's contrast first
  for (label, d, half, p), hp, line in zip(rows, _holm(np.array(ps)), table, strict=True):
    mean = d.mean()
    assert line == (f"| {label} | {', '.join(f'{x:+.4f}' for x in d)} | {mean:+.4f} | {mean - half:+.4f} … "
                    f"{mean + half:+.4f} | {p:.2g} | {hp:.2g} |"), label


def test_thirty_step_provenance():
  """The commit, the dirty files, the interrupted full run and the run times quoted are those of the records."""
  files = {"analysis.json": RAW / "analysis.json", "before.json": RAW / "before.json"}
  files |= {f"raw/{p.parent.name}/record.json": p for p in (RAW / "raw").glob("*/record.json")}
  recs = {k: json.loads(p.read_text()) for k, p in files.items()}
  assert {r["commit"] for r in recs.values()} == {"9125455423bd"} and "commit `9125455423bd`" in DOC
  dirty = sorted(k for k, r in recs.items() if r["dirty"])
  assert dirty == ["analysis.json", "before.json", "raw/base_lora_s0/record.json"]
  assert "`analysis.json`, `before.json` and `raw/base_lora_s0/record.json` are marked **dirty**" in DOC
  steps = [json.loads(ln)["step"] for ln in (RAW / "raw" / "base_full_s0" / "metrics.jsonl").read_text().splitlines()
           if ln.strip() and "step" in json.loads(ln)]
  full = {n: recs[f"raw/{n}_full_s0/record.json"]["train_seconds"] for n in ("base", "eq7", "eq8")}
  assert f"starts at step {steps[0]}" in DOC and f"`train_seconds` ({full['base']:.0f} s)" in DOC
  assert f"against {full['eq7']:.0f} and {full['eq8']:.0f} s" in DOC
  lora = sorted(r["train_seconds"] for k, r in recs.items() if "_lora_" in k)
  assert f"Training time per LoRA run: {lora[0]:.0f}–{lora[-2]:.0f} s, one {lora[-1]:.0f} s (base_lora_s0)" in DOC
  assert recs["raw/base_lora_s0/record.json"]["train_seconds"] == lora[-1]


def test_full_finetuning_check():
  """The one-seed full fine-tuning differences quoted (routed CV, imbalance, held-out loss, shared heads), from the
  raw records with the shared heads chosen here: the top 2 per layer of the pretrained importance."""
  imp0 = np.asarray(json.loads((RAW / "analysis.json").read_text())["importance"])
  shared = np.zeros(imp0.shape, bool)
  np.put_along_axis(shared, np.argsort(-imp0, axis=-1)[:, :2], True, axis=-1)

  def stats(name):
    r = json.loads((RAW / "raw" / name / "record.json").read_text())
    imp = np.asarray(r["importance"], np.float64)
    routed = imp[~shared].reshape(imp.shape[0], -1)
    return {"cv": (routed.std(-1) / routed.mean(-1)).mean(), "imb": _cv(imp).mean(), "loss": r["val_loss"],
            "shared": imp[shared].mean()}

  base = stats("base_full_s0")
  d = {arm: {k: v - base[k] for k, v in stats(f"{arm}_full_s0").items()} for arm in ("eq7", "eq8")}
  fmt = lambda x: f"{x:+.3f}".replace("-", "−")
  assert f"(eq. 7 {fmt(d['eq7']['cv'])}, eq. 8 {fmt(d['eq8']['cv'])})" in DOC
  assert f"imbalance ({fmt(d['eq7']['imb'])}, {fmt(d['eq8']['imb'])})" in DOC
  assert f"held-out loss ({fmt(d['eq7']['loss'])}, {fmt(d['eq8']['loss'])} nats/token)" in DOC
  assert f"(eq. 7 {fmt(d['eq7']['shared'])}, eq. 8 {fmt(d['eq8']['shared'])})" in DOC


# ------------------------------------------------------------------------------------ the one-epoch study

EPOCH = ROOT / "docs" / "results" / "heads_pinning"
FULL = ROOT / "docs" / "results" / "heads_pinning_full"          # the same study with every weight trained
LINES = (ROOT / "docs" / "RESULTS.md").read_text().splitlines()
KEYS = {"held-out loss (nats/token)": "val_loss", "head imbalance (eq. 6)": "imbalance",
        "shared heads' importance": "shared_importance", "routed heads' importance": "routed_importance",
        "routed heads' CV": "routed_cv", "mean importance": "mean_importance"}
epoch = pytest.mark.skipif(not (EPOCH / "nll_step0.json").is_file(), reason="the one-epoch study's files are not here")
full = pytest.mark.skipif(not (FULL / "nll_step0.json").is_file(), reason="the full fine-tuning study's files are not here")


def _table(header: str) -> list[list[str]]:
  start = next(i for i, ln in enumerate(LINES) if ln.startswith(header))
  out = []
  for ln in LINES[start + 2:]:
    if not ln.startswith("|"):
      break
    out.append([c.strip() for c in ln.strip().strip("|").split("|")])
  return out


def _nll(name: str, step: int, root: pathlib.Path = EPOCH) -> dict:
  d = json.loads((root / ("nll_step0.json" if step == 0 else f"raw/{name}/nll_step{step}.json")).read_text())
  d = dict(d)
  d["val_loss"] = list(np.asarray(d["nll_sum"]) / np.asarray(d["tokens"]))    # recomputed, not read
  return d


def _records(root: pathlib.Path = EPOCH) -> dict:
  return {p.parent.name: json.loads(p.read_text()) for p in sorted((root / "raw").glob("*/record.json"))}


def _fmt_p(p: float) -> str:
  return f"{p:.2g}" if p >= 1e-4 else f"{p:.1e}"


@epoch
def test_epoch_provenance():
  """One commit, none dirty, the same steps in every run, the run times quoted, and what ran."""
  recs = _records()
  study = [json.loads((EPOCH / f).read_text()) for f in ("shared_heads.json", "nll_step0.json")]
  commits = {r["commit"] for r in list(recs.values()) + study}
  assert len(commits) == 1 and f"commit `{commits.pop()}`" in DOC
  assert not any(r["dirty"] for r in list(recs.values()) + study) and "none dirty" in DOC
  steps = {r["steps"] for r in recs.values()}
  assert len(steps) == 1
  n = steps.pop()
  t = sorted(r["train_seconds"] for r in recs.values())
  assert f"{len(recs)} LoRA runs of {n} steps" in DOC and f"{t[0]:.0f}–{t[-1]:.0f} s of training per run" in DOC
  for name, r in recs.items():
    assert r["lora_rank"] == 16 and name in DOC
    if r["dropped_interrupted"]:      # made again from step 0 after an interruption: the docs must say which
      assert f"{name} was part way" in " ".join(DOC.split()) and "`dropped_interrupted: true`" in DOC, name
    files = sorted(p.name for p in (EPOCH / "raw" / name).glob("*nll*"))
    assert len(files) >= 3 and f"nll_step{n}.json" in files, name


@epoch
def test_epoch_effects_table():
  """Every effect row: the mean over seeds of the per-seed mean differences, the t-interval and paired t p (scipy),
  the document-level interval and p (a bootstrap and a sign-flip test written here, numpy, another seed: within
  Monte-Carlo tolerance), and both Holm columns (recomputed here)."""
  _check_effects("| effect | mean |", EPOCH, "lora")


@full
def test_full_epoch_effects_table():
  """The same for full fine-tuning (one seed per arm: no t; the documents' columns and their Holm)."""
  _check_effects("| effect, full fine-tuning | mean |", FULL, "full")


@full
def test_full_epoch_curve_table():
  _check_curve("| full fine-tuning: arm @ step |", FULL, "full")


@full
def test_full_epoch_provenance():
  """One clean commit for the whole full fine-tuning study, quoted; every weight trained (lora_rank 0) at the quoted
  learning rate for the same steps as the LoRA study; the run times quoted from the records; the nll files kept."""
  recs = _records(FULL)
  study = [json.loads((FULL / f).read_text()) for f in ("shared_heads.json", "nll_step0.json")]
  commits = {r["commit"] for r in list(recs.values()) + study}
  assert len(commits) == 1 and f"full fine-tuning study: commit `{commits.pop()}`" in DOC
  assert not any(r["dirty"] for r in list(recs.values()) + study)
  assert {(r["kind"], r["lora_rank"], r["adamw_lr"], r["steps"]) for r in recs.values()} == {
      ("full", 0, 3e-5, next(iter(_records().values()))["steps"])}
  t = sorted(r["train_seconds"] for r in recs.values())
  assert f"{len(recs)} full fine-tuning runs" in DOC and f"{t[0]:.0f}–{t[-1]:.0f} s of training per run" in DOC
  for name, r in recs.items():
    assert not r["dropped_interrupted"] and name in DOC
    files = sorted(p.name for p in (FULL / "raw" / name).glob("*nll*"))
    assert len(files) >= 3 and f"nll_step{r['steps']}.json" in files, name


def _check_effects(header: str, root: pathlib.Path, kind: str):
  recs = _records(root)
  end = next(iter(recs.values()))["steps"]
  title = {"base": "base", "eq7": "eq. 7", "eq8": "eq. 8"}
  rows = _table(header)
  assert rows and rows[0][0].startswith("eq. 8 − eq. 7")                  # the paper's contrast first
  rng = np.random.default_rng(12345)
  pt, pd_printed, pd_holm, pt_holm = [], [], [], []
  for row in rows:
    label, metric = row[0].split(", ", 1)
    t, c = [k for v in label.split(" − ") for k, x in title.items() if x == v]
    key = KEYS[metric]
    seeds = sorted(r["seed"] for r in recs.values() if r["arm"] == t and f"{c}_{kind}_s{r['seed']}" in recs)
    a = [np.asarray(_nll(f"{t}_{kind}_s{s}", end, root)[key]) for s in seeds]
    b = [np.asarray(_nll(f"{c}_{kind}_s{s}", end, root)[key]) for s in seeds]
    per_seed = np.array([x.mean() - y.mean() for x, y in zip(a, b)])
    assert row[1] == f"{per_seed.mean():+.4f}", row
    if len(seeds) >= 2:
      half = sps.t.ppf(0.975, len(seeds) - 1) * per_seed.std(ddof=1) / np.sqrt(len(seeds))
      assert row[2] == f"[{per_seed.mean() - half:+.4f}, {per_seed.mean() + half:+.4f}]", row
      p = sps.ttest_1samp(per_seed, 0).pvalue
      assert row[3] == _fmt_p(p), row
      pt.append(p)
      pt_holm.append(row[4])
    else:
      assert row[2] == row[3] == row[4] == "—"
    d = np.mean([x - y for x, y in zip(a, b)], axis=0)
    boot = np.array([rng.choice(d, d.size).mean() for _ in range(4000)])
    lo, hi = np.quantile(boot, [0.025, 0.975])
    got = [float(x) for x in row[5].strip("[]").split(", ")]
    width = max(hi - lo, 1e-9)
    assert abs(got[0] - lo) < 0.1 * width and abs(got[1] - hi) < 0.1 * width, row
    flips = np.abs((rng.choice([-1.0, 1.0], (4000, d.size)) * d).mean(1))
    p_mc = (np.sum(flips >= abs(d.mean()) * (1 - 1e-12)) + 1) / (4000 + 1)
    assert abs(float(row[6]) - p_mc) < max(0.02, 0.25 * p_mc), row
    pd_printed.append(float(row[6]))
    pd_holm.append(row[7])
  assert [_fmt_p(p) for p in _holm(np.array(pd_printed))] == [_fmt_p(float(x)) for x in pd_holm]
  if pt:
    assert [_fmt_p(p) for p in _holm(np.array(pt))] == pt_holm


@epoch
def test_epoch_curve_table():
  """Every cell of the curve: per arm and step, the mean over seeds of each run's mean over documents."""
  _check_curve("| arm @ step |", EPOCH, "lora")


def _check_curve(first: str, root: pathlib.Path, kind: str):
  recs = _records(root)
  rows = _table(first)
  header = next(ln for ln in LINES if ln.startswith(first))
  cols = [c.strip() for c in header.strip().strip("|").split("|")][2:]
  assert rows
  for row in rows:
    arm, step = row[0].split("@")
    seeds = sorted(r["seed"] for r in recs.values() if r["arm"] == arm)
    assert row[1] == str(len(seeds))
    files = [_nll(f"{arm}_{kind}_s{s}", int(step), root) for s in seeds]
    for col, cell in zip(cols, row[2:], strict=True):
      assert cell == f"{np.mean([np.mean(f[KEYS[col]]) for f in files]):.4f}", (row[0], col)


@pytest.mark.skipif(not (ROOT / "docs" / "results" / "null_arm" / "null.json").is_file(), reason="no null.json")
def test_null_check_quoted():
  """The null-arm check's figures quoted in RESULTS.md, from docs/results/null_arm/null.json."""
  rec = json.loads((ROOT / "docs" / "results" / "null_arm" / "null.json").read_text())
  assert not rec["dirty"] and f"`{rec['commit']}`" in DOC
  cell = lambda c: "bit-identical" if c["bit_identical"] else f"{c['max_abs_diff']:.2g}"
  for r in rec["runs"]:
    last, first = r[f"after_step_{rec['steps']}"], r["after_step_1"]
    assert (f"| {r['optimizer']} | {r['attention']} | {r['label']} | {cell(last)} | {cell(first)} | "
            f"{last['elements_differing']:,} of {last['elements']:,} |") in DOC, r
  assert all(r[f"after_step_{rec['steps']}"]["bit_identical"] for r in rec["runs"] if r["aux_weight"] == 0)
