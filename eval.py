"""
Evaluation of ModernBERT checkpoints: how far a run's representations moved (layer-wise CKA against a seed-noise
band), what they are worth downstream (fine-tuning), and how well it still predicts (validation loss).

    python eval.py cka MLM_R1,MLM_R2,MLM_R3 CLM_R1,CLM_R2,CLM_R3 --control=MLM_SEED_R1 \\
        --control=MLM_SEED_R2 --control=MLM_SEED_R3 --names=MLM,CLM --texts=heldout.jsonl
    python eval.py finetune RUN --task=tasks/ncbi_disease --task=tasks/chemprot --out=out/ft.json
    python eval.py table mlm-r1.json,mlm-r2.json clm-r1.json,clm-r2.json  # arms compared
    python eval.py mlm RUN --data=data/demo
    python eval.py curves out/clm out/mlm --out=out/curves.png   # runs on shared axes (one run: its loss.png again)
    python eval.py needle MLM_R1,MLM_R2 CLM_R1,CLM_R2 --names=MLM,CLM --texts=heldout.jsonl

A model is a Hugging Face ModernBERT folder, a hub id, or a train.py run directory. This file holds three
lessons, one `# ---` section each, in this order:

  1. CKA and its seed-noise band (`# CKA:`): linear_cka, layer_means, band and BAND_RULE, control_pairs, cka,
     cka_summary, trend.
  2. Task kinds and how each is scored (`# Task kinds.`): Kind, TokenClassification, SingleLabel, MultiLabel,
     KINDS (through kind_of).
  3. Fine-tuning (`# Fine-tuning:`): Classifier, budget, train_seed, finetune, finetune_task.

Then validation loss and loss curves (mlm, curves) and the command line. Two lessons of their own live in one file
each: comparing arms (intervals, power, verdicts, the `table` command: machinery/compare.py) and long context (the
`needle` command: machinery/needle.py). The machinery a reader may skip: batches (machinery/batches.py), the
metrics (machinery/metrics.py), models and tokenizers found and checked (machinery/models.py), task and results
files (machinery/tasks.py), tables and figures (machinery/report.py), the command line (machinery/evalcli.py). Bad
input ends in one line `error: ...` and exit status 2.
"""
import copy
import math
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from machinery import evalcli

if __name__ == "__main__":  # the flags, checked before torch is imported: a typo is answered in a second
    evalcli.check_command_line(__file__)

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from machinery.batches import batches_by_length, length_grouped, pad_batch
from machinery.cli import InputError, autocast, check_outputs, pick_device, run, save
from machinery.compare import t_interval, t_quantile, verdict
from machinery.metrics import entity_counts, entity_f1_from_counts, f1_counts, f1_from_counts, one_hot
from machinery.models import (as_list, check_validation_data, distinct_models, inspect_model, load_weights,
                              model_files, model_tokenizer, validation_setting)
from machinery.tasks import (SPLITS, cached_seed, carve_dev, is_number, read_tasks, read_texts, seed_folder,
                             split_sizes, subset)
from model import IGNORE_INDEX, ModernBERT

# ----------------------------------------------------------------------------
# CKA: per layer, how alike two models represent the same texts. The signal is the pair's
# divergence 1 - CKA against seed noise: the divergence between two runs of the reference method
# that differ only in their training seed (the seed controls), and the band rule below.

# How often the band marks a block with no effect outside, measured by simulation (tests/test_stats.py,
# test_the_band_error_rate_is_the_one_stated): studies built as reproduce.py builds them (3 MLM-CLM pairs, 3
# controls that share no run, 8 blocks), every run a shared representation plus noise of its own, scaled by a
# log-normal factor (sd 0.5 on the log scale, half of its variance shared by a run's blocks) so that runs move
# unequally far, as the measured controls do (100 texts, 32 features, 1 - CKA about 0.02 between two runs). The
# one place these figures are stated; the documents quote it. The raw-scale bound this rule replaced marked 7.2% of
# blocks outside in the same simulation, and at least one block in 33.8% of the studies.
BAND_ERROR = dict(per_block=0.0253, family_wise=0.159, blocks=8, studies=4000, spread=0.5)

BAND_RULE = ("outside the band: the geometric mean of the pair's 1 - CKA over its replicates lies above the "
             "controls' one-sided 95% prediction bound on the log scale, exp(mean + t(0.95, k - 1) * "
             "sqrt(sd^2 (1/k + 1/m) + sd_draws^2 / draws)), mean and sd of the controls' log 1 - CKA (k "
             "controls that share no run, m replicates; log, because runs move unequally far and a distance "
             "scales; sd_draws: how much the pair's mean log 1 - CKA moves between draws of texts). Measured "
             "with no effect and runs that move unequally far (log-normal, sd "
             f"{BAND_ERROR['spread']}), a block is marked outside {BAND_ERROR['per_block']:.1%} of the time and at "
             f"least one of {BAND_ERROR['blocks']} blocks {BAND_ERROR['family_wise']:.1%} of the time "
             f"({BAND_ERROR['studies']:,} simulated studies)")


def band(pair, controls, draw_sd=0.0, draws=1):
    """The seed-noise band at one layer (BAND_RULE): the controls' mean, sd and k, the bound, the pair's
    geometric mean (`level`) and whether it lies above the bound; bound and outside None with fewer than 2
    controls. pair: the pair's 1 - CKA per replicate; controls: each control's; draw_sd: the sd between draws of
    the pair's mean log 1 - CKA. A divergence is taken as at least 1e-12 (float64's rounding of 0)."""
    c, m = np.asarray(controls, np.float64), len(pair)
    logs = np.log(np.maximum(c, 1e-12))
    level = float(np.exp(np.log(np.maximum(np.asarray(pair, np.float64), 1e-12)).mean()))
    bound = None
    if len(c) > 1:
        spread = float(logs.var(ddof=1)) * (1 / len(c) + 1 / m) + draw_sd * draw_sd / draws
        bound = float(np.exp(logs.mean() + t_quantile(0.95, len(c) - 1) * math.sqrt(spread)))
    return {"mean": float(c.mean()), "sd": float(c.std(ddof=1)) if len(c) > 1 else None, "k": len(c),
            "bound": bound, "level": level, "outside": None if bound is None else bool(level > bound)}


def control_pairs(m, k):
    """The seed controls as pairs of runs that share no run with each other, over the runs
    [A_1..A_m, B_1..B_m, C_1..C_k] (C: more runs of A's method): A_j with C_j (the same data
    order, another training seed, as the study trains them), then the runs left over two by two.
    Controls that share a run (A1-A2, A1-A3, A2-A3) are correlated: their spread understates seed
    noise and the band errs more often than it says."""
    partnered = [(j, 2 * m + j) for j in range(min(m, k))]
    left = list(range(min(m, k), m)) + [2 * m + j for j in range(min(m, k), k)]
    return partnered + list(zip(left[0::2], left[1::2]))


def linear_cka(X, Y):
    """Linear CKA of (n, p) and (n, q) features in float64: float32, or centring after forming the
    n x n Gram matrices, cancels catastrophically on deep layers, whose features share an offset.
    NaN when either is the same for every text (CKA is undefined there, not 1)."""
    X = np.asarray(X, np.float64).reshape(len(X), -1)
    Y = np.asarray(Y, np.float64).reshape(len(Y), -1)
    Xc, Yc = X - X.mean(0), Y - Y.mean(0)
    if min(np.linalg.norm(Xc) / max(np.linalg.norm(X), 1e-300),
           np.linalg.norm(Yc) / max(np.linalg.norm(Y), 1e-300)) < 1e-9:  # rounding noise only
        return math.nan
    return float(np.linalg.norm(Yc.T @ Xc) ** 2 / (np.linalg.norm(Xc.T @ Xc) * np.linalg.norm(Yc.T @ Yc)))


@torch.no_grad()
def layer_means(model, tok, texts, max_len, batch_size, device):
    """(L, len(texts), d) float64: each text's attention-masked mean of every block's output (before final_norm)."""
    seqs = [[tok.cls_id, *ids[:max_len - 2], tok.sep_id] for ids in tok.encode_batch(texts)]
    c = model.config
    out = torch.empty(c.num_hidden_layers, len(seqs), c.hidden_size, dtype=torch.float64)
    for idx in batches_by_length(seqs, batch_size):
        ids, mask = pad_batch([seqs[i] for i in idx], tok.pad_id, device)
        with autocast(device):
            layers = model.encode(ids, mask, all_layers=True)  # L x (B, T, d)
        weight = mask[..., None].double()  # (B, T, 1)
        for layer, h in enumerate(layers):
            out[layer, torch.from_numpy(idx)] = ((h.double() * weight).sum(1) / weight.sum(1)).cpu()
    return out.numpy()


def cka(model_a, model_b, texts, controls=(), names=None, n=500, seeds=(42, 43, 44), max_len=512,
        out="cka.json", batch_size=16, tokenizer=None, device="auto"):
    """Per-layer CKA of model A and model B, mean over the sampling seeds (draws of n texts),
    against seed noise. model_a, model_b: a model each, or lists of replicates, A's r-th paired
    with B's r-th. controls: more runs of A's method, control j trained like A's j-th replicate
    but for its training seed; the seed controls are pairs that share no run (control_pairs).
    names: what to call A and B (default: the first replicates' folder names). Writes out (JSON,
    every draw kept) and a PNG beside it; returns the dict of cka_summary."""
    a_runs, b_runs = as_list(model_a), as_list(model_b)
    if len(a_runs) != len(b_runs):
        raise InputError(f"{len(a_runs)} replicates of model A but {len(b_runs)} of model B; "
                         f"replicate r of A pairs with replicate r of B")
    pool = read_texts(texts, n)  # at least n, and 3 distinct: of 2 texts CKA is 1 whatever the models
    paths = [*a_runs, *b_runs, *controls]
    infos = distinct_models(paths, ModernBERT, same_ok=(0, len(a_runs)))  # A against itself: 1 - CKA = 0
    toks = [model_tokenizer(info, tokenizer) for info in infos]
    check_outputs("--out", [out, Path(out).with_suffix(".png")], [texts, *model_files(infos, toks)])
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
    m = len(a_runs)
    pairs, seed_controls = [(r, m + r) for r in range(m)], control_pairs(m, len(controls))
    per_seed = {}
    for seed, draw in draws.items():
        rows = np.searchsorted(union, draw)
        per_seed[seed] = {key: [[linear_cka(features[i][layer, rows], features[j][layer, rows])
                                 for layer in range(len(features[i]))] for i, j in which]
                          for key, which in (("pairs", pairs), ("controls", seed_controls))}
        if any(math.isnan(x) for rows in per_seed[seed].values() for row in rows for x in row):
            raise InputError(f"{texts}: the {n} texts drawn with seed {seed} give every text the "
                             f"same features in some layer: CKA is undefined there (are the texts "
                             f"identical or empty?)")
    result = {"names": list(names or [Path(str(runs[0])).name for runs in (a_runs, b_runs)]),
              **cka_summary(per_seed), "per_seed": per_seed,
              "args": dict(model_a=list(map(str, a_runs)), model_b=list(map(str, b_runs)),
                           texts=str(texts), n=n, controls=list(map(str, controls)),
                           control_pairs=[[str(paths[i]), str(paths[j])] for i, j in seed_controls],
                           seeds=list(seeds), max_len=max_len, tokenizer=tokenizer)}
    save(out, result)
    from machinery.report import cka_markdown, plot_cka  # rendering: matplotlib only here
    print(cka_markdown(result))
    plot_cka(result, Path(out).with_suffix(".png"))
    return result


def cka_summary(per_seed):
    """Per layer: cka and divergence = 1 - cka (means over replicates and draws); the divergence of
    each replicate, its 95% t interval over replicates and how much it moves between draws; with
    controls, their divergences, the band (BAND_RULE) and the ratio, each replicate's divergence over
    its own seed control's (the control that shares its run of A's method), with its interval over
    those replicates (None where a control does not diverge: below 1e-12 is float64 rounding of
    zero), and the trend with depth (`trend`)."""
    pairs = 1 - np.array([s["pairs"] for s in per_seed.values()])  # (draws, m, L)
    draws, m, L = pairs.shape
    each = pairs.mean(0)  # (m, L)
    draw_sd = pairs.mean(1).std(0, ddof=1) if draws > 1 else np.zeros(L)
    logs = np.log(np.maximum(pairs, 1e-12)).mean(1)  # (draws, L): the band's statistic on each draw
    log_draw_sd = logs.std(0, ddof=1) if draws > 1 else np.zeros(L)
    spread = [t_interval(each[:, layer], bounds=(0.0, 1.0)) for layer in range(L)]  # clipped to 1 - CKA's range
    r = {"layers": list(range(L)), "replicates": m, "draws": draws,
         "cka": (1 - pairs).mean((0, 1)).tolist(), "divergence": each.mean(0).tolist(),
         "divergence_replicates": each.tolist(), "divergence_low": [s[1] for s in spread],
         "divergence_high": [s[2] for s in spread], "divergence_draw_sd": draw_sd.tolist()}
    controls = np.array([s["controls"] for s in per_seed.values()])  # (draws, k, L)
    if controls.size == 0:
        return r
    controls = 1 - controls.mean(0)  # (k, L)
    bands = [band(each[:, layer], controls[:, layer], log_draw_sd[layer], draws) for layer in range(L)]
    own = min(m, len(controls))  # control j pairs A_j with a run of its own (control_pairs): replicate j's
    ratios = [t_interval(each[:own, layer] / controls[:own, layer], bounds=(0.0, math.inf))
              if controls[:own, layer].min() >= 1e-12 else (None,) * 3 for layer in range(L)]
    r["controls"] = {"divergence": controls.tolist(), "k": len(controls),
                     "mean": [b["mean"] for b in bands], "sd": [b["sd"] for b in bands]}
    r["band"] = {"bound": [b["bound"] if b["bound"] is None else min(1.0, b["bound"]) for b in bands],  # 1 - CKA <= 1
                 "level": [b["level"] for b in bands], "outside": [b["outside"] for b in bands], "rule": BAND_RULE}
    r["ratio"] = {key: [x[i] for x in ratios] for i, key in enumerate(("mean", "low", "high"))}
    r["ratio"]["replicates"] = own
    if controls[:own].min() >= 1e-12 and L > 1:
        r["trend"] = trend(each, controls[:own])
    return r


def trend(each, controls):
    """How the divergence changes with depth, the paper's signature (lower blocks move most), read
    two ways: per replicate, the least-squares slope against the block index of its ratio (its
    divergence over its own control's, so that each slope carries its control's noise) and of its
    raw 1 - CKA; each slope's mean with a 95% t interval over replicates. The ratio alone can fall
    because its controls rise; a reading is given only where both intervals exclude 0 on the same
    side. each: (m, L) the pairs' divergences; controls: (n, L), control j replicate j's."""
    layers = np.arange(each.shape[1], dtype=np.float64)
    out = {}
    for key, rows in (("ratio", each[:len(controls)] / controls), ("raw", each)):
        slopes = [float(np.polyfit(layers, row, 1)[0]) for row in rows]  # units per block
        mean, low, high = t_interval(slopes)
        out[key] = {"slope": mean, "low": low, "high": high, "each": slopes,
                    "verdict": verdict(low, high, "rises with depth", "falls with depth").replace(
                        "no detectable difference", "no detectable trend")}
    ratio, raw = out["ratio"]["verdict"], out["raw"]["verdict"]
    out["verdict"] = ratio if ratio == raw else f"no reading (the ratio: {ratio}; the raw 1 - CKA: {raw})"
    return out


# ----------------------------------------------------------------------------
# Task kinds. What differs between them (targets, loss, decoding, metrics, majority baseline) is one class; a new
# kind is a class and an entry in KINDS (and, for a new file format, a reader in machinery/tasks.py). Targets are
# built over train's labels. A dev or test label that train lacks (read_task warns once per label) gets the target
# UNSEEN, is never predicted and counts as missed: the same for every kind. A kind scores through per-example
# counts (`counts`, then `metrics` of their sum), so that a resample of the test examples is scored by the same code.

UNSEEN = -1  # never in a loss: train holds no such label


def cross_entropy(logits, targets):
    return F.cross_entropy(logits.flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX)


class Kind:
    def score(self, gold, preds, labels):
        """Every metric of predictions against gold labels; labels: the task's "scored" labels."""
        totals = self.counts(gold, preds, self.columns(gold, preds, labels)).sum(0)
        return {metric: float(value) for metric, value in self.metrics(totals).items()}

    def fill(self, label, gold):
        """`label` (the majority's) predicted for every example of gold."""
        return [label for _ in gold]

    def permute(self, preds, rng):
        """Chance: the predictions dealt to the examples in a random order (rng: numpy's)."""
        return [preds[i] for i in rng.permutation(len(preds))]


class TokenClassification(Kind):
    """IOB2 tags, one per word, predicted on the word's first sub-token; entity F1 as seqeval, in
    its default mode or (strict=True) its strict IOB2 mode; tag-level F1 and accuracy beside it."""
    name, primary, epochs, per_token = "token", "entity_f1", 20, True

    def __init__(self, strict=False):
        self.strict = strict

    def encode(self, labels, examples, tok, max_len):
        """(ids, target) per sentence, target the tag's class on a word's first sub-token and -100 elsewhere.
        Whole words only: a word cut by max_len goes with all that follow it (they count as predicted "O")."""
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

    def columns(self, gold, preds, labels):  # the tags found in either: sklearn's default labels
        return sorted({t for tags in [*gold, *preds] for t in tags})

    def counts(self, gold, preds, columns):
        """(n, 3 + 3C + 2) per sentence: gold, found and correct entities; each tag's TP, FP and
        FN over the words; words tagged right, words."""
        tags = [f1_counts(one_hot(g, columns), one_hot(p, columns)).sum(0).ravel()
                for g, p in zip(gold, preds)]
        right = [(sum(a == b for a, b in zip(g, p)), len(g)) for g, p in zip(gold, preds)]
        tags = np.reshape(tags, (len(gold), 3 * len(columns)))
        entity = entity_counts(gold, preds, self.strict)
        return np.hstack([entity, tags, np.reshape(right, (-1, 2))])

    def metrics(self, t):  # t: (..., K) totals of counts
        macro, micro = f1_from_counts(t[..., 3:-2].reshape(*t.shape[:-1], -1, 3), present_only=True)
        return {"entity_f1": entity_f1_from_counts(t[..., :3]), "macro_f1": macro,
                "micro_f1": micro, "accuracy": t[..., -2] / np.maximum(t[..., -1], 1)}

    def majority(self, train):
        return Counter(t for ex in train for t in ex["label"]).most_common(1)[0][0]

    def fill(self, tag, gold):
        return [[tag] * len(tags) for tags in gold]

    def permute(self, preds, rng):  # the tags dealt to the words: sentence lengths kept
        tags = [t for p in preds for t in p]
        tags = [tags[i] for i in rng.permutation(len(tags))]
        ends = np.cumsum([len(p) for p in preds])
        return [tags[end - len(p):end] for p, end in zip(preds, ends)]


class SequenceClassification(Kind):
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

    def counts(self, gold, preds, columns):
        """(n, 3C + 2) per example: each column's TP, FP and FN; right (1 or 0), 1."""
        true, pred = self.indicators(gold, columns), self.indicators(preds, columns)
        right = (true == pred).all(1)  # the label, or the whole set of labels
        return np.hstack([f1_counts(true, pred).reshape(len(gold), -1),
                          np.stack([right, np.ones_like(right)], 1)])

    def metrics(self, t):
        macro, micro = f1_from_counts(t[..., :-2].reshape(*t.shape[:-1], -1, 3), self.present_only)
        accuracy = t[..., -2] / np.maximum(t[..., -1], 1)
        return {"macro_f1": macro, "micro_f1": micro, "accuracy": accuracy}


def fit_pair(a, b, budget):
    """Cut the longer of two id lists first, a token at a time (ties cut b), to fit the budget."""
    kept_b = min(len(b), max(budget // 2, budget - len(a)))
    return a[:budget - kept_b], b[:kept_b]


class SingleLabel(SequenceClassification):
    """One label per example: softmax over the labels; macro-F1 over the labels found in gold or
    predictions (sklearn's default); accuracy."""
    name, present_only = "single", True
    loss = staticmethod(cross_entropy)

    def columns(self, gold, preds, labels):
        return sorted(set(gold) | set(preds))

    def indicators(self, values, columns):
        return one_hot(values, columns)

    def target(self, label, labels):
        return labels.index(label) if label in labels else UNSEEN

    def decode(self, logits, target, example, labels):
        return labels[logits.argmax()]

    def majority(self, train):
        return Counter(ex["label"] for ex in train).most_common(1)[0][0]


class MultiLabel(SequenceClassification):
    """A list of labels per example (possibly empty): a sigmoid per label, predicted when its logit
    is > 0; macro-F1 over the task's label columns; accuracy: the whole set right (exact match)."""
    name, present_only = "multi", False

    def columns(self, gold, preds, labels):
        return labels

    def indicators(self, sets, columns):
        rows = [[label in s for label in columns] for s in sets]
        return np.array(rows, bool).reshape(-1, len(columns))

    def target(self, label, labels):  # an unseen label has no column: it only enters the score
        return [float(x in label) for x in labels]

    def loss(self, logits, targets):
        return F.binary_cross_entropy_with_logits(logits, targets)

    def decode(self, logits, target, example, labels):
        return [label for label, z in zip(labels, logits) if z > 0]

    def majority(self, train):  # every label more than half of the train examples carry
        counts = Counter(x for ex in train for x in ex["label"])
        return sorted(x for x in counts if counts[x] > len(train) / 2)


KINDS = {kind.name: kind for kind in (TokenClassification(), SingleLabel(), MultiLabel())}
NER_MODES = {"default": KINDS["token"], "strict": TokenClassification(strict=True)}


def kind_of(task, ner_mode=None):
    """The task's kind; a token task reads its entities in seqeval's default or strict mode (None:
    the mode a results file's task records, else the default). machinery/compare.py takes it."""
    ner_mode = ner_mode or task.get("ner_mode") or "default"
    return NER_MODES[ner_mode] if task["kind"] == "token" else KINDS[task["kind"]]

# ----------------------------------------------------------------------------
# Fine-tuning: AdamW (weight decay 0.01, none on biases and norms), linear decay, batch 16, no dropout; 10
# epochs (20 for token classification) or a budget in optimizer steps (--steps), so that no task
# is starved; dev is scored at evenly spaced points, the best point's weights once on test.


@dataclass
class Settings:
    """What every (task, seed) run of one `finetune` call shares."""
    epochs: int  # None: the task kind's default (when steps is None)
    steps: int  # optimizer steps per (task, seed); None: epochs over train
    evals: int  # dev evaluations spread evenly over the steps; None: one per epoch (4 with steps)
    lr: float
    max_len: int
    batch_size: int
    pooling: str
    pad_id: int
    device: torch.device
    ner_mode: str = "default"  # how entities are read from IOB2 tags (NER_MODES)


class Classifier(nn.Module):
    """Encoder, its pretrained head transform (dense, GELU, norm: as HF's ModernBert*Classification),
    dropout and a linear layer, on the pooled vector (sequence tasks) or every token (token tasks)."""

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
    return InputError(f"{task['name']}: {what} (the fine-tuning diverged: try a lower --lr than {s.lr})")


@torch.no_grad()
def evaluate(model, task, split, s):
    """(metrics, predictions) on split = (examples, encoded); a prediction is a label, a list of
    labels, or one tag per word."""
    examples, encoded = split
    kind = kind_of(task, s.ner_mode)
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


def budget(kind, n_train, s):
    """(optimizer steps, the steps after which dev is scored): epochs over train; or s.steps, at
    most s.epochs over train when both are given (a small task is not read fifty times over); dev
    after each epoch, or at s.evals evenly spaced points (the last one the final step)."""
    per_epoch = math.ceil(n_train / s.batch_size)
    epochs = kind.epochs if s.epochs is None else s.epochs
    total = (epochs * per_epoch if s.steps is None else
             min(s.steps, s.epochs * per_epoch) if s.epochs else s.steps)
    evals = min(total, s.evals or (4 if s.steps else epochs))
    return total, sorted({round(total * i / evals) for i in range(1, evals + 1)})


def train_seed(base, task, data, seed, s):
    """Fine-tune a copy of base on data["train"] = (examples, encoded); the point with the best dev
    primary metric is scored on test. Returns {"dev", "best_step", "steps", "test", "seconds"} and
    the dev and test predictions at that point."""
    kind = kind_of(task, s.ner_mode)
    train = data["train"][1]
    steps, points = budget(kind, len(train), s)
    torch.manual_seed(seed)  # the classifier init and dropout
    model = Classifier(copy.deepcopy(base), len(task["labels"]), kind.per_token, s.pooling)
    model = model.to(s.device)
    optimizer = optimizer_for(model, s.lr)
    # linear decay to 0 and no warmup: with few steps per epoch a warmup would take a large share
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    shuffle, lengths = torch.Generator().manual_seed(seed), [len(ids) for ids, _ in train]
    batches = (b for _ in iter(int, 1) for b in length_grouped(lengths, s.batch_size, shuffle))
    best, losses, start = None, [], time.time()
    model.train()
    for step, idx in zip(range(1, steps + 1), batches):
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
        if step not in points:
            continue
        train_loss, losses = torch.stack(losses).mean().item(), []
        if not math.isfinite(train_loss):
            raise diverged(task, s, f"seed {seed} step {step}: train loss {train_loss}")
        dev, dev_preds = evaluate(model, task, data["dev"], s)
        better = best is None or dev[kind.primary] > best["dev"][kind.primary]
        if better:  # the best point's weights, kept in memory
            best = {"dev": dev, "best_step": step, "state": copy.deepcopy(model.state_dict()),
                    "dev_predictions": dev_preds}
        print(f"  seed {seed} step {step}/{steps} (epoch {step * s.batch_size / len(train):.1f}): "
              f"train loss {train_loss:.4f}, dev {kind.primary} {dev[kind.primary]:.4f}"
              f"{' (best)' if better else ''}, {time.time() - start:.0f} s", flush=True)
        model.train()
    model.load_state_dict(best.pop("state"))
    preds = {"dev": best.pop("dev_predictions")}
    test, preds["test"] = evaluate(model, task, data["test"], s)
    return {**best, "steps": steps, "test": test, "seconds": round(time.time() - start, 2)}, preds


def finetune(model, tasks, seeds=(42, 43, 44, 45, 46), out="results.json", epochs=None, steps=None,
             evals=None, lr=5e-5, max_len=512, train_subset=None, dev_subset=None, test_subset=None,
             dev_min=0, batch_size=16, pooling="cls", ner_mode="default", device="auto",
             tokenizer=None):
    """Fine-tune model on each task folder once per seed; writes out (JSON, after every task) and
    returns it. Each (task, seed) is written with its dev and test predictions to OUT.seeds/ when
    done, under a name keyed on a fingerprint of the settings, the model's weights, the task files'
    contents and the code (every script and machinery module): a later call reuses exactly the pairs
    whose inputs and code did not change."""
    tasks = read_tasks(tasks, seeds)  # every input error surfaces before any training
    splits = {t["name"]: carve_dev(t, dev_min) for t in tasks}  # a bad --dev_min ends here too
    info = inspect_model(model, ModernBERT)
    tok = model_tokenizer(info, tokenizer)
    check_outputs("--out", [out], [*(f for t in tasks for f in t["files"].values()), Path(out).with_suffix(".seeds"),
                                   *model_files([info], [tok])])
    device = pick_device(device)
    base = load_weights({**info, "config": info["config"].replace(attention_dropout=0.0)}, device)  # no dropout, ever
    seed_dir = seed_folder(out)  # one that cannot be written ends here, before training; made once the weights load
    s = Settings(epochs, steps, evals, lr, max_len, batch_size, pooling, tok.pad_id, device, ner_mode)
    args = dict(model=str(model), seeds=list(seeds), epochs=epochs, steps=steps, evals=evals, lr=lr,
                max_len=max_len, train_subset=train_subset, dev_subset=dev_subset,
                test_subset=test_subset, dev_min=dev_min, batch_size=batch_size, pooling=pooling,
                ner_mode=ner_mode, tokenizer=tok.spec)
    inputs = {**args, "model": info["sha256"], "config": repr(info["config"]), "seeds": None,
              "tokenizer": tok.fingerprint, "device": device.type}  # what the numbers depend on, with the code
    results = {"model": str(model), "args": args, "tasks": {}}
    for task in tasks:
        train, dev, how = splits[task["name"]]
        examples = {"train": subset(train, train_subset), "dev": subset(dev, dev_subset),
                    "test": subset(task["test"], test_subset)}
        results["tasks"][task["name"]] = finetune_task(base, tok, task, examples, how, seeds, s, inputs, seed_dir)
        save(out, results)
    return results


def finetune_task(base, tok, task, examples, dev_split, seeds, s, inputs, seed_dir):
    """One task: encoded, fine-tuned once per seed (or a seed's saved result reused), summarised
    beside the majority baseline: mean and sample std (ddof=1; 0 for one seed) of each metric."""
    kind = kind_of(task, s.ner_mode)
    data = {split: (examples[split], kind.encode(task["labels"], examples[split], tok, s.max_len))
            for split in SPLITS}
    steps, points = budget(kind, len(examples["train"]), s)
    print(f"{task['name']}: {kind.name}, {len(task['labels'])} labels, {split_sizes(examples, dev_split)}, {steps} "
          f"steps of {s.batch_size} ({steps * s.batch_size / len(examples['train']):.1f} epochs), dev scored "
          f"{len(points)} times")
    every = [[x for split in SPLITS for x in data[split][part]] for part in (0, 1)]
    print("  train, dev and test: " + kind.truncation(*every, s.max_len))
    inputs = {**inputs, "task": task["name"], "kind": kind.name, "sha256": task["sha256"]}

    def rows(split, preds):  # each example's index, line, origin, gold label and prediction
        return [{"index": ex["index"], "line": ex["line"], "from": ex.get("from", split),
                 "gold": ex["label"], "pred": p} for ex, p in zip(data[split][0], preds)]

    def run(seed):
        result, preds = train_seed(base, task, data, seed, s)
        return result, {split: rows(split, p) for split, p in preds.items()}

    runs = {str(seed): cached_seed(seed_dir, task, inputs, seed, lambda: run(seed)) for seed in seeds}
    top = kind.majority(examples["train"])  # what the model trained on: without dev's carve-out, within --train_subset
    gold = {split: [ex["label"] for ex in examples[split]] for split in ("dev", "test")}
    baseline = {split: kind.score(gold[split], kind.fill(top, gold[split]), task["scored"])
                for split in gold}
    values = {m: [r["test"][m] for r in runs.values()] for m in baseline["test"]}
    mean = {m: float(np.mean(v)) for m, v in values.items()}
    std = {m: float(np.std(v, ddof=1)) if len(v) > 1 else 0.0 for m, v in values.items()}
    print(f"{task['name']}: test {kind.primary} {100 * mean[kind.primary]:.2f} ± {100 * std[kind.primary]:.2f} over "
          f"{len(seeds)} seeds; majority baseline {100 * baseline['test'][kind.primary]:.2f}")
    return {"task": task["name"], "kind": kind.name, "labels": task["labels"], "scored": task["scored"],
            "primary": kind.primary, "steps": steps, "ner_mode": s.ner_mode if kind.name == "token" else None,
            "files": task["files"], "sha256": task["sha256"], "dev_split": dev_split, "majority": top,
            "examples": {split: len(examples[split]) for split in SPLITS}, "seeds": runs, "mean": mean, "std": std,
            "baseline": baseline}


# ----------------------------------------------------------------------------
# Validation loss, and loss curves


def mlm(model, data, n_sequences=None, seq_len=None, batch_size=8, device="auto"):
    """Validation losses as train.py measures them: MLM (15% masked) and CLM on the first n_sequences windows of
    seq_len tokens of data/val.bin, each a mean over their labelled tokens (None: as a run was validated)."""
    info = inspect_model(model, ModernBERT)
    n_sequences, seq_len, dtype, sep_id = validation_setting(info, data, n_sequences, seq_len)
    check_validation_data(data, info, n_sequences, seq_len)  # never fewer windows than asked for
    device = pick_device(device)
    net = load_weights(info, device)
    from train import validation_losses  # only this command needs the trainer
    losses = validation_losses(net, data, seq_len, n_sequences, batch_size, device, dtype, sep_id)
    bad = [f"{k} = {v}" for k, v in losses.items() if not is_number(v)]
    if bad:
        raise InputError(f"{model} on {data}/val.bin: {', '.join(bad)}; a loss that is not finite means nothing")
    print(f"{model} on {data}/val.bin ({n_sequences} windows of {seq_len}): validation MLM loss "
          f"{losses['val_mlm']:.4f} (15% masked), CLM loss {losses['val_clm']:.4f}")
    return losses


def curves(runs, out=None, names=None):
    """Loss curves (machinery/curves.py): one run's picture across the phases it continues (its loss.png unless
    --out names another), or several runs on shared axes, one colour per run."""
    from machinery.curves import draw  # matplotlib: only this command needs it
    return draw([str(r) for r in runs], out and str(out), names)


# ----------------------------------------------------------------------------
# Command line


def main(argv=None):
    """eval.py's command line (machinery/evalcli.py): a sub-command per function above."""
    return evalcli.main(sys.modules[__name__], argv)


if __name__ == "__main__":
    run(main)
