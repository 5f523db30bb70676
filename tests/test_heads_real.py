"""The real-model studies' pieces that need no model: the offline English corpus (heads_real) and the head-role metrics
of the pinning study (heads_pinning) against a hand computation."""
import json

import numpy as np
import pytest

from sinkjax.experiments import heads_pinning, heads_real


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
  r = heads_pinning.role_metrics(after, shared_from, m=2)
  assert r["shared_importance"] == pytest.approx(np.mean([0.6, 0.4, 0.5, 0.7]))
  assert r["routed_importance"] == pytest.approx(np.mean([0.2, 0.1]))
  assert r["routed_cv"] == pytest.approx(0.0)                          # one routed head per layer
  cv = lambda x: np.std(x) / np.mean(x)
  assert r["imbalance"] == pytest.approx((cv(after[0]) + cv(after[1])) / 2)
  assert r["mean_importance"] == pytest.approx(after.mean())
