"""Live tracking: the records train.py appends to log.jsonl, sent as they are written to TensorBoard, Weights &
Biases or trackio too (--log_to), from rank 0. A reader of the recipe may skip this file.

Each tracker names a run after the run directory and keeps it across --resume: TensorBoard writes into
OUT/tensorboard and hides the steps a resumed run logs again (purge_step); W&B and trackio continue the run
whose id is OUT's run_id (resume="allow"). A tracker asked for but not installed, or that cannot start (W&B
without a login), stops the run at start: the user asked to watch it, and log.jsonl is there either way. A tracker
that fails once the run is going (a network error at its Nth call) is a side job's failure: one warning, it gets no
more records, and training goes on; log.jsonl holds every record, and a --resume starts it again.
"""
import importlib.util
import os

from machinery.cli import InputError, side_job

PROJECT = "modernbert"  # the W&B and trackio project, unless $WANDB_PROJECT or $TRACKIO_PROJECT names one


def names(log_to):
    """--log_to's trackers, checked: known names, each installed. Before any data is read. "none" (Hugging Face's
    word for no tracker) is none."""
    chosen = [n.strip() for n in log_to.split(",") if n.strip()] if log_to.strip() != "none" else []
    twice = sorted({n for n in chosen if chosen.count(n) > 1})
    if twice:  # it would get every point twice
        raise InputError(f"--log_to={log_to}: {', '.join(twice)} is named twice; name each tracker once")
    for name in chosen:
        if name not in TRACKERS:
            raise InputError(f"--log_to={log_to}: {name!r} is not a tracker; expected some of "
                             f"{', '.join(TRACKERS)}, comma-separated")
        if importlib.util.find_spec(name) is None:  # each tracker's package has its name
            raise InputError(f"--log_to={log_to}: the {name} package is not installed (pip install {name}); "
                             f"log.jsonl holds the same records without it: leave {name} out of --log_to")
    return chosen


class Trackers:
    """The trackers of one run: log(record) sends a log.jsonl record to each, close() flushes them."""

    def __init__(self, log_to="", out_dir="", run_id="", config=None, first_step=1):
        self.sinks = {}  # name -> tracker, those still working
        self.failed = {}  # name -> where it failed (at step N, or closing): what the summary says of it
        try:
            for name in names(log_to):
                self.sinks[name] = TRACKERS[name](out_dir, run_id, config, first_step)
        except InputError:
            self.close()
            raise
        except Exception as e:  # a login missing, a port taken: the package's own words, as one line
            self.close()
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise InputError(f"--log_to={log_to}: {type(e).__name__}: {first}") from None

    def log(self, record):
        """Every number of the record at its step (the phase, a word, is the run's: not a curve)."""
        scalars = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        for name, sink in list(self.sinks.items()):
            if not side_job(f"--log_to: {name} at step {record['step']}", sink.log, scalars, record["step"],
                            then="it gets no more records in this run; log.jsonl holds them all"):
                del self.sinks[name]
                self.failed[name] = f"at step {record['step']}"
                side_job(f"--log_to: closing {name}", sink.close)

    def close(self):
        for name, sink in self.sinks.items():
            if not side_job(f"--log_to: closing {name}", sink.close):
                self.failed[name] = "closing (its last records may be lost)"
        self.sinks = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):  # closed however the run ends
        self.close()


def run_name(out_dir):
    return os.path.basename(os.path.normpath(out_dir))


class TensorBoard:
    def __init__(self, out_dir, run_id, config, first_step):
        from torch.utils.tensorboard import SummaryWriter
        # a resumed run logs the steps after its checkpoint again: hide what an interrupted process wrote there
        self.writer = SummaryWriter(os.path.join(out_dir, "tensorboard"), purge_step=first_step)

    def log(self, scalars, step):
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, step)

    def close(self):
        self.writer.close()


class WandB:
    def __init__(self, out_dir, run_id, config, first_step):
        import wandb
        self.wandb = wandb
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", PROJECT), name=run_name(out_dir), id=run_id,
                              resume="allow", dir=out_dir, config=config)
        # our step is the x axis: W&B's own counter goes on across a resume, and a step logged twice stays
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, scalars, step):
        self.run.log({**scalars, "step": step})

    def close(self):
        self.run.finish()


class Trackio:
    def __init__(self, out_dir, run_id, config, first_step):
        import trackio
        self.run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", PROJECT),
                                name=f"{run_name(out_dir)}-{run_id[:8]}", resume="allow", config=config)

    def log(self, scalars, step):
        self.run.log(scalars, step=step)

    def close(self):
        self.run.finish()


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "trackio": Trackio}  # --log_to's names


# -----------------------------------------------------------------------------
# Where each tracker keeps the records and how to look at them: said when a run starts and when it ends.


def where(log_to, out_dir, failed=None):
    """A line per tracker of --log_to: where its records are, and the command that shows them; for one that failed
    (`failed`: Trackers.failed), where it failed and that log.jsonl holds every record."""
    board = os.path.join(out_dir, "tensorboard")
    wandb = os.path.join(out_dir, "wandb")
    views = {
        "tensorboard": f"TensorBoard event files in {board}/; to view them: tensorboard --logdir {board} (then "
                       f"open http://localhost:6006)",
        "wandb": f"W&B run {run_name(out_dir)} of project {os.environ.get('WANDB_PROJECT', PROJECT)} (its page: the "
                 f"URL wandb printed), files in {wandb}/; offline ($WANDB_MODE=offline), upload them with: wandb sync "
                 f"{wandb}/offline-run-*",
        "trackio": f"trackio project {os.environ.get('TRACKIO_PROJECT', PROJECT)}; to view it: trackio show --project "
                   f"{os.environ.get('TRACKIO_PROJECT', PROJECT)}"}
    failed, names = failed or {}, [n.strip() for n in log_to.split(",")]
    return [f"{name} failed {failed[name]} (the warning above says why): it holds the records before that; "
            f"log.jsonl holds them all" if name in failed else views[name] for name in names
            if name in failed or name in views]
