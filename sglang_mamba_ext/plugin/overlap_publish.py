"""Publish a launched prefill to the tree before the next batch is scheduled (overlap
scheduling; issue 38, ``docs/design.md``, "Overlap scheduling").

SGLang's overlap loop (``Scheduler.event_loop_overlap``) schedules batch N+1 before it
processes the result of batch N, and the result processor is where a finished prompt goes
into the tree (``checkpoint_kv_cache`` in ``batch_result_processor.py``). So a request
admitted in the batch right after another's prefill cannot match that prompt: under overlap
it recomputes a shared system prompt that the request before it has just computed, where the
scheduler without overlap would hit it. A request whose prefill is chunked does not have
this gap: SGLang inserts its finished chunk when it schedules the next batch
(``Scheduler.stash_chunked_request``), while that chunk's forward may still run.

This module does the same for the requests whose prompt the last launched batch completed:
a BEFORE hook on ``Scheduler.get_next_batch_to_run`` calls the cache's ``checkpoint`` for
them (KV, planned prefix checkpoints, the prefill's ping-pong checkpoint). It is safe for the
reason SGLang's chunked stash is: every read of what it publishes happens inside a later
forward, after batch N's forward wrote it, and SGLang fences the scheduler's writes behind the
in-flight forward's reads (``Scheduler._apply_war_barrier``). The result processor's own
``checkpoint_kv_cache`` then finds nothing new to insert. Only under ``--enable-mamba-radix``,
for a plain extend batch (no speculative decoding, not a PD prefill server); ``req.prefix_len``
is left for the result processor to advance.

The same hook donates early the final state of a request that the last launched decode
batch finishes by length (:func:`donate_finishing_decodes`). SGLang knows it at this point
(``Scheduler._reqs_finishing_inflight`` leaves it out of the next batch); without the early
donation, the next batch's admission runs while the request still holds its working slot,
and its final state is no eviction candidate there (``docs/benchmarks.md``, "What overlap
scheduling costs the cache"). The request's sequence through the in-flight token goes into
the tree with the working slot, whose state that forward is writing, and the request's lock
is released; only bookkeeping, no device work: the slot and the sequence's KV can be reused
only by a later forward, which the device runs after this one. Its result's release then
finds the request already donated (:data:`DONATED`). Not for speculative decoding, beam
search, sessions, the host tier, int8 checkpoints or ``--enable-linear-replayssm`` (whose
inserts do device work), nor a finish SGLang cannot foresee (a stop token: its result
arrives one batch late, as before).
"""

from __future__ import annotations

GET_NEXT_BATCH = "sglang.srt.managers.scheduler.Scheduler.get_next_batch_to_run"


def _launched_prefills(scheduler, last_batch) -> list:
    """The requests of ``last_batch`` whose prompt its forward completed and whose result is
    not processed yet (empty unless the hook applies: module docstring)."""
    if last_batch is None or not getattr(scheduler, "result_queue", None):
        return []  # not the overlap loop, or the last result was processed already
    mode = getattr(last_batch, "forward_mode", None)
    if getattr(mode, "name", None) != "EXTEND":  # not MIXED, TARGET_VERIFY, SPLIT_PREFILL, ...
        return []
    spec = getattr(last_batch, "spec_algorithm", None)
    if spec is not None and not spec.is_none():
        return []
    if str(getattr(scheduler, "disaggregation_mode", "null")).lower().endswith("prefill"):
        return []
    chunked = getattr(scheduler, "chunked_req", None)
    out = []
    for req in last_batch.reqs:
        if req is chunked or req.finished() or getattr(req, "to_finish", None) is not None:
            continue
        if req.kv.req_pool_idx is None or req.skip_radix_cache_insert:
            continue
        end = req.extend_end
        if end <= req.prefix_len or end < len(req.full_untruncated_fill_ids):
            continue  # nothing new, or a chunk SGLang stashes itself
        out.append(req)
    return out


#: Attribute set on a request whose final state :func:`donate_finishing_decodes` gave the
#: tree (its length in tokens); the adapter's ``checkpoint`` then inserts nothing more.
DONATED = "_mamba_radix_finish_donated"


def _finishing_decodes(scheduler, cache) -> list:
    """The requests of the in-flight decode batch whose result finishes them by length
    (SGLang's ``Scheduler._reqs_finishing_inflight`` rule), where the early donation applies
    (module docstring)."""
    if not getattr(scheduler, "enable_skip_finishing_decode", False):
        return []
    queue = getattr(scheduler, "result_queue", None)
    if not queue or len(queue) != 1:
        return []
    batch = queue[0][0]
    if getattr(getattr(batch, "forward_mode", None), "name", None) != "DECODE":
        return []
    spec = getattr(batch, "spec_algorithm", None)
    if spec is not None and not spec.is_none():
        return []
    if str(getattr(scheduler, "disaggregation_mode", "null")).lower().endswith(("prefill", "decode")):
        return []
    core = cache.core
    if core.mamba_host_pool is not None or core.mamba_ckpt_pool is not None:
        return []  # their inserts copy states (ReplaySSM runs without overlap scheduling)
    out = []
    for req in batch.reqs:
        kv = req.kv
        if (req.finished() or getattr(req, "to_finish", None) is not None or getattr(req, DONATED, None) is not None
                or getattr(req, "beam_group", None) is not None or req.skip_radix_cache_insert
                or getattr(req, "session", None) is not None or getattr(req, "session_id", None) is not None
                or kv.req_pool_idx is None or kv.mamba_pool_idx is None):
            continue
        if not req.next_output_finishes_by_length():
            continue
        if kv.kv_committed_len != len(req.origin_input_ids) + len(req.output_ids):
            continue  # not the layout this relies on: leave it to the result processor
        out.append(req)
    return out


def donate_finishing_decodes(scheduler, cache) -> int:
    """Give the tree the final state of each request the in-flight decode batch finishes by
    length (module docstring): its ``origin_input_ids + output_ids`` (``kv_committed_len``
    tokens) with its working slot, through the core's finished ``checkpoint``; then release
    its lock. Returns how many were donated."""
    from sglang_mamba_ext.plugin import req_bridge

    reqs = _finishing_decodes(scheduler, cache)
    for req in reqs:
        n = req.kv.kv_committed_len
        tokens = [int(t) for t in req.origin_input_ids] + [int(t) for t in req.output_ids]
        pool = cache.req_to_token_pool
        creq = req_bridge.pull(req, tokens, pool=pool)
        group = cache._free_group_begin()
        try:
            cache.core.checkpoint(creq, up_to=n, finished=True)
        finally:
            if group:
                cache.token_to_kv_pool_allocator.free_group_end()
        req_bridge.push_prefix_checkpoints(pool, creq.req_pool_idx, creq)
        req_bridge.push_checkpoint(req, creq, cache.device, finished=True)
        cache.unlock(req.lock)  # the result's release unlocks nothing more (req.lock None)
        req.lock = None
        setattr(req, DONATED, n)
    cache.finish_states_donated_early += len(reqs)
    if reqs and cache.hybrid_metrics is not None:
        cache.sync_metrics()
    return len(reqs)


def publish_launched_prefill_before(scheduler, *args, **kwargs) -> None:
    """BEFORE hook on ``Scheduler.get_next_batch_to_run(running_batch, last_batch)``:
    insert the prompts the last launched batch completed, and donate the final states of
    the requests it finishes by length (module docstring). Returns ``None`` (the original
    runs unchanged)."""
    from sglang_mamba_ext.plugin.cache import MambaRadixCacheAdapter

    cache = getattr(scheduler, "tree_cache", None)
    if not isinstance(cache, MambaRadixCacheAdapter):
        return None
    last_batch = kwargs.get("last_batch", args[1] if len(args) > 1 else None)
    for req in _launched_prefills(scheduler, last_batch):
        cache.checkpoint(req, up_to=req.extend_end)
    donate_finishing_decodes(scheduler, cache)
    return None


def register_overlap_publish_hook() -> None:
    """Register :func:`publish_launched_prefill_before` (idempotent with the registry)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(GET_NEXT_BATCH, publish_launched_prefill_before, HookType.BEFORE)
