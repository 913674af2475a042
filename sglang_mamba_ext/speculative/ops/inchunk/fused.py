"""Triton in-chunk checkpoint writer (``docs/design.md``, "Prefix checkpoints"): from a start
state (a slot's conv window and SSM state, or zeros) and the raw inputs of the tokens after it
(``mixed_qkv``, raw decay gate, raw beta: what SGLang's KDA / GDN ``forward_extend`` receives),
write the states reached after arbitrary token offsets into other slots. Torch reference:
:mod:`.naive`, same signature. Two launches cover all linear layers and requests:

- ``_inchunk_recurrent_kernel`` (grid ``(N * L, HV, cdiv(V, BV))``) keeps one ``[K, BV]`` tile
  of a value head's state in registers and steps it over the row's tokens up to its deepest
  offset (a runtime loop, so offsets may be anywhere: inside a 64-token chunk of SGLang's chunked
  kernels, or past it), per token recomputing the head's post-conv ``k``, ``v`` from the start
  window and the raw inputs and activating the gates with the replay kernel's helpers
  (:func:`~..triton_utils.silu_l2_kv`, :func:`~..triton_utils.raw_decay_beta`,
  :func:`~..triton_utils.gated_delta_step`; per key channel, KDA, or per value head, GDN:
  ``PER_HEAD_GATE``); after token ``t`` the tile is stored into every destination whose offset
  is ``t + 1`` (offset 0: the start state itself);
- ``_inchunk_conv_window_kernel`` (grid ``(N * L * C, cdiv(conv_dim, BD))``) writes each
  destination's conv window: the last ``W-1`` raw inputs before its offset, from the start
  window or the tokens.

Neither kernel writes the start slot, so they may run before the forward that advances it.
States are read and written through strides (SGLang's transposed KDA layouts pass as views, as
for replay). No SGLang import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from sglang_mamba_ext.speculative.ops.triton_utils import (
    conv_at,
    deepest_offset,
    gated_delta_step,
    launch_scope,
    raw_decay_beta,
    silu_l2_kv,
    store_at_offset,
)

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.ops.inchunk import CheckpointWrites
    from sglang_mamba_ext.speculative.replay import ReplayWeights

__all__ = ["write_checkpoints_triton"]


@triton.jit
def _inchunk_recurrent_kernel(
    mixed_ptr, graw_ptr, braw_ptr, T,
    starts_ptr, src_ptr, offs_ptr, dst_ptr,
    conv_ptr, s_cl, s_cs, s_cd, s_cw,
    state_ptr, s_sl, s_ss, s_sh, s_sk, s_sv,
    cw_ptr, cb_ptr, alog_ptr, dtb_ptr,
    L: tl.constexpr, C: tl.constexpr, D: tl.constexpr, GD: tl.constexpr, BD_: tl.constexpr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, EPS: tl.constexpr,
    HAS_BIAS: tl.constexpr, PER_HEAD_GATE: tl.constexpr,
):
    i_nl = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_l = i_nl % L
    i_n = i_nl // L
    start = tl.load(starts_ptr + i_n).to(tl.int64)
    src = tl.load(src_ptr + i_n).to(tl.int64)
    has_src = src >= 0
    n = deepest_offset(offs_ptr, i_n, C)
    if n >= 0:
        i_h = i_hv // (HV // H)
        offs_k = tl.arange(0, BK)
        offs_v = i_v * BV + tl.arange(0, BV)
        mk = offs_k < K
        mv = offs_v < V
        ck = H * K + i_h * K + offs_k
        cv = 2 * H * K + i_hv * V + offs_v
        src0 = tl.maximum(src, 0)
        conv_base = conv_ptr + i_l * s_cl + src0 * s_cs
        tok0 = (i_l * T + start)  # first token's row in the [L, T, *] inputs
        cw_base = cw_ptr + i_l * D * W
        cb_base = cb_ptr + i_l * D
        st_base = state_ptr + i_l * s_sl + i_hv * s_sh
        tile = offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
        mkv = mk[:, None] & mv[None, :]
        S = tl.load(st_base + src0 * s_ss + tile, mask=mkv & has_src, other=0.0).to(tl.float32)
        neg_a = -tl.exp(tl.load(alog_ptr + i_l * HV + i_hv).to(tl.float32))
        act_ty = mixed_ptr.dtype.element_ty
        store_at_offset(st_base, s_ss, tile, S, offs_ptr, dst_ptr, i_n, 0, mkv, C)  # offset 0: the start state
        for t in range(0, n):
            yk = conv_at(conv_base, s_cd, s_cw, mixed_ptr, tok0, cw_base, cb_base, ck, mk, t, has_src, D, W, HAS_BIAS)
            yv = conv_at(conv_base, s_cd, s_cw, mixed_ptr, tok0, cw_base, cb_base, cv, mv, t, has_src, D, W, HAS_BIAS)
            kn, yv = silu_l2_kv(yk, yv, mk, act_ty, EPS)
            decay, beta = raw_decay_beta(graw_ptr + (tok0 + t) * GD, braw_ptr + (tok0 + t) * BD_,
                                         dtb_ptr + i_l * GD, neg_a, i_hv, offs_k, mk, K, PER_HEAD_GATE)
            S = gated_delta_step(S, kn, yv, decay, beta)
            store_at_offset(st_base, s_ss, tile, S, offs_ptr, dst_ptr, i_n, t + 1, mkv, C)


@triton.jit
def _inchunk_conv_window_kernel(
    mixed_ptr, T, starts_ptr, src_ptr, offs_ptr, dst_ptr,
    conv_ptr, s_cl, s_cs, s_cd, s_cw,
    L: tl.constexpr, C: tl.constexpr, D: tl.constexpr, W: tl.constexpr, BD: tl.constexpr,
):
    i_nlc = tl.program_id(0)
    i_d = tl.program_id(1)
    j = i_nlc % C
    i_nl = i_nlc // C
    i_l = i_nl % L
    i_n = i_nl // L
    o = tl.load(offs_ptr + i_n * C + j).to(tl.int64)
    d = tl.load(dst_ptr + i_n * C + j).to(tl.int64)
    if (o >= 0) & (d >= 0):
        start = tl.load(starts_ptr + i_n).to(tl.int64)
        src = tl.load(src_ptr + i_n).to(tl.int64)
        ch = i_d * BD + tl.arange(0, BD)
        mch = ch < D
        base = conv_ptr + i_l * s_cl + tl.maximum(src, 0) * s_cs
        tok0 = i_l * T + start
        out = conv_ptr + i_l * s_cl + d * s_cs
        for m in tl.static_range(W - 1):
            q = o + m  # column of [start window, tokens]
            old = q < W - 1
            vo = tl.load(base + ch * s_cd + tl.minimum(q, W - 2) * s_cw, mask=mch & old & (src >= 0), other=0.0)
            vt = tl.load(mixed_ptr + (tok0 + tl.maximum(q - (W - 1), 0)) * D + ch, mask=mch & (q >= W - 1), other=0.0)
            val = tl.where(old, vo.to(tl.float32), vt.to(tl.float32))
            tl.store(out + ch * s_cd + m * s_cw, val.to(conv_ptr.dtype.element_ty), mask=mch)


def write_checkpoints_triton(
    mixed_qkv: torch.Tensor, g_raw: torch.Tensor, b_raw: torch.Tensor, writes: "CheckpointWrites",
    conv_state: torch.Tensor, temporal_state: torch.Tensor, weights: "ReplayWeights",
    BV: int = 32, BD: int = 256,
) -> None:
    """Launch the two kernels. Same contract as :func:`.naive.write_checkpoints_torch` (see
    :func:`sglang_mamba_ext.speculative.ops.inchunk.write_checkpoints`); inputs are validated
    there. ``BV``, ``BD``: value-channel and conv-channel tile sizes."""
    L, T, D = mixed_qkv.shape
    sh = weights.shape
    H, HV, K, V, W = sh.num_k_heads, sh.num_v_heads, sh.head_k_dim, sh.head_v_dim, sh.conv_kernel
    N, C = writes.offsets.shape
    if N == 0 or C == 0:
        return
    starts, srcs, offs, dsts = (x.to(torch.int64).contiguous() for x in writes)
    BK = triton.next_power_of_2(K)
    BVv = min(BV, triton.next_power_of_2(V))
    BDv = min(BD, triton.next_power_of_2(D))
    has_bias = weights.conv_bias is not None
    cb = weights.conv_bias if has_bias else weights.conv_weight  # dummy pointer
    with launch_scope(_inchunk_recurrent_kernel):
        _inchunk_recurrent_kernel[(N * L, HV, triton.cdiv(V, BVv))](
            mixed_qkv, g_raw, b_raw, T, starts, srcs, offs, dsts,
            conv_state, *conv_state.stride(),
            temporal_state, *temporal_state.stride(),
            weights.conv_weight, cb, weights.A_log, weights.dt_bias,
            L=L, C=C, D=D, GD=g_raw.shape[-1], BD_=b_raw.shape[-1], H=H, HV=HV, K=K, V=V, W=W,
            BK=BK, BV=BVv, EPS=1e-6, HAS_BIAS=has_bias, PER_HEAD_GATE=bool(weights.per_head_gate),
        )
        _inchunk_conv_window_kernel[(N * L * C, triton.cdiv(D, BDv))](
            mixed_qkv, T, starts, srcs, offs, dsts,
            conv_state, *conv_state.stride(),
            L=L, C=C, D=D, W=W, BD=BDv,
        )
