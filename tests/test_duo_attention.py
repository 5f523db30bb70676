"""DuoAttention's gate optimisation (`sinkjax.experiments.duo_attention`) on a tiny model: the map keeps each layer's
highest gates (hand-made gates), the samples put the needle where the options say and end with the question and the
key, and the optimisation behaves as its loss says (no penalty: the gates stay at the all-full optimum; a penalty
pulls them below 1; every gate stays in [0, 1]). The gate mixing itself: tests/test_head_masks.py."""
import json

import numpy as np
import pytest

from sinkjax.data import passkey
from sinkjax.experiments import duo_attention as duo
from tests.test_generate import random_model


def test_map_keeps_each_layers_highest_gates():
  alpha = np.asarray([[0.1, 0.9, 0.3], [0.8, 0.2, 0.7], [0.0, 0.05, 0.6]])
  np.testing.assert_array_equal(duo.gate_map(alpha, 0.25), [[0, 1, 0], [1, 0, 0], [0, 0, 1]])
  np.testing.assert_array_equal(duo.gate_map(alpha, 2), [[0, 1, 1], [1, 0, 1], [0, 1, 1]])


class ByteTokenizer:
  def encode_document(self, text):
    return list(text.encode("utf-8"))


def test_samples_hold_the_needle_early_and_end_with_question_and_key():
  opts = duo.DuoOptions(checkpoint="x", out="y", seq_len=400, depth=0.25, seed=3)
  hay = "".join(chr(97 + i % 26) for i in range(5000))
  it = duo.samples(ByteTokenizer(), hay, opts)
  for _ in range(5):
    s = bytes(next(it).tolist()).decode()
    assert len(s) == 400
    at = s.index("The pass key is #")
    key = s[at + len("The pass key is #"):][:passkey.KEY_DIGITS]
    assert s.endswith(" " + passkey.QUESTION + key + ".")
    assert 1 <= at <= 0.25 * 400


@pytest.fixture(scope="module")
def tiny():
  return random_model(num_layers=2, vocab_size=64)[0]


def _batches(seq_len=24):
  rng = np.random.RandomState(0)
  while True:
    yield rng.randint(0, 64, size=seq_len)


def test_without_penalty_the_gates_stay_full(tiny):
  opts = duo.DuoOptions(checkpoint="x", out="y", steps=3, seq_len=24, answer=6, window=8, sinks=2, l1=0.0, lr=0.1)
  alpha, losses = duo.optimise(tiny, _batches(), opts)
  np.testing.assert_array_equal(alpha, 1.0)       # at alpha = 1 the gated model is the teacher: loss 0, gradient 0
  assert losses == [0.0] * 3


def test_penalty_pulls_gates_down_within_bounds(tiny):
  opts = duo.DuoOptions(checkpoint="x", out="y", steps=4, seq_len=24, answer=6, window=8, sinks=2, l1=1.0, lr=0.3)
  alpha, losses = duo.optimise(tiny, _batches(), opts)
  assert alpha.shape == (2, 2)
  assert np.all((alpha >= 0) & (alpha <= 1)) and np.all(alpha < 1)
  assert all(np.isfinite(losses))
