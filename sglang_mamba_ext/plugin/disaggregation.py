"""Prefill/decode disaggregation (``--disaggregation-mode prefill``) with the plugin's cache
on a host without CUDA (``docs/design.md``, "Prefill/decode disaggregation").

The prefill server needs nothing of the plugin to transfer a request: SGLang 0.5.23's
``disaggregation/prefill.py::_send_kv_chunk`` reads the request's KV row
(``req_to_token``) and its working SSM slot
(``req_index_to_mamba_index_mapping[req_pool_idx]``) from whatever request pool the
scheduler has, here :class:`~sglang_mamba_ext.plugin.pool.MambaRadixReqToTokenPool`, whose
``MambaPool`` buffers the transfer backend registered (``disaggregation/utils.py``). One
branch of that function is CUDA-only: when the sender says ``supports_host_tensor_indices``
(mooncake's ``MooncakeKVSender`` does, ``disaggregation/mooncake/conn.py``) it allocates the
page indices with ``pin_memory=True`` and records a ``torch.cuda.Event``; both raise on a host
without a CUDA driver. The other branch (``kv_to_page_indices``, a plain host copy) sends the
same pages.

:func:`send_kv_chunk_around` (an AROUND hook on
``SchedulerDisaggregationPrefillMixin._send_kv_chunk``) sets ``supports_host_tensor_indices =
False`` on the request's sender object (an instance attribute, that sender only) before the
call, so SGLang takes the host-copy branch. Inert (SGLang's call unchanged) when CUDA is
available and when ``--enable-mamba-radix`` is not given.
"""

from __future__ import annotations

import torch

from sglang_mamba_ext.plugin.settings import BACKEND_NAME

#: Hook target (dotted path, resolved by SGLang's HookRegistry).
SEND_KV_CHUNK = "sglang.srt.disaggregation.prefill.SchedulerDisaggregationPrefillMixin._send_kv_chunk"


def _host_indices_unusable() -> bool:
    if torch.cuda.is_available():
        return False
    from sglang.srt.runtime_context import get_memory

    return get_memory().radix_cache_backend == BACKEND_NAME


def send_kv_chunk_around(original, scheduler, req, *args, **kwargs):
    """AROUND hook on ``SchedulerDisaggregationPrefillMixin._send_kv_chunk`` (module
    docstring): on a host without CUDA under ``--enable-mamba-radix``, the request's sender
    reports ``supports_host_tensor_indices = False`` so SGLang builds the page indices with a
    host copy instead of a pinned buffer and a CUDA event."""
    sender = getattr(req, "disagg_kv_sender", None)
    if sender is not None and getattr(sender, "supports_host_tensor_indices", False) and _host_indices_unusable():
        sender.supports_host_tensor_indices = False
    return original(scheduler, req, *args, **kwargs)


def register_disaggregation_hooks() -> None:
    """Register :func:`send_kv_chunk_around` (called by ``install_mamba_radix``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(SEND_KV_CHUNK, send_kv_chunk_around, HookType.AROUND)
