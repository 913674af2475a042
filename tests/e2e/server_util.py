"""Helpers of the e2e tests: the server subprocess (the package's
``sglang_mamba_ext.testing.server``, always killed as a process group when the test class
ends, also when start-up fails) and parsers of the server log.
"""

from __future__ import annotations

import re
import time
from typing import Dict, List, Optional

from sglang_mamba_ext.testing.server import ServerProcess

START_TIMEOUT_S = 420


class Server(ServerProcess):
    """The package's :class:`~sglang_mamba_ext.testing.server.ServerProcess` with a fixed
    log file; :meth:`wait_healthy` starts it and waits for ``/health``."""

    def __init__(self, model_dir: str, args: List[str], log_path: str, env: Optional[Dict[str, str]] = None):
        super().__init__(model_dir, args, env=env, start_timeout_s=START_TIMEOUT_S, log_path=log_path)

    def wait_healthy(self) -> None:
        self.start()


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
