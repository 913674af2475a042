"""Torch reference replay of stashed accepted tokens into the main conv/SSM state
(``docs/design.md``, "Replay"): for every request and linear layer, the stashed raw gates are
activated (``GatedDeltaRuleMixer.activate_gates``) and the stashed ``mixed_qkv`` run through
the mixer's own segment runner (``GatedDeltaRuleMixer.run_segments``: conv -> split ->
recurrence), cut after the token at which the sequence crosses a ``mamba_track_interval``
boundary so that the state there lands in the request's track slot. Same signature and results
(to float rounding) as the Triton kernels of :mod:`.fused`; a loop over requests, for tests and
the reference decode loop. Plain torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.replay import ReplayPlan, ReplayWeights
    from sglang_mamba_ext.speculative.stash import ActivationStash

__all__ = ["replay_torch"]


def replay_torch(
    stash: "ActivationStash", plan: "ReplayPlan", conv_state: torch.Tensor, temporal_state: torch.Tensor,
    weights: "ReplayWeights",
) -> None:
    """Replay ``plan.counts[i]`` stashed tokens of row ``plan.rows[i]`` into slot
    ``plan.slots[i]``, in place (the stash itself is not modified).

    Args:
        stash: the records ``mixed_qkv``, ``g_raw``, ``b_raw`` ``[L, R, A, *]``.
        plan: per request: row, slot (``-1`` skips), count (0 skips), crossing step
            (``-1`` none) and track slot.
        conv_state: ``[L, slots, conv_dim, W-1]``; temporal_state ``[L, slots, HV, K, V]``
            (any float dtype, computed in fp32); written in place.
        weights: built with ``ReplayWeights.from_mixers`` (the layer math).

    Raises:
        ValueError: ``weights`` carries no mixers (built from raw tensors).
    """
    if weights.mixers is None:
        raise ValueError("replay (torch) needs ReplayWeights.from_mixers(...) (the layer math)")
    for i in range(plan.rows.shape[0]):
        r, s, c = int(plan.rows[i]), int(plan.slots[i]), int(plan.counts[i])
        if c == 0 or s < 0:
            continue
        cut, ts = int(plan.tsteps[i]) + 1, int(plan.track_slots[i])
        for l, mixer in enumerate(weights.mixers):

            def track(offset: int, conv: torch.Tensor, S: torch.Tensor, l: int = l) -> None:
                conv_state[l, ts] = conv
                temporal_state[l, ts] = S.to(temporal_state.dtype)

            g, beta = mixer.activate_gates(stash.g_raw[l, r, :c], stash.b_raw[l, r, :c])
            _, conv, S = mixer.run_segments(
                stash.mixed_qkv[l, r, :c], g, beta, conv_state[l, s], temporal_state[l, s].float(),
                cuts=[cut] if cut > 0 else [], on_cut=track,
            )
            conv_state[l, s] = conv
            temporal_state[l, s] = S.to(temporal_state.dtype)
