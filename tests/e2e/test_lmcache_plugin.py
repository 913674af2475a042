"""End to end: ``--enable-lmcache`` with ``--enable-mamba-radix`` (issue 42; ``docs/flags.md``,
"LMCache"; ``sglang_mamba_ext/plugin/lmcache_connector.py``).

Skipped unless ``import lmcache`` works (CI does not install it; ``docs/flags.md`` shows the
throwaway venv it was measured in, and this file is run there as
``srvrun /tmp/lmc/bin/python -m pytest tests/e2e/test_lmcache_plugin.py``).

An ``lmcache server --separate-object-groups --chunk-size 8`` on a free port, and the tiny model
served with ``--device cpu --enable-mamba-radix --enable-lmcache --lmcache-config-file F``. A
100-token prompt A plans a state at its last chunk end (96) and stores tokens 0-96 in LMCache;
after ``POST /flush_cache`` (the tree is empty, LMCache is not), B = A + 50 tokens hits exactly
96 tokens, all from LMCache (``cached_tokens_details``: device 0, storage 96, backend LMCache),
with the output of a cold run (a fresh ``cache_salt``); B stores 96-144; after another flush,
C = B + 20 hits 144 from LMCache. A request that hits from LMCache and is aborted mid-generation
leaves nothing held (SGLang's strict idle checks; no protected KV or state in the tree). A
server whose config names a port nobody listens on fails at start-up naming it.
"""

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest

import pytest
import requests

from server_util import CHECKED_ENV, GreedyHits, Server, abort_mid_generation, idle_and_checked, tiny_class_setup

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

HAVE_LMCACHE = importlib.util.find_spec("lmcache") is not None
CHUNK = 8
A_LEN, B_EXTRA, C_EXTRA = 100, 50, 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_lmcache_server(cls, port: int, log_path: str) -> subprocess.Popen:
    """``lmcache server`` (the CLI next to this Python) on ``port``, stopped with the class."""
    exe = os.path.join(os.path.dirname(sys.executable), "lmcache")
    log = open(log_path, "w")
    proc = subprocess.Popen(
        [exe, "server", "--host", "127.0.0.1", "--port", str(port), "--l1-size-gb", "1", "--eviction-policy", "LRU",
         "--chunk-size", str(CHUNK), "--separate-object-groups"],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )

    def stop():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        log.close()

    cls.addClassCleanup(stop)
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lmcache server exited: {open(log_path).read()[-3000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                break
        except OSError:
            time.sleep(0.5)
    else:
        raise RuntimeError("lmcache server did not listen in 180 s")
    time.sleep(2)  # it listens before its engine is ready
    return proc


def remove_dead_shm_segments(before) -> None:
    """Unlink the POSIX shared memory LMCache made for this class's servers
    (``/dev/shm/lmcache_kv_<pid>_<n>``): a stopped server's process is killed, so LMCache's own
    unlink (a finalizer) does not run. Only segments new since ``before`` whose process is gone."""
    if not os.path.isdir("/dev/shm"):
        return
    for name in set(os.listdir("/dev/shm")) - before:
        parts = name.split("_")
        if not name.startswith("lmcache_kv_") or len(parts) < 4 or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except OSError:
            pass


@unittest.skipUnless(HAVE_LMCACHE, "needs the lmcache package (docs/flags.md, \"LMCache\")")
class TestLMCachePlugin(GreedyHits, unittest.TestCase):
    NEW = 6
    VOCAB = (5, 500)
    SEED = 4242

    @classmethod
    def setUpClass(cls):
        import random

        tiny_class_setup(cls)
        if os.environ.get("LMCACHE_TEST_LOG_DIR"):  # keep the logs (the class's directory goes)
            cls.tmp_dir = os.environ["LMCACHE_TEST_LOG_DIR"]
        cls.rng = random.Random(cls.SEED)
        cls.salt = 0
        cls.addClassCleanup(remove_dead_shm_segments, set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set())
        port = free_port()
        cls.lmcache = start_lmcache_server(cls, port, os.path.join(cls.tmp_dir, "lmcache.log"))
        cls.config = os.path.join(cls.tmp_dir, "lmcache.yaml")
        with open(cls.config, "w") as f:
            f.write(f"mp_host: 127.0.0.1\nmp_port: {port}\n")
        cls.server = Server(cls.model, ["--device", "cpu", "--enable-mamba-radix", "--enable-lmcache",
                                        "--lmcache-config-file", cls.config],
                            os.path.join(cls.tmp_dir, "server.log"), env=dict(CHECKED_ENV))
        cls.addClassCleanup(cls.server.stop)
        cls.server.wait_healthy()

    def info(self):
        r = requests.get(self.server.base_url + "/server_info", timeout=60)
        r.raise_for_status()
        return r.json()["internal_states"][0]["mamba_radix"]

    def lmc(self):
        """The connector's counters (``lmcache_*`` of ``/server_info``'s ``mamba_radix``)."""
        return {k[len("lmcache_"):]: v for k, v in self.info().items() if k.startswith("lmcache_")}

    def flush(self):
        idle_and_checked(self.server)
        r = requests.post(self.server.base_url + "/flush_cache", timeout=60)
        self.assertEqual(r.status_code, 200, r.text)

    def full(self, ids):
        r = self.server.generate(input_ids=ids, max_new_tokens=self.NEW, return_logprob=True)
        meta = r["meta_info"]
        return (r["output_ids"], meta["cached_tokens"], [lp[0] for lp in meta["output_token_logprobs"]]), meta

    def test_1_hits_from_lmcache_after_flush(self):
        a = self.tokens(A_LEN)
        b = a + self.tokens(B_EXTRA)
        c = b + self.tokens(C_EXTRA)
        cold_b, cold_c = self.gen(b, cold=True), self.gen(c, cold=True)
        self.flush()  # the cold runs' tree entries go; their LMCache values are in their own salts
        before = self.lmc()
        self.assertEqual(self.gen(a)[1], 0)
        after = self.lmc()
        # A's state at its last chunk end (96) was planned, inserted and stored
        self.assertEqual(after["stored_tokens"] - before["stored_tokens"], (A_LEN - 1) // CHUNK * CHUNK)

        self.flush()
        got, meta = self.full(b)
        self.assertEqual(got[1], (A_LEN - 1) // CHUNK * CHUNK)  # 96, all from LMCache
        details = meta["cached_tokens_details"]
        self.assertEqual((details["device"], details["host"], details["storage"]), (0, 0, 96))
        self.assertEqual(details["storage_backend"], "LMCache")
        self.assert_same(got, cold_b)
        info = self.lmc()
        self.assertEqual(info["loaded_tokens"] - after["loaded_tokens"], 96)
        self.assertEqual(info["failures"], 0)

        self.flush()
        got, meta = self.full(c)
        expected = (A_LEN + B_EXTRA - 1) // CHUNK * CHUNK  # 144: B stored 96-144 after its load
        self.assertEqual(got[1], expected)
        self.assertEqual(meta["cached_tokens_details"]["storage"], expected)
        self.assert_same(got, cold_c)
        idle_and_checked(self.server)

    def test_2_abort_after_an_lmcache_hit_frees_everything(self):
        prompt = self.tokens(A_LEN)
        self.gen(prompt)
        self.flush()
        out = abort_mid_generation(self.server, prompt + self.tokens(10), rid="lmcache-abort", max_new_tokens=3000,
                                   after_s=2.0)
        self.assertEqual(out["meta_info"]["cached_tokens"], 96)
        idle_and_checked(self.server)
        info = self.info()
        self.assertEqual((info["kv_protected_tokens"], info["ssm_protected_states"]), (0, 0))
        self.assertEqual(info["lmcache_failures"], 0)

    def test_3_no_lmcache_server_fails_start_up_naming_it(self):
        port = free_port()
        config = os.path.join(self.tmp_dir, "nobody.yaml")
        with open(config, "w") as f:
            f.write(f"mp_host: 127.0.0.1\nmp_port: {port}\n")
        server = Server(self.model, ["--device", "cpu", "--enable-mamba-radix", "--enable-lmcache",
                                     "--lmcache-config-file", config],
                        os.path.join(self.tmp_dir, "nobody.log"), env=dict(CHECKED_ENV))
        self.addCleanup(server.stop)
        with self.assertRaises(Exception):
            server.wait_healthy()
        self.assertIn(f"--enable-lmcache: no LMCache server at 127.0.0.1:{port}", server.log_text())


if __name__ == "__main__":
    unittest.main()
