"""CPU compatibility of SGLang 0.5.23's extra_buffer checkpoint tracking.

``ScheduleBatch.prepare_for_decode`` (``managers/schedule_batch.py``, extra_buffer branch)
moves the decode track mask to the device with ``track_mask_cpu.pin_memory().to(...)``.
Pinning needs a CUDA driver: on a host without one it raises, so SGLang's tracking pipeline
cannot run on CPU-only hosts (SGLang itself never runs extra_buffer there). Every other
pinned copy in that pipeline asks ``is_pin_memory_available()`` first.

:func:`prepare_for_decode_around` (an AROUND hook) makes ``Tensor.pin_memory`` return the
tensor unchanged for the duration of that one call, only under ``--enable-mamba-radix`` on a
host where pinning is impossible (``torch.cuda.is_available()`` is False); elsewhere it calls
the method untouched. Pinning is only a transfer optimization, so the result is the same.
"""

from __future__ import annotations

import contextlib

import torch

from sglang_mamba_ext.plugin.settings import BACKEND_NAME


@contextlib.contextmanager
def _pin_memory_is_identity():
    original = torch.Tensor.pin_memory

    def _identity(self, *args, **kwargs):
        return self

    torch.Tensor.pin_memory = _identity
    try:
        yield
    finally:
        torch.Tensor.pin_memory = original


def _needs_no_pin() -> bool:
    if torch.cuda.is_available():
        return False
    from sglang.srt.runtime_context import get_exec, get_memory

    return get_memory().radix_cache_backend == BACKEND_NAME and bool(get_exec().mamba.enable_mamba_extra_buffer)


def prepare_for_decode_around(original, batch, *args, **kwargs):
    """AROUND hook on ``ScheduleBatch.prepare_for_decode`` (module docstring)."""
    if not _needs_no_pin():
        return original(batch, *args, **kwargs)
    with _pin_memory_is_identity():
        return original(batch, *args, **kwargs)
