"""Small-n statistics for the seed studies (n = 3 seeds per arm): paired differences d_s = x(treated, s) -
x(control, s) read with a t-interval (`t_interval`), exact sign-flip and sign tests (`permutation_test`,
`sign_test`: their least two-sided p at n = 3 is 0.25) and the smallest effect the design could detect
(`detectable_effect`); Welch's t for unpaired arms. `paired_effect` turns these into a sentence that claims no
more than they allow (docs/RESULTS.md, "What each number is"). For a seeds x documents table of differences (the
pinning study): `bootstrap_flip` over documents and `crossed`, the seed x document random-effects model that carries
both sources of variance; `holm` over a family.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
from scipy import optimize
from scipy import stats as sps

ALPHA = 0.05        # two-sided level of every test
POWER = 0.8         # the power `detectable_effect` asks for
MAX_EXACT = 20      # the permutation test enumerates 2^n sign flips up to this n


def paired(treated: dict, control: dict) -> tuple[list[int], list[float]]:
  """(seeds, treated[s] - control[s]) over the seeds both hold, in seed order."""
  seeds = sorted(set(treated) & set(control))
  return seeds, [float(treated[s]) - float(control[s]) for s in seeds]


def _diffs(diffs, least: int = 2) -> np.ndarray:
  d = np.asarray(diffs, np.float64).ravel()
  if d.size < least:
    raise ValueError(f"{d.size} paired difference(s): a t-interval needs at least {least}; run more seeds")
  return d


def t_interval(diffs, level: float = 1 - ALPHA) -> dict:
  """One-sample t of the differences against 0: mean, sd (ddof 1), se = sd/sqrt(n), df = n - 1, the two-sided
  critical value t_crit = t_{df}((1 + level)/2), the interval [low, high] = mean ± t_crit·se, t = mean/se and its
  two-sided p. sd = 0 gives t = ±inf (p 0) for a nonzero mean and nan for a zero one."""
  d = _diffs(diffs)
  n, mean, sd = d.size, float(d.mean()), float(d.std(ddof=1))
  se = sd / math.sqrt(n)
  tc = float(sps.t.ppf((1 + level) / 2, n - 1))
  if se > 0:
    t = mean / se
    p = float(2 * sps.t.sf(abs(t), n - 1))
  else:
    t, p = (math.copysign(math.inf, mean), 0.0) if mean else (math.nan, math.nan)
  return {"n": n, "mean": mean, "sd": sd, "se": se, "df": n - 1, "t_crit": tc, "low": mean - tc * se,
          "high": mean + tc * se, "t": t, "p": p, "level": level}


def permutation_test(diffs) -> dict:
  """Exact paired permutation test: every one of the 2^n sign flips of the differences; p two-sided = the share
  of flips whose |mean| is at least the observed |mean| (up to rounding), and the least p that n allows (2 / 2^n)."""
  d = _diffs(diffs, 1)
  if d.size > MAX_EXACT:
    raise ValueError(f"{d.size} differences: the exact test enumerates 2^n flips, at most n = {MAX_EXACT}")
  signs = np.array(list(itertools.product((1.0, -1.0), repeat=d.size)))
  means = np.abs(signs @ d) / d.size
  observed = abs(float(d.mean()))
  hits = int(np.sum(means >= observed * (1 - 1e-12) - 1e-15))
  return {"n": int(d.size), "p": hits / len(signs), "p_min": min(1.0, 2 / len(signs)), "flips": len(signs)}


def sign_test(diffs) -> dict:
  """Exact two-sided sign test of the differences (zeros dropped): k of n positive; p = P(a Binomial(n, 1/2) at
  least as far from n/2 as k); also the least p that n allows, one- and two-sided."""
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


def welch(a, b, level: float = 1 - ALPHA) -> dict:
  """Welch's t for two unpaired arms: diff = mean(a) - mean(b), se = sqrt(s_a²/n_a + s_b²/n_b), the
  Welch–Satterthwaite df, t = diff/se, two-sided p and the `level` interval diff ± t_{df}·se."""
  a, b = _diffs(a), _diffs(b)
  va, vb = a.var(ddof=1) / a.size, b.var(ddof=1) / b.size
  diff, se = float(a.mean() - b.mean()), math.sqrt(va + vb)
  if se == 0:
    raise ValueError("both arms are constant: Welch's t is undefined")
  df = (va + vb) ** 2 / (va ** 2 / (a.size - 1) + vb ** 2 / (b.size - 1))
  t = diff / se
  tc = float(sps.t.ppf((1 + level) / 2, df))
  return {"diff": diff, "se": se, "df": float(df), "t": t, "p": float(2 * sps.t.sf(abs(t), df)), "t_crit": tc,
          "low": diff - tc * se, "high": diff + tc * se, "n": (int(a.size), int(b.size)), "level": level}


def t_power(effect: float, sd: float, n: int, *, alpha: float = ALPHA, arms: int = 1) -> float:
  """Probability that the two-sided t-test at `alpha` rejects when the true mean difference is `effect` and the
  SD of one observation is `sd`. arms = 1: paired (or one-sample) differences of n seeds, df = n - 1, ncp =
  effect/(sd/sqrt(n)); arms = 2: two unpaired arms of n each, df = 2n - 2, ncp = effect/(sd·sqrt(2/n))."""
  if arms not in (1, 2) or n < 2 or sd <= 0:
    raise ValueError(f"power needs arms 1 or 2, n >= 2 and sd > 0 (got arms={arms}, n={n}, sd={sd})")
  df = n - 1 if arms == 1 else 2 * n - 2
  ncp = abs(effect) / (sd * math.sqrt(arms / n))
  tc = sps.t.ppf(1 - alpha / 2, df)
  lower = float(sps.nct.cdf(-tc, df, ncp))
  return float(sps.nct.sf(tc, df, ncp)) + (lower if math.isfinite(lower) else 0.0)


def detectable_effect(sd: float, n: int, *, alpha: float = ALPHA, power: float = POWER, arms: int = 1) -> float:
  """The smallest true |mean difference| that the t-test of `t_power` detects with probability `power` (the
  noncentral t solved for its noncentrality): at n = 3 paired, 3.26 sd; at n = 10, 1.00 sd."""
  if sd <= 0:
    raise ValueError("detectable_effect needs sd > 0")
  f = lambda e: t_power(e, sd, n, alpha=alpha, arms=arms) - power
  hi = sd
  while f(hi) < 0:
    hi *= 2
  return float(optimize.brentq(f, 0.0, hi, xtol=sd * 1e-10))


def seeds_needed(effect: float, sd: float, *, alpha: float = ALPHA, power: float = POWER, arms: int = 1,
                 most: int = 100_000) -> int:
  """The least n (seeds per arm) whose t-test detects a true |mean difference| `effect` with probability
  `power`, at the SD `sd` of one paired difference (arms = 1) or of one run (arms = 2)."""
  if effect == 0:
    raise ValueError("seeds_needed needs a nonzero effect")
  ok = lambda n: t_power(effect, sd, n, alpha=alpha, arms=arms) >= power
  lo, hi = 2, 2
  while not ok(hi):
    lo, hi = hi, hi * 2
    if hi > most:
      raise ValueError(f"more than {most} seeds would be needed")
  while lo < hi:                                   # power grows with n: the least n that reaches `power`
    mid = (lo + hi) // 2
    lo, hi = (mid + 1, hi) if not ok(mid) else (lo, mid)
  return hi


def pooled_sd(groups) -> tuple[float, int]:
  """(SD pooled over groups, each about its own mean: sqrt(sum of squared deviations / sum of (n_i - 1)), df)."""
  groups = [np.asarray(g, np.float64) for g in groups if len(g) > 1]
  df = sum(g.size - 1 for g in groups)
  if df == 0:
    raise ValueError("pooled_sd needs a group of at least two values")
  return math.sqrt(sum(float(((g - g.mean()) ** 2).sum()) for g in groups) / df), df


def seed_stats(xs) -> dict:
  """mean, sample std (ddof 1; None for one value), min, max, n and the values."""
  a = np.asarray(xs, np.float64)
  return {"mean": float(a.mean()), "std": float(a.std(ddof=1)) if a.size > 1 else None, "min": float(a.min()),
          "max": float(a.max()), "n": int(a.size), "values": a.tolist()}


def mean_std(s: dict | None, nd: int = 4) -> str:
  """A `seed_stats` as "mean ± std" ("—": none; no std for one value)."""
  if not s:
    return "—"
  return f"{s['mean']:.{nd}f}" + (f" ± {s['std']:.{nd}f}" if s["std"] is not None else "")


def bootstrap_flip(d, resamples: int = 10000) -> dict:
  """Over many paired differences (documents): the 95 % percentile bootstrap interval of their mean ("low", "high")
  and the sign-flip permutation p ("p"), each from `resamples` random draws (seed 0)."""
  d = np.asarray(d, np.float64)
  if np.all(d == d[0]):
    return {"low": float(d[0]), "high": float(d[0]), "p": 1.0 if d[0] == 0 else 0.0}
  ci = sps.bootstrap((d,), np.mean, n_resamples=resamples, method="percentile",
                     rng=np.random.default_rng(0)).confidence_interval
  p = sps.permutation_test((d,), np.mean, permutation_type="samples", n_resamples=resamples,
                           rng=np.random.default_rng(0)).pvalue
  return {"low": float(ci.low), "high": float(ci.high), "p": float(p)}


def crossed(table, level: float = 1 - ALPHA) -> dict:
  """The mean of a seeds x documents table of paired differences d[s, j] read with both sources of variance: the
  crossed random-effects model d[s, j] = mu + a_s + b_j + e_sj (seed effect a ~ N(0, va), document effect
  b ~ N(0, vb), residual e ~ N(0, ve), one value per cell), by two-way ANOVA. With S seeds and D documents the mean
  squares MS_seed = D·sum_s (row mean - grand)²/(S-1), MS_doc = S·sum_j (column mean - grand)²/(D-1) and MS_resid
  (the additive fit's residual, (S-1)(D-1) df) estimate ve + D·va, ve + S·vb and ve. The grand mean's variance
  va/S + vb/D + ve/(SD) is estimated by (MS_seed + MS_doc - MS_resid)/(SD), a component estimated below 0 being
  set to 0 (its mean square then drops out: MS_doc/(SD) when va is 0); its df are Satterthwaite's for that linear
  combination of mean squares. Returns mean, the three mean squares, the variance components, se, df, t_crit, the
  `level` interval [low, high], t and two-sided p. Needs at least 2 seeds and 2 documents."""
  d = np.asarray(table, np.float64)
  if d.ndim != 2 or d.shape[0] < 2 or d.shape[1] < 2:
    raise ValueError(f"a crossed test needs a seeds x documents table with at least 2 of each, got shape {d.shape}; "
                     "with one seed only the documents can be tested (bootstrap_flip)")
  S, D = d.shape
  grand, rows, cols = float(d.mean()), d.mean(1), d.mean(0)
  df_s, df_d, df_e = S - 1, D - 1, (S - 1) * (D - 1)
  ms_s = D * float(((rows - grand) ** 2).sum()) / df_s
  ms_d = S * float(((cols - grand) ** 2).sum()) / df_d
  ms_e = float(((d - rows[:, None] - cols[None, :] + grand) ** 2).sum()) / df_e
  c_s, c_d = float(ms_s > ms_e), float(ms_d > ms_e)        # va > 0, vb > 0 as estimated
  terms = [(c_s, ms_s, df_s), (c_d, ms_d, df_d), (1 - c_s - c_d, ms_e, df_e)]
  v = sum(c * m for c, m, _ in terms)                     # = S·D·(va/S + vb/D + ve/(SD)), components >= 0
  out = {"seeds": S, "documents": D, "mean": grand, "ms_seed": ms_s, "ms_doc": ms_d, "ms_resid": ms_e,
         "var_seed": max(ms_s - ms_e, 0.0) / D, "var_doc": max(ms_d - ms_e, 0.0) / S, "var_resid": ms_e,
         "level": level}
  if v <= 0:                                              # every cell the same difference
    t, p = (math.copysign(math.inf, grand), 0.0) if grand else (math.nan, math.nan)
    return {**out, "se": 0.0, "df": math.nan, "t_crit": math.nan, "low": grand, "high": grand, "t": t, "p": p}
  df = v ** 2 / sum((c * m) ** 2 / k for c, m, k in terms if c)
  se = math.sqrt(v / (S * D))
  tc = float(sps.t.ppf((1 + level) / 2, df))
  t = grand / se
  return {**out, "se": se, "df": float(df), "t_crit": tc, "low": grand - tc * se, "high": grand + tc * se, "t": t,
          "p": float(2 * sps.t.sf(abs(t), df))}


def holm(pvalues) -> list:
  """Holm's step-down adjusted p-values (None stays None): sorted ascending, p_(i) · (n − i + 1), made monotone,
  capped at 1."""
  idx = [i for i, p in enumerate(pvalues) if p is not None]
  out, run = list(pvalues), 0.0
  for k, i in enumerate(sorted(idx, key=lambda i: pvalues[i])):
    run = max(run, min(1.0, pvalues[i] * (len(idx) - k)))
    out[i] = run
  return out


def fmt(x: float, nd: int) -> str:
  """Signed, nd decimals; scientific when that would print a nonzero value as 0."""
  return f"{x:+.{nd}f}" if x == 0 or abs(x) >= 0.5 * 10 ** -nd else f"{x:+.1e}"


def fmt_p(x: float) -> str:
  """A p-value as the tests' sentences and tables print it."""
  return f"{x:.2g}" if x >= 0.001 else f"{x:.1e}"


def _sign_words(d: list[float], st: dict) -> str:
  n = len(d)
  every = {1: "the one seed", 2: "both seeds"}.get(n, f"all {n} seeds")
  if st["n"] == n and st["positive"] in (0, n):
    return f"{every} {'higher' if st['positive'] else 'lower'}"
  return f"{st['positive']} of {n} seeds higher, {n - st['positive']} lower or equal"


def _t_words(d: list[float], t: dict, st: dict, nd: int) -> str:
  """The mean, the per-seed differences, their signs and the t-interval, as `paired_effect`'s sentence says them."""
  return (f"{fmt(t['mean'], nd)} on average (per seed {', '.join(fmt(x, nd) for x in d)}; {_sign_words(d, st)}); "
          f"95 % t-interval {fmt(t['low'], nd)} … {fmt(t['high'], nd)} (t_{t['df']} = {t['t']:+.2f}, "
          f"p = {fmt_p(t['p'])})")


def paired_effect(diffs, *, what: str, nd: int = 4) -> dict:
  """Every test of one paired effect and a sentence that claims no more than they allow. Detected = the paired
  t-test's two-sided p < ALPHA (the t-interval excludes 0); the permutation and sign tests are stated beside it with
  the least p their n allows. Not detected: the sentence gives the smallest effect this design could detect."""
  d = [float(x) for x in diffs]
  t = t_interval(d)
  perm, st = permutation_test(d), sign_test(d)
  n = len(d)
  mde = detectable_effect(t["sd"], n) if t["sd"] > 0 else 0.0
  detected = t["p"] < ALPHA
  out = {"what": what, "diffs": d, "n": n, "mean": t["mean"], "t": t, "permutation": perm, "sign_test": st,
         "detectable": mde, "detected": bool(detected)}
  rank_free = (f"exact permutation p = {fmt_p(perm['p'])}, sign test p = {fmt_p(st['p_two_sided'])}"
               f" (the least {n} seeds allow: {fmt_p(perm['p_min'])})")
  body = f"{what}: {_t_words(d, t, st, nd)}; {rank_free}"
  if detected:
    out["reading"] = "detected (paired t)"
    claim = "detected by the paired t-test, whose noise is these differences' own SD"
    if perm["p_min"] >= ALPHA:
      claim += f" (estimated from {n} differences; the rank-free tests cannot reach {ALPHA:g} at n = {n})"
  else:
    out["reading"] = "not detected"
    claim = (f"not detected; the smallest effect this design could detect (power {POWER:g}, two-sided {ALPHA:g}, "
             f"SD {t['sd']:.{nd}f}, n = {n}) is ±{mde:.{nd}f}")
  out["sentence"] = f"{body}. Reading: {claim}."
  return out
