"""The real-model studies' pieces that need no model: the offline English corpus (heads_real)."""
import json

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


