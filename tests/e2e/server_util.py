"""Start / stop ``python -m sglang.launch_server`` as a subprocess for the e2e tests.

The server runs in its own process group on a free port with its log in a file; it is
always killed (SIGTERM, then SIGKILL) when the test class ends, also when start-up fails.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, List, Optional

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 420


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One server process. ``args`` are the flags after ``--model-path M --host --port``."""

    def __init__(self, model_dir: str, args: List[str], log_path: str, env: Optional[Dict[str, str]] = None):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = REPO + os.pathsep + full_env.get("PYTHONPATH", "")
        full_env.update(env or {})
        self.cmd = [
            sys.executable, "-m", "sglang.launch_server",
            "--model-path", model_dir,
            *args,
            "--host", "127.0.0.1", "--port", str(self.port),
        ]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            self.cmd, env=full_env, stdout=self._log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=os.path.dirname(log_path),
        )
        self.startup_s = None

    def wait_healthy(self) -> None:
        import requests

        t0 = time.time()
        deadline = t0 + START_TIMEOUT_S
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.base_url + "/health", timeout=5).status_code == 200:
                    self.startup_s = time.time() - t0
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise RuntimeError(f"server not healthy after {START_TIMEOUT_S}s:\n{self.log_tail()}")

    def log_text(self) -> str:
        self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 6000) -> str:
        return self.log_text()[-n:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        if not self._log.closed:
            self._log.close()

    # -- requests ----------------------------------------------------------------------
    def generate(self, input_ids=None, text=None, max_new_tokens=16, timeout=300, **extra):
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


IDLE_RE = re.compile(
    r"mamba-radix idle check ok: kv evictable=(\d+) protected=(\d+), ssm evictable=(\d+) protected=(\d+), "
    r"free kv=(\d+) ssm=(\d+), evicted kv=(\d+) ssm=(\d+)"
)


def idle_checks(log: str) -> List[Dict[str, int]]:
    """The cache's idle-check lines (``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK=1``) as dicts."""
    keys = ("kv_evictable", "kv_protected", "ssm_evictable", "ssm_protected", "kv_free", "ssm_free",
            "evicted_kv", "evicted_ssm")
    return [dict(zip(keys, map(int, m.groups()))) for m in IDLE_RE.finditer(log)]


def pool_sizes(log: str) -> Dict[str, int]:
    """KV tokens and SSM slots of the server's pools, from SGLang's start-up log."""
    kv = re.search(r"max_total_num_tokens=(\d+)", log)
    ssm = re.search(r"max_mamba_cache_size: (\d+)", log)
    return {"kv": int(kv.group(1)), "ssm": int(ssm.group(1))}


def wait_for(predicate, timeout_s: float = 120, poll_s: float = 0.5):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    return predicate()
