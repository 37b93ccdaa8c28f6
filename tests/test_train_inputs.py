"""train.py on bad input and under faults: every mistake is one line `error: ...` naming the flag or file,
exit status 2, no traceback, before any compute; no fault loses or poisons a checkpoint."""
import dataclasses
import gc
import fcntl
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import train
from conftest import ROOT
from machinery import cli, rundir
from machinery import flags as flag_rules
from machinery.cli import InputError
from machinery.rundir import RunDir

SMALL = ["--preset=tiny", "--seq_len=128", "--batch_size=4", "--micro_batch_size=2", "--eval_sequences=2",
         "--eval_interval=1000", "--log_interval=1000", "--save_interval=0", "--warmup_tokens=1024", "--lr=1e-3",
         "--threads=1"]
STEP_TOKENS = 4 * 128


def fails(capsys, argv, *words):
    """Run the command line as `python train.py` would; assert exit 2 and one `error:` line holding `words`."""
    with pytest.raises(SystemExit) as exit_info:
        cli.run(train.main, argv)
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for word in words:
        assert word in err, (word, err)
    return err


@pytest.fixture(scope="module")
def run_dir(demo_corpus, tmp_path_factory):
    """A finished 2-step run of ours, to start from."""
    out = tmp_path_factory.mktemp("runs") / "run"
    train.main([f"--data={demo_corpus}", f"--out_dir={out}", *SMALL, f"--tokens={2 * STEP_TOKENS}"])
    return out


def copy_run(run_dir, tmp_path, edit=None):
    """A copy of the run; `edit` changes the files of its newest checkpoint."""
    dst = tmp_path / "copy"
    shutil.copytree(run_dir, dst)
    if edit:
        edit(newest(dst))
    return dst


def newest(out):
    return Path(RunDir.open(str(out)).latest_state()["dir"])


def with_small(*changes):
    """SMALL with some of its flags changed (a flag may be given only once)."""
    changed = {c.split("=")[0] for c in changes}
    return [f for f in SMALL if f.split("=")[0] not in changed] + list(changes)


# Flags whose value is out of range: (flags, words the one-line message must hold).
BAD_FLAGS = [
    (["--warmup_tokens=-1000"], ["--warmup_tokens=-1000"]),  # a negative lr: gradient ascent
    (["--grad_clip=nan"], ["--grad_clip=nan"]),  # NaN would switch clipping off
    (["--eps=-1"], ["--eps=-1.0"]),
    (["--save_interval=-1"], ["--save_interval"]),
    (["--max_steps=-1"], ["--max_steps"]),
    (["--tokens=100"], ["--tokens=100", "one optimizer step"]),  # a budget smaller than the global batch
    (["--seq_len=9000", "--tokens=1e9", "--eval_sequences=1"], ["--seq_len=9000", "max_position_embeddings"]),
    (["--eval_interval=0"], ["--eval_interval"]),
    (["--log_interval=0"], ["--log_interval"]),
    (["--eval_sequences=0"], ["--eval_sequences"]),
    (["--eval_sequences=100000"], ["--eval_sequences=100000", "val.bin"]),  # found at startup, not at validation
    (["--dropout=2"], ["--dropout=2.0"]),
    (["--beta1=1"], ["--beta1=1.0"]),
    (["--lr=nan"], ["--lr=nan"]),
    (["--lr=0"], ["--lr=0.0"]),
    (["--freeze=abc"], ["--freeze='abc'"]),
    (["--freeze=0-99"], ["--freeze='0-99'", "0-3"]),
    (["--device=foo"], ["--device='foo'"]),
    (["--seed=-1"], ["--seed=-1"]),
    (["--mask_rate=1.5"], ["--mask_rate=1.5"]),
    (["--tokens=lots"], ["--tokens='lots'"]),
    (["--tokens=1e400"], ["--tokens='1e400'"]),
    (["--recipe=huge"], ["--recipe='huge'"]),
    (["--phase=decay"], ["--phase=decay", "--init_from"]),
    (["--backend=xformers"], ["--backend=xformers", "expected auto"]),
    (["--batch_size=5"], ["--batch_size=5", "--micro_batch_size"]),
    (["--recipe=paper", "--init_from=/nonexistent/run"], ["--init_from=/nonexistent/run", "no such directory"]),
    (["--recipe=paper", "--init_from=./missing"], ["--init_from=./missing", "no such directory"]),
    (["--resume"], ["--resume"]),
    (["stray"], ["'stray'"]),
    (["--unknown=1"], ["--unknown"]),
    (["--tokns=500k"], ["unknown flag --tokns; did you mean --tokens?"]),  # by closeness, not by its first letters
    (["--report_to=tensorbored"], ["--log_to=tensorbored", "'tensorbored' is not a tracker"]),  # Hugging Face's name
    (["--report_to=wandb", "--log_to=wandb"], ["--report_to and --log_to name one setting"]),
    (["--lr=1e9"], ["--lr=1000000000.0", "--allow_high_lr"]),  # a typo, not an intent
    (["--tokens=1e6", "--tokens=2e6"], ["--tokens is given twice"]),
    (["--seed=1.5"], ["--seed='1.5'"]),
    (["--seed=1e30"], ["--seed=", "2**63"]),
    (["--lr=1e38", "--allow_high_lr"], ["--lr=1e+38", "overflow"]),
    (["--schedule=cosine"], ["--schedule='cosine'", "wsd"]),
    (["--objective=span"], ["--objective='span'", "mlm, clm"]),
    (["--schedule=wsd", "--decay_frac=0"], ["--decay_frac=0.0"]),
    # a decay longer than its schedule: wsd would never reach its peak (here about a third of it at most)
    (["--schedule=wsd", "--tokens=1e6", "--decay_tokens=2000000"], ["--decay_tokens=2000000", "1,000,000 tokens"]),
    (["--schedule_tokens=100", "--tokens=1e6"], ["--schedule_tokens=100"]),
    (["--keep=0"], ["--keep=0"]),
    (["--weight_decay=5"], ["--weight_decay=5.0"]),
    (["--backend=flash"], ["--backend=flash"]),  # no flash-attn on a CPU
    (["--device=cuda:7"], ["--device=cuda:7"]),
    (["--threads=-2"], ["--threads"]),
    (["--final_lr_frac=2"], ["--final_lr_frac=2.0"]),
    # a schedule's flag the run's schedule does not read: it would change nothing
    (["--phase=clm", "--decay_frac=0.2"], ["--decay_frac=0.2 changes nothing", "the constant schedule", "wsd does"]),
    (["--final_lr_frac=0.3"], ["--final_lr_frac=0.3 changes nothing", "(1-sqrt and wsd do: --schedule=NAME)"]),
    (["--schedule=wsd", "--decay_tokens=65536", "--decay_frac=0.2"],
     ["--decay_frac=0.2 changes nothing", "the wsd schedule does not read it with these settings"]),
    (["--phase=decay", "--tokens=1e6"], ["--phase=decay", "--init_from"]),
    # windows that may hold no token to predict: [SEP] [CLS] labels nothing in MLM or CLM
    (["--seq_len=1"], ["--seq_len=1", "at least 3"]),
    (["--seq_len=2", "--phase=clm"], ["--seq_len=2", "at least 3"]),
    (["--seq_len=0"], ["--seq_len=0", "at least 3"]),
    (["--mask_rate=1e-4"], ["--mask_rate=0.0001", "0.026 tokens of a micro-batch of 2 x 128"]),  # trains nothing
    (["--threads=100000"], ["--threads=100000", "1024"]),  # a C int overflows further up; threads fail to start
    (["--ddp_timeout=0"], ["--ddp_timeout=0"]),
    (["--ddp_timeout=1e15"], ["--ddp_timeout=1000000000000000"]),  # the rendezvous's clock overflows
    (["--weights_only"], ["--weights_only", "fresh model"]),  # recorded, and meaning nothing
    (["--log_to=tensorbored"], ["--log_to=tensorbored", "'tensorbored' is not a tracker", "tensorboard, wandb"]),
    (["--license=Apache 2.0"], ["--license='Apache 2.0'", "apache-2.0"]),  # the model card's front matter
    (["--language=English"], ["--language='English'", "en,de"]),
    (["--base_model=a/b/c"], ["--base_model='a/b/c'", "hub id"]),
    (["--hub_id=mymodel"], ["--hub_id='mymodel'", "USER/NAME"]),  # the card's "Use" loads it from the hub
    # ids the hub refuses (huggingface_hub's validate_repo_id, test_hub_ids_are_those_the_hub_takes): never in a card
    (["--hub_id=../.."], ["--hub_id='../..'", "USER/NAME", "'..' is not a name the hub takes"]),
    (["--hub_id=./model"], ["--hub_id='./model'", "'.' is not a name the hub takes"]),
    (["--hub_id=me/model.git"], ["--hub_id='me/model.git'", "ending in .git"]),
    (["--hub_id=me/a..b"], ["--hub_id='me/a..b'", "no '--' or '..'"]),
    (["--hub_id=me/" + "m" * 97], ["--hub_id='me/mmm", "1 to 96 ASCII letters"]),
    (["--hub_id=me/modèle"], ["--hub_id='me/modèle'", "'modèle' is not a name the hub takes"]),
    (["--base_model=a/.."], ["--base_model='a/..'", "hub id", "'..' is not a name"]),
    # accepted by the flags, beyond what a checkpoint holds (integers below 2**62, strings of 4,096 characters):
    # refused before the first step, not at the first save after it (--max_steps: a step that would be lost)
    (["--tokens=5e18", "--max_steps=1"], ["--tokens=5000000000000000000", "a checkpoint cannot hold it",
                                         "nothing was trained"]),
    (["--seed=4611686018427387904", "--max_steps=1"], ["--seed=4611686018427387904", "a checkpoint cannot hold it",
                                                      "nothing was trained"]),
    # a micro-batch no machine holds (8 TiB of ids): the allocator's failure, as one line naming what to lower
    (["--batch_size=1099511627776", "--micro_batch_size=1099511627776", "--seq_len=3", "--tokens=1e13"],
     ["out of memory on cpu in step 1", "8.00 TiB", "1099511627776 x 3 tokens", "4 blocks 128 wide",
      "--micro_batch_size", "--seq_len or --preset"]),
]
if not torch.cuda.is_available():
    BAD_FLAGS.append((["--device=cuda"], ["--device=cuda", "not available"]))
    BAD_FLAGS.append((["--backend=flex"], ["--backend=flex", "cannot train on cpu", "sdpa"]))  # no CPU backward



@pytest.mark.parametrize("flags, words", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_before_any_compute(flags, words, demo_corpus, tmp_path, capsys):
    out = tmp_path / "out"
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={out}", *with_small(*flags)], *words)
    assert not out.exists()  # refused after the run directory was made, or before: no husk that reads as a run


def test_hub_ids_are_those_the_hub_takes():
    """--hub_id and --base_model (and every other place a hub id is checked: hf.hub_id_problem) take what the hub
    takes, and nothing else: huggingface_hub's own validate_repo_id is the oracle, on ids at its rules' edges and on
    6,000 random ones. --hub_id needs a namespace (USER/NAME: a name alone loads another repository)."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    from machinery.hf import hub_id_problem

    def hub_takes(text):
        try:
            validate_repo_id(text)
            return True
        except HFValidationError:
            return False
    rng = np.random.default_rng(0)
    alphabet = list("ab_Z9.-/") + ["é", " ", "~"]
    edges = ["a/b", "a", "_a/b_", "./x", "a/.", "a/..", "..", ".", "-a/b", "a/-b", "a/b.", "a/b-", "a--b/c", "a/b.git",
             "a/b.gitx", "1/2", "a b/c", "a/b/c", "/a", "a/", "", "a" * 96 + "/b", "a/" + "b" * 96, "a/" + "b" * 97,
             "answerdotai/ModernBERT-base", "bert-base-uncased", "日本/x"]
    texts = edges + ["".join(rng.choice(alphabet, rng.integers(1, 9))) for _ in range(6000)]
    assert 500 < sum(map(hub_takes, texts)) < 5000  # the random ids hold both kinds
    for text in texts:
        assert (hub_id_problem(text, namespace=False) is None) == hub_takes(text), text
        assert (hub_id_problem(text) is None) == (hub_takes(text) and "/" in text), text


def test_a_mistyped_run_to_continue_is_named_as_missing_under_the_demo_recipe(demo_corpus, tmp_path, capsys):
    """`python train.py --phase=decay --init_from=out/code-clmm` (a typo) under the default recipe: the folder is not
    there, which is what the user must hear, not that the demo takes no pretrained checkpoint."""
    fails(capsys, ["--phase=decay", "--init_from=out/mistyped", f"--data={demo_corpus}", f"--out_dir={tmp_path / 'o'}"],
          "--init_from=out/mistyped: no such folder, so no run of train.py to continue")
    # under another recipe a decay takes its data and budget from the run: naming those was no help either
    fails(capsys, ["--recipe=cpu", "--phase=decay", "--init_from=out/mistyped", f"--out_dir={tmp_path / 'o'}"],
          "--init_from=out/mistyped: no such folder here, so no run of ours to take --data and --tokens from")
    fails(capsys, ["--recipe=paper", "--phase=clm", "--init_from=answerdotai/ModernBERT-base"],
          "from a Hugging Face id, pass --data)")


def test_a_start_that_is_neither_a_folder_nor_a_hub_id_is_named_as_init_from(demo_corpus, tmp_path, capsys):
    """The card's base model is --init_from's hub id only where it is one: a path that is not there is an error of
    --init_from, never of a --base_model the user did not give."""
    fails(capsys, ["--recipe=paper", "--init_from=./missing", f"--data={demo_corpus}", f"--out_dir={tmp_path / 'o'}"],
          "--init_from=./missing: ./missing: no such directory")


def test_a_missing_init_from_is_named_as_a_folder_and_as_a_hub_id(demo_corpus, tmp_path, capsys, monkeypatch):
    """Under a recipe that takes a Hugging Face start, with --data and --tokens given: what the hub cannot hold (an
    absolute path, ./ or ../, two '/', a '/' at the end) is a folder that is not here, said before the data is read
    or the hub is asked; what may be either, fetched in vain, is named in both readings, with what the hub said."""
    import httpx
    from huggingface_hub.errors import RepositoryNotFoundError
    asked = []

    def hub(repo_id, **kwargs):
        asked.append(repo_id)
        raise answer
    monkeypatch.setattr("huggingface_hub.snapshot_download", hub)
    argv = ["--recipe=cpu", f"--data={tmp_path / 'no-data'}", "--tokens=1e6", f"--out_dir={tmp_path / 'o'}"]
    for path in (str(tmp_path / "mistyped"), "./mistyped", "../out/mistyped", "out/run/mistyped", "out/mistyped/"):
        fails(capsys, [f"--init_from={path}", *argv], f"--init_from={path}: {path}: no such directory, and not a hub id")
    assert asked == []
    argv[1] = f"--data={demo_corpus}"
    answer = RepositoryNotFoundError("404 Client Error. Repository Not Found", response=httpx.Response(
        404, request=httpx.Request("GET", "https://huggingface.co/api/models/out/mistyped")))
    fails(capsys, ["--init_from=out/mistyped", *argv], "--init_from=out/mistyped: no such folder here, and could not "
          "fetch 'out/mistyped' from the Hugging Face hub: no such model on the hub (or a private one)")
    answer = ConnectionError("offline")
    fails(capsys, ["--init_from=out/mistyped", *argv], "no such folder here, and could not fetch 'out/mistyped'",
          "the hub could not be reached (ConnectionError: offline)")
    assert asked == ["out/mistyped"] * 2 and not (tmp_path / "o").exists()


# torchrun's variables left in a shell, or written by hand: (environment, words of the one line). Each is refused
# before any rendezvous (which would wait, or end in a traceback); the message says what to run instead.
TORCHRUN = dict(LOCAL_RANK="0", MASTER_ADDR="localhost", MASTER_PORT="29400")
BAD_ENVIRONMENTS = [
    (dict(RANK="0"), ["RANK=0", "WORLD_SIZE is missing", "torchrun --nproc_per_node=N train.py", "unset RANK"]),
    (dict(RANK="1"), ["RANK=1", "WORLD_SIZE is missing"]),  # rank 1 prints too: the error is about its variables
    (dict(WORLD_SIZE="1"), ["WORLD_SIZE=1", "RANK is missing", "unset WORLD_SIZE"]),
    (dict(WORLD_SIZE="2"), ["RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT are missing"]),
    (dict(LOCAL_RANK="0"), ["RANK, WORLD_SIZE are missing"]),
    (dict(RANK="1", WORLD_SIZE="2"), ["LOCAL_RANK, MASTER_ADDR, MASTER_PORT are missing"]),
    (dict(RANK="2", WORLD_SIZE="2", **TORCHRUN), ["RANK must be below WORLD_SIZE"]),  # would wait at the rendezvous
    (dict(RANK="x", WORLD_SIZE="2", **TORCHRUN), ["RANK=x", "a whole number"]),
    (dict(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="two"), ["LOCAL_WORLD_SIZE", "a whole number"]),
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="4", **TORCHRUN), ["LOCAL_WORLD_SIZE must be 1 to WORLD_SIZE"]),
    (dict(RANK="0", WORLD_SIZE="2", **{**TORCHRUN, "LOCAL_RANK": "2"}, LOCAL_WORLD_SIZE="2"),
     ["LOCAL_RANK must be below"]),
    (dict(RANK="0", WORLD_SIZE="2", **{**TORCHRUN, "MASTER_PORT": "70000"}), ["MASTER_PORT must be a port"]),
    (dict(OMP_NUM_THREADS="99999999999"), ["OMP_NUM_THREADS=99999999999", "1024"]),  # no --threads given
]


@pytest.fixture
def environment(monkeypatch):
    """Set these variables, with none of torchrun's left from the shell that started the tests."""
    for name in (*cli.PROCESS_VARIABLES, "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    return lambda variables: [monkeypatch.setenv(k, v) for k, v in variables.items()]


@pytest.mark.parametrize("variables, words", BAD_ENVIRONMENTS, ids=[" ".join(f"{k}={v}" for k, v in e.items())
                                                                     for e, _ in BAD_ENVIRONMENTS])
def test_leftover_torchrun_variables_are_one_line(variables, words, environment, demo_corpus, tmp_path, capsys):
    environment(variables)
    flags = [f for f in SMALL if not f.startswith("--threads")]  # OMP_NUM_THREADS decides where --threads is 0
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={tmp_path / 'out'}", *flags], *words)
    assert not (tmp_path / "out").exists()


def test_one_process_runs_with_torchruns_variables_and_others_are_awaited_with_a_deadline(
        environment, demo_corpus, tmp_path, capsys):
    """RANK=0 WORLD_SIZE=1 (torchrun --nproc_per_node=1, or a launcher's) is one process: it trains, and makes no
    process group. A complete set for 2 processes started without the other waits --ddp_timeout, then says so."""
    environment(dict(RANK="0", WORLD_SIZE="1", **TORCHRUN))
    train.main([f"--data={demo_corpus}", f"--out_dir={tmp_path / 'one'}", *SMALL, f"--tokens={STEP_TOKENS}"])
    assert "1 process(es)" in capsys.readouterr().out and not torch.distributed.is_initialized()
    environment(dict(RANK="1", WORLD_SIZE="2", **{**TORCHRUN, "LOCAL_RANK": "1", "MASTER_PORT": "1"}))
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={tmp_path / 'two'}", *SMALL, "--ddp_timeout=1", "--device=cpu"],
          "rank 1 of 2 did not meet the others at localhost:1 within --ddp_timeout=1 s", "torchrun")


@pytest.mark.parametrize("error, words", [
    (torch.distributed.DistBackendError, ["rank 0 of 2: NCCL could not start on cuda:0: NCCL error in: init.cc:1 "
                                          "unhandled cuda error", "NCCL_DEBUG=INFO", "NCCL_SOCKET_IFNAME"]),
    (torch.distributed.DistStoreError, ["rank 0 of 2 did not meet the others at localhost:29400", "torchrun"])],
    ids=["nccl", "store"])
def test_only_the_stores_failures_read_as_a_missed_rendezvous(error, words, environment, monkeypatch, demo_corpus,
                                                              tmp_path, capsys, request):
    """On GPUs (faked): NCCL failing to start its communicator (a driver, a network interface, two ranks on one
    GPU) passes through in its own words with what to check; only the store's failure says the others never came."""
    environment(dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", **TORCHRUN))
    monkeypatch.setattr("machinery.cli.pick_device", lambda *args, **kwargs: torch.device("cuda:0"))
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    # train.py turns TF32 on for a CUDA device: put it back after (saved by hand, since cuBLAS's flags are no
    # attributes that monkeypatch can restore: pytest 9.2 would delete them)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    request.addfinalizer(lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", tf32))

    def init_process_group(backend, **kwargs):
        raise error("NCCL error in: init.cc:1 unhandled cuda error\nLast error: more words")
    monkeypatch.setattr(train.dist, "init_process_group", init_process_group)
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={tmp_path / 'run'}", *SMALL], *words)


def test_one_gpu_named_for_several_processes_is_refused(environment, demo_corpus, tmp_path, capsys):
    """--device=cuda:0 under torchrun with 2 processes on this machine would put both on GPU 0: refused before any
    GPU is touched or any process group is made (this machine has no GPU: the refusal comes first)."""
    environment(dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", **TORCHRUN))
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={tmp_path / 'run'}", *SMALL, "--device=cuda:0"],
          "--device=cuda:0 names one device for the 2 processes on this machine", "--device=cuda")
    assert not (tmp_path / "run").exists()



def test_each_local_process_takes_the_gpu_of_its_local_rank(monkeypatch):
    """On a machine of 2 GPUs (faked): one process may name either; under 2 local processes, cuda and auto give each
    the GPU of its LOCAL_RANK, and an index is refused (both processes would run on it); a GPU past the machine's is
    named, for --device and for LOCAL_RANK alike."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert cli.pick_device("cuda:1") == torch.device("cuda:1") and cli.pick_device("cuda") == torch.device("cuda:0")
    for requested in ("cuda", "auto"):
        assert cli.pick_device(requested, local_rank=1, local_world=2) == torch.device("cuda:1"), requested
    with pytest.raises(InputError, match=r"^--device=cuda:0 names one device for the 2 processes on this machine"):
        cli.pick_device("cuda:0", local_rank=1, local_world=2)
    with pytest.raises(InputError, match=r"^--device=cuda:2: this machine has 2 GPU\(s\)"):
        cli.pick_device("cuda:2")
    with pytest.raises(InputError, match=r"^LOCAL_RANK=2 asks for GPU 2, and this machine has 2"):
        cli.pick_device("auto", local_rank=2, local_world=3)

def test_demo_recipe_refuses_a_pretrained_start(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    fails(capsys, [f"--init_from={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'o'}"], "--recipe=demo", "--recipe=paper")


# Broken files: (what to break in the newest checkpoint of a copy of a finished run, words of the message).
# The copy is --init_from; its state.json is read as a flag would be: field and file named, before any weight.
def truncate(name):
    def edit(folder):
        with open(folder / name, "r+b") as f:
            f.truncate(100)
    return edit


def rewrite(name, text):
    return lambda folder: (folder / name).write_text(text)


def edit_json(name, change):
    def edit(folder):
        content = json.loads((folder / name).read_text())
        change(content)
        (folder / name).write_text(json.dumps(content))
    return edit


def poison(name, key, value=float("nan")):
    """Write `value` into one element of tensor `key` of a safetensors file, its size and header unchanged (the
    size a checkpoint's state.json lists still holds)."""
    def edit(folder):
        from safetensors import safe_open
        from safetensors.torch import save_file
        path = folder / name
        with safe_open(path, "pt") as f:
            metadata = f.metadata()
        tensors, size = load_file(path), path.stat().st_size
        tensors[key].view(-1)[3] = value
        save_file(tensors, path, metadata=metadata)
        assert path.stat().st_size == size
    return edit


BAD_RUNS = [
    ("truncated model", truncate("model.safetensors"), ["model.safetensors", "bytes"]),
    ("truncated optimizer", truncate("optimizer.safetensors"), ["optimizer.safetensors", "bytes"]),
    ("garbage state.json", rewrite("state.json", "{not json"), ["state.json", "not valid JSON"]),
    ("state.json without loader", edit_json("state.json", lambda s: s.pop("loader")), ["state.json", "loader"]),
    ("a string adam_t", edit_json("state.json", lambda s: s.update(adam_t="4")), ["state.json", "adam_t"]),
    ("a negative phase_step", edit_json("state.json", lambda s: s.update(phase_step=-5)), ["phase_step"]),
    ("a phase_step of 1e30", edit_json("state.json", lambda s: s.update(phase_step=1e30)), ["phase_step"]),
    ("a non-numeric loader position", edit_json("state.json", lambda s: s["loader"].update(sequence="x")),
     ["loader.sequence"]),
    ("an lr of 'abc'", edit_json("state.json", lambda s: s["config"].update(lr="abc")), ["config.lr"]),
    ("history not a list", edit_json("state.json", lambda s: s.update(history={"a": 1})), ["history"]),
    ("rng not base64", edit_json("state.json", lambda s: s["rng"][0].update(cpu="!!")), ["rng[0].cpu"]),
    ("parent tokens of 1e30", edit_json("state.json", lambda s: s.update(phase_tokens=10**30)), ["phase_tokens"]),
    ("tokens that steps cannot make", edit_json("state.json", lambda s: s.update(phase_tokens=7)),
     ["phase_tokens 7"]),
    ("a phase nobody knows", edit_json("state.json", lambda s: s.update(phase="sft")), ["phase"]),
]


@pytest.mark.parametrize("name, edit, words", BAD_RUNS, ids=[b[0] for b in BAD_RUNS])
def test_broken_start_run_is_named(name, edit, words, run_dir, demo_corpus, tmp_path, capsys):
    start = copy_run(run_dir, tmp_path, edit)
    fails(capsys, [f"--init_from={start}", f"--out_dir={tmp_path / 'out'}", "--phase=decay", *SMALL], *words,
          str(start))
    assert not (tmp_path / "out" / "checkpoints").exists()


@pytest.mark.parametrize("start", ["handoff", "weights", "resume", "hugging face"])
def test_a_checkpoint_that_holds_nan_or_inf_is_refused_before_any_step(start, run_dir, demo_corpus, tmp_path, capsys):
    """A weight or one of Adam's moments that is NaN or inf (a damaged file, a run of another trainer) is refused as
    it is read, naming the file and the tensor: never blamed on the learning rate after a step that poisons every
    weight. Every way a run takes weights or moments from a checkpoint."""
    weight = "model.layers.1.mlp.Wo.weight"
    moment = "exp_avg_sq.model.layers.0.attn.Wqkv.weight"
    copy = copy_run(run_dir, tmp_path, poison("optimizer.safetensors", moment, float("inf")))
    common = [f"--out_dir={tmp_path / 'out'}", *SMALL, f"--tokens={STEP_TOKENS}"]
    argv = {"handoff": [f"--init_from={copy}", "--phase=decay", *common],
            "weights": [f"--init_from={copy}", "--weights_only", "--phase=clm", f"--data={demo_corpus}", *common],
            "resume": ["--resume", f"--out_dir={copy}", f"--tokens={3 * STEP_TOKENS}"],
            "hugging face": [f"--init_from={copy}", "--recipe=paper", f"--data={demo_corpus}", *common]}[start]
    if start in ("handoff", "resume"):  # they take the moments too: the inf moment first, then the weights
        fails(capsys, argv, f"{newest(copy) / 'optimizer.safetensors'}: Adam's moment {moment} holds NaN or inf")
        poison("optimizer.safetensors", moment, 1.0)(newest(copy))
    if start == "hugging face":  # the top-level copy: a Hugging Face folder's model.safetensors
        shutil.rmtree(copy / "checkpoints")
        (copy / "run.json").unlink()
        poison("model.safetensors", weight)(copy)
        fails(capsys, argv, f"{copy / 'model.safetensors'}: weight {weight} holds NaN or inf")
    else:
        poison("model.safetensors", weight)(newest(copy))
        fails(capsys, argv, f"{newest(copy) / 'model.safetensors'}: weight {weight} holds NaN or inf")
    assert "step 1" not in capsys.readouterr().out and not (tmp_path / "out" / "checkpoints").exists()


# A Hugging Face directory (no run of ours) with broken files: the file itself is named.
BAD_CHECKPOINTS = [
    ("truncated weights", truncate("model.safetensors"), ["model.safetensors", "not a readable safetensors file"]),
    ("garbage config.json", rewrite("config.json", "[1, 2"), ["config.json"]),
    ("vocab of 4e9", edit_json("config.json", lambda c: c.update(vocab_size=4_000_000_000)), ["config.json"]),
]


@pytest.mark.parametrize("name, edit, words", BAD_CHECKPOINTS, ids=[b[0] for b in BAD_CHECKPOINTS])
def test_broken_hugging_face_checkpoint_is_named(name, edit, words, run_dir, demo_corpus, tmp_path, capsys):
    start = tmp_path / "hf"
    start.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(run_dir / name, start / name)
    edit(start)
    fails(capsys, [f"--data={demo_corpus}", f"--init_from={start}", f"--out_dir={tmp_path / 'out'}",
                   "--recipe=paper", *SMALL, "--tokens=1e6"], *words)


# Broken data directories: a copy of the demo corpus with its meta.json edited.
BAD_META = [
    ("float16 dtype", lambda m: m.update(dtype="float16"), ["meta.json"]),
    ("no pad_id", lambda m: m.pop("pad_id"), ["meta.json"]),
    ("special id beyond the vocabulary", lambda m: m.update(mask_id=10**6), ["meta.json"]),
    ("tokenizer is a system file", lambda m: m.update(tokenizer="/etc/hostname"), ["/etc/hostname"]),
]


@pytest.mark.parametrize("name, change, words", BAD_META, ids=[b[0] for b in BAD_META])
def test_broken_data_is_named(name, change, words, demo_corpus, tmp_path, capsys):
    corpus = tmp_path / "corpus"
    shutil.copytree(demo_corpus, corpus)
    edit_json("meta.json", change)(corpus)
    fails(capsys, [f"--data={corpus}", f"--out_dir={tmp_path / 'out'}", *SMALL], *words)
    assert not (tmp_path / "out" / "hostname").exists()


def test_a_resume_reads_the_tokens_the_run_read(demo_corpus, tmp_path, capsys):
    """A token file overwritten in place with other tokens of the same size before --resume is refused, naming the
    file (its fingerprint in meta.json); so is the data prepared again with other tokens, meta.json and all (the
    fingerprint the checkpoint holds). The tokens put back, the run goes on."""
    from machinery.tokenfiles import file_digest
    corpus, out = tmp_path / "corpus", tmp_path / "out"
    shutil.copytree(demo_corpus, corpus)
    train.main([f"--data={corpus}", f"--out_dir={out}", *SMALL, f"--tokens={3 * STEP_TOKENS}", "--max_steps=1"])
    kept = (corpus / "train.bin").read_bytes()
    tokens = np.frombuffer(kept, np.uint16)
    np.random.default_rng(0).permutation(tokens).tofile(corpus / "train.bin")  # in place: the same inode and size
    fails(capsys, ["--resume", f"--out_dir={out}"], f"{corpus / 'train.bin'}: not the tokens data.py prepare wrote")
    meta = json.loads((corpus / "meta.json").read_text())
    meta["splits"]["train"]["sample_sha256"] = file_digest(corpus / "train.bin", "uint16", len(tokens))
    (corpus / "meta.json").write_text(json.dumps(meta))  # as a prepare of these tokens would write it
    fails(capsys, ["--resume", f"--out_dir={out}"], "state.json: loader: the run read other tokens than",
          str(corpus / "train.bin"))
    shutil.copytree(demo_corpus, corpus, dirs_exist_ok=True)
    train.main(["--resume", f"--out_dir={out}"])
    assert newest(out).name == "step-00000003"


def test_a_started_model_keeps_its_architecture_and_records_it(run_dir, demo_corpus, tmp_path, capsys):
    """--preset with --init_from: another architecture is refused (the weights have their shape), the same one is
    accepted; a start from a checkpoint records the preset its shape has, not the recipe's. A hand-off keeps the
    settings its data position holds for."""
    fails(capsys, [f"--init_from={run_dir}", f"--out_dir={tmp_path / 'decay'}", "--phase=decay",
                   *with_small("--preset=mini")], "--preset=mini", "is tiny (4 blocks 128 wide)", "leave it out")
    for flag in ("--seq_len=64", "--seed=5", "--data_seed=3"):  # the parent's data position holds for its own only
        fails(capsys, [f"--init_from={run_dir}", f"--out_dir={tmp_path / 'decay'}", "--phase=decay",
                       *with_small(flag)], flag, "continues the data position", "--weights_only")
    hf = tmp_path / "hf"
    hf.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        shutil.copy(run_dir / name, hf / name)
    start = [f"--data={demo_corpus}", f"--init_from={hf}", "--recipe=paper", f"--tokens={STEP_TOKENS}"]
    fails(capsys, [*start, f"--out_dir={tmp_path / 'base'}", *with_small("--preset=base")], "--preset=base", "tiny")
    unnamed = [f for f in SMALL if not f.startswith("--preset")]
    train.main([*start, f"--out_dir={tmp_path / 'weights'}", *unnamed])  # the paper's recipe names base
    assert RunDir.open(str(tmp_path / "weights")).latest_state()["config"]["preset"] == "tiny"
    train.main([*start, f"--out_dir={tmp_path / 'same'}", *SMALL])


@pytest.mark.parametrize("allocate", [lambda: torch.empty(1 << 50, dtype=torch.uint8),
                                      lambda: __import__("numpy").empty(1 << 50, dtype="uint8")],
                         ids=["torch's CPU allocator", "numpy's"])
def test_out_of_memory_mid_run_is_one_line_and_keeps_the_checkpoint(allocate, demo_corpus, tmp_path, capsys,
                                                                     monkeypatch):
    """A real allocation of 1 PiB in step 2 (after step 1's checkpoint): one line with the sizes and what to lower,
    and the checkpoint of step 1 stays complete."""
    out = tmp_path / "run"
    real, steps = train.freeze.zero_frozen_grads, []

    def allocating(model, names):  # runs after each backward
        real(model, names)
        steps.append(1)
        if len(steps) == 2:
            allocate()
    monkeypatch.setattr(train.freeze, "zero_frozen_grads", allocating)
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={out}", *with_small("--save_interval=1"),
                   f"--tokens={4 * STEP_TOKENS}"], "out of memory on cpu in step 2", "micro-batches of 2 x 128 tokens",
          "--micro_batch_size", "--seq_len or --preset", f"checkpoints in {out} are as they were")
    assert newest(out).name == "step-00000001"
    assert load_file(out / "model.safetensors").keys() == load_file(newest(out) / "model.safetensors").keys()
    monkeypatch.setattr(train.freeze, "zero_frozen_grads", real)
    train.main([f"--out_dir={out}", "--resume"])  # the kept checkpoint goes on
    assert RunDir.open(str(out)).latest_state()["phase_step"] == 4


def test_out_dir_a_user_shares_keeps_every_file_of_theirs(demo_corpus, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={tmp_path / 'file'}", *SMALL], "--out_dir", "file")
    (tmp_path / "hf").mkdir()  # a model directory that is no run of ours: training into it would overwrite it
    (tmp_path / "hf" / "config.json").write_text("{}")
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={tmp_path / 'hf'}", *SMALL], "config.json", "run.json")
    out = tmp_path / "mine"  # a user's notes, results and backups in and beside the run survive every save
    (out / "eval").mkdir(parents=True)
    (out / "README.md").write_text("keep me")
    (out / "eval" / "results.json").write_text("{}")
    flags = [f"--data={demo_corpus}", f"--out_dir={out}", *with_small("--save_interval=1"), f"--tokens={4 * STEP_TOKENS}"]
    train.main([*flags, "--max_steps=2"])
    shutil.copytree(out, tmp_path / "mine.old")  # a backup beside the run, taken mid-run
    backup = {p: p.read_bytes() for p in (tmp_path / "mine.old").rglob("*") if p.is_file()}
    train.main([f"--out_dir={out}", "--resume"])
    assert (out / "README.md").read_text() == "keep me" and (out / "eval" / "results.json").read_text() == "{}"
    assert {p: p.read_bytes() for p in (tmp_path / "mine.old").rglob("*") if p.is_file()} == backup
    assert RunDir.open(str(out)).latest_state()["phase_step"] == 4
    assert len(list((out / "checkpoints").iterdir())) == 3  # --keep=3


def test_second_writer_is_refused(demo_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    train.main([f"--data={demo_corpus}", f"--out_dir={out}", *SMALL, f"--tokens={2 * STEP_TOKENS}", "--max_steps=1"])
    with open(out / ".lock", "a+") as held:  # what a running train.py holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fails(capsys, [f"--out_dir={out}", "--resume"], "another train.py", ".lock")
    train.main([f"--out_dir={out}", "--resume"])  # released: runs, and leaves no lock file behind
    assert not (out / ".lock").exists()


def files_of(folder):
    """{path under folder: its bytes} for every file, .lock included."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file()}


# Refused after the run directory is made or locked: by the model's blocks, and by what a checkpoint can hold.
LATE_REFUSALS = [(["--freeze=0-99"], "--freeze='0-99'"), (["--tokens=5e18", "--max_steps=1"], "nothing was trained")]


@pytest.mark.parametrize("flags, words", LATE_REFUSALS, ids=[f[0] for f, _ in LATE_REFUSALS])
def test_a_refused_start_leaves_its_out_dir_as_it_was(flags, words, run_dir, demo_corpus, tmp_path, capsys):
    """A start refused once its run directory is made takes back what it made (run.json, .lock, the folder) and
    nothing more: an empty folder the user made stays, and a run of ours killed before its first checkpoint keeps
    its log and its .lock byte for byte (a start that runs empties that log at its first record). A refused
    --resume leaves its run byte for byte, the log's records past the checkpoint (a kill between saves) included,
    with no .lock added."""
    made, empty, husk, resumed = tmp_path / "made", tmp_path / "empty", tmp_path / "husk", copy_run(run_dir, tmp_path)
    empty.mkdir()
    RunDir.create(str(husk)).append_log({"step": 1, "loss": 7.0})
    (husk / ".lock").write_text("")  # a kill leaves the file, never the lock
    with open(resumed / "log.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 1.0}\n')
    before = {out: files_of(out) for out in (empty, husk, resumed)}
    for out in (made, empty, husk):
        fails(capsys, [f"--data={demo_corpus}", f"--out_dir={out}", *with_small(*flags)], words)
    fails(capsys, [f"--out_dir={resumed}", "--resume", *flags], flags[0].split("=")[0])
    assert not made.exists()
    assert {out: files_of(out) for out in (empty, husk, resumed)} == before and os.listdir(empty) == []


def test_a_checkpoint_older_than_some_settings_resumes_with_their_defaults(run_dir, tmp_path, capsys):
    """A checkpoint written before --log_to and the model card's flags existed lacks them: it resumes with their
    defaults, each said once. A setting its counters and data position are counted in (seq_len) is refused when
    missing, with the reason."""
    out = copy_run(run_dir, tmp_path)
    path = newest(out) / "state.json"
    state = json.loads(path.read_text())
    for key in ("log_to", "license", "language", "base_model"):
        del state["config"][key]
    path.write_text(json.dumps(state))
    capsys.readouterr()
    train.main([f"--out_dir={out}", "--resume", f"--tokens={3 * STEP_TOKENS}"])
    printed = capsys.readouterr().out
    assert printed.count("license: not in this run (its checkpoint was written before the setting existed), its "
                         "default ''") == 1 and "base_model: not in this run" in printed
    assert RunDir.open(str(out)).latest_state()["config"]["license"] == ""
    path = newest(out) / "state.json"
    state = json.loads(path.read_text())
    del state["config"]["seq_len"]
    path.write_text(json.dumps(state))
    fails(capsys, [f"--out_dir={out}", "--resume"], "state.json: config.seq_len: missing, and a run cannot continue "
          "from it without it: its counters, data position and place in its schedule are counted in it")


def test_a_setting_added_to_config_leaves_the_runs_made_before_it_usable(run_dir, demo_corpus, tmp_path, monkeypatch,
                                                                         capsys):
    """An ablation's first edit: a field added to train.py's Config (here one a hand-off inherits). A run made
    before it resumes, hands off and starts --weights_only; where the run's settings are read (a resume, a
    hand-off) the start says once that the field takes its default, and the checkpoints written from then on hold
    it. A flag given for it is taken, and not said to be the default."""
    extended = dataclasses.make_dataclass("Config", [("label_smoothing", float, 0.0)], bases=(train.Config,))
    monkeypatch.setattr(train, "Config", extended)
    monkeypatch.setattr(train, "FIELDS", flag_rules.checkpoint_fields(extended))
    monkeypatch.setattr(train, "INHERITED", (*train.INHERITED, "label_smoothing"))
    out = copy_run(run_dir, tmp_path)
    assert "label_smoothing" not in RunDir.open(str(out)).latest_state()["config"]
    said = "label_smoothing: not in {} (its checkpoint was written before the setting existed), its default 0.0"
    capsys.readouterr()
    for how, argv in {"resume": [f"--out_dir={out}", "--resume", f"--tokens={3 * STEP_TOKENS}"],
                      "handoff": [f"--init_from={run_dir}", "--phase=decay", f"--out_dir={tmp_path / 'decay'}",
                                  f"--tokens={STEP_TOKENS}"],
                      "weights": [f"--init_from={run_dir}", "--weights_only", f"--out_dir={tmp_path / 'weights'}",
                                  f"--data={demo_corpus}", *SMALL, f"--tokens={STEP_TOKENS}"]}.items():
        train.main(argv)
        printed = capsys.readouterr().out
        where = {"resume": "this run", "handoff": "the run it continues"}.get(how)
        assert printed.count(said.format(where)) == (1 if where else 0) and "label_smoothing: not in" not in \
            printed.replace(said.format(where), ""), how
        state = RunDir.open(str(argv[0 if how == "resume" else 2].split("=", 1)[1])).latest_state()
        assert state["config"]["label_smoothing"] == 0.0 and state["phase_step"] == 1 + 2 * (how == "resume"), how
    train.main([f"--out_dir={out}", "--resume", f"--tokens={4 * STEP_TOKENS}"])  # it holds the field now: no word
    assert "label_smoothing: not in" not in capsys.readouterr().out
    train.main([f"--init_from={run_dir}", "--phase=decay", f"--out_dir={tmp_path / 'given'}", f"--tokens={STEP_TOKENS}",
                "--label_smoothing=0.1"])
    assert "label_smoothing: not in" not in capsys.readouterr().out
    assert RunDir.open(str(tmp_path / "given")).latest_state()["config"]["label_smoothing"] == 0.1


def test_a_setting_removed_from_config_leaves_the_runs_made_with_it_usable(run_dir, demo_corpus, tmp_path, capsys):
    """The ablation undone: a run saved with a field that train.py's Config no longer has (label_smoothing, added
    for the run and removed since). A hand-off and a --weights_only start go on without it (the hand-off says so
    once, and its checkpoint does not hold it); a --resume, which continues the run as it was saved, is refused in
    one line that names the setting and the way on."""
    def saved_with_smoothing(folder):
        state = json.loads((folder / "state.json").read_text())
        state["config"]["label_smoothing"] = 0.1
        (folder / "state.json").write_text(json.dumps(state))
    out = copy_run(run_dir, tmp_path, saved_with_smoothing)
    said = ("label_smoothing=0.1: a setting of the run it continues that train.py's Config no longer has (removed "
            "since its checkpoint was written): this run goes on without it")
    capsys.readouterr()
    for how, argv in {"handoff": [f"--init_from={out}", "--phase=decay", f"--out_dir={tmp_path / 'decay'}",
                                  f"--tokens={STEP_TOKENS}"],
                      "weights": [f"--init_from={out}", "--weights_only", f"--out_dir={tmp_path / 'weights'}",
                                  f"--data={demo_corpus}", *SMALL, f"--tokens={STEP_TOKENS}"]}.items():
        train.main(argv)
        printed = capsys.readouterr().out
        assert printed.count(said) == (how == "handoff") and "label_smoothing=" not in printed.replace(said, ""), how
        state = RunDir.open(str(tmp_path / ("decay" if how == "handoff" else "weights"))).latest_state()
        assert "label_smoothing" not in state["config"] and state["phase_step"] == 1, how
    fails(capsys, [f"--out_dir={out}", "--resume", f"--tokens={3 * STEP_TOKENS}"], "state.json: the run was saved "
          "with label_smoothing=0.1, a setting train.py's Config no longer has", "put the field back", "--init_from")


def test_a_run_of_ours_trained_with_another_tokenizer_is_refused_on_this_data(run_dir, demo_corpus, tmp_path, capsys):
    """A start from a run of ours (its weights alone, or a hand-off) on data of another tokenizer with the same size
    and special ids, which the ids alone do not tell apart (here the run's with two ids swapped: its "a" is the
    data's "b"), is one line before any weight is loaded, naming both tokenizers."""
    def swap(checkpoint):
        path = checkpoint / "tokenizer.json"
        text = path.read_text()
        vocab = json.loads(text)["model"]["vocab"]
        a, b = f'"a": {vocab["a"]},', f'"b": {vocab["b"]},'
        assert text.count(a) == text.count(b) == 1 and len(a) == len(b)  # the same size: the checkpoint stays whole
        path.write_text(text.replace(a, "\0").replace(b, f'"b": {vocab["a"]},').replace("\0", f'"a": {vocab["b"]},'))
    other = copy_run(run_dir, tmp_path, edit=swap)
    for how, extra in (("weights", ["--weights_only"]), ("handoff", [])):
        out = tmp_path / how
        fails(capsys, [f"--data={demo_corpus}", f"--init_from={other}", f"--out_dir={out}", *SMALL,
                       f"--tokens={STEP_TOKENS}", *extra],
              f"{demo_corpus}/meta.json", f"--init_from={other} was trained with another", "tokenizer.json",
              "Prepare the data with the model's tokenizer")
        assert not (out / "model.safetensors").exists()


def test_a_checkpoint_that_calls_adam_t_step_resumes_and_hands_off(run_dir, tmp_path):
    """A checkpoint written before Adam's t had its own name holds it as `step`: it resumes to the weights of the
    same checkpoint under today's name, and hands its t on."""
    today = copy_run(run_dir, tmp_path)
    before = tmp_path / "before"
    shutil.copytree(run_dir, before)
    path = newest(before) / "state.json"
    state = json.loads(path.read_text())
    state["step"] = state.pop("adam_t")
    path.write_text(json.dumps(state))
    for out in (today, before):
        train.main([f"--out_dir={out}", "--resume", f"--tokens={3 * STEP_TOKENS}"])
    resumed = {out: load_file(out / "model.safetensors") for out in (today, before)}
    assert all(torch.equal(resumed[today][k], resumed[before][k]) for k in resumed[today])
    assert RunDir.open(str(before)).latest_state()["adam_t"] == 3
    path = newest(before) / "state.json"
    state = json.loads(path.read_text())
    state["step"] = state.pop("adam_t")
    path.write_text(json.dumps(state))
    train.main([f"--init_from={before}", f"--out_dir={tmp_path / 'decay'}", "--phase=decay", f"--tokens={STEP_TOKENS}"])
    assert RunDir.open(str(tmp_path / "decay")).latest_state()["adam_t"] == 4


def test_resume_continues_the_run_as_saved(run_dir, tmp_path, capsys):
    """--resume changes nothing that alters the numbers; a finished run says so and trains nothing."""
    out = copy_run(run_dir, tmp_path)
    fails(capsys, [f"--out_dir={out}", "--resume", "--phase=clm"], "--phase=clm", "'mlm'", "--init_from")
    fails(capsys, [f"--out_dir={out}", "--resume", "--lr=1e-2"], "--lr=0.01")
    before = (out / "model.safetensors").read_bytes()
    train.main([f"--out_dir={out}", "--resume"])
    printed = capsys.readouterr().out
    assert "done: phase mlm" in printed and "nan" not in printed
    assert (out / "model.safetensors").read_bytes() == before


def test_a_new_budget_that_would_change_a_step_already_run_is_refused(run_dir, tmp_path, capsys):
    """--resume --tokens continues a run as if it had that budget from the start: refused where a step already
    run would have had another learning rate (a decay's 1-sqrt depends on its budget at every step) and below the
    steps already run; the checkpoint is left as it was."""
    out = copy_run(run_dir, tmp_path)
    fails(capsys, [f"--out_dir={out}", "--resume", f"--tokens={STEP_TOKENS}"], "--tokens=512",
          "has trained 1,024 tokens (2 steps) already")
    decay = tmp_path / "decay"
    train.main([f"--init_from={out}", f"--out_dir={decay}", "--phase=decay", *SMALL, f"--tokens={2 * STEP_TOKENS}"])
    before = {p: p.read_bytes() for p in (decay / "checkpoints").rglob("*") if p.is_file()}
    fails(capsys, [f"--out_dir={decay}", "--resume", f"--tokens={4 * STEP_TOKENS}"], "--tokens=2,048",
          "1-sqrt schedule would give the step at token 512 the learning rate 0.0002402, and it ran at 5e-05",
          "constant; wsd before its decay", f"--init_from={decay}")
    assert {p: p.read_bytes() for p in (decay / "checkpoints").rglob("*") if p.is_file()} == before


def test_impossible_phase_chains_are_refused(run_dir, demo_corpus, tmp_path, capsys):
    decay = tmp_path / "decay"
    train.main([f"--init_from={run_dir}", f"--out_dir={decay}", "--phase=decay", *SMALL, f"--tokens={STEP_TOKENS}"])
    fails(capsys, [f"--init_from={decay}", f"--out_dir={tmp_path / 'again'}", "--phase=decay", *SMALL,
                   f"--tokens={STEP_TOKENS}"], "is a decay already")
    fails(capsys, [f"--init_from={run_dir}", f"--out_dir={tmp_path / 'short'}", "--phase=decay", *SMALL],
          "less than one optimizer step")  # 10% of a 2-step run is no step at all


def test_trailing_slash_is_the_same_run(demo_corpus, tmp_path):
    train.main([f"--data={demo_corpus}", f"--out_dir={tmp_path / 'run'}/", *SMALL, f"--tokens={2 * STEP_TOKENS}",
                "--max_steps=1"])
    train.main([f"--out_dir={tmp_path / 'run'}/", "--resume"])
    assert RunDir.open(str(tmp_path / "run")).latest_state()["phase_step"] == 2


def test_a_mistyped_flag_is_answered_before_torch_is_imported(tmp_path):
    """train.py checks its flags against its Config's source before it imports torch (seconds, a minute on a busy
    machine): a torch that cannot be imported does not stand in the way of the answer; right flags go on to it."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise SystemExit('torch was imported')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    for flags, said in ((["--tokns=500k"], "error: unknown flag --tokns; did you mean --tokens? (python train.py "
                                           "--help lists them all)"),
                        (["--tokens=500k", "--lr=fast"], "error: --lr='fast' is not a valid float"),
                        (["--tokens=500k"], "torch was imported")):
        result = subprocess.run([sys.executable, str(ROOT / "train.py"), *flags], capture_output=True, text=True,
                                env=env, cwd=tmp_path)
        assert result.stderr.strip() == said and result.returncode == (1 if said.startswith("torch") else 2)


@pytest.mark.parametrize("argv", [["train.py", "--tokens=500k"], ["data.py", "docstrings", "--out", "d.jsonl"],
                                  ["eval.py", "curves", "out/run"]], ids=["train.py", "data.py", "eval.py"])
def test_ctrl_c_while_torch_is_imported_is_one_line(argv, tmp_path):
    """Ctrl-C after the flags are checked, while the script imports torch (seconds, a minute on a busy machine):
    one line and exit status 130, as a stop during the run is, not the traceback of the module that was loading."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("import sys, time\nprint('importing', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, str(ROOT / argv[0]), *argv[1:]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(tmp_path)},
                            cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline() == "importing\n"
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (130, "stopped by SIGINT\n")


def test_none_is_no_tracker_as_hugging_face_says_it():
    from machinery import tracking
    assert tracking.names("none") == [] and tracking.where("none", "out/run") == []


def test_traceback_free_at_the_process_level(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--lr=-1", f"--out_dir={tmp_path}"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip() == "error: --lr=-1.0: expected a positive finite learning rate"


# ---- faults -------------------------------------------------------------------------------------------


def test_nan_gradient_stops_before_the_update_and_keeps_the_checkpoint(demo_corpus, tmp_path, capsys, monkeypatch):
    """A finite loss with a NaN gradient (injected at step 2) is caught before the update: nothing is saved."""
    out = tmp_path / "run"
    flags = [f"--data={demo_corpus}", f"--out_dir={out}", *with_small("--save_interval=1"), f"--tokens={8 * STEP_TOKENS}"]
    real, steps = train.freeze.zero_frozen_grads, []

    def poisoned(model, names):  # runs after each backward, before the norm check
        real(model, names)
        steps.append(1)
        if len(steps) == 2:
            model.model.layers[1].mlp.Wi.weight.grad[0, 0] = float("nan")
    monkeypatch.setattr(train.freeze, "zero_frozen_grads", poisoned)
    with pytest.raises(InputError, match="gradient norm nan at step 2"):
        train.main(flags)
    assert newest(out).name == "step-00000001"
    tensors = {**load_file(out / "model.safetensors"), **load_file(newest(out) / "optimizer.safetensors")}
    assert all(torch.isfinite(t).all() for t in tensors.values())


def test_a_non_finite_weight_is_never_saved(demo_corpus, tmp_path, capsys, monkeypatch):
    """Weights that turn infinite in an update (injected at step 2) are refused by the save that follows."""
    out = tmp_path / "run"
    real = train.AdamW.step

    def overflowing(self, lr):
        real(self, lr)
        if self.t == 2:
            next(iter(self.moments.values()))[0].fill_(float("inf"))
    monkeypatch.setattr(train.AdamW, "step", overflowing)
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={out}", *with_small("--save_interval=1"),
                   f"--tokens={8 * STEP_TOKENS}"], "non-finite", "step-00000001")
    assert newest(out).name == "step-00000001"
    tensors = {**load_file(out / "model.safetensors"), **load_file(newest(out) / "optimizer.safetensors")}
    assert all(torch.isfinite(t).all() for t in tensors.values())


def test_a_real_full_disk_keeps_the_previous_checkpoint(demo_corpus, small_disk, capsys):
    """A tmpfs with room for one checkpoint and the published model: the second save fails with one line,
    the first checkpoint stays complete, nothing temporary is left."""
    out = small_disk("18m") / "run"
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={out}", *with_small("--save_interval=1"),
                   f"--tokens={4 * STEP_TOKENS}"], "could not write the checkpoint", "intact")
    assert newest(out).name == "step-00000001"
    leftovers = [p for p in out.rglob("*") if ".tmp" in p.name]
    assert not leftovers, leftovers
    assert RunDir.open(str(out)).latest_state()["phase_step"] == 1


class Killed(BaseException):
    """A kill -9 at a chosen point: nothing after it runs (BaseException: no handler in train.py catches it)."""


# (module, function, call): die at that call, counted from the second save of a run, then again in its resume.
PROTOCOL_POINTS = [(os, "replace", 1), (os, "replace", 5), (os, "rename", 1), (os, "rename", 2),
                   (rundir, "_fsync", 3), (os, "remove", 1)]


def arm_kill(owner, name, patch, die_at, after_saves):
    """Wrap owner.name to raise Killed at its call number die_at, counting only once `after_saves` saves
    have started."""
    real, real_save, calls, saves = getattr(owner, name), RunDir.save, [], []

    def wrapper(*args, **kwargs):
        if len(saves) >= after_saves:
            calls.append(1)
            if len(calls) == die_at:
                raise Killed
        return real(*args, **kwargs)

    def counted_save(self, *args, **kwargs):
        saves.append(1)
        return real_save(self, *args, **kwargs)
    patch.setattr(owner, name, wrapper)
    patch.setattr(RunDir, "save", counted_save)


def killed(argv):
    """train.main(argv), perhaps killed; the dead run's frames (and so its lock) are released, as at exit."""
    try:
        train.main(argv)
    except Killed as e:
        e.__traceback__ = None
    gc.collect()


def protocol_flags(demo_corpus):
    return [f"--data={demo_corpus}", *with_small("--save_interval=1"), f"--tokens={4 * STEP_TOKENS}", "--keep=2"]


@pytest.fixture(scope="module")
def never_interrupted(demo_corpus, tmp_path_factory):
    """The weights of the protocol's run never interrupted (one run for every kill point)."""
    out = tmp_path_factory.mktemp("straight")
    train.main([*protocol_flags(demo_corpus), f"--out_dir={out}"])
    return load_file(out / "model.safetensors")


@pytest.mark.parametrize("owner, function, call", PROTOCOL_POINTS,
                         ids=[f"{o.__name__}.{f}#{n}" for o, f, n in PROTOCOL_POINTS])
def test_kill_at_each_point_of_the_save_resumes_bit_identically(owner, function, call, demo_corpus, tmp_path,
                                                                  monkeypatch, never_interrupted):
    """Kill inside the second save, then again in the resumed run's first save: --resume still finds the
    newest complete checkpoint and ends with the weights of a run never interrupted."""
    flags, out = protocol_flags(demo_corpus), tmp_path / "run"
    for argv, after in (([*flags, f"--out_dir={out}"], 2), ([f"--out_dir={out}", "--resume"], 1)):
        with monkeypatch.context() as patch:
            arm_kill(owner, function, patch, call, after)
            killed(argv)
    train.main([f"--out_dir={out}", "--resume"])
    resumed = load_file(out / "model.safetensors")
    assert all(torch.equal(never_interrupted[k], resumed[k]) for k in never_interrupted)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # nothing beside the run
    assert not [p for p in out.rglob("*") if ".tmp" in p.name]
    assert [r["step"] for r in map(json.loads, open(out / "log.jsonl")) if "loss" in r] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_with_a_message(demo_corpus, tmp_path):
    """SIGSTOP one of two processes mid-run: the other gives up after --ddp_timeout and the job ends."""
    (tmp_path / "data").mkdir()
    os.symlink(demo_corpus, tmp_path / "data" / "demo")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"),
           "--phase=clm", "--ddp_timeout=5", "--log_interval=1"]
    job = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in job.stdout:
        if line.startswith("clm step 3/"):
            break
    ranks = subprocess.run(["pgrep", "-f", str(ROOT / "train.py")], capture_output=True, text=True).stdout.split()
    stopped = [p for p in ranks if "RANK=1" in open(f"/proc/{p}/environ").read().split("\0")]
    assert len(stopped) == 1
    os.kill(int(stopped[0]), signal.SIGSTOP)
    out = job.stdout.read()
    job.wait()
    assert job.returncode != 0 and "error: rank 0: another process did not answer within --ddp_timeout" in out


def test_a_hand_off_killed_before_its_first_checkpoint_logs_its_step_0_once(run_dir, tmp_path, monkeypatch, capsys):
    """Killed in its first save, a hand-off leaves a run with no checkpoint, whose log holds its step-0 validation
    and its first steps: the rerun starts the run over, log and all, so that its log, curve and card hold each
    step once, as a run never killed does."""
    argv = [f"--init_from={run_dir}", "--phase=decay", *with_small("--save_interval=1"), f"--tokens={2 * STEP_TOKENS}"]
    train.main([*argv, f"--out_dir={tmp_path / 'straight'}"])
    out = tmp_path / "decay"
    with monkeypatch.context() as patch:
        arm_kill(rundir, "_fsync", patch, 1, 1)  # inside the first save: no checkpoint yet
        killed([*argv, f"--out_dir={out}"])
    assert RunDir.open(str(out)).latest_state() is None
    assert [r["step"] for r in map(json.loads, open(out / "log.jsonl")) if "val_mlm" in r] == [0]
    train.main([*argv, f"--out_dir={out}"])

    def steps(run):
        return [(r["step"], "val_mlm" in r) for r in map(json.loads, open(run / "log.jsonl"))]
    assert steps(out) == steps(tmp_path / "straight") == [(0, True), (1, False), (2, False), (2, True)]
    assert capsys.readouterr().out.count("decay step 0 (before the first step)") == 3


def test_a_schedule_flag_is_refused_where_the_schedule_does_not_read_it_as_written(monkeypatch):
    """Which flags a schedule reads is found by calling its shape as written: a shape added to SCHEDULES that reads
    final_lr_frac takes --final_lr_frac, and the constant schedule, which reads none, still refuses it, naming the
    new shape among those that read it; --tokens and --schedule_tokens (the budget) are every schedule's."""
    monkeypatch.setitem(train.SCHEDULES, "cosine", lambda t, end, cfg: cfg.final_lr_frac + (1 - cfg.final_lr_frac) * (
        1 + math.cos(math.pi * min(1.0, t / end))) / 2)

    def check(*argv):
        given, _ = flag_rules.parse(list(argv), train.Config)
        flag_rules.check_schedule_flags(train.resolve_config(given), given, train.SCHEDULES)

    check("--schedule=cosine", "--final_lr_frac=0.2", "--tokens=1e6", "--schedule_tokens=2e6")
    with pytest.raises(InputError, match=r"^--final_lr_frac=0.2 changes nothing: the constant schedule does not "
                                         r"read it \(1-sqrt, wsd and cosine do"):
        check("--final_lr_frac=0.2")
