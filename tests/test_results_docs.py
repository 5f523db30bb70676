"""The numbers and test statistics docs/RESULTS.md, STREAMING.md and TRIGGER.md quote, recomputed from the committed
raw files under docs/results/ with numpy and scipy (ttest_rel, permutation_test, binomtest, ttest_ind with
equal_var=False, the noncentral t), not through `sinkjax.stats` / `paper_report`, which made them: a doc
number that drifts from its source, or a source that changes under a doc, fails here. No training, no model."""
import json
import math
import pathlib
import re

import numpy as np
import pytest
from scipy import optimize
from scipy import stats as sps

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "RESULTS.md"
GRID = ROOT / "docs" / "results" / "paper_cpu" / "results.json"
DOSE_DIR = ROOT / "docs" / "results" / "paper_cpu_dose"
REPRO_DIR = ROOT / "docs" / "results" / "paper_cpu_repro"
VARIANTS = ("vanilla", "sink", "gated")


@pytest.fixture(scope="module")
def doc():
  return DOC.read_text()


@pytest.fixture(scope="module")
def flat(doc):
  """The doc with every run of whitespace one space (quoted phrases may be wrapped)."""
  return " ".join(doc.split())


@pytest.fixture(scope="module")
def runs():
  return json.loads(GRID.read_text())["runs"]


def table(doc: str, first_header: str) -> list[list[str]]:
  """The body rows (cells stripped) of the markdown table whose header row starts with `| first_header`."""
  lines = doc.splitlines()
  for i, line in enumerate(lines):
    if line.startswith(f"| {first_header}"):
      rows = []
      for row in lines[i + 2:]:
        if not row.startswith("|"):
          break
        rows.append([c.strip() for c in row.strip().strip("|").split("|")])
      return rows
  raise AssertionError(f"no table with first header {first_header!r} in {DOC.name}")


def sel(runs, variant, loss):
  return sorted((r for r in runs if r["variant"] == variant and r["loss"] == loss), key=lambda r: r["seed"])


def sign_p(diffs) -> float:
  """Exact two-sided sign test (scipy's binomial test)."""
  return sps.binomtest(sum(d > 0 for d in diffs), len(diffs), 0.5).pvalue


def perm_p(diffs) -> float:
  """Exact paired permutation test over all 2^n sign flips (scipy)."""
  return sps.permutation_test((np.asarray(diffs),), np.mean, permutation_type="samples", n_resamples=np.inf).pvalue


def p2(x: float) -> str:
  return f"{x:.2g}" if x >= 0.001 else f"{x:.1e}"


def detectable(sd: float, n: int) -> float:
  """The true mean difference the two-sided 0.05 paired t-test detects with power 0.8: the noncentral t's
  noncentrality solved by brentq on [0, 15] (n >= 3) (scipy.stats.nct), times sd / sqrt(n)."""
  tc = sps.t.ppf(0.975, n - 1)
  ncp = optimize.brentq(lambda c: sps.nct.sf(tc, n - 1, c) + np.nan_to_num(sps.nct.cdf(-tc, n - 1, c)) - 0.8,
                              0.0, 15.0)
  return ncp * sd / math.sqrt(n)


def seeds_for(effect: float, sd: float) -> int:
  n = 3
  while detectable(sd, n) > effect:
    n += 1
  return n


def paired_cells(treated, control, nd):
  """The cells an effect row prints, from scipy: per seed, mean, 95 % t-interval, paired t p, permutation p, sign
  p, reading."""
  d = np.asarray(treated) - np.asarray(control)
  t = sps.ttest_rel(treated, control)
  ci = t.confidence_interval(0.95)
  f = lambda x: f"{x:+.{nd}f}"
  reading = "detected (paired t)" if t.pvalue < 0.05 else \
      f"not detected (detectable: ±{detectable(d.std(ddof=1), len(d)):.{nd}f})"
  return [", ".join(f(x) for x in d), f(d.mean()), f"{f(ci.low)} … {f(ci.high)}", p2(t.pvalue), p2(perm_p(d)),
          p2(sign_p(d)), reading]


def diffs(runs, variant, key="val_bpb"):
  return [a[key] - b[key] for a, b in zip(sel(runs, variant, "aux"), sel(runs, variant, "base"))]


def rng(xs, nd=3) -> str:
  return f"{min(xs):.{nd}f}–{max(xs):.{nd}f}"


def test_drift_arms_and_their_aux_terms(runs, flat):
  for v in ("vanilla", "sink"):
    d = diffs(runs, v)
    assert f"{v} " + ", ".join(f"{x:+.4f}" for x in d).replace("-", "−") + f" (SD {np.std(d, ddof=1):.4f})" in flat
  assert f"three differences ({np.std(diffs(runs, 'gated'), ddof=1):.4f}, less than an eighth of" in flat
  for v in VARIANTS:                             # lambda * sum_l H * CV_l^2 at the held-out importances
    term = np.mean([1e-4 * 4 * np.sum(np.square(r["cv_per_layer"])) for r in sel(runs, v, "aux")])
    assert f"{term:.1e}" in flat, v


def test_table1_with_its_tests(runs, doc):
  rows = {r[0]: r for r in table(doc, "attention | base | base + aux")}
  for v in VARIANTS:
    b = np.array([r["val_bpb"] for r in sel(runs, v, "base")])
    a = np.array([r["val_bpb"] for r in sel(runs, v, "aux")])
    c = paired_cells(a, b, 4)
    imb = ", ".join(f"{x['head_imbalance']:.3f} → {y['head_imbalance']:.3f}"
                    for x, y in zip(sel(runs, v, "base"), sel(runs, v, "aux")))
    want = [v, f"{b.mean():.4f} ± {b.std(ddof=1):.4f}", f"{a.mean():.4f} ± {a.std(ddof=1):.4f}", *c[:5], imb]
    assert rows[v] == want, v


def test_rerun_table_from_each_runs_own_files(doc, flat):
  """The main grid's rerun: its table and readings recomputed from the 18 runs' own paper_eval.json files (not the
  runner's aggregate results.json, which must agree with them), every run made with one clean commit."""
  r2 = ROOT / "docs" / "results" / "paper_cpu_r2"
  recs, commits = [], set()
  for d in sorted((r2 / "raw").iterdir()):
    variant, loss, seed = d.name.split("_")
    done = json.loads((d / "done.json").read_text())
    commits.add((done["commit"], done["dirty"]))
    assert (d / "metrics.jsonl").stat().st_size > 0 and (d / "config.yaml").is_file()
    recs.append({"variant": variant, "loss": loss, "seed": int(seed[1:]), "name": d.name,
                 **json.loads((d / "paper_eval.json").read_text())})
  assert len(recs) == 18 and commits == {("8d9b2aa5a703", False)}
  agg = json.loads((r2 / "results.json").read_text())["runs"]
  assert {r["name"]: (r["val_bpb"], r["head_imbalance"]) for r in agg} == \
      {r["name"]: (r["val_bpb"], r["head_imbalance"]) for r in recs}
  rows = {r[0]: r for r in table(doc, "attention (rerun) | base")}
  for v in VARIANTS:
    b = np.array([r["val_bpb"] for r in sel(recs, v, "base")])
    a = np.array([r["val_bpb"] for r in sel(recs, v, "aux")])
    imb = ", ".join(f"{x['head_imbalance']:.3f} → {y['head_imbalance']:.3f}"
                    for x, y in zip(sel(recs, v, "base"), sel(recs, v, "aux")))
    assert rows[v] == [v, f"{b.mean():.4f} ± {b.std(ddof=1):.4f}", f"{a.mean():.4f} ± {a.std(ddof=1):.4f}",
                       *paired_cells(a, b, 4)[:5], imb], v
  g, g1 = diffs(recs, "gated"), diffs(json.loads(GRID.read_text())["runs"], "gated")
  assert f"four times as widely (SD {np.std(g, ddof=1):.4f}) as the first grid's ({np.std(g1, ddof=1):.4f})" in flat
  assert round(np.std(g, ddof=1) / np.std(g1, ddof=1)) == 4 and min(g + g1) > 0          # six of six seeds worse
  for v, nd in (("vanilla", 4), ("sink", 4)):
    d = diffs(recs, v)
    assert f"±{detectable(np.std(d, ddof=1), 3):.{nd}f}" in flat, v
  imb = diffs(recs, "gated", "head_imbalance")
  assert ", ".join(f"{x:+.3f}" for x in imb).replace("-", "−") in flat
  assert f"p = {p2(sps.ttest_rel(*[[r['head_imbalance'] for r in sel(recs, 'gated', l)] for l in ('aux', 'base')]).pvalue)}, detectable ±{detectable(np.std(imb, ddof=1), 3):.3f}" in flat
  van = diffs(recs, "vanilla", "head_imbalance")
  assert ", ".join(f"{x:+.1e}" for x in van) in flat and f"by {np.mean(van):+.1e} in every seed" in flat
  assert min(van) > 0


def test_dose_rerun_tables_from_each_runs_own_files(doc):
  """The dose study again on one commit: both tables recomputed with scipy from the 15 runs' own files (λ = 0 and
  1e-4 are the main-grid rerun's gated runs, the others docs/results/paper_cpu_r2_dose/raw/), each run's config
  holding its λ and its done.json the one clean commit."""
  import yaml
  lams = (0.0, 1e-8, 1e-4, 1e-3, 1e-2)
  recs = {}
  for lam in lams:
    for s in range(3):
      name = {0.0: f"gated_base_s{s}", 1e-4: f"gated_aux_s{s}"}.get(lam, f"gated_lam{lam:g}_s{s}")
      d = ROOT / "docs" / "results" / ("paper_cpu_r2" if lam in (0.0, 1e-4) else "paper_cpu_r2_dose") / "raw" / name
      done = json.loads((d / "done.json").read_text())
      assert (done["commit"], done["dirty"]) == ("8d9b2aa5a703", False), name
      cfg = yaml.safe_load((d / "config.yaml").read_text())
      assert cfg["loss"]["aux_weight"] == lam and cfg["train"]["seed"] == s and cfg["model"]["attention"] == "gated"
      assert (d / "metrics.jsonl").stat().st_size > 0
      recs[lam, s] = json.loads((d / "paper_eval.json").read_text())
  levels = {r[0]: r for r in table(doc, "λ (one commit)")}
  for lam in lams:
    b = np.array([recs[lam, s]["val_bpb"] for s in range(3)])
    im = np.array([recs[lam, s]["head_imbalance"] for s in range(3)])
    assert levels[f"{lam:g}"] == [f"{lam:g}", ", ".join(f"{x:.4f}" for x in b), f"{b.mean():.4f} ± {b.std(ddof=1):.4f}",
                                  ", ".join(f"{x:.3f}" for x in im), f"{im.mean():.3f}"], lam
  effects = {r[0]: r[1:] for r in table(doc, "effect, one commit (paired with λ = 0)")}
  for lam in lams[1:]:
    for key, label, nd in (("val_bpb", "val BPB", 4), ("head_imbalance", "final head imbalance", 3)):
      t, c = ([recs[l, s][key] for s in range(3)] for l in (lam, 0.0))
      assert effects[f"λ = {lam:g} − 0, {label}"] == paired_cells(t, c, nd), (lam, key)
  # the readings: the weaker heads at λ = 1e-2, the null arm's noise and its false positive, the size ratio
  other = [float(np.mean(_quantity(recs[1e-2, s], "other heads") - _quantity(recs[0.0, s], "other heads")))
           for s in range(3)]
  text = " ".join(doc.split())
  assert f"rise again: {np.mean(other):+.3f}, p = {p2(sps.ttest_1samp(other, 0).pvalue)}" in text
  null_bpb = [recs[1e-8, s]["val_bpb"] - recs[0.0, s]["val_bpb"] for s in range(3)]
  null_imb = [recs[1e-8, s]["head_imbalance"] - recs[0.0, s]["head_imbalance"] for s in range(3)]
  assert f"(SD {np.std(null_bpb, ddof=1):.3f})" in text and min(null_imb) > 0
  assert ", ".join(f"{x:+.4f}" for x in null_bpb).replace("-", "−") in text
  dose_imb = np.mean([recs[1e-2, s]["head_imbalance"] - recs[0.0, s]["head_imbalance"] for s in range(3)])
  assert round(-dose_imb / np.mean(null_imb)) == 7 and "seven times the size of λ = 1e-8's difference" in text
  assert f"which has the opposite sign ({np.mean(null_imb):+.3f};" in text


def test_readings_quote_their_tests(runs, flat):
  base = lambda v, k="val_bpb": [r[k] for r in sel(runs, v, "base")]
  aux = lambda v, k="val_bpb": [r[k] for r in sel(runs, v, "aux")]
  for v in ("vanilla", "sink"):
    t = sps.ttest_rel(aux(v), base(v))
    assert f"{t.pvalue:.2f}" in flat and f"±{detectable(np.std(diffs(runs, v), ddof=1), 3):.4f}" in flat
  t = sps.ttest_rel(aux("gated"), base("gated"))
  ci = t.confidence_interval()
  assert (f"95 % t-interval {ci.low:+.4f} … {ci.high:+.4f}, t₂ = {t.statistic:+.2f}, p = {p2(t.pvalue)})"
          in flat and t.pvalue < 0.05 and perm_p(diffs(runs, "gated")) == 0.25)
  assert min(np.std(diffs(runs, v), ddof=1) for v in ("vanilla", "sink")) > 8 * np.std(diffs(runs, "gated"), ddof=1)
  gi = diffs(runs, "gated", "head_imbalance")
  ti = sps.ttest_rel(aux("gated", "head_imbalance"), base("gated", "head_imbalance"))
  assert ("aux − base is " + ", ".join(f"{x:+.3f}" for x in gi).replace("-", "−") in flat and
          f"paired t p = {p2(ti.pvalue)}, not detected (detectable: ±{detectable(np.std(gi, ddof=1), 3):.3f})" in flat)
  si = diffs(runs, "sink", "head_imbalance")
  ts = sps.ttest_rel(aux("sink", "head_imbalance"), base("sink", "head_imbalance"))
  assert all(x > 0 for x in si) and ("(" + ", ".join(f"{x:+.3f}" for x in si) + f"; paired t p = {p2(ts.pvalue)}"
                                     in flat and f"not detected (detectable: ±{detectable(np.std(si, ddof=1), 3):.3f})"
                                     in flat)
  for v, name in (("sink", "sink − vanilla"), ("gated", "gated − vanilla")):
    w = sps.ttest_ind(base(v), base("vanilla"), equal_var=False)
    d = np.mean(base(v)) - np.mean(base("vanilla"))
    assert f"{name} {d:+.4f} (p = {p2(w.pvalue)})".replace("-0", "−0") in flat and w.pvalue > 0.05


def test_timings(runs, flat):
  t = [r["train_seconds"] for r in runs]
  e = [r["eval_seconds"] for r in runs]
  assert flat.count(f"{min(t):,.0f}–{max(t):,.0f} s") >= 2 and f"{min(e):.0f}–{max(e):.0f} s" in flat


def test_curves(runs, flat):
  at = lambda r, step: dict((int(s), y) for s, y in r["imbalance_curve"])[step]
  gb = sel(runs, "gated", "base")
  assert f"start at {rng([at(r, 1) for r in gb])} at step 1" in flat
  assert f"are at {rng([at(r, 20) for r in gb])} by step 20" in flat
  peaks = [max(y for _, y in r["imbalance_curve"]) for r in gb]
  assert f"peak at {rng(peaks)} (seed 2 never goes above {peaks[2]:.3f})" in flat
  van = [y for r in runs if r["variant"] == "vanilla" for _, y in r["imbalance_curve"]]
  assert f"Vanilla stays flat at {rng(van)}" in flat
  sink_peaks = [max(y for _, y in r["imbalance_curve"]) for r in runs if r["variant"] == "sink"]
  assert f"to a maximum of {rng(sink_peaks)}" in flat
  steps = sorted(set.intersection(*(set(int(s) for s, _ in r["imbalance_curve"]) for r in runs
                                    if r["variant"] == "gated")))
  grid = lambda rs: np.array([[at(r, s) for s in steps] for r in rs])
  b, a = grid(gb), grid(sel(runs, "gated", "aux")).mean(0)
  below, inside = int((a < b.mean(0)).sum()), int(((a >= b.min(0)) & (a <= b.max(0))).sum())
  assert f"below the base mean at {below} of the {len(steps)} logged steps" in flat
  assert f"min–max band at {inside} of them" in flat


def test_first_token_attention_and_value_norms(runs, doc, flat):
  f = [x for r in runs for x in r["first_token_attention"]]
  alpha = np.array([r["sink_ratio_alpha"] for r in runs])
  sink = [x for r in runs if r["sink_logit_attention"] is not None for x in r["sink_logit_attention"]]
  assert f"is {rng(f)} in every layer of every run" in flat
  assert f"per layer is {rng(alpha.mean(-1).ravel())}" in flat and f"(largest: {alpha.max():.3f})" in flat
  assert (alpha <= 0.75).all() and f"takes {rng(sink)} of the attention per layer" in flat
  rows = {r[0]: r for r in table(doc, "run | value_norm_ratio per layer")}
  means = {}
  for v in VARIANTS:
    for loss in ("base", "aux"):
      a = np.array([r["value_norm_ratio"] for r in sel(runs, v, loss)])
      means[v, loss] = a.mean(0)
      assert rows[f"{v} {loss}"][1:] == [" ".join(f"{x:.3f}" for x in a.mean(0)), rng(a.ravel())]
  allv = np.array([r["value_norm_ratio"] for r in runs])
  layer0 = [m[0] for m in means.values()]
  deeper = [x for m in means.values() for x in m[1:]]
  assert f"is {rng(layer0)} in layer 0 and {rng(deeper)} in the deeper layers" in flat
  assert f"{rng(allv.ravel())} over every layer of every run" in flat


def test_value_zeroing_of_the_main_grid(runs, doc):
  rows = {r[0]: r for r in table(doc, "variant | teacher-forced, targets 0–255")}
  for v in VARIANTS:
    cells = []
    for defn in ("teacher_forced", "after_prefill"):
      d = [r[f"value_zeroing_{defn}"]["bpb_all"] - r[f"value_zeroing_{defn}"]["bpb_none"]
           for r in runs if r["variant"] == v]
      cells.append(f"{np.mean(d):+.4f} ({min(d):+.4f} … {max(d):+.4f})")
    assert rows[v][1:] == cells, v


def test_finetuning_tables(doc, flat):
  ft = json.loads(GRID.read_text())["finetune"]["gated"]
  before = np.array(ft["before"]["importance"])
  modes = ("none", "eq7", "eq8_fixed", "eq8_repicked")
  after = {m: np.array(ft["modes"][m]["importance"]) for m in modes}
  top = before.argmax(-1)
  shared = np.zeros(before.shape, bool)
  shared[np.arange(4), top] = True
  rows = table(doc, "gated, fine-tuned with")
  assert rows[0][1:3] == [f"{ft['before']['val_bpb']:.4f}", f"{ft['before']['head_imbalance']:.3f}"]
  for row, m in zip(rows[1:], modes):
    a = after[m]
    routed = lambda x: x[~shared].reshape(4, 3)
    cv = np.mean(routed(a).std(-1) / routed(a).mean(-1))
    assert row[1:] == [f"{ft['modes'][m]['val_bpb']:.4f}", f"{ft['modes'][m]['head_imbalance']:.3f}",
                       f"{before[shared].mean():.3f} → {a[shared].mean():.3f}",
                       f"{routed(before).mean():.3f} → {routed(a).mean():.3f}", f"{cv:.3f}"], m
  heads = table(doc, "layer | head | role (m = 1)")
  want = [[str(l), str(h), "shared" if top[l] == h else "routed", f"{before[l, h]:.3f}",
           *(f"{after[m][l, h]:.3f}" for m in modes)] for l, h in zip(*np.nonzero(before > 0.9))]
  assert heads == want
  assert (f"layer 0's head 2 ({before[0, 2]:.3f} → {after['eq7'][0, 2]:.3f})" in flat and
          f"while eq. 7 keeps it at {after['eq7'][1, 3]:.3f}" in flat)
  none_rise = routed_mean = None
  routed_mean = lambda x: x[~shared].mean()
  none_rise = routed_mean(after["none"]) - routed_mean(before)
  assert f"without the aux loss they move by {none_rise:+.3f}" in flat


# ------------------------------------------------------------------------------------------------ STREAMING.md

PASSKEY = ROOT / "docs" / "results" / "passkey_tiny"


def _passkey(name):
  return json.loads((PASSKEY / name).read_text())


def _pk_rows(recs, mode, ctx):
  return [r for r in recs if r["mode"] == mode and r["context"] == ctx]


def _pk_cells(recs, modes):
  """(KV bytes at 498, digits 247, digits 498, key at depth 1 247, key at depth 1 498) as the doc prints them: one
  mode's values, or min–max over several."""
  def fmt(xs):
    return f"{min(xs):.2f}–{max(xs):.2f}" if min(xs) != max(xs) else f"{xs[0]:.2f}"
  digits = lambda m, c: np.mean([r["digit_accuracy"] for r in _pk_rows(recs, m, c)])
  key = lambda m, c: [r["accuracy"] for r in _pk_rows(recs, m, c) if r["depth"] == 1.0][0]
  return (f"{_pk_rows(recs, modes[0], 498)[0]['kv_bytes']:,}", fmt([digits(m, 247) for m in modes]),
          fmt([digits(m, 498) for m in modes]), fmt([key(m, 247) for m in modes]), fmt([key(m, 498) for m in modes]))


def test_passkey_table_and_ablations_come_from_the_raw_records():
  """STREAMING.md's passkey table, row by row, from the probe's results*.json (one per command), and its reading:
  the random maps are what the seeds draw, layer 0's head 3 is in exactly the maps the doc says, the one-head map
  retrieves and the all-but-one map does not."""
  from sinkjax.cache_policy import random_heads
  doc = (ROOT / "docs" / "STREAMING.md").read_text()
  stream = " ".join(doc.split())
  main, incl = _passkey("results.json"), _passkey("results_random_with_l0h3.json")
  only, allbut = _passkey("results_only_l0h3.json"), _passkey("results_all_but_l0h3.json")
  assert np.asarray(_passkey("only_l0h3.json")).sum() == 1 and _passkey("only_l0h3.json")[0][3] == 1
  assert (np.asarray(_passkey("all_but_l0h3.json")) == 1 - np.asarray(_passkey("only_l0h3.json"))).all()
  holds = lambda recs, m: bool(np.asarray(_pk_rows(recs, m, 247)[0]["full_map"])[0, 3])
  for recs, seeds in ((main, range(5)), (incl, (14, 20, 22, 25, 26))):
    for r in recs:
      if "random" in r["mode"]:
        a, s = float(r["mode"].split("F=")[1].split()[0]), int(r["mode"].split("seed ")[1].rstrip(")"))
        assert s in seeds and (np.asarray(r["full_map"], bool) == random_heads((4, 4), a, "layer", s)).all()
  assert [s for s in range(27) if random_heads((4, 4), 0.25, "layer", s)[0, 3]] == [14, 20, 22, 25, 26]
  assert [s for s in range(5) if random_heads((4, 4), 0.5, "layer", s)[0, 3]] == [1, 3]
  want = [("full", "16/16", main, ["full cache"]),
          ("sinks + window (S 4, W 64)", "0/16", main, ["sinks + window (S=4, W=64)"]),
          ("only layer 0 head 3 full", "1/16", only, ["hybrid map only_l0h3.json"]),
          ("every head full but layer 0 head 3", "15/16", allbut, ["hybrid map all_but_l0h3.json"])]
  for F, n in (("0.25", 4), ("0.5", 8)):
    want.append((f"F = {F} by importance", f"{n}/16", main, [f"hybrid F={F} by importance"]))
    rand = [f"hybrid F={F} random (seed {s})" for s in range(5)]
    w, wo = [m for m in rand if holds(main, m)], [m for m in rand if not holds(main, m)]
    seeds = lambda ms: ", ".join(m.split("seed ")[1].rstrip(")") for m in ms)
    if w:
      want.append((f"F = {F} random with layer 0 head 3 (seeds {seeds(w)})", f"{n}/16", main, w))
    want.append((f"F = {F} random without layer 0 head 3 (seeds {seeds(wo)})", f"{n}/16", main, wo))
  want.append(("F = 0.25 random with layer 0 head 3 (seeds 14, 20, 22, 25, 26)", "4/16", incl,
               [f"hybrid F=0.25 random (seed {s})" for s in (14, 20, 22, 25, 26)]))
  got = {r[0]: r[1:] for r in table(doc, "cache | full heads | KV bytes (498)")}
  assert len(got) == len(want)
  for label, full, recs, modes in want:
    kv, d247, d498, k247, k498 = _pk_cells(recs, modes)
    assert got[label] == [full, kv, f"{d247} / {d498}", f"{k247} / {k498}"], label
  # the reading: the one-head map keeps the full cache's digits, the all-but-one map is at chance
  full_d, only_d, allbut_d = (_pk_cells(r, [m])[1:3] for r, m in ((main, "full cache"),
                              (only, "hybrid map only_l0h3.json"), (allbut, "hybrid map all_but_l0h3.json")))
  assert f"({only_d[0]} / {only_d[1]} against {full_d[0]} / {full_d[1]})" in stream
  assert f"falls to chance ({allbut_d[0]} / {allbut_d[1]})" in stream
  assert float(allbut_d[0]) < 0.2 and float(only_d[0]) > float(full_d[0]) - 0.05
  # the exception to "falls to chance": 498 tokens, depth 0, in digits out of 8 keys x 5
  cell = lambda recs, m: [r for r in _pk_rows(recs, m, 498) if r["depth"] == 0.0][0]
  got = round(cell(allbut, "hybrid map all_but_l0h3.json")["digit_accuracy"] * 40)
  ref = round(cell(allbut, "full cache")["digit_accuracy"] * 40)
  assert f"depth 0 it gets {got} of 40 digits right, the full cache {ref} of 40" in stream and got / 40 > 0.4
  # the overview's quotes (section head): F = 0.25 / 0.5 by importance against the full cache, and the random maps
  dig = lambda m, c: np.mean([r["digit_accuracy"] for r in _pk_rows(main, m, c)])
  rand = [f"hybrid F=0.25 random (seed {s})" for s in range(5)]
  assert (f"({dig('hybrid F=0.25 by importance', 247):.3f} vs {dig('full cache', 247):.3f} at 247 tokens; "
          f"{dig('hybrid F=0.5 by importance', 247):.2f} with half the heads full)") in stream
  assert (f"random maps ≤ {max(dig(m, 247) for m in rand):.3f} at 247 tokens and ≤ "
          f"{max(dig(m, 498) for m in rand):.2f} at 498") in stream
  assert not any(holds(main, m) for m in rand)
  sw = "sinks + window (S=4, W=64)"
  assert f"all-streaming {dig(sw, 247):.3f} / {dig(sw, 498):.3f}" in stream


def test_passkey_perplexity_table_and_ranks():
  """The perplexity rows STREAMING.md quotes are ppl.md's / ppl_ablations.md's, and the importance map's rank among its
  random peers (3rd of 6 at both sizes) holds."""
  ppl = {}
  for name in ("ppl.md", "ppl_ablations.md"):
    for line in (PASSKEY / name).read_text().splitlines():
      cells = [c.strip() for c in line.strip("|").split("|")]
      if len(cells) == 8 and cells[3][:1].isdigit():
        ppl[cells[0]] = (float(cells[3]), float(cells[5]))
  stream = " ".join((ROOT / "docs" / "STREAMING.md").read_text().split())
  rows = {r[0]: r for r in table((ROOT / "docs" / "STREAMING.md").read_text(), "cache | full heads | KV cache bytes")}
  single = {"full": "full cache", "window only (S = 0)": "window only (S=0, W=64)",
            "sinks + window": "sinks + window (S=4, W=64)",
            "only layer 0 head 3 full": "hybrid map only_l0h3.json (S=4, W=64)",
            "every head full but layer 0 head 3": "hybrid map all_but_l0h3.json (S=4, W=64)",
            "hybrid F = 0.25 by importance": "hybrid F=0.25 by importance (S=4, W=64)",
            "hybrid F = 0.5 by importance": "hybrid F=0.5 by importance (S=4, W=64)"}
  for label, key in single.items():
    assert rows[label][3:5] == [f"{ppl[key][0]:.3f}", f"{ppl[key][1]:.3f}"], label
  for F in ("0.25", "0.5"):
    rand = [ppl[f"hybrid F={F} random (seed {s}) (S=4, W=64)"] for s in range(5)]
    span = lambda i: f"{min(r[i] for r in rand):.3f}–{max(r[i] for r in rand):.3f}"
    assert rows[f"hybrid F = {F} random, seeds 0–4 (min–max)"][3:5] == [span(0), span(1)]
    imp = ppl[f"hybrid F={F} by importance (S=4, W=64)"][0]
    assert sorted([r[0] for r in rand] + [imp]).index(imp) + 1 == 3
  rand25 = sorted(ppl[f"hybrid F=0.25 random (seed {s}) (S=4, W=64)"][0] for s in range(5))
  imp25 = ppl["hybrid F=0.25 by importance (S=4, W=64)"][0]
  assert f"(F = 0.25: {imp25:.3f} against " + ", ".join(f"{x:.3f}" for x in rand25) + ")" in stream
  hybrids = [v[0] for k, v in ppl.items() if k.startswith("hybrid")]
  worse = sum(v > ppl["sinks + window (S=4, W=64)"][0] for v in hybrids)
  assert f"{worse} of the {len(hybrids)} hybrid maps measured are slightly *worse*" in stream


# ------------------------------------------------------------------------------------------------ dose study

def dose_runs(runs):
  """{(lambda, seed): record} from the dose study's raw per-run files (docs/results/paper_cpu_dose/raw/NAME/
  paper_eval.json) and, for lambda 0 / 1e-4, the main grid's gated base / aux runs."""
  out = {}
  for r in runs:
    if r["variant"] == "gated":
      out[{"base": 0.0, "aux": 1e-4}[r["loss"]], r["seed"]] = r
  for d in sorted((DOSE_DIR / "raw").glob("gated_*_s*")):
    _, label, seed = d.name.rsplit("_", 2)
    lam = {"base": 0.0, "aux": 1e-4}.get(label, None)
    lam = float(label[3:]) if lam is None else lam
    ev = json.loads((d / "paper_eval.json").read_text())
    if (lam, int(seed[1:])) in out:               # a main-grid run is never retrained into the dose study
      raise AssertionError(f"{d.name} duplicates a main-grid run")
    out[lam, int(seed[1:])] = ev
  return out


@pytest.fixture(scope="module")
def dose(runs):
  if not (DOSE_DIR / "raw").is_dir():
    pytest.skip("no dose-study raw files committed yet")
  return dose_runs(runs)


def test_dose_table(dose, doc):
  rows = {r[0]: r for r in table(doc, "λ | val BPB per seed")}
  lams = sorted({lam for lam, _ in dose})
  assert sorted(rows) == sorted(f"{lam:g}" for lam in lams)
  for lam in lams:
    rs = [dose[lam, s] for s in sorted(s for l, s in dose if l == lam)]
    b = np.array([r["val_bpb"] for r in rs])
    i = np.array([r["head_imbalance"] for r in rs])
    aux = np.mean([lam * 4 * np.sum(np.square(r["cv_per_layer"])) for r in rs])
    ranks = np.mean([np.sort(r["importance"], -1)[:, ::-1].mean(0) for r in rs], 0)
    want = [f"{lam:g}", ", ".join(f"{x:.4f}" for x in b), f"{b.mean():.4f} ± {b.std(ddof=1):.4f}",
            ", ".join(f"{x:.3f}" for x in i), f"{i.mean():.3f}", f"{aux:.1e}",
            f"{np.mean([np.mean(r['importance']) for r in rs]):.3f}", f"{ranks[0]:.3f} / {ranks[1:].mean():.3f}"]
    assert rows[f"{lam:g}"] == want, lam


def _ranked(r):
  return np.sort(r["importance"], -1)[:, ::-1]


def _quantity(r, name):
  return {"val BPB": lambda: r["val_bpb"], "final head imbalance": lambda: r["head_imbalance"],
          "strongest head per layer": lambda: _ranked(r)[:, 0],
          "other heads": lambda: _ranked(r)[:, 1:]}[name]()


def test_dose_tests_paired_by_seed(dose, doc):
  """Both dose tables (against λ = 0 and, on the same commit, against λ = 1e-8), row by row, from scipy; importance
  ranks matched within each layer and averaged per seed before the test."""
  for header, control, lams in (("effect (paired with)", 0.0, (1e-4, 1e-3, 1e-2)),
                                ("effect (paired with λ = 1e-8, same commit)", 1e-8, (1e-3, 1e-2))):
    rows = {r[0]: r[1:] for r in table(doc, header)}
    names = ("val BPB", "final head imbalance", "strongest head per layer", "other heads")[:4 if control == 0 else 2]
    assert len(rows) == len(lams) * len(names)
    for lam in lams:
      for name in names:
        nd = 4 if name == "val BPB" else 3
        t = [float(np.mean(_quantity(dose[lam, s], name))) for s in range(3)]
        c = [float(np.mean(_quantity(dose[control, s], name))) for s in range(3)]
        if name in ("strongest head per layer", "other heads"):     # the mean over layers (and heads) of rank diffs
          t = [float(np.mean(_quantity(dose[lam, s], name) - _quantity(dose[control, s], name))) for s in range(3)]
          c = [0.0] * 3
        got = rows[f"λ = {lam:g} − {control:g}, {name}"]
        assert got == paired_cells(t, c, nd), (lam, control, name)


def test_dose_readings_and_power(dose, runs, flat):
  """The first dose study's readings: its numbers, the all-doses BPB t-interval (the seed is the unit) and the
  λ = 1e-8 arm against the old base (the design's power: test_power_of_the_from_scratch_design)."""
  bpb = lambda lam: np.array([dose[lam, s]["val_bpb"] for s in range(3)])
  imb = lambda lam: np.array([dose[lam, s]["head_imbalance"] for s in range(3)])
  t1 = sps.ttest_rel(imb(1e-3), imb(0.0))
  t2 = sps.ttest_rel(imb(1e-2), imb(0.0))
  assert t1.pvalue > 0.05 > t2.pvalue and all(imb(1e-3) < imb(0.0))
  assert f"give p = {p2(t2.pvalue)}" in flat and f"p = {p2(t1.pvalue)} (t-interval" in flat
  doses = (1e-4, 1e-3, 1e-2)
  every = np.array([bpb(l) - bpb(0.0) for l in doses])
  assert (every > 0).all() and f"All {every.size} differences against λ = 0" in flat
  per_seed = every.mean(0)
  t = sps.ttest_1samp(per_seed, 0.0)
  ci = t.confidence_interval()
  assert (", ".join(f"{x:+.4f}" for x in per_seed) + f", 95 % t-interval {ci.low:+.4f} … {ci.high:+.4f} "
          f"(t₂ = {t.statistic:+.2f}, p = {p2(t.pvalue)})") in flat
  null = bpb(1e-8) - bpb(0.0)
  tn = sps.ttest_rel(bpb(1e-8), bpb(0.0))
  assert (f"λ = 1e-8, which carries the code change and a small treatment, is {null.mean():+.4f} against the old "
          f"base (t-interval {tn.confidence_interval().low:+.4f} … {tn.confidence_interval().high:+.4f}, not "
          "detected)").replace("(t-interval -", "(t-interval −") in flat
  top = [(_ranked(dose[1e-8, s])[:, 0] - _ranked(dose[0.0, s])[:, 0]).mean() for s in range(3)]
  assert f"strongest head {top[0]:+.3f}, {top[1]:+.3f}, {top[2]:+.3f}".replace("-", "−") in flat
  assert f"−0.028: detected, p = {p2(sps.ttest_1samp(top, 0).pvalue)}" in flat
  assert f"strongest head moves by {np.mean(top):+.3f} (p = {p2(sps.ttest_1samp(top, 0).pvalue)}: the code change and a " \
         "small treatment together, not drift)".replace("by -", "by −") in flat
  assert "## Real pretrained model (SmolLM2-135M)" in flat


def one_commit_runs() -> dict:
  """{run name: paper_eval.json} of the one-commit reruns (8d9b2aa): the main grid's 18 runs and the dose rerun's 9."""
  out = {}
  for sub in ("paper_cpu_r2", "paper_cpu_r2_dose"):
    for d in sorted((ROOT / "docs" / "results" / sub / "raw").iterdir()):
      assert json.loads((d / "done.json").read_text())["commit"] == "8d9b2aa5a703", d
      out[d.name] = json.loads((d / "paper_eval.json").read_text())
  return out


def pooled_sd(arms) -> float:
  """The SD of one paired difference, each arm's differences about their own mean, pooled over the arms."""
  arms = [np.asarray(a, float) for a in arms]
  return math.sqrt(sum(np.sum((a - a.mean()) ** 2) for a in arms) / sum(len(a) - 1 for a in arms))


def test_power_of_the_from_scratch_design(flat):
  """The power figures of the opening section and the findings table, from the one-commit reruns' own files: the
  pooled SD of six BPB arms (vanilla, sink and gated aux − base; gated λ = 1e-8, 1e-3, 1e-2 − 0) and of the main
  grid's three, the detectable effect at n = 3, the seeds the paper's Δ 0.003 / 0.006 would take, and the same for
  the imbalance of the four gated arms."""
  ev = one_commit_runs()
  d = lambda t, c, k="val_bpb": [ev[t.format(s=s)][k] - ev[c.format(s=s)][k] for s in range(3)]  # noqa: E731
  main = [d(f"{v}_aux_s{{s}}", f"{v}_base_s{{s}}") for v in VARIANTS]
  dose = [d(f"gated_lam{lam}_s{{s}}", "gated_base_s{s}") for lam in ("1e-08", "0.001", "0.01")]
  sd, sd3 = pooled_sd(main + dose), pooled_sd(main)
  assert (f"pooled over 6 arms of the one-commit reruns, is {sd:.4f}; over the main grid's three arms alone "
          f"{sd3:.4f})") in flat and f"about ±{detectable(sd, 3):.3f} (the SD" in flat
  assert f"**{seeds_for(0.003, sd)} seeds** (Δ 0.003) to **{seeds_for(0.006, sd)} seeds** (Δ 0.006)" in flat
  assert f"Δ 0.003 would take ~{seeds_for(0.003, sd)} seeds per arm" in flat
  imb = [d(f"gated_{x}_s{{s}}", "gated_base_s{s}", "head_imbalance") for x in ("lam1e-08", "aux", "lam0.001", "lam0.01")]
  isd = pooled_sd(imb)
  assert f"about ±{detectable(isd, 3):.2f} (pooled SD {isd:.3f})" in flat


# ------------------------------------------------------------------------------------------------ TRIGGER.md

TRIGGER = ROOT / "docs" / "results" / "trigger"


def test_trigger_tables_are_the_committed_runs():
  """Every table TRIGGER.md shows is a committed run's table.txt, line for line; the table is what its results.json
  holds, `solved` is the held-out batch's largest error against the 5e-3 rule, and the readings quote them."""
  text = (ROOT / "docs" / "TRIGGER.md").read_text()
  flat = " ".join(text.split())
  for run in ("quick", "nobos", "2x2_6000steps"):
    lines = [l.rstrip() for l in (TRIGGER / run / "table.txt").read_text().splitlines() if l.strip()]
    body = [l for l in lines if not l.startswith("(")]
    assert "\n".join(body[2:]) in "\n".join(l.rstrip() for l in text.splitlines()), run
    for rec in json.loads((TRIGGER / run / "results.json").read_text()):
      row = [l for l in body[2:] if l.split()[0] == rec["variant"]][0].split()
      assert int(row[3]) == rec["steps"] and row[7] == f"{rec['final_loss']:.2e}"
      assert row[9] == f"{rec['bos_attention_nontrigger']:.3f}" and row[10] == f"{rec['bos_attention_trigger']:.3f}"
      assert rec["solved"] == (rec["heldout_max_abs_error"] < 5e-3) and row[5] == ("yes" if rec["solved"] else "no")
      assert row[6] == f"{rec['heldout_max_abs_error']:.2e}"
  quick = json.loads((TRIGGER / "quick" / "results.json").read_text())
  err = [r["heldout_max_abs_error"] for r in quick]
  assert all(r["converged"] and not r["solved"] for r in quick)
  assert f"its largest error is {min(err) * 1e3:.1f}e-3 (sink) to {max(err) * 1e3:.1f}e-3 (softmax)" in flat
  assert min(err) == [r for r in quick if r["variant"] == "sink"][0]["heldout_max_abs_error"]
  sink = [r for r in quick if r["variant"] == "sink"][0]
  assert f"its value is {sink['sink_logits'][0][0]:.2f} after training".replace("-", "−") in flat
  nobos = {r["variant"]: r for r in json.loads((TRIGGER / "nobos" / "results.json").read_text())}
  assert nobos["relu"]["solved"] and not nobos["sink"]["solved"] and nobos["sink"]["converged"]
  assert (f"largest error {nobos['relu']['heldout_max_abs_error'] * 1e3:.1f}e-3" in flat and
          f"held-out one ({nobos['sink']['heldout_max_abs_error'] * 1e3:.1f}e-3)" in flat)
  two = json.loads((TRIGGER / "2x2_6000steps" / "results.json").read_text())
  e2 = [r["heldout_max_abs_error"] for r in two]
  assert f"held-out largest error {min(e2):.3f}–{max(e2):.3f}" in flat and not any(r["solved"] for r in two)
  t2 = [r["train_time_s"] for r in two]
  assert f"{min(t2):.0f}–{max(t2):.0f} s of training per variant; raw results" in flat
  assert "solves the task (loss" not in flat


def test_trigger_value_norms_quoted():
  flat = " ".join((ROOT / "docs" / "TRIGGER.md").read_text().split())
  recs = {r["variant"]: r for r in json.loads((TRIGGER / "quick" / "results.json").read_text())}
  norm = lambda r, k: r[k][0][0]
  relu = recs["relu"]
  b, o = norm(relu, "bos_value_norm_per_head"), norm(relu, "value_norm_per_head")
  bo, oo = norm(relu, "bos_output_norm_per_head"), norm(relu, "output_norm_per_head")
  assert f"has {b / o:.2f} of the other tokens' mean norm ({b:.3f} vs {o:.3f}; after W_O {bo / oo:.2f}: " \
         f"{bo:.3f} vs {oo:.3f}" in flat
  ratios = [norm(recs[v], "bos_value_norm_per_head") / norm(recs[v], "value_norm_per_head")
            for v in ("softmax", "sink", "gated")]
  assert f"drive it to {min(ratios):.4f}–{max(ratios):.3f} of the others'" in flat
  sm = recs["softmax"]
  assert f"(softmax {norm(sm, 'bos_value_norm_per_head'):.3f} vs {norm(sm, 'value_norm_per_head'):.3f}" in flat
  t = [r["train_time_s"] for r in recs.values()]
  assert f"{min(t):.0f}–{max(t):.0f} s of training per variant" in flat
  nobos = json.loads((TRIGGER / "nobos" / "results.json").read_text())
  assert all(r["bos_value_norm_per_head"] is None for r in nobos)          # no BOS token, no BOS norm
  t44 = {r["variant"]: r for r in json.loads((TRIGGER / "4x4_1000steps" / "results.json").read_text())}
  assert f"took {t44['softmax']['train_time_s'] / t44['softmax']['steps']:.2f} s per step for softmax and " \
         f"{t44['relu']['train_time_s'] / t44['relu']['steps']:.3f} s for ReLU" in flat
  assert not any(r["converged"] for r in t44.values())


def test_dose_prose(dose, flat):
  new = sorted((DOSE_DIR / "raw").glob("gated_*_s*"))
  t = [json.loads((d / "done.json").read_text())["train_seconds"] for d in new]
  assert f"The {len(new)} new runs took {min(t):.0f}–{max(t):.0f} s of training each".replace("The 9", "The nine") \
      in flat
  base = {s: r for (l, s), r in dose.items() if l == 0.0}
  null = [dose[1e-8, s]["val_bpb"] - base[s]["val_bpb"] for s in sorted(base)]
  assert "its BPB differences are all positive (" + ", ".join(f"{x:+.4f}" for x in null) + ")" in flat
  worst = max(dose[l, s]["val_bpb"] - base[s]["val_bpb"] for (l, s) in dose if l >= 1e-4)
  assert f"The largest single-seed difference is {worst:+.4f}" in flat
  curve_max = max(y for d in new if d.name.startswith("gated_lam0.01_")
                  for y in (json.loads(l)["head_imbalance"] for l in (d / "metrics.jsonl").read_text().splitlines()
                            if l.strip() and json.loads(l).get("head_imbalance") is not None))
  assert f"at λ = 1e-2 the imbalance never exceeds {curve_max:.3f}" in flat
  mean_imp = lambda lam: np.mean([np.mean(r["importance"]) for (l, s), r in dose.items() if l == lam])
  assert f"the mean importance rises {mean_imp(0.0):.3f} → {mean_imp(1e-2):.3f}" in flat
  repro = json.loads((REPRO_DIR / "raw" / "gated_base_s0" / "paper_eval.json").read_text())
  assert (f"gave val BPB {repro['val_bpb']:.4f} instead of {base[0]['val_bpb']:.4f} and imbalance "
          f"{repro['head_imbalance']:.3f} instead of {base[0]['head_imbalance']:.3f}") in flat


def test_size_paragraph(dose, flat):
  new = sorted((DOSE_DIR / "raw").glob("gated_*_s*"))
  t = [json.loads((d / "done.json").read_text())["train_seconds"] for d in new]
  e = [json.loads((d / "paper_eval.json").read_text())["eval_seconds"] for d in new]
  assert f"took {min(t):.0f}–{max(t):.0f} s of training and {min(e):.0f}–{max(e):.0f} s of evaluation each" in flat


def test_value_zeroing_on_one_window(runs, doc, flat):
  """Every run scored both ways on targets 64-255 (retrained base runs + dose runs): the table rows and the
  ranges quoted, from the raw paper_eval.json files."""
  files = sorted(REPRO_DIR.glob("raw/*/paper_eval.json")) + sorted(DOSE_DIR.glob("raw/*/paper_eval.json"))
  rows = {r[0]: r for r in table(doc, "run | teacher-forced, targets 0–255")}
  got = []
  for f in files:
    ev = json.loads(f.read_text())
    d = lambda k: ev[k]["bpb_all"] - ev[k]["bpb_none"]
    vals = (d("value_zeroing_teacher_forced"), d("value_zeroing_teacher_forced_window"),
            d("value_zeroing_after_prefill"))
    assert ev["value_zeroing_after_prefill"]["prompt_len"] == ev["value_zeroing_teacher_forced_window"]["prompt_len"]
    assert rows[f.parent.name][1:] == [f"{x:+.4f}" for x in vals], f.parent.name
    got.append(vals)
  assert len(rows) == len(files) == 12
  g = np.array(got)
  gap = np.abs(g[:, 1] - g[:, 2]).max()
  assert f"at most {gap:.4f} BPB apart on any of the {len(files)} runs" in flat
  r = lambda c: f"{g[:, c].min():+.4f} … {g[:, c].max():+.4f}".replace("-", "−")
  assert f"teacher-forced {r(1)}, after prefill {r(2)}" in flat
  assert f"The {r(0)} of teacher-forced zeroing over the whole row" in flat
  committed = {f"{x['variant']}_{x['loss']}_s{x['seed']}": x["val_bpb"] for x in runs}
  for name in ("vanilla_base_s0", "sink_base_s0", "gated_base_s0"):
    new = json.loads((REPRO_DIR / "raw" / name / "paper_eval.json").read_text())["val_bpb"]
    assert f"{committed[name]:.4f} → {new:.4f} {name.split('_')[0]}" in flat


# ------------------------------------------------------------------------------------------------ the findings table

def _m(x: float, nd: int) -> str:
  return f"{x:+.{nd}f}".replace("-", "−")


def _ci(d, nd: int) -> str:
  """'mean [low, high]' of a paired difference, the 95 % t-interval (scipy), with the doc's minus sign."""
  ci = sps.ttest_1samp(d, 0).confidence_interval(0.95)
  return f"{_m(np.mean(d), nd)} [{_m(ci.low, nd)}, {_m(ci.high, nd)}]"


def findings(doc) -> dict:
  """{first words of the claim: row} of the findings table."""
  return {r[0]: r for r in table(doc, "claim | setup as run")}


def _row(rows, start):
  got = [r for k, r in rows.items() if k.startswith(start)]
  assert len(got) == 1, start
  return got[0]


def test_the_page_opens_with_the_findings_table(doc):
  """The page is a reference: its title names what it is (no 'reproduced'), its first section is the findings table,
  every row names a verdict of the four, and every link in it (and on the page) reaches a heading or a committed
  file; readings an audit found wider than their numbers stay out."""
  lines = doc.splitlines()
  assert lines[0].startswith("# ") and "reproduc" not in lines[0].lower()
  assert next(l for l in lines if l.startswith("## ")) == "## Findings"
  first_table = next(l for l in lines if l.startswith("|"))
  assert first_table.startswith("| claim | setup as run | effect, 95 % interval | test, n | verdict | section; raw files |")
  verdicts = ("held", "not detected at this power", "contradicted", "not testable here")
  rows = findings(doc)
  assert len(rows) >= 10
  for r in rows.values():
    assert r[4].startswith(verdicts), r[0]
    for path in re.findall(r"`(docs/results/[^`]+)`", r[5]):
      assert (ROOT / path).exists(), path
  def anchor(h):                                  # GitHub's: lower case, punctuation out, each space a hyphen
    return re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
  anchors = {anchor(l.lstrip("#")) for l in lines if l.startswith("#") and not l.startswith("#!")}
  for target in re.findall(r"\]\(#([^)]+)\)", doc):
    assert target in anchors, target
  for target in re.findall(r"\]\((results/[^)]+)\)", doc):
    assert (DOC.parent / target).is_file(), target
  flat = " ".join(doc.split())
  for phrase in ("bounds the noise from above", "holds on each source of variance", "the paper's recipe",
                 "leaves the shared heads where", "does not leave the shared heads where", "stronger than its paired",
                 "# null arm", "exact sign test p = 0.031", "first read as", "At lr 3e-5 eq. 7",
                 "cost is detected.**", "1.3e-7", "byte-identical", "292 s"):
    assert phrase not in flat, phrase


def test_findings_from_scratch_rows(doc, runs):
  """The from-scratch rows' effects, intervals, p and detectable sizes, from the raw files with scipy: the one-commit
  reruns' own paper_eval.json files, the first grid's results.json, the first dose study's raw files."""
  rows = findings(doc)
  ev = one_commit_runs()
  d = lambda t, c, k="val_bpb": np.array([ev[t.format(s=s)][k] - ev[c.format(s=s)][k] for s in range(3)])  # noqa
  r2 = {v: d(f"{v}_aux_s{{s}}", f"{v}_base_s{{s}}") for v in VARIANTS}
  row = _row(rows, "[Sink-MoE] Table 1")
  assert row[2] == "aux − base: " + "; ".join(f"{v} {_ci(r2[v], 4)}" for v in VARIANTS)
  assert row[3] == "paired t, n = 3 seeds per variant (p " + ", ".join(
      p2(sps.ttest_1samp(r2[v], 0).pvalue) for v in VARIANTS) + ")"
  assert row[4].startswith("not detected at this power (detectable " + ", ".join(
      f"±{detectable(r2[v].std(ddof=1), 3):.4f}" for v in VARIANTS) + ";")
  assert all(sps.ttest_1samp(r2[v], 0).pvalue > 0.05 for v in VARIANTS)
  g1 = np.array(diffs(runs, "gated"))
  row = _row(rows, "the same, first grid")
  assert row[2].startswith(f"gated {_ci(g1, 4)};") and f"(gated p {p2(sps.ttest_1samp(g1, 0).pvalue)}; permutation p " \
      f"{p2(perm_p(g1))}" in row[3]
  assert sps.ttest_1samp(g1, 0).confidence_interval().low > 0 > -0.0025       # above the paper's gated gains
  i2 = d("gated_aux_s{s}", "gated_base_s{s}", "head_imbalance")
  i1 = np.array(diffs(runs, "gated", "head_imbalance"))
  row = _row(rows, "[Sink-MoE] Fig. 5")
  assert row[2] == f"aux − base, final imbalance: rerun {_ci(i2, 3)}; first grid {_ci(i1, 3)}"
  assert row[3] == f"paired t, n = 3 (p {p2(sps.ttest_1samp(i2, 0).pvalue)}, {p2(sps.ttest_1samp(i1, 0).pvalue)})"
  assert row[4] == (f"not detected at this power (detectable ±{detectable(i2.std(ddof=1), 3):.3f}, "
                    f"±{detectable(i1.std(ddof=1), 3):.3f})")
  dose1 = dose_runs(runs)
  x2 = d("gated_lam0.01_s{s}", "gated_base_s{s}", "head_imbalance")
  x1 = np.array([dose1[1e-2, s]["head_imbalance"] - dose1[0.0, s]["head_imbalance"] for s in range(3)])
  row = _row(rows, "eq. 7 balances the heads")
  assert row[2] == f"λ = 1e-2 − 0, final imbalance {_ci(x2, 3)}; the first dose study (two commits) {_ci(x1, 3)}"
  assert row[3] == f"paired t, n = 3 (p {p2(sps.ttest_1samp(x2, 0).pvalue)}, {p2(sps.ttest_1samp(x1, 0).pvalue)})"
  f = [x for r in runs for x in r["first_token_attention"]]
  alpha = np.array([r["sink_ratio_alpha"] for r in runs])
  row = _row(rows, "[GatedAttn] Table 4")
  assert row[2].startswith(f"F-Attn {rng(f)} in every layer of every run; largest head α {alpha.max():.3f}")
  files = sorted(REPRO_DIR.glob("raw/*/paper_eval.json")) + sorted(DOSE_DIR.glob("raw/*/paper_eval.json"))
  z = [json.loads(p.read_text())["value_zeroing_after_prefill"] for p in files]
  z = [x["bpb_all"] - x["bpb_none"] for x in z]
  row = _row(rows, "[Sink-MoE] Table 3")
  assert row[1].startswith(f"{len(files)} runs") and row[2] == f"all heads − none, after prefill: {_m(min(z), 4)} … " \
      f"{_m(max(z), 4)} BPB"
