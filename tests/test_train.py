"""train.py and freeze.py: the optimizer against torch.optim.AdamW, the schedules, the phase hand-off,
exact resume, DDP equivalence and freezing that really freezes."""
import argparse
import concurrent.futures
import copy
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

import data
import freeze
import train
from conftest import BYTE_IDS, ROOT, tiny_model, torch_adamw_oracle
from machinery import flags as flag_rules
from machinery import progress
from machinery.cli import InputError
from machinery.rundir import RunDir
from model import ModernBERT, ModernBERTConfig

# A tiny run: 128-token sequences, 4 per step, a few steps; the paper's recipe otherwise.
SMALL = ["--preset=tiny", "--seq_len=128", "--batch_size=4", "--micro_batch_size=2", "--compile=false",
         "--eval_interval=1000", "--eval_sequences=2", "--log_interval=1000", "--save_interval=0",
         "--warmup_tokens=1024", "--lr=1e-3", "--grad_clip=0"]


def small(*changes):
    """SMALL with some of its flags changed (a flag may be given only once)."""
    changed = {c.split("=")[0] for c in changes}
    return [f for f in SMALL if f.split("=")[0] not in changed] + list(changes)
STEP_TOKENS = 4 * 128


@pytest.fixture(scope="module")
def corpus(demo_corpus):
    return demo_corpus


def configure(argv, world=1):
    """The resolved and checked configuration of a command line, as train.main sees it."""
    given, _ = flag_rules.parse(argv, train.Config)
    cfg = train.resolve_config(given)
    flag_rules.check(cfg, train.CHOICES, world)
    flag_rules.check_start(cfg, "fresh" if cfg.init_from == "scratch" else "weights", None, train.Config)
    return cfg


def latest(out_dir):
    """The state of a run's newest checkpoint, with "dir" its folder."""
    return RunDir.open(str(out_dir)).latest_state()


def run(corpus, out_dir, *flags):
    train.main([f"--data={corpus}", f"--out_dir={out_dir}", *small(*flags)])
    return load_file(os.path.join(out_dir, "model.safetensors")), latest(out_dir)


def printed_commands(text):
    """The commands a run printed, by label: `next:` and `longer:` lines and the line after `Continue with:`."""
    found, lines = {}, text.splitlines()
    for i, line in enumerate(lines):
        if line.endswith("Continue with:"):
            found.setdefault("continue", []).append(lines[i + 1].strip())
        if m := re.match(r"(next|longer): +(.*?)   # ", line):
            found.setdefault(m[1], []).append(m[2])
    return found


def run_printed(command):
    """A printed `python train.py ...` command, run as the shell would run it from here (in this process)."""
    argv = shlex.split(command)
    assert argv[0] == "python" and os.path.samefile(argv[1], ROOT / "train.py"), command
    train.main(argv[2:])


def lrs(out_dir):
    """The learning rate of every training step in a run's log.jsonl."""
    return [r["lr"] for r in map(json.loads, open(os.path.join(out_dir, "log.jsonl"))) if "loss" in r]


# --- optimizer and schedules -----------------------------------------------------------------------


def test_adamw_equals_torch_adamw_with_scaled_weight_decay():
    ours, ref = tiny_model(), tiny_model()
    ref.load_state_dict(ours.state_dict())
    peak, wd = 1e-3, 0.1  # a large decay, so that the decoupled scaling is visible
    schedule = train.Config(lr=peak, warmup_tokens=3, schedule="constant")
    opt = train.AdamW(ours.param_groups(), peak, (0.9, 0.98), 1e-6, wd)
    groups = ref.param_groups()
    torch_opt = torch_adamw_oracle(ref, peak, wd)
    x = torch.randint(0, 256, (2, 64))
    y = torch.where(torch.rand(2, 64) < 0.3, x, -100)
    for step in range(6):
        lr = train.learning_rate(schedule, step)
        for model in (ours, ref):
            model.zero_grad()
            model(x, labels=y)[1].backward()
        opt.step(lr)
        for g in torch_opt.param_groups:
            g["lr"] = lr
        torch_opt.step()
        for (name, a), b in zip(ours.named_parameters(), ref.parameters()):
            assert torch.allclose(a, b, rtol=1e-6, atol=1e-9), (step, name)
    assert opt.t == 6
    no_decay = {n for n, _ in groups["no_decay"]}
    assert no_decay == {n for n, p in ours.named_parameters() if p.ndim <= 1}
    assert any(n.endswith("norm.weight") for n in no_decay) and "decoder.bias" in no_decay


def test_adamw_skips_frozen_parameters_entirely():
    p, q = torch.nn.Parameter(torch.ones(3, 3)), torch.nn.Parameter(torch.ones(3, 3))
    opt = train.AdamW({"decay": [("p", p), ("q", q)], "no_decay": []}, 1e-2, weight_decay=0.5)
    for frozen in (set(), {"p"}):  # one step to give p moments, then frozen with a zero gradient
        opt.frozen = frozen
        p.grad, q.grad = torch.ones(3, 3) if not frozen else torch.zeros(3, 3), torch.ones(3, 3)
        before, moments = p.detach().clone(), [m.clone() for m in opt.moments["p"]]
        opt.step(1e-2)
    assert torch.equal(p, before) and opt.moments["p"][0].abs().sum() > 0  # stale moments did not move it
    assert all(map(torch.equal, opt.moments["p"], moments))  # nor did its zero gradient decay them
    assert not torch.equal(q, torch.ones(3, 3))


def test_schedules_at_their_key_points():
    peak = 2e-4
    phase1 = train.Config(lr=peak, schedule="constant", warmup_tokens=100_000_000, tokens=10**10)
    assert train.learning_rate(phase1, 0) == 0.0  # the first step (Composer's warmup starts at 0)
    assert train.learning_rate(phase1, 25_000_000) == pytest.approx(peak / 4)
    assert train.learning_rate(phase1, 100_000_000) == pytest.approx(peak)  # end of warmup
    assert train.learning_rate(phase1, 5 * 10**9) == peak  # constant
    # 1-sqrt over 101 steps of 10M tokens: the shape runs from the first step (t = 0) to the last (t = 1B)
    decay = train.Config(lr=peak, schedule="1-sqrt", warmup_tokens=0, tokens=1_010_000_000, batch_size=1,
                         seq_len=10_000_000, final_lr_frac=0.1)
    assert train.learning_rate(decay, 0) == peak  # no warmup: starts at the peak
    assert train.learning_rate(decay, 10**9) == pytest.approx(0.1 * peak)  # its last step: 10% of the peak
    assert train.learning_rate(decay, 250_000_000) == pytest.approx(peak * (0.1 + 0.9 * 0.5))  # 1 - sqrt(1/4)
    assert train.learning_rate(decay, 640_000_000) == pytest.approx(peak * (0.1 + 0.9 * 0.2))  # 1 - sqrt(0.64)


@pytest.mark.parametrize("schedule", ["1-sqrt", "wsd", "cosine"])
@pytest.mark.parametrize("steps", [1, 7, 12])
def test_the_last_step_of_a_decay_runs_at_its_floor(schedule, steps, monkeypatch):
    """Whatever the length, a decay's last step takes final_lr_frac of the peak and its rates fall to it (never
    below): 1-sqrt, wsd, and a shape added to SCHEDULES as an ablation (a cosine written as one_minus_sqrt is)."""
    monkeypatch.setitem(train.SCHEDULES, "cosine", lambda t, end, cfg: cfg.final_lr_frac + (1 - cfg.final_lr_frac) * (
        1 + math.cos(math.pi * (min(1.0, t / end) if end > 0 else 1.0))) / 2)
    cfg = train.Config(lr=1e-3, schedule=schedule, warmup_tokens=0, tokens=steps * STEP_TOKENS, seq_len=128,
                       batch_size=4, final_lr_frac=0.2, decay_frac=0.5)
    rates = [train.learning_rate(cfg, k * STEP_TOKENS) for k in range(steps)]
    assert rates[-1] == pytest.approx(0.2e-3) and min(rates) == rates[-1]
    assert rates == sorted(rates, reverse=True) and (steps == 1 or rates[0] == 1e-3)


def test_phase_defaults_and_flag_parsing():
    cfg = configure(["--recipe=paper", "--phase=clm", "--data=d", "--tokens=10B"])
    assert (cfg.objective, cfg.schedule, cfg.warmup_tokens, cfg.tokens) == ("clm", "constant", 10**8, 10**10)
    assert (cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay) == (2e-4, 0.9, 0.98, 1e-6, 1e-5)
    assert (cfg.seq_len, cfg.batch_size, cfg.out_dir) == (8192, 384, "out/clm")
    cfg = configure(["--recipe", "paper", "--phase", "mlm", "--data", "d", "--resume=false"])
    assert cfg.mask_rate == 0.3 and cfg.objective == "mlm"
    cfg = configure(["--recipe=paper", "--phase=decay", "--data=d", "--tokens=1e9", "--init_from=x/y"])
    assert (cfg.mask_rate, cfg.schedule, cfg.warmup_tokens, cfg.final_lr_frac) == (0.15, "1-sqrt", 0, 0.1)
    for bad, message in ((["--bogus=1"], "unknown flag --bogus"), (["--lr=fast"], "--lr='fast' is not a valid float"),
                         (["--phase=sft"], "--phase='sft'"), (["--phase=decay", "--data=d"], "--phase=decay needs"),
                         (["--data=d", "--mask_rate=0"], "--mask_rate=0.0: expected 0 < rate < 1")):
        with pytest.raises(InputError, match=message):
            configure(bad)


def test_a_hand_off_runs_with_its_parents_model_data_batch_and_optimizer():
    """The decay continues the run it starts from: its architecture, data, batch, optimizer, clipping, dropout and
    seeds, not the recipe's, unless a flag changes one; the phase sets its own objective and schedule."""
    kept = dict(recipe="smoke", preset="mini", data="d", seq_len=64, batch_size=12, micro_batch_size=3, lr=3e-3,
                beta1=0.8, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=0.5, dropout=0.1, seed=5, data_seed=6)
    parent = dict(config=dataclasses.asdict(train.Config(**kept, phase="clm", objective="clm")), phase_tokens=10_000)
    cfg = train.resolve_config(dict(phase="decay", init_from="out/x"), parent=parent)
    assert {k: getattr(cfg, k) for k in kept} == kept
    assert (cfg.objective, cfg.mask_rate, cfg.schedule, cfg.warmup_tokens) == ("mlm", 0.15, "1-sqrt", 0)
    assert cfg.tokens == 1000  # 10% of the parent's
    changed = train.resolve_config(dict(phase="decay", init_from="out/x", weight_decay=0.0), parent=parent)
    assert changed.weight_decay == 0 and changed.lr == 3e-3


def test_freeze_specs():
    assert freeze.parse_layers("0-7", 22) == list(range(8))
    assert freeze.parse_layers("8-14", 22) == list(range(8, 15))
    assert freeze.parse_layers("0,2,5", 22) == [0, 2, 5]
    assert freeze.parse_layers("low", 22) == list(range(8)) and freeze.parse_layers("mid", 22) == list(range(8, 15))
    assert freeze.parse_layers("", 22) == []
    with pytest.raises(ValueError, match="outside the model's blocks 0-21"):
        freeze.parse_layers("20-23", 22)
    with pytest.raises(ValueError, match="expected block ranges"):
        freeze.parse_layers("first", 22)
    with pytest.raises(ValueError, match="'7-0' runs backwards"):  # not "outside the model's blocks": it is not
        freeze.parse_layers("7-0", 22)
    assert freeze.parse_layers("21", 22) == [21] and freeze.parse_layers("0-21", 22) == list(range(22))  # the edges
    for n in (1, 2):  # too few blocks for a middle third: refused, never a freeze of nothing (2 named block 2)
        with pytest.raises(ValueError, match=f"--freeze=mid: a model of {n} block"):
            freeze.parse_layers("mid", n)
    assert freeze.parse_layers("mid", 3) == [2] and freeze.parse_layers("low", 1) == [0]
    assert freeze.parse_layers("embeddings", 22) == ["embeddings"]
    assert freeze.parse_layers("0-1,embeddings", 22) == ["embeddings", 0, 1]


def test_freezing_the_embeddings_freezes_the_tied_output_matrix_too():
    """The embedding matrix is the decoder's weight (tied): frozen through the embeddings, the output layer does
    not move either under AdamW with weight decay, while its bias and every block do."""
    model = tiny_model(seed=1)
    frozen = freeze.frozen_names(model, freeze.parse_layers("embeddings", 4))
    assert frozen == {"model.embeddings.tok_embeddings.weight", "model.embeddings.norm.weight"}
    assert model.decoder.weight is model.model.embeddings.tok_embeddings.weight
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = train.AdamW(model.param_groups(), 1e-2, (0.9, 0.98), 1e-6, 0.1, frozen)
    for step in range(3):
        x = torch.randint(0, 256, (2, 32))
        model(x, labels=x)[1].backward()
        freeze.zero_frozen_grads(model, frozen)
        optimizer.step(1e-2)
        model.zero_grad(set_to_none=True)
    assert torch.equal(model.decoder.weight, before["model.embeddings.tok_embeddings.weight"])
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert moved == set(before) - frozen and "decoder.bias" in moved


# --- losses ----------------------------------------------------------------------------------------


def test_validation_losses_are_token_means_whatever_the_batch_size(corpus):
    """The mean over every labelled token of the windows, as F.cross_entropy summed over one batch of them
    all: the same in batches of 1, 7 (the last one short: 7 does not divide 10) or 64; without the dropout the model
    trains with, which is on again afterwards."""
    meta = data.load_meta(corpus)
    model = tiny_model(vocab_size=meta["vocab_size"], cls_token_id=meta["cls_id"], sep_token_id=meta["sep_id"],
                       pad_token_id=meta["pad_id"], mask_token_id=meta["mask_id"], attention_dropout=0.1)
    T, n = 64, 10
    by_size = {b: train.validation_losses(model, corpus, T, n, b, torch.device("cpu")) for b in (1, 7, 64)}
    assert model.training  # a run with --dropout validates without it, then trains with it again
    model.eval()
    for objective, rate in (("mlm", 0.15), ("clm", 0.0)):
        (x, y), = data.val_batches(corpus, T, n, n, objective, rate)
        with torch.no_grad():
            logits, _ = model(x, causal=objective == "clm")  # every position's logits: not the sparse path
        per_token = F.cross_entropy(logits.double().flatten(0, 1), y.flatten(), reduction="none").view(n, T)
        labelled = y != -100
        expected = (per_token.sum() / labelled.sum()).item()
        for b, losses in by_size.items():
            assert losses[f"val_{objective}"] == pytest.approx(expected, rel=1e-6), (objective, b)
        # the test can fail: the batches of 7 hold different numbers of labelled tokens
        means = [per_token[i:i + 7].sum() / labelled[i:i + 7].sum() for i in range(0, n, 7)]
        assert abs(torch.stack(means).mean().item() - expected) > 1e-4 * expected, objective


def test_validation_under_ddp_scores_each_window_once_and_reports_one_process_losses(corpus, monkeypatch):
    """Under torchrun every rank validates its share, every world-th micro-batch, and the all-reduced sums give the
    one-process losses. 4 ranks, as threads through train.validate, over 5 windows in micro-batches of 2 (batches
    of 2, 2 and 1): the fourth scores nothing yet joins the all-reduce, which sums the ranks' tensors at a barrier
    (a rank that skipped it would break the barrier, not hang the test); rank 0 alone logs."""
    meta = data.load_meta(corpus)
    model = tiny_model(vocab_size=meta["vocab_size"], cls_token_id=meta["cls_id"], sep_token_id=meta["sep_id"],
                       pad_token_id=meta["pad_id"], mask_token_id=meta["mask_id"]).eval()
    T, n, micro, world = 64, 5, 2, 4
    one = train.validation_losses(model, corpus, T, n, micro, torch.device("cpu"))
    full = {objective: next(data.val_batches(corpus, T, n, n, objective, rate))[0]
            for objective, rate in (("mlm", 0.15), ("clm", 0.0))}  # every window, in one batch
    assert all(len({tuple(row) for row in x.tolist()}) == n for x in full.values())  # a row names its window
    val_batches, scored, me = data.val_batches, {}, threading.local()

    def recording(*args, **kwargs):  # which windows each rank scores
        for x, y in val_batches(*args, **kwargs):
            windows = [next(j for j, row in enumerate(full[args[4]]) if torch.equal(row, r)) for r in x]
            scored.setdefault(args[4], {}).setdefault(me.rank, []).extend(windows)
            yield x, y
    barrier, given = threading.Barrier(world, timeout=60), [None] * world

    def all_reduce(tensor):  # gloo's sum over the ranks
        given[me.rank] = tensor.clone()
        barrier.wait()
        tensor.copy_(sum(given))
        barrier.wait()
    monkeypatch.setattr(data, "val_batches", recording)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    logged, tracked = [], []

    def rank(k):  # what train.setup builds: a run directory and trackers on rank 0 only
        me.rank = k
        cfg = argparse.Namespace(data=corpus, seq_len=T, eval_sequences=n, batch_size=micro * world, dtype="bfloat16",
                                 separate_documents=False)
        r = argparse.Namespace(cfg=cfg, meta=meta, model=copy.deepcopy(model), device=torch.device("cpu"), rank=k,
                               world=world, accum=1, loader=argparse.Namespace(micro_batch_size=micro),
                               run_dir=argparse.Namespace(append_log=logged.append) if k == 0 else None,
                               tracker=argparse.Namespace(log=tracked.append if k == 0 else None))
        return train.validate(r, dict(phase="mlm", step=1, tokens=0))
    with concurrent.futures.ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(rank, k) for k in range(world)]
    for objective in full:  # each window scored once, by the rank that holds its batch
        assert scored[objective] == {0: [0, 1], 1: [2, 3], 2: [4]}, objective
    records = [future.result() for future in futures]
    for record in records:
        assert (record["phase"], record["step"], record["tokens"]) == ("mlm", 1, 0)
        for key in ("val_mlm", "val_clm"):  # the sums in another order: equal to float64 rounding
            assert record[key] == pytest.approx(one[key], rel=1e-12), key
    assert logged == tracked == records[:1]


def test_a_batch_without_labels_adds_nothing_and_trains_nothing():
    """A micro-batch where nothing is labelled: loss 0 and zero gradients (no NaN, no crash), and nothing
    added to the logged loss's token sum or count."""
    model = tiny_model()
    x, y = torch.randint(0, 256, (2, 32)), torch.full((2, 32), -100)
    _, loss = model(x, labels=y)
    loss.backward()
    assert loss.item() == 0 and all(p.grad.abs().sum() == 0 for p in model.parameters())
    summed, n = train.token_sum(loss, y)
    assert (summed.item(), n) == (0, 0)


# --- runs ------------------------------------------------------------------------------------------


def test_a_resume_keeps_a_schedule_shared_with_its_parent_within_its_budget(corpus, tmp_path):
    """A hand-off that continues its parent's schedule must end within it, at the hand-off and when a --resume
    gives it a longer budget: steps past the schedule's end would run at its floor, counted past its budget."""
    B = 8 * STEP_TOKENS
    run(corpus, tmp_path / "clm", "--phase=clm", "--schedule=wsd", f"--schedule_tokens={B}",
        f"--tokens={2 * STEP_TOKENS}", "--decay_frac=0.25")
    mlm = [f"--init_from={tmp_path / 'clm'}", "--phase=mlm", "--schedule=wsd", f"--schedule_tokens={B}"]
    with pytest.raises(InputError, match="after the 1,024 its parent ran exceeds --schedule_tokens=4,096"):
        run(corpus, tmp_path / "x", *mlm, f"--tokens={B}")
    run(corpus, tmp_path / "mlm", *mlm, f"--tokens={6 * STEP_TOKENS}", "--max_steps=2")
    with pytest.raises(InputError, match="after the 1,024 its parent ran exceeds --schedule_tokens=4,096"):
        train.main([f"--out_dir={tmp_path / 'mlm'}", "--resume", f"--tokens={B}"])
    assert latest(tmp_path / "mlm")["phase_step"] == 2  # nothing trained, nothing written


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_exact_resume_is_bit_identical(dropout, corpus, tmp_path):
    """A run stopped at step 2 and resumed equals the run that went straight on, bit for bit; with dropout too,
    whose random stream the resume restores where the stopped run left it (not from the seed again)."""
    flags = ["--phase=mlm", f"--tokens={6 * STEP_TOKENS}", f"--dropout={dropout}"]
    straight, _ = run(corpus, tmp_path / "straight", *flags)
    run(corpus, tmp_path / "stopped", *flags, "--max_steps=2")
    assert latest(tmp_path / "stopped")["phase_step"] == 2
    with pytest.raises(InputError, match="--resume"):  # nothing written is overwritten by accident
        run(corpus, tmp_path / "stopped", *flags)
    resumed, state = run(corpus, tmp_path / "stopped", "--resume")
    assert state["phase_step"] == 6 and state["adam_t"] == 6
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    log = [json.loads(line) for line in open(tmp_path / "stopped" / "log.jsonl")]
    assert [r["step"] for r in log if "loss" in r] == [1, 2, 3, 4, 5, 6]  # training records; validation has its own


def test_a_resume_on_another_number_of_processes_says_its_dropout_streams_start_again(corpus, tmp_path, capsys):
    """Each process's RNG streams are saved: a resume on another number of processes starts them again from the
    seed, and its start line lists them as fresh, not as carried over (a checkpoint of two processes stood in for
    by a copy of one process's streams); where the micro-batch follows the number of processes, it says that the
    tokens' weights in a step change too."""
    flags = ["--phase=mlm", f"--tokens={4 * STEP_TOKENS}", "--dropout=0.1", "--micro_batch_size=0"]
    run(corpus, tmp_path / "run", *flags, "--max_steps=2")
    state_file = latest(tmp_path / "run")["dir"] + "/state.json"
    state = json.loads(open(state_file).read())
    state["rng"] = state["rng"] * 2
    open(state_file, "w").write(json.dumps(state))
    capsys.readouterr()
    train.main([f"--out_dir={tmp_path / 'run'}", "--resume"])
    printed = capsys.readouterr().out
    start = next(line for line in printed.splitlines() if line.startswith("resume "))
    carried, fresh = start.split("; fresh: ")
    assert "RNG streams" in fresh and "RNG streams" not in carried and "data position" in carried, start
    # --micro_batch_size=0 (this recipe's): the micro-batches change size, and with them each token's weight
    assert "note: --micro_batch_size=0 gives each of the 2 processes before a micro-batch of another size" in printed


def test_a_resume_with_changed_code_says_it_is_not_bit_for_bit(corpus, tmp_path, monkeypatch, capsys):
    """A resume under other code or packages warns, and the checkpoints keep the code of every stretch of steps
    (state.json's earlier_code: the code up to the step where other code took over), not only the newest."""
    from machinery import progress, rundir
    _, state = run(corpus, tmp_path / "run", "--phase=mlm", f"--tokens={4 * STEP_TOKENS}", "--max_steps=1")
    capsys.readouterr()
    real, first = progress.code_version, state["code"]
    assert state["earlier_code"] == []
    edited = {**real(), "sha256": "an edited data.py"}
    for module in (progress, rundir):
        monkeypatch.setattr(module, "code_version", lambda: edited)
    _, state = run(corpus, tmp_path / "run", "--resume", "--max_steps=1")
    err = capsys.readouterr().err
    assert "warning: the code changed since" in err and "packages changed" not in err
    assert state["code"] == edited and state["earlier_code"] == [dict(until_step=1, code=first)]
    # the same code on another torch: also not bit for bit, and the warning names what changed
    other = {**edited, "versions": {**real()["versions"], "torch": "2.11.0+cu130"}}
    for module in (progress, rundir):
        monkeypatch.setattr(module, "code_version", lambda: other)
    _, state = run(corpus, tmp_path / "run", "--resume", "--max_steps=1")
    err = capsys.readouterr().err
    assert "warning: the code changed" not in err
    assert f"warning: packages changed since {tmp_path / 'run'}'s checkpoint was written (torch " \
           f"{real()['versions']['torch']} -> 2.11.0+cu130)" in err
    assert state["earlier_code"] == [dict(until_step=1, code=first), dict(until_step=2, code=edited)]
    _, state = run(corpus, tmp_path / "run", "--resume")  # the same code again: nothing to add
    assert state["phase_step"] == 4 and state["code"] == other and len(state["earlier_code"]) == 2


def test_a_hand_off_under_changed_code_says_so(corpus, tmp_path, monkeypatch, capsys):
    """An edit between the phases (often the ablation itself): the hand-off says that the run it continues was
    written by other code, naming both; under the same code it says nothing of it."""
    from machinery import progress, rundir
    _, state = run(corpus, tmp_path / "run", "--phase=mlm", f"--tokens={2 * STEP_TOKENS}")
    decay = [f"--init_from={tmp_path / 'run'}", "--phase=decay", f"--tokens={STEP_TOKENS}"]
    capsys.readouterr()
    train.main([*decay, f"--out_dir={tmp_path / 'same'}"])
    assert "written by other code" not in capsys.readouterr().out
    edited = {**progress.code_version(), "sha256": "an edited data"}
    for module in (progress, rundir):
        monkeypatch.setattr(module, "code_version", lambda: edited)
    train.main([*decay, f"--out_dir={tmp_path / 'edited'}"])
    assert f"note: {tmp_path / 'run'} was written by other code (a script or a module of machinery/ changed since: " \
           f"code {state['code']['sha256']} then, an edited data now)" in capsys.readouterr().out


def test_the_loss_on_the_page_is_the_loss_that_trains(corpus, tmp_path, monkeypatch, capsys):
    """model.py's cross_entropy trains by default and the start line says so: label smoothing added to it changes
    the run's losses and weights. --loss=fused, named on the start line, trains the same run to rounding, and is
    refused while the loss on the page computes something else."""
    import model
    flags = [f"--tokens={2 * STEP_TOKENS}"]
    plain, _ = run(corpus, tmp_path / "plain", *flags)
    assert "loss: model.py's cross_entropy" in capsys.readouterr().out
    fused, _ = run(corpus, tmp_path / "fused", *flags, "--loss=fused")
    assert "loss: fused (model.py's cross_entropy in row chunks" in capsys.readouterr().out
    assert all(torch.allclose(plain[k], fused[k], atol=1e-5) for k in plain)
    page = model.cross_entropy
    monkeypatch.setattr(model, "cross_entropy", lambda h, w, b, y: F.cross_entropy(  # an ablation: label smoothing
        F.linear(h, w, b), y, label_smoothing=0.1) if len(y) else page(h, w, b, y))
    smoothed, _ = run(corpus, tmp_path / "smoothed", *flags)
    assert lrs(tmp_path / "smoothed") == lrs(tmp_path / "plain")
    losses = [[r["loss"] for r in map(json.loads, open(tmp_path / name / "log.jsonl")) if "loss" in r]
              for name in ("plain", "smoothed")]
    assert all(a != b for a, b in zip(*losses)), losses  # smoothing moves the loss of every step (up or down)
    assert not torch.equal(plain["model.layers.0.attn.Wqkv.weight"], smoothed["model.layers.0.attn.Wqkv.weight"])
    with pytest.raises(InputError, match="loss=fused computes model.py's cross_entropy as first written"):
        run(corpus, tmp_path / "refused", *flags, "--loss=fused")


def test_a_save_that_would_not_reload_as_it_trained_says_so(corpus, tmp_path, monkeypatch, capsys):
    """The first save of a run is reloaded as a user would and compared with the model in memory: a clean run says
    nothing; an activation hard-coded in model.py (SiLU where config.json says gelu) is one warning that
    transformers loads another model; a module swapped on the model after it was built (not in its config) is one
    warning that the folder does not reload as the model that trained."""
    import model
    flags = [f"--tokens={2 * STEP_TOKENS}", "--save_interval=1"]
    card = lambda name: (tmp_path / name / "README.md").read_text()
    run(corpus, tmp_path / "clean", *flags)
    assert "warning" not in capsys.readouterr().err
    assert "It loads with `transformers` (`AutoModelForMaskedLM`, `pipeline(\"fill-mask\")`) as it trained" in \
        card("clean")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(model.ACTIVATIONS, "gelu", F.silu)  # a hard-coded edit: the config field still says gelu
        run(corpus, tmp_path / "silu", *flags)
        err = capsys.readouterr().err
        assert err.count("warning: ") == 1 and f"warning: transformers loads {tmp_path / 'silu'} as another model" in err
        assert "code edited in place of a config field" in err and "hidden_activation" in err
        assert "**transformers loads it as another model**" in card("silu") and "as it trained (" not in card("silu")
        mp.setitem(sys.modules, "transformers", None)  # not installed: no oracle, and the card does not claim one
        run(corpus, tmp_path / "unchecked", *flags)
        assert "whether transformers loads it as it trained was not checked (transformers was not installed" in \
            card("unchecked")
        mp.setattr(train.progress, "check_saved", lambda *a: 1 / 0)  # the check itself fails: a warning, and the card
        run(corpus, tmp_path / "failed", *flags)                      # says it was not checked, not why it guesses
        assert "whether it reloads as it trained was not checked (the check failed" in card("failed")
    capsys.readouterr()
    build = train.build_model

    def swapped(*args):  # an edit in train.py after the model is built: block 1 local no more
        built, source = build(*args)
        built.model.layers[1].local = False
        return built, source
    monkeypatch.setattr(train, "build_model", swapped)
    run(corpus, tmp_path / "swapped", *flags)
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1 and f"warning: {tmp_path / 'swapped'} does not reload as the model that " \
        "trained" in err
    assert "**It does not reload as the model that trained**" in card("swapped")


@pytest.mark.parametrize("flags", [[], ["--separate_documents", "--dtype=float32"]])
def test_eval_mlm_on_a_run_validates_as_the_run_did(corpus, tmp_path, capsys, flags):
    """`eval.py mlm RUN --data=D` with no other flag reads the run's own validation setting (its --eval_sequences
    windows of its --seq_len tokens, its dtype, and documents kept apart where it kept them): the losses its log
    ends with."""
    import eval as ev
    run(corpus, tmp_path / "run", f"--tokens={2 * STEP_TOKENS}", *flags)
    last = [json.loads(line) for line in open(tmp_path / "run" / "log.jsonl") if "val_mlm" in line][-1]
    got = ev.mlm(str(tmp_path / "run"), corpus, device="cpu")
    assert got == pytest.approx({"val_mlm": last["val_mlm"], "val_clm": last["val_clm"]}, abs=2e-6)
    setting = ev.validation_setting(ev.inspect_model(tmp_path / "run", ev.ModernBERT), corpus)
    want = (2, 128, "float32", data.load_meta(corpus)["sep_id"]) if flags else (2, 128, "bfloat16", None)
    assert setting == want


def test_a_continued_run_states_the_architecture_it_keeps(corpus, tmp_path, monkeypatch, capsys):
    """The start names the shape and attention settings a run trains (window, global-layer period, activation). A
    run that continues a checkpoint keeps the checkpoint's, says so, and warns where this code would build a fresh
    model otherwise (a window edited in the preset after the run was made); --dropout, the one flag that sets a
    config field, is applied to a continued run and said; --preset is refused (tests/test_train_inputs.py)."""
    run(corpus, tmp_path / "run", f"--tokens={2 * STEP_TOKENS}")
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("architecture: "))
    assert "4 blocks 128 wide" in line and "with gelu" in line and "global attention in block(s) 0, 3 " \
        "(global_attn_every_n_layers=3)" in line and "a window of 128 tokens (64 each side)" in line
    monkeypatch.setitem(train.PRESETS, "tiny", {**train.PRESETS["tiny"], "local_attention": 32})  # the ablation
    run(corpus, tmp_path / "fresh", f"--tokens={STEP_TOKENS}")
    assert "a window of 32 tokens (16 each side)" in capsys.readouterr().out
    for name, flags in {"handoff": [f"--init_from={tmp_path / 'run'}", "--dropout=0.1"],
                        "weights": [f"--init_from={tmp_path / 'run'}", "--weights_only"]}.items():
        train.main([f"--data={corpus}", f"--out_dir={tmp_path / name}", f"--tokens={STEP_TOKENS}", *flags,
                    *(f for f in SMALL if not f.startswith("--preset="))])  # the edited tiny is not the run's
        out, err = capsys.readouterr()
        line = next(x for x in out.splitlines() if x.startswith("architecture: "))
        assert "a window of 128 tokens" in line and "; kept from " in line, name
        assert f"attention dropout {0.1 if name == 'handoff' else 0.0}" in line, name
        assert "warning: this code builds a fresh model with local_attention=32; this run keeps " \
            "local_attention=128 from" in err, name
        saved = json.loads((tmp_path / name / "config.json").read_text())
        assert saved["local_attention"] == 128 and saved["attention_dropout"] == (0.1 if name == "handoff" else 0.0)
    fresh = train.fresh_config  # a SwiGLU made where a fresh model's configuration is: recorded as no preset
    monkeypatch.setattr(train, "fresh_config", lambda cfg, meta: fresh(cfg, meta).replace(hidden_activation="silu"))
    run(corpus, tmp_path / "swiglu", f"--tokens={STEP_TOKENS}")
    assert latest(tmp_path / "swiglu")["config"]["preset"] == ""
    assert "(custom architecture, " in (tmp_path / "swiglu" / "README.md").read_text()


def test_what_an_objective_is_comes_from_its_table_entry(monkeypatch):
    """A new objective is one function and one entry in data.OBJECTIVES: the checks, the FLOP count's share of
    predicted positions and the start line read its entry (causal, masked), never its name."""
    monkeypatch.setitem(data.OBJECTIVES, "next2", data.Objective(data.clm_labels, causal=True, masked=False))
    cfg = configure(small("--data=d", "--objective=next2", "--mask_rate=0"))  # no masking rate to check
    assert cfg.objective == "next2"
    monkeypatch.setitem(data.OBJECTIVES, "ramp", data.Objective(data.mlm_labels, causal=False, masked=True))
    with pytest.raises(InputError, match="--mask_rate=0.0: expected 0 < rate < 1"):
        configure(small("--data=d", "--objective=ramp", "--mask_rate=0"))
    config = ModernBERTConfig.from_preset("tiny", **BYTE_IDS)
    assert flag_rules.preset_of(config, train.PRESETS) == "tiny"
    assert flag_rules.preset_of(config.replace(hidden_activation="silu"), train.PRESETS) == ""  # a SwiGLU: no preset


def test_a_save_finds_its_steps_validation_already_logged(corpus, tmp_path, monkeypatch):
    """A kill right after a save loses no curve point, and the run's loss picture (drawn at the save) shows
    the validation of the step it saves."""
    logs_at_save, save = [], train.save

    def spy(r):
        logs_at_save.append([json.loads(line) for line in open(r.run_dir.log_path)])
        save(r)
    monkeypatch.setattr(train, "save", spy)
    run(corpus, tmp_path / "run", f"--tokens={4 * STEP_TOKENS}", "--eval_interval=2", "--save_interval=2")
    assert [[r["step"] for r in log if "val_mlm" in r] for log in logs_at_save] == [[2], [2, 4]]


def test_phase_hand_off_carries_moments_and_step_counter(corpus, tmp_path):
    run(corpus, tmp_path / "clm", "--phase=clm", f"--tokens={10 * STEP_TOKENS}")
    clm_state = latest(tmp_path / "clm")
    decay, state = run(corpus, tmp_path / "decay", "--phase=decay", f"--init_from={tmp_path / 'clm'}",
                       "--warmup_tokens=0")  # SMALL's warmup would apply to any schedule
    assert state["adam_t"] == 11 and state["phase_step"] == 1 and state["phase"] == "decay"
    assert state["config"]["tokens"] == STEP_TOKENS  # 10% of the Phase-1 budget by default
    with pytest.raises(InputError, match="less than one optimizer step"):  # a decay of no step is refused
        run(corpus, tmp_path / "short", "--phase=decay", f"--init_from={tmp_path / 'clm'}", "--tokens=100")

    # Rebuild the decay run's first step by hand from the saved CLM state, with torch.optim.AdamW; and the same step
    # under --grad_clip, with torch's clip_grad_norm_ (the carried moments make a clipped step another step).
    clipped, _ = run(corpus, tmp_path / "clipped", "--phase=decay", f"--init_from={tmp_path / 'clm'}",
                     "--warmup_tokens=0", "--grad_clip=0.05")  # far below the norm: clipped
    for clip, trained in ((0, decay), (0.05, clipped)):
        model = ModernBERT.from_pretrained(str(tmp_path / "clm"))
        moments = load_file(os.path.join(clm_state["dir"], "optimizer.safetensors"))
        loader = data.Loader(corpus, "train", 128, 4, 2, objective="mlm", mask_rate=0.15, data_seed=42, mask_seed=17)
        loader.load_state_dict(clm_state["loader"])
        for _ in range(loader.accum):
            x, y = loader.next()
            (model(x, labels=y)[1] / loader.accum).backward()
        if clip:
            assert torch.nn.utils.clip_grad_norm_(model.parameters(), clip) > 10 * clip
        peak, wd = 1e-3, 1e-5
        opt = torch_adamw_oracle(model, peak, wd)
        for name, p in model.named_parameters():
            m, v = (moments[f"{kind}.{name}"].clone() for kind in ("exp_avg", "exp_avg_sq"))
            opt.state[p] = {"step": torch.tensor(float(clm_state["adam_t"])), "exp_avg": m, "exp_avg_sq": v}
        for group in opt.param_groups:  # the decay's one step is its last: final_lr_frac (0.1) of the peak
            group["lr"] = 0.1 * peak
        fresh = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        for name, p in model.named_parameters():
            tied = name if name != "decoder.weight" else "model.embeddings.tok_embeddings.weight"
            assert torch.allclose(p, trained[tied], rtol=1e-5, atol=1e-7), (clip, name)
    # A fresh optimizer (zero moments, t = 1) would have moved the weights differently.
    moved = decay["model.layers.0.attn.Wqkv.weight"] - fresh["model.layers.0.attn.Wqkv.weight"]
    assert not torch.allclose(moved.abs(), torch.full_like(moved, 0.1 * peak), rtol=1e-3)


@pytest.mark.parametrize("phase, objective, rate", [(["--phase=clm"], "clm", 0.3),  # CLM reads no rate
                                                    (["--phase=mlm", "--mask_rate=0.4"], "mlm", 0.4)],
                         ids=["clm", "mlm"])
def test_a_step_trains_the_objective_its_phase_names(phase, objective, rate, corpus, tmp_path):
    """A fresh model's first step, rebuilt by hand: the phase's labels (CLM: the next token, under the causal mask;
    MLM: at the rate asked), the mean of the micro-batch means, torch.optim.AdamW. The run's weights and logged loss
    are these; a run that trained another objective, without the causal mask or at another rate would not be."""
    trained, _ = run(corpus, tmp_path / "run", *phase, f"--tokens={STEP_TOKENS}", "--warmup_tokens=0")
    torch.manual_seed(17)  # the scratch init, seeded by --seed, of the model the corpus sized
    model = ModernBERT(ModernBERTConfig.read(str(tmp_path / "run" / "config.json")))
    loader = data.Loader(corpus, "train", 128, 4, 2, objective=objective, mask_rate=rate, data_seed=42, mask_seed=17)
    summed, labelled = 0.0, 0
    for _ in range(loader.accum):
        x, y = loader.next()
        _, loss = model(x, labels=y, causal=objective == "clm")
        (loss / loader.accum).backward()
        summed, labelled = summed + loss.item() * (y != -100).sum().item(), labelled + (y != -100).sum().item()
    torch_adamw_oracle(model, 1e-3, 1e-5).step()  # no warmup: the peak rate
    for name, p in model.named_parameters():
        tied = name if name != "decoder.weight" else "model.embeddings.tok_embeddings.weight"
        assert torch.allclose(p, trained[tied], rtol=1e-5, atol=1e-7), name
    logged = [r["loss"] for r in map(json.loads, open(tmp_path / "run" / "log.jsonl")) if "loss" in r]
    assert logged == [pytest.approx(summed / labelled, abs=1e-5)]


def test_each_way_a_run_starts_carries_over_what_its_row_of_starts_says(corpus, tmp_path, capsys):
    """One step after each row of train.STARTS, from a parent stopped at 2 of 3 steps: Adam's t, the data position,
    the phase's step and the runs before it go on from the parent's where the row carries them and start from 0
    where it does not, and the first line names what is carried. (Weights, moments and RNG streams count in the
    hand-off and resume tests, which rebuild their numbers.)"""
    parent = tmp_path / "parent"
    run(corpus, parent, f"--tokens={3 * STEP_TOKENS}", "--max_steps=2")
    before = latest(parent)
    shutil.copytree(parent, tmp_path / "resume")
    capsys.readouterr()
    for how, flags in {"fresh": [], "weights": [f"--init_from={parent}", "--weights_only"],
                       "handoff": [f"--init_from={parent}"], "resume": ["--resume"]}.items():
        run(corpus, tmp_path / how, *flags, *([] if how == "resume" else [f"--tokens={STEP_TOKENS}"]))
        carries, state = train.STARTS[how], latest(tmp_path / how)
        line = next(line for line in capsys.readouterr().out.splitlines() if "; carries over: " in line)
        named = line.split("; carries over: ")[1].split("; fresh: ")[0].split(", ")
        assert named == [words for name, words in progress.CARRIED.items() if getattr(carries, name)] or \
            named == ["nothing"] and not any(dataclasses.astuple(carries)), (how, line)
        assert state["adam_t"] == (before["adam_t"] if carries.adam_t else 0) + 1, how
        assert state["loader"]["sequence"] == (before["loader"]["sequence"] if carries.data_position else 0) + 4, how
        assert state["phase_step"] == (before["phase_step"] if carries.phase else 0) + 1, how
        handed_on = before["history"] + [dict(phase="mlm", tokens=2 * STEP_TOKENS, dir=before["dir"])]
        assert state["history"] == (before["history"] if carries.phase else handed_on if carries.history else []), how


def test_across_ranks_shares_the_loss_the_stop_signal_and_the_norm():
    """One process: the step's mean over its labelled tokens (0 where none), the stop signal as asked, the norm."""
    loss_sum, norm = torch.tensor(6.0, dtype=torch.float64), torch.tensor(2.5)
    assert train.across_ranks(loss_sum, 3, False, norm) == (2.0, False, 2.5)
    assert train.across_ranks(loss_sum * 0, 0, True, norm) == (0.0, True, 2.5)


def test_freezing_leaves_frozen_blocks_bit_identical_and_out_of_the_clipping(corpus, tmp_path, monkeypatch):
    """--freeze=0-1 with gradient clipping on: frozen blocks stay bit-identical (stale moments, weight decay), and
    the rest trains exactly as in a run whose blocks 0-1 have no gradient at all (requires_grad off): their zeroed
    gradients are out of the clipping norm too."""
    run(corpus, tmp_path / "clm", "--phase=clm", f"--tokens={3 * STEP_TOKENS}")
    before = load_file(tmp_path / "clm" / "model.safetensors")
    moments = load_file(os.path.join(latest(tmp_path / "clm")["dir"], "optimizer.safetensors"))
    assert moments["exp_avg.model.layers.0.attn.Wqkv.weight"].abs().sum() > 0  # stale moments that could move it
    decay = ["--phase=decay", f"--init_from={tmp_path / 'clm'}", f"--tokens={3 * STEP_TOKENS}", "--weight_decay=0.1",
             "--grad_clip=0.05", "--log_interval=1"]  # every step clipped: its norm is far above 0.05
    after, _ = run(corpus, tmp_path / "decay", *decay, "--freeze=0-1")
    build = train.build_model

    def without_gradients(*args):  # the reference: blocks 0-1 take no part in the backward's parameters
        model, source = build(*args)
        model.model.layers[:2].requires_grad_(False)
        return model, source
    monkeypatch.setattr(train, "build_model", without_gradients)
    reference, _ = run(corpus, tmp_path / "reference", *decay)
    norms = {run: [r["grad_norm"] for r in map(json.loads, open(tmp_path / run / "log.jsonl")) if "loss" in r]
             for run in ("decay", "reference")}
    assert min(norms["decay"]) > 0.05 and norms["decay"] == pytest.approx(norms["reference"], rel=1e-6)
    for name, tensor in before.items():
        block = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        if block in (0, 1):
            assert torch.equal(tensor, after[name]) and torch.equal(tensor, reference[name]), f"frozen {name} moved"
        else:
            assert not torch.equal(tensor, after[name]), f"{name} did not train"
            # equal but for the last bits: the norm sums the frozen blocks' zeros in another order
            assert torch.allclose(after[name], reference[name], rtol=0, atol=1e-8), f"{name} trained otherwise"


# The paper's depths: ModernBERT-base has 22 blocks, large 28. (preset, --freeze, the blocks it names)
FREEZE_AT_DEPTH = [("base", "0-7", range(0, 8)), ("base", "8-14", range(8, 15)), ("base", "low", range(0, 8)),
                   ("base", "mid", range(8, 15)), ("base", "1,10,21", [1, 10, 21]), ("large", "0-7", range(0, 8)),
                   ("large", "low", range(0, 10)), ("large", "mid", range(10, 19)), ("large", "2-2", [2])]


@pytest.mark.parametrize("preset, spec, blocks", FREEZE_AT_DEPTH, ids=[f"{p} {s}" for p, s, _ in FREEZE_AT_DEPTH])
def test_freezing_selects_and_zeroes_exactly_the_named_blocks_at_the_papers_depths(preset, spec, blocks):
    """The frozen parameters of the full-size model (on the meta device: no memory) are those whose block index,
    read from the name, is named; on the same depth at a tiny width, exactly their gradients are zeroed."""
    config = ModernBERTConfig.from_preset(preset)
    with torch.device("meta"):
        full = ModernBERT(config)
    layers = freeze.parse_layers(spec, config.num_hidden_layers)
    assert layers == list(blocks)
    frozen = freeze.frozen_names(full, layers)
    expected = {n for n, _ in full.named_parameters() if n.split(".")[:2] == ["model", "layers"]
                and int(n.split(".")[2]) in blocks}
    assert frozen == expected and len({n.split(".")[2] for n in frozen}) == len(blocks)

    torch.manual_seed(0)
    narrow = ModernBERT(config.replace(hidden_size=32, intermediate_size=32, num_attention_heads=2, **BYTE_IDS))
    x = torch.randint(0, 256, (1, 16))
    narrow(x, labels=x)[1].backward()
    freeze.zero_frozen_grads(narrow, frozen)
    for i, block in enumerate(narrow.model.layers):
        zeroed = [p.grad.count_nonzero().item() == 0 for p in block.parameters()]
        assert all(zeroed) if i in blocks else not any(zeroed), (i, zeroed)


def torchrun(nproc, *args, cwd=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train.py"), *args]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=cwd)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def test_ddp_two_processes_equal_one_with_twice_the_accumulation(corpus, tmp_path):
    """Same global batches of the same micro-batches: 2 gloo processes x accumulation 2 vs 1 process x accumulation
    4, so that the gradient (the mean of the 4 micro-batch means) must be the same and be all-reduced after the
    last micro-step only: the same weights, and the same logged and validation losses, means over tokens. Also
    freezing under DDP."""
    batch = ["--batch_size=8", f"--tokens={3 * 2 * STEP_TOKENS}"]  # 3 steps of 8 sequences, micro-batches of 2
    common = [f"--data={corpus}", "--phase=mlm", "--freeze=1", "--weight_decay=0.1"]
    validate = ["--eval_interval=1", "--eval_sequences=3"]  # in micro-batches of 2: a full one and a short one
    out = torchrun(2, *common, *small(*batch, *validate), f"--out_dir={tmp_path / 'two'}")
    assert "2 micro x 2 accumulation x 2 process(es)" in out
    train.main([*common, *small(*batch, *validate), f"--out_dir={tmp_path / 'one'}"])
    two = load_file(tmp_path / "two" / "model.safetensors")
    one = load_file(tmp_path / "one" / "model.safetensors")
    for name in one:
        assert (one[name] - two[name]).abs().max().item() <= 1e-5, name

    def losses(run):  # each step's logged loss, then its validation losses
        records = [json.loads(line) for line in open(tmp_path / run / "log.jsonl")]
        return [r[k] for r in records for k in ("loss", "val_mlm", "val_clm") if k in r]
    assert len(losses("one")) == 3 * 3 and losses("one") == pytest.approx(losses("two"), rel=1e-5)
    # One process in micro-batches of 8 (and validation in one batch of 3) trains another gradient, a mean of
    # micro-batch means, but not at step 1: the warmup runs it at lr 0. So step 1's logged loss and validation, on
    # the same weights and tokens, equal the 2 processes' (to the 5 decimals of the logged loss); a mean of
    # micro-batch means would not.
    train.main([*common, *small(*batch, *validate, "--micro_batch_size=0", "--max_steps=1"),
                f"--out_dir={tmp_path / 'eight'}"])
    assert losses("eight") == pytest.approx(losses("two")[:3], rel=2e-6)
    torch.manual_seed(17)  # the scratch init, seeded by --seed, of the model the corpus sized
    init = ModernBERT(ModernBERTConfig.read(str(tmp_path / "one" / "config.json"))).state_dict()
    for name, tensor in two.items():
        assert torch.equal(tensor, init[name]) == name.startswith("model.layers.1."), name


def test_non_finite_loss_stops_without_touching_the_checkpoint(corpus, tmp_path):
    out = tmp_path / "run"  # warmup: step 1 runs at lr 0, step 2 at 5e29 blows the weights up
    with pytest.raises(InputError, match="non-finite loss .* at step 3"):
        run(corpus, out, "--phase=mlm", f"--tokens={4 * STEP_TOKENS}", "--lr=1e30", "--allow_high_lr",
            "--save_interval=1")
    state = latest(out)
    assert state["phase_step"] == 2
    tensors = {**load_file(out / "model.safetensors"), **load_file(os.path.join(state["dir"], "optimizer.safetensors"))}
    assert all(torch.isfinite(t).all() for t in tensors.values())


def test_bad_data_is_reported_before_training(corpus, tmp_path):
    with pytest.raises(InputError, match="meta.json: missing"):
        train.main([f"--data={tmp_path}", *SMALL, f"--out_dir={tmp_path / 'out'}"])
    with pytest.raises(InputError, match="seq_len 5000000 is longer than the data"):
        train.main([f"--data={corpus}", *small("--seq_len=5000000", "--tokens=1e12"), f"--out_dir={tmp_path / 'out'}"])
    with pytest.raises(InputError, match="cannot be split into micro-batches of 3 on 1 process"):
        train.main([f"--data={corpus}", *small("--micro_batch_size=3"), f"--out_dir={tmp_path / 'out'}"])


def test_demo_runs_from_a_fresh_directory_and_transformers_loads_the_result(tmp_path):
    """`python train.py` alone: builds data/demo, trains the tiny preset, writes a Hugging Face directory."""
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), "--max_steps=3"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "building the embedded demo corpus" in result.stdout and "saved out/demo-mlm at step 3" in result.stdout
    transformers = pytest.importorskip("transformers")
    run_dir = tmp_path / "out" / "demo-mlm"
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(run_dir), attn_implementation="sdpa").eval()
    ours = ModernBERT.from_pretrained(str(run_dir)).eval()
    ids = torch.randint(0, 256, (2, 300))
    with torch.no_grad():
        assert (hf(input_ids=ids).logits - ours(ids)[0]).abs().max().item() <= 1e-4
    state = latest(run_dir)
    assert state["tokenizer"] == data.load_meta(str(tmp_path / "data" / "demo"))["tokenizer"] and state["code"]["sha256"] and math.isfinite(json.loads(
        (run_dir / "log.jsonl").read_text().splitlines()[-1])["loss"])


def check_hugging_face_directory(run_dir, tokenizer):
    """The run directory is a complete Hugging Face model: fill-mask works offline, ids equal data.py's."""
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(run_dir))
    for text in ("The function returns a list of strings.", "naïve café — ünïcode [MASK] and [SEP] inside"):
        assert hf_tok(text)["input_ids"] == [tokenizer.cls_id, *tokenizer.encode(text), tokenizer.sep_id]
    fill = transformers.pipeline("fill-mask", model=str(run_dir), device="cpu")
    guesses = fill(f"Return the {hf_tok.mask_token} of the list.")
    assert len(guesses) == 5 and all(math.isfinite(g["score"]) for g in guesses)


@pytest.mark.parametrize("nproc", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_headline_command_on_n_processes(nproc, demo_corpus, tmp_path):
    """`torchrun --nproc_per_node=N train.py --phase clm` on the demo, as the README says (2 steps here)."""
    (tmp_path / "data").mkdir()
    os.symlink(demo_corpus, tmp_path / "data" / "demo")  # the demo corpus, already built
    out = torchrun(nproc, "--phase", "clm", "--max_steps=2", cwd=tmp_path)
    assert f"16 sequences = {16 // nproc} micro x 1 accumulation x {nproc} process(es)" in out
    assert "saved out/demo-clm at step 2" in out
    check_hugging_face_directory(tmp_path / "out" / "demo-clm",
                                 data.load_tokenizer(data.load_meta(demo_corpus)["tokenizer"]))


@pytest.mark.slow  # two launches of torchrun with 2 processes
def test_ctrl_c_under_torchrun_prints_the_torchrun_command_that_resumes(corpus, tmp_path):
    """Ctrl-C in a terminal signals torchrun's process group (its workers have sessions of their own): the agent
    forwards one SIGINT to each worker, which save and print the torchrun command to continue; then torchrun prints
    its own SignalException traceback and exits 1. Our part prints none; the command, run as printed, resumes to
    the end, at the weights of an uninterrupted run (1 process: the same gradients to float rounding)."""
    flags = [f"--data={corpus}", *small(f"--tokens={8 * STEP_TOKENS}", "--log_interval=1", "--threads=1")]
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(ROOT / "train.py"), *flags, f"--out_dir={out}"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path, start_new_session=True)
    for line in proc.stdout:
        if line.startswith("mlm step 2/"):
            os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the terminal signals the foreground group
            break
    printed = proc.communicate()[0]
    assert proc.returncode == 1 and "interrupted by a signal" in printed, printed[-3000:]
    assert printed.count("Traceback") == 1 and "SignalException" in printed, printed[-3000:]  # torchrun's only
    assert "torchrun reports the stop next, with a traceback of its own and exit status 1" in printed
    (resume,) = printed_commands(printed)["continue"]
    assert resume == f"torchrun --standalone --nproc_per_node=2 {ROOT / 'train.py'} --resume --out_dir={out}"
    assert 2 <= latest(out)["phase_step"] < 8
    result = subprocess.run(resume, shell=True, env=env, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode == 0 and "done: phase mlm" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
    log = [json.loads(line) for line in open(out / "log.jsonl")]
    assert [r["step"] for r in log if "loss" in r] == list(range(1, 9))
    train.main([*flags, f"--out_dir={tmp_path / 'one'}"])
    one, two = load_file(tmp_path / "one" / "model.safetensors"), load_file(out / "model.safetensors")
    assert all((one[k] - two[k]).abs().max().item() <= 1e-5 for k in one)


@pytest.mark.slow  # SIGKILL and resume are also covered by the phase-switch test
def test_interrupted_demo_resumes_to_the_uninterrupted_result(demo_corpus, tmp_path):
    """Kill -9 the demo after its first checkpoint, --resume it: the same weights as a run never interrupted."""
    flags = [f"--data={demo_corpus}", f"--tokens={8 * 16 * 256}", "--save_interval=2", "--threads=1"]
    train.main([*flags, f"--out_dir={tmp_path / 'straight'}"])
    out = tmp_path / "run"
    killed_after_first_save([*flags, f"--out_dir={out}"], out, step=2)
    train.main([f"--out_dir={out}", "--resume"])
    straight, resumed = load_file(tmp_path / "straight" / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


# --- the warmup-stable-decay schedule and a phase switch inside one budget ------------------------------


def test_wsd_schedule_at_its_key_points():
    """20 steps of 50 tokens; the decay's 4 steps (the last 20%) run 1-sqrt from the peak at the first of them
    to final_lr_frac at the last."""
    peak = 1e-3
    wsd = train.Config(lr=peak, schedule="wsd", warmup_tokens=100, tokens=1000, batch_size=1, seq_len=50,
                       decay_frac=0.2, final_lr_frac=0.1)
    assert train.learning_rate(wsd, 0) == 0.0 and train.learning_rate(wsd, 50) == pytest.approx(peak / 2)
    assert train.learning_rate(wsd, 100) == peak and train.learning_rate(wsd, 800) == peak  # stable until 80%
    assert train.learning_rate(wsd, 850) == pytest.approx(peak * (0.1 + 0.9 * (1 - math.sqrt(1 / 3))))
    assert train.learning_rate(wsd, 950) == pytest.approx(0.1 * peak)  # the last step: final_lr_frac
    fixed = train.Config(**{**wsd.__dict__, "decay_tokens": 150})  # a token count overrides the fraction
    assert train.learning_rate(fixed, 850) == peak
    assert train.learning_rate(fixed, 900) == pytest.approx(peak * (0.1 + 0.9 * (1 - math.sqrt(0.5))))
    # one schedule over two phases: each part reads the whole budget's curve at its own offset
    part = train.Config(**{**wsd.__dict__, "tokens": 250, "schedule_tokens": 1000})
    assert [train.learning_rate(part, t) for t in range(0, 1001, 50)] == \
        [train.learning_rate(wsd, t) for t in range(0, 1001, 50)]


def test_the_reference_states_the_biphasic_cpu_schedule_that_runs():
    """docs/reference.md's learning rates of the biphasic cpu run are learning_rate's at reproduce.py's cpu scale,
    and the ones the committed report's runs logged (it once quoted a B of 200 steps the scale no longer has)."""
    from reproduce import BIPHASIC as scales
    s, per = scales["cpu"], train.RECIPES["cpu"]["batch_size"] * train.RECIPES["cpu"]["seq_len"]
    steps, warm, B = s["steps"], s["warmup_steps"], s["steps"] * per
    parts = [train.Config(**{**train.RECIPES["cpu"], "phase": phase, "schedule": "wsd", "schedule_tokens": B,
                             "warmup_tokens": warm * per, "tokens": tokens})
             for phase, tokens in (("clm", B // 4), ("mlm", B - B // 4))]
    lr = [train.learning_rate(parts[k >= steps // 4], k * per) for k in range(steps)]  # lr[k]: step k + 1
    alone = train.Config(**{**parts[1].__dict__, "tokens": B})
    assert lr == [train.learning_rate(alone, k * per) for k in range(steps)]  # MLM alone: the same at every step
    report = json.loads((ROOT / "docs" / "biphasic-cpu" / "report.json").read_text())["runs"]
    logged = [rate for run in ("clm25-r1", "clm25-mlm-r1") for _, rate in report[run]["lr"]]
    assert logged == pytest.approx(lr, rel=1e-12, abs=0)
    decay = steps - max(k for k in range(steps) if lr[k] == lr[warm])  # from the last step at the peak to the end
    at = lambda k: f"{lr[k - 1]:.2e}".replace("e-0", "e-")  # the rate of step k, as the text writes it
    text = " ".join((ROOT / "docs" / "reference.md").read_text().split())
    for said in (f"(B = {steps} steps of {per:,} tokens, peak 1e-3, warmup over {warm} steps,",
                 f"reaches {at(warm)} at step {warm} and the peak 1e-3 at step {warm + 1};",
                 f"(step {steps // 4} of CLM, step 1 of MLM)",
                 f"the decay's {decay} steps run from the peak at step {steps - decay + 1} of B through "
                 f"{at(steps - decay + 2)} at step {steps - decay + 2}", f"to 1e-4, the floor, in step {steps}."):
        assert said in text, said


BIPHASIC = ["--schedule=wsd", f"--schedule_tokens={6 * STEP_TOKENS}", "--decay_frac=0.5", "--save_interval=1"]


def biphasic(corpus, root, kill_in=None):
    """CLM for 2 of 6 steps, then MLM at 40% for 4, one WSD schedule; `kill_in`: SIGKILL that part after its
    first checkpoint, then --resume it."""
    parts = {"clm": ["--phase=clm", f"--tokens={2 * STEP_TOKENS}"],
             "mlm": ["--phase=mlm", "--mask_rate=0.4", f"--tokens={4 * STEP_TOKENS}", f"--init_from={root / 'clm'}"]}
    for name, part in parts.items():
        argv = [f"--data={corpus}", f"--out_dir={root / name}", *small(*BIPHASIC, *part)]
        if name == kill_in:
            killed_after_first_save(argv, root / name)
            train.main([f"--out_dir={root / name}", "--resume"])
        else:
            train.main(argv)
    return load_file(root / "mlm" / "model.safetensors")


def killed_after_first_save(argv, out, step=1):
    """`python train.py argv`, killed with SIGKILL right after it saved step `step`."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *argv], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stdout:
        if line == f"saved {out} at step {step}\n":
            proc.kill()
            break
    proc.wait()
    assert proc.returncode == -9, "the run finished before it could be killed"


def test_a_hand_off_to_the_same_phase_equals_the_straight_run(corpus, tmp_path, capsys):
    """CLM for 2 of 6 steps handed off to CLM for the other 4, in one schedule, ends bit-identical to 6 straight
    steps: reproduce.py's biphasic study trains its CLM-only model as the continuation of CLM 25% and 50%."""
    flags = [f"--data={corpus}", *small(*BIPHASIC, "--phase=clm")]
    train.main([*flags, f"--tokens={6 * STEP_TOKENS}", f"--out_dir={tmp_path / 'straight'}"])
    assert "next:" not in capsys.readouterr().out  # its schedule ended with its own decay
    train.main([*flags, f"--tokens={2 * STEP_TOKENS}", f"--out_dir={tmp_path / 'first'}"])
    assert f"--schedule=wsd --schedule_tokens={6 * STEP_TOKENS} --tokens={4 * STEP_TOKENS}   # the rest of its " \
        "schedule" in capsys.readouterr().out
    train.main([*flags, f"--tokens={4 * STEP_TOKENS}", f"--init_from={tmp_path / 'first'}",
                f"--out_dir={tmp_path / 'then'}"])
    straight, then = (load_file(tmp_path / name / "model.safetensors") for name in ("straight", "then"))
    assert all(torch.equal(straight[k], then[k]) for k in straight)
    lrs = {name: [r["lr"] for r in map(json.loads, open(tmp_path / name / "log.jsonl")) if "loss" in r]
           for name in ("straight", "first", "then")}
    assert lrs["first"] + lrs["then"] == lrs["straight"] and latest(tmp_path / "then")["adam_t"] == 6


@pytest.fixture(scope="module")
def straight_biphasic(corpus, tmp_path_factory):
    """(its folder, its final weights): the biphasic run never interrupted."""
    root = tmp_path_factory.mktemp("straight")
    return root, biphasic(corpus, root)


def test_phase_switch_inside_one_budget_continues_the_schedule(straight_biphasic):
    root = straight_biphasic[0]
    lrs = [r["lr"] for name in ("clm", "mlm") for r in map(json.loads, open(root / name / "log.jsonl")) if "loss" in r]
    whole = train.Config(lr=1e-3, schedule="wsd", warmup_tokens=1024, tokens=6 * STEP_TOKENS, decay_frac=0.5,
                         seq_len=128, batch_size=4)
    assert lrs == [train.learning_rate(whole, k * STEP_TOKENS) for k in range(6)]
    assert lrs[2] == lrs[3] == 1e-3 and lrs[4] < lrs[3]  # no second warmup after the switch; one decay at the end
    assert latest(root / "mlm")["adam_t"] == 6  # Adam's t crossed the switch


# the CLM side's kill is a plain resume before a hand-off; the MLM side's resumes a run handed off to
@pytest.mark.parametrize("side", ["mlm", pytest.param("clm", marks=pytest.mark.slow)])
def test_a_kill_on_either_side_of_a_phase_switch_resumes_exactly(side, corpus, tmp_path, straight_biphasic):
    straight, resumed = straight_biphasic[1], biphasic(corpus, tmp_path, kill_in=side)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


# --- signals and help ---------------------------------------------------------------------------------


def test_ctrl_c_in_the_same_process_saves_and_stops_the_caller_too(corpus, tmp_path, monkeypatch):
    """A caller of train.main in its own process (a test suite) gets the interrupt after the checkpoint is saved,
    not a SystemExit it would take as one failure and go on from: one Ctrl-C stops it."""
    from machinery import progress
    record = progress.record

    def interrupted_at_step_2(r, *args):
        if r.phase_step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C sends
        return record(r, *args)
    monkeypatch.setattr(progress, "record", interrupted_at_step_2)
    before = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        train.main([f"--data={corpus}", *small(f"--tokens={6 * STEP_TOKENS}"), f"--out_dir={tmp_path / 'run'}"])
    assert latest(tmp_path / "run")["phase_step"] in (2, 3) and signal.getsignal(signal.SIGINT) is before


@pytest.mark.parametrize("signum", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
                         ids=["SIGINT", "SIGTERM"])
def test_a_signal_saves_says_how_to_continue_and_resumes_exactly(signum, corpus, tmp_path):
    flags = [f"--data={corpus}", *small(f"--tokens={6 * STEP_TOKENS}", "--log_interval=1", "--threads=1")]
    train.main([*flags, f"--out_dir={tmp_path / 'straight'}"])
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *flags, f"--out_dir={out}"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stdout:
        if line.startswith("mlm step 2/"):
            proc.send_signal(signum)
            break
    rest, err = proc.communicate()
    assert proc.returncode == 128 + signum and "Traceback" not in err, err  # 130 for Ctrl-C, 143 for SIGTERM
    assert err.splitlines()[-1] == f"stopped by {signal.Signals(signum).name}"
    assert "interrupted by a signal" in rest
    assert 2 <= latest(out)["phase_step"] < 6
    (resume,) = printed_commands(rest)["continue"]
    assert resume.endswith(f"train.py --resume --out_dir={out}")
    run_printed(resume)  # as printed: it continues to the end of the budget
    straight, resumed = load_file(tmp_path / "straight" / "model.safetensors"), load_file(out / "model.safetensors")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    assert lrs(out) == lrs(tmp_path / "straight")


def test_the_step_lines_and_the_summary_tell_time_and_losses_as_the_run_went(corpus, tmp_path, monkeypatch, capsys):
    """On a clock where each step takes 4,000 s: every step line says so (4000000 ms) and gives the time to the end
    of this invocation (steps left x 4,000 s, in hours and minutes: 0 at its last step, whatever the budget); a
    resumed invocation counts only its own steps, starts at no epoch of a run it continues (it is that run), and
    its summary gives its own time and the last validation losses of the log."""
    captured = []
    plan = progress.plan
    monkeypatch.setattr(progress, "plan", lambda r, steps: captured.append(r) or plan(r, steps))
    monkeypatch.setattr(train, "time", argparse.Namespace(time=lambda: 4000.0 * captured[-1].phase_step))
    out, lines = tmp_path / "run", re.compile(r"mlm step (\d)/3 \|.* \| (\d+) ms \|.* \| eta (\S+)$")
    train.main([f"--data={corpus}", f"--out_dir={out}", *small(f"--tokens={3 * STEP_TOKENS}", "--log_interval=1",
                                                               "--eval_interval=2", "--max_steps=1")])
    train.main([f"--out_dir={out}", "--resume"])
    printed = capsys.readouterr().out
    said = [m.groups() for m in map(lines.match, printed.splitlines()) if m]
    assert said == [("1", "4000000", "0m00s"), ("2", "4000000", "1h06m"), ("3", "4000000", "0m00s")]
    assert "stopped at step 1 of 3 (--max_steps) after 1h06m" in printed and "from epoch" not in printed
    last = [r for r in map(json.loads, open(out / "log.jsonl")) if "val_mlm" in r]
    assert [r["step"] for r in last] == [2, 3]
    assert f"2h13m this invocation; validation MLM {last[-1]['val_mlm']:.4f}, CLM {last[-1]['val_clm']:.4f}\n" \
        in printed


def test_help_lists_every_flag_with_the_chosen_recipes_default():
    for argv, seq_len in ((["--help"], 256), (["--recipe=paper", "-h"], 8192)):
        result = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv], capture_output=True, text=True)
        assert result.returncode == 0, result.stderr
        flags_shown = {line.split("=")[0].strip() for line in result.stdout.splitlines() if line.startswith("  --")}
        assert flags_shown == {f"--{f.name}" for f in dataclasses.fields(train.Config)}
        assert f"--seq_len={seq_len} " in result.stdout and "documents packed into windows" in result.stdout


def test_integers_are_exact_and_a_flag_is_given_once():
    given, _ = flag_rules.parse(["--seed=9007199254740993", "--tokens=10B", "--data_seed=1_000"], train.Config)
    assert given == {"seed": 9007199254740993, "tokens": 10**10, "data_seed": 1000}
    with pytest.raises(InputError, match="--lr is given twice"):
        flag_rules.parse(["--lr=1e-3", "--lr=2e-3"], train.Config)


# --- the commands a run prints: each runs as printed and does what it says ----------------------------------


def test_every_command_the_demo_chain_prints_runs_as_printed(demo_corpus, tmp_path, monkeypatch, capsys):
    """The module docstring's chain at a tiny budget (start -> detour with --weights_only -> decay), from the
    folder it is typed in: each printed `next:` and `longer:` command runs as printed and does what its comment
    says, a taken default --out_dir makes the command name another, and the `use it:` line fills a mask."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    os.symlink(demo_corpus, tmp_path / "data" / "demo")  # the demo corpus where the demo recipe looks, built
    tiny = ["--seq_len=128", "--batch_size=4", f"--tokens={10 * STEP_TOKENS}", "--warmup_tokens=2048",
            "--eval_sequences=2", "--eval_interval=1000", "--save_interval=0", "--threads=1"]

    train.main(tiny)  # python train.py
    said = printed_commands(capsys.readouterr().out)
    assert said.keys() == {"next", "longer"}
    run_printed(said["next"][0])  # the short MLM decay, 10% of its tokens: one step, no warmup
    decay = latest("out/demo-mlm-decay")
    assert (decay["phase"], decay["phase_tokens"], decay["history"][0]["tokens"]) == ("decay", STEP_TOKENS,
                                                                                   10 * STEP_TOKENS)
    assert lrs("out/demo-mlm-decay") == [pytest.approx(0.1 * 2e-3)]  # its one step is its last: the floor
    capsys.readouterr()
    start = (tmp_path / "out/demo-mlm/model.safetensors").read_bytes()
    run_printed(said["longer"][0])  # as many tokens again, its schedule kept, into a run of its own
    printed = capsys.readouterr().out
    assert (tmp_path / "out/demo-mlm/model.safetensors").read_bytes() == start  # what others start from stays
    assert latest("out/demo-mlm")["phase_step"] == 10 and latest("out/demo-mlm-longer")["phase_step"] == 10
    whole = train.Config(lr=2e-3, warmup_tokens=2048, tokens=20 * STEP_TOKENS)
    assert lrs("out/demo-mlm") + lrs("out/demo-mlm-longer") == \
        [train.learning_rate(whole, k * STEP_TOKENS) for k in range(20)]
    (decay_again,) = printed_commands(printed)["next"]
    run_printed(decay_again)
    assert latest("out/demo-mlm-longer-decay")["phase_tokens"] == 2 * STEP_TOKENS  # 10% of both mlm runs

    train.main(["--phase=clm", "--init_from=out/demo-mlm", "--weights_only", *tiny])  # the detour
    said = printed_commands(capsys.readouterr().out)
    assert said["next"] == [f"python {ROOT / 'train.py'} --phase=decay --init_from=out/demo-mlm-clm"]
    run_printed(said["next"][0])
    printed = capsys.readouterr().out
    assert printed_commands(printed) == {} and latest("out/demo-mlm-clm-decay")["history"][0]["phase"] == "clm"
    use = re.search(r"^use it: +(.*)$", printed, re.M)[1]
    python, flag, code = shlex.split(use)
    assert (python, flag) == ("python", "-c") and "model='out/demo-mlm-clm-decay'" in code
    pytest.importorskip("transformers")
    exec(code, {})
    assert "'token_str'" in capsys.readouterr().out  # five guesses for [MASK]


def finished_run(out, history=(), windows=10**9, **flags):
    """What progress.continuations reads of a demo run that has run its budget (no training), on data of
    `windows` training windows (by default far more than it read)."""
    cfg = train.resolve_config({"out_dir": str(out), **flags})
    per_step = cfg.batch_size * cfg.seq_len
    steps = cfg.tokens // per_step
    r = argparse.Namespace(cfg=cfg, phase_step=steps, phase_tokens=steps * per_step, schedule_start=0,
                           history=list(history), objective=data.OBJECTIVES[cfg.objective],
                           loader=argparse.Namespace(sequence=steps * cfg.batch_size, n_windows=windows))
    return r, steps


def hint_flags(r, steps):
    return {label: shlex.split(line)[2:] for label, line, _ in progress.continuations(r, steps, train.learning_rate)}


def test_a_hint_never_changes_a_run_that_exists(tmp_path):
    """Once a run has run its budget, its hints write new run directories: the longer run is a hand-off of the
    same phase into OUT-longer (then -longer-2, ...), its objective, masking and freezing given, no second warmup,
    where every step would run at the peak; the decay takes a free name too, and 10% of a longer chain's tokens."""
    out = tmp_path / "demo-mlm"
    r, steps = finished_run(out)
    said = hint_flags(r, steps)
    assert said["longer"] == ["--phase=mlm", f"--init_from={out}", f"--out_dir={out}-longer", "--mask_rate=0.3",
                              "--tokens=1250000", "--warmup_tokens=0"]
    assert said["next"] == ["--phase=decay", f"--init_from={out}"]
    for taken in (f"{out}-longer", f"{out}-decay", f"{out}-longer-2"):
        os.makedirs(taken)
    said = hint_flags(r, steps)
    assert f"--out_dir={out}-longer-3" in said["longer"] and f"--out_dir={out}-decay-2" in said["next"]
    r, steps = finished_run(out, phase="clm", freeze="low")
    assert hint_flags(r, steps)["longer"][:4] == ["--phase=clm", f"--init_from={out}", f"--out_dir={out}-longer-3",
                                                  "--freeze=low"]
    chain = [dict(phase="mlm", tokens=1249280, dir=str(out))]
    r, steps = finished_run(f"{out}-longer", chain, init_from=str(out), warmup_tokens=0, tokens=1_250_000)
    assert hint_flags(r, steps)["next"] == ["--phase=decay", f"--init_from={out}-longer", "--tokens=249856"]
    for flags in ({"schedule": "1-sqrt"}, {"warmup_tokens": 2_000_000}):  # a rate that would change, a warmup
        r, steps = finished_run(out, **flags)                               # not done: no longer hint
        assert "longer" not in hint_flags(r, steps)
    r.phase_step -= 1
    assert hint_flags(r, steps) == {"continue": ["--resume", f"--out_dir={out}"]}


def test_the_longer_hint_never_warns_against_itself(tmp_path, capsys):
    """A run that has read its data 2.5 times: its `longer:` line asks for as many tokens as keep the data read at
    most 4 times (where a run warns that it will memorise them), not as many again, says so, and runs as printed
    without that warning. The demo's own start model (2,073 windows read 2.35 times) gets 872,448 tokens."""
    words = "the cell protein binds a receptor in mice while dose and risk of tumour rose".split()
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": " ".join(words[i % 7:] + words[:i % 5])}) + "\n" for i in range(80)))
    data.prepare([str(corpus)], "bytes", str(tmp_path / "data"), val_fraction=0.1)
    windows = data.count_windows(str(tmp_path / "data"), "train", 128)
    steps = math.ceil(2.5 * windows / 4)
    out = tmp_path / "run"
    train.main([f"--data={tmp_path / 'data'}", f"--out_dir={out}", *small(f"--tokens={steps * STEP_TOKENS}")])
    printed = capsys.readouterr().out
    (longer,) = printed_commands(printed)["longer"]
    room = (4 * windows - steps * 4) // 4 * STEP_TOKENS  # 4 sequences a step
    assert f"--tokens={room}" in longer and 0 < room < steps * STEP_TOKENS
    assert f"{room:,} tokens more, up to 4 epochs of {tmp_path / 'data'}" in printed
    run_printed(longer)
    printed = capsys.readouterr().out
    assert "warning: the budget is" not in printed and latest(f"{out}-longer")["phase_tokens"] == room
    r, done = finished_run(tmp_path / "demo-mlm", windows=2073)
    assert "--tokens=872448" in hint_flags(r, done)["longer"]


def test_the_rest_of_a_schedule_runs_as_printed(corpus, tmp_path, capsys):
    """CLM for 2 of 6 steps of a WSD schedule prints the MLM hand-off that runs the other 4: run as printed (no
    --decay_frac: a hand-off that continues a schedule takes its shape), its learning rates are the schedule's."""
    train.main([f"--data={corpus}", f"--out_dir={tmp_path / 'clm'}",
                *small(*BIPHASIC, "--phase=clm", f"--tokens={2 * STEP_TOKENS}")])
    (command,) = printed_commands(capsys.readouterr().out)["next"]
    assert "--decay_frac" not in command and f"--tokens={4 * STEP_TOKENS}" in command
    run_printed(command)
    assert "the wsd schedule goes on from token 1,024 of 3,072: no second warmup" in capsys.readouterr().out
    whole = train.Config(lr=1e-3, schedule="wsd", warmup_tokens=1024, tokens=6 * STEP_TOKENS, decay_frac=0.5,
                         seq_len=128, batch_size=4)
    assert lrs(tmp_path / "clm") + lrs(tmp_path / "clm-mlm") == \
        [train.learning_rate(whole, k * STEP_TOKENS) for k in range(6)]


@pytest.mark.parametrize("schedule", [["--schedule=constant"], ["--schedule=wsd", f"--decay_tokens={2 * STEP_TOKENS}"]],
                         ids=["constant", "wsd-before-its-decay"])
def test_a_run_made_longer_equals_the_run_given_that_budget_from_the_start(schedule, corpus, tmp_path, capsys):
    """The `longer:` line of a finished constant run, a hand-off into a run directory of its own with no second
    warmup, continues it bit for bit as if it had been given that budget from the start: weights, Adam moments
    and every step's learning rate. `--resume --tokens=N` grows a WSD run the same way, in place, while its decay
    has not started; once a step ran in the decay, a new budget is refused."""
    flags = [f"--data={corpus}", *small(*schedule, "--save_interval=1")]
    train.main([*flags, f"--tokens={6 * STEP_TOKENS}", f"--out_dir={tmp_path / 'straight'}"])
    out = end = tmp_path / "run"
    capsys.readouterr()
    if schedule == ["--schedule=constant"]:  # the hint: a hand-off into run-longer, the same steps
        train.main([*flags, f"--tokens={3 * STEP_TOKENS}", f"--out_dir={out}"])
        (longer,) = printed_commands(capsys.readouterr().out)["longer"]
        run_printed(longer)
        end = tmp_path / "run-longer"
    else:  # 2 of 4 steps: its decay, over the last 2, has not started
        train.main([*flags, f"--tokens={4 * STEP_TOKENS}", "--max_steps=2", f"--out_dir={out}"])
        train.main([f"--out_dir={out}", "--resume", f"--tokens={6 * STEP_TOKENS}"])
    for name in ("model.safetensors", "optimizer.safetensors"):
        straight, longer = (load_file(os.path.join(latest(d)["dir"], name)) for d in (tmp_path / "straight", end))
        assert straight.keys() == longer.keys() and all(torch.equal(straight[k], longer[k]) for k in straight)
    assert lrs(out) + (lrs(end) if end != out else []) == lrs(tmp_path / "straight") and latest(end)["adam_t"] == 6
    if schedule != ["--schedule=constant"]:
        with pytest.raises(InputError, match="would give the step at token 2,560 the learning rate"):
            train.main([f"--out_dir={out}", "--resume", f"--tokens={8 * STEP_TOKENS}"])


def test_a_hand_off_to_the_same_phase_that_warms_up_again_says_so(corpus, tmp_path, capsys):
    """A same-phase hand-off without a shared --schedule_tokens starts a new schedule: one line says the rate warms
    up from 0 again and why, and which flag goes on with the parent's schedule instead (the parent unchanged)."""
    first = tmp_path / "first"
    run(corpus, first, f"--tokens={3 * STEP_TOKENS}")
    capsys.readouterr()
    run(corpus, tmp_path / "again", f"--tokens={2 * STEP_TOKENS}", f"--init_from={first}")
    printed = capsys.readouterr().out
    assert "the schedule starts again: the learning rate warms up from 0 over 1,024 tokens (a hand-off continues " \
           "its parent's schedule only where both give the same --schedule and --schedule_tokens" in printed
    assert lrs(tmp_path / "again")[0] == 0.0
    assert f"To go on with {first}'s schedule instead (its peak rate from the first step), pass " \
           f"--warmup_tokens=0" in printed
    run(corpus, tmp_path / "kept", f"--tokens={2 * STEP_TOKENS}", f"--init_from={first}", "--warmup_tokens=0")
    assert "the schedule starts again" not in capsys.readouterr().out
    assert lrs(tmp_path / "kept") == [1e-3] * 2 and lrs(first) == [0.0, 5e-4, 1e-3]
