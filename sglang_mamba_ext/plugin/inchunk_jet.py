"""Exact prefix checkpoints for SGLang's Jet-Nemotron classes (issue 40; ``docs/design.md``, "Prefix
checkpoints"): ``JetNemotronForCausalLM`` (``srt/models/jet_nemotron.py``) and the VLM on it,
``JetVLMForConditionalGeneration`` (``srt/models/jet_vlm.py``).

Their linear layer, the **JetBlock** (``jet_nemotron.py:190-336``), rides SGLang's
``GDNAttnBackend`` (``configs/hybrid_arch.py:55-68``, ``hybrid_gdn_config``) and its state pool
(``JetNemotronConfig.mamba2_cache_params``: a Mamba2-shaped layout, ``conv [slots, 2 H K + H V,
W]`` of which the JetBlock uses the last ``H V`` channels, ``temporal [slots, H, V, K]``), but
calls none of the backend's methods: its ``forward`` reads the backend's ``forward_metadata``
and the pool directly and runs

1. a **dynamic short convolution** of ``v`` (``DynamicShortConvolution``, ``:74-187``): per
   token a kernel of ``W + 1`` taps per channel generated from the layer's input (``w2(silu(w1(x)))``),
   applied to the last ``W + 1`` raw ``v`` values, SiLU; its state is the raw ``v`` of the last
   ``W`` tokens (``conv[slot, -H V:, :]``, oldest first), so a checkpoint's window is the row's
   start window followed by its raw ``v``, cut at the offset;
2. the **gated delta rule** token by token (``fused_recurrent_gated_delta_rule_update``,
   ``:316-326``; ``kernels/ops/attention/fla/fused_recurrent.py:1211``) from the row's working
   slot, storing only the final state.

So SGLang's GDN writer hooks (``forward_extend``, the kernel dispatcher) never fire for these
layers: without this module the plugin planned exact checkpoints that nothing wrote (measured:
a resent 150-token prompt hit 149 cached tokens and answered other tokens than a cold run).

A BEFORE hook on ``JetBlock.forward`` (:func:`jet_block_forward_before`), for a backend the
plugin marked ``jet`` (:func:`is_jet_model`) and an extend with planned checkpoints, *before*
the layer advances the rows' working slots:

1. recomputes the layer's recurrence inputs as ``JetBlock.forward`` does, with the same modules
   on the same tensors (``qkvabz_proj``, the SiLU'd ``q`` / ``k``, the dynamic convolution of the
   whole extend from a copy of the rows' start windows, ``g`` and ``beta``), so the values are
   the layer's bit for bit;
2. per planned ``(row, offset, slot)``: writes the conv window after ``offset`` tokens, copies
   the row's start state (its working slot, which the layer reads too) into the slot and runs
   the recurrence over the row's first ``offset`` tokens there, with the function the layer
   calls (``jet_nemotron.fused_recurrent_gated_delta_rule_update``: SGLang's Triton kernel, or
   on CPU the plugin's torch version, :mod:`.cpu_kernels_jet`), all checkpoints of the batch in
   one call. Both versions are call-independent (each sequence and token on its own), so the
   slot holds what SGLang would have stored had the prefill ended at ``offset``.

Cost: the layer's projections and dynamic convolution once more per Jet layer of an extend with
planned checkpoints, and the recurrence over each checkpoint's prefix. Hook target:
``docs/sglang-hooks.md``.
"""

from __future__ import annotations

import importlib
from typing import Dict, List, Tuple

import torch

#: SGLang's module and layer class.
JET_MODULE = "sglang.srt.models.jet_nemotron"
JET_BLOCK = JET_MODULE + ".JetBlock"
#: (hook target, kind, function name in this module)
HOOK_TARGETS = [
    (JET_BLOCK + ".forward", "BEFORE", "jet_block_forward_before"),
]
#: The plugin's writer name for a backend serving JetBlocks (``WRITER_ATTR``).
JET_TYPE = "jet"
#: ``model_type`` of the configs whose linear layers are JetBlocks (text config, or a VLM's).
JET_MODEL_TYPES = ("jet_nemotron", "jet_vlm")


def is_jet_model(model_runner) -> bool:
    """Whether ``model_runner``'s model is one of SGLang's Jet-Nemotron classes (its config's or
    text config's ``model_type``)."""
    hf = getattr(getattr(model_runner, "model_config", None), "hf_config", None)
    for cfg in (hf, getattr(hf, "text_config", None)):
        if getattr(cfg, "model_type", None) in JET_MODEL_TYPES:
            return True
    return False


def _recurrent_fn():
    """The recurrence the JetBlock calls (its module's binding, after the plugin's CPU bridge)."""
    return getattr(importlib.import_module(JET_MODULE), "fused_recurrent_gated_delta_rule_update")


def layer_inputs(layer, hidden_states: torch.Tensor, forward_batch, start_windows: torch.Tensor):
    """``(q, k, v_raw, v, g, beta)`` of the extend, computed as ``JetBlock.forward`` computes them
    (``jet_nemotron.py:271-314``): ``q, k [T, H, K]`` (SiLU), ``v_raw [T, H V]`` (the conv's
    input), ``v [T, H, V]`` (the dynamic conv's output from ``start_windows [rows, H V, W]``),
    ``g, beta [T, H]``."""
    H, K, V = layer.num_heads, layer.head_k_dim, layer.head_v_dim
    qkvabz, _ = layer.qkvabz_proj(hidden_states)
    q, k, v_raw, a, beta, _z = qkvabz.split(
        [layer.total_k_dim, layer.total_k_dim, layer.total_v_dim, H, H, layer.total_v_dim], dim=-1)
    q = torch.nn.functional.silu(q).reshape(-1, H, K)
    k = torch.nn.functional.silu(k).reshape(-1, H, K)
    seq_lens = forward_batch.extend_seq_lens
    if seq_lens is None:
        seq_lens = torch.ones((forward_batch.batch_size,), dtype=torch.long)
    v, _ = layer.dynamic_conv1d(v_raw, conv_state=start_windows, generator_input=hidden_states, seq_lens=seq_lens)
    v = v.reshape(-1, H, V)
    g = -layer.A_log.float().exp() * torch.nn.functional.softplus(a.float() + layer.dt_bias)
    beta = torch.sigmoid(beta)
    return q, k, v_raw, v, g, beta


@torch.no_grad()
def write_jet_checkpoints(q, k, v_raw, v, g, beta, start_windows, start_slots: List[int], conv: torch.Tensor,
                          temporal: torch.Tensor, rows: List[Tuple[int, int, List[Tuple[int, int]]]],
                          recurrent=None) -> int:
    """Write the planned checkpoints of one JetBlock; returns how many.

    Args:
        q, k, v_raw, v, g, beta: the extend's recurrence inputs (:func:`layer_inputs`).
        start_windows: ``[rows of the batch, H V, W]`` each row's conv window before the extend.
        start_slots: per batch row, the slot holding its start state (its working slot).
        conv: ``[slots, C, W]`` the layer's conv pool (the last ``H V`` channels are the JetBlock's);
            temporal: ``[slots, H, V, K]``; both written in place.
        rows: ``(batch row, first token in the extend, [(offset, dst_slot), ...])``; the state
            after ``offset`` (``1 ..`` the row's length) of the row's tokens goes to ``dst_slot``.
        recurrent: the delta-rule function (default: the one the JetBlock calls).
    """
    if not rows:
        return 0
    recurrent = recurrent or _recurrent_fn()
    Dv, W = start_windows.shape[-2], start_windows.shape[-1]
    token_idx, cu, dsts = [], [0], []
    for r, start, items in rows:
        for off, dst in items:
            seq = torch.cat([start_windows[r].transpose(0, 1), v_raw[start:start + off]])  # as the layer's cat
            conv[dst, -Dv:, :] = seq[off:off + W].transpose(0, 1)
            temporal[dst] = temporal[start_slots[r]]
            token_idx.append(torch.arange(start, start + off))
            cu.append(cu[-1] + off)
            dsts.append(dst)
    sel = torch.cat(token_idx).to(q.device)
    recurrent(
        q=q[sel].unsqueeze(0), k=k[sel].unsqueeze(0), v=v[sel].unsqueeze(0), g=g[sel].unsqueeze(0),
        beta=beta[sel].unsqueeze(0), initial_state_source=temporal,
        initial_state_indices=torch.tensor(dsts, dtype=torch.int32, device=q.device),
        cu_seqlens=torch.tensor(cu, dtype=torch.long, device=q.device), use_qk_l2norm_in_kernel=True,
        disable_output_calculation=True,
    )
    return len(dsts)


def jet_block_forward_before(layer, positions=None, hidden_states=None, forward_batch=None, *args, **kwargs):
    """BEFORE SGLang's ``JetBlock.forward(positions, hidden_states, forward_batch)``: for a backend
    marked ``jet`` and an extend with planned checkpoints, write the layer's checkpoints (module
    docstring); SGLang's forward then runs unchanged.

    Raises:
        RuntimeError: the extend is being captured in a CUDA graph (a planned slot would not be
            written).
    """
    if forward_batch is None:
        return None
    from sglang.srt.model_executor.forward_context import get_attn_backend

    from sglang_mamba_ext.plugin.inchunk_checkpoints import count_checkpoints, plan_of_kind

    backend = getattr(get_attn_backend(), "linear_attn_backend", None)
    plan: Dict[int, List[Tuple[int, int]]] = plan_of_kind(backend, forward_batch, JET_TYPE) if backend else None
    if plan is None:
        return None
    if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("mamba-radix Jet checkpoints: extend captured in a CUDA graph")
    count_checkpoints(backend.req_to_token_pool, forward_batch, sum(len(i) for i in plan.values()), 0, 0)
    md = backend.forward_metadata
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer.layer_id)
    conv, temporal = cache.conv[0], cache.temporal
    with torch.no_grad():
        start_windows = conv[md.mamba_cache_indices, -layer.total_v_dim:, :]  # the layer's read (a copy)
        q, k, v_raw, v, g, beta = layer_inputs(layer, hidden_states, forward_batch, start_windows)
        lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
        starts = [0]
        for n in lens[:-1]:
            starts.append(starts[-1] + n)
        rows = [(r, starts[r], sorted(plan[r])) for r in sorted(plan)]
        write_jet_checkpoints(q, k, v_raw, v, g, beta, start_windows,
                              [int(s) for s in md.mamba_cache_indices.tolist()], conv, temporal, rows)
    return None
