"""model.py against its oracle, transformers.ModernBertForMaskedLM, and the properties the recipe relies on."""
import json

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_model
from machinery import kernels
from machinery.cli import InputError
from machinery.kernels import SDPA, linear_cross_entropy
from model import IGNORE_INDEX, LOSSES, ModernBERT, ModernBERTConfig, mask_rule

transformers = pytest.importorskip("transformers")

# Random shapes, each with sequences longer than its local window and a different global/local pattern.
SHAPES = [
    dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
         global_attn_every_n_layers=3, local_attention=16),
    dict(hidden_size=96, intermediate_size=160, num_hidden_layers=5, num_attention_heads=3,
         global_attn_every_n_layers=2, local_attention=32, global_rope_theta=1000.0, local_rope_theta=500.0),
    dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
         global_attn_every_n_layers=3, local_attention=128),  # ModernBERT's own window, +-64
]
SPECIAL = dict(pad_token_id=3, bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, mask_token_id=4)


def hf_checkpoint(tmp_path, shape, vocab=300, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.ModernBertConfig(vocab_size=vocab, attn_implementation="sdpa", **SPECIAL, **shape)
    hf = transformers.ModernBertForMaskedLM(cfg).eval()
    with torch.no_grad():  # HF inits the decoder bias at 0 and norms at 1: perturb so they are tested too
        for name, p in hf.named_parameters():
            if "norm" in name or "bias" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "Wqkv" in name:  # HF's 0.02 gives scores near 0: attention near uniform, where no position shows
                p.mul_(20)  # (without RoPE the logits moved by under 1e-4); x20: scores of a few units
    hf.save_pretrained(tmp_path)
    return hf


def padded_batch(vocab, T=200, lengths=(200, 150, 37), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, :n] = 1
        ids[b, n:] = SPECIAL["pad_token_id"]
    return ids, mask


@pytest.mark.parametrize("shape", SHAPES)
def test_logits_match_transformers(tmp_path, shape):
    hf = hf_checkpoint(tmp_path, shape)
    ours = ModernBERT.from_pretrained(str(tmp_path)).eval()
    ids, mask = padded_batch(300)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask).logits
        got, loss = ours(ids, mask)
    assert loss is None and got.shape == want.shape == (3, 200, 300)
    real = mask.bool()
    assert (got - want)[real].abs().max().item() <= 1e-4


@pytest.mark.parametrize("activation", ["relu", "silu"])
def test_an_edited_activation_is_saved_as_it_runs(tmp_path, activation, capsys):
    """A student's GLU variant through the config field transformers names (hidden_activation): config.json holds
    it, our model reloads equal to the trained one, and transformers runs it alike (ReGLU, SwiGLU). A field
    transformers cannot read is written faithfully, with a warning that transformers would not load it as
    trained, and read back by model.py."""
    import dataclasses
    config = ModernBERTConfig.from_preset("tiny", vocab_size=300, pad_token_id=3, cls_token_id=1, sep_token_id=2,
                                          mask_token_id=4, hidden_activation=activation)
    torch.manual_seed(0)
    trained = ModernBERT(config).eval()
    trained.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["hidden_activation"] == activation
    ids, mask = padded_batch(300)
    with torch.no_grad():
        want = trained(ids, mask)[0]
        again = ModernBERT.from_pretrained(str(tmp_path)).eval()
        assert again.config.hidden_activation == activation and torch.equal(again(ids, mask)[0], want)
        hf = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
        assert (hf(input_ids=ids, attention_mask=mask).logits - want)[mask.bool()].abs().max().item() <= 1e-4
    assert "warning" not in capsys.readouterr().err
    Extended = dataclasses.make_dataclass("Extended", [("mlp_scale", float, 1.0)], bases=(ModernBERTConfig,))
    extended = Extended(**{**dataclasses.asdict(config), "mlp_scale": 2.0})
    from machinery.hf import read_config, write_checkpoint
    write_checkpoint(tmp_path / "x", trained.state_dict(), extended)
    assert "mlp_scale written to config.json, but transformers' ModernBertConfig does not read" in \
        capsys.readouterr().err
    assert read_config(tmp_path / "x" / "config.json", Extended).mlp_scale == 2.0
    with pytest.raises(InputError, match="hidden_activation='reglu': expected one of"):
        config.replace(hidden_activation="reglu")


def test_the_check_at_a_save_runs_a_copy_of_a_compiled_model_and_leaves_all_as_it_was(tmp_path, capsys):
    """hf.check_saved on a model that is not CPU fp32 eager (here float64, with blocks as nn.Module.compile leaves
    them): it compares a CPU fp32 copy that runs eager with model.py's and transformers' reloads, all equal, and
    leaves the model (dtype, mode, calls) and the global RNG as they were."""
    from machinery.hf import check_saved
    model = tiny_model().train()
    model.save_pretrained(tmp_path)
    model.double()
    model.compiled_with = "a test double"
    for block in model.model.layers:  # what compiling leaves: a call of the model in memory, on its device
        block._compiled_call_impl = lambda *args, **kwargs: pytest.fail("the copy ran the model in memory's call")
    rng = torch.get_rng_state()
    assert check_saved(model, str(tmp_path)) == {"model.py": 0.0, "transformers": 0.0}
    assert torch.equal(torch.get_rng_state(), rng) and model.training and model.backend == "auto"
    embeddings = model.model.embeddings.tok_embeddings.weight
    assert model.decoder.weight.dtype == torch.float64 and model.decoder.weight is embeddings  # still tied
    assert "warning" not in capsys.readouterr().err


def test_the_check_at_a_save_leaves_a_cpu_model_training(tmp_path):
    """On a CPU in fp32 the check runs the model itself, in eval mode: training goes on after it in train mode (with
    dropout, as configured), with the backend it had."""
    from machinery.hf import check_saved
    model = tiny_model(attention_dropout=0.1).train()
    model.backend = "sdpa"
    model.save_pretrained(tmp_path)
    assert check_saved(model, str(tmp_path)) == {"model.py": 0.0, "transformers": 0.0}
    assert all(m.training for m in model.modules()) and model.backend == "sdpa"


def test_a_failed_save_leaves_the_weights_saved_before(tmp_path, monkeypatch):
    """model.safetensors is written whole or not at all: a save that fails half way (a full disk) over a checkpoint
    leaves that checkpoint's weights as they were."""
    import safetensors.torch
    tiny_model().save_pretrained(tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()

    def full_disk(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a file")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    with pytest.raises(OSError, match="No space left"):
        tiny_model(seed=1).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_every_blocks_output_matches_transformers(tmp_path):
    """encode(all_layers=True), what CKA compares: each block's output before final_norm, as transformers' layers
    give it (read with forward hooks); final_norm of the last one is encode's output."""
    hf = hf_checkpoint(tmp_path, SHAPES[1])
    ours = ModernBERT.from_pretrained(str(tmp_path)).eval()
    ids, mask = padded_batch(300)
    seen = []
    hooks = [layer.register_forward_hook(lambda module, args, out: seen.append(out)) for layer in hf.model.layers]
    with torch.no_grad():
        hf(input_ids=ids, attention_mask=mask)
        got = ours.encode(ids, mask, all_layers=True)
        last = ours.model.final_norm(got[-1])
    for hook in hooks:
        hook.remove()
    real = mask.bool()
    assert len(got) == len(seen) == SHAPES[1]["num_hidden_layers"]
    for layer, (a, b) in enumerate(zip(got, seen)):
        assert (a - b)[real].abs().max().item() <= 1e-4, layer
    assert torch.equal(last[real], ours.encode(ids, mask)[real])


def test_loss_matches_transformers_with_sparse_prediction(tmp_path):
    hf = hf_checkpoint(tmp_path, SHAPES[0])
    ours = ModernBERT.from_pretrained(str(tmp_path)).eval()
    ids, mask = padded_batch(300)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=torch.Generator().manual_seed(2)) > 0.3] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, labels=labels).loss
        logits, got = ours(ids, mask, labels=labels)
    assert logits is None  # with labels the decoder runs on the labelled positions only, inside the loss
    assert abs(got.item() - want.item()) <= 1e-5


def test_causal_matches_transformers_given_the_same_masks(tmp_path):
    """transformers has no causal mode, but takes explicit per-layer-type masks: build them independently."""
    shape = SHAPES[0]
    hf = hf_checkpoint(tmp_path, shape)
    ours = ModernBERT.from_pretrained(str(tmp_path)).eval()
    T, w = 100, shape["local_attention"] // 2
    ids = torch.randint(4, 300, (2, T), generator=torch.Generator().manual_seed(3))
    i = torch.arange(T)
    causal = i[None, :] <= i[:, None]
    window = causal & (i[:, None] - i[None, :] <= w)
    masks = {"full_attention": causal.expand(2, 1, T, T), "sliding_attention": window.expand(2, 1, T, T)}
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=masks).logits
        got, _ = ours(ids, causal=True)
    assert (got - want).abs().max().item() <= 1e-4


def test_round_trip_through_save_pretrained(tmp_path):
    hf = hf_checkpoint(tmp_path / "hf", SHAPES[1])
    ours = ModernBERT.from_pretrained(str(tmp_path / "hf"))
    ours.save_pretrained(str(tmp_path / "ours"))
    config = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert {"layer_types", "rope_parameters", "global_rope_theta", "global_attn_every_n_layers"} <= set(config)
    back = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "ours"), attn_implementation="sdpa").eval()
    ids, mask = padded_batch(300)
    with torch.no_grad():
        a = hf(input_ids=ids, attention_mask=mask).logits
        b = back(input_ids=ids, attention_mask=mask).logits
    assert (a - b)[mask.bool()].abs().max().item() == 0.0


def test_loads_old_config_spelling_and_file_with_decoder_weight(tmp_path):
    hf = hf_checkpoint(tmp_path, SHAPES[1])
    config = json.loads((tmp_path / "config.json").read_text())
    # transformers 4.x spelling: thetas as top-level keys, no layer_types / rope_parameters
    for key in ("layer_types", "rope_parameters"):
        config.pop(key)
    config.update(global_rope_theta=1000.0, local_rope_theta=500.0)
    (tmp_path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file
    state = load_file(tmp_path / "model.safetensors")
    state["decoder.weight"] = state["model.embeddings.tok_embeddings.weight"].clone()
    save_file(state, tmp_path / "model.safetensors")
    ours = ModernBERT.from_pretrained(str(tmp_path)).eval()
    assert ours.config.layer_types == tuple(hf.config.layer_types)
    ids, mask = padded_batch(300)
    with torch.no_grad():
        assert (ours(ids, mask)[0] - hf(input_ids=ids, attention_mask=mask).logits)[mask.bool()].abs().max() <= 1e-4


def test_a_transformers_checkpoint_takes_its_mask_id_from_the_tokenizer_beside_it(tmp_path):
    """transformers writes no mask_token_id to config.json: the [MASK] id is the tokenizer's saved with the weights,
    so that the data and the eval tokenizer of that tokenizer fit the model (ModernBERT's 50284, the default, refused
    them, and lies outside this vocabulary of 320). A config.json that names a mask id keeps it."""
    from machinery import models
    from machinery.tokenizer import load_tokenizer
    tok = load_tokenizer("bytes")
    ids = dict(pad_token_id=tok.pad_id, cls_token_id=tok.cls_id, sep_token_id=tok.sep_id)
    hf = transformers.ModernBertConfig(vocab_size=320, bos_token_id=tok.cls_id, eos_token_id=tok.sep_id, **ids,
                                       **SHAPES[0])
    transformers.ModernBertForMaskedLM(hf).save_pretrained(tmp_path)
    assert "mask_token_id" not in json.loads((tmp_path / "config.json").read_text())
    with pytest.raises(InputError, match="names no mask_token_id"):  # was ModernBERT's 50284, outside this vocabulary
        ModernBERTConfig.read(tmp_path / "config.json")
    tok.save_pretrained(tmp_path)
    info = models.inspect_model(str(tmp_path), ModernBERT)
    assert info["config"].mask_token_id == tok.mask_id == 259
    assert models.model_tokenizer(info).mask_id == 259  # was: "does not fit the model (ids (256, 257, 258, 50284)"
    ModernBERT.from_pretrained(str(tmp_path)).save_pretrained(str(tmp_path / "ours"))
    assert json.loads((tmp_path / "ours" / "config.json").read_text())["mask_token_id"] == 259
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "mask_token_id": 7}))
    assert ModernBERTConfig.read(tmp_path / "config.json").mask_token_id == 7


def test_a_checkpoint_without_tokenizer_json_takes_its_mask_id_from_its_tokenizer_config(tmp_path):
    """A transformers checkpoint stripped of tokenizer.json: the mask id is the one tokenizer_config.json's
    added_tokens_decoder gives the token its mask_token (or special_tokens_map.json's) names, as transformers 4.x
    writes them; where nothing gives it, one line says so, but for ModernBERT's own vocabulary, whose [MASK] is 50284."""
    from machinery.tokenizer import load_tokenizer
    tok = load_tokenizer("bytes")
    ids = dict(pad_token_id=tok.pad_id, cls_token_id=tok.cls_id, sep_token_id=tok.sep_id)
    transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(vocab_size=320, **ids, **SHAPES[0])) \
        .save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    transformers.AutoTokenizer.from_pretrained(tmp_path).save_pretrained(tmp_path)  # its own tokenizer_config.json
    (tmp_path / "tokenizer.json").unlink()
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["mask_token"] == "[MASK]"
    with pytest.raises(InputError, match=r"config\.json: names no mask_token_id, and no tokenizer\.json or "
                                         r"tokenizer_config\.json beside it gives the id of its mask token"):
        ModernBERTConfig.read(tmp_path / "config.json")  # 5.x writes the token, not its id: was 50284
    settings = json.loads((tmp_path / "tokenizer_config.json").read_text())
    decoder = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tok.config["added_tokens"]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "added_tokens_decoder": decoder}))
    assert ModernBERTConfig.read(tmp_path / "config.json").mask_token_id == tok.mask_id == 259
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"mask_token": {"content": "[SEP]"}}))
    del settings["mask_token"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**settings, "added_tokens_decoder": decoder}))
    assert ModernBERTConfig.read(tmp_path / "config.json").mask_token_id == tok.sep_id  # the token it names
    transformers.ModernBertConfig().save_pretrained(tmp_path / "modernbert")  # ModernBERT's vocabulary, nothing else
    assert ModernBERTConfig.read(tmp_path / "modernbert" / "config.json").mask_token_id == 50284


def edited_config(tmp_path, **changes):
    """A transformers checkpoint of SHAPES[0] in tmp_path with config.json's keys changed (None: a null)."""
    hf = hf_checkpoint(tmp_path, SHAPES[0])
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
    return hf


@pytest.mark.parametrize("changes, named", [
    (dict(rope_scaling={"rope_type": "linear", "factor": 8.0}), "rope_scaling"),  # transformers 4.x's spelling
    (dict(rope_parameters={"full_attention": {"type": "linear", "factor": 8.0, "rope_theta": 160000.0}}), "linear"),
    (dict(pad_token_id=None), "pad_token_id is null"),
    (dict(sep_token_id=None), "sep_token_id is null"),
    (dict(mlp_dropout=0.1), "mlp_dropout=0.1"),
    (dict(embedding_dropout=0.1), "embedding_dropout=0.1"),
    (dict(classifier_bias=True), "classifier_bias=True")])
def test_a_config_this_model_does_not_run_is_refused_by_name(tmp_path, changes, named):
    """What transformers reads and model.py would run otherwise (a scaled RoPE, a null id it would fill with a
    default, dropouts it has no place for) is refused, naming the key, never loaded as another model."""
    edited_config(tmp_path, **changes)
    with pytest.raises(InputError, match=named):
        ModernBERT.from_pretrained(str(tmp_path))


@pytest.mark.parametrize("kept", ["model.safetensors.index.json", "pytorch_model.bin"])
def test_a_checkpoint_in_another_weights_layout_is_named(tmp_path, kept):
    """A sharded checkpoint, or an older one in pickle format, is refused with the file it holds and what to do."""
    hf_checkpoint(tmp_path, SHAPES[0])
    (tmp_path / "model.safetensors").rename(tmp_path / kept)
    with pytest.raises(InputError, match=f"no such file .*; {kept} is not read: save the model again as one"):
        ModernBERT.from_pretrained(str(tmp_path))


def test_layer_types_without_their_period_are_saved_with_it(tmp_path):
    """A config.json that lists the layer types alone (global every 2nd layer) is saved with the period that
    transformers 4.x reads instead of them, so that both versions build the same layers."""
    config = edited_config(tmp_path).config.to_dict()
    types = ["full_attention" if i % 2 == 0 else "sliding_attention" for i in range(SHAPES[0]["num_hidden_layers"])]
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("global_attn_every_n_layers")
    (tmp_path / "config.json").write_text(json.dumps({**saved, "layer_types": types}))
    ModernBERT.from_pretrained(str(tmp_path)).save_pretrained(str(tmp_path / "ours"))
    back = json.loads((tmp_path / "ours" / "config.json").read_text())
    assert back["layer_types"] == types and back["global_attn_every_n_layers"] == 2 != config["global_attn_every_n_layers"]


def test_rope_parameters_without_a_theta_take_the_top_level_one_as_transformers_does(tmp_path):
    hf = edited_config(tmp_path, global_rope_theta=1000.0, local_rope_theta=100.0,
                       rope_parameters={k: {"rope_type": "default"} for k in ("full_attention", "sliding_attention")})
    ours = ModernBERT.from_pretrained(str(tmp_path)).eval()
    assert (ours.config.global_rope_theta, ours.config.local_rope_theta) == (1000.0, 100.0)
    hf = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path), attn_implementation="sdpa").eval()
    ids, mask = padded_batch(300)
    with torch.no_grad():
        assert (ours(ids, mask)[0] - hf(input_ids=ids, attention_mask=mask).logits)[mask.bool()].abs().max() <= 1e-4


def test_a_theta_in_rope_scaling_applies_to_both_layer_kinds_as_transformers_reads_it(tmp_path):
    """transformers 5.x merges a config.json's rope_scaling into the rotary parameters of both layer kinds, its
    rope_theta over theirs: a default-type rope_scaling with a theta gives every layer that theta (it was ignored)."""
    edited_config(tmp_path, rope_scaling={"rope_type": "default", "rope_theta": 5.0})
    theirs = transformers.AutoConfig.from_pretrained(str(tmp_path)).rope_parameters
    ours = ModernBERTConfig.read(tmp_path / "config.json")
    assert (ours.global_rope_theta, ours.local_rope_theta) == (theirs["full_attention"]["rope_theta"],
                                                              theirs["sliding_attention"]["rope_theta"]) == (5.0, 5.0)


def test_mismatched_checkpoint_names_the_keys(tmp_path):
    hf_checkpoint(tmp_path, SHAPES[0])
    from safetensors.torch import load_file, save_file
    state = load_file(tmp_path / "model.safetensors")
    state["model.layers.1.mlp.Wi.weight"] = state["model.layers.1.mlp.Wi.weight"][:10]
    del state["model.final_norm.weight"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(InputError, match=r"model\.final_norm\.weight.*model\.layers\.1\.mlp\.Wi\.weight"):
        ModernBERT.from_pretrained(str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "bert"}))
    with pytest.raises(InputError, match="model_type"):
        ModernBERT.from_pretrained(str(tmp_path))
    with pytest.raises(InputError, match="no such directory, and not a hub id"):
        ModernBERT.from_pretrained(str(tmp_path / "nowhere" / "deeper"))


def tiny(seed=0, **kw):
    return tiny_model(seed, **kw).eval()


def test_causal_outputs_do_not_see_the_future_in_any_layer():
    model = tiny()
    assert {"full_attention", "sliding_attention"} == set(model.config.layer_types)
    T, t = 200, 120
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(0))
    other = ids.clone()
    other[:, t + 1:] = torch.randint(0, 256, (2, T - t - 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = model.encode(ids, causal=True, all_layers=True)
        b = model.encode(other, causal=True, all_layers=True)
        bidirectional = model.encode(other, all_layers=True)
    assert len(a) == model.config.num_hidden_layers
    for layer, (x, y) in enumerate(zip(a, b)):
        assert (x[:, :t + 1] - y[:, :t + 1]).abs().max().item() <= 1e-6, f"layer {layer} saw the future"
        assert (x[:, t + 1:] - y[:, t + 1:]).abs().max().item() > 1e-3  # the change itself is visible
    # ...while bidirectional attention does propagate the change backwards
    assert (a[-1][:, :t + 1] - model.encode(ids, all_layers=True)[-1][:, :t + 1]).abs().max() > 1e-3
    assert (bidirectional[0][:, :t + 1] - model.encode(ids, all_layers=True)[0][:, :t + 1]).abs().max() > 1e-3


@pytest.mark.parametrize("causal", [False, True])
def test_local_window_reaches_exactly_64_tokens_back(causal):
    model = tiny()
    local = next(b for b in model.model.layers if b.local)
    assert model.config.window == 64
    T, i = 260, 150
    x = torch.randn(1, T, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    masks = SDPA(1, T, x.device, causal, model.config.window, rule=mask_rule)
    ropes = {loc: model_rope(model, T, loc) for loc in (False, True)}

    def moved(j):  # how much the attention output at i changes when input j is perturbed, in one local layer
        y = x.clone()
        y[0, j, 0] += 10.0  # one coordinate: a shift of the whole row would vanish in the LayerNorm
        with torch.no_grad():  # the attention branch alone: next to the residual its effect would round away
            attend = lambda z: local.attn(local.attn_norm(z), ropes[True], masks)[0, i]  # noqa: E731
            return (attend(x) - attend(y)).abs().max().item()

    assert moved(i - 64) > 1e-6 and moved(i - 65) == 0.0
    if causal:
        assert moved(i + 1) == 0.0
    else:
        assert moved(i + 64) > 1e-6 and moved(i + 65) == 0.0


def model_rope(model, T, local):
    from model import rope_cos_sin
    D = model.config.hidden_size // model.config.num_attention_heads
    theta = model.config.local_rope_theta if local else model.config.global_rope_theta
    return rope_cos_sin(torch.arange(T), D, theta)


def test_document_ids_keep_packed_documents_apart():
    """With doc_ids, a packed sequence gives each document the outputs it has alone (RoPE is relative)."""
    model = tiny()
    g = torch.Generator().manual_seed(0)
    first, second = torch.randint(0, 256, (1, 90), generator=g), torch.randint(0, 256, (1, 110), generator=g)
    packed = torch.cat([first, second], 1)
    doc_ids = torch.cat([torch.zeros(1, 90), torch.ones(1, 110)], 1).long()
    for causal in (False, True):
        with torch.no_grad():
            together = model.encode(packed, causal=causal, doc_ids=doc_ids)
            alone = torch.cat([model.encode(first, causal=causal), model.encode(second, causal=causal)], 1)
            crossing = model.encode(packed, causal=causal)
        assert (together - alone).abs().max().item() <= 1e-4
        assert (crossing - alone)[:, 90:].abs().max().item() > 1e-3  # the default lets attention cross


@pytest.mark.parametrize("name, count", [("base", 149_655_232), ("large", 395_881_664)])
def test_preset_parameter_counts(name, count):
    with torch.device("meta"):
        model = ModernBERT(ModernBERTConfig.from_preset(name))
    assert model.num_params() == count


@pytest.mark.parametrize("name", ["tiny", "mini", "small", "base"])
def test_preset_sizes_match_transformers(name):
    """Our presets against transformers' own ModernBertForMaskedLM built from the same sizes (the oracle)."""
    from model import PRESETS
    with torch.device("meta"):
        ours = ModernBERT(ModernBERTConfig.from_preset(name))
        hf = transformers.ModernBertForMaskedLM(transformers.ModernBertConfig(**PRESETS[name]))
    assert ours.num_params() == sum(p.numel() for p in hf.parameters())
    assert ours.config.layer_types == tuple(hf.config.layer_types)  # global every 3 layers, as in base
    assert ours.config.hidden_size // ours.config.num_attention_heads == 64 or name == "tiny"


def test_config_defaults_are_modernberts_as_transformers_has_them(tmp_path):
    """What a run from scratch builds on (every preset keeps the rest of the defaults): transformers' default
    ModernBertConfig, ModernBERT-base's, read back field by field (rotary bases, norm eps, window, init, ids)."""
    transformers.ModernBertConfig().save_pretrained(tmp_path)
    assert ModernBERTConfig.read(tmp_path / "config.json") == ModernBERTConfig()


CORRUPT_CONFIGS = [  # (change to a valid config.json, the field the error must name)
    (dict(vocab_size=4_000_000_000), "vocab_size"),
    (dict(vocab_size=4e9), "vocab_size"),
    (dict(hidden_size=100), "hidden_size"),  # 4 heads of 25: not even, and rotary needs halves
    (dict(num_hidden_layers=0), "num_hidden_layers"),
    (dict(num_attention_heads=-4), "num_attention_heads"),
    (dict(max_position_embeddings=-1), "max_position_embeddings"),
    (dict(intermediate_size="96"), "intermediate_size"),
    (dict(hidden_size=2 ** 14, num_attention_heads=2 ** 8, vocab_size=2 ** 22), "parameters"),
    (dict(pad_token_id=300), "pad_token_id"),
    (dict(norm_eps=0.0), "norm_eps"),
    (dict(layer_types=["full_attention"]), "layer_types"),
]


@pytest.mark.parametrize("change, field", CORRUPT_CONFIGS)
def test_absurd_config_is_rejected_before_allocation(tmp_path, change, field):
    hf_checkpoint(tmp_path, SHAPES[0])
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(InputError, match=f"config.json.*{field}"):
        ModernBERT.from_pretrained(str(tmp_path))


def test_corrupt_files_name_the_file(tmp_path):
    hf_checkpoint(tmp_path, SHAPES[0])
    weights = (tmp_path / "model.safetensors").read_bytes()
    for broken in (weights[: len(weights) // 2], b"garbage" * 10, b""):
        (tmp_path / "model.safetensors").write_bytes(broken)
        with pytest.raises(InputError, match="model.safetensors: not a readable safetensors file"):
            ModernBERT.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text('{"model_type": "modernbert", ')
    with pytest.raises(InputError, match="config.json: not valid JSON"):
        ModernBERT.from_pretrained(str(tmp_path))
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(InputError, match="config.json: expected a JSON object"):
        ModernBERT.from_pretrained(str(tmp_path))


def test_from_pretrained_overrides_set_config_fields(tmp_path):
    hf_checkpoint(tmp_path, SHAPES[0])
    model = ModernBERT.from_pretrained(str(tmp_path), "sdpa", attention_dropout=0.1)
    assert model.config.attention_dropout == 0.1 and model.model.layers[1].attn.dropout == 0.1
    with pytest.raises(InputError, match="unknown config fields.*dropout"):
        ModernBERT.from_pretrained(str(tmp_path), dropout=0.1)
    with pytest.raises(InputError, match="attention_dropout"):
        ModernBERT.from_pretrained(str(tmp_path), attention_dropout=1.5)


def test_megatron_init():
    model = tiny(num_hidden_layers=4)
    std, out_std = 0.02, 0.02 / (2 * 4) ** 0.5
    emb = model.model.embeddings.tok_embeddings.weight
    assert emb is model.decoder.weight
    assert abs(emb.std().item() - std * 0.88) < 0.002  # a +-2 sigma truncated normal has std 0.88 sigma
    assert emb.abs().max().item() <= 2 * std
    for wo in (model.model.layers[2].mlp.Wo.weight, model.model.layers[2].attn.Wo.weight):  # both write the residual
        assert abs(wo.std().item() - out_std * 0.88) < 0.001 and wo.abs().max().item() <= 2 * out_std
    assert abs(model.head.dense.weight.std().item() - std * 0.88) < 0.002
    assert torch.equal(model.model.final_norm.weight, torch.ones(128)) and not model.decoder.bias.any()


def test_attention_dropout_drops_in_training_only():
    """attention_dropout (train.py's --dropout) is inverted dropout on the attention's output: in eval mode the model
    computes bit for bit what it does without it; in training a share p of the outputs is zero and the rest is the
    eval output scaled by 1 / (1 - p)."""
    p, T = 0.5, 100
    ids = torch.randint(0, 256, (2, T), generator=torch.Generator().manual_seed(0))
    model = tiny(attention_dropout=p)
    with torch.no_grad():
        assert torch.equal(model(ids)[0], tiny()(ids)[0])
        attn = model.model.layers[1].attn
        x = torch.randn(2, T, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
        args = model_rope(model, T, attn.local), SDPA(2, T, x.device, False, model.config.window, rule=mask_rule)
        kept, dropped = attn(x, *args), attn.train()(x, *args)
    zero = dropped == 0
    assert abs(zero.float().mean().item() - p) < 0.02 and not (kept == 0).any()
    assert torch.allclose(dropped[~zero], kept[~zero] / (1 - p), rtol=1e-6, atol=0)


def test_param_groups_split_by_ndim():
    model = tiny()
    groups = model.param_groups()
    assert all(p.ndim >= 2 for _, p in groups["decay"]) and all(p.ndim <= 1 for _, p in groups["no_decay"])
    names = [n for g in groups.values() for n, _ in g]
    assert len(names) == len(set(names)) == len(dict(model.named_parameters()))
    assert "decoder.bias" in dict(groups["no_decay"]) and "decoder.weight" not in names  # tied: counted once


def test_flops_per_token_counts_every_matmul():
    model = tiny()
    c = model.config
    T = 256
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not model.decoder)
    head = model.head.dense.weight.numel() + model.decoder.weight.numel()
    n_global = c.layer_types.count("full_attention")
    n_local = c.num_hidden_layers - n_global
    d = c.hidden_size
    want_mlm = 6 * (matmul - model.head.dense.weight.numel() + 0.3 * head) + 12 * d * (n_global * T + n_local * 129)
    want_clm = 6 * (matmul - model.head.dense.weight.numel() + head) + 12 * d * (n_global * (T + 1) / 2 + n_local * 65)
    assert model.flops_per_token(T, causal=False, mask_rate=0.3) == pytest.approx(want_mlm)
    assert model.flops_per_token(T, causal=True, mask_rate=1.0) == pytest.approx(want_clm)
    every_global = tiny(layer_types=["full_attention"] * c.num_hidden_layers)
    for causal in (False, True):  # a window that covers the whole sequence (T <= w + 1) is global attention
        assert model.flops_per_token(50, causal) == pytest.approx(every_global.flops_per_token(50, causal))


def test_linear_cross_entropy_matches_pytorch():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(50, 16, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(30, 16, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(30, dtype=torch.float64, generator=g, requires_grad=True)
    y = torch.randint(0, 30, (50,), generator=g)
    y[::3] = IGNORE_INDEX
    ours = linear_cross_entropy(h, w, b, y, chunk=7)
    ours.backward()
    mine = [t.grad.clone() for t in (h, w, b)]
    for t in (h, w, b):
        t.grad = None
    ref = F.cross_entropy(F.linear(h, w, b), y)
    ref.backward()
    assert abs(ours.item() - ref.item()) < 1e-12
    for a, r in zip(mine, (h.grad, w.grad, b.grad)):
        assert (a - r).abs().max().item() < 1e-12
    with torch.no_grad():  # no gradient work without grad mode, same value
        assert abs(linear_cross_entropy(h, w, b, y).item() - ref.item()) < 1e-12


@pytest.mark.parametrize("causal", [False, True])
def test_the_fused_loss_equals_the_plain_one_on_the_page(causal):
    """model.py's cross_entropy (the loss a reader sees, and the default) and the fused kernel --loss=fused picks:
    the same loss and the same gradient on every parameter, MLM and CLM, in float64; no labelled position gives 0
    for both."""
    torch.manual_seed(0)
    plain = tiny_model(seed=3).double()
    fused = tiny_model(seed=3).double()
    assert plain.loss == "plain"
    fused.loss = "fused"
    ids = torch.randint(0, 256, (2, 40))
    labels = torch.where(torch.rand(2, 40) < 0.3, ids, IGNORE_INDEX) if not causal else ids.roll(-1, 1)
    losses = []
    for model in (plain, fused):
        _, loss = model(ids, labels=labels, causal=causal)
        loss.backward()
        losses.append(loss)
    assert losses[0].item() == pytest.approx(losses[1].item(), abs=1e-12)
    for (name, p), q in zip(plain.named_parameters(), fused.parameters()):
        assert (p.grad - q.grad).abs().max().item() < 1e-12, name
    none = torch.full_like(labels, IGNORE_INDEX)
    for model in (plain, fused):  # a batch with nothing to predict: a loss of 0 and gradients of 0, no error
        model.zero_grad()
        loss = model(ids, labels=none)[1]
        loss.backward()
        assert loss.item() == 0.0 and not any(p.grad.any() for p in model.parameters() if p.grad is not None)


def test_an_edit_to_the_loss_on_the_page_is_what_trains(monkeypatch):
    """The default (loss=plain) runs model.py's cross_entropy as it is now: an edit there (here, the loss doubled)
    changes the loss the model returns, and its gradients."""
    import model
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    labels = torch.where(torch.rand(2, 40, generator=torch.Generator().manual_seed(1)) < 0.3, ids, IGNORE_INDEX)
    want = tiny()(ids, labels=labels)[1].item()
    plain = model.cross_entropy
    monkeypatch.setattr(model, "cross_entropy", lambda h, w, b, y: 2 * plain(h, w, b, y))
    assert tiny()(ids, labels=labels)[1].item() == pytest.approx(2 * want, rel=1e-6)


def test_a_fused_loss_is_refused_once_the_loss_on_the_page_is_edited(monkeypatch):
    """The fused kernel computes model.py's cross_entropy as written: asked for while that function computes
    something else (label smoothing), the model refuses it, rather than train what the page no longer says."""
    import model
    config = tiny_model().config
    assert ModernBERT(config, loss="fused").loss == "fused"  # the page's own loss: the kernel computes it
    plain = model.cross_entropy
    monkeypatch.setattr(model, "cross_entropy", lambda h, w, b, y: plain(h, w, b, y) + 0.0 * h.sum())
    ModernBERT(config, loss="fused")  # the same numbers however written
    smoothed = lambda h, w, b, y: F.cross_entropy(F.linear(h, w, b).float(), y, label_smoothing=0.1)  # noqa: E731
    monkeypatch.setattr(model, "cross_entropy", smoothed)
    with pytest.raises(InputError, match=r"^loss=fused computes model.py's cross_entropy as first written.*"
                                         r"--loss=plain"):
        ModernBERT(config, loss="fused")


@pytest.mark.parametrize("loss", LOSSES)
def test_training_gradients_match_transformers(tmp_path, loss):
    """Sparse prediction with either loss gives the gradients of the dense HF loss."""
    hf = hf_checkpoint(tmp_path, SHAPES[0])
    hf.train()
    ours = ModernBERT.from_pretrained(str(tmp_path)).train()
    ours.loss = loss
    ids, mask = padded_batch(300)
    labels = ids.clone()
    labels[torch.rand(ids.shape, generator=torch.Generator().manual_seed(5)) > 0.3] = IGNORE_INDEX
    labels[mask == 0] = IGNORE_INDEX
    hf(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    ours(ids, mask, labels=labels)[1].backward()
    theirs = dict(hf.named_parameters())
    for name, p in ours.named_parameters():
        assert (p.grad - theirs[name].grad).abs().max().item() <= 1e-5, name


@pytest.mark.gpu
def test_backends_agree_in_bf16_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = tiny().cuda()
    ids, mask = padded_batch(256, T=512, lengths=(512, 300, 100))
    ids, mask = ids.cuda(), mask.cuda()
    outs = {}
    for backend in ["sdpa", "flex"] + (["flash"] if kernels.flash_attn_varlen_func else []):
        model.backend = backend
        for causal in (False, True):
            with torch.no_grad(), torch.autocast("cuda", torch.bfloat16):
                outs[backend, causal] = model(ids, mask, causal=causal)[0].float()
    for (backend, causal), out in outs.items():
        diff = (out - outs["sdpa", causal])[mask.bool()].abs().max().item()
        print(f"{backend} causal={causal}: max |logit diff| vs sdpa = {diff:.4f}")
        assert diff <= 0.05 * outs["sdpa", causal].abs().max().item()


def test_hub_id_without_network_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no network here; where there is one, offline mode says the same
    with pytest.raises(InputError, match="could not fetch 'answerdotai/ModernBERT-base'.*local directory"):
        ModernBERT.from_pretrained("answerdotai/ModernBERT-base")


@pytest.mark.slow
def test_compiled_loss_chunk_matches_eager():
    """On CUDA the loss chunk runs compiled (one fused pass); inductor's CPU backend checks the same graph here."""
    from machinery.kernels import _chunk_loss_and_grad
    compiled = torch.compile(_chunk_loss_and_grad, dynamic=True)
    g = torch.Generator().manual_seed(0)
    for rows in (37, 64):  # dynamic shapes: the last chunk of a batch is shorter
        z = torch.randn(rows, 1000, generator=g)
        target = torch.randint(0, 1000, (rows,), generator=g)
        valid = (torch.rand(rows, generator=g) > 0.3).float()
        eager = _chunk_loss_and_grad(z.clone(), target, True)
        fused = compiled(z.clone(), target, True)
        eager, fused = ((loss @ valid, grad) for loss, grad in (eager, fused))  # the summed loss of the valid rows
        assert abs(eager[0].item() - fused[0].item()) <= 1e-5 * abs(eager[0].item())
        assert (eager[1] - fused[1]).abs().max().item() <= 1e-7
