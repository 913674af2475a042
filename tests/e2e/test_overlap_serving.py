"""End to end: SGLang's overlap scheduler with the plugin on CPU (issue 13, item 4).

SGLang 0.5.23 runs its overlap scheduler on CPU; the plugin turns it off there by default
(under overlap no exact prefix checkpoint is planned) and ``SGLANG_MAMBA_EXT_CPU_OVERLAP=1``
keeps it on. With it on, a forward may be in flight while the previous batch's results
(finishes, cache inserts) are processed: the finish path donates the request's newest
ping-pong checkpoint (``finish_state="checkpoint"``, ``docs/design.md``, "Ping-pong
checkpoints") and never a slot a running forward could still write. Greedy output must equal
the reference, concurrent finishes must leave no leak (SGLang's strict idle checks), and a
follow-up turn hits the donated checkpoint exactly.
"""

import os
import tempfile
import unittest
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_util import CHECKED_ENV, Server, idle_and_checked

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

INTERVAL = 8


class TestOverlapOnCPU(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference
        from sglang_mamba_ext.testing import tiny_model_dir

        tmp = tempfile.TemporaryDirectory()
        cls.addClassCleanup(tmp.cleanup)
        cls.model = tiny_model_dir()
        cls.ref = TinyHybridReference.from_pretrained(cls.model)
        flags = ["--device", "cpu", "--enable-mamba-radix", "--mamba-track-interval", str(INTERVAL),
                 "--max-total-tokens", "2048", "--max-mamba-cache-size", "32", "--max-running-requests", "4"]
        env = {**CHECKED_ENV, "SGLANG_MAMBA_EXT_CPU_OVERLAP": "1"}
        cls.server = Server(cls.model, flags, os.path.join(tmp.name, "server.log"), env=env)
        cls.addClassCleanup(cls.server.stop)
        cls.server.wait_healthy()

    def gen(self, ids, n):
        r = self.server.generate(input_ids=ids, max_new_tokens=n)
        self.assertEqual(r["output_ids"], self.ref.generate_greedy(ids, n), f"prompt of {len(ids)}")
        return r

    def test_a_overlap_is_on(self):
        self.assertIn("'disable_overlap_schedule': False", self.server.log_text())

    def test_concurrent_finishes_and_follow_up(self):
        prompts = [[(7 * i + s) % 600 + 5 for i in range(n)] for s, n in ((1, 37), (2, 45), (3, 29), (4, 52))]
        with ThreadPoolExecutor(4) as pool:
            firsts = list(pool.map(lambda p: self.gen(p, 11), prompts))
        for p, first in zip(prompts, firsts):
            out = first["output_ids"]
            nxt = p + out + [3, 4]
            r = self.gen(nxt, 4)
            got = r["meta_info"]["cached_tokens"]
            # the donated state is the newest ping-pong checkpoint: the last multiple of the
            # track interval not past the finished request's len - 1
            done = len(p) + len(out) - 1
            self.assertEqual(got, done // INTERVAL * INTERVAL, (got, done))
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0)


if __name__ == "__main__":
    unittest.main()
