"""Plain-torch CPU version of SGLang 0.5.23's ``fused_recurrent_gated_delta_rule_update``
(``sglang/kernels/ops/attention/fla/fused_recurrent.py:1211``; its Triton kernel
``fused_recurrent_gated_delta_rule_update_fwd_kernel``, ``:881``), the token-by-token gated delta
rule that Jet-Nemotron's JetBlock runs for prefill and decode alike
(``srt/models/jet_nemotron.py:316``; issue 40). Bridged for CPU tensors only by
:mod:`.cpu_bridges_jet_nemotron` (on CPU the Triton kernel otherwise runs under Triton's
interpreter: about 40 s for a 150-token prompt of the tiny checkpoint on the 2-core machine).

Per sequence ``n`` (tokens ``cu_seqlens[n]:cu_seqlens[n+1]``) and value head ``hv`` (query / key
head ``hv // (HV / H)``), state ``h [V, K]`` float32 from ``initial_state_source[idx[n], hv]``
(zeros where ``idx[n] < 0``), per token::

    q, k <- q / sqrt(sum(q^2) + 1e-6), k / ...      (use_qk_l2norm_in_kernel)
    h    <- h * exp(g_t)
    v'   <- (v_t - h @ k) * beta_t
    h    <- h + v' k^T
    o_t  <- h @ (q * scale)

and the final ``h`` stored back to ``initial_state_source[idx[n]]`` in its dtype (unless
``disable_state_update``), as the Triton kernel does.

Call independence (what the Jet writer, :mod:`.inchunk_jet`, relies on): every operation runs on
one sequence's one token at a time, on tensors whose shapes depend only on ``H, HV, K, V``, so a
sequence's states and outputs do not depend on the other sequences of the call nor on where its
tokens sit in the packed tensors (torch's vectorized element-wise kernels round a tensor's tail
elements by a scalar path: a value's position could otherwise change its last bit). Running
the first ``t`` tokens of a sequence alone therefore gives bit for bit the state the whole
sequence's call had after ``t`` tokens. The Triton kernel has the same property (one program
per sequence, head and value block, loading one token at a time).
"""

from __future__ import annotations

from typing import Optional

import torch


def recurrent_supported(q=None, k=None, v=None, g=None, beta=None, scale=None, initial_state_source=None,
                        initial_state_indices=None, cu_seqlens=None, use_qk_l2norm_in_kernel=False,
                        disable_state_update=False, disable_output_calculation=False,
                        intermediate_states_buffer=None, intermediate_state_indices=None, cache_steps=None,
                        retrieve_parent_token=None) -> bool:
    """Whether :func:`fused_recurrent_gated_delta_rule_update` covers the call: no per-step
    state cache (speculative verify), no tree mask, a scalar ``beta`` per head, batch 1 with
    ``cu_seqlens`` or fixed-length batches without."""
    if intermediate_states_buffer is not None or retrieve_parent_token is not None:
        return False
    if beta is not None and v is not None and beta.ndim == v.ndim:
        return False  # head-wise (per value channel) beta: not used by any SGLang 0.5.23 caller on this path
    return q is not None and (cu_seqlens is None or q.shape[0] == 1)


@torch.no_grad()
def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: Optional[torch.Tensor] = None,
    scale: Optional[float] = None, initial_state_source: Optional[torch.Tensor] = None,
    initial_state_indices: Optional[torch.Tensor] = None, cu_seqlens: Optional[torch.Tensor] = None,
    use_qk_l2norm_in_kernel: bool = False, disable_state_update: bool = False,
    disable_output_calculation: bool = False, intermediate_states_buffer=None, intermediate_state_indices=None,
    cache_steps=None, retrieve_parent_token=None,
) -> torch.Tensor:
    """Replaces SGLang's function of the same name for CPU tensors (module docstring). Shapes:
    ``q, k [B, T, H, K]``, ``v [B, T, HV, V]``, ``g, beta [B, T, HV]``; ``initial_state_source``
    ``[slots, HV, V, K]`` (updated in place), ``initial_state_indices [N]``. Returns ``o``
    ``[B, T, HV, V]`` in ``q``'s dtype (``[1, 1, 1, 1]`` with ``disable_output_calculation``, as
    SGLang's)."""
    if not recurrent_supported(q, k, v, g, beta, scale, initial_state_source, initial_state_indices, cu_seqlens,
                               use_qk_l2norm_in_kernel, disable_state_update, disable_output_calculation,
                               intermediate_states_buffer, intermediate_state_indices, cache_steps,
                               retrieve_parent_token):
        raise NotImplementedError("fused_recurrent_gated_delta_rule_update: call not covered by the CPU version")
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if scale is None:
        scale = K ** -0.5
    if beta is None:
        beta = torch.ones_like(q[..., 0])
    if cu_seqlens is not None:
        bounds = [int(x) for x in cu_seqlens.tolist()]
        seqs = [(0, bounds[n], bounds[n + 1]) for n in range(len(bounds) - 1)]
    else:
        seqs = [(b, 0, T) for b in range(B)]
    idx = None if initial_state_source is None else [int(x) for x in initial_state_indices.reshape(-1).tolist()]
    out = None if disable_output_calculation else torch.zeros(B, T, HV, V, dtype=q.dtype, device=q.device)
    heads = torch.arange(HV, device=q.device) // (HV // H)
    for n, (b, bos, eos) in enumerate(seqs):
        slot = -1 if idx is None else idx[n]
        if slot >= 0:
            h = initial_state_source[slot].float().clone()  # [HV, V, K]
        else:
            h = torch.zeros(HV, V, K, dtype=torch.float32, device=q.device)
        for t in range(bos, eos):
            bq = q[b, t].float()[heads]  # [HV, K]
            bk = k[b, t].float()[heads]
            bv = v[b, t].float()  # [HV, V]
            if use_qk_l2norm_in_kernel:
                bq = bq / torch.sqrt((bq * bq).sum(-1, keepdim=True) + 1e-6)
                bk = bk / torch.sqrt((bk * bk).sum(-1, keepdim=True) + 1e-6)
            bq = bq * scale
            h = h * torch.exp(g[b, t].float())[:, None, None]
            bv = bv - (h * bk[:, None, :]).sum(-1)
            bv = bv * beta[b, t].float()[:, None]
            h = h + bv[:, :, None] * bk[:, None, :]
            if out is not None:
                out[b, t] = (h * bq[:, None, :]).sum(-1).to(out.dtype)
        if slot >= 0 and not disable_state_update:
            initial_state_source[slot] = h.to(initial_state_source.dtype)
    if out is None:
        return q.new_empty(1, 1, 1, 1)
    return out
