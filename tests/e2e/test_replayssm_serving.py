"""End to end (issue 42, item 3): SGLang's ReplaySSM decode ring (``--enable-linear-replayssm``)
with ``--enable-mamba-radix``.

The tiny model with SGLang's own Gated-DeltaNet kernels (``--linear-kernels sglang``, as in
``test_sglang_kernels_serving.py``, key heads of 32 for the kernel; on CPU its prefill kernels
as the plugin's torch versions, ``SGLANG_MAMBA_EXT_CPU_BRIDGES=1``, the ring's decode kernel
under Triton's interpreter) decodes through SGLang's
ReplaySSM kernel: a decode step appends a record to the slot's ring and writes the state only
every ``--linear-replayssm-cache-len`` steps (16), so a finished request's working slot lags
its live state by its decode steps (4 here: 5 new tokens). The plugin folds the pending
records into the state before the tree takes it (``plugin/replayssm.py``); SGLang requires
``--mamba-radix-cache-strategy no_buffer`` with the flag, which the plugin picks.

A server without the flag (same strategy) answers the same prompts first; with the flag:

- a resend of a 150-token prompt hits 149 tokens (the prompt-end checkpoint, written in
  prefill), and its output equals the first send's and the flagless server's;
- a follow-up turn hits the finished request's state (``len + 5 - 1`` tokens, a state the
  ring had lagged by 4 steps: ``replayssm_records_folded`` counts them) and generates what a
  cold run and the flagless server generate;
- the server then survives SGLang's strict idle checks.
"""

import os
import random
import tempfile
import unittest

import pytest
import requests
from server_util import CHECKED_ENV, GreedyHits, Server, idle_and_checked

from sglang_mamba_ext.models.tiny_builder import build_tiny_model

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

BASE = ["--device", "cpu", "--enable-mamba-radix", "--chunked-prefill-size", "64"]
NEW = 5
#: key head dim of the linear layers: SGLang's ReplaySSM decode kernel tiles K in 2 blocks of
#: at least 16 (``fused_recurrent_linear_replayssm.py``: "BKT=8 must be >=16 for tl.dot"), the
#: tiny model's default 16 is too small for it
KEY_DIM = 32


class TestReplaySSMDecodeRing(GreedyHits, unittest.TestCase):
    NEW = NEW

    @classmethod
    def setUpClass(cls):
        tmp = tempfile.TemporaryDirectory(prefix="replayssm-e2e-")
        cls.addClassCleanup(tmp.cleanup)
        cls.tmpdir = tmp.name
        cls.model = build_tiny_model(os.path.join(tmp.name, "model"), seed=0,
                                     config_overrides={"linear_gate": "gdn", "linear_key_head_dim": KEY_DIM},
                                     linear_kernels="sglang")
        cls.rng = random.Random(42)
        cls.salt = 0
        cls.prompt = cls.tokens(cls, 150)
        cls.turn_tail = cls.tokens(cls, 12)
        # the run without the flag (same strategy), one server at a time
        plain = cls.start("plain", ["--mamba-radix-cache-strategy", "no_buffer"])
        cls.plain_first = cls.gen(cls, cls.prompt, server=plain)
        cls.plain_turn = cls.gen(cls, cls.prompt + cls.plain_first[0] + cls.turn_tail, server=plain)
        plain.stop()
        cls.server = cls.start("replayssm", ["--enable-linear-replayssm"])
        cls.addClassCleanup(cls.server.stop)

    @classmethod
    def start(cls, name, extra):
        # the plugin's torch versions of SGLang's GDN prefill kernels (plugin/cpu_bridges.py, on
        # by default only for SGLang's own hybrid classes): the ReplaySSM ring's decode kernel
        # stays SGLang's, interpreted (KERNEL_COVERS); the prefills were most of this class's time
        env = dict(CHECKED_ENV, SGLANG_MAMBA_EXT_CPU_BRIDGES="1")
        server = Server(cls.model, BASE + extra, os.path.join(cls.tmpdir, f"{name}.log"), env=env)
        cls.addClassCleanup(server.stop)
        server.wait_healthy()
        return server

    def info(self):
        r = requests.get(self.server.base_url + "/server_info", timeout=60)
        r.raise_for_status()
        return r.json()["internal_states"][0]["mamba_radix"]

    def test_a_no_buffer_chosen_for_the_ring(self):
        log = self.server.log_text()
        self.assertIn("--enable-linear-replayssm: --mamba-radix-cache-strategy no_buffer", log)
        self.assertFalse(self.info()["ping_pong_tracking"])

    def test_b_resend_and_follow_up_turn_hit_exactly(self):
        first = self.gen(self.prompt)
        self.assertEqual(first[1], 0)
        self.assertEqual(first[0], self.plain_first[0])
        again = self.gen(self.prompt)
        self.assertEqual(again[1], len(self.prompt) - 1)  # 149
        self.assert_same(again, first)
        before = self.info()["replayssm_records_folded"]
        turn = self.prompt + first[0] + self.turn_tail
        hit = self.gen(turn)
        # the finished request's state: its decode steps were still in the ring
        self.assertEqual(hit[1], len(self.prompt) + NEW - 1)
        self.assertEqual(hit[0], self.plain_turn[0])
        self.assert_same(hit, self.gen(turn, cold=True))
        # the turn's own finish and its cold run's each folded NEW - 1 records
        self.assertEqual(self.info()["replayssm_records_folded"] - before, 2 * (NEW - 1))

    def test_z_idle_checks(self):
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_running_reqs"], 0)


if __name__ == "__main__":
    unittest.main()
