"""Tests of the serving benchmark (``sglang_mamba_ext.benchmarks.serving_cpu``) without
SGLang: its ``main`` drives in-process fake servers (a streaming ``/generate`` and
``/flush_cache`` over HTTP, with a prefix cache per flag set), so the workloads, the
the two phases of alternating rounds, the flush before every pass, the per-side numbers and the last line are
checked in a few seconds. Arguments it refuses exit 2 with argparse's ``error:``.

The benchmark against real servers is run by hand (docs/benchmarks.md); it starts three
servers (about 3 minutes with the passes), too long for the suite.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import threading
import time
import unittest
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from conftest import tiny_model_dir

from sglang_mamba_ext.benchmarks import serving_cpu


class FakeServer:
    """Stands in for ``ServerProcess``: answers ``/generate`` (streamed, greedy-like: the
    output depends only on the prompt) and ``/flush_cache``. ``cached_tokens`` is the longest
    prefix shared with an earlier prompt since the last flush, times ``HIT_SHARE`` of the
    side the flags name (0 for ``--disable-radix-cache``). Records every launch and request."""

    launches: list = []
    HIT_SHARE = {"--enable-mamba-radix": 1.0, "no_buffer": 0.5, "--disable-radix-cache": 0.0}
    DIVERGE = None  # a flag whose side answers differently (to test the equality check)

    def __init__(self, model, flags):
        self.flags = list(flags)
        self.side = next(k for k in self.HIT_SHARE if k in self.flags)
        self.share = self.HIT_SHARE[self.side]
        self.started_at = self.stopped_at = None
        self.seen: list = []
        self.events: list = []
        self.log_path = "(fake)"
        self.startup_s = 0.0
        FakeServer.launches.append(self)

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path == "/flush_cache":
                    fake.seen.clear()
                    fake.events.append("flush")
                    self.send_response(200)
                    self.end_headers()
                    return
                prompt = body.get("input_ids") or [ord(c) for c in body["text"]]
                fake.events.append(("input_ids" if "input_ids" in body else "text", len(prompt)))
                shared = max((len(os.path.commonprefix([prompt, p])) for p in fake.seen), default=0)
                fake.seen.append(prompt)
                n = body["sampling_params"]["max_new_tokens"]
                tag = "x" if fake.DIVERGE and fake.DIVERGE in fake.flags else ""
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for k in range(1, n + 1):
                    meta = {"prompt_tokens": len(prompt), "cached_tokens": int(shared * fake.share), "completion_tokens": k}
                    chunk = {"text": tag + "".join(chr(97 + (sum(prompt) + j) % 26) for j in range(k)), "meta_info": meta}
                    self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.write(b"data: [DONE]\n\n")

        return Handler

    def start(self):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.started_at = time.perf_counter()
        return self

    def stop(self):
        if self.stopped_at is None:
            self.httpd.shutdown()
            self.httpd.server_close()
            self.stopped_at = time.perf_counter()



def _run(*argv):
    FakeServer.launches = []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = serving_cpu.main(["--model-path", tiny_model_dir(), *argv], server_factory=FakeServer)
    return rc, out.getvalue()


def _last_fields(text):
    return {k: float(v) for k, v in re.findall(r"(\w+)=(\S+)", text.strip().splitlines()[-1])}


class ServingBenchmarkTest(unittest.TestCase):
    def tearDown(self):
        FakeServer.DIVERGE = None

    def test_rounds_alternate_and_each_side_runs_both_workloads(self):
        rc, text = _run("--rounds", "2", "--users", "3", "--turns", "2", "--max-new-tokens", "3", "--noreuse-tokens", "20")
        self.assertEqual(rc, 0, text)
        ours, theirs, none = FakeServer.launches
        self.assertEqual([s.side for s in FakeServer.launches], ["--enable-mamba-radix", "no_buffer", "--disable-radix-cache"])
        # SGLang's server is stopped before the no-cache one starts; the plugin's stays up
        self.assertLess(theirs.stopped_at, none.started_at)
        self.assertGreater(ours.stopped_at, none.started_at)
        for s in FakeServer.launches:
            self.assertIn("--disable-overlap-schedule", s.flags)
            self.assertIn("--sleep-on-idle", s.flags)
            self.assertEqual(s.events[0], ("input_ids", 8))  # warm-up
        # passes in order, each after a flush: 6 multi-turn requests (text), 6 no-reuse (ids)
        mt = ["flush"] + [("text", None)] * 6
        nr = ["flush"] + [("input_ids", 20)] * 6

        def shape(events):
            return [e if e == "flush" or e[0] == "input_ids" else ("text", None) for e in events]

        self.assertEqual(shape(ours.events[1:]), (mt + nr) * 4)
        self.assertEqual(shape(theirs.events[1:]), (mt + nr) * 2)
        self.assertEqual(shape(none.events[1:]), (mt + nr) * 2)
        passes = re.findall(r"^\[(vs-\S+) round (\d) (\S+) (\S+)\]", text, re.M)
        self.assertEqual(
            passes[:8],
            [("vs-sglang", "0", "mamba-radix", "multi-turn"), ("vs-sglang", "0", "sglang-cache", "multi-turn"),
             ("vs-sglang", "0", "mamba-radix", "no-reuse"), ("vs-sglang", "0", "sglang-cache", "no-reuse"),
             ("vs-sglang", "1", "sglang-cache", "multi-turn"), ("vs-sglang", "1", "mamba-radix", "multi-turn"),
             ("vs-sglang", "1", "sglang-cache", "no-reuse"), ("vs-sglang", "1", "mamba-radix", "no-reuse")],
        )
        self.assertEqual(len(passes), 16)
        for phase, pair in (("vs-sglang", ("mamba-radix", "sglang-cache")), ("vs-no-cache", ("mamba-radix", "no-cache"))):
            for label in pair:
                for w in serving_cpu.WORKLOADS:
                    self.assertRegex(
                        text, rf"\[{phase} {label} {w}\] requests=12 out_tok_s=\S+ req_s=\S+ ttft_mean=\S+ ttft_p95=\S+ "
                        rf"tpot_mean=\S+ prompt_tokens=\d+ cached_tokens=\d+ prefill_tokens_computed=\d+ same_outputs=True",
                    )
                self.assertRegex(text, rf"\[{phase} multi-turn\] out tok/s {pair[0]}/{pair[1]} per round: \S+ \S+\n")
        self.assertIn("greedy outputs identical across sides and rounds: True", text)
        fields = _last_fields(text)
        self.assertEqual(
            list(fields),
            ["prefill_tokens_saved", "ttft_ratio", "vs_sglang_throughput", "vs_sglang_ttft",
             "vs_sglang_prefill", "noreuse_throughput", "noreuse_tpot"],
        )
        self.assertGreater(fields["prefill_tokens_saved"], 0)
        self.assertLess(fields["vs_sglang_prefill"], 1)  # the fake plugin side caches more

    def test_no_reuse_prompts_share_no_token_prefix(self):
        prompts = serving_cpu.noreuse_prompts(40, 16, seed=0, vocab=768)
        self.assertEqual(len({p[0] for p in prompts}), 40)
        self.assertTrue(all(len(p) == 16 and min(p) >= serving_cpu.NOREUSE_FIRST_ID for p in prompts))
        self.assertEqual(prompts, serving_cpu.noreuse_prompts(40, 16, seed=0, vocab=768))
        rc, text = _run("--rounds", "1", "--users", "2", "--turns", "1", "--max-new-tokens", "2", "--noreuse-tokens", "9")
        self.assertEqual(rc, 0, text)
        self.assertRegex(text, r"\[vs-sglang mamba-radix no-reuse\] .*cached_tokens=0 prefill_tokens_computed=18 ")

    def test_concurrency_keeps_each_conversation_in_order(self):
        rc, text = _run("--rounds", "1", "--users", "4", "--turns", "3", "--max-new-tokens", "2", "--concurrency", "3")
        self.assertEqual(rc, 0, text)
        self.assertIn("concurrency=3", text)
        self.assertIn("greedy outputs identical across sides and rounds: True", text)

    def test_different_outputs_fail_the_run(self):
        FakeServer.DIVERGE = "no_buffer"
        rc, text = _run("--rounds", "1", "--users", "2", "--turns", "1", "--max-new-tokens", "2")
        self.assertEqual(rc, 1)
        self.assertRegex(text, r"\[vs-sglang sglang-cache multi-turn\] .* same_outputs=False")
        self.assertRegex(text, r"\[vs-no-cache no-cache multi-turn\] .* same_outputs=True")
        self.assertIn("identical across sides and rounds: False", text)

    def test_bad_arguments_exit_2(self):
        for argv in (["--rounds", "0"], ["--concurrency", "0"], ["--turns", "5"], ["--max-new-tokens", "1"],
                     ["--noreuse-tokens", "0"], ["--rounds", "x"]):
            with self.subTest(argv=argv):
                err = io.StringIO()
                with contextlib.redirect_stderr(err), self.assertRaises(SystemExit) as cm:
                    serving_cpu.parse_args(argv)
                self.assertEqual(cm.exception.code, 2)
                self.assertIn("error:", err.getvalue())
        # and through the command line, as a user sees it
        proc = subprocess.run(
            [sys.executable, "-m", "sglang_mamba_ext.benchmarks.serving_cpu", "--rounds", "0"],
            capture_output=True, text=True, timeout=120,
        )
        self.assertEqual(proc.returncode, 2, proc.stderr)
        self.assertIn("error: --rounds and --concurrency must be >= 1", proc.stderr)

if __name__ == "__main__":
    unittest.main()
