"""The request cycle of SGLang 0.5.23's scheduler, run on any ``BasePrefixCache``.

:class:`SchedulerDriver` is the :class:`~.common.CacheDriver` both sides of a benchmark
share: SGLang's ``UnifiedRadixCache`` (:mod:`.upstream`) and this project's
``MambaRadixCacheAdapter`` (:mod:`.ours`). A subclass only builds the cache, its
``HybridReqToTokenPool`` and its KV allocator and hands them to :meth:`SchedulerDriver.bind`;
every operation is then the SGLang scheduler function the scheduler calls for a hybrid
model at page size 1, one request at a time, so both caches pay the same protocol cost:

* match -> ``mem_cache.common.match_kv_cache(req, cache, ids, cow_mamba=True,
  max_prefix_len=len-1)`` as in ``Req.init_next_round_input``; a cache allocates the
  copy-on-write SSM slot inside its ``match_prefix``.
* lock -> ``cache.lock(req.last_node)`` (a ``TreeLock``), as
  ``PrefillAdder._commit_prefill_admission`` does; ``req.extend_end = len(tokens)``.
* alloc_mamba -> ``mem_cache.allocation.alloc_req_slots`` (``ensure_mamba_capacity``
  evicts ``EvictParams(mamba_num=shortfall)``, then the pool's ``alloc`` takes the row
  and, without a COW slot, a fresh SSM slot).
* alloc_kv -> ``mem_cache.allocation.alloc_token_slots`` (evicts the shortfall through
  ``evict_for_alloc``), then the ``req_to_token`` row write of ``alloc_for_extend`` /
  ``alloc_for_decode_default`` (prefix from ``cache.prefix_device_indices``).
* finish -> ``mem_cache.common.release_kv_cache(req, cache, checkpoint=True)``:
  ``cache.checkpoint(req, up_to=...)`` inserts ``tokens + output``, then the row is
  freed, the lock released and ``cache.on_release`` runs. SGLang has no separate unlock
  after finish, so ``unlock`` is empty; its cost is in ``finish``.

``cow_copy`` also runs the copy-on-write of the SSM state (or the zeroing of a fresh
slot) that SGLang defers to the forward (``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear``),
timed in alloc_mamba. ``prompt_checkpoint`` makes ``after_prefill`` (hit-rate benchmark
only) do what SGLang's result processor does once a prompt ran and the request did not
finish (``managers/scheduler_components/batch_result_processor.py``): append the first
sampled token, then ``common.checkpoint_kv_cache(req, cache)``.
"""

from __future__ import annotations

import logging
import warnings
from array import array
import torch

from sglang_mamba_ext.benchmarks.common import CacheDriver, TraceRecord


def apply_plugin() -> None:
    """Run this package's SGLang entry point and apply SGLang's hook registry in this
    process (what ``sglang.srt.plugins.load_plugins`` does for installed plugins).
    Idempotent."""
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_mamba_ext.plugin.registration import register

    register()
    HookRegistry.apply_hooks()


class Handle:
    """Per-request state of a :class:`SchedulerDriver` run."""

    __slots__ = ("req", "seq_len", "n_prompt", "output", "kv_match_len")

    def __init__(self, req, n_prompt: int, output: list[int]):
        self.req = req  # SGLang Req
        self.seq_len = 0  # KV positions written into the request's row so far (tokens)
        self.n_prompt = n_prompt
        self.output = output
        self.kv_match_len = 0  # MatchResult.full_kv_hit_length of the match (tokens)


class SchedulerDriver(CacheDriver):
    """SGLang's scheduler functions over one cache (module docstring).

    Subclasses build the objects (:meth:`build`), which the constructor hands to
    :meth:`bind`. ``state_copies`` counts SSM states written through ``MambaPool.copy_from``
    (a checkpoint snapshot; a COW copy goes through ``copy_mamba_state`` and is not
    counted).

    Args:
        kv_size: KV pool size (tokens).
        mamba_size: SSM pool size (slots).
        max_context_len: row width of ``req_to_token`` (tokens); must exceed the longest
            ``tokens + output`` of the trace (3,766 for the shared trace).
        cow_copy: also run the deferred SSM copy / clear SGLang runs at forward.
        prompt_checkpoint: ``after_prefill`` runs SGLang's post-prefill
            ``checkpoint_kv_cache``. Off by default: the README's op list does not have it.
    """

    name = "?"
    prompt_checkpoint = False

    def __init__(
        self,
        kv_size: int,
        mamba_size: int,
        *,
        max_context_len: int = 4096,
        cow_copy: bool = False,
        prompt_checkpoint: bool = False,
    ):
        cache, allocator, req_to_token_pool = self.build(kv_size, mamba_size, max_context_len)
        self.bind(cache, allocator, req_to_token_pool, max_context_len=max_context_len, cow_copy=cow_copy)
        self.prompt_checkpoint = prompt_checkpoint

    def build(self, kv_size: int, mamba_size: int, max_context_len: int) -> tuple:
        """``(cache, kv_allocator, req_to_token_pool)`` of the sizes given (constructor)."""
        raise NotImplementedError

    def bind(
        self,
        cache,
        allocator,
        req_to_token_pool,
        *,
        max_context_len: int,
        cow_copy: bool,
    ) -> None:
        """Attach the cache, its KV allocator (``available_size``, ``size``) and its
        ``HybridReqToTokenPool``; import the SGLang functions the cycle calls.

        This package's SGLang plugin is applied first (:func:`apply_plugin`), as SGLang's
        ``load_plugins`` applies every installed plugin in a server process, so both
        sides call the same (hooked) functions whichever driver is built first."""
        apply_plugin()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
            from sglang.srt.mem_cache import allocation, common
            from sglang.srt.sampling.sampling_params import SamplingParams
        logging.getLogger("sglang").setLevel(logging.WARNING)

        self._Req = Req
        self._SamplingParams = SamplingParams
        self._FINISH_LENGTH = FINISH_LENGTH
        self._match_kv_cache = common.match_kv_cache
        self._release_kv_cache = common.release_kv_cache
        self._checkpoint_kv_cache = common.checkpoint_kv_cache
        self._alloc_req_slots = allocation.alloc_req_slots
        self._alloc_token_slots = allocation.alloc_token_slots
        self.cache = cache
        self.allocator = allocator
        self.req_to_token_pool = req_to_token_pool
        self.max_context_len = max_context_len
        self.cow_copy = cow_copy
        self.state_copies = 0

        mamba_pool = req_to_token_pool.mamba_pool
        copy_from = mamba_pool.copy_from

        def counting_copy_from(src, dst):
            self.state_copies += int(dst.numel())
            return copy_from(src, dst)

        mamba_pool.copy_from = counting_copy_from

        # Record each match (its full-KV length is the KV ceiling), without changing it.
        match_prefix = cache.match_prefix
        self._last_match = None

        def recording_match_prefix(params):
            result = match_prefix(params)
            self._last_match = result
            return result

        cache.match_prefix = recording_match_prefix

    # ---- per-request cycle -------------------------------------------------

    def begin(self, rec: TraceRecord) -> Handle:
        n_total = len(rec.tokens) + len(rec.output)
        if n_total > self.max_context_len:
            raise ValueError(
                f"rid {rec.rid}: {n_total} tokens exceed max_context_len "
                f"{self.max_context_len}; build the driver with a larger max_context_len"
            )
        req = self._Req(
            rid=str(rec.rid),
            origin_input_text="",
            origin_input_ids=array("q", rec.tokens),
            sampling_params=self._SamplingParams(temperature=0, max_new_tokens=max(1, len(rec.output))),
        )
        # What init_next_round_input does before its match.
        req.refresh_fill_ids()
        return Handle(req, len(rec.tokens), list(rec.output))

    def match(self, h: Handle) -> int:
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
        h.kv_match_len = self._last_match.full_kv_hit_length
        return req.prefix_len

    def kv_match_len(self, h: Handle) -> int:
        return h.kv_match_len

    def lock(self, h: Handle) -> None:
        req = h.req
        req.lock = self.cache.lock(req.last_node)
        # PrefillAdder._commit_prefill_admission: the whole prompt in one chunk.
        req.extend_end = h.n_prompt

    def alloc_mamba(self, h: Handle) -> None:
        req = h.req
        self._alloc_req_slots(self.req_to_token_pool, [req], self.cache)
        if self.cow_copy:
            pool = self.req_to_token_pool
            ckpt = getattr(pool, "mamba_ckpt_pool", None)
            if req.kv.mamba_cow_src_index is not None and ckpt is not None:
                ckpt.load_to_active(pool.mamba_pool, req.kv.mamba_cow_src_index, req.kv.mamba_pool_idx.unsqueeze(0))
            elif req.kv.mamba_cow_src_index is not None:
                pool.copy_mamba_state(req.kv.mamba_cow_src_index, req.kv.mamba_pool_idx.unsqueeze(0))
            elif req.kv.mamba_needs_clear:
                pool.mamba_pool.clear_slots(req.kv.mamba_pool_idx.unsqueeze(0))
        req.kv.mamba_cow_src_index = None
        req.kv.mamba_needs_clear = False

    def alloc_kv(self, h: Handle, num_tokens: int) -> None:
        req = h.req
        row = req.kv.req_pool_idx
        if h.seq_len == 0 and req.prefix_len > 0:
            # alloc_for_extend: the matched prefix comes off the locked tree path.
            prefix = self.cache.prefix_device_indices(req)
            self.req_to_token_pool.write((row, slice(0, req.prefix_len)), prefix)
            h.seq_len = req.prefix_len
        if num_tokens > 0:
            loc = self._alloc_token_slots(self.cache, num_tokens)
            self.req_to_token_pool.write((row, slice(h.seq_len, h.seq_len + num_tokens)), loc.to(torch.int32))
        h.seq_len += num_tokens
        req.kv.kv_allocated_len = h.seq_len
        req.kv.kv_committed_len = h.seq_len

    def after_prefill(self, h: Handle) -> None:
        if self.prompt_checkpoint:
            self._prefill_result(h)

    def _prefill_result(self, h: Handle) -> None:
        """The result processor's step for a request whose prompt just ran."""
        req = h.req
        if not h.output:
            return
        # The prefill forward samples the first output token.
        req.output_ids.append(h.output[0])
        if len(h.output) == 1:
            return  # finished at prefill: release_kv_cache in finish()
        self._checkpoint_kv_cache(req, self.cache)

    def finish(self, h: Handle) -> None:
        req = h.req
        req.output_ids = array("q", h.output)
        req.finished_reason = self._FINISH_LENGTH(length=len(h.output))
        self._release_kv_cache(req, self.cache, checkpoint=True)

    def unlock(self, h: Handle) -> None:
        # release_kv_cache (in finish) already dropped the tree lock.
        assert h.req.lock is None

    def end(self, h: Handle) -> None:
        h.req = None

    # ---- end of run ---------------------------------------------------------

    def leak_check(self) -> tuple[bool, str]:
        """``free + evictable + protected == size`` for KV (tokens) and SSM (slots), every
        request row free; with int8 checkpoints (SGLang's ``mamba_ckpt_pool``) the tree's
        states are counted against the checkpoint pool and every active SSM slot is free.
        Returns ``(ok, details)``."""
        cache = self.cache
        kv_free = self.allocator.available_size()
        kv_evictable = cache.full_evictable_size()
        kv_protected = cache.full_protected_size()
        kv_size = self.allocator.size
        m_free = self.req_to_token_pool.mamba_allocator.available_size()
        m_evictable = cache.mamba_evictable_size()
        m_protected = cache.mamba_protected_size()
        m_size = self.req_to_token_pool.mamba_pool.size
        ckpt = getattr(self.req_to_token_pool, "mamba_ckpt_pool", None)
        if ckpt is not None:
            if m_free != m_size:
                return False, f"mamba: {m_size - m_free} active slots held at the end"
            m_free, m_size = ckpt.available_size(), ckpt.num_slots
        rows_free = self.req_to_token_pool.available_size()
        rows = self.req_to_token_pool.size
        ok = (
            kv_free + kv_evictable + kv_protected == kv_size
            and m_free + m_evictable + m_protected == m_size
            and rows_free == rows
        )
        details = (
            f"kv: free={kv_free} evictable={kv_evictable} protected={kv_protected} "
            f"size={kv_size}; mamba: free={m_free} evictable={m_evictable} "
            f"protected={m_protected} size={m_size}; req rows free={rows_free}/{rows}"
        )
        return ok, details
