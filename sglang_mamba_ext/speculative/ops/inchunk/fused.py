"""Triton in-chunk checkpoint writer (``docs/design.md``, "Prefix checkpoints"; issue 39): from a
start state (a slot's conv window and SSM state, or zeros) and the raw inputs of the tokens after
it (``mixed_qkv``, raw decay gate, raw beta: what SGLang's KDA / GDN ``forward_extend``
receives), write the states reached after arbitrary token offsets into other slots. Torch
implementation: :mod:`.chunked` (same chunks, same results to float rounding); the old token
scan from the extend start: :mod:`.naive` (the reference). A fixed number of launches for all
layers, rows and checkpoints, whatever the offsets:

- the per-chunk WY quantities of every row's whole chunks up to its deepest checkpoint
  (:func:`.chunked.prepare`, batched torch ops);
- ``_chunk_states_kernel`` (grid ``(L * R, HV, cdiv(V, BV))``) runs the chunk-to-chunk
  recurrence (two ``tl.dot`` per chunk, IEEE fp32) and keeps the boundary states that
  checkpoints start from;
- ``_inchunk_recurrent_kernel`` (grid ``(J * L, HV, cdiv(V, BV))``, one program per checkpoint,
  layer and value tile) steps its boundary state over the at most ``chunk - 1`` tokens up to the
  checkpoint, per token recomputing the head's post-conv ``k``, ``v`` from the start window and
  the raw inputs and activating the gates with the replay kernel's helpers
  (:func:`~..triton_utils.silu_l2_kv`, :func:`~..triton_utils.raw_decay_beta`,
  :func:`~..triton_utils.gated_delta_step`; per key channel, KDA, or per value head, GDN:
  ``PER_HEAD_GATE``), and stores it into the destination;
- ``_inchunk_conv_window_kernel`` (grid ``(N * L * C, cdiv(conv_dim, BD))``) writes each
  destination's conv window: the last ``W-1`` raw inputs before its offset, from the start
  window or the tokens.

None of them writes the start slot, so they may run before the forward that advances it.
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
    gated_delta_step,
    launch_scope,
    raw_decay_beta,
    silu_l2_kv,
)

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.ops.inchunk import CheckpointWrites
    from sglang_mamba_ext.speculative.replay import ReplayWeights

__all__ = ["write_checkpoints_triton"]


@triton.jit
def _chunk_states_kernel(
    U_ptr, W_ptr, Kt_ptr, E_ptr, s0_ptr, bnd_ptr, table_ptr, nch_ptr, R, NB, Q,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, C: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
):
    i_lr = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_l = i_lr // R
    i_r = i_lr % R
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    offs_c = tl.arange(0, C)
    mk = offs_k < K
    mv = offs_v < V
    mkv = mk[:, None] & mv[None, :]
    tile = offs_k[:, None] * V + offs_v[None, :]
    S = tl.load(s0_ptr + ((i_l * R + i_r) * HV + i_hv) * K * V + tile, mask=mkv, other=0.0)
    q = tl.load(table_ptr + i_r * (NB + 1))
    if q >= 0:
        tl.store(bnd_ptr + ((i_l * Q + q) * HV + i_hv) * K * V + tile, S, mask=mkv)
    nch = tl.load(nch_ptr + i_r)
    for c in range(0, nch):
        row = ((i_l * R + i_r) * NB + c) * HV + i_hv  # [L, R, NB, HV] flattened
        ck = (row * C + offs_c[:, None]) * K + offs_k[None, :]
        Wc = tl.load(W_ptr + ck, mask=mk[None, :], other=0.0)
        Kc = tl.load(Kt_ptr + ck, mask=mk[None, :], other=0.0)
        Uc = tl.load(U_ptr + (row * C + offs_c[:, None]) * V + offs_v[None, :], mask=mv[None, :], other=0.0)
        e = tl.load(E_ptr + row * K + offs_k, mask=mk, other=0.0)
        u = Uc - tl.dot(Wc, S, input_precision="ieee")
        S = e[:, None] * S + tl.dot(tl.trans(Kc), u, input_precision="ieee")
        q = tl.load(table_ptr + i_r * (NB + 1) + c + 1)
        if q >= 0:
            tl.store(bnd_ptr + ((i_l * Q + q) * HV + i_hv) * K * V + tile, S, mask=mkv)


@triton.jit
def _inchunk_recurrent_kernel(
    mixed_ptr, graw_ptr, braw_ptr, T,
    istart_ptr, isrc_ptr, ioff_ptr, idst_ptr, ibeg_ptr, ibnd_ptr, bnd_ptr, Q,
    conv_ptr, s_cl, s_cs, s_cd, s_cw,
    state_ptr, s_sl, s_ss, s_sh, s_sk, s_sv,
    cw_ptr, cb_ptr, alog_ptr, dtb_ptr,
    L: tl.constexpr, D: tl.constexpr, GD: tl.constexpr, BD_: tl.constexpr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, EPS: tl.constexpr,
    HAS_BIAS: tl.constexpr, PER_HEAD_GATE: tl.constexpr,
):
    i_jl = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_l = i_jl % L
    i_j = i_jl // L
    start = tl.load(istart_ptr + i_j).to(tl.int64)
    src = tl.load(isrc_ptr + i_j).to(tl.int64)
    o = tl.load(ioff_ptr + i_j).to(tl.int64)
    d = tl.load(idst_ptr + i_j).to(tl.int64)
    b = tl.load(ibeg_ptr + i_j).to(tl.int64)
    q = tl.load(ibnd_ptr + i_j).to(tl.int64)
    has_src = src >= 0
    i_h = i_hv // (HV // H)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    ck = H * K + i_h * K + offs_k
    cv = 2 * H * K + i_hv * V + offs_v
    conv_base = conv_ptr + i_l * s_cl + tl.maximum(src, 0) * s_cs
    tok0 = (i_l * T + start)  # the row's first token in the [L, T, *] inputs
    cw_base = cw_ptr + i_l * D * W
    cb_base = cb_ptr + i_l * D
    mkv = mk[:, None] & mv[None, :]
    S = tl.load(bnd_ptr + ((i_l * Q + q) * HV + i_hv) * K * V + offs_k[:, None] * V + offs_v[None, :],
                mask=mkv, other=0.0)
    neg_a = -tl.exp(tl.load(alog_ptr + i_l * HV + i_hv).to(tl.float32))
    act_ty = mixed_ptr.dtype.element_ty
    for t in range(b, o):  # at most chunk - 1 tokens after the boundary state
        yk = conv_at(conv_base, s_cd, s_cw, mixed_ptr, tok0, cw_base, cb_base, ck, mk, t, has_src, D, W, HAS_BIAS)
        yv = conv_at(conv_base, s_cd, s_cw, mixed_ptr, tok0, cw_base, cb_base, cv, mv, t, has_src, D, W, HAS_BIAS)
        kn, yv = silu_l2_kv(yk, yv, mk, act_ty, EPS)
        decay, beta = raw_decay_beta(graw_ptr + (tok0 + t) * GD, braw_ptr + (tok0 + t) * BD_,
                                     dtb_ptr + i_l * GD, neg_a, i_hv, offs_k, mk, K, PER_HEAD_GATE)
        S = gated_delta_step(S, kn, yv, decay, beta)
    tile = offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    tl.store(state_ptr + i_l * s_sl + d * s_ss + i_hv * s_sh + tile, S.to(state_ptr.dtype.element_ty), mask=mkv)


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


def item_tables(lay, src_rows: torch.Tensor):
    """Device int64 per-checkpoint tables of ``lay`` (a :class:`~.layout.ChunkLayout`) for the
    partial-chunk kernels: row start token, start slot (``src_rows [R]``, device), offset,
    destination, boundary token ``b``, kept boundary index."""
    dev = src_rows.device
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=dev)  # noqa: E731
    rows = t(lay.item_row)
    return (t([lay.starts[r] for r in lay.item_row]), src_rows[rows].contiguous(), t(lay.item_off),
            t(lay.item_dst), t([c * lay.chunk for c in lay.item_chunk]), t(lay.item_bnd))


def write_checkpoints_triton(
    mixed_qkv: torch.Tensor, g_raw: torch.Tensor, b_raw: torch.Tensor, writes: "CheckpointWrites",
    conv_state: torch.Tensor, temporal_state: torch.Tensor, weights: "ReplayWeights", lay,
    BV: int = 32, BD: int = 256,
) -> None:
    """The Triton writer; contract: :func:`sglang_mamba_ext.speculative.ops.inchunk.write_checkpoints`
    (inputs validated there), ``lay`` its :func:`~.layout.chunk_layout` (chunk a power of two,
    >= 16, for ``tl.dot``). The per-chunk WY quantities come from the torch ops of
    :func:`.chunked.prepare` (a fixed number of launches), then three kernels: the boundary
    states, the partial chunks, the conv windows. ``BV``, ``BD``: value-channel and
    conv-channel tile sizes."""
    from sglang_mamba_ext.speculative.ops.inchunk.chunked import prepare, start_states

    L, T, D = mixed_qkv.shape
    sh = weights.shape
    H, HV, K, V, W = sh.num_k_heads, sh.num_v_heads, sh.head_k_dim, sh.head_v_dim, sh.conv_kernel
    N, C = writes.offsets.shape
    J = len(lay.item_off)
    if J == 0:
        return
    dev = mixed_qkv.device
    src = writes.src_slots.to(torch.int64)[torch.tensor(lay.rows, dtype=torch.int64, device=dev)].contiguous()
    S0 = start_states(temporal_state, src).contiguous()  # [L, R, HV, K, V]
    R, Q = len(lay.rows), len(lay.bnd_row)
    BK = max(16, triton.next_power_of_2(K))
    BVv = max(16, min(BV, triton.next_power_of_2(V)))
    if lay.max_chunks:
        prep = prepare(mixed_qkv, g_raw, b_raw, lay, src, conv_state, weights)
        bnd = torch.empty(L, Q, HV, K, V, dtype=torch.float32, device=dev)
        table = torch.tensor(lay.boundary_table(), dtype=torch.int64, device=dev)
        nch = torch.tensor(lay.nchunks, dtype=torch.int64, device=dev)
        with launch_scope(_chunk_states_kernel):
            _chunk_states_kernel[(L * R, HV, triton.cdiv(V, BVv))](
                prep.U.contiguous(), prep.W.contiguous(), prep.Kt.contiguous(), prep.E, S0, bnd, table, nch,
                R, lay.max_chunks, Q, HV=HV, K=K, V=V, C=lay.chunk, BK=BK, BV=BVv,
            )
    else:
        bnd = S0[:, lay.bnd_row].contiguous()
    istart, isrc, ioff, idst, ibeg, ibnd = item_tables(lay, src)
    has_bias = weights.conv_bias is not None
    cb = weights.conv_bias if has_bias else weights.conv_weight  # dummy pointer
    with launch_scope(_inchunk_recurrent_kernel):
        _inchunk_recurrent_kernel[(J * L, HV, triton.cdiv(V, BVv))](
            mixed_qkv, g_raw, b_raw, T, istart, isrc, ioff, idst, ibeg, ibnd, bnd, Q,
            conv_state, *conv_state.stride(),
            temporal_state, *temporal_state.stride(),
            weights.conv_weight, cb, weights.A_log, weights.dt_bias,
            L=L, D=D, GD=g_raw.shape[-1], BD_=b_raw.shape[-1], H=H, HV=HV, K=K, V=V, W=W,
            BK=BK, BV=BVv, EPS=1e-6, HAS_BIAS=has_bias, PER_HEAD_GATE=bool(weights.per_head_gate),
        )
    starts, srcs, offs, dsts = (x.to(torch.int64).contiguous() for x in writes)
    BDv = min(BD, triton.next_power_of_2(D))
    with launch_scope(_inchunk_conv_window_kernel):
        _inchunk_conv_window_kernel[(N * L * C, triton.cdiv(D, BDv))](
            mixed_qkv, T, starts, srcs, offs, dsts,
            conv_state, *conv_state.stride(),
            L=L, C=C, D=D, W=W, BD=BDv,
        )


def write_blocks_triton(mixed_qkv: torch.Tensor, g_raw: torch.Tensor, b_raw: torch.Tensor, lay, S: torch.Tensor,
                        begin: int, conv_state: torch.Tensor, temporal_state: torch.Tensor, weights: "ReplayWeights",
                        BV: int = 32, BD: int = 256) -> None:
    """Blocks of :func:`.from_chunks.gather_tail_blocks` (``lay`` their layout, one checkpoint
    per block): each steps its state ``S [L, J, HV, K, V]`` (float32, contiguous) from block
    token ``begin`` (``W - 1``, so the conv reads only the block) to its offset, then its conv
    window is copied; the two kernels of :func:`write_checkpoints_triton`, no chunked pass."""
    L, T, D = mixed_qkv.shape
    sh = weights.shape
    H, HV, K, V, W = sh.num_k_heads, sh.num_v_heads, sh.head_k_dim, sh.head_v_dim, sh.conv_kernel
    from sglang_mamba_ext.speculative.ops.inchunk.from_chunks import block_tables

    J = len(lay.item_off)
    istart, isrc, ioff, idst, ibeg, ibnd = block_tables(lay, begin, mixed_qkv.device)
    BK = max(16, triton.next_power_of_2(K))
    BVv = max(16, min(BV, triton.next_power_of_2(V)))
    has_bias = weights.conv_bias is not None
    cb = weights.conv_bias if has_bias else weights.conv_weight  # dummy pointer
    with launch_scope(_inchunk_recurrent_kernel):
        _inchunk_recurrent_kernel[(J * L, HV, triton.cdiv(V, BVv))](
            mixed_qkv, g_raw, b_raw, T, istart, isrc, ioff, idst, ibeg, ibnd, S, J,
            conv_state, *conv_state.stride(),
            temporal_state, *temporal_state.stride(),
            weights.conv_weight, cb, weights.A_log, weights.dt_bias,
            L=L, D=D, GD=g_raw.shape[-1], BD_=b_raw.shape[-1], H=H, HV=HV, K=K, V=V, W=W,
            BK=BK, BV=BVv, EPS=1e-6, HAS_BIAS=has_bias, PER_HEAD_GATE=bool(weights.per_head_gate),
        )
    BDv = min(BD, triton.next_power_of_2(D))
    with launch_scope(_inchunk_conv_window_kernel):
        _inchunk_conv_window_kernel[(J * L, triton.cdiv(D, BDv))](
            mixed_qkv, T, istart, isrc, ioff, idst,
            conv_state, *conv_state.stride(),
            L=L, C=1, D=D, W=W, BD=BDv,
        )
