"""Raw (pre-activation) mixer inputs: what the deferred-verify stash keeps per accepted token.

Seed §9.3 asks for the layer's "input activations"; issue 5 asks to keep only what replay cannot
recompute from the layer's weights. For a gated-delta-rule (KDA) layer that is, per token:

- ``mixed_qkv`` ``[conv_dim]``: the pre-conv projection (the conv window needs it, and the
  post-conv q, k, v are recomputed from it with the conv taps);
- ``g_raw`` ``[HV*K]``: the decay-gate projection ``f_b(f_a(x))`` *before* the activation
  ``g = -exp(A_log) * softplus(g_raw + dt_bias)`` (stored in the activation dtype, exactly as the
  forward computes it, so replay in bf16 rounds the same way);
- ``b_raw`` ``[HV]``: ``b_proj(x)`` before ``beta = sigmoid(b_raw)``.

These are the same three tensors SGLang's KDA backend receives (``mixed_qkv, a, b`` in
``layers/attention/linear/kda_backend.py``), so in SGLang the stash is exactly the linear
backend's inputs.

:func:`project_raw` and :func:`activate_gates` split ``GatedDeltaRuleMixer.project`` of
``sglang_mamba_ext/models/linear_attn.py`` in two; a test asserts that their composition equals
``project`` bit for bit. They belong in ``models/linear_attn.py`` (as mixer methods, with
``project`` calling them); they live here only until that file's owner moves them.
"""

from __future__ import annotations

from typing import Tuple

import torch
import torch.nn.functional as F

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer

__all__ = ["project_raw", "activate_gates"]


def project_raw(mixer: GatedDeltaRuleMixer, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Input projections of ``x`` ``[..., hidden]`` without the gate activations.

    Returns:
        ``mixed_qkv [..., conv_dim]``, ``g_raw [..., HV*K]``, ``b_raw [..., HV]``, all in
        ``x.dtype``.
    """
    return mixer.qkv_proj(x), mixer.f_b(mixer.f_a(x)), mixer.b_proj(x)


def activate_gates(
    mixer: GatedDeltaRuleMixer, g_raw: torch.Tensor, b_raw: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gate activations: ``g [..., HV, K]`` fp32 log-decay and ``beta [..., HV]`` fp32."""
    s = mixer.shape
    f = g_raw.float() + mixer.dt_bias.float()
    g = -mixer.A_log.float().exp()[:, None] * F.softplus(f.unflatten(-1, (s.num_v_heads, s.head_k_dim)))
    beta = torch.sigmoid(b_raw.float())
    return g, beta
