"""What the test modules share: whether SGLang is installed, the tiny model directory,
the shared trace's path, and the ``e2e`` / ``slow`` markers (registered in ``pytest.ini``,
strict).

The tests are ``unittest.TestCase`` classes; they use the plain names below
(``from conftest import requires_sglang, tiny_model_dir``; pytest puts ``tests/`` on
``sys.path`` for this file and the modules beside it). The pytest fixtures at the end
give the same things to pytest-style code.

Markers: every test that starts an SGLang server is ``e2e`` (all of ``tests/e2e``; a
collection check below refuses an unmarked one), tests over ~30 s on 2 cores are ``slow``.
``scripts/run_tests.sh`` runs everything; ``scripts/run_tests.sh -m "not e2e and not slow"``
the fast part.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import unittest
from typing import Optional

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E2E_DIR = os.path.join(REPO, "tests", "e2e")

#: SGLang is installed (its import is not attempted here). Tests skip only when this is
#: False; with SGLang installed a broken import fails the test that needs it.
SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None

#: The shared multi-turn trace (``<repo>/../shared/bench/``, or ``$SGLANG_MAMBA_EXT_TRACE``).
TRACE_PATH = os.environ.get(
    "SGLANG_MAMBA_EXT_TRACE",
    os.path.normpath(os.path.join(REPO, "..", "shared", "bench", "multiturn-trace-v1.jsonl.gz")),
)


def requires_sglang(obj):
    """``unittest.skipUnless`` SGLang is installed (class or test decorator)."""
    return unittest.skipUnless(SGLANG_INSTALLED, "SGLang is not installed")(obj)


_tiny_dir: Optional[str] = None


def tiny_model_dir() -> str:
    """The tiny hybrid model directory (seed 0: the weights every test compares against),
    built on first use in a temporary directory removed when the test process exits.
    Read-only for callers: a test that needs other weights builds its own."""
    global _tiny_dir
    if _tiny_dir is None:
        import atexit

        from sglang_mamba_ext.models.tiny_builder import build_tiny_model

        root = tempfile.mkdtemp(prefix="tests-tiny-")
        atexit.register(shutil.rmtree, root, True)
        _tiny_dir = build_tiny_model(os.path.join(root, "tiny"), seed=0)
    return _tiny_dir


# -- pytest hooks and fixtures -------------------------------------------------------------


def pytest_collection_modifyitems(config, items):
    """Refuse an unmarked server test: everything under ``tests/e2e`` carries ``e2e``."""
    unmarked = [
        item.nodeid
        for item in items
        if os.path.abspath(str(item.fspath)).startswith(E2E_DIR + os.sep) and item.get_closest_marker("e2e") is None
    ]
    if unmarked:
        raise pytest.UsageError("tests under tests/e2e must be marked e2e: " + ", ".join(unmarked))


@pytest.fixture(scope="session")
def tiny_model() -> str:
    """:func:`tiny_model_dir` as a fixture."""
    return tiny_model_dir()


@pytest.fixture(scope="session")
def trace_path() -> str:
    """:data:`TRACE_PATH`; skips when the trace file is absent."""
    if not os.path.isfile(TRACE_PATH):
        pytest.skip(f"shared trace not found at {TRACE_PATH}")
    return TRACE_PATH
