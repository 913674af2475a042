"""Plain-torch CPU versions of SGLang 0.5.23's GDN / KDA packed decode kernels
(``sglang/kernels/ops/attention/fla/fused_recurrent.py``; issue 40, item 5): one token per
row of the delta rule of :mod:`.cpu_kernels`, on the packed projections the backends' decode
passes (``TritonGDNKernel.packed_decode`` / ``TritonKDAKernel.packed_decode``,
``srt/layers/attention/linear/kernels/gdn_triton.py`` / ``kda_triton.py``). Bridged by
:mod:`.cpu_bridges` for CPU tensors only."""

from __future__ import annotations

import torch

from sglang_mamba_ext.plugin.cpu_kernels import _expand_heads


def _packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
                   use_qk_l2norm_in_kernel, per_channel, lower_bound=None, round_beta=False):
    """One token per row of the delta rule on the packed ``[B, 2 H K + HV V]`` projections
    (the two packed decode kernels of ``fla/fused_recurrent.py``); the pool rows are updated in
    place, a row with index ``-1`` gets a zero output and no state write."""
    B = mixed_qkv.shape[0]
    HV, V, K = initial_state.shape[-3:]
    H = (mixed_qkv.shape[1] - HV * V) // (2 * K)
    x = mixed_qkv.float()
    q = x[:, : H * K].reshape(B, H, K)
    k = x[:, H * K: 2 * H * K].reshape(B, H, K)
    v = x[:, 2 * H * K:].reshape(B, HV, V)
    if use_qk_l2norm_in_kernel:
        q = q / torch.sqrt(q.square().sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt(k.square().sum(-1, keepdim=True) + 1e-6)
    q, k = _expand_heads(q * scale, HV), _expand_heads(k, HV)
    A = A_log.float().reshape(HV, 1)
    if per_channel:
        xg = a.float().reshape(B, HV, K) + dt_bias.float().reshape(HV, K)
        if lower_bound is None:
            g = -A.exp() * torch.where(xg <= 20.0, torch.log(1.0 + torch.exp(xg)), xg)
        else:
            g = lower_bound * torch.sigmoid(A.exp() * xg)
        decay = g.exp()[:, :, None, :]  # [B, HV, 1, K]
    else:
        xg = a.float().reshape(B, HV) + dt_bias.float().reshape(HV)
        g = -A.reshape(HV).exp() * torch.where(xg <= 20.0, torch.log(1.0 + torch.exp(xg)), xg)
        decay = g.exp()[:, :, None, None]
    beta = torch.sigmoid(b.float().reshape(B, HV))
    if round_beta:
        beta = beta.to(b.dtype).float()
    idx = ssm_state_indices.to(torch.long).reshape(-1)
    live = (idx >= 0).nonzero().reshape(-1)
    o = torch.zeros(B, HV, V)
    if live.numel():
        rows = idx[live]
        S = initial_state[rows].float() * decay[live]  # [n, HV, V, K]
        kl, ql = k[live], q[live]
        vn = (v[live] - (S @ kl[..., None]).squeeze(-1)) * beta[live][..., None]
        S = S + vn[..., None] * kl[:, :, None, :]
        o[live] = (S @ ql[..., None]).squeeze(-1)
        initial_state[rows] = S.to(initial_state.dtype)
    out.copy_(o.reshape(out.shape))
    return out, initial_state


def fused_recurrent_gated_delta_rule_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                                   ssm_state_indices, use_qk_l2norm_in_kernel=False):
    """Replaces ``fla/fused_recurrent.py::fused_recurrent_gated_delta_rule_packed_decode`` (GDN
    decode, ``TritonGDNKernel.packed_decode``).

    Args:
        mixed_qkv: ``[B, 2 H K + HV V]`` (after the conv); a, b: ``[B, HV]``; A_log, dt_bias:
            ``[HV]``; initial_state: pool ``[slots, HV, V, K]`` updated in place;
            out: ``[B, 1, HV, V]``; ssm_state_indices: ``[B]`` (``-1``: zero output).

    Returns: ``(out, initial_state)``. Gate ``-exp(A_log) * softplus(a + dt_bias)``, beta
    ``sigmoid(b)`` rounded through b's dtype (as the kernel).
    """
    return _packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
                          use_qk_l2norm_in_kernel, per_channel=False, round_beta=True)


def fused_recurrent_kda_packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out,
                                      ssm_state_indices, use_qk_l2norm_in_kernel=False, lower_bound=None):
    """Replaces ``fla/fused_recurrent.py::fused_recurrent_kda_packed_decode`` (KDA decode,
    ``TritonKDAKernel.packed_decode``): as the GDN one with a per-key-channel gate, ``a [B, HV*K]``
    and ``dt_bias [HV*K]`` (``lower_bound``: the safe gate), beta in float32."""
    return _packed_decode(mixed_qkv, a, b, A_log, dt_bias, scale, initial_state, out, ssm_state_indices,
                          use_qk_l2norm_in_kernel, per_channel=True, lower_bound=lower_bound)
