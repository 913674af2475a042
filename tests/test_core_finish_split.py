"""The finish split used by SGLang 0.5.23 (``checkpoint`` of a finished request, then
``release_kv_cache`` frees the row): ``MambaRadixCache.checkpoint(req, finished=True)``
inserts and donates, the caller frees the rest. No SGLang import."""

import unittest

import torch

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq, RadixKey


def seq(n, start=100):
    return list(range(start, start + n))


def release_like_sglang(cache, req):
    """What SGLang's ``release_kv_cache`` does after ``checkpoint``: free the row's KV
    above ``cache_protected_len``, unlock, free the row (and any SSM slot left)."""
    row = req.req_pool_idx
    p, a = req.cache_protected_len, req.kv_allocated_len
    if a > p:
        cache.token_to_kv_pool_allocator.free(cache.req_to_token_pool.req_to_token[row, p:a].to(torch.int64))
    cache.dec_lock_ref(req.last_node)
    req.last_node = None
    cache.req_to_token_pool.free(req)


class TestInsertFinishedReq(unittest.TestCase):
    def _run_until_finish(self, cache, tokens, outputs, chunk=4, sim=None):
        sim = sim or SimModel(cache)
        req = CacheReq(rid="r", token_ids=list(tokens))
        self.assertTrue(sim.admit(req))
        self.assertTrue(sim.prefill(req, chunk))
        self.assertTrue(sim.decode(req, outputs))
        return sim, req

    def test_working_state_exact_length(self):
        cache = make_cache(kv_size=128, mamba_size=16, mamba_track_interval=4)
        sim, req = self._run_until_finish(cache, seq(10), [7, 8, 9])
        committed = req.kv_committed_len
        self.assertEqual(committed, 12)
        working = req.mamba_pool_idx
        protected = cache.checkpoint(req, up_to=committed, finished=True)
        self.assertEqual(protected, committed)
        self.assertEqual(req.cache_protected_len, committed)
        self.assertEqual(req.last_node.seq_len, committed)
        self.assertEqual(req.last_node.mamba_value, working)  # the working slot was donated
        self.assertGreater(req.last_node.mamba_lock_ref, 0)  # the lock moved to the new node
        row = req.req_pool_idx
        self.assertEqual(
            cache.req_to_token_pool.req_to_token[row, :committed].tolist(),
            cache.path_device_indices(req.last_node).tolist(),
        )
        self.assertIsNone(req.mamba_pool_idx)  # every other SSM slot is freed
        self.assertEqual(req.mamba_ping_pong_track_buffer, [])
        release_like_sglang(cache, req)
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()
        m = cache.match_prefix(RadixKey(seq(10) + [7, 8, 9]))
        self.assertEqual(m.prefix_len, 12)

    def test_stop_before_last_committed_token_uses_checkpoint(self):
        """A stop landing before the last committed token (up_to < kv_committed_len): the
        working state holds tokens past the key, so the newest checkpoint within ``up_to``
        is donated and nothing past ``up_to`` enters the tree."""
        cache = make_cache(kv_size=128, mamba_size=16, mamba_track_interval=4)
        sim, req = self._run_until_finish(cache, seq(10), [7, 8, 9, 10, 11])
        self.assertEqual(req.kv_committed_len, 14)
        self.assertEqual(req.mamba_last_track_seqlen, 12)  # decode checkpoint at 12
        protected = cache.checkpoint(req, up_to=13, finished=True)
        self.assertEqual(protected, 12)
        self.assertEqual(req.last_node.seq_len, 12)
        release_like_sglang(cache, req)
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()
        m = cache.match_prefix(RadixKey(seq(10) + [7, 8, 9, 10, 11]))
        self.assertEqual(m.prefix_len, 12)

    def test_state_already_cached_frees_donation(self):
        """The same sequence finished twice: the second donation finds a state there and
        is freed with the request's other slots."""
        cache = make_cache(kv_size=128, mamba_size=16, mamba_track_interval=4)
        sim = SimModel(cache)
        for rid in ("first", "second"):
            sim, req = self._run_until_finish(cache, seq(9), [3, 4], sim=sim)
            cache.checkpoint(req, up_to=req.kv_committed_len, finished=True)
            release_like_sglang(cache, req)
            cache.sanity_check()
            cache.check_slot_accounting()
        sim.check_tree()
        self.assertEqual(cache.evicted_states_total, 0)
        self.assertEqual(cache.mamba_total_size(), len(cache.all_mamba_values_flatten()))
        self.assertEqual(cache.total_size(), cache.all_values_flatten().numel())


class TestEvictionTotals(unittest.TestCase):
    def test_totals_count_every_eviction(self):
        """``evicted_*_total`` count evictions asked by the caller and those the cache runs
        itself to find a copy-on-write slot."""
        cache = make_cache(kv_size=64, mamba_size=2, track_slots=0)
        kv = cache.token_to_kv_pool_allocator
        for i in range(2):
            cache.insert(seq(8, start=10 * i), kv.alloc(8), cache.mamba_pool.alloc_list(1)[0])
        res = cache.evict(num_tokens=8)
        self.assertEqual((res.num_tokens_evicted, res.mamba_num_evicted), (8, 1))
        self.assertEqual((cache.evicted_tokens_total, cache.evicted_states_total), (8, 1))
        cache.insert(seq(8, start=50), kv.alloc(8), cache.mamba_pool.alloc_list(1)[0])  # pool full again
        req = CacheReq(rid="r", token_ids=seq(8, start=10) + [1])
        m = cache.match_prefix(RadixKey(req.token_ids[:-1]), cow_mamba=True, req=req)
        self.assertEqual(m.prefix_len, 8)
        self.assertIsNotNone(req.mamba_pool_idx)  # a state was evicted for the COW slot
        self.assertEqual((cache.evicted_tokens_total, cache.evicted_states_total), (16, 2))


if __name__ == "__main__":
    unittest.main()
