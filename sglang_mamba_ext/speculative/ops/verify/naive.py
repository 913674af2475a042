"""Torch reference of the tree verify of one linear layer (``docs/design.md``, "Speculative
verify"): every tree node must see its parent's state (``retrieve_parent_token``; ``-1`` = the
request's main state). :func:`tree_conv` gathers each node's conv window along its path
(:class:`~sglang_mamba_ext.speculative.tree.TreeIndex`) and runs the mixer's own ``conv``;
:func:`tree_recurrence` steps every node from its parent's SSM state with
``gated_delta_rule_step`` (``models/linear_attn.py``), in index (topological) order, writing
the node states into a buffer of ``verify_buffers.py``. The Triton kernel of :mod:`.fused`
computes the same recurrence. Pure torch.
"""

from __future__ import annotations

from typing import Optional

import torch

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, gated_delta_rule_step
from sglang_mamba_ext.speculative.tree import TreeIndex

__all__ = ["tree_conv", "tree_recurrence"]


def tree_conv(
    mixer: GatedDeltaRuleMixer,
    mixed_qkv: torch.Tensor,
    conv_state: torch.Tensor,
    index: TreeIndex,
):
    """Causal conv + SiLU of every tree node, each continuing its own path's window.

    Args:
        mixed_qkv: ``[N, T, conv_dim]`` pre-conv activations of the nodes.
        conv_state: ``[N, conv_dim, W-1]`` main conv windows of the requests.
        index: the batch's :class:`TreeIndex`.

    Returns:
        ``(y [N, T, conv_dim], windows [N, T, conv_dim, W-1])``: post-conv activations and each
        node's window *after* it (what SGLang's ``intermediate_conv_window`` stores).
    """
    N, T, D = mixed_qkv.shape
    Wm1 = conv_state.shape[-1]
    # [N, W-1 + T, D]: main window columns then node inputs, in the conv state's dtype (what
    # a sequential decode would have stored in the window before reading it back).
    ext = torch.cat([conv_state.transpose(-1, -2), mixed_qkv.to(conv_state.dtype)], dim=1)
    src = torch.where(index.conv_src >= 0, index.conv_src + Wm1, -1 - index.conv_src)  # [N, T, W-1]
    win = torch.gather(ext, 1, src.reshape(N, T * Wm1, 1).expand(N, T * Wm1, D)).view(N, T, Wm1, D)
    y, windows = mixer.conv(mixed_qkv[:, :, None, :], win.transpose(-1, -2))
    return y[:, :, 0], windows


def tree_recurrence(
    mixer: GatedDeltaRuleMixer,
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
    index: TreeIndex,
    node_states: torch.Tensor,
    rows: torch.Tensor,
    head_chunk: Optional[int] = None,
) -> torch.Tensor:
    """Gated delta rule over tree nodes, each stepping from its parent's state.

    Args:
        q, k: ``[N, T, H, K]``; v: ``[N, T, HV, V]``; g: ``[N, T, HV, K]`` fp32; beta
            ``[N, T, HV]`` fp32.
        state: ``[N, HV, K, V]`` main SSM states (read only).
        node_states: node-state buffer ``[R, T, HC, K, V]`` (``HC = head_chunk or HV``); row
            ``rows[n]`` receives request ``n``'s node states (snapshot: a layer of
            ``SnapshotBuffers``; deferred: the ``OneLayerBuffer``).
        rows: ``[N]`` int64 buffer rows.
        head_chunk: value heads per pass (None = all).

    Returns:
        ``o [N, T, HV, V]`` float32.
    """
    N, T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    G = HV // H
    hc = HV if head_chunk is None else head_chunk
    if node_states.shape[2] != hc:
        raise ValueError(f"tree_recurrence: buffer holds {node_states.shape[2]} heads, head_chunk is {hc}")
    scale = mixer.scale
    o = torch.empty(N, T, HV, V, dtype=torch.float32, device=q.device)
    for h0 in range(0, HV, hc):
        hs = slice(h0, h0 + hc)
        ks = slice(h0 // G, (h0 + hc) // G)
        for i in range(T):
            par = index.parents[:, i]
            from_main = (par < 0)[:, None, None, None]
            S_par = torch.where(from_main, state[:, hs].float(), node_states[rows, par.clamp(min=0)].float())
            o_i, S_i = gated_delta_rule_step(q[:, i, ks], k[:, i, ks], v[:, i, hs], g[:, i, hs], beta[:, i, hs], S_par, scale)
            o[:, i, hs] = o_i
            node_states[rows, i] = S_i.to(node_states.dtype)
    return o
