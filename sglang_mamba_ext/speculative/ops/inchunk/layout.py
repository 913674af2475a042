"""Host-side layout of a chunked in-chunk write (``docs/design.md``, "Prefix checkpoints"; issue
39): which rows run, how many whole chunks each needs, and for every checkpoint the chunk
boundary it starts from. Shared by the GDN / KDA and Mamba2 writers (both implementations), so
that the torch and Triton paths walk the same chunks. Plain Python and torch, no SGLang.

A checkpoint at offset ``o`` of a row starts from the state at the chunk boundary
``b = (o // chunk) * chunk`` below it (``b = 0``: the row's start state) and covers the
``o - b <= chunk - 1`` tokens after it; the boundary states come from one chunked pass per row
(all its checkpoints share it) up to the deepest boundary any of them needs.
"""

from __future__ import annotations

from typing import List, NamedTuple, Optional, Sequence, Tuple

import torch

__all__ = ["ChunkLayout", "chunk_layout", "DEFAULT_CHUNK"]

#: Tokens per chunk of the writers' chunked pass: SGLang's KDA / GDN / Mamba2 kernel chunk.
DEFAULT_CHUNK = 64


class ChunkLayout(NamedTuple):
    """Host-side plan of one chunked write (all lists on the host; ``R`` active rows, ``J``
    checkpoints, ``Q`` distinct (row, boundary) pairs).

    Attributes:
        chunk: tokens per chunk.
        rows: ``[R]`` the :class:`~.CheckpointWrites` row of each active row (one with at least
            one checkpoint).
        starts: ``[R]`` each active row's first token in the packed inputs.
        lengths: ``[R]`` tokens each active row needs (its deepest offset).
        nchunks: ``[R]`` whole chunks each row's chunked pass runs (its deepest boundary / chunk).
        item_row: ``[J]`` the active row (index into ``rows``) of each checkpoint.
        item_off: ``[J]`` the checkpoint's offset ``o`` (tokens after the row's start).
        item_dst: ``[J]`` its destination slot.
        item_chunk: ``[J]`` ``o // chunk``: the boundary it starts from, in chunks.
        item_bnd: ``[J]`` index of its boundary state among the ``Q`` kept.
        bnd_row, bnd_chunk: ``[Q]`` each kept boundary state's active row and chunk index.
    """

    chunk: int
    rows: List[int]
    starts: List[int]
    lengths: List[int]
    nchunks: List[int]
    item_row: List[int]
    item_off: List[int]
    item_dst: List[int]
    item_chunk: List[int]
    item_bnd: List[int]
    bnd_row: List[int]
    bnd_chunk: List[int]

    @property
    def max_len(self) -> int:
        """Tokens of the longest active row (the padded token axis of the prepared inputs)."""
        return max(self.lengths, default=0)

    @property
    def max_chunks(self) -> int:
        """Whole chunks of the longest chunked pass."""
        return max(self.nchunks, default=0)

    def scanned(self) -> List[int]:
        """``[J]`` tokens each checkpoint covers after its boundary state, ``o - b``: at most
        ``chunk - 1``."""
        return [o - c * self.chunk for o, c in zip(self.item_off, self.item_chunk)]

    def boundary_table(self) -> List[List[int]]:
        """``[R][max_chunks + 1]``: the kept boundary index of (row, chunk), ``-1`` where none."""
        table = [[-1] * (self.max_chunks + 1) for _ in self.rows]
        for q, (r, c) in enumerate(zip(self.bnd_row, self.bnd_chunk)):
            table[r][c] = q
        return table


def chunk_layout(writes, chunk: int = DEFAULT_CHUNK,
                 host: Optional[Tuple[Sequence[int], Sequence[Sequence[int]], Sequence[Sequence[int]]]] = None
                 ) -> ChunkLayout:
    """The :class:`ChunkLayout` of ``writes`` (a :class:`~.CheckpointWrites`).

    Args:
        writes: the plan; its ``starts``, ``offsets`` and ``dst_slots`` are read on the host
            (``.tolist()``, a device sync on CUDA) unless ``host`` gives them.
        chunk: tokens per chunk (>= 1).
        host: ``(starts [N], offsets [N][C], dst_slots [N][C])`` as host lists (the serving
            glue's plan), so that no device value is read.

    Raises:
        ValueError: ``chunk < 1``.
    """
    if chunk < 1:
        raise ValueError(f"chunk_layout: chunk must be >= 1, got {chunk}")
    if host is None:
        host = (writes.starts.tolist(), writes.offsets.tolist(), writes.dst_slots.tolist())
    starts, offs, dsts = host
    rows, r_starts, lengths, nchunks = [], [], [], []
    item_row, item_off, item_dst, item_chunk, item_bnd = [], [], [], [], []
    bnd_row, bnd_chunk = [], []
    for i, (lo, orow, drow) in enumerate(zip(starts, offs, dsts)):
        items = [(int(o), int(d)) for o, d in zip(orow, drow) if o >= 0 and d >= 0]
        if not items:
            continue
        r = len(rows)
        rows.append(i)
        r_starts.append(int(lo))
        lengths.append(max(o for o, _ in items))
        nchunks.append(max(o // chunk for o, _ in items))
        seen = {}
        for o, d in items:
            c = o // chunk
            if c not in seen:
                seen[c] = len(bnd_row)
                bnd_row.append(r)
                bnd_chunk.append(c)
            item_row.append(r)
            item_off.append(o)
            item_dst.append(d)
            item_chunk.append(c)
            item_bnd.append(seen[c])
    return ChunkLayout(chunk, rows, r_starts, lengths, nchunks, item_row, item_off, item_dst, item_chunk, item_bnd,
                       bnd_row, bnd_chunk)


def gather_rows(x: torch.Tensor, lay: ChunkLayout, pad: int = 0) -> torch.Tensor:
    """``x [L, T, F]`` -> ``[L, R, max_len + pad, F]``: each active row's tokens from its start
    (tokens past the row's length, and the ``pad`` extra ones, repeat an in-range token; the
    callers mask them)."""
    T = x.shape[1]
    n = lay.max_len + pad
    idx = [[min(s + t, T - 1) for t in range(n)] for s in lay.starts]
    i = torch.tensor(idx, dtype=torch.int64, device=x.device).reshape(-1)
    return x.index_select(1, i).reshape(x.shape[0], len(lay.rows), n, x.shape[-1])


def valid_mask(lay: ChunkLayout, device, pad: int = 0) -> torch.Tensor:
    """``[R, max_len + pad]`` bool: token ``t`` belongs to active row ``r`` (``t < lengths[r]``)."""
    n = lay.max_len + pad
    return torch.tensor([[t < ln for t in range(n)] for ln in lay.lengths], dtype=torch.bool, device=device)
