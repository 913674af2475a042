"""End to end: faults in prefill/decode disaggregation with the plugin on the prefill server
(issue 23, item 3). One prefill + decode pair (``--tp 1`` each) behind sglang-router (Rust) for
the class; each fault is followed by SGLang's strict idle checks on the server(s) that lived
(every KV and SSM slot back: the plugin's pool on the prefill side) and a next request served
exactly through the router:

1. a transfer failure: requests whose bootstrap cannot complete, sent straight to each server
   (to the decode server with the bootstrap address of a port where nothing listens; to the
   prefill server with a bootstrap room no decode server ever claims);
2. the decode server killed while it decodes a request, then started again on its port;
3. the prefill server killed while it prefills a request, then started again on its ports;
4. a soak through the router (``soak.py``): clients with random endings, then idle checks and
   flat resident memory.

The client's error comes within a bounded time: SGLang's own timeouts, shortened here with its
environment variables (``SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT`` / ``_WAITING_TIMEOUT`` 20 s;
the decode side's heartbeat to a prefill server, 5 s x 2 failures, is SGLang's default), are
what bounds it; :data:`ERROR_WITHIN_S` is the bound asserted. Clients giving up mid-request (a
disconnect in prefill, transfer or decode) are ``test_pd_serving.py``'s ``test_3``.
"""

import random
import threading
import time
import unittest

import pytest
import requests

from pd_util import skip_without_pd, start_pd_pair, start_router
from server_util import CHECKED_ENV, idle_and_checked, tiny_class_setup, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TIMEOUT_S = 20
#: A decode server holds the KV pages of a transfer the prefill side broke off (a killed
#: prefill server, test_3) until the prefill acknowledges the drain or this many seconds pass
#: (SGLang's default 30 s, ``disaggregation/decode.py``, ``_defer_release``): shortened so that
#: test_3 can see every page back.
DEFERRED_RELEASE_S = 4
FAULT_ENV = {**CHECKED_ENV, "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(TIMEOUT_S),
             "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(TIMEOUT_S),
             "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": str(DEFERRED_RELEASE_S)}
#: A client of a failed request has its answer within this many seconds (SGLang's timeouts
#: above plus a loaded 2-core machine's slack).
ERROR_WITHIN_S = 90


def _ids(start, n):
    return [(start + 7 * i) % 700 + 3 for i in range(n)]


def failed(response) -> bool:
    """An HTTP error, or a 200 whose request was aborted (SGLang's ``finish_reason`` abort)."""
    if response.status_code != 200:
        return True
    info = response.json().get("meta_info", {})
    return (info.get("finish_reason") or {}).get("type") == "abort"


def report(line):
    from conftest import progress

    progress(f"  fault: {line}")


def describe(answer) -> str:
    if isinstance(answer, Exception):
        return type(answer).__name__
    return f"HTTP {answer.status_code} {answer.text[:80]!r}"


@skip_without_pd
class TestPrefillDecodeFaults(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        tmp = tiny_class_setup(cls)
        cls.bootstrap = start_pd_pair(cls, cls.model, tmp, ["--max-mamba-cache-size", "32",
                                                             "--chunked-prefill-size", "64"], [], env=FAULT_ENV)
        # health checks every 2 s and a 5 s open circuit: a restarted server is admitted again soon
        cls.url = start_router(cls, tmp, "router", ["--pd-disaggregation"], cls.bootstrap, "/readiness",
                               ["--health-check-interval-secs", "2", "--cb-timeout-duration-secs", "5"])

    def body(self, ids, n, **extra):
        return {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True},
                **extra}

    def served_exactly(self, ids, n=8, within_s=240):
        """A request through the router is served (retrying while the router has not yet
        admitted a restarted server) and equals the reference."""
        deadline = time.time() + within_s
        while True:
            try:
                r = requests.post(self.url + "/generate", json=self.body(ids, n), timeout=120)
                if r.status_code == 200 and not failed(r):
                    break
            except requests.RequestException:
                r = None
            self.assertLess(time.time(), deadline, f"not served: {r.text[:300] if r is not None else 'no answer'}")
            time.sleep(2)
        self.assertEqual(r.json()["output_ids"], self.ref.generate_greedy(ids, n))

    def timed(self, fn):
        t0 = time.time()
        out = fn()
        return out, time.time() - t0

    def in_flight_then_kill(self, server, ids, n, busy):
        """Send ``ids`` through the router, SIGKILL ``server`` as soon as ``busy(marker)`` is
        true (``marker``: the length of the server's log before the send); returns (the
        client's answer or exception, seconds from the kill to it)."""
        result = {}
        marker = len(server.log_text())

        def client():
            try:
                result["r"] = requests.post(self.url + "/generate", json=self.body(ids, n), timeout=600)
            except requests.RequestException as e:
                result["r"] = e
            result["t"] = time.time()

        t = threading.Thread(target=client)
        t.start()
        deadline = time.time() + 60
        while not busy(marker):
            self.assertTrue(t.is_alive() and time.time() < deadline, f"the request never showed on {server.base_url}")
            time.sleep(0.01)
        killed_at = time.time()
        server.stop()
        t.join(ERROR_WITHIN_S + 30)
        self.assertFalse(t.is_alive(), f"the client got no answer {ERROR_WITHIN_S + 30} s after the kill")
        return result["r"], result["t"] - killed_at

    def restart(self, server):
        port = server.port
        server.wait_healthy()
        self.assertEqual(server.port, port, "restarted on another port: the router would not find it")

    def test_1_transfer_failure_bootstrap_never_completes(self):
        from sglang_mamba_ext.testing.server import free_port

        # decode server: the prefill's bootstrap address is a port where nothing listens
        dead = free_port()
        r, took = self.timed(lambda: requests.post(self.decode.base_url + "/generate", timeout=300, json=self.body(
            _ids(5, 40), 4, bootstrap_host="127.0.0.1", bootstrap_port=dead,
            bootstrap_room=random.getrandbits(62))))
        self.assertTrue(failed(r), r.text[:300])
        self.assertLess(took, ERROR_WITHIN_S)
        report(f"decode server, dead bootstrap address: HTTP {r.status_code} after {took:.1f} s")
        # prefill server: a room no decode server claims (its bootstrap times out)
        r, took = self.timed(lambda: requests.post(self.prefill.base_url + "/generate", timeout=300, json=self.body(
            _ids(9, 40), 4, bootstrap_host="127.0.0.1", bootstrap_port=self.bootstrap,
            bootstrap_room=random.getrandbits(62))))
        self.assertTrue(failed(r), r.text[:300])
        self.assertLess(took, ERROR_WITHIN_S)
        self.assertGreaterEqual(took, TIMEOUT_S - 1)  # it was the bootstrap timeout that ended it
        report(f"prefill server, unclaimed bootstrap room: HTTP {r.status_code} after {took:.1f} s")
        for server in (self.prefill, self.decode):
            idle_and_checked(server)
        self.served_exactly(_ids(13, 30))

    def test_2_decode_killed_mid_request(self):
        answer, took = self.in_flight_then_kill(  # killed while decoding
            self.decode, _ids(21, 300), 512, lambda _: self.decode.loads()["num_running_reqs"] > 0)
        self.assertTrue(isinstance(answer, Exception) or failed(answer), getattr(answer, "text", answer))
        self.assertLess(took, ERROR_WITHIN_S)
        report(f"decode server killed: client answer {describe(answer)} {took:.1f} s after the kill")
        load = idle_and_checked(self.prefill)  # the plugin's pool: every slot back
        self.assertEqual(load["num_used_tokens"], 0)
        self.restart(self.decode)
        self.served_exactly(_ids(25, 30))
        idle_and_checked(self.decode)

    def test_3_prefill_killed_mid_request(self):
        # killed while prefilling: the first of its 64-token chunks logged (the prefill server's
        # /v1/loads does not count a request in prefill)
        answer, took = self.in_flight_then_kill(
            self.prefill, _ids(31, 2000), 64, lambda at: "Prefill batch" in self.prefill.log_text()[at:])
        self.assertTrue(isinstance(answer, Exception) or failed(answer), getattr(answer, "text", answer))
        self.assertLess(took, ERROR_WITHIN_S)
        report(f"prefill server killed: client answer {describe(answer)} {took:.1f} s after the kill")
        idle_and_checked(self.decode)
        # the broken-off transfer's pages come back once the deferred release times out
        self.assertTrue(wait_for(lambda: self.decode.loads()["num_used_tokens"] == 0, timeout_s=DEFERRED_RELEASE_S + 30),
                        f"decode KV tokens still in use: {self.decode.loads()['num_used_tokens']}")
        self.restart(self.prefill)
        self.served_exactly(_ids(35, 30))
        for server in (self.prefill, self.decode):
            idle_and_checked(server)

    def test_4_soak_with_random_endings(self):
        """Issue 23, item 4: concurrent clients through the router with random endings
        (served, disconnected, stream cut) for ``SOAK_SECONDS``; then both servers idle with
        every slot back, and their resident memory flat (within 10 % + 64 MB)."""
        from conftest import progress
        from soak import soak, soak_seconds

        figures = soak(self.url, [self.prefill.proc.pid, self.decode.proc.pid], soak_seconds())
        progress(f"  soak, PD: {figures}")
        self.assertEqual(figures["errors"], 0, figures)
        for ending in ("served", "disconnected", "stream_cut"):
            self.assertGreater(figures[ending], 0, figures)
        for server in (self.prefill, self.decode):
            self.assertEqual(idle_and_checked(server)["num_used_tokens"], 0)
        self.assertLessEqual(figures["rss_end_mb"], figures["rss_start_mb"] * 1.1 + 64, figures)


if __name__ == "__main__":
    unittest.main()
