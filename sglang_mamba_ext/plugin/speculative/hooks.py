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

logger = logging.getLogger(__name__)

FLAG = "--mamba-spec-state-update"
ATTR = "_mamba_spec_state_update"
CHOICES = ("snapshot", "deferred")
POOL_ATTR = "mamba_spec_deferred"  # DeferredSpecState attached to a MambaPool


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
            "--speculative-algorithm FROZEN_KV_MTP, a KDA hybrid target and "
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
            f"{FLAG} deferred needs speculative decoding: pass --speculative-algorithm FROZEN_KV_MTP "
            f"(or drop {FLAG})"
        )
    if str(algo).upper() not in ("FROZEN_KV_MTP", "EAGLE", "NEXTN"):
        # EAGLE / NEXTN may still be promoted to FROZEN_KV_MTP for frozen-KV drafts; the
        # resolved algorithm is checked again at model-runner start.
        raise DeferredSpecConfigError(
            f"{FLAG} deferred works with --speculative-algorithm FROZEN_KV_MTP only, got {algo}"
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


def model_runner_init_after(result, runner, *args, **kwargs) -> None:
    """AFTER ``ModelRunner.__init__``: the target must be a KDA hybrid, the draft must have no
    Mamba/linear-attention layers, the resolved algorithm must be FROZEN_KV_MTP.

    Raises:
        DeferredSpecConfigError
    """
    if not deferred_active():
        return None
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.runtime_context import get_spec

    mcfg = getattr(runner, "model_config", None)
    has_ssm = mcfg is not None and mambaish_config(mcfg) is not None
    if getattr(runner, "is_draft_worker", False):
        if has_ssm:
            raise DeferredSpecConfigError(
                f"{FLAG} deferred requires a draft model without Mamba/linear-attention layers "
                "(it replays only the target's state; the draft must read the target's KV only, "
                "as FROZEN_KV_MTP drafts do): use another --speculative-draft-model-path or "
                f"{FLAG} snapshot"
            )
        return None
    algo = str(get_spec().speculative_algorithm or "").upper()
    if algo != "FROZEN_KV_MTP":
        raise DeferredSpecConfigError(
            f"{FLAG} deferred works with --speculative-algorithm FROZEN_KV_MTP only (resolved: {algo or None})"
        )
    if not has_ssm:
        raise DeferredSpecConfigError(
            f"{FLAG} deferred needs a hybrid model with Mamba/linear-attention layers; "
            f"{getattr(mcfg, 'model_path', 'this model')} has none (drop {FLAG})"
        )
    return None


# ---------------------------------------------------------------------------------------
# pool construction
# ---------------------------------------------------------------------------------------


def mamba_pool_init_around(original, pool, *args, **kwargs) -> None:
    """AROUND ``MambaPool.__init__``: in deferred mode, build the pool without SGLang's
    ``[L, N+1, T, ...]`` intermediate buffers, then give it one-layer buffers seen as ``L``
    layers (stride 0) and a :class:`DeferredSpecState` (``pool.mamba_spec_deferred``).

    Raises:
        DeferredSpecConfigError: not a KDA model, or an unsupported pool layout.
    """
    T = kwargs.get("speculative_num_draft_tokens")
    if not deferred_active() or T is None:
        return original(pool, *args, **kwargs)
    cache_params = kwargs["cache_params"]
    if not getattr(cache_params, "is_kda", False):
        raise DeferredSpecConfigError(
            f"{FLAG} deferred supports KDA linear attention (Kimi-Linear) only in this version; "
            f"{type(cache_params).__name__} needs its own replay kernel (use {FLAG} snapshot)"
        )
    if kwargs.get("envelope_layout"):
        raise DeferredSpecConfigError(f"{FLAG} deferred does not support the envelope Mamba layout")
    kw = dict(kwargs)
    kw["speculative_num_draft_tokens"] = None  # no intermediate buffers
    original(pool, *args, **kw)
    from sglang.srt.mem_cache.memory_pool import MambaPool
    from sglang.srt.runtime_context import get_spec

    shape_p = cache_params.shape
    conv_shape = tuple(shape_p.conv[0])  # KDA: (W-1, conv_dim)
    if len(shape_p.conv) != 1 or conv_shape[0] != shape_p.conv_kernel - 1:
        raise DeferredSpecConfigError(f"{FLAG} deferred: unsupported conv state layout {shape_p.conv}")
    hv, v_dim, k_dim = shape_p.temporal  # SGLang KDA keeps (HV, V, K)
    h_k = getattr(shape_p, "num_k_heads_per_tp", hv)
    conv_dim = conv_shape[1]
    from sglang_mamba_ext.models.linear_attn import LinearAttnShape

    shape = LinearAttnShape(h_k, hv, k_dim, v_dim, shape_p.conv_kernel)
    if shape.conv_dim != conv_dim:
        raise DeferredSpecConfigError(f"{FLAG} deferred: conv_dim {conv_dim} != 2*H*K + HV*V of {shape}")
    L = len(kwargs["mamba_layer_ids"])
    R = kwargs["spec_state_size"] + 1
    steps = int(get_spec().speculative_num_steps or (T - 1))
    state = DeferredSpecState(
        num_layers=L, num_rows=R, draft_token_num=T, max_accept=steps + 1, shape=shape,
        dims=StashDims(conv_dim, hv * k_dim, hv), ssm_state_shape=tuple(shape_p.temporal),
        conv_state_shape=conv_shape, ssm_dtype=cache_params.dtype.temporal,
        conv_dtype=cache_params.dtype.conv, act_dtype=cache_params.dtype.conv, device=kwargs["device"],
    )
    ssm_view, conv_view = state.layered_views()
    old = pool.mamba_cache
    pool.mamba_cache = MambaPool.SpeculativeState(
        conv=old.conv, temporal=old.temporal, intermediate_ssm=ssm_view, intermediate_conv_window=[conv_view],
    )
    setattr(pool, POOL_ATTR, state)
    logger.info("mamba-spec-state-update=deferred: no intermediate SSM buffer; %s",
                {k: f"{v / 2**20:.1f} MiB" for k, v in state.nbytes().items()})
    return None


def _state_of(obj) -> Optional[DeferredSpecState]:
    """The DeferredSpecState behind a req_to_token_pool / MambaPool, if any."""
    pool = getattr(obj, "mamba_pool", obj)
    return getattr(pool, POOL_ATTR, None)


def pool_views(pool) -> tuple:
    """Main-state views in the replay layout: ``conv [L, slots, conv_dim, W-1]`` and
    ``temporal [L, slots, HV, K, V]`` (SGLang KDA stores ``(W-1, dim)`` and ``(HV, V, K)``)."""
    mc = pool.mamba_cache
    return mc.conv[0].transpose(-1, -2), mc.temporal.transpose(-1, -2)


# ---------------------------------------------------------------------------------------
# verify, commit, replay, release
# ---------------------------------------------------------------------------------------


def kda_target_verify_around(original, backend, layer, forward_batch, mixed_qkv, a, b):
    """AROUND ``KDAAttnBackend._forward_target_verify``: copy the layer's raw inputs of all
    tree nodes into the pending workspace, register the layer's replay weights, then verify
    as SGLang does (its kernels write node states into the one-layer buffer).

    SGLang's verify conv kernel (``causal_conv1d_update``) also rolls the *main* conv window
    by all ``T`` draft tokens in place, which snapshot mode undoes in its commit scatter; here
    the batch's windows of this layer are saved before and restored after the layer's verify,
    so the main conv state stays at the last committed token until replay."""
    state = _state_of(getattr(backend, "req_to_token_pool", None))
    if state is None:
        return original(backend, layer, forward_batch, mixed_qkv, a, b)
    if isinstance(mixed_qkv, (tuple, list)):
        raise DeferredSpecConfigError(f"{FLAG} deferred: split q/k/v conv inputs are not supported")
    spec_info = forward_batch.spec_info
    if getattr(spec_info, "ragged_verify_layout", None) is not None:
        raise DeferredSpecConfigError(f"{FLAG} deferred: ragged verify layouts are not supported")
    if getattr(layer, "lower_bound", None) is not None:
        raise DeferredSpecConfigError(
            f"{FLAG} deferred: the KDA safe gate (lower_bound) is not implemented in replay"
        )
    rtp = backend.req_to_token_pool
    l = rtp.mamba_map[layer.layer_id]
    state.register_layer(l, layer.conv_weights, layer.bias, layer.A_log, layer.dt_bias)
    state.capture(l, mixed_qkv, a, b)
    bs = mixed_qkv.shape[0] // spec_info.draft_token_num
    # padding rows (-1) read and write back slot 0's own value: in deferred mode no main window
    # may change during verify, so restoring every touched slot to its saved value is exact
    idx = backend.forward_metadata.mamba_cache_indices[:bs].to(torch.int64).clamp(min=0)
    conv = rtp.mamba2_layer_cache(layer.layer_id).conv[0]
    saved = conv.index_select(0, idx)
    out = original(backend, layer, forward_batch, mixed_qkv, a, b)
    conv.index_copy_(0, idx, saved)
    return out


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
    state.replay(req_pool_indices.to(torch.int64), slots.to(torch.int64), conv, temporal, keep=keep)


def worker_forward_before(worker, batch, *args, **kwargs) -> None:
    """BEFORE ``FrozenKVMTPWorkerV2.forward_batch_generation``: a decode round starts by
    replaying the previous round's stash (eager launches, outside CUDA graphs)."""
    if not deferred_active():
        return None
    if batch.forward_mode.is_extend() or getattr(batch, "is_extend_in_batch", False) or batch.forward_mode.is_idle():
        return None
    replay_for_batch(worker.req_to_token_pool, batch.req_pool_indices)
    return None


def release_kv_cache_before(req, tree_cache, *args, checkpoint: bool = False, **kwargs) -> None:
    """BEFORE ``mem_cache.common.release_kv_cache``: a request leaving with its state kept
    (``checkpoint=True``) replays its pending run first, cut at ``prompt + output[:-1]``
    (tokens after EOS / the length limit are dropped); one leaving without is cleared."""
    req_pool = getattr(tree_cache, "req_to_token_pool", None)
    state = _state_of(req_pool)
    kv = getattr(req, "kv", None)
    if state is None or kv is None or getattr(kv, "req_pool_idx", None) is None:
        return None
    row = int(kv.req_pool_idx)
    if checkpoint and getattr(kv, "mamba_pool_idx", None) is not None:
        cached = len(req.origin_input_ids) + len(req.output_ids) - 1
        rows = torch.tensor([row], dtype=torch.int64, device=state.stash.count.device)
        keep = torch.tensor([cached], device=rows.device) - state.stash.seq_len[rows]
        replay_for_batch(req_pool, rows, keep=keep)
    state.clear([row])
    return None


def free_rows_before(req_pool, indices, *args, **kwargs) -> None:
    """BEFORE ``ReqToTokenPool.free_rows``: a freed row never carries pending records into
    its next request."""
    state = _state_of(req_pool)
    if state is not None and len(indices) > 0:
        state.clear(list(indices))
    return None
