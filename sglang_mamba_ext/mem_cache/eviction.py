"""Eviction policies of :class:`~.radix_cache.MambaRadixCache` (``docs/design.md``,
"Eviction"). A policy decides which unlocked SSM states and KV leaves go first; the tree
operations that free them (tombstoning an inner node, removing a leaf with its KV and the
tombstone ancestors it leaves bare) stay in the cache. The cache builds one policy object
by name at construction (:func:`make_eviction_policy`), so the hot paths call a bound method
and never compare strings: :class:`LRUEviction` scans the two recency lists;
:class:`RecomputeEviction` ranks states by recompute saved per byte, blended with recency;
:class:`AdaptiveEviction` weighs that by each state's expected future hits, learned online
per class of states.
:class:`PriorityEviction` is the seam for a caller-given victim priority
(``MambaRadixCache.set_victim_priority``; the hit-rate benchmark's offline oracle uses it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Dict, Iterator, Optional, Sequence, Tuple, Type

from .tree_node import EvictResult, TreeNode

if TYPE_CHECKING:  # pragma: no cover
    from .radix_cache import MambaRadixCache


def reversed_links(lru) -> Iterator:
    """The links of ``lru`` from its least recently used end."""
    link = lru.lru()
    while link is not None:
        nxt = lru.step_toward_head(link)
        yield link
        link = nxt


class LRUEviction:
    """Least recently used first, on the two lists the cache keeps (``docs/design.md``,
    "Eviction"): SSM states on ``mamba_lru_list`` (an inner node is tombstoned, a leaf is
    removed whole), KV on ``full_lru_list`` (unlocked leaves only). Locked nodes are
    skipped. Each victim costs O(1) list steps beyond the locked ones passed over."""

    name = "lru"
    #: Called as ``state_used(node, event)`` after the cache moved ``node`` to the front of
    #: ``mamba_lru_list``: ``event`` is ``"stored"`` (a state was stored there, its
    #: ``mamba_origin`` set), ``"hit"`` (a request's first copy-on-write match resumes
    #: from it) or ``"touched"`` (any other match ending there); ``None``: this policy
    #: keeps nothing else.
    state_used: Optional[Callable[[TreeNode, str], None]] = None

    def __init__(self, cache: "MambaRadixCache"):
        self.cache = cache

    def reset(self) -> None:
        """The tree was emptied."""

    def admits(self, state_class: tuple, saved: int) -> bool:
        """Whether a new state of ``state_class`` (``(mamba_origin, under_state)``) that would
        save ``saved`` tokens of recompute is worth evicting the next victim for: a planned
        prefix checkpoint takes a slot only then (``docs/design.md``, "Eviction"). Always
        ``True`` here: recency alone cannot rank a state not stored yet."""
        return True

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
                if cache._demote(node, res):  # kept in the host tier
                    res.mamba_num_evicted += 1
                elif node.children:
                    cache._drop_state(node)
                    res.mamba_num_evicted += 1
                elif node.full_lock_ref == 0:
                    cache._delete_leaf(node, res)
            link = nxt if nxt is None or nxt.linked else lru.step_toward_head(nxt)

    @staticmethod
    def host_evictable(node: TreeNode) -> bool:
        """Whether the host tier may evict ``node``'s copy: unlocked, and either beside a
        device state, an inner node's, or a leaf's whose KV is unlocked."""
        return node.mamba_lock_ref == 0 and (node.mamba_value is not None or bool(node.children) or node.full_lock_ref == 0)

    def host_victim(self) -> Optional[TreeNode]:
        """The host tier's next victim (``docs/design.md``, "Host tier"): its least recently
        used evictable copy, or ``None``."""
        for link in reversed_links(self.cache.host_lru_list):
            if self.host_evictable(link.owner):
                return link.owner
        return None

    def host_kv_victim(self) -> Optional[TreeNode]:
        """The host KV pool's next victim (``docs/design.md``, "Host tier"): its least
        recently used unlocked host-only leaf, or ``None``."""
        for link in reversed_links(self.cache.host_kv_lru_list):
            node = link.owner
            if not node.children and node.full_lock_ref == 0:
                return node
        return None

    def evict_full(self, num_tokens: int, res: EvictResult) -> None:
        """Evict unlocked device leaves until ``res.num_tokens_evicted >= num_tokens`` or none
        is left: their KV moves to the host tier if there is one (``_evict_kv_leaf``),
        otherwise the leaves are removed."""
        cache = self.cache
        lru = cache.full_lru_list
        link = lru.lru()
        while link is not None and res.num_tokens_evicted < num_tokens:
            node = link.owner
            nxt = lru.step_toward_head(link)
            if node.full_lock_ref == 0 and cache._is_device_leaf(node):
                cache._evict_kv_leaf(node, res)
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
            if cache._demote(node, res):  # kept in the host tier
                res.mamba_num_evicted += 1
            elif node.children:
                cache._drop_state(node)
                res.mamba_num_evicted += 1
            else:
                cache._delete_leaf(node, res)

    def evict_full(self, num_tokens: int, res: EvictResult) -> None:
        while res.num_tokens_evicted < num_tokens:
            node = self._victim(leaf_only=True)
            if node is None or not self.cache._evict_kv_leaf(node, res):
                break
        if res.num_tokens_evicted < num_tokens:
            # Only locked or stateless leaves are left: the LRU scan takes the latter.
            super().evict_full(num_tokens, res)

    def recompute_per_byte(self, node: TreeNode) -> float:
        """Tokens of recompute the state of ``node`` saves, per SSM slot's worth of bytes.

        ``saved = node.seq_len - a``, ``a`` the end of the deepest ancestor holding a state:
        without this state a request reaching ``node`` falls back to ``a`` and recomputes
        the difference. The bytes are one SSM slot, plus the node's KV
        (``kv_bytes_per_token`` per token) when the node is a leaf, whose eviction frees
        both; a slot is the tree's (an int8 checkpoint slot under int8 checkpoints, so a
        stored state weighs its compressed bytes against the KV)."""
        cache = self.cache
        root = cache.root_node
        anc = node.parent
        while anc is not root and not anc.has_state:
            anc = anc.parent
        size = 1.0
        if not node.children and cache.kv_bytes_per_token:
            size += cache.kv_bytes_per_token * len(node.key) / (cache.state_pool.slot_bytes() or 1)
        return (node.seq_len - anc.seq_len) / size

    def _state_used(self, node: TreeNode, event: str) -> None:
        node.hits += 1
        node.priority = self.inflation + node.hits * self.recompute_per_byte(node)

    #: Evictable host copies :meth:`host_victim` ranks, least recently used first: the host
    #: tier can hold tens of thousands of states, so each victim costs a bounded scan.
    HOST_VICTIM_SCAN = 64

    def host_victim(self) -> Optional[TreeNode]:
        """The host tier's next victim: of its :attr:`HOST_VICTIM_SCAN` least recently used
        evictable copies, the one of lowest priority (the same recompute-saved-per-byte
        priority the device tier ranks by; ties: least recently used), so both tiers keep
        the states worth most."""
        best, best_p, seen = None, 0.0, 0
        for link in reversed_links(self.cache.host_lru_list):
            if seen == self.HOST_VICTIM_SCAN:
                break
            node = link.owner
            if self.host_evictable(node):
                seen += 1
                p = self.priority_of(node)
                if best is None or p < best_p:
                    best, best_p = node, p
        return best

    def host_kv_victim(self) -> Optional[TreeNode]:
        """The host KV pool's next victim: of its :attr:`HOST_VICTIM_SCAN` least recently
        used unlocked host-only leaves, the one whose (host) state has the lowest priority, so
        that the KV tier keeps what the state tier ranks highest (a leaf without a state
        first; ties: least recently used)."""
        best, best_p, seen = None, 0.0, 0
        for link in reversed_links(self.cache.host_kv_lru_list):
            if seen == self.HOST_VICTIM_SCAN:
                break
            node = link.owner
            if node.children or node.full_lock_ref:
                continue
            seen += 1
            p = self.priority_of(node) if node.has_state else float("-inf")
            if best is None or p < best_p:
                best, best_p = node, p
        return best

    def priority_of(self, node: TreeNode) -> float:
        """``node``'s priority now; lower goes first."""
        return node.priority

    def _candidates(self, leaf_only: bool) -> Iterator[TreeNode]:
        """Unlocked nodes holding a device state, most recent first; only device leaves
        (their KV unlocked) when ``leaf_only`` (a leaf must also be free of KV locks)."""
        for link in self.cache.mamba_lru_list:
            node = link.owner
            if node.mamba_lock_ref:
                continue
            leaf = not node.children
            if leaf_only:
                # KV eviction: the device KV pool's leaves (whose children are host-only)
                if node.full_lock_ref or not self.cache._is_device_leaf(node):
                    continue
            elif leaf and node.full_lock_ref:
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


class AdaptiveEviction(RecomputeEviction):
    """GreedyDual-Size-Frequency whose frequency is each state's *expected future hits*,
    learned online per class of states (``docs/design.md``, "Eviction"):

        priority(n) = L + E[future hits | class(n), hits(n)] * saved(n) / bytes(n)

    ``saved / bytes`` is :meth:`RecomputeEviction.recompute_per_byte`, evaluated when a
    victim is chosen (the nearest ancestor holding a state may have changed since the
    state was stored); ``L`` is the inflation value as in GDSF (the highest victim
    priority so far), set on ``n`` when its state is stored or hit.

    ``class(n)`` is ``(mamba_origin, under_state)``: where the state came from (branch
    point, prompt length - 1, message boundary, finished sequence, chunk or ping-pong
    checkpoint; ``stats.STATE_ORIGINS``) and whether a shallower state lay on its path when
    it was stored (a nested state, e.g. inside a conversation, against a top-level one,
    e.g. a shared system prompt). ``hits(n)`` counts the requests that resumed from the
    state since it was stored (first copy-on-write match per request), capped at
    :attr:`MAX_HITS`. Per class the policy counts how many states reached ``h`` hits and
    estimates ``P(one more hit | h) = (reached(h + 1) + 1) / (reached(h) + 2)`` (Laplace
    smoothing: 1/2 without data), geometric beyond :attr:`MAX_HITS`; the expected future
    hits chain these. A class nobody resumes from (prompt-end states that a finished
    sequence shadows, say) drops toward 0 and goes first; a class whose states keep being
    hit (system-prompt branch points) is kept. The hit counts are halved every
    :attr:`HALF_LIFE` stores, so the estimates follow a changing workload. The idea of
    learning hit probabilities per class of entries online is LHD's (Beckmann et al.,
    "LHD: Improving Cache Hit Rate by Maximizing Hit Density", NSDI 2018), here inside
    GDSF's cost-aware, aging priority.

    Candidates and ties as :class:`RecomputeEviction`. O(states x path depth) per victim;
    O(path depth) per stored state.
    """

    name = "adaptive"
    #: Hits per state tracked exactly (buckets 0 .. MAX_HITS, the last one open).
    MAX_HITS = 2
    #: States stored between two halvings of the learned counts.
    HALF_LIFE = 4096

    def __init__(self, cache: "MambaRadixCache"):
        super().__init__(cache)
        self.reached: Dict[tuple, float] = {}  # (class, h) -> states that reached h hits
        self.more: Dict[tuple, float] = {}  # class -> hits of states already at MAX_HITS
        self.stores = 0
        self._expected: Dict[tuple, float] = {}  # (class, h) -> expected future hits (cache)

    def reset(self) -> None:
        self.inflation = 0.0
        self.reached.clear()
        self.more.clear()
        self.stores = 0
        self._expected.clear()

    def state_class(self, node: TreeNode) -> tuple:
        """``(mamba_origin, under_state)`` of the state just stored at ``node``."""
        root = self.cache.root_node
        anc = node.parent
        while anc is not root and not anc.has_state:
            anc = anc.parent
        return (node.mamba_origin, anc is not root)

    def _state_used(self, node: TreeNode, event: str) -> None:
        if event == "touched":
            return
        if event == "stored" or node.state_class is None:
            node.state_class = self.state_class(node)
            node.hits = 0
            key = (node.state_class, 0)
            self.reached[key] = self.reached.get(key, 0.0) + 1.0
            self.stores += 1
            if self.stores % self.HALF_LIFE == 0:
                for d in (self.reached, self.more):
                    for k in d:
                        d[k] *= 0.5
        if event == "hit":
            h = node.hits
            if h < self.MAX_HITS:
                key = (node.state_class, h + 1)
                self.reached[key] = self.reached.get(key, 0.0) + 1.0
            else:
                self.more[node.state_class] = self.more.get(node.state_class, 0.0) + 1.0
            node.hits = h + 1
        node.priority = self.inflation
        self._expected.clear()

    def expected_hits(self, cls: tuple, hits: int) -> float:
        """Expected future hits of a state of class ``cls`` that has had ``hits`` hits
        (class docstring)."""
        h = min(hits, self.MAX_HITS)
        got = self._expected.get((cls, h))
        if got is not None:
            return got
        reached = self.reached
        top = reached.get((cls, self.MAX_HITS), 0.0)
        more = self.more.get(cls, 0.0)
        p = (more + 1.0) / (top + more + 2.0)
        e = p / (1.0 - p)
        for k in range(self.MAX_HITS - 1, h - 1, -1):
            p = (reached.get((cls, k + 1), 0.0) + 1.0) / (reached.get((cls, k), 0.0) + 2.0)
            e = p * (1.0 + e)
        self._expected[(cls, h)] = e
        return e

    def priority_of(self, node: TreeNode) -> float:
        """``node``'s priority now (class docstring); lower goes first."""
        if node.state_class is None:  # stored before this policy was installed
            node.state_class = self.state_class(node)
        return node.priority + self.expected_hits(node.state_class, node.hits) * self.recompute_per_byte(node)

    def admits(self, state_class: tuple, saved: int) -> bool:
        """A new state of ``state_class`` saving ``saved`` tokens (one slot, an inner node)
        outranks the next victim: its priority ``L + E[hits | class, 0] * saved`` is above
        the victim's. (A prompt-end checkpoint that a finished sequence will shadow, E near
        0, then never evicts a system prompt's state.) ``True`` when nothing is evictable."""
        victim, p = self._lowest(leaf_only=False)
        if victim is None:
            return True
        return self.inflation + self.expected_hits(state_class, 0) * saved > p

    def _lowest(self, leaf_only: bool) -> Tuple[Optional[TreeNode], float]:
        """The candidate of lowest priority (ties: least recent) and its priority."""
        best = None
        best_p = 0.0
        for node in self._candidates(leaf_only):
            p = self.priority_of(node)
            if best is None or p <= best_p:
                best, best_p = node, p
        return best, best_p

    def _victim(self, leaf_only: bool) -> Optional[TreeNode]:
        best, best_p = self._lowest(leaf_only)
        if best is not None and best_p > self.inflation:
            self.inflation = best_p
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
    AdaptiveEviction.name: AdaptiveEviction,
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
