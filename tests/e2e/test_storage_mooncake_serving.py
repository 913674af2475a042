"""End to end: the storage tier over SGLang's mooncake backend (issue 42 item 1,
``docs/design.md``, "Storage tier").

A ``mooncake_master`` on localhost (tcp; the class is skipped, with the reason, where it
cannot start), then the tiny model served with ``--enable-mamba-radix
--enable-hierarchical-cache --hicache-ratio 1 --max-mamba-cache-size 8 --max-total-tokens 640
--hicache-storage-backend mooncake --hicache-storage-backend-extra-config
{"master_server_address": ..., "protocol": "tcp", ...}`` (SGLang's ``MooncakeStore``, the
server process mounting a 64 MiB segment): as ``test_storage_tier_serving.py`` does with
``file`` (this class is that one with mooncake's flags), a 200-token prompt, then ten others,
push the first prompt's states and KV out of both tiers into the store; sent again, it hits
``len - 1`` tokens read back from mooncake, and its output equals a cold run's (a fresh
``cache_salt``) and the reference's greedy tokens. SGLang's strict idle checks run. No restart: mooncake's values live in the segment
the server mounts and go with it (``tests/test_storage_mooncake.py`` shows it). The server
is stopped before the master (a client whose master is gone spends seconds failing to
unmount), and the master is always killed.

Last (``test_master_gone...``), the master is killed under the running server: a request
then misses storage and drops its spills within the guard's bound
(``storage_call_timeout_s``, here 1 s; without the guard a fresh user saw a request of 41 s
and ``/server_info`` unanswered for minutes), ``/server_info`` answers and counts the
outage, and once the master is back on its port the tier's probe lets calls through again.
"""

import os
import time
import unittest

import pytest

import test_storage_tier_serving as base
from mooncake_master import MooncakeMaster
from server_util import idle_and_checked

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


class TestMooncakeStorageTier(base.TestStorageTier):
    SEED = 4202
    SURVIVES_RESTART = False  # the values live in the segment the stopped server mounted

    @classmethod
    def storage_flags(cls):
        cls.master = MooncakeMaster(os.path.join(cls.tmp_dir, "master.log"))
        cls.addClassCleanup(cls.master.stop)  # runs after the server's stop (cleanups run last-in first)
        why = cls.master.start()
        if why is not None:
            raise unittest.SkipTest(f"no local mooncake master: {why}")
        return ["--hicache-storage-backend", "mooncake", "--hicache-storage-backend-extra-config",
                cls.master.extra_config_json(storage_call_timeout_s=1, storage_retry_interval_s=1)]

    def test_a_storage_tier_is_mooncake(self):
        """The inherited tests read back through mooncake, not some other tier: the server set
        up the plugin's storage tier over SGLang's mooncake backend, at this class's master."""
        log = self.server.log_text()
        self.assertIn("sglang-mamba-ext: storage tier mooncake (", log)
        self.assertIn(self.master.extra_config()["master_server_address"], log)

    def test_master_gone_misses_within_the_bound_then_recovers(self):
        self.master.stop()
        t = time.monotonic()
        out = self.gen(self.tokens(base.PROMPT_LEN))  # the full tiers spill into a master that is gone
        took = time.monotonic() - t
        self.assertEqual(out[1], 0)
        t = time.monotonic()
        info = self.info()
        self.assertLess(time.monotonic() - t, 5)
        self.assertEqual((info["storage_outages"], info["storage_recoveries"]), (1, 0))
        self.assertGreater(info["storage_unavailable"], 0)
        self.assertLess(took, 1 + 10)  # the 1 s bound, plus a request's own time on a loaded machine
        self.assertIsNone(self.master.start(same_ports=True))
        deadline = time.monotonic() + 60
        while info["storage_recoveries"] == 0 and time.monotonic() < deadline:
            self.gen(self.tokens(20))  # a call after the retry interval probes the master
            info = self.info()
        self.assertEqual(info["storage_recoveries"], 1, "the master came back, the server's tier did not")
        self.assertEqual(info["storage_rejected"], 0)
        idle_and_checked(self.server)


if __name__ == "__main__":
    unittest.main()
