"""The per-request record the core cache works on.

SGLang's scheduler keeps these fields on its ``Req`` (``sglang/srt/managers/schedule_batch.py``);
the SGLang adapter (``sglang_mamba_ext/plugin/``) fills a :class:`CacheReq` from it and copies
the results back. The core never sees SGLang's objects.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Tuple

import torch


@dataclasses.dataclass(eq=False)
class CacheReq:
    """One request's cache-side state.

    Token positions are counted in tokens from the start of the sequence.

    Attributes:
        rid: request id (any hashable).
        token_ids: every token known so far (prompt, then output as it is generated).
        extra_key: namespace (SGLang ``RadixKey.extra_key``: LoRA id and/or ``cache_salt``);
            requests with different values never share a node, KV slot or SSM slot.
        req_pool_idx: row of ``req_to_token`` (``None`` until admitted by
            :meth:`HybridReqToTokenPool.alloc`).
        kv_allocated_len: positions ``[0, kv_allocated_len)`` of the row hold KV slots
            (tree-owned below ``cache_protected_len``, request-owned above).
        kv_committed_len: positions whose KV and SSM state have been computed by a forward.
        prefix_indices: int64 ``[cache_protected_len]`` KV slots of the tree-owned prefix.
        last_node: the tree node locked for this request (root when nothing is locked).
        cache_protected_len: tokens of the row owned (and locked) by the tree.
        mamba_pool_idx: the working SSM slot, or ``None``.
        mamba_cow_src_index: tree slot to copy into ``mamba_pool_idx`` at forward start
            (``docs/design.md``, "Copy-on-write"), or ``None``.
        mamba_needs_clear: the working slot is fresh and must be zeroed at forward start.
        mamba_ping_pong_track_buffer: the request's checkpoint slots (``docs/design.md``,
            "Ping-pong checkpoints"), ``-1`` where a slot could not be (re)allocated; empty
            without tracking.
        mamba_next_track_idx: which ping-pong entry the next checkpoint goes to (0/1).
        mamba_last_track_seqlen: sequence length (tokens) of the state in the other entry,
            ``None`` if no checkpoint is held.
        mamba_prev_track_seqlen: sequence length (tokens) of the older checkpoint, still
            held in entry ``mamba_next_track_idx`` until the next checkpoint overwrites it
            (SGLang's ``ReqKvInfo.mamba_prev_track_seqlen``), or ``None``.
        mamba_prefix_checkpoints: extra checkpoints planned for this prefill as sorted
            ``(seqlen, slot)`` pairs (branch point, prompt end - 1), not yet in the tree.
        mamba_working_len: tokens the working slot's state reflects when that is not
            ``kv_committed_len`` (``None``: it is). The deferred speculative verify replays a
            finishing request to exactly ``prompt + output[:-1]`` although the KV of drafts
            accepted past the stop is committed (``docs/design.md``, "Deferred update").
        mamba_track_slots_wanted: whether ``HybridReqToTokenPool.alloc`` gives the request its
            ping-pong slots; ``False`` where planned prefix checkpoints replace them (the
            adapter decides, ``MambaRadixReqToTokenPool.tracking_replaced``): the entries
            start ``-1``, as after ``release_track_slots``.
        user: free slot for the adapter (e.g. SGLang's ``Req``).
    """

    rid: Any
    token_ids: List[int]
    extra_key: Optional[str] = None
    req_pool_idx: Optional[int] = None
    kv_allocated_len: int = 0
    kv_committed_len: int = 0
    prefix_indices: Optional[torch.Tensor] = None
    last_node: Any = None
    cache_protected_len: int = 0
    mamba_pool_idx: Optional[int] = None
    mamba_cow_src_index: Optional[int] = None
    mamba_needs_clear: bool = False
    mamba_ping_pong_track_buffer: List[int] = dataclasses.field(default_factory=list)
    mamba_next_track_idx: int = 0
    mamba_last_track_seqlen: Optional[int] = None
    mamba_prev_track_seqlen: Optional[int] = None
    mamba_prefix_checkpoints: List[Tuple[int, int]] = dataclasses.field(default_factory=list)
    mamba_working_len: Optional[int] = None
    mamba_track_slots_wanted: bool = True
    user: Any = None

    def last_track_slot(self) -> Optional[int]:
        """The ping-pong slot holding the newest checkpoint, or ``None``."""
        if self.mamba_last_track_seqlen is None or not self.mamba_ping_pong_track_buffer:
            return None
        slot = self.mamba_ping_pong_track_buffer[1 - self.mamba_next_track_idx]
        return None if slot < 0 else slot
