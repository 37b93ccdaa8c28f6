"""The run-directory protocol: checkpoints that survive a kill or a full disk at any instant, a save that
touches only what it wrote, the schema of state.json, RNG states and signals. A reader of the recipe may skip
this file.

A run directory OUT, as train.py writes it:

    OUT/run.json                    {"written_by": "train.py", "run_id": <32 hex>, "created": <time>}
    OUT/config.json, model.safetensors, tokenizer.json, tokenizer_config.json, special_tokens_map.json
                                    copies of the latest checkpoint's Hugging Face files: OUT loads with
                                    from_pretrained; train.py never reads them, and the next save replaces them
    OUT/log.jsonl                   one JSON record per line (train.py writes it), on the disk before each
                                    checkpoint: a crash loses only the steps after it, which a resume runs again
    OUT/README.md                   the model card, rewritten at each save while it is ours: it ends with our
                                    mark, the sha256 of the text above it; a card the user wrote or edited is theirs
    OUT/checkpoints/step-00000050/  .checkpoint (the run_id), the Hugging Face files, optimizer.safetensors,
                                    state.json (written last; lists the other files' sizes)
    OUT/.lock                       held by the process writing the run

Ownership is by marker, never by name alone: a folder under checkpoints/ is this run's only if it is a real
folder with a name a save gives and a .checkpoint file holding this run's id, so a user's backup
(`cp -r run run.old`), another run's checkpoint, a link, a folder the user renamed or put inside OUT is never
read as ours nor deleted. A save writes checkpoints/.tmp-step-N-<pid> (every file fsynced,
state.json last), copies the Hugging Face files beside their top-level names, then renames: each top-level
file into place, the folder to checkpoints/step-N. At every instant a complete checkpoint of this run exists:
any folder of ours whose state.json is there counts, under whichever of those names.

A top-level file is a copy, never a second name of a checkpoint's file: whatever a user does to OUT's files
(an edit in place, save_pretrained over them, a deletion) leaves every checkpoint as it was saved. The copy
goes through copy_file_range, which on a file system that shares blocks copy-on-write (btrfs, xfs, bcachefs)
writes no byte twice; elsewhere it costs the model's size once more per save.
"""
import base64
import binascii
import contextlib
import datetime
import errno
import fcntl
import hashlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import uuid

from machinery.cli import NOT_CODE, InputError, Stop, read_json, source_digest, versions, write_json

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: code_version asks git there
RUN_FILE = "run.json"
MARKER = ".checkpoint"  # inside a checkpoint folder: the id of the run that wrote it
STATE = "state.json"
OPTIMIZER = "optimizer.safetensors"
# What a checkpoint folder holds besides the marker (a save lists the real names in state.json's "files").
CHECKPOINT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                    "special_tokens_map.json", OPTIMIZER, STATE)
# A fresh run refuses a folder holding any of these: it would overwrite or misread them. state.json at the
# top level is the layout of an older train.py.
OUTPUTS = ("checkpoints", "log.jsonl", "loss.png", "state.json", *CHECKPOINT_FILES[:-1])
# The names a save gives: step-N, step-N-<run_id> (beside someone else's step-N), .tmp-step-N-<pid> while
# it writes, .tmp-step-N-<pid>-replaced for the earlier step-N of ours it replaces.
FOLDER = re.compile(r"(\.tmp-)?step-(?P<step>\d{8,})(-[0-9a-f]+)?(-replaced)?")
MAX_INT = 2 ** 62  # counters are far below it; a larger value is a corrupt or edited file
CARD = "README.md"  # Hugging Face's name for a model card: the hub shows it, `hf upload` publishes it
CARD_MARK = "<!-- written by train.py, rewritten at each save until edited; sha256 of the text above: {} -->"


class RunDir:
    """One run directory of train.py: `create` a new one or `open` an existing one, then `lock`, `save`,
    `latest_state`."""

    def __init__(self, path, run_id):
        self.path, self.run_id = path, run_id
        self.log_path = os.path.join(path, "log.jsonl")
        self.checkpoints = os.path.join(path, "checkpoints")
        self._lock = None
        # Until this process writes a record or a checkpoint, it has changed nothing a run wrote before: what it made
        # (run.json, the folder, .lock) is all abandon() takes back, and the log keeps its records until then.
        self._made, self._lock_made, self._written = [], False, False
        self._log_until = None  # the records the log keeps at the first write (-1: none), None: all

    # ---- which folder is a run, and whose -------------------------------------------------------------

    @classmethod
    def create(cls, path, locked=False):
        """A new run in `path` (made if missing), locked when asked. Refuses a run that holds a checkpoint, a folder a run would
        overwrite, a file. A run of ours that stopped before its first checkpoint is started over (its lock
        still keeps two processes apart), its log too, at the new run's first record: it holds steps no checkpoint
        has (a hand-off's step-0 validation among them), which the run logs again."""
        path = os.path.normpath(path)
        marker = os.path.join(path, RUN_FILE)
        if os.path.lexists(path) and not os.path.isdir(path):
            raise InputError(f"{path} is a file, not a directory; choose another --out_dir")
        if os.path.lexists(marker):
            run = cls.open(path)
            if run.latest_state() is not None:
                raise InputError(f"{path} already holds a run of train.py with checkpoints; pass --resume to "
                                 f"continue it, or choose another --out_dir")
            if locked:  # the process that writes the run: no other one is writing its log
                run.lock()
                run._log_until = -1
            return run
        clash = [name for name in OUTPUTS if os.path.lexists(os.path.join(path, name))]
        if clash:
            raise InputError(f"{path} holds {clash[0]} but no {RUN_FILE}: it is not a run of train.py, and a new "
                             f"run would overwrite it; choose another --out_dir or move it away")
        run_id = uuid.uuid4().hex
        tmp, made = f"{marker}.tmp-{run_id}", not os.path.lexists(path)
        try:
            os.makedirs(path, exist_ok=True)
            write_json(tmp, {"written_by": "train.py", "run_id": run_id,
                             "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds")})
            os.link(tmp, marker)  # fails if another process created the run meanwhile: one of them wins
            _fsync(path)
        except FileExistsError:
            raise InputError(f"{path}: another train.py created a run there just now; choose another --out_dir") \
                from None
        except OSError as e:
            _remove_file(tmp)
            if made and os.path.isdir(path) and not os.listdir(path):
                os.rmdir(path)  # a full disk or a read-only folder leaves nothing behind
            raise InputError(f"{path}: cannot write a run there ({e.strerror or e})") from None
        finally:
            _remove_file(tmp)
        run = cls(path, run_id)
        run._made = [marker, path] if made else [marker]
        return run.locked() if locked else run

    @classmethod
    def open(cls, path):
        """An existing run of train.py; InputError if `path` is not one."""
        path = os.path.normpath(path)
        marker = os.path.join(path, RUN_FILE)
        if not os.path.isfile(marker):
            old = " (it holds state.json at its top level: a run of an older train.py, which is no longer read)" \
                if os.path.isfile(os.path.join(path, STATE)) else ""
            raise InputError(f"{path}: not a run directory of train.py: no {RUN_FILE}{old}")
        info = read_json(marker, "a run marker of train.py")
        if not _is_marker(info):
            raise InputError(f"{marker}: not written by train.py (expected written_by \"train.py\" and a run_id of "
                             f"32 hex digits)")
        return cls(path, info["run_id"])

    @staticmethod
    def is_run(path):
        """Whether `path` holds a run marker of train.py (never raises)."""
        marker = os.path.join(path, RUN_FILE)
        if not os.path.isfile(marker):  # a named pipe would block the open
            return False
        try:
            with open(marker, encoding="utf-8") as f:
                return _is_marker(json.load(f))
        except (OSError, ValueError, RecursionError):
            return False

    def _ours(self, folder):
        """A real folder (not a link) whose marker holds this run's id."""
        if os.path.islink(folder) or not os.path.isdir(folder) or not os.path.isfile(os.path.join(folder, MARKER)):
            return False
        try:
            with open(os.path.join(folder, MARKER), encoding="utf-8") as f:
                return f.read(100).strip() == self.run_id
        except (OSError, ValueError):
            return False

    def _folders(self):
        """This run's folders under checkpoints/, newest first: a name a save gives and our marker inside (a
        folder the user renamed, or copied from another run, is not ours)."""
        if not os.path.isdir(self.checkpoints):
            return []
        found = []
        for name in os.listdir(self.checkpoints):
            match = FOLDER.fullmatch(name)
            if match and self._ours(os.path.join(self.checkpoints, name)):
                found.append((int(match["step"]), _recency(name), os.path.join(self.checkpoints, name)))
        return [folder for *_, folder in sorted(found, reverse=True)]

    # ---- the lock -------------------------------------------------------------------------------------------

    def locked(self):
        """This run, locked (lock)."""
        self.lock()
        return self

    def lock(self):
        """An exclusive lock on OUT/.lock, held until unlock() or the process ends."""
        if self._lock is None:
            lock_path = os.path.join(self.path, ".lock")
            made = not os.path.lexists(lock_path)  # a kill leaves the file: then it was there before us
            self._lock = hold_lock(lock_path, f"{self.path}: another train.py is writing this run (it holds "
                                              f"{lock_path})")
            self._lock_made = made
            if _STARTING is not None:
                _STARTING.append(self)

    def unlock(self):
        """At a clean end: remove OUT/.lock and release it."""
        if self._lock is not None:
            release_lock(self._lock)
            self._lock = None

    def abandon(self):
        """A start that stopped before writing anything (a refused flag or file, Ctrl-C, a first step out of
        memory): take back what it made, run.json, .lock and the folder, so that no husk reads as a run; a run it
        was to resume or start over stays byte for byte as it was. Nothing once a record or a checkpoint is written."""
        if self._written:
            return
        if self._lock is not None:
            if self._lock_made:
                release_lock(self._lock)
            else:  # a .lock a kill left stays
                self._lock.close()
            self._lock = None
        for path in self._made:  # run.json, then the folder, if this start made it and it holds nothing else
            if os.path.isdir(path) and not os.path.islink(path):
                if not os.listdir(path):
                    os.rmdir(path)
            else:
                _remove_file(path)
        self._made = []

    def _first_write(self):
        """Before this process's first record or checkpoint: the log as the start it makes holds it (trim_log)."""
        if not self._written:
            if self._log_until is not None:
                self.trim_log(self._log_until)
            self._written = True

    # ---- the log --------------------------------------------------------------------------------------------

    def append_log(self, record):
        """One record at the end of log.jsonl. A disk that takes no more (full, read-only) stops the run with one
        line naming the log and the checkpoint it can go on from: the log is written at every step, so a disk that
        fills up between saves is met here first, and a run that went on would leave steps out of it."""
        self._first_write()
        try:
            append_log(self.log_path, record)
        except OSError as e:
            raise InputError(f"{self.log_path}: cannot append the record of step {record['step']} "
                             f"({e.strerror or e}); the run stops here: {self._intact()}") from None

    def trim_log(self, step):
        """Keep the records up to `step`, the checkpoint a resume starts from: the steps after it will be
        run, and logged, again (-1: none is kept). A line cut short by a kill is dropped. Written beside the log and
        renamed over it: a disk that cannot take it leaves the log as it was, and one line says so."""
        if not os.path.exists(self.log_path):
            return
        kept = []
        with open(self.log_path, encoding="utf-8") as f:
            for line in f:
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line if line.endswith("\n") else line + "\n")
                except (ValueError, KeyError, TypeError):
                    continue
        tmp = f"{self.log_path}.tmp-{self.run_id}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(kept)
                f.flush()
                os.fsync(f.fileno())  # a crash after the rename must not leave an empty log
            os.replace(tmp, self.log_path)
        except OSError as e:
            _remove_file(tmp)
            kept = f"with the records up to step {step}, where the run resumes" if step >= 0 else "empty, for the " \
                "run that starts over there"
            raise InputError(f"{self.log_path}: cannot rewrite it {kept} ({e.strerror or e}); the log is as it was, "
                             f"and the run stops here: {self._intact()}") from None

    # ---- the model card ------------------------------------------------------------------------------------

    def write_card(self, text):
        """Make OUT/README.md `text` if the card there is ours: missing, or written by a save and unchanged since
        (its last line, our mark, holds the sha256 of the text above it). A card the user wrote, edited, linked or
        replaced is left as it is. Written beside its name and renamed over it: a kill leaves the old card or the
        new one. Returns whether it was written."""
        path = os.path.join(self.path, CARD)
        if not card_is_ours(path):
            return False
        text = text.rstrip("\n") + "\n"
        tmp = f"{path}.tmp-{self.run_id}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text + CARD_MARK.format(hashlib.sha256(text.encode()).hexdigest()) + "\n")
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        finally:
            _remove_file(tmp)
        return True

    # ---- reading -------------------------------------------------------------------------------------------

    def latest_state(self, phases=None, fields=None):
        """The validated state.json of this run's newest complete checkpoint, with "dir" = its folder; None when
        there is none. A folder without state.json is a save or a prune that was cut short and is skipped; a
        state.json that fails the schema, or files whose sizes differ from those it lists, are an InputError."""
        for folder in self._folders():
            state = self._read(folder, phases, fields)
            if state is not None:
                return {**state, "dir": folder}
        return None

    def _read(self, folder, phases=None, fields=None):
        path = os.path.join(folder, STATE)
        if not os.path.isfile(path):
            return None
        state = validate_state(read_json(path, "a checkpoint's state"), path, phases, fields)
        named = int(FOLDER.fullmatch(os.path.basename(folder))["step"])
        if state["phase_step"] != named:
            raise InputError(f"{path}: phase_step: {state['phase_step']}, but the checkpoint was saved as step "
                             f"{named}")
        missing = [name for name in ("config.json", "model.safetensors", OPTIMIZER) if name not in state["files"]]
        if missing:
            raise InputError(f"{path}: files: {missing[0]} is not listed")
        wrong = [f"{name} has {_size(os.path.join(folder, name))} bytes, {size} expected"
                 for name, size in state["files"].items() if _size(os.path.join(folder, name)) != size]
        if wrong:
            raise InputError(f"{folder}: {'; '.join(wrong)}: it changed after it was saved. Restore it, or move "
                             f"the folder out of {self.checkpoints} to use the checkpoint before it")
        return state

    # ---- the save ------------------------------------------------------------------------------------------

    def save(self, model, moments, state, tokenizer, keep):
        """Write a checkpoint of `state` (state["phase_step"] names it) and of Adam's `moments` ({name: (m, v)}),
        make OUT's Hugging Face files copies of its own, keep this run's `keep` newest checkpoints. Any failure (a
        full disk) leaves OUT as it was and raises one InputError. Returns the checkpoint's folder."""
        optimizer_tensors = moment_tensors(moments)
        if type(keep) is not int or keep < 1:
            raise InputError(f"--keep={keep}: expected an integer of at least 1 (checkpoints kept)")
        step = validate_state({**state, "files": {}}, "the state to save")["phase_step"]
        self._first_write()
        intact = self._intact()
        tensors = [*model.named_parameters(), *optimizer_tensors.items()]
        bad = next((name for name, t in tensors if not bool(t.isfinite().all())), None)
        if bad is not None:  # never replace a good checkpoint by a poisoned one
            raise InputError(f"non-finite values in {bad} at step {step}: nothing saved, {intact}")
        tmp = os.path.join(self.checkpoints, f".tmp-step-{step:08d}-{os.getpid()}")
        staged = {}
        try:
            if os.path.isfile(self.log_path):  # on the disk before the checkpoint: a crash keeps every step it holds
                _fsync(self.log_path)
            files = self._write(tmp, model, optimizer_tensors, state, tokenizer)
            # the model file last: until it is replaced, OUT's files are all the previous checkpoint's
            published = sorted((n for n in files if n != OPTIMIZER), key=lambda n: n == "model.safetensors")
            for name in published:
                staged[name] = os.path.join(self.path, f"{name}.tmp-{self.run_id}")
                _remove_file(staged[name])  # left by a save that was killed
                _copy(os.path.join(tmp, name), staged[name])
                _fsync(staged[name])
            for name in published:
                os.replace(staged[name], os.path.join(self.path, name))
                del staged[name]
            _fsync(self.path)
        except Exception as e:  # OSError, and safetensors' own error types on a full disk
            for path in staged.values():
                _remove_file(path)
            self._remove(tmp)
            reason = e.strerror if isinstance(e, OSError) and e.strerror else f"{type(e).__name__}: {str(e)[:200]}"
            culprit = isinstance(e, OSError) and (e.filename2 or e.filename)  # a folder at a top-level name, say
            reason = f"{culprit}: {reason}" if culprit else reason
            raise InputError(f"could not write the checkpoint of step {step} in {self.checkpoints}: {reason}; "
                             f"{intact}") from None
        folder = self._place(tmp, step)
        self._prune(keep, folder)
        return folder

    def _intact(self):
        """What a failed save leaves, for its message (a damaged older checkpoint must not stop the run here)."""
        try:
            previous = self.latest_state()
        except InputError:
            return "the earlier checkpoints are as they were"
        return f"the previous checkpoint {previous['dir']} is intact" if previous else \
            "this run has no earlier checkpoint; nothing was changed"

    def _write(self, tmp, model, optimizer_tensors, state, tokenizer):
        """The complete checkpoint in `tmp`: marker first, state.json last. Returns the files' sizes."""
        from safetensors.torch import save_file
        if self._ours(tmp):  # left by an earlier process with our pid
            self._remove(tmp)
        os.makedirs(tmp)
        try:
            with open(os.path.join(tmp, MARKER), "w", encoding="utf-8") as f:
                f.write(self.run_id + "\n")
        except OSError:  # a full disk here leaves an empty marker: the folder is not yet ours to clean
            _remove_file(os.path.join(tmp, MARKER))
            os.rmdir(tmp)
            raise
        model.save_pretrained(tmp)
        save_file({k: v.detach().contiguous() for k, v in optimizer_tensors.items()}, os.path.join(tmp, OPTIMIZER))
        tokenizer.save_pretrained(tmp)
        names = sorted(set(os.listdir(tmp)) - {MARKER})
        for name in [MARKER, *names]:
            _fsync(os.path.join(tmp, name))
        sizes = {name: os.path.getsize(os.path.join(tmp, name)) for name in names}
        write_json(os.path.join(tmp, STATE), validate_state({**state, "files": sizes}, "the state to save"))
        _fsync(tmp)
        return sizes

    def _place(self, tmp, step):
        """Rename the written folder to checkpoints/step-N. An earlier step-N of ours is moved aside first (it
        stays a complete checkpoint under its new name until the prune); someone else's is left alone."""
        target = os.path.join(self.checkpoints, f"step-{step:08d}")
        if os.path.lexists(target) and not self._ours(target):
            target = f"{target}-{self.run_id}"
        if os.path.lexists(target):
            os.rename(target, f"{tmp}-replaced")
        os.rename(tmp, target)
        _fsync(self.checkpoints)
        return target

    def _prune(self, keep, newest):
        """Remove this run's folders but `newest` and the keep - 1 next newest complete ones: folders of
        earlier, killed saves and damaged checkpoints go too."""
        kept = [newest]
        for folder in self._folders():
            if len(kept) < keep and folder != newest and not os.path.basename(folder).startswith("."):
                try:
                    if self._read(folder) is not None:
                        kept.append(folder)
                except InputError:
                    pass
        for folder in self._folders():
            if folder not in kept:
                self._remove(folder)

    def _remove(self, folder):
        """Delete the files a save writes in a folder of ours: state.json first (the folder stops counting as
        a checkpoint), the marker last (a kill midway leaves it ours, removed by the next save). A file we did
        not write stays, and so does the folder then."""
        if not self._ours(folder):
            return
        names = set(CHECKPOINT_FILES)
        with_state = os.path.join(folder, STATE)
        try:
            files = read_json(with_state).get("files", {})
            names.update(n for n in files if isinstance(n, str) and _plain_name(n))
        except (InputError, AttributeError, TypeError):
            pass
        try:
            ours = [n for n in os.listdir(folder) if n.split(".tmp")[0] in names and n != STATE]
            for name in [STATE, *ours, MARKER]:
                _remove_file(os.path.join(folder, name))
            if not os.listdir(folder):
                os.rmdir(folder)
        except OSError as e:
            print(f"warning: could not remove {folder} ({e.strerror})", file=sys.stderr)


def hold_lock(lock_path, busy):
    """An exclusive lock on the file lock_path (made if missing), held until release_lock(handle) or the
    process ends (a kill releases it too); InputError `busy` when another process holds it."""
    while True:
        try:
            handle = open(lock_path, "a+")
        except OSError as e:
            raise InputError(f"{lock_path}: cannot create the lock ({e.strerror})") from None
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.close()
            raise InputError(busy) from None
        # the previous holder may have removed the file after we opened it: hold the one that is there
        try:
            if os.path.samestat(os.fstat(handle.fileno()), os.stat(lock_path)):
                return handle
        except FileNotFoundError:
            pass
        handle.close()


def release_lock(handle):
    """Remove the lock file, then release it: a process waiting on the old file tries again."""
    _remove_file(handle.name)
    handle.close()


def card_is_ours(path):
    """Whether the model card at `path` may be rewritten by a save: missing, or a plain file whose last line is
    our mark holding the sha256 of the lines above it."""
    if not os.path.lexists(path):
        return True
    if os.path.islink(path) or not os.path.isfile(path):
        return False
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return False
    text, _, mark = data.rstrip(b"\n").rpartition(b"\n")
    digest = hashlib.sha256(text + b"\n").hexdigest()
    return mark.decode("utf-8", "replace") == CARD_MARK.format(digest)


def continuation_dir(parent, phase):
    """The default out_dir of a run that continues the run in `parent`: named after it (out/demo-mlm-clm)."""
    return f"{os.path.normpath(parent)}-{phase}"


def latest_state(path, phases=None, fields=None):
    """The newest complete checkpoint's state of the run in `path` (with "dir"), None if `path` is no run of
    ours or holds no checkpoint yet."""
    return RunDir.open(path).latest_state(phases, fields) if RunDir.is_run(path) else None


def _recency(name):
    """Among checkpoints of one step (a step saved again), the newer write: a save's complete folder not yet
    renamed (the top-level files may be its already), then the one in place, then the one it replaces."""
    return 0 if name.endswith("-replaced") else 2 if name.startswith(".") else 1


def _is_marker(info):
    return isinstance(info, dict) and info.get("written_by") == "train.py" and \
        isinstance(info.get("run_id"), str) and re.fullmatch(r"[0-9a-f]{32}", info["run_id"]) is not None


def _plain_name(name):
    return name not in ("", ".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _size(path):
    try:
        return os.path.getsize(path)
    except OSError:
        return None


# what copy_file_range answers where the file systems or the kernel cannot do it (the bytes then go through us)
NO_COPY_FILE_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}


def _copy(src, dst):
    """dst: a new file with src's bytes. copy_file_range lets the file system share the blocks copy-on-write (a
    reflink on btrfs and xfs: nothing written twice) or copy them inside the kernel."""
    with open(src, "rb") as source, open(dst, "wb") as target:
        size, done = os.fstat(source.fileno()).st_size, 0
        try:
            while done < size and hasattr(os, "copy_file_range"):  # Linux has it; elsewhere the bytes go through us
                n = os.copy_file_range(source.fileno(), target.fileno(), size - done)
                if n == 0:  # some file systems give up part way: the rest goes through us
                    break
                done += n
        except OSError as e:
            if e.errno not in NO_COPY_FILE_RANGE:
                raise
        source.seek(done)
        target.seek(done)
        shutil.copyfileobj(source, target, 1 << 24)


def _fsync(path):
    """Flush a file, or a folder's entries (a rename or a new file), to the disk. Some file systems cannot
    flush a folder (EINVAL): its entries then reach the disk when the file system decides."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (e.errno == errno.EINVAL and os.path.isdir(path)):
            raise
    finally:
        os.close(fd)


def _remove_file(path):
    try:
        os.remove(path)
    except (FileNotFoundError, NotADirectoryError):
        pass


# -----------------------------------------------------------------------------
# The schema of state.json: every field typed and bounded before any weight is loaded. Containers are typed
# down to their leaves, so nesting deeper than the schema's three levels fails where it starts.


class _Bad(Exception):
    def __init__(self, field, message):
        super().__init__(field, message)
        self.field, self.message = field, message


def _show(value):
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    text = repr(value)
    return f"{kind} {text[:60]}{'...' if len(text) > 60 else ''}" if not isinstance(value, (list, dict)) else kind


def _count(value, field):
    """An integer in [0, 2**62): a step or token counter. A bool is not an integer here."""
    if type(value) is not int:
        raise _Bad(field, f"expected an integer >= 0, got {_show(value)}")
    if not 0 <= value < MAX_INT:
        raise _Bad(field, f"expected an integer in [0, 2**62), got {value}")
    return value


def _text(value, field, limit=4096):
    if type(value) is not str or len(value) > limit:
        raise _Bad(field, f"expected a string of at most {limit} characters, got {_show(value)}")
    return value


def _object(value, field, check, limit):
    """A JSON object of at most `limit` entries, each value passed to check(value, field_of_entry)."""
    if type(value) is not dict or len(value) > limit:
        raise _Bad(field, f"expected an object of at most {limit} entries, got {_show(value)}")
    for key, item in value.items():
        check(item, f"{field}.{key}")
    return value


def _list(value, field, check, limit):
    if type(value) is not list or len(value) > limit:
        raise _Bad(field, f"expected a list of at most {limit} entries, got {_show(value)}")
    for i, item in enumerate(value):
        check(item, f"{field}[{i}]")
    return value


SETTINGS = {  # a setting's type name in train.py -> (check, what it expects)
    "int": (lambda v: type(v) is int and abs(v) < MAX_INT, "an integer of magnitude below 2**62"),
    "float": (lambda v: type(v) is int and abs(v) < MAX_INT or type(v) is float and math.isfinite(v),
              "a finite number"),
    "str": (lambda v: type(v) is str and len(v) <= 4096, "a string of at most 4096 characters"),
    "bool": (lambda v: type(v) is bool, "true or false"),
}


def _setting(value, field, kind=None):
    """One configuration value: a finite number, a string or a boolean; of type `kind` when it is known."""
    if kind not in SETTINGS:
        if not any(check(value) for check, _ in SETTINGS.values()):
            raise _Bad(field, f"expected a finite number, a string or a boolean, got {_show(value)}")
    elif not SETTINGS[kind][0](value):
        raise _Bad(field, f"expected {SETTINGS[kind][1]}, got {_show(value)}")


def _config(value, fields):
    """The resolved configuration: {name: value}, every one of `fields` there (those whose type ends in "?" may
    be missing) with its type when given. A setting not in `fields` (one removed from train.py's Config since the
    checkpoint was written) is read as any plain value: flags.absent_settings decides what a start makes of it."""
    if fields is None:
        return _object(value, "config", _setting, 512)
    _object(value, "config", lambda v, f: None, 512)
    for key, item in value.items():
        _setting(item, f"config.{key}", fields[key].rstrip("?") if key in fields else None)
    for key in fields:
        if key not in value and not fields[key].endswith("?"):  # "?": a setting an older checkpoint may lack
            raise _Bad(f"config.{key}", "missing, and a run cannot continue from it without it: its counters, data "
                                        "position and place in its schedule are counted in it")
    return value


def _loader(value, field):
    def check(item, name):
        if not (item is None or SETTINGS["int"][0](item) or SETTINGS["str"][0](item)):
            raise _Bad(name, f"expected an integer, a string or null, got {_show(item)}")
    _object(value, field, check, 64)
    if "sequence" not in value:
        raise _Bad(f"{field}.sequence", "missing")
    _count(value["sequence"], f"{field}.sequence")
    return value


def _rng_bytes(value, field):
    try:
        return base64.b64decode(_text(value, field, 1 << 20), validate=True)
    except (binascii.Error, ValueError):
        raise _Bad(field, "not base64 (expected an RNG state written by train.py)") from None


def _rng(value, field):
    import torch
    _object(value, field, _rng_bytes, 8)
    if "cpu" not in value:
        raise _Bad(f"{field}.cpu", "missing")
    want = torch.get_rng_state().numel()
    if len(_rng_bytes(value["cpu"], f"{field}.cpu")) != want:
        raise _Bad(f"{field}.cpu", f"expected {want} bytes of torch's CPU RNG state")
    return value


def _record(value, field):
    """One run this one continues: {phase, tokens, dir}."""
    if type(value) is not dict or set(value) != {"phase", "tokens", "dir"}:
        raise _Bad(field, f"expected an object with phase, tokens and dir, got {_show(value)}")
    _text(value["phase"], f"{field}.phase", 64)
    _count(value["tokens"], f"{field}.tokens")
    _text(value["dir"], f"{field}.dir")
    return value


def _files(value, field):
    _object(value, field, lambda v, f: None, 64)
    for name, size in value.items():
        if not _plain_name(name):
            raise _Bad(f"{field}[{name!r}]", "not a plain file name")
        _count(size, f"{field}[{name!r}]")
    return value


def _code(value, field):
    def check(item, name):
        if not (item is None or type(item) is str and len(item) <= 256):
            raise _Bad(name, f"expected a string or null, got {_show(item)}")

    def versions_or_check(item, name):
        if name == f"{field}.versions":  # {package: version}: code_version's
            _object(item, name, check, 16)
        else:
            check(item, name)
    return _object(value, field, versions_or_check, 16)


def _earlier(value, field):
    """The code of steps a resume under other code left behind: {until_step, code}."""
    if type(value) is not dict or set(value) != {"until_step", "code"}:
        raise _Bad(field, f"expected an object with until_step and code, got {_show(value)}")
    _count(value["until_step"], f"{field}.until_step")
    _code(value["code"], f"{field}.code")
    return value


STATE_FIELDS = {  # field -> check(value, field); phase and config are checked against the caller's tables
    "phase": lambda v, f: _text(v, f, 64), "adam_t": _count, "phase_step": _count, "phase_tokens": _count,
    "total_tokens": _count, "schedule_tokens_done": _count, "loader": _loader,
    "rng": lambda v, f: _list(v, f, _rng, 1 << 16), "config": None, "code": _code,
    "tokenizer": _text, "history": lambda v, f: _list(v, f, _record, 1000), "files": _files,
    "earlier_code": lambda v, f: _list(v, f, _earlier, 1000),
}
OPTIONAL = {"earlier_code"}  # fields a checkpoint written before they existed does not have


def validate_state(state, source, phases=None, fields=None):
    """state.json checked field by field; an InputError names `source` and the field. `phases`: the phase
    names allowed; `fields`: train.py's settings {name: "int" | "float" | "str" | "bool"}. Returns the state, Adam's
    t under its name of today."""
    try:
        return _checked_state(state, phases, fields)
    except _Bad as e:
        raise InputError(f"{source}: {e.field}: {e.message}") from None


def check_savable(state, steps_left, step_tokens, fields=None):
    """The state a save would write at the end of the budget (`state` as it is now, `steps_left` steps of
    `step_tokens` tokens to go; `fields`: train.py's settings and their types), checked as a save checks it: a
    value the format cannot hold (an integer of 2**62 or more, a string of more than 4,096 characters) is refused
    before the first step, not at the first save, after the training it was to keep."""
    tokens = steps_left * step_tokens
    end = {**state, "adam_t": state["adam_t"] + steps_left, "phase_step": state["phase_step"] + steps_left,
           "phase_tokens": state["phase_tokens"] + tokens, "total_tokens": state["total_tokens"] + tokens,
           "schedule_tokens_done": state["schedule_tokens_done"] + tokens, "files": {}}
    try:
        _config(end["config"], fields)  # first: the loader's state repeats the seeds, a flag names them here
        _checked_state(end, fields=fields)
    except _Bad as e:
        key = e.field.removeprefix("config.")
        if key != e.field:
            value = state["config"][key]
            shown = repr(value) if isinstance(value, str) else str(value)
            raise InputError(f"--{key}={shown[:60]}{'...' * (len(shown) > 60)}: a checkpoint cannot hold it "
                             f"({e.message}); nothing was trained") from None
        raise InputError(f"--tokens={state['config']['tokens']:,}: at the end of this budget the checkpoint's "
                         f"{e.field} cannot be saved ({e.message}); nothing was trained") from None


def _checked_state(state, phases=None, fields=None):
    """validate_state's checks; a failure is _Bad(field, message)."""
    if type(state) is not dict:
        raise _Bad("(top level)", f"expected an object, got {_show(state)}")
    if "step" in state and "adam_t" not in state:  # a checkpoint written before Adam's t had its own name
        state = {("adam_t" if key == "step" else key): value for key, value in state.items()}
    for key in [k for k in STATE_FIELDS if k not in OPTIONAL]:
        if key not in state:
            raise _Bad(key, "missing")
    for key, value in state.items():
        if key not in STATE_FIELDS:
            raise _Bad(key, f"not a field of a checkpoint's state (known: {', '.join(STATE_FIELDS)})")
        if key == "config":
            _config(value, fields)
        else:
            STATE_FIELDS[key](value, key)
    for field, phase in [("phase", state["phase"]), *((f"history[{i}].phase", h["phase"])
                                                       for i, h in enumerate(state["history"]))]:
        if phases is not None and phase not in phases:
            raise _Bad(field, f"{phase!r} is not a phase (known: {', '.join(phases)})")
    if state["adam_t"] < state["phase_step"]:
        raise _Bad("adam_t", f"{state['adam_t']} is less than phase_step {state['phase_step']}")
    if state["total_tokens"] < state["phase_tokens"]:
        raise _Bad("total_tokens", f"{state['total_tokens']} is less than phase_tokens {state['phase_tokens']}")
    return state


# -----------------------------------------------------------------------------
# RNG states, the code's version, the log, signals.


def rng_state(device):
    """This process's torch RNG states as base64 text (a checkpoint holds JSON, never pickles)."""
    import torch
    state = {"cpu": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if device.type == "cuda":
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state(device).numpy().tobytes()).decode()
    return state


def set_rng_state(state, device):
    import torch
    decode = lambda s: torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)  # noqa: E731
    torch.set_rng_state(decode(state["cpu"]))
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(decode(state["cuda"]), device)


def code_version():
    """The git commit when there is one, "+edits" after it where the files cli.source_digest hashes differ from the
    commit's (an ablation run before it is committed: the commit alone would name code that did not run); a hash of
    the code that ran: every script, this package and any other folder of code (cli.source_digest); the versions of the packages it ran on
    (cli.versions)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()
    try:
        commit = git("rev-parse", "HEAD")
        edited = commit and git("status", "--porcelain", "--", ":(glob)*.py", ":(glob)*/*.py",
                                *(f":(exclude){folder}/" for folder in NOT_CODE))
    except (OSError, subprocess.SubprocessError):
        commit, edited = "", ""
    return {"git": (commit + "+edits" if edited else commit) or None, "sha256": source_digest()[:16],
            "versions": versions()}


def code_record(resumed=None):
    """{code: what this invocation runs (code_version), earlier_code: the code of this phase's steps before}: for a
    resume of the checkpoint state `resumed`, its own list, and its code up to its step where this is other code or
    other packages (a checkpoint's `code` is the code that wrote it; this keeps that of every stretch before)."""
    now = code_version()
    kept, then = (resumed or {}).get("earlier_code", []), (resumed or {}).get("code")
    if then and (then.get("sha256") != now["sha256"] or then.get("versions", now["versions"]) != now["versions"]):
        kept = [*kept, dict(until_step=resumed["phase_step"], code=then)]
    return dict(code=now, earlier_code=kept)


def append_log(path, record):
    """One JSON line; a non-finite number is written as null (JSON has no NaN)."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()}
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(clean, allow_nan=False) + "\n")


_STARTING = None  # inside undone_if_refused: the run directories this process made or locked


@contextlib.contextmanager
def undone_if_refused():
    """Around a start of train.py: if it stops before its run writes a record or a checkpoint, every run directory
    it made or locked meanwhile is abandon()ed: a refused start into a fresh --out_dir leaves no folder, and a
    refused --resume leaves the run as it was. One that ends without a record (a --resume whose budget ends at its
    checkpoint) has its log cut back to that checkpoint all the same."""
    global _STARTING
    outer, _STARTING = _STARTING, []
    try:
        yield
    except BaseException:
        for run in _STARTING:
            run.abandon()
        raise
    else:  # the records a kill left past the checkpoint are not the run's: its summary would read them
        for run in _STARTING:
            run._first_write()
    finally:
        _STARTING = outer


class GracefulStop:
    """SIGINT and SIGTERM while training: the first sets .requested (the loop saves at the next step boundary
    and exits), a second raises KeyboardInterrupt at once. The previous handlers come back on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested, self.signal_name, self._old = False, None, {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc):
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}
        return False

    def _handle(self, signum, frame):
        if self.requested:
            raise Stop("a second signal: stopped at once; the newest checkpoint is the run's last", signum)
        self.requested, self.signal_name = True, signal.Signals(signum).name


# ---- where a run starts: the run it resumes or continues, and Adam's moments -----------------------------------


def resume_from(out_dir, master, share, phases, fields):
    """(run directory, newest complete checkpoint's state) of the run --resume continues: rank 0 opens and locks
    it, `share` hands its state to every rank (a collective). Its log keeps exactly the steps of that checkpoint:
    the steps after it are run, and logged, again (trimmed at the first record, so a refused resume changes
    nothing)."""
    if not RunDir.is_run(out_dir):
        raise InputError(f"--resume needs --out_dir=<a run directory of train.py>; {out_dir or 'none'} holds no "
                         f"{RUN_FILE}")
    run_dir = RunDir.open(os.path.normpath(out_dir)) if master else None
    if run_dir:
        run_dir.lock()
    state = share(run_dir.latest_state(phases, fields) if master else None)
    if state is None:
        raise InputError(f"--resume --out_dir={out_dir}: no complete checkpoint there yet")
    if run_dir:
        run_dir._log_until = state["phase_step"]
    return run_dir, state


def newest_state(init_from, phases, fields):
    """The newest complete checkpoint's state of --init_from when it is a run of ours, else None."""
    if not RunDir.is_run(init_from):
        return None
    state = RunDir.open(init_from).latest_state(phases, fields)
    if state is None:
        raise InputError(f"--init_from={init_from}: that run has no complete checkpoint yet")
    return state


def checkpoint_dir(init_from, state):
    """The folder a run takes its config.json and weights from: one of our runs' newest complete checkpoint
    (`state`), or a Hugging Face directory or hub id."""
    from machinery.hf import resolve_checkpoint
    if state is not None:
        return state["dir"]
    try:
        return resolve_checkpoint(init_from)
    except InputError as e:
        raise InputError(f"--init_from={init_from}: {e}") from None


def moment_tensors(moments):
    """Adam's moments ({name: (m, v)}) as the tensors optimizer.safetensors holds."""
    return {f"{kind}.{name}": t for name, pair in moments.items() for kind, t in zip(("exp_avg", "exp_avg_sq"), pair)}


def load_moments(moments, checkpoint, device):
    """Adam's moments ({name: (m, v)}, filled in place) from a checkpoint's optimizer.safetensors, whose names must
    be the model's."""
    from safetensors.torch import load_file
    from machinery.hf import check_finite
    path = os.path.join(checkpoint, OPTIMIZER)
    tensors, want = load_file(path, device=str(device)), set(moment_tensors(moments))
    if set(tensors) != want:
        raise InputError(f"{path} does not match the model: missing {sorted(want - set(tensors))[:5]}, unexpected "
                         f"{sorted(set(tensors) - want)[:5]}")
    check_finite(tensors, path, "Adam's moment")
    for name, (m, v) in moments.items():
        m.copy_(tensors[f"exp_avg.{name}"])
        v.copy_(tensors[f"exp_avg_sq.{name}"])


def default_dir(recipe, phase, init_from):
    """A run's --out_dir when none is given: out/<phase> at the paper's recipe, out/<recipe>-<phase> at the others;
    a run that continues one of ours is named after it (out/demo-mlm-clm)."""
    if RunDir.is_run(init_from):
        return continuation_dir(init_from, phase)
    return f"out/{phase}" if recipe == "paper" else f"out/{recipe}-{phase}"
