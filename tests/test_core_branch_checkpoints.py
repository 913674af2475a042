"""Branch-point and prompt-end checkpoints, and the recompute-aware eviction policy
(issue 6), on the core cache with the exact content oracle of ``cache_sim``."""

import unittest

import torch

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
            sim.release(r2)
            r3 = CacheReq(rid="r3", token_ids=SYS + user(3))
            self.assertTrue(sim.admit(r3))
            self.assertEqual(r3.cache_protected_len, len(SYS) if branch else 0)
            self.assertTrue(sim.prefill(r3))  # checks the COW'd state is S's exactly
            sim.release(r3)
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
        sim.run(prompt, [5, 6, 7], rid="first")
        again = CacheReq(rid="again", token_ids=list(prompt))
        self.assertTrue(sim.admit(again))
        self.assertEqual(again.cache_protected_len, len(prompt) - 1)
        self.assertTrue(sim.prefill(again))
        sim.release(again)
        # Next turn: the previous sequence (prompt + output; the last output token was never
        # fed to the model) plus a new user message.
        turn2 = CacheReq(rid="turn2", token_ids=prompt + [5, 6, 7] + user(2))
        self.assertTrue(sim.admit(turn2))
        self.assertEqual(turn2.cache_protected_len, len(prompt) + 2)
        self.assertTrue(sim.prefill(turn2))
        sim.release(turn2)
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
        sim.release(r2)
        node = cache.match_prefix(RadixKey(SYS)).last_node
        self.assertEqual(node.seq_len, len(SYS))
        sim.check_state(node.mamba_value, SYS, "branch checkpoint")
        sim.check_tree()
        cache.check_slot_accounting()

    def test_max_states_per_path_keeps_forks_and_locked(self):
        """With max_states_per_path=2 (SGLang's --mamba-max-states-per-path), an insert that
        makes a third state on its path drops the shallowest surplus state — but never a
        fork (a branch point shared by several requests) nor a locked one."""
        cache = make_cache(kv_size=512, mamba_size=32, max_states_per_path=2)
        kv, pool = cache.token_to_kv_pool_allocator, cache.mamba_pool
        seq = list(range(100, 112))

        def put(n, tokens=None):
            tokens = tokens or seq[:n]
            m = cache.match_prefix(RadixKey(tokens))
            # Reuse the tree's KV where present, fresh slots for the rest.
            node = m.kv_last_node
            have = cache.path_device_indices(node) if node is not cache.root_node else torch.empty(0, dtype=torch.int64)
            value = torch.cat([have[: m.kv_match_len], kv.alloc(len(tokens) - m.kv_match_len)])
            return cache.insert(RadixKey(tokens), value, pool.alloc_list(1)[0], prev_prefix_len=m.kv_match_len)

        def states():
            out, stack = [], [cache.root_node]
            while stack:
                n = stack.pop()
                for c in n.children.values():
                    if c.mamba_value is not None:
                        out.append(c.seq_len)
                    stack.append(c)
            return sorted(out)

        put(4), put(8)
        self.assertEqual(states(), [4, 8])
        put(12)  # three on one path: the shallowest (4) goes, its KV stays
        self.assertEqual(states(), [8, 12])
        self.assertEqual(cache.match_prefix(RadixKey(seq[:4])).kv_match_len, 4)
        # A fork at 8: another branch from 8, then a deeper state on the first branch.
        put(10, seq[:8] + [7, 7])
        self.assertEqual(states(), [8, 10, 12])  # 8 is now a fork: kept on both paths
        cache.sanity_check()
        cache.check_slot_accounting()
        # A locked state survives too (cap 1).
        cache = make_cache(kv_size=512, mamba_size=32, max_states_per_path=1)
        kv, pool = cache.token_to_kv_pool_allocator, cache.mamba_pool
        r = put(4)
        cache.inc_lock_ref(r.last_node)
        put(8)
        self.assertEqual(states(), [4, 8])
        cache.dec_lock_ref(r.last_node)
        put(12)
        self.assertEqual(states(), [12])
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_abort_frees_planned_checkpoints(self):
        """A request aborted (or rejected) after planning frees its checkpoint slots."""
        cache = make_cache(kv_size=512, mamba_size=32, branch_checkpoints=True)
        sim = SimModel(cache)
        sim.run(SYS + user(1), [1, 2], rid="r1")
        r3 = CacheReq(rid="r3", token_ids=SYS + user(4))
        free = cache.mamba_pool.available_size()
        self.assertTrue(sim.admit(r3))
        self.assertEqual(len(r3.mamba_prefix_checkpoints), 2)
        self.assertEqual(cache.mamba_pool.available_size(), free - 5)  # 1 + 2 ping-pong + 2
        sim.release(r3, checkpoint=False)
        self.assertEqual(cache.mamba_pool.available_size(), free)
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


class TestVictimPriority(unittest.TestCase):
    """``MambaRadixCache.set_victim_priority`` (``eviction.PriorityEviction``): the caller's
    priority picks the victim, lowest first, ties to the least recent; ``None`` restores
    the policy named at construction."""

    def _three_states(self):
        cache = make_cache(kv_size=512, mamba_size=8, track_slots=0)
        sim = SimModel(cache)
        # Three independent leaves, oldest first; each keeps its state at its prompt's end
        # (the last output token is never forwarded): 3, 5 and 7 tokens.
        for i, n in enumerate((3, 5, 7)):
            sim.run([100 * (i + 1) + k for k in range(n)], [9], rid=f"r{i}")
        return cache, sim

    def _seq_lens(self, cache):
        return sorted(n.seq_len for n in cache.nodes() if n.mamba_value is not None)

    def test_lowest_priority_goes_and_locked_nodes_are_not_offered(self):
        cache, sim = self._three_states()
        seen = []

        def deepest_first(cands, for_kv):
            seen.append((sorted(c.seq_len for c in cands), for_kv))
            return [-c.seq_len for c in cands]

        cache.set_victim_priority(deepest_first)
        self.assertEqual(cache.eviction_policy, "lru")  # the configured name is kept
        deep = max(cache.nodes(), key=lambda n: n.seq_len)
        cache.inc_lock_ref(deep)  # the 7-token leaf: locked, never offered
        res = cache.evict(mamba_num=1)
        self.assertEqual(res.mamba_num_evicted, 1)
        self.assertEqual(seen, [([3, 5], False)])
        self.assertEqual(self._seq_lens(cache), [3, 7])  # the 5-token leaf went, not the LRU one
        cache.dec_lock_ref(deep)
        res = cache.evict(num_tokens=1)  # KV eviction asks with for_kv=True
        self.assertEqual(seen[-1], ([3, 7], True))
        self.assertEqual((res.num_tokens_evicted, self._seq_lens(cache)), (7, [3]))
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_ties_go_to_the_least_recent_and_none_restores_lru(self):
        cache, _ = self._three_states()
        cache.set_victim_priority(lambda cands, for_kv: [0.0] * len(cands))
        cache.evict(mamba_num=1)
        self.assertEqual(self._seq_lens(cache), [5, 7])  # oldest of equals: the first run
        # Make the 7-token state the most recent, the 5-token one the least.
        cache.match_prefix(RadixKey([300, 301, 302, 303, 304, 305, 306, 9]))
        cache.set_victim_priority(lambda cands, for_kv: [-c.seq_len for c in cands])
        cache.set_victim_priority(None)  # back to LRU: the 5-token state goes
        cache.evict(mamba_num=1)
        self.assertEqual(self._seq_lens(cache), [7])
        cache.sanity_check()
        cache.check_slot_accounting()


if __name__ == "__main__":
    unittest.main()
