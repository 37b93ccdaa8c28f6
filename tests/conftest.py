"""Shared test helpers: the repository root on sys.path, and where the real data lives."""
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Real data is never copied into the repository: tests read it from ../shared beside the checkout.
SHARED = ROOT.parent / "shared"
SHARED_DATA = SHARED / "data"
MODERNBERT_TOKENIZER = SHARED / "tokenizers" / "modernbert" / "tokenizer.json"


def need(path: Path) -> Path:
    """Return `path`, or skip the test with a reason that names the missing file."""
    if not path.exists():
        pytest.skip(f"needs {path} (real data lives in ../shared beside the checkout; absent here)")
    return path
