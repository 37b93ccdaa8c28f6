"""data.py bad inputs, table-driven: each ends in exit code 2 and ONE line `error: ...` naming the flag or file,
before any tokenizing; meta.json and tokenizer.json are checked for structure and id range before any allocation;
a loader state read from a checkpoint is checked field by field; a real full disk leaves nothing behind."""
import json
import os

import pytest
import torch

import data
from machinery.cli import InputError, run
from machinery.tokenizer import bytes_config


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def with_flags(argv, extra):
    """argv with the flags that extra names replaced by extra's (a flag may be given once), the rest appended."""
    named = {a for a in extra if str(a).startswith("--")}
    kept, skipping = [], False
    for a in argv:
        if str(a).startswith("--"):
            skipping = a in named
        if not skipping:
            kept.append(a)
    return kept + list(extra)


def run_cli(argv, capsys):
    """(exit code, stderr) of data.main(argv), in process: the subprocess path is tested in test_data.py."""
    with pytest.raises(SystemExit) as e:
        run(data.main, [str(a) for a in argv])
    return e.value.code, capsys.readouterr().err


def byte_tokenizer_with(edit):
    """A function of the tmp dir writing odd.json: the byte tokenizer's tokenizer.json after edit(config)."""
    def build(tmp):
        config = bytes_config()
        config = edit(config) or config
        (tmp / "odd.json").write_text(json.dumps(config))
        return tmp / "odd.json"
    return build


def not_a_tokenizer(config):
    return byte_tokenizer_with(lambda _: config)


def read_only_dir(tmp):
    """A directory this process cannot write to: chmod is no obstacle to root, sysfs is."""
    if os.geteuid() == 0:
        return "/sys"
    (tmp / "ro").mkdir()
    (tmp / "ro").chmod(0o555)
    return tmp / "ro"


GOOD = ["--tokenizer", "bytes"]
# (case, extra argv given the tmp dir, the words the one error line must contain)
CASES = [
    ("val_fraction 0", lambda t: ["--val_fraction", "0"], ["--val_fraction=0.0", "(0, 1)"]),
    ("val_fraction negative", lambda t: ["--val_fraction", "-0.1"], ["--val_fraction=-0.1"]),
    ("val_fraction NaN", lambda t: ["--val_fraction", "nan"], ["--val_fraction=nan"]),
    ("val_fraction 1", lambda t: ["--val_fraction", "1"], ["--val_fraction=1.0"]),
    ("val_fraction above 1", lambda t: ["--val_fraction", "1.5"], ["--val_fraction=1.5"]),
    ("val_fraction not a number", lambda t: ["--val_fraction", "half"], ["--val_fraction", "half"]),
    ("one-document input", lambda t: ["--input", write_jsonl(t / "one.jsonl", ["only document"])],
     ["--input", "one.jsonl has 1 document", "validation split is empty"]),
    ("one huge line", lambda t: ["--input", t / "line.txt"],
     ["--input", "line.txt has 1 document", "validation split is empty"]),
    ("out is a file", lambda t: ["--out", t / "corpus.jsonl"], ["--out=", "corpus.jsonl", "is a file"]),
    ("out under a file", lambda t: ["--out", t / "corpus.jsonl" / "sub"], ["--out=", "cannot write"]),
    ("out read-only", lambda t: ["--out", read_only_dir(t)], ["--out=", "cannot write"]),
    ("tokenizer: JSON list", lambda t: ["--tokenizer", not_a_tokenizer([1, 2])(t)], ["odd.json", "'model'"]),
    ("tokenizer: no model", lambda t: ["--tokenizer", not_a_tokenizer({"name": "x"})(t)], ["odd.json", "'model'"]),
    ("tokenizer: no vocab", lambda t: ["--tokenizer", not_a_tokenizer({"model": {"type": "BPE"}})(t)],
     ["odd.json", "model.vocab"]),
    ("tokenizer: vocab a list", lambda t: ["--tokenizer", not_a_tokenizer({"model": {"vocab": ["a"]}})(t)],
     ["odd.json", "model.vocab"]),
    ("tokenizer: merges not pairs", lambda t: ["--tokenizer", byte_tokenizer_with(
        lambda c: c["model"].update(merges=[["a", "b", "c"]]))(t)], ["odd.json", "model.merges"]),
    ("tokenizer: added token id 4e9", lambda t: ["--tokenizer", byte_tokenizer_with(
        lambda c: c["added_tokens"][3].update(id=4e9))(t)], ["odd.json", "added_tokens", "integer id"]),
    ("tokenizer: added token id 4000000000", lambda t: ["--tokenizer", byte_tokenizer_with(
        lambda c: c["added_tokens"][3].update(id=4_000_000_000))(t)], ["odd.json", "4000000000", "[0, 16777216)"]),
    ("tokenizer: vocab id 4000000000", lambda t: ["--tokenizer", byte_tokenizer_with(
        lambda c: c["model"]["vocab"].update(a=4_000_000_000))(t)], ["odd.json", "4000000000"]),
    ("tokenizer: holes", lambda t: ["--tokenizer", byte_tokenizer_with(
        lambda c: c["added_tokens"][3].update(id=1_000_000))(t)], ["odd.json", "holes larger than the vocabulary"]),
    ("tokenizer: added token without flags", lambda t: ["--tokenizer", byte_tokenizer_with(
        lambda c: c["added_tokens"][0].pop("normalized"))(t)], ["odd.json", "normalized"]),
    ("tokenizer: normalizer a string", lambda t: ["--tokenizer", byte_tokenizer_with(
        lambda c: c.update(normalizer="NFC"))(t)], ["odd.json", "normalizer"]),
    ("mix NaN", lambda t: ["--mix", "corpus=nan"], ["--mix", "finite"]),
    ("mix inf", lambda t: ["--mix", "corpus=inf"], ["--mix", "finite"]),
    ("mix negative", lambda t: ["--mix", "corpus=-1"], ["--mix", ">= 0"]),
    ("mix unknown source", lambda t: ["--mix", "other=1"], ["--mix", "other", "corpus"]),
    ("mix syntax", lambda t: ["--mix", "corpus"], ["--mix", "name=weight"]),
    ("workers 0", lambda t: ["--workers", "0"], ["--workers=0", ">= 1"]),
    ("workers negative", lambda t: ["--workers", "-2"], ["--workers=-2"]),
    ("seed negative", lambda t: ["--seed", "-1"], ["--seed=-1"]),
    ("unknown flag", lambda t: ["--vocab", "5"], ["unrecognized arguments", "--vocab"]),
    # inputs, flags and tokenizer files
    ("input is a folder", lambda t: ["--input", t], ["a folder; expected a text file"]),
    ("two inputs, one stem", lambda t: ["--input", t / "corpus.jsonl", raw(t, "corpus.txt", b"a\n\nb\n")],
     ["--input", "distinct file names"]),
    ("flag given twice", lambda t: ["--seed", "1", "--seed", "2"], ["--seed", "given twice"]),
    ("seed not an integer", lambda t: ["--seed", "1.5"], ["--seed", "1.5"]),
    ("mix weight 1e400", lambda t: ["--mix", "corpus=1e400"], ["--mix", "finite"]),
    ("mix empty", lambda t: ["--mix", ""], ["--mix", "name=weight"]),
    ("tokenizer is a folder", lambda t: ["--tokenizer", t], ["cannot read it"]),
    ("tokenizer not UTF-8", lambda t: ["--tokenizer", raw(t, "t.json", b'{"model": "\xff"}')],
     ["t.json", "not valid JSON"]),
    ("tokenizer nested 100000 deep", lambda t: ["--tokenizer", raw(t, "t.json", b"[" * 100_000 + b"]" * 100_000)],
     ["t.json", "not valid JSON"]),
    ("tokenizer vocab id a bool", lambda t: ["--tokenizer", byte_tokenizer_with(
        lambda c: c["model"]["vocab"].update(a=True))(t)], ["odd.json", "model.vocab"]),
]

# texts that JSON or a file allows and Unicode text does not: (case, input file, its bytes, words of the error)
BAD_TEXTS = [
    ("jsonl lone high surrogate", "s.jsonl", b'{"text": "a"}\n{"text": "x \\ud800"}\n',
     ["s.jsonl:2", "lone surrogate", "'\\ud800' at character 2"]),
    ("jsonl lone low surrogate", "s.jsonl", b'{"text": "\\udc80 tail"}\n', ["s.jsonl:1", "lone surrogate"]),
    ("jsonl reversed surrogate pair", "s.jsonl", b'{"text": "\\ude00\\ud83d"}\n', ["s.jsonl:1", "lone surrogate"]),
    ("jsonl byte 0xff", "b.jsonl", b'{"text": "a"}\n{"text": "\xff"}\n', ["b.jsonl:2", "invalid start byte"]),
    ("jsonl cut inside a character", "b.jsonl", b'{"text": "a"}\n{"text": "caf\xc3', ["b.jsonl:2", "invalid UTF-8"]),
    ("jsonl encoded surrogate", "b.jsonl", b'{"text": "\xed\xa0\x80"}\n', ["b.jsonl:1", "invalid UTF-8"]),
    ("txt UTF-16", "w.txt", "two\n\ndocuments\n".encode("utf-16"), ["w.txt:1", "invalid UTF-8"]),
    ("jsonl nested 100000 deep", "d.jsonl", b"[" * 100_000 + b"]" * 100_000, ["d.jsonl:1", "JSON object"]),
    ("jsonl text null", "n.jsonl", b'{"text": null}\n', ["n.jsonl:1", "NoneType"]),
    ("jsonl text NaN", "n.jsonl", b'{"text": NaN}\n', ["n.jsonl:1", "float"]),
    ("jsonl a bare string", "n.jsonl", b'"text"\n', ["n.jsonl:1", "JSON object"]),
]
CASES += [(case, lambda t, name=name, content=content: ["--input", raw(t, name, content)], expected)
          for case, name, content, expected in BAD_TEXTS]


def raw(tmp, name, content):
    """tmp/name holding exactly these bytes."""
    (tmp / name).write_bytes(content)
    return tmp / name


@pytest.mark.parametrize("case, extra, expected", CASES, ids=[c[0] for c in CASES])
def test_prepare_bad_input(case, extra, expected, tmp_path, capsys):
    write_jsonl(tmp_path / "corpus.jsonl", [f"document number {i}" for i in range(20)])
    (tmp_path / "line.txt").write_text("word " * 400_000 + "\n")  # one 2 MB line: a single document
    argv = with_flags(["prepare", "--input", tmp_path / "corpus.jsonl", "--out", tmp_path / "out", *GOOD],
                      extra(tmp_path))
    code, err = run_cli(argv, capsys)
    lines = err.rstrip("\n").split("\n")  # before the error there may be a progress bar, nothing else
    assert code == 2 and lines[-1].startswith("error: ") and err.count("error") == 1, err
    assert "Traceback" not in err and all(w in lines[-1] for w in expected), err
    assert not (tmp_path / "out" / "meta.json").exists()


def test_prepare_good_input_passes_the_same_checks(tmp_path, capsys):
    """The table's base command is valid, so every failure above is due to its one changed flag."""
    write_jsonl(tmp_path / "corpus.jsonl", [f"document number {i}" for i in range(20)])
    data.main(["prepare", "--input", str(tmp_path / "corpus.jsonl"), "--out", str(tmp_path / "out"), *GOOD,
               "--workers", "1", "--val_fraction", "0.1"])
    assert data.load_meta(tmp_path / "out")["splits"]["val"]["documents"] == 2


TOKENIZER_CASES = [
    ("vocab_size 0", lambda t: ["--vocab_size", "0"], ["--vocab_size=0", "[261, 16777216]"]),
    ("vocab_size without merges", lambda t: ["--vocab_size", "260"], ["--vocab_size=260"]),
    ("vocab_size 2**30", lambda t: ["--vocab_size", str(2 ** 30)], ["--vocab_size=1073741824"]),
    ("vocab_size not a number", lambda t: ["--vocab_size", "8k"], ["--vocab_size", "8k"]),
    ("out a directory", lambda t: ["--out", t], ["--out=", ".json file"]),
    ("out not .json", lambda t: ["--out", t / "tok.txt"], ["--out=", "tok.txt", ".json file"]),
    ("out under a file", lambda t: ["--out", t / "corpus.jsonl" / "tok.json"], ["--out=", "cannot write"]),
    ("out read-only", lambda t: ["--out", f"{read_only_dir(t)}/tok.json"], ["--out=", "cannot write"]),
    ("input missing", lambda t: ["--input", t / "gone.jsonl"], ["gone.jsonl", "not found"]),
    ("input unreadable", lambda t: ["--input", t / "line.txt", t / "bad.jsonl"], ["bad.jsonl:1", "JSON object"]),
]


@pytest.mark.parametrize("case, extra, expected", TOKENIZER_CASES, ids=[c[0] for c in TOKENIZER_CASES])
def test_tokenizer_bad_input(case, extra, expected, tmp_path, capsys):
    write_jsonl(tmp_path / "corpus.jsonl", ["some text", "more text"])
    (tmp_path / "line.txt").write_text("a line\n")
    (tmp_path / "bad.jsonl").write_text("[1]\n")
    argv = with_flags(["tokenizer", "--input", tmp_path / "corpus.jsonl", "--vocab_size", "300", "--out",
                       tmp_path / "t.json"], extra(tmp_path))
    code, err = run_cli(argv, capsys)
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and all(w in err for w in expected), err
    assert not (tmp_path / "t.json").exists()


# ----------------------------------------------------------------------------
# meta.json: structure, dtype and ids, all named as meta.json errors

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("meta")
    data.prepare([write_jsonl(tmp / "c.jsonl", [f"text {i} " * 50 for i in range(40)])], "bytes", tmp / "d",
                 val_fraction=0.1)
    return tmp / "d"


META_CASES = [
    ("float16 dtype", lambda m: m.update(dtype="float16"), "dtype uint16 or uint32"),
    ("int64 dtype", lambda m: m.update(dtype="int64"), "dtype uint16 or uint32"),
    ("uint16 for a large vocabulary", lambda m: m.update(vocab_size=70_000), "dtype uint32 for vocab_size 70000"),
    ("vocab_size 4e9", lambda m: m.update(vocab_size=4e9), "vocab_size an integer"),
    ("vocab_size 2**30", lambda m: m.update(vocab_size=2 ** 30, dtype="uint32"), "vocab_size an integer"),
    ("vocab_size 0", lambda m: m.update(vocab_size=0), "vocab_size an integer"),
    ("no pad_id", lambda m: m.pop("pad_id"), "needs keys"),
    ("no cls_id", lambda m: m.pop("cls_id"), "needs keys"),
    ("no splits", lambda m: m.pop("splits"), "needs keys"),
    ("mask_id beyond the vocabulary", lambda m: m.update(mask_id=10 ** 6), "below vocab_size 260"),
    ("negative sep_id", lambda m: m.update(sep_id=-1), "below vocab_size 260"),
    ("special id beyond the vocabulary", lambda m: m["special_ids"].append(260), "below vocab_size 260"),
    ("special_ids not a list", lambda m: m.update(special_ids=5), "special_ids"),
    ("tokenizer not a string", lambda m: m.update(tokenizer=None), "tokenizer strings"),
    ("not an object", lambda m: m.clear(), "needs keys"),
]


@pytest.mark.parametrize("case, edit, expected", META_CASES, ids=[c[0] for c in META_CASES])
def test_bad_meta(case, edit, expected, prepared, tmp_path):
    meta = json.loads((prepared / "meta.json").read_text())
    edit(meta)
    (tmp_path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(InputError) as e:
        data.load_meta(tmp_path)
    assert "meta.json" in str(e.value) and expected in str(e.value), str(e.value)


def test_count_windows_is_the_loaders(prepared):
    n = data.load_meta(prepared)["splits"]["val"]["tokens"]
    for seq_len in (1, 7, 64, n // 2, n):
        windows = data.count_windows(prepared, "val", seq_len)
        assert windows == n // seq_len == data.Loader(prepared, "val", seq_len, 1, 1).n_windows
    assert data.count_windows(prepared, "val", n + 1) == 0
    with pytest.raises(InputError, match="seq_len"):
        data.count_windows(prepared, "val", 0)
    with pytest.raises(InputError, match="test.bin: not found"):
        data.count_windows(prepared, "test", 8)


# ----------------------------------------------------------------------------
# A loader state comes from a checkpoint's state.json: every field is checked before it is used

def changed(**fields):
    return lambda state: {**state, **fields}


def without(key):
    return lambda state: {k: v for k, v in state.items() if k != key}


LOADER_STATE_CASES = [
    ("not an object", lambda s: [1, 2], "expected an object, got list"),
    ("sequence missing", without("sequence"), "sequence is missing"),
    ("sequence a string", changed(sequence="abc"), "sequence is 'abc'"),
    ("sequence negative", changed(sequence=-5), "sequence is -5"),
    ("sequence 1e30", changed(sequence=1e30), "sequence is 1e+30"),
    ("sequence a float", changed(sequence=16.0), "sequence is 16.0"),
    ("sequence 2**70", changed(sequence=2 ** 70), "sequence is 1180591620717411303424"),
    ("sequence true", changed(sequence=True), "sequence is True"),
    ("sequence null", changed(sequence=None), "sequence is None"),
    ("seq_len a string", changed(seq_len="64"), "seq_len is '64', expected 64"),
    ("seq_len another", changed(seq_len=32), "seq_len is 32, expected 64"),
    ("n_windows another", changed(n_windows=3), "n_windows is 3"),
    ("split another", changed(split="val"), "split is 'val', expected 'train'"),
    ("data_seed null", changed(data_seed=None), "data_seed is None, expected 42"),
    ("mask_seed a float", changed(mask_seed=17.0), "mask_seed is 17.0, expected 17"),
    ("mask_seed missing", without("mask_seed"), "mask_seed is missing"),
]


@pytest.mark.parametrize("case, edit, expected", LOADER_STATE_CASES, ids=[c[0] for c in LOADER_STATE_CASES])
def test_bad_loader_state(case, edit, expected, prepared):
    loader = data.Loader(prepared, "train", 64, 4, 2)
    for _ in range(4):
        loader.next()
    state = json.loads(json.dumps(loader.state_dict()))
    state = edit(state)
    fresh = data.Loader(prepared, "train", 64, 4, 2)
    with pytest.raises(InputError) as e:
        fresh.load_state_dict(state, where="run/state.json: loader")
    assert str(e.value).startswith("run/state.json: loader: ") and expected in str(e.value), str(e.value)
    assert fresh.sequence == 0  # nothing was taken from the bad state


def test_good_loader_state_passes_the_same_checks(prepared):
    """The table's base state is valid, so every failure above is due to its one changed field."""
    loader = data.Loader(prepared, "train", 64, 4, 2)
    for _ in range(4):
        loader.next()
    fresh = data.Loader(prepared, "train", 64, 4, 2)
    fresh.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert fresh.sequence == 8 and all(torch.equal(a, b) for a, b in zip(fresh.next(), loader.next()))


# ----------------------------------------------------------------------------
# A real full disk: a 256 KiB tmpfs (the small_disk fixture). One error line, exit 2, and nothing of ours left on it


def fill(disk):
    """Fill the disk to the last byte; returns the filler's name."""
    with open(disk / "filler", "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"x" * 4096)
        except OSError:
            pass
    return "filler"


FULL_DISK_CASES = [  # (command given the tmp dir and the disk, what is on the disk before, the file it fails on)
    ("prepare", lambda t, d: ["prepare", "--input", t / "big.jsonl", "--tokenizer", "bytes", "--out", d / "out"],
     lambda d: [], "out"),
    ("prepare over a previous corpus", lambda t, d: ["prepare", "--input", t / "big.jsonl", "--tokenizer", "bytes",
                                                     "--out", d / "small"], None, "small"),
    ("tokenizer", lambda t, d: ["tokenizer", "--input", t / "big.jsonl", "--vocab_size", "300", "--out",
                                d / "tok.json"], lambda d: [fill(d)], "tok.json"),
    ("docstrings", lambda t, d: ["docstrings", "--out", d / "general.jsonl", "--max_bytes", "400000"],
     lambda d: [], "general.jsonl"),
]


@pytest.mark.parametrize("case, argv, before, culprit", FULL_DISK_CASES, ids=[c[0] for c in FULL_DISK_CASES])
def test_full_disk(case, argv, before, culprit, small_disk, tmp_path, capsys):
    disk = small_disk("256k")
    write_jsonl(tmp_path / "big.jsonl", [f"document {i} " * 200 for i in range(200)])  # 600 KB of uint16 tokens
    if before is None:  # a small corpus prepared there before: the failed run must leave it as it was
        data.prepare([write_jsonl(tmp_path / "few.jsonl", ["one", "two", "three"])], "bytes", disk / "small")
        kept = {p.name: p.read_bytes() for p in (disk / "small").iterdir()}
        before = lambda d: ["small", *(f"small/{n}" for n in kept)]
    expected = sorted(before(disk))
    code, err = run_cli(argv(tmp_path, disk), capsys)
    lines = err.rstrip("\n").split("\n")  # before the error there may be a progress bar, nothing else
    assert code == 2 and lines[-1].startswith("error: ") and err.count("error") == 1, err
    assert "Traceback" not in err and "No space left on device" in lines[-1] and culprit in lines[-1], err
    left = sorted(str(p.relative_to(disk)) for p in disk.rglob("*"))
    assert left in (expected, sorted([*expected, "out"])), left  # at most the empty --out folder it made
    if case == "prepare over a previous corpus":
        assert {p.name: p.read_bytes() for p in (disk / "small").iterdir()} == kept
