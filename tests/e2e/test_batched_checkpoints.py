"""End to end (issue 11, item 1): exact checkpoints when requests share forwards.

Batches of 2-4 prompts of unaligned lengths go to one ``/generate`` call, so they wait in the
queue together and SGLang packs them into shared forwards; ``--chunked-prefill-size 64``
cuts chunks across request boundaries (one request's last chunk shares a forward with
another's first), and ``--max-mamba-cache-size`` is small, so the SSM pool is under
pressure (the tree's states are evicted to admit requests) through most of the workload.
After each batch every prompt is probed alone and the hit is asserted exactly:

- a resent prompt hits its prompt-length - 1 checkpoint (``len - 1`` floored to a page);
- a continuation (prompt + outputs + new text) hits the finished request's state
  (``len + outputs - 1``; lengths chosen on the page grid);
- a sibling diverging from a batched request at a branch point that lies in a later chunk
  of that request hits the branch point (floored to a page).

Every output equals a cold run of the same prompt in a fresh ``cache_salt`` (no hit), and
the server survives going idle under SGLang's strict leak and tree checks.
Before the fix of issue 11 the resends under SSM pressure hit only SGLang's 32-token track
grid (the admission of a later request reclaimed the planned checkpoints of a request
between its chunks instead of evicting cold states).
"""

import math
import os
import random
import tempfile
import unittest

import pytest
import requests
from conftest import tiny_model_dir
from server_util import CHECKED_ENV, Server, idle_and_checked, unexpected_tracebacks

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

VOCAB_LO, VOCAB_HI = 3, 200


class _BatchedCheckpoints(unittest.TestCase):
    """One server per subclass; ``PAGE`` is its ``--page-size``."""

    __test__ = False
    PAGE = 1
    TRACK = 32
    CHUNK = 64
    MAMBA_SLOTS = 48
    SEED = 11
    #: batch shapes (prompt lengths) of ``test_a``: one to four requests, 26-145 tokens, so
    #: prompts and continuations end inside, at and past the 64-token chunk
    SHAPES = ((97, 46), (73, 128, 73), (123, 80, 145, 76), (30, 54, 66, 93), (28, 89, 57),
              (122, 26, 52), (95, 142, 96, 131), (35, 38, 36), (44, 37))

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="batched-ckpt-e2e-")
        cls.addClassCleanup(cls.tmp.cleanup)
        args = [
            "--device", "cpu", "--enable-mamba-radix",
            "--chunked-prefill-size", str(cls.CHUNK), "--mamba-track-interval", str(cls.TRACK),
            "--max-mamba-cache-size", str(cls.MAMBA_SLOTS), "--page-size", str(cls.PAGE),
            # the probes expect every state of a batch to survive the probes before them, which
            # is LRU's order under this pressure (the default adaptive policy may evict a finish
            # state it ranks lower first)
            "--radix-eviction-policy", "lru",
        ]
        cls.server = Server(tiny_model_dir(), args, os.path.join(cls.tmp.name, "server.log"), env=dict(CHECKED_ENV))
        cls.addClassCleanup(cls.server.stop)
        cls.server.wait_healthy()
        cls.rng = random.Random(cls.SEED)
        cls.salt = 0

    # -- helpers ---------------------------------------------------------------------
    def tokens(self, n):
        return [self.rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(n)]

    @property
    def grid(self):
        """SGLang's checkpoint grid for the tiny model at this page size (tokens):
        ``mamba_checkpoint_grid(page) = lcm(mamba_cache_chunk_size() = 8, page)``."""
        return math.lcm(8, self.PAGE)

    def floor(self, n):
        return n - n % self.PAGE

    def batch(self, prompts, new_tokens):
        """One ``/generate`` call with every prompt (they queue together)."""
        body = {
            "input_ids": prompts,
            "sampling_params": [{"temperature": 0, "max_new_tokens": m, "ignore_eos": True} for m in new_tokens],
        }
        r = requests.post(self.server.base_url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        return r.json()

    def cold(self, ids, new_tokens):
        """Greedy output of ``ids`` with nothing cached (a fresh ``cache_salt``)."""
        type(self).salt += 1
        out = self.server.generate(input_ids=ids, max_new_tokens=new_tokens, cache_salt=f"cold-{self.salt}")
        self.assertEqual(out["meta_info"]["cached_tokens"], 0)
        return out["output_ids"]

    def probe(self, ids, expected_hit, seen, new_tokens=2):
        """Send ``ids`` alone; its hit must be ``expected_hit``. The output is kept in
        ``seen`` for :meth:`check_cold` (cold runs come last: their states would push the
        states under test out of the small SSM pool)."""
        out = self.server.generate(input_ids=ids, max_new_tokens=new_tokens)
        self.assertEqual(out["meta_info"]["cached_tokens"], expected_hit, f"prompt of {len(ids)} tokens")
        seen.append((ids, new_tokens, out["output_ids"]))
        return out

    def check_cold(self, seen):
        for ids, new_tokens, output_ids in seen:
            self.assertEqual(output_ids, self.cold(ids, new_tokens), f"prompt of {len(ids)} tokens")

    def check_batch(self, lens, new_tokens):
        prompts = [self.tokens(n) for n in lens]
        outs = self.batch(prompts, new_tokens)
        seen = []
        for p, o, m in zip(prompts, outs, new_tokens):
            self.assertEqual(o["meta_info"]["cached_tokens"], 0)
            seen.append((p, m, o["output_ids"]))
        for p, o, m in zip(prompts, outs, new_tokens):
            # The continuation first: a resend would leave its own (identical greedy)
            # outputs' state on the continuation's path.
            done = len(p) + m - 1
            if done % self.PAGE == 0:
                self.probe(p + o["output_ids"] + self.tokens(3), done, seen)
            self.probe(p, self.floor(len(p) - 1), seen)
        self.check_cold(seen)

    def new_tokens_on_grid(self, prompt_len, at_least):
        """Output lengths ``m >= at_least`` with ``prompt_len + m - 1`` on the page grid."""
        m = at_least
        while (prompt_len + m - 1) % self.PAGE:
            m += 1
        return m

    # -- tests -----------------------------------------------------------------------
    def test_a_batches_resend_and_continue_exactly(self):
        for lens in self.SHAPES:
            with self.subTest(lens=lens):
                new = [self.new_tokens_on_grid(n, self.rng.choice([1, 2, 5])) for n in lens]
                self.check_batch(list(lens), new)

    def test_b_branch_point_in_a_later_chunk(self):
        """``shared`` is cached without a state near its end; a batched request extending it
        plants the branch-point checkpoint in its second chunk (the chunk it shares with
        a filler's first one), and a sibling sent alone hits it."""
        for shared_len, filler_len in ((100, 127), (90, 112), (115, 60)):
            with self.subTest(shared=shared_len, filler=filler_len):
                shared = self.tokens(shared_len)
                # The first request runs past the chunk holding the end of ``shared``
                # (132 > 2 chunks of 64), so SGLang's chunk tracking saves no state
                # between 64 and the branch point.
                first_ids = shared + self.tokens(132 - shared_len)
                first = self.server.generate(input_ids=first_ids, max_new_tokens=2)
                self.assertEqual(first["meta_info"]["cached_tokens"], 0)
                child = shared + self.tokens(9)
                filler = self.tokens(filler_len)
                outs = self.batch([filler, child], [2, 2])
                # The child hits the deepest state of the first request inside ``shared``,
                # not yet the branch point: SGLang's chunk tracking saves one state per
                # chunk, at the chunk's last multiple of the checkpoint grid.
                starts = range(0, len(first_ids), self.CHUNK)
                tracked = [a + (min(a + self.CHUNK, len(first_ids)) - a) // self.grid * self.grid for a in starts]
                inside = max([t for t in tracked if t <= shared_len], default=0)
                self.assertLess(inside, self.floor(shared_len))
                self.assertEqual(outs[1]["meta_info"]["cached_tokens"], inside)
                seen = [(child, 2, outs[1]["output_ids"]), (filler, 2, outs[0]["output_ids"])]
                self.probe(shared + self.tokens(7), self.floor(shared_len), seen)
                self.probe(child, self.floor(len(child) - 1), seen)
                self.check_cold(seen)

    def test_z_idle_without_leaks(self):
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0)
        self.assertEqual(unexpected_tracebacks(self.server.log_text()), [])


class TestBatchedCheckpoints(_BatchedCheckpoints):
    __test__ = True
    PAGE = 1
    SHAPES = _BatchedCheckpoints.SHAPES[:7]  # 23 prompts (the suite's time budget, docs/testing.md)


class TestBatchedCheckpointsPaged(_BatchedCheckpoints):
    """``--page-size 16``: every inserted state on a whole page."""

    __test__ = True
    PAGE = 16
    SHAPES = _BatchedCheckpoints.SHAPES[:5]  # the page floor is what differs; fewer shapes


class TestBatchedCheckpointsPage4(_BatchedCheckpoints):
    """``--page-size 4``: not a multiple of SGLang's 8-token checkpoint grid (the tiny
    model's state chunk); prefix checkpoints land on 4-token pages, SGLang's own on the
    8-token grid. (A page size that neither divides nor is a multiple of the state chunk,
    e.g. 12, is refused at start-up: ``test_sglang_glue``.)"""

    __test__ = True
    PAGE = 4
    SHAPES = _BatchedCheckpoints.SHAPES[:3]  # the page floor is what differs (the suite's time budget)
