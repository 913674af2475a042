"""Replay of stashed accepted tokens into the main conv/SSM state (``docs/design.md``,
"Replay"): at the start of a round, and before a finishing request's state is cached or freed,
every request with pending stash records advances its main state along its accepted chain, for
every linear layer (conv, split, gate activation, gated-delta-rule step per token), writing a
checkpoint of ``(conv_state, S)`` into the row's ``stash.track_slot`` right after the token at
which the sequence length reaches a multiple of ``mamba_track_interval`` (SGLang asserts
``mamba_track_interval >= draft_token_num``, so one run crosses at most once; should it cross
more, the last crossing is kept). This module holds the serving-path entry :func:`replay` (the
planning, then the torch reference ``ops/replay/naive.py`` or the Triton kernels
``ops/replay/fused.py``), the stacked weights :class:`ReplayWeights` and :func:`track_steps`.
Layouts: ``conv_state`` ``[L, slots, conv_dim, W-1]`` (oldest first), ``temporal_state``
``[L, slots, HV, K, V]`` (fp32 or bf16; computed in fp32; the Triton path accepts views with
any strides). Torch only at import; no SGLang.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Optional, Sequence, Tuple

import torch

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape
from sglang_mamba_ext.speculative.stash import ActivationStash

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import Mamba2Weights

__all__ = ["ReplayPlan", "ReplayWeights", "track_steps", "replay"]


@dataclass
class ReplayWeights:
    """The per-layer weights replay needs, stacked over the ``L`` linear layers.

    Attributes:
        shape: head layout shared by all layers.
        conv_weight: ``[L, conv_dim, W]``.
        conv_bias: ``[L, conv_dim]`` or None.
        A_log: ``[L, HV]``.
        dt_bias: ``[L, HV*K]`` (KDA), ``[L, HV]`` (GDN, ``per_head_gate``).
        mixers: the source mixers (torch reference only; None when built from raw tensors).
        per_head_gate: the decay gate is one value per value head (Gated DeltaNet) instead of
            one per key channel (KDA); the stash's ``g_raw`` is then ``[.., HV]``.
    """

    shape: LinearAttnShape
    conv_weight: torch.Tensor
    conv_bias: Optional[torch.Tensor]
    A_log: torch.Tensor
    dt_bias: torch.Tensor
    mixers: Optional[Sequence[GatedDeltaRuleMixer]] = None
    per_head_gate: bool = False

    def __post_init__(self) -> None:
        s = self.shape
        want = s.num_v_heads if self.per_head_gate else s.num_v_heads * s.head_k_dim
        if self.dt_bias.shape[-1] != want:
            raise ValueError(
                f"ReplayWeights: dt_bias width {self.dt_bias.shape[-1]} != {want} "
                f"({'HV, per-head gate' if self.per_head_gate else 'HV*K, per-channel gate'})"
            )

    @classmethod
    def from_mixers(cls, mixers: Sequence[GatedDeltaRuleMixer]) -> "ReplayWeights":
        """Stack the weights of ``mixers`` (one per linear layer, same shape)."""
        if not mixers:
            raise ValueError("ReplayWeights.from_mixers: no linear layers")
        shape = mixers[0].shape
        if any(m.shape != shape or m.gate != mixers[0].gate for m in mixers):
            raise ValueError("ReplayWeights.from_mixers: linear layers have different shapes or gates")
        with torch.no_grad():
            cw = torch.stack([m.conv_weight.detach().reshape(shape.conv_dim, -1) for m in mixers])
            cb = None
            if mixers[0].conv_bias is not None:
                cb = torch.stack([m.conv_bias.detach() for m in mixers])
            A = torch.stack([m.A_log.detach() for m in mixers])
            dtb = torch.stack([m.dt_bias.detach() for m in mixers])
        return cls(shape, cw.contiguous(), None if cb is None else cb.contiguous(), A.contiguous(), dtb.contiguous(),
                   list(mixers), per_head_gate=mixers[0].gate == "gdn")

    @property
    def num_layers(self) -> int:
        return self.conv_weight.shape[0]


def track_steps(seq_lens: torch.Tensor, counts: torch.Tensor, mamba_track_interval: Optional[int]) -> torch.Tensor:
    """``[N]`` int64: the (last) step ``t < counts`` after which ``seq_lens + t + 1`` is a
    multiple of ``mamba_track_interval``, or -1 (no crossing / tracking off)."""
    if mamba_track_interval is None or mamba_track_interval <= 0:
        return torch.full_like(seq_lens, -1, dtype=torch.int64)
    seq_lens = seq_lens.to(torch.int64)
    counts = counts.to(torch.int64)
    end = seq_lens + counts
    last_mult = end // mamba_track_interval * mamba_track_interval
    t = last_mult - seq_lens - 1
    return torch.where((last_mult > seq_lens) & (counts > 0), t, torch.full_like(t, -1))


def _check(stash, rows, slots, conv_state, temporal_state, weights):
    L = weights.num_layers
    if stash.num_layers != L or conv_state.shape[0] != L or temporal_state.shape[0] != L:
        raise ValueError(
            f"replay: layer counts differ (stash {stash.num_layers}, weights {L}, conv_state "
            f"{conv_state.shape[0]}, temporal_state {temporal_state.shape[0]})"
        )
    if rows.shape != slots.shape:
        raise ValueError("replay: rows and slots must both be [N]")


class ReplayPlan(NamedTuple):
    """What one replay call does per request (``[N]`` tensors), as the ops take it.

    Attributes:
        rows: int64 stash rows.
        slots: int64 main-state slots (``mamba_pool_idx``; ``-1`` skips the request).
        counts: int64 stashed tokens to replay (0 skips the request).
        tsteps: int64 step after which the state goes to ``track_slots`` (``-1`` none).
        track_slots: int64 ping-pong slots of the checkpoints.
    """

    rows: torch.Tensor
    slots: torch.Tensor
    counts: torch.Tensor
    tsteps: torch.Tensor
    track_slots: torch.Tensor


def _plan(stash, rows, slots, mamba_track_interval, keep) -> Tuple[ReplayPlan, torch.Tensor]:
    """The per-request plan, and ``[N]`` bool: which requests write a checkpoint."""
    counts = stash.count[rows].to(torch.int64)
    if keep is not None:
        counts = torch.minimum(counts, keep.to(torch.int64).clamp(min=0))
    tsteps = track_steps(stash.seq_len[rows], counts, mamba_track_interval)
    track_slots = stash.track_slot[rows]
    tracked = (tsteps >= 0) & (track_slots >= 0) & (counts > 0) & (slots >= 0)
    tsteps = torch.where(tracked, tsteps, torch.full_like(tsteps, -1))
    return ReplayPlan(rows, slots, counts, tsteps, track_slots), tracked


def replay(
    stash: ActivationStash,
    rows: torch.Tensor,
    slots: torch.Tensor,
    conv_state: torch.Tensor,
    temporal_state: torch.Tensor,
    weights: "ReplayWeights | Mamba2Weights",
    mamba_track_interval: Optional[int] = None,
    keep: Optional[torch.Tensor] = None,
    impl: str = "triton",
) -> torch.Tensor:
    """Replay pending stash records into the main state, in place; clears the replayed rows.

    Args:
        stash: the pending records.
        rows: ``[N]`` int64 stash rows to replay (rows with ``count == 0`` are skipped).
        slots: ``[N]`` int64 main-state slots of those rows (``mamba_pool_idx``); ``-1`` skips.
        conv_state, temporal_state: pools, layouts in the module docstring (written in place).
        weights: the stacked layer weights (``impl="torch"``: the mixers' own math when built
            with ``from_mixers``, else the in-chunk writer's torch path), or a
            Mamba2 target's :class:`~.ops.inchunk.mamba2.Mamba2Weights` (then ``stash.mixed_qkv``
            holds ``xBC``, ``stash.g_raw`` the raw ``dt``, and ``temporal_state`` is
            ``[L, slots, HV, P, N]``: :mod:`.ops.replay.mamba2`).
        mamba_track_interval: tokens between checkpoints; None disables tracking. The
            checkpoint goes to the row's ``stash.track_slot`` (``-1`` none).
        keep: ``[N]`` optional cap on the tokens replayed per row (a request that finished
            inside its accepted run keeps ``len(prompt + output) - 1 - stash.seq_len``
            tokens; the rest are dropped with the row's records).
        impl: ``"triton"`` (:mod:`.ops.replay.fused`; needs CUDA or ``TRITON_INTERPRET=1``)
            or ``"torch"`` (:mod:`.ops.replay.naive`; CPU serving).

    Returns:
        ``[N]`` bool: which rows wrote a checkpoint (the caller flips its ping-pong index).

    Raises:
        ValueError: unknown ``impl`` or inconsistent shapes.
    """
    if impl not in ("triton", "torch"):
        raise ValueError(f"replay: impl must be 'triton' or 'torch', got {impl!r}")
    if isinstance(weights, ReplayWeights):
        if impl == "torch":
            from sglang_mamba_ext.speculative.ops.replay import naive

            run = naive.replay_torch if weights.mixers is not None else naive.replay_torch_from_weights
        else:
            from sglang_mamba_ext.speculative.ops.replay.fused import replay_triton as run
    else:  # Mamba2Weights: a Mamba2 layer's conv + selective state update (ops/replay/mamba2.py)
        from sglang_mamba_ext.speculative.ops.replay import mamba2

        mamba2.check_mamba2_replay(stash, conv_state, temporal_state, weights)
        run = mamba2.replay_mamba2_torch if impl == "torch" else mamba2.replay_mamba2_triton
    _check(stash, rows, slots, conv_state, temporal_state, weights)
    plan, tracked = _plan(stash, rows, slots, mamba_track_interval, keep)
    run(stash, plan, conv_state, temporal_state, weights)
    stash.count[rows] = 0
    return tracked
