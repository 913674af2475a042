"""Exact prefix checkpoints with SGLang's lightning attention backend (issue 40; ``docs/design.md``,
"Prefix checkpoints"): Ling 2.5's linear layers (``BailingMoeV2_5ForCausalLM``,
``srt/models/bailing_moe_linear.py``) on ``LightningAttentionBackend``
(``srt/layers/attention/linear/lightning_backend.py``), whose ``seg_la`` prefill kernel keeps a
state only at the end of each extend and, for SGLang's own cache, on its chunk grid
(``_prepare_seg_la_track_store``).

Lightning attention is linear attention with a fixed decay per head (the ALiBi slope ``s`` of the
head and layer, ``backend.tp_slope[layer_id]``) and no conv state:

    S_t = exp(-s) S_{t-1} + k_t^T v_t              (S [K, V] per head, the pool's ``temporal``)

so the state after ``o`` new tokens of a row is fixed by its start state and the row's ``k`` and
``v`` (after the layer's projections, q / k norms and rotary embedding, as SGLang's backend
receives them):

    S_o = exp(-s o) S_0 + sum_{j < o} exp(-s (o - 1 - j)) k_j^T v_j

A BEFORE hook on ``LightningAttentionBackend.forward_extend`` (:func:`forward_extend_before`) writes
each planned checkpoint (``MambaRadixReqToTokenPool.prefix_checkpoint_plan``: ``{row: [(offset,
slot)]}``) from the row's working slot (zeros without a prefix) before SGLang's kernel advances
it: the offsets of a row in order, each stepping from the one before it
(:func:`write_lightning_checkpoints`), so a row costs one pass over its deepest checkpoint's
tokens. Plain torch ops, on any device (no Triton version: the work is a handful of batched
matrix products per checkpoint). The backend is marked a writer by
:func:`..inchunk_checkpoints.backend_init_after` (AFTER its ``__init__``), which makes the pool
plan exact positions.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

LIGHTNING_BACKEND = "sglang.srt.layers.attention.linear.lightning_backend.LightningAttentionBackend"
#: (hook target, kind, function name in this module)
HOOK_TARGETS = [
    (LIGHTNING_BACKEND + ".__init__", "AFTER", "backend_init_after"),
    (LIGHTNING_BACKEND + ".forward_extend", "BEFORE", "forward_extend_before"),
]


def backend_init_after(result, backend, model_runner, *args, **kwargs):
    """AFTER ``LightningAttentionBackend.__init__``: the shared marking
    (:func:`..inchunk_checkpoints.backend_init_after`)."""
    from sglang_mamba_ext.plugin.inchunk_checkpoints import backend_init_after as mark

    return mark(result, backend, model_runner, *args, **kwargs)


@torch.no_grad()
def write_lightning_checkpoints(k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, states: torch.Tensor,
                                rows: Sequence[Tuple[int, int, Sequence[Tuple[int, int]]]]) -> None:
    """Write lightning-attention states into pool rows.

    ``k, v [T, H, D]`` (the extend's packed tokens), ``slope [H]`` (decay per token ``exp(-slope)``),
    ``states [slots, H, D, D]`` (the layer's pool, written in place, in its dtype). ``rows``:
    ``(start, src_slot, [(offset, dst_slot), ...])`` per row: its first token in ``k``, the slot
    holding its start state (``-1``: zeros) and the checkpoints, the state after ``offset`` of its
    tokens going to ``dst_slot``. Computed in float32, each offset from the previous one."""
    if not rows:
        return
    H = k.shape[1]
    slope = slope.reshape(-1).float().to(k.device)
    for start, src, items in rows:
        S = states[src].float() if src >= 0 else torch.zeros(H, k.shape[2], v.shape[2], device=k.device)
        prev = 0
        for off, dst in sorted(items):
            n = off - prev
            if n > 0:
                kr = k[start + prev: start + off].float().transpose(0, 1)  # [H, n, D]
                vr = v[start + prev: start + off].float().transpose(0, 1)
                age = torch.arange(n - 1, -1, -1, dtype=torch.float32, device=k.device)  # o - 1 - j
                w = torch.exp(-slope[:, None] * age[None, :])  # [H, n]
                S = S * torch.exp(-slope * n)[:, None, None] + (kr * w[..., None]).transpose(1, 2) @ vr
            prev = off
            states[dst] = S.to(states.dtype)


def reference_states(k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor, start_state: Optional[torch.Tensor],
                     offsets: Sequence[int]) -> List[torch.Tensor]:
    """The naive recurrence token by token (the tests' oracle): the float32 state after each of
    ``offsets`` tokens of ``k, v [n, H, D]`` from ``start_state [H, D, D]`` (None: zeros)."""
    H, D, Dv = k.shape[1], k.shape[2], v.shape[2]
    S = torch.zeros(H, D, Dv) if start_state is None else start_state.float().clone()
    decay = torch.exp(-slope.reshape(-1).float())[:, None, None]
    from sglang_mamba_ext.speculative.ops.inchunk.naive import states_at_offsets

    return states_at_offsets(S, k.shape[0], offsets,
                             lambda t, S: decay * S + k[t].float()[:, :, None] * v[t].float()[:, None, :])


def forward_extend_before(backend, q, k, v, layer=None, forward_batch=None, *args, **kwargs) -> None:
    """BEFORE SGLang's ``LightningAttentionBackend.forward_extend(q, k, v, layer, forward_batch)``:
    write this layer's planned checkpoints (see the module docstring); SGLang's forward then runs
    unchanged."""
    from sglang_mamba_ext.plugin.inchunk_checkpoints import count_checkpoints, extend_rows, plan_of_kind

    plan = plan_of_kind(backend, forward_batch, "lightning")
    if plan is None:
        return None
    if k.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("mamba-radix lightning checkpoints: extend captured in a CUDA graph")
    layer_id = layer.layer_id if layer is not None else kwargs["layer_id"]
    count_checkpoints(backend.req_to_token_pool, forward_batch, sum(len(i) for i in plan.values()), 0, 0)
    rows = [(start, src, items) for start, _, src, items in extend_rows(backend, forward_batch, plan)]
    states = backend.req_to_token_pool.mamba2_layer_cache(layer_id).temporal
    H = states.shape[1]
    write_lightning_checkpoints(k.reshape(k.shape[0], H, -1), v.reshape(v.shape[0], H, -1),
                                backend.tp_slope[layer_id], states, rows)
    return None
