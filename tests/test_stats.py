"""`sinkjax.stats` against independent computations: scipy's t-test, permutation test, binomial test and
Welch test, a Monte Carlo of the power, and hand-computed values; the readings' wording against what the tests
allow."""
import itertools
import math

import numpy as np
import pytest
from scipy import stats as sps

from sinkjax import stats

DIFFS = [[-0.145, -0.160, -0.013], [-0.281, -0.266, -0.132], [0.0097, 0.0061, 0.0071], [0.3, -0.1, 0.2, 0.05],
         [1.0, 2.0, -0.5, 3.0, 0.25, 1.5]]


@pytest.mark.parametrize("d", DIFFS)
def test_t_interval_is_scipys_one_sample_t(d):
  got = stats.t_interval(d)
  ref = sps.ttest_1samp(d, 0.0)
  ci = ref.confidence_interval(0.95)
  assert got["t"] == pytest.approx(ref.statistic) and got["p"] == pytest.approx(ref.pvalue)
  assert (got["low"], got["high"]) == pytest.approx((ci.low, ci.high))
  assert got["df"] == len(d) - 1 and got["sd"] == pytest.approx(np.std(d, ddof=1))


def test_t_critical_values_by_hand():
  """t_2 = 4.303 and t_3 = 3.182 at 97.5 % (printed tables): n = 3 is not read with the normal's 1.96."""
  assert stats.t_interval([1, 2, 3])["t_crit"] == pytest.approx(4.3027, abs=1e-4)
  assert stats.t_interval([1, 2, 3, 5])["t_crit"] == pytest.approx(3.1824, abs=1e-4)
  # [1, 2, 3]: mean 2, sd 1, se 1/sqrt(3); interval 2 ± 4.3027 / sqrt(3)
  got = stats.t_interval([1, 2, 3])
  assert (got["low"], got["high"]) == pytest.approx((2 - 4.3027 / math.sqrt(3), 2 + 4.3027 / math.sqrt(3)), abs=1e-4)
  with pytest.raises(ValueError, match="at least 2"):
    stats.t_interval([0.1])


@pytest.mark.parametrize("d", DIFFS + [[0.1, 0.1, 0.1], [1, -1, 2, -2]])
def test_permutation_test_is_scipys_exact_sign_flip_test(d):
  ref = sps.permutation_test((np.asarray(d),), np.mean, permutation_type="samples", n_resamples=np.inf,
                             alternative="two-sided")
  assert stats.permutation_test(d)["p"] == pytest.approx(ref.pvalue)


def test_permutation_test_by_hand():
  """[1, 2, 3]: of the 8 flips only (+,+,+) and (-,-,-) reach |mean| 2, so p = 2/8; [3, -1, 1]: |mean| 1 is
  reached by (+,+,+), (+,-,-)... counted by a loop."""
  assert stats.permutation_test([1, 2, 3])["p"] == 0.25 and stats.permutation_test([1, 2, 3])["p_min"] == 0.25
  d = [3, -1, 1]
  count = sum(abs(sum(s * x for s, x in zip(signs, d))) >= 3 for signs in itertools.product((1, -1), repeat=3))
  assert stats.permutation_test(d)["p"] == count / 8
  assert stats.permutation_test([1] * 6)["p_min"] == pytest.approx(2 / 64)


@pytest.mark.parametrize("diffs", [[1, 2, 3], [-1, -2, -3], [1, -2, 3], [1, 2, 3, 4, 5], [1, -1, 2, 3, 4, 5],
                                   [0.5], [1, 0, 2]])
def test_sign_test_is_scipys_two_sided_binomial_test(diffs):
  d = [x for x in diffs if x != 0]
  k = sum(x > 0 for x in d)
  got = stats.sign_test(diffs)
  assert got["n"] == len(d) and got["positive"] == k
  assert got["p_two_sided"] == pytest.approx(sps.binomtest(k, len(d), 0.5, alternative="two-sided").pvalue)
  far = max(k, len(d) - k)
  assert got["p_one_sided"] == pytest.approx(sps.binomtest(far, len(d), 0.5, alternative="greater").pvalue)
  assert stats.sign_test([0.1, 0.2, 0.3])["p_min_two_sided"] == 0.25


@pytest.mark.parametrize("a,b", [([2.43, 2.42, 2.44], [2.44, 2.45, 2.43]), ([1, 2, 3, 4], [2.5, 2.7, 9.0]),
                                 ([0.1, 0.4, 0.2], [0.3, 0.35, 0.32, 0.31, 0.4])])
def test_welch_is_scipys_unequal_variance_t(a, b):
  got = stats.welch(a, b)
  ref = sps.ttest_ind(a, b, equal_var=False)
  ci = ref.confidence_interval(0.95)
  assert got["t"] == pytest.approx(ref.statistic) and got["p"] == pytest.approx(ref.pvalue)
  assert got["df"] == pytest.approx(ref.df) and (got["low"], got["high"]) == pytest.approx((ci.low, ci.high))


def test_power_against_a_monte_carlo_of_the_t_test():
  """The noncentral-t power of the paired t-test against simulated normal samples (20,000 draws of n = 3 and of two
  arms of n = 4): within 0.015."""
  rng = np.random.default_rng(0)
  x = rng.normal(0.8, 0.3, (20_000, 3))
  mc = np.mean(sps.ttest_1samp(x, 0.0, axis=1).pvalue < 0.05)
  assert stats.t_power(0.8, 0.3, 3) == pytest.approx(mc, abs=0.015)
  a, b = rng.normal(1.0, 1.0, (20_000, 4)), rng.normal(0.0, 1.0, (20_000, 4))
  mc2 = np.mean(sps.ttest_ind(a, b, axis=1).pvalue < 0.05)
  assert stats.t_power(1.0, 1.0, 4, arms=2) == pytest.approx(mc2, abs=0.015)


def test_detectable_effect_and_seeds_needed():
  """At the detectable effect the power is 0.8; with n = 3 paired it is 3.26 SD (far above the normal
  approximation's (1.96 + 0.84) / sqrt(3) = 1.62 SD); seeds_needed is the least n that reaches 0.8."""
  e = stats.detectable_effect(0.01, 3)
  assert stats.t_power(e, 0.01, 3) == pytest.approx(0.8, abs=1e-6)
  assert e / 0.01 == pytest.approx(3.264, abs=2e-3)
  assert stats.detectable_effect(1.0, 1000) == pytest.approx((1.95996 + 0.84162) / math.sqrt(1000), rel=2e-3)
  n = stats.seeds_needed(0.003, 0.0101)
  assert stats.t_power(0.003, 0.0101, n) >= 0.8 > stats.t_power(0.003, 0.0101, n - 1)
  # the normal approximation ((1.96 + 0.84) sd / effect)^2 is a slight underestimate at this size
  assert n >= math.ceil(((1.95996 + 0.84162) * 0.0101 / 0.003) ** 2)


def test_pooled_sd_by_hand():
  sd, df = stats.pooled_sd([[1, 2, 3], [10, 14]])            # squared deviations 2 and 8 over df 2 + 1
  assert df == 3 and sd == pytest.approx(math.sqrt(10 / 3))


def test_readings_claim_no_more_than_the_tests():
  """Paired t p < 0.05 reads as detected, and the sentence says the rank-free tests cannot reach 0.05 at n = 3;
  otherwise "not detected" with the smallest detectable effect beside it."""
  lam2 = stats.paired_effect([-0.281, -0.266, -0.132], what="imbalance", nd=3)
  assert lam2["detected"] and "cannot reach 0.05 at n = 3" in lam2["sentence"] and "p = 0.041" in lam2["sentence"]
  lam3 = stats.paired_effect([-0.145, -0.160, -0.013], what="imbalance", nd=3)
  mde = stats.detectable_effect(np.std([-0.145, -0.160, -0.013], ddof=1), 3)
  assert not lam3["detected"] and f"is ±{mde:.3f}" in lam3["sentence"] and "p = 0.15" in lam3["sentence"]
  assert "all 3 seeds lower" in lam3["sentence"] and "floor" not in lam3["sentence"]
  assert stats.fmt(-2.3e-4, 3) == "-2.3e-04" and stats.fmt(0.0123, 3) == "+0.012"


def test_holm_by_hand():
  # sorted 0.01, 0.02, 0.04, 0.5 -> x4, x3, x2, x1 = 0.04, 0.06, 0.08, 0.5 (monotone); None stays None
  assert stats.holm([0.04, None, 0.01, 0.5, 0.02]) == pytest.approx([0.08, None, 0.04, 0.5, 0.06])
  assert stats.holm([0.3, 0.3]) == [0.6, 0.6] and stats.holm([0.9, 0.8]) == [1.0, 1.0]


def test_crossed_by_hand():
  """[[1, 2, 3], [3, 5, 4]] (2 seeds x 3 documents), by hand: grand mean 3, seed means 2 and 4, document means 2, 3.5,
  3.5; MS_seed = 3·(1 + 1)/1 = 6, MS_doc = 2·(1 + 0.25 + 0.25)/2 = 1.5, residuals 0, -0.5, 0.5, 0, 0.5, -0.5 give
  MS_resid = 1/2 = 0.5; Var(mean)·6 = 6 + 1.5 - 0.5 = 7, df = 7² / (6²/1 + 1.5²/2 + 0.5²/2) = 49/37.25."""
  got = stats.crossed([[1, 2, 3], [3, 5, 4]])
  assert (got["mean"], got["ms_seed"], got["ms_doc"], got["ms_resid"]) == pytest.approx((3, 6, 1.5, 0.5))
  assert got["se"] == pytest.approx(math.sqrt(7 / 6)) and got["df"] == pytest.approx(49 / 37.25)
  assert (got["var_seed"], got["var_doc"], got["var_resid"]) == pytest.approx(((6 - 0.5) / 3, (1.5 - 0.5) / 2, 0.5))
  tc = sps.t.ppf(0.975, 49 / 37.25)
  assert (got["low"], got["high"]) == pytest.approx((3 - tc * math.sqrt(7 / 6), 3 + tc * math.sqrt(7 / 6)))
  assert got["p"] == pytest.approx(2 * sps.t.sf(3 / math.sqrt(7 / 6), 49 / 37.25))
  with pytest.raises(ValueError, match="at least 2 of each"):
    stats.crossed([[1.0, 2.0, 3.0]])


def _rss(y, *blocks):
  """Residual sum of squares of y on an intercept and the given dummy blocks (numpy least squares)."""
  x = np.column_stack([np.ones(y.size), *blocks])
  return float(((y - x @ np.linalg.lstsq(x, y, rcond=None)[0]) ** 2).sum())


def test_crossed_against_least_squares_and_the_materialized_covariance():
  """The mean squares are the drops in residual sum of squares of dummy-variable regressions (seed and document
  indicators, numpy least squares), and se² is 1ᵀ Σ 1 / (SD)² of the covariance of the SD cells materialized from
  the estimated components: Σ = va·(I_S ⊗ J_D) + vb·(J_S ⊗ I_D) + ve·I."""
  rng = np.random.default_rng(4)
  S, D = 3, 11
  d = 0.2 + rng.normal(0, 0.5, (S, 1)) + rng.normal(0, 0.3, (1, D)) + rng.normal(0, 0.2, (S, D))
  got = stats.crossed(d)
  y = d.ravel()                                      # seed-major: cell (s, j) at s·D + j
  seed = np.kron(np.eye(S), np.ones((D, 1)))[:, 1:]
  doc = np.kron(np.ones((S, 1)), np.eye(D))[:, 1:]
  full = _rss(y, seed, doc)
  assert got["ms_resid"] == pytest.approx(full / ((S - 1) * (D - 1)))
  assert got["ms_seed"] == pytest.approx((_rss(y, doc) - full) / (S - 1))
  assert got["ms_doc"] == pytest.approx((_rss(y, seed) - full) / (D - 1))
  assert got["var_seed"] > 0 and got["var_doc"] > 0
  sigma = (got["var_seed"] * np.kron(np.eye(S), np.ones((D, D))) + got["var_doc"] * np.kron(np.ones((S, S)), np.eye(D))
           + got["var_resid"] * np.eye(S * D))
  assert got["se"] ** 2 == pytest.approx(sigma.sum() / (S * D) ** 2)


def test_crossed_reduces_to_the_one_source_t_tests():
  """A table whose documents all have the same mean (no document variance) is read exactly as scipy's one-sample t
  over the seeds' means (df S - 1); one whose seeds all have the same mean, as the t over the documents' means
  (df D - 1): the crossed model adds a source only where the table holds it."""
  rng = np.random.default_rng(5)
  e = rng.normal(0, 1, (3, 8))
  e -= e.mean(0, keepdims=True)                       # every document's mean is 0
  d = 0.7 + np.array([[0.9], [-0.2], [0.4]]) + 0.1 * e
  got, ref = stats.crossed(d), sps.ttest_1samp(d.mean(1), 0)
  assert got["p"] == pytest.approx(ref.pvalue) and got["df"] == pytest.approx(2)
  assert (got["low"], got["high"]) == pytest.approx(tuple(ref.confidence_interval(0.95)))
  e = rng.normal(0, 1, (4, 9))
  e -= e.mean(1, keepdims=True)                       # every seed's mean is 0
  d = 0.3 + rng.normal(0, 1, (1, 9)) + 0.1 * e
  got, ref = stats.crossed(d), sps.ttest_1samp(d.mean(0), 0)
  assert got["p"] == pytest.approx(ref.pvalue) and got["df"] == pytest.approx(8)


@pytest.mark.parametrize("S,seed_sd,doc_sd,blind", [(3, 2.0, 1.0, "seeds"), (5, 0.5, 3.0, "documents")])
def test_crossed_covers_where_a_one_source_test_does_not(S, seed_sd, doc_sd, blind):
  """4,000 tables drawn from the crossed model (S seeds x 20 documents, residual SD 1): the crossed 95 % interval
  covers the true mean in 0.92-0.97 of them (Satterthwaite's df are an approximation: 0.93 with 3 seeds). Where the seeds vary most, the t over the documents' means (blind to the
  seeds) covers less than 0.85; where the documents vary most, the t over the seeds' means (blind to the documents)."""
  rng = np.random.default_rng(6)
  D, n = 20, 4000
  tables = rng.normal(0, seed_sd, (n, S, 1)) + rng.normal(0, doc_sd, (n, 1, D)) + rng.normal(0, 1, (n, S, D))
  cover = lambda lo, hi: float(np.mean((lo <= 0) & (0 <= hi)))
  got = [stats.crossed(t) for t in tables]
  assert 0.92 <= cover(np.array([g["low"] for g in got]), np.array([g["high"] for g in got])) <= 0.97
  means = tables.mean(1) if blind == "seeds" else tables.mean(2)    # the documents' / the seeds' means
  ci = sps.ttest_1samp(means, 0, axis=1).confidence_interval(0.95)
  assert cover(ci.low, ci.high) < 0.85
