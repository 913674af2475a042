"""Run SGLang's own Triton linear-attention kernels under Triton's CPU interpreter
(``TRITON_INTERPRET=1``, triton 3.8), for the tiny model served with SGLang's GDN / KDA
backends on a host without CUDA (``TinyHybridSGLangKernelsForCausalLM``; ``docs/design.md``,
"Tiny hybrid model"). Three things stop those kernels there, each fixed in-process:

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

:func:`install_interpreter_shims` does nothing when CUDA is available or ``TRITON_INTERPRET``
is not ``1`` (then SGLang's kernels compile as usual). Only the plugin's own model class calls
it, so no other launch is touched. Known limit of the interpreter: bfloat16 tensors give wrong
results in SGLang's chunked kernels (serve the tiny model in float16).
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


def install_interpreter_shims() -> bool:
    """Apply the three fixes of this module once per process when :func:`interpreting`;
    returns whether they are in place.

    Raises:
        RuntimeError: Triton was imported before ``TRITON_INTERPRET=1`` was set, so SGLang's
            kernels are compiled functions that cannot run on CPU (set the variable before
            the server starts; the plugin's CPU defaults do it for this model).
    """
    global _installed
    if _installed:
        return True
    if not interpreting():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    for name in KERNEL_MODULES:
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
    logger.info("Triton interpreter shims for SGLang's linear-attention kernels: %d builtin aliases", n)
    _installed = True
    return True
