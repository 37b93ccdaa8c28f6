"""What eval.py evaluates, found and checked: a model folder, run directory or hub id, its config, weights and
tokenizer; models that must differ from each other; results written with one error line. A reader of the recipe
may skip this file."""
from pathlib import Path

from machinery.cli import MODEL_FILES, InputError, read_json, sha256_file
from machinery.hf import read_config, resolve_checkpoint
from machinery.tokenfiles import load_meta, split_tokens
from machinery.tokenizer import load_tokenizer


def inspect_model(path, model_class):
    """What is known of a model before its weights are loaded: its local folder (a hub id is
    fetched), its config, and the SHA-256 of its weights (which keys saved results and tells two
    models apart). model_class: model.py's ModernBERT (its config_class reads config.json)."""
    text = str(path)
    if not Path(text).is_dir() and (text.startswith((".", "/", "~")) or Path(text).parent.is_dir()):
        raise InputError(f"{text}: no such model directory")  # a local path, not a hub id
    folder = Path(resolve_checkpoint(text))
    if not (folder / "model.safetensors").is_file():
        raise InputError(f"{text}: no model.safetensors there (a model folder holds config.json "
                         f"and model.safetensors)")
    return {"path": text, "dir": folder, "class": model_class,
            "config": read_config(folder / "config.json", model_class.config_class),
            "sha256": sha256_file(folder / "model.safetensors")}


def find_tokenizer(folder, spec=None):
    """--tokenizer if given, else the folder's tokenizer.json, else the one train.py recorded in
    the run's state.json (runs that did not copy tokenizer.json to the top)."""
    folder = Path(folder)
    found = spec or (folder / "tokenizer.json" if (folder / "tokenizer.json").is_file() else None)
    found = found or recorded_tokenizer(folder)
    if not found:
        raise InputError(f"{folder}: no tokenizer.json and no tokenizer recorded in a state.json; "
                         f"pass --tokenizer (a tokenizer.json, a hub id, or 'bytes')")
    return load_tokenizer(found)


def recorded_tokenizer(folder):
    """The tokenizer spec in the latest checkpoint's state.json (or a top-level one), or None."""
    from machinery.rundir import latest_state
    state = latest_state(str(folder))
    if state is None and (folder / "state.json").is_file():
        state = read_json(folder / "state.json", "train.py's state.json")
    spec = state.get("tokenizer") if isinstance(state, dict) else None
    return spec if isinstance(spec, str) else None


def model_tokenizer(info, spec=None):
    """The tokenizer of inspect_model's `info` (find_tokenizer), refused when its special ids or
    its vocabulary do not fit the model's config."""
    tok = find_tokenizer(info["dir"], spec)
    c = info["config"]
    ours = (tok.cls_id, tok.sep_id, tok.pad_id, tok.mask_id)
    theirs = (c.cls_token_id, c.sep_token_id, c.pad_token_id, c.mask_token_id)
    if ours != theirs or tok.vocab_size > c.vocab_size:
        raise InputError(f"{info['path']}: tokenizer {tok.spec} (cls, sep, pad, mask = {ours}, "
                         f"vocab {tok.vocab_size}) does not fit the model (ids {theirs}, vocab "
                         f"{c.vocab_size}); pass the right --tokenizer")
    return tok


def load_weights(info, device):
    """The model of inspect_model's `info`, in eval mode on device; refused when a weight is NaN
    or inf (hf.read_weights: a diverged run, every score computed from it would be nonsense)."""
    model = info["class"](info["config"])
    model.load_weights(str(info["dir"] / "model.safetensors"))
    return model.to(device).eval()


def validation_setting(info, data, n_sequences=None, seq_len=None):
    """(windows, tokens per window, dtype, document separator id or None) to validate the model of inspect_model's
    `info` on `data` as train.py validated it, where it is a run of ours (its config's eval_sequences, seq_len, dtype
    and separate_documents), else on 64 x 512 in bfloat16 across documents; the windows and length asked for win.
    The dtype is autocast's on a GPU only, as in train.py: a run trained on a CPU validated in float32, and its
    numbers on a GPU differ by bfloat16's rounding."""
    from machinery.rundir import latest_state
    state = latest_state(str(info["dir"]))
    config = state["config"] if state else {}
    sep_id = load_meta(data)["sep_id"] if config.get("separate_documents") else None
    return (n_sequences or config.get("eval_sequences", 64), seq_len or config.get("seq_len", 512),
            config.get("dtype", "bfloat16"), sep_id)


def check_validation_data(data, info, n_sequences, seq_len):
    """A data.py folder whose val.bin the model of `info` can be validated on: its tokenizer's mask id and
    vocabulary, and at least n_sequences windows of seq_len."""
    meta, c = load_meta(data), info["config"]
    if meta["mask_id"] != c.mask_token_id or meta["vocab_size"] > c.vocab_size:
        raise InputError(f"{data}: tokenized with mask id {meta['mask_id']} and vocab {meta['vocab_size']}, but "
                         f"{info['path']} has mask id {c.mask_token_id} and vocab {c.vocab_size}")
    available = split_tokens(data, meta, "val") // seq_len
    if n_sequences > available:
        raise InputError(f"{data}/val.bin holds {available} windows of {seq_len} tokens; --n_sequences={n_sequences} "
                         f"asks for more")


def as_list(models):
    """A model, or a list of replicates given as a list or as paths separated by commas."""
    return list(models) if isinstance(models, (list, tuple)) else str(models).split(",")


def distinct_models(paths, model_class, same_ok=()):
    """inspect_model of each path, refused when they differ in depth, or when one is a model named
    before it (same folder or same weights), but for the pair of indices `same_ok`: a control or a
    replicate must be another run."""
    infos = [inspect_model(p, model_class) for p in paths]
    depths = {info["path"]: info["config"].num_hidden_layers for info in infos}
    if len(set(depths.values())) > 1:
        raise InputError(f"models have different numbers of layers: {depths}")
    for i in range(1, len(infos)):
        for j, other in enumerate(infos[:i]):
            same = "folder" if infos[i]["dir"].resolve() == other["dir"].resolve() else \
                "weights" if infos[i]["sha256"] == other["sha256"] else None
            if same and (j, i) != tuple(same_ok):
                raise InputError(f"{infos[i]['path']} has the same {same} as {other['path']}; "
                                 f"each model, replicate and seed control must be a run of its own")
    return infos


def model_files(infos, toks):
    """The files eval.py reads of the models inspect_model found, and the tokenizer files model_tokenizer loaded
    for them (--tokenizer, or the one a run recorded): an --out must not be one (cli.check_outputs, which also
    refuses every other file of a model folder)."""
    tokenizers = [Path(tok.spec) for tok in toks if Path(tok.spec).is_file()]
    return [Path(info["dir"]) / name for info in infos for name in MODEL_FILES] + tokenizers
