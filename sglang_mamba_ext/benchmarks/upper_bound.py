"""A provable upper bound on the usable hit of any SSM-slot-limited prefix cache over a
workload known in advance: a min-cost-flow linear program (``docs/design.md``, "Eviction",
upper bound).

The benchmark's *offline bound* (:mod:`.oracle`) replays the cache with Belady-like victim
rules; it is no upper bound (an online policy beats it at 16 slots). This module bounds
what *any* run of this cache can hit, whatever its eviction policy and wherever it places
states, by a relaxation whose optimum is computed exactly.

**What a run of the cache can do** (the facts the relaxation rests on; ``mem_cache/``):

1. Request ``r`` hits ``h_r`` tokens, the depth of the deepest node on its capped prompt
   ``tokens[:-1]`` that holds an SSM state at ``r``'s match (KV must be there as well; the
   bound ignores that, which can only raise it). ``h_r <= len(tokens) - 1``.
2. An SSM state is the state after some sequence ``s``; only a forward writes one, so ``s``
   is a prefix of the full sequence ``tokens + output`` of a request ``q`` that ran
   (branch point, prompt - 1, message boundary, ping-pong or chunk checkpoint, finish state:
   all are prefixes of ``q``'s sequence; a copy-on-write copy has the same ``s``).
3. Requests run one at a time, in rid order (the benchmark's replay). Every cached state
   holds its own SSM slot; the pool has ``C`` slots (``--max-mamba-cache-size``, the
   padding slot 0 on top), so at most ``C`` states are cached *between* two requests.
   Request ``t`` gets a working slot of its own while the tree still holds every cached
   state, including the one ``t`` hits (copy-on-write, ``docs/design.md``: the source stays
   locked in the tree, a forward never writes a slot the tree owns). So the states cached
   before ``t`` and still cached after it number at most ``C - 1``, and at most ``C - 2``
   when ``t`` hits -- not counting those ``t`` passes (their sequence is a prefix of
   ``t``'s), as ``t`` may have written them anew.

**Relaxation.** Let ``pass(s) = {q : s is a prefix of tokens_q + output_q}`` and, for a
request ``r`` hitting state ``s`` of depth ``d``, ``g = max{q in pass(s), q < r}``
(``r`` can only hit ``s`` if some earlier request passed it). Whatever the policy, that
state was held without a break from the end of request ``g`` to ``r``'s match: it existed
then (written by ``g`` or earlier) and only a request passing ``s`` can write it again, and
none did in between. So it occupied one slot at every *between point* ``g, ..., r - 1``
(after request ``t``, before ``t + 1``) and through every *run* ``g + 1, ..., r - 1``. Two
requests ``r1 < r2`` hitting the same sequence ``s`` have disjoint spans (``r1`` passes
``s``, so ``r2``'s span starts at ``r1`` or later), so the spans covering one point are
distinct states: at most ``C`` per between point and ``C - 1`` over the between point
before a request's match (its working slot is taken then; the span of its own hit ends
there, the others crossing it go on through its run). The relaxation drops
everything else (where states may be planted, KV, the prefill that writes a state):
request ``r`` may hit any depth ``d <= len - 1`` of its capped prompt at the price of one
slot over ``[g_r(d), r)``, ``g_r(d) = max{q < r : lcp(tokens_q + output_q, tokens_r[:-1])
>= d}``. Every run of the cache is a feasible choice, with the same hits.

**Candidates.** ``g_r(d)`` falls as ``d`` grows, so only the deepest ``d`` per value of
``g`` matters: a short list ``(g_k, d_k)`` per request (``g`` falling, ``d`` rising), read
off a compressed trie of every full sequence (:func:`candidates`).

**Program** (:func:`upper_bound`): maximise ``sum_r sum_k d_k y[r,k]`` subject to
``sum_k y[r,k] <= 1`` per request and the slot counts above. It is a min-cost flow: ``C``
units flow along the timeline (``F_{t-1} -> A_t`` between points, capacity ``C``, flow at
least 1: the slot ``t``'s working state will take; ``A_t -> F_t`` runs), and a request's candidate
``k`` is a detour ``F_{g_k} -> R_r -> A_r`` (``R_r -> A_r`` capacity 1: one hit per
request) earning ``d_k``. A detour crosses exactly the points its state occupies. The
constraint matrix is a network matrix (totally unimodular), so the LP optimum is integral:
it equals the best choice of the relaxed problem, which is at least the hit of every run of
the cache -- an upper bound for every eviction policy *and* every placement of states (the
plugin plants at any offset a client names, ``plugin/chat_boundaries.py``). Solved with
SciPy's HiGHS (``scipy.optimize.linprog``, dual simplex: a vertex, hence integral hits per
request).

How tight: the relaxation lets the first request passing a shared system prompt plant the
state its first sharer needs (this cache plants it at the second; message boundaries do it
for chat requests), and lets a state be rewritten by any request passing it (the cache
rewrites only what a prefill or decode computes). The gap between the bound and the best
policy mixes these placement limits and the eviction policy's own loss.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import List, Sequence, Tuple

from sglang_mamba_ext.benchmarks.common import CacheDriver, TraceRecord
from sglang_mamba_ext.benchmarks.oracle import PromptTrie, _TrieNode

#: One candidate of a request: ``(g, d)``: hit ``d`` tokens by holding a state from the end
#: of request ``g`` to the request's match.
Candidate = Tuple[int, int]


class _SequenceTrie(PromptTrie):
    """:class:`.oracle.PromptTrie` over whole sequences ``tokens + output`` (not capped
    prompts): ``e.rids`` are the requests whose full sequence passes edge ``e``."""

    def __init__(self, records: Sequence[TraceRecord]):
        self.root = _TrieNode((), 0, None)
        for i, rec in enumerate(records):
            if rec.rid != i:
                raise ValueError(f"record {i} has rid {rec.rid}; the bound needs rids 0..N-1 in order")
            self._insert(tuple(rec.tokens) + tuple(rec.output), i)
        self.num_records = len(records)


def candidates(records: Sequence[TraceRecord]) -> List[List[Candidate]]:
    """Per request ``r`` (rid order), its undominated candidates ``(g, d)`` (module
    docstring): ``g`` the last earlier request whose ``tokens + output`` shares at least
    ``d`` tokens with ``tokens_r[:-1]``, ``d`` the deepest such depth for that ``g``;
    ``g`` strictly falling and ``d`` strictly rising along the list; empty when no earlier
    sequence shares a token. Depths in tokens.

    Raises:
        ValueError: a record's rid is not its index.
    """
    trie = _SequenceTrie(records)
    out: List[List[Candidate]] = []
    for r, rec in enumerate(records):
        cap = rec.tokens[:-1]
        n = len(cap)
        cands: List[Candidate] = []
        node, pos = trie.root, 0
        while pos < n:
            node = node.children[cap[pos]]  # cap is a prefix of r's own sequence: in the trie
            i = bisect.bisect_left(node.rids, r) - 1
            if i < 0:
                break  # no earlier sequence passes this edge, nor any deeper one
            g, d = node.rids[i], min(node.end, n)
            if cands and cands[-1][0] == g:
                cands[-1] = (g, d)
            else:
                cands.append((g, d))
            pos = node.end
        out.append(cands)
    return out


@dataclass
class UpperBound:
    """The optimum of the program (module docstring) for one pool size.

    ``hits[r]``: tokens request ``r`` hits in one optimal choice; ``total`` their sum (the
    bound, tokens); ``prompt_tokens``: sum of prompt lengths; ``seconds``: candidates +
    solve time."""

    slots: int
    total: int
    hits: List[int] = field(default_factory=list)
    prompt_tokens: int = 0
    num_candidates: int = 0
    seconds: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.total / self.prompt_tokens if self.prompt_tokens else 0.0


def upper_bound(
    records: Sequence[TraceRecord], slots: int, cands: List[List[Candidate]] | None = None
) -> UpperBound:
    """Solve the min-cost flow (module docstring) for an SSM pool of ``slots`` slots.

    ``cands`` (from :func:`candidates`) may be passed to share them between pool sizes.

    Raises:
        ValueError: ``slots < 1``, a bad rid, or a solver failure (message from HiGHS).
    """
    import numpy as np
    from scipy.optimize import linprog
    from scipy.sparse import coo_matrix

    if slots < 1:
        raise ValueError(f"slots={slots}: the pool needs at least 1 slot (the running request's)")
    t0 = time.perf_counter()
    if cands is None:
        cands = candidates(records)
    n = len(records)
    prompt_tokens = sum(len(r.tokens) for r in records)
    if n == 0:
        return UpperBound(slots, 0, [], 0, 0, time.perf_counter() - t0)
    # Nodes: A_t = 2t (t's match), F_t = 2t + 1 (t finished), R_r = 2n + j (j-th request
    # with candidates). Arcs: columns of the incidence matrix (-1 at tail, +1 at head).
    req_rows = [r for r in range(n) if cands[r]]
    tails, heads, lo, hi, cost = [], [], [], [], []

    def arc(u: int, v: int, low: float, up: float, c: float) -> None:
        tails.append(u)
        heads.append(v)
        lo.append(low)
        hi.append(up)
        cost.append(c)

    for t in range(n):
        arc(2 * t, 2 * t + 1, 0, slots, 0)  # run t
        if t + 1 < n:
            arc(2 * t + 1, 2 * t + 2, 1, slots, 0)  # between point t: >= 1 unit is t + 1's working slot
    cand_cols = []
    for j, r in enumerate(req_rows):
        rnode = 2 * n + j
        for g, d in cands[r]:
            cand_cols.append((r, d, len(cost)))
            arc(2 * g + 1, rnode, 0, 1, -d)
        arc(rnode, 2 * r, 0, 1, 0)
    m = len(cost)
    num_nodes = 2 * n + len(req_rows)
    rows = np.concatenate([np.asarray(tails), np.asarray(heads)])
    cols = np.concatenate([np.arange(m), np.arange(m)])
    vals = np.concatenate([-np.ones(m), np.ones(m)])
    a_eq = coo_matrix((vals, (rows, cols)), shape=(num_nodes, m)).tocsr()
    b_eq = np.zeros(num_nodes)
    b_eq[0] = -slots  # C units leave A_0 ...
    b_eq[2 * n - 1] = slots  # ... and reach F_{n-1}
    res = linprog(
        np.asarray(cost, dtype=float),
        A_eq=a_eq,
        b_eq=b_eq,
        bounds=np.column_stack([lo, hi]),
        method="highs-ds",
    )
    if res.status != 0:
        raise ValueError(f"upper bound LP ({slots} slots): {res.message}")
    x = res.x
    hits = [0] * n
    for r, d, col in cand_cols:
        if x[col] > 0.5:
            hits[r] += d
    frac = np.abs(x - np.round(x)).max()
    total = int(round(-res.fun))
    if frac > 1e-6 or sum(hits) != total:
        raise ValueError(
            f"upper bound LP ({slots} slots): the vertex is not integral (max fraction {frac:.3g}, "
            f"hits {sum(hits)} vs objective {-res.fun:.3f}); the program should be a network flow"
        )
    return UpperBound(
        slots,
        total,
        hits,
        prompt_tokens,
        sum(len(c) for c in cands),
        time.perf_counter() - t0,
    )


class UpperBoundDriver(CacheDriver):
    """Not a cache: replays the per-request hits of :func:`upper_bound` through the hit-rate
    runner, so the bound is a row of its table (side ``"bound"``). ``records`` must be the
    trace the runner replays, in order; ``kv_size`` is ignored (the bound ignores KV)."""

    def __init__(self, kv_size: int, mamba_size: int, records: Sequence[TraceRecord], *, name: str = "upper-bound-lp"):
        self.name = name
        self.bound = upper_bound(records, mamba_size)
        self.mamba_size = mamba_size

    def describe(self) -> str:
        b = self.bound
        return (
            f"{self.name}: min-cost-flow LP over any placement and eviction, mamba_size={self.mamba_size} "
            f"candidates={b.num_candidates} bound={b.total} tokens solved in {b.seconds:.1f}s"
        )

    def begin(self, rec: TraceRecord) -> TraceRecord:
        return rec

    def match(self, h: TraceRecord) -> int:
        return self.bound.hits[h.rid]

    def lock(self, h) -> None:
        pass

    def alloc_mamba(self, h) -> None:
        pass

    def alloc_kv(self, h, num_tokens: int) -> None:
        pass

    def finish(self, h) -> None:
        pass

    def unlock(self, h) -> None:
        pass

    def leak_check(self) -> tuple[bool, str]:
        return True, "no pools (a bound, not a cache)"
