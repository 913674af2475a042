"""Launching this package's Triton kernels where they were imported.

``@triton.jit`` picks compiled or interpreted mode from ``TRITON_INTERPRET`` when a kernel
module is imported, and Triton's interpreter reads the same variable again while the kernel
runs (a helper ``@triton.jit`` function called from an interpreted kernel raises "Cannot call
@triton.jit'd outside of the scope of a kernel" without it). :func:`launch_scope` keeps the
two consistent: it sets ``TRITON_INTERPRET=1`` for the duration of a launch exactly when the
kernel was built for the interpreter (CPU tests), and does nothing otherwise (CUDA).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator


def is_interpreted(kernel: Any) -> bool:
    """Whether ``kernel`` was decorated under ``TRITON_INTERPRET=1``."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # pragma: no cover - very old Triton
        return False
    return isinstance(kernel, InterpretedFunction)


@contextlib.contextmanager
def interpreter_env() -> Iterator[None]:
    """``TRITON_INTERPRET=1`` while inside; the previous value is restored on exit."""
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old


def launch_scope(kernel: Any) -> "contextlib.AbstractContextManager[None]":
    """Context for launching ``kernel``: :func:`interpreter_env` if the kernel is
    interpreted, else nothing."""
    return interpreter_env() if is_interpreted(kernel) else contextlib.nullcontext()
