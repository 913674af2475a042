"""End to end: the storage tier over SGLang's mooncake backend (issue 42 item 1,
``docs/design.md``, "Storage tier").

A ``mooncake_master`` on localhost (tcp; the class is skipped, with the reason, where it
cannot start), then the tiny model served with ``--enable-mamba-radix
--enable-hierarchical-cache --hicache-ratio 1 --max-mamba-cache-size 8 --max-total-tokens 640
--hicache-storage-backend mooncake --hicache-storage-backend-extra-config
{"master_server_address": ..., "protocol": "tcp", ...}`` (SGLang's ``MooncakeStore``, the
server process mounting a 64 MiB segment): as ``test_storage_tier_serving.py`` does with
``file``, a 200-token prompt, then ten others, push the first prompt's states and KV out of
both tiers into the store; sent again, it hits ``len - 1`` tokens read back from mooncake,
and its output equals a cold run's (a fresh ``cache_salt``) and the reference's greedy
tokens. SGLang's strict idle checks run. No restart: mooncake's values live in the segment
the server mounts and go with it (``tests/test_storage_mooncake.py`` shows it). The server
is stopped before the master (a client whose master is gone spends seconds failing to
unmount), and the master is always killed.
"""

import os
import random
import unittest

import pytest
import requests
import torch

from mooncake_master import MooncakeMaster
from server_util import CHECKED_ENV, GreedyHits, Server, idle_and_checked, tiny_class_setup

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

PROMPT_LEN = 200
FLOOD = 10


class TestMooncakeStorageTier(GreedyHits, unittest.TestCase):
    NEW = 6
    VOCAB = (5, 500)

    @classmethod
    def setUpClass(cls):
        tiny_class_setup(cls)
        cls.master = MooncakeMaster(os.path.join(cls.tmp_dir, "master.log"))
        cls.addClassCleanup(cls.master.stop)  # runs after the server's stop below
        why = cls.master.start()
        if why is not None:
            raise unittest.SkipTest(f"no local mooncake master: {why}")
        cls.rng = random.Random(4202)
        cls.salt = 0
        flags = [
            "--device", "cpu", "--enable-mamba-radix", "--enable-hierarchical-cache", "--hicache-ratio", "1",
            "--max-mamba-cache-size", "8", "--max-total-tokens", "640", "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", cls.master.extra_config_json(),
        ]
        cls.server = Server(cls.model, flags, os.path.join(cls.tmp_dir, "server.log"), env=dict(CHECKED_ENV))
        cls.addClassCleanup(cls.server.stop)
        cls.server.wait_healthy()

    def info(self):
        r = requests.get(self.server.base_url + "/server_info", timeout=60)
        r.raise_for_status()
        return r.json()["internal_states"][0]["mamba_radix"]

    def test_evicted_conversation_hits_from_mooncake(self):
        prompt = self.tokens(PROMPT_LEN)
        cold = self.gen(prompt, cold=True)
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
        again = self.gen(prompt)
        self.assertEqual(again[1], PROMPT_LEN - 1)
        info = self.info()
        self.assertEqual(info["storage_loads"] - loads, 1)
        self.assertEqual(info["storage_rejected"], 0)
        self.assert_same(again, cold)
        idle_and_checked(self.server)


if __name__ == "__main__":
    unittest.main()
