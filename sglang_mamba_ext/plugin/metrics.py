"""Prometheus series of the hybrid cache under ``--enable-metrics`` (``docs/design.md``,
"Metrics"), and its ``mamba_radix`` entry in ``/server_info``.

SGLang 0.5.23 runs prometheus-client in multiprocess mode (``utils/common.py::
set_prometheus_multiproc_dir`` before the scheduler processes start; the HTTP server's
``/metrics`` aggregates the per-process files with ``MultiProcessCollector``). A collector
that reads the cache at scrape time would run in the HTTP process, which has no cache, so
:class:`MambaRadixMetricsCollector` holds ordinary ``Counter`` / ``Gauge`` objects in the
scheduler process, like SGLang's ``RadixCacheMetricsCollector``
(``observability/metrics_collector.py``), and :meth:`~MambaRadixMetricsCollector.sync`
moves them to the core's plain integer counters (``mem_cache/stats.py``,
``MambaRadixCache.stats_snapshot``) after each cache call that can change them. Names start
``sglang:mamba_radix_``; labels are SGLang's radix-cache rank labels (``tp_rank``,
``pp_rank``, ``dp_rank``) plus ``model_name`` and ``--extra-metric-labels``; gauges use
``multiprocess_mode="mostrecent"`` as SGLang's do. prometheus-client is imported only when a
collector is built (after SGLang set ``PROMETHEUS_MULTIPROC_DIR``).

The warm-up's series (``plugin/warmup.py``, run in the HTTP server's process) are
:func:`record_warmup`.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Optional, Tuple

from sglang_mamba_ext.mem_cache.stats import STATE_ORIGINS

PREFIX = "sglang:mamba_radix_"

#: ``(snapshot key, metric name, help)`` of the unlabelled counters.
COUNTERS: Tuple[Tuple[str, str, str], ...] = (
    ("matches", "matches_total", "Prefills admitted (their copy-on-write match counted once per admission)."),
    ("prompt_tokens", "prompt_tokens_total", "Prompt tokens of the admitted prefills."),
    (
        "kv_match_tokens",
        "kv_match_tokens_total",
        "Prompt tokens found as attention KV in the tree (with or without an SSM state at their end).",
    ),
    (
        "prefix_tokens",
        "prefix_tokens_total",
        "Prompt tokens usable as cache hits: KV plus the SSM state at their end (what cached_tokens reports).",
    ),
    ("cow_copies", "cow_copies_total", "Copy-on-write copies of a cached SSM state into a request's working slot."),
)
#: ``(snapshot key prefix, metric name, help)`` of the counters labelled ``kind``.
KIND_COUNTERS: Tuple[Tuple[str, str, str], ...] = (
    (
        "states_stored_",
        "checkpoints_total",
        "SSM states the tree took, by kind (ping_pong: SGLang's tracked checkpoint after a prefill chunk; "
        "chunk: chunk-end copy without tracking; branch; prompt_end: prompt length - 1; boundary: a message boundary; finish; insert: direct).",
    ),
    (
        "state_hits_",
        "checkpoint_hits_total",
        "Admitted prefills whose usable prefix ended on a state of that kind.",
    ),
)
#: ``(snapshot key, metric name, help)`` of the counters labelled ``policy``.
EVICTION_COUNTERS: Tuple[Tuple[str, str, str], ...] = (
    ("evicted_kv_tokens", "evicted_kv_tokens_total", "KV tokens freed by the hybrid cache's evictions (all causes)."),
    (
        "evicted_ssm_states",
        "evicted_ssm_states_total",
        "SSM states freed by the hybrid cache's evictions (tombstoned nodes and removed leaves).",
    ),
)
#: ``(snapshot key, metric name, help)`` of the gauges.
GAUGES: Tuple[Tuple[str, str, str], ...] = (
    ("kv_tokens", "kv_tokens", "KV tokens held by the tree."),
    ("ssm_states", "ssm_states", "SSM states held by the tree."),
    ("tombstones", "tombstones", "Tree nodes holding KV but no SSM state."),
)
#: Warm-up series (``plugin/warmup.py``): ``(result key, metric name, help)``.
WARMUP_COUNTERS: Tuple[Tuple[str, str, str], ...] = (
    ("prompts", "warmup_prompts_total", "Prompts the kda_cache warm-up prefilled into the cache."),
    ("tokens", "warmup_tokens_total", "Prompt tokens the kda_cache warm-up prefilled into the cache."),
    (
        "second_pass_cached_tokens",
        "warmup_hit_tokens_total",
        "Tokens the warm-up's second pass found cached (its check that the prompts stayed in the cache).",
    ),
)

# One set of metric families per (registry, label names): prometheus-client refuses a
# second family of the same name in a registry.
_FAMILIES: Dict[Tuple[int, Tuple[str, ...], str], Dict[str, Any]] = {}


def _families(labelnames: Tuple[str, ...], registry, group: str) -> Dict[str, Any]:
    from prometheus_client import REGISTRY, Counter, Gauge

    registry = REGISTRY if registry is None else registry
    key = (id(registry), labelnames, group)
    found = _FAMILIES.get(key)
    if found is not None:
        return found
    fam: Dict[str, Any] = {}
    if group == "cache":
        for _, name, doc in COUNTERS:
            fam[name] = Counter(PREFIX + name, doc, labelnames, registry=registry)
        for _, name, doc in KIND_COUNTERS:
            fam[name] = Counter(PREFIX + name, doc, labelnames + ("kind",), registry=registry)
        for _, name, doc in EVICTION_COUNTERS:
            fam[name] = Counter(PREFIX + name, doc, labelnames + ("policy",), registry=registry)
        for _, name, doc in GAUGES:
            fam[name] = Gauge(PREFIX + name, doc, labelnames, registry=registry, multiprocess_mode="mostrecent")
    else:
        for _, name, doc in WARMUP_COUNTERS:
            fam[name] = Counter(PREFIX + name, doc, labelnames, registry=registry)
    _FAMILIES[key] = fam
    return fam


class MambaRadixMetricsCollector:
    """The hybrid cache's series for one cache (module docstring).

    Args:
        labels: label values of every series (:func:`cache_metric_labels` in a server).
        policy: the ``policy`` label of the eviction counters (``lru`` / ``recompute``).
        registry: prometheus-client registry (default: its global ``REGISTRY``, the one
            SGLang's multiprocess mode writes through).
    """

    def __init__(self, labels: Dict[str, Any], policy: str, registry=None):
        labels = {k: str(v) for k, v in labels.items()}
        fam = _families(tuple(labels), registry, "cache")
        self.labels = labels
        self._counters: List[Tuple[str, Any]] = []
        for key, name, _ in COUNTERS:
            self._counters.append((key, fam[name].labels(**labels)))
        for prefix, name, _ in KIND_COUNTERS:
            for origin in STATE_ORIGINS:
                self._counters.append((prefix + origin, fam[name].labels(**labels, kind=origin)))
        for key, name, _ in EVICTION_COUNTERS:
            self._counters.append((key, fam[name].labels(**labels, policy=policy)))
        self._gauges = [(key, fam[name].labels(**labels)) for key, name, _ in GAUGES]
        self._last: Dict[str, int] = {}

    def sync(self, snapshot: Dict[str, int]) -> None:
        """Advance every counter by what ``snapshot`` (``MambaRadixCache.stats_snapshot()``)
        gained since the last call and set the gauges. The first call exports the totals so
        far."""
        last = self._last
        for key, child in self._counters:
            value = snapshot[key]
            delta = value - last.get(key, 0)
            if delta > 0:
                child.inc(delta)
                last[key] = value
        for key, child in self._gauges:
            value = snapshot[key]
            if last.get(key) != value:
                child.set(value)
                last[key] = value


def cache_metric_labels(cache_type: str) -> Dict[str, Any]:
    """Labels of the scheduler-side series: ``model_name`` (``--served-model-name``) and
    SGLang's radix-cache rank labels (``radix_cache_metric_labels``: ``tp_rank``,
    ``pp_rank``, ``dp_rank``; attention ranks under DP attention) plus
    ``--extra-metric-labels``. Needs the scheduler's published runtime context."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled
    from sglang.srt.observability.metrics_collector import radix_cache_metric_labels
    from sglang.srt.runtime_context import get_observability, get_parallel, get_serving

    labels: Dict[str, Any] = {"model_name": get_serving().served_model_name}
    ranks = radix_cache_metric_labels(cache_type, get_parallel(), is_dp_attention_enabled())
    ranks.pop("cache_type", None)
    labels.update(ranks)
    extra = get_observability().extra_metric_labels
    if extra:
        labels.update(extra)
    return labels


def record_warmup(result: Dict[str, int], model_name: str, extra_labels: Optional[Dict[str, str]] = None, registry=None) -> None:
    """Add the ``kda_cache`` warm-up's result (``plugin/warmup.py``: ``prompts``,
    ``tokens``, ``second_pass_cached_tokens``) to its counters, labelled ``model_name``
    (and ``--extra-metric-labels``)."""
    labels = {"model_name": str(model_name)}
    if extra_labels:
        labels.update({k: str(v) for k, v in extra_labels.items()})
    fam = _families(tuple(labels), registry, "warmup")
    for key, name, _ in WARMUP_COUNTERS:
        child = fam[name].labels(**labels)
        value = int(result.get(key, 0) or 0)
        if value > 0:
            child.inc(value)


def cache_server_info(cache) -> dict:
    """The ``mamba_radix`` entry of ``/server_info`` (:func:`server_info_after`) of the cache
    adapter ``cache`` (``plugin/cache.py``): its settings, its current sizes (KV in tokens, SSM
    in slots) and the counters of ``MambaRadixCache.stats_snapshot``; plain ints, strings and
    bools."""
    from sglang_mamba_ext.plugin import pd_decode
    from sglang_mamba_ext.plugin.cache import _kv_bytes_per_token
    from sglang_mamba_ext.plugin.inchunk_checkpoints import CHECKPOINT_COUNTERS
    from sglang_mamba_ext.plugin.settings import BACKEND_NAME

    core = cache.core
    pool = cache.req_to_token_pool
    ckpt = core.mamba_ckpt_pool
    host = core.mamba_host_pool
    return {
        "backend": BACKEND_NAME,
        "page_size": core.page_size,
        "mamba_track_interval": core.mamba_track_interval,
        "checkpoint_grid": cache.checkpoint_grid,
        "ping_pong_tracking": bool(cache.enable_mamba_extra_buffer),
        "exact_prefix_checkpoints": bool(pool.prefix_checkpoint_writer and core.branch_checkpoints),
        "finish_state": core.finish_state,
        "eviction_policy": core.eviction_policy,
        "max_states_per_path": core.max_states_per_path,
        "kv_slots_total": int(getattr(cache.token_to_kv_pool_allocator, "size", 0) or 0),
        "kv_slots_free": int(cache.token_to_kv_pool_allocator.available_size()),
        "kv_evictable_tokens": core.full_evictable_size(),
        "kv_protected_tokens": core.full_protected_size(),
        "ssm_slots_total": pool.core_mamba_pool.size,
        "ssm_slots_free": pool.core_mamba_pool.available_size(),
        "ssm_evictable_states": core.mamba_evictable_size(),
        "ssm_protected_states": core.mamba_protected_size(),
        # --enable-linear-replayssm: decode-ring records folded before the tree took a state
        "replayssm_records_folded": cache.replayssm_records_folded,
        "finish_states_donated_early": cache.finish_states_donated_early,  # plugin/overlap_publish.py
        **{n: int(pool.__dict__.get(n, 0)) for n in CHECKPOINT_COUNTERS},  # plugin/inchunk_checkpoints.py
        # int8 checkpoints (--enable-int8-mamba-checkpoint): the tree's states are here,
        # not in the SSM slots above; 0 without the flag
        "int8_ckpt_slots_total": ckpt.size if ckpt is not None else 0,
        "int8_ckpt_slots_free": ckpt.available_size() if ckpt is not None else 0,
        "ssm_state_bytes": core.state_pool.slot_bytes(),
        # host tier (--enable-hierarchical-cache): SSM states in host memory; 0 without
        "host_ssm_slots_total": host.size if host is not None else 0,
        "host_ssm_slots_free": host.available_size() if host is not None else 0,
        "host_ssm_states": core.host_states(),
        "host_backups": core.host_backups_total,
        "host_loads": core.host_loads_total,
        "host_demotions": core.host_demotions_total,
        "host_evicted": core.host_evicted_total,
        # host tier of attention KV (tokens)
        "host_kv_tokens_total": core.kv_host_pool.size if core.kv_host_pool is not None else 0,
        "host_kv_tokens": core.host_kv_tokens(),
        "host_kv_demoted": core.host_kv_demoted_total,
        "host_kv_loaded": core.host_kv_loaded_total,
        "host_kv_evicted": core.host_kv_evicted_total,
        # storage tier (--hicache-storage-backend): states / KV pages written, prefixes
        # read back, values that failed their check (read as misses)
        "storage_states_written": core.storage_states_written_total,
        "storage_kv_pages_written": core.storage_kv_pages_written_total,
        "storage_loads": core.storage_loads_total,
        "storage_kv_pages_loaded": core.storage_kv_pages_loaded_total,
        "storage_rejected": core.storage_rejected_total,
        # ... and, behind the guard of a store that can become unreachable (mooncake): calls
        # answered as a miss or a dropped write while it was, times it went and came back
        "storage_unavailable": getattr(core.storage, "unavailable_total", 0),
        "storage_outages": getattr(core.storage, "outages_total", 0),
        "storage_recoveries": getattr(core.storage, "recoveries_total", 0),
        # --enable-session-radix-cache: states open sessions pin (evicted last)
        "session_pins": len(core.pinned_nodes()),
        # PD decode server: prefix held, KV tokens and bytes asked of the prefill server
        **pd_decode.server_info_fields(cache, _kv_bytes_per_token(cache.token_to_kv_pool_allocator),
                                       core.state_pool.slot_bytes()),
        **core.stats_snapshot(),
        # --enable-lmcache (plugin/lmcache_connector.py): lookups, loads, stores; absent without
        **({f"lmcache_{k}": v for k, v in cache.lmcache.info().items()}
           if getattr(cache, "lmcache", None) is not None else {}),
    }


def server_info_after(result, controller, *args, **kwargs):
    """AFTER hook on ``managers.scheduler_components.internal_state.
    SchedulerInternalStateController.get_internal_state``: under ``--enable-mamba-radix``
    the scheduler's internal state (one per DP rank in ``/server_info``'s
    ``internal_states``) gets a ``mamba_radix`` entry (``MambaRadixCacheAdapter.
    server_info``: settings, sizes, counters); otherwise the result is SGLang's."""
    from sglang_mamba_ext.plugin.cache import MambaRadixCacheAdapter

    cache = getattr(getattr(controller, "scheduler", None), "tree_cache", None)
    state = getattr(result, "internal_state", None)
    if isinstance(cache, MambaRadixCacheAdapter) and isinstance(state, dict):
        state["mamba_radix"] = cache.server_info()
    return result


def iter_series_names() -> Iterable[str]:
    """Every series name this module defines (documentation and tests)."""
    for group in (COUNTERS, KIND_COUNTERS, EVICTION_COUNTERS, GAUGES, WARMUP_COUNTERS):
        for _, name, _ in group:
            yield PREFIX + name
