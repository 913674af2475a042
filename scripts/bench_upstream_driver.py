"""Benchmark driver for SGLang 0.5.23's own hybrid prefix cache.

``UnifiedRadixCache`` with the FULL and MAMBA components, built on CPU with SGLang's
unit-test kit (``sglang.test.kits.unified_radix_cache.fixtures.build_fixture``, its
``get_device`` patched to return "cpu"), and driven through the same scheduler-side
functions SGLang's scheduler calls for a hybrid model with the ``no_buffer`` mamba
strategy (page_size 1):

* match  -> ``mem_cache.common.match_kv_cache(req, cache, ids, cow_mamba=True,
  max_prefix_len=len-1)`` as in ``Req.init_next_round_input``; the COW slot is
  allocated inside ``MambaComponent.finalize_match_result_in_cache``.
* lock   -> ``cache.lock(req.last_node)`` (a ``TreeLock`` receipt), as
  ``PrefillAdder._commit_prefill_admission`` does.
* alloc_mamba -> ``mem_cache.allocation.alloc_req_slots`` (``ensure_mamba_capacity``
  evicts ``EvictParams(mamba_num=shortfall)``, then ``HybridReqToTokenPool.alloc``
  takes the row and, without a COW slot, a fresh mamba slot).
* alloc_kv -> ``mem_cache.allocation.alloc_token_slots`` (evicts
  ``EvictParams(num_tokens=shortfall)`` through ``evict_for_alloc``), then the
  request's ``req_to_token`` row is written like ``alloc_for_extend`` /
  ``alloc_for_decode_default`` do (prefix from ``cache.prefix_device_indices``).
* finish -> ``mem_cache.common.release_kv_cache(req, cache, checkpoint=True)``:
  ``checkpoint`` inserts ``tokens + output`` with ``mamba_value = req.kv.mamba_pool_idx``
  and moves the lock, then the row is freed and the lock released. SGLang has no
  separate unlock after finish, so ``unlock`` is empty here; its cost is in ``finish``.

``--cow-copy`` additionally runs the copy-on-write of the SSM state (and the zeroing
of a fresh slot) that SGLang defers to the start of the forward pass
(``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear``), timed in alloc_mamba.
"""

from __future__ import annotations

import logging
import warnings
from array import array
from typing import Any
from unittest import mock

import torch

from bench_common import CacheDriver, TraceRecord

# Tiny per-slot shapes: the benchmark measures bookkeeping, not memory traffic.
_NUM_LAYERS = 4
_FULL_ATTENTION_LAYER_IDS = (3,)  # one attention layer, three mamba layers
_HEAD_NUM = 1
_HEAD_DIM = 8


class _Handle:
    __slots__ = ("req", "seq_len", "n_prompt", "output")

    def __init__(self, req, n_prompt: int, output: list[int]):
        self.req = req
        self.seq_len = 0  # KV positions written into the request's row so far
        self.n_prompt = n_prompt
        self.output = output


class UpstreamDriver(CacheDriver):
    """SGLang 0.5.23 ``UnifiedRadixCache`` (FULL + MAMBA), page_size 1, no_buffer.

    Args:
        kv_size: KV pool slots (tokens), slot 0 reserved on top.
        mamba_size: SSM slots, slot 0 reserved on top.
        max_context_len: row width of ``req_to_token``; must exceed the longest
            ``tokens + output`` of the trace (3,766 for the shared trace).
        cow_copy: also perform the deferred SSM copy / clear SGLang runs at forward.
    """

    name = "upstream"

    def __init__(
        self,
        kv_size: int,
        mamba_size: int,
        *,
        max_context_len: int = 4096,
        cow_copy: bool = False,
    ):
        # Heavy imports only when the driver is built.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import sglang.test.kits.unified_radix_cache.fixtures as fixtures
            from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
            from sglang.srt.mem_cache import allocation, common
            from sglang.srt.mem_cache.unified_cache.components.base import (
                ComponentType,
            )
            from sglang.srt.sampling.sampling_params import SamplingParams
            from sglang.test.kits.unified_radix_cache.config import CacheConfig
        logging.getLogger("sglang").setLevel(logging.WARNING)

        self._Req = Req
        self._SamplingParams = SamplingParams
        self._FINISH_LENGTH = FINISH_LENGTH
        self._match_kv_cache = common.match_kv_cache
        self._release_kv_cache = common.release_kv_cache
        self._alloc_req_slots = allocation.alloc_req_slots
        self._alloc_token_slots = allocation.alloc_token_slots
        self.kv_size = kv_size
        self.mamba_size = mamba_size
        self.cow_copy = cow_copy

        cfg = CacheConfig(
            page_size=1,
            components=(ComponentType.FULL, ComponentType.MAMBA),
            num_layers=_NUM_LAYERS,
            full_attention_layer_ids=_FULL_ATTENTION_LAYER_IDS,
            head_num=_HEAD_NUM,
            head_dim=_HEAD_DIM,
            kv_size=kv_size,
            mamba_cache_size=mamba_size,
            # One request at a time; a few spare rows.
            max_num_reqs=4,
            max_context_len=max_context_len,
        )
        with mock.patch.object(fixtures, "get_device", lambda *a, **k: "cpu"):
            self.cache, self.allocator, self.req_to_token_pool = fixtures.build_fixture(
                cfg
            )
        self.max_context_len = max_context_len

    def describe(self) -> str:
        return (
            f"upstream: SGLang {type(self.cache).__name__} "
            f"components={[c.name for c in self.cache.tree_components]} "
            f"kv_size={self.allocator.size} mamba_size={self.req_to_token_pool.mamba_pool.size} "
            f"page_size={self.cache.page_size} cow_copy={self.cow_copy}"
        )

    # ---- per-request cycle -------------------------------------------------

    def begin(self, rec: TraceRecord) -> _Handle:
        n_total = len(rec.tokens) + len(rec.output)
        if n_total > self.max_context_len:
            raise ValueError(
                f"rid {rec.rid}: {n_total} tokens exceed max_context_len "
                f"{self.max_context_len}; raise UpstreamDriver(max_context_len=...)"
            )
        req = self._Req(
            rid=str(rec.rid),
            origin_input_text="",
            origin_input_ids=array("q", rec.tokens),
            sampling_params=self._SamplingParams(
                temperature=0, max_new_tokens=max(1, len(rec.output))
            ),
        )
        # What init_next_round_input does before its match.
        req.refresh_fill_ids()
        return _Handle(req, len(rec.tokens), list(rec.output))

    def match(self, h: _Handle) -> int:
        req = h.req
        self._match_kv_cache(
            req,
            self.cache,
            req.full_untruncated_fill_ids,
            cow_mamba=True,
            max_prefix_len=h.n_prompt - 1,
        )
        # init_next_round_input: the match did not report a protected length.
        req.kv.cache_protected_len = req.prefix_len
        return req.prefix_len

    def lock(self, h: _Handle) -> None:
        h.req.lock = self.cache.lock(h.req.last_node)

    def alloc_mamba(self, h: _Handle) -> None:
        req = h.req
        self._alloc_req_slots(self.req_to_token_pool, [req], self.cache)
        if self.cow_copy:
            pool = self.req_to_token_pool
            if req.kv.mamba_cow_src_index is not None:
                pool.copy_mamba_state(
                    req.kv.mamba_cow_src_index, req.kv.mamba_pool_idx.unsqueeze(0)
                )
            elif req.kv.mamba_needs_clear:
                pool.mamba_pool.clear_slots(req.kv.mamba_pool_idx.unsqueeze(0))
        req.kv.mamba_cow_src_index = None
        req.kv.mamba_needs_clear = False

    def alloc_kv(self, h: _Handle, num_tokens: int) -> None:
        req = h.req
        row = req.kv.req_pool_idx
        if h.seq_len == 0 and req.prefix_len > 0:
            # alloc_for_extend: the matched prefix comes off the locked tree path.
            prefix = self.cache.prefix_device_indices(req)
            self.req_to_token_pool.write((row, slice(0, req.prefix_len)), prefix)
            h.seq_len = req.prefix_len
        if num_tokens > 0:
            loc = self._alloc_token_slots(self.cache, num_tokens)
            self.req_to_token_pool.write(
                (row, slice(h.seq_len, h.seq_len + num_tokens)), loc.to(torch.int32)
            )
        h.seq_len += num_tokens
        req.kv.kv_allocated_len = h.seq_len
        req.kv.kv_committed_len = h.seq_len

    def finish(self, h: _Handle) -> None:
        req = h.req
        req.output_ids = h.output
        req.finished_reason = self._FINISH_LENGTH(length=len(h.output))
        self._release_kv_cache(req, self.cache, checkpoint=True)

    def unlock(self, h: _Handle) -> None:
        # release_kv_cache (in finish) already dropped the tree lock.
        assert h.req.lock is None

    def end(self, h: _Handle) -> None:
        h.req = None

    # ---- end of run ---------------------------------------------------------

    def leak_check(self) -> tuple[bool, str]:
        cache = self.cache
        kv_free = self.allocator.available_size()
        kv_evictable = cache.full_evictable_size()
        kv_protected = cache.full_protected_size()
        kv_size = self.allocator.size
        m_free = self.req_to_token_pool.mamba_allocator.available_size()
        m_evictable = cache.mamba_evictable_size()
        m_protected = cache.mamba_protected_size()
        m_size = self.req_to_token_pool.mamba_pool.size
        rows_free = self.req_to_token_pool.available_size()
        rows = self.req_to_token_pool.size
        kv_ok = kv_free + kv_evictable + kv_protected == kv_size
        m_ok = m_free + m_evictable + m_protected == m_size
        rows_ok = rows_free == rows
        details = (
            f"kv: free={kv_free} evictable={kv_evictable} protected={kv_protected} "
            f"size={kv_size}; mamba: free={m_free} evictable={m_evictable} "
            f"protected={m_protected} size={m_size}; req rows free={rows_free}/{rows}"
        )
        return kv_ok and m_ok and rows_ok, details


def make_upstream_driver(args: Any) -> UpstreamDriver:
    return UpstreamDriver(args.kv_size, args.mamba_size, cow_copy=args.cow_copy)
