"""The passkey probe's per-key records (issue 35: outcomes stored key by key, so two caches can be paired): the
outcome of each key by hand from a hit matrix, and on a random model with the full cache, against greedy choices
taken from the model's own teacher-forced forward pass (no cache)."""
import numpy as np
import pytest

from sinkjax.errors import ConfigError
from sinkjax.data.tokenizers import ByteTokenizer
from sinkjax.experiments import passkey
from tests.test_generate import random_model


def test_key_outcomes_by_hand():
  hit = np.array([[0, 1, 1, 1, 1, 1, 1],           # a prompt target missed does not count: only the last 5
                  [1, 1, 1, 0, 1, 1, 0],
                  [0, 0, 0, 0, 0, 0, 0]], bool)
  right, digits = passkey.key_outcomes(hit, 5)
  assert right == [True, False, False] and digits == [5, 3, 0]


def test_batch_keys_are_the_keys_in_its_rows():
  tok = ByteTokenizer()
  b = passkey.passkey_batch(tok, 200, 0.5, 3, seed=4)
  assert len(b.keys) == 3 and all(tok.decode(row[-5:]) == k for row, k in zip(b.ids, b.keys))


def test_probe_records_every_keys_outcome():
  """Full cache on a random model: each key's digits right are the targets where the forward pass's argmax is the
  key token, its key_right whether all five are, and the cell's accuracies are their means."""
  model, _ = random_model(attention="sink", vocab_size=257, max_seq_len=256)
  tok = ByteTokenizer()
  recs = passkey.probe(model, tok, lengths=[120], depths=[0.5], samples=3, sink_size=2, window=16)
  full = [r for r in recs if r["mode"] == "full cache"]
  assert len(full) == 1
  for r in full:
    b = passkey.passkey_batch(tok, 120, r["depth"], 3, seed=0)
    logits = np.asarray(model(b.ids[:, :-1]))
    greedy = logits.argmax(-1) == b.ids[:, 1:]
    digits = greedy[:, -5:].sum(1).tolist()
    assert r["keys"] == list(b.keys) and r["digits_right"] == digits
    assert r["key_right"] == [d == 5 for d in digits]
    assert r["accuracy"] == pytest.approx(np.mean(r["key_right"]))
    assert r["digit_accuracy"] == pytest.approx(sum(digits) / 15)


def test_the_study_file_spells_the_probe():
  """configs/studies/passkey_tiny.yaml: the documented probe (lengths 256, 512 x five depths, W 64, 4 sinks, hybrid
  caches at F 0.25 and 0.5 with five random seeds), the head policy in a `cache:` section read as
  `cache_policy.CacheOptions` (the cache.* keys of sinkjax.generate); an override sets a policy key back to not
  given (None), and the probe's own section holds no policy key."""
  from sinkjax import cache_policy
  from sinkjax.experiments import runner
  plan = runner.load_plan(passkey.STUDY_FILE)
  sections = plan.options(passkey.SECTIONS)
  assert plan.axes == {"length": [256, 512], "depth": [0, 0.25, 0.5, 0.75, 1]} and plan.study.driver == "passkey"
  assert sections["passkey"] == passkey.PasskeyOptions(samples=8, sink_size=4, window=64, seed=0)
  assert sections["cache"] == cache_policy.CacheOptions(full_heads="0.25,0.5", full_heads_random="0,1,2,3,4")
  assert cache_policy.parse_amounts(sections["cache"].full_heads) == [0.25, 0.5]
  assert cache_policy.parse_seeds(sections["cache"].full_heads_random) == [0, 1, 2, 3, 4]
  pol = runner.load_plan(passkey.STUDY_FILE, ["cache.full_heads_random=null", "cache.full_heads_scope=global"]).options(
      passkey.SECTIONS)["cache"]
  assert pol.full_heads_random is None and pol.full_heads_from is None and cache_policy.wanted(pol)
  assert (pol.full_heads, pol.full_heads_scope) == ("0.25,0.5", "global")
  cache_policy.check(pol)
  with pytest.raises(ConfigError, match=r"^config key cache.full_heads_scope \(--full-heads-scope\) must be one of "
                                        r"layer\|global, got 'model' \(in .*passkey_tiny.yaml\)$"):
    runner.load_plan(passkey.STUDY_FILE, ["cache.full_heads_scope=model"]).options(passkey.SECTIONS)
  with pytest.raises(ConfigError, match="unknown option passkey.full_heads; the keys of passkey are"):
    runner.load_plan(passkey.STUDY_FILE, ["passkey.full_heads=0.5"]).options(passkey.SECTIONS)


def test_a_bad_study_value_is_one_line_naming_its_key(capsys):
  from sinkjax.experiments import study
  path = str(passkey.STUDY_FILE)
  assert study.main([path, "passkey.window=0"]) == 1
  assert capsys.readouterr().err.strip().splitlines() == [
      f"sinkjax.experiments.study: error: config key passkey.window must be >= 1, got 0 (in {path})"]
  assert study.main([path, "cache.full_heads_gqa=max"]) == 1
  assert capsys.readouterr().err.strip().splitlines() == [
      "sinkjax.experiments.study: error: config key cache.full_heads_gqa (--full-heads-gqa) must be one of "
      f"source|any|mean, got 'max' (in {path})"]
  assert study.main([path, "axes.depth=[0,1.5]"]) == 1
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "axis depth must list floats in [0, 1], got [0, 1.5]" in err[0], err


@pytest.mark.parametrize("name", ["results", "results_all_but_l0h3", "results_only_l0h3", "results_random_with_l0h3"])
def test_committed_tables_are_their_records(name):
  """docs/results/passkey_tiny's tables are `format_results` of the committed records: a row per mode and context,
  a column per depth (whole-key accuracy), the mean, the digits right and the KV bytes, each cell read back here."""
  import json
  root = passkey.runner.REPO / "docs" / "results" / "passkey_tiny"
  records = json.loads((root / f"{name}.json").read_text())
  md = (root / f"{name}.md").read_text()
  assert passkey.format_results(records) + "\n" == md
  for line in md.splitlines()[2:]:
    cells = [c.strip() for c in line.strip("|").split("|")]
    rows = [r for r in records if r["mode"] == cells[0] and r["context"] == int(cells[2])]
    depths = sorted({r["depth"] for r in records})
    acc = [next(r["accuracy"] for r in rows if r["depth"] == d) for d in depths]
    assert cells[3:3 + len(depths)] == [f"{a:.2f}" for a in acc] and cells[-3] == f"{np.mean(acc):.2f}"
    assert cells[1] == f"{rows[0]['full_heads']}/{rows[0]['heads']}" and cells[-1] == f"{rows[0]['kv_bytes']:,}"
