"""GDN / KDA in-chunk checkpoints from the prefill's own chunk states (issue 39, item 1;
``docs/design.md``, "Prefix checkpoints").

SGLang's chunked GDN / KDA prefill (``kernels/ops/attention/fla/chunk.py``, ``fla/kda.py``)
computes ``h [1, NT, HV, V, K]``: the state at the start of every 64-token chunk of every
sequence of the packed extend (chunks numbered over the sequences in order). A checkpoint at
offset ``o >= chunk`` of a row then needs only the ``o - b <= chunk - 1`` tokens after the
boundary ``b = (o // chunk) * chunk``, starting from ``h`` at that chunk (``chunk`` tokens from
the chunk before for a checkpoint at the row's end, where no chunk starts): a cost that does
not depend on ``o``. Checkpoints inside a row's first chunk start from the row's start state, which
the writers of :mod:`.chunked` / :mod:`.fused` already step without a chunked pass.

Two phases, because SGLang's forward advances the rows' working slots and may reuse its input
buffers: :func:`gather_tail_blocks` (before the forward) copies, per checkpoint, the
``W - 1 + chunk`` raw inputs it reads into a block of its own; :func:`write_tail_blocks`
(once ``h`` exists) steps each block from its boundary state and stores the conv window and the
state. Each block is a row whose first ``W - 1`` tokens only feed the conv, so the writers' own
kernels run on it unchanged (torch: :func:`.chunked.prepare` / :func:`.chunked.scan_from_boundaries`;
Triton: ``fused._inchunk_recurrent_kernel`` and ``fused._inchunk_conv_window_kernel``). A fixed
number of launches per layer, no host sync. No SGLang import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, List, NamedTuple, Optional, Sequence, Tuple

import torch

from sglang_mamba_ext.speculative.ops.inchunk.layout import DEFAULT_CHUNK, ChunkLayout

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.replay import ReplayWeights

__all__ = ["TailWrites", "TailBlocks", "split_plan", "first_chunks_of", "gather_tail_blocks", "block_states",
           "block_tables", "write_split", "write_tail_blocks"]


class TailWrites(NamedTuple):
    """Checkpoints that start from a chunk state of the prefill (host lists, ``J`` entries).

    Attributes:
        starts: the row's first token in the packed inputs.
        offsets: tokens after the row's start.
        dst_slots: destination slots.
        chunk_ids: the chunk state each starts from (its index in the prefill's chunk states).
        begins: the boundary ``b`` of that state, in tokens after the row's start (``0 < b <=
            offset``, ``offset - b <= chunk``; ``chunk`` only for a checkpoint at the row's end).
    """

    starts: List[int]
    offsets: List[int]
    dst_slots: List[int]
    chunk_ids: List[int]
    begins: List[int]


class TailBlocks(NamedTuple):
    """The raw inputs of :class:`TailWrites`, one block of ``P = W - 1 + chunk`` tokens per
    checkpoint (tokens ``b - (W-1) .. b + chunk - 1`` of its row; past ``o`` unused).

    Attributes:
        inputs: the per-token inputs, each ``[L, J*P, *]`` (copies, their dtypes): GDN / KDA
            ``(mixed_qkv, g_raw, b_raw)``, Mamba2 ``(xbc, dt_raw)``.
        lay: the blocks as a :class:`ChunkLayout` (one row and one checkpoint per block, at
            block offset ``W - 1 + o - b``; no whole chunk).
        chunk_ids: ``[J]`` host list, as :attr:`TailWrites.chunk_ids`.
        conv_kernel: ``W``.
    """

    inputs: Tuple[torch.Tensor, ...]
    lay: ChunkLayout
    chunk_ids: List[int]
    conv_kernel: int


def split_plan(starts: Sequence[int], offsets: Sequence[Sequence[int]], dst_slots: Sequence[Sequence[int]],
               lengths: Sequence[int], first_chunks: Optional[Sequence[int]] = None, chunk: int = DEFAULT_CHUNK
               ) -> Tuple[Tuple[List[int], List[List[int]], List[List[int]]], TailWrites]:
    """Split a host plan (the ``host`` triple of :func:`~.write_checkpoints`) into the
    checkpoints with no chunk state of the prefill below them (same triple, others ``-1``) and
    the rest (:class:`TailWrites`).

    A chunk state is used only where its chunk starts at a token of the row itself, after the
    row's first token: the prefill has no state for a chunk starting at the row's end (the last
    row's end, or the next row's start). A checkpoint at such an end (``offset = length``, on
    the grid) starts from the chunk state before, ``chunk`` tokens back.

    Args:
        lengths: ``[N]`` each row's tokens in the prefill (``extend_seq_lens``).
        first_chunks: ``[N]`` each row's first chunk in the chunk states, when chunks start at
            every row (GDN / KDA's ``h``); None: one chunk grid over the packed tokens, chunk
            ``c`` starting at token ``c * chunk`` (Mamba2's SSD ``states``).
    """
    now_offs, now_dst = [], []
    tail = TailWrites([], [], [], [], [])
    for r, (lo, orow, drow, n) in enumerate(zip(starts, offsets, dst_slots, lengths)):
        lo, n = int(lo), int(n)
        no, nd = [], []
        for o, d in zip(orow, drow):
            o, d = int(o), int(d)
            if o < 0 or d < 0:
                continue
            g = (o // chunk) * chunk if first_chunks is not None else ((lo + o) // chunk) * chunk - lo
            if g >= n:  # no chunk starts at the row's end
                g -= chunk
            if g <= 0:
                no.append(o)
                nd.append(d)
            else:
                cid = int(first_chunks[r]) + g // chunk if first_chunks is not None else (lo + g) // chunk
                for lst, v in zip(tail, (lo, o, d, cid, g)):
                    lst.append(v)
        now_offs.append(no)
        now_dst.append(nd)
    width = max((len(x) for x in now_offs), default=0)
    now_offs = [x + [-1] * (width - len(x)) for x in now_offs]
    now_dst = [x + [-1] * (width - len(x)) for x in now_dst]
    return (list(starts), now_offs, now_dst), tail


def first_chunks_of(lengths: Sequence[int], chunk: int = DEFAULT_CHUNK) -> List[int]:
    """``[N]`` each row's first chunk when every row starts a chunk (GDN / KDA's ``h``):
    ``ceil(length / chunk)`` chunks per row, rows in order."""
    out, c = [], 0
    for n in lengths:
        out.append(c)
        c += (int(n) + chunk - 1) // chunk
    return out


def gather_tail_blocks(inputs: Sequence[torch.Tensor], tail: TailWrites, conv_kernel: int,
                       chunk: int = DEFAULT_CHUNK) -> TailBlocks:
    """Copy each tail checkpoint's raw inputs into its block (one ``index_select`` per input).

    Args:
        inputs: ``[L, T, *]`` each (GDN / KDA ``(mixed_qkv, g_raw, b_raw)``, Mamba2
            ``(xbc, dt_raw)``), as the writers take them.
        tail: from :func:`split_plan`.
        conv_kernel: ``W``.

    Raises:
        ValueError: a boundary not inside ``(0, offset]``, more than ``chunk - 1`` tokens after
            it, or an offset past the inputs.
    """
    i, lay = _tail_index(tail, conv_kernel, chunk, inputs[0].shape[1], inputs[0].device)
    return TailBlocks(tuple(x.index_select(1, i) for x in inputs), lay, list(tail.chunk_ids), conv_kernel)


#: One entry: the last plan's block index (every linear layer of a forward gathers the same
#: blocks from its own inputs; serving passes the same :class:`TailWrites` to each).
_INDEX_MEMO: dict = {}


def _tail_index(tail: TailWrites, conv_kernel: int, chunk: int, T: int, device):
    """``(index [J*P] int64 on device, ChunkLayout)`` of :func:`gather_tail_blocks`, built once
    per ``tail`` object (validated then)."""
    key = (conv_kernel, chunk, T, str(device))
    hit = _INDEX_MEMO.get("last")
    if hit is not None and hit[0] is tail and hit[1] == key:
        return hit[2]
    Wm1 = conv_kernel - 1
    P = Wm1 + chunk
    idx, item_off = [], []
    for lo, o, b in zip(tail.starts, tail.offsets, tail.begins):
        if not 0 < b <= o or o - b > chunk or lo + o > T:
            raise ValueError(f"gather_tail_blocks: offset {o} from boundary {b} of a row at {lo}: the boundary must "
                             f"lie in (0, offset] within {chunk} tokens, the offset within the {T} input tokens")
        first = lo + b - Wm1
        idx.extend(min(max(first + t, 0), T - 1) for t in range(P))
        item_off.append(Wm1 + o - b)
    J = len(item_off)
    rows = list(range(J))
    lay = ChunkLayout(P + 1, rows, [j * P for j in rows], list(item_off), [0] * J, rows, item_off,
                      list(tail.dst_slots), [0] * J, rows, rows, [0] * J)
    out = (torch.tensor(idx, dtype=torch.int64, device=device), lay)
    _INDEX_MEMO["last"] = (tail, key, out)
    return out


def block_states(blocks: TailBlocks, chunk_states: torch.Tensor) -> torch.Tensor:
    """``[L, J, ...]`` float32 contiguous: each block's boundary state from ``chunk_states
    [L, NT, ...]``.

    Raises:
        ValueError: a chunk id past ``chunk_states``.
    """
    if max(blocks.chunk_ids) >= chunk_states.shape[1]:
        raise ValueError(f"write_tail_blocks: chunk {max(blocks.chunk_ids)} past the {chunk_states.shape[1]} "
                         f"chunk states")
    ids = torch.tensor(blocks.chunk_ids, dtype=torch.int64, device=chunk_states.device)
    return chunk_states.index_select(1, ids).float().contiguous()


def write_tail_blocks(blocks: TailBlocks, chunk_states: torch.Tensor, conv_state: torch.Tensor,
                      temporal_state: torch.Tensor, weights: "ReplayWeights", impl: str = "triton",
                      stats: Optional[dict] = None) -> None:
    """Step each block from its boundary state ``chunk_states[:, chunk_ids[j]]`` over its
    ``o - b <= chunk - 1`` tokens and store the conv window and state into its slot.

    Args:
        blocks: from :func:`gather_tail_blocks`.
        chunk_states: ``[L, NT, HV, K, V]`` view (any strides, any float dtype): the state at
            the start of every chunk (SGLang's ``h [1, NT, HV, V, K]`` through
            ``.transpose(-1, -2)``).
        conv_state: ``[L, slots, conv_dim, W-1]`` view; temporal_state: ``[L, slots, HV, K, V]``
            view (as :func:`~.write_checkpoints`).
        weights: the layers' :class:`~sglang_mamba_ext.speculative.replay.ReplayWeights`.
        impl: ``"triton"`` or ``"torch"``.
        stats: if a dict, receives ``"scanned"``: ``[J]`` tokens stepped per checkpoint.

    Raises:
        ValueError: an unknown ``impl``, or a chunk id past ``chunk_states``.
    """
    lay = blocks.lay
    J = len(lay.item_off)
    if stats is not None:
        stats["scanned"] = [o - (blocks.conv_kernel - 1) for o in lay.item_off]
    if J == 0:
        return
    S = block_states(blocks, chunk_states)  # [L, J, HV, K, V]
    mixed_qkv, g_raw, b_raw = blocks.inputs
    Wm1 = blocks.conv_kernel - 1
    if impl == "torch":
        from sglang_mamba_ext.speculative.ops.inchunk.chunked import prepare, scan_from_boundaries, write_states

        src = torch.full((J,), -1, dtype=torch.int64, device=mixed_qkv.device)
        prep = prepare(mixed_qkv, g_raw, b_raw, lay, src, conv_state, weights)
        S = scan_from_boundaries(prep, lay, S, begin=[Wm1] * J)
        write_states(prep.window, lay, S, conv_state, temporal_state)
    elif impl == "triton":
        from sglang_mamba_ext.speculative.ops.inchunk.fused import write_blocks_triton

        write_blocks_triton(mixed_qkv.contiguous(), g_raw.contiguous(), b_raw.contiguous(), lay, S, Wm1, conv_state,
                            temporal_state, weights)
    else:
        raise ValueError(f"write_tail_blocks: unknown impl {impl!r} (triton, torch)")


def block_tables(lay: ChunkLayout, begin: int, device):
    """Device int64 per-block tables for the writers' partial-chunk kernels (``fused.
    _inchunk_recurrent_kernel``, ``mamba2._mamba2_inchunk_kernel``): block start, start slot
    (``-1``: no start window is read), offset, destination, first token stepped (``begin =
    W - 1``), boundary state index (the block's own); built once per layout (every layer of a
    forward uses the same)."""
    key = (begin, str(device))
    hit = _INDEX_MEMO.get("tables")
    if hit is not None and hit[0] is lay and hit[1] == key:
        return hit[2]
    J = len(lay.item_off)
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
    out = (t(lay.starts), torch.full((J,), -1, dtype=torch.int64, device=device), t(lay.item_off),
           t(lay.item_dst), torch.full((J,), begin, dtype=torch.int64, device=device), t(list(range(J))))
    _INDEX_MEMO["tables"] = (lay, key, out)
    return out


def write_split(writes, host, row_lengths, first_chunks, chunk: int, inputs: Sequence[torch.Tensor], conv_kernel: int,
                write_now, write_tail, stats: Optional[dict]) -> None:
    """A writer's call with the prefill's chunk states, in one place for both kinds of layer:
    :func:`split_plan`, then ``write_now(now_writes, now_host, stats)`` for the checkpoints with
    no chunk state below them (``now_writes``: a :class:`~.CheckpointWrites` keeping
    ``writes.src_slots``; skipped when none) and ``write_tail(blocks, tail_stats)`` for the
    others (:func:`gather_tail_blocks` of ``inputs``); ``stats["scanned"]`` lists the first
    group's, then the second's.

    Raises:
        ValueError: ``row_lengths`` (or ``first_chunks`` when not None) not one per row.
    """
    from sglang_mamba_ext.speculative.ops.inchunk import plan_writes

    N = writes.starts.shape[0]
    if row_lengths is None or len(row_lengths) != N or (first_chunks is not None and len(first_chunks) != N):
        raise ValueError("chunk_states needs row_lengths (and for GDN / KDA first_chunks), one per row")
    now, tail = split_plan(*(host or (writes.starts.tolist(), writes.offsets.tolist(), writes.dst_slots.tolist())),
                           row_lengths, first_chunks, chunk)
    blocks = gather_tail_blocks(inputs, tail, conv_kernel, chunk)
    now_writes = plan_writes([(lo, 0, [(o, d) for o, d in zip(orow, drow) if o >= 0]) for lo, orow, drow in zip(*now)],
                             inputs[0].device)
    if now_writes.offsets.shape[1]:
        write_now(now_writes._replace(src_slots=writes.src_slots), now, stats)
    tail_stats: dict = {}
    write_tail(blocks, tail_stats)
    if stats is not None:
        stats["scanned"] = list(stats.get("scanned", [])) + tail_stats["scanned"]
        stats.setdefault("chunks", 0)
