"""SGLang general-plugin entry point (group ``sglang.srt.plugins``, name ``mamba_radix``).

SGLang 0.5.23 calls :func:`register` in every process it starts
(``sglang/srt/plugins/__init__.py::load_plugins``), before parsing server arguments in
``launch_server`` / ``sglang serve``. Keep it cheap and idempotent.
"""

from __future__ import annotations


def register() -> None:
    """Register this package's SGLang extensions: the tiny hybrid model, and CPU-safe
    defaults for flags the user did not pass with ``--device cpu``
    (:mod:`sglang_mamba_ext.sglang.cpu_defaults`)."""
    from sglang_mamba_ext.sglang.cpu_defaults import install_cpu_defaults
    from sglang_mamba_ext.sglang.tiny_hybrid import register_tiny_hybrid

    register_tiny_hybrid()
    install_cpu_defaults()
