"""Offline eviction oracles for the hit-rate benchmark: Belady's rule with the workload's
future, for a fixed checkpoint placement.

The benchmark (:mod:`.hit_rate`) replays a workload whose every request is known in
advance. :class:`OracleDriver` runs this project's cache exactly as ``ours-branch-*`` does
(same plugin adapter, same SGLang scheduler functions, same branch-point and prompt-end
checkpoints) but replaces the victim choice through the core's seam
(``MambaRadixCache.set_victim_priority``,
:class:`~sglang_mamba_ext.mem_cache.eviction.PriorityEviction`) with a rule that reads the
future: :class:`BeladyPriority` drops the unlocked state (or, for KV, leaf) whose next use
lies farthest ahead, or never comes; :class:`RecomputeWeightedBelady` weighs that distance
by the tokens a miss there would recompute.

Next use (:class:`PromptTrie`): a request can only use a state whose token sequence is a
prefix of its prompt less its last token (the match is capped at ``len - 1``). The trie of
all capped prompts gives, for any sequence, the sorted rids whose capped prompt extends
it; the next use after request ``now`` is the first of them above ``now``.

* SSM state of an inner node: the next request that extends the node's whole sequence and
  would resume there, i.e. does not extend a deeper state now in the tree under it, nor
  the sequence the running request will leave (its finish state): a deeper state serves
  that request instead (``shadowing=False`` counts every extension: the naive rule).
* a leaf (removed whole under SSM pressure, its KV with it) and KV eviction: the next
  request entering the leaf's edge at all -- one that passes its parent and shares at least
  one token of the edge. Such a request hits the state or, diverging inside the edge, finds
  the KV that plants its branch-point checkpoint.

How close to an upper bound this is (``docs/design.md``, "Eviction", offline bound).
Belady's MIN is optimal for demand paging when every item takes one slot, every miss
costs the same and items are independent. Here: a miss costs the tokens back to the nearest
surviving ancestor state, not one unit; a state's value depends on which deeper states
survive; a leaf holds KV too; the placement rule creates states no request asked for, and
they must be admitted; and an eviction changes where later branch-point checkpoints are
planted (the placement rule reads the tree). No optimal offline algorithm for this setting
is implemented (with item sizes alone, offline caching is already NP-hard: Chrobak et al.,
"Caching is hard -- even in the fault model", Algorithmica 2012), so the benchmark takes
the best of these offline rules as its *offline bound* for the fixed placement: no proof
of optimality, a reference that knows every future match. An online policy can come out
ahead of one rule on a given workload (the naive rule loses to ``ours-branch-recompute``
on the shared trace at 16 slots), and could in principle beat all of them
(``oracle_ratio > 1``; the adaptive policy does at 16 slots). A provable upper bound, over
every eviction policy and placement, is :mod:`.upper_bound`'s (``upper_bound_ratio``).

The trie and the rules are plain Python; the driver builds the plugin cache as
:mod:`.ours` does.
"""

from __future__ import annotations

import bisect
import math
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_mamba_ext.benchmarks.common import TraceRecord
from sglang_mamba_ext.benchmarks.ours import OursDriver

NEVER = math.inf


class _TrieNode:
    """An edge of :class:`PromptTrie`: ``key`` tokens ending at depth ``end``; ``rids``
    (ascending) of the capped prompts that pass through the whole edge."""

    __slots__ = ("key", "end", "children", "parent", "rids", "rid_set")

    def __init__(self, key: Tuple[int, ...], end: int, parent: Optional["_TrieNode"]):
        self.key = key
        self.end = end
        self.children: Dict[int, _TrieNode] = {}
        self.parent = parent
        self.rids: List[int] = []
        self.rid_set: Optional[frozenset] = None

    def rids_as_set(self) -> frozenset:
        if self.rid_set is None:
            self.rid_set = frozenset(self.rids)
        return self.rid_set


#: A place in the trie: ``(edge, tokens of that edge consumed)``; ``(root, 0)`` is empty.
Position = Tuple[_TrieNode, int]


class PromptTrie:
    """Compressed trie of every record's capped prompt ``tokens[:-1]`` (module docstring).

    ``records[i].rid`` must be ``i`` (arrival order). Every prompt ends at an edge's end, so
    the rids extending a sequence that ends inside edge ``e`` are ``e.rids``.

    Raises:
        ValueError: a record's rid is not its index.
    """

    def __init__(self, records: Sequence[TraceRecord]):
        self.root = _TrieNode((), 0, None)
        for i, rec in enumerate(records):
            if rec.rid != i:
                raise ValueError(f"record {i} has rid {rec.rid}; the oracle needs rids 0..N-1 in order")
            self._insert(tuple(rec.tokens[:-1]), i)
        self.num_records = len(records)

    def _insert(self, toks: Tuple[int, ...], rid: int) -> None:
        node = self.root
        node.rids.append(rid)
        pos, n = 0, len(toks)
        while pos < n:
            child = node.children.get(toks[pos])
            if child is None:
                child = _TrieNode(toks[pos:], n, node)
                node.children[toks[pos]] = child
                child.rids.append(rid)
                return
            key = child.key
            m = 0
            lim = min(len(key), n - pos)
            while m < lim and key[m] == toks[pos + m]:
                m += 1
            if m < len(key):  # split: the upper part ends at pos + m
                upper = _TrieNode(key[:m], child.end - len(key) + m, node)
                upper.rids = list(child.rids)
                node.children[key[0]] = upper
                child.key = key[m:]
                child.parent = upper
                upper.children[child.key[0]] = child
                child = upper
            child.rids.append(rid)
            pos += m
            node = child

    def advance(self, pos: Optional[Position], tokens: Sequence[int]) -> Optional[Position]:
        """The position after following ``tokens`` from ``pos``, or None if no capped
        prompt continues that way (then no request ever extends the sequence)."""
        if pos is None:
            return None
        node, off = pos
        i, n = 0, len(tokens)
        while i < n:
            if off == len(node.key):
                child = node.children.get(tokens[i])
                if child is None:
                    return None
                node, off = child, 0
            key = node.key
            lim = min(len(key) - off, n - i)
            m = 0
            while m < lim and key[off + m] == tokens[i + m]:
                m += 1
            if m < lim:
                return None
            off += m
            i += m
        return node, off

    @property
    def start(self) -> Position:
        return self.root, 0

    @staticmethod
    def rids(pos: Optional[Position]) -> List[int]:
        """Ascending rids whose capped prompt extends the sequence ending at ``pos``."""
        return [] if pos is None else pos[0].rids

    @staticmethod
    def is_prefix(a: Optional[Position], b: Optional[Position]) -> bool:
        """The sequence ending at ``a`` is a prefix of (or equal to) the one ending at ``b``."""
        if a is None or b is None:
            return False
        na, oa = a
        nb, ob = b
        if na is nb:
            return oa <= ob
        while nb is not None and nb.end >= na.end:
            if nb is na:
                return True
            nb = nb.parent
        return False


def next_after(rids: List[int], now: int) -> float:
    """The first rid above ``now`` in ascending ``rids``, or :data:`NEVER`."""
    i = bisect.bisect_right(rids, now)
    return rids[i] if i < len(rids) else NEVER


class BeladyPriority:
    """``priority(candidates, for_kv)`` for ``MambaRadixCache.set_victim_priority``:
    ``-next_use`` of each candidate (module docstring), so the farthest (or never) used goes
    first. Set :attr:`now` (the rid being served) and :attr:`pending` (its ``tokens +
    output``) before each request (:meth:`begin`).

    Args:
        records: the whole trace, rid order.
        cache: the ``MambaRadixCache`` it ranks for (its states shadow each other); may be
            set later, before the first eviction.
        shadowing: count an inner state's use only by requests no deeper state serves.
    """

    def __init__(self, records: Sequence[TraceRecord], cache=None, *, shadowing: bool = True):
        self.trie = PromptTrie(records)
        self.shadowing = shadowing
        self.cache = cache
        self.now = -1
        self.pending: Optional[Position] = None
        self._end: Dict[int, Optional[Position]] = {}  # tree node id -> trie position of its end
        self._entry: Dict[int, Optional[Position]] = {}  # leaf id -> position one token into its edge
        self.calls = 0

    def begin(self, rec: TraceRecord) -> None:
        """Request ``rec`` is being served now."""
        self.now = rec.rid
        self.pending = self.trie.advance(self.trie.start, tuple(rec.tokens) + tuple(rec.output))

    # -- positions of tree nodes --------------------------------------------------
    def end_pos(self, node) -> Optional[Position]:
        """Trie position of the end of ``node``'s root path (memoised by node id: a node's
        path never changes; a split makes a new node)."""
        memo = self._end
        got = memo.get(node.id, memo)
        if got is not memo:
            return got
        chain = []
        while node.parent is not None and node.id not in memo:
            chain.append(node)
            node = node.parent
        pos = self.trie.start if node.parent is None else memo[node.id]
        for n in reversed(chain):
            pos = self.trie.advance(pos, n.key)
            memo[n.id] = pos
        return pos

    def entry_pos(self, node) -> Optional[Position]:
        """Trie position one token into ``node``'s edge."""
        got = self._entry.get(node.id, self._entry)
        if got is self._entry:
            got = self.trie.advance(self.end_pos(node.parent), node.key[:1])
            self._entry[node.id] = got
        return got

    # -- next use -------------------------------------------------------------------
    def state_next_use(self, node, shadows: Sequence[frozenset] = ()) -> float:
        """First request after :attr:`now` that extends ``node``'s sequence and is in none
        of ``shadows`` (rid sets served by a deeper state)."""
        rids = self.trie.rids(self.end_pos(node))
        i = bisect.bisect_right(rids, self.now)
        if not shadows:
            return rids[i] if i < len(rids) else NEVER
        for j in range(i, len(rids)):
            r = rids[j]
            if not any(r in s for s in shadows):
                return r
        return NEVER

    def kv_next_use(self, node) -> float:
        """First request after :attr:`now` that enters ``node``'s edge."""
        return next_after(self.trie.rids(self.entry_pos(node)), self.now)

    def next_use(self, node, shadows: Sequence[frozenset] = ()) -> float:
        """The rid of ``node``'s next use (module docstring): :meth:`kv_next_use` for a
        leaf, :meth:`state_next_use` for an inner node."""
        if not node.children:
            return self.kv_next_use(node)
        return self.state_next_use(node, shadows)

    def __call__(self, candidates: Sequence, for_kv: bool) -> List[float]:
        self.calls += 1
        shadows_of = self._shadows(candidates) if self.shadowing and not for_kv else {}
        return [-self.next_use(n, shadows_of.get(n.id, ())) for n in candidates]

    def _shadows(self, candidates: Sequence) -> Dict[int, List[frozenset]]:
        """For each inner candidate, the rid sets of the deeper states under it (every state
        in the tree, locked or not, and the running request's pending sequence)."""
        inner = {n.id: n for n in candidates if n.children}
        if not inner:
            return {}
        out: Dict[int, List[frozenset]] = {}
        # Walk up from every state in the tree (the SSM pool is small).
        for link in self.cache.mamba_lru_list:
            n = link.owner
            pos = self.end_pos(n)
            if pos is None:
                continue
            s = pos[0].rids_as_set()
            a = n.parent
            while a is not None:
                if a.id in inner:
                    out.setdefault(a.id, []).append(s)
                a = a.parent
        if self.pending is not None:
            s = self.pending[0].rids_as_set()
            for nid, node in inner.items():
                p = self.end_pos(node)
                if p is not None and p != self.pending and self.trie.is_prefix(p, self.pending):
                    out.setdefault(nid, []).append(s)
        return out


class RecomputeWeightedBelady(BeladyPriority):
    """Belady weighted by what a miss costs: priority ``saved / (next_use - now)``, ``saved``
    the tokens back to the nearest ancestor holding a state (what a request resuming here
    would recompute without it, as in ``RecomputeEviction.recompute_per_byte`` without the
    bytes), ``next_use`` as in :class:`BeladyPriority`; never used again: ``-inf`` (first
    out). The hit rate counts tokens, not requests, so this offline rule beats plain
    Belady when near uses save few tokens (module docstring)."""

    def __call__(self, candidates: Sequence, for_kv: bool) -> List[float]:
        self.calls += 1
        shadows_of = self._shadows(candidates) if self.shadowing and not for_kv else {}
        out = []
        for node in candidates:
            nu = self.next_use(node, shadows_of.get(node.id, ()))
            if nu == NEVER:
                out.append(-NEVER)
                continue
            anc = node.parent
            while anc.parent is not None and anc.mamba_value is None:
                anc = anc.parent
            out.append((node.seq_len - anc.seq_len) / (nu - self.now))
        return out


class OracleDriver(OursDriver):
    """``ours-branch-*`` with :class:`BeladyPriority` as the victim choice (module
    docstring). ``records`` must be the trace the runner replays, in order."""

    def __init__(
        self,
        kv_size: int,
        mamba_size: int,
        records: Sequence[TraceRecord],
        *,
        shadowing: bool = True,
        weighted: bool = False,
        name: str = "oracle",
        **kw,
    ):
        rule = RecomputeWeightedBelady if weighted else BeladyPriority
        self.belady = rule(records, shadowing=shadowing)
        super().__init__(kv_size, mamba_size, prefix_checkpoints=True, name=name, **kw)
        self.belady.cache = self.cache.core
        self.cache.core.set_victim_priority(self.belady)

    def begin(self, rec: TraceRecord):
        self.belady.begin(rec)
        return super().begin(rec)

    def describe(self) -> str:
        return super().describe() + (
            f" victim_priority={type(self.belady).__name__}(shadowing={self.belady.shadowing})"
        )
