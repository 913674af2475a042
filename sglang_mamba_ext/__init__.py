"""sglang-mamba-ext: hybrid prefix cache (KV + SSM state) and deferred-update verify for SGLang.

Layers (DESIGN.md): ``mem_cache`` (core, torch only) <- ``spec`` (torch/Triton only)
<- ``sglang`` (the only subpackage that imports SGLang). Importing this package imports
nothing from SGLang.
"""

__version__ = "0.1.0"
