"""Triton replay of stashed accepted tokens into the main conv/SSM state (``docs/design.md``,
"Replay"); torch reference: :mod:`.naive`, same signature. Two launches cover all linear layers
and requests: ``_replay_recurrent_kernel`` (grid ``(N * L, HV, cdiv(V, BV))``) keeps one
``[K, BV]`` tile of a value head's SSM state in registers and, per pending token, recomputes
the head's post-conv ``k`` and ``v`` from the *old* conv window and the stashed ``mixed_qkv``
(conv, bias, SiLU, the forward's rounding to the activation dtype, per-head L2 norm), activates
the stashed raw gates (per key channel, KDA, or per value head, GDN: ``PER_HEAD_GATE``) and applies :func:`~..triton_utils.gated_delta_step` (tile loaded once,
stored once, plus once into the track slot after the crossing token; no output ``o``);
``_replay_conv_window_kernel`` (grid ``(N * L, cdiv(conv_dim, BD))``), launched after it,
shifts each conv window by the row's count and writes the track slot's window. States are read
through strides, so SGLang's transposed KDA layouts pass as views (conv ``[.., W-1, dim]`` as
``[.., dim, W-1]``, temporal ``[.., HV, V, K]`` via ``.transpose(-1, -2)``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from sglang_mamba_ext.speculative.ops.triton_utils import gated_delta_step, launch_scope, raw_decay_beta, silu_l2_kv

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.replay import ReplayPlan, ReplayWeights
    from sglang_mamba_ext.speculative.stash import ActivationStash

__all__ = ["replay_triton"]


# The replay arguments of request i_n: stash row, main slot, pending count, crossing step
# (-1 none) and track slot.
@triton.jit
def _request(rows_ptr, slots_ptr, counts_ptr, tstep_ptr, tslot_ptr, i_n):
    r = tl.load(rows_ptr + i_n).to(tl.int64)
    s = tl.load(slots_ptr + i_n).to(tl.int64)
    c = tl.load(counts_ptr + i_n).to(tl.int32)
    tstep = tl.load(tstep_ptr + i_n).to(tl.int32)
    tslot = tl.load(tslot_ptr + i_n).to(tl.int64)
    return r, s, c, tstep, tslot


@triton.jit
def _replay_recurrent_kernel(
    mixed_ptr, graw_ptr, braw_ptr,
    rows_ptr, slots_ptr, counts_ptr, tstep_ptr, tslot_ptr,
    conv_ptr, s_cl, s_cs, s_cd, s_cw,
    state_ptr, s_sl, s_ss, s_sh, s_sk, s_sv,
    cw_ptr, cb_ptr, alog_ptr, dtb_ptr,
    L: tl.constexpr, R: tl.constexpr, A: tl.constexpr, D: tl.constexpr,
    GD: tl.constexpr, BD_: tl.constexpr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, EPS: tl.constexpr,
    HAS_BIAS: tl.constexpr, PER_HEAD_GATE: tl.constexpr,
):
    i_nl = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_l = i_nl % L
    r, s, c, tstep, tslot = _request(rows_ptr, slots_ptr, counts_ptr, tstep_ptr, tslot_ptr, i_nl // L)
    if (c > 0) & (s >= 0):
        i_h = i_hv // (HV // H)
        offs_k = tl.arange(0, BK)
        offs_v = i_v * BV + tl.arange(0, BV)
        mk = offs_k < K
        mv = offs_v < V
        ck = H * K + i_h * K + offs_k
        cv = 2 * H * K + i_hv * V + offs_v

        conv_base = conv_ptr + i_l * s_cl + s * s_cs
        row = (i_l * R + r) * A
        cw_base = cw_ptr + i_l * D * W
        cb_base = cb_ptr + i_l * D
        st_base = state_ptr + i_l * s_sl + i_hv * s_sh
        tile = offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
        mkv = mk[:, None] & mv[None, :]
        S = tl.load(st_base + s * s_ss + tile, mask=mkv, other=0.0).to(tl.float32)
        neg_a = -tl.exp(tl.load(alog_ptr + i_l * HV + i_hv).to(tl.float32))
        act_ty = mixed_ptr.dtype.element_ty

        for t in tl.static_range(A):
            if t < c:
                # conv input column m = t + j: old window for m < W-1, else stashed token m-(W-1)
                yk = tl.zeros([BK], dtype=tl.float32)
                yv = tl.zeros([BV], dtype=tl.float32)
                for j in tl.static_range(W):
                    m = t + j
                    if m < W - 1:
                        xk = tl.load(conv_base + ck * s_cd + m * s_cw, mask=mk, other=0.0).to(tl.float32)
                        xv = tl.load(conv_base + cv * s_cd + m * s_cw, mask=mv, other=0.0).to(tl.float32)
                    else:
                        tok = mixed_ptr + (row + (m - (W - 1))) * D
                        xk = tl.load(tok + ck, mask=mk, other=0.0).to(tl.float32)
                        xv = tl.load(tok + cv, mask=mv, other=0.0).to(tl.float32)
                    yk += tl.load(cw_base + ck * W + j, mask=mk, other=0.0).to(tl.float32) * xk
                    yv += tl.load(cw_base + cv * W + j, mask=mv, other=0.0).to(tl.float32) * xv
                if HAS_BIAS:
                    yk += tl.load(cb_base + ck, mask=mk, other=0.0).to(tl.float32)
                    yv += tl.load(cb_base + cv, mask=mv, other=0.0).to(tl.float32)
                # SiLU, the forward's rounding, L2 norm of k (q is not needed: no output)
                kn, yv = silu_l2_kv(yk, yv, mk, act_ty, EPS)
                decay, beta = raw_decay_beta(graw_ptr + (row + t) * GD, braw_ptr + (row + t) * BD_,
                                             dtb_ptr + i_l * GD, neg_a, i_hv, offs_k, mk, K, PER_HEAD_GATE)
                S = gated_delta_step(S, kn, yv, decay, beta)
                if t == tstep:
                    tl.store(st_base + tslot * s_ss + tile, S.to(state_ptr.dtype.element_ty), mask=mkv)
        tl.store(st_base + s * s_ss + tile, S.to(state_ptr.dtype.element_ty), mask=mkv)


@triton.jit
def _replay_conv_window_kernel(
    mixed_ptr, rows_ptr, slots_ptr, counts_ptr, tstep_ptr, tslot_ptr,
    conv_ptr, s_cl, s_cs, s_cd, s_cw,
    L: tl.constexpr, R: tl.constexpr, A: tl.constexpr, D: tl.constexpr, W: tl.constexpr,
    BD: tl.constexpr,
):
    i_nl = tl.program_id(0)
    i_d = tl.program_id(1)
    i_l = i_nl % L
    r, s, c, tstep, tslot = _request(rows_ptr, slots_ptr, counts_ptr, tstep_ptr, tslot_ptr, i_nl // L)
    if (c > 0) & (s >= 0):
        ch = i_d * BD + tl.arange(0, BD)
        mch = ch < D
        base = conv_ptr + i_l * s_cl + s * s_cs
        row = (i_l * R + r) * A
        tr = tstep + 1
        # In place: the value for new column m comes from old column c+m > m (or the stash),
        # and the track window's from old column tstep+1+m > m, so no column is read after
        # this loop has overwritten it.
        for m in tl.static_range(W - 1):
            src = c + m
            from_old = src < W - 1
            vo = tl.load(base + ch * s_cd + tl.minimum(src, W - 2) * s_cw, mask=mch & from_old, other=0.0)
            vs = tl.load(mixed_ptr + (row + tl.maximum(src - (W - 1), 0)) * D + ch, mask=mch & (~from_old), other=0.0)
            val = tl.where(from_old, vo.to(tl.float32), vs.to(tl.float32))
            if tstep >= 0:
                tsrc = tr + m
                t_old = tsrc < W - 1
                to = tl.load(base + ch * s_cd + tl.minimum(tsrc, W - 2) * s_cw, mask=mch & t_old, other=0.0)
                ts = tl.load(mixed_ptr + (row + tl.maximum(tsrc - (W - 1), 0)) * D + ch, mask=mch & (~t_old), other=0.0)
                tval = tl.where(t_old, to.to(tl.float32), ts.to(tl.float32))
                tb = conv_ptr + i_l * s_cl + tslot * s_cs
                tl.store(tb + ch * s_cd + m * s_cw, tval.to(conv_ptr.dtype.element_ty), mask=mch)
            tl.store(base + ch * s_cd + m * s_cw, val.to(conv_ptr.dtype.element_ty), mask=mch)


def replay_triton(
    stash: "ActivationStash", plan: "ReplayPlan", conv_state: torch.Tensor, temporal_state: torch.Tensor,
    weights: "ReplayWeights", BV: int = 32, BD: int = 256,
) -> None:
    """Launch the two replay kernels (in place on ``conv_state`` / ``temporal_state``; the
    stash itself is not modified). Same contract as :func:`.naive.replay_torch`.

    Args:
        stash: the records ``mixed_qkv``, ``g_raw``, ``b_raw`` ``[L, R, A, *]`` (contiguous).
        plan: per request: row, slot (``-1`` skips), count (0 skips), crossing step
            (``-1`` none) and track slot.
        conv_state: ``[L, slots, conv_dim, W-1]`` view; temporal_state ``[L, slots, HV, K, V]``
            view (any strides).
        weights: stacked, contiguous layer weights.
        BV, BD: value-channel and conv-channel tile sizes.

    Raises:
        ValueError: non-contiguous records or weights, shapes that disagree with
            ``weights.shape``, or a gate width that disagrees with ``weights.per_head_gate``.
    """
    mixed_qkv, g_raw, b_raw = stash.mixed_qkv, stash.g_raw, stash.b_raw
    sh = weights.shape
    L, R, A, D = mixed_qkv.shape
    H, HV, K, V, W = sh.num_k_heads, sh.num_v_heads, sh.head_k_dim, sh.head_v_dim, sh.conv_kernel
    for t in (mixed_qkv, g_raw, b_raw, weights.conv_weight, weights.A_log, weights.dt_bias):
        if not t.is_contiguous():
            raise ValueError("replay_triton: stash records and stacked weights must be contiguous")
    if D != sh.conv_dim or conv_state.shape[-2:] != (D, W - 1) or temporal_state.shape[-3:] != (HV, K, V):
        raise ValueError(
            f"replay_triton: shapes disagree with {sh}: stash conv_dim {D}, conv_state "
            f"{tuple(conv_state.shape)}, temporal_state {tuple(temporal_state.shape)}"
        )
    GD = g_raw.shape[-1]
    want = HV if weights.per_head_gate else HV * K
    if GD != want:
        raise ValueError(
            f"replay_triton: g_raw width {GD} != {want} "
            f"({'HV, per-head gate' if weights.per_head_gate else 'HV*K, per-channel gate'})"
        )
    N = plan.rows.shape[0]
    if N == 0:
        return
    idx = [x.to(torch.int64).contiguous() for x in plan]
    BK = triton.next_power_of_2(K)
    BVv = min(BV, triton.next_power_of_2(V))
    has_bias = weights.conv_bias is not None
    cb = weights.conv_bias if has_bias else weights.conv_weight  # dummy pointer
    BDv = min(BD, triton.next_power_of_2(D))
    with launch_scope(_replay_recurrent_kernel):
        _replay_recurrent_kernel[(N * L, HV, triton.cdiv(V, BVv))](
            mixed_qkv, g_raw, b_raw, *idx,
            conv_state, *conv_state.stride(),
            temporal_state, *temporal_state.stride(),
            weights.conv_weight, cb, weights.A_log, weights.dt_bias,
            L=L, R=R, A=A, D=D, GD=GD, BD_=b_raw.shape[-1], H=H, HV=HV, K=K, V=V, W=W,
            BK=BK, BV=BVv, EPS=1e-6, HAS_BIAS=has_bias, PER_HEAD_GATE=bool(weights.per_head_gate),
        )
        _replay_conv_window_kernel[(N * L, triton.cdiv(D, BDv))](
            mixed_qkv, *idx,
            conv_state, *conv_state.stride(),
            L=L, R=R, A=A, D=D, W=W, BD=BDv,
        )
