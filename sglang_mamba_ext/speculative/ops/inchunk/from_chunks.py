"""GDN / KDA in-chunk checkpoints from the prefill's own chunk states (issue 39, item 1;
``docs/design.md``, "Prefix checkpoints").

SGLang's chunked GDN / KDA prefill (``kernels/ops/attention/fla/chunk.py``, ``fla/kda.py``)
computes ``h [1, NT, HV, V, K]``: the state at the start of every 64-token chunk of every
sequence of the packed extend (chunks numbered over the sequences in order). A checkpoint at
offset ``o >= chunk`` of a row then needs only the ``o - b <= chunk - 1`` tokens after the
boundary ``b = (o // chunk) * chunk``, starting from ``h`` at that chunk: a cost that does not
depend on ``o``. Checkpoints inside a row's first chunk start from the row's start state, which
the writers of :mod:`.chunked` / :mod:`.fused` already step without a chunked pass.

Two phases, because SGLang's forward advances the rows' working slots and may reuse its input
buffers: :func:`gather_tail_blocks` (before the forward) copies, per checkpoint, the
``W - 1 + chunk - 1`` raw inputs it reads into a block of its own; :func:`write_tail_blocks`
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

__all__ = ["TailWrites", "TailBlocks", "split_plan", "gather_tail_blocks", "write_tail_blocks"]


class TailWrites(NamedTuple):
    """Checkpoints past a row's first chunk (host lists, ``J`` entries).

    Attributes:
        starts: the row's first token in the packed inputs.
        offsets: tokens after the row's start (``>= chunk``).
        dst_slots: destination slots.
        chunk_ids: the chunk of ``h`` holding the boundary state below each: the row's first
            chunk in the packed extend plus ``offset // chunk``.
    """

    starts: List[int]
    offsets: List[int]
    dst_slots: List[int]
    chunk_ids: List[int]


class TailBlocks(NamedTuple):
    """The raw inputs of :class:`TailWrites`, one block of ``P = W - 1 + chunk - 1`` tokens per
    checkpoint (tokens ``b - (W-1) .. b + P - (W-1) - 1`` of its row; past ``o`` unused).

    Attributes:
        mixed_qkv: ``[L, J*P, conv_dim]``; g_raw: ``[L, J*P, *]``; b_raw: ``[L, J*P, HV]``
            (copies, the inputs' dtypes).
        lay: the blocks as a :class:`ChunkLayout` (one row and one checkpoint per block, at
            block offset ``W - 1 + o - b``; no whole chunk).
        chunk_ids: ``[J]`` host list, as :attr:`TailWrites.chunk_ids`.
        conv_kernel: ``W``.
    """

    mixed_qkv: torch.Tensor
    g_raw: torch.Tensor
    b_raw: torch.Tensor
    lay: ChunkLayout
    chunk_ids: List[int]
    conv_kernel: int


def split_plan(starts: Sequence[int], offsets: Sequence[Sequence[int]], dst_slots: Sequence[Sequence[int]],
               first_chunks: Sequence[int], chunk: int = DEFAULT_CHUNK
               ) -> Tuple[Tuple[List[int], List[List[int]], List[List[int]]], TailWrites]:
    """Split a host plan (the ``host`` triple of :func:`~.write_checkpoints`) into the
    checkpoints inside each row's first chunk (``offset < chunk``: same triple, others ``-1``)
    and the rest (:class:`TailWrites`). ``first_chunks [N]``: each row's first chunk in ``h``."""
    now_offs, now_dst = [], []
    tail = TailWrites([], [], [], [])
    for lo, orow, drow, c0 in zip(starts, offsets, dst_slots, first_chunks):
        no, nd = [], []
        for o, d in zip(orow, drow):
            if o < 0 or d < 0:
                continue
            if o < chunk:
                no.append(int(o))
                nd.append(int(d))
            else:
                tail.starts.append(int(lo))
                tail.offsets.append(int(o))
                tail.dst_slots.append(int(d))
                tail.chunk_ids.append(int(c0) + int(o) // chunk)
        now_offs.append(no)
        now_dst.append(nd)
    width = max((len(x) for x in now_offs), default=0)
    now_offs = [x + [-1] * (width - len(x)) for x in now_offs]
    now_dst = [x + [-1] * (width - len(x)) for x in now_dst]
    return (list(starts), now_offs, now_dst), tail


def gather_tail_blocks(mixed_qkv: torch.Tensor, g_raw: torch.Tensor, b_raw: torch.Tensor, tail: TailWrites,
                       conv_kernel: int, chunk: int = DEFAULT_CHUNK) -> TailBlocks:
    """Copy each tail checkpoint's raw inputs into its block (one ``index_select`` per input).

    Args:
        mixed_qkv: ``[L, T, conv_dim]``; g_raw: ``[L, T, *]``; b_raw: ``[L, T, HV]`` (as
            :func:`~.write_checkpoints` takes them).
        tail: from :func:`split_plan`; every ``starts + offsets <= T`` and ``offsets >= chunk``.
        conv_kernel: ``W``.

    Raises:
        ValueError: an offset inside the first chunk, or past the inputs.
    """
    Wm1 = conv_kernel - 1
    P = Wm1 + chunk - 1
    T = mixed_qkv.shape[1]
    idx, item_off, lengths = [], [], []
    for lo, o in zip(tail.starts, tail.offsets):
        if o < chunk or lo + o > T:
            raise ValueError(f"gather_tail_blocks: offset {o} of a row at {lo} is inside the first chunk "
                             f"({chunk}) or past the {T} input tokens")
        b = (o // chunk) * chunk
        first = lo + b - Wm1
        idx.extend(min(first + t, T - 1) for t in range(P))
        item_off.append(Wm1 + o - b)
        lengths.append(Wm1 + o - b)
    J = len(item_off)
    i = torch.tensor(idx, dtype=torch.int64, device=mixed_qkv.device)
    rows = list(range(J))
    lay = ChunkLayout(P + 1, rows, [j * P for j in rows], lengths, [0] * J, rows, item_off, list(tail.dst_slots),
                      [0] * J, rows, rows, [0] * J)
    return TailBlocks(mixed_qkv.index_select(1, i), g_raw.index_select(1, i), b_raw.index_select(1, i), lay,
                      list(tail.chunk_ids), conv_kernel)


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
    if max(blocks.chunk_ids) >= chunk_states.shape[1]:
        raise ValueError(f"write_tail_blocks: chunk {max(blocks.chunk_ids)} past the {chunk_states.shape[1]} "
                         f"chunk states")
    dev = blocks.mixed_qkv.device
    ids = torch.tensor(blocks.chunk_ids, dtype=torch.int64, device=dev)
    S = chunk_states.index_select(1, ids).float().contiguous()  # [L, J, HV, K, V]
    Wm1 = blocks.conv_kernel - 1
    if impl == "torch":
        from sglang_mamba_ext.speculative.ops.inchunk.chunked import prepare, scan_from_boundaries, write_states

        src = torch.full((J,), -1, dtype=torch.int64, device=dev)
        prep = prepare(blocks.mixed_qkv, blocks.g_raw, blocks.b_raw, lay, src, conv_state, weights)
        S = scan_from_boundaries(prep, lay, S, begin=[Wm1] * J)
        write_states(prep.window, lay, S, conv_state, temporal_state)
    elif impl == "triton":
        from sglang_mamba_ext.speculative.ops.inchunk.fused import write_blocks_triton

        write_blocks_triton(blocks.mixed_qkv.contiguous(), blocks.g_raw.contiguous(), blocks.b_raw.contiguous(),
                            lay, S, Wm1, conv_state, temporal_state, weights)
    else:
        raise ValueError(f"write_tail_blocks: unknown impl {impl!r} (triton, torch)")
