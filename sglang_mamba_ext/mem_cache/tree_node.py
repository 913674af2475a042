"""The value types of the hybrid radix tree: the key (token ids plus a namespace), the node
(an edge's token ids, their attention-KV slots and at most one SSM-state slot), and the
results of a match, an insert and an eviction. Nothing here changes a tree: the operations
live in :mod:`.radix_cache` (``docs/design.md``, "Tree and match").
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple, Union

import torch

from .lru import LRULink

#: The empty int64 index tensor (no KV slots).
EMPTY_INDICES = torch.empty(0, dtype=torch.int64)

class RadixKey:
    """Token ids plus a namespace (SGLang ``RadixKey``: ``token_ids``, ``extra_key``)."""

    __slots__ = ("token_ids", "extra_key")

    def __init__(self, token_ids: Sequence[int], extra_key: Optional[str] = None):
        self.token_ids = token_ids if isinstance(token_ids, list) else list(token_ids)
        self.extra_key = extra_key

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return f"RadixKey(len={len(self.token_ids)}, extra_key={self.extra_key!r})"


KeyLike = Union[RadixKey, Sequence[int]]


class TreeNode:
    """One radix-tree node (``docs/design.md``, "Tree and match").

    Attributes:
        key: token ids of this edge (a non-empty list, a multiple of ``page_size`` long).
        value: int64 ``[len(key)]`` device KV slots of those tokens, or ``None`` when the
            KV is in the host tier only (``host_value``; ``docs/design.md``, "Host tier").
            Such a node's descendants are host-only too, it holds no device state and no
            request locks it.
        host_value: int64 ``[len(key)]`` slots of the host KV pool holding that KV while
            ``value`` is ``None``; ``None`` otherwise (a node's KV is in one place).
        mamba_value: the SSM slot holding the state after the last token of ``key`` (the
            state of the whole root-to-node sequence), or ``None`` (a tombstone).
        mamba_host_value: the slot of a copy of that state in the host tier
            (``--enable-hierarchical-cache``; ``docs/design.md``, "Host tier"), or ``None``.
            A node whose state is on the host only has ``mamba_value None`` and this set.
        mamba_origin: where that state came from (``stats.STATE_ORIGINS``), for the
            metrics; meaningless on a tombstone.
        children: child dict keyed by the child's first page (and namespace).
        parent: parent node (``None`` for the root).
        seq_len: tokens from the root to the end of this node (its state's position).
        full_lock_ref / mamba_lock_ref: lock counts (requests using this node).
        last_access_time: logical clock of the last touch.
        priority / hits / state_class: the eviction policy's bookkeeping
            (:mod:`.eviction`).
    """

    __slots__ = (
        "key",
        "value",
        "host_value",
        "mamba_value",
        "mamba_host_value",
        "mamba_origin",
        "children",
        "parent",
        "full_lock_ref",
        "mamba_lock_ref",
        "extra_key",
        "seq_len",
        "last_access_time",
        "priority",
        "hits",
        "state_class",
        "id",
        "full_link",
        "mamba_link",
        "host_link",
        "removed",
    )

    _next_id = 0

    def __init__(self, key: List[int], value: torch.Tensor, parent: Optional["TreeNode"], extra_key=None):
        self.key = key
        self.value: Optional[torch.Tensor] = value
        self.host_value: Optional[torch.Tensor] = None
        self.mamba_value: Optional[int] = None
        self.mamba_host_value: Optional[int] = None
        self.mamba_origin: Optional[str] = None
        self.children: dict = {}
        self.parent = parent
        self.full_lock_ref = 0
        self.mamba_lock_ref = 0
        self.extra_key = extra_key
        self.seq_len = (parent.seq_len if parent is not None else 0) + len(key)
        self.last_access_time = 0
        self.priority = 0.0
        self.hits = 0
        self.state_class = None
        self.id = TreeNode._next_id
        TreeNode._next_id += 1
        self.full_link = LRULink(self)
        self.mamba_link = LRULink(self)
        self.host_link = LRULink(self)
        self.removed = False

    @property
    def is_tombstone(self) -> bool:
        """No state in either tier."""
        return self.mamba_value is None and self.mamba_host_value is None

    @property
    def evicted(self) -> bool:
        """KV in the host tier only (SGLang's ``TreeNode.evicted``)."""
        return self.value is None

    @property
    def has_state(self) -> bool:
        """A state in the device tier or the host tier."""
        return self.mamba_value is not None or self.mamba_host_value is not None

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, mamba={self.mamba_value}, "
            + (f"host={self.mamba_host_value}, " if self.mamba_host_value is not None else "")
            + ("kv=host, " if self.value is None else "")
            + f"lock=({self.full_lock_ref},{self.mamba_lock_ref}))"
        )


@dataclasses.dataclass
class MatchResult:
    """Result of :meth:`~.radix_cache.MambaRadixCache.match_prefix`.

    Attributes:
        device_indices: int64 ``[prefix_len]`` KV slots of the usable (SSM-valid) prefix.
        last_node: deepest matched node holding an SSM state (root if none); the node to lock.
        kv_match_len: tokens matched by KV alone (>= ``prefix_len``); the tokens between
            are KV without a state (a branch point or tombstones).
        kv_last_node: the node where the KV match ends.
        mamba_pool_idx: SSM slot allocated for the request by copy-on-write, or ``None``.
        mamba_cow_src_index: the tree slot to copy from at forward start, or ``None``.
    """

    device_indices: torch.Tensor
    last_node: TreeNode
    kv_match_len: int = 0
    kv_last_node: Optional[TreeNode] = None
    mamba_pool_idx: Optional[int] = None
    mamba_cow_src_index: Optional[int] = None

    @property
    def prefix_len(self) -> int:
        return int(self.device_indices.numel())

    @property
    def mamba_branching_seqlen(self) -> Optional[int]:
        """Where the KV match runs deeper than the usable match (a branch point or
        tombstones): a position worth checkpointing during this request's prefill
        (SGLang's ``MatchResult.mamba_branching_seqlen``); ``None`` if there is none."""
        return self.kv_match_len if self.kv_match_len > self.prefix_len else None


@dataclasses.dataclass
class InsertResult:
    """Result of :meth:`~.radix_cache.MambaRadixCache.insert`.

    Attributes:
        prefix_len: tokens of the key that were already in the tree.
        mamba_exist: True when the tree did NOT take ``mamba_value`` (the node already had a
            state, or none was given): the caller still owns and must free its slot.
        last_node: the node that ends exactly at the key's end.
    """

    prefix_len: int
    mamba_exist: bool
    last_node: Optional[TreeNode] = None


@dataclasses.dataclass
class EvictResult:
    """Device KV tokens (freed or moved to the host tier) and SSM states actually freed by :meth:`~.radix_cache.MambaRadixCache.evict`."""

    num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0
    #: Host-tier KV tokens freed (host-only nodes removed), not counted above.
    host_tokens_evicted: int = 0


def split_key(key: KeyLike) -> Tuple[List[int], Optional[str]]:
    """``(token_ids, extra_key)`` of a :class:`RadixKey` or a plain token sequence (no
    namespace)."""
    if isinstance(key, RadixKey):
        return key.token_ids, key.extra_key
    return (key if isinstance(key, list) else list(key)), None


def match_len(node_key: List[int], tokens: List[int], pos: int, end: int, page_size: int) -> int:
    """Tokens (whole pages of ``page_size``) of ``node_key`` equal to the start of
    ``tokens[pos:end]``. Compares slices (C speed) and bisects for the first mismatch: no
    per-token loop."""
    k = len(node_key)
    n = min(k, end - pos)
    if n == k:
        if tokens[pos : pos + k] == node_key:
            return k
    elif node_key[:n] == tokens[pos : pos + n]:
        return n - n % page_size
    lo, hi = 0, n  # node_key[:lo] matches; the first mismatch is in [lo, hi)
    while hi - lo > 8:
        mid = (lo + hi) >> 1
        if node_key[lo:mid] == tokens[pos + lo : pos + mid]:
            lo = mid
        else:
            hi = mid
    while lo < hi and node_key[lo] == tokens[pos + lo]:
        lo += 1
    return lo - lo % page_size


def drop_removed_tail(path: List[TreeNode], pos: int) -> int:
    """Pop the nodes at the end of a match's ``path`` that an eviction during the match
    removed (KV-only nodes past the used state, deleted with a leaf whose state went to
    make room for the request's slot); returns where the KV match now ends (tokens). The
    used state's node is locked or holds the slot's source, so it is never popped."""
    if not path or not path[-1].removed:
        return pos
    while path and path[-1].removed:
        path.pop()
    return path[-1].seq_len if path else 0
