"""CPU bridge for SGLang 0.5.23's Jet-Nemotron classes (``JetNemotronForCausalLM``,
``srt/models/jet_nemotron.py``; issue 40), beside :mod:`.cpu_bridges` (whose
:func:`.cpu_bridges.torch_kernels` gates it: inert unless the CPU defaults turned the bridges on,
CUDA is absent and ``SGLANG_MAMBA_EXT_CPU_KERNELS`` is not ``triton``).

SGLang serves the class on CPU as it is (no gap that stops it); one bridge is for time:

- **the JetBlock's recurrence** (AROUND ``kernels/ops/attention/fla/fused_recurrent.py::
  fused_recurrent_gated_delta_rule_update``, ``:1211``): the JetBlock runs every token of a
  prefill and a decode through this Triton kernel (``models/jet_nemotron.py:316``), which on a
  CPU host runs under Triton's interpreter: a 150-token prompt of the tiny checkpoint took
  about 40 s to prefill on the 2-core machine. For a CPU tensor and a call it covers
  (:func:`.cpu_kernels_jet.recurrent_supported`: no speculative state cache, no tree mask) the
  plugin's torch version (:mod:`.cpu_kernels_jet`) answers; otherwise SGLang's kernel. In
  SGLang 0.5.23 only the JetBlock (and the Ascend NPU GDN backend) calls this function.
"""
from __future__ import annotations

RECURRENT_UPDATE = "sglang.kernels.ops.attention.fla.fused_recurrent.fused_recurrent_gated_delta_rule_update"


def recurrent_update_around(original, *args, **kwargs):
    """AROUND ``fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, ...)``: the plugin's torch
    version for CPU tensors on a process with the torch kernels on (module docstring), SGLang's
    kernel otherwise."""
    from sglang_mamba_ext.plugin.cpu_bridges import _first_tensor, torch_kernels

    first = _first_tensor(args, kwargs)
    if first is None or first.device.type != "cpu" or not torch_kernels():
        return original(*args, **kwargs)
    from sglang_mamba_ext.plugin import cpu_kernels_jet

    if not cpu_kernels_jet.recurrent_supported(*args, **kwargs):
        return original(*args, **kwargs)
    return cpu_kernels_jet.fused_recurrent_gated_delta_rule_update(*args, **kwargs)


def register_jet_nemotron_bridges(registry, hook_type) -> None:
    """Register this module's hooks on SGLang's ``HookRegistry`` (called from
    :func:`.cpu_bridges.register_cpu_bridges`)."""
    registry.register(RECURRENT_UPDATE, recurrent_update_around, hook_type.AROUND)
