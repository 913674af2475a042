"""Prefill/decode sets for the PD test classes: the two servers (started at once) and routers
in front of them (``sglang_router.launch_router``), each killed as a process group with the
class. Skip decorator for hosts without sglang-router or mooncake's transfer engine.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import unittest
from typing import Dict, List, Optional

import requests

from server_util import Server, start_together

#: SGLang's PD request fields (``bootstrap_host`` etc.) aside, the flags both sides share.
PD_FLAGS = ["--device", "cpu", "--disaggregation-transfer-backend", "mooncake_tcp", "--enable-cache-report",
            "--max-total-tokens", "4096", "--max-running-requests", "4"]


def _have_mooncake() -> bool:
    try:
        import mooncake.engine  # noqa: F401  (loads libibverbs / libnl)
    except Exception:
        return False
    return True


skip_without_pd = unittest.skipUnless(
    importlib.util.find_spec("sglang_router") and _have_mooncake(),
    "sglang-router or mooncake-transfer-engine-non-cuda is not installed")


def start_pd_pair(cls, model: str, tmp: str, prefill_flags: List[str], decode_flags: List[str],
                  env: Optional[Dict[str, str]] = None) -> int:
    """Start ``cls.prefill`` (``--disaggregation-mode prefill`` on a fresh bootstrap port, with
    ``--enable-mamba-radix``) and ``cls.decode`` together; returns the bootstrap port."""
    from sglang_mamba_ext.testing.server import free_port

    bootstrap = free_port()
    cls.prefill = Server(model, [*PD_FLAGS, "--enable-mamba-radix", "--disaggregation-mode", "prefill",
                                 "--disaggregation-bootstrap-port", str(bootstrap), *prefill_flags],
                         os.path.join(tmp, "prefill.log"), env=env)
    cls.decode = Server(model, [*PD_FLAGS, "--disaggregation-mode", "decode", *decode_flags],
                        os.path.join(tmp, "decode.log"), env=env)
    start_together(cls, [cls.prefill, cls.decode])
    return bootstrap


def start_router(cls, tmp: str, name: str, mode: List[str], bootstrap: int, ready_path: str,
                 extra: List[str] = ()) -> str:
    """Start a router (``mode``: e.g. ``["--pd-disaggregation"]``, plus ``"--mini-lb"``) in
    front of ``cls.prefill`` / ``cls.decode``; returns its URL once ``ready_path`` answers 200
    (Rust ``/readiness``: a healthy prefill and decode worker admitted)."""
    from sglang_mamba_ext.testing.server import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(os.path.join(tmp, f"{name}.log"), "w")
    cls.addClassCleanup(log.close)
    proc = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", *mode, "--host", "127.0.0.1",
         "--port", str(port), "--prometheus-port", str(free_port()),
         "--prefill", cls.prefill.base_url, str(bootstrap), "--decode", cls.decode.base_url, *extra],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    cls.addClassCleanup(lambda: os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None)
    deadline = time.time() + 120
    while True:
        try:
            if requests.get(url + ready_path, timeout=5).status_code == 200:
                return url
        except requests.RequestException:
            pass
        if time.time() > deadline or proc.poll() is not None:
            raise RuntimeError(f"{name} did not become ready")
        time.sleep(1)
