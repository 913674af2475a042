"""Test and benchmark utilities (no SGLang import): the seed-0 tiny hybrid model written to a
temporary directory once per process (:func:`tiny_model_dir`), launching SGLang servers as
subprocesses (:mod:`.server`) and the seeded tiny target + draft pair of the speculative tests
(:mod:`.spec_pair`)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from typing import Optional

_tiny_dir: Optional[str] = None


def tiny_model_dir() -> str:
    """The tiny hybrid model directory (seed 0: the weights every test and benchmark compares
    against), built on first use in a temporary directory removed when the process exits.
    Read-only for callers: whoever needs other weights builds its own."""
    global _tiny_dir
    if _tiny_dir is None:
        from sglang_mamba_ext.models.tiny_builder import build_tiny_model

        root = tempfile.mkdtemp(prefix="mamba-ext-tiny-")
        atexit.register(shutil.rmtree, root, True)
        _tiny_dir = build_tiny_model(os.path.join(root, "tiny"), seed=0)
    return _tiny_dir
