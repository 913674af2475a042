"""A running request gives its two ping-pong slots back once its prefill ran
(``MambaRadixCache.checkpoint(..., prefill_done=True)``, issue 38): the finish then donates
the working state (``finish_state`` ``"working"`` / ``"overlap"``), so the slots would only
catch decode checkpoints nothing inserts. Its entries become ``-1`` and the row's mapping,
which the forward's track writes read, the padding slot (``docs/design.md``, "Ping-pong
checkpoints"). The content oracle of ``cache_sim`` checks every inserted state. No SGLang
import."""

import unittest

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq

SLOTS = 16


def seq(n, start=100):
    return list(range(start, start + n))


class TestReleaseTrackSlots(unittest.TestCase):
    def _prefilled(self, finish_state="overlap", page_size=1):
        """A 10-token prompt prefilled in one forward (its ping-pong checkpoint at 8, the
        interval), then the result processor's checkpoint with ``prefill_done``."""
        cache = make_cache(kv_size=256, mamba_size=SLOTS, page_size=page_size, mamba_track_interval=8,
                           finish_state=finish_state)
        sim = SimModel(cache)
        r = CacheReq(rid="r", token_ids=seq(12 if page_size > 1 else 10))
        self.assertTrue(sim.admit(r))
        self.assertEqual(cache.mamba_pool.available_size(), SLOTS - 3)  # working + 2 ping-pong
        n = len(r.token_ids)
        self.assertTrue(sim.extend_kv(r, n))
        sim.forward(r, n)
        self.assertEqual(r.mamba_last_track_seqlen, 8)
        cache.checkpoint(r, up_to=n, prefill_done=True)
        return cache, sim, r

    def test_released_after_the_prefill_and_the_finish_still_exact(self):
        cache, sim, r = self._prefilled("overlap")
        # the checkpoint at 8 went into the tree; the other ping-pong slot was freed
        self.assertEqual([n.seq_len for n in cache.nodes() if n.mamba_value is not None], [8])
        self.assertEqual(r.mamba_ping_pong_track_buffer, [-1, -1])
        self.assertIsNone(r.mamba_last_track_seqlen)
        pool = cache.req_to_token_pool
        padding = cache.mamba_pool.padding_slot
        self.assertEqual(pool.req_index_to_mamba_ping_pong_track_buffer_mapping[r.req_pool_idx].tolist(),
                         [padding, padding])
        self.assertEqual(cache.mamba_pool.available_size(), SLOTS - 2)  # working + the tree's state at 8
        cache.check_slot_accounting([r])
        # decode past the next interval (16): no checkpoint is written anywhere
        self.assertTrue(sim.decode(r, [7, 8, 9, 10, 11, 12, 13, 14]))
        self.assertEqual(r.mamba_ping_pong_track_buffer, [-1, -1])
        self.assertEqual(cache.checkpoint(r, finished=True), 17)  # the working state after 17 tokens
        sim.release(r, checkpoint=False)
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()
        self.assertEqual(sorted(n.seq_len for n in cache.nodes() if n.mamba_value is not None), [8, 17])
        self.assertEqual(cache.mamba_pool.available_size(), SLOTS - 2)
        # the next turn resumes from the finish state: len + out - 1 of its prompt
        nxt = CacheReq(rid="next", token_ids=r.token_ids + [15, 16, 17])
        self.assertTrue(sim.admit(nxt))
        self.assertEqual(nxt.cache_protected_len, 17)

    def test_released_twice_is_a_no_op(self):
        cache, sim, r = self._prefilled("working")
        free = cache.mamba_pool.available_size()
        cache.checkpoint(r, up_to=10, prefill_done=True)
        self.assertEqual(cache.mamba_pool.available_size(), free)
        self.assertEqual(r.mamba_ping_pong_track_buffer, [-1, -1])
        sim.release(r)
        cache.check_slot_accounting()
        self.assertEqual(cache.mamba_pool.available_size(), SLOTS - 2)  # states at 8 and 10

    def test_kept_where_the_finish_may_read_them(self):
        for finish_state, page_size in (("checkpoint", 1), ("working", 4)):
            with self.subTest(finish_state=finish_state, page_size=page_size):
                cache, sim, r = self._prefilled(finish_state, page_size)
                self.assertTrue(all(s > 0 for s in r.mamba_ping_pong_track_buffer), r.mamba_ping_pong_track_buffer)
                self.assertEqual(cache.mamba_pool.available_size(), SLOTS - 4)  # + a fresh ping-pong slot
                sim.release(r)
                cache.check_slot_accounting()

    def test_switch_off(self):
        cache = make_cache(kv_size=256, mamba_size=SLOTS, mamba_track_interval=8, finish_state="overlap")
        cache.release_track_slots = False
        sim = SimModel(cache)
        r = CacheReq(rid="r", token_ids=seq(10))
        self.assertTrue(sim.admit(r))
        self.assertTrue(sim.extend_kv(r, 10))
        sim.forward(r, 10)
        cache.checkpoint(r, up_to=10, prefill_done=True)
        self.assertTrue(all(s > 0 for s in r.mamba_ping_pong_track_buffer))
        sim.release(r)
        cache.check_slot_accounting()


class TestNoTrackSlotsAtAlloc(unittest.TestCase):
    """``CacheReq.mamba_track_slots_wanted = False`` (what the plugin's pool sets where
    planned prefix checkpoints replace the ping-pong slots, ``tracking_replaced``, for a
    prompt of one chunk): the request is admitted with one SSM slot, its entries ``-1`` and
    the padding slot in the row mapping from the start; no checkpoint of it inserts a
    tracked state (a chunk end neither) and the finish donates the working state. A
    request beside it that wants its slots gets them."""

    def test_one_slot_per_running_request(self):
        cache = make_cache(kv_size=256, mamba_size=SLOTS, mamba_track_interval=8, finish_state="overlap")
        self.assertTrue(cache.releases_track_slots())
        pool = cache.req_to_token_pool
        sim = SimModel(cache)
        r = CacheReq(rid="r", token_ids=seq(10), mamba_track_slots_wanted=False)
        other = CacheReq(rid="other", token_ids=seq(6, start=500))
        self.assertEqual(pool.mamba_slots_needed([r, other]), 1 + 3)
        self.assertTrue(sim.admit(r))
        self.assertEqual(cache.mamba_pool.available_size(), SLOTS - 1)
        self.assertTrue(sim.admit(other))
        self.assertTrue(all(s > 0 for s in other.mamba_ping_pong_track_buffer))
        self.assertEqual(cache.mamba_pool.available_size(), SLOTS - 4)
        sim.release(other, checkpoint=False)
        self.assertEqual(cache.mamba_pool.available_size(), SLOTS - 1)
        self.assertEqual(r.mamba_ping_pong_track_buffer, [-1, -1])
        padding = cache.mamba_pool.padding_slot
        self.assertEqual(pool.req_index_to_mamba_ping_pong_track_buffer_mapping[r.req_pool_idx].tolist(),
                         [padding, padding])
        self.assertTrue(sim.extend_kv(r, 10))
        sim.forward(r, 6)
        cache.checkpoint(r, up_to=6)  # a chunk end: no state (a copy could race the forward)
        sim.forward(r, 4)
        cache.checkpoint(r, up_to=10, prefill_done=True)
        self.assertEqual([n.seq_len for n in cache.nodes() if n.mamba_value is not None], [])
        self.assertEqual(r.cache_protected_len, 0)  # no state, no node: the KV stays the request's until its finish
        self.assertEqual(cache.mamba_pool.available_size(), SLOTS - 1)
        self.assertTrue(sim.decode(r, [7, 8, 9]))
        self.assertEqual(cache.checkpoint(r, finished=True), 12)  # the working state after 12 tokens
        sim.release(r, checkpoint=False)
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()
        self.assertEqual([n.seq_len for n in cache.nodes() if n.mamba_value is not None], [12])
        nxt = CacheReq(rid="next", token_ids=r.token_ids + [15, 16])
        self.assertTrue(sim.admit(nxt))
        self.assertEqual(nxt.cache_protected_len, 12)
        sim.release(nxt)
        cache.check_slot_accounting()

    def test_not_replaced_where_the_finish_may_read_them(self):
        for finish_state, page_size in (("checkpoint", 1), ("working", 4)):
            with self.subTest(finish_state=finish_state, page_size=page_size):
                cache = make_cache(kv_size=256, mamba_size=SLOTS, page_size=page_size, finish_state=finish_state)
                self.assertFalse(cache.releases_track_slots())


if __name__ == "__main__":
    unittest.main()
