"""End to end: the storage tier (issue 42 item 1, ``docs/design.md``, "Storage tier").

The tiny model served with ``--enable-mamba-radix --enable-hierarchical-cache --hicache-ratio 1
--max-mamba-cache-size 8 --max-total-tokens 640 --hicache-storage-backend file`` (SGLang's
``HiCacheFile`` in a temporary directory): 8 device and 8 host states, 640 device and 640 host
KV tokens. A 200-token prompt, then ten others of 200 tokens, push the first prompt's states
and KV out of both tiers (they are written to storage); sent again, it hits exactly
``len - 1`` tokens read back from storage, and its output equals a cold run's (a fresh
``cache_salt``) and the reference's greedy tokens. The server is then stopped and a new one
started on the same directory (``HiCacheFile`` keeps its files; SGLang clears them only on
``POST /hicache/storage-backend/clear``): the prompt hits ``len - 1`` from storage again, with the
same output. SGLang's strict idle checks run on both servers.
"""

import json
import os
import random
import unittest

import pytest
import requests
import torch

from server_util import CHECKED_ENV, GreedyHits, Server, idle_and_checked, tiny_class_setup

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT_LEN = 200
FLOOD = 10


class TestStorageTier(GreedyHits, unittest.TestCase):
    NEW = 6
    VOCAB = (5, 500)
    SEED = 4201
    #: the backend keeps its values across a server restart (HiCacheFile: files)
    SURVIVES_RESTART = True

    @classmethod
    def storage_flags(cls):
        """``--hicache-storage-backend`` and its extra config (the mooncake class overrides it)."""
        cls.store = os.path.join(cls.tmp_dir, "hicache")
        return ["--hicache-storage-backend", "file",
                "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": cls.store})]

    @classmethod
    def setUpClass(cls):
        tiny_class_setup(cls)
        cls.rng = random.Random(cls.SEED)
        cls.salt = 0
        cls.flags = [
            "--device", "cpu", "--enable-mamba-radix", "--enable-hierarchical-cache", "--hicache-ratio", "1",
            "--max-mamba-cache-size", "8", "--max-total-tokens", "640", *cls.storage_flags(),
        ]
        cls.server = cls.start("first")

    @classmethod
    def start(cls, name):
        server = Server(cls.model, cls.flags, os.path.join(cls.tmp_dir, f"{name}.log"), env=dict(CHECKED_ENV))
        cls.addClassCleanup(server.stop)
        server.wait_healthy()
        return server

    def info(self):
        r = requests.get(self.server.base_url + "/server_info", timeout=60)
        r.raise_for_status()
        return r.json()["internal_states"][0]["mamba_radix"]

    def test_evicted_conversation_hits_from_storage(self):
        prompt = self.tokens(PROMPT_LEN)
        cold = self.gen(prompt, cold=True)
        type(self).conversation = (prompt, cold)  # for the restart below
        with torch.no_grad():
            self.assertEqual(cold[0], self.ref.generate_greedy(prompt, self.NEW))
        first = self.gen(prompt)
        self.assertEqual(first[1], 0)
        for _ in range(FLOOD):  # 2 states and 205 KV tokens each: both tiers overflow
            self.assertEqual(self.gen(self.tokens(PROMPT_LEN))[1], 0)
        info = self.info()
        self.assertGreaterEqual(info["storage_states_written"], 2 * FLOOD - 16)
        self.assertGreater(info["storage_kv_pages_written"], PROMPT_LEN)
        loads = info["storage_loads"]
        r = self.server.generate(input_ids=prompt, max_new_tokens=self.NEW, return_logprob=True)
        again = (r["output_ids"], r["meta_info"]["cached_tokens"],
                 [lp[0] for lp in r["meta_info"]["output_token_logprobs"]])
        self.assertEqual(again[1], PROMPT_LEN - 1)
        # SGLang's per-tier split: every cached token came back from storage (a fresh-user check
        # found them all reported as device hits)
        details = r["meta_info"]["cached_tokens_details"]
        self.assertEqual((details["device"], details["host"], details["storage"]), (0, 0, PROMPT_LEN - 1))
        info = self.info()
        self.assertEqual(info["storage_loads"] - loads, 1)
        self.assertEqual(info["storage_rejected"], 0)
        self.assert_same(again, cold)
        idle_and_checked(self.server)

    def test_hits_from_storage_after_a_restart(self):
        if not self.SURVIVES_RESTART:
            self.skipTest("this backend's values do not outlive the server (see the module docstring)")
        prompt, cold = self.conversation
        # a restart on the same directory: the tree is empty, storage is not
        self.server.stop()
        type(self).server = self.start("restarted")
        # (SGLang's start-up warm-up request may already have read its own prompt back: the
        # first server wrote it)
        loads = self.info()["storage_loads"]
        after = self.gen(prompt)
        self.assertEqual(after[1], PROMPT_LEN - 1)
        self.assertEqual(self.info()["storage_loads"] - loads, 1)
        self.assert_same(after, cold)
        idle_and_checked(self.server)


if __name__ == "__main__":
    unittest.main()
