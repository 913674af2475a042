"""End to end: SGLang's overlap scheduler with the plugin on CPU (issue 25).

SGLang 0.5.23 runs its overlap scheduler on CPU, and with the plugin it stays on there as on a
GPU (``SGLANG_MAMBA_EXT_CPU_OVERLAP=0`` or ``--disable-overlap-schedule`` turn it off). Under
overlap the batch after a request's last token is launched before that token's result is
processed; SGLang commits that extra step (a request finishing by length is left out of it),
so the finish donates the live state (``finish_state="overlap"``, ``docs/design.md``,
"Overlap scheduling"). Planned checkpoints
(branch point, prompt - 1) are written as without overlap. Every hit below is the exact
value of the scheduler without overlap (a stop-token finish: one more); greedy output
equals the reference model; aborts and concurrent finishes leave nothing behind (SGLang's
strict idle checks).
"""

import random
import unittest
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from server_util import CHECKED_ENV, abort_mid_generation, idle_and_checked, start_tiny_server

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

INTERVAL = 8
CHUNK = 64
#: the tiny model's end-of-sequence id (its generation_config.json)
EOS = 2


class TestOverlapOnCPU(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        flags = ["--device", "cpu", "--enable-mamba-radix", "--mamba-track-interval", str(INTERVAL),
                 "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "4096",
                 "--max-mamba-cache-size", "48", "--max-running-requests", "4"]
        start_tiny_server(cls, flags, CHECKED_ENV)  # overlap on: the plugin's default
        cls.rng = random.Random(25)

    def tokens(self, n):
        return [self.rng.randrange(5, 600) for _ in range(n)]

    def gen(self, ids, n, **extra):
        r = self.server.generate(input_ids=ids, max_new_tokens=n, **extra)
        self.assertEqual(r["output_ids"], self.ref.generate_greedy(ids, n), f"prompt of {len(ids)}")
        return r["output_ids"], r["meta_info"]["cached_tokens"]

    def info(self):
        r = requests.get(self.server.base_url + "/server_info", timeout=60)
        r.raise_for_status()
        return r.json()["internal_states"][0]["mamba_radix"]

    def test_finish_by_length_donated_before_its_result(self):
        """A request finishing by length gives the tree its final state when the next batch
        is scheduled, before its result is processed (``plugin/overlap_publish.py``): one
        early donation per such request, none for a finish by the prefill itself (one
        output token: no decode batch), and its next turn hits ``len + out - 1``."""
        before = self.info()["finish_states_donated_early"]
        p = self.tokens(45)
        out, _ = self.gen(p, 7)
        self.assertEqual(self.info()["finish_states_donated_early"] - before, 1)
        nxt = p + out + [3, 4]
        out2, hit = self.gen(nxt, 4)
        self.assertEqual(hit, len(p) + 7 - 1)
        self.assertEqual(self.info()["finish_states_donated_early"] - before, 2)
        # a branch off nxt's end, finished by its prefill: nxt's prompt-end checkpoint
        self.assertEqual(self.gen(nxt + [out2[0] % 500 + 7], 1)[1], len(nxt) - 1)
        self.assertEqual(self.info()["finish_states_donated_early"] - before, 2)
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0, load)

    def test_a_overlap_is_on(self):
        log = self.server.log_text()
        self.assertIn("'disable_overlap_schedule': False", log)
        self.assertIn("finish_state=overlap", log)

    def test_resend_hits_len_minus_1(self):
        for n in (150, 120):  # 120: no ping-pong checkpoint of the prefill is near its end
            p = self.tokens(n)
            self.assertEqual(self.gen(p, 5)[1], 0)
            self.assertEqual(self.gen(p, 5)[1], n - 1, n)

    def test_branch_point_hits_exactly(self):
        shared = self.tokens(77)
        self.gen(shared + self.tokens(30), 3)
        # the KV is cached to 77, the deepest state is the first prompt's at its first chunk
        # end; the branch point is planned here
        self.assertEqual(self.gen(shared + self.tokens(25), 3)[1], CHUNK)
        self.assertEqual(self.gen(shared + self.tokens(20), 3)[1], 77)

    def test_next_turn_hits_len_plus_out_minus_1(self):
        for n, new in ((150, 8), (37, 11), (64, 1)):  # 1: finished by its prefill
            p = self.tokens(n)
            out, _ = self.gen(p, new)
            self.assertEqual(self.gen(p + out + self.tokens(3), 4)[1], n + new - 1, (n, new))

    def test_stop_token_finish_next_turn(self):
        """A request that ends on a stop token: SGLang cannot tell before its result is
        processed, so the next batch runs and commits one more step of it, the stop token's
        (a finish by length is left out of that batch, ``Scheduler._reqs_finishing_inflight``).
        The next turn then hits ``len + out`` (one more than without overlap, where the stop
        token is never forwarded) and is served exactly."""
        for n in (50, 150):
            p, ref = next((p, r) for p in (self.tokens(n) for _ in range(20))
                          for r in [self.ref.generate_greedy(p, 16)] if EOS not in r)
            k = next(i for i in range(4, 16) if ref[i] not in ref[:i])
            donated = self.info()["finish_states_donated_early"]
            r = self.server.generate(input_ids=p, sampling_params={  # ignore_eos would ignore the stop id too
                "temperature": 0, "max_new_tokens": 16, "stop_token_ids": [ref[k]]})
            out = r["output_ids"]
            # not foreseeable: no early donation (its result finishes it one batch late)
            self.assertEqual(self.info()["finish_states_donated_early"], donated)
            self.assertEqual(out, ref[: k + 1])
            self.assertEqual(r["meta_info"]["finish_reason"]["type"], "stop")
            self.assertEqual(self.gen(p + out + self.tokens(3), 4)[1], n + len(out), n)

    def test_concurrent_finishes_and_follow_up(self):
        """Four requests finishing at different steps of shared decode batches: each next turn
        hits ``len + out - 1``."""
        prompts = [self.tokens(n) for n in (37, 45, 29, 52)]
        news = (11, 6, 14, 9)
        with ThreadPoolExecutor(4) as pool:
            firsts = list(pool.map(lambda a: self.gen(*a)[0], zip(prompts, news)))
        for p, out in zip(prompts, firsts):
            self.assertEqual(self.gen(p + out + [3, 4], 4)[1], len(p) + len(out) - 1)
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0)

    def test_chunked_prefills_sharing_forwards(self):
        """Two 150-token prompts prefilled in 64-token chunks side by side (their chunks share
        forwards with each other's decode steps): resends hit 149 each."""
        prompts = [self.tokens(150) for _ in range(2)]
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda p: self.gen(p, 6), prompts))
        with ThreadPoolExecutor(2) as pool:
            hits = list(pool.map(lambda p: self.gen(p, 2)[1], prompts))
        self.assertEqual(hits, [149, 149])

    def test_z_abort_in_flight_then_idle(self):
        abort_mid_generation(self.server, self.tokens(40), "overlap-abort")
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_running_reqs"], 0)
        self.assertEqual(load["num_used_tokens"], 0, load)
        # the server still serves exactly after it
        p = self.tokens(60)
        self.gen(p, 3)
        self.assertEqual(self.gen(p, 3)[1], 59)



class TestOverlapRetraction(unittest.TestCase):
    """Overlap on and SGLang's retraction test mode (``SGLANG_TEST_RETRACT=1``: the running
    batch is retracted every 3 forwards, while the batch launched before is in flight):
    retracted requests are requeued and finish with the reference's output, their next
    turns hit ``len + out - 1``, and nothing leaks (strict idle checks)."""

    @classmethod
    def setUpClass(cls):
        flags = ["--device", "cpu", "--enable-mamba-radix", "--max-total-tokens", "4096",
                 "--max-mamba-cache-size", "48", "--max-running-requests", "4"]
        start_tiny_server(cls, flags, {**CHECKED_ENV, "SGLANG_TEST_RETRACT": "1"})
        cls.rng = random.Random(2525)

    def test_retracted_requests_finish_exactly(self):
        prompts = [[self.rng.randrange(5, 600) for _ in range(n)] for n in (40, 57, 33)]
        new = 24

        def run(p):
            r = self.server.generate(input_ids=p, max_new_tokens=new)
            self.assertEqual(r["output_ids"], self.ref.generate_greedy(p, new))
            return r["output_ids"]

        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(run, prompts))
        self.assertIn("Testing retraction", self.server.log_text())
        for p, out in zip(prompts, outs):
            nxt = p + out + [3, 4]
            r = self.server.generate(input_ids=nxt, max_new_tokens=2)
            self.assertEqual(r["output_ids"], self.ref.generate_greedy(nxt, 2))
            self.assertEqual(r["meta_info"]["cached_tokens"], len(p) + new - 1)
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0, load)


if __name__ == "__main__":
    unittest.main()
