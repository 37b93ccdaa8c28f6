"""eval.py's bad input, table-driven: every case ends in exit code 2 and one line `error: ...` naming the flag or
file, before any model is loaded; and the task-file quirks real datasets have (BOM, trailing spaces, integer
labels, a label only in test, words cut by --max_len)."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import BYTE_IDS, ROOT

import eval as ev
from data import load_tokenizer
from test_eval import make_model, multilabel_task, write


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    model = make_model(root / "model", 0, **BYTE_IDS)
    garbage = make_model(root / "garbage", 0, **BYTE_IDS)
    (garbage / "state.json").write_text("{not json")
    write(root / "texts.jsonl", '{"text": "a b c"}\n' * 4)
    (root / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    write(root / "results.json", "[]")
    return {"root": root, "model": str(model), "garbage": str(garbage), "texts": str(root / "texts.jsonl"),
            "task": str(multilabel_task(root / "animals")), "missing": str(root / "no-such-run")}


CASES = [  # (argv with {placeholders}, what the one error line must say)
    ("cka {model} {model} --texts={texts} --n=0", "--n must be >= 1, got 0"),
    ("cka {model} {model} --texts={texts} --n=-3", "--n must be >= 1, got -3"),
    ("cka {model} {model} --texts={texts} --n=x", "argument --n: invalid int value: 'x'"),
    ("cka {model} {model} --texts={texts} --max_len=1", "--max_len must be >= 4"),
    ("cka {model} {model} --texts={texts} --batch_size=0", "--batch_size must be >= 1, got 0"),
    ("cka {model} {model} --texts={texts} --names=MLM", "--names must be two names"),
    ("cka {model} {model} --texts={root}/none.jsonl", "none.jsonl: no such file"),
    ("cka {model} {model} --texts={root}/latin1.jsonl --n=1", "latin1.jsonl:2: not valid UTF-8"),
    ("cka {model} {missing} --texts={texts}", "no-such-run: not a model directory"),
    ("cka {model} {model} --control={garbage} --texts={texts}", "garbage/state.json: not a readable JSON file"),
    ("finetune {model} --task={task} --epochs=0", "--epochs must be >= 1, got 0"),
    ("finetune {model} --task={task} --max_len=0", "--max_len must be >= 4"),
    ("finetune {model} --task={task} --max_len=1", "--max_len must be >= 4"),
    ("finetune {model} --task={task} --batch_size=0", "--batch_size must be >= 1, got 0"),
    ("finetune {model} --task={task} --train_subset=0", "--train_subset must be >= 1, got 0"),
    ("finetune {model} --task={task} --lr=0", "--lr must be a positive number"),
    ("finetune {model} --task={task} --seeds=", "argument --seeds: invalid seed_list value"),
    ("finetune {missing} --task={task}", "no-such-run: not a model directory"),
    ("finetune {garbage} --task={task}", "garbage/state.json: not a readable JSON file"),
    ("mlm {model} --data={root} --batch_size=0", "--batch_size must be >= 1, got 0"),
    ("mlm {model} --data={root} --seq_len=0", "--seq_len must be >= 1, got 0"),
    ("mlm {missing} --data={root}", "no-such-run: not a model directory"),
    ("mlm {model} --data={root}", "meta.json: not found"),
    ("table {root}/results.json", "results.json: expected a JSON object"),
    ("table {root}/texts.jsonl", "texts.jsonl: not a readable JSON file"),
    ("table {root}/results.json {root}/results.json {root}/results.json --paired", "--paired compares two"),
]


@pytest.mark.parametrize("argv, expected", CASES, ids=[c[0].split(" --")[-1] for c in CASES])
def test_bad_input_is_one_line_and_exit_2(inputs, argv, expected, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr(ev.ModernBERT, "from_pretrained", no_loading)
    with pytest.raises(SystemExit) as exit:
        ev.main(argv.format(**inputs).split(" ") + (["--device=cpu"] if argv.startswith(("cka", "finetune", "mlm")) else []))
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and expected in err, err


def test_bad_input_from_the_shell_has_no_traceback(inputs):
    run = subprocess.run([sys.executable, str(ROOT / "eval.py"), "finetune", inputs["model"], f"--task={inputs['task']}",
                          "--epochs=0"], capture_output=True, text=True)
    assert run.returncode == 2 and run.stderr == "error: --epochs must be >= 1, got 0\n"
    fresh = subprocess.run([sys.executable, "-c", "import os, torch; "  # torch's default in a new process
                            "print(min(torch.get_num_threads(), len(os.sched_getaffinity(0))))"],
                           capture_output=True, text=True).stdout.strip()
    assert run.stdout == f"threads: {fresh} intra-op (--threads to change)\n"


def test_threads(monkeypatch, capsys):
    monkeypatch.setattr(ev.os, "sched_getaffinity", lambda pid: {0})
    assert ev.default_threads() == 1
    monkeypatch.setattr(ev.os, "sched_getaffinity", lambda pid: set(range(4096)))
    assert ev.default_threads() == torch.get_num_threads()
    with pytest.raises(SystemExit) as exit:
        ev.main(["mlm", "model", "--data=data", "--threads=0"])
    assert exit.value.code == 2 and capsys.readouterr().err == "error: argument --threads: expected at least 1, got 0 (see eval.py mlm --help)\n"


def test_bom_and_trailing_spaces_are_dropped(tmp_path):
    bom = "\ufeff"
    for split in ("train", "dev", "test"):
        write(tmp_path / "tsv" / f"{split}.tsv", bom + "Aspirin\tO \ncures\tO\npain\tB-D  \n")
        write(tmp_path / "jsonl" / f"{split}.jsonl", bom + '{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n')
    tsv = ev.read_task(tmp_path / "tsv")
    assert tsv["train"][0]["words"] == ["Aspirin", "cures", "pain"] and tsv["labels"] == ["B-D", "O"]
    assert ev.read_task(tmp_path / "jsonl")["labels"] == ["x", "y"]


def test_integer_labels_are_read_as_their_names(tmp_path):
    for split in ("train", "dev", "test"):
        write(tmp_path / "ints" / f"{split}.jsonl", '{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n')
        write(tmp_path / "multi" / f"{split}.jsonl", '{"text": "a", "label": [0, 2]}\n{"text": "b", "label": []}\n')
    assert ev.read_task(tmp_path / "ints")["labels"] == ["0", "1"]
    assert ev.read_task(tmp_path / "multi")["labels"] == ["0", "2"]
    write(tmp_path / "ints" / "dev.jsonl", '{"text": "a", "label": 0.5}\n')
    with pytest.raises(ev.DataError, match=r"ints/dev.jsonl:1: expected an object with 'text' .* 'label' \(a string "
                                           r"or an integer"):
        ev.read_task(tmp_path / "ints")


def test_a_label_only_in_test_is_scored_as_never_predicted(inputs, tmp_path, capsys):
    """The run goes on and its macro-F1 is scikit-learn's over the gold and predicted labels of the seed file."""
    from sklearn.metrics import f1_score
    rows = {"train": ["x", "y"] * 8, "dev": ["x", "y"] * 2, "test": ["x", "y", "z", "z"]}
    for split, labels in rows.items():
        write(tmp_path / "rare" / f"{split}.jsonl", "".join(json.dumps({"text": f"{label} {i}", "label": label}) + "\n"
                                                          for i, label in enumerate(labels)))
    r = ev.finetune(inputs["model"], [tmp_path / "rare"], seeds=(1,), out=tmp_path / "r.json", epochs=1, max_len=16,
                    device="cpu")["tasks"]["rare"]
    assert "rare/test.jsonl:3: label 'z' does not occur" in capsys.readouterr().err
    predictions = json.loads((tmp_path / "r.seeds" / "rare-seed1.json").read_text())["predictions"]
    assert "z" not in predictions and r["labels"] == ["x", "y"]
    assert r["seeds"]["1"]["test"]["macro_f1"] == pytest.approx(f1_score(rows["test"], predictions, average="macro",
                                                                          zero_division=0), abs=1e-12)


def test_words_cut_by_max_len_are_counted():
    tok, token = load_tokenizer("bytes"), ev.TokenClassification()
    rng = np.random.default_rng(0)
    sentences = [{"words": ["w" * int(n) for n in rng.integers(1, 6, size=rng.integers(1, 8))]} for _ in range(20)]
    for ex in sentences:
        ex["label"] = ["O"] * len(ex["words"])
    encoded = token.encode(["O"], sentences, tok, max_len=12)
    cut = []
    for ex in sentences:  # the definition: bytes of each word (with its leading space) until [SEP] would not fit
        used, kept = 1, 0
        for i, word in enumerate(ex["words"]):
            used += len(word) + (i > 0)
            if used > 11:
                break
            kept += 1
        cut.append(len(ex["words"]) - kept)
    assert sum(cut) > 0
    expected = f"cuts {sum(cut)} words in {sum(c > 0 for c in cut)} of 20 sentences"
    assert expected in token.truncation(sentences, encoded, 12)
