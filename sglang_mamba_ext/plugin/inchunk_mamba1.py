"""Exact prefix checkpoints for SGLang's Mamba1 classes (issue 40; ``docs/design.md``, "Prefix
checkpoints"): Falcon-Mamba and Mamba (``srt/models/falcon_mamba.py``, ``srt/models/mamba.py``),
whose mixer ``MambaMixer1`` (``srt/layers/attention/mamba/mamba1.py``) rides SGLang's
``Mamba2AttnBackend`` and its state pool with a full-rank layout: per layer a conv window
``conv [slots, D, W-1]`` (the last ``W-1`` raw conv inputs, oldest first) and an SSM state
``temporal [slots, D, 1, N]`` (``D`` = ``intermediate_size``, ``N`` = ``state_size``).

SGLang's Mamba1 prefill (``MambaMixer1._forward_prefill``) runs the causal conv, derives ``dt``,
``B``, ``C`` from the conv output (``x_proj``, Falcon-Mamba's weightless RMSNorm, ``dt_proj``),
then steps the selective scan token by token in float32 and stores only each row's final state,
so without help the plugin's cache keeps states at the prefill chunks' ends only. The recurrence
per token ``t`` of a row (``x_t`` the conv output, ``dt_t = softplus(dt_proj(...))``):

    h_t = exp(dt_t A) * h_{t-1} + (dt_t B_t) x_t        (h [D, N], A = -exp(A_log) [D, N])

A BEFORE hook on ``Mamba2AttnBackend.forward`` (:func:`mamba1_forward_before`), for a backend the
plugin marked ``mamba1`` (:func:`..inchunk_checkpoints.backend_init_after`: a Mamba1 model,
:func:`is_mamba1_model`) and an extend with planned checkpoints
(``MambaRadixReqToTokenPool.prefix_checkpoint_plan``: ``{row: [(offset, slot)]}``), *before*
SGLang's forward advances the rows' working slots:

1. recomputes the mixer's prefill inputs as ``MambaMixer1`` does, with the same modules and
   kernels on the same tensors: ``in_proj``, SGLang's causal-conv function the mixer calls (its
   ``_triton`` name when the layer asks for it) run on a copy of the rows' start windows (the
   pool is not touched), and the mixer's own ``_ssm_params``;
2. writes each planned slot (:func:`write_mamba1_checkpoints`): the conv window after ``offset``
   new tokens (from the row's start window and raw conv inputs) and the SSM state after them,
   stepping the same float32 operations as SGLang's scan from the row's working slot (zeros
   without a prefix), so a checkpoint holds what SGLang would have stored had the prefill ended
   there.

Cost: one more ``in_proj``, conv and ``x_proj`` / ``dt_proj`` per Mamba1 layer of an extend with
planned checkpoints, and a token-by-token scan per planned row up to its deepest checkpoint.
Plain torch ops on any device (no Triton version). Hook target: ``docs/sglang-hooks.md``.
"""

from __future__ import annotations

import importlib
from typing import Optional, Sequence, Tuple

import torch

from sglang_mamba_ext.plugin.inchunk_checkpoints import MAMBA2_BACKEND

#: (hook target, kind, function name in this module)
HOOK_TARGETS = [
    (MAMBA2_BACKEND + ".forward", "BEFORE", "mamba1_forward_before"),
]
#: ``mamba_type`` of SGLang's Mamba1 mixer (``MambaMixer1.mamba_type``).
MAMBA1_TYPE = "mamba1"


def is_mamba1_model(model_runner) -> bool:
    """Whether ``model_runner``'s model is one of SGLang's pure Mamba1 classes
    (``configs/model_config.py::PURE_MAMBA1_ARCHITECTURES``), by ``architectures``."""
    hf = getattr(getattr(model_runner, "model_config", None), "hf_config", None)
    archs = getattr(hf, "architectures", None) or []
    try:
        from sglang.srt.configs.model_config import PURE_MAMBA1_ARCHITECTURES
    except ImportError:  # an SGLang without the list
        PURE_MAMBA1_ARCHITECTURES = ("FalconMambaForCausalLM", "MambaForCausalLM")
    return any(a in PURE_MAMBA1_ARCHITECTURES for a in archs)


def selective_scan_steps(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, h: torch.Tensor,
                         t0: int, t1: int) -> torch.Tensor:
    """Steps ``t0 .. t1-1`` of the Mamba1 recurrence from ``h [D, N]`` (float32); ``x, dt [T, D]``
    (``dt`` after softplus), ``B [T, N]`` float32, ``A [D, N]``. The operations, in order, are
    those of SGLang's ``MambaMixer1._selective_scan`` (so the states are bit-equal to its)."""
    for t in range(t0, t1):
        dt_t = dt[t][:, None]
        dA_t = torch.exp(dt_t * A)
        dBx_t = (dt_t * B[t][None, :]) * x[t][:, None]
        h = dA_t * h + dBx_t
    return h


@torch.no_grad()
def write_mamba1_checkpoints(conv_in: torch.Tensor, conv_out: torch.Tensor, dt: torch.Tensor, B: torch.Tensor,
                             A: torch.Tensor, conv_states: torch.Tensor, ssm_states: torch.Tensor,
                             rows: Sequence[Tuple[int, int, int, Sequence[Tuple[int, int]]]], width: int) -> None:
    """Write Mamba1 checkpoints (conv window and SSM state) into pool slots.

    Args:
        conv_in: ``[T, D]`` the extend's raw conv inputs (``x`` of ``in_proj``), any dtype (cast
            to the conv pool's, as SGLang's prefill casts them before its conv kernel).
        conv_out: ``[T, D]`` the conv output (bias and activation applied).
        dt: ``[T, D]`` the time step before softplus (``dt_proj`` output, its bias included).
        B: ``[T, N]``. A: ``[D, N]`` float32 (``-exp(A_log)``).
        conv_states: ``[slots, D, >= width]`` (first ``width`` columns: the window, oldest
            first); ssm_states: ``[slots, D, 1, N]``; both written in place, in their dtypes.
        rows: ``(start, length, src_slot, [(offset, dst_slot), ...])`` per row: its first token
            and its number of tokens in the packed tensors, the slot holding its start window
            and state (``-1``: zeros) and the checkpoints, the state after ``offset``
            (``1 .. length``) of its tokens going to ``dst_slot``. ``softplus`` runs over the
            row's ``length`` tokens as in SGLang's scan: torch's vectorized kernels may round
            the tail of a tensor differently, so a shorter slice could differ in the last bit.
        width: the conv window, ``conv_kernel - 1``.
    """
    if not rows:
        return
    D, N = A.shape
    for start, length, src, items in rows:
        items = sorted(items)
        deepest = items[-1][0]
        if src >= 0:
            h = ssm_states[src, :, 0, :].float()
            window = conv_states[src, :, :width]
        else:
            h = torch.zeros(D, N, dtype=torch.float32, device=A.device)
            window = torch.zeros(D, width, dtype=conv_states.dtype, device=conv_states.device)
        seq = torch.cat([window, conv_in[start:start + deepest].t().to(conv_states.dtype)], dim=-1)
        end = start + deepest
        x = conv_out[start:end].float()
        dts = torch.nn.functional.softplus(dt[start:start + length].float())
        Bf = B[start:end].float()
        done = 0
        for off, dst in items:
            h = selective_scan_steps(x, dts, A, Bf, h, done, off)
            done = off
            ssm_states[dst, :, 0, :] = h.to(ssm_states.dtype)
            conv_states[dst, :, :width] = seq[:, off:off + width]


def reference_states(conv_out: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     h0: Optional[torch.Tensor], offsets: Sequence[int]):
    """The tests' oracle: transformers' Mamba1 recurrence (``MambaMixer.slow_forward``: the
    discretized ``exp(A dt)`` and ``dt B x`` for all tokens at once, then the scan), the float32
    state ``[D, N]`` after each of ``offsets`` tokens of ``conv_out, dt [n, D]`` (``dt`` before
    softplus), ``B [n, N]`` from ``h0`` (None: zeros)."""
    x = conv_out.float()
    dts = torch.nn.functional.softplus(dt.float())
    dA = torch.exp(A[None] * dts[:, :, None])  # [n, D, N]
    dBx = dts[:, :, None] * B.float()[:, None, :] * x[:, :, None]
    from sglang_mamba_ext.speculative.ops.inchunk.naive import states_at_offsets

    h = torch.zeros(A.shape) if h0 is None else h0.float().clone()
    return states_at_offsets(h, x.shape[0], offsets, lambda t, h: dA[t] * h + dBx[t])


def _mixer_prefill_inputs(backend, mixer, hidden_states, mup_vector, use_triton_causal_conv, conv_states):
    """``(conv_in [T, D], conv_out [T, D], dt, B)`` of the extend's prefill tokens, computed as
    ``MambaMixer1.forward`` / ``_forward_prefill`` compute them (same modules, same conv function
    on the same inputs), with a copy of the rows' start windows as the conv's state."""
    md = backend.forward_metadata
    n_pre, T = int(md.num_prefills), int(md.num_prefill_tokens)
    dim = mixer.intermediate_size_per_tp
    projected, _ = mixer.in_proj(hidden_states)
    if mup_vector is not None:
        projected = projected * mup_vector
    conv_in = projected.split([dim, dim], dim=-1)[0][:T]
    mixed = md.mixed_metadata
    has_initial = mixed.has_initial_states if mixed is not None else None
    qsl = md.query_start_loc[: n_pre + 1]
    seq_lens_cpu = mixed.extend_seq_lens_cpu if mixed is not None else None
    if seq_lens_cpu is None:
        seq_lens_cpu = (qsl[1:] - qsl[:-1]).cpu().tolist()
    use_triton = use_triton_causal_conv
    try:
        from sglang.srt.runtime_context import get_memory

        use_triton = use_triton or get_memory().enable_page_major_kv_layout  # as Mamba2AttnBackend.forward
    except Exception:  # an SGLang without the switch
        pass
    mod = importlib.import_module(type(mixer).__module__)
    conv_fn = mod.causal_conv1d_fn_triton if use_triton else mod.causal_conv1d_fn
    conv_dtype = conv_states.dtype
    w = mixer.conv1d.weight
    weights = w.view(w.size(0), w.size(2))
    scratch = conv_states[md.mamba_cache_indices[:n_pre]].clone()
    conv_out = conv_fn(
        conv_in.transpose(0, 1).to(conv_dtype), weights.to(conv_dtype),
        mixer.conv1d.bias.to(conv_dtype) if mixer.conv1d.bias is not None else None,
        activation=mixer.activation, conv_states=scratch, has_initial_state=has_initial,
        cache_indices=torch.arange(n_pre, dtype=md.mamba_cache_indices.dtype, device=scratch.device),
        query_start_loc=qsl, seq_lens_cpu=seq_lens_cpu,
    ).transpose(0, 1)[:T].to(conv_in.dtype)
    dt, B, _ = mixer._ssm_params(conv_out)
    return conv_in, conv_out, dt, B


def mamba1_forward_before(backend, mixer=None, hidden_states=None, output=None, layer_id=None, forward_batch=None,
                          mup_vector=None, use_triton_causal_conv=False, *args, **kwargs) -> None:
    """BEFORE SGLang's ``Mamba2AttnBackend.forward(mixer, hidden_states, output, layer_id,
    forward_batch, mup_vector, use_triton_causal_conv)``: for a backend marked ``mamba1`` and an
    extend with planned checkpoints, write the layer's checkpoints (see the module docstring);
    SGLang's forward then runs unchanged.

    Raises:
        RuntimeError: a layer of a backend marked ``mamba1`` is not a Mamba1 mixer, or the extend
            is being captured in a CUDA graph (a planned slot would not be written).
    """
    from sglang_mamba_ext.plugin.inchunk_checkpoints import count_checkpoints, extend_rows, plan_of_kind

    plan = plan_of_kind(backend, forward_batch, MAMBA1_TYPE)
    if plan is None:
        return None
    if getattr(mixer, "mamba_type", None) != MAMBA1_TYPE:
        raise RuntimeError(f"mamba-radix Mamba1 checkpoints: layer {layer_id} is not a Mamba1 mixer "
                           f"({type(mixer).__name__}); planned checkpoint slots would not be written")
    if hidden_states.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("mamba-radix Mamba1 checkpoints: extend captured in a CUDA graph")
    count_checkpoints(backend.req_to_token_pool, forward_batch, sum(len(i) for i in plan.values()), 0, 0)
    cache = backend.req_to_token_pool.mamba2_layer_cache(layer_id)
    conv_states, ssm_states = cache.conv[0], cache.temporal
    with torch.no_grad():
        conv_in, conv_out, dt, B = _mixer_prefill_inputs(backend, mixer, hidden_states, mup_vector,
                                                         use_triton_causal_conv, conv_states)
        rows = extend_rows(backend, forward_batch, plan)
        A = -torch.exp(mixer.A_log.float())
        write_mamba1_checkpoints(conv_in, conv_out, dt, B, A, conv_states, ssm_states, rows,
                                 width=int(mixer.conv_kernel_size) - 1)
    return None
