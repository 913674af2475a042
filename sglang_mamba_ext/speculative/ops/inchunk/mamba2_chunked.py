"""Chunked Mamba2 / SSD in-chunk checkpoint writer (``docs/design.md``, "Prefix checkpoints";
issue 39): each checkpoint starts from the chunk-boundary state below it and adds the at most
``chunk - 1`` tokens after it, so its cost no longer grows with its offset.

Mamba2's decay is one scalar per head and token (``a_t = dt_t A``), so a run of tokens adds to
the state in one contraction (the SSD form of SGLang's ``ssd_combined.mamba_chunk_scan_combined``,
derived here from the recurrence ``state = e^{a_t} state + dt_t x_t ⊗ B_t``)::

    state_after = e^{Σ_t a_t} state_before + Σ_t e^{Σ_{u > t} a_u} dt_t x_t ⊗ B_t

Every exponent is a sum of ``a <= 0`` taken over exactly its own tokens (reverse cumulative
sums, not differences of long prefix sums), so nothing overflows or cancels. :func:`prepare`
computes the per-token activations (conv + SiLU rounded as served, softplus ``dt``) and each
whole chunk's contribution; :func:`boundary_states` combines them into the kept boundary states
in one contraction over chunks; :func:`add_partial` adds each checkpoint's partial chunk (torch
path; the Triton path steps those tokens in ``mamba2._mamba2_inchunk_kernel``). No SGLang import.
"""

from __future__ import annotations

from typing import List, TYPE_CHECKING, NamedTuple, Optional

import torch
import torch.nn.functional as F

from sglang_mamba_ext.speculative.ops.inchunk.chunked import exp0
from sglang_mamba_ext.speculative.ops.inchunk.layout import ChunkLayout, gather_rows, valid_mask

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import Mamba2Weights

__all__ = ["Mamba2Prep", "prepare", "boundary_states", "add_partial", "start_states"]


class Mamba2Prep(NamedTuple):
    """Per-token activations of a chunked Mamba2 write (float32; ``R`` active rows, ``n`` tokens).

    Attributes:
        xdt: ``[L, R, n, HV, P]`` ``dt_t x_t`` (0 past a row's end).
        B: ``[L, R, n, HV, N]`` the head's ``B`` group.
        a: ``[L, R, n, HV]`` log-decay ``dt_t A`` (0 past a row's end).
        window: ``[L, R, W-1+n, D]`` raw conv inputs: start window, then the row's tokens.
    """

    xdt: torch.Tensor
    B: torch.Tensor
    a: torch.Tensor
    window: torch.Tensor


def _rev_excl_cumsum(a: torch.Tensor, dim: int) -> torch.Tensor:
    """``out[t] = Σ_{u > t} a[u]`` along ``dim``."""
    return a.flip(dim).cumsum(dim).flip(dim) - a


def start_states(ssm_state, src) -> torch.Tensor:
    """``[L, R, HV, P, N]`` float32 start states of the active rows (zeros where ``src < 0``)."""
    return ssm_state[:, src.clamp(min=0)].float() * (src >= 0)[None, :, None, None, None]


def prepare(xbc, dt_raw, lay: ChunkLayout, src: torch.Tensor, conv_state, weights: "Mamba2Weights") -> Mamba2Prep:
    """The :class:`Mamba2Prep` of ``lay``'s rows (``src``: ``[R]`` start slots, device; -1:
    zeros): conv + SiLU rounded to ``xbc``'s dtype, ``dt = clamp(softplus(dt_raw + dt_bias))``."""
    HV, P, N, G, Wk = weights.num_heads, weights.head_dim, weights.d_state, weights.n_groups, weights.conv_kernel
    n = lay.max_len
    x = gather_rows(xbc, lay).float()  # [L, R, n, D]
    win = conv_state[:, src.clamp(min=0)].float() * (src >= 0)[None, :, None, None]  # [L, R, D, W-1]
    u = torch.cat([win.transpose(-1, -2), x], dim=2)
    cw = weights.conv_weight.float()
    acc = u[:, :, 0:n] * cw[:, None, None, :, 0]
    for j in range(1, Wk):
        acc = acc + u[:, :, j:j + n] * cw[:, None, None, :, j]
    if weights.conv_bias is not None:
        acc = acc + weights.conv_bias.float()[:, None, None, :]
    y = F.silu(acc).to(xbc.dtype).float()
    xs = y[..., :HV * P].unflatten(-1, (HV, P))
    Bm = y[..., HV * P:HV * P + G * N].unflatten(-1, (G, N)).repeat_interleave(HV // G, dim=-2)
    lo, hi = weights.dt_limit
    dt = F.softplus(gather_rows(dt_raw, lay).float() + weights.dt_bias.float()[:, None, None, :]).clamp(lo, hi)
    dt = torch.where(valid_mask(lay, xbc.device)[None, :, :, None], dt, torch.zeros_like(dt))
    return Mamba2Prep(dt[..., None] * xs, Bm, dt * weights.A.float()[:, None, None, :], u)


def boundary_states(prep: Mamba2Prep, lay: ChunkLayout, S0: torch.Tensor) -> torch.Tensor:
    """``[L, Q, HV, P, N]`` float32: the kept boundary states from the active rows' start states
    ``S0 [L, R, HV, P, N]``: each whole chunk's contribution in one contraction, then every kept
    boundary ``c`` as ``e^{Σ_{c'' < c} A_c''} S0 + Σ_{c' < c} e^{Σ_{c' < c'' < c} A_c''} R_c'``
    (``A_c``: a chunk's total log-decay), one more contraction."""
    L, R, HV, P, N = S0.shape
    nb, C = lay.max_chunks, lay.chunk
    dev = S0.device
    rows = torch.tensor(lay.bnd_row, dtype=torch.int64, device=dev)
    if nb == 0:
        return S0[:, rows]
    a = prep.a[:, :, :nb * C].unflatten(2, (nb, C))  # [L, R, nb, C, HV]
    w = exp0(_rev_excl_cumsum(a, 3))  # decay from each token to its chunk's end
    Rc = torch.einsum("lrcth,lrcthp,lrcthn->lrchpn", w, prep.xdt[:, :, :nb * C].unflatten(2, (nb, C)),
                      prep.B[:, :, :nb * C].unflatten(2, (nb, C)))
    tot = a.sum(3)  # [L, R, nb, HV]
    tgt = torch.tensor(lay.bnd_chunk, dtype=torch.int64, device=dev)  # [Q]
    ar = torch.arange(nb, device=dev)
    before = (ar[None, :] < tgt[:, None])  # [Q, nb]: chunks below the boundary
    t = torch.where(before[None, :, :, None], tot[:, rows], torch.zeros((), device=dev))  # [L, Q, nb, HV]
    suf = _rev_excl_cumsum(t, 2)  # Σ over chunks after c' and below the boundary
    wc = torch.where(before[None, :, :, None], exp0(suf), torch.zeros((), device=dev))
    S = exp0(t.sum(2))[..., None, None] * S0[:, rows]
    return S + torch.einsum("lqch,lqchpn->lqhpn", wc, Rc[:, rows])


def add_partial(prep: Mamba2Prep, lay: ChunkLayout, S: torch.Tensor, stats: Optional[dict] = None,
                begin: Optional[List[int]] = None) -> torch.Tensor:
    """Each checkpoint's state from its boundary state ``S [L, J, HV, P, N]`` and the ``o - b``
    (at most ``chunk - 1``) tokens after it, all checkpoints in one contraction. ``begin``:
    ``[J]`` the token ``b`` of each in its row of ``prep`` (default ``item_chunk * chunk``).
    ``stats``, if given, gets ``"scanned"`` (``[J]`` tokens added per checkpoint) and ``"chunks"``."""
    if begin is None:
        begin = [c * lay.chunk for c in lay.item_chunk]
    lens = [o - b for o, b in zip(lay.item_off, begin)]
    steps = max(lens, default=0)
    if stats is not None:
        stats.update(scanned=list(lens), chunks=lay.max_chunks)
    if not steps:
        return S
    dev = S.device
    rows = torch.tensor(lay.item_row, dtype=torch.int64, device=dev)
    n = prep.a.shape[2]  # a checkpoint on the last token's boundary steps nothing: its index stays in range
    tok = torch.tensor([[min(b + min(s, m - 1 if m else 0), n - 1) for s in range(steps)]
                        for b, m in zip(begin, lens)], dtype=torch.int64, device=dev)
    act = torch.tensor([[s < m for s in range(steps)] for m in lens], dtype=torch.bool, device=dev)
    a = torch.where(act[None, :, :, None], prep.a[:, rows[:, None], tok], torch.zeros((), device=dev))  # [L, J, s, HV]
    w = torch.where(act[None, :, :, None], exp0(_rev_excl_cumsum(a, 2)), torch.zeros((), device=dev))
    add = torch.einsum("ljsh,ljshp,ljshn->ljhpn", w, prep.xdt[:, rows[:, None], tok], prep.B[:, rows[:, None], tok])
    return exp0(a.sum(2))[..., None, None] * S + add
