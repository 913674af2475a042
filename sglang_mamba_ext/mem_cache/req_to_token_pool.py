"""Hybrid request-to-token pool (``docs/design.md``, "Ping-pong checkpoints"): the ``req_to_token`` map of KV slots,
the request -> working SSM slot map, and the ping-pong checkpoint slots per request.

Plays the role of SGLang's ``HybridReqToTokenPool`` (``sglang/srt/mem_cache/memory_pool.py``).
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Sequence, Tuple, Union

import torch

from .mamba_pool import MambaPool
from .req import CacheReq


class HybridReqToTokenPool:
    """Rows of KV-slot indices per request, plus each request's SSM slots.

    Tensors (``size + 1`` rows: row 0 is a padding row that is never handed out, SGLang's
    convention in ``ReqToTokenPool`` — padded batch rows point at it — so the same tensors
    can back both; usable rows are ``1 .. size``):

    - ``req_to_token``: int32 ``[size + 1, max_context_len]``; ``req_to_token[r, pos]`` is
      the KV slot of token ``pos`` of the request in row ``r``.
    - ``req_index_to_mamba_index_mapping``: int ``[size + 1]``; the working SSM slot of row
      ``r`` (``-1`` when free; the padding row maps to the padding SSM slot 0).
    - ``req_index_to_mamba_ping_pong_track_buffer_mapping``: int64
      ``[size + 1, track_slots_per_req]``; the row's checkpoint slots (``-1`` where missing).

    A request holds ``1 + track_slots_per_req`` SSM slots while it runs: with the default
    ``track_slots_per_req=2`` that is "1 working + 2 ping-pong" (SGLang's extra_buffer);
    ``0`` means no tracking (SGLang's no_buffer strategy).

    Args:
        size: usable rows (concurrent requests), >= 1.
        max_context_len: tokens per row, >= 1.
        mamba_pool: the SSM pool the request slots come from (``self.mamba_pool``).
        track_slots_per_req: 0 or 2.
        device: device of the index tensors.
        req_to_token / req_index_to_mamba_index_mapping /
        req_index_to_mamba_ping_pong_track_buffer_mapping: existing tensors to use instead
            of allocating (e.g. SGLang's ``HybridReqToTokenPool`` tensors, so SGLang's
            backends and this pool read the same maps); shapes as above (the ping-pong map
            only needs ``>= track_slots_per_req`` columns).
        mamba_ckpt_pool: where the radix tree keeps its states instead of ``mamba_pool``
            (:class:`~.checkpoint_pool.Int8CheckpointPool`, or the plugin's wrapper of
            SGLang's ``MambaCheckpointPool``); ``None``: the tree holds slots of
            ``mamba_pool`` (``docs/design.md``, "int8 checkpoints").
        mamba_host_pool: the host tier of the tree's states
            (:class:`~.checkpoint_pool.HostStatePool`; ``docs/design.md``, "Host tier"), or
            ``None``.
        kv_host_pool: the host tier of the tree's attention KV
            (:class:`~.kv_host_pool.HostKVPool`; with ``mamba_host_pool`` only), or ``None``.

    Raises:
        ValueError: on non-positive sizes, ``track_slots_per_req`` not in (0, 2), or given
            tensors of the wrong shape.
    """

    def __init__(
        self,
        size: int,
        max_context_len: int,
        mamba_pool: MambaPool,
        track_slots_per_req: int = 2,
        device: Union[str, torch.device] = "cpu",
        *,
        req_to_token: Optional[torch.Tensor] = None,
        req_index_to_mamba_index_mapping: Optional[torch.Tensor] = None,
        req_index_to_mamba_ping_pong_track_buffer_mapping: Optional[torch.Tensor] = None,
        mamba_ckpt_pool: Optional[Any] = None,
        mamba_host_pool: Optional[Any] = None,
        kv_host_pool: Optional[Any] = None,
    ):
        if size < 1 or max_context_len < 1:
            raise ValueError(
                f"HybridReqToTokenPool needs size >= 1 and max_context_len >= 1, got {size}, {max_context_len}"
            )
        if track_slots_per_req not in (0, 2):
            raise ValueError(f"track_slots_per_req must be 0 or 2, got {track_slots_per_req}")
        self.size = size
        self.max_context_len = max_context_len
        self.mamba_pool = mamba_pool
        self.mamba_ckpt_pool = mamba_ckpt_pool
        self.mamba_host_pool = mamba_host_pool
        self.kv_host_pool = kv_host_pool
        self.track_slots_per_req = track_slots_per_req
        self.device = torch.device(device)
        rows = size + 1
        if req_to_token is None:
            req_to_token = torch.zeros((rows, max_context_len), dtype=torch.int32, device=self.device)
        elif tuple(req_to_token.shape) != (rows, max_context_len):
            raise ValueError(
                f"HybridReqToTokenPool: req_to_token has shape {tuple(req_to_token.shape)}, "
                f"expected {(rows, max_context_len)}"
            )
        if req_index_to_mamba_index_mapping is None:
            req_index_to_mamba_index_mapping = torch.empty((rows,), dtype=torch.int64, device=self.device)
        elif tuple(req_index_to_mamba_index_mapping.shape) != (rows,):
            raise ValueError(
                "HybridReqToTokenPool: req_index_to_mamba_index_mapping has shape "
                f"{tuple(req_index_to_mamba_index_mapping.shape)}, expected {(rows,)}"
            )
        track_cols = max(track_slots_per_req, 1)
        pp = req_index_to_mamba_ping_pong_track_buffer_mapping
        if pp is None:
            pp = torch.empty((rows, track_cols), dtype=torch.int64, device=self.device)
        elif pp.dim() != 2 or pp.shape[0] != rows or pp.shape[1] < track_slots_per_req:
            raise ValueError(
                "HybridReqToTokenPool: req_index_to_mamba_ping_pong_track_buffer_mapping has shape "
                f"{tuple(pp.shape)}, expected ({rows}, >= {track_slots_per_req})"
            )
        self.req_to_token = req_to_token
        self.req_index_to_mamba_index_mapping = req_index_to_mamba_index_mapping
        self.req_index_to_mamba_ping_pong_track_buffer_mapping = pp
        #: Copy-on-write copies scheduled since construction: requests admitted by
        #: :meth:`alloc` with a copy source (each gets exactly one copy at forward start).
        self.cow_copies_total = 0
        self.clear()

    # -- sizes ------------------------------------------------------------------------
    def available_size(self) -> int:
        """Free rows."""
        return len(self._free_rows)

    def free_row_ids(self) -> List[int]:
        """The free rows (a copy), for leak checks: ``len(...) == size`` at idle."""
        return list(self._free_rows)

    def mamba_slots_per_req(self) -> int:
        """SSM slots a running request holds (working + checkpoints)."""
        return 1 + self.track_slots_per_req

    def mamba_slots_needed(self, reqs: Sequence[CacheReq]) -> int:
        """SSM slots :meth:`alloc` takes for ``reqs``: their ping-pong slots, plus a working
        slot for each request ``match_prefix`` did not already give one."""
        track = self.track_slots_per_req
        return sum((track if r.mamba_track_slots_wanted else 0) + (1 if r.mamba_pool_idx is None else 0)
                   for r in reqs)

    # -- alloc / free -----------------------------------------------------------------
    def alloc(self, reqs: Sequence[CacheReq]) -> Optional[List[int]]:
        """Give each request a row, a working SSM slot (unless ``match_prefix`` already
        allocated one for copy-on-write) and its ping-pong checkpoint slots.

        All or nothing: on failure nothing is taken and ``None`` is returned, so the caller
        can evict and retry or reject the requests (which then still own only what they held
        before, e.g. a COW slot, freed by ``MambaRadixCache.on_release``).

        A fresh working slot (no COW source) is marked ``mamba_needs_clear``: the
        scheduler zeroes it at forward start, batched with the pending copy-on-write copies
        (SGLang: ``_execute_deferred_mamba_cow_and_clear``; ``docs/design.md``,
        "Copy-on-write").

        Returns:
            the rows (also written to ``req.req_pool_idx``), or ``None``.
        """
        n = len(reqs)
        if n > len(self._free_rows):
            return None
        pool = self.mamba_pool
        slots = pool.alloc_list(self.mamba_slots_needed(reqs))
        if slots is None:
            return None
        rows = self.alloc_rows(n)
        it = iter(slots)
        track = self.track_slots_per_req
        for r, row in zip(reqs, rows):
            if r.mamba_pool_idx is None:
                r.mamba_pool_idx = next(it)
                r.mamba_needs_clear = r.mamba_cow_src_index is None
            if r.mamba_cow_src_index is not None:
                self.cow_copies_total += 1
            r.req_pool_idx = row
            # without its ping-pong slots (``mamba_track_slots_wanted``): entries -1 and the
            # padding slot in the row mapping, as after :meth:`release_track_slots`
            r.mamba_ping_pong_track_buffer = [next(it) if r.mamba_track_slots_wanted else -1 for _ in range(track)]
            r.mamba_next_track_idx = 0
            r.mamba_last_track_seqlen = None
        mapping = self.req_index_to_mamba_index_mapping
        pp = self.req_index_to_mamba_ping_pong_track_buffer_mapping
        pad = self.mamba_pool.padding_slot
        if n == 1:  # the scheduler's common case: scalar writes, no index tensors
            r, row = reqs[0], rows[0]
            mapping[row] = r.mamba_pool_idx
            if track:
                pp[row, :track] = torch.tensor([s if s >= 0 else pad for s in r.mamba_ping_pong_track_buffer],
                                               dtype=pp.dtype, device=self.device)
            return rows
        idx = torch.tensor(rows, dtype=torch.int64, device=self.device)
        mapping[idx] = torch.tensor([r.mamba_pool_idx for r in reqs], dtype=mapping.dtype, device=self.device)
        if track:
            pp[idx, :track] = torch.tensor(
                [[s if s >= 0 else pad for s in r.mamba_ping_pong_track_buffer] for r in reqs],
                dtype=pp.dtype, device=self.device,
            )
        return rows

    def alloc_rows(self, need_size: int) -> Optional[List[int]]:
        """Take ``need_size`` rows with no SSM slots (e.g. SGLang's beam-search member
        rows); ``None`` if fewer are free."""
        if need_size > len(self._free_rows):
            return None
        return [self._free_rows.pop() for _ in range(need_size)]

    def free_rows(self, rows: Iterable[int]) -> None:
        """Return rows taken by :meth:`alloc_rows` (their SSM maps are reset)."""
        for row in rows:
            if row < 1 or row > self.size:
                raise ValueError(f"free_rows: row {row} out of range [1, {self.size}]")
            self.req_index_to_mamba_index_mapping[row] = -1
            if self.track_slots_per_req:
                self.req_index_to_mamba_ping_pong_track_buffer_mapping[row] = -1
            self._free_rows.append(row)

    def free_mamba_slots(self, req: CacheReq, keep_slot: Optional[int] = None) -> None:
        """Release the request's working and checkpoint SSM slots, except ``keep_slot``
        (a slot donated to the radix tree by ``MambaRadixCache.checkpoint``); keep its row. Clears the
        request's SSM fields. Idempotent."""
        slots = []
        if req.mamba_pool_idx is not None:
            slots.append(req.mamba_pool_idx)
        slots.extend(s for s in req.mamba_ping_pong_track_buffer if s >= 0)
        slots.extend(slot for _, slot in req.mamba_prefix_checkpoints)
        if keep_slot is not None:
            slots.remove(keep_slot)
        if slots:
            self.mamba_pool.free(slots)
        req.mamba_pool_idx = None
        req.mamba_cow_src_index = None
        req.mamba_needs_clear = False
        req.mamba_ping_pong_track_buffer = []
        req.mamba_last_track_seqlen = None
        req.mamba_prefix_checkpoints = []

    def free(self, req: CacheReq, keep_slot: Optional[int] = None) -> None:
        """Release the request's row and SSM slots, except ``keep_slot`` (see
        :meth:`free_mamba_slots`). Idempotent on the row."""
        self.free_mamba_slots(req, keep_slot)
        row = req.req_pool_idx
        if row is not None:
            self.free_rows([row])
            req.req_pool_idx = None

    def replace_track_slot(self, req: CacheReq, entry: int, slot: int) -> None:
        """Put ``slot`` (or ``-1``: none) into ping-pong entry ``entry`` of the request, after
        the old slot there was donated to the tree or freed. The row's mapping, which the
        forward's track writes read, gets the padding slot for ``-1``: SGLang's track
        scatter kernels do not skip a negative destination (``track_mamba_states_if_needed``
        checks only with unified memory) and its extend path indexes with it."""
        req.mamba_ping_pong_track_buffer[entry] = slot
        if req.req_pool_idx is not None:
            mapped = slot if slot >= 0 else self.mamba_pool.padding_slot
            self.req_index_to_mamba_ping_pong_track_buffer_mapping[req.req_pool_idx, entry] = mapped

    def release_track_slots(self, req: CacheReq) -> None:
        """Free the request's ping-pong slots and set both entries to ``-1`` (row mapping
        too); it holds no checkpoint afterwards. Idempotent."""
        held = [s for s in req.mamba_ping_pong_track_buffer if s >= 0]
        if held:
            self.mamba_pool.free(held)
        for entry in range(len(req.mamba_ping_pong_track_buffer)):
            self.replace_track_slot(req, entry, -1)
        req.mamba_last_track_seqlen = None
        req.mamba_prev_track_seqlen = None

    # -- prefix checkpoints (docs/design.md, "Prefix checkpoints") --------------------
    @staticmethod
    def prefix_checkpoints_in(req: CacheReq, seq_len_before: int, num_new_tokens: int) -> List[Tuple[int, int]]:
        """The planned extra checkpoints (``MambaRadixCache.plan_prefix_checkpoints``) that
        fall inside this forward: ``(slot, c)`` pairs with ``seq_len_before < c <=
        seq_len_before + num_new_tokens`` — write the state after token ``c - 1`` into
        ``slot``."""
        end = seq_len_before + num_new_tokens
        return [(slot, c) for c, slot in req.mamba_prefix_checkpoints if seq_len_before < c <= end]

    def clear(self) -> None:
        """Forget every row (server flush); SSM slots must have been freed by the caller."""
        self._free_rows = list(range(self.size, 0, -1))
        self.req_index_to_mamba_index_mapping.fill_(-1)
        self.req_index_to_mamba_ping_pong_track_buffer_mapping.fill_(-1)
        # The padding row points at the padding SSM slot (SGLang: padded batch rows carry
        # row 0, which must map to a harmless slot).
        self.req_index_to_mamba_index_mapping[0] = self.mamba_pool.padding_slot
        self.req_index_to_mamba_ping_pong_track_buffer_mapping[0] = self.mamba_pool.padding_slot
