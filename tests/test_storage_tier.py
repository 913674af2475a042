"""The storage tier under the host tier (issue 42 item 1, ``docs/design.md``, "Storage tier"):
``--enable-hierarchical-cache --hicache-storage-backend file`` with ``--enable-mamba-radix``,
built as the scheduler builds it (SGLang's ``create_tree_cache`` over its ``MHATokenToKVPool``
on ``device="cpu"``, SGLang's ``HiCacheFile`` in a temporary directory). States and their KV
that the host tier gives up are written under SGLang's page keys; a match that the device and
host tiers miss reads the longest stored prefix ending on a state back, bit for bit, also in a
new cache over the same directory (a restart); tenants stay apart; a corrupted, truncated or
missing file reads as a miss (or a shorter hit), never as a wrong state."""

import contextlib
import json
import os
import shutil
import tempfile
import unittest

import torch

import sglang_glue_fixtures as F
from sglang_mamba_ext.mem_cache import CacheReq, RadixKey

MAMBA_SIZE = 8
KV_SIZE = 64


class TestStorageTier(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="smx-storage-")
        self.addCleanup(shutil.rmtree, self.dir, True)

    def build(self, *flags):
        """A fresh cache over the storage directory (a new server, as far as storage goes)."""
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        ctx, _ = F.scheduler_context(F.base_argv(
            "--enable-mamba-radix", "--enable-hierarchical-cache", "--hicache-ratio", "1",
            "--max-mamba-cache-size", str(MAMBA_SIZE), "--hicache-storage-backend", "file",
            "--hicache-storage-backend-extra-config", json.dumps({"file_storage_path": self.dir}), *flags))
        stack = contextlib.ExitStack()
        stack.enter_context(F.in_context(ctx))
        self.addCleanup(stack.close)
        kv_pool = MHATokenToKVPool(KV_SIZE, page_size=1, dtype=torch.float32, head_num=2, head_dim=4, layer_num=2,
                                   device="cpu", enable_memory_saver=False)
        cache, _ = F.build_tree_cache(F.build_req_pool(), KV_SIZE, hierarchical=True, kv_pool=kv_pool)
        self.adapter = cache
        return cache.core, kv_pool

    # -- helpers ---------------------------------------------------------------------------
    @staticmethod
    def buffers(kv_pool):
        return list(kv_pool.k_buffer) + list(kv_pool.v_buffer)

    def put(self, core, kv_pool, tokens, seed, ns=None, parent_len=0):
        """Insert ``tokens`` (extending the cached ``tokens[:parent_len]``) with random KV for
        the new tokens and a random state; returns ``(kv per buffer, state tensors)``."""
        g = torch.Generator().manual_seed(seed)
        n = len(tokens)
        head = core.match_prefix(RadixKey(tokens[:parent_len], ns)).device_indices if parent_len else None
        new = core.token_to_kv_pool_allocator.alloc(n - parent_len)
        for b in self.buffers(kv_pool):
            b[new] = torch.randn((n - parent_len, *b.shape[1:]), generator=g)
        slot = core.mamba_pool.alloc_list(1)[0]
        for t in core.mamba_pool.state_tensors():
            t[:, slot] = torch.randn(t[:, slot].shape, generator=g).to(t.dtype)
        state = [t[:, slot].clone() for t in core.mamba_pool.state_tensors()]
        value = torch.cat([head, new]) if head is not None else new
        core.insert(RadixKey(tokens, ns), value, mamba_value=slot, prev_prefix_len=parent_len)
        return [b[value].clone() for b in self.buffers(kv_pool)], state

    @staticmethod
    def push_out(core):
        """Everything out of the device and the host tiers (to storage where it is kept)."""
        core.evict(num_tokens=KV_SIZE, mamba_num=MAMBA_SIZE)
        core._evict_host(core.mamba_host_pool.size)
        from sglang_mamba_ext.mem_cache.tree_node import EvictResult

        core._evict_host_kv(core.kv_host_pool.size, EvictResult())
        core.sanity_check()

    def clobber(self, core, kv_pool):
        for b in self.buffers(kv_pool):
            b.zero_()
        for t in core.mamba_pool.state_tensors():
            t.zero_()

    def hit(self, core, tokens, ns=None):
        req = CacheReq("r", list(tokens) + [99])
        m = core.match_prefix(RadixKey(list(tokens) + [99], ns), cow_mamba=True, req=req)
        return m, req

    def assert_exact(self, core, kv_pool, m, req, kv, state):
        for b, want in zip(self.buffers(kv_pool), kv):
            self.assertTrue(torch.equal(b[m.device_indices], want))
        for t, want in zip(core.mamba_pool.state_tensors(), state):
            self.assertTrue(torch.equal(t[:, req.mamba_pool_idx], want))

    def release(self, core, req):
        core.mamba_pool.free([req.mamba_pool_idx])
        core.sanity_check()
        self.assertEqual(core.token_to_kv_pool_allocator.available_size() + core.total_size(), KV_SIZE)
        held = core.mamba_total_size() if core.mamba_ckpt_pool is None else 0  # int8: the tree holds none
        self.assertEqual(core.mamba_pool.available_size() + held, MAMBA_SIZE)

    def files(self, suffix):
        return sorted(f for f in os.listdir(self.dir) if f.endswith(".bin") and (suffix in f))

    # -- what is stored, backend by backend (the mooncake tests override these) ------------
    def _path(self, key):
        found = [f for f in self.files("") if f.startswith(key + "_")]
        self.assertEqual(len(found), 1, (key, found))
        return os.path.join(self.dir, found[0])

    def stored(self, core, key) -> bytes:
        """The raw value stored under ``key`` (payload and trailer)."""
        with open(self._path(key), "rb") as f:
            return f.read()

    def replace(self, core, key, data: bytes):
        """Store ``data`` under ``key`` in place of its value, behind the tier's back."""
        with open(self._path(key), "wb") as f:
            f.write(data)

    def remove(self, core, key):
        """Lose the value under ``key`` (a size cap, a deleted file)."""
        os.remove(self._path(key))

    def reset_store(self):
        """Empty the store between subtests."""
        shutil.rmtree(self.dir)
        os.makedirs(self.dir)

    def count_stored(self, core, tokens, ns=None):
        """``(states, KV pages from the first)`` the store holds for ``tokens``."""
        keys = core._page_hasher(tokens, ns)
        states = sum(core.storage.exists(k + core.state_suffix) for k in keys)
        return states, core.storage.batch_exists(keys)

    # -- tests -----------------------------------------------------------------------------
    def test_evicted_state_and_kv_come_back_from_storage_exactly(self):
        core, kv_pool = self.build()
        self.assertIsNotNone(core.storage)
        tokens = list(range(10, 22))
        kv, state = self.put(core, kv_pool, tokens, seed=1)
        self.assertEqual(core.storage_states_written_total, 0)  # still in the tiers
        self.push_out(core)
        self.assertEqual(core.total_size(), 0)
        self.assertEqual((core.storage_states_written_total, core.storage_kv_pages_written_total), (1, 12))
        self.assertEqual(self.count_stored(core, tokens), (1, 12))
        self.clobber(core, kv_pool)
        m, req = self.hit(core, tokens)
        self.assertEqual(m.prefix_len, 12)
        self.assertEqual((core.storage_loads_total, core.storage_kv_pages_loaded_total), (1, 12))
        self.assertEqual(core.storage_rejected_total, 0)
        self.assert_exact(core, kv_pool, m, req, kv, state)
        self.release(core, req)

    def test_int8_states_come_back_as_a_device_hit_would_give_them(self):
        """Under ``--enable-int8-mamba-checkpoint`` the stored state is the int8 one (data,
        scales, conv window as the host tier holds them): read back and dequantized it equals
        what a hit on the device copy gives."""
        core, kv_pool = self.build("--enable-int8-mamba-checkpoint", "--int8-mamba-ckpt-size", "8")
        self.assertIsNotNone(core.mamba_ckpt_pool)
        tokens = list(range(100, 110))
        kv, _ = self.put(core, kv_pool, tokens, seed=9)
        node = core.match_prefix(RadixKey(tokens)).last_node
        tmp = core.mamba_pool.alloc_list(1)[0]
        core.mamba_ckpt_pool.load_to_active(core.mamba_pool, [node.mamba_value], [tmp])
        want = [t[:, tmp].clone() for t in core.mamba_pool.state_tensors()]
        core.mamba_pool.free([tmp])
        self.push_out(core)
        self.assertEqual(core.storage_states_written_total, 1)
        self.clobber(core, kv_pool)
        m, req = self.hit(core, tokens)
        self.assertEqual((m.prefix_len, core.storage_loads_total), (10, 1))
        self.assert_exact(core, kv_pool, m, req, kv, want)
        self.release(core, req)

    def test_a_new_cache_on_the_same_directory_hits_from_storage(self):
        """HiCacheFile keeps its files (no clear at start-up; SGLang clears them only on
        POST /hicache/storage-backend/clear): a restarted server reads them back."""
        core, kv_pool = self.build()
        tokens = list(range(30, 46))
        kv, state = self.put(core, kv_pool, tokens, seed=2)
        self.push_out(core)
        core2, kv_pool2 = self.build()
        self.assertEqual(core2.total_size(), 0)
        m, req = self.hit(core2, tokens)
        self.assertEqual(m.prefix_len, 16)
        self.assert_exact(core2, kv_pool2, m, req, kv, state)
        self.release(core2, req)

    def test_clear_storage_backend_empties_the_directory(self):
        """SGLang's ``POST /hicache/storage-backend/clear`` reaches the adapter's
        ``clear_storage_backend``: the stored values go, and the next match misses."""
        core, kv_pool = self.build()
        tokens = list(range(120, 128))
        self.put(core, kv_pool, tokens, seed=10)
        self.push_out(core)
        self.assertEqual(self.count_stored(core, tokens), (1, 8))
        self.assertTrue(self.adapter.clear_storage_backend())
        self.assertEqual(self.count_stored(core, tokens), (0, 0))
        m, req = self.hit(core, tokens)
        self.assertEqual((m.prefix_len, core.storage_loads_total), (0, 0))
        if req.mamba_pool_idx is not None:
            self.release(core, req)

    def test_kv_in_the_tree_and_only_the_state_from_storage(self):
        """The inner state of a shared prefix leaves the host tier while the branches keep
        its KV: a match reads back the state alone, on the node the match splits there."""
        core, kv_pool = self.build()
        sys_prompt = list(range(50, 58))
        kv_sys, state_sys = self.put(core, kv_pool, sys_prompt, seed=3)
        self.put(core, kv_pool, sys_prompt + [1, 2, 3, 4], seed=4, parent_len=8)
        inner = core.match_prefix(RadixKey(sys_prompt)).last_node
        self.assertEqual(inner.seq_len, 8)
        # the state of the inner node goes (device, then its host copy): KV stays
        core.evict(mamba_num=MAMBA_SIZE)
        core._drop_host(inner)
        self.assertTrue(inner.is_tombstone)
        self.assertEqual(core.storage_states_written_total, 1)
        other = sys_prompt + [7, 7]
        for t in core.mamba_pool.state_tensors():
            t.zero_()
        m, req = self.hit(core, other)
        self.assertEqual(m.prefix_len, 8)
        self.assertEqual(core.storage_kv_pages_loaded_total, 0)  # the KV was in the tree
        self.assert_exact(core, kv_pool, m, req, kv_sys, state_sys)
        self.release(core, req)

    def test_tenants_stay_apart_in_storage(self):
        core, kv_pool = self.build()
        tokens = list(range(60, 68))
        kv, state = self.put(core, kv_pool, tokens, seed=5, ns=(None, "tenant-a"))
        self.push_out(core)
        for ns in (None, (None, "tenant-b"), ("lora-x", "tenant-a")):
            with self.subTest(ns=ns):
                m, req = self.hit(core, tokens, ns)
                self.assertEqual(m.prefix_len, 0)
                if req.mamba_pool_idx is not None:
                    self.release(core, req)
        self.clobber(core, kv_pool)
        m, req = self.hit(core, tokens, (None, "tenant-a"))
        self.assertEqual(m.prefix_len, 8)
        self.assert_exact(core, kv_pool, m, req, kv, state)
        self.release(core, req)

    def _two_states_in_storage(self):
        """``tokens[:6]`` and ``tokens`` (12), each with a state, written to storage."""
        core, kv_pool = self.build()
        tokens = list(range(70, 82))
        kv6, state6 = self.put(core, kv_pool, tokens[:6], seed=6)
        self.put(core, kv_pool, tokens, seed=7, parent_len=6)
        self.push_out(core)
        self.assertEqual(core.storage_states_written_total, 2)
        self.clobber(core, kv_pool)
        return core, kv_pool, tokens, kv6, state6

    def test_corrupted_state_file_falls_back_to_the_shorter_stored_prefix(self):
        core, kv_pool, tokens, kv6, state6 = self._two_states_in_storage()
        keys = core._page_hasher(tokens, None)
        deep = keys[-1] + core.state_suffix
        data = bytearray(self.stored(core, deep))
        data[len(data) // 2] ^= 0x01  # one bit of the state
        self.replace(core, deep, bytes(data))
        m, req = self.hit(core, tokens)
        self.assertEqual(m.prefix_len, 6)
        self.assertEqual(core.storage_rejected_total, 1)
        self.assertFalse(core.storage.exists(deep))  # discarded: a later write can replace it
        self.assert_exact(core, kv_pool, m, req, kv6, state6)
        self.release(core, req)

    def test_truncated_or_missing_kv_page_falls_back(self):
        for how in ("truncate", "remove", "swap"):
            with self.subTest(how=how):
                core, kv_pool, tokens, kv6, state6 = self._two_states_in_storage()
                keys = core._page_hasher(tokens, None)
                if how == "truncate":
                    self.replace(core, keys[8], self.stored(core, keys[8])[:-5])
                elif how == "remove":
                    self.remove(core, keys[8])
                else:  # another page's (valid) value under this key
                    self.replace(core, keys[8], self.stored(core, keys[9]))
                m, req = self.hit(core, tokens)
                self.assertEqual(m.prefix_len, 6)
                self.assertEqual(core.storage_rejected_total, 0 if how == "remove" else 1)
                self.assert_exact(core, kv_pool, m, req, kv6, state6)
                self.release(core, req)
                self.reset_store()

    def test_a_later_spill_writes_a_lost_page_again(self):
        """A KV page file lost (a size cap, a failed check) while its state is stored: the
        prefix misses until the same prefix leaves the tiers again, whose spill writes the
        page back (the state is already there)."""
        core, kv_pool = self.build()
        tokens = list(range(130, 140))
        kv, state = self.put(core, kv_pool, tokens, seed=11)
        self.push_out(core)
        self.remove(core, core._page_hasher(tokens, None)[4])
        m, req = self.hit(core, tokens)
        self.assertEqual(m.prefix_len, 0)
        if req.mamba_pool_idx is not None:
            self.release(core, req)
        kv, state = self.put(core, kv_pool, tokens, seed=11)  # the same prefix computed again
        self.push_out(core)
        self.assertEqual((core.storage_states_written_total, core.storage_kv_pages_written_total), (1, 11))
        self.clobber(core, kv_pool)
        m, req = self.hit(core, tokens)
        self.assertEqual(m.prefix_len, 10)
        self.assert_exact(core, kv_pool, m, req, kv, state)
        self.release(core, req)

    def test_foreign_layout_reads_as_a_miss(self):
        """A value written under another layout (here: another tag) fails its digest."""
        core, kv_pool = self.build()
        tokens = list(range(90, 98))
        self.put(core, kv_pool, tokens, seed=8)
        self.push_out(core)
        core._storage_tag = b"another layout"
        m, req = self.hit(core, tokens)
        self.assertEqual(m.prefix_len, 0)
        self.assertGreaterEqual(core.storage_rejected_total, 1)
        if req.mamba_pool_idx is not None:
            self.release(core, req)


class TestStorageFlags(unittest.TestCase):
    def test_file_backend_accepted_with_the_host_tier_others_refused(self):
        from sglang_mamba_ext.plugin.settings import settings_of

        args = F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-hierarchical-cache",
                                        "--hicache-storage-backend", "file"))
        self.assertIsNone(args.hicache_storage_backend)  # SGLang's own prefetch protocol stays off
        self.assertEqual(settings_of(args)["storage_backend"], "file")
        for extra, message in (
            (("--hicache-storage-backend", "file"),
             "--enable-mamba-radix cannot be combined with --hicache-storage-backend file without "
             "--enable-hierarchical-cache"),
            (("--enable-hierarchical-cache", "--hicache-storage-backend", "nixl"),
             "--enable-mamba-radix cannot be combined with --hicache-storage-backend nixl (its storage "
             "tier serves SGLang's file and mooncake backends"),
            (("--enable-hierarchical-cache", "--hicache-storage-backend", "file", "--tp", "2"),
             "--enable-mamba-radix cannot be combined with --hicache-storage-backend file at --tp 2"),
        ):
            with self.subTest(extra=extra):
                with self.assertRaises(ValueError) as cm:
                    F.parse_args(F.base_argv("--enable-mamba-radix", *extra))
                self.assertIn(message, str(cm.exception))


if __name__ == "__main__":
    unittest.main()
