"""SGLang 0.5.23's prefix-cache protocol (``mem_cache/base_prefix_cache.py::BasePrefixCache``)
spoken by the core :class:`~sglang_mamba_ext.mem_cache.MambaRadixCache`.

Registered as ``--radix-cache-backend mamba_radix_ext`` (:func:`build_tree_cache`), built by
``kv_cache_builder.build_kv_cache`` → ``registry.create_tree_cache``. The scheduler's calls,
and what each becomes (call paths: ``shared/design`` protocol report, ``docs/sglang-hooks.md``):

- ``match_prefix(MatchPrefixParams(key, cow_mamba, req))`` — from ``common.match_kv_cache``
  (admission), the cache-aware sort and ``touch_prefix``: the core's ``match_prefix`` on the
  key's raw tokens (``RadixKey.limit`` honoured) in the namespace
  ``(key.extra_key, key.cache_salt)``; with ``cow_mamba`` the core allocates the request's SSM
  slot and records the copy-on-write source on ``req.kv``; SGLang runs the copy at forward
  start (``ModelRunner._maybe_execute_deferred_mamba_cow_and_clear`` through this pool's
  ``copy_mamba_state``). ``mamba_branching_seqlen`` reports where the KV match goes past the
  deepest state, so the prefill checkpoints that point: on SGLang's checkpoint grid through
  its own tracking, or — when the linear-attention backend can write a state at any token
  (``MambaRadixReqToTokenPool.prefix_checkpoint_writer``, the tiny model's backend) —
  exactly, as a prefix checkpoint the pool plans with the core's
  ``plan_prefix_checkpoints`` when the request gets its row (with one more at prompt
  length - 1, so a resent identical prompt hits all but its last token).
- ``checkpoint(req, up_to=...)`` — after each prefill chunk and each completed prefill
  (``common.checkpoint_kv_cache``), and for a finished request from
  ``common.release_kv_cache``: the core's ``cache_unfinished_req`` (unfinished) or
  ``insert_finished_req`` (finished; SGLang then frees the row tail, unlocks and frees the
  row itself).
- ``on_release(req, checkpointed)`` — frees the SSM slots a request still holds (abort,
  retraction, release without checkpoint).
- ``evict`` / ``evict_for_alloc`` (KV and SSM shortfalls from ``alloc_token_slots``,
  ``ensure_mamba_capacity``), ``inc_lock_ref`` / ``dec_lock_ref`` (the base class builds
  ``lock`` / ``unlock`` from them; a core lock always takes both counts, so no receipt is
  needed), ``path_device_indices``, the size getters read by the scheduler's budget and its
  idle leak check (``invariant_checker``), ``reset`` (flush), ``sanity_check``,
  ``pretty_print``, ``all_values_flatten`` / ``all_mamba_values_flatten`` (leak dumps).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

import torch

from sglang.srt.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    DecLockRefParams,
    DecLockRefResult,
    EvictParams,
    EvictResult,
    IncLockRefResult,
    MatchPrefixParams,
    MatchResult,
)

from sglang_mamba_ext.mem_cache import MambaRadixCache
from sglang_mamba_ext.mem_cache import RadixKey as CoreRadixKey
from sglang_mamba_ext.plugin import req_bridge
from sglang_mamba_ext.plugin.pool import MambaRadixReqToTokenPool
from sglang_mamba_ext.plugin.settings import BACKEND_NAME

logger = logging.getLogger(__name__)


class MambaRadixCacheAdapter(BasePrefixCache):
    """``BasePrefixCache`` over the core cache (module docstring).

    Args:
        req_to_token_pool: the plugin's :class:`MambaRadixReqToTokenPool`.
        token_to_kv_pool_allocator: SGLang's KV allocator (``alloc`` / ``free`` /
            ``available_size``).
        page_size: tokens per KV page.
        mamba_track_interval: ``--mamba-track-interval`` (tokens).
        finish_state: what a finished request donates: ``"working"`` (its live state,
            exact without overlap scheduling) or ``"checkpoint"`` (its newest ping-pong
            checkpoint, safe under overlap scheduling).
        enable_mamba_extra_buffer: SGLang's checkpoint tracking runs (the pool has ping-pong
            slots).
        checkpoint_grid: tokens; ``mamba_branching_seqlen`` is reported on this grid
            (SGLang's ``mamba_checkpoint_grid(page_size)``).
        eviction_policy: ``--radix-eviction-policy``: ``"lru"`` or ``"recompute"`` (the
            core's recompute-aware SSM eviction).
        kv_bytes_per_token: bytes of one token's KV, weighed by the recompute policy.
        max_states_per_path: SGLang's ``--mamba-max-states-per-path`` (-1: no bound).
        enable_metrics: create SGLang's radix-cache metrics collector.

    Raises:
        TypeError: the pool is not the plugin's (the pool hook did not run).
    """

    def __init__(
        self,
        *,
        req_to_token_pool: MambaRadixReqToTokenPool,
        token_to_kv_pool_allocator: Any,
        page_size: int = 1,
        mamba_track_interval: int = 256,
        finish_state: str = "working",
        enable_mamba_extra_buffer: bool = True,
        checkpoint_grid: int = 1,
        enable_metrics: bool = False,
        eviction_policy: str = "lru",
        kv_bytes_per_token: int = 0,
        max_states_per_path: int = -1,
    ):
        if not isinstance(req_to_token_pool, MambaRadixReqToTokenPool):
            raise TypeError(
                f"--enable-mamba-radix: the request pool is {type(req_to_token_pool).__name__}, "
                "not MambaRadixReqToTokenPool (the pool hook on "
                "KVCacheConfigurator._build_hybrid_req_pool did not run)"
            )
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = False
        self.enable_mamba_extra_buffer = enable_mamba_extra_buffer
        self.checkpoint_grid = max(1, int(checkpoint_grid))
        self.device = req_to_token_pool.device
        self.core = MambaRadixCache(
            token_to_kv_pool_allocator,
            req_to_token_pool.core,
            page_size=page_size,
            mamba_track_interval=mamba_track_interval,
            finish_state=finish_state,
            eviction_policy=eviction_policy,
            kv_bytes_per_token=kv_bytes_per_token,
            max_states_per_path=max(int(max_states_per_path), 0),
            branch_checkpoints=True,
        )
        req_to_token_pool.tree_cache = self
        self._checked_version = None
        self._version = 0
        if enable_metrics:
            self.init_metrics_collector()

    # -- identity ----------------------------------------------------------------------
    @property
    def root_node(self):
        return self.core.root_node

    def supports_mamba(self) -> bool:
        return True

    def supports_swa(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return not self.disable

    def reset(self) -> None:
        """Drop the tree (``Scheduler.flush_cache`` clears the pools right after)."""
        self.core.reset()
        self._version += 1

    # -- match -------------------------------------------------------------------------
    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        key = params.key
        if getattr(key, "is_bigram", False):
            raise NotImplementedError("--enable-mamba-radix does not support EAGLE bigram keys")
        tokens = key.raw_token_ids()
        ns = req_bridge.namespace(key.extra_key, key.cache_salt)
        req = params.req
        cow = bool(params.cow_mamba) and req is not None
        creq = req_bridge.pull(req) if cow else None
        res = self.core.match_prefix(CoreRadixKey(list(tokens), ns), cow_mamba=cow, req=creq)
        if cow:
            req_bridge.push_mamba(req, creq, self.device)
        self._version += 1
        branching = None
        if res.kv_match_len > res.prefix_len:
            if self.req_to_token_pool.prefix_checkpoint_writer:
                # The backend saves a state at any position: the exact branch point, planned
                # as a prefix checkpoint when the request gets its row (SGLang's own tracking
                # ignores a point off its grid and re-saves one on it, harmlessly).
                branching = res.kv_match_len
            elif self.enable_mamba_extra_buffer:
                aligned = (res.kv_match_len // self.checkpoint_grid) * self.checkpoint_grid
                if aligned > res.prefix_len:
                    branching = aligned
        node = res.last_node
        return MatchResult(
            device_prefix_len=res.prefix_len,
            last_device_node=node,
            last_host_node=node,
            best_match_node=node,
            mamba_branching_seqlen=branching,
            full_kv_hit_length=res.kv_match_len,
        )

    # -- checkpoint / release ----------------------------------------------------------
    def checkpoint(self, req, *, up_to: int, **kwargs) -> None:
        fill = req.full_untruncated_fill_ids
        up_to = min(int(up_to), len(fill))
        pool = self.req_to_token_pool
        tokens = fill[:up_to].tolist() if hasattr(fill, "tolist") else list(fill[:up_to])
        creq = req_bridge.pull(req, tokens, pool=pool)
        row = creq.req_pool_idx
        finished = req.finished()
        if finished:
            self.core.insert_finished_req(creq, up_to=up_to)
        else:
            creq.kv_committed_len = min(creq.kv_committed_len, up_to)
            self.core.cache_unfinished_req(creq)
        req_bridge.push_prefix_checkpoints(pool, row, creq)
        req_bridge.push_checkpoint(req, creq, self.device, finished=finished)
        self._version += 1

    def on_release(self, req, *, checkpointed: bool) -> None:
        kv = req.kv
        if kv.mamba_pool_idx is not None or kv.mamba_ping_pong_track_buffer is not None:
            self.req_to_token_pool.free_mamba_cache(req)
        self._version += 1

    # -- eviction and locks ------------------------------------------------------------
    def evict(self, params: EvictParams) -> EvictResult:
        start = time.perf_counter()
        res = self.core.evict(num_tokens=params.num_tokens, mamba_num=params.mamba_num)
        self.update_eviction_metrics(res.num_tokens_evicted, start)
        self._version += 1
        return EvictResult(num_tokens_evicted=res.num_tokens_evicted, mamba_num_evicted=res.mamba_num_evicted)

    def inc_lock_ref(self, node) -> IncLockRefResult:
        self.core.inc_lock_ref(node)
        return IncLockRefResult()

    def dec_lock_ref(self, node, params: Optional[DecLockRefParams] = None) -> DecLockRefResult:
        self.core.dec_lock_ref(node)
        return DecLockRefResult()

    def path_device_indices(self, node) -> torch.Tensor:
        return self.core.path_device_indices(node)

    # -- sizes (tokens for KV, slots for SSM) ------------------------------------------
    def evictable_size(self) -> int:
        return self.core.full_evictable_size()

    def protected_size(self) -> int:
        return self.core.full_protected_size()

    def full_evictable_size(self) -> int:
        return self.core.full_evictable_size()

    def full_protected_size(self) -> int:
        return self.core.full_protected_size()

    def mamba_evictable_size(self) -> int:
        return self.core.mamba_evictable_size()

    def mamba_protected_size(self) -> int:
        return self.core.mamba_protected_size()

    def total_size(self) -> int:
        return self.core.total_size()

    def available_and_evictable_str(self) -> str:
        kv_free = self.token_to_kv_pool_allocator.available_size()
        ssm_free = self.req_to_token_pool.mamba_allocator.available_size()
        return (
            f"Available KV tokens: {kv_free + self.full_evictable_size()} "
            f"({kv_free} free + {self.full_evictable_size()} evictable); SSM slots: "
            f"{ssm_free + self.mamba_evictable_size()} ({ssm_free} free + "
            f"{self.mamba_evictable_size()} evictable)\n"
        )

    # -- diagnostics -------------------------------------------------------------------
    def all_values_flatten(self) -> torch.Tensor:
        return self.core.all_values_flatten()

    def all_mamba_values_flatten(self) -> torch.Tensor:
        return self.core.all_mamba_values_flatten()

    def pretty_print(self) -> str:
        return self.core.pretty_print()

    def sanity_check(self) -> None:
        """The core's invariant check (SGLang calls it at idle with
        ``SGLANG_ENABLE_TREE_CACHE_SANITY_CHECK=1``). Logs one line per check after the
        tree changed, so a test can see that the idle checker ran with this cache."""
        self.core.sanity_check()
        if self._checked_version != self._version:
            self._checked_version = self._version
            logger.info(
                "mamba-radix idle check ok: kv evictable=%d protected=%d, ssm evictable=%d protected=%d, "
                "free kv=%d ssm=%d, evicted kv=%d ssm=%d",
                self.full_evictable_size(),
                self.full_protected_size(),
                self.mamba_evictable_size(),
                self.mamba_protected_size(),
                self.token_to_kv_pool_allocator.available_size(),
                self.req_to_token_pool.mamba_allocator.available_size(),
                self.core.evicted_tokens_total,
                self.core.evicted_states_total,
            )


#: Environment override of what a finished request donates: ``auto`` (default: the newest
#: ping-pong checkpoint under overlap scheduling, else the live state), ``working`` or
#: ``checkpoint`` (e.g. to run the overlap-safe path on CPU).
FINISH_STATE_ENV = "SGLANG_MAMBA_EXT_FINISH_STATE"


def _finish_state(overlap: bool, extra_buffer: bool) -> str:
    import os

    choice = os.environ.get(FINISH_STATE_ENV, "auto") or "auto"
    if choice not in ("auto", "working", "checkpoint"):
        raise ValueError(f"{FINISH_STATE_ENV}={choice!r}: expected auto, working or checkpoint")
    if choice == "checkpoint" and not extra_buffer:
        raise ValueError(
            f"{FINISH_STATE_ENV}=checkpoint needs ping-pong checkpoints "
            "(not --mamba-radix-cache-strategy no_buffer)"
        )
    if choice == "auto":
        return "checkpoint" if (overlap and extra_buffer) else "working"
    return choice


def _eviction_policy(params) -> str:
    """``--radix-eviction-policy`` as the core cache names it.

    Raises:
        ValueError: a policy the plugin's cache does not implement (naming the flag)."""
    from sglang_mamba_ext.plugin.settings import SUPPORTED_POLICIES

    policy = str(getattr(params, "eviction_policy", None) or "lru")
    if policy not in SUPPORTED_POLICIES:
        raise ValueError(
            f"--enable-mamba-radix supports --radix-eviction-policy {' or '.join(SUPPORTED_POLICIES)}, "
            f"not {policy}"
        )
    return policy


def _kv_bytes_per_token(allocator) -> int:
    """Bytes of one token's KV over all attention layers (0 if the pool does not say)."""
    try:
        kvcache = allocator.get_kvcache()
        k, v = kvcache.get_kv_size_bytes()
        return int((k + v) // max(int(kvcache.size + kvcache.page_size), 1))
    except Exception:  # noqa: BLE001 - an estimate only; the policy works without it
        return 0


def build_tree_cache(ctx) -> MambaRadixCacheAdapter:
    """Factory registered as ``--radix-cache-backend mamba_radix_ext``
    (``registry.register_radix_cache_backend``); ``ctx`` is SGLang's
    ``TreeCacheBuildContext``.

    Raises:
        ValueError: naming the flags, for a model or combination the cache cannot serve.
    """
    from sglang.srt.runtime_context import get_exec, get_schedule, get_spec, mamba_checkpoint_grid

    if ctx.disable_radix_cache:
        raise ValueError("--enable-mamba-radix cannot be combined with --disable-radix-cache")
    if not ctx.is_hybrid_ssm:
        raise ValueError(
            "--enable-mamba-radix needs a hybrid model with linear-attention / SSM layers; "
            "this model has none (drop --enable-mamba-radix)"
        )
    if ctx.is_hybrid_swa:
        raise ValueError("--enable-mamba-radix does not support sliding-window (SWA) hybrid models")
    if ctx.enable_hierarchical_cache:
        raise ValueError("--enable-mamba-radix cannot be combined with --enable-hierarchical-cache")
    params = ctx.params
    algo = str(get_spec().speculative_algorithm or "").upper()
    if params.is_eagle and algo != "FROZEN_KV_MTP":
        # EAGLE / EAGLE3 drafts write KV keyed by token pairs (SGLang's bigram radix keys);
        # FROZEN_KV_MTP's draft writes no KV (SGLang counts it as EAGLE-family only for the
        # scheduler), so its keys are plain tokens.
        raise ValueError(
            f"--enable-mamba-radix does not support --speculative-algorithm {algo} (bigram radix keys)"
        )
    overlap = not get_schedule().disable_overlap_schedule
    extra_buffer = bool(params.enable_mamba_extra_buffer)
    grid = mamba_checkpoint_grid(params.page_size) if extra_buffer else params.page_size
    cache = MambaRadixCacheAdapter(
        req_to_token_pool=params.req_to_token_pool,
        token_to_kv_pool_allocator=params.token_to_kv_pool_allocator,
        page_size=params.page_size,
        mamba_track_interval=get_exec().mamba.mamba_track_interval,
        finish_state=_finish_state(overlap, extra_buffer),
        enable_mamba_extra_buffer=extra_buffer,
        checkpoint_grid=grid,
        enable_metrics=params.enable_metrics,
        eviction_policy=_eviction_policy(params),
        kv_bytes_per_token=_kv_bytes_per_token(params.token_to_kv_pool_allocator),
        max_states_per_path=get_exec().mamba.mamba_max_states_per_path,
    )
    logger.info(
        "sglang-mamba-ext: %s tree cache (page_size=%d, finish_state=%s, ping-pong tracking %s, "
        "track interval %d, checkpoint grid %d, eviction %s)",
        BACKEND_NAME,
        params.page_size,
        cache.core.finish_state,
        "on" if extra_buffer else "off",
        get_exec().mamba.mamba_track_interval,
        grid,
        cache.core.eviction_policy,
    )
    return cache
