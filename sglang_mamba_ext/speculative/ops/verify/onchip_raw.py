"""The deferred mode's on-chip tree verify in one launch per layer, from the raw arguments of
SGLang's ``target_verify`` (issue 39, item 2; ``docs/design.md``, "Speculative verify").

:func:`sglang_mamba_ext.speculative.verify_onchip.onchip_tree_verify` used to prepare its
inputs with torch ops before :mod:`.fused`'s kernel: fp32 copies of q and k L2-normalised, the
gates activated (``g = -exp(A_log) softplus(a + dt_bias)``, ``beta = sigmoid(b)``), the tree
tables built from ``retrieve_parent_token`` by gathers, and the output cast back. On an H200
that entry added 2.7 ms over the kernel alone at Kimi-Linear shapes (20 layers: about twenty
small launches and allocations per layer). This kernel does all of it in registers: each
program (one request, value head and ``BV`` value columns) holds its main-state tile ``[K, BV]``
and, per node, walks ``retrieve_parent_token`` up to the root to find its depth (at most
``DMAX``, deeper paths cut at the root side as :func:`..verify_onchip.tree_paths` cuts them),
then steps the state from the root down, each ancestor found by walking up again (``depth²``
scalar loads, ``depth <= 8``), normalising k and activating the gates of each token as it
loads them, and writes the output in ``v``'s dtype. Same arithmetic as the two-step path, in
the same order, in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_mamba_ext.speculative.ops.triton_utils import gated_delta_step, launch_scope, softplus

__all__ = ["onchip_verify_raw"]

EPS = 1e-6


@triton.jit
def _parent(par_ptr, row, i, T: tl.constexpr, CHAIN: tl.constexpr):
    # node i's parent in row `row` (-1 for the root, node 0, and for entries outside [0, T))
    if CHAIN:
        p = i - 1
    else:
        p = tl.load(par_ptr + row * T + i).to(tl.int64)
        p = tl.where((p >= 0) & (p < T) & (i != 0), p, -1)
    return p


@triton.jit
def _raw_step(S, k_ptr, v_ptr, a_ptr, b_ptr, neg_a, dtb, offs_k, offs_v, mk, mv, EPS_: tl.constexpr,
              GATE_PER_K: tl.constexpr):
    kk = tl.load(k_ptr + offs_k, mask=mk, other=0.0).to(tl.float32)
    kk = kk * tl.rsqrt(tl.sum(kk * kk, axis=0) + EPS_)
    vv = tl.load(v_ptr + offs_v, mask=mv, other=0.0).to(tl.float32)
    if GATE_PER_K:
        x = tl.load(a_ptr + offs_k, mask=mk, other=0.0).to(tl.float32) + dtb
        decay = tl.exp(neg_a * softplus(x))[:, None]
    else:
        x = tl.load(a_ptr).to(tl.float32) + dtb
        decay = tl.exp(neg_a * softplus(x))
    beta = tl.sigmoid(tl.load(b_ptr).to(tl.float32))
    return gated_delta_step(S, kk, vv, decay, beta)


@triton.jit
def _onchip_raw_kernel(
    q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, o_ptr, alog_ptr, dtb_ptr,
    state_ptr, slots_ptr, s_ss, s_sh, s_sk, s_sv,
    par_ptr, scale,
    T: tl.constexpr, DMAX: tl.constexpr, H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, GK: tl.constexpr, EPS_: tl.constexpr,
    GATE_PER_K: tl.constexpr, CHAIN: tl.constexpr,
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
    slot = tl.maximum(tl.load(slots_ptr + i_n).to(tl.int64), 0)  # padding (-1) reads slot 0
    S0 = tl.load(state_ptr + slot * s_ss + i_hv * s_sh + offs_k[:, None] * s_sk + offs_v[None, :] * s_sv,
                 mask=mkv, other=0.0).to(tl.float32)
    neg_a = -tl.exp(tl.load(alog_ptr + i_hv).to(tl.float32))
    if GATE_PER_K:
        dtb = tl.load(dtb_ptr + i_hv * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    else:
        dtb = tl.load(dtb_ptr + i_hv).to(tl.float32)
    for i in range(0, T):
        # depth: the node and up to DMAX - 1 ancestors
        if CHAIN:
            d = tl.minimum(i + 1, DMAX)
        else:
            d = 1
            p = _parent(par_ptr, i_n, i, T, CHAIN)
            for u in range(0, DMAX - 1):
                if p >= 0:
                    d += 1
                    p = _parent(par_ptr, i_n, p, T, CHAIN)
        S = S0
        for j in range(0, DMAX):
            if j < d:
                if CHAIN:
                    node = i - (d - 1) + j
                else:
                    node = i + 0
                    for u in range(0, DMAX - 1):  # up d - 1 - j steps: the path's j-th node
                        if u < d - 1 - j:
                            node = _parent(par_ptr, i_n, node, T, CHAIN)
                tok = i_n * T + node
                S = _raw_step(S, k_ptr + (tok * H + i_h) * K, v_ptr + (tok * HV + i_hv) * V,
                              a_ptr + (tok * HV + i_hv) * GK, b_ptr + tok * HV + i_hv, neg_a, dtb,
                              offs_k, offs_v, mk, mv, EPS_, GATE_PER_K)
        tok = i_n * T + i
        qq = tl.load(q_ptr + (tok * H + i_h) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
        qq = qq * tl.rsqrt(tl.sum(qq * qq, axis=0) + EPS_) * scale
        o = tl.sum(qq[:, None] * S, axis=0)
        tl.store(o_ptr + (tok * HV + i_hv) * V + offs_v, o.to(o_ptr.dtype.element_ty), mask=mv)


def onchip_verify_raw(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      A_log: torch.Tensor, dt_bias: torch.Tensor, state: torch.Tensor, slots: torch.Tensor,
                      parents, T: int, dmax: int, per_head_gate: bool, scale: float, BV: int = 32) -> torch.Tensor:
    """One layer's on-chip tree verify in one launch (module docstring).

    Args:
        q, k: ``n * H * K`` elements each, laid out ``[n, H, K]`` (post-conv, before the L2
            norm; ``n = bs * T`` nodes, request-major); v: ``[n, HV, V]`` layout.
        a: raw gates, ``[n, HV, K]`` (KDA) or ``[n, HV]`` (GDN) layout; b: ``[n, HV]`` layout.
        A_log: ``HV`` elements; dt_bias: ``HV * K`` (KDA) or ``HV`` elements.
        state: ``[slots, HV, K, V]`` view of the main states (any strides; read only).
        slots: ``[bs]`` main slot per request (``-1``: padding, reads slot 0).
        parents: ``[>= bs, T]`` local parent per node (SGLang's ``retrieve_parent_token``;
            entries outside ``[0, T)`` and node 0's read as the root), or None for a chain.
        dmax: deepest path kept (``max_depth``; a chain uses ``T``).
        per_head_gate: GDN's one decay per value head (else KDA's per key channel).

    Returns:
        ``[n, HV, V]`` in ``v``'s dtype.
    """
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    n = v.numel() // (HV * V)
    bs = n // T
    q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))
    o = torch.empty(n, HV, V, dtype=v.dtype, device=v.device)
    if bs == 0:
        return o
    chain = parents is None
    par = slots if chain else parents.contiguous()
    BVv = min(BV, triton.next_power_of_2(V))
    with launch_scope(_onchip_raw_kernel):
        _onchip_raw_kernel[(bs, HV, triton.cdiv(V, BVv))](
            q, k, v, a, b, o, A_log.contiguous(), dt_bias.contiguous(),
            state, slots.contiguous(), *state.stride(),
            par, scale,
            T=T, DMAX=T if chain else max(int(dmax), 1), H=H, HV=HV, K=K, V=V, BK=triton.next_power_of_2(K),
            BV=BVv, GK=1 if per_head_gate else K, EPS_=EPS, GATE_PER_K=not per_head_gate, CHAIN=chain,
        )
    return o
