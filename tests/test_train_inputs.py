"""train.py on bad input and under faults: every mistake is one line `error: ...` naming the flag or file,
exit status 2, no traceback, before any compute; no fault loses or poisons a checkpoint."""
import errno
import gc
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

import train
from conftest import ROOT

SMALL = ["--preset=tiny", "--seq_len=128", "--batch_size=4", "--micro_batch_size=2", "--eval_sequences=2",
         "--eval_interval=1000", "--log_interval=1000", "--save_interval=0", "--warmup_tokens=1024", "--lr=1e-3",
         "--threads=1"]
STEP_TOKENS = 4 * 128


def fails(capsys, argv, *words):
    """Run the command line as `python train.py` would; assert exit 2 and one `error:` line holding `words`."""
    with pytest.raises(SystemExit) as exit_info:
        train.cli(argv)
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
    dst = tmp_path / "copy"
    shutil.copytree(run_dir, dst)
    if edit:
        edit(dst)
    return dst


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
    (["--backend=xformers"], ["--backend='xformers'"]),
    (["--batch_size=5"], ["--batch_size=5", "--micro_batch_size"]),
    (["--recipe=paper", "--init_from=/nonexistent/run"], ["--init_from=/nonexistent/run", "no such directory"]),
    (["--recipe=paper", "--init_from=./missing"], ["--init_from=./missing", "no such directory"]),
    (["--resume"], ["--resume"]),
    (["stray"], ["'stray'"]),
    (["--unknown=1"], ["--unknown"]),
]
if not torch.cuda.is_available():
    BAD_FLAGS.append((["--device=cuda"], ["--device=cuda", "not available"]))


@pytest.mark.parametrize("flags, words", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_before_any_compute(flags, words, demo_corpus, tmp_path, capsys):
    out = tmp_path / "out"
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={out}", *SMALL, *flags], *words)
    assert not (out / "model.safetensors").exists()


def test_demo_recipe_refuses_a_pretrained_start(tmp_path, capsys):
    (tmp_path / "hf").mkdir()
    fails(capsys, [f"--init_from={tmp_path / 'hf'}", f"--out_dir={tmp_path / 'o'}"], "--recipe=demo", "--recipe=paper")


# Broken files: (what to break in a copy of a finished run, words of the message). The copy is --init_from.
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


BAD_RUNS = [
    ("truncated model", truncate("model.safetensors"), ["--init_from", "incomplete"]),
    ("truncated optimizer", truncate("optimizer.safetensors"), ["--init_from", "incomplete"]),
    ("garbage state.json", rewrite("state.json", "{not json"), ["--init_from", "incomplete or unreadable"]),
    ("state.json without loader", edit_json("state.json", lambda s: s.pop("loader")), ["--init_from", "incomplete"]),
]


@pytest.mark.parametrize("name, edit, words", BAD_RUNS, ids=[b[0] for b in BAD_RUNS])
def test_broken_start_run_is_named(name, edit, words, run_dir, demo_corpus, tmp_path, capsys):
    start = copy_run(run_dir, tmp_path, edit)
    fails(capsys, [f"--init_from={start}", f"--out_dir={tmp_path / 'out'}", "--phase=decay", *SMALL], *words, str(start))


# A Hugging Face directory (no state.json) with broken files: the file itself is named.
BAD_CHECKPOINTS = [
    ("truncated weights", truncate("model.safetensors"), ["model.safetensors", "cannot load"]),
    ("garbage config.json", rewrite("config.json", "[1, 2"), ["config.json"]),
    ("vocab of 4e9", edit_json("config.json", lambda c: c.update(vocab_size=4_000_000_000)), ["config.json"]),
]


@pytest.mark.parametrize("name, edit, words", BAD_CHECKPOINTS, ids=[b[0] for b in BAD_CHECKPOINTS])
def test_broken_hugging_face_checkpoint_is_named(name, edit, words, run_dir, demo_corpus, tmp_path, capsys):
    start = copy_run(run_dir, tmp_path, edit)
    for ours in ("state.json", "optimizer.safetensors", train.MARKER):
        (start / ours).unlink()
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


def test_out_dir_that_is_a_file_or_foreign_folder(demo_corpus, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    fails(capsys, [f"--data={demo_corpus}", f"--out_dir={tmp_path / 'file'}", *SMALL], "--out_dir", "file")
    for foreign in ("mine", "mine.old", "mine.tmp"):  # folders a user made are never deleted nor trained into
        (tmp_path / foreign).mkdir()
        (tmp_path / foreign / "notes.txt").write_text("keep me")
        fails(capsys, [f"--data={demo_corpus}", f"--out_dir={tmp_path / 'mine'}", *SMALL], "not written by train.py")
        assert (tmp_path / foreign / "notes.txt").read_text() == "keep me"
        shutil.rmtree(tmp_path / foreign)


def test_second_writer_is_refused(demo_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    with open(f"{out}.lock", "a+") as held:  # what a running train.py holds
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fails(capsys, [f"--data={demo_corpus}", f"--out_dir={out}", *SMALL, f"--tokens={STEP_TOKENS}"],
              "another train.py", "run.lock")
    train.main([f"--data={demo_corpus}", f"--out_dir={out}", *SMALL, f"--tokens={STEP_TOKENS}"])  # released: runs


def test_trailing_slash_is_the_same_run(demo_corpus, tmp_path):
    train.main([f"--data={demo_corpus}", f"--out_dir={tmp_path / 'run'}/", *SMALL, f"--tokens={2 * STEP_TOKENS}",
                "--max_steps=1"])
    train.main([f"--out_dir={tmp_path / 'run'}/", "--resume"])
    assert json.loads((tmp_path / "run" / "state.json").read_text())["phase_step"] == 2


def test_traceback_free_at_the_process_level(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--lr=-1", f"--out_dir={tmp_path}"],
                            capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.strip() == "error: --lr=-1.0: expected a positive finite learning rate"


# ---- faults -------------------------------------------------------------------------------------------


def test_nan_gradient_stops_before_the_update_and_keeps_the_checkpoint(demo_corpus, tmp_path, capsys, monkeypatch):
    """A finite loss with a NaN gradient (injected at step 2) is caught before the update: nothing is saved."""
    out = tmp_path / "run"
    flags = [f"--data={demo_corpus}", f"--out_dir={out}", *SMALL, f"--tokens={8 * STEP_TOKENS}", "--save_interval=1"]
    real, steps = train.freeze.zero_frozen_grads, []

    def poisoned(model, names):  # runs after each backward, before the norm check
        real(model, names)
        steps.append(1)
        if len(steps) == 2:
            model.model.layers[1].mlp.Wi.weight.grad[0, 0] = float("nan")
    monkeypatch.setattr(train.freeze, "zero_frozen_grads", poisoned)
    with pytest.raises(train.TrainError, match="gradient norm nan at step 2"):
        train.main(flags)
    assert json.loads((out / "state.json").read_text())["phase_step"] == 1
    tensors = {**load_file(out / "model.safetensors"), **load_file(out / "optimizer.safetensors")}
    assert all(torch.isfinite(t).all() for t in tensors.values())


def test_exploding_run_never_writes_a_non_finite_checkpoint(demo_corpus, tmp_path, capsys):
    out = tmp_path / "run"
    train.main([f"--data={demo_corpus}", f"--out_dir={out}", *SMALL, f"--tokens={8 * STEP_TOKENS}", "--max_steps=1"])
    fails(capsys, [f"--out_dir={out}", "--resume", "--lr=1e30", "--save_interval=1"], "non-finite", "kept")
    tensors = {**load_file(out / "model.safetensors"), **load_file(out / "optimizer.safetensors")}
    assert all(torch.isfinite(t).all() for t in tensors.values())


def test_disk_full_during_a_save_keeps_the_previous_checkpoint(demo_corpus, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    train.main([f"--data={demo_corpus}", f"--out_dir={out}", *SMALL, f"--tokens={4 * STEP_TOKENS}", "--max_steps=1"])
    before = (out / "model.safetensors").read_bytes()

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(train, "fsync_file", full)
    fails(capsys, [f"--out_dir={out}", "--resume"], "No space left on device", "kept as it was")
    assert (out / "model.safetensors").read_bytes() == before and not (tmp_path / "run.tmp").exists()


class Killed(BaseException):
    """A kill -9 at a chosen point: nothing after it runs (BaseException: no handler in train.py catches it)."""


PROTOCOL_POINTS = [("rename", 1), ("rename", 2), ("remove_run_dir", 1), ("remove_run_dir", 3), ("write_json", 1),
                   ("fsync_file", 2)]


def counting(owner, name, monkeypatch, die_at=None):
    """Wrap owner.name: count its calls, and raise Killed at call number die_at."""
    real, calls = getattr(owner, name), []

    def wrapper(*args, **kwargs):
        calls.append(1)
        if len(calls) == die_at:
            raise Killed
        return real(*args, **kwargs)
    monkeypatch.setattr(owner, name, wrapper)
    return calls


def killed(argv):
    """train.main(argv) dies of Killed; the dead run's frames (and so its lock on OUT) are released, as at exit."""
    with pytest.raises(Killed) as info:
        train.main(argv)
    info.value.__traceback__ = None
    del info
    gc.collect()


@pytest.mark.parametrize("function, call", PROTOCOL_POINTS, ids=[f"{f}#{n}" for f, n in PROTOCOL_POINTS])
def test_kill_at_each_point_of_the_save_resumes_bit_identically(function, call, demo_corpus, tmp_path, monkeypatch):
    """Kill inside the second save, then again early in the resumed run (its recovery or first save): --resume
    still finds the newest complete checkpoint and ends with the weights of a run never interrupted."""
    flags = [f"--data={demo_corpus}", *SMALL, f"--tokens={4 * STEP_TOKENS}", "--save_interval=1"]
    owner = train.os if function == "rename" else train
    with monkeypatch.context() as patch:
        calls = counting(owner, function, patch)
        train.main([*flags, f"--out_dir={tmp_path / 'straight'}"])  # 4 steps, 4 saves
    per_save = len(calls) // 4
    out = tmp_path / "run"
    for argv, die_at in (([*flags, f"--out_dir={out}"], per_save + call), ([f"--out_dir={out}", "--resume"], call)):
        with monkeypatch.context() as patch:
            counting(owner, function, patch, die_at=die_at)
            killed(argv)
    train.main([f"--out_dir={out}", "--resume"])
    straight, resumed = load_file(tmp_path / "straight" / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "run.lock", "straight", "straight.lock"]
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
