"""The scores eval.py's task kinds report, each a function of per-example counts that add up (per label: true
positives, false positives, false negatives; per sentence: gold, found and correct entities), so that one function
scores a test set and any resample of its examples (machinery/compare.py's intervals). Written out here and tested
against scikit-learn and seqeval (tests/test_eval.py), which are not dependencies. A reader of the recipe may skip
this file."""
import numpy as np


def f1_counts(true, pred):
    """(n, C, 3) counts of (n, C) indicator matrices: per example and column, TP, FP and FN."""
    true, pred = np.asarray(true, bool), np.asarray(pred, bool)
    return np.stack([true & pred, ~true & pred, true & ~pred], -1).astype(np.int64)


def f1_from_counts(counts, present_only):
    """(macro-F1, micro-F1) of TP, FP, FN totals (..., C, 3), as sklearn's f1_score with
    zero_division=0: per column 2TP / (2TP + FP + FN). present_only: the macro mean over the
    columns that some true or predicted label falls in (sklearn's default `labels`); else over
    every column, an empty one scoring 0 (sklearn with `labels` given)."""
    tp, fp, fn = np.moveaxis(np.asarray(counts, np.float64), -1, 0)  # (..., C) each
    denominator = 2 * tp + fp + fn
    f1 = np.where(denominator > 0, 2 * tp / np.maximum(denominator, 1), 0.0)
    used = denominator > 0 if present_only else np.ones(f1.shape, bool)
    macro = (f1 * used).sum(-1) / np.maximum(used.sum(-1), 1)
    total = denominator.sum(-1)
    return macro, np.where(total > 0, 2 * tp.sum(-1) / np.maximum(total, 1), 0.0)


def one_hot(labels, columns):
    """(n, C) indicators of one label per example among `columns`."""
    index = {label: i for i, label in enumerate(columns)}
    return np.eye(len(columns), dtype=bool)[[index[x] for x in labels]]


def f1_scores(true, pred):
    """Macro- and micro-F1 of (n, C) indicator matrices over every column."""
    macro, micro = f1_from_counts(f1_counts(true, pred).sum(0), present_only=False)
    return {"macro_f1": float(macro), "micro_f1": float(micro)}


def label_f1(true, pred):
    """Single-label F1 over the labels found in either list (sklearn's default `labels`)."""
    columns = sorted(set(true) | set(pred))
    counts = f1_counts(one_hot(true, columns), one_hot(pred, columns)).sum(0)
    macro, micro = f1_from_counts(counts, present_only=True)
    return {"macro_f1": float(macro), "micro_f1": float(micro)}


def entities(tags, strict=False):
    """Entity spans (type, first, last) of one IOB2 sentence. seqeval's default mode: an I- that
    does not continue an entity of its own type starts a new one, as a B- does. strict (seqeval's
    mode="strict", scheme IOB2): an entity is a B- and the I-s of its type that follow it; an I-
    that continues nothing is no entity."""
    spans, current = [], None  # current: (type, first) of the entity being read
    for i, tag in enumerate([*tags, "O"]):
        prefix, kind = tag[:1], tag[2:]
        if current and (prefix != "I" or kind != current[0]):
            spans.append((*current, i - 1))
            current = None
        if prefix == "B" or (prefix == "I" and current is None and not strict):
            current = (kind, i)
    return spans


def entity_counts(true, pred, strict=False):
    """(n, 3): per sentence, its gold, found and correct (same type and span) entities."""
    rows = []
    for gold, found in zip(true, pred):
        g, f = set(entities(gold, strict)), set(entities(found, strict))
        rows.append((len(g), len(f), len(g & f)))
    return np.array(rows, np.int64).reshape(-1, 3)


def entity_f1_from_counts(counts):
    """Micro-F1 over exactly matching entities from (..., 3) totals: 2 correct / (gold + found)."""
    gold, found, correct = np.moveaxis(np.asarray(counts, np.float64), -1, 0)
    return np.where(gold + found > 0, 2 * correct / np.maximum(gold + found, 1), 0.0)


def entity_f1(true, pred, strict=False):
    """Micro-F1 over exactly matching (sentence, type, span) entities, as seqeval's f1_score."""
    return float(entity_f1_from_counts(entity_counts(true, pred, strict).sum(0)))
