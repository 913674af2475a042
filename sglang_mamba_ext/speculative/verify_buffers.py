"""Verify-state buffers of both speculative modes and the snapshot commit (``docs/design.md``,
"Speculative verify" and "Deferred update"). A verify forward gives every tree node of a linear
layer its parent's state; where the node states live is the difference between the modes:
**snapshot** (SGLang today) keeps every layer's node states in :class:`SnapshotBuffers`
``[L, R, T, ...]`` until acceptance, then :func:`commit_snapshot` copies the last accepted
node's state of every layer into the main state (and the interval-crossing node's into the
track slot); **deferred** reuses one layer's :class:`OneLayerBuffer` ``[R, T, ...]`` for all
layers (optionally a group of value heads at a time), or no buffer at all with the on-chip
kernel of ``ops/verify/fused.py``. ``R = max_running_requests + 1`` rows. Pure torch.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_mamba_ext.models.linear_attn import LinearAttnShape

__all__ = ["SnapshotBuffers", "OneLayerBuffer", "commit_snapshot"]


class SnapshotBuffers:
    """SGLang's per-layer intermediate buffers (``memory_pool.py``: ``intermediate_ssm`` and the
    dense ``intermediate_conv_window``), this project's CPU twin for the reference and the
    planner.

    ``ssm``: ``[L, R, T, HV, K, V]`` (``ssm_dtype``); ``conv``: ``[L, R, T, conv_dim, W-1]``
    (``conv_dtype``). Resident for the server's life.
    """

    def __init__(self, num_layers: int, num_rows: int, draft_token_num: int, shape: LinearAttnShape,
                 ssm_dtype=torch.float32, conv_dtype=torch.float32, device=None) -> None:
        s = shape
        self.ssm = torch.zeros(num_layers, num_rows, draft_token_num, *s.temporal_state_shape, dtype=ssm_dtype, device=device)
        self.conv = torch.zeros(num_layers, num_rows, draft_token_num, *s.conv_state_shape, dtype=conv_dtype, device=device)

    def layer(self, l: int):
        """``(ssm [R, T, HV, K, V], conv [R, T, conv_dim, W-1])`` views of layer ``l``."""
        return self.ssm[l], self.conv[l]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ssm, self.conv))

    @staticmethod
    def bytes_for(num_layers, num_rows, draft_token_num, shape: LinearAttnShape, ssm_bytes: int, conv_bytes: int) -> int:
        s = shape
        per = s.num_v_heads * s.head_k_dim * s.head_v_dim * ssm_bytes + s.conv_dim * (s.conv_kernel - 1) * conv_bytes
        return num_layers * num_rows * draft_token_num * per


class OneLayerBuffer:
    """The deferred mode's reusable verify buffer: one layer's node states.

    ``ssm``: ``[R, T, head_chunk, K, V]``; ``conv``: ``[R, T, conv_dim, W-1]``. Every linear
    layer overwrites it; ``head_chunk < HV`` makes the recurrence run over value-head groups
    of that size, one group at a time (``HV % head_chunk == 0`` and ``head_chunk`` a multiple
    of ``HV // H``).

    Raises:
        ValueError: ``head_chunk`` does not split the heads evenly.
    """

    def __init__(self, num_rows: int, draft_token_num: int, shape: LinearAttnShape, head_chunk: Optional[int] = None,
                 ssm_dtype=torch.float32, conv_dtype=torch.float32, device=None) -> None:
        s = shape
        hc = s.num_v_heads if head_chunk is None else int(head_chunk)
        G = s.num_v_heads // s.num_k_heads
        if hc <= 0 or s.num_v_heads % hc != 0 or hc % G != 0:
            raise ValueError(
                f"OneLayerBuffer: head_chunk={hc} must divide HV={s.num_v_heads} and be a multiple of HV/H={G}"
            )
        self.head_chunk = hc
        self.ssm = torch.zeros(num_rows, draft_token_num, hc, s.head_k_dim, s.head_v_dim, dtype=ssm_dtype, device=device)
        self.conv = torch.zeros(num_rows, draft_token_num, *s.conv_state_shape, dtype=conv_dtype, device=device)

    def layer(self, l: int):
        """The same tensors for every layer (the point of the mode)."""
        return self.ssm, self.conv

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ssm, self.conv))

    @staticmethod
    def bytes_for(num_rows, draft_token_num, shape: LinearAttnShape, ssm_bytes: int, conv_bytes: int, head_chunk=None) -> int:
        s = shape
        hc = s.num_v_heads if head_chunk is None else head_chunk
        per = hc * s.head_k_dim * s.head_v_dim * ssm_bytes + s.conv_dim * (s.conv_kernel - 1) * conv_bytes
        return num_rows * draft_token_num * per


def commit_snapshot(
    snap: SnapshotBuffers,
    rows: torch.Tensor,
    slots: torch.Tensor,
    last_node: torch.Tensor,
    conv_state: torch.Tensor,
    temporal_state: torch.Tensor,
    track_slots: Optional[torch.Tensor] = None,
    track_node: Optional[torch.Tensor] = None,
) -> None:
    """Snapshot-mode commit (SGLang ``update_mamba_state_after_mtp_verify``): for every layer,
    ``main[slot] = buffer[row, last_node]``; and ``main[track_slot] = buffer[row, track_node]``
    where ``track_node >= 0`` (the accepted node at which the sequence reaches a multiple of
    ``mamba_track_interval``).

    Args:
        rows, slots, last_node: ``[N]`` int64.
        conv_state ``[L, slots, conv_dim, W-1]``, temporal_state ``[L, slots, HV, K, V]``.
        track_slots, track_node: ``[N]`` int64 or None.
    """
    temporal_state[:, slots] = snap.ssm[:, rows, last_node].to(temporal_state.dtype)
    conv_state[:, slots] = snap.conv[:, rows, last_node].to(conv_state.dtype)
    if track_slots is not None and track_node is not None:
        m = (track_node >= 0) & (track_slots >= 0)
        if bool(m.any()):
            temporal_state[:, track_slots[m]] = snap.ssm[:, rows[m], track_node[m]].to(temporal_state.dtype)
            conv_state[:, track_slots[m]] = snap.conv[:, rows[m], track_node[m]].to(conv_state.dtype)
