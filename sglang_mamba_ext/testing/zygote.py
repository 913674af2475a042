"""Test harness only: SGLang launches forked from a process that has already imported SGLang
(a "zygote", as Android starts its apps), so a test server's start-up skips its imports.

Why: on the 2-core test machine a tiny-model start-up is almost all Python imports (about 15 s
idle and 25 s or more loaded in the launcher, as much again in SGLang's spawned workers); the
model, pools, tree and HTTP server take 2-4 s (docs/testing.md, "Forked servers"). A zygote
imports ``sglang.launch_server`` and ``sglang.srt.entrypoints.http_server`` once (a zygote of
server launches also runs SGLang's plugin loading, which imports the hook targets' modules),
then forks one child per launch. The child runs ``sglang.launch_server`` as ``__main__``
(SGLang's argument hooks run in it as in a user's launch; its plugin loading finds the
plugins loaded) with SGLang's worker processes forked from it (:mod:`.fork_launch`), so they
inherit the imports too.

A zygote serves one environment: the launch's environment less the variables read only when
SGLang or the plugin acts (:data:`LATE_ENV`, which the child sets after the fork), including
what the plugin's CPU defaults read at import (:func:`.fork_launch.import_time_env`). A
launch with another environment gets its own zygote, so every variable read at import is set
before anything imports.

Client side (the test process): :func:`launch` returns a :class:`ForkedProcess`, a
``subprocess.Popen``-like handle (``pid``, ``poll``, ``wait``, ``returncode``) of the child,
which leads its own session (kill its process group to stop the server). The zygote reaps
its children and reports each exit status.

Protocol (one JSON object per line): the zygote writes ``{"ready": ...}`` once imported; then
for each request ``{"module": name, "args": [...], "log": path, "err": path or null, "cwd":
dir, "late_env": {...}}`` on its stdin it forks and answers ``{"pid": N}``. It writes a child's exit status (``subprocess`` convention: negative
for a signal) to ``<state_dir>/<pid>.exit``, and exits at end of input.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

#: Variables left out of a zygote's environment: pytest's name of the running test changes
#: with every test, and no launch reads it.
PER_TEST_ENV = ("PYTEST_CURRENT_TEST",)

#: Variables a launch sets in its forked child, after the fork, instead of in the zygote's
#: environment, so launches that differ only in them share a zygote (each new zygote is one
#: import of SGLang: 25-50 s on the 2-core machine). Only variables read when SGLang or the
#: plugin acts, never at import or while the plugins register: SGLang's idle checks
#: (``invariant_checker.py``) and PD timeouts (``disaggregation/common/conn.py``), read through
#: ``envs.X.get()`` at the call; the conv-state dtype (``configs/mamba_utils.py``, at pool
#: sizing); and the plugin's switches (:data:`LATE_ENV_PREFIX`, read at argument parsing or
#: later; :data:`EARLY_PLUGIN_ENV` excepted).
LATE_ENV = (
    "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE", "SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK",
    "SGLANG_DISAGGREGATION_WAITING_TIMEOUT", "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT",
    "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", "SGLANG_MAMBA_CONV_DTYPE",
    "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION",  # http_server.py's /health handler, per request
    "SGLANG_OPT_USE_INKLING_FUSED_ATTN_PROLOGUE",  # models/inkling.py, at the layer's call
)
LATE_ENV_PREFIX = "SGLANG_MAMBA_EXT_"
#: The plugin's variables read at import (``benchmarks/common.py``'s trace path).
EARLY_PLUGIN_ENV = ("SGLANG_MAMBA_EXT_TRACE",)


def is_late(name: str) -> bool:
    """Whether variable ``name`` is set in the forked child rather than in the zygote
    (:data:`LATE_ENV`)."""
    return name in LATE_ENV or (name.startswith(LATE_ENV_PREFIX) and name not in EARLY_PLUGIN_ENV)

#: Zygotes kept per test process (each holds an imported SGLang: about 1.1 GB of RSS, most of
#: it shared libraries); the least recently used idle one goes first.
MAX_ZYGOTES = 4


# ---------------------------------------------------------------------------------------------
# The zygote process: ``python -m sglang_mamba_ext.testing.zygote STATE_DIR``
# ---------------------------------------------------------------------------------------------


def _preload(plugins: bool) -> None:
    """What every launch does before it reads its arguments: SGLang's imports and, for the
    zygotes of server launches (``plugins``), its plugin loading."""
    import sglang.launch_server  # noqa: F401
    import sglang.srt.entrypoints.http_server  # noqa: F401

    if not plugins:  # a zygote of other modules (test files run under Triton's interpreter)
        return
    # SGLang's plugin loading (idempotent: a process loads them once). Applying the hooks
    # walks every imported module once per hook target to re-point ``from X import Y``
    # copies (``hook_registry.py::_propagate_patch``): about 5-7 s per launch on the test
    # machine, paid here once. Same as in the child: the zygote has the launch's environment
    # but for LATE_ENV (none read by the plugins' registration), and the registration reads
    # no command line.
    from sglang.srt.plugins import load_plugins

    load_plugins()


def _child(request: dict, close_fds: Sequence[int]) -> None:
    """In the forked child: become a session leader writing to the request's log, then run
    SGLang's launcher. Never returns."""
    code = 1
    try:
        os.setsid()
        for fd in close_fds:
            os.close(fd)
        for fd, path in ((1, request["log"]), (2, request.get("err") or request["log"])):
            out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(out, fd)
            os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        late = request.get("late_env") or {}
        for name in [n for n in os.environ if is_late(n) and n not in late]:
            del os.environ[name]
        os.environ.update(late)
        os.chdir(request["cwd"])
        sys.path[0] = request["cwd"]  # as ``python -m`` started there would have it
        sys.argv = [request["module"], *request["args"]]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        # as Python reports an uncaught exception: through ``sys.excepthook`` (the plugin's
        # start-up errors install one that writes argparse's two lines and exits with 2)
        sys.excepthook(*sys.exc_info())
        code = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _report_exits(state_dir: str, children: set) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        tmp = os.path.join(state_dir, f".{pid}.exit")
        with open(tmp, "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.rename(tmp, os.path.join(state_dir, f"{pid}.exit"))


def main(state_dir: str, plugins: bool = False) -> None:
    requests = os.fdopen(os.dup(0), "r")
    answers = os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)  # stray prints go to the zygote's log, not into the answers
    t0 = time.time()
    _preload(plugins)
    ready = {"ready": True, "import_s": round(time.time() - t0, 1), "threads": threading.active_count()}
    os.write(answers, (json.dumps(ready) + "\n").encode())
    children: set = set()
    while True:
        readable, _, _ = select.select([requests], [], [], 0.2)
        _report_exits(state_dir, children)
        if not readable:
            continue
        line = requests.readline()
        if not line:
            break
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, (requests.fileno(), answers))
        children.add(pid)
        os.write(answers, (json.dumps({"pid": pid}) + "\n").encode())
    # End of input: the test process is done; children still running keep running.


# ---------------------------------------------------------------------------------------------
# Client side (no SGLang import)
# ---------------------------------------------------------------------------------------------


class ForkedProcess:
    """A launch forked by a zygote: the ``subprocess.Popen`` subset the test harness uses.
    The process leads its own session (process group id = ``pid``)."""

    def __init__(self, pid: int, zygote: "_Zygote"):
        self.pid = pid
        self.returncode: Optional[int] = None
        #: Why this launch started a new zygote (one SGLang import), or None if it used one.
        self.zygote_started: Optional[str] = None
        self._zygote = zygote

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            path = os.path.join(self._zygote.state_dir, f"{self.pid}.exit")
            if os.path.exists(path):
                with open(path) as f:
                    self.returncode = int(f.read())
            elif self._zygote.proc.poll() is not None and not _exists(self.pid):
                self.returncode = -9  # the zygote is gone and cannot tell; the process is gone
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.time() + timeout
        while self.poll() is None:
            if deadline is not None and time.time() > deadline:
                raise subprocess.TimeoutExpired(f"forked pid {self.pid}", timeout)
            time.sleep(0.05)
        return self.returncode


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class _Zygote:
    def __init__(self, env: Dict[str, str], plugins: bool = False):
        self.state_dir = tempfile.mkdtemp(prefix="mamba-ext-zygote-")
        self.log_path = os.path.join(self.state_dir, "zygote.log")
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "sglang_mamba_ext.testing.zygote", self.state_dir]
                + (["--plugins"] if plugins else []),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env,
                start_new_session=True, text=True, bufsize=1,
            )
        self.lock = threading.Lock()
        self.ready: Optional[dict] = None
        self.children: List[ForkedProcess] = []
        self.last_used = time.time()

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            with open(self.log_path, errors="replace") as f:
                tail = f.read()[-4000:]
            raise RuntimeError(f"the test harness's zygote exited ({self.proc.poll()}):\n{tail}")
        return json.loads(line)

    def start(self, module: str, args: Sequence[str], log_path: str, cwd: str,
              err_path: Optional[str] = None, late_env: Optional[Dict[str, str]] = None) -> ForkedProcess:
        with self.lock:
            if self.ready is None:
                self.ready = self._answer()
            request = {"module": module, "args": list(args), "log": log_path, "err": err_path, "cwd": cwd,
                       "late_env": dict(late_env or {})}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            child = ForkedProcess(self._answer()["pid"], self)
            self.children.append(child)
            self.last_used = time.time()
            return child

    def busy(self) -> bool:
        self.children = [c for c in self.children if c.poll() is None]
        return bool(self.children)

    def close(self) -> None:
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.state_dir, ignore_errors=True)


_zygotes: Dict[tuple, _Zygote] = {}  # key: (plugins, *sorted environment items)
_zygotes_lock = threading.Lock()
_closed_keys: set = set()  # keys of zygotes closed to keep MAX_ZYGOTES


def _start_reason(key: tuple) -> str:
    """Why a zygote was needed for ``key``: the first of its kind, one closed earlier, or the
    variables (names) in which the environment differs from the nearest existing zygote's."""
    if key in _closed_keys:
        return "one closed earlier for MAX_ZYGOTES"
    env = dict(key[1:])
    best = None
    for other in _zygotes:
        if other[0] != key[0]:
            continue
        o = dict(other[1:])
        names = sorted(n for n in set(env) | set(o) if env.get(n) != o.get(n))
        if best is None or len(names) < len(best):
            best = names
    if best is None:
        return "the first of its kind"
    return "environment differs in " + ", ".join(best[:6]) + (" ..." if len(best) > 6 else "")


def start(module: str, args: Sequence[str], env: Dict[str, str], log_path: str,
          cwd: Optional[str] = None, err_path: Optional[str] = None, plugins: bool = False) -> ForkedProcess:
    """``python -m MODULE ARGS`` with environment ``env`` (as :mod:`runpy` runs it), forked
    from the zygote of that environment less its :data:`LATE_ENV` variables, which the child
    sets (the zygote is started on first use: about one import of SGLang),
    writing stdout and stderr to ``log_path`` (appended; stderr to ``err_path`` if given).
    ``plugins``: from a zygote that has loaded SGLang's plugins too (server launches).
    Returns at once.

    Raises:
        RuntimeError: the zygote died (the message carries the end of its log)."""
    late = {k: v for k, v in env.items() if is_late(k)}
    env = {k: v for k, v in env.items() if k not in PER_TEST_ENV and not is_late(k)}
    key = (plugins, *sorted(env.items()))
    with _zygotes_lock:
        zygote = _zygotes.get(key)
        reason = None
        if zygote is None or zygote.proc.poll() is not None:
            reason = "its zygote exited" if zygote is not None else _start_reason(key)
            zygote = _zygotes[key] = _Zygote(dict(env), plugins)
            idle = sorted(((k, z) for k, z in _zygotes.items() if z is not zygote and not z.busy()),
                          key=lambda kz: kz[1].last_used)
            for old_key, old in idle[: max(0, len(_zygotes) - MAX_ZYGOTES)]:
                del _zygotes[old_key]
                _closed_keys.add(old_key)
                old.close()
    child = zygote.start(module, args, log_path, cwd or os.getcwd(), err_path, late)
    child.zygote_started = reason
    return child


def launch(args: Sequence[str], env: Dict[str, str], log_path: str, cwd: Optional[str] = None) -> ForkedProcess:
    """``python -m sglang.launch_server ARGS`` forked from a zygote (:func:`start`), with
    SGLang's worker processes forked from the launcher (:mod:`.fork_launch`). Returns at
    once; the caller waits for ``/health``."""
    return start("sglang_mamba_ext.testing.fork_launch", args, env, log_path, cwd, plugins=True)


def run(module: str, args: Sequence[str], env: Dict[str, str], timeout: float,
        cwd: Optional[str] = None, plugins: bool = False) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` forked from a zygote (:func:`start`), to its end, as
    ``subprocess.run(..., capture_output=True, text=True, timeout=timeout)`` would return it.

    Raises:
        subprocess.TimeoutExpired: not done in ``timeout`` seconds (it is killed first)."""
    import signal

    with tempfile.TemporaryDirectory(prefix="mamba-ext-zygote-run-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = start(module, args, env, out, cwd, err, plugins=plugins)
        try:
            child.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise
        texts = []
        for path in (out, err):
            with open(path, errors="replace") as f:
                texts.append(f.read())
    return subprocess.CompletedProcess([module, *args], child.returncode, *texts)


def run_plugins_loaded(module: str, args: Sequence[str], timeout: float, cwd: Optional[str] = None) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` as :func:`run` gives it, forked from the plugin-loaded zygote
    of the plain test environment (the test process's, this repository first on
    ``PYTHONPATH``, ``SGLANG_PLUGINS`` unset): the tests that each needed a fresh process with
    SGLang imported and the plugins loaded (the start-up error launches, the model and MTP
    load checks) share one SGLang import per test process.

    Raises:
        subprocess.TimeoutExpired: not done in ``timeout`` seconds (it is killed first)."""
    return run(module, list(args), plain_test_env(), timeout=timeout, cwd=cwd or _ROOT, plugins=True)


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def plain_test_env() -> Dict[str, str]:
    """The test process's environment with this repository first on ``PYTHONPATH`` and
    ``SGLANG_PLUGINS`` unset (every installed plugin loads, as for a user)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = _ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SGLANG_PLUGINS", None)
    return env


@atexit.register
def close_all() -> None:
    """Stop every zygote (their children, the servers, are stopped by their owners)."""
    with _zygotes_lock:
        for zygote in _zygotes.values():
            zygote.close()
        _zygotes.clear()


if __name__ == "__main__":
    main(sys.argv[1], plugins="--plugins" in sys.argv[2:])
