"""The hybrid radix tree (``docs/design.md``, "Tree and match"): a radix tree over token
ids whose nodes hold attention-KV slot indices and at most one SSM-state slot, with the one
request lifecycle SGLang 0.5.23's scheduler drives — :meth:`MambaRadixCache.checkpoint`
after prefill chunks, completed prefills and finished requests, and
:meth:`MambaRadixCache.on_release` when a request lets go. A match stops at the deepest
node holding a state (KV beyond it is of no use to a hybrid model); a hit gets its own SSM
slot by copy-on-write; locks pin a node's state and its root path's KV; eviction removes
states and KV leaves independently (policies in :mod:`.eviction`). Prefix-checkpoint
planning, the per-path cap and the finish state are in :mod:`.prefix_checkpoints`; the
invariant checks in :mod:`.invariants` (run through :mod:`.tree_queries`, with the size
queries); the locks in :mod:`.tree_locks`; per-node slot bookkeeping in :mod:`.node_slots`; the counters in :mod:`.stats`; int8 checkpoints and the host tier in
:mod:`.state_tiers`; sessions' pins in :mod:`.session_pins`.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple, Union

import torch

from .eviction import PriorityEviction, VictimPriority, make_eviction_policy
from .lru import LRUList
from .node_slots import NodeSlots
from .prefix_checkpoints import FINISH_STATES, PrefixCheckpoints
from .state_tiers import HOST_WRITE_POLICIES, StateTiers  # noqa: F401  (re-exported)
from .req import CacheReq
from .req_to_token_pool import HybridReqToTokenPool
from .session_pins import SessionPins
from .storage_tier import StorageTier
from .tree_locks import TreeLocks
from .tree_queries import TreeQueries
from .stats import CacheCounters, CacheStats
from .tree_node import EMPTY_INDICES, EvictResult, InsertResult, KeyLike, MatchResult, TreeNode, drop_removed_tail, match_len, split_key


class MambaRadixCache(PrefixCheckpoints, StateTiers, StorageTier, SessionPins, TreeLocks, TreeQueries, CacheCounters,
                      NodeSlots):
    """Hybrid prefix cache: attention KV + SSM state per node (``docs/design.md``).

    Args:
        kv_allocator: KV slot allocator (``alloc(n)``, ``free(idx)``, ``available_size()``):
            :class:`~sglang_mamba_ext.mem_cache.allocator.KVSlotAllocator` or SGLang's
            ``TokenToKVPoolAllocator``.
        req_to_token_pool: the hybrid request pool; its ``mamba_pool`` is the SSM pool, its
            ``mamba_ckpt_pool`` / ``mamba_host_pool`` / ``kv_host_pool`` the tiers (or ``None``).
        page_size: tokens per KV page (>= 1). Keys are matched and stored in whole pages.
        mamba_track_interval: tokens between ping-pong checkpoints (a multiple of
            ``page_size``).
        finish_state: which state a finished request donates (:meth:`checkpoint`):
            ``"working"`` (its working slot, exact at the sequence end; safe when no
            forward can still be writing it, i.e. without overlap scheduling),
            ``"checkpoint"`` (its newest ping-pong checkpoint) or ``"overlap"`` (as
            ``"working"``, but never the older ping-pong entry, which a step of the
            request still in flight may rewrite; ``docs/design.md``, "Overlap scheduling").
        branch_checkpoints: save extra SSM checkpoints during prefill where they pay off
            (:meth:`plan_prefix_checkpoints`).
        max_states_per_path: at most this many SSM states on any root-to-node path
            (SGLang's ``--mamba-max-states-per-path``; 0 or negative: no bound, stored as
            0). After an insert places a state, the shallowest surplus states on its path
            are dropped (tombstoned, KV kept) — never the new state, a fork or a locked one.
        eviction_policy: ``"lru"`` or ``"recompute"`` (:mod:`.eviction`).
        kv_bytes_per_token: bytes of one token's KV over all attention layers, so the
            recompute policy can weigh KV freed by removing a leaf (0: SSM bytes only).
        hicache_write_policy: when a state gets its host-tier copy, if the request pool has
            a ``mamba_host_pool`` (``docs/design.md``, "Host tier"): ``"write_through"``
            (when it enters the tree), ``"write_through_selective"`` (when a request first
            resumes from it; an evicted state without a copy is dropped) or
            ``"write_back"`` (when the device tier evicts it).

    Raises:
        ValueError: on a bad ``page_size``, ``mamba_track_interval``, ``finish_state`` or
            ``eviction_policy``, or ``hicache_write_policy``.
    """

    #: Observer of tree changes, ``event_sink(kind, node, other=None)`` (``docs/design.md``,
    #: "KV events"), or ``None``: no calls. Kinds: ``"stored"`` (a new node, KV and state),
    #: ``"split"`` (``node`` is the new upper part of ``other``), ``"state_stored"``,
    #: ``"state_dropped"``, ``"removed"`` (``node`` left the tree), ``"reset"`` (node None).
    event_sink = None

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
        hicache_write_policy: str = "write_through",
    ):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if mamba_track_interval < page_size or mamba_track_interval % page_size:
            raise ValueError(
                f"mamba_track_interval ({mamba_track_interval}) must be a positive multiple of "
                f"page_size ({page_size}); pass --mamba-track-interval as a multiple of --page-size"
            )
        if finish_state not in FINISH_STATES:
            raise ValueError(f"finish_state must be one of {', '.join(FINISH_STATES)}, got {finish_state!r}")
        self._use_policy(make_eviction_policy(eviction_policy, self))
        self.token_to_kv_pool_allocator = kv_allocator
        self.req_to_token_pool = req_to_token_pool
        self.mamba_pool = req_to_token_pool.mamba_pool
        self._init_state_tiers(req_to_token_pool, hicache_write_policy)
        self._init_storage_tier()  # attach_storage gives it a store
        self.page_size = page_size
        self.mamba_track_interval = mamba_track_interval
        self.finish_state = finish_state
        self.release_track_slots = True  #: ping-pong slots back after the prefill (_checkpoint_running)
        self.branch_checkpoints = branch_checkpoints
        self.max_states_per_path = max(int(max_states_per_path), 0)
        self.eviction_policy = eviction_policy
        self.kv_bytes_per_token = kv_bytes_per_token
        self.device = getattr(kv_allocator, "device", torch.device("cpu"))
        #: Totals since construction (every eviction, including those the cache runs
        #: itself to allocate a slot and the tombstone leaves an unlock removes): KV
        #: tokens, SSM states.
        self.evicted_tokens_total = 0
        self.evicted_states_total = 0
        #: Match and state counters since construction (:mod:`.stats`).
        self.stats = CacheStats()
        #: Origin (``"branch"`` / ``"prompt_end"`` / ``"boundary"``) of each planned prefix checkpoint, by
        #: its SSM slot, until it is inserted (stale entries are overwritten, never read).
        self._prefix_origin = {}
        self.reset()

    # ================================================================ public protocol
    def reset(self) -> None:
        """Empty the tree (does not touch slots held outside it)."""
        self.root_node = TreeNode([], EMPTY_INDICES, None)
        self.root_node.full_lock_ref = 1
        self.root_node.mamba_lock_ref = 1
        self.full_lru_list = LRUList()
        #: Nodes whose KV is in the host tier only (the host KV pool's recency list; their
        #: ``full_link`` is here instead of in ``full_lru_list``).
        self.host_kv_lru_list = LRUList()
        self.mamba_lru_list = LRUList()
        self.host_lru_list = LRUList()
        self._eviction.reset()
        self._clock = 0
        self._full_evictable = 0
        self._full_protected = 0
        self._mamba_evictable = 0
        self._mamba_protected = 0
        #: Open sessions' pins (``--enable-session-radix-cache``, :mod:`.session_pins`).
        self._session_pins = {}
        if self.event_sink is not None:
            self.event_sink("reset", None)

    def match_prefix(self, key: KeyLike, *, cow_mamba: bool = False, req: Optional[CacheReq] = None) -> MatchResult:
        """Longest cached prefix of ``key`` that is usable by a hybrid model
        (``docs/design.md``, "Tree and match").

        The usable prefix ends at the deepest matched node holding an SSM state: KV beyond
        it is never returned. A match ending inside a node splits it. The key is truncated
        to whole pages. Matched nodes are touched in the KV LRU, the used state in the SSM
        LRU.

        With ``cow_mamba`` and a non-empty usable prefix, the request gets copy-on-write
        (``docs/design.md``, "Copy-on-write"): an SSM slot is allocated now (evicting one
        state if the pool is full; ``None`` if that fails — ``HybridReqToTokenPool.alloc``
        then allocates it) and the tree's slot is recorded as the source; the copy runs at
        forward start. With ``req`` given, ``req.mamba_pool_idx`` /
        ``req.mamba_cow_src_index`` are set too.
        """
        tokens, extra_key = split_key(key)
        n = len(tokens)
        if self.page_size > 1:
            n -= n % self.page_size
        root = self.root_node
        path, pos = self._walk(root, tokens, 0, n, extra_key)
        best = len(path)
        while best and not path[best - 1].has_state:
            best -= 1
        if cow_mamba and self.storage is not None and self._fetch_from_storage(
            tokens, extra_key, n, path[best - 1].seq_len if best else 0, pos
        ):  # docs/design.md, "Storage tier": read back into the host tier, loaded below
            path, pos = self._walk(root, tokens, 0, n, extra_key)
            best = len(path)
            while best and not path[best - 1].has_state:
                best -= 1
        if best and path[best - 1].value is None:
            # KV in the host tier (docs/design.md, "Host tier"): a copy-on-write match loads
            # it back now; any other match stops above it
            first = best - 1
            while first and path[first - 1].value is None:
                first -= 1
            if not (cow_mamba and self._load_kv(path[first:best])):
                best = first
                while best and not path[best - 1].has_state:
                    best -= 1
            pos = drop_removed_tail(path, pos)
        host_slot = None
        if cow_mamba and best and path[best - 1].mamba_value is None:
            # the deepest state is in the host tier only: loaded into the request's own
            # slot now, or, without a slot, the deepest device state serves instead
            host_slot = self._load_from_host(path[best - 1], req)
            if host_slot is None:
                while best and path[best - 1].mamba_value is None:
                    best -= 1
            pos = drop_removed_tail(path, pos)
        best_node = path[best - 1] if best else root
        last = path[-1] if path else root
        self._touch_path(last)
        if best == 0:
            device_indices = EMPTY_INDICES
        else:
            # A hit counts once per request: its first copy-on-write match (a repeated
            # match of a waiting request reuses its slot; sorting matches copy nothing).
            hit = cow_mamba and (req is None or req.mamba_pool_idx is None)
            self._touch_state(best_node, "hit" if hit else "touched")
            device_indices = best_node.value if best == 1 else torch.cat([c.value for c in path[:best]])

        result = MatchResult(device_indices, best_node, kv_match_len=pos, kv_last_node=last)
        if cow_mamba and best and host_slot is not None:
            result.mamba_pool_idx = host_slot
            if req is not None:
                req.mamba_pool_idx = host_slot
                req.mamba_cow_src_index = None
                req.mamba_needs_clear = False
        elif cow_mamba and best:
            result.mamba_cow_src_index = best_node.mamba_value
            if req is None or req.mamba_pool_idx is None:
                result.mamba_pool_idx = self._alloc_mamba_slot(protect=best_node)
                if path[-1].removed:
                    result.kv_match_len = drop_removed_tail(path, pos)
                    result.kv_last_node = path[-1]
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
        origin: str = "insert",
    ) -> InsertResult:
        """Insert ``key`` with its KV slots ``value`` and the state after its last token.

        Ownership (``docs/design.md``, "Tree and match"): the tree takes the KV slots it
        lacked. Slots of ``value[prev_prefix_len:]`` that duplicate tree content are freed
        here; ``value[:prev_prefix_len]`` is the part the caller already had from the tree
        and is never freed. The tree takes ``mamba_value`` only if the node ending at the
        key's end had no state (``mamba_exist`` False); otherwise the caller keeps (and
        frees) it.

        Args:
            key: token ids, a multiple of ``page_size`` long.
            value: int64 ``[len(key)]`` KV slots.
            mamba_value: SSM slot (int or 1-element tensor) holding the state after the key.
            prev_prefix_len: tokens at the start of ``value`` that are tree-owned already.
            origin: where the state comes from (``stats.STATE_ORIGINS``), for the metrics.

        Raises:
            ValueError: on a key not page aligned, a length mismatch, or new tokens without
                ``mamba_value`` (that would make a tombstone leaf).
            RuntimeError: with int8 checkpoints, no checkpoint slot can be freed for the
                state (every stored state is locked).
        """
        tokens, extra_key = split_key(key)
        n = len(tokens)
        if n % self.page_size:
            raise ValueError(f"insert: key length {n} is not a multiple of page_size {self.page_size}")
        if value.numel() != n:
            raise ValueError(f"insert: {value.numel()} KV slots for a key of {n} tokens")
        if isinstance(mamba_value, torch.Tensor):
            mamba_value = int(mamba_value.reshape(-1)[0])
        if mamba_value is not None and not self._state_room():
            raise RuntimeError(
                "insert: the int8 checkpoint pool is full and holds no unlocked state; "
                "raise --int8-mamba-ckpt-size"
            )
        return self._insert(tokens, extra_key, value, mamba_value, prev_prefix_len, self.root_node, origin)

    def checkpoint(self, req: CacheReq, up_to: Optional[int] = None, finished=False, prefill_done=False) -> int:
        """Hand the tree what the request has computed of its first ``up_to`` tokens
        (default and cap: ``req.kv_committed_len``); SGLang's ``checkpoint(req, up_to)``
        (``docs/design.md``, "Ping-pong checkpoints", "Prefix checkpoints").

        First the planned prefix checkpoints the forward has passed are inserted. Then,
        for a running request (after a prefill chunk or a completed prefill), its sequence
        up to its newest ping-pong checkpoint is inserted with that checkpoint's slot, and
        the donated entry gets a fresh slot (``-1`` if the pool has none even after
        evicting one state); without ping-pong tracking (``track_slots_per_req == 0``) the
        working state is copied into a fresh slot instead, when ``up_to`` is a page end. For
        a ``finished`` request its sequence goes in with its final state (see
        ``finish_state``; the key is cut at the state's length, at most ``up_to`` and
        ``len(req.token_ids)``), and every SSM slot the tree did not take is freed. A state
        goes in only at a whole number of pages (SGLang's ``cache_finished_req`` floors to
        the page); nothing is inserted for one that is not, and the KV past the inserted
        length stays the caller's, freed with the row.

        ``prefill_done`` (the prompt has now run in full) may give the request's ping-pong
        slots back after the insert (``_checkpoint_running``; ``docs/design.md``, "Ping-pong
        checkpoints").

        Each insert frees the request's KV slots that duplicate the tree's, writes the
        tree's indices back into ``req_to_token``, moves the request's lock to the new
        node and advances ``cache_protected_len``. KV slots at and above it, the row and
        the lock stay the caller's.

        Returns:
            ``req.cache_protected_len`` (tokens the tree now owns for the request).

        Raises:
            ValueError: a running request without a row.
        """
        if finished:
            self._checkpoint_finished(req, up_to)
        else:
            self._checkpoint_running(req, up_to, prefill_done)
        return req.cache_protected_len

    def on_release(self, req: CacheReq) -> None:
        """The request lets go (finished after :meth:`checkpoint`, aborted, retracted or
        rejected at admission): free every SSM slot it still holds — working,
        copy-on-write, ping-pong and planned prefix checkpoints — and clear its SSM
        fields. Its KV slots, row and lock are the caller's (SGLang's ``release_kv_cache``
        frees them before calling ``on_release``). Idempotent."""
        self.req_to_token_pool.free_mamba_slots(req)

    def evict(self, num_tokens: int = 0, mamba_num: int = 0) -> EvictResult:
        """Free at least ``mamba_num`` SSM states and ``num_tokens`` KV tokens if possible,
        in the order of the eviction policy (``docs/design.md``, "Eviction").

        SSM eviction tombstones inner nodes and removes leaves whole (a leaf may not be a
        tombstone); KV eviction removes unlocked leaves (with their state, if any). Either
        may then remove ancestors that became tombstone leaves.

        Open sessions' pinned states and their paths' KV go last (:mod:`.session_pins`).

        Returns:
            :class:`EvictResult` with what was freed (possibly more or less than asked).
        """
        res = EvictResult()
        self._evict_sessions_last(num_tokens, mamba_num, res)
        self._count_evicted(res)
        return res

    def set_victim_priority(self, priority: Optional[VictimPriority]) -> None:
        """Choose eviction victims by ``priority(candidates, for_kv)``, lowest first
        (:class:`~.eviction.PriorityEviction`), instead of the policy named at construction;
        ``None`` goes back to that policy (a fresh instance). For offline studies (the
        hit-rate benchmark's oracle); a server never calls it."""
        if priority is None:
            self._use_policy(make_eviction_policy(self.eviction_policy, self))
        else:
            self._use_policy(PriorityEviction(self, priority))

    def _use_policy(self, policy) -> None:
        self._eviction = policy
        self._state_used = policy.state_used
        self._evict_mamba = policy.evict_mamba
        self._evict_full = policy.evict_full

    # ================================================================ tree helpers
    def _child_key(self, tokens: List[int], pos: int, extra_key: Optional[str]):
        if self.page_size == 1:
            first = tokens[pos]
        else:
            first = tuple(tokens[pos : pos + self.page_size])
        return first if extra_key is None else (extra_key, first)

    def _walk(self, node: TreeNode, tokens: List[int], pos: int, end: int, extra_key) -> Tuple[List[TreeNode], int]:
        """Follow ``tokens[pos:end]`` down from ``node`` (which ends at ``pos``): the nodes
        passed (the last one split when the match ends inside it) and where the match
        ends."""
        path: List[TreeNode] = []
        child_key = self._child_key
        page_size = self.page_size
        while pos < end:
            child = node.children.get(child_key(tokens, pos, extra_key))
            if child is None:
                break
            m = match_len(child.key, tokens, pos, end, page_size)
            if m == 0:
                break
            pos += m
            if m < len(child.key):
                path.append(self._split_node(child, m))
                break
            path.append(child)
            node = child
        return path, pos

    def _insert(
        self,
        tokens: List[int],
        extra_key: Optional[str],
        value: torch.Tensor,
        mamba_value: Optional[int],
        prev_prefix_len: int,
        node: TreeNode,
        origin: str = "insert",
        keep_active: bool = False,
    ) -> InsertResult:
        """:meth:`insert` starting the walk at ``node`` (a node on the key's path, e.g. the
        request's locked ``last_node``), which skips re-comparing the locked prefix. With
        int8 checkpoints a taken state is quantized into a checkpoint slot (one must be free:
        :meth:`_state_room`) and its active slot freed, unless ``keep_active`` (the caller
        keeps it either way)."""
        n = len(tokens)
        start = node.seq_len
        path, pos = self._walk(node, tokens, start, n, extra_key)
        if path:
            # The walked nodes cover value[start:pos] back to back: the caller's duplicates
            # of them (past prev_prefix_len) are one contiguous range, freed in one call.
            # Host-only nodes (a tail of the path) take the caller's slots instead.
            dev_end = pos
            if path[-1].value is None:
                at = pos
                for walked in reversed(path):
                    if walked.value is not None:
                        break
                    k = len(walked.key)
                    self._adopt_kv(walked, value[at - k : at])
                    at -= k
                dev_end = at
            lo = max(prev_prefix_len, start)
            if lo < dev_end:
                self.token_to_kv_pool_allocator.free(value[lo:dev_end])
            node = path[-1]
        prefix_len = pos
        if pos < n:
            if mamba_value is None:
                raise ValueError("insert: new tokens without mamba_value would leave a leaf without SSM state")
            new = TreeNode(tokens[pos:], value[pos:], node, extra_key)
            node.children[self._child_key(new.key, 0, extra_key)] = new
            new.mamba_value = self._stored_slot(mamba_value, keep_active)
            new.mamba_origin = origin
            self._full_evictable += n - pos
            self._mamba_evictable += 1
            self._touch_state(new, "stored")
            if self.event_sink is not None:
                self.event_sink("stored", new)
            node = new
            mamba_exist = False
        elif mamba_value is not None and node is not self.root_node and node.mamba_value is None:
            node.mamba_origin = origin
            self._set_state(node, self._stored_slot(mamba_value, keep_active))
            mamba_exist = False
        else:
            mamba_exist = True
        if not mamba_exist:
            self.stats.states_stored[origin] += 1
            if self.mamba_host_pool is not None and self.hicache_write_policy == "write_through":
                self._backup(node)
        if not mamba_exist and self.max_states_per_path > 0:
            self._enforce_path_cap(node)
        self._touch_path(node)
        return InsertResult(prefix_len, mamba_exist, node)

    def _split_node(self, child: TreeNode, m: int) -> TreeNode:
        """Split ``child`` after ``m`` tokens; return the new parent, which has no SSM state
        and the child's KV lock count (``docs/design.md``, "Tree and match")."""
        parent = child.parent
        if child.value is None:  # host-only KV: both halves stay on the host
            new = TreeNode(child.key[:m], None, parent, child.extra_key)
            new.host_value = child.host_value[:m]
            child.host_value = child.host_value[m:]
        else:
            new = TreeNode(child.key[:m], child.value[:m], parent, child.extra_key)
            child.value = child.value[m:]
        new.full_lock_ref = child.full_lock_ref
        new.last_access_time = child.last_access_time
        parent.children[self._child_key(new.key, 0, new.extra_key)] = new
        child.key = child.key[m:]
        child.parent = new
        new.children[self._child_key(child.key, 0, child.extra_key)] = child
        # A split is an access through the old node: both halves become recent (the new
        # parent just ahead of the child, so parents stay more recent than children).
        self._clock += 1
        child.last_access_time = self._clock
        lru = self.full_lru_list if child.value is not None else self.host_kv_lru_list
        lru.push_front(child.full_link)
        lru.insert_before(new.full_link, child.full_link)
        if self.event_sink is not None:
            self.event_sink("split", new, child)
        return new
