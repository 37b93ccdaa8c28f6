"""eval.py's bad input, table-driven: every case ends in exit code 2 and one line `error: ...` naming the flag or
file, before any model is loaded where it can be; models and results that are not finite are refused; a full disk
is one line; and the task-file quirks real datasets have (BOM, trailing spaces, integer labels, a label only in
dev or test, words cut by --max_len)."""
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import BYTE_IDS, ROOT

import eval as ev
from data import load_tokenizer, prepare
from machinery.cli import InputError, run
from machinery.tasks import read_task
from test_eval import make_model, multilabel_task, write

RESULT = {"primary": "macro_f1", "seeds": {"1": {"test": {"macro_f1": 0.5}}}, "baseline": {"test": {"macro_f1": 0.1}}}


def jsonl_task(folder, rows):
    """A JSONL task folder: rows = {split: [(text, label), ...]}."""
    for split, examples in rows.items():
        write(folder / f"{split}.jsonl", "".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in examples))
    return folder


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    model = make_model(root / "model", 0, **BYTE_IDS)
    shutil.copytree(model, root / "copy")  # the same weights in another folder
    make_model(root / "other", 1, **BYTE_IDS)
    garbage = make_model(root / "garbage", 0, **BYTE_IDS)
    (garbage / "config.json").write_text("{not json")
    (make_model(root / "noweights", 0, **BYTE_IDS) / "model.safetensors").unlink()
    make_model(root / "mismatch", 0)  # ModernBERT's special ids, the byte tokenizer's files
    write(root / "texts.jsonl", "".join(f'{{"text": "a b c {w}"}}\n' for w in "defg"))
    shutil.copy(model / "tokenizer.json", root / "tok.json")  # a tokenizer outside the model folders
    shutil.copy(root / "texts.jsonl", root / "held.examples.jsonl")  # held-out texts named as needle's examples
    (root / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    write(root / "surrogate.jsonl", '{"text": "ok"}\n{"text": "lone \\ud800 half"}\n')
    write(root / "results.json", "[]")
    nan = {"1": {"test": {"macro_f1": float("nan")}}}  # json writes NaN, which Python's json reads back
    write(root / "nan.json", json.dumps({"tasks": {"t": {**RESULT, "seeds": nan}}}))
    write(root / "noseeds.json", json.dumps({"tasks": {"t": {**RESULT, "seeds": {}}}}))
    write(root / "ok.json", json.dumps({"tasks": {"t": RESULT}}))
    write(root / "run" / "log.jsonl", json.dumps({"phase": "mlm", "step": 1, "tokens": 64, "loss": 5.0}) + "\n")
    good = [("a b", "x"), ("c d", "y")]
    tasks = {"surrogate": {"train": good, "dev": good, "test": good + [("\ud800", "x")]},
             "onelabel": {"train": [("a", "x"), ("b", "x")], "dev": good, "test": good},
             "emptylabel": {"train": good + [("e", "")], "dev": good, "test": good},
             "mixed": {"train": good, "dev": good + [("e", ["x"])], "test": good}}
    for name, rows in tasks.items():
        jsonl_task(root / name, rows)
    jsonl_task(root / "deep", {"train": good, "dev": good, "test": good})
    write(root / "deep" / "dev.jsonl", "[" * 100_000 + "]" * 100_000 + "\n")
    return {"root": root, "model": str(model), "garbage": str(garbage), "texts": str(root / "texts.jsonl"),
            "task": str(multilabel_task(root / "animals")), "missing": str(root / "no-such-run")}


NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: --device=cuda is fine here")

CASES = [  # (argv with {placeholders}, what the one error line must say)
    ("cka {model} {model} --texts={texts} --n=0", "argument --n: expected at least 1, got 0"),
    ("cka {model} {model} --texts={texts} --n=-3", "argument --n: expected at least 1, got -3"),
    ("cka {model} {model} --texts={texts} --n=x", "argument --n: expected an integer, got 'x'"),
    ("cka {model} {model} --texts={texts} --max_len=1", "--max_len: expected at least 4"),
    ("cka {model} {model} --texts={texts} --batch_size=0", "--batch_size: expected at least 1, got 0"),
    ("cka {model} {model} --texts={texts} --names=MLM", "--names: expected 2 distinct non-empty names"),
    ("cka {model} {model} --texts={root}/none.jsonl", "none.jsonl: cannot read it (No such file"),
    ("cka {model} {model} --texts={root}/latin1.jsonl --n=3", "latin1.jsonl:2: not valid UTF-8"),
    ("cka {model} {missing} --texts={texts}", "no-such-run: no such model directory"),
    ("cka {model} {model} --control={garbage} --texts={texts}", "garbage/config.json: not valid JSON"),
    ("finetune {model} --task={task} --epochs=0", "--epochs: expected at least 1, got 0"),
    ("finetune {model} --task={task} --max_len=0", "--max_len: expected at least 1"),
    ("finetune {model} --task={task} --max_len=1", "--max_len: expected at least 4"),
    ("finetune {model} --task={task} --batch_size=0", "--batch_size: expected at least 1, got 0"),
    ("finetune {model} --task={task} --train_subset=0", "--train_subset: expected at least 1, got 0"),
    ("finetune {model} --task={task} --lr=0", "--lr: expected a finite number above 0"),
    ("finetune {model} --task={task} --seeds=", "--seeds: expected integers separated by commas"),
    ("finetune {missing} --task={task}", "no-such-run: no such model directory"),
    ("finetune {garbage} --task={task}", "garbage/config.json: not valid JSON"),
    ("mlm {model} --data={root} --batch_size=0", "--batch_size: expected at least 1, got 0"),
    ("mlm {model} --data={root} --seq_len=0", "--seq_len: expected at least 1, got 0"),
    ("mlm {missing} --data={root}", "no-such-run: no such model directory"),
    ("mlm {model} --data={root}", "inputs0/meta.json: "),
    ("table {root}/results.json", "results.json: not a results file of `eval.py finetune`"),
    ("table {root}/texts.jsonl", "texts.jsonl: not valid JSON"),
    # a device that is not here, a hub that cannot be reached, a seed twice, a control that is a compared model
    pytest.param("finetune {model} --task={task} --device=cuda", "--device=cuda: CUDA is not available", marks=NO_CUDA),
    ("finetune {model} --task={task} --device=foo", "--device='foo': expected auto, cpu, cuda or cuda:N"),
    ("finetune nobody-here/no-such-model --task={task}", "could not fetch 'nobody-here/no-such-model'"),
    ("finetune {model} --task={task} --seeds=42,42", "--seeds: 42,42 repeats a seed"),
    ("cka {model} {root}/other --control={root}/other --texts={texts}", "other has the same folder as"),
    ("cka {model} {root}/mismatch --control={root}/copy --texts={texts}", "copy has the same weights as"),
    # new bad input
    pytest.param("cka {model} {model} --texts={texts} --device=cuda:3", "CUDA is not available", marks=NO_CUDA),
    ("cka {model} {model} --texts={texts} --device=mps", "--device=mps: expected auto, cpu, cuda or cuda:N"),
    ("cka {model} {model} --texts={texts} --seeds=1,x", "--seeds: expected integers separated by commas"),
    ("cka {model} {model} --texts={texts} --seeds=-1", "--seeds: expected seeds in [0, 2**32), got -1"),
    ("cka {model} {model} --texts={texts} --seeds=4294967296", "--seeds: expected seeds in [0, 2**32)"),
    ("cka {model} {model} --texts={texts} --names=A,A", "--names: expected 2 distinct non-empty names"),
    ("cka {model} {model} --texts={texts} --names=,B", "--names: expected 2 distinct non-empty names"),
    ("cka {model} {model} --texts={texts} --n=1 --n=3", "--n is given twice"),
    ("cka {model} {model} --texts={root}/surrogate.jsonl", "surrogate.jsonl:2: expected an object with 'text'"),
    ("cka {model} {root}/mismatch --control={root}/other --control={root}/other --texts={texts}", "same folder"),
    ("cka {model} {root}/noweights --texts={texts}", "noweights: no model.safetensors there"),
    ("cka {model} {root}/mismatch --texts={texts}", "(256, 257, 258, 259), vocab 260) does not fit the model"),
    ("cka {model} {model} --texts={texts} --tokenizer={root}/none.json", "none.json"),
    ("finetune {model} --task={task} --lr=nan", "--lr: expected a finite number above 0, got 'nan'"),
    ("finetune {model} --task={task} --lr=inf", "--lr: expected a finite number above 0, got 'inf'"),
    ("finetune {model} --task={task} --lr=-1e-5", "--lr: expected a finite number above 0"),
    ("finetune {model} --task={task} --epochs=1.5", "--epochs: expected an integer, got '1.5'"),
    ("finetune {model} --task={task} --threads=0", "--threads: expected at least 1, got 0"),
    ("finetune {model} --task={task} --pooling=max", "--pooling: invalid choice: 'max'"),
    ("finetune {model} --task={root}/no-such-task", "no-such-task: not a folder"),
    ("finetune {model} --task={texts}", "texts.jsonl: not a folder"),
    ("finetune {model} --task={task} --task={task}", "task folders must have distinct names"),
    ("finetune {model} --task={root}/surrogate", "surrogate/test.jsonl:3: expected an object with 'text'"),
    ("finetune {model} --task={root}/deep", "deep/dev.jsonl:1: not valid JSON"),
    ("finetune {model} --task={root}/onelabel", "train.jsonl: 1 distinct label(s) ['x']: nothing to learn"),
    ("finetune {model} --task={root}/emptylabel", "emptylabel/train.jsonl:3: expected an object"),
    ("finetune {model} --task={root}/mixed", "mixed/dev.jsonl:3: label ['x'] mixes single-label and multi"),
    ("finetune {model} --task={task} --out={texts}/r.json", "cannot make its folder"),
    ("table {root}/ok.json {root}/ok.json", "a results file is given twice"),
    ("table {root}/nan.json", "task 't' lacks a finite macro_f1 test score"),
    ("table {root}/noseeds.json", "task 't' lacks a finite macro_f1 test score"),
    ("curves {root} --out={root}/c.png", "no log.jsonl (not a train.py run directory)"),
    ("curves {root}/run {root}/run --out={root}/c.png --names=a", "--names gives 1 names for 2 runs"),
    ("curves {root}/run --out={root}/c.png --names=a,a", "--names: expected some distinct non-empty names"),
    ("curves {root}/run {root}/run", "--out: several runs are drawn into one picture"),
    ("finetune {model} --task={task} --sedes=1", "unrecognized arguments: --sedes=1; did you mean --seeds or --steps?"),
    ("cka {model} {model} --textz={texts}", "unrecognized arguments: --textz={texts}; did you mean --texts?"),
    # an --out that is an input, a folder, or the file the command writes beside it: refused before any model loads
    ("cka {model} {root}/other --texts={texts} --out={texts}", "it would overwrite " + "{texts}, which this command"),
    ("cka {model} {root}/other --texts={texts} --out={root}/other/model.safetensors", "other/model.safetensors, which"),
    ("cka {model} {root}/other --texts={texts} --out={root}/cka.png", "also writes {root}/cka.png beside it, the same"),
    ("needle {model} --texts={texts} --out={texts}", "it would overwrite {texts}, which this command reads"),
    ("needle {model} --texts={root}/held.examples.jsonl --out={root}/held.json",
     "{root}/held.examples.jsonl, written beside it, would overwrite {root}/held.examples.jsonl"),
    ("finetune {model} --task={task} --out={task}/dev.jsonl", "it would overwrite {task}/dev.jsonl"),
    ("finetune {model} --task={task} --out={root}", "--out={root}: it is a folder"),
    ("curves {root}/run --out={root}", "--out={root}: it is a folder; --out names a file to write"),
    ("curves {root}/run --out={root}/run/log.jsonl", "it would overwrite {root}/run/log.jsonl, which this command"),
    # an --out that names a file of a model (read or not) or the tokenizer a command reads
    ("finetune {model} --task={task} --out={model}/config.json", "would overwrite {model}/config.json, which this"),
    ("finetune {model} --task={task} --out={model}/tokenizer_config.json", "{model}/tokenizer_config.json, which"),
    ("finetune {model} --task={task} --tokenizer={root}/tok.json --out={root}/tok.json",
     "it would overwrite {root}/tok.json, which this command reads"),
    ("finetune {model} --task={task} --out={root}/other/config.json", "{root}/other/config.json, a file of the model "
                                                                       "in {root}/other; choose another --out"),
    ("cka {model} {root}/other --texts={texts} --tokenizer={root}/tok.json --out={root}/tok.json",
     "it would overwrite {root}/tok.json, which this command reads"),
    ("cka {model} {root}/other --texts={texts} --out={root}/copy/special_tokens_map.json", "a file of the model in"),
    ("needle {model} --texts={texts} --tokenizer={root}/tok.json --out={root}/tok.json",
     "it would overwrite {root}/tok.json, which this command reads"),
    ("curves {root}/run --out={root}/other/model.safetensors", "{root}/other/model.safetensors, a file of the model"),
]


def case_id(case):
    argv, expected = case.values if hasattr(case, "values") else case
    return f"{argv.split()[0]}: {expected[:40]}"


def run_main(argv, inputs):
    """eval.py's command line in this process: (exit code, stdout, stderr)."""
    argv = argv.format(**inputs).split(" ")
    if argv[0] in ("cka", "finetune", "mlm") and not any(a.startswith("--device") for a in argv):
        argv.append("--device=cpu")
    if argv[0] == "cka" and not any(a.startswith("--n=") for a in argv):
        argv.append("--n=3")  # the texts file holds 4
    with pytest.raises(SystemExit) as exit:
        run(ev.main, argv)
    return exit.value.code


@pytest.mark.parametrize("argv, expected", CASES, ids=[case_id(c) for c in CASES])
def test_bad_input_is_one_line_and_exit_2(inputs, argv, expected, capsys, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the input was checked")
    monkeypatch.setattr(ev, "load_weights", no_loading)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code = run_main(argv, inputs)
    err = capsys.readouterr().err
    expected = expected.format(**inputs)
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and expected in err, err


@pytest.fixture(scope="module")
def nan_model(inputs):
    """A model one of whose weights is NaN (a diverged run), and a prepared corpus for `mlm`."""
    path = make_model(inputs["root"] / "nan", 0, **BYTE_IDS)
    from safetensors.torch import load_file, save_file
    state = load_file(path / "model.safetensors")
    state["model.layers.1.mlp.Wo.weight"][3, 5] = float("nan")
    save_file(state, path / "model.safetensors")
    prepare([inputs["texts"]], "bytes", inputs["root"] / "data", val_fraction=0.5)
    return path


REFUSED_AFTER_LOADING = [  # a model or a run that loads and then cannot be trusted
    ("finetune {nan} --task={task}", "nan/model.safetensors: weight model.layers.1.mlp.Wo.weight holds NaN or inf"),
    ("cka {model} {nan} --texts={texts} --n=3", "nan/model.safetensors: weight model.layers.1.mlp.Wo.weight holds"),
    ("mlm {nan} --data={root}/data --seq_len=8 --n_sequences=1", "nan/model.safetensors: weight model.layers.1.mlp"),
    ("finetune {model} --task={task} --lr=1e30 --epochs=1 --max_len=16 --seeds=1 --out={root}/div.json",
     "the fine-tuning diverged: try a lower --lr than 1e+30"),
    ("finetune {root}/badweights --task={task}", "model.safetensors: not a readable safetensors file"),
]


@pytest.mark.parametrize("argv, expected", REFUSED_AFTER_LOADING, ids=[case_id(c) for c in REFUSED_AFTER_LOADING])
def test_models_and_scores_that_are_not_finite_are_refused(inputs, nan_model, argv, expected, capsys, tmp_path,
                                                           monkeypatch):
    bad = make_model(inputs["root"] / "badweights", 0, **BYTE_IDS)
    (bad / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage")
    monkeypatch.chdir(tmp_path)  # where a finetune without --out writes results.json and results.seeds/
    code = run_main(argv, {**inputs, "nan": str(nan_model)})
    assert not (tmp_path / "results.seeds").exists()  # weights refused: no folder made for seeds never trained
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and expected in err, err
    assert not (inputs["root"] / "div.json").exists()  # no score of a diverged run is written


def test_a_full_disk_during_finetune_is_one_line(inputs, small_disk, capsys):
    """The disk fills between two calls: the second says so in one line and leaves the first's files as they
    were, with no temporary file behind."""
    folder = small_disk("1m")  # a real 1 MiB filesystem
    argv = f"finetune {{model}} --task={{task}} --epochs=1 --max_len=16 --seeds=1 --out={folder}/r.json"
    run(ev.main, argv.format(**inputs).split(" ") + ["--device=cpu"])
    before = {f.name: f.read_bytes() for f in [folder / "r.json", *(folder / "r.seeds").iterdir()]}
    with open(folder / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
        for _ in range(1 << 10):  # until the disk is full
            f.write(b"\0" * (1 << 16))
    capsys.readouterr()
    assert run_main(argv + " --lr=1e-4", inputs) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "No space left on device" in err, err
    after = {f.name: f.read_bytes() for f in [folder / "r.json", *(folder / "r.seeds").iterdir()]}
    assert after == before and not [f for f in folder.rglob("*") if ".tmp" in f.name]


def test_bad_input_from_the_shell_has_no_traceback(inputs):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    shell = subprocess.run([sys.executable, str(ROOT / "eval.py"), "finetune", inputs["model"],
                            f"--task={inputs['task']}", "--epochs=0"], capture_output=True, text=True, env=env)
    assert shell.returncode == 2 and shell.stdout == ""
    assert shell.stderr == "error: eval.py finetune: argument --epochs: expected at least 1, got 0 (see eval.py " \
                           "finetune --help)\n"
    shell = subprocess.run([sys.executable, str(ROOT / "eval.py"), "finetune", inputs["model"],
                            f"--task={inputs['root'] / 'onelabel'}"], capture_output=True, text=True, env=env)
    assert shell.returncode == 2 and shell.stdout == "threads: 1 intra-op (--threads to change)\n"
    assert shell.stderr.startswith("error: ") and shell.stderr.count("\n") == 1


def test_every_flag_has_a_meaning_and_its_functions_default_in_help():
    """A flag left out takes the function's own default (one place to change it), and --help shows that one."""
    import inspect

    from machinery import compare, needle
    from machinery.evalcli import parser
    commands = next(a for a in parser(ev, needle)._actions if a.dest == "command").choices
    assert set(commands) == {"cka", "finetune", "table", "mlm", "curves", "needle"}
    functions = {"table": compare.table, "needle": needle.needle}
    for name, sub in commands.items():
        text = " ".join(sub.format_help().split())  # argparse wraps lines
        function = functions.get(name) or getattr(ev, name)
        defaults = {k: p.default for k, p in inspect.signature(function).parameters.items()}
        for action in sub._actions:
            assert action.help and len(action.help) > 10, (name, action.dest)
            default = defaults.get(action.dest)
            if action.option_strings and action.dest != "help" and default not in (None, False, (), [], inspect._empty):
                shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
                assert f"(default: {shown})" in text, (name, action.dest)  # None, off, none: the meaning says
    args = vars(parser(ev, needle).parse_args(["finetune", "m", "--task=t"]))  # left out: absent, the function decides
    assert set(args) == {"command", "model", "tasks", "threads"}
    finetune = " ".join(commands["finetune"].format_help().split())
    assert "--lr LR AdamW peak learning rate (default: 5e-05)" in finetune
    assert "--seeds SEEDS fine-tuning seeds" in finetune and "--max_len MAX_LEN tokens per text" in finetune


def test_the_flags_checked_before_torch_are_the_flags_of_the_command():
    """eval.py checks its flags before it imports torch, with a parser built over sketches of eval.py and
    machinery/needle.py (their functions' signatures and docstrings, read from the source): every sub-command has
    the same flags, types, choices, requirements and help as the parser over the modules themselves."""
    from machinery import evalcli, needle

    def described(p):
        commands = next(a for a in p._actions if a.dest == "command").choices
        return {name: (sub.format_help(), [(a.dest, a.option_strings, getattr(a.type, "__qualname__", a.type),
                                            a.choices and list(a.choices), a.required, a.nargs)  # choices: the keys
                                           for a in sub._actions]) for name, sub in commands.items()}
    sketched = evalcli.parser(evalcli.sketch(ROOT / "eval.py"), evalcli.sketch(ROOT / "machinery" / "needle.py"))
    assert described(sketched) == described(evalcli.parser(ev, needle))


def test_a_mistyped_flag_is_answered_before_torch_is_imported(tmp_path):
    """A torch that cannot be imported does not stand in the way of a flag's error (nor of the suggestion); right
    flags and --help go on to the import."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise SystemExit('torch was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for argv, status, said in ((["finetune", "m", "--task=t", "--sedes=1"], 2, "error: eval.py: unrecognized "
                                "arguments: --sedes=1; did you mean --seeds or --steps? (see eval.py --help)"),
                               (["cka", "a"], 2, "error: eval.py cka: the following arguments are required: model_b, "
                                "--texts (see eval.py cka --help)"),
                               (["mlm", "m", "--data=d"], 1, "torch was imported"),
                               (["mlm", "--help"], 1, "torch was imported")):
        result = subprocess.run([sys.executable, str(ROOT / "eval.py"), *argv], capture_output=True, text=True,
                                env=env, cwd=tmp_path)
        assert (result.returncode, result.stderr.strip()) == (status, said), result


def test_threads(monkeypatch, capsys):
    with pytest.raises(SystemExit) as exit:
        run(ev.main, ["mlm", "model", "--data=data", "--threads=0"])
    assert exit.value.code == 2
    assert capsys.readouterr().err == ("error: eval.py mlm: argument --threads: expected at least 1, got 0 "
                                       "(see eval.py mlm --help)\n")


def test_curves_draws_several_runs(inputs, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curves.png"
    shutil.copytree(inputs["root"] / "run", tmp_path / "run2")
    run(ev.main, ["curves", str(inputs["root"] / "run"), str(tmp_path / "run2"), f"--out={out}", "--names=a,b"])
    assert out.stat().st_size > 1000


# ----------------------------------------------------------------------------
# Task files as real datasets ship them


def test_bom_and_trailing_spaces_are_dropped(tmp_path):
    bom = "\ufeff"
    for split in ("train", "dev", "test"):
        write(tmp_path / "tsv" / f"{split}.tsv", bom + "Aspirin\tO \ncures\tO\npain\tB-D  \n")
        write(tmp_path / "jsonl" / f"{split}.jsonl", bom + '{"text": "a", "label": "x"}\n{"text": "b", "label": "y"}\n')
    tsv = read_task(tmp_path / "tsv")
    assert tsv["train"][0]["words"] == ["Aspirin", "cures", "pain"] and tsv["labels"] == ["B-D", "O"]
    assert read_task(tmp_path / "jsonl")["labels"] == ["x", "y"]


def test_integer_labels_are_read_as_their_names(tmp_path):
    for split in ("train", "dev", "test"):
        write(tmp_path / "ints" / f"{split}.jsonl", '{"text": "a", "label": 0}\n{"text": "b", "label": 1}\n')
        write(tmp_path / "multi" / f"{split}.jsonl", '{"text": "a", "label": [0, 2]}\n{"text": "b", "label": []}\n')
    assert read_task(tmp_path / "ints")["labels"] == ["0", "1"]
    assert read_task(tmp_path / "multi")["labels"] == ["0", "2"]
    write(tmp_path / "ints" / "dev.jsonl", '{"text": "a", "label": 0.5}\n')
    with pytest.raises(InputError, match=r"ints/dev.jsonl:1: expected an object with 'text' .* 'label' \(a non-empty "
                                         r"string or an integer"):
        read_task(tmp_path / "ints")


def unseen_label_tasks(root):
    """One task per kind whose test split holds a label that train lacks (and dev another, twice)."""
    words = {"x": "cat", "y": "dog", "z": "owl", "w": "bee"}
    single = {"train": [(f"{words[y]} {i}", y) for i, y in enumerate("xy" * 8)],
              "dev": [("cat", "x"), ("bee", "w"), ("bee", "w")], "test": [("cat", "x"), ("dog", "y"), ("owl", "z")]}
    jsonl_task(root / "single", single)
    multi = {split: [(t, [y] if y != "y" else []) for t, y in rows] for split, rows in single.items()}
    jsonl_task(root / "multi", multi)
    sentence = lambda tags: "".join(f"w{i}\t{tag}\n" for i, tag in enumerate(tags)) + "\n"
    write(root / "token" / "train.tsv", sentence(["O", "B-D", "I-D", "O"]) * 8)
    write(root / "token" / "dev.tsv", sentence(["O", "B-W", "O"]) + sentence(["B-W", "O"]))
    write(root / "token" / "test.tsv", sentence(["O", "B-D", "I-D"]) + sentence(["B-Z", "O"]))
    return {"single": ("w", "z"), "multi": ("w", "z"), "token": ("B-W", "B-Z")}


@pytest.mark.parametrize("kind", ["single", "multi", "token"])
def test_every_kind_warns_once_and_scores_a_label_train_lacks(inputs, tmp_path, capsys, kind):
    """The run goes on; each label train lacks is one warning; the scores are scikit-learn's and seqeval's over
    the gold labels and the predictions of the seed file, the unseen label among the classes."""
    from seqeval.metrics import f1_score as entity_f1
    from sklearn.metrics import f1_score
    from sklearn.preprocessing import MultiLabelBinarizer
    unseen = unseen_label_tasks(tmp_path)[kind]
    r = ev.finetune(inputs["model"], [tmp_path / kind], seeds=(1,), out=tmp_path / "r.json", epochs=1, max_len=16,
                    device="cpu")["tasks"][kind]
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2 and all(f"label {label!r} occurs in" in w for label, w in zip(unseen, warnings))
    assert "and 1 more place(s)" in warnings[0] and r["kind"] == kind
    saved, = (tmp_path / "r.seeds").glob(f"{kind}-seed1-*.json")
    predictions = json.loads(saved.read_text())["predictions"]["test"]
    gold, pred = [p["gold"] for p in predictions], [p["pred"] for p in predictions]
    test = r["seeds"]["1"]["test"]
    if kind == "multi":
        binary = MultiLabelBinarizer(classes=["x", "w", "z"]).fit([])  # every label of the task
        expected = f1_score(binary.transform(gold), binary.transform(pred), average="macro", zero_division=0)
        assert unseen[1] not in {x for p in pred for x in p}
    elif kind == "single":
        expected = f1_score(gold, pred, average="macro", zero_division=0)
        assert unseen[1] not in pred
    else:
        expected = f1_score(sum(gold, []), sum(pred, []), average="macro", zero_division=0)
        assert test["entity_f1"] == pytest.approx(entity_f1(gold, pred), abs=1e-12)
    assert test["macro_f1"] == pytest.approx(expected, abs=1e-12)


def test_the_scores_a_run_records_count_the_labels_train_lacks(tmp_path):
    """What fine-tuning records and chooses its dev point on is scored over the task's labels, those only dev or test
    hold among them: a multi-label model that names the one label train has ("x") everywhere scores scikit-learn's
    macro-F1 over x, w and z, a third of its F1 on x alone."""
    from sklearn.metrics import f1_score
    from sklearn.preprocessing import MultiLabelBinarizer

    class EveryLabel(torch.nn.Module):  # a logit of 5 for train's one label, on every example
        def forward(self, ids, mask):
            return torch.full((len(ids), 1), 5.0)
    unseen_label_tasks(tmp_path)
    task, tok = read_task(tmp_path / "multi"), load_tokenizer("bytes")
    kind = ev.kind_of(task)
    test = (task["test"], kind.encode(task["labels"], task["test"], tok, 16))
    s = ev.Settings(None, None, None, 1e-3, 16, 16, "cls", tok.pad_id, torch.device("cpu"))
    scores, preds = ev.evaluate(EveryLabel(), task, test, s)
    binary = MultiLabelBinarizer(classes=["x", "w", "z"]).fit([])
    gold = [ex["label"] for ex in task["test"]]
    expected = f1_score(binary.transform(gold), binary.transform(preds), average="macro", zero_division=0)
    assert preds == [["x"]] * 3 and scores["macro_f1"] == pytest.approx(expected) == 0.5 / 3


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
