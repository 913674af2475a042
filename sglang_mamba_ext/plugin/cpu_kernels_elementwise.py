"""Plain-torch CPU versions of the small Triton kernels around SGLang 0.5.23's linear layers
that, once the scans are in torch (:mod:`.cpu_kernels`), took most of a tiny Qwen3-Next prefill
under Triton's interpreter (py-spy on a served 300-token prompt: the qkvz split 31 %, the
shared-expert gate 12 %, the GDN gating 10 %). Same signatures and outputs; bridged by
:mod:`.cpu_bridges` for CPU tensors only.

- :func:`fused_qkvzba_split_reshape_cat`: ``sglang/kernels/ops/attention/
  triton_gdn_fused_proj.py`` (``srt/models/qwen3_next.py``, ``Qwen3GatedDeltaNet``).
- :func:`fused_gdn_gating`: ``sglang/kernels/ops/attention/linear/fused_gdn_gating.py``
  (``srt/layers/attention/linear/gdn_backend.py``).
- :func:`fused_gate_sigmoid_mul_add` / :func:`fused_gate_sigmoid_mul`:
  ``sglang/kernels/ops/elementwise/elementwise.py`` (``srt/models/qwen2_moe.py``, the
  shared-expert gate of Qwen2-MoE / Qwen3-Next).
"""

from __future__ import annotations

import torch


def fused_qkvzba_split_reshape_cat(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Split Qwen3-Next's head-group-interleaved projections.

    Args:
        mixed_qkvz: ``[T, Hqk * (2 * head_qk + 2 * r * head_v)]`` with ``r = Hv / Hqk``, per key
            head group ``[q | k | v (r heads) | z (r heads)]``.
        mixed_ba: ``[T, Hqk * 2r]``, per group ``[b (r) | a (r)]``.

    Returns:
        ``(mixed_qkv [T, 2 Hqk head_qk + Hv head_v]`` (all q, all k, all v), ``z [T, Hv,
        head_v]``, ``b [T, Hv]``, ``a [T, Hv])``, in the inputs' dtypes.
    """
    T = mixed_qkvz.shape[0]
    r = num_heads_v // num_heads_qk
    x = mixed_qkvz.reshape(T, num_heads_qk, -1)
    q, k, v, z = x.split([head_qk, head_qk, r * head_v, r * head_v], dim=-1)
    mixed_qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
    ba = mixed_ba.reshape(T, num_heads_qk, 2 * r)
    b = ba[..., :r].reshape(T, num_heads_v).contiguous()
    a = ba[..., r:].reshape(T, num_heads_v).contiguous()
    return mixed_qkv, z.reshape(T, num_heads_v, head_v).contiguous(), b, a


def fused_gdn_gating(A_log, a, b, dt_bias, beta: float = 1.0, threshold: float = 20.0):
    """``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``.

    Args:
        A_log, dt_bias: ``[H]``; a, b: ``[T, H]`` (rows may be strided).

    Returns:
        ``(g [1, T, H], beta [1, T, H])`` float32; beta is rounded through b's dtype first, as
        SGLang's kernel stores it.
    """
    x = a.float() + dt_bias.float()
    soft = torch.where(beta * x <= threshold, torch.log1p(torch.exp(beta * x)) / beta, x)
    g = -torch.exp(A_log.float()) * soft
    beta_out = torch.sigmoid(b.float()).to(b.dtype).float()
    return g.unsqueeze(0), beta_out.unsqueeze(0)


def _gate(hidden_states, gate_weight):
    return torch.sigmoid((hidden_states.float() * gate_weight.float()).sum(-1, keepdim=True))


def fused_gate_sigmoid_mul_add(hidden_states, gate_weight, shared_output, final_hidden_states) -> None:
    """``final += sigmoid(hidden_states @ gate_weight) * shared_output`` in place (float32 math).

    Args: hidden_states, shared_output, final_hidden_states ``[T, D]``; gate_weight ``[D]``."""
    res = _gate(hidden_states, gate_weight) * shared_output.float() + final_hidden_states.float()
    final_hidden_states.copy_(res)


def fused_gate_sigmoid_mul(hidden_states, gate_weight, shared_output):
    """``sigmoid(hidden_states @ gate_weight) * shared_output`` (shapes as above), in
    shared_output's dtype."""
    return (_gate(hidden_states, gate_weight) * shared_output.float()).to(shared_output.dtype)
