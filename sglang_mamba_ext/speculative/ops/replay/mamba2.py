"""Replay of stashed accepted tokens into a Mamba2 layer's main conv window and SSM state
(issue 41, item 3; ``docs/design.md``, "Deferred update" and "Replay"): the deferred verify's
state update for Nemotron-H-style targets. The stash holds, per layer, request row and
accepted token, the layer's raw verify inputs: ``xBC`` before the causal conv (in
``stash.mixed_qkv``, ``[L, R, A, D]``, ``D = HV*P + 2*G*N``) and ``dt`` before ``dt_bias`` and
softplus (in ``stash.g_raw``, ``[L, R, A, HV]``); ``stash.b_raw`` is unused. Per token and head
the step is the one SGLang's ``MambaMixer2`` makes at decode (``srt/layers/attention/mamba/mamba.py``,
``selective_state_update`` with ``dt_softplus=True``; the formula in
:mod:`..inchunk.mamba2`): conv + bias + SiLU (rounded to the activation dtype), then
``h = exp(dt*A) * h + dt * x (outer) B``.

- :func:`replay_mamba2_torch`: the reference, through the in-chunk writer's token scan
  (:func:`..inchunk.mamba2.write_mamba2_checkpoints_torch`, which computes every state of a
  layer before writing any, so its start slot may also be its destination here).
- :func:`replay_mamba2_triton`: ``_replay_mamba2_kernel`` (grid ``(N * L, HV, cdiv(P, BP))``,
  one ``[BP, N]`` state tile in registers, loaded and stored once, plus once into the track
  slot after the crossing token), then the GDN / KDA replay's conv-window kernel
  (layout-agnostic), which shifts each window by the row's count afterwards.

Layouts: ``conv_state [L, slots, D, W-1]``, ``temporal_state [L, slots, HV, P, N]`` (SGLang's
Mamba2 pool; any strides), weights :class:`..inchunk.mamba2.Mamba2Weights`. No SGLang import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from sglang_mamba_ext.speculative.ops.replay.fused import _replay_conv_window_kernel, _request
from sglang_mamba_ext.speculative.ops.triton_utils import launch_scope, mamba2_token_step

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import Mamba2Weights
    from sglang_mamba_ext.speculative.replay import ReplayPlan
    from sglang_mamba_ext.speculative.stash import ActivationStash

__all__ = ["replay_mamba2_torch", "replay_mamba2_triton", "check_mamba2_replay"]


def check_mamba2_replay(stash: "ActivationStash", conv_state: torch.Tensor, temporal_state: torch.Tensor,
                        weights: "Mamba2Weights") -> None:
    """Check the stash, pools and weights agree (``D = HV*P + 2*G*N``, ``dt`` width ``HV``).

    Raises:
        ValueError: naming the shape that disagrees.
    """
    L, R, A, D = stash.mixed_qkv.shape
    HV, P, N, G, W = weights.num_heads, weights.head_dim, weights.d_state, weights.n_groups, weights.conv_kernel
    if HV % G:
        raise ValueError(f"replay (Mamba2): {HV} heads not a multiple of {G} groups")
    if (D != weights.conv_dim or D != HV * P + 2 * G * N or stash.g_raw.shape[-1] != HV
            or conv_state.shape[-2:] != (D, W - 1) or temporal_state.shape[-3:] != (HV, P, N)):
        raise ValueError(
            f"replay (Mamba2): shapes disagree (HV={HV}, P={P}, N={N}, G={G}, W={W}, D={weights.conv_dim}): "
            f"stash xBC {tuple(stash.mixed_qkv.shape)}, dt {tuple(stash.g_raw.shape)}, conv_state "
            f"{tuple(conv_state.shape)}, temporal_state {tuple(temporal_state.shape)}"
        )


def replay_mamba2_torch(stash: "ActivationStash", plan: "ReplayPlan", conv_state: torch.Tensor,
                        temporal_state: torch.Tensor, weights: "Mamba2Weights") -> None:
    """Replay ``plan.counts[i]`` stashed tokens of row ``plan.rows[i]`` into slot
    ``plan.slots[i]`` (and the state after step ``plan.tsteps[i]`` into its track slot), in
    place; a loop over requests. Contract: :func:`sglang_mamba_ext.speculative.replay.replay`."""
    from sglang_mamba_ext.speculative.ops.inchunk import plan_writes
    from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_checkpoints_torch

    for i in range(plan.rows.shape[0]):
        r, s, c = int(plan.rows[i]), int(plan.slots[i]), int(plan.counts[i])
        if c == 0 or s < 0:
            continue
        items = [(c, s)]
        if int(plan.tsteps[i]) >= 0:
            items.insert(0, (int(plan.tsteps[i]) + 1, int(plan.track_slots[i])))
        writes = plan_writes([(0, s, items)], stash.mixed_qkv.device)
        write_mamba2_checkpoints_torch(stash.mixed_qkv[:, r, :c].contiguous(), stash.g_raw[:, r, :c].contiguous(),
                                       writes, conv_state, temporal_state, weights)


@triton.jit
def _replay_mamba2_kernel(
    xbc_ptr, dt_ptr,
    rows_ptr, slots_ptr, counts_ptr, tstep_ptr, tslot_ptr,
    conv_ptr, s_cl, s_cs, s_cd, s_cw,
    state_ptr, s_sl, s_ss, s_sh, s_sp, s_sn,
    cw_ptr, cb_ptr, a_ptr, dtb_ptr, DT_MIN, DT_MAX,
    L: tl.constexpr, R: tl.constexpr, A: tl.constexpr, D: tl.constexpr, HV: tl.constexpr, G: tl.constexpr,
    P: tl.constexpr, N: tl.constexpr, W: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    i_nl = tl.program_id(0)
    i_h = tl.program_id(1)
    i_p = tl.program_id(2)
    i_l = i_nl % L
    r, s, c, tstep, tslot = _request(rows_ptr, slots_ptr, counts_ptr, tstep_ptr, tslot_ptr, i_nl // L)
    if (c > 0) & (s >= 0):
        offs_p = i_p * BP + tl.arange(0, BP)
        offs_n = tl.arange(0, BN)
        mp = offs_p < P
        mn = offs_n < N
        cx = i_h * P + offs_p                            # x channels of this head
        cB = HV * P + (i_h // (HV // G)) * N + offs_n    # B channels of its group
        conv_base = conv_ptr + i_l * s_cl + s * s_cs     # the main window, still unshifted
        row = (i_l * R + r) * A                          # the row's first stashed token
        cw_base = cw_ptr + i_l * D * W
        cbias = cb_ptr + i_l * D
        st_base = state_ptr + i_l * s_sl + i_h * s_sh
        tile = offs_p[:, None] * s_sp + offs_n[None, :] * s_sn
        m2 = mp[:, None] & mn[None, :]
        S = tl.load(st_base + s * s_ss + tile, mask=m2, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + i_l * HV + i_h).to(tl.float32)
        dtb = tl.load(dtb_ptr + i_l * HV + i_h).to(tl.float32)
        act_ty = xbc_ptr.dtype.element_ty
        for t in tl.static_range(A):
            if t < c:
                S = mamba2_token_step(S, conv_base, s_cd, s_cw, xbc_ptr, row, cw_base, cbias, cx, cB, mp, mn, t, True,
                                      dt_ptr + (row + t) * HV + i_h, a, dtb, DT_MIN, DT_MAX, act_ty, D, W, HAS_BIAS)
                if t == tstep:
                    tl.store(st_base + tslot * s_ss + tile, S.to(state_ptr.dtype.element_ty), mask=m2)
        tl.store(st_base + s * s_ss + tile, S.to(state_ptr.dtype.element_ty), mask=m2)


def replay_mamba2_triton(stash: "ActivationStash", plan: "ReplayPlan", conv_state: torch.Tensor,
                         temporal_state: torch.Tensor, weights: "Mamba2Weights", BP: int = 32, BD: int = 256) -> None:
    """Launch the state kernel, then the conv-window kernel (in place; the stash is not
    modified). Contract: :func:`replay_mamba2_torch`; ``BP`` / ``BD``: head-channel and
    conv-channel tile sizes.

    Raises:
        ValueError: non-contiguous records or weights.
    """
    xbc, dt = stash.mixed_qkv, stash.g_raw
    for t in (xbc, dt, weights.conv_weight, weights.A, weights.dt_bias):
        if not t.is_contiguous():
            raise ValueError("replay_mamba2_triton: stash records and stacked weights must be contiguous")
    L, R, A, D = xbc.shape
    HV, P, N, G, W = weights.num_heads, weights.head_dim, weights.d_state, weights.n_groups, weights.conv_kernel
    n = plan.rows.shape[0]
    if n == 0:
        return
    idx = [x.to(torch.int64).contiguous() for x in plan]
    BPv = min(BP, triton.next_power_of_2(P))
    BDv = min(BD, triton.next_power_of_2(D))
    has_bias = weights.conv_bias is not None
    cb = weights.conv_bias if has_bias else weights.conv_weight  # dummy pointer
    lo_dt, hi_dt = weights.dt_limit
    with launch_scope(_replay_mamba2_kernel):
        _replay_mamba2_kernel[(n * L, HV, triton.cdiv(P, BPv))](
            xbc, dt, *idx,
            conv_state, *conv_state.stride(),
            temporal_state, *temporal_state.stride(),
            weights.conv_weight, cb, weights.A, weights.dt_bias, float(lo_dt), float(min(hi_dt, 3.0e38)),
            L=L, R=R, A=A, D=D, HV=HV, G=G, P=P, N=N, W=W, BP=BPv, BN=triton.next_power_of_2(N),
            HAS_BIAS=has_bias,
        )
    with launch_scope(_replay_conv_window_kernel):
        _replay_conv_window_kernel[(n * L, triton.cdiv(D, BDv))](
            xbc, *idx,
            conv_state, *conv_state.stride(),
            L=L, R=R, A=A, D=D, W=W, BD=BDv,
        )
