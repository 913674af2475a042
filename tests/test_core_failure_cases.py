"""Failure classes reported against other hybrid prefix caches, each as a small exact case
(issue 2, cases (a)-(h)), plus namespace isolation. No SGLang import."""

import unittest


from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq, RadixKey


def seq(n, start=100):
    return list(range(start, start + n))


class TestFailureCases(unittest.TestCase):
    def test_a_identical_prompt_hits_deepest_state(self):
        """(a) An identical prompt sent again hits, falling back to the deepest ancestor with
        an SSM state, and never gets KV beyond it."""
        cache = make_cache(kv_size=128, mamba_size=16, mamba_track_interval=4)
        sim = SimModel(cache)
        prompt = seq(10)
        sim.run(prompt, [7, 8], chunk=4, rid="first")
        again = CacheReq(rid="again", token_ids=list(prompt))
        m = cache.match_prefix(RadixKey(prompt[:-1]))
        # States exist at 4 and 8 (chunk checkpoints) and at 11 (the finished sequence);
        # the KV match reaches 9, the usable match stops at 8.
        self.assertEqual(m.kv_match_len, 9)
        self.assertEqual(m.prefix_len, 8)
        path = []
        node = m.last_node
        while node is not cache.root_node:
            path = node.value.tolist() + path
            node = node.parent
        self.assertEqual(m.device_indices.tolist(), path)
        self.assertTrue(sim.admit(again))
        self.assertEqual(again.cache_protected_len, 8)
        self.assertTrue(sim.prefill(again))  # checks the COW'd state and the prefix KV
        sim.release(again)
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_b_page_64_match_63_then_evict(self):
        """(b) page_size 64: insert 64 tokens, match 63 (nothing: less than a page), then
        force SSM eviction: no zero-length node, no child under a stale key."""
        cache = make_cache(kv_size=256, mamba_size=4, page_size=64, mamba_track_interval=64)
        kv = cache.token_to_kv_pool_allocator
        slots = kv.alloc(64)
        state = cache.mamba_pool.alloc_list(1)[0]
        cache.insert(seq(64), slots, state)
        m = cache.match_prefix(seq(63))
        self.assertEqual((m.prefix_len, m.kv_match_len), (0, 0))
        self.assertEqual(len(cache.root_node.children), 1)
        only = next(iter(cache.root_node.children.values()))
        self.assertEqual(len(only.key), 64)
        cache.sanity_check()
        res = cache.evict(mamba_num=1)
        self.assertEqual(res.mamba_num_evicted, 1)
        self.assertEqual(res.num_tokens_evicted, 64)  # a leaf loses its KV with its state
        self.assertEqual(cache.root_node.children, {})
        self.assertEqual(kv.available_size(), 256)
        self.assertEqual(cache.mamba_pool.available_size(), 4)
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_c_page_4_nested_states(self):
        """(c) page_size 4: insert 8 tokens with a state, then their first 4 with their own
        state; match 3 -> empty without a split, 4 -> 4, 7 -> 4."""
        cache = make_cache(kv_size=64, mamba_size=4, page_size=4, mamba_track_interval=4)
        kv = cache.token_to_kv_pool_allocator
        s8 = cache.mamba_pool.alloc_list(1)[0]
        slots = kv.alloc(8)
        cache.insert(seq(8), slots, s8)
        s4 = cache.mamba_pool.alloc_list(1)[0]
        res = cache.insert(seq(4), slots[:4], s4, prev_prefix_len=4)
        self.assertFalse(res.mamba_exist)
        self.assertEqual(kv.available_size(), 64 - 8)  # prev_prefix_len: nothing freed
        nodes_before = cache.full_lru_list.size
        m3 = cache.match_prefix(seq(3))
        self.assertEqual((m3.prefix_len, m3.kv_match_len), (0, 0))
        self.assertEqual(cache.full_lru_list.size, nodes_before)  # no split
        m4 = cache.match_prefix(seq(4))
        self.assertEqual(m4.prefix_len, 4)
        self.assertEqual(m4.last_node.mamba_value, s4)
        m7 = cache.match_prefix(seq(7))
        self.assertEqual((m7.prefix_len, m7.kv_match_len), (4, 4))
        self.assertEqual(m7.device_indices.tolist(), slots[:4].tolist())
        self.assertEqual(cache.full_lru_list.size, nodes_before)
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_d_zero_cacheable_length(self):
        """(d) A request whose cacheable length is 0 (3 tokens, page_size 4) inserts nothing
        and frees its slots."""
        cache = make_cache(kv_size=64, mamba_size=8, page_size=4, mamba_track_interval=4)
        sim = SimModel(cache)
        req = CacheReq(rid="short", token_ids=[1, 2, 3])
        self.assertTrue(sim.admit(req))
        self.assertTrue(sim.prefill(req))
        self.assertEqual(req.kv_committed_len, 3)
        sim.release(req)
        self.assertEqual(cache.root_node.children, {})
        self.assertEqual(cache.token_to_kv_pool_allocator.available_size(), 64)
        self.assertEqual(cache.mamba_pool.available_size(), 8)
        self.assertIsNone(req.req_pool_idx)
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_e_abort_after_cow_alloc(self):
        """(e) Aborted after match_prefix allocated its COW slot, before the request pool
        took it: the slot is freed and the lock released."""
        cache = make_cache(kv_size=128, mamba_size=8)
        sim = SimModel(cache)
        sim.run(seq(12), [1, 2], rid="warm")
        free_ssm = cache.mamba_pool.available_size()
        req = CacheReq(rid="aborted", token_ids=seq(12) + [1, 5, 6])
        m = cache.match_prefix(RadixKey(req.token_ids[:-1]), cow_mamba=True, req=req)
        cache.inc_lock_ref(m.last_node)
        req.last_node = m.last_node
        self.assertEqual(m.prefix_len, 13)
        self.assertIsNotNone(req.mamba_pool_idx)
        self.assertEqual(req.mamba_cow_src_index, m.last_node.mamba_value)
        self.assertEqual(cache.mamba_pool.available_size(), free_ssm - 1)
        self.assertEqual(cache.mamba_protected_size(), 1)
        sim.release(req, checkpoint=False)
        self.assertEqual(cache.mamba_pool.available_size(), free_ssm)
        self.assertEqual(cache.mamba_protected_size(), 0)
        self.assertEqual(cache.full_protected_size(), 0)
        self.assertIsNone(req.mamba_pool_idx)
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_f_rejected_at_admission(self):
        """(f) A request matched (with COW) and then rejected because the pools are full
        leaks nothing."""
        cache = make_cache(kv_size=128, mamba_size=4, rows=1)
        sim = SimModel(cache)
        sim.run(seq(12), [1, 2], rid="warm")  # 1 state in the tree
        running = CacheReq(rid="running", token_ids=seq(20, 500))
        self.assertTrue(sim.admit(running))  # takes the only row and 3 SSM slots
        late = CacheReq(rid="late", token_ids=seq(12) + [1, 9, 9])
        self.assertFalse(sim.admit(late))
        self.assertIsNone(late.mamba_pool_idx)
        self.assertIsNone(late.last_node)
        cache.sanity_check()
        cache.check_slot_accounting(live_reqs=[running])
        self.assertTrue(sim.prefill(running))
        sim.release(running)
        cache.check_slot_accounting()

    def test_g_lock_tombstone_revive_unlock(self):
        """(g) Lock a tombstone, revive its state by a re-insert, unlock: counts mirror and
        never go negative; the revived state is evictable again after the unlock."""
        cache = make_cache(kv_size=64, mamba_size=8)
        kv = cache.token_to_kv_pool_allocator
        pool = cache.mamba_pool
        cache.insert(seq(8), kv.alloc(8), pool.alloc_list(1)[0])
        cache.match_prefix(seq(4))  # split: [0:4] is a tombstone
        tomb = cache.root_node.children[100]
        self.assertIsNone(tomb.mamba_value)
        cache.inc_lock_ref(tomb)
        self.assertEqual((tomb.full_lock_ref, tomb.mamba_lock_ref), (1, 1))
        self.assertEqual((cache.full_protected_size(), cache.mamba_protected_size()), (4, 0))
        slot = pool.alloc_list(1)[0]
        res = cache.insert(seq(4), tomb.value, slot, prev_prefix_len=4)
        self.assertFalse(res.mamba_exist)
        self.assertIs(res.last_node, tomb)
        self.assertEqual(cache.mamba_protected_size(), 1)  # revived under the lock
        self.assertEqual(cache.evict(mamba_num=8).mamba_num_evicted, 1)  # only the child's
        self.assertEqual(tomb.mamba_value, slot)
        cache.sanity_check()
        cache.dec_lock_ref(tomb)
        self.assertEqual((tomb.full_lock_ref, tomb.mamba_lock_ref), (0, 0))
        self.assertEqual((cache.full_protected_size(), cache.mamba_protected_size()), (0, 0))
        self.assertEqual(cache.mamba_evictable_size(), 1)
        with self.assertRaises(RuntimeError):
            cache.dec_lock_ref(tomb)
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_h_chunked_equals_unchunked(self):
        """(h) Chunked and unchunked prefill of the same prompt leave the same tree: the same
        token paths, the same KV content, the same end states; the chunked run adds exactly
        the chunk-boundary checkpoints, each holding the state of its prefix. Once those are
        evicted, the trees are node for node identical."""
        prompt = seq(22)
        out = [1, 2, 3]
        trees = []
        for chunk in (None, 8):
            cache = make_cache(kv_size=128, mamba_size=16, mamba_track_interval=8)
            sim = SimModel(cache)
            sim.run(prompt, list(out), chunk=chunk, rid=f"chunk={chunk}")
            sim.check_tree()
            cache.sanity_check()
            cache.check_slot_accounting()
            trees.append((cache, sim))

        def states(cache):
            res = {}
            stack = [(cache.root_node, 0)]
            while stack:
                node, depth = stack.pop()
                for child in node.children.values():
                    d = depth + len(child.key)
                    if child.mamba_value is not None:
                        res[d] = (
                            cache.mamba_pool.temporal_state[:, child.mamba_value].tolist(),
                            cache.mamba_pool.conv_state[:, child.mamba_value].tolist(),
                        )
                    stack.append((child, d))
            return res

        def kv_content(cache, sim):
            m = cache.match_prefix(prompt + out)
            node = m.kv_last_node
            return sim.kv_token[cache._path_values(node)].tolist()

        (c1, s1), (c2, s2) = trees
        st1, st2 = states(c1), states(c2)
        self.assertEqual(sorted(st1), [24])
        self.assertEqual(sorted(st2), [8, 16, 24])
        self.assertEqual(st1[24], st2[24])
        self.assertEqual(kv_content(c1, s1), kv_content(c2, s2))
        self.assertEqual(c1.total_size(), c2.total_size())
        # Evict the two checkpoints (least recently used first) and merge-compare shapes.
        c2.evict(mamba_num=2)
        self.assertEqual(sorted(states(c2)), [24])
        shape = lambda c: [(len(n.key), n.mamba_value is not None) for n in _walk(c.root_node)]
        self.assertEqual(sum(k for k, _ in shape(c2)), sum(k for k, _ in shape(c1)))
        c2.sanity_check()
        c2.check_slot_accounting()

    def test_namespaces_isolate(self):
        """Requests with different extra_key (LoRA / cache_salt) never share nodes or slots."""
        cache = make_cache(kv_size=128, mamba_size=16)
        sim = SimModel(cache)
        sim.run(seq(10), [1], rid="t1", extra_key="tenant-1")
        req = CacheReq(rid="t2", token_ids=seq(10) + [4], extra_key="tenant-2")
        self.assertTrue(sim.admit(req))
        self.assertEqual(req.cache_protected_len, 0)
        self.assertIsNone(req.mamba_cow_src_index)
        self.assertTrue(sim.prefill(req))
        sim.release(req)
        self.assertEqual(len(cache.root_node.children), 2)
        self.assertEqual(cache.total_size(), 10 + 11)
        same = CacheReq(rid="t1b", token_ids=seq(10) + [1, 5], extra_key="tenant-1")
        self.assertTrue(sim.admit(same))
        self.assertEqual(same.cache_protected_len, 10)
        sim.release(same, checkpoint=False)
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()


def _walk(root):
    stack = list(root.children.values())
    while stack:
        n = stack.pop()
        yield n
        stack.extend(n.children.values())


if __name__ == "__main__":
    unittest.main()
