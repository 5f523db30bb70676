"""`sinkjax.experiments.stats` against independent computations: the exact sign test against scipy's binomial test,
the floor and z by hand, and the readings' wording against what the tests allow."""
import math

import numpy as np
import pytest
from scipy import stats as sps

from sinkjax.experiments import stats


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


def test_least_attainable_sign_test_p_for_three_and_five_seeds():
  three = stats.sign_test([0.1, 0.2, 0.3])
  assert three["p_two_sided"] == three["p_min_two_sided"] == 0.25 and three["p_min_one_sided"] == 0.125
  five = stats.sign_test([1, 1, 1, 1, 1])
  assert five["p_min_two_sided"] == 0.0625 and five["p_min_one_sided"] == 0.03125


def test_noise_floor_is_the_rms_about_zero_of_every_null_difference():
  f = stats.noise_floor({"a": [0.3, -0.4], "b": [1.2]})
  assert f["sigma"] == pytest.approx(math.sqrt((0.09 + 0.16 + 1.44) / 3)) and f["n"] == 3
  assert f["per_arm_rms"]["a"] == pytest.approx(math.sqrt(0.125))
  with pytest.raises(ValueError):
    stats.noise_floor({"a": []})


def test_z_against_the_floor_by_hand():
  z = stats.z_test([0.01, 0.02, 0.03], 0.02)
  assert z["z"] == pytest.approx(0.02 / (0.02 / math.sqrt(3)))
  assert z["p_two_sided"] == pytest.approx(2 * sps.norm.sf(z["z"]))


def test_readings_claim_no_more_than_the_tests():
  small = stats.verdict([0.0097, 0.0061, 0.0071], 0.0137, what="gated")          # the committed gated BPB cost
  assert small["reading"] == "within the floor" and "no effect is detected" in small["sentence"]
  assert "p = 0.25" in small["sentence"] and "above" not in small["sentence"]
  big = stats.verdict([0.05, 0.04, 0.06], 0.0137, what="x")
  assert big["reading"] == "above the floor, consistent sign" and "0.25" in big["sentence"]
  mixed = stats.verdict([0.08, 0.06, -0.01], 0.0137, what="x")
  assert mixed["reading"] == "above the floor, mixed sign" and "not of the same sign" in mixed["sentence"]
  nofloor = stats.verdict([0.002, 0.003, 0.011], None, what="sink imbalance", nd=3)
  assert nofloor["z"] is None and "not a demonstrated effect" in nofloor["sentence"]
  nofloor_mixed = stats.verdict([-0.068, -0.032, 0.063], None, what="gated imbalance", nd=3)
  assert "no direction is established" in nofloor_mixed["sentence"]
  assert stats.fmt(-2.3e-4, 3) == "-2.3e-04" and stats.fmt(0.0123, 3) == "+0.012"


def test_floor_upper_bound_and_the_wording_it_bounds():
  # n = 3 null differences: chi^2_3's 2.5 % quantile is 0.2158 (tables), so the bound is sigma * sqrt(3 / 0.2158)
  assert stats.sigma_upper(0.01, 3) == pytest.approx(0.01 * math.sqrt(3 / 0.215795), rel=1e-4)
  assert stats.sigma_upper(1.0, 9) == pytest.approx(math.sqrt(9 / 2.700389), rel=1e-4)
  shaky = stats.verdict([0.09, 0.09, 0.02], 0.03, what="x", floor_n=3, nd=3)    # z = 3.8 vs the estimate, 1.0 vs bound
  assert shaky["reading"] == "above the floor's estimate, not its upper bound" and "not established" in shaky["sentence"]
  firm = stats.verdict([-0.28, -0.27, -0.13], 0.011, what="x", floor_n=3, nd=3)
  assert firm["reading"] == "above the floor, consistent sign" and firm["z_upper"]["z"] < -2
