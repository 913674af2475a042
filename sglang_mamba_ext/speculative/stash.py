"""Accepted-token activation stash of the deferred-update verify (``docs/design.md``,
"Deferred update"): after a round's acceptance the deferred mode keeps, per linear layer and
request row, only the accepted tokens' raw mixer inputs (``mixed_qkv``, ``g_raw``, ``b_raw``
of ``GatedDeltaRuleMixer.project_raw``) and leaves the main conv/SSM state as it was; the next
round starts by replaying them into it (:mod:`.replay`). Rows are SGLang's ``req_pool_idx``
(``max_running_requests + 1``, row 0 reserved for padding); the main state is addressed by
``mamba_pool_idx`` slots at replay time. Layout (``L`` layers, ``R`` rows, ``A = steps + 1``
tokens at most per round): ``mixed_qkv [L, R, A, conv_dim]``, ``g_raw [L, R, A, gate_dim]``
(``HV*K`` for KDA, ``HV`` for GDN), ``b_raw [L, R, A, HV]`` in the activation dtype;
``count [R]`` int32 tokens pending; ``seq_len [R]`` int64 tokens the main state reflects
(replay crosses a ``mamba_track_interval`` boundary at token ``t`` when ``(seq_len + t + 1) %
interval == 0``); ``track_slot [R]`` int64 ping-pong slot for that crossing (``-1`` none).
Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["StashDims", "ActivationStash"]


@dataclass(frozen=True)
class StashDims:
    """Per-token widths of one linear layer's stash record (elements).

    Attributes:
        conv_dim: ``mixed_qkv`` width (``2*H*K + HV*V`` for KDA/GDN; ``d_inner + 2*G*N`` for
            Mamba2's ``xBC``).
        gate_dim: raw decay-gate width (``HV*K`` KDA, ``HV`` GDN / Mamba2 ``dt``).
        beta_dim: raw write-strength width (``HV`` for KDA/GDN; 0 for Mamba2).
    """

    conv_dim: int
    gate_dim: int
    beta_dim: int

    @property
    def per_token(self) -> int:
        """Elements stashed per accepted token per layer."""
        return self.conv_dim + self.gate_dim + self.beta_dim


class ActivationStash:
    """Per-layer, per-row stash of the accepted tokens' raw mixer inputs.

    Args:
        num_layers: ``L`` linear layers.
        num_rows: ``R`` request rows (``max_running_requests + 1``).
        max_accept: ``A`` most tokens committed per round (``speculative_num_steps + 1``).
        dims: record widths.
        dtype: activation dtype of the records.
        device: torch device.

    Raises:
        ValueError: a size is not positive.
    """

    def __init__(
        self,
        num_layers: int,
        num_rows: int,
        max_accept: int,
        dims: StashDims,
        dtype: torch.dtype = torch.bfloat16,
        device: Optional[torch.device | str] = None,
    ) -> None:
        for name, v in (("num_layers", num_layers), ("num_rows", num_rows), ("max_accept", max_accept)):
            if int(v) <= 0:
                raise ValueError(f"ActivationStash: {name} must be positive, got {v}")
        self.dims = dims
        self.num_layers, self.num_rows, self.max_accept = num_layers, num_rows, max_accept
        L, R, A = num_layers, num_rows, max_accept
        self.mixed_qkv = torch.zeros(L, R, A, dims.conv_dim, dtype=dtype, device=device)
        self.g_raw = torch.zeros(L, R, A, dims.gate_dim, dtype=dtype, device=device)
        self.b_raw = torch.zeros(L, R, A, max(dims.beta_dim, 1), dtype=dtype, device=device)
        self.count = torch.zeros(R, dtype=torch.int32, device=device)
        self.seq_len = torch.zeros(R, dtype=torch.int64, device=device)
        self.track_slot = torch.full((R,), -1, dtype=torch.int64, device=device)

    # -- sizing ---------------------------------------------------------------------------

    @staticmethod
    def bytes_for(num_layers: int, num_rows: int, max_accept: int, dims: StashDims, dtype: torch.dtype) -> int:
        """Bytes :class:`ActivationStash` allocates for these sizes (records + counters)."""
        itemsize = torch.empty((), dtype=dtype).element_size()
        beta = max(dims.beta_dim, 1)
        records = num_layers * num_rows * max_accept * (dims.conv_dim + dims.gate_dim + beta) * itemsize
        return records + num_rows * (4 + 8 + 8)

    def nbytes(self) -> int:
        """Bytes actually allocated."""
        return sum(t.numel() * t.element_size() for t in (self.mixed_qkv, self.g_raw, self.b_raw, self.count, self.seq_len, self.track_slot))

    # -- writing ----------------------------------------------------------------------------

    def write_layer(
        self,
        layer: int,
        rows: torch.Tensor,
        accept_index: torch.Tensor,
        mixed_qkv: torch.Tensor,
        g_raw: torch.Tensor,
        b_raw: torch.Tensor,
    ) -> None:
        """Copy the accepted nodes' records of one layer out of the verify activations.

        Args:
            layer: linear-layer index (0-based among the linear layers).
            rows: ``[N]`` int64 request rows.
            accept_index: ``[N, A']`` int64 accepted node indices per request (root first),
                ``-1`` padded, ``A' <= max_accept``.
            mixed_qkv / g_raw / b_raw: ``[N, T, width]`` the layer's raw inputs for every
                tree node of this round (only the accepted ones are read).

        Raises:
            ValueError: more accepted nodes than ``max_accept``.
        """
        N, Ap = accept_index.shape
        if Ap > self.max_accept:
            raise ValueError(f"ActivationStash: {Ap} accepted tokens > max_accept={self.max_accept} (--speculative-num-steps + 1)")
        valid = accept_index >= 0
        src = accept_index.clamp(min=0)
        for dst, srcs in ((self.mixed_qkv, mixed_qkv), (self.g_raw, g_raw), (self.b_raw, b_raw)):
            picked = torch.gather(srcs, 1, src[..., None].expand(N, Ap, srcs.shape[-1]))
            cur = dst[layer, rows, :Ap]
            dst[layer, rows, :Ap] = torch.where(valid[..., None], picked.to(dst.dtype), cur)

    def set_pending(self, rows: torch.Tensor, counts: torch.Tensor, seq_lens: torch.Tensor,
                    track_slots: Optional[torch.Tensor] = None) -> None:
        """Mark ``counts[i]`` tokens of ``rows[i]`` pending, the main state reflecting
        ``seq_lens[i]`` tokens; a crossing's checkpoint goes to ``track_slots[i]`` (-1: none).

        Raises:
            RuntimeError: a row still has tokens pending (they must be replayed first, or the
                main state would miss them).
        """
        if bool((self.count[rows] != 0).any()):
            raise RuntimeError(
                "ActivationStash.set_pending: rows "
                f"{rows[self.count[rows] != 0].tolist()} still hold unreplayed tokens; replay before stashing"
            )
        self.count[rows] = counts.to(torch.int32)
        self.seq_len[rows] = seq_lens.to(torch.int64)
        self.track_slot[rows] = -1 if track_slots is None else track_slots.to(torch.int64)

    def clear(self, rows: torch.Tensor) -> None:
        """Drop pending tokens of ``rows`` (request freed without keeping its state)."""
        self.count[rows] = 0

    def pending(self, rows: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool: which of ``rows`` have tokens waiting for replay."""
        return self.count[rows] > 0
