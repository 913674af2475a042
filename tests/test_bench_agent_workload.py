"""The agent-shaped synthetic workload of the hit-rate benchmark
(``benchmarks/agent_workload.py``, ``hit_rate --workload agent``; issue 38)."""

from __future__ import annotations

import contextlib
import io
import unittest

from conftest import requires_sglang

from sglang_mamba_ext.benchmarks import hit_rate as bench_hit_rate
from sglang_mamba_ext.benchmarks.agent_workload import (
    DEFAULTS, DOC_SEP, ROLE_TOOL, agent_workload, shape_counts,
)
from sglang_mamba_ext.benchmarks.hit_rate import run_config, run_hit_trace


class AgentWorkloadTest(unittest.TestCase):
    def test_deterministic_and_parents_are_prefixes(self):
        recs = agent_workload(0)
        self.assertEqual(recs, agent_workload(0))
        self.assertNotEqual(recs, agent_workload(1))
        self.assertEqual([r.rid for r in recs], list(range(len(recs))))
        for r in recs:
            self.assertLess(len(r.tokens) + len(r.output), 4096)  # the drivers' max_context_len
            if r.parent is not None:
                p = recs[r.parent]
                self.assertLess(p.rid, r.rid)
                self.assertEqual(r.tokens[: len(p.tokens) + len(p.output)], p.tokens + p.output)
                self.assertEqual(r.sys, p.sys)

    def test_three_shapes(self):
        recs = agent_workload(0)
        counts = shape_counts(recs)
        self.assertEqual(counts["agent_steps"] + counts["rag"], len(recs))
        by_prompt = {}
        regens = 0
        for r in recs:
            first = by_prompt.setdefault(r.tokens, r)
            if first is not r:  # a regeneration: same prompt and parent, a new output
                regens += 1
                self.assertEqual(r.parent, first.parent)
                self.assertNotEqual(r.output, first.output)
        self.assertEqual(regens, counts["regenerations"])
        self.assertGreater(regens, 0)
        agent = [r for r in recs if r.sys < DEFAULTS["num_toolsets"]]
        rag = [r for r in recs if r.sys >= DEFAULTS["num_toolsets"]]
        # tool loops: a later step appends the tool result after the previous output
        steps = [r for r in agent if r.parent is not None]
        self.assertTrue(steps)
        for r in steps:
            p = recs[r.parent]
            self.assertIn(ROLE_TOOL, r.tokens[len(p.tokens) + len(p.output):])
        # RAG: first turns carry 2-4 documents; the pool's documents come in varying order
        firsts = [r for r in rag if r.parent is None]
        docs = [r.tokens.count(DOC_SEP) for r in firsts]
        self.assertEqual((min(docs), max(docs)), DEFAULTS["docs_per_query"])
        first_doc = {r.tokens[r.tokens.index(DOC_SEP):r.tokens.index(DOC_SEP) + 8] for r in firsts}
        self.assertGreater(len(first_doc), DEFAULTS["num_docs"] // 2)

    def test_bad_parameters(self):
        with self.assertRaisesRegex(ValueError, "unknown parameter"):
            agent_workload(0, turns=(1, 2))
        with self.assertRaisesRegex(ValueError, "docs_per_query"):
            agent_workload(0, docs_per_query=(2, 40))
        with self.assertRaisesRegex(ValueError, "probabilities"):
            agent_workload(0, regen_prob=1.5)


class ArgsTest(unittest.TestCase):
    def test_mamba_sizes_below_what_every_variant_runs_at(self):
        """``--mamba-sizes`` below :data:`MIN_MAMBA_SIZE` (6) is refused like argparse
        (exit 2, the flag named): 4 and 5 passed the old check and then failed inside
        SGLang's extra_buffer and int8 rows and the overlap rows' start-up check."""
        from sglang_mamba_ext.benchmarks.hit_rate import MIN_MAMBA_SIZE, parse_args

        self.assertEqual(MIN_MAMBA_SIZE, 6)
        for bad in ("5", "16,4", "0"):
            err = io.StringIO()
            with self.subTest(sizes=bad), contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as cm:
                parse_args(["--workload", "agent", "--mamba-sizes", bad])
            self.assertEqual(cm.exception.code, 2)
            self.assertIn("--mamba-sizes", err.getvalue())
            self.assertIn("at least 6", err.getvalue())
        self.assertEqual(parse_args(["--workload", "agent", "--mamba-sizes", "6"]).mamba_sizes, [6])


@requires_sglang
class AgentHitsTest(unittest.TestCase):
    """Pools that evict nothing: exact hits per shape with this cache's prefix checkpoints."""

    def test_exact_hits_without_eviction(self):
        recs = agent_workload(2, agent_sessions=4, rag_queries=6, regen_prob=0.4)[:40]
        v = bench_hit_rate.VARIANTS["ours-branch-recompute"]
        res = run_hit_trace(v.factory(400_000, 3 * len(recs) + 8), recs, side=v.side)
        self.assertTrue(res.leak_ok, res.leak_details)
        seen, regens, steps = set(), 0, 0
        for r, hit in zip(recs, res.prefix_lens):
            if r.tokens in seen:  # a regeneration hits its prompt-end checkpoint
                self.assertEqual(hit, len(r.tokens) - 1, r.rid)
                regens += 1
            elif r.parent is not None:  # a step or follow-up hits the whole previous sequence
                p = recs[r.parent]
                self.assertEqual(hit, len(p.tokens) + len(p.output), r.rid)
                steps += 1
            seen.add(r.tokens)
        self.assertGreater(regens, 0)
        self.assertGreater(steps, 0)


@requires_sglang
class MainAgentTest(unittest.TestCase):
    def test_last_line_is_the_agent_workloads(self):
        """``--workload agent``: the table and summary lines are labelled ``agent`` and the
        last line compares at the last ``--mamba-sizes``, as :func:`run_config` measures."""
        names = ["upstream-nobuf", "upstream-xbuf", "ours-default", "ours-default-overlap", "upper-bound-lp"]
        argv = ["--workload", "agent", "--limit", "60", "--mamba-sizes", "12,6"]
        for n in names:
            argv += ["--only", n]
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = bench_hit_rate.main(argv)
        self.assertEqual(rc, 0)
        lines = out.getvalue().strip().splitlines()
        self.assertTrue(lines[0].startswith("agent workload: seed=0 tool_sets=4 "), lines[0])
        self.assertIn("requests=60 ", lines[0])
        self.assertIn("[agent] == SSM pool 6 slots", out.getvalue())
        results, _ = run_config(names, 200_000, 6, agent_workload(0)[:60])
        by = {r.name: r for r in results}
        ours = max(by["ours-default"].hit_rate, by["ours-default-overlap"].hit_rate)
        up = max(by["upstream-nobuf"].hit_rate, by["upstream-xbuf"].hit_rate)
        default, overlap = by["ours-default"].hit_rate, by["ours-default-overlap"].hit_rate
        self.assertEqual(
            lines[-1],
            f"hit_ratio={ours / up:.4f} oracle_ratio=nan upper_bound_ratio={ours / by['upper-bound-lp'].hit_rate:.4f} "
            f"bytes_hit_ratio={ours / up:.4f} default_hit_ratio={default / up:.4f} "
            f"default_overlap_points={100 * (default - overlap):.2f}",
        )
        self.assertTrue(any(l.startswith("agent mamba_size=6 against upstream best of all") for l in lines))
        self.assertFalse(any(l.startswith("chat") or l.startswith("[chat]") for l in lines))


if __name__ == "__main__":
    unittest.main()
