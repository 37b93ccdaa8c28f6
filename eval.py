"""
Evaluation of ModernBERT checkpoints: how far a run's representations moved (CKA), what they are worth
downstream (fine-tuning), and how well the MLM head still predicts.

    python eval.py cka RUN_MLM RUN_CLM --control=RUN_MLM_SEED2 --control=RUN_MLM_SEED3 --control=RUN_MLM_SEED4 \
        --names=MLM,CLM --texts=heldout.jsonl --out=out/cka.json
    python eval.py finetune RUN --task=tasks/ncbi_disease --task=tasks/chemprot --out=out/ft.json
    python eval.py table out/ft_mlm.json out/ft_clm.json            # add --paired for CLM - MLM seed by seed
    python eval.py mlm RUN --data=data/demo

A model is a Hugging Face ModernBERT directory (or hub id) or one of our run directories. Sections:
models and tokenizers, metrics (as scikit-learn and seqeval compute them), CKA (SPEC §4), tasks (the two
formats of data/README.md, one class per task kind), fine-tuning (SPEC §5), MLM quality, input checks,
command line. Every bad flag or input file ends in one line `error: ...` and exit code 2.
"""
import argparse
import contextlib
import copy
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from data import DataError, load_meta, load_tokenizer, val_batches
from model import IGNORE_INDEX, ModernBERT, resolve_checkpoint, write_json

# ----------------------------------------------------------------------------
# Models, tokenizers, batches


def default_device():
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_threads():
    """torch's default intra-op threads (OMP_NUM_THREADS when set, else every core of the machine) capped to the
    cores this process may run on: in a container or under taskset torch counts cores it cannot use, and the
    surplus threads made eval.py 10x slower on a busy 2-core machine (issue 13)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(torch.get_num_threads(), cores)


def autocast(device):
    """bf16 autocast on CUDA, as the runs train; fp32 on CPU, where bf16 is slow and buys nothing."""
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def find_tokenizer(model_dir, spec=None):
    """--tokenizer if given, else the directory's tokenizer.json, else the spec our trainer records in state.json."""
    if spec:
        return load_tokenizer(spec)
    folder = Path(model_dir)
    if (folder / "tokenizer.json").is_file():
        return load_tokenizer(folder / "tokenizer.json")
    if (folder / "state.json").is_file():
        recorded = read_object(folder / "state.json").get("tokenizer")
        if recorded:
            return load_tokenizer(recorded)
    raise DataError(f"{model_dir}: no tokenizer.json and no 'tokenizer' in state.json; pass --tokenizer "
                    f"(a tokenizer.json, a hub id, or 'bytes')")


def read_object(path):
    try:
        obj = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: not a readable JSON file ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}: expected a JSON object, got {type(obj).__name__}")
    return obj


def load_model(path, device, tokenizer=None):
    """(model in eval mode on device, its tokenizer), after checking that both agree on the special ids."""
    local = resolve_checkpoint(str(path))
    tok = find_tokenizer(local, tokenizer)
    model = ModernBERT.from_pretrained(local).to(device).eval()
    c = model.config
    ours, theirs = (tok.cls_id, tok.sep_id, tok.pad_id, tok.mask_id), (c.cls_token_id, c.sep_token_id,
                                                                       c.pad_token_id, c.mask_token_id)
    if ours != theirs or tok.vocab_size > c.vocab_size:
        raise DataError(f"{path}: tokenizer {tok.spec} (cls, sep, pad, mask = {ours}, vocab {tok.vocab_size}) does "
                        f"not fit the model (ids {theirs}, vocab {c.vocab_size}); pass the right --tokenizer")
    return model, tok


def pad_batch(seqs, pad_value, device):
    """list of id lists -> (B, T) long tensor padded on the right, and its (B, T) attention mask."""
    T = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_value] * (T - len(s)) for s in seqs], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs], device=device)
    return ids, mask


def batches_by_length(seqs, batch_size):
    """Index arrays of batch_size sequences of similar length (evaluation only: order does not matter there)."""
    order = np.argsort([len(s) for s in seqs], kind="stable")
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


# ----------------------------------------------------------------------------
# Metrics, written out here and tested against scikit-learn and seqeval (which are not dependencies)


def f1_scores(true, pred):
    """Macro- and micro-F1 of (n, C) indicator matrices, as sklearn.metrics.f1_score(zero_division=0):
    per column 2TP / (2TP + FP + FN), and 0 for a column with no true and no predicted positive."""
    true, pred = np.asarray(true, bool), np.asarray(pred, bool)
    tp, fp, fn = (true & pred).sum(0), (~true & pred).sum(0), (true & ~pred).sum(0)

    def f1(tp, fp, fn):
        denominator = 2 * tp + fp + fn
        return np.where(denominator > 0, 2 * tp / np.maximum(denominator, 1), 0.0)

    macro = f1(tp, fp, fn).mean() if tp.size else 0.0
    return {"macro_f1": float(macro), "micro_f1": float(f1(tp.sum(), fp.sum(), fn.sum()))}


def label_f1(true, pred):
    """Single-label F1 over the labels found in either list (sklearn's default `labels`): one-hot columns."""
    labels = sorted(set(true) | set(pred))
    column = {label: i for i, label in enumerate(labels)}
    one_hot = np.eye(len(labels), dtype=bool)
    return f1_scores(one_hot[[column[x] for x in true]], one_hot[[column[x] for x in pred]])


def entities(tags):
    """Entity spans (type, first, last) of one IOB2 sentence, read as seqeval's default mode reads them: an I-
    that does not continue an entity of its own type starts a new one, as a B- does."""
    spans, current = [], None  # current: (type, first) of the entity being read
    for i, tag in enumerate([*tags, "O"]):
        prefix, kind = tag[:1], tag[2:]
        if current and (prefix != "I" or kind != current[0]):
            spans.append((*current, i - 1))
            current = None
        if prefix == "B" or (prefix == "I" and current is None):
            current = (kind, i)
    return spans


def entity_f1(true, pred):
    """Micro-F1 over exactly matching (sentence, type, span) entities: seqeval.metrics.f1_score, default mode."""
    gold = {(s, *span) for s, tags in enumerate(true) for span in entities(tags)}
    found = {(s, *span) for s, tags in enumerate(pred) for span in entities(tags)}
    return 2 * len(gold & found) / (len(gold) + len(found)) if gold or found else 0.0


# ----------------------------------------------------------------------------
# CKA (SPEC §4): per layer, how similar two models' representations of the same texts are


def linear_cka(X, Y):
    """Linear CKA of (n, p) and (n, q) features, in float64: float32, or centring after forming the n x n Gram
    matrices, cancels catastrophically on deep layers, whose features share a large common offset."""
    X = np.asarray(X, np.float64).reshape(len(X), -1)
    Y = np.asarray(Y, np.float64).reshape(len(Y), -1)
    X, Y = X - X.mean(0), Y - Y.mean(0)
    return float(np.linalg.norm(Y.T @ X) ** 2 / (np.linalg.norm(X.T @ X) * np.linalg.norm(Y.T @ Y)))


@torch.no_grad()
def layer_means(model, tok, texts, max_len, batch_size, device):
    """(L, len(texts), d) float64: each text's attention-masked mean of every block output (before final_norm)."""
    seqs = [[tok.cls_id, *ids[:max_len - 2], tok.sep_id] for ids in tok.encode_batch(texts)]
    c = model.config
    out = torch.empty(c.num_hidden_layers, len(seqs), c.hidden_size, dtype=torch.float64)
    for idx in batches_by_length(seqs, batch_size):
        ids, mask = pad_batch([seqs[i] for i in idx], tok.pad_id, device)
        with autocast(device):
            layers = model.hidden_states(ids, mask)  # L x (B, T, d)
        weight = mask[..., None].double()  # (B, T, 1)
        for layer, h in enumerate(layers):
            out[layer, torch.from_numpy(idx)] = ((h.double() * weight).sum(1) / weight.sum(1)).cpu()
    return out.numpy()


def ratio(divergence, control):
    """Divergence in control units. A control below 1e-12 is float64 rounding of zero: the ratio is then inf
    (or nan when the pair does not diverge either); Python's json writes these as Infinity / NaN."""
    if control < 1e-12:
        return math.inf if divergence >= 1e-12 else math.nan
    return divergence / control


def control_band(divergence, controls):
    """The seed controls' divergences at one layer, summarised, and where the pair's divergence lies: `outside`
    the band means above every control and, with three or more controls, also above mean + 2 std (sample std,
    ddof=1; with fewer controls the std says too little to use)."""
    c = np.asarray(controls, np.float64)
    mean, std = float(c.mean()), float(c.std(ddof=1)) if len(c) > 1 else 0.0
    outside = divergence > c.max() and (len(c) < 3 or divergence > mean + 2 * std)
    return {"mean": mean, "std": std, "min": float(c.min()), "max": float(c.max()),
            "ratio": ratio(divergence, mean), "outside": bool(outside)}


def cka(model_a, model_b, texts, controls=(), names=None, n=500, seeds=(42, 43, 44), max_len=512, out="cka.json",
        batch_size=16, tokenizer=None, device=None):
    """Per-layer CKA of A and B and of A and each seed control (a run differing from A only in its training seed),
    mean over the sampling seeds (draws of n texts). names: what to call A and B in the table and the figure
    (default: their directory names). Writes out (JSON, every draw kept) and a PNG beside it; returns the dict.

    Per layer: divergence = 1 - CKA(A, B); the controls' 1 - CKA(A, C_i), their mean, std, min and max;
    ratio = divergence / mean control divergence; outside_band (see control_band)."""
    check("cka", locals())
    device = device or default_device()
    pool = [ex["text"] for ex in read_jsonl(texts, labelled=False)]
    if n > len(pool):
        raise DataError(f"{texts}: {len(pool)} texts, fewer than the n={n} to draw")
    names = list(names or [Path(str(p)).name for p in (model_a, model_b)])
    draws = {seed: np.random.default_rng(seed).choice(len(pool), n, replace=False) for seed in seeds}
    union = np.unique(np.concatenate(list(draws.values())))  # each text goes through each model once
    paths = [model_a, model_b, *controls]
    features = [layer_means(model, tok, [pool[i] for i in union], max_len, batch_size, device)
                for model, tok in load_models(paths, device, tokenizer)]
    layers = list(range(len(features[0])))

    def per_layer(other, rows):  # CKA of A with model `other` at every layer, on the texts of one draw
        return [linear_cka(features[0][layer, rows], features[other][layer, rows]) for layer in layers]

    per_seed = {}
    for seed, draw in draws.items():
        rows = np.searchsorted(union, draw)
        per_seed[seed] = {"cka": per_layer(1, rows), "control_cka": [per_layer(2 + k, rows) for k in range(len(controls))]}
    pair = np.array([s["cka"] for s in per_seed.values()])  # (draws, L)
    result = {"names": names, "layers": layers, "cka": pair.mean(0).tolist(), "divergence": (1 - pair.mean(0)).tolist(),
              "divergence_std": (1 - pair).std(0).tolist()}  # over the draws
    if controls:
        each = 1 - np.mean([s["control_cka"] for s in per_seed.values()], axis=0)  # (controls, L)
        bands = [control_band(d, each[:, layer]) for layer, d in enumerate(result["divergence"])]
        result["controls"] = {"paths": list(map(str, controls)), "divergence": each.tolist(),
                              **{key: [b[key] for b in bands] for key in ("std", "min", "max")}}
        result["control_divergence"] = [b["mean"] for b in bands]
        result["ratio"] = [b["ratio"] for b in bands]
        result["outside_band"] = [b["outside"] for b in bands]
    result["per_seed"] = per_seed
    result["args"] = dict(model_a=str(model_a), model_b=str(model_b), controls=list(map(str, controls)),
                          texts=str(texts), n=n, seeds=list(seeds), max_len=max_len, tokenizer=tokenizer)
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_json(str(out), result)
    print_cka(result)
    plot_cka(result, Path(out).with_suffix(".png"))
    return result


def load_models(paths, device, tokenizer):
    models = [load_model(p, device, tokenizer) for p in paths]
    depths = [m.config.num_hidden_layers for m, _ in models]
    if len(set(depths)) > 1:
        raise DataError(f"models have different numbers of layers: {dict(zip(map(str, paths), depths))}")
    return models


def print_cka(r):
    a, b = r["names"]
    k = len(r.get("controls", {}).get("paths", []))
    print(f"linear CKA, {a} vs {b}" + (f" ({k} seed controls of {a})" if k else "")
          + f", mean of {len(r['per_seed'])} draws of {r['args']['n']} texts")
    print(f"{'layer':>5} {'CKA':>10} {'1 - CKA':>10}" + (f" {'control':>10} {'± std':>9} {'ratio':>8}" if k else ""))
    for layer in r["layers"]:
        line = f"{layer:>5} {r['cka'][layer]:>10.6f} {r['divergence'][layer]:>10.3e}"
        if k:
            line += (f" {r['control_divergence'][layer]:>10.3e} {r['controls']['std'][layer]:>9.2e} "
                     f"{r['ratio'][layer]:>8.2f}{'  outside the control band' if r['outside_band'][layer] else ''}")
        print(line)
    if k:
        print("outside the control band: above every control" + (" and above mean + 2 std" if k >= 3 else ""))


def plot_cka(r, path):
    """Two panels, as a paper shows them: the ratio per layer against the controls' band (each control over their
    mean), and the divergences with their spread (the pair's over the draws, the controls' min-max and std)."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display on a training node
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure (the JSON has every number)")
        return
    a, b = r["names"]
    layers, controls = r["layers"], r.get("controls")
    fig, axes = plt.subplots(1, 2 if controls else 1, figsize=(11 if controls else 6, 3.8), squeeze=False)
    if controls:
        ax, mean = axes[0, 0], np.array(r["control_divergence"])
        ax.fill_between(layers, np.array(controls["min"]) / mean, np.array(controls["max"]) / mean, alpha=0.25,
                        color="gray", label=f"{a} seed controls (min-max)")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.plot(layers, r["ratio"], "o-", label=f"{a} vs {b}")
        outside = [layer for layer in layers if r["outside_band"][layer]]
        ax.plot(outside, [r["ratio"][layer] for layer in outside], "r*", ms=10, label="outside the control band")
        if all(0 < x < math.inf for x in r["ratio"]):
            ax.set_yscale("log")  # 1x to 44x in the paper
        ax.set(xlabel="layer", ylabel="divergence / mean control divergence", title="divergence in seed-noise units")
        ax.legend(fontsize=8)
    ax = axes[0, -1]
    ax.errorbar(layers, r["divergence"], yerr=r["divergence_std"], fmt="o-", capsize=3, label=f"{a} vs {b}")
    if controls:
        ax.fill_between(layers, controls["min"], controls["max"], alpha=0.25, color="gray")
        ax.errorbar(layers, r["control_divergence"], yerr=controls["std"], fmt="s--", color="gray", capsize=3,
                    label=f"{a} vs its seed controls (mean ± std, min-max)")
    if min(r["divergence"] + r.get("control_divergence", [])) > 0:
        ax.set_yscale("log")  # the paper's ratios span 1x to 44x
    ax.set(xlabel="layer", ylabel="1 - linear CKA", title="representation divergence by layer")
    for ax in axes[0]:
        ax.set_xticks(layers)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=150)
    plt.close(fig)
    print(f"wrote {path}")


# ----------------------------------------------------------------------------
# Tasks: token<TAB>tag files (token classification) or JSONL (sequence classification), checked in full
# before any training, so that a typo in a test file does not cost a run. Everything that differs between the
# kinds (reading, targets, loss, decoding, metrics, majority baseline) lives in one class per kind; a new kind is
# a new class and one line in read_task.

SPLITS = ("train", "dev", "test")


def lines(path):
    """(number, line) of a UTF-8 text file, a byte-order mark dropped (spreadsheet exports write one); invalid
    UTF-8 is an error naming the line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{number}: not valid UTF-8 (byte {e.start}: {e.reason})") from None


def read_tsv(path):
    """Sentences of an IOB2 token<TAB>tag file, a blank line between sentences; spaces around a tag are dropped."""
    sentences, words, tags, first = [], [], [], 0
    for number, line in lines(path):
        if not line.strip():
            if words:
                sentences.append({"words": words, "label": tags, "line": first})
                words, tags = [], []
            continue
        parts = line.split("\t")
        tag = parts[-1].strip()
        iob2 = len(parts) == 2 and (tag == "O" or tag[:2] in ("B-", "I-") and len(tag) > 2)
        if not iob2 or not parts[0]:
            raise DataError(f"{path}:{number}: expected token<TAB>tag with an IOB2 tag (O, B-type, I-type), "
                            f"got {line!r}")
        first = first if words else number
        words.append(parts[0])
        tags.append(tag)
    return sentences + ([{"words": words, "label": tags, "line": first}] if words else [])


def label_text(label):
    """Labels are names: integer class ids (as many datasets ship them) are read as their decimal strings."""
    is_int = isinstance(label, int) and not isinstance(label, bool)
    return str(label) if is_int else label


def read_jsonl(path, labelled=True):
    """Examples of a JSONL file: text, optional text_pair, label (a string or an integer, or a list of them:
    multi-label)."""
    examples = []
    for number, line in lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise DataError(f"{path}:{number}: not valid JSON ({e})") from None
        row = row if isinstance(row, dict) else {}
        label = row.get("label")
        label = [label_text(x) for x in label] if isinstance(label, list) else label_text(label)
        ok = isinstance(row.get("text"), str) and isinstance(row.get("text_pair") or "", str)
        if labelled:
            ok = ok and isinstance(label, (str, list)) and all(isinstance(x, str) for x in label)
        if not ok:
            raise DataError(f"{path}:{number}: expected an object with 'text' (a string)" + (", 'label' (a string "
                            "or an integer, or a list of them) and optionally 'text_pair' (a string)" if labelled else ""))
        examples.append({"text": row["text"], "text_pair": row.get("text_pair"), "label": label, "line": number})
    return examples


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)


def most_common(labels):
    return Counter(labels).most_common(1)[0][0]


class TokenClassification:
    """IOB2 tags, one per word, predicted on the word's first sub-token; entity-level F1 as seqeval computes it."""
    name, primary, epochs, per_token = "token", "entity_f1", 20, True

    def labels_of(self, example):  # (label, line) pairs, for the label-set checks
        return [(tag, example["line"] + k) for k, tag in enumerate(example["label"])]

    def encode(self, labels, examples, tok, max_len):
        """(ids, target) per sentence, target the tag's class on a word's first sub-token and -100 elsewhere.
        Whole words only: a word cut by max_len goes with all that follow it (they count as predicted "O")."""
        column = {label: i for i, label in enumerate(labels)}
        # Each word as the tokenizer sees it mid-sentence: byte-level BPE keeps the leading space in the token.
        pieces = iter(tok.encode_batch([w if i == 0 else " " + w for ex in examples for i, w in enumerate(ex["words"])]))
        out = []
        for ex in examples:
            ids, target = [tok.cls_id], [IGNORE_INDEX]
            for word, tag in zip([next(pieces) for _ in ex["words"]], ex["label"]):
                if len(ids) + len(word) > max_len - 1:
                    break
                ids += word
                target += [column[tag]] + [IGNORE_INDEX] * (len(word) - 1)
            out.append((ids + [tok.sep_id], target + [IGNORE_INDEX]))
        return out

    def stack(self, targets, device):
        return pad_batch(targets, IGNORE_INDEX, device)[0]  # (B, T)

    def truncation(self, examples, encoded, max_len):
        cut = [len(ex["words"]) - sum(t != IGNORE_INDEX for t in target) for ex, (_, target) in zip(examples, encoded)]
        return f"--max_len={max_len} cuts {sum(cut):,} words in {sum(c > 0 for c in cut):,} of {len(cut):,} sentences"

    loss = staticmethod(cross_entropy)

    def decode(self, logits, target, example, labels):  # logits (T, C); the first sub-tokens are where target is set
        words = logits[target != IGNORE_INDEX].argmax(-1).tolist()
        return [labels[k] for k in words] + ["O"] * (len(example["words"]) - len(words))

    def score(self, gold, preds, labels):
        flat = label_f1([t for tags in gold for t in tags], [t for tags in preds for t in tags])
        return {"entity_f1": entity_f1(gold, preds), **flat}

    def majority(self, train, examples, labels):
        top = most_common(t for ex in train for t in ex["label"])
        return [[top] * len(ex["words"]) for ex in examples]


class SequenceClassification:
    """What the JSONL kinds share: [CLS] text [SEP] (text_pair [SEP]), one target per example, macro-F1."""
    primary, epochs, per_token = "macro_f1", 10, False

    def encode(self, labels, examples, tok, max_len):
        texts = tok.encode_batch([ex["text"] for ex in examples])
        pairs = tok.encode_batch([ex["text_pair"] or "" for ex in examples])
        out = []
        for ex, a, b in zip(examples, texts, pairs):
            if ex["text_pair"] is None:
                ids = [tok.cls_id, *a[:max_len - 2], tok.sep_id]
            else:
                a, b = fit_pair(a, b, max_len - 3)
                ids = [tok.cls_id, *a, tok.sep_id, *b, tok.sep_id]
            out.append((ids, self.target(ex["label"], labels)))
        return out

    def stack(self, targets, device):
        return torch.tensor(targets, device=device)  # (B,) or (B, C)

    def truncation(self, examples, encoded, max_len):  # a text exactly max_len long is counted too: rare enough
        full = sum(len(ids) >= max_len for ids, _ in encoded)
        return f"--max_len={max_len}: {full:,} of {len(encoded):,} examples fill it (their text is cut)"


class SingleLabel(SequenceClassification):
    """One label per example: softmax over the labels."""
    name = "single"
    loss = staticmethod(cross_entropy)

    def labels_of(self, example):
        return [(example["label"], example["line"])]

    def target(self, label, labels):
        return labels.index(label)

    def decode(self, logits, target, example, labels):
        return labels[logits.argmax()]

    def score(self, gold, preds, labels):
        return label_f1(gold, preds)

    def majority(self, train, examples, labels):
        top = most_common(ex["label"] for ex in train)
        return [top for _ in examples]


class MultiLabel(SequenceClassification):
    """A list of labels per example (possibly empty): a sigmoid per label, predicted when its logit is > 0."""
    name = "multi"

    def labels_of(self, example):
        return [(label, example["line"]) for label in example["label"]]

    def target(self, label, labels):
        return [float(x in label) for x in labels]

    def loss(self, logits, targets):
        return F.binary_cross_entropy_with_logits(logits, targets)

    def decode(self, logits, target, example, labels):
        return [label for label, z in zip(labels, logits) if z > 0]

    def score(self, gold, preds, labels):
        indicator = lambda sets: [[label in s for label in labels] for s in sets]
        return f1_scores(indicator(gold), indicator(preds))

    def majority(self, train, examples, labels):  # every label that more than half of the train examples carry
        counts = Counter(x for ex in train for x in ex["label"])
        return [[x for x in labels if counts[x] > len(train) / 2] for _ in examples]


def read_task(folder):
    """{"name", "kind" (one of the classes above), "labels", "files", "train", "dev", "test"} of a task folder."""
    folder = Path(folder)
    found = {ext for ext in (".tsv", ".jsonl") for s in SPLITS if (folder / f"{s}{ext}").is_file()}
    if len(found) != 1:
        raise DataError(f"{folder}: expected train/dev/test.tsv (token classification) or train/dev/test.jsonl "
                        f"(sequence classification), found {'both' if found else 'neither'}")
    ext = found.pop()
    files = {s: folder / f"{s}{ext}" for s in SPLITS}
    for split, path in files.items():
        if not path.is_file():
            raise DataError(f"{folder}: missing {path.name} (a task needs {', '.join(p.name for p in files.values())})")
    examples = {s: (read_tsv if ext == ".tsv" else read_jsonl)(p) for s, p in files.items()}
    for split in SPLITS:
        if not examples[split]:
            raise DataError(f"{files[split]}: no examples")
    multi = isinstance(examples["train"][0]["label"], list)
    kind = TokenClassification() if ext == ".tsv" else MultiLabel() if multi else SingleLabel()
    known, unseen = set(), {}
    for split in SPLITS:  # train defines the label set (the classifier's outputs)
        for ex in examples[split]:
            if ext == ".jsonl" and isinstance(ex["label"], list) != multi:
                raise DataError(f"{files[split]}:{ex['line']}: label {ex['label']!r} mixes single-label and "
                                f"multi-label examples (the first train example decides)")
            for label, line in kind.labels_of(ex):
                if split == "train":
                    known.add(label)
                elif label not in known and (split, label) not in unseen:
                    unseen[split, label] = f"{files[split]}:{line}: label {label!r} does not occur in {files['train']}"
    if not known:
        raise DataError(f"{files['train']}: no labels at all")
    for message in unseen.values():  # a real test set can hold a rare label that train lacks: it costs recall
        print(f"warning: {message}; it is never predicted and counts as missed", file=sys.stderr)
    labels = sorted(known)
    return {"name": folder.name, "kind": kind, "labels": labels, "files": {s: str(p) for s, p in files.items()},
            "scored": labels + sorted({label for _, label in unseen}), **examples}


def fit_pair(a, b, budget):
    """Truncate the longer of two id lists first, one token at a time (ties cut b), to len(a) + len(b) <= budget."""
    kept_b = min(len(b), max(budget // 2, budget - len(a)))
    return a[:budget - kept_b], b[:kept_b]


# ----------------------------------------------------------------------------
# Fine-tuning (SPEC §5)


@dataclass
class Settings:
    """What every (task, seed) run of one `finetune` call shares."""
    epochs: int  # None: the kind's default (SPEC §5)
    lr: float
    batch_size: int
    pooling: str
    pad_id: int
    device: str


class Classifier(nn.Module):
    """Encoder, its pretrained head transform (dense, GELU, norm: as HF's ModernBert*Classification), dropout,
    and a linear layer, on the pooled vector (sequence tasks) or on every token (token tasks)."""

    def __init__(self, encoder, n_labels, per_token, pooling="cls", dropout=0.0):
        super().__init__()
        self.encoder, self.per_token, self.pooling = encoder, per_token, pooling
        self.dropout = nn.Dropout(dropout)
        self.classifier = nn.Linear(encoder.config.hidden_size, n_labels)
        std = encoder.config.hidden_size ** -0.5  # HF ModernBERT's classifier init ("final_out")
        nn.init.trunc_normal_(self.classifier.weight, std=std, a=-2 * std, b=2 * std)
        nn.init.zeros_(self.classifier.bias)

    def forward(self, ids, mask):
        h = self.encoder.encode(ids, mask)  # (B, T, d)
        if not self.per_token:
            m = mask[..., None].to(h.dtype)
            h = h[:, 0] if self.pooling == "cls" else (h * m).sum(1) / m.sum(1)  # (B, d)
        return self.classifier(self.dropout(self.encoder.head_hidden(h)))  # (B, C) or (B, T, C)


def collate(batch, kind, pad_id, device):
    """(ids, attention mask, targets) tensors of a list of (ids, target)."""
    ids, mask = pad_batch([ids for ids, _ in batch], pad_id, device)
    return ids, mask, kind.stack([t for _, t in batch], device)


@torch.no_grad()
def evaluate(model, task, split, s):
    """(metrics, predictions) on split = (examples, encoded); a prediction is a label, a list of labels, or one tag
    per word."""
    examples, encoded = split
    model.eval()
    preds = [None] * len(encoded)
    for idx in batches_by_length([ids for ids, _ in encoded], s.batch_size):
        ids, mask, targets = collate([encoded[i] for i in idx], task["kind"], s.pad_id, s.device)
        with autocast(s.device):
            logits = model(ids, mask).float().cpu()
        for row, i in enumerate(idx):
            preds[i] = task["kind"].decode(logits[row], targets[row].cpu(), examples[i], task["labels"])
    return task["kind"].score([ex["label"] for ex in split[0]], preds, task["scored"]), preds


def optimizer_for(model, lr):
    named = list(model.named_parameters())
    return torch.optim.AdamW([  # no decay on biases and norms, as HF's Trainer
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.01},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}], lr=lr)


def train_seed(base, task, data, seed, s):
    """Fine-tune a copy of base on data["train"] = (examples, encoded); the epoch with the best dev primary metric
    is evaluated on test. Returns {"dev", "best_epoch", "test", "seconds"} and the test predictions."""
    kind, epochs = task["kind"], task["kind"].epochs if s.epochs is None else s.epochs  # 0 is refused by check()
    torch.manual_seed(seed)  # the classifier init and dropout
    model = Classifier(copy.deepcopy(base), len(task["labels"]), kind.per_token, s.pooling).to(s.device)
    optimizer = optimizer_for(model, s.lr)
    train = data["train"][1]
    per_epoch = math.ceil(len(train) / s.batch_size)
    # linear decay to 0 and no warmup: with few steps per epoch a warmup would take a large share of the run
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / (epochs * per_epoch))
    shuffle = torch.Generator().manual_seed(seed)
    best, start = None, time.time()
    for epoch in range(1, epochs + 1):
        model.train()
        total = torch.zeros((), device=s.device)
        for idx in torch.randperm(len(train), generator=shuffle).split(s.batch_size):
            ids, mask, targets = collate([train[i] for i in idx], kind, s.pad_id, s.device)
            with autocast(s.device):
                logits = model(ids, mask)
            loss = kind.loss(logits.float(), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # HF Trainer's default max_grad_norm
            optimizer.step()
            schedule.step()
            total += loss.detach()
        dev, _ = evaluate(model, task, data["dev"], s)
        better = best is None or dev[kind.primary] > best["dev"][kind.primary]
        if better:  # the best epoch's weights, kept in memory
            best = {"dev": dev, "best_epoch": epoch, "state": copy.deepcopy(model.state_dict())}
        print(f"  seed {seed} epoch {epoch}/{epochs}: train loss {total.item() / per_epoch:.4f}, dev {kind.primary} "
              f"{dev[kind.primary]:.4f}{' (best)' if better else ''}, {time.time() - start:.0f} s", flush=True)
    model.load_state_dict(best.pop("state"))
    test, preds = evaluate(model, task, data["test"], s)
    return {**best, "test": test, "seconds": round(time.time() - start, 2)}, preds


def subset(examples, n):
    """n examples drawn with a fixed seed (the same for every run seed); all when n is None or too large."""
    if n is None or n >= len(examples):
        return examples
    return [examples[i] for i in np.sort(np.random.default_rng(0).choice(len(examples), n, replace=False))]


def summarize(task, runs, baseline, epochs):
    """A task's entry in the results file: every seed, mean and sample std (ddof=1, as papers report; 0 for one
    seed) of each test metric, and the majority baseline."""
    values = {m: [r["test"][m] for r in runs.values()] for m in next(iter(runs.values()))["test"]}
    return {"task": task["name"], "kind": task["kind"].name, "labels": task["labels"], "primary": task["kind"].primary,
            "epochs": epochs, "seeds": runs, "mean": {m: float(np.mean(v)) for m, v in values.items()},
            "std": {m: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0 for m, v in values.items()},
            "baseline": {"test": baseline}}


def seed_result(base, task, data, seed, s, path, setting):
    """A (task, seed) result: read from path when an earlier call wrote it with the same setting, else trained
    now and written at once, with the test predictions."""
    if path.is_file():
        saved = read_object(path)
        if saved.get("setting") != json.loads(json.dumps(setting)) or "result" not in saved:
            raise DataError(f"{path}: written with other settings ({saved.get('setting')}); delete it or choose "
                            f"another --out")
        print(f"  seed {seed}: skip, done in {path}")
        return saved["result"]
    result, predictions = train_seed(base, task, data, seed, s)
    write_json(str(path), {"setting": setting, "result": result, "predictions": predictions})
    return result


def finetune(model, tasks, seeds=(42, 43, 44, 45, 46), out="results.json", epochs=None, lr=5e-5, max_len=512,
             train_subset=None, eval_subset=None, batch_size=16, pooling="cls", device=None, tokenizer=None):
    """Fine-tune model on each task folder once per seed; writes out (JSON, after every task) and returns it.
    Each (task, seed) is written as soon as it is done, with its test predictions, to <out stem>.seeds/<task>-seed<N>
    .json; a later call with the same settings skips the pairs found there (an interrupted evaluation resumes)."""
    device = device or default_device()
    tasks = [read_task(t) for t in tasks]  # every input error surfaces before any training
    check("finetune", locals())
    names = [t["name"] for t in tasks]
    if len(set(names)) < len(names):
        raise DataError(f"task folders must have distinct names, got {names}")
    base, tok = load_model(model, device, tokenizer)
    settings = Settings(epochs, lr, batch_size, pooling, tok.pad_id, device)
    args = dict(model=str(model), seeds=list(seeds), epochs=epochs, lr=lr, max_len=max_len, train_subset=train_subset,
                eval_subset=eval_subset, batch_size=batch_size, pooling=pooling, tokenizer=tok.spec)
    results = {"model": str(model), "args": args, "tasks": {}}
    seed_dir = Path(out).with_suffix(".seeds")
    seed_dir.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        kind = task["kind"]
        examples = {split: subset(task[split], train_subset if split == "train" else eval_subset) for split in SPLITS}
        data = {split: (examples[split], kind.encode(task["scored"], examples[split], tok, max_len)) for split in SPLITS}
        n_epochs = kind.epochs if epochs is None else epochs
        print(f"{task['name']}: {kind.name}, {len(task['labels'])} labels, "
              f"{'/'.join(str(len(examples[split])) for split in SPLITS)} examples, {n_epochs} epochs")
        print("  train, dev and test: " + kind.truncation([ex for split in SPLITS for ex in data[split][0]],
                                                          [e for split in SPLITS for e in data[split][1]], max_len))
        setting = {**args, "seeds": None, "task": task["files"]}  # what a seed file must match to be reused
        runs = {str(seed): seed_result(base, task, data, seed, settings, seed_dir / f"{task['name']}-seed{seed}.json", setting)
                for seed in seeds}
        test = examples["test"]
        baseline = kind.score([ex["label"] for ex in test], kind.majority(task["train"], test, task["labels"]),
                              task["scored"])
        summary = results["tasks"][task["name"]] = summarize(task, runs, baseline, n_epochs)
        write_json(str(out), results)
        shown = ", ".join(f"{m} {100 * summary['mean'][m]:.2f} ± {100 * summary['std'][m]:.2f}" for m in summary["mean"])
        print(f"{task['name']}: test {shown} over {len(seeds)} seeds; majority baseline {kind.primary} "
              f"{100 * baseline[kind.primary]:.2f}")
    return results


def load_results(path):
    tasks = read_object(path).get("tasks")
    if not isinstance(tasks, dict):
        raise DataError(f"{path}: not a results file of `eval.py finetune` (no 'tasks' object)")
    return tasks


def paired_difference(a_json, b_json):
    """B - A per task on the primary metric, seed by seed over the seeds both ran (the same seed means the same
    classifier init and data order, so the pairing removes that noise): {task: {"metric", "seeds", "difference"
    (per seed), "mean", "std" (ddof=1; 0 for one seed)}}. Tasks without a shared seed are left out."""
    a, b = load_results(a_json), load_results(b_json)
    out = {}
    for name in [n for n in a if n in b]:
        metric, seeds = a[name]["primary"], [s for s in a[name]["seeds"] if s in b[name]["seeds"]]
        diff = [b[name]["seeds"][s]["test"][metric] - a[name]["seeds"][s]["test"][metric] for s in seeds]
        if diff:
            out[name] = {"metric": metric, "seeds": seeds, "difference": diff, "mean": float(np.mean(diff)),
                         "std": float(np.std(diff, ddof=1)) if len(diff) > 1 else 0.0}
    return out


def table(files, paired=False):
    """Models side by side: a row per task, a column per results file, cells mean ± std (x100) over seeds.
    paired: two files A B, and the rows are B - A seed by seed (paired_difference)."""
    if paired:
        if len(files) != 2:
            raise DataError(f"--paired compares two results files, got {len(files)}")
        rows = [["task", f"{files[1]} - {files[0]}", "seeds"]] + [
            [f"{name} [{d['metric']}]", f"{100 * d['mean']:+.2f} ± {100 * d['std']:.2f}", str(len(d["seeds"]))]
            for name, d in paired_difference(*files).items()]
    else:
        loaded = [load_results(path) for path in files]

        def cell(r):
            if r is None:
                return "-"
            text = lambda m: f"{100 * r['mean'][m]:.2f} ± {100 * r['std'][m]:.2f}"
            return text(r["primary"]) + (f" (macro {text('macro_f1')})" if r["primary"] != "macro_f1" else "")

        names = list(dict.fromkeys(name for tasks in loaded for name in tasks))
        primary = {name: next(t[name]["primary"] for t in loaded if name in t) for name in names}
        rows = [["task", *map(str, files)]] + [[f"{name} [{primary[name]}]", *(cell(t.get(name)) for t in loaded)]
                                              for name in names]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    text = "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows)
    print(text)
    return text


# ----------------------------------------------------------------------------
# MLM quality: masked-token loss and accuracy on fixed validation batches


@torch.no_grad()
def mlm(model, data, n_sequences=64, seq_len=512, seed=0, batch_size=8, device=None):
    """15% of the non-special positions chosen with a fixed seed (80% [MASK], 10% random, 10% kept, as in training);
    loss and accuracy (argmax == original id) over all chosen positions of the first n_sequences windows."""
    check("mlm", locals())
    device = device or default_device()
    meta = load_meta(data)
    net = ModernBERT.from_pretrained(resolve_checkpoint(str(model))).to(device).eval()
    c = net.config
    if meta["mask_id"] != c.mask_token_id or meta["vocab_size"] > c.vocab_size:
        raise DataError(f"{data}: tokenized with mask id {meta['mask_id']} and vocab {meta['vocab_size']}, but {model} "
                        f"has mask id {c.mask_token_id} and vocab {c.vocab_size}")
    total_loss, correct, count, sequences = 0.0, 0, 0, 0
    for x, y in val_batches(data, seq_len, n_sequences, batch_size, "mlm", mask_rate=0.15, seed=seed):
        x, y = x.to(device), y.to(device)
        chosen = y != IGNORE_INDEX  # (B, T)
        with autocast(device):
            logits = net.predict(net.encode(x)[chosen]).float()  # (M, vocab): the head on chosen positions only
        total_loss += F.cross_entropy(logits, y[chosen], reduction="sum").item()
        correct += (logits.argmax(-1) == y[chosen]).sum().item()
        count, sequences = count + int(chosen.sum()), sequences + len(x)
    if count == 0:
        raise DataError(f"{data}/val.bin: no masked positions in {sequences} sequences")
    result = {"loss": total_loss / count, "accuracy": correct / count, "masked_tokens": count, "sequences": sequences,
              "seq_len": seq_len, "seed": seed}
    print(f"{model} on {data}/val.bin: MLM loss {result['loss']:.4f}, accuracy {result['accuracy']:.4f} "
          f"({count:,} masked tokens in {sequences} sequences of {seq_len})")
    return result


# ----------------------------------------------------------------------------
# Input checks: every flag of a command and every model directory, before any file is read or model loaded


def check(command, a):
    """Raise one DataError naming the first bad flag or model directory of command (a: its arguments)."""
    counts = {"cka": ("n", "batch_size"), "finetune": ("epochs", "batch_size", "train_subset", "eval_subset"),
              "mlm": ("n_sequences", "seq_len", "batch_size")}[command]
    rules = [(a[k] is None or a[k] >= 1, f"--{k} must be >= 1, got {a[k]}") for k in counts]  # None: the default
    if "max_len" in a:
        rules.append((a["max_len"] >= 4, f"--max_len must be >= 4 ([CLS], [SEP] and some text), got {a['max_len']}"))
    if "seeds" in a:
        rules.append((len(a["seeds"]) > 0, "--seeds must list at least one seed, e.g. 42,43,44"))
    if "lr" in a:
        rules.append((0 < a["lr"] < math.inf, f"--lr must be a positive number, got {a['lr']}"))
    if a.get("names") is not None:
        rules.append((len(a["names"]) == 2 and all(a["names"]), f"--names must be two names, for model_a and "
                      f"model_b (e.g. MLM,CLM), got {','.join(a['names'])!r}"))
    if "texts" in a:
        rules.append((Path(a["texts"]).is_file(), f"--texts={a['texts']}: no such file"))
    for ok, message in rules:
        if not ok:
            raise DataError(message)
    for model in [a[k] for k in ("model", "model_a", "model_b") if k in a] + list(a.get("controls", ())):
        check_model(str(model))


def check_model(path):
    """A local model directory must hold a config.json, and its JSON files must parse; a name that is not a
    local path (no such directory, one slash, e.g. answerdotai/ModernBERT-base) is left to the hub."""
    folder = Path(path)
    local = folder.exists() or path.startswith((".", "/", "~")) or path.count("/") != 1 or folder.parent.is_dir()
    if not local:
        return
    if not (folder / "config.json").is_file():
        raise DataError(f"{path}: not a model directory (no config.json there)")
    for name in ("config.json", "state.json"):
        if (folder / name).is_file():
            read_object(folder / name)


# ----------------------------------------------------------------------------
# Command line


def seed_list(text):
    return tuple(int(s) for s in text.split(","))


def at_least_one(text):
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {text}")
    return int(text)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, as every other input error
        print(f"error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def main(argv=None):
    parser = Parser(prog="eval.py", description="Evaluate ModernBERT checkpoints (SPEC §4-5).")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    common.add_argument("--threads", type=at_least_one, default=None,
                        help="CPU intra-op threads (default: torch's, capped to the cores this process may use)")
    with_tokenizer = argparse.ArgumentParser(add_help=False, parents=[common])
    with_tokenizer.add_argument("--tokenizer", default=None, help="tokenizer.json, hub id or 'bytes' (default: the "
                                "model directory's tokenizer.json, else the spec in its state.json)")

    p = sub.add_parser("cka", parents=[with_tokenizer], help="per-layer linear CKA of two models (and a seed control)")
    p.add_argument("model_a")
    p.add_argument("model_b")
    p.add_argument("--control", dest="controls", action="append", default=[],
                   help="a run differing from model_a only in its training seed; repeat for more")
    p.add_argument("--names", type=lambda text: text.split(","), default=None,
                   help="what to call model_a and model_b in the table and figure, e.g. MLM,CLM (default: directory names)")
    p.add_argument("--texts", required=True, help="JSONL with a 'text' field (held-out texts)")
    p.add_argument("--n", type=int, default=500)
    p.add_argument("--seeds", type=seed_list, default=(42, 43, 44), help="sampling seeds, e.g. 42,43,44")
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--out", default="cka.json", help="JSON; the plot goes beside it as .png")

    p = sub.add_parser("finetune", parents=[with_tokenizer], help="fine-tune on task folders, several seeds")
    p.add_argument("model")
    p.add_argument("--task", dest="tasks", action="append", required=True, help="a task folder; repeat for more")
    p.add_argument("--seeds", type=seed_list, default=(42, 43, 44, 45, 46))
    p.add_argument("--out", default="results.json")
    p.add_argument("--epochs", type=int, default=None, help="default: 10, or 20 for token classification")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--max_len", type=int, default=512)
    p.add_argument("--train_subset", type=int, default=None, help="train on this many examples (fixed draw)")
    p.add_argument("--eval_subset", type=int, default=None, help="dev and test on this many examples (fixed draw)")
    p.add_argument("--batch_size", type=int, default=16)
    p.add_argument("--pooling", choices=("cls", "mean"), default="cls")

    p = sub.add_parser("table", help="results files of `finetune` side by side")
    p.add_argument("files", nargs="+")
    p.add_argument("--paired", action="store_true", help="two files A B: B - A per task, seed by seed")

    p = sub.add_parser("mlm", parents=[common], help="masked-token loss and accuracy on val.bin")
    p.add_argument("model")
    p.add_argument("--data", required=True, help="a directory prepared by data.py")
    p.add_argument("--n_sequences", type=int, default=64)
    p.add_argument("--seq_len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch_size", type=int, default=8)

    args = vars(parser.parse_args(argv))
    command = {"cka": cka, "finetune": finetune, "table": table, "mlm": mlm}[args.pop("command")]
    if command is not table:
        threads = args.pop("threads")
        torch.set_num_threads(default_threads() if threads is None else threads)
        print(f"threads: {torch.get_num_threads()} intra-op (--threads to change)")
    try:
        command(**args)
    except (ValueError, FileNotFoundError) as e:  # bad input (DataError is a ValueError; so are bad configs)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
