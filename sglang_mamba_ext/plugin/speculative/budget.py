"""SGLang's memory budget under ``--mamba-spec-state-update deferred`` (issue 15, item 1).

SGLang sizes the Mamba/SSM pool and the KV pool in
``KVCacheConfigurator._handle_max_mamba_cache`` (``mem_cache/kv_cache_configurator.py``):
with speculative decoding it charges, per request row (``max_running_requests + 1`` rows,
capped by the Mamba slots), ``stage_per_req * D`` bytes for the snapshot buffers
``intermediate_ssm`` / ``intermediate_conv_window`` (``stage_per_req``: one slot's conv + SSM
state over the stage's linear layers; ``D = speculative_num_draft_tokens``). In every one of
its three branches (``--max-mamba-cache-size`` given; radix cache off with
``--max-running-requests``; automatic split by ``--mamba-full-memory-ratio``) that charge is
the product ``stage_per_req * D`` and nothing else reads ``D``.

In deferred mode the Mamba pool holds no snapshot buffers; the hook of ``MambaPool.__init__``
(:func:`.hooks.mamba_pool_init_around`) gives it a
:class:`~sglang_mamba_ext.speculative.deferred.DeferredSpecState` instead: stash, pending
workspace and one-layer verify buffers, all preallocated and all proportional to the rows.
:func:`handle_max_mamba_cache_around` runs SGLang's own method with ``D`` replaced, for that
call only (``get_spec().override``), by ``row_bytes / stage_per_req``, so every branch charges
the deferred state's real ``row_bytes`` per row instead of the snapshot's; whatever the
snapshot would have taken is left to SGLang's own split: more Mamba slots, hence a higher
``max_running_requests`` cap, and more KV tokens. ``row_bytes`` is measured, not re-derived: the
hook builds a one-row and a two-row pool on the ``meta`` device through
:func:`.hooks.mamba_pool_init_around` and reads ``DeferredSpecState.nbytes()``
(a size-independent part, zero today, is charged once).

User-given ``--max-running-requests`` and ``--max-mamba-cache-size`` keep their meaning: SGLang
still applies them (the first caps the rows and ``max_running_requests``, the second fixes the
Mamba slots; only the reserve behind them shrinks). Without the flag, for a draft worker, on a
PD prefill rank (no speculative buffers) or without speculative decoding the hook returns
SGLang's result untouched.

Not covered: the unified memory pool (``--enable-unified-memory``; sized elsewhere) and the
post-capture KV resize on CUDA (it resizes the KV pool only, after this split).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Tuple

from sglang_mamba_ext.plugin.speculative import hooks

logger = logging.getLogger(__name__)

__all__ = ["TARGET", "deferred_row_bytes", "deferred_draft_token_equivalent", "handle_max_mamba_cache_around"]

TARGET = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._handle_max_mamba_cache"


@contextlib.contextmanager
def _quiet(name: str):
    lg = logging.getLogger(name)
    was = lg.disabled
    lg.disabled = True
    try:
        yield
    finally:
        lg.disabled = was


def deferred_row_bytes(cache_params: Any, num_layers: int, draft_token_num: int, eagle_topk: Any = None) -> Tuple[int, int]:
    """``(per_row, fixed)`` bytes of the deferred state a ``MambaPool`` of ``num_layers`` linear
    layers gets: ``per_row`` per request row (``spec_state_size + 1`` rows), ``fixed`` once.

    Measured by building the pool with one and two rows on the ``meta`` device through
    :func:`.hooks.mamba_pool_init_around` (needs SGLang's runtime context: the hook reads
    ``--mamba-spec-state-update`` and ``--speculative-num-steps`` from it) and summing
    ``DeferredSpecState.nbytes()``.

    Raises:
        hooks.DeferredSpecConfigError: the hook refuses this model (e.g. an unsupported
            linear-attention kind).
    """
    from sglang.srt.mem_cache.memory_pool import MambaPool

    total = []
    for spec_state_size in (0, 1):
        pool = MambaPool.__new__(MambaPool)
        with _quiet(hooks.__name__), _quiet(MambaPool.__module__):  # no pool-allocated log lines for a probe
            hooks.mamba_pool_init_around(
                MambaPool.__init__, pool, size=1, spec_state_size=spec_state_size, cache_params=cache_params,
                mamba_layer_ids=list(range(num_layers)), device="meta",
                speculative_num_draft_tokens=draft_token_num, speculative_eagle_topk=eagle_topk,
            )
        state = getattr(pool, hooks.POOL_ATTR, None)
        if state is None:  # the hook left the pool as SGLang builds it
            raise hooks.DeferredSpecConfigError(
                f"{hooks.FLAG} deferred: the Mamba pool hook built no deferred state (is the flag in the runtime context?)"
            )
        total.append(sum(state.nbytes().values()))
    one, two = total
    return two - one, 2 * one - two


def _stage_layers(conf: Any, all_layers: list) -> int:
    """Linear layers of the largest pipeline stage (what SGLang charges every rank for)."""
    if conf.pp_size <= 1 or not all_layers:
        return len(all_layers)
    from sglang.srt.distributed.utils import get_pp_indices

    n = conf.model_config.num_hidden_layers
    return max(sum(1 for i in all_layers if s <= i < e)
               for s, e in (get_pp_indices(n, r, conf.pp_size) for r in range(conf.pp_size)))


def deferred_draft_token_equivalent(conf: Any) -> Tuple[float, int, int, int]:
    """``(D_eff, row_bytes, fixed_bytes, stage_per_req)`` for configurator ``conf``:
    SGLang's snapshot charge per row is ``stage_per_req * D``; the deferred one is
    ``row_bytes = stage_per_req * D_eff`` (``D_eff`` a float)."""
    from sglang.srt.runtime_context import get_spec, max_speculative_num_draft_tokens

    cp = conf.mambaish_config.mamba2_cache_params
    all_layers = list(cp.layers)
    fused = conf.fused_entry_bytes("mamba")
    per_req = cp.mamba_cache_per_req if fused is None else fused
    n_stage = _stage_layers(conf, all_layers)
    stage_per_req = int(per_req * (n_stage / max(len(all_layers), 1)))
    T = max_speculative_num_draft_tokens() or get_spec().speculative_num_draft_tokens
    # the pool hook builds the state in the target backend's layout (KDA / GDN / tiny), which
    # SGLang's _init_pools hook records only after this budget: record it now, the same way
    hooks.configurator_init_pools_before(conf)
    row, fixed = deferred_row_bytes(cp, n_stage, T, get_spec().speculative_eagle_topk)
    return row / stage_per_req, row, fixed, stage_per_req


def handle_max_mamba_cache_around(original, conf, total_rest_memory):
    """AROUND ``KVCacheConfigurator._handle_max_mamba_cache(total_rest_memory)`` (GB in, GB
    left for the KV pool out; sets ``max_mamba_cache_size``): in deferred mode, SGLang's
    method with the snapshot buffers' charge replaced by the deferred state's bytes (module
    docstring).

    Raises:
        hooks.DeferredSpecConfigError: the deferred pool hook refuses this model.
        RuntimeError: SGLang's own "not enough memory" errors.
    """
    if (hooks.mode(getattr(conf, "server_args", None)) != "deferred" or conf.is_draft_worker
            or conf.spec_algorithm.is_none()):
        return original(conf, total_rest_memory)
    from sglang.srt.mem_cache import kv_cache_configurator as kvc_mod
    from sglang.srt.runtime_context import get_exec, get_spec

    if kvc_mod._pd_prefill_skips_mamba_spec_state() or get_exec().mamba.enable_linear_replayssm_spec:
        return original(conf, total_rest_memory)
    d_eff, row, fixed, stage_per_req = deferred_draft_token_equivalent(conf)
    D = get_spec().speculative_num_draft_tokens
    logger.info(
        "%s deferred: budget charges %.2f MiB per request row for the deferred state instead of %.2f MiB "
        "for the snapshot buffers (%d draft tokens x %.2f MiB)", hooks.FLAG, row / 2**20,
        stage_per_req * D / 2**20, D, stage_per_req / 2**20,
    )
    with get_spec().override(speculative_num_draft_tokens=d_eff):
        return original(conf, total_rest_memory - fixed / (1 << 30))
