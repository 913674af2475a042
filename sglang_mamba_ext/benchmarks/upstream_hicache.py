"""SGLang 0.5.23's own host tier (``--enable-hierarchical-cache``) in the hit-rate benchmark:
not built yet. :func:`make_host_driver` raises :class:`~.common.VariantUnavailable` with
the reason, so the rows print "not available" instead of a number.
"""

from __future__ import annotations

def make_host_driver(base: str, kv_size: int, mamba_size: int, host_ratio: float, **kw):
    """SGLang's ``UnifiedRadixCache`` with its HiCache host tier over the strategy of
    ``upstream.<base>``.

    Raises:
        VariantUnavailable: always, for now (see the module docstring)."""
    from sglang_mamba_ext.benchmarks.common import VariantUnavailable

    raise VariantUnavailable(
        "SGLang's HiCache controller needs sgl_kernel's transfer ops and pinned host memory "
        "(CUDA); not driven on CPU yet"
    )
