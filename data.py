r"""
Data for continued pretraining of ModernBERT, top to bottom: text in, token files out, batches.

    python data.py                 # data/demo: stdlib docstrings and a BPE learned from them
    python data.py prepare --input a.jsonl b.txt --tokenizer answerdotai/ModernBERT-base \
        --out data/mix --mix a=0.7,b=0.3
    python data.py tokenizer --input a.jsonl --vocab_size 8192 --out tok8k.json  # a small BPE
    python data.py code --out data/code.jsonl --heldout data/code-heldout.jsonl  # a new domain: stdlib code
    python data.py fetch --out data/bio   # the studies' corpus, tasks and held-out texts, from public sources

1. Packing: a .bin is its documents end to end, each [CLS] tokens [SEP], and a sequence is any
   window of seq_len tokens, across documents (document_ids tells them apart where attention should).
2. The Loader: windows in a seeded order, a micro-batch per call, a position for exact resume.
3. Objectives: the labels of each objective (MLM masking, CLM next token), one function each.
4. Prepare: documents are split into train and validation, shuffled, mixed by weight and written
   as train.bin and val.bin (one uint16 or uint32 per token), with meta.json beside them.
The machinery behind them: reading files (.jsonl, .txt, .parquet; .gz, .zst; folders, globs) in
worker processes, the same bytes for any number of them (machinery/prepare.py); meta.json and
the .bin files checked against each other (machinery/tokenfiles.py); the tokenizers, a
tokenizer.json run by tiktoken and the BPE trainer (machinery/tokenizer.py); the command line,
the demo corpus (the standard library's docstrings and a BPE learned from them) and the BPE
trainer's command (machinery/datacli.py).
"""
import json
import mmap
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from machinery import datacli

if __name__ == "__main__":  # the flags, checked before torch is imported: a typo is answered in a second
    datacli.check_command_line(__doc__)

import numpy as np
import torch

from machinery.cli import InputError, run, usable_cores
from machinery.prepare import (Workers, check_prepare_args, describe, find_sources, publish, tokenize, worker_count,
                               workspace, write_documents)
from machinery.tokenfiles import check_tokenizer, load_meta, split_tokens  # noqa: F401 (train.py's data.check_tokenizer)
from machinery.tokenfiles import check_same_tokens, file_digest
from machinery.tokenizer import Tokenizer, is_int, load_tokenizer


# ----------------------------------------------------------------------------
# 1. Packing: a .bin is one long row of tokens; a sequence is any window of seq_len of them


def count_windows(data_dir, split, seq_len):
    """Number of seq_len windows in data_dir/{split}.bin, the file checked against meta.json."""
    if not is_int(seq_len) or seq_len < 1:
        raise InputError(f"seq_len must be a positive integer, got {seq_len!r}")
    return split_tokens(data_dir, load_meta(data_dir), split) // seq_len


def document_ids(x, sep_id):
    """(B, T) -> (B, T) int32 document index; [SEP] belongs to the document it ends."""
    sep = (x == sep_id).int()
    return (sep.cumsum(1) - sep).int()


# ----------------------------------------------------------------------------
# 2. The Loader


class Loader:
    """Micro-batches of seq_len windows in a seeded order that depends only on data_seed and the
    global sequence index g, so that any batch is rebuilt from its position (exact resume).

    Sequence g is window perm_e[g % n_windows] of epoch e = g // n_windows. Optimizer step s
    covers sequences [g0, g0 + batch_size), split over micro-steps and ranks: the same set for any
    world size or accumulation. data_seed=None keeps file order (fixed validation batches).

    next() returns a micro-batch whose ids are on `device` (prefetch() copies them from pinned memory
    while the device works on the previous one) and whose labels stay on the host, where the model
    finds the positions to predict without a device sync. state_dict() is the position of the
    batch that the next next() returns, whatever was prefetched.

    The token file is read through np.memmap. Windows in a seeded order are random reads: the
    kernel is told so, and asked for each window's pages at once (advise=True); left to its
    read-ahead around each page touched, it reads tens of times the bytes a window needs from a
    file not in memory (`bench.py data` measures both).
    """

    def __init__(self, data_dir, split="train", seq_len=8192, batch_size=384, micro_batch_size=4,
                 rank=0, world_size=1, objective="mlm", mask_rate=0.3, data_seed=42, mask_seed=17,
                 device=None, advise=True):
        if objective not in OBJECTIVES:
            raise InputError(f"objective {objective!r}: expected one of {', '.join(OBJECTIVES)}")
        self.meta = load_meta(data_dir)
        self.path, self.dtype = Path(data_dir) / f"{split}.bin", np.dtype(self.meta["dtype"])
        self.n_tokens = split_tokens(data_dir, self.meta, split)
        self.checked = self.path.stat()  # the file whose size, ids and fingerprint were checked
        self.sample_sha256 = self.meta["splits"][split].get("sample_sha256")  # None: a meta.json older than it
        if seq_len > self.n_tokens:
            raise InputError(f"{self.path}: seq_len {seq_len} is longer than the data "
                             f"({self.n_tokens} tokens)")
        self.split, self.seq_len, self.n_windows = split, seq_len, self.n_tokens // seq_len
        self.batch_size, self.micro_batch_size = batch_size, micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.accum, rest = divmod(batch_size, micro_batch_size * world_size)
        if rest or not self.accum:
            raise InputError(f"batch_size {batch_size} is not a multiple of micro_batch_size "
                             f"{micro_batch_size} x {world_size} process(es)")
        self.objective, self.mask_rate = objective, mask_rate
        self.data_seed, self.mask_seed = data_seed, mask_seed
        self.vocab = Vocab(self.meta)
        self.device = None if device is None else torch.device(device)
        self.sequence, self.micro_step = 0, 0  # the position of the batch next() returns
        self.ahead, self.perms = None, {}
        self.random_reads = advise and data_seed is not None  # file order (validation) reads ahead well

    def windows(self, g):
        """Window index of each global sequence index in g."""
        if self.data_seed is None:
            return g % self.n_windows
        out = np.empty_like(g)
        for e in np.unique(g // self.n_windows):
            if e not in self.perms:  # one epoch's permutation kept: the next batch is likely in it
                rng = np.random.default_rng([self.data_seed, int(e)])
                self.perms = {e: rng.permutation(self.n_windows)}
            here = g // self.n_windows == e
            out[here] = self.perms[e][g[here] % self.n_windows]
        return out

    def tokens(self, windows):
        """The split's tokens, (n_tokens,) through np.memmap, mapped anew for each batch (a file
        replaced or cut since it was checked is an error here, not a crash at a page fault), the
        kernel told which windows will be read."""
        with open(self.path, "rb") as f:
            now = os.fstat(f.fileno())
            if not os.path.samestat(now, self.checked):
                raise InputError(f"{self.path}: replaced after this run checked it (by another "
                                 f"data.py prepare?); its windows are not the ones checked")
            if now.st_size < self.n_tokens * self.dtype.itemsize:
                raise InputError(f"{self.path}: no longer holds its {self.n_tokens} tokens: it was "
                                 f"cut after this run checked it")
            if now.st_mtime_ns != self.checked.st_mtime_ns:  # in place: no read of the tokens to see it
                raise InputError(f"{self.path}: written to after this run checked it: its windows may "
                                 f"not be the ones checked. The last checkpoint is kept; --resume "
                                 f"checks the file again")
            tokens = np.memmap(f, self.dtype, "r", shape=(self.n_tokens,))
        if self.random_reads and hasattr(mmap, "MADV_RANDOM"):
            tokens.base.madvise(mmap.MADV_RANDOM)  # tokens.base: the mmap np.memmap made
            span, page = self.seq_len * self.dtype.itemsize, mmap.PAGESIZE
            for start in (int(w) * span for w in windows):  # every window's pages, requested at once
                tokens.base.madvise(mmap.MADV_WILLNEED, start // page * page, start % page + span)
        return tokens

    def batch(self, g):
        """(x, y) int64 tensors (len(g), seq_len) for global sequence indices g: the windows, then
        the objective's inputs and labels."""
        T, windows = self.seq_len, self.windows(g)
        tokens = self.tokens(windows)
        x = np.stack([tokens[w * T:(w + 1) * T] for w in windows]).astype(np.int64)
        del tokens  # unmapped
        vocab = len(self.vocab.special)
        above = np.flatnonzero(x.max(1) >= vocab)  # every id a step sees: the open read a sample
        if len(above):
            i, start = above[0], windows[above[0]] * T
            raise InputError(f"{self.path}: id {x[i].max()} in tokens {start} to {start + T - 1}, "
                             f"above the vocabulary of {vocab} (a file of another tokenizer or "
                             f"dtype?)")
        x, y = OBJECTIVES[self.objective].labels(x, g, self.vocab, self.mask_rate, self.mask_seed)
        return torch.from_numpy(x), torch.from_numpy(y)  # (B, T) each

    def prepare(self):
        """This rank's micro-batch at the current position, its ids on their way to the device."""
        B = self.micro_batch_size
        start = self.sequence + (self.micro_step * self.world_size + self.rank) * B
        x, y = self.batch(np.arange(start, start + B))
        if self.device is not None and self.device.type == "cuda":
            x = x.pin_memory().to(self.device, non_blocking=True)
        return x, y

    def next(self):
        """This rank's next micro-batch (the one prefetch() prepared, if it did); the position moves
        by batch_size after `accum` of them."""
        xy = self.ahead if self.ahead is not None else self.prepare()
        self.ahead = None
        self.micro_step += 1
        if self.micro_step == self.accum:
            self.sequence, self.micro_step = self.sequence + self.batch_size, 0
        return xy

    def prefetch(self):
        """Prepare the batch the next next() returns, while the device works on this one. The
        position does not move: a checkpoint taken now resumes at that batch."""
        if self.ahead is None:
            self.ahead = self.prepare()

    # what must match to continue the same sequences and masks; the objective and mask_rate may
    # change (a phase hand-off), and so may the world size and the micro-batch size
    MATCH = ("split", "seq_len", "n_windows", "data_seed", "mask_seed")

    def state_dict(self):
        assert self.micro_step == 0, "state_dict() is only meaningful at an optimizer-step boundary"
        return {"sequence": self.sequence, **{k: getattr(self, k) for k in self.MATCH},
                "sample_sha256": self.sample_sha256}  # which tokens: a resume reads these again

    def load_state_dict(self, state, where="the loader state"):
        """Continue at a saved position. The state was read from a file: every field is checked."""
        def require(key, ok, expected):
            if key not in state or not ok(state[key]):
                got = repr(state[key]) if key in state else "missing"
                raise InputError(f"{where}: {key} is {got}, expected {expected}")
        if not isinstance(state, dict):
            raise InputError(f"{where}: expected an object, got {type(state).__name__}")
        require("sequence", lambda v: is_int(v) and 0 <= v < 1 << 62, "an integer in [0, 2**62)")
        for key in self.MATCH:
            mine = getattr(self, key)
            require(key, lambda v: type(v) is type(mine) and v == mine,
                    f"{mine!r}, as this loader has (other data, seq_len or seeds: other batches)")
        check_same_tokens(state.get("sample_sha256"), self.sample_sha256, self.path, where)
        self.sequence, self.micro_step, self.ahead = state["sequence"], 0, None


def val_batches(data_dir, seq_len, n_sequences, micro_batch_size, objective, mask_rate=0.15,
                seed=0, rank=0, world_size=1):
    """Fixed validation micro-batches: the first n_sequences windows of val.bin in file order,
    with the same masks at every call."""
    loader = Loader(data_dir, "val", seq_len, micro_batch_size, micro_batch_size,
                    objective=objective, mask_rate=mask_rate, data_seed=None, mask_seed=seed)
    n = min(n_sequences, loader.n_windows)
    for start in range(rank * micro_batch_size, n, micro_batch_size * world_size):
        yield loader.batch(np.arange(start, min(start + micro_batch_size, n)))


# ----------------------------------------------------------------------------
# 3. Objectives: f(x, g, vocab, rate, seed) -> (inputs, labels), (B, T) int64 arrays each.
# x holds the windows of the global sequences g; a label -100 takes no loss. Each function depends
# on g and the seed only, never on a counter or a global RNG: a batch is rebuilt exactly from its
# position on resume, on any number of ranks. A new objective, or a masking rate that is a
# function of g (a schedule), is one function and one entry in OBJECTIVES, which also says whether
# it attends causally and whether mask_rate picks its predicted positions: what the trainer, its
# checks and its FLOP count read of an objective, never its name.


def mlm_labels(x, g, vocab, rate, seed):
    """Masked language modelling as in BERT: each token is chosen with probability `rate` (one
    number, or one per sequence), never a special token; of the chosen, 80% become [MASK], 10% a
    random non-special token and 10% stay; the labels are the chosen tokens."""
    x, y = x.copy(), np.full_like(x, -100)
    T = x.shape[1]
    for i, (gi, r) in enumerate(zip(g, np.broadcast_to(rate, len(g)))):
        rng = np.random.default_rng([seed, int(gi)])  # not the split, rank or phase: same masks
        chosen = (rng.random(T) < r) & ~vocab.special[x[i]]
        kind = rng.random(T)
        random_ids = vocab.replacements[rng.integers(0, len(vocab.replacements), T)]
        y[i, chosen] = x[i, chosen]
        x[i, chosen & (kind < 0.8)] = vocab.mask_id
        swap = chosen & (kind >= 0.8) & (kind < 0.9)
        x[i, swap] = random_ids[swap]
    return x, y


def clm_labels(x, g, vocab, rate, seed):
    """Causal language modelling: each token predicts the next. [SEP] ends a document, so it
    predicts nothing (not the next document's [CLS]), and neither does a window's last token."""
    y = np.full_like(x, -100)
    y[:, :-1] = x[:, 1:]
    y[x == vocab.sep_id] = -100
    return x, y


@dataclass(frozen=True)
class Objective:
    labels: Callable  # (x, g, vocab, rate, seed) -> (inputs, labels)
    causal: bool  # attention: causal (each position sees those before it) or bidirectional
    masked: bool  # mask_rate picks the positions predicted (else every position is)


OBJECTIVES = {"mlm": Objective(mlm_labels, causal=False, masked=True),
              "clm": Objective(clm_labels, causal=True, masked=False)}


class Vocab:
    """What the objectives know of the token ids, from meta.json."""

    def __init__(self, meta):
        self.mask_id, self.sep_id = meta["mask_id"], meta["sep_id"]
        # as Hugging Face's DataCollatorForLanguageModeling: a special token is never masked
        self.special = np.zeros(meta["vocab_size"], bool)  # (vocab_size,)
        self.special[meta["special_ids"]] = True
        # the ids this code frames, pads and masks with, even where a tokenizer.json does not flag them special
        self.special[[meta["cls_id"], meta["sep_id"], meta["pad_id"], meta["mask_id"]]] = True
        self.replacements = np.flatnonzero(~self.special)  # the ids a random replacement may take


# ----------------------------------------------------------------------------
# 4. Prepare: text files -> train.bin, val.bin, meta.json


def prepare(inputs, tokenizer_spec, out_dir, field="text", mix=None, val_fraction=0.005,
            seed=1337, workers=None):
    """Tokenize inputs into out_dir/{train,val}.bin and meta.json; returns the meta dict.
    Inputs are files, folders (one source of their files) or globs (machinery/prepare.py). The work
    is shared by `workers` processes (default: one per usable core); the files are the same bytes
    for any number of them. They are written in a folder of this process's own and moved into
    place at the end, under out_dir/.lock: a failure leaves nothing half-written (nor an out_dir
    it made), and a second prepare into the same folder while this one runs is refused."""
    t0, out = time.time(), Path(out_dir)
    sources = find_sources(inputs)
    names, workers = [s.name for s in sources], usable_cores() if workers is None else workers
    check_prepare_args(names, out, mix, val_fraction, seed, workers)
    workers = worker_count(workers, sources, field)  # no more than the cores and the pieces
    tokenizer = tokenizer_spec
    if not isinstance(tokenizer, Tokenizer):
        tokenizer = load_tokenizer(tokenizer_spec)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    with workspace(out) as (tmp, lock), Workers(workers, tokenizer, lock) as pool:
        # every document as [CLS] ids [SEP], source after source, in input order
        tokens = tmp / "all.tokens"
        lengths, keys, text_bytes, digests = tokenize(sources, field, dtype, tokens, pool,
                                                      f"tokenizing into {out}")
        train, val, copies = choose_documents(lengths, names, mix, val_fraction, seed, keys)
        if not sum(map(len, val)):
            counts = ", ".join(f"{s.path} has {len(lens)}" for s, lens in zip(sources, lengths))
            raise InputError(f"--input: the validation split is empty ({counts} document(s)); "
                             f"val needs at least one document and train keeps one per input, so "
                             f"give an input 2 or more documents (.txt: separated by a blank line)")
        splits = {split: write_split(tmp / f"{split}.bin", tokens, dtype, lengths, chosen, names,
                                     np.random.default_rng([seed, len(sources), split == "val"]),
                                     pool)
                  for split, chosen in (("train", train), ("val", val))}
        for split, counts in splits.items():  # the tokens' fingerprint, checked whenever they are read
            counts["sample_sha256"] = file_digest(tmp / f"{split}.bin", dtype, counts["tokens"])
        splits["train"]["copies_of_val_left_out"] = copies
        every = np.concatenate(keys)
        repeats = len(every) - len(np.unique(every))  # said: a corpus may hold a case twice
        # a tokenizer file is recorded by absolute path: a run started elsewhere still finds it
        spec = Path(tokenizer.spec)
        meta = dict(format=1, dtype=dtype.name, vocab_size=tokenizer.vocab_size,
                    tokenizer=str(spec.resolve()) if spec.is_file() else tokenizer.spec,
                    tokenizer_fingerprint=tokenizer.fingerprint, cls_id=tokenizer.cls_id,
                    sep_id=tokenizer.sep_id, pad_id=tokenizer.pad_id, mask_id=tokenizer.mask_id,
                    special_ids=tokenizer.special_ids, field=field, seed=seed,
                    val_fraction=val_fraction, mix=mix, splits=splits,
                    sources=[describe(s, d, len(lens))
                             for s, d, lens in zip(sources, digests, lengths)])
        (tmp / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
        publish(tmp, out, ("train.bin", "val.bin", "meta.json"))
    mb, seconds = text_bytes / 1e6, time.time() - t0
    print(f"{out}: {mb:.1f} MB of text in {seconds:.1f} s ({mb / seconds:.2f} MB/s, {workers} "
          f"worker{'s' * (workers > 1)}); " + ", ".join(
              f"{k} {v['tokens']:,} tokens in {v['documents']:,} documents" for k, v in splits.items())
          + (f"; {copies:,} left out of train as copies of validation documents" if copies else "")
          + (f"; {repeats:,} document(s) repeat another's text (kept)" if repeats else ""))
    return meta


def choose_documents(lengths, names, mix, val_fraction, seed, keys):
    """(train, val, copies): document indices per source, and how many train left out. Validation is
    drawn first, so that mixing never repeats a validation document in train; a document whose text
    is a validation document's (`keys`: a digest of each text) is left out of train, or validation
    would score text the model trained on (a corpus may hold a case twice)."""
    rngs = [np.random.default_rng([seed, i]) for i in range(len(lengths))]
    train, val = [], []
    for lens, rng in zip(lengths, rngs):
        n = len(lens)
        n_val = min(n - 1, max(1, round(val_fraction * n))) if val_fraction > 0 and n >= 2 else 0
        is_val = np.zeros(n, bool)
        is_val[rng.choice(n, n_val, replace=False)] = True
        train.append(np.flatnonzero(~is_val))
        val.append(np.flatnonzero(is_val))
    held = np.concatenate([k[docs] for k, docs in zip(keys, val)])
    kept = [docs[~np.isin(k[docs], held)] for k, docs in zip(keys, train)]
    for name, a, b in zip(names, train, kept):
        if len(a) and not len(b):
            raise InputError(f"--input {name}: every train document of it is a copy of a validation one")
    copies, train = sum(len(a) - len(b) for a, b in zip(train, kept)), kept
    if mix is not None:  # target shares of the natural train total, reached with whole documents
        natural = sum(lens[docs].sum() for lens, docs in zip(lengths, train))
        top = max(mix.values())  # weights over the largest first: 1e308 + 1e308 is no number
        share = {n: w / top / sum(v / top for v in mix.values()) for n, w in mix.items()}
        train = [resample(docs, lens, share[n] * natural, rng)
                 for n, lens, docs, rng in zip(names, lengths, train, rngs)]
        for n, docs in zip(names, train):
            if share[n] and not len(docs):  # asked for, and left out: a silent 0 share
                raise InputError(f"--mix {n}={mix[n]:g}: a share of {share[n]:.3g} of the "
                                 f"{natural:,} train tokens is less than one document of {n}, so "
                                 f"train would hold none of it; raise its weight, or give it 0")
    return train, val, copies


def resample(docs, lengths, target, rng):
    """Whole documents reaching `target` tokens: each document int(x) times, then a seeded few."""
    tokens = lengths[docs].sum()
    repeats, fraction = divmod(target / tokens, 1.0)
    order = rng.permutation(docs)
    extra = order[:np.searchsorted(np.cumsum(lengths[order]), fraction * tokens)]
    return np.concatenate([np.tile(docs, int(repeats)), extra])


def write_split(dst, tokens, dtype, lengths, chosen, names, rng, workers):
    """Write the chosen documents of all sources to dst in one shuffled order (sources interleave;
    in val too, so that its first windows are a fair sample); returns the split's counts. The
    order is the seed's alone; the workers copy documents from `tokens` in blocks."""
    source = np.concatenate([np.full(len(d), i) for i, d in enumerate(chosen)])
    doc = np.concatenate(chosen)
    order = rng.permutation(len(doc))
    every = np.concatenate(lengths)  # documents of all sources, as `tokens` holds them
    first = np.cumsum([0] + [len(lens) for lens in lengths])[:-1]  # each source's first there
    at = first[source[order]] + doc[order]
    write_documents(dst, tokens, dtype, np.cumsum(every)[at] - every[at], every[at], workers)
    per = {n: {"tokens": int(lens[d].sum()), "documents": len(d)}
           for n, lens, d in zip(names, lengths, chosen)}
    return {"tokens": sum(v["tokens"] for v in per.values()), "documents": len(doc),
            "per_source": per}


# ----------------------------------------------------------------------------
# Command line (machinery/datacli.py: the subcommands, the demo corpus and the BPE trainer's)


def main(argv=None):
    """data.py's command line: a subcommand per step above; no arguments: the demo corpus."""
    return datacli.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    run(main)
