"""Plain-torch CPU versions of the kernels SGLang 0.5.23's speculative decoding runs besides the
prefill and decode ones of :mod:`.cpu_kernels` / :mod:`.cpu_kernels_decode` (the suite's time
budget, issue 40 item 6): on a host without CUDA they ran under Triton's interpreter, and a
profile of a tiny Qwen3-Next + MTP server (topk 2) spent 94 % of its scheduler time there:

- ``kernels/ops/attention/linear/fused_sigmoid_gating_recurrent.py::
  fused_sigmoid_gating_delta_rule_update``: the GDN / KDA target verify (``TritonGDNKernel.
  target_verify``, ``srt/layers/attention/linear/kernels/gdn_triton.py``), the draft tokens run
  one by one through the delta rule, each step's state kept in SGLang's intermediate buffer and,
  for a tree, each token started from its parent's state (47 % of the profile);
- ``kernels/ops/attention/decode_attention.py::decode_attention_fwd``: EAGLE's draft decode on
  SGLang's Triton attention backend (the CPU defaults pick it, ``plugin/cpu_defaults.py``), 37 %.

Bridged by :mod:`.cpu_bridges` (``KERNEL_BRIDGES``) for CPU tensors only, with the calls these
functions do not cover (:func:`verify_supported`, :func:`decode_attention_supported`) left on
SGLang's kernel. Everything is computed in float32; checked against SGLang's kernels under the
interpreter in ``tests/test_cpu_kernels_verify.py``.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_mamba_ext.plugin.cpu_kernels import _expand_heads


def _softplus(x: torch.Tensor, beta: float, threshold: float) -> torch.Tensor:
    bx = beta * x
    return torch.where(bx <= threshold, torch.log(1.0 + torch.exp(bx)) / beta, x)


def verify_supported(*args, **kwargs) -> bool:
    """Whether :func:`fused_sigmoid_gating_delta_rule_update` covers this call: keyword
    arguments only (as SGLang's callers pass them), no ReplaySSM ring, not the CuTe-DSL
    parity mode, a 5-D intermediate buffer (``[slots, steps, HV, V, K]``) if any."""
    buf = kwargs.get("intermediate_states_buffer")
    return (not args and not kwargs.get("cache_ring") and not kwargs.get("match_cutedsl_decode")
            and kwargs.get("initial_state_source") is not None and (buf is None or buf.dim() == 5))


def fused_sigmoid_gating_delta_rule_update(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, softplus_beta: float,
    softplus_threshold: float, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
    initial_state_source: torch.Tensor, initial_state_indices: torch.Tensor,
    scale: Optional[float] = None, use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Optional[torch.Tensor] = None, is_kda: bool = False, lower_bound: Optional[float] = None,
    disable_state_update: bool = False, intermediate_states_buffer: Optional[torch.Tensor] = None,
    intermediate_state_indices: Optional[torch.Tensor] = None, cache_steps: Optional[int] = None,
    retrieve_parent_token: Optional[torch.Tensor] = None, **_unused,
) -> torch.Tensor:
    """Replaces ``fused_sigmoid_gating_delta_rule_update`` (GDN / KDA decode and target verify).

    Args:
        q, k: ``[B, T, H, K]``; v: ``[B, T, HV, V]``; with ``cu_seqlens`` (``[N + 1]``, token
            offsets) ``B == 1`` and the sequences are packed along ``T``.
        a: the gate input per token, ``[.., HV]`` (GDN) or ``[.., HV * K]`` / ``[.., HV, K]``
            (KDA, ``is_kda``); dt_bias likewise per head / per key channel; A_log ``[HV]``;
            b: ``[.., HV]`` (beta = ``sigmoid(b)``).
        initial_state_source: state pool ``[slots, HV, V, K]`` (a slot may be a strided view);
            initial_state_indices ``[N]`` (``< 0``: start from zero, no write-back).
        disable_state_update: leave the pool unchanged (target verify).
        intermediate_states_buffer: ``[slots, steps, HV, V, K]``; step ``t``'s state of
            sequence ``n`` goes to ``[intermediate_state_indices[n], t]`` (``< 0``: not kept).
        retrieve_parent_token: ``[N, >= T]`` (a tree): token ``t > 0`` of a sequence with a
            buffer row starts from its parent's state, read back from the buffer.

    Returns:
        ``o`` ``[B, T, HV, V]`` in ``q.dtype``. Gate ``-exp(A_log) * softplus(a + dt_bias)``
        (``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))`` with ``lower_bound``).
    """
    B, T, H, K = k.shape
    HV, V = v.shape[-2], v.shape[-1]
    if cu_seqlens is None:
        bounds = [n * T for n in range(B + 1)]
    else:
        bounds = [int(x) for x in cu_seqlens.tolist()]
    N = len(bounds) - 1
    total = B * T
    scale = K ** -0.5 if scale is None else scale
    qf = q.reshape(total, H, K).float()
    kf = k.reshape(total, H, K).float()
    vf = v.reshape(total, HV, V).float()
    if use_qk_l2norm_in_kernel:
        qf = qf / torch.sqrt(qf.square().sum(-1, keepdim=True) + 1e-6)
        kf = kf / torch.sqrt(kf.square().sum(-1, keepdim=True) + 1e-6)
    qf, kf = _expand_heads(qf * scale, HV), _expand_heads(kf, HV)
    A = A_log.float().reshape(HV)
    if is_kda:
        x = a.reshape(total, HV, K).float() + dt_bias.float().reshape(HV, K)
        A = A.reshape(1, HV, 1)
    else:
        x = a.reshape(total, HV).float() + dt_bias.float().reshape(HV)
    if lower_bound is not None:
        g = lower_bound * torch.sigmoid(A.exp() * x)
    else:
        g = -A.exp() * _softplus(x, softplus_beta, softplus_threshold)
    decay = g.exp()[:, :, None, :] if is_kda else g.exp()[:, :, None, None]  # [total, HV, 1, K|1]
    beta = torch.sigmoid(b.reshape(total, HV).float())

    pool = initial_state_source
    idx = initial_state_indices.reshape(-1)[:N].to(torch.long)
    live = idx >= 0
    S = torch.zeros(N, HV, V, K)
    if live.any():
        S[live] = pool[idx[live]].float()
    buf = intermediate_states_buffer
    rows = intermediate_state_indices.reshape(-1)[:N].to(torch.long) if buf is not None else None
    parents = retrieve_parent_token.to(torch.long) if retrieve_parent_token is not None else None
    lens = torch.tensor([bounds[n + 1] - bounds[n] for n in range(N)], dtype=torch.long)
    starts = torch.tensor(bounds[:N], dtype=torch.long)
    out = torch.zeros(total, HV, V)
    for t in range(int(lens.max()) if N else 0):
        act = lens > t
        if parents is not None and t > 0 and buf is not None:
            load = act & (rows >= 0)
            if load.any():
                S[load] = buf[rows[load], parents[load, t]].float()
        tok = (starts + t).clamp(max=max(total - 1, 0))
        Sn = S * decay[tok]
        vn = (vf[tok] - (Sn @ kf[tok][..., None]).squeeze(-1)) * beta[tok][..., None]
        Sn = Sn + vn[..., None] * kf[tok][:, :, None, :]
        o = (Sn @ qf[tok][..., None]).squeeze(-1)
        S = torch.where(act[:, None, None, None], Sn, S)
        out[tok[act]] = o[act]
        if buf is not None:
            keep = act & (rows >= 0)
            if keep.any():
                buf[rows[keep], t] = Sn[keep].to(buf.dtype)
    if not disable_state_update and live.any():
        pool[idx[live]] = S[live].to(pool.dtype)
    return out.to(q.dtype).reshape(B, T, HV, V)


def decode_attention_supported(*args, **kwargs) -> bool:
    """Whether :func:`decode_attention_fwd` covers this call: page size 1, 3-D KV buffers, no
    score_mod / xai temperature (those stay on SGLang's kernel)."""
    names = ("q", "k_buffer", "v_buffer", "o", "kv_indptr", "kv_indices")
    bound = dict(zip(names, args))
    bound.update({n: kwargs[n] for n in names if n in kwargs})
    if len(bound) < len(names):
        return False
    return (bound["k_buffer"].dim() == 3 and bound["v_buffer"].dim() == 3 and bound["q"].dim() == 3
            and kwargs.get("page_size", 1) == 1 and kwargs.get("score_mod") is None
            and kwargs.get("xai_temperature_len", -1) in (-1, None) and len(args) <= 13)


def decode_attention_fwd(q, k_buffer, v_buffer, o, kv_indptr, kv_indices, attn_logits=None, attn_lse=None,
                         num_kv_splits=None, max_kv_splits=None, sm_scale=1.0, k_scale=1.0, v_scale=1.0,
                         logit_cap=0.0, sinks=None, **_unused) -> None:
    """Replaces ``decode_attention.py::decode_attention_fwd`` (one query token per request).

    Args:
        q: ``[B, Hq, Dk]``; k_buffer / v_buffer: the KV pool ``[slots, Hkv, Dk]`` /
            ``[slots, Hkv, Dv]`` (token slots, page size 1); o: ``[B, Hq, Dv]``, written;
            kv_indptr ``[>= B + 1]`` and kv_indices: request ``i`` attends to the slots
            ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]``.
        sm_scale, k_scale, v_scale: softmax scale and the KV dequantization scales;
        logit_cap: ``cap * tanh(s / cap)`` when > 0; sinks: ``[Hq]`` per-head sink logits
        (one more softmax term with no value). The split buffers (attn_logits, attn_lse, ...)
        are scratch of SGLang's two-stage kernel and are not touched.
    """
    Bq, Hq, Dk = q.shape
    Hkv = k_buffer.shape[1]
    group = Hq // Hkv
    ptr = kv_indptr.tolist()
    scale = float(sm_scale) * float(k_scale)
    for i in range(Bq):
        slots = kv_indices[ptr[i]:ptr[i + 1]].to(torch.long)
        if slots.numel() == 0:
            o[i] = 0
            continue
        kk = k_buffer[slots].float().permute(1, 2, 0)  # [Hkv, Dk, L]
        vv = v_buffer[slots].float().permute(1, 0, 2)  # [Hkv, L, Dv]
        qq = q[i].float().reshape(Hkv, group, Dk)
        s = (qq @ kk) * scale  # [Hkv, group, L]
        if logit_cap and logit_cap > 0:
            s = logit_cap * torch.tanh(s / logit_cap)
        s = s.reshape(Hq, -1)
        if sinks is not None:
            s = torch.cat([s, sinks.float().reshape(Hq, 1)], dim=-1)
            p = torch.softmax(s, dim=-1)[:, :-1]
        else:
            p = torch.softmax(s, dim=-1)
        out = p.reshape(Hkv, group, -1) @ vv  # [Hkv, group, Dv]
        o[i] = (out.reshape(Hq, -1) * float(v_scale)).to(o.dtype)
