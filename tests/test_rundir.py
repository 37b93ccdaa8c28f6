"""The run-directory protocol: a save touches only what it wrote, survives a kill at every system call and a
real full disk, and every field of state.json is checked before it is trusted."""
import base64
import copy
import errno
import functools
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, source_copy, tiny_model
from safetensors.torch import load_file

import data
from machinery import rundir
from machinery.cli import InputError
from machinery.rundir import GracefulStop, RunDir, validate_state

PHASES = ("mlm", "clm", "decay")
FIELDS = {"lr": "float", "seed": "int", "recipe": "str", "compile": "bool"}
TOP_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@functools.lru_cache(maxsize=None)
def small_model(step):
    """A one-block model whose weights say which step saved them (built once per step; a save only reads it)."""
    model = tiny_model(num_hidden_layers=1, hidden_size=64, intermediate_size=96, num_attention_heads=2)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(step)
    return model


def moments(model, step):
    """Adam's moments as the optimizer holds them: {name: (m, v)}."""
    gen = torch.Generator().manual_seed(step)
    return {n: (torch.randn(p.shape, generator=gen), torch.rand(p.shape, generator=gen))
            for n, p in model.named_parameters()}


def make_state(step, phase="mlm"):
    return dict(phase=phase, adam_t=step + 10, phase_step=step, phase_tokens=step * 64, total_tokens=step * 64 + 100,
                schedule_tokens_done=step * 64, loader={"sequence": step * 4, "split": "train", "data_seed": 42},
                rng=[rundir.rng_state(torch.device("cpu"))], config={"lr": 2e-3, "seed": 17, "recipe": "demo",
                                                                    "compile": False},
                code={"git": None, "sha256": "0" * 16, "versions": {"python": "3.11.7", "torch": "2.13.0+cpu"}},
                tokenizer="bytes",
                history=[{"phase": "clm", "tokens": 100, "dir": "out/clm"}])


TOKENIZER = data.load_tokenizer("bytes")


def save(run, step, keep=3):
    model = small_model(step)
    return run.save(model, moments(model, step), make_state(step), TOKENIZER, keep)


def tree(path):
    """{relative path: sha256} of every file under path."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
    return out


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def leftovers(run):
    """Anything of a save's temporary names still in the run: .tmp folders under checkpoints, staged files."""
    names = os.listdir(run.checkpoints) if os.path.isdir(run.checkpoints) else []
    return [n for n in names if n.startswith(".tmp")] + [n for n in os.listdir(run.path) if ".tmp" in n]


def check_checkpoint(state, step):
    """The checkpoint in state["dir"] is the one `save(run, step)` wrote, tensor for tensor."""
    assert state["phase_step"] == step
    model = small_model(step)
    weights = load_file(os.path.join(state["dir"], "model.safetensors"))
    for name, p in model.state_dict().items():
        if name in weights:
            assert torch.equal(weights[name], p), name
    optimizer = load_file(os.path.join(state["dir"], "optimizer.safetensors"))
    want = rundir.moment_tensors(moments(model, step))
    assert optimizer.keys() == want.keys() and len(want) == 2 * len(dict(model.named_parameters()))
    assert all(torch.equal(optimizer[k], v) for k, v in want.items())


# ---- ownership: what a save and a resume may touch ---------------------------------------------------------


def test_user_files_backups_and_foreign_folders_are_never_touched(tmp_path):
    out, backup, other = tmp_path / "run", tmp_path / "run.old", tmp_path / "other"
    run = RunDir.create(str(out))
    (out / "README.md").write_text("my notes")
    (out / "eval").mkdir()
    (out / "eval" / "scores.txt").write_text("0.9")
    (out / "results.json").write_text("{}")
    save(run, 1)
    shutil.copytree(out, backup)  # cp -r run run.old: the same run_id, every checkpoint marker included
    shutil.copytree(save(RunDir.create(str(other)), 99), out / "checkpoints" / "step-00000099")  # another run's
    (out / "checkpoints" / "step-00000098").mkdir()  # and a folder without a marker
    os.symlink(backup / "checkpoints" / "step-00000001", out / "checkpoints" / "step-00000097")  # a link to ours
    (out / "checkpoints" / "step-00000098" / "state.json").write_text(json.dumps(make_state(98)))
    user = ("README.md", "eval/scores.txt", "results.json", "run.json", "checkpoints/step-00000098/state.json",
            *(f"checkpoints/step-00000099/{name}" for name in os.listdir(out / "checkpoints" / "step-00000099")))
    before, before_backup = tree(out), tree(backup)
    for step in (2, 3, 4):
        save(run, step, keep=2)
        check_checkpoint(RunDir.open(str(out)).latest_state(), step)
    after = tree(out)
    assert {k: after.get(k) for k in user} == {k: before[k] for k in user}
    assert sorted(os.listdir(out / "checkpoints")) == [f"step-{s:08d}" for s in (3, 4, 97, 98, 99)]
    assert tree(backup) == before_backup
    assert RunDir.open(str(backup)).latest_state()["dir"] == str(backup / "checkpoints" / "step-00000001")
    # a different run trained into run.old is never adopted by run
    shutil.rmtree(backup)
    stranger = RunDir.create(str(backup))
    save(stranger, 500)
    assert stranger.run_id != run.run_id
    assert RunDir.open(str(out)).latest_state()["phase_step"] == 4
    assert sorted(os.listdir(tmp_path)) == ["other", "run", "run.old"]


def test_a_foreign_folder_at_the_name_of_our_step_is_left_alone(tmp_path):
    run = RunDir.create(str(tmp_path / "run"))
    save(run, 1)
    foreign = tmp_path / "run" / "checkpoints" / "step-00000002"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    folder = save(run, 2)
    assert folder != str(foreign) and (foreign / "notes.txt").read_text() == "mine"
    check_checkpoint(run.latest_state(), 2)


def test_a_checkpoint_the_user_renamed_is_theirs(tmp_path):
    run = RunDir.create(str(tmp_path / "run"))
    os.rename(save(run, 5), run.checkpoints + "/best")  # kept aside by hand: never pruned, never resumed from
    before = tree(run.checkpoints + "/best")
    assert run.latest_state() is None
    for step in (1, 2):
        save(run, step, keep=1)
    assert tree(run.checkpoints + "/best") == before and run.latest_state()["phase_step"] == 2


def test_user_files_inside_a_pruned_checkpoint_survive(tmp_path):
    run = RunDir.create(str(tmp_path / "run"))
    first = save(run, 1)
    with open(os.path.join(first, "eval.json"), "w") as f:
        f.write("{}")
    save(run, 2, keep=1)
    assert os.listdir(first) == ["eval.json"]  # our files gone, the marker too: the folder is the user's now
    save(run, 3, keep=1)
    assert os.listdir(first) == ["eval.json"]


@pytest.mark.parametrize("keep, steps, kept", [(1, 4, [4]), (2, 5, [4, 5]), (3, 2, [1, 2]), (3, 5, [3, 4, 5])])
def test_keep_prunes_to_the_newest(tmp_path, keep, steps, kept):
    run = RunDir.create(str(tmp_path / "run"))
    for step in range(1, steps + 1):
        save(run, step, keep=keep)
    assert sorted(os.listdir(run.checkpoints)) == [f"step-{s:08d}" for s in kept]
    for name in TOP_FILES:  # OUT's Hugging Face files are the newest checkpoint's
        assert digest(f"{run.path}/{name}") == digest(f"{run.checkpoints}/step-{steps:08d}/{name}"), name
    assert shared_inodes(run.path) == []


@pytest.mark.parametrize("keep", [0, -1, 1.5, "2", True])
def test_keep_below_one_is_refused(tmp_path, keep):
    run = RunDir.create(str(tmp_path / "run"))
    with pytest.raises(InputError, match="--keep"):
        save(run, 1, keep=keep)
    assert not os.path.exists(run.checkpoints)


def test_saving_a_step_again_replaces_only_our_folder(tmp_path):
    run = RunDir.create(str(tmp_path / "run"))
    save(run, 1)
    model = small_model(7)
    run.save(model, moments(model, 7), make_state(1), TOKENIZER, keep=3)
    assert os.listdir(run.checkpoints) == ["step-00000001"]
    weights = load_file(os.path.join(run.checkpoints, "step-00000001", "model.safetensors"))
    assert all(torch.equal(weights[n], p) for n, p in model.state_dict().items() if n in weights)


def shared_inodes(path):
    """The files under path that have another name anywhere (a hard link): none, in a run directory."""
    return [os.path.relpath(os.path.join(root, name), path) for root, _, names in os.walk(path) for name in names
            if os.stat(os.path.join(root, name)).st_nlink != 1]


# ---- OUT's Hugging Face files are the user's: nothing done to them reaches a checkpoint ----------------------

SMOKE = ["--phase=mlm", "--preset=tiny", "--seq_len=128", "--batch_size=4", "--micro_batch_size=2",
         "--compile=false", "--eval_interval=1000", "--eval_sequences=2", "--log_interval=1000", "--save_interval=1",
         "--warmup_tokens=1024", "--lr=1e-3", "--grad_clip=0", "--threads=1", f"--tokens={4 * 4 * 128}"]


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """(a run of 4 tiny steps, the same run stopped after its checkpoint at step 2): train.py on a byte corpus."""
    import train
    tmp = tmp_path_factory.mktemp("user")
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i}: " + "some words here " * (i % 7 + 3)}) + "\n"
                              for i in range(300)))
    data.prepare([corpus], "bytes", tmp / "data", val_fraction=0.1, workers=1)
    for name, extra in (("straight", []), ("stopped", ["--max_steps=2"])):
        train.main([f"--data={tmp / 'data'}", f"--out_dir={tmp / name}", *SMOKE, *extra])
    return tmp / "straight", tmp / "stopped"


def edit_in_place(out):
    """As an editor that keeps hard links writes (vim does): the same inode, rewritten."""
    for name in TOP_FILES[1:]:
        with open(out / name, "r+b") as f:
            f.seek(os.path.getsize(out / name) // 2)
            f.write(b"edited")  # the model: same size, other bytes
    with open(out / "config.json", "r+") as f:
        config = json.load(f)
        f.seek(0)
        json.dump({**config, "note": "fine-tuned by hand"}, f, indent=4)
        f.truncate()


def replace(out):
    for name in TOP_FILES:
        (out / f"{name}.new").write_text("{}")
        os.replace(out / f"{name}.new", out / name)


def delete(out):
    for name in TOP_FILES:
        os.remove(out / name)


def keep_elsewhere(out):
    """The user keeps the published files in a folder of theirs: the model by a hard link, config.json as their own
    file that the run's name now points to."""
    mine = out.parent / "mine"
    mine.mkdir()
    os.link(out / "model.safetensors", mine / "model.safetensors")
    (mine / "config.json").write_text('{"mine": true}')
    os.remove(out / "config.json")
    os.symlink(mine / "config.json", out / "config.json")


def ours_save_pretrained(out):
    from model import ModernBERT
    model = ModernBERT.from_pretrained(str(out))
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    model.save_pretrained(str(out))


def transformers_save_pretrained(out):
    """What a Hugging Face user does: load the run, change it, save it back over the same folder (in place)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForMaskedLM.from_pretrained(str(out))
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    model.save_pretrained(str(out))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    tokenizer.add_tokens(["<extra>"])
    tokenizer.save_pretrained(str(out))


@pytest.mark.parametrize("action", [edit_in_place, replace, delete, keep_elsewhere, ours_save_pretrained,
                                    transformers_save_pretrained], ids=lambda f: f.__name__)
def test_what_a_user_does_to_the_top_level_files_never_reaches_a_checkpoint(stopped_run, tmp_path, action):
    import train
    straight, stopped = stopped_run
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    before, state = tree(out / "checkpoints"), RunDir.open(str(out)).latest_state()
    assert shared_inodes(out) == [] and state["phase_step"] == 2
    action(out)
    assert tree(out / "checkpoints") == before  # every checkpoint as it was saved
    assert RunDir.open(str(out)).latest_state() == state
    mine = tree(tmp_path / "mine")  # what the user keeps outside the run, if anything
    train.main([f"--out_dir={out}", "--resume"])
    assert tree(tmp_path / "mine") == mine  # a save replaces the run's names, never what they point to
    expected, resumed = load_file(straight / "model.safetensors"), load_file(out / "model.safetensors")
    assert expected.keys() == resumed.keys() and all(torch.equal(expected[k], resumed[k]) for k in expected)
    newest = RunDir.open(str(out)).latest_state()["dir"]
    assert all(digest(out / name) == digest(os.path.join(newest, name)) for name in TOP_FILES)
    assert shared_inodes(out) == []


def test_a_folder_of_the_user_at_a_top_level_name_stops_the_save_and_is_kept(tmp_path):
    run = RunDir.create(str(tmp_path / "run"))
    save(run, 1)
    os.remove(tmp_path / "run" / "model.safetensors")
    (tmp_path / "run" / "model.safetensors").mkdir()
    (tmp_path / "run" / "model.safetensors" / "mine.txt").write_text("mine")
    before = tree(tmp_path / "run")
    with pytest.raises(InputError) as e:
        save(run, 2)
    assert f"{run.path}/model.safetensors: Is a directory; the previous checkpoint " in str(e.value)
    assert tree(tmp_path / "run") == before and leftovers(run) == []


@pytest.mark.parametrize("how", ["copies", *sorted(errno.errorcode[e] for e in rundir.NO_COPY_FILE_RANGE),
                                 "stops part way", "absent"])
def test_a_copy_is_a_file_of_its_own_whatever_the_file_system_supports(tmp_path, monkeypatch, how):
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.write_bytes(os.urandom(3 << 20))
    real, calls = os.copy_file_range, [0]

    def partial(fd_in, fd_out, count, *args):
        calls[0] += 1
        return real(fd_in, fd_out, min(count, 1 << 20)) if calls[0] == 1 else 0
    if how == "absent":
        monkeypatch.delattr(os, "copy_file_range")
    elif how == "stops part way":
        monkeypatch.setattr(os, "copy_file_range", partial)
    elif how != "copies":
        code = getattr(errno, how)
        monkeypatch.setattr(os, "copy_file_range", lambda *a: (_ for _ in ()).throw(OSError(code, how)))
    rundir._copy(str(src), str(dst))
    assert dst.read_bytes() == src.read_bytes() and os.stat(dst).st_ino != os.stat(src).st_ino
    dst.write_bytes(b"edited")
    assert len(src.read_bytes()) == 3 << 20


# ---- the model card: rewritten at each save while it is ours, the user's once edited ------------------------


def test_the_model_card_is_ours_until_the_user_touches_it(tmp_path):
    run = RunDir.create(str(tmp_path / "run"))
    card = tmp_path / "run" / "README.md"
    assert run.write_card("---\nlibrary_name: transformers\n---\n\n# one") and rundir.card_is_ours(str(card))
    assert card.read_text().startswith("---\nlibrary_name: transformers\n---\n\n# one\n<!-- written by train.py")
    assert run.write_card("# two") and card.read_text() == mark_of("# two")  # ours: rewritten
    for edit in (lambda t: t.replace("two", "mine"),  # a word changed above the mark
                 lambda t: t + "my notes below the mark\n",  # the mark no longer last
                 lambda t: t.splitlines()[0] + "\n"):  # the mark removed
        card.write_text(edit(card.read_text()))
        edited = card.read_text()
        assert not run.write_card("# three") and card.read_text() == edited
        os.remove(card)
        assert run.write_card("# two")  # a card deleted is written again
    os.remove(card)
    (tmp_path / "notes.md").write_text("# my card")
    os.symlink(tmp_path / "notes.md", card)  # a link to a card of the user's, even one with our mark
    assert not run.write_card("# four") and (tmp_path / "notes.md").read_text() == "# my card"
    os.remove(card)
    card.mkdir()
    assert not run.write_card("# five") and os.listdir(card) == [] and leftovers(run) == []


def mark_of(text):
    """The card a save writes for `text`: the text, then our mark with the sha256 of the text."""
    return text + "\n" + rundir.CARD_MARK.format(hashlib.sha256((text + "\n").encode()).hexdigest()) + "\n"


def front_matter(card):
    """The YAML front matter of a model card as a dict (PyYAML when installed, else its key: value lines)."""
    head = card.split("---\n")[1]
    try:
        import yaml
        return yaml.safe_load(head)
    except ImportError:
        meta, key = {}, None
        for line in head.splitlines():
            if line.startswith("- "):
                meta[key].append(json.loads(line[2:]))
            else:
                key, _, value = line.partition(": ")
                key = key.rstrip(":")
                meta[key] = json.loads(value) if value else []
        return meta


def test_a_run_writes_a_model_card_that_the_hub_reads_and_leaves_an_edited_one(stopped_run, tmp_path, capsys):
    """Each save writes OUT/README.md in Hugging Face's format from the run: front matter (YAML) with the flags'
    license, language and base model, the chain of phases, the data, the last validation losses and the command
    that continues the run. An edited card survives the next saves, and transformers still loads the folder."""
    import train
    _, stopped = stopped_run
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    train.main([f"--out_dir={out}", "--resume", "--max_steps=1", "--license=apache-2.0", "--language=en,de",
                "--base_model=answerdotai/ModernBERT-base", "--eval_interval=1"])
    card = (out / "README.md").read_text()
    meta = front_matter(card)
    assert meta == {"library_name": "transformers", "pipeline_tag": "fill-mask", "license": "apache-2.0",
                    "language": ["en", "de"], "base_model": "answerdotai/ModernBERT-base",
                    "tags": ["modernbert", "fill-mask", "train.py", "phases-mlm"]}
    val = [r for r in map(json.loads, open(out / "log.jsonl")) if "val_mlm" in r][-1]
    assert f"At step 3, on the first 2 windows of 128 tokens of the validation split: MLM loss (15% masked) " \
           f"{val['val_mlm']:.4f}, CLM loss {val['val_clm']:.4f}." in card
    assert f"train.py --resume --out_dir={out}   # to the end of its budget" in card  # 3 of 4 steps
    assert "| mlm | MLM 30% | 1,536 | constant over 2,048, warmup 1,024 |" in card and "| corpus | 300 |" in card
    hub = pytest.importorskip("huggingface_hub")
    assert hub.ModelCard.load(str(out / "README.md")).data.to_dict() == meta  # what the hub reads
    edited = card.replace("# run", "# My continued ModernBERT")
    (out / "README.md").write_text(edited)
    train.main([f"--out_dir={out}", "--resume"])
    assert (out / "README.md").read_text() == edited and latest_step(out) == 4
    transformers = pytest.importorskip("transformers")
    assert transformers.AutoModelForMaskedLM.from_pretrained(str(out)).config.model_type == "modernbert"
    snippet = card.split("```python\n")[1].split("```")[0]  # the card's "Use", run as written: it prints 5 answers
    exec(compile(snippet, "README.md", "exec"), {})
    assert capsys.readouterr().out.count("'token_str'") == 5


def card_of(tmp_path, **flags):
    """The model card progress.card writes for a finished demo-like run of 4 steps on 2 epochs' worth of a
    corpus, continued from a run of ours by --weights_only (no training: what the card reads of the run)."""
    import argparse

    import train
    from machinery import progress
    log = tmp_path / "log.jsonl"
    log.write_text(json.dumps(dict(phase="clm", step=0, tokens=0, val_mlm=5.9, val_clm=7.9)) + "\n"
                   + json.dumps(dict(phase="clm", step=4, tokens=2048, val_mlm=7.1, val_clm=3.9)) + "\n")
    cfg = train.Config(**{**train.RECIPES["demo"], **train.PHASES["clm"], "phase": "clm", "init_from": str(tmp_path),
                          "weights_only": True, "out_dir": "out/code-clm", "tokens": 2048, "seq_len": 128,
                          "batch_size": 4, **flags})
    meta = dict(vocab_size=2048, splits=dict(train=dict(tokens=1024, per_source={"code": {"tokens": 1024}})),
                sources=[dict(name="code", documents=12, sha256="ab" * 32)])
    r = argparse.Namespace(cfg=cfg, history=[], phase_step=4, phase_tokens=2048, schedule_start=0, meta=meta,
                           model=tiny_model(), run_dir=argparse.Namespace(log_path=str(log)),
                           loader=argparse.Namespace(sequence=16, n_windows=8), wrote={"loss.png": True},
                           reloaded={"model.py": 0.0, "transformers": 0.0})  # what the check at a save found
    return progress.card(r, train.learning_rate)


def test_the_model_card_is_usable_on_the_hub(tmp_path):
    """The card's "Use" loads the folder train.py wrote (runnable as written: no hub id the user never chose),
    and says how to publish it; with --hub_id it loads that id and names the folder; an intended use and
    limitations section states the run's size, tokens, data (and how often it was read), context and what was
    not evaluated; a missing license is said in a line of its own."""
    card = card_of(tmp_path)
    use = card.split("## Use")[1].split("##")[0]
    code = use.split("```python")[1].split("```")[0]
    assert 'pipeline("fill-mask", model="out/code-clm")' in code and "USER/NAME" not in code
    assert "`out/code-clm` is the folder train.py wrote, from the directory it ran in" in use
    assert 'hf upload USER/NAME out/code-clm --exclude "checkpoints/*"' in use and "--hub_id" in use
    limits = card.split("## Intended use and limitations")[1].split("\n## ")[0]
    params = tiny_model().num_params()
    for words in (f"{params:,} parameters", "on 2,048 tokens (after the training of the model it started from)",
                  "windows of 128 tokens", "(code; 1,024 training tokens, read 2.00 times: it may reproduce",
                  "Measured: validation MLM and CLM losses", "Not evaluated: any downstream task",
                  "inputs longer than 128 tokens"):
        assert words in limits, words
    assert "**No license was given**" in card and "license" not in front_matter(card)
    card = card_of(tmp_path, hub_id="me/code-clm", license="apache-2.0")
    use = card.split("## Use")[1].split("##")[0]
    assert 'pipeline("fill-mask", model="me/code-clm")' in use and "USER/NAME" not in use
    assert '`model="out/code-clm"` loads the folder train.py wrote' in use
    assert "No license was given" not in card and "`apache-2.0`" in card
    assert front_matter(card)["license"] == "apache-2.0"


def test_the_cards_upload_command_publishes_the_model_and_not_the_users_wandb_files(tmp_path):
    """The card's `hf upload`, run as written, publishes the run directory less its optimizer states and, where W&B
    tracked the run (this invocation or an earlier one), less W&B's local files, whose wandb-metadata.json holds the
    user's e-mail, host and user names and git remote: what huggingface_hub's own filter keeps of the run's files
    under the command's --exclude patterns, read from the card (a folder name with a space stays one argument)."""
    hub = pytest.importorskip("huggingface_hub.utils")
    out = tmp_path / "my run"
    files = ["config.json", "model.safetensors", "tokenizer.json", "README.md", "log.jsonl", "loss.png", "run.json",
             "checkpoints/step-00000004/optimizer.safetensors", "tensorboard/events.out.tfevents.1.host",
             "wandb/offline-run-20260101_000000-0123abcd/files/wandb-metadata.json"]
    model = {name for name in files if not name.startswith(("checkpoints/", "wandb/"))}
    for log_to, wandb_files in (("wandb", False), ("tensorboard", True), ("tensorboard", False)):
        shutil.rmtree(out, ignore_errors=True)
        there = files if wandb_files else [f for f in files if not f.startswith("wandb/")]
        for name in there:
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_text("x")
        card = card_of(tmp_path, out_dir=str(out), log_to=log_to)
        (command,) = [part for part in card.split("`") if part.startswith("hf upload ")]
        words = shlex.split(command)
        assert words[:4] == ["hf", "upload", "USER/NAME", str(out)]
        patterns = [words[i + 1] for i, word in enumerate(words) if word == "--exclude"]
        assert set(hub.filter_repo_objects(there, ignore_patterns=patterns)) == model, (log_to, patterns)
        assert ("wandb/*" in patterns) == (log_to == "wandb" or wandb_files)  # no pattern for what is not there


def latest_step(out):
    return RunDir.open(str(out)).latest_state()["phase_step"]


# ---- creating, opening, locking ------------------------------------------------------------------------------


def with_run(path):
    save(RunDir.create(path), 1)


@pytest.mark.parametrize("prepare, match", [
    (lambda p: open(p, "w").close(), "is a file"),
    (with_run, "pass --resume"),
    (lambda p: os.makedirs(p + "/checkpoints"), "holds checkpoints"),
    (lambda p: os.makedirs(p) or open(p + "/config.json", "w").close(), "holds config.json"),
    (lambda p: os.makedirs(p) or open(p + "/model.safetensors", "w").close(), "holds model.safetensors"),
    (lambda p: os.makedirs(p) or open(p + "/log.jsonl", "w").close(), "holds log.jsonl"),
    (lambda p: os.makedirs(p) or open(p + "/state.json", "w").close(), "holds state.json"),
    (lambda p: os.makedirs(p) or open(p + "/run.json", "w").write('{"written_by": "x"}'), "not written by train"),
    (lambda p: os.makedirs(p) or open(p + "/run.json", "w").write("{"), "not valid JSON"),
    (lambda p: os.rmdir(os.path.dirname(p)) or open(os.path.dirname(p), "w").close(), "cannot write a run"),
])
def test_create_refuses(tmp_path, prepare, match):
    (tmp_path / "parent").mkdir()
    path = str(tmp_path / "parent" / "run")
    prepare(path)
    before, listing = tree(tmp_path), sorted(os.walk(tmp_path))
    with pytest.raises(InputError, match=match):
        RunDir.create(path)
    assert tree(tmp_path) == before and sorted(os.walk(tmp_path)) == listing


def test_create_accepts_a_folder_of_user_files_and_restarts_a_run_that_never_saved(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "README.md").write_text("notes")
    run = RunDir.create(str(tmp_path / "run"))
    assert RunDir.is_run(run.path) and RunDir.open(run.path).run_id == run.run_id
    assert json.loads((tmp_path / "run" / "run.json").read_text())["written_by"] == "train.py"
    again = RunDir.create(run.path)  # killed before its first checkpoint: started over, same marker
    assert again.run_id == run.run_id and (tmp_path / "run" / "README.md").read_text() == "notes"


@pytest.mark.parametrize("content, match", [
    (None, "no run.json"), ("[1]", "not written by train.py"), ('{"written_by": "train.py", "run_id": "x"}', "run_id"),
    ('{"written_by": "eval.py", "run_id": "' + "a" * 32 + '"}', "not written by"), ("{", "not valid JSON"),
])
def test_open_refuses_what_is_not_our_run(tmp_path, content, match):
    (tmp_path / "run").mkdir()
    if content is not None:
        (tmp_path / "run" / "run.json").write_text(content)
    with pytest.raises(InputError, match=match):
        RunDir.open(str(tmp_path / "run"))
    assert not RunDir.is_run(str(tmp_path / "run"))
    assert rundir.latest_state(str(tmp_path / "run")) is None


def test_the_lock_keeps_a_second_writer_out(tmp_path):
    run = RunDir.create(str(tmp_path / "run"))
    run.lock()
    script = f"import sys; sys.path.insert(0, {str(ROOT)!r}); from machinery.rundir import RunDir; " \
             f"RunDir.open({run.path!r}).lock()"
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert other.returncode == 1 and f"it holds {run.path}/.lock" in other.stderr
    with pytest.raises(InputError, match=r"\.lock"):
        RunDir.open(run.path).lock()
    run.unlock()
    assert not os.path.exists(run.path + "/.lock")
    second = RunDir.open(run.path)
    second.lock()
    second.unlock()


# ---- kills and full disks ------------------------------------------------------------------------------------


class Killed(BaseException):
    """A kill: no `except Exception` cleans up after it."""


def count_calls(monkeypatch, name, fail_at=None):
    calls, real = [0], getattr(os, name)

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == fail_at:
            raise Killed(f"{name} call {fail_at}")
        return real(*args, **kwargs)
    monkeypatch.setattr(os, name, wrapper)
    return calls


@pytest.mark.parametrize("new_step", [2, 1], ids=["next-step", "same-step-again"])
@pytest.mark.parametrize("call", ["replace", "rename", "fsync", "remove", "copy_file_range"])
def test_a_kill_at_every_call_of_a_save_leaves_one_complete_checkpoint(tmp_path, monkeypatch, call, new_step):
    monkeypatch.setattr(os, "fsync", lambda fd: None)  # durability needs a power cut to observe; calls still count
    base = tmp_path / "base"
    run = RunDir.create(str(base))
    (base / "README.md").write_text("mine")
    save(run, 1)
    old_model = digest(base / "model.safetensors")
    step = new_step if new_step == 2 else 11  # a re-save of step 1 carries other weights (those of step 11)
    model = small_model(step)
    for k in range(1, 1000):
        out = tmp_path / f"kill{k}"
        shutil.copytree(base, out)
        run = RunDir.open(str(out))
        with monkeypatch.context() as m:
            calls = count_calls(m, call, fail_at=k)
            try:
                run.save(model, moments(model, step), make_state(new_step), TOKENIZER, keep=1)
            except Killed:
                pass
        if calls[0] < k:  # the save made fewer calls: every one has been a kill point
            assert k > 1
            break
        state = RunDir.open(str(out)).latest_state()  # what a resume would read
        saved = 1 if digest(os.path.join(state["dir"], "model.safetensors")) == old_model else step
        check_checkpoint({**state, "phase_step": saved}, saved)
        assert state["phase_step"] in (1, new_step)
        top = digest(out / "model.safetensors")  # the old model, or the new one once the new checkpoint is complete
        assert top == old_model or top == digest(os.path.join(state["dir"], "model.safetensors")) != old_model
        save(run, 3)
        check_checkpoint(run.latest_state(), 3)
        assert all(os.path.isfile(f"{run.checkpoints}/{name}/state.json") for name in os.listdir(run.checkpoints))
        assert leftovers(run) == [] and (out / "README.md").read_text() == "mine"


def test_an_error_at_each_writer_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    run = RunDir.create(str(tmp_path / "run"))
    save(run, 1)
    before = tree(tmp_path / "run")
    from safetensors import SafetensorError
    real_replace = os.replace

    def fail(error, when=lambda *args: True, real=None):
        def fake(*args, **kwargs):
            if when(*args):
                raise error
            return real(*args, **kwargs)
        return fake
    top_level = lambda src, dst: os.path.dirname(dst) == run.path and dst.endswith("model.safetensors")  # noqa
    full, unsupported = fail(OSError(28, "No space left on device")), fail(OSError(18, "Invalid cross-device link"))
    for fakes, reason in [
            ({"os.copy_file_range": full}, "No space left on device"),
            ({"os.copy_file_range": unsupported, "shutil.copyfileobj": full}, "No space left on device"),
            ({"safetensors.torch.save_file": fail(SafetensorError("Error while serializing: IoError"))},
             "SafetensorError: Error while serializing"),
            ({"data.Tokenizer.save_pretrained": fail(OSError(5, "Input/output error"))}, "Input/output error"),
            ({"os.replace": fail(IsADirectoryError(21, "Is a directory"), top_level, real_replace)}, "Is a directory")]:
        with monkeypatch.context() as m:
            for target, fake in fakes.items():
                m.setattr(target, fake)
            with pytest.raises(InputError) as e:
                save(run, 2)
        assert f"could not write the checkpoint of step 2 in {run.checkpoints}: {reason}" in str(e.value)
        assert "step-00000001 is intact" in str(e.value)
        assert tree(tmp_path / "run") == before and leftovers(run) == []



def test_a_save_writes_over_what_a_killed_save_of_the_same_step_left_under_our_pid(tmp_path):
    """A process often gets the pid its killed predecessor had (train.py as a container's first process): the
    save that was killed left checkpoints/.tmp-step-N-<pid>, and the resume's first save, of the same step N,
    writes the checkpoint there all the same."""
    run = RunDir.create(str(tmp_path / "run"))
    save(run, 1)
    left = os.path.join(run.checkpoints, f".tmp-step-00000002-{os.getpid()}")
    os.makedirs(left)
    with open(os.path.join(left, rundir.MARKER), "w") as f:
        f.write(run.run_id + "\n")
    with open(os.path.join(left, "model.safetensors"), "wb") as f:
        f.write(b"cut short")
    assert run.latest_state()["phase_step"] == 1  # no state.json: not a checkpoint
    save(run, 2)
    check_checkpoint(run.latest_state(), 2)
    assert leftovers(run) == []

@pytest.mark.parametrize("checkpoints_of_room", [1.4, 2.2, 3.7])
def test_a_real_full_disk_gives_one_error_and_keeps_the_previous_checkpoint(tmp_path, small_disk,
                                                                           checkpoints_of_room):
    probe = RunDir.create(str(tmp_path / "probe"))
    save(probe, 1)
    one = sum(-(-os.path.getsize(os.path.join(r, f)) // 4096) * 4096 + 4096  # tmpfs: pages, and an inode
              for r, _, fs in os.walk(probe.path) for f in fs)
    disk = small_disk(str(int(one * checkpoints_of_room) // 4096 * 4096))
    run = RunDir.create(str(disk / "run"))
    (disk / "run" / "README.md").write_text("mine")
    errors, step = [], 0
    while not errors and step < 20:
        step += 1
        before = tree(disk / "run")
        try:
            save(run, step, keep=100)
        except InputError as e:
            errors.append(str(e))
    assert len(errors) == 1 and step >= 2, errors
    assert f"step-{step - 1:08d} is intact" in errors[0] and "could not write the checkpoint" in errors[0]
    assert tree(disk / "run") == before and leftovers(run) == []
    check_checkpoint(run.latest_state(), step - 1)


# ---- the schema of state.json --------------------------------------------------------------------------------


def deep(levels):
    value = 1
    for _ in range(levels):
        value = [value]
    return value


def edit(path, value):
    """A copy of a good state with the field at `path` ("loader.sequence", "history.0.tokens") set or deleted."""
    state = json.loads(json.dumps(make_state(4)))
    *parents, last = path.split(".")
    target = state
    for key in parents:
        target = target[int(key)] if isinstance(target, list) else target[key]
    if isinstance(target, list):
        last = int(last)
    if value is DELETE:
        del target[last]
    else:
        target[last] = value
    return state


DELETE = object()
BAD_STATES = [  # (field to edit, bad value, the field the message names)
    ("adam_t", "5", "adam_t"), ("adam_t", -1, "adam_t"), ("adam_t", True, "adam_t"), ("adam_t", 1e30, "adam_t"),
    ("adam_t", float("nan"), "adam_t"), ("adam_t", 2 ** 62, "adam_t"), ("adam_t", 4.0, "adam_t"),
    ("adam_t", None, "adam_t"), ("adam_t", DELETE, "adam_t"), ("adam_t", 3, "adam_t"),  # below phase_step
    ("phase_step", 1e30, "phase_step"), ("phase_step", -5, "phase_step"), ("phase_tokens", "x", "phase_tokens"),
    ("total_tokens", 1.5, "total_tokens"), ("total_tokens", 10, "total_tokens"),  # below phase_tokens
    ("schedule_tokens_done", -1, "schedule_tokens_done"), ("schedule_tokens_done", [], "schedule_tokens_done"),
    ("phase", "foo", "phase"), ("phase", 3, "phase"), ("phase", "x" * 100, "phase"),
    ("loader", "abc", "loader"), ("loader.sequence", "ten", "loader.sequence"), ("loader.sequence", -1,
                                                                               "loader.sequence"),
    ("loader.sequence", DELETE, "loader.sequence"), ("loader.split", [1], "loader.split"),
    ("loader.sequence", 2.5, "loader.sequence"), ("config", "x", "config"), ("config.lr", "abc", "config.lr"),
    ("config.lr", float("nan"), "config.lr"), ("config.lr", float("inf"), "config.lr"),
    ("config.lr", {"a": {"b": 1}}, "config.lr"), ("config.seed", 1.5, "config.seed"),
    ("config.seed", True, "config.seed"), ("config.compile", "yes", "config.compile"),
    ("config.lrr", [1.0], "config.lrr"), ("history", "x", "history"), ("history", {"0": 1}, "history"),
    ("history", [1], "history[0]"), ("history.0.tokens", -1, "history[0].tokens"),
    ("history.0.dir", DELETE, "history[0]"), ("history.0.phase", "foo", "history[0].phase"),
    ("config.seed", DELETE, "config.seed"), ("history.0.phase", deep(50), "history[0].phase"),
    ("history", deep(200), "history[0]"), ("rng", "x", "rng"), ("rng.0.cpu", "!!!not base64", "rng[0].cpu"),
    ("rng.0.cpu", base64.b64encode(b"short").decode(), "rng[0].cpu"), ("rng.0", "x", "rng[0]"),
    ("rng.0.cpu", DELETE, "rng[0].cpu"), ("rng.0.cuda", 5, "rng[0].cuda"), ("files", "x", "files"),
    ("files.model.safetensors", -1, "files['model.safetensors']"), ("files.../x", 3, "files['../x']"),
    ("code", "x", "code"), ("code.git", 5, "code.git"), ("code.versions", "2.13", "code.versions"),
    ("code.versions.torch", 2.13, "code.versions.torch"), ("tokenizer", 5, "tokenizer"),
    ("tokenizer", DELETE, "tokenizer"), ("surprise", 1, "surprise"), ("phase_tokens", 1e30, "phase_tokens"),
    ("history.0.tokens", 1e30, "history[0].tokens"), ("history.0.extra", 1, "history[0]"),
    ("loader.sequence", 2 ** 70, "loader.sequence"), ("config.lr", 10 ** 400, "config.lr"),
    ("earlier_code", "x", "earlier_code"), ("earlier_code", [{"until_step": 1}], "earlier_code[0]"),
    ("earlier_code", [{"until_step": -1, "code": {}}], "earlier_code[0].until_step"),
    ("earlier_code", [{"until_step": 1, "code": {"git": 5}}], "earlier_code[0].code.git"),
]


@pytest.mark.parametrize("path, value, field", BAD_STATES, ids=[f"{p}={str(v)[:20]}" for p, v, _ in BAD_STATES])
def test_validate_state_names_the_field_and_the_file(path, value, field):
    if path.startswith("files."):  # file names hold dots: set the entry directly
        state = make_state(4)
        state["files"] = {path[len("files."):]: value}
    else:
        state = edit(path, value)
        state.setdefault("files", {})
    with pytest.raises(InputError) as e:
        validate_state(state, "run/checkpoints/step-00000004/state.json", PHASES, FIELDS)
    assert str(e.value).startswith(f"run/checkpoints/step-00000004/state.json: {field}:"), str(e.value)


def test_a_state_written_before_adam_t_had_its_name_reads_as_today():
    """Checkpoints written before the rename call Adam's t `step`: read, it is `adam_t`, checked as before."""
    old = {("step" if key == "adam_t" else key): value for key, value in make_state(4, "clm").items()}
    state = validate_state({**old, "files": {}}, "s.json", PHASES, FIELDS)
    assert "step" not in state and state["adam_t"] == 14 and state["phase_step"] == 4
    with pytest.raises(InputError, match=r"^s\.json: adam_t: 3 is less than phase_step 4"):
        validate_state({**old, "step": 3, "files": {}}, "s.json")


def test_validate_state_accepts_a_good_state_and_the_top_level_must_be_an_object():
    good = {**make_state(4), "files": {"model.safetensors": 10}}
    assert validate_state(copy.deepcopy(good), "s.json", PHASES, FIELDS) == good
    assert validate_state(json.loads(json.dumps(good)), "s.json") == good
    with pytest.raises(InputError, match=r"^s\.json: \(top level\): expected an object"):
        validate_state([good], "s.json")


def test_a_state_a_save_would_refuse_is_refused_before_the_first_step():
    """check_savable: the state at the end of the budget, checked as a save checks it; the message names the flag
    (a setting's own, or --tokens for a counter the budget would push past 2**62)."""
    kinds = {"lr": "float", "seed": "int", "recipe": "str", "compile": "bool", "tokens": "int", "license": "str"}
    state = make_state(4)
    state["config"].update(tokens=10 ** 6, license="")
    rundir.check_savable(state, 1000, 64, kinds)  # within every bound: nothing to say
    state["config"]["license"] = "a" * 5000
    with pytest.raises(InputError, match=r"^--license='a{59}\.\.\.: a checkpoint cannot hold it \(expected a string "
                                         r"of at most 4096 characters.*nothing was trained$"):
        rundir.check_savable(state, 1000, 64, kinds)
    state["config"]["license"] = ""
    state["history"][0]["tokens"] = state["total_tokens"] = 2 ** 62 - 1000  # the runs before it, nearly full
    with pytest.raises(InputError, match=r"^--tokens=1,000,000: at the end of this budget the checkpoint's "
                                         r"total_tokens cannot be saved \(expected an integer in \[0, 2\*\*62\)"):
        rundir.check_savable(state, 1000, 64, kinds)


@pytest.mark.parametrize("damage, match", [
    (lambda f: open(f + "/state.json", "w").write('{"step": "5"'), "state.json: not valid JSON"),
    (lambda f: open(f + "/state.json", "w").write("[" * 100000 + "]" * 100000), "state.json: not valid JSON"),
    (lambda f: edit_file(f + "/state.json", "phase_step", -3), "state.json: phase_step: expected an integer"),
    (lambda f: edit_file(f + "/state.json", "rng", [{"cpu": "%%"}]), r"state.json: rng\[0\].cpu: not base64"),
    (lambda f: open(f + "/model.safetensors", "ab").write(b"x"), "model.safetensors has"),
    (lambda f: os.remove(f + "/optimizer.safetensors"), "optimizer.safetensors has None bytes"),
    (lambda f: edit_file(f + "/state.json", "phase_step", 1), "phase_step: 1, but the checkpoint was saved as step 2"),
    (lambda f: edit_file(f + "/state.json", "files", {"config.json": 1068}), "files: model.safetensors is not listed"),
])
def test_a_damaged_checkpoint_is_an_error_naming_the_file(tmp_path, damage, match):
    run = RunDir.create(str(tmp_path / "run"))
    save(run, 1)
    folder = save(run, 2)
    damage(folder)
    with pytest.raises(InputError, match=match) as e:
        rundir.latest_state(run.path, PHASES)
    assert folder in str(e.value)
    save(run, 3, keep=1)  # a later save still works, and prunes the damaged folder of ours
    assert os.listdir(run.checkpoints) == ["step-00000003"]


def edit_file(path, key, value):
    with open(path) as f:
        state = json.load(f)
    state[key] = value
    with open(path, "w") as f:
        json.dump(state, f)


def test_a_non_finite_weight_or_moment_is_never_saved(tmp_path):
    run = RunDir.create(str(tmp_path / "run"))
    save(run, 1)
    before = tree(run.path)
    model = copy.deepcopy(small_model(2))  # poisoned below: not the cached one
    bad = moments(model, 2)
    next(iter(bad.values()))[0].view(-1)[0] = float("nan")
    with pytest.raises(InputError, match="non-finite values in exp_avg.* at step 2.*step-00000001 is intact"):
        run.save(model, bad, make_state(2), TOKENIZER, keep=3)
    with torch.no_grad():
        next(model.parameters()).fill_(float("inf"))
    with pytest.raises(InputError, match="non-finite values in .* at step 2"):
        run.save(model, moments(model, 2), make_state(2), TOKENIZER, keep=3)
    assert tree(run.path) == before


# ---- RNG, code version, log, signals -------------------------------------------------------------------------


def test_rng_state_round_trips_through_json():
    torch.manual_seed(3)
    state = json.loads(json.dumps(rundir.rng_state(torch.device("cpu"))))
    expected = torch.rand(5)
    torch.manual_seed(4)
    rundir.set_rng_state(state, torch.device("cpu"))
    assert torch.equal(torch.rand(5), expected)


def test_a_write_that_fails_midway_leaves_the_file_that_was_there(tmp_path):
    """cli.write_text (the JSON files, results and reports the scripts write): a failure while its pieces are written
    (a full disk, an error in what makes them) leaves the old file whole and no temporary file beside it."""
    from machinery import cli
    path = tmp_path / "report.json"
    path.write_text("the old results\n")

    def pieces():
        yield "the new results, half of them"
        raise OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(OSError):
        cli.write_text(path, pieces())
    assert path.read_text() == "the old results\n" and os.listdir(tmp_path) == ["report.json"]
    cli.write_text(path, iter(["the new ", "results\n"]))
    assert path.read_text() == "the new results\n" and os.listdir(tmp_path) == ["report.json"]


def test_code_version_hashes_every_script_and_the_machinery(tmp_path, monkeypatch):
    """A checkpoint's code version: the commit where git has one, and a hash of every script and machinery module
    (cli.source_digest), the same for the same code anywhere and different after an edit to any of them."""
    from machinery import cli
    here = cli.source_digest()[:16]  # this repository's code
    monkeypatch.setattr(rundir, "ROOT", str(tmp_path))  # no git repository there
    versions = {}
    for edit in (None, "eval.py", "machinery/cli.py"):
        monkeypatch.setattr(cli, "REPOSITORY", source_copy(tmp_path / str(edit).replace("/", "-"), edit))
        versions[edit] = rundir.code_version()
    assert versions[None] == {"git": None, "sha256": here, "versions": cli.versions()}
    assert len({v["sha256"] for v in versions.values()}) == 3
    # a folder of code beside machinery/ (a student's ablation module) counts; tests, documents, hidden ones do not
    root = tmp_path / "None"  # the unedited copy
    monkeypatch.setattr(cli, "REPOSITORY", root)
    for path, counts in (("ablations/x.py", True), ("tests/test_y.py", False), ("docs/z.py", False),
                         (".venv/w.py", False)):
        (root / path).parent.mkdir(exist_ok=True)
        (root / path).write_text("x = 1\n")
        assert (cli.source_digest(now=True)[:16] != versions[None]["sha256"]) == counts, path
        (root / path).unlink()
    # one digit changed in place (a constant edited): the file keeps its name and its length, and is other code
    kept = (root / "machinery" / "compare.py").read_bytes()
    i = next(i for i, b in enumerate(kept) if chr(b).isdigit())
    (root / "machinery" / "compare.py").write_bytes(kept[:i] + (b"2" if kept[i:i + 1] == b"1" else b"1") + kept[i + 1:])
    assert cli.source_digest(now=True)[:16] != versions[None]["sha256"]


def test_code_version_names_the_commit_and_whether_the_code_that_ran_differs_from_it(tmp_path, monkeypatch):
    """An ablation run before it is committed: the commit with "+edits", where a script or a machinery module (the
    files the code's hash covers: edited, or new) differs from the commit's; a test or a document does not count."""
    repo = tmp_path / "repo"
    for path in ("train.py", "machinery/cli.py", "tests/test_x.py", "README.md"):
        (repo / path).parent.mkdir(parents=True, exist_ok=True)
        (repo / path).write_text("x = 1\n")
    git = functools.partial(subprocess.run, cwd=repo, check=True, capture_output=True, text=True)
    git(["git", "init", "-q"])
    git(["git", "add", "."])
    git(["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "code"])
    commit = git(["git", "rev-parse", "HEAD"]).stdout.strip()
    monkeypatch.setattr(rundir, "ROOT", str(repo))
    assert rundir.code_version()["git"] == commit
    for path in ("tests/test_x.py", "README.md", "tests/new.py"):
        (repo / path).write_text("x = 2\n")
    assert rundir.code_version()["git"] == commit
    for path in ("machinery/cli.py", "train.py", "machinery/new.py", "model.py", "ablations/x.py"):
        (repo / path).parent.mkdir(exist_ok=True)
        (repo / path).write_text("x = 2\n")
        assert rundir.code_version()["git"] == commit + "+edits", path
        git(["git", "checkout", "-q", "--", path]) if path in ("machinery/cli.py", "train.py") else (repo / path).unlink()
    assert rundir.code_version()["git"] == commit


def test_a_checkpoint_written_before_earlier_code_existed_validates_and_resumes_its_record(monkeypatch):
    """earlier_code is optional: a state.json without it (older checkpoints) validates, and a resume of it starts
    the record from its code (the code up to its step, where this resume runs other code; nothing where the same)."""
    old = {**make_state(4), "files": {}}
    assert "earlier_code" not in old and validate_state(old, "s.json", PHASES, FIELDS) == old
    now = {"git": None, "sha256": "1" * 16, "versions": old["code"]["versions"]}
    monkeypatch.setattr(rundir, "code_version", lambda: now)
    assert rundir.code_record(old) == {"code": now, "earlier_code": [{"until_step": 4, "code": old["code"]}]}
    monkeypatch.setattr(rundir, "code_version", lambda: old["code"])
    assert rundir.code_record(old) == {"code": old["code"], "earlier_code": []}
    assert rundir.code_record(None) == {"code": old["code"], "earlier_code": []}  # not a resume


def test_the_versions_a_result_records_are_the_installed_packages():
    """cli.versions reads the packages' metadata without importing them: the same versions the imported packages
    report (torch's with its build), and changed_versions names what differs between two records."""
    import numpy
    import safetensors
    from machinery import cli
    found = cli.versions()
    assert found["torch"] == torch.__version__ and found["numpy"] == numpy.__version__
    assert found["safetensors"] == safetensors.__version__ and found["python"] == sys.version.split()[0]
    assert cli.changed_versions(found, found) == "" and cli.changed_versions({}, found) == ""
    assert cli.changed_versions({**found, "torch": "2.11.0+cu130", "made-up": "2.8.3"}, found) == \
        f"torch 2.11.0+cu130 -> {torch.__version__}, made-up 2.8.3 -> absent"


def test_append_log_writes_strict_json_lines(tmp_path):
    path = str(tmp_path / "log.jsonl")
    rundir.append_log(path, {"step": 1, "loss": 2.5})
    rundir.append_log(path, {"step": 2, "loss": float("nan"), "mfu": None})
    with open(path) as f:
        lines = [json.loads(line, parse_constant=lambda c: pytest.fail(f"{c} in the log")) for line in f]
    assert lines == [{"step": 1, "loss": 2.5}, {"step": 2, "loss": None, "mfu": None}]



def test_a_resume_trims_the_log_to_its_checkpoint_and_keeps_every_record_on_a_line_of_its_own(tmp_path):
    """trim_log keeps the records up to the checkpoint's step, that step's included, and drops a line a kill cut
    short; a last record left without its newline (a disk that filled up just before it, an editor) gets one, so
    that the next record is not glued to it (a line of two records would lose both)."""
    run = RunDir.create(str(tmp_path / "run"))
    with open(run.log_path, "w") as f:
        f.write('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "loss": 1.5}')
    run.trim_log(3)
    run.append_log({"step": 4, "loss": 1.25})
    with open(run.log_path) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]
    with open(run.log_path, "a") as f:
        f.write('{"step": 5, "lo')  # cut short by a kill
    run.trim_log(2)
    with open(run.log_path) as f:
        assert [json.loads(line) for line in f] == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}]

def test_a_resume_that_ends_without_a_record_still_cuts_its_log_back_to_its_checkpoint(tmp_path):
    """A --resume whose budget ends at its checkpoint runs no step and writes no record; its log still ends at that
    checkpoint (its summary reads the last validation there): the records a kill left past it are not the run's. One
    refused before its first record leaves them, the run byte for byte as it was."""
    run = RunDir.create(str(tmp_path / "run"))
    run.append_log({"step": 1, "loss": 3.0, "val_mlm": 3.0})
    save(run, 1)
    run.append_log({"step": 2, "loss": 2.0, "val_mlm": 2.0})  # a kill between saves
    before = tree(run.path)

    def steps():
        with open(run.log_path) as f:
            return [json.loads(line)["step"] for line in f]
    with pytest.raises(InputError), rundir.undone_if_refused():
        rundir.resume_from(run.path, True, lambda state: state, PHASES, FIELDS)
        raise InputError("refused")
    assert tree(run.path) == before and steps() == [1, 2]
    with rundir.undone_if_refused():
        resumed, state = rundir.resume_from(run.path, True, lambda state: state, PHASES, FIELDS)
    resumed.unlock()
    assert state["phase_step"] == 1 and steps() == [1]


def test_a_start_stopped_before_its_first_record_takes_back_what_it_made_and_nothing_else(tmp_path):
    """A start stopped before its first record takes back the run.json, .lock and folder it made; a file put in that
    folder meanwhile is not its to take (the folder stays, holding it alone)."""
    out = tmp_path / "new"
    for put in (False, True):
        with pytest.raises(KeyboardInterrupt), rundir.undone_if_refused():
            RunDir.create(str(out), locked=True)
            if put:
                (out / "notes.txt").write_text("mine")
            raise KeyboardInterrupt
        assert os.listdir(tmp_path) == (["new"] if put else [])
    assert os.listdir(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"


def test_the_log_is_on_the_disk_before_the_checkpoint_that_covers_it(tmp_path, monkeypatch):
    """A checkpoint is fsynced; the records of the steps it covers are too, before it: after a crash its resume
    finds them all (a log with a gap would draw a curve, and a card, with steps missing). A resume's trim reaches the
    disk before its rename, so a crash then never leaves an empty log."""
    run = RunDir.create(str(tmp_path / "run"))
    run.append_log({"step": 1, "loss": 2.5})
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd))[1])
    save(run, 1)
    assert run.log_path in synced
    assert synced.index(run.log_path) < min(i for i, path in enumerate(synced) if path.startswith(run.checkpoints))
    synced.clear()
    run.trim_log(1)
    assert synced == [f"{run.log_path}.tmp-{run.run_id}"]


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGTERM), (signal.SIGINT, signal.SIGTERM),
                                           (signal.SIGTERM, signal.SIGINT)])
def test_graceful_stop(capsys, first, second):
    before = {s: signal.getsignal(s) for s in GracefulStop.SIGNALS}
    with GracefulStop() as stop:
        assert not stop.requested
        os.kill(os.getpid(), first)
        assert stop.requested and stop.signal_name == first.name
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), second)
    assert {s: signal.getsignal(s) for s in GracefulStop.SIGNALS} == before
    assert capsys.readouterr() == ("", "")


# The size string goes into tmpfs's "size=" mount option, so it carries the other options after a comma.
@pytest.mark.parametrize("size, reason", [("64k,ro", "Read-only file system"),
                                          ("4k,nr_inodes=2", "No space left on device")])
def test_create_on_a_read_only_or_full_disk_is_one_error_and_leaves_nothing(small_disk, size, reason):
    disk = small_disk(size)
    with pytest.raises(InputError, match=rf"disk/run: cannot write a run there \({reason}\)"):
        RunDir.create(str(disk / "run"))
    assert os.listdir(disk) == []


def test_a_disk_that_fills_between_saves_stops_the_run_at_its_log_with_one_line(small_disk):
    """The log takes a record at every step, so a disk that fills up between saves is met there first: one error
    naming the log and the checkpoint the run goes on from, not an OSError's traceback. A resume on that disk
    (its trim of the log) is one line too, and leaves the log as it was and nothing beside it."""
    disk = small_disk("1m")
    run = RunDir.create(str(disk / "run"))
    record = dict(phase="mlm", tokens=512, loss=2.5, lr=1e-3, grad_norm=0.5, ms=100.0, tokens_per_s=5120, mfu=None)
    run.append_log({**record, "step": 1})
    save(run, 1)
    with open(disk / "filler", "wb", buffering=0) as f:  # another program takes the rest of the disk
        with pytest.raises(OSError, match="No space left"):
            while True:
                f.write(bytes(4096))
    with pytest.raises(InputError) as stopped:  # the log's last page fills up a few steps later
        for step in range(2, 1000):
            run.append_log({**record, "step": step})
    assert f"{run.log_path}: cannot append the record of step {step} (No space left on device); the run stops " \
           f"here: the previous checkpoint {run.checkpoints}/step-00000001 is intact" == str(stopped.value)
    before = tree(disk / "run")
    with pytest.raises(InputError, match=rf"{run.log_path}: cannot rewrite it with the records up to step 1, where "
                                         rf"the run resumes \(No space left on device\); the log is as it was"):
        run.trim_log(1)
    assert tree(disk / "run") == before and leftovers(run) == []
