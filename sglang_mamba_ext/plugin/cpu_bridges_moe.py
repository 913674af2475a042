"""The CPU bridge of SGLang's CPU MoE path (issue 40), beside :mod:`.cpu_bridges` (whose
:func:`.cpu_bridges.active` gates it: inert unless the CPU defaults turned the bridges on and CUDA
is absent).

AROUND ``layers/moe/fused_moe_native.py::moe_forward_native`` (SGLang's CPU MoE path, from
``quantization/unquant.py:1385``): it knows the gated ``silu`` / ``gelu`` / ``situ`` activations
only (``fused_moe_native.py:97``) and ignores ``moe_runner_config.swiglu_limit`` (its GPU runners
clamp: ``moe_runner/triton.py:173``). Two kinds of experts run :func:`routed_experts` instead:

- non-gated ReLU² experts without biases (Nemotron-H's MoE blocks): :func:`relu2_experts`;
- gated ``silu`` experts with a ``swiglu_limit`` (GLM-5-Next's):
  :func:`.cpu_bridges_glm5_next.clamped_experts_apply`.

Any other call is SGLang's.
"""

from __future__ import annotations

from sglang_mamba_ext.plugin import cpu_bridges

MOE_FORWARD_NATIVE = "sglang.srt.layers.moe.fused_moe_native.moe_forward_native"


def routed_experts(x, w13, w2, topk_weights, topk_ids, activation):
    """Routed MoE experts in torch: for each routed (token, slot),
    ``w2[e] @ activation(w13[e] @ x)`` weighted by the slot's router weight, summed over the slots
    in float32 and returned in ``x``'s dtype.

    ``x``: ``[T, H]``; ``w13``: ``[E, I or 2I, H]``; ``w2``: ``[E, H, I]``; ``topk_weights`` /
    ``topk_ids``: ``[T, K]``; ``activation`` maps ``[n, I or 2I]`` (``x``'s dtype) to ``[n, I]``
    in ``x``'s dtype (as SGLang's activations return it)."""
    import torch
    import torch.nn.functional as F

    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        rows, slots = (topk_ids == e).nonzero(as_tuple=True)
        y = F.linear(activation(F.linear(x[rows], w13[e])), w2[e]).float()
        out.index_add_(0, rows, y * topk_weights[rows, slots].float().unsqueeze(-1))
    return out.to(x.dtype)


def relu2_experts(x, w13, w2, topk_weights, topk_ids):
    """Non-gated MoE experts with ReLU² (Nemotron-H's): :func:`routed_experts` with
    ``relu(h) ** 2``; ``w13``: ``[E, I, H]``, ``w2``: ``[E, H, I]``."""
    import torch.nn.functional as F

    return routed_experts(x, w13, w2, topk_weights, topk_ids, lambda h: F.relu(h).square())


def moe_native_around(original, layer, x, topk_output, moe_runner_config, *args, **kwargs):
    """AROUND ``moe_forward_native(layer, x, topk_output, moe_runner_config)`` (module docstring):
    on an active process and a CPU tensor, ReLU² experts or clamped SwiGLU experts in torch;
    otherwise SGLang's result."""
    if not (cpu_bridges.active() and x.device.type == "cpu") or args or kwargs:
        return original(layer, x, topk_output, moe_runner_config, *args, **kwargs)
    no_bias = getattr(layer, "w13_weight_bias", None) is None and getattr(layer, "w2_weight_bias", None) is None
    if (moe_runner_config.activation == "relu2" and not moe_runner_config.is_gated
            and not moe_runner_config.apply_router_weight_on_input and no_bias):
        topk_weights, topk_ids, _ = topk_output
        return relu2_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids)
    from sglang_mamba_ext.plugin.cpu_bridges_glm5_next import clamped_experts_apply

    out = clamped_experts_apply(layer, x, topk_output, moe_runner_config)
    return original(layer, x, topk_output, moe_runner_config) if out is None else out
