"""Command-line flags of the plugin and the start-up checks of flag combinations.

The plugin's flags enter SGLang 0.5.23 through four hooks (applied by SGLang's
``load_plugins()`` before ``prepare_server_args`` parses argv; mechanism in
``docs/design.md``, "SGLang wiring"). Every check raises a
:class:`~sglang_mamba_ext.plugin.startup_errors.FlagError` (a ``ValueError`` naming the flag
and the fix), which the launchers report like an argparse error (usage line, ``error: ...``,
exit status 2). Without the plugin's flags these hooks leave the parsed ``ServerArgs`` exactly
as SGLang makes it (no field written, no extra attribute).

- AFTER ``ServerArgs.add_cli_args(parser)``: adds ``--enable-mamba-radix`` and
  ``--warmup-prompts-file PATH`` (so ``python -m sglang.launch_server --help`` lists them).
- AFTER ``ServerArgs.from_cli_args(namespace)``: turns ``--enable-mamba-radix`` into SGLang
  settings (:func:`apply_flags`), checks the prompts file, and, when one of the plugin's flags
  was given, stores the plugin's settings as ``ServerArgs._mamba_radix_ext`` (see
  :mod:`.settings`).
- AROUND ``arg_groups.mamba_hook.validate_mamba_extra_buffer``: SGLang refuses its
  ``extra_buffer`` checkpoint tracking on CPU and for models whose registry spec does not
  declare support; under ``--enable-mamba-radix`` a model whose linear-attention backend
  declares ``writes_mamba_track_states = True`` (it writes the ping-pong checkpoints from
  SGLang's track metadata in plain torch, e.g. the tiny test model) is accepted on any
  device. Any other refusal is re-raised naming the flags.
- AROUND ``arg_groups.model_hook.handle_mamba_radix_cache``: a model without SSM state under
  ``--enable-mamba-radix`` fails with a message naming the flag (instead of SGLang's message
  about ``--mamba-radix-cache-strategy``, which the user did not pass); hybrid classes SGLang's
  list leaves out are declared first (:mod:`.hybrid_declare`).
"""
from __future__ import annotations

import math
import os

import logging
import pkgutil
from typing import Any, Dict

from sglang_mamba_ext.plugin import settings as S
from sglang_mamba_ext.plugin.args_combos import (  # noqa: F401  (_take_storage_backend: tests)
    _check_disaggregation, _check_host_tier_size, _check_mamba_cache_size, _map_replayssm, _take_storage_backend)
from sglang_mamba_ext.plugin.cpu_defaults import ENABLE_FLAG
from sglang_mamba_ext.plugin.hybrid_declare import declare_missing_hybrid
from sglang_mamba_ext.plugin.startup_errors import FlagError, check_plugin_env, remember_parser

logger = logging.getLogger(__name__)

#: SGLang's overlap scheduler on ``--device cpu`` with ``--enable-mamba-radix``: ``1`` (the
#: default, as on a GPU) or ``0`` (off, as ``--disable-overlap-schedule``).
CPU_OVERLAP_ENV = "SGLANG_MAMBA_EXT_CPU_OVERLAP"

PROMPTS_FLAG = "--warmup-prompts-file"


def add_cli_args_after(result, parser, *args, **kwargs):
    """AFTER hook on the static ``ServerArgs.add_cli_args(parser)``."""
    if ENABLE_FLAG in parser._option_string_actions:  # applied twice (tests)
        return None
    remember_parser(parser)
    group = parser.add_argument_group("sglang-mamba-ext")
    group.add_argument(
        ENABLE_FLAG,
        action="store_true",
        default=False,
        help=(
            "Serve a hybrid (full attention + linear attention / SSM) model with "
            "sglang-mamba-ext's prefix cache holding both attention KV and SSM state "
            f"(--radix-cache-backend {S.BACKEND_NAME}) and its hybrid request pool; SSM "
            "checkpoints are tracked every --mamba-track-interval tokens. Without "
            f"--radix-eviction-policy it evicts states by the {S.DEFAULT_POLICY} policy. Cannot be "
            "combined with --disable-radix-cache or another --radix-cache-backend."
        ),
    )
    group.add_argument(
        PROMPTS_FLAG,
        type=str,
        default=None,
        metavar="PATH",
        help=(
            f"Prompts the '{S.WARMUP_NAME}' warmup (--warmups {S.WARMUP_NAME}) caches before "
            "the server reports ready: a JSON list of strings, or JSON lines of "
            '{"text": ...}, {"input_ids": [...]} or {"messages": [...]} (chat template '
            "applied). Each is sent with max_new_tokens=1, then again so the prefix-hit "
            "path is warm."
        ),
    )
    return None


def _warmup_names(server_args) -> list:
    raw = getattr(server_args, "warmups", None) or ""
    return [w.strip() for w in raw.split(",") if w.strip()]


def apply_flags(server_args, enable: bool, prompts_file) -> Dict[str, Any]:
    """Check the plugin's flags against the rest and set SGLang fields before resolution.

    With ``enable``: ``radix_cache_backend = "mamba_radix_ext"``; strategy ``auto`` becomes
    ``extra_buffer`` (SGLang's ping-pong tracking pipeline feeds the cache's checkpoints);
    with ``no_buffer`` overlap scheduling is turned off, as SGLang's no_buffer path requires,
    and on ``--device cpu`` with ``SGLANG_MAMBA_EXT_CPU_OVERLAP=0`` or for a PD prefill
    server (``--disaggregation-mode prefill``); otherwise it stays as
    SGLang sets it (on unless ``--disable-overlap-schedule``), on CPU as on a GPU. A user's
    explicit strategy wins. Without ``--radix-eviction-policy`` on the command line
    (SGLang's ``_radix_eviction_policy_explicitly_set``) the policy becomes
    :data:`.settings.DEFAULT_POLICY` (``adaptive``); a named one, ``lru`` included, is kept.

    Raises:
        FlagError: ``SGLANG_MAMBA_EXT_CPU_OVERLAP`` other than ``0`` or ``1``.

    Returns:
        the plugin settings stored on ``server_args``.

    Raises:
        FlagError: (a ``ValueError``) naming the flags, for combinations that cannot work,
            a ``--mamba-track-interval`` of 0 or less, and for a bad or missing prompts file (see :func:`sglang_mamba_ext.plugin.warmup.load_prompts`).
    """
    from sglang_mamba_ext.plugin.warmup import load_prompts

    warmups = _warmup_names(server_args)
    if S.WARMUP_NAME in warmups and not prompts_file:
        raise FlagError(
            f"--warmups {S.WARMUP_NAME} needs {PROMPTS_FLAG} PATH (the prompts to cache at start-up)"
        )
    if prompts_file:
        prompts = load_prompts(prompts_file)  # fail before the model loads
        _check_prompt_vocab(prompts, prompts_file, getattr(server_args, "model_path", None))
        if S.WARMUP_NAME not in warmups:
            logger.warning(
                "%s %s is ignored without --warmups %s", PROMPTS_FLAG, prompts_file, S.WARMUP_NAME
            )
        else:
            logger.info("%s %s: %d prompts", PROMPTS_FLAG, prompts_file, len(prompts))
    settings: Dict[str, Any] = {"enable": bool(enable), "warmup_prompts_file": prompts_file}
    policy = getattr(server_args, "radix_eviction_policy", "lru")
    if not enable:
        if policy in S.PLUGIN_POLICIES:
            raise FlagError(
                f"--radix-eviction-policy {policy} is sglang-mamba-ext's policy: "
                f"add {ENABLE_FLAG} (or choose another policy)"
            )
        return settings

    def refuse(flag: str, why: str = "") -> None:
        raise FlagError(f"{ENABLE_FLAG} cannot be combined with {flag}{why}; drop one of them")

    _check_disaggregation(server_args)

    interval = getattr(server_args, "mamba_track_interval", None)
    if interval is not None and interval <= 0:
        raise FlagError(
            f"--mamba-track-interval ({interval}) must be a positive number of tokens, a multiple of "
            f"--page-size (SGLang's default is 256)"
        )
    if server_args.disable_radix_cache:
        refuse("--disable-radix-cache", " (it is a radix prefix cache)")
    backend = server_args.radix_cache_backend
    if backend not in (None, "", S.BACKEND_NAME):
        refuse(f"--radix-cache-backend {backend}", f" (it selects --radix-cache-backend {S.BACKEND_NAME})")
    # still refused, each with SGLang's own reason (docs/flags.md, "What is refused")
    checks = [
        ("enable_unified_memory", "--enable-unified-memory",
         "SGLang builds its unified byte pool and virtual-to-physical slot translation for its own "
         "UnifiedRadixCache and pools only (mem_cache/kv_cache_configurator.py), and on CPU it refuses "
         "the pair's implied --enable-page-major-kv-layout with a torch_native attention backend itself "
         "(arg_groups/kv_cache_hook.py)"),
    ]
    for field, flag, why in checks:
        if getattr(server_args, field, False):
            refuse(flag, f" ({why})")
    if getattr(server_args, "enable_lmcache", False):
        # served by the plugin's own connector (plugin/lmcache_connector.py; docs/flags.md,
        # "LMCache"); SGLang's own refusals (int8 states: "LMCache is not int8-aware",
        # arg_groups/mamba_hook.py; --enable-hierarchical-cache: "mutually exclusive",
        # arg_groups/kv_cache_hook.py) still apply during resolution
        from sglang_mamba_ext.plugin.lmcache_connector import lmcache_installed

        if not lmcache_installed():
            raise FlagError(
                f"{ENABLE_FLAG} --enable-lmcache needs the lmcache package (pip install lmcache; measured with "
                "lmcache 0.5.6, docs/flags.md, \"LMCache\")"
            )
        ranks = {n: int(getattr(server_args, f, 1) or 1) for n, f in (("--tp", "tp_size"), ("--pp", "pp_size"),
                                                                       ("--dp", "dp_size"))}
        if any(v > 1 for v in ranks.values()):
            refuse("--enable-lmcache at " + " / ".join(f"{n} {v}" for n, v in ranks.items()),
                   " (the plugin's LMCache connector serves one rank: its lookups and loads are not agreed "
                   "across ranks, so the ranks' trees could differ; docs/flags.md, \"LMCache\")")
    _map_replayssm(server_args)
    _take_storage_backend(server_args, settings, refuse)
    host_ratio = getattr(server_args, "hicache_ratio", None)
    host_size = getattr(server_args, "hicache_size", 0) or 0
    if getattr(server_args, "enable_hierarchical_cache", False):
        if not math.isfinite(host_size) or host_size < 0:
            refuse(f"--enable-hierarchical-cache --hicache-size {host_size}",
                   " (its host tier needs a positive size in GiB, or 0 to size it by --hicache-ratio)")
        # --hicache-size, when given, sizes the tier and the ratio is not read (as in SGLang)
        if not host_size and host_ratio is not None and not (math.isfinite(host_ratio) and host_ratio > 0):
            refuse(f"--enable-hierarchical-cache --hicache-ratio {host_ratio}",
                   " (its host tier needs a positive, finite number of host states per device slot; "
                   "SGLang's default is 2)")
    if getattr(server_args, "enable_hierarchical_cache", False):
        # the host tier of the tree's states (docs/design.md, "Host tier")
        mode = getattr(server_args, "hicache_host_memory_mode", "cache")
        if mode not in (None, "cache"):
            refuse(f"--hicache-host-memory-mode {mode}",
                   " (SGLang: 'buffer_only requires a storage backend (--hicache-storage-backend): host "
                   "memory is only a staging buffer and all cached data lives in storage', "
                   "arg_groups/hicache_hook.py, and 'is only implemented for the unified radix tree', "
                   "mem_cache/registry.py; the plugin's host tier is a cache above its storage tier: "
                   "mode cache)")
    if not getattr(server_args, "_radix_eviction_policy_explicitly_set", False):
        # SGLang records whether argv named the policy (server_args.prepare_server_args), as its
        # model overrides do before choosing theirs: unnamed, the plugin's default applies
        policy = S.DEFAULT_POLICY
        server_args.radix_eviction_policy = policy
    if getattr(server_args, "radix_eviction_policy_config", None):
        logger.warning(
            "%s: --radix-eviction-policy-config is ignored: it configures SGLang's own eviction "
            "policies, and the plugin's cache evicts by --radix-eviction-policy %s", ENABLE_FLAG, policy,
        )
    if policy not in S.SUPPORTED_POLICIES:
        refuse(
            f"--radix-eviction-policy {policy}",
            f" (its cache supports {' and '.join(S.SUPPORTED_POLICIES)})",
        )
    settings["eviction_policy"] = policy
    strategy = server_args.mamba_radix_cache_strategy
    if strategy == "extra_buffer_lazy":
        raise FlagError(
            f"{ENABLE_FLAG} cannot be combined with --mamba-radix-cache-strategy extra_buffer_lazy; "
            "use extra_buffer (the default with the flag) or no_buffer"
        )

    server_args.radix_cache_backend = S.BACKEND_NAME
    if strategy == "auto":
        server_args.mamba_radix_cache_strategy = "extra_buffer"
    # SGLang's overlap scheduler runs on CPU too, and the cache is as exact under it as
    # without it (docs/design.md, "Overlap scheduling"): kept on, as on a GPU.
    cpu_overlap = os.environ.get(CPU_OVERLAP_ENV, "1") or "1"
    if cpu_overlap not in ("0", "1"):
        raise FlagError(f"{CPU_OVERLAP_ENV}={cpu_overlap!r}: expected 1 (overlap scheduling on CPU, the "
                        "default) or 0 (off, as --disable-overlap-schedule)")
    check_plugin_env()
    # The prefill side of PD disaggregation is served and tested on CPU without overlap
    # only (SGLang's overlapped prefill loop with the CPU transfer backend is untested).
    pd_mode = str(getattr(server_args, "disaggregation_mode", "null"))
    pd_cpu = server_args.device == "cpu" and (  # a role-switch server may become a prefill server
        pd_mode == "prefill" or (pd_mode == "decode" and getattr(server_args, "enable_pd_role_switch", False)))
    if ((server_args.device == "cpu" and (cpu_overlap == "0" or pd_cpu))
            or server_args.mamba_radix_cache_strategy == "no_buffer") and not server_args.disable_overlap_schedule:
        server_args.disable_overlap_schedule = True
        logger.info("%s: overlap scheduling off (no_buffer, a PD prefill or role-switch server on CPU, or %s=0 on CPU)",
                    ENABLE_FLAG, CPU_OVERLAP_ENV)
    settings["strategy"] = server_args.mamba_radix_cache_strategy
    _check_mamba_cache_size(server_args)
    _check_host_tier_size(server_args)
    return settings


def _check_prompt_vocab(prompts, prompts_file: str, model_path) -> None:
    """Refuse ``input_ids`` prompts with a token id outside the vocabulary of a local model's
    ``config.json`` (``vocab_size``), at parse time; a hub model name is checked by the
    warm-up itself once the tokenizer manager knows the vocabulary.

    Raises:
        PromptsFileError: naming the file, the line and the vocabulary size."""
    from sglang_mamba_ext.plugin.cpu_defaults import local_model_config
    from sglang_mamba_ext.plugin.warmup import PromptsFileError

    vocab = local_model_config(model_path).get("vocab_size")
    if not isinstance(vocab, int):
        return
    for p in prompts:
        if p.kind != "input_ids" or not p.value:
            continue
        bad = max(p.value) if max(p.value) >= vocab else (min(p.value) if min(p.value) < 0 else None)
        if bad is not None:
            raise PromptsFileError(
                f"{PROMPTS_FLAG} {prompts_file}:{p.line}: token id {bad} is outside the vocabulary "
                f"(size {vocab}) of {model_path}"
            )


def from_cli_args_after(result, cls, args, *rest, **kwargs):
    """AFTER hook on the classmethod ``ServerArgs.from_cli_args(namespace)``.

    Attaches ``ServerArgs._mamba_radix_ext`` only when ``--enable-mamba-radix`` or
    ``--warmup-prompts-file`` was given; otherwise the record stays as SGLang built it
    (:func:`.settings.settings_of` then reads ``{}``).

    Raises:
        FlagError: from :func:`apply_flags`."""
    enable = bool(getattr(args, "enable_mamba_radix", False))
    prompts_file = getattr(args, "warmup_prompts_file", None)
    settings = apply_flags(result, enable, prompts_file)
    if enable or prompts_file:
        setattr(result, S.SETTINGS_ATTR, settings)
    S.remember(settings)
    return result


# -- resolution-time checks --------------------------------------------------------------


def backend_writes_track_states(hf_config) -> bool:
    """Whether the model's registered linear-attention backend declares
    ``writes_mamba_track_states = True`` (it writes SGLang's extra_buffer checkpoints
    itself, on any device)."""
    from sglang.srt.configs.linear_attn_model_registry import get_linear_attn_spec

    spec = get_linear_attn_spec(hf_config)
    name = getattr(spec, "backend_class_name", None) if spec is not None else None
    if not name:
        return False
    try:
        backend_cls = pkgutil.resolve_name(name)
    except (ImportError, AttributeError, ValueError):
        return False
    return bool(getattr(backend_cls, "writes_mamba_track_states", False))


def _sglang_kernels_interpreted(hf_config) -> bool:
    """The tiny model served by SGLang's own GDN / KDA backend with their Triton kernels under
    Triton's interpreter (``plugin/triton_interpret.py``): SGLang's extra_buffer tracking then
    runs on CPU too, although SGLang's platform check allows it only on GPUs."""
    from sglang_mamba_ext.plugin.tiny_hybrid import SGLANG_KERNEL_ARCHITECTURES
    from sglang_mamba_ext.plugin.triton_interpret import interpreting

    from sglang_mamba_ext.plugin.cpu_defaults import INKLING_ARCHITECTURES

    archs = getattr(hf_config, "architectures", None) or []
    # Inkling's sconv backend writes the track windows in its own Triton kernels
    # (models/inkling_common/sconv.py: fused_gather_scatter_to_sconv_cache, the decode kernel's track)
    return any(a in SGLANG_KERNEL_ARCHITECTURES or a in INKLING_ARCHITECTURES for a in archs) and interpreting()


def _ours(server_args_or_view) -> bool:
    return getattr(server_args_or_view, "radix_cache_backend", None) == S.BACKEND_NAME


def validate_mamba_extra_buffer_around(original, view, hf_config, *args, **kwargs):
    """AROUND hook on ``arg_groups.mamba_hook.validate_mamba_extra_buffer``."""
    if not _ours(view):
        return original(view, hf_config, *args, **kwargs)
    if backend_writes_track_states(hf_config) or _sglang_kernels_interpreted(hf_config):
        interval = view.mamba_track_interval
        drafts = getattr(view, "speculative_num_draft_tokens", None)
        if drafts is not None and interval < drafts:
            raise FlagError(
                f"--mamba-track-interval ({interval}) must be >= --speculative-num-draft-tokens ({drafts})"
            )
        # The page against the model first: a track interval cannot fix a bad page size.
        _check_page_grid(view, hf_config)
        page = getattr(view, "page_size", None)
        if page is not None and interval % page:
            raise FlagError(f"--mamba-track-interval ({interval}) must be a multiple of --page-size ({page})")
        return None
    try:
        return original(view, hf_config, *args, **kwargs)
    except AssertionError as exc:
        raise FlagError(
            f"{ENABLE_FLAG} tracks SSM checkpoints with SGLang's extra_buffer pipeline "
            f"(--mamba-radix-cache-strategy extra_buffer), which SGLang refuses here: {str(exc).rstrip('.')}. "
            "Pass --mamba-radix-cache-strategy no_buffer to cache without ping-pong checkpoints."
        ) from exc


def _check_page_grid(view, hf_config) -> None:
    """``--page-size`` against the model's linear-attention state chunk (``mamba_chunk_size``
    in its config, else FLA's 64 tokens) and ``--chunked-prefill-size``: SGLang asserts both
    divisibilities inside the scheduler process (``mamba_cache_chunk_size`` in
    ``arg_groups/overrides.py``, the chunked-prefill check), which dies with a traceback;
    under the plugin's flag they fail at start-up instead.

    Raises:
        FlagError: naming the flags and page sizes that work."""
    page = getattr(view, "page_size", None) or 1
    chunk = int(getattr(hf_config, "mamba_chunk_size", 64) or 64)
    if max(chunk, page) % min(chunk, page):
        below = page - page % chunk if page > chunk else max(d for d in range(1, page + 1) if chunk % d == 0)
        above = page + (chunk - page % chunk) if page > chunk else chunk
        raise FlagError(
            f"{ENABLE_FLAG}: --page-size {page} must divide or be a multiple of the model's "
            f"linear-attention state chunk ({chunk} tokens, mamba_chunk_size in its config); "
            f"use --page-size {below} or {above}"
        )
    prefill = getattr(view, "chunked_prefill_size", None)
    if prefill is not None and prefill > 0 and prefill % page:
        raise FlagError(
            f"{ENABLE_FLAG}: --chunked-prefill-size {prefill} must be a multiple of --page-size {page}; "
            f"use --chunked-prefill-size {prefill - prefill % page or page}"
        )


def int8_mamba_checkpoint_step(server_args, previous) -> None:
    """Override of SGLang's resolution step ``handle_int8_mamba_checkpoint``
    (``arg_groups/mamba_hook.py``), which refuses ``--enable-int8-mamba-checkpoint`` with any
    ``--radix-cache-backend`` ("is not int8-aware") and with ``--enable-hierarchical-cache``
    ("the host-offload path is not int8-aware"): both reasons are about SGLang's own cache
    and host offload reading checkpoint slots as active ones. The plugin's cache keeps its
    states in SGLang's checkpoint pool and its host tier copies those int8 slots
    (``docs/design.md``, "int8 checkpoints" and "Host tier"), so under ``--enable-mamba-radix``
    the step runs with both hidden: its other refusal (``--enable-lmcache``) still applies."""
    if not _ours(server_args):
        return previous(server_args)
    previous(_BackendHidden(server_args))


class _BackendHidden:
    """Read-only view of server arguments that shows no ``radix_cache_backend`` and no
    ``enable_hierarchical_cache`` (the plugin's own cache and host tier)."""

    __slots__ = ("_server_args",)

    _HIDDEN = {"radix_cache_backend": None, "enable_hierarchical_cache": False}

    def __init__(self, server_args):
        object.__setattr__(self, "_server_args", server_args)

    def __getattr__(self, name):
        if name in _BackendHidden._HIDDEN:
            return _BackendHidden._HIDDEN[name]
        return getattr(object.__getattribute__(self, "_server_args"), name)

    def __setattr__(self, name, value):
        raise AttributeError("read-only view of the server arguments")


def handle_mamba_radix_cache_around(original, server_args, hf_config, *args, **kwargs):
    """AROUND hook on ``arg_groups.model_hook.handle_mamba_radix_cache``."""
    if not _ours(server_args):
        return original(server_args, hf_config, *args, **kwargs)
    arch = (getattr(hf_config, "architectures", None) or ["?"])[0]
    message = (
        f"{ENABLE_FLAG} needs a hybrid model with linear-attention / SSM layers; {arch} has "
        f"none (drop {ENABLE_FLAG})"
    )
    declare_missing_hybrid(server_args, hf_config)  # classes SGLang's list leaves out
    try:
        result = original(server_args, hf_config, *args, **kwargs)
    except ValueError as exc:
        if "needs mamba state" in str(exc):
            raise FlagError(message) from exc
        raise
    from sglang.srt.arg_groups.model_override_base import resolved_view

    if not resolved_view(server_args).uses_mamba_radix_cache:
        raise FlagError(message)
    return result
