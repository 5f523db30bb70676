"""docs/RESULTS.md's real-model numbers recomputed from the study's raw files (docs/results/heads_real/), with numpy
and scipy written here (not the study's code): the imbalance (eq. 6 as the mean over layers of std / mean across
heads), the counts and ranges quoted, every column of each fine-tuning run's row (imbalance, held-out loss, shared /
routed heads' importance, routed CV, with the shared heads chosen here), every cell of the 30-step effects table
(per-seed differences, mean, t-interval, paired t p, Holm p), and the provenance quoted (commit, dirty files, the
interrupted run, run times). For the one-epoch studies (docs/results/heads_pinning*/): every cell of the effects
tables (t over seeds, bootstrap and sign-flip over documents, the crossed seed x document test by dummy-variable
least squares, Holm over the family named) and of the curves, the setup quoted against the runs' configs and logged
learning rates, the readings' numbers, and the figures' links; and the null arm's figures (null.json)."""
import json
import pathlib
import re

import numpy as np
import pytest
from scipy import stats as sps

ROOT = pathlib.Path(__file__).resolve().parents[1]
RAW = ROOT / "docs" / "results" / "heads_real"
DOC = " ".join((ROOT / "docs" / "RESULTS.md").read_text().split("\n"))   # quotes may wrap
PROSE = " ".join(DOC.split())                                                # and be indented

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
  dropped = sorted(n for n, r in recs.items() if r["dropped_interrupted"])
  assert dropped == ["eq7_full_s1"] and "eq7_full_s1 was interrupted and the study dropped it" in PROSE
  for name, r in recs.items():
    assert name in DOC
    files = sorted(p.name for p in (FULL / "raw" / name).glob("*nll*"))
    assert len(files) >= 3 and f"nll_step{r['steps']}.json" in files, name


def _mean_squares(table) -> dict:
  """{seed, doc, resid: (mean square, df)} of a seeds x documents table: the mean squares as drops in the residual
  sum of squares of dummy-variable least-squares fits (numpy)."""
  S, D = table.shape
  y = table.ravel()
  seed = np.kron(np.eye(S), np.ones((D, 1)))[:, 1:]
  doc = np.kron(np.ones((S, 1)), np.eye(D))[:, 1:]

  def rss(*blocks):
    x = np.column_stack([np.ones(y.size), *blocks])
    return float(((y - x @ np.linalg.lstsq(x, y, rcond=None)[0]) ** 2).sum())
  full = rss(seed, doc)
  return {"seed": ((rss(doc) - full) / (S - 1), S - 1), "doc": ((rss(seed) - full) / (D - 1), D - 1),
          "resid": (full / ((S - 1) * (D - 1)), (S - 1) * (D - 1))}


def _crossed(table):
  """The crossed seed x document test written here: the mean squares (_mean_squares), the grand mean's variance
  (MS_seed + MS_doc - MS_resid)/(SD) with a component estimated below 0 dropped, Satterthwaite's df, the t interval
  and p (scipy's t)."""
  S, D = table.shape
  y = table.ravel()
  ms = _mean_squares(table)
  coef = {"seed": float(ms["seed"][0] > ms["resid"][0]), "doc": float(ms["doc"][0] > ms["resid"][0])}
  coef["resid"] = 1 - coef["seed"] - coef["doc"]
  v = sum(coef[k] * ms[k][0] for k in ms)
  df = v ** 2 / sum((coef[k] * ms[k][0]) ** 2 / ms[k][1] for k in ms if coef[k])
  se = np.sqrt(v / (S * D))
  half = sps.t.ppf(0.975, df) * se
  return y.mean() - half, y.mean() + half, df, 2 * sps.t.sf(abs(y.mean()) / se, df)


def _check_effects(header: str, root: pathlib.Path, kind: str):
  """Every cell of an effects table; Holm per column over the family the section names (eq. 8 − eq. 7 and eq. 7 −
  base, every metric but the mean importance), "—" outside it."""
  recs = _records(root)
  end = next(iter(recs.values()))["steps"]
  title = {"base": "base", "eq7": "eq. 7", "eq8": "eq. 8"}
  rows = _table(header)
  assert rows and rows[0][0].startswith("eq. 8 − eq. 7") and len(rows) == 18     # the paper's contrast first
  rng = np.random.default_rng(12345)
  family = {"t": [], "doc": [], "crossed": []}
  for row in rows:
    label, metric = row[0].split(", ", 1)
    t, c = [k for v in label.split(" − ") for k, x in title.items() if x == v]
    key = KEYS[metric]
    in_family = (t, c) in (("eq8", "eq7"), ("eq7", "base")) and key != "mean_importance"
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
      lo, hi, df, pc = _crossed(np.array([x - y for x, y in zip(a, b)]))
      assert row[8:11] == [f"[{lo:+.4f}, {hi:+.4f}]", f"{df:.1f}", _fmt_p(pc)], row
      if in_family:
        family["t"].append((p, row[4]))
        family["crossed"].append((pc, row[11]))
    else:
      assert row[2] == row[3] == row[4] == row[8] == row[9] == row[10] == row[11] == "—", row
    d = np.mean([x - y for x, y in zip(a, b)], axis=0)
    boot = np.array([rng.choice(d, d.size).mean() for _ in range(4000)])
    lo, hi = np.quantile(boot, [0.025, 0.975])
    got = [float(x) for x in row[5].strip("[]").split(", ")]
    width = max(hi - lo, 1e-9)
    assert abs(got[0] - lo) < 0.1 * width and abs(got[1] - hi) < 0.1 * width, row
    flips = np.abs((rng.choice([-1.0, 1.0], (4000, d.size)) * d).mean(1))
    p_mc = (np.sum(flips >= abs(d.mean()) * (1 - 1e-12)) + 1) / (4000 + 1)
    assert abs(float(row[6]) - p_mc) < max(0.02, 0.25 * p_mc), row
    if in_family:
      family["doc"].append((float(row[6]), row[7]))
    else:
      assert row[4] == row[7] == row[11] == "—", row
  assert len(family["doc"]) == 10
  for col, pairs in family.items():
    if pairs:
      assert [_fmt_p(p) for p in _holm(np.array([p for p, _ in pairs]))] == [h for _, h in pairs], col


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


NULLS = [ROOT / "docs" / "results" / d / "null.json" for d in ("null_arm", "null_arm_lambda1e-4")]


@pytest.mark.parametrize("path", NULLS, ids=["null_arm", "lambda1e-4"])
def test_null_check_quoted(path):
  """The null-arm checks' tables in RESULTS.md, from their null.json files: every row, the commit (clean), λ = 0
  again bit-identical; where the file records it, every run the same program as its setup's first λ = 0."""
  if not path.is_file():
    pytest.skip(f"no {path}")
  rec = json.loads(path.read_text())
  assert not rec["dirty"] and f"`{rec['commit']}`" in DOC and f"`docs/results/{path.parent.name}/null.json`" in DOC
  cell = lambda c: "bit-identical" if c["bit_identical"] else f"{c['max_abs_diff']:.2g}"
  for r in rec["runs"]:
    last, first = r[f"after_step_{rec['steps']}"], r["after_step_1"]
    assert (f"| {r['optimizer']} | {r['attention']} | {r['label']} | {cell(last)} | {cell(first)} | "
            f"{last['elements_differing']:,} of {last['elements']:,} |") in DOC, r
    assert r.get("same_program", True), r
  assert all(r[f"after_step_{rec['steps']}"]["bit_identical"] for r in rec["runs"] if r["aux_weight"] == 0)


def test_null_arm_prose():
  """The first-step differences quoted in the null arm's prose (AdamW and Muon at λ = 1e-30, Muon at 1e-8 and 1e-4)
  are those of the two null.json files."""
  if not all(p.is_file() for p in NULLS):
    pytest.skip("no null.json")
  runs = {(r["optimizer"], r["attention"], r["aux_weight"]): r for p in NULLS
          for r in json.loads(p.read_text())["runs"]}
  step1 = lambda o, a, lam: runs[o, a, lam]["after_step_1"]["max_abs_diff"]    # noqa: E731
  assert (f"differ by {step1('adamw', 'vanilla', 1e-30):.1e} (vanilla) and {step1('adamw', 'gated', 1e-30):.1e} "
          "(gated)") in PROSE
  assert (f"its first-step difference, {step1('muon', 'vanilla', 1e-30):.1e} vanilla and "
          f"{step1('muon', 'gated', 1e-30):.1e} gated,") in PROSE
  assert f"at λ = 1e-30 the first step moves by {step1('muon', 'vanilla', 1e-30):.1e} / " \
         f"{step1('muon', 'gated', 1e-30):.1e}" in PROSE
  assert "4e-9" not in PROSE and "~1e-23" not in PROSE
  m4 = max(step1("muon", a, 1e-4) for a in ("vanilla", "sink", "gated"))
  m8 = max(step1("muon", a, 1e-8) for a in ("vanilla", "gated"))
  assert f"by up to {m4:.2f} at λ = 1e-4 and {m8:.2f} at λ = 1e-8 against λ = 0" in PROSE
  assert (f"by up to {step1('muon', 'vanilla', 1e-4):.2f} for vanilla and {step1('muon', 'sink', 1e-4):.2f} for sink "
          "against λ = 0") in PROSE


def _signed(x: float, nd: int = 4) -> str:
  return f"{x:+.{nd}f}".replace("-", "−")


def _doc_table(root, t, c, kind, step, key):
  """The seeds x documents table of per-document differences treated − control at `step`."""
  seeds = sorted(r["seed"] for r in _records(root).values() if r["arm"] == t)
  return np.array([np.asarray(_nll(f"{t}_{kind}_s{s}", step, root)[key]) - np.asarray(
      _nll(f"{c}_{kind}_s{s}", step, root)[key]) for s in seeds])


def _curve(root, arm, kind, step, key):
  seeds = sorted(r["seed"] for r in _records(root).values() if r["arm"] == arm)
  return np.mean([np.mean(_nll(f"{arm}_{kind}_s{s}", step, root)[key]) for s in seeds])


@epoch
def test_epoch_setup_as_quoted():
  """The budget, the schedule and this study's column of the differences table are the runs' own config.yaml,
  metrics.jsonl and evaluation files: no "paper's budget", no warmup (the lr falls from step 1)."""
  import yaml
  assert "the paper's budget" not in PROSE and "warmup steps" not in PROSE and "App. D at the paper's" not in PROSE
  recs = _records()
  cfgs = {n: yaml.safe_load((EPOCH / "raw" / n / "config.yaml").read_text()) for n in recs}
  steps = {r["steps"] for r in recs.values()}.pop()
  c = next(iter(cfgs.values()))
  assert {(x["lora"]["rank"], x["lora"]["alpha"], tuple(x["lora"]["targets"]), x["data"]["seq_len"],
           x["train"]["batch_size"], x["train"]["adamw_lr"], x["train"]["decay_frac"]) for x in cfgs.values()} == {
      (16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj"), 128, 4, 1e-3, 1.0)}
  rows = c["train"]["batch_size"]
  assert (f"{steps} steps × {rows} rows × {c['data']['seq_len']} = {steps * rows * c['data']['seq_len']:,} token "
          "positions") in PROSE
  assert f"({steps} steps of {rows} × {c['data']['seq_len']} tokens" in PROSE
  assert f"LoRA rank {c['lora']['rank']} / alpha {c['lora']['alpha']:g} on q/k/v/o" in PROSE
  m, H = cfgs["eq8_lora_s0"]["loss"]["num_shared_heads"], c["model"]["num_heads"]
  assert f"m = {m} of {H} per layer, this project's choice" in PROSE and f"{c['model']['num_layers']} layers × {H} query" in PROSE
  eq8 = cfgs["eq8_lora_s0"]["loss"]
  assert (eq8["aux_weight"], eq8["num_shared_heads"], cfgs["eq7_lora_s0"]["loss"]["num_shared_heads"],
          cfgs["base_lora_s0"]["loss"]["aux_weight"]) == (1e-2, 2, 0, 0.0)
  s0 = json.loads((EPOCH / "nll_step0.json").read_text())
  assert s0["documents"] == 64 and s0["documents_cut"] == 0 and max(np.asarray(s0["tokens"])) + 1 <= 209
  assert f"at most {s0['doc_tokens'] + 1} tokens" in PROSE and f"per-head importance on {s0['documents']} held-out" in PROSE
  for n in recs:                     # no warmup: the lr is the peak at step 1 and falls at every logged step
    lr = [(r["step"], r["lr"]) for r in map(json.loads, (EPOCH / "raw" / n / "metrics.jsonl").read_text().splitlines())
          if "lr" in r]
    assert lr[0][0] == 1 and lr[0][1] == pytest.approx(1e-3) and all(b[1] < a[1] for a, b in zip(lr, lr[1:])), n
  lr5 = dict(lr)[5]
  assert f"the records' lr is 1e-3 at step 1 and {lr5 * 1e4:.2f}e-4 at step 5" in PROSE
  corpus = json.loads((EPOCH / "corpus.json").read_text())
  assert f"{corpus['train']['documents']} English documents" in PROSE
  assert f"one epoch of the {corpus['train']['documents']} documents" in PROSE
  seeds = lambda root: {len([r for r in _records(root).values() if r["arm"] == a]) for a in ("base", "eq7", "eq8")}
  n_lora, n_full = seeds(EPOCH), seeds(FULL)
  assert len(n_lora) == len(n_full) == 1
  word = lambda n: f"{n} seed{'s' if n > 1 else ''} per arm"                 # noqa: E731
  assert f"| {word(n_lora.pop())} (LoRA); {word(n_full.pop())} (full fine-tuning) |" in DOC
  e = sorted(r["eval_seconds"] for r in recs.values())
  assert f"{e[0]:.0f}–{e[-1]:.0f} s for its three evaluations" in PROSE and all(len(r["eval_steps"]) == 3
                                                                                  for r in recs.values())


@epoch
def test_epoch_readings_quoted():
  """The numbers of the LoRA readings that are not cells of its tables, from the raw files: the crossed intervals
  quoted, the shared heads against base and against the pretrained model, the routed CV at step 30, the heads that
  rise and fall in layers 12–29, and the ratios."""
  end = next(iter(_records().values()))["steps"]
  cr = lambda t, c, key, step=end: _crossed(_doc_table(EPOCH, t, c, "lora", step, key))
  lo, hi, _, p = cr("eq8", "eq7", "val_loss")
  assert f"crossed interval {_signed(lo)} … {_signed(hi)}, p {_fmt_p(p)}" in PROSE
  lo, hi, _, p = cr("eq8", "base", "shared_importance")
  assert f"not detected, interval {_signed(lo)} … {_signed(hi)}" in PROSE and f"(crossed p {_fmt_p(p)};" in PROSE
  eq7_shared = _doc_table(EPOCH, "eq7", "base", "lora", end, "shared_importance").mean()
  assert f"its far end is {abs(hi / eq7_shared) * 100:.0f} % of eq. 7's {_signed(eq7_shared)}" in PROSE
  full_shared = _doc_table(FULL, "eq8", "base", "full", end, "shared_importance").mean()   # "holds full FT's +0.0015"
  assert lo < 0 < full_shared < hi and f"also holds full fine-tuning's detected {_signed(full_shared)}" in PROSE
  pre = _curve(EPOCH, "base", "lora", 0, "shared_importance")
  assert (f"{pre:.4f} → {_curve(EPOCH, 'eq8', 'lora', end, 'shared_importance'):.4f} (eq. 8) and → "
          f"{_curve(EPOCH, 'base', 'lora', end, 'shared_importance'):.4f} (base)") in PROSE
  d30 = _doc_table(EPOCH, "eq8", "eq7", "lora", 30, "routed_cv")
  t = sps.ttest_1samp(d30.mean(1), 0)
  ci = t.confidence_interval(0.95)
  lo, hi, _, _ = _crossed(d30)
  assert (f"at step 30 of this study the contrast is already {_signed(d30.mean())} (over seeds {_signed(ci.low)} … "
          f"{_signed(ci.high)}, p {_fmt_p(t.pvalue)}; crossed {_signed(lo)} … {_signed(hi)})") in PROSE
  lo, hi, _, p = cr("eq7", "base", "mean_importance")
  ratio = _doc_table(EPOCH, "eq7", "base", "lora", end, "mean_importance").mean() / _doc_table(
      EPOCH, "eq8", "base", "lora", end, "mean_importance").mean()
  assert f"(crossed {_signed(lo)} … {_signed(hi)}, p {_fmt_p(p)}; outside Holm's family), {ratio:.1f} times" in PROSE
  costs = [cr(t, "base", "val_loss")[:2] for t in ("eq7", "eq8")]
  assert (f"(crossed {_signed(costs[0][0])} … {_signed(costs[0][1])} and {_signed(costs[1][0])} … "
          f"{_signed(costs[1][1])})") in PROSE
  moved = _moved(EPOCH)
  assert (f"eq. 7 lowers {moved['eq7'][0]} of the {moved['shared']} shared heads and raises {moved['eq7'][1]} of the "
          f"{moved['routed']} routed ones against the pretrained model (base: {moved['base'][0]} and "
          f"{moved['base'][1]}; eq. 8: {moved['eq8'][0]} and {moved['eq8'][1]})") in PROSE


def _moved(root):
  """In layers 12–29: per arm, (shared heads lowered, routed heads raised) against the pretrained model, from the
  mean over seeds of the end's importance maps; the shared heads as the top 2 of shared_heads.json."""
  recs = _records(root)
  end = next(iter(recs.values()))["steps"]
  kind = next(iter(recs.values()))["kind"]
  pre = np.asarray(json.loads((root / "nll_step0.json").read_text())["importance"])
  shared = np.zeros(pre.shape, bool)
  np.put_along_axis(shared, np.argsort(-np.asarray(json.loads((root / "shared_heads.json").read_text())[
      "importance"]), -1)[:, :2], True, -1)
  out = {"shared": int(shared[12:].sum()), "routed": int((~shared[12:]).sum())}
  for arm in ("base", "eq7", "eq8"):
    seeds = sorted(r["seed"] for r in recs.values() if r["arm"] == arm)
    d = np.mean([_nll(f"{arm}_{kind}_s{s}", end, root)["importance"] for s in seeds], axis=0)[12:] - pre[12:]
    out[arm] = (int((d[shared[12:]] < 0).sum()), int((d[~shared[12:]] > 0).sum()))
  return out


@full
def test_full_readings_quoted():
  """The full fine-tuning readings' numbers that are not table cells: eq. 8 − base on the shared heads over documents,
  the shared heads against the pretrained model, and eq. 7's heads in layers 12–29."""
  end = next(iter(_records(FULL).values()))["steps"]
  table = _doc_table(FULL, "eq8", "base", "full", end, "shared_importance")
  low, high, _, p = _crossed(table)
  assert f"**eq. 8's shared heads against base: {_signed(table.mean())}, detected** (crossed {_signed(low)} … " \
         f"{_signed(high)}, p {p:.1e}" in PROSE and p < 0.05
  c = lambda arm, step=end: f"{_curve(FULL, arm, 'full', step, 'shared_importance'):.4f}"  # noqa: E731
  assert f"{c('base', 0)} → {c('eq8')} (eq. 8), → {c('base')} (base), → {c('eq7')} (eq. 7)" in PROSE
  moved = _moved(FULL)
  assert (f"it lowers {moved['eq7'][0]} of the {moved['shared']} shared heads and raises {moved['eq7'][1]} of the "
          f"{moved['routed']} routed ones") in PROSE


@pytest.mark.parametrize("root", [EPOCH, FULL])
def test_pinning_figures_are_linked(root):
  """Both figures of each pinning study are in its directory and linked from RESULTS.md."""
  for name in ("pinning_importance.png", "pinning_curve.png"):
    assert (root / name).is_file() and f"](results/{root.name}/{name})" in PROSE, name


@epoch
def test_epoch_three_tests_agree():
  """"The three tests agree": in the LoRA effects table every effect is detected (p < 0.05) by the t over seeds, the
  documents and the crossed test alike, and the one not detected (eq. 8 − base, shared heads) by none."""
  rows = _table("| effect | mean |")
  for row in rows:
    detected = {float(row[i]) < 0.05 for i in (3, 6, 10)}
    assert detected == {row[0] != "eq. 8 − base, shared heads' importance"}, row
  assert "detect the same effects: all but eq. 8 − base on the shared heads" in PROSE


def _findings_row(start: str) -> list[str]:
  rows = [r for r in _table("| claim | setup as run |") if r[0].startswith(start)]
  assert len(rows) == 1, start
  return rows[0]


def _crossed_ci(root, t, c, kind, key) -> str:
  end = next(iter(_records(root).values()))["steps"]
  tab = _doc_table(root, t, c, kind, end, key)
  lo, hi, _, _ = _crossed(tab)
  return f"{_signed(tab.mean())} [{_signed(lo)}, {_signed(hi)}]"


@full
def test_findings_app_d_rows():
  """The App. D rows of RESULTS.md's findings table: every effect and crossed interval from the two studies' raw
  per-document files (this file's own crossed test), and each verdict's direction against the intervals."""
  both = lambda t, c, key: (_crossed_ci(EPOCH, t, c, "lora", key), _crossed_ci(FULL, t, c, "full", key))  # noqa
  row = _findings_row("[Sink-MoE] App. D: eq. 8 keeps the shared heads higher")
  s, l = both("eq8", "eq7", "shared_importance"), both("eq8", "eq7", "val_loss")
  assert row[2] == (f"eq. 8 − eq. 7: shared heads LoRA {s[0]}, full {s[1]}; held-out loss LoRA {l[0]}, full {l[1]} "
                    "nats/token") and row[4].startswith("held")
  row = _findings_row("[Sink-MoE] App. D: eq. 8 preserves")
  s, c = both("eq8", "base", "shared_importance"), both("eq8", "base", "routed_cv")
  assert row[2] == (f"eq. 8 − base: shared heads LoRA {s[0]}, full {s[1]}; routed heads' CV LoRA {c[0]}, full "
                    f"{c[1]}")
  row = _findings_row("[Sink-MoE] App. D / Fig. 11")
  s, r = both("eq7", "base", "shared_importance"), both("eq7", "base", "routed_importance")
  assert row[2] == f"eq. 7 − base: shared heads LoRA {s[0]}, full {s[1]}; routed heads LoRA {r[0]}, full {r[1]}"
  end = next(iter(_records().values()))["steps"]
  for root, kind in ((EPOCH, "lora"), (FULL, "full")):    # "contradicted": the shared heads' interval lies below 0
    assert _crossed(_doc_table(root, "eq7", "base", kind, end, "shared_importance"))[1] < 0
    assert _crossed(_doc_table(root, "eq8", "base", kind, end, "val_loss"))[0] > 0
  row = _findings_row("[Sink-MoE] Table 2")
  l = both("eq8", "base", "val_loss")
  assert row[2] == f"eq. 8 − base, held-out loss: LoRA {l[0]}, full {l[1]} nats/token"
  assert row[4].startswith("contradicted on the stand-in")
  a = json.loads((RAW / "analysis.json").read_text())
  imp, rnd = np.asarray(a["importance"]), np.asarray(a["random_init"][0]["importance"])
  row = _findings_row("[Sink-MoE] Fig. 4 / App. C")
  assert row[2] == (f"imbalance {_cv(imp).mean():.4f} (random init {_cv(rnd).mean():.4f}); {(imp < 0.1).sum()} of "
                    f"{imp.size} heads with importance below 0.1") and row[1] == f"SmolLM2-135M, {a['documents']} documents"


def _components(table):
  """The crossed model's variance components (seed, document, residual) by the method of moments, from the mean
  squares of _mean_squares."""
  S, D = table.shape
  ms = {k: v[0] for k, v in _mean_squares(table).items()}
  return (ms["seed"] - ms["resid"]) / D, (ms["doc"] - ms["resid"]) / S, ms["resid"]


@full
def test_variance_components_table():
  """Every cell of "What the crossed test covers": per contrast and study σ²_seed, σ²_doc, σ²_resid and the seed's
  share of the mean's variance; and the reading's numbers (the largest shares, the full study's eq. 8 − eq. 7 loss)."""
  rows = _table("| variance components at step 183 |")
  assert len(rows) == 9
  names = {"base": "base", "eq. 7": "eq7", "eq. 8": "eq8"}
  keys = {"held-out loss": "val_loss", "shared heads' importance": "shared_importance", "routed heads' CV": "routed_cv"}
  e = lambda x: "−" + f"{-x:.1e}" if x < 0 else f"{x:.1e}"                    # noqa: E731
  shares = {}
  end = next(iter(_records().values()))["steps"]
  for row in rows:
    label, metric = row[0].split(", ", 1)
    t, c = (names[x] for x in label.split(" − "))
    want = [row[0]]
    for root, kind in ((EPOCH, "lora"), (FULL, "full")):
      vs, vd, vr = _components(_doc_table(root, t, c, kind, end, keys[metric]))
      share = max(vs, 0) / 3 / (max(vs, 0) / 3 + max(vd, 0) / 64 + vr / 192)
      shares[kind, t, c, metric] = share
      want += [e(vs), e(vd), e(vr), f"{100 * share:.0f} %"]
    assert row == want, row[0]
  loss = max(v for k, v in shares.items() if k[3] == "held-out loss")
  assert f"on held-out loss the seed's share of the mean's variance is at most {100 * loss:.0f} %" in PROSE
  top = max(shares.items(), key=lambda kv: kv[1])
  assert top[0] == ("lora", "eq8", "eq7", "shared heads' importance")
  assert f"up to {100 * top[1]:.0f} % of the mean's variance, eq. 8 − eq. 7 on the shared heads" in PROSE
  full = max(v for k, v in shares.items() if k[0] == "full")
  assert f"is at most {100 * full:.0f} % in every row of the components table" in PROSE
  vs, vd, _ = _components(_doc_table(FULL, "eq8", "eq7", "full", end, "val_loss"))
  assert f"σ²_seed {vs:.1e} against σ²_doc {vd:.1e}" in PROSE


@full
def test_per_document_pairing_holds():
  """"every run's nll_step*.json scores the same 64 held-out documents with the same token count per document as
  nll_step0.json, in both studies": the pairing by document the tests over documents rely on."""
  assert "same 64 held-out documents with the same token count per document as `nll_step0.json`, in both studies" \
      in PROSE
  for root in (EPOCH, FULL):
    t0 = json.loads((root / "nll_step0.json").read_text())["tokens"]
    files = sorted((root / "raw").glob("*/nll_step*.json"))
    assert len(t0) == 64 and len(files) == 27
    for f in files:
      assert json.loads(f.read_text())["tokens"] == t0, f
