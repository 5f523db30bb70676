"""The real-model head study's pieces that need no model: the offline English corpus, the head-role metrics against a
hand computation, and the report's paired statistics against scipy on hand-written run records."""
import json

import numpy as np
import pytest
from scipy import stats as sps

from sinkjax.experiments import heads_real


def test_corpus_is_english_prose_split_without_overlap(tmp_path):
  corpus = heads_real.english_corpus(tmp_path)
  assert corpus["analysis"]["documents"] == heads_real.ANALYSIS_DOCS >= 500
  assert corpus["heldout"]["documents"] == heads_real.HELDOUT_DOCS and corpus["train"]["documents"] >= 200
  docs = {n: [json.loads(l)["text"] for l in open(c["path"])] for n, c in corpus.items()}
  sets = {n: set(d) for n, d in docs.items()}
  assert not (sets["analysis"] & sets["train"]) and not (sets["heldout"] & (sets["train"] | sets["analysis"]))
  for d in docs["analysis"][:50]:
    assert 300 <= len(d) <= 700 and sum(c.isalpha() or c == " " for c in d) >= 0.75 * len(d)
  # a second call reuses the files (the study resumes on the same documents)
  assert heads_real.english_corpus(tmp_path) == corpus


def test_role_metrics_by_hand():
  shared_from = np.array([[0.9, 0.1, 0.5], [0.2, 0.3, 0.8]])          # top-2 per layer: {0, 2}, {2, 1}
  after = np.array([[0.6, 0.2, 0.4], [0.1, 0.5, 0.7]])
  r = heads_real.role_metrics(None, after, shared_from, m=2)
  assert r["shared_importance"] == pytest.approx(np.mean([0.6, 0.4, 0.5, 0.7]))
  assert r["routed_importance"] == pytest.approx(np.mean([0.2, 0.1]))
  assert r["routed_cv"] == pytest.approx(0.0)                          # one routed head per layer
  cv = lambda x: np.std(x) / np.mean(x)
  assert r["imbalance"] == pytest.approx((cv(after[0]) + cv(after[1])) / 2)
  assert r["mean_importance"] == pytest.approx(after.mean())


def test_report_statistics_equal_scipy(tmp_path):
  """summarize pairs each arm with the base loss by seed; its paired t equals scipy's ttest_rel."""
  rng = np.random.default_rng(0)
  L, H = 3, 4
  imp0 = rng.uniform(0.2, 0.9, (L, H))
  common = {"commit": "abc", "dirty": False}
  (tmp_path / "analysis.json").write_text(json.dumps({
      "importance": imp0.tolist(), "documents": 512, "rows": 300, "eval_tokens": 1000, "val_bpb": 1.0,
      "head_imbalance": 0.2, "cv_per_layer": [0.2] * L, "random_init": [{"head_imbalance": 0.01}], **common}))
  (tmp_path / "before.json").write_text(json.dumps({"importance": imp0.tolist(), "val_loss": 3.0, "val_bpb": 1.0,
                                                    **common}))
  loss = {}
  for arm, kind, seed in heads_real.plan():
    if kind != "lora":
      continue
    imp = np.clip(imp0 + rng.normal(0, 0.05, (L, H)) + (0.1 if arm == "eq7" else 0.0), 0.01, 1)
    loss[(arm, seed)] = 3.0 + rng.normal(0, 0.01)
    d = tmp_path / "runs" / heads_real.run_name(arm, kind, seed)
    d.mkdir(parents=True)
    (d / "record.json").write_text(json.dumps({"name": d.name, "arm": arm, "kind": kind, "seed": seed,
                                               "importance": imp.tolist(), "val_loss": loss[(arm, seed)],
                                               "val_bpb": 1.0, **common}))
  s = heads_real.summarize(tmp_path)
  e = s["effects"]["eq7.val_loss"]
  a = [loss[("eq7", k)] for k in heads_real.LORA_SEEDS]
  b = [loss[("base", k)] for k in heads_real.LORA_SEEDS]
  ref = sps.ttest_rel(a, b)
  assert e["t"]["p"] == pytest.approx(ref.pvalue) and e["t"]["t"] == pytest.approx(ref.statistic)
  assert e["diffs"] == pytest.approx(np.subtract(a, b))
  # a record of another commit is refused
  rec = tmp_path / "runs" / heads_real.run_name("eq8", "lora", 0) / "record.json"
  r = json.loads(rec.read_text())
  rec.write_text(json.dumps({**r, "commit": "other"}))
  with pytest.raises(Exception, match="different commits"):
    heads_real.summarize(tmp_path)
