"""Message-boundary checkpoints (issue 16, item 2) on the core cache, with the exact content
oracle of ``cache_sim``: a request that names the offsets where its messages end leaves a
state there, so the first request sharing a system prompt with it already hits it;
positions are floored to pages, kept inside the unprotected prompt, planned after the
branch point and prompt length - 1, and within ``max_states_per_path``."""

import unittest

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq

SYS = list(range(1000, 1041))  # a 41-token "system prompt" (off a 4-token page)


def user(i, n=6):
    return [2000 + 100 * i + k for k in range(n)]


def states(cache):
    out, stack = [], [cache.root_node]
    while stack:
        n = stack.pop()
        for c in n.children.values():
            if c.mamba_value is not None:
                out.append(c.seq_len)
            stack.append(c)
    return sorted(out)


class TestBoundaryCheckpoints(unittest.TestCase):
    def first_then_second(self, page_size=1, boundaries=(), **kw):
        """R1 = SYS + u1 (naming ``boundaries``), then R2 = SYS + u2: R2's hit."""
        cache = make_cache(kv_size=512, mamba_size=32, page_size=page_size, branch_checkpoints=True, **kw)
        sim = SimModel(cache)
        r1 = CacheReq(rid="r1", token_ids=SYS + user(1))
        self.assertTrue(sim.admit(r1, boundaries=boundaries))
        planned = [c for c, _ in r1.mamba_prefix_checkpoints]
        self.assertTrue(sim.prefill(r1))
        sim.decode(r1, [7, 7])
        sim.release(r1)
        r2 = CacheReq(rid="r2", token_ids=SYS + user(2))
        self.assertTrue(sim.admit(r2))
        hit = r2.cache_protected_len
        self.assertTrue(sim.prefill(r2))  # checks the copied state is exactly SYS[:hit]'s
        sim.release(r2)
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()
        return cache, planned, hit

    def test_first_sharer_hits_the_boundary(self):
        cache, planned, hit = self.first_then_second(boundaries=[len(SYS)])
        self.assertEqual(planned, [len(SYS), len(SYS) + 5])
        self.assertEqual(hit, len(SYS))
        self.assertEqual(cache.stats.states_stored["boundary"], 1)

    def test_without_boundaries_the_first_sharer_misses(self):
        _, planned, hit = self.first_then_second()
        self.assertEqual(planned, [len(SYS) + 5])
        self.assertEqual(hit, 0)

    def test_boundary_floored_to_the_page(self):
        _, planned, hit = self.first_then_second(page_size=4, boundaries=[len(SYS)])
        floor = len(SYS) - len(SYS) % 4
        self.assertEqual(planned, [floor, (len(SYS) + 5) - (len(SYS) + 5) % 4])
        self.assertEqual(hit, floor)

    def test_positions_outside_the_unprotected_prompt_are_dropped(self):
        """Offsets at or below ``cache_protected_len`` (already cached), at or past the
        prompt length, or equal to another planned position are not planned (again)."""
        cache = make_cache(kv_size=512, mamba_size=32, branch_checkpoints=True)
        sim = SimModel(cache)
        r1 = CacheReq(rid="r1", token_ids=SYS + user(1))
        self.assertTrue(sim.admit(r1, boundaries=[20]))
        self.assertTrue(sim.prefill(r1))
        sim.release(r1)
        n = len(SYS) + 8
        r2 = CacheReq(rid="r2", token_ids=SYS + user(2, 8))
        self.assertTrue(sim.admit(r2, boundaries=[10, 20, len(SYS), n - 1, n, n + 3, 30, 30]))
        self.assertEqual(r2.cache_protected_len, 20)
        self.assertEqual([c for c, _ in r2.mamba_prefix_checkpoints], [30, len(SYS), n - 1])
        origins = [cache._prefix_origin[s] for _, s in r2.mamba_prefix_checkpoints]
        # the branch point (R1's KV runs to len(SYS)) keeps its kind; prompt - 1 likewise
        self.assertEqual(origins, ["boundary", "branch", "prompt_end"])
        self.assertTrue(sim.prefill(r2))
        sim.release(r2)
        sim.check_tree()
        cache.check_slot_accounting()

    def test_per_path_cap_budget(self):
        """Under ``max_states_per_path`` a request plans boundaries only while its path
        keeps room for them, its prompt - 1 checkpoint and its finish state, in the order
        given; the cap then drops nothing. Unbounded (0) plans them all."""
        for cap, expect in ((0, [10, 20, 30]), (4, [30, 10]), (3, [30]), (2, [])):
            with self.subTest(cap=cap):
                cache = make_cache(kv_size=512, mamba_size=32, branch_checkpoints=True, max_states_per_path=cap)
                sim = SimModel(cache)
                r1 = CacheReq(rid="r1", token_ids=SYS + user(1))
                self.assertTrue(sim.admit(r1, boundaries=[30, 10, 20]))
                planned = [c for c, _ in r1.mamba_prefix_checkpoints]
                self.assertEqual(planned, sorted(expect + [len(SYS) + 5]))
                self.assertTrue(sim.prefill(r1))
                sim.decode(r1, [7, 7])
                sim.release(r1)
                self.assertEqual(states(cache), sorted(expect + [len(SYS) + 5, len(SYS) + 7]))
                sim.check_tree()
                cache.check_slot_accounting()

    def test_budget_counts_states_already_on_the_path(self):
        cache = make_cache(kv_size=512, mamba_size=32, branch_checkpoints=True, max_states_per_path=4)
        sim = SimModel(cache)
        sim.run(SYS[:20], [7], rid="r0")  # states at 19 (prompt - 1) and 20 (finish)
        self.assertEqual(states(cache), [19, 20])
        r1 = CacheReq(rid="r1", token_ids=SYS + user(1))
        self.assertTrue(sim.admit(r1, boundaries=[30, 35]))
        self.assertEqual(r1.cache_protected_len, 20)
        # 4 - 2 on the path - 1 (prompt - 1) - 1 (finish): no boundary
        self.assertEqual([c for c, _ in r1.mamba_prefix_checkpoints], [len(SYS) + 5])
        sim.release(r1, checkpoint=False)
        cache.check_slot_accounting()

    def test_boundaries_yield_slots_to_prompt_end(self):
        """With one free SSM slot beyond the request's own three and nothing to evict, the
        prompt - 1 checkpoint gets it and the boundary is dropped."""
        cache = make_cache(kv_size=512, mamba_size=4, branch_checkpoints=True)
        sim = SimModel(cache)
        r1 = CacheReq(rid="r1", token_ids=SYS + user(1))
        self.assertTrue(sim.admit(r1, boundaries=[len(SYS)]))
        self.assertEqual([c for c, _ in r1.mamba_prefix_checkpoints], [len(SYS) + 5])
        sim.release(r1, checkpoint=False)
        cache.check_slot_accounting()

    def test_chunked_prefill_writes_the_boundary_state(self):
        """A boundary inside a later chunk: the state there is the prompt prefix's exactly."""
        cache = make_cache(kv_size=512, mamba_size=32, branch_checkpoints=True, mamba_track_interval=16)
        sim = SimModel(cache)
        r1 = CacheReq(rid="r1", token_ids=SYS + user(1, 30))
        self.assertTrue(sim.admit(r1, boundaries=[len(SYS)]))
        self.assertTrue(sim.prefill(r1, chunk=13))
        sim.release(r1)
        r2 = CacheReq(rid="r2", token_ids=SYS + user(2))
        self.assertTrue(sim.admit(r2))
        self.assertEqual(r2.cache_protected_len, len(SYS))
        self.assertTrue(sim.prefill(r2))
        sim.release(r2)
        sim.check_tree()
        cache.check_slot_accounting()


if __name__ == "__main__":
    unittest.main()
