"""End to end: two replicas with the plugin behind ``sglang-router`` (PyPI) with its
cache-aware policy (issue 13, item 5). The turns of a conversation reach the replica that
served the previous turn and hit its cache there, exactly: the deepest state the first turn
left on the shared path (its prompt's ``len - 1`` checkpoint or its finish state at
``len(prompt) + len(output) - 1``). Greedy output equals the reference. Skipped when
``sglang_router`` is not installed (``scripts/setup_env.sh`` installs it).
"""

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import pytest
import requests

from server_util import CHECKED_ENV, Server, common_prefix, start_together

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHUNK = 8  # TinyHybridSGLangConfig.mamba_chunk_size
SYSTEMS = [
    "You are a baker. Answer questions about bread, cakes and opening hours briefly and kindly. ",
    "You are a train guide. Explain timetables, platforms and tickets for the city lines. ",
]


@unittest.skipUnless(importlib.util.find_spec("sglang_router"), "sglang-router is not installed")
class TestRouterReplicas(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from transformers import AutoTokenizer

        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference
        from sglang_mamba_ext.testing import tiny_model_dir
        from sglang_mamba_ext.testing.server import free_port

        tmp = tempfile.TemporaryDirectory()
        cls.addClassCleanup(tmp.cleanup)
        model = tiny_model_dir()
        cls.ref = TinyHybridReference.from_pretrained(model)
        cls.tok = AutoTokenizer.from_pretrained(model)
        flags = ["--device", "cpu", "--enable-mamba-radix", "--max-total-tokens", "2048",
                 "--max-mamba-cache-size", "32", "--max-running-requests", "4"]
        cls.replicas = [Server(model, flags, os.path.join(tmp.name, f"r{i}.log"), env=CHECKED_ENV) for i in (0, 1)]
        start_together(cls, cls.replicas)
        port = free_port()
        cls.url = f"http://127.0.0.1:{port}"
        log = open(os.path.join(tmp.name, "router.log"), "w")
        cls.addClassCleanup(log.close)
        cls.router = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", *[r.base_url for r in cls.replicas], "--policy", "cache_aware"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        cls.addClassCleanup(lambda: os.killpg(cls.router.pid, signal.SIGKILL) if cls.router.poll() is None else None)
        deadline = time.time() + 120
        while True:
            try:
                if requests.get(cls.url + "/health", timeout=5).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline or cls.router.poll() is not None:
                raise RuntimeError("sglang-router did not become healthy")
            time.sleep(1)
        # the router answers 503 until its health checks have admitted the workers
        while requests.post(cls.url + "/generate", timeout=300, json={
                "input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}).status_code == 503:
            if time.time() > deadline + 120:
                raise RuntimeError("sglang-router admitted no worker")
            time.sleep(2)

    def gen(self, text, n=8):
        r = requests.post(self.url + "/generate", timeout=300, json={
            "text": text, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}})
        r.raise_for_status()
        out = r.json()
        ids = self.tok.encode(text)
        self.assertEqual(out["output_ids"], self.ref.generate_greedy(ids, n))
        return ids, out

    def test_isolation_between_tenants_by_extra_key(self):
        """Issue 23: tenants in SGLang's ``extra_key`` (which sglang-router forwards; it drops
        ``cache_salt``: ``tests/test_router_forwarding.py``) are kept apart exactly. The
        cache-aware policy routes by text, so both tenants' requests reach the same replica."""
        import uuid

        from isolation import check_isolation

        text = f"Tenant check {uuid.uuid4().hex}: list three rivers. "

        def send(t, ns):
            body = {"text": t, "sampling_params": {"temperature": 0, "max_new_tokens": 2, "ignore_eos": True}}
            if ns is not None:
                body["extra_key"] = ns
            r = requests.post(self.url + "/generate", timeout=300, json=body)
            r.raise_for_status()
            out = r.json()
            self.assertEqual(out["output_ids"], self.ref.generate_greedy(self.tok.encode(t), 2))
            return out["meta_info"]["cached_tokens"]

        check_isolation(self, send, text, len(self.tok.encode(text)))

    def test_turns_hit_on_their_replica(self):
        firsts = [self.gen(s + "User: hello?") for s in SYSTEMS]  # interleaved conversations
        for (ids1, out1), system in zip(firsts, SYSTEMS):
            text2 = system + "User: hello?" + self.tok.decode(out1["output_ids"]) + " User: and then?"
            ids2, out2 = self.gen(text2)
            path = ids1 + out1["output_ids"]
            shared = common_prefix(ids2, path)
            # the first turn's states on that path: none (0), its prompt's len - 1 checkpoint,
            # its finish state (no prefill-tracking state at the prompt's end: planned
            # checkpoints replace the ping-pong slots of a one-chunk prompt, docs/design.md,
            # "Ping-pong checkpoints")
            states = [0, len(ids1) - 1, len(path) - 1]
            want = max(s for s in states if s <= min(shared, len(ids2) - 1))
            self.assertEqual(out2["meta_info"]["cached_tokens"], want, (shared, states))


if __name__ == "__main__":
    unittest.main()
