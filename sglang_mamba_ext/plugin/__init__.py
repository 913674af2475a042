"""The SGLang-facing layer: the only part of the package that imports ``sglang``.

SGLang 0.5.23 loads :func:`register` through the entry point
``sglang.srt.plugins: mamba_radix = sglang_mamba_ext.plugin:register`` in every process it
starts. Every SGLang symbol this layer hooks, registers into or subclasses is listed in
``docs/sglang-hooks.md``.
"""

from sglang_mamba_ext.plugin.registration import register

__all__ = ["register"]
