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
import sys
import time
import unittest

import pytest

from sglang_mamba_ext.benchmarks.common import TRACE_PATH  # noqa: F401  (one lookup rule)
from sglang_mamba_ext.testing import tiny_model_dir  # noqa: F401  (shared with the benchmarks)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
E2E_DIR = os.path.join(REPO, "tests", "e2e")

#: SGLang is installed (its import is not attempted here). Tests skip only when this is
#: False; with SGLang installed a broken import fails the test that needs it.
SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None


class TraceDriverCase(unittest.TestCase):
    """Base of the tests that replay the first ``N`` records of the shared trace through a
    benchmark driver (one torch thread, as the benchmarks run). Skips without SGLang or the
    trace."""

    N = 120

    @classmethod
    def setUpClass(cls):
        if not (SGLANG_INSTALLED and os.path.isfile(TRACE_PATH)):
            raise unittest.SkipTest("needs SGLang and the trace")
        import torch

        from sglang_mamba_ext.benchmarks.common import load_trace

        torch.set_num_threads(1)
        cls.records = load_trace(limit=cls.N)


def requires_sglang(obj):
    """``unittest.skipUnless`` SGLang is installed (class or test decorator)."""
    return unittest.skipUnless(SGLANG_INSTALLED, "SGLang is not installed")(obj)


# -- pytest hooks and fixtures -------------------------------------------------------------

_PROGRESS = {"t0": time.time(), "cls": None, "reporter": None, "capture": None}


def progress(message: str) -> None:
    """One line ``[tests +MM:SS] message`` on the terminal, also under ``-q`` and output
    capture (pytest's terminal reporter): which class runs, which server starts and when it
    is ready, so a person can follow a long run (``scripts/run_tests.sh``)."""
    elapsed = int(time.time() - _PROGRESS["t0"])
    line = f"[tests +{elapsed // 60:02d}:{elapsed % 60:02d}] {message}"
    reporter, capture = _PROGRESS["reporter"], _PROGRESS["capture"]
    if reporter is None or capture is None:
        print(line, file=sys.stderr, flush=True)
        return
    with capture.global_and_fixture_disabled():  # output capture would swallow it
        if getattr(reporter._tw, "width_of_current_line", 0):  # after -q's dots
            reporter.write("\n")
        reporter.write_line(line)


def pytest_sessionstart(session):
    _PROGRESS["t0"] = time.time()
    _PROGRESS["reporter"] = session.config.pluginmanager.get_plugin("terminalreporter")
    _PROGRESS["capture"] = session.config.pluginmanager.get_plugin("capturemanager")


def pytest_runtest_setup(item):
    """Name each test class as it starts (its servers start in its ``setUpClass``)."""
    cls = getattr(item, "cls", None)
    if cls is not None and cls is not _PROGRESS["cls"]:
        _PROGRESS["cls"] = cls
        progress(f"{os.path.relpath(str(item.fspath), REPO)}::{cls.__name__}")



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


def small_mixer(seed: int = 0):
    """``(shape, mixer)``: a small gated-delta-rule mixer (hidden 32; 2 key / 4 value heads
    of 8 / 12; conv 4) with N(0, 0.3) weights after ``torch.manual_seed(seed)``, the one the
    tiny-model math and backend tests share."""
    import torch

    from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape

    torch.manual_seed(seed)
    shape = LinearAttnShape(num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=12, conv_kernel=4)
    mixer = GatedDeltaRuleMixer(32, shape, gate_low_rank_dim=8)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0, 0.3)
    return shape, mixer
