"""Randomized stateful test of the core cache (issue 2): random interleavings of match /
admit (alloc) / prefill chunk / decode / finish / abort / lock / unlock / evict on small
pools. After every step: ``sanity_check()``, the exact content oracle of ``cache_sim``
(every node's KV and SSM slots summarise its root path) and the exact slot accounting
(every slot in exactly one place); at every idle point ``free + evictable + protected ==
size`` for both pools. Each example ends by evicting everything unlocked (to the host tiers
where configured), then the idle checks.

The number of operations is set by ``SGLANG_MAMBA_EXT_RANDOM_OPS`` (default 100,000, what CI
runs); each configuration below gets an equal share.
"""

import os
import unittest

import torch

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import random

from cache_sim import ExactCheckpointPool, SimModel, make_cache
from storage_sim import MemoryStore, page_keys
from sglang_mamba_ext.mem_cache import CacheReq, RadixKey

TOTAL_OPS = int(os.environ.get("SGLANG_MAMBA_EXT_RANDOM_OPS", "100000"))
STEPS = 100

# Prompts share prefixes: a few "system prompts" and small vocabularies.
SYSTEMS = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9], [5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5, 5]]


class CacheMachine(RuleBasedStateMachine):
    page_size = 1
    track_slots = 2
    finish_state = "working"
    cache_kwargs: dict = {}
    ops = 0
    host_backups = 0
    host_kv_demoted = 0
    mamba_size = 10
    sessions = False  # the session pin / close rules (--enable-session-radix-cache)
    storage = False  # a storage tier (--hicache-storage-backend) over an in-memory store
    storage_loads = 0

    def __init__(self):
        super().__init__()
        self.cache = make_cache(
            kv_size=96,
            mamba_size=self.mamba_size,
            page_size=self.page_size,
            track_slots=self.track_slots,
            rows=4,
            max_context_len=128,
            mamba_track_interval=4 * self.page_size,
            finish_state=self.finish_state,
            **self.cache_kwargs,
        )
        self.sim = SimModel(self.cache)
        if self.storage:
            self.store = MemoryStore()
            self.cache.attach_storage(self.store, page_keys(self.page_size), b"sim", discard=self.store.discard)
        self.live = []  # requests holding a row (or a COW slot)
        self.prompt_len = {}
        self.locks = []  # nodes locked by the test itself
        self.rid = 0

    # ---------------------------------------------------------------- rules
    @rule(
        sys_idx=st.integers(0, len(SYSTEMS)),
        suffix=st.lists(st.integers(0, 3), min_size=0, max_size=10),
        cont=st.booleans(),
        ns=st.sampled_from([None, None, None, "salt"]),
    )
    def new_request(self, sys_idx, suffix, cont, ns):
        """Admit a request (match with COW, lock, alloc row + SSM slots, evicting if short)."""
        base = SYSTEMS[sys_idx] if sys_idx < len(SYSTEMS) else []
        if cont and self.cache.root_node.children:
            # Continue an existing cached path (a multi-turn follow-up).
            node = next(iter(self.cache.root_node.children.values()))
            base = list(node.key)
            while node.children:
                node = next(iter(node.children.values()))
                base += node.key
        tokens = base + suffix
        if len(tokens) < 2:
            tokens = tokens + [0, 1]
        tokens = tokens[:100]
        self.rid += 1
        req = CacheReq(rid=self.rid, token_ids=list(tokens), extra_key=ns)
        if self.sim.admit(req, prompt_len=len(tokens)):
            self.live.append(req)
            self.prompt_len[req.rid] = len(tokens)
        else:
            self._assert_released(req)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), chunk=st.integers(1, 9))
    def prefill_chunk(self, i, chunk):
        """Run one prefill chunk (``checkpoint`` unless it was the last)."""
        req = self.live[i % len(self.live)]
        total = self.prompt_len[req.rid]
        if req.kv_committed_len >= total:
            return self.decode_step(i)
        if self.page_size > 1:
            chunk = max(self.page_size, chunk - chunk % self.page_size)
        k = min(chunk, total - req.kv_committed_len)
        if not self.sim.extend_kv(req, req.kv_committed_len + k):
            self.sim.release(req, checkpoint=False)
            self._drop(req)
            return
        last = req.kv_committed_len + k == total
        self.sim.forward(req, k, chunk_end=not last)
        if not last:
            self.cache.checkpoint(req)
        else:
            req.token_ids.append(req.rid % 4)  # the prefill's output token

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def decode_step(self, i):
        """One decode token (after the prefill has finished)."""
        req = self.live[i % len(self.live)]
        if req.kv_committed_len < self.prompt_len[req.rid]:
            return
        if req.kv_committed_len >= 110:
            return
        if not self.sim.extend_kv(req, req.kv_committed_len + 1):
            self.sim.release(req, checkpoint=False)
            self._drop(req)
            return
        self.sim.forward(req, 1)
        req.token_ids.append((req.rid + req.kv_committed_len) % 4)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def finish(self, i):
        """Finish a request at any stage (caches what it computed)."""
        req = self.live[i % len(self.live)]
        self.sim.release(req)
        self._drop(req)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7), cut=st.integers(0, 3))
    def finish_sglang_style(self, i, cut):
        """Finish as SGLang 0.5.23 does it: ``checkpoint(finished=True)`` (its ``checkpoint``,
        possibly cut below the committed length), then the caller frees the row's KV above
        ``cache_protected_len``, unlocks and frees the row (``release_kv_cache``)."""
        req = self.live[i % len(self.live)]
        if req.req_pool_idx is None:
            return self.finish(i)
        up_to = max(req.kv_committed_len - cut, 0)
        self.cache.checkpoint(req, up_to=up_to, finished=True)
        p, a = req.cache_protected_len, req.kv_allocated_len
        if a > p:
            self.cache.token_to_kv_pool_allocator.free(
                self.cache.req_to_token_pool.req_to_token[req.req_pool_idx, p:a].to(torch.int64)
            )
        self.cache.dec_lock_ref(req.last_node)
        req.last_node = None
        self.cache.req_to_token_pool.free(req)
        self._drop(req)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 7))
    def abort(self, i):
        """Abort / retract a request at any stage (caches nothing)."""
        req = self.live[i % len(self.live)]
        self.sim.release(req, checkpoint=False)
        self._drop(req)

    @rule(
        sys_idx=st.integers(0, len(SYSTEMS) - 1),
        cut=st.integers(0, 14),
        cow=st.booleans(),
    )
    def match_only(self, sys_idx, cut, cow):
        """A bare match (splits nodes); with COW, the allocated slot is freed at once, as a
        scheduler does when it drops a candidate."""
        key = SYSTEMS[sys_idx][:cut]
        if cow:
            probe = CacheReq(rid="probe", token_ids=list(key))
            m = self.cache.match_prefix(RadixKey(key), cow_mamba=True, req=probe)
            self.sim.release(probe, checkpoint=False)
        else:
            m = self.cache.match_prefix(RadixKey(key))
        assert m.prefix_len <= m.kv_match_len <= len(key)
        assert m.last_node is self.cache.root_node or m.last_node.has_state

    def _first_child_path(self, depth):
        """The node ``depth`` first children below the root (or the deepest on the way)."""
        node = self.cache.root_node
        for _ in range(depth):
            if not node.children:
                break
            node = next(iter(node.children.values()))
        return node

    def _first_child_path_tokens(self):
        node, key = self.cache.root_node, []
        while node.children:
            node = next(iter(node.children.values()))
            key += node.key
        return key

    @rule(depth=st.integers(0, 4))
    def lock_node(self, depth):
        node = self._first_child_path(depth)
        while node.value is None:  # as a caller would: a match returns device KV only
            node = node.parent
        if node is not self.cache.root_node:
            self.cache.inc_lock_ref(node)
            self.locks.append(node)

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 7))
    def unlock_node(self, i):
        node = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @precondition(lambda self: self.sessions)
    @rule(depth=st.integers(1, 5), session=st.integers(0, 2))
    def pin_session(self, depth, session):
        """A session's turn ended at some node (``--enable-session-radix-cache``): pin the
        state it resumes from; evictions take it last."""
        node = self._first_child_path(depth)
        if node is not self.cache.root_node:
            pinned = self.cache.pin_session(f"s{session}", node)
            assert pinned is None or (pinned.has_state and not pinned.removed)

    @precondition(lambda self: self.sessions)
    @rule(session=st.integers(0, 2))
    def close_session(self, session):
        self.cache.release_session(f"s{session}")

    @rule(cut=st.integers(1, 40), extra=st.lists(st.integers(0, 3), max_size=6))
    def cow_match_and_drop(self, cut, extra):
        """A copy-on-write match of the first-child path cut anywhere (often inside a node,
        or inside host-only KV), then the request goes without running (SGLang's admission
        rejecting it): the matched KV is checked, everything it took is given back."""
        key = self._first_child_path_tokens() + extra
        probe = CacheReq(rid="probe", token_ids=key[:cut] + [0])
        m = self.cache.match_prefix(RadixKey(key[:cut]), cow_mamba=True, req=probe)
        assert m.prefix_len <= m.kv_match_len <= cut
        self.sim.check_kv(m.device_indices, key[: m.prefix_len], 0, "copy-on-write match")
        self.sim.release(probe, checkpoint=False)
        self._assert_released(probe)

    @precondition(lambda self: not self.live and not self.locks)
    @rule()
    def flush(self):
        """``/flush_cache``: the tree reset, then every pool cleared."""
        c = self.cache
        c.reset()
        c.token_to_kv_pool_allocator.clear()
        c.req_to_token_pool.clear()
        c.mamba_pool.clear_all()
        for tier in (c.mamba_host_pool, c.mamba_ckpt_pool):
            if tier is not None:
                tier.clear_all()
        if c.kv_host_pool is not None:
            c.kv_host_pool.clear()

    @precondition(lambda self: self.storage)
    @rule(seed=st.integers(0, 2**16))
    def damage_storage(self, seed):
        """A stored value loses a byte or gets one flipped: it must read as a miss."""
        self.store.damage(random.Random(seed))

    @precondition(lambda self: self.storage and not self.live and not self.locks)
    @rule()
    def spill_all(self):
        """Everything out of the device and host tiers: what leaves goes to storage."""
        from sglang_mamba_ext.mem_cache import EvictResult

        c = self.cache
        c.evict(num_tokens=10**6, mamba_num=10**6)
        c._evict_host(c.mamba_host_pool.size)
        res = EvictResult()
        c._evict_host_kv(c.kv_host_pool.size, res)
        c._count_evicted(res)

    # now and then (1 in 11) more than the tree holds: everything unlocked goes
    @rule(tokens=st.integers(0, 44).map(lambda t: 10**6 if t > 40 else t),
          mamba=st.integers(0, 4).map(lambda m: 10**6 if m == 4 else m))
    def evict(self, tokens, mamba):
        before = self.cache.total_size(), self.cache.mamba_total_size()
        res = self.cache.evict(num_tokens=tokens, mamba_num=mamba)
        after = self.cache.total_size(), self.cache.mamba_total_size()
        assert before[0] - after[0] == res.num_tokens_evicted
        assert before[1] - after[1] == res.mamba_num_evicted

    # ---------------------------------------------------------------- invariants
    @invariant()
    def check_all(self):
        CacheMachine.ops += 1
        cache = self.cache
        cache.sanity_check()
        self.sim.check_tree()
        cache.check_slot_accounting(self.live)
        if not self.live and not self.locks:
            kv = cache.token_to_kv_pool_allocator
            assert kv.available_size() + cache.full_evictable_size() + cache.full_protected_size() == kv.size
            assert cache.full_protected_size() == 0 and cache.mamba_protected_size() == 0
            pool = cache.state_pool
            assert pool.available_size() + cache.mamba_evictable_size() + cache.mamba_protected_size() == pool.size
            host = cache.mamba_host_pool
            if host is not None:
                assert host.available_size() + cache.host_states() == host.size
            if cache.kv_host_pool is not None:
                assert cache.kv_host_pool.available_size() + cache.host_kv_tokens() == cache.kv_host_pool.size
            if cache.mamba_ckpt_pool is not None:  # the tree holds no active slot
                assert cache.mamba_pool.available_size() == cache.mamba_pool.size

    def teardown(self):
        """Every request aborted and lock dropped, then everything evicted (with a host tier,
        the device KV and states go there where they fit), then the idle checks."""
        for req in list(self.live):
            self.sim.release(req, checkpoint=False)
        for node in self.locks:
            self.cache.dec_lock_ref(node)
        self.live, self.locks = [], []
        self.evict(10**6, 10**6)
        self.check_all()
        if self.storage:
            # one whole request over an undamaged store, everything to storage, then the
            # request's prompt again: read back, KV and state checked by the forward
            self.store.values.clear()
            self.rid += 1
            tokens = SYSTEMS[self.rid % len(SYSTEMS)] + [3, 1, 2]
            self.sim.run(list(tokens), [2, 0], rid=self.rid)
            self.spill_all()
            self.check_all()
            self.rid += 1
            req = CacheReq(rid=self.rid, token_ids=tokens + [2, 0, 1])
            loads = self.cache.storage_loads_total
            assert self.sim.admit(req, prompt_len=len(req.token_ids))
            assert self.cache.storage_loads_total == loads + 1 and req.cache_protected_len > 0
            self.sim.forward(req, 0)  # checks the read-back KV and working state
            self.sim.release(req, checkpoint=False)
            self.check_all()
        CacheMachine.host_backups += self.cache.host_backups_total
        CacheMachine.host_kv_demoted += self.cache.host_kv_demoted_total
        CacheMachine.storage_loads += self.cache.storage_loads_total

    # ---------------------------------------------------------------- helpers
    def _drop(self, req):
        self.live.remove(req)
        self._assert_released(req)

    def _assert_released(self, req):
        assert req.req_pool_idx is None and req.mamba_pool_idx is None and req.last_node is None
        assert not req.mamba_ping_pong_track_buffer and not req.mamba_prefix_checkpoints


CONFIGS = {
    "page1_track": dict(page_size=1, track_slots=2, finish_state="working"),
    "page1_nobuffer": dict(page_size=1, track_slots=0, finish_state="working"),
    "page1_checkpoint_finish": dict(page_size=1, track_slots=2, finish_state="checkpoint"),
    "page2_track": dict(page_size=2, track_slots=2, finish_state="working"),
    "page1_branch_recompute": dict(
        page_size=1, track_slots=2, finish_state="working", cache_kwargs=dict(
            branch_checkpoints=True, eviction_policy="recompute", max_states_per_path=3, kv_bytes_per_token=64)
    ),
    "page1_branch_adaptive": dict(
        page_size=1, track_slots=2, finish_state="working", sessions=True, cache_kwargs=dict(
            branch_checkpoints=True, eviction_policy="adaptive", max_states_per_path=3)
    ),
    "page2_branch_lru_nobuffer": dict(
        page_size=2, track_slots=0, finish_state="working", cache_kwargs=dict(branch_checkpoints=True)
    ),
    # the tree's states in a separate checkpoint pool (int8 checkpoints' lifecycle), smaller
    # than the active pool so that storing a state evicts one
    "page1_branch_ckpt": dict(
        page_size=1, track_slots=2, finish_state="working", cache_kwargs=dict(
            branch_checkpoints=True, ckpt_size=6, max_states_per_path=3)
    ),
    # a host tier of the states (--enable-hierarchical-cache), each write policy
    "page1_branch_host_through": dict(
        page_size=1, track_slots=2, finish_state="working", mamba_size=6, cache_kwargs=dict(
            branch_checkpoints=True, host_size=7, kv_host_size=40, hicache_write_policy="write_through")
    ),
    "page1_track_host_selective_adaptive": dict(
        page_size=1, track_slots=2, finish_state="working", sessions=True, mamba_size=6, cache_kwargs=dict(
            branch_checkpoints=True, host_size=6, kv_host_size=48, hicache_write_policy="write_through_selective",
            eviction_policy="adaptive", max_states_per_path=3)
    ),
    # a host tier smaller than one request's KV: demotions that cannot fit, host-only
    # subtrees dropped under device leaves (a fresh user's fuzzing found the bare-leaf case)
    "page4_track_tiny_host_back_adaptive": dict(
        page_size=4, track_slots=2, finish_state="working", sessions=True, mamba_size=6, cache_kwargs=dict(
            branch_checkpoints=True, host_size=2, kv_host_size=8, hicache_write_policy="write_back",
            eviction_policy="adaptive", max_states_per_path=1)
    ),
    "page2_nobuffer_host_back_recompute": dict(
        page_size=2, track_slots=0, finish_state="working", mamba_size=5, cache_kwargs=dict(
            branch_checkpoints=True, host_size=8, kv_host_size=40, hicache_write_policy="write_back",
            eviction_policy="recompute", kv_bytes_per_token=64)
    ),
    # int8 checkpoints' lifecycle with a host tier of the checkpoint slots (issue 42)
    "page1_branch_ckpt_host_back_adaptive": dict(
        page_size=1, track_slots=2, finish_state="working", mamba_size=8, cache_kwargs=dict(
            branch_checkpoints=True, ckpt_size=5, host_size=7, kv_host_size=40, hicache_write_policy="write_back",
            eviction_policy="adaptive", max_states_per_path=3)
    ),
    # a storage tier under the host tier (--hicache-storage-backend, issue 42), values
    # damaged now and then
    "page1_branch_host_storage_adaptive": dict(
        page_size=1, track_slots=2, finish_state="working", mamba_size=6, storage=True, cache_kwargs=dict(
            branch_checkpoints=True, host_size=3, kv_host_size=24, hicache_write_policy="write_through",
            eviction_policy="adaptive", max_states_per_path=3)
    ),
    "page2_ckpt_host_back_storage": dict(
        page_size=2, track_slots=2, finish_state="working", mamba_size=8, storage=True, cache_kwargs=dict(
            branch_checkpoints=True, ckpt_size=5, host_size=3, kv_host_size=16, hicache_write_policy="write_back")
    ),
    "page2_nobuffer_ckpt_recompute": dict(
        page_size=2, track_slots=0, finish_state="working", sessions=True, cache_kwargs=dict(
            branch_checkpoints=True, ckpt_size=5, eviction_policy="recompute", kv_bytes_per_token=64)
    ),
}


def _make_case(name, cfg):
    machine = type(f"Machine_{name}", (CacheMachine,), dict(cfg))
    examples = max(1, TOTAL_OPS // (len(CONFIGS) * STEPS))
    machine.TestCase.settings = settings(
        max_examples=examples,
        stateful_step_count=STEPS,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )

    class Case(machine.TestCase):
        def runTest(self):
            before = CacheMachine.ops
            stores = ExactCheckpointPool.total_stores
            backups = CacheMachine.host_backups
            demoted = CacheMachine.host_kv_demoted
            loads = CacheMachine.storage_loads
            super().runTest()
            # The machine really stepped (invariants run once per step).
            self.assertGreaterEqual(CacheMachine.ops - before, examples * STEPS // 2)
            kw = cfg.get("cache_kwargs", {})
            if examples < 50:
                return  # too few (mostly small) examples to be sure the paths below ran
            if kw.get("host_size"):
                # states really went to the host tier (a load back needs a later hit on a
                # state the device tier gave up: too rare here to assert, about one run in
                # ten has none; test_host_tier.py loads under each policy)
                self.assertGreater(CacheMachine.host_backups - backups, 0)
            if kw.get("kv_host_size") and kw.get("hicache_write_policy") != "write_through_selective":
                # KV went to the host (at the latest in the teardown's eviction of everything).
                # Not asserted under write_through_selective: there a leaf's KV moves only with
                # a state that was hit before (one without a host copy is dropped, and its leaf
                # with it), and about one run in three has none (test_host_tier.py's TestHostKV
                # covers that policy's demotions)
                self.assertGreater(CacheMachine.host_kv_demoted - demoted, 0)
            if cfg.get("storage"):
                # prefixes really came back from storage
                self.assertGreater(CacheMachine.storage_loads - loads, 0)
            if cfg.get("cache_kwargs", {}).get("ckpt_size"):
                # states really went through the checkpoint pool
                self.assertGreater(ExactCheckpointPool.total_stores - stores, 0)

    Case.__name__ = Case.__qualname__ = f"TestRandomized_{name}"
    return Case


for _name, _cfg in CONFIGS.items():
    globals()[f"TestRandomized_{_name}"] = _make_case(_name, _cfg)


if __name__ == "__main__":
    unittest.main()
