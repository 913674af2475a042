"""Exact prefix checkpoints with SGLang's own KDA and Gated DeltaNet backends
(``docs/design.md``, "Prefix checkpoints"; issue 16).

SGLang's chunked linear-attention kernels (``srt/layers/attention/linear/kda_backend.py``,
``gdn_backend.py``) keep states only on their 64-token chunk grid, so without help the plugin
rounds a branch point down to the grid and has no prompt-end checkpoint. Under
``--enable-mamba-radix`` two hooks per backend class change that:

- AFTER ``KDAAttnBackend.__init__`` / ``GDNAttnBackend.__init__`` (:func:`backend_init_after`):
  when the backend can be helped (the extend not captured in SGLang's breakable prefill CUDA graph;
  the class does not override ``forward_extend``; a KDA safe gate, ``lower_bound``, is
  rewritten as a raw gate of KDA's usual form, :func:`safe_gate_as_raw`), it sets the pool's ``prefix_checkpoint_writer`` so that the
  core plans exact positions (``MambaRadixReqToTokenPool._plan_prefix_checkpoints``);
- BEFORE ``forward_extend`` (:func:`forward_extend_before`): for an extend batch with planned
  checkpoints (``MambaRadixReqToTokenPool.prefix_checkpoint_plan``), *before* SGLang's forward
  advances the rows' working slots, the in-chunk writer
  (:func:`sglang_mamba_ext.speculative.ops.inchunk.write_checkpoints`: Triton on CUDA, its
  torch reference on CPU, :func:`writer_impl`) writes each
  planned slot's conv window and SSM state from the layer's raw inputs (``mixed_qkv``, raw
  gate ``a``, raw ``b``).

Start state: the extend's initial state, read in place from the row's working slot
(``forward_metadata.mamba_cache_indices``; zeros for a row without prefix, as SGLang's kernels
treat ``extend_prefix_lens == 0``). SGLang exposes per-chunk states ``h`` only from some
extend kernels and only for its own track rows (its FlashInfer KDA prefill and CuTe DSL GDN
kernels return none), so the writer computes the chunk-boundary states itself from the raw
inputs, in the chunked WY form (one pass per row, up to its deepest checkpoint's chunk), and
each checkpoint steps at most ``chunk - 1`` tokens from the boundary below it (issue 39;
``speculative/ops/inchunk/chunked.py``). ``scripts/gpu_check.sh`` measures that cost against
the prefill it saves.

Every hook returns SGLang's result unchanged without ``--enable-mamba-radix`` (the pool has no
``prefix_checkpoint_writer``) or without a plan. Hook targets: ``docs/sglang-hooks.md``.
"""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Tuple

import torch

logger = logging.getLogger(__name__)

KDA_BACKEND = "sglang.srt.layers.attention.linear.kda_backend.KDAAttnBackend"
KDA_DISPATCH = "sglang.srt.layers.attention.linear.kda_backend.KDAKernelDispatcher"
GDN_DISPATCH = "sglang.srt.layers.attention.linear.gdn_backend.GDNKernelDispatcher"
MAMBA2_BACKEND = "sglang.srt.layers.attention.hybrid_linear_attn_backend.Mamba2AttnBackend"
SHORT_CONV_BACKEND = "sglang.srt.layers.attention.linear.short_conv_backend.ShortConvAttnBackend"
GDN_BACKEND = "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend"
#: (hook target, kind, function name in this module)
HOOK_TARGETS = [
    (KDA_BACKEND + ".__init__", "AFTER", "backend_init_after"),
    (GDN_BACKEND + ".__init__", "AFTER", "backend_init_after"),
    (KDA_BACKEND + ".forward_extend", "BEFORE", "forward_extend_before"),
    (GDN_BACKEND + ".forward_extend", "BEFORE", "forward_extend_before"),
    (MAMBA2_BACKEND + ".__init__", "AFTER", "backend_init_after"),
    (SHORT_CONV_BACKEND + ".__init__", "AFTER", "backend_init_after"),
]
#: The other writers' modules, each with its own ``HOOK_TARGETS`` (registered with these):
#: SGLang's KDA / GDN kernel dispatchers (checkpoints from the prefill's chunk states), Mamba2 /
#: short conv, lightning attention (Ling 2.5), Mamba1 (Falcon-Mamba, Mamba), Inkling's sconv
#: windows, Jet-Nemotron's JetBlock, Qwen4-Exp's PLE side states, ZAYA1's CCA conv state.
KIND_MODULES = ("inchunk_from_chunks", "inchunk_conv_ssd", "inchunk_lightning", "inchunk_mamba1", "inchunk_inkling",
                "inchunk_jet", "inchunk_ple", "inchunk_cca")
#: Attribute set on a backend the plugin writes checkpoints for: its layout name.
WRITER_ATTR = "_mamba_radix_inchunk_layout"
#: Attribute set beside :data:`WRITER_ATTR`: the writers' implementation, ``"triton"`` or
#: ``"torch"`` (:func:`writer_impl`); a backend without it uses Triton.
IMPL_ATTR = "_mamba_radix_inchunk_impl"
#: Environment variable choosing the in-chunk writers' implementation: ``auto`` (the default:
#: Triton on CUDA, torch elsewhere), ``triton`` or ``torch``.
IMPL_ENV = "SGLANG_MAMBA_EXT_INCHUNK_IMPL"
IMPLS = ("auto", "triton", "torch")
#: Environment variable: ``0`` makes every GDN / KDA checkpoint compute its boundary state
#: itself (the chunked pass) even where SGLang's extend kernel returns its chunk states ``h``
#: (for A/B runs; default ``1``).
FROM_CHUNKS_ENV = "SGLANG_MAMBA_EXT_INCHUNK_FROM_CHUNKS"
#: The chunk of SGLang's GDN / KDA extend kernels (``fla/chunk.py`` ``CHUNK_SIZE``, ``fla/kda.py``).
KERNEL_CHUNK = 64


def writer_impl(device) -> str:
    """The in-chunk writers' implementation for a backend on ``device``: ``$SGLANG_MAMBA_EXT_
    INCHUNK_IMPL`` when it names one, else (``auto``) ``"triton"`` on CUDA and ``"torch"``
    elsewhere. On CPU the Triton kernels only run under Triton's interpreter, about 1000x
    slower than the torch loops at the tiny models' shapes (20 s against 17 ms per layer for a
    150-token prompt, measured on the 2-core machine); both compute the same states (their
    tests compare them, and each against SGLang's kernels).

    Raises:
        ValueError: the variable holds something else (the message names it and the choices).
    """
    choice = os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"
    if choice not in IMPLS:
        raise ValueError(f"error: {IMPL_ENV}={os.environ.get(IMPL_ENV)!r}: expected one of {', '.join(IMPLS)}")
    if choice != "auto":
        return choice
    return "triton" if str(device).startswith("cuda") else "torch"


def backend_impl(backend) -> str:
    """The implementation :func:`backend_init_after` chose for ``backend`` (Triton if none)."""
    return getattr(backend, IMPL_ATTR, "triton")


def register_inchunk_hooks() -> None:
    """Register :data:`HOOK_TARGETS` and those of each module of :data:`KIND_MODULES` with SGLang's
    HookRegistry (from ``install_mamba_radix``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    import importlib

    for target, kind, name in HOOK_TARGETS:
        HookRegistry.register(target, globals()[name], getattr(HookType, kind))
    for mod_name in KIND_MODULES:
        mod = importlib.import_module("sglang_mamba_ext.plugin." + mod_name)
        for target, kind, name in mod.HOOK_TARGETS:
            HookRegistry.register(target, getattr(mod, name), getattr(HookType, kind))


def _backend_kinds():
    """``(class, writer name, method the hooks rely on)`` for SGLang's backends with a writer:
    KDA / GDN (:func:`forward_extend_before`), Mamba2 and short conv
    (:mod:`.inchunk_conv_ssd`), lightning attention (:mod:`.inchunk_lightning`)."""
    from sglang.srt.layers.attention.hybrid_linear_attn_backend import Mamba2AttnBackend
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
    from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend
    from sglang.srt.layers.attention.linear.lightning_backend import LightningAttentionBackend
    from sglang.srt.layers.attention.linear.short_conv_backend import ShortConvAttnBackend

    # (Mamba2AttnBackend before LightningAttentionBackend would not matter: neither subclasses
    # the other; both subclass MambaAttnBackendBase)
    return ((KDAAttnBackend, "kda", "forward_extend"), (GDNAttnBackend, "gdn", "forward_extend"),
            (Mamba2AttnBackend, "mamba2", "forward"), (ShortConvAttnBackend, "shortconv", "conv_state_metadata"),
            (LightningAttentionBackend, "lightning", "forward_extend"))


def _layout_name(backend) -> Optional[str]:
    """``"kda"`` / ``"gdn"`` / ``"mamba2"`` / ``"shortconv"`` for SGLang's backends
    (subclasses included, unless they override the hooked method), else None."""
    for cls, name, method in _backend_kinds():
        if isinstance(backend, cls):
            # a subclass with its own method would bypass the hooks
            return name if getattr(type(backend), method) is getattr(cls, method) else None
    return None


#: Model classes whose writer hooks run inside the model's own layer code (Jet-Nemotron's
#: ``JetBlock.forward``, ZAYA1's ``cca_extend``, Qwen4-Exp's PLE ``_short_conv``, Inkling's
#: ``ShortConvolution.forward``), not at a linear-attention backend's call, where SGLang's
#: breakable prefill graph breaks: a captured prefill graph would replay them without the hook.
IN_LAYER_WRITER_CLASSES = ("JetNemotronForCausalLM", "JetVLMForConditionalGeneration", "ZayaForCausalLM",
                           "Qwen4ExpForConditionalGeneration", "InklingForConditionalGeneration")


def prefill_graph_reason(model_runner) -> Optional[str]:
    """Why a writer hooked inside the model's layer code cannot run: a prefill CUDA graph (SGLang's
    ``cuda_graph_config`` prefill backend ``full`` or ``breakable``, ``model_executor/
    cuda_graph_config.py``; breakable is SGLang's default on CUDA for text models, full for
    Inkling, ``arg_groups/cuda_graph_hook.py``) replays the layers without calling the hook, so a
    planned slot would keep garbage. None off CUDA (no prefill graphs) or with them disabled
    (``--disable-prefill-cuda-graph``)."""
    if not str(getattr(model_runner, "device", "cuda")).startswith("cuda"):
        return None
    try:
        from sglang.srt.model_executor.cuda_graph_config import Backend, Phase, check_cuda_graph_backend

        if check_cuda_graph_backend(Phase.PREFILL, Backend.DISABLED):
            return None
        which = "full" if check_cuda_graph_backend(Phase.PREFILL, Backend.FULL) else "breakable"
        return (f"{which} prefill CUDA graphs replay the layer without the writer's hook "
                "(--disable-prefill-cuda-graph gives exact checkpoints)")
    except Exception as e:  # an SGLang without these names, or no runtime context
        return f"could not check for prefill CUDA graphs ({type(e).__name__}: {e})"


def why_not_writer(backend, model_runner) -> Optional[str]:
    """Why the plugin cannot write exact checkpoints for ``backend`` (None: it can)."""
    hf = getattr(getattr(model_runner, "model_config", None), "hf_config", None)
    if any(a in IN_LAYER_WRITER_CLASSES for a in (getattr(hf, "architectures", None) or ())):
        reason = prefill_graph_reason(model_runner)
        if reason is not None:
            return reason
    name = _layout_name(backend)
    if name is None:
        method = next((m for cls, _, m in _backend_kinds() if isinstance(backend, cls)), None)
        return f"{type(backend).__name__} overrides {method}" if method else "no writer for this backend"
    if name == "lightning":
        backend_kind = getattr(backend, "linear_backend", "seg_la")
        if backend_kind != "seg_la":  # the writer reads the k / v seg_la receives; minimax not checked
            return f"linear_backend {backend_kind} (the lightning writer is checked with seg_la only)"
        return None  # torch ops on any device (inchunk_lightning.py)
    if name == "gdn":
        from sglang_mamba_ext.plugin.inchunk_jet import is_jet_model

        if is_jet_model(model_runner):
            return None  # the Jet writer: the layer's own recurrence, any device (inchunk_jet.py)
    if name == "mamba2":
        from sglang_mamba_ext.plugin.inchunk_mamba1 import is_mamba1_model

        if is_mamba1_model(model_runner):
            return None  # the Mamba1 writer: torch ops on any device (inchunk_mamba1.py)
    device = str(getattr(model_runner, "device", "cuda"))
    if (not device.startswith("cuda") and writer_impl(device) == "triton"
            and os.environ.get("TRITON_INTERPRET") != "1"):
        return f"device {device} with {IMPL_ENV}=triton (the Triton writer needs CUDA, or TRITON_INTERPRET=1)"
    # the KDA safe gate (Kimi-K3 / GLM-5-Next's gate_lower_bound, Ling-V3's kda_safe_gate; the
    # layers' lower_bound) is written through safe_gate_as_raw
    if name == "kda":
        try:
            from sglang.srt.layers.attention.hybrid_linear_attn_backend import (
                Backend,
                Phase,
                check_cuda_graph_backend,
            )

            if backend.supports_prefill_graph_extend() and check_cuda_graph_backend(Phase.PREFILL, Backend.BREAKABLE):
                return "breakable prefill CUDA graphs capture the KDA extend"
        except Exception as e:  # an SGLang without these names, or no runtime context
            return f"could not check for breakable prefill CUDA graphs ({type(e).__name__}: {e})"
    return None


def _family_and_grid(backend, model_runner):
    """The model class (``architectures[0]``) and the grid SGLang's own cache keeps states on
    with ``backend``, in tokens: the kernel chunk (``mamba_chunk_size``), or for short conv,
    which has no kernel chunk, the prefill chunk (``--chunked-prefill-size``)."""
    hf = getattr(getattr(model_runner, "model_config", None), "hf_config", None)
    archs = getattr(hf, "architectures", None) or [type(hf).__name__]
    if any(c.__name__ == "ShortConvAttnBackend" for c in type(backend).__mro__):
        grid = getattr(getattr(model_runner, "server_args", None), "chunked_prefill_size", None)
    else:
        grid = getattr(backend, "mamba_chunk_size", 64)
    return archs[0], grid


def backend_init_after(result, backend, model_runner, *args, **kwargs) -> None:
    """AFTER SGLang's KDA / GDN / Mamba2 / short-conv backend ``__init__``: under
    ``--enable-mamba-radix`` mark the backend as helped and the pool as a
    ``prefix_checkpoint_writer`` when :func:`why_not_writer` finds no obstacle; otherwise log
    one line naming the model class, the reason and the grid checkpoints stay on."""
    pool = getattr(model_runner, "req_to_token_pool", None)
    if not hasattr(pool, "prefix_checkpoint_writer"):
        return result
    from sglang_mamba_ext.plugin.inchunk_inkling import is_inkling_backend

    if is_inkling_backend(backend):  # its own writer, marked after its own __init__ (inchunk_inkling.py)
        return result
    family, grid = _family_and_grid(backend, model_runner)
    reason = why_not_writer(backend, model_runner)
    if reason is not None:
        logger.info("mamba-radix: %s: prefix checkpoints stay on the %s-token grid with %s: %s",
                    family, grid, type(backend).__name__, reason)
        return result
    impl = writer_impl(getattr(model_runner, "device", "cuda"))
    layout = _layout_name(backend)
    if layout == "mamba2":
        from sglang_mamba_ext.plugin.inchunk_mamba1 import is_mamba1_model

        layout = "mamba1" if is_mamba1_model(model_runner) else layout  # MambaMixer1 on Mamba2AttnBackend
    if layout == "gdn":
        from sglang_mamba_ext.plugin.inchunk_jet import is_jet_model

        layout = "jet" if is_jet_model(model_runner) else layout  # JetBlocks on GDNAttnBackend (inchunk_jet.py)
    if layout in ("lightning", "mamba1", "jet"):
        impl = "torch"  # these writers are torch ops on every device (inchunk_lightning.py, inchunk_mamba1.py)
    setattr(backend, WRITER_ATTR, layout)
    setattr(backend, IMPL_ATTR, impl)
    pool.prefix_checkpoint_writer = True
    logger.info("mamba-radix: exact prefix checkpoints with %s (in-chunk %s writer) for %s",
                type(backend).__name__, "Triton" if impl == "triton" else "torch", family)
    return result


def _layer_weights(backend, layer, per_head_gate: bool):
    """The layer's :class:`ReplayWeights` (``L = 1``; its conv taps, ``A_log`` and ``dt_bias``),
    cached on the backend by layer id. Both writers read these tensors (the torch writer no
    longer steps a :class:`~sglang_mamba_ext.models.linear_attn.GatedDeltaRuleMixer`)."""
    from sglang_mamba_ext.models.linear_attn import LinearAttnShape
    from sglang_mamba_ext.speculative.replay import ReplayWeights

    cache: Dict[int, object] = backend.__dict__.setdefault("_mamba_radix_inchunk_weights", {})
    w = cache.get(layer.layer_id)
    if w is None:
        cw = layer.conv_weights
        bias = layer.bias
        if isinstance(cw, (tuple, list)):  # split q / k / v convs: one conv_dim-wide stack
            cw = torch.cat([c.reshape(c.shape[0], -1) for c in cw])
            bias = None if bias is None else torch.cat(list(bias))
        cw = cw.reshape(cw.shape[0], -1)
        shape = LinearAttnShape(layer.num_k_heads, layer.num_v_heads, layer.head_k_dim, layer.head_v_dim, cw.shape[-1])
        w = ReplayWeights(
            shape,
            cw.detach().unsqueeze(0).contiguous(),
            None if bias is None else bias.detach().reshape(1, -1).contiguous(),
            layer.A_log.detach().reshape(1, -1).float().contiguous(),
            layer.dt_bias.detach().reshape(1, -1).float().contiguous(),
            per_head_gate=per_head_gate,
        )
        cache[layer.layer_id] = w
    return w


def _writes_for(backend, forward_batch, plan: Dict[int, List[Tuple[int, int]]]):
    """The batch's :class:`CheckpointWrites` (rows in ``plan``), cached per forward batch."""
    return _writes_and_host(backend, forward_batch, plan)[0]


def _writes_and_host(backend, forward_batch, plan: Dict[int, List[Tuple[int, int]]]):
    """``(writes, host)``: the batch's :class:`CheckpointWrites` and the same plan as host
    lists ``(starts, offsets, dst_slots)`` (the writers' chunk layout reads these, so no device
    value is read back), cached per forward batch."""
    from sglang_mamba_ext.speculative.ops.inchunk import plan_writes

    cached = backend.__dict__.get("_mamba_radix_inchunk_writes")
    if cached is not None and cached[0] is forward_batch:
        return cached[1], cached[2]
    lens = list(forward_batch.extend_seq_lens_cpu)
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + int(n))
    rows = sorted(plan)
    cache_idx = backend.forward_metadata.mamba_cache_indices
    packed = [(starts[r], 0, plan[r]) for r in rows]
    writes = plan_writes(packed, cache_idx.device)
    width = writes.offsets.shape[1]
    host = ([p[0] for p in packed], [[o for o, _ in p[2]] + [-1] * (width - len(p[2])) for p in packed],
            [[d for _, d in p[2]] + [-1] * (width - len(p[2])) for p in packed])
    # start state: the row's working slot when it has a prefix, zeros otherwise (no sync)
    sel = torch.tensor(rows, dtype=torch.int64, device=cache_idx.device)
    has_prefix = forward_batch.extend_prefix_lens.to(cache_idx.device)[sel] > 0
    src = torch.where(has_prefix, cache_idx[sel].to(torch.int64), torch.full_like(sel, -1))
    writes = writes._replace(src_slots=src)
    backend.__dict__["_mamba_radix_inchunk_writes"] = (forward_batch, writes, host)
    return writes, host


def safe_gate_as_raw(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float) -> torch.Tensor:
    """The raw KDA gate ``a'`` (float32, ``a``'s shape) for which KDA's usual gate equals the
    safe gate of ``a``: ``-exp(A_log) * softplus(a' + dt_bias) == lower_bound *
    sigmoid(exp(A_log) * (a + dt_bias))`` (SGLang's safe gate: ``kernels/ops/attention/fla/
    kda.py:1028``, ``fused_recurrent.py:492``; Kimi-K3 / GLM-5-Next's ``gate_lower_bound``,
    Ling-V3's ``kda_lower_bound``). With ``s = -lower_bound * sigmoid(..) / exp(A_log) > 0``,
    ``a' = softplus^-1(s) - dt_bias = s + log(-expm1(-s)) - dt_bias`` (float32; ``s`` floored at
    1e-30, a log decay of about -1e-30 where the safe gate gives 0).

    Args:
        a: ``[..., HV*K]`` or ``[..., HV, K]`` raw gate (any float dtype), ``A_log``: ``[HV]``,
            ``dt_bias``: ``[HV*K]``;
            ``lower_bound``: negative, the largest log decay magnitude.
    """
    HV = A_log.numel()
    x = a.float().reshape(-1, HV, dt_bias.numel() // HV) + dt_bias.float().reshape(HV, -1)
    ea = A_log.float().reshape(HV, 1).exp()
    s = (-float(lower_bound) * torch.sigmoid(ea * x) / ea).clamp_min(1e-30)
    raw = s + torch.log(-torch.expm1(-s)) - dt_bias.float().reshape(HV, -1)
    return raw.reshape(a.shape)


def _raw_gate(layer, a: torch.Tensor) -> torch.Tensor:
    """``a`` as the writer reads it: unchanged, or through :func:`safe_gate_as_raw` for a
    layer with the KDA safe gate (``layer.lower_bound``, SGLang's ``kda_backend.py``)."""
    lower_bound = getattr(layer, "lower_bound", None)
    if lower_bound is None:
        return a
    return safe_gate_as_raw(a, layer.A_log, layer.dt_bias, lower_bound)


def write_layer_checkpoints(backend, layer, forward_batch, mixed_qkv, a, b,
                            plan: Dict[int, List[Tuple[int, int]]], impl: str = "triton") -> None:
    """Write this layer's planned checkpoints (``plan``: ``{batch row: [(offset, slot)]}``,
    offsets in tokens from the row's extend start) into the pool slots, from the raw inputs
    SGLang's ``forward_extend`` received (``mixed_qkv [T, conv_dim]`` or a q/k/v tuple, ``a``
    ``[.., T, HV*K]`` KDA / ``[T, HV]`` GDN, ``b`` ``[.., T, HV]``). Must run before SGLang's
    forward advances the working slots.

    A layer with the KDA safe gate (``layer.lower_bound``) has its raw gate rewritten first
    (:func:`safe_gate_as_raw`), so the writer's ``-exp(A_log) softplus`` gate gives the safe
    gate's values.

    Raises:
        RuntimeError: the extend is being captured in a CUDA graph (the backend should not have
            been marked a writer).
    """
    from sglang_mamba_ext.speculative.deferred import LAYOUTS
    from sglang_mamba_ext.speculative.ops.inchunk import write_checkpoints

    layout = LAYOUTS[getattr(backend, WRITER_ATTR)]
    a = _raw_gate(layer, a)
    if getattr(backend, "prefill_graph_metadata", None) is not None or (
            mixed_qkv.is_cuda if isinstance(mixed_qkv, torch.Tensor) else False) and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("mamba-radix in-chunk checkpoints: extend captured in a CUDA graph")
    if isinstance(mixed_qkv, (tuple, list)):
        mixed_qkv = torch.cat(list(mixed_qkv), dim=-1)
    T = mixed_qkv.shape[0]
    w = _layer_weights(backend, layer, layout.per_head_gate)
    writes, host = _writes_and_host(backend, forward_batch, plan)
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    conv, temporal = layout.replay_views(cache.conv[0], cache.temporal)
    write_checkpoints(
        mixed_qkv.unsqueeze(0).contiguous(),
        a.reshape(T, -1).unsqueeze(0).contiguous(),
        b.reshape(T, -1).unsqueeze(0).contiguous(),
        writes, conv.unsqueeze(0), temporal.unsqueeze(0), w, impl=impl,
        check_offsets=False,  # prefix_checkpoint_plan keeps offsets within the row's new tokens
        host=host,
    )


def _plan_for(backend, forward_batch) -> Dict[int, List[Tuple[int, int]]]:
    """The pool's planned checkpoints inside this extend, computed once per forward batch
    (every linear layer asks)."""
    cached = backend.__dict__.get("_mamba_radix_inchunk_plan")
    if cached is not None and cached[0] is forward_batch:
        return cached[1]
    pool = backend.req_to_token_pool
    plan = pool.prefix_checkpoint_plan(forward_batch) if pool.prefix_checkpoints else {}
    backend.__dict__["_mamba_radix_inchunk_plan"] = (forward_batch, plan)
    return plan


def plan_of_kind(backend, forward_batch, kind: str) -> Optional[Dict[int, List[Tuple[int, int]]]]:
    """:func:`_plan_for` for a backend the plugin marked with writer ``kind`` (``"mamba1"``,
    ``"lightning"``) on a prefill extend; None when the backend is not that writer's, there is
    no batch, it is a speculative verify, or nothing is planned (the kinds' BEFORE hooks)."""
    if getattr(backend, WRITER_ATTR, None) != kind or forward_batch is None:
        return None
    if forward_batch.forward_mode.is_target_verify():
        return None
    return _plan_for(backend, forward_batch) or None


def extend_rows(backend, forward_batch, plan) -> List[Tuple[int, int, int, List[Tuple[int, int]]]]:
    """Per planned batch row, in row order: ``(first token in the extend, new tokens, start
    slot, plan[row])``; the start slot is the row's working slot (``forward_metadata.
    mamba_cache_indices``) when it has a cached prefix, -1 (start from zeros) otherwise."""
    lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
    prefix = [int(n) for n in forward_batch.extend_prefix_lens_cpu]
    starts = [0]
    for n in lens[:-1]:
        starts.append(starts[-1] + n)
    slots = backend.forward_metadata.mamba_cache_indices.tolist()
    return [(starts[r], lens[r], int(slots[r]) if prefix[r] > 0 else -1, plan[r]) for r in sorted(plan)]


def forward_extend_before(backend, layer, forward_batch, mixed_qkv, a, b, **kwargs) -> None:
    """BEFORE SGLang's KDA / GDN ``forward_extend``: the planned prefix checkpoints inside this
    extend (:func:`write_layer_checkpoints`); SGLang's forward then runs unchanged with the
    same arguments (a BEFORE hook, so it chains with the deferred verify's AROUND hook on
    ``GDNAttnBackend.forward_extend`` without SGLang's multiple-AROUND warning).

    Where SGLang's extend kernel returns its chunk states (:mod:`.inchunk_from_chunks`),
    only the checkpoints inside each row's first chunk are written here; the others' raw
    inputs are copied aside (:func:`~sglang_mamba_ext.speculative.ops.inchunk.from_chunks.
    gather_tail_blocks`) and written from ``h`` once the kernel ran (:func:`.inchunk_from_chunks.dispatch_extend_after`)."""
    if getattr(backend, WRITER_ATTR, None) is not None:
        plan = _plan_for(backend, forward_batch)
        if plan:
            from sglang_mamba_ext.plugin.inchunk_from_chunks import _split_for, _stash_tail

            split = _split_for(backend, layer, forward_batch, plan)
            if split is None:
                first = sum(1 for items in plan.values() for o, _ in items if o < KERNEL_CHUNK)
                count_checkpoints(backend.req_to_token_pool, forward_batch, first, 0,
                                  sum(len(items) for items in plan.values()) - first)
                write_layer_checkpoints(backend, layer, forward_batch, mixed_qkv, a, b, plan, backend_impl(backend))
            else:
                now_plan, tail = split
                count_checkpoints(backend.req_to_token_pool, forward_batch,
                                  sum(len(items) for items in now_plan.values()), len(tail.offsets), 0)
                if now_plan:
                    write_layer_checkpoints(backend, layer, forward_batch, mixed_qkv, a, b, now_plan,
                                            backend_impl(backend))
                if tail.offsets:
                    _stash_tail(backend, layer, mixed_qkv, a, b, tail)
    return None


#: Counters on the request pool (``/server_info``, ``plugin/cache.py``): checkpoints written
#: from a row's start state (inside its first chunk), from the prefill's own chunk states, and
#: from the writer's own chunked pass; counted once per forward batch.
CHECKPOINT_COUNTERS = ("inchunk_from_start_state", "inchunk_from_chunk_states", "inchunk_from_own_pass")


def count_checkpoints(pool, forward_batch, from_start: int, from_chunks: int, own_pass: int) -> None:
    """Add one forward batch's checkpoints to :data:`CHECKPOINT_COUNTERS` on ``pool`` (the
    first layer to call counts; the others of the same batch are ignored)."""
    if pool is None or pool.__dict__.get("_inchunk_counted") is forward_batch:
        return
    pool.__dict__["_inchunk_counted"] = forward_batch
    for name, n in zip(CHECKPOINT_COUNTERS, (from_start, from_chunks, own_pass)):
        pool.__dict__[name] = pool.__dict__.get(name, 0) + int(n)
