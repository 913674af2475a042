"""The storage tier over SGLang's mooncake backend (issue 42 item 1, ``docs/design.md``,
"Storage tier"): ``--enable-hierarchical-cache --hicache-storage-backend mooncake`` with
``--enable-mamba-radix``, the cache built as the scheduler builds it (as in
``test_storage_tier.py``) against a real ``mooncake_master`` started on localhost for each
test (tcp; skipped, with the reason, where the master cannot start). SGLang's
``MooncakeStore`` is set up from ``--hicache-storage-backend-extra-config``; the tier reaches
it through ``plugin/storage_mooncake.py::MooncakeValues``.

The tier's tests of ``test_storage_tier.py`` run here unchanged, the ones that damage stored
values through this class's ``stored`` / ``replace`` / ``remove`` on mooncake objects (a bit
flipped, a value cut short, another page's value, a removed value); plus the adapter's own semantics (``set`` keeps a
stored key, ``get`` of a missing / shorter / longer value, ``batch_exists`` counting from
the first key, a forced discard) and what a restart means for mooncake: the values live in
the segment the writing process mounts, so a client that goes takes them along."""

import contextlib
import os
import shutil
import tempfile
import time
import unittest
from unittest import mock

import torch

import sglang_glue_fixtures as F
import test_storage_tier as base
from mooncake_master import MooncakeMaster

KV_SIZE, MAMBA_SIZE = base.KV_SIZE, base.MAMBA_SIZE


class TestMooncakeStorageTier(base.TestStorageTier):
    """One master per class; the caches' storage tiers share one mooncake client (a client's
    ``close`` takes about 2 s), emptied before each test; ``build(fresh=True)`` sets up a
    client of its own."""

    #: more keys for the extra config (the guard's, below)
    EXTRA_CONFIG = {}

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        cls.master_dir = tempfile.mkdtemp(prefix="smx-mooncake-")
        cls.addClassCleanup(shutil.rmtree, cls.master_dir, True)
        cls.master = MooncakeMaster(os.path.join(cls.master_dir, "master.log"))
        cls.addClassCleanup(cls.master.stop)  # after the shared client's close below
        why = cls.master.start()
        if why is not None:
            raise unittest.SkipTest(f"no local mooncake master: {why}")
        cls.shared = None
        cls.addClassCleanup(cls.drop_shared)

    @classmethod
    def drop_shared(cls):
        if cls.shared is not None:
            cls.shared.store.close()
            cls.shared = None

    def setUp(self):
        super().setUp()
        if self.shared is not None:
            self.shared.store.remove_all(True)

    def build(self, *flags, fresh=False):
        """A fresh cache whose storage tier is a client of the class's master (the shared
        one, or one of its own with ``fresh``)."""
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        ctx, _ = F.scheduler_context(F.base_argv(
            "--enable-mamba-radix", "--enable-hierarchical-cache", "--hicache-ratio", "1",
            "--max-mamba-cache-size", str(MAMBA_SIZE), "--hicache-storage-backend", "mooncake",
            "--hicache-storage-backend-extra-config", self.master.extra_config_json(**self.EXTRA_CONFIG), *flags))
        stack = contextlib.ExitStack()
        stack.enter_context(F.in_context(ctx))
        self.addCleanup(stack.close)
        kv_pool = MHATokenToKVPool(KV_SIZE, page_size=1, dtype=torch.float32, head_num=2, head_dim=4, layer_num=2,
                                   device="cpu", enable_memory_saver=False)
        create = StorageBackendFactory.create_backend
        cls = type(self)

        def shared(name, config, pool):
            if cls.shared is None:
                cls.shared = create(name, config, pool)
            return cls.shared

        with mock.patch.object(StorageBackendFactory, "create_backend", create if fresh else shared):
            cache, _ = F.build_tree_cache(F.build_req_pool(), KV_SIZE, hierarchical=True, kv_pool=kv_pool)
        self.adapter = cache
        # its staging buffer (and its own client): unregistered before the client closes
        if fresh:
            self.addCleanup(self.close_client, cache.core.storage)
        else:
            self.addCleanup(cache.core.storage.close)
        return cache.core, kv_pool

    @staticmethod
    def close_client(storage):
        """Unregister the staging buffer, then close the client, once (mooncake crashes on
        a buffer unregistered from a closed client)."""
        storage.close()
        if not getattr(storage, "client_closed", False):
            storage.client_closed = True
            storage.client.close()

    # -- mooncake objects --------------------------------------------------------------------
    def stored(self, core, key):
        return bytes(core.storage.client.get(core.storage.name(key)))

    def replace(self, core, key, data: bytes):
        client, name = core.storage.client, core.storage.name(key)
        client.remove(name, True)
        self.assertEqual(client.put(name, data), 0)

    def remove(self, core, key):
        core.storage.discard(key)

    def reset_store(self):
        self.adapter.clear_storage_backend()

    # -- the adapter's semantics -------------------------------------------------------------
    def test_set_get_exists_batch_exists(self):
        core, _ = self.build()
        st = core.storage
        a = torch.arange(100, dtype=torch.uint8)
        self.assertTrue(st.set("a", a))
        self.assertTrue(st.set("b", torch.full((7,), 3, dtype=torch.uint8)))
        self.assertTrue(st.set("c", torch.ones(5, dtype=torch.uint8)))
        self.assertTrue(st.set("a", torch.zeros(100, dtype=torch.uint8)))  # stored already: kept
        target = torch.empty(100, dtype=torch.uint8)
        got = st.get("a", target)
        self.assertIs(got, target)
        self.assertTrue(torch.equal(got, a))
        self.assertIsNone(st.get("missing", torch.empty(4, dtype=torch.uint8)))
        self.assertEqual(st.get("b", torch.empty(100, dtype=torch.uint8)).tolist(), [3] * 7)  # shorter: its length
        self.assertEqual((st.exists("a"), st.exists("missing")), (True, False))
        self.assertEqual(st.batch_exists(["a", "b", "missing", "c"]), 2)
        self.assertEqual(st.batch_exists(["a", "b", "c"]), 3)
        self.assertEqual(st.batch_exists(["missing", "a"]), 0)
        self.assertEqual(st.batch_exists([]), 0)
        # a value longer than the staging buffer holds: mooncake refuses the read
        big = torch.ones(4 * st._staging.numel(), dtype=torch.uint8)
        client = st.client
        staging = torch.empty(big.numel(), dtype=torch.uint8)
        staging.copy_(big)
        self.assertEqual(client.register_buffer(staging.data_ptr(), staging.numel()), 0)
        self.assertEqual(client.batch_put_from([st.name("big")], [staging.data_ptr()], [staging.numel()]), [0])
        client.unregister_buffer(staging.data_ptr())
        with self.assertRaises(RuntimeError):
            st.get("big", torch.empty(10, dtype=torch.uint8))
        # a discard right after a read (mooncake leases what it served) still removes the key
        st.discard("a")
        self.assertFalse(st.exists("a"))
        self.assertTrue(st.set("a", torch.zeros(100, dtype=torch.uint8)))
        self.assertEqual(st.get("a", target).sum().item(), 0)
        # SGLang's model prefix names the objects
        self.assertTrue(st.name("a").endswith("_a") and st.name("a") != "a")

    def test_the_tier_rejects_a_longer_or_foreign_value_and_discards_it(self):
        core, kv_pool = self.build()
        tokens = list(range(140, 148))
        kv, state = self.put(core, kv_pool, tokens, seed=12)
        self.push_out(core)
        keys = core._page_hasher(tokens, None)
        n = core._state_bytes()
        state_key = keys[-1] + core.state_suffix
        good = self.stored(core, state_key)
        self.assertEqual(len(good), n + 32)
        for how, data in (("longer", good + b"\0" * 9), ("foreign", self.stored(core, keys[0]))):
            with self.subTest(how=how):
                rejected = core.storage_rejected_total
                self.replace(core, state_key, data)
                self.assertIsNone(core._read(state_key, n))
                self.assertEqual(core.storage_rejected_total, rejected + 1)
                self.assertFalse(core.storage.exists(state_key))  # discarded
        self.replace(core, state_key, good)
        self.clobber(core, kv_pool)
        m, req = self.hit(core, tokens)
        self.assertEqual(m.prefix_len, 8)
        self.assert_exact(core, kv_pool, m, req, kv, state)
        self.release(core, req)

    # -- where mooncake differs from files: values do not outlive their client -----------------
    def test_a_new_cache_on_the_same_directory_hits_from_storage(self):
        """Mooncake's values live in the segments its clients mount: a second client of the
        same master reads what the first wrote while the first is up; once the first client
        goes (a server stopped), so do the values it holds: a restarted server misses."""
        self.drop_shared()  # (mooncake places a value in any client's segment)
        core, kv_pool = self.build(fresh=True)
        tokens = list(range(30, 46))
        kv, state = self.put(core, kv_pool, tokens, seed=2)
        self.push_out(core)
        core2, kv_pool2 = self.build()  # the shared client, set up anew
        self.assertEqual(core2.total_size(), 0)
        m, req = self.hit(core2, tokens)
        self.assertEqual(m.prefix_len, 16)
        self.assert_exact(core2, kv_pool2, m, req, kv, state)
        self.release(core2, req)
        self.close_client(core.storage)  # the writer's segment goes (a stopped server)
        keys = core2._page_hasher(tokens, None)
        deadline = time.monotonic() + 10
        while core2.storage.exists(keys[-1] + core2.state_suffix) and time.monotonic() < deadline:
            time.sleep(0.2)
        core3, _ = self.build()  # a new tree (a restarted server) on a client that stayed
        m, req = self.hit(core3, tokens)
        self.assertEqual((m.prefix_len, core3.storage_loads_total), (0, 0))
        if req.mamba_pool_idx is not None:
            self.release(core3, req)


class TestMooncakeMasterGone(TestMooncakeStorageTier):
    """A master that goes away (``docs/flags.md``): without the guard each mooncake call then
    waits about 4.3 s on its client's retries (measured), and a request's spill of a hundred
    pages held the scheduler for minutes. With it, the tier's calls are misses and dropped
    writes within ``storage_call_timeout_s``, and hits come back once the master does. The
    class's own master (killed and restarted on its ports); the inherited tests do not run
    here."""

    TIMEOUT_S, RETRY_S = 0.5, 0.3
    EXTRA_CONFIG = {"storage_call_timeout_s": TIMEOUT_S, "storage_retry_interval_s": RETRY_S}

    def test_misses_within_the_bound_then_hits_after_the_master_returns(self):
        from sglang_mamba_ext.mem_cache.storage_guard import GuardedStore

        core, kv_pool = self.build()
        st = core.storage
        self.assertIsInstance(st, GuardedStore)
        self.assertEqual((st.timeout_s, st.retry_s), (self.TIMEOUT_S, self.RETRY_S))
        stored = list(range(60, 72))
        kv, state = self.put(core, kv_pool, stored, seed=5)
        self.push_out(core)
        self.assertEqual(self.count_stored(core, stored), (1, 12))
        kept = list(range(80, 90))  # in the tree when the master goes: its spill is dropped
        self.put(core, kv_pool, kept, seed=6)

        self.master.stop()
        keys = core._page_hasher(stored, None)
        t0 = time.monotonic()
        calls = [
            ("exists", lambda: st.exists(keys[0] + core.state_suffix), False),
            ("batch_exists", lambda: st.batch_exists(keys), 0),
            ("get", lambda: st.get(keys[0], torch.empty(8, dtype=torch.uint8)), None),
            ("set", lambda: st.set("gone", torch.ones(8, dtype=torch.uint8)), False),
        ]
        for what, call, miss in calls:
            t = time.monotonic()
            self.assertEqual(call(), miss, what)
            self.assertLess(time.monotonic() - t, self.TIMEOUT_S + 0.5, what)
        self.assertFalse(st.available)
        self.assertEqual(st.outages_total, 1)
        # the tier through its own paths: a spill of 10 pages and a match that would read back
        # 12 are dropped / missed, all calls answered at once now
        written = (core.storage_states_written_total, core.storage_kv_pages_written_total)
        t = time.monotonic()
        self.push_out(core)
        self.clobber(core, kv_pool)
        m, req = self.hit(core, stored)
        elapsed = time.monotonic() - t
        self.assertEqual((m.prefix_len, core.storage_loads_total), (0, 0))
        self.assertEqual((core.storage_states_written_total, core.storage_kv_pages_written_total), written)
        self.assertEqual(core.storage_rejected_total, 0)
        self.assertLess(elapsed, 0.5)
        self.assertLess(time.monotonic() - t0, 4 * (self.TIMEOUT_S + 0.5))
        self.assertGreater(st.unavailable_total, len(calls))
        if req.mamba_pool_idx is not None:
            self.release(core, req)

        # the master comes back (empty: its objects were in its memory): within a probe or
        # two the tier's calls go through again, and a value written now hits exactly
        self.assertIsNone(self.master.start(same_ports=True))
        deadline = time.monotonic() + 30
        while not st.available and time.monotonic() < deadline:
            st.exists("probe")  # a call while down starts a probe every RETRY_S
            time.sleep(0.1)
        self.assertTrue(st.available, "the master came back, the tier did not")
        self.assertEqual(st.recoveries_total, 1)
        again = list(range(100, 116))
        deadline = time.monotonic() + 30  # the client mounts its segment again after its reconnect
        while True:
            kv, state = self.put(core, kv_pool, again, seed=7)
            self.push_out(core)
            if self.count_stored(core, again) == (1, 16) or time.monotonic() > deadline:
                break
            again = [t + 100 for t in again]
        self.assertEqual(self.count_stored(core, again), (1, 16))
        self.clobber(core, kv_pool)
        loads = core.storage_loads_total
        m, req = self.hit(core, again)
        self.assertEqual((m.prefix_len, core.storage_loads_total - loads), (16, 1))
        self.assert_exact(core, kv_pool, m, req, kv, state)
        self.release(core, req)
        self.assertEqual(core.storage_rejected_total, 0)


for _name in dir(TestMooncakeStorageTier):  # only the class's own test runs on its master
    if _name.startswith("test_") and _name not in TestMooncakeMasterGone.__dict__:
        setattr(TestMooncakeMasterGone, _name, None)


class TestMooncakeStorageFlags(unittest.TestCase):
    def test_mooncake_accepted_standalone_refused(self):
        from sglang_mamba_ext.plugin.host_tier import _check_mooncake_config
        from sglang_mamba_ext.plugin.settings import settings_of

        args = F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-hierarchical-cache",
                                        "--hicache-storage-backend", "mooncake"))
        self.assertIsNone(args.hicache_storage_backend)  # SGLang's own prefetch protocol stays off
        self.assertEqual(settings_of(args)["storage_backend"], "mooncake")
        with self.assertRaises(ValueError) as cm:
            F.parse_args(F.base_argv("--enable-mamba-radix", "--enable-hierarchical-cache",
                                     "--hicache-storage-backend", "mooncake", "--tp", "2"))
        self.assertIn("--hicache-storage-backend mooncake at --tp 2", str(cm.exception))
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
            enable_storage_metrics=False, is_page_first_layout=False, model_name=None,
            extra_config={"master_server_address": "127.0.0.1:1", "standalone_storage": True})
        with self.assertRaises(ValueError) as cm:
            _check_mooncake_config(config)
        self.assertIn("standalone_storage", str(cm.exception))


if __name__ == "__main__":
    unittest.main()
