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

Options used by the hit-rate benchmark (``scripts/bench_hit_rate.py``) only; the
tree-ops benchmark calls none of the hooks they act in, so its op list is unchanged:

* ``prompt_checkpoint=True`` (no_buffer): ``after_prefill`` does what SGLang's result
  processor does once a prompt's forward ran and the request did not finish
  (``managers/scheduler_components/batch_result_processor.py:356-392``): append the
  first sampled token, then ``mem_cache.common.checkpoint_kv_cache(req, cache)``
  (``common.py:271``) -> ``UnifiedRadixCache.checkpoint(req, up_to=req.extend_end)``.
  With no_buffer that allocates a fresh SSM slot (evicting if short), copies the live
  state into it (``MambaPool.copy_from``) and inserts the prompt with that copy
  (``unified_cache/components/mamba.py:672-680``); a duplicate copy is freed
  (``mamba.py:722-725``).
* ``strategy="extra_buffer"``: see :class:`UpstreamExtraBufferDriver`.
* ``kv_match_len`` reports the match's ``MatchResult.full_kv_hit_length`` (KV found
  regardless of SSM state, capped like the match).
"""

from __future__ import annotations

import functools
import logging
import warnings
from array import array
from types import SimpleNamespace
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
    __slots__ = ("req", "seq_len", "n_prompt", "output", "kv_match_len")

    def __init__(self, req, n_prompt: int, output: list[int]):
        self.req = req
        self.seq_len = 0  # KV positions written into the request's row so far
        self.n_prompt = n_prompt
        self.output = output
        self.kv_match_len = 0  # MatchResult.full_kv_hit_length of the match


class UpstreamDriver(CacheDriver):
    """SGLang 0.5.23 ``UnifiedRadixCache`` (FULL + MAMBA), page_size 1, no_buffer.

    Args:
        kv_size: KV pool slots (tokens), slot 0 reserved on top.
        mamba_size: SSM slots, slot 0 reserved on top.
        max_context_len: row width of ``req_to_token``; must exceed the longest
            ``tokens + output`` of the trace (3,766 for the shared trace).
        cow_copy: also perform the deferred SSM copy / clear SGLang runs at forward.
        prompt_checkpoint: ``after_prefill`` runs SGLang's post-prefill
            ``checkpoint_kv_cache`` (see the module docstring). Off by default: the
            README's op list does not have it.
    """

    name = "upstream"
    strategy = "no_buffer"

    def __init__(
        self,
        kv_size: int,
        mamba_size: int,
        *,
        max_context_len: int = 4096,
        cow_copy: bool = False,
        prompt_checkpoint: bool = False,
    ):
        self._build(kv_size, mamba_size, max_context_len, cow_copy, extra_buffer=False)
        self.prompt_checkpoint = prompt_checkpoint

    def _build(
        self,
        kv_size: int,
        mamba_size: int,
        max_context_len: int,
        cow_copy: bool,
        *,
        extra_buffer: bool,
        enable_overlap_schedule: bool = True,
    ) -> None:
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
        self._checkpoint_kv_cache = common.checkpoint_kv_cache
        self._alloc_req_slots = allocation.alloc_req_slots
        self._alloc_token_slots = allocation.alloc_token_slots
        self.kv_size = kv_size
        self.mamba_size = mamba_size
        self.cow_copy = cow_copy
        self.state_copies = 0

        cfg = CacheConfig(
            page_size=1,
            components=(ComponentType.FULL, ComponentType.MAMBA),
            num_layers=_NUM_LAYERS,
            full_attention_layer_ids=_FULL_ATTENTION_LAYER_IDS,
            head_num=_HEAD_NUM,
            head_dim=_HEAD_DIM,
            kv_size=kv_size,
            mamba_cache_size=mamba_size,
            enable_mamba_extra_buffer=extra_buffer,
            # One request at a time; a few spare rows.
            max_num_reqs=4,
            max_context_len=max_context_len,
        )
        # The kit builds HybridReqToTokenPool with SGLang's default
        # enable_overlap_schedule=True (2 ping-pong slots under extra_buffer).
        pool_cls = functools.partial(
            fixtures.HybridReqToTokenPool,
            enable_overlap_schedule=enable_overlap_schedule,
        )
        with mock.patch.object(
            fixtures, "get_device", lambda *a, **k: "cpu"
        ), mock.patch.object(fixtures, "HybridReqToTokenPool", pool_cls):
            self.cache, self.allocator, self.req_to_token_pool = fixtures.build_fixture(
                cfg
            )
        assert self.cache.enable_mamba_extra_buffer == extra_buffer
        self.max_context_len = max_context_len

        # Count the SSM state copies SGLang's cache makes (no_buffer checkpoint of an
        # unfinished request: mamba.py:672-680). COW copies go through
        # copy_mamba_state, not this.
        mamba_pool = self.req_to_token_pool.mamba_pool
        copy_from = mamba_pool.copy_from

        def counting_copy_from(src, dst):
            self.state_copies += int(dst.numel())
            return copy_from(src, dst)

        mamba_pool.copy_from = counting_copy_from

        # Record the full-KV length of each match (the KV ceiling), without changing it.
        match_prefix = self.cache.match_prefix
        self._last_match = None

        def recording_match_prefix(params):
            result = match_prefix(params)
            self._last_match = result
            return result

        self.cache.match_prefix = recording_match_prefix

    def describe(self) -> str:
        return (
            f"{self.name}: SGLang {type(self.cache).__name__} "
            f"components={[c.name for c in self.cache.tree_components]} "
            f"strategy={self.strategy} "
            f"kv_size={self.allocator.size} mamba_size={self.req_to_token_pool.mamba_pool.size} "
            f"page_size={self.cache.page_size} cow_copy={self.cow_copy}"
            + (f" prompt_checkpoint={self.prompt_checkpoint}")
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
        h.kv_match_len = self._last_match.full_kv_hit_length
        return req.prefix_len

    def kv_match_len(self, h: _Handle) -> int:
        return h.kv_match_len

    def lock(self, h: _Handle) -> None:
        req = h.req
        req.lock = self.cache.lock(req.last_node)
        # PrefillAdder._commit_prefill_admission (schedule_policy.py:1689): the whole
        # prompt in one chunk (see bench_hit_rate.py on --chunked-prefill-size).
        req.extend_end = h.n_prompt

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

    def after_prefill(self, h: _Handle) -> None:
        if not self.prompt_checkpoint:
            return
        self._prefill_result(h)

    def _prefill_result(self, h: _Handle) -> None:
        """batch_result_processor.py:356-394 for a request whose prompt just ran."""
        req = h.req
        if not h.output:
            return
        # The prefill forward samples the first output token (line 365).
        req.output_ids.append(h.output[0])
        if len(h.output) == 1:
            return  # finished at prefill: release_kv_cache in finish() (line 387)
        self._checkpoint_kv_cache(req, self.cache)

    def finish(self, h: _Handle) -> None:
        req = h.req
        req.output_ids = array("q", h.output)
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


class _ScheduleBatchView:
    """The fields of ``ScheduleBatch`` that the SGLang functions called by
    :class:`UpstreamExtraBufferDriver` read, for a batch of one request."""

    def __init__(self, cache, req_to_token_pool, spec_none):
        self.tree_cache = cache
        self.req_to_token_pool = req_to_token_pool
        # No ``mamba_chunk_size`` on the HF config: the state chunk is FLA's 64
        # (schedule_batch.py:3142-3144), as for the GDN models (Qwen3-Next/3.5).
        self.model_config = SimpleNamespace(hf_text_config=SimpleNamespace())
        self.spec_algorithm = spec_none
        self.reqs = []
        self.req_pool_indices = None
        # Decode track metadata (prepare_for_decode, schedule_batch.py:3802-3832).
        self.mamba_track_buffer_indices = None
        self.mamba_track_indices = None
        self.mamba_track_mask_cpu = None
        self.mamba_track_mask_next_cpu = None
        self.mamba_decode_batch_idx_cpu = None


class UpstreamExtraBufferDriver(UpstreamDriver):
    """SGLang 0.5.23 ``UnifiedRadixCache`` with ``enable_mamba_extra_buffer``, driven
    the way SGLang's scheduler drives it in the ``extra_buffer`` strategy.

    The pool is the test kit's ``HybridReqToTokenPool(enable_mamba_extra_buffer=True)``;
    with ``enable_overlap_schedule=True`` (SGLang's default, and the mode in which
    ``--mamba-radix-cache-strategy auto`` picks extra_buffer) each running request
    holds 2 ping-pong track slots besides its working slot
    (``mem_cache/allocation_sizing.py:11-19``); with False, 1.

    Per request (one at a time, prompt in one chunk):

    * match: ``Req.init_next_round_input(cache)`` (``schedule_batch.py:1692``) itself:
      ``match_kv_cache(cow_mamba=True, max_prefix_len=len-1)`` and
      ``req.mamba_branching_seqlen`` from ``MambaComponent.finalize_match_result_in_tree_core``
      (``unified_cache/components/mamba.py:164-192``: the full-KV hit floored to
      ``mamba_checkpoint_grid`` (64 at page 1), if deeper than the usable hit).
    * lock: ``cache.lock(last_node)``, ``req.extend_end = len(tokens)``
      (``schedule_policy.py:1689-1690``).
    * alloc_mamba: ``allocation.alloc_req_slots`` -- ``ensure_mamba_capacity`` evicts
      for 1 working slot + ``mamba_initial_tracking_slots``; ``HybridReqToTokenPool.alloc``
      takes them (``memory_pool.py:1572-1632``, ``_alloc_ping_pong_buffer`` 1753).
    * alloc_kv: as the no_buffer driver.
    * after_prefill: the prefill forward's track entry from SGLang's own
      ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend``
      (``schedule_batch.py:3137-3238``, called unbound on a :class:`_ScheduleBatchView`):
      it picks the tracked depth (``prefix_len + floor(extend_len/64)*64``, or
      ``mamba_branching_seqlen`` when that lies inside the extend on the 64 grid
      relative to ``prefix_len``), sets ``mamba_last_track_idx/seqlen`` and flips
      ``mamba_next_track_idx``. The forward would write the state there (one state
      copy, counted when ``track_mask``). Then the result processor's step
      (``batch_result_processor.py:356-394``): append the first sampled token and
      ``common.checkpoint_kv_cache`` -> ``checkpoint(up_to=extend_end)``, which with
      extra_buffer cuts the key to ``mamba_last_track_seqlen`` and donates that
      ping-pong slot, replacing it with a fresh one (``mamba.py:611-612, 665-671``,
      ``memory_pool.py:1803``; ``unified_radix_cache.py:1195-1227``); nothing is
      inserted when nothing was tracked (``mamba.py:648-649``).
    * after_decode: every decode step whose ``seq_len % mamba_track_grid(1)`` is 0
      (``lcm(64, --mamba-track-interval 256) = 256``, ``schedule_batch.py:3802-3820``)
      tracks the state into ``mamba_next_track_idx``: the driver fills the batch view
      with SGLang's ``set_mamba_track_indices_from_reqs`` (``schedule_batch.py:2322``)
      and the track mask, then calls SGLang's
      ``SchedulerBatchResultProcessor._handle_finish_state_updated_req``
      (``batch_result_processor.py:1377-1425``, unbound, on a small shim) which
      records ``mamba_last_track_idx/seqlen`` / ``mamba_prev_track_seqlen`` and flips
      the ping-pong (``_mamba_prefix_cache_update``, 1524-1577). Steps off the grid
      are skipped: for them that handler does nothing (its mask is False).
    * finish: ``release_kv_cache(checkpoint=True)``; the finished checkpoint donates
      the slot ``_select_finished_checkpoint`` picks (``mamba.py:582-602``) with the
      key cut to its seqlen, or inserts nothing when no decode boundary was tracked
      since the prompt checkpoint (that checkpoint reset ``mamba_last_track_seqlen``,
      ``mamba.py:726-727``); ``free_mamba_cache`` frees the rest (``mamba.py:708-717``,
      ``memory_pool.py:1826``).

    Re-implemented scheduler logic (no SGLang function to call in isolation):
    the decode step loop itself -- which steps are track boundaries
    (``seq_lens % interval == 0``, ``schedule_batch.py:3815-3816``) and the per-step
    ``kv_committed_len`` / ``output_ids`` / ``decode_batch_idx`` bookkeeping the handler
    reads (``allocation.py:683-686``, ``batch_result_processor.py:1044, 1384-1406``).
    Decode KV is allocated in one call (the README's op list), so the step loop only
    replays the counters. Results are processed with lookahead 0 (non-overlap order);
    under the overlap scheduler the same fields get the same final values one
    batch later. The forward itself (state writes, COW copy) does not run.

    Deviation shared with the README's op model: the request's ``tokens + output``
    are all processed (the last output token gets KV too), so decode steps have
    ``seq_len`` ``len(tokens)+1 .. len(tokens)+len(output)``; real SGLang never feeds
    the last sampled token (one step less).
    """

    name = "upstream-extra_buffer"
    strategy = "extra_buffer"

    def __init__(
        self,
        kv_size: int,
        mamba_size: int,
        *,
        max_context_len: int = 4096,
        cow_copy: bool = False,
        enable_overlap_schedule: bool = True,
    ):
        self._build(
            kv_size,
            mamba_size,
            max_context_len,
            cow_copy,
            extra_buffer=True,
            enable_overlap_schedule=enable_overlap_schedule,
        )
        # The real scheduler always checkpoints after prefill; extra_buffer's prompt
        # states reach the tree only that way.
        self.prompt_checkpoint = True
        self.enable_overlap_schedule = enable_overlap_schedule
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from sglang.srt.managers.schedule_batch import (
                ScheduleBatch,
                set_mamba_track_indices_from_reqs,
            )
            from sglang.srt.managers.scheduler_components.batch_result_processor import (
                SchedulerBatchResultProcessor,
            )
            from sglang.srt.runtime_context import get_exec, mamba_track_grid
            from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        if get_exec().mamba.enable_mamba_extra_buffer_lazy:
            raise RuntimeError(
                "the global SGLang server args say extra_buffer_lazy; this driver "
                "models the plain extra_buffer strategy"
            )
        self._prepare_for_extend_track = (
            ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend
        )
        self._set_track_indices = set_mamba_track_indices_from_reqs
        self.track_interval = mamba_track_grid(self.cache.page_size)
        self._batch = _ScheduleBatchView(
            self.cache, self.req_to_token_pool, SpeculativeAlgorithm.NONE
        )
        P = SchedulerBatchResultProcessor

        class _ResultProcessorShim:
            # SGLang's own methods; only the state they read is provided here.
            _handle_finish_state_updated_req = P._handle_finish_state_updated_req
            _mamba_prefix_cache_update = P._mamba_prefix_cache_update
            _mamba_check_track_boundary = P._mamba_check_track_boundary
            _mamba_assert_committed_len_lookahead = staticmethod(
                P._mamba_assert_committed_len_lookahead
            )
            _maybe_collect_customized_info = P._maybe_collect_customized_info
            draft_worker = None

            def __init__(self, tree_cache):
                self.tree_cache = tree_cache

        self._processor = _ResultProcessorShim(self.cache)
        #: prefill track entries whose mask was set / decode boundaries tracked
        self.prefill_tracks = 0
        self.decode_tracks = 0

    def describe(self) -> str:
        return (
            super().describe()
            + f" mamba_track_interval={self.track_interval}"
            + f" ping_pong_slots={self.req_to_token_pool.mamba_ping_pong_track_buffer_size}"
        )

    def match(self, h: _Handle) -> int:
        req = h.req
        req.init_next_round_input(self.cache)
        if req.prefix_len > h.n_prompt - 1:
            raise AssertionError("init_next_round_input ignored max_prefix_len")
        h.kv_match_len = self._last_match.full_kv_hit_length
        return req.prefix_len

    def after_prefill(self, h: _Handle) -> None:
        req = h.req
        entry = self._prepare_for_extend_track(self._batch, req)
        if entry.track_mask:
            self.prefill_tracks += 1
            self.state_copies += 1
        self._prefill_result(h)

    def after_decode(self, h: _Handle) -> None:
        req = h.req
        n_prompt, n_out = h.n_prompt, len(h.output)
        if not n_out:
            return
        interval = self.track_interval
        batch = self._batch
        batch.reqs = [req]
        batch.req_pool_indices = torch.tensor([req.kv.req_pool_idx], dtype=torch.int64)
        committed = req.kv.kv_committed_len
        first = (n_prompt // interval + 1) * interval
        for seq_len in range(first, n_prompt + n_out + 1, interval):
            step = seq_len - n_prompt  # decode step 1 feeds output[0]
            # prepare_for_decode: kv_committed_len += 1, decode_batch_idx += 1,
            # then the track indices and mask for this batch.
            req.kv.kv_committed_len = seq_len
            req.decode_batch_idx = step
            self._set_track_indices(batch)
            batch.mamba_track_mask_cpu = [True]  # seq_len % interval == 0
            batch.mamba_decode_batch_idx_cpu = [req.decode_batch_idx]
            # process_batch_result_decode: the sampled token joins output_ids first.
            req.output_ids = array("q", h.output[: min(step + 1, n_out)])
            self._processor._handle_finish_state_updated_req(req, batch, None, 0, None)
            self.decode_tracks += 1
            self.state_copies += 1
        req.kv.kv_committed_len = committed
        batch.reqs = []
        batch.req_pool_indices = None


def make_upstream_driver(args: Any) -> UpstreamDriver:
    return UpstreamDriver(args.kv_size, args.mamba_size, cow_copy=args.cow_copy)
