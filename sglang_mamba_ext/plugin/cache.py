"""SGLang 0.5.23's prefix-cache protocol (``mem_cache/base_prefix_cache.py::BasePrefixCache``)
over the core :class:`~sglang_mamba_ext.mem_cache.MambaRadixCache`, registered as
``--radix-cache-backend mamba_radix_ext`` (:func:`build_tree_cache`; call paths in
``docs/sglang-hooks.md``, mechanisms in ``docs/design.md``). The adapter only translates:
SGLang's ``MatchPrefixParams`` / ``Req`` / ``EvictParams`` into the core's keys and
:class:`~sglang_mamba_ext.mem_cache.CacheReq` (through :mod:`.req_bridge`) and the core's
results back. The scheduler's ``match_prefix`` (admission, the cache-aware sort,
``touch_prefix``) becomes the core's match in the namespace ``(extra_key, cache_salt)``, with
copy-on-write when asked and ``mamba_branching_seqlen`` reported where a prefill should save a
state; ``checkpoint(req, up_to=...)`` (``common.checkpoint_kv_cache`` after prefill chunks and
completed prefills, ``common.release_kv_cache`` for a finished request) becomes the core's
``checkpoint(req, up_to, finished=req.finished())``; ``on_release`` the core's ``on_release``;
evictions, locks, sizes and diagnostics go to the core as they are.
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from typing import Any, List, Optional


from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)

from sglang_mamba_ext.mem_cache import MambaRadixCache
from sglang_mamba_ext.mem_cache import RadixKey as CoreRadixKey
from sglang_mamba_ext.plugin import req_bridge
from sglang_mamba_ext.plugin.kv_events import attach as attach_kv_events
from sglang_mamba_ext.plugin.host_tier import attach_host_tier
from sglang_mamba_ext.plugin import overlap_publish, replayssm
from sglang_mamba_ext.plugin.cache_tiers import TierProtocol
from sglang_mamba_ext.plugin.pool import MambaRadixReqToTokenPool
from sglang_mamba_ext.plugin.sessions import RadixSessions, end_streaming_turn
from sglang_mamba_ext.plugin.settings import BACKEND_NAME, WARMUP_RID_PREFIX, current_settings

logger = logging.getLogger(__name__)


class MambaRadixCacheAdapter(TierProtocol, BasePrefixCache):
    """``BasePrefixCache`` over the core cache (module docstring).

    Args:
        req_to_token_pool: the plugin's :class:`MambaRadixReqToTokenPool`.
        token_to_kv_pool_allocator: SGLang's KV allocator (``alloc`` / ``free`` /
            ``available_size``).
        enable_mamba_extra_buffer: SGLang's checkpoint tracking runs (the pool has ping-pong
            slots).
        checkpoint_grid: tokens; ``mamba_branching_seqlen`` is reported on this grid
            (SGLang's ``mamba_checkpoint_grid(page_size)``).
        enable_metrics: create SGLang's radix-cache metrics collector and the hybrid
            cache's series (:mod:`.metrics`).
        **core_options: the core cache's keyword arguments (``page_size``,
            ``mamba_track_interval``, ``finish_state``, ``eviction_policy``,
            ``kv_bytes_per_token``, ``max_states_per_path`` — SGLang's -1 means no bound);
            prefix checkpoints are always on.
        enable_kv_cache_events / dynamo_kv_event_format / kv_event_lora_names: SGLang's
            ``CacheInitParams`` fields of ``--kv-events-config``; events are recorded into
            ``self.kv_events`` (:mod:`.kv_events`, ``docs/design.md``, "KV events").

    Raises:
        TypeError: the pool is not the plugin's (the pool hook did not run).
        ValueError: a core option out of range (the core's message).
    """

    #: Read-only queries answered by the core method of the same meaning (KV in tokens,
    #: SSM in slots), bound per instance: no adapter frame on the scheduler's hot path.
    _CORE_QUERIES = {
        "evictable_size": "full_evictable_size",
        "protected_size": "full_protected_size",
        "full_evictable_size": "full_evictable_size",
        "full_protected_size": "full_protected_size",
        "mamba_evictable_size": "mamba_evictable_size",
        "mamba_protected_size": "mamba_protected_size",
        "total_size": "total_size",
        "path_device_indices": "path_device_indices",
        "all_values_flatten": "all_values_flatten",
        "all_mamba_values_flatten": "all_mamba_values_flatten",
        "pretty_print": "pretty_print",
        "sanity_check": "sanity_check",
    }

    def __init__(
        self,
        *,
        req_to_token_pool: MambaRadixReqToTokenPool,
        token_to_kv_pool_allocator: Any,
        enable_mamba_extra_buffer: bool = True,
        checkpoint_grid: int = 1,
        enable_metrics: bool = False,
        enable_kv_cache_events: bool = False,
        dynamo_kv_event_format: bool = False,
        kv_event_lora_names: Any = None,
        enable_session_radix_cache: bool = False,
        **core_options: Any,
    ):
        if not isinstance(req_to_token_pool, MambaRadixReqToTokenPool):
            raise TypeError(
                f"--enable-mamba-radix: the request pool is {type(req_to_token_pool).__name__}, "
                "not MambaRadixReqToTokenPool (the pool hook on "
                "KVCacheConfigurator._build_hybrid_req_pool did not run)"
            )
        core = MambaRadixCache(
            token_to_kv_pool_allocator, req_to_token_pool.core, branch_checkpoints=True, **core_options
        )
        self.core = core
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = core.page_size
        self.device = req_to_token_pool.device
        self.disable = False
        self.enable_mamba_extra_buffer = enable_mamba_extra_buffer
        self.checkpoint_grid = max(1, int(checkpoint_grid))
        self.kv_events = attach_kv_events(
            core,
            enabled=enable_kv_cache_events,
            dynamo_format=dynamo_kv_event_format,
            lora_names=kv_event_lora_names,
        )
        self._kv_free_groups = hasattr(token_to_kv_pool_allocator, "free_group_begin") and hasattr(
            token_to_kv_pool_allocator, "free_group"
        )
        for name, core_name in self._CORE_QUERIES.items():
            setattr(self, name, getattr(core, core_name))
        req_to_token_pool.tree_cache = self
        #: SGLang ``Req`` -> its last copy-on-write match (``MambaRadixCache.hit_of``),
        #: counted when the request gets its row (:meth:`count_admitted`); weak, so a
        #: request dropped while waiting leaves nothing behind.
        self._matched = weakref.WeakKeyDictionary()
        #: SGLang's idle check reads these under ``--enable-hierarchical-cache``: always empty.
        self.ongoing_write_through = {}
        self.ongoing_load_back = {}
        #: The hybrid cache's Prometheus series (``--enable-metrics``), or ``None``.
        self.hybrid_metrics = None
        if enable_metrics:
            from sglang_mamba_ext.plugin.metrics import MambaRadixMetricsCollector, cache_metric_labels

            self.init_metrics_collector()
            self.hybrid_metrics = MambaRadixMetricsCollector(
                cache_metric_labels(type(self).__name__), core.eviction_policy
            )
            self.sync_metrics()

        #: ``--enable-session-radix-cache`` (SGLang's registry checks this attribute): open
        #: sessions' states are evicted last (``plugin/sessions.py``).
        self.enable_session_radix_cache = bool(enable_session_radix_cache)
        self.radix_sessions = RadixSessions(core) if self.enable_session_radix_cache else None

        #: The TP consistency check (``SGLANG_MAMBA_EXT_TP_DIGEST_STEPS``), set by
        #: :func:`build_tree_cache` under tensor parallelism; ``None`` otherwise.
        self.tp_digest = None
        #: ReplaySSM decode-ring records folded into working states before the tree took
        #: them (``--enable-linear-replayssm``; ``plugin/replayssm.py``)
        self.replayssm_records_folded = 0
        #: final states given to the tree before their result (plugin/overlap_publish.py)
        self.finish_states_donated_early = 0
        #: ``--enable-lmcache``: the fetch-and-store path to an LMCache server
        #: (:mod:`.lmcache_connector`), set by :func:`build_tree_cache`; ``None`` otherwise.
        self.lmcache = None
        #: SGLang ``Req`` -> prompt tokens already looked up in LMCache (one lookup per
        #: request and length; a waiting request is matched again each scheduling pass)
        self._lmcache_looked_up = weakref.WeakKeyDictionary()

    # -- identity ----------------------------------------------------------------------
    @property
    def root_node(self):
        return self.core.root_node

    def supports_mamba(self) -> bool:
        return True

    def supports_swa(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    # -- SGLang's radix sessions (--enable-session-radix-cache) ---------------------------
    def open_radix_session(self, session_id: str) -> Optional[int]:
        return self.radix_sessions.open(session_id) if self.radix_sessions else None

    def ensure_session_generation(self, session_id: str) -> Optional[int]:
        return self.radix_sessions.generation(session_id) if self.radix_sessions else None

    def release_radix_session(self, session_id: str) -> int:
        return self.radix_sessions.close(session_id) if self.radix_sessions else 0

    def reset(self) -> None:
        """Drop the tree (``Scheduler.flush_cache`` clears the pools right after); LMCache
        keeps what it stored."""
        self.core.reset()
        if self.lmcache is not None:
            self.lmcache.reset()
            self._lmcache_looked_up = weakref.WeakKeyDictionary()
        if self.hybrid_metrics is not None:
            self.sync_metrics()

    # -- match -------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if getattr(key, "is_bigram", False):
            raise NotImplementedError("--enable-mamba-radix does not support EAGLE bigram keys")
        tokens = _token_list(key.raw_token_ids())
        ns = req_bridge.namespace(key.extra_key, key.cache_salt)
        req = params.req
        if req is not None and req.skip_radix_cache_insert:
            _admit_warmup(req)
        cow = bool(params.cow_mamba) and req is not None
        creq = req_bridge.pull(req) if cow else None
        loaded = (getattr(self.core, "host_kv_loaded_total", 0), getattr(self.core, "storage_kv_pages_loaded_total", 0))
        from_lmcache = 0
        if cow and self.lmcache is not None:
            # --enable-lmcache: past the tree's hit, from LMCache; before the free group below,
            # so that KV its allocation evicts is free for it at once
            from_lmcache = self._lmcache_fetch(req, tokens, ns, key)
        # A copy-on-write slot may evict a state (and its leaf's KV): one batched free.
        group = self._free_group_begin() if cow else False
        try:
            res = self.core.match_prefix(CoreRadixKey(tokens, ns), cow_mamba=cow, req=creq)
        finally:
            if group:
                self.token_to_kv_pool_allocator.free_group_end()
        if cow:
            req_bridge.push_mamba(req, creq, self.device)
            self._cache_breakdown(req, res.prefix_len, getattr(self.core, "host_kv_loaded_total", 0) - loaded[0]
                                  + from_lmcache,
                                  (getattr(self.core, "storage_kv_pages_loaded_total", 0) - loaded[1])
                                  * self.core.page_size + from_lmcache)
            fill = getattr(req, "full_untruncated_fill_ids", None)
            try:
                self._matched[req] = self.core.hit_of(len(fill) if fill is not None else len(tokens), res)
            except TypeError:  # a request object without weak references: not counted
                pass
            if self.hybrid_metrics is not None:
                self.sync_metrics()
        branching = None
        if res.kv_match_len > res.prefix_len:
            if self.req_to_token_pool.prefix_checkpoint_writer:
                # The backend saves a state at any position: the exact branch point, planned
                # as a prefix checkpoint when the request gets its row (SGLang's own tracking
                # ignores a point off its grid and re-saves one on it, harmlessly).
                branching = res.kv_match_len
            elif self.enable_mamba_extra_buffer:
                aligned = (res.kv_match_len // self.checkpoint_grid) * self.checkpoint_grid
                if aligned > res.prefix_len:
                    branching = aligned
        node = res.last_node
        return MatchResult(
            device_prefix_len=res.prefix_len,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
            mamba_branching_seqlen=branching,
            full_kv_hit_length=res.kv_match_len,
        )

    @staticmethod
    def _cache_breakdown(req, prefix_len: int, host_tokens: int, storage_tokens: int) -> None:
        """SGLang's per-tier split of a request's cached prefix (``meta_info.cached_tokens_details``:
        device / host / storage tokens; ``ScheduleBatch.prepare_for_extend`` computes it from its
        own tree's host and storage hit fields, which the plugin's tree does not fill): where this
        match loaded KV from the host tier (``host_tokens``, of which ``storage_tokens`` were read
        from storage first), the split is set here and marked computed. A match that loaded
        nothing leaves SGLang's computation (all device) alone."""
        if host_tokens <= 0:
            return
        host = min(host_tokens, prefix_len)
        storage = min(storage_tokens, host)
        req.cached_tokens_device = prefix_len - host
        req.cached_tokens_host = host - storage
        req.cached_tokens_storage = storage
        req._cache_breakdown_computed = True

    def _free_group_begin(self) -> bool:
        """Open a free group on the KV allocator (SGLang's ``free_group_begin`` /
        ``free_group_end``: the frees of one adapter call reach the free list as one
        concatenation, in the same order). Returns whether one was opened: not when the
        allocator has no groups or the caller (SGLang's scheduler) already holds one."""
        alloc = self.token_to_kv_pool_allocator
        if not self._kv_free_groups or alloc.free_group is not None:
            return False
        alloc.free_group_begin()
        return True

    # -- checkpoint / release ----------------------------------------------------------
    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        if getattr(req, overlap_publish.DONATED, None) is not None:
            return  # its final state is in the tree already (plugin/overlap_publish.py)
        fill = req.full_untruncated_fill_ids
        up_to = min(int(up_to), len(fill))
        pool = self.req_to_token_pool
        tokens = _token_list(fill if up_to == len(fill) else fill[:up_to])
        creq = req_bridge.pull(req, tokens, pool=pool)
        row = creq.req_pool_idx
        finished = req.finished()
        # --enable-linear-replayssm: the working state becomes the live one before the tree
        # can take it (plugin/replayssm.py)
        self.replayssm_records_folded += replayssm.flush_slots(pool.mamba_pool, [creq.mamba_pool_idx])
        # The insert frees duplicate KV and a slot allocation may evict: one batched free.
        group = self._free_group_begin()
        try:
            self.core.checkpoint(creq, up_to=up_to, finished=finished, prefill_done=up_to >= len(fill))
        finally:
            if group:
                self.token_to_kv_pool_allocator.free_group_end()
        if finished and self.radix_sessions is not None:
            self.radix_sessions.pin_finished(req, creq.last_node)
        req_bridge.push_prefix_checkpoints(pool, row, creq)
        req_bridge.push_checkpoint(req, creq, self.device, finished=finished)
        if self.lmcache is not None and not getattr(req, "skip_radix_cache_insert", False):
            ns = req_bridge.namespace(req.extra_key, req.cache_salt)
            self.lmcache.store(str(req.rid), tokens, CoreRadixKey(tokens, ns),
                               self.lmcache.salt(req.cache_salt, req.extra_key))
        if self.hybrid_metrics is not None:
            self.sync_metrics()

    def on_release(self, req, *, checkpointed: bool) -> None:
        end_streaming_turn(req)  # a streaming session's turn ended (plugin/sessions.py)
        if self.lmcache is not None:
            self.lmcache.release(str(req.rid))
        kv = req.kv
        if kv.mamba_pool_idx is None and kv.mamba_ping_pong_track_buffer is None:
            return
        pool = self.req_to_token_pool
        creq = req_bridge.pull(req, pool=pool)
        self.core.on_release(creq)
        req_bridge.push_prefix_checkpoints(pool, creq.req_pool_idx, creq)
        req_bridge.push_mamba_released(req)

    # -- eviction and locks ------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        start = time.perf_counter()
        # Every removed leaf frees its KV: one batched free for the whole eviction.
        group = self._free_group_begin()
        # SGLang asks for SSM slots of the active pool; with int8 checkpoints the tree holds
        # none there (its states are in the checkpoint pool), so it evicts KV only.
        tree_mamba = 0 if self.core.mamba_ckpt_pool is not None else params.mamba_num
        try:
            res = self.core.evict(num_tokens=params.num_tokens, mamba_num=tree_mamba)
        finally:
            if group:
                self.token_to_kv_pool_allocator.free_group_end()
        mamba_evicted = res.mamba_num_evicted
        if params.mamba_num > mamba_evicted:
            # The tree had no more states to give: planned prefix checkpoints of running
            # requests are optional, so they go next (never a request's own slots).
            mamba_evicted += self.req_to_token_pool.reclaim_prefix_checkpoints(params.mamba_num - mamba_evicted)
        self.update_eviction_metrics(res.num_tokens_evicted, start)
        if self.hybrid_metrics is not None:
            self.sync_metrics()
        return EvictResult(num_tokens_evicted=res.num_tokens_evicted, mamba_num_evicted=mamba_evicted)

    def inc_lock_ref(self, node) -> IncLockRefResult:
        self.core.inc_lock_ref(node)
        return IncLockRefResult()

    def dec_lock_ref(self, node, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        self.core.dec_lock_ref(node)
        if self.hybrid_metrics is not None:
            self.sync_metrics()
        return DecLockRefResult()

    # -- metrics and server info (docs/design.md, "Metrics") ---------------------------
    def count_admitted(self, reqs) -> None:
        """The requests got their rows (``MambaRadixReqToTokenPool.alloc``): count each
        one's last copy-on-write match in the core's statistics, once."""
        matched = self._matched
        for req in reqs:
            try:
                hit = matched.pop(req, None)
            except TypeError:
                hit = None
            if hit is not None:
                self.core.count_hit(*hit)
        if self.hybrid_metrics is not None:
            self.sync_metrics()

    def sync_metrics(self) -> None:
        """Bring the Prometheus series (``--enable-metrics``) up to the core's counters."""
        if self.hybrid_metrics is not None:
            self.hybrid_metrics.sync(self.core.stats_snapshot())

    def server_info(self) -> dict:
        """The ``mamba_radix`` entry of ``/server_info`` (:func:`.metrics.cache_server_info`)."""
        from sglang_mamba_ext.plugin.metrics import cache_server_info

        return cache_server_info(self)

    def available_and_evictable_str(self) -> str:
        """The pool summary SGLang prints when an allocation fails
        (``allocation.alloc_token_slots`` and the decode path, through
        ``common.available_and_evictable_str``), worded as SGLang 0.5.23's own hybrid
        mamba cache words it (``UnifiedRadixCache.available_and_evictable_str`` with the
        FULL and MAMBA components), so logs and tools read the same two lines: KV in
        tokens, SSM states in slots, each ``free + evictable``."""
        kv_free = self.token_to_kv_pool_allocator.available_size()
        ssm_free = self.req_to_token_pool.mamba_allocator.available_size()
        kv_evictable = self.core.full_evictable_size()
        # with int8 checkpoints the tree's states free no active SSM slot
        ssm_evictable = self.core.mamba_evictable_size() if self.core.mamba_ckpt_pool is None else 0
        return (
            f"Available full tokens: {kv_free + kv_evictable} "
            f"(full_available_size={kv_free} + full_evictable_size_={kv_evictable})\n"
            f"Available mamba: {ssm_free + ssm_evictable} "
            f"(available_size={ssm_free} + component_evictable_size_={ssm_evictable})\n"
        )


def _admit_warmup(req) -> None:
    """Let a ``kda_cache`` warm-up request on a prefill server into the tree: SGLang sets
    ``Req.skip_radix_cache_insert`` for its fake bootstrap host (``managers/schedule_batch.py``,
    so that its own warm-up leaves no entries); the plugin's warm-up (``rid`` prefix
    ``WARMUP_RID_PREFIX``, :mod:`.warmup`) exists to leave them. A request with positional
    embedding overrides stays out (its KV is not determined by its token ids)."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    if (
        str(getattr(req, "rid", "")).startswith(WARMUP_RID_PREFIX)
        and getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST
        and getattr(req, "positional_embed_overrides", None) is None
    ):
        req.skip_radix_cache_insert = False


def _token_list(tokens) -> List[int]:
    """Token ids as a list (the core compares and slices lists): an ``array`` or tensor
    converted in C, a list passed as it is (the core never mutates a key)."""
    if type(tokens) is list:
        return tokens
    tolist = getattr(tokens, "tolist", None)
    return tolist() if tolist is not None else list(tokens)


#: Environment override of what a finished request donates: ``auto`` (default: under
#: overlap scheduling ``overlap``, the live state, or with speculative decoding
#: ``checkpoint``; else ``working``, the live state), ``working``, ``checkpoint`` or
#: ``overlap`` (``docs/design.md``, "Overlap scheduling").
FINISH_STATE_ENV = "SGLANG_MAMBA_EXT_FINISH_STATE"


def _finish_state(overlap: bool, extra_buffer: bool, live_state: bool = True) -> str:
    """The core's ``finish_state``. ``live_state``: under overlap the working slot of a
    finished request holds ``kv_committed_len`` tokens (not with speculative decoding,
    whose committed length lags the device's by up to one verify under overlap).

    Raises:
        ValueError: a bad ``SGLANG_MAMBA_EXT_FINISH_STATE`` value, or one the strategy
            cannot serve."""
    choice = os.environ.get(FINISH_STATE_ENV, "auto") or "auto"
    if choice not in ("auto", "working", "checkpoint", "overlap"):
        raise ValueError(f"{FINISH_STATE_ENV}={choice!r}: expected auto, working, checkpoint or overlap")
    if choice in ("checkpoint", "overlap") and not extra_buffer:
        raise ValueError(
            f"{FINISH_STATE_ENV}={choice} needs ping-pong checkpoints "
            "(not --mamba-radix-cache-strategy no_buffer)"
        )
    if choice == "auto":
        if not (overlap and extra_buffer):
            return "working"
        return "overlap" if live_state else "checkpoint"
    return choice


def _eviction_policy(params) -> str:
    """``--radix-eviction-policy`` as the core cache names it.

    Raises:
        ValueError: a policy the plugin's cache does not implement (naming the flag)."""
    from sglang_mamba_ext.plugin.settings import SUPPORTED_POLICIES

    policy = str(getattr(params, "eviction_policy", None) or "lru")
    if policy not in SUPPORTED_POLICIES:
        raise ValueError(
            f"--enable-mamba-radix supports --radix-eviction-policy {' or '.join(SUPPORTED_POLICIES)}, "
            f"not {policy}"
        )
    return policy


def _kv_bytes_per_token(allocator) -> int:
    """Bytes of one token's KV over all attention layers (0 if the pool does not say)."""
    try:
        kvcache = allocator.get_kvcache()
        k, v = kvcache.get_kv_size_bytes()
        return int((k + v) // max(int(kvcache.size + kvcache.page_size), 1))
    except Exception:  # noqa: BLE001 - an estimate only; the policy works without it
        return 0


def build_tree_cache(ctx) -> MambaRadixCacheAdapter:
    """Factory registered as ``--radix-cache-backend mamba_radix_ext``
    (``registry.register_radix_cache_backend``); ``ctx`` is SGLang's
    ``TreeCacheBuildContext``.

    Raises:
        ValueError: naming the flags, for a model or combination the cache cannot serve.
    """
    from sglang.srt.runtime_context import get_exec, get_schedule, get_spec, mamba_checkpoint_grid

    if ctx.disable_radix_cache:
        raise ValueError("--enable-mamba-radix cannot be combined with --disable-radix-cache")
    if not ctx.is_hybrid_ssm:
        raise ValueError(
            "--enable-mamba-radix needs a hybrid model with linear-attention / SSM layers; "
            "this model has none (drop --enable-mamba-radix)"
        )
    if ctx.is_hybrid_swa:
        raise ValueError("--enable-mamba-radix does not support sliding-window (SWA) hybrid models")
    params = ctx.params
    write_policy = "write_through"
    if ctx.enable_hierarchical_cache:
        write_policy = attach_host_tier(params.req_to_token_pool, params.token_to_kv_pool_allocator)
    algo = str(get_spec().speculative_algorithm or "").upper()
    if params.is_eagle and algo not in ("FROZEN_KV_MTP", "EAGLE"):
        # SGLang keys EAGLE-family trees by token pairs (bigram keys): a draft's KV at position
        # i was computed with token i+1. This tree keys by tokens; FROZEN_KV_MTP's draft writes
        # no KV, and an EAGLE / NEXTN draft's KV at a hit's last position may carry another
        # next token (draft proposals only: accept counts, never outputs; docs/speculative.md).
        raise ValueError(
            f"--enable-mamba-radix does not support --speculative-algorithm {algo} (bigram radix keys)"
        )
    overlap = not get_schedule().disable_overlap_schedule
    extra_buffer = bool(params.enable_mamba_extra_buffer)
    grid = mamba_checkpoint_grid(params.page_size) if extra_buffer else params.page_size
    cache = MambaRadixCacheAdapter(
        req_to_token_pool=params.req_to_token_pool,
        token_to_kv_pool_allocator=params.token_to_kv_pool_allocator,
        page_size=params.page_size,
        mamba_track_interval=get_exec().mamba.mamba_track_interval,
        finish_state=_finish_state(overlap, extra_buffer, not algo),
        enable_mamba_extra_buffer=extra_buffer,
        checkpoint_grid=grid,
        enable_metrics=params.enable_metrics,
        enable_kv_cache_events=params.enable_kv_cache_events,
        dynamo_kv_event_format=params.dynamo_kv_event_format,
        kv_event_lora_names=params.kv_event_lora_names,
        eviction_policy=_eviction_policy(params),
        kv_bytes_per_token=_kv_bytes_per_token(params.token_to_kv_pool_allocator),
        max_states_per_path=get_exec().mamba.mamba_max_states_per_path,
        hicache_write_policy=write_policy,
        enable_session_radix_cache=bool(getattr(params, "enable_session_radix_cache", False)),
    )
    storage = current_settings().get("storage_backend")
    if storage:  # docs/design.md, "Storage tier"
        from sglang.srt.runtime_context import get_parallel, get_server_args

        from sglang_mamba_ext.plugin.host_tier import attach_storage_tier

        sa = get_server_args()
        try:  # each TP rank stores its own shard (HiCacheFile's key suffix)
            rank, size = get_parallel().tp_rank, get_parallel().tp_size
        except RuntimeError:  # not published (an offline build of the cache)
            rank, size = 0, 1
        attach_storage_tier(cache.core, storage, current_settings().get("storage_extra_config"),
                            getattr(sa, "served_model_name", None) or getattr(sa, "model_path", None), rank, size,
                            model_path=getattr(sa, "model_path", None))
    from sglang.srt.runtime_context import get_memory

    if get_memory().enable_lmcache:  # docs/flags.md, "LMCache"
        from sglang_mamba_ext.plugin.lmcache_connector import build_connector

        cache.lmcache = build_connector(cache, ctx, get_memory().lmcache_config_file)
    from sglang_mamba_ext.plugin.tp_digest import maybe_digest_check

    cache.tp_digest = maybe_digest_check(cache.core, getattr(params, "tp_cache_group", None))
    logger.info(
        "sglang-mamba-ext: %s tree cache (page_size=%d, finish_state=%s, ping-pong tracking %s, "
        "track interval %d, checkpoint grid %d, eviction %s)",
        BACKEND_NAME,
        params.page_size,
        cache.core.finish_state,
        "on" if extra_buffer else "off",
        get_exec().mamba.mamba_track_interval,
        grid,
        cache.core.eviction_policy,
    )
    return cache
