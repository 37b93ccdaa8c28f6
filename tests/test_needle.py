"""eval.py needle: a model told the answer scores every example and none without the needle, the examples' lengths,
positions and seeds, the haystack's texts changing nothing else, the Wilson interval against scipy, bad input
refused before any model is loaded, and the command line."""
import json
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
