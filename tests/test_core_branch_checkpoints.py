"""Branch-point and prompt-end checkpoints, and the recompute-aware eviction policy
(issue 6), on the core cache with the exact content oracle of ``cache_sim``."""

import unittest

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq, RadixKey

SYS = list(range(1000, 1040))  # a 40-token "system prompt"


def user(i, n=6):
    return [2000 + 100 * i + k for k in range(n)]


class TestBranchCheckpoints(unittest.TestCase):
    def test_shared_system_prompt_gets_a_state_at_the_branch(self):
        """R1 = S + u1 leaves a state only at its end; R2 = S + u2 finds S as KV without a
        state (the branch point), saves its state there, and R3 = S + u3 then hits all of
        S. Without branch checkpoints R3 hits nothing."""
        for branch in (False, True):
            cache = make_cache(kv_size=512, mamba_size=32, branch_checkpoints=branch)
            sim = SimModel(cache)
            sim.run(SYS + user(1), [7, 7], rid="r1")
            r2 = CacheReq(rid="r2", token_ids=SYS + user(2))
            self.assertTrue(sim.admit(r2))
            self.assertEqual(r2.cache_protected_len, 0)
            self.assertEqual(sim.last_match.mamba_branching_seqlen, len(SYS))
            if branch:
                self.assertEqual([c for c, _ in r2.mamba_prefix_checkpoints], [len(SYS), len(SYS) + 5])
            else:
                self.assertEqual(r2.mamba_prefix_checkpoints, [])
            self.assertTrue(sim.prefill(r2))
            sim.decode(r2, [8, 8])
            cache.cache_finished_req(r2)
            r3 = CacheReq(rid="r3", token_ids=SYS + user(3))
            self.assertTrue(sim.admit(r3))
            self.assertEqual(r3.cache_protected_len, len(SYS) if branch else 0)
            self.assertTrue(sim.prefill(r3))  # checks the COW'd state is S's exactly
            cache.cache_finished_req(r3)
            sim.check_tree()
            cache.sanity_check()
            cache.check_slot_accounting()

    def test_identical_prompt_hits_all_but_one_token(self):
        """The prompt-end checkpoint (length - 1) lets a resent identical prompt hit
        len - 1 tokens; the next turn (prompt + output + more) hits the previous turn's
        end state."""
        cache = make_cache(kv_size=512, mamba_size=32, branch_checkpoints=True)
        sim = SimModel(cache)
        prompt = SYS + user(1)
        first = sim.run(prompt, [5, 6, 7], rid="first")
        again = CacheReq(rid="again", token_ids=list(prompt))
        self.assertTrue(sim.admit(again))
        self.assertEqual(again.cache_protected_len, len(prompt) - 1)
        self.assertTrue(sim.prefill(again))
        cache.cache_finished_req(again)
        # Next turn: the previous sequence (prompt + output; the last output token was never
        # fed to the model) plus a new user message.
        turn2 = CacheReq(rid="turn2", token_ids=prompt + [5, 6, 7] + user(2))
        self.assertTrue(sim.admit(turn2))
        self.assertEqual(turn2.cache_protected_len, len(prompt) + 2)
        self.assertTrue(sim.prefill(turn2))
        cache.cache_finished_req(turn2)
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_checkpoint_inside_a_chunk_equals_unchunked_prefix_state(self):
        """A checkpoint at a position inside a prefill chunk holds exactly the state of the
        prompt's first p tokens (the oracle), and chunked prefill commits it."""
        cache = make_cache(kv_size=512, mamba_size=32, branch_checkpoints=True, mamba_track_interval=16)
        sim = SimModel(cache)
        sim.run(SYS + user(1), [1], rid="r1")
        r2 = CacheReq(rid="r2", token_ids=SYS + user(2, 30))
        self.assertTrue(sim.admit(r2))
        planned = [c for c, _ in r2.mamba_prefix_checkpoints]
        self.assertEqual(planned, [len(SYS), len(SYS) + 29])
        self.assertTrue(sim.prefill(r2, chunk=13))  # 40 lies inside the 4th chunk
        cache.cache_finished_req(r2)
        node = cache.match_prefix(RadixKey(SYS)).last_node
        self.assertEqual(node.seq_len, len(SYS))
        sim.check_state(node.mamba_value, SYS, "branch checkpoint")
        sim.check_tree()
        cache.check_slot_accounting()

    def test_max_states_per_path_and_abort(self):
        """With max_states_per_path the plan stops at the bound; an aborted request frees
        its planned checkpoint slots."""
        cache = make_cache(kv_size=512, mamba_size=32, branch_checkpoints=True, max_states_per_path=1)
        sim = SimModel(cache)
        sim.run(SYS + user(1), [1, 2], rid="r1")
        r2 = CacheReq(rid="r2", token_ids=SYS + user(1) + [1] + user(3))
        self.assertTrue(sim.admit(r2))  # hits r1's end state: one state on the path
        self.assertGreater(r2.cache_protected_len, 0)
        self.assertEqual(r2.mamba_prefix_checkpoints, [])
        r3 = CacheReq(rid="r3", token_ids=SYS + user(4))
        free = cache.mamba_pool.available_size()
        self.assertTrue(sim.admit(r3))
        self.assertEqual(len(r3.mamba_prefix_checkpoints), 1)  # bound 1, nothing on its path
        cache.release_req(r3)
        cache.release_req(r2)
        self.assertEqual(cache.mamba_pool.available_size(), free + 3)
        cache.sanity_check()
        cache.check_slot_accounting()


class TestRecomputePolicy(unittest.TestCase):
    def _fill(self, policy):
        """A deep shared-prefix state (the system prompt branch point, used long ago) and
        several newer short leaves; then pressure for one SSM slot."""
        cache = make_cache(
            kv_size=1024, mamba_size=16, branch_checkpoints=True, eviction_policy=policy
        )
        sim = SimModel(cache)
        sim.run(SYS + user(0), [1], rid="a")
        sim.run(SYS + user(1), [1], rid="b")  # saves the state at len(SYS)
        for i in range(2, 6):
            sim.run([3000 + 10 * i, 3001 + 10 * i, 3002 + 10 * i], [1], rid=f"short{i}")
        return cache, sim

    def test_recompute_keeps_the_deep_state(self):
        results = {}
        for policy in ("lru", "recompute"):
            cache, sim = self._fill(policy)
            # Find the system-prompt state without touching it.
            node = cache.root_node.children[SYS[0]]
            self.assertEqual((node.seq_len, node.mamba_value is not None), (len(SYS), True))
            # Evict as many states as LRU needs to reach it.
            k = sum(
                1 for link in cache.mamba_lru_list if link.owner.last_access_time <= node.last_access_time
            )
            before = cache.mamba_total_size()
            cache.evict(mamba_num=k)
            self.assertEqual(cache.mamba_total_size(), before - k)
            results[policy] = cache.match_prefix(RadixKey(SYS + [0])).prefix_len
            sim.check_tree()
            cache.sanity_check()
            cache.check_slot_accounting()
        # LRU drops the old deep state; the recompute policy drops cheap states instead.
        self.assertEqual(results["recompute"], len(SYS))
        self.assertEqual(results["lru"], 0)

    def test_bad_policy(self):
        with self.assertRaises(ValueError):
            make_cache(eviction_policy="lfu")


if __name__ == "__main__":
    unittest.main()
