"""The adaptive eviction policy (``eviction.AdaptiveEviction``, issue 16) on the core cache:
what it learns per class of states, the exact victim order it gives in a small shared-prompt
scenario, and which matches count as hits."""

import unittest

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq, RadixKey
from sglang_mamba_ext.mem_cache.eviction import AdaptiveEviction

SYS = list(range(1000, 1040))  # a 40-token "system prompt"
S = len(SYS)


def user(i, n=6):
    return [2000 + 100 * i + k for k in range(n)]


BRANCH, PROMPT_END, FINISH = ("branch", False), ("prompt_end", True), ("finish", True)


class TestAdaptiveEviction(unittest.TestCase):
    def _four_requests(self):
        """r0..r3 = SYS + user(i), one output token each (never forwarded, so each
        finished sequence leaves its state at its prompt's end, 46 tokens), no eviction.

        r0 leaves a prompt-end state (45, nothing above it: top-level) and a finish state
        (46, nested). r1 finds SYS as KV without a state: a branch-point state at 40
        (top-level), then its prompt-end (45) and finish (46) states, nested. r2 and r3 hit
        the branch point (its hits 1, then 2) and leave nested prompt-end and finish
        states."""
        cache = make_cache(kv_size=1024, mamba_size=32, track_slots=0, branch_checkpoints=True,
                           eviction_policy="adaptive")
        sim = SimModel(cache)
        for i in range(4):
            sim.run(SYS + user(i), [1], rid=f"r{i}")
        return cache, sim

    def _states(self, cache):
        """``{(first user token or None for the branch point, seq_len): node}``."""
        out = {}
        for n in cache.nodes():
            if n.mamba_value is not None:
                first = None if n.seq_len == S else _path_tokens(n)[S]
                out[(first, n.seq_len)] = n
        return out

    def test_learned_counts_and_expected_hits(self):
        cache, _ = self._four_requests()
        pol = cache._eviction
        self.assertIsInstance(pol, AdaptiveEviction)
        self.assertEqual(
            {k: v for k, v in pol.reached.items()},
            {
                (BRANCH, 0): 1, (BRANCH, 1): 1, (BRANCH, 2): 1,
                (("prompt_end", False), 0): 1, (PROMPT_END, 0): 3, (FINISH, 0): 4,
            },
        )
        self.assertEqual(pol.more, {})
        # Laplace-smoothed chain (class docstring), by hand:
        # branch at 2 hits: p = (0 + 1) / (1 + 0 + 2) = 1/3, E = p / (1 - p) = 1/2.
        self.assertAlmostEqual(pol.expected_hits(BRANCH, 2), 0.5)
        # an empty class: p = 1/2 at every step, E(2) = 1, E(1) = 1/2 * 2, E(0) = 1/2 * 2.
        self.assertAlmostEqual(pol.expected_hits(("boundary", True), 0), 1.0)
        # nested prompt-end, 3 stored, none hit: E(0) = (0 + 1) / (3 + 2) * (1 + E(1) = 1).
        self.assertAlmostEqual(pol.expected_hits(PROMPT_END, 0), 0.4)
        self.assertAlmostEqual(pol.expected_hits(FINISH, 0), 2 / 6)
        self.assertAlmostEqual(pol.expected_hits(("prompt_end", False), 0), 2 / 3)
        by = self._states(cache)
        # priority = L (0: nothing evicted yet) + E * tokens back to the nearest state.
        self.assertAlmostEqual(pol.priority_of(by[(None, S)]), 0.5 * S)
        self.assertAlmostEqual(pol.priority_of(by[(2100, S + 5)]), 0.4 * 5)
        self.assertAlmostEqual(pol.priority_of(by[(2100, S + 6)]), (2 / 6) * 1)
        # r0's prompt-end state lies under the branch point now: 5 tokens saved.
        self.assertAlmostEqual(pol.priority_of(by[(2000, S + 5)]), (2 / 3) * 5)
        cache.sanity_check()

    def test_exact_victim_order(self):
        """Finish states (E 1/3, 1 token each) go first, least recent first; then the nested
        prompt-end states (0.4 * 5), then r0's top-level one (2/3 * 5), the shared branch
        point last (1/2 * 40). LRU would drop the branch point before r3's states."""
        cache, sim = self._four_requests()
        order = []
        for _ in range(9):
            before = {(f, n) for (f, n) in self._states(cache)}
            res = cache.evict(mamba_num=1)
            self.assertEqual(res.mamba_num_evicted, 1)
            gone = before - set(self._states(cache))
            self.assertEqual(len(gone), 1)
            order.append(gone.pop())
            sim.check_tree()
            cache.sanity_check()
            cache.check_slot_accounting()
        self.assertEqual(
            order,
            [(2000, S + 6), (2100, S + 6), (2200, S + 6), (2300, S + 6),
             (2100, S + 5), (2200, S + 5), (2300, S + 5), (2000, S + 5),
             (None, S)],
        )
        # The inflation value is the highest victim priority so far.
        self.assertAlmostEqual(cache._eviction.inflation, 0.5 * S)

    def test_lru_drops_the_shared_prefix_earlier(self):
        """The same scenario under LRU: the branch point, last hit by r3's admission, goes
        before r3's own two states (the contrast the victim-order test relies on)."""
        cache = make_cache(kv_size=1024, mamba_size=32, track_slots=0, branch_checkpoints=True)
        sim = SimModel(cache)
        for i in range(4):
            sim.run(SYS + user(i), [1], rid=f"r{i}")
        cache.evict(mamba_num=7)
        left = sorted(n.seq_len for n in cache.nodes() if n.mamba_value is not None)
        self.assertEqual(left, [S + 5, S + 6])  # r3's states; the branch point is gone

    def test_hits_count_once_per_request(self):
        """Only a request's first copy-on-write match is a hit: a match without COW (the
        scheduler's sorting) and a repeated match of a request that already has its slot
        are not."""
        cache, sim = self._four_requests()
        branch = self._states(cache)[(None, S)]
        self.assertEqual(branch.hits, 2)
        key = RadixKey(SYS + user(9))
        cache.match_prefix(key)  # no COW
        self.assertEqual(branch.hits, 2)
        req = CacheReq(rid="x", token_ids=SYS + user(9))
        m = cache.match_prefix(key, cow_mamba=True, req=req)
        self.assertEqual((m.prefix_len, branch.hits), (S, 3))
        cache.match_prefix(key, cow_mamba=True, req=req)  # waiting, matched again
        self.assertEqual(branch.hits, 3)
        self.assertEqual(cache._eviction.more, {BRANCH: 1.0})
        cache.on_release(req)
        cache.sanity_check()

    def test_counts_are_halved_every_half_life(self):
        cache = make_cache(kv_size=1024, mamba_size=32, track_slots=0, branch_checkpoints=True,
                           eviction_policy="adaptive")
        cache._eviction.HALF_LIFE = 4
        sim = SimModel(cache)
        sim.run(SYS + user(0), [1], rid="r0")  # 2 stores
        # 3 more: branch point, prompt end (the 4th store: every count halved), finish
        sim.run(SYS + user(1), [1], rid="r1")
        self.assertEqual(cache._eviction.stores, 5)
        self.assertEqual(
            cache._eviction.reached,
            {
                (("prompt_end", False), 0): 0.5, (FINISH, 0): 1.5,
                (BRANCH, 0): 0.5, (PROMPT_END, 0): 0.5,
            },
        )

    def test_reset_forgets(self):
        cache, _ = self._four_requests()
        cache.reset()
        pol = cache._eviction
        self.assertEqual((pol.reached, pol.more, pol.stores, pol.inflation), ({}, {}, 0, 0.0))


class TestAdmission(unittest.TestCase):
    """``AdaptiveEviction.admits`` (issue 38): with the SSM pool full, a planned prefix
    checkpoint evicts a cached state only when its own priority ``L + E[hits | class, 0] *
    saved`` is above the next victim's."""

    def _full(self, prompt_end_stored=None):
        """The four-request scenario of :class:`TestAdaptiveEviction` (lowest priority: the
        finish states, 1/3 each), the pool's free slots taken; ``prompt_end_stored`` overrides
        how many nested prompt-end states were stored with no hit (3 there)."""
        cache = make_cache(kv_size=1024, mamba_size=32, track_slots=0, branch_checkpoints=True,
                           eviction_policy="adaptive")
        sim = SimModel(cache)
        for i in range(4):
            sim.run(SYS + user(i), [1], rid=f"r{i}")
        pol = cache._eviction
        if prompt_end_stored is not None:
            pol.reached[(PROMPT_END, 0)] = prompt_end_stored
            pol._expected.clear()
        taken = cache.mamba_pool.alloc_list(cache.mamba_pool.available_size())
        self.assertEqual(cache.mamba_pool.available_size(), 0)
        return cache, sim, pol, taken

    def test_admits_compares_with_the_victim(self):
        cache, _, pol, _ = self._full()
        # nested prompt-end, E(0) = 0.4: 0.4 * 5 = 2 > 1/3 (a finish state)
        self.assertTrue(pol.admits(PROMPT_END, 5))
        # 0.4 * 0 = 0 < 1/3: a state that saves nothing never evicts one
        self.assertFalse(pol.admits(PROMPT_END, 0))
        cache, _, pol, _ = self._full(prompt_end_stored=48)
        # learned: E(0) = 1/50 * (1 + 1) = 0.04, 0.04 * 5 = 0.2 < 1/3
        self.assertAlmostEqual(pol.expected_hits(PROMPT_END, 0), 0.04)
        self.assertFalse(pol.admits(PROMPT_END, 5))
        self.assertTrue(pol.admits(BRANCH, 5))  # E(0) of the branch class is above 1/15

    def test_planning_skips_what_would_rank_below_the_victim(self):
        """A fifth request hits the branch point (40 tokens) and plans its prompt-end
        checkpoint (45) only while that class is worth evicting a finish state for."""
        for stored, planned in ((None, [S + 5]), (48, [])):
            with self.subTest(prompt_end_stored=stored):
                cache, sim, pol, taken = self._full(stored)
                cache.mamba_pool.free(taken[:1])  # the fifth request's working slot
                r = CacheReq(rid="r4", token_ids=SYS + user(4))
                self.assertTrue(sim.admit(r))
                self.assertEqual(r.cache_protected_len, S)
                self.assertEqual([c for c, _ in r.mamba_prefix_checkpoints], planned)
                sim.release(r, checkpoint=False)
                cache.mamba_pool.free(taken[1:])
                cache.sanity_check()
                cache.check_slot_accounting()

    def test_lru_admits_everything(self):
        cache = make_cache(kv_size=1024, mamba_size=8, track_slots=0, branch_checkpoints=True)
        self.assertTrue(cache._eviction.admits(PROMPT_END, 0))


def _path_tokens(node):
    """The token ids from the root to the end of ``node``."""
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return [t for k in reversed(keys) for t in k]


if __name__ == "__main__":
    unittest.main()
