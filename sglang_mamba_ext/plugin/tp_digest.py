"""TP consistency check of the cache (``docs/design.md``, "Multi-rank serving").

Under tensor parallelism every rank runs its own copy of the cache, fed the same requests in
the same order (rank 0 broadcasts them), and each rank's forward reads its own SSM / KV slots:
if two ranks' caches ever decide differently (another eviction victim, another slot), their
forwards read different states and the ranks desynchronise silently. The cache uses no clock,
randomness or unordered iteration in its decisions, so this should never happen; the check
makes it visible.

With ``SGLANG_MAMBA_EXT_TP_DIGEST_STEPS=N`` (N > 0) and more than one rank in the cache's group
(SGLang's ``CacheInitParams.tp_cache_group``: the TP ranks, or the attention-TP ranks of one DP
group), every N batches (counted in ``flush_pending_backups``, which SGLang's scheduler calls
once per processed batch, in lockstep on every rank) each rank hashes

- ``tree``: every node's key, KV slots, SSM slot and lock counts, in a canonical order;
- ``slots``: the free SSM slots and the free KV count (slot ownership);
- ``counters``: evicted KV tokens and SSM states, stored states (the eviction decisions so far);

and the ranks MIN-all-reduce ``[d, -d]`` per part over the group's CPU (gloo) group: equal
iff every rank has the same digest. A mismatch raises :class:`TPCacheDivergence` naming the
part and the step, which stops the scheduler (and the server) with that message.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
from typing import Any, List, Optional

import torch

logger = logging.getLogger(__name__)

ENV = "SGLANG_MAMBA_EXT_TP_DIGEST_STEPS"
PARTS = ("tree", "slots", "counters")
_LOOKUP_COUNTERS = ("matches", "prompt_tokens", "kv_match_tokens", "prefix_tokens")

__all__ = ["ENV", "PARTS", "TPCacheDivergence", "TPDigestCheck", "cache_digest", "maybe_digest_check"]


class TPCacheDivergence(RuntimeError):
    """The TP ranks' caches made different decisions (see the module docstring)."""


def _ints(h, values) -> None:
    for v in values:
        h.update(struct.pack("<q", int(v)))


def _fold(h) -> int:
    """A blake2b digest as a signed int64 that is never ``-2**63`` (so ``-d`` exists)."""
    d = int.from_bytes(h.digest()[:8], "little", signed=True)
    return d if d != -(2**63) else 0


def cache_digest(core) -> List[int]:
    """``[tree, slots, counters]`` digests (int64) of a core ``MambaRadixCache``.

    Deterministic across processes (blake2b over the values, children in key order; no
    Python ``hash``). O(tree size)."""
    tree = hashlib.blake2b(digest_size=8)
    stack = [(0, core.root_node)]
    while stack:
        depth, node = stack.pop()
        _ints(tree, (depth, len(node.key) if node.key is not None else 0))
        if node.key:
            _ints(tree, node.key)
        if node.value is not None and len(node.value):
            _ints(tree, node.value.tolist())
        _ints(tree, (-1 if node.mamba_value is None else node.mamba_value, node.full_lock_ref, node.mamba_lock_ref))
        tree.update(repr(node.extra_key).encode())
        kids = sorted(node.children.values(), key=lambda c: (repr(c.extra_key), c.key[:1] if c.key else []), reverse=True)
        stack.extend((depth + 1, c) for c in kids)
    slots = hashlib.blake2b(digest_size=8)
    pool = core.req_to_token_pool.mamba_pool
    _ints(slots, pool.free_slots() if hasattr(pool, "free_slots") else ())
    _ints(slots, (core.token_to_kv_pool_allocator.available_size(),))
    counters = hashlib.blake2b(digest_size=8)
    snap = core.stats_snapshot()
    # decisions only: the lookup counters (matches, hits) are not decisions of the tree
    _ints(counters, (snap[k] for k in sorted(snap) if k not in _LOOKUP_COUNTERS and not k.startswith("state_hits_")))
    return [_fold(tree), _fold(slots), _fold(counters)]


class TPDigestCheck:
    """Every ``every`` calls of :meth:`step`, compare :func:`cache_digest` across ``group``.

    Args:
        core: the core cache.
        group: a ``torch.distributed`` process group (gloo / CPU) of the ranks that must agree.
        every: batches between checks (> 0).
    """

    def __init__(self, core, group, every: int) -> None:
        if every <= 0:
            raise ValueError(f"{ENV} must be a positive number of batches, got {every}")
        self.core, self.group, self.every = core, group, int(every)
        self.steps = 0
        self.checks = 0

    def step(self) -> None:
        self.steps += 1
        if self.steps % self.every == 0:
            self.check()

    def check(self) -> None:
        """All-reduce the digests now.

        Raises:
            TPCacheDivergence: some part differs on some rank."""
        import torch.distributed as dist

        parts = cache_digest(self.core)
        t = torch.tensor(parts + [-p for p in parts], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        n = len(parts)
        lo, hi = t[:n].tolist(), [-x for x in t[n:].tolist()]
        self.checks += 1
        bad = [PARTS[i] for i in range(n) if not (lo[i] == parts[i] == hi[i])]
        if bad:
            rank = dist.get_rank(group=self.group)
            raise TPCacheDivergence(
                f"sglang-mamba-ext: the TP ranks' prefix caches diverged ({', '.join(bad)}) by batch "
                f"{self.steps} (rank {rank}: {dict(zip(PARTS, parts))}); the ranks would read different "
                f"SSM/KV slots. Please report this with the server log ({ENV} check)."
            )


def maybe_digest_check(core, group: Optional[Any]) -> Optional[TPDigestCheck]:
    """The check for ``core`` when ``SGLANG_MAMBA_EXT_TP_DIGEST_STEPS`` > 0 and ``group`` has
    more than one rank, else None.

    Raises:
        ValueError: the variable is not a positive integer."""
    raw = os.environ.get(ENV, "").strip()
    if not raw or raw == "0":
        return None
    try:
        every = int(raw)
    except ValueError:
        raise ValueError(f"{ENV}={raw!r}: expected a positive integer (batches between checks)") from None
    if group is None:
        return None
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size(group=group) <= 1:
        return None
    logger.info("sglang-mamba-ext: TP cache digest check every %d batches over %d ranks", every,
                dist.get_world_size(group=group))
    return TPDigestCheck(core, group, every)
