"""Freezing blocks of layers, frozen meaning unchanged: the paper's interventions freeze blocks 0-7
or 8-14 of the 22-layer base model during the CLM phase, or blocks 0-7 during the decay.

`--freeze=0-7` (also `8-14`, `0,2,5`, `low`, `mid`) names transformer blocks; `embeddings` (alone or
with blocks: `embeddings,0-7`) names the token embeddings and their norm. The embedding matrix is tied
to the output layer (the MLM decoder reads its logits off the same tensor), so freezing the embeddings
freezes the output matrix too; the decoder's bias stays trainable. The trainer zeroes
their gradients after each backward pass (what the paper does) AND tells the optimizer to skip them:
under AdamW, zero gradients alone still move a parameter through its stale moments and the weight
decay, so zeroing alone does not freeze anything.
"""
from machinery.cli import InputError


def parse_layers(spec: str, n_layers: int) -> list:
    """'0-7' | '8-14' | '0,2,5' | 'low' (first third) | 'mid' (second third) | '' (none) -> sorted
    block indices; 'embeddings' among the parts puts "embeddings" first."""
    spec = spec.strip()
    parts = [p.strip() for p in spec.split(",")]
    if "embeddings" in parts:
        rest = ",".join(p for p in parts if p != "embeddings")
        return ["embeddings"] + parse_layers(rest, n_layers)
    third = round(n_layers / 3)  # 22 layers: low = 0-7, mid = 8-14, as in the paper
    presets = {"": [], "none": [], "low": range(0, third + 1),
               "mid": range(third + 1, 2 * third + 1)}
    if spec in presets:
        blocks = list(presets[spec])
        if spec in ("low", "mid") and (not blocks or blocks[-1] >= n_layers):  # 1 or 2 blocks: no middle third
            raise InputError(f"--freeze={spec}: a model of {n_layers} block(s) has no {spec} third to freeze; "
                             f"name its blocks (0-{n_layers - 1})")
        return blocks
    layers = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise InputError(f"--freeze={spec!r}: expected block ranges like 0-7, 8-14 or 0,2,5, "
                             f"or low / mid, and optionally embeddings") from None
        if first > last:
            raise InputError(f"--freeze={spec!r}: {part.strip()!r} runs backwards; expected FIRST-LAST with "
                             f"FIRST <= LAST")
        if not 0 <= first <= last < n_layers:
            raise InputError(f"--freeze={spec!r}: {part.strip()!r} is outside the model's blocks "
                             f"0-{n_layers - 1}")
        layers.update(range(first, last + 1))
    return sorted(layers)


def frozen_names(model, layers) -> set:
    """Names of every parameter inside the given blocks (`model.layers.{i}.*`), and of the embeddings
    (`model.embeddings.*`) when "embeddings" is among them. named_parameters() yields the tied matrix once,
    under the embeddings' name: frozen there, the decoder's weight is frozen with it."""
    prefixes = tuple("model.embeddings." if i == "embeddings" else f"model.layers.{i}." for i in layers)
    return {name for name, _ in model.named_parameters() if name.startswith(prefixes)}


def zero_frozen_grads(model, names) -> None:
    """Called after each backward pass (after the DDP all-reduce): frozen blocks get no gradient."""
    if not names:
        return
    for name, p in model.named_parameters():
        if name in names and p.grad is not None:
            p.grad.zero_()
