"""eval.py's command line: a sub-command per entry point, each flag with its meaning and its type checked. A
reader of the recipe may skip this file."""
import argparse
import ast
import inspect
import os
import sys
import types
from pathlib import Path

from machinery import compare
from machinery.cli import Parser, importing, pick_threads, positive_float, positive_int, run


def seed_list(text):
    """argparse type: distinct integers in [0, 2**32) separated by commas (numpy takes no negative
    seed; a seed given twice would count one run twice in the mean and std)."""
    try:
        seeds = [int(s) for s in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, e.g. 42,43,44; "
                                         f"got {text!r}") from None
    if not all(0 <= s < 2 ** 32 for s in seeds):
        raise argparse.ArgumentTypeError(f"expected seeds in [0, 2**32), got {text}")
    if len(set(seeds)) < len(seeds):
        raise argparse.ArgumentTypeError(f"{text} repeats a seed; give each seed once")
    return tuple(seeds)


def one_seed(text):
    """argparse type: one seed of seed_list."""
    seeds = seed_list(text)
    if len(seeds) != 1:
        raise argparse.ArgumentTypeError(f"expected one seed, got {text}")
    return seeds[0]


def name_list(text, count=None):
    """argparse type: distinct non-empty names separated by commas (`count` of them if given)."""
    names = text.split(",")
    if not all(names) or len(set(names)) < len(names) or count not in (None, len(names)):
        raise argparse.ArgumentTypeError(f"expected {count or 'some'} distinct non-empty names "
                                         f"separated by commas, got {text!r}")
    return names


def at_least_three(text):
    """argparse type: an integer of 3 or more (linear CKA of two texts is 1 whatever the models)."""
    if positive_int(text) < 3:
        raise argparse.ArgumentTypeError(f"expected at least 3 (CKA of 2 texts is 1 whatever the "
                                         f"models), got {text}")
    return int(text)


def max_len(text):
    """argparse type: a length with room for [CLS], [SEP] and some text."""
    if positive_int(text) < 4:
        raise argparse.ArgumentTypeError(f"expected at least 4 ([CLS], [SEP] and text), got {text}")
    return int(text)


def int_list(text, low, high, what):
    """argparse type: distinct integers in [low, high] separated by commas, in increasing order."""
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not all(low <= x <= high for x in values) or values != sorted(set(values)):
        raise argparse.ArgumentTypeError(f"expected distinct {what} from {low} to {high} in increasing order, "
                                         f"got {text}")
    return tuple(values)


def parser(ev, needle):
    """eval.py's command line over the module `ev` (eval.py): its functions are the sub-commands, with the needle's
    (machinery/needle.py, the module `needle`)."""
    p = Parser(prog="eval.py", description=ev.__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    device = Parser(add_help=False, argument_default=argparse.SUPPRESS)  # an unset flag: the function's default
    device.add_argument("--device", help="auto (a GPU if any), cpu, cuda, cuda:N")
    device.add_argument("--threads", type=positive_int, default=None,
                        help="CPU intra-op threads (none: $OMP_NUM_THREADS, else the idle cores)")
    model = Parser(add_help=False, parents=[device], argument_default=argparse.SUPPRESS)
    model.add_argument("--tokenizer", help="a tokenizer.json, a hub id or 'bytes' "
                       "(none: the model folder's tokenizer.json, else the one its run recorded)")
    model.add_argument("--max_len", type=max_len,
                       help="tokens per text, [CLS] and [SEP] included")

    commands = []

    def command(fn, parents, what):  # a sub-command's --help opens with its function's docstring
        commands.append((sub.add_parser(fn.__name__, parents=parents, help=what, argument_default=argparse.SUPPRESS,
                                        description=inspect.cleandoc(fn.__doc__)), fn))
        return commands[-1][0]

    cka_flags(command(ev.cka, [model], "per-layer linear CKA of two models against seed controls"))
    finetune_flags(command(ev.finetune, [model], "fine-tune on task folders, several seeds"), ev.NER_MODES)
    t = command(compare.table, [], "fine-tuned arms compared, with intervals, power, baselines and verdicts")
    t.add_argument("files", nargs="+", help="results files of `finetune`, one per arm, or an arm's "
                   "replicates separated by commas; the first arm is the reference")
    t.add_argument("--reference", help="the arm the others are compared with, by "
                   "name (its first file's name without .json)")
    m = command(ev.mlm, [device], "validation MLM and CLM loss on val.bin")
    m.add_argument("model", help="a model folder, run directory or hub id")
    m.add_argument("--data", required=True, help="a folder data.py prepared (meta.json, val.bin)")
    m.add_argument("--n_sequences", type=positive_int, help="validation windows read (default: as the run was validated, "
                   "its --eval_sequences; 64 for a model folder)")
    m.add_argument("--seq_len", type=positive_int, help="tokens per window (default: the run's; 512 for a model folder)")
    m.add_argument("--batch_size", type=positive_int, help="windows per forward pass")
    needle_flags(command(needle.needle, [device], "needle in a haystack: a value read far back, filled at [MASK]s"))
    k = command(ev.curves, [], "loss curves: one run across its phases, or several runs on shared axes")
    k.add_argument("runs", nargs="+", help="train.py run directories (each with a log.jsonl)")
    k.add_argument("--out", help="the PNG to write (none: one run's own loss.png; several runs need one)")
    k.add_argument("--names", type=name_list, help="a name per run of a comparison (none: folders)")
    for sp, fn in commands:
        signature_defaults(sp, fn)
    return p


def cka_flags(c):
    c.add_argument("model_a", help="the reference model (e.g. the MLM run), or its replicates "
                   "separated by commas (every two of them are a seed control)")
    c.add_argument("model_b", help="the model compared with it (e.g. the CLM run), or its "
                   "replicates separated by commas, in the order of model_a's")
    c.add_argument("--control", dest="controls", action="append",
                   help="another run of model_a's method with other seeds; repeat for more")
    c.add_argument("--names", type=lambda text: name_list(text, 2),
                   help="what to call model_a and model_b in the table and figure, e.g. MLM,CLM")
    c.add_argument("--texts", required=True, help="JSONL of held-out texts: {'text': ...} a line")
    c.add_argument("--n", type=at_least_three, help="texts drawn per sampling seed")
    c.add_argument("--seeds", type=seed_list,
                   help="sampling seeds: a draw of --n texts each")
    c.add_argument("--batch_size", type=positive_int, help="texts per forward pass")
    c.add_argument("--out", help="the JSON result; the figure goes beside it")


def needle_flags(n):
    n.add_argument("models", nargs="+", help="a model folder, run directory or hub id per arm, or an arm's "
                   "replicates separated by commas")
    n.add_argument("--texts", required=True, help="JSONL of held-out texts, {'text': ...} a line: the haystacks")
    n.add_argument("--lengths", type=lambda t: int_list(t, 16, 2 ** 20, "lengths"), 
                   help="tokens per sequence, [CLS] and [SEP] included (at most max_position_embeddings)")
    n.add_argument("--depths", type=lambda t: int_list(t, 0, 100, "percentages"),
                   help="how far back the needle sits, in percent of the haystack (0: right before the query)")
    n.add_argument("--n", type=positive_int, help="examples per length and depth")
    n.add_argument("--seed", type=one_seed, help="draws the values and the haystacks")
    n.add_argument("--names", type=name_list, help="a name per arm (none: the first folder's)")
    n.add_argument("--batch_tokens", type=positive_int,
                   help="tokens per forward pass: max(1, this // length) sequences")
    n.add_argument("--tokenizer", help="a tokenizer.json, a hub id or 'bytes' (none: the model's)")
    n.add_argument("--out", help="the JSON result; examples and heat map go beside it")


def finetune_flags(f, ner_modes):
    f.add_argument("model", help="a model folder, run directory or hub id")
    f.add_argument("--task", dest="tasks", action="append", required=True,
                   help="a task folder (train/dev/test .tsv or .jsonl); repeat for more")
    f.add_argument("--seeds", type=seed_list, help="fine-tuning seeds (classifier init and data order), one run each")
    f.add_argument("--out", help="results JSON; seed files in OUT.seeds/")
    f.add_argument("--epochs", type=positive_int, help="passes over train (none: 10; 20 for token tasks)")
    f.add_argument("--steps", type=positive_int, help="a budget in optimizer steps per task and seed instead of "
                   "epochs, at most --epochs passes over train when that is given too")
    f.add_argument("--evals", type=positive_int, help="dev scored at this many evenly spaced steps, the best one's "
                   "weights tested (none: after each epoch; 4 with --steps)")
    f.add_argument("--lr", type=positive_float, help="AdamW peak learning rate")
    f.add_argument("--train_subset", type=positive_int, help="train on this many examples (a fixed draw; none: all)")
    f.add_argument("--dev_subset", type=positive_int, help="score dev on this many examples (a fixed draw; none: all)")
    f.add_argument("--test_subset", type=positive_int, help="score test on this many examples (a fixed draw; none: "
                   "all, as a comparison should)")
    f.add_argument("--dev_min", type=non_negative_int, help="a dev set with fewer examples takes examples from train "
                   "(a fixed draw) until it has this many; 0: never")
    f.add_argument("--batch_size", type=positive_int, help="examples per step")
    f.add_argument("--pooling", choices=("cls", "mean"), help="sequence tasks: the [CLS] vector or the mean over "
                   "tokens")
    f.add_argument("--ner_mode", choices=ner_modes, help="token tasks: entities as seqeval reads them by default (an "
                   "I- that continues nothing starts an entity) or in its strict IOB2 mode (it is dropped)")


def non_negative_int(text):
    """argparse type: an integer of 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer of 0 or more, got {text!r}")
    return value


def signature_defaults(sub, fn):
    """A flag left out takes the function's own default (argument_default=SUPPRESS: one place to change it); its
    help says what that default is."""
    defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()
                if p.default not in (inspect.Parameter.empty, None, False, (), [])}
    for action in sub._actions:
        if action.dest in defaults and action.help and "(default" not in action.help:
            action.help += f" (default: {format_default(defaults[action.dest])})"


def format_default(value):
    return ",".join(map(str, value)) if isinstance(value, (tuple, list)) else str(value)


# What the lesson hands the machinery's commands, by parameter name: the model class (the needle) and the
# task kinds (the comparison of fine-tuned arms).
HANDED = {"model_class": lambda ev: ev.ModernBERT, "kind_of": lambda ev: ev.kind_of}


def check_command_line(path):
    """eval.py's flags (`path`: its file) checked before it imports torch (seconds on an idle machine, more on a busy
    one): a mistyped one is answered at once, in one line (exit status 2). The parser is built over a sketch of
    eval.py and machinery/needle.py, made from their source without running their imports; main parses the flags
    again over the modules themselves, and prints --help."""
    argv = sys.argv[1:]
    if argv and not {"-h", "--help"} & set(argv):
        run(lambda _: parser(sketch(path), sketch(Path(__file__).with_name("needle.py"))).parse_args(argv))
    importing()  # Ctrl-C during the imports: one line


def sketch(path):
    """A stand-in for the module at `path`: its docstring, its functions with their signatures and docstrings
    (bodies and annotations left out), and its constants (a dict whose keys are literals: those keys)."""
    tree = ast.parse(Path(path).read_text(encoding="utf-8"))
    body = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            doc = ast.get_docstring(node, clean=False)
            node.body, node.decorator_list, node.returns = [ast.Expr(ast.Constant(doc))], [], None
            for arg in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]:
                arg.annotation = None
            node.args.defaults = [literal(d) for d in node.args.defaults]  # a sub-command's are literals (tested)
            node.args.kw_defaults = [d and literal(d) for d in node.args.kw_defaults]
            body.append(node)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = node.value
            if isinstance(value, ast.Dict) and all(isinstance(k, ast.Constant) for k in value.keys):
                value = ast.Dict(keys=value.keys, values=[ast.Constant(None)] * len(value.keys))
            try:
                ast.literal_eval(value)
            except ValueError:
                continue
            body.append(ast.copy_location(ast.Assign(targets=node.targets, value=value), node))
    names = {}
    exec(compile(ast.fix_missing_locations(ast.Module(body=body, type_ignores=[])), str(path), "exec"), names)
    return types.SimpleNamespace(__doc__=ast.get_docstring(tree), **{k: v for k, v in names.items()
                                                                     if not k.startswith("__")})


def literal(node):
    """An expression of a sketch: itself where it is a literal, else None (what it names is not there)."""
    try:
        ast.literal_eval(node)
        return node
    except ValueError:
        return ast.copy_location(ast.Constant(None), node)


def main(ev, argv=None):
    """Run the sub-command of eval.py (the module `ev`) that argv names."""
    import torch

    from machinery import needle
    args = vars(parser(ev, needle).parse_args(argv))
    name = args.pop("command")
    command = {"table": compare.table, "needle": needle.needle}.get(name) or getattr(ev, name)
    args.update({k: give(ev) for k, give in HANDED.items() if k in inspect.signature(command).parameters})
    if "threads" in args:
        torch.set_num_threads(pick_threads(args.pop("threads")))
        print(f"threads: {torch.get_num_threads()} intra-op (--threads to change)")
    result = command(**args)
    params = inspect.signature(command).parameters
    out = args.get("out", params["out"].default if "out" in params else None)
    # a file it chose itself (curves: a run's loss.png); a command without --out (table) returns its text
    out = out or (result if isinstance(result, str) and "out" in params else None)
    if result is not None and out:  # a command that wrote a file says so (None: it wrote nothing, no matplotlib)
        print(wrote(out))
    return result


# How to look at what a command wrote, by the file's extension.
LOOK = {".png": "a picture: open it in any image viewer",
        ".json": "every number, the table's and more: python -m json.tool {}"}


def wrote(path):
    """What a command wrote and how to look at it."""
    how = LOOK.get(os.path.splitext(str(path))[1], "")
    return f"wrote {path}" + (f" ({how.format(path)})" if how else "")
