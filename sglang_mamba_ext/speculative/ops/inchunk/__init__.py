"""In-chunk checkpoint writer (``docs/design.md``, "Prefix checkpoints"): the conv window and
SSM state at arbitrary token positions of a prefill, from a start state and the raw inputs of
the tokens after it, for KDA (decay per key channel) and Gated DeltaNet (decay per value head).
SGLang's chunked KDA / GDN kernels keep states only on their 64-token chunk grid; this op gives
the plugin exact branch-point and prompt-end checkpoints with them
(``plugin/inchunk_checkpoints.py``). Each checkpoint starts from the chunk-boundary state below
it and covers at most ``chunk - 1`` tokens (issue 39; :mod:`.layout`): :mod:`.chunked` (torch,
the boundary states in the chunked WY form) and :mod:`.fused` (Triton, the same chunks) share one
signature; :mod:`.naive` is the token scan from the extend start that they replaced, kept as the
reference (the mixer's segment runner). The token math is the replay kernel's (``speculative/ops/replay``, ``ops/triton_utils.py``) and the
layer weights its :class:`~sglang_mamba_ext.speculative.replay.ReplayWeights`. No SGLang import.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import torch

from sglang_mamba_ext.speculative.ops.inchunk.layout import DEFAULT_CHUNK, chunk_layout

__all__ = ["CheckpointWrites", "plan_writes", "write_checkpoints"]


class CheckpointWrites(NamedTuple):
    """What one call writes, per request (``N`` rows, up to ``C`` destinations each).

    Attributes:
        starts: ``[N]`` int64: the row's first token in the packed inputs (``T`` axis).
        src_slots: ``[N]`` int64: the slot holding the start state (conv window and SSM
            state); ``-1``: zeros (a sequence with no prefix).
        offsets: ``[N, C]`` int64: tokens after the start (``0`` = the start state itself);
            ``-1`` pads.
        dst_slots: ``[N, C]`` int64: the slot each state goes to (``-1`` pads); never
            another row's source slot in the same call. A row's own source slot may be a
            destination with ``impl="torch"`` (the replay's write-back,
            ``ops/replay/naive.py``): the chunked pass reads every start state before it writes.
    """

    starts: torch.Tensor
    src_slots: torch.Tensor
    offsets: torch.Tensor
    dst_slots: torch.Tensor


def plan_writes(rows: Sequence[Tuple[int, int, Sequence[Tuple[int, int]]]], device) -> CheckpointWrites:
    """Pack ``[(start, src_slot, [(offset, dst_slot), ...]), ...]`` into a
    :class:`CheckpointWrites` (``C`` = the most destinations of a row; pads ``-1``)."""
    C = max((len(items) for _, _, items in rows), default=0)
    offs = [[o for o, _ in items] + [-1] * (C - len(items)) for _, _, items in rows]
    dsts = [[d for _, d in items] + [-1] * (C - len(items)) for _, _, items in rows]
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=device).reshape(len(rows), -1)  # noqa: E731
    return CheckpointWrites(
        torch.tensor([r[0] for r in rows], dtype=torch.int64, device=device),
        torch.tensor([r[1] for r in rows], dtype=torch.int64, device=device),
        t(offs) if C else torch.empty(len(rows), 0, dtype=torch.int64, device=device),
        t(dsts) if C else torch.empty(len(rows), 0, dtype=torch.int64, device=device),
    )


def write_checkpoints(
    mixed_qkv: torch.Tensor, g_raw: torch.Tensor, b_raw: torch.Tensor, writes: CheckpointWrites,
    conv_state: torch.Tensor, temporal_state: torch.Tensor, weights, impl: str = "triton",
    check_offsets: bool = True, chunk: int = DEFAULT_CHUNK, host=None, stats: Optional[dict] = None,
    chunk_states: Optional[torch.Tensor] = None, first_chunks: Optional[Sequence[int]] = None,
    row_lengths: Optional[Sequence[int]] = None,
) -> None:
    """For every request ``i`` and linear layer ``l``, run the layer's conv + gated delta rule
    from slot ``writes.src_slots[i]``'s states over tokens ``starts[i] ..`` of the inputs and
    store the conv window and SSM state reached after ``offsets[i, j]`` tokens into slot
    ``dst_slots[i, j]`` (state cast to the pool dtype; computed in fp32, with the forward's
    rounding of the post-conv activations to the inputs' dtype, as the replay). The source
    slot is only read. Each checkpoint at offset ``o`` starts from the state at the chunk
    boundary ``(o // chunk) * chunk`` (one chunked pass per row, shared by its checkpoints and
    batched over layers) and steps the ``o % chunk`` tokens after it, so its cost does not grow
    with ``o`` beyond the chunked pass (issue 39).

    Args:
        mixed_qkv: ``[L, T, conv_dim]`` raw (pre-conv) projections, contiguous.
        g_raw: ``[L, T, HV*K]`` (KDA) or ``[L, T, HV]`` (GDN) raw decay gates, contiguous.
        b_raw: ``[L, T, HV]`` raw beta logits, contiguous.
        writes: :class:`CheckpointWrites`; every ``starts[i] + offsets[i, j] <= T``.
        conv_state: ``[L, slots, conv_dim, W-1]`` view (any strides; SGLang KDA's
            ``[W-1, conv_dim]`` pool through ``.transpose(-1, -2)``).
        temporal_state: ``[L, slots, HV, K, V]`` view (SGLang's ``[HV, V, K]`` transposed).
        weights: :class:`~sglang_mamba_ext.speculative.replay.ReplayWeights` of the ``L``
            layers (``from_mixers`` for ``impl="torch"``).
        impl: ``"triton"`` (:mod:`.fused`), ``"torch"`` (:mod:`.chunked`) or ``"reference"``
            (:mod:`.naive`: the token scan from the extend start; needs ``from_mixers`` weights).
        check_offsets: check ``starts + offsets <= T`` (a device sync on CUDA; the serving
            hook, whose plan is checked on the host, passes False).
        chunk: tokens per chunk (Triton: a power of two >= 16); 64, SGLang's kernel chunk.
        host: ``(starts, offsets, dst_slots)`` as host lists (no device read; the serving glue);
            else read with ``.tolist()``.
        stats: if a dict, receives ``"scanned"`` (tokens stepped after its boundary state, per
            checkpoint; torch) and ``"chunks"`` (whole chunks of the longest chunked pass).
        chunk_states: ``[L, NT, HV, K, V]`` view: the prefill's state at the start of every
            chunk (SGLang's ``h`` transposed; :mod:`.from_chunks`). When given, a checkpoint
            past its row's first chunk starts from it instead of a chunked pass, and the
            writer's cost no longer depends on the offset; needs ``first_chunks`` and
            ``row_lengths``.
        first_chunks: ``[N]`` each row's first chunk in ``chunk_states`` (host ints).
        row_lengths: ``[N]`` each row's tokens in the prefill that computed ``chunk_states``.

    Raises:
        ValueError: shapes or gate width disagree with ``weights``, non-contiguous inputs, an
            offset past the inputs, an unknown ``impl``, or a Triton ``chunk`` that is not a power
            of two >= 16.
    """
    sh = weights.shape
    if mixed_qkv.dim() != 3 or g_raw.dim() != 3 or b_raw.dim() != 3:
        raise ValueError("write_checkpoints: mixed_qkv, g_raw, b_raw must be [L, T, *]")
    L, T, D = mixed_qkv.shape
    for t in (mixed_qkv, g_raw, b_raw, weights.conv_weight, weights.A_log, weights.dt_bias):
        if not t.is_contiguous():
            raise ValueError("write_checkpoints: inputs and stacked weights must be contiguous")
    W = sh.conv_kernel
    if (D != sh.conv_dim or weights.num_layers != L or g_raw.shape[:2] != (L, T) or b_raw.shape[:2] != (L, T)
            or conv_state.shape[0] != L or conv_state.shape[-2:] != (D, W - 1)
            or temporal_state.shape[0] != L or temporal_state.shape[-3:] != (sh.num_v_heads, sh.head_k_dim, sh.head_v_dim)):
        raise ValueError(
            f"write_checkpoints: shapes disagree with {sh} x {weights.num_layers} layers: mixed_qkv "
            f"{tuple(mixed_qkv.shape)}, g_raw {tuple(g_raw.shape)}, b_raw {tuple(b_raw.shape)}, conv_state "
            f"{tuple(conv_state.shape)}, temporal_state {tuple(temporal_state.shape)}"
        )
    want = sh.num_v_heads if weights.per_head_gate else sh.num_v_heads * sh.head_k_dim
    if g_raw.shape[-1] != want:
        raise ValueError(f"write_checkpoints: g_raw width {g_raw.shape[-1]} != {want}")
    if check_offsets and writes.offsets.numel():
        ends = writes.starts[:, None] + writes.offsets
        if bool(((writes.offsets >= 0) & (ends > T)).any()):
            raise ValueError(f"write_checkpoints: an offset reaches past the {T} input tokens")
    if impl == "reference":
        from sglang_mamba_ext.speculative.ops.inchunk.naive import write_checkpoints_torch

        write_checkpoints_torch(mixed_qkv, g_raw, b_raw, writes, conv_state, temporal_state, weights)
        return
    if impl not in ("triton", "torch"):
        raise ValueError(f"write_checkpoints: unknown impl {impl!r} (triton, torch, reference)")
    if impl == "triton" and (chunk < 16 or chunk & (chunk - 1)):
        raise ValueError(f"write_checkpoints: the Triton writer needs a chunk that is a power of two >= 16, not {chunk}")
    if chunk_states is not None:
        from sglang_mamba_ext.speculative.ops.inchunk.from_chunks import write_split, write_tail_blocks

        if first_chunks is None:
            raise ValueError("write_checkpoints: chunk_states needs first_chunks and row_lengths, one per row")
        write_split(writes, host, row_lengths, first_chunks, chunk, (mixed_qkv, g_raw, b_raw), W,
                    lambda w, h, st: write_checkpoints(mixed_qkv, g_raw, b_raw, w, conv_state, temporal_state, weights,
                                                       impl, False, chunk, h, st),
                    lambda blocks, st: write_tail_blocks(blocks, chunk_states, conv_state, temporal_state, weights,
                                                         impl, st), stats)
        return
    lay = chunk_layout(writes, chunk, host)
    if impl == "triton":
        from sglang_mamba_ext.speculative.ops.inchunk.fused import write_checkpoints_triton

        write_checkpoints_triton(mixed_qkv, g_raw, b_raw, writes, conv_state, temporal_state, weights, lay)
        if stats is not None:
            stats.update(scanned=lay.scanned(), chunks=lay.max_chunks)
    else:
        from sglang_mamba_ext.speculative.ops.inchunk.chunked import write_checkpoints_chunked

        write_checkpoints_chunked(mixed_qkv, g_raw, b_raw, writes, conv_state, temporal_state, weights, lay, stats)
