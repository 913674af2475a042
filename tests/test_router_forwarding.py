"""What sglang-router 0.3.2 (the Rust gateway on PyPI) forwards of a request body (issue 23).

The cause of the cross-tenant hits through ``scripts/serve_cpu_pd.sh``: the router parses
``/generate`` and ``/v1/chat/completions`` into typed requests that have no ``cache_salt``
field and re-serializes them, so the salt never reaches the prefill server (nor the decode
server), in PD mode and in regular mode alike. ``extra_key`` (SGLang's other cache namespace)
survives on ``/generate`` (not on chat); ``/v1/completions`` keeps both fields. sglang-router's ``--mini-lb`` (Python, PD only) forwards the body as
sent. No SGLang server here: the router fronts capture workers (a few HTTP endpoints that record
what reaches them), so the test takes seconds. When a router release keeps ``cache_salt``, the
first assertion fails: then the "Tenant isolation" table of docs/serving.md changes.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.util import find_spec

import requests

from sglang_mamba_ext.testing.server import free_port

GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 1}, "cache_salt": "tenant-a",
            "extra_key": "ns-a"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "tenant-b",
        "extra_key": "ns-b"}
COMPLETION = {"model": "tiny", "prompt": "hi", "cache_salt": "tenant-c", "extra_key": "ns-c"}
SENT = {"/generate": GENERATE, "/v1/chat/completions": CHAT, "/v1/completions": COMPLETION}


class CaptureWorker:
    """An HTTP server posing as an SGLang worker: health and info endpoints, and ``/generate``
    / ``/v1/chat/completions`` answered with a minimal valid response; the JSON bodies of the
    POSTs are kept in ``bodies`` as ``(path, body)``."""

    def __init__(self):
        self.bodies = []
        worker = self

        class Handler(BaseHTTPRequestHandler):
            def _json(self, obj):
                data = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                if "model_info" in self.path:
                    return self._json({"model_path": "tiny", "tokenizer_path": "tiny", "is_generation": True})
                return self._json({"model_path": "tiny"} if "server_info" in self.path else {})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                worker.bodies.append((self.path, body))
                if self.path == "/v1/completions":
                    return self._json({"id": "x", "object": "text_completion", "created": 0, "model": "tiny",
                                       "choices": [{"index": 0, "text": "x", "finish_reason": "stop"}],
                                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                if "chat" in self.path:
                    return self._json({"id": "x", "object": "chat.completion", "created": 0, "model": "tiny",
                                       "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"},
                                                    "finish_reason": "stop"}],
                                       "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                return self._json({"text": "x", "output_ids": [1], "meta_info": {
                    "id": "x", "finish_reason": {"type": "length"}, "prompt_tokens": 3, "completion_tokens": 1,
                    "cached_tokens": 0}})

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@unittest.skipUnless(find_spec("sglang_router"), "sglang-router is not installed")
class TestRouterForwarding(unittest.TestCase):
    def start_router(self, args):
        port = free_port()
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
             "--prometheus-port", str(free_port()), "--health-check-interval-secs", "1",
             "--worker-startup-check-interval", "1", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self.addCleanup(lambda: os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None)
        return f"http://127.0.0.1:{port}", proc

    def workers(self, n):
        out = [CaptureWorker() for _ in range(n)]
        for w in out:
            self.addCleanup(w.close)
        return out

    def post_until_admitted(self, url, proc, path, body, timeout_s=90):
        """POST through the router, retrying while it has no admitted worker (503 / not up)."""
        deadline = time.time() + timeout_s
        while True:
            try:
                r = requests.post(url + path, json=body, timeout=30)
                if r.status_code != 503:
                    self.assertEqual(r.status_code, 200, r.text)
                    return
            except requests.ConnectionError:
                pass
            self.assertIsNone(proc.poll(), "router exited")
            self.assertLess(time.time(), deadline, "router admitted no worker")
            time.sleep(0.5)

    def send_all(self, url, proc):
        for path, body in SENT.items():
            self.post_until_admitted(url, proc, path, body)

    def check_forwarded(self, bodies):
        """What reached a worker: on ``/generate`` ``extra_key`` only, on chat neither field,
        on ``/v1/completions`` both."""
        by_path = dict(bodies)
        self.assertEqual(set(by_path), set(SENT))
        self.assertNotIn("cache_salt", by_path["/generate"])
        self.assertEqual(by_path["/generate"]["extra_key"], "ns-a")
        self.assertEqual(by_path["/generate"]["input_ids"], [5, 6, 7])
        self.assertNotIn("cache_salt", by_path["/v1/chat/completions"])
        self.assertNotIn("extra_key", by_path["/v1/chat/completions"])
        self.assertEqual(by_path["/v1/chat/completions"]["messages"], CHAT["messages"])
        self.assertEqual(by_path["/v1/completions"]["cache_salt"], "tenant-c")
        self.assertEqual(by_path["/v1/completions"]["extra_key"], "ns-c")

    def test_regular_mode_drops_cache_salt(self):
        (w,) = self.workers(1)
        url, proc = self.start_router(["--worker-urls", w.url])
        self.send_all(url, proc)
        self.check_forwarded(w.bodies)

    def test_pd_mode_drops_cache_salt_mini_lb_keeps_it(self):
        prefill, decode = self.workers(2)
        bootstrap = str(free_port())
        url, proc = self.start_router(["--pd-disaggregation", "--prefill", prefill.url, bootstrap,
                                       "--decode", decode.url])
        mini, mini_proc = self.start_router(["--pd-disaggregation", "--mini-lb", "--prefill", prefill.url,
                                             bootstrap, "--decode", decode.url])
        for u, p in ((url, proc), (mini, mini_proc)):
            self.send_all(u, p)
        # the Rust router's three requests reached each side first, then the mini one's
        n = len(SENT)
        for side in (prefill, decode):
            self.assertEqual(len(side.bodies), 2 * n)
            self.check_forwarded(side.bodies[:n])
            for path, body in side.bodies[n:]:
                self.assertEqual(body["cache_salt"], SENT[path]["cache_salt"], path)
                self.assertEqual(body["bootstrap_port"], int(bootstrap), path)


if __name__ == "__main__":
    unittest.main()
