"""A study as stages: the Stage record, the fingerprints that keep an experiment directory to the results of
one command, and the runner that runs stages side by side, resumes an interrupted training, and ends every
stage on a signal or with its driver. reproduce.py says which stages a study has; a reader of the studies may
skip this file.

OUT/plan.json holds each stage's fingerprint and threads; OUT/stages/NAME.json records a stage (fingerprint, threads;
`finished` with its times and the digests of what it wrote once it ends); OUT/logs/NAME.log holds its output."""
import functools
import hashlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from machinery.cli import (PLANNED, InputError, changed_versions, die_with, read_json, source_digest, versions,
                           write_json)
from machinery.planfiles import check_plan, check_record

ROOT = Path(__file__).resolve().parent.parent  # the scripts' folder: every stage runs from there
GRACE = 60  # seconds a stage has to stop after SIGTERM (a training ends its step and saves) before SIGKILL
WHOLE = 64 << 20  # inputs up to 64 MiB are hashed whole; a larger one by its size and its first and last MiB


@dataclass
class Stage:
    """One command of a study, run from the repository root once the stages it `needs` have finished."""
    name: str
    command: list
    needs: list = field(default_factory=list)
    inputs: list = field(default_factory=list)  # files and folders outside OUT whose content its results depend on
    run_dir: str = ""  # a training stage's run directory: an interrupted one continues with --resume
    continues: str = ""  # the stage whose run this one continues (its curve goes on from there)
    threaded: bool = True  # takes --threads (train.py and eval.py do; data.py's commands need one core)
    solo: bool = False  # nothing can run beside it (the start model): it gets every core


# -----------------------------------------------------------------------------
# Fingerprints: what a stage computes, so that OUT never mixes the results of two commands.


def rel(path):
    text = str(path)
    return "python" if text == sys.executable else text.replace(str(ROOT) + os.sep, "")


def shown(command, out=None):
    """The command as a reader types it from the repository root; with `out`, the experiment directory written
    as OUT (the fingerprint's form: a moved experiment keeps its fingerprints)."""
    def arg(c):
        c = str(c)
        return c if out is None else "OUT" if c == str(out) else c.replace(str(out) + os.sep, "OUT/")
    return shlex.join(rel(arg(c)) for c in command)


def digest(path):
    """sha256 of what a file holds (whole up to WHOLE bytes, else its size and its first and last MiB), or of a
    folder's top-level files that are not hidden (a model directory's are its latest weights; a lock is not)."""
    p, h = Path(path), hashlib.sha256()
    try:
        if p.is_dir():
            for child in sorted(p.iterdir()):
                if child.is_file() and not child.name.startswith("."):
                    h.update(f"{child.name}\0{digest(str(child))}\n".encode())
            return h.hexdigest()
        size = p.stat().st_size
        h.update(f"{size}\0".encode())
        with open(p, "rb") as f:
            if size <= WHOLE:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            else:
                h.update(f.read(1 << 20))
                f.seek(-(1 << 20), os.SEEK_END)
                h.update(f.read())
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror or e})") from None
    return h.hexdigest()


content = functools.lru_cache(maxsize=None)(digest)  # an input's digest: read once per invocation


# What a training stage's results are: which run, its log and its weights. Not the model card (a user may edit it
# before publishing) nor the picture, which the next save redraws.
RUN_OUTPUTS = ("run.json", "log.jsonl", "config.json", "model.safetensors")


def outputs(stage):
    """The paths a stage writes: a training's run directory (RUN_OUTPUTS in it), else its command's --out."""
    if stage.run_dir:
        return [Path(stage.run_dir) / name for name in RUN_OUTPUTS]
    found = []
    for flag, after in zip(stage.command, [*stage.command[1:], ""]):
        flag = str(flag)
        if flag == "--out":
            found.append(Path(after))
        elif flag.startswith("--out="):
            found.append(Path(flag.removeprefix("--out=")))
    return found


def output_digests(stage, out):
    """{path (OUT/... inside the experiment): digest, or None where the stage wrote nothing (then it is not
    finished)}, read now (never from the cache: the stage has just written them)."""
    return {in_out(path, out): digest(path) if path.exists() else None for path in outputs(stage)}


def in_out(path, out):
    """A path as a record keeps it: OUT/... inside the experiment directory, so that a moved one still checks."""
    text = str(path)
    return "OUT/" + text[len(str(out)) + 1:] if text.startswith(str(out) + os.sep) else text


def fingerprint(stages, out, study, scale):
    """The plan as OUT/plan.json keeps it: the code that runs it (every script and machinery module:
    cli.source_digest) and the versions of the packages it runs on (cli.versions); per stage its command, its
    inputs' content hashes and a fingerprint over both, the code, the versions and the fingerprints of the stages
    it needs; and one fingerprint for the whole plan. An edit to any of the code, or another torch, is another
    command: no stage's result outlives what computed it."""
    entries, code, packages = {}, source_digest(), versions()
    for s in stages:
        inputs = {rel(p): content(str(p)) for p in s.inputs}
        command = shown(s.command, out)
        ups = [entries[n]["fingerprint"] for n in s.needs]
        digest = hashlib.sha256(json.dumps([command, inputs, ups, code, packages]).encode()).hexdigest()
        entries[s.name] = dict(fingerprint=digest, command=command, inputs=inputs)
    whole = hashlib.sha256(json.dumps([study, code, packages, {n: e["fingerprint"] for n, e in entries.items()}])
                           .encode())
    return dict(written_by="reproduce.py", study=study, scale=scale, code=code, versions=packages,
                fingerprint=whole.hexdigest(), stages=entries)


def check_out(out, plan):
    """OUT is new, empty, or holds this very plan, and can be written; otherwise one InputError naming the stages
    that differ, or why OUT cannot be written."""
    if out.exists() and not out.is_dir():
        raise InputError(f"--out={out}: a file; expected a directory")
    check_writable(out)
    path = out / "plan.json"
    if not path.exists():
        if out.exists() and any(out.iterdir()):
            raise InputError(f"--out={out} is not empty and holds no plan.json, so it is no experiment of "
                             f"reproduce.py; choose a new --out")
        return
    old = check_plan(read_json(path, "the plan of a reproduce.py experiment"), path)
    if old.get("fingerprint") != plan["fingerprint"]:
        raise InputError(f"--out={out} holds the results of another command ({differences(old, plan)}); finished "
                         f"stages are never re-run in place nor mixed into another command's report: choose a new "
                         f"--out, or delete {out} to start over")
    check_finished(out, plan)


def check_writable(out):
    """OUT, or the folder it would be made in, takes a new folder (made and removed: nothing is left), so that a dry
    run meets what the run would: a read-only disk, a path through a file, a folder of someone else's."""
    existing = next(p for p in (out, *out.parents) if p.exists())
    try:
        tempfile.TemporaryDirectory(dir=existing, prefix=".reproduce-check-").cleanup()
    except OSError as e:
        raise InputError(f"--out={out}: cannot write there ({existing}: {e.strerror or e})") from None


def check_finished(out, plan):
    """Every finished stage's outputs are what it wrote: a file replaced since (a hand run into the same --out, a
    training continued by hand) would otherwise be skipped as done and its numbers reported as this experiment's.
    Refused, naming the stage and the file, rather than re-run: a re-run would overwrite what the other command
    wrote, which may be someone's only copy, and the stages after it have read the old output. Records written
    before digests were kept hold none and are not checked."""
    changed = []
    for name, entry in plan["stages"].items():
        record = stage_record(out, name, entry["fingerprint"])
        wrote_all = (record.get("outputs") or {}) if record.get("finished") else {}
        for path, wrote in wrote_all.items():
            real = out / path[4:] if path.startswith("OUT/") else Path(path)
            now = digest(real) if real.exists() else None
            if now != wrote:
                changed.append((name, real, "is gone" if now is None else "is not what the stage wrote",
                                sorted(Path(p).name for p in wrote_all) == sorted(RUN_OUTPUTS)))
    if changed:
        name, real, how, training = changed[0]
        more = f" (and {len(changed) - 1} more output(s) of finished stages)" if len(changed) > 1 else ""
        # a training's run directory keeps its checkpoints: run again, it would continue its run from the end
        # and write nothing, so the whole directory goes
        away = (f"Move its run directory {real.parent} away" if training else "Move it away")
        raise InputError(f"stage {name} finished, but {real} {how}: another command wrote there since{more}, and its "
                         f"numbers are not this experiment's. {away} and delete {out / 'stages' / name}.json to "
                         f"run the stage again, or choose a new --out")


def differences(old, new):
    """The stages whose fingerprints differ: those with a cause of their own (their command, an input's content,
    a stage only one command has), then how many differ only through a stage they depend on; or the code, which
    every stage runs."""
    if old.get("code") != new["code"]:
        return (f"{old.get('study')} at scale {old.get('scale')}, run by other code: a .py file of the repository "
                f"changed since (code {str(old.get('code'))[:12]}, now {new['code'][:12]})")
    if old.get("versions") != new["versions"]:
        return (f"{old.get('study')} at scale {old.get('scale')}, run on other packages: "
                f"{changed_versions(old.get('versions'), new['versions']) or 'versions not recorded then'}")
    before, now = old["stages"], new["stages"]
    differ = [n for n in now if (before.get(n) or {}).get("fingerprint") != now[n]["fingerprint"]]
    own = {}
    for n in (n for n in differ if isinstance(before.get(n), dict)):
        if before[n].get("command") != now[n]["command"]:
            own[n] = "its command"
        elif before[n].get("inputs") != now[n]["inputs"]:
            changed = [p for p, h in now[n]["inputs"].items() if (before[n].get("inputs") or {}).get(p) != h]
            own[n] = f"the content of {', '.join(changed) or 'its inputs'}"
    own |= {n: "not in that command" for n in differ if not isinstance(before.get(n), dict)}
    own |= {n: "not in this command" for n in before if n not in now}
    causes = [f"{n} ({why})" for n, why in own.items()]
    causes = causes[:6] + ([f"{len(causes) - 6} more"] if len(causes) > 6 else [])
    downstream = len([n for n in differ if n not in own])
    return (f"{old.get('study')} at scale {old.get('scale')}: {len(own) + downstream} stages differ: "
            + ", ".join(causes) + (f", and {downstream} that depend on them" if downstream else ""))



# -----------------------------------------------------------------------------
# Running: up to --jobs stages side by side, an interrupted training resumed, all ended together.


def stage_record(out, name, fingerprint_):
    """A stage's record, if it was written for this fingerprint; else {}."""
    path = out / "stages" / f"{name}.json"
    saved = read_json(path, "a stage record of reproduce.py") if path.exists() else {}
    ours = isinstance(saved, dict) and saved.get("fingerprint") == fingerprint_
    return check_record(saved, path) if ours else {}


def launch(stage, out, fingerprint_, threads, planned):
    """Start a stage's process (`planned`: the code and packages of the plan, which the process checks it runs)."""
    command, verb = stage.command, "run"
    if stage.run_dir and has_checkpoint(stage.run_dir):
        trainer_end = command.index(str(ROOT / "train.py")) + 1  # an interrupted training continues exactly
        command, verb = [*command[:trainer_end], "--resume", f"--out_dir={stage.run_dir}"], "resume"
    if stage.threaded:
        command = [*command, f"--threads={threads}"]
    print(f"[{verb}]{' ' * (7 - len(verb))}{stage.name}: {shown(command)}", flush=True)
    write_json(out / "stages" / f"{stage.name}.json", dict(fingerprint=fingerprint_, command=shown(stage.command, out),
                                                          threads=threads, finished=False))
    log = open(out / "logs" / f"{stage.name}.log", "a")
    # die_with: no stage outlives its driver (a SIGTERM would let it save while a rerun starts beside it)
    proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", PLANNED: planned},
                            preexec_fn=functools.partial(die_with, os.getpid()))
    return stage, proc, log, time.time()


def has_checkpoint(run_dir):
    from machinery.rundir import latest_state
    try:
        return latest_state(run_dir) is not None
    except InputError:  # a damaged checkpoint: train.py --resume says what is wrong with it
        return True


def signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def exited(proc):
    """Whether the stage's first process has exited, without reaping it (its group id stays ours to signal)."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def end(running, stop):
    """SIGTERM to every running stage's process group, SIGKILL to what is left after GRACE seconds or at a
    second signal."""
    for _, proc, _, _ in running.values():
        signal_group(proc, signal.SIGTERM)
    deadline = time.time() + GRACE
    while len(stop) < 2 and time.time() < deadline and not all(exited(p) for _, p, _, _ in running.values()):
        time.sleep(0.1)
    for _, proc, log, _ in running.values():
        signal_group(proc, signal.SIGKILL)  # what a stage left behind in its group
        proc.wait()
        log.close()


def plan_threads(out, stages, jobs, cores):
    """Each stage's --threads, fixed in OUT/plan.json by the first invocation that runs the plan (cores / jobs; a
    solo stage every core): a CPU run's numbers change with its thread count, so a rerun with another --jobs, or on
    a machine with other cores, computes what the first invocation would have; --jobs then changes only how many
    stages run at once."""
    path, share = out / "plan.json", {s.name: cores if s.solo else max(1, cores // jobs) for s in stages}
    saved = check_plan(read_json(path, "the plan of a reproduce.py experiment"), path) if path.exists() else {}
    if "threads" not in saved:  # a new plan (or one written before plans kept them): fixed now
        saved["threads"] = share
        if path.exists():
            write_json(path, saved)
    elif any(saved["threads"].get(name) != n for name, n in share.items()):
        print(f"reproduce: each stage takes the threads its plan fixed at its first invocation (a CPU run's numbers "
              f"change with them), not {max(1, cores // jobs)} of --jobs={jobs} on {cores} cores", flush=True)
    return saved["threads"]


def run(stages, out, plan, jobs, cores):
    """Run what is not finished, up to `jobs` at once, until all are done, one fails or a signal comes."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "stages").mkdir(exist_ok=True)
    fixed = plan_threads(out, stages, jobs, cores)
    fps = {n: e["fingerprint"] for n, e in plan["stages"].items()}
    planned = json.dumps(dict(code=plan["code"], versions=plan["versions"]))  # each stage refuses other code
    done = {s.name for s in stages if stage_record(out, s.name, fps[s.name]).get("finished")}
    for s in stages:
        if s.name in done:
            print(f"[skip]   {s.name}: finished", flush=True)
    running, failed, stop = {}, [], []
    handlers = {sig: signal.signal(sig, lambda signum, _: stop.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while running or not (failed or stop or len(done) == len(stages)):
            ready = [s for s in stages if s.name not in done and s.name not in running and set(s.needs) <= done]
            for stage in ready[:max(0, jobs - len(running))] if not (failed or stop) else []:
                if running and (stage.solo or any(s.solo for s, *_ in running.values())):
                    break  # a solo stage runs alone, on every core: it waits, and nothing starts beside it
                # fixed per stage (kept by a resume), so that a rerun computes the same numbers
                threads = stage_record(out, stage.name, fps[stage.name]).get("threads") or \
                    fixed.get(stage.name) or (cores if stage.solo else max(1, cores // jobs))
                running[stage.name] = launch(stage, out, fps[stage.name], threads, planned)
            time.sleep(0.05)
            if stop:
                end(running, stop)
                break
            for name, (stage, proc, log, t0) in list(running.items()):
                if proc.poll() is None:
                    continue
                log.close()
                del running[name]
                if proc.returncode:
                    failed.append(name)
                    tail = (out / "logs" / f"{name}.log").read_text(errors="replace").splitlines()[-15:]
                    print(f"[failed] {name} (exit {proc.returncode}); the end of {out / 'logs' / (name + '.log')}:"
                          f"\n  " + "\n  ".join(tail), flush=True)
                    continue
                t1, wrote = time.time(), output_digests(stage, out)
                lacks = [path for path, d in wrote.items() if d is None]
                if lacks:  # never recorded as finished: a rerun would skip it, its output still missing
                    failed.append(name)
                    print(f"[failed] {name}: it ended without writing {', '.join(lacks)}" + (
                        f" (a run that had ended is continued and writes nothing: move {stage.run_dir} away to train "
                        f"it again)" if stage.run_dir else ""), flush=True)
                    continue
                write_json(out / "stages" / f"{name}.json", dict(
                    stage_record(out, name, fps[name]), finished=True, seconds=round(t1 - t0, 3), start=t0, end=t1,
                    outputs=wrote))
                done.add(name)
                print(f"[done]   {name} ({t1 - t0:.1f} s)", flush=True)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    if stop:
        print(f"reproduce: stopped by {signal.Signals(stop[0]).name}; the running stages were ended. Run the same "
              f"command again to continue", file=sys.stderr, flush=True)
        raise SystemExit(128 + stop[0])
    if failed:
        print(f"error: stage(s) {', '.join(failed)} failed; fix the cause and run the same command again",
              file=sys.stderr)
        raise SystemExit(1)


def check_unchanged(plan):
    """An InputError if the code on disk is no longer the code the experiment was planned with: what reads it now
    (the report's modules) would be other code than the stages ran."""
    now = source_digest(now=True)
    if now != plan["code"]:
        raise InputError(f"every stage has finished, but the code changed while the experiment ran (a .py file of the "
                         f"repository; {plan['code'][:12]} then, {now[:12]} now): the report would "
                         f"be written by other code. Restore what the experiment started with and run the same command "
                         f"again (no stage runs again)")


def stage_times(out, stages):
    """Each stage's time, their sum, and the wall time: the time at least one stage ran (pauses between
    invocations left out; an interrupted attempt's time is not counted)."""
    records = {s.name: check_record(read_json(out / "stages" / f"{s.name}.json"), out / "stages" / f"{s.name}.json")
               for s in stages}
    spans, wall, reach = sorted((r["start"], r["end"]) for r in records.values()), 0.0, -math.inf
    for start, end_ in spans:
        wall += max(0.0, end_ - max(start, reach))
        reach = max(reach, end_)
    seconds = {n: r["seconds"] for n, r in records.items()}
    return dict(stages=seconds, summed=sum(seconds.values()), wall=wall)

