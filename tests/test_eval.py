"""eval.py: CKA known answers and properties, metrics against scikit-learn and seqeval, fine-tuning end to end
on the real tasks (skipped visibly without them), the CKA, MLM and table commands, and bad task input."""
import dataclasses
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import BYTE_IDS, MODERNBERT_TOKENIZER, ROOT, SHARED_DATA, made_up_texts, need, source_copy, tiny_model

import eval as ev
from machinery import cli, compare, metrics
from data import count_windows, load_tokenizer, prepare, val_batches
from machinery.cli import InputError, run
from machinery.tasks import read_task
from model import ModernBERT, ModernBERTConfig

TASKS = SHARED_DATA / "tasks"


def make_model(path, seed, tokenizer="bytes", **config):
    """A random tiny ModernBERT folder with its tokenizer files, as train.py writes a run's top level."""
    torch.manual_seed(seed)  # config: the ids of `tokenizer` (ModernBERT's defaults unless given)
    ModernBERT(ModernBERTConfig.from_preset("tiny", **config)).save_pretrained(path)
    load_tokenizer(tokenizer).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def byte_models(tmp_path_factory):
    """Three model folders near one start checkpoint, as a detour, its twin and a seed control are: the start's
    weights plus independent seeded noise (std 0.02 on every weight), with the byte tokenizer's files."""
    root = tmp_path_factory.mktemp("runs")
    for name, seed in (("a", 17), ("b", 18), ("c", 19)):
        model = tiny_model(0)
        torch.manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        model.save_pretrained(root / name)
        load_tokenizer("bytes").save_pretrained(root / name)
    return [root / name for name in "abc"]


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Made-up texts of different lengths (padding matters for the masked mean)."""
    return made_up_texts(tmp_path_factory.mktemp("texts") / "texts.jsonl", 24, 3, 25)


# ----------------------------------------------------------------------------
# CKA


def gram_cka(X, Y, dtype):
    """CKA by another route: centring the n x n Gram matrices (HKH) after forming them."""
    X, Y = np.asarray(X, dtype), np.asarray(Y, dtype)
    H = np.eye(len(X), dtype=dtype) - dtype(1 / len(X))
    K, L = H @ (X @ X.T) @ H, H @ (Y @ Y.T) @ H
    return float((K * L).sum() / np.sqrt((K * K).sum() * (L * L).sum()))


def test_linear_cka_known_answers():
    x, y = np.array([[1.0], [2], [3], [4]]), np.array([[1.0], [2], [3], [5]])
    assert ev.linear_cka(x, y) == pytest.approx(169 / 175, abs=1e-14)
    X = np.array([[1.0, 0], [0, 1], [-1, 0], [0, -1]])
    assert ev.linear_cka(X, X @ np.diag([1.0, 2.0])) == pytest.approx(5 / math.sqrt(34), abs=1e-14)


def test_linear_cka_invariances():
    rng = np.random.default_rng(0)
    X, Y = rng.normal(size=(40, 12)), rng.normal(size=(40, 7))
    Y[:, :3] += X[:, :3]  # related, so that CKA is far from both 0 and 1
    base = ev.linear_cka(X, Y)
    assert 0.1 < base < 0.9
    assert ev.linear_cka(X, X) == pytest.approx(1.0, abs=1e-12)
    Q, _ = np.linalg.qr(rng.normal(size=(12, 12)))
    assert ev.linear_cka(X @ Q, Y) == pytest.approx(base, abs=1e-12)  # orthogonal map
    assert ev.linear_cka(3.7 * X, Y) == pytest.approx(base, abs=1e-12)  # isotropic scaling
    assert ev.linear_cka(X + rng.normal(size=12), Y - 5.0) == pytest.approx(base, abs=1e-12)  # translation
    assert ev.linear_cka(torch.tensor(X, dtype=torch.float32), Y) == pytest.approx(base, abs=1e-6)  # tensors in


def test_linear_cka_float64_survives_a_large_common_offset():
    """Deep layers share a large offset: float32 through Gram matrices cancels, float64 with column centring not."""
    rng = np.random.default_rng(0)
    X = 1e4 + rng.normal(size=(64, 16))
    Y = 1e4 + X @ rng.normal(size=(16, 8)) / 4 + rng.normal(size=(64, 8))
    ours = ev.linear_cka(X, Y)
    assert ours == pytest.approx(gram_cka(X, Y, np.float64), abs=1e-6)
    assert abs(gram_cka(X, Y, np.float32) - ours) > 1e-2


def test_cka_command(byte_models, texts, tmp_path, capsys):
    a, b, c = byte_models
    out = tmp_path / "pair.json"
    r = ev.cka(a, b, texts, controls=[c], n=10, seeds=(1, 2), max_len=48, out=out, batch_size=4, device="cpu")
    assert r["layers"] == [0, 1, 2, 3] and r["replicates"] == 1 and r["draws"] == 2
    assert json.loads(out.read_text())["ratio"] == r["ratio"]
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "ratio" in capsys.readouterr().out
    control = r["controls"]["divergence"][0]
    for d, cd, ratio in zip(r["divergence"], control, r["ratio"]["mean"]):
        assert 1e-6 < d < 1 and 1e-6 < cd < 1 and ratio == pytest.approx(d / cd, rel=1e-12)
    per_seed = np.mean([s["pairs"][0] for s in r["per_seed"].values()], axis=0)
    assert r["cka"] == pytest.approx(per_seed.tolist(), abs=1e-15)
    # the control is the pair (a, c): what a run of a against c gives
    ac = ev.cka(a, c, texts, n=10, seeds=(1, 2), max_len=48, out=tmp_path / "ac.json", device="cpu")
    assert control == pytest.approx(ac["divergence"], abs=1e-12)
    # padding must not enter the mean: one text per batch (no padding) gives the same numbers
    alone = ev.cka(a, b, texts, controls=[c], n=10, seeds=(1, 2), max_len=48, out=tmp_path / "alone.json",
                   batch_size=1, device="cpu")
    assert alone["cka"] == pytest.approx(r["cka"], abs=1e-6)
    # each draw's CKA is over its own texts: its rows of the features computed once over every draw's texts
    pool, tok = [json.loads(line)["text"] for line in texts.read_text().splitlines()], load_tokenizer("bytes")
    models = [ModernBERT.from_pretrained(x).eval() for x in (a, b)]
    for seed in (1, 2):
        chosen = [pool[i] for i in np.random.default_rng(seed).choice(len(pool), 10, replace=False)]
        A, B = (ev.layer_means(m, tok, chosen, 48, 4, torch.device("cpu")) for m in models)
        assert r["per_seed"][seed]["pairs"][0] == pytest.approx(list(map(ev.linear_cka, A, B)), abs=1e-6)
    same = ev.cka(a, a, texts, n=10, seeds=(1, 2), max_len=48, out=tmp_path / "same.json", device="cpu")
    assert max(abs(d) for d in same["divergence"]) <= 1e-10  # a model against itself: a check
    with pytest.raises(InputError, match="has the same folder as"):  # a control must be another run
        ev.cka(a, b, texts, controls=[a], n=10, out=tmp_path / "x.json", device="cpu")


def test_cka_of_replicates(byte_models, texts, tmp_path, capsys):
    """Three replicate pairs (A_r, B_r): each pair's divergence is what a one-pair run gives, the seed controls are
    A_r against control run C_r (pairs that share no run), and the band, ratio, trend and intervals follow their
    definitions; the names reach the table; no matplotlib means no figure, not a failure. Without control runs the
    controls are A's replicates two by two, never a run twice."""
    import sys
    a, b, c = byte_models
    A = [a, make_model(tmp_path / "a2", 1, **BYTE_IDS), make_model(tmp_path / "a3", 2, **BYTE_IDS)]
    B = [b, c, make_model(tmp_path / "b3", 3, **BYTE_IDS)]
    C = [make_model(tmp_path / f"c{i}", 4 + i, **BYTE_IDS) for i in range(3)]
    kw = dict(n=8, seeds=(1, 2), max_len=32, device="cpu")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
        r = ev.cka(",".join(map(str, A)), B, texts, controls=C, names=["MLM", "CLM"], out=tmp_path / "three.json",
                   **kw)
    shown = capsys.readouterr().out
    assert "MLM vs CLM per layer" in shown and "3 seed control(s)" in shown and "Trend with depth" in shown
    assert shown.count("| yes |") + shown.count("| no |") == 4 and ev.BAND_RULE in shown
    assert not (tmp_path / "three.png").exists()
    one = lambda x, y, name: np.array(ev.cka(x, y, texts, out=tmp_path / name, **kw)["divergence"])  # noqa: E731
    each = np.array(r["divergence_replicates"])
    for i in range(3):
        assert each[i] == pytest.approx(one(A[i], B[i], f"pair{i}.json"), abs=1e-12)
    controls = np.array(r["controls"]["divergence"])
    assert r["args"]["control_pairs"] == [[str(A[i]), str(C[i])] for i in range(3)]
    for i, row in enumerate(controls):
        assert row == pytest.approx(one(A[i], C[i], f"c{i}.json"), abs=1e-12)
    pairs = 1 - np.array([s["pairs"] for s in r["per_seed"].values()])  # (draws, replicates, layers)
    assert r["divergence_draw_sd"] == pytest.approx(pairs.mean(1).std(0, ddof=1))  # the mean's sd between draws
    for layer in r["layers"]:  # the band's draw term: how the pair's mean log divergence moves between draws
        expected = ev.band(each[:, layer], controls[:, layer], np.log(pairs).mean(1)[:, layer].std(ddof=1), 2)
        assert r["band"]["bound"][layer] == pytest.approx(expected["bound"])
        assert r["band"]["outside"][layer] == expected["outside"]
        mean, low, high = ev.t_interval(each[:, layer] / controls[:, layer])  # each replicate over its own control
        assert (r["ratio"]["mean"][layer], r["ratio"]["low"][layer]) == pytest.approx((mean, low))
        assert (r["divergence_low"][layer], r["divergence_high"][layer]) == pytest.approx(
            ev.t_interval(each[:, layer])[1:])
    for key, rows in (("ratio", each / controls), ("raw", each)):
        slopes = [np.polyfit(np.arange(4), row, 1)[0] for row in rows]
        assert r["trend"][key]["each"] == pytest.approx(slopes)
        assert r["trend"][key]["slope"] == pytest.approx(np.mean(slopes))
    alone = ev.cka(",".join(map(str, A)), B, texts, out=tmp_path / "alone.json", **kw)
    assert alone["args"]["control_pairs"] == [[str(A[0]), str(A[1])]] and alone["band"]["bound"] == [None] * 4
    assert ev.control_pairs(3, 5) == [(0, 6), (1, 7), (2, 8), (9, 10)] and ev.control_pairs(4, 1) == [(0, 8), (1, 2)]
    with pytest.raises(InputError, match="3 replicates of model A but 2 of model B"):
        ev.cka(A, B[:2], texts, out=tmp_path / "x.json", **kw)


def test_trend_reads_depth_only_where_the_ratio_against_own_controls_and_the_raw_divergence_agree():
    """Each replicate's ratio is over its own control, so a control's noise is in its slope; the raw divergence's
    slope is read beside it. Controls that rise with depth make the ratio fall while the raw divergence does not:
    no reading. Both falling: "falls with depth"."""
    falling = np.array([[6.0, 5.0, 4.1, 3.0], [5.8, 5.1, 3.9, 3.2], [6.1, 4.9, 4.0, 2.9]])
    flat_controls = np.ones((3, 4))
    t = ev.trend(falling, flat_controls)
    assert t["ratio"]["slope"] == pytest.approx(np.mean([np.polyfit(range(4), r, 1)[0] for r in falling]))
    assert t["ratio"]["high"] < 0 and t["raw"]["verdict"] == "falls with depth" and t["verdict"] == "falls with depth"
    assert ev.trend(falling[:, ::-1], flat_controls)["verdict"] == "rises with depth"
    flat = np.array([[1.0, 1.01, 0.99, 1.0], [1.02, 1.0, 1.0, 0.99], [0.99, 1.0, 1.01, 1.02]])
    rising_controls = np.array([[1.0, 2.0, 3.0, 4.0], [1.1, 1.9, 3.2, 3.9], [0.9, 2.1, 2.9, 4.2]])
    t = ev.trend(flat, rising_controls)
    assert t["ratio"]["verdict"] == "falls with depth" and t["raw"]["verdict"] == "no detectable trend"
    assert t["verdict"].startswith("no reading")
    two = np.array([[1.0, 2.0, 1.0], [2.0, 1.0, 2.0]])
    assert ev.trend(two, np.ones((2, 3)))["verdict"] == "no detectable trend"


def test_cka_checks_its_input(byte_models, texts, tmp_path):
    a, b, _ = byte_models
    with pytest.raises(InputError, match=rf"{texts.name}: 24 texts, fewer than the n=25"):
        ev.cka(a, b, texts, n=25, out=tmp_path / "x.json", device="cpu")
    deeper = make_model(tmp_path / "deeper", 0, num_hidden_layers=5, **BYTE_IDS)
    with pytest.raises(InputError, match="different numbers of layers"):
        ev.cka(a, deeper, texts, n=5, out=tmp_path / "x.json", device="cpu")
    (tmp_path / "bare").mkdir()
    tiny_model().save_pretrained(tmp_path / "bare")
    with pytest.raises(InputError, match="bare: no tokenizer.json .* pass --tokenizer"):
        ev.cka(a, tmp_path / "bare", texts, n=5, out=tmp_path / "x.json", device="cpu")
    # a folder of the older layout, whose top-level state.json records the tokenizer, still loads
    (tmp_path / "bare" / "state.json").write_text(json.dumps({"tokenizer": "bytes"}))
    assert ev.cka(a, tmp_path / "bare", texts, n=5, out=tmp_path / "x.json", device="cpu")["layers"] == [0, 1, 2, 3]
    same = write(tmp_path / "same.jsonl", '{"text": "the cell"}\n' * 6)  # CKA of identical texts is undefined
    with pytest.raises(InputError, match="1 distinct texts, n=4; CKA needs at least 3"):
        ev.cka(a, b, same, n=4, out=tmp_path / "x.json", device="cpu")
    rows = np.random.default_rng(0).normal(size=(5, 3))  # features equal for every text: undefined, not 1
    assert math.isnan(ev.linear_cka(np.ones((5, 3)) + 1e-17 * rows, rows))
    assert not (tmp_path / "x.json").exists() or "NaN" not in (tmp_path / "x.json").read_text()


def test_cka_markdown_and_figure_state_one_band_rule(tmp_path, monkeypatch):
    """The table says yes exactly where the figure draws a star, the rule is written in both, the bound is drawn
    and in the legend; the axes are labelled and start at 0."""
    pytest.importorskip("matplotlib")
    from machinery import report
    from matplotlib.figure import Figure
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: drawn.append(fig) or open(path, "wb").close())
    controls = np.array([[0.010, 0.020, 0.5, 0.03], [0.012, 0.010, 0.4, 0.05], [0.011, 0.015, 0.45, 0.04]])
    each = np.array([[0.011, 0.300, 0.9, 0.04], [0.012, 0.310, 0.95, 0.05]])  # inside, outside, outside, inside
    r = {"names": ["MLM", "CLM"], "layers": [0, 1, 2, 3], "replicates": 2, "draws": 3,
         "divergence": each.mean(0).tolist(), "divergence_replicates": each.tolist(), "per_seed": {},
         "divergence_draw_sd": [0.001] * 4, "args": {"n": 10}}
    spread = [ev.t_interval(each[:, i]) for i in range(4)]
    r["divergence_low"], r["divergence_high"] = [s[1] for s in spread], [s[2] for s in spread]
    bands = [ev.band(each[:, i], controls[:, i], 0.001, 3) for i in range(4)]
    ratios = [ev.t_interval(each[:, i] / controls[:2, i]) for i in range(4)]
    r["controls"] = {"divergence": controls.tolist(), "k": 3, "mean": [b["mean"] for b in bands],
                     "sd": [b["sd"] for b in bands]}
    r["band"] = {"bound": [b["bound"] for b in bands], "outside": [b["outside"] for b in bands], "rule": ev.BAND_RULE,
                 "level": [b["level"] for b in bands]}
    r["ratio"] = {k: [x[i] for x in ratios] for i, k in enumerate(("mean", "low", "high"))}
    r["ratio"]["replicates"] = 2
    assert r["band"]["outside"] == [False, True, True, False]
    text = report.cka_markdown(r)
    rows = [line for line in text.splitlines() if re.match(r"\| \d", line)]
    assert [" | yes | " in row for row in rows] == [False, True, True, False] and ev.BAND_RULE in text
    report.plot_cka(r, tmp_path / "cka.png")
    fig, = drawn
    left, right = fig.axes
    for ax in (left, right):
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert any("bound" in t for t in legend) and ax.get_xlabel().startswith("layer")
        assert ax.get_ylim()[0] == 0  # no axis that starts above zero
    stars = [line for line in left.get_lines() if line.get_marker() == "*"]
    assert len(stars) == 1 and list(stars[0].get_xdata()) == [1, 2]
    assert "outside the band (2 of 4 layers)" in [t.get_text() for t in left.get_legend().get_texts()]
    assert left.get_ylabel() == "1 - linear CKA" and "ratio" in right.get_title()
    assert any("measured error rate" in t.get_text() and "1 - CKA: 0 =" in t.get_text() for t in fig.texts)


@pytest.mark.slow  # two processes that import torch; test_cka_command checks the function this command runs
def test_cka_cli(byte_models, texts, tmp_path):
    a, b, c = byte_models
    out = tmp_path / "cli" / "cka.json"
    run = subprocess.run([sys.executable, str(ROOT / "eval.py"), "cka", str(a), str(b), f"--control={c}",
                          f"--texts={texts}", "--n=8", "--seeds=1", "--max_len=32", f"--out={out}", "--device=cpu"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "ratio" in run.stdout and out.is_file() and out.with_suffix(".png").is_file()
    assert len(json.loads(out.read_text())["ratio"]["mean"]) == 4
    one = subprocess.run([sys.executable, str(ROOT / "eval.py"), "cka", str(a), str(b), f"--texts={texts}", "--n=1"],
                         capture_output=True, text=True, cwd=tmp_path)
    assert one.returncode == 2 and "expected at least 3 (CKA of 2 texts is 1 whatever the models), got 1" in one.stderr



# ----------------------------------------------------------------------------
# Metrics against their oracles


def test_label_f1_matches_sklearn():
    from sklearn.metrics import f1_score
    rng = np.random.default_rng(0)
    for _ in range(20):  # "e" is never predicted, "f" never true
        true = list(rng.choice(list("abcde"), size=30, p=[0.4, 0.3, 0.15, 0.1, 0.05]))
        pred = list(rng.choice(list("abcf"), size=30))
        got = metrics.label_f1(true, pred)
        for average in ("macro", "micro"):
            assert got[f"{average}_f1"] == pytest.approx(f1_score(true, pred, average=average, zero_division=0),
                                                         abs=1e-12)


def test_multilabel_f1_matches_sklearn():
    from sklearn.metrics import f1_score
    rng = np.random.default_rng(1)
    for _ in range(20):
        true, pred = rng.random((30, 6)) < 0.3, rng.random((30, 6)) < 0.3
        true[:, 5] = pred[:, 5] = False  # a label nobody has or predicts: 0 for that column (zero_division=0)
        pred[:, 4] = False  # a label never predicted
        true[:3] = False  # examples with an empty label list
        got = metrics.f1_scores(true, pred)
        for average in ("macro", "micro"):
            assert got[f"{average}_f1"] == pytest.approx(f1_score(true, pred, average=average, zero_division=0),
                                                         abs=1e-12)


def test_entities_and_entity_f1_match_seqeval():
    from seqeval.metrics import f1_score
    from seqeval.metrics.sequence_labeling import get_entities
    # ill-formed on purpose: I- after O, a type switch inside an entity, B- then I- of another type
    tricky = ["I-X", "I-X", "O", "B-X", "I-Y", "I-Y", "B-Y", "B-Y", "I-X", "O", "I-Y"]
    assert metrics.entities(tricky) == get_entities(tricky)
    rng = np.random.default_rng(2)
    tags = ["O", "O", "O", "B-X", "I-X", "B-Y", "I-Y"]
    for _ in range(30):
        lengths = rng.integers(1, 12, size=15)
        true = [list(rng.choice(tags, size=n)) for n in lengths]
        pred = [list(rng.choice(tags, size=n)) for n in lengths]
        for sentence in true:
            assert metrics.entities(sentence) == get_entities(sentence)
        assert metrics.entity_f1(true, pred) == pytest.approx(f1_score(true, pred), abs=1e-12)
    assert metrics.entity_f1([["O", "O"]], [["O", "O"]]) == 0.0  # no entities anywhere: seqeval says 0 too


def test_strict_iob2_entities_match_seqeval_strict_mode():
    from seqeval.metrics import f1_score
    from seqeval.scheme import IOB2
    rng = np.random.default_rng(4)
    tags = ["O", "O", "B-X", "I-X", "B-Y", "I-Y"]
    for _ in range(30):
        lengths = rng.integers(1, 12, size=15)
        true = [list(rng.choice(tags, size=n)) for n in lengths]
        pred = [list(rng.choice(tags, size=n)) for n in lengths]
        want = f1_score(true, pred, mode="strict", scheme=IOB2)
        assert metrics.entity_f1(true, pred, strict=True) == pytest.approx(want, abs=1e-12)
        assert ev.NER_MODES["strict"].score(true, pred, None)["entity_f1"] == pytest.approx(want, abs=1e-12)
    assert metrics.entities(["I-X", "I-X", "O", "B-X", "I-X"], strict=True) == [("X", 3, 4)]  # the I-s start nothing


def test_every_kind_scores_as_its_oracles(tmp_path):
    """F1 and accuracy of each kind through its counts: scikit-learn on the labels (flattened words for token
    tasks; subset accuracy for multi-label), seqeval on the entities."""
    from seqeval.metrics import f1_score as entity_f1
    from sklearn.metrics import accuracy_score, f1_score
    rng = np.random.default_rng(5)
    tags = ["O", "O", "B-X", "I-X", "B-Y"]
    gold = [list(rng.choice(tags, size=n)) for n in rng.integers(1, 10, 20)]
    pred = [list(rng.choice(tags[:4], size=len(g))) for g in gold]
    got, flat = ev.KINDS["token"].score(gold, pred, None), (sum(gold, []), sum(pred, []))
    assert got["entity_f1"] == pytest.approx(entity_f1(gold, pred), abs=1e-12)
    assert got["accuracy"] == pytest.approx(accuracy_score(*flat), abs=1e-12)
    for average in ("macro", "micro"):
        assert got[f"{average}_f1"] == pytest.approx(f1_score(*flat, average=average, zero_division=0), abs=1e-12)
    true, guess = list(rng.choice(list("abcd"), 50)), list(rng.choice(list("abce"), 50))
    got = ev.KINDS["single"].score(true, guess, None)
    assert got["accuracy"] == pytest.approx(accuracy_score(true, guess))
    assert got["macro_f1"] == pytest.approx(f1_score(true, guess, average="macro", zero_division=0))
    labels = ["x", "y", "z", "w"]  # "w": a column nobody has or predicts
    sets = [[sorted({x for x in "xyz" if rng.random() < 0.4}) for _ in range(40)] for _ in range(2)]
    got = ev.KINDS["multi"].score(sets[0], sets[1], labels)
    indicator = [[[x in s for x in labels] for s in part] for part in sets]
    assert got["accuracy"] == pytest.approx(accuracy_score(*map(np.array, indicator)))
    assert got["macro_f1"] == pytest.approx(f1_score(*map(np.array, indicator), average="macro", zero_division=0))
    # chance (the informative rule's): the same labels dealt at random; token tags keep each sentence's length
    dealt = ev.KINDS["token"].permute(pred, np.random.default_rng(0))
    assert [len(p) for p in dealt] == [len(p) for p in pred] and sorted(sum(dealt, [])) == sorted(sum(pred, []))
    assert dealt != pred and sorted(ev.KINDS["single"].permute(guess, np.random.default_rng(0))) == sorted(guess)
    assert ev.KINDS["token"].fill("O", gold) == [["O"] * len(g) for g in gold]


# ----------------------------------------------------------------------------
# Task encoding


def test_token_encoding_labels_first_subtokens_and_truncates_whole_words():
    tok = load_tokenizer("bytes")
    token, labels = ev.TokenClassification(), ["B-D", "I-D", "O"]
    example = {"words": ["ab", "c", "de"], "label": ["B-D", "I-D", "O"]}
    (ids, target), = token.encode(labels, [example], tok, max_len=512)
    assert ids == [256, 97, 98, 32, 99, 32, 100, 101, 257]  # " " + word after the first: the space is in the token
    assert target == [-100, 0, -100, 1, -100, 2, -100, -100, -100]
    (ids, target), = token.encode(labels, [example], tok, max_len=6)  # [CLS] a b ␠ c [SEP]: " de" does not fit
    assert ids == [256, 97, 98, 32, 99, 257] and target == [-100, 0, -100, 1, -100, -100]
    (ids, target), = token.encode(labels, [example], tok, max_len=5)  # no half words: " c" goes too
    assert ids == [256, 97, 98, 257] and target == [-100, 0, -100, -100]


def test_fit_pair_cuts_the_longer_first():
    for la in range(0, 12):
        for lb in range(0, 12):
            for budget in range(0, 14):
                a, b = list(range(la)), list(range(lb))
                while len(a) + len(b) > budget:  # the definition, one token at a time
                    (a if len(a) > len(b) else b).pop()
                assert ev.fit_pair(list(range(la)), list(range(lb)), budget) == (a, b)


def test_sequence_encoding_holds_max_len_tokens_with_its_special_tokens():
    tok, single = load_tokenizer("bytes"), ev.KINDS["single"]
    examples = [{"text": "abcdefghij", "text_pair": None, "label": "x"},
                {"text": "abcdefghij", "text_pair": "klm", "label": "y"}]
    (ids, target), (pair, pair_target) = single.encode(["x", "y"], examples, tok, max_len=8)
    assert ids == [256, *b"abcdef", 257] and target == 0  # [CLS] text [SEP]: 8 tokens
    assert pair == [256, *b"abc", 257, *b"kl", 257] and pair_target == 1  # fit_pair's cut, two [SEP]s


def test_each_word_is_read_at_its_first_subtoken_and_a_label_where_its_probability_passes_one_half():
    """A word whose tag train lacks (UNSEEN) is still a word: its prediction keeps its place; words cut by max_len
    are "O". Multi-label: a label is predicted where its sigmoid is above 0.5 (torch's)."""
    logits = torch.tensor([[9.0, 0, 0], [0, 9, 0], [9, 0, 0], [0, 0, 9], [0, 9, 0], [9, 0, 0]])  # (T, C)
    target = torch.tensor([-100, 0, -100, ev.UNSEEN, 2, -100])  # [CLS], word 1 (2 pieces), word 2, word 3, [SEP]
    example = {"words": ["w1", "w2", "w3", "cut"]}
    assert ev.KINDS["token"].decode(logits, target, example, ["B-D", "I-D", "O"]) == ["I-D", "O", "I-D", "O"]
    z, labels = torch.tensor([0.3, -0.2, 0.0, 2.0, 0.45]), ["a", "b", "c", "d", "e"]
    want = [label for label, p in zip(labels, torch.sigmoid(z)) if p > 0.5]
    assert ev.KINDS["multi"].decode(z, None, None, labels) == want == ["a", "d", "e"]


# ----------------------------------------------------------------------------
# Fine-tuning


@pytest.fixture(scope="module")
def modernbert_model(tmp_path_factory):
    """A random tiny model with ModernBERT's vocabulary and special ids."""
    tokenizer = need(MODERNBERT_TOKENIZER)
    return make_model(tmp_path_factory.mktemp("mb") / "tiny", 0, tokenizer=tokenizer)


def test_finetune_ner_beats_the_majority_baseline(modernbert_model, tmp_path):
    task = need(TASKS / "ncbi_disease" / "train.tsv").parent
    out = tmp_path / "ner.json"
    results = ev.finetune(modernbert_model, [task], seeds=(42,), out=out, epochs=2, lr=1e-3, max_len=64,
                          train_subset=256, dev_subset=100, test_subset=100, device="cpu")
    r = json.loads(out.read_text())["tasks"]["ncbi_disease"]
    assert r == json.loads(json.dumps(results["tasks"]["ncbi_disease"]))
    assert r["kind"] == "token" and r["primary"] == "entity_f1" and r["labels"] == ["B-Disease", "I-Disease", "O"]
    assert r["baseline"]["test"]["entity_f1"] == 0.0  # all "O"
    assert r["mean"]["entity_f1"] > 0.1  # 0.26-0.32 seen over three model inits and two run seeds
    run = r["seeds"]["42"]
    assert set(run) == {"dev", "test", "best_step", "steps", "seconds", "predictions"}
    assert run["steps"] == 32 and run["best_step"] in (16, 32)  # 256 examples: 16 steps an epoch, dev after each
    assert (out.parent / run["predictions"]).is_file() and r["ner_mode"] == "default"
    assert set(r["std"]) == {"entity_f1", "macro_f1", "micro_f1", "accuracy"} and set(r["baseline"]) == {"dev", "test"}


def test_finetune_sequence_tasks(modernbert_model, tmp_path, capsys):
    tasks = [need(TASKS / name / "train.jsonl").parent for name in ("chemprot", "pubmedqa")]
    out = tmp_path / "seq.json"
    r = ev.finetune(modernbert_model, tasks, seeds=(42, 43), out=out, epochs=1, max_len=96, train_subset=32,
                    dev_subset=32, test_subset=32, batch_size=16, device="cpu")["tasks"]
    assert len(r["chemprot"]["labels"]) == 13 and r["pubmedqa"]["labels"] == ["maybe", "no", "yes"]
    for name in ("chemprot", "pubmedqa"):
        assert r[name]["kind"] == "single" and r[name]["primary"] == "macro_f1"
        assert set(r[name]["seeds"]) == {"42", "43"} and r[name]["baseline"]["test"]["macro_f1"] > 0
        for metric in ("macro_f1", "micro_f1"):
            values = [s["test"][metric] for s in r[name]["seeds"].values()]
            assert r[name]["mean"][metric] == pytest.approx(np.mean(values))
            assert r[name]["std"][metric] == pytest.approx(np.std(values, ddof=1))
    copy = tmp_path / "again.json"
    copy.write_text(out.read_text())
    text = compare.table([out, copy], ev.kind_of)
    assert "**chemprot** (macro_f1" in text and "**pubmedqa** (macro_f1" in text
    assert text.count("| +0.00 [+0.00, +0.00] |") == 2  # the same predictions: no difference at all
    assert "One pretraining run per arm" in text


def multilabel_task(root):
    """Labels are the animals a text names (possibly none): learnable from bytes in a few steps."""
    rng = np.random.default_rng(0)
    names, filler = ["cat", "dog", "owl"], ["we", "saw", "a", "the", "here", "today"]
    root.mkdir(parents=True)
    for split, n in (("train", 96), ("dev", 32), ("test", 32)):
        rows = []
        for _ in range(n):
            labels = sorted({x for x in names if rng.random() < 0.35})
            words = list(rng.choice(filler, size=4)) + labels
            rows.append({"text": " ".join(rng.permutation(words)), "label": labels})
        (root / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def test_finetune_multilabel(byte_models, tmp_path):
    task = multilabel_task(tmp_path / "animals")
    r = ev.finetune(byte_models[0], [task], seeds=(42,), out=tmp_path / "ml.json", epochs=6, lr=2e-3, max_len=64,
                    pooling="mean", device="cpu")["tasks"]["animals"]
    assert r["kind"] == "multi" and r["labels"] == ["cat", "dog", "owl"]
    assert r["baseline"]["test"]["micro_f1"] == 0.0  # no animal is named in more than half of the texts
    assert r["mean"]["micro_f1"] > 0.6


@pytest.mark.parametrize("pooling", ["cls", "mean", None])  # None: a token task
def test_the_classifier_is_transformers_classification_model(tmp_path, pooling):
    """Classifier on a saved model gives the logits of transformers' ModernBertForSequenceClassification ([CLS] or
    the mean over real tokens) or ModernBertForTokenClassification loaded from the same folder, with the same
    linear layer: encoder, the pretrained head transform, classifier; on a padded batch."""
    transformers = pytest.importorskip("transformers")
    model = tiny_model(0)
    with torch.no_grad():
        model.head.norm.weight.add_(0.5 * torch.randn_like(model.head.norm.weight))  # so that a dropped norm shows
    model.save_pretrained(tmp_path)
    ours = ev.Classifier(ModernBERT.from_pretrained(tmp_path), 5, pooling is None, pooling or "cls").eval()
    hf = (transformers.ModernBertForTokenClassification if pooling is None else
          transformers.ModernBertForSequenceClassification).from_pretrained(
        tmp_path, num_labels=5, classifier_pooling=pooling or "cls", attn_implementation="sdpa").eval()
    hf.classifier.load_state_dict(ours.classifier.state_dict())
    ids = torch.randint(0, 256, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = (torch.arange(20) < torch.tensor([[20], [13], [5]])).long()
    ids[mask == 0] = BYTE_IDS["pad_token_id"]
    with torch.no_grad():
        got, want = ours(ids, mask), hf(input_ids=ids, attention_mask=mask).logits
    real = mask.bool() if pooling is None else slice(None)
    assert got.shape == want.shape and (got - want)[real].abs().max().item() < 1e-4


def test_test_is_scored_once_with_the_weights_of_the_best_dev_point(byte_models, tmp_path, monkeypatch):
    """Dev is scored at each point, test once, with the weights of the point whose dev score was best: here the
    first of two (its score forced), not the last weights."""
    task = multilabel_task(tmp_path / "animals")
    real, weights = ev.evaluate, []

    def evaluate(model, task, split, s):  # each call's weights; every dev score below the one before
        weights.append({k: v.clone() for k, v in model.state_dict().items()})
        scores, preds = real(model, task, split, s)
        return {**scores, "macro_f1": 1 / len(weights)}, preds
    monkeypatch.setattr(ev, "evaluate", evaluate)
    r = ev.finetune(byte_models[0], [task], seeds=(1,), out=tmp_path / "r.json", epochs=2, lr=2e-3, max_len=48,
                    pooling="mean", device="cpu")["tasks"]["animals"]["seeds"]["1"]
    first, last, test = weights  # dev after epochs 1 and 2, then test
    assert (r["best_step"], r["steps"]) == (6, 12) and not all(torch.equal(first[k], last[k]) for k in first)
    assert all(torch.equal(first[k], test[k]) for k in first)


def test_fine_tuning_decays_and_schedules_as_transformers_trainer(byte_models, tmp_path, monkeypatch):
    """AdamW decays (0.01) exactly the parameters transformers' Trainer decays (no biases, no norms), and each
    optimizer step runs at the learning rate of transformers' linear schedule without warmup."""
    transformers = pytest.importorskip("transformers")
    task = multilabel_task(tmp_path / "animals")
    real, made, lrs = ev.optimizer_for, [], []

    def optimizer_for(model, lr):
        optimizer = real(model, lr)
        optimizer.register_step_pre_hook(lambda o, args, kwargs: lrs.append(o.param_groups[0]["lr"]))
        made.append((model, optimizer))
        return optimizer
    monkeypatch.setattr(ev, "optimizer_for", optimizer_for)
    ev.finetune(byte_models[0], [task], seeds=(1,), out=tmp_path / "r.json", epochs=2, lr=1e-3, max_len=48,
                pooling="mean", device="cpu")
    (model, optimizer), = made
    names = {id(p): name for name, p in model.named_parameters()}
    decay = {names[id(p)] for g in optimizer.param_groups if g["weight_decay"] == 0.01 for p in g["params"]}
    assert {g["weight_decay"] for g in optimizer.param_groups} == {0.0, 0.01}
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(names)
    hf = set(transformers.Trainer.get_decay_parameter_names(None, model)) & set(names.values())  # tied: named once
    assert decay == hf
    reference = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
    schedule, want = transformers.get_linear_schedule_with_warmup(reference, 0, 12), []
    for _ in range(12):
        want.append(reference.param_groups[0]["lr"])
        reference.step()
        schedule.step()
    assert lrs == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_finetune_runs_without_dropout_whatever_the_pretraining_used(byte_models, tmp_path, capsys):
    """A checkpoint pretrained with --dropout=0.1 (its config says so) is fine-tuned as the same weights without it:
    the same train losses and predictions, seed for seed, so that arms differ by their pretraining alone."""
    import shutil
    task = multilabel_task(tmp_path / "animals")
    dropped = shutil.copytree(byte_models[0], tmp_path / "dropped")
    config = json.loads((dropped / "config.json").read_text())
    (dropped / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.1}))
    kw = dict(seeds=(1,), epochs=2, lr=2e-3, max_len=48, pooling="mean", device="cpu")
    runs = []
    for model, out in ((byte_models[0], "plain.json"), (dropped, "dropped.json")):
        capsys.readouterr()
        result = ev.finetune(model, [task], out=tmp_path / out, **kw)["tasks"]["animals"]["seeds"]["1"]
        losses = re.findall(r"train loss (\S+),", capsys.readouterr().out)
        runs.append((losses, json.loads((tmp_path / result["predictions"]).read_text())["predictions"]))
    assert runs[0] == runs[1] and len(runs[0][0]) == 2


def test_finetune_writes_each_seed_and_skips_it_on_a_second_call(byte_models, tmp_path, capsys):
    task = multilabel_task(tmp_path / "animals")
    kw = dict(epochs=1, lr=2e-3, max_len=48, pooling="mean", device="cpu")
    first = ev.finetune(byte_models[0], [task], seeds=(1, 2), out=tmp_path / "a.json", **kw)
    files = sorted((tmp_path / "a.seeds").glob("*.json"))
    assert [re.sub(r"-[0-9a-f]{12}\.json", "", f.name) for f in files] == ["animals-seed1", "animals-seed2"]
    saved = json.loads(files[0].read_text())
    test = [json.loads(line) for line in (task / "test.jsonl").read_text().splitlines()]
    rows = saved["predictions"]["test"]
    assert [p["index"] for p in rows] == list(range(32)) and {p["from"] for p in rows} == {"test"}
    assert [p["gold"] for p in rows] == [row["label"] for row in test]
    assert [p["line"] for p in rows] == list(range(1, 33))
    assert all(set(p["pred"]) <= {"cat", "dog", "owl"} for p in rows)
    assert len(saved["predictions"]["dev"]) == 32
    assert {**saved["result"], "predictions": f"a.seeds/{files[0].name}"} == first["tasks"]["animals"]["seeds"]["1"]
    stamps = [f.stat().st_mtime_ns for f in files]
    capsys.readouterr()
    again = ev.finetune(byte_models[0], [task], seeds=(1, 2), out=tmp_path / "a.json", **kw)
    assert capsys.readouterr().out.count("skip") == 2 and [f.stat().st_mtime_ns for f in files] == stamps
    assert again == first
    # another lr, or a changed test file: computed again (a stale score is never reused), the old files kept
    ev.finetune(byte_models[0], [task], seeds=(1,), out=tmp_path / "a.json", **{**kw, "lr": 1e-3})
    assert "skip" not in capsys.readouterr().out and len(list((tmp_path / "a.seeds").glob("*"))) == 3
    lines = (task / "test.jsonl").read_text().splitlines()
    (task / "test.jsonl").write_text("\n".join(lines[1:]) + "\n")  # one test example fewer
    changed = ev.finetune(byte_models[0], [task], seeds=(1, 2), out=tmp_path / "a.json", **kw)
    assert "skip" not in capsys.readouterr().out and len(list((tmp_path / "a.seeds").glob("*"))) == 5
    newest = max((tmp_path / "a.seeds").glob("*"), key=lambda f: f.stat().st_mtime_ns)
    assert len(json.loads(newest.read_text())["predictions"]["test"]) == 31
    assert changed["tasks"]["animals"]["sha256"]["test"] != first["tasks"]["animals"]["sha256"]["test"]
    (task / "test.jsonl").write_text("\n".join(lines) + "\n")  # back as it was: the first files count again
    assert ev.finetune(byte_models[0], [task], seeds=(1, 2), out=tmp_path / "a.json", **kw) == first
    # all the code is in the key: the same code elsewhere reuses a result, an edit to any module of the package (the
    # metrics, the attention kernels: in a copy of the code) never does
    capsys.readouterr()
    for edit in (None, "machinery/metrics.py", "machinery/kernels.py"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(cli, "REPOSITORY", source_copy(tmp_path / f"code-{edit and Path(edit).stem}", edit))
            ev.finetune(byte_models[0], [task], seeds=(1,), out=tmp_path / "a.json", **kw)
        assert ("skip, done in" in capsys.readouterr().out) == (edit is None), edit
    with pytest.MonkeyPatch.context() as mp:  # and the packages: another torch build computes other roundings
        mp.setattr("machinery.tasks.versions", lambda: {**cli.versions(), "torch": "2.11.0+cu130"})
        ev.finetune(byte_models[0], [task], seeds=(1,), out=tmp_path / "a.json", **kw)
    assert "skip, done in" not in capsys.readouterr().out
    ev.finetune(byte_models[0], [task], seeds=(1, 2), out=tmp_path / "a.json", **kw)  # a.json as it was

    # a second model on seeds 2 and 3: compared on the seed both ran
    ev.finetune(byte_models[1], [task], seeds=(2, 3), out=tmp_path / "b.json", **kw)
    b = json.loads((tmp_path / "b.json").read_text())["tasks"]["animals"]
    d = compare.compare({"a": {"-": [tmp_path / "a.json"]}, "b": {"-": [tmp_path / "b.json"]}}, ev.kind_of)
    d = d["tasks"]["animals"]
    expected = b["seeds"]["2"]["test"]["macro_f1"] - first["tasks"]["animals"]["seeds"]["2"]["test"]["macro_f1"]
    assert d["seeds"] == [["2"]] and d["arms"]["b"]["difference"]["mean"] == pytest.approx(expected)


def test_a_step_budget_sets_the_steps_and_the_dev_points():
    s = ev.Settings(epochs=None, steps=None, evals=None, lr=1e-3, max_len=32, batch_size=16, pooling="cls",
                    pad_id=0, device=torch.device("cpu"))
    token, single = ev.KINDS["token"], ev.KINDS["single"]
    assert ev.budget(token, 100, s) == (140, [7 * k for k in range(1, 21)])  # 20 epochs of 7 steps
    assert ev.budget(single, 100, dataclasses.replace(s, steps=50)) == (50, [12, 25, 38, 50])  # 4 evals
    capped = dataclasses.replace(s, steps=500, epochs=3, evals=2)  # 500 steps, at most 3 passes over train
    assert ev.budget(single, 100, capped) == (21, [10, 21])
    assert ev.budget(single, 10_000, capped)[0] == 500


def test_length_grouped_batches_read_every_example_once_with_little_padding():
    lengths = list(np.random.default_rng(0).integers(5, 200, 1000))
    g = torch.Generator().manual_seed(0)
    batches = ev.length_grouped(lengths, 16, g)
    assert sorted(i for b in batches for i in b) == list(range(1000)) and max(map(len, batches)) == 16
    padded = sum(len(b) * max(lengths[i] for i in b) for b in batches)
    shuffled = torch.randperm(1000, generator=g).split(16)
    random = sum(len(b) * max(lengths[i] for i in b.tolist()) for b in shuffled)
    assert padded < 0.6 * random and padded < 1.1 * sum(lengths)
    longest = [max(lengths[i] for i in b) for b in batches]  # 63 batches, one run of 64: sorted, then shuffled
    assert longest != sorted(longest) and longest != sorted(longest, reverse=True)
    assert batches != ev.length_grouped(lengths, 16, g)  # another epoch, another order


def test_a_small_dev_set_takes_examples_from_train(byte_models, tmp_path, capsys):
    """--dev_min tops a small dev set up from train (a fixed draw, never trained on, said in the results); a
    carve-out that would empty train is one clear error before any training."""
    task = multilabel_task(tmp_path / "animals")  # 96 / 32 / 32
    r = ev.finetune(byte_models[0], [task], seeds=(1,), out=tmp_path / "c.json", epochs=1, max_len=48,
                    dev_min=50, device="cpu")["tasks"]["animals"]
    assert r["dev_split"] == {"own": 32, "carved_from_train": 18, "dev_min": 50}
    assert r["examples"] == {"train": 78, "dev": 50, "test": 32} and "18 moved from train" in capsys.readouterr().out
    saved = json.loads((tmp_path / r["seeds"]["1"]["predictions"]).read_text())["predictions"]["dev"]
    assert [row["from"] for row in saved].count("train") == 18
    train, dev, _ = ev.carve_dev(read_task(task), 50)
    assert not {(ex["text"], ex["line"]) for ex in train} & {(ex["text"], ex["line"]) for ex in dev if "from" in ex}
    assert ev.carve_dev(read_task(task), 50)[1] == dev  # the same draw every time
    with pytest.raises(InputError, match=r"animals: --dev_min=200 would move 168 examples from train to dev, but "
                                         r"train holds 96"):
        ev.finetune(byte_models[0], [task], out=tmp_path / "x.json", dev_min=200, device="cpu")
    assert not (tmp_path / "x.seeds").exists()


def test_the_majority_baseline_counts_the_train_split_the_model_trained_on(byte_models, tmp_path):
    """Where --dev_min moves train examples to dev, the majority label is counted on what is left of train (what the
    model was fine-tuned on), not on the task's whole train file: here the two disagree."""
    from sklearn.metrics import accuracy_score
    root = tmp_path / "pets"
    root.mkdir()
    write = lambda split, labels: (root / f"{split}.jsonl").write_text(  # noqa: E731
        "".join(json.dumps({"text": f"a {label} here", "label": label}) + "\n" for label in labels))
    write("dev", ["cat", "dog"])
    write("test", ["cat", "dog", "dog", "owl"])
    write("train", ["cat"] * 11 + ["dog"])
    moved = {ex["index"] for ex in ev.carve_dev(read_task(root), 9)[1] if "from" in ex}  # 7 of the 12, a fixed draw
    stay = sorted(set(range(12)) - moved)
    labels = ["cat" if i in moved or i in stay[:2] else "dog" for i in range(12)]  # 9 cat, 3 dog; kept: 3 dog, 2 cat
    write("train", labels)
    train, _, _ = ev.carve_dev(read_task(root), 9)
    kept = [ex["label"] for ex in train]
    assert (labels.count("cat"), kept.count("dog"), kept.count("cat")) == (9, 3, 2)
    r = ev.finetune(byte_models[0], [root], seeds=(1,), out=tmp_path / "p.json", steps=1, max_len=16, dev_min=9,
                    device="cpu")["tasks"]["pets"]
    assert r["majority"] == "dog"  # was "cat": the whole train file's
    assert r["baseline"]["test"]["accuracy"] == accuracy_score(["cat", "dog", "dog", "owl"], ["dog"] * 4) == 0.5


@pytest.mark.slow
def test_finetune_ner_longer_run(modernbert_model, tmp_path):
    task = need(TASKS / "ncbi_disease" / "train.tsv").parent
    r = ev.finetune(modernbert_model, [task], seeds=(42,), out=tmp_path / "ner.json", epochs=3, lr=1e-3,
                    max_len=128, train_subset=1000, dev_subset=300, test_subset=300, device="cpu")
    r = r["tasks"]["ncbi_disease"]
    assert r["mean"]["entity_f1"] > 0.3  # 0.38-0.40 seen with seeds 42 and 43


# ----------------------------------------------------------------------------
# Bad input: named file and line, before any training


def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_bad_task_input_is_named(tmp_path, capsys):
    good = '{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n'
    for split in ("train", "dev"):
        write(tmp_path / "nosplit" / f"{split}.jsonl", good)
    with pytest.raises(InputError, match=r"nosplit: missing test.jsonl"):
        read_task(tmp_path / "nosplit")

    for split in ("train", "dev", "test"):
        extra = '{"text": "c", "label": "z"}\n' if split == "test" else ""
        write(tmp_path / "unseen" / f"{split}.jsonl", good + extra)
    # a label only in test: a warning naming label, file and line; scored, never predicted
    task = read_task(tmp_path / "unseen")
    assert re.search(r"warning: label 'z' occurs in .*unseen/test.jsonl:3 but not in .*train.jsonl",
                     capsys.readouterr().err)
    assert task["labels"] == ["x", "y"] and task["scored"] == ["x", "y", "z"]

    for split in ("train", "dev", "test"):
        write(tmp_path / "badjson" / f"{split}.jsonl", good + ('{"text": "c", "label":\n' if split == "dev" else ""))
    with pytest.raises(InputError, match=r"badjson/dev.jsonl:3: not valid JSON"):
        read_task(tmp_path / "badjson")
    write(tmp_path / "badjson" / "dev.jsonl", good + '{"text": "c"}\n')
    with pytest.raises(InputError, match=r"badjson/dev.jsonl:3: expected an object with 'text'"):
        read_task(tmp_path / "badjson")

    sentences = "Aspirin\tO\ncures\tO\npain\tB-D\n\nOK\tO\n"
    for split in ("train", "dev", "test"):
        write(tmp_path / "tsv" / f"{split}.tsv", sentences)
    write(tmp_path / "tsv" / "dev.tsv", sentences + "\nfever\tB-Sym\n")
    assert read_task(tmp_path / "tsv")["scored"] == ["B-D", "O", "B-Sym"]
    assert re.search(r"warning: label 'B-Sym' occurs in .*tsv/dev.tsv:7 but not in .*train.tsv",
                     capsys.readouterr().err)
    write(tmp_path / "tsv" / "dev.tsv", sentences.replace("cures\tO", "cures O"))
    with pytest.raises(InputError, match=r"tsv/dev.tsv:2: expected token<TAB>tag"):
        read_task(tmp_path / "tsv")


def test_finetune_checks_every_task_before_loading_or_training(tmp_path, capsys):
    task = multilabel_task(tmp_path / "ok")
    write(tmp_path / "bad" / "train.tsv", "a\tO\n")
    with pytest.raises(InputError, match="bad: missing dev.tsv"):  # not the missing model: tasks are read first
        ev.finetune(tmp_path / "no-such-model", [task, tmp_path / "bad"], out=tmp_path / "r.json", device="cpu")
    with pytest.raises(SystemExit) as exit:
        run(ev.main, ["finetune", str(tmp_path / "no-such-model"), f"--task={tmp_path / 'bad'}", "--device=cpu"])
    assert exit.value.code == 2 and "error: " in capsys.readouterr().err and not (tmp_path / "r.json").exists()


# ----------------------------------------------------------------------------
# MLM quality


def test_mlm_reports_trains_validation_losses(byte_models, texts, tmp_path, capsys):
    """`eval.py mlm` is train.py's validation: the model's own MLM loss on the 15%-masked windows, and its
    causal loss, on the same val.bin windows."""
    data_dir = tmp_path / "data"
    prepare([texts], "bytes", data_dir, val_fraction=0.5)
    r = ev.mlm(byte_models[0], data_dir, n_sequences=4, seq_len=32, batch_size=4, device="cpu")
    model = ModernBERT.from_pretrained(byte_models[0]).eval()
    expected = {}
    for objective, rate in (("mlm", 0.15), ("clm", 0.0)):
        (x, y), = list(val_batches(data_dir, 32, 4, 4, objective, mask_rate=rate))
        with torch.no_grad():
            expected[f"val_{objective}"] = model(x, labels=y, causal=objective == "clm")[1].item()
    assert r == pytest.approx(expected, rel=1e-5)
    assert abs(r["val_mlm"] - math.log(320)) < 1.0  # a random model guesses near uniformly
    shown = capsys.readouterr().out
    assert f"validation MLM loss {r['val_mlm']:.4f} (15% masked), CLM loss {r['val_clm']:.4f}" in shown
    assert "val.bin (4 windows of 32)" in shown


def test_mlm_refuses_more_windows_than_val_bin_holds(byte_models, texts, tmp_path, capsys, monkeypatch):
    """Asked for more windows than val.bin holds, `eval.py mlm` says so before it loads any weight, instead
    of a loss over fewer windows printed as the number asked for."""
    data_dir = tmp_path / "data"
    prepare([texts], "bytes", data_dir, val_fraction=0.5)
    held = count_windows(data_dir, "val", 32)
    monkeypatch.setattr(ev, "load_weights", lambda *a: pytest.fail("loaded the weights before counting windows"))
    with pytest.raises(SystemExit) as exit:
        run(ev.main, ["mlm", str(byte_models[0]), f"--data={data_dir}", "--seq_len=32",
                      f"--n_sequences={held + 1}", "--device=cpu"])
    assert exit.value.code == 2
    assert (f"error: {data_dir}/val.bin holds {held} windows of 32 tokens; --n_sequences={held + 1} asks for more"
            in capsys.readouterr().err)


def test_a_bounded_quantity_keeps_its_interval_and_axis_in_its_range(tmp_path, monkeypatch):
    """1 - CKA lies in [0, 1]: with 2 replicates far apart, t's interval of their mean (here about [-4, 4.7]) is
    clipped to [0, 1], the ratio's at 0, and the band's bound (here above 7 from controls far apart) at 1; the table
    and the figure say so, and the figure's axis holds no more than its data (never up to 4)."""
    pytest.importorskip("matplotlib")
    from machinery import report
    from matplotlib.figure import Figure
    cka = {"pairs": [[0.99, 0.20], [0.30, 0.95]], "controls": [[0.90, 0.60], [0.10, 0.95], [0.50, 0.50]]}
    r = ev.cka_summary({42: cka, 43: cka})
    assert ev.t_interval([0.01, 0.70])[1] < -3 and ev.t_interval([0.80, 0.05])[2] > 4  # what t gives unclipped
    assert (r["divergence_low"], r["divergence_high"]) == ([0.0, 0.0], [1.0, 1.0])
    assert r["ratio"]["low"] == [0.0, 0.0] and all(x > 1 for x in r["ratio"]["high"])
    assert ev.band([0.01, 0.7], [0.1, 0.9, 0.5])["bound"] > 1.5 and r["band"]["bound"] == [1.0, 1.0]
    r.update(names=["MLM", "CLM"], args={"n": 10})
    assert "95% t interval over replicates, clipped to [0, 1]" in report.cka_markdown(r)
    drawn = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, path, **kw: drawn.append(fig) or open(path, "wb").close())
    report.plot_cka(r, tmp_path / "cka.png")
    left = drawn[0].axes[0]
    assert left.get_ylim()[0] == 0 and left.get_ylim()[1] <= 1.1
    assert any("clipped to [0, 1]" in t.get_text() for t in left.get_legend().get_texts())
