"""The leak check and the eviction totals (``mem_cache/invariants.py``, ``docs/design.md``
"Invariants" and "Eviction"): a page owned twice is caught when ``page_size > 1``, and a
tombstone leaf removed by ``dec_lock_ref`` counts as evicted. No SGLang import."""

import unittest

import torch

from cache_sim import make_cache
from sglang_mamba_ext.mem_cache import CacheReq


def seq(n, start=100):
    return list(range(start, start + n))


class TestSlotAccounting(unittest.TestCase):
    def _tree_with_one_page_node(self, page_size):
        cache = make_cache(kv_size=8 * page_size, mamba_size=4, page_size=page_size, mamba_track_interval=4 * page_size)
        slots = cache.token_to_kv_pool_allocator.alloc(page_size)
        state = cache.mamba_pool.alloc_list(1)[0]
        cache.insert(seq(page_size), slots, state)
        cache.check_slot_accounting()
        return cache, slots

    def _request_claiming(self, cache, slots):
        """A live request whose own KV tail is ``slots`` (which the tree owns too)."""
        row = cache.req_to_token_pool.alloc_rows(1)[0]
        cache.req_to_token_pool.req_to_token[row, : slots.numel()] = slots.to(torch.int32)
        return CacheReq(rid="dup", token_ids=seq(slots.numel()), req_pool_idx=row, kv_allocated_len=slots.numel())

    def test_page_owned_twice_is_caught(self):
        for page_size in (1, 4):
            with self.subTest(page_size=page_size):
                cache, slots = self._tree_with_one_page_node(page_size)
                req = self._request_claiming(cache, slots)
                with self.assertRaisesRegex(AssertionError, "owned twice"):
                    cache.check_slot_accounting([req])

    def test_partial_tail_page_is_one_page(self):
        """A request holding 3 tokens of a 4-token page owns that page once: no error."""
        cache = make_cache(kv_size=32, mamba_size=4, page_size=4, mamba_track_interval=16)
        page = cache.token_to_kv_pool_allocator.alloc(4)
        row = cache.req_to_token_pool.alloc_rows(1)[0]
        cache.req_to_token_pool.req_to_token[row, :3] = page[:3].to(torch.int32)
        req = CacheReq(rid="tail", token_ids=seq(3), req_pool_idx=row, kv_allocated_len=3)
        cache.check_slot_accounting([req])
        with self.assertRaisesRegex(AssertionError, "KV slots lost"):
            cache.check_slot_accounting()


class TestEvictionTotals(unittest.TestCase):
    def test_leaf_removed_by_dec_lock_ref_counts_as_evicted(self):
        """A tombstone locked directly loses its children to eviction; its unlock removes
        it, and its tokens join ``evicted_tokens_total`` like any other eviction."""
        cache = make_cache(kv_size=64, mamba_size=8, mamba_track_interval=4)
        kv = cache.token_to_kv_pool_allocator
        a = seq(8)
        b = seq(4) + seq(4, start=900)
        cache.insert(a, kv.alloc(8), cache.mamba_pool.alloc_list(1)[0])
        cache.insert(b, kv.alloc(8), cache.mamba_pool.alloc_list(1)[0])
        fork = cache.root_node.children[a[0]]
        self.assertEqual((len(fork.key), fork.mamba_value), (4, None))
        cache.inc_lock_ref(fork)
        res = cache.evict(num_tokens=64)
        self.assertEqual(res.num_tokens_evicted, 8)  # the two 4-token leaves
        self.assertEqual(cache.evicted_tokens_total, 8)
        cache.dec_lock_ref(fork)
        self.assertEqual(cache.root_node.children, {})
        self.assertEqual(cache.evicted_tokens_total, 12)
        self.assertEqual(cache.evicted_states_total, 2)
        self.assertEqual(kv.available_size(), 64)
        cache.sanity_check()
        cache.check_slot_accounting()


if __name__ == "__main__":
    unittest.main()
