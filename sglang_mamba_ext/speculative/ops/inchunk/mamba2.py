"""In-chunk checkpoint writer for Mamba2 / SSD layers (Nemotron-H, Falcon-H1, GraniteMoeHybrid;
issue 24, item 3; ``docs/design.md``, "Prefix checkpoints"): the conv window and SSM state after
any token offset of a prefill, from a start state and the layer's raw inputs, so that a backend
whose chunked kernels keep states only on their chunk grid can still have exact branch-point and
prompt-end checkpoints. Same plan as the GDN / KDA writer (:class:`..CheckpointWrites`).

Per layer, token and head ``h`` (what SGLang's ``MambaMixer2.forward`` computes,
``sglang/srt/layers/attention/mamba/mamba.py``, with its chunked scan
``ssd_combined.mamba_chunk_scan_combined`` at ``dt_softplus=True``)::

    y      = silu(causal_conv1d(xBC) + conv_bias)          # rounded to xBC's dtype, as served
    x, B   = y[:HV*P] as [HV, P], y[HV*P : HV*P+G*N] as [G, N]
    dt     = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max)        # [HV]
    state  = exp(dt * A) * state + dt * x[h] (outer) B[h // (HV/G)]   # [HV, P, N], fp32

(C, D and the gate only shape the output, not the state.) Each checkpoint starts from the state
at the chunk boundary below it (issue 39; :mod:`.layout`, :mod:`.mamba2_chunked`: the boundary
states from whole chunks in the SSD form, one contraction each): the torch path
(:func:`write_mamba2_checkpoints_chunked`) adds the at most ``chunk - 1`` tokens after it in one
more contraction; :func:`write_mamba2_checkpoints_triton` steps them in one program per
(checkpoint and layer, head, ``P`` tile) holding a ``[BP, N]`` state tile, and reuses the GDN /
KDA writer's conv-window kernel (layout-agnostic). :func:`write_mamba2_checkpoints_torch` is the
token scan from the extend start they replaced (``impl="reference"``). None writes the start
slot. No SGLang import.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.ops.inchunk import CheckpointWrites

__all__ = ["Mamba2Weights", "write_mamba2_checkpoints", "write_mamba2_checkpoints_torch",
           "write_mamba2_checkpoints_triton"]


class Mamba2Weights(NamedTuple):
    """The state-shaping weights of ``L`` Mamba2 layers, stacked (one TP shard's heads).

    Attributes:
        conv_weight: ``[L, D, W]`` depthwise conv kernel, ``D = HV*P + 2*G*N`` (SGLang's
            ``conv1d.weight`` ``[D, 1, W]`` squeezed).
        conv_bias: ``[L, D]`` or None.
        A: ``[L, HV]`` float32, negative (SGLang's ``MambaMixer2.A``, ``-exp(A_log)``).
        dt_bias: ``[L, HV]``.
        n_groups: ``G`` (B / C groups of this shard).
        head_dim: ``P``.
        d_state: ``N``.
        dt_limit: ``(dt_min, dt_max)`` applied after softplus (SGLang serves ``(0, inf)``).
    """

    conv_weight: torch.Tensor
    conv_bias: Optional[torch.Tensor]
    A: torch.Tensor
    dt_bias: torch.Tensor
    n_groups: int
    head_dim: int
    d_state: int
    dt_limit: Tuple[float, float] = (0.0, math.inf)

    @property
    def num_layers(self) -> int:
        return self.conv_weight.shape[0]

    @property
    def num_heads(self) -> int:
        return self.A.shape[-1]

    @property
    def conv_dim(self) -> int:
        return self.conv_weight.shape[1]

    @property
    def conv_kernel(self) -> int:
        return self.conv_weight.shape[2]


def write_mamba2_checkpoints(
    xbc: torch.Tensor, dt_raw: torch.Tensor, writes: "CheckpointWrites", conv_state: torch.Tensor,
    ssm_state: torch.Tensor, weights: Mamba2Weights, impl: str = "triton", check_offsets: bool = True,
    chunk: int = 64, host=None, stats: Optional[dict] = None, chunk_states: Optional[torch.Tensor] = None,
    row_lengths=None,
) -> None:
    """For every request ``i`` and layer ``l``, run the layer's conv + SSD recurrence from slot
    ``writes.src_slots[i]``'s states over tokens ``starts[i] ..`` and store the conv window and
    SSM state reached after ``offsets[i, j]`` tokens into slot ``dst_slots[i, j]`` (computed in
    fp32, stored in the pools' dtypes). The source slot is only read.

    Args:
        xbc: ``[L, T, D]`` raw (pre-conv) ``hidden_states_B_C`` of the extend's tokens, contiguous.
        dt_raw: ``[L, T, HV]`` raw ``dt`` (before ``dt_bias`` and softplus), contiguous.
        writes: :class:`..CheckpointWrites`; every ``starts[i] + offsets[i, j] <= T``.
        conv_state: ``[L, slots, D, W-1]`` view (any strides).
        ssm_state: ``[L, slots, HV, P, N]`` view (SGLang's Mamba2 ``temporal`` layout).
        weights: :class:`Mamba2Weights` of the ``L`` layers.
        impl: ``"triton"``, ``"torch"`` (chunked) or ``"reference"`` (token scan from the start).
        check_offsets: check ``starts + offsets <= T`` (a device sync on CUDA).
        chunk: tokens per chunk (each checkpoint adds at most ``chunk - 1`` tokens to the
            boundary state below it); 64, SGLang's Mamba2 chunk.
        host: ``(starts, offsets, dst_slots)`` host lists (no device read), else ``.tolist()``.
        stats: if a dict, receives ``"scanned"`` (tokens per checkpoint after its boundary) and
            ``"chunks"``.
        chunk_states: ``[L, NC, HV, P, N]``: the prefill's state at the start of every chunk of
            one grid over the packed tokens (SGLang's SSD scan ``states``; chunk ``c`` starts at
            token ``c * chunk``). When given, a checkpoint with a grid boundary inside its row
            below it starts from that state (:mod:`.from_chunks`), so its cost does not depend
            on its offset; needs ``row_lengths``.
        row_lengths: ``[N]`` each row's tokens in the scan that computed ``chunk_states``.

    Raises:
        ValueError: shapes disagree with ``weights``, non-contiguous inputs, an offset past
            the inputs, ``HV`` not a multiple of ``G``, or an unknown ``impl``.
    """
    if xbc.dim() != 3 or dt_raw.dim() != 3:
        raise ValueError("write_mamba2_checkpoints: xbc and dt_raw must be [L, T, *]")
    L, T, D = xbc.shape
    HV, P, N, G, W = weights.num_heads, weights.head_dim, weights.d_state, weights.n_groups, weights.conv_kernel
    for t in (xbc, dt_raw, weights.conv_weight, weights.A, weights.dt_bias):
        if not t.is_contiguous():
            raise ValueError("write_mamba2_checkpoints: inputs and stacked weights must be contiguous")
    if HV % G:
        raise ValueError(f"write_mamba2_checkpoints: {HV} heads not a multiple of {G} groups")
    if (D != weights.conv_dim or D != HV * P + 2 * G * N or weights.num_layers != L
            or dt_raw.shape != (L, T, HV) or conv_state.shape[0] != L or conv_state.shape[-2:] != (D, W - 1)
            or ssm_state.shape[0] != L or ssm_state.shape[-3:] != (HV, P, N)):
        raise ValueError(
            f"write_mamba2_checkpoints: shapes disagree (L={weights.num_layers}, HV={HV}, P={P}, N={N}, G={G}, "
            f"W={W}, D={weights.conv_dim}): xbc {tuple(xbc.shape)}, dt_raw {tuple(dt_raw.shape)}, conv_state "
            f"{tuple(conv_state.shape)}, ssm_state {tuple(ssm_state.shape)}"
        )
    if check_offsets and writes.offsets.numel():
        ends = writes.starts[:, None] + writes.offsets
        if bool(((writes.offsets >= 0) & (ends > T)).any()):
            raise ValueError(f"write_mamba2_checkpoints: an offset reaches past the {T} input tokens")
    if impl == "reference":
        write_mamba2_checkpoints_torch(xbc, dt_raw, writes, conv_state, ssm_state, weights)
        return
    if impl not in ("triton", "torch"):
        raise ValueError(f"write_mamba2_checkpoints: unknown impl {impl!r} (triton, torch, reference)")
    if chunk_states is not None:
        from sglang_mamba_ext.speculative.ops.inchunk.from_chunks import write_split

        write_split(writes, host, row_lengths, None, chunk, (xbc, dt_raw), W,
                    lambda w, h, st: write_mamba2_checkpoints(xbc, dt_raw, w, conv_state, ssm_state, weights, impl,
                                                              False, chunk, h, st),
                    lambda blocks, st: write_mamba2_tail_blocks(blocks, chunk_states, conv_state, ssm_state, weights,
                                                                impl, st), stats)
        return
    from sglang_mamba_ext.speculative.ops.inchunk.layout import chunk_layout

    lay = chunk_layout(writes, chunk, host)
    if impl == "triton":
        write_mamba2_checkpoints_triton(xbc, dt_raw, writes, conv_state, ssm_state, weights, lay)
        if stats is not None:
            stats.update(scanned=lay.scanned(), chunks=lay.max_chunks)
    else:
        write_mamba2_checkpoints_chunked(xbc, dt_raw, writes, conv_state, ssm_state, weights, lay, stats)


def write_mamba2_checkpoints_chunked(xbc, dt_raw, writes, conv_state, ssm_state, weights: Mamba2Weights, lay,
                                     stats: Optional[dict] = None) -> None:
    """The torch writer; contract: :func:`write_mamba2_checkpoints` (inputs validated there),
    ``lay`` its :func:`~.layout.chunk_layout`."""
    from sglang_mamba_ext.speculative.ops.inchunk import mamba2_chunked as mc
    from sglang_mamba_ext.speculative.ops.inchunk.chunked import write_states

    if not lay.item_off:
        if stats is not None:
            stats.update(scanned=[], chunks=0)
        return
    src = writes.src_slots.to(torch.int64)[torch.tensor(lay.rows, dtype=torch.int64, device=xbc.device)]
    prep = mc.prepare(xbc, dt_raw, lay, src, conv_state, weights)
    bnd = mc.boundary_states(prep, lay, mc.start_states(ssm_state, src))
    S = mc.add_partial(prep, lay, bnd[:, lay.item_bnd], stats)
    write_states(prep.window, lay, S, conv_state, ssm_state)


def write_mamba2_tail_blocks(blocks, chunk_states: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                             weights: Mamba2Weights, impl: str = "triton", stats: Optional[dict] = None) -> None:
    """Mamba2 checkpoints from the prefill's chunk states (issue 39): each block of
    :func:`.from_chunks.gather_tail_blocks` (inputs ``(xbc, dt_raw)``) adds its ``o - b <=
    chunk - 1`` tokens to its boundary state ``chunk_states[:, chunk_ids[j]]`` (``[L, NC, HV, P,
    N]``, any float dtype), then its conv window and state go to its slot; ``impl`` ``"triton"`` or
    ``"torch"``. ``stats``, if a dict, gets ``"scanned"``.

    Raises:
        ValueError: an unknown ``impl``, or a chunk id past ``chunk_states``.
    """
    from sglang_mamba_ext.speculative.ops.inchunk.from_chunks import block_states

    lay = blocks.lay
    J = len(lay.item_off)
    Wm1 = blocks.conv_kernel - 1
    if stats is not None:
        stats["scanned"] = [o - Wm1 for o in lay.item_off]
    if J == 0:
        return
    S = block_states(blocks, chunk_states)
    xbc, dt_raw = blocks.inputs
    if impl == "torch":
        from sglang_mamba_ext.speculative.ops.inchunk import mamba2_chunked as mc
        from sglang_mamba_ext.speculative.ops.inchunk.chunked import write_states

        src = torch.full((J,), -1, dtype=torch.int64, device=xbc.device)
        prep = mc.prepare(xbc, dt_raw, lay, src, conv_state, weights)
        write_states(prep.window, lay, mc.add_partial(prep, lay, S, begin=[Wm1] * J), conv_state, ssm_state)
    elif impl == "triton":
        _mamba2_blocks_triton(xbc.contiguous(), dt_raw.contiguous(), lay, S, Wm1, conv_state, ssm_state, weights)
    else:
        raise ValueError(f"write_mamba2_tail_blocks: unknown impl {impl!r} (triton, torch)")


def write_mamba2_checkpoints_torch(
    xbc: torch.Tensor, dt_raw: torch.Tensor, writes: "CheckpointWrites", conv_state: torch.Tensor,
    ssm_state: torch.Tensor, weights: Mamba2Weights,
) -> None:
    """Token-scan reference (``impl="reference"``: from the extend start, cost growing with the
    offset); contract: :func:`write_mamba2_checkpoints` (inputs validated there)."""
    HV, P, N, G, W = weights.num_heads, weights.head_dim, weights.d_state, weights.n_groups, weights.conv_kernel
    lo_dt, hi_dt = weights.dt_limit
    starts, srcs, offs, dsts = (x.tolist() for x in writes)
    for i in range(len(starts)):
        items = [(o, d) for o, d in zip(offs[i], dsts[i]) if o >= 0 and d >= 0]
        if not items:
            continue
        lo, src, n = starts[i], srcs[i], max(o for o, _ in items)
        for l in range(weights.num_layers):
            D = weights.conv_dim
            if src >= 0:
                window = conv_state[l, src].float()
                h = ssm_state[l, src].float().clone()
            else:
                window = torch.zeros(D, W - 1, dtype=torch.float32, device=xbc.device)
                h = torch.zeros(HV, P, N, dtype=torch.float32, device=xbc.device)
            cols = torch.cat([window, xbc[l, lo:lo + n].float().t()], dim=1)  # [D, W-1+n]
            w = weights.conv_weight[l].float()
            b = weights.conv_bias[l].float() if weights.conv_bias is not None else 0.0
            A = weights.A[l].float()
            reached = {0: h.clone()}
            for t in range(n):
                y = (cols[:, t:t + W] * w).sum(-1) + b
                y = F.silu(y).to(xbc.dtype).float()
                x = y[:HV * P].view(HV, P)
                B = y[HV * P:HV * P + G * N].view(G, N).repeat_interleave(HV // G, dim=0)  # [HV, N]
                dt = F.softplus(dt_raw[l, lo + t].float() + weights.dt_bias[l].float()).clamp(lo_dt, hi_dt)
                h = torch.exp(dt * A)[:, None, None] * h + (dt[:, None] * x)[:, :, None] * B[:, None, :]
                reached[t + 1] = h
            for o, d in items:
                conv_state[l, d] = cols[:, o:o + W - 1].to(conv_state.dtype)
                ssm_state[l, d] = reached[o].to(ssm_state.dtype)


try:  # Triton is optional for the torch reference
    import triton
    import triton.language as tl

    from sglang_mamba_ext.speculative.ops.triton_utils import mamba2_token_step
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _mamba2_inchunk_kernel(
        xbc_ptr, dt_ptr, T,
        istart_ptr, isrc_ptr, ioff_ptr, idst_ptr, ibeg_ptr, ibnd_ptr, bnd_ptr, Q,
        conv_ptr, s_cl, s_cs, s_cd, s_cw,
        state_ptr, s_sl, s_ss, s_sh, s_sp, s_sn,
        cw_ptr, cb_ptr, a_ptr, dtb_ptr, DT_MIN, DT_MAX,
        L: tl.constexpr, D: tl.constexpr, HV: tl.constexpr, G: tl.constexpr,
        P: tl.constexpr, N: tl.constexpr, W: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
        HAS_BIAS: tl.constexpr,
    ):
        # one program per (checkpoint and layer, head, P tile): the kept boundary state
        # (bnd [L, Q, HV, P, N] fp32) stepped over the tokens b .. o-1 (at most chunk - 1)
        i_jl = tl.program_id(0)
        i_h = tl.program_id(1)
        i_p = tl.program_id(2)
        i_l = i_jl % L
        i_j = i_jl // L
        start = tl.load(istart_ptr + i_j).to(tl.int64)
        src = tl.load(isrc_ptr + i_j).to(tl.int64)
        o = tl.load(ioff_ptr + i_j).to(tl.int64)
        d = tl.load(idst_ptr + i_j).to(tl.int64)
        b = tl.load(ibeg_ptr + i_j).to(tl.int64)
        q = tl.load(ibnd_ptr + i_j).to(tl.int64)
        has_src = src >= 0
        offs_p = i_p * BP + tl.arange(0, BP)
        offs_s = tl.arange(0, BN)
        mp = offs_p < P
        ms = offs_s < N
        cx = i_h * P + offs_p                      # x channels of this head
        cb_ch = HV * P + (i_h // (HV // G)) * N + offs_s  # B channels of its group
        conv_base = conv_ptr + i_l * s_cl + tl.maximum(src, 0) * s_cs
        tok0 = i_l * T + start
        cw_base = cw_ptr + i_l * D * W
        cbias = cb_ptr + i_l * D
        mps = mp[:, None] & ms[None, :]
        S = tl.load(bnd_ptr + ((i_l * Q + q) * HV + i_h) * P * N + offs_p[:, None] * N + offs_s[None, :],
                    mask=mps, other=0.0)
        a = tl.load(a_ptr + i_l * HV + i_h).to(tl.float32)
        dtb = tl.load(dtb_ptr + i_l * HV + i_h).to(tl.float32)
        act_ty = xbc_ptr.dtype.element_ty
        for t in range(b, o):
            S = mamba2_token_step(S, conv_base, s_cd, s_cw, xbc_ptr, tok0, cw_base, cbias, cx, cb_ch, mp, ms, t,
                                  has_src, dt_ptr + (tok0 + t) * HV + i_h, a, dtb, DT_MIN, DT_MAX, act_ty, D, W,
                                  HAS_BIAS)
        tile = offs_p[:, None] * s_sp + offs_s[None, :] * s_sn
        tl.store(state_ptr + i_l * s_sl + d * s_ss + i_h * s_sh + tile, S.to(state_ptr.dtype.element_ty), mask=mps)


def write_mamba2_checkpoints_triton(
    xbc: torch.Tensor, dt_raw: torch.Tensor, writes: "CheckpointWrites", conv_state: torch.Tensor,
    ssm_state: torch.Tensor, weights: Mamba2Weights, lay, BP: int = 32, BD: int = 256,
) -> None:
    """The boundary states (:mod:`.mamba2_chunked`, batched torch ops), then the state kernel
    over each checkpoint's partial chunk and the shared conv-window kernel; contract:
    :func:`write_mamba2_checkpoints` (inputs validated there), ``lay`` its
    :func:`~.layout.chunk_layout`. ``BP``, ``BD``: head-channel and conv-channel tile sizes."""
    from sglang_mamba_ext.speculative.ops.inchunk import mamba2_chunked as mc
    from sglang_mamba_ext.speculative.ops.inchunk.fused import _inchunk_conv_window_kernel, item_tables
    from sglang_mamba_ext.speculative.ops.triton_utils import launch_scope

    L, T, D = xbc.shape
    HV, P, N, G, W = weights.num_heads, weights.head_dim, weights.d_state, weights.n_groups, weights.conv_kernel
    R, C = writes.offsets.shape
    J = len(lay.item_off)
    if J == 0:
        return
    dev = xbc.device
    src = writes.src_slots.to(torch.int64)[torch.tensor(lay.rows, dtype=torch.int64, device=dev)].contiguous()
    S0 = mc.start_states(ssm_state, src)
    if lay.max_chunks:
        bnd = mc.boundary_states(mc.prepare(xbc, dt_raw, lay, src, conv_state, weights), lay, S0).contiguous()
    else:
        bnd = S0[:, lay.bnd_row].contiguous()
    istart, isrc, ioff, idst, ibeg, ibnd = item_tables(lay, src)
    BPv = min(BP, triton.next_power_of_2(P))
    BDv = min(BD, triton.next_power_of_2(D))
    has_bias = weights.conv_bias is not None
    cb = weights.conv_bias if has_bias else weights.conv_weight  # dummy pointer
    lo_dt, hi_dt = weights.dt_limit
    with launch_scope(_mamba2_inchunk_kernel):
        _mamba2_inchunk_kernel[(J * L, HV, triton.cdiv(P, BPv))](
            xbc, dt_raw, T, istart, isrc, ioff, idst, ibeg, ibnd, bnd, len(lay.bnd_row),
            conv_state, *conv_state.stride(),
            ssm_state, *ssm_state.stride(),
            weights.conv_weight, cb, weights.A, weights.dt_bias, float(lo_dt), float(min(hi_dt, 3.0e38)),
            L=L, D=D, HV=HV, G=G, P=P, N=N, W=W, BP=BPv, BN=triton.next_power_of_2(N), HAS_BIAS=has_bias,
        )
    starts, srcs, offs, dsts = (x.to(torch.int64).contiguous() for x in writes)
    with launch_scope(_inchunk_conv_window_kernel):
        _inchunk_conv_window_kernel[(R * L * C, triton.cdiv(D, BDv))](
            xbc, T, starts, srcs, offs, dsts,
            conv_state, *conv_state.stride(),
            L=L, C=C, D=D, W=W, BD=BDv,
        )


def _mamba2_blocks_triton(xbc, dt_raw, lay, S, begin: int, conv_state, ssm_state, weights: Mamba2Weights,
                          BP: int = 32, BD: int = 256) -> None:
    """The state kernel and the conv-window kernel of :func:`write_mamba2_checkpoints_triton`
    over tail blocks (one checkpoint per block, stepped from block token ``begin = W - 1``)."""
    from sglang_mamba_ext.speculative.ops.inchunk.from_chunks import block_tables
    from sglang_mamba_ext.speculative.ops.inchunk.fused import _inchunk_conv_window_kernel
    from sglang_mamba_ext.speculative.ops.triton_utils import launch_scope

    L, T, D = xbc.shape
    HV, P, N, G, W = weights.num_heads, weights.head_dim, weights.d_state, weights.n_groups, weights.conv_kernel
    J = len(lay.item_off)
    istart, isrc, ioff, idst, ibeg, ibnd = block_tables(lay, begin, xbc.device)
    BPv = min(BP, triton.next_power_of_2(P))
    BDv = min(BD, triton.next_power_of_2(D))
    has_bias = weights.conv_bias is not None
    cb = weights.conv_bias if has_bias else weights.conv_weight  # dummy pointer
    lo_dt, hi_dt = weights.dt_limit
    with launch_scope(_mamba2_inchunk_kernel):
        _mamba2_inchunk_kernel[(J * L, HV, triton.cdiv(P, BPv))](
            xbc, dt_raw, T, istart, isrc, ioff, idst, ibeg, ibnd, S, J,
            conv_state, *conv_state.stride(),
            ssm_state, *ssm_state.stride(),
            weights.conv_weight, cb, weights.A, weights.dt_bias, float(lo_dt), float(min(hi_dt, 3.0e38)),
            L=L, D=D, HV=HV, G=G, P=P, N=N, W=W, BP=BPv, BN=triton.next_power_of_2(N), HAS_BIAS=has_bias,
        )
    with launch_scope(_inchunk_conv_window_kernel):
        _inchunk_conv_window_kernel[(J * L, triton.cdiv(D, BDv))](
            xbc, T, istart, isrc, ioff, idst,
            conv_state, *conv_state.stride(),
            L=L, C=1, D=D, W=W, BD=BDv,
        )
