"""The files eval.py reads and writes: fine-tuning task folders (token<TAB>tag and JSONL), held-out texts,
results files of `eval.py finetune`, each seed's saved result and test predictions, keyed by the content hashes
of what they depend on. Everything is checked in full
before any model is loaded, so a typo in a test file does not cost a run. A reader of the recipe may skip
this file."""
import hashlib
import json
import math
import sys
from pathlib import Path

import numpy as np

from machinery.cli import InputError, read_json, save, sha256_file, source_digest, versions

SPLITS = ("train", "dev", "test")


def lines(path):
    """(number, line) of a UTF-8 text file, a byte-order mark dropped (spreadsheet exports write one); invalid
    UTF-8 is an error naming the line."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror})") from None
    with f:
        for number, raw in enumerate(f, 1):
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise InputError(f"{path}:{number}: not valid UTF-8 (byte {e.start}: {e.reason})") from None


def read_tsv(path):
    """Sentences of an IOB2 token<TAB>tag file, a blank line between sentences; spaces around a tag are
    dropped. Each sentence: {"words", "label" (one tag per word), "line" (of its first word)}."""
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
            raise InputError(f"{path}:{number}: expected token<TAB>tag with an IOB2 tag (O, B-type, I-type), "
                             f"got {line!r}")
        first = first if words else number
        words.append(parts[0])
        tags.append(tag)
    return sentences + ([{"words": words, "label": tags, "line": first}] if words else [])


def label_text(label):
    """Labels are names: integer class ids (as many datasets ship them) are read as their decimal strings."""
    is_int = isinstance(label, int) and not isinstance(label, bool)
    return str(label) if is_int else label


def is_text(value):
    """A string the tokenizer can take: a lone surrogate (JSON allows "\\ud800") cannot be encoded."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_jsonl(path, labelled=True):
    """Examples of a JSONL file: {"text", "text_pair" (or None), "label", "line"}; a label is a string or an
    integer (a name), or a list of them (multi-label). Blank lines are skipped."""
    expected = "an object with 'text' (a string)" + (
        ", 'label' (a non-empty string or an integer, or a list of them) and optionally 'text_pair' "
        "(a string)"
        if labelled else "")
    examples = []
    for number, line in lines(path):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as e:
            raise InputError(f"{path}:{number}: not valid JSON ({str(e)[:120]})") from None
        row = row if isinstance(row, dict) else {}
        label = row.get("label")
        label = [label_text(x) for x in label] if isinstance(label, list) else label_text(label)
        ok = is_text(row.get("text")) and (row.get("text_pair") is None or is_text(row["text_pair"]))
        if labelled:  # a label is a non-empty name
            names = label if isinstance(label, list) else [label]
            ok = ok and all(is_text(x) and x for x in names)
        if not ok:
            raise InputError(f"{path}:{number}: expected {expected} (a string must be valid Unicode)")
        examples.append({"text": row["text"], "text_pair": row.get("text_pair"), "label": label, "line": number})
    return examples


def labels_of(example):
    """(label, line) of each label an example carries: one per word of a sentence, or those of a JSONL line."""
    if "words" in example:
        return [(tag, example["line"] + k) for k, tag in enumerate(example["label"])]
    label = example["label"]
    return [(x, example["line"]) for x in (label if isinstance(label, list) else [label])]


def read_task(folder):
    """A task folder, read and checked: {"name", "kind" ("token", "single" or "multi"), "labels" (those of
    train: the classifier's outputs), "scored" (those labels, then any that only dev or test hold), "files",
    "sha256" (per split), "train", "dev", "test"}. Each example gets its "index" in its file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder}: not a folder (a task is a folder with train, dev and test files)")
    found = {ext for ext in (".tsv", ".jsonl") for s in SPLITS if (folder / f"{s}{ext}").is_file()}
    if len(found) != 1:
        raise InputError(f"{folder}: expected train/dev/test.tsv (token classification) or train/dev/test.jsonl "
                         f"(sequence classification), found {'both' if found else 'neither'}")
    ext = found.pop()
    files = {s: folder / f"{s}{ext}" for s in SPLITS}
    for path in files.values():
        if not path.is_file():
            raise InputError(f"{folder}: missing {path.name} (a task needs "
                             f"{', '.join(p.name for p in files.values())})")
    examples = {s: (read_tsv if ext == ".tsv" else read_jsonl)(p) for s, p in files.items()}
    for split, rows in examples.items():
        if not rows:
            raise InputError(f"{files[split]}: no examples")
        for index, ex in enumerate(rows):
            ex["index"] = index
    multi = ext == ".jsonl" and isinstance(examples["train"][0]["label"], list)
    kind = "token" if ext == ".tsv" else "multi" if multi else "single"
    labels, unseen = label_sets(examples, files, multi if ext == ".jsonl" else None)
    if len(labels) < (1 if multi else 2):
        raise InputError(f"{files['train']}: {len(labels)} distinct label(s) {labels}: nothing to learn")
    for label, (where, count) in unseen.items():  # a real test set can hold a rare label that train lacks
        more = f" and {count - 1} more place(s)" if count > 1 else ""
        print(f"warning: label {label!r} occurs in {where}{more} but not in {files['train']}: it is never "
              f"predicted and counts as missed", file=sys.stderr)
    return {"name": folder.name, "kind": kind, "labels": labels, "scored": labels + sorted(unseen),
            "files": {s: str(p) for s, p in files.items()},
            "sha256": {s: sha256_file(p) for s, p in files.items()}, **examples}


def label_sets(examples, files, multi):
    """(train's labels sorted, {label only dev or test hold: (first file:line, count)}). multi: whether every
    JSONL label must be a list (None for token files)."""
    known, unseen = set(), {}
    for split in SPLITS:
        for ex in examples[split]:
            if multi is not None and isinstance(ex["label"], list) != multi:
                raise InputError(f"{files[split]}:{ex['line']}: label {ex['label']!r} mixes single-label and "
                                 f"multi-label examples (the first train example decides)")
            for label, line in labels_of(ex):
                if split == "train":
                    known.add(label)
                elif label not in known:
                    where, count = unseen.get(label, (f"{files[split]}:{line}", 0))
                    unseen[label] = (where, count + 1)
    return sorted(known), unseen


def subset(examples, n):
    """n examples drawn with a fixed seed (the same for every run seed); all when n is None."""
    if n is None or n >= len(examples):
        return examples
    drawn = np.random.default_rng(0).choice(len(examples), n, replace=False)
    return [examples[i] for i in np.sort(drawn)]


def carve_dev(task, dev_min):
    """(train, dev, how): a dev set smaller than dev_min is topped up to dev_min with examples drawn out of
    the task's train split (a fixed draw; they leave it), so that choices and the informative rule rest on
    enough examples. 50 dev examples move a score by 1/50 per example."""
    train, own = task["train"], task["dev"]
    carved = max(0, dev_min - len(own))
    if carved >= len(train):
        raise InputError(f"{task['name']}: --dev_min={dev_min} would move {carved} examples from "
                         f"train to dev, but train holds {len(train)} (at most {len(train) - 1} can "
                         f"move; dev holds {len(own)})")
    drawn = set(np.random.default_rng(0).choice(len(train), carved, replace=False).tolist())
    moved = [{**ex, "from": "train"} for i, ex in enumerate(train) if i in drawn]
    return ([ex for i, ex in enumerate(train) if i not in drawn], own + moved,
            {"own": len(own), "carved_from_train": carved, "dev_min": dev_min})


def split_sizes(examples, dev_split):
    """The examples of each split, as a task's first line says them: "N/N/N examples", and how many dev took
    from the train split where it took some (carve_dev)."""
    sizes = f"{'/'.join(str(len(examples[split])) for split in SPLITS)} examples"
    carved = dev_split["carved_from_train"]
    return sizes + (f" (dev: {dev_split['own']} of its own and {carved} moved from train, --dev_min="
                    f"{dev_split['dev_min']})" if carved else "")


def read_tasks(folders, seeds):
    """The task folders read and checked (read_task), with distinct names, for distinct seeds."""
    tasks = [read_task(t) for t in folders]
    names = [t["name"] for t in tasks]
    if len(set(names)) < len(names):
        raise InputError(f"task folders must have distinct names, got {names}")
    if len(set(seeds)) < len(seeds):
        raise InputError(f"seeds must be distinct (a seed run twice counts twice): {list(seeds)}")
    return tasks


def read_texts(path, n):
    """The texts of a JSONL of held-out texts, refused when fewer than n, or fewer than 3 distinct (CKA of 2 texts
    is 1 whatever the models)."""
    pool = [ex["text"] for ex in read_jsonl(path, labelled=False)]
    if n > len(pool):
        raise InputError(f"{path}: {len(pool)} texts, fewer than the n={n} to draw")
    if n < 3 or len(set(pool)) < 3:
        raise InputError(f"{path}: {len(set(pool))} distinct texts, n={n}; CKA needs at least 3 "
                         f"(of 2 texts it is 1 whatever the models)")
    return pool


def seed_folder(out):
    """OUT.seeds/ beside a results file, created now: a folder that cannot be written is found before training."""
    folder = Path(out).with_suffix(".seeds")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{folder}: cannot create it ({e.strerror or e})") from None
    return folder


def is_number(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def score(entry, metric, split="test"):
    """entry[split][metric] when it is a finite number, else None."""
    scores = entry.get(split) if isinstance(entry, dict) else None
    value = scores.get(metric) if isinstance(scores, dict) else None
    return value if is_number(value) else None


def load_results(path):
    """A results file of `eval.py finetune`, checked: every task names its primary metric, its kind, its majority
    label and the labels it scored, and every seed and the majority baseline have a finite dev and test score on it
    (a NaN would print as a number; a comparison chooses on dev and reads test)."""
    r = read_json(path, "a results file of `eval.py finetune`")
    tasks = r.get("tasks") if isinstance(r, dict) else None
    if not isinstance(tasks, dict) or not tasks:
        raise InputError(f"{path}: not a results file of `eval.py finetune` (no 'tasks' object)")
    for name, t in tasks.items():
        metric = t.get("primary") if isinstance(t, dict) else None
        seeds = t.get("seeds") if isinstance(metric, str) else None
        ok = isinstance(seeds, dict) and seeds and all(score(s, metric, split) is not None for s in
                                                       [*seeds.values(), t.get("baseline")] for split in ("dev", "test"))
        if not ok:
            raise InputError(f"{path}: task {name!r} lacks a finite {metric or 'primary'} test score (or dev score) "
                             f"for every seed and for the baseline")
        lacks = [k for k, ok in (("kind", isinstance(t.get("kind"), str)), ("majority", t.get("majority") is not None),
                                 ("scored", isinstance(t.get("scored"), list))) if not ok]
        if lacks:
            raise InputError(f"{path}: task {name!r} lacks its {', '.join(lacks)} (written by an older eval.py?); "
                             f"run its `eval.py finetune` again")
    return r


def cached_seed(seed_dir, task, inputs, seed, compute):
    """A (task, seed) result of `eval.py finetune`: read from its file in seed_dir when an earlier call computed it
    from the same inputs (settings, the model's weights, the task files' contents), the same code (every script
    and machinery module: cli.source_digest) and the same packages (cli.versions), else compute() -> (result,
    {"dev": rows, "test": rows}), written at once. Returned with "predictions": that file, relative to the results
    file's folder (a comparison recomputes the metrics from its predictions)."""
    key = {**inputs, "seed": seed, "code": source_digest(), "versions": versions()}
    fingerprint = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    path = seed_dir / f"{task['name']}-seed{seed}-{fingerprint[:12]}.json"
    if path.is_file():
        saved = read_json(path, "a fine-tuning result of `eval.py finetune`")
        ok = isinstance(saved, dict) and saved.get("fingerprint") == fingerprint
        result = saved.get("result") if ok else None
        if not scores_ok(result):
            raise InputError(f"{path}: not a result this command wrote; delete it")
        print(f"  seed {seed}: skip, done in {path} (same settings, model, task files, code and packages)")
    else:
        result, predictions = compute()
        save(path, {"fingerprint": fingerprint, "inputs": key, "result": result, "predictions": predictions})
    return {**result, "predictions": f"{seed_dir.name}/{path.name}"}


def scores_ok(result):
    """Whether a seed's result holds dev and test scores that are all finite numbers."""
    return isinstance(result, dict) and all(
        isinstance(result.get(split), dict) and result[split]
        and all(is_number(v) for v in result[split].values()) for split in ("dev", "test"))


def read_predictions(results_path, task, seed, split="test"):
    """(gold, predictions) of one seed's dev or test split, read from the file its result names, in the order the
    examples were scored."""
    name = task["seeds"][seed].get("predictions")
    path = results_path.parent / str(name)
    if not name or not path.is_file():
        raise InputError(f"{results_path}: seed {seed} of {task['task']} names no predictions file "
                         f"that exists ({name}); run its `eval.py finetune` again")
    saved = read_json(path, "a fine-tuning result of `eval.py finetune`")
    saved = saved.get("predictions") if isinstance(saved, dict) else None
    rows = saved.get(split) if isinstance(saved, dict) else None
    if not isinstance(rows, list) or not rows:
        raise InputError(f"{path}: no {split} predictions in it (written by an older eval.py?); run its "
                         f"`eval.py finetune` again")
    if not all(isinstance(row, dict) and "gold" in row and type(row.get("pred")) is type(row["gold"]) for row in rows):
        raise InputError(f"{path}: its {split} predictions are not rows of a gold label and a prediction of its kind; "
                         f"run its `eval.py finetune` again")
    return [row["gold"] for row in rows], [row["pred"] for row in rows]
