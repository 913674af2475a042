"""Tests of the tree-ops benchmark (``sglang_mamba_ext.benchmarks.tree_ops``): its shared
pieces, SGLang's (upstream) driver and this project's (``MambaRadixCacheAdapter``) driver.

CPU only. The driver tests import SGLang (several seconds) and replay the first requests
of the shared trace; they are skipped when SGLang or the trace is missing.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import tempfile
import unittest

from conftest import TraceDriverCase

from sglang_mamba_ext.benchmarks.common import (
    CacheDriver,
    TraceError,
    TraceRecord,
    load_trace,
    median_result,
    run_trace,
)


def _write_trace(path: str, records: list[dict]) -> str:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, separators=(",", ":")) + "\n")
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _rec(rid, tokens, output, parent=None):
    return {"rid": rid, "tokens": tokens, "output": output, "sys": 0, "parent": parent}


def reference_prefix_lens(records: list[TraceRecord]) -> list[int]:
    """Usable prefix of every request when nothing is ever evicted.

    An SSM state exists only at the end of a finished ``tokens + output``; so the
    usable prefix of request i is the longest earlier full sequence that is a prefix
    of its prompt, no longer than ``len(tokens) - 1``.
    """
    seen: list[tuple[int, ...]] = []
    out = []
    for rec in records:
        cap = len(rec.tokens) - 1
        best = 0
        for seq in seen:
            if best < len(seq) <= cap and rec.tokens[: len(seq)] == seq:
                best = len(seq)
        out.append(best)
        seen.append(rec.tokens + rec.output)
    return out


class TraceLoadingTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.path = os.path.join(self.tmp.name, "t.jsonl.gz")

    def tearDown(self):
        self.tmp.cleanup()

    def test_reads_records_after_checksum(self):
        sha = _write_trace(
            self.path, [_rec(0, [1, 2, 3], [4]), _rec(1, [1, 2, 3, 4, 5], [6], 0)]
        )
        recs = load_trace(self.path, expected_sha256=sha)
        self.assertEqual([r.rid for r in recs], [0, 1])
        self.assertEqual(recs[1].tokens, (1, 2, 3, 4, 5))
        self.assertEqual(recs[1].parent, 0)
        self.assertEqual(len(load_trace(self.path, expected_sha256=sha, limit=1)), 1)

    def test_checksum_mismatch_names_the_file(self):
        _write_trace(self.path, [_rec(0, [1, 2, 3], [4])])
        with self.assertRaisesRegex(TraceError, "sha256"):
            load_trace(self.path, expected_sha256="0" * 64)

    def test_out_of_order_rid_rejected(self):
        sha = _write_trace(self.path, [_rec(1, [1, 2, 3], [4])])
        with self.assertRaisesRegex(TraceError, "rid order"):
            load_trace(self.path, expected_sha256=sha)

    def test_missing_field_rejected(self):
        sha = _write_trace(self.path, [{"rid": 0, "tokens": [1, 2]}])
        with self.assertRaisesRegex(TraceError, "not a trace record"):
            load_trace(self.path, expected_sha256=sha)

    def test_trace_location_beside_the_checkout_or_from_the_environment(self):
        import subprocess
        import sys

        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        code = "from sglang_mamba_ext.benchmarks.common import TRACE_PATH; print(TRACE_PATH)"

        def trace_path(**env):
            full = {k: v for k, v in os.environ.items() if k != "SGLANG_MAMBA_EXT_TRACE"}
            full.update(env)
            out = subprocess.run([sys.executable, "-c", code], cwd=repo, env=full, capture_output=True, text=True)
            self.assertEqual(out.returncode, 0, out.stderr)
            return out.stdout.strip()

        self.assertEqual(
            trace_path(),
            os.path.normpath(os.path.join(repo, "..", "shared", "bench", "multiturn-trace-v1.jsonl.gz")),
        )
        self.assertEqual(trace_path(SGLANG_MAMBA_EXT_TRACE="/elsewhere/t.jsonl.gz"), "/elsewhere/t.jsonl.gz")

    def test_missing_file(self):
        with self.assertRaisesRegex(TraceError, "not found"):
            load_trace(os.path.join(self.tmp.name, "nope.jsonl.gz"))

    def test_not_gzip_is_a_clean_error(self):
        """A plain file given with ``--no-verify``: exit status 2 and one line naming it."""
        import contextlib
        import io

        from sglang_mamba_ext.benchmarks import tree_ops

        plain = os.path.join(self.tmp.name, "plain.txt")
        with open(plain, "w") as f:
            f.write("root:x:0:0\n")
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            self.assertEqual(tree_ops.main(["--trace", plain, "--no-verify"]), 2)
        self.assertIn(f"tree_ops: {plain}: not a readable gzip JSON-lines trace", err.getvalue())


class _ScriptedDriver(CacheDriver):
    """Returns a scripted prefix length per request and logs every call."""

    name = "scripted"

    def __init__(self, prefix_lens):
        self.prefix_lens = list(prefix_lens)
        self.calls = []

    def begin(self, rec):
        self.calls.append(("begin", rec.rid))
        return rec

    def match(self, h):
        self.calls.append(("match", h.rid))
        return self.prefix_lens[h.rid]

    def lock(self, h):
        self.calls.append(("lock", h.rid))

    def alloc_mamba(self, h):
        self.calls.append(("alloc_mamba", h.rid))

    def alloc_kv(self, h, n):
        self.calls.append(("alloc_kv", h.rid, n))

    def finish(self, h):
        self.calls.append(("finish", h.rid))

    def unlock(self, h):
        self.calls.append(("unlock", h.rid))

    def end(self, h):
        self.calls.append(("end", h.rid))

    def leak_check(self):
        return True, "scripted"


class RunnerTest(unittest.TestCase):
    RECS = [
        TraceRecord(0, (1, 2, 3, 4), (5, 6), 0, None),
        TraceRecord(1, (1, 2, 3, 4, 5, 6, 7), (8,), 0, 0),
    ]

    def test_op_order_and_counters(self):
        d = _ScriptedDriver([0, 6])
        res = run_trace(d, self.RECS)
        self.assertEqual(
            d.calls[:9],
            [
                ("begin", 0),
                ("match", 0),
                ("lock", 0),
                ("alloc_mamba", 0),
                ("alloc_kv", 0, 4),  # extend: whole prompt
                ("alloc_kv", 0, 2),  # decode: the output
                ("finish", 0),
                ("unlock", 0),
                ("end", 0),
            ],
        )
        self.assertIn(("alloc_kv", 1, 1), d.calls)  # 7 - 6 extend tokens
        self.assertEqual(res.prompt_tokens, 11)
        self.assertEqual(res.matched_tokens, 6)
        self.assertEqual(res.hits, 1)
        self.assertAlmostEqual(res.hit_rate, 6 / 11)
        self.assertTrue(res.leak_ok)

    def test_match_beyond_cap_rejected(self):
        # 7 tokens: a match of 7 would leave nothing to compute.
        with self.assertRaisesRegex(ValueError, r"\[0, len\(tokens\)-1\]"):
            run_trace(_ScriptedDriver([0, 7]), self.RECS)

    def test_median_requires_identical_matches(self):
        a = run_trace(_ScriptedDriver([0, 6]), self.RECS)
        b = run_trace(_ScriptedDriver([0, 5]), self.RECS)
        with self.assertRaisesRegex(ValueError, "not deterministic"):
            median_result([a, b])



class _DriverChecks:
    """Checks shared by both sides' drivers (mixed into :class:`TraceDriverCase` classes)."""

    def check_small_pools(self, driver):
        """4 SSM slots and 8,192 KV tokens: evictions lose hits only relative to the
        no-eviction reference, nothing leaks, and all 4 states end in the tree."""
        res = run_trace(driver, self.records)
        self.assertTrue(res.leak_ok, res.leak_details)
        for got, ref in zip(res.prefix_lens, reference_prefix_lens(self.records)):
            self.assertLessEqual(got, ref)
        self.assertEqual(driver.cache.mamba_evictable_size(), 4)


class UpstreamDriverTest(_DriverChecks, TraceDriverCase):

    def test_matches_no_eviction_reference(self):
        from sglang_mamba_ext.benchmarks.upstream import UpstreamDriver

        # Pools large enough that nothing is evicted in the first N requests.
        driver = UpstreamDriver(kv_size=200_000, mamba_size=self.N)
        res = run_trace(driver, self.records)
        expected = reference_prefix_lens(self.records)
        self.assertEqual(res.prefix_lens, expected)
        self.assertEqual(res.matched_tokens, sum(expected))
        self.assertTrue(res.leak_ok, res.leak_details)

    def test_small_pools_evict_without_leak(self):
        from sglang_mamba_ext.benchmarks.upstream import UpstreamDriver

        self.check_small_pools(UpstreamDriver(kv_size=8192, mamba_size=4, cow_copy=True))


class OursDriverTest(_DriverChecks, TraceDriverCase):
    """This project's cache through the plugin's adapter and SGLang's scheduler functions."""

    def test_matches_no_eviction_reference(self):
        from sglang_mamba_ext.benchmarks.ours import OursDriver
        from sglang_mamba_ext.plugin.cache import MambaRadixCacheAdapter

        driver = OursDriver(kv_size=200_000, mamba_size=self.N)
        self.assertIsInstance(driver.cache, MambaRadixCacheAdapter)
        self.assertTrue(driver.describe().startswith("ours: MambaRadixCacheAdapter via SGLang scheduler functions"))
        res = run_trace(driver, self.records)
        self.assertEqual(res.prefix_lens, reference_prefix_lens(self.records))
        self.assertTrue(res.leak_ok, res.leak_details)
        # Every finished sequence keeps its state: one SSM slot per request in the tree.
        self.assertEqual(driver.cache.mamba_evictable_size(), self.N)
        self.assertEqual(driver.cache.full_protected_size(), 0)

    def test_small_pools_evict_without_leak(self):
        from sglang_mamba_ext.benchmarks.ours import OursDriver

        driver = OursDriver(kv_size=8192, mamba_size=4, cow_copy=True)
        self.check_small_pools(driver)
        self.assertEqual(driver.req_to_token_pool.mamba_allocator.available_size(), 0)

    def test_main_names_the_adapter_and_prints_the_comparison_last(self):
        import contextlib
        import io

        from sglang_mamba_ext.benchmarks import tree_ops

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = tree_ops.main(["--limit", "30", "--repeat", "1"])
        self.assertEqual(rc, 0)
        lines = out.getvalue().strip().splitlines()
        self.assertTrue(
            any(l.startswith("ours: MambaRadixCacheAdapter via SGLang scheduler functions") for l in lines), lines
        )
        self.assertRegex(lines[-1], r"^speedup=\d+\.\d{3} hit_ratio=1\.0000$")


class EntryPointsTest(unittest.TestCase):
    """The scripts are thin entry points of the package's modules: same ``--help``."""

    REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    PAIRS = (
        ("bench_tree_ops.py", "tree_ops"),
        ("bench_hit_rate.py", "hit_rate"),
        ("bench_serving_cpu.py", "serving_cpu"),
        ("plan_spec_memory.py", "spec_memory"),
    )

    def _help(self, *cmd: str) -> str:
        import subprocess
        import sys

        proc = subprocess.run(
            [sys.executable, *cmd, "--help"], cwd=self.REPO, capture_output=True, text=True, timeout=300
        )
        self.assertEqual(proc.returncode, 0, proc.stderr)
        return proc.stdout

    def test_scripts_and_modules_print_the_same_help(self):
        for script, module in self.PAIRS:
            with self.subTest(script=script):
                via_script = self._help(os.path.join("scripts", script))
                via_module = self._help("-m", f"sglang_mamba_ext.benchmarks.{module}")
                self.assertIn("usage:", via_module)
                # argparse names the program after argv[0] in the usage paragraph; the
                # description and options after it are identical.
                self.assertEqual(via_script.split("\n\n", 1)[1], via_module.split("\n\n", 1)[1])


if __name__ == "__main__":
    unittest.main()
