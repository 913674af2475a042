"""On-chip tree verify of the deferred mode (``docs/design.md``, "Speculative verify" and
"Deferred update"): the rule that chooses it over the one-layer node-state buffer, and the
entry point the SGLang glue calls in place of a backend's recurrent verify kernel.

Verify must give every tree node its parent's state. The one-layer variant steps each node from
its parent's state read back from an HBM buffer ``[R, T, HV, K, V]`` (reused by every layer);
the on-chip variant (``ops/verify/fused.py``, ``ON_CHIP``) keeps a ``[K, BV]`` tile of the main
state in registers and recomputes each node's state along its root path, so no node-state SSM
buffer exists at all. The conv part is unchanged (SGLang's conv kernel and the one-layer conv
window buffer).

**Rule** (:func:`onchip_fits`): on chip when the program's two fp32 tiles (the main state and
the node being stepped), ``2 * next_pow2(K) * BV * 4`` bytes with ``BV = min(32,
next_pow2(V))``, fit :data:`ONCHIP_TILE_BYTES` (64 KiB: 128 fp32 registers per thread at 4
warps), and the tree depth (``speculative_num_steps + 1``: EAGLE trees and topk-1 chains) is at
most :data:`ONCHIP_MAX_DEPTH` (the recompute costs ``sum(depth)`` steps instead of ``T``, at most
``depth`` times the buffered verify's arithmetic). Kimi-Linear / Qwen3-Next (K = V = 128, depth
4): 32 KiB, on chip. ``SGLANG_MAMBA_EXT_DEFERRED_VERIFY=one_layer`` (or ``on_chip``) overrides
the rule (:func:`choose_verify`).

:func:`onchip_tree_verify` takes the arguments SGLang's KDA / GDN backends hand their
``kernel_dispatcher.target_verify`` (``layers/attention/linear/kernels/kda_triton.py``,
``gdn_triton.py``: raw gates ``a``/``b`` activated there as ``g = -exp(A_log) *
softplus(a + dt_bias)``, ``beta = sigmoid(b)``, q/k L2-normalised with eps 1e-6, scale
``K**-0.5``, states ``[slots, HV, V, K]``, the main state left unchanged) and returns the same
output. Tree tables are built on the device from ``retrieve_parent_token`` (no host sync: CUDA
graph capture safe). Torch + Triton; no SGLang.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

import torch

from sglang_mamba_ext.models.linear_attn import l2_normalize
from sglang_mamba_ext.speculative.tree import TreeIndex

__all__ = ["ONCHIP_TILE_BYTES", "ONCHIP_MAX_DEPTH", "VERIFY_ENV", "VERIFY_VARIANTS", "onchip_fits", "choose_verify",
           "tree_paths", "activate_gates", "onchip_tree_recurrence", "onchip_tree_verify"]

#: Register budget of one program's fp32 state tiles (main state + node state), bytes.
ONCHIP_TILE_BYTES = 64 * 1024
#: Deepest tree (root = depth 1) verified on chip.
ONCHIP_MAX_DEPTH = 8
#: Value columns per program (``tree_recurrence_triton``'s ``BV``).
ONCHIP_BV = 32
#: :func:`onchip_tree_verify` runs the one-launch kernel of ``ops/verify/onchip_raw.py`` (q/k
#: norm, gates and tree walk in registers); False: torch prep + ``ops/verify/fused.py`` (the
#: path it replaced, kept as the tests' second opinion).
RAW_ENTRY = True
#: Environment override of the rule: ``auto`` (default), ``on_chip`` or ``one_layer``.
VERIFY_ENV = "SGLANG_MAMBA_EXT_DEFERRED_VERIFY"
VERIFY_VARIANTS = ("on_chip", "one_layer")


def _pow2(x: int) -> int:
    return 1 << max(int(x) - 1, 0).bit_length()


def onchip_fits(head_k_dim: int, head_v_dim: int, max_depth: int) -> Tuple[bool, str]:
    """Whether the on-chip verify fits (module docstring), with the reason in words."""
    bv = min(ONCHIP_BV, _pow2(head_v_dim))
    tile = 2 * _pow2(head_k_dim) * bv * 4
    if tile > ONCHIP_TILE_BYTES:
        return False, f"state tiles {tile} B > {ONCHIP_TILE_BYTES} B (K={head_k_dim}, BV={bv})"
    if max_depth > ONCHIP_MAX_DEPTH:
        return False, f"tree depth {max_depth} > {ONCHIP_MAX_DEPTH}"
    return True, f"state tiles {tile} B <= {ONCHIP_TILE_BYTES} B, tree depth {max_depth} <= {ONCHIP_MAX_DEPTH}"


def choose_verify(head_k_dim: int, head_v_dim: int, max_depth: int, env: Optional[str] = None) -> Tuple[str, str]:
    """``(variant, reason)``: ``"on_chip"`` or ``"one_layer"`` for a model's per-rank head
    dims and tree depth; ``env`` (default: ``$SGLANG_MAMBA_EXT_DEFERRED_VERIFY``) ``auto`` /
    unset applies :func:`onchip_fits`, a variant name forces it.

    Raises:
        ValueError: an unknown ``env`` value.
    """
    env = os.environ.get(VERIFY_ENV, "auto") if env is None else env
    env = (env or "auto").strip().lower()
    if env in VERIFY_VARIANTS:
        return env, f"{VERIFY_ENV}={env}"
    if env != "auto":
        raise ValueError(f"{VERIFY_ENV} must be auto, on_chip or one_layer, got {env!r}")
    ok, why = onchip_fits(head_k_dim, head_v_dim, max_depth)
    return ("on_chip" if ok else "one_layer"), why


def tree_paths(parents: torch.Tensor, dmax: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``(depth [N, T], path [N, T, dmax])`` int64 from ``parents [N, T]`` (local node
    indices in any order, node 0 the root whatever its entry says, entries outside ``[0, T)``
    read as ``-1``; SGLang's ``retrieve_parent_token`` as its conv kernel fills it), by ``dmax -
    1`` device gathers.
    ``path[n, i]`` lists the nodes from the root down to ``i``, ``-1`` padded; a path deeper
    than ``dmax`` is cut (the rule keeps ``dmax`` = the tree depth)."""
    par = parents.to(torch.int64)
    N, T = par.shape
    # SGLang's conv kernel leaves padding rows' entries unwritten: anything outside [0, T)
    # reads as the main state (those rows' outputs are discarded)
    par = torch.where((par >= 0) & (par < T), par, torch.full_like(par, -1))
    par[:, 0] = -1
    node = torch.arange(T, device=par.device).expand(N, T)
    anc = [node]
    for _ in range(dmax - 1):
        prev = anc[-1]
        up = torch.gather(par, 1, prev.clamp(min=0))
        anc.append(torch.where(prev >= 0, up, torch.full_like(up, -1)))
    anc = torch.stack(anc, dim=-1)  # [N, T, dmax]: node, parent, grandparent, ...
    depth = (anc >= 0).sum(-1)
    j = depth[..., None] - 1 - torch.arange(dmax, device=par.device)
    path = torch.where(j >= 0, torch.gather(anc, 2, j.clamp(min=0)), torch.full_like(anc, -1))
    return depth, path


def activate_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, num_v_heads: int,
                   head_k_dim: int, per_head_gate: bool) -> Tuple[torch.Tensor, torch.Tensor]:
    """``g`` float32 ``[n, HV, K]`` (KDA) or ``[n, HV]`` (``per_head_gate``, GDN) ``=
    -exp(A_log) * softplus(a + dt_bias)`` and ``beta [n, HV] = sigmoid(b)`` from the raw
    gates (any leading shape with ``n`` tokens)."""
    HV, K = num_v_heads, head_k_dim
    A = torch.exp(A_log.float().reshape(HV))
    if per_head_gate:
        x = a.float().reshape(-1, HV) + dt_bias.float().reshape(HV)
        g = -A * torch.nn.functional.softplus(x, beta=1.0, threshold=20.0)
    else:
        x = a.float().reshape(-1, HV, K) + dt_bias.float().reshape(HV, K)
        g = -A[:, None] * torch.nn.functional.softplus(x, beta=1.0, threshold=20.0)
    return g, torch.sigmoid(b.float().reshape(-1, HV))


def onchip_tree_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           state: torch.Tensor, slots: torch.Tensor, parents: Optional[torch.Tensor], max_depth: int,
                           scale: float, impl: str = "triton") -> torch.Tensor:
    """The recurrence on chip from activated inputs: ``q, k [bs, T, H, K]`` (normalised), ``v
    [bs, T, HV, V]``, ``g [bs, T, HV, K]`` or ``[bs, T, HV]``, ``beta [bs, T, HV]``; ``state``
    ``[slots, HV, K, V]`` (any strides, read only), ``slots [bs]`` (``>= 0``), ``parents [bs,
    T]`` (None: a chain). ``impl``: ``"triton"`` (:mod:`.ops.verify.fused`) or ``"torch"``
    (:func:`onchip_tree_recurrence_torch`). Returns ``o [bs, T, HV, V]`` float32.

    Raises:
        ValueError: an unknown ``impl``."""
    bs, T = q.shape[0], q.shape[1]
    if parents is None:
        parents, dmax = (torch.arange(T, device=q.device) - 1).expand(bs, T), T
    else:
        dmax = max(int(max_depth), 1)
    depth, path = tree_paths(parents, dmax)
    if impl == "torch":
        return onchip_tree_recurrence_torch(q, k, v, g, beta, state, slots, depth, path, scale)
    if impl != "triton":
        raise ValueError(f"onchip_tree_recurrence: impl must be 'triton' or 'torch', got {impl!r}")
    from sglang_mamba_ext.speculative.ops.verify.fused import tree_recurrence_triton

    index = TreeIndex(parents, depth, path, path[..., :0])
    return tree_recurrence_triton(q, k, v, g, beta, state, slots.to(torch.int64), index, scale, BV=ONCHIP_BV)


def onchip_tree_recurrence_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, state: torch.Tensor, slots: torch.Tensor, depth: torch.Tensor,
                                 path: torch.Tensor, scale: float) -> torch.Tensor:
    """Torch form of the on-chip tree verify (the Triton kernel's reference, and CPU serving's
    path): every node steps from its request's main state along its root path (``path [bs, T,
    dmax]`` root first, ``-1`` past ``depth [bs, T]``: :func:`tree_paths`), all nodes of a level
    at once with ``gated_delta_rule_step`` (``models/linear_attn.py``); no node state is kept.
    Inputs as :func:`onchip_tree_recurrence`; returns ``o [bs, T, HV, V]`` float32."""
    from sglang_mamba_ext.models.linear_attn import gated_delta_rule_step

    bs, T = q.shape[0], q.shape[1]
    HV, V = v.shape[-2], v.shape[-1]
    S = state[slots.to(torch.int64)].float()[:, None].expand(bs, T, *state.shape[1:]).contiguous()
    o = torch.zeros(bs, T, HV, V, dtype=torch.float32, device=q.device)

    def along(x: torch.Tensor, j: torch.Tensor) -> torch.Tensor:  # x[b, j[b, t]] for every (b, t)
        return torch.gather(x, 1, j.view(bs, T, *([1] * (x.dim() - 2))).expand(bs, T, *x.shape[2:]))

    for d in range(path.shape[-1]):
        j = path[..., d]
        on = j >= 0
        if not bool(on.any()):
            break
        j = j.clamp(min=0)
        o_d, S_d = gated_delta_rule_step(along(q, j), along(k, j), along(v, j), along(g, j), along(beta, j), S, scale)
        S = torch.where(on[..., None, None, None], S_d, S)
        o = torch.where((depth - 1 == d)[..., None, None], o_d, o)
    return o


def onchip_tree_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       A_log: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor,
                       cache_indices: torch.Tensor, draft_token_num: int,
                       retrieve_parent_token: Optional[torch.Tensor], max_depth: int, per_head_gate: bool,
                       ssm_vk: bool = True, scale: Optional[float] = None, impl: str = "triton") -> torch.Tensor:
    """Tree verify of one layer without a node-state buffer, from the arguments of SGLang's
    ``kernel_dispatcher.target_verify`` (module docstring).

    Args:
        q, k: ``[1, n, H, K]`` (or ``[n, H, K]``) post-conv, before the L2 norm; v ``[1, n, HV,
            V]``; ``n = bs * draft_token_num`` (dense layout).
        a, b: raw gates, ``n * HV * K`` (KDA) or ``n * HV`` (GDN) and ``n * HV`` elements.
        A_log ``HV`` elements; dt_bias ``HV * K`` (KDA) or ``HV``.
        ssm_states: the pool's main states ``[slots, HV, V, K]`` (``ssm_vk``) or ``[slots, HV,
            K, V]``, read only.
        cache_indices: ``[>= bs]`` main slots; ``-1`` (padding) reads slot 0, output discarded.
        retrieve_parent_token: ``[bs, T]`` parents (None: a chain).
        max_depth: tree depth bound (``speculative_num_steps + 1``).
        impl: ``"triton"`` (one launch from the raw arguments where :data:`RAW_ENTRY`) or
            ``"torch"`` (:func:`onchip_tree_recurrence_torch`; CPU serving).

    Returns:
        ``[1, n, HV, V]`` in ``v``'s dtype.
    """
    H, K = q.shape[-2], q.shape[-1]
    HV, V = v.shape[-2], v.shape[-1]
    n = q.numel() // (H * K)
    T = int(draft_token_num)
    bs = n // T
    state = ssm_states.transpose(-1, -2) if ssm_vk else ssm_states
    if RAW_ENTRY and impl == "triton":
        from sglang_mamba_ext.speculative.ops.verify.onchip_raw import onchip_verify_raw

        parents = None if retrieve_parent_token is None else retrieve_parent_token[:bs]
        o = onchip_verify_raw(q.reshape(n, H, K), k.reshape(n, H, K), v.reshape(n, HV, V),
                              a.reshape(n, HV, -1) if not per_head_gate else a.reshape(n, HV), b.reshape(n, HV),
                              A_log, dt_bias, state, cache_indices[:bs], parents, T, max_depth, per_head_gate,
                              K ** -0.5 if scale is None else scale)
        return o.reshape(1, n, HV, V)
    qf = l2_normalize(q.reshape(bs, T, H, K).float())
    kf = l2_normalize(k.reshape(bs, T, H, K).float())
    g, beta = activate_gates(a, b, A_log, dt_bias, HV, K, per_head_gate)
    g = g.reshape(bs, T, HV) if per_head_gate else g.reshape(bs, T, HV, K)
    parents = None if retrieve_parent_token is None else retrieve_parent_token[:bs]
    o = onchip_tree_recurrence(qf, kf, v.reshape(bs, T, HV, V), g, beta.reshape(bs, T, HV), state,
                               cache_indices[:bs].to(torch.int64).clamp(min=0), parents, max_depth,
                               K ** -0.5 if scale is None else scale, impl=impl)
    return o.to(v.dtype).reshape(1, n, HV, V)
