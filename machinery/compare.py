"""Comparing arms: what a difference between two methods must carry, and what a comparison could have seen.

Read on its own, top to bottom: the t and chi-square distributions; power, the smallest true difference a design
finds 80% of the time, with the range the variance's own uncertainty leaves it; the variance components of a
difference, pooled over the arms that share a reference, and its interval; the design that would find a given
difference; the words an interval allows, alone and over its family (Holm); settings chosen apart from the runs
they are read on; whether a model learned anything a task can rank; and the comparison of fine-tuned arms that
`eval.py table` and reproduce.py's reports print. It imports nothing of the lesson: eval.py hands it the task kinds
(how predictions become counts and scores).

The design. The unit of an arm is a pretraining run (a replicate); fine-tuning seeds and test examples are nested in
it. Replicate r of every arm shares its data order and its fine-tuning seeds (a seed: the same classifier init and
data order for every arm of the replicate; reproduce.py gives each replicate seeds of its own, so that a seed's
effect on an arm is nested in its replicate, as the variance components read it), and every model is scored on the
same test examples, so differences are paired at every level. Settings are chosen on dev, a replicate's learning
rate on the other replicates' dev scores and a run's checkpoint on its own; test is read once, for that setting.
"""
import functools
import math
from pathlib import Path
from statistics import NormalDist

import numpy as np

from machinery.cli import InputError
from machinery.tasks import load_results, read_predictions

# ----------------------------------------------------------------------------
# The t and chi-square distributions, and the t interval


def whole(df):
    """Degrees of freedom as the tables take them: rounded down (conservative), at least 1; inf stays inf."""
    return max(1, int(df)) if math.isfinite(df) else math.inf


def t_cdf(x, df):
    """P(T <= x) for Student's t with df degrees of freedom (`whole`), by the closed-form series of an integer df
    (Abramowitz & Stegun 26.7.3-4); the normal's beyond 1,000."""
    df = whole(df)
    if df > 1000:
        return NormalDist().cdf(x)
    theta = math.atan(x / math.sqrt(df))
    c, term, total = math.cos(theta), 1.0, 0.0
    if df % 2:  # odd: P(|T| < x) = (2/pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        for k in range((df - 1) // 2):
            total, term = total + term, term * (2 * k + 2) / (2 * k + 3) * c * c
        inside = 2 / math.pi * (theta + math.sin(theta) * c * total)
    else:  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        for k in range(df // 2):
            total, term = total + term, term * (2 * k + 1) / (2 * k + 2) * c * c
        inside = math.sin(theta) * total
    return (1 + inside) / 2


def bisect(cdf, p, high):
    """The x in [0, high] where an increasing cdf reaches p, to float precision."""
    low = 0.0
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (low, middle) if cdf(middle) >= p else (middle, high)
    return (low + high) / 2


def t_quantile(p, df):
    """Student's t quantile with df degrees of freedom (`whole`), by Newton's steps on t_cdf from the normal
    quantile: t's cdf is concave above 0 and its quantile above the normal's, so each step lands below the root and
    the steps rise to it (below 0.5, the same by symmetry); the normal quantile beyond 1,000."""
    if p < 0.5:
        return -t_quantile(1 - p, df)
    df, x = whole(df), NormalDist().inv_cdf(p)
    if df > 1000:
        return x
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - math.log(df * math.pi) / 2  # t's density at 0
    for _ in range(200):
        step = (p - t_cdf(x, df)) / math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))
        x += step
        if step <= 1e-14 * x:
            break
    return x


def chi2_cdf(x, df):
    """P(X <= x) for a chi-square on df degrees of freedom: the regularized lower incomplete gamma P(df/2, x/2), by
    its power series (Abramowitz & Stegun 6.5.29), summed until the terms stop counting."""
    if x <= 0:
        return 0.0
    a, y = df / 2, x / 2
    term = total = 1 / a
    n = 0
    while term > total * 1e-17:
        n += 1
        term *= y / (a + n)
        total += term
    return min(1.0, math.exp(a * math.log(y) - y - math.lgamma(a)) * total)


@functools.lru_cache(maxsize=None)
def chi2_quantile(p, df):
    """The chi-square quantile: the x with chi2_cdf(x, df) = p."""
    return bisect(lambda x: chi2_cdf(x, df), p, df + 40 * math.sqrt(2 * df) + 100)


def t_interval(values, bounds=(-math.inf, math.inf)):
    """(mean, low, high): the mean of independent values and its 95% t interval (low and high None for a single
    value: its spread is unknown). A quantity that lives in `bounds` (1 - CKA in [0, 1], an accuracy) has its
    interval clipped to them: with few values t's interval reaches past them, and what lies beyond is impossible,
    not uncertain (clipping drops only those values, so the interval covers as often as before)."""
    v = np.asarray(values, np.float64)
    mean = float(v.mean())
    if len(v) < 2:
        return mean, None, None
    half = t_quantile(0.975, len(v) - 1) * float(v.std(ddof=1)) / math.sqrt(len(v))
    return mean, max(bounds[0], mean - half), min(bounds[1], mean + half)


# ----------------------------------------------------------------------------
# Power. The interval below excludes 0 when |mean| > t(0.975, df) * sqrt(v), v the estimated variance of the
# mean: the replicates' part v_runs (estimated on `k` degrees of freedom: a chi-square on k around its true value)
# plus the examples' part (a bootstrap of many draws: taken as known), df Satterthwaite's. Its power at a true
# difference d is the chance of that over the mean (normal around d, with the true variance) and over the
# replicates' estimate, which moves v and df together; with no examples' part it is the noncentral t's,
# P(|Z + d/se| > t(0.975, df) * S), S^2 a chi-square over df divided by df. The smallest difference found with
# 80% power solves power = 0.8: about (t(0.975, df) + t(0.80, df)) * se for a fixed df (2.8 se for large df, 5.7
# se at df = 2, where the sum's 5.36 se is found 77% of the time). The half-width is found only half the time.
#
# That difference is computed from the estimated variance as if it were the truth; with few degrees of freedom the
# truth may lie far from it. Its range: the same computation at the two 95% confidence bounds of v_runs,
# v_runs * k / chi2(0.975, k) and v_runs * k / chi2(0.025, k) (with k = 2 they are 0.27 and 40 times v_runs).

POWER = 0.8


def normal_cdf(x):
    """Phi(x) for an array, Abramowitz & Stegun 7.1.26 (error below 1.5e-7): numpy has no erf."""
    z = np.abs(np.asarray(x, np.float64)) / math.sqrt(2)
    t = 1 / (1 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    half_erfc = 0.5 * poly * np.exp(-z * z)  # P(Z > |x|)
    return np.where(np.asarray(x) >= 0, 1 - half_erfc, half_erfc)


@functools.lru_cache(maxsize=None)
def critical(df):
    """t(0.975, df) for an integer df: the quantile's bisection once per df (power asks for many)."""
    return t_quantile(0.975, df)


def power(d, v_runs, v_examples, k):
    """The probability that `interval`'s 95% interval excludes 0 when the true difference is d, its variance
    v_runs (estimated on k degrees of freedom) + v_examples (see above); the integral over the replicates'
    estimate on a grid of 1,201 points."""
    sigma = math.sqrt(v_runs + v_examples)
    shift = abs(d) / sigma
    if v_runs <= 0 or k < 1:  # nothing estimated from few values: the normal quantile
        c = t_quantile(0.975, math.inf)
        return float(normal_cdf(shift - c) + normal_cdf(-shift - c))
    s = np.linspace(1e-9, 1 + 12 / math.sqrt(k), 1201)  # S = sqrt(estimate / truth); beyond, no density
    log_c = math.log(2) + k / 2 * math.log(k / 2) - math.lgamma(k / 2)  # S's density: c s^(k-1) e^(-k s^2/2)
    density = np.exp(log_c + (k - 1) * np.log(s) - k * s * s / 2)
    runs = v_runs * s * s  # the replicates' part as estimated
    v = runs + v_examples
    df = np.minimum(np.floor(v * v / (runs * runs / k)), 1001)  # Satterthwaite's, rounded down as the interval does
    each, where = np.unique(df, return_inverse=True)
    c = np.array([critical(int(x) if x <= 1000 else math.inf) for x in each])[where]
    z = np.sqrt(v) / sigma
    found = density * (normal_cdf(shift - c * z) + normal_cdf(-shift - c * z))
    return float(np.sum(found[1:] + found[:-1]) / 2 * (s[1] - s[0]))


@functools.lru_cache(maxsize=None)  # a plan asks the same (about 2 in 5 of a dry run's questions are repeats)
def detectable(v_runs, v_examples, k):
    """The smallest true difference `interval` finds with 80% power (POWER): power's root, by bisection. 0 when
    nothing varies."""
    if not v_runs + v_examples > 0:
        return 0.0
    low, high = 0.0, 20 * math.sqrt(v_runs + v_examples)
    for _ in range(20):  # to 2e-5 standard errors
        middle = (low + high) / 2
        low, high = (middle, high) if power(middle, v_runs, v_examples, k) < POWER else (low, middle)
    return high


def bound(v, k, side):
    """A 95% confidence bound of a variance estimated as v on k degrees of freedom: side "low" or "high"."""
    return v * k / chi2_quantile(0.975 if side == "low" else 0.025, k) if v > 0 and k >= 1 else v


def detectable_range(v_runs, v_examples, k):
    """(low, high): the detectable difference at the two 95% confidence bounds of v_runs (see above)."""
    return tuple(detectable(bound(v_runs, k, side), v_examples, k) for side in ("low", "high"))


# ----------------------------------------------------------------------------
# The variance components of a difference, pooled over the arms that share a reference, and its interval.
#
# A comparison is a table: arms x replicates x seeds of a score (and under each score, test examples). Replicate r
# and seed s are shared by every arm, so what they share cancels in a difference; what is left of each run's noise
# is its own. As a mixed model with arm fixed and replicate and seed random reads a balanced table, by the method of
# moments: the arm x replicate interaction of the replicate means (each the mean of its seeds) estimates how much
# one arm's replicate mean moves, on (arms - 1)(replicates - 1) degrees of freedom; the arm x seed interaction
# within replicates, how much one run moves about its replicate, on (arms - 1) replicates (seeds - 1). A difference
# of two arms moves twice as much. With two arms (an arm and its reference) these are the difference's own
# spreads, on replicates - 1 and replicates (seeds - 1) degrees of freedom; every arm added to the table adds its
# degrees of freedom, on the condition that the arms' runs vary alike (a difference's own components are kept
# beside the pooled ones, to see whether they do). The test examples' part is each difference's own bootstrap, less
# what differs from run to run: each run's score moves with its own luck on the examples, and that is in the runs'
# spread already; what the test set adds beyond it is the part every run shares.


def measured(metric, b, a=None, resamples=2000, seed=0):
    """What one difference rests on. a, b: (R, S, N, K) counts of replicate r, fine-tuning seed s and test example
    n, paired; metric: (..., K) totals -> (...) score. `runs`: (R, S) the difference metric(b) - metric(a) of each
    run (of metric(b) when a is None); the test examples' variance, from a bootstrap that draws N examples with
    replacement and recomputes the metric from every run's counts (F1 is not a mean over examples): `example_var`,
    N times the variance of the mean over runs, and `example_run_var`, N times the part of one run's that differs
    from run to run and so averages away as runs are added (the rest is shared: the same test set for every run)."""
    R, S, N, K = b.shape
    arms = [b] if a is None else [b, a]

    def difference(scores):
        return scores[0] if a is None else scores[0] - scores[1]

    runs = difference([metric(x.sum(2)) for x in arms])  # (R, S)
    w = np.random.default_rng(seed).multinomial(N, np.full(N, 1 / N), resamples).astype(np.float64)
    drawn = [(w @ x.transpose(2, 0, 1, 3).reshape(N, -1)).reshape(resamples, R, S, K) for x in arms]
    boot = difference([metric(x) for x in drawn]).reshape(resamples, R * S)  # each run on each draw
    of_mean, of_each, n = float(boot.mean(1).var(ddof=1)), float(boot.var(0, ddof=1).mean()), R * S
    own = max(0.0, of_each - of_mean) * n / (n - 1) if n > 1 else 0.0  # of_mean = shared + own / n
    return {"runs": runs, "examples": N, "example_var": of_mean * N, "example_run_var": own * N}


def components(groups):
    """The variance components of the differences in `groups`, a list of lists of `measured` differences, each
    list sharing one reference (whose row of the table is 0: a row shared by every arm of a replicate and seed
    cancels in the interactions). `top_var`: the variance of one top unit's mean difference (a replicate's, the
    mean over its seeds; with one replicate, a seed's) on `top_df` degrees of freedom; `seed_var`: of one run
    about its replicate (None with one seed: it cannot be told from pretraining noise), on `seed_df`;
    `replicate_var` = top_var - seed_var / seeds, the method of moments' estimate, below 0 when noise makes the
    replicate means vary less than their seeds predict (None with one replicate: pretraining noise is not
    measured); the examples' parts, the mean over the differences."""
    every = [m for group in groups for m in group]
    R, S = every[0]["runs"].shape
    top_ss = top_df = seed_ss = seed_df = 0.0
    for group in groups:
        D = np.stack([np.zeros((R, S)), *(m["runs"] for m in group)])  # (arms, R, S), the reference's row 0
        top = D.mean(2) if R > 1 else D[:, 0]  # (arms, units): replicate means, or with one replicate its seeds
        z = top - top.mean(0) - top.mean(1, keepdims=True) + top.mean()
        top_ss, top_df = top_ss + float((z * z).sum()), top_df + (len(D) - 1) * (top.shape[1] - 1)
        if R > 1 and S > 1:
            e = D - D.mean(2, keepdims=True) - D.mean(0, keepdims=True) + D.mean((0, 2), keepdims=True)
            seed_ss, seed_df = seed_ss + float((e * e).sum()), seed_df + (len(D) - 1) * R * (S - 1)
    top_var = 2 * top_ss / top_df if top_df else 0.0
    seed_var = 2 * seed_ss / seed_df if seed_df else top_var if R == 1 and S > 1 else None
    return dict(replicates=R, seeds=S, examples=every[0]["examples"], arms=len(every), top_var=top_var,
                top_df=top_df, seed_var=seed_var, seed_df=seed_df if R > 1 else top_df,
                replicate_var=None if R == 1 else top_var - (seed_var or 0.0) / S, seeds_inside=R > 1 and S == 1,
                example_var=float(np.mean([m["example_var"] for m in every])),
                example_run_var=float(np.mean([m["example_run_var"] for m in every])))


def interval_of(m, c):
    """The mean of a `measured` difference and its 95% interval, from variance components c (its own, or pooled
    with the arms that share its reference): the top units' part top_var / units (its spread, with the seeds'
    inside) plus the part of its own test examples' that every run shares (shared_examples), with a t quantile on
    Satterthwaite's degrees of freedom (top_df when the runs' part dominates, more as the examples' does, rounded
    down); beside it the two-sided p value of the same t test, and `detectable`, the smallest true difference this
    design finds with 80% power, with its range."""
    R, S = m["runs"].shape
    units = R if R > 1 else S
    v_runs, v_examples = c["top_var"] / units, shared_examples(m, R * S) / m["examples"]
    v = v_runs + v_examples
    df = v * v / (v_runs * v_runs / c["top_df"]) if v_runs > 0 else math.inf
    half, mean = t_quantile(0.975, df) * math.sqrt(v), float(m["runs"].mean())
    low, high = detectable_range(v_runs, v_examples, c["top_df"])
    return {"mean": mean, "low": mean - half, "high": mean + half, "half": half, "df": df,
            "p": 2 * (1 - t_cdf(abs(mean) / math.sqrt(v), df)) if v > 0 else float(mean == 0),
            "units": units, "level": "replicates" if R > 1 else "seeds", "sd_runs": math.sqrt(v_runs),
            "sd_examples": math.sqrt(v_examples), "detectable": detectable(v_runs, v_examples, c["top_df"]),
            "detectable_low": low, "detectable_high": high, "components": c}


def interval(metric, b, a=None, resamples=2000, seed=0):
    """The mean over runs of metric(b) - metric(a) (a None: of metric(b)) and its 95% interval from its own
    variance components (`measured`, `components`, `interval_of`). On simulated data it covers a known difference
    93.5-94.7% of the time with 3 replicates and 89.6% with 2, where a percentile bootstrap at every level covered
    76.7% with 3 replicates when pretraining noise dominates (tests/test_stats.py)."""
    m = measured(metric, b, a, resamples, seed)
    return interval_of(m, components([[m]]))


# ----------------------------------------------------------------------------
# Another design: what it would detect, and what would detect a given difference. A reading of the components
# splits the top units' variance into its replicate and seed parts, neither below 0: at the estimate ("point"), or
# at the low or high 95% confidence bound of top_var (the seeds' estimate kept, at most the whole). Where the
# method of moments put the replicate part below 0, the point reading takes 0 and says so. With one fine-tuning
# seed the two cannot be told apart: the point and high readings take it all as pretraining noise (more seeds
# change nothing), the low one all as seed noise. The examples' shared part shrinks with the test set; the part that
# differs between runs is inside the runs' part and shrinks with the runs.

READINGS = ("low", "point", "high")


def split(c, reading="point"):
    """(replicate, seed) variance of one run at this reading (replicate None with one replicate)."""
    top = c["top_var"] if reading == "point" else bound(c["top_var"], c["top_df"], reading)
    if c["replicates"] == 1:
        return None, top
    if c["seeds_inside"]:
        return (0.0, top) if reading == "low" else (top, 0.0)
    seed = min(c["seed_var"], top * c["seeds"])
    return top - seed / c["seeds"], seed


def project(c, replicates, seeds, examples, reading="point"):
    """The standard error, degrees of freedom and detectable difference (80% power) of a design with this many
    replicates, seeds and test examples, from a comparison's variance components at a reading (see above): the
    replicate term (replicate + seed / seeds) / replicates on arms (replicates - 1) degrees of freedom, the example
    term the shared part / examples, and more on fewer examples (examples_part). At the measured design the point reading is the comparison's own
    standard error, so a report's detectable difference comes back, unless its replicate part was below 0. One
    replicate: the seeds are the top level and pretraining noise is not counted (as `interval`)."""
    replicate, seed = split(c, reading)
    if replicates > 1:
        if replicate is None:
            raise InputError("these variance components come from one pretraining run per arm: they hold no "
                             "pretraining noise to project onto several replicates")
        v_runs, units = (replicate + seed / seeds) / replicates, replicates
    else:
        v_runs, units = seed / seeds, seeds
    v_examples = examples_part(c, examples, replicates * seeds)
    v, k = v_runs + v_examples, c["arms"] * (units - 1)
    df = v * v / (v_runs * v_runs / k) if v_runs > 0 and k else math.inf
    return {"se": math.sqrt(v), "df": df, "detectable": detectable(v_runs, v_examples, k)}


def shared_examples(m, runs):
    """N times the test examples' variance that every run shares (at least 0): of `measured`'s bootstrap of the mean
    over its `runs` runs, the part that does not differ between runs (that part is in the runs' spread)."""
    return max(0.0, m["example_var"] - m["example_run_var"] / runs)


def examples_part(c, examples, runs=math.inf):
    """The test examples' part of the variance of a mean over `runs` runs on `examples` test examples: the part every
    run shares; and, on fewer test examples than the comparison's, what each run's own luck on them adds beyond what
    the runs' part holds (that part was measured on the comparison's test set; on a larger one the projection keeps
    it as measured, erring wide)."""
    more = max(0.0, 1 / examples - 1 / c["examples"]) * c["example_run_var"] / runs
    return shared_examples(c, c["replicates"] * c["seeds"]) / examples + more


def floor(c, examples):
    """The least difference any number of replicates and seeds would detect on `examples` test examples: with the
    runs' part gone, the shared part of the examples' is left (known, so the normal quantiles)."""
    return detectable(0.0, examples_part(c, examples), 0)


def needed(c, target, replicates, seeds, examples, most_examples, limit=200, reading="point"):
    """What would detect `target` with 80% power at a reading, changing one thing of the design at a time: the
    fewest replicates (at the same seeds and examples), seeds, and test examples (up to `most_examples`, what the
    task holds); None where no number up to `limit` (or the test set) reaches it. More examples do not always help:
    as the examples' share of the variance shrinks, the degrees of freedom fall towards arms (replicates - 1), and
    past some number the detectable difference rises again towards that floor; the fewest is searched for below
    the number that detects least."""
    def reaches(r, s, n):
        return project(c, r, s, n, reading)["detectable"] <= target

    def least(low, high, fits):  # the fewest of low..high that fit, where every number above a fitting one fits
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if fits(middle) else (middle + 1, high)
        return low

    out = {}
    for key, design in (("replicates", lambda k: (k, seeds, examples)), ("seeds", lambda k: (replicates, k, examples))):
        out[key] = least(2 if key == "replicates" else 1, limit, lambda k: reaches(*design(k))) if reaches(
            *design(limit)) else None
    at = functools.lru_cache(maxsize=None)(lambda n: project(c, replicates, seeds, n, reading)["detectable"])
    grid = sorted({min(most_examples, max(1, round(examples * 1.05 ** k))) for k in range(-200, 200)})
    low, high = 0, len(grid) - 1
    while high - low > 2:  # the number that detects least: a ternary search of the valley
        one, two = low + (high - low) // 3, high - (high - low) // 3
        low, high = (low, two) if at(grid[one]) <= at(grid[two]) else (one, high)
    best = min(range(low, high + 1), key=lambda i: at(grid[i]))
    out["examples"] = None
    if at(grid[best]) <= target:  # below it fewer examples detect more: the first grid point, then the first n
        i = least(0, best, lambda i: at(grid[i]) <= target)
        out["examples"] = least(grid[i - 1] + 1 if i else 1, grid[i], lambda n: at(n) <= target)
    out["all_examples"] = at(most_examples)
    return out


# ----------------------------------------------------------------------------
# Words. An interval's own words hold for it alone; a study that reads several has a family, and the chance that
# one of them excludes 0 with no true difference grows with their number. Holm's step-down adjustment keeps that
# chance at 5% over a family (any dependence between its members); a verdict sentence uses it.


def verdict(low, high, above="better", below="worse"):
    """Words that follow from an interval of a difference: `above` or `below` only when it excludes 0."""
    if low is None or high is None:
        return "no interval"
    return above if low > 0 else below if high < 0 else "no detectable difference"


def holm(p_values):
    """Holm's adjusted p values, in the order given: the i-th smallest p times (m - i + 1), never below the one
    before it, at most 1. A difference is family-wise at 5% where its adjusted p is below 0.05."""
    order = sorted(range(len(p_values)), key=lambda i: p_values[i])
    adjusted, running = [0.0] * len(p_values), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


def family(differences, above="better", below="worse"):
    """Holm over a family of differences (`interval` dicts with "p" and "mean"): each gets "family", its adjusted p,
    the family's size and the words that adjusted p allows."""
    for d, p in zip(differences, holm([d["p"] for d in differences])):
        words = (above if d["mean"] > 0 else below) if p < 0.05 else "no family-wise difference"
        d["family"] = {"p": p, "size": len(differences), "verdict": words}
    return differences


def by_chance(compared, excluded, level=0.05):
    """What chance alone gives among `compared` 95% intervals if no method differed from its reference: the
    expected number that exclude 0, and the probability of `excluded` or more (binomial, as if independent)."""
    tail = sum(math.comb(compared, k) * level ** k * (1 - level) ** (compared - k)
               for k in range(excluded, compared + 1))
    return {"compared": compared, "excluded": excluded, "expected": compared * level, "p_as_many": tail}


def choose_on_dev(dev):
    """The setting whose runs have the highest mean dev score ({setting: dev scores}); the first on a tie. Test
    scores never enter: they are read once, for the chosen setting."""
    means = {setting: float(np.mean(scores)) for setting, scores in dev.items()}
    return max(means, key=lambda setting: (means[setting], -list(means).index(setting)))


def choose_apart(dev):
    """Per run, the setting chosen on the dev scores of other runs ({setting: (R, S) dev scores} -> R lists of S
    settings): a replicate's on the other replicates', with one replicate a seed's on the other seeds'. A run's
    own dev score never chooses the setting its test score is read at: a run that is lucky on dev is often lucky
    on test, and choosing on it would carry that luck into the comparison. A single run has no other: its own."""
    R, S = next(iter(dev.values())).shape
    if R * S == 1 or len(dev) == 1:
        return [[choose_on_dev(dev)] * S for _ in range(R)]
    if R > 1:
        return [[choose_on_dev({k: np.delete(v, r, 0) for k, v in dev.items()})] * S for r in range(R)]
    return [[choose_on_dev({k: np.delete(v, i, 1) for k, v in dev.items()}) for i in range(S)]]


def clip(iv, low, high):
    """An interval cut to the values its metric can take (F1 and accuracy lie in [0, 1])."""
    return {**iv, "low": max(iv["low"], low), "high": min(iv["high"], high)}


# ----------------------------------------------------------------------------
# Has a model learned anything the task can rank? Decided on dev alone. A model is informative on a task when its
# dev score lies above two baselines by more than noise (the interval of the difference excludes 0): the majority
# baseline (the most common train label everywhere), and chance (the model's own dev predictions dealt to the
# examples at random: the same labels in the same proportions, unrelated to the input). A model at chance can
# beat the majority baseline on macro-F1 by spreading its guesses over several labels; only a model that reads
# its input beats both.

INFORMATIVE_RULE = ("informative: the dev score lies above the majority baseline and above chance (the model's "
                    "own dev predictions dealt to the examples at random) by more than noise, each difference's 95% "
                    "interval over replicates, seeds and dev examples excluding 0")


def informative(metric, dev, majority, chance):
    """Whether dev counts (R, S, N, K) beat the majority's and chance's counts (the same shape, paired), with both
    intervals and, if not, why."""
    over = {"majority": interval(metric, dev, majority, resamples=1000), "chance": interval(metric, dev, chance,
                                                                                          resamples=1000)}
    short = [f"not above {name} on dev ({100 * iv['mean']:+.2f} [{100 * iv['low']:+.2f}, {100 * iv['high']:+.2f}])"
             for name, iv in over.items() if not iv["low"] > 0]
    return {"ok": not short, "why": "; ".join(short) or None,
            **{name: {k: iv[k] for k in ("mean", "low", "high")} for name, iv in over.items()}}


# ----------------------------------------------------------------------------
# Comparing fine-tuned arms: each replicate's setting chosen on the other replicates' dev scores, whether it is
# informative, and every arm's difference to a reference arm with its interval (the runs' variance pooled over the
# arms that learned), its detectable difference and the words the interval allows.


def compare(arms, kind_of, reference=None):
    """arms: {arm: {setting: [results files of `eval.py finetune`, one per replicate]}}, the reference (default:
    the first arm) among them; kind_of(task entry) -> its task kind (eval.py's). Per task: the majority baseline,
    the fine-tuning seeds every run shares (the pairing), and per arm the setting chosen for each run
    (choose_apart), the mean dev score per setting, whether it is informative on dev, the test score (primary
    metric) with its interval, accuracy, and its difference to the reference (interval, detectable difference,
    verdict, its own components beside the pooled ones). A task where the reference is not informative gets no
    verdict; tasks that some arm lacks are named in "left_out", and a task's seeds that not every arm ran in its
    "unpaired"."""
    reference = reference or next(iter(arms))
    if reference not in arms:
        raise InputError(f"reference arm {reference!r} is not among the arms {list(arms)}")
    loaded = {arm: {setting: [(Path(f), load_results(f)) for f in files]
                    for setting, files in settings.items()} for arm, settings in arms.items()}
    every = [r for settings in loaded.values() for runs in settings.values() for r in runs]
    if len({len(runs) for settings in loaded.values() for runs in settings.values()}) > 1:
        raise InputError("the arms have different numbers of replicates; replicate r of every arm pairs with "
                         "replicate r of the others")
    tasks = list(dict.fromkeys(t for _, r in every for t in r["tasks"]))
    shared = [t for t in tasks if all(t in r["tasks"] for _, r in every)]
    if not shared:
        raise InputError(f"no task is in every results file ({', '.join(tasks)} each lack from some): there is "
                         f"nothing to compare")
    result = {task: compare_task(loaded, reference, task, kind_of) for task in shared}
    left_out = {t: [str(path) for settings in loaded.values() for runs in settings.values() for path, r in runs
                    if t not in r["tasks"]] for t in tasks if t not in shared}
    return {"tasks": result, "left_out": left_out}


def counts_of(kind, gold, every_prediction, scored):
    """A function (predictions -> (N, K) counts) over columns shared by every prediction of every arm."""
    columns = kind.columns(gold, [y for ys in every_prediction for y in ys], scored)
    return lambda ys: kind.counts(gold, ys, columns)


def paired_seeds(loaded, task):
    """Replicate r's fine-tuning seeds that every arm ran on `task` (in every setting), in the first file's order:
    run (r, seed) of one arm pairs with run (r, seed) of every other. Replicates may use other seeds than each
    other (reproduce.py gives each its own), but as many each: the table of runs is replicates x seeds."""
    R = len(next(iter(next(iter(loaded.values())).values())))
    seeds = []
    for r in range(R):
        entries = [runs[r][1]["tasks"][task] for settings in loaded.values() for runs in settings.values()]
        seeds.append([s for s in entries[0]["seeds"] if all(s in t["seeds"] for t in entries)])
    if not seeds[0]:
        raise InputError(f"{task}: no fine-tuning seed of replicate 1 is in every arm's results file, so no run pairs "
                         f"with another")
    if len({len(x) for x in seeds}) > 1:
        raise InputError(f"{task}: the replicates share {', '.join(str(len(x)) for x in seeds)} fine-tuning seeds "
                         f"across the arms: every replicate needs as many (its runs are a replicates x seeds table)")
    return seeds


def compare_task(loaded, reference, task, kind_of):
    runs = [r["tasks"][task] for settings in loaded.values() for files in settings.values() for _, r in files]
    first = runs[0]
    modes = {r.get("ner_mode") or "default" for r in runs} if first["kind"] == "token" else set()
    if len(modes) > 1:  # each arm's dev choice and test score would be read again in the first one's
        raise InputError(f"{task}: the runs read entities with different --ner_mode ({', '.join(sorted(modes))}): "
                         f"their entity F1s are not one measure; fine-tune every arm with the same --ner_mode")
    kinds = {r["kind"] for r in runs}
    if len(kinds) > 1:  # one kind's counts and metric read the predictions of every arm
        raise InputError(f"{task}: the results files hold it as tasks of different kinds ({', '.join(sorted(kinds))})")
    try:
        kind = kind_of(first)
    except KeyError as e:
        raise InputError(f"{task}: its kind or --ner_mode {e} is not one eval.py knows (a results file of another "
                         f"version?)") from None
    seeds = paired_seeds(loaded, task)
    metric = first["primary"]
    rows, test, dev = {}, {}, {}
    for arm, settings in loaded.items():
        scores = {setting: np.array([[t["tasks"][task]["seeds"][s]["dev"][metric] for s in seeds[r]]
                                     for r, (_, t) in enumerate(files)])
                  for setting, files in settings.items()}  # (R, S) per setting
        chosen = choose_apart(scores)

        def read(r, i, split):  # run (r, seed i) at the setting chosen for it
            path, results = settings[chosen[r][i]][r]
            return read_predictions(path, results["tasks"][task], seeds[r][i], split)

        test[arm], dev[arm] = ([[read(r, i, split) for i in range(len(seeds[r]))] for r in range(len(chosen))]
                               for split in ("test", "dev"))
        used = [scores[chosen[r][i]][r, i] for r in range(len(chosen)) for i in range(len(seeds[r]))]
        rows[arm] = {"setting": ", ".join(dict.fromkeys(x for row in chosen for x in row)), "chosen": chosen,
                     "dev": {k: float(v.mean()) for k, v in scores.items()}, "dev_chosen": float(np.mean(used)),
                     "runs": len(test[arm]) * len(seeds[0])}
    counts = {}
    for split, preds in (("test", test), ("dev", dev)):
        gold = preds[reference][0][0][0]
        if any(g != gold for p in preds.values() for rep in p for g, _ in rep):
            raise InputError(f"{task}: the arms were scored on different {split} examples")
        every = [ys for p in preds.values() for rep in p for _, ys in rep]
        majority = kind.fill(first["majority"], gold)
        count = counts_of(kind, gold, every + [majority], first["scored"])
        counts[split] = {arm: np.array([[count(ys) for _, ys in rep] for rep in p]) for arm, p in preds.items()}
        if split == "dev":
            rng = np.random.default_rng(0)
            chance = {arm: np.array([[count(kind.permute(ys, rng)) for _, ys in rep] for rep in p])
                      for arm, p in preds.items()}
            majority_counts = count(majority)

    def primary(totals):
        return kind.metrics(totals)[metric]

    for arm, row in rows.items():
        d = counts["dev"][arm]
        row["informative"] = informative(primary, d, np.broadcast_to(majority_counts, d.shape), chance[arm])
        row["test"] = clip(interval(primary, counts["test"][arm]), 0, 1)
        row["accuracy"] = float(kind.metrics(counts["test"][arm].sum(2))["accuracy"].mean())
    ranked = rows[reference]["informative"]["ok"]
    diffs = {arm: measured(primary, counts["test"][arm], counts["test"][reference]) for arm in rows if arm != reference}
    pool = [arm for arm in diffs if rows[arm]["informative"]["ok"]]  # the arms that learned: alike, as pooling assumes
    pooled = components([[diffs[arm] for arm in pool]]) if len(pool) > 1 else None
    for arm, m in diffs.items():
        own = interval_of(m, components([[m]]))
        d = clip(interval_of(m, pooled) if arm in pool and pooled else own, -1, 1)
        d["own"] = {k: own[k] for k in ("low", "high", "df", "detectable", "detectable_low", "detectable_high",
                                        "components")}
        d["measured"] = {**m, "runs": m["runs"].tolist()}  # what a later reading pools again (reproduce.py's plan)
        d["verdict"] = verdict(d["low"], d["high"]) if ranked else "no verdict: the reference is not informative"
        rows[arm]["difference"] = d
    n_dev = counts["dev"][reference].shape[2]
    spent = {arm: [budget(loaded[arm][setting][r][1], task) for r, chosen in enumerate(row["chosen"])
                   for setting in dict.fromkeys(chosen)] for arm, row in rows.items()}  # each run at its setting
    mixed = len({tuple(b.items()) for runs in spent.values() for b in runs}) > 1
    unpaired = {str(path): extra for settings in loaded.values() for files in settings.values()  # named, not dropped
                for r, (path, results) in enumerate(files)
                if (extra := [s for s in results["tasks"][task]["seeds"] if s not in seeds[r]])}
    return {"kind": kind.name, "metric": metric, "baseline": first["baseline"], "seeds": seeds,
            "ner_mode": first.get("ner_mode"), "replicates": len(test[reference]), "reference": reference,
            "ranked": ranked, "dev_examples": n_dev, "test_examples": counts["test"][reference].shape[2],
            "dev_split": first.get("dev_split"), "arms": rows, "pooled": pool if pooled else [],
            **({"mixed_budgets": spent} if mixed else {}), **({"unpaired": unpaired} if unpaired else {})}


def budget(results, task):
    """What a results file's fine-tuning of `task` spent, as `eval.py finetune` records it: optimizer steps of a
    batch, the train examples they read, the tokens per example, the dev evaluations a setting was chosen among,
    how a sequence classifier pooled the encoder's output.
    Arms (or replicates) fine-tuned on different budgets differ by more than their pretraining: a comparison of them
    says so (finetune_markdown). A file that does not record a field leaves it None."""
    t, args = results["tasks"][task], results.get("args") if isinstance(results.get("args"), dict) else {}
    examples = t.get("examples") if isinstance(t.get("examples"), dict) else {}
    return {"steps": t.get("steps"), "batch_size": args.get("batch_size"), "train_examples": examples.get("train"),
            "max_len": args.get("max_len"), "evals": args.get("evals"), "pooling": args.get("pooling")}


def compared(comparison):
    """The differences of a comparison that carry a verdict."""
    return [row["difference"] for t in comparison["tasks"].values() for row in t["arms"].values()
            if "difference" in row and not row["difference"]["verdict"].startswith("no verdict")]


def table(files, kind_of, reference=None):
    """`eval.py table`: print and return the comparison of results files of `eval.py finetune`, each file an arm,
    or several separated by commas, the replicates of one arm (replicate r of each arm paired), its comparisons read
    alone and as one family (Holm); the first arm is the reference unless --reference names another. An arm is
    named by its first file. kind_of: eval.py's task_kind."""
    if len(set(map(str, files))) < len(files):
        raise InputError(f"a results file is given twice: {list(map(str, files))}")
    arms = {}
    for f in files:
        runs = str(f).split(",")
        name = Path(runs[0]).stem if Path(runs[0]).stem not in arms else runs[0]
        arms[name] = {"-": runs}
    from machinery.report import finetune_markdown  # rendering: report.py imports this file
    comparison = compare(arms, kind_of, reference)
    family(compared(comparison))  # the table's comparisons are one family
    text = finetune_markdown(comparison)
    print(text, end="")
    return text
