"""End to end: the plugin's cache on several ranks (issue 13), tiny model on CPU (gloo).

- ``--tp 2``: the TP-sharded tiny model (``models/tiny_shard.py``), every rank's cache checked
  against the others after every batch (``SGLANG_MAMBA_EXT_TP_DIGEST_STEPS=1``,
  ``plugin/tp_digest.py``), over a workload with prefix hits, SSM and KV eviction, chunked
  prefill and track checkpoints;
- ``--dp 2``: two data-parallel schedulers, each with its own cache; the ``kda_cache`` warm-up
  warms both (a request names its rank with ``routed_dp_rank``);
- ``--tp 2 --dp 2 --enable-dp-attention``: two attention-DP groups of one rank each (the
  idle one runs empty batches), digest check on.

Greedy output must equal ``TinyHybridReference.generate_greedy`` token for token (which is
what ``--tp 1`` and ``--disable-radix-cache`` give: ``tests/e2e/test_cpu_serving_baseline.py``);
hits are asserted exactly. SGLang's strict idle checks (leaks) are on. One server per class.
"""

import json
import os
import tempfile
import time
import unittest

import pytest
import requests

from isolation import check_isolation, check_warm_prompt_not_shared
from server_util import CHECKED_ENV, start_tiny_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW = 8
DIGEST_ENV = {**CHECKED_ENV, "SGLANG_MAMBA_EXT_TP_DIGEST_STEPS": "1"}


def _ids(start, n):
    return [(start + 7 * i) % 700 + 3 for i in range(n)]


class _Ranks(unittest.TestCase):
    FLAGS: list = []
    ENV = CHECKED_ENV
    WARM = None  # prompts for --warmups kda_cache
    SPAWN = False  # server_util.Server

    @classmethod
    def setUpClass(cls):
        flags = ["--device", "cpu", "--enable-mamba-radix", *cls.FLAGS]
        if cls.WARM:
            tmp = tempfile.TemporaryDirectory()
            cls.addClassCleanup(tmp.cleanup)
            path = os.path.join(tmp.name, "warm.jsonl")
            with open(path, "w") as f:
                for ids in cls.WARM:
                    f.write(json.dumps({"input_ids": ids}) + "\n")
            flags += ["--warmups", "kda_cache", "--warmup-prompts-file", path]
        start_tiny_server(cls, flags, cls.ENV, spawn=cls.SPAWN)

    def gen(self, ids, n=NEW, **extra):
        r = self.server.generate(input_ids=ids, max_new_tokens=n, **extra)
        self.assertEqual(r["output_ids"], self.ref.generate_greedy(ids, n), f"prompt of {len(ids)}")
        return r

    def cached(self, ids, salt, **extra):
        """``cached_tokens`` of a 2-token greedy request in namespace ``salt`` (a ``cache_salt``)."""
        if salt is not None:
            extra["cache_salt"] = salt
        return self.gen(ids, 2, **extra)["meta_info"]["cached_tokens"]

    def loads(self):
        r = requests.get(self.server.base_url + "/v1/loads", params={"include": "core"}, timeout=60)
        r.raise_for_status()
        return r.json()["loads"]

    def idle_checked(self):
        """Every scheduler idle, no leak report, still healthy (SGLang's strict checks)."""
        deadline = time.time() + 120
        while any(l["num_running_reqs"] or l["num_waiting_reqs"] for l in self.loads()):
            self.assertLess(time.time(), deadline, self.loads())
            time.sleep(0.5)
        time.sleep(3)
        log = self.server.log_text()
        for bad in ("memory leak detected", "Scheduler hit an exception", "diverged", "double free"):
            self.assertNotIn(bad, log, self.server.log_tail())
        self.assertTrue(self.server.healthy(), self.server.log_tail())
        for load in self.loads():
            self.assertEqual(load["num_used_tokens"], 0, load)


class TestTP2(_Ranks):
    """``--tp 2`` under pressure: 16 SSM slots (3 per running request), 640 KV tokens, chunks
    of 32 tokens, a checkpoint every 16."""

    FLAGS = ["--tp", "2", "--max-total-tokens", "640", "--max-mamba-cache-size", "16", "--max-running-requests", "3",
             "--chunked-prefill-size", "32", "--mamba-track-interval", "16"]
    ENV = DIGEST_ENV

    def test_isolation_between_tenants(self):
        """Issue 23: ``cache_salt`` keeps tenants apart on every rank (digest check on)."""
        check_isolation(self, self.cached)

    def test_workload_with_hits_and_eviction(self):
        prompts = [_ids(s, n) for s, n in ((1, 45), (50, 70), (100, 23), (150, 90), (200, 37), (250, 61))]
        for p in prompts:
            self.gen(p)
            again = self.gen(p)  # right after: nothing evicted it
            self.assertEqual(again["meta_info"]["cached_tokens"], len(p) - 1)
            # a branch inside the prompt (and inside a 32-token chunk; past the end of a
            # short prompt): the first one plants the branch-point checkpoint, the second hits
            # it exactly
            self.gen(p[:30] + [5, 6, 7])
            branch = self.gen(p[:30] + [8, 9])
            self.assertEqual(branch["meta_info"]["cached_tokens"], min(30, len(p)))
        self.assertIn("TP cache digest check every 1 batches over 2 ranks", self.server.log_text())
        # pressure: 6 prompts and their branches do not fit 640 tokens / 16 slots: the first
        # prompt's states are gone and its resend recomputes (output still exact)
        first = self.gen(prompts[0])
        self.assertLess(first["meta_info"]["cached_tokens"], len(prompts[0]) - 1)
        self.idle_checked()


class TestDP2Warm(_Ranks):
    """``--dp 2`` with the ``kda_cache`` warm-up: both ranks hold the warmed prompt."""

    WARM = [_ids(300, 40)]
    # Forked: the data-parallel controller starts its ranks with SGLang's multiprocessing, which
    # forks in a forked test server (testing/fork_launch.py) as TestTP2's ranks do. Spawned, as
    # a user's launch, its start-up took 125-181 s of the suite.
    FLAGS = ["--dp", "2", "--max-total-tokens", "2048", "--max-mamba-cache-size", "32", "--max-running-requests", "4"]

    def test_warm_prompt_hit_on_every_rank(self):
        warm = self.WARM[0]
        for rank in (0, 1):
            ids = warm + [11 + rank, 12, 13]
            r = self.gen(ids, routed_dp_rank=rank)
            self.assertEqual(r["meta_info"]["dp_rank"], rank)
            self.assertEqual(r["meta_info"]["cached_tokens"], len(warm))
        self.assertIn("on 2 data-parallel rank(s)", self.server.log_text())
        self.idle_checked()

    def test_isolation_between_tenants(self):
        """Issue 23: ``cache_salt`` keeps tenants apart on each DP rank; the unsalted warm-up
        serves only unsalted requests (SGLang's rule)."""
        warm = self.WARM[0]
        first = self.ref.generate_greedy(warm, 1)[0]
        for rank in (0, 1):
            def send(ids, salt, rank=rank):
                return self.cached(ids, salt, routed_dp_rank=rank)

            with self.subTest(rank=rank):
                check_isolation(self, send)
                suffix = [t for t in (31 + rank, 32, 33) if t != first]  # not the warm-up's own next token
                check_warm_prompt_not_shared(self, send, warm, suffix, len(warm))
        self.idle_checked()


class TestTP2DP2Attention(_Ranks):
    """``--tp 2 --dp 2 --enable-dp-attention``: one rank per attention-DP group; a request on
    one group leaves the other running empty batches."""

    FLAGS = ["--tp", "2", "--dp", "2", "--enable-dp-attention", "--max-total-tokens", "2048",
             "--max-mamba-cache-size", "32", "--max-running-requests", "4", "--chunked-prefill-size", "32"]
    ENV = DIGEST_ENV

    def test_each_group_caches_its_own(self):
        p = _ids(400, 50)
        for rank in (0, 1):
            first = self.gen(p, routed_dp_rank=rank)
            self.assertEqual(first["meta_info"]["cached_tokens"], 0)  # the other group's cache is not shared
            again = self.gen(p, routed_dp_rank=rank)
            self.assertEqual(again["meta_info"]["cached_tokens"], len(p) - 1)
        self.idle_checked()

    def test_isolation_between_tenants(self):
        """Issue 23: ``cache_salt`` keeps tenants apart in each attention-DP group."""
        for rank in (0, 1):
            with self.subTest(rank=rank):
                check_isolation(self, lambda ids, salt, rank=rank: self.cached(ids, salt, routed_dp_rank=rank))
        self.idle_checked()


if __name__ == "__main__":
    unittest.main()
