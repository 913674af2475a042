"""Start-up checks of ``--enable-mamba-radix`` combined with SGLang's other cache and
serving features (split from :mod:`.args`, which calls them from ``apply_flags``): the
storage tier's backend, ReplaySSM, prefill/decode disaggregation and role switch, and the
sizes of the SSM pool and the host tier. Each refusal raises a
:class:`~sglang_mamba_ext.plugin.startup_errors.FlagError` naming the flag and the fix
(``docs/flags.md``)."""
from __future__ import annotations

import logging

from sglang_mamba_ext.plugin.cpu_defaults import ENABLE_FLAG
from sglang_mamba_ext.plugin.startup_errors import FlagError

logger = logging.getLogger(__name__)


def _take_storage_backend(server_args, settings, refuse) -> None:
    """``--hicache-storage-backend file`` (``docs/design.md``, "Storage tier"): the plugin's
    tree writes states and KV through SGLang's backend itself, so the backend's name moves to
    the plugin's settings and SGLang's field is cleared (its scheduler would otherwise run
    its own storage prefetch against the plugin's cache). Needs the host tier; SGLang's
    ``file`` and ``mooncake`` backends are served (mooncake through a staging buffer,
    ``plugin/storage_mooncake.py``; the others take SGLang's host KV pool object at
    construction, which the plugin's host tier is not)."""
    storage = getattr(server_args, "hicache_storage_backend", None)
    if not storage:
        return
    if not getattr(server_args, "enable_hierarchical_cache", False):
        refuse(f"--hicache-storage-backend {storage} without --enable-hierarchical-cache",
               " (its storage tier sits below the host tier and reads back through it)")
    if storage not in ("file", "mooncake"):
        refuse(f"--hicache-storage-backend {storage}",
               " (its storage tier serves SGLang's file and mooncake backends; the others are built "
               "on SGLang's host KV pool object, mem_cache/storage/backend_factory.py, which the "
               "plugin's host tier is not)")
    tp = int(getattr(server_args, "tp_size", 1) or 1)
    if tp > 1 or int(getattr(server_args, "dp_size", 1) or 1) > 1:
        refuse(f"--hicache-storage-backend {storage} at --tp {tp} / --dp {getattr(server_args, 'dp_size', 1)}",
               " (each rank would read its own values, and a value missing on one rank would make the "
               "ranks' trees differ; served on one rank only)")
    if getattr(server_args, "hicache_host_memory_mode", "cache") not in (None, "cache"):
        return  # refused below with SGLang's reason
    extra = getattr(server_args, "hicache_storage_backend_extra_config", None)
    from sglang_mamba_ext.plugin.host_tier import check_guard_settings

    try:
        check_guard_settings(extra, storage)
    except ValueError as e:
        raise FlagError(str(e)) from None
    settings["storage_backend"] = storage
    settings["storage_extra_config"] = extra
    server_args.hicache_storage_backend = None


#: SGLang's ReplaySSM decode kernel tiles a key head in ``nk = 2`` blocks of at least 16 channels
#: for ``tl.dot`` (``kernels/ops/attention/linear/fused_recurrent_linear_replayssm.py:566-572``)
REPLAYSSM_MIN_KEY_DIM = 32


def linear_key_head_dim(cfg: dict):
    """Key head dim (channels) of a config's GDN / KDA layers, or None where the config names none.

    Reads ``linear_key_head_dim`` (Qwen3-Next / Qwen3.5 / GigaChat, the tiny model),
    ``linear_attn_config.head_dim`` (Kimi-Linear, Kimi-K3) or ``linear_head_dim``, at the top level
    or in ``text_config`` (a VLM)."""
    for c in (cfg, cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else None):
        if not c:
            continue
        for key in ("linear_key_head_dim", "linear_head_dim"):
            if isinstance(c.get(key), int):
                return c[key]
        lac = c.get("linear_attn_config")
        if isinstance(lac, dict) and isinstance(lac.get("head_dim"), int):
            return lac["head_dim"]
    return None


def _check_replayssm_key_dim(server_args) -> None:
    """Refuse ``--enable-linear-replayssm`` at start-up for a local model whose GDN / KDA key
    heads are narrower than SGLang's ReplaySSM decode kernel takes: without this, the first
    decode step raises inside the scheduler (``ValueError: BKT=8 must be >=16 for tl.dot``,
    ``fused_recurrent_linear_replayssm.py:572``; with or without the plugin). Models served
    by the plugin's own torch backend (the tiny model's default kernels) never run that kernel.

    Raises:
        FlagError: key head dim below :data:`REPLAYSSM_MIN_KEY_DIM`."""
    from sglang_mamba_ext.plugin.cpu_defaults import TINY_MODEL_TYPE, local_model_config

    cfg = local_model_config(getattr(server_args, "model_path", None))
    if not cfg:
        return
    if cfg.get("model_type") == TINY_MODEL_TYPE:
        from sglang_mamba_ext.models.tiny_builder import DEFAULT_CONFIG
        from sglang_mamba_ext.plugin.tiny_hybrid import SGLANG_KERNEL_ARCHITECTURES

        if not any(a in SGLANG_KERNEL_ARCHITECTURES for a in cfg.get("architectures") or []):
            return
        cfg = dict(DEFAULT_CONFIG, **cfg)
    dim = linear_key_head_dim(cfg)
    if dim is not None and dim < REPLAYSSM_MIN_KEY_DIM:
        bkt = (1 << max(0, dim - 1).bit_length()) // 2  # the kernel's BK // nk
        raise FlagError(
            f"--enable-linear-replayssm: the model's linear key heads have {dim} channels, and SGLang's "
            f"ReplaySSM decode kernel needs at least {REPLAYSSM_MIN_KEY_DIM} (it raises 'BKT={bkt} "
            "must be >=16 for tl.dot' at the first decode step, kernels/ops/attention/linear/"
            "fused_recurrent_linear_replayssm.py:572); drop --enable-linear-replayssm for this model"
        )


def _map_replayssm(server_args) -> None:
    """SGLang's ReplaySSM flags under the flag (``docs/flags.md``, "ReplaySSM").

    ``--enable-linear-replayssm`` (the decode ring) runs as SGLang runs it, with the plugin's
    cache: SGLang requires ``--mamba-radix-cache-strategy no_buffer``
    (``arg_groups/attention_hook.py``), so the strategy ``auto`` becomes ``no_buffer`` (not
    the flag's usual ``extra_buffer``), and a finished request's ring is folded into its
    state before the tree takes it (``plugin/replayssm.py``).

    ``--enable-linear-replayssm-spec`` (verify without per-draft state snapshots, the
    accepted tokens' inputs folded into the state) is what the plugin's
    ``--mamba-spec-state-update deferred`` does for the speculative algorithms it runs with
    (FROZEN_KV_MTP, NEXTN / EAGLE): it is mapped to it, with deferred mode's requirements.

    Raises:
        FlagError: ``--enable-linear-replayssm`` with an explicit ``extra_buffer`` strategy
            (SGLang's reason), or the spec flag where deferred mode cannot run."""
    if getattr(server_args, "enable_linear_replayssm", False):
        _check_replayssm_key_dim(server_args)
        strategy = server_args.mamba_radix_cache_strategy
        if strategy == "auto":
            server_args.mamba_radix_cache_strategy = "no_buffer"
            logger.info("%s with --enable-linear-replayssm: --mamba-radix-cache-strategy no_buffer "
                        "(SGLang's requirement for the ReplaySSM decode ring)", ENABLE_FLAG)
        elif strategy != "no_buffer":
            raise FlagError(
                f"--enable-linear-replayssm cannot be combined with --mamba-radix-cache-strategy {strategy} "
                "(SGLang: 'requires --mamba-radix-cache-strategy no_buffer (the default); the extra_buffer "
                "ping-pong donation path is not yet supported', arg_groups/attention_hook.py); "
                "drop --mamba-radix-cache-strategy"
            )
    if getattr(server_args, "enable_linear_replayssm_spec", False):
        from sglang_mamba_ext.plugin.speculative import hooks as spec_hooks

        if getattr(server_args, spec_hooks.ATTR, None) == "snapshot":
            raise FlagError(
                f"--enable-linear-replayssm-spec under {ENABLE_FLAG} runs as {spec_hooks.FLAG} deferred, "
                f"not {spec_hooks.FLAG} snapshot; drop one of them"
            )
        server_args.enable_linear_replayssm_spec = False
        try:
            spec_hooks.validate_flags(server_args, "deferred")
        except FlagError as exc:
            raise FlagError(
                f"--enable-linear-replayssm-spec under {ENABLE_FLAG} runs as the plugin's "
                f"{spec_hooks.FLAG} deferred, which refuses this: {exc}"
            ) from exc
        server_args.__dict__[spec_hooks.ATTR] = "deferred"
        logger.info("%s: --enable-linear-replayssm-spec runs as %s deferred (the plugin's replay of "
                    "accepted tokens)", ENABLE_FLAG, spec_hooks.FLAG)


def _check_disaggregation(server_args) -> None:
    """Prefill/decode disaggregation (``docs/design.md``, "Prefill/decode disaggregation"):
    the plugin serves the prefill side (SGLang sends the KV and the working SSM state from
    the plugin's pool; the cache keeps serving hits there) and the decode side with SGLang's
    decode-side tree (``--disaggregation-decode-enable-radix-cache``): the plugin's pool
    takes the decode pool's pre-allocated rows and its tree keeps finished requests, with
    its host tier under ``--enable-hierarchical-cache`` (:mod:`.pd_decode`).

    Raises:
        FlagError: ``--disaggregation-mode decode`` without
            ``--disaggregation-decode-enable-radix-cache`` (SGLang then runs the decode server
            without a tree, so there is no cache for the flag to choose);
            ``--enable-pd-role-switch`` without
            ``--disaggregation-decode-enable-radix-cache`` (either role may become the decode
            side). With ``--enable-hierarchical-cache`` a flip empties the host tier too (the
            pool's ``clear``, ``plugin/pool.py``)."""
    mode = getattr(server_args, "disaggregation_mode", "null")
    if mode == "decode":
        if not getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
            raise FlagError(
                f"{ENABLE_FLAG} on a decode server (--disaggregation-mode decode) needs "
                "--disaggregation-decode-enable-radix-cache (SGLang's switch for a decode-side "
                f"tree; without it there is no cache to run): add it, or drop {ENABLE_FLAG} "
                "on the decode server"
            )
    if mode in ("prefill", "decode") and getattr(server_args, "enable_pd_role_switch", False):
        # SGLang's flip (disaggregation/role_switch.py) keeps the pools and resets the tree;
        # the server may serve either side, so it must be a decode side the plugin serves
        if not getattr(server_args, "disaggregation_decode_enable_radix_cache", False):
            raise FlagError(
                f"{ENABLE_FLAG} with --enable-pd-role-switch needs "
                "--disaggregation-decode-enable-radix-cache (either role may become the decode "
                "side after a flip, and the plugin serves SGLang's decode path only with its "
                f"decode-side tree): add it, or drop {ENABLE_FLAG}"
            )


def _check_mamba_cache_size(server_args) -> None:
    """Refuse a ``--max-mamba-cache-size`` that serves no running request: SGLang caps running
    requests at ``size // ratio`` (``KVCacheConfigurator._calculate_mamba_ratio``: 3, plus the
    ping-pong tracking slots, 2 with overlap scheduling and 1 without), and one request holds
    its working state and two ping-pong checkpoints in the plugin's pool (SGLang would fail
    later with advice about GPU memory, also on CPU).

    Raises:
        FlagError: naming the flag and the smallest size that serves a request."""
    size = getattr(server_args, "max_mamba_cache_size", None)
    if size is None:
        return
    tracking = server_args.mamba_radix_cache_strategy != "no_buffer"
    need = 1 + (2 if tracking else 0)  # working state (+ two ping-pong checkpoints)
    overlap = not server_args.disable_overlap_schedule
    per_request = 3 + ((2 if overlap else 1) if tracking else 0)
    if size < max(need, per_request):
        what = "its working state and two ping-pong checkpoints" if tracking else "its working state"
        raise FlagError(
            f"--max-mamba-cache-size {size} is too small: with {ENABLE_FLAG} one running "
            f"request holds {need} SSM state slots ({what}) and SGLang budgets {per_request} per "
            f"running request ({'with' if overlap else 'without'} overlap scheduling), so give at least "
            f"{per_request}, about {per_request} per running request you want, or leave the "
            "flag out (sized from memory; 128 slots on --device cpu)"
        )


def _check_host_tier_size(server_args) -> None:
    """Refuse a ``--hicache-ratio`` whose host tier (``plugin/host_tier.py``) would hold no SSM
    state (``ratio x --max-mamba-cache-size < 1``) or no KV page (``ratio x --max-total-tokens``
    under one ``--page-size``), where those sizes are given; sized from memory, the scheduler
    refuses it at start-up instead. ``--hicache-size`` sizes the tier alone (as in SGLang).

    Raises:
        FlagError: naming the flags and the smallest ratio that holds one."""
    ratio = getattr(server_args, "hicache_ratio", None)
    if not getattr(server_args, "enable_hierarchical_cache", False) or getattr(server_args, "hicache_size", 0) \
            or ratio is None:
        return
    size = getattr(server_args, "max_mamba_cache_size", None)
    if size and int(size * ratio) < 1:
        raise FlagError(
            f"--hicache-ratio {ratio} x --max-mamba-cache-size {size} holds no SSM state in the "
            f"host tier of {ENABLE_FLAG}: give a ratio of at least {1 / size:g} (SGLang's default is 2)"
        )
    tokens = getattr(server_args, "max_total_tokens", None)
    page = getattr(server_args, "page_size", None) or 1
    if tokens and int(tokens * ratio) < page:
        raise FlagError(
            f"--hicache-ratio {ratio} x --max-total-tokens {tokens} holds no KV page of --page-size {page} "
            f"tokens in the host tier of {ENABLE_FLAG}: give a ratio of at least {page / tokens:g} "
            "(SGLang's default is 2)"
        )
