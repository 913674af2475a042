"""Benchmark driver for this project's ``MambaRadixCache`` (``sglang_mamba_ext.mem_cache``).

Driven the way the SGLang adapter drives it for SGLang's scheduler (page_size 1, no
ping-pong buffer: the counterpart of the upstream driver's ``no_buffer`` strategy):

* match  -> ``match_prefix(tokens[:-1], cow_mamba=True, req=req)``: the COW slot is
  allocated inside the match, the copy deferred;
* lock   -> ``inc_lock_ref(last_node)``;
* alloc_mamba -> ``HybridReqToTokenPool.alloc([req])`` (row + fresh SSM slot when no
  COW), evicting ``mamba_num=shortfall`` first when the pool is short;
* alloc_kv -> ``MambaRadixCache.alloc_kv(n)`` (evict-if-short) and the ``req_to_token``
  row write (prefix from the match);
* finish -> ``cache_finished_req(req)``: inserts ``tokens + output`` with the working
  slot, frees duplicates and whatever the tree did not take, releases the row and the
  lock (so ``unlock`` is empty, as in the upstream driver).

``--cow-copy`` also runs the deferred COW copy / fresh-slot clear (``execute_deferred_cow``)
that the forward would run, timed in alloc_mamba; without it the deferred work is dropped
exactly as the upstream driver drops it.
"""

from __future__ import annotations

from typing import Any


from bench_common import CacheDriver, TraceRecord
from sglang_mamba_ext.mem_cache import (
    CacheReq,
    HybridReqToTokenPool,
    KVSlotAllocator,
    MambaPool,
    MambaRadixCache,
    RadixKey,
)

# Tiny per-slot shapes (three linear layers): the benchmark measures bookkeeping.
_NUM_LINEAR_LAYERS = 3
_CONV_SHAPE = (8, 3)
_TEMPORAL_SHAPE = (1, 8, 8)


class _Handle:
    __slots__ = ("req", "match", "seq_len", "tokens", "output")

    def __init__(self, req: CacheReq, tokens: list, output: list):
        self.req = req
        self.match = None
        self.seq_len = 0
        self.tokens = tokens
        self.output = output


class OursDriver(CacheDriver):
    """This project's cache with equal pool sizes to the upstream driver."""

    name = "ours"

    def __init__(
        self,
        kv_size: int,
        mamba_size: int,
        *,
        max_context_len: int = 4096,
        cow_copy: bool = False,
        branch_checkpoints: bool = False,
        eviction_policy: str = "lru",
        name: str = "ours",
    ):
        self.name = name
        self.kv = KVSlotAllocator(kv_size)
        self.mamba_pool = MambaPool(mamba_size, _NUM_LINEAR_LAYERS, _CONV_SHAPE, _TEMPORAL_SHAPE)
        self.req_to_token_pool = HybridReqToTokenPool(4, max_context_len, self.mamba_pool, track_slots_per_req=0)
        self.cache = MambaRadixCache(
            self.kv,
            self.req_to_token_pool,
            page_size=1,
            branch_checkpoints=branch_checkpoints,
            eviction_policy=eviction_policy,
        )
        self.checkpoints_planned = 0
        self.max_context_len = max_context_len
        self.cow_copy = cow_copy

    def describe(self) -> str:
        c = self.cache
        return (
            f"{self.name}: sglang_mamba_ext MambaRadixCache kv_size={self.kv.size} "
            f"mamba_size={self.mamba_pool.size} page_size=1 cow_copy={self.cow_copy} "
            f"branch_checkpoints={c.branch_checkpoints} eviction_policy={c.eviction_policy}"
        )

    def begin(self, rec: TraceRecord) -> _Handle:
        tokens = list(rec.tokens)
        if len(tokens) + len(rec.output) > self.max_context_len:
            raise ValueError(f"rid {rec.rid}: longer than max_context_len {self.max_context_len}")
        return _Handle(CacheReq(rid=rec.rid, token_ids=tokens), tokens, list(rec.output))

    def match(self, h: _Handle) -> int:
        h.match = self.cache.match_prefix(RadixKey(h.tokens[:-1]), cow_mamba=True, req=h.req)
        return h.match.prefix_len

    def lock(self, h: _Handle) -> None:
        self.cache.inc_lock_ref(h.match.last_node)
        h.req.last_node = h.match.last_node

    def alloc_mamba(self, h: _Handle) -> None:
        req = h.req
        pool = self.req_to_token_pool
        if pool.alloc([req]) is None:
            need = 1 if req.mamba_pool_idx is None else 0
            self.cache.evict(mamba_num=need - self.mamba_pool.available_size())
            if pool.alloc([req]) is None:
                raise RuntimeError(f"rid {req.rid}: no SSM slot even after eviction")
        if self.cache.branch_checkpoints:
            # Branch-point / prompt-end checkpoints: slots taken now, states written by the
            # prefill (not simulated here), inserted at finish.
            self.checkpoints_planned += len(
                self.cache.plan_prefix_checkpoints(req, len(h.tokens), h.match.mamba_branching_seqlen)
            )
        if self.cow_copy:
            pool.execute_deferred_cow([req])
        req.mamba_cow_src_index = None  # the forward ran (or its copy is not measured)
        req.mamba_needs_clear = False

    def alloc_kv(self, h: _Handle, num_tokens: int) -> None:
        req = h.req
        row = self.req_to_token_pool.req_to_token[req.req_pool_idx]
        if h.seq_len == 0:
            p = h.match.prefix_len
            if p:
                row[:p] = h.match.device_indices
            req.prefix_indices = h.match.device_indices
            req.cache_protected_len = p
            h.seq_len = p
        if num_tokens > 0:
            loc = self.cache.alloc_kv(num_tokens)
            if loc is None:
                raise RuntimeError(f"rid {req.rid}: out of KV slots even after eviction")
            row[h.seq_len : h.seq_len + num_tokens] = loc
        h.seq_len += num_tokens
        req.kv_allocated_len = req.kv_committed_len = h.seq_len

    def finish(self, h: _Handle) -> None:
        req = h.req
        req.token_ids = h.tokens + h.output
        self.cache.cache_finished_req(req)

    def unlock(self, h: _Handle) -> None:
        # cache_finished_req (in finish) released the lock.
        assert h.req.last_node is None

    def end(self, h: _Handle) -> None:
        h.req = None
        h.match = None

    def leak_check(self) -> tuple[bool, str]:
        c = self.cache
        kv_free, kv_ev, kv_pr = self.kv.available_size(), c.full_evictable_size(), c.full_protected_size()
        m_free, m_ev, m_pr = self.mamba_pool.available_size(), c.mamba_evictable_size(), c.mamba_protected_size()
        rows_free = self.req_to_token_pool.available_size()
        ok = (
            kv_free + kv_ev + kv_pr == self.kv.size
            and m_free + m_ev + m_pr == self.mamba_pool.size
            and rows_free == self.req_to_token_pool.size
        )
        try:
            c.sanity_check()
            c.check_slot_accounting()
        except AssertionError as e:
            ok = False
            kv_free = f"{kv_free} ({e})"
        details = (
            f"kv: free={kv_free} evictable={kv_ev} protected={kv_pr} size={self.kv.size}; "
            f"mamba: free={m_free} evictable={m_ev} protected={m_pr} size={self.mamba_pool.size}; "
            f"req rows free={rows_free}/{self.req_to_token_pool.size}"
        )
        return ok, details


def make_ours_driver(args: Any) -> OursDriver:
    return OursDriver(args.kv_size, args.mamba_size, cow_copy=args.cow_copy)
