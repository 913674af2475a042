"""The ``--enable-lmcache`` fetch-and-store path of the plugin's tree
(``sglang_mamba_ext/plugin/lmcache_connector.py``), against an in-process stand-in for LMCache's
``UnifiedLMCacheMPConnector`` (this file needs no ``lmcache``; the served path is
``tests/e2e/test_lmcache_plugin.py``). The stand-in keeps what is stored by token prefix and
salt, answers a lookup with the longest chunk-aligned prefix whose KV is complete and whose last
chunk ends on a stored state (as ``lmcache server --separate-object-groups`` does for a
recurrent group), and copies by slot index, as the real one does through the registered
buffers.

Checked: a prefix stored from the tree's slots comes back after the tree was emptied, KV and
state bit for bit, and is hung in the tree (a copy-on-write match then hits it); only a
chunk-aligned prefix ending on a tree state is stored, once per request; a tree hit is extended
from LMCache with only the missing tokens loaded; salts stay apart; a failed retrieve, or no free
slots, is a miss that leaves every slot free and no lookup lock held."""

import contextlib
import types
import unittest
import unittest.mock

import torch

import sglang_glue_fixtures as F
from sglang_mamba_ext.mem_cache import CacheReq, RadixKey
from sglang_mamba_ext.plugin.lmcache_connector import (LMCacheTreeConnector, lmcache_installed,
                                                       share_moved_state_storage)

KV_SIZE = 96
CHUNK = 8


class _Future:
    def __init__(self, ok):
        self.ok = ok

    def result(self, timeout=None):
        return self.ok


class _SlowFuture(_Future):
    """A transfer still running past the connector's timeout until ``finished`` is set."""

    def __init__(self, ok):
        super().__init__(ok)
        self.finished = False

    def done(self):
        return self.finished

    def result(self, timeout=None):
        if not self.finished:
            raise TimeoutError("still running")
        return self.ok


class FakeLMCache:
    """LMCache's connector API, storing in dictionaries (module docstring)."""

    chunk_size = CHUNK
    operation_timeout = 5.0
    device = "cpu"

    def __init__(self, buffers, states):
        self.buffers, self.states = buffers, states
        self.kv = {}  # (salt, prefix tuple) -> per-buffer row of that prefix's last token
        self.state = {}  # (salt, prefix tuple) -> per-tensor state after it
        self.store_pos = {}
        self.locks = {}  # rid -> (start, end) held
        self.fail_load = False
        self.slow = False  # transfers outlive the connector's timeout (a _SlowFuture each)
        self.futures = []
        self.complete_raises = False
        self.stored = []  # (start, end) of each store

    @staticmethod
    def build_cache_salt(cache_salt, extra_key):
        return f"{cache_salt or ''}|{extra_key or ''}"

    def submit_lookup(self, rid, tokens, *, local_hit_tokens, cache_salt):
        hit = 0
        for end in range(CHUNK, len(tokens) // CHUNK * CHUNK + 1, CHUNK):
            if not all((cache_salt, tuple(tokens[: i + 1])) in self.kv for i in range(end)):
                break
            if (cache_salt, tuple(tokens[:end])) in self.state:
                hit = end
        if hit:
            self.locks[rid] = (0, hit)
        if hit > self.store_pos.get(rid, 0):
            self.store_pos[rid] = hit
        return types.SimpleNamespace(request_id=rid, token_ids=list(tokens), salt=cache_salt, hit=hit, lock_start=0)

    def poll_lookup(self, op):
        return op.hit

    def free_lookup_locks(self, rid, start, end):
        held = self.locks.get(rid)
        if held is None:
            return
        assert start == held[0], (start, held)
        self.locks[rid] = (end, held[1])
        if end >= held[1]:
            del self.locks[rid]

    def device_indices_by_group(self, kv, *, mamba_value=None, mamba_transfer_tokens=None):
        return [kv, mamba_value]

    def submit_load(self, lookup, groups, *, local_hit_tokens, owned_device_indices=None):
        kv, slot = groups
        ok = not self.fail_load
        if ok:
            for j, pos in enumerate(range(local_hit_tokens, lookup.hit)):
                rows = self.kv[(lookup.salt, tuple(lookup.token_ids[: pos + 1]))]
                for b, row in zip(self.buffers, rows):
                    b[kv[j]] = row
            for t, s in zip(self.states, self.state[(lookup.salt, tuple(lookup.token_ids[: lookup.hit]))]):
                t[:, int(slot)] = s
        self.locks.pop(lookup.request_id, None)  # a retrieve consumes its locks
        return types.SimpleNamespace(future=self._future(ok))

    def _future(self, ok):
        f = _SlowFuture(ok) if self.slow else _Future(ok)
        self.futures.append(f)
        return f

    def complete_load(self, op):
        if self.complete_raises:
            raise RuntimeError("complete_load failed")
        return op.future.ok

    def get_store_start(self, rid, end):
        return min(self.store_pos.get(rid, 0), end // CHUNK * CHUNK)

    def submit_store(self, rid, tokens, groups, *, device_indices_start, cache_salt):
        kv, slot = groups
        end = len(tokens) // CHUNK * CHUNK
        start = self.get_store_start(rid, end)
        if end <= start:
            return None
        for pos in range(start, end):
            j = pos - device_indices_start
            self.kv[(cache_salt, tuple(tokens[: pos + 1]))] = [b[kv[j]].clone() for b in self.buffers]
        self.state[(cache_salt, tuple(tokens[:end]))] = [t[:, int(slot)].clone() for t in self.states]
        self.store_pos[rid] = end
        self.stored.append((start, end))
        return types.SimpleNamespace(future=self._future(True))

    def complete_store(self, op):
        return True

    def end_session(self, rid):
        pass

    def finish_request(self, rid):
        self.store_pos.pop(rid, None)

    def end_all_sessions(self):
        pass

    def clear(self):
        self.kv.clear()
        self.state.clear()
        return True

    def close(self):
        pass


class TestLMCacheConnector(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.ctx, _ = F.scheduler_context(F.base_argv("--enable-mamba-radix", "--max-mamba-cache-size", "8"))

    def setUp(self):
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        stack = contextlib.ExitStack()
        stack.enter_context(F.in_context(self.ctx))
        self.addCleanup(stack.close)
        self.kv_pool = MHATokenToKVPool(KV_SIZE, page_size=1, dtype=torch.float32, head_num=2, head_dim=4,
                                        layer_num=2, device="cpu", enable_memory_saver=False)
        cache, alloc = F.build_tree_cache(F.build_req_pool(), KV_SIZE, kv_pool=self.kv_pool)
        self.core, self.alloc = cache.core, alloc
        self.buffers = list(self.kv_pool.k_buffer) + list(self.kv_pool.v_buffer)
        self.fake = FakeLMCache(self.buffers, self.core.mamba_pool.state_tensors())
        self.conn = LMCacheTreeConnector(self.core, self.fake, alloc)
        self.gen = torch.Generator().manual_seed(0)
        self.mamba_size = self.core.mamba_pool.available_size()

    # -- helpers ---------------------------------------------------------------------------
    def put(self, tokens, parent_len=0, ns=None):
        """Insert ``tokens`` with random KV and a random state after them."""
        n = len(tokens)
        head = self.core.match_prefix(RadixKey(tokens[:parent_len], ns)).device_indices if parent_len else None
        new = self.alloc.alloc(n - parent_len)
        for b in self.buffers:
            b[new] = torch.randn((n - parent_len, *b.shape[1:]), generator=self.gen)
        slot = self.core.mamba_pool.alloc_list(1)[0]
        for t in self.core.mamba_pool.state_tensors():
            t[:, slot] = torch.randn(t[:, slot].shape, generator=self.gen).to(t.dtype)
        value = torch.cat([head, new]) if head is not None else new
        self.core.insert(RadixKey(tokens, ns), value, mamba_value=slot, prev_prefix_len=parent_len)
        return [b[value].clone() for b in self.buffers], [t[:, slot].clone() for t in self.core.mamba_pool.state_tensors()]

    def empty_tree(self):
        """``/flush_cache``: the tree and both pools emptied (their contents clobbered)."""
        self.core.reset()
        self.alloc.clear()
        self.core.mamba_pool.free([s for s in range(1, self.mamba_size + 1)
                                   if s not in self.core.mamba_pool.free_slots()])
        for b in self.buffers:
            b.zero_()
        for t in self.core.mamba_pool.state_tensors():
            t.zero_()

    def hit(self, tokens, ns=None):
        req = CacheReq("r", list(tokens) + [7])
        m = self.core.match_prefix(RadixKey(list(tokens) + [7], ns), cow_mamba=True, req=req)
        return m, req

    def assert_all_free(self):
        self.core.sanity_check()
        self.assertEqual(self.alloc.available_size() + self.core.total_size(), KV_SIZE)
        self.assertEqual(self.core.mamba_pool.available_size() + self.core.mamba_total_size(), self.mamba_size)
        self.assertEqual(self.fake.locks, {})

    def seq(self, n, base=10):
        return [base + i for i in range(n)]

    # -- tests -----------------------------------------------------------------------------
    def test_stored_prefix_comes_back_bit_for_bit_after_the_tree_is_emptied(self):
        tokens = self.seq(24)
        kv, state = self.put(tokens)
        self.assertEqual(self.conn.store("a", tokens + [1, 2, 3], RadixKey(tokens + [1, 2, 3]), "s"), 24)
        self.assertEqual(self.conn.store("a", tokens + [1, 2, 3], RadixKey(tokens + [1, 2, 3]), "s"), 0)  # once
        self.empty_tree()
        query = tokens + [5, 6, 7, 8, 9]
        self.assertEqual(self.conn.fetch("b", query, RadixKey(query), "s"), 24)
        m, req = self.hit(tokens)
        self.assertEqual(m.prefix_len, 24)
        for b, want in zip(self.buffers, kv):
            self.assertTrue(torch.equal(b[m.device_indices], want))
        for t, want in zip(self.core.mamba_pool.state_tensors(), state):
            self.assertTrue(torch.equal(t[:, m.mamba_cow_src_index], want))
        self.core.mamba_pool.free([req.mamba_pool_idx])
        self.assert_all_free()
        self.assertEqual((self.conn.loads, self.conn.loaded_tokens, self.conn.failures), (1, 24, 0))

    def test_only_chunk_aligned_tree_states_are_stored(self):
        tokens = self.seq(21)
        self.put(tokens[:16])
        self.put(tokens, parent_len=16)  # a state at 21: not a chunk end
        self.assertEqual(self.conn.store("a", tokens, RadixKey(tokens), "s"), 16)
        self.assertEqual(self.fake.stored, [(0, 16)])
        fresh = self.seq(13, base=200)
        self.put(fresh)  # no state at a chunk end: nothing to store
        self.assertEqual(self.conn.store("b", fresh, RadixKey(fresh), "s"), 0)

    def test_a_tree_hit_is_extended_with_the_missing_tokens_only(self):
        tokens = self.seq(32)
        self.put(tokens[:8])
        kv, state = self.put(tokens, parent_len=8)
        self.conn.store("a", tokens, RadixKey(tokens), "s")
        self.empty_tree()
        self.put(tokens[:8])  # the tree holds 8 again (other KV)
        before = self.alloc.available_size()
        self.assertEqual(self.conn.fetch("b", tokens + [3], RadixKey(tokens + [3]), "s"), 24)
        self.assertEqual(before - self.alloc.available_size(), 24)
        m, req = self.hit(tokens)
        self.assertEqual(m.prefix_len, 32)
        for b, want in zip(self.buffers, kv):
            self.assertTrue(torch.equal(b[m.device_indices[8:]], want[8:]))
        for t, want in zip(self.core.mamba_pool.state_tensors(), state):
            self.assertTrue(torch.equal(t[:, m.mamba_cow_src_index], want))
        self.core.mamba_pool.free([req.mamba_pool_idx])
        self.assert_all_free()

    def test_salts_stay_apart(self):
        tokens = self.seq(16)
        self.put(tokens)
        self.conn.store("a", tokens, RadixKey(tokens), "tenant-a")
        self.empty_tree()
        self.assertEqual(self.conn.fetch("b", tokens + [1], RadixKey(tokens + [1], ("x", "tenant-b")), "tenant-b"), 0)
        self.assertEqual(self.conn.fetch("c", tokens + [1], RadixKey(tokens + [1]), "tenant-a"), 16)
        self.assert_all_free()

    def test_a_failed_retrieve_or_no_room_is_a_miss_that_frees_everything(self):
        tokens = self.seq(24)
        self.put(tokens)
        self.conn.store("a", tokens, RadixKey(tokens), "s")
        self.empty_tree()
        self.fake.fail_load = True
        self.assertEqual(self.conn.fetch("b", tokens + [1], RadixKey(tokens + [1]), "s"), 0)
        self.assertEqual(self.core.total_size(), 0)
        self.assert_all_free()
        self.assertEqual(self.conn.failures, 1)
        self.fake.fail_load = False
        held = self.alloc.alloc(KV_SIZE - 10)  # 10 free KV slots, nothing evictable: no room for 24
        self.assertEqual(self.conn.fetch("c", tokens + [1], RadixKey(tokens + [1]), "s"), 0)
        self.alloc.free(held)
        self.assert_all_free()
        self.assertEqual(self.conn.fetch("d", tokens + [1], RadixKey(tokens + [1]), "s"), 24)

    def test_a_retrieve_past_its_timeout_holds_its_slots_until_it_ends(self):
        """LMCache may still copy into the slots of a retrieve past its timeout: they stay
        allocated (quarantined) until its future is done, then a later call frees them."""
        tokens = self.seq(24)
        self.put(tokens)
        self.conn.store("a", tokens, RadixKey(tokens), "s")
        self.empty_tree()
        kv_free, ssm_free = self.alloc.available_size(), self.core.mamba_pool.available_size()
        self.fake.slow = True
        self.assertEqual(self.conn.fetch("b", tokens + [1], RadixKey(tokens + [1]), "s"), 0)
        self.assertEqual((self.conn.quarantined, self.conn.failures), (1, 1))
        self.assertEqual(kv_free - self.alloc.available_size(), 24)  # held, not reused
        self.assertEqual(ssm_free - self.core.mamba_pool.available_size(), 1)
        self.assertEqual(self.core.total_size(), 0)  # and not in the tree
        self.conn.fetch("c", [1], RadixKey([1]), "s")  # still running: still held
        self.assertEqual(self.conn.quarantined, 1)
        self.fake.futures[-1].finished = True
        self.conn.fetch("d", [1], RadixKey([1]), "s")  # done now: freed at the next call
        self.assertEqual(self.conn.quarantined, 0)
        self.assert_all_free()

    def test_a_store_past_its_timeout_keeps_its_node_locked_until_it_ends(self):
        tokens = self.seq(16)
        self.put(tokens)
        self.fake.slow = True
        self.assertEqual(self.conn.store("a", tokens, RadixKey(tokens), "s"), 0)
        node = self.core.match_prefix(RadixKey(tokens)).last_node
        self.assertEqual((self.conn.quarantined, node.full_lock_ref), (1, 1))
        self.fake.futures[-1].finished = True
        self.fake.slow = False
        self.conn.store("b", [1], RadixKey([1]), "s")
        self.assertEqual((self.conn.quarantined, node.full_lock_ref), (0, 0))

    def test_an_error_after_the_transfer_frees_everything(self):
        """An exception in ``complete_load`` or in the tree's insert is a miss, its slots freed."""
        tokens = self.seq(24)
        self.put(tokens)
        self.conn.store("a", tokens, RadixKey(tokens), "s")
        self.empty_tree()
        self.fake.complete_raises = True
        self.assertEqual(self.conn.fetch("b", tokens + [1], RadixKey(tokens + [1]), "s"), 0)
        self.assert_all_free()
        self.fake.complete_raises = False
        with unittest.mock.patch.object(self.core, "insert", side_effect=ValueError("bad insert")):
            self.assertEqual(self.conn.fetch("c", tokens + [1], RadixKey(tokens + [1]), "s"), 0)
        self.assert_all_free()
        self.assertEqual(self.conn.failures, 2)
        self.assertEqual(self.conn.fetch("d", tokens + [1], RadixKey(tokens + [1]), "s"), 24)

    def test_boundary_is_the_last_chunk_end_inside_the_prompt(self):
        self.assertEqual([self.conn.boundary(n) for n in (8, 9, 16, 17, 100)], [None, 8, 8, 16, 96])


class TestMovedStateStorage(unittest.TestCase):
    def test_pool_tensors_follow_the_views_lmcache_moved(self):
        """LMCache re-points only the views it was given (``tensor.set_`` onto shared memory); the
        pool's own tensors are re-pointed at the same storage, so what the model writes is what
        LMCache stores and what LMCache loads is what the model reads."""
        conv = torch.arange(2 * 5 * 3, dtype=torch.float32).reshape(2, 5, 3)
        temporal = torch.arange(2 * 5 * 4, dtype=torch.float32).reshape(2, 5, 4) + 100
        cache = types.SimpleNamespace(conv=[conv], temporal=temporal, extra=None)
        pool = types.SimpleNamespace(mamba_cache=cache)
        entries = [conv[0], conv[1], temporal[0], temporal[1]]
        before = [t.untyped_storage().data_ptr() for t in entries]
        views = [t.view(t.shape[0], 1, -1) for t in entries]
        moved = {}
        for v in views:  # what LMCache's migration does: copy the whole storage, re-point the view
            old = v.untyped_storage()
            if old.data_ptr() not in moved:
                new = torch.empty(old.nbytes(), dtype=torch.uint8)
                new.copy_(torch.frombuffer(bytearray(bytes(old)), dtype=torch.uint8))
                moved[old.data_ptr()] = new.untyped_storage()
            v.set_(moved[old.data_ptr()], v.storage_offset(), v.size(), v.stride())
        self.assertEqual(share_moved_state_storage(pool, before, views), 2)
        for t, v in zip(entries[:1], views[:1]):
            self.assertNotEqual(t.untyped_storage().data_ptr(), v.untyped_storage().data_ptr())  # old views stay
        self.assertEqual(conv.untyped_storage().data_ptr(), views[0].untyped_storage().data_ptr())
        self.assertEqual(temporal.untyped_storage().data_ptr(), views[2].untyped_storage().data_ptr())
        conv[1, 2] = -7.0  # a state the model writes ...
        self.assertTrue(torch.equal(views[1].reshape(5, 3)[2], torch.full((3,), -7.0)))  # ... is what LMCache reads
        views[3].view(5, 4)[1] = 9.0  # a state LMCache loads ...
        self.assertTrue(torch.equal(temporal[1, 1], torch.full((4,), 9.0)))  # ... is what the model reads
        self.assertEqual(share_moved_state_storage(pool, [t.untyped_storage().data_ptr() for t in views], views), 0)


class TestLMCacheOptional(unittest.TestCase):
    def test_sglang_refusals_still_apply(self):
        """SGLang's own refusals of --enable-lmcache stay (arg_groups/mamba_hook.py: "LMCache is not
        int8-aware"; arg_groups/kv_cache_hook.py: with --enable-hierarchical-cache "mutually
        exclusive"), and the plugin's (several ranks); without the lmcache package the plugin
        refuses first, naming it."""
        cases = {
            ("--enable-int8-mamba-checkpoint",):
                "--enable-int8-mamba-checkpoint is not supported together with --enable-lmcache: LMCache is not "
                "int8-aware. Disable one of them.",
            ("--enable-hierarchical-cache",):
                "--enable-lmcache and --enable-hierarchical-cache are mutually exclusive",
            # the plugin's: one rank only (docs/flags.md, "LMCache")
            ("--tp", "2"):
                "--enable-mamba-radix cannot be combined with --enable-lmcache at --tp 2 / --pp 1 / --dp 1 (the "
                "plugin's LMCache connector serves one rank",
        }
        for extra, message in cases.items():
            with self.subTest(extra=extra):
                with self.assertRaises(ValueError) as cm:
                    F.scheduler_context(F.base_argv("--enable-mamba-radix", "--enable-lmcache", *extra))
                if lmcache_installed():
                    self.assertIn(message, str(cm.exception))
                else:
                    self.assertIn("--enable-lmcache needs the lmcache package", str(cm.exception))

    def test_the_plugin_imports_without_lmcache(self):
        """The connector module imports ``lmcache`` only when a connector is built."""
        import sys

        import sglang_mamba_ext.plugin.cache  # noqa: F401
        import sglang_mamba_ext.plugin.lmcache_connector  # noqa: F401

        if not lmcache_installed():
            self.assertNotIn("lmcache", sys.modules)


if __name__ == "__main__":
    unittest.main()
