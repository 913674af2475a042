"""The seed's worked examples (seed-mamba-radix-cache.zh.md §2.2, §4.2, §4.3, §6.4) as exact
tests of the core cache. No SGLang import."""

import unittest


from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq


def toks(s: str):
    return [ord(c) for c in s]


def tree_shape(cache):
    """{path string: has_state} for every node, plus the parent/child structure as strings."""
    out = {}
    stack = [(cache.root_node, "")]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            seg = "".join(chr(t) for t in child.key)
            out[path + "|" + seg] = child.mamba_value is not None
            stack.append((child, path + "|" + seg))
    return out


class TestSeedExamples(unittest.TestCase):
    def test_2_2_tree_shape(self):
        """§2.2: three prompts give root -> "You are a " -> {"helpful assistant." ->
        " Write code.", "coding expert."}; the shared split node has no SSM state."""
        cache = make_cache(kv_size=512, mamba_size=16)
        sim = SimModel(cache)
        r1 = "You are a helpful assistant."
        r2 = "You are a helpful assistant. Write code."
        r3 = "You are a coding expert."
        # Each prompt is prefilled and finished before generating: the tree gets the
        # prompt with the state after its last token.
        hits = []
        for text in (r1, r2, r3):
            req = CacheReq(rid=text, token_ids=toks(text))
            self.assertTrue(sim.admit(req))
            hits.append(req.cache_protected_len)
            self.assertTrue(sim.prefill(req))
            sim.release(req)
        # R2 hit all of R1; R3 found "You are a " as KV only (no state there): no usable hit.
        self.assertEqual(hits, [0, len(r1), 0])
        self.assertEqual(
            tree_shape(cache),
            {
                "|You are a ": False,
                "|You are a |helpful assistant.": True,
                "|You are a |helpful assistant.| Write code.": True,
                "|You are a |coding expert.": True,
            },
        )
        # R2 reused R1's KV for the shared prefix: the tree holds each prefix token once.
        self.assertEqual(cache.total_size(), len(r2) + len("coding expert."))
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_4_2_two_chunk_prefill(self):
        """§4.2: "ABCDEFGH" with chunk size 4 gives root -> [A,B,C,D] (SSM) -> [E,F,G,H]
        (SSM); chunk 2 does not free the locked [A..D] slots."""
        cache = make_cache(kv_size=64, mamba_size=8, mamba_track_interval=4)
        sim = SimModel(cache)
        req = CacheReq(rid="A", token_ids=toks("ABCDEFGH"))
        self.assertTrue(sim.admit(req, cap_one=False))
        self.assertEqual(req.cache_protected_len, 0)
        sim.extend_kv(req, 4)
        own_abcd = cache.req_to_token_pool.req_to_token[req.req_pool_idx, :4].tolist()
        sim.forward(req, 4, chunk_end=True)
        track_slot = req.last_track_slot()
        cache.checkpoint(req)
        # After chunk 1: one node [A..D] holding the ping-pong checkpoint slot, locked.
        self.assertEqual(tree_shape(cache), {"|ABCD": True})
        node = req.last_node
        self.assertEqual(node.mamba_value, track_slot)
        self.assertEqual(node.value.tolist(), own_abcd)
        self.assertEqual((node.full_lock_ref, node.mamba_lock_ref), (1, 1))
        self.assertEqual(req.cache_protected_len, 4)
        # The donated checkpoint slot was replaced by a fresh one.
        self.assertNotIn(track_slot, req.mamba_ping_pong_track_buffer)
        self.assertTrue(all(s >= 0 for s in req.mamba_ping_pong_track_buffer))

        sim.extend_kv(req, 8)
        sim.forward(req, 4)
        free_before = cache.token_to_kv_pool_allocator.available_size()
        sim.release(req)
        self.assertEqual(tree_shape(cache), {"|ABCD": True, "|ABCD|EFGH": True})
        # Nothing of the request's KV was freed: all 8 slots are now the tree's.
        self.assertEqual(cache.token_to_kv_pool_allocator.available_size(), free_before)
        abcd = cache.root_node.children[ord("A")]
        self.assertEqual(abcd.value.tolist(), own_abcd)
        self.assertEqual((abcd.full_lock_ref, abcd.mamba_lock_ref), (0, 0))
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_4_3_duplicate_kv_freed(self):
        """§4.3: between A's chunks, B caches [A..F]; A's chunk-2 insert frees A's own
        [E,F] slots and A's req_to_token becomes tree [A..D] + B's [E,F] + A's own [G,H]."""
        cache = make_cache(kv_size=64, mamba_size=16, mamba_track_interval=4)
        sim = SimModel(cache)
        a = CacheReq(rid="A", token_ids=toks("ABCDEFGHIJ"))
        self.assertTrue(sim.admit(a, cap_one=False))
        sim.extend_kv(a, 4)
        sim.forward(a, 4, chunk_end=True)
        cache.checkpoint(a)
        abcd_slots = a.prefix_indices.tolist()

        # Request B: prompt ABCDEF, hits [A..D] (copy-on-write of its state), computes E,F.
        sim.run(toks("ABCDEF"), [ord("x")], rid="B")
        ef = cache.root_node.children[ord("A")].children[ord("E")]
        self.assertEqual(ef.key, toks("EF"))
        b_ef_slots = ef.value.tolist()

        # A's chunk 2: [E,F,G,H] computed into A's own slots.
        sim.extend_kv(a, 8)
        row = a.req_pool_idx
        own_ef = cache.req_to_token_pool.req_to_token[row, 4:6].tolist()
        own_gh = cache.req_to_token_pool.req_to_token[row, 6:8].tolist()
        sim.forward(a, 4, chunk_end=True)
        free_before = cache.token_to_kv_pool_allocator.available_size()
        cache.checkpoint(a)
        # A's own E,F slots were freed (duplicates), nothing else.
        self.assertEqual(cache.token_to_kv_pool_allocator.available_size(), free_before + 2)
        free = set(cache.token_to_kv_pool_allocator.free_slots().tolist())
        self.assertTrue(set(own_ef) <= free)
        self.assertEqual(
            cache.req_to_token_pool.req_to_token[row, :8].tolist(), abcd_slots + b_ef_slots + own_gh
        )
        self.assertEqual(
            tree_shape(cache),
            {"|ABCD": True, "|ABCD|EF": True, "|ABCD|EF|GH": True},
        )
        gh = ef.children[ord("G")]
        self.assertEqual(gh.value.tolist(), own_gh)
        self.assertIs(a.last_node, gh)
        # Finish A: I,J plus one generated token.
        sim.extend_kv(a, 10)
        sim.forward(a, 2)
        a.token_ids.append(ord("y"))
        sim.release(a)
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()

    def test_6_4_long_cannot_serve_short(self):
        """§6.4: with only [A..H] (SSM) cached, matching "ABCD" returns an empty usable prefix
        and splits the node; the new parent [A..D] has no SSM state."""
        cache = make_cache(kv_size=64, mamba_size=8)
        kv = cache.token_to_kv_pool_allocator
        slots = kv.alloc(8)
        state = cache.mamba_pool.alloc_list(1)[0]
        cache.insert(toks("ABCDEFGH"), slots, state)
        m = cache.match_prefix(toks("ABCD"))
        self.assertEqual(m.prefix_len, 0)
        self.assertEqual(m.device_indices.numel(), 0)
        self.assertIs(m.last_node, cache.root_node)
        self.assertEqual(m.kv_match_len, 4)
        self.assertEqual(tree_shape(cache), {"|ABCD": False, "|ABCD|EFGH": True})
        parent = cache.root_node.children[ord("A")]
        self.assertIsNone(parent.mamba_value)
        self.assertEqual(parent.value.tolist(), slots[:4].tolist())
        self.assertEqual(parent.children[ord("E")].mamba_value, state)
        # The full prompt still hits the whole state.
        m2 = cache.match_prefix(toks("ABCDEFGH"))
        self.assertEqual(m2.device_indices.tolist(), slots.tolist())
        cache.sanity_check()
        cache.check_slot_accounting()


if __name__ == "__main__":
    unittest.main()
