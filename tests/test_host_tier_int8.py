"""int8 states in the host tier (issue 42, item 5; ``docs/design.md``, "Host tier"): with
int8 checkpoints the host tier copies the checkpoint pool's slots as they are (int8 data,
scales, conv windows), so a host state costs what an int8 device state costs and a hit on
it dequantizes exactly what a device hit on the same state would have.

The lifecycle runs through ``cache_sim`` (its exact checkpoint pool: every node's device
state and host copy checked against the tokens they summarise); the numerics with the
core's real :class:`Int8CheckpointPool`."""

import unittest

import torch

from cache_sim import SimModel, make_cache
from sglang_mamba_ext.mem_cache import CacheReq, HybridReqToTokenPool, Int8CheckpointPool, KVSlotAllocator, MambaPool
from sglang_mamba_ext.mem_cache import MambaRadixCache, RadixKey
from sglang_mamba_ext.mem_cache.checkpoint_pool import HostStatePool, copy_on_write

from test_host_tier import PROMPTS, run


class TestHostTierOfCheckpointSlots(unittest.TestCase):
    """4 checkpoint slots on the device, 12 host slots: the host tier's lifecycle over
    the checkpoint pool (the same counts as the full-precision ``TestHostTier``)."""

    def make(self, policy, host_size=12):
        cache = make_cache(kv_size=400, mamba_size=8, track_slots=0, ckpt_size=4, host_size=host_size,
                           branch_checkpoints=True, hicache_write_policy=policy)
        return cache, SimModel(cache)

    def test_second_pass_comes_back_from_the_host(self):
        for policy in ("write_through", "write_back"):
            with self.subTest(policy=policy):
                cache, sim = self.make(policy)
                self.assertIs(cache.state_pool, cache.mamba_ckpt_pool)
                self.assertEqual(run(sim, PROMPTS, "a"), [0] * 6)
                # two states a prompt: 12 > 4 checkpoint slots
                self.assertEqual(cache.mamba_total_size(), 4)
                self.assertEqual(cache.host_states(), 12 if policy == "write_through" else 8)
                self.assertEqual(run(sim, PROMPTS, "b"), [7] * 6)
                self.assertEqual(cache.host_loads_total, 6)
                # the loads borrowed a checkpoint slot each and gave it back; no active slot kept
                ckpt = cache.mamba_ckpt_pool
                self.assertEqual(ckpt.available_size() + cache.mamba_total_size(), 4)
                self.assertEqual(cache.mamba_pool.available_size(), cache.mamba_pool.size)

    def test_load_with_every_checkpoint_slot_locked_uses_the_device(self):
        """No checkpoint slot can be borrowed (all held by locked states): the host load
        gives up and the match stops at the deepest device state; nothing leaks."""
        cache, sim = self.make("write_back", host_size=4)
        run(sim, PROMPTS[:3], "a")  # 6 states: the first prompt's two went to the host
        locked = [n for n in cache.nodes() if n.mamba_value is not None]
        self.assertEqual(len(locked), 4)
        for n in locked:
            cache.inc_lock_ref(n)
        req = CacheReq("r", list(PROMPTS[0]))
        m = cache.match_prefix(RadixKey(PROMPTS[0][:-1]), cow_mamba=True, req=req)
        self.assertEqual(m.prefix_len, 0)
        self.assertEqual(cache.host_loads_total, 0)
        for n in locked:
            cache.dec_lock_ref(n)
        if req.mamba_pool_idx is not None:
            cache.mamba_pool.free([req.mamba_pool_idx])
        cache.sanity_check()
        cache.check_slot_accounting()


class TestInt8HostCopies(unittest.TestCase):
    """The real int8 pool under the host tier: the host keeps int8, twice the states per
    byte of a full-precision host tier here, and a host hit dequantizes bit for bit what
    the device hit on the same state gives."""

    def make(self):
        kv = KVSlotAllocator(512, 1)
        active = MambaPool(8, 2, (3, 8), (2, 16, 16), dtype=torch.float32)
        ckpt = Int8CheckpointPool(2, active)
        host = HostStatePool(4, ckpt)
        pool = HybridReqToTokenPool(4, 256, active, track_slots_per_req=0, mamba_ckpt_pool=ckpt, mamba_host_pool=host)
        cache = MambaRadixCache(kv, pool, mamba_track_interval=4, hicache_write_policy="write_through")
        return cache, active, ckpt, host

    def test_host_holds_int8_at_the_checkpoint_slot_bytes(self):
        _, active, ckpt, host = self.make()
        self.assertEqual([t.dtype for t in host.host], [torch.int8, torch.float32, torch.float32])
        self.assertEqual(host.slot_bytes(), ckpt.slot_bytes())
        full = HostStatePool(1, active)
        # temporal 2x16x16 float32 (2048 B) + conv 3x8 (96 B) per layer, against int8 data
        # (512 B) + scales (128 B) + conv (96 B): 2.92x the states per host byte
        self.assertEqual((full.slot_bytes(), host.slot_bytes()), (2 * 2144, 2 * 736))

    def test_host_hit_equals_the_device_hit(self):
        cache, active, ckpt, host = self.make()
        g = torch.Generator().manual_seed(3)
        slot = active.alloc_list(1)[0]
        active.temporal_state[:, slot] = torch.randn(2, 2, 16, 16, generator=g)
        active.conv_state[:, slot] = torch.randn(2, 3, 8, generator=g)
        tokens = [5] * 8
        cache.insert(RadixKey(tokens), cache.token_to_kv_pool_allocator.alloc(8), slot)
        node = cache.match_prefix(RadixKey(tokens)).last_node
        self.assertIsNotNone(node.mamba_host_value)  # write_through: copied as it entered
        device_hit = active.alloc_list(1)[0]
        copy_on_write(active, ckpt, [node.mamba_value], [device_hit])
        self.assertEqual(cache.evict(mamba_num=1).mamba_num_evicted, 1)  # demoted: host only now
        self.assertIsNone(node.mamba_value)
        req = CacheReq("r", tokens + [1])
        m = cache.match_prefix(RadixKey(tokens), cow_mamba=True, req=req)
        self.assertEqual((m.prefix_len, cache.host_loads_total), (8, 1))
        self.assertTrue(torch.equal(active.temporal_state[:, req.mamba_pool_idx], active.temporal_state[:, device_hit]))
        self.assertTrue(torch.equal(active.conv_state[:, req.mamba_pool_idx], active.conv_state[:, device_hit]))
        self.assertEqual(ckpt.available_size(), 2)  # the borrowed slot went back
        active.free([device_hit, req.mamba_pool_idx])
        cache.sanity_check()
        cache.check_slot_accounting()


if __name__ == "__main__":
    unittest.main()
