"""docs/RESULTS.md's real-model numbers recomputed from the study's raw files (docs/results/heads_real/), with numpy
written here (not the study's code): the imbalance (eq. 6 as the mean over layers of std / mean across heads), the
counts and ranges quoted, and each fine-tuning run's quoted held-out loss and imbalance."""
import json
import pathlib
import re

import numpy as np
import pytest

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


def test_finetuning_rows():
  for rec_path in sorted((RAW / "raw").glob("*/record.json")):
    r = json.loads(rec_path.read_text())
    row = re.search(rf"\| {re.escape(r['name'])} \| ([^|]+) \| ([^|]+) \|", DOC)
    assert row, r["name"]
    assert float(row.group(1)) == pytest.approx(_cv(r["importance"]).mean(), abs=6e-5)
    assert float(row.group(2)) == pytest.approx(r["val_loss"], abs=6e-5)


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
