"""Plain-torch CPU version of SGLang 0.5.23's lightning (linear) attention kernel ``seg_la_fwd``
(``sglang/kernels/ops/attention/linear/seg_la.py``; issue 40): the prefill (``seg_la_p_kernel``,
with its chunk-grid track store) and the decode (``seg_la_d_kernel``) that
``LightningAttentionBackend`` (``srt/layers/attention/linear/lightning_backend.py``) calls for
Ling 2.5 (``BailingMoeV2_5ForCausalLM``) with its default ``linear_backend`` ``seg_la``. Bridged by
:mod:`.cpu_bridges` for CPU tensors only; the speculative paths (a ``mask`` or ``caches``) stay on
SGLang's kernel (:func:`seg_la_supported`).

The recurrence, per head with its slope ``s`` (``decay_scales``), state ``S [K, V]`` (the pool row
``s[slot, h]``, float32 inside):

    S_t = exp(-s) S_{t-1} + k_t^T v_t,        o_t = scale * q_t S_t

computed here in 32-token blocks as the Triton prefill does (intra-block ``(q k^T * D) v`` with
``D[i, j] = exp(-s (i - j))`` for ``j <= i``, inter-block ``q S * exp(-s (i + 1))``).
"""

from __future__ import annotations

import torch

#: The Triton prefill kernel's block (``seg_la_fwd``: ``BLOCK = 32``); the track store writes a
#: state only where a block ends.
BLOCK = 32


def seg_la_supported(q, k, v, s, decay_scales, meta, caches=None, cache_indices=None, *args, **kwargs) -> bool:
    """Whether :func:`seg_la_fwd` covers the call: prefill and decode, not the speculative
    kernels (``caches``: MTP chain verify; ``meta.mask``: tree verify)."""
    return caches is None and getattr(meta, "mask", None) is None


def _prefill_row(q, k, v, state, slope, scale, track_len=0):
    """One row: ``q, k, v [T, H, D]`` float32, ``state [H, D, D]`` float32, ``slope [H]``.
    Returns ``(o [T, H, D], final state, state after track_len tokens or None)``."""
    T, H, D = q.shape
    out = torch.empty(T, H, D)
    tracked = None
    ar = torch.arange(BLOCK, dtype=torch.float32)
    for n in range(0, T, BLOCK):
        b = min(BLOCK, T - n)
        qb = q[n:n + b].transpose(0, 1)  # [H, b, D]
        kb = k[n:n + b].transpose(0, 1)
        vb = v[n:n + b].transpose(0, 1)
        i = ar[:b]
        diff = i[:, None] - i[None, :]  # i - j
        dm = torch.where(diff >= 0, torch.exp(-slope[:, None, None] * diff.clamp(min=0)), torch.zeros(()))
        o = ((qb @ kb.transpose(1, 2)) * dm) @ vb  # [H, b, D]
        o = o + (qb @ state) * torch.exp(-slope[:, None, None] * (i + 1)[None, :, None])
        out[n:n + b] = (o * scale).transpose(0, 1)
        wk = kb * torch.exp(-slope[:, None, None] * (b - 1 - i)[None, :, None])
        state = state * torch.exp(-slope * b)[:, None, None] + wk.transpose(1, 2) @ vb
        if track_len > 0 and n + b == track_len:
            tracked = state.clone()
    return out, state, tracked


def seg_la_fwd(q, k, v, s, decay_scales, meta, caches=None, cache_indices=None, track_lens=None,
               track_state_indices=None, softmax_scale=None):
    """Same signature, output and in-place state writes as SGLang's ``seg_la_fwd`` for its prefill
    and decode paths: ``q, k, v [T, H, D]``, the pool ``s [slots, H, D, D]`` (rows ``meta.s_offsets``,
    ``-1``: skipped, zero output), ``meta.q_offsets / q_lengths / s_scales`` (``s_scales`` 0: the
    row starts from zeros); with ``track_lens`` / ``track_state_indices`` the state after
    ``track_lens[b]`` tokens (at a 32-token block end) is also stored in row
    ``track_state_indices[b]``. Returns ``o [T, H, D]`` in ``q``'s dtype."""
    length, H, D = q.shape
    bs = int(meta.batch_size)
    if softmax_scale is None:
        softmax_scale = D ** (-0.5)
    slope = decay_scales.reshape(-1).float()
    qf, kf, vf = q.float(), k.float(), v.float()
    s_off = meta.s_offsets.reshape(-1).tolist()
    out = torch.zeros(length, H, D)
    max_len = -(-length // bs)
    if max_len > 1:
        q_off = meta.q_offsets.reshape(-1).tolist()
        q_len = meta.q_lengths.reshape(-1).tolist()
        scales = meta.s_scales.reshape(-1).tolist()
        track = track_lens is not None and track_state_indices is not None
        t_len = track_lens.reshape(-1).tolist() if track else None
        t_dst = track_state_indices.reshape(-1).tolist() if track else None
        for b in range(bs):
            slot = int(s_off[b])
            if slot == -1:
                continue
            a, n = int(q_off[b]), int(q_len[b])
            state = s[slot].float() if scales[b] > 0 else torch.zeros(H, D, D)
            tl_b = int(t_len[b]) if track and int(t_dst[b]) >= 0 else 0
            o, state, tracked = _prefill_row(qf[a:a + n], kf[a:a + n], vf[a:a + n], state, slope,
                                             softmax_scale, tl_b)
            out[a:a + n] = o
            if tracked is not None:
                s[int(t_dst[b])] = tracked.to(s.dtype)
            s[slot] = state.to(s.dtype)
    else:
        idx = torch.tensor(s_off[:bs], dtype=torch.long)
        live = (idx >= 0).nonzero().reshape(-1)
        if live.numel():
            rows = idx[live]
            S = s[rows].float() * torch.exp(-slope)[None, :, None, None]
            S = S + kf[live][..., :, None] * vf[live][..., None, :]  # [n, H, D(k), D(v)]
            out[live] = ((qf[live] * softmax_scale)[..., None, :] @ S).squeeze(-2)
            s[rows] = S.to(s.dtype)
    return out.to(q.dtype)
