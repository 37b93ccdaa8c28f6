"""The command-line layer every script shares: one error type, one parser, one device, thread and autocast
picker, JSON in and out, a file's SHA-256. A reader of the recipe may skip this file."""
import argparse
import contextlib
import hashlib
import json
import os
import sys
from pathlib import Path


class InputError(ValueError):
    """A bad flag or input file, or a run that cannot go on. `run` prints it as `error: <message>` and exits
    with status 2, never a traceback: the user made a mistake the message explains."""


def run(main, argv=None):
    """Call main(argv). An InputError becomes one line on stderr (rank 0 only under torchrun) and exit 2;
    so does a collective that waited past its timeout (a peer stalled or died), never a hang."""
    try:
        return main(argv)
    except InputError as e:
        if int(os.environ.get("RANK", 0)) == 0:
            print(f"error: {e}", file=sys.stderr, flush=True)
        e.__traceback__ = None  # drop main()'s frames now: they may hold a run directory's lock
        raise SystemExit(2) from None
    except RuntimeError as e:  # how gloo and NCCL report a collective that waited past the timeout
        dist = sys.modules.get("torch.distributed")
        if not (dist and dist.is_initialized() and "timed out" in str(e).lower()):
            raise
        print(f"error: rank {dist.get_rank()}: another process did not answer within --ddp_timeout; it stalled "
              f"or died ({str(e).splitlines()[0][-120:]}). Resume with --resume", file=sys.stderr, flush=True)
        os._exit(2)  # the process group cannot be torn down cleanly while a peer is stuck
    finally:
        dist = sys.modules.get("torch.distributed")
        if dist and dist.is_available() and dist.is_initialized():
            import gc
            gc.collect()  # DDP's reducer goes before its process group: gloo aborts if it outlives it
            dist.destroy_process_group()


class Parser(argparse.ArgumentParser):
    """argparse that shows every default in --help, turns usage errors into InputError, and refuses a flag
    given twice (argparse would silently keep the last value)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise InputError(f"{self.prog}: {message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        refuse_repeats(args, self)
        return super().parse_args(args, namespace)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and `(default: ...)` after every flag's meaning that has one
    (a required flag, or a default of None that the meaning explains, has none to show)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, argparse.SUPPRESS, False, [], ()) and not action.required \
                and action.option_strings and "(default" not in text:
            shown = ",".join(map(str, action.default)) if isinstance(action.default, (list, tuple)) \
                else action.default
            text += f" (default: {shown})"
        return text


def refuse_repeats(argv, parser=None):
    """A flag given twice is an error: --lr=1 ... --lr=2 is a typo far more often than an intent. Flags made
    to repeat (argparse action="append") are exempt."""
    repeatable = set()
    for p in _parsers(parser):
        for action in p._actions:
            if isinstance(action, argparse._AppendAction):
                repeatable.update(action.option_strings)
    seen = set()
    for arg in argv:
        if arg == "--":
            break
        if not arg.startswith("--"):
            continue
        name = arg.split("=", 1)[0]
        if name in seen and name not in repeatable:
            raise InputError(f"{name} is given twice; give each flag once")
        seen.add(name)


def _parsers(parser):
    """The parser and its sub-command parsers."""
    if parser is None:
        return []
    found = [parser]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _parsers(sub)
    return found


def positive_int(text):
    """argparse type: an integer >= 1, parsed as an integer (never through float, which rounds above 2**53)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected at least 1, got {text}")
    return value


def usable_cores():
    """The cores this process may run on (a container or taskset may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def pick_threads(requested=0, processes=1):
    """Intra-op threads of a CPU process: `requested`, else $OMP_NUM_THREADS, else the cores idle now shared
    by the `processes` started on this machine. PyTorch's default (a thread per core in every process)
    oversubscribes a machine that runs anything else: on 2 cores beside one busy process the demo took 1.8x
    the wall time and 2.4x the CPU time with 2 threads than with 1."""
    if requested:
        return requested
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    idle = usable_cores() - round(os.getloadavg()[0])
    return max(1, min(usable_cores(), idle) // max(1, processes))


def pick_device(requested="auto", local_rank=0, flag="--device"):
    """auto: this process's GPU under torchrun (LOCAL_RANK), else the CPU. A device that is not here is an
    InputError naming `flag`."""
    import torch
    if requested in (None, "auto"):
        return torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except (RuntimeError, ValueError):
        raise InputError(f"{flag}={requested!r}: expected auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"{flag}={requested}: expected auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(f"{flag}={requested}: CUDA is not available on this machine")
        if device.index is None:
            device = torch.device(f"cuda:{local_rank}")
        if device.index >= torch.cuda.device_count():
            raise InputError(f"{flag}={requested}: this machine has {torch.cuda.device_count()} GPU(s)")
    return device


def autocast(device, dtype="bfloat16"):
    """bf16 autocast on CUDA; fp32 on a CPU, where bf16 is slow and buys nothing."""
    import torch
    device = torch.device(device)
    if device.type == "cuda" and dtype != "float32":
        return torch.autocast("cuda", dtype=getattr(torch, dtype))
    return contextlib.nullcontext()


def read_json(path, what="a JSON file"):
    """The parsed file, or an InputError naming it and what it should have been."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise InputError(f"{path}: missing (expected {what})") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror})") from None
    except (ValueError, RecursionError) as e:
        raise InputError(f"{path}: not valid JSON ({str(e)[:120]}); expected {what}") from None


def sha256_file(path):
    """The hex SHA-256 of a file's bytes, read in 16 MiB pieces (a model.safetensors can be gigabytes)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for piece in iter(lambda: f.read(1 << 24), b""):
                digest.update(piece)
    except OSError as e:
        raise InputError(f"{path}: cannot read it ({e.strerror})") from None
    return digest.hexdigest()


def write_json(path, obj):
    """Write through a temporary file and rename, so a reader never sees half a file."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, allow_nan=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def save(path, obj):
    """write_json into a folder made if needed; a full disk or an unwritable folder as one error line (the old file
    is kept)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json(str(path), obj)
    except OSError as e:
        raise InputError(f"{path}: cannot write it ({e.strerror or e})") from None
