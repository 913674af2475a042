"""SGLang general-plugin entry point (group ``sglang.srt.plugins``, name ``mamba_radix``).

SGLang 0.5.23 calls :func:`register` in every process it starts
(``sglang/srt/plugins/__init__.py::load_plugins``: launcher / HTTP server, schedulers,
detokenizer, DP controller; ``SGLANG_PLUGINS`` restricts which plugins run), before the
launchers parse server arguments, then applies the registered hooks. What it installs, all
in-process (no file written; the one environment change, ``SGLANG_MAMBA_CONV_DTYPE=float32``,
comes with the CPU defaults of :mod:`.cpu_defaults`):

- hooks on SGLang functions through ``HookRegistry`` (each listed in ``docs/sglang-hooks.md``):
  argument parsing (:mod:`.args`, :mod:`.cpu_defaults`, :mod:`.speculative`), model lookup
  (:mod:`.tiny_hybrid`), request-pool construction (:mod:`.pool`), decode preparation
  (:mod:`.cpu_pin_memory`), the prefill side's KV send on a host without CUDA
  (:mod:`.disaggregation`), request validation (:mod:`.request_validation`), chat message
  boundaries (:mod:`.chat_boundaries`), the scheduler's
  internal state for ``/server_info`` (:mod:`.metrics`), the speculative verify path
  (:mod:`.speculative.hooks`);
- registry entries: the ``--radix-cache-backend mamba_radix_ext`` factory, the
  ``--radix-eviction-policy recompute`` choice, the ``kda_cache`` warmup, the ``tiny_hybrid``
  config and linear-attention model spec;
- later, only when a check of the plugin's flags fails, a ``sys.excepthook``
  (:mod:`.startup_errors`).

Each hook returns SGLang's own result unless one of the plugin's flags
(``--enable-mamba-radix``, ``--warmups kda_cache`` / ``--warmup-prompts-file``,
``--radix-eviction-policy recompute``, ``--mamba-spec-state-update``) is given or the model
is the project's tiny model (CPU defaults on ``--device cpu``): for any other launch SGLang
resolves the same ``ServerArgs`` and the same ``os.environ`` as without the plugin
(``tests/test_plugin_no_side_effects.py``). A bad use of those flags exits like an argparse
error. Keep :func:`register` cheap and idempotent. Mechanism: ``docs/design.md``, "SGLang
wiring".
"""

from __future__ import annotations

_installed = False

# Hook targets (dotted paths resolved by SGLang's HookRegistry at apply time).
ADD_CLI_ARGS = "sglang.srt.server_args.ServerArgs.add_cli_args"
FROM_CLI_ARGS = "sglang.srt.server_args.ServerArgs.from_cli_args"
VALIDATE_EXTRA_BUFFER = "sglang.srt.arg_groups.mamba_hook.validate_mamba_extra_buffer"
HANDLE_MAMBA_RADIX = "sglang.srt.arg_groups.model_hook.handle_mamba_radix_cache"
BUILD_HYBRID_REQ_POOL = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._build_hybrid_req_pool"
PREPARE_FOR_DECODE = "sglang.srt.managers.schedule_batch.ScheduleBatch.prepare_for_decode"
VALIDATE_ONE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._validate_one_request"
CHAT_CONVERT = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._convert_to_internal_request"
CHAT_RENDER = "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._render_and_encode_chat_template"
GET_INTERNAL_STATE = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
)


def install_mamba_radix() -> None:
    """Register the hooks of ``--enable-mamba-radix`` / ``--warmup-prompts-file``, the
    ``mamba_radix_ext`` tree-cache backend and the ``kda_cache`` warmup (idempotent)."""
    global _installed
    if _installed:
        return
    from sglang.srt.mem_cache.registry import get_radix_cache_factory, register_radix_cache_backend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_mamba_ext.plugin import args, chat_boundaries
    from sglang_mamba_ext.plugin.cache import build_tree_cache
    from sglang_mamba_ext.plugin.cpu_pin_memory import prepare_for_decode_around
    from sglang_mamba_ext.plugin.metrics import server_info_after
    from sglang_mamba_ext.plugin.request_validation import validate_one_request_before
    from sglang_mamba_ext.plugin.pool import build_hybrid_req_pool_around
    from sglang_mamba_ext.plugin.settings import BACKEND_NAME
    from sglang_mamba_ext.plugin.warmup import register_warmup

    HookRegistry.register(ADD_CLI_ARGS, args.add_cli_args_after, HookType.AFTER)
    HookRegistry.register(FROM_CLI_ARGS, args.from_cli_args_after, HookType.AFTER)
    HookRegistry.register(VALIDATE_EXTRA_BUFFER, args.validate_mamba_extra_buffer_around, HookType.AROUND)
    HookRegistry.register(HANDLE_MAMBA_RADIX, args.handle_mamba_radix_cache_around, HookType.AROUND)
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    register_resolution_hook("handle_int8_mamba_checkpoint")(args.int8_mamba_checkpoint_step)
    HookRegistry.register(BUILD_HYBRID_REQ_POOL, build_hybrid_req_pool_around, HookType.AROUND)
    from sglang_mamba_ext.plugin import sessions

    HookRegistry.register(sessions.CREATE_TREE_CACHE, sessions.create_tree_cache_around, HookType.AROUND)
    HookRegistry.register(PREPARE_FOR_DECODE, prepare_for_decode_around, HookType.AROUND)
    HookRegistry.register(VALIDATE_ONE_REQUEST, validate_one_request_before, HookType.BEFORE)
    HookRegistry.register(GET_INTERNAL_STATE, server_info_after, HookType.AFTER)
    HookRegistry.register(CHAT_CONVERT, chat_boundaries.convert_to_internal_request_around, HookType.AROUND)
    HookRegistry.register(CHAT_RENDER, chat_boundaries.render_and_encode_around, HookType.AROUND)
    if get_radix_cache_factory(BACKEND_NAME) is None:
        register_radix_cache_backend(BACKEND_NAME, build_tree_cache)
    # --radix-eviction-policy recompute / adaptive (the core's SSM eviction policies), added
    # to SGLang's choices before any argument parser is built.
    from sglang.srt.arg_groups.choices import RADIX_EVICTION_POLICY_CHOICES, add_radix_eviction_policy_choices

    from sglang_mamba_ext.plugin.settings import PLUGIN_POLICIES

    add_radix_eviction_policy_choices([p for p in PLUGIN_POLICIES if p not in RADIX_EVICTION_POLICY_CHOICES])
    register_warmup()
    from sglang_mamba_ext.plugin.inchunk_checkpoints import register_inchunk_hooks

    register_inchunk_hooks()  # exact prefix checkpoints with SGLang's KDA / GDN / Mamba2 / short-conv backends
    from sglang_mamba_ext.plugin.multi_rank import register_multi_rank_hooks

    register_multi_rank_hooks()
    from sglang_mamba_ext.plugin.disaggregation import register_disaggregation_hooks

    register_disaggregation_hooks()
    from sglang_mamba_ext.plugin.pd_decode import register_pd_decode_hooks

    register_pd_decode_hooks()  # the decode side: the plugin's pool with pre-allocated rows
    from sglang_mamba_ext.plugin.overlap_publish import register_overlap_publish_hook

    register_overlap_publish_hook()  # a launched prefill is matched by the next batch
    _installed = True


def register() -> None:
    """Register this package's SGLang extensions (idempotent): the tiny hybrid model
    (:mod:`.tiny_hybrid`), CPU-safe defaults for the tiny model or ``--enable-mamba-radix``
    with ``--device cpu`` (:mod:`.cpu_defaults`), the mamba-radix cache
    (:func:`install_mamba_radix`) and the deferred-update speculative verify
    (``--mamba-spec-state-update``, :mod:`.speculative`). Hooks are applied by SGLang's
    ``load_plugins()`` after every plugin ran."""
    from sglang_mamba_ext.plugin.cpu_defaults import install_cpu_defaults
    from sglang_mamba_ext.plugin.speculative import register_spec_hooks
    from sglang_mamba_ext.plugin.tiny_hybrid import register_tiny_hybrid

    from sglang_mamba_ext.plugin.cpu_bridges import register_cpu_bridges

    register_tiny_hybrid()
    install_cpu_defaults()
    register_cpu_bridges()
    install_mamba_radix()
    register_spec_hooks()
