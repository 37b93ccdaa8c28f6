"""The command-line layer every script shares: one error type, one parser, torchrun's variables checked and the
processes met, one device, thread and autocast picker, out-of-memory recognised, output paths checked before the
work, JSON in and out, a file's SHA-256 and the code's. A reader of the recipe may skip this file."""
import argparse
import contextlib
import difflib
import functools
import math
import hashlib
import importlib.metadata
import json
import os
import platform
import signal
import sys
from pathlib import Path


class InputError(ValueError):
    """A bad flag or input file, or a run that cannot go on. `run` prints it as `error: <message>` and exits
    with status 2, never a traceback: the user made a mistake the message explains. Under torchrun rank 0 alone
    prints it (every rank meets the same flags and files), unless `every_rank`: an error of this process alone
    (its rendezvous, its memory)."""

    def __init__(self, message, every_rank=False):
        super().__init__(message)
        self.every_rank = every_rank


class Stop(KeyboardInterrupt):
    """A stop asked for by a signal (Ctrl-C's SIGINT, or SIGTERM under stop_on_sigterm), with what it left behind:
    `run` prints it as one line and exits with 128 + the signal's number, as a shell reports such a stop."""

    def __init__(self, message="", signum=signal.SIGINT):
        super().__init__(message)
        self.signum = signum


@contextlib.contextmanager
def stop_on_sigterm():
    """Inside the block SIGTERM stops the work as Ctrl-C does (a Stop raised where the main thread is), so that
    the `with` and `finally` blocks it is in clean up: a pool's workers ended, a temporary folder removed, a lock
    released. The previous handlers come back after. A process forked inside the block (a pool's worker, before it
    sets its own handlers) that gets SIGTERM or Ctrl-C's SIGINT ends there and then: a Stop raised in it would
    unwind the parent's copied stack and run on as a second copy of the parent (seen: a test process's copy that
    waited forever for tests, and its pool with it)."""
    owner = os.getpid()

    def stop(signum, frame):
        if os.getpid() != owner:
            os._exit(128 + signum)
        raise Stop(signum=signum)
    old = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}  # Ctrl-C: Stop is one too
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def importing():
    """Called once a script's flags are checked, before it imports torch (seconds on an idle machine, a minute on a
    busy one): until `run` calls its main, Ctrl-C ends the process with one line, as a stop inside `run` does, not
    with the traceback of whichever module was loading. Nothing is written by then, so it ends there and then."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not where the shell left Ctrl-C ignored
        signal.signal(signal.SIGINT, stopped_while_importing)


def stopped_while_importing(signum, frame):
    if reports_errors():
        print(f"stopped by {signal.Signals(signum).name}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def run(main, argv=None):
    """Call main(argv). An InputError becomes one line on stderr (rank 0 only under torchrun) and exit 2;
    so does a collective that waited past its timeout (a peer stalled or died), never a hang. A stop (Ctrl-C, or
    a SIGTERM the command turned into one) is one line too, never a traceback."""
    if signal.getsignal(signal.SIGINT) is stopped_while_importing:  # main's stops unwind: its `with` blocks clean up
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        check_planned_code()  # reads the code now, as near its imports as a process gets: what it records ran
        return main(argv)
    except InputError as e:
        if e.every_rank or reports_errors():
            print(f"error: {e}", file=sys.stderr, flush=True)
        e.__traceback__ = e.__context__ = None  # drop main()'s frames now: they may hold a run directory's lock
        raise SystemExit(2) from None
    except KeyboardInterrupt as e:
        signum = getattr(e, "signum", signal.SIGINT)
        if reports_errors():
            print(f"stopped by {signal.Signals(signum).name}{': ' * bool(str(e))}{e}", file=sys.stderr, flush=True)
        e.__traceback__ = e.__context__ = None
        raise SystemExit(128 + signum) from None
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


def side_job(what, fn, *args, then="training goes on"):
    """fn(*args) for work beside the training (a tracker, the loss picture, the model card): its failure is one
    warning line naming `what`, and the caller goes on, since nothing the run computed depends on it. Returns
    whether fn succeeded."""
    try:
        fn(*args)
        return True
    except Exception as e:  # whatever a tracker's network stack or a plotting library raises
        first = (str(e).strip().splitlines() or [""])[0][:300]
        print(f"warning: {what} failed ({type(e).__name__}: {first}); {then}", file=sys.stderr, flush=True)
        return False


def die_with(parent):
    """For a child process, run first thing in it: the kernel sends it SIGKILL when `parent` dies, even by SIGKILL,
    so that nothing it holds (a lock, a half-written file, a stage's run) outlives the process that started it.
    Linux only (prctl); elsewhere the check after it still catches a parent that died before the child started."""
    if sys.platform.startswith("linux"):
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before that took effect
        os._exit(1)


# What torchrun sets in every process it starts: which process it is (RANK, LOCAL_RANK) of how many (WORLD_SIZE,
# LOCAL_WORLD_SIZE), and where they meet (MASTER_ADDR, MASTER_PORT). The first four make a process one of a job.
PROCESS_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def processes(script="train.py"):
    """(rank, world, local_rank, local_world) of this process: torchrun's variables, or (0, 1, 0, 1) where none
    of the first four is set (MASTER_ADDR and MASTER_PORT alone name no job: some clusters export them). A partial
    or inconsistent set (leftovers of a torchrun job in the shell, a hand-written launch) is an InputError that
    says what is set, what is wrong and what to run instead, never a traceback or a wait at the rendezvous.
    One process (WORLD_SIZE=1) meets nobody, so it needs no MASTER_ADDR or MASTER_PORT."""
    env = {k: os.environ[k] for k in PROCESS_VARIABLES if k in os.environ}
    if not env.keys() & set(PROCESS_VARIABLES[:4]):
        return 0, 1, 0, 1
    numbers = {k: int(v) for k, v in env.items() if k != "MASTER_ADDR" and v.isascii() and v.isdigit()}
    problem = process_problem(env, numbers)
    if problem:
        shown = " ".join(f"{k}={v}" for k, v in env.items())
        raise InputError(f"the environment sets {shown}: {problem}. Start N processes with `torchrun "
                         f"--nproc_per_node=N {script} ...` (it sets them all), or run one after `unset "
                         f"{' '.join(env)}`")
    world = numbers["WORLD_SIZE"]
    return numbers["RANK"], world, numbers.get("LOCAL_RANK", 0), numbers.get("LOCAL_WORLD_SIZE", world)


def process_problem(env, numbers):
    """What is wrong with a set of torchrun's variables (`numbers`: those that are whole numbers), or None."""
    bad = [k for k in env if k != "MASTER_ADDR" and k not in numbers]
    if bad:
        return f"{', '.join(bad)} must be {'a whole number' if len(bad) == 1 else 'whole numbers'}"
    needed = ["RANK", "WORLD_SIZE"] + (["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"]
                                       if numbers.get("WORLD_SIZE", 1) > 1 else [])
    missing = [k for k in needed if k not in env]
    if missing:
        return f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} missing"
    rank, world = numbers["RANK"], numbers["WORLD_SIZE"]
    local_rank, local_world = numbers.get("LOCAL_RANK", 0), numbers.get("LOCAL_WORLD_SIZE", world)
    rules = [(rank < world, "RANK must be below WORLD_SIZE"),
             (1 <= local_world <= world, "LOCAL_WORLD_SIZE must be 1 to WORLD_SIZE"),
             (local_rank < local_world, "LOCAL_RANK must be below LOCAL_WORLD_SIZE (or WORLD_SIZE)"),
             (1 <= numbers.get("MASTER_PORT", 1) <= 65535, "MASTER_PORT must be a port, 1 to 65535")]
    return next((message for ok, message in rules if not ok), None)


@contextlib.contextmanager
def rendezvous(rank, world, timeout, device, script="train.py"):
    """Around init_process_group, one line from each process, never a traceback. The others that never came (a
    complete set of torchrun's variables left in a shell) or a port taken: the store's rendezvous failed. NCCL (or
    gloo) failing to start its communicator on `device` after the rendezvous: its own words, and what to check."""
    import torch.distributed as dist
    try:
        yield
    except (dist.DistStoreError, dist.DistNetworkError) as e:
        raise InputError(f"rank {rank} of {world} did not meet the others at {os.environ['MASTER_ADDR']}:"
                         f"{os.environ['MASTER_PORT']} within --ddp_timeout={timeout.total_seconds():.0f} s "
                         f"({str(e).splitlines()[0][:160]}); start every process with `torchrun --nproc_per_node=N "
                         f"{script} ...`, or `unset {' '.join(PROCESS_VARIABLES)}` to run one",
                         every_rank=True) from None
    except dist.DistBackendError as e:
        what = "NCCL" if device.type == "cuda" else "gloo"
        words = " ".join(str(e).split())[:400]
        check = ("each process on a GPU of its own (--nproc_per_node at most the GPUs in CUDA_VISIBLE_DEVICES), the "
                 "network interface NCCL picks (NCCL_SOCKET_IFNAME), the driver (nvidia-smi); NCCL_DEBUG=INFO says "
                 "what NCCL tried") if device.type == "cuda" else \
            "the network interface gloo picks (GLOO_SOCKET_IFNAME)"
        raise InputError(f"rank {rank} of {world}: {what} could not start on {device}: {words}. Check {check}",
                         every_rank=True) from None


def init_processes(requested_device, timeout, script="train.py"):
    """(rank, world, local_world, device) of this process: torchrun's variables checked, the device picked (TF32
    matmuls on a GPU), and a process group only where there are others to meet: NCCL on GPUs, gloo on CPUs. One
    code path for 1 and N processes."""
    import torch
    import torch.distributed as dist
    rank, world, local_rank, local_world = processes(script)
    device = pick_device(requested_device, local_rank, local_world=local_world)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    if world > 1:  # device_id: NCCL binds this rank to its GPU now, not at its first collective
        with rendezvous(rank, world, timeout, device, script):
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                                    device_id=device if device.type == "cuda" else None)
    return rank, world, local_world, device


def all_gather(obj, world):
    """Every rank's obj. A collective: every rank must call it at the same point."""
    if world == 1:
        return [obj]
    import torch.distributed as dist
    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def all_reduce(tensor, world):
    """`tensor` summed over every rank, in place. A collective: every rank must call it at the same point."""
    if world > 1:
        import torch.distributed as dist
        dist.all_reduce(tensor)
    return tensor


def launcher(script):
    """The words that start `script` again as this process was started: `python SCRIPT`, or torchrun with the
    same processes per machine (from torchrun's variables). `script` is shown relative to the current folder
    when it is inside it, else absolute, so that the command runs from here as printed. Several machines need
    the job's own rendezvous flags, which no variable records: the placeholder says so."""
    relative = os.path.relpath(script)
    path = relative if not relative.startswith("..") else os.path.abspath(script)
    _, world, _, local_world = processes()
    if world == 1 and "TORCHELASTIC_RUN_ID" not in os.environ:  # torchrun sets it in every process it starts
        return ["python", path]
    if world == local_world:  # one machine: --standalone finds a free port by itself
        return ["torchrun", "--standalone", f"--nproc_per_node={local_world}", path]
    return ["torchrun", f"--nnodes={world // local_world}", f"--nproc_per_node={local_world}",
            "<rendezvous flags of the job, on every machine>", path]


_said = set()  # the messages this process has printed: each is said once


def say_once(message):
    """A warning on stderr, once per process however often its cause comes back (a picture drawn at every save, a
    model built per fine-tuning seed), and under torchrun by rank 0 alone."""
    if message not in _said and reports_errors():
        _said.add(message)
        print(message, file=sys.stderr, flush=True)


def reports_errors():
    """Whether this process prints an error: not the ranks above 0 of a torchrun job (all ranks meet the same
    errors; one line is enough), but any process whose variables are leftovers (the error may be about them)."""
    try:
        return processes()[0] == 0
    except InputError:
        return True


def out_of_memory(e):
    """Whether an exception is an allocation that failed: CUDA's torch.OutOfMemoryError, numpy's MemoryError,
    or the CPU allocator's RuntimeError ("DefaultCPUAllocator: can't allocate memory")."""
    return isinstance(e, MemoryError) or (isinstance(e, RuntimeError) and any(
        words in str(e) for words in ("out of memory", "can't allocate memory", "CUBLAS_STATUS_ALLOC_FAILED")))


def check_writable(path, flag):
    """An output file that the work writes at its end, opened for writing before the work (and removed again if
    it was not there): a folder, a missing folder or a read-only disk would otherwise lose the results."""
    existed = os.path.lexists(path)
    try:  # non-blocking: a named pipe without a reader must not hang the check
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK))
    except OSError as e:
        raise InputError(f"{flag}={path}: cannot write it ({e.strerror}); name a file in a folder that exists "
                         f"and can be written") from None
    if not existed:
        os.remove(path)


def same_file(a, b):
    """Whether two paths name one file: the same path once resolved, or two names of one file (a hard link)."""
    a, b = Path(a), Path(b)
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is missing
        return False


# A model folder's files (Hugging Face's, and those of a run of train.py): a result written over one of them leaves
# a model that no longer loads, is no longer the model trained, or has lost its card or its log (a run's loss.png
# is not among them: any save or `python eval.py curves RUN` draws it again).
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "README.md", "run.json", "log.jsonl")


def model_of(path):
    """What `path` would overwrite of a model, in words, or None: a file of MODEL_FILES that is there, in a folder
    holding config.json and model.safetensors or a run of train.py (its run.json); anything inside a run's
    checkpoints/."""
    path = Path(os.path.abspath(path))
    run = next((f.parent for f in path.parents if f.name == "checkpoints" and (f.parent / "run.json").is_file()),
               None)
    if run is not None:
        return f"a file inside the checkpoints of the run in {run}"
    folder = path.parent
    is_model = (folder / "run.json").is_file() or all((folder / n).is_file() for n in MODEL_FILES[:2])
    return f"a file of the model in {folder}" if path.name in MODEL_FILES and os.path.lexists(path) and is_model \
        else None


def check_outputs(flag, outputs, reads):
    """The files a command writes (`outputs`: the one `flag` names, then those written beside it), checked before
    any compute: none is a folder, none is a file the command reads (`reads`: an --out naming the held-out texts
    would replace them with the result) or a file of a model (model_of), no two are one file, and each can be
    written (its folder is made)."""
    given = outputs[0] if outputs else None
    for i, path in enumerate(map(Path, outputs)):
        what = "it" if i == 0 else f"{path}, written beside it,"
        if path.is_dir():
            raise InputError(f"{flag}={given}: {'it' if i == 0 else path} is a folder; {flag} names a file to write")
        read = next((r for r in reads if same_file(path, r)), None)
        if read is not None:
            raise InputError(f"{flag}={given}: {what} would overwrite {read}, which this command reads; choose "
                             f"another {flag}")
        model = model_of(path)
        if model is not None:
            raise InputError(f"{flag}={given}: {what} would write {path}, {model}; choose another {flag}")
        if any(same_file(path, other) for other in outputs[:i]):
            raise InputError(f"{flag}={given}: the command also writes {path} beside it, the same file; choose "
                             f"another {flag}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise InputError(f"{flag}={given}: cannot make its folder {path.parent} ({e.strerror or e})") from None
        check_writable(str(path), flag)


def did_you_mean(flag, names):
    """"; did you mean --x?" for a mistyped --flag: the names closest to it by spelling (difflib's ratio, as a
    typo keeps most letters in order: --tokns is --tokens), or "" where none is close."""
    close = difflib.get_close_matches(flag.lstrip("-").replace("-", "_"), dict.fromkeys(names), n=3, cutoff=0.6)
    return f"; did you mean {' or '.join('--' + name for name in close)}?" if close else ""


class Parser(argparse.ArgumentParser):
    """argparse that shows every default in --help, turns usage errors into InputError, refuses a flag given
    twice (argparse would silently keep the last value), takes a flag by its whole name only (argparse would take
    --scal for --scale, and a typo for another flag), and answers an unknown flag with the closest ones."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message):
        raise InputError(f"{self.prog}: {message} (see {self.prog} --help)")

    def parse_args(self, args=None, namespace=None):
        args = sys.argv[1:] if args is None else list(args)
        refuse_repeats(args, self)
        try:
            namespace, extras = self.parse_known_args(args, namespace)
        except InputError:  # a required flag missing: because it was mistyped, most often; that is the error
            extras, namespace = [a for a in args if a.startswith("--") and not self.knows(a)], None
            if not extras:
                raise
        if extras:
            flag = next((a.split("=", 1)[0] for a in extras if a.startswith("--")), "")
            hint = did_you_mean(flag, flag_names(self, namespace)) if flag else ""
            self.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return namespace

    def knows(self, arg):
        """Whether --flag[=value] names a flag of this parser or its sub-commands."""
        return arg == "--" or arg.split("=", 1)[0][2:] in flag_names(self)


def flag_names(parser, namespace=None):
    """The --flags (without dashes) of the parser and of the sub-command that `namespace` chose (None: of every
    sub-command)."""
    names = [o[2:] for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(namespace, action.dest, None) if namespace is not None else None
            for name, sub in action.choices.items():
                if chosen in (None, name):
                    names += flag_names(sub, namespace)
    return names


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


def positive_float(text):
    """argparse type: a finite number above 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a finite number above 0, got {text!r}")
    return value


def usable_cores():
    """The cores this process may run on (a container or taskset may allow fewer than the machine has)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


MAX_THREADS = 1024  # more than any process is given; far more threads fail to start, or overflow a C int


def pick_threads(requested=0, processes=1):
    """Intra-op threads of a CPU process: `requested`, else $OMP_NUM_THREADS, else the cores idle now shared
    by the `processes` started on this machine. PyTorch's default (a thread per core in every process)
    oversubscribes a machine that runs anything else: on 2 cores beside one busy process the demo took 1.8x
    the wall time and 2.4x the CPU time with 2 threads than with 1."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    for source, n in (("--threads", requested or 0), ("OMP_NUM_THREADS", int(env) if env.isdigit() else 0)):
        if n > MAX_THREADS:
            raise InputError(f"{source}={n}: expected at most {MAX_THREADS} threads (this process may use "
                             f"{usable_cores()} cores)")
        if n > 0:
            return n
    idle = usable_cores() - round(os.getloadavg()[0])
    return max(1, min(usable_cores(), idle) // max(1, processes))


def pick_device(requested="auto", local_rank=0, flag="--device", local_world=1):
    """auto: this process's GPU under torchrun (LOCAL_RANK), else the CPU. A device that is not here is an
    InputError naming `flag`, and so is one GPU named for the `local_world` processes of this machine."""
    import torch
    if local_world > 1 and str(requested).startswith("cuda:"):  # before a GPU is touched or a process group made
        raise InputError(f"{flag}={requested} names one device for the {local_world} processes on this machine, "
                         f"which would all run on it: use {flag}=cuda (each process takes the GPU of its LOCAL_RANK) "
                         f"or leave it out")
    if requested in (None, "auto"):
        if not torch.cuda.is_available():
            return torch.device("cpu")
        if local_rank >= torch.cuda.device_count():
            raise InputError(f"LOCAL_RANK={local_rank} asks for GPU {local_rank}, and this machine has "
                             f"{torch.cuda.device_count()}; start at most that many processes per machine")
        return torch.device(f"cuda:{local_rank}")
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


REPOSITORY = Path(__file__).resolve().parent.parent  # the scripts, machinery/ and any other folder of code


def source_digest(now=False):
    """The hex SHA-256 of every .py file of the repository's scripts and of its folders one level down (their names
    and contents; `code_files`):
    all the code that can change a result kept across commands (a fine-tuning seed, a study's stage, the code a
    checkpoint was written by), not a list of files that an edit elsewhere would slip past. Read once per process
    (at its start: `run`), as the code it describes was imported once; `now`: read the files again (a study's
    driver: has the code changed since it began?)."""
    return _digest_of_sources.__wrapped__(REPOSITORY) if now else _digest_of_sources(REPOSITORY)


NOT_CODE = ("tests", "docs")  # folders whose .py files cannot change a result: the checks and the documents


def code_files(root):
    """The .py files a result can come from: the scripts, machinery/ and any folder beside it (a student's
    `ablations/x.py`, imported by an edited script, is code a cache must not outlive), one level down."""
    return sorted(path for path in [*root.glob("*.py"), *root.glob("*/*.py")]
                  if path.parent == root or not (path.parent.name in NOT_CODE or path.parent.name.startswith(".")))


@functools.cache
def _digest_of_sources(root):
    digest = hashlib.sha256()
    for path in code_files(root):
        content = path.read_bytes()
        digest.update(f"{path.relative_to(root).as_posix()}\0{len(content)}\0".encode() + content)
    return digest.hexdigest()


# The packages whose versions can change a number that is kept across commands: with the code (source_digest) they
# name what computed a stage of reproduce.py, a fine-tuning seed, a checkpoint that --resume continues.
PACKAGES = ("torch", "numpy", "tiktoken", "safetensors", "flash-attn")


@functools.cache
def versions():
    """{"python": its version, package: version} for each of PACKAGES that is installed, read from the packages'
    metadata (nothing is imported). torch's names its build (2.13.0+cpu, 2.11.0+cu130): the same code on another
    build computes other roundings."""
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


PLANNED = "REPRODUCE_PLANNED"  # set by reproduce.py in each stage's environment: what its experiment was planned with


def check_planned_code():
    """In a stage of a reproduce.py experiment: an InputError unless this process runs the code and the packages the
    experiment was planned with (PLANNED, JSON: {"code": source_digest(), "versions": versions()}). An edit made
    while a study runs would otherwise reach the stages that start after it, under the plan's name."""
    planned, now = json.loads(os.environ.get(PLANNED) or "null"), source_digest()
    if planned is None:
        return
    changed = changed_versions(planned["versions"], versions())
    if planned["code"] != now:
        what = (f"other code than its experiment was planned with ({planned['code'][:12]} then, {now[:12]} now: a .py "
                f"file of the repository changed while the experiment ran)")
    elif changed:
        what = f"on other packages than its experiment was planned with ({changed})"
    else:
        return
    raise InputError(f"this stage of a reproduce.py experiment would run {what}, and its results would be reported "
                     f"under the plan's name. Restore what the experiment started with and run the same command "
                     f"again (the finished stages stay), or choose a new --out; a long study is best run from a copy "
                     f"of the code that nobody edits (git worktree add DIR COMMIT)", every_rank=True)  # its own read


def changed_versions(before, now):
    """'torch 2.11.0+cu130 -> 2.13.0+cpu, ...': the packages whose versions differ between two versions() records
    ('' where none does; a record written before versions were kept reads as {}, and says nothing)."""
    if not isinstance(before, dict) or not before:
        return ""
    names = [n for n in dict.fromkeys([*before, *now]) if before.get(n) != now.get(n)]
    return ", ".join(f"{n} {before.get(n, 'absent')} -> {now.get(n, 'absent')}" for n in names)


def write_text(path, text):
    """Write `text` (a string, or an iterable of its pieces: a long file is never held whole) through a temporary
    file and a rename, so that a reader never sees half a file and a failure midway (a full disk, an error while
    the pieces are made) leaves the file that was there."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines([text] if isinstance(text, str) else text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def write_json(path, obj):
    """write_text of obj as indented JSON (strict: no NaN)."""
    write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def save(path, obj):
    """write_json into a folder made if needed; a full disk or an unwritable folder as one error line (the old file
    is kept)."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        write_json(str(path), obj)
    except OSError as e:
        raise InputError(f"{path}: cannot write it ({e.strerror or e})") from None
