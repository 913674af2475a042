"""Radix tree over token ids whose nodes hold attention-KV slot indices and at most one
SSM-state slot (seed §2–§7).

Mechanisms, with their seed sections:

- §2.1 ``TreeNode``: ``key`` (token ids), ``value`` (KV slots, one per token),
  ``mamba_value`` (one SSM slot or ``None``), ``full_lock_ref`` / ``mamba_lock_ref``.
- §2.3 tombstones: a node whose SSM state was evicted keeps its KV; it can never be the end
  of a usable match. Leaves are never tombstones (a tombstone that becomes a leaf is removed).
- §3.1 index sharing: requests share the tree's KV slots through ``req_to_token``.
- §3.2 copy-on-write: a hit allocates the request its own SSM slot and records the source;
  the copy runs at forward start (:meth:`execute_deferred_cow`). The tree's slot is never
  written by a forward.
- §3.3 two LRU lists with O(1) touch/remove: SSM states are evicted (tombstoning) and KV
  leaves are removed independently.
- §3.4 / §5 ping-pong checkpoints (see ``HybridReqToTokenPool.plan_track``); decode inserts
  only the final state (§5.2).
- §4.2 chunked prefill: :meth:`cache_unfinished_req` inserts the checkpointed prefix and
  writes the tree's indices back into ``req_to_token``.
- §4.3 ``prev_prefix_len``: :meth:`insert` frees the caller's KV slots that duplicate tree
  content and lie beyond the part the caller already had from the tree.
- §6.4 long cannot serve short: a match that ends inside a node splits it; the new parent
  has no SSM state, so the usable match stops at the deepest ancestor with a state.

Namespaces: a :class:`RadixKey`'s ``extra_key`` is part of every child lookup, so keys of
different namespaces never share a node.

Lock semantics: ``inc_lock_ref(node)`` takes a KV lock on ``node`` and every ancestor and an
SSM lock on ``node`` itself, whether or not it holds a state at that moment (a tombstone
revived while locked is protected until the unlock); ``dec_lock_ref`` mirrors it exactly, so
counts never go negative. The root holds both locks permanently.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from .lru import LRULink, LRUList
from .req import CacheReq
from .req_to_token_pool import HybridReqToTokenPool

_EMPTY = torch.empty(0, dtype=torch.int64)

#: Eviction policies of :class:`MambaRadixCache`.
EVICTION_POLICIES = ("lru", "recompute")


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
    """One radix-tree node (seed §2.1).

    Attributes:
        key: token ids of this edge (a non-empty list, a multiple of ``page_size`` long).
        value: int64 ``[len(key)]`` KV slots of those tokens.
        mamba_value: the SSM slot holding the state after the last token of ``key`` (the
            state of the whole root-to-node sequence), or ``None`` (a tombstone).
        children: child dict keyed by the child's first page (and namespace).
        parent: parent node (``None`` for the root).
        seq_len: tokens from the root to the end of this node (its state's position).
        full_lock_ref / mamba_lock_ref: lock counts (requests using this node).
        last_access_time: logical clock of the last touch.
    """

    __slots__ = (
        "key",
        "value",
        "mamba_value",
        "children",
        "parent",
        "full_lock_ref",
        "mamba_lock_ref",
        "extra_key",
        "seq_len",
        "last_access_time",
        "priority",
        "hits",
        "id",
        "full_link",
        "mamba_link",
        "removed",
    )

    _next_id = 0

    def __init__(self, key: List[int], value: torch.Tensor, parent: Optional["TreeNode"], extra_key=None):
        self.key = key
        self.value = value
        self.mamba_value: Optional[int] = None
        self.children: dict = {}
        self.parent = parent
        self.full_lock_ref = 0
        self.mamba_lock_ref = 0
        self.extra_key = extra_key
        self.seq_len = (parent.seq_len if parent is not None else 0) + len(key)
        self.last_access_time = 0
        self.priority = 0.0
        self.hits = 0
        self.id = TreeNode._next_id
        TreeNode._next_id += 1
        self.full_link = LRULink(self)
        self.mamba_link = LRULink(self)
        self.removed = False

    @property
    def is_tombstone(self) -> bool:
        return self.mamba_value is None

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, len={len(self.key)}, mamba={self.mamba_value}, "
            f"lock=({self.full_lock_ref},{self.mamba_lock_ref}))"
        )


@dataclasses.dataclass
class MatchResult:
    """Result of :meth:`MambaRadixCache.match_prefix`.

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
    """Result of :meth:`MambaRadixCache.insert`.

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
    """Tokens of KV and SSM states actually freed by :meth:`MambaRadixCache.evict`."""

    num_tokens_evicted: int = 0
    mamba_num_evicted: int = 0


class MambaRadixCache:
    """Hybrid prefix cache: attention KV + SSM state per node (seed §2–§7).

    Args:
        kv_allocator: KV slot allocator (``alloc(n)``, ``free(idx)``, ``available_size()``):
            :class:`~sglang_mamba_ext.mem_cache.allocator.KVSlotAllocator` or SGLang's
            ``TokenToKVPoolAllocator``.
        req_to_token_pool: the hybrid request pool; its ``mamba_pool`` is the SSM pool.
        page_size: tokens per KV page (>= 1). Keys are matched and stored in whole pages.
        mamba_track_interval: tokens between ping-pong checkpoints (a multiple of
            ``page_size``).
        finish_state: which state :meth:`cache_finished_req` donates: ``"working"`` (the
            request's working slot, exact at the sequence end; safe when no forward can
            still be writing it, i.e. without overlap scheduling) or ``"checkpoint"`` (the
            newest ping-pong checkpoint, seed §4.1 step 4; safe under overlap scheduling).
        branch_checkpoints: save extra SSM checkpoints during prefill where they pay off
            (see :meth:`plan_prefix_checkpoints`): at the branch point ``match_prefix``
            reports, and at prompt length - 1.
        max_states_per_path: at most this many SSM states on any root-to-node path
            (SGLang's ``--mamba-max-states-per-path``; 0 or negative: no bound): after an
            insert places a state, the shallowest surplus states on its path are dropped
            (tombstoned, KV kept) — never the new state, a fork (a node with several
            children, shared by several branches) or a locked one.
        eviction_policy: ``"lru"`` (seed §3.3) or ``"recompute"`` (recency blended with
            recompute saved per byte, see :meth:`_recompute_victim`).
        kv_bytes_per_token: bytes of one token's KV over all attention layers, so the
            recompute policy can weigh KV freed by removing a leaf (0: SSM bytes only).

    Raises:
        ValueError: on a bad ``page_size``, ``mamba_track_interval``, ``finish_state`` or
            ``eviction_policy``.
    """

    def __init__(
        self,
        kv_allocator: Any,
        req_to_token_pool: HybridReqToTokenPool,
        page_size: int = 1,
        mamba_track_interval: int = 256,
        finish_state: str = "working",
        branch_checkpoints: bool = False,
        max_states_per_path: int = 0,
        eviction_policy: str = "lru",
        kv_bytes_per_token: int = 0,
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if mamba_track_interval < page_size or mamba_track_interval % page_size:
            raise ValueError(
                f"mamba_track_interval ({mamba_track_interval}) must be a positive multiple of "
                f"page_size ({page_size}); pass --mamba-track-interval as a multiple of --page-size"
            )
        if finish_state not in ("working", "checkpoint"):
            raise ValueError(f"finish_state must be 'working' or 'checkpoint', got {finish_state!r}")
        if eviction_policy not in EVICTION_POLICIES:
            raise ValueError(
                f"eviction_policy must be one of {EVICTION_POLICIES}, got {eviction_policy!r}"
            )
        self.token_to_kv_pool_allocator = kv_allocator
        self.req_to_token_pool = req_to_token_pool
        self.mamba_pool = req_to_token_pool.mamba_pool
        self.page_size = page_size
        self.mamba_track_interval = mamba_track_interval
        self.finish_state = finish_state
        self.branch_checkpoints = branch_checkpoints
        self.max_states_per_path = max_states_per_path
        self.eviction_policy = eviction_policy
        self.kv_bytes_per_token = kv_bytes_per_token
        self.device = getattr(kv_allocator, "device", torch.device("cpu"))
        self.full_lru_list = LRUList()
        self.mamba_lru_list = LRUList()
        #: Totals since construction (all evictions, including those the cache runs
        #: itself to allocate a copy-on-write or checkpoint slot): KV tokens, SSM states.
        self.evicted_tokens_total = 0
        self.evicted_states_total = 0
        self.reset()

    # ================================================================ public protocol
    def reset(self) -> None:
        """Empty the tree (does not touch slots held outside it)."""
        self.root_node = TreeNode([], _EMPTY, None)
        self.root_node.full_lock_ref = 1
        self.root_node.mamba_lock_ref = 1
        self.full_lru_list = LRUList()
        self.mamba_lru_list = LRUList()
        self._clock = 0
        self._inflation = 0.0
        self._full_evictable = 0
        self._full_protected = 0
        self._mamba_evictable = 0
        self._mamba_protected = 0

    def match_prefix(self, key: KeyLike, *, cow_mamba: bool = False, req: Optional[CacheReq] = None) -> MatchResult:
        """Longest cached prefix of ``key`` that is usable by a hybrid model.

        The usable prefix ends at the deepest matched node holding an SSM state: KV beyond
        it is never returned (seed §6.4). A match ending inside a node splits it. The key is
        truncated to whole pages. Matched nodes are touched in the KV LRU, the used state in
        the SSM LRU.

        With ``cow_mamba`` and a non-empty usable prefix, the request gets copy-on-write
        (seed §3.2): an SSM slot is allocated now (evicting one state if the pool is full;
        ``None`` if that fails — ``HybridReqToTokenPool.alloc`` then allocates it) and the
        tree's slot is recorded as the source; the copy runs at forward start. With ``req``
        given, ``req.mamba_pool_idx`` / ``req.mamba_cow_src_index`` are set too.

        Args:
            key: token ids (list or :class:`RadixKey`).
            cow_mamba: allocate and record the COW as above.
            req: the request to record the COW on (optional).

        Returns:
            :class:`MatchResult`.
        """
        tokens, extra_key = self._split_key(key)
        n = len(tokens)
        if self.page_size > 1:
            n -= n % self.page_size
        node = self.root_node
        pos = 0
        best_node = node
        values: List[torch.Tensor] = []
        best_nvals = 0
        step = self._step
        while pos < n:
            hit = step(node, tokens, pos, n, extra_key)
            if hit is None:
                break
            child, m, full = hit
            values.append(child.value)
            pos += m
            node = child
            if child.mamba_value is not None:
                best_node, best_nvals = child, len(values)
            if not full:
                break

        self._touch_path(node)
        if best_node is not self.root_node:
            self._touch_state(best_node)
        if best_nvals == 0:
            device_indices = _EMPTY
        elif best_nvals == 1:
            device_indices = values[0]
        else:
            device_indices = torch.cat(values[:best_nvals])

        result = MatchResult(device_indices, best_node, kv_match_len=pos, kv_last_node=node)
        if cow_mamba and best_node is not self.root_node:
            result.mamba_cow_src_index = best_node.mamba_value
            if req is None or req.mamba_pool_idx is None:
                result.mamba_pool_idx = self._alloc_mamba_slot(protect=best_node)
            else:
                result.mamba_pool_idx = req.mamba_pool_idx
            if req is not None:
                req.mamba_pool_idx = result.mamba_pool_idx
                req.mamba_cow_src_index = result.mamba_cow_src_index
                req.mamba_needs_clear = False
        return result

    def insert(
        self,
        key: KeyLike,
        value: torch.Tensor,
        mamba_value: Optional[Union[int, torch.Tensor]] = None,
        prev_prefix_len: int = 0,
    ) -> InsertResult:
        """Insert ``key`` with its KV slots ``value`` and the state after its last token.

        Ownership (seed §4.3): the tree takes the KV slots it lacked. Slots of
        ``value[prev_prefix_len:]`` that duplicate tree content are freed here;
        ``value[:prev_prefix_len]`` is the part the caller already had from the tree and is
        never freed. The tree takes ``mamba_value`` only if the node ending at the key's end
        had no state (``mamba_exist`` False); otherwise the caller keeps (and frees) it.

        Args:
            key: token ids, a multiple of ``page_size`` long.
            value: int64 ``[len(key)]`` KV slots.
            mamba_value: SSM slot (int or 1-element tensor) holding the state after the key.
            prev_prefix_len: tokens at the start of ``value`` that are tree-owned already.

        Raises:
            ValueError: on a key not page aligned, a length mismatch, or new tokens without
                ``mamba_value`` (that would make a tombstone leaf).
        """
        tokens, extra_key = self._split_key(key)
        n = len(tokens)
        if n % self.page_size:
            raise ValueError(f"insert: key length {n} is not a multiple of page_size {self.page_size}")
        if value.numel() != n:
            raise ValueError(f"insert: {value.numel()} KV slots for a key of {n} tokens")
        if isinstance(mamba_value, torch.Tensor):
            mamba_value = int(mamba_value.reshape(-1)[0])
        return self._insert(tokens, extra_key, value, mamba_value, prev_prefix_len, self.root_node)

    def _insert(
        self,
        tokens: List[int],
        extra_key: Optional[str],
        value: torch.Tensor,
        mamba_value: Optional[int],
        prev_prefix_len: int,
        node: TreeNode,
    ) -> InsertResult:
        """:meth:`insert` starting the walk at ``node`` (a node on the key's path, e.g. the
        request's locked ``last_node``), which skips re-comparing the locked prefix."""
        n = len(tokens)
        kv_free = self.token_to_kv_pool_allocator.free
        pos = node.seq_len
        step = self._step
        while pos < n:
            hit = step(node, tokens, pos, n, extra_key)
            if hit is None:
                break
            child, m, full = hit
            end = pos + m
            if prev_prefix_len < end:
                kv_free(value[max(prev_prefix_len, pos) : end])
            pos = end
            node = child
            if not full:
                break

        prefix_len = pos
        if pos < n:
            if mamba_value is None:
                raise ValueError(
                    "insert: new tokens without mamba_value would leave a leaf without SSM state"
                )
            new = TreeNode(tokens[pos:], value[pos:], node, extra_key)
            node.children[self._child_key(new.key, 0, extra_key)] = new
            new.mamba_value = mamba_value
            self._full_evictable += n - pos
            self._mamba_evictable += 1
            self._touch_state(new)
            node = new
            mamba_exist = False
        elif mamba_value is not None and node is not self.root_node and node.mamba_value is None:
            self._set_state(node, mamba_value)
            mamba_exist = False
        else:
            mamba_exist = True
        if not mamba_exist and self.max_states_per_path > 0:
            self._enforce_path_cap(node)
        self._touch_path(node)
        return InsertResult(prefix_len, mamba_exist, node)

    def cache_unfinished_req(self, req: CacheReq) -> None:
        """After a prefill chunk (seed §4.2): insert the request's tokens up to its newest
        checkpoint with that checkpoint's slot, free the request's duplicate KV, write the
        tree's KV indices back into ``req_to_token``, and move the request's lock to the new
        node. Without ping-pong tracking (``track_slots_per_req == 0``) the working state is
        copied into a fresh slot instead (the chunk end must be page aligned).

        A donated checkpoint slot is replaced by a freshly allocated one (``-1`` if the pool
        has none even after evicting one state).
        """
        row = req.req_pool_idx
        if row is None:
            raise ValueError(f"cache_unfinished_req: request {req.rid!r} has no req_pool_idx")
        self._commit_prefix_checkpoints(req)
        p = req.cache_protected_len
        pool = self.req_to_token_pool
        tracked = pool.track_slots_per_req > 0
        if tracked:
            n = req.mamba_last_track_seqlen
            slot = req.last_track_slot()
            if n is None or slot is None or n <= p or n > req.kv_committed_len:
                return
            entry = 1 - req.mamba_next_track_idx
        else:
            n = req.kv_committed_len - req.kv_committed_len % self.page_size
            if n <= p:
                return
            slot = self._alloc_mamba_slot()
            if slot is None:
                return
            self.mamba_pool.copy_from([req.mamba_pool_idx], [slot])
        res = self._adopt_prefix(req, n, slot)
        if tracked:
            if not res.mamba_exist:
                fresh = self._alloc_mamba_slot()
                pool.replace_track_slot(req, entry, -1 if fresh is None else fresh)
                req.mamba_last_track_seqlen = None
        elif res.mamba_exist:
            self.mamba_pool.free([slot])

    def _adopt_prefix(self, req: CacheReq, n: int, slot: int) -> InsertResult:
        """Insert the request's first ``n`` tokens with SSM slot ``slot`` (the state after
        them). When ``n`` passes ``cache_protected_len``, the tree's KV indices are written
        back into ``req_to_token`` (seed §4.3) and the request's lock moves to the new node;
        the caller still owns ``slot`` when the result says ``mamba_exist``."""
        pool = self.req_to_token_pool
        row = req.req_pool_idx
        p = req.cache_protected_len
        kv = pool.req_to_token[row, :n].to(torch.int64)
        res = self._insert(req.token_ids[:n], req.extra_key, kv, slot, p, self._walk_start(req, n))
        if n > p:
            self._adopt_inserted_prefix(req, res.last_node, n)
        return res

    # ------------------------------------------------------------ branch checkpoints
    def plan_prefix_checkpoints(
        self, req: CacheReq, prompt_len: int, branching_seqlen: Optional[int] = None
    ) -> List[Tuple[int, int]]:
        """Plan the extra SSM checkpoints this request's prefill saves (Marconi-style
        admission; issue 6), after ``match_prefix``, the lock and the row allocation:

        - at ``branching_seqlen`` (``MatchResult.mamba_branching_seqlen``): the KV of the
          prompt is cached deeper than any usable state — where sequences branch, e.g. at
          the end of a shared system prompt. A state saved there serves every later request
          that shares the prefix;
        - at ``prompt_len - 1``: the state before the last prompt token, so a resent
          identical prompt (whose match is capped at ``len - 1``) hits all but one token.

        Positions are floored to whole pages and kept only inside ``(cache_protected_len,
        prompt_len)``. Each gets an SSM slot now (evicting one state if the pool is full:
        the slot is counted against the SSM pool like any other); a position whose slot
        cannot be had is dropped. The forward writes the states
        (``HybridReqToTokenPool.prefix_checkpoints_in``); ``cache_unfinished_req`` /
        ``cache_finished_req`` insert them; ``release_req`` frees unused ones.

        Returns:
            the planned ``(seqlen, slot)`` pairs (also stored on the request).
        """
        if not self.branch_checkpoints:
            return []
        ps = self.page_size
        p = req.cache_protected_len
        wanted = set()
        if branching_seqlen is not None:
            wanted.add(branching_seqlen - branching_seqlen % ps)
        last = prompt_len - 1
        wanted.add(last - last % ps)
        positions = sorted(c for c in wanted if p < c < prompt_len)
        planned: List[Tuple[int, int]] = []
        for c in positions:
            slot = self._alloc_mamba_slot()
            if slot is None:
                break
            planned.append((c, slot))
        req.mamba_prefix_checkpoints = planned + req.mamba_prefix_checkpoints
        req.mamba_prefix_checkpoints.sort()
        return planned

    def _commit_prefix_checkpoints(self, req: CacheReq, up_to: Optional[int] = None) -> None:
        """Insert every planned checkpoint the forward has passed (``seqlen <=
        kv_committed_len`` and ``<= up_to``), in order; free the slot where the tree already
        had a state."""
        cps = req.mamba_prefix_checkpoints
        if not cps:
            return
        limit = req.kv_committed_len if up_to is None else min(up_to, req.kv_committed_len)
        keep = []
        for c, slot in cps:
            if c > limit:
                keep.append((c, slot))
                continue
            res = self._adopt_prefix(req, c, slot)
            if res.mamba_exist:
                self.mamba_pool.free([slot])
        req.mamba_prefix_checkpoints = keep

    def _enforce_path_cap(self, node: TreeNode) -> None:
        """Drop the shallowest surplus states on ``node``'s root path beyond
        ``max_states_per_path`` (see the constructor); ``node`` itself, forks and locked
        nodes keep theirs."""
        cap = self.max_states_per_path
        path = []
        anc = node.parent
        root = self.root_node
        while anc is not root:
            if anc.mamba_value is not None:
                path.append(anc)
            anc = anc.parent
        surplus = len(path) + 1 - cap
        for anc in reversed(path):  # shallowest first
            if surplus <= 0:
                return
            if anc.mamba_lock_ref == 0 and len(anc.children) == 1:
                self._drop_state(anc)
                surplus -= 1

    def insert_finished_req(self, req: CacheReq, up_to: Optional[int] = None, adopt: bool = True) -> int:
        """The insert half of :meth:`cache_finished_req` (seed §4.1 step 4, §5.1 step 4),
        for callers that release the row themselves (SGLang 0.5.23's ``checkpoint`` of a
        finished request, followed by its ``release_kv_cache``).

        Inserts the request's sequence with its final state — the working slot when it
        holds exactly ``up_to`` tokens (``finish_state="working"``), else the newest
        ping-pong checkpoint not past ``up_to``, the key cut at the state's length — frees
        the KV slots the tree already had, writes the tree's KV indices back into
        ``req_to_token``, moves the request's lock to the new node and advances
        ``cache_protected_len``; then frees every SSM slot of the request the tree did not
        take (:meth:`HybridReqToTokenPool.free_mamba_slots`). KV slots at and above the
        new ``cache_protected_len`` and the row stay the caller's to free.

        Args:
            req: a request holding a row.
            up_to: tokens of ``req.token_ids`` that may be inserted (the request's valid
                length, e.g. cut at a stop); default ``req.kv_committed_len``.
            adopt: write the tree's KV indices back and move the lock (needed when the
                caller keeps using the row); ``cache_finished_req`` skips it.

        Returns:
            the new ``req.cache_protected_len`` (tokens now owned by the tree).
        """
        pool = self.req_to_token_pool
        row = req.req_pool_idx
        if row is None:
            pool.free_mamba_slots(req)
            return req.cache_protected_len
        self._commit_prefix_checkpoints(req, up_to)
        p = req.cache_protected_len
        n, slot = self._finish_state(req, up_to)
        donated = None
        if n > 0:
            kv = pool.req_to_token[row, :n].to(torch.int64)
            res = self._insert(req.token_ids[:n], req.extra_key, kv, slot, p, self._walk_start(req, n))
            if not res.mamba_exist:
                donated = slot
            if n > p:
                if adopt:
                    self._adopt_inserted_prefix(req, res.last_node, n)
                else:
                    # The row is released right after (cache_finished_req): the tree now
                    # owns [p, n) (duplicates were freed by the insert); no write-back or
                    # lock move is needed.
                    req.cache_protected_len = n
        pool.free_mamba_slots(req, keep_slot=donated)
        return req.cache_protected_len

    def cache_finished_req(self, req: CacheReq, insert: bool = True) -> None:
        """Finish (or, with ``insert=False``, abort) a request: insert its sequence with the
        final state (:meth:`insert_finished_req`), free every slot the tree did not take,
        release its row and its lock.

        The state donated is the working slot (``finish_state="working"``, exact at
        ``kv_committed_len`` when that is page aligned) or else the newest ping-pong
        checkpoint with the key cut at the checkpoint's length. KV slots past the inserted
        length are freed. Safe at any stage: a request rejected at admission or aborted
        before it got a row frees its copy-on-write slot and its lock.
        """
        pool = self.req_to_token_pool
        row = req.req_pool_idx
        if row is not None:
            if insert:
                self.insert_finished_req(req, adopt=False)
            p = req.cache_protected_len
            alloc_len = req.kv_allocated_len
            if alloc_len > p:
                self.token_to_kv_pool_allocator.free(pool.req_to_token[row, p:alloc_len].to(torch.int64))
        pool.free(req)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node = None
        req.prefix_indices = None
        req.cache_protected_len = 0
        req.kv_allocated_len = 0
        req.kv_committed_len = 0

    def _adopt_inserted_prefix(self, req: CacheReq, node: TreeNode, n: int) -> None:
        """After inserting the request's first ``n`` tokens (ending at ``node``): lock
        ``node`` in place of the request's old lock, point ``req_to_token[row, p:n]`` at the
        tree's KV slots and set ``cache_protected_len = n`` (seed §4.2 step 4)."""
        # Lock the new node before anything can evict (a replacement slot may).
        self.inc_lock_ref(node)
        if req.last_node is not None:
            self.dec_lock_ref(req.last_node)
        req.last_node = node
        p = req.cache_protected_len
        new_indices = self._path_values(node)
        self.req_to_token_pool.req_to_token[req.req_pool_idx, p:n] = new_indices[p:n].to(torch.int32)
        req.prefix_indices = new_indices
        req.cache_protected_len = n

    def release_req(self, req: CacheReq) -> None:
        """Abort / admission rejection / retraction without caching: frees every slot the
        request holds (KV above ``cache_protected_len``, working, COW and checkpoint SSM
        slots, its row) and its lock. Same as ``cache_finished_req(req, insert=False)``."""
        self.cache_finished_req(req, insert=False)

    def execute_deferred_cow(self, reqs: Iterable[CacheReq]) -> int:
        """Run the pending copy-on-write copies at forward start (seed §3.2, §4.1 step 3①);
        see ``HybridReqToTokenPool.execute_deferred_cow``. Returns the number copied."""
        return self.req_to_token_pool.execute_deferred_cow(reqs)

    def evict(self, num_tokens: int = 0, mamba_num: int = 0) -> EvictResult:
        """Free at least ``mamba_num`` SSM states and ``num_tokens`` KV tokens if possible,
        least recently used first (seed §3.3).

        SSM eviction tombstones internal nodes and removes leaves whole (a leaf may not be a
        tombstone); KV eviction removes unlocked leaves (with their state, if any). Either
        may then remove ancestors that became tombstone leaves.

        Returns:
            :class:`EvictResult` with what was freed (possibly more or less than asked).
        """
        res = EvictResult()
        if mamba_num > 0:
            self._evict_mamba(mamba_num, res)
        if num_tokens > res.num_tokens_evicted:
            self._evict_full(num_tokens, res)
        self.evicted_tokens_total += res.num_tokens_evicted
        self.evicted_states_total += res.mamba_num_evicted
        return res

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` (SSM) and its root path (KV) against eviction (seed §7.3)."""
        if node is self.root_node:
            return
        if node.mamba_lock_ref == 0 and node.mamba_value is not None:
            self._mamba_evictable -= 1
            self._mamba_protected += 1
        node.mamba_lock_ref += 1
        root = self.root_node
        while node is not root:
            if node.full_lock_ref == 0:
                k = len(node.key)
                self._full_evictable -= k
                self._full_protected += k
            node.full_lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Release one :meth:`inc_lock_ref` of ``node``.

        Raises:
            RuntimeError: if ``node`` is not locked (an unbalanced release).
        """
        if node is self.root_node:
            return
        if node.mamba_lock_ref <= 0 or node.full_lock_ref <= 0:
            raise RuntimeError(f"dec_lock_ref on an unlocked node {node!r}")
        node.mamba_lock_ref -= 1
        if node.mamba_lock_ref == 0 and node.mamba_value is not None:
            self._mamba_protected -= 1
            self._mamba_evictable += 1
        start = node
        root = self.root_node
        while node is not root:
            node.full_lock_ref -= 1
            if node.full_lock_ref == 0:
                k = len(node.key)
                self._full_protected -= k
                self._full_evictable += k
            node = node.parent
        # A tombstone locked directly may have lost its children meanwhile.
        if start.mamba_value is None and not start.children and start.full_lock_ref == 0 and not start.removed:
            self._delete_leaf(start, EvictResult())

    def full_evictable_size(self) -> int:
        """KV tokens in unlocked nodes."""
        return self._full_evictable

    def full_protected_size(self) -> int:
        """KV tokens in locked nodes."""
        return self._full_protected

    def mamba_evictable_size(self) -> int:
        """SSM states (slots) in unlocked nodes."""
        return self._mamba_evictable

    def mamba_protected_size(self) -> int:
        """SSM states (slots) in locked nodes."""
        return self._mamba_protected

    def path_device_indices(self, node: TreeNode) -> torch.Tensor:
        """int64 KV slots of the tokens from the root to the end of ``node``."""
        return self._path_values(node)

    def all_values_flatten(self) -> torch.Tensor:
        """int64 KV slots of every node (leak diagnostics; O(tree size))."""
        vals = [n.value for n in self._nodes()]
        return torch.cat(vals) if vals else _EMPTY

    def all_mamba_values_flatten(self) -> torch.Tensor:
        """int64 SSM slots held by the tree (leak diagnostics; O(tree size))."""
        return torch.tensor(
            [n.mamba_value for n in self._nodes() if n.mamba_value is not None], dtype=torch.int64
        )

    def _nodes(self) -> List[TreeNode]:
        out: List[TreeNode] = []
        stack = [self.root_node]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                out.append(child)
                stack.append(child)
        return out

    def total_size(self) -> int:
        """KV tokens in the tree."""
        return self._full_evictable + self._full_protected

    def mamba_total_size(self) -> int:
        """SSM states in the tree."""
        return self._mamba_evictable + self._mamba_protected

    def alloc_kv(self, num_tokens: int) -> Optional[torch.Tensor]:
        """Allocate KV slots, evicting unlocked KV first if the pool is short (the
        scheduler's evict-if-short rule). ``None`` if still short."""
        alloc = self.token_to_kv_pool_allocator
        short = num_tokens - alloc.available_size()
        if short > 0:
            self.evict(num_tokens=short)
        return alloc.alloc(num_tokens)

    # ================================================================ checks / debug
    def sanity_check(self) -> None:
        """Check every invariant of DESIGN.md that the tree can see; raise AssertionError
        on the first broken one. O(tree size)."""
        root = self.root_node
        assert root.full_lock_ref == 1 and root.mamba_lock_ref == 1, "root must hold both locks"
        assert root.mamba_value is None and not root.key
        fe = fp = me = mp = 0
        kv_seen: List[torch.Tensor] = []
        mamba_seen = set()
        n_nodes = 0
        n_mamba = 0
        stack = [root]
        while stack:
            node = stack.pop()
            for ck, child in node.children.items():
                assert child.parent is node, f"{child!r} has a wrong parent"
                assert child.seq_len == node.seq_len + len(child.key), f"{child!r} has a wrong seq_len"
                assert not child.removed, f"removed node {child!r} still in the tree"
                assert len(child.key) > 0, f"{child!r} has an empty key"
                assert len(child.key) % self.page_size == 0, f"{child!r} key not page aligned"
                assert child.value.numel() == len(child.key), f"{child!r} key/value length mismatch"
                assert ck == self._child_key(child.key, 0, child.extra_key), (
                    f"{child!r} is registered under a stale key {ck!r}"
                )
                assert child.extra_key == node.extra_key or node is root, "namespace changes below root"
                assert child.full_lock_ref >= 0 and child.mamba_lock_ref >= 0, f"negative lock {child!r}"
                assert child.mamba_lock_ref == 0 or child.full_lock_ref > 0, (
                    f"{child!r}: mamba_lock_ref > 0 requires full_lock_ref > 0"
                )
                assert node is root or node.full_lock_ref >= child.full_lock_ref, (
                    f"{child!r} holds more KV locks than its parent"
                )
                if not child.children:
                    assert child.mamba_value is not None or child.full_lock_ref > 0, (
                        f"leaf {child!r} is a tombstone"
                    )
                assert child.full_link.linked, f"{child!r} missing from the KV LRU list"
                if child.mamba_value is not None:
                    assert child.mamba_link.linked, f"{child!r} missing from the SSM LRU list"
                    assert child.mamba_value not in mamba_seen, f"SSM slot {child.mamba_value} in two nodes"
                    assert not self.mamba_pool.is_free(child.mamba_value), (
                        f"SSM slot {child.mamba_value} of {child!r} is on the free list"
                    )
                    mamba_seen.add(child.mamba_value)
                    n_mamba += 1
                    if child.mamba_lock_ref > 0:
                        mp += 1
                    else:
                        me += 1
                else:
                    assert not child.mamba_link.linked, f"tombstone {child!r} in the SSM LRU list"
                if child.full_lock_ref > 0:
                    fp += len(child.key)
                else:
                    fe += len(child.key)
                kv_seen.append(child.value)
                n_nodes += 1
                stack.append(child)
        assert (fe, fp) == (self._full_evictable, self._full_protected), (
            f"KV counters {(self._full_evictable, self._full_protected)} != tree {(fe, fp)}"
        )
        assert (me, mp) == (self._mamba_evictable, self._mamba_protected), (
            f"SSM counters {(self._mamba_evictable, self._mamba_protected)} != tree {(me, mp)}"
        )
        assert len(self.full_lru_list) == n_nodes, "KV LRU list size != node count"
        assert len(self.mamba_lru_list) == n_mamba, "SSM LRU list size != state count"
        if kv_seen:
            allkv = torch.cat(kv_seen)
            assert torch.unique(allkv).numel() == allkv.numel(), "a KV slot is in two nodes"
        # Recency: every node is at least as recent as its descendants in the KV list.
        seen = set()
        for link in self.full_lru_list:
            node = link.owner
            assert node.parent is root or node.parent.id in seen, (
                f"{node!r} is more recent than its parent in the KV LRU list"
            )
            seen.add(node.id)

    def check_slot_accounting(self, live_reqs: Sequence[CacheReq] = ()) -> None:
        """Exact slot-level leak check: every KV and SSM slot is in exactly one place — the
        free list, the tree, or a live request (``live_reqs``). At an idle point (no live
        requests) this is ``free + evictable + protected == size`` for both pools.

        Raises:
            AssertionError: naming the lost or doubly owned slots.
        """
        kv = self.token_to_kv_pool_allocator
        places: List[torch.Tensor] = [kv.free_slots()]
        stack = [self.root_node]
        tree_mamba: List[int] = []
        while stack:
            node = stack.pop()
            for child in node.children.values():
                places.append(child.value)
                if child.mamba_value is not None:
                    tree_mamba.append(child.mamba_value)
                stack.append(child)
        req_mamba: List[int] = []
        for r in live_reqs:
            if r.req_pool_idx is not None and r.kv_allocated_len > r.cache_protected_len:
                own = self.req_to_token_pool.req_to_token[r.req_pool_idx, r.cache_protected_len : r.kv_allocated_len]
                places.append(own.to(torch.int64))
            if r.mamba_pool_idx is not None:
                req_mamba.append(r.mamba_pool_idx)
            req_mamba.extend(s for s in r.mamba_ping_pong_track_buffer if s >= 0)
            req_mamba.extend(slot for _, slot in r.mamba_prefix_checkpoints)
        allkv = torch.cat(places)
        if self.page_size > 1:
            allkv = torch.unique(allkv // self.page_size)
            total = kv.size // self.page_size
        else:
            total = kv.size
        uniq = torch.unique(allkv)
        assert uniq.numel() == allkv.numel() or self.page_size > 1, (
            f"{allkv.numel() - uniq.numel()} KV slots are owned twice"
        )
        assert uniq.numel() == total, f"KV slots lost: {total - uniq.numel()} of {total} not accounted for"
        mamba_all = self.mamba_pool.free_slots() + tree_mamba + req_mamba
        assert len(mamba_all) == len(set(mamba_all)), "an SSM slot is owned twice"
        assert len(mamba_all) == self.mamba_pool.size, (
            f"SSM slots lost: {self.mamba_pool.size - len(mamba_all)} of {self.mamba_pool.size}"
        )

    def pretty_print(self) -> str:
        """The tree as indented text (also printed)."""
        lines: List[str] = []

        def visit(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                head = child.key[:4]
                more = "..." if len(child.key) > 4 else ""
                lines.append(
                    f"{'  ' * depth}[{len(child.key)} tok {head}{more}] kv={child.value[:3].tolist()}"
                    f"{'...' if child.value.numel() > 3 else ''} ssm={child.mamba_value} "
                    f"lock=({child.full_lock_ref},{child.mamba_lock_ref})"
                )
                visit(child, depth + 1)

        visit(self.root_node, 0)
        lines.append(
            f"kv evictable={self._full_evictable} protected={self._full_protected} | "
            f"ssm evictable={self._mamba_evictable} protected={self._mamba_protected}"
        )
        text = "\n".join(lines)
        print(text)
        return text

    # ================================================================ internals
    @staticmethod
    def _split_key(key: KeyLike) -> Tuple[List[int], Optional[str]]:
        if isinstance(key, RadixKey):
            return key.token_ids, key.extra_key
        return (key if isinstance(key, list) else list(key)), None

    def _child_key(self, tokens: List[int], pos: int, extra_key: Optional[str]):
        if self.page_size == 1:
            first = tokens[pos]
        else:
            first = tuple(tokens[pos : pos + self.page_size])
        return first if extra_key is None else (extra_key, first)

    def _step(self, node: TreeNode, tokens: List[int], pos: int, end: int, extra_key):
        """One step of a walk: the child of ``node`` that continues ``tokens[pos:end]`` and
        how many tokens of it match, splitting it when the match ends inside it:
        ``(child, matched, whole_child_matched)``, or ``None`` when nothing matches."""
        child = node.children.get(self._child_key(tokens, pos, extra_key))
        if child is None:
            return None
        m = self._match_len(child.key, tokens, pos, end)
        if m == 0:
            return None
        full = m == len(child.key)
        if not full:
            child = self._split_node(child, m)
        return child, m, full

    def _match_len(self, node_key: List[int], tokens: List[int], pos: int, end: int) -> int:
        """Tokens (whole pages) of ``node_key`` equal to ``tokens[pos:end]``'s start.
        Compares slices (C speed) and bisects for the first mismatch: no per-token loop."""
        k = len(node_key)
        n = min(k, end - pos)
        if n == k:
            if tokens[pos : pos + k] == node_key:
                return k
        elif node_key[:n] == tokens[pos : pos + n]:
            return n - n % self.page_size
        lo, hi = 0, n  # node_key[:lo] matches; the first mismatch is in [lo, hi)
        while hi - lo > 8:
            mid = (lo + hi) >> 1
            if node_key[lo:mid] == tokens[pos + lo : pos + mid]:
                lo = mid
            else:
                hi = mid
        while lo < hi and node_key[lo] == tokens[pos + lo]:
            lo += 1
        return lo - lo % self.page_size

    def _split_node(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens; return the new parent, which has no SSM state
        (seed §6.4) and the child's KV lock count."""
        parent = child.parent
        new = TreeNode(child.key[:m], child.value[:m], parent, child.extra_key)
        new.full_lock_ref = child.full_lock_ref
        new.last_access_time = child.last_access_time
        parent.children[self._child_key(new.key, 0, new.extra_key)] = new
        child.key = child.key[m:]
        child.value = child.value[m:]
        child.parent = new
        new.children[self._child_key(child.key, 0, child.extra_key)] = child
        # A split is an access through the old node: both halves become recent (the new
        # parent just ahead of the child, so parents stay more recent than children).
        self._clock += 1
        child.last_access_time = self._clock
        self.full_lru_list.push_front(child.full_link)
        self.full_lru_list.insert_before(new.full_link, child.full_link)
        return new

    def _touch_path(self, node: TreeNode) -> None:
        """Mark ``node`` and its ancestors used now, deepest first, so that every node stays
        at least as recent as its descendants in the KV LRU list."""
        self._clock += 1
        now = self._clock
        root = self.root_node
        push = self.full_lru_list.push_front
        while node is not root:
            node.last_access_time = now
            push(node.full_link)
            node = node.parent

    def _path_values(self, node: TreeNode) -> torch.Tensor:
        vals = []
        root = self.root_node
        while node is not root:
            vals.append(node.value)
            node = node.parent
        if not vals:
            return _EMPTY
        if len(vals) == 1:
            return vals[0]
        vals.reverse()
        return torch.cat(vals)

    def _walk_start(self, req: CacheReq, n: int) -> TreeNode:
        """Where an insert of the request's first ``n`` tokens may start walking: its locked
        ``last_node`` (its whole path is in the tree and cannot be evicted) if that lies
        within the key, else the root."""
        node = req.last_node
        if node is None or node.seq_len > n:
            return self.root_node
        if node.seq_len != req.cache_protected_len:
            raise RuntimeError(
                f"request {req.rid!r}: locked node ends at {node.seq_len}, "
                f"cache_protected_len is {req.cache_protected_len}"
            )
        return node

    def _set_state(self, node: TreeNode, slot: int) -> None:
        node.mamba_value = slot
        if node.mamba_lock_ref > 0:
            self._mamba_protected += 1
        else:
            self._mamba_evictable += 1
        self._touch_state(node)

    def _drop_state(self, node: TreeNode) -> None:
        """Tombstone ``node``: free its SSM slot (caller checked it is unlocked)."""
        self.mamba_pool.free([node.mamba_value])
        node.mamba_value = None
        self._mamba_evictable -= 1
        self.mamba_lru_list.remove(node.mamba_link)

    def _delete_leaf(self, node: TreeNode, res: EvictResult) -> None:
        """Remove an unlocked leaf with its KV and state, then every ancestor that became an
        unlocked tombstone leaf."""
        root = self.root_node
        kv_free = self.token_to_kv_pool_allocator.free
        while True:
            parent = node.parent
            if node.mamba_value is not None:
                self._drop_state(node)
                res.mamba_num_evicted += 1
            kv_free(node.value)
            k = len(node.key)
            self._full_evictable -= k
            res.num_tokens_evicted += k
            self.full_lru_list.remove(node.full_link)
            del parent.children[self._child_key(node.key, 0, node.extra_key)]
            node.removed = True
            if parent is root or parent.children or parent.mamba_value is not None or parent.full_lock_ref > 0:
                return
            node = parent

    def _evict_mamba(self, num: int, res: EvictResult) -> None:
        if self.eviction_policy == "recompute":
            target = res.mamba_num_evicted + num
            while res.mamba_num_evicted < target:
                node = self._recompute_victim(leaf_only=False)
                if node is None:
                    return
                if node.children:
                    self._drop_state(node)
                    res.mamba_num_evicted += 1
                else:
                    self._delete_leaf(node, res)
            return
        lru = self.mamba_lru_list
        link = lru.lru()
        target = res.mamba_num_evicted + num
        while link is not None and res.mamba_num_evicted < target:
            node = link.owner
            nxt = lru.step_toward_head(link)
            if node.mamba_lock_ref == 0:
                if node.children:
                    self._drop_state(node)
                    res.mamba_num_evicted += 1
                elif node.full_lock_ref == 0:
                    self._delete_leaf(node, res)
            link = nxt if nxt is None or nxt.linked else lru.step_toward_head(nxt)

    def _evict_full(self, num_tokens: int, res: EvictResult) -> None:
        if self.eviction_policy == "recompute":
            while res.num_tokens_evicted < num_tokens:
                node = self._recompute_victim(leaf_only=True)
                if node is None:
                    break
                self._delete_leaf(node, res)
            if res.num_tokens_evicted >= num_tokens:
                return
            # Only locked or stateless leaves are left: fall through to the LRU scan.
        lru = self.full_lru_list
        link = lru.lru()
        while link is not None and res.num_tokens_evicted < num_tokens:
            node = link.owner
            nxt = lru.step_toward_head(link)
            if not node.children and node.full_lock_ref == 0:
                self._delete_leaf(node, res)
            link = nxt if nxt is None or nxt.linked else lru.step_toward_head(nxt)

    def _touch_state(self, node: TreeNode) -> None:
        """A state was stored or used: most recent in the SSM LRU list; under the
        recompute policy its priority is refreshed (see :meth:`_recompute_victim`)."""
        self.mamba_lru_list.push_front(node.mamba_link)
        if self.eviction_policy == "recompute":
            node.hits += 1
            node.priority = self._inflation + node.hits * self._recompute_per_byte(node)

    def _recompute_per_byte(self, node: TreeNode) -> float:
        """Tokens of recompute the state of ``node`` saves, per SSM slot's worth of bytes.

        ``saved = node.seq_len - a``, ``a`` the end of the deepest ancestor holding a state:
        without this state a request reaching ``node`` falls back to ``a`` (seed §6.4) and
        recomputes the difference. The bytes are one SSM slot, plus the node's KV
        (``kv_bytes_per_token`` per token) when the node is a leaf, whose eviction frees
        both."""
        root = self.root_node
        anc = node.parent
        while anc is not root and anc.mamba_value is None:
            anc = anc.parent
        size = 1.0
        if not node.children and self.kv_bytes_per_token:
            size += self.kv_bytes_per_token * len(node.key) / (self.mamba_pool.slot_bytes() or 1)
        return (node.seq_len - anc.seq_len) / size

    def _recompute_victim(self, leaf_only: bool) -> Optional[TreeNode]:
        """The state to evict under ``eviction_policy="recompute"``: GreedyDual-Size-
        Frequency (Cherkasova, HP Labs TR HPL-98-69, 1998, after Cao & Irani's GreedyDual-
        Size, USITS 1997) with the cost of a miss taken as tokens of recompute:

            priority(n) = L + hits(n) * saved(n) / bytes(n)

        set whenever ``n``'s state is stored or used; ``L`` (the inflation value) is the
        priority of the last victim, so entries not used since age relative to new ones —
        recency blended with recompute saved per byte (:meth:`_recompute_per_byte`), the
        utility idea of Marconi (Pan et al., MLSys 2025, §4.2), without a tuned weight.

        Candidates: unlocked nodes holding a state; with ``leaf_only`` (KV eviction) only
        leaves whose KV is unlocked. The lowest priority goes (ties: the least recently
        used). O(states) per victim; the SSM pool is small.
        """
        best = None
        for link in self.mamba_lru_list:
            node = link.owner
            if node.mamba_lock_ref:
                continue
            leaf = not node.children
            if (leaf_only and not leaf) or (leaf and node.full_lock_ref):
                continue
            if best is None or node.priority <= best.priority:
                best = node
        if best is not None:
            self._inflation = best.priority
        return best

    def _alloc_mamba_slot(self, protect: Optional[TreeNode] = None) -> Optional[int]:
        """One SSM slot, evicting one unlocked state if the pool is empty (``protect`` is
        locked meanwhile so the eviction cannot take it). ``None`` if none can be freed."""
        pool = self.mamba_pool
        got = pool.alloc_list(1)
        if got is None:
            if protect is not None:
                self.inc_lock_ref(protect)
            self.evict(mamba_num=1)
            if protect is not None:
                self.dec_lock_ref(protect)
            got = pool.alloc_list(1)
            if got is None:
                return None
        return got[0]

    def _finish_state(self, req: CacheReq, up_to: Optional[int] = None) -> Tuple[int, Optional[int]]:
        """(tokens, slot) of the state :meth:`insert_finished_req` inserts: the working
        slot if it holds exactly ``up_to`` tokens, else the newest checkpoint not past
        ``up_to``; ``(0, None)`` if neither."""
        done = req.kv_committed_len
        limit = done if up_to is None else min(up_to, len(req.token_ids))
        if (
            self.finish_state == "working"
            and done == limit
            and done > 0
            and done % self.page_size == 0
            and req.mamba_pool_idx is not None
            and req.mamba_cow_src_index is None
            and not req.mamba_needs_clear
        ):
            return done, req.mamba_pool_idx
        c = req.mamba_last_track_seqlen
        slot = req.last_track_slot()
        if c is not None and slot is not None and 0 < c <= min(done, limit):
            return c, slot
        return 0, None
