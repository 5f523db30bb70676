"""docs/STREAMING.md's "On real weights: the far-context ranking on three texts" against its raw files
(docs/results/far_context/*.json, docs/results/far_context_duo/*.json).

Every quoted number is recomputed here from the per-position NLLs with plain Python, not with the study's report
code: perplexities (math.fsum), each map's rank among the random maps and its p on every text and on the mean over
texts of the log perplexity, the random maps' spread, the share of the NLL gap per block of positions, the
DuoAttention map against the far-context map; and the runs' design: 99 random maps or more, the same on every text,
one commit per study, one token sequence per text, each named map what its measurement says.
"""
import json
import math
import pathlib
import re
import statistics

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
MAIN = ROOT / "docs" / "results" / "far_context"
DUO = ROOT / "docs" / "results" / "far_context_duo"
DOC = ROOT / "docs" / "STREAMING.md"
TITLE = "## On real weights: the far-context ranking on three texts"
TEXTS = ("news", "dialogue", "code")
LABELS = {"far-context attention": "far_attention", "importance (eq. 5)": "importance",
          "DuoAttention gates": "duo_attention", "every head full": "full",
          "no head full (sinks + window)": "streaming"}
RANKED = ("far_attention", "importance", "duo_attention")
BLOCK = 128


def section() -> str:
  text = DOC.read_text()
  assert TITLE in text, f"{DOC} has no section {TITLE!r}"
  return text.split(TITLE, 1)[1].split("\n## ", 1)[0]


def flat() -> str:
  return " ".join(section().split())


def runs_of(base: pathlib.Path) -> dict:
  out = {}
  for p in sorted(base.glob("*.json")):
    r = json.loads(p.read_text())
    if isinstance(r, dict) and "arm" in r:
      out[(r["text"], r["arm"])] = r
  assert out, f"{base} holds no runs (configs/studies/far_context*.yaml make them)"
  return out


@pytest.fixture(scope="module")
def runs() -> dict:
  return {**runs_of(MAIN), **runs_of(DUO)}


def log_ppl(r) -> float:
  return math.fsum(r["nll"]) / len(r["nll"])


def seeds_of(runs) -> list[int]:
  return sorted({int(a[6:]) for (_, a) in runs if a.startswith("random")})


def rank_p(value, randoms):
  return 1 + sum(x < value for x in randoms), (1 + sum(x <= value for x in randoms)) / (len(randoms) + 1)


def test_design_99_random_maps_on_three_texts_one_commit_each(runs):
  seeds = seeds_of(runs)
  assert len(seeds) >= 99
  for t in TEXTS:
    assert all((t, f"random{s}") in runs for s in seeds), t
    assert len({r["meta"]["ids_sha256"] for (tt, _), r in runs.items() if tt == t}) == 1, t
    assert all(len(r["nll"]) == r["tokens"] - 1 for (tt, _), r in runs.items() if tt == t)
  for s in seeds:                                    # the same map on every text, one full KV head per layer
    maps = [runs[(t, f"random{s}")]["map"] for t in TEXTS]
    assert maps[0] == maps[1] == maps[2] and all(sum(row) == 1 for row in maps[0])
  assert len({json.dumps(runs[("news", f"random{s}")]["map"]) for s in seeds}) == len(seeds)   # distinct maps
  for base in (MAIN, DUO):
    recs = runs_of(base).values()
    assert len({r["commit"] for r in recs}) == 1 and not any(r.get("dirty") for r in recs), base
    m = re.search(re.escape(base.name) + r"/\S* (?:at|from) commit `([0-9a-f]+)`", flat())
    assert m and next(iter(recs))["commit"].startswith(m[1]), base.name
  assert len({r["meta"]["ids_sha256"] for r in runs.values()}) == 3
  for r in runs.values():
    assert r["meta"]["source"].split(":")[0] in flat(), r["meta"]["source"]


def _top(rows, rule):
  """Per layer, 1 if the KV head (3 query heads each) scores highest by `rule` (ties: lower index), else 0."""
  out = []
  for row in rows:
    kv = [rule(row[3 * g:3 * g + 3]) for g in range(len(row) // 3)]
    best = max(range(len(kv)), key=lambda h: (kv[h], -h))
    out.append([int(h == best) for h in range(len(kv))])
  return out


def test_named_maps_are_their_measurements(runs):
  far = json.loads((ROOT / "docs/results/streaming_far/far_attention.json").read_text())["far_attention"]
  imp = json.loads((ROOT / "docs/results/streaming_far/importance.json").read_text())["importance"]
  alpha = json.loads((DUO / "duo_gates.json").read_text())["alpha"]
  duo = [[int(h == max(range(len(row)), key=lambda g: (row[g], -g))) for h in range(len(row))] for row in alpha]
  assert json.loads((DUO / "duo_map.json").read_text()) == duo
  for t in TEXTS:
    assert runs[(t, "far_attention")]["map"] == _top(far, lambda x: sum(x) / 3)
    assert runs[(t, "importance")]["map"] == _top(imp, max)
    assert runs[(t, "duo_attention")]["map"] == duo
    assert all(all(row) for row in runs[(t, "full")]["map"]) and not any(map(any, runs[(t, "streaming")]["map"]))


def table_rows() -> dict:
  rows = {}
  for line in section().splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if len(cells) == 8 and cells[0] not in ("map", "---") and not cells[0].startswith("-"):
      rows[cells[0]] = cells
  assert rows, "no table rows in the section"
  return rows


def test_table_is_the_raw_files(runs):
  rows = table_rows()
  seeds = seeds_of(runs)
  n = len(seeds)
  assert set(LABELS) <= set(rows)
  rnd = {t: [log_ppl(runs[(t, f"random{s}")]) for s in seeds] for t in TEXTS}
  across_rnd = [sum(rnd[t][i] for t in TEXTS) / 3 for i in range(n)]
  for label, arm in LABELS.items():
    cells = rows[label]
    for t, got in zip(TEXTS, cells[1:4]):
      assert abs(float(got) - math.exp(log_ppl(runs[(t, arm)]))) <= 5.01e-4, (label, t)
    for t, got in zip(TEXTS, cells[4:7]):
      if arm not in RANKED:
        assert got == "", (label, t)
        continue
      rank, p = rank_p(log_ppl(runs[(t, arm)]), rnd[t])
      m = re.fullmatch(r"(\d+) of (\d+) \(([0-9.]+)\)", got)
      assert m and (int(m[1]), int(m[2])) == (rank, n + 1) and abs(float(m[3]) - p) < 5.01e-4, (label, t, got)
    if arm in RANKED:
      rank, p = rank_p(sum(log_ppl(runs[(t, arm)]) for t in TEXTS) / 3, across_rnd)
      m = re.fullmatch(r"(\d+) of (\d+) \(([0-9.]+)\)", cells[7])
      assert m and (int(m[1]), int(m[2])) == (rank, n + 1) and abs(float(m[3]) - p) < 5.01e-4, label
  spread = rows["random maps: min / median / max"]
  for t, got in zip(TEXTS, spread[1:4]):
    want = [math.exp(min(rnd[t])), math.exp(statistics.median(rnd[t])), math.exp(max(rnd[t]))]
    assert [abs(float(x) - y) <= 5.01e-4 for x, y in zip(got.split(" / "), want)] == [True] * 3, t


def test_p_worse_is_the_raw_files(runs):
  seeds = seeds_of(runs)
  text = flat()
  worse = lambda v, rs: (1 + sum(x >= v for x in rs)) / (len(rs) + 1)
  for label, arm in LABELS.items():
    if arm not in RANKED:
      continue
    m = re.search(re.escape(label[0].upper() + label[1:]) + r" map, p for worse than a random map: news (\d\.\d+), "
                  r"dialogue (\d\.\d+), code (\d\.\d+), all texts (\d\.\d+)", text)
    assert m, label
    rnd = {t: [log_ppl(runs[(t, f"random{s}")]) for s in seeds] for t in TEXTS}
    for t, got in zip(TEXTS, m.groups()):
      assert abs(float(got) - worse(log_ppl(runs[(t, arm)]), rnd[t])) < 5.01e-4, (label, t)
    across = [sum(rnd[t][i] for t in TEXTS) / 3 for i in range(len(seeds))]
    assert abs(float(m[4]) - worse(sum(log_ppl(runs[(t, arm)]) for t in TEXTS) / 3, across)) < 5.01e-4, label


def test_gap_by_position_is_the_raw_files(runs):
  seeds = seeds_of(runs)
  text = flat()
  for label, arm in LABELS.items():
    if arm not in RANKED:
      continue
    m = re.search(re.escape(label[0].upper() + label[1:]) + r" map: NLL gap \(mean random map - this map, nats per position\) "
                  rf"per {BLOCK}-position block: news ([^;]+); dialogue ([^;]+); code (.+?\d)\.(?: |$)", text)
    assert m, label
    for t, got in zip(TEXTS, m.groups()):
      rs = [runs[(t, f"random{s}")]["nll"] for s in seeds]
      gap = [math.fsum(r[i] for r in rs) / len(rs) - runs[(t, arm)]["nll"][i] for i in range(len(rs[0]))]
      want = [math.fsum(gap[i:i + BLOCK]) / len(gap[i:i + BLOCK]) for i in range(0, len(gap), BLOCK)]
      vals = [float(x) for x in got.split(",")]
      assert len(vals) == len(want) and all(abs(a - b) <= 5.01e-4 for a, b in zip(vals, want)), (label, t)


def test_duo_against_far_is_the_raw_files(runs):
  m = re.search(r"Perplexity, DuoAttention gates map - far-context attention map: news ([+-]\d+\.\d+), dialogue "
                r"([+-]\d+\.\d+), code ([+-]\d+\.\d+)", flat())
  assert m
  for t, got in zip(TEXTS, m.groups()):
    want = math.exp(log_ppl(runs[(t, "duo_attention")])) - math.exp(log_ppl(runs[(t, "far_attention")]))
    assert abs(float(got) - want) <= 5.01e-4, t


def _nth(text: str, pattern: str):
  m = re.search(pattern, text)
  assert m, pattern
  return m


def test_prose_numbers_are_the_raw_files(runs):
  """The numbers the bullets repeat in words: ranks and p per text and across, the two ends, the spread on code, the
  scored length, the timings (this study's and the chunked path's in the section above)."""
  text = flat()
  seeds = seeds_of(runs)
  rnd = {t: [log_ppl(runs[(t, f"random{s}")]) for s in seeds] for t in TEXTS}
  across = [sum(rnd[t][i] for t in TEXTS) / 3 for i in range(len(seeds))]
  rank = lambda t, arm: rank_p(log_ppl(runs[(t, arm)]), rnd[t])
  rank_all = lambda arm: rank_p(sum(log_ppl(runs[(t, arm)]) for t in TEXTS) / 3, across)
  m = _nth(text, r"It ranks (\d+)\w\w, (\d+)\w\w and (\d+)\w\w of 100 on news, dialogue and code \(p ([0-9.]+), "
                 r"([0-9.]+), ([0-9.]+)\)")
  for i, t in enumerate(TEXTS):
    r, p = rank(t, "far_attention")
    assert int(m[1 + i]) == r and abs(float(m[4 + i]) - p) < 5e-3, t
  m = _nth(text, r"the far-context map is (\d+)\w\w of 100, p = ([0-9.]+), so")
  assert (int(m[1]), round(float(m[2]), 2)) == (rank_all("far_attention")[0], round(rank_all("far_attention")[1], 2))
  assert rank("news", "importance")[0] == 100 and "as on the help topics: last of 100 there" in text
  worse = lambda v, rs: (1 + sum(x >= v for x in rs)) / (len(rs) + 1)
  m = _nth(text, r"Eq\. 5's importance map is again among the worst \(all texts: (\d+)\w\w of 100, p = ([0-9.]+) for "
                 r"worse than chance; news: last\)")
  imp_all = sum(log_ppl(runs[(t, "importance")]) for t in TEXTS) / 3
  assert int(m[1]) == rank_all("importance")[0] and abs(float(m[2]) - worse(imp_all, across)) < 5e-3
  m = _nth(text, r"DuoAttention map: (\d+)\w\w, (\d+)\w\w and (\d+)\w\w of 100")
  assert [int(x) for x in m.groups()] == [rank(t, "duo_attention")[0] for t in TEXTS]
  m = _nth(text, r"On all texts the far-context map is (\d+)\w\w of 100 and DuoAttention's (\d+)\w\w\.")
  assert (int(m[1]), int(m[2])) == (rank_all("far_attention")[0], rank_all("duo_attention")[0])
  assert f"worse still (all texts: {rank_all('duo_attention')[0]}th)" in text
  m = _nth(text, r"on news the full cache scores ([0-9.]+) against ([0-9.]+) with no head full, on dialogue ([0-9.]+) "
                 r"against ([0-9.]+), on code ([0-9.]+) against ([0-9.]+); on code the random maps range "
                 r"([0-9.]+)–([0-9.]+),")
  want = [math.exp(log_ppl(runs[(t, a)])) for t in TEXTS for a in ("full", "streaming")]
  want += [math.exp(min(rnd["code"])), math.exp(max(rnd["code"]))]
  assert all(abs(float(g) - w) <= 5.01e-4 for g, w in zip(m.groups(), want))
  m = _nth(text, r"the far context is worth ([0-9.]+) perplexity on news and ([0-9.]+) on code")
  assert abs(float(m[1]) - (want[1] - want[0])) <= 1.01e-3 and abs(float(m[2]) - (want[5] - want[4])) <= 1.01e-3
  n = len(runs[("news", "full")]["nll"])
  m = _nth(text, r"The first (\d+) tokens of each text are scored\*\* \((\d+) scored targets, the (\d+) after the first "
                 r"(\d+)")
  assert [int(x) for x in m.groups()] == [n + 1, n, n - 256, 256] and all(len(r["nll"]) == n for r in runs.values())
  secs = sorted(r["seconds"] for r in runs.values())
  m = _nth(text, r"A map took ([0-9.]+) s of wall time at the median \(([0-9.]+)–([0-9.]+) s,")
  assert (float(m[1]), float(m[2]), float(m[3])) == (round(statistics.median(secs), 1), secs[0], secs[-1])
  old = [json.loads(p.read_text())["seconds"] for p in (ROOT / "docs/results/streaming_far").glob("hybrid_*.json")]
  m = _nth(text, r"64-token chunks took (\d+)–(\d+) s per map at 2,048 tokens")
  assert (int(m[1]), int(m[2])) == (round(min(old)), round(max(old)))


def test_duo_training_sentences_are_its_record(runs):
  g = json.loads((DUO / "duo_gates.json").read_text())
  o, alpha = g["options"], g["alpha"]
  text = flat()
  m = _nth(text, r"over the last (\d+) positions \(the question and the key\)")
  assert int(m[1]) == o["answer"]
  m = _nth(text, r"\+ ([0-9.]+) × the sum of the gates; Adam \(lr ([0-9.]+)\)")
  assert (float(m[1]), float(m[2])) == (o["l1"], o["lr"])
  assert o["depth"] == 0.25 and "in the first quarter of" in text and (o["window"], o["sinks"]) == (256, 4)
  m = _nth(text, r"(\d+) steps of one (\d+)-token sample \(([0-9,]+) s\)")
  assert (int(m[1]), int(m[2])) == (o["steps"], o["seq_len"]) == (len(g["loss"]), o["seq_len"])
  assert int(m[3].replace(",", "")) == round(g["seconds"])
  flat_alpha = [x for row in alpha for x in row]
  m = _nth(text, r"(\d+) of the 90 gates sit at 1 and (\d+) at 0, and in (\d+) layers \(([0-9, ]+)\) two or three "
                 r"gates tie at 1")
  ties = [i for i, row in enumerate(alpha) if sorted(row)[-1] == sorted(row)[-2]]
  assert (int(m[1]), int(m[2])) == (flat_alpha.count(1.0), flat_alpha.count(0.0)) and len(flat_alpha) == 90
  assert int(m[3]) == len(ties) and [int(x) for x in m[4].split(",")] == ties
  assert all(alpha[i][0] == 1.0 or alpha[i][1] == 1.0 for i in ties)
  m = _nth(text, r"Its map keeps the far-context map's head in (\d+) of 30 layers")
  far, duo = runs[("news", "far_attention")]["map"], runs[("news", "duo_attention")]["map"]
  assert int(m[1]) == sum(a == b for a, b in zip(far, duo))
  assert g["commit"] == "ca968cfc17a9" and g["commit"] in text and not g["dirty"]
