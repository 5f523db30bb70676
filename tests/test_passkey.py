"""The passkey probe's per-key records (issue 35: outcomes stored key by key, so two caches can be paired): the
outcome of each key by hand from a hit matrix, and on a random model with the full cache, against greedy choices
taken from the model's own teacher-forced forward pass (no cache)."""
import numpy as np
import pytest

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
  caches at F 0.25 and 0.5 with five random seeds); an override empties a policy key, which cache_policy then reads
  as not given (None)."""
  from sinkjax import cache_policy
  from sinkjax.experiments import runner
  plan = runner.load_plan(passkey.STUDY_FILE)
  opts = plan.options("passkey", passkey.PasskeyOptions())
  assert plan.axes == {"length": [256, 512], "depth": [0, 0.25, 0.5, 0.75, 1]} and plan.study.kind == "passkey"
  assert (opts.samples, opts.sink_size, opts.window) == (8, 4, 64)
  assert cache_policy.parse_amounts(opts.full_heads) == [0.25, 0.5]
  assert cache_policy.parse_seeds(opts.full_heads_random) == [0, 1, 2, 3, 4]
  pol = runner.load_plan(passkey.STUDY_FILE, ["passkey.full_heads_random="]).options(
      "passkey", passkey.PasskeyOptions()).cache_options()
  assert isinstance(pol, cache_policy.CacheOptions)
  assert pol.full_heads_random is None and pol.full_heads_from is None and cache_policy.wanted(pol)
  assert (pol.full_heads, pol.full_heads_scope) == ("0.25,0.5", "layer")
  cache_policy.check(pol)
