"""Plain-torch CPU versions of SGLang 0.5.23's Mamba2 chunked SSD scan and its causal depthwise
convolutions (issue 40, item 5; the delta-rule kernels are in :mod:`.cpu_kernels`).

- :func:`mamba_chunk_scan_combined` replaces
  ``sglang/kernels/ops/mamba/triton_ops/ssd_combined.py::mamba_chunk_scan_combined`` (called by
  ``srt/layers/attention/mamba/mamba.py::MambaMixer2.forward`` for prefill).
- :func:`causal_conv1d_fn` / :func:`causal_conv1d_update` replace
  ``sglang/kernels/ops/mamba/causal_conv1d_triton.py``'s functions of the same names (Mamba2,
  GDN, KDA and short-conv prefill / decode).
- :func:`selective_state_update` replaces ``mamba/triton_ops/mamba_ssm.py``'s (Mamba2 decode).

The SSD recurrence (per head, state ``h`` of shape ``[P, N]``)::

    dt_t = clamp(softplus(dt_t + dt_bias), dt_limit);   h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T
    y_t  = h_t C_t + D x_t   (times silu(z_t) when z is given)

The packed tokens are cut at sequence starts and at multiples of ``chunk_size`` (SGLang's chunk
grid, on which it reports ``states``); each piece is solved in closed form with batched matrix
products, and the states are handed from piece to piece in one short loop.
"""

from __future__ import annotations

from typing import List

import torch
import torch.nn.functional as F

PAD_SLOT_ID = -1


class _Pieces:
    """Pieces of a packed batch: maximal runs of tokens within one sequence and one chunk of
    the global ``chunk_size`` grid. ``idx [P, L]`` (clamped token index), ``mask [P, L]``,
    ``seq [P]``, ``start`` / ``end`` token bounds."""

    def __init__(self, bounds: List[int], chunk: int):
        cuts = sorted(set(bounds) | set(range(0, bounds[-1], chunk)))
        cuts = [c for c in cuts if bounds[0] <= c <= bounds[-1]]
        if cuts[-1] != bounds[-1]:
            cuts.append(bounds[-1])
        self.start, self.end, self.seq = [], [], []
        s = 0
        for a, b in zip(cuts[:-1], cuts[1:]):
            if a == b:
                continue
            while bounds[s + 1] <= a:
                s += 1
            self.start.append(a)
            self.end.append(b)
            self.seq.append(s)
        L = chunk
        ar = torch.arange(L)
        st = torch.tensor(self.start, dtype=torch.long).reshape(-1, 1)
        ln = torch.tensor([b - a for a, b in zip(self.start, self.end)], dtype=torch.long).reshape(-1, 1)
        self.mask = ar[None, :] < ln
        self.idx = torch.where(self.mask, st + ar[None, :], torch.zeros((), dtype=torch.long))
        self.L = L

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        out = x[self.idx].float()
        return out * self.mask.reshape(*self.mask.shape, *([1] * (out.dim() - 2)))


def _dt_activation(dt, dt_bias, dt_softplus, dt_limit):
    dt = dt.float()
    if dt_bias is not None:
        dt = dt + dt_bias.float()
    if dt_softplus:
        dt = torch.where(dt <= 20.0, F.softplus(dt, threshold=1e9), dt)
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def ssd_scan(x, dt, A, B, C, bounds, chunk_size, D=None, z=None, initial_states=None):
    """The SSD scan of one packed row (float32 math).

    Args:
        x: ``[T, H, P]``; dt: ``[T, H]`` (activated); A: ``[H]``; B, C: ``[T, G, N]``.
        bounds: sequence starts and the end, ``[n0=0, ..., T]``.
        initial_states: ``[S, H, P, N]`` or None (zeros).

    Returns:
        ``(y [T, H, P], piece_in [P, H, P, N], piece_out, pieces)``: outputs, the state
        entering and leaving each piece.
    """
    T, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    pieces = _Pieces(bounds, chunk_size)
    rep = H // G
    xc = pieces.gather(x)  # [np, L, H, P]
    dtc = pieces.gather(dt)  # [np, L, H]
    Bc = pieces.gather(B).repeat_interleave(rep, dim=2)  # [np, L, H, N]
    Cc = pieces.gather(C).repeat_interleave(rep, dim=2)
    dA = (dtc * A.float()).cumsum(1)  # [np, L, H]
    dA = dA.transpose(1, 2)  # [np, H, L]
    xc, Bc, Cc, dtc = (t.transpose(1, 2) for t in (xc, Bc, Cc, dtc))  # [np, H, L, .]
    L = pieces.L
    causal = torch.tril(torch.ones(L, L, dtype=torch.bool))
    decay = (dA[..., :, None] - dA[..., None, :]).masked_fill_(~causal, float("-inf")).exp_()
    scores = (Cc @ Bc.transpose(-1, -2)) * decay * dtc[..., None, :]
    y = scores @ xc  # [np, H, L, P]
    last = dA[..., -1:]  # [np, H, 1] (constant past the end: dt is zero there)
    contrib = (xc * (dtc * (last - dA).exp())[..., None]).transpose(-1, -2) @ Bc  # [np, H, P, N]
    n_pieces = len(pieces.seq)
    s_in = torch.zeros(n_pieces, H, P, N)
    s_out = torch.zeros(n_pieces, H, P, N)
    state = None
    prev_seq = -1
    scale = last.exp()[..., None]  # [np, H, 1, 1]
    for i, s in enumerate(pieces.seq):
        if s != prev_seq:
            state = initial_states[s].float() if initial_states is not None else torch.zeros(H, P, N)
            prev_seq = s
        s_in[i] = state
        state = state * scale[i] + contrib[i]
        s_out[i] = state
    y = y + (Cc * dA.exp()[..., None]) @ s_in.transpose(-1, -2)
    y = y.transpose(1, 2)  # [np, L, H, P]
    out = torch.zeros(T, H, P)
    out[pieces.idx[pieces.mask]] = y[pieces.mask]
    if D is not None:
        Df = D.float()
        out = out + x.float() * (Df[:, None] if Df.dim() == 1 else Df)
    if z is not None:
        out = out * F.silu(z.float())
    return out, s_in, s_out, pieces


def _state_at(x, dt, A, B, end, piece, s_in, rep):
    """State after token ``end - 1`` inside ``piece`` (entering state ``s_in``)."""
    a = piece
    xs, dts, Bs = x[a:end].float(), dt[a:end], B[a:end].float().repeat_interleave(rep, dim=1)
    dA = (dts * A.float()).cumsum(0)  # [l, H]
    w = dts * (dA[-1:] - dA).exp()  # [l, H]
    return s_in * dA[-1].exp()[:, None, None] + torch.einsum("lh,lhp,lhn->hpn", w, xs, Bs)


def mamba_chunk_scan_combined(
    x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
    chunk_indices=None, chunk_offsets=None, cu_seqlens=None, dt_softplus=False,
    dt_limit=(0.0, float("inf")), out=None, return_final_states=False, return_varlen_states=False,
    return_intermediate_states=False, state_dtype=None, return_track_states=False,
    track_seq_idx=None, track_end_locs=None,
):
    """Same signature and returns as SGLang's ``mamba_chunk_scan_combined``.

    Args:
        x: ``[b, T, H, P]``; dt: ``[b, T, H]`` (raw); A: ``[H]``; B, C: ``[b, T, G, N]``;
        D: ``[H]`` or ``[H, P]``; z: like x or None; dt_bias: ``[H]``.
        initial_states: ``[S, H, P, N]`` (one per sequence with ``cu_seqlens``) or ``[b, ...]``.
        seq_idx: ``[b, T]`` sequence of each token (used when ``cu_seqlens`` is not given).
        chunk_indices / chunk_offsets: SGLang's pseudo-chunk metadata (not needed here).
        cu_seqlens: ``[S + 1]``, with ``return_varlen_states`` (``b == 1``).
        out: ``[b, T, H, P]`` written in place (else returned).
        state_dtype: dtype of the returned states (default C's dtype).
        track_seq_idx / track_end_locs: with ``return_track_states``, the state of sequence
            ``track_seq_idx[i]`` after packed token ``track_end_locs[i] - 1``.

    Returns (as SGLang): ``states [b, nchunks, H, P, N]`` is the state entering each global
    chunk of ``chunk_size`` tokens (of the sequence holding the chunk's previous token; chunk 0:
    ``initial_states[0]`` or zeros), ``final_states [b, H, P, N]`` the state after the last
    token, ``varlen_states [S, H, P, N]`` each sequence's final state, ``track_states
    [1, n, H, P, N]``. With ``return_track_states``: ``(states, varlen_states, track_states)``.
    """
    if not return_varlen_states:
        cu_seqlens = None
    b, T, H, P = x.shape
    N = B.shape[-1]
    rep = H // B.shape[-2]
    sdtype = state_dtype if state_dtype is not None else C.dtype
    dta = _dt_activation(dt, dt_bias, dt_softplus, dt_limit)
    nchunks = -(-T // chunk_size)
    states = torch.empty(b, nchunks, H, P, N, dtype=sdtype)
    finals = torch.empty(b, H, P, N, dtype=sdtype)
    y_all = torch.empty(b, T, H, P)
    varlen = track = None
    for r in range(b):
        if cu_seqlens is not None:
            bounds = [int(v) for v in cu_seqlens.tolist()]
        elif seq_idx is not None:
            si = seq_idx[r].tolist()
            bounds = [0] + [t for t in range(1, T) if si[t] != si[t - 1]] + [T]
        else:
            bounds = [0, T]
        init = initial_states
        if initial_states is not None and cu_seqlens is None:
            init = initial_states[r:r + 1]
            if len(bounds) > 2:  # several sequences in one row without cu_seqlens: first one only
                init = torch.cat([init, torch.zeros(len(bounds) - 2, H, P, N, dtype=init.dtype)])
        y, s_in, s_out, pieces = ssd_scan(x[r], dta[r], A, B[r], C[r], bounds, chunk_size, D,
                                          None if z is None else z[r], init)
        y_all[r] = y
        states[r, 0] = (init[0].float() if init is not None else torch.zeros(H, P, N)).to(sdtype)
        ends = {e: i for i, e in enumerate(pieces.end)}
        for c in range(1, nchunks):
            states[r, c] = s_out[ends[c * chunk_size]].to(sdtype)
        finals[r] = s_out[-1].to(sdtype) if len(pieces.seq) else states[r, 0]
        if cu_seqlens is not None:
            n_seq = len(bounds) - 1
            varlen = torch.empty(n_seq, H, P, N, dtype=sdtype)
            for s in range(n_seq):
                mine = [i for i, q in enumerate(pieces.seq) if q == s]
                if mine:
                    varlen[s] = s_out[mine[-1]].to(sdtype)
                else:
                    varlen[s] = (init[s].float() if init is not None else torch.zeros(H, P, N)).to(sdtype)
            if track_seq_idx is not None and track_end_locs is not None and track_end_locs.numel() > 0:
                rows = []
                for s, e in zip(track_seq_idx.tolist(), track_end_locs.tolist()):
                    start = bounds[s]
                    st0 = init[s].float() if init is not None else torch.zeros(H, P, N)
                    if e <= start:
                        rows.append(st0)
                        continue
                    i = next(i for i, (a, bb) in enumerate(zip(pieces.start, pieces.end)) if a < e <= bb)
                    rows.append(_state_at(x[r], dta[r], A, B[r], e, pieces.start[i], s_in[i], rep))
                track = torch.stack(rows).to(sdtype).unsqueeze(0)
    y_all = y_all.to(x.dtype)
    if out is not None:
        out.copy_(y_all)
    else:
        out = y_all
    if return_track_states:
        return states, varlen, track
    if return_intermediate_states:
        if return_varlen_states:
            return (states, finals, varlen) if return_final_states else (states, varlen)
        return (states, finals) if return_final_states else states
    if not return_varlen_states:
        return finals if return_final_states else None
    return (finals, varlen) if return_final_states else varlen


def causal_conv1d_fn(
    x, weight, bias, conv_states, query_start_loc, seq_lens_cpu=None, cache_indices=None,
    has_initial_state=None, activation="silu", pad_slot_id=PAD_SLOT_ID, validate_data=False,
    block_table=None, **kwargs,
):
    """Replaces ``causal_conv1d_triton.py::causal_conv1d_fn`` (varlen prefill).

    Args:
        x: ``[dim, T]`` packed sequences (any strides); weight: ``[dim, W]``; bias: ``[dim]``.
        conv_states: ``[slots, dim, >= W-1]``; its first ``W-1`` columns hold a sequence's last
            ``W-1`` inputs (oldest first), read when ``has_initial_state[i]`` and overwritten
            with the window after the sequence.
        query_start_loc: ``[S + 1]``; cache_indices: ``[S]`` slot per sequence
            (``pad_slot_id``: skipped).
        activation: ``"silu"`` / ``"swish"`` / True, or None.

    Returns:
        ``out`` like ``x`` (``torch.empty_like``): the convolution (+ bias, activation).
    """
    if isinstance(activation, bool) and activation:
        activation = "silu"
    out = torch.empty_like(x)
    dim, _ = x.shape
    W = weight.shape[1]
    sl = W - 1
    bounds = [int(v) for v in query_start_loc.tolist()]
    wf = weight.float()
    for s in range(len(bounds) - 1):
        a, e = bounds[s], bounds[s + 1]
        slot = int(cache_indices[s]) if cache_indices is not None else s
        if (pad_slot_id is not None and slot == pad_slot_id) or e <= a:
            continue
        xs = x[:, a:e]
        if conv_states is not None and has_initial_state is not None and bool(has_initial_state[s]):
            prev = conv_states[slot, :, :sl].to(x.dtype)
        else:
            prev = x.new_zeros(dim, sl)
        xx = torch.cat([prev, xs], dim=1).float()  # [dim, sl + L]
        y = F.conv1d(xx.unsqueeze(0), wf.unsqueeze(1), None if bias is None else bias.float(), groups=dim)[0]
        if activation in ("silu", "swish"):
            y = F.silu(y)
        out[:, a:e] = y.to(out.dtype)
        if conv_states is not None:
            conv_states[slot, :, :sl] = torch.cat([prev, xs], dim=1)[:, -sl:].to(conv_states.dtype)
    return out


def causal_conv1d_update(
    x, conv_state, weight, bias=None, activation=None, cache_seqlens=None, conv_state_indices=None,
    num_accept_tokens=None, intermediate_conv_window=None, intermediate_state_indices=None,
    retrieve_next_token=None, retrieve_next_sibling=None, retrieve_parent_token=None,
    pad_slot_id=PAD_SLOT_ID, metadata=None, validate_data=False,
):
    """Replaces ``causal_conv1d_triton.py::causal_conv1d_update`` for plain decode (no circular
    buffer, speculative windows or trees: those stay on SGLang's kernel, see
    :func:`update_supported`).

    Args:
        x: ``[batch, dim]`` or ``[batch, dim, L]``; conv_state ``[slots, dim, >= W-1]`` (first
        ``W-1`` columns, oldest first) updated in place; conv_state_indices ``[batch]``
        (``pad_slot_id``: skipped).

    Returns:
        ``out`` shaped like ``x``.
    """
    if isinstance(activation, bool):
        activation = "silu" if activation else None
    squeeze = x.dim() == 2
    if squeeze:
        x = x.unsqueeze(-1)
    batch, dim, L = x.shape
    W = weight.shape[1]
    sl = W - 1
    out = torch.zeros_like(x)
    slots = conv_state_indices.to(torch.long) if conv_state_indices is not None else torch.arange(batch)
    live = slots != pad_slot_id if pad_slot_id is not None else torch.ones(batch, dtype=torch.bool)
    if live.any():
        rows = live.nonzero().reshape(-1)
        sidx = slots[rows]
        prev = conv_state[sidx, :, :sl].to(x.dtype)  # [n, dim, sl]
        xx = torch.cat([prev, x[rows]], dim=-1)  # [n, dim, sl + L]
        y = F.conv1d(xx.float(), weight.float().unsqueeze(1), None if bias is None else bias.float(), groups=dim)
        if activation in ("silu", "swish"):
            y = F.silu(y)
        out[rows] = y.to(out.dtype)
        conv_state[sidx, :, :sl] = xx[..., -sl:].to(conv_state.dtype)
    return out.squeeze(-1) if squeeze else out


def update_supported(*args, **kwargs) -> bool:
    """Whether :func:`causal_conv1d_update` covers this call (plain decode)."""
    names = ("cache_seqlens", "num_accept_tokens", "intermediate_conv_window", "retrieve_next_token",
             "retrieve_next_sibling", "retrieve_parent_token", "metadata")
    return len(args) <= 5 and all(kwargs.get(n) is None for n in names)


def selective_state_update(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False,
                           state_batch_indices=None, pad_slot_id=PAD_SLOT_ID, out=None, **kwargs):
    """Replaces ``mamba/triton_ops/mamba_ssm.py::selective_state_update`` for one decode token
    per row (``MambaMixer2.forward``'s decode; speculative / stochastic-rounding calls stay on
    SGLang's kernel, see :func:`ssu_supported`).

    Args:
        state: pool ``[slots, H, P, N]`` updated in place; x, dt: ``[B, H, P]``; A: ``[H, P, N]``;
        B, C: ``[B, G, N]``; D, dt_bias: ``[H, P]``; z: like x or None;
        state_batch_indices: ``[B]`` pool rows (``pad_slot_id``: zero state, no write);
        out: ``[B, H, P]`` written in place.
    """
    Bn, H, P = x.shape
    rep = H // B.shape[-2]
    dtf = dt.float()
    if dt_bias is not None:
        dtf = dtf + dt_bias.float()
    if dt_softplus:
        dtf = torch.where(dtf <= 20.0, torch.log1p(torch.exp(dtf)), dtf)
    rows = state_batch_indices.to(torch.long).reshape(-1) if state_batch_indices is not None else torch.arange(Bn)
    live = rows != pad_slot_id if pad_slot_id is not None else torch.ones(Bn, dtype=torch.bool)
    s = torch.zeros(Bn, H, P, state.shape[-1])
    if live.any():
        s[live] = state[rows[live]].float()
    Bh = B.float().repeat_interleave(rep, dim=1)[:, :, None, :]  # [B, H, 1, N]
    Ch = C.float().repeat_interleave(rep, dim=1)[:, :, None, :]
    xf = x.float()
    s = s * torch.exp(A.float() * dtf[..., None]) + Bh * dtf[..., None] * xf[..., None]
    y = (s * Ch).sum(-1)
    if D is not None:
        y = y + xf * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    if live.any():
        state[rows[live]] = s[live].to(state.dtype)
    if out is None:
        return y.to(x.dtype)
    out.copy_(y.reshape(out.shape))
    return None


def ssu_supported(state, x, *args, **kwargs) -> bool:
    """Whether :func:`selective_state_update` covers this call: one token per row, a 4-D
    pool, no speculative buffers, no stochastic rounding."""
    plain = ("intermediate_states_buffer", "retrieve_parent_token", "intermediate_state_indices", "cache_steps")
    return (state.dim() == 4 and x.dim() == 3 and not kwargs.get("disable_state_update")
            and not kwargs.get("enable_stochastic_rounding") and all(kwargs.get(n) is None for n in plain)
            and len(args) <= 7)
