"""Long context, the needle: can an encoder fill in a value it read far back? A made-up code (the needle's value)
is written into real held-out text (the haystack) and asked for at the end with its tokens masked; the model must
fill them from what it read, with bidirectional attention, as an encoder is used. Every depth and both controls of
one length share the same values and the same text: they differ only in where the needle is.

Read on its own, top to bottom: the examples, filling the masks, the scores with their intervals, the command
(`eval.py needle`, reproduce.py's long-context stage). eval.py hands it the model class; tables and the heat map
are machinery/report.py's.
"""
import json
import math
import time
from pathlib import Path
from statistics import NormalDist

import numpy as np
import torch

from machinery.cli import InputError, autocast, check_outputs, pick_device, save, write_text
from machinery.compare import interval, t_interval
from machinery.models import as_list, inspect_model, load_weights, model_files, model_tokenizer
from machinery.tasks import read_jsonl

NEEDLE = (" The code is", ".")  # the words around the value; the query at the end restates them
CONSONANTS = "BCDFGHJKLMNPQRSTVWXZ"  # no vowels: a value spells no word the model could guess from priors
CONTROLS = ("no needle", "next to the query")
VALUE_POOL = "3 consonants, a dash and 3 digits, e.g. QXT-481; 8,000,000 codes"


def needle_value(rng):
    """A value from the pool (VALUE_POOL): no text holds it, and it is several tokens in any tokenizer."""
    return "".join(rng.choice(list(CONSONANTS), 3)) + "-" + "".join(str(d) for d in rng.integers(0, 10, 3))


def needle_examples(tok, texts, lengths, depths, n, seed):
    """The examples, length by length, example by example, each depth then the controls. Example i of length L
    draws its value and its haystack's first text with (seed, L, i); the haystack is the texts (each with a
    leading space, joined, wrapping round after the last) from there. A sequence is [CLS] haystack query [SEP],
    exactly L tokens. The needle (prefix, value, suffix, tokenized apart, so that the query's [MASK]s are exactly
    the value's tokens) sits in the haystack with depth% of the haystack's other tokens between it and the
    query: 0 right before the query, 100 right after [CLS]. Controls: the haystack without the needle (what the
    model guesses from priors), and [CLS] needle query [SEP] alone (its best case, shorter than L)."""
    prefix, suffix = tok.encode(NEEDLE[0]), tok.encode(NEEDLE[1])
    docs = tok.encode_batch([" " + t for t in texts])
    stream = np.concatenate([np.asarray(d, np.int64) for d in docs] or [np.zeros(0, np.int64)])
    starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    if len(stream) < max(lengths) - 2:  # a haystack never repeats a text
        raise InputError(f"--texts: {len(texts)} texts hold {len(stream)} tokens, fewer than the "
                         f"{max(lengths) - 2} a haystack of {max(lengths)} tokens needs (--lengths)")
    examples = []
    for L in lengths:
        for i in range(n):
            rng = np.random.default_rng([seed, L, i])
            value = needle_value(rng)
            first = int(starts[rng.integers(len(docs))])
            answer = tok.encode(" " + value)
            needle, query = prefix + answer + suffix, prefix + [tok.mask_id] * len(answer) + suffix
            room = L - 2 - len(query)  # the haystack's tokens, the needle's among them
            filler = room - len(needle)
            if filler < 1:
                raise InputError(f"--lengths: {L} tokens cannot hold [CLS], the needle ({len(needle)} tokens), "
                                 f"the query ({len(query)}), [SEP] and any haystack")
            hay = np.take(stream, np.arange(first, first + room), mode="wrap").tolist()

            def example(column, ids, at):
                q = len(ids) - 1 - len(query)  # where the query starts
                return dict(length=L, column=column, index=i, value=value, needle_at=at, answer=answer,
                            masked=list(range(q + len(prefix), q + len(prefix) + len(answer))), ids=ids)

            for d in depths:
                before = filler - round(d / 100 * filler)  # haystack tokens between [CLS] and the needle
                ids = [tok.cls_id, *hay[:before], *needle, *hay[before:filler], *query, tok.sep_id]
                examples.append(example(str(d), ids, 1 + before))
            examples.append(example(CONTROLS[0], [tok.cls_id, *hay, *query, tok.sep_id], None))
            examples.append(example(CONTROLS[1], [tok.cls_id, *needle, *query, tok.sep_id], 1))
    return examples


@torch.no_grad()
def fill_masks(model, examples, batch_tokens, device):
    """Per example, whether the argmax of the MLM logits at each [MASK] is the value's token (a list of bools).
    Sequences of one token count go together, max(1, batch_tokens // count) per forward, so memory stays within
    batch_tokens tokens' activations (or one sequence's); the head runs on the masked positions alone."""
    hits, groups = [None] * len(examples), {}
    for i, ex in enumerate(examples):
        groups.setdefault(len(ex["ids"]), []).append(i)
    for T, members in groups.items():
        size = max(1, batch_tokens // T)
        for idx in (members[j:j + size] for j in range(0, len(members), size)):
            ids = torch.tensor([examples[i]["ids"] for i in idx], device=device)  # (B, T): no padding
            rows = torch.tensor([b for b, i in enumerate(idx) for _ in examples[i]["masked"]], device=device)
            cols = torch.tensor([p for i in idx for p in examples[i]["masked"]], device=device)
            with autocast(device):
                guess = model.predict(model.encode(ids)[rows, cols]).argmax(-1).tolist()  # (M,)
            for i in idx:
                answer = examples[i]["answer"]
                hits[i], guess = [g == a for g, a in zip(guess, answer)], guess[len(answer):]
    return hits


def wilson(k, n, z=NormalDist().inv_cdf(0.975)):
    """The Wilson score interval of k successes in n independent trials (95% by default): unlike p +- z * se it
    stays within [0, 1] and is not empty at 0 or n of n."""
    p, z2 = k / n, z * z
    centre, half = (p + z2 / (2 * n)) / (1 + z2 / n), z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def needle_cell(hits):
    """One model's cell: exact match (every token of the value) with its Wilson interval, and token accuracy
    with its t interval, over the examples (the independent unit); each example's numbers kept."""
    exact = [int(all(h)) for h in hits]
    token = [sum(h) / len(h) for h in hits]
    low, high = wilson(sum(exact), len(exact))
    mean, t_low, t_high = t_interval(token, bounds=(0.0, 1.0))  # cut to the values an accuracy can take
    return dict(n=len(hits), exact=sum(exact) / len(exact), exact_low=low, exact_high=high, token=mean,
                token_low=t_low, token_high=t_high, exact_each=exact, token_each=token)


def replicates_cell(cells):
    """An arm's cell: the mean over its replicates with a 95% interval over every unit it rests on (eval.interval:
    the replicates' spread, pretraining noise, and a bootstrap of the examples, the same for every replicate), cut
    to [0, 1]. Exact match's interval also holds the Wilson interval of the examples' means over replicates: where
    every replicate misses (or fills) every example, the spread is 0 but n examples still bound the rate. One
    replicate: its own cell."""
    if len(cells) == 1:
        return {k: v for k, v in cells[0].items() if not k.endswith("_each")}
    out = dict(n=cells[0]["n"], replicates=len(cells))
    for key in ("exact", "token"):
        each = np.array([c[f"{key}_each"] for c in cells], np.float64)  # (R, N)
        counts = np.stack([each, np.ones_like(each)], -1)[:, None]  # (R, 1, N, 2): a score and 1 per example
        iv = interval(lambda totals: totals[..., 0] / totals[..., 1], counts)
        low, high = iv["low"], iv["high"]
        if key == "exact":
            w_low, w_high = wilson(each.mean(0).sum(), each.shape[1])
            low, high = min(low, w_low), max(high, w_high)
        out.update({key: iv["mean"], f"{key}_low": max(0.0, low), f"{key}_high": min(1.0, high)})
    return out


def needle(models, texts, model_class, names=None, lengths=(512, 1024, 2048, 4096, 8192), depths=(0, 25, 50, 75, 100),
           n=20, seed=0, out="needle.json", batch_tokens=8192, tokenizer=None, device="auto"):
    """Needle in a haystack: can the model fill a value it read up to L tokens earlier? For each length and depth (how
    far back from the query the needle sits, as a share of the haystack: 0% right before the query, 100% right after
    [CLS]), n examples from the held-out texts (needle_examples), each masked token filled by the argmax of the MLM
    logits with bidirectional attention: what an encoder does. A decoder (CLM-only) model reads left to right and is
    not what this measures. Scored by exact match of the whole value (Wilson 95% interval over examples) and token
    accuracy (t interval); two controls per length: no needle (priors) and the needle next to the query with no
    haystack (the best case). models: one per arm, or an arm's replicates separated by commas (their mean is given
    beside each one's); model_class: model.py's ModernBERT. Writes out (JSON: the inputs and every cell), the
    examples beside it (OUT.examples.jsonl) and a heat map (PNG); returns the result."""
    arms = [as_list(m) for m in models]
    names = list(names or [Path(str(a[0])).name for a in arms])
    if len(names) != len(arms) or len(set(names)) < len(names):
        raise InputError(f"--names gives {len(names)} distinct names for {len(arms)} models")
    groups = [[inspect_model(p, model_class) for p in arm] for arm in arms]
    infos, seen = [info for group in groups for info in group], {}
    for info in infos:  # a replicate given twice would count one run twice in its arm's mean
        if info["sha256"] in seen:
            raise InputError(f"{info['path']} has the same weights as {seen[info['sha256']]}; each model and "
                             f"replicate must be a run of its own")
        seen[info["sha256"]] = info["path"]
    toks = [model_tokenizer(info, tokenizer) for info in infos]
    check_outputs("--out", [out, *(Path(out).with_suffix(s) for s in (".examples.jsonl", ".png"))],
                  [texts, *model_files(infos, toks)])
    if len({t.fingerprint for t in toks}) > 1:
        raise InputError("the models use different tokenizers; the examples are token sequences, the same for "
                         "every model: run needle once per tokenizer")
    for info in infos:
        top = info["config"].max_position_embeddings
        if max(lengths) > top:
            raise InputError(f"--lengths={','.join(map(str, lengths))}: {max(lengths)} is above "
                             f"{info['path']}'s max_position_embeddings {top}")
    pool = [ex["text"] for ex in read_jsonl(texts, labelled=False)]
    examples = needle_examples(toks[0], pool, lengths, depths, n, seed)  # bad lengths end here, before compute
    written = Path(out).with_suffix(".examples.jsonl")
    try:
        written.parent.mkdir(parents=True, exist_ok=True)
        write_text(written, (json.dumps({**ex, "text": toks[0].decode(ex["ids"])}) + "\n" for ex in examples))
    except OSError as e:
        raise InputError(f"{written}: cannot write it ({e.strerror or e})") from None
    device, start = pick_device(device), time.time()
    columns = [str(d) for d in depths] + list(CONTROLS)
    result = {"names": names, "lengths": list(lengths), "columns": columns, "value_pool": VALUE_POOL,
              "needle": list(NEEDLE), "examples": written.name, "arms": {},
              "args": dict(models=[list(map(str, a)) for a in arms], texts=str(texts), lengths=list(lengths),
                           depths=list(depths), n=n, seed=seed, batch_tokens=batch_tokens, tokenizer=tokenizer,
                           device=device.type)}
    for name, arm, group in zip(names, arms, groups):
        runs = []
        for path, info in zip(arm, group):  # one model in memory at a time
            model = load_weights(info, device)
            hits = fill_masks(model, examples, batch_tokens, device)
            del model
            cells = {}
            for ex, h in zip(examples, hits):
                cells.setdefault(str(ex["length"]), {}).setdefault(ex["column"], []).append(h)
            runs.append({"model": str(path), "cells": {L: {c: needle_cell(h) for c, h in row.items()}
                                                       for L, row in cells.items()}})
            print(f"{name}: {path} scored in {time.time() - start:.0f} s", flush=True)
        mean = {L: {c: replicates_cell([r["cells"][L][c] for r in runs]) for c in columns} for L in runs[0]["cells"]}
        result["arms"][name] = {"models": list(map(str, arm)), "replicates": runs, "mean": mean}
    result["seconds"] = round(time.time() - start, 2)
    save(out, result)
    from machinery.report import needle_markdown, plot_needle  # rendering: matplotlib only here
    print(needle_markdown(result))
    plot_needle(result, Path(out).with_suffix(".png"))
    return result


