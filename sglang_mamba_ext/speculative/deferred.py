"""Deferred-update verify state of one Mamba pool, independent of SGLang objects
(``docs/design.md``, "Deferred update" and "Replay"). :class:`StateLayout` says how a backend
keeps its states and gates (the backend-neutral interface; :data:`LAYOUTS` holds SGLang's KDA
and GDN backends and the tiny one). :class:`DeferredSpecState` owns what the
deferred mode keeps next to a pool's main conv/SSM state and is driven by four calls in round
order: :meth:`~DeferredSpecState.capture` (during verify, per linear layer, every tree node's
raw mixer inputs into the pending workspace ``[L, rows * T, *]``), ``commit`` (after
acceptance, the accepted nodes' records into the stash with counts, pre-verify ``seq_lens``
and track slot; device ops only, no host sync), ``replay`` (at the start of the next round or
to flush a request before its state is cached: the Triton kernels of ``ops/replay/fused.py``;
rows with nothing pending are no-ops) and ``clear`` (rows released without their state).
Verify uses the one-layer conv-window buffer ``one_layer_conv`` and, in the ``one_layer``
variant, the node-state buffer ``one_layer_ssm``, handed to the verify kernels as ``[L, ...]``
views with layer stride 0; in the ``on_chip`` variant (``verify_onchip.py``: chosen where the
shapes fit on chip) there is no node-state buffer. Pure torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Dict, Optional, Sequence, Tuple

import torch

from sglang_mamba_ext.models.linear_attn import LinearAttnShape
from sglang_mamba_ext.speculative.replay import ReplayWeights, replay
from sglang_mamba_ext.speculative.stash import ActivationStash, StashDims

if TYPE_CHECKING:
    from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import Mamba2Weights

__all__ = ["DeferredSpecState", "StateLayout", "LAYOUTS"]


@dataclass(frozen=True)
class StateLayout:
    """What the deferred mode needs to know about one linear-attention backend: the
    backend-neutral interface of ``docs/design.md``, "Deferred update". Every supported
    backend hands its verify the same raw inputs (``mixed_qkv [n, conv_dim]``, raw decay gate
    ``a``, raw ``b``) and keeps one slot's states in its own layout; replay runs one kernel
    on views of them.

    Attributes:
        name: the backend (``"kda"``: SGLang's ``KDAAttnBackend``; ``"gdn"``: its
            ``GDNAttnBackend``; ``"tiny-kda"`` / ``"tiny-gdn"``: this project's torch backend).
        per_head_gate: raw gate ``[n, HV]`` (Gated DeltaNet) instead of ``[n, HV*K]`` (KDA).
        conv_window_first: the pool stores a conv window as ``[W-1, conv_dim]`` (SGLang KDA)
            rather than ``[conv_dim, W-1]`` (SGLang GDN / Mamba2, tiny).
        ssm_vk: the pool stores an SSM state as ``[HV, V, K]`` (SGLang's KDA and GDN kernels,
            and the tiny model's pool) rather than ``[HV, K, V]`` (fla's layout).
        verify_rolls_conv: the backend's verify conv kernel shifts the *main* conv window by
            all draft tokens in place (SGLang's ``causal_conv1d_update`` with intermediate
            windows); the deferred glue saves and restores the batch's windows around it.
        mamba2: the layers are Mamba2 mixers (SGLang's ``MambaMixer2``): the stash holds raw
            ``xBC`` (as ``mixed_qkv``) and raw ``dt`` (as the per-head gate), no ``b``; the
            :class:`LinearAttnShape` reads ``G`` groups as key heads, ``N`` (d_state) as ``K``
            and ``P`` (head_dim) as ``V``; the pool's ``[HV, P, N]`` state is the replay
            layout itself (:mod:`.ops.replay.mamba2`).
    """

    name: str
    per_head_gate: bool
    conv_window_first: bool
    ssm_vk: bool
    verify_rolls_conv: bool
    mamba2: bool = False

    def gate_dim(self, shape: LinearAttnShape) -> int:
        """Raw gate width per token (elements)."""
        return shape.num_v_heads if self.per_head_gate else shape.num_v_heads * shape.head_k_dim

    def replay_views(self, conv: torch.Tensor, temporal: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """The pool's ``conv [L, slots, *conv]`` and ``temporal [L, slots, *ssm]`` seen in the
        replay layout ``[L, slots, conv_dim, W-1]`` / ``[L, slots, HV, K, V]`` (views)."""
        return (conv.transpose(-1, -2) if self.conv_window_first else conv,
                temporal.transpose(-1, -2) if self.ssm_vk else temporal)


#: The backends the deferred mode serves, by name.
LAYOUTS: Dict[str, StateLayout] = {
    "kda": StateLayout("kda", per_head_gate=False, conv_window_first=True, ssm_vk=True, verify_rolls_conv=True),
    "gdn": StateLayout("gdn", per_head_gate=True, conv_window_first=False, ssm_vk=True, verify_rolls_conv=True),
    "tiny-kda": StateLayout("tiny-kda", per_head_gate=False, conv_window_first=False, ssm_vk=True,
                            verify_rolls_conv=False),
    "tiny-gdn": StateLayout("tiny-gdn", per_head_gate=True, conv_window_first=False, ssm_vk=True,
                            verify_rolls_conv=False),
    "mamba2": StateLayout("mamba2", per_head_gate=True, conv_window_first=False, ssm_vk=False,
                          verify_rolls_conv=True, mamba2=True),
}


class DeferredSpecState:
    """Stash, pending workspace, one-layer verify buffers and replay weights of one pool.

    Args:
        num_layers: ``L`` linear layers of the pool.
        num_rows: request rows (``max_running_requests + 1``, SGLang's ``spec_state_size + 1``).
        draft_token_num: ``T``.
        max_accept: ``speculative_num_steps + 1``.
        shape: head layout of the linear layers.
        dims: stash record widths.
        ssm_state_shape / conv_state_shape: one slot's SSM state and conv window as the pool
            stores them (e.g. SGLang KDA: ``(HV, V, K)`` and ``(W-1, conv_dim)``).
        ssm_dtype / conv_dtype / act_dtype: dtypes of the node-state buffer, the conv-window
            buffer and the stash / workspace.
        device: torch device.
        layout: the backend's :class:`StateLayout` (default: SGLang's KDA backend).
        verify: ``"one_layer"`` (node states in ``one_layer_ssm``) or ``"on_chip"`` (no
            node-state buffer: ``one_layer_ssm`` is None, :meth:`layered_views` hands out a
            one-element placeholder; :mod:`.verify_onchip`).

    Raises:
        ValueError: ``dims.gate_dim`` disagrees with the layout's gate, or an unknown ``verify``.
    """

    def __init__(self, num_layers: int, num_rows: int, draft_token_num: int, max_accept: int,
                 shape: LinearAttnShape, dims: StashDims, ssm_state_shape: Tuple[int, ...],
                 conv_state_shape: Tuple[int, ...], ssm_dtype: torch.dtype, conv_dtype: torch.dtype,
                 act_dtype: torch.dtype, device, layout: StateLayout = LAYOUTS["kda"],
                 verify: str = "one_layer") -> None:
        if verify not in ("one_layer", "on_chip"):
            raise ValueError(f"DeferredSpecState: verify must be 'one_layer' or 'on_chip', got {verify!r}")
        if dims.gate_dim != layout.gate_dim(shape):
            raise ValueError(f"DeferredSpecState: gate width {dims.gate_dim} != {layout.gate_dim(shape)} of {layout.name}")
        self.num_layers, self.num_rows, self.draft_token_num = num_layers, num_rows, draft_token_num
        self.shape, self.dims, self.layout, self.verify = shape, dims, layout, verify
        self.max_depth = max_accept  # tree depth bound (steps + 1), the on-chip path tables' width
        L, R, T = num_layers, num_rows, draft_token_num
        self.stash = ActivationStash(L, R, max_accept, dims, dtype=act_dtype, device=device)
        self.pending_mixed_qkv = torch.zeros(L, R * T, dims.conv_dim, dtype=act_dtype, device=device)
        self.pending_g_raw = torch.zeros(L, R * T, dims.gate_dim, dtype=act_dtype, device=device)
        self.pending_b_raw = torch.zeros(L, R * T, max(dims.beta_dim, 1), dtype=act_dtype, device=device)
        self.ssm_state_shape = tuple(ssm_state_shape)
        self.one_layer_ssm: Optional[torch.Tensor] = None
        if verify == "one_layer":
            self.one_layer_ssm = torch.zeros(R, T, *ssm_state_shape, dtype=ssm_dtype, device=device)
        else:  # one element seen as [R, T, *ssm] (stride 0): SGLang's verify paths read the shape only
            self._ssm_placeholder = torch.zeros(1, dtype=ssm_dtype, device=device).as_strided(
                (R, T, *ssm_state_shape), (0,) * (2 + len(ssm_state_shape)))
        self.one_layer_conv = torch.zeros(R, T, *conv_state_shape, dtype=conv_dtype, device=device)
        self.mamba_track_interval: Optional[int] = None
        self._layer_weights: Dict[int, Tuple] = {}
        self._weights: Optional[ReplayWeights] = None

    # -- verify buffers ---------------------------------------------------------------------

    @property
    def on_chip(self) -> bool:
        """Verify keeps the node states on chip (no node-state buffer)."""
        return self.verify == "on_chip"

    def layered_views(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(ssm [L, R, T, *ssm], conv [L, R, T, *conv])``: the one-layer buffers seen as
        ``L`` layers (stride 0 on the layer dim; no extra memory). On chip, ``ssm`` is a view of
        one element (every stride 0): no verify kernel may write it."""
        L = self.num_layers
        ssm = self.one_layer_ssm if self.one_layer_ssm is not None else self._ssm_placeholder
        return (ssm.unsqueeze(0).expand(L, *ssm.shape),
                self.one_layer_conv.unsqueeze(0).expand(L, *self.one_layer_conv.shape))

    def nbytes(self) -> Dict[str, int]:
        """Bytes per component: ``stash`` (resident across rounds) and the verify workspace."""
        nb = lambda *ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {
            "stash": self.stash.nbytes(),
            "pending": nb(self.pending_mixed_qkv, self.pending_g_raw, self.pending_b_raw),
            "one_layer_ssm": 0 if self.one_layer_ssm is None else nb(self.one_layer_ssm),
            "one_layer_conv": nb(self.one_layer_conv),
        }

    # -- weights ----------------------------------------------------------------------------

    def register_layer(self, linear_idx: int, conv_weight: torch.Tensor, conv_bias: Optional[torch.Tensor],
                       A_log: torch.Tensor, dt_bias: torch.Tensor) -> None:
        """Remember linear layer ``linear_idx``'s replay weights (``conv_weight [conv_dim, W]``
        or any shape with ``conv_dim * W`` elements, ``A_log [HV]``, ``dt_bias [gate_dim]``;
        Mamba2: ``A [HV]`` itself, ``-exp(A_log)``, in place of ``A_log``). Idempotent."""
        if linear_idx not in self._layer_weights:
            self._layer_weights[linear_idx] = (conv_weight, conv_bias, A_log, dt_bias)
            self._weights = None

    def weights(self) -> "ReplayWeights | Mamba2Weights":
        """Stacked replay weights of all layers (:class:`Mamba2Weights` for a Mamba2 layout).

        Raises:
            RuntimeError: some layer was never registered (no verify ran through it yet).
        """
        if self._weights is None:
            missing = [l for l in range(self.num_layers) if l not in self._layer_weights]
            if missing:
                raise RuntimeError(f"DeferredSpecState: replay weights of linear layers {missing} not registered")
            ws = [self._layer_weights[l] for l in range(self.num_layers)]
            cw = torch.stack([w[0].detach().reshape(w[0].shape[0], -1) for w in ws]).contiguous()
            cb = None if ws[0][1] is None else torch.stack([w[1].detach() for w in ws]).contiguous()
            A = torch.stack([w[2].detach().reshape(-1) for w in ws]).float().contiguous()
            dtb = torch.stack([w[3].detach().reshape(-1) for w in ws]).float().contiguous()
            if self.layout.mamba2:
                from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import Mamba2Weights

                sh = self.shape
                self._weights = Mamba2Weights(cw, cb, A, dtb, n_groups=sh.num_k_heads, head_dim=sh.head_v_dim,
                                              d_state=sh.head_k_dim)
            else:
                self._weights = ReplayWeights(self.shape, cw, cb, A, dtb, per_head_gate=self.layout.per_head_gate)
        return self._weights

    # -- round calls --------------------------------------------------------------------------

    def capture(self, linear_idx: int, mixed_qkv: torch.Tensor, g_raw: torch.Tensor,
                b_raw: Optional[torch.Tensor]) -> None:
        """Copy one layer's verify inputs (``[n_tokens, width]`` each, flat verify order;
        ``b_raw`` None for Mamba2, which has none)."""
        n = mixed_qkv.shape[0]
        self.pending_mixed_qkv[linear_idx, :n].copy_(mixed_qkv)
        self.pending_g_raw[linear_idx, :n].copy_(g_raw.reshape(n, -1))
        if b_raw is not None:
            self.pending_b_raw[linear_idx, :n].copy_(b_raw.reshape(n, -1))

    def commit(self, rows: torch.Tensor, accept_index: torch.Tensor, accept_lens: torch.Tensor,
               seq_lens: torch.Tensor, track_slots: Optional[torch.Tensor] = None,
               mamba_track_interval: Optional[int] = None) -> None:
        """Stash the accepted nodes of every layer (see the module docstring).

        Args:
            rows: ``[bs]`` request rows (``req_pool_indices``).
            accept_index: ``[bs, A']`` flat indices of accepted nodes in the verify batch
                (``-1`` padding), ``A' <= max_accept``.
            accept_lens: ``[bs]`` committed tokens (accepted drafts + 1).
            seq_lens: ``[bs]`` sequence lengths before this round's tokens.
            track_slots: ``[bs]`` ping-pong slot for a crossing, or None.
        """
        st = self.stash
        Ap = accept_index.shape[1]
        idx = accept_index.clamp(min=0).to(torch.int64)
        st.mixed_qkv[:, rows, :Ap] = self.pending_mixed_qkv[:, idx]
        st.g_raw[:, rows, :Ap] = self.pending_g_raw[:, idx]
        st.b_raw[:, rows, :Ap] = self.pending_b_raw[:, idx]
        st.count[rows] = accept_lens.to(torch.int32)
        st.seq_len[rows] = seq_lens.to(torch.int64)
        st.track_slot[rows] = -1 if track_slots is None else track_slots.to(torch.int64)
        if mamba_track_interval is not None:
            self.mamba_track_interval = int(mamba_track_interval)

    def replay(self, rows: torch.Tensor, slots: torch.Tensor, conv_state: torch.Tensor, temporal_state: torch.Tensor,
               keep: Optional[torch.Tensor] = None, impl: str = "triton") -> torch.Tensor:
        """Replay pending rows into the pool (views ``[L, slots, conv_dim, W-1]`` and
        ``[L, slots, HV, K, V]``); returns ``[bs]`` bool: checkpoint written. Before the first
        verify (no layer captured yet) nothing can be pending: a no-op."""
        if not self._layer_weights:
            return torch.zeros(rows.shape, dtype=torch.bool, device=rows.device)
        return replay(self.stash, rows, slots, conv_state, temporal_state, self.weights(),
                      self.mamba_track_interval, keep=keep, impl=impl)

    def replay_pool(self, rows: torch.Tensor, slots: torch.Tensor, conv_pool: torch.Tensor, temporal_pool: torch.Tensor,
                    keep: Optional[torch.Tensor] = None, impl: str = "triton") -> torch.Tensor:
        """:meth:`replay` on the backend's own pool tensors (``conv [L, slots, *conv]``,
        ``temporal [L, slots, *ssm]`` in the layout's order)."""
        conv, temporal = self.layout.replay_views(conv_pool, temporal_pool)
        return self.replay(rows, slots, conv, temporal, keep=keep, impl=impl)

    def clear(self, rows: Sequence[int] | torch.Tensor) -> None:
        rows = torch.as_tensor(rows, dtype=torch.int64, device=self.stash.count.device)
        self.stash.clear(rows)
