"""Token files read back: meta.json and each split's .bin checked against each other before any step, so that a file
cut short, of another dtype or of another tokenizer, or overwritten with other tokens, stops a run with one line
naming it. A reader of the recipe may skip this file: data.py's Loader calls it.
"""
import hashlib
import os
import re
from pathlib import Path

import numpy as np

from machinery.cli import InputError, read_json
from machinery.tokenizer import MAX_VOCAB, is_int

SPLITS = ("train", "val")


def load_meta(data_dir):
    """data_dir/meta.json, checked: every field that sizes a table or indexes one is in range, and
    each split's token count is there (split_tokens checks its file against it)."""
    path = Path(data_dir) / "meta.json"
    meta = read_json(path, "the meta.json of `python data.py prepare` (`python data.py`: the demo)")
    keys = ("format", "dtype", "vocab_size", "tokenizer", "tokenizer_fingerprint", "cls_id",
            "sep_id", "pad_id", "mask_id", "special_ids", "splits")
    if not isinstance(meta, dict) or meta.get("format") != 1 or not all(k in meta for k in keys):
        raise InputError(f"{path}: not a format-1 meta.json written by `data.py prepare` (needs "
                         f"keys {', '.join(keys)})")
    vocab, dtype, splits = meta["vocab_size"], meta["dtype"], meta["splits"]
    ids = [meta[f"{n}_id"] for n in ("cls", "sep", "pad", "mask")]
    ids += meta["special_ids"] if isinstance(meta["special_ids"], list) else [None]
    counts = {s: splits[s].get("tokens") if isinstance(splits[s], dict) else None
              for s in splits} if isinstance(splits, dict) else {}
    digests = {s: splits[s].get("sample_sha256", "0" * 64) for s in SPLITS if isinstance(counts.get(s), int)}
    for ok, expected in [  # in order, each asked only when those before it hold
            (lambda: is_int(vocab) and 0 < vocab <= MAX_VOCAB,
             f"vocab_size an integer in [1, {MAX_VOCAB}], got {vocab!r}"),
            (lambda: dtype in ("uint16", "uint32"), f"dtype uint16 or uint32, got {dtype!r}"),
            (lambda: dtype != "uint16" or vocab <= 1 << 16,
             f"dtype uint32 for vocab_size {vocab} (uint16 holds ids < 65536)"),
            (lambda: all(is_int(i) and 0 <= i < vocab for i in ids),
             f"cls/sep/pad/mask_id and special_ids integers below vocab_size {vocab}, got {ids}"),
            (lambda: all(isinstance(meta[k], str) for k in ("tokenizer", "tokenizer_fingerprint")),
             "tokenizer strings"),
            (lambda: set(SPLITS) <= set(counts) and all(is_int(n) and 0 <= n < 1 << 62
                                                       for n in counts.values()),
             f"splits {' and '.join(SPLITS)}, each with its tokens an integer >= 0, got "
             f"{counts if isinstance(splits, dict) else splits}"),
            (lambda: all(re.fullmatch(r"[0-9a-f]{64}", str(d)) for d in digests.values()),
             f"each split's sample_sha256 64 hex digits (written by data.py prepare), got {list(digests.values())}")]:
        if not ok():
            raise InputError(f"{path}: expected {expected}")
    return meta


SAMPLE, EDGE = 4096, 8192  # ids read at open: a seeded spread, and the first and last EDGE tokens


def split_tokens(data_dir, meta, split):
    """The number of tokens in data_dir/{split}.bin, after checking the file against meta.json:
    its size is the split's token count times the dtype's size, and its ids on a fixed sample are
    below the vocabulary. A copy cut short, a file of another dtype or tokenizer stops here, before
    any step (Loader.batch checks every id it reads)."""
    path, where = Path(data_dir) / f"{split}.bin", Path(data_dir) / "meta.json"
    dtype, vocab, splits = np.dtype(meta["dtype"]), meta["vocab_size"], meta["splits"]
    if split not in splits:
        raise InputError(f"{path}: not found; {where} lists the splits {', '.join(splits)}")
    n = splits[split]["tokens"]
    if not path.is_file():
        raise InputError(f"{path}: not found or not a file; {where} says it holds {n} tokens")
    size, want = path.stat().st_size, n * dtype.itemsize
    if size != want:
        raise InputError(f"{path} holds {size} bytes; {where} says {n} tokens of {dtype.name} = "
                         f"{want} bytes ({size_hint(size, n, dtype)})")
    if n == 0:
        return 0
    at = sample_positions(n)
    try:
        ids = read_at(path, dtype, at)
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror or e})") from None
    if len(ids) < len(at):
        raise InputError(f"{path}: shorter than its size said while it was read: is it being "
                         f"written?")
    if ids.max() >= vocab:
        raise InputError(f"{path}: ids up to {ids.max()} at sample positions (the first at token "
                         f"{at[np.argmax(ids >= vocab)]}), above the vocabulary of {vocab} in "
                         f"{where} (a file of another tokenizer or dtype?)")
    want = splits[split].get("sample_sha256")  # a meta.json older than the fingerprint has none
    if want is not None and sample_digest(ids) != want:
        raise InputError(f"{path}: not the tokens data.py prepare wrote there: the digest of its {len(at):,} sampled "
                         f"ids differs from {where}'s (overwritten since with {n:,} other tokens?); put the file back, "
                         f"or prepare the data again")
    return n


def sample_digest(ids):
    """The fingerprint of a token file: the sha256 of its ids at sample_positions, which every open reads anyway (no
    extra read, however large the file). data.py prepare writes it into meta.json; the Loader keeps it in each
    checkpoint, so that a resume and a hand-off read the tokens the run read."""
    return hashlib.sha256(np.ascontiguousarray(ids).tobytes()).hexdigest()


def file_digest(path, dtype, n):
    """sample_digest of the n tokens of dtype in the file at path (prepare's, once the file is written)."""
    return sample_digest(read_at(path, np.dtype(dtype), sample_positions(n)) if n else np.zeros(0, dtype))


def check_same_tokens(saved, now, path, where):
    """The tokens a run continues from (`saved`: the fingerprint its checkpoint's loader holds) are the ones in
    `path` now (`now`: meta.json's, checked against the file at its open); either may be None (written before the
    fingerprint), and then nothing is compared."""
    if saved is not None and type(saved) is not str:
        raise InputError(f"{where}: sample_sha256 is {saved!r}, expected a string (the token file's fingerprint)")
    if saved is not None and now is not None and saved != now:
        raise InputError(f"{where}: the run read other tokens than {path} holds now (its fingerprint {saved[:12]}, "
                         f"now {now[:12]}): the data was prepared again or replaced since, and the position it "
                         f"continues names windows of the tokens it read. Put that data back, or start from its "
                         f"weights alone (--weights_only)")


def sample_positions(n):
    """The positions split_tokens reads in a file of n tokens: sorted, the same at every call."""
    spread = np.random.default_rng(0).integers(0, n, SAMPLE)
    edges = [np.arange(min(n, EDGE)), np.arange(max(0, n - EDGE), n)]
    return np.unique(np.concatenate([*edges, spread]))


def read_at(path, dtype, positions):
    """The ids at sorted positions, one read per run of consecutive ones. Not np.memmap: each page
    fault of a mapping reads the kernel's read-ahead window around it (megabytes), and a few
    thousand of them would read gigabytes of a large file."""
    runs = np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1)
    with open(path, "rb") as f:
        return np.concatenate([np.frombuffer(os.pread(f.fileno(), len(r) * dtype.itemsize,
                                                      int(r[0]) * dtype.itemsize), dtype)
                               for r in runs])


def size_hint(size, n, dtype):
    """The likely story of a .bin whose size is not the one meta.json implies."""
    other = np.dtype(np.uint32 if dtype == np.uint16 else np.uint16)
    if size == n * other.itemsize:
        return f"the size of {n} tokens of {other.name}: written with another dtype?"
    return "an interrupted copy?" if size < n * dtype.itemsize else \
        "longer than that: appended to, or the file of another prepare?"


def check_tokenizer(meta, tokenizer):
    """Stop when the data was tokenized by another tokenizer than the one the model will use."""
    if meta["tokenizer_fingerprint"] != tokenizer.fingerprint:
        raise InputError(f"data was prepared with tokenizer {meta['tokenizer']} (fingerprint "
                         f"{meta['tokenizer_fingerprint'][:12]}) but tokenizer {tokenizer.spec} "
                         f"has fingerprint {tokenizer.fingerprint[:12]}; prepare the data again "
                         f"with this tokenizer")
