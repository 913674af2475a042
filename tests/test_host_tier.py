"""The host tier of the tree's SSM states in the core (issue 26, ``docs/design.md``, "Host
tier"): a working set larger than the device pool comes back from the host on its second
pass, each write policy copies when it says, and the host tier evicts in the policy's order.
Driven by ``cache_sim`` (exact states: every node's device state and host copy are checked
against the tokens they summarise)."""

import unittest

import torch

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


def two_level_tree(**kw):
    """A cache of 3 SSM slots holding ``[1]*4`` and ``[1]*4 + [2]*4``, each with a state;
    returns ``(cache, the leaf's slot)``."""
    cache = make_cache(kv_size=64, mamba_size=3, track_slots=0, branch_checkpoints=True, **kw)
    kv, pool = cache.token_to_kv_pool_allocator, cache.mamba_pool
    a, b = pool.alloc_list(2)
    cache.insert([1, 1, 1, 1], kv.alloc(4), mamba_value=a)
    head = cache.match_prefix([1, 1, 1, 1]).device_indices
    cache.insert([1, 1, 1, 1, 2, 2, 2, 2], torch.cat([head, kv.alloc(4)]), mamba_value=b, prev_prefix_len=4)
    return cache, b


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

    def test_host_load_that_evicts_past_the_used_state(self):
        """A match through a host-only state into the middle of a leaf whose device state is
        the only one to evict, with no host copy (CI's randomized run found this): loading
        the host copy drops that leaf, and the KV-only node the match split off goes with
        it. The match reports the KV that is left (4 tokens, not 6), and the tree stays
        consistent."""
        cache, b = two_level_tree(host_size=4, hicache_write_policy="write_through_selective")
        pool = cache.mamba_pool
        first = CacheReq("r0", [1, 1, 1, 1, 5])
        cache.match_prefix([1, 1, 1, 1], cow_mamba=True, req=first)  # a hit: [1]*4's state gets a host copy
        pool.free([first.mamba_pool_idx])
        cache.match_prefix([1, 1, 1, 1, 2, 2, 2, 2])  # [2]*4's state touched last, no copy
        self.assertEqual(cache.evict(mamba_num=1).mamba_num_evicted, 1)  # [1]*4's state: demoted
        self.assertEqual((cache.host_states(), cache.mamba_total_size()), (1, 1))
        held = pool.alloc_list(2)  # running requests' slots: the device pool is full
        self.assertIsNotNone(held)
        req = CacheReq("r1", [1, 1, 1, 1, 2, 2, 9])
        m = cache.match_prefix([1, 1, 1, 1, 2, 2], cow_mamba=True, req=req)
        self.assertEqual((m.prefix_len, m.kv_match_len), (4, 4))
        self.assertIs(m.kv_last_node, m.last_node)
        self.assertEqual(req.mamba_pool_idx, b)  # the dropped leaf's slot, now the request's
        self.assertEqual((cache.host_loads_total, cache.mamba_total_size()), (1, 0))
        cache.sanity_check()
        pool.free(held + [req.mamba_pool_idx])
        cache.check_slot_accounting()

    def test_cow_slot_that_evicts_past_the_used_state(self):
        """The same without a host tier: the copy-on-write slot of a match that ends inside a
        leaf evicts that leaf's state (the only evictable one); the match reports 4 KV tokens,
        not the 6 it walked."""
        cache, b = two_level_tree()
        pool = cache.mamba_pool
        held = pool.alloc_list(1)
        req = CacheReq("r", [1, 1, 1, 1, 2, 2, 9])
        m = cache.match_prefix([1, 1, 1, 1, 2, 2], cow_mamba=True, req=req)
        self.assertEqual((m.prefix_len, m.kv_match_len, req.mamba_pool_idx), (4, 4, b))
        self.assertIs(m.kv_last_node, m.last_node)
        cache.sanity_check()
        pool.free(held + [req.mamba_pool_idx])
        cache.check_slot_accounting()

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


LONG = [[i] * 30 + [9, 9] for i in range(1, 7)]


def demoted_pair(kv_host_size=64):
    """A cache whose 16 KV tokens hold ``[1]*8`` then ``[2]*8`` (each with a state): the
    second insert moved the first's KV and state to the host tier. Returns the cache."""
    cache = make_cache(kv_size=16, mamba_size=4, track_slots=0, host_size=4, kv_host_size=kv_host_size)
    kv, pool = cache.token_to_kv_pool_allocator, cache.mamba_pool
    cache.insert([1] * 8, kv.alloc(8), mamba_value=pool.alloc_list(1)[0])
    cache.insert([2] * 8, kv.alloc(8), mamba_value=pool.alloc_list(1)[0])
    cache.evict(num_tokens=8)
    return cache


class TestHostKV(unittest.TestCase):
    """The host tier of attention KV: device KV eviction moves a device leaf's KV (and its
    state) to host memory; a copy-on-write match loads it back (``docs/design.md``, "Host
    tier")."""

    def test_second_pass_loads_kv_and_states_from_the_host(self):
        """6 prompts of 32 tokens against 80 device KV tokens: without a host KV tier the
        second pass hits nothing (the KV is gone); with one each prompt hits ``len - 1`` = 31,
        its 31 KV tokens loaded back (the sim checks every token and state copied)."""
        for page, policy, write in (
            (1, "lru", "write_through"), (2, "recompute", "write_back"), (1, "adaptive", "write_back"),
        ):
            with self.subTest(page=page, policy=policy, write=write):
                kw = dict(kv_size=80, mamba_size=4, track_slots=0, host_size=16, page_size=page,
                          branch_checkpoints=True, hicache_write_policy=write, eviction_policy=policy)
                cache = make_cache(kv_host_size=400, **kw)
                sim = SimModel(cache)
                self.assertEqual(run(sim, LONG, "a"), [0] * 6)
                self.assertGreater(cache.host_kv_tokens(), 0)
                want = 31 - 31 % page
                self.assertEqual(run(sim, LONG, "b"), [want] * 6)
                self.assertEqual(cache.host_kv_loaded_total, 6 * want)
                base = make_cache(**kw)
                bsim = SimModel(base)
                run(bsim, LONG, "a")
                self.assertEqual(run(bsim, LONG, "b"), [0] * 6)

    def test_eviction_moves_the_leaf_and_its_state(self):
        cache = demoted_pair()
        first = cache.root_node.children[1]
        self.assertIsNone(first.value)
        self.assertEqual(first.host_value.numel(), 8)
        self.assertIsNone(first.mamba_value)
        self.assertIsNotNone(first.mamba_host_value)
        self.assertEqual((cache.total_size(), cache.host_kv_tokens(), cache.host_kv_demoted_total), (8, 8, 8))
        self.assertEqual(cache.token_to_kv_pool_allocator.available_size(), 8)
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_selective_moves_only_the_kv_of_a_hit_state(self):
        """Under ``write_through_selective`` a leaf's KV moves to the host only with a state a
        request resumed from (it got its host copy at the hit); a leaf whose state was never
        hit is removed, KV and state. 24 device KV tokens hold ``[1]*8``, ``[2]*8``, ``[3]*8``;
        ``[1]*8``'s state is hit (a copy-on-write match), then 16 tokens are evicted, then 8."""
        cache = make_cache(kv_size=24, mamba_size=4, track_slots=0, host_size=4, kv_host_size=64,
                           hicache_write_policy="write_through_selective")
        kv, pool = cache.token_to_kv_pool_allocator, cache.mamba_pool
        for t in (1, 2, 3):
            cache.insert([t] * 8, kv.alloc(8), mamba_value=pool.alloc_list(1)[0])
        req = CacheReq("a", [1] * 8 + [4])
        m = cache.match_prefix([1] * 8 + [4], cow_mamba=True, req=req)
        self.assertEqual((m.prefix_len, cache.host_backups_total), (8, 1))
        pool.free([req.mamba_pool_idx])
        cache.evict(num_tokens=16)  # [2]*8, [3]*8 (least recently used): removed, not moved
        self.assertEqual((set(cache.root_node.children), cache.host_kv_demoted_total), ({1}, 0))
        cache.evict(num_tokens=8)
        first = cache.root_node.children[1]
        self.assertEqual((first.value, first.host_value.numel(), first.mamba_host_value is not None), (None, 8, True))
        self.assertEqual((cache.host_kv_demoted_total, cache.host_kv_tokens(), cache.total_size()), (8, 8, 0))
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_plain_match_stops_above_host_kv(self):
        """A match without copy-on-write (the scheduler's sort) loads nothing: prefix 0,
        while the KV match still reports the 8 host tokens."""
        cache = demoted_pair()
        m = cache.match_prefix([1] * 8 + [3])
        self.assertEqual((m.prefix_len, m.kv_match_len, cache.host_kv_loaded_total), (0, 8, 0))

    def test_cow_match_inside_a_host_node_splits_it_on_the_host(self):
        """A copy-on-write match of 4 of the 8 host tokens splits the node (both halves on
        the host), finds no state at 4 and loads nothing; a match of all 8 loads them and the
        state, evicting the other leaf's KV to the host for room."""
        cache = demoted_pair()
        m = cache.match_prefix([1] * 4 + [3], cow_mamba=True, req=CacheReq("a", [1] * 4 + [3]))
        self.assertEqual((m.prefix_len, m.kv_match_len), (0, 4))
        top = cache.root_node.children[1]
        self.assertEqual((top.host_value.numel(), next(iter(top.children.values())).host_value.numel()), (4, 4))
        cache.sanity_check()
        held = cache.token_to_kv_pool_allocator.alloc(8)  # a running request's: the device pool is full
        req = CacheReq("b", [1] * 8 + [3])
        m = cache.match_prefix([1] * 8, cow_mamba=True, req=req)
        self.assertEqual((m.prefix_len, cache.host_kv_loaded_total, cache.host_loads_total), (8, 8, 1))
        self.assertIsNotNone(req.mamba_pool_idx)
        second = cache.root_node.children[2]
        self.assertIsNone(second.value)  # made room on the device
        cache.sanity_check()
        cache.mamba_pool.free([req.mamba_pool_idx])
        cache.token_to_kv_pool_allocator.free(held)
        cache.check_slot_accounting()

    def test_insert_over_host_kv_takes_the_request_slots(self):
        """A request that computed the host-only tokens itself inserts them: the node takes
        its device slots (no copy, no double free) and gives the host slots back."""
        cache = demoted_pair()
        kv, pool = cache.token_to_kv_pool_allocator, cache.mamba_pool
        cache.evict(num_tokens=8)  # [2]*8 too: the device KV pool is empty
        fresh = kv.alloc(12)
        res = cache.insert([1] * 12, fresh, mamba_value=pool.alloc_list(1)[0])
        self.assertEqual(res.prefix_len, 8)
        first = cache.root_node.children[1]
        self.assertTrue(torch.equal(first.value, fresh[:8]))
        self.assertIsNone(first.host_value)
        self.assertEqual((cache.host_kv_tokens(), cache.total_size()), (8, 12))
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_full_host_tier_drops_its_least_recently_used_leaf(self):
        """8 host KV tokens: moving the second leaf there removes the first (host-only)
        one, with its host state."""
        cache = demoted_pair(kv_host_size=8)
        cache.evict(num_tokens=8)
        self.assertEqual(list(cache.root_node.children), [2])
        self.assertEqual((cache.host_kv_tokens(), cache.host_kv_evicted_total, cache.host_states()), (8, 8, 1))
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_full_host_kv_pool_evicts_in_the_policy_order(self):
        """16 host KV tokens holding two demoted leaves, the older ranked higher; a third
        demotion needs room: LRU removes the older leaf, the recompute policy the lower
        ranked (newer) one."""
        for policy, gone_first in (("lru", True), ("recompute", False)):
            with self.subTest(policy=policy):
                cache = make_cache(kv_size=16, mamba_size=4, track_slots=0, host_size=8, kv_host_size=16,
                                   eviction_policy=policy)
                kv, pool = cache.token_to_kv_pool_allocator, cache.mamba_pool
                for t in (1, 2, 3, 4):  # each insert demotes the oldest device leaf
                    if kv.available_size() < 8:
                        cache.evict(num_tokens=8)
                    cache.insert([t] * 8, kv.alloc(8), mamba_value=pool.alloc_list(1)[0])
                older, newer = cache.root_node.children[1], cache.root_node.children[2]
                self.assertEqual((older.value, newer.value), (None, None))
                older.priority, newer.priority = 5.0, 1.0
                cache.evict(num_tokens=8)  # [3]*8 to the host: 8 host tokens must go
                kept = set(cache.root_node.children)
                self.assertEqual(kept, {2, 3, 4} if gone_first else {1, 3, 4})
                self.assertEqual(cache.host_kv_evicted_total, 8)
                cache.sanity_check()
                cache.check_slot_accounting()

    # A fresh user's fuzzing found the next three (each fails without its fix).
    def test_stateless_leaf_left_bare_by_the_host_eviction_is_removed_once(self):
        """A stateless device leaf (the split-off ``[1]*4``) whose only child is host-only,
        with the host KV pool full of that child: making room removes the child, which leaves
        ``[1]*4`` a bare leaf; it is removed once (it used to be removed, then freed again)."""
        for node_len in (4, 8):  # 8: longer than the host pool as well
            with self.subTest(node_len=node_len):
                cache = make_cache(kv_size=16, mamba_size=4, track_slots=0, host_size=4, kv_host_size=4)
                kv, pool = cache.token_to_kv_pool_allocator, cache.mamba_pool
                cache.insert([1] * node_len + [2] * 4, kv.alloc(node_len + 4), mamba_value=pool.alloc_list(1)[0])
                cache.match_prefix([1] * node_len + [3])  # split: [1]*node_len holds no state
                self.assertEqual(cache.evict(num_tokens=4).num_tokens_evicted, 4)  # [2]*4 to the host
                res = cache.evict(num_tokens=node_len)
                self.assertEqual((res.num_tokens_evicted, res.host_tokens_evicted), (node_len, 4))
                self.assertEqual((kv.available_size(), cache.host_kv_tokens(), len(cache.root_node.children)), (16, 0, 0))
                cache.sanity_check()
                cache.check_slot_accounting()

    def test_leaf_longer_than_the_host_pool_leaves_the_host_tier_alone(self):
        cache = make_cache(kv_size=16, mamba_size=4, track_slots=0, host_size=4, kv_host_size=8)
        kv, pool = cache.token_to_kv_pool_allocator, cache.mamba_pool
        cache.insert([1] * 4, kv.alloc(4), mamba_value=pool.alloc_list(1)[0])
        cache.evict(num_tokens=4)
        cache.insert([2] * 12, kv.alloc(12), mamba_value=pool.alloc_list(1)[0])
        res = cache.evict(num_tokens=12)  # [2]*12 cannot fit in 8 host tokens: removed
        self.assertEqual((res.num_tokens_evicted, res.host_tokens_evicted), (12, 0))
        self.assertEqual((cache.host_kv_tokens(), list(cache.root_node.children)), (4, [1]))
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_evict_reports_the_kv_the_state_tier_removes(self):
        """write_back with one host state slot: demoting ``[2]*4``'s state needs the slot, so
        the host tier removes leaf ``[1]*4`` (its state on the host only) with its 4 KV
        tokens; ``evict`` reports them."""
        cache = make_cache(kv_size=16, mamba_size=4, track_slots=0, host_size=1, kv_host_size=8,
                           hicache_write_policy="write_back")
        kv, pool = cache.token_to_kv_pool_allocator, cache.mamba_pool
        cache.insert([1] * 4, kv.alloc(4), mamba_value=pool.alloc_list(1)[0])
        cache.evict(mamba_num=1)
        cache.insert([2] * 4, kv.alloc(4), mamba_value=pool.alloc_list(1)[0])
        before = cache.total_size()
        res = cache.evict(mamba_num=1)
        self.assertEqual((before - cache.total_size(), res.num_tokens_evicted), (4, 4))
        cache.sanity_check()

    def test_load_without_device_room_uses_what_is_on_the_device(self):
        """Every device KV slot held by a running request: the copy-on-write match cannot load
        the host tokens and returns the device prefix (none), with nothing lost."""
        cache = demoted_pair()
        kv = cache.token_to_kv_pool_allocator
        held = kv.alloc(8)
        other = cache.root_node.children[2]
        cache.inc_lock_ref(other)
        req = CacheReq("r", [1] * 8 + [3])
        m = cache.match_prefix([1] * 8, cow_mamba=True, req=req)
        self.assertEqual((m.prefix_len, cache.host_kv_loaded_total), (0, 0))
        self.assertIsNone(cache.root_node.children[1].value)
        cache.dec_lock_ref(other)
        kv.free(held)
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_flush_gives_every_host_kv_slot_back(self):
        cache = demoted_pair()
        cache.reset()
        cache.token_to_kv_pool_allocator.clear()
        cache.mamba_pool.clear_all()
        cache.mamba_host_pool.clear_all()
        cache.kv_host_pool.clear()
        self.assertEqual((cache.kv_host_pool.available_size(), cache.host_kv_tokens()), (64, 0))


if __name__ == "__main__":
    unittest.main()
