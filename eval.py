"""
Evaluation of ModernBERT checkpoints: how far a run's representations moved (CKA against a
seed-noise band), what they are worth downstream (fine-tuning), and how well it still predicts.

    python eval.py cka RUN_MLM RUN_CLM --control=RUN_MLM_SEED2 --control=RUN_MLM_SEED3 \\
        --names=MLM,CLM --texts=heldout.jsonl --out=out/cka.json
    python eval.py finetune RUN --task=tasks/ncbi_disease --task=tasks/chemprot --out=out/ft.json
    python eval.py table out/ft-mlm.json out/ft-clm.json  # paired against the first file
    python eval.py mlm RUN --data=data/demo
    python eval.py curves out/clm out/mlm --out=out/curves.png

A model is a Hugging Face ModernBERT folder, a hub id, or a train.py run directory. Sections:
models, metrics, CKA, task kinds, fine-tuning, result tables, validation loss and curves, command
line. Task and results files are read and checked in machinery/tasks.py. Bad input ends in one
line `error: ...` and exit status 2.
"""
import argparse
import copy
import hashlib
import inspect
import json
import math
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from data import load_meta, load_tokenizer
from machinery.cli import (InputError, Parser, autocast, pick_device, pick_threads, positive_int,
                           read_json, run, sha256_file, write_json)
from machinery.hf import read_config, resolve_checkpoint
from machinery.tasks import SPLITS, is_number, load_results, read_jsonl, read_task, score
from model import IGNORE_INDEX, ModernBERT

# ----------------------------------------------------------------------------
# Models, tokenizers, batches


def inspect_model(path):
    """What is known of a model before its weights are loaded: its local folder (a hub id is
    fetched), its config, and the SHA-256 of its weights (which keys saved results and tells two
    models apart)."""
    text = str(path)
    if not Path(text).is_dir() and (text.startswith((".", "/", "~")) or Path(text).parent.is_dir()):
        raise InputError(f"{text}: no such model directory")  # a local path, not a hub id
    folder = Path(resolve_checkpoint(text))
    if not (folder / "model.safetensors").is_file():
        raise InputError(f"{text}: no model.safetensors there (a model folder holds config.json "
                         f"and model.safetensors)")
    return {"path": text, "dir": folder, "config": read_config(folder / "config.json"),
            "sha256": sha256_file(folder / "model.safetensors")}


def find_tokenizer(folder, spec=None):
    """--tokenizer if given, else the folder's tokenizer.json, else the one train.py recorded in
    the run's state.json (runs that did not copy tokenizer.json to the top)."""
    folder = Path(folder)
    found = spec or (folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else None)
    found = found or recorded_tokenizer(folder)
    if not found:
        raise InputError(f"{folder}: no tokenizer.json and no tokenizer recorded in a state.json; "
                         f"pass --tokenizer (a tokenizer.json, a hub id, or 'bytes')")
    return load_tokenizer(found)


def recorded_tokenizer(folder):
    """The tokenizer spec in the latest checkpoint's state.json (or a top-level one), or None."""
    from machinery.rundir import latest_state
    state = latest_state(str(folder))
    if state is None and (folder / "state.json").is_file():
        state = read_json(folder / "state.json", "train.py's state.json")
    spec = state.get("tokenizer") if isinstance(state, dict) else None
    return spec if isinstance(spec, str) else None


def model_tokenizer(info, spec=None):
    """The tokenizer of inspect_model's `info` (find_tokenizer), refused when its special ids or
    its vocabulary do not fit the model's config."""
    tok = find_tokenizer(info["dir"], spec)
    c = info["config"]
    ours = (tok.cls_id, tok.sep_id, tok.pad_id, tok.mask_id)
    theirs = (c.cls_token_id, c.sep_token_id, c.pad_token_id, c.mask_token_id)
    if ours != theirs or tok.vocab_size > c.vocab_size:
        raise InputError(f"{info['path']}: tokenizer {tok.spec} (cls, sep, pad, mask = {ours}, "
                         f"vocab {tok.vocab_size}) does not fit the model (ids {theirs}, vocab "
                         f"{c.vocab_size}); pass the right --tokenizer")
    return tok


def load_weights(info, device):
    """The model of inspect_model's `info`, in eval mode on device; refused when a weight is NaN
    or inf (a diverged run: every score computed from it would be nonsense)."""
    model = ModernBERT(info["config"])
    model.load_weights(str(info["dir"] / "model.safetensors"))
    bad = next((k for k, p in model.state_dict().items() if not torch.isfinite(p).all()), None)
    if bad:
        raise InputError(f"{info['path']}: weight {bad} holds NaN or inf; a diverged model cannot "
                         f"be evaluated")
    return model.to(device).eval()


def pad_batch(seqs, pad_value, device):
    """list of id lists -> (B, T) long tensor padded on the right, and its (B, T) attention mask."""
    T = max(len(s) for s in seqs)
    ids = torch.tensor([s + [pad_value] * (T - len(s)) for s in seqs], device=device)
    mask = torch.tensor([[1] * len(s) + [0] * (T - len(s)) for s in seqs], device=device)
    return ids, mask


def batches_by_length(seqs, batch_size):
    """Index arrays of batch_size sequences of similar length (evaluation: order is free there)."""
    order = np.argsort([len(s) for s in seqs], kind="stable")
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def save(path, obj):
    """write_json, a full disk or an unwritable folder as one error line (the old file is kept)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json(str(path), obj)
    except OSError as e:
        raise InputError(f"{path}: cannot write it ({e.strerror or e})") from None


# ----------------------------------------------------------------------------
# Metrics, written out here and tested against scikit-learn and seqeval (not dependencies)


def f1_scores(true, pred):
    """Macro- and micro-F1 of (n, C) indicator matrices, as sklearn's f1_score(zero_division=0):
    per column 2TP / (2TP + FP + FN), and 0 for a column with no true and no predicted positive."""
    true, pred = np.asarray(true, bool), np.asarray(pred, bool)
    tp, fp, fn = (true & pred).sum(0), (~true & pred).sum(0), (true & ~pred).sum(0)

    def f1(tp, fp, fn):
        denominator = 2 * tp + fp + fn
        return np.where(denominator > 0, 2 * tp / np.maximum(denominator, 1), 0.0)

    macro = f1(tp, fp, fn).mean() if tp.size else 0.0
    return {"macro_f1": float(macro), "micro_f1": float(f1(tp.sum(), fp.sum(), fn.sum()))}


def label_f1(true, pred):
    """Single-label F1 over the labels found in either list (sklearn's default `labels`)."""
    labels = sorted(set(true) | set(pred))
    column = {label: i for i, label in enumerate(labels)}
    one_hot = np.eye(len(labels), dtype=bool)
    return f1_scores(one_hot[[column[x] for x in true]], one_hot[[column[x] for x in pred]])


def entities(tags):
    """Entity spans (type, first, last) of one IOB2 sentence, read as seqeval's default mode reads
    them: an I- that does not continue an entity of its own type starts a new one, as a B- does."""
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
    """Micro-F1 over exactly matching (sentence, type, span) entities, as seqeval's f1_score."""
    gold = {(s, *span) for s, tags in enumerate(true) for span in entities(tags)}
    found = {(s, *span) for s, tags in enumerate(pred) for span in entities(tags)}
    return 2 * len(gold & found) / (len(gold) + len(found)) if gold or found else 0.0


# ----------------------------------------------------------------------------
# CKA: per layer, how alike two models represent the same texts. The signal is the pair's
# divergence 1 - CKA against seed noise: the divergence of model A from runs that differ from A
# only in their training seed (the seed controls).

BAND_RULE = ("outside the band: the pair's 1 - CKA is above that of every seed control at that "
             "layer (the band spans the controls' min to max)")


def linear_cka(X, Y):
    """Linear CKA of (n, p) and (n, q) features in float64: float32, or centring after forming the
    n x n Gram matrices, cancels catastrophically on deep layers, whose features share an offset."""
    X = np.asarray(X, np.float64).reshape(len(X), -1)
    Y = np.asarray(Y, np.float64).reshape(len(Y), -1)
    X, Y = X - X.mean(0), Y - Y.mean(0)
    return float(np.linalg.norm(Y.T @ X) ** 2 / (np.linalg.norm(X.T @ X) * np.linalg.norm(Y.T @ Y)))


@torch.no_grad()
def layer_means(model, tok, texts, max_len, batch_size, device):
    """(L, len(texts), d) float64: each text's attention-masked mean of every block's output
    (before final_norm)."""
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


def control_band(divergence, controls):
    """The seed controls' divergences at one layer summarised (sample std, ddof=1); the pair's
    divergence in units of their mean (None when they do not diverge: below 1e-12 is float64
    rounding of zero); whether it lies outside the band (BAND_RULE)."""
    c = np.asarray(controls, np.float64)
    mean = float(c.mean())
    return {"mean": mean, "std": float(c.std(ddof=1)) if len(c) > 1 else 0.0,
            "min": float(c.min()), "max": float(c.max()),
            "ratio": divergence / mean if mean >= 1e-12 else None,
            "outside": bool(divergence > c.max())}


def cka(model_a, model_b, texts, controls=(), names=None, n=500, seeds=(42, 43, 44), max_len=512,
        out="cka.json", batch_size=16, tokenizer=None, device="auto"):
    """Per-layer CKA of A and B, and of A and each seed control, mean over the sampling seeds (draws
    of n texts). names: what to call A and B (default: their folder names). Writes out (JSON, every
    draw kept) and a PNG beside it; returns the dict (see cka_summary)."""
    pool = [ex["text"] for ex in read_jsonl(texts, labelled=False)]
    if n > len(pool):
        raise InputError(f"{texts}: {len(pool)} texts, fewer than the n={n} to draw")
    infos = distinct_models([model_a, model_b, *controls])
    toks = [model_tokenizer(info, tokenizer) for info in infos]
    device = pick_device(device)
    draws = {s: np.random.default_rng(s).choice(len(pool), n, replace=False) for s in seeds}
    union = np.unique(np.concatenate(list(draws.values())))  # each text through each model once
    features, chosen = [], [pool[i] for i in union]
    for info, tok in zip(infos, toks):  # one model in memory at a time
        model = load_weights(info, device)
        features.append(layer_means(model, tok, chosen, max_len, batch_size, device))
        if not np.isfinite(features[-1]).all():
            raise InputError(f"{info['path']}: its block outputs hold NaN or inf on {texts}")
        del model
    per_seed = {}
    for seed, draw in draws.items():
        rows = np.searchsorted(union, draw)
        each = [[linear_cka(features[0][layer, rows], f[layer, rows]) for layer in range(len(f))]
                for f in features[1:]]
        per_seed[seed] = {"cka": each[0], "control_cka": each[1:]}
    result = {"names": list(names or [Path(str(p)).name for p in (model_a, model_b)]),
              **cka_summary(per_seed, len(controls)), "per_seed": per_seed,
              "args": dict(model_a=str(model_a), model_b=str(model_b), texts=str(texts), n=n,
                           controls=list(map(str, controls)), seeds=list(seeds), max_len=max_len,
                           tokenizer=tokenizer)}
    save(out, result)
    print(cka_markdown(result))
    plot_cka(result, Path(out).with_suffix(".png"))
    return result


def distinct_models(paths):
    """inspect_model of each path, refused when they differ in depth, or when a seed control
    (paths[2:]) is a model named before it (same folder or same weights): its band would be 0."""
    infos = [inspect_model(p) for p in paths]
    depths = {info["path"]: info["config"].num_hidden_layers for info in infos}
    if len(set(depths.values())) > 1:
        raise InputError(f"models have different numbers of layers: {depths}")
    for i in range(2, len(infos)):
        for other in infos[:i]:
            same = "folder" if infos[i]["dir"].resolve() == other["dir"].resolve() else \
                "weights" if infos[i]["sha256"] == other["sha256"] else None
            if same:
                raise InputError(f"--control={infos[i]['path']} has the same {same} as "
                                 f"{other['path']}; a seed control must be another training run")
    return infos


def cka_summary(per_seed, n_controls):
    """Per layer: cka (mean over the draws), divergence = 1 - cka and its std over the draws; with
    controls, their divergences ("controls": each, std, min, max), control_divergence (their mean),
    ratio and outside_band (control_band)."""
    pair = np.array([s["cka"] for s in per_seed.values()])  # (draws, L)
    r = {"layers": list(range(pair.shape[1])), "cka": pair.mean(0).tolist(),
         "divergence": (1 - pair.mean(0)).tolist(), "divergence_std": (1 - pair).std(0).tolist()}
    if n_controls:
        each = 1 - np.mean([s["control_cka"] for s in per_seed.values()], axis=0)  # (controls, L)
        bands = [control_band(d, each[:, layer]) for layer, d in enumerate(r["divergence"])]
        r["controls"] = {"divergence": each.tolist(),
                         **{key: [b[key] for b in bands] for key in ("std", "min", "max")}}
        r["control_divergence"] = [b["mean"] for b in bands]
        r["ratio"] = [b["ratio"] for b in bands]
        r["outside_band"] = [b["outside"] for b in bands]
        r["band_rule"] = BAND_RULE
    return r


def cka_markdown(r):
    """A CKA result as a markdown table, with what 1 - CKA is and the band rule in words."""
    a, b = r["names"]
    k = len(r.get("controls", {}).get("divergence", []))
    controls = f"; {k} seed control(s): runs that differ from {a} only in the training seed"
    lines = [f"1 - linear CKA of {a} vs {b} per layer: 0 when they represent the same texts alike "
             f"up to rotation and scale, towards 1 when unrelated. Mean of {len(r['per_seed'])} "
             f"draws of {r['args']['n']} texts{controls if k else ''}.", ""]
    if not k:
        lines += ["| layer | CKA | 1 - CKA | ± std over draws |", "|---|---|---|---|"]
        lines += [f"| {i} | {r['cka'][i]:.6f} | {r['divergence'][i]:.3e} | "
                  f"{r['divergence_std'][i]:.1e} |" for i in r["layers"]]
        return "\n".join(lines) + "\n"
    c = r["controls"]
    lines += [f"| layer | 1 - CKA, {a} vs {b} | seed controls, mean ± std | controls, min - max "
              f"| ratio | outside the band |", "|---|---|---|---|---|---|"]
    for i in r["layers"]:
        ratio = "-" if r["ratio"][i] is None else f"{r['ratio'][i]:.2f}"
        lines.append(f"| {i} | {r['divergence'][i]:.3e} | {r['control_divergence'][i]:.3e} ± "
                     f"{c['std'][i]:.1e} | {c['min'][i]:.3e} - {c['max'][i]:.3e} | {ratio} | "
                     f"{'yes' if r['outside_band'][i] else 'no'} |")
    lines += ["", f"ratio: the pair's 1 - CKA over the controls' mean; {BAND_RULE}."]
    return "\n".join(lines) + "\n"


def plot_cka(r, path):
    """Left: 1 - CKA per layer, the pair's against the seed controls' band; right (with controls):
    the same in units of the controls' mean. Layers outside the band are starred; what 1 - CKA is
    and the band rule are written under the panels."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display on a training node
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no figure (the JSON has every number)")
        return
    a, b = r["names"]
    layers, c = r["layers"], r.get("controls")
    fig, axes = plt.subplots(1, 2 if c else 1, figsize=(12 if c else 6.5, 4.8), squeeze=False)
    ax = axes[0, 0]
    ax.errorbar(layers, r["divergence"], yerr=r["divergence_std"], fmt="o-", color="C0",
                capsize=3, label=f"{a} vs {b} (bars: std over the text draws)")
    if c:
        draw_band(ax, r, c["min"], c["max"], r["control_divergence"], r["divergence"])
        ax.errorbar(layers, r["control_divergence"], yerr=c["std"], fmt="none", color="grey",
                    capsize=2, label="seed controls' std")
    if min(r["divergence"] + r.get("control_divergence", [])) > 0:
        ax.set_yscale("log")
    ax.set(xlabel="layer (block output)", ylabel="1 - linear CKA",
           title="representation divergence")
    if c:
        ax, mean = axes[0, 1], np.array(r["control_divergence"])
        with np.errstate(divide="ignore", invalid="ignore"):
            low, high = np.array(c["min"]) / mean, np.array(c["max"]) / mean
        ratio = [np.nan if x is None else x for x in r["ratio"]]
        draw_band(ax, r, low, high, np.ones(len(layers)), ratio)
        ax.plot(layers, ratio, "o-", color="C0", label=f"{a} vs {b}")
        if all(x is not None and x > 0 for x in r["ratio"]):
            ax.set_yscale("log")  # the paper's ratios span 1x to 44x
        ax.set(xlabel="layer (block output)", ylabel="1 - CKA over the controls' mean",
               title="divergence in seed-noise units (ratio)")
    for ax in axes[0]:
        ax.set_xticks(layers)
        ax.legend(fontsize=7)
    note = "1 - CKA: 0 = the same representation up to rotation and scale, 1 = unrelated."
    rule = f" {BAND_RULE[0].upper()}{BAND_RULE[1:]}." if c else ""
    fig.text(0.5, 0.01, note + rule, ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    try:
        fig.savefig(path, dpi=150)
    except OSError as e:
        raise InputError(f"{path}: cannot write it ({e.strerror or e})") from None
    finally:
        plt.close(fig)
    print(f"wrote {path}")


def draw_band(ax, r, low, high, mean, pair):
    """The controls' band (min to max) and mean, and a star on each layer the pair lies outside."""
    layers = r["layers"]
    ax.fill_between(layers, low, high, color="grey", alpha=0.3,
                    label="the band: seed controls, min to max")
    ax.plot(layers, mean, "s--", color="grey", ms=4, label="seed controls' mean")
    outside = [layer for layer in layers if r["outside_band"][layer]]
    ax.plot(outside, [pair[layer] for layer in outside], "*", color="red", ms=12, ls="none",
            label=f"outside the band ({len(outside)} of {len(layers)} layers)")


# ----------------------------------------------------------------------------
# Task kinds. What differs between them (targets, loss, decoding, metrics, majority baseline) is
# one class; a new kind is a class and an entry in KINDS (and, for a new file format, a reader in
# machinery/tasks.py). Targets are built over train's labels. A dev or test label that train lacks
# (read_task warns once per label) gets the target UNSEEN, is never predicted and counts as missed:
# the same for every kind.

UNSEEN = -1  # never in a loss: train holds no such label


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)


def most_common(labels):
    return Counter(labels).most_common(1)[0][0]


class TokenClassification:
    """IOB2 tags, one per word, predicted on the word's first sub-token; entity F1 as seqeval."""
    name, primary, epochs, per_token = "token", "entity_f1", 20, True

    def encode(self, labels, examples, tok, max_len):
        """(ids, target) per sentence, target the tag's class on a word's first sub-token and -100
        elsewhere. Whole words only: a word cut by max_len goes with all that follow it (they count
        as predicted "O")."""
        column = {label: i for i, label in enumerate(labels)}
        # Each word as the tokenizer sees it mid-sentence: byte-level BPE keeps the leading space.
        words = [w if i == 0 else " " + w for ex in examples for i, w in enumerate(ex["words"])]
        pieces = iter(tok.encode_batch(words))
        out = []
        for ex in examples:
            ids, target = [tok.cls_id], [IGNORE_INDEX]
            for word, tag in zip([next(pieces) for _ in ex["words"]], ex["label"]):
                if len(ids) + len(word) > max_len - 1:
                    break
                ids += word
                target += [column.get(tag, UNSEEN)] + [IGNORE_INDEX] * (len(word) - 1)
            out.append((ids + [tok.sep_id], target + [IGNORE_INDEX]))
        return out

    def stack(self, targets, device):
        return pad_batch(targets, IGNORE_INDEX, device)[0]  # (B, T)

    def truncation(self, examples, encoded, max_len):
        cut = [len(ex["words"]) - sum(t != IGNORE_INDEX for t in target)
               for ex, (_, target) in zip(examples, encoded)]
        return (f"--max_len={max_len} cuts {sum(cut):,} words in {sum(c > 0 for c in cut):,} of "
                f"{len(cut):,} sentences")

    loss = staticmethod(cross_entropy)

    def decode(self, logits, target, example, labels):  # logits (T, C); target set: first pieces
        words = logits[target != IGNORE_INDEX].argmax(-1).tolist()
        return [labels[k] for k in words] + ["O"] * (len(example["words"]) - len(words))

    def score(self, gold, preds, labels):
        flat = label_f1([t for tags in gold for t in tags], [t for tags in preds for t in tags])
        return {"entity_f1": entity_f1(gold, preds), **flat}

    def majority(self, train, examples):
        top = most_common(t for ex in train for t in ex["label"])
        return [[top] * len(ex["words"]) for ex in examples]


class SequenceClassification:
    """What the JSONL kinds share: [CLS] text [SEP] (text_pair [SEP]), one target per example."""
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

    def truncation(self, examples, encoded, max_len):  # exactly max_len long counts: rare enough
        full = sum(len(ids) >= max_len for ids, _ in encoded)
        return f"--max_len={max_len}: {full:,} of {len(encoded):,} examples fill it (text is cut)"


def fit_pair(a, b, budget):
    """Cut the longer of two id lists first, a token at a time (ties cut b), to fit the budget."""
    kept_b = min(len(b), max(budget // 2, budget - len(a)))
    return a[:budget - kept_b], b[:kept_b]


class SingleLabel(SequenceClassification):
    """One label per example: softmax over the labels; macro-F1."""
    name = "single"
    loss = staticmethod(cross_entropy)

    def target(self, label, labels):
        return labels.index(label) if label in labels else UNSEEN

    def decode(self, logits, target, example, labels):
        return labels[logits.argmax()]

    def score(self, gold, preds, labels):
        return label_f1(gold, preds)

    def majority(self, train, examples):
        top = most_common(ex["label"] for ex in train)
        return [top for _ in examples]


class MultiLabel(SequenceClassification):
    """A list of labels per example (possibly empty): a sigmoid per label, predicted when its logit
    is > 0; macro-F1 over the task's label columns."""
    name = "multi"

    def target(self, label, labels):  # an unseen label has no column: it only enters the score
        return [float(x in label) for x in labels]

    def loss(self, logits, targets):
        return F.binary_cross_entropy_with_logits(logits, targets)

    def decode(self, logits, target, example, labels):
        return [label for label, z in zip(labels, logits) if z > 0]

    def score(self, gold, preds, labels):
        indicator = lambda sets: [[label in s for label in labels] for s in sets]
        return f1_scores(indicator(gold), indicator(preds))

    def majority(self, train, examples):  # every label more than half of the train examples carry
        counts = Counter(x for ex in train for x in ex["label"])
        return [sorted(x for x in counts if counts[x] > len(train) / 2) for _ in examples]


KINDS = {kind.name: kind for kind in (TokenClassification(), SingleLabel(), MultiLabel())}

# ----------------------------------------------------------------------------
# Fine-tuning: AdamW (weight decay 0.01, none on biases and norms), linear decay, batch 16, 10
# epochs (20 for token classification); the epoch with the best dev score is scored on test.


@dataclass
class Settings:
    """What every (task, seed) run of one `finetune` call shares."""
    epochs: int  # None: the task kind's default
    lr: float
    max_len: int
    batch_size: int
    pooling: str
    train_subset: int  # None: every example
    eval_subset: int
    pad_id: int
    device: torch.device


class Classifier(nn.Module):
    """Encoder, its pretrained head transform (dense, GELU, norm: as HF's
    ModernBert*Classification), dropout and a linear layer, on the pooled vector (sequence tasks)
    or on every token (token tasks)."""

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


def diverged(task, s, what):
    return InputError(f"{task['name']}: {what} (the fine-tuning diverged: try a lower --lr than "
                      f"{s.lr})")


@torch.no_grad()
def evaluate(model, task, split, s):
    """(metrics, predictions) on split = (examples, encoded); a prediction is a label, a list of
    labels, or one tag per word."""
    examples, encoded = split
    kind = KINDS[task["kind"]]
    model.eval()
    preds = [None] * len(encoded)
    for idx in batches_by_length([ids for ids, _ in encoded], s.batch_size):
        ids, mask, targets = collate([encoded[i] for i in idx], kind, s.pad_id, s.device)
        with autocast(s.device):
            logits = model(ids, mask).float().cpu()
        if not torch.isfinite(logits).all():
            raise diverged(task, s, "the classifier's outputs hold NaN or inf")
        for row, i in enumerate(idx):
            preds[i] = kind.decode(logits[row], targets[row].cpu(), examples[i], task["labels"])
    return kind.score([ex["label"] for ex in examples], preds, task["scored"]), preds


def optimizer_for(model, lr):
    named = list(model.named_parameters())
    return torch.optim.AdamW([  # no decay on biases and norms, as HF's Trainer
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.01},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0}], lr=lr)


def train_seed(base, task, data, seed, s):
    """Fine-tune a copy of base on data["train"] = (examples, encoded); the epoch with the best dev
    primary metric is scored on test. Returns {"dev", "best_epoch", "test", "seconds"} and the test
    predictions."""
    kind = KINDS[task["kind"]]
    epochs = kind.epochs if s.epochs is None else s.epochs
    torch.manual_seed(seed)  # the classifier init and dropout
    model = Classifier(copy.deepcopy(base), len(task["labels"]), kind.per_token, s.pooling)
    model = model.to(s.device)
    optimizer = optimizer_for(model, s.lr)
    train = data["train"][1]
    steps = epochs * math.ceil(len(train) / s.batch_size)
    # linear decay to 0 and no warmup: with few steps per epoch a warmup would take a large share
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    shuffle = torch.Generator().manual_seed(seed)
    best, start = None, time.time()
    for epoch in range(1, epochs + 1):
        model.train()
        losses = []
        for idx in torch.randperm(len(train), generator=shuffle).split(s.batch_size):
            ids, mask, targets = collate([train[i] for i in idx], kind, s.pad_id, s.device)
            with autocast(s.device):
                logits = model(ids, mask)
            loss = kind.loss(logits.float(), targets)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # HF Trainer's max_grad_norm
            optimizer.step()
            schedule.step()
            losses.append(loss.detach())
        train_loss = torch.stack(losses).mean().item()
        if not math.isfinite(train_loss):
            raise diverged(task, s, f"seed {seed} epoch {epoch}: train loss {train_loss}")
        dev, _ = evaluate(model, task, data["dev"], s)
        better = best is None or dev[kind.primary] > best["dev"][kind.primary]
        if better:  # the best epoch's weights, kept in memory
            best = {"dev": dev, "best_epoch": epoch, "state": copy.deepcopy(model.state_dict())}
        print(f"  seed {seed} epoch {epoch}/{epochs}: train loss {train_loss:.4f}, dev "
              f"{kind.primary} {dev[kind.primary]:.4f}{' (best)' if better else ''}, "
              f"{time.time() - start:.0f} s", flush=True)
    model.load_state_dict(best.pop("state"))
    test, preds = evaluate(model, task, data["test"], s)
    return {**best, "test": test, "seconds": round(time.time() - start, 2)}, preds


def subset(examples, n):
    """n examples drawn with a fixed seed (the same for every run seed); all when n is None."""
    if n is None or n >= len(examples):
        return examples
    drawn = np.random.default_rng(0).choice(len(examples), n, replace=False)
    return [examples[i] for i in np.sort(drawn)]


def finetune(model, tasks, seeds=(42, 43, 44, 45, 46), out="results.json", epochs=None, lr=5e-5,
             max_len=512, train_subset=None, eval_subset=None, batch_size=16, pooling="cls",
             device="auto", tokenizer=None):
    """Fine-tune model on each task folder once per seed; writes out (JSON, after every task) and
    returns it. Each (task, seed) is written with its test predictions to OUT.seeds/ when done,
    under a name keyed on a fingerprint of the settings, the model's weights and the task files'
    contents: a later call reuses exactly the pairs whose inputs did not change."""
    tasks = [read_task(t) for t in tasks]  # every input error surfaces before any training
    names = [t["name"] for t in tasks]
    if len(set(names)) < len(names):
        raise InputError(f"task folders must have distinct names, got {names}")
    if len(set(seeds)) < len(seeds):
        raise InputError(f"seeds must be distinct (a seed run twice counts twice): {list(seeds)}")
    info = inspect_model(model)
    tok = model_tokenizer(info, tokenizer)
    device = pick_device(device)
    seed_dir = Path(out).with_suffix(".seeds")
    try:  # a folder that cannot be written is found before any training
        seed_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{seed_dir}: cannot create it ({e.strerror or e})") from None
    base = load_weights(info, device)
    s = Settings(epochs, lr, max_len, batch_size, pooling, train_subset, eval_subset, tok.pad_id,
                 device)
    args = dict(model=str(model), seeds=list(seeds), epochs=epochs, lr=lr, max_len=max_len,
                train_subset=train_subset, eval_subset=eval_subset, batch_size=batch_size,
                pooling=pooling, tokenizer=tok.spec)
    inputs = {**args, "model": info["sha256"], "config": repr(info["config"]), "seeds": None,
              "tokenizer": tok.fingerprint, "device": device.type}  # what the numbers depend on
    results = {"model": str(model), "args": args, "tasks": {}}
    for task in tasks:
        results["tasks"][task["name"]] = finetune_task(base, tok, task, seeds, s, inputs, seed_dir)
        save(out, results)
    return results


def finetune_task(base, tok, task, seeds, s, inputs, seed_dir):
    """One task: encoded, fine-tuned once per seed (or a seed's saved result reused), summarised
    beside the majority baseline: mean and sample std (ddof=1; 0 for one seed) of each metric."""
    kind = KINDS[task["kind"]]
    examples = {split: subset(task[split], s.train_subset if split == "train" else s.eval_subset)
                for split in SPLITS}
    data = {split: (examples[split], kind.encode(task["labels"], examples[split], tok, s.max_len))
            for split in SPLITS}
    epochs = kind.epochs if s.epochs is None else s.epochs
    print(f"{task['name']}: {kind.name}, {len(task['labels'])} labels, "
          f"{'/'.join(str(len(examples[split])) for split in SPLITS)} examples, {epochs} epochs")
    every = [[x for split in SPLITS for x in data[split][part]] for part in (0, 1)]
    print("  train, dev and test: " + kind.truncation(*every, s.max_len))
    inputs = {**inputs, "task": task["name"], "kind": kind.name, "sha256": task["sha256"]}
    runs = {str(seed): seed_result(base, task, data, seed, s, inputs, seed_dir) for seed in seeds}
    gold = [ex["label"] for ex in examples["test"]]
    baseline = kind.score(gold, kind.majority(task["train"], examples["test"]), task["scored"])
    values = {m: [r["test"][m] for r in runs.values()] for m in baseline}
    mean = {m: float(np.mean(v)) for m, v in values.items()}
    std = {m: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0 for m, v in values.items()}
    print(f"{task['name']}: test {kind.primary} {100 * mean[kind.primary]:.2f} ± "
          f"{100 * std[kind.primary]:.2f} over {len(seeds)} seeds; majority baseline "
          f"{100 * baseline[kind.primary]:.2f}")
    return {"task": task["name"], "kind": kind.name, "labels": task["labels"],
            "primary": kind.primary, "epochs": epochs, "files": task["files"],
            "sha256": task["sha256"], "seeds": runs, "mean": mean, "std": std,
            "baseline": {"test": baseline}}


def seed_result(base, task, data, seed, s, inputs, seed_dir):
    """A (task, seed) result: read from its file when an earlier call computed it from the same
    inputs, else trained now and written at once with the test predictions (each example's index
    and line in the test file, gold label, prediction)."""
    key = {**inputs, "seed": seed}
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    path = seed_dir / f"{task['name']}-seed{seed}-{fingerprint[:12]}.json"
    if path.is_file():
        saved = read_json(path, "a fine-tuning result of `eval.py finetune`")
        ok = isinstance(saved, dict) and saved.get("fingerprint") == fingerprint
        result = saved.get("result") if ok else None
        if not scores_ok(result):
            raise InputError(f"{path}: not a result this command wrote; delete it")
        print(f"  seed {seed}: skip, done in {path} (same settings, model and task files)")
        return result
    result, preds = train_seed(base, task, data, seed, s)
    predictions = [{"index": ex["index"], "line": ex["line"], "gold": ex["label"], "pred": p}
                   for ex, p in zip(data["test"][0], preds)]
    save(path, {"fingerprint": fingerprint, "inputs": key, "result": result,
                "predictions": predictions})
    return result


def scores_ok(result):
    """Whether a seed's result holds dev and test scores that are all finite numbers."""
    return isinstance(result, dict) and all(
        isinstance(result.get(split), dict) and result[split]
        and all(is_number(v) for v in result[split].values()) for split in ("dev", "test"))


# ----------------------------------------------------------------------------
# Result tables: fine-tuning arms side by side, against the majority baseline, paired seed by seed


def paired_difference(a, b):
    """B - A per task on the primary metric, seed by seed over the seeds both ran (the same seed is
    the same classifier init and data order, so pairing removes that noise). a, b: results of
    `finetune` or their files. {task: {"metric", "seeds", "difference" (per seed), "mean", "std"
    (ddof=1; 0 for one seed), "wins" (seeds where B is higher, A is higher, they tie)}}; a task
    without a shared seed is left out."""
    a, b = (x if isinstance(x, dict) else load_results(x) for x in (a, b))
    out = {}
    for name in [n for n in a["tasks"] if n in b["tasks"]]:
        ta, tb = a["tasks"][name], b["tasks"][name]
        metric, seeds = ta["primary"], [s for s in ta["seeds"] if s in tb["seeds"]]
        diff = [score(tb["seeds"][s], metric) - score(ta["seeds"][s], metric) for s in seeds]
        if diff:
            out[name] = {"metric": metric, "seeds": seeds, "difference": diff,
                         "mean": float(np.mean(diff)),
                         "std": float(np.std(diff, ddof=1)) if len(diff) > 1 else 0.0,
                         "wins": [sum(d > 0 for d in diff), sum(d < 0 for d in diff),
                                  sum(d == 0 for d in diff)]}
    return out


def finetune_markdown(arms, baseline_arm=None):
    """A markdown table of fine-tuning arms ({arm name: results of `finetune`}) and a one-line
    legend: per task and arm the number of seeds, the majority baseline, the test score (mean ±
    std, x100) flagged when it is not above the baseline, and the paired difference to baseline_arm
    (default: the first arm) with its spread and the seeds each side wins."""
    base = baseline_arm or next(iter(arms))
    if base not in arms:
        raise InputError(f"baseline arm {base!r} is not among the arms {list(arms)}")
    pairs = {arm: paired_difference(arms[base], r) for arm, r in arms.items() if arm != base}
    lines = [f"| task (metric) | arm | seeds | majority baseline | test, mean ± std | arm - "
             f"{base}, paired mean ± std | seeds won: arm / {base} / tie |", "|---" * 7 + "|"]
    for task in dict.fromkeys(t for r in arms.values() for t in r["tasks"]):
        for arm, r in arms.items():
            t = r["tasks"].get(task)
            if t is None:
                lines.append(f"| {task} | {arm} | 0 | - | - | - | - |")
                continue
            scores = [score(s, t["primary"]) for s in t["seeds"].values()]
            mean, std = np.mean(scores), np.std(scores, ddof=1) if len(scores) > 1 else 0.0
            baseline = score(t["baseline"], t["primary"])
            flag = "" if mean > baseline else " **not above the baseline**"
            d = pairs.get(arm, {}).get(task)
            paired = (f"{100 * d['mean']:+.2f} ± {100 * d['std']:.2f} ({len(d['seeds'])} seeds)"
                      if d else "(the reference)" if arm == base else "no shared seed")
            wins = " / ".join(map(str, d["wins"])) if d else "-"
            lines.append(f"| {task} ({t['primary']}) | {arm} | {len(scores)} | "
                         f"{100 * baseline:.2f} | {100 * mean:.2f} ± {100 * std:.2f}{flag} | "
                         f"{paired} | {wins} |")
    legend = (f"Scores x100 on the test split, mean ± sample std over seeds; majority baseline: "
              f"always the most common train label (per word for token tasks); paired: the arm "
              f"minus {base} on each seed both ran (same classifier init and data order).")
    return "\n".join(lines + ["", legend]) + "\n"


def table(files):
    """Print and return finetune_markdown of results files, the first file the reference arm; an
    arm is named by its file name (by its path where two names clash)."""
    if len(set(map(str, files))) < len(files):
        raise InputError(f"a results file is given twice: {list(map(str, files))}")
    names = [Path(f).stem for f in files]
    names = names if len(set(names)) == len(names) else list(map(str, files))
    text = finetune_markdown({name: load_results(f) for name, f in zip(names, files)})
    print(text, end="")
    return text


# ----------------------------------------------------------------------------
# Validation loss, and loss curves


def mlm(model, data, n_sequences=64, seq_len=512, batch_size=8, device="auto"):
    """Validation losses as train.py measures them: MLM (15% masked) and CLM on the first
    n_sequences windows of data/val.bin."""
    info = inspect_model(model)
    meta = load_meta(data)
    c = info["config"]
    if meta["mask_id"] != c.mask_token_id or meta["vocab_size"] > c.vocab_size:
        raise InputError(f"{data}: tokenized with mask id {meta['mask_id']} and vocab "
                         f"{meta['vocab_size']}, but {model} has mask id {c.mask_token_id} and "
                         f"vocab {c.vocab_size}")
    device = pick_device(device)
    net = load_weights(info, device)
    from train import validation_losses  # only this command needs the trainer
    losses = validation_losses(net, data, seq_len, n_sequences, batch_size, device)
    bad = [f"{k} = {v}" for k, v in losses.items() if not is_number(v)]
    if bad:
        raise InputError(f"{model} on {data}/val.bin: {', '.join(bad)}; a loss that is not finite "
                         f"means nothing")
    print(f"{model} on {data}/val.bin ({n_sequences} windows of {seq_len}): validation MLM loss "
          f"{losses['val_mlm']:.4f} (15% masked), CLM loss {losses['val_clm']:.4f}")
    return losses


def curves(runs, out, names=None):
    """Several runs' loss curves on shared axes, one colour per run (machinery/curves.py)."""
    from machinery.curves import draw_runs  # matplotlib: only this command needs it
    for folder in runs:
        if not (Path(folder) / "log.jsonl").is_file():
            raise InputError(f"{folder}: no log.jsonl (not a train.py run directory)")
    if names is not None and len(names) != len(runs):
        raise InputError(f"--names gives {len(names)} names for {len(runs)} runs")
    return draw_runs([str(r) for r in runs], str(out), names=names)


# ----------------------------------------------------------------------------
# Command line


def seed_list(text):
    """argparse type: distinct integers in [0, 2**32) separated by commas (numpy takes no negative
    seed; a seed given twice would count one run twice in the mean and std)."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, e.g. 42,43,44; "
                                         f"got {text!r}") from None
    if not all(0 <= s < 2 ** 32 for s in seeds):
        raise argparse.ArgumentTypeError(f"expected seeds in [0, 2**32), got {text}")
    if len(set(seeds)) < len(seeds):
        raise argparse.ArgumentTypeError(f"{text} repeats a seed; give each seed once")
    return tuple(seeds)


def name_list(text, count=None):
    """argparse type: distinct non-empty names separated by commas (`count` of them if given)."""
    names = text.split(",")
    if not all(names) or len(set(names)) < len(names) or count not in (None, len(names)):
        raise argparse.ArgumentTypeError(f"expected {count or 'some'} distinct non-empty names "
                                         f"separated by commas, got {text!r}")
    return names


def positive_float(text):
    """argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return value


def max_len(text):
    """argparse type: a length with room for [CLS], [SEP] and some text."""
    if positive_int(text) < 4:
        raise argparse.ArgumentTypeError(f"expected at least 4 ([CLS], [SEP] and text), got {text}")
    return int(text)


def parser():
    """eval.py's command line: a sub-command per entry point, each flag with its meaning."""
    p = Parser(prog="eval.py", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    device = Parser(add_help=False)
    device.add_argument("--device", default="auto", help="auto (a GPU if any), cpu, cuda, cuda:N")
    device.add_argument("--threads", type=positive_int, default=None,
                        help="CPU intra-op threads (none: $OMP_NUM_THREADS, else the idle cores)")
    model = Parser(add_help=False, parents=[device])
    model.add_argument("--tokenizer", default=None, help="a tokenizer.json, a hub id or 'bytes' "
                       "(none: the model folder's tokenizer.json, else the one its run recorded)")
    model.add_argument("--max_len", type=max_len, default=512,
                       help="tokens per text, [CLS] and [SEP] included")

    def command(fn, parents, what):  # a sub-command's --help opens with its function's docstring
        return sub.add_parser(fn.__name__, parents=parents, help=what,
                              description=inspect.cleandoc(fn.__doc__))

    cka_flags(command(cka, [model], "per-layer linear CKA of two models against seed controls"))
    finetune_flags(command(finetune, [model], "fine-tune on task folders, several seeds"))
    t = command(table, [], "fine-tuning results side by side, with baselines and paired seeds")
    t.add_argument("files", nargs="+", help="results files of `finetune`; the first: the reference")
    m = command(mlm, [device], "validation MLM and CLM loss on val.bin")
    m.add_argument("model", help="a model folder, run directory or hub id")
    m.add_argument("--data", required=True, help="a folder data.py prepared (meta.json, val.bin)")
    m.add_argument("--n_sequences", type=positive_int, default=64, help="validation windows read")
    m.add_argument("--seq_len", type=positive_int, default=512, help="tokens per window")
    m.add_argument("--batch_size", type=positive_int, default=8, help="windows per forward pass")
    k = command(curves, [], "several runs' loss curves on shared axes")
    k.add_argument("runs", nargs="+", help="train.py run directories (each with a log.jsonl)")
    k.add_argument("--out", required=True, help="the PNG to write")
    k.add_argument("--names", type=name_list, default=None, help="a name per run (none: folders)")
    return p


def cka_flags(c):
    c.add_argument("model_a", help="the reference model (e.g. the MLM run)")
    c.add_argument("model_b", help="the model compared with it (e.g. the CLM run)")
    c.add_argument("--control", dest="controls", action="append", default=[],
                   help="a run differing from model_a only in its training seed; repeat for more")
    c.add_argument("--names", type=lambda text: name_list(text, 2), default=None,
                   help="what to call model_a and model_b in the table and figure, e.g. MLM,CLM")
    c.add_argument("--texts", required=True, help="JSONL of held-out texts: {'text': ...} a line")
    c.add_argument("--n", type=positive_int, default=500, help="texts drawn per sampling seed")
    c.add_argument("--seeds", type=seed_list, default=(42, 43, 44),
                   help="sampling seeds: a draw of --n texts each")
    c.add_argument("--batch_size", type=positive_int, default=16, help="texts per forward pass")
    c.add_argument("--out", default="cka.json", help="the JSON result; the figure goes beside it")


def finetune_flags(f):
    f.add_argument("model", help="a model folder, run directory or hub id")
    f.add_argument("--task", dest="tasks", action="append", required=True,
                   help="a task folder (train/dev/test .tsv or .jsonl); repeat for more")
    f.add_argument("--seeds", type=seed_list, default=(42, 43, 44, 45, 46),
                   help="fine-tuning seeds (classifier init and data order), one run each")
    f.add_argument("--out", default="results.json", help="results JSON; seed files in OUT.seeds/")
    f.add_argument("--epochs", type=positive_int, default=None,
                   help="passes over train (none: 10; 20 for token tasks)")
    f.add_argument("--lr", type=positive_float, default=5e-5, help="AdamW peak learning rate")
    f.add_argument("--train_subset", type=positive_int, default=None,
                   help="train on this many examples (a fixed draw; none: all)")
    f.add_argument("--eval_subset", type=positive_int, default=None,
                   help="dev and test on this many examples each (a fixed draw; none: all)")
    f.add_argument("--batch_size", type=positive_int, default=16, help="examples per step")
    f.add_argument("--pooling", choices=("cls", "mean"), default="cls",
                   help="sequence tasks: the [CLS] vector or the mean over tokens")


def main(argv=None):
    args = vars(parser().parse_args(argv))
    command = {"cka": cka, "finetune": finetune, "table": table, "mlm": mlm, "curves": curves}
    command = command[args.pop("command")]
    if "threads" in args:
        torch.set_num_threads(pick_threads(args.pop("threads")))
        print(f"threads: {torch.get_num_threads()} intra-op (--threads to change)")
    return command(**args)


if __name__ == "__main__":
    run(main)
