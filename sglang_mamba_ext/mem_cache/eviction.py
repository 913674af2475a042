"""Eviction policies of :class:`~.radix_cache.MambaRadixCache` (``docs/design.md``,
"Eviction"). A policy decides which unlocked SSM states and KV leaves go first; the tree
operations that free them (tombstoning an inner node, removing a leaf with its KV and the
tombstone ancestors it leaves bare) stay in the cache. The cache builds one policy object
by name at construction (:func:`make_eviction_policy`), so the hot paths call a bound method
and never compare strings: :class:`LRUEviction` scans the two recency lists;
:class:`RecomputeEviction` ranks states by recompute saved per byte, blended with recency.
:class:`PriorityEviction` is the seam for a caller-given victim priority
(``MambaRadixCache.set_victim_priority``; the hit-rate benchmark's offline oracle uses it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Optional, Sequence, Type, Iterator

from .tree_node import EvictResult, TreeNode

if TYPE_CHECKING:  # pragma: no cover
    from .radix_cache import MambaRadixCache


class LRUEviction:
    """Least recently used first, on the two lists the cache keeps (``docs/design.md``,
    "Eviction"): SSM states on ``mamba_lru_list`` (an inner node is tombstoned, a leaf is
    removed whole), KV on ``full_lru_list`` (unlocked leaves only). Locked nodes are
    skipped. Each victim costs O(1) list steps beyond the locked ones passed over."""

    name = "lru"
    #: Called with a node whose state was stored or used, after the cache moved it to the
    #: front of ``mamba_lru_list``; ``None``: this policy keeps nothing else.
    state_used: Optional[Callable[[TreeNode], None]] = None

    def __init__(self, cache: "MambaRadixCache"):
        self.cache = cache

    def reset(self) -> None:
        """The tree was emptied."""

    def evict_mamba(self, num: int, res: EvictResult) -> None:
        """Free ``num`` more SSM states if possible, adding what was freed to ``res``."""
        cache = self.cache
        lru = cache.mamba_lru_list
        link = lru.lru()
        target = res.mamba_num_evicted + num
        while link is not None and res.mamba_num_evicted < target:
            node = link.owner
            nxt = lru.step_toward_head(link)
            if node.mamba_lock_ref == 0:
                if node.children:
                    cache._drop_state(node)
                    res.mamba_num_evicted += 1
                elif node.full_lock_ref == 0:
                    cache._delete_leaf(node, res)
            link = nxt if nxt is None or nxt.linked else lru.step_toward_head(nxt)

    def evict_full(self, num_tokens: int, res: EvictResult) -> None:
        """Remove unlocked leaves until ``res.num_tokens_evicted >= num_tokens`` or none is
        left."""
        cache = self.cache
        lru = cache.full_lru_list
        link = lru.lru()
        while link is not None and res.num_tokens_evicted < num_tokens:
            node = link.owner
            nxt = lru.step_toward_head(link)
            if not node.children and node.full_lock_ref == 0:
                cache._delete_leaf(node, res)
            link = nxt if nxt is None or nxt.linked else lru.step_toward_head(nxt)


class RecomputeEviction(LRUEviction):
    """GreedyDual-Size-Frequency (Cherkasova, HP Labs TR HPL-98-69, 1998, after Cao &
    Irani's GreedyDual-Size, USITS 1997) with the cost of a miss taken as tokens of
    recompute (``docs/design.md``, "Eviction"):

        priority(n) = L + hits(n) * saved(n) / bytes(n)

    set whenever ``n``'s state is stored or used; ``L`` (the inflation value) is the
    priority of the last victim, so entries not used since age relative to new ones —
    recency blended with recompute saved per byte (:meth:`recompute_per_byte`), the utility
    idea of Marconi (Pan et al., MLSys 2025, §4.2), without a tuned weight.

    Candidates: unlocked nodes holding a state; for KV eviction only leaves whose KV is
    unlocked, then the LRU scan for stateless leaves. The lowest priority goes (ties: the
    least recently used). O(states) per victim; the SSM pool is small.
    """

    name = "recompute"

    def __init__(self, cache: "MambaRadixCache"):
        super().__init__(cache)
        self.inflation = 0.0
        self.state_used = self._state_used

    def reset(self) -> None:
        self.inflation = 0.0

    def evict_mamba(self, num: int, res: EvictResult) -> None:
        cache = self.cache
        target = res.mamba_num_evicted + num
        while res.mamba_num_evicted < target:
            node = self._victim(leaf_only=False)
            if node is None:
                return
            if node.children:
                cache._drop_state(node)
                res.mamba_num_evicted += 1
            else:
                cache._delete_leaf(node, res)

    def evict_full(self, num_tokens: int, res: EvictResult) -> None:
        while res.num_tokens_evicted < num_tokens:
            node = self._victim(leaf_only=True)
            if node is None:
                break
            self.cache._delete_leaf(node, res)
        if res.num_tokens_evicted < num_tokens:
            # Only locked or stateless leaves are left: the LRU scan takes the latter.
            super().evict_full(num_tokens, res)

    def recompute_per_byte(self, node: TreeNode) -> float:
        """Tokens of recompute the state of ``node`` saves, per SSM slot's worth of bytes.

        ``saved = node.seq_len - a``, ``a`` the end of the deepest ancestor holding a state:
        without this state a request reaching ``node`` falls back to ``a`` and recomputes
        the difference. The bytes are one SSM slot, plus the node's KV
        (``kv_bytes_per_token`` per token) when the node is a leaf, whose eviction frees
        both."""
        cache = self.cache
        root = cache.root_node
        anc = node.parent
        while anc is not root and anc.mamba_value is None:
            anc = anc.parent
        size = 1.0
        if not node.children and cache.kv_bytes_per_token:
            size += cache.kv_bytes_per_token * len(node.key) / (cache.mamba_pool.slot_bytes() or 1)
        return (node.seq_len - anc.seq_len) / size

    def _state_used(self, node: TreeNode) -> None:
        node.hits += 1
        node.priority = self.inflation + node.hits * self.recompute_per_byte(node)

    def _candidates(self, leaf_only: bool) -> Iterator[TreeNode]:
        """Unlocked nodes holding a state, most recent first; only leaves when
        ``leaf_only`` (a leaf must also be free of KV locks)."""
        for link in self.cache.mamba_lru_list:
            node = link.owner
            if node.mamba_lock_ref:
                continue
            leaf = not node.children
            if (leaf_only and not leaf) or (leaf and node.full_lock_ref):
                continue
            yield node

    def _victim(self, leaf_only: bool) -> Optional[TreeNode]:
        best = None
        for node in self._candidates(leaf_only):
            if best is None or node.priority <= best.priority:
                best = node
        if best is not None:
            self.inflation = best.priority
        return best


#: ``priority(candidates, for_kv) -> priorities`` of :class:`PriorityEviction`: one float
#: per candidate node, lower goes first.
VictimPriority = Callable[[Sequence[TreeNode], bool], Sequence[float]]


class PriorityEviction(RecomputeEviction):
    """Victims by a caller-given priority (``docs/design.md``, "Eviction"). For each victim
    the callable gets every unlocked candidate at once (so it can look at the tree as a
    whole) and returns their priorities; the lowest goes, ties to the least recently used.
    ``for_kv`` is False when an SSM state is wanted (an inner node is then tombstoned, a
    leaf removed whole) and True when KV is wanted (only leaves are candidates).
    Candidates, the tree operations and the fallback for stateless leaves are
    :class:`RecomputeEviction`'s. Installed by ``MambaRadixCache.set_victim_priority``
    (the hit-rate benchmark's offline oracle); never built by name."""

    name = "priority"

    def __init__(self, cache: "MambaRadixCache", priority: VictimPriority):
        LRUEviction.__init__(self, cache)
        self.priority = priority

    def reset(self) -> None:
        """Nothing kept."""

    def _victim(self, leaf_only: bool) -> Optional[TreeNode]:
        cands = list(self._candidates(leaf_only))  # most recent first
        if not cands:
            return None
        prios = self.priority(cands, leaf_only)
        best = 0
        for i in range(1, len(cands)):
            if prios[i] <= prios[best]:
                best = i
        return cands[best]


#: The policies by the name ``MambaRadixCache(eviction_policy=...)`` takes.
EVICTION_POLICIES: Dict[str, Type[LRUEviction]] = {
    LRUEviction.name: LRUEviction,
    RecomputeEviction.name: RecomputeEviction,
}


def make_eviction_policy(name: str, cache: "MambaRadixCache") -> LRUEviction:
    """The policy object named ``name`` for ``cache``.

    Raises:
        ValueError: ``name`` is not one of :data:`EVICTION_POLICIES`.
    """
    cls = EVICTION_POLICIES.get(name)
    if cls is None:
        raise ValueError(f"eviction_policy must be one of {tuple(EVICTION_POLICIES)}, got {name!r}")
    return cls(cache)
