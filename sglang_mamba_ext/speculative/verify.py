"""Tree verify of one linear layer, and the verify-state buffers of both modes (seed §8.3–8.4,
§9.5–9.6).

A verify forward runs every tree node of every request through the target. A linear layer
must give each node the state of its parent (``retrieve_parent_token``; ``-1`` = the request's
main state): for the conv, the ``W-1`` inputs preceding the node *along its path*; for the SSM,
the parent's SSM state.

Where the node states live is the difference between the modes:

- **snapshot** (SGLang today): :class:`SnapshotBuffers` ``[L, R, T, ...]`` — every layer keeps
  every node's state until acceptance, then :func:`commit_snapshot` copies the last accepted
  node's state of every layer into the main state (and the interval-crossing node's into the
  track slot). ``R = max_running_requests + 1`` rows.
- **deferred** (seed §9): the node states of a layer are dead once the layer's outputs exist,
  so one buffer serves all layers. :class:`OneLayerBuffer` ``[R, T, ...]`` (optionally for a
  group of value heads at a time, ``head_chunk``, so ``[R, T, head_chunk, K, V]``), or no
  buffer at all with the on-chip Triton kernel (:mod:`.verify_triton`), which recomputes each
  node's state along its path in registers.

The conv windows of tree nodes are built by gathering along the path (:class:`TreeIndex`) and
then running the mixer's own ``conv``; the recurrence steps every node from its parent with the
mixer math's ``gated_delta_rule_step``. Nodes are processed in index (topological) order.

Pure torch; no SGLang import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape, gated_delta_rule_step
from sglang_mamba_ext.speculative.tree import DraftTree

__all__ = [
    "TreeIndex",
    "SnapshotBuffers",
    "OneLayerBuffer",
    "tree_conv",
    "tree_recurrence",
    "commit_snapshot",
]


@dataclass(frozen=True)
class TreeIndex:
    """Index tables of a :class:`DraftTree` batch for verify kernels.

    Attributes:
        parents: ``[N, T]`` int64 ``retrieve_parent_token``.
        depth: ``[N, T]`` int64 (1 = child of the main state).
        path: ``[N, T, Dmax]`` int64 nodes from the first node after the main state to the
            node itself, ``-1`` padded.
        conv_src: ``[N, T, W-1]`` int64 where each column of the node's *input* window (the
            ``W-1`` inputs before it, oldest first) comes from: ``j >= 0`` node ``j``'s input,
            ``j < 0`` column ``-1 - j`` of the main conv window.
    """

    parents: torch.Tensor
    depth: torch.Tensor
    path: torch.Tensor
    conv_src: torch.Tensor

    @classmethod
    def build(cls, tree: DraftTree, conv_kernel: int) -> "TreeIndex":
        par = tree.retrieve_parent_token
        N, T = par.shape
        depth = tree.depth()
        dmax = int(depth.max()) if T > 0 else 1
        path = torch.full((N, T, dmax), -1, dtype=torch.int64)
        conv_src = torch.empty((N, T, conv_kernel - 1), dtype=torch.int64)
        parl = par.tolist()
        for n in range(N):
            for i in range(T):
                chain = []
                j = i
                while j >= 0:
                    chain.append(j)
                    j = parl[n][j]
                chain.reverse()  # first node after main state .. i
                path[n, i, : len(chain)] = torch.tensor(chain)
                # inputs before node i along its path: chain[:-1], preceded by the main window
                before = chain[:-1]
                for c in range(conv_kernel - 1):
                    back = conv_kernel - 1 - c  # distance back from node i (1 = parent)
                    if back <= len(before):
                        conv_src[n, i, c] = before[len(before) - back]
                    else:
                        # main window column: the (back - len(before))-th last
                        conv_src[n, i, c] = -1 - (conv_kernel - 1 - (back - len(before)))
        return cls(par, depth, path, conv_src)


class SnapshotBuffers:
    """SGLang's per-layer intermediate buffers (``memory_pool.py``: ``intermediate_ssm`` and the
    dense ``intermediate_conv_window``), this project's CPU twin for the reference and the
    planner.

    ``ssm``: ``[L, R, T, HV, K, V]`` (``ssm_dtype``); ``conv``: ``[L, R, T, conv_dim, W-1]``
    (``conv_dtype``). Resident for the server's life.
    """

    def __init__(self, num_layers: int, num_rows: int, draft_token_num: int, shape: LinearAttnShape,
                 ssm_dtype=torch.float32, conv_dtype=torch.float32, device=None) -> None:
        s = shape
        self.ssm = torch.zeros(num_layers, num_rows, draft_token_num, *s.temporal_state_shape, dtype=ssm_dtype, device=device)
        self.conv = torch.zeros(num_layers, num_rows, draft_token_num, *s.conv_state_shape, dtype=conv_dtype, device=device)

    def layer(self, l: int):
        """``(ssm [R, T, HV, K, V], conv [R, T, conv_dim, W-1])`` views of layer ``l``."""
        return self.ssm[l], self.conv[l]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ssm, self.conv))

    @staticmethod
    def bytes_for(num_layers, num_rows, draft_token_num, shape: LinearAttnShape, ssm_bytes: int, conv_bytes: int) -> int:
        s = shape
        per = s.num_v_heads * s.head_k_dim * s.head_v_dim * ssm_bytes + s.conv_dim * (s.conv_kernel - 1) * conv_bytes
        return num_layers * num_rows * draft_token_num * per


class OneLayerBuffer:
    """The deferred mode's reusable verify buffer (seed §9.5): one layer's node states.

    ``ssm``: ``[R, T, head_chunk, K, V]``; ``conv``: ``[R, T, conv_dim, W-1]``. Every linear
    layer overwrites it; ``head_chunk < HV`` makes the recurrence run over value-head groups
    of that size, one group at a time (``HV % head_chunk == 0`` and ``head_chunk`` a multiple
    of ``HV // H``).

    Raises:
        ValueError: ``head_chunk`` does not split the heads evenly.
    """

    def __init__(self, num_rows: int, draft_token_num: int, shape: LinearAttnShape, head_chunk: Optional[int] = None,
                 ssm_dtype=torch.float32, conv_dtype=torch.float32, device=None) -> None:
        s = shape
        hc = s.num_v_heads if head_chunk is None else int(head_chunk)
        G = s.num_v_heads // s.num_k_heads
        if hc <= 0 or s.num_v_heads % hc != 0 or hc % G != 0:
            raise ValueError(
                f"OneLayerBuffer: head_chunk={hc} must divide HV={s.num_v_heads} and be a multiple of HV/H={G}"
            )
        self.head_chunk = hc
        self.ssm = torch.zeros(num_rows, draft_token_num, hc, s.head_k_dim, s.head_v_dim, dtype=ssm_dtype, device=device)
        self.conv = torch.zeros(num_rows, draft_token_num, *s.conv_state_shape, dtype=conv_dtype, device=device)

    def layer(self, l: int):
        """The same tensors for every layer (the point of the mode)."""
        return self.ssm, self.conv

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ssm, self.conv))

    @staticmethod
    def bytes_for(num_rows, draft_token_num, shape: LinearAttnShape, ssm_bytes: int, conv_bytes: int, head_chunk=None) -> int:
        s = shape
        hc = s.num_v_heads if head_chunk is None else head_chunk
        per = hc * s.head_k_dim * s.head_v_dim * ssm_bytes + s.conv_dim * (s.conv_kernel - 1) * conv_bytes
        return num_rows * draft_token_num * per


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
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    index: TreeIndex,
    node_states: torch.Tensor,
    rows: torch.Tensor,
    head_chunk: Optional[int] = None,
) -> torch.Tensor:
    """Gated delta rule over tree nodes, each stepping from its parent's state (seed §9.6).

    Args:
        q, k: ``[N, T, H, K]``; v: ``[N, T, HV, V]``; g: ``[N, T, HV, K]`` fp32; beta
            ``[N, T, HV]`` fp32.
        state: ``[N, HV, K, V]`` main SSM states (read only).
        node_states: node-state buffer ``[R, T, HC, K, V]`` (``HC = head_chunk or HV``); row
            ``rows[n]`` receives request ``n``'s node states (snapshot: a layer of
            :class:`SnapshotBuffers`; deferred: the :class:`OneLayerBuffer`).
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
    scale = mixer.shape.head_k_dim ** -0.5
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


def commit_snapshot(
    snap: SnapshotBuffers,
    rows: torch.Tensor,
    slots: torch.Tensor,
    last_node: torch.Tensor,
    conv_state: torch.Tensor,
    temporal_state: torch.Tensor,
    track_slots: Optional[torch.Tensor] = None,
    track_node: Optional[torch.Tensor] = None,
) -> None:
    """Snapshot-mode commit (SGLang ``update_mamba_state_after_mtp_verify``): for every layer,
    ``main[slot] = buffer[row, last_node]``; and ``main[track_slot] = buffer[row, track_node]``
    where ``track_node >= 0`` (the accepted node at which the sequence reaches a multiple of
    ``mamba_track_interval``).

    Args:
        rows, slots, last_node: ``[N]`` int64.
        conv_state ``[L, slots, conv_dim, W-1]``, temporal_state ``[L, slots, HV, K, V]``.
        track_slots, track_node: ``[N]`` int64 or None.
    """
    temporal_state[:, slots] = snap.ssm[:, rows, last_node].to(temporal_state.dtype)
    conv_state[:, slots] = snap.conv[:, rows, last_node].to(conv_state.dtype)
    if track_slots is not None and track_node is not None:
        m = (track_node >= 0) & (track_slots >= 0)
        if bool(m.any()):
            temporal_state[:, track_slots[m]] = snap.ssm[:, rows[m], track_node[m]].to(temporal_state.dtype)
            conv_state[:, track_slots[m]] = snap.conv[:, rows[m], track_node[m]].to(conv_state.dtype)
