"""Run SGLang's own Triton linear-attention kernels under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, triton 3.8), for the tiny model served with SGLang's GDN / KDA
backends on a host without CUDA (``TinyHybridSGLangKernelsForCausalLM``; ``docs/design.md``,
"Tiny hybrid model"). Five things stop those kernels there, each fixed in-process:

1. **Module-level aliases of ``triton.language`` builtins** (``exp = tl.exp`` in
   ``sglang/kernels/ops/attention/fla/op.py``, imported by name into other kernel modules):
   the interpreter patches the builtins on ``tl`` / ``tl.math`` while a kernel runs, so an
   alias taken at import time is the unpatched builtin and raises "``_semantic`` argument must
   be provided". Each such alias in an imported ``sglang.kernels`` / ``sglang.srt.layers``
   module is replaced by a forwarder that looks the builtin up on its home module at call time.
2. **Autotuning**: with more than one config Triton benchmarks them through the active GPU
   driver, which does not exist; under the interpreter the first config is used.
3. **fla's device context** (``sglang/kernels/ops/attention/fla/utils.py::custom_device_ctx``)
   calls ``torch.cpu.device``, which torch lacks; a null context on CPU.
4. **libdevice calls** (``libdevice.exp`` in ``fla/kda.py::kda_gate_chunk_cumsum_vector_kernel``):
   ``triton.language.extra.libdevice`` holds compile-time stubs that return None under the
   interpreter. A module-level ``libdevice`` in an imported SGLang kernel module is replaced by
   :class:`InterpretedLibdevice`, which forwards the names ``tl`` / ``tl.math`` also define
   (``exp``, ``log``, ``sqrt``, ``div_rn``, ...) and raises ``AttributeError`` for the others.
5. **bfloat16 dot operands** (``fla/chunk_intra.py``: KDA's inter-sub-chunk products cast
   their operands ``.to(tl.bfloat16)`` before ``tl.dot``): the interpreter keeps bfloat16 values
   as their raw 16-bit patterns (``uint16``) and its ``create_dot`` multiplies those integers,
   so the result is garbage (NaN downstream). ``InterpreterBuilder.create_dot`` is wrapped to
   widen bfloat16 operands to float32 first (exact: every bfloat16 is a float32).

:func:`install_interpreter_shims` does nothing when CUDA is available or ``TRITON_INTERPRET``
is not ``1`` (then SGLang's kernels compile as usual). Only the plugin's own model class calls
it, so no other launch is touched. Item 5 was the cause of the wrong bfloat16 results seen in
SGLang's chunked kernels (1e9-sized GDN outputs; with it, SGLang's chunked GDN kernel on bfloat16
inputs agrees with fla's naive recurrence to bfloat16 precision, about 1e-2); the tiny model is
still served in float16, the dtype checked in serving.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys

logger = logging.getLogger(__name__)

#: SGLang kernel modules the GDN / KDA backends launch (imported before the aliases are fixed).
KERNEL_MODULES = (
    "sglang.kernels.ops.attention.fla.op",
    "sglang.kernels.ops.attention.fla.chunk",
    "sglang.kernels.ops.attention.fla.kda",
    "sglang.kernels.ops.attention.fla.fused_recurrent",
    "sglang.kernels.ops.attention.fla.utils",
    "sglang.srt.layers.attention.linear.gdn_backend",
    "sglang.srt.layers.attention.linear.kda_backend",
)
_PACKAGES = ("sglang.kernels", "sglang.srt.layers")

_installed = False


def interpreting() -> bool:
    """True when Triton kernels run interpreted here: ``TRITON_INTERPRET=1`` and no CUDA."""
    import torch

    return os.environ.get("TRITON_INTERPRET") == "1" and not torch.cuda.is_available()


def _forwarder(home, name: str):
    def forward(*args, **kwargs):
        return getattr(home, name)(*args, **kwargs)

    forward.__name__ = name
    return forward


def fix_builtin_aliases() -> int:
    """Replace module-level aliases of ``tl`` / ``tl.math`` builtins in imported SGLang
    kernel modules by call-time forwarders (item 1 above); returns how many were replaced."""
    import triton.language as tl

    homes = (tl, tl.math)
    n = 0
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(_PACKAGES):
            continue
        for attr, value in list(vars(mod).items()):
            try:
                builtin = callable(value) and tl.core.is_builtin(value)
            except Exception:
                builtin = False
            if not builtin:
                continue
            name = getattr(value, "__name__", attr)
            if not isinstance(name, str):
                continue
            for home in homes:
                if getattr(home, name, None) is value:
                    setattr(mod, attr, _forwarder(home, name))
                    n += 1
                    break
    return n


class InterpretedLibdevice:
    """Stand-in for ``triton.language.extra.libdevice`` inside interpreted kernels (item 4):
    ``name`` -> a call-time forwarder to ``tl.math.name`` (or ``tl.name``)."""

    def __getattr__(self, name: str):
        import triton.language as tl

        for home in (tl.math, tl):
            if callable(getattr(home, name, None)):
                return _forwarder(home, name)
        raise AttributeError(
            f"libdevice.{name} has no triton.language equivalent for the Triton interpreter"
        )


def fix_libdevice_modules() -> int:
    """Replace module-level references to ``triton.language.extra.libdevice`` in imported
    SGLang kernel modules by :class:`InterpretedLibdevice` (item 4 above); returns how many."""
    from triton.language.extra import libdevice

    shim = InterpretedLibdevice()
    n = 0
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or not mod_name.startswith(_PACKAGES):
            continue
        for attr, value in list(vars(mod).items()):
            if value is libdevice:
                setattr(mod, attr, shim)
                n += 1
    return n


def fix_bf16_dot() -> None:
    """Wrap Triton's ``InterpreterBuilder.create_dot`` so bfloat16 operands are widened to
    float32 before the product (item 5 above)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as ti

    original = ti.InterpreterBuilder.create_dot
    if getattr(original, "_mamba_ext_bf16", False):
        return

    def widen(h):
        if h.dtype.scalar != tl.bfloat16:
            return h
        bits = h.data.astype(np.uint16).astype(np.uint32) << 16  # bf16 = high half of fp32
        return ti.TensorHandle(bits.view(np.float32), tl.float32)

    def create_dot(self, a, b, d, *args, **kwargs):
        return original(self, widen(a), widen(b), d, *args, **kwargs)

    create_dot._mamba_ext_bf16 = True
    ti.InterpreterBuilder.create_dot = create_dot


def install_interpreter_shims(extra_modules=()) -> bool:
    """Apply the five fixes of this module once per process when :func:`interpreting`;
    returns whether they are in place. ``extra_modules``: more kernel modules to import
    before the aliases are fixed (the Mamba2 ones for SGLang's Mamba2 classes,
    :mod:`.cpu_bridges`); given after the first call, they are imported and fixed then.

    Raises:
        RuntimeError: Triton was imported before ``TRITON_INTERPRET=1`` was set, so SGLang's
            kernels are compiled functions that cannot run on CPU (set the variable before
            the server starts; the plugin's CPU defaults do it for this model).
    """
    global _installed
    if not interpreting():
        return False
    if _installed:
        if extra_modules:
            for name in extra_modules:
                importlib.import_module(name)
            fix_builtin_aliases()
            fix_libdevice_modules()
        return True
    from triton.runtime.interpreter import InterpretedFunction

    for name in (*KERNEL_MODULES, *extra_modules):
        importlib.import_module(name)
    if not isinstance(sys.modules["sglang.kernels.ops.attention.fla.op"].safe_exp, InterpretedFunction):
        raise RuntimeError(
            "SGLang's Triton kernels were imported before TRITON_INTERPRET=1 was set, so they cannot "
            "run on this host without CUDA; start the server with TRITON_INTERPRET=1 in its environment"
        )

    from triton.runtime import autotuner

    original_prune = autotuner.Autotuner.prune_configs

    def prune_first(self, kwargs, *args, **kw):
        return original_prune(self, kwargs, *args, **kw)[:1]

    autotuner.Autotuner.prune_configs = prune_first

    from sglang.kernels.ops.attention.fla import utils as fla_utils

    original_ctx = fla_utils.custom_device_ctx

    def device_ctx(index):
        import torch

        return contextlib.nullcontext() if not torch.cuda.is_available() else original_ctx(index)

    fla_utils.custom_device_ctx = device_ctx
    n = fix_builtin_aliases()
    m = fix_libdevice_modules()
    fix_bf16_dot()
    logger.info("Triton interpreter shims for SGLang's linear-attention kernels: %d builtin aliases, "
                "%d libdevice modules", n, m)
    _installed = True
    return True
