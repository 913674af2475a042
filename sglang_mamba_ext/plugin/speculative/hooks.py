"""SGLang 0.5.23 seams of ``--mamba-spec-state-update deferred`` (see the package docstring).

Each function below is a hook for :class:`sglang.srt.plugins.hook_registry.HookRegistry`
(``AFTER``: ``fn(result, *args)``; ``BEFORE``: ``fn(*args)``; ``AROUND``:
``fn(original, *args)``). All of them are no-ops unless the server arguments carry
``_mamba_spec_state_update == "deferred"``; the SGLang-independent logic lives in
:class:`sglang_mamba_ext.speculative.deferred.DeferredSpecState`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from sglang_mamba_ext.plugin.startup_errors import FlagError
from sglang_mamba_ext.speculative.deferred import DeferredSpecState
from sglang_mamba_ext.speculative.stash import StashDims
from sglang_mamba_ext.speculative.verify_onchip import choose_verify

logger = logging.getLogger(__name__)

FLAG = "--mamba-spec-state-update"
ATTR = "_mamba_spec_state_update"
CHOICES = ("snapshot", "deferred")
POOL_ATTR = "mamba_spec_deferred"  # DeferredSpecState attached to a MambaPool
#: ``SGLANG_MAMBA_EXT_CPU_KERNELS`` (also read by ``plugin/cpu_bridges.py``): ``triton`` runs
#: the deferred verify's and replay's Triton kernels on CPU too (under Triton's interpreter).
CPU_KERNELS_ENV = "SGLANG_MAMBA_EXT_CPU_KERNELS"


def kernel_impl(device) -> str:
    """The deferred update's kernels in serving: ``"triton"`` on CUDA (compiled); on CPU
    ``"torch"``, the torch references the Triton kernels are tested against (the interpreter ran
    a tiny model's verify at seconds per round), unless :data:`CPU_KERNELS_ENV` is ``triton``.
    ``device``: a ``torch.device`` or a tensor on it."""
    import os

    dev = getattr(device, "device", device)
    if torch.device(dev).type == "cuda":
        return "triton"
    return "triton" if os.environ.get(CPU_KERNELS_ENV, "torch").strip().lower() == "triton" else "torch"


#: ``--speculative-algorithm`` values accepted with ``deferred`` at flag level, and what SGLang
#: resolves them to (``get_spec().speculative_algorithm`` in the model runner): FROZEN_KV_MTP's
#: worker and EAGLE's worker (NEXTN is EAGLE with the model's own MTP head), the two per-round
#: entry points :data:`WORKER_ENTRY_POINTS` replays at.
FLAG_ALGORITHMS = ("FROZEN_KV_MTP", "NEXTN", "EAGLE")
RESOLVED_ALGORITHMS = ("FROZEN_KV_MTP", "EAGLE", "NEXTN")
#: Each speculative worker's per-round entry (a decode round = draft, verify, draft extend); a
#: BEFORE hook on each replays the stash (:func:`worker_forward_before`). FrozenKVMTPWorkerV2
#: subclasses EAGLEWorkerV2 but overrides the method without calling it, so one replay a round.
WORKER_ENTRY_POINTS = (
    "sglang.srt.speculative.frozen_kv_mtp_worker_v2.FrozenKVMTPWorkerV2.forward_batch_generation",
    "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.forward_batch_generation",
)


class DeferredSpecConfigError(FlagError):
    """An invalid combination with ``--mamba-spec-state-update deferred`` (a ``ValueError``;
    at start-up the launcher reports it like an argparse error,
    :mod:`sglang_mamba_ext.plugin.startup_errors`)."""


# ---------------------------------------------------------------------------------------
# server arguments
# ---------------------------------------------------------------------------------------


def _server_args() -> Any:
    try:
        from sglang.srt.runtime_context import get_server_args

        return get_server_args()
    except Exception:  # not published yet in this process
        return None


def mode(server_args: Any = None) -> str:
    """The value of ``--mamba-spec-state-update`` in effect (``"snapshot"`` when the flag was
    not given: the attribute is then absent)."""
    sa = server_args if server_args is not None else _server_args()
    return getattr(sa, ATTR, "snapshot") if sa is not None else "snapshot"


def deferred_active(server_args: Any = None) -> bool:
    return mode(server_args) == "deferred"


def add_cli_args_after(result, parser) -> None:
    """AFTER ``ServerArgs.add_cli_args``: add ``--mamba-spec-state-update``."""
    if FLAG in getattr(parser, "_option_string_actions", {}):
        return None
    parser.add_argument(
        FLAG,
        type=str,
        choices=list(CHOICES),
        default=None,  # not given: ServerArgs stays as SGLang builds it; means snapshot
        help=(
            "How speculative verify handles Mamba/linear-attention state (sglang-mamba-ext). "
            "'snapshot' (default): SGLang's own path, per-layer per-draft-token states, scattered "
            "after acceptance. 'deferred': a one-layer verify buffer, a stash of the accepted "
            "tokens' activations and replay at the start of the next round; needs "
            "--speculative-algorithm FROZEN_KV_MTP, NEXTN or EAGLE with a draft without linear "
            "layers (e.g. the model's own MTP head), a KDA or Gated DeltaNet hybrid target and "
            "--disable-overlap-schedule."
        ),
    )
    return None


def validate_flags(server_args: Any, value: str) -> None:
    """Flag-level checks (model-level ones run when the model runner starts).

    Raises:
        DeferredSpecConfigError: naming the flags to change.
    """
    if value not in CHOICES:
        raise DeferredSpecConfigError(f"{FLAG} must be one of {CHOICES}, got {value!r}")
    if value != "deferred":
        return
    algo = getattr(server_args, "speculative_algorithm", None)
    if algo is None:
        raise DeferredSpecConfigError(
            f"{FLAG} deferred needs speculative decoding: pass --speculative-algorithm FROZEN_KV_MTP, NEXTN "
            f"or EAGLE (or drop {FLAG})"
        )
    if str(algo).upper() not in FLAG_ALGORITHMS:
        # the resolved algorithm (NEXTN runs as EAGLE; EAGLE / NEXTN may be promoted to
        # FROZEN_KV_MTP for frozen-KV drafts) is checked again at model-runner start
        raise DeferredSpecConfigError(
            f"{FLAG} deferred works with --speculative-algorithm FROZEN_KV_MTP, NEXTN or EAGLE only, got {algo}"
        )
    if getattr(server_args, "enable_linear_replayssm_spec", False):
        raise DeferredSpecConfigError(
            f"{FLAG} deferred and --enable-linear-replayssm-spec both replace the intermediate SSM "
            "buffer; choose one (SGLang's ReplaySSM spec path covers linear draft chains only, "
            f"deferred also covers trees with --speculative-eagle-topk > 1)"
        )
    if getattr(server_args, "enable_linear_replayssm", False):
        raise DeferredSpecConfigError(
            f"{FLAG} deferred cannot be combined with --enable-linear-replayssm (the decode ring "
            "keeps the SSM state outside the pool this mode replays into)"
        )
    if not getattr(server_args, "disable_overlap_schedule", False):
        raise DeferredSpecConfigError(
            f"{FLAG} deferred needs --disable-overlap-schedule: it moves the state update of "
            "round N (and its ping-pong checkpoint) to the start of round N+1, which the overlap "
            "scheduler would run while it still processes round N's results"
        )


def from_cli_args_after(result, cls, args) -> None:
    """AFTER ``ServerArgs.from_cli_args``: when ``--mamba-spec-state-update`` was given,
    validate it and store the value as ``server_args._mamba_spec_state_update`` (it travels
    with the pickled ServerArgs to the scheduler / worker processes); when it was not, the
    record is left as SGLang built it.

    Raises:
        DeferredSpecConfigError: from :func:`validate_flags`."""
    value = getattr(args, "mamba_spec_state_update", None)
    if value is None:
        return None
    validate_flags(result, value)
    result.__dict__[ATTR] = value
    return None


# ---------------------------------------------------------------------------------------
# start-up checks that need the model
# ---------------------------------------------------------------------------------------


#: Class names of linear-attention / SSM layers (SGLang's ``RadixLinearAttention`` for GDN,
#: KDA and the tiny model, ``MambaMixer2`` / ``MambaMixer1``, GDN / delta-rule, short-conv and
#: lightning mixers) matched along a module's class hierarchy.
_STATE_LAYER_NAMES = ("RadixLinearAttention", "MambaMixer", "GatedDeltaNet", "DeltaAttention", "ShortConv",
                      "LightningMixer")


def model_state_layers(model) -> list:
    """Names of the modules of a loaded ``model`` that keep a Mamba / linear-attention state
    (:data:`_STATE_LAYER_NAMES` on the class or a base class)."""
    found = []
    for name, mod in model.named_modules():
        if any(k in c.__name__ for c in type(mod).__mro__ for k in _STATE_LAYER_NAMES):
            found.append(name or type(mod).__name__)
    return found


def _draft_state_layers(runner) -> list:
    """The draft's state-keeping layers: read off the loaded model, not its config (a model's
    own MTP head, e.g. ``Qwen3NextForCausalLMMTP``, is loaded with the target's hybrid config
    but builds one attention layer); by the config when no model is loaded."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    model = getattr(runner, "model", None)
    if model is not None and hasattr(model, "named_modules"):
        return model_state_layers(model)
    mcfg = getattr(runner, "model_config", None)
    return ["(config)"] if mcfg is not None and mambaish_config(mcfg) is not None else []


def model_runner_init_after(result, runner, *args, **kwargs) -> None:
    """AFTER ``ModelRunner.__init__``: the target must be a linear-attention hybrid (the
    family is checked when its pool is built, :func:`mamba_pool_init_around`), the loaded draft
    must have no Mamba/linear-attention layers (:func:`_draft_state_layers`), the resolved
    algorithm must be FROZEN_KV_MTP or EAGLE (NEXTN).

    Raises:
        DeferredSpecConfigError
    """
    if not deferred_active():
        return None
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.runtime_context import get_spec

    mcfg = getattr(runner, "model_config", None)
    if getattr(runner, "is_draft_worker", False):
        layers = _draft_state_layers(runner)
        if layers:
            raise DeferredSpecConfigError(
                f"{FLAG} deferred requires a draft model without Mamba/linear-attention layers "
                f"(it replays only the target's state; this draft has {len(layers)}: {', '.join(layers[:3])}): "
                f"use another --speculative-draft-model-path (a frozen-KV draft, the model's own MTP head) or "
                f"{FLAG} snapshot"
            )
        return None
    algo = str(get_spec().speculative_algorithm or "").upper()
    if algo not in RESOLVED_ALGORITHMS:
        raise DeferredSpecConfigError(
            f"{FLAG} deferred works with --speculative-algorithm FROZEN_KV_MTP, NEXTN or EAGLE only "
            f"(resolved: {algo or None})"
        )
    if mcfg is None or mambaish_config(mcfg) is None:
        raise DeferredSpecConfigError(
            f"{FLAG} deferred needs a hybrid model with Mamba/linear-attention layers; "
            f"{getattr(mcfg, 'model_path', 'this model')} has none (drop {FLAG})"
        )
    return None


# ---------------------------------------------------------------------------------------
# pool construction
# ---------------------------------------------------------------------------------------


#: Layout name (:data:`sglang_mamba_ext.speculative.deferred.LAYOUTS`) of the target model
#: whose pools this process is building, set by :func:`configurator_init_pools_before`;
#: ``"unsupported:<config class>"`` for a linear-attention family without a replay kernel.
_target_layout: Optional[str] = None


def layout_name_for(configurator) -> Optional[str]:
    """The deferred layout of the model a ``KVCacheConfigurator`` sizes pools for (None: no
    linear-attention layers, e.g. the frozen-KV draft)."""
    if getattr(configurator, "mambaish_config", None) is None:
        return None
    if getattr(configurator, "hybrid_kda_config", None) is not None:
        return "kda"
    if getattr(configurator, "hybrid_gdn_config", None) is not None:
        return "gdn"
    from sglang_mamba_ext.plugin.speculative.mamba2_verify import layout_for

    if layout_for(configurator) is not None:  # Mamba2 mixers (Nemotron-H, Falcon-H1, GraniteMoeHybrid)
        return "mamba2"
    cfg = configurator.model_config.hf_config
    from sglang_mamba_ext.models.tiny_hybrid import TinyHybridConfig

    if isinstance(cfg, TinyHybridConfig):
        return "tiny-" + getattr(cfg, "linear_gate", "kda")
    return f"unsupported:{type(configurator.mambaish_config).__name__}"


def configurator_init_pools_before(configurator, *args, **kwargs) -> None:
    """BEFORE ``KVCacheConfigurator._init_pools``: remember which linear-attention backend the
    target's Mamba pool serves (the pool constructor is not told)."""
    global _target_layout
    if not deferred_active():
        return None
    name = layout_name_for(configurator)
    if name is not None:
        _target_layout = name
    return None


def _layout_for_pool(cache_params):
    from sglang_mamba_ext.speculative.deferred import LAYOUTS

    name = _target_layout
    if name is None:  # a pool built outside a model runner (tests): SGLang's own flag
        name = "kda" if getattr(cache_params, "is_kda", False) else f"unsupported:{type(cache_params).__name__}"
    if name not in LAYOUTS:
        raise DeferredSpecConfigError(
            f"{FLAG} deferred supports KDA (Kimi-Linear), Gated DeltaNet (Qwen3-Next), Mamba2 (Nemotron-H, "
            f"Falcon-H1, GraniteMoeHybrid) and the tiny hybrid model; this model's linear layers "
            f"({name.split(':', 1)[-1]}, e.g. short conv or Mamba1) need their own replay kernel: use {FLAG} snapshot"
        )
    return LAYOUTS[name]


def mamba_pool_init_around(original, pool, *args, **kwargs) -> None:
    """AROUND ``MambaPool.__init__``: in deferred mode, build the pool without SGLang's
    ``[L, N+1, T, ...]`` intermediate buffers, then give it one-layer buffers seen as ``L``
    layers (stride 0) and a :class:`DeferredSpecState` (``pool.mamba_spec_deferred``) in the
    target backend's :class:`~sglang_mamba_ext.speculative.deferred.StateLayout`. Where the
    per-rank head dims and the tree depth fit on chip
    (:func:`~sglang_mamba_ext.speculative.verify_onchip.choose_verify`), verify runs on chip and
    the one-layer *SSM* node buffer is not allocated (a one-element placeholder takes its place
    in ``intermediate_ssm``); the conv-window buffer stays.

    Raises:
        DeferredSpecConfigError: a linear-attention family without a replay kernel (Mamba2),
            or an unsupported pool layout.
    """
    T = kwargs.get("speculative_num_draft_tokens")
    if not deferred_active() or T is None:
        return original(pool, *args, **kwargs)
    cache_params = kwargs["cache_params"]
    layout = _layout_for_pool(cache_params)
    if kwargs.get("envelope_layout"):
        raise DeferredSpecConfigError(f"{FLAG} deferred does not support the envelope Mamba layout")
    kw = dict(kwargs)
    kw["speculative_num_draft_tokens"] = None  # no intermediate buffers
    original(pool, *args, **kw)
    from sglang.srt.mem_cache.memory_pool import MambaPool
    from sglang.srt.runtime_context import get_spec

    from sglang_mamba_ext.models.linear_attn import LinearAttnShape

    shape_p = cache_params.shape
    conv_shape = tuple(shape_p.conv[0])
    W = shape_p.conv_kernel
    conv_dim = conv_shape[1] if layout.conv_window_first else conv_shape[0]
    window = conv_shape[0] if layout.conv_window_first else conv_shape[1]
    if len(shape_p.conv) != 1 or window != W - 1:
        raise DeferredSpecConfigError(f"{FLAG} deferred: unsupported conv state layout {shape_p.conv} ({layout.name})")
    if layout.ssm_vk or layout.mamba2:  # Mamba2's [HV, P, N]: P plays V, N plays K (StateLayout)
        hv, v_dim, k_dim = shape_p.temporal
    else:
        hv, k_dim, v_dim = shape_p.temporal
    h_k = getattr(shape_p, "num_k_heads_per_tp", hv)
    if layout.mamba2:  # B / C groups of this rank: conv_dim = HV*P + 2*G*N
        h_k = (conv_dim - hv * v_dim) // (2 * k_dim)
    shape = LinearAttnShape(h_k, hv, k_dim, v_dim, W)
    if shape.conv_dim != conv_dim:
        raise DeferredSpecConfigError(f"{FLAG} deferred: conv_dim {conv_dim} != 2*H*K + HV*V of {shape}")
    L = len(kwargs["mamba_layer_ids"])
    R = kwargs["spec_state_size"] + 1
    steps = int(get_spec().speculative_num_steps or (T - 1))
    try:  # tree depth = steps + 1 (EAGLE trees and topk-1 chains)
        verify, why = choose_verify(k_dim, v_dim, steps + 1)
    except ValueError as e:
        raise DeferredSpecConfigError(f"{FLAG} deferred: {e}") from None
    state = DeferredSpecState(
        num_layers=L, num_rows=R, draft_token_num=T, max_accept=steps + 1, shape=shape,
        dims=StashDims(conv_dim, layout.gate_dim(shape), 0 if layout.mamba2 else hv),
        ssm_state_shape=tuple(shape_p.temporal),
        conv_state_shape=conv_shape, ssm_dtype=cache_params.dtype.temporal,
        conv_dtype=cache_params.dtype.conv, act_dtype=cache_params.dtype.conv, device=kwargs["device"],
        layout=layout, verify=verify,
    )
    ssm_view, conv_view = state.layered_views()
    old = pool.mamba_cache
    pool.mamba_cache = MambaPool.SpeculativeState(
        conv=old.conv, temporal=old.temporal, intermediate_ssm=ssm_view, intermediate_conv_window=[conv_view],
    )
    setattr(pool, POOL_ATTR, state)
    logger.info("mamba-spec-state-update=deferred (%s): no intermediate SSM buffer; verify_variant=%s (%s); %s", layout.name,
                verify, why, {k: f"{v / 2**20:.1f} MiB" for k, v in state.nbytes().items()})
    return None


def _state_of(obj) -> Optional[DeferredSpecState]:
    """The DeferredSpecState behind a req_to_token_pool / MambaPool, if any."""
    pool = getattr(obj, "mamba_pool", obj)
    return getattr(pool, POOL_ATTR, None)


def pool_views(pool) -> tuple:
    """Main-state views in the replay layout: ``conv [L, slots, conv_dim, W-1]`` and
    ``temporal [L, slots, HV, K, V]`` (from the pool's own layout)."""
    mc = pool.mamba_cache
    return getattr(pool, POOL_ATTR).layout.replay_views(mc.conv[0], mc.temporal)


# ---------------------------------------------------------------------------------------
# verify, commit, replay, release
# ---------------------------------------------------------------------------------------


def capture_verify_inputs(req_to_token_pool, layer_id: int, conv_weight, conv_bias, A_log, dt_bias,
                          mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """The backend-neutral capture point: in deferred mode, copy one linear layer's verify
    inputs of all tree nodes (``mixed_qkv [n, conv_dim]``, raw gate ``a [n, gate_dim]``, raw
    ``b [n, HV]``) into the pending workspace and register the layer's replay weights
    (``conv_weight`` ``conv_dim * W`` elements, ``conv_bias [conv_dim]`` or None, ``A_log
    [HV]``, ``dt_bias [gate_dim]``). Returns whether deferred mode is on for this pool (False:
    nothing done). Called by each backend adapter (SGLang's KDA / GDN backends through the
    hooks below, the tiny backend directly)."""
    state = _state_of(req_to_token_pool)
    if state is None:
        return False
    if isinstance(mixed_qkv, (tuple, list)):
        raise DeferredSpecConfigError(f"{FLAG} deferred: split q/k/v conv inputs are not supported")
    l = req_to_token_pool.mamba_map[layer_id]
    state.register_layer(l, conv_weight, conv_bias, A_log, dt_bias)
    state.capture(l, mixed_qkv, a, b)
    return True


def onchip_state(req_to_token_pool) -> Optional[DeferredSpecState]:
    """The pool's DeferredSpecState if its verify runs on chip (the tiny backend asks)."""
    state = _state_of(req_to_token_pool)
    return state if state is not None and state.on_chip else None


def _verify_deferred(backend, layer, forward_batch, mixed_qkv, a, b, run):
    """Capture, then ``run()`` the backend's own verify — on chip through
    :func:`.onchip_dispatch.run_onchip` when the pool has no node-state buffer; if the layout's verify kernel rolls
    the main conv windows in place (SGLang's ``causal_conv1d_update``, which snapshot mode
    undoes in its commit scatter), the batch's windows of this layer are saved before and
    restored after, so the main conv state stays at the last committed token until replay."""
    spec_info = forward_batch.spec_info
    if getattr(spec_info, "ragged_verify_layout", None) is not None:
        raise DeferredSpecConfigError(f"{FLAG} deferred: ragged verify layouts are not supported")
    from sglang_mamba_ext.plugin.inchunk_checkpoints import _raw_gate

    rtp = backend.req_to_token_pool
    # the KDA safe gate (layer.lower_bound) is captured as the raw gate whose usual KDA decay equals
    # it (inchunk_checkpoints.safe_gate_as_raw), so the replay's gate math is unchanged
    capture_verify_inputs(rtp, layer.layer_id, layer.conv_weights, layer.bias, layer.A_log, layer.dt_bias,
                          mixed_qkv, _raw_gate(layer, a), b)
    state = _state_of(rtp)
    if state.on_chip:
        from sglang_mamba_ext.plugin.speculative.onchip_dispatch import run_onchip

        run = (lambda inner: lambda: run_onchip(backend, state, inner))(run)
    if not state.layout.verify_rolls_conv:
        return run()
    bs = mixed_qkv.shape[0] // spec_info.draft_token_num
    # padding rows (-1) read and write back slot 0's own value: in deferred mode no main window
    # may change during verify, so restoring every touched slot to its saved value is exact
    idx = backend.forward_metadata.mamba_cache_indices[:bs].to(torch.int64).clamp(min=0)
    conv = rtp.mamba2_layer_cache(layer.layer_id).conv[0]
    saved = conv.index_select(0, idx)
    out = run()
    conv.index_copy_(0, idx, saved)
    return out


def kda_target_verify_around(original, backend, layer, forward_batch, mixed_qkv, a, b):
    """AROUND ``KDAAttnBackend._forward_target_verify``: :func:`_verify_deferred` (capture,
    SGLang's verify into the one-layer buffers or with its recurrence on chip, main conv
    windows restored)."""
    if _state_of(getattr(backend, "req_to_token_pool", None)) is None:
        return original(backend, layer, forward_batch, mixed_qkv, a, b)
    return _verify_deferred(backend, layer, forward_batch, mixed_qkv, a, b,
                            lambda: original(backend, layer, forward_batch, mixed_qkv, a, b))


def gdn_forward_extend_around(original, backend, layer, forward_batch, mixed_qkv, a, b, **kwargs):
    """AROUND ``GDNAttnBackend.forward_extend`` (its target verify lives there): for a
    target-verify batch in deferred mode, :func:`_verify_deferred` around SGLang's own
    verify (one-layer buffer as its ``intermediate_ssm``, or its recurrence on chip); every
    other call is SGLang's."""
    if (_state_of(getattr(backend, "req_to_token_pool", None)) is None
            or not forward_batch.forward_mode.is_target_verify()):
        return original(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs)
    return _verify_deferred(backend, layer, forward_batch, mixed_qkv, a, b,
                            lambda: original(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs))


def commit_around(original, target_worker, batch, accept_lens, accept_index, draft_token_num, *args, **kwargs):
    """AROUND ``spec_utils.commit_mamba_states_after_verify``: deferred mode stashes the
    accepted tokens' activations instead of scattering intermediate states."""
    req_pool = getattr(getattr(target_worker, "model_runner", None), "req_to_token_pool", None)
    state = _state_of(req_pool)
    if state is None:
        return original(target_worker, batch, accept_lens, accept_index, draft_token_num, *args, **kwargs)
    if batch.forward_mode.is_idle() or accept_index.numel() == 0:
        return None
    bs = accept_lens.shape[0]
    interval = None
    if getattr(batch, "mamba_track_indices", None) is not None:
        from sglang.srt.runtime_context import mamba_track_grid

        interval = mamba_track_grid(batch.tree_cache.page_size)
    state.commit(
        rows=batch.req_pool_indices[:bs],
        accept_index=accept_index,
        accept_lens=accept_lens,
        seq_lens=batch.seq_lens[:bs],
        track_slots=None if batch.mamba_track_indices is None else batch.mamba_track_indices[:bs],
        mamba_track_interval=interval,
    )
    return None


def replay_for_batch(req_to_token_pool, req_pool_indices: torch.Tensor, keep: Optional[torch.Tensor] = None) -> None:
    """Replay the pending records of ``req_pool_indices`` into their main slots."""
    state = _state_of(req_to_token_pool)
    if state is None or req_pool_indices.numel() == 0:
        return
    pool = req_to_token_pool.mamba_pool
    slots = req_to_token_pool.get_mamba_indices(req_pool_indices)
    conv, temporal = pool_views(pool)
    state.replay(req_pool_indices.to(torch.int64), slots.to(torch.int64), conv, temporal, keep=keep,
                 impl=kernel_impl(temporal))


def worker_forward_before(worker, batch, *args, **kwargs) -> None:
    """BEFORE a speculative worker's per-round entry (:data:`WORKER_ENTRY_POINTS`:
    ``FrozenKVMTPWorkerV2`` / ``EAGLEWorkerV2.forward_batch_generation``): a decode round
    starts by replaying the previous round's stash into the target's main state (eager
    launches, outside CUDA graphs), before the draft and the verify read it. Layout-neutral:
    the pool's :class:`DeferredSpecState` knows its layout; nothing happens without one."""
    if not deferred_active():
        return None
    if batch.forward_mode.is_extend() or getattr(batch, "is_extend_in_batch", False) or batch.forward_mode.is_idle():
        return None
    pool = worker.req_to_token_pool
    name = type(worker).__name__
    if name not in _REPLAY_WORKERS and _state_of(pool) is not None:
        _REPLAY_WORKERS.add(name)
        logger.info("mamba-spec-state-update=deferred: replay at the start of %s's rounds", name)
    replay_for_batch(pool, batch.req_pool_indices)
    return None


#: worker classes whose first decode round logged the replay point (once per class)
_REPLAY_WORKERS: set = set()


def release_kv_cache_before(req, tree_cache, *args, checkpoint: bool = False, **kwargs) -> None:
    """BEFORE ``mem_cache.common.release_kv_cache``: a request leaving with its state kept
    (``checkpoint=True``) replays its pending run first, cut at ``prompt + output[:-1]`` or
    at the last emitted token if the last round went past it (tokens after EOS / the length
    limit are dropped) and records that length for the cache; one leaving without is
    cleared."""
    req_pool = getattr(tree_cache, "req_to_token_pool", None)
    state = _state_of(req_pool)
    kv = getattr(req, "kv", None)
    if state is None or kv is None or getattr(kv, "req_pool_idx", None) is None:
        return None
    row = int(kv.req_pool_idx)
    if checkpoint and getattr(kv, "mamba_pool_idx", None) is not None:
        from sglang_mamba_ext.plugin.req_bridge import WORKING_LEN_ATTR

        # Tokens whose state is worth caching: every token with KV (prompt + output[:-1]),
        # but not past the last *emitted* one: a round that accepted drafts beyond the stop
        # (max_new_tokens, EOS) keeps them in output_ids and their KV committed, yet the
        # next turn never contains them (``Req.finished_len``).
        n_out = len(req.output_ids)
        emitted = getattr(req, "finished_len", None)
        cached = len(req.origin_input_ids) + min(n_out - 1, n_out if emitted is None else emitted)
        rows = torch.tensor([row], dtype=torch.int64, device=state.stash.count.device)
        pending = int(state.stash.count[row])
        if pending > 0:  # one host read per finishing request (not per round)
            keep = torch.tensor([cached], device=rows.device) - state.stash.seq_len[rows]
            replay_for_batch(req_pool, rows, keep=keep)
            # the working state now holds exactly that many tokens, fewer than the KV
            # committed: tell the cache (CacheReq.mamba_working_len)
            setattr(req, WORKING_LEN_ATTR, min(cached, int(state.stash.seq_len[row]) + pending))
    state.clear([row])
    return None


def free_rows_before(req_pool, indices, *args, **kwargs) -> None:
    """BEFORE ``ReqToTokenPool.free_rows``: a freed row never carries pending records into
    its next request."""
    state = _state_of(req_pool)
    if state is not None and len(indices) > 0:
        state.clear(list(indices))
    return None
