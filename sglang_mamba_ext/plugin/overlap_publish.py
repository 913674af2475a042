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


def publish_launched_prefill_before(scheduler, *args, **kwargs) -> None:
    """BEFORE hook on ``Scheduler.get_next_batch_to_run(running_batch, last_batch)``:
    insert the prompts the last launched batch completed (module docstring). Returns
    ``None`` (the original runs unchanged)."""
    from sglang_mamba_ext.plugin.cache import MambaRadixCacheAdapter

    cache = getattr(scheduler, "tree_cache", None)
    if not isinstance(cache, MambaRadixCacheAdapter):
        return None
    last_batch = kwargs.get("last_batch", args[1] if len(args) > 1 else None)
    for req in _launched_prefills(scheduler, last_batch):
        cache.checkpoint(req, up_to=req.extend_end)
    return None


def register_overlap_publish_hook() -> None:
    """Register :func:`publish_launched_prefill_before` (idempotent with the registry)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(GET_NEXT_BATCH, publish_launched_prefill_before, HookType.BEFORE)
