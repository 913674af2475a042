"""Reference of the in-chunk checkpoint writer (``docs/design.md``, "Prefix checkpoints";
``impl="reference"``): the token scan from the extend start that the chunked writers replaced
(issue 39), its cost growing with the offset; kept as the oracle of their tests and the "old"
side of ``benchmarks/checkpoint_cost``. Per request and linear layer, the raw gates are activated
(``GatedDeltaRuleMixer.activate_gates``) and the tokens run through the mixer's own segment
runner (``GatedDeltaRuleMixer.run_segments``) from the start state, cut at the requested
offsets, each cut's states copied into its destination slot. Same signature and results (to
float rounding) as :mod:`.chunked` and :mod:`.fused`. Plain torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.ops.inchunk import CheckpointWrites
    from sglang_mamba_ext.speculative.replay import ReplayWeights

__all__ = ["write_checkpoints_torch", "states_at_offsets"]


def write_checkpoints_torch(
    mixed_qkv: torch.Tensor, g_raw: torch.Tensor, b_raw: torch.Tensor, writes: "CheckpointWrites",
    conv_state: torch.Tensor, temporal_state: torch.Tensor, weights: "ReplayWeights",
) -> None:
    """Contract: :func:`sglang_mamba_ext.speculative.ops.inchunk.write_checkpoints`.

    Raises:
        ValueError: ``weights`` carries no mixers (built from raw tensors).
    """
    if weights.mixers is None:
        raise ValueError("write_checkpoints (torch) needs ReplayWeights.from_mixers(...) (the layer math)")
    starts, srcs, offs, dsts = (x.tolist() for x in writes)
    for i in range(len(starts)):
        items = [(o, d) for o, d in zip(offs[i], dsts[i]) if o >= 0 and d >= 0]
        if not items:
            continue
        lo, src = starts[i], srcs[i]
        n = max(o for o, _ in items)
        for l, mixer in enumerate(weights.mixers):
            conv0 = conv_state[l, src].float() if src >= 0 else None
            S0 = temporal_state[l, src].float() if src >= 0 else None
            if conv0 is None:
                s = mixer.shape
                conv0 = torch.zeros(s.conv_dim, s.conv_kernel - 1, dtype=torch.float32, device=mixed_qkv.device)
                S0 = torch.zeros(s.num_v_heads, s.head_k_dim, s.head_v_dim, dtype=torch.float32,
                                 device=mixed_qkv.device)
            reached = {}

            def keep(off, conv, S, reached=reached):
                reached[off] = (conv.clone(), S.clone())

            g, beta = mixer.activate_gates(g_raw[l, lo:lo + n], b_raw[l, lo:lo + n])
            mixer.run_segments(mixed_qkv[l, lo:lo + n], g, beta, conv0, S0,
                               cuts=[o for o, _ in items], on_cut=keep)
            for o, d in items:
                conv, S = reached[o]
                conv_state[l, d] = conv.to(conv_state.dtype)
                temporal_state[l, d] = S.to(temporal_state.dtype)


def states_at_offsets(h: torch.Tensor, n: int, offsets, step) -> list:
    """A token recurrence's states at ``offsets`` (the writers' test oracles): ``h`` is the
    start state, ``step(t, h)`` returns the state after token ``t`` of ``n``; returns a copy of
    the state after each offset's first ``offset`` tokens, in ascending order of ``offsets``
    (an offset past ``n`` gets the state after all ``n``)."""
    out, want = [], sorted(offsets)
    for t in range(max(want, default=0) + 1):
        while want and want[0] == t:
            out.append(h.clone())
            want.pop(0)
        if t < n:
            h = step(t, h)
    return out
