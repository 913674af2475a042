"""Exact prefix checkpoints for ZAYA1's compressed convolutional attention (CCA; issue 40;
``docs/design.md``, "Prefix checkpoints"): SGLang 0.5.23's ``ZayaForCausalLM``
(``srt/models/zaya.py``).

CCA's attention layers keep, besides their KV cache, a per-request state in SGLang's Mamba pool
(``configs/zaya.py:284-303``: ``Mamba2StateShape`` with two conv tensors and an empty temporal
state), run by ``ShortConvAttnBackend`` (``layers/attention/attention_registry.py:495-533``),
which only hands out the slots (``conv_state_metadata``); the layer runs its own conv:

- ``conv[0]`` ``[slots, C, P]``: the last ``P = (cca_time0 - 1) + (cca_time1 - 1)`` raw conv
  inputs ``qk = [linear_q(h) || linear_k(h)]`` (``C`` channels), oldest first, which the two-stage
  causal conv ``conv_qk`` needs as its left padding (``zaya.py:231-330``, ``cca_extend``:
  ``new_state = padded[..., -total_padding:]``);
- ``conv[1]`` ``[slots, H, 1]``: the previous token's layer input ``h_{t-1}``, the input of
  ``val_proj2`` for the next token (``prev_hs``).

Both are windows of the layer's inputs with no recurrence, so the exact state after any token
offset ``o`` of a prefill is ``qk`` of tokens ``o - P .. o - 1`` (the row's start window where
``o < P``) and ``h_{o - 1}``: the short-conv writer's conv-window copy
(:func:`sglang_mamba_ext.speculative.ops.inchunk.shortconv.write_conv_window_checkpoints`) on
each tensor, with the plan of the other writers (:func:`..inchunk_checkpoints._writes_for`).

Hook: BEFORE ``sglang.srt.models.zaya.cca_extend(qk, hidden_states, conv_qk, conv_state,
prev_hs_state, slot_ids, has_prefix, extend_seq_lens_cpu, total_padding)`` (:func:`cca_extend_before`),
called by ``CCA.forward`` (``zaya.py:828-852``) right after it asked the backend for the layer's
handle: the AFTER hook on ``ShortConvAttnBackend.conv_state_metadata``
(:func:`..inchunk_conv_ssd.short_conv_metadata_after`) has then opened the layer's context
when checkpoints are planned in this extend. The writes read the start windows from the rows'
working slots before ``cca_extend`` advances them. Plain torch ops on CPU (the conv-window
Triton kernel on CUDA, as for LFM2). Listed in ``docs/sglang-hooks.md``.
"""

from __future__ import annotations

import torch

from sglang_mamba_ext.plugin.inchunk_checkpoints import backend_impl, count_checkpoints

CCA_EXTEND_FN = "sglang.srt.models.zaya.cca_extend"
#: (hook target, kind, function name in this module)
HOOK_TARGETS = [
    (CCA_EXTEND_FN, "BEFORE", "cca_extend_before"),
]


def write_cca_checkpoints(qk: torch.Tensor, hidden_states: torch.Tensor, writes, conv_state: torch.Tensor,
                          prev_hs_state: torch.Tensor, impl: str = "torch") -> None:
    """Store the CCA state after each planned offset of ``writes`` (:class:`~sglang_mamba_ext.
    speculative.ops.inchunk.CheckpointWrites`: rows' first tokens, start slots (``-1``: zeros),
    offsets and destination slots) into ``conv_state [slots, C, P]`` (the last ``P`` rows of
    ``qk [T, C]`` before the offset) and ``prev_hs_state [slots, H, 1]`` (the row of
    ``hidden_states [T, H]`` before it), in the pools' dtypes, as SGLang's ``cca_extend`` would
    have stored them had the row's extend ended there."""
    from sglang_mamba_ext.speculative.ops.inchunk.shortconv import write_conv_window_checkpoints

    write_conv_window_checkpoints(qk.contiguous().unsqueeze(0), writes, conv_state.unsqueeze(0), impl=impl)
    write_conv_window_checkpoints(hidden_states.contiguous().unsqueeze(0), writes, prev_hs_state.unsqueeze(0),
                                  impl=impl)


def cca_extend_before(qk=None, hidden_states=None, conv_qk=None, conv_state=None, prev_hs_state=None,
                      *args, **kwargs) -> None:
    """BEFORE SGLang's ``cca_extend`` (see the module docstring): with an open short-conv context
    for this layer (planned checkpoints), write them and mark the layer's conv as seen; inert
    otherwise (no plan, SGLang's own cache, decode).

    Raises:
        RuntimeError: the state tensors are not the layer's pool tensors, or the extend is
            being captured in a CUDA graph (a planned slot would not be written).
    """
    from sglang_mamba_ext.plugin import inchunk_conv_ssd as ics
    from sglang_mamba_ext.plugin.inchunk_checkpoints import _writes_for

    ctx = ics._current()
    if ctx is None or ctx.kind != "shortconv" or ctx.conv_done:
        return None
    conv = ctx.cache.conv
    if (len(conv) < 2 or not isinstance(conv_state, torch.Tensor) or not isinstance(prev_hs_state, torch.Tensor)
            or not ics._same_view(conv_state, conv[0]) or not ics._same_view(prev_hs_state, conv[1])):
        raise RuntimeError(f"mamba-radix CCA checkpoints: layer {ctx.layer_id}'s cca_extend call is not the one "
                           "expected (conv_state / prev_hs_state: the layer's two pool tensors)")
    ics._check_not_capturing(qk)
    writes = _writes_for(ctx.backend, ctx.forward_batch, ctx.plan)
    count_checkpoints(ctx.backend.req_to_token_pool, ctx.forward_batch,  # once per batch
                      sum(len(v) for v in ctx.plan.values()), 0, 0)
    with torch.no_grad():
        write_cca_checkpoints(qk, hidden_states, writes, conv_state, prev_hs_state, impl=backend_impl(ctx.backend))
    ctx.conv_done = True
    return None
