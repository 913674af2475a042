"""Exact prefix checkpoints with SGLang's Mamba2 and short-conv backends (issue 24, item 3;
``docs/design.md``, "Prefix checkpoints"): the serving side of the Mamba2 / SSD writer
(:mod:`sglang_mamba_ext.speculative.ops.inchunk.mamba2`) and the short-conv writer
(:mod:`sglang_mamba_ext.speculative.ops.inchunk.shortconv`).

SGLang's ``MambaMixer2.forward`` (``srt/layers/attention/mamba/mamba.py``) and LFM2's
``Lfm2ShortConv.forward`` (``srt/models/lfm2.py``) compute the raw conv input inside the layer
and hand it straight to module-level kernels, so the plugin reads it where those kernels are
called. The plan (which token offsets, into which SSM slots) is the GDN / KDA writer's
(:func:`..inchunk_checkpoints._plan_for`, :func:`..inchunk_checkpoints._writes_for`, from the
pool's ``prefix_checkpoint_plan``); the pool plans exact positions once
:func:`..inchunk_checkpoints.backend_init_after` has set its ``prefix_checkpoint_writer``.

Hooks (all BEFORE / AFTER; targets in :data:`HOOK_TARGETS`, listed in ``docs/sglang-hooks.md``):

- BEFORE ``Mamba2AttnBackend.forward`` (:func:`mamba2_forward_before`): when the backend is a
  writer and this extend has planned checkpoints, opens a per-layer context (backend, forward
  batch, layer id, mixer); AFTER it (:func:`mamba2_forward_after`) checks that both kernel
  hooks below ran for the layer (RuntimeError otherwise: a planned slot would hold garbage)
  and closes it.
- AFTER ``ShortConvAttnBackend.conv_state_metadata`` (:func:`short_conv_metadata_after`): the
  same context for an LFM2 layer (the layer asks for its conv handle just before its conv).
- BEFORE SGLang's varlen ``causal_conv1d_fn`` (its Triton version, ``kernels/ops/mamba/
  causal_conv1d_triton.py``, which the CPU bridge binds in ``mamba.py``; and the dispatcher in
  ``srt/layers/attention/mamba/causal_conv1d.py`` that LFM2 and CUDA Mamba2 call)
  (:func:`conv_fn_before`): receives the raw conv input ``x [D, T]`` and the layer's
  ``conv_states [slots, D, W-1]`` *before* the kernel advances the rows' working slots. Short
  conv: writes the planned windows. Mamba2: keeps ``x`` and the rows' start windows for the
  scan hook.
- BEFORE SGLang's ``mamba_chunk_scan_combined`` (``kernels/ops/mamba/triton_ops/
  ssd_combined.py``) (:func:`ssd_scan_before`): receives the raw ``dt [1, T, HV]``; the SSM
  pool still holds the start states (SGLang stores ``varlen_state`` after the scan). For the
  duration of the write the start windows are put back into the rows' working conv slots
  (the conv kernel has advanced them), then the Mamba2 writer stores each planned slot's
  conv window and SSM state, and the advanced windows are restored.

The writers run as Triton kernels on CUDA and as their torch loops on CPU, where Triton only
runs interpreted (:func:`..inchunk_checkpoints.writer_impl`, ``SGLANG_MAMBA_EXT_INCHUNK_IMPL``).
With no context (SGLang's own cache, a backend not marked, no plan, decode) every hook returns
at once and SGLang's call runs unchanged. A context is per thread (one forward at a time).
"""

from __future__ import annotations

import logging
import threading
from typing import Dict, List, Optional, Tuple

import torch

from sglang_mamba_ext.plugin.inchunk_checkpoints import (
    MAMBA2_BACKEND,
    SHORT_CONV_BACKEND,
    WRITER_ATTR,
    backend_impl,
    count_checkpoints,
    _plan_for,
    _writes_and_host,
    _writes_for,
)

logger = logging.getLogger(__name__)

CONV_TRITON_FN = "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn"
CONV_DISPATCH_FN = "sglang.srt.layers.attention.mamba.causal_conv1d.causal_conv1d_fn"
SSD_SCAN_FN = "sglang.kernels.ops.mamba.triton_ops.ssd_combined.mamba_chunk_scan_combined"
#: (hook target, kind, function name in this module)
HOOK_TARGETS = [
    (MAMBA2_BACKEND + ".forward", "BEFORE", "mamba2_forward_before"),
    (MAMBA2_BACKEND + ".forward", "AFTER", "mamba2_forward_after"),
    (SHORT_CONV_BACKEND + ".conv_state_metadata", "AFTER", "short_conv_metadata_after"),
    (CONV_TRITON_FN, "BEFORE", "conv_fn_before"),
    (CONV_DISPATCH_FN, "BEFORE", "conv_fn_before"),
    (SSD_SCAN_FN, "BEFORE", "ssd_scan_before"),
    (SSD_SCAN_FN, "AFTER", "ssd_scan_after"),
]

_local = threading.local()


class LayerContext:
    """One layer's pending checkpoint writes, from the backend hook to the kernel hooks."""

    def __init__(self, kind: str, backend, forward_batch, layer_id: int, plan, mixer=None):
        self.kind = kind  # "mamba2" | "shortconv"
        self.backend = backend
        self.forward_batch = forward_batch
        self.layer_id = layer_id
        self.plan: Dict[int, List[Tuple[int, int]]] = plan
        self.mixer = mixer
        self.cache = backend.req_to_token_pool.mamba2_layer_cache(layer_id)
        self.conv_done = False
        self.scan_done = False
        self.xbc: Optional[torch.Tensor] = None  # [1, T, D] raw conv input (Mamba2)
        self.start_windows: Optional[torch.Tensor] = None  # [R', D, W-1] rows with a prefix
        self.prefixed: Optional[torch.Tensor] = None  # their slots
        self.tail = None  # (TailBlocks, caller's return_intermediate_states) until the scan returned


def _current() -> Optional[LayerContext]:
    return getattr(_local, "ctx", None)


def _open(kind, backend, forward_batch, layer_id, mixer=None) -> None:
    _local.ctx = None
    if getattr(backend, WRITER_ATTR, None) != kind or forward_batch is None:
        return
    plan = _plan_for(backend, forward_batch)
    if plan:
        _local.ctx = LayerContext(kind, backend, forward_batch, layer_id, plan, mixer)


def mamba2_forward_before(backend, mixer=None, hidden_states=None, output=None, layer_id=None,
                          forward_batch=None, *args, **kwargs) -> None:
    """BEFORE ``Mamba2AttnBackend.forward``: open the layer's context when checkpoints are
    planned in this extend (see the module docstring)."""
    _open("mamba2", backend, forward_batch, layer_id, mixer)
    return None


def mamba2_forward_after(result, backend, *args, **kwargs) -> None:
    """AFTER ``Mamba2AttnBackend.forward``: close the context; raise when the kernel hooks did
    not both run for a layer with planned checkpoints."""
    ctx, _local.ctx = _current(), None
    if ctx is not None and not (ctx.conv_done and ctx.scan_done and ctx.tail is None):
        raise RuntimeError(
            f"mamba-radix Mamba2 checkpoints: layer {ctx.layer_id} did not call SGLang's causal_conv1d_fn and "
            f"mamba_chunk_scan_combined as expected (conv {ctx.conv_done}, scan {ctx.scan_done}); planned "
            "checkpoint slots were not written")
    return None


def short_conv_metadata_after(result, backend, layer_id=None, forward_batch=None, *args, **kwargs) -> None:
    """AFTER ``ShortConvAttnBackend.conv_state_metadata``: open an LFM2 layer's context (its
    prefill conv follows)."""
    ctx = _current()
    if ctx is not None and ctx.kind == "shortconv" and not ctx.conv_done:
        raise RuntimeError(f"mamba-radix short-conv checkpoints: layer {ctx.layer_id} never ran its prefill conv")
    _open("shortconv", backend, forward_batch, layer_id)
    return None


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors view the same memory the same way (SGLang builds a new layer
    view of the pool at every ``mamba2_layer_cache`` call)."""
    return (isinstance(a, torch.Tensor) and a.data_ptr() == b.data_ptr() and a.shape == b.shape
            and a.stride() == b.stride() and a.dtype == b.dtype)


def _check_not_capturing(t: torch.Tensor) -> None:
    if t.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("mamba-radix in-chunk checkpoints: extend captured in a CUDA graph")


def _prefixed_rows(ctx: LayerContext, writes):
    """Slots (``[R']`` int64, device) of the planned rows that start from a prefix; the rows
    are chosen on the host (``extend_prefix_lens_cpu``), so no device sync."""
    rows = sorted(ctx.plan)
    prefix = ctx.forward_batch.extend_prefix_lens_cpu
    keep = [k for k, r in enumerate(rows) if int(prefix[r]) > 0]
    sel = torch.tensor(keep, dtype=torch.int64, device=writes.src_slots.device)
    return writes.src_slots[sel]


def conv_fn_before(x, weight=None, bias=None, *args, **kwargs) -> None:
    """BEFORE SGLang's varlen ``causal_conv1d_fn(x [D, T], weight [D, W], bias, ...,
    conv_states=[slots, D, W-1], ...)``, called with ``conv_states`` as a keyword as both
    ``MambaMixer2.forward`` and ``Lfm2ShortConv.forward`` do. Inert without a context or once
    the layer's conv was seen (the dispatcher calls the Triton version)."""
    ctx = _current()
    if ctx is None or ctx.conv_done:
        return None
    conv_states = kwargs.get("conv_states")
    if args or conv_states is None or not _same_view(conv_states, ctx.cache.conv[0]):
        raise RuntimeError(
            f"mamba-radix in-chunk checkpoints: layer {ctx.layer_id}'s causal_conv1d_fn call is not the one "
            "expected (conv_states by keyword, the layer's pool tensor)")
    _check_not_capturing(x)
    writes = _writes_for(ctx.backend, ctx.forward_batch, ctx.plan)
    conv_in = x.t().contiguous().unsqueeze(0)  # [1, T, D]
    if ctx.kind == "shortconv":
        from sglang_mamba_ext.speculative.ops.inchunk.shortconv import write_conv_window_checkpoints

        write_conv_window_checkpoints(conv_in, writes, conv_states.unsqueeze(0), impl=backend_impl(ctx.backend))
    else:
        ctx.xbc = conv_in
        ctx.prefixed = _prefixed_rows(ctx, writes)
        ctx.start_windows = conv_states[ctx.prefixed].clone()
    ctx.conv_done = True
    return None


def _mamba2_weights(backend, layer_id: int, mixer):
    """The layer's :class:`~sglang_mamba_ext.speculative.ops.inchunk.mamba2.Mamba2Weights`
    (``L = 1``, views of the mixer's parameters), cached on the backend by layer id."""
    from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import Mamba2Weights

    cache = backend.__dict__.setdefault("_mamba_radix_mamba2_weights", {})
    w = cache.get(layer_id)
    if w is None:
        cw = mixer.conv1d.weight
        cw = cw.detach().reshape(cw.shape[0], cw.shape[-1])  # [D, 1, W] -> [D, W]
        bias = mixer.conv1d.bias
        A = mixer.A.detach().float().reshape(1, -1).contiguous()
        HV, P, N = A.shape[-1], int(mixer.head_dim), int(mixer.ssm_state_size)
        G = (cw.shape[0] - HV * P) // (2 * N)
        w = Mamba2Weights(
            cw.unsqueeze(0).contiguous(),
            None if bias is None else bias.detach().reshape(1, -1).contiguous(),
            A,
            mixer.dt_bias.detach().float().reshape(1, -1).contiguous(),
            n_groups=G, head_dim=P, d_state=N,
        )
        cache[layer_id] = w
    return w


def ssd_scan_before(x, dt=None, A=None, *args, **kwargs) -> None:
    """BEFORE SGLang's ``mamba_chunk_scan_combined(x, dt [1, T, HV] raw, A, B, C, ...,
    dt_bias=..., dt_softplus=True, dt_limit=(0, inf), ...)``: write the layer's planned conv
    windows and SSM states (Mamba2 writer, :func:`backend_impl`) from the start states, while the SSM pool
    still holds them."""
    ctx = _current()
    if ctx is None or ctx.kind != "mamba2" or ctx.scan_done:
        return None
    from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_checkpoints

    mixer = ctx.mixer
    if (not ctx.conv_done or dt is None or A is not mixer.A or kwargs.get("dt_bias") is not mixer.dt_bias
            or not kwargs.get("dt_softplus", False) or tuple(kwargs.get("dt_limit", (0.0, float("inf"))))
            != (0.0, float("inf")) or getattr(mixer, "activation", "silu") != "silu"):
        raise RuntimeError(
            f"mamba-radix Mamba2 checkpoints: layer {ctx.layer_id}'s mamba_chunk_scan_combined call is not the one "
            "expected (after its conv; the mixer's A and dt_bias; softplus; dt_limit (0, inf); silu)")
    writes, host = _writes_and_host(ctx.backend, ctx.forward_batch, ctx.plan)
    conv_pool, ssm_pool = ctx.cache.conv[0], ctx.cache.temporal
    T = ctx.xbc.shape[1]
    dt_raw = dt.reshape(-1, dt.shape[-1])[:T].unsqueeze(0).contiguous()
    weights = _mamba2_weights(ctx.backend, ctx.layer_id, mixer)
    chunk = kwargs.get("chunk_size", args[2] if len(args) > 2 else None)
    changed = None
    total = sum(1 for row in host[1] for o in row if o >= 0)
    if _scan_gives_chunk_states(kwargs, chunk, x.shape[1], T):
        from sglang_mamba_ext.speculative.ops.inchunk import plan_writes
        from sglang_mamba_ext.speculative.ops.inchunk.from_chunks import gather_tail_blocks, split_plan

        cached = ctx.backend.__dict__.get("_mamba_radix_ssd_split")
        if cached is not None and cached[0] is ctx.forward_batch and cached[1] == chunk:
            host, tail, writes = cached[2]  # every Mamba2 layer of a forward has the same split
        else:
            lens = [int(ctx.forward_batch.extend_seq_lens_cpu[r]) for r in sorted(ctx.plan)]
            host, tail = split_plan(*host, lens, None, int(chunk))
            writes = plan_writes([(lo, 0, [(o, d) for o, d in zip(orow, drow) if o >= 0])
                                  for lo, orow, drow in zip(*host)],
                                 writes.src_slots.device)._replace(src_slots=writes.src_slots)
            ctx.backend.__dict__["_mamba_radix_ssd_split"] = (ctx.forward_batch, chunk, (host, tail, writes))
        count_checkpoints(ctx.backend.req_to_token_pool, ctx.forward_batch, total - len(tail.offsets),
                          len(tail.offsets), 0)
        if tail.offsets:
            ctx.tail = (gather_tail_blocks((ctx.xbc, dt_raw), tail, weights.conv_kernel, int(chunk)),
                        bool(kwargs.get("return_intermediate_states", False)))
            changed = ((x, dt, A, *args), dict(kwargs, return_intermediate_states=True))
    else:
        first = sum(1 for lo, row in zip(host[0], host[1]) for o in row if 0 <= o < int(chunk or 64))
        count_checkpoints(ctx.backend.req_to_token_pool, ctx.forward_batch, first, 0, total - first)
    if writes.offsets.shape[1]:
        advanced = conv_pool[ctx.prefixed].clone()
        conv_pool[ctx.prefixed] = ctx.start_windows
        try:
            write_mamba2_checkpoints(ctx.xbc, dt_raw, writes, conv_pool.unsqueeze(0), ssm_pool.unsqueeze(0), weights,
                                     impl=backend_impl(ctx.backend), check_offsets=False, host=host)
        finally:
            conv_pool[ctx.prefixed] = advanced
    ctx.scan_done = True
    ctx.xbc = ctx.start_windows = None
    return changed


def _scan_gives_chunk_states(kwargs, chunk, scan_tokens: int, extend_tokens: int) -> bool:
    """Whether the planned checkpoints past a grid boundary can start from the scan's own chunk
    states: a varlen scan (``return_varlen_states`` with ``cu_seqlens``) over exactly the
    extend's tokens with a known chunk size, and not turned off by ``SGLANG_MAMBA_EXT_INCHUNK_
    FROM_CHUNKS=0`` (:data:`..inchunk_checkpoints.FROM_CHUNKS_ENV`)."""
    import os

    from sglang_mamba_ext.plugin.inchunk_checkpoints import FROM_CHUNKS_ENV

    return (os.environ.get(FROM_CHUNKS_ENV, "1").strip() != "0" and isinstance(chunk, int) and chunk > 0
            and bool(kwargs.get("return_varlen_states")) and kwargs.get("cu_seqlens") is not None
            and scan_tokens == extend_tokens)


def ssd_scan_after(result, x, *args, **kwargs):
    """AFTER SGLang's ``mamba_chunk_scan_combined``: the layer's checkpoints past a grid
    boundary (:func:`ssd_scan_before` asked the scan for its chunk states ``states [1, NC, HV,
    P, N]``), each from the state below it (:func:`~sglang_mamba_ext.speculative.ops.inchunk.
    mamba2.write_mamba2_tail_blocks`); the caller gets the result without ``states`` unless it
    asked for them.

    Raises:
        RuntimeError: the scan returned no chunk states.
    """
    ctx = _current()
    if ctx is None or ctx.kind != "mamba2" or ctx.tail is None:
        return None
    (blocks, wanted), ctx.tail = ctx.tail, None
    states = result[0] if isinstance(result, tuple) else None
    if not isinstance(states, torch.Tensor) or states.dim() != 5:
        raise RuntimeError(f"mamba-radix Mamba2 checkpoints: layer {ctx.layer_id}'s scan returned no chunk states")
    from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_tail_blocks

    write_mamba2_tail_blocks(blocks, states, ctx.cache.conv[0].unsqueeze(0), ctx.cache.temporal.unsqueeze(0),
                             _mamba2_weights(ctx.backend, ctx.layer_id, ctx.mixer), backend_impl(ctx.backend))
    if wanted or kwargs.get("return_track_states"):
        return None
    rest = result[1:]
    return rest[0] if len(rest) == 1 else tuple(rest)
