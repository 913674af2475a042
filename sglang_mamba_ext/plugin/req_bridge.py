"""The one place where SGLang 0.5.23's per-request cache fields meet the core's
:class:`~sglang_mamba_ext.mem_cache.CacheReq`.

SGLang keeps a request's cache bookkeeping on its ``Req`` (``managers/schedule_batch.py``):
``req.kv`` (``ReqKvInfo``: row, ``cache_protected_len``, committed / allocated lengths, the
working SSM slot ``mamba_pool_idx`` as a 0-d int64 tensor, the deferred copy-on-write source
``mamba_cow_src_index`` as a ``[1]`` tensor, the ping-pong buffer as a ``[2]`` tensor with its
``mamba_next_track_idx`` / ``mamba_last_track_idx`` / ``mamba_last_track_seqlen``), plus
``req.lock`` (a ``TreeLock`` on the node the request holds) and ``req.last_node``.

Every adapter call builds a fresh :class:`CacheReq` from those fields (:func:`pull`), runs the
core, and writes back what the core changed (the ``push_*`` functions). Nothing is cached on
the ``Req``, so SGLang's own resets (retraction, abort, admission rejection) need no hook. The
one piece of per-request state SGLang has no field for — the prefix checkpoints planned for a
prefill (``docs/design.md``, "Prefix checkpoints") — is kept by the plugin's request pool
per row, and every path that frees a row or its SSM slots frees them too.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch

from sglang.srt.mem_cache.base_prefix_cache import DecLockRefParams, TreeLock

from sglang_mamba_ext.mem_cache import CacheReq

#: Attribute of SGLang's ``Req``: tokens its working SSM slot reflects when that is not
#: ``kv_committed_len`` (the deferred speculative verify, ``CacheReq.mamba_working_len``).
WORKING_LEN_ATTR = "_mamba_working_len"


def namespace(extra_key: Optional[str], cache_salt: Optional[str]) -> Any:
    """The core's namespace for SGLang's ``RadixKey.extra_key`` (LoRA) and ``cache_salt``
    (tenant): ``None`` when both are unset, else the pair. Different pairs never share a
    node (``docs/design.md``, "Tree and match")."""
    if extra_key is None and not cache_salt:
        return None
    return (extra_key, cache_salt or None)


def _as_int(t: Optional[torch.Tensor]) -> Optional[int]:
    if t is None:
        return None
    # SGLang's slot fields hold one element (0-d or [1]); ``item`` reads it without a view.
    return t.item() if t.numel() == 1 else int(t.reshape(-1)[0])


def pull(req, token_ids: Sequence[int] = (), pool=None) -> CacheReq:
    """A :class:`CacheReq` holding ``req``'s current cache fields.

    Args:
        req: SGLang ``Req``.
        token_ids: the tokens the core may read (a prefix of ``origin_input_ids +
            output_ids``); empty for calls that read no tokens.
        pool: the plugin's request pool; when given, the prefix checkpoints it keeps for
            the request's row (``MambaRadixReqToTokenPool.prefix_checkpoints``) are copied
            into ``mamba_prefix_checkpoints`` (write them back with
            :func:`push_prefix_checkpoints`).

    The ping-pong entry the core reads as "newest checkpoint" (``1 - mamba_next_track_idx``)
    is set to SGLang's ``mamba_last_track_idx`` (they agree with a two-entry buffer).
    """
    kv = req.kv
    lock = getattr(req, "lock", None)
    buf = kv.mamba_ping_pong_track_buffer
    last_idx = kv.mamba_last_track_idx
    next_idx = (1 - last_idx) if last_idx is not None else (kv.mamba_next_track_idx or 0)
    planned = pool.prefix_checkpoints.get(kv.req_pool_idx) if pool is not None else None
    return CacheReq(
        rid=req.rid,
        token_ids=token_ids if type(token_ids) is list else list(token_ids),
        extra_key=namespace(req.extra_key, req.cache_salt),
        req_pool_idx=kv.req_pool_idx,
        kv_allocated_len=kv.kv_allocated_len,
        kv_committed_len=kv.kv_committed_len,
        last_node=lock.node if lock is not None else None,
        cache_protected_len=kv.cache_protected_len,
        mamba_pool_idx=_as_int(kv.mamba_pool_idx),
        mamba_cow_src_index=_as_int(kv.mamba_cow_src_index),
        mamba_needs_clear=bool(kv.mamba_needs_clear),
        mamba_ping_pong_track_buffer=buf.tolist() if buf is not None else [],
        mamba_next_track_idx=next_idx,
        mamba_last_track_seqlen=kv.mamba_last_track_seqlen,
        mamba_prev_track_seqlen=getattr(kv, "mamba_prev_track_seqlen", None),
        mamba_prefix_checkpoints=list(planned) if planned else [],
        # set by the deferred speculative glue after it replayed a finishing request
        # (plugin/speculative/hooks.py::release_kv_cache_before)
        mamba_working_len=getattr(req, WORKING_LEN_ATTR, None),
        user=req,
    )


def push_prefix_checkpoints(pool, row: Optional[int], creq: CacheReq) -> None:
    """Store the prefix checkpoints the core left on ``creq`` (planned, not yet inserted)
    as row ``row``'s entry of ``pool.prefix_checkpoints``; drop the entry when none are
    left. ``row`` is the row the request held when :func:`pull` ran."""
    if row is None:
        return
    if creq.mamba_prefix_checkpoints:
        pool.prefix_checkpoints[row] = list(creq.mamba_prefix_checkpoints)
    else:
        pool.prefix_checkpoints.pop(row, None)


def _slot_tensor(slot: int, device) -> torch.Tensor:
    """A fresh 0-d int64 tensor holding ``slot`` (``scalar_tensor`` skips the Python-data
    parsing of ``torch.tensor``)."""
    return torch.scalar_tensor(slot, dtype=torch.int64, device=device)


def push_mamba(req, creq: CacheReq, device) -> None:
    """Write the working slot and the copy-on-write fields back (after ``match_prefix``
    or a pool allocation)."""
    kv = req.kv
    if creq.mamba_pool_idx is None:
        kv.mamba_pool_idx = None
    elif _as_int(kv.mamba_pool_idx) != creq.mamba_pool_idx:
        kv.mamba_pool_idx = _slot_tensor(creq.mamba_pool_idx, device)
    if creq.mamba_cow_src_index is None:
        kv.mamba_cow_src_index = None
    elif _as_int(kv.mamba_cow_src_index) != creq.mamba_cow_src_index:
        kv.mamba_cow_src_index = torch.tensor([creq.mamba_cow_src_index], dtype=torch.int64, device=device)
    kv.mamba_needs_clear = creq.mamba_needs_clear


def push_track_buffer(req, creq: CacheReq, device, *, fresh: bool) -> None:
    """Write the ping-pong buffer back: SGLang's ``[2]`` int64 tensor, its emptiness flags,
    and, for a ``fresh`` buffer (just allocated), the initial indices SGLang's
    ``HybridReqToTokenPool._alloc_ping_pong_buffer`` sets (next 0, last 1)."""
    kv = req.kv
    buf: List[int] = creq.mamba_ping_pong_track_buffer
    if not buf:
        return
    if kv.mamba_ping_pong_track_buffer is None or kv.mamba_ping_pong_track_buffer.tolist() != buf:
        kv.mamba_ping_pong_track_buffer = torch.tensor(buf, dtype=torch.int64, device=device)
    kv.mamba_ping_pong_empty = [s < 0 for s in buf]
    if fresh:
        kv.mamba_next_track_idx = 0
        kv.mamba_last_track_idx = 1
        kv.mamba_last_track_seqlen = None
        kv.mamba_prev_track_seqlen = None
    elif creq.mamba_last_track_seqlen is None and kv.mamba_last_track_seqlen is not None:
        # The core donated the newest checkpoint to the tree (as SGLang's own
        # cleanup_after_caching_req does, nothing names a checkpoint now).
        kv.mamba_last_track_seqlen = None
        kv.mamba_prev_track_seqlen = None


#: SGLang's per-request SSM fields that hold nothing once the slots are freed.
_SSM_FIELDS = (
    "mamba_pool_idx",
    "mamba_ping_pong_track_buffer",
    "mamba_ping_pong_empty",
    "mamba_next_track_idx",
    "mamba_last_track_idx",
    "mamba_last_track_seqlen",
    "mamba_prev_track_seqlen",
    "mamba_cow_src_index",
)


def push_mamba_released(req) -> None:
    """Clear every SSM field after the core freed (or donated) the request's slots, as
    SGLang's ``HybridReqToTokenPool.free_mamba_cache`` does."""
    kv = req.kv
    for name in _SSM_FIELDS:
        setattr(kv, name, None)
    kv.mamba_needs_clear = False


def push_checkpoint(req, creq: CacheReq, device, *, finished: bool) -> None:
    """Write back what the core's ``checkpoint`` changed: the
    tree-owned length, the node the request now holds locked (``req.lock`` /
    ``req.last_node``; the core already moved the lock count), and the SSM fields."""
    kv = req.kv
    lock = getattr(req, "lock", None)
    old_node = lock.node if lock is not None else None
    if creq.last_node is not old_node and creq.last_node is not None:
        req.lock = TreeLock(creq.last_node, DecLockRefParams())
        req.last_node = creq.last_node
    kv.cache_protected_len = creq.cache_protected_len
    kv.cache_inserted_len = max(kv.cache_inserted_len, creq.cache_protected_len)
    if finished:
        push_mamba_released(req)
    else:
        push_track_buffer(req, creq, device, fresh=False)
