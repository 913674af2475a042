"""Tests of the defaults serving benchmark (``sglang_mamba_ext.benchmarks.serving_defaults``)
without a server: its argument parsing (sides, workloads, refusals with exit status 2), the
bench_serving command lines, and the per-pass records, summaries, per-round ratios and last
line computed from made-up bench_serving results, with exact values.

The benchmark itself (servers + bench_serving) is run by hand; it takes tens of minutes on
the 2-core machine.
"""

from __future__ import annotations

import contextlib
import io
import unittest

from sglang_mamba_ext.benchmarks import serving_defaults as sd

LRU = ["--enable-mamba-radix", "--radix-eviction-policy", "lru"]


def _parse(*argv):
    return sd.parse_args(list(argv))


def _result(out_tok_s, tpot_ms, prompt, cached, completed=48, duration=4.0, ttft_ms=20.0):
    """A bench_serving JSON line with the fields the benchmark reads."""
    return {
        "completed": completed,
        "duration": duration,
        "total_output_tokens": int(out_tok_s * duration),
        "output_throughput": out_tok_s,
        "mean_ttft_ms": ttft_ms,
        "mean_tpot_ms": tpot_ms,
        "cache_report": {"total_prompt_tokens": prompt, "total_cached_tokens": cached, "cache_hit_rate_pct": 0.0},
    }


def _rec(*a, **k):
    return sd.pass_record(_result(*a, **k))


class ParseArgsTest(unittest.TestCase):
    def test_defaults(self):
        a = _parse()
        self.assertEqual(a.sides, [("old-default", LRU), ("new-default", ["--enable-mamba-radix"])])
        self.assertEqual(a.workloads, ["shared-prefix", "no-reuse"])
        self.assertEqual((a.rounds, a.concurrency, a.seed), (2, 4, 42))
        self.assertEqual(
            (a.gsp_num_groups, a.gsp_prompts_per_group, a.gsp_num_turns, a.gsp_system_prompt_len,
             a.gsp_question_len, a.gsp_output_len),
            (4, 4, 3, 1536, 64, 16))
        self.assertEqual((a.noreuse_prompts, a.noreuse_input_len, a.noreuse_output_len), (32, 320, 16))
        self.assertEqual(sd.phases(a.sides), [("old-default-vs-new-default", ("old-default", "new-default"))])
        self.assertNotIn("--disable-overlap-schedule", sd.COMMON_FLAGS)

    def test_with_no_overlap_adds_a_phase_against_the_new_default(self):
        a = _parse("--with-no-overlap", "--rounds", "3")
        self.assertEqual(a.rounds, 3)
        self.assertEqual(a.sides[-1], ("no-overlap", ["--enable-mamba-radix", "--disable-overlap-schedule"]))
        self.assertEqual(sd.phases(a.sides), [
            ("old-default-vs-new-default", ("old-default", "new-default")),
            ("new-default-vs-no-overlap", ("new-default", "no-overlap")),
        ])

    def test_sides_replace_the_defaults_and_workloads_choose(self):
        a = _parse("--side", "a=--enable-mamba-radix --radix-eviction-policy 'lru'",
                   "--side", "b=--enable-mamba-radix", "--side", "c=", "--workloads", "no-reuse")
        self.assertEqual(a.sides, [("a", LRU), ("b", ["--enable-mamba-radix"]), ("c", [])])
        self.assertEqual(a.workloads, ["no-reuse"])
        self.assertEqual([p for _, p in sd.phases(a.sides)], [("a", "b"), ("b", "c")])
        # order of --workloads does not matter: always shared-prefix first
        self.assertEqual(_parse("--workloads", "no-reuse,shared-prefix").workloads, ["shared-prefix", "no-reuse"])

    def test_bad_arguments_exit_2(self):
        for argv in (
            ["--side", "only=--enable-mamba-radix"],
            ["--side", "x=--a", "--side", "x=--b"],
            ["--side", "no-equals-sign"],
            ["--side", "bad name=--a", "--side", "b=--b"],
            ["--side", "no-overlap=--a", "--side", "b=--b", "--with-no-overlap"],
            ["--workloads", "multi-turn"],
            ["--workloads", "no-reuse,no-reuse"],
            ["--workloads", ""],
            ["--rounds", "0"],
            ["--concurrency", "0"],
            ["--gsp-output-len", "1"],
            ["--noreuse-prompts", "0"],
            ["--bench-timeout", "0"],
            ["--bench-timeout", "nan"],
            ["--extra-flags", '"unterminated'],
            ["--work-dir", __file__],  # a file, not a directory
        ):
            err = io.StringIO()
            with self.assertRaises(SystemExit) as cm, contextlib.redirect_stderr(err):
                sd.parse_args(argv)
            self.assertEqual(cm.exception.code, 2, argv)
            self.assertIn("error:", err.getvalue(), argv)

    def test_parse_side(self):
        self.assertEqual(sd.parse_side("n=--x 1 --y"), ("n", ["--x", "1", "--y"]))
        with self.assertRaises(ValueError):
            sd.parse_side("=--x")


class CommandTest(unittest.TestCase):
    def test_bench_commands(self):
        a = _parse()
        cmd = sd.bench_command("shared-prefix", a, 12345, "/m", "/w/x.jsonl", 42)
        self.assertEqual(cmd[1:3], ["-m", "sglang.bench_serving"])
        text = " ".join(cmd[3:])
        for part in ("--backend sglang-oai-chat", "--host 127.0.0.1 --port 12345", "--tokenizer /m",
                     "--dataset-name generated-shared-prefix", "--gsp-num-groups 4", "--gsp-prompts-per-group 4",
                     "--gsp-num-turns 3", "--gsp-system-prompt-len 1536", "--gsp-question-len 64",
                     "--gsp-output-len 16", "--max-concurrency 4", "--seed 42", "--cache-report",
                     "--flush-cache", "--output-file /w/x.jsonl"):
            self.assertIn(part, text)
        cmd = sd.bench_command("no-reuse", a, 1, "/m", "/w/y.jsonl", 43)
        text = " ".join(cmd[3:])
        for part in ("--backend sglang ", "--dataset-name random-ids", "--tokenize-prompt", "--num-prompts 32",
                     "--random-input-len 320", "--random-output-len 16", "--random-range-ratio 1", "--seed 43",
                     "--cache-report"):
            self.assertIn(part, text)
        self.assertEqual(sd.expected_requests("shared-prefix", a), 48)
        self.assertEqual(sd.expected_requests("no-reuse", a), 32)

    def test_fit_system_prompt_len(self):
        self.assertEqual(sd.fit_system_prompt_len(4096, 1536, 64, 16, 3), 1536)  # 2*(1536+224)+64 = 3584
        self.assertEqual(sd.fit_system_prompt_len(2048, 1536, 64, 16, 3), 768)   # 2*(768+224)+64 = 2048
        with self.assertRaises(ValueError):
            sd.fit_system_prompt_len(256, 1536, 64, 16, 3)

    def test_eviction_policy_and_first_tokens(self):
        line = ("[2025-01-01 00:00:00] sglang-mamba-ext: mamba_radix_ext tree cache (page_size=1, finish_state=True, "
                "ping-pong tracking on, track interval 256, checkpoint grid 64, eviction adaptive)\n")
        self.assertEqual(sd.eviction_policy("x\n" + line), "adaptive")
        self.assertIsNone(sd.eviction_policy("no such line"))
        self.assertTrue(sd.distinct_first_tokens([[1, 2], [2, 2], [3]]))
        self.assertFalse(sd.distinct_first_tokens([[1, 2], [2, 2], [1, 3]]))


class SummaryTest(unittest.TestCase):
    def test_pass_record(self):
        rec = _rec(125.0, 6.5, 4000, 3500, completed=48, duration=2.0, ttft_ms=30.0)
        self.assertEqual(rec, {"completed": 48, "duration_s": 2.0, "out_tokens": 250, "out_tok_s": 125.0,
                               "ttft_ms": 30.0, "tpot_ms": 6.5, "prompt": 4000, "cached": 3500, "computed": 500})
        with self.assertRaises(KeyError):
            sd.pass_record({k: v for k, v in _result(1.0, 1.0, 1, 0).items() if k != "cache_report"})

    def test_summarize_weights_means_by_requests(self):
        s = sd.summarize([_rec(100.0, 6.0, 1000, 600, completed=3, duration=3.0, ttft_ms=10.0),
                          _rec(100.0, 10.0, 500, 100, completed=1, duration=1.0, ttft_ms=30.0)])
        self.assertEqual(s, {"passes": 2, "completed": 4, "duration_s": 4.0, "out_tokens": 400, "out_tok_s": 100.0,
                             "ttft_ms": 15.0, "tpot_ms": 7.0, "prompt": 1500, "cached": 700, "computed": 800})

    def _runs(self, with_no_overlap):
        old = {"shared-prefix": [_rec(100.0, 8.0, 4000, 3000), _rec(80.0, 10.0, 4000, 3000)],
               "no-reuse": [_rec(50.0, 10.0, 10240, 0, completed=32), _rec(40.0, 10.0, 10240, 0, completed=32)]}
        new = {"shared-prefix": [_rec(125.0, 6.0, 4000, 3500), _rec(90.0, 10.0, 4000, 3500)],
               "no-reuse": [_rec(40.0, 12.5, 10240, 0, completed=32), _rec(50.0, 10.0, 10240, 0, completed=32)]}
        runs = {"old-default-vs-new-default": {"old-default": old, "new-default": new}}
        if with_no_overlap:
            new2 = {"shared-prefix": [_rec(100.0, 8.0, 4000, 3500)] * 2, "no-reuse": []}
            none = {"shared-prefix": [_rec(100.0, 8.0, 4000, 3600)] * 2, "no-reuse": []}
            runs["new-default-vs-no-overlap"] = {"new-default": new2, "no-overlap": none}
        return runs

    def test_round_ratios(self):
        runs = self._runs(False)["old-default-vs-new-default"]
        new, old = runs["new-default"]["shared-prefix"], runs["old-default"]["shared-prefix"]
        self.assertEqual(sd.round_ratios(new, old, "out_tok_s"), [1.25, 1.125])
        self.assertEqual(sd.round_ratios(new, old, "tpot_ms"), [0.75, 1.0])
        self.assertEqual(sd.round_ratios(new, old, "computed"), [0.5, 0.5])
        (nan,) = sd.round_ratios([_rec(1.0, 1.0, 0, 0)], [_rec(1.0, 1.0, 0, 0)], "computed")
        self.assertNotEqual(nan, nan)  # 0/0 is NaN, not an error

    def test_last_line(self):
        sides = _parse().sides
        fields = sd.last_line_fields(self._runs(False), sides, ["shared-prefix", "no-reuse"])
        want = {
            "shared_prefix_prefill_ratio": 0.5,       # (500+500)/(1000+1000)
            "shared_prefix_throughput_ratio": 1.1875,  # median(1.25, 1.125)
            "shared_prefix_tpot_ratio": 0.875,        # median(0.75, 1.0)
            "noreuse_throughput_ratio": 1.025,        # median(0.8, 1.25)
            "noreuse_tpot_ratio": 1.125,              # median(1.25, 1.0)
        }
        self.assertEqual(list(fields), list(want))
        for key, value in want.items():
            self.assertAlmostEqual(fields[key], value, places=12, msg=key)
        self.assertEqual(
            sd.format_fields(fields),
            "shared_prefix_prefill_ratio=0.500 shared_prefix_throughput_ratio=1.188 shared_prefix_tpot_ratio=0.875 "
            "noreuse_throughput_ratio=1.025 noreuse_tpot_ratio=1.125")

    def test_last_line_with_no_overlap(self):
        sides = _parse("--with-no-overlap").sides
        fields = sd.last_line_fields(self._runs(True), sides, ["shared-prefix", "no-reuse"])
        self.assertEqual(list(fields)[-1], "overlap_prefill_ratio")
        self.assertEqual(fields["overlap_prefill_ratio"], 1.25)  # 1000 / 800
        self.assertEqual(fields["shared_prefix_prefill_ratio"], 0.5)

    def test_last_line_leaves_out_a_workload_not_run(self):
        sides = _parse().sides
        runs = self._runs(False)
        fields = sd.last_line_fields(runs, sides, ["no-reuse"])
        self.assertEqual(list(fields), ["noreuse_throughput_ratio", "noreuse_tpot_ratio"])


if __name__ == "__main__":
    unittest.main()
