"""Chunked GDN / KDA in-chunk checkpoint writer (``docs/design.md``, "Prefix checkpoints"; issue
39): each checkpoint starts from the chunk-boundary state just below it and steps at most
``chunk - 1`` tokens, so its cost no longer grows with its offset. The boundary states come from
one chunked pass per row (shared by all the row's checkpoints, all layers batched) in the WY
form of the gated delta rule (the form of fla's and SGLang's chunked KDA / GDN kernels,
``sglang/srt/layers/attention/fla/``, derived here from the recurrence, not copied).

Per value head, chunk of ``C`` tokens, start state ``S0 [K, V]``, ``γ_t`` the cumulative
log-decay inside the chunk (per key channel for KDA, one per head for GDN) and ``k``
L2-normalised post-conv keys, the token step ``S ← (I - β k kᵀ) diag(e^g) S + β k vᵀ`` over the
chunk equals::

    T      = I + strictly_lower(β_t Σ_c k_t[c] k_s[c] e^{γ_t[c] - γ_s[c]})      [C, C]
    U      = T⁻¹ (β v),  W = T⁻¹ (β k ⊙ e^{γ})                               [C, V], [C, K]
    u      = U - W S0                                                          (pseudo-values)
    S_end  = diag(e^{γ_C}) S0 + (k ⊙ e^{γ_C - γ})ᵀ u

Every exponent above is <= 0 (``γ`` falls along the chunk), so nothing overflows: the KDA
products ``e^{γ_t - γ_s}`` are taken directly on 16-token diagonal blocks and through the block
start ``r`` (``e^{γ_t - γ_r} e^{γ_r - γ_s}``, both <= 1) elsewhere. :func:`prepare` computes
the per-token activations (conv + SiLU rounded as served, L2 norm, gates) and these per-chunk
quantities for all rows, layers and chunks at once; :func:`boundary_states_torch` runs the
chunk-to-chunk recurrence (3 batched ops a chunk; the Triton path's kernel is
``fused._chunk_states_kernel``); :func:`write_checkpoints_chunked` is the torch writer. No
SGLang import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, NamedTuple, Optional

import torch
import torch.nn.functional as F

from sglang_mamba_ext.speculative.ops.inchunk.layout import ChunkLayout, gather_rows, valid_mask

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.ops.inchunk import CheckpointWrites
    from sglang_mamba_ext.speculative.replay import ReplayWeights

__all__ = ["GdrPrep", "prepare", "boundary_states_torch", "write_checkpoints_chunked"]

#: Diagonal block of the KDA decay products (``e^{γ_t - γ_s}`` taken directly there).
SUB_BLOCK = 16
#: Elements of the largest temporary of the KDA diagonal blocks before it is split.
_MAX_ELEMS = 1 << 26


class GdrPrep(NamedTuple):
    """Per-token activations and per-chunk WY quantities of a chunked write (float32;
    ``R`` active rows, ``n = max_len`` tokens, ``nb = max_chunks``, ``C = chunk``).

    Attributes:
        k: ``[L, R, n, HV, K]`` L2-normalised keys (per value head). v: ``[L, R, n, HV, V]``.
        g: ``[L, R, n, HV, K]`` (KDA) or ``[L, R, n, HV]`` (GDN) log-decay, 0 past a row's end.
        beta: ``[L, R, n, HV]``, 0 past a row's end.
        U: ``[L, R, nb, HV, C, V]``; W: ``[L, R, nb, HV, C, K]``; Kt: ``[L, R, nb, HV, C, K]``
            (``k ⊙ e^{γ_C - γ}``); E: ``[L, R, nb, HV, K]`` (``e^{γ_C}``); all None when ``nb = 0``.
        window: ``[L, R, W-1+n, D]`` the raw conv inputs: start window, then the row's tokens.
    """

    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor
    U: Optional[torch.Tensor]
    W: Optional[torch.Tensor]
    Kt: Optional[torch.Tensor]
    E: Optional[torch.Tensor]
    window: torch.Tensor


#: Exponents below this give exactly 0 (e^-80 < 2e-35): fp32 subnormals, which are both
#: below the rounding of any O(1) state entry and very slow on CPUs.
_EXP_FLOOR = -80.0


def exp0(x: torch.Tensor) -> torch.Tensor:
    """``e^x`` for ``x <= 0``, flushed to 0 below ``e^-80`` (no subnormal results)."""
    return torch.exp(x.clamp(min=_EXP_FLOOR - 7.0)).masked_fill_(x < _EXP_FLOOR, 0.0)


def _start_windows(conv_state, src, L, D, Wm1):
    """``[L, R, W-1, D]`` float32 start windows of the active rows (zeros where ``src < 0``)."""
    has = (src >= 0)
    win = conv_state[:, src.clamp(min=0)].float()  # [L, R, D, W-1]
    return (win * has[None, :, None, None]).transpose(-1, -2)


def start_states(temporal_state, src) -> torch.Tensor:
    """``[L, R, HV, K, V]`` float32 start states of the active rows (zeros where ``src < 0``)."""
    has = (src >= 0)
    S = temporal_state[:, src.clamp(min=0)].float()
    return S * has[None, :, None, None, None]


def _decay_products(k: torch.Tensor, gam: torch.Tensor) -> torch.Tensor:
    """``A [B, C, C]``: ``A[t, s] = Σ_c k_t[c] k_s[c] e^{γ_t[c] - γ_s[c]}`` for ``s < t``, else 0,
    from ``k [B, C, K]`` and cumulative log-decays ``gam [B, C, K]`` (non-increasing along C):
    directly on the diagonal blocks, through each block's start elsewhere (every exponent <= 0)."""
    B, C, K = k.shape
    bs = min(SUB_BLOCK, C)
    if C % bs:
        bs = C
    nsb = C // bs
    kb, gb = k.reshape(B, nsb, bs, K), gam.reshape(B, nsb, bs, K)
    lower = torch.tril(torch.ones(bs, bs, dtype=torch.bool, device=k.device), -1)
    diag = k.new_empty(B, nsb, bs, bs)
    step = max(1, _MAX_ELEMS // (C * bs * K))
    for b0 in range(0, B, step):  # e^{γ_t - γ_s} directly, s < t in the same block
        d = gb[b0:b0 + step, :, :, None, :] - gb[b0:b0 + step, :, None, :, :]
        diag[b0:b0 + step] = (exp0(d.masked_fill_(~lower[:, :, None], -float("inf")))
                              * kb[b0:b0 + step, :, :, None, :] * kb[b0:b0 + step, :, None, :, :]).sum(-1)
    if nsb == 1:
        return diag.reshape(B, C, C)
    # block i against all earlier tokens, through r = its start - 1: e^{γ_t - γ_r} e^{γ_r - γ_s}
    ref = torch.cat([gam[:, :1] * 0, gam[:, bs - 1:C - 1:bs]], dim=1)[:, :nsb]  # [B, nsb, K]
    q = kb * exp0(gb - ref[:, :, None])  # [B, nsb, bs, K]
    p = k[:, None] * exp0((ref[:, :, None] - gam[:, None]).clamp(max=0.0))  # [B, nsb, C, K]
    off = q @ p.transpose(-1, -2)  # [B, nsb, bs, C]
    before = (torch.arange(C, device=k.device)[None, :] < (torch.arange(nsb, device=k.device) * bs)[:, None])
    A = off.masked_fill_(~before[None, :, None, :], 0.0)
    A = A.reshape(B, C, C)
    idx = torch.arange(nsb, device=k.device)
    A.view(B, nsb, bs, nsb, bs)[:, idx, :, idx, :] = diag.movedim(1, 0)
    return A


def prepare(mixed_qkv, g_raw, b_raw, lay: ChunkLayout, src: torch.Tensor, conv_state, weights: "ReplayWeights"
            ) -> GdrPrep:
    """The :class:`GdrPrep` of ``lay``'s rows: conv + SiLU (rounded to the inputs' dtype, as
    served), L2 norm of ``k`` (rounded likewise), ``g = -e^{A_log} softplus(g_raw + dt_bias)``,
    ``β = sigmoid(b_raw)``, then the WY quantities of every whole chunk. ``src``: ``[R]`` start
    slots of the active rows (device; -1: zeros). A fixed number of batched torch ops for any
    offsets (no host sync)."""
    sh = weights.shape
    L = mixed_qkv.shape[0]
    H, HV, K, V, Wk = sh.num_k_heads, sh.num_v_heads, sh.head_k_dim, sh.head_v_dim, sh.conv_kernel
    D = sh.conv_dim
    R, n, C, nb = len(lay.rows), lay.max_len, lay.chunk, lay.max_chunks
    act = mixed_qkv.dtype
    x = gather_rows(mixed_qkv, lay).float()  # [L, R, n, D]
    u = torch.cat([_start_windows(conv_state, src, L, D, Wk - 1), x], dim=2)  # [L, R, W-1+n, D]
    cw = weights.conv_weight.float()  # [L, D, W]
    acc = u[:, :, 0:n] * cw[:, None, None, :, 0]
    for j in range(1, Wk):
        acc = acc + u[:, :, j:j + n] * cw[:, None, None, :, j]
    if weights.conv_bias is not None:
        acc = acc + weights.conv_bias.float()[:, None, None, :]
    y = F.silu(acc).to(act).float()
    k = y[..., H * K:2 * H * K].unflatten(-1, (H, K))
    k = (k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)).to(act).float()
    k = k.repeat_interleave(HV // H, dim=-2)  # [L, R, n, HV, K]
    v = y[..., 2 * H * K:].unflatten(-1, (HV, V))
    valid = valid_mask(lay, mixed_qkv.device)[None, :, :, None]  # [1, R, n, 1]
    f = gather_rows(g_raw, lay).float() + weights.dt_bias.float()[:, None, None, :]
    neg_a = -weights.A_log.float().exp()  # [L, HV]
    if weights.per_head_gate:
        g = neg_a[:, None, None, :] * F.softplus(f)  # [L, R, n, HV]
        g = torch.where(valid, g, torch.zeros_like(g))
    else:
        g = neg_a[:, None, None, :, None] * F.softplus(f.unflatten(-1, (HV, K)))
        g = torch.where(valid[..., None], g, torch.zeros_like(g))
    beta = torch.sigmoid(gather_rows(b_raw, lay).float())
    beta = torch.where(valid, beta, torch.zeros_like(beta))
    if nb == 0:
        return GdrPrep(k, v, g, beta, None, None, None, None, u)
    # whole chunks: [L, R, nb, C, HV, *] -> batch [L*R*nb*HV, C, *]
    def chunks(t, last):
        t = t[:, :, :nb * C].reshape(L, R, nb, C, HV, *last)
        return t.movedim(3, 4).reshape(-1, C, *last)

    kc, vc, bc = chunks(k, (K,)), chunks(v, (V,)), chunks(beta, ())
    if weights.per_head_gate:
        gam = chunks(g, ()).cumsum(1)  # [B, C]
        d = gam[:, :, None] - gam[:, None, :]
        lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=k.device), -1)
        d = torch.where(lower, d, torch.full_like(d, -float("inf")))
        A = (kc @ kc.transpose(-1, -2)) * exp0(d)
        gam = gam[..., None]  # broadcast over K
    else:
        gam = chunks(g, (K,)).cumsum(1)  # [B, C, K]
        A = _decay_products(kc, gam)
    eye = torch.eye(C, device=k.device, dtype=torch.float32)
    Tm = eye + torch.tril(bc[:, :, None] * A, -1)
    rhs = torch.cat([bc[..., None] * vc, bc[..., None] * kc * exp0(gam)], dim=-1)
    sol = torch.linalg.solve_triangular(Tm, rhs, upper=False, unitriangular=True)
    last = gam[:, -1:]
    Kt = kc * exp0(last - gam)
    E = exp0(last[:, 0]).expand(-1, K) if weights.per_head_gate else exp0(last[:, 0])
    shp = (L, R, nb, HV, C)
    return GdrPrep(k, v, g, beta, sol[..., :V].reshape(*shp, V), sol[..., V:].reshape(*shp, K),
                   Kt.reshape(*shp, K), E.reshape(L, R, nb, HV, K).contiguous(), u)


def boundary_states_torch(prep: GdrPrep, lay: ChunkLayout, S0: torch.Tensor) -> torch.Tensor:
    """``[L, Q, HV, K, V]`` float32: the kept boundary states (``lay.bnd_row`` /
    ``lay.bnd_chunk``), from the active rows' start states ``S0 [L, R, HV, K, V]`` through the
    chunk-to-chunk recurrence (``u = U - W S``, ``S = e^{γ_C} S + K̃ᵀ u``; rows with fewer
    chunks run on, their kept states taken when passed)."""
    L, R, HV, K, V = S0.shape
    out = S0.new_empty(L, len(lay.bnd_row), HV, K, V)
    at: Dict[int, list] = {}
    for q, (r, c) in enumerate(zip(lay.bnd_row, lay.bnd_chunk)):
        at.setdefault(c, []).append((q, r))

    def keep(c, S):
        for q, r in at.get(c, ()):
            out[:, q] = S[:, r]

    S = S0.clone()
    keep(0, S)
    for c in range(lay.max_chunks):
        Sf = S.reshape(-1, K, V)
        u = torch.baddbmm(prep.U[:, :, c].reshape(-1, lay.chunk, V), prep.W[:, :, c].reshape(-1, lay.chunk, K),
                          Sf, alpha=-1.0)
        Sf = torch.baddbmm(prep.E[:, :, c].reshape(-1, K, 1) * Sf, prep.Kt[:, :, c].reshape(-1, lay.chunk, K)
                           .transpose(-1, -2), u)
        S = Sf.reshape(L, R, HV, K, V)
        keep(c + 1, S)
    return out


def scan_from_boundaries(prep: GdrPrep, lay: ChunkLayout, S: torch.Tensor, stats: Optional[dict] = None,
                         begin: Optional[List[int]] = None) -> torch.Tensor:
    """Step every checkpoint's boundary state ``S [L, J, HV, K, V]`` over its ``o - b`` tokens
    (at most ``chunk - 1``; all checkpoints batched, the shorter ones masked to the identity).
    ``begin``: ``[J]`` the token ``b`` each starts at in its row of ``prep`` (default: its chunk
    boundary, ``item_chunk * chunk``). ``stats``, if given, gets ``"scanned"``: ``[J]`` steps
    applied to each checkpoint."""
    J = len(lay.item_off)
    if begin is None:
        begin = [c * lay.chunk for c in lay.item_chunk]
    lens = [o - b for o, b in zip(lay.item_off, begin)]
    steps = max(lens, default=0)
    counts = [0] * J
    if steps:
        dev = S.device
        rows = torch.tensor(lay.item_row, dtype=torch.int64, device=dev)
        n = prep.k.shape[2]  # a checkpoint on the last token's boundary steps nothing: its index stays in range
        tok = torch.tensor([[min(b + min(s, max(m - 1, 0)), n - 1) for s in range(steps)]
                            for b, m in zip(begin, lens)], dtype=torch.int64, device=dev)
        act = torch.tensor([[s < m for s in range(steps)] for m in lens], dtype=torch.bool, device=dev)

        def pick(t):  # [L, R, n, ...] -> [L, J, steps, ...]
            return t[:, rows[:, None], tok]

        k, v, beta = pick(prep.k), pick(prep.v), pick(prep.beta)
        beta = torch.where(act[None, :, :, None], beta, torch.zeros_like(beta))
        g = pick(prep.g)
        g = torch.where(act.reshape(1, J, steps, *([1] * (g.dim() - 3))), g, torch.zeros_like(g))
        decay = exp0(g)
        per_head = decay.dim() == 4
        for s in range(steps):
            ks = k[:, :, s]
            S = S * (decay[:, :, s, :, None, None] if per_head else decay[:, :, s, :, :, None])
            pred = (ks[..., None] * S).sum(-2)
            S = S + ks[..., None] * ((v[:, :, s] - pred) * beta[:, :, s, :, None])[..., None, :]
            for j, m in enumerate(lens):
                counts[j] += int(s < m)
    if stats is not None:
        stats["scanned"] = counts
        stats["chunks"] = lay.max_chunks
    return S


def write_checkpoints_chunked(
    mixed_qkv: torch.Tensor, g_raw: torch.Tensor, b_raw: torch.Tensor, writes: "CheckpointWrites",
    conv_state: torch.Tensor, temporal_state: torch.Tensor, weights: "ReplayWeights", lay: ChunkLayout,
    stats: Optional[dict] = None,
) -> None:
    """The torch writer; contract: :func:`sglang_mamba_ext.speculative.ops.inchunk.write_checkpoints`
    (inputs validated there), with ``lay`` its :func:`~.layout.chunk_layout`."""
    J = len(lay.item_off)
    if J == 0:
        if stats is not None:
            stats.update(scanned=[], chunks=0)
        return
    dev = mixed_qkv.device
    src = writes.src_slots.to(torch.int64)[torch.tensor(lay.rows, dtype=torch.int64, device=dev)]
    prep = prepare(mixed_qkv, g_raw, b_raw, lay, src, conv_state, weights)
    S0 = start_states(temporal_state, src)
    bnd = boundary_states_torch(prep, lay, S0) if lay.max_chunks else S0[:, lay.bnd_row]
    S = scan_from_boundaries(prep, lay, bnd[:, lay.item_bnd], stats)
    write_states(prep.window, lay, S, conv_state, temporal_state)


def write_states(window: torch.Tensor, lay: ChunkLayout, S: Optional[torch.Tensor], conv_state, state_pool) -> None:
    """Store each checkpoint's conv window (the ``W-1`` raw inputs before its offset, from
    ``window [L, R, W-1+n, D]``) and, when given, its state ``S [L, J, ...]`` into its slot."""
    dev = window.device
    Wm1 = conv_state.shape[-1]
    rows = torch.tensor(lay.item_row, dtype=torch.int64, device=dev)
    cols = torch.tensor([[o + m for m in range(Wm1)] for o in lay.item_off], dtype=torch.int64, device=dev)
    dst = torch.tensor(lay.item_dst, dtype=torch.int64, device=dev)
    conv_state[:, dst] = window[:, rows[:, None], cols].transpose(-1, -2).to(conv_state.dtype)
    if S is not None:
        state_pool[:, dst] = S.to(state_pool.dtype)
