"""The decode side of prefill/decode disaggregation with the plugin's cache
(``--disaggregation-mode decode --disaggregation-decode-enable-radix-cache
--enable-mamba-radix``; ``docs/design.md``, "Prefill/decode disaggregation").

Five AROUND hooks on SGLang 0.5.23, each inert unless the server's radix cache backend is
the plugin's:

* :func:`build_decode_req_pool_around` on
  ``KVCacheConfigurator._build_hybrid_mamba_decode_req_pool``. SGLang builds a
  ``HybridMambaDecodeReqToTokenPool`` there: ``max_num_reqs`` rows for running requests plus
  ``pre_alloc_size`` rows for requests whose transfer is in flight, and SSM slots for all of
  them. The plugin's cache needs its own pool (one free list per resource, prefix-checkpoint
  slots), so the hook builds the plugin's :class:`~.pool.MambaRadixReqToTokenPool` through
  the ordinary hybrid builder (``_build_hybrid_req_pool``, hooked by :mod:`.pool`) with
  ``max_num_reqs + pre_alloc_size`` rows, then reports ``size = max_num_reqs`` and
  ``pre_alloc_size`` as SGLang's decode pool does (its idle leak check counts the free rows
  against their sum). The decode scheduler uses the pool as a prefill scheduler does
  (``alloc``, ``free``, the row and slot maps, ``translate_mamba_indices``, the SSM
  allocator for ``ensure_mamba_capacity``), all of which the plugin's pool serves.
* :func:`match_prefix_and_lock_around` on ``DecodePreallocQueue._match_prefix_and_lock``: a
  decode-side hit asks the cache for a copy-on-write of the matched state into the request's
  working slot (``cow_mamba``), which the plugin, like SGLang, stages on the request
  (``mamba_cow_src_index``, or ``mamba_needs_clear`` on a miss) for ``prepare_for_extend``
  to run. A transferred request never runs an extend, and the prefill server always sends
  the whole SSM state after the prompt into that slot (only the KV is cut at
  ``decode_prefix_len``), so the staged copy is dropped here, right after the match; left on
  the request it would overwrite the received state if the request were ever extended
  (sglang #32995). The working slot itself stays the request's. Without a hit the slot
  comes from the pool's ``alloc`` in ``_pre_alloc``, which stages a clear of it
  (``mamba_needs_clear``); :func:`pre_alloc_around` drops that one the same way (a pending
  clear would also keep the finished request's state out of the tree).
* :func:`send_kv_metadata_around` on ``DecodePreallocQueue._send_kv_metadata``: counts, per
  transfer, the prefix the decode side holds (``decode_prefix_len``) and the KV tokens the
  prefill server is asked to send; ``/server_info``'s ``mamba_radix`` entry shows the totals
  (:func:`server_info_fields`).
* :func:`process_hicache_local_restores_around` on
  ``DecodeHiCacheTransferMixin._process_hicache_local_restores`` (the decode-side host tier,
  ``--enable-hierarchical-cache``). With it SGLang gates every transferred request on a
  restore status (``HiCacheRestoreGatedKVReceiver``: a finished transfer reads as
  ``Transferring`` while the status is ``PENDING``), which this method moves to ``READY`` once
  the layer-wise load of the request's host-tier prefix (or of any load in flight, which an
  L1 prefix may share) is done on SGLang's cache controller. The plugin's tree has no cache
  controller and no load in flight: its match loads a host-only prefix's KV into device slots
  inside the call (``docs/design.md``, "Host tier"), so the match reports a device prefix and
  no host hit (``needs_local_restore`` false), and SGLang's method, which returns early on a
  tree without ``is_load_back_event_done``, would leave every request ``PENDING`` (each
  transfer waiting forever). The hook marks them ``READY``; a request whose match did report
  a host or storage hit (none does with the plugin's tree) is marked ``FAILED``, which SGLang
  turns into a transfer failure (every slot freed) rather than a hang.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sglang_mamba_ext.plugin.settings import BACKEND_NAME

logger = logging.getLogger(__name__)

BUILD_DECODE_REQ_POOL = (
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_hybrid_mamba_decode_req_pool"
)
MATCH_PREFIX_AND_LOCK = "sglang.srt.disaggregation.decode.DecodePreallocQueue._match_prefix_and_lock"
PRE_ALLOC = "sglang.srt.disaggregation.decode.DecodePreallocQueue._pre_alloc"
SEND_KV_METADATA = "sglang.srt.disaggregation.decode.DecodePreallocQueue._send_kv_metadata"
PROCESS_HICACHE_RESTORES = (
    "sglang.srt.disaggregation.decode_hicache_mixin.DecodeHiCacheTransferMixin._process_hicache_local_restores"
)


def _plugin_cache() -> bool:
    from sglang.srt.runtime_context import get_memory

    return get_memory().radix_cache_backend == BACKEND_NAME


def build_decode_req_pool_around(original, configurator, *, max_num_reqs, extra_max_context_len, pre_alloc_size):
    """AROUND hook (module docstring): the plugin's request pool with the decode side's
    pre-allocated rows; SGLang's own pool otherwise."""
    if not _plugin_cache():
        return original(configurator, max_num_reqs=max_num_reqs, extra_max_context_len=extra_max_context_len,
                        pre_alloc_size=pre_alloc_size)
    from sglang_mamba_ext.plugin.pool import MambaRadixReqToTokenPool

    pool = configurator._build_hybrid_req_pool(max_num_reqs=max_num_reqs + pre_alloc_size,
                                               extra_max_context_len=extra_max_context_len)
    if not isinstance(pool, MambaRadixReqToTokenPool):
        raise RuntimeError("--enable-mamba-radix: the decode server's request pool was not built by the plugin")
    # SGLang's decode pool reports its running rows as ``size`` and the in-flight ones as
    # ``pre_alloc_size`` (its idle leak check counts free rows against the sum)
    pool.size = max_num_reqs
    pool.pre_alloc_size = pre_alloc_size
    logger.info("sglang-mamba-ext: decode request pool: %d rows (%d running + %d pre-allocated)",
                max_num_reqs + pre_alloc_size, max_num_reqs, pre_alloc_size)
    return pool


def drop_staged_state_copy(req) -> None:
    """Forget a staged copy-on-write or clear of the request's working SSM slot (the
    transfer fills that slot; module docstring)."""
    kv = req.kv
    kv.mamba_cow_src_index = None
    kv.mamba_needs_clear = False


def match_prefix_and_lock_around(original, queue, req):
    """AROUND hook (module docstring): SGLang's match and lock, then the staged state copy
    dropped under the plugin's cache."""
    result = original(queue, req)
    if _plugin_cache():
        drop_staged_state_copy(req)
    return result


def drop_planned_checkpoints(queue, req) -> int:
    """Free the prefix checkpoints the pool's ``alloc`` planned for the request (prompt
    length - 1, the branch point; ``MambaRadixCache.plan_prefix_checkpoints``): they are
    for the forward of a prefill to write, and a decode-side request's prompt runs no
    forward here (its state comes whole from the prefill server). Left planned, the finish
    would insert their slots into the tree as states of tokens they never saw (whatever the
    slots held before). Returns how many were dropped."""
    from sglang_mamba_ext.plugin import req_bridge

    cache = queue.tree_cache
    pool = cache.req_to_token_pool
    row = req.kv.req_pool_idx
    if row is None or not getattr(pool, "prefix_checkpoints", {}).get(row):
        return 0
    creq = req_bridge.pull(req, pool=pool)
    dropped = cache.core.drop_planned_prefix_checkpoints(creq)
    req_bridge.push_prefix_checkpoints(pool, row, creq)
    return dropped


def pre_alloc_around(original, queue, req, *args, **kwargs):
    """AROUND hook on ``DecodePreallocQueue._pre_alloc`` (module docstring): the pool's
    ``alloc`` gives a request without a decode-side hit a fresh working slot and stages a
    clear of it (``mamba_needs_clear``); the transfer fills that slot, so the clear is
    dropped. Left staged, the finished request's working state could not enter the tree
    (a pending clear means the slot is not the state of its tokens) and a retraction's
    re-extend would zero the received state. The prefix checkpoints ``alloc`` planned are
    freed too (:func:`drop_planned_checkpoints`)."""
    result = original(queue, req, *args, **kwargs)
    if _plugin_cache():
        drop_staged_state_copy(req)
        drop_planned_checkpoints(queue, req)
    return result


@dataclass
class DecodeTransferCounters:
    """Totals over the transfers a decode server asked for (plain ints)."""

    transfers: int = 0
    #: tokens of the prompts the decode side already held (``decode_prefix_len``)
    prefix_tokens: int = 0
    #: KV tokens the prefill server was asked to send (prompt length - prefix)
    kv_tokens: int = 0
    #: SSM states asked for (one per transfer: always the whole state)
    states: int = 0


COUNTERS_ATTR = "pd_decode_counters"


def counters_of(cache) -> DecodeTransferCounters:
    """The adapter's :class:`DecodeTransferCounters` (created on first use)."""
    c = cache.__dict__.get(COUNTERS_ATTR)
    if c is None:
        c = cache.__dict__[COUNTERS_ATTR] = DecodeTransferCounters()
    return c


def record_transfer(cache, kv_tokens: int, prefix_tokens: int, with_state: bool) -> None:
    c = counters_of(cache)
    c.transfers += 1
    c.prefix_tokens += int(prefix_tokens)
    c.kv_tokens += int(kv_tokens)
    c.states += int(bool(with_state))


def send_kv_metadata_around(original, queue, decode_req, kv_indices, page_size, state_indices=None,
                            **metadata_kwargs):
    """AROUND hook (module docstring): count the transfer, then SGLang's call."""
    cache = getattr(queue, "tree_cache", None)
    if cache is not None and getattr(cache, "server_info", None) is not None and _plugin_cache():
        record_transfer(cache, len(kv_indices), metadata_kwargs.get("decode_prefix_len") or 0,
                        bool(state_indices) and any(s is not None for s in state_indices))
    return original(queue, decode_req, kv_indices, page_size, state_indices, **metadata_kwargs)


def process_hicache_local_restores_around(original, queue, decode_reqs):
    """AROUND hook (module docstring): under the plugin's cache, a transferred request has no
    host-tier restore to wait for (its match loaded any host KV into device slots), so a
    ``PENDING`` status becomes ``READY``; SGLang's method otherwise."""
    if not _plugin_cache():
        return original(queue, decode_reqs)
    from sglang.srt.disaggregation.decode_hicache_mixin import HiCacheRestoreResult

    for dr in decode_reqs:
        if dr.hicache_restore_status != HiCacheRestoreResult.PENDING:
            continue
        match = dr.prefix_match
        if match is not None and match.needs_local_restore:
            logger.error("sglang-mamba-ext: decode request %s reports a host/storage hit of %d tokens, which the "
                         "plugin's tree never does; failing its transfer", dr.req.rid, match.restore_token_count)
            dr.hicache_restore_status = HiCacheRestoreResult.FAILED
        else:
            dr.hicache_restore_status = HiCacheRestoreResult.READY
    return None


def server_info_fields(cache, kv_bytes_per_token: int, state_bytes: int) -> dict:
    """``/server_info`` fields of a decode server's transfers (zeros elsewhere)."""
    c = counters_of(cache)
    return {
        "pd_decode_transfers": c.transfers,
        "pd_decode_prefix_tokens": c.prefix_tokens,
        "pd_decode_kv_tokens_received": c.kv_tokens,
        "pd_decode_states_received": c.states,
        "pd_decode_bytes_received": c.kv_tokens * kv_bytes_per_token + c.states * state_bytes,
    }


def register_pd_decode_hooks() -> None:
    """Register the five hooks (called by ``install_mamba_radix``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(BUILD_DECODE_REQ_POOL, build_decode_req_pool_around, HookType.AROUND)
    HookRegistry.register(MATCH_PREFIX_AND_LOCK, match_prefix_and_lock_around, HookType.AROUND)
    HookRegistry.register(PRE_ALLOC, pre_alloc_around, HookType.AROUND)
    HookRegistry.register(SEND_KV_METADATA, send_kv_metadata_around, HookType.AROUND)
    HookRegistry.register(PROCESS_HICACHE_RESTORES, process_hicache_local_restores_around, HookType.AROUND)
