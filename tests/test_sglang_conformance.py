"""SGLang conformance (issue 11, item 3): the scenarios of SGLang's public unit tests for its
hybrid (full attention + mamba) cache, re-expressed against this project's
``MambaRadixCacheAdapter`` and run, step for step, on SGLang 0.5.23's own hybrid cache built
in-process by SGLang's installed test kit (``tests/sglang_conformance_sides.py``).

Sources (SGLang's repository): ``test/registered/unit/mem_cache/test_mamba_unittest.py``
(``test_mamba_pool``, ``test_mamba_radix_cache_1``,
``test_mamba_lru_match_refreshes_only_used_node``, ``test_insert_prev_prefix_len``, the two
KV-event tests) and the mamba scenarios of
``test/registered/unit/mem_cache/test_unified_radix_cache_unittest.py`` whose fixtures the
installed kit ships (``sglang.test.kits.unified_radix_cache.core``:
``MambaCheckpointGridFixtures``, ``MambaFinishedOvershootCheckpointFixtures``). The kit's
test bodies read SGLang's tree internals (``tree_core``), so they cannot be called on the
adapter; the scenarios are written here, each one test named after its source, asserting
the exact values of the scenario on both caches. Differences kept on purpose are listed in
``docs/design.md``, "SGLang conformance", and their tests assert this project's behaviour.
"""

import unittest
from array import array

from sglang_conformance_sides import OursSide, SGLangSide

TOKENS_A = [1, 2, 3]
TOKENS_B = [1, 2, 3, 4, 5, 6, 7]
TOKENS_C = [10, 11, 12]
TOKENS_D = [1, 2, 3, 4, 5, 60, 70]


def removed(hashes):
    """SGLang's ``BlockRemoved`` of ``hashes`` (the device pool), as a subscriber decodes it."""
    from sglang.srt.disaggregation.kv_events import BlockRemoved, StorageMedium
    from test_kv_events import decoded

    return decoded([BlockRemoved(block_hashes=list(hashes), medium=StorageMedium.GPU)])


def both(kv_events=False, **sglang_kit_config):
    """A fresh pair: SGLang's cache (kit ``CacheConfig`` overrides) and ours; ``kv_events``:
    both built with KV events on (``CacheInitParams.enable_kv_cache_events``)."""
    ours_kw = {k: sglang_kit_config.pop(k) for k in ("ours_argv",) if k in sglang_kit_config}
    kv = sglang_kit_config.setdefault("kv_size", 128)
    fixture_kwargs = dict(sglang_kit_config.pop("fixture_kwargs", None) or {})
    if kv_events:
        fixture_kwargs["enable_kv_cache_events"] = True
    return [
        SGLangSide(fixture_kwargs=fixture_kwargs, **sglang_kit_config),
        OursSide(kv_size=kv, extra_argv=ours_kw.get("ours_argv"), kv_events=kv_events),
    ]


class TestMambaUnittest(unittest.TestCase):
    """``test/registered/unit/mem_cache/test_mamba_unittest.py``."""

    def test_mamba_pool(self):
        """Rows and SSM slots through ``alloc`` / ``free_mamba_cache`` / ``free``: 10 rows,
        20 slots, one slot per request (no ping-pong slots)."""
        for side in both():
            with self.subTest(side=side.name), side.active():
                pool = side.pool
                self.assertEqual((pool.available_size(), pool.mamba_allocator.available_size()), (10, 20))
                req = side.new_req()
                self.assertEqual((pool.available_size(), pool.mamba_allocator.available_size()), (9, 19))
                pool.free_mamba_cache(req)
                pool.free(req)
                self.assertEqual((pool.available_size(), pool.mamba_allocator.available_size()), (10, 20))
                # alloc, then free the row only
                req.kv.mamba_pool_idx = None
                pool.alloc([req])
                pool.free(req)
                self.assertEqual(pool.available_size(), 10)
                ssm_after_row_free = pool.mamba_allocator.available_size()
                pool.alloc([req])
                self.assertEqual(pool.available_size(), 9)
                self.assertEqual(pool.mamba_allocator.available_size(), 19)
                if side.name == "sglang":
                    # SGLang's free(req) leaves the SSM slot with the request (reused by
                    # the next alloc).
                    self.assertEqual(ssm_after_row_free, 19)
                else:
                    # Ours gives it back with the row (docs/design.md, SGLang conformance).
                    self.assertEqual(ssm_after_row_free, 20)

    def test_mamba_radix_cache_1(self):
        """Four inserts, a KV eviction, SSM evictions, matches through tombstones, a
        copy-on-write match; sizes after each step."""
        results = {}
        for side in both():
            with self.subTest(side=side.name), side.active():
                out = results[side.name] = {}
                out["inserts"] = [side.insert(t, side.new_req()) for t in (TOKENS_A, TOKENS_B, TOKENS_C, TOKENS_D)]
                self.assertEqual(out["inserts"], [(0, False), (3, False), (0, False), (5, False)])
                self.assertEqual(
                    side.nodes(),
                    {(1, 2, 3): True, (1, 2, 3, 4, 5): False, tuple(TOKENS_B): True, tuple(TOKENS_C): True,
                     tuple(TOKENS_D): True},
                )
                self.assertEqual(side.sizes()["full_evictable"], 12)
                self.assertEqual(side.sizes()["mamba_evictable"], 4)
                # One KV token: the least recent leaf goes whole (3 tokens, its state).
                self.assertEqual(side.evict(num_tokens=1), (3, 1))
                self.assertNotIn(tuple(TOKENS_C), side.nodes())
                # One state: the least recent one, an inner node's (KV kept).
                self.assertEqual(side.evict(mamba_num=1), (0, 1))
                self.assertFalse(side.nodes()[(1, 2, 3)])
                m5 = side.match([1, 2, 3, 4, 5])
                self.assertEqual((m5.device_prefix_len, side.path(m5.last_device_node), m5.full_kv_hit_length), (0, (), 5))
                for toks in (TOKENS_D, TOKENS_B):
                    m = side.match(toks)
                    self.assertEqual(m.device_prefix_len, 7)
                    self.assertEqual(side.path(m.last_device_node), tuple(toks))
                # The next state to go is TOKENS_D's leaf (matched before TOKENS_B): whole.
                self.assertEqual(side.evict(mamba_num=1), (2, 1))
                m8 = side.match(TOKENS_D)
                self.assertEqual((m8.device_prefix_len, side.path(m8.last_device_node)), (0, ()))
                # Copy-on-write: the request's own slot receives the node's state at the
                # forward start (deferred, SGLang 0.5.23).
                req9 = side.new_req()
                src = side.state_slot(side.match(TOKENS_B).last_device_node)
                side.write_state(src, 7.0)
                m9 = side.match(TOKENS_B, req=req9, cow=True)
                self.assertEqual(m9.device_prefix_len, 7)
                self.assertEqual(int(req9.kv.mamba_cow_src_index[0]), src)
                self.assertNotEqual(int(req9.kv.mamba_pool_idx), src)
                side.run_deferred_cow(req9)
                got, want = side.state(int(req9.kv.mamba_pool_idx)), side.state(src)
                self.assertTrue(bool((got[0] == want[0]).all()) and bool((got[1] == want[1]).all()))
                self.assertEqual(float(got[1].reshape(-1)[0]), 7.0)
                out["sizes"] = side.sizes()
                self.assertEqual(
                    out["sizes"],
                    {"kv_available": 121, "mamba_available": 18, "full_evictable": 7, "full_protected": 0,
                     "mamba_evictable": 1, "mamba_protected": 0},
                )
                side.cache.sanity_check()
        self.assertEqual(results["ours"], results["sglang"])

    def test_mamba_lru_match_refreshes_only_used_node(self):
        """A hit moves only the state it used to the front of the SSM LRU, not its
        ancestors' states."""
        for side in both():
            with self.subTest(side=side.name), side.active():
                for t in ([1, 2, 3], [1, 2, 3, 4, 5, 6], [7, 8, 9], [7, 8, 9, 10, 11, 12]):
                    side.insert(t, side.new_req())
                a1, b1, a2, b2 = (1, 2, 3), (1, 2, 3, 4, 5, 6), (7, 8, 9), (7, 8, 9, 10, 11, 12)
                self.assertEqual(side.path(side.match(list(b1)).last_device_node), b1)
                self.assertEqual(side.path(side.match(list(b2)).last_device_node), b2)
                order = side.mamba_lru()
                self.assertGreater(order.index(a1), order.index(a2))
                side.match(list(b1))
                order = side.mamba_lru()
                self.assertEqual(order[0], b1)
                self.assertGreater(order.index(a1), order.index(a2))
                self.assertEqual(order, [b1, b2, a2, a1])
                side.cache.sanity_check()

    def test_insert_prev_prefix_len(self):
        """``prev_prefix_len`` decides which of the caller's duplicate KV slots the insert
        frees: all matched ones, those past a protected prefix across two nodes, none."""
        for side in both():
            with self.subTest(side=side.name), side.active():
                kv = side.allocator
                start = kv.available_size()
                side.insert([1, 2, 3], side.new_req())
                self.assertEqual(kv.available_size(), start - 3)
                self.assertEqual(side.insert([1, 2, 3, 4, 5, 6, 7], side.new_req(), prev_prefix_len=0), (3, False))
                self.assertEqual(kv.available_size(), start - 7)
                self.assertEqual(side.insert(list(range(1, 9)), side.new_req(), prev_prefix_len=2), (7, False))
                self.assertEqual(kv.available_size(), start - 7 - 3)
                self.assertEqual(side.insert(list(range(1, 10)), side.new_req(), prev_prefix_len=8), (8, False))
                self.assertEqual(kv.available_size(), start - 7 - 3 - 9)
                side.cache.sanity_check()

    def test_mamba_radix_cache_kv_events(self):
        """KV events (both caches built with ``enable_kv_cache_events``, decoded as SGLang's
        subscribers decode them): one ``BlockStored`` per insert, linked to the block
        before it; nothing when an inner state is evicted (its KV stays covered by the
        state below); a KV eviction withdraws every stored block exactly once in all.

        The difference (docs/design.md, "SGLang conformance"): the KV eviction of the leaf
        leaves the stateless ``[1, 2, 3]`` without a child. SGLang 0.5.23 keeps it in the
        tree and keeps announcing its blocks, although no request can resume there (KV hit
        3, usable 0) until its own eviction withdraws them; ours removes it with the leaf
        and withdraws all five blocks at once, as SGLang's scenario expects."""
        from sglang.srt.disaggregation.kv_events import AllBlocksCleared, BlockStored

        results = {}
        for side in both(kv_events=True):
            with self.subTest(side=side.name), side.active():
                self.assertEqual(side.events(), [AllBlocksCleared()])
                side.insert([1, 2, 3], side.new_req())
                (first,) = side.events()
                self.assertIsInstance(first, BlockStored)
                self.assertEqual(
                    (first.token_ids, first.parent_block_hash, first.block_size, len(first.block_hashes)),
                    ([1, 2, 3], None, 1, 3),
                )
                side.insert([1, 2, 3, 4, 5], side.new_req())
                (second,) = side.events()
                self.assertIsInstance(second, BlockStored)
                self.assertEqual(
                    (second.token_ids, second.parent_block_hash, len(second.block_hashes)),
                    ([4, 5], first.block_hashes[-1], 2),
                )
                self.assertEqual(len(set(first.block_hashes + second.block_hashes)), 5)
                # State-only eviction of the inner state at 3: no event on either side.
                self.assertEqual(side.evict(mamba_num=1), (0, 1))
                self.assertEqual(side.nodes(), {(1, 2, 3): False, (1, 2, 3, 4, 5): True})
                self.assertEqual(side.events(), [])
                # One KV token: the leaf goes, with its state.
                if side.name == "sglang":
                    self.assertEqual(side.evict(num_tokens=1), (2, 1))
                    self.assertEqual(side.nodes(), {(1, 2, 3): False})
                    self.assertEqual(side.events(), removed(second.block_hashes))
                    m = side.match([1, 2, 3, 4])
                    self.assertEqual((m.device_prefix_len, m.full_kv_hit_length), (0, 3))
                    # [1, 2, 3] stays announced until its own eviction.
                    self.assertEqual(side.evict(num_tokens=1), (3, 0))
                    self.assertEqual(side.events(), removed(first.block_hashes))
                else:
                    self.assertEqual(side.evict(num_tokens=1), (5, 1))
                    self.assertEqual(side.events(), removed(second.block_hashes + first.block_hashes))
                    m = side.match([1, 2, 3, 4])
                    self.assertEqual((m.device_prefix_len, m.full_kv_hit_length), (0, 0))
                # Every stored block withdrawn once, the leaf's first (exact lists above).
                self.assertEqual(side.nodes(), {})
                self.assertEqual(side.sizes()["kv_available"], 128)
                results[side.name] = (first, second)
                side.cache.sanity_check()
        # Same blocks, hashes and links on both.
        self.assertEqual(results["ours"], results["sglang"])

    def test_mamba_radix_cache_kv_events_split_hash(self):
        """An insert that splits a stored node publishes only its new blocks, linked to the
        block where the split happened (the split itself publishes nothing: same pages,
        same hashes)."""
        from sglang.srt.disaggregation.kv_events import BlockStored

        results = {}
        for side in both(kv_events=True):
            with self.subTest(side=side.name), side.active():
                side.events()  # the AllBlocksCleared of construction
                side.insert([1, 2, 3, 4], side.new_req())
                (first,) = side.events()
                self.assertIsInstance(first, BlockStored)
                self.assertEqual((first.token_ids, first.parent_block_hash, len(first.block_hashes)), ([1, 2, 3, 4], None, 4))
                side.insert([1, 2, 5, 6], side.new_req())
                (second,) = side.events()
                self.assertIsInstance(second, BlockStored)
                self.assertEqual(
                    (second.token_ids, second.parent_block_hash, len(second.block_hashes)),
                    ([5, 6], first.block_hashes[1], 2),
                )
                self.assertEqual(side.nodes(), {(1, 2): False, (1, 2, 3, 4): True, (1, 2, 5, 6): True})
                results[side.name] = (first, second)
                side.cache.sanity_check()
        self.assertEqual(results["ours"], results["sglang"])


class TestUnifiedRadixCacheMambaScenarios(unittest.TestCase):
    """Mamba scenarios of ``test_unified_radix_cache_unittest.py`` (kit fixtures of the
    same names)."""

    def test_mamba_checkpoint_grid_branching_seqlen(self):
        """With ping-pong tracking, a match whose KV runs past its deepest state reports
        ``mamba_branching_seqlen`` rounded down to the checkpoint grid (here the tiny
        model's ``mamba_chunk_size`` 8 at page size 1; SGLang's kit side is given the same
        chunk size), and none when the rounded length does not pass the usable prefix."""
        cases = {100: 96, 13: 8, 7: None}
        for side in both(enable_mamba_extra_buffer=True, fixture_kwargs={"mamba_cache_chunk_size": 8}, ours_argv=()):
            with self.subTest(side=side.name), side.active():
                side.insert([1], side.new_req())
                for hit, want in cases.items():
                    # A state at the end of hit + 1 tokens; the query diverges after hit tokens.
                    tokens = [1] + list(range(1000 * hit, 1000 * hit + hit - 1))
                    side.insert(tokens + [7777], side.new_req())
                    m = side.match(tokens + [8888])
                    self.assertEqual((m.device_prefix_len, m.full_kv_hit_length), (1, hit))
                    self.assertEqual(m.mamba_branching_seqlen, want, f"KV hit {hit}")

    def test_evict_for_alloc_internal_mamba_chain(self):
        """The kit's real-components chain (``UnifiedRadixAllocationEvictionRealComponentsFixtures``:
        states at 2, 4 and 6 tokens on one path), drained one SSM state at a time through
        ``evict_for_alloc``: the inner states go first, least recent first, KV kept. The
        last state is a leaf's: SGLang removes that leaf and keeps its stateless ancestors'
        KV in the tree; ours removes the stateless ancestors with it (a leaf always holds
        a state; docs/design.md, "SGLang conformance" and "Eviction"). With KV events on,
        SGLang withdraws the leaf's blocks only and keeps announcing the ancestors'; ours
        withdraws all of them."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        chain = [(1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6)]
        for side in both(kv_events=True):
            with self.subTest(side=side.name), side.active():
                side.events()  # the AllBlocksCleared of construction
                for p in chain:
                    side.insert(list(p), side.new_req())
                self.assertEqual(side.mamba_lru(), chain[::-1])
                (stored,) = side.events()  # one chain of 6 blocks (consecutive stores merged)
                self.assertEqual((stored.token_ids, stored.parent_block_hash), (list(chain[2]), None))
                hashes = stored.block_hashes

                def drain():
                    r = side.cache.evict_for_alloc(EvictParams(mamba_num=1))
                    return r.num_tokens_evicted, r.mamba_num_evicted

                # Inner states: KV kept and still covered by the leaf's state, no event.
                self.assertEqual(drain(), (0, 1))
                self.assertEqual(side.nodes(), {chain[0]: False, chain[1]: True, chain[2]: True})
                self.assertEqual(drain(), (0, 1))
                self.assertEqual(side.nodes(), {chain[0]: False, chain[1]: False, chain[2]: True})
                self.assertEqual(side.events(), [])
                if side.name == "sglang":
                    self.assertEqual(drain(), (2, 1))
                    self.assertEqual(side.nodes(), {chain[0]: False, chain[1]: False})
                    self.assertEqual(side.sizes()["full_evictable"], 4)
                    # The stateless [1..4] stays announced (KV events: no state can resume it).
                    self.assertEqual(side.events(), removed(hashes[4:]))
                else:
                    self.assertEqual(drain(), (6, 1))
                    self.assertEqual(side.nodes(), {})
                    self.assertEqual(side.sizes()["full_evictable"], 0)
                    self.assertEqual(side.events(), removed(hashes[4:] + hashes[2:4] + hashes[:2]))
                self.assertEqual(side.sizes()["mamba_available"], 20)
                side.cache.sanity_check()

    def test_mamba_finished_overshoot_checkpoint(self):
        """A finished request of 12 committed tokens whose newest checkpoint is at 12 but
        whose kept length (``up_to``, a stop before the last committed token) is 10: the
        older checkpoint (8), still in the other ping-pong entry, goes into the tree;
        without an older checkpoint nothing does. The KV past the kept length is freed.
        SGLang's scenario runs without overlap scheduling; under overlap (the plugin's
        default) ours never reads the older entry, which the step in flight may be
        rewriting (docs/design.md, "Overlap scheduling"), so nothing goes in either way."""
        no_overlap = ("--disable-overlap-schedule",)
        for prev, want_nodes, want_kv_free in ((8, {tuple(range(1, 9)): True}, 128 - 8), (None, {}, 128)):
            for side in both(enable_mamba_extra_buffer=True, ours_argv=no_overlap):
                with self.subTest(side=side.name, prev_track_seqlen=prev), side.active():
                    self._finish(side, prev, up_to=10)
                    self.assertEqual(side.nodes(), want_nodes)
                    # The request's 12 KV slots: 2 (10..12) are the scheduler's to free as
                    # over-allocated, the rest the tree kept or the release freed.
                    self.assertEqual(side.allocator.available_size(), want_kv_free - 2)
                    side.cache.sanity_check()
        side = OursSide(kv_size=128, extra_argv=())
        self.assertEqual(side.cache.core.finish_state, "overlap")
        with self.subTest(side="ours-overlap", prev_track_seqlen=8), side.active():
            self._finish(side, 8, up_to=10)
            self.assertEqual(side.nodes(), {})
            self.assertEqual(side.allocator.available_size(), 128 - 2)
            side.cache.sanity_check()

    def _finish(self, side, prev, up_to):
        from sglang.test.mem_cache_utils import finish_req

        tokens = list(range(1, 13))
        req = side.new_req(tokens)
        req.output_ids = array("q")
        req.extra_key = None
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(tokens)
        req.kv.cache_protected_len = 0
        req.kv.mamba_last_track_seqlen = len(tokens)
        req.kv.mamba_prev_track_seqlen = prev
        req.kv.mamba_last_track_idx = 0
        req.kv.mamba_next_track_idx = side.pool.get_mamba_ping_pong_other_idx(0)
        side.pool.write((req.kv.req_pool_idx, slice(0, len(tokens))), side.allocator.alloc(len(tokens)))
        req.lock = None
        req.last_node = side.root()
        finish_req(side.cache, req, up_to)  # SGLang's test helper: checkpoint, free, unlock


class TestSchedulerProtocol(unittest.TestCase):
    """Not an upstream scenario: the lock protocol the scheduler uses
    (``BasePrefixCache.lock`` / ``unlock``), on both caches."""

    def test_lock_protects_the_path_from_eviction(self):
        for side in both():
            with self.subTest(side=side.name), side.active():
                for t in (TOKENS_A, TOKENS_B, TOKENS_D, TOKENS_C):
                    side.insert(t, side.new_req())
                lock = side.cache.lock(side.match(TOKENS_B).last_device_node)
                self.assertEqual(
                    side.sizes(),
                    {"kv_available": 116, "mamba_available": 16, "full_evictable": 5, "full_protected": 7,
                     "mamba_evictable": 3, "mamba_protected": 1},
                )
                # Everything unlocked goes; the locked path keeps its KV and its state.
                self.assertEqual(side.evict(num_tokens=100, mamba_num=10), (5, 3))
                self.assertEqual(side.nodes(), {(1, 2, 3): False, (1, 2, 3, 4, 5): False, tuple(TOKENS_B): True})
                side.cache.unlock(lock)
                self.assertEqual((side.sizes()["full_evictable"], side.sizes()["mamba_evictable"]), (7, 1))
                self.assertEqual(side.evict(num_tokens=100, mamba_num=10), (7, 1))
                self.assertEqual(side.nodes(), {})
                self.assertEqual(side.sizes()["kv_available"], 128)
                side.cache.sanity_check()


class TestDiagnostics(unittest.TestCase):
    """Issue 11 item 5: the pool summary SGLang prints when an allocation fails
    (``common.available_and_evictable_str``) reads as SGLang's own hybrid mamba cache's
    for the same numbers."""

    def test_available_and_evictable_str_matches_sglang(self):
        got = {}
        for side in both():
            with side.active():
                side.insert(TOKENS_B, side.new_req())
                side.insert(TOKENS_C, side.new_req())
                from sglang.srt.mem_cache.common import available_and_evictable_str

                got[side.name] = available_and_evictable_str(side.cache)
                self.assertEqual(side.sizes()["kv_available"], 118)
        self.assertEqual(
            got["ours"],
            "Available full tokens: 128 (full_available_size=118 + full_evictable_size_=10)\n"
            "Available mamba: 20 (available_size=18 + component_evictable_size_=2)\n",
        )
        self.assertEqual(got["ours"], got["sglang"])

    def test_idle_mamba_leak_message_names_the_leaked_slot(self):
        """SGLang's idle check (``SchedulerInvariantChecker._check_mamba_pool``) writes its leak
        message from the cache's sizes and slot lists; over our cache it reads as over
        SGLang's and names exactly the slot that leaked."""
        from types import SimpleNamespace

        from sglang.srt.managers.scheduler_components.invariant_checker import SchedulerInvariantChecker as InvariantChecker

        msgs = {}
        for side in both():
            with side.active():
                side.insert(TOKENS_B, side.new_req())  # the tree takes the request's slot
                leaked = int(side.pool.mamba_allocator.alloc(1)[0])  # never freed
                checker = SimpleNamespace(
                    _check_pool_invariant=InvariantChecker._check_pool_invariant,
                    tree_cache=side.cache,
                    req_to_token_pool=side.pool,
                    token_to_kv_pool_allocator=side.allocator,
                    pool_stats_observer=SimpleNamespace(session_held_mamba_slots=lambda: 0),
                )
                stats = SimpleNamespace(
                    mamba_available_size=side.pool.mamba_allocator.available_size(),
                    mamba_evictable_size=side.cache.mamba_evictable_size(),
                )
                leak, msg = InvariantChecker._check_mamba_pool(checker, stats)
                self.assertTrue(leak)
                msgs[side.name] = msg.replace(f"{{{leaked}}}", "{LEAKED}")
        self.assertEqual(
            msgs["ours"],
            "[mamba] total=20, available=18, evictable=1, protected=0, session_held=0, uncached=0, "
            "leaked_full_pages=None, leaked_mamba_pages={LEAKED}",
        )
        self.assertEqual(msgs["ours"], msgs["sglang"])


if __name__ == "__main__":
    unittest.main()
