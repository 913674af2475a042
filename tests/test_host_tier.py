"""The host tier of the tree's SSM states in the core (issue 26, ``docs/design.md``, "Host
tier"): a working set larger than the device pool comes back from the host on its second
pass, each write policy copies when it says, and the host tier evicts in the policy's order.
Driven by ``cache_sim`` (exact states: every node's device state and host copy are checked
against the tokens they summarise)."""

import unittest

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq

PROMPTS = [[i] * 6 + [9, 9] for i in range(1, 7)]


def run(sim, prompts, rid):
    """Each prompt as one request (prefill, no decode, finish); returns the hits."""
    hits = []
    for i, p in enumerate(prompts):
        req = CacheReq(f"{rid}{i}", list(p))
        assert sim.admit(req, prompt_len=len(p))
        hits.append(req.cache_protected_len)
        sim.extend_kv(req, len(p))
        sim.forward(req, len(p) - req.kv_committed_len)
        sim.release(req)
        sim.check_tree()
        sim.cache.check_slot_accounting()
        sim.cache.sanity_check()
    return hits


class TestHostTier(unittest.TestCase):
    def make(self, policy, host_size=12, **kw):
        cache = make_cache(kv_size=400, mamba_size=4, track_slots=0, host_size=host_size, branch_checkpoints=True,
                           hicache_write_policy=policy, **kw)
        return cache, SimModel(cache)

    def test_second_pass_comes_back_from_the_host(self):
        for policy in ("write_through", "write_back"):
            with self.subTest(policy=policy):
                cache, sim = self.make(policy)
                self.assertEqual(run(sim, PROMPTS, "a"), [0] * 6)
                # two states a prompt (prompt length - 1, finish): 12 > 4 device slots; write_through
                # copied every one, write_back the 8 the device tier evicted
                self.assertEqual(cache.mamba_total_size(), 4)
                self.assertEqual(cache.host_states(), 12 if policy == "write_through" else 8)
                self.assertEqual(cache.host_loads_total, 0)
                self.assertEqual(run(sim, PROMPTS, "b"), [7] * 6)
                self.assertEqual(cache.host_loads_total, 6)
                self.assertEqual(cache.mamba_pool.available_size() + cache.mamba_total_size(), 4)

    def test_when_each_policy_copies(self):
        cache, sim = self.make("write_through")
        run(sim, PROMPTS[:1], "a")
        # both states copied as they entered the tree, none evicted yet
        self.assertEqual((cache.host_backups_total, cache.host_demotions_total), (2, 0))
        cache, sim = self.make("write_back")
        run(sim, PROMPTS[:1], "a")
        self.assertEqual(cache.host_backups_total, 0)
        run(sim, PROMPTS[1:3], "b")  # 6 states in 4 device slots: the first two go to the host
        self.assertEqual((cache.host_backups_total, cache.host_demotions_total), (2, 2))
        self.assertEqual(cache.evicted_states_total, 2)

    def test_selective_keeps_only_states_resumed_from(self):
        cache, sim = self.make("write_through_selective")
        run(sim, PROMPTS[:1], "a")
        self.assertEqual(cache.host_backups_total, 0)
        run(sim, PROMPTS[:1], "b")  # the prompt - 1 state is hit: now it has a host copy
        self.assertEqual(cache.host_backups_total, 1)
        run(sim, PROMPTS[1:4], "c")  # pressure: the hit state is demoted, the others dropped
        self.assertEqual(run(sim, PROMPTS[:1], "d"), [7])
        self.assertGreaterEqual(cache.host_loads_total, 1)

    def test_host_tier_evicts_in_the_policy_order(self):
        """A host tier of 3 holding prompt 1's two copies, the older (its prompt - 1 state)
        ranked higher; prompt 2's two states need one more slot: it evicts the least
        recently used copy under LRU, the lowest ranked one under the recompute policy."""
        for policy, evicted in (("lru", "older"), ("recompute", "newer")):
            with self.subTest(policy=policy):
                cache, sim = self.make("write_through", host_size=3, eviction_policy=policy)
                run(sim, PROMPTS[:1], "a")
                older, newer = sorted((n for n in cache.nodes() if n.mamba_host_value is not None), key=lambda n: n.seq_len)
                older.priority, newer.priority = 5.0, 1.0
                run(sim, PROMPTS[1:2], "b")
                gone = {"older": older, "newer": newer}[evicted]
                kept = newer if gone is older else older
                self.assertIsNone(gone.mamba_host_value)
                self.assertIsNotNone(kept.mamba_host_value)
                self.assertEqual(cache.host_evicted_total, 1)

    def test_flush_gives_every_host_slot_back(self):
        cache, sim = self.make("write_through")
        run(sim, PROMPTS, "a")
        self.assertEqual(cache.mamba_host_pool.available_size(), 0)
        # what /flush_cache does: the tree reset, then every pool cleared
        cache.reset()
        cache.token_to_kv_pool_allocator.clear()
        cache.req_to_token_pool.clear()
        cache.mamba_pool.clear_all()
        cache.mamba_host_pool.clear_all()
        self.assertEqual(cache.mamba_host_pool.available_size(), 12)
        self.assertEqual(run(sim, PROMPTS[:1], "b"), [0])


if __name__ == "__main__":
    unittest.main()
