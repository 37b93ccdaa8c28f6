"""Tokenizers: a Hugging Face tokenizer.json (byte-level BPE) run by tiktoken with ids identical to the
`tokenizers` library, the built-in byte tokenizer, and a small byte-level BPE learned from a corpus.
A reader of the recipe may skip this file: data.py calls load_tokenizer and learn_bpe.

Four facts of Hugging Face's byte-level BPE that a port must reproduce:
- the ByteLevel pre-tokenizer splits text with the GPT-2 pattern before any merge;
- added tokens are found in the text first (leftmost, longest), never merged, and swallow the whitespace
  beside them when they have lstrip/rstrip;
- added tokens with normalized=false are searched in the raw text, the others after the normalizer;
- tiktoken applies merges by rank, so a token's id must be its merge's rank: ids in merge order.
"""
import functools
import hashlib
import heapq
import json
import re
import unicodedata
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import tiktoken

from machinery.cli import InputError, read_json, usable_cores, write_text
from machinery.hf import hub_id_problem

# Hugging Face's ByteLevel pre-tokenizer splits with the GPT-2 pattern.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
GPT2_DIGEST = "eeb55ba74cc544ae"  # of the line above as GPT-2 (and ModernBERT) have it: see the fingerprint
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
MIN_LEARNED = 256 + len(SPECIALS) + 1  # the smallest vocabulary learn_bpe makes: the bytes, the specials, a merge
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
            raise InputError(f"{spec}: not a usable tokenizer.json: {expected}")
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
    require(min(ids) >= 0 and max(ids) < MAX_VOCAB,
            f"token ids must lie in [0, {MAX_VOCAB}), found {min(ids)} to {max(ids)}")
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
                raise InputError(f"{spec}: unsupported tokenizer, {field} must be {expected}")
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
        # The split pattern too: it decides the pieces merges apply to, and an edit to it tokenizes text anew. GPT-2's
        # is left out, so that corpora prepared before the pattern was counted still pass with the one they were made with.
        edited = {} if hashlib.sha256(GPT2_PATTERN.encode()).hexdigest()[:16] == GPT2_DIGEST else {"pattern": GPT2_PATTERN}
        self.fingerprint = hashlib.sha256(json.dumps(  # sorted items: sort_keys on the big vocab dict is slow
            {"vocab": sorted(vocab.items()), "merges": merges, "added_tokens": added, "normalizer": norm} | edited,
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
        # added tokens with normalized=false are split from the raw text, the others after normalizing
        self.added = {t["content"]: t for t in added}
        self.added |= {self.normalize(t["content"]): t for t in added if t["normalized"]}
        self.raw = self._matcher([t["content"] for t in added if not t["normalized"]])
        self.normalized = self._matcher([self.normalize(t["content"]) for t in added if t["normalized"]])

    def _ranks(self, vocab, merges, added):
        """tiktoken's mergeable_ranks (token bytes -> id), after checking that id order is merge order."""
        to_latin1 = str.maketrans({u: chr(b) for b, u in byte_to_unicode().items()})
        added_ids = {t["id"] for t in added}
        try:
            ranks = {s.translate(to_latin1).encode("latin-1"): i for s, i in vocab.items() if i not in added_ids}
        except UnicodeEncodeError as e:
            raise InputError(f"{self.spec}: vocab entry {e.object!r} is not byte-level") from None
        # every byte that UTF-8 text can contain must be a token (0xC0, 0xC1 and 0xF5-0xFF never occur)
        missing = [b for b in [*range(0xC0), *range(0xC2, 0xF5)] if bytes([b]) not in ranks]
        if missing:
            raise InputError(f"{self.spec}: vocab lacks single bytes {missing[:8]}; a byte-level BPE needs them")
        results = np.array([vocab.get(m.replace(" ", ""), -1) for m in merges], dtype=np.int64)  # byte-level: no " "
        bad = np.flatnonzero((results < 0) | (np.diff(results, prepend=-1) <= 0))
        if len(bad):
            raise InputError(f"{self.spec}: merge {bad[0]} ({merges[bad[0]]!r}) does not produce a vocab id larger "
                             f"than the previous merge's; tiktoken needs ids in merge order")
        made = set(results.tolist())
        orphans = [s for s, i in vocab.items() if len(s) > 1 and i not in made and i not in added_ids]
        if orphans:
            raise InputError(f"{self.spec}: vocab entries {orphans[:5]} are not the result of any merge")
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
        n = max(1, min(num_threads or usable_cores(), len(texts)))
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
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json, which AutoTokenizer loads, each
        whole or not at all."""
        for name, text in self.hf_files.items():
            write_text(Path(out_dir, name), text)


def load_tokenizer(spec):
    """spec: a tokenizer.json path, a Hugging Face hub id (fetches its tokenizer.json), or "bytes"."""
    spec = str(spec)
    if spec == "bytes":
        return Tokenizer(bytes_config(), spec)
    path = Path(spec)
    if not path.exists() and not spec.endswith(".json") and not hub_id_problem(spec):
        try:
            from huggingface_hub import hf_hub_download
            path = Path(hf_hub_download(spec, "tokenizer.json"))
        except Exception as e:
            raise InputError(f"could not fetch tokenizer.json of hub id {spec!r} ({type(e).__name__}); "
                             f"without network pass the path of a local tokenizer.json") from None
    return Tokenizer(read_json(path, "a tokenizer.json, a hub id, or 'bytes'"), spec)


# ----------------------------------------------------------------------------------------------------
# A small tokenizer: byte-level BPE learned from a corpus (a small model with 50k ids is mostly embedding)

def word_counts(texts):
    """How often each GPT-2 pre-token (the tokenizer's own split, after NFC) occurs in texts."""
    import regex  # tiktoken's own dependency: the stdlib re has no \p{L}
    split, counts = regex.compile(GPT2_PATTERN).findall, Counter()
    for text in texts:
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


def learn_bpe(texts, vocab_size, name):
    """(Tokenizer, word counts): a byte-level BPE of at most vocab_size ids learned from texts, the 4 special
    tokens last. Fewer ids when the corpus runs out of pairs to merge."""
    if not is_int(vocab_size) or not MIN_LEARNED <= vocab_size <= MAX_VOCAB:
        raise InputError(f"vocab_size={vocab_size}: expected an integer in [{MIN_LEARNED}, {MAX_VOCAB}]")
    counts = word_counts(texts)
    tokens, merges = learn_merges(counts, vocab_size - 256 - len(SPECIALS))
    b2u = byte_to_unicode()
    spell = ["".join(b2u[c] for c in t) for t in tokens]
    added = [special_token(name, len(tokens) + i) for i, name in enumerate(SPECIALS)]
    added[SPECIALS.index("[MASK]")]["lstrip"] = True  # as ModernBERT's: "a [MASK]" keeps the space out of the text
    config = byte_level_config({s: i for i, s in enumerate(spell)}, [[spell[a], spell[b]] for a, b in merges], added,
                               {"type": "NFC"})
    return Tokenizer(config, str(name)), counts  # the loader's checks (merge order, every byte) on what we learned
