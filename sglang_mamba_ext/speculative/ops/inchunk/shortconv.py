"""In-chunk checkpoint writer for short-convolution layers (LFM2's gated short conv,
``sglang/srt/models/lfm2.py``: ``in_proj -> B, C, x``; ``Bx = B * x`` runs through a causal
depthwise conv whose only state is its window): the conv window after any token offset of a
prefill, i.e. the last ``W-1`` columns of ``[start window, Bx of the tokens]`` before the
offset (issue 24, item 3; ``docs/design.md``, "Prefix checkpoints"). Same plan as the GDN / KDA
writer (:class:`..CheckpointWrites`); the Triton path is that writer's layout-agnostic
conv-window kernel, the torch path a loop beside it. No SGLang import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.ops.inchunk import CheckpointWrites

__all__ = ["write_conv_window_checkpoints"]


def write_conv_window_checkpoints(conv_in: torch.Tensor, writes: "CheckpointWrites", conv_state: torch.Tensor,
                                  impl: str = "triton", BD: int = 256) -> None:
    """For every request ``i`` and layer ``l``, store into slot ``dst_slots[i, j]`` the conv
    window after ``offsets[i, j]`` tokens from ``starts[i]``: the last ``W-1`` columns of slot
    ``src_slots[i]``'s window (zeros for ``-1``) followed by ``conv_in[l, starts[i]:]``. The source
    slot is only read.

    Args:
        conv_in: ``[L, T, D]`` the conv's raw input per token (LFM2: ``Bx``), contiguous.
        writes: :class:`..CheckpointWrites`; every ``starts[i] + offsets[i, j] <= T``.
        conv_state: ``[L, slots, D, W-1]`` view (any strides), written in its dtype.
        impl: ``"triton"`` or ``"torch"``.
        BD: channel tile of the Triton kernel.

    Raises:
        ValueError: shapes disagree, non-contiguous ``conv_in``, an offset past the inputs, or
            an unknown ``impl``.
    """
    if conv_in.dim() != 3 or not conv_in.is_contiguous():
        raise ValueError("write_conv_window_checkpoints: conv_in must be a contiguous [L, T, D]")
    L, T, D = conv_in.shape
    if conv_state.dim() != 4 or conv_state.shape[0] != L or conv_state.shape[2] != D:
        raise ValueError(f"write_conv_window_checkpoints: conv_state {tuple(conv_state.shape)} is not "
                         f"[{L}, slots, {D}, W-1]")
    W = conv_state.shape[-1] + 1
    if writes.offsets.numel():
        ends = writes.starts[:, None] + writes.offsets
        if bool(((writes.offsets >= 0) & (ends > T)).any()):
            raise ValueError(f"write_conv_window_checkpoints: an offset reaches past the {T} input tokens")
    R, C = writes.offsets.shape
    if R == 0 or C == 0:
        return
    if impl == "torch":  # W-1 columns per destination, whatever its offset (issue 39)
        starts, srcs, offs, dsts = (x.tolist() for x in writes)
        for i in range(R):
            for o, d in zip(offs[i], dsts[i]):
                if o < 0 or d < 0:
                    continue
                keep = min(o, W - 1)  # columns from the tokens; the rest from the start window
                for l in range(L):
                    win = (conv_state[l, srcs[i]].float() if srcs[i] >= 0
                           else torch.zeros(D, W - 1, device=conv_in.device))
                    toks = conv_in[l, starts[i] + o - keep:starts[i] + o].float().t()
                    conv_state[l, d] = torch.cat([win[:, keep:], toks], dim=1).to(conv_state.dtype)
    elif impl == "triton":
        import triton

        from sglang_mamba_ext.speculative.ops.inchunk.fused import _inchunk_conv_window_kernel
        from sglang_mamba_ext.speculative.ops.triton_utils import launch_scope

        starts, srcs, offs, dsts = (x.to(torch.int64).contiguous() for x in writes)
        BDv = min(BD, triton.next_power_of_2(D))
        with launch_scope(_inchunk_conv_window_kernel):
            _inchunk_conv_window_kernel[(R * L * C, triton.cdiv(D, BDv))](
                conv_in, T, starts, srcs, offs, dsts, conv_state, *conv_state.stride(),
                L=L, C=C, D=D, W=W, BD=BDv,
            )
    else:
        raise ValueError(f"write_conv_window_checkpoints: unknown impl {impl!r} (triton, torch)")
