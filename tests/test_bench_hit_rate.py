"""Tests of the hit-rate benchmark (``sglang_mamba_ext.benchmarks.hit_rate``) and of the
drivers it runs: SGLang's (upstream) and this project's through the plugin's adapter.

CPU only. The runner and report tests need nothing; the driver tests import SGLang
(several seconds) and replay the first requests of the shared trace, and are skipped
when SGLang or the trace is missing. Each upstream driver's hits are checked request
by request against an independent model (:func:`reference_model`) of what its
strategy can hit when nothing is evicted.
"""

from __future__ import annotations

import contextlib
import io
import math
import unittest
from unittest import mock

from conftest import SGLANG_INSTALLED, TraceDriverCase, requires_sglang

from sglang_mamba_ext.benchmarks import hit_rate as bench_hit_rate
from sglang_mamba_ext.benchmarks.common import CacheDriver, TraceRecord
from sglang_mamba_ext.benchmarks.hit_rate import (
    HitResult,
    Variant,
    VariantUnavailable,
    best_of,
    comparison,
    run_config,
    run_hit_trace,
)


def _lcp(a, b) -> int:
    import numpy as np

    m = min(len(a), len(b))
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if len(diff) else m


def reference_model(records, strategy: str, *, grid: int = 64, interval: int = 256):
    """What each SGLang strategy can hit when no pool ever runs short.

    The tree is modelled as a set of inserted keys (token prefixes), some ending in an
    SSM state. Per request, with ``cap = tokens[:-1]``: the KV-only match is the longest
    common prefix of ``cap`` with any key; the usable prefix ``P`` is the longest key
    with a state that is a prefix of ``cap``. Then, by strategy:

    * ``nobuf``: finish inserts ``tokens + output`` with a state at its end.
    * ``nobuf-ckpt``: the prompt is also inserted with a state (a copy) after prefill.
    * ``branch`` (this project's prefix checkpoints): as ``nobuf``, plus states at the
      branch point ``kv`` (when ``P < kv``) and at ``n - 1`` (when ``P < n - 1``), each a
      state written by the prefill.
    * ``xbuf``: prefill tracks one state: at the branch point
      ``B = floor(kv_match / grid) * grid`` if ``B > P`` and ``(B - P) % grid == 0``,
      else at ``P + floor((n - P) / grid) * grid``, and only if ``n - P >= grid``; the
      prompt checkpoint inserts ``tokens[:T]`` with it. Decode tracks at every
      multiple of ``interval`` in ``(n, n + len(output)]``; finish inserts
      ``(tokens + output)[:last]`` with the last one, or nothing.

    Returns ``(prefix_lens, kv_lens, state_copies)``.
    """
    import numpy as np

    keys, states = [], []
    prefix_lens, kv_lens, copies = [], [], 0
    for rec in records:
        toks = np.asarray(rec.tokens, dtype=np.int64)
        seq = np.asarray(rec.tokens + rec.output, dtype=np.int64)
        n = len(toks)
        cap = toks[: n - 1]
        kv = max((_lcp(cap, k) for k in keys), default=0)
        p = max(
            (len(s) for s in states if len(s) <= n - 1 and _lcp(cap, s) == len(s)),
            default=0,
        )
        prefix_lens.append(p)
        kv_lens.append(kv)
        if strategy in ("nobuf", "nobuf-ckpt", "branch"):
            keys.append(seq)
            states.append(seq)
            if strategy == "nobuf-ckpt":
                states.append(toks)
                copies += 1
            if strategy == "branch":
                for c in sorted({kv, n - 1}):
                    if p < c:
                        states.append(toks[:c])
                        copies += 1
            continue
        assert strategy == "xbuf", strategy
        if n - p >= grid:
            t = p + (n - p) // grid * grid
            b = kv // grid * grid
            if p < b < n and (b - p) % grid == 0:
                t = b
            keys.append(toks[:t])
            states.append(toks[:t])
            copies += 1
        bounds = list(range((n // interval + 1) * interval, len(seq) + 1, interval))
        if bounds:
            copies += len(bounds)
            keys.append(seq[: bounds[-1]])
            states.append(seq[: bounds[-1]])
    return prefix_lens, kv_lens, copies


class ReferenceModelTest(unittest.TestCase):
    """The model itself, on hand-made requests (grid 4, interval 8 for short keys)."""

    def test_xbuf_branch_point_then_hit(self):
        sys_prompt = tuple(range(100, 110))  # 10 tokens
        recs = [
            TraceRecord(0, sys_prompt + (1, 2), (3,), 0, None),
            TraceRecord(1, sys_prompt + (4, 5), (6,), 0, None),
            TraceRecord(2, sys_prompt + (7, 8), (9,), 0, None),
        ]
        p, kv, copies = reference_model(recs, "xbuf", grid=4, interval=8)
        # r0 tracks at 12; r1 sees 10 KV tokens, branches at 8; r2 hits the state at 8.
        self.assertEqual(kv, [0, 10, 10])
        self.assertEqual(p, [0, 0, 8])
        # r0: prefill 12 + none in (12, 13]; r1: prefill at 8; r2: prefill at 12.
        self.assertEqual(copies, 3)

    def test_nobuf_only_sequence_ends(self):
        recs = [
            TraceRecord(0, (1, 2, 3, 4), (5, 6), 0, None),
            TraceRecord(1, (1, 2, 3, 4, 5, 6, 7), (8,), 0, 0),
            TraceRecord(2, (1, 2, 3, 9), (8,), 0, None),
        ]
        p, kv, _ = reference_model(recs, "nobuf")
        self.assertEqual(p, [0, 6, 0])
        self.assertEqual(kv, [0, 6, 3])
        p, _, copies = reference_model(recs, "nobuf-ckpt")
        self.assertEqual(p, [0, 6, 0])
        self.assertEqual(copies, 3)


class _ScriptedDriver(CacheDriver):
    """Scripted prefix / KV lengths; logs every call."""

    name = "scripted"

    def __init__(self, prefix_lens, kv_lens=None):
        self.prefix_lens = list(prefix_lens)
        self.kv_lens = kv_lens
        self.calls = []
        self.state_copies = 0

    def begin(self, rec):
        return rec

    def match(self, h):
        self.calls.append(("match", h.rid))
        return self.prefix_lens[h.rid]

    def kv_match_len(self, h):
        if self.kv_lens is None:
            raise NotImplementedError
        return self.kv_lens[h.rid]

    def lock(self, h):
        self.calls.append(("lock", h.rid))

    def alloc_mamba(self, h):
        self.calls.append(("alloc_mamba", h.rid))

    def alloc_kv(self, h, n):
        self.calls.append(("alloc_kv", h.rid, n))

    def after_prefill(self, h):
        self.calls.append(("after_prefill", h.rid))
        self.state_copies += 1

    def after_decode(self, h):
        self.calls.append(("after_decode", h.rid))

    def finish(self, h):
        self.calls.append(("finish", h.rid))

    def unlock(self, h):
        self.calls.append(("unlock", h.rid))

    def leak_check(self):
        return True, "scripted"


class RunnerTest(unittest.TestCase):
    RECS = [
        TraceRecord(0, (1, 2, 3, 4), (5, 6), 0, None),
        TraceRecord(1, (1, 2, 3, 4, 5, 6, 7), (8,), 0, 0),
        TraceRecord(2, (1, 2, 9, 9, 9), (8,), 0, None),
    ]

    def test_arithmetic_and_op_order(self):
        d = _ScriptedDriver([0, 6, 0], kv_lens=[0, 6, 2])
        res = run_hit_trace(d, self.RECS, side="ours")
        self.assertEqual(
            d.calls[:9],
            [
                ("match", 0),
                ("lock", 0),
                ("alloc_mamba", 0),
                ("alloc_kv", 0, 4),
                ("after_prefill", 0),
                ("alloc_kv", 0, 2),
                ("after_decode", 0),
                ("finish", 0),
                ("unlock", 0),
            ],
        )
        self.assertEqual(res.prompt_tokens, 16)
        self.assertEqual(res.matched_tokens, 6)
        # recompute = prompt - hit, per request and in total
        self.assertEqual(res.recomputed_tokens, 4 + 1 + 5)
        self.assertEqual(res.recomputed_tokens, res.prompt_tokens - res.matched_tokens)
        self.assertEqual(res.hits, 1)
        self.assertEqual(res.kv_matched_tokens, 8)
        self.assertAlmostEqual(res.kv_ceiling, 8 / 16)
        self.assertAlmostEqual(res.hit_rate, 6 / 16)
        self.assertEqual(res.state_copies, 3)
        self.assertTrue(res.leak_ok)

    def test_kv_unknown_reported_as_none(self):
        res = run_hit_trace(_ScriptedDriver([0, 6, 0]), self.RECS)
        self.assertIsNone(res.kv_matched_tokens)
        self.assertIsNone(res.kv_ceiling)

    def test_bad_lengths_rejected(self):
        with self.assertRaisesRegex(ValueError, r"\[0, len\(tokens\)-1\]"):
            run_hit_trace(_ScriptedDriver([0, 7, 0]), self.RECS)
        with self.assertRaisesRegex(ValueError, "KV-only match"):
            run_hit_trace(_ScriptedDriver([0, 6, 0], kv_lens=[0, 5, 0]), self.RECS)


def _result(name, side, matched, recomputed, prompt=100):
    return HitResult(
        name=name,
        side=side,
        prompt_tokens=prompt,
        matched_tokens=matched,
        recomputed_tokens=recomputed,
    )


class ComparisonTest(unittest.TestCase):
    def test_best_is_highest_hit_rate_and_uses_its_recompute(self):
        rs = [
            _result("u1", "upstream", 20, 80),
            _result("u2", "upstream", 50, 50),
            _result("o1", "ours", 60, 40),
            _result("o2", "ours", 40, 10),  # less recompute, but not the best hit rate
        ]
        self.assertEqual(best_of(rs, "upstream").name, "u2")
        h, r, o, u = comparison(rs)
        self.assertEqual((o, u), ("o1", "u2"))
        self.assertAlmostEqual(h, 60 / 50)
        self.assertAlmostEqual(r, 40 / 50)

    def test_missing_side_gives_nan(self):
        h, r, o, u = comparison([_result("u", "upstream", 20, 80)])
        self.assertTrue(math.isnan(h) and math.isnan(r))
        self.assertEqual((o, u), ("-", "u"))

    def test_unavailable_variant_is_reported_not_run(self):
        def broken(kv, m):
            raise VariantUnavailable("not built")

        def scripted(kv, m):
            return _ScriptedDriver([0, 6, 0], kv_lens=[0, 6, 2])

        fake = {
            "a": Variant("upstream", scripted, "a"),
            "b": Variant("ours", broken, "b"),
        }
        with mock.patch.dict(bench_hit_rate.VARIANTS, fake, clear=True):
            results, unavailable = run_config(["a", "b"], 10_000, 8, RunnerTest.RECS)
        self.assertEqual([r.name for r in results], ["a"])
        self.assertEqual(results[0].side, "upstream")
        self.assertEqual(unavailable, {"b": "not built"})



def _check_variant(case, variant: str, strategy: str, *, side: str, states_per_req: int):
    """Replay ``case.records`` through ``variant`` with pools that evict nothing and check it
    request by request against :func:`reference_model` (prefix and KV lengths, state copies,
    recomputed tokens) and the leak check. Returns ``(result, driver)``."""
    driver = bench_hit_rate.VARIANTS[variant].factory(400_000, states_per_req * case.N + 8)
    res = run_hit_trace(driver, case.records, side=side)
    prefix, kv, copies = reference_model(case.records, strategy)
    case.assertEqual(res.prefix_lens, prefix)
    case.assertEqual(res.kv_prefix_lens, kv)
    case.assertEqual(res.state_copies, copies)
    case.assertTrue(res.leak_ok, res.leak_details)
    case.assertEqual(res.recomputed_tokens, sum(len(r.tokens) for r in case.records) - sum(prefix))
    return res, driver


class UpstreamDriversTest(TraceDriverCase):
    N = 150

    def _check_against_model(self, variant: str, strategy: str):
        # Pools large enough that nothing is evicted in the first N requests.
        return _check_variant(self, variant, strategy, side="upstream", states_per_req=2)[0]

    def test_no_buffer_readme_ops(self):
        res = self._check_against_model("upstream-nobuf", "nobuf")
        self.assertGreater(res.matched_tokens, 0)
        self.assertEqual(res.state_copies, 0)

    def test_no_buffer_with_prompt_checkpoint(self):
        res = self._check_against_model("upstream-nobuf-ckpt", "nobuf-ckpt")
        self.assertEqual(res.state_copies, self.N)  # one copy per prompt

    def test_extra_buffer(self):
        res = self._check_against_model("upstream-xbuf", "xbuf")
        nobuf, _, _ = reference_model(self.records, "nobuf")
        # Branch-point tracking hits system prompts that no_buffer cannot.
        self.assertGreater(res.matched_tokens, 1.5 * sum(nobuf))

    def test_extra_buffer_one_ping_pong_slot(self):
        self._check_against_model("upstream-xbuf-1pp", "xbuf")

    def test_small_pools_evict_without_leak(self):
        for name in ("upstream-nobuf", "upstream-nobuf-ckpt", "upstream-xbuf", "upstream-xbuf-1pp"):
            with self.subTest(variant=name):
                driver = bench_hit_rate.VARIANTS[name].factory(8192, 6)
                res = run_hit_trace(driver, self.records, side="upstream")
                self.assertTrue(res.leak_ok, res.leak_details)
                self.assertGreater(res.hits, 0)
                # Every SSM slot is back in the tree or free at the end.
                pool = driver.req_to_token_pool
                self.assertEqual(
                    pool.mamba_allocator.available_size()
                    + driver.cache.mamba_evictable_size(),
                    6,
                )

    def test_main_prints_comparison_last(self):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = bench_hit_rate.main(
                [
                    "--workload", "trace",
                    "--limit", "40",
                    "--mamba-sizes", "8,6",
                    "--only", "upstream-nobuf",
                    "--only", "upstream-xbuf",
                ]
            )
        self.assertEqual(rc, 0)
        lines = out.getvalue().strip().splitlines()
        self.assertEqual(
            lines[-3],
            "mamba_size=6 against upstream best of all (upstream-xbuf), ours -, offline bound -: "
            "hit_ratio=nan recompute_ratio=nan oracle_ratio=nan upper_bound_ratio=nan",
        )
        self.assertTrue(lines[-2].endswith("ours -, upstream upstream-xbuf: bytes_hit_ratio=nan"), lines[-2])
        self.assertEqual(
            lines[-1],
            "hit_ratio=nan oracle_ratio=nan upper_bound_ratio=nan bytes_hit_ratio=nan "
            "default_hit_ratio=nan default_overlap_points=nan",
        )
        self.assertTrue(any(l.startswith("upstream-xbuf ") for l in lines))
        self.assertFalse(any(l.startswith("chat") for l in lines))


class OursVariantsTest(TraceDriverCase):
    """The "ours" variants: the plugin's ``MambaRadixCacheAdapter`` under SGLang's scheduler
    functions, checked request by request against :func:`reference_model`."""

    N = 150

    def _check_against_model(self, variant: str, strategy: str):
        from sglang_mamba_ext.plugin.cache import MambaRadixCacheAdapter

        # Pools large enough that nothing is evicted (3 states at most per request).
        res, driver = _check_variant(self, variant, strategy, side="ours", states_per_req=3)
        self.assertIsInstance(driver.cache, MambaRadixCacheAdapter)
        return res

    def test_lru_is_no_buffer(self):
        res = self._check_against_model("ours-lru", "nobuf")
        self.assertEqual(res.state_copies, 0)

    def test_branch_checkpoints(self):
        for name in ("ours-branch-lru", "ours-branch-recompute", "ours-branch-adaptive"):
            with self.subTest(variant=name):
                res = self._check_against_model(name, "branch")
                nobuf, _, _ = reference_model(self.records, "nobuf")
                # Branch points hit the shared system prompts that no_buffer cannot.
                self.assertGreater(res.matched_tokens, 1.5 * sum(nobuf))

    def test_default_rows_follow_the_flag(self):
        """``ours-default*`` are what ``--enable-mamba-radix`` alone selects (issue 38): the
        plugin's policy and strategy as parsed, prefix checkpoints; with pools that evict
        nothing they hit exactly what the branch-point model says, overlap timing included."""
        branch, _, _ = reference_model(self.records, "branch")
        for name, finish in (("ours-default", "working"), ("ours-default-overlap", "overlap"),
                             ("ours-default-overlap-stop", "overlap")):
            with self.subTest(variant=name):
                driver = bench_hit_rate.VARIANTS[name].factory(400_000, 5 * self.N + 8)
                self.assertEqual((driver.eviction_policy, driver.strategy), ("adaptive", "extra_buffer"))
                self.assertEqual(driver.cache.core.finish_state, finish)
                # planned prefix checkpoints replace the ping-pong slots (docs/design.md, "Ping-pong release")
                self.assertTrue(driver.req_to_token_pool.tracking_replaced())
                self.assertEqual(driver.req_to_token_pool.mamba_initial_tracking_slots, 0)
                res = run_hit_trace(driver, self.records, side="ours")
                self.assertEqual(res.prefix_lens, branch)
                self.assertTrue(res.leak_ok, res.leak_details)

    def test_small_pools_evict_without_leak(self):
        for name in ("ours-lru", "ours-branch-lru", "ours-branch-recompute", "ours-branch-adaptive",
                     "ours-default", "ours-default-overlap", "ours-default-overlap-stop"):
            with self.subTest(variant=name):
                driver = bench_hit_rate.VARIANTS[name].factory(8192, 6)
                res = run_hit_trace(driver, self.records, side="ours")
                self.assertTrue(res.leak_ok, res.leak_details)
                pool = driver.req_to_token_pool
                self.assertEqual(pool.prefix_checkpoints, {})
                self.assertEqual(
                    pool.mamba_allocator.available_size() + driver.cache.mamba_evictable_size(), 6
                )


class Int8SplitTest(unittest.TestCase):
    def test_equal_device_bytes(self):
        # Qwen3-Next GDN layer, bf16: 32 x 128 x 128 state + 8,192 x 3 conv window
        full = 32 * 128 * 128 * 2 + 8192 * 3 * 2
        int8 = 32 * 128 * 128 + 32 * 128 * 2 + 8192 * 3 * 2
        self.assertAlmostEqual(bench_hit_rate.int8_state_bytes_ratio(), int8 / full)
        active, slots = bench_hit_rate.int8_split(16)
        self.assertEqual(active, bench_hit_rate.INT8_ACTIVE_SLOTS)
        self.assertEqual(slots, int((16 - active) * full / int8))
        # never more bytes than the full-precision pool it stands for
        self.assertLessEqual(active * full + slots * int8, 16 * full)
        self.assertGreater(active * full + (slots + 1) * int8, 16 * full)

    @requires_sglang
    def test_int8_host_row_at_equal_host_bytes(self):
        """``ours-branch-adaptive-int8-host`` (issue 42): the int8 split of the device bytes
        and a host tier of int8 states at the host bytes of the ratio-2 rows (the plugin
        sizes it by ``--hicache-ratio`` x the active slots), replayed without a leak."""
        from sglang_mamba_ext.benchmarks.chat_workload import chat_workload

        driver = bench_hit_rate.VARIANTS["ours-branch-adaptive-int8-host"].factory(200_000, 16)
        active, slots = bench_hit_rate.int8_split(16)
        self.assertEqual((driver.int8_slots, driver.host_ratio), (slots, bench_hit_rate.HOST_RATIO * 16 / active))
        self.assertIsNotNone(driver.cache.core.mamba_host_pool)
        res = run_hit_trace(driver, chat_workload(0)[:60], side="ours-bytes")
        self.assertTrue(res.leak_ok, res.leak_details)

    def test_bytes_hit_ratio_takes_every_row_of_each_side(self):
        rs = [
            _result("u", "upstream", 20, 80),
            _result("u8", "upstream-bytes", 30, 70),
            _result("o", "ours", 25, 75),
            _result("o8", "ours-bytes", 45, 55),
        ]
        self.assertEqual(bench_hit_rate.bytes_hit_ratio(rs), (45 / 30, "o8", "u8"))
        # the old fields see only the equal-slot rows
        self.assertEqual(comparison(rs)[2:], ("o", "u"))


@requires_sglang
class Int8VariantsTest(TraceDriverCase):
    """Rows with int8 checkpoints at equal device bytes: with pools that evict nothing they
    hit exactly what the same strategy hits in full precision; with small pools they evict
    without a leak, the tree's states all in the checkpoint pool."""

    N = 60
    PAIRS = {
        "upstream-nobuf-ckpt-int8": ("upstream-nobuf-ckpt", "upstream-bytes"),
        "upstream-xbuf-int8": ("upstream-xbuf", "upstream-bytes"),
        "ours-branch-lru-int8": ("ours-branch-lru", "ours-bytes"),
        "ours-branch-adaptive-int8": ("ours-branch-adaptive", "ours-bytes"),
    }

    def test_same_hits_as_full_precision_when_nothing_is_evicted(self):
        size = 3 * self.N + 8
        for name, (full, side) in self.PAIRS.items():
            with self.subTest(variant=name):
                self.assertEqual(bench_hit_rate.VARIANTS[name].side, side)
                res = run_hit_trace(bench_hit_rate.VARIANTS[name].factory(400_000, size), self.records, side=side)
                ref = run_hit_trace(bench_hit_rate.VARIANTS[full].factory(400_000, size), self.records, side="x")
                self.assertTrue(res.leak_ok, res.leak_details)
                self.assertEqual(res.prefix_lens, ref.prefix_lens)
                self.assertGreater(res.matched_tokens, 0)

    def test_small_pools_evict_without_leak(self):
        active, slots = bench_hit_rate.int8_split(8)
        for name, (_, side) in self.PAIRS.items():
            with self.subTest(variant=name):
                driver = bench_hit_rate.VARIANTS[name].factory(8192, 8)
                res = run_hit_trace(driver, self.records, side=side)
                self.assertTrue(res.leak_ok, res.leak_details)
                self.assertGreater(res.hits, 0)
                pool = driver.req_to_token_pool
                ckpt = pool.mamba_ckpt_pool
                self.assertEqual((pool.mamba_pool.size, ckpt.num_slots), (active, slots))
                self.assertEqual(pool.mamba_allocator.available_size(), active)
                self.assertEqual(ckpt.available_size() + driver.cache.mamba_evictable_size(), slots)


@requires_sglang
class OursOverlapTimingTest(unittest.TestCase):
    """``ours-*-overlap`` rows (``OursOverlapDriver``): a finish is processed after the next
    request's prefill was scheduled, unless that request continues the finished one's
    conversation (``parent``)."""

    @staticmethod
    def records():
        a = TraceRecord(0, tuple(range(10, 50)), tuple(range(50, 56)), 0, None)
        b = TraceRecord(1, a.tokens + (7, 8, 9), (11, 12), 0, None)  # shares a's prompt only
        c = TraceRecord(2, a.tokens + a.output + (60, 61), (62, 63), 0, 0)  # a's next turn
        d = TraceRecord(3, b.tokens + b.output + (64,), (65,), 0, 1)  # b's next turn
        return [a, b, c, d]

    def _run(self, name, mamba_size=64):
        driver = bench_hit_rate.VARIANTS[name].factory(8192, mamba_size)
        res = run_hit_trace(driver, self.records(), side="ours")
        self.assertTrue(res.leak_ok, res.leak_details)
        return res

    def test_late_finish_and_continuations(self):
        # without overlap b hits a's prompt - 1 checkpoint (39); with it a's finish, which
        # inserts that checkpoint, is processed only after b's prefill was scheduled; the
        # next turns hit the finished sequences either way (the benchmark's finish inserts
        # prompt + output: 46 = 40 + 6, 45 = 43 + 2)
        self.assertEqual(self._run("ours-branch-lru").prefix_lens, [0, 39, 46, 45])
        res = self._run("ours-branch-lru-overlap")
        self.assertEqual(res.prefix_lens, [0, 0, 46, 45])

    def test_finish_by_length_is_donated_before_the_next_match(self):
        """The flag's defaults insert a's prompt - 1 checkpoint after its prefill (SGLang's
        post-prefill insert, published before the next batch), so b hits it under either
        finish timing; ``ours-default-overlap`` (requests ending by length) processes a's
        finish before b's match (its final state donated early,
        ``plugin/overlap_publish.py``), ``ours-default-overlap-stop`` (a stop token) after
        b's prefill was scheduled: at b's admission a still holds its working slot."""
        for name in ("ours-default", "ours-default-overlap", "ours-default-overlap-stop"):
            self.assertEqual(self._run(name).prefix_lens, [0, 39, 46, 45], name)
        for name, pending_at_b in (("ours-default-overlap", False), ("ours-default-overlap-stop", True)):
            driver = bench_hit_rate.VARIANTS[name].factory(8192, 64)
            a, b = self.records()[:2]
            with driver.activate():
                h = driver.begin(a)
                driver.match(h)
                driver.lock(h)
                driver.alloc_mamba(h)
                driver.alloc_kv(h, len(a.tokens))
                driver.after_prefill(h)
                driver.alloc_kv(h, len(a.output))
                driver.after_decode(h)
                driver.finish(h)
                driver.unlock(h)
                driver.end(h)
                driver.begin(b)  # b's match comes next
                self.assertEqual(driver._pending is h, pending_at_b, name)

    def test_small_pools_evict_without_leak(self):
        for name in ("ours-branch-lru-overlap", "ours-branch-adaptive-overlap"):
            with self.subTest(variant=name):
                driver = bench_hit_rate.VARIANTS[name].factory(8192, 6)
                res = run_hit_trace(driver, self.records(), side="ours")
                self.assertTrue(res.leak_ok, res.leak_details)
                pool = driver.req_to_token_pool
                self.assertEqual(pool.prefix_checkpoints, {})
                self.assertEqual(pool.mamba_allocator.available_size() + driver.cache.mamba_evictable_size(), 6)


class BeladyRuleTest(unittest.TestCase):
    """The oracle's victim rule (``benchmarks/oracle.py``) on the core cache through the seam
    ``set_victim_priority``, against LRU, on a hand-built trace (no SGLang).

    Pool: 3 SSM slots, no checkpoints besides each request's final state (its prompt end:
    the last output token is never forwarded), no ping-pong slots. Seeds ``sA``, ``sB``,
    ``sC`` leave states A, B, C (3 tokens each, the pool is full); then ``xA``, ``xB``,
    ``xC``, ``xA``, ``xB`` each send that state + one new token (a hit of 3 tokens if the
    state is there) and leave a 4-token leaf nobody extends. By hand:

    * LRU: ``xA`` hits A and its copy-on-write slot evicts B (least recent); ``xB``
      misses, evicts C; ``xC`` misses, evicts A (touched before ``xA``'s leaf); ``xA``
      finds A's KV but no state, misses; ``xB`` misses: hits ``[0,0,0,3,0,0,0,0]``.
    * Belady: ``xA`` (rid 3) evicts C (next use: rid 5) rather than B (rid 4); ``xB``
      hits B and evicts ``xA``'s leaf (never used); ``xC`` misses and evicts ``xB``'s leaf;
      ``xA`` hits A, evicting ``xC``'s leaf; ``xB`` hits B: ``[0,0,0,3,3,0,3,3]``.
    """

    def _records(self):
        a, b, c = [11, 12, 13], [21, 22, 23], [31, 32, 33]
        seeds = [TraceRecord(i, tuple(s), (99,), 0, None) for i, s in enumerate((a, b, c))]
        extend = [(a, 41), (b, 42), (c, 43), (a, 44), (b, 45)]
        return seeds + [
            TraceRecord(3 + i, tuple(s) + (u,), (u + 100,), 0, None) for i, (s, u) in enumerate(extend)
        ]

    def _replay(self, belady: bool, shadowing: bool = True):
        from cache_sim import SimModel, make_cache

        from sglang_mamba_ext.benchmarks.oracle import BeladyPriority

        records = self._records()
        cache = make_cache(kv_size=256, mamba_size=3, track_slots=0)
        sim = SimModel(cache)
        prio = BeladyPriority(records, cache, shadowing=shadowing)
        if belady:
            cache.set_victim_priority(prio)
        hits = []
        from sglang_mamba_ext.mem_cache import CacheReq

        for rec in records:
            prio.begin(rec)
            req = CacheReq(rid=rec.rid, token_ids=list(rec.tokens))
            self.assertTrue(sim.admit(req))
            hits.append(sim.last_match.prefix_len)
            self.assertTrue(sim.prefill(req))
            self.assertTrue(sim.decode(req, list(rec.output)))
            sim.release(req)
        sim.check_tree()
        cache.sanity_check()
        cache.check_slot_accounting()
        return hits, prio

    def test_lru(self):
        self.assertEqual(self._replay(belady=False)[0], [0, 0, 0, 3, 0, 0, 0, 0])

    def test_belady_beats_lru_exactly(self):
        for shadowing in (True, False):
            with self.subTest(shadowing=shadowing):
                hits, prio = self._replay(belady=True, shadowing=shadowing)
                self.assertEqual(hits, [0, 0, 0, 3, 3, 0, 3, 3])
                self.assertEqual(prio.calls, 5)  # one victim for each x request (full pool)

    def test_next_use_index(self):
        from sglang_mamba_ext.benchmarks.oracle import NEVER, PromptTrie, next_after

        trie = PromptTrie(self._records())
        pos_a = trie.advance(trie.start, [11, 12, 13])
        # Capped prompts extending A: rids 3 and 6 (the seed's capped prompt is [11, 12]).
        self.assertEqual(trie.rids(pos_a), [3, 6])
        self.assertEqual(trie.rids(trie.advance(trie.start, [11])), [0, 3, 6])
        self.assertIsNone(trie.advance(pos_a, [41]))  # xA's last token is cut by the cap
        self.assertEqual((next_after([3, 6], 3), next_after([3, 6], 6)), (6, NEVER))
        self.assertTrue(trie.is_prefix(trie.advance(trie.start, [11]), pos_a))
        self.assertFalse(trie.is_prefix(pos_a, trie.advance(trie.start, [21, 22])))
        with self.assertRaisesRegex(ValueError, "rid"):
            PromptTrie(self._records()[1:])


class ChatWorkloadTest(unittest.TestCase):
    """The chat-shaped synthetic workload (``benchmarks/chat_workload.py``)."""

    def test_deterministic_interleaved_multiturn(self):
        from sglang_mamba_ext.benchmarks.chat_workload import DEFAULTS, chat_workload, first_turns_by_system

        recs = chat_workload(0)
        self.assertEqual(recs, chat_workload(0))
        self.assertNotEqual(recs, chat_workload(1))
        self.assertEqual([r.rid for r in recs], list(range(len(recs))))
        firsts = first_turns_by_system(recs)
        self.assertEqual(sum(len(v) for v in firsts.values()), DEFAULTS["num_conversations"])
        self.assertEqual(sorted(len(v) for v in firsts.values()), [20] * DEFAULTS["num_system"])
        interleaved = 0
        for r in recs:
            if r.parent is not None:
                p = recs[r.parent]
                self.assertLess(p.rid, r.rid)
                self.assertEqual(r.tokens[: len(p.tokens) + len(p.output)], p.tokens + p.output)
                self.assertEqual(r.sys, p.sys)
                interleaved += r.rid != p.rid + 1
        self.assertGreater(interleaved, len(recs) // 2)  # turns of others arrive in between

    def test_first_sharer_misses_third_hits(self):
        """One system prompt, three single-turn conversations, pools that evict nothing:
        the first sharer (2nd conversation) hits nothing of the system prompt + user
        header it shares, and plants the branch checkpoint the 3rd then hits whole. The
        variants agree with :func:`reference_model` ("branch") request by request."""
        if not SGLANG_INSTALLED:
            self.skipTest("needs SGLang")
        from sglang_mamba_ext.benchmarks.chat_workload import chat_workload, sharer_hits

        recs = chat_workload(3, num_system=1, num_conversations=3, turns=(1, 1))
        for name in ("ours-branch-recompute", "oracle-belady"):
            with self.subTest(variant=name):
                v = bench_hit_rate.VARIANTS[name]
                args = (400_000, 16) + ((recs,) if v.side == "oracle" else ())
                res = run_hit_trace(v.factory(*args), recs, side=v.side)
                self.assertEqual(res.prefix_lens, reference_model(recs, "branch")[0])
                n, hit, shared = sharer_hits(recs, res.prefix_lens, 2)
                self.assertEqual((n, hit), (1, 0))
                self.assertEqual(sharer_hits(recs, res.prefix_lens, 3), (1, shared, shared))
                # shared = system message + the user header, up to the user's content.
                self.assertEqual(recs[1].tokens[shared - 3 : shared], (1, 4, 6))


@requires_sglang
class MainChatTest(unittest.TestCase):
    def test_last_line_is_ours_over_extra_buffer_and_over_the_bound(self):
        """``--workload chat`` (no trace needed): the last line holds ours' best hit rate
        over SGLang's best (extra_buffer included), over the best oracle row and over the
        upper bound, at the last ``--mamba-sizes``, as :func:`run_config` measures them."""
        from sglang_mamba_ext.benchmarks.chat_workload import chat_workload

        names = ["upstream-nobuf", "upstream-xbuf", "ours-branch-recompute", "ours-default", "ours-default-overlap",
                 "oracle-belady", "upper-bound-lp", "upstream-xbuf-int8", "ours-branch-adaptive-int8"]
        argv = ["--workload", "chat", "--limit", "80", "--mamba-sizes", "12,6"]
        for n in names:
            argv += ["--only", n]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = bench_hit_rate.main(argv)
        self.assertEqual(rc, 0)
        lines = out.getvalue().strip().splitlines()
        results, _ = run_config(names, 200_000, 6, chat_workload(0)[:80])
        by = {r.name: r for r in results}
        ours = max(by[n].hit_rate for n in ("ours-branch-recompute", "ours-default", "ours-default-overlap"))
        up = max(by["upstream-nobuf"].hit_rate, by["upstream-xbuf"].hit_rate)
        default, overlap = by["ours-default"].hit_rate, by["ours-default-overlap"].hit_rate
        self.assertEqual(
            lines[-1],
            f"hit_ratio={ours / up:.4f} oracle_ratio={ours / by['oracle-belady'].hit_rate:.4f} "
            f"upper_bound_ratio={ours / by['upper-bound-lp'].hit_rate:.4f} "
            f"bytes_hit_ratio={max(ours, by['ours-branch-adaptive-int8'].hit_rate) / max(up, by['upstream-xbuf-int8'].hit_rate):.4f} "
            f"default_hit_ratio={default / up:.4f} default_overlap_points={100 * (default - overlap):.2f}",
        )
        self.assertGreaterEqual(by["oracle-belady"].matched_tokens, by["ours-branch-recompute"].matched_tokens)
        self.assertGreaterEqual(by["upper-bound-lp"].matched_tokens, by["oracle-belady"].matched_tokens)
        self.assertTrue(any(l.startswith("upper-bound-lp ") and " n/a " in l for l in lines))
        sharer = [l for l in lines if l.startswith("[chat] mamba_size=6 first turn of the 2nd")]
        self.assertEqual(len(sharer), 1)
        self.assertIn("oracle-belady ", sharer[0])


class OracleDriverTest(TraceDriverCase):
    """The oracle variants on the first requests of the shared trace."""

    N = 300

    def test_oracle_at_least_ours_under_pressure(self):
        """8 SSM slots: the offline Belady rule hits at least as much as every online
        variant of this cache with the same checkpoint placement, without leaks."""
        got = {}
        for name in ("ours-branch-lru", "ours-branch-recompute", "oracle-belady"):
            v = bench_hit_rate.VARIANTS[name]
            args = (200_000, 8) + ((self.records,) if v.side == "oracle" else ())
            res = run_hit_trace(v.factory(*args), self.records, side=v.side)
            self.assertTrue(res.leak_ok, res.leak_details)
            got[name] = res.matched_tokens
        self.assertGreaterEqual(got["oracle-belady"], got["ours-branch-recompute"])
        self.assertGreater(got["ours-branch-recompute"], got["ours-branch-lru"])

    def test_no_eviction_equals_ours(self):
        """Pools that evict nothing: the victim rule never runs, so the oracle hits exactly
        what ``ours-branch-*`` hit (the reference model's "branch")."""
        n = 150
        recs = self.records[:n]
        driver = bench_hit_rate.VARIANTS["oracle-belady"].factory(400_000, 3 * n + 8, recs)
        res = run_hit_trace(driver, recs, side="oracle")
        self.assertEqual(res.prefix_lens, reference_model(recs, "branch")[0])
        self.assertEqual(driver.belady.calls, 0)
        self.assertTrue(res.leak_ok, res.leak_details)


if __name__ == "__main__":
    unittest.main()
