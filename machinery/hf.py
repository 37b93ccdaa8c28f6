"""Hugging Face formats: config.json read, checked and written; model.safetensors read and written; hub ids
fetched. Every problem with a file is an InputError naming the file and the field. A reader of the recipe may
skip this file."""
import dataclasses
import math
import os
import re
import sys

from machinery.cli import InputError, read_json, write_json

# Bounds that reject a crafted or corrupt config.json before any allocation (ModernBERT-large is far inside).
LIMITS = dict(vocab_size=2 ** 22, hidden_size=2 ** 15, intermediate_size=2 ** 17, num_hidden_layers=512,
              num_attention_heads=1024, global_attn_every_n_layers=512, local_attention=2 ** 20,
              max_position_embeddings=2 ** 20)
MAX_PARAMS = 20e9  # 80 GB of fp32 weights
# What model.py implements and its config has no field for: a config.json that says otherwise describes another
# model. A field of the config class is never fixed here: it is written and read as the model runs it.
FIXED = dict(classifier_activation="gelu", norm_bias=False, attention_bias=False, mlp_bias=False, decoder_bias=True,
             tie_word_embeddings=True, classifier_bias=False, embedding_dropout=0.0, mlp_dropout=0.0)
# The config.json keys transformers' ModernBertConfig reads (besides FIXED's and those config_to_hf adds): a field
# of ours outside it is written faithfully, but transformers would load the model without it, not as trained.
HF_KEYS = {"vocab_size", "hidden_size", "intermediate_size", "hidden_activation", "num_hidden_layers",
           "num_attention_heads", "global_attn_every_n_layers", "local_attention", "global_rope_theta",
           "local_rope_theta", "norm_eps", "attention_dropout", "initializer_range", "initializer_cutoff_factor",
           "max_position_embeddings", "pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id", "layer_types"}
# check_saved: the largest logit difference, as a share of the largest logit (at least 1), that a reload may show
# on the CPU in fp32 (rounding: model.py and transformers agree to about 1e-6 there; a GELU computed as SiLU in a
# few-step demo run moves them by 4e-4).
RELOAD_TOLERANCE = 1e-5
# transformers 5.x keeps the rotary bases per layer type; 4.x (and our config) as two fields.
ROPE_FIELDS = {"full_attention": "global_rope_theta", "sliding_attention": "local_rope_theta"}


def check_config(c, activations):
    """InputError naming the first field of config `c` out of range: sizes are checked before anything is
    allocated; hidden_activation is one of `activations` (model.py's). layer_types is checked when given (None:
    model.py derives it)."""
    def require(ok, name, expected):
        if not ok:
            raise InputError(f"{name}={getattr(c, name)!r}: expected {expected}")
    require(c.hidden_activation in activations, "hidden_activation", f"one of {list(activations)}")
    for name, top in LIMITS.items():
        v = getattr(c, name)
        require(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= top, name, f"an integer in [1, {top}]")
    for name in ("pad_token_id", "cls_token_id", "sep_token_id", "mask_token_id"):
        require(isinstance(getattr(c, name), int) and getattr(c, name) >= 0, name, "a non-negative id")
    # only the padding id indexes the embedding; transformers' config.json files carry no mask_token_id (read from
    # the tokenizer files beside them, else ModernBERT's in ModernBERT's vocabulary: config_fields)
    require(c.pad_token_id < c.vocab_size, "pad_token_id", f"an id below vocab_size={c.vocab_size}")
    for name in ("global_rope_theta", "local_rope_theta", "norm_eps", "initializer_range",
                 "initializer_cutoff_factor"):
        v = getattr(c, name)
        require(isinstance(v, (int, float)) and 0 < v < math.inf, name, "a positive finite number")
    require(isinstance(c.attention_dropout, (int, float)) and 0 <= c.attention_dropout < 1,
            "attention_dropout", "a probability in [0, 1)")
    d, h = c.hidden_size, c.num_attention_heads
    require(d % h == 0 and (d // h) % 2 == 0, "hidden_size",
            f"a multiple of num_attention_heads={h} with an even head dim (rotary halves)")
    params = c.vocab_size * d + c.num_hidden_layers * (4 * d * d + 3 * d * c.intermediate_size)
    if params > MAX_PARAMS:
        raise InputError(f"vocab_size, hidden_size, intermediate_size and num_hidden_layers give {params:.2e} "
                         f"parameters: expected at most {MAX_PARAMS:.0e}")
    if c.layer_types is not None:
        require(isinstance(c.layer_types, (list, tuple)) and len(c.layer_types) == c.num_hidden_layers,
                "layer_types", f"a list of num_hidden_layers={c.num_hidden_layers} entries")
        require(all(t in ROPE_FIELDS for t in c.layer_types), "layer_types",
                f"entries among {', '.join(ROPE_FIELDS)}")


def replace_config(c, **overrides):
    """A copy of config `c` with some fields changed, checked again; an unknown field is named."""
    unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(c)})
    if unknown:
        raise InputError(f"unknown config fields {unknown}")
    if {"num_hidden_layers", "global_attn_every_n_layers"} & set(overrides):
        overrides.setdefault("layer_types", None)  # derived again from the new depth
    return dataclasses.replace(c, **overrides)


# -----------------------------------------------------------------------------
# config.json


def read_config(config_file, config_class):
    """A checkpoint's config.json as a config_class (model.py's ModernBERTConfig); InputError naming the file
    and the field if it is not one we can run."""
    names = {f.name: f.default for f in dataclasses.fields(config_class)}
    fields = config_fields(read_json(config_file, "a ModernBERT config.json"), config_file, names)
    try:
        return config_class(**fields)
    except (ValueError, TypeError) as e:
        raise InputError(f"{config_file}: {e}") from None


def config_fields(d, source, names):
    """The values of `names` (the config class's fields and their defaults) in a parsed config.json, from either key
    spelling (transformers 4.x or 5.x)."""
    if not isinstance(d, dict):
        raise InputError(f"{source}: expected a JSON object, got {type(d).__name__}")
    if d.get("model_type") != "modernbert":
        raise InputError(f"{source}: model_type is {d.get('model_type')!r}, expected 'modernbert'")
    for key, want in FIXED.items():
        if key in d and d[key] != want and key not in names:
            raise InputError(f"{source}: {key}={d[key]!r} is not supported (ModernBERT uses {want!r})")
    for name in ("pad_token_id", "cls_token_id", "sep_token_id"):  # transformers allows null; the model needs them
        if name in d and d[name] is None:
            raise InputError(f"{source}: {name} is null: expected the id (this model frames and pads with it)")
    fields = {name: d[name] for name in names if d.get(name) is not None}
    if "mask_token_id" in names and d.get("mask_token_id") is None:  # transformers writes none: the id is that of
        mask = saved_mask_id(os.path.dirname(source))  # the tokenizer beside (ModernBERT's default would call the data
        if mask is not None:  # of any other tokenizer not the model's)
            fields["mask_token_id"] = mask
        elif any(d.get(k, names[k]) != names[k] for k in ("vocab_size", "cls_token_id", "sep_token_id",
                                                          "pad_token_id")):
            raise InputError(f"{source}: names no mask_token_id, and no tokenizer.json or tokenizer_config.json beside "
                             f"it gives the id of its mask token; add \"mask_token_id\": ID (the id of [MASK] in the "
                             f"tokenizer the model was trained with) to it")
        # else the vocabulary is ModernBERT's (its size, [CLS], [SEP] and [PAD]): its [MASK], the class's default
    types = d.get("layer_types")
    if "global_attn_every_n_layers" not in d and isinstance(types, list) and types:  # transformers 5.x may list the
        fields["global_attn_every_n_layers"] = next(  # layers alone: written back, their period is what 4.x reads
            (n for n in range(1, len(types) + 1) if all((t == "full_attention") == (i % n == 0)
                                                        for i, t in enumerate(types))), 3)
    scaling = d.get("rope_scaling")  # transformers 4.x's spelling of a scaled RoPE, applied to every layer
    if isinstance(scaling, dict) and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise InputError(f"{source}: rope_scaling {scaling!r} is not supported (unscaled rotary embeddings only)")
    rope = d.get("rope_parameters") or {}
    for kind, name in ROPE_FIELDS.items():
        if isinstance(rope, dict) and isinstance(rope.get(kind), dict):
            how = rope[kind].get("rope_type", rope[kind].get("type", "default"))  # "type": the older key
            if how != "default":
                raise InputError(f"{source}: rope_parameters' {kind} rope_type {how!r} is not supported")
            if rope[kind].get("rope_theta") is not None:  # else the top-level theta, as transformers reads it
                fields[name] = rope[kind]["rope_theta"]
    if isinstance(scaling, dict) and scaling.get("rope_theta") is not None:  # transformers 5.x merges rope_scaling
        fields.update(dict.fromkeys(ROPE_FIELDS.values(), scaling["rope_theta"]))  # into both kinds, over theirs
    return fields


def tokenizer_mask_id(path):
    """The id of [MASK] in the tokenizer.json at `path` (an added token, or in the vocabulary), or None where there
    is no such file or no such token."""
    if not os.path.isfile(path):
        return None
    t = read_json(path, "a tokenizer.json")
    t = t if isinstance(t, dict) else {}
    added, model = t.get("added_tokens"), t.get("model")
    ids = dict(model.get("vocab") or {}) if isinstance(model, dict) and isinstance(model.get("vocab"), dict) else {}
    ids |= {a.get("content"): a.get("id") for a in added if isinstance(a, dict)} if isinstance(added, list) else {}
    mask = ids.get("[MASK]")
    return mask if isinstance(mask, int) and not isinstance(mask, bool) else None


def saved_mask_id(folder):
    """The mask token's id in the tokenizer files of a checkpoint folder: [MASK] in its tokenizer.json, else the token
    its tokenizer_config.json (or special_tokens_map.json) names as mask_token, found in tokenizer_config.json's
    added_tokens_decoder (as transformers 4.x writes it); None where none of them gives it."""
    mask = tokenizer_mask_id(os.path.join(folder, "tokenizer.json"))
    if mask is not None:
        return mask
    def read(name):
        path = os.path.join(folder, name)
        content = read_json(path, f"a tokenizer's {name}") if os.path.isfile(path) else {}
        return content if isinstance(content, dict) else {}
    settings = read("tokenizer_config.json")
    name = settings.get("mask_token") or read("special_tokens_map.json").get("mask_token")
    name = name.get("content") if isinstance(name, dict) else name
    added = settings.get("added_tokens_decoder")
    ids = [int(i) for i, t in added.items() if isinstance(t, dict) and t.get("content") == name and i.isdigit()] \
        if isinstance(added, dict) and isinstance(name, str) else []
    return ids[0] if len(ids) == 1 else None


def config_to_hf(c):
    """config.json's contents in both key spellings, keys sorted as transformers writes them. Every field of the
    config is written as it is (what is saved is what runs); one transformers does not read is written too, with
    a warning that transformers will load the model without it."""
    rope = {kind: {"rope_theta": getattr(c, name), "rope_type": "default"} for kind, name in ROPE_FIELDS.items()}
    fields = dataclasses.asdict(c)
    foreign = sorted(set(fields) - HF_KEYS)
    if foreign:
        print(f"warning: config field(s) {', '.join(foreign)} written to config.json, but transformers' "
              f"ModernBertConfig does not read them: transformers would load this model without them, as trained "
              f"only where their values change nothing it computes (model.py reads them back; a run checks this after "
              f"its first save)", file=sys.stderr)
    d = {**FIXED, **fields, "layer_types": list(c.layer_types), "model_type": "modernbert",
         "architectures": ["ModernBertForMaskedLM"], "bos_token_id": c.cls_token_id, "eos_token_id": c.sep_token_id,
         "rope_parameters": rope}
    return dict(sorted(d.items()))


# -----------------------------------------------------------------------------
# model.safetensors and the checkpoint directory


def read_weights(weights_file, expected):
    """The tensors of a model.safetensors in fp32, checked against `expected` (the model's state dict): an
    InputError names the file and every missing, unexpected or mis-shaped key. Published files usually omit
    the tied decoder weight, which is the embedding."""
    from safetensors.torch import load_file
    if not os.path.exists(weights_file):
        folder = os.path.dirname(weights_file)
        other = [f for f in ("model.safetensors.index.json", "pytorch_model.bin")
                 if os.path.exists(os.path.join(folder, f))]
        raise InputError(f"{weights_file}: no such file (a checkpoint needs model.safetensors" + (
            f"; {other[0]} is not read: save the model again as one model.safetensors, e.g. transformers' "
            f"save_pretrained(..., max_shard_size='100GB')" if other else "") + ")")
    try:
        state = load_file(weights_file)
    except Exception as e:  # safetensors raises its own error type on truncated or garbage files
        raise InputError(f"{weights_file}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    emb = state.get("model.embeddings.tok_embeddings.weight")
    if "decoder.weight" in state and emb is not None and not state["decoder.weight"].equal(emb):
        raise InputError(f"{weights_file}: decoder.weight differs from the embeddings; only tied decoders "
                         f"are supported")
    if emb is not None:
        state["decoder.weight"] = emb
    problems = mismatches(state, expected)
    if problems:
        raise InputError(f"{weights_file} does not match the config: {problems}")
    check_finite(state, weights_file, "weight")
    return {k: v.float() for k, v in state.items()}


def check_finite(tensors, path, what="tensor"):
    """Every value of `tensors` ({name: tensor}, read from `path`) finite, or an InputError naming the file and the
    first tensor that is not: a diverged or damaged checkpoint, refused before any step or score is computed on it
    (the first step would turn every weight into NaN, and the loss check would blame the learning rate)."""
    bad = next((name for name, t in tensors.items() if t.is_floating_point() and not bool(t.isfinite().all())), None)
    if bad is not None:
        raise InputError(f"{path}: {what} {bad} holds NaN or inf (a diverged or damaged checkpoint); nothing can "
                         f"start from it: take an earlier checkpoint")


def mismatches(state, expected):
    """The keys missing from `state`, unexpected in it, or of another shape than in `expected`, in words."""
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if state[k].shape != expected[k].shape)
    problems = []
    if missing:
        problems.append(f"missing keys {missing}")
    if unexpected:
        problems.append(f"unexpected keys {unexpected}")
    if wrong:
        problems.append("shape mismatches " + ", ".join(
            f"{k}: file {tuple(state[k].shape)} vs model {tuple(expected[k].shape)}" for k in wrong))
    return "; ".join(problems)


def write_checkpoint(path, state, config):
    """config.json and model.safetensors, which transformers.AutoModelForMaskedLM loads as is. The tied
    decoder weight is left out, as Hugging Face does; the weights file is written whole or not at all."""
    from safetensors.torch import save_file
    os.makedirs(path, exist_ok=True)
    state = {k: v.detach().contiguous() for k, v in state.items() if k != "decoder.weight"}
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file(state, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    write_json(os.path.join(path, "config.json"), config_to_hf(config))


def check_saved(model, path):
    """After `model` is saved to `path`: the folder reloaded as a user would, by the model's own class and by
    transformers where it is installed, and each one's logits on a test sequence against the model as it is in
    memory, all on the CPU in fp32. A difference means that what trained is not what was saved: one warning line
    naming the likely cause. Returns the largest difference per loader, as a share of the largest logit (at least 1;
    within RELOAD_TOLERANCE: it reloads as trained); transformers is absent where it is not installed. The global
    RNG is left as it was (dropout streams go on as without the check) and so is the model."""
    import copy

    import torch
    c, cpu = model.config, torch.device("cpu")
    T = min(c.max_position_embeddings, c.local_attention + 8)  # keys beyond a local layer's reach (window each side)
    ids = torch.randint(0, c.vocab_size, (1, T), generator=torch.Generator().manual_seed(0))
    params = [*model.parameters(), *model.buffers()]
    if all(p.device == cpu and p.dtype == torch.float32 for p in params) and model.compiled_with is None:
        twin = model  # already as the check runs it: no copy
    else:  # the module as it is (its code, its attributes), on CPU copies of its tensors
        memo = {id(p): torch.nn.Parameter(p.detach().to(cpu, torch.float32), p.requires_grad)
                for p in model.parameters()}
        memo |= {id(b): b.detach().to(cpu) for b in model.buffers()}
        twin = copy.deepcopy(model, memo)
        for m in twin.modules():
            m._compiled_call_impl = None  # nn.Module.compile's: run eager
    backend = model.backend if model.backend in ("auto", "reference", "sdpa") else "auto"  # the CPU's
    was_training, previous = twin.training, twin.backend
    differences = {}
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            twin.eval()
            twin.backend = backend
            want = twin(ids)[0]
            ours = type(model).from_pretrained(path, backend=backend).eval()
            differences["model.py"] = (ours(ids)[0] - want).abs().max().item()
            try:
                import transformers
            except ImportError:
                transformers = None
            if transformers is not None:
                quiet = transformers.logging  # its load report and progress bar are not this check's business
                verbosity, bars = quiet.get_verbosity(), quiet.is_progress_bar_enabled()
                quiet.set_verbosity_error()
                quiet.disable_progress_bar()
                try:
                    theirs = transformers.AutoModelForMaskedLM.from_pretrained(path, attn_implementation="sdpa").eval()
                finally:
                    quiet.set_verbosity(verbosity)
                    if bars:
                        quiet.enable_progress_bar()
                differences["transformers"] = (theirs(input_ids=ids).logits - want).abs().max().item()
    finally:
        twin.train(was_training)
        twin.backend = previous
    scale = max(1.0, want.abs().max().item())
    wrong = {name: d for name, d in differences.items() if not d <= RELOAD_TOLERANCE * scale}
    if "model.py" in wrong:
        print(f"warning: {path} does not reload as the model that trained: reloaded by model.py, its logits differ by "
              f"{wrong['model.py']:.2g} from the model in memory on a test sequence. The model ran something its "
              f"config.json does not hold (a module or attribute changed after the model was built?): make the change "
              f"a ModernBERTConfig field, which config.json holds", file=sys.stderr, flush=True)
    elif wrong:
        print(f"warning: transformers loads {path} as another model: its logits differ by {wrong['transformers']:.2g} "
              f"from the model in memory on a test sequence, while model.py's own loader agrees. model.py computes "
              f"something its config.json does not describe (code edited in place of a config field: an activation, "
              f"a window, a norm?): make it a ModernBERTConfig field that transformers reads, as hidden_activation "
              f"is", file=sys.stderr, flush=True)
    return {name: d / scale for name, d in differences.items()}


# A segment of a hub id, as the hub takes it (huggingface_hub's validate_repo_id): 1 to 96 ASCII letters, digits,
# '_', '.' or '-', the first and the last a letter, a digit or '_'.
HUB_SEGMENT = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?")


def hub_id_problem(text, namespace=True):
    """What the Hugging Face hub refuses in a repository id, in words, or None where it takes it: NAMESPACE/NAME
    (or NAME alone where `namespace` is False), each a HUB_SEGMENT, no '--' or '..', no '.git' at the end. A dot
    segment ('..', '.') is no repository: a card or a snippet naming one names nothing anyone can load."""
    parts = text.split("/")
    if len(parts) != 2 and (namespace or len(parts) != 1):
        return "expected USER/NAME" if namespace else "expected NAME or USER/NAME"
    bad = next((part for part in parts if not HUB_SEGMENT.fullmatch(part)), None)
    if bad is not None:
        return (f"{bad!r} is not a name the hub takes: 1 to 96 ASCII letters, digits, '_', '.' or '-', starting and "
                f"ending with a letter, a digit or '_'")
    if "--" in text or ".." in text:
        return "the hub takes no '--' or '..' in an id"
    return "the hub takes no id ending in .git" if text.endswith(".git") else None


# What a checkpoint fetched from the hub is: the files model.py and the tokenizer read.
HUB_FILES = ["config.json", "model.safetensors", "tokenizer.json"]


def checkpoint_problem(path_or_id):
    """Why `path_or_id` is neither a local directory nor a hub id, in words (an absolute path, ./ or ../, more than one
    '/', a '/' at the end: what the hub refuses); None where it may be either. Needs no network, so a mistyped path
    is answered at once."""
    if os.path.isdir(path_or_id):
        return None
    if os.path.exists(path_or_id):
        return f"{path_or_id}: not a directory, and not a hub id like 'answerdotai/ModernBERT-base'"
    problem = hub_id_problem(path_or_id)
    return problem and f"{path_or_id}: no such directory, and not a hub id like 'answerdotai/ModernBERT-base' " \
                       f"({problem})"


def resolve_checkpoint(path_or_id):
    """A local directory as is; otherwise a hub id fetched with huggingface_hub (needs the network). A value that may
    be either, fetched in vain, is named in both readings: a folder that is not here, a model the hub has not or
    that could not be reached."""
    if os.path.isdir(path_or_id):
        return path_or_id
    problem = checkpoint_problem(path_or_id)
    if problem:
        raise InputError(problem)
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(path_or_id, allow_patterns=HUB_FILES)
    except Exception as e:
        reason = (str(e).splitlines() or [""])[0][:200]
        kinds = {kind.__name__ for kind in type(e).__mro__}  # by name: huggingface_hub may be what is missing
        hub = "huggingface_hub is not installed" if isinstance(e, ImportError) else \
            "a gated model, which needs a login (hf auth login)" if "GatedRepoError" in kinds else \
            "no such model on the hub (or a private one)" if "RepositoryNotFoundError" in kinds else \
            "the hub could not be reached"
        raise InputError(f"no such folder here, and could not fetch {path_or_id!r} from the Hugging Face hub: {hub} "
                         f"({type(e).__name__}: {reason}); check the path, or download it where the network allows "
                         f"and pass the local directory") from e


def hub_snapshot(hub_id, cached_only=False):
    """The folder of a hub id's revision as huggingface_hub keeps it (.../snapshots/COMMIT: the folder's name is the
    commit, its files that commit's): the newest, fetched (resolve_checkpoint); with cached_only, the one this machine
    holds already with every file of HUB_FILES, else None (nothing is fetched)."""
    if not cached_only:
        return resolve_checkpoint(hub_id)
    try:
        from huggingface_hub import snapshot_download
        folder = snapshot_download(hub_id, allow_patterns=HUB_FILES, local_files_only=True)
    except Exception:  # not on this machine (or no huggingface_hub): the run fetches it
        return None
    return folder if all(os.path.isfile(os.path.join(folder, f)) for f in HUB_FILES) else None
