"""The hybrid request pool SGLang 0.5.23 builds under ``--enable-mamba-radix``.

:class:`MambaRadixReqToTokenPool` subclasses SGLang's ``HybridReqToTokenPool``
(``mem_cache/memory_pool.py``), so every ``isinstance`` gate (deferred COW in
``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear``, ``ensure_mamba_capacity``, the
linear-attention backends) keeps working, and keeps SGLang's ``MambaPool`` (the state tensors
the backends index). The bookkeeping — rows, working SSM slots, ping-pong checkpoint slots,
the free lists — is the core's (:class:`sglang_mamba_ext.mem_cache.HybridReqToTokenPool` over
the same ``req_to_token`` and mapping tensors, :class:`sglang_mamba_ext.mem_cache.MambaPool`
over the same state tensors); ``mamba_allocator`` is a facade over the core's free list with
SGLang's ``MambaSlotAllocator`` API (``mem_cache/allocator/mamba.py``). One free list per
resource, owned by the core.

Built by the AROUND hook on ``KVCacheConfigurator._build_hybrid_req_pool`` (see
:func:`build_hybrid_req_pool_around`), which lets SGLang compute the constructor arguments.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Dict, List, Optional, Tuple

import torch

from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

from sglang_mamba_ext.mem_cache import HybridReqToTokenPool as CoreReqToTokenPool
from sglang_mamba_ext.mem_cache import MambaPool as CoreMambaPool
from sglang_mamba_ext.mem_cache.mamba_pool import SlotPool as CoreSlotPool
from sglang_mamba_ext.plugin import chat_boundaries, replayssm, req_bridge

logger = logging.getLogger(__name__)

#: Ping-pong entries per request when tracking: 1 working + 2 checkpoint slots
#: (``docs/design.md``, "Ping-pong checkpoints").
TRACK_SLOTS = 2


class SGLangStateMambaPool(CoreMambaPool):
    """The core's slot bookkeeping over SGLang's ``MambaPool`` tensors.

    ``conv_state`` / ``temporal_state`` are SGLang's ``mamba_cache.conv[0]`` /
    ``mamba_cache.temporal`` (``[L, size + 1, ...]``; slot 0 is the padding slot in both).
    State copies and clears go through SGLang's ``MambaPool.copy_from`` / ``clear_slots``,
    which also cover extra conv tensors and side states a model may register.
    """

    #: SGLang's ReplaySSM decode ring is on (``--enable-linear-replayssm``)
    _replayssm = False

    def __init__(self, sglang_mamba_pool, size: int):
        cache = sglang_mamba_pool.mamba_cache
        conv = cache.conv[0]
        temporal = cache.temporal
        super().__init__(
            size,
            conv.shape[0],
            tuple(conv.shape[2:]),
            tuple(temporal.shape[2:]),
            dtype=temporal.dtype,
            conv_dtype=conv.dtype,
            device=conv.device,
            conv_state=conv,
            temporal_state=temporal,
        )
        self.sglang_mamba_pool = sglang_mamba_pool
        self._replayssm = replayssm.decode_ring(sglang_mamba_pool) is not None

    def state_tensors(self):
        """SGLang's state tensors of a slot: every conv tensor and the temporal state, then the
        side states a model registers on the pool (:func:`_slot_sibling_tensors`), so the host
        and storage tiers, which copy these, carry them too."""
        cache = self.sglang_mamba_pool.mamba_cache
        return [*cache.conv, cache.temporal, *_slot_sibling_tensors(self.sglang_mamba_pool)]

    def alloc_list(self, need_size: int):
        """The core's allocation; under ``--enable-linear-replayssm`` each slot handed out
        starts with an empty decode ring (``plugin/replayssm.py``)."""
        slots = super().alloc_list(need_size)
        if slots and self._replayssm:
            replayssm.reset_cursor(self.sglang_mamba_pool, slots)
        return slots

    def copy_from(self, src_slots, dst_slots) -> None:
        src = torch.as_tensor(src_slots, dtype=torch.int64, device=self.device).reshape(-1)
        dst = torch.as_tensor(dst_slots, dtype=torch.int64, device=self.device).reshape(-1)
        if src.numel() != dst.numel():
            raise ValueError(f"copy_from: {src.numel()} sources for {dst.numel()} destinations")
        if src.numel():
            self.sglang_mamba_pool.copy_from(src, dst)

    def clear(self, slots) -> None:
        idx = torch.as_tensor(slots, dtype=torch.int64, device=self.device).reshape(-1)
        if idx.numel():
            self.sglang_mamba_pool.clear_slots(idx)


class SGLangCheckpointPool(CoreSlotPool):
    """The core's checkpoint-pool protocol (:class:`sglang_mamba_ext.mem_cache.Int8CheckpointPool`:
    a free list plus ``store_from_active`` / ``load_to_active``) over SGLang's int8
    ``MambaCheckpointPool`` (``mem_cache/mamba_checkpoint_pool.py``, built by SGLang's
    ``HybridReqToTokenPool`` under ``--enable-int8-mamba-checkpoint``; ``--int8-mamba-ckpt-size``
    slots, default twice the active pool). SGLang's tensors and (de)quantization are used
    as they are, so ``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear`` dequantizes a
    hit's source straight from them; the free list is the core's, and SGLang's pool's
    ``allocator`` is replaced by a facade over it (its invariant check and ``clear`` read the
    same list)."""

    def __init__(self, sglang_ckpt_pool):
        self.sglang_ckpt_pool = sglang_ckpt_pool
        self.size = int(sglang_ckpt_pool.num_slots)
        self.device = torch.device(sglang_ckpt_pool.device)
        self._slot_bytes = sglang_ckpt_pool.mem_usage_bytes() // (self.size + 1)  # read per state use
        self.clear_all()
        sglang_ckpt_pool.allocator = MambaSlotAllocatorFacade(self)

    def slot_bytes(self) -> int:
        """Bytes of one stored state (int8 data, scales, conv windows), all layers."""
        return self._slot_bytes

    def state_tensors(self):
        """SGLang's tensors of a stored state, each ``[L, size + 1, ...]``: every conv window
        (its dtype), the int8 ``qdata`` and the ``scale`` (what the host tier copies)."""
        ckpt = self.sglang_ckpt_pool
        return [*ckpt.conv, ckpt.temporal.qdata, ckpt.temporal.scale]

    def store_from_active(self, active: "SGLangStateMambaPool", active_slots, ckpt_slots) -> None:
        self.sglang_ckpt_pool.store_from_active(active.sglang_mamba_pool, _index(active_slots, self.device), _index(ckpt_slots, self.device))

    def load_to_active(self, active: "SGLangStateMambaPool", ckpt_slots, active_slots) -> None:
        self.sglang_ckpt_pool.load_to_active(active.sglang_mamba_pool, _index(ckpt_slots, self.device), _index(active_slots, self.device))


def _slot_sibling_tensors(sglang_mamba_pool) -> List[torch.Tensor]:
    """The tensors of the per-slot side states registered on SGLang's ``MambaPool``
    (``register_slot_state``, ``mem_cache/memory_pool.py:516-519``; its own ``copy_from`` /
    ``clear_slots`` / host copies carry them), each as ``[L, size + 1, ...]`` like the conv and
    temporal tensors: Qwen4-Exp's PLE short-conv windows (``ShortConvPool.conv_state``
    ``[PLE layers, size + 1, C, W]``) and n-gram history (``NGramPool.context`` ``[size + 1, K]``,
    as a view with a leading axis of 1), ``mem_cache/ple_state_pool.py``. A sibling of another
    kind is refused: the host tier would drop it."""
    out = []
    for sibling in getattr(sglang_mamba_pool, "_slot_siblings", ()):
        if getattr(sibling, "conv_state", None) is not None:
            out.append(sibling.conv_state)
        elif getattr(sibling, "context", None) is not None:
            out.append(sibling.context.unsqueeze(0))
        else:
            raise ValueError(f"sglang-mamba-ext: unknown per-slot side state {type(sibling).__name__} on "
                             "SGLang's MambaPool (its host and storage copies would drop it)")
    return out


def _index(slots, device) -> torch.Tensor:
    return torch.as_tensor(slots, dtype=torch.int64, device=device).reshape(-1)


class MambaSlotAllocatorFacade:
    """SGLang's ``MambaSlotAllocator`` API over the core pool's free list.

    ``alloc(n)`` returns an int64 tensor ``[n]`` of slots or ``None``; ``free(t)`` takes a
    tensor of slots; sizes are in slots. ``alloc_group_begin/end`` (SGLang pre-takes slots
    for the copy-on-write allocations of one scheduling round) are no-ops: the core's
    allocation is a Python list pop, so there is nothing to amortize.
    """

    def __init__(self, core_pool: CoreSlotPool, owner: Optional["MambaRadixReqToTokenPool"] = None):
        self._pool = core_pool
        self._owner = owner
        self.size = core_pool.size
        self.device = core_pool.device

    def _reclaimable(self) -> int:
        return self._owner.reclaimable_prefix_checkpoints() if self._owner is not None else 0

    def available_size(self) -> int:
        """Free slots, counting the slots of planned prefix checkpoints (given up on
        demand by :meth:`alloc`)."""
        return self._pool.available_size() + self._reclaimable()

    def schedulable_available_size(self) -> int:
        """Slots free right now. SGLang's ``ensure_mamba_capacity``
        (``mem_cache/allocation.py``) evicts the tree for the shortfall below this, so the
        slots of planned prefix checkpoints are not counted: cold tree states go first,
        and the adapter's ``evict`` gives planned checkpoints back only when the tree has
        no state left to evict (issue 11)."""
        return self._pool.available_size()

    def alloc_group_begin(self, num_reqs: int) -> None:
        return None

    def alloc_group_end(self) -> None:
        return None

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        short = need_size - self._pool.available_size()
        if short > 0 and self._owner is not None:
            self._owner.make_mamba_room(short)
        return self._pool.alloc(need_size)

    def free(self, free_index: torch.Tensor) -> None:
        if free_index is None or free_index.numel() == 0:
            return
        self._pool.free(free_index)

    @property
    def free_slots(self) -> torch.Tensor:
        return torch.tensor(self._pool.free_slots(), dtype=torch.int64, device=self.device)

    def clear(self) -> None:
        self._pool.clear_all()


class MambaRadixReqToTokenPool(HybridReqToTokenPool):
    """SGLang's hybrid request pool with the core's bookkeeping (module docstring).

    Takes exactly ``HybridReqToTokenPool``'s keyword arguments. With
    ``enable_mamba_extra_buffer`` every request gets two ping-pong checkpoint slots (with or
    without overlap scheduling); otherwise none (SGLang's ``no_buffer``).

    Raises:
        ValueError: for pool features the core does not implement
            (``--mamba-radix-cache-strategy extra_buffer_lazy``).
    """

    def __init__(self, **kwargs):
        unsupported = {
            "enable_mamba_extra_buffer_lazy": "--mamba-radix-cache-strategy extra_buffer_lazy",
        }
        for key, flag in unsupported.items():
            if kwargs.get(key):
                raise ValueError(f"--enable-mamba-radix does not support {flag}; drop one of them")
        super().__init__(**kwargs)
        #: The core's view of SGLang's int8 checkpoint pool (``--enable-int8-mamba-checkpoint``),
        #: where the tree keeps its states; ``None`` without the flag.
        self.core_ckpt_pool = (
            SGLangCheckpointPool(self.mamba_ckpt_pool) if self.mamba_ckpt_pool is not None else None
        )
        tracking = bool(self.enable_mamba_extra_buffer)
        self.mamba_ping_pong_track_buffer_size = TRACK_SLOTS
        self.mamba_initial_tracking_slots = TRACK_SLOTS if tracking else 0  # the setter below
        ping_pong_map = None
        if tracking:
            # SGLang sizes this map with 1 column without overlap scheduling; the core
            # always keeps two checkpoints (docs/design.md, "Ping-pong checkpoints"), so
            # rebuild it with two.
            ping_pong_map = torch.zeros(
                (self.req_to_token.shape[0], TRACK_SLOTS), dtype=torch.int64, device=self.device
            )
            self.req_index_to_mamba_ping_pong_track_buffer_mapping = ping_pong_map
        self.core_mamba_pool = SGLangStateMambaPool(self.mamba_pool, kwargs["mamba_size"])
        self.core = CoreReqToTokenPool(
            self.size,
            self.max_context_len,
            self.core_mamba_pool,
            track_slots_per_req=TRACK_SLOTS if tracking else 0,
            device=self.device,
            req_to_token=self.req_to_token,
            req_index_to_mamba_index_mapping=self.req_index_to_mamba_index_mapping,
            req_index_to_mamba_ping_pong_track_buffer_mapping=ping_pong_map,
            mamba_ckpt_pool=self.core_ckpt_pool,
        )
        self.mamba_allocator = MambaSlotAllocatorFacade(self.core_mamba_pool, self)
        #: row -> planned ``(seqlen, slot)`` prefix checkpoints not yet in the tree
        #: (``MambaRadixCache.plan_prefix_checkpoints``); the slots are the request's.
        self.prefix_checkpoints: Dict[int, List[Tuple[int, int]]] = {}
        #: Set by a linear-attention backend that writes a state at any token position
        #: (the tiny model's torch backend; SGLang's KDA / GDN backends through
        #: ``plugin/inchunk_checkpoints.py``); other backends write only their checkpoint
        #: grid, so without it no prefix checkpoint is planned.
        self.prefix_checkpoint_writer = False
        #: The tree cache planning the checkpoints (set by ``MambaRadixCacheAdapter``).
        self.tree_cache = None
        #: ``(req_generation, numpy view of it)`` for :meth:`_rows_taken`.
        self._req_generation_view = None

    # -- ping-pong slots -----------------------------------------------------------------
    @property
    def mamba_initial_tracking_slots(self) -> int:
        """Ping-pong slots :meth:`alloc` gives a fresh request (SGLang's
        ``ensure_mamba_capacity`` evicts for them): the strategy's two, or none when
        :meth:`tracking_replaced`."""
        slots = self.__dict__.get("_initial_tracking_slots", 0)
        return 0 if slots and self.tracking_replaced() else slots

    @mamba_initial_tracking_slots.setter
    def mamba_initial_tracking_slots(self, value: int) -> None:
        self.__dict__["_initial_tracking_slots"] = value

    def tracking_replaced(self) -> bool:
        """Whether a running request needs no ping-pong slot: the backend writes planned
        prefix checkpoints (:attr:`prefix_checkpoint_writer`), the tree cache plans them,
        and the finish donates the working state with single-token pages
        (``MambaRadixCache.releases_track_slots``). Its slots would hold only the prefill's
        grid-tracked state, which the planned prompt-end checkpoint shadows, and would be
        freed after the prefill anyway (``docs/design.md``, "Ping-pong release")."""
        cache = self.__dict__.get("tree_cache")
        return bool(self.__dict__.get("prefix_checkpoint_writer") and cache is not None
                    and cache.core.branch_checkpoints and cache.core.releases_track_slots())

    def _drop_unneeded_track_slots(self, reqs, creqs) -> None:
        """Admit without ping-pong slots (:meth:`tracking_replaced`) every request whose
        prompt fits one prefill chunk (``--chunked-prefill-size``). A prompt expected to be
        chunked keeps them: its forward writes each chunk end's state into a ping-pong slot,
        which SGLang's stash of the chunk inserts (a scheduler-side copy of the working state
        there could race the chunk's forward under overlap scheduling)."""
        from sglang.srt.runtime_context import get_server_args

        chunk = getattr(get_server_args(), "chunked_prefill_size", None)
        for r, c in zip(reqs, creqs):
            fill = getattr(r, "full_untruncated_fill_ids", None)
            new = (len(fill) if fill is not None else len(r.origin_input_ids)) - int(getattr(r, "prefix_len", 0) or 0)
            c.mamba_track_slots_wanted = chunk is not None and 0 < chunk < new

    # -- rows: the core's free list ---------------------------------------------------
    @property
    def free_slots(self) -> List[int]:
        """Free rows (a copy of the core's list; SGLang's leak check reads its length)."""
        return self.core.free_row_ids()

    @free_slots.setter
    def free_slots(self, value) -> None:
        # ReqToTokenPool.__init__ assigns the initial list before the core exists.
        if "core" in self.__dict__:
            raise AttributeError(
                "MambaRadixReqToTokenPool: rows are owned by the core pool; use alloc/free"
            )

    def available_size(self) -> int:
        return self.core.available_size()

    def _rows_taken(self, rows: List[int]) -> None:
        if rows:
            gen = self.req_generation
            view = getattr(self, "_req_generation_view", None)
            if view is None or view[0] is not gen:
                # SGLang keeps the counters in a CPU int64 tensor; a numpy view of it
                # bumps a row without a tensor indexing call (same memory, same values).
                view = (gen, gen.numpy() if gen.device.type == "cpu" else None)
                self._req_generation_view = view
            counters = view[1]
            if counters is None:
                gen[rows] += 1
            else:
                for row in rows:
                    counters[row] += 1
            if self._on_alloc_rows is not None:
                self._on_alloc_rows(rows)

    def alloc_rows(self, need_size: int) -> Optional[List[int]]:
        rows = self.core.alloc_rows(need_size)
        if rows is not None:
            self._rows_taken(rows)
        return rows

    def free_rows(self, indices: List[int]) -> None:
        from sglang_mamba_ext.plugin.speculative.hooks import free_rows_before

        free_rows_before(self, indices)  # deferred speculative records of these rows
        if self._aux_cache is not None:
            for index in indices:
                self._aux_cache.free(index)
        self._drop_prefix_checkpoints(indices)
        self.core.free_rows(indices)

    def reclaimable_prefix_checkpoints(self) -> int:
        """SSM slots held by planned (not yet written) prefix checkpoints."""
        return sum(len(v) for v in self.prefix_checkpoints.values())

    def reclaim_prefix_checkpoints(self, num: int) -> int:
        """Give up to ``num`` planned prefix checkpoints back to the SSM pool (message
        boundaries first, deepest first, then the others deepest first: a prompt-end
        checkpoint before a branch point) so that a request's own slots never wait for an
        optional checkpoint. Safe with overlap scheduling too: a forward in flight read its
        plan at launch, and a freed slot's next owner first writes it in a later forward
        (``docs/design.md``, "Overlap scheduling"). Returns slots freed."""
        freed: List[int] = []
        core = self.tree_cache.core if self.tree_cache is not None else None
        while len(freed) < num and self.prefix_checkpoints:
            # (is a boundary, seqlen, row, index): the largest goes first
            _, _, row, i = max(
                (core is not None and core.planned_origin(slot) == "boundary", c, r, j)
                for r, planned in self.prefix_checkpoints.items()
                for j, (c, slot) in enumerate(planned)
            )
            planned = self.prefix_checkpoints[row]
            freed.append(planned.pop(i)[1])
            if not planned:
                del self.prefix_checkpoints[row]
        if freed:
            self.core_mamba_pool.free(freed)
        return len(freed)

    def make_mamba_room(self, num: int) -> None:
        """Free up to ``num`` SSM slots for an allocation: cold tree states first (the tree
        cache's ``evict``, which gives planned prefix checkpoints back only for what the
        tree could not free), planned checkpoints alone without a tree cache."""
        if num <= 0:
            return
        if self.tree_cache is not None:
            from sglang.srt.mem_cache.base_prefix_cache import EvictParams

            self.tree_cache.evict(EvictParams(num_tokens=0, mamba_num=num))
        else:
            self.reclaim_prefix_checkpoints(num)

    def _drop_prefix_checkpoints(self, rows) -> None:
        """Free the slots of prefix checkpoints still planned for ``rows``."""
        slots = [slot for row in rows for _, slot in self.prefix_checkpoints.pop(row, ())]
        if slots:
            self.core_mamba_pool.free(slots)

    def alloc(self, reqs) -> Optional[List[int]]:
        """Rows, working SSM slots and ping-pong slots for the requests without a row (a
        continuing chunked request keeps its own); all or nothing."""
        fresh = [r for r in reqs if not r.kv.holds_kv]
        if fresh:
            creqs = [req_bridge.pull(r) for r in fresh]
            if self.tracking_replaced():
                self._drop_unneeded_track_slots(fresh, creqs)
            rows = self.core.alloc(creqs)
            short = self.core.mamba_slots_needed(creqs) - self.core_mamba_pool.available_size()
            if rows is None and short > 0:
                # SGLang's ensure_mamba_capacity normally made the room; a caller that did
                # not gets it here (cold tree states, then planned checkpoints).
                self.make_mamba_room(short)
                rows = self.core.alloc(creqs)
            if rows is None:
                return None
            for r, c in zip(fresh, creqs):
                r.kv.req_pool_idx = c.req_pool_idx
                req_bridge.push_mamba(r, c, self.device)
                req_bridge.push_track_buffer(r, c, self.device, fresh=True)
            self._rows_taken(rows)
            if self.tree_cache is not None:
                self.tree_cache.count_admitted(fresh)
            # After every request of the batch has its own slots: the extra checkpoints
            # only take what is left (evicting a state at most, never failing the batch).
            for r, c in zip(fresh, creqs):
                self._plan_prefix_checkpoints(r, c)
        return [r.kv.req_pool_idx for r in reqs]

    def _plan_prefix_checkpoints(self, req, creq) -> None:
        """Plan the request's prefix checkpoints (branch point, prompt length - 1; issue 6;
        message boundaries from ``Req.kv_hints``, :mod:`.chat_boundaries`; issue 16) when
        the backend can write them and the tree cache plans them."""
        cache = self.tree_cache
        if not self.prefix_checkpoint_writer or cache is None or not cache.core.branch_checkpoints:
            return
        fill = getattr(req, "full_untruncated_fill_ids", None)
        prompt_len = len(fill) if fill else len(req.origin_input_ids) + len(req.output_ids)
        branching = getattr(req, "mamba_branching_seqlen", None)
        # message boundaries the request names (chat template, or /generate kv_hints)
        boundaries = chat_boundaries.request_offsets(req)
        lmcache = getattr(cache, "lmcache", None)
        if lmcache is not None:  # --enable-lmcache: a state at the prompt's last chunk end can be stored
            end = lmcache.boundary(prompt_len)
            if end is not None:
                boundaries = [end, *boundaries]
        cache.core.plan_prefix_checkpoints(creq, prompt_len, branching, boundaries)
        req_bridge.push_prefix_checkpoints(self, creq.req_pool_idx, creq)

    def prefix_checkpoint_plan(self, forward_batch) -> Dict[int, List[Tuple[int, int]]]:
        """The planned prefix checkpoints inside this extend, as a backend checkpoint plan:
        ``{batch row: [(offset, slot), ...]}`` where ``offset`` (tokens into the row's new
        tokens of this forward) is ``seqlen - extend_prefix_len``. Empty for other modes."""
        if not self.prefix_checkpoints:
            return {}
        mode = getattr(forward_batch, "forward_mode", None)
        if mode is None or not mode.is_extend() or mode.is_target_verify() or mode.is_draft_extend_v2():
            return {}
        prefix = forward_batch.extend_prefix_lens_cpu
        new = forward_batch.extend_seq_lens_cpu
        if prefix is None or new is None:
            return {}
        plan: Dict[int, List[Tuple[int, int]]] = {}
        for i, row in enumerate(forward_batch.req_pool_indices.tolist()):
            planned = self.prefix_checkpoints.get(row)
            if not planned:
                continue
            start, end = int(prefix[i]), int(prefix[i]) + int(new[i])
            items = [(c - start, slot) for c, slot in planned if start < c <= end]
            if items:
                plan[i] = items
        return plan

    def free(self, req) -> None:
        """Release the request's row (and any SSM slot it still holds)."""
        creq = req_bridge.pull(req, pool=self)
        row = creq.req_pool_idx
        held_mamba = creq.mamba_pool_idx is not None or bool(creq.mamba_ping_pong_track_buffer)
        if self._aux_cache is not None and row is not None:
            self._aux_cache.free(row)
        self.core.free(creq)
        self.prefix_checkpoints.pop(row, None)
        req.kv.req_pool_idx = None
        if held_mamba:
            req_bridge.push_mamba_released(req)

    def free_mamba_cache(self, req, mamba_ping_pong_track_buffer_to_keep: Optional[int] = None) -> None:
        """Free the request's working and ping-pong SSM slots except ping-pong entry
        ``mamba_ping_pong_track_buffer_to_keep`` (SGLang's signature)."""
        creq = req_bridge.pull(req, pool=self)
        keep = None
        if mamba_ping_pong_track_buffer_to_keep is not None and creq.mamba_ping_pong_track_buffer:
            slot = creq.mamba_ping_pong_track_buffer[mamba_ping_pong_track_buffer_to_keep]
            keep = slot if slot >= 0 else None
        self.core.free_mamba_slots(creq, keep_slot=keep)
        self.prefix_checkpoints.pop(creq.req_pool_idx, None)
        req_bridge.push_mamba_released(req)

    def clear(self) -> None:
        """Server flush: every row and SSM slot back to the free lists (the tree was reset
        just before, ``Scheduler.flush_cache``)."""
        logger.info("Reset MambaRadixReqToTokenPool")
        if self._aux_cache is not None:
            self._aux_cache.clear()
        self.mamba_allocator.clear()
        self.short_conv_pool.clear()
        self.ngram_pool.clear()
        self.prefix_checkpoints.clear()
        self.core.clear()
        if self.core_ckpt_pool is not None:
            self.core_ckpt_pool.clear_all()  # the tree was reset: no stored state is held
        if self.core.mamba_host_pool is not None:
            self.core.mamba_host_pool.clear_all()  # host memory of the tree's states released
        if self.core.kv_host_pool is not None:
            self.core.kv_host_pool.clear()  # and of their KV


@contextlib.contextmanager
def _build_with(module, cls):
    """Make ``module.HybridReqToTokenPool`` name ``cls`` while SGLang builds the pool."""
    original = module.HybridReqToTokenPool
    module.HybridReqToTokenPool = cls
    try:
        yield
    finally:
        module.HybridReqToTokenPool = original


def build_hybrid_req_pool_around(original, configurator, **kwargs):
    """AROUND hook on ``KVCacheConfigurator._build_hybrid_req_pool``: under
    ``--enable-mamba-radix`` (``radix_cache_backend == "mamba_radix_ext"``) SGLang's own
    method builds a :class:`MambaRadixReqToTokenPool` with the arguments it computes;
    otherwise it runs unchanged."""
    from sglang.srt.mem_cache import kv_cache_configurator
    from sglang.srt.runtime_context import get_memory

    from sglang_mamba_ext.plugin.settings import BACKEND_NAME

    if get_memory().radix_cache_backend != BACKEND_NAME:
        return original(configurator, **kwargs)
    with _build_with(kv_cache_configurator, MambaRadixReqToTokenPool):
        pool = original(configurator, **kwargs)
    if not isinstance(pool, MambaRadixReqToTokenPool):
        raise RuntimeError("--enable-mamba-radix: SGLang did not build the hybrid request pool through the hook")
    logger.info(
        "sglang-mamba-ext: hybrid request pool: %d rows, %d SSM slots, %d ping-pong slots per request",
        pool.size,
        pool.core_mamba_pool.size,
        pool.mamba_initial_tracking_slots,
    )
    return pool
