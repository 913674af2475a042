"""CPU bridges for SGLang 0.5.23's Kimi-K3 text class (``KimiK3LinearForCausalLM``,
``srt/models/kimi_k3.py``; issue 40), beside :mod:`.cpu_bridges` (whose :func:`.cpu_bridges.active`
gates every hook here: inert unless the CPU defaults turned the bridges on and CUDA is absent).

- **side streams** (AROUND ``KimiK3LinearModel.__init__``): the backbone creates three CUDA
  streams for its layers unless on ROCm (``models/kimi_k3.py:2761``,
  ``[torch.cuda.Stream() for _ in range(3)]``), which on a CUDA build of torch without a driver
  raises ``AcceleratorError: CUDA error: CUDA driver version is insufficient``. On CPU, for the
  duration of the constructor, ``torch.cuda.Stream()`` answers None: every layer then gets no
  side stream (what K3's layers already take for ``alt_streams`` None: its MoE, KDA and MLA
  output-gate overlaps are off), and the model runs on the one CPU stream.
- **attention-residual mixture** (AROUND ``layers/attn_residual.py::_mix_fused``): off CUDA
  (and ROCm's fused kernel) every attention-residual read aggregates through ``_mix_fused``
  (``attn_residual.py:440`` via ``_aggregate_fused``), a pair of Triton kernels tiled for K3's
  width only: ``_BLOCK_H`` 1024 (``attn_residual.py:29``) and ``n_h_blocks = H // _BLOCK_H``
  (``:231``), so for a width below 1024 (or not a multiple of it) the combine kernel's grid has
  no column block and the mixture is left as ``torch.empty_like``'s garbage; on CPU it would
  also run under Triton's interpreter. For CPU tensors the mixture is SGLang's own eager
  reference, ``aggregate_stream_torch`` (``attn_residual.py:318``; the same softmax over the
  RMS-normed rows' scores, then the weighted sum), which its ``aggregate_stream`` already takes
  for such widths (``:355``).
"""
from __future__ import annotations

import contextlib
import logging
import threading

logger = logging.getLogger(__name__)

K3_MODEL_INIT = "sglang.srt.models.kimi_k3.KimiK3LinearModel.__init__"
MIX_FUSED = "sglang.srt.layers.attn_residual._mix_fused"

_lock = threading.Lock()


@contextlib.contextmanager
def no_cuda_streams():
    """For the duration: ``torch.cuda.Stream(...)`` returns None (restored afterwards)."""
    import torch

    with _lock:
        original = torch.cuda.Stream

        def _no_stream(*args, **kwargs):
            return None

        torch.cuda.Stream = _no_stream
        try:
            yield
        finally:
            torch.cuda.Stream = original


def k3_model_init_around(original, *args, **kwargs):
    """AROUND ``KimiK3LinearModel.__init__``: on CPU (:func:`.cpu_bridges.active`) no side
    streams (module docstring); otherwise SGLang's constructor unchanged."""
    from sglang_mamba_ext.plugin.cpu_bridges import active

    if not active():
        return original(*args, **kwargs)
    with no_cuda_streams():
        return original(*args, **kwargs)


def mix_fused_around(original, prefix_sum, bank, nvb, score_proj, score_norm, *args, **kwargs):
    """AROUND ``attn_residual._mix_fused(prefix_sum [T, H], bank [T, NB, H], nvb, score_proj,
    score_norm)`` (the pre-norm mixture ``[T, H]`` in ``prefix_sum``'s dtype): for a CPU tensor
    on an active process, SGLang's ``aggregate_stream_torch`` (module docstring); otherwise
    SGLang's kernels."""
    from sglang_mamba_ext.plugin.cpu_bridges import active

    if not (active() and prefix_sum.device.type == "cpu"):
        return original(prefix_sum, bank, nvb, score_proj, score_norm, *args, **kwargs)
    from sglang.srt.layers.attn_residual import aggregate_stream_torch

    return aggregate_stream_torch(prefix_sum, bank, nvb, score_proj, score_norm)


def register_kimi_k3_bridges(registry, hook_type) -> None:
    """Register this module's hooks on SGLang's ``HookRegistry`` (called from
    :func:`.cpu_bridges.register_cpu_bridges`)."""
    registry.register(K3_MODEL_INIT, k3_model_init_around, hook_type.AROUND)
    registry.register(MIX_FUSED, mix_fused_around, hook_type.AROUND)
    from sglang_mamba_ext.plugin.cpu_bridges_kimi_k3_vl import register_kimi_k3_vl_bridges

    register_kimi_k3_vl_bridges(registry, hook_type)  # the VLM's processor (cpu_bridges_kimi_k3_vl.py)
