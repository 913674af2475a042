"""A local mooncake master for the mooncake storage tier's tests (``--hicache-storage-backend
mooncake``, ``plugin/storage_mooncake.py``): ``mooncake_master`` of the venv's mooncake
package (``mooncake-transfer-engine-non-cuda``) on free localhost ports, and the extra config
that points SGLang's ``MooncakeStore`` at it (tcp, P2P handshake: no metadata server).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from typing import Optional

#: Bytes each client (a test's store, a server process) mounts into the store.
SEGMENT_BYTES = 64 << 20


def _die_with_parent() -> None:
    """In the child before ``exec``: killed when the test process dies (a crash skips the
    cleanups that stop the master)."""
    import ctypes
    import signal

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """``mooncake_master`` as a subprocess. :meth:`start` returns ``None`` when up, else why
    it is not (for a ``skipTest``); :meth:`stop` kills it (always safe to call)."""

    def __init__(self, log_path: str):
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None
        self.rpc_port = self.metrics_port = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def extra_config(self, **more) -> dict:
        """SGLang's ``--hicache-storage-backend-extra-config`` for this master."""
        return {"master_server_address": self.address, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE",
                "local_hostname": "localhost", "global_segment_size": SEGMENT_BYTES,
                "master_metrics_port": self.metrics_port, **more}

    def extra_config_json(self, **more) -> str:
        return json.dumps(self.extra_config(**more))

    def start(self, timeout: float = 20.0, same_ports: bool = False) -> Optional[str]:
        """``same_ports``: on the ports of the previous start (a master that comes back)."""
        binary = os.path.join(os.path.dirname(sys.executable), "mooncake_master")
        if not os.path.exists(binary):
            return f"no {binary} (the mooncake-transfer-engine-non-cuda package)"
        probe = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True, text=True)
        if probe.returncode != 0:  # e.g. the system libraries scripts/setup_env.sh names
            return f"mooncake.store does not import: {probe.stderr.strip().splitlines()[-1:]}"
        if not (same_ports and self.rpc_port):
            self.rpc_port, self.metrics_port = _free_port(), _free_port()
        log = open(self.log_path, "a" if same_ports else "w")
        self.proc = subprocess.Popen(
            [binary, f"--rpc_port={self.rpc_port}", f"--metrics_port={self.metrics_port}",
             "--rpc_address=127.0.0.1", "--metrics_host=127.0.0.1", "--enable_metric_reporting=false"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return f"mooncake_master exited with {self.proc.returncode} (log {self.log_path})"
            try:
                socket.create_connection(("127.0.0.1", self.rpc_port), 0.5).close()
                return None
            except OSError:
                time.sleep(0.1)
        self.stop()
        return f"mooncake_master did not listen on {self.address} within {timeout:.0f} s (log {self.log_path})"

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self.proc = None
