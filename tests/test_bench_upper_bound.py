"""Tests of the hit-rate benchmark's upper bound (``sglang_mamba_ext.benchmarks.upper_bound``).

* Hand-made traces whose optimum is worked out by hand (candidates and bound).
* Random tiny traces: the LP equals a brute-force search over every choice of held states
  of the relaxed cache (the program is a network flow, so its optimum is integral).
* Random small traces replayed through the core cache (``cache_sim``: real pools, branch
  point, prompt - 1 and boundary checkpoints) under every eviction policy and the offline
  Belady rules: none hits more than the bound.
* The benchmark's own variants on the first requests of the shared trace (SGLang needed).

CPU only, in-process.
"""

from __future__ import annotations

import unittest
from functools import lru_cache
from itertools import combinations

import pytest
from conftest import TraceDriverCase
from hypothesis import HealthCheck, given, settings, strategies as st

from sglang_mamba_ext.benchmarks.common import TraceRecord
from sglang_mamba_ext.benchmarks.upper_bound import candidates, upper_bound


def _recs(pairs):
    """Records from ``(tokens, output)`` pairs, rids in order."""
    return [TraceRecord(i, tuple(t), tuple(o), 0, None) for i, (t, o) in enumerate(pairs)]


def brute_force(records, slots: int) -> int:
    """Best total hit of the relaxed cache (``upper_bound`` module docstring), by trying
    every choice: request ``t`` hits nothing or the depth of a held state that is a prefix
    of ``tokens[:-1]``; after it the cache holds any ``<= slots`` states, of which at most
    ``slots - 1`` (``slots - 2`` after a hit: its source and the working slot) were held
    before ``t`` and are not prefixes of ``t``'s sequence, the others any prefixes of
    ``t``'s ``tokens + output``."""
    seqs = [tuple(r.tokens) + tuple(r.output) for r in records]
    caps = [tuple(r.tokens[:-1]) for r in records]
    n = len(records)

    @lru_cache(maxsize=None)
    def best(t: int, held: frozenset) -> int:
        if t == n:
            return 0
        cap, seq = caps[t], seqs[t]
        others = sorted(s for s in held if seq[: len(s)] != s)
        prefixes = [seq[:k] for k in range(1, len(seq) + 1)]
        top = 0
        for hit in {0} | {len(s) for s in held if cap[: len(s)] == s}:
            keep = slots - 1 - (hit > 0)
            for nk in range(min(keep, len(others)) + 1):
                for kept in combinations(others, nk):
                    for npf in range(min(slots - nk, len(prefixes)) + 1):
                        for new in combinations(prefixes, npf):
                            top = max(top, hit + best(t + 1, frozenset(kept) | frozenset(new)))
        return top

    return best(0, frozenset())


@st.composite
def tiny_traces(draw, max_requests: int = 5, alphabet: int = 3):
    """3..``max_requests`` requests over ``alphabet`` token ids (much sharing): prompts of 2-4
    tokens, a fresh prompt or an earlier full sequence + 1 token; outputs of 1-2 tokens."""
    n = draw(st.integers(3, max_requests))
    tok = st.integers(0, alphabet - 1)
    pairs = []
    for i in range(n):
        parent = draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None
        if parent is not None and len(pairs[parent][0]) + len(pairs[parent][1]) < 5:
            prompt = pairs[parent][0] + pairs[parent][1] + [draw(tok)]
        else:
            prompt = draw(st.lists(tok, min_size=2, max_size=4))
        pairs.append((prompt, draw(st.lists(tok, min_size=1, max_size=2))))
    return _recs(pairs)


class HandMadeTest(unittest.TestCase):
    def test_first_sharer_and_resend(self):
        """r0 = S + (5, 6), r1 = S + (8, 9), r2 continues r0. Candidates: r1 may hit S (4) by
        a state held from r0; r2 may hit S from r1 (4) or r0's sequence (7) from r0. One
        slot: nothing (a hit needs its source and the working slot). Two: r1's 4 and r2's 4
        (r2's 7 would need, at r1's match, S, r0's sequence and r1's working slot). Three:
        4 + 7."""
        s = [1, 2, 3, 4]
        recs = _recs([(s + [5, 6], [7]), (s + [8, 9], [10]), (s + [5, 6, 7, 20], [21])])
        self.assertEqual(candidates(recs), [[], [(0, 4)], [(1, 4), (0, 7)]])
        one, two, three = (upper_bound(recs, c) for c in (1, 2, 3))
        self.assertEqual((one.total, one.hits), (0, [0, 0, 0]))
        self.assertEqual((two.total, two.hits), (8, [0, 4, 4]))
        self.assertEqual((three.total, three.hits), (11, [0, 4, 7]))
        self.assertEqual(three.prompt_tokens, 6 + 6 + 8)
        self.assertAlmostEqual(three.hit_rate, 11 / 20)
        self.assertEqual([brute_force(recs, c) for c in (1, 2, 3)], [0, 8, 11])

    def test_interleaved_continuations_need_a_slot_per_run(self):
        """A, B, A's continuation, B's continuation: each continuation's state must survive
        the other conversation's run. Two slots: one continuation (at the other's match it
        would take A's state, B's state and the working slot); three: both (5 tokens each)."""
        recs = _recs(
            [([1, 2, 3, 7], [8]), ([4, 5, 6, 9], [10]), ([1, 2, 3, 7, 8, 11], [12]), ([4, 5, 6, 9, 10, 13], [14])]
        )
        self.assertEqual(candidates(recs), [[], [], [(0, 5)], [(1, 5)]])
        self.assertEqual(upper_bound(recs, 2).total, 5)
        self.assertEqual(upper_bound(recs, 3).hits, [0, 0, 5, 5])
        self.assertEqual([brute_force(recs, c) for c in (2, 3)], [5, 10])

    def test_capped_at_prompt_minus_one(self):
        """A resent prompt hits all but its last token, not the earlier output."""
        recs = _recs([([1, 2, 3], [4]), ([1, 2, 3], [5])])
        self.assertEqual(candidates(recs), [[], [(0, 2)]])
        self.assertEqual(upper_bound(recs, 2).hits, [0, 2])

    def test_bad_input(self):
        with self.assertRaisesRegex(ValueError, "slots=0"):
            upper_bound(_recs([([1, 2], [3])]), 0)
        with self.assertRaisesRegex(ValueError, "rid"):
            candidates([TraceRecord(1, (1, 2), (3,), 0, None)])
        self.assertEqual(upper_bound([], 4).total, 0)


class BruteForceTest(unittest.TestCase):
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(tiny_traces(), st.integers(1, 3))
    def test_lp_equals_brute_force(self, recs, slots):
        """The program's optimum is integral (a network flow): it equals the best choice of
        the relaxed cache, found by exhaustive search."""
        b = upper_bound(recs, slots)
        self.assertEqual(b.total, brute_force(recs, slots))
        self.assertEqual(sum(b.hits), b.total)


@st.composite
def small_traces(draw):
    """6..14 requests like the shared trace in miniature: 3 system prompts of 3-6 tokens,
    fresh requests (system prompt + 1-4 own tokens) or continuations of an earlier request
    (its full sequence + 1-3 tokens), 1-3 output tokens; ``(records, boundaries)`` with a few
    random message boundaries per request (offsets inside the prompt)."""
    fresh = iter(range(100, 10_000))
    systems = [[next(fresh) for _ in range(draw(st.integers(3, 6)))] for _ in range(3)]
    pairs, bounds = [], []
    for i in range(draw(st.integers(6, 14))):
        if i and draw(st.booleans()):
            t, o = pairs[draw(st.integers(0, i - 1))]
            prompt = t + o + [next(fresh) for _ in range(draw(st.integers(1, 3)))]
        else:
            prompt = systems[draw(st.integers(0, 2))] + [next(fresh) for _ in range(draw(st.integers(1, 4)))]
        pairs.append((prompt, [next(fresh) for _ in range(draw(st.integers(1, 3)))]))
        bounds.append(sorted(set(draw(st.lists(st.integers(1, len(prompt) - 1), max_size=2)))))
    return _recs(pairs), bounds


def replay_core(records, boundaries, slots: int, policy: str):
    """Per-request hits of the core cache (``cache_sim``: branch-point, prompt - 1 and
    ``boundaries`` checkpoints, no ping-pong slots, KV never short) with eviction ``policy``:
    a ``--radix-eviction-policy`` name or an offline rule of ``benchmarks/oracle.py``
    (``belady``, ``belady-naive``, ``belady-cost``)."""
    from cache_sim import SimModel, make_cache

    from sglang_mamba_ext.benchmarks.oracle import BeladyPriority, RecomputeWeightedBelady
    from sglang_mamba_ext.mem_cache import CacheReq

    offline = policy.startswith("belady")
    cache = make_cache(
        kv_size=4096,
        mamba_size=slots,
        track_slots=0,
        branch_checkpoints=True,
        eviction_policy="lru" if offline else policy,
    )
    prio = None
    if offline:
        rule = RecomputeWeightedBelady if policy == "belady-cost" else BeladyPriority
        prio = rule(records, cache, shadowing=policy != "belady-naive")
        cache.set_victim_priority(prio)
    sim = SimModel(cache)
    hits = []
    for rec, b in zip(records, boundaries):
        if prio is not None:
            prio.begin(rec)
        req = CacheReq(rid=rec.rid, token_ids=list(rec.tokens))
        assert sim.admit(req, boundaries=b), f"request {rec.rid} rejected"
        hits.append(sim.last_match.prefix_len)
        assert sim.prefill(req) and sim.decode(req, list(rec.output))
        sim.release(req)
    sim.check_tree()
    cache.sanity_check()
    return hits


POLICIES = ("lru", "recompute", "adaptive", "belady", "belady-naive", "belady-cost")


class CorePoliciesTest(unittest.TestCase):
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(small_traces(), st.integers(2, 4))
    def test_no_policy_beats_the_bound(self, trace, slots):
        """Every eviction policy (and offline rule) of the cache, with branch-point, prompt - 1
        and message-boundary checkpoints, hits at most the bound in total."""
        records, boundaries = trace
        bound = upper_bound(records, slots).total
        for policy in POLICIES:
            hits = replay_core(records, boundaries, slots, policy)
            self.assertLessEqual(sum(hits), bound, f"{policy}: {hits}")

    def test_bound_is_reached_on_a_chain(self):
        """A conversation of 4 turns, 2 slots (a hit's copy-on-write needs the source and the
        working slot at once): each turn resumes from the previous turn's finish state
        (nothing runs in between), which every policy keeps, so the bound is reached and its
        per-request hits are the cache's. ``cache_sim`` never forwards the last output token
        (the benchmark's drivers count it), so each turn continues ``tokens + output[:-1]``:
        the finish state is the deepest state either can have there."""
        pairs = [([1, 2, 3], [4, 5])]
        for k in range(3):
            t, o = pairs[-1]
            pairs.append((t + o[:-1] + [10 + k, 30 + k], [20 + k, 40 + k]))
        recs = _recs(pairs)
        b = upper_bound(recs, 2)
        self.assertEqual(b.hits, [0, 4, 7, 10])
        self.assertEqual(upper_bound(recs, 1).total, 0)  # no slot for the copy
        for policy in POLICIES:
            self.assertEqual(replay_core(recs, [[]] * 4, 2, policy), b.hits, policy)


class BenchmarkVariantsTest(TraceDriverCase):
    """The benchmark's variants of this cache on the first requests of the shared trace."""

    N = 200

    def _check(self, names, slots: int):
        """Every row of ``names`` hits at most the ``upper-bound-lp`` row (request totals in
        tokens), which is :func:`upper_bound`'s optimum; ``upper_bound_ratio`` is the best
        ``ours`` row over it."""
        from sglang_mamba_ext.benchmarks import hit_rate as bench_hit_rate

        results, unavailable = bench_hit_rate.run_config(list(names) + ["upper-bound-lp"], 200_000, slots, self.records)
        self.assertEqual(unavailable, {})
        by = {r.name: r for r in results}
        bound = by.pop("upper-bound-lp")
        self.assertEqual(bound.matched_tokens, upper_bound(self.records, slots).total)
        self.assertEqual(bound.kv_matched_tokens, None)
        for name, r in by.items():
            self.assertLessEqual(r.matched_tokens, bound.matched_tokens, name)
        ratio = bench_hit_rate.upper_bound_ratio(results)
        self.assertEqual(ratio, max(r.hit_rate for r in by.values() if r.side == "ours") / bound.hit_rate)

    def test_best_variants_below_the_bound(self):
        """8 SSM slots: the best online policies and the best offline rule."""
        self._check(["ours-branch-recompute", "ours-branch-adaptive", "oracle-belady-cost"], 8)

    @pytest.mark.slow  # every ours and oracle row twice: ~30 s on 2 cores
    def test_every_variant_below_the_bound(self):
        """6 and 12 SSM slots: every ``ours-*`` and ``oracle-*`` row."""
        from sglang_mamba_ext.benchmarks import hit_rate as bench_hit_rate

        names = [n for n, v in bench_hit_rate.VARIANTS.items() if v.side in ("ours", "oracle")]
        for slots in (6, 12):
            with self.subTest(slots=slots):
                self._check(names, slots)


if __name__ == "__main__":
    unittest.main()
