"""CPU bridge for SGLang 0.5.23's MiniCPM-V 4.6 / 4.7 classes (``MiniCPMV4_6ForConditionalGeneration``,
``MiniCPMV4_7ForConditionalGeneration``, ``srt/models/minicpmv.py``: Qwen3.5's Gated DeltaNet text
model behind a vision tower; issue 40), beside :mod:`.cpu_bridges` (whose
:func:`.cpu_bridges.active` gates it: inert unless the CPU defaults turned the bridges on and CUDA
is absent).

- **device of the vision merger** (AROUND ``utils/common.py::get_device``): the classes move
  their resampler / merger to ``get_device()`` at construction (``models/minicpmv.py:1512``, and
  ``:938``, ``:1105``, ``:1276`` for the older versions), which knows accelerators and platform
  plugins only and raises ``RuntimeError: No accelerator (CUDA, XPU, HPU, NPU, MUSA, MPS) or
  platform plugin is available`` on a CPU host (``utils/common.py:1122-1126``). Where SGLang's
  function raises that on an active process, the answer is ``"cpu"`` (``"cpu:N"`` is not asked
  for: ``device_id`` None); everywhere else SGLang's answer or error unchanged.
- **the loaded model's shared-experts layout** (AROUND ``model_loader/loader.py::_initialize_model``):
  SGLang's ``MiniCPMV`` (the 4.6 / 4.7 classes' base) is a plain object around the version's
  module (``minicpmv.py:1770-1776``: attribute reads go to ``self.minicpmv``); the loader sets
  ``shared_experts_config`` on what it built (``loader.py:311``), the wrapper, then returns
  ``model.eval()`` (``loader.py:1025``), which the wrapper hands to the inner module
  (``MiniCPMBaseModel.eval`` returns the inner module, ``minicpmv.py:1351-1353``). The model
  runner then reads ``shared_experts_config`` from the inner module
  (``runner/base_runner.py:250``, ``model_runner.py:1801``) and the server stops at start-up with
  ``AttributeError: 'MiniCPMV4_6' object has no attribute 'shared_experts_config'``. The bridge
  also sets the attribute on the inner module. Read from SGLang's code, the same path runs on a
  GPU (not checked there): a report upstream would be the real fix.
"""
from __future__ import annotations

GET_DEVICE = "sglang.srt.utils.common.get_device"
INITIALIZE_MODEL = "sglang.srt.model_loader.loader._initialize_model"


def get_device_around(original, device_id=None, *args, **kwargs):
    """AROUND ``get_device(device_id=None)``: SGLang's device string, or ``"cpu"`` where SGLang
    finds no accelerator on a process with the CPU bridges active (module docstring)."""
    try:
        return original(device_id, *args, **kwargs)
    except RuntimeError:
        from sglang_mamba_ext.plugin.cpu_bridges import active

        if active() and device_id is None:
            return "cpu"
        raise


def initialize_model_around(original, *args, **kwargs):
    """AROUND ``_initialize_model(model_config, load_config, quant_config)``: SGLang's model;
    for a ``MiniCPMV`` wrapper on a process with the CPU bridges active, its
    ``shared_experts_config`` also set on the inner module ``minicpmv`` (module docstring)."""
    model = original(*args, **kwargs)
    inner = getattr(model, "__dict__", {}).get("minicpmv")
    if inner is not None and "shared_experts_config" in model.__dict__:
        from sglang_mamba_ext.plugin.cpu_bridges import active

        if active() and not hasattr(inner, "shared_experts_config"):
            inner.shared_experts_config = model.shared_experts_config
    return model


def register_minicpmv_bridges(registry, hook_type) -> None:
    """Register this module's hooks on SGLang's ``HookRegistry`` (called from
    :func:`.cpu_bridges.register_cpu_bridges`)."""
    registry.register(GET_DEVICE, get_device_around, hook_type.AROUND)
    registry.register(INITIALIZE_MODEL, initialize_model_around, hook_type.AROUND)
