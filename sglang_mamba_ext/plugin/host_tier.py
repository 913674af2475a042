"""The host tier of ``--enable-hierarchical-cache`` under ``--enable-mamba-radix``
(``docs/design.md``, "Host tier"): building it from SGLang's flags onto the plugin's request
pool, and the stand-in KV host pool SGLang's host-tier metrics read (attention KV is not
offloaded). The tier's mechanism is the core's (``mem_cache/state_tiers.py``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


def attach_host_tier(pool) -> str:
    """``--enable-hierarchical-cache``: give the pool a host tier of SSM states
    (:class:`~sglang_mamba_ext.mem_cache.checkpoint_pool.HostStatePool`; ``docs/design.md``,
    "Host tier") sized by SGLang's ``--hicache-size`` (GiB) or ``--hicache-ratio`` (host
    states per device slot, default 2.0), page-locked where CUDA is available. Returns
    ``--hicache-write-policy``.

    Raises:
        ValueError: the sizes give no host slot."""
    from sglang.srt.runtime_context import get_memory

    from sglang_mamba_ext.mem_cache.checkpoint_pool import HostStatePool

    mem = get_memory()
    active = pool.core_mamba_pool
    probe = HostStatePool(1, active)
    if mem.hicache_size:
        slots = int(mem.hicache_size * (1 << 30)) // probe.slot_bytes()
        how = f"--hicache-size {mem.hicache_size} GiB"
    else:
        ratio = mem.hicache_ratio if mem.hicache_ratio is not None else 2.0
        slots = int(active.size * ratio)
        how = f"--hicache-ratio {ratio} x {active.size} device slots"
    if slots < 1:
        raise ValueError(f"--enable-hierarchical-cache: {how} holds no SSM state of {probe.slot_bytes()} bytes")
    pin = active.device.type == "cuda" and torch.cuda.is_available()
    host = HostStatePool(slots, active, pin_memory=pin)
    pool.core.mamba_host_pool = host
    logger.info(
        "sglang-mamba-ext: host tier of %d SSM states (%s, %.1f MiB, write policy %s)",
        slots, how, host.total_bytes() / (1 << 20), mem.hicache_write_policy,
    )
    return mem.hicache_write_policy


class _NoKVHostPool:
    logical_size = 0

    @staticmethod
    def available_size() -> int:
        return 0


#: What the adapter answers for SGLang's ``token_to_kv_pool_host`` (host-tier metrics).
NO_KV_HOST_POOL = _NoKVHostPool()
