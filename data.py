"""
Data for continued pretraining of ModernBERT: tokenizer, corpus preparation, batches.

    python data.py                                   # build data/demo from stdlib docstrings (no download)
    python data.py prepare --input a.jsonl b.txt --tokenizer answerdotai/ModernBERT-base --out data/mix \
        --mix a=0.7,b=0.3
    python data.py tokenizer --input a.jsonl --vocab_size 8192 --out tok8k.json   # a small byte-level BPE

Sections: tokenizer (a tokenizer.json run by tiktoken, ids identical to Hugging Face `tokenizers`),
prepare (text files -> train.bin / val.bin / meta.json), a small tokenizer (byte-level BPE learned from the corpus),
batches (seeded windows, MLM masking, CLM labels).
"""
import argparse
import ast
import functools
import hashlib
import heapq
import json
import math
import os
import re
import sys
import sysconfig
import tempfile
import time
import unicodedata
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tiktoken
import torch


class DataError(ValueError):
    """Bad input: the message names the file (and line) and what was expected."""


# ----------------------------------------------------------------------------
# Tokenizer

# SPEC §2 trap 1: Hugging Face's ByteLevel pre-tokenizer splits with the GPT-2 pattern.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# Rust's char::is_whitespace (Unicode White_Space), which lstrip/rstrip use; unlike str.isspace it excludes \x1c-\x1f.
WHITESPACE = frozenset("\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007"
                       "\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000")
NORMALIZERS = {None: None, "NFC": "NFC", "NFD": "NFD", "NFKC": "NFKC", "NFKD": "NFKD"}


def byte_to_unicode():
    """GPT-2's reversible map from the 256 bytes to printable characters (how byte-level vocabularies are spelled)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {b: chr(c) for b, c in zip(printable + others, printable + [256 + i for i in range(len(others))])}


SPECIALS = ("[CLS]", "[SEP]", "[PAD]", "[MASK]")  # the tokens the MLM recipe needs, named as in ModernBERT


def special_token(content, id_):
    return {"id": id_, "content": content, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
            "special": True}


def template_processing(ids):
    """ModernBERT's post-processor: `[CLS] $A [SEP]` and `[CLS] $A [SEP] $B [SEP]`; ids maps [CLS] and [SEP] to ids."""
    special = [{"SpecialToken": {"id": t, "type_id": 0}} for t in ("[CLS]", "[SEP]")]
    a, b = ({"Sequence": {"id": s, "type_id": 0}} for s in "AB")
    return {"type": "TemplateProcessing", "single": [special[0], a, special[1]],
            "pair": [special[0], a, special[1], b, special[1]],
            "special_tokens": {t: {"id": t, "ids": [ids[t]], "tokens": [t]} for t in ("[CLS]", "[SEP]")}}


def byte_level_config(vocab, merges, added, normalizer):
    """A complete tokenizer.json for a byte-level BPE, as Hugging Face `tokenizers` writes and loads it."""
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    ids = {t["content"]: t["id"] for t in added}
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": normalizer,
            "pre_tokenizer": byte_level, "post_processor": template_processing(ids), "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": vocab, "merges": merges}}


def bytes_config():
    """The built-in byte tokenizer: the 256 bytes with no merges, then the four special tokens."""
    b2u = byte_to_unicode()
    return byte_level_config({b2u[b]: b for b in range(256)}, [],
                             [special_token(name, 256 + i) for i, name in enumerate(SPECIALS)], None)


# Ids size tables (special-token masks, embeddings): anything above this is a corrupt or crafted file, not a vocabulary
MAX_VOCAB = 1 << 24
ADDED_TOKEN_FLAGS = ("special", "normalized", "lstrip", "rstrip", "single_word")


def is_int(x):
    return type(x) is int  # JSON's 4e9 is a float and true is a bool: neither is an id or a count


def is_merge(m):
    return isinstance(m, str) or (isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) for p in m))


def is_added_token(t):
    return (isinstance(t, dict) and isinstance(t.get("content"), str) and is_int(t.get("id"))
            and all(f in t for f in ADDED_TOKEN_FLAGS))


def check_tokenizer_json(config, spec):
    """The structure and id range of a tokenizer.json, checked before anything is sized by its ids."""
    def require(ok, expected):
        if not ok:
            raise DataError(f"{spec}: not a usable tokenizer.json: {expected}")
    require(isinstance(config, dict) and isinstance(config.get("model"), dict), "expected an object with a 'model'")
    model, added = config["model"], config.get("added_tokens") or []
    vocab, merges = model.get("vocab"), model.get("merges", [])
    require(isinstance(vocab, dict) and vocab and all(map(is_int, vocab.values())),
            "model.vocab must be a non-empty object of token -> integer id")
    require(isinstance(merges, list) and all(map(is_merge, merges)), "model.merges must be a list of 'a b' or [a, b]")
    require(isinstance(added, list) and all(map(is_added_token, added)),
            f"added_tokens must be objects with a string content, an integer id and {', '.join(ADDED_TOKEN_FLAGS)}")
    for key in ("normalizer", "pre_tokenizer"):
        require(isinstance(config.get(key) or {}, dict), f"{key} must be an object or null")
    ids = {*vocab.values(), *(t["id"] for t in added)}
    require(min(ids) >= 0 and max(ids) < MAX_VOCAB, f"token ids must lie in [0, {MAX_VOCAB}), found {min(ids)} to {max(ids)}")
    require(max(ids) < 2 * len(ids), f"ids reach {max(ids)} but only {len(ids)} are used (holes larger than the "
                                     f"vocabulary)")


class Tokenizer:
    """A byte-level BPE tokenizer.json run by tiktoken, splitting added tokens the way Hugging Face does."""

    def __init__(self, config, spec):
        check_tokenizer_json(config, spec)
        self.spec, self.config = spec, config
        model, pre = config.get("model") or {}, config.get("pre_tokenizer") or {}
        def require(ok, field, expected):
            if not ok:
                raise DataError(f"{spec}: unsupported tokenizer, {field} must be {expected}")
        require(model.get("type", "BPE") == "BPE", "model.type", "BPE")
        require(pre.get("type") == "ByteLevel", "pre_tokenizer.type", "ByteLevel")
        require(not pre.get("add_prefix_space"), "pre_tokenizer.add_prefix_space", "false")
        require(pre.get("use_regex", True), "pre_tokenizer.use_regex", "true")
        for field in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
            require(not model.get(field), f"model.{field}", "null")
        norm = config.get("normalizer")
        require(norm is None or norm.get("type") in NORMALIZERS, "normalizer", "null, NFC, NFD, NFKC or NFKD")
        self.form = NORMALIZERS[norm and norm["type"]]

        added = sorted(config.get("added_tokens") or [], key=lambda t: t["id"])
        for t in added:
            require(not t.get("single_word"), f"added token {t['content']!r} single_word", "false")
        vocab = model["vocab"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]  # both file formats
        self.fingerprint = hashlib.sha256(json.dumps(  # sorted items: sort_keys on the big vocab dict is slow
            {"vocab": sorted(vocab.items()), "merges": merges, "added_tokens": added, "normalizer": norm},
            sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        # added tokens are given to tiktoken only so that decode() knows them; encode splits them out itself
        self.enc = tiktoken.Encoding(spec, pat_str=GPT2_PATTERN, mergeable_ranks=self._ranks(vocab, merges, added),
                                     special_tokens={t["content"]: t["id"] for t in added})
        self.vocab_size = max([*vocab.values(), *(t["id"] for t in added)]) + 1
        self.special_ids = sorted(t["id"] for t in added if t.get("special"))
        ids = {t["content"]: t["id"] for t in added} | vocab
        for name in ("cls", "sep", "pad", "mask"):
            require(f"[{name.upper()}]" in ids, f"a token [{name.upper()}]", "present (the MLM recipe needs it)")
            setattr(self, f"{name}_id", ids[f"[{name.upper()}]"])
        # SPEC §2 trap 3: added tokens with normalized=false are split from the raw text, the others after normalizing.
        self.added = {t["content"]: t for t in added}
        self.added |= {self.normalize(t["content"]): t for t in added if t["normalized"]}
        self.raw = self._matcher([t["content"] for t in added if not t["normalized"]])
        self.normalized = self._matcher([self.normalize(t["content"]) for t in added if t["normalized"]])

    def _ranks(self, vocab, merges, added):
        """tiktoken's mergeable_ranks (token bytes -> id), after checking that id order is merge order (trap 4)."""
        to_latin1 = str.maketrans({u: chr(b) for b, u in byte_to_unicode().items()})
        added_ids = {t["id"] for t in added}
        try:
            ranks = {s.translate(to_latin1).encode("latin-1"): i for s, i in vocab.items() if i not in added_ids}
        except UnicodeEncodeError as e:
            raise DataError(f"{self.spec}: vocab entry {e.object!r} is not byte-level") from None
        # every byte that UTF-8 text can contain must be a token (0xC0, 0xC1 and 0xF5-0xFF never occur)
        missing = [b for b in [*range(0xC0), *range(0xC2, 0xF5)] if bytes([b]) not in ranks]
        if missing:
            raise DataError(f"{self.spec}: vocab lacks single bytes {missing[:8]}; a byte-level BPE needs them")
        results = np.array([vocab.get(m.replace(" ", ""), -1) for m in merges], dtype=np.int64)  # byte-level: no " "
        bad = np.flatnonzero((results < 0) | (np.diff(results, prepend=-1) <= 0))
        if len(bad):
            raise DataError(f"{self.spec}: merge {bad[0]} ({merges[bad[0]]!r}) does not produce a vocab id larger than "
                            f"the previous merge's; tiktoken needs ids in merge order")
        made = set(results.tolist())
        orphans = [s for s, i in vocab.items() if len(s) > 1 and i not in made and i not in added_ids]
        if orphans:
            raise DataError(f"{self.spec}: vocab entries {orphans[:5]} are not the result of any merge")
        return ranks

    @staticmethod
    def _matcher(contents):
        """(probes, regex) finding added tokens leftmost-longest; probes are a cheap test that none can occur."""
        if not contents:
            return (), None
        probes = tuple(sorted({c[:2] for c in contents}))
        return probes, re.compile("|".join(re.escape(c) for c in sorted(contents, key=len, reverse=True)))

    def normalize(self, text):
        if self.form is None or unicodedata.is_normalized(self.form, text):
            return text
        return unicodedata.normalize(self.form, text)

    def _split(self, text, matcher):
        """Split text into str pieces and added-token ids, exactly as tokenizers' AddedVocabulary::find_matches."""
        probes, regex = matcher
        if not any(p in text for p in probes):
            return [text] if text else []
        out, pos = [], 0
        for m in regex.finditer(text):
            token, start, stop = self.added[m.group()], m.start(), m.end()
            while token["lstrip"] and start > pos and text[start - 1] in WHITESPACE:
                start -= 1
            while token["rstrip"] and stop < len(text) and text[stop] in WHITESPACE:
                stop += 1
            if start > pos:
                out.append(text[pos:start])
            out.append(token["id"])
            pos = stop
        return out + [text[pos:]] if pos < len(text) else out

    def encode(self, text):
        """Token ids of text, no special tokens added."""
        ids = []
        for piece in self._split(text, self.raw):
            if isinstance(piece, int):
                ids.append(piece)
                continue
            for sub in self._split(self.normalize(piece), self.normalized):
                ids.extend([sub] if isinstance(sub, int) else self.enc.encode_ordinary(sub))
        return ids

    def encode_batch(self, texts, num_threads=None):
        """encode() over many texts on threads: tiktoken releases the GIL (faster than processes on 2 cores)."""
        n = max(1, min(num_threads or os.cpu_count() or 1, len(texts)))
        chunks = [texts[i * len(texts) // n:(i + 1) * len(texts) // n] for i in range(n)]
        with ThreadPoolExecutor(n) as pool:
            return [ids for chunk in pool.map(lambda c: [self.encode(t) for t in c], chunks) for ids in chunk]

    def decode(self, ids):
        return self.enc.decode([int(i) for i in ids], errors="replace")

    @functools.cached_property
    def hf_files(self):
        """{file name: text} of a Hugging Face tokenizer directory; built once, since every checkpoint writes it."""
        config = self.config
        if not config.get("post_processor"):  # without it AutoTokenizer would not add [CLS] ... [SEP]
            config = config | {"post_processor": template_processing({"[CLS]": self.cls_id, "[SEP]": self.sep_id})}
        tokens = {f"{name}_token": f"[{name.upper()}]" for name in ("cls", "sep", "pad", "mask")}
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False, **tokens}
        return {name: json.dumps(content, ensure_ascii=False, indent=indent) + "\n" for name, content, indent in [
            ("tokenizer.json", config, None), ("tokenizer_config.json", settings, 2),
            ("special_tokens_map.json", tokens, 2)]}

    def save_pretrained(self, out_dir):
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json, which AutoTokenizer loads."""
        for name, text in self.hf_files.items():
            Path(out_dir, name).write_text(text, encoding="utf-8")


def load_tokenizer(spec):
    """spec: a tokenizer.json path, a Hugging Face hub id (fetches its tokenizer.json), or "bytes"."""
    spec = str(spec)
    if spec == "bytes":
        return Tokenizer(bytes_config(), spec)
    path = Path(spec)
    if not path.exists() and not spec.endswith(".json") and spec.count("/") == 1:
        try:
            from huggingface_hub import hf_hub_download
            path = Path(hf_hub_download(spec, "tokenizer.json"))
        except Exception as e:
            raise DataError(f"could not fetch tokenizer.json of hub id {spec!r} ({type(e).__name__}); "
                            f"without network pass the path of a local tokenizer.json") from None
    return Tokenizer(read_json(path, "tokenizer file not found (expected a tokenizer.json, a hub id, or 'bytes')"), spec)


def read_json(path, missing):
    """The JSON in path, or a DataError naming the file; `missing` says what was expected there."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: {missing}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: not readable JSON ({e})") from None


def check_tokenizer(meta, tokenizer):
    """Stop when the data was tokenized by another tokenizer than the one the model will use."""
    if meta["tokenizer_fingerprint"] != tokenizer.fingerprint:
        raise DataError(f"data was prepared with tokenizer {meta['tokenizer']} (fingerprint "
                        f"{meta['tokenizer_fingerprint'][:12]}) but tokenizer {tokenizer.spec} has fingerprint "
                        f"{tokenizer.fingerprint[:12]}; prepare the data again with this tokenizer")


# ----------------------------------------------------------------------------
# Prepare: text files -> train.bin, val.bin, meta.json

def read_documents(path, field="text"):
    """Yield (document, bytes of input consumed): .jsonl (one object a line), .txt (blank-line separated), .parquet."""
    path = Path(path)
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading .parquet needs pyarrow (pip install pyarrow)") from None
        rows = pq.ParquetFile(path)
        if field not in rows.schema_arrow.names:
            raise DataError(f"{path}: no column {field!r} (columns: {', '.join(rows.schema_arrow.names)})")
        for batch in rows.iter_batches(columns=[field]):
            for text in batch.column(0).to_pylist():
                if not isinstance(text, str):
                    raise DataError(f"{path}: column {field!r} holds {type(text).__name__}, expected strings")
                yield text, len(text.encode())
        return
    if path.suffix not in (".jsonl", ".txt"):
        raise DataError(f"{path}: unsupported input format; expected .jsonl, .txt or .parquet")
    block, size = [], 0
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{number}: invalid UTF-8 ({e.reason} at byte {e.start} of the line)") from None
            if path.suffix == ".txt":
                if line.strip():
                    block.append(line)
                    size += len(raw)
                elif block:
                    yield "".join(block).rstrip("\r\n"), size + len(raw)
                    block, size = [], 0
                continue
            if not line.strip():
                continue
            try:
                text = json.loads(line)[field]
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{path}:{number}: expected a JSON object with a string field {field!r}") from None
            if not isinstance(text, str):
                raise DataError(f"{path}:{number}: field {field!r} is {type(text).__name__}, expected a string")
            yield text, len(raw)
    if block:
        yield "".join(block).rstrip("\r\n"), size


def progress(total, desc):
    """tqdm when installed (it is optional); otherwise a printed line per update."""
    try:
        from tqdm import tqdm
        return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024)
    except ImportError:
        class Plain:  # one line per batch of a few MB
            def update(self, n):
                print(f"{desc}: {n / 1e6:.1f} MB more of {total / 1e6:.1f} MB", flush=True)
            def close(self):
                pass
        return Plain()


def tokenize_source(path, field, tokenizer, dtype, dst, workers, bar):
    """Tokenize one source into dst as [CLS] text [SEP] per document; returns (document lengths, text bytes)."""
    lengths, text_bytes, batch, size = [], 0, [], 0
    def flush():
        flat = []
        for ids in tokenizer.encode_batch(batch, num_threads=workers):
            flat += [tokenizer.cls_id, *ids, tokenizer.sep_id]
            lengths.append(len(ids) + 2)
        np.asarray(flat, dtype=dtype).tofile(f)
        bar.update(size)
    with open(dst, "wb") as f:
        for text, nbytes in read_documents(path, field):
            size += nbytes
            if text.strip():  # an empty document would only add [CLS][SEP]
                batch.append(text)
                text_bytes += len(text.encode())
            if size >= 4 << 20:  # a few MB per batch keeps memory flat and the threads busy
                flush()
                batch, size = [], 0
        flush()
    if not lengths:
        raise DataError(f"{path}: no documents (the file is empty or every {field!r} is empty)")
    return np.array(lengths, dtype=np.int64), text_bytes


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def resample(docs, lengths, target, rng):
    """Whole documents reaching `target` tokens: every document `int(x)` times, plus a seeded subset for the rest."""
    tokens = lengths[docs].sum()
    repeats, fraction = divmod(target / tokens, 1.0)
    order = rng.permutation(docs)
    extra = order[:np.searchsorted(np.cumsum(lengths[order]), fraction * tokens)]
    return np.concatenate([np.tile(docs, int(repeats)), extra])


def choose_documents(lengths, names, mix, val_fraction, seed):
    """(train, val): document indices per source. Val is drawn first, so mixing never repeats it in train."""
    rngs = [np.random.default_rng([seed, i]) for i in range(len(lengths))]
    train, val = [], []
    for lens, rng in zip(lengths, rngs):
        n = len(lens)
        n_val = min(n - 1, max(1, round(val_fraction * n))) if val_fraction > 0 and n >= 2 else 0
        is_val = np.zeros(n, bool)
        is_val[rng.choice(n, n_val, replace=False)] = True
        train.append(np.flatnonzero(~is_val))
        val.append(np.flatnonzero(is_val))
    if mix is not None:  # target shares of the natural train total, reached with whole documents
        natural = sum(lens[docs].sum() for lens, docs in zip(lengths, train))
        weight = sum(mix.values())
        train = [resample(docs, lens, mix[n] / weight * natural, rng)
                 for n, lens, docs, rng in zip(names, lengths, train, rngs)]
    return train, val


def make_writable_dir(folder, out):
    """Create folder; a probe file proves it writable (permission bits do not stop root, a read-only mount does)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=folder).close()
    except OSError as e:
        raise DataError(f"--out={out}: cannot write there ({e.strerror or e})") from None


def check_inputs(paths):
    if not paths:
        raise DataError("--input: expected one or more text files")
    for p in paths:
        if not p.is_file():
            raise DataError(f"{p}: input file not found")


def check_tokenizer_args(paths, vocab_size, out):
    """Every argument of `tokenizer` checked before the corpus is read."""
    check_inputs(paths)
    low = 256 + len(SPECIALS) + 1
    if not is_int(vocab_size) or not low <= vocab_size <= MAX_VOCAB:
        raise DataError(f"--vocab_size={vocab_size}: expected an integer in [{low}, {MAX_VOCAB}] (256 bytes, "
                        f"{len(SPECIALS)} special tokens and at least one merge)")
    if out.suffix != ".json" or out.is_dir():
        raise DataError(f"--out={out}: expected the path of a .json file to write")
    make_writable_dir(out.parent, out)


def check_prepare_args(paths, names, out, mix, val_fraction, seed, workers):
    """Every argument of `prepare` checked before any tokenizing; creates out."""
    check_inputs(paths)
    weights = list((mix or {}).values())
    for ok, message in [
        (len(set(names)) == len(names), f"--input needs distinct file names (source name = stem), got {names}"),
        (mix is None or set(mix) == set(names), f"--mix names {sorted(mix or [])} must be exactly the sources "
                                                f"{sorted(names)}"),
        (all(math.isfinite(w) and w >= 0 for w in weights) and (mix is None or sum(weights) > 0),
         f"--mix weights must be finite, >= 0 and not all 0, got {weights}"),
        (math.isfinite(val_fraction) and 0 < val_fraction < 1, f"--val_fraction={val_fraction}: expected a number "
                                                               f"in (0, 1); the validation split cannot be empty"),
        (is_int(seed) and seed >= 0, f"--seed={seed}: expected an integer >= 0"),
        (workers is None or (is_int(workers) and workers >= 1), f"--workers={workers}: expected an integer >= 1"),
        (not out.exists() or out.is_dir(), f"--out={out}: is a file, expected a directory")]:
        if not ok:
            raise DataError(message)
    make_writable_dir(out, out)


def prepare(inputs, tokenizer_spec, out_dir, field="text", mix=None, val_fraction=0.005, seed=1337, workers=None):
    """Tokenize inputs into out_dir/{train,val}.bin and meta.json; returns the meta dict."""
    t0 = time.time()
    paths, out = [Path(p) for p in inputs], Path(out_dir)
    names = [p.stem for p in paths]
    check_prepare_args(paths, names, out, mix, val_fraction, seed, workers)
    tokenizer = load_tokenizer(tokenizer_spec)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 65536 else np.uint32)
    tmp = {k: out / f".{k}.tmp" for k in [*(f"{n}.tokens" for n in names), "train.bin", "val.bin", "meta.json"]}
    bar = progress(sum(p.stat().st_size for p in paths), f"tokenizing into {out}")
    try:
        sources = [tokenize_source(p, field, tokenizer, dtype, tmp[f"{n}.tokens"], workers, bar)
                   for p, n in zip(paths, names)]
        lengths = [lens for lens, _ in sources]
        train, val = choose_documents(lengths, names, mix, val_fraction, seed)
        if not sum(map(len, val)):
            counts = ", ".join(f"{p} has {len(lens)}" for p, lens in zip(paths, lengths))
            raise DataError(f"--input: the validation split is empty ({counts} document(s)); val needs at least one "
                            f"document and train keeps one per input, so give an input 2 or more documents (.txt: "
                            f"separated by a blank line)")
        splits = {}
        tokens = [np.memmap(tmp[f"{n}.tokens"], dtype=dtype, mode="r") for n in names]
        starts = [np.concatenate([[0], np.cumsum(lens)]) for lens in lengths]
        for split, chosen in (("train", train), ("val", val)):
            source = np.concatenate([np.full(len(d), i) for i, d in enumerate(chosen)])
            doc = np.concatenate(chosen)
            # shuffled documents interleave the sources (val too: its first windows are a fair sample)
            order = np.random.default_rng([seed, len(paths), split == "val"]).permutation(len(doc))
            with open(tmp[f"{split}.bin"], "wb") as f:
                for s, d in zip(source[order], doc[order]):
                    f.write(tokens[s][starts[s][d]:starts[s][d + 1]])
            per = {n: {"tokens": int(lens[d].sum()), "documents": len(d)} for n, lens, d in zip(names, lengths, chosen)}
            splits[split] = {"tokens": sum(v["tokens"] for v in per.values()), "documents": len(doc), "per_source": per}

        # a tokenizer file is recorded by absolute path, so a run started from another directory still finds it
        spec = str(Path(tokenizer_spec).resolve()) if Path(tokenizer_spec).is_file() else tokenizer.spec
        meta = {"format": 1, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size, "tokenizer": spec,
                "tokenizer_fingerprint": tokenizer.fingerprint, "cls_id": tokenizer.cls_id, "sep_id": tokenizer.sep_id,
                "pad_id": tokenizer.pad_id, "mask_id": tokenizer.mask_id, "special_ids": tokenizer.special_ids,
                "field": field, "seed": seed, "val_fraction": val_fraction, "mix": mix, "splits": splits,
                "sources": [{"name": n, "path": str(p), "sha256": sha256(p), "documents": len(lens)}
                            for n, p, lens in zip(names, paths, lengths)]}
        tmp["meta.json"].write_text(json.dumps(meta, indent=2) + "\n")
        # meta.json goes last, so a directory with a meta.json always holds the matching .bin files
        (out / "meta.json").unlink(missing_ok=True)
        for name in ("train.bin", "val.bin", "meta.json"):
            os.replace(tmp[name], out / name)
    finally:
        bar.close()
        for path in tmp.values():
            path.unlink(missing_ok=True)
    mb, seconds = sum(b for _, b in sources) / 1e6, time.time() - t0
    train, val = splits["train"], splits["val"]
    print(f"{out}: {mb:.1f} MB of text in {seconds:.1f} s ({mb / seconds:.2f} MB/s); train {train['tokens']:,} tokens "
          f"in {train['documents']:,} documents, val {val['tokens']:,} tokens in {val['documents']:,} documents")
    return meta


def load_meta(data_dir):
    """Read and check data_dir/meta.json, stopping with a message that names the file and what was expected."""
    path = Path(data_dir) / "meta.json"
    meta = read_json(path, "not found; run `python data.py prepare ...` (or `python data.py` for the demo)")
    keys = ("format", "dtype", "vocab_size", "tokenizer", "tokenizer_fingerprint", "cls_id", "sep_id", "pad_id",
            "mask_id", "special_ids", "splits")
    if not isinstance(meta, dict) or meta.get("format") != 1 or not all(k in meta for k in keys):
        raise DataError(f"{path}: not a format-1 meta.json written by `data.py prepare` (needs keys {', '.join(keys)})")
    vocab, dtype = meta["vocab_size"], meta["dtype"]
    ids = [meta[f"{n}_id"] for n in ("cls", "sep", "pad", "mask")]
    ids += meta["special_ids"] if isinstance(meta["special_ids"], list) else [None]
    for ok, expected in [
        (is_int(vocab) and 0 < vocab <= MAX_VOCAB, f"vocab_size an integer in [1, {MAX_VOCAB}], got {vocab!r}"),
        (dtype in ("uint16", "uint32"), f"dtype uint16 or uint32, got {dtype!r}"),
        (dtype != "uint16" or vocab <= 1 << 16, f"dtype uint32 for vocab_size {vocab} (uint16 holds ids < 65536)"),
        (all(is_int(i) and 0 <= i < vocab for i in ids), f"cls/sep/pad/mask_id and special_ids integers below "
                                                               f"vocab_size {vocab}, got {ids}"),
        (all(isinstance(meta[k], str) for k in ("tokenizer", "tokenizer_fingerprint")), "tokenizer strings")]:
        if not ok:
            raise DataError(f"{path}: expected {expected}")
    return meta


def count_windows(data_dir, split, seq_len):
    """Number of seq_len windows in data_dir/{split}.bin, from its size alone (no scan)."""
    if not is_int(seq_len) or seq_len < 1:
        raise DataError(f"seq_len must be a positive integer, got {seq_len!r}")
    return bin_tokens(Path(data_dir) / f"{split}.bin", np.dtype(load_meta(data_dir)["dtype"])) // seq_len


def stdlib_docstrings(max_bytes=1_000_000):
    """Docstrings of the standard library's .py files, read with ast: importing some modules has side effects.

    1 MB (the size of nanoGPT's shakespeare_char) keeps the build to a few seconds: parsing is the slow part."""
    root, total = Path(sysconfig.get_paths()["stdlib"]), 0
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(set(subfolders) - {"test", "tests", "idlelib", "site-packages", "lib2to3"})
        for name in sorted(f for f in files if f.endswith(".py")):
            try:
                tree = ast.parse(Path(folder, name).read_text(encoding="utf-8"))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node)
                    if doc:
                        yield doc
                        total += len(doc.encode())
                        if total >= max_bytes:
                            return


def prepare_demo(out_dir="data/demo"):
    """A small corpus with no download and no text in the repository: stdlib docstrings, byte tokenizer."""
    try:
        meta = load_meta(out_dir)
        if all((Path(out_dir) / f"{s}.bin").is_file() for s in ("train", "val")):
            print(f"{out_dir} is already prepared: {meta['splits']['train']['tokens']:,} train tokens")
            return meta
    except DataError:
        pass
    with tempfile.TemporaryDirectory() as tmp:
        return prepare([write_docstrings(Path(tmp) / "stdlib_docstrings.jsonl")], "bytes", out_dir, val_fraction=0.01)


def write_docstrings(path, max_bytes=1_000_000):
    """General English text with no download: the standard library's docstrings as JSONL (reproduce.py's
    stand-in for the general corpus a pretrained encoder saw). Written atomically; returns the path."""
    if max_bytes < 1:
        raise DataError(f"--max_bytes={max_bytes}: expected a positive size")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps({"text": d}) + "\n" for d in stdlib_docstrings(max_bytes)), encoding="utf-8")
    os.replace(tmp, path)
    return path


# ----------------------------------------------------------------------------
# A small tokenizer: byte-level BPE learned from the corpus (small models are mostly embedding with 50k tokens)

def word_counts(paths, field="text"):
    """How often each GPT-2 pre-token (the loader's split, after NFC) occurs in the documents of paths."""
    import regex  # tiktoken's own dependency: the stdlib re has no \p{L}
    split, counts = regex.compile(GPT2_PATTERN).findall, Counter()
    for path in paths:
        for text, _ in read_documents(path, field):
            counts.update(split(unicodedata.normalize("NFC", text)))
    return counts


def merge_pair(word, a, b, new):
    """word (a tuple of ids) with every non-overlapping (a, b), left to right, replaced by new."""
    out, i = [], 0
    while i < len(word):
        if word[i] == a and i + 1 < len(word) and word[i + 1] == b:
            out.append(new)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def learn_merges(counts, n_merges):
    """(token bytes by id, merges as id pairs): the most frequent adjacent pair first, ties to the smallest ids.

    Pair counts are updated incrementally: a merge revisits only the words that hold its pair (`where`), and a heap
    with stale entries (skipped when their count is out of date) gives the next best pair."""
    words, freqs = [tuple(w.encode()) for w in counts], list(counts.values())
    pairs, where = Counter(), defaultdict(set)
    for i, (word, f) in enumerate(zip(words, freqs)):
        for pair in zip(word, word[1:]):
            pairs[pair] += f
            where[pair].add(i)
    heap = [(-c, pair) for pair, c in pairs.items()]
    heapq.heapify(heap)
    tokens, merges = [bytes([b]) for b in range(256)], []
    known = set(tokens)
    while len(merges) < n_merges and heap:
        count, (a, b) = heapq.heappop(heap)
        if count == 0 or -count != pairs[(a, b)]:  # a pair gone from the corpus, or a stale entry
            continue
        del pairs[(a, b)]
        if tokens[a] + tokens[b] in known:  # a second spelling of a token: tiktoken ranks allow one merge per token
            continue
        new = len(tokens)
        tokens.append(tokens[a] + tokens[b])
        known.add(tokens[-1])
        merges.append((a, b))
        delta = Counter()
        for i in where.pop((a, b)):
            old, f = words[i], freqs[i]
            words[i] = merge_pair(old, a, b, new)
            for pair in zip(old, old[1:]):
                delta[pair] -= f
            for pair in zip(words[i], words[i][1:]):
                delta[pair] += f
                where[pair].add(i)
        for pair, d in delta.items():
            if d and pair != (a, b):
                pairs[pair] += d
                heapq.heappush(heap, (-pairs[pair], pair))
    return tokens, merges


def train_tokenizer(inputs, vocab_size, out, field="text"):
    """Learn a byte-level BPE with vocab_size ids (the 4 special tokens last) and write it as a tokenizer.json."""
    t0, paths, out = time.time(), [Path(p) for p in inputs], Path(out)
    check_tokenizer_args(paths, vocab_size, out)
    counts = word_counts(paths, field)
    tokens, merges = learn_merges(counts, vocab_size - 256 - len(SPECIALS))
    b2u = byte_to_unicode()
    spell = ["".join(b2u[c] for c in t) for t in tokens]
    added = [special_token(name, len(tokens) + i) for i, name in enumerate(SPECIALS)]
    added[SPECIALS.index("[MASK]")]["lstrip"] = True  # as ModernBERT's: "a [MASK]" keeps the space out of the text
    config = byte_level_config({s: i for i, s in enumerate(spell)}, [[spell[a], spell[b]] for a, b in merges], added,
                               {"type": "NFC"})
    tokenizer = Tokenizer(config, str(out))  # the loader's checks (ids in merge order, every byte) on what we learned
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(tokenizer.hf_files["tokenizer.json"], encoding="utf-8")
    os.replace(tmp, out)
    print(f"{out}: {tokenizer.vocab_size:,} ids ({len(merges):,} merges) learned from {sum(counts.values()):,} words "
          f"({len(counts):,} distinct) in {time.time() - t0:.1f} s")
    if tokenizer.vocab_size < vocab_size:
        print(f"warning: the corpus allows only {len(merges):,} merges, so the vocabulary has {tokenizer.vocab_size:,} "
              f"ids, not --vocab_size={vocab_size:,}", file=sys.stderr)
    return tokenizer


# ----------------------------------------------------------------------------
# Batches

def bin_tokens(path, dtype):
    """Number of tokens in a .bin, from its size, after checking that the size fits the dtype."""
    if not path.is_file():
        raise DataError(f"{path}: not found")
    size = path.stat().st_size
    if size % dtype.itemsize:
        raise DataError(f"{path}: size {size} bytes is not a multiple of {dtype.name} ({dtype.itemsize} bytes); "
                        f"truncated or wrong dtype")
    return size // dtype.itemsize


def check_bin(path, dtype, vocab_size):
    """Number of tokens in a .bin, after checking its size and (one chunked scan) that every id is < vocab_size."""
    n = bin_tokens(path, dtype)
    if n:
        tokens = np.memmap(path, dtype=dtype, mode="r")
        top = max(int(tokens[i:i + (1 << 24)].max()) for i in range(0, n, 1 << 24))
        if top >= vocab_size:
            raise DataError(f"{path}: max token id {top} but vocab_size is {vocab_size} (wrong tokenizer or corrupt)")
    return n


class Loader:
    """Micro-batches of seq_len windows in a seeded order that depends only on data_seed and the sequence index.

    Global sequence g is window perm_e[g % n_windows] with e = g // n_windows; optimizer step s covers sequences
    [g0, g0 + batch_size), split over micro-steps and ranks, so the same set for any world size or accumulation.
    data_seed=None keeps file order (fixed validation batches).
    """

    def __init__(self, data_dir, split="train", seq_len=8192, batch_size=384, micro_batch_size=4, rank=0, world_size=1,
                 objective="mlm", mask_rate=0.3, data_seed=42, mask_seed=17):
        assert objective in ("mlm", "clm"), objective
        self.meta = load_meta(data_dir)
        self.path, self.dtype = Path(data_dir) / f"{split}.bin", np.dtype(self.meta["dtype"])
        n_tokens = check_bin(self.path, self.dtype, self.meta["vocab_size"])
        if seq_len > n_tokens:
            raise DataError(f"{self.path}: seq_len {seq_len} is longer than the data ({n_tokens} tokens)")
        self.split, self.seq_len, self.n_windows = split, seq_len, n_tokens // seq_len
        self.batch_size, self.micro_batch_size = batch_size, micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.accum, rest = divmod(batch_size, micro_batch_size * world_size)
        assert rest == 0 and self.accum > 0, f"batch_size {batch_size} != k * {micro_batch_size} * {world_size}"
        self.objective, self.mask_rate, self.data_seed, self.mask_seed = objective, mask_rate, data_seed, mask_seed
        # like HF's DataCollatorForLanguageModeling, no special token is ever masked: not [PAD], nor [CLS]/[SEP]
        self.special = np.zeros(self.meta["vocab_size"], bool)
        self.special[self.meta["special_ids"]] = True
        self.replacements = np.flatnonzero(~self.special)  # ids a random replacement may take
        self.sequence, self.micro_step, self.perms = 0, 0, {}

    def windows(self, g):
        """Window index of each global sequence index in g."""
        if self.data_seed is None:
            return g % self.n_windows
        out = np.empty_like(g)
        for e in np.unique(g // self.n_windows):
            if e not in self.perms:
                self.perms = {e: np.random.default_rng([self.data_seed, int(e)]).permutation(self.n_windows)}
            here = g // self.n_windows == e
            out[here] = self.perms[e][g[here] % self.n_windows]
        return out

    def batch(self, g):
        """(x, y) int64 tensors (len(g), seq_len) for global sequence indices g."""
        tokens = np.memmap(self.path, dtype=self.dtype, mode="r")  # re-opened per read, as nanoGPT, against a leak
        T = self.seq_len
        x = np.stack([tokens[w * T:(w + 1) * T] for w in self.windows(g)]).astype(np.int64)  # (B, T)
        y = np.full_like(x, -100)
        if self.objective == "clm":
            y[:, :-1] = x[:, 1:]
            y[x == self.meta["sep_id"]] = -100  # [SEP] ends a document: it does not predict the next one
        else:
            for i, gi in enumerate(g):  # the mask depends on (mask_seed, g) only: not on split, rank or phase
                rng = np.random.default_rng([self.mask_seed, int(gi)])
                chosen = (rng.random(T) < self.mask_rate) & ~self.special[x[i]]
                kind = rng.random(T)  # 80% [MASK], 10% random token, 10% unchanged
                random_ids = self.replacements[rng.integers(0, len(self.replacements), T)]
                y[i, chosen] = x[i, chosen]
                x[i, chosen & (kind < 0.8)] = self.meta["mask_id"]
                swap = chosen & (kind >= 0.8) & (kind < 0.9)
                x[i, swap] = random_ids[swap]
        return torch.from_numpy(x), torch.from_numpy(y)

    def next(self):
        """This rank's next micro-batch; the position moves by batch_size after `accum` of them."""
        start = self.sequence + (self.micro_step * self.world_size + self.rank) * self.micro_batch_size
        xy = self.batch(np.arange(start, start + self.micro_batch_size))
        self.micro_step += 1
        if self.micro_step == self.accum:
            self.sequence, self.micro_step = self.sequence + self.batch_size, 0
        return xy

    # what must match to continue the same sequences and masks; objective and mask_rate may change (phase switch)
    MATCH = ("split", "seq_len", "n_windows", "data_seed", "mask_seed")

    def state_dict(self):
        assert self.micro_step == 0, "state_dict() is only meaningful at an optimizer-step boundary"
        return {"sequence": self.sequence, **{k: getattr(self, k) for k in self.MATCH}}

    def load_state_dict(self, state):
        for key in self.MATCH:
            if state.get(key) != getattr(self, key):
                raise DataError(f"{self.path}: loader state has {key}={state.get(key)} but this loader has "
                                f"{getattr(self, key)}")
        self.sequence, self.micro_step = int(state["sequence"]), 0


def val_batches(data_dir, seq_len, n_sequences, micro_batch_size, objective, mask_rate=0.15, seed=0, rank=0,
                world_size=1):
    """Fixed validation micro-batches: the first n_sequences windows of val.bin in file order, same masks every call."""
    loader = Loader(data_dir, "val", seq_len, micro_batch_size, micro_batch_size, objective=objective,
                    mask_rate=mask_rate, data_seed=None, mask_seed=seed)
    n = min(n_sequences, loader.n_windows)
    for start in range(rank * micro_batch_size, n, micro_batch_size * world_size):
        yield loader.batch(np.arange(start, min(start + micro_batch_size, n)))


def document_ids(x, sep_id):
    """(B, T) -> (B, T) int32 document index; [SEP] belongs to the document it ends."""
    sep = (x == sep_id).int()
    return (sep.cumsum(1) - sep).int()


# ----------------------------------------------------------------------------
# Command line

def parse_mix(text):
    try:
        return {k.strip(): float(v) for k, v in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected name=weight,name=weight") from None


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one `error: ...` line and exit code 2, like every other bad input here."""

    def error(self, message):
        raise DataError(f"{self.prog}: {message}")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    parser = Parser(description="Prepare token data (no arguments: build data/demo).")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="tokenize text files into train.bin, val.bin and meta.json")
    p.add_argument("--input", nargs="+", required=True, help=".jsonl, .txt (blank-line separated) or .parquet")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json path, hub id, or 'bytes'")
    p.add_argument("--out", required=True)
    p.add_argument("--field", default="text", help="the text field of .jsonl/.parquet rows")
    p.add_argument("--mix", type=parse_mix, help="target train-token shares per source, e.g. en=0.6,fr=0.4")
    p.add_argument("--val_fraction", type=float, default=0.005)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--workers", type=int, default=None, help="tokenizer threads (default: all cores)")
    t = sub.add_parser("tokenizer", help="learn a small byte-level BPE tokenizer.json from text files")
    t.add_argument("--input", nargs="+", required=True, help=".jsonl, .txt (blank-line separated) or .parquet")
    t.add_argument("--vocab_size", type=int, required=True, help="number of ids, the 4 special tokens included")
    t.add_argument("--out", required=True, help="the tokenizer.json to write")
    t.add_argument("--field", default="text", help="the text field of .jsonl/.parquet rows")
    d = sub.add_parser("docstrings", help="write the standard library's docstrings as JSONL (general text)")
    d.add_argument("--out", required=True, help="the .jsonl to write")
    d.add_argument("--max_bytes", type=int, default=1_000_000, help="stop after this much text")
    try:
        if not argv:
            prepare_demo()
            return
        a = parser.parse_args(argv)
        if a.command == "tokenizer":
            train_tokenizer(a.input, a.vocab_size, a.out, a.field)
        elif a.command == "docstrings":
            print(f"{write_docstrings(a.out, a.max_bytes)}: {Path(a.out).stat().st_size / 1e6:.1f} MB of docstrings")
        else:
            prepare(a.input, a.tokenizer, a.out, a.field, a.mix, a.val_fraction, a.seed, a.workers)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
