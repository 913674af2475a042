"""Exact prefix checkpoints for Qwen4-Exp's PLE side states (issue 40; ``docs/design.md``, "Prefix
checkpoints"). SGLang 0.5.23's ``Qwen4ExpForConditionalGeneration`` (``srt/models/qwen4_exp.py``)
runs Qwen3.5's Gated DeltaNet layers, written at any offset by the in-chunk writer
(:mod:`.inchunk_checkpoints`), and on each PLE layer (``text_config.ple_layer_ids``) two more
per-request states that live beside the GDN state in SGLang's state pool, addressed by the same
mamba slot (``mem_cache/ple_state_pool.py``; registered as slot siblings of ``MambaPool``,
``memory_pool.py:1490-1493``, so slot copies, clears and host copies carry them):

- the **dilated short-conv window** ``ShortConvPool.conv_state [PLE layers, slots + 1, C, L]``
  (``C = hidden * hc_count``, ``L = (ple_conv_kernel_size - 1) * ngram_size``: the conv's dilation
  is ``ngram_size``, ``configs/qwen4_exp.py:103-108``): the last ``L`` conv inputs
  (``norm_conv`` of the gated PLE value), oldest first;
- the **n-gram history** ``NGramPool.context [slots + 1, ngram_size - 1]``: the last
  ``ngram_size - 1`` token ids (EOS before the first token), one per request.

Neither is a recurrence: the state after ``o`` new tokens is a window of the row's inputs.
SGLang's extend (``Qwen4ExpPLELayer._short_conv``, ``qwen4_exp.py:1123-1254``) builds
``conv_input = [start window | the row's inputs]`` and stores ``conv_input[:, len : len + L]``
into the working slot (and, under SGLang's own extra-buffer tracking, the window at the
track offset, ``_ple_track_targets``); ``_commit_ple_batch`` (``:410-463``) does the same with
``[history | the row's tokens]``. So an exact checkpoint at any offset ``o`` is the same gather
at ``o``, with nothing to recompute:

- AROUND ``Qwen4ExpPLELayer._short_conv`` (:func:`short_conv_around`): for a prefill extend with
  planned checkpoints (``MambaRadixReqToTokenPool.prefix_checkpoint_plan``: ``{row: [(offset,
  slot)]}``), the rows' start windows are read before SGLang's call advances the working slots,
  then each planned slot gets :func:`conv_window_at` (the same dtype casts as SGLang's: the start
  window to the inputs' dtype, the result to the pool's);
- AROUND ``_commit_ple_batch`` (:func:`commit_ple_batch_around`): after SGLang's commit, each
  planned slot gets :func:`ngram_context_at` from the batch's ``ngram_context``.

Torch ops on any device (a few index copies per checkpoint and PLE layer). Decode, speculative
verify and idle batches are left alone (no checkpoint is planned there). Tests:
``tests/test_inchunk_ple.py`` (these windows against a token-by-token reference and against
SGLang's own ``_short_conv`` / ``_commit_ple_batch`` at every offset).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

QWEN4_EXP = "sglang.srt.models.qwen4_exp"
#: (hook target, kind, function name in this module)
HOOK_TARGETS = [
    (QWEN4_EXP + ".Qwen4ExpPLELayer._short_conv", "AROUND", "short_conv_around"),
    (QWEN4_EXP + "._commit_ple_batch", "AROUND", "commit_ple_batch_around"),
]


def conv_window_at(start: torch.Tensor, x_row: torch.Tensor, offset: int) -> torch.Tensor:
    """The conv window ``[C, L]`` after ``offset`` of the row's inputs ``x_row [n, C]``, from the
    row's start window ``start [C, L]`` (in ``x_row``'s dtype, as SGLang concatenates them):
    columns ``offset .. offset + L`` of ``[start | x_row^T]``."""
    L = start.shape[-1]
    if L == 0:
        return start[:, :0]
    if offset >= L:
        return x_row[offset - L: offset].transpose(0, 1)
    return torch.cat([start[:, offset:], x_row[:offset].transpose(0, 1)], dim=1)


def ngram_context_at(history: torch.Tensor, tokens: torch.Tensor, offset: int) -> torch.Tensor:
    """The n-gram history ``[K]`` after ``offset`` of the row's ``tokens``, from the row's start
    history ``history [K]``: entries ``offset .. offset + K`` of ``[history | tokens]``."""
    return torch.cat([history, tokens[:offset].to(history.dtype)])[offset: offset + history.shape[0]]


def _row_starts(lengths: Sequence[int]) -> List[int]:
    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += int(n)
    return starts


def _plan(forward_batch, ple_batch) -> Optional[Dict[int, List[Tuple[int, int]]]]:
    """The planned checkpoints of this forward (``{batch row: [(offset, slot)]}``) when it is a
    prefill extend of a pool that plans them; None otherwise."""
    if ple_batch is None or forward_batch is None or ple_batch.use_decode_fast_path:
        return None
    mode = ple_batch.mode
    if not mode.is_extend() or mode.is_target_verify() or mode.is_draft_extend_v2():
        return None
    from sglang.srt.model_executor.forward_context import get_req_to_token_pool

    pool = get_req_to_token_pool()
    if not getattr(pool, "prefix_checkpoint_writer", False) or not hasattr(pool, "prefix_checkpoint_plan"):
        return None
    if forward_batch.extend_seq_lens_cpu is None:
        return None
    return pool.prefix_checkpoint_plan(forward_batch) or None


@torch.no_grad()
def write_conv_checkpoints(conv_state: torch.Tensor, start: torch.Tensor, x: torch.Tensor,
                           lengths: Sequence[int], plan: Dict[int, List[Tuple[int, int]]]) -> int:
    """Write each planned ``(offset, slot)`` of ``plan`` (batch row -> list) into ``conv_state
    [slots + 1, C, L]``: :func:`conv_window_at` of the row's start window (``start [rows, C, L]``,
    read before SGLang advanced the working slots) and its inputs in the packed ``x [T, C]``.
    Returns the number of slots written."""
    starts = _row_starts(lengths)
    n = 0
    for row, items in plan.items():
        x_row = x[starts[row]: starts[row] + int(lengths[row])]
        s = start[row].to(dtype=x.dtype)
        for offset, slot in items:
            conv_state[slot] = conv_window_at(s, x_row, int(offset)).to(dtype=conv_state.dtype)
            n += 1
    return n


def short_conv_around(original, layer, x, forward_batch, batch, *args, **kwargs):
    """AROUND SGLang's ``Qwen4ExpPLELayer._short_conv(x, forward_batch, batch)``: SGLang's
    output unchanged; for a prefill extend with planned checkpoints, the dilated conv window after
    each planned offset also written into its slot (module docstring)."""
    plan = _plan(forward_batch, batch) if x is not None and x.shape[0] else None
    if not plan:
        return original(layer, x, forward_batch, batch, *args, **kwargs)
    from sglang.srt.model_executor.forward_context import get_req_to_token_pool

    conv_state = get_req_to_token_pool().short_conv_layer_cache(layer.layer_id)
    start = conv_state.index_select(0, batch.state_indices).clone()
    out = original(layer, x, forward_batch, batch, *args, **kwargs)
    write_conv_checkpoints(conv_state, start, x, forward_batch.extend_seq_lens_cpu, plan)
    return out


@torch.no_grad()
def write_ngram_checkpoints(pool, context: torch.Tensor, row_width: int,
                            plan: Dict[int, List[Tuple[int, int]]]) -> int:
    """Write each planned ``(offset, slot)`` into the pool's n-gram history:
    ``context [rows, K + row_width]`` is the batch's ``[history | tokens]`` (SGLang's
    ``_PLEBatch.ngram_context``), so the history after ``offset`` tokens is its columns
    ``offset .. offset + K`` (:func:`ngram_context_at`). Returns the number of slots written."""
    K = context.shape[1] - row_width
    n = 0
    for row, items in plan.items():
        for offset, slot in items:
            idx = torch.tensor([int(slot)], dtype=torch.long, device=context.device)
            pool.set_ngram_context(idx, context[row, int(offset): int(offset) + K].unsqueeze(0))
            n += 1
    return n


def commit_ple_batch_around(original, batch, forward_batch, *args, **kwargs):
    """AROUND SGLang's ``_commit_ple_batch(batch, forward_batch)``: SGLang's commit, then for a
    prefill extend with planned checkpoints the n-gram history after each planned offset written
    into its slot (module docstring)."""
    result = original(batch, forward_batch, *args, **kwargs)
    if batch is None or batch.ngram_context is None or not batch.processed_tokens:
        return result
    plan = _plan(forward_batch, batch)
    if plan:
        from sglang.srt.model_executor.forward_context import get_req_to_token_pool

        write_ngram_checkpoints(get_req_to_token_pool(), batch.ngram_context, batch.row_width, plan)
    return result
