"""The statistics of a comparison: t quantiles against scipy, the interval's coverage on simulated data with a
known difference and its width against the number of replicates, scores of resampled test sets against the
oracles, settings chosen on dev, collapsed arms flagged and never compared, and the CKA band's false-positive
rate on data with no effect."""
import json
import zlib

import numpy as np
import pytest

import eval as ev
from machinery.cli import InputError


def test_t_quantile_matches_scipy():
    from scipy.stats import t
    for df in [1, 2, 3, 4, 5, 6, 9, 10, 29, 30, 120, 999]:
        for p in (0.9, 0.95, 0.975):
            assert ev.t_quantile(p, df) == pytest.approx(t.ppf(p, df), rel=1e-7)
    assert ev.t_quantile(0.975, 2.9) == pytest.approx(t.ppf(0.975, 2))  # fractional df rounded down
    assert ev.t_quantile(0.975, float("inf")) == pytest.approx(1.959964, abs=1e-6)
    mean, low, high = ev.t_interval([1.0, 2.0, 4.0])
    assert (low, high) == pytest.approx(t.interval(0.95, 2, loc=mean, scale=np.std([1, 2, 4], ddof=1) / 3 ** 0.5))
    assert ev.t_interval([3.0]) == (3.0, None, None)


# ----------------------------------------------------------------------------
# The interval on simulated data: two arms whose expected score differs by DELTA


DELTA = 0.1


def mean_metric(totals):
    return totals[..., 0] / totals[..., 1]  # the counts hold (score, 1) per example: the metric is their mean


def simulated(rng, R, S, N, replicate_sd, seed_sd, example_sd, noise_sd):
    """(a, b) counts of shape (R, S, N, 2) from a hierarchical model: per arm, replicate effects, seed effects
    within them, an arm-by-example effect (what the test examples add to a difference), and noise per run and
    example; example difficulty is shared by both arms. The arms' expected difference is DELTA."""
    difficulty = rng.normal(0, 1, N)
    arms = []
    for mu in (0.0, DELTA):
        x = (mu + rng.normal(0, replicate_sd, (R, 1, 1)) + rng.normal(0, seed_sd, (R, S, 1))
             + difficulty + rng.normal(0, example_sd, N) + rng.normal(0, noise_sd, (R, S, N)))
        arms.append(np.stack([x, np.ones_like(x)], -1))
    return arms


@pytest.mark.parametrize("R, replicate_sd, example_sd, least", [(3, 0.2, 0.1, 0.91), (3, 0.05, 0.3, 0.91),
                                                                (2, 0.1, 0.3, 0.85)])
def test_interval_covers_the_known_difference_about_95_percent_of_the_time(R, replicate_sd, example_sd, least):
    """Pretraining noise dominating, test examples dominating, two replicates: 300 simulated studies each.
    Measured over 1,000 studies: 93.6%, 93.6% and 88.9% (two replicates leave one degree of freedom to the
    spread of pretraining runs); a percentile bootstrap at every level covered 76.7%, 93.3% and 84.0%."""
    rng = np.random.default_rng(R + int(100 * replicate_sd))
    hits = 0
    for i in range(300):
        a, b = simulated(rng, R, 3, 100, replicate_sd, 0.05, example_sd, 0.4)
        iv = ev.interval(mean_metric, b, a, resamples=400, seed=i)
        hits += iv["low"] <= DELTA <= iv["high"]
    assert least <= hits / 300 <= 0.98, hits / 300


def test_interval_narrows_with_more_replicates_and_says_what_it_counts():
    rng = np.random.default_rng(5)
    widths = {}
    for R in (2, 4, 8):
        ivs = [ev.interval(mean_metric, *simulated(rng, R, 3, 100, 0.1, 0.05, 0.2, 0.4)[::-1], resamples=300, seed=i)
               for i in range(40)]
        widths[R] = np.mean([iv["half"] for iv in ivs])
        assert all(iv["units"] == R and iv["level"] == "replicates" for iv in ivs)
    assert widths[2] > 1.5 * widths[4] > 1.5 * 1.1 * widths[8], widths
    one = ev.interval(mean_metric, *simulated(rng, 1, 5, 100, 0.1, 0.05, 0.2, 0.4)[::-1], resamples=300)
    assert one["units"] == 5 and one["level"] == "seeds"  # one replicate: the seeds are the top level
    same = simulated(rng, 3, 3, 50, 0.1, 0.05, 0.2, 0.4)[0]
    zero = ev.interval(mean_metric, same, same, resamples=200)
    assert zero["mean"] == zero["low"] == zero["high"] == 0.0  # an arm against itself


def test_a_resampled_test_set_is_scored_as_its_repeated_examples_are():
    """The interval recomputes each metric from per-example counts weighted by a draw of the examples: equal to
    scoring the drawn examples themselves (repeats included), for every kind and metric."""
    rng = np.random.default_rng(3)
    gold_tags = [list(rng.choice(["O", "O", "B-X", "I-X", "B-Y"], size=rng.integers(1, 9))) for _ in range(40)]
    pred_tags = [list(rng.choice(["O", "B-X", "I-X", "I-Y"], size=len(g))) for g in gold_tags]
    cases = [(ev.KINDS["token"], gold_tags, pred_tags, None), (ev.NER_MODES["strict"], gold_tags, pred_tags, None),
             (ev.KINDS["single"], list(rng.choice(list("abcd"), 40)), list(rng.choice(list("abce"), 40)), None),
             (ev.KINDS["multi"], [sorted(set(rng.choice(list("xyz"), rng.integers(0, 3)))) for _ in range(40)],
              [sorted(set(rng.choice(list("xyz"), rng.integers(0, 3)))) for _ in range(40)], ["x", "y", "z"])]
    for kind, gold, pred, labels in cases:
        columns = kind.columns(gold, pred, labels)
        counts = kind.counts(gold, pred, columns)
        for _ in range(5):
            draw = rng.integers(0, 40, 40)
            weights = np.bincount(draw, minlength=40).astype(float)
            got = kind.metrics(weights @ counts)
            want = kind.score([gold[i] for i in draw], [pred[i] for i in draw], labels)
            assert {k: float(v) for k, v in got.items()} == pytest.approx(want, abs=1e-12), kind.name


# ----------------------------------------------------------------------------
# compare(): settings chosen on dev, collapse, verdicts, from results files as `finetune` writes them

LABELS = ["a", "b", "c"]


def write_results(path, runs, baseline_dev=0.2):
    """A results file of one replicate with one task 't' (single-label): runs = {seed: (dev macro-F1, test
    predictions)}, the gold labels GOLD; each seed's predictions in a file beside it, as `finetune` writes them."""
    kind, seeds = ev.KINDS["single"], {}
    for seed, (dev, pred) in runs.items():
        name = f"{path.stem}.seeds/t-seed{seed}.json"
        (path.parent / name).parent.mkdir(parents=True, exist_ok=True)
        rows = [{"index": i, "line": i + 1, "gold": g, "pred": p} for i, (g, p) in enumerate(zip(GOLD, pred))]
        (path.parent / name).write_text(json.dumps({"predictions": rows}))
        seeds[str(seed)] = {"dev": {"macro_f1": dev}, "test": kind.score(GOLD, pred, LABELS), "predictions": name}
    majority = kind.score(GOLD, ["a"] * len(GOLD), LABELS)
    task = {"task": "t", "kind": "single", "primary": "macro_f1", "labels": LABELS, "scored": LABELS,
            "ner_mode": None, "seeds": seeds, "baseline": {"dev": {"macro_f1": baseline_dev}, "test": majority}}
    path.write_text(json.dumps({"tasks": {"t": task}}))
    return path


GOLD = list(np.random.default_rng(0).choice(LABELS, 60, p=[0.5, 0.3, 0.2]))


def noisy(rng, right):
    """Predictions that are right with probability `right`, a random label otherwise."""
    return [g if rng.random() < right else str(rng.choice(LABELS)) for g in GOLD]


def arm(tmp_path, name, settings, R=3, seeds=(1, 2)):
    """{setting: [results files, one per replicate]}, settings = {setting: (dev score, accuracy of predictions)}."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    return {setting: [write_results(tmp_path / f"{name}-{setting}-r{r}.json",
                                    {s: (dev + 0.01 * rng.random(), noisy(rng, right)) for s in seeds})
                      for r in range(R)] for setting, (dev, right) in settings.items()}


def test_the_setting_is_chosen_on_dev_and_test_is_read_for_it_alone(tmp_path):
    """Arm 'x' is best on test at lr 2 but best on dev at lr 1: lr 1 is chosen, and its test score is reported."""
    arms = {"ref": arm(tmp_path, "ref", {"1": (0.5, 0.6)}), "x": arm(tmp_path, "x", {"1": (0.8, 0.5), "2": (0.6, 1.0)})}
    t = ev.compare(arms)["t"]
    x = t["arms"]["x"]
    assert x["setting"] == "1" and x["dev"]["1"] > x["dev"]["2"]
    scores = [json.loads(f.read_text())["tasks"]["t"]["seeds"] for f in arms["x"]["1"]]
    assert x["test"]["mean"] == pytest.approx(np.mean([s["test"]["macro_f1"] for run in scores for s in run.values()]))
    assert x["runs"] == 6 and t["replicates"] == 3 and t["seeds"] == ["1", "2"]
    assert ev.choose_on_dev({"1": [0.5, 0.7], "2": [0.6, 0.6]}) == "1"  # a tie goes to the first


def test_verdicts_follow_the_interval(tmp_path):
    arms = {"ref": arm(tmp_path, "ref", {"-": (0.5, 0.4)}), "good": arm(tmp_path, "good", {"-": (0.9, 0.95)}),
            "same": {"-": arm(tmp_path, "ref", {"-": (0.5, 0.4)})["-"]}}
    t = ev.compare(arms)["t"]
    good = t["arms"]["good"]["difference"]
    assert good["low"] > 0 and good["verdict"] == "better"
    same = t["arms"]["same"]["difference"]
    assert same["mean"] == 0.0 and same["verdict"] == "no detectable difference"
    worse = ev.compare(arms, reference="good")["t"]["arms"]["ref"]["difference"]
    assert worse["high"] < 0 and worse["verdict"] == "worse"
    assert ev.verdict(-0.1, 0.2) == "no detectable difference" and ev.verdict(0.1, 0.2, "higher") == "higher"


def test_a_collapsed_arm_is_flagged_and_never_compared(tmp_path):
    """An arm that predicts one label everywhere sits at the majority baseline: it wins against a reference that
    falls below the baseline, but it is marked collapsed and given no verdict; so is every arm against it."""
    constant = {"-": [write_results(tmp_path / f"const-r{r}.json", {s: (0.1, ["a"] * len(GOLD)) for s in (1, 2)})
                      for r in range(3)]}
    arms = {"ref": arm(tmp_path, "ref", {"-": (0.5, 0.1)}), "const": constant,
            "good": arm(tmp_path, "good", {"-": (0.9, 0.95)})}
    t = ev.compare(arms)["t"]
    c = t["arms"]["const"]
    assert c["collapsed"] == "dev score not above the majority baseline"
    assert c["difference"]["verdict"] == "not compared: this arm collapsed"
    assert t["arms"]["good"]["difference"]["verdict"] == "better"
    against = ev.compare(arms, reference="const")["t"]["arms"]["good"]["difference"]
    assert against["verdict"] == "not compared: the reference collapsed"
    assert ev.collapsed([0.5, 0.6], 0.2, [True, True, False]) == "2 of 3 runs predict one label for every test example"
    assert ev.collapsed([0.5, 0.6], 0.2, [True, False]) is None


def test_compare_refuses_unpaired_arms(tmp_path):
    arms = {"ref": arm(tmp_path, "ref", {"-": (0.5, 0.5)}, R=3), "x": arm(tmp_path, "x", {"-": (0.5, 0.5)}, R=2)}
    with pytest.raises(InputError, match="different numbers of replicates"):
        ev.compare(arms)
    with pytest.raises(InputError, match="reference arm 'BERT'"):
        ev.compare(arms, reference="BERT")


def test_table_reads_replicates_separated_by_commas(tmp_path, capsys):
    ref, x = arm(tmp_path, "ref", {"-": (0.5, 0.5)})["-"], arm(tmp_path, "x", {"-": (0.8, 0.9)})["-"]
    text = ev.table([",".join(map(str, ref)), ",".join(map(str, x))])
    row = next(line for line in text.splitlines() if line.startswith(f"| {x[0].stem} "))
    assert "| 6 |" in row and row.endswith("| better |")
    assert "3 pretraining run(s) per arm x 2 fine-tuning seed(s)" in text


# ----------------------------------------------------------------------------
# The CKA band


def test_band_bound_is_the_one_sided_prediction_bound():
    from scipy.stats import t
    controls, pair = [0.10, 0.12, 0.11, 0.13], [0.2, 0.18, 0.22]
    b = ev.band(pair, controls, draw_sd=0.01, draws=3)
    sd = np.std(controls, ddof=1)
    want = np.mean(controls) + t.ppf(0.95, 3) * np.sqrt(sd ** 2 * (1 / 4 + 1 / 3) + 0.01 ** 2 / 3)
    assert b["bound"] == pytest.approx(want) and b["outside"] and b["k"] == 4
    assert not ev.band([0.125], controls)["outside"]
    one = ev.band(pair, [0.1])
    assert one["bound"] is None and one["outside"] is None and one["sd"] is None  # no spread to bound


@pytest.mark.parametrize("k, m", [(3, 3), (3, 1), (10, 3)])
def test_band_marks_a_layer_with_no_effect_outside_at_most_5_percent_of_the_time(k, m):
    """Controls-only data: the pair is drawn like a control (plus the noise of its text draws, which the rule
    counts), so any "outside" is a false positive. The old rule, above the largest of 3 controls, errs 25% of the
    time with one replicate."""
    rng = np.random.default_rng(k * 10 + m)
    trials = 4000
    controls = rng.normal(0.3, 0.05, (trials, k))
    draw_sd = 0.01
    pair = rng.normal(0.3, 0.05, (trials, m)) + rng.normal(0, draw_sd / 3 ** 0.5, (trials, 1))
    rate = np.mean([ev.band(p, c, draw_sd, 3)["outside"] for p, c in zip(pair, controls)])
    assert 0.025 <= rate <= 0.055, rate
    if k == 3 and m == 1:
        assert np.mean(pair[:, 0] > controls.max(1)) == pytest.approx(0.25, abs=0.025)
