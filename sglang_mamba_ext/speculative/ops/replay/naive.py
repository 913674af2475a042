"""Torch reference replay of stashed accepted tokens into the main conv/SSM state
(``docs/design.md``, "Replay"): for every request and linear layer, the stashed raw gates are
activated (``GatedDeltaRuleMixer.activate_gates``) and the stashed ``mixed_qkv`` run through
the mixer's own segment runner (``GatedDeltaRuleMixer.run_segments``: conv -> split ->
recurrence), cut after the token at which the sequence crosses a ``mamba_track_interval``
boundary so that the state there lands in the request's track slot. Same signature and results
(to float rounding) as the Triton kernels of :mod:`.fused`; a loop over requests, for tests and
the reference decode loop. :func:`replay_torch_from_weights` does the same from raw weights
(no mixers) through the in-chunk writer's torch path: CPU serving's replay. Plain torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.replay import ReplayPlan, ReplayWeights
    from sglang_mamba_ext.speculative.stash import ActivationStash

__all__ = ["replay_torch", "replay_torch_from_weights"]


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


def replay_torch_from_weights(
    stash: "ActivationStash", plan: "ReplayPlan", conv_state: torch.Tensor, temporal_state: torch.Tensor,
    weights: "ReplayWeights",
) -> None:
    """:func:`replay_torch` for weights built from raw tensors (a served model's layers, no
    mixers): each request's stashed tokens go through the in-chunk checkpoint writer's torch
    path (``ops/inchunk``, ``impl="torch"``: the same conv -> split -> gated delta rule from a
    slot's state), which stores the state after all ``counts[i]`` tokens back into the request's
    slot and, where the plan crosses a track boundary, the state after ``tsteps[i] + 1`` tokens
    into its track slot. The CPU serving path of the deferred update (on CUDA: :mod:`.fused`).

    Args and layouts: as :func:`replay_torch` (``weights`` from raw tensors or mixers).
    """
    from sglang_mamba_ext.speculative.ops.inchunk import plan_writes, write_checkpoints

    rows, parts, start = [], [], 0
    for i in range(plan.rows.shape[0]):
        r, s, c = int(plan.rows[i]), int(plan.slots[i]), int(plan.counts[i])
        if c == 0 or s < 0:
            continue
        cut, ts = int(plan.tsteps[i]) + 1, int(plan.track_slots[i])
        items = [(cut, ts)] if cut > 0 and ts >= 0 else []
        rows.append((start, s, items + [(c, s)]))
        parts.append((r, c))
        start += c
    if not rows:
        return

    def packed(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[:, r, :c] for r, c in parts], dim=1).contiguous()

    write_checkpoints(packed(stash.mixed_qkv), packed(stash.g_raw), packed(stash.b_raw),
                      plan_writes(rows, conv_state.device), conv_state, temporal_state, weights, impl="torch")
