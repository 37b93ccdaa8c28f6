"""data.py: tokenizer parity with Hugging Face `tokenizers`, prepare, the loader's order, masks, resume, bad inputs."""
import ast
import contextlib
import gzip
import hashlib
import json
import os
import random
import re
import shutil
import signal
import unicodedata
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import data
from machinery import datacli
from machinery import prepare as prepare_io
from conftest import MODERNBERT_TOKENIZER, ROOT, SHARED_DATA, need, tiny_model
from machinery import prepare as prep
from machinery import tokenizer as tok
from machinery import tokenfiles
from machinery.cli import InputError, run, sha256_file
from machinery.gpureport import children
from machinery.rundir import hold_lock, release_lock

CORPORA = [SHARED_DATA / "corpus" / f"e3c_{lang}_clinical_cases.jsonl" for lang in ("en", "fr")]
TRICKY = ([" " * n + "x" for n in range(1, 31)] + ["a" + " " * n + "b" for n in range(1, 31)] + [
    "", " ", "\t", "\t\tx\ty", "a\n\nb", "a\n\n  b\r\n", "x [MASK] y", "x   [MASK]", "x\t [MASK]", "a\n[MASK]",
    "\n\n[MASK]", "[MASK]", "[MASK][MASK]  [MASK]", "[CLS]hi[SEP]", "foo<|endoftext|>bar",
    "mail |||EMAIL_ADDRESS||| me", "call|||PHONE_NUMBER|||now", "[unused0][unused12]", "<|padding|>", "e\u0301",
    "cafe\u0301 [MASK]", "😀 emoji 👍🏽", "中文字符 测试。", "\x1c\x1d x \x1f[MASK]", "a\x1c [MASK]", "\u3000[MASK]",
    "\u00a0\u00a0x", "x\u2028y", "Привет мир 123 ελληνικά", "don't I'll we've 'S", "ﬁ ligature Ⅻ ①", "   \n   ",
    "[mask] [MAS K] [MASK", "x\x85y [MASK]", "\x0b\x0c[MASK]\u2003", "１２３ｱｲｳ", "a\u200bb", "\ufeffBOM"])


def words(rng, n):
    """Generated text with the features that stress a BPE port: accents in NFD, CJK, digits, odd whitespace."""
    parts = ["ka", "lo", "mi", "ré", "e\u0301t", "zu", "ph", "str", "ön", "ß", "中", "1", "42", "'s", "!", "..."]
    seps = [" ", " ", " ", "  ", "\n", ", ", "\t", "   ", "\n\n"]
    return "".join("".join(rng.choice(parts) for _ in range(rng.randint(1, 4))) + rng.choice(seps) for _ in range(n))


def hf_ids(hf, texts):
    return [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small byte-level BPE trained here with `tokenizers`: (path, HF tokenizer)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    rng = random.Random(0)
    hf = Tokenizer(models.BPE())
    hf.normalizer, hf.decoder = normalizers.NFC(), decoders.ByteLevel()
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=500, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    hf.train_from_iterator([words(rng, 200) for _ in range(200)], trainer)
    hf.add_special_tokens([AddedToken(t, normalized=False) for t in ("[CLS]", "[SEP]", "[PAD]")] +
                          [AddedToken("[MASK]", lstrip=True, normalized=False), AddedToken("<r>", rstrip=True)])
    hf.add_tokens([AddedToken("  ", normalized=True), AddedToken("<e\u0301nt>", normalized=True)])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    hf.save(str(path))
    return path, hf


@pytest.fixture(scope="module")
def modernbert():
    from tokenizers import Tokenizer
    path = need(MODERNBERT_TOKENIZER)
    return data.load_tokenizer(path), Tokenizer.from_file(str(path))


# ----------------------------------------------------------------------------
# Tokenizer

def test_modernbert_tricky_strings(modernbert):
    ours, hf = modernbert
    assert [ours.encode(t) for t in TRICKY] == hf_ids(hf, TRICKY)
    assert (ours.vocab_size, ours.cls_id, ours.sep_id, ours.pad_id, ours.mask_id) == (50368, 50281, 50282, 50283, 50284)
    assert ours.special_ids == [1, 50279, 50280, 50281, 50282, 50283, 50284]
    assert ours.encode("a  [MASK]") == ours.encode("a") + [50284]  # [MASK] swallows the spaces on its left
    for text in TRICKY:
        if "[MASK]" not in text:
            assert ours.decode(ours.encode(text)) == unicodedata.normalize("NFC", text)


@pytest.mark.slow  # ~7 s on 2 cores, mostly the HF side; the golden ids above stay in the default suite
def test_modernbert_every_corpus_document(modernbert):
    ours, hf = modernbert
    texts = [json.loads(line)["text"] for path in CORPORA for line in open(need(path), encoding="utf-8")]
    mismatched = [i for i, (a, b) in enumerate(zip(ours.encode_batch(texts), hf_ids(hf, texts))) if a != b]
    assert len(texts) == 7943 + 1520 and not mismatched, f"{len(mismatched)} documents differ, first {mismatched[:5]}"


def test_trained_tokenizer_parity(trained):
    path, hf = trained
    ours = data.load_tokenizer(path)
    texts = TRICKY + [words(random.Random(1), 300)] + ["x <r>  y", "<r>\n<r>", "<e\u0301nt> <ént>", "e\u0301[CLS]",
                                                      "zu [MASK]  ka [SEP]", "\u3000[MASK] <r>\t"]
    assert [ours.encode(t) for t in texts] == hf_ids(hf, texts)
    assert ours.encode_batch(texts, num_threads=4) == hf_ids(hf, texts)  # 105 texts in order, on 4 threads
    assert (ours.vocab_size, ours.special_ids, ours.mask_id) == (507, [500, 501, 502, 503, 504], 503)


def test_decode_round_trip(trained):
    ours = data.load_tokenizer(trained[0])
    for text in ["plain text", "e\u0301t -> ét", "中文 😀 ", "  two  spaces\t\ttabs\n\nlines", "[CLS]x[SEP]",
                 words(random.Random(2), 50)]:
        assert ours.decode(ours.encode(text)) == unicodedata.normalize("NFC", text)


def test_bytes_tokenizer():
    tok = data.load_tokenizer("bytes")
    assert (tok.vocab_size, tok.cls_id, tok.sep_id, tok.pad_id, tok.mask_id) == (260, 256, 257, 258, 259)
    assert tok.special_ids == [256, 257, 258, 259]
    assert tok.encode("é[MASK]a") == [0xC3, 0xA9, 259, 97]
    assert tok.decode(tok.encode("héllo [PAD] 中")) == "héllo [PAD] 中"
    assert tok.fingerprint == data.load_tokenizer("bytes").fingerprint


def swap_two_bytes(config):
    vocab = config["model"]["vocab"]
    vocab["a"], vocab["b"] = vocab["b"], vocab["a"]


@pytest.mark.parametrize("edit", [lambda c: c["added_tokens"][-1].update(content="<other>"), swap_two_bytes,
                                  lambda c: c.update(normalizer={"type": "NFKC"})],
                         ids=["an added token", "the ids of two bytes", "the normalizer"])
def test_fingerprint(trained, tmp_path, edit):
    """Whatever changes the ids a text gets changes the fingerprint, which stops a run on data of another tokenizer."""
    path, hf = trained
    assert data.load_tokenizer(path).fingerprint == data.load_tokenizer(path).fingerprint
    config = json.loads(path.read_text())
    edit(config)
    (tmp_path / "other.json").write_text(json.dumps(config))
    other, ours = data.load_tokenizer(tmp_path / "other.json"), data.load_tokenizer(path)
    assert other.encode("<e\u0301nt> ab \ufb01") != ours.encode("<e\u0301nt> ab \ufb01")  # another tokenizer indeed
    assert other.fingerprint != ours.fingerprint
    # GPT-2's own pattern is not counted: corpora prepared before the pattern was (with it) still pass
    assert data.load_tokenizer("bytes").fingerprint.startswith("f0251e1e1f2a26b6")


def test_fingerprint_holds_the_split_pattern(trained, monkeypatch):
    """The pre-tokenizer's pattern decides the pieces merges apply to: an edit to it alone (the same tokenizer.json)
    gives other ids, so it gives another fingerprint, and data prepared before the edit is not read as if it fit."""
    path, _ = trained
    ours = data.load_tokenizer(path)
    monkeypatch.setattr(tok, "GPT2_PATTERN", r"\S+|\s+")  # whitespace-delimited pieces, no leading space
    other = data.load_tokenizer(path)
    assert other.encode("ka lo mi") != ours.encode("ka lo mi")  # another tokenization indeed
    assert other.fingerprint != ours.fingerprint


def test_byte_tokenizer_json_is_loaded_by_hf_tokenizers(tmp_path):
    from tokenizers import Tokenizer
    ours = data.load_tokenizer("bytes")
    ours.save_pretrained(tmp_path)
    hf = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    texts = TRICKY + [words(random.Random(6), 300), "é[MASK]a [PAD][SEP]x[CLS]", "\x00\x7f\u0100 \U0010ffff"]
    assert [ours.encode(t) for t in texts] == hf_ids(hf, texts)
    assert [e.ids for e in hf.encode_batch(texts)] == [[256, *ours.encode(t), 257] for t in texts]
    assert [hf.decode(ours.encode(t), skip_special_tokens=False) for t in texts] == [ours.decode(ours.encode(t))
                                                                                     for t in texts]
    assert hf.get_vocab_size() == ours.vocab_size


def test_modernbert_save_pretrained_round_trip(modernbert, tmp_path):
    ours, _ = modernbert
    ours.save_pretrained(tmp_path)
    again = data.load_tokenizer(tmp_path / "tokenizer.json")
    assert again.fingerprint == ours.fingerprint
    assert [again.encode(t) for t in TRICKY] == [ours.encode(t) for t in TRICKY]
    import transformers
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert [hf(t)["input_ids"] for t in TRICKY] == [[50281, *ours.encode(t), 50282] for t in TRICKY]
    assert (hf.mask_token, hf.cls_token, hf.sep_token, hf.pad_token) == ("[MASK]", "[CLS]", "[SEP]", "[PAD]")


@pytest.mark.parametrize("which", ["bytes", "trained"])
def test_run_directory_loads_in_transformers(which, trained, tmp_path):
    """AutoTokenizer and pipeline("fill-mask") on a directory of save_pretrained + a tiny random model, offline."""
    import transformers
    ours = data.load_tokenizer(trained[0] if which == "trained" else "bytes")
    ours.save_pretrained(tmp_path)
    model = tiny_model(vocab_size=max(320, ours.vocab_size), cls_token_id=ours.cls_id, sep_token_id=ours.sep_id,
                       pad_token_id=ours.pad_id, mask_token_id=ours.mask_id)
    model.save_pretrained(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(tmp_path)
    texts = TRICKY[::3] + [words(random.Random(7), 100)]
    assert [hf(t)["input_ids"] for t in texts] == [[ours.cls_id, *ours.encode(t), ours.sep_id] for t in texts]
    assert (hf.mask_token_id, hf.cls_token_id, hf.sep_token_id, hf.pad_token_id) == (
        ours.mask_id, ours.cls_id, ours.sep_id, ours.pad_id)
    text = "the zu [MASK] ka."
    ids = torch.tensor([[ours.cls_id, *ours.encode(text), ours.sep_id]])
    with torch.no_grad():
        logits = model.eval()(ids)[0][0, ids[0].tolist().index(ours.mask_id)]
    filled = transformers.pipeline("fill-mask", model=str(tmp_path), top_k=5)(text)
    assert [f["token"] for f in filled] == logits.topk(5).indices.tolist()
    assert np.allclose([f["score"] for f in filled], logits.softmax(-1).topk(5).values.numpy(), atol=1e-5)


@pytest.mark.parametrize("edit, words_", [
    (lambda c: c.update(pre_tokenizer={"type": "Metaspace"}), ["pre_tokenizer.type", "ByteLevel"]),
    (lambda c: c["pre_tokenizer"].update(add_prefix_space=True), ["add_prefix_space"]),
    (lambda c: c.update(normalizer={"type": "Lowercase"}), ["normalizer", "NFC"]),
    (lambda c: c["model"].update(dropout=0.1), ["model.dropout"]),
    (lambda c: c["model"].update(continuing_subword_prefix="##"), ["continuing_subword_prefix"]),
    (lambda c: c["added_tokens"][0].update(single_word=True), ["single_word"]),
    (lambda c: c["model"]["merges"].reverse(), ["merge", "order"]),
    (lambda c: c["model"]["merges"].pop(), ["not the result of any merge"]),
])
def test_unsupported_tokenizer_is_refused(trained, tmp_path, edit, words_):
    config = json.loads(trained[0].read_text())
    edit(config)
    path = tmp_path / "odd_tokenizer.json"
    path.write_text(json.dumps(config))
    with pytest.raises(InputError) as e:
        data.load_tokenizer(path)
    assert all(w in str(e.value) for w in ["odd_tokenizer.json", *words_]), str(e.value)


# ----------------------------------------------------------------------------
# A small tokenizer learned by data.py

def recount_merges(texts, n_merges):
    """BPE by its definition, every pair recounted before each merge: the slow oracle for the incremental one.
    Tokens are bytes; ties go to the smallest ids (a byte's id is its value, merge k makes id 256 + k)."""
    import regex
    from collections import Counter
    pieces = Counter(w for t in texts for w in regex.findall(tok.GPT2_PATTERN, unicodedata.normalize("NFC", t)))
    words = Counter({tuple(bytes([c]) for c in w.encode()): f for w, f in pieces.items()})
    ids, merges = {bytes([i]): i for i in range(256)}, []
    while len(merges) < n_merges:
        pairs = Counter()
        for w, f in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += f
        candidates = [p for p in pairs if p[0] + p[1] not in ids]
        if not candidates:
            break
        a, b = min(candidates, key=lambda p: (-pairs[p], ids[p[0]], ids[p[1]]))
        merges.append((ids[a], ids[b]))
        ids[a + b] = 255 + len(merges)
        merged = Counter()
        for w, f in words.items():
            out = []
            for token in w:
                if out and out[-1] == a and token == b:
                    out[-1] = a + b
                else:
                    out.append(token)
            merged[tuple(out)] += f
        words = merged
    return merges


def test_learned_merges_equal_the_recount(tmp_path):
    texts = [words(random.Random(8), 200) for _ in range(5)]
    counts = tok.word_counts(prepare_io.read_documents(write_jsonl(tmp_path / "c.jsonl", texts)))
    assert tok.learn_merges(counts, 150)[1] == recount_merges(texts, 150)


def test_learned_tokenizer_stops_when_the_corpus_runs_out(tmp_path, capsys):
    texts = ["abab cd", "abab"]
    tok = datacli.train_tokenizer([write_jsonl(tmp_path / "c.jsonl", texts)], 1000, tmp_path / "t.json")
    merges = recount_merges(texts, 1000)
    assert len(merges) == 4 and tok.vocab_size == 256 + 4 + 4 and tok.mask_id == 263  # ab, abab, " c", " cd"
    assert tok.encode("abab cd") == [257, 259] and "allows only 4 merges" in capsys.readouterr().err


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """A 600-id tokenizer learned by `python data.py tokenizer` from generated text, and the corpus (path, texts)."""
    tmp = tmp_path_factory.mktemp("learned")
    rng = random.Random(9)
    texts = [words(rng, 150) + " 😀 中文 naïve e\u0301t" for _ in range(80)]
    corpus = write_jsonl(tmp / "corpus.jsonl", texts)
    data.main(["tokenizer", "--input", str(corpus), "--vocab_size", "600", "--out", str(tmp / "tok.json")])
    return tmp / "tok.json", corpus


def test_learned_tokenizer_parity_with_hf(learned):
    from tokenizers import Tokenizer
    path, _ = learned
    ours, hf = data.load_tokenizer(path), Tokenizer.from_file(str(path))
    held_out = TRICKY + [words(random.Random(10), 400), "ka[MASK]lo  [MASK] [CLS]x[SEP][PAD]", "e\u0301t\u0301"]
    assert [ours.encode(t) for t in held_out] == hf_ids(hf, held_out)
    assert (ours.vocab_size, ours.cls_id, ours.sep_id, ours.pad_id, ours.mask_id) == (600, 596, 597, 598, 599)
    assert ours.special_ids == [596, 597, 598, 599] and hf.get_vocab_size() == 600
    assert ours.encode("zu  [MASK]") == ours.encode("zu") + [599]  # [MASK] swallows the space on its left
    assert len(ours.encode(held_out[-2])) < len(held_out[-2].encode()) / 2  # merges were learned and are used


def test_learned_tokenizer_is_deterministic(learned, tmp_path):
    path, corpus = learned
    datacli.train_tokenizer([corpus], 600, tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()
    datacli.train_tokenizer([corpus], 500, tmp_path / "smaller.json")
    small, big = json.loads((tmp_path / "smaller.json").read_text()), json.loads(path.read_text())
    assert small["model"]["merges"] == big["model"]["merges"][:500 - 260]  # a prefix: the order is by count


# ----------------------------------------------------------------------------
# Prepare

@pytest.fixture(scope="module")
def byte_data(tmp_path_factory):
    """A byte-tokenized data dir with [PAD] inside the text (so masking must skip it): ~330k train tokens."""
    tmp = tmp_path_factory.mktemp("bytes")
    rng = random.Random(3)
    texts = [words(rng, rng.randint(20, 200)) + rng.choice(["", " [PAD][PAD]"]) for _ in range(600)]
    data.prepare([write_jsonl(tmp / "gen.jsonl", texts)], "bytes", tmp / "d", val_fraction=0.1)
    return tmp / "d"


def split_documents(folder, meta, split):
    """The documents of folder/{split}.bin, each as its ids' bytes ([CLS] ... [SEP])."""
    ids = np.fromfile(folder / f"{split}.bin", meta["dtype"])
    ends = np.flatnonzero(ids == meta["sep_id"]) + 1
    return [ids[a:b].tobytes() for a, b in zip([0, *ends[:-1]], ends)]


def test_a_copy_of_a_validation_document_is_left_out_of_train(tmp_path, capsys):
    """A corpus that holds each case twice (two sources, or one file): validation never scores a text that train
    holds; the copies left out, and the texts repeated, are counted and said."""
    rng = random.Random(5)
    texts = [words(rng, 30) for _ in range(20)]
    a = write_jsonl(tmp_path / "a.jsonl", texts + texts[:10])  # 10 repeated within a source
    b = write_jsonl(tmp_path / "b.jsonl", texts[10:])  # and 10 across sources
    meta = data.prepare([a, b], "bytes", tmp_path / "d", val_fraction=0.25, seed=3, workers=1)
    val, train = (split_documents(tmp_path / "d", meta, split) for split in ("val", "train"))
    copies = meta["splits"]["train"]["copies_of_val_left_out"]
    assert not set(val) & set(train) and copies > 0 and len(val) + len(train) + copies == 40
    said = capsys.readouterr().out
    assert f"; {copies} left out of train as copies of validation documents; 20 document(s) repeat another's text" \
           in said, said


def test_the_french_corpus_validates_on_no_text_it_trains_on(tmp_path):
    """The shared French clinical cases hold most cases twice (the same text under two ids)."""
    path = need(SHARED_DATA / "corpus" / "e3c_fr_clinical_cases.jsonl")
    meta = data.prepare([path], need(MODERNBERT_TOKENIZER), tmp_path / "fr", val_fraction=0.02, workers=1)
    val, train = (split_documents(tmp_path / "fr", meta, split) for split in ("val", "train"))
    assert len(val) == 30 and not set(val) & set(train) and meta["splits"]["train"]["copies_of_val_left_out"] > 0


def test_prepare_is_deterministic_and_counts(tmp_path):
    rng = random.Random(4)
    a = write_jsonl(tmp_path / "a.jsonl", [words(rng, 30) for _ in range(50)])
    b = tmp_path / "b.txt"
    b.write_text("first doc\nstill first\n\n\nsecond doc\n  \nthird\n", encoding="utf-8")
    metas = [data.prepare([a, b], "bytes", tmp_path / out, val_fraction=0.1, seed=7) for out in ("o1", "o2")]
    for name in ("train.bin", "val.bin", "meta.json"):
        assert (tmp_path / "o1" / name).read_bytes() == (tmp_path / "o2" / name).read_bytes()
    meta = metas[0]
    assert sorted(p.name for p in (tmp_path / "o1").iterdir()) == ["meta.json", "train.bin", "val.bin"]
    assert [s["documents"] for s in meta["sources"]] == [50, 3]
    assert {k: v["documents"] for k, v in meta["splits"]["val"]["per_source"].items()} == {"a": 5, "b": 1}
    docs = {"train": [], "val": []}
    b_docs = {"first doc\nstill first", "second doc", "third"}
    for split in docs:
        tokens = np.fromfile(tmp_path / "o1" / f"{split}.bin", dtype=np.uint16)
        assert len(tokens) == meta["splits"][split]["tokens"]
        assert tokens[0] == 256 and tokens[-1] == 257  # [CLS] text [SEP], concatenated
        ends = np.flatnonzero(tokens == 257)
        assert np.all(tokens[ends[:-1] + 1] == 256) and len(ends) == meta["splits"][split]["documents"]
        docs[split] = [bytes(d[1:-1].astype(np.uint8)).decode() for d in np.split(tokens, ends + 1)[:-1]]
        per_source = meta["splits"][split]["per_source"]
        for name, mine in (("a", [d for d in docs[split] if d not in b_docs]), ("b", [d for d in docs[split]
                                                                                     if d in b_docs])):
            # the byte tokenizer: one token per UTF-8 byte, plus [CLS] and [SEP] per document
            assert per_source[name] == {"tokens": sum(len(d.encode()) + 2 for d in mine), "documents": len(mine)}
        assert sum(v["tokens"] for v in per_source.values()) == meta["splits"][split]["tokens"]
    assert b_docs <= set(docs["train"]) | set(docs["val"]) and not set(docs["train"]) & set(docs["val"])
    assert len(docs["train"]) + len(docs["val"]) == 53  # no repeats without --mix


def test_train_keeps_a_document_of_every_input_whatever_the_val_fraction(tmp_path):
    """Validation takes val_fraction of each input's documents, rounded, at least one and never all of them."""
    a = write_jsonl(tmp_path / "a.jsonl", ["first text", "second text"])
    b = write_jsonl(tmp_path / "b.jsonl", ["third", "fourth", "fifth"])
    meta = data.prepare([a, b], "bytes", tmp_path / "d", val_fraction=0.9, workers=1)
    assert {split: {name: source["documents"] for name, source in meta["splits"][split]["per_source"].items()}
            for split in ("train", "val")} == {"train": {"a": 1, "b": 1}, "val": {"a": 1, "b": 2}}


def test_prepare_mix(tmp_path):
    rng = random.Random(5)
    big = write_jsonl(tmp_path / "big.jsonl", [words(rng, 40) for _ in range(400)])
    small = write_jsonl(tmp_path / "small.jsonl", [words(rng, 40) for _ in range(40)])
    plain = data.prepare([big, small], "bytes", tmp_path / "plain", seed=1)
    meta = data.prepare([big, small], "bytes", tmp_path / "mixed", mix={"big": 0.6, "small": 0.4}, seed=1)
    train = meta["splits"]["train"]
    assert abs(train["tokens"] - plain["splits"]["train"]["tokens"]) / train["tokens"] < 0.02  # natural total kept
    assert abs(train["per_source"]["small"]["tokens"] / train["tokens"] - 0.4) < 0.02
    assert train["per_source"]["small"]["documents"] > 2 * 39  # repeated more than twice
    assert meta["splits"]["val"] == plain["splits"]["val"]  # validation chosen before mixing, never repeated
    huge = data.prepare([big, small], "bytes", tmp_path / "huge", mix={"big": 0.6e308, "small": 0.4e308}, seed=1)
    assert huge["splits"] == meta["splits"]  # only the ratio counts: weights whose sum overflows are no special case
    with pytest.raises(InputError, match="big.*small"):
        data.prepare([big, small], "bytes", tmp_path / "bad", mix={"big": 1.0, "other": 1.0})


# ----------------------------------------------------------------------------
# Prepare on worker processes: the same bytes for any number of them, and as before they existed

def golden_corpus(folder):
    """Three sources with what a reader must get right: a byte order mark, CRLF, blank and empty documents, runs of
    blank lines (some of Unicode spaces), no newline at the end."""
    rng = random.Random(11)
    lines = []
    for i in range(150):
        text = words(rng, rng.randint(3, 80)) if i % 17 else rng.choice(["", "  "])
        lines.append(json.dumps({"text": text, "id": i}) + rng.choice(["\n", "\r\n", "\n\n"]))
    (folder / "web.jsonl").write_text("\ufeff" + "".join(lines), encoding="utf-8", newline="")
    blocks = []
    for i in range(60):
        doc = "\n".join(words(rng, rng.randint(1, 12)).replace("\n", " ") for _ in range(rng.randint(1, 4)))
        blocks.append(doc + rng.choice(["\n\n", "\n\n\n", "\n \t\n", "\n\u3000\n\n", "\r\n\r\n"]))
    (folder / "notes.txt").write_text("".join(blocks).rstrip("\n"), encoding="utf-8", newline="")
    code = [f"def f{i}():\n    return {i} # 😀 中文" * rng.randint(1, 5) for i in range(25)]
    (folder / "code.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in code), encoding="utf-8")
    return [folder / n for n in ("web.jsonl", "notes.txt", "code.jsonl")]


GOLDEN_CASES = {"plain": dict(val_fraction=0.1, seed=7),
                "mix": dict(mix={"web": 0.5, "notes": 0.3, "code": 0.2}, seed=3, val_fraction=0.05)}
# The first 16 hex digits of the sha256 of train.bin, val.bin and meta.json (its paths cut to file names, without
# the splits' fingerprints, which the .bin files decide) that the single-process prepare wrote for golden_corpus
# before prepare had worker processes (commit 16c0676).
GOLDEN = {
    ("bytes", "plain"): ("de5655087bdb36dc", "c203e684c9c2a83f", "494668b31d60a13e"),
    ("bytes", "mix"): ("9722335f8410336e", "f4257f4faf30cda7", "d484b31391becd64"),
    ("modernbert", "plain"): ("80021bf8d1c9bb12", "cfecac273b9d447b", "83f674c1a614a1c2"),
    ("modernbert", "mix"): ("1e85d3b82e44fc07", "123c7c719ebd5949", "9394afd59bc2e36a"),
}


def digests(out):
    """The GOLDEN digests of a prepared folder."""
    meta = json.loads((out / "meta.json").read_text())
    meta["tokenizer"] = Path(meta["tokenizer"]).name
    for s in meta["sources"]:
        s["path"] = Path(s["path"]).name
    for split, counts in meta["splits"].items():  # the fingerprint is the file's: its ids at the sampled positions
        n, dtype = counts["tokens"], np.dtype(meta["dtype"])
        ids = np.fromfile(out / f"{split}.bin", dtype)[tokenfiles.sample_positions(n)] if n else np.zeros(0, dtype)
        assert counts.pop("sample_sha256") == hashlib.sha256(ids.tobytes()).hexdigest()
    assert meta["splits"]["train"].pop("copies_of_val_left_out") == 0  # counted since; the corpus repeats no text
    texts = [(out / "train.bin").read_bytes(), (out / "val.bin").read_bytes(), (json.dumps(meta, indent=2) + "\n").encode()]
    return tuple(hashlib.sha256(t).hexdigest()[:16] for t in texts)


@pytest.mark.parametrize("workers, piece_bytes", [(1, None), (2, None), (3, None), (1, 1), (3, 1)],
                         ids=["1 worker", "2 workers", "3 workers", "1 worker, a piece a line", "3 workers, a piece a line"])
def test_prepare_writes_the_golden_bytes_with_any_number_of_workers(tmp_path, monkeypatch, workers, piece_bytes):
    """Pieces of every size (down to one line, or one .txt document, each), blocks of a few documents and batches of
    one: the bytes of the single-process prepare."""
    inputs = golden_corpus(tmp_path)
    monkeypatch.setattr(prep, "usable_cores", lambda: 8)  # 3 workers even where fewer cores would bound them
    monkeypatch.setattr(prep, "BLOCK_TOKENS", 1000)
    monkeypatch.setattr(prep, "BATCH_BYTES", 300)
    if piece_bytes:
        monkeypatch.setattr(prep, "PIECE_BYTES", piece_bytes)
        assert sum(len(prep.plan(f, piece_bytes, "text")) for f in inputs) == 283  # lines and .txt documents
    tokenizers = {"bytes": "bytes", "modernbert": data.load_tokenizer(MODERNBERT_TOKENIZER)
                  if MODERNBERT_TOKENIZER.exists() else None}
    for (name, case), golden in GOLDEN.items():
        if tokenizers[name] is None:
            continue  # the real tokenizer lives in ../shared; the byte tokenizer's cases still ran
        out = tmp_path / f"{name}-{case}"
        data.prepare(inputs, tokenizers[name], out, workers=workers, **GOLDEN_CASES[case])
        assert digests(out) == golden, (name, case)


def compress(path, suffix):
    """path.gz or path.zst beside path, the same bytes compressed."""
    raw, out = path.read_bytes(), path.with_name(path.name + suffix)
    if suffix == ".gz":
        out.write_bytes(gzip.compress(raw))
    else:
        out.write_bytes(pytest.importorskip("zstandard").ZstdCompressor().compress(raw))
    return out


def without(meta, *keys):
    """meta with the keys of its sources removed (where the same documents were read from)."""
    return meta | {"sources": [{k: v for k, v in s.items() if k not in keys} for s in meta["sources"]]}


def test_compressed_files_folders_and_globs_read_as_the_plain_files(tmp_path, capsys):
    """.gz and .zst are their plain files; a folder of shards is one source, named by the folder, of its files in
    name order; a glob is the files it matches, each a source."""
    plain = golden_corpus(tmp_path)
    web, notes, code = plain
    packed = tmp_path / "packed"
    packed.mkdir()
    for path, suffix in ((web, ".gz"), (notes, ".zst")):
        compress(path, suffix).rename(packed / (path.name + suffix))
    shutil.copy(code, packed / "code.jsonl")
    args = dict(val_fraction=0.1, seed=7, workers=2)
    base = data.prepare(plain, "bytes", tmp_path / "plain", **args)
    mixed = data.prepare([packed / "web.jsonl.gz", packed / "notes.txt.zst", packed / "code.jsonl"], "bytes",
                         tmp_path / "packed-out", **args)
    assert without(mixed, "path", "sha256") == without(base, "path", "sha256")
    assert [s["sha256"] for s in mixed["sources"]] == [sha256_file(packed / n) for n in
                                                       ("web.jsonl.gz", "notes.txt.zst", "code.jsonl")]
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "packed-out" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()

    # the web source as a folder of shards: the same documents in the same order, so the same token files
    shards = tmp_path / "web"
    shards.mkdir()
    lines = web.read_bytes().splitlines(keepends=True)
    for i, (name, suffix) in enumerate((("part-0.jsonl", ".gz"), ("part-1.jsonl", ".zst"), ("part-2.jsonl", ""))):
        (shards / name).write_bytes(b"".join(lines[i * 70:(i + 1) * 70]))
        if suffix:
            compress(shards / name, suffix)
            (shards / name).unlink()
    (shards / "README.md").write_text("not read")
    folder = data.prepare([shards, notes, code], "bytes", tmp_path / "folder", **args)
    assert f"{shards}: source web reads its 3 files of text, not README.md\n" in capsys.readouterr().out
    assert without(folder, "path", "sha256", "files") == without(base, "path", "sha256")
    for name in ("train.bin", "val.bin"):
        assert (tmp_path / "folder" / name).read_bytes() == (tmp_path / "plain" / name).read_bytes()
    files = ["part-0.jsonl.gz", "part-1.jsonl.zst", "part-2.jsonl"]
    record = folder["sources"][0]
    assert record["files"] == [{"name": n, "sha256": sha256_file(shards / n)} for n in files]
    assert record["sha256"] == hashlib.sha256("".join(f"{sha256_file(shards / n)}  {n}\n"
                                                      for n in files).encode()).hexdigest()

    globbed = data.prepare([str(packed / "*")], "bytes", tmp_path / "glob", **args)
    listed = data.prepare(sorted(packed.iterdir()), "bytes", tmp_path / "listed", **args)
    assert [s["name"] for s in globbed["sources"]] == ["code", "notes", "web"] and globbed == listed


def test_a_folders_hidden_files_are_not_read(tmp_path, capsys):
    """A download in progress (.part-1.jsonl) and a copy's metadata (._part-0.jsonl, not even text) beside the
    shards are no corpus: not read, and named; a folder of hidden files alone says why it has nothing to read."""
    shards = tmp_path / "web"
    shards.mkdir()
    write_jsonl(shards / "part-0.jsonl", ["one text", "two texts", "three texts"])
    write_jsonl(shards / ".part-1.jsonl", ["half a download"])
    (shards / "._part-0.jsonl").write_bytes(b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X")
    (shards / ".DS_Store").write_bytes(b"\x00\x00\x00\x01Bud1")
    meta = data.prepare([shards], "bytes", tmp_path / "out", workers=1)
    assert [f["name"] for f in meta["sources"][0]["files"]] == ["part-0.jsonl"] and meta["sources"][0]["documents"] == 3
    assert f"{shards}: source web reads its 1 files of text, not ._part-0.jsonl, .part-1.jsonl\n" in capsys.readouterr().out
    (shards / "part-0.jsonl").unlink()
    with pytest.raises(InputError, match=r"web: a folder with no file to read in it; .*hidden files, whose names start "
                                         r"with '\.', are not read"):
        data.prepare([shards], "bytes", tmp_path / "out", workers=1)


def test_a_bad_line_is_named_by_its_line_in_the_file_whatever_piece_holds_it(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "PIECE_BYTES", 200)
    good = [json.dumps({"text": f"document {i}"}) + "\n" for i in range(300)]
    (tmp_path / "bad.jsonl").write_text("".join(good[:256]) + '{"text": 5}\n' + "".join(good[256:]))
    (tmp_path / "bad.txt").write_bytes(b"".join(b"doc %d\nline\n\n" % i for i in range(100)) + b"caf\xe9\n")
    for name, expected in (("bad.jsonl", "bad.jsonl:257: field 'text' is int"), ("bad.txt", "bad.txt:301: invalid")):
        assert len(prep.plan(tmp_path / name, 200, "text")) > 5
        for workers in (1, 3):
            with pytest.raises(InputError, match=re.escape(expected)):
                data.prepare([tmp_path / name], "bytes", tmp_path / "out", workers=workers)


def test_memory_is_bounded_by_the_piece_batch_and_block_sizes(tmp_path, monkeypatch):
    """Memory flat in the corpus's size: a worker holds one batch of text (and its ids) or one block of a split,
    each at most its bound plus one document, however large the corpus; the parent, 8 bytes per document."""
    monkeypatch.setattr(prep, "PIECE_BYTES", 4000)
    monkeypatch.setattr(prep, "BATCH_BYTES", 2000)
    monkeypatch.setattr(prep, "BLOCK_TOKENS", 3000)
    rng = random.Random(12)
    texts = [words(rng, rng.randint(1, 60)) for _ in range(800)]
    corpus = write_jsonl(tmp_path / "c.jsonl", texts)
    batches, blocks = [], []
    frame, write_block = prep.frame, prep.write_block
    monkeypatch.setattr(prep, "frame", lambda t, texts, d: batches.append(texts) or frame(t, texts, d))
    monkeypatch.setattr(prep, "write_block", lambda *a: blocks.append(a[3]) or write_block(*a))
    meta = data.prepare([corpus], "bytes", tmp_path / "out", workers=1)
    longest = max(len(t.encode()) for t in texts)
    assert corpus.stat().st_size > 50 * 2000 and len(batches) > 30 and len(blocks) > 30
    assert max(sum(len(t.encode()) for t in b) for b in batches) < 2000 + longest
    assert max(lens.sum() for lens in blocks) <= 3000 + longest + 2
    assert sum(lens.sum() for lens in blocks) == sum(s["tokens"] for s in meta["splits"].values())
    pieces, line = prep.plan(corpus, 4000, "text"), max(map(len, corpus.read_bytes().splitlines(keepends=True)))
    assert max(p.stop - p.start for p in pieces) < 4000 + line and pieces[-1].stop == corpus.stat().st_size


def die(*args):
    os._exit(3)  # a worker killed, as the system kills a process for memory


def test_a_worker_that_dies_is_one_error_not_a_wait(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "tokenize_piece", die)  # a forked worker runs it
    corpus = write_jsonl(tmp_path / "c.jsonl", [f"text {i}" for i in range(50)])
    with pytest.raises(InputError, match="a worker process of data.py prepare died .*lower --workers"):
        data.prepare([corpus], "bytes", tmp_path / "out", workers=2)
    assert not (tmp_path / "out").exists()  # nothing half-written left, not even the folder this prepare made


def test_the_worker_count_is_bounded_by_the_cores_and_the_pieces(tmp_path, monkeypatch, capsys):
    """An absurd --workers starts no more processes than the cores this process may use, nor than the pieces of
    its input (a compressed file is one), and says so; the bytes are those of one worker."""
    started, pool = [], prep.ProcessPoolExecutor
    monkeypatch.setattr(prep, "ProcessPoolExecutor", lambda n, *a, **k: started.append(n) or pool(n, *a, **k))
    monkeypatch.setattr(prep, "usable_cores", lambda: 3)
    rng = random.Random(5)
    corpus = write_jsonl(tmp_path / "c.jsonl", [words(rng, 30) for _ in range(400)])
    data.prepare([corpus], "bytes", tmp_path / "one", workers=1)
    capsys.readouterr()
    data.prepare([corpus], "bytes", tmp_path / "many", workers=12)
    assert started == [3] and "--workers=12: 3 worker processes (this process may use 3 cores)\n" in capsys.readouterr().out
    assert folder(tmp_path / "many").keys() == folder(tmp_path / "one").keys()
    assert all(folder(tmp_path / "many")[n] == folder(tmp_path / "one")[n] for n in ("train.bin", "val.bin"))
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(2):
        compress(write_jsonl(shards / f"part-{i}.jsonl", [words(rng, 30) for _ in range(50)]), ".gz")
        (shards / f"part-{i}.jsonl").unlink()
    data.prepare([shards], "bytes", tmp_path / "gz", workers=3)
    assert started == [3, 2] and "--workers=3: 2 worker processes (the input makes 2 pieces)\n" in capsys.readouterr().out


# A prepare whose workers stay busy with their first batch for as long as a test needs: stopped or killed then.
SLOW_PREPARE = """import sys, time
sys.path.insert(0, sys.argv[1])
import data
from machinery import cli, prepare
prepare.frame = lambda *args: time.sleep(600)
cli.run(data.main, sys.argv[2:])
"""


def alive(pid):
    """Whether the process pid runs (a zombie, exited but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def busy_prepare(corpus, out):
    """(the process, its workers) of `data.py prepare --workers 2` into out, once its temporary folder exists and
    both workers are tokenizing."""
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PREPARE, str(ROOT), "prepare", "--input", str(corpus),
                             "--tokenizer", "bytes", "--out", str(out), "--workers", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    deadline = time.time() + 120
    while len(workers := children(proc.pid)) < 2 or not list(out.glob(".prepare-*/piece-*")):
        if proc.poll() is not None or time.time() > deadline:
            gone([proc.pid, *workers], 0)
            pytest.fail(f"the prepare did not start its workers: {proc.communicate()}")
        time.sleep(0.05)
    return proc, workers


def gone(pids, seconds=20):
    """Whether the processes have all ended within `seconds`; those left are killed (by pid) either way."""
    deadline = time.time() + seconds
    while any(map(alive, pids)) and time.time() < deadline:
        time.sleep(0.05)
    left = [p for p in pids if alive(p)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return not left


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["Ctrl-C", "SIGTERM"])
def test_a_stopped_prepare_is_one_line_and_leaves_the_folder_as_it_was(signum, tmp_path):
    """Ctrl-C (the terminal signals the whole group; the workers leave it to the parent) or SIGTERM to the parent,
    while the workers tokenize: one line, the workers ended, and out as it was, its earlier corpus whole."""
    (a, b), _ = two_corpora(tmp_path)
    out = tmp_path / "out"
    data.prepare([a], "bytes", out, workers=1)
    before = folder(out)
    proc, workers = busy_prepare(b, out)
    try:
        if signum == signal.SIGINT:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        _, err = proc.communicate(timeout=120)
    finally:
        assert gone([proc.pid, *workers])
    last = err.rstrip("\n").split("\n")[-1]  # after the progress bar
    assert proc.returncode == 128 + signum and "Traceback" not in err, err
    assert last == f"stopped by {signal.Signals(signum).name}: data.py prepare left no half-written file in {out}"
    assert folder(out) == before


def test_a_killed_prepare_takes_its_workers_and_leaves_the_folder_free(tmp_path):
    """SIGKILL to the parent: its workers die with it and hold no lock, so the next prepare into the folder runs
    (and removes what the killed one left)."""
    (a, b), (ref_a, _) = two_corpora(tmp_path)
    out = tmp_path / "out"
    proc, workers = busy_prepare(b, out)
    proc.kill()
    proc.wait()  # not its output: a worker that outlived it would hold the pipes open
    assert gone(workers), "the workers outlived their parent"
    proc.communicate(timeout=60)
    release_lock(hold_lock(out / ".lock", "the lock is still held"))
    data.prepare([a], "bytes", out, workers=1)
    assert folder(out) == ref_a


def test_parquet_input(tmp_path):
    path = tmp_path / "rows.parquet"
    try:
        import pyarrow
        import pyarrow.parquet as pq
    except ImportError:  # optional dependency: without it the message says what to install
        path.write_bytes(b"PAR1")
        with pytest.raises(InputError, match="rows.parquet: reading .parquet needs pyarrow"):
            data.prepare([path], "bytes", tmp_path / "out")
        return
    pq.write_table(pyarrow.table({"text": ["one", "", "two"], "n": [1, 2, 3]}), path)
    meta = data.prepare([path], "bytes", tmp_path / "out")
    assert meta["sources"][0]["documents"] == 2  # the empty row is skipped
    assert meta["splits"]["train"]["tokens"] + meta["splits"]["val"]["tokens"] == 10
    with pytest.raises(InputError, match="rows.parquet: column 'n' holds int"):
        data.prepare([path], "bytes", tmp_path / "out", field="n")
    with pytest.raises(InputError, match="rows.parquet: no column 'body'"):
        data.prepare([path], "bytes", tmp_path / "out", field="body")


def test_parquet_row_groups_are_pieces(tmp_path, monkeypatch):
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rng = random.Random(13)
    texts = [words(rng, rng.randint(1, 40)) if i % 9 else "" for i in range(300)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "rows.parquet", row_group_size=20)
    write_jsonl(tmp_path / "rows.jsonl", texts)
    monkeypatch.setattr(prep, "PIECE_BYTES", 1000)
    assert len(prep.plan(tmp_path / "rows.parquet", 1000, "text")) > 10
    metas = [data.prepare([tmp_path / name], "bytes", tmp_path / f"{name}-{w}", workers=w, seed=2)
             for name in ("rows.jsonl", "rows.parquet") for w in (1, 3)]
    assert all(without(m, "path", "sha256") == without(metas[0], "path", "sha256") for m in metas)
    for name in ("train.bin", "val.bin"):
        assert len({(tmp_path / f"{f}-{w}" / name).read_bytes() for f in ("rows.jsonl", "rows.parquet")
                    for w in (1, 3)}) == 1


def folder(path):
    """{name: bytes} of the files in a folder, and the names of the others (folders, links)."""
    return {p.name: p.read_bytes() if p.is_file() and not p.is_symlink() else None for p in Path(path).iterdir()}


def prepare_cli(inputs, out, capsys):
    """(exit status, stderr) of `data.py prepare` in this process."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run(data.main, ["prepare", "--input", *map(str, inputs), "--tokenizer", "bytes", "--out", str(out),
                        "--workers", "1"])
        raise SystemExit(0)
    return e.value.code, capsys.readouterr().err


def two_corpora(tmp_path):
    """Two inputs and, prepared one after the other, the folder each gives."""
    rng = random.Random(6)
    inputs = [write_jsonl(tmp_path / f"{name}.jsonl", [words(rng, 60) for _ in range(n)])
              for name, n in (("a", 300), ("b", 500))]
    for path in inputs:
        data.prepare([path], "bytes", tmp_path / f"ref-{path.stem}", workers=1)
    return inputs, [folder(tmp_path / f"ref-{path.stem}") for path in inputs]


def test_a_prepare_into_a_folder_another_prepare_writes_is_refused(tmp_path, capsys):
    (a, b), (ref_a, ref_b) = two_corpora(tmp_path)
    out = tmp_path / "out"
    data.prepare([a], "bytes", out, workers=1)
    running = hold_lock(out / ".lock", "busy")  # what a prepare holds from its first token to its last rename
    code, err = prepare_cli([b], out, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: --out={out}: another data.py prepare is "
                                                                  f"writing there"), err
    release_lock(running)
    assert folder(out) == ref_a  # the running one's corpus, whole: no file of b, no meta.json deleted
    assert prepare_cli([b], out, capsys)[0] == 0
    assert folder(out) == ref_b  # replaced whole once the folder is free


def test_two_prepares_at_once_leave_one_whole_corpus(tmp_path):
    (a, b), refs = two_corpora(tmp_path)
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "data.py"), "prepare", "--input", str(path), "--tokenizer",
                               "bytes", "--out", str(out), "--workers", "1"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
             for path in (a, b)]
    results = [(p.wait(), p.stderr.read()) for p in procs]
    for code, err in results:  # the second to start while the first writes is refused; otherwise both finish
        assert code == 0 or code == 2 and "another data.py prepare is writing there" in err.splitlines()[-1], err
    assert any(code == 0 for code, _ in results) and folder(out) in refs
    data.Loader(out, "train", 64, 4, 2)  # its files match its meta.json


def test_a_killed_prepare_leaves_no_folder_that_looks_prepared_and_is_cleaned_up(tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text("")  # a kill leaves the file, never the lock: the kernel releases it
    for name, files in ((".prepare-4242-0123abcd", ["a.tokens", "train.bin", "meta.json"]),
                        (".prepare-4243-89abcdef", ["val.bin", "notes.txt"])):
        (out / name).mkdir()
        for f in files:
            (out / name / f).write_text("partial")
    seen, tokenize = [], data.tokenize
    monkeypatch.setattr(data, "tokenize", lambda *a: seen.append(a[3]) or tokenize(*a))
    data.prepare([write_jsonl(tmp_path / "c.jsonl", ["one text", "another text"])], "bytes", out, workers=1)
    assert re.fullmatch(rf"\.prepare-{os.getpid()}-[0-9a-f]{{8}}", seen[0].parent.name)  # this process's own name
    assert folder(out).keys() == {"meta.json", "train.bin", "val.bin", ".prepare-4243-89abcdef"}
    assert folder(out / ".prepare-4243-89abcdef") == {"notes.txt": b"partial"}  # not a file a prepare writes
    data.Loader(out, "train", 4, 1, 1)
    # a kill between the first step of the publish (meta.json removed) and its last leaves no meta.json
    original = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (_ for _ in ()).throw(KeyboardInterrupt)
                        if str(dst).endswith("val.bin") else original(src, dst))
    with pytest.raises(KeyboardInterrupt):
        data.prepare([tmp_path / "c.jsonl"], "bytes", out, workers=1)
    with pytest.raises(InputError, match="meta.json: missing"):
        data.load_meta(out)


def test_write_file_uses_a_name_of_its_own(tmp_path, monkeypatch):
    names, original = [], os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: names.append(Path(src).name) or original(src, dst))
    prepare_io.write_file(tmp_path / "tok.json", "{}")
    assert re.fullmatch(rf"\.tok\.json\.tmp-{os.getpid()}-[0-9a-f]{{8}}", names[0])
    assert sorted(os.listdir(tmp_path)) == ["tok.json"]


@pytest.mark.slow  # builds the demo from scratch, as test_train does through train.py
def test_demo_subprocess(tmp_path, demo_corpus):
    """`python data.py` builds data/demo: the docstrings, and a BPE of DEMO_VOCAB ids learned from them. The same
    bytes in any process (the session fixture built the demo in this one, with another hash seed)."""
    proc = subprocess.run([sys.executable, str(ROOT / "data.py")], cwd=tmp_path, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    demo = tmp_path / "data" / "demo"
    meta = data.load_meta(demo)
    assert meta["tokenizer"] == str((demo / "tokenizer.json").resolve()) and meta["vocab_size"] == datacli.DEMO_VOCAB
    assert meta["splits"]["train"]["tokens"] > 400_000 and meta["special_ids"] == [2044, 2045, 2046, 2047]
    for name in ("tokenizer.json", "train.bin", "val.bin"):
        assert (demo / name).read_bytes() == (Path(demo_corpus) / name).read_bytes()
    x, y = data.Loader(demo, seq_len=512, batch_size=8, micro_batch_size=8).next()
    assert x.shape == y.shape == (8, 512)


def test_demo_tokenizer_answers_words(demo_corpus):
    """Fill-mask on the demo predicts one token: with the demo's BPE, the words of the README's example and the
    docstrings' common words are one token each (with the byte tokenizer every token is a character)."""
    tokenizer = data.load_tokenizer(data.load_meta(demo_corpus)["tokenizer"])
    for word in ["Return", " the", " number", " of", " list", " value", " function", " object", " string", " file"]:
        assert len(tokenizer.encode(word)) == 1, word
    ids = tokenizer.encode("Return the [MASK] of the list.")  # [MASK] takes the space before it (lstrip)
    assert ids == [*tokenizer.encode("Return the"), tokenizer.mask_id, *tokenizer.encode(" of the list.")]
    assert len(ids) == 7 and tokenizer.decode(ids) == "Return the[MASK] of the list."


def test_demo_is_rebuilt_for_another_tokenizer(tmp_path, monkeypatch, capsys):
    """A demo is reused only when it was made with the tokenizer asked for; 'bytes' stays available."""
    monkeypatch.setattr(datacli, "DEMO_BYTES", 30_000)  # a few docstrings: seconds
    demo = tmp_path / "demo"
    learned = datacli.prepare_demo(data.prepare, demo, vocab_size=300)
    assert learned["vocab_size"] == 300 and learned["tokenizer"] == str((demo / "tokenizer.json").resolve())
    again = datacli.prepare_demo(data.prepare, demo, vocab_size=300)
    assert again == learned and "already prepared" in capsys.readouterr().out
    as_bytes = datacli.prepare_demo(data.prepare, demo, vocab_size=None)
    assert (as_bytes["tokenizer"], as_bytes["vocab_size"]) == ("bytes", 260)
    assert "building it again" in capsys.readouterr().out
    assert as_bytes["splits"]["train"]["tokens"] > 1.2 * learned["splits"]["train"]["tokens"]  # a token a byte


# ----------------------------------------------------------------------------
# Batches

def loader(path, **kw):
    args = dict(seq_len=1024, batch_size=8, micro_batch_size=4, objective="mlm", mask_rate=0.3)
    return data.Loader(path, **(args | kw))


def test_mlm_mask_statistics(byte_data):
    x, y = loader(byte_data, batch_size=64, micro_batch_size=64).next()
    orig, _ = loader(byte_data, batch_size=64, micro_batch_size=64, objective="clm").next()
    special = orig >= 256
    assert x.dtype == y.dtype == torch.int64 and x.shape == (64, 1024)
    assert (orig == 258).any() and (orig == 256).any()  # [PAD] and [CLS] are in the data, so the test can fail
    chosen = y != -100
    assert not (chosen & special).any()
    assert torch.equal(y[chosen], orig[chosen]) and torch.equal(x[~chosen], orig[~chosen])
    rate = chosen.sum() / (~special).sum()
    assert abs(rate - 0.3) < 0.01  # ~60k candidates: standard error 0.002
    masked = (x == 259) & chosen
    changed = chosen & (x != orig) & ~masked
    n = chosen.sum()
    assert abs(masked.sum() / n - 0.8) < 0.015 and abs(changed.sum() / n - 0.1) < 0.015  # standard error 0.003
    assert abs((chosen & (x == orig)).sum() / n - 0.1) < 0.015
    assert (x[changed] < 256).all()  # random replacements are never special tokens


def test_the_ids_this_code_frames_with_are_never_masked_even_unflagged():
    """A tokenizer.json whose [CLS], [SEP], [PAD] or [MASK] is not flagged special (a plain vocabulary entry): MLM
    still never chooses them, nor draws them as a random replacement."""
    meta = dict(vocab_size=16, cls_id=12, sep_id=13, pad_id=14, mask_id=15, special_ids=[])
    vocab = data.Vocab(meta)
    x = np.tile(np.arange(16), (64, 4))  # (64, 64): every id, many times
    masked, labels = data.mlm_labels(x, np.arange(64), vocab, 0.9, seed=0)
    framing = np.isin(x, [12, 13, 14, 15])
    assert (labels[framing] == -100).all() and (masked[framing] == x[framing]).all()
    assert set(vocab.replacements) == set(range(12)) and (labels[~framing] != -100).mean() > 0.8


def test_a_token_the_tokenizer_flags_special_is_never_masked():
    """A token tokenizer.json flags special besides the four this code frames with (ModernBERT's [UNK] and
    <|endoftext|>): MLM never chooses it, nor draws it as a random replacement."""
    meta = dict(vocab_size=16, cls_id=12, sep_id=13, pad_id=14, mask_id=15, special_ids=[3, 7, 12, 13, 14, 15])
    x = np.tile(np.arange(16), (64, 4))  # (64, 64): every id, many times
    masked, labels = data.mlm_labels(x, np.arange(64), data.Vocab(meta), 0.9, seed=0)
    flagged = np.isin(x, [3, 7])
    assert (labels[flagged] == -100).all() and (masked[flagged] == x[flagged]).all()
    assert not np.isin(masked[labels != -100], [3, 7]).any() and (labels[x < 3] != -100).mean() > 0.8


def test_clm_labels(byte_data):
    x, y = loader(byte_data, objective="clm").next()
    assert (y[:, -1] == -100).all() and (x == 257).any()
    expected = torch.where(x[:, :-1] == 257, -100, x[:, 1:])
    assert torch.equal(y[:, :-1], expected)


def test_lookahead_keeps_the_saved_position(byte_data):
    """prefetch() prepares the following micro-batch ahead, yet each batch is the one its position names and
    state_dict() is the position of the batch the next next() returns: a checkpoint after any step resumes
    exactly, with nothing for the training loop to remember."""
    ahead, direct = loader(byte_data), loader(byte_data)  # 4 sequences a micro-batch, accum 2
    for step in range(3):
        for k in range(2):
            x, y = ahead.next()
            ahead.prefetch()
            expected = direct.batch(np.arange(8 * step + 4 * k, 8 * step + 4 * k + 4))
            assert torch.equal(x, expected[0]) and torch.equal(y, expected[1])
        assert ahead.ahead is not None and ahead.state_dict()["sequence"] == 8 * (step + 1)
        resumed = loader(byte_data)
        resumed.load_state_dict(json.loads(json.dumps(ahead.state_dict())))
        following = direct.batch(np.arange(8 * step + 8, 8 * step + 12))
        assert all(torch.equal(u, v) for u, v in zip(resumed.next(), following))
    on_cpu = loader(byte_data, device="cpu")
    assert all(torch.equal(u, v) for u, v in zip(on_cpu.next(), loader(byte_data).next()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_lookahead_on_cuda(byte_data):
    """With a CUDA device the ids arrive there (copied from pinned memory), the labels stay on the host."""
    on_gpu, on_cpu = loader(byte_data, device="cuda"), loader(byte_data)
    for _ in range(6):  # three optimizer steps of 2 micro-batches: state_dict() is read at a step's boundary
        (x, y), (cx, cy) = on_gpu.next(), on_cpu.next()
        on_gpu.prefetch()
        assert x.device.type == "cuda" and y.device.type == "cpu"
        assert torch.equal(x.cpu(), cx) and torch.equal(y, cy)
    assert on_gpu.state_dict() == on_cpu.state_dict()


def test_objectives_table(byte_data):
    assert list(data.OBJECTIVES) == ["mlm", "clm"]
    with pytest.raises(InputError, match="objective 'span': expected one of mlm, clm"):
        loader(byte_data, objective="span")


def test_masking_rate_schedule_is_one_function(byte_data, monkeypatch):
    """A masking rate that grows with the sequence index is one function and one table entry; its batches
    are rebuilt exactly from the saved position."""
    def mlm_ramp(x, g, vocab, rate, seed):  # rate * g / 32, up to rate
        return data.mlm_labels(x, g, vocab, rate * np.minimum(1.0, g / 32), seed)
    monkeypatch.setitem(data.OBJECTIVES, "mlm_ramp", data.Objective(mlm_ramp, causal=False, masked=True))
    ramp = loader(byte_data, objective="mlm_ramp", batch_size=16, micro_batch_size=16)
    x, y = (torch.cat(t) for t in zip(*[ramp.next() for _ in range(4)]))  # sequences 0..63
    maskable = torch.where(y == -100, x, y) < 256  # the original tokens that are not special
    rate = (y != -100).sum(1) / maskable.sum(1)
    expected = 0.3 * torch.clamp(torch.arange(64) / 32, max=1.0)
    assert rate[0] == 0 and torch.allclose(rate.view(8, 8).mean(1), expected.view(8, 8).mean(1), atol=0.015)
    state = ramp.state_dict()
    fresh = loader(byte_data, objective="mlm_ramp", batch_size=16, micro_batch_size=16)
    fresh.load_state_dict(state)
    assert all(torch.equal(u, v) for u, v in zip(fresh.next(), ramp.next()))


def test_same_seeds_same_batches_and_resume(byte_data):
    a, b = loader(byte_data), loader(byte_data)
    for _ in range(3):  # accum is 2: this leaves the loaders in the middle of step 1
        assert all(torch.equal(u, v) for u, v in zip(a.next(), b.next()))
    with pytest.raises(AssertionError):
        a.state_dict()
    a.next()
    state = json.loads(json.dumps(a.state_dict()))
    assert state["sequence"] == 2 * 8
    expected = [a.next() for _ in range(6)]
    resumed = loader(byte_data)
    resumed.load_state_dict(state)
    assert all(torch.equal(u, v) for e in expected for u, v in zip(e, resumed.next()))
    with pytest.raises(InputError, match="data_seed"):
        loader(byte_data, data_seed=0).load_state_dict(state)


def test_step_is_the_same_set_for_any_world_size(byte_data):
    one_by_one = loader(byte_data, batch_size=1, micro_batch_size=1)
    reference = [one_by_one.next() for _ in range(24)]  # global sequences 0..23, masks included
    single = loader(byte_data, batch_size=8, micro_batch_size=4)  # accum 2
    ranks = [loader(byte_data, batch_size=8, micro_batch_size=2, rank=r, world_size=2) for r in range(2)]  # accum 2
    assert (single.accum, ranks[0].accum) == (2, 2)
    runs = [(ranks[0], 0, 2), (ranks[1], 1, 2), (single, 0, 1)]  # (loader, rank, world size)
    for step in range(3):
        for k in range(2):  # micro-step k on rank r takes g0 + (k * world_size + r) * micro_batch_size + [0, mbs)
            for ld, rank, world_size in runs:
                for j, (x, y) in enumerate(zip(*ld.next())):
                    g = 8 * step + (k * world_size + rank) * ld.micro_batch_size + j
                    assert torch.equal(x, reference[g][0][0]) and torch.equal(y, reference[g][1][0])


@pytest.mark.parametrize("world_size, micro", [(2, 4), (4, 1), (4, 2)])
def test_a_position_resumes_on_another_number_of_processes_and_micro_batch(byte_data, world_size, micro):
    """A checkpoint of one process in micro-batches of 4 goes on, on 2 or 4 processes in other micro-batches, with
    the steps the single process would have taken: the ranks' micro-batches, in global order, are its batches."""
    single = loader(byte_data)  # batch 8 = 4 micro x accumulation 2
    for _ in range(2 * 3):
        single.next()
        single.prefetch()
    state = json.loads(json.dumps(single.state_dict()))
    expected = [torch.cat(t) for t in zip(*[single.next() for _ in range(2 * 2)])]  # the next 2 steps, in order
    ranks = [loader(byte_data, micro_batch_size=micro, rank=r, world_size=world_size) for r in range(world_size)]
    for ld in ranks:
        ld.load_state_dict(state)
    accum = ranks[0].accum
    got = [[ld.next() for _ in range(2 * accum)] for ld in ranks]  # got[rank][micro-step]
    in_order = [got[r][k] for k in range(2 * accum) for r in range(world_size)]  # global order: micro-step, rank
    assert all(torch.equal(u, v) for u, v in zip(expected, (torch.cat(t) for t in zip(*in_order))))
    assert [ld.state_dict()["sequence"] for ld in ranks] == [state["sequence"] + 2 * 8] * world_size


def test_mlm_twin_sees_the_same_windows(byte_data):
    clm, mlm_a, mlm_b = (loader(byte_data, **kw) for kw in ({"objective": "clm"}, {"mask_seed": 17}, {"mask_seed": 18}))
    for _ in range(4):
        orig, (xa, ya), (xb, yb) = clm.next()[0], mlm_a.next(), mlm_b.next()
        assert torch.equal(torch.where(ya == -100, xa, ya), orig) and torch.equal(torch.where(yb == -100, xb, yb), orig)
        assert not torch.equal(ya, yb)


def test_epoch_wrap_follows_the_permutation_formula(byte_data):
    meta = data.load_meta(byte_data)
    seq_len = meta["splits"]["val"]["tokens"] // 5  # 5 windows in val.bin
    tokens = np.fromfile(byte_data / "val.bin", dtype=np.uint16)
    wrap = loader(byte_data, split="val", seq_len=seq_len, batch_size=2, micro_batch_size=2, objective="clm")
    assert wrap.n_windows == 5
    seen = torch.cat([wrap.next()[0] for _ in range(6)])  # sequences 0..11: two full epochs and a bit
    for g in range(12):
        w = np.random.default_rng([42, g // 5]).permutation(5)[g % 5]
        assert torch.equal(seen[g], torch.from_numpy(tokens[w * seq_len:(w + 1) * seq_len].astype(np.int64)))


def test_val_batches_are_fixed_and_in_file_order(byte_data):
    first = list(data.val_batches(byte_data, 256, 10, 4, "mlm", mask_rate=0.15))
    again = list(data.val_batches(byte_data, 256, 10, 4, "mlm", mask_rate=0.15))
    assert [b[0].shape[0] for b in first] == [4, 4, 2]
    assert all(torch.equal(u, v) for a, b in zip(first, again) for u, v in zip(a, b))
    x = torch.cat([b[0] for b in data.val_batches(byte_data, 256, 10, 4, "clm")])
    tokens = torch.from_numpy(np.fromfile(byte_data / "val.bin", dtype=np.uint16)[:2560].astype(np.int64))
    assert torch.equal(x, tokens.view(10, 256))


def test_document_ids():
    x = torch.tensor([[256, 1, 257, 256, 2, 3, 257, 256], [5, 257, 257, 256, 7, 7, 7, 7]])
    ids = data.document_ids(x, 257)
    assert ids.dtype == torch.int32
    assert ids.tolist() == [[0, 0, 0, 1, 1, 1, 1, 2], [0, 0, 1, 2, 2, 2, 2, 2]]


# ----------------------------------------------------------------------------
# Bad inputs stop with a message naming the file and what was expected

@pytest.mark.parametrize("name, content, expected", [
    ("empty.jsonl", b"", ["empty.jsonl", "no documents"]),
    ("blank.jsonl", b'{"text": ""}\n{"text": "  "}\n', ["blank.jsonl", "no documents"]),
    ("broken.jsonl", b'{"text": "a"}\n\n{"text": "b"\n', ["broken.jsonl:3", "JSON object"]),
    ("nofield.jsonl", b'{"text": "a"}\n{"body": "b"}\n', ["nofield.jsonl:2", "'text'"]),
    ("number.jsonl", b'{"text": "a"}\n{"text": 5}\n', ["number.jsonl:2", "int", "string"]),
    ("latin1.jsonl", b'{"text": "a"}\n{"text": "caf\xe9"}\n', ["latin1.jsonl:2", "invalid UTF-8"]),
    ("latin1.txt", b"fine\n\ncaf\xe9\n", ["latin1.txt:3", "invalid UTF-8"]),
    ("table.csv", b"text\na\n", ["table.csv", ".jsonl, .txt or .parquet"]),
])
def test_bad_corpus(tmp_path, name, content, expected):
    (tmp_path / name).write_bytes(content)
    with pytest.raises(InputError) as e:
        data.prepare([tmp_path / name], "bytes", tmp_path / "out")
    assert all(w in str(e.value) for w in expected), str(e.value)
    assert not any((tmp_path / "out").glob("*"))  # nothing half-written (a format refused before out is made)


def test_missing_files(tmp_path):
    with pytest.raises(InputError, match="nope.jsonl: input file not found"):
        data.prepare([tmp_path / "nope.jsonl"], "bytes", tmp_path / "out")
    with pytest.raises(InputError, match="meta.json: missing"):
        data.load_meta(tmp_path)
    (tmp_path / "meta.json").write_text("{not json")
    with pytest.raises(InputError, match="meta.json: not valid JSON"):
        data.load_meta(tmp_path)
    with pytest.raises(InputError, match="nope.json: missing .expected a tokenizer.json, a hub id, or 'bytes'"):
        data.load_tokenizer(tmp_path / "nope.json")


def test_every_id_a_batch_holds_is_below_the_vocabulary(byte_data, tmp_path):
    """The open reads a sample of ids; an id above the vocabulary anywhere else stops the batch that holds it,
    naming the file and its tokens. (The table of damaged files is in test_data_inputs.py.)"""
    bad = tmp_path / "bad"
    shutil.copytree(byte_data, bad)
    tokens = np.fromfile(bad / "train.bin", dtype=np.uint16)
    sampled = set(tokenfiles.sample_positions(len(tokens)).tolist())
    at = next(p for p in range(len(tokens) // 2, len(tokens)) if p not in sampled)
    tokens[at] = 260  # the vocabulary's size: the smallest id outside it
    tokens.tofile(bad / "train.bin")
    ordered = loader(bad, data_seed=None)  # file order: window w holds tokens [1024 w, 1024 (w + 1))
    with pytest.raises(InputError) as e:
        for _ in range(ordered.n_windows):
            ordered.next()
    start = at // 1024 * 1024
    assert str(e.value) == f"{bad / 'train.bin'}: id 260 in tokens {start} to {start + 1023}, above the vocabulary " \
                           f"of 260 (a file of another tokenizer or dtype?)"
    assert ordered.sequence == start // 1024 // 8 * 8  # the batches before it were served
    with pytest.raises(InputError, match=r"val.bin: seq_len 1000000 is longer than the data \(\d+ tokens\)"):
        loader(byte_data, split="val", seq_len=1_000_000)


def test_the_open_reads_a_large_files_last_tokens_whole(byte_data, tmp_path):
    """A file's end (where a copy cut short and padded, or another tokenizer's tail, shows) is read whole at the open,
    its last 8192 tokens: a bad id there stops the run before any step."""
    bad = tmp_path / "bad"
    shutil.copytree(byte_data, bad)
    tokens = np.fromfile(bad / "train.bin", dtype=np.uint16)
    assert len(tokens) > 20 * 8192  # the seeded spread of 4096 positions alone would likely miss it
    tokens[-8192] = 260
    tokens.tofile(bad / "train.bin")
    with pytest.raises(InputError, match=rf"ids up to 260 at sample positions \(the first at token {len(tokens) - 8192}\)"):
        data.count_windows(bad, "train", 1024)


@pytest.mark.parametrize("change, expected", [
    (lambda d: os.truncate(d / "train.bin", 1000), r"train.bin: no longer holds its \d+ tokens: it was cut"),
    (lambda d: shutil.copy(d / "val.bin", d / "train.bin"), r"train.bin: no longer holds its \d+ tokens"),
    (lambda d: shutil.copy(d / "train.bin", d / "new.bin") and os.replace(d / "new.bin", d / "train.bin"),
     r"train.bin: replaced after this run checked it"),
    (lambda d: np.random.default_rng(0).permutation(np.fromfile(d / "train.bin", np.uint16)).tofile(d / "train.bin"),
     r"train.bin: written to after this run checked it: its windows may not be the ones checked"),
], ids=["cut", "overwritten shorter", "replaced", "overwritten in place, the same size"])
def test_a_token_file_changed_during_a_run_stops_the_next_batch(byte_data, tmp_path, change, expected):
    d = tmp_path / "d"
    shutil.copytree(byte_data, d)
    running = loader(d)
    running.next()
    change(d)
    with pytest.raises(InputError, match=expected):
        for _ in range(running.n_windows):  # a cut may spare the first windows
            running.next()


def test_tokenizer_mismatch(byte_data, trained):
    meta = data.load_meta(byte_data)
    data.check_tokenizer(meta, data.load_tokenizer("bytes"))
    with pytest.raises(InputError) as e:
        data.check_tokenizer(meta, data.load_tokenizer(trained[0]))
    assert all(w in str(e.value) for w in ["bytes", "tokenizer.json", "fingerprint"]), str(e.value)


def test_cli_error_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "data.py"), "prepare", "--input", str(tmp_path / "gone.txt"),
                          "--tokenizer", "bytes", "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "gone.txt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_docstrings_command_writes_general_text(tmp_path, capsys):
    out = tmp_path / "general.jsonl"
    data.main(["docstrings", "--out", str(out), "--max_bytes", "20000"])
    texts = [json.loads(line)["text"] for line in out.read_text(encoding="utf-8").splitlines()]
    size = sum(len(t.encode()) for t in texts)
    assert size >= 20000 and size - len(texts[-1].encode()) < 20000  # stops at the first docstring past the limit
    with pytest.raises(SystemExit) as exit_info:
        run(data.main, ["docstrings", "--out", str(out), "--max_bytes", "0"])
    assert exit_info.value.code == 2 and "--max_bytes=0" in capsys.readouterr().err



def test_code_command_writes_functions_without_docstrings_and_holds_modules_out(tmp_path, capsys, monkeypatch):
    """`data.py code`: the standard library's top-level functions and classes, one a line, with every docstring
    cut out (code, not the docstrings the demo's start model learnt); the held-out modules' texts in their own file,
    never in the training one; the same bytes at every call; the two files must differ."""
    monkeypatch.setattr(prep, "HELD_OUT_EVERY", 2)  # one module in 2: some are held out within the first 60 kB
    out, heldout = tmp_path / "code.jsonl", tmp_path / "code-heldout.jsonl"
    data.main(["code", "--out", str(out), "--heldout", str(heldout), "--max_bytes", "60000"])
    assert f"{out}: " in capsys.readouterr().out
    texts = {path: [json.loads(line)["text"] for line in path.read_text(encoding="utf-8").splitlines()]
             for path in (out, heldout)}
    size = sum(len(t.encode()) for t in texts[out])
    assert size >= 60000 and size - len(texts[out][-1].encode()) < 60000
    assert texts[heldout] and all(re.match(r"(@|def |async def |class )", t) for t in texts[out])
    assert not set(texts[out]) & set(texts[heldout])
    wanted, module_of, docstrings = set(texts[out] + texts[heldout]), {}, []
    for module, source, tree in prep.stdlib_modules():  # the modules the texts came from, and their docstrings
        module_of.update({text: module for text in prep.module_code(source, tree) if text in wanted})
        docstrings += [ast.get_docstring(node, clean=False) for node in ast.walk(tree)
                       if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
        if module_of.keys() == wanted:
            break
    assert not any(prep.is_held_out(module_of[t]) for t in texts[out])
    assert all(prep.is_held_out(module_of[t]) for t in texts[heldout])
    docstrings = [d for d in docstrings if d and "\n" in d]  # several lines: in the source as they are
    every = "\n".join(wanted)
    assert len(docstrings) > 20 and not [d for d in docstrings if d in every]  # methods' and classes' too
    first = out.read_bytes(), heldout.read_bytes()
    data.main(["code", "--out", str(out), "--heldout", str(heldout), "--max_bytes", "60000"])
    assert (out.read_bytes(), heldout.read_bytes()) == first
    with pytest.raises(SystemExit) as exit_info:
        run(data.main, ["code", "--out", str(out), "--heldout", str(out)])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--out" in err and "--heldout" in err and err.count("\n") == 1
