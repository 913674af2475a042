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
import tempfile
import threading
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

_PROGRESS = {"t0": time.time(), "cls": None, "reporter": None, "capture": None, "file": None, "worker": None}

#: Test classes that start several servers each (TP/DP ranks, a PD pair, router replicas):
#: under ``-n 2`` they form one work unit, run one after another on one worker, so two of
#: them never hold their servers at once (about 9 GB each) and the largest unit of work is
#: handed out first.
#: ``SGLANG_MAMBA_EXT_FULL_SUITE=1``: also the classes left out of the default run for its time
#: budget (docs/testing.md, "The full suite"); each is a second class on plugin paths another
#: class of the default run covers, or a slow interpreted re-run of what a faster test checks.
FULL_SUITE = os.environ.get("SGLANG_MAMBA_EXT_FULL_SUITE") == "1"


def full_suite_only(why: str):
    """Class decorator: skip the class unless :data:`FULL_SUITE` (``why`` names what covers
    its paths in the default run). A subclass that should run by default sets
    ``__unittest_skip__ = False``."""
    return unittest.skipUnless(FULL_SUITE, f"{why}; left out of the default run for the suite's budget "
                                           "(docs/testing.md): SGLANG_MAMBA_EXT_FULL_SUITE=1 runs it")


#: Unit-test classes of a minute or more (Triton-interpreter re-runs, the GPU checks' CPU modes,
#: the family build): handed out first among the unit tests, so the short ones fill the end.
LONG_UNITS = ("TestUnderTritonInterpreter", "TestGpuCheckTinyMode", "TestMakeTinyArch", "TestCpuKernelsUnderInterpreter",
              "TestStartupErrorsLikeArgparse", "TestMamba2GpuCheckTinyMode", "TestEntryPoint",
              "TestNoSideEffectsWithoutFlags")

HEAVY_MODULES = ("test_multi_rank_serving.py", "test_pd_decode_cache.py", "test_pd_faults.py", "test_pd_role_switch.py",
                 "test_pd_serving.py",
                 "test_router_replicas.py")


def progress(message: str) -> None:
    """One line ``[tests +MM:SS] message`` on the terminal, also under ``-q``, output
    capture and ``-n`` workers: which class runs, which server starts and when it is ready,
    so a person can follow a long run (``scripts/run_tests.sh``). A pytest-xdist worker
    appends the line, tagged with its name, to a file the controller prints as it grows
    (workers have no terminal)."""
    elapsed = int(time.time() - _PROGRESS["t0"])
    tag = f" {_PROGRESS['worker']}" if _PROGRESS["worker"] else ""
    line = f"[tests +{elapsed // 60:02d}:{elapsed % 60:02d}{tag}] {message}"
    if _PROGRESS["file"] and _PROGRESS["worker"]:
        with open(_PROGRESS["file"], "a") as f:
            f.write(line + "\n")
        return
    _terminal_line(line)


def _terminal_line(line: str) -> None:
    reporter, capture = _PROGRESS["reporter"], _PROGRESS["capture"]
    if reporter is None or capture is None:
        print(line, file=sys.stderr, flush=True)
        return
    with capture.global_and_fixture_disabled():  # output capture would swallow it
        if getattr(reporter._tw, "width_of_current_line", 0):  # after -q's dots
            reporter.write("\n")
        reporter.write_line(line)


#: the directory one test run's workers share (:func:`shared_build`), made by the controller
_SHARED = {"dir": None, "owner": False}


def _shared_dir() -> str:
    if _SHARED["dir"] is None:  # outside pytest (python -m unittest): this process only
        import atexit
        import shutil

        _SHARED["dir"] = tempfile.mkdtemp(prefix="mamba-ext-shared-")
        atexit.register(shutil.rmtree, _SHARED["dir"], True)
    return _SHARED["dir"]


def shared_build(key: str, build) -> str:
    """A directory built once per test run and shared by its workers: ``build(path)`` fills a
    fresh directory the first time ``key`` is asked for (under a file lock, so a second
    worker waits for it instead of building it again); later calls, in any worker, return the
    finished directory. Used for what several classes build alike (the MTP pairs and their
    plain servers' outputs, ``tests/e2e/test_mtp_spec_serving.py``, ``tests/test_mtp_tiny.py``).
    Removed when the run ends."""
    import fcntl

    root = _shared_dir()
    path = os.path.join(root, key)
    done = os.path.join(path, ".built")
    if os.path.exists(done):
        return path
    with open(os.path.join(root, key + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(done):
            tmp = tempfile.mkdtemp(prefix=key + "-building-", dir=root)
            build(tmp)
            open(os.path.join(tmp, ".built"), "w").close()
            os.rename(tmp, path)
    return path


def mtp_pair(arch: str):
    """``(target dir, draft dir, the script's stdout)``: the tiny ``arch`` checkpoint and its
    MTP draft as ``scripts/make_tiny_model.py --arch ARCH --out T --draft-out D`` writes them
    (seed 0), built once per test run (:func:`shared_build`)."""
    import subprocess

    def build(path):
        proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "make_tiny_model.py"), "--arch", arch,
                               "--out", os.path.join(path, "target"), "--draft-out", os.path.join(path, "draft")],
                              capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"building the {arch} MTP pair failed: {proc.stderr[-3000:]}")
        with open(os.path.join(path, "build.out"), "w") as f:
            f.write(proc.stdout)

    path = shared_build(f"mtp-pair-{arch}", build)
    with open(os.path.join(path, "build.out")) as f:
        return os.path.join(path, "target"), os.path.join(path, "draft"), f.read()


def tiny_arch(arch: str) -> str:
    """The tiny checkpoint of SGLang class family ``arch`` (``scripts/make_tiny_model.py --arch``,
    seed 0). Every family of ``models/hf_tiny.py::ARCHS`` is built the first time any is asked
    for, in one subprocess (one transformers import, :func:`build_hf_tiny_models`), once per
    test run (:func:`shared_build`), for the family, differential and build tests alike."""
    from sglang_mamba_ext.models.hf_tiny import ARCHS, build_hf_tiny_models

    path = shared_build("tiny-archs", lambda d: build_hf_tiny_models({a: os.path.join(d, a) for a in ARCHS}))
    return os.path.join(path, arch)


def _relay_worker_progress(path: str, stop: threading.Event) -> None:
    """Controller side of ``-n``: print the workers' progress lines as they arrive."""
    with open(path, "a+") as f:
        f.seek(0)
        pending = ""
        while True:
            chunk = f.read()
            pending += chunk
            *lines, pending = pending.split("\n")
            for line in lines:
                _terminal_line(line)
            if not chunk:
                if stop.is_set():
                    return
                stop.wait(1.0)


def pytest_configure(config):
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:  # a pytest-xdist worker: the controller's file and clock
        _PROGRESS["file"] = workerinput.get("mamba_ext_progress")
        _PROGRESS["t0"] = workerinput.get("mamba_ext_t0", _PROGRESS["t0"])
        _PROGRESS["worker"] = workerinput.get("workerid")
        _SHARED["dir"] = workerinput.get("mamba_ext_shared")
        return
    _SHARED["dir"], _SHARED["owner"] = tempfile.mkdtemp(prefix="mamba-ext-shared-"), True
    if getattr(config.option, "numprocesses", None):
        fd, path = tempfile.mkstemp(prefix="mamba-ext-progress-", suffix=".log")
        os.close(fd)
        _PROGRESS["file"] = path
        stop = threading.Event()
        thread = threading.Thread(target=_relay_worker_progress, args=(path, stop), daemon=True)
        _PROGRESS["relay"] = (thread, stop)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """pytest-xdist (controller): hand each worker the progress file and the start time."""
    node.workerinput["mamba_ext_progress"] = _PROGRESS["file"]
    node.workerinput["mamba_ext_t0"] = _PROGRESS["t0"]
    node.workerinput["mamba_ext_shared"] = _SHARED["dir"]


def pytest_sessionstart(session):
    if not _PROGRESS["worker"]:
        _PROGRESS["t0"] = time.time()
    _PROGRESS["reporter"] = session.config.pluginmanager.get_plugin("terminalreporter")
    _PROGRESS["capture"] = session.config.pluginmanager.get_plugin("capturemanager")
    relay = _PROGRESS.get("relay")
    if relay:
        relay[0].start()


def pytest_sessionfinish(session):
    if _SHARED["owner"] and _SHARED["dir"]:
        import shutil

        shutil.rmtree(_SHARED["dir"], ignore_errors=True)
    relay = _PROGRESS.pop("relay", None)
    if relay:
        relay[1].set()
        relay[0].join(timeout=10)
        os.unlink(_PROGRESS["file"])


def pytest_runtest_setup(item):
    """Name each test class as it starts (its servers start in its ``setUpClass``)."""
    cls = getattr(item, "cls", None)
    if cls is not None and cls is not _PROGRESS["cls"]:
        _PROGRESS["cls"] = cls
        progress(f"{os.path.relpath(str(item.fspath), REPO)}::{cls.__name__}")


def _work_unit(nodeid: str) -> str:
    """The ``-n`` work unit of a test: ``heavy-servers`` for the :data:`HEAVY_MODULES`,
    otherwise its class (``path::Class``) or, for a plain function, its module."""
    path = nodeid.split("::", 1)[0]
    if os.path.basename(path) in HEAVY_MODULES:
        return "heavy-servers"
    parts = nodeid.split("::")
    return "::".join(parts[:2]) if len(parts) > 2 else path


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist (controller) under ``--dist loadscope``: its scope scheduler with
    :func:`_work_unit` as the unit, so each test class's ``setUpClass`` servers start once,
    on one worker, and the multi-server classes run one after another."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class SuiteScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

    return SuiteScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    """Refuse an unmarked server test (everything under ``tests/e2e`` carries ``e2e``), and
    order the work for ``-n``: the :data:`HEAVY_MODULES` first, then the other server
    classes, then the :data:`LONG_UNITS`, then the rest (each part in its own order), so the
    longest units are handed out first and the short ones fill the end."""
    unmarked = [
        item.nodeid
        for item in items
        if os.path.abspath(str(item.fspath)).startswith(E2E_DIR + os.sep) and item.get_closest_marker("e2e") is None
    ]
    if unmarked:
        raise pytest.UsageError("tests under tests/e2e must be marked e2e: " + ", ".join(unmarked))

    def rank(item):
        if _work_unit(item.nodeid) == "heavy-servers":
            return 0
        if item.get_closest_marker("e2e") is not None:
            return 1
        cls = getattr(item, "cls", None)
        return 2 if cls is not None and cls.__name__ in LONG_UNITS else 3

    items.sort(key=rank)  # stable


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
