"""sglang-mamba-ext: hybrid prefix cache (KV + SSM state) and deferred-update verify for SGLang.

Layers (``docs/design.md``, "Layers"): ``mem_cache`` (core, torch only) <- ``models`` and
``speculative`` (torch/Triton) <- ``plugin`` (the only layer that imports SGLang) <-
``benchmarks`` and ``testing``. Importing this package imports nothing from SGLang.
"""

__version__ = "0.1.0"
