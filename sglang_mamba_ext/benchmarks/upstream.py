"""Benchmark drivers for SGLang 0.5.23's own hybrid prefix cache.

``UnifiedRadixCache`` with the FULL and MAMBA components, built on CPU with SGLang's
unit-test kit (``sglang.test.kits.unified_radix_cache.fixtures.build_fixture``, its
``get_device`` patched to return "cpu"), driven by :class:`.scheduler.SchedulerDriver`:
the scheduler functions SGLang calls for a hybrid model (page_size 1). Inside them, with
the ``no_buffer`` strategy, the COW slot of a hit is allocated by
``MambaComponent.finalize_match_result_in_cache``, and ``checkpoint`` at finish inserts
``tokens + output`` with ``mamba_value = req.kv.mamba_pool_idx`` and moves the lock.

With ``prompt_checkpoint=True`` (hit-rate benchmark only), the post-prefill
``checkpoint_kv_cache`` -> ``UnifiedRadixCache.checkpoint(req, up_to=req.extend_end)``
allocates a fresh SSM slot (evicting if short), copies the live state into it
(``MambaPool.copy_from``) and inserts the prompt with that copy
(``unified_cache/components/mamba.py:672-680``); a duplicate copy is freed
(``mamba.py:722-725``).

:class:`UpstreamExtraBufferDriver` runs the ``extra_buffer`` strategy (ping-pong
tracking). ``kv_match_len`` reports the match's ``MatchResult.full_kv_hit_length`` (KV
found regardless of SSM state, capped like the match).
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

from sglang_mamba_ext.benchmarks.scheduler import Handle, SchedulerDriver

# Tiny per-slot shapes: the benchmark measures bookkeeping, not memory traffic.
_NUM_LAYERS = 4
_FULL_ATTENTION_LAYER_IDS = (3,)  # one attention layer, three mamba layers
_HEAD_NUM = 1
_HEAD_DIM = 8


class UpstreamDriver(SchedulerDriver):
    """SGLang 0.5.23 ``UnifiedRadixCache`` (FULL + MAMBA), page_size 1, no_buffer.

    Arguments: :class:`.scheduler.SchedulerDriver`'s (KV and SSM sizes: slot 0 of each
    reserved on top); ``prompt_checkpoint`` (hit-rate benchmark only) is described in
    the module docstring.
    """

    name = "upstream"
    strategy = "no_buffer"
    #: the test kit's ``enable_mamba_extra_buffer``
    extra_buffer = False
    #: the pool's ``enable_overlap_schedule`` (SGLang's default; matters under extra_buffer)
    enable_overlap_schedule = True

    #: int8 checkpoint slots (SGLang's ``MambaCheckpointPool``) attached after the build, 0: none
    int8_slots = 0

    def build(self, kv_size: int, mamba_size: int, max_context_len: int) -> tuple:
        extra_buffer = self.extra_buffer
        # Heavy imports only when the driver is built.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import sglang.test.kits.unified_radix_cache.fixtures as fixtures
            from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
            from sglang.test.kits.unified_radix_cache.config import CacheConfig
        logging.getLogger("sglang").setLevel(logging.WARNING)

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
        # The kit's HybridReqToTokenPool gets ``enable_overlap_schedule`` (SGLang's
        # default True: 2 ping-pong slots under extra_buffer).
        pool_cls = functools.partial(
            fixtures.HybridReqToTokenPool,
            enable_overlap_schedule=self.enable_overlap_schedule,
        )
        with mock.patch.object(
            fixtures, "get_device", lambda *a, **k: "cpu"
        ), mock.patch.object(fixtures, "HybridReqToTokenPool", pool_cls):
            cache, allocator, req_to_token_pool = fixtures.build_fixture(cfg)
        assert cache.enable_mamba_extra_buffer == extra_buffer
        if self.int8_slots:
            req_to_token_pool.mamba_ckpt_pool = _int8_pool(req_to_token_pool, self.int8_slots)
        return cache, allocator, req_to_token_pool

    def describe(self) -> str:
        return (
            f"{self.name}: SGLang {type(self.cache).__name__} "
            f"components={[c.name for c in self.cache.tree_components]} "
            f"strategy={self.strategy} "
            f"kv_size={self.allocator.size} mamba_size={self.req_to_token_pool.mamba_pool.size} "
            f"page_size={self.cache.page_size} cow_copy={self.cow_copy}"
            + (f" prompt_checkpoint={self.prompt_checkpoint}")
            + (f" int8_ckpt_slots={self.int8_slots}" if self.int8_slots else "")
        )


def _int8_pool(req_to_token_pool, slots: int):
    """SGLang's ``MambaCheckpointPool`` of ``slots`` states shaped as the pool's active states:
    what ``HybridReqToTokenPool`` builds under ``--enable-int8-mamba-checkpoint`` (the test
    kit builds the pool without a runtime context, so the flag cannot reach it); the cache's
    MAMBA component reads ``req_to_token_pool.mamba_ckpt_pool`` when it stores and frees
    states (``unified_cache/components/mamba.py``)."""
    from sglang.srt.mem_cache.mamba_checkpoint_pool import MambaCheckpointPool

    cache = req_to_token_pool.mamba_pool.mamba_cache
    heads, d_v, d_k = cache.temporal.shape[2:]
    return MambaCheckpointPool(
        num_layers=cache.temporal.shape[0],
        num_slots=slots,
        num_heads=heads,
        head_v_dim=d_v,
        head_k_dim=d_k,
        conv_shapes=[tuple(c.shape[2:]) for c in cache.conv],
        conv_dtype=cache.conv[0].dtype,
        device="cpu",
        temporal_dtype=cache.temporal.dtype,
    )


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
    extra_buffer = True

    def __init__(self, kv_size: int, mamba_size: int, *, enable_overlap_schedule: bool = True, **kw):
        """``kw``: ``max_context_len``, ``cow_copy`` (:class:`.scheduler.SchedulerDriver`)."""
        self.enable_overlap_schedule = enable_overlap_schedule
        # The real scheduler always checkpoints after prefill; extra_buffer's prompt
        # states reach the tree only that way.
        super().__init__(kv_size, mamba_size, prompt_checkpoint=True, **kw)
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

    def match(self, h: Handle) -> int:
        req = h.req
        req.init_next_round_input(self.cache)
        if req.prefix_len > h.n_prompt - 1:
            raise AssertionError("init_next_round_input ignored max_prefix_len")
        h.kv_match_len = self._last_match.full_kv_hit_length
        return req.prefix_len

    def after_prefill(self, h: Handle) -> None:
        req = h.req
        entry = self._prepare_for_extend_track(self._batch, req)
        if entry.track_mask:
            self.prefill_tracks += 1
            self.state_copies += 1
        self._prefill_result(h)

    def after_decode(self, h: Handle) -> None:
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
