"""On-chip tree verify of a Mamba2 layer (issue 41, item 3; ``docs/design.md``, "Speculative
verify" and "Deferred update"): the output SGLang's ``selective_state_update`` gives every
draft-tree node in a target-verify batch (``kernels/ops/mamba/triton_ops/mamba_ssm.py``, called
by ``MambaMixer2.forward`` with ``disable_state_update=True``, ``intermediate_states_buffer``
and ``retrieve_parent_token``), without the node-state buffer: SGLang steps each node from its
parent's state read back from an HBM buffer ``[rows, T, HV, P, N]``; here one program per
(request, head, ``P`` tile) keeps the main state's ``[BP, N]`` tile in registers and recomputes
each node's state along its root path (``sum(depth)`` steps instead of ``T``), per token::

    dt = softplus(dt_raw + dt_bias)                   # [BP] (per head dim, as SGLang's API)
    h  = exp(A * dt) * h + (dt * x) (outer) B         # A [BP, N], B of the head's group
    y  = sum_n(h * C) + D * x                         # the node's output, in out's dtype

The main state is only read. :func:`mamba2_tree_verify_torch` is the reference (loops);
:func:`mamba2_tree_verify_triton` the kernel; tree tables from
:func:`sglang_mamba_ext.speculative.verify_onchip.tree_paths` (device gathers, no host sync).
No SGLang import.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglang_mamba_ext.speculative.ops.triton_utils import launch_scope, softplus

__all__ = ["mamba2_tree_verify_torch", "mamba2_tree_verify_triton", "mamba2_tree_verify"]


def _tables(parents: Optional[torch.Tensor], bs: int, T: int, max_depth: int, device):
    from sglang_mamba_ext.speculative.verify_onchip import tree_paths

    if parents is None:  # a chain: node i's parent is i - 1
        return tree_paths((torch.arange(T, device=device) - 1).expand(bs, T), T)
    return tree_paths(parents[:bs], max(int(max_depth), 1))


def mamba2_tree_verify_torch(state, x, dt, A, B, C, D, dt_bias, slots, parents, max_depth: int,
                             dt_softplus: bool = True) -> torch.Tensor:
    """Torch reference of :func:`mamba2_tree_verify_triton` (same arguments); returns ``y
    [bs, T, HV, P]`` float32."""
    bs, T, HV, P = x.shape
    G = B.shape[2]
    depth, path = _tables(parents, bs, T, max_depth, x.device)
    y = torch.zeros(bs, T, HV, P, dtype=torch.float32, device=x.device)
    Af = A.float()
    for b in range(bs):
        s0 = state[max(int(slots[b]), 0)].float()
        for i in range(T):
            h = s0.clone()
            for j in range(int(depth[b, i])):
                t = int(path[b, i, j])
                d = dt[b, t].float() + (dt_bias.float() if dt_bias is not None else 0.0)  # [HV, P]
                d = F.softplus(d) if dt_softplus else d
                Bh = B[b, t].float().repeat_interleave(HV // G, 0)  # [HV, N]
                h = torch.exp(Af * d[..., None]) * h + (d * x[b, t].float())[..., None] * Bh[:, None, :]
            Ch = C[b, i].float().repeat_interleave(HV // G, 0)
            y[b, i] = (h * Ch[:, None, :]).sum(-1) + (D.float() * x[b, i].float() if D is not None else 0.0)
    return y


@triton.jit
def _mamba2_tree_verify_kernel(
    x_ptr, sx_b, sx_t, sx_h, sx_p,
    dt_ptr, sdt_b, sdt_t, sdt_h, sdt_p,
    a_ptr, sa_h, sa_p, sa_n,
    b_ptr, sb_b, sb_t, sb_g, sb_n,
    c_ptr, sc_b, sc_t, sc_g, sc_n,
    d_ptr, sd_h, sd_p,
    dtb_ptr, sdtb_h, sdtb_p,
    out_ptr, so_b, so_t, so_h, so_p,
    state_ptr, ss_s, ss_h, ss_p, ss_n,
    slots_ptr, path_ptr, depth_ptr,
    buf_ptr, sbuf_b, sbuf_t, sbuf_h, sbuf_p, sbuf_n,
    T: tl.constexpr, DMAX: tl.constexpr, HV: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BP: tl.constexpr, BN: tl.constexpr, HAS_D: tl.constexpr, HAS_DTB: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
    ON_CHIP: tl.constexpr,
):
    i_b = tl.program_id(0)
    i_h = tl.program_id(1)
    i_p = tl.program_id(2)
    i_g = i_h // (HV // G)
    offs_p = i_p * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mp = offs_p < P
    mn = offs_n < N
    m2 = mp[:, None] & mn[None, :]
    slot = tl.maximum(tl.load(slots_ptr + i_b).to(tl.int64), 0)  # padding (-1): slot 0, output discarded
    S0 = tl.load(state_ptr + slot * ss_s + i_h * ss_h + offs_p[:, None] * ss_p + offs_n[None, :] * ss_n,
                 mask=m2, other=0.0).to(tl.float32)
    A = tl.load(a_ptr + i_h * sa_h + offs_p[:, None] * sa_p + offs_n[None, :] * sa_n, mask=m2, other=0.0).to(tl.float32)
    if HAS_DTB:
        dtb = tl.load(dtb_ptr + i_h * sdtb_h + offs_p * sdtb_p, mask=mp, other=0.0).to(tl.float32)
    x_h = x_ptr + i_b * sx_b + i_h * sx_h + offs_p * sx_p
    dt_h = dt_ptr + i_b * sdt_b + i_h * sdt_h + offs_p * sdt_p
    b_g = b_ptr + i_b * sb_b + i_g * sb_g + offs_n * sb_n
    if not ON_CHIP:
        btile = buf_ptr + i_b * sbuf_b + i_h * sbuf_h + offs_p[:, None] * sbuf_p + offs_n[None, :] * sbuf_n
    for i in range(0, T):
        node = i_b * T + i
        d = tl.load(depth_ptr + node).to(tl.int32)
        S = S0
        j0 = 0
        if not ON_CHIP:  # buffered (as snapshot verify): step from the parent's state read back
            if d >= 2:
                par = tl.load(path_ptr + node * DMAX + d - 2).to(tl.int64)
                S = tl.load(btile + par * sbuf_t, mask=m2, other=0.0).to(tl.float32)
            j0 = d - 1
        for j in range(j0, d):
            t = tl.load(path_ptr + node * DMAX + j).to(tl.int64)
            xx = tl.load(x_h + t * sx_t, mask=mp, other=0.0).to(tl.float32)
            dd = tl.load(dt_h + t * sdt_t, mask=mp, other=0.0).to(tl.float32)
            if HAS_DTB:
                dd += dtb
            if DT_SOFTPLUS:
                dd = softplus(dd)
            bb = tl.load(b_g + t * sb_t, mask=mn, other=0.0).to(tl.float32)
            S = S * tl.exp(A * dd[:, None]) + (dd * xx)[:, None] * bb[None, :]
        if not ON_CHIP:
            tl.store(btile + i * sbuf_t, S.to(buf_ptr.dtype.element_ty), mask=m2)
            tl.debug_barrier()
        cc = tl.load(c_ptr + i_b * sc_b + i * sc_t + i_g * sc_g + offs_n * sc_n, mask=mn, other=0.0).to(tl.float32)
        y = tl.sum(S * cc[None, :], axis=1)
        if HAS_D:
            xi = tl.load(x_h + i * sx_t, mask=mp, other=0.0).to(tl.float32)
            y += tl.load(d_ptr + i_h * sd_h + offs_p * sd_p, mask=mp, other=0.0).to(tl.float32) * xi
        tl.store(out_ptr + i_b * so_b + i * so_t + i_h * so_h + offs_p * so_p,
                 y.to(out_ptr.dtype.element_ty), mask=mp)


def mamba2_tree_verify_triton(state, x, dt, A, B, C, D, dt_bias, slots, parents, max_depth: int,
                              dt_softplus: bool = True, out: Optional[torch.Tensor] = None, BP: int = 32,
                              node_states: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Every tree node's output of one Mamba2 layer, the main state read only (on chip; with
    ``node_states`` ``[>= bs, T, HV, P, N]``, the buffered form snapshot verify uses: each node
    steps once from its parent's state read back from the buffer and writes its own, row ``b``
    for request ``b``; the GPU check times the two against each other).

    Args:
        state: ``[slots, HV, P, N]`` main SSM states (any strides).
        x: ``[bs, T, HV, P]`` post-conv ``x``; dt ``[bs, T, HV, P]`` raw (any strides: SGLang's
            expanded views pass as they are).
        A: ``[HV, P, N]`` (negative); B, C ``[bs, T, G, N]``; D ``[HV, P]`` or None; dt_bias
            ``[HV, P]`` or None.
        slots: ``[>= bs]`` main slots (``-1``: padding, reads slot 0, output discarded).
        parents: ``[>= bs, T]`` ``retrieve_parent_token`` (None: a chain).
        max_depth: tree depth bound (``speculative_num_steps + 1``).
        out: ``[bs, T, HV, P]`` to write (SGLang's preallocated output), else a new float32 one.
        BP: head-dim tile.

    Returns:
        ``out``.
    """
    bs, T, HV, P = x.shape
    G, N = B.shape[2], B.shape[3]
    if out is None:
        out = torch.empty(bs, T, HV, P, dtype=torch.float32, device=x.device)
    if bs == 0:
        return out
    depth, path = _tables(parents, bs, T, max_depth, x.device)
    depth, path = depth.contiguous(), path.contiguous()
    BPv = min(BP, triton.next_power_of_2(P))
    Dt = D if D is not None else A
    dtb = dt_bias if dt_bias is not None else A
    on_chip = node_states is None
    buf = out if on_chip else node_states
    bstr = (0,) * 5 if on_chip else node_states.stride()
    with launch_scope(_mamba2_tree_verify_kernel):
        _mamba2_tree_verify_kernel[(bs, HV, triton.cdiv(P, BPv))](
            x, *x.stride(), dt, *dt.stride(), A, *A.stride(), B, *B.stride(), C, *C.stride(),
            Dt, *Dt.stride()[-2:], dtb, *dtb.stride()[-2:], out, *out.stride(),
            state, *state.stride(), slots[:bs].to(torch.int64).contiguous(), path, depth, buf, *bstr,
            T=T, DMAX=path.shape[-1], HV=HV, G=G, P=P, N=N, BP=BPv, BN=triton.next_power_of_2(N),
            HAS_D=D is not None, HAS_DTB=dt_bias is not None, DT_SOFTPLUS=bool(dt_softplus), ON_CHIP=on_chip,
        )
    return out


def mamba2_tree_verify(*args, impl: str = "triton", **kwargs) -> torch.Tensor:
    """:func:`mamba2_tree_verify_triton` (``impl="triton"``) or the torch reference.

    Raises:
        ValueError: an unknown ``impl``.
    """
    if impl == "triton":
        return mamba2_tree_verify_triton(*args, **kwargs)
    if impl == "torch":
        kwargs.pop("out", None)
        return mamba2_tree_verify_torch(*args, **kwargs)
    raise ValueError(f"mamba2_tree_verify: impl must be 'triton' or 'torch', got {impl!r}")
