"""Issue 39: prefix checkpoints past a row's first 64-token chunk written from SGLang's own
per-chunk states ``h``, where its KDA / GDN extend kernel returns them (``docs/design.md``,
"Prefix checkpoints"). :func:`.inchunk_checkpoints.forward_extend_before` copies such a
checkpoint's raw inputs aside (:func:`_stash_tail`); hooks on SGLang's kernel dispatchers
(``layers/attention/linear/kda_backend.py::KDAKernelDispatcher.extend``, ``gdn_backend.py::
GDNKernelDispatcher.extend``) ask the KDA kernel for ``h`` (BEFORE) and step each checkpoint at
most 63 tokens from the chunk state below it (AFTER,
:func:`~sglang_mamba_ext.speculative.ops.inchunk.from_chunks.write_tail_blocks`).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Dict

import torch

from sglang_mamba_ext.plugin.inchunk_checkpoints import (
    FROM_CHUNKS_ENV,
    GDN_DISPATCH,
    KDA_DISPATCH,
    KERNEL_CHUNK,
    WRITER_ATTR,
    _layer_weights,
    _raw_gate,
    backend_impl,
)

logger = logging.getLogger(__name__)

HOOK_TARGETS = [
    (KDA_DISPATCH + ".extend", "BEFORE", "dispatch_extend_before"),
    (GDN_DISPATCH + ".extend", "BEFORE", "dispatch_extend_before"),
    (KDA_DISPATCH + ".extend", "AFTER", "dispatch_extend_after"),
    (GDN_DISPATCH + ".extend", "AFTER", "dispatch_extend_after"),
]

#: ``{layer_id: pending tail write}`` between :func:`.inchunk_checkpoints.forward_extend_before` and the kernel
#: dispatcher's ``extend`` (one forward at a time per scheduler thread).
_pending = threading.local()


def _pending_map() -> Dict[int, dict]:
    m = getattr(_pending, "by_layer", None)
    if m is None:
        m = _pending.by_layer = {}
    return m


def _kernel_gives_chunk_states(backend, layer, forward_batch) -> bool:
    """Whether this extend's kernel returns SGLang's per-chunk states ``h`` (``[1, NT, HV, V,
    K]``): the Triton GDN kernel (``kernels/gdn_triton.py``, always) and the Triton KDA kernel
    (``kernels/kda_triton.py``, when asked with ``return_intermediate_states``), off AMD, off
    SGLang's CPU engine, outside multi-item scoring; and not turned off by
    :data:`FROM_CHUNKS_ENV`."""
    if os.environ.get(FROM_CHUNKS_ENV, "1").strip() == "0":
        return False
    disp = getattr(backend, "kernel_dispatcher", None)
    if disp is None or getattr(backend, "mis_metadata", None) is not None:
        return False
    try:
        from sglang.srt.utils import is_cpu, is_hip

        if is_cpu() or is_hip():
            return False
        if getattr(backend, WRITER_ATTR, None) == "kda":
            T = int(sum(forward_batch.extend_seq_lens_cpu))
            kernel = disp.effective_extend_kernel(getattr(layer, "lower_bound", None), T,
                                                  len(forward_batch.extend_seq_lens_cpu))
            return type(kernel).__name__ == "TritonKDAKernel"
        return type(disp.extend_kernel).__name__ == "TritonGDNKernel"
    except Exception:  # an SGLang without these names: the writer's own chunked pass
        return False


def _split_for(backend, layer, forward_batch, plan):
    """``(plan of the checkpoints with no chunk state below them, TailWrites)`` when the kernel
    gives chunk states (:func:`~sglang_mamba_ext.speculative.ops.inchunk.from_chunks.split_plan`),
    else None; computed once per forward batch."""
    from sglang_mamba_ext.speculative.ops.inchunk.from_chunks import first_chunks_of, split_plan

    cached = backend.__dict__.get("_mamba_radix_inchunk_split")
    if cached is not None and cached[0] is forward_batch:
        return cached[1]
    split = None
    if _kernel_gives_chunk_states(backend, layer, forward_batch):
        lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        firsts = first_chunks_of(lens, KERNEL_CHUNK)
        rows = sorted(plan)
        (_, offs, dsts), tail = split_plan([starts[r] for r in rows], [[o for o, _ in plan[r]] for r in rows],
                                           [[d for _, d in plan[r]] for r in rows], [lens[r] for r in rows],
                                           [firsts[r] for r in rows], KERNEL_CHUNK)
        now = {r: [(o, d) for o, d in zip(orow, drow) if o >= 0] for r, orow, drow in zip(rows, offs, dsts)}
        split = ({r: items for r, items in now.items() if items}, tail)
    backend.__dict__["_mamba_radix_inchunk_split"] = (forward_batch, split)
    return split


def _stash_tail(backend, layer, mixed_qkv, a, b, tail) -> None:
    """Copy the tail checkpoints' raw inputs aside for :func:`dispatch_extend_after`."""
    from sglang_mamba_ext.speculative.deferred import LAYOUTS
    from sglang_mamba_ext.speculative.ops.inchunk.from_chunks import gather_tail_blocks

    layout = LAYOUTS[getattr(backend, WRITER_ATTR)]
    a = _raw_gate(layer, a)
    if isinstance(mixed_qkv, (tuple, list)):
        mixed_qkv = torch.cat(list(mixed_qkv), dim=-1)
    T = mixed_qkv.shape[0]
    w = _layer_weights(backend, layer, layout.per_head_gate)
    blocks = gather_tail_blocks((mixed_qkv.unsqueeze(0), a.reshape(T, -1).unsqueeze(0), b.reshape(T, -1).unsqueeze(0)),
                                tail, w.shape.conv_kernel, KERNEL_CHUNK)
    pending = _pending_map()
    if layer.layer_id in pending:  # an earlier forward raised between the two hooks
        logger.warning("mamba-radix: layer %s: dropping a tail checkpoint write its forward never reached",
                       layer.layer_id)
    pending[layer.layer_id] = dict(backend=backend, layer=layer, blocks=blocks, weights=w, layout=layout)


def dispatch_extend_before(dispatcher, *args, **kwargs):
    """BEFORE SGLang's GDN / KDA kernel dispatcher ``extend``: with a pending tail write for
    this layer (``layer_id``), ask the KDA kernel for its chunk states
    (``return_intermediate_states=True``; GDN's kernel returns them anyway)."""
    entry = _pending_map().get(kwargs.get("layer_id"))
    if entry is None:
        return None
    entry["caller_wants_h"] = bool(kwargs.get("return_intermediate_states", False))
    if getattr(entry["backend"], WRITER_ATTR, None) == "kda":
        kwargs = dict(kwargs, return_intermediate_states=True)
        return (dispatcher, *args), kwargs
    return None


def dispatch_extend_after(result, dispatcher, *args, **kwargs):
    """AFTER SGLang's GDN / KDA kernel dispatcher ``extend``: write the layer's pending tail
    checkpoints from the kernel's chunk states ``h`` (:func:`~sglang_mamba_ext.speculative.ops.
    inchunk.from_chunks.write_tail_blocks`), and hand the caller the result it asked for (KDA:
    ``h`` dropped when it did not ask).

    Raises:
        RuntimeError: the kernel returned no chunk states (a planned slot would hold garbage).
    """
    entry = _pending_map().pop(kwargs.get("layer_id"), None)
    if entry is None:
        return None
    kda = getattr(entry["backend"], WRITER_ATTR, None) == "kda"
    h = None
    if isinstance(result, tuple):
        h = result[1] if kda else (result[2] if len(result) > 2 else None)
    if not isinstance(h, torch.Tensor):
        raise RuntimeError("mamba-radix in-chunk checkpoints: SGLang's extend kernel returned no chunk states")
    from sglang_mamba_ext.speculative.ops.inchunk.from_chunks import write_tail_blocks

    backend, layer = entry["backend"], entry["layer"]
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    conv, temporal = entry["layout"].replay_views(cache.conv[0], cache.temporal)
    write_tail_blocks(entry["blocks"], h.transpose(-1, -2), conv.unsqueeze(0), temporal.unsqueeze(0),
                      entry["weights"], backend_impl(backend))
    if kda and not entry.get("caller_wants_h", False):
        return result[0]
    return None
