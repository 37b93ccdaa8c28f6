"""Comparing arms: what a difference between two methods must carry, and what a comparison could have seen.

Read on its own, top to bottom: t quantiles; the interval of a difference over every independent unit it rests
on; power, the smallest true difference a design finds 80% of the time, and the design that would find a given
one; the words an interval allows; settings chosen on dev; whether a model learned anything a task can rank; and
the comparison of fine-tuned arms that `eval.py table` and reproduce.py's reports print. It imports nothing of the
lesson: eval.py hands it the task kinds (how predictions become counts and scores).

The design. The unit of an arm is a pretraining run (a replicate); fine-tuning seeds and test examples are nested
in it. Replicate r of every arm shares its data order, a fine-tuning seed is the same classifier init and data
order for every model, and every model is scored on the same test examples, so differences are paired at every
level. Settings (learning rate, checkpoint) are chosen on dev; test is read once, for that setting.
"""
import functools
import math
from pathlib import Path
from statistics import NormalDist

import numpy as np

from machinery.cli import InputError
from machinery.tasks import load_results, read_predictions

# ----------------------------------------------------------------------------
# t quantiles and the t interval


def t_quantile(p, df):
    """Student's t quantile (p > 0.5) with df degrees of freedom (rounded down: conservative; at least 1), by
    bisection on the closed-form distribution function of an integer df; the normal quantile beyond 1,000."""
    df = max(1, int(df)) if math.isfinite(df) else math.inf
    if df > 1000:
        return NormalDist().inv_cdf(p)

    def cdf(x):  # P(T <= x) = (1 + P(|T| < x)) / 2, the series of Abramowitz & Stegun 26.7.3-4
        theta = math.atan(x / math.sqrt(df))
        c, term, total = math.cos(theta), 1.0, 0.0
        if df % 2:  # odd: (2/pi) (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
            for k in range((df - 1) // 2):
                total, term = total + term, term * (2 * k + 2) / (2 * k + 3) * c * c
            inside = 2 / math.pi * (theta + math.sin(theta) * c * total)
        else:  # even: sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
            for k in range(df // 2):
                total, term = total + term, term * (2 * k + 1) / (2 * k + 2) * c * c
            inside = math.sin(theta) * total
        return (1 + inside) / 2

    low, high = 0.0, 1e3
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (low, middle) if cdf(middle) >= p else (middle, high)
    return (low + high) / 2


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
# mean: the replicates' part v_runs (from `units` values: a chi-square on units - 1 degrees of freedom around its
# true value) plus the examples' part (a bootstrap of many draws: taken as known), df Satterthwaite's. Its power
# at a true difference d is the chance of that over the mean (normal around d, with the true variance) and over
# the replicates' estimate, which moves v and df together; with no examples' part it is the noncentral t's,
# P(|Z + d/se| > t(0.975, df) * S), S^2 a chi-square over df divided by df. The smallest difference found with
# 80% power solves power = 0.8: about (t(0.975, df) + t(0.80, df)) * se for a fixed df (2.8 se for large df, 5.7
# se at df = 2, where the sum's 5.36 se is found 77% of the time). The half-width is found only half the time.

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


def power(d, v_runs, v_examples, units):
    """The probability that `interval`'s 95% interval excludes 0 when the true difference is d, its variance
    v_runs (estimated from `units` values) + v_examples (see above); the integral over the replicates' estimate
    on a grid of 1,201 points."""
    sigma = math.sqrt(v_runs + v_examples)
    shift = abs(d) / sigma
    if v_runs <= 0 or units < 2:  # nothing estimated from few values: the normal quantile
        c = t_quantile(0.975, math.inf)
        return float(normal_cdf(shift - c) + normal_cdf(-shift - c))
    k = units - 1
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


def detectable(v_runs, v_examples, units):
    """The smallest true difference `interval` finds with 80% power (POWER): power's root, by bisection. 0 when
    nothing varies."""
    if not v_runs + v_examples > 0:
        return 0.0
    low, high = 0.0, 20 * math.sqrt(v_runs + v_examples)
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (middle, high) if power(middle, v_runs, v_examples, units) < POWER else (low, middle)
    return high


# ----------------------------------------------------------------------------
# The interval of a difference, and the variance components it rests on


def interval(metric, b, a=None, resamples=2000, seed=0):
    """The mean over runs of metric(b) - metric(a) (a None: of metric(b)) and its 95% interval.
    a, b: (R, S, N, K) counts of replicate r, fine-tuning seed s and test example n, paired; metric: (..., K) totals
    -> (...) score. Two variances add up: the runs', from the spread of the replicate means (each the mean over its
    seeds, so the seeds' spread is in it; with one replicate, from the spread of the seeds, and pretraining noise is
    not counted), and the test examples', from a bootstrap that draws N examples with replacement and recomputes
    the metric from every run's counts (F1 is not a mean over examples). The t quantile takes Satterthwaite's
    degrees of freedom: the top level's units - 1 when the runs' variance dominates, more as the examples' does. On
    simulated data it covers a known difference 93.6-94.7% of the time with 3 to 8 replicates and 88.9% with 2,
    where a percentile bootstrap at every level covered 76.7% with 3 replicates when pretraining noise dominates
    (tests/test_stats.py).
    Beside the interval: the variance components (per replicate, per seed within a replicate, per test example),
    from which `project` predicts the standard error of another design, and `detectable`, the smallest true
    difference this design finds with 80% power, from the same standard error and degrees of freedom."""
    R, S, N, K = b.shape
    arms = [b] if a is None else [b, a]

    def difference(scores):
        return scores[0] if a is None else scores[0] - scores[1]

    runs = difference([metric(x.sum(2)) for x in arms])  # (R, S)
    top = runs.mean(1) if R > 1 else runs[0]  # the independent units at the top level
    v_runs = float(top.var(ddof=1)) / len(top) if len(top) > 1 else 0.0
    w = np.random.default_rng(seed).multinomial(N, np.full(N, 1 / N), resamples).astype(np.float64)
    drawn = [(w @ x.transpose(2, 0, 1, 3).reshape(N, -1)).reshape(resamples, R, S, K) for x in arms]
    boot = difference([metric(x) for x in drawn])  # (resamples, R, S): each run on each draw
    v_examples = float(boot.mean((1, 2)).var(ddof=1))
    v = v_runs + v_examples
    df = v * v / (v_runs * v_runs / (len(top) - 1)) if v_runs > 0 else math.inf
    half = t_quantile(0.975, df) * math.sqrt(v)
    mean = float(runs.mean())
    seed_var = float(runs.var(1, ddof=1).mean()) if S > 1 else None  # the seeds' spread within a replicate
    if R > 1:  # the method of moments: below 0 where the replicate means vary less than their seeds predict
        replicate_var = float(top.var(ddof=1)) - (seed_var or 0.0) / S
    else:
        replicate_var = None  # one pretraining run: its noise is not measured
    components = dict(replicates=R, seeds=S, examples=N, replicate_var=replicate_var, seed_var=seed_var,
                      example_var=v_examples * N, seeds_inside=seed_var is None and R > 1)
    return {"mean": mean, "low": mean - half, "high": mean + half, "half": half,
            "units": len(top), "level": "replicates" if R > 1 else "seeds", "df": df,
            "sd_runs": math.sqrt(v_runs), "sd_examples": math.sqrt(v_examples),
            "detectable": detectable(v_runs, v_examples, len(top)), "components": components}


def project(components, replicates, seeds, examples):
    """The standard error, degrees of freedom and detectable difference (80% power) of a design with this many
    replicates, seeds and test examples, from a finished comparison's variance components: the replicate term
    (replicate + seed / seeds) / replicates, the example term example / examples (a test set drawn like the one
    measured). At the measured design the replicate term is the replicate means' variance, so a report's own
    detectable difference comes back. The replicate part is an unbiased estimate that noise can put below 0 (the
    means vary less than their seeds predict); then the means' whole spread is also read as seed noise, and the
    larger of the two readings is taken, so that more seeds never project a variance of 0. One replicate: the
    seeds are the top level and pretraining noise is not counted (as `interval`)."""
    c = components
    if replicates > 1:
        if c["replicate_var"] is None:
            raise InputError("these variance components come from one pretraining run per arm: they hold no "
                             "pretraining noise to project onto several replicates")
        seed_var = 0.0 if c["seeds_inside"] else c["seed_var"] or 0.0
        unit = c["replicate_var"] + seed_var / seeds
        if c["replicate_var"] < 0:
            unit = max(unit, (c["replicate_var"] + seed_var / c["seeds"]) * c["seeds"] / seeds)
        v_runs, units = unit / replicates, replicates
    else:
        v_runs, units = (c["seed_var"] or 0.0) / seeds, seeds
    v_examples = c["example_var"] / examples
    v = v_runs + v_examples
    df = v * v / (v_runs * v_runs / (units - 1)) if v_runs > 0 and units > 1 else math.inf
    return {"se": math.sqrt(v), "df": df, "detectable": detectable(v_runs, v_examples, units)}


def needed(components, target, replicates, seeds, examples, most_examples, limit=200):
    """What would detect `target` with 80% power, changing one thing of the design at a time: the fewest
    replicates (at the same seeds and examples), seeds, and test examples (up to `most_examples`, what the task
    holds); None where no number up to `limit` (or the test set) reaches it. More examples do not always help: as
    the examples' share of the variance shrinks, the degrees of freedom fall towards replicates - 1."""
    def reaches(r, s, n):
        return project(components, r, s, n)["detectable"] <= target

    def least(low, design):  # the fewest of low..limit that reach the target (more never detect less), or None
        if not reaches(*design(limit)):
            return None
        high = limit
        while low < high:
            middle = (low + high) // 2
            low, high = (low, middle) if reaches(*design(middle)) else (middle + 1, high)
        return low

    out = {"replicates": least(2, lambda k: (k, seeds, examples)), "seeds": least(1, lambda k: (replicates, k, examples))}
    grid = sorted({min(most_examples, round(examples * 1.05 ** k)) for k in range(200)} | {most_examples})
    first = next((n for n in grid if reaches(replicates, seeds, n)), None)
    if first is not None:  # the least n between the grid point before and this one
        low = max([n for n in grid if n < first] + [0]) + 1
        out_n = next(n for n in range(low, first + 1) if reaches(replicates, seeds, n))
        first = out_n
    out["examples"] = first
    out["all_examples"] = project(components, replicates, seeds, most_examples)["detectable"]
    return out


def verdict(low, high, above="better", below="worse"):
    """Words that follow from an interval of a difference: `above` or `below` only when it excludes 0."""
    if low is None or high is None:
        return "no interval"
    return above if low > 0 else below if high < 0 else "no detectable difference"


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
# Comparing fine-tuned arms: each arm's setting chosen on dev, whether it is informative, and every arm's
# difference to a reference arm with its interval, its detectable difference and the words the interval allows.


def compare(arms, kind_of, reference=None):
    """arms: {arm: {setting: [results files of `eval.py finetune`, one per replicate]}}, the reference (default:
    the first arm) among them; kind_of(task entry) -> its task kind (eval.py's). Per task: the majority baseline,
    the fine-tuning seeds every run shares (the pairing), and per arm the setting chosen on dev, the mean dev score
    per setting, whether it is informative on dev, the test score (primary metric) with its interval, accuracy,
    and its difference to the reference (interval, detectable difference, verdict). A task where the reference is
    not informative gets no verdict; tasks that some arm lacks are named in "left_out"."""
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


def compare_task(loaded, reference, task, kind_of):
    runs = [r["tasks"][task] for settings in loaded.values() for files in settings.values() for _, r in files]
    first = runs[0]
    kind = kind_of(first)
    seeds = [s for s in first["seeds"] if all(s in t["seeds"] for t in runs)]
    if not seeds:
        raise InputError(f"{task}: no fine-tuning seed is in every results file, so no run pairs with another")
    metric = first["primary"]
    rows, test, dev = {}, {}, {}
    for arm, settings in loaded.items():
        scores = {setting: [t["tasks"][task]["seeds"][s]["dev"][metric] for _, t in files for s in seeds]
                  for setting, files in settings.items()}
        chosen = choose_on_dev(scores)
        test[arm], dev[arm] = ([[read_predictions(path, t["tasks"][task], s, split) for s in seeds]
                                for path, t in settings[chosen]] for split in ("test", "dev"))
        rows[arm] = {"setting": chosen, "dev": {k: float(np.mean(v)) for k, v in scores.items()},
                     "runs": len(test[arm]) * len(seeds)}
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
    for arm, row in rows.items():
        if arm == reference:
            continue
        row["difference"] = d = clip(interval(primary, counts["test"][arm], counts["test"][reference]), -1, 1)
        d["verdict"] = verdict(d["low"], d["high"]) if ranked else "no verdict: the reference is not informative"
    n_dev = counts["dev"][reference].shape[2]
    spent = {arm: [budget(r, task) for _, r in loaded[arm][row["setting"]]] for arm, row in rows.items()}
    mixed = len({tuple(b.items()) for runs in spent.values() for b in runs}) > 1
    return {"kind": kind.name, "metric": metric, "baseline": first["baseline"], "seeds": seeds,
            "ner_mode": first.get("ner_mode"), "replicates": len(test[reference]), "reference": reference,
            "ranked": ranked, "dev_examples": n_dev, "test_examples": counts["test"][reference].shape[2],
            "dev_split": first.get("dev_split"), "arms": rows, **({"mixed_budgets": spent} if mixed else {})}


def budget(results, task):
    """What a results file's fine-tuning of `task` spent, as `eval.py finetune` records it: optimizer steps of a
    batch, the train examples they read, the tokens per example, the dev evaluations a setting was chosen among.
    Arms (or replicates) fine-tuned on different budgets differ by more than their pretraining: a comparison of them
    says so (finetune_markdown). A file that does not record a field leaves it None."""
    t, args = results["tasks"][task], results.get("args") if isinstance(results.get("args"), dict) else {}
    examples = t.get("examples") if isinstance(t.get("examples"), dict) else {}
    return {"steps": t.get("steps"), "batch_size": args.get("batch_size"), "train_examples": examples.get("train"),
            "max_len": args.get("max_len"), "evals": args.get("evals")}


def compared(comparison):
    """The differences of a comparison that carry a verdict."""
    return [row["difference"] for t in comparison["tasks"].values() for row in t["arms"].values()
            if "difference" in row and not row["difference"]["verdict"].startswith("no verdict")]


def table(files, kind_of, reference=None):
    """`eval.py table`: print and return the comparison of results files of `eval.py finetune`, each file an arm,
    or several separated by commas, the replicates of one arm (replicate r of each arm paired); the first arm is the
    reference unless --reference names another. An arm is named by its first file. kind_of: eval.py's task_kind."""
    if len(set(map(str, files))) < len(files):
        raise InputError(f"a results file is given twice: {list(map(str, files))}")
    arms = {}
    for f in files:
        runs = str(f).split(",")
        name = Path(runs[0]).stem if Path(runs[0]).stem not in arms else runs[0]
        arms[name] = {"-": runs}
    from machinery.report import finetune_markdown  # rendering: report.py imports this file
    text = finetune_markdown(compare(arms, kind_of, reference))
    print(text, end="")
    return text
