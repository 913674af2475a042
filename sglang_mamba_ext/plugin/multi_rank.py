"""Multi-rank serving on a CPU host (``docs/design.md``, "Multi-rank serving").

One hook, active only when the plugin's CPU defaults saw a launch with more than one rank
(they set :data:`ACTIVE_ENV`, ``plugin/cpu_defaults.py::multi_rank_env``):

- AROUND ``TorchNativeAttnBackend.get_cuda_graph_seq_len_fill_value``: with DP attention SGLang
  pads every attention-DP group's batch to a common size before the MLP sync
  (``forward_batch_info.py::_pad_inputs_to_size``) and asks the attention backend which sequence
  length a padding row gets; ``torch_native`` (the only attention backend that runs on CPU
  without ``sgl_kernel``'s CPU ops) raises ``NotImplementedError``. A padding row is a
  one-token sequence, the value every GPU backend returns (``flashinfer_backend.py``).
- AROUND ``ForwardBatch.prepare_mlp_sync_batch``: the same padding step builds a tensor with
  ``pin_memory=True`` unless SGLang's CPU engine is on (``SGLANG_USE_CPU_ENGINE``, which needs
  ``sgl_kernel`` CPU ops); pinning needs a CUDA driver. On a host without CUDA the call runs
  with ``torch.tensor``'s ``pin_memory`` dropped (a transfer optimisation only; as
  ``plugin/cpu_pin_memory.py`` does for ``prepare_for_decode``).
"""

from __future__ import annotations

import contextlib
import os

import torch

ACTIVE_ENV = "SGLANG_MAMBA_EXT_MULTI_RANK_CPU"

HOOK_TARGETS = [
    ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend.get_cuda_graph_seq_len_fill_value",
     "AROUND", "fill_value_around"),
    ("sglang.srt.model_executor.forward_batch_info.ForwardBatch.prepare_mlp_sync_batch", "AROUND",
     "prepare_mlp_sync_batch_around"),
]


@contextlib.contextmanager
def _no_pinned_factories():
    original = torch.tensor

    def tensor(*args, **kwargs):
        kwargs.pop("pin_memory", None)
        return original(*args, **kwargs)

    torch.tensor = tensor
    try:
        yield
    finally:
        torch.tensor = original


def prepare_mlp_sync_batch_around(original, batch, *args, **kwargs):
    if os.environ.get(ACTIVE_ENV) != "1" or torch.cuda.is_available():
        return original(batch, *args, **kwargs)
    with _no_pinned_factories():
        return original(batch, *args, **kwargs)


def fill_value_around(original, backend, *args, **kwargs):
    if os.environ.get(ACTIVE_ENV) != "1":
        return original(backend, *args, **kwargs)
    try:
        return original(backend, *args, **kwargs)
    except NotImplementedError:
        return 1


def register_multi_rank_hooks() -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, kind, name in HOOK_TARGETS:
        HookRegistry.register(target, globals()[name], getattr(HookType, kind))
