"""CPU-safe server defaults, applied only to flags the user did not pass.

With ``--device cpu``, stock SGLang 0.5.23 needs a few flags to serve a hybrid model well
(facts in ``shared/design/CPU_SERVING.md`` and the report of issue 4):

- ``--attention-backend torch_native``: SGLang's CPU default is ``intel_amx``
  (``arg_groups/platform_hook.py::handle_cpu_backends``), which needs ``sgl_kernel`` CPU ops
  that PyPI's CUDA-only ``sglang-kernel`` lacks; it falls back to ``torch_native`` only on
  hosts without AMX.
- ``--dtype float32`` when the checkpoint is float32: ``--dtype auto`` downcasts a float32
  checkpoint to float16 (``configs/model_config.py::_get_and_verify_dtype``), slow and
  inexact on CPU.
- ``--max-total-tokens`` / ``--max-mamba-cache-size``: unset, SGLang sizes the KV pool and
  the Mamba pool from ~72% of free host memory (observed: 14 GB of KV for the tiny model).
- ``SGLANG_MAMBA_CONV_DTYPE=float32``: SGLang keeps the conv window in bf16 by default
  (``configs/mamba_utils.py::mamba2_state_dtype``), about 2e-3 log-prob drift.

Not needed as flags (SGLang resolves them on CPU by itself): ``--sampling-backend pytorch``
(``handle_cpu_backends``), ``--disable-cuda-graph`` (no graphs off CUDA), and
``--mamba-radix-cache-strategy no_buffer`` + ``--disable-overlap-schedule`` (strategy
``auto`` resolves to ``no_buffer`` and turns overlap off when the model's
``LinearAttnModelSpec`` has no extra-buffer support, ``arg_groups/overrides.py``).

Mechanism: a BEFORE hook on ``sglang.srt.server_args.prepare_server_args(argv)`` through
SGLang's plugin ``HookRegistry`` (``srt/plugins/hook_registry.py``). ``launch_server`` and
``sglang serve`` call ``load_plugins()`` before ``prepare_server_args``, so the hook sees the
raw argv and appends defaults. ``sglang.Engine(...)`` (no argv) is not covered. A ``--config``
file disables the defaults (its values are merged inside ``prepare_server_args``).
"""

from __future__ import annotations

import json
import logging
import os
from typing import List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

HOOK_TARGET = "sglang.srt.server_args.prepare_server_args"
#: Set to 1 to turn the defaults off (e.g. to measure which flags SGLang needs by itself).
DISABLE_ENV = "SGLANG_MAMBA_EXT_NO_CPU_DEFAULTS"
CONV_DTYPE_ENV = "SGLANG_MAMBA_CONV_DTYPE"

#: KV tokens: a few thousand-token conversations at once.
DEFAULT_MAX_TOTAL_TOKENS = 16384
#: SSM slots. Each running request holds up to 4 (working, copy-on-write, 2 ping-pong
#: checkpoints), so 32 slots capped running requests at 8 and left no room for cached
#: states under concurrency; 128 keeps ~100 states cached at 8 running requests.
DEFAULT_MAX_MAMBA_CACHE_SIZE = 128

_installed = False


def _flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    """Value of ``flag`` in argv (``--flag v`` or ``--flag=v``); ``""`` for a bare flag;
    None when absent."""
    for i, arg in enumerate(argv):
        if arg == flag:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if nxt.startswith("--") else nxt
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def _checkpoint_dtype(model_path: Optional[str]) -> Optional[str]:
    if not model_path:
        return None
    path = os.path.join(model_path, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg.get("dtype") or cfg.get("torch_dtype")


def _active(argv: Sequence[str]) -> bool:
    return (
        _flag_value(argv, "--device") == "cpu"
        and _flag_value(argv, "--config") is None
        and os.environ.get(DISABLE_ENV, "0") in ("", "0")
    )


def cpu_default_args(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Append CPU-safe defaults to a ``launch_server`` argv.

    Only acts when ``--device cpu`` is given, no ``--config`` file is used and
    ``SGLANG_MAMBA_EXT_NO_CPU_DEFAULTS`` is not set to 1; never touches
    a flag the user passed (nor its related flags, e.g. ``--mem-fraction-static`` keeps the
    pool sizes SGLang's).

    Returns:
        ``(new_argv, added)``: ``added`` lists the flags appended (for the log).
    """
    argv = list(argv)
    if not _active(argv):
        return argv, []
    added: List[str] = []

    def absent(*flags: str) -> bool:
        return all(_flag_value(argv, f) is None for f in flags)

    def add(*items: str) -> None:
        argv.extend(items)
        added.append(" ".join(items))

    if absent("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend"):
        add("--attention-backend", "torch_native")
    if absent("--dtype") and _checkpoint_dtype(_flag_value(argv, "--model-path")) == "float32":
        add("--dtype", "float32")
    if absent("--max-total-tokens", "--mem-fraction-static"):
        add("--max-total-tokens", str(DEFAULT_MAX_TOTAL_TOKENS))
    if absent("--max-mamba-cache-size", "--mem-fraction-static", "--mamba-full-memory-ratio"):
        add("--max-mamba-cache-size", str(DEFAULT_MAX_MAMBA_CACHE_SIZE))
    return argv, added


def _before_prepare_server_args(argv, *args, **kwargs):
    new_argv, added = cpu_default_args(argv)
    if _active(new_argv) and CONV_DTYPE_ENV not in os.environ:
        os.environ[CONV_DTYPE_ENV] = "float32"  # inherited by the scheduler processes
        added.append(f"{CONV_DTYPE_ENV}=float32")
    if added:
        # warning: SGLang configures logging only inside prepare_server_args
        logger.warning("sglang-mamba-ext: CPU defaults added: %s", ", ".join(added))
    return (new_argv, *args), kwargs


def install_cpu_defaults() -> None:
    """Register the ``prepare_server_args`` hook (idempotent; applied by SGLang's
    ``load_plugins`` right after the plugins run)."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, _before_prepare_server_args, HookType.BEFORE)
    _installed = True
