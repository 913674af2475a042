"""Exact prefix checkpoints for SGLang's Inkling class (issue 40; ``docs/design.md``, "Prefix
checkpoints"): ``InklingForConditionalGeneration`` (``srt/models/inkling.py``) with ``use_sconv``.

Inkling has no linear-attention layer; its state is the windows of its short convolutions
(``models/inkling_common/sconv.py::ShortConvolution``), kept in SGLang's Mamba pool by
``InklingShortConvAttnBackend`` (``layers/attention/linear/inkling_sconv_backend.py``, a
``ShortConvAttnBackend`` subclass reached only through ``conv_state_metadata`` /
``sconv_state``). Per layer the pool has six conv streams (``configs/inkling.py``,
``mamba2_cache_params``; ``SconvType``: ``K_FULL, V_FULL, K_LOCAL, V_LOCAL, ATTN, MLP``), each
``[slots, W-1, width]`` (time on axis 1); a full-attention layer uses four of them (its keys' and
values' conv, ``K_FULL`` / ``V_FULL``, and the convs on its attention and MLP outputs), a
sliding-window layer the two ``*_LOCAL`` ones instead. A window is the stream's last ``W-1`` raw
conv inputs, oldest first; SGLang writes it after the conv (``kernels/sconv.py::
update_sconv_cache``: the last ``W-1`` rows of ``[start window (zeros without a prefix) ++ the
row's new inputs]``, stored in the pool's dtype).

The plugin's short-conv writer (:mod:`.inchunk_conv_ssd`) does not apply: it hooks SGLang's
Mamba causal-conv kernels and ``ShortConvAttnBackend.conv_state_metadata``, while Inkling calls
its own kernels (``inkling_common/kernels/sconv.py``: ``causal_conv1d``, ``update_sconv_cache``)
and its backend overrides ``conv_state_metadata``. So this module is the writer for the kind:

- AFTER ``InklingShortConvAttnBackend.__init__`` (:func:`backend_init_after`): under
  ``--enable-mamba-radix`` mark the backend (writer ``inkling_sconv``, torch) and make the pool a
  ``prefix_checkpoint_writer`` (it then plans the branch point and prompt - 1 at any token);
- BEFORE ``ShortConvolution.forward`` (:func:`sconv_forward_before`), for a prefill extend with
  planned checkpoints, before the conv's cache update advances the rows' working slots: write
  the window after each planned offset of each planned row into its planned slot
  (:func:`write_sconv_checkpoints`), for this conv's stream and layer. Every conv of every layer
  is called once per forward, so all of a checkpoint's streams are written.

Plain torch indexing on any device (no Triton version: a copy of ``W-1`` rows per checkpoint,
stream and layer). Hook targets: ``docs/sglang-hooks.md``.
"""

from __future__ import annotations

import logging
import os
from typing import List, Sequence, Tuple

import torch

logger = logging.getLogger(__name__)

INKLING_BACKEND = "sglang.srt.layers.attention.linear.inkling_sconv_backend.InklingShortConvAttnBackend"
SCONV_FORWARD = "sglang.srt.models.inkling_common.sconv.ShortConvolution.forward"
#: Writer name set on a marked backend (``inchunk_checkpoints.WRITER_ATTR``).
KIND = "inkling_sconv"
#: (hook target, kind, function name in this module)
HOOK_TARGETS = [
    (INKLING_BACKEND + ".__init__", "AFTER", "backend_init_after"),
    (SCONV_FORWARD, "BEFORE", "sconv_forward_before"),
]


def is_inkling_backend(backend) -> bool:
    """Whether ``backend`` is SGLang's ``InklingShortConvAttnBackend`` (or a subclass), by name
    (no import of SGLang's module)."""
    return any(c.__name__ == "InklingShortConvAttnBackend" for c in type(backend).__mro__)


def store_cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` in the pool's ``dtype`` as SGLang's Triton cache update stores it: rounded to
    nearest even (torch's cast, as a GPU's ``cvt.rn``), except under Triton's interpreter on a
    host without CUDA, whose store of a float16 / float32 value into a bfloat16 pointer goes
    through float32 and drops the low 16 bits (``triton/runtime/interpreter.py``,
    ``_convert_float`` without a rounding mode): there the same truncation is applied, so a
    checkpoint is bit-equal to the window SGLang's interpreted kernel leaves on CPU
    (``tests/test_inchunk_inkling.py``)."""
    if x.dtype == dtype:
        return x
    if (dtype == torch.bfloat16 and not x.is_cuda and os.environ.get("TRITON_INTERPRET") == "1"):
        return (x.float().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)
    return x.to(dtype)


def sconv_windows_at(start_window: torch.Tensor, x: torch.Tensor, offsets: Sequence[int]) -> List[torch.Tensor]:
    """The conv windows ``[W-1, D]`` after each of ``offsets`` (``1 .. len(x)``) new inputs
    ``x [n, D]`` from ``start_window [W-1, D]`` (already in the pool's dtype; zeros for a row
    without a prefix): rows ``o .. o+W-2`` of ``[start_window ++ x]``, ``x`` cast to the window's
    dtype as SGLang's cache update stores it (:func:`store_cast`)."""
    w = start_window.shape[0]
    seq = torch.cat([start_window, store_cast(x, start_window.dtype)], dim=0)
    return [seq[o:o + w] for o in offsets]


@torch.no_grad()
def write_sconv_checkpoints(x: torch.Tensor, cache: torch.Tensor,
                            rows: Sequence[Tuple[int, int, int, Sequence[Tuple[int, int]]]]) -> None:
    """Write one conv stream's planned checkpoints into its pool ``cache [slots, W-1, D]``.

    Args:
        x: ``[T, D]`` the conv's raw inputs of the whole extend (packed rows).
        cache: the stream's layer cache, written in place (its dtype).
        rows: ``(start, length, src_slot, [(offset, dst_slot), ...])`` per planned row: its first
            token in ``x``, its new tokens, the slot holding its start window (``-1``: zeros, no
            prefix) and its checkpoints (the window after ``offset`` in ``1 .. length`` of its
            tokens goes to ``dst_slot``). Must run before the conv's cache update advances
            ``src_slot``.
    """
    w = cache.shape[1]
    for start, length, src, items in rows:
        if not items:
            continue
        deepest = max(o for o, _ in items)
        if src >= 0:
            window = cache[src].clone()
        else:
            window = torch.zeros(w, cache.shape[2], dtype=cache.dtype, device=cache.device)
        wins = sconv_windows_at(window, x[start:start + deepest], [o for o, _ in items])
        for (_, dst), win in zip(items, wins):
            cache[dst].copy_(win)


def reference_window(start_window: torch.Tensor, x: torch.Tensor, offset: int) -> torch.Tensor:
    """The tests' oracle: the window after ``offset`` inputs, one token at a time (shift left,
    append the token, in the window's dtype), as a decode step updates it."""
    win = start_window.clone()
    for t in range(offset):
        win = torch.cat([win[1:], store_cast(x[t:t + 1], win.dtype)], dim=0)
    return win


def why_not_writer(model_runner):
    """Why the writer cannot see every conv of the model (None: it can). On CUDA SGLang may run
    the key / value convs inside fused kernels that never call ``ShortConvolution.forward``: the
    attention prologue (``inkling_common/attn.py``, ``fused_prologue``: ``fa4``, head size 128,
    ``SGLANG_OPT_USE_INKLING_FUSED_ATTN_PROLOGUE``, default on) and the fused all-reduce + output
    conv paths at ``--tp`` > 1 (``SGLANG_OPT_USE_INKLING_FUSED_AR_SCONV*``); not checked on a GPU,
    so the writer is used off CUDA, or on CUDA with those switched off and one rank."""
    device = str(getattr(model_runner, "device", "cuda"))
    if not device.startswith("cuda"):
        return None
    from sglang_mamba_ext.plugin.inchunk_checkpoints import prefill_graph_reason

    reason = prefill_graph_reason(model_runner)  # SGLang captures Inkling's prefill in full graphs by default
    if reason is not None:
        return reason
    from sglang.srt.environ import envs

    if envs.SGLANG_OPT_USE_INKLING_FUSED_ATTN_PROLOGUE.get():
        return "the fused attention prologue runs the key / value convs (SGLANG_OPT_USE_INKLING_FUSED_ATTN_PROLOGUE)"
    tp = getattr(getattr(model_runner, "server_args", None), "tp_size", 1) or 1
    if tp > 1:
        return "fused all-reduce + conv paths at --tp > 1 are not covered"
    return None


def backend_init_after(result, backend, model_runner, *args, **kwargs):
    """AFTER ``InklingShortConvAttnBackend.__init__``: under ``--enable-mamba-radix`` (the pool
    has ``prefix_checkpoint_writer``) mark the backend as this module's writer and let the pool
    plan exact checkpoints; log one line naming the class."""
    from sglang_mamba_ext.plugin.inchunk_checkpoints import IMPL_ATTR, WRITER_ATTR

    pool = getattr(model_runner, "req_to_token_pool", None)
    if not hasattr(pool, "prefix_checkpoint_writer"):
        return result
    hf = getattr(getattr(model_runner, "model_config", None), "hf_config", None)
    family = (getattr(hf, "architectures", None) or [type(hf).__name__])[0]
    reason = why_not_writer(model_runner)
    if reason is not None:
        logger.info("mamba-radix: %s: prefix checkpoints stay on the %s-token grid with %s: %s", family,
                    getattr(backend, "mamba_cache_chunk_size", 64), type(backend).__name__, reason)
        return result
    setattr(backend, WRITER_ATTR, KIND)
    setattr(backend, IMPL_ATTR, "torch")
    pool.prefix_checkpoint_writer = True
    logger.info("mamba-radix: exact prefix checkpoints with %s (in-chunk torch writer) for %s",
                type(backend).__name__, family)
    return result


def _sconv_backend():
    from sglang.srt.model_executor.forward_context import get_attn_backend

    backend = get_attn_backend()
    return getattr(backend, "short_conv_backend", backend)


def sconv_forward_before(module, hidden_states=None, positions=None, forward_batch=None, *args, **kwargs):
    """BEFORE ``ShortConvolution.forward(hidden_states, positions, forward_batch)``: the planned
    checkpoints of this conv's stream and layer (module docstring); nothing otherwise."""
    if forward_batch is None or hidden_states is None:
        return None
    mode = forward_batch.forward_mode
    if not mode.is_extend() or mode.is_target_verify() or mode.is_draft_extend_v2():
        return None
    from sglang_mamba_ext.plugin.inchunk_checkpoints import count_checkpoints, extend_rows, plan_of_kind

    backend = _sconv_backend()
    plan = plan_of_kind(backend, forward_batch, KIND)
    if not plan:
        return None
    rows = extend_rows(backend, forward_batch, plan)
    n = sum(len(items) for items in plan.values())
    count_checkpoints(backend.req_to_token_pool, forward_batch, n, 0, 0)
    cache = backend.sconv_state(layer_id=module.layer_id, stream=module.sconv_type.value)
    write_sconv_checkpoints(hidden_states.reshape(-1, hidden_states.shape[-1]), cache, rows)
    return None
