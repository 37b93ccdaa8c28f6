"""eval.py needle: a model told the answer scores every example and none without the needle, the examples' lengths,
positions and seeds, the haystack's texts changing nothing else, the Wilson interval against scipy, bad input
refused before any model is loaded, and the command line."""
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import BYTE_IDS, ROOT, made_up_texts, tiny_model

from machinery import needle as nd
from machinery.compare import interval
from model import ModernBERT
from machinery.cli import InputError
from machinery.tokenizer import load_tokenizer

TOK = load_tokenizer("bytes")
PREFIX = TOK.encode(nd.NEEDLE[0])


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """Made-up held-out texts, about 3,000 byte tokens in all."""
    return made_up_texts(tmp_path_factory.mktemp("texts") / "texts.jsonl", 30, 5, 30)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Two tiny model folders (byte tokenizer, 160 positions): an arm's two replicates."""
    root = tmp_path_factory.mktemp("models")
    for seed in (1, 2):
        tiny_model(seed, max_position_embeddings=160).save_pretrained(root / f"m{seed}")
        TOK.save_pretrained(root / f"m{seed}")
    return [root / "m1", root / "m2"]


def pool(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


class Told(torch.nn.Module):
    """A model told the answer the way a reader finds it: at the k-th [MASK], the k-th token after the needle's
    prefix where it appears unmasked earlier in the sequence; [MASK] itself where there is no needle."""

    def encode(self, ids, attention_mask=None):
        out = ids.clone()  # (B, T): a position's "hidden state" is the id it predicts
        P = len(PREFIX)
        for b, row in enumerate(ids.tolist()):
            needle = [t + P for t in range(len(row) - P) if row[t:t + P] == PREFIX and row[t + P] != TOK.mask_id]
            for k, t in enumerate(t for t, x in enumerate(row) if x == TOK.mask_id):
                out[b, t] = row[needle[0] + k] if needle else TOK.mask_id
        return out[..., None].float()  # (B, T, 1)

    def predict(self, h):
        return F.one_hot(h[..., 0].long(), BYTE_IDS["vocab_size"]).float()  # (M, vocab)


class HalfTold(Told):
    """Told, but wrong at the value's last token: no example filled whole, most of each value's tokens filled."""

    def encode(self, ids, attention_mask=None):
        out = super().encode(ids)
        for b, row in enumerate(ids.tolist()):
            out[b, max(t for t, x in enumerate(row) if x == TOK.mask_id)] = TOK.mask_id
        return out


def test_a_model_told_the_answer_scores_every_example_and_none_without_the_needle(models, texts, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setattr(nd, "load_weights", lambda info, device: Told())
    r = nd.needle([",".join(map(str, models))], texts, ModernBERT, names=["told"], lengths=(64, 160),
                  depths=(0, 50, 100), n=6, out=tmp_path / "told.json", device="cpu")
    arm = r["arms"]["told"]
    assert r["columns"] == ["0", "50", "100", "no needle", "next to the query"] and len(arm["replicates"]) == 2
    for length in ("64", "160"):
        for column in r["columns"]:
            expected = 0.0 if column == "no needle" else 1.0
            for cell in [arm["mean"][length][column], *(rep["cells"][length][column] for rep in arm["replicates"])]:
                assert (cell["exact"], cell["token"]) == (expected, expected), (length, column)
        cell = arm["replicates"][0]["cells"][length]["0"]
        assert (cell["exact_low"], cell["exact_high"]) == pytest.approx(nd.wilson(6, 6))
        assert 0.5 < cell["exact_low"] < cell["exact_high"] == 1  # 6 of 6: the interval is not empty at the edge
    assert json.loads((tmp_path / "told.json").read_text())["arms"]["told"]["mean"] == arm["mean"]


def test_an_arm_is_its_replicates_mean_in_the_json_the_printed_tables_and_the_heat_map(models, texts, tmp_path,
                                                                                      monkeypatch, capsys):
    """Two replicates that differ (one fills every value, one all but each value's last token): the arm's cell is
    the mean of both, and the tables print its exact match and token accuracy (%, 95% interval), the heat map
    its exact match."""
    from machinery import report
    monkeypatch.setattr(nd, "load_weights", lambda info, device: Told() if info["path"] == str(models[0])
                        else HalfTold())
    figures = []
    monkeypatch.setattr(report, "save", lambda fig, path: figures.append(fig))
    r = nd.needle([f"{models[0]},{models[1]}"], texts, ModernBERT, names=["arm"], lengths=(64, 96), depths=(0, 100),
                  n=4, out=tmp_path / "arm.json", device="cpu")
    mean, replicates = r["arms"]["arm"]["mean"], r["arms"]["arm"]["replicates"]
    for length, row in mean.items():
        for column, cell in row.items():
            assert cell == nd.replicates_cell([rep["cells"][length][column] for rep in replicates])
            if column != "no needle":
                assert cell["exact"] == 0.5 and 0.5 < cell["token"] < 1, (length, column)
    printed = capsys.readouterr().out
    for key, title in (("exact", "exact match of the whole value"), ("token", "token accuracy")):
        rows = printed.split(f"**{title}**")[1].strip().split("\n\n")[0].splitlines()[2:]
        assert len(rows) == 2
        for line, length in zip(rows, ("64", "96")):
            cells = [mean[length][c] for c in r["columns"]]
            assert [c.strip() for c in line.strip("|").split("|")] == ["arm (2)", length, *(
                f"{100 * c[key]:.0f} [{100 * c[key + '_low']:.0f}, {100 * c[key + '_high']:.0f}]" for c in cells)]
    (fig,) = figures
    assert np.array_equal(fig.axes[0].images[0].get_array(),
                          [[100 * mean[length][c]["exact"] for c in r["columns"]] for length in ("64", "96")])


def test_examples_have_the_requested_lengths_and_the_needle_where_its_depth_says(texts):
    examples = nd.needle_examples(TOK, pool(texts), (64, 100), (0, 25, 100), n=3, seed=0)
    assert len(examples) == 2 * 3 * (3 + 2)
    for ex in examples:
        ids, at, m = ex["ids"], ex["needle_at"], ex["masked"]
        assert ids[0] == TOK.cls_id and ids[-1] == TOK.sep_id
        assert [ids[p] for p in m] == [TOK.mask_id] * len(ex["answer"]) == [TOK.mask_id] * (len(m))
        assert ex["answer"] == TOK.encode(" " + ex["value"]) and ids.count(TOK.mask_id) == len(m)
        query = m[0] - len(PREFIX)  # where the query starts
        assert ids[query:m[0]] == PREFIX and m[-1] + 2 == len(ids) - 1  # then the suffix "." and [SEP]
        if ex["column"] == "next to the query":
            assert len(ids) < ex["length"] and at == 1
        else:
            assert len(ids) == ex["length"]
        if at is not None:
            end = at + len(PREFIX) + len(ex["answer"]) + 1  # the needle's last token (its ".") is at end - 1
            assert ids[at:end] == PREFIX + ex["answer"] + TOK.encode(".")
            haystack = query - 1  # tokens between [CLS] and the query, the needle's included
            other = haystack - (end - at)
            depth = {"0": 0, "25": 25, "100": 100}.get(ex["column"], 0)
            assert query - end == round(depth / 100 * other)  # the depth: a share of the other tokens
        if ex["column"] == "100":
            assert at == 1
        if ex["column"] == "0":
            assert end == query
    by_index = {}
    for ex in examples:  # every depth and both controls of one example share its value
        by_index.setdefault((ex["length"], ex["index"]), set()).add(ex["value"])
    assert all(len(v) == 1 for v in by_index.values())


def test_a_haystack_is_the_texts_in_order_from_one_texts_start_and_every_depth_shares_it(texts):
    """Each example's haystack (the no-needle control's) is the texts, each with a leading space, read in order from
    the start of one of them and wrapping round after the last; examples start at different texts; every depth of an
    example is that haystack, less as many of its last tokens as the needle takes, with the needle put in."""
    few = pool(texts)[:5]
    docs = [TOK.encode(" " + t) for t in few]
    stream = [t for d in docs for t in d]
    starts = [sum(len(d) for d in docs[:k]) for k in range(len(docs))]
    L = len(stream) - 10  # a haystack of nearly every token: one that starts past the first text wraps round
    examples = nd.needle_examples(TOK, few, (L,), (0, 50, 100), n=8, seed=0)
    found = set()
    for bare in (ex for ex in examples if ex["column"] == "no needle"):
        hay = bare["ids"][1:bare["masked"][0] - len(PREFIX)]
        (first,) = [s for s in starts if (stream + stream)[s:s + len(hay)] == hay]
        found.add(first)
        for ex in (e for e in examples if e["index"] == bare["index"] and e["column"] in ("0", "50", "100")):
            at, needle = ex["needle_at"], len(PREFIX) + len(ex["answer"]) + 1  # the query is as long
            shorter = bare["ids"][:-1 - 2 * needle] + bare["ids"][-1 - needle:]  # the haystack's last tokens make room
            assert ex["ids"][:at] + ex["ids"][at + needle:] == shorter, ex["column"]
    assert len(found) > 1 and max(found) + len(hay) > len(stream)  # several texts start one, and one wraps round


def test_the_same_seed_gives_the_same_examples_and_another_seed_others(texts):
    a, b = (nd.needle_examples(TOK, pool(texts), (64, 128), (0, 50), n=5, seed=s) for s in (3, 3))
    assert a == b
    other = nd.needle_examples(TOK, pool(texts), (64, 128), (0, 50), n=5, seed=4)
    assert {ex["value"] for ex in other}.isdisjoint({ex["value"] for ex in a})
    assert [ex["ids"] for ex in other] != [ex["ids"] for ex in a]


def test_shuffled_haystack_texts_change_the_haystack_alone(texts):
    """The texts in another order: other haystack tokens, but the same values, lengths, positions and masks."""
    texts_ = pool(texts)
    shuffled = [texts_[i] for i in np.random.default_rng(1).permutation(len(texts_))]
    a, b = (nd.needle_examples(TOK, t, (64, 128), (0, 50, 100), n=4, seed=0) for t in (texts_, shuffled))
    keys = ("length", "column", "index", "value", "needle_at", "answer", "masked")
    assert [{k: ex[k] for k in keys} for ex in a] == [{k: ex[k] for k in keys} for ex in b]
    assert [len(ex["ids"]) for ex in a] == [len(ex["ids"]) for ex in b]
    differ = [x["ids"] != y["ids"] for x, y in zip(a, b) if x["column"] != "next to the query"]
    assert sum(differ) > 0.8 * len(differ)
    assert all(x["ids"] == y["ids"] for x, y in zip(a, b) if x["column"] == "next to the query")


def test_batches_give_what_one_sequence_at_a_time_gives(texts):
    model = tiny_model(0).eval()
    examples = nd.needle_examples(TOK, pool(texts), (64, 96), (0, 100), n=3, seed=0)
    one = nd.fill_masks(model, examples, 1, "cpu")
    assert nd.fill_masks(model, examples, 10 ** 6, "cpu") == one
    assert [len(h) for h in one] == [len(ex["answer"]) for ex in examples]


@pytest.mark.parametrize("k, n", [(0, 20), (1, 20), (7, 20), (20, 20), (3, 7), (50, 100), (1, 1)])
def test_wilson_interval_matches_scipy(k, n):
    stats = pytest.importorskip("scipy.stats")
    ci = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert nd.wilson(k, n) == pytest.approx((ci.low, ci.high), abs=1e-9)


def test_a_cell_scores_the_whole_value_and_its_tokens_apart():
    """Exact match counts an example whose every token is filled; token accuracy averages each example's share of
    tokens, its interval scipy's t interval over the examples, cut to [0, 1] where t's reaches past 1."""
    stats = pytest.importorskip("scipy.stats")
    hits = [[True, True, True], [True, False, True], [False, False, False], [True, True, False]] * 2
    cell = nd.needle_cell(hits)
    share = [1, 2 / 3, 0, 2 / 3] * 2
    assert (cell["n"], cell["exact"], cell["exact_each"]) == (8, 0.25, [1, 0, 0, 0] * 2)
    assert (cell["exact_low"], cell["exact_high"]) == pytest.approx(nd.wilson(2, 8))
    assert cell["token"] == pytest.approx(np.mean(share)) and cell["token_each"] == pytest.approx(share)
    t = stats.t.interval(0.95, 7, loc=np.mean(share), scale=stats.sem(share))
    assert 0 < t[0] < t[1] < 1
    assert (cell["token_low"], cell["token_high"]) == pytest.approx(t)
    high = nd.needle_cell([[True, True]] * 2 + [[True, False]])  # t's interval reaches past 1
    assert high["token_high"] == 1 and high["token_low"] == pytest.approx(
        stats.t.interval(0.95, 2, loc=5 / 6, scale=stats.sem([1, 1, 0.5]))[0])


def test_an_arm_that_misses_everything_is_not_certain_of_zero():
    """Three replicates that each miss all 30 examples: the spread is 0, yet 30 examples bound the rate at the
    Wilson interval of 0 in 30, not at [0, 0]; where replicates differ, the interval is eval.interval's."""
    zeros = [nd.needle_cell([[0, 0, 0]] * 30) for _ in range(3)]
    cell = nd.replicates_cell(zeros)
    assert cell["exact"] == 0 and cell["exact_low"] == 0
    assert cell["exact_high"] == pytest.approx(nd.wilson(0, 30)[1]) and cell["exact_high"] > 0.11
    rng = np.random.default_rng(0)
    hits = [[[int(rng.random() < p)] * 2 for _ in range(40)] for p in (0.3, 0.5, 0.6)]
    cell = nd.replicates_cell([nd.needle_cell(h) for h in hits])
    each = np.array([[all(x) for x in h] for h in hits], np.float64)
    iv = interval(lambda t: t[..., 0] / t[..., 1], np.stack([each, np.ones_like(each)], -1)[:, None])
    assert cell["exact"] == pytest.approx(each.mean()) and cell["exact_high"] == pytest.approx(min(1, iv["high"]))
    assert cell["exact_low"] == pytest.approx(max(0, min(iv["low"], nd.wilson(each.mean(0).sum(), 40)[0])))


def test_an_arms_exact_match_holds_the_wilson_interval_of_its_replicates_mean_and_intervals_stay_in_0_1():
    """Replicates that fill 0, 0 and 1 of 30 examples: the Wilson bound is that of the mean over replicates (1/3 of
    an example), not of one replicate; replicates near 1 have their token accuracy's interval cut at 1."""
    cells = [nd.needle_cell([[1, 1]] * k + [[0, 1]] * (30 - k)) for k in (0, 0, 1)]
    assert nd.replicates_cell(cells)["exact_high"] == pytest.approx(nd.wilson(1 / 3, 30)[1])
    cells = [nd.needle_cell([[1, 0]] * k + [[1, 1]] * (6 - k)) for k in (0, 0, 2)]
    each = np.array([c["token_each"] for c in cells])
    iv = interval(lambda t: t[..., 0] / t[..., 1], np.stack([each, np.ones_like(each)], -1)[:, None])
    cell = nd.replicates_cell(cells)
    assert iv["high"] > 1 and cell["token_high"] == 1 and cell["token_low"] == pytest.approx(iv["low"])


def test_bad_input_is_one_error_before_any_model_is_loaded(models, texts, tmp_path, monkeypatch):
    def loaded(info, device):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(nd, "load_weights", loaded)
    kw = dict(depths=(0, 100), n=2, out=tmp_path / "x.json", device="cpu")
    with pytest.raises(InputError, match=r"--lengths=64,256: 256 is above .*m1's max_position_embeddings 160"):
        nd.needle([models[0]], texts, ModernBERT, lengths=(64, 256), **kw)
    few = tmp_path / "few.jsonl"
    few.write_text('{"text": "the cell binds a receptor"}\n' * 3)
    with pytest.raises(InputError, match=r"--texts: 3 texts hold 78 tokens, fewer than the 158 a haystack of 160"):
        nd.needle([models[0]], few, ModernBERT, lengths=(64, 160), **kw)
    with pytest.raises(InputError, match=r"--lengths: 32 tokens cannot hold \[CLS\], the needle"):
        nd.needle([models[0]], texts, ModernBERT, lengths=(32, 64), **kw)
    with pytest.raises(InputError, match="has the same weights as"):
        nd.needle([f"{models[0]},{models[0]}"], texts, ModernBERT, lengths=(64,), **kw)
    other = tmp_path / "m2-other"  # m2 with another tokenizer: NFKC gives a ligature other ids
    shutil.copytree(models[1], other)
    config = json.loads((other / "tokenizer.json").read_text())
    (other / "tokenizer.json").write_text(json.dumps({**config, "normalizer": {"type": "NFKC"}}))
    with pytest.raises(InputError, match="the models use different tokenizers"):
        nd.needle([models[0], other], texts, ModernBERT, lengths=(64,), **kw)
    assert not (tmp_path / "x.json").exists()


def test_a_write_that_fails_midway_leaves_the_examples_file_as_it_was(models, texts, tmp_path, monkeypatch):
    """The examples file is written through a temporary name: an error while its lines are made (here the
    tokenizer's decode, at the fifth example) leaves the file of the previous run whole, and no temporary file."""
    monkeypatch.setattr(nd, "load_weights", lambda info, device: Told())
    kw = dict(lengths=(64,), depths=(0, 100), n=3, out=tmp_path / "needle.json", device="cpu")
    nd.needle([models[0]], texts, ModernBERT, **kw)
    examples = tmp_path / "needle.examples.jsonl"
    before = examples.read_bytes()
    assert len(before.splitlines()) == 3 * (2 + 2)
    decoded = []

    def decode(self, ids):
        decoded.append(ids)
        if len(decoded) == 5:
            raise OSError(28, "No space left on device")
        return TOK.enc.decode([int(i) for i in ids], errors="replace")
    monkeypatch.setattr(type(TOK), "decode", decode)
    with pytest.raises(InputError, match="needle.examples.jsonl: cannot write it .No space left on device"):
        nd.needle([models[0]], texts, ModernBERT, **{**kw, "n": 4})
    assert examples.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "needle.examples.jsonl", "needle.json", "needle.png"]


@pytest.mark.slow  # three processes that import torch; the needle's science is tested in process above
def test_needle_cli(models, texts, tmp_path):
    out = tmp_path / "cli" / "needle.json"
    command = [sys.executable, str(ROOT / "eval.py"), "needle", f"{models[0]},{models[1]}", str(models[0]),
               f"--texts={texts}", "--lengths=64,128", "--depths=0,100", "--n=3", "--names=both,first",
               f"--out={out}", "--device=cpu", "--batch_tokens=256"]
    run = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2 and "has the same weights as" in run.stderr  # m1 in two arms
    run = subprocess.run(command[:4] + command[5:], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2 and "--names gives 2 distinct names for 1 models" in run.stderr
    run = subprocess.run(command[:4] + command[5:9] + command[10:], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    r = json.loads(out.read_text())
    assert r["args"]["lengths"] == [64, 128] and r["args"]["n"] == 3 and list(r["arms"]) == [models[0].name]
    assert len(out.with_suffix(".examples.jsonl").read_text().splitlines()) == 2 * 3 * (2 + 2)
    assert out.with_suffix(".png").stat().st_size > 1000
    assert "**exact match of the whole value**" in run.stdout and run.stdout.count("| m1 (2) | ") == 4
    bad = subprocess.run(command[:4] + ["--texts=x", "--depths=50,0"], capture_output=True, text=True, cwd=tmp_path)
    assert bad.returncode == 2 and "expected distinct percentages from 0 to 100 in increasing order" in bad.stderr
