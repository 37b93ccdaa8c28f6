"""The JSON files reproduce.py reads back, checked field by field into one error line that names the file and the
field: a finished report's variance components (what the dry run projects onto a plan), OUT/plan.json and the
stage records. A file edited by hand, cut short or of another tool is refused by name, never a traceback. A reader
of the studies may skip this file."""
import math

from machinery.cli import InputError, read_json


def is_count(v):
    return type(v) is int and v >= 1


def is_real(v):
    return type(v) in (int, float) and math.isfinite(v)


# A difference's variance components, as machinery/compare.py's `interval` writes them: the fields the planner reads.
COMPONENTS = {
    "replicates": (is_count, "an integer >= 1"),
    "seeds": (is_count, "an integer >= 1"),
    "examples": (is_count, "an integer >= 1"),
    "replicate_var": (lambda v: v is None or is_real(v), "a finite number or null (below 0 where noise puts it)"),
    "seed_var": (lambda v: v is None or is_real(v) and v >= 0, "a finite number >= 0 or null"),
    "example_var": (lambda v: is_real(v) and v >= 0, "a finite number >= 0"),
    "seeds_inside": (lambda v: type(v) is bool, "true or false"),
}


class Bad(Exception):
    def __init__(self, field, message):
        super().__init__(field, message)
        self.field, self.message = field, message


def shown(value):
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' * (len(text) > 60)}"


def entries(obj, field, optional=False):
    """The (key, value) pairs of the JSON object obj[field] (an object itself); absent or null: none where optional."""
    value = obj.get(field) if isinstance(obj, dict) else None
    if value is None and optional:
        return []
    if not isinstance(value, dict):
        raise Bad(field, f"expected an object, got {shown(value)}")
    return value.items()


def components(c, field):
    """One difference's components, checked: the COMPONENTS fields alone (another field is not read)."""
    if not isinstance(c, dict):
        raise Bad(field, f"expected an object, got {shown(c)}")
    for key, (ok, expected) in COMPONENTS.items():
        if key not in c:
            raise Bad(f"{field}.{key}", "missing")
        if not ok(c[key]):
            raise Bad(f"{field}.{key}", f"expected {expected}, got {shown(c[key])}")
    return {key: c[key] for key in COMPONENTS}


def read_components(path):
    """(the report, {task: variance components}) of a report.json reproduce.py wrote, each difference's checked
    field by field (an InputError names --components, the file and the first field that is not as the report writes
    it): per task, the runs' differences of every comparison's pooled arms (or of its every arm, where none
    pooled), pooled again over the comparisons (compare.components). A report written before reports kept each
    run's differences gives each difference's own components, averaged (`averaged`)."""
    import numpy as np

    from machinery.compare import components as pooled_components
    rep = read_json(path, "a report.json of reproduce.py")
    groups, older, shapes = {}, {}, {}
    try:
        if not isinstance(rep, dict):
            raise Bad("(top level)", f"expected an object, got {shown(rep)}")
        for title, comparison in entries(rep, "finetune", optional=True):
            here = f"finetune[{title!r}]"
            for task, t in prefixed(here, lambda: entries(comparison, "tasks")):
                differences, own = {}, []
                for arm, row in prefixed(f"{here}.tasks[{task!r}]", lambda: entries(t, "arms")):
                    at = f"{here}.tasks[{task!r}].arms[{arm!r}]"
                    difference = row.get("difference") if isinstance(row, dict) else None
                    if not isinstance(row, dict) or not (difference is None or isinstance(difference, dict)):
                        raise Bad(at, f"expected an object whose difference is an object, got {shown(row)}")
                    if not difference:
                        continue  # the reference, or an arm with no difference
                    if difference.get("measured") is not None:  # each run's difference: pooled below
                        differences[arm] = measured(difference["measured"], f"{at}.difference.measured")
                        alike(differences[arm], shapes.setdefault(task, differences[arm]), f"{at}.difference.measured")
                    elif difference.get("components") is not None:  # a report before reports kept them
                        own.append(components(difference["components"], f"{at}.difference.components"))
                if not isinstance(t.get("pooled") or [], list):
                    raise Bad(f"{here}.tasks[{task!r}].pooled", f"expected a list of arms, got {shown(t['pooled'])}")
                pool = [arm for arm in t.get("pooled") or [] if arm in differences] or list(differences)
                if pool:
                    groups.setdefault(task, []).append([differences[arm] for arm in pool])
                elif own:
                    older.setdefault(task, []).extend(own)
    except Bad as e:
        raise InputError(f"--components={path}: {e.field}: {e.message}") from None
    found = {task: pooled_components([[{**m, "runs": np.array(m["runs"])} for m in g] for g in group])
             for task, group in groups.items()}
    found.update({task: averaged(cs) for task, cs in older.items() if task not in found})
    if not found:
        raise InputError(f"--components={path}: no variance components in it (a report written before reports kept "
                         f"them, or one without fine-tuning); name a report.json of this version")
    return rep, found


def measured(m, field):
    """A difference's runs and examples (compare.measured, as a report keeps them), checked."""
    runs = m.get("runs") if isinstance(m, dict) else None
    if not (isinstance(runs, list) and runs and all(isinstance(r, list) and len(r) == len(runs[0]) and r
                                                    and all(is_real(x) for x in r) for r in runs)):
        raise Bad(f"{field}.runs", f"expected a table of finite numbers (replicates x seeds), got {shown(runs)}")
    for key, ok in (("examples", is_count), ("example_var", is_real), ("example_run_var", is_real)):
        if not ok(m.get(key)):
            raise Bad(f"{field}.{key}", f"expected {'an integer >= 1' if key == 'examples' else 'a finite number'}, "
                                        f"got {shown(m.get(key))}")
    return m


def alike(m, first, field):
    """A task's differences are pooled as one table: each holds the first's replicates x seeds and test examples."""
    shape, want = (len(m["runs"]), len(m["runs"][0])), (len(first["runs"]), len(first["runs"][0]))
    if shape != want:
        raise Bad(f"{field}.runs", f"expected {want[0]} replicates x {want[1]} seeds, as the task's first difference, "
                                   f"got {shape[0]} x {shape[1]}")
    if m["examples"] != first["examples"]:
        raise Bad(f"{field}.examples", f"expected {first['examples']}, as the task's first difference, got "
                                       f"{m['examples']}")


def averaged(cs):
    """The components of a report written before reports kept each run's differences: each difference's own (its
    replicate, seed and example variances), averaged over the differences, on one difference's degrees of freedom
    (they share a reference: more would overstate them), the examples' part all counted as shared by the runs."""
    first, R, S = cs[0], cs[0]["replicates"], cs[0]["seeds"]

    def mean(key):
        return sum(c[key] or 0.0 for c in cs) / len(cs)

    inside = first["seeds_inside"]
    top = mean("seed_var") if R == 1 else mean("replicate_var") + (0.0 if inside else mean("seed_var") / S)
    return dict(replicates=R, seeds=S, examples=first["examples"], arms=1, top_var=top,
                top_df=R - 1 if R > 1 else S - 1, seed_var=None if inside else mean("seed_var"), seed_df=R * (S - 1),
                replicate_var=None if R == 1 else mean("replicate_var"), seeds_inside=inside,
                example_var=mean("example_var"), example_run_var=0.0, older=True)


def prefixed(where, get):
    """get()'s entries, a failure named from `where` on."""
    try:
        return list(get())
    except Bad as e:
        raise Bad(f"{where}.{e.field}", e.message) from None


# OUT/plan.json and OUT/stages/NAME.json: written by reproduce.py, read at every invocation. A stage of a plan holds
# its fingerprint, and its command and inputs (an older plan may lack them: only the fingerprint is compared).
PLAN_ENTRY = {"fingerprint": (str, True), "command": (str, False), "inputs": (dict, False)}
RECORD = {"fingerprint": (lambda v: isinstance(v, str), "a string"),
          "finished": (lambda v: type(v) is bool, "true or false"),
          "threads": (is_count, "an integer >= 1"),
          "outputs": (lambda v: isinstance(v, dict) and all(isinstance(k, str) and (d is None or isinstance(d, str))
                                                            for k, d in v.items()),
                      "an object of paths and digests (strings, or null)"),
          "seconds": (lambda v: is_real(v) and v >= 0, "a finite number >= 0"),
          "start": (is_real, "a finite number"), "end": (is_real, "a finite number")}


def check_plan(plan, path):
    """OUT/plan.json: an object with a string fingerprint and an object of stages, each as PLAN_ENTRY says (and the
    stages' threads, where they were fixed). Returns it."""
    def fail(field, message):
        raise InputError(f"{path}: {field}: {message}; not a plan of reproduce.py: choose a new --out")
    if not isinstance(plan, dict) or not isinstance(plan.get("stages"), dict):
        fail("stages", "expected an object")
    if not isinstance(plan.get("fingerprint"), str):
        fail("fingerprint", f"expected a string, got {shown(plan.get('fingerprint'))}")
    if "threads" in plan and not (isinstance(plan["threads"], dict) and all(map(is_count, plan["threads"].values()))):
        fail("threads", f"expected an object of stages' thread counts (integers >= 1), got {shown(plan['threads'])}")
    for name, entry in plan["stages"].items():
        if not isinstance(entry, dict):
            fail(f"stages[{name!r}]", f"expected an object, got {shown(entry)}")
        for key, (kind, required) in PLAN_ENTRY.items():
            if (required or key in entry) and not isinstance(entry.get(key), kind):
                what = "an object" if kind is dict else "a string"
                fail(f"stages[{name!r}].{key}", f"expected {what}, got {shown(entry.get(key))}")
    return plan


def check_record(record, path):
    """A stage record: an object whose fields (those there) are of RECORD's kinds, and a finished one with its
    seconds, start and end. Returns it."""
    if not isinstance(record, dict):
        raise InputError(f"{path}: expected an object, got {shown(record)}; delete it to run the stage again")
    needed = ("seconds", "start", "end") if record.get("finished") is True else ()
    for key, (ok, expected) in RECORD.items():
        if (key in record or key in needed) and not ok(record.get(key)):
            raise InputError(f"{path}: {key}: expected {expected}, got {shown(record.get(key))}; delete it to run "
                             f"the stage again")
    return record
