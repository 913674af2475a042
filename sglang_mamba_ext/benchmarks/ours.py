"""Benchmark driver for this project's cache as SGLang serves it: the plugin's
``MambaRadixCacheAdapter`` (``sglang_mamba_ext/plugin/cache.py``) over its
``MambaRadixReqToTokenPool``, driven by :class:`.scheduler.SchedulerDriver` — the same
SGLang scheduler functions the upstream driver runs on SGLang's ``UnifiedRadixCache``.

The pool and the cache are built the way a scheduler process builds them under
``--enable-mamba-radix`` (:func:`build_plugin_cache`): the plugin's entry point and hooks
are applied, the server arguments are parsed by SGLang's own parser for the tiny hybrid
model (``sglang_mamba_ext.models.tiny_builder``, written once per process to a temporary
directory) with ``--device cpu --mamba-radix-cache-strategy no_buffer``, and, inside that
runtime context, ``KVCacheConfigurator._build_hybrid_req_pool`` (the plugin's AROUND hook)
builds the pool (:func:`build_req_pool`) and ``registry.create_tree_cache`` the adapter
over a ``TokenToKVPoolAllocator`` of ``kv_size`` tokens (:func:`build_tree_cache`); the
SGLang glue tests build theirs with these two functions too. The replay runs in that context too
(:meth:`OursDriver.activate`): SGLang's release path reads its serving flags.

``prefix_checkpoints=True`` declares the linear-attention backend able to write a state at
any token (``MambaRadixReqToTokenPool.prefix_checkpoint_writer``, as the tiny model's
backend does), so the pool plans the core's branch-point and prompt-end checkpoints when a
request gets its row and the finishing ``checkpoint`` inserts them (docs/design.md,
prefix checkpoints). The prefill that would write those states is not run; every planned
checkpoint is counted in ``state_copies``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Optional

import torch

from sglang_mamba_ext.benchmarks.scheduler import Handle, SchedulerDriver, apply_plugin
from sglang_mamba_ext.testing import tiny_model_dir

def scheduler_context(argv: list[str]):
    """SGLang's runtime context of a scheduler process launched with ``argv`` (the plugin's
    entry point run and its hooks applied first, as ``load_plugins`` does)."""
    from sglang.srt.runtime_context import create_context
    from sglang.srt.server_args import prepare_server_args

    apply_plugin()
    return create_context(prepare_server_args(argv), role="scheduler")


#: The rest of ``TreeCacheBuildContext`` for one scheduler rank on CPU serving an SSM hybrid
#: (no SWA, no hierarchical cache, radix cache on, no model worker).
_SINGLE_RANK_SSM_HYBRID: dict[str, Any] = {
    "is_hybrid_swa": False,
    "is_hybrid_ssm": True,
    "enable_hierarchical_cache": False,
    "disable_radix_cache": False,
    "tp_worker": None,
    "model_config": None,
    "tp_size": 1,
    "tp_rank": 0,
    "tp_group": None,
}


def build_req_pool(max_num_reqs: int = 4, context_len: int = 256):
    """SGLang's ``KVCacheConfigurator._build_hybrid_req_pool`` (with the plugin's AROUND
    hook) for the tiny model, on a configurator holding only what that method reads:
    ``max_num_reqs`` rows of ``context_len`` tokens. Call inside a scheduler context."""
    from transformers import AutoConfig

    from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator

    hf = AutoConfig.from_pretrained(tiny_model_dir())
    conf = object.__new__(KVCacheConfigurator)
    conf.mambaish_config = hf
    conf.layer_info = SimpleNamespace(start_layer=0, end_layer=hf.num_hidden_layers)
    conf.model_config = SimpleNamespace(context_len=context_len)
    conf.device = "cpu"
    conf.hybrid_kda_config = None
    conf.hybrid_gdn_config = None
    return KVCacheConfigurator._build_hybrid_req_pool(conf, max_num_reqs=max_num_reqs, extra_max_context_len=0)


def build_tree_cache(
    pool, kv_size: int, page_size: int = 1, *, hierarchical: bool = False, kv_pool: Any = None, **cache_init_params: Any
):
    """``(cache, kv_allocator)``: SGLang's ``registry.create_tree_cache`` over ``pool`` and a
    ``TokenToKVPoolAllocator`` of ``kv_size`` tokens (over SGLang's KV pool ``kv_pool``, or
    slots only without one), with the flags of the current runtime
    context; ``cache_init_params`` sets further ``CacheInitParams`` fields (e.g.
    ``enable_kv_cache_events=True``, as the scheduler sets it under ``--kv-events-config``).
    Call inside a scheduler context."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache
    from sglang.srt.runtime_context import get_exec, get_memory, get_server_args

    allocator = TokenToKVPoolAllocator(kv_size, torch.float32, "cpu", kv_pool, False)
    params = CacheInitParams(
        disable=False,
        req_to_token_pool=pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        enable_mamba_extra_buffer=get_exec().mamba.enable_mamba_extra_buffer,
        enable_mamba_extra_buffer_lazy=get_exec().mamba.enable_mamba_extra_buffer_lazy,
        eviction_policy=get_memory().radix_eviction_policy,
        **cache_init_params,
    )
    build_ctx = TreeCacheBuildContext(
        server_args=get_server_args(), params=params,
        **{**_SINGLE_RANK_SSM_HYBRID, "enable_hierarchical_cache": hierarchical},
    )
    return create_tree_cache(build_ctx), allocator


def build_plugin_cache(
    kv_size: int,
    mamba_size: int,
    *,
    eviction_policy: Optional[str] = "lru",
    max_context_len: int = 4096,
    max_num_reqs: int = 4,
    int8_slots: int = 0,
    host_ratio: float = 0.0,
    defaults: bool = False,
    overlap: bool = False,
):
    """``(adapter, kv_allocator, req_to_token_pool, runtime_context)`` built through SGLang's code paths
    (module docstring). Sizes: ``kv_size`` tokens, ``mamba_size`` SSM slots (slot 0 of
    each reserved on top), ``max_num_reqs`` rows of ``max_context_len`` tokens.

    Raises:
        ValueError: from the plugin, for sizes or a policy it refuses (naming the flag).

    ``eviction_policy=None``: ``--radix-eviction-policy`` not given (the plugin's default).
    ``defaults``: ``--enable-mamba-radix`` with no strategy flag (the plugin's choice,
    ``extra_buffer``: two ping-pong slots per request) and overlap scheduling as
    ``overlap`` says; otherwise ``--mamba-radix-cache-strategy no_buffer
    --disable-overlap-schedule``. ``int8_slots > 0``: ``--enable-int8-mamba-checkpoint
    --int8-mamba-ckpt-size int8_slots`` (the tree's states in SGLang's int8 checkpoint pool).
    ``host_ratio > 0``: ``--enable-hierarchical-cache --hicache-ratio host_ratio`` (a host
    tier of the states).
    """
    from sglang.srt.runtime_context import use_context

    if defaults:
        mode = [] if overlap else ["--disable-overlap-schedule"]
    else:
        mode = ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]
    ctx = scheduler_context(
        [
            "--model-path", tiny_model_dir(), "--device", "cpu", "--page-size", "1",
            "--enable-mamba-radix", *mode, "--max-mamba-cache-size", str(mamba_size),
        ]
        + (["--radix-eviction-policy", eviction_policy] if eviction_policy else [])
        + (["--enable-int8-mamba-checkpoint", "--int8-mamba-ckpt-size", str(int8_slots)] if int8_slots else [])
        + (["--enable-hierarchical-cache", "--hicache-ratio", str(host_ratio)] if host_ratio else [])
    )
    with use_context(ctx):
        pool = build_req_pool(max_num_reqs, max_context_len)
        cache, allocator = build_tree_cache(pool, kv_size, hierarchical=bool(host_ratio))
    return cache, allocator, pool, ctx


class OursDriver(SchedulerDriver):
    """The plugin's ``MambaRadixCacheAdapter`` under SGLang's scheduler functions.

    Args (besides :class:`.scheduler.SchedulerDriver`'s, in ``kw``):
        eviction_policy: ``--radix-eviction-policy`` (``"lru"``, ``"recompute"`` or
            ``"adaptive"``; ``None``: not given, the plugin's default).
        prefix_checkpoints: plan branch-point / prompt-end checkpoints (module docstring).
        defaults: exactly what ``--enable-mamba-radix`` alone selects (:func:`build_plugin_cache`
            ``defaults``; no policy named, prefix checkpoints planned, SGLang's post-prefill
            insert run as its result processor does).
        name: label in reports.
    """

    name = "ours"
    #: overlap scheduling on in the parsed flags (``--enable-mamba-radix`` defaults only)
    overlap_timing = False

    def __init__(
        self,
        kv_size: int,
        mamba_size: int,
        *,
        eviction_policy: str = "lru",
        prefix_checkpoints: bool = False,
        name: str = "ours",
        int8_slots: int = 0,
        host_ratio: float = 0.0,
        defaults: bool = False,
        **kw,
    ):
        self.name = name
        self.defaults = defaults
        if defaults:
            eviction_policy, prefix_checkpoints = None, True
            kw.setdefault("prompt_checkpoint", True)
        self.int8_slots = int8_slots
        self.host_ratio = host_ratio
        self.eviction_policy = eviction_policy
        self.prefix_checkpoints = prefix_checkpoints
        self.checkpoints_planned = 0
        super().__init__(kv_size, mamba_size, **kw)

    def build(self, kv_size: int, mamba_size: int, max_context_len: int) -> tuple:
        cache, allocator, pool, self.context = build_plugin_cache(
            kv_size, mamba_size, eviction_policy=self.eviction_policy, max_context_len=max_context_len,
            int8_slots=self.int8_slots, host_ratio=self.host_ratio, defaults=self.defaults,
            overlap=self.overlap_timing,
        )
        pool.prefix_checkpoint_writer = self.prefix_checkpoints
        self.eviction_policy = cache.core.eviction_policy  # the one the plugin chose
        return cache, allocator, pool

    def describe(self) -> str:
        return (
            f"{self.name}: {type(self.cache).__name__} via SGLang scheduler functions "
            f"kv_size={self.allocator.size} mamba_size={self.req_to_token_pool.mamba_pool.size} "
            f"page_size={self.cache.page_size} strategy={self.strategy} cow_copy={self.cow_copy} "
            f"prefix_checkpoints={self.prefix_checkpoints} eviction_policy={self.eviction_policy}"
            + (f" int8_ckpt_slots={self.int8_slots}" if self.int8_slots else "")
            + (f" hicache_ratio={self.host_ratio}" if self.host_ratio else "")
        )

    @property
    def strategy(self) -> str:
        """``--mamba-radix-cache-strategy`` as the plugin resolved it."""
        from sglang.srt.runtime_context import get_server_args

        with self.activate():
            return get_server_args().mamba_radix_cache_strategy

    def alloc_mamba(self, h: Handle) -> None:
        super().alloc_mamba(h)
        if self.prefix_checkpoints:
            planned = self.req_to_token_pool.prefix_checkpoints.get(h.req.kv.req_pool_idx, ())
            self.checkpoints_planned += len(planned)
            self.state_copies += len(planned)

    def activate(self):
        """The scheduler's runtime context (``runtime_context.use_context``)."""
        from sglang.srt.runtime_context import use_context

        return use_context(self.context)

    def leak_check(self) -> tuple[bool, str]:
        """The pool counts (:meth:`SchedulerDriver.leak_check`), no planned prefix
        checkpoint left, and the core's invariant check (``sanity_check``)."""
        ok, details = super().leak_check()
        pool = self.req_to_token_pool
        core = self.cache.core
        host = core.mamba_host_pool
        if host is not None and host.available_size() + core.host_states() != host.size:
            ok = False
            details += f"; host tier: free={host.available_size()} held={core.host_states()} size={host.size}"
        if pool.prefix_checkpoints:
            ok = False
            details += f"; planned prefix checkpoints left: {dict(pool.prefix_checkpoints)}"
        try:
            self.cache.sanity_check()
        except AssertionError as e:
            ok = False
            details += f"; sanity_check: {e}"
        return ok, details


class OursOverlapDriver(OursDriver):
    """:class:`OursDriver` under overlap scheduling's timing (``docs/design.md``, "Overlap
    scheduling"): a request's finish is processed one batch late, after the next request's
    prefill was scheduled (that request cannot hit the finished one's state, and the
    finished one still holds its slots at that admission), unless the next request is the
    next turn of its conversation (``TraceRecord.parent``: its client had the reply first).
    The finish donates the live state (``finish_state="overlap"``).

    ``finish_by_length``: every request ends by length (a replay's fixed output lengths), so
    the plugin donates its final state before the next batch is scheduled
    (``plugin/overlap_publish.py``, ``donate_finishing_decodes``): the finish is processed
    before the next request's match, as without overlap. Without it (a stop token, which
    SGLang sees only in the result) the finish comes one batch late."""

    overlap_timing = True

    def __init__(self, *args, finish_by_length: bool = False, **kw):
        super().__init__(*args, **kw)
        self.finish_by_length = finish_by_length
        self._pending: Optional[Handle] = None

    def build(self, kv_size: int, mamba_size: int, max_context_len: int) -> tuple:
        cache, allocator, pool = super().build(kv_size, mamba_size, max_context_len)
        cache.core.finish_state = "overlap"
        return cache, allocator, pool

    def describe(self) -> str:
        return super().describe() + f" overlap_timing=True finish_by_length={self.finish_by_length}"

    def _process_pending_finish(self) -> None:
        h, self._pending = self._pending, None
        if h is not None:
            super().finish(h)
            super().unlock(h)
            super().end(h)

    def begin(self, rec):
        h = self._pending
        if h is not None and (self.finish_by_length or (rec.parent is not None and str(rec.parent) == h.req.rid)):
            self._process_pending_finish()
        return super().begin(rec)

    def after_prefill(self, h: Handle) -> None:
        # the previous request's last result is processed once this prefill is launched
        self._process_pending_finish()
        super().after_prefill(h)

    def finish(self, h: Handle) -> None:
        self._pending = h

    def unlock(self, h: Handle) -> None:
        if h is not self._pending:
            super().unlock(h)

    def end(self, h: Handle) -> None:
        if h is not self._pending:
            super().end(h)

    def leak_check(self) -> tuple[bool, str]:
        self._process_pending_finish()
        return super().leak_check()


def make_ours_driver(args: Any, eviction_policy: Optional[str] = None) -> OursDriver:
    """The tree-ops benchmark's "ours" (``args``: ``kv_size``, ``mamba_size``, ``cow_copy``):
    the plugin's default policy unless ``eviction_policy`` names one."""
    name = "ours" if eviction_policy is None else f"ours-{eviction_policy}"
    return OursDriver(args.kv_size, args.mamba_size, cow_copy=args.cow_copy, eviction_policy=eviction_policy, name=name)
