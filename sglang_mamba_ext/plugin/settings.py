"""Names shared by the plugin's hooks, and the plugin's settings carried on ``ServerArgs``.

``--enable-mamba-radix`` becomes ``ServerArgs.radix_cache_backend = BACKEND_NAME`` (an
existing SGLang field: every process reads it as ``get_memory().radix_cache_backend``) plus
an extra attribute ``ServerArgs._mamba_radix_ext`` (a dict) holding the plugin's own
settings; the attribute exists only when ``--enable-mamba-radix`` or
``--warmup-prompts-file`` was given (:func:`settings_of` reads ``{}`` otherwise), so a launch
without the plugin's flags keeps SGLang's record unchanged (``docs/design.md``, "SGLang
wiring"). ``ServerArgs`` is a msgspec Struct with ``dict=True``: an undeclared underscore
attribute lives in ``__dict__``, is exempt from the resolution seal and survives the pickling
that hands ``ServerArgs`` to the scheduler processes (``ServerArgs.__reduce__``).
"""

from __future__ import annotations

from typing import Any, Dict

#: ``--radix-cache-backend`` name under which the adapter's factory is registered.
BACKEND_NAME = "mamba_radix_ext"
#: Name of the warmup registered with ``sglang.srt.entrypoints.warmup.warmup``.
WARMUP_NAME = "kda_cache"
#: ``rid`` prefix of the ``kda_cache`` warmup's requests. On a prefill server
#: (``--disaggregation-mode prefill``) they carry SGLang's fake bootstrap host, which makes
#: SGLang bar them from the tree (``Req.skip_radix_cache_insert``); the adapter lets these
#: ones in (``plugin/cache.py::MambaRadixCacheAdapter.match_prefix``).
WARMUP_RID_PREFIX = "mamba-radix-warmup-"
#: Extra ``ServerArgs`` attribute with the plugin's settings.
SETTINGS_ATTR = "_mamba_radix_ext"
#: ``--radix-eviction-policy`` value added by the plugin: the core cache's recompute-aware
#: SSM eviction (``MambaRadixCache(eviction_policy="recompute")``).
RECOMPUTE_POLICY = "recompute"
#: ``--radix-eviction-policy`` value added by the plugin: the core cache's adaptive SSM
#: eviction (recompute-aware, with hit expectations learned per class of states;
#: ``MambaRadixCache(eviction_policy="adaptive")``).
ADAPTIVE_POLICY = "adaptive"
#: ``--radix-eviction-policy`` values the plugin adds to SGLang's choices.
PLUGIN_POLICIES = (RECOMPUTE_POLICY, ADAPTIVE_POLICY)
#: ``--radix-eviction-policy`` values the plugin's cache accepts.
SUPPORTED_POLICIES = ("lru",) + PLUGIN_POLICIES
#: The policy ``--enable-mamba-radix`` selects when ``--radix-eviction-policy`` is not given:
#: the best hit rate of the cache's policies on every hit-rate workload (docs/benchmarks.md).
DEFAULT_POLICY = ADAPTIVE_POLICY

# Settings of this process's last ``from_cli_args`` (the launcher, which also runs the
# HTTP server and its warmups); used when ``get_server_args()`` is not published yet.
_last_settings: Dict[str, Any] = {}


def settings_of(server_args) -> Dict[str, Any]:
    """The plugin's settings dict on a ``ServerArgs`` (empty if none)."""
    if server_args is None:
        return {}
    return dict(getattr(server_args, "__dict__", {}).get(SETTINGS_ATTR, {}) or {})


def current_settings() -> Dict[str, Any]:
    """The plugin's settings in this process: from the published ``ServerArgs``
    (``sglang.srt.runtime_context.get_server_args``), else from this process's last
    ``from_cli_args``."""
    try:
        from sglang.srt.runtime_context import get_server_args

        found = settings_of(get_server_args())
    except Exception:  # not published in this process
        found = {}
    return found or dict(_last_settings)


def remember(settings: Dict[str, Any]) -> None:
    """Keep ``settings`` as this process's last parsed settings (:func:`current_settings`)."""
    _last_settings.clear()
    _last_settings.update(settings)
