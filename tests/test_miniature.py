"""The README's "paper in miniature", run as a reader copies it: the quick start's `python train.py`, then the
section's bash block word for word (only `python X.py` pointed at this checkout), one thread, in a scratch folder.
Every loss, CKA figure and fill-mask answer the section prints must be what these runs give (wall times are
measured and dated, not checked). About 10 minutes on 2 idle cores: `python -m pytest -m slow -k miniature`."""
import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from machinery.progress import validations
from machinery.tokenfiles import load_meta

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SECTION = README[README.index("### The paper in miniature"):README.index("## Common paths")]
PROSE = " ".join(SECTION.split())  # its sentences, line breaks aside


def commands():
    """The section's bash block, its scripts called from this checkout by this interpreter."""
    block = SECTION[SECTION.index("```bash\n") + 8:]
    block = block[:block.index("\n```")]
    block = re.sub(r"\bpython (\w+\.py)", lambda m: f"{sys.executable} {ROOT / m[1]}", block)
    return block.replace("python -c", f"{sys.executable} -c")


def val(run, which=-1):
    return validations(run / "log.jsonl")[which]


def row(name):
    """The last cell of the section's table row that starts with `name`."""
    return next(line for line in SECTION.splitlines() if line.startswith(f"| {name}")).rstrip(" |").split(" | ")[-1]


def two(*runs, which=-1):
    """Validation MLM / CLM of runs, as the table writes them: "m1, m2 / c1, c2" at 2 decimals."""
    records = [val(r, which) for r in runs]
    return " / ".join(", ".join(f"{r[k]:.2f}" for r in records) for k in ("val_mlm", "val_clm"))


def test_the_paper_in_miniature_gives_the_readmes_figures(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, str(ROOT / "train.py")], cwd=tmp_path, env=env, check=True, capture_output=True)
    done = subprocess.run(["bash", "-ec", commands()], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "out"
    code = out / "code-clm"

    start = f"{two(out / 'demo-mlm')} on docstrings; {two(code, which=0)} on the code"
    assert row("start model").startswith(start)
    assert row("`data.py code`") == "-" and f"({load_meta(tmp_path / 'data/code')['splits']['train']['tokens'] / 1000:.0f}k " \
        f"training tokens; {len((tmp_path / 'data/code-heldout.jsonl').read_text().splitlines())} held-out texts)" \
        in SECTION
    assert row("CLM detour") == two(code) and row("MLM twin") == two(out / "code-mlm")
    seeds = [out / f"code-mlm-seed{s}" for s in (18, 19, 20)]
    assert row("3 seed controls") == two(*seeds)
    decays = [out / f"code-{r}-decay" for r in ("mlm-seed18", "mlm-seed19", "mlm-seed20")]
    assert row("5 decays") == (f"detour {two(out / 'code-clm-decay')}; twin {two(out / 'code-mlm-decay')}; "
                               f"controls {two(*decays)}")

    # the prose under the table: the detour's curve, the decays' gaps
    first, fifty = val(code, 0), next(r for r in validations(code / "log.jsonl") if r["step"] == 50)
    assert (f"climbs from {first['val_mlm']:.2f} to {fifty['val_mlm']:.2f} in its first 50 steps and to "
            f"{val(code)['val_mlm']:.2f} at the end, while its CLM loss falls from {first['val_clm']:.2f} to "
            f"{val(code)['val_clm']:.2f}") in PROSE
    mlm_decays = [val(r)["val_mlm"] for r in (out / "code-mlm-decay", *decays)]
    detour = val(out / "code-clm-decay")["val_mlm"]
    assert f"{detour - mlm_decays[0]:.2f} above the twin's decay ({mlm_decays[0]:.2f})" in PROSE
    assert f"end within {max(mlm_decays) - min(mlm_decays):.2f} of each other" in PROSE

    cka = json.loads((out / "code-cka.json").read_text())
    divergence, ratio = cka["divergence"], cka["ratio"]["mean"]
    own = cka["controls"]["divergence"][0]  # the control that shares the twin's run
    outside = [i for i, o in enumerate(cka["band"]["outside"]) if o]
    inside = [i for i, o in enumerate(cka["band"]["outside"]) if not o]
    assert (f"is {min(divergence):.2f} to {max(divergence):.2f} per block, {min(ratio):.1f} to {max(ratio):.1f} "
            f"times that of the seed control") in PROSE
    assert f"seed: {min(own):.3f} to {max(own):.3f})" in PROSE
    assert (f"above the band's bound in blocks {' and '.join(map(str, outside))} and not in blocks "
            f"{' and '.join(map(str, inside))}") in PROSE

    answers = dict(re.findall(r"^(out/\S+) (\[.*\])$", done.stdout, re.M))  # the fill-mask line of each model
    for model in ("demo-mlm", "code-mlm-decay", "code-clm-decay"):
        tokens = ", ".join(token.strip() for token in ast.literal_eval(answers[f"out/{model}"]))
        assert f"({tokens})" in PROSE, (model, tokens)
