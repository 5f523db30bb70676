"""The far-context study's map building and statistics.

Map building runs the code the studies run (`streaming_real.score_run` on a tiny model, `far_context.map_of` from
score files) with hand-made scores whose order within each layer is known, and checks that each layer keeps the KV
head the ranking puts first (for far-context attention the mean of its query heads, for importance the best one); a
reversed ranking order fails them. The statistics are checked against hand counts on made-up runs."""
import json
import math
import types

import numpy as np
import pytest

from sinkjax.experiments import far_context as fc
from sinkjax.experiments import streaming_real as sr
from tests.test_generate import random_model

# [L=2, Hq=4] query-head scores of a 2-KV-head model (query heads 0-1 read KV head 0, 2-3 KV head 1). Layer 0: KV
# head 1 has the higher mean (0.5 vs 0.45) but KV head 0 the single best query head (0.9); layer 1: KV head 0 both.
SCORES = [[0.9, 0.0, 0.5, 0.5], [0.8, 0.7, 0.1, 0.2]]
BY_MEAN = [[0, 1], [1, 0]]     # far-context attention (rule "mean")
BY_ANY = [[1, 0], [1, 0]]      # importance (rule "any": the best query head)


@pytest.fixture(scope="module")
def tiny():
  return random_model(num_layers=2)[0]


@pytest.mark.parametrize("ranking,expected", [("far_attention", BY_MEAN), ("importance", BY_ANY)])
def test_score_run_keeps_the_heads_the_ranking_puts_first(tiny, ranking, expected):
  ids = np.random.RandomState(0).randint(0, 50, size=14)
  opts = sr.StreamingOptions(tokens=14, full_heads=0.5, chunk=4, scope="layer", rankings=[ranking])
  rec = sr.score_run(f"hybrid_{ranking}_w6", tiny, ids, {ranking: np.asarray(SCORES)}, opts)
  assert rec["map"] == expected
  assert rec["ranking"] == ranking and len(rec["nll"]) == 13


@pytest.mark.parametrize("ranking,expected", [("far_attention", BY_MEAN), ("importance", BY_ANY)])
def test_far_context_maps_keep_the_heads_the_ranking_puts_first(tmp_path, ranking, expected):
  (tmp_path / "scores.json").write_text(json.dumps({ranking: SCORES}))
  opts = fc.FarOptions(full_heads=0.5, **{ranking: "scores.json"})
  np.testing.assert_array_equal(fc.map_of(ranking, (2, 2), opts, tmp_path), expected)


def test_far_context_other_maps(tmp_path):
  opts = fc.FarOptions(full_heads=1 / 3, duo_map="duo.json")
  (tmp_path / "duo.json").write_text(json.dumps([[0, 0, 1], [1, 0, 0]]))
  np.testing.assert_array_equal(fc.map_of("duo_attention", (2, 3), opts, tmp_path), [[0, 0, 1], [1, 0, 0]])
  assert fc.map_of("full", (2, 3), opts, tmp_path).all() and not fc.map_of("streaming", (2, 3), opts, tmp_path).any()
  r = fc.map_of("random7", (2, 3), opts, tmp_path)
  assert r.sum(1).tolist() == [1, 1]          # one of 3 per layer
  np.testing.assert_array_equal(r, fc.map_of("random7", (2, 3), opts, tmp_path))


def test_rank_p_by_hand():
  assert fc.p_worse(1.0, [2.0, 3.0, 4.0]) == 1.0 and fc.p_worse(5.0, [2.0, 3.0, 4.0]) == 0.25
  assert fc.p_worse(3.0, [2.0, 3.0, 4.0]) == 0.75
  assert fc.rank_p(1.0, [2.0, 3.0, 4.0]) == (1, 0.25)
  assert fc.rank_p(3.0, [2.0, 3.0, 4.0]) == (2, 0.75)      # a tie counts against the map in p
  assert fc.rank_p(5.0, [2.0, 3.0, 4.0]) == (4, 1.0)


def _run(text, arm, nll):
  return {"name": f"{text}_{arm}", "text": text, "arm": arm, "nll": list(nll), "commit": "abc",
          "meta": {"ids_sha256": text}}


def test_summary_by_hand():
  """Two texts of 300 positions, three random maps; the far map is best on news, second on code."""
  runs = {}
  level = {"news": {"far_attention": 0.5, "random0": 1.1, "random1": 1.2, "random2": 1.3},
           "code": {"far_attention": 2.05, "random0": 2.0, "random1": 2.1, "random2": 2.2}}
  for text, arms in level.items():
    for arm, v in arms.items():
      nll = np.full(300, v)
      if arm == "far_attention":
        nll[:256] = np.mean([arms[f"random{s}"] for s in range(3)])   # no gap in the first block
      runs[f"{text}_{arm}"] = _run(text, arm, nll)
  s = fc.summary(runs)
  assert s["texts"] == ["news", "code"] and s["maps"] == 3
  news, code = s["per_text"]["news"]["arms"]["far_attention"], s["per_text"]["code"]["arms"]["far_attention"]
  lp = lambda text, arm: math.fsum(runs[f"{text}_{arm}"]["nll"]) / 300
  assert news["rank"] == 1 and news["p_rank"] == 0.25
  far_code = lp("code", "far_attention")
  assert code["rank"] == 1 + sum(lp("code", f"random{k}") < far_code for k in range(3))
  assert news["nll_gap_share"] == pytest.approx([0.0, 0.0, 1.0], abs=1e-12)    # all of the gap after position 256
  assert news["nll_gap_block_mean"] == pytest.approx([0.0, 0.0, 0.7], abs=1e-12)
  assert news["nll_gap_total"] == pytest.approx(44 * (1.2 - 0.5))
  across = [np.mean([lp(t, f"random{k}") for t in ("news", "code")]) for k in range(3)]
  far = np.mean([lp(t, "far_attention") for t in ("news", "code")])
  assert s["across"]["far_attention"]["rank"] == 1 + sum(a < far for a in across)
  assert s["across"]["far_attention"]["p_rank"] == (1 + sum(a <= far for a in across)) / 4


def test_load_refuses_two_commits(tmp_path):
  for i, commit in enumerate(("a", "b")):
    rec = _run("news", f"random{i}", [1.0]) | {"commit": commit}
    (tmp_path / f"news_random{i}.json").write_text(json.dumps(rec))
  with pytest.raises(fc.StudyError, match="different commits"):
    fc.load(tmp_path)
