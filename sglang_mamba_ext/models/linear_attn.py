"""Gated-delta-rule linear attention with a short causal conv (KDA style), in plain torch.

The project's one implementation of the linear-attention layer math (``docs/design.md``,
"Tiny hybrid model"): :meth:`GatedDeltaRuleMixer.run_segments` runs conv -> split ->
recurrence over a sequence cut into segments, stopping at each cut to hand the states to the
caller (a checkpoint). The reference model (``tiny_hybrid.py``), the tiny SGLang backend
(``plugin/tiny_hybrid/backend.py``), the torch replay (``speculative/ops/replay/naive.py``)
and through them the reference decode loop all call it, so "cached == uncached", "chunked ==
unchunked" and "deferred == snapshot" compare one piece of math with itself under different
state handling. Torch only (never sglang, never fla at import).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GATES",
    "CutCallback",
    "LinearAttnShape",
    "causal_conv1d_update",
    "gated_delta_rule",
    "gated_delta_rule_step",
    "l2_normalize",
    "rms_norm",
    "GatedDeltaRuleMixer",
]

#: ``on_cut(offset, conv_state, temporal_state)``: the states after the first ``offset`` tokens
#: of a :meth:`GatedDeltaRuleMixer.run_segments` call (``None, None`` for a fresh sequence cut
#: at offset 0). The tensors are the runner's own; copy them to keep them past the call.
CutCallback = Callable[[int, Optional[torch.Tensor], Optional[torch.Tensor]], None]


#: Decay-gate kinds of :class:`GatedDeltaRuleMixer`: ``"kda"`` (Kimi Delta Attention, one decay
#: per key channel) and ``"gdn"`` (Gated DeltaNet, Qwen3-Next: one decay per value head).
GATES = ("kda", "gdn")


@dataclass(frozen=True)
class LinearAttnShape:
    """Head layout of one gated-delta-rule layer.

    Attributes:
        num_k_heads: ``H``, query/key heads.
        num_v_heads: ``HV``, value heads (and SSM state heads); a multiple of ``H``.
        head_k_dim: ``K``, query/key head size (rows of the SSM state).
        head_v_dim: ``V``, value head size (columns of the SSM state).
        conv_kernel: ``W``, causal conv window in tokens (the conv state keeps ``W-1``).

    Raises:
        ValueError: a size is not positive, or ``HV`` is not a multiple of ``H``.
    """

    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "head_k_dim", "head_v_dim", "conv_kernel"):
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"LinearAttnShape.{name} must be positive, got {getattr(self, name)}")
        if self.conv_kernel < 2:
            raise ValueError(f"LinearAttnShape.conv_kernel must be >= 2, got {self.conv_kernel}")
        if self.num_v_heads % self.num_k_heads != 0:
            raise ValueError(
                f"num_v_heads ({self.num_v_heads}) must be a multiple of num_k_heads "
                f"({self.num_k_heads}) for grouped value attention"
            )

    @property
    def key_dim(self) -> int:
        """``H * K``: width of the q block (and of the k block) of ``mixed_qkv``."""
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        """``HV * V``: width of the v block of ``mixed_qkv`` and of the mixer output."""
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """``2*H*K + HV*V``: channels of ``mixed_qkv`` = ``cat([q, k, v])``."""
        return 2 * self.key_dim + self.value_dim

    @property
    def conv_state_shape(self) -> Tuple[int, int]:
        """``(conv_dim, W-1)``: one request's conv state."""
        return (self.conv_dim, self.conv_kernel - 1)

    @property
    def temporal_state_shape(self) -> Tuple[int, int, int]:
        """``(HV, K, V)``: one request's SSM state (float32)."""
        return (self.num_v_heads, self.head_k_dim, self.head_v_dim)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: Optional[torch.Tensor],
    weight: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over new tokens, continuing from a conv window, then SiLU.

    ``y[t, c] = SiLU(bias[c] + sum_j weight[c, j] * u[t + j, c])`` where ``u`` is the
    window followed by ``x`` (so ``weight[:, -1]`` multiplies the current token), as in
    SGLang's ``causal_conv1d_update`` / ``causal_conv1d_fn`` (``kernels/ops/mamba``).
    Pure function: ``conv_state`` is not modified.

    Args:
        x: ``[..., T, D]`` new pre-conv activations (``D = conv_dim``), any float dtype.
            Leading batch dims, if any, must match ``conv_state``'s.
        conv_state: ``[..., D, W-1]`` the previous ``W-1`` inputs, oldest first; ``None``
            means a fresh sequence (zeros).
        weight: ``[D, W]`` conv taps (a ``[D, 1, W]`` nn.Conv1d weight is accepted too).
        bias: optional ``[D]``.

    Returns:
        ``(y, new_conv_state)``: ``y`` ``[..., T, D]`` in ``x.dtype``; ``new_conv_state``
        ``[..., D, W-1]`` (the last ``W-1`` inputs of window + x) in ``conv_state.dtype``
        (``x.dtype`` when ``conv_state`` is None). ``T == 0`` returns the state unchanged.

    Raises:
        ValueError: shapes disagree.
    """
    if weight.dim() == 3:
        weight = weight.reshape(weight.shape[0], weight.shape[-1])
    D, W = weight.shape
    if x.shape[-1] != D:
        raise ValueError(f"causal_conv1d_update: x has {x.shape[-1]} channels, weight has {D}")
    T = x.shape[-2]
    state_dtype = conv_state.dtype if conv_state is not None else x.dtype
    if conv_state is None:
        conv_state = x.new_zeros(*x.shape[:-2], D, W - 1)
    if tuple(conv_state.shape[-2:]) != (D, W - 1):
        raise ValueError(
            f"causal_conv1d_update: conv_state shape {tuple(conv_state.shape)} != "
            f"[..., {D}, {W - 1}] (conv_dim, conv_kernel-1)"
        )
    u = torch.cat([conv_state.float(), x.float().transpose(-1, -2)], dim=-1)  # [..., D, W-1+T]
    w = weight.float()
    acc = u[..., :, 0:T] * w[:, 0:1]
    for j in range(1, W):
        acc = acc + u[..., :, j : j + T] * w[:, j : j + 1]
    if bias is not None:
        acc = acc + bias.float()[:, None]
    y = F.silu(acc).transpose(-1, -2).to(x.dtype)
    new_state = u[..., :, u.shape[-1] - (W - 1) :].to(state_dtype)
    return y, new_state


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (fla's ``l2norm`` convention)."""
    xf = x.float()
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps)).to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim: ``x / sqrt(mean(x^2) + eps) * weight``, computed in fp32,
    returned in ``x.dtype``."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for any number of independent states.

    Same recurrence as :func:`gated_delta_rule` for one time step, batched over leading
    dims ``...`` (e.g. the nodes of a draft tree, each stepping from its parent's state).

    Args:
        q, k: ``[..., H, K]``; v: ``[..., HV, V]``; g: ``[..., HV, K]`` (or ``[..., HV]``
            for a per-head scalar gate) log-space decay, <= 0; beta: ``[..., HV]``;
        state: ``[..., HV, K, V]`` float32 (not modified).
        scale: query scale, default ``K ** -0.5``.

    Returns:
        ``(o [..., HV, V] float32, new_state [..., HV, K, V] float32)``.
    """
    HV, K = state.shape[-3], state.shape[-2]
    H = q.shape[-2]
    G = HV // H
    if scale is None:
        scale = K**-0.5
    qf = q.float().repeat_interleave(G, dim=-2) * scale  # [..., HV, K]
    kf = k.float().repeat_interleave(G, dim=-2)
    gf = g.float()
    if gf.dim() == kf.dim() - 1:  # scalar per-head gate (GDN)
        gf = gf[..., None].expand_as(kf)
    S = state.float() * gf.exp()[..., None]
    pred = (kf[..., None] * S).sum(-2)  # S^T k: [..., HV, V]
    delta = (v.float() - pred) * beta.float()[..., None]
    S = S + kf[..., None] * delta[..., None, :]
    o = (qf[..., None] * S).sum(-2)
    return o, S


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over ``T`` tokens of one sequence, from a given SSM state.

    For each token ``t`` and value head ``h`` (``S``: ``[K, V]``)::

        S <- S * exp(g_t)[:, None]
        S <- S + beta_t * k_t (v_t - S^T k_t)^T
        o_t = S^T (q_t * scale)

    Equal (to float rounding) to ``fla.ops.kda.naive.naive_recurrent_kda`` with a batch of
    one; with a per-head scalar ``g`` it is Gated DeltaNet
    (``fla.ops.gated_delta_rule.naive``).

    Args:
        q, k: ``[T, H, K]`` (L2-normalised by the caller for KDA/GDN).
        v: ``[T, HV, V]``.
        g: ``[T, HV, K]`` float32 log-space decay (<= 0), or ``[T, HV]`` per-head scalar.
        beta: ``[T, HV]`` write strength in (0, 1).
        state: ``[HV, K, V]`` float32 initial state (not modified); None = zeros.
        scale: query scale, default ``K ** -0.5``.

    Returns:
        ``(o, new_state)``: ``o`` ``[T, HV, V]`` in ``v.dtype``; ``new_state``
        ``[HV, K, V]`` float32. ``T == 0`` returns an empty ``o`` and a copy of the state.

    Raises:
        ValueError: shapes disagree.
    """
    T, H, K = q.shape
    HV, V = v.shape[-2], v.shape[-1]
    if k.shape != q.shape or v.shape[0] != T or beta.shape != (T, HV):
        raise ValueError(
            f"gated_delta_rule: inconsistent shapes q{tuple(q.shape)} k{tuple(k.shape)} "
            f"v{tuple(v.shape)} beta{tuple(beta.shape)}"
        )
    if g.shape not in ((T, HV, K), (T, HV)):
        raise ValueError(f"gated_delta_rule: g{tuple(g.shape)} must be [T, HV, K] or [T, HV]")
    if HV % H != 0:
        raise ValueError(f"gated_delta_rule: HV={HV} not a multiple of H={H}")
    if state is None:
        S = torch.zeros(HV, K, V, dtype=torch.float32, device=q.device)
    else:
        if tuple(state.shape) != (HV, K, V):
            raise ValueError(f"gated_delta_rule: state{tuple(state.shape)} != [HV, K, V]=({HV}, {K}, {V})")
        S = state.float()
    o = torch.empty(T, HV, V, dtype=torch.float32, device=q.device)
    for t in range(T):
        o[t], S = gated_delta_rule_step(q[t], k[t], v[t], g[t], beta[t], S, scale)
    if state is not None and S is state:
        S = S.clone()
    return o.to(v.dtype), S


class GatedDeltaRuleMixer(nn.Module):
    """KDA- or GDN-style token mixer: projections, short conv, gated delta rule, gated norm,
    out_proj.

    The forward is split into stateless steps so that callers that own the states (the
    reference model, SGLang's pools via the backend, the speculative verify/replay) compose
    the same math:

    ``project`` -> ``conv`` -> ``split_qkv`` -> ``recurrence`` -> ``finish``, with
    :meth:`run_segments` = ``conv`` -> ``split_qkv`` -> ``recurrence`` over cut segments.

    Mechanism (Kimi Delta Attention, the per-channel-gated variant of Gated DeltaNet; the torch
    oracle is ``fla.ops.kda.naive.naive_recurrent_kda``, which tests compare against):

        mixed_qkv = x @ W_qkv                        pre-conv activations, [T, conv_dim]
        y         = SiLU(causal_conv1d(mixed_qkv))   short depthwise causal conv, window W
        q, k, v   = split(y); q, k L2-normalised per head
        g         = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)   log-space decay, <= 0
                    (gate="gdn", Gated DeltaNet as in Qwen3-Next: one decay per value head,
                     g = -exp(A_log) * softplus(a_proj(x) + dt_bias), broadcast over K)
        beta      = sigmoid(b_proj(x))
        per token t, per value head h (S: [K, V], fp32):
            S <- S * exp(g_t)[:, None]                       decay, per key channel
            S <- S + beta_t * k_t (v_t - S^T k_t)^T          delta-rule write
            o_t = S^T (q_t * scale)                          read, scale = K ** -0.5
        out = out_proj(RMSNorm(o) * sigmoid(g_proj(x)))      gated output norm

    State layouts (these match SGLang's Mamba2 pool so the backend copies rows without
    reshaping; see ``sglang/srt/configs/mamba_utils.py``):

    - ``conv_state``: ``[conv_dim, W-1]``, window axis last, oldest token first (the last W-1
      pre-conv activations ``mixed_qkv`` of the sequence so far, zero-padded at the start).
    - ``temporal_state`` (the SSM state ``S``): ``[HV, K, V]`` float32, the layout of fla's
      ``initial_state``. (SGLang's GDN kernels, and this project's pool for the tiny model, keep
      ``[HV, V, K]``; the tiny backend reads it through transposed views.)

    Group value attention: ``HV`` must be a multiple of ``H``; q/k head ``i // (HV // H)`` serves
    value head ``i``.

    Numerics: conv and recurrence compute in float32; splitting a sequence into chunks (carrying
    the states between them) agrees with one pass to float rounding (about 1e-7; not bit for bit,
    since torch's vectorised SiLU/exp round differently on tails of different lengths).

    Parameters (``D = shape.conv_dim``, ``HV, K, V`` as in :class:`LinearAttnShape`):
        ``qkv_proj.weight`` ``[D, hidden]``; ``conv_weight`` ``[D, W]`` (+ ``conv_bias``
        ``[D]`` if ``conv_bias=True``); ``f_a.weight`` ``[gate_rank, hidden]``,
        ``f_b.weight`` ``[HV*K, gate_rank]`` (low-rank decay gate, as KDA);
        ``A_log`` ``[HV]``; ``dt_bias`` ``[HV*K]``; with ``gate="gdn"`` instead
        ``a_proj.weight`` ``[HV, hidden]`` and ``dt_bias`` ``[HV]``; ``b_proj.weight`` ``[HV, hidden]``;
        ``g_proj.weight`` ``[HV*V, hidden]`` (output gate); ``o_norm_weight`` ``[V]``;
        ``out_proj.weight`` ``[hidden, HV*V]``.
    """

    def __init__(
        self,
        hidden_size: int,
        shape: LinearAttnShape,
        gate_low_rank_dim: Optional[int] = None,
        conv_bias: bool = False,
        norm_eps: float = 1e-6,
        gate: str = "kda",
    ) -> None:
        super().__init__()
        if gate not in GATES:
            raise ValueError(f"GatedDeltaRuleMixer: gate must be one of {GATES}, got {gate!r}")
        self.hidden_size = hidden_size
        self.shape = shape
        self.norm_eps = norm_eps
        self.gate = gate
        s = shape
        rank = gate_low_rank_dim or s.head_v_dim
        self.qkv_proj = nn.Linear(hidden_size, s.conv_dim, bias=False)
        self.conv_weight = nn.Parameter(torch.empty(s.conv_dim, s.conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(s.conv_dim)) if conv_bias else None
        if gate == "kda":
            self.f_a = nn.Linear(hidden_size, rank, bias=False)
            self.f_b = nn.Linear(rank, s.num_v_heads * s.head_k_dim, bias=False)
        else:
            self.a_proj = nn.Linear(hidden_size, s.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.dt_bias = nn.Parameter(torch.zeros(self.gate_dim))
        self.b_proj = nn.Linear(hidden_size, s.num_v_heads, bias=False)
        self.g_proj = nn.Linear(hidden_size, s.value_dim, bias=False)
        self.o_norm_weight = nn.Parameter(torch.ones(s.head_v_dim))
        self.out_proj = nn.Linear(s.value_dim, hidden_size, bias=False)
        nn.init.normal_(self.conv_weight, std=1.0 / math.sqrt(s.conv_kernel))

    @property
    def gate_dim(self) -> int:
        """Width of the raw decay gate per token: ``HV*K`` (KDA, per key channel) or ``HV``
        (GDN, per value head)."""
        s = self.shape
        return s.num_v_heads * s.head_k_dim if self.gate == "kda" else s.num_v_heads

    # -- steps ---------------------------------------------------------------------------

    def project(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Input projections of ``x`` ``[T, hidden]``.

        Returns:
            ``mixed_qkv`` ``[T, conv_dim]`` (x.dtype, pre-conv ``cat([q, k, v])``),
            ``g`` ``[T, HV, K]`` float32 = ``-exp(A_log) * softplus(f_b(f_a(x)) + dt_bias)``,
            ``beta`` ``[T, HV]`` float32 = ``sigmoid(b_proj(x))``.
        """
        mixed_qkv, g_raw, b_raw = self.project_raw(x)
        g, beta = self.activate_gates(g_raw, b_raw)
        return mixed_qkv, g, beta

    def project_raw(self, x: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The input projections of ``x`` ``[..., hidden]`` before the gate activations —
        what the deferred-verify stash keeps per accepted token (``docs/design.md``, "Deferred
        update"; the same three
        tensors SGLang's KDA backend receives as ``mixed_qkv, a, b``).

        Returns:
            ``mixed_qkv [..., conv_dim]``, ``g_raw [..., gate_dim]`` (KDA ``f_b(f_a(x))``
            ``[..., HV*K]``; GDN ``a_proj(x)`` ``[..., HV]``), ``b_raw [..., HV]``
            (``b_proj(x)``), all in ``x.dtype``.
        """
        g_raw = self.f_b(self.f_a(x)) if self.gate == "kda" else self.a_proj(x)
        return self.qkv_proj(x), g_raw, self.b_proj(x)

    def activate_gates(self, g_raw: torch.Tensor, b_raw: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Gate activations of :meth:`project_raw`'s outputs: ``g [..., HV, K]`` float32
        ``= -exp(A_log) * softplus(g_raw + dt_bias)`` (GDN: one value per head, repeated over
        the ``K`` channels) and ``beta [..., HV]`` float32 ``= sigmoid(b_raw)``."""
        s = self.shape
        f = g_raw.float() + self.dt_bias.float()
        if self.gate == "kda":
            g = -self.A_log.float().exp()[:, None] * F.softplus(f.unflatten(-1, (s.num_v_heads, s.head_k_dim)))
        else:
            g = (-self.A_log.float().exp() * F.softplus(f))[..., None].expand(*f.shape, s.head_k_dim)
        return g, torch.sigmoid(b_raw.float())

    def conv(
        self, mixed_qkv: torch.Tensor, conv_state: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Causal conv + SiLU: :func:`causal_conv1d_update` with this layer's taps.

        ``mixed_qkv`` ``[..., T, conv_dim]``, ``conv_state`` ``[..., conv_dim, W-1]`` or None.
        Returns ``(y [..., T, conv_dim], new_conv_state [..., conv_dim, W-1])``."""
        return causal_conv1d_update(mixed_qkv, conv_state, self.conv_weight, self.conv_bias)

    def split_qkv(self, y: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split post-conv ``y`` ``[..., conv_dim]`` into ``q, k`` ``[..., H, K]``
        (L2-normalised per head) and ``v`` ``[..., HV, V]``."""
        s = self.shape
        q, k, v = torch.split(y, [s.key_dim, s.key_dim, s.value_dim], dim=-1)
        q = l2_normalize(q.unflatten(-1, (s.num_k_heads, s.head_k_dim)))
        k = l2_normalize(k.unflatten(-1, (s.num_k_heads, s.head_k_dim)))
        v = v.unflatten(-1, (s.num_v_heads, s.head_v_dim))
        return q, k, v

    def recurrence(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: Optional[torch.Tensor],
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """:func:`gated_delta_rule` with ``scale = K ** -0.5``: ``(o [T, HV, V],
        new_state [HV, K, V] float32)``."""
        return gated_delta_rule(q, k, v, g, beta, state, scale=self.scale)

    @property
    def scale(self) -> float:
        """Query scale ``K ** -0.5`` (pass it to :func:`gated_delta_rule_step` when stepping
        ``N`` independent states: batched decode rows, draft-tree nodes)."""
        return self.shape.head_k_dim**-0.5

    def run_segments(
        self,
        mixed_qkv: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        conv_state: Optional[torch.Tensor],
        temporal_state: Optional[torch.Tensor],
        cuts: Sequence[int] = (),
        on_cut: Optional[CutCallback] = None,
    ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """Conv -> split -> recurrence over the ``T`` tokens of one sequence, cut into
        segments at ``cuts`` (``docs/design.md``, "Tiny hybrid model").

        The segments run one after another, each continuing from the states the previous
        one left, which is the same recurrence as one pass (to float rounding). After the
        first ``c`` tokens, for every ``c`` in ``cuts``, ``on_cut(c, conv_state,
        temporal_state)`` receives the states reached there (``c == 0``: the given states).

        Args:
            mixed_qkv: ``[T, conv_dim]`` pre-conv activations (:meth:`project`).
            g: ``[T, HV, K]`` float32 activated decay; beta: ``[T, HV]`` float32
                (:meth:`project` / :meth:`activate_gates`).
            conv_state: ``[conv_dim, W-1]`` or None (fresh sequence); not modified.
            temporal_state: ``[HV, K, V]`` float32 or None (fresh sequence); not modified.
            cuts: offsets in tokens, ``0 <= c <= T`` (any order, repeats allowed).
            on_cut: called once per distinct cut, in increasing order.

        Returns:
            ``(o [T, HV, V] in mixed_qkv.dtype, conv_state [conv_dim, W-1], temporal_state
            [HV, K, V] float32)`` after all ``T`` tokens.

        Raises:
            ValueError: a cut outside ``[0, T]``.
        """
        T = mixed_qkv.shape[0]
        stops = sorted({int(c) for c in cuts})
        if stops and (stops[0] < 0 or stops[-1] > T):
            raise ValueError(f"run_segments: cuts {stops} outside [0, {T}] tokens")
        bounds = [0] + [c for c in stops if 0 < c < T] + [T]
        conv, S = conv_state, temporal_state
        if on_cut is not None and stops and stops[0] == 0:
            on_cut(0, conv, S)
        outs = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            y, conv = self.conv(mixed_qkv[lo:hi], conv)
            q, k, v = self.split_qkv(y)
            o, S = self.recurrence(q, k, v, g[lo:hi], beta[lo:hi], S)
            outs.append(o)
            if on_cut is not None and hi > 0 and hi in stops:
                on_cut(hi, conv, S)
        return (outs[0] if len(outs) == 1 else torch.cat(outs)), conv, S

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Gated output norm and projection: ``out_proj(RMSNorm_V(o) * sigmoid(g_proj(x)))``.

        ``o`` ``[T, HV, V]``, ``x`` ``[T, hidden]`` (the mixer input). Returns ``[T, hidden]``
        in ``x.dtype``."""
        s = self.shape
        gate = torch.sigmoid(self.g_proj(x).float()).view(-1, s.num_v_heads, s.head_v_dim)
        o = rms_norm(o.float(), self.o_norm_weight, self.norm_eps).float() * gate
        return self.out_proj(o.reshape(-1, s.value_dim).to(x.dtype))

    def forward(
        self,
        x: torch.Tensor,
        conv_state: Optional[torch.Tensor] = None,
        temporal_state: Optional[torch.Tensor] = None,
        cuts: Sequence[int] = (),
        on_cut: Optional[CutCallback] = None,
    ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Mix ``x`` ``[T, hidden]`` of one sequence, continuing from its states.

        Args:
            conv_state: ``[conv_dim, W-1]`` or None (fresh sequence).
            temporal_state: ``[HV, K, V]`` float32 or None (fresh sequence).
            cuts, on_cut: checkpoints inside the sequence, as in :meth:`run_segments`.

        Returns:
            ``(y [T, hidden], new_conv_state [conv_dim, W-1], new_temporal_state
            [HV, K, V] float32)``; the inputs are not modified.
        """
        mixed_qkv, g, beta = self.project(x)
        o, new_conv, new_temporal = self.run_segments(mixed_qkv, g, beta, conv_state, temporal_state, cuts, on_cut)
        return self.finish(o, x), new_conv, new_temporal
