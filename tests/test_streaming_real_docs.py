"""docs/STREAMING.md's "On real weights (SmolLM2-135M)" against its raw files (docs/results/streaming_real/*.json),
and its "the hybrid ranked within each layer" section against docs/results/streaming_real_layer/*.json.

Every quoted number is recomputed here from the per-position NLLs with plain Python and scipy, not with the
study's own report code: perplexities (math.fsum), the importance map's rank among the maps, the paired t (scipy),
the exact permutation test (every sign flip enumerated here), the sign test (scipy's binomial test), the blocks won,
the block-vs-step check and the importance measurement's size.
"""
import itertools
import json
import math
import pathlib
import re

import pytest
from scipy import stats as sps

ROOT = pathlib.Path(__file__).resolve().parents[1]
RAW = ROOT / "docs" / "results" / "streaming_real"
DOC = ROOT / "docs" / "STREAMING.md"
TITLE = "## On real weights (SmolLM2-135M)"
LAYER_RAW = ROOT / "docs" / "results" / "streaming_real_layer"
LAYER_TITLE = "## On real weights: the hybrid ranked within each layer"
STUDIES = [pytest.param((TITLE, RAW), id="global"), pytest.param((LAYER_TITLE, LAYER_RAW), id="layer")]


def section(title: str = TITLE) -> str:
  text = DOC.read_text()
  assert title in text, f"{DOC} has no section {title!r}"
  body = text.split(title, 1)[1]
  return body.split("\n## ", 1)[0]


def raw(name: str, base: pathlib.Path = RAW) -> dict:
  path = base / f"{name}.json"
  assert path.is_file(), f"{path} is missing (configs/studies/streaming_real.yaml makes it)"
  return json.loads(path.read_text())


def run_of(label: str) -> str:
  """The raw file a table row names, read from the label alone."""
  if label == "full cache":
    return "full"
  m = re.fullmatch(r"window only \(W (\d+)\)", label)
  if m:
    return f"window_w{m[1]}"
  m = re.fullmatch(r"(\d+) sinks \+ window \(W (\d+)\)", label)
  if m:
    return f"sinks{m[1]}_w{m[2]}"
  m = re.fullmatch(r"hybrid, importance(?:, within each layer)? \(W (\d+), \d+ sinks\)", label)
  if m:
    return f"hybrid_importance_w{m[1]}"
  m = re.fullmatch(r"hybrid, random seed (\d+)(?:, within each layer)? \(W (\d+), \d+ sinks\)", label)
  assert m, f"unknown row label {label!r}"
  return f"hybrid_random{m[1]}_w{m[2]}"


def table(title: str = TITLE) -> dict:
  rows = {}
  for line in section(title).splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 7 and cells[0] not in ("cache", "---") and not cells[0].startswith("-"):
      rows[cells[0]] = cells
  assert rows, "no table rows in the section"
  return rows


def ppl(nll) -> float:
  return math.exp(math.fsum(nll) / len(nll))


def test_every_table_row_is_its_raw_file():
  rows = table()
  names = {run_of(label) for label in rows}
  expect = {"full", "window_w256", "sinks4_w256", "window_w1024", "sinks4_w1024", "hybrid_importance_w256"}
  assert expect <= names and sum(n.startswith("hybrid_random") for n in names) >= 5
  for label, cells in rows.items():
    r = raw(run_of(label))
    nll = r["nll"]
    assert len(nll) == r["tokens"] - 1 >= 8191, label
    w = r["window"] or 256
    for got, want in zip(cells[2:5], (ppl(nll), ppl(nll[:w - 1]), ppl(nll[w - 1:]))):
      assert abs(float(got) - want) <= 5.01e-4, (label, got, want)
    heads = cells[1].split("/")
    assert int(heads[0]) == (90 if r["kind"] == "full" else sum(map(sum, r.get("map", [[0]])))), label
    assert int(cells[5].replace(",", "")) == r["kv_bytes"], label
    assert abs(float(cells[6]) - r["seconds"]) <= 0.51, label


def test_the_layer_table_rows_are_their_raw_files():
  """The within-layer study: every row is its raw file; every map keeps the same number of full KV heads in every
  layer (1 of 3 at F = 0.25: round half up of 0.75), the importance map the most important KV head of each layer."""
  rows = table(LAYER_TITLE)
  assert {run_of(label) for label in rows} == {"hybrid_importance_w256", *(f"hybrid_random{s}_w256" for s in range(5))}
  for label, cells in rows.items():
    r = raw(run_of(label), LAYER_RAW)
    assert r["scope"] == "layer" and all(sum(row) == 1 for row in r["map"]), label
    nll = r["nll"]
    assert len(nll) == r["tokens"] - 1 >= 8191, label
    for got, want in zip(cells[2:5], (ppl(nll), ppl(nll[:255]), ppl(nll[255:]))):
      assert abs(float(got) - want) <= 5.01e-4, (label, got, want)
    assert int(cells[1].split("/")[0]) == sum(map(sum, r["map"])) == 30, label
    assert int(cells[5].replace(",", "")) == r["kv_bytes"] and abs(float(cells[6]) - r["seconds"]) <= 0.51, label
  imp = raw("importance", LAYER_RAW)["importance"]        # [L][9 query heads]; a KV head = its best of 3 query heads
  kv = [[max(layer[3 * g:3 * g + 3]) for g in range(3)] for layer in imp]
  want = [[int(g == max(range(3), key=lambda h: (row[h], -h))) for g in range(3)] for row in kv]
  assert raw("hybrid_importance_w256", LAYER_RAW)["map"] == want
  # the same tokens as the global study, scored by the same model
  assert raw("hybrid_importance_w256", LAYER_RAW)["meta"]["ids_sha256"] == raw("full")["meta"]["ids_sha256"]


@pytest.mark.parametrize("base", [RAW, LAYER_RAW], ids=["global", "layer"])
def test_one_token_sequence_and_one_commit(base):
  runs = [json.loads(p.read_text()) for p in sorted(base.glob("*.json")) if p.name != "results.json"]
  scored = [r for r in runs if "nll" in r]
  assert len({r["meta"]["ids_sha256"] for r in scored}) == 1
  assert len({r["commit"] for r in runs}) == 1 and not any(r.get("dirty") for r in runs)


def _hybrids(base: pathlib.Path = RAW):
  imp = raw("hybrid_importance_w256", base)
  randoms = sorted((json.loads(p.read_text()) for p in base.glob("hybrid_random*_w256.json")), key=lambda r: r["seed"])
  return imp, randoms


@pytest.mark.parametrize("study", STUDIES)
def test_rank_and_paired_tests_are_the_raw_files(study):
  title, base = study
  text = " ".join(section(title).split())
  imp, randoms = _hybrids(base)
  k = len(randoms)
  assert all(sum(map(sum, r["map"])) == sum(map(sum, imp["map"])) for r in randoms)   # the same size
  p_imp = ppl(imp["nll"])
  d = [ppl(r["nll"]) - p_imp for r in randoms]
  rank = 1 + sum(x < 0 for x in d)
  m = re.search(r"rank (\d+) of (\d+) maps \(p = (\d+)/(\d+) = ([0-9.]+)", text)
  assert m and (int(m[1]), int(m[2])) == (rank, k + 1) and abs(float(m[5]) - rank / (k + 1)) < 5e-4
  mean = sum(d) / k
  t = sps.ttest_1samp(d, 0.0)
  m = re.search(r"t_(\d+) = ([+-]?[0-9.]+), p = ([0-9.e-]+)\)", text)
  assert m and int(m[1]) == k - 1 and abs(float(m[2]) - t.statistic) < 0.006
  assert math.isclose(float(m[3]), t.pvalue, rel_tol=0.06)
  m = re.search(r"random map - importance map: ([+-][0-9.]+) on average", text)
  assert m and abs(float(m[1]) - mean) < 5.01e-4
  flips = [sum(s * x for s, x in zip(signs, d)) for signs in itertools.product((1, -1), repeat=k)]
  p_perm = sum(abs(f) >= abs(sum(d)) - 1e-12 for f in flips) / len(flips)
  m = re.search(r"exact permutation p = ([0-9.e-]+), sign test p = ([0-9.e-]+)", text)
  assert m and math.isclose(float(m[1]), p_perm, rel_tol=0.06)
  positive = sum(x > 0 for x in d)
  p_sign = sps.binomtest(positive, sum(x != 0 for x in d), 0.5).pvalue
  assert math.isclose(float(m[2]), p_sign, rel_tol=0.06)


@pytest.mark.parametrize("study", STUDIES)
def test_blocks_won_are_the_raw_files(study):
  title, base = study
  imp, randoms = _hybrids(base)
  n = len(imp["nll"]) // 512
  block = lambda nll, b: math.fsum(nll[b * 512:(b + 1) * 512]) / 512
  won = [sum(block(imp["nll"], b) < block(r["nll"], b) for b in range(n)) for r in randoms]
  m = re.search(r"blocks won by the importance map, per random map: \[([0-9, ]+)\] of (\d+)",
                " ".join(section(title).split()))
  assert m and [int(x) for x in m[1].split(",")] == won and int(m[2]) == n


def test_check_and_importance_numbers():
  text = " ".join(section().split())
  check = raw("check")["modes"]
  for mode, words in (("sinks", "4 sinks + W 256"), ("full", "full cache")):
    m = re.search(re.escape(words) + r": largest \|Δ NLL\| ([0-9.e-]+)", text)
    assert m and math.isclose(float(m[1]), check[mode]["max_abs_diff"], rel_tol=0.06), mode
  imp = raw("importance")
  m = re.search(r"importance .*?over (\d+) documents \(([0-9,]+) tokens\)", text)
  assert m and int(m[1]) == imp["documents"] and int(m[2].replace(",", "")) == imp["tokens"]


def test_map_importance_and_timing_sentences():
  text = " ".join(section().split())
  imp_map = raw("hybrid_importance_w256")["map"]
  m = re.search(r"keeps \[([0-9, ]+)\] full heads per layer", text)
  assert m and [int(x) for x in m[1].split(",")] == [sum(r) for r in imp_map]
  low = sum(x < 0.1 for row in raw("importance")["importance"] for x in row)
  m = re.search(r"(\d+) of 270 query heads have importance < 0\.1", text)
  assert m and int(m[1]) == low
  secs = {n: raw(n)["seconds"] for n in ("sinks4_w256", "window_w256", "sinks4_w1024", "window_w1024", "full")}
  streaming = [secs[n] for n in secs if n != "full"]
  hybrid = [json.loads(p.read_text())["seconds"] for p in RAW.glob("hybrid_*_w256.json")]
  m = re.search(r"(\d+)–(\d+) s per streaming cache, (\d+) s for the full cache, (\d+)–(\d+) s per hybrid", text)
  assert m and [int(x) for x in m.groups()] == [round(min(streaming)), round(max(streaming)), round(secs["full"]),
                                                  round(min(hybrid)), round(max(hybrid))]


# ---------------------------------------------------------------------------------------------------------------
# "A head ranking that measures far context": docs/results/streaming_far/*.json
# ---------------------------------------------------------------------------------------------------------------

FAR_RAW = ROOT / "docs" / "results" / "streaming_far"
FAR_TITLE = "## On real weights: a head ranking that measures far context"
FAR_LABELS = {"far_attention": "far-context attention", "importance": "importance"}   # ranking -> its words


def far_run_of(label: str) -> str:
  for ranking, words in FAR_LABELS.items():
    if label == f"hybrid, {words}, within each layer (W 256, 4 sinks)":
      return f"hybrid_{ranking}_w256"
  m = re.fullmatch(r"hybrid, random seed (\d+), within each layer \(W 256, 4 sinks\)", label)
  assert m, f"unknown row label {label!r}"
  return f"hybrid_random{m[1]}_w256"


def far_randoms() -> list:
  return sorted((json.loads(p.read_text()) for p in FAR_RAW.glob("hybrid_random*_w256.json")), key=lambda r: r["seed"])


def per_layer_top(scores, group: str) -> list:
  """The 0/1 map of one full KV head per layer: the KV head (3 query heads each) with the highest score of its
  group (max or mean), the lower index on ties."""
  out = []
  for row in scores:
    kv = [(max if group == "max" else lambda xs: sum(xs) / 3)(row[3 * g:3 * g + 3]) for g in range(3)]
    best = max(range(3), key=lambda g: (kv[g], -g))
    out.append([int(g == best) for g in range(3)])
  return out


def test_far_table_rows_are_their_raw_files_and_maps_their_rankings():
  """Every row of the section's table is its raw file; every map keeps 1 of 3 KV heads full in every layer; the
  far-context map is each layer's KV head with the most far-context attention (mean of its query heads), the
  importance map each layer's KV head with the most important query head, both recomputed from their measurements;
  ten random maps or more; the far-context calibration text is not the scored text."""
  rows = table(FAR_TITLE)
  names = {far_run_of(label) for label in rows}
  assert {"hybrid_far_attention_w256", "hybrid_importance_w256"} <= names
  assert sum(n.startswith("hybrid_random") for n in names) >= 10 and len(names) == len(rows)
  for label, cells in rows.items():
    r = raw(far_run_of(label), FAR_RAW)
    assert r["scope"] == "layer" and r["window"] == 256 and r["sink_size"] == 4 and r["full_heads"] == 0.25, label
    assert all(sum(row) == 1 for row in r["map"]) and len(r["map"]) == 30, label
    nll = r["nll"]
    assert len(nll) == r["tokens"] - 1 == r["meta"]["tokens"] - 1, label
    for got, want in zip(cells[2:5], (ppl(nll), ppl(nll[:255]), ppl(nll[255:]))):
      assert abs(float(got) - want) <= 5.01e-4, (label, got, want)
    assert int(cells[1].split("/")[0]) == sum(map(sum, r["map"])) == 30, label
    assert int(cells[5].replace(",", "")) == r["kv_bytes"] and abs(float(cells[6]) - r["seconds"]) <= 0.51, label
  far = raw("far_attention", FAR_RAW)
  assert raw("hybrid_far_attention_w256", FAR_RAW)["map"] == per_layer_top(far["far_attention"], "mean")
  assert raw("hybrid_importance_w256", FAR_RAW)["map"] == per_layer_top(raw("importance", FAR_RAW)["importance"], "max")
  assert (far["sink_size"], far["window"]) == (4, 256) and "docstrings" in far["text"]
  assert "pydoc_data.topics" in raw("hybrid_far_attention_w256", FAR_RAW)["meta"]["text"]


def test_far_runs_are_one_commit_and_one_token_sequence():
  runs = [json.loads(p.read_text()) for p in sorted(FAR_RAW.glob("*.json")) if p.name != "results.json"]
  scored = [r for r in runs if "nll" in r]
  assert len({r["meta"]["ids_sha256"] for r in scored}) == 1 and len(scored) >= 12
  assert len({r["commit"] for r in runs}) == 1 and not any(r.get("dirty") for r in runs)
  m = re.search(r"Commit `([0-9a-f]+)`", section(FAR_TITLE))
  assert m and runs[0]["commit"].startswith(m[1])


@pytest.mark.parametrize("ranking", sorted(FAR_LABELS))
def test_far_rank_and_differences_are_the_raw_files(ranking):
  """Per ranked map: its rank among the maps and its p (the one test 10 random maps carry, at least 1/11), and the
  per-map differences (random - ranked perplexity: mean, each), in the sentence that names this map; no paired t,
  sign-flip or sign test is quoted (the differences share the one ranked map, so they are not independent draws)."""
  words = FAR_LABELS[ranking]
  text = " ".join(section(FAR_TITLE).split())
  ranked, randoms = raw(f"hybrid_{ranking}_w256", FAR_RAW), far_randoms()
  k = len(randoms)
  d = [ppl(r["nll"]) - ppl(ranked["nll"]) for r in randoms]
  rank = 1 + sum(x < 0 for x in d)
  m = re.search(re.escape(words) + r" map: rank (\d+) of (\d+) maps \(p = (\d+)/(\d+) = ([0-9.]+)", text, re.I)
  assert m and (int(m[1]), int(m[2])) == (rank, k + 1) and abs(float(m[5]) - rank / (k + 1)) < 5e-4
  s = text.split(f"random map - {words} map:", 1)[1]
  m = re.match(r" ([+-][0-9.]+) on average \(per seed ([0-9.,+ -]+);", s)
  assert m and abs(float(m[1]) - sum(d) / k) < 5.01e-4
  assert [abs(float(x) - y) < 5.01e-4 for x, y in zip(m[2].split(","), d)] == [True] * k
  m = re.search(r"cannot go below 1/(\d+) = ([0-9.]+)", text)
  assert m and int(m[1]) == k + 1 and abs(float(m[2]) - 1 / (k + 1)) < 5e-4
  for claim in ("t-interval", "exact permutation p", "sign test p", "t_9"):
    assert claim not in text, claim
  n = len(ranked["nll"]) // 512
  block = lambda nll, b: math.fsum(nll[b * 512:(b + 1) * 512]) / 512
  won = [sum(block(ranked["nll"], b) < block(r["nll"], b) for b in range(n)) for r in randoms]
  m = re.search(r"blocks won by the " + re.escape(words) + r" map, per random map: \[([0-9, ]+)\] of (\d+)", text)
  assert m and [int(x) for x in m[1].split(",")] == won and int(m[2]) == n


def test_far_between_maps_where_and_size_sentences():
  """The two ranked maps against each other (perplexities, their difference, heads shared), where the far-context
  attention is (all heads, layers 0-10, layers 11-29), the calibration's and the scored text's sizes."""
  text = " ".join(section(FAR_TITLE).split())
  far_map, imp_map = (raw(f"hybrid_{r}_w256", FAR_RAW) for r in ("far_attention", "importance"))
  p_far, p_imp = ppl(far_map["nll"]), ppl(imp_map["nll"])
  m = re.search(r"far-context map scores ([0-9.]+) below the importance map \(([0-9.]+) against ([0-9.]+)\); the two "
                r"share (\d+) of their (\d+) full heads", text)
  assert m and abs(float(m[1]) - (p_imp - p_far)) < 5.01e-4 and abs(float(m[2]) - p_far) < 5.01e-4
  assert abs(float(m[3]) - p_imp) < 5.01e-4
  shared = sum(a & b for ra, rb in zip(far_map["map"], imp_map["map"]) for a, b in zip(ra, rb))
  assert int(m[4]) == shared and int(m[5]) == 30
  m = re.search(r"they keep the same head in (\d+) of 30 layers", text)
  assert m and int(m[1]) == shared
  far = raw("far_attention", FAR_RAW)["far_attention"]
  mean = lambda rows: math.fsum(x for row in rows for x in row) / sum(len(row) for row in rows)
  m = re.search(r"Averaged over its 270 query heads, SmolLM2 puts ([0-9.]+) of a query's attention on keys a W 256 "
                r"streaming cache has evicted \(on the calibration text\); layers 0–10 put ([0-9.]+) there, layers "
                r"11–29 ([0-9]+\.[0-9]+)", text)
  assert m and len(far) == 30 and all(len(row) == 9 for row in far)
  for got, want in zip(m.groups(), (mean(far), mean(far[:11]), mean(far[11:]))):
    assert abs(float(got) - want) < 5.01e-4
  rec = raw("far_attention", FAR_RAW)
  m = re.search(r"its first ([0-9,]+) tokens in (\d+) rows of ([0-9,]+)", text)
  assert m and int(m[1].replace(",", "")) == rec["tokens"] == rec["rows"] * rec["seq_len"]
  assert (int(m[2]), int(m[3].replace(",", ""))) == (rec["rows"], rec["seq_len"])
  m = re.search(r"Only the first ([0-9,]+) tokens of the help topics are scored\*\* \(([0-9,]+) positions", text)
  assert m and int(m[1].replace(",", "")) == far_map["tokens"] and int(m[2].replace(",", "")) == len(far_map["nll"])
  # the importance map and random maps 0-4 are the within-layer section's maps
  for name in ["hybrid_importance_w256"] + [f"hybrid_random{s}_w256" for s in range(5)]:
    assert raw(name, FAR_RAW)["map"] == raw(name, LAYER_RAW)["map"], name


def test_far_attention_source_of_cache_policy_picks_the_studys_map():
  """What the section says `cache_policy` offers: --full-heads-by far_attention with the study's far_attention.json
  as --head-scores and --full-heads 0.25 (scope layer, the source's own GQA rule) is the study's far-context map."""
  import types
  from sinkjax import cache_policy
  opts = cache_policy.CacheOptions(full_heads="0.25", full_heads_by="far_attention",
                                   head_scores=str(FAR_RAW / "far_attention.json"))
  assert "--full-heads-by far_attention --head-scores docs/results/streaming_far/far_attention.json" in \
      " ".join(section(FAR_TITLE).split())
  [(_, full)] = cache_policy.policies_from(opts, types.SimpleNamespace(num_layers=30, num_heads=9, num_kv_heads=3),
                                           FAR_RAW)
  assert full.astype(int).tolist() == raw("hybrid_far_attention_w256", FAR_RAW)["map"]
