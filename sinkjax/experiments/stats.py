"""Small-n statistics for the seed studies: paired differences, a noise floor from a null arm, and the tests (with
what they can and cannot show) that the reports word their readings from.

A study here has n = 3 seeds per arm. Two tests are stated for every effect (a per-seed paired difference d_s =
x(treated, s) - x(control, s)):

- **z against the noise floor.** The floor sigma0 is the RMS of paired differences from a *null arm*: two runs that
  differ by a change that does (next to) nothing, so that whatever difference they show is the noise of training
  itself (a perturbation early in training sends the run down another path). RMS about zero, not std about the
  mean, because the null's expected difference is 0. Under the null an n-seed mean has standard error
  sigma0 / sqrt(n); z = mean(d) / (sigma0 / sqrt(n)), two-sided normal p. |z| >= Z_CRIT is read as "above the
  floor". The floor is itself estimated from few differences, so z is a screen, not an exact test.
- **Exact sign test.** Under the null each seed's difference is positive with probability 1/2. With n seeds the
  smallest attainable p is 0.5^n one-sided and 2 * 0.5^n two-sided: for n = 3, 0.125 and 0.25, so three seeds of
  the same sign can never reach p < 0.05 by this test (n = 5 is the least that can: 0.0625 two-sided, 0.031
  one-sided).

`verdict` turns the two into a reading whose wording never claims more than they allow.
"""
from __future__ import annotations

import math

import numpy as np
from scipy.stats import chi2  # scipy comes with jax

Z_CRIT = 2.0       # |z| at and above which a mean difference is read as above the noise floor (~ p 0.05 two-sided)


def paired(treated: dict, control: dict) -> tuple[list[int], list[float]]:
  """(seeds, treated[s] - control[s]) over the seeds both hold, in seed order."""
  seeds = sorted(set(treated) & set(control))
  return seeds, [float(treated[s]) - float(control[s]) for s in seeds]


def noise_floor(arms: dict) -> dict:
  """Pooled RMS about zero of the null arms' paired differences, arms = {name: [d, ...]}: sigma0 =
  sqrt(mean of every d^2), with what was pooled."""
  values = [float(x) for v in arms.values() for x in v]
  if not values:
    raise ValueError("a noise floor needs at least one null difference")
  rms = math.sqrt(sum(x * x for x in values) / len(values))
  return {"sigma": rms, "n": len(values), "arms": {k: [float(x) for x in v] for k, v in arms.items()},
          "per_arm_rms": {k: math.sqrt(sum(x * x for x in v) / len(v)) for k, v in arms.items() if len(v)}}


def sign_test(diffs) -> dict:
  """Exact two-sided sign test of the differences (zeros dropped): k of n positive; p = P(a Binomial(n, 1/2) at
  least as far from n/2 as k); also the smallest p that n allows, one- and two-sided."""
  d = [x for x in diffs if x != 0]
  n = len(d)
  k = sum(1 for x in d if x > 0)
  if n == 0:
    return {"n": 0, "positive": 0, "p_two_sided": 1.0, "p_one_sided": 1.0, "p_min_two_sided": 1.0,
            "p_min_one_sided": 1.0}
  tail = lambda m: sum(math.comb(n, i) for i in range(m, n + 1)) / 2 ** n        # P(X >= m)
  far = max(k, n - k)
  return {"n": n, "positive": k, "p_one_sided": tail(far), "p_two_sided": min(1.0, 2 * tail(far)),
          "p_min_one_sided": 0.5 ** n, "p_min_two_sided": min(1.0, 2 * 0.5 ** n)}


def z_test(diffs, sigma: float) -> dict:
  """z = mean / (sigma / sqrt(n)) and its two-sided normal p."""
  d = np.asarray(diffs, np.float64)
  se = sigma / math.sqrt(d.size)
  z = float(d.mean() / se) if se > 0 else math.copysign(math.inf, float(d.mean()))
  return {"mean": float(d.mean()), "se": se, "z": z, "p_two_sided": math.erfc(abs(z) / math.sqrt(2))}


def fmt(x: float, nd: int) -> str:
  """Signed, nd decimals; scientific when that would print a nonzero value as 0."""
  return f"{x:+.{nd}f}" if x == 0 or abs(x) >= 0.5 * 10 ** -nd else f"{x:+.1e}"


def sigma_upper(sigma: float, n: int, level: float = 0.95) -> float:
  """The upper end of the two-sided `level` confidence interval of a floor estimated as the RMS of n null
  differences (n sigma_hat^2 / sigma^2 ~ chi^2_n): sigma_hat * sqrt(n / chi2.ppf((1 - level) / 2, n))."""
  return sigma * math.sqrt(n / chi2.ppf((1 - level) / 2, n))


def verdict(diffs, sigma: float | None, *, what: str, nd: int = 4, floor_n: int | None = None) -> dict:
  """Both tests of one effect and a sentence that claims no more than they allow. sigma None: no null arm at
  this scale of the quantity, so only the sign test (and the wording says so). floor_n: how many null differences
  sigma was estimated from; then z is also taken against the floor's upper 95 % bound (`sigma_upper`), and an
  effect above the estimate but not above that bound is worded as such."""
  d = [float(x) for x in diffs]
  n = len(d)
  st = sign_test(d)
  mean = float(np.mean(d))
  per_seed = ", ".join(fmt(x, nd) for x in d)
  same = st["n"] == n and st["positive"] in (0, n)
  direction = "higher" if mean > 0 else "lower"
  every = {1: "the one seed", 2: "both seeds"}.get(n, f"all {n} seeds")
  sign_txt = (f"{every} {direction}" if same else
              f"{st['positive']} of {n} seeds higher, {n - st['positive']} lower or equal")
  sign_txt += f" (sign test p = {st['p_two_sided']:.3g} two-sided; the least {n} seeds allow is " \
              f"{st['p_min_two_sided']:.3g})"
  out = {"what": what, "diffs": d, "mean": mean, "n": n, "sign_test": st, "sigma": sigma}
  if sigma is None:
    out["z"] = None
    out["reading"] = "no null arm" if not same else "consistent sign, untested against a floor"
    tail = (f"so this is a direction seen in {n} of {n} seeds, not a demonstrated effect" if same else
            "and the sign changes between seeds: no direction is established")
    out["sentence"] = (f"{what}: {fmt(mean, nd)} on average (per seed {per_seed}); {sign_txt}. No null arm measures "
                       f"the noise of this quantity here, {tail}.")
    return out
  z = z_test(d, sigma)
  out["z"] = z
  above = abs(z["z"]) >= Z_CRIT
  robust = True
  if floor_n:
    up = sigma_upper(sigma, floor_n)
    out["z_upper"] = z_test(d, up)
    robust = abs(out["z_upper"]["z"]) >= Z_CRIT
  if above and same and not robust:
    out["reading"] = "above the floor's estimate, not its upper bound"
    claim = (f"above the estimated floor and of the same sign in every seed, but not above the floor's upper 95 % "
             f"bound {up:.{nd}f} (z = {out['z_upper']['z']:+.2f}; the floor rests on {floor_n} null differences): "
             "suggestive, not established")
  elif above and same:
    out["reading"] = "above the floor, consistent sign"
    claim = "above the noise floor and of the same sign in every seed"
    if floor_n:
      claim += f", also against the floor's upper 95 % bound {up:.{nd}f} (z = {out['z_upper']['z']:+.2f})"
  elif above:
    out["reading"] = "above the floor, mixed sign"
    claim = "above the noise floor on average, but not of the same sign in every seed"
  else:
    out["reading"] = "within the floor"
    claim = (f"within the noise floor: no effect is detected (at this n a mean effect smaller than about "
             f"{Z_CRIT * z['se']:.{nd}f} could not be told from the floor)")
  out["sentence"] = (f"{what}: {fmt(mean, nd)} on average (per seed {per_seed}); z = {z['z']:+.2f} against the "
                     f"floor {sigma:.{nd}f} (p = {z['p_two_sided']:.2g}); {sign_txt}. Reading: {claim}.")
  return out
