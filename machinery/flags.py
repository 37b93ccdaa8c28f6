"""train.py's flags: --key=value parsed into its Config dataclass, --help written from the dataclass's own
comments, and the range of every value. A reader of the recipe may skip this file."""
import ast
import contextlib
import dataclasses
import datetime
import decimal
import inspect
import math
import os
import re
import sys

from machinery.cli import MAX_THREADS, InputError, did_you_mean, importing, run
from machinery.cli import out_of_memory as allocation_failed
from machinery.hf import checkpoint_problem, hub_id_problem

LR_BOUND = 1e-2  # above any published encoder recipe (ModernBERT: 8e-4 to 2e-3): a typo, not an intent
SUFFIXES = {"k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}  # --tokens=10B
# never taken from a saved configuration
PER_INVOCATION = ("resume", "max_steps", "device", "ddp_timeout", "deterministic")
# What --resume may change besides: nothing that alters the numbers (threads: a smaller machine needs fewer).
RESUMABLE = (*PER_INVOCATION, "out_dir", "eval_interval", "save_interval", "keep", "log_interval", "threads",
             "log_to", "license", "language", "base_model", "hub_id")
# Other names a flag answers to: Hugging Face's Trainer calls --log_to report_to.
ALIASES = {"report_to": "log_to"}
# The budget, which --resume may change where every step already run keeps its learning rate (check_new_budget).
BUDGET = ("tokens", "schedule_tokens")
# What a checkpoint cannot be continued without: its counters, data position and place in its schedule are counted
# in these. Any other setting a checkpoint lacks (one added to train.py's Config after it was written) takes its
# default, and the start says so (absent_settings): a setting added there needs a default that does what the code
# did before it existed.
REQUIRED = ("phase", "tokens", "seq_len", "batch_size", "seed", "data_seed", "schedule", "schedule_tokens")
# Documents are [CLS] text [SEP] with at least one text token, so a window holds at most two special tokens in a
# row: [SEP] [CLS], which no objective labels (MLM never masks a special token; in CLM [SEP] predicts nothing,
# and neither does a window's last token). Three tokens always hold one that MLM may mask and CLM predicts.
MIN_SEQ_LEN = 3
MAX_DDP_TIMEOUT = 10**6  # seconds (11 days); the rendezvous's millisecond clock overflows not far above


def field_types(config_cls):
    return {f.name: f.type.__name__ for f in dataclasses.fields(config_cls)}  # "int", "float", "bool", "str"


def source_field_types(path, name):
    """field_types of the dataclass `name` that the file at `path` defines, read from its source without running
    it (nor importing what it imports)."""
    with open(path, encoding="utf-8") as f:
        body = next(n.body for n in ast.parse(f.read()).body if isinstance(n, ast.ClassDef) and n.name == name)
    return {n.target.id: n.annotation.id for n in body if isinstance(n, ast.AnnAssign)}


def check_command_line(script, config="Config"):
    """The flags of `script`'s command line checked before it imports torch (seconds on an idle machine, a minute on
    a busy one), against the names and types of its `config` dataclass read from its source: a mistyped flag is
    answered at once, in one line (exit status 2). The script parses them again once it runs."""
    run(lambda _: parse_types(sys.argv[1:], source_field_types(script, config)))
    importing()  # Ctrl-C during the imports: one line


def checkpoint_fields(config_cls):
    """The settings a checkpoint's config holds, with their types. All but REQUIRED are marked "?": a checkpoint
    written before such a setting existed lacks it, and takes its default (absent_settings)."""
    return {name: kind + "?" * (name not in REQUIRED) for name, kind in field_types(config_cls).items()}


def absent_settings(state, config_cls, how):
    """The settings of config_cls that a checkpoint's config lacks (it was written before they existed), put into
    it at their defaults, so that what continues from it reads them as any other; and those it holds that
    config_cls no longer has (a field removed since), taken out of it: ({name: default}, {name: saved value}). A
    resume continues the run as it was saved, which this code cannot: refused, with the way on. A hand-off or a
    start from the weights goes on without them, as with any setting it does not inherit."""
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    removed = {name: value for name, value in state["config"].items() if name not in defaults}
    if removed and how == "resume":
        name, value = next(iter(removed.items()))
        raise InputError(f"{state['dir']}/state.json: the run was saved with {name}={value!r}, a setting train.py's "
                         f"Config no longer has (removed since), so --resume cannot continue it as it was; put the "
                         f"field back to resume it, or start a new run from it with --init_from (a hand-off, or "
                         f"--weights_only), which goes on without it")
    absent = {name: value for name, value in defaults.items() if name not in state["config"]}
    state["config"] = {name: value for name, value in state["config"].items() if name in defaults} | absent
    return absent, removed


def parse_value(key, text, kind):
    """One flag's text as its field's type. Integers are exact (10_000, 10e9, 10B; never rounded through a
    float, which would turn --seed=9007199254740993 into another seed)."""
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return text.lower() in ("true", "1", "yes")
        if kind == "int":
            scale = SUFFIXES.get(text[-1:].lower(), 1)
            number = decimal.Decimal((text[:-1] if scale > 1 else text).replace("_", "")) * scale
            if not number.is_finite() or number != number.to_integral_value() or abs(number) >= 2**63:
                raise ValueError
            return int(number)
        if kind == "float":
            return float(text)
        return text
    except (ValueError, ArithmeticError):
        what = "int (an integer of magnitude below 2**63)" if kind == "int" else kind
        raise InputError(f"--{key}={text!r} is not a valid {what}") from None


def parse(argv, config_cls):
    """--key=value or --key value (a bare --flag sets a bool) into the fields of a dataclass. Unknown keys and
    repeated keys are errors. Returns (flags, wants_help)."""
    return parse_types(argv, field_types(config_cls))


def parse_types(argv, types):
    """parse, against {field: type name}."""
    flags, named, wants_help, i = {}, {}, False, 0  # named: the name each flag was given by
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            wants_help, i = True, i + 1
            continue
        if not arg.startswith("--"):
            raise InputError(f"unexpected argument {arg!r}; flags look like --key=value (see --help)")
        given, eq, value = arg[2:].partition("=")
        key = ALIASES.get(given, given)
        if key not in types:
            raise InputError(f"unknown flag --{key}{did_you_mean(key, [*types, *ALIASES])} (python train.py --help "
                             f"lists them all)")
        if key in flags:
            both = (f"--{named[key]} and --{given} name one setting" if named[key] != given else
                    f"--{key} is given twice")
            raise InputError(f"{both}; give each flag once")
        named[key] = given
        if not eq:
            if types[key] == "bool" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
                value = "true"
            elif i + 1 < len(argv):
                i, value = i + 1, argv[i + 1]
            else:
                raise InputError(f"--{key} needs a value")
        flags[key] = parse_value(key, value, types[key])
        i += 1
    return flags, wants_help


def help_text(config_cls, cfg, usage):
    """Every flag with its value in `cfg` (the chosen recipe and phase) and the comment beside it in the
    dataclass, grouped under the dataclass's own `# ...` heading lines."""
    lines = [usage.strip(), "", f"flags (defaults for --recipe={cfg.recipe} --phase={cfg.phase}; pass those "
                                f"first to see another recipe's):"]
    for line in inspect.getsource(config_cls).splitlines()[1:]:
        if m := re.match(r"\s+# (.*)", line):
            lines += ["", m.group(1) + ":"]
        elif m := re.match(r"\s+(\w+): \w+ = .*?(?:#\s*(.*))?$", line):
            flag = f"--{m.group(1)}={getattr(cfg, m.group(1))}"
            also = "".join(f" (also --{alias})" for alias, name in ALIASES.items() if name == m.group(1))
            lines.append(f"  {flag:<27} {m.group(2) or ''}{also}".rstrip())
    return "\n".join(lines)


def check_names(values, allowed):
    """Each value among the names the lesson's tables define for its flag (recipes, phases, schedules...)."""
    for key, names in allowed.items():
        if values[key] not in names:
            raise InputError(f"--{key}={values[key]!r}; expected one of {', '.join(names)}")


def resumed_settings(given, saved):
    """A resumed run's settings: the saved ones, with the flags given now where they do not change the
    numbers (RESUMABLE); any other difference is an error."""
    changed = [k for k, v in given.items() if k not in RESUMABLE + BUDGET and saved.get(k) != v]
    if changed:
        raise InputError(f"--resume continues the run as it was saved; --{changed[0]}={given[changed[0]]} "
                         f"differs from its {saved.get(changed[0])!r}. Start a new run with --init_from")
    return {**{k: v for k, v in saved.items() if k not in PER_INVOCATION}, **given}


def check(cfg, allowed, world):
    """Every value's range, before any data is read or any weight is loaded. `allowed` maps a field to the
    names the lesson's tables define for it (phases, schedules, objectives, backends)."""
    check_names({key: getattr(cfg, key) for key in allowed}, allowed)
    finite = math.isfinite
    unset = " and ".join(flag for flag, value in (("--data", cfg.data), ("--tokens", cfg.tokens)) if not value)
    rules = [
        (not allowed["objective"][cfg.objective].masked or 0 < cfg.mask_rate < 1,
         f"--mask_rate={cfg.mask_rate}: expected 0 < rate < 1"),
        (cfg.init_from == "scratch" or os.path.exists(cfg.init_from) or not unset,  # most often a path mistyped
         f"--init_from={cfg.init_from}: no such folder here, so no run of ours to take {unset} from (from a "
         f"Hugging Face id, pass {unset})"),
        (cfg.data != "", "--data is required: a directory written by `python data.py prepare`"),
        (cfg.tokens != 0 or cfg.init_from != "scratch",
         f"--phase={cfg.phase} needs --init_from (the run it continues) or --tokens: 0 means 10% of that run's"),
        (cfg.tokens > 0, f"--tokens={cfg.tokens}: expected a positive token budget (0: 10% of a run of ours "
                         f"given by --init_from)"),
        (cfg.schedule_tokens == 0 or cfg.schedule_tokens >= cfg.tokens,
         f"--schedule_tokens={cfg.schedule_tokens}: the schedule's budget must cover this phase's "
         f"--tokens={cfg.tokens} (0: the same)"),
        (cfg.seq_len >= MIN_SEQ_LEN, f"--seq_len={cfg.seq_len}: expected at least {MIN_SEQ_LEN}; a shorter window "
                                     f"may hold no token to predict ([SEP] [CLS] at a document boundary)"),
        (cfg.batch_size > 0 and cfg.micro_batch_size >= 0,
         f"--batch_size={cfg.batch_size} must be positive and --micro_batch_size={cfg.micro_batch_size} >= 0"),
        (finite(cfg.lr) and cfg.lr > 0, f"--lr={cfg.lr}: expected a positive finite learning rate"),
        (cfg.lr < 1e37, f"--lr={cfg.lr}: Adam's update would overflow float32"),
        (cfg.lr <= LR_BOUND or cfg.allow_high_lr,
         f"--lr={cfg.lr} is above {LR_BOUND} (published encoder recipes stay below 2e-3); pass "
         f"--allow_high_lr if you mean it"),
        (0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1,
         f"--beta1={cfg.beta1}, --beta2={cfg.beta2}: expected 0 <= beta < 1"),
        (finite(cfg.eps) and cfg.eps > 0, f"--eps={cfg.eps}: expected a positive finite number"),
        (finite(cfg.weight_decay) and 0 <= cfg.weight_decay < 1,
         f"--weight_decay={cfg.weight_decay}: expected 0 <= wd < 1"),
        (cfg.warmup_tokens >= 0, f"--warmup_tokens={cfg.warmup_tokens}: expected >= 0"),
        (0 <= cfg.final_lr_frac <= 1, f"--final_lr_frac={cfg.final_lr_frac}: expected a fraction in [0, 1]"),
        (0 < cfg.decay_frac <= 1 and cfg.decay_tokens >= 0,
         f"--decay_frac={cfg.decay_frac} must be in (0, 1] and --decay_tokens={cfg.decay_tokens} >= 0"),
        (cfg.decay_tokens <= (cfg.schedule_tokens or cfg.tokens),  # longer, wsd would start below its peak
         f"--decay_tokens={cfg.decay_tokens}: longer than the schedule's budget of {cfg.schedule_tokens or cfg.tokens:,} "
         f"tokens (--schedule_tokens, else --tokens); a decay lies within its schedule"),
        (finite(cfg.grad_clip) and cfg.grad_clip >= 0, f"--grad_clip={cfg.grad_clip}: expected >= 0 (0 disables)"),
        (0 <= cfg.dropout < 1, f"--dropout={cfg.dropout}: expected a probability in [0, 1)"),
        (0 <= cfg.seed < 2**63 and 0 <= cfg.data_seed < 2**63,
         f"--seed={cfg.seed}, --data_seed={cfg.data_seed}: expected 0 <= seed < 2**63"),
        (cfg.eval_interval > 0 and cfg.log_interval > 0 and cfg.eval_sequences > 0,
         "--eval_interval, --log_interval and --eval_sequences must be positive"),
        (cfg.save_interval >= 0 and cfg.max_steps >= 0, "--save_interval and --max_steps must be >= 0 (0: at the end)"),
        (cfg.keep >= 1, f"--keep={cfg.keep}: keep at least the newest checkpoint"),
        (0 <= cfg.threads <= MAX_THREADS, f"--threads={cfg.threads}: expected 0 (automatic) to {MAX_THREADS}"),
        (cfg.dtype in ("bfloat16", "float32"), f"--dtype={cfg.dtype!r}: expected bfloat16 or float32"),
        (re.fullmatch(r"([a-z0-9][a-z0-9.\-]*)?", cfg.license),
         f"--license={cfg.license!r}: expected a Hugging Face license id such as apache-2.0, mit or cc-by-4.0"),
        (re.fullmatch(r"([a-z]{2,3}(-[A-Za-z0-9]+)*(,[a-z]{2,3}(-[A-Za-z0-9]+)*)*)?", cfg.language),
         f"--language={cfg.language!r}: expected language codes such as en or en,de"),
        (not cfg.base_model or not hub_id_problem(cfg.base_model, namespace=False),
         f"--base_model={cfg.base_model!r}: expected a Hugging Face hub id such as answerdotai/ModernBERT-base "
         f"({hub_id_problem(cfg.base_model, namespace=False)})"),
        (not cfg.hub_id or not hub_id_problem(cfg.hub_id),
         f"--hub_id={cfg.hub_id!r}: expected the hub repository to publish to, USER/NAME "
         f"({hub_id_problem(cfg.hub_id)})"),
    ]
    for ok, message in rules:
        if not ok:
            raise InputError(message)
    micro = cfg.micro_batch_size or cfg.batch_size // world
    if micro == 0 or cfg.batch_size % (micro * world):
        if not cfg.micro_batch_size:
            counts = ", ".join(str(n) for n in range(1, cfg.batch_size + 1) if cfg.batch_size % n == 0)
            raise InputError(f"--batch_size={cfg.batch_size} does not split evenly over {world} processes; run on "
                             f"{counts} processes, or pass a --batch_size divisible by {world}")
        raise InputError(f"--batch_size={cfg.batch_size} cannot be split into micro-batches of {micro} on {world} "
                         f"process(es); change --micro_batch_size so that batch_size = micro_batch_size x "
                         f"processes x k")
    if allowed["objective"][cfg.objective].masked and cfg.mask_rate * micro * cfg.seq_len < 1:  # no label: adds 0
        raise InputError(f"--mask_rate={cfg.mask_rate} masks {cfg.mask_rate * micro * cfg.seq_len:.2g} tokens of a "
                         f"micro-batch of {micro} x {cfg.seq_len} on average: most would have nothing to predict; "
                         f"raise --mask_rate, --micro_batch_size or --seq_len")
    if cfg.tokens < cfg.batch_size * cfg.seq_len:
        raise InputError(f"--tokens={cfg.tokens:,} is less than one optimizer step ({cfg.batch_size} x {cfg.seq_len} "
                         f"= {cfg.batch_size * cfg.seq_len:,} tokens); raise --tokens or lower --batch_size")


def ddp_timeout(seconds):
    """--ddp_timeout as the process group takes it, checked before the group is made."""
    if not 0 < seconds <= MAX_DDP_TIMEOUT:
        raise InputError(f"--ddp_timeout={seconds}: expected 1 to {MAX_DDP_TIMEOUT:,} seconds")
    return datetime.timedelta(seconds=seconds)


def check_schedule_fits(cfg, done):
    """A phase that continues its parent's schedule must end within that schedule's budget."""
    if done + cfg.tokens > cfg.schedule_tokens:
        raise InputError(f"--tokens={cfg.tokens:,} after the {done:,} its parent ran exceeds "
                         f"--schedule_tokens={cfg.schedule_tokens:,}")


def first_changed_rate(old, new, done, per_step, learning_rate):
    """The first token, of the `done` tokens of a schedule run in steps of `per_step`, at which `new`'s learning
    rate differs from `old`'s; None where every step keeps its rate (constant; wsd before its decay)."""
    return next((t for t in range(done % per_step, done, per_step)
                 if learning_rate(old, t) != learning_rate(new, t)), None)


def check_new_budget(old, new, state, learning_rate):
    """--resume with another --tokens or --schedule_tokens: the run goes on as if it had been given that budget
    from the start, so the steps it ran must keep their learning rates."""
    if all(getattr(new, k) == getattr(old, k) for k in BUDGET):
        return
    start = state["schedule_tokens_done"] - state["phase_tokens"]  # a hand-off's parent's tokens of the schedule
    if start:  # it continues its parent's schedule, and must still end within it (as at the hand-off)
        check_schedule_fits(new, start)
    per_step = new.batch_size * new.seq_len
    if new.tokens // per_step < state["phase_step"]:
        raise InputError(f"--tokens={new.tokens:,}: the run has trained {state['phase_tokens']:,} tokens "
                         f"({state['phase_step']} steps) already; a budget continues it from there")
    t = first_changed_rate(old, new, state["schedule_tokens_done"], per_step, learning_rate)
    if t is not None:
        budget = f"--tokens={new.tokens:,}" + (f" --schedule_tokens={new.schedule_tokens:,}"
                                               if new.schedule_tokens != old.schedule_tokens else "")
        raise InputError(f"{budget}: over that budget its {new.schedule} schedule would give the step at token {t:,} "
                         f"the learning rate {learning_rate(new, t):.4g}, and it ran at {learning_rate(old, t):.4g}. "
                         f"Only a schedule whose steps so far keep their rates grows (constant; wsd before its "
                         f"decay); go on with a phase hand-off instead (--init_from={new.out_dir})")


def check_finite(loss, grad_norm, step, cfg):
    """A step's loss and gradient norm, before the update: one non-finite value would poison every weight."""
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        raise InputError(f"non-finite loss {loss} or gradient norm {grad_norm} at step {step} (phase {cfg.phase}); "
                         f"stopped before the update. The last checkpoint in {cfg.out_dir} is kept; lower --lr or "
                         f"check the data")


@contextlib.contextmanager
def out_of_memory_explained(r):
    """An allocation that fails inside the block (cli.py's out_of_memory says which) is raised again as the
    InputError of out_of_memory below: the sizes the step tried and what to lower."""
    try:
        yield
    except Exception as e:
        if not allocation_failed(e):
            raise
        raise out_of_memory(e, r) from None


def out_of_memory(e, r):
    """The InputError for a step that did not fit in memory (`r`: train.py's Run): the sizes it tried, the
    settings to lower. Every rank says it: the others may have had room."""
    cfg, model = r.cfg, r.model.config
    asked = re.search(r"allocate ([\d.]+ \w?i?B|\d+ bytes)", str(e))  # CUDA's "2.00 GiB", the CPU's "N bytes"
    asked = asked and (f"{int(asked[1].split()[0]) / 2**30:.1f} GiB" if "bytes" in asked[1] else asked[1])
    lower = "--micro_batch_size (more accumulation steps keep --batch_size), --seq_len" + \
        (" or --preset" if r.how == "fresh" else "")
    change = f"lower {lower}" if r.how != "resume" else \
        f"a resumed run keeps its settings: resume where more memory is, or start again with a lower {lower}"
    if cfg.loss == "plain" and r.how != "resume":  # the (rows, vocab) logits in fp32 are often the largest tensor
        change += ", or pass --loss=fused (the loss in row chunks, never all the logits at once)"
    return InputError(f"{f'rank {r.rank}: ' if r.world > 1 else ''}out of memory on {r.device} in step "
                      f"{r.phase_step + 1}{f' (asked for {asked} more)' if asked else ''}: micro-batches of "
                      f"{cfg.batch_size // r.accum // r.world} x {cfg.seq_len} tokens through "
                      f"{model.num_hidden_layers} blocks {model.hidden_size} wide (--preset={cfg.preset or 'none'}); "
                      f"{change}. The checkpoints in {cfg.out_dir} are as they were", every_rank=True)


def check_state(state, cfg):
    """A checkpoint's counters against the configuration that wrote them (types were checked on reading):
    a state.json edited by hand must not make a run stop early, train past its budget or hand off a
    budget it never ran."""
    where = os.path.join(state["dir"], "state.json")
    per_step = cfg.batch_size * cfg.seq_len
    steps = max(1, cfg.tokens // per_step)
    rules = [
        (state["phase_step"] <= steps, f"phase_step {state['phase_step']} is beyond the budget's {steps} steps"),
        (state["phase_tokens"] == state["phase_step"] * per_step,
         f"phase_tokens {state['phase_tokens']} != phase_step {state['phase_step']} x {per_step} tokens per step"),
        (state["adam_t"] >= state["phase_step"], f"adam_t {state['adam_t']} is below phase_step {state['phase_step']}"),
        (state["schedule_tokens_done"] >= state["phase_tokens"],
         f"schedule_tokens_done {state['schedule_tokens_done']} is below phase_tokens {state['phase_tokens']}"),
        (state["phase"] == cfg.phase, f"phase {state['phase']!r} differs from its config's {cfg.phase!r}"),
    ]
    for ok, message in rules:
        if not ok:
            raise InputError(f"{where}: {message}")


def check_data_fits_model(meta, config, cfg, ours=None):
    """Data prepared with another tokenizer would train garbage: compare ids before any compute, and, for a run of
    ours (`ours`: its checkpoint folder, whose tokenizer.json is the one its data was prepared with), the
    tokenizers themselves: two learned ones of one size have the same special ids and mean other things by the rest."""
    ids = {"cls": config.cls_token_id, "sep": config.sep_token_id, "pad": config.pad_token_id,
           "mask": config.mask_token_id}
    wrong = [f"{k}: data {meta[k + '_id']} vs model {v}" for k, v in ids.items() if meta[k + "_id"] != v]
    if meta["vocab_size"] > config.vocab_size or wrong:
        raise InputError(f"{os.path.join(cfg.data, 'meta.json')} does not match the model of --init_from="
                         f"{cfg.init_from}: vocabulary {meta['vocab_size']} vs {config.vocab_size}"
                         + (f"; special ids {', '.join(wrong)}" if wrong else "")
                         + ". Prepare the data with the model's tokenizer.")
    if ours is not None:
        from machinery.tokenizer import load_tokenizer
        trained = load_tokenizer(os.path.join(ours, "tokenizer.json"))
        if trained.fingerprint != meta["tokenizer_fingerprint"]:
            raise InputError(f"{os.path.join(cfg.data, 'meta.json')}: the data was prepared with tokenizer "
                             f"{meta['tokenizer']} (fingerprint {meta['tokenizer_fingerprint'][:12]}), but the model of "
                             f"--init_from={cfg.init_from} was trained with another ({os.path.join(ours, 'tokenizer.json')}"
                             f", fingerprint {trained.fingerprint[:12]}). Prepare the data with the model's tokenizer.")
    if cfg.seq_len > config.max_position_embeddings:
        raise InputError(f"--seq_len={cfg.seq_len} is longer than the model's max_position_embeddings "
                         f"({config.max_position_embeddings})")


def check_handoff(cfg, parent):
    """A phase hand-off continues its parent's data position, which names windows of its seq_len in the order of
    its data_seed, masked by its seed: those stay the parent's (`parent`: its saved configuration)."""
    for key in ("seq_len", "data_seed", "seed"):
        if getattr(cfg, key) != parent[key]:
            raise InputError(f"--{key}={getattr(cfg, key)}: a phase hand-off continues the data position of "
                             f"--init_from={cfg.init_from}, which holds for its {key}={parent[key]} only; leave "
                             f"--{key} out, or take its weights alone with --weights_only")


# Architecture beyond a preset's sizes: a model that changes one of them (a ReGLU MLP, another window) is no preset's
SHAPE = ("hidden_activation", "global_attn_every_n_layers", "local_attention", "global_rope_theta",
         "local_rope_theta", "norm_eps")


def preset_of(config, presets):
    """The name of the row of `presets` whose architecture a checkpoint's config has (its sizes, and SHAPE's fields
    at their defaults), or "" (none has it)."""
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    same_shape = all(getattr(config, key) == defaults[key] for key in SHAPE if key in defaults)
    return next((name for name, dims in presets.items()
                 if same_shape and all(getattr(config, key) == value for key, value in dims.items())), "")


def unlike_fresh(config, fresh, presets):
    """Where a checkpoint's architecture (`config`) differs from the one this code gives a fresh model of its sizes
    (`fresh(preset)`: train.py's fresh_config, for the preset of those sizes): {field: (the checkpoint's value, a
    fresh model's)} over SHAPE and the layer types; {} where no preset has its sizes. A continued run keeps the
    checkpoint's."""
    sized = next((name for name, dims in presets.items() if all(
        getattr(config, key) == value for key, value in dims.items() if key not in SHAPE)), None)
    new = fresh(sized) if sized else config
    return {key: (getattr(config, key), getattr(new, key)) for key in (*SHAPE, "layer_types")
            if getattr(config, key) != getattr(new, key)}


def check_preset(preset, config, init_from, presets):
    """A --preset given with --init_from: weights keep their shape, so only the checkpoint's own preset is allowed."""
    if preset != preset_of(config, presets):
        raise InputError(f"--preset={preset}: the model of --init_from={init_from} is "
                         f"{preset_of(config, presets) or 'no preset'} ({config.num_hidden_layers} blocks "
                         f"{config.hidden_size} wide) and keeps that architecture, as its weights do; --preset picks "
                         f"a fresh model's (--init_from=scratch): leave it out")


def check_val_split(cfg, val_windows):
    if val_windows < cfg.eval_sequences:
        raise InputError(f"{cfg.data}/val.bin holds {val_windows} windows of {cfg.seq_len} tokens, fewer than "
                         f"--eval_sequences={cfg.eval_sequences}; lower it, or prepare with a larger --val_fraction")


def check_weights_only(given, how):
    if given.get("weights_only") and how == "fresh":
        raise InputError("--weights_only takes the weights of --init_from=<a run of ours>; a fresh model has none "
                         "to take")


def check_all(cfg, how, state, config_cls, allowed, world, given=()):
    """Every check of a resolved configuration before anything is built: where it starts (check_start), each
    value (check), the schedule's flags (a flag it does not read is refused), the trackers (known and installed)."""
    from machinery import tracking
    check_start(cfg, how, state, config_cls)
    check(cfg, allowed, world)
    if how != "resume":  # a resumed run's flags were checked when it started
        check_schedule_flags(cfg, given, allowed["schedule"])
    tracking.names(cfg.log_to)


class Reads:
    """A configuration that records the names of the fields read from it."""

    def __init__(self, cfg):
        self.cfg, self.names = cfg, set()

    def __getattr__(self, name):
        self.names.add(name)
        return getattr(self.cfg, name)


def schedule_reads(shape, cfg):
    """The configuration fields a schedule's shape (train.py's SCHEDULES) reads with `cfg`: found by calling it, at
    the first, middle and last token of the schedule's budget, so that a field read on one branch only (a decay's)
    is found, and an edited or added shape is read as it is written."""
    reads, end = Reads(cfg), cfg.schedule_tokens or cfg.tokens
    for t in (0, end // 2, end):
        shape(t, end, reads)
    return reads.names


def check_schedule_flags(cfg, given, schedules):
    """A schedule's flag given on the command line (a field that some shape of `schedules` reads, with these
    settings or the defaults) that this run's schedule does not read is an InputError: it would change nothing."""
    read = schedule_reads(schedules[cfg.schedule], cfg)
    readers = {name: schedule_reads(shape, cfg) | schedule_reads(shape, type(cfg)())
               for name, shape in schedules.items()}
    budget = ("tokens", "schedule_tokens")  # read by every run, whatever its schedule
    unread = [k for k in given if k not in budget and k not in read and any(k in r for r in readers.values())]
    if unread:
        k = unread[0]
        others = [name for name, r in readers.items() if k in r and name != cfg.schedule]
        why = "with these settings" if k in readers[cfg.schedule] else \
            f"({', '.join(others[:-1]) + ' and ' if others[:-1] else ''}{others[-1]} " \
            f"{'does' if len(others) == 1 else 'do'}: --schedule=NAME)"
        raise InputError(f"--{k}={given[k]} changes nothing: the {cfg.schedule} schedule does not read it {why}; "
                         f"leave it out")


def check_start(cfg, how, state, config_cls):
    """Where the run starts against what it asks for: the chain of phases, the counters of the checkpoint
    it starts from, the device and the attention backend. `how`: fresh | weights | handoff | resume."""
    if cfg.recipe == "demo" and how == "weights" and not os.path.isfile(os.path.join(cfg.init_from, "run.json")):
        if not os.path.exists(cfg.init_from):  # most often a run's path mistyped: not a call for another recipe
            raise InputError(f"--init_from={cfg.init_from}: no such folder, so no run of train.py to continue")
        raise InputError(f"--recipe=demo trains a tiny model; --init_from={cfg.init_from} (a pretrained "
                         f"checkpoint) needs --recipe=paper or another recipe")
    if how == "weights" and state is None and checkpoint_problem(cfg.init_from):  # before any network or data
        raise InputError(f"--init_from={cfg.init_from}: {checkpoint_problem(cfg.init_from)}")
    if cfg.phase == "decay" and how == "fresh":
        raise InputError("--phase=decay needs --init_from: the run (or checkpoint) to decay from")
    if how == "handoff" and state["phase"] == "decay" and cfg.phase == "decay":
        raise InputError(f"--init_from={cfg.init_from} is a decay already; a decay continues an mlm or clm run")
    if state is not None:
        saved = {k: v for k, v in state["config"].items() if k in field_types(config_cls)}
        check_state(state, cfg if how == "resume" else config_cls(**saved))
    from machinery.cli import autocast, pick_device
    from machinery.kernels import pick_backend
    device = pick_device(cfg.device)
    try:
        with autocast(device, cfg.dtype):  # the dtype the steps will compute in: flash-attn refuses float32
            pick_backend(device, cfg.backend, training=True)
    except ValueError as e:
        raise InputError(f"--backend={cfg.backend}: {e}") from None
