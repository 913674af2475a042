"""Unit tests of the core pools (KVSlotAllocator, MambaPool, HybridReqToTokenPool) and of the
scheduler stand-in the core tests use (``tests/cache_sim.py``)."""

import sys
import subprocess
import unittest

import torch

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq, HybridReqToTokenPool, KVSlotAllocator, MambaPool


class TestKVSlotAllocator(unittest.TestCase):
    def test_alloc_free_page1(self):
        kv = KVSlotAllocator(10)
        a = kv.alloc(4)
        self.assertEqual(a.tolist(), [1, 2, 3, 4])  # slot 0 is reserved
        self.assertEqual(kv.available_size(), 6)
        self.assertIsNone(kv.alloc(7))
        self.assertEqual(kv.available_size(), 6)  # a failed alloc takes nothing
        kv.free(a[:2])
        self.assertEqual(kv.available_size(), 8)
        b = kv.alloc(8)
        self.assertEqual(sorted(b.tolist()), [1, 2, 5, 6, 7, 8, 9, 10])
        self.assertEqual(kv.free_slots().tolist(), [])

    def test_paged(self):
        kv = KVSlotAllocator(16, page_size=4)
        a = kv.alloc(8)
        self.assertEqual(a.tolist(), [4, 5, 6, 7, 8, 9, 10, 11])  # pages 1 and 2
        with self.assertRaises(ValueError):
            kv.alloc(3)
        kv.free(a[4:6])  # any slot of a page frees the whole page
        self.assertEqual(kv.available_size(), 12)
        self.assertEqual(kv.free_slots().tolist()[:4], [8, 9, 10, 11])

    def test_bad_sizes(self):
        with self.assertRaises(ValueError):
            KVSlotAllocator(10, page_size=4)
        with self.assertRaises(ValueError):
            KVSlotAllocator(0)


class TestMambaPool(unittest.TestCase):
    def test_alloc_free_copy_clear(self):
        pool = MambaPool(4, num_layers=2, conv_shape=(3, 2), temporal_shape=(2, 3, 3))
        self.assertEqual(pool.conv_state.shape, (2, 5, 3, 2))
        self.assertEqual(pool.temporal_state.shape, (2, 5, 2, 3, 3))
        self.assertEqual(pool.slot_bytes(), 2 * (6 + 18) * 4)
        slots = pool.alloc(3)
        self.assertEqual(slots.tolist(), [1, 2, 3])
        self.assertNotIn(0, slots.tolist())  # padding slot never handed out
        self.assertIsNone(pool.alloc(2))
        pool.temporal_state[:, 1] = 7.0
        pool.conv_state[:, 1] = 3.0
        pool.copy_from([1], [2])
        torch.testing.assert_close(pool.temporal_state[:, 2], pool.temporal_state[:, 1], rtol=0, atol=0)
        torch.testing.assert_close(pool.conv_state[:, 2], pool.conv_state[:, 1], rtol=0, atol=0)
        pool.clear([2])
        self.assertEqual(float(pool.temporal_state[:, 2].abs().sum()), 0.0)
        self.assertEqual(float(pool.temporal_state[:, 1].sum()), 7.0 * 2 * 18)
        pool.free(slots)
        self.assertEqual(pool.available_size(), 4)
        with self.assertRaises(ValueError):
            pool.free([2])  # double free
        with self.assertRaises(ValueError):
            pool.free([0])  # the padding slot

    def test_external_tensors(self):
        conv = torch.zeros(1, 3, 4, 2)
        temporal = torch.zeros(1, 3, 1, 2, 2)
        pool = MambaPool(2, 1, (4, 2), (1, 2, 2), conv_state=conv, temporal_state=temporal)
        self.assertIs(pool.conv_state, conv)
        with self.assertRaises(ValueError):
            MambaPool(3, 1, (4, 2), (1, 2, 2), conv_state=conv)


class TestHybridReqToTokenPool(unittest.TestCase):
    def _pool(self, mamba_size=6, rows=3, track=2):
        mp = MambaPool(mamba_size, 1, (2, 1), (1,))
        return HybridReqToTokenPool(rows, 32, mp, track_slots_per_req=track), mp

    def test_alloc_all_or_nothing(self):
        pool, mp = self._pool(mamba_size=5)
        a, b = CacheReq("a", [1]), CacheReq("b", [2])
        self.assertEqual(pool.alloc([a]), [1])  # row 0 is the padding row
        self.assertEqual(mp.available_size(), 2)  # 1 working + 2 ping-pong
        self.assertTrue(a.mamba_needs_clear)
        self.assertIsNone(pool.alloc([b]))  # needs 3, 2 free: nothing taken
        self.assertEqual(mp.available_size(), 2)
        self.assertIsNone(b.req_pool_idx)
        self.assertEqual(int(pool.req_index_to_mamba_index_mapping[1]), a.mamba_pool_idx)
        self.assertEqual(
            pool.req_index_to_mamba_ping_pong_track_buffer_mapping[1].tolist(), a.mamba_ping_pong_track_buffer
        )
        pool.free(a, keep_slot=a.mamba_pool_idx)  # donate the working slot
        self.assertEqual(mp.available_size(), 4)
        self.assertEqual(pool.available_size(), 3)

    def test_padding_row_and_external_tensors(self):
        """SGLang's layout: row 0 is padding (maps to SSM padding slot 0, never handed out);
        given tensors (int32 map, wider ping-pong map) are used in place."""
        mp = MambaPool(9, 1, (2, 1), (1,))
        r2t = torch.zeros(4, 16, dtype=torch.int32)
        mapping = torch.zeros(4, dtype=torch.int32)
        pp = torch.zeros(4, 2, dtype=torch.int64)
        pool = HybridReqToTokenPool(
            3, 16, mp, track_slots_per_req=2, req_to_token=r2t,
            req_index_to_mamba_index_mapping=mapping,
            req_index_to_mamba_ping_pong_track_buffer_mapping=pp,
        )
        self.assertIs(pool.req_to_token, r2t)
        reqs = [CacheReq(i, [i]) for i in range(3)]
        self.assertEqual(sorted(pool.alloc(reqs)), [1, 2, 3])
        self.assertEqual(int(mapping[0]), 0)
        self.assertEqual(pp[0].tolist(), [0, 0])
        self.assertEqual(mapping[1:].tolist(), [r.mamba_pool_idx for r in reqs])
        self.assertEqual(pp[reqs[2].req_pool_idx].tolist(), reqs[2].mamba_ping_pong_track_buffer)
        self.assertIsNone(pool.alloc_rows(1))
        pool.free(reqs[1])
        self.assertEqual(int(mapping[reqs[0].req_pool_idx]), reqs[0].mamba_pool_idx)
        self.assertEqual(pool.free_row_ids(), [2])
        with self.assertRaises(ValueError):
            HybridReqToTokenPool(3, 16, mp, req_to_token=torch.zeros(3, 16, dtype=torch.int32))
        with self.assertRaises(ValueError):
            pool.free_rows([0])

    def test_free_mamba_slots_keeps_row_and_donated_slot(self):
        pool, mp = self._pool(mamba_size=6)
        a = CacheReq("a", [1])
        pool.alloc([a])
        row, keep = a.req_pool_idx, a.mamba_ping_pong_track_buffer[1]
        pool.free_mamba_slots(a, keep_slot=keep)
        self.assertEqual(mp.available_size(), 5)  # working + one ping-pong back, one kept
        self.assertFalse(mp.is_free(keep))
        self.assertEqual(a.req_pool_idx, row)
        self.assertIsNone(a.mamba_pool_idx)
        self.assertEqual(a.mamba_ping_pong_track_buffer, [])
        pool.free(a)  # the row only now
        self.assertEqual(pool.available_size(), 3)
        self.assertEqual(mp.available_size(), 5)


class TestSchedulerStandIn(unittest.TestCase):
    """The scheduler side the core tests drive (``tests/cache_sim.py``)."""

    def test_cow_and_clear_at_forward_start(self):
        cache = make_cache(mamba_size=8, track_slots=0)
        sim, mp, pool = SimModel(cache), cache.mamba_pool, cache.req_to_token_pool
        src = mp.alloc_list(1)[0]
        mp.temporal_state[:, src] = 5
        a = CacheReq("a", [1], mamba_cow_src_index=src)
        a.mamba_pool_idx = mp.alloc_list(1)[0]
        b = CacheReq("b", [2])
        pool.alloc([a, b])
        mp.temporal_state[:, b.mamba_pool_idx] = 9  # garbage from an earlier user
        self.assertEqual(sim.run_deferred_cow([a, b]), 1)
        self.assertEqual(int(mp.temporal_state[0, a.mamba_pool_idx, 0]), 5)
        self.assertEqual(int(mp.temporal_state[0, b.mamba_pool_idx, 0]), 0)
        self.assertIsNone(a.mamba_cow_src_index)
        self.assertFalse(b.mamba_needs_clear)

    def test_plan_track(self):
        cache = make_cache(mamba_size=8, mamba_track_interval=8)
        sim = SimModel(cache)
        r = CacheReq("r", list(range(40)))
        cache.req_to_token_pool.alloc([r])
        first, second = r.mamba_ping_pong_track_buffer
        # A 10-token chunk ending a prefill chunk: checkpoint at its end.
        self.assertEqual(sim.plan_track(r, 0, 10, chunk_end=True), (first, 10))
        self.assertEqual(r.last_track_slot(), first)
        # Decode tokens 11..15: no multiple of 8 crossed.
        self.assertIsNone(sim.plan_track(r, 10, 5))
        # Decode crossing 16: checkpoint at 16 into the other slot (ping-pong).
        self.assertEqual(sim.plan_track(r, 15, 1), (second, 16))
        self.assertEqual(r.mamba_last_track_seqlen, 16)
        self.assertEqual(r.last_track_slot(), second)


class TestNoSGLangImport(unittest.TestCase):
    def test_core_imports_without_sglang(self):
        """The core (and spec) layers import in an environment where sglang cannot be
        imported at all."""
        code = (
            "import sys; sys.modules['sglang'] = None\n"
            "import sglang_mamba_ext, sglang_mamba_ext.mem_cache, sglang_mamba_ext.speculative\n"
            "assert not [m for m in sys.modules if m.startswith('sglang.')]\n"
            "print('ok')"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "ok")


if __name__ == "__main__":
    unittest.main()
