"""Start and stop ``python -m sglang.launch_server`` as a subprocess, for end-to-end tests and
the serving benchmark. Imports nothing from SGLang (it runs SGLang in a child process).

The server runs in its own process group and is always killed as a group (SGLang's
scheduler and detokenizer children rename themselves, so killing by name misses them).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Dict, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


#: Ports handed out by :func:`free_port`: under SGLang's own pick for ports bound later
#: (``get_free_port_below_ephemeral``, 22000-29999), under the kernel's ephemeral range
#: (32768+), and around Mooncake's RPC/TCP ports (15000-17000, seen listening in the PD
#: servers), so no port the servers pick for themselves can take one between the pick and
#: the server's bind (a 60 s start-up window on a loaded machine).
PORT_RANGES = ((12000, 14999), (17001, 21999))

#: Log lines that mean the server could not bind its HTTP port (it does not always exit:
#: uvicorn's shutdown can hang for minutes).
BIND_FAILURES = ("address already in use", "error while attempting to bind")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 and 0.0.0.0 right now, from :data:`PORT_RANGES`
    (falls back to one the kernel picks when 64 random tries there are taken)."""
    candidates = [p for lo, hi in PORT_RANGES for p in range(lo, hi + 1)]
    for port in random.sample(candidates, 64):
        try:
            for host in ("0.0.0.0", "127.0.0.1"):
                with socket.socket() as s:
                    s.bind((host, port))
            return port
        except OSError:
            continue
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model_dir(path: Optional[str] = None, seed: int = 0) -> str:
    """The tiny hybrid model directory, built on first use (no download).

    Args:
        path: where to keep it (default ``<repo>/.tiny_model``, or ``$TINY_MODEL_DIR``).
        seed: weight seed when it has to be built.
    """
    from sglang_mamba_ext.models.tiny_builder import build_tiny_model

    path = path or os.environ.get("TINY_MODEL_DIR") or os.path.join(REPO, ".tiny_model")
    if os.path.isfile(os.path.join(path, "config.json")):
        return path
    if os.path.isdir(path):  # left half-written by an older version: rebuild in place
        build_tiny_model(path, seed=seed)
        return path
    # Built beside it and renamed in one step, so a concurrent reader (another test worker)
    # never sees a directory with config.json but not yet the weights.
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tiny_model-build-", dir=parent)
    try:
        build_tiny_model(tmp, seed=seed)
        os.rename(tmp, path)
    except OSError:
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after the rename; the loser's copy otherwise
    return path


class ServerProcess:
    """One SGLang server subprocess.

    Args:
        model_path: ``--model-path``.
        flags: extra launch flags (after ``--model-path --host --port``).
        env: environment overrides (a ``None`` value removes the variable).
        start_timeout_s: seconds to wait for ``/health``.
        log_path: where the server's stdout/stderr go (default: a temp file).
        fork: fork the launch from a process that has imported SGLang already
            (:mod:`sglang_mamba_ext.testing.zygote`; SGLang's workers forked from it too,
            :mod:`sglang_mamba_ext.testing.fork_launch`): a start-up of a few seconds instead
            of 30-60 s on the 2-core machine; the test suite's default, ``docs/testing.md``.

    Use as a context manager, or call :meth:`start` / :meth:`stop`.

    Raises:
        RuntimeError (from :meth:`start`): the server exited or was not healthy in time;
            the message carries the end of its log.
    """

    def __init__(
        self,
        model_path: str,
        flags: Sequence[str] = (),
        env: Optional[Dict[str, Optional[str]]] = None,
        start_timeout_s: float = 300.0,
        log_path: Optional[str] = None,
        fork: bool = False,
    ):
        self.model_path = model_path
        self.flags = list(flags)
        self.env_overrides = dict(env or {})
        self.start_timeout_s = start_timeout_s
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
            os.close(fd)
        self.log_path = log_path
        self.fork = fork
        self.proc = None  # subprocess.Popen, or zygote.ForkedProcess with fork
        self.startup_s: Optional[float] = None

    def launch_args(self) -> list:
        """The arguments of ``sglang.launch_server`` (model, host, port, flags)."""
        return ["--model-path", self.model_path, "--host", "127.0.0.1", "--port", str(self.port), *self.flags]

    def command(self) -> list:
        """The spawned launch's command line."""
        return [sys.executable, "-m", "sglang.launch_server", *self.launch_args()]

    def start(self, bind_attempts: int = 3) -> "ServerProcess":
        """Launch the server and wait for ``/health``. If its HTTP port was taken meanwhile
        (the log says so), it is stopped and relaunched on a fresh port, up to
        ``bind_attempts`` launches; ``port``/``base_url`` then name the new port and the log
        keeps every attempt."""
        for attempt in range(bind_attempts):
            if attempt:
                self.port = free_port()
                self.base_url = f"http://127.0.0.1:{self.port}"
            if self._launch(append_log=attempt > 0):
                return self
        raise RuntimeError(f"server could not bind a port in {bind_attempts} launches:\n{self.log_tail()}")

    def launch_env(self) -> Dict[str, str]:
        """The launch's environment: the test process's, this repository first on
        ``PYTHONPATH``, ``PYTHONUNBUFFERED=1`` unless set, then the overrides."""
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("PYTHONUNBUFFERED", "1")
        for key, value in self.env_overrides.items():
            if value is None:
                env.pop(key, None)
            else:
                env[key] = value
        return env

    @staticmethod
    def import_time_preset(args: Sequence[str], env: Dict[str, str]) -> Dict[str, str]:
        """What the plugin's CPU defaults would set at import for a launch with ``args``
        (:func:`.fork_launch.import_time_env`), judged in the launch's own environment ``env``
        (it may unset or override what the test process has). ``os.environ`` is never swapped
        for it: servers started together (threads) raced on the swap (one left the test
        process with the repository twice on ``PYTHONPATH``, so every later launch needed a new
        zygote), and a thread starting a process meanwhile failed (``fork_exec``: EFAULT)."""
        from sglang_mamba_ext.testing import fork_launch

        return fork_launch.import_time_env(args, env)

    def _launch(self, append_log: bool) -> bool:
        """One launch; True once healthy, False when the port was taken (server stopped).

        Raises:
            RuntimeError: the server exited or was not healthy in time."""
        import requests

        env = self.launch_env()
        t0 = time.time()
        with open(self.log_path, "a" if append_log else "w") as log:
            if append_log:
                log.write(f"\n[sglang-mamba-ext test harness] port taken; relaunching on {self.port}\n")
                log.flush()
            start_at = log.tell()
            if not self.fork:
                self.proc = subprocess.Popen(
                    self.command(), env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
        if self.fork:
            from sglang_mamba_ext.testing import zygote

            args = self.launch_args()
            env.update(self.import_time_preset(args, env))
            self.proc = zygote.launch(args, env, self.log_path)
        deadline = t0 + self.start_timeout_s
        while time.time() < deadline:
            if self._bind_failed(start_at):
                self.stop()
                return False
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()  # children of the leader may outlive it
                raise RuntimeError(f"server exited with {code}:\n{self.log_tail()}")
            try:
                if requests.get(self.base_url + "/health", timeout=5).status_code == 200:
                    self.startup_s = time.time() - t0
                    return True
            except requests.RequestException:
                pass
            time.sleep(0.25)  # a forked test server is up in a few seconds: poll finely
        self.stop()
        raise RuntimeError(f"server not healthy after {self.start_timeout_s:.0f} s:\n{self.log_tail()}")

    def _bind_failed(self, start_at: int) -> bool:
        """This launch's log (from byte ``start_at``) says the HTTP port could not be bound."""
        with open(self.log_path, errors="replace") as f:
            f.seek(start_at)
            text = f.read().lower()
        return any(line in text for line in BIND_FAILURES) and str(self.port) in text

    def stop(self) -> None:
        """SIGKILL the server's process group and reap the leader; idempotent. SIGKILL, as
        SGLang's own ``kill_process_tree`` does: SIGTERM took 6 s per server (SGLang's graceful
        shutdown) and cleaned up nothing more (its ``/dev/shm`` entries stay either way); read
        what is needed from the server (log, ``/v1/loads``) before stopping it."""
        proc, self.proc = self.proc, None  # a second stop must not signal a reused group id
        if proc is None:
            return
        try:  # also when the leader is gone: its children keep the group
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def generate(self, input_ids=None, text=None, max_new_tokens: int = 16, timeout: float = 300, **extra) -> dict:
        """POST ``/generate`` with greedy sampling (``ignore_eos``); ``extra`` fields are
        added to the request body. Returns the JSON response.

        Raises:
            requests.HTTPError: on a non-2xx answer."""
        import requests

        body = {
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
            **extra,
        }
        if input_ids is not None:
            body["input_ids"] = list(input_ids)
        else:
            body["text"] = text
        r = requests.post(self.base_url + "/generate", json=body, timeout=timeout)
        r.raise_for_status()
        return r.json()

    def loads(self, timeout: float = 60) -> dict:
        """SGLang's ``GET /v1/loads`` for the (single) scheduler: ``num_running_reqs``,
        ``num_waiting_reqs``, ``num_used_tokens`` (KV tokens held by requests or locked in
        the tree, i.e. neither free nor evictable), ``max_total_num_tokens``, ...

        Raises:
            requests.HTTPError: on a non-2xx answer."""
        import requests

        r = requests.get(self.base_url + "/v1/loads", params={"include": "core"}, timeout=timeout)
        r.raise_for_status()
        (load,) = r.json()["loads"]
        return load

    def healthy(self, timeout: float = 60) -> bool:
        """The process runs and ``/health`` answers 200 (the scheduler is serving)."""
        import requests

        if not self.alive():
            return False
        try:
            return requests.get(self.base_url + "/health", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def log_text(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 4000) -> str:
        return self.log_text()[-n:]

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
