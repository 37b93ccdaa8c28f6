"""data.py bad inputs, table-driven: each ends in exit code 2 and ONE line `error: ...` naming the flag or file,
before any tokenizing; meta.json and tokenizer.json are checked for structure and id range before any allocation;
a loader state read from a checkpoint is checked field by field; a real full disk leaves nothing behind."""
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import data
from conftest import ROOT
from machinery import tokenfiles
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
    ("input a folder without text files", lambda t: ["--input", folder_of(t, "README.md")],
     ["empty", "a folder with no file to read", ".jsonl, .txt or .parquet"]),
    ("input a folder of empty files", lambda t: ["--input", folder_of(t, "a.jsonl", "b.txt")],
     ["empty: no documents (its files are empty"]),
    ("input a glob matching nothing", lambda t: ["--input", f"{t}/*.jsonl.gz"], ["*.jsonl.gz: no file matches"]),
    ("input a folder holding a bad file", lambda t: ["--input", folder_of(t, "a.jsonl", "b.jsonl", "c.jsonl")],
     ["b.jsonl:1", "JSON object"]),
    ("gzip cut in half", lambda t: ["--input", raw(t, "c.jsonl.gz", gzipped(t)[:len(gzipped(t)) // 2])],
     ["c.jsonl.gz: not a readable .gz file: corrupt or cut short"]),
    ("gzip of garbage", lambda t: ["--input", raw(t, "c.jsonl.gz", b"garbage " * 100)],
     ["c.jsonl.gz: not a readable .gz file", "Not a gzipped file"]),
    ("zst of garbage", lambda t: ["--input", raw(t, "c.txt.zst", b"garbage " * 100)],
     ["c.txt.zst: not a readable .zst file: corrupt or cut short"]),
    ("zst cut short", lambda t: ["--input", raw(t, "c.jsonl.zst", zstd(t)[:-5])],
     ["c.jsonl.zst: not a readable .zst file: corrupt or cut short", "ends inside a frame"]),
    ("compressed parquet", lambda t: ["--input", raw(t, "c.parquet.gz", b"")], ["c.parquet.gz", "unsupported"]),
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
    # --mix weights that whole documents cannot reach, or that the parser would merge
    ("mix starves a source", lambda t: ["--input", t / "corpus.jsonl", long_documents(t), "--mix",
                                        "corpus=1e-12,long=1"], ["--mix corpus=1e-12", "less than one document"]),
    ("mix 1e308 against 1", lambda t: ["--input", t / "corpus.jsonl", long_documents(t), "--mix",
                                       "corpus=1,long=1e308"], ["--mix corpus=1", "train would hold none"]),
    ("mix subnormal against 1", lambda t: ["--input", t / "corpus.jsonl", long_documents(t), "--mix",
                                           "corpus=5e-324,long=1"], ["--mix corpus=4.94066e-324"]),
    ("mix a name twice", lambda t: ["--mix", "corpus=1,corpus=0"], ["--mix", "corpus given more than once"]),
]


def folder_of(tmp, *names):
    """tmp/empty holding the named files: each empty, but b.jsonl, which holds a line that is no JSON object."""
    (tmp / "empty").mkdir()
    for name in names:
        (tmp / "empty" / name).write_text("[1]\n" if name == "b.jsonl" else "")
    return tmp / "empty"


def gzipped(tmp):
    return gzip.compress((tmp / "corpus.jsonl").read_bytes())


def zstd(tmp):
    return pytest.importorskip("zstandard").ZstdCompressor().compress((tmp / "corpus.jsonl").read_bytes())


def long_documents(tmp):
    return write_jsonl(tmp / "long.jsonl", [f"a long document {i} " * 300 for i in range(10)])

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
    assert code == 2 and lines[-1].startswith("error: ") and "error" not in "".join(lines[:-1]), err
    assert "Traceback" not in err and all(w in lines[-1] for w in expected), err
    assert not (tmp_path / "out").exists()  # a failed prepare leaves no folder that looks prepared


def test_a_tokenizer_that_cannot_be_fetched_leaves_out_as_it_was(tmp_path, capsys, monkeypatch):
    """Offline, a hub id's tokenizer.json cannot be fetched: one line, and --out as it was: absent where it was
    absent (its missing parents too), a folder of the user's with its files untouched. A folder that cannot take
    the output is refused first, before any fetch."""
    import huggingface_hub

    def offline(repo_id, filename, **kwargs):
        fetched.append(repo_id)
        raise huggingface_hub.errors.LocalEntryNotFoundError("offline: not in the cache")
    fetched = []
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    write_jsonl(tmp_path / "corpus.jsonl", [f"document number {i}" for i in range(20)])
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("kept")
    for out in (tmp_path / "new" / "data", tmp_path / "mine"):
        code, err = run_cli(["prepare", "--input", tmp_path / "corpus.jsonl", "--out", out, "--tokenizer",
                             "someone/a-tokenizer"], capsys)
        assert code == 2 and "could not fetch tokenizer.json of hub id 'someone/a-tokenizer'" in err, err
    assert fetched == ["someone/a-tokenizer"] * 2
    assert not (tmp_path / "new").exists() and os.listdir(tmp_path / "mine") == ["notes.txt"]
    code, err = run_cli(["prepare", "--input", tmp_path / "corpus.jsonl", "--out", tmp_path / "corpus.jsonl" / "x",
                         "--tokenizer", "someone/a-tokenizer"], capsys)
    assert code == 2 and "cannot write there" in err and len(fetched) == 2, err


def test_a_failed_prepare_removes_the_folders_it_made_and_none_it_found(tmp_path, capsys):
    """A failure met while tokenizing (a line that is no text) removes what the prepare made, --out and its missing
    parents, and leaves a folder that was there before, empty as it was."""
    bad = raw(tmp_path, "s.jsonl", b'{"text": "a"}\n{"text": "x \\ud800"}\n')
    (tmp_path / "mine").mkdir()
    for out in (tmp_path / "new" / "data", tmp_path / "mine"):
        code, err = run_cli(["prepare", "--input", bad, "--out", out, *GOOD], capsys)
        assert code == 2 and "lone surrogate" in err, err
    assert not (tmp_path / "new").exists() and os.listdir(tmp_path / "mine") == []


def test_prepare_good_input_passes_the_same_checks(tmp_path, capsys):
    """The table's base command is valid, so every failure above is due to its one changed flag."""
    write_jsonl(tmp_path / "corpus.jsonl", [f"document number {i}" for i in range(20)])
    data.main(["prepare", "--input", str(tmp_path / "corpus.jsonl"), "--out", str(tmp_path / "out"), *GOOD,
               "--workers", "1", "--val_fraction", "0.1"])
    assert data.load_meta(tmp_path / "out")["splits"]["val"]["documents"] == 2


def test_zst_without_zstandard_is_one_line_saying_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "zstandard", None)  # as if not installed: importing it fails
    path = raw(tmp_path, "c.jsonl.zst", b"")
    code, err = run_cli(["prepare", "--input", path, "--out", tmp_path / "out", *GOOD], capsys)
    assert code == 2 and err == f"error: {path}: reading .zst needs zstandard (pip install zstandard)\n", err


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


def tokens_of(d, split):
    return np.fromfile(d / f"{split}.bin", dtype=np.uint16)


def cut(split, keep):
    """The first `keep` share of a split's bytes: a copy interrupted part way."""
    def damage(d):
        size = (d / f"{split}.bin").stat().st_size
        os.truncate(d / f"{split}.bin", int(size * keep))
    return damage


def rewrite(split, change):
    """The split's tokens after change(tokens) (which may return another array), written back."""
    def damage(d):
        tokens = tokens_of(d, split)
        tokens = change(tokens) if change(tokens.copy()) is not None else tokens
        (d / f"{split}.bin").unlink()
        tokens.tofile(d / f"{split}.bin")
    return damage


def set_at(position, value):
    def change(tokens):
        tokens[position] = value
        return tokens
    return change


def meta_edit(edit):
    def damage(d):
        meta = json.loads((d / "meta.json").read_text())
        edit(meta)
        (d / "meta.json").write_text(json.dumps(meta))
    return damage


def as_uint32_meta(d):
    """meta.json saying uint32 over a file of uint16 ids: pairs of ids read as one."""
    n = len(tokens_of(d, "train")) // 2 * 2
    os.truncate(d / "train.bin", 2 * n)
    meta_edit(lambda m: (m.update(dtype="uint32"), m["splits"]["train"].update(tokens=n // 2)))(d)


def replace_by(kind):
    def damage(d):
        (d / "train.bin").unlink()
        if kind == "folder":
            (d / "train.bin").mkdir()
        elif kind == "broken link":
            os.symlink(d / "gone.bin", d / "train.bin")
        elif kind == "fifo":
            os.mkfifo(d / "train.bin")
    return damage


def add_tokens(split, n):
    def damage(d):
        with open(d / f"{split}.bin", "ab") as f:
            f.write(np.full(n, 65, np.uint16).tobytes())
    return damage


BIN_CASES = [  # (case, what is done to a prepared folder, the split read, the words of the one error line)
    ("train.bin cut to half", cut("train", 0.5), "train",
     ["train.bin holds", "meta.json says", "tokens of uint16", "an interrupted copy?"]),
    ("val.bin cut by one byte", cut("val", 0.9999), "val", ["val.bin holds", "an interrupted copy?"]),
    ("train.bin empty", cut("train", 0), "train", ["train.bin holds 0 bytes", "an interrupted copy?"]),
    ("train.bin extended", add_tokens("train", 100), "train", ["train.bin holds", "appended to"]),
    ("val.bin with one more byte", lambda d: open(d / "val.bin", "ab").write(b"x"), "val",
     ["val.bin holds", "appended to"]),
    ("train.bin of uint32 ids", rewrite("train", lambda t: t.astype(np.uint32)), "train",
     ["train.bin holds", "tokens of uint32: written with another dtype?"]),
    ("meta.json says uint32 over uint16 ids", as_uint32_meta, "train",
     ["train.bin: ids up to", "above the vocabulary of 260", "another tokenizer or dtype"]),
    ("an id above the vocabulary at the last token", rewrite("train", set_at(-1, 300)), "train",
     ["train.bin: ids up to 300 at sample positions", "vocabulary of 260"]),
    ("ids of a larger tokenizer", rewrite("val", lambda t: t + 40_000), "val",
     ["val.bin: ids up to 40", "vocabulary of 260", "another tokenizer"]),
    ("train.bin missing", lambda d: (d / "train.bin").unlink(), "train", ["train.bin: not found", "says it holds"]),
    ("val.bin missing", lambda d: (d / "val.bin").unlink(), "val", ["val.bin: not found", "says it holds"]),
    ("train.bin a folder", replace_by("folder"), "train", ["train.bin: not found or not a file"]),
    ("train.bin a broken link", replace_by("broken link"), "train", ["train.bin: not found"]),
    ("train.bin a named pipe", replace_by("fifo"), "train", ["train.bin: not found or not a file"]),
    ("train.bin swapped with val.bin", lambda d: os.replace(d / "val.bin", d / "train.bin"), "train",
     ["train.bin holds", "an interrupted copy?"]),
    ("meta.json train tokens plus one", meta_edit(lambda m: m["splits"]["train"].update(
        tokens=m["splits"]["train"]["tokens"] + 1)), "train", ["train.bin holds", "an interrupted copy?"]),
    ("meta.json val tokens minus ten", meta_edit(lambda m: m["splits"]["val"].update(
        tokens=m["splits"]["val"]["tokens"] - 10)), "val", ["val.bin holds", "appended to"]),
    ("meta.json tokens a string", meta_edit(lambda m: m["splits"]["train"].update(tokens="9")), "train",
     ["meta.json: expected splits train and val", "'9'"]),
    ("meta.json tokens negative", meta_edit(lambda m: m["splits"]["val"].update(tokens=-2)), "val",
     ["meta.json: expected splits", "-2"]),
    ("meta.json tokens a boolean", meta_edit(lambda m: m["splits"]["val"].update(tokens=True)), "val",
     ["meta.json: expected splits", "True"]),
    ("meta.json tokens 1e30", meta_edit(lambda m: m["splits"]["train"].update(tokens=1e30)), "train",
     ["meta.json: expected splits"]),
    ("meta.json without val", meta_edit(lambda m: m["splits"].pop("val")), "train", ["meta.json: expected splits"]),
    ("meta.json splits a list", meta_edit(lambda m: m.update(splits=[1, 2])), "train",
     ["meta.json: expected splits"]),
    ("meta.json vocab_size a string", meta_edit(lambda m: m.update(vocab_size="260")), "train",
     ["meta.json: expected vocab_size an integer", "'260'"]),
    ("meta.json mask_id a string", meta_edit(lambda m: m.update(mask_id="259")), "train",
     ["meta.json: expected cls/sep/pad/mask_id"]),
    # other tokens of the same size, in range: the fingerprint prepare wrote (a sampled digest) tells them apart
    ("train.bin overwritten in place by other tokens", lambda d: shutil.copyfile(shuffled(d, "train"), d / "train.bin"),
     "train", ["train.bin: not the tokens data.py prepare wrote there", "sampled ids differs from", "meta.json"]),
    ("val.bin one token changed at the end", rewrite("val", set_at(-1, 65)), "val",
     ["val.bin: not the tokens data.py prepare wrote there"]),
    ("meta.json fingerprint not hex", meta_edit(lambda m: m["splits"]["val"].update(sample_sha256="x")), "val",
     ["meta.json: expected each split's sample_sha256 64 hex digits", "'x'"]),
]


def shuffled(d, split):
    """A file of the split's own ids in another order (a prepare with another --seed writes such a file)."""
    tokens = tokens_of(d, split)
    np.random.default_rng(0).permutation(tokens).tofile(d / "other.bin")
    return d / "other.bin"


@pytest.mark.parametrize("case, damage, split, expected", BIN_CASES, ids=[c[0] for c in BIN_CASES])
def test_token_files_are_checked_against_meta_json(case, damage, split, expected, prepared, tmp_path):
    """Whatever reads a split (train.py's Loader, eval.py mlm's count_windows, bench.py's Loader) stops with one
    line naming the file and what differs, before a step."""
    d = tmp_path / "d"
    shutil.copytree(prepared, d)
    damage(d)
    readers = [lambda: data.Loader(d, split, 64, 4, 2), lambda: data.count_windows(d, split, 64)]
    if split == "val":  # train.py's validation
        readers.append(lambda: list(data.val_batches(d, 64, 2, 2, "mlm")))
    for read in readers:
        with pytest.raises(InputError) as e:
            read()
        message = str(e.value)
        assert "\n" not in message and all(w in message for w in expected), message


def fingerprinted(split):
    """meta.json's fingerprint of the split made that of its file as it is now (as a prepare of these tokens would)."""
    def edit(d):
        n = data.load_meta(d)["splits"][split]["tokens"]
        meta_edit(lambda m: m["splits"][split].update(sample_sha256=tokenfiles.file_digest(d / f"{split}.bin",
                                                                                            "uint16", n)))(d)
    return edit


def test_good_token_files_pass_the_same_checks(prepared, tmp_path):
    """The table's folder is valid, so every failure above is due to its one change; a file written again with the
    same ids, and ids at the top of the vocabulary (their meta.json's fingerprint made theirs), still load."""
    d = tmp_path / "d"
    shutil.copytree(prepared, d)
    rewrite("train", set_at(-1, 259))(d)
    fingerprinted("train")(d)
    meta = data.load_meta(d)
    for split in ("train", "val"):
        n = meta["splits"][split]["tokens"]
        assert data.count_windows(d, split, 64) == n // 64 == data.Loader(d, split, 64, 4, 2).n_windows
    x, y = data.Loader(d, "train", 64, 4, 2).next()
    assert x.shape == y.shape == (2, 64)


def test_train_and_eval_stop_on_a_damaged_token_file_with_one_line(prepared, tmp_path, capsys):
    import eval as evaluate
    import train
    from conftest import tiny_model
    threads = torch.get_num_threads()
    for split in ("train", "val"):
        d = tmp_path / split
        shutil.copytree(prepared, d)
        cut(split, 0.5)(d)
        tiny_model().save_pretrained(str(tmp_path / "model"))
        for main, argv in [
                (train.main, [f"--data={d}", f"--out_dir={tmp_path / 'out' / split}", "--preset=tiny", "--seq_len=64",
                              "--batch_size=4", "--micro_batch_size=2", "--compile=false", "--eval_sequences=2",
                              "--tokens=1024", "--threads=1"]),
                (evaluate.main, ["mlm", str(tmp_path / "model"), "--data", str(d), "--seq_len=64",
                                 "--n_sequences=2", "--threads=1"])]:
            if main is evaluate.main and split == "train":
                continue  # eval.py mlm reads val.bin alone
            with pytest.raises(SystemExit) as e:
                run(main, argv)
            err = capsys.readouterr().err
            assert e.value.code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
            assert f"{d / split}.bin holds" in err and "an interrupted copy?" in err, err
    torch.set_num_threads(threads)


def test_a_run_continues_only_on_the_tokens_it_read(prepared, tmp_path):
    """A checkpoint's loader state holds the fingerprint of the tokens it read: a resume or a hand-off onto data
    prepared again with other tokens of the same size (its meta.json and files consistent) is refused, naming the
    file; the same tokens prepared again, and a state or a meta.json older than the fingerprint, continue."""
    running = data.Loader(prepared, "train", 64, 4, 2)
    for _ in range(4):
        running.next()
    state = json.loads(json.dumps(running.state_dict()))
    assert state["sample_sha256"] == data.load_meta(prepared)["splits"]["train"]["sample_sha256"]
    other = tmp_path / "other"
    shutil.copytree(prepared, other)
    shutil.copyfile(shuffled(other, "train"), other / "train.bin")
    fingerprinted("train")(other)  # prepared again: consistent with itself, other tokens
    with pytest.raises(InputError) as e:
        data.Loader(other, "train", 64, 4, 2).load_state_dict(state, where="run/state.json: loader")
    assert str(e.value).startswith(f"run/state.json: loader: the run read other tokens than {other / 'train.bin'} "
                                   f"holds now") and "--weights_only" in str(e.value), str(e.value)
    same = tmp_path / "same"
    shutil.copytree(prepared, same)
    for loader_state, folder in [(state, same), ({k: v for k, v in state.items() if k != "sample_sha256"}, other)]:
        fresh = data.Loader(folder, "train", 64, 4, 2)
        fresh.load_state_dict(loader_state)
        assert fresh.sequence == 8
    meta_edit(lambda m: m["splits"]["train"].pop("sample_sha256"))(other)  # a meta.json older than the fingerprint
    data.Loader(other, "train", 64, 4, 2).load_state_dict(state)
    with pytest.raises(InputError, match="sample_sha256 is 5, expected a string"):
        data.Loader(prepared, "train", 64, 4, 2).load_state_dict({**state, "sample_sha256": 5})


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


def test_an_out_that_names_a_file_of_a_model_is_refused(tmp_path, capsys):
    """data.py's outputs never replace a file of a model: a tokenizer over a model folder's tokenizer.json, text
    over a run's log.jsonl, or a file inside a run's checkpoints. One line each, and every file as it was."""
    model, run_dir = tmp_path / "model", tmp_path / "run"
    for folder, names in ((model, ("config.json", "model.safetensors", "tokenizer.json")),
                          (run_dir, ("run.json", "log.jsonl", "checkpoints/step-00000002/state.json"))):
        for name in names:
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_text(f"the {name} of the model")
    corpus = write_jsonl(tmp_path / "corpus.jsonl", ["some text", "more text"])
    checkpoint = run_dir / "checkpoints" / "step-00000002"
    cases = [(["tokenizer", "--input", corpus, "--vocab_size", "300", "--out", model / "tokenizer.json"],
              f"--out={model / 'tokenizer.json'}: it would write {model / 'tokenizer.json'}, a file of the model in "
              f"{model}; choose another --out"),
             (["docstrings", "--out", run_dir / "log.jsonl"], f"a file of the model in {run_dir}"),
             (["code", "--out", tmp_path / "code.jsonl", "--heldout", run_dir / "log.jsonl"],
              f"--heldout={run_dir / 'log.jsonl'}: it would write {run_dir / 'log.jsonl'}, a file of the model"),
             (["tokenizer", "--input", corpus, "--vocab_size", "300", "--out", checkpoint / "tok.json"],
              f"a file inside the checkpoints of the run in {run_dir}")]
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    for argv, expected in cases:
        code, err = run_cli(argv, capsys)
        assert code == 2 and err.count("\n") == 1 and expected in err, err
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before


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
    ("code", lambda t, d: ["code", "--out", d / "code.jsonl", "--heldout", t / "held.jsonl", "--max_bytes", "400000"],
     lambda d: [], "code.jsonl"),
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


def test_a_mistyped_flag_is_answered_before_torch_is_imported(tmp_path):
    """data.py checks its flags before it imports torch (seconds, more on a busy machine): a torch that cannot be
    imported does not stand in the way of the answer, nor of --help; right flags go on to it."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise SystemExit('torch was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for argv, status, said in ((["prepare", "--inptu", "a.jsonl"], 2, "error: data.py: unrecognized arguments: "
                                "--inptu; did you mean --input? (see data.py --help)"),
                               (["prepare", "--help"], 0, ""),
                               (["docstrings", "--out", "d.jsonl"], 1, "torch was imported")):
        result = subprocess.run([sys.executable, str(ROOT / "data.py"), *argv], capture_output=True, text=True,
                                env=env, cwd=tmp_path)
        assert (result.returncode, result.stderr.strip()) == (status, said)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_process_forked_during_prepare_ends_at_a_signal(sig):
    """prepare's pool forks its workers inside cli.stop_on_sigterm; a worker that gets a signal before it sets its
    own handlers (the pool's cleanup, Ctrl-C to the process group) must end there, with 128 + the signal: a Stop
    raised in it would unwind the parent's copied stack and run on as a second copy of the parent."""
    from machinery import cli
    with cli.stop_on_sigterm():
        pid = os.fork()
        if pid == 0:
            try:
                os.kill(os.getpid(), sig)  # the handler runs at the next instruction
                time.sleep(5)
            finally:
                os._exit(1)  # reached only where the handler let the copy run on
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 128 + sig
