"""Which SSM states a request leaves in the tree besides its ping-pong checkpoints, and
which of them the tree keeps (``docs/design.md``, "Prefix checkpoints" and "Ping-pong
checkpoints"): planning extra checkpoints for a prefill (at the branch point a match
reports, at prompt length - 1 and at message boundaries the request names), committing
them once the forward has written them, the per-path cap ``max_states_per_path``, and the
choice of the state a finished request donates (``finish_state``); also how an insert of a
request's prefix is adopted by the request (lock moved, ``req_to_token`` pointed at the
tree's KV). :class:`PrefixCheckpoints`
is mixed into :class:`~.radix_cache.MambaRadixCache` and uses its tree operations.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .req import CacheReq
from .tree_node import InsertResult, TreeNode

#: What a finished request donates to the tree (``MambaRadixCache(finish_state=...)``).
FINISH_STATES = ("working", "checkpoint", "overlap")


class PrefixCheckpoints:
    """Prefix-checkpoint planning and committing, the per-path cap and the finish state of
    :class:`~.radix_cache.MambaRadixCache` (module docstring)."""

    def plan_prefix_checkpoints(
        self,
        req: CacheReq,
        prompt_len: int,
        branching_seqlen: Optional[int] = None,
        boundaries: Sequence[int] = (),
    ) -> List[Tuple[int, int]]:
        """Plan the extra SSM checkpoints this request's prefill saves (Marconi-style
        admission; ``docs/design.md``, "Prefix checkpoints"), after ``match_prefix``, the
        lock and the row allocation:

        - at ``branching_seqlen`` (``MatchResult.mamba_branching_seqlen``): the KV of the
          prompt is cached deeper than any usable state — where sequences branch, e.g. at
          the end of a shared system prompt. A state saved there serves every later request
          that shares the prefix;
        - at ``prompt_len - 1``: the state before the last prompt token, so a resent
          identical prompt (whose match is capped at ``len - 1``) hits all but one token;
        - at each of ``boundaries`` (tokens; message boundaries of a chat request, or the
          offsets a ``/generate`` request names), in the order given, as long as the
          per-path cap leaves room (:meth:`_boundary_budget`): where a later request that
          shares the messages so far will branch, so the *first* request passing a
          boundary already saves the state there.

        Priority: the branch point, then prompt length - 1, then the boundaries in their
        order; each position takes an SSM slot now (evicting one state if the pool is
        full, and then only if the eviction policy ranks the new state above its victim:
        ``admits``; a position it does not is skipped), and planning stops at the first
        position without a slot. Positions are
        floored to whole pages and kept only inside ``(cache_protected_len, prompt_len)``;
        duplicates are planned once (under the first kind that names them). The forward
        writes the states (``HybridReqToTokenPool.prefix_checkpoints_in``);
        :meth:`checkpoint` inserts them; :meth:`on_release` frees unused ones. Nothing is
        planned unless the cache was built with ``branch_checkpoints=True``.

        Returns:
            the planned ``(seqlen, slot)`` pairs (also stored, sorted, on
            ``req.mamba_prefix_checkpoints``).
        """
        if not self.branch_checkpoints:
            return []
        ps = self.page_size
        p = req.cache_protected_len
        wanted = {}  # seqlen -> origin, in priority order
        candidates = []
        if branching_seqlen is not None:
            candidates.append((branching_seqlen, "branch"))
        candidates.append((prompt_len - 1, "prompt_end"))
        for c, origin in candidates:
            c -= c % ps
            if p < c < prompt_len:
                wanted.setdefault(c, origin)
        budget = self._boundary_budget(req, len(wanted))
        for c in boundaries:
            if budget <= 0:
                break
            c = int(c)
            c -= c % ps
            if p < c < prompt_len and c not in wanted:
                wanted[c] = "boundary"
                budget -= 1
        planned: List[Tuple[int, int]] = []
        for c, origin in wanted.items():
            if not self.mamba_pool.available_size():
                # a full pool: evict only for a state worth more than the victim
                below = max([p] + [d for d, _ in planned if d < c])
                if not self._eviction.admits((origin, below > 0), c - below):
                    continue
            slot = self._alloc_mamba_slot()
            if slot is None:
                break
            planned.append((c, slot))
            self._prefix_origin[slot] = origin
        req.mamba_prefix_checkpoints = sorted(planned + req.mamba_prefix_checkpoints)
        return planned

    def drop_planned_prefix_checkpoints(self, req: CacheReq) -> int:
        """Free the request's planned prefix checkpoints without inserting them: nothing will
        write them (a PD decode-side request, whose prompt no forward of this server runs;
        ``plugin/pd_decode.py``). Returns how many were dropped."""
        cps = req.mamba_prefix_checkpoints
        if not cps:
            return 0
        slots = [slot for _, slot in cps]
        for slot in slots:
            self._prefix_origin.pop(slot, None)
        self.mamba_pool.free(slots)
        req.mamba_prefix_checkpoints = []
        return len(slots)

    def planned_origin(self, slot: int) -> Optional[str]:
        """Kind (``"branch"``, ``"prompt_end"``, ``"boundary"``) of the planned prefix
        checkpoint holding SSM slot ``slot``; ``None`` for another slot."""
        return self._prefix_origin.get(slot)

    def _boundary_budget(self, req: CacheReq, planned: int) -> int:
        """How many boundary checkpoints a request may plan under ``max_states_per_path``
        (unbounded when 0): the cap less the states already on its matched path
        (``req.last_node`` to the root), less the ``planned`` branch-point / prompt - 1
        checkpoints, less one for the state it leaves when it finishes. Within that
        budget the per-path cap (:meth:`_enforce_path_cap`, which drops the shallowest
        states first) has nothing to drop when the request's own states go in; states
        SGLang's ``--mamba-track-interval`` tracking inserts in a long prefill still count
        against the cap as before."""
        cap = self.max_states_per_path
        if cap <= 0:
            return 1 << 30
        on_path = 0
        node = req.last_node
        root = self.root_node
        while node is not None and node is not root:
            if node.mamba_value is not None:
                on_path += 1
            node = node.parent
        return cap - on_path - planned - 1

    # ------------------------------------------------------------------ helpers
    def releases_track_slots(self) -> bool:
        """Whether a running request gives its ping-pong slots back after its prefill
        (:meth:`_checkpoint_running`): ``release_track_slots`` set, single-token pages and a
        finish that donates the working state. Where the backend also writes planned
        prefix checkpoints, the adapter admits a request without ping-pong slots
        (``CacheReq.mamba_track_slots_wanted``): the prefill's states come from the plan,
        the finish state from the working slot (``docs/design.md``, "Ping-pong
        release")."""
        return bool(self.release_track_slots and self.page_size == 1
                    and self.finish_state in ("working", "overlap"))

    def _checkpoint_running(self, req: CacheReq, up_to: Optional[int], prefill_done: bool = False) -> None:
        """:meth:`checkpoint` of a running request: planned prefix checkpoints, then the
        newest ping-pong checkpoint (or, untracked, a copy of the working state).

        After the prefill (``prefill_done``), when the finish will donate the working state
        (``finish_state`` ``"working"`` / ``"overlap"``), ``release_track_slots`` is set and
        pages are single tokens (with larger pages an unaligned finish falls back to a decode
        checkpoint), the ping-pong slots are freed (entries ``-1``): decode never inserts
        their checkpoints, so a decoding request holds one SSM slot instead of three."""
        release_tracking = prefill_done and self.releases_track_slots()
        self._insert_running(req, up_to, release_tracking)
        if release_tracking:
            self.req_to_token_pool.release_track_slots(req)

    def _insert_running(self, req: CacheReq, up_to: Optional[int], release_tracking: bool) -> None:
        """The inserts of :meth:`_checkpoint_running`; a donated ping-pong entry gets no
        fresh slot when ``release_tracking``. A request holding no ping-pong slot (admitted
        without, ``CacheReq.mamba_track_slots_wanted``, or released) inserts no state here:
        its prefill's states are the planned checkpoints, and a scheduler-side copy of the
        working state could race the forward under overlap scheduling (which is why the
        adapter keeps the slots for a prompt it expects to be chunked)."""
        if req.req_pool_idx is None:
            raise ValueError(f"checkpoint: request {req.rid!r} has no req_pool_idx")
        limit = req.kv_committed_len if up_to is None else min(up_to, req.kv_committed_len)
        self._commit_prefix_checkpoints(req, limit)
        p = req.cache_protected_len
        pool = self.req_to_token_pool
        tracked = pool.track_slots_per_req > 0
        if tracked:
            n = req.mamba_last_track_seqlen
            slot = req.last_track_slot()
            # A state names a node only at a whole number of pages (issue 11).
            if n is None or slot is None or n <= p or n > limit or n % self.page_size:
                return
            entry = 1 - req.mamba_next_track_idx
        else:
            # The working state is the state after ``limit`` tokens: it can only go into
            # a node ending there, so only when that is a page end (flooring the key
            # would pair a shorter key with a longer sequence's state).
            n = limit
            if n <= p or n % self.page_size:
                return
            if self.mamba_ckpt_pool is not None:
                # quantized straight from the working slot, which the request keeps
                self._adopt_prefix(req, n, req.mamba_pool_idx, "chunk", keep_active=True)
                return
            slot = self._alloc_mamba_slot()
            if slot is None:
                return
            self.mamba_pool.copy_from([req.mamba_pool_idx], [slot])
        res = self._adopt_prefix(req, n, slot, "ping_pong" if tracked else "chunk")
        if tracked:
            if not res.mamba_exist:
                fresh = None if release_tracking else self._alloc_mamba_slot()
                pool.replace_track_slot(req, entry, -1 if fresh is None else fresh)
                req.mamba_last_track_seqlen = None
        elif res.mamba_exist:
            self.mamba_pool.free([slot])

    def _checkpoint_finished(self, req: CacheReq, up_to: Optional[int]) -> None:
        """:meth:`checkpoint` of a finished request: planned prefix checkpoints, then the
        final state (:meth:`_finish_state`); every SSM slot the tree did not take is freed."""
        pool = self.req_to_token_pool
        if req.req_pool_idx is None:
            pool.free_mamba_slots(req)
            return
        done = req.kv_committed_len
        self._commit_prefix_checkpoints(req, done if up_to is None else min(up_to, done))
        n, slot = self._finish_state(req, done if up_to is None else min(up_to, len(req.token_ids)))
        donated = None
        if n > 0 and not self._adopt_prefix(req, n, slot, "finish").mamba_exist:
            donated = slot
        pool.free_mamba_slots(req, keep_slot=donated)

    def _commit_prefix_checkpoints(self, req: CacheReq, limit: int) -> None:
        """Insert every planned checkpoint at or below ``limit`` tokens (the forward has
        written it), in order; free the slot where the tree already had a state."""
        cps = req.mamba_prefix_checkpoints
        if not cps:
            return
        keep = []
        for c, slot in cps:
            if c > limit:
                keep.append((c, slot))
                continue
            res = self._adopt_prefix(req, c, slot, self._prefix_origin.pop(slot, "branch"))
            if res.mamba_exist:
                self.mamba_pool.free([slot])
        req.mamba_prefix_checkpoints = keep

    def _enforce_path_cap(self, node: TreeNode) -> None:
        """Drop the shallowest surplus states on ``node``'s root path beyond
        ``max_states_per_path``; ``node`` itself, forks (nodes with several children) and
        locked nodes keep theirs (``docs/design.md``, "Prefix checkpoints")."""
        surplus = 1 - self.max_states_per_path
        path = []
        anc = node.parent
        root = self.root_node
        while anc is not root:
            if anc.mamba_value is not None:
                path.append(anc)
            anc = anc.parent
        surplus += len(path)
        for anc in reversed(path):  # shallowest first
            if surplus <= 0:
                return
            if anc.mamba_lock_ref == 0 and len(anc.children) == 1:
                self._drop_state(anc)
                surplus -= 1

    def _finish_state(self, req: CacheReq, limit: int) -> Tuple[int, Optional[int]]:
        """``(tokens, slot)`` of the state a finished request donates, at most ``limit``
        tokens (and at most ``mamba_working_len`` when that is given): the working slot if it
        holds exactly that many tokens (``kv_committed_len``, or ``mamba_working_len``; a whole number of
        pages, no copy-on-write or clear pending) under ``finish_state="working"`` or
        ``"overlap"``, else
        the newest ping-pong checkpoint not past ``limit`` if it ends on a page boundary,
        else (``"working"`` only: no overlap scheduling) the older one still held in the other entry;
        ``(0, None)`` if neither (``docs/design.md``, "Ping-pong checkpoints"). The KV
        past the returned length stays the caller's, which frees it with the row."""
        done = req.kv_committed_len
        working = done
        if req.mamba_working_len is not None:
            # the deferred verify replayed the request to exactly this many tokens; nothing
            # past it (a ping-pong checkpoint included) is known to be written
            working = req.mamba_working_len
            limit = min(limit, working)
        if (
            self.finish_state != "checkpoint"
            and working == limit
            and 0 < working <= done
            and working % self.page_size == 0
            and req.mamba_pool_idx is not None
            and req.mamba_cow_src_index is None
            and not req.mamba_needs_clear
        ):
            return working, req.mamba_pool_idx
        ps = self.page_size
        c = req.mamba_last_track_seqlen
        slot = req.last_track_slot()
        if c is not None and slot is not None and 0 < c <= min(done, limit) and c % ps == 0:
            return c, slot
        # A stop before the newest checkpoint (``limit`` below it): the older checkpoint
        # still sits in the other entry, as SGLang's finish falls back to it. Only
        # without overlap scheduling (``"working"``), where no forward of this request is
        # in flight to overwrite that entry.
        c = req.mamba_prev_track_seqlen
        buf = req.mamba_ping_pong_track_buffer
        if self.finish_state == "working" and c is not None and buf and 0 < c <= min(done, limit) and c % ps == 0:
            slot = buf[req.mamba_next_track_idx]
            if slot >= 0:
                return c, slot
        return 0, None

    def _adopt_prefix(
        self, req: CacheReq, n: int, slot: int, origin: str = "insert", keep_active: bool = False
    ) -> InsertResult:
        """Insert the request's first ``n`` tokens with SSM slot ``slot`` (the state after
        them; ``origin`` as in ``stats.STATE_ORIGINS``). When ``n`` passes ``cache_protected_len``, the request's lock moves to the
        node ending at ``n``, ``req_to_token[row, p:n]`` is pointed at the tree's KV slots
        and ``cache_protected_len`` becomes ``n``. The caller still owns ``slot`` when the
        result says ``mamba_exist`` (or ``keep_active``: with int8 checkpoints the tree
        stores a quantized copy and the caller keeps the slot). With int8 checkpoints and no
        checkpoint slot to be had (every stored state locked) nothing is inserted and the
        result says ``mamba_exist``.

        Raises:
            ValueError: ``n`` is not a whole number of pages (the caller must floor a
                length only together with a state taken at the floored length)."""
        if n % self.page_size:
            raise ValueError(f"request {req.rid!r}: a state at {n} tokens is not on a page boundary (page_size {self.page_size})")
        pool = self.req_to_token_pool
        row = req.req_pool_idx
        p = req.cache_protected_len
        start = self._walk_start(req, n)
        if not self._state_room():
            return InsertResult(p, True, req.last_node)
        kv = pool.req_to_token[row, :n].to(torch.int64)
        res = self._insert(req.token_ids[:n], req.extra_key, kv, slot, p, start, origin, keep_active)
        if n > p:
            node = res.last_node
            # Lock the new node before anything can evict (a replacement slot may).
            self.inc_lock_ref(node)
            if req.last_node is not None:
                self.dec_lock_ref(req.last_node)
            req.last_node = node
            new_indices = self._path_values(node)
            pool.req_to_token[row, p:n] = new_indices[p:n].to(torch.int32)
            req.prefix_indices = new_indices
            req.cache_protected_len = n
        return res

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
