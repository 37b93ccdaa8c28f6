"""The code against ruff.toml: `ruff check .` finds nothing (unused imports and names, imports out of place, lambdas
named), so that every `# noqa` in the code is one that configuration reads."""
import shutil
import subprocess

import pytest
from conftest import ROOT


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or pytest.skip("ruff is not installed (pip install -r tests/requirements.txt)")
    result = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
