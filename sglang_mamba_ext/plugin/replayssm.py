"""SGLang's ReplaySSM decode ring (``--enable-linear-replayssm``) under ``--enable-mamba-radix``
(``docs/design.md``, "ReplaySSM decode ring").

What SGLang 0.5.23 does with the flag (``mem_cache/memory_pool.py``, ``MambaPool.__init__``;
``kernels/ops/attention/linear/fused_recurrent_linear_replayssm.py``; the cursor in
``layers/attention/hybrid_linear_attn_backend.py``): a decode step of a GDN or KDA layer
does not write the recurrent state back. It reads the slot's last written state ``S0`` and
appends the step's record to a per-slot ring of ``--linear-replayssm-cache-len`` (``Lr``)
entries, and writes the state only every ``Lr`` steps (GDN also on the radix track boundary,
``seq_len % --mamba-track-interval == 0``). Between those writes ``temporal[slot]`` lags the
live state by ``write_pos[slot]`` steps. Records, per layer and slot (SGLang's tensors):

- ``replayssm_d``: ``[L, slots, HV, Lr, V]``, the step's corrected delta
  ``d = beta * (v - (S . Diag(a)) k)``;
- ``replayssm_k``: ``[L, slots, H, Lr, K]``, the step's L2-normalised key (``H`` key heads,
  ``HV / H`` value heads each);
- ``replayssm_g``: ``[L, slots, HV, Lr]`` (GDN, one log-decay per head) or
  ``[L, slots, HV, Lr, K]`` (KDA, one per key channel), float32.

The live state after the ``m = write_pos`` buffered steps is the recurrence itself,
``S <- S . Diag(exp(g_j)) + d_j k_j^T`` for ``j = 0 .. m-1`` (state ``[HV, V, K]``).

The plugin's tree may only hold exact states, and a finished request's working slot is what
it stores (``no_buffer``, the strategy SGLang requires with the flag): :func:`flush_slots`
folds a slot's pending records into ``temporal[slot]`` (float32, then the state's dtype) and
empties its ring before the cache takes the state, so the tree's state is the live one at
its key's length. SGLang's own cache instead shortens the donated key by ``write_pos``
(``mem_cache/unified_cache/components/mamba.py``, ``prepare_for_caching_req``). Every
slot the plugin's pool hands out starts with an empty ring (:func:`reset_cursor`), as
SGLang's ``HybridReqToTokenPool.alloc`` and ``MambaPool.copy_from`` do for theirs.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch


def decode_ring(sglang_mamba_pool) -> Optional[torch.Tensor]:
    """SGLang's ``replayssm_write_pos`` (int32 ``[slots]``, pending records per slot) when the
    pool runs the ReplaySSM decode ring, else ``None`` (the spec-verify ring,
    ``--enable-linear-replayssm-spec``, keeps no pending decode records)."""
    if not getattr(sglang_mamba_pool, "enable_linear_replayssm", False):
        return None
    return getattr(sglang_mamba_pool, "replayssm_write_pos", None)


def reset_cursor(sglang_mamba_pool, slots: Iterable[int]) -> None:
    """Empty the ring of ``slots`` (no-op without the decode ring)."""
    pos = decode_ring(sglang_mamba_pool)
    slots = list(slots)
    if pos is None or not slots:
        return
    pos[torch.as_tensor(slots, dtype=torch.int64, device=pos.device)] = 0


def fold_records(state: torch.Tensor, d: torch.Tensor, k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """The state after ``m`` buffered steps, from the state before them.

    Args:
        state: ``[HV, V, K]`` (any float dtype).
        d: ``[HV, m, V]`` corrected deltas.
        k: ``[H, m, K]`` normalised keys (``HV`` a multiple of ``H``).
        g: ``[HV, m]`` (GDN) or ``[HV, m, K]`` (KDA) log-decays.

    Returns:
        float32 ``[HV, V, K]``: ``S <- S . Diag(exp(g_j)) + d_j k_j^T`` over ``j``.
    """
    s = state.float().clone()
    hv, h = d.shape[0], k.shape[0]
    kk = k.float().repeat_interleave(hv // h, dim=0)  # [HV, m, K]
    dd, gg = d.float(), g.float()
    for j in range(d.shape[1]):
        decay = torch.exp(gg[:, j])
        s = s * (decay[:, None, None] if decay.dim() == 1 else decay[:, None, :])
        s = s + dd[:, j, :, None] * kk[:, j, None, :]
    return s


def flush_slots(sglang_mamba_pool, slots: Iterable[int]) -> int:
    """Fold each slot's pending ring records into its temporal state, every linear layer,
    and empty its ring (the slots' states become the live ones). No-op without the decode
    ring. Returns the records folded (over slots; per layer they are the same)."""
    pos = decode_ring(sglang_mamba_pool)
    if pos is None:
        return 0
    cache = sglang_mamba_pool.mamba_cache
    temporal = cache.temporal
    folded = 0
    for slot in slots:
        if slot is None or int(slot) <= 0:
            continue
        slot = int(slot)
        m = int(pos[slot].item())
        if m <= 0:
            continue
        for layer in range(temporal.shape[0]):
            new = fold_records(
                temporal[layer, slot],
                cache.replayssm_d[layer, slot, :, :m],
                cache.replayssm_k[layer, slot, :, :m],
                cache.replayssm_g[layer, slot, :, :m],
            )
            temporal[layer, slot] = new.to(temporal.dtype)
        pos[slot] = 0
        folded += m
    return folded
