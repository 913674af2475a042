"""Triton tree-verify recurrence of one linear layer (``docs/design.md``, "Speculative
verify"); torch reference: :func:`.naive.tree_recurrence`. One kernel, grid ``(N, HV, cdiv(V,
BV))``: a program holds a ``[K, BV]`` tile of one value head's state of one request, loads the
main state tile once (``S0``) and, per tree node, either recomputes the node's state from
``S0`` along its path in registers (``ON_CHIP``, the deferred mode with no node-state buffer;
``sum(depth)`` steps instead of ``T``, about 2.7x the arithmetic for topk=4, steps=3, T=37) or
steps from its parent's state read back from ``node_states`` and writes its own there
(buffered: snapshot mode, or the deferred mode's one-layer buffer). ``HAS_PENDING`` folds a
round's stashed tokens (post-conv ``q, k, v, g, beta``, at most ``A``) into the load of ``S0``
and writes the replayed state back once ("Replay" done by the first reader of the state;
measured by ``ops/gpu_check.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang_mamba_ext.speculative.ops.triton_utils import gated_delta_step, launch_scope
from sglang_mamba_ext.speculative.tree import TreeIndex

__all__ = ["tree_recurrence_triton", "tree_recurrence_onchip"]


# Load one token's k, v, g (per key channel or per head), beta and apply the step.
@triton.jit
def _gdr_step(S, k_ptr, v_ptr, g_ptr, b_ptr, offs_k, offs_v, mk, mv, GATE_PER_K: tl.constexpr):
    kk = tl.load(k_ptr + offs_k, mask=mk, other=0.0).to(tl.float32)
    vv = tl.load(v_ptr + offs_v, mask=mv, other=0.0).to(tl.float32)
    if GATE_PER_K:
        decay = tl.exp(tl.load(g_ptr + offs_k, mask=mk, other=0.0).to(tl.float32))[:, None]
    else:
        decay = tl.exp(tl.load(g_ptr).to(tl.float32))
    return gated_delta_step(S, kk, vv, decay, tl.load(b_ptr).to(tl.float32))


@triton.jit
def _tree_verify_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr,
    state_ptr, slots_ptr, s_ss, s_sh, s_sk, s_sv,
    par_ptr, path_ptr, depth_ptr,
    buf_ptr, rows_ptr, s_br, s_bt, s_bh, s_bk, s_bv,
    pq_ptr, pk_ptr, pv_ptr, pg_ptr, pb_ptr, pcnt_ptr,
    scale,
    T: tl.constexpr, DMAX: tl.constexpr, A: tl.constexpr,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, GK: tl.constexpr,
    ON_CHIP: tl.constexpr, HAS_PENDING: tl.constexpr, GATE_PER_K: tl.constexpr,
):
    i_n = tl.program_id(0)
    i_hv = tl.program_id(1)
    i_v = tl.program_id(2)
    i_h = i_hv // (HV // H)
    offs_k = tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    mkv = mk[:, None] & mv[None, :]
    slot = tl.load(slots_ptr + i_n).to(tl.int64)
    tile = offs_k[:, None] * s_sk + offs_v[None, :] * s_sv
    st = state_ptr + slot * s_ss + i_hv * s_sh
    S0 = tl.load(st + tile, mask=mkv, other=0.0).to(tl.float32)
    if HAS_PENDING:
        cnt = tl.load(pcnt_ptr + i_n).to(tl.int32)
        for t in range(0, cnt):
            tok = i_n * A + t
            S0 = _gdr_step(S0, pk_ptr + (tok * H + i_h) * K, pv_ptr + (tok * HV + i_hv) * V,
                           pg_ptr + (tok * HV + i_hv) * GK, pb_ptr + tok * HV + i_hv,
                           offs_k, offs_v, mk, mv, GATE_PER_K)
        if cnt > 0:
            tl.store(st + tile, S0.to(state_ptr.dtype.element_ty), mask=mkv)
    if not ON_CHIP:
        row = tl.load(rows_ptr + i_n).to(tl.int64)
        btile = offs_k[:, None] * s_bk + offs_v[None, :] * s_bv
        bbase = buf_ptr + row * s_br + i_hv * s_bh
    for i in range(0, T):
        node = i_n * T + i
        if ON_CHIP:
            d = tl.load(depth_ptr + node).to(tl.int32)
            S = S0
            for j in range(0, d):
                p = tl.load(path_ptr + node * DMAX + j).to(tl.int64)
                tok = i_n * T + p
                S = _gdr_step(S, k_ptr + (tok * H + i_h) * K, v_ptr + (tok * HV + i_hv) * V,
                              g_ptr + (tok * HV + i_hv) * GK, b_ptr + tok * HV + i_hv,
                              offs_k, offs_v, mk, mv, GATE_PER_K)
        else:
            p = tl.load(par_ptr + node).to(tl.int64)
            if p >= 0:
                S = tl.load(bbase + p * s_bt + btile, mask=mkv, other=0.0).to(tl.float32)
            else:
                S = S0
            S = _gdr_step(S, k_ptr + (node * H + i_h) * K, v_ptr + (node * HV + i_hv) * V,
                          g_ptr + (node * HV + i_hv) * GK, b_ptr + node * HV + i_hv,
                          offs_k, offs_v, mk, mv, GATE_PER_K)
            tl.store(bbase + i * s_bt + btile, S.to(buf_ptr.dtype.element_ty), mask=mkv)
            tl.debug_barrier()
        qq = tl.load(q_ptr + (node * H + i_h) * K + offs_k, mask=mk, other=0.0).to(tl.float32) * scale
        o = tl.sum(qq[:, None] * S, axis=0)
        tl.store(o_ptr + (node * HV + i_hv) * V + offs_v, o, mask=mv)


def tree_recurrence_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state_pool: torch.Tensor,
    slots: torch.Tensor,
    index: TreeIndex,
    scale: float,
    node_states: Optional[torch.Tensor] = None,
    rows: Optional[torch.Tensor] = None,
    pending: Optional[tuple] = None,
    BV: int = 32,
) -> torch.Tensor:
    """Tree verify recurrence of one layer (Triton).

    Args:
        q, k: ``[N, T, H, K]``; v ``[N, T, HV, V]``; g ``[N, T, HV, K]`` or ``[N, T, HV]``;
            beta ``[N, T, HV]`` (contiguous; any float dtype, computed in fp32).
        state_pool: ``[slots, HV, K, V]`` main SSM states (any strides); ``slots`` ``[N]``.
        index: tree tables (parents, depth, path).
        node_states: None for the on-chip mode; else ``[R, T, HV, K, V]`` buffer written with
            every node's state (row ``rows[n]``).
        pending: optional ``(q, k, v, g, beta, counts)`` of stashed tokens ``[N, A, ...]`` to
            fold into the main state first (written back to ``state_pool``).

    Returns:
        ``o [N, T, HV, V]`` float32.
    """
    N, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o = torch.empty(N, T, HV, V, dtype=torch.float32, device=q.device)
    if N == 0:
        return o
    gate_per_k = g.dim() == 4
    BK = triton.next_power_of_2(K)
    BVv = min(BV, triton.next_power_of_2(V))
    par = index.parents.to(q.device).contiguous()
    path = index.path.to(q.device).contiguous()
    depth = index.depth.to(q.device).contiguous()
    on_chip = node_states is None
    if on_chip:
        buf, brows, bstr = o, slots, (0, 0, 0, 0, 0)
    else:
        buf, brows, bstr = node_states, rows, node_states.stride()
    if pending is not None:
        pq, pk, pv, pg, pb, pc = (x.contiguous() for x in pending)
        A = pq.shape[1]
    else:
        pq = pk = pv = pg = pb = q
        pc = slots
        A = 1
    with launch_scope(_tree_verify_kernel):
        _tree_verify_kernel[(N, HV, triton.cdiv(V, BVv))](
            q, k, v, g, beta, o,
            state_pool, slots.to(torch.int64).contiguous(), *state_pool.stride(),
            par, path, depth,
            buf, brows.to(torch.int64).contiguous(), *bstr,
            pq, pk, pv, pg, pb, pc,
            scale,
            T=T, DMAX=path.shape[-1], A=A, H=H, HV=HV, K=K, V=V, BK=BK, BV=BVv, GK=K if gate_per_k else 1,
            ON_CHIP=on_chip, HAS_PENDING=pending is not None, GATE_PER_K=gate_per_k,
        )
    return o


def tree_recurrence_onchip(q, k, v, g, beta, state: torch.Tensor, index: TreeIndex, scale: float) -> torch.Tensor:
    """On-chip tree verify from gathered main states ``state [N, HV, K, V]`` (no buffer)."""
    N = state.shape[0]
    return tree_recurrence_triton(q, k, v, g, beta, state, torch.arange(N, device=state.device), index, scale)
