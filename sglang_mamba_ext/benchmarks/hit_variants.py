"""The variants of the hit-rate benchmark (:mod:`.hit_rate`, whose docstring describes each
row): one factory per row, building the driver of SGLang's cache, of this project's cache, of
an offline oracle or of the upper bound, and the rows at equal device bytes (int8 checkpoints
and host tiers on both sides: :func:`int8_split`, :data:`HOST_RATIO`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from sglang_mamba_ext.benchmarks.common import CacheDriver, TraceRecord


# ------------------------------------------------------------------------- variants


def _upstream(driver_cls: str, name: str, **kw) -> Callable[[int, int], CacheDriver]:
    """The factory of an upstream variant: ``upstream.<driver_cls>(kv_size, mamba_size,
    **kw)`` labelled ``name``."""

    def factory(kv_size: int, mamba_size: int) -> CacheDriver:
        from sglang_mamba_ext.benchmarks import upstream

        d = getattr(upstream, driver_cls)(kv_size, mamba_size, **kw)
        d.name = name
        return d

    return factory


def _ours(name: str, overlap: bool = False, **kw) -> Callable[[int, int], CacheDriver]:
    """The factory of one of this project's variants: ``ours.OursDriver(kv_size,
    mamba_size, name=name, **kw)`` (``OursOverlapDriver`` with ``overlap``)."""

    def factory(kv_size: int, mamba_size: int) -> CacheDriver:
        from sglang_mamba_ext.benchmarks.ours import OursDriver, OursOverlapDriver

        cls = OursOverlapDriver if overlap else OursDriver
        return cls(kv_size, mamba_size, name=name, **kw)

    return factory


def _oracle(name: str, **kw) -> Callable[..., CacheDriver]:
    """The factory of an offline-oracle variant: ``oracle.OracleDriver(kv_size, mamba_size,
    records, name=name, **kw)`` (it needs the whole trace it will replay)."""

    def factory(kv_size: int, mamba_size: int, records: Sequence[TraceRecord]) -> CacheDriver:
        from sglang_mamba_ext.benchmarks.oracle import OracleDriver

        return OracleDriver(kv_size, mamba_size, records, name=name, **kw)

    return factory


def _bound(name: str = "upper-bound-lp") -> Callable[..., CacheDriver]:
    """The factory of the upper-bound row: ``upper_bound.UpperBoundDriver(kv_size,
    mamba_size, records)`` (it solves the program for the whole trace when built)."""

    def factory(kv_size: int, mamba_size: int, records: Sequence[TraceRecord]) -> CacheDriver:
        from sglang_mamba_ext.benchmarks.upper_bound import UpperBoundDriver

        return UpperBoundDriver(kv_size, mamba_size, records, name=name)

    return factory


# ------------------------------------------------------------- equal device bytes
#: One served model's linear-attention state, to weigh an int8 cached state against a
#: full-precision one: Qwen3-Next's Gated DeltaNet layer (32 value heads of 128 x 128, bf16;
#: conv window of 3 tokens over 8,192 channels, bf16). Per layer, in bytes.
INT8_REFERENCE_STATE = dict(heads=32, d_k=128, d_v=128, conv_channels=8192, conv_window=3, dtype_bytes=2)
#: Active (full-precision) SSM slots an int8 row keeps for running requests: one request at
#: a time holds at most 3 (a working slot and two ping-pong or planned checkpoint slots).
INT8_ACTIVE_SLOTS = 4


def int8_state_bytes_ratio(shape: dict = INT8_REFERENCE_STATE) -> float:
    """Bytes of one int8 cached state (int8 data, one scale per (head, k-channel) in the
    state's dtype, the conv window at its dtype: SGLang's ``MambaCheckpointPool`` layout)
    over one full-precision state."""
    h, dk, dv, b = shape["heads"], shape["d_k"], shape["d_v"], shape["dtype_bytes"]
    conv = shape["conv_channels"] * shape["conv_window"] * b
    return (h * dk * dv + h * dk * b + conv) / (h * dk * dv * b + conv)


def int8_split(mamba_size: int) -> tuple[int, int]:
    """``(active slots, int8 checkpoint slots)`` holding at most the device bytes of
    ``mamba_size`` full-precision slots: :data:`INT8_ACTIVE_SLOTS` active, the rest int8."""
    active = min(INT8_ACTIVE_SLOTS, mamba_size)
    return active, int((mamba_size - active) / int8_state_bytes_ratio())


def _upstream_int8(driver_cls: str, name: str, **kw) -> Callable[[int, int], CacheDriver]:
    """An upstream variant with SGLang's int8 checkpoints at the device bytes of
    ``mamba_size`` full-precision slots (:func:`int8_split`)."""

    def factory(kv_size: int, mamba_size: int) -> CacheDriver:
        from sglang_mamba_ext.benchmarks import upstream

        active, slots = int8_split(mamba_size)
        cls = type(driver_cls + "Int8", (getattr(upstream, driver_cls),), {"int8_slots": slots})
        d = cls(kv_size, active, **kw)
        d.name = name
        return d

    return factory


def _upstream_host(base: str, name: str, **kw) -> Callable[[int, int], CacheDriver]:
    """An upstream variant with SGLang's own host tier (``--enable-hierarchical-cache``,
    ``--hicache-ratio`` :data:`HOST_RATIO`) at the same device slots:
    :func:`.upstream_hicache.make_host_driver` (``base`` names the strategy's driver)."""

    def factory(kv_size: int, mamba_size: int) -> CacheDriver:
        from sglang_mamba_ext.benchmarks import upstream_hicache

        d = upstream_hicache.make_host_driver(base, kv_size, mamba_size, HOST_RATIO, **kw)
        d.name = name
        return d

    return factory


def _ours_int8(name: str, host: bool = False, **kw) -> Callable[[int, int], CacheDriver]:
    """One of this project's variants with int8 checkpoints at the device bytes of
    ``mamba_size`` full-precision slots (:func:`int8_split`); with ``host``, a host tier of
    int8 states at the host bytes of the full-precision host rows (:data:`HOST_RATIO` x
    ``mamba_size`` full-precision states: the plugin sizes its tier by ``--hicache-ratio`` x
    ``--max-mamba-cache-size``, the active slots here, in full-precision bytes)."""

    def factory(kv_size: int, mamba_size: int) -> CacheDriver:
        from sglang_mamba_ext.benchmarks.ours import OursDriver

        active, slots = int8_split(mamba_size)
        if host:
            kw["host_ratio"] = HOST_RATIO * mamba_size / active
        return OursDriver(kv_size, active, name=name, int8_slots=slots, **kw)

    return factory


#: ``--hicache-ratio`` of the host-tier rows: host states per device SSM slot (SGLang's default).
HOST_RATIO = 2.0


#: upstream variants SGLang can serve on a CPU device (no_buffer); see the docstring.
NO_BUFFER_VARIANTS = ("upstream-nobuf", "upstream-nobuf-ckpt")


@dataclasses.dataclass(frozen=True)
class Variant:
    side: str  # "upstream", "ours", "oracle" or "bound" (the last two's factory also takes the records);
    # "upstream-bytes" / "ours-bytes": int8 rows at equal device bytes, only in bytes_hit_ratio
    factory: Callable[..., CacheDriver]
    doc: str


VARIANTS: dict[str, Variant] = {
    "upstream-nobuf": Variant(
        "upstream", _upstream("UpstreamDriver", "upstream-nobuf"), "SGLang no_buffer, README op list"
    ),
    "upstream-nobuf-ckpt": Variant(
        "upstream",
        _upstream("UpstreamDriver", "upstream-nobuf-ckpt", prompt_checkpoint=True),
        "SGLang no_buffer + post-prefill checkpoint (its real scheduler)",
    ),
    "upstream-xbuf": Variant(
        "upstream",
        _upstream("UpstreamExtraBufferDriver", "upstream-xbuf"),
        "SGLang extra_buffer, 2 ping-pong slots (overlap), track interval 256",
    ),
    "upstream-xbuf-1pp": Variant(
        "upstream",
        _upstream("UpstreamExtraBufferDriver", "upstream-xbuf-1pp", enable_overlap_schedule=False),
        "SGLang extra_buffer, 1 ping-pong slot (--disable-overlap-schedule)",
    ),
    "ours-lru": Variant("ours", _ours("ours-lru"), "MambaRadixCache, LRU"),
    "ours-branch-lru": Variant(
        "ours", _ours("ours-branch-lru", prefix_checkpoints=True), "MambaRadixCache, branch-point checkpoints + LRU"
    ),
    "ours-branch-recompute": Variant(
        "ours",
        _ours("ours-branch-recompute", prefix_checkpoints=True, eviction_policy="recompute"),
        "MambaRadixCache, branch-point checkpoints + recompute-aware eviction",
    ),
    "ours-branch-adaptive": Variant(
        "ours",
        _ours("ours-branch-adaptive", prefix_checkpoints=True, eviction_policy="adaptive"),
        "MambaRadixCache, branch-point checkpoints + adaptive eviction (hit expectations learned per state class)",
    ),
    "ours-branch-lru-overlap": Variant(
        "ours",
        _ours("ours-branch-lru-overlap", overlap=True, prefix_checkpoints=True),
        "ours-branch-lru under overlap scheduling's timing (finish one batch late)",
    ),
    "ours-branch-adaptive-overlap": Variant(
        "ours",
        _ours("ours-branch-adaptive-overlap", overlap=True, prefix_checkpoints=True, eviction_policy="adaptive"),
        "ours-branch-adaptive under overlap scheduling's timing (finish one batch late)",
    ),
    "ours-default": Variant(
        "ours",
        _ours("ours-default", defaults=True),
        "MambaRadixCache with what --enable-mamba-radix alone selects (policy, strategy, checkpoints), "
        "--disable-overlap-schedule",
    ),
    "ours-default-overlap": Variant(
        "ours",
        _ours("ours-default-overlap", overlap=True, defaults=True, finish_by_length=True),
        "ours-default with overlap scheduling on (its default) and its timing, requests ending by length "
        "(final states donated before the next batch)",
    ),
    "ours-default-overlap-stop": Variant(
        "ours",
        _ours("ours-default-overlap-stop", overlap=True, defaults=True),
        "ours-default-overlap with requests ending on a stop token (finish one batch late)",
    ),
    "oracle-belady": Variant(
        "oracle",
        _oracle("oracle-belady"),
        "MambaRadixCache, branch-point checkpoints, offline Belady victims (deeper states shadow)",
    ),
    "oracle-belady-cost": Variant(
        "oracle",
        _oracle("oracle-belady-cost", weighted=True),
        "MambaRadixCache, branch-point checkpoints, offline victims by recompute saved per request-distance",
    ),
    "oracle-belady-naive": Variant(
        "oracle",
        _oracle("oracle-belady-naive", shadowing=False),
        "MambaRadixCache, branch-point checkpoints, offline Belady victims (every extension a use)",
    ),
    "upstream-nobuf-ckpt-int8": Variant(
        "upstream-bytes",
        _upstream_int8("UpstreamDriver", "upstream-nobuf-ckpt-int8", prompt_checkpoint=True),
        "upstream-nobuf-ckpt with SGLang's int8 checkpoints, same device bytes",
    ),
    "upstream-xbuf-int8": Variant(
        "upstream-bytes",
        _upstream_int8("UpstreamExtraBufferDriver", "upstream-xbuf-int8"),
        "upstream-xbuf with SGLang's int8 checkpoints, same device bytes",
    ),
    "ours-branch-lru-int8": Variant(
        "ours-bytes",
        _ours_int8("ours-branch-lru-int8", prefix_checkpoints=True),
        "ours-branch-lru with int8 checkpoints (--enable-int8-mamba-checkpoint), same device bytes",
    ),
    "ours-branch-adaptive-int8": Variant(
        "ours-bytes",
        _ours_int8("ours-branch-adaptive-int8", prefix_checkpoints=True, eviction_policy="adaptive"),
        "ours-branch-adaptive with int8 checkpoints, same device bytes",
    ),
    "upstream-xbuf-host": Variant(
        "upstream-bytes",
        _upstream_host("UpstreamExtraBufferDriver", "upstream-xbuf-host"),
        "upstream-xbuf with SGLang's host tier (HiCache, ratio 2), same device bytes",
    ),
    "upstream-nobuf-ckpt-host": Variant(
        "upstream-bytes",
        _upstream_host("UpstreamDriver", "upstream-nobuf-ckpt-host", prompt_checkpoint=True),
        "upstream-nobuf-ckpt with SGLang's host tier (HiCache, ratio 2), same device bytes",
    ),
    "ours-branch-lru-host": Variant(
        "ours-bytes",
        _ours("ours-branch-lru-host", prefix_checkpoints=True, host_ratio=HOST_RATIO),
        "ours-branch-lru with a host tier of SSM states (--enable-hierarchical-cache, ratio 2), same device bytes",
    ),
    "ours-branch-adaptive-host": Variant(
        "ours-bytes",
        _ours("ours-branch-adaptive-host", prefix_checkpoints=True, eviction_policy="adaptive", host_ratio=HOST_RATIO),
        "ours-branch-adaptive with a host tier of SSM states (--enable-hierarchical-cache, ratio 2), same device bytes",
    ),
    "ours-branch-adaptive-int8-host": Variant(
        "ours-bytes",
        _ours_int8("ours-branch-adaptive-int8-host", host=True, prefix_checkpoints=True, eviction_policy="adaptive"),
        "ours-branch-adaptive-int8 with a host tier of int8 states (--enable-hierarchical-cache), same device "
        "bytes and the host bytes of the ratio-2 host rows",
    ),
    "upper-bound-lp": Variant(
        "bound",
        _bound(),
        "upper bound on any eviction and placement of states (min-cost-flow LP, .upper_bound)",
    ),
}
