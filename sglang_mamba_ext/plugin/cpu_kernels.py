"""Plain-torch CPU versions of SGLang 0.5.23's chunked delta-rule prefill kernels (issue 40,
item 5): Gated DeltaNet (``chunk_gated_delta_rule``) and Kimi Delta Attention (``chunk_kda``).

On a host without CUDA the plugin serves SGLang's hybrid classes with their Triton kernels run
by Triton's interpreter (:mod:`.triton_interpret`), where a 64-token chunk of a tiny model takes
seconds. The functions here compute the same thing with batched torch ops; :mod:`.cpu_bridges`
routes SGLang's calls to them for CPU tensors only (``SGLANG_MAMBA_EXT_CPU_KERNELS=triton``
keeps the interpreted kernels). The Mamba2 scan and the causal convolutions are in
:mod:`.cpu_kernels_ssd`.

The math (per value head, state ``S`` of shape ``[V, K]``, read as ``S @ k``)::

    S_t = S_{t-1} * decay_t + beta_t * (v_t - (S_{t-1} * decay_t) @ k_t) k_t^T
    o_t = scale * S_t @ q_t

with ``decay_t = exp(g_t)`` a scalar per head (GDN) or ``exp(g_t[k])`` per key channel, scaling
the columns of ``S`` (KDA). Within a chunk of ``C = 64`` tokens the recurrence is solved in
closed form (the chunk's unit lower-triangular system for the "new values", then one matrix
product per chunk for the outputs and the next state); only the chunk-to-chunk state hand-over
is sequential, batched over the sequences of the batch. Everything is computed in float32.
"""

from __future__ import annotations

import math
from typing import List, Optional

import torch
import torch.nn.functional as F

#: Chunk length of SGLang's fla kernels (``fla/chunk.py``, ``fla/kda.py``): the grid of ``h``.
CHUNK = 64
#: Elements of the ``[chunks, H, C, C, K]`` pairwise-decay tensor KDA builds at once.
_KDA_BLOCK_ELEMS = 1 << 24


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in float32, back in ``x``'s dtype (as
    ``fla/l2norm.py::l2norm_fwd``)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


class ChunkLayout:
    """The chunk grid of a packed batch: sequence ``n`` (tokens ``cu[n]:cu[n+1]``) is cut into
    ``ceil(len / C)`` chunks, numbered globally in sequence order (SGLang's
    ``fla/index.py::prepare_chunk_indices``).

    Attributes: ``seq`` / ``pos`` ``[NT]`` (sequence and chunk number within it), ``idx``
    ``[NT, C]`` token index of each chunk row (clamped), ``mask`` ``[NT, C]`` (row holds a token),
    ``first`` ``[N]`` global id of each sequence's first chunk, ``count`` ``[N]`` chunks per
    sequence."""

    def __init__(self, cu_seqlens: List[int], chunk: int = CHUNK):
        self.cu = cu_seqlens
        self.n_seq = len(cu_seqlens) - 1
        seq, pos, starts, lens, first, count = [], [], [], [], [], []
        for n in range(self.n_seq):
            bos, eos = cu_seqlens[n], cu_seqlens[n + 1]
            nc = -(-(eos - bos) // chunk)
            first.append(len(seq))
            count.append(nc)
            for c in range(nc):
                seq.append(n)
                pos.append(c)
                starts.append(bos + c * chunk)
                lens.append(min(chunk, eos - bos - c * chunk))
        self.nt = len(seq)
        self.seq, self.pos, self.first, self.count = seq, pos, first, count
        ar = torch.arange(chunk)
        st = torch.tensor(starts, dtype=torch.long).reshape(-1, 1)
        ln = torch.tensor(lens, dtype=torch.long).reshape(-1, 1)
        self.mask = ar[None, :] < ln
        total = max(cu_seqlens[-1], 1)
        self.idx = torch.where(self.mask, st + ar[None, :], torch.zeros((), dtype=torch.long)).clamp_(max=total - 1)
        self.lens = ln.reshape(-1)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, ...]`` -> ``[NT, C, ...]`` float32, zero at empty rows."""
        out = x[self.idx].float()
        return out * self.mask.reshape(*self.mask.shape, *([1] * (out.dim() - 2)))

    def scatter(self, y: torch.Tensor, total: int) -> torch.Tensor:
        """``y [NT, C, ...]`` -> ``[T, ...]`` (rows that hold a token)."""
        out = y.new_zeros((total, *y.shape[2:]))
        out[self.idx[self.mask]] = y[self.mask]
        return out


_MASKS = {}


def _masks(C: int):
    """``(causal, strict, eye)`` for a ``C x C`` chunk (cached; causal includes the diagonal)."""
    if C not in _MASKS:
        ones = torch.ones(C, C, dtype=torch.bool)
        _MASKS[C] = (torch.tril(ones), torch.tril(ones, -1), torch.eye(C))
    return _MASKS[C]


def _seq_bounds(cu_seqlens: Optional[torch.Tensor], batch: int, length: int) -> List[int]:
    if cu_seqlens is None:
        return [b * length for b in range(batch + 1)]
    return [int(v) for v in cu_seqlens.tolist()]


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped heads (``[..., Hg, D]``) -> ``[..., H, D]``: head ``h`` reads group ``h // (H / Hg)``."""
    hg = x.shape[-2]
    return x if hg == heads else x.repeat_interleave(heads // hg, dim=-2)


def delta_rule_chunked(q, k, v, g_cum, beta, scale, h0, layout: ChunkLayout):
    """The chunked gated delta rule on gathered chunks (all float32).

    Args:
        q, k: ``[NT, C, H, K]`` (already normalised, heads expanded); v: ``[NT, C, H, V]``.
        g_cum: chunk-local cumulative log decay, ``[NT, C, H]`` (scalar per head, GDN) or
            ``[NT, C, H, K]`` (per key channel, KDA), natural log; constant past a chunk's end.
        beta: ``[NT, C, H]``, zero on empty rows.
        scale: output scale.
        h0: ``[N, H, V, K]`` state entering each sequence.
        layout: the chunk grid.

    Returns:
        ``(o [NT, C, H, V], h [NT, H, V, K], final [N, H, V, K])``: outputs, the state entering
        each chunk, and each sequence's state after its last token.
    """
    nt, C, H, K = k.shape
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [NT, H, C, D]
    beta = beta.transpose(1, 2)  # [NT, H, C]
    causal, strict, eye = _masks(C)
    if g_cum.dim() == 3:  # GDN: one decay per head and token
        G = g_cum.transpose(1, 2)  # [NT, H, C]
        decay = (G[..., :, None] - G[..., None, :]).masked_fill_(~causal, -math.inf).exp_()  # [NT, H, C, C]
        kk = k @ k.transpose(-1, -2) * decay
        qk = q @ k.transpose(-1, -2) * decay
        kw = k * G.exp()[..., None]  # k_t * exp(G_t)
        G_last = G[..., -1]  # [NT, H]
        k_end = k * (G_last[..., None] - G).exp()[..., None]
        q_in = q * G.exp()[..., None]
        s_decay = G_last.exp()[..., None, None]  # [NT, H, 1, 1]
    else:  # KDA: per-channel decay
        G = g_cum.transpose(1, 2)  # [NT, H, C, K]
        kk = torch.empty(nt, H, C, C)
        qk = torch.empty(nt, H, C, C)
        step = max(1, _KDA_BLOCK_ELEMS // max(1, H * C * C * K))
        for a in range(0, nt, step):
            Gs, ks, qs = G[a:a + step], k[a:a + step], q[a:a + step]
            diff = Gs[:, :, :, None, :] - Gs[:, :, None, :, :]  # [n, H, C(t), C(j), K]
            dec = diff.masked_fill_(~causal[:, :, None], -math.inf).exp_()
            kk[a:a + step] = torch.einsum("nhtk,nhjk,nhtjk->nhtj", ks, ks, dec)
            qk[a:a + step] = torch.einsum("nhtk,nhjk,nhtjk->nhtj", qs, ks, dec)
        kw = k * G.exp()
        G_last = G[:, :, -1]  # [NT, H, K]
        k_end = k * (G_last[:, :, None, :] - G).exp()
        q_in = q * G.exp()
        s_decay = G_last.exp()[:, :, None, :]  # scales the K columns of S [V, K]
    # (I + L) u' = beta * (v - decayed S0 k), L_tj = beta_t * (k_t . k_j) * decay_tj for j < t
    system = eye + beta[..., None] * kk * strict
    rhs = torch.cat([beta[..., None] * v, beta[..., None] * kw], dim=-1)
    sol = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = sol[..., : v.shape[-1]], sol[..., v.shape[-1]:]  # [NT, H, C, V], [NT, H, C, K]

    n_seq = len(layout.count)
    h = torch.empty(nt, H, v.shape[-1], K)
    v_new = torch.empty_like(u)
    final = h0.clone()
    state = h0.clone()
    max_chunks = max(layout.count, default=0)
    firsts = torch.tensor(layout.first, dtype=torch.long)
    counts = torch.tensor(layout.count, dtype=torch.long)
    for p in range(max_chunks):
        live = (counts > p).nonzero().reshape(-1)
        cid = firsts[live] + p
        S = state[live]  # [n, H, V, K]
        h[cid] = S
        vn = u[cid] - w[cid] @ S.transpose(-1, -2)  # [n, H, C, V]
        v_new[cid] = vn
        S = S * s_decay[cid] + vn.transpose(-1, -2) @ k_end[cid]
        state[live] = S
        done = live[counts[live] == p + 1]
        if done.numel():
            final[done] = state[done]
    o = scale * (q_in @ h.transpose(-1, -2) + (qk * causal) @ v_new)  # [NT, H, C, V]
    assert n_seq == final.shape[0]
    return o.transpose(1, 2), h, final


def _load_states(pool, indices, n_seq, H, V, K):
    """State entering each sequence (float32 ``[N, H, V, K]``) from the pool rows ``indices``
    (``-1``: none, zeros) and the valid-row mask."""
    h0 = torch.zeros(n_seq, H, V, K)
    if pool is None:
        return h0, torch.zeros(n_seq, dtype=torch.bool), None
    if indices is None:
        indices = torch.arange(n_seq)
    indices = indices.to(torch.long).reshape(-1)
    valid = indices >= 0
    if valid.any():
        h0[valid] = pool[indices[valid]].float()
    return h0, valid, indices


def _store_states(pool, indices, valid, final):
    if pool is not None and valid.any():
        pool[indices[valid]] = final[valid].to(pool.dtype)


def _chunk_local_cumsum(g: torch.Tensor, layout: ChunkLayout) -> torch.Tensor:
    """``g [T, H(, K)]`` -> chunk-local cumulative sums gathered ``[NT, C, H(, K)]``."""
    return layout.gather(g).cumsum(1)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    initial_state_indices: Optional[torch.Tensor] = None,
    cu_seqlens: Optional[torch.Tensor] = None,
    head_first: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    inplace_update: bool = True,
):
    """Replaces ``sglang/kernels/ops/attention/fla/chunk.py::chunk_gated_delta_rule`` on CPU
    (called by ``srt/layers/attention/linear/kernels/gdn_triton.py::TritonGDNKernel.extend``).

    Args:
        q, k: ``[1, T, Hg, K]`` (or ``[B, T, Hg, K]`` without ``cu_seqlens``), half precision;
            ``Hg`` may divide ``H`` (grouped heads).
        v: ``[B, T, H, V]``.
        g: ``[B, T, H]`` log decay (per token, not cumulated). beta: ``[B, T, H]``.
        scale: defaults to ``K ** -0.5``.
        initial_state: state pool ``[slots, H, V, K]`` (any float dtype, row stride free).
        initial_state_indices: ``[N]`` pool row of each sequence; ``-1`` = start from zero and
            write nothing back.
        cu_seqlens: ``[N + 1]`` packed sequence bounds.
        use_qk_l2norm_in_kernel: l2-normalise q and k first.
        inplace_update: write each sequence's final state to its pool row.

    Returns:
        ``(o, None, h)``: ``o [B, T, H, V]`` in q's dtype; ``h [B, NT, H, V, K]`` in k's dtype,
        the state at the START of each 64-token chunk, chunks numbered globally over the packed
        sequences (``prepare_chunk_indices`` order).
    """
    if head_first:
        raise DeprecationWarning("head_first is not supported")
    B, T, Hg, K = k.shape
    H, V = v.shape[-2], v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    bounds = _seq_bounds(cu_seqlens, B, T)
    layout = ChunkLayout(bounds)
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    qc = layout.gather(_expand_heads(flat(q), H))
    kc = layout.gather(_expand_heads(flat(k), H))
    vc = layout.gather(flat(v))
    gc = _chunk_local_cumsum(flat(g), layout)
    bc = layout.gather(flat(beta))
    h0, valid, idx = _load_states(initial_state, initial_state_indices, layout.n_seq, H, V, K)
    o, h, final = delta_rule_chunked(qc, kc, vc, gc, bc, scale, h0, layout)
    if inplace_update:
        _store_states(initial_state, idx, valid, final)
    o = layout.scatter(o, B * T).reshape(B, T, H, V).to(q.dtype)
    h_out = h.to(k.dtype).reshape(B, layout.nt // B if cu_seqlens is None else layout.nt, H, V, K)
    return o, None, h_out


def _kda_gate(g, A_log, dt_bias, lower_bound, H, K):
    """KDA's gate activation (``fla/kda.py::kda_gate_chunk_cumsum_vector_kernel``), float32."""
    gf = g.float().reshape(-1, H, K)
    if dt_bias is not None:
        gf = gf + dt_bias.float().reshape(H, K)
    a = A_log.float().reshape(H, 1).exp()
    if lower_bound is None:
        return -a * torch.where(gf < 20.0, F.softplus(gf, threshold=1e9), gf)
    return lower_bound * torch.sigmoid(a * gf)


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: Optional[float] = None,
    initial_state: Optional[torch.Tensor] = None,
    initial_state_indices: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None,
    A_log: Optional[torch.Tensor] = None,
    dt_bias: Optional[torch.Tensor] = None,
    lower_bound: Optional[float] = None,
    output_intermediate_states: bool = False,
    track_state: Optional[torch.Tensor] = None,
    track_chunk_idx: Optional[torch.Tensor] = None,
    beta_is_raw: bool = False,
    chunk_indices: Optional[torch.Tensor] = None,
    chunk_offsets: Optional[torch.Tensor] = None,
    **kwargs,
):
    """Replaces ``sglang/kernels/ops/attention/fla/kda.py::chunk_kda`` on CPU (called by
    ``srt/layers/attention/linear/kernels/kda_triton.py::TritonKDAKernel.extend``).

    Args:
        q, k: ``[1, T, H, K]``; v: ``[1, T, H, V]`` (half precision).
        g: raw gate ``[1, T, H, K]`` (or ``[1, T, H*K]``); activated here as
            ``-exp(A_log) * softplus(g + dt_bias)`` (``lower_bound * sigmoid(exp(A_log) * (g +
            dt_bias))`` with ``lower_bound``) when ``A_log [H]`` is given, else taken as the
            activated log decay. ``dt_bias``: ``[H*K]``.
        beta: ``[1, T, H]``, sigmoid-ed here when ``beta_is_raw``.
        initial_state / initial_state_indices: pool ``[slots, H, V, K]`` and ``[N]`` rows
            (``-1`` = none); the final states are always written back (as SGLang's kernel does).
        track_state / track_chunk_idx: ``[N, H, V, K]`` float32 and ``[N]``: sequence ``n``'s state
            entering its chunk ``track_chunk_idx[n]`` is copied to ``track_state[n]``.
        chunk_indices / chunk_offsets: SGLang's precomputed grid; recomputed here.

    Returns:
        ``o [1, T, H, V]`` (written into ``v``'s buffer when ``v`` is contiguous, as SGLang's
        kernel does), or ``(o, h)`` with ``output_intermediate_states``: ``h [1, NT, H, V, K]``
        in k's dtype, the state at the start of each global 64-token chunk.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    if scale is None:
        scale = K ** -0.5
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    bounds = _seq_bounds(cu_seqlens, B, T)
    layout = ChunkLayout(bounds)
    flat = lambda x: x.reshape(B * T, *x.shape[2:])  # noqa: E731
    if A_log is not None:
        gate = _kda_gate(g, A_log, dt_bias, lower_bound, H, K)
    else:
        gate = g.float().reshape(B * T, H, K)
    if beta_is_raw:
        beta = beta.float().sigmoid()
    gc = _chunk_local_cumsum(gate, layout)
    h0, valid, idx = _load_states(initial_state, initial_state_indices, layout.n_seq, H, V, K)
    o, h, final = delta_rule_chunked(layout.gather(flat(q)), layout.gather(flat(k)), layout.gather(flat(v)),
                                     gc, layout.gather(flat(beta)), scale, h0, layout)
    _store_states(initial_state, idx, valid, final)
    if track_state is not None and track_chunk_idx is not None:
        for n, c in enumerate(track_chunk_idx.tolist()):
            if 0 <= c < layout.count[n]:
                track_state[n] = h[layout.first[n] + c].to(track_state.dtype)
    o = layout.scatter(o, B * T).reshape(B, T, H, V)
    out = v if v.is_contiguous() else torch.empty_like(v)
    out.copy_(o)
    if output_intermediate_states:
        return out, h.to(k.dtype).reshape(1 if cu_seqlens is not None else B, -1, H, V, K)
    return out

