"""Serving benchmark on CPU: the same multi-turn chat workload against SGLang serving the
tiny hybrid model with this plugin's cache (``--enable-mamba-radix``) and with no prefix
cache (``--disable-radix-cache``), one server after the other in one run.

Workload: ``--users`` conversations over the example system prompts
(``examples/system_prompts.json``; several users share each one), ``--turns`` turns each,
interleaved across users as a server sees them; every follow-up turn extends the previous
one (system + user + assistant reply + next user message), rendered with the model's chat
template. Requests are sent one at a time with greedy sampling and streamed, so the time to
first token (TTFT) is measured without queueing.

Prints, for each server: prefill tokens computed (prompt tokens minus
``meta_info.cached_tokens``), mean and p95 TTFT, and whether the greedy outputs of the two
runs are token-identical; the last line is

    prefill_tokens_saved=<1 - computed(cached)/computed(uncached)> ttft_ratio=<mean TTFT cached / uncached>

Usage (``scripts/bench_serving_cpu.py`` takes the same arguments):
    python -m sglang_mamba_ext.benchmarks.serving_cpu         # builds .tiny_model if needed
    python -m sglang_mamba_ext.benchmarks.serving_cpu --users 12 --turns 3 --max-new-tokens 16

Exit status: 0 on success, 1 when a server fails or the outputs differ, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from sglang_mamba_ext.benchmarks.common import REPO_ROOT as REPO
from sglang_mamba_ext.testing.server import ServerProcess, tiny_model_dir

USER_TURNS = [
    "I have a question about {topic}. Can you help?",
    "Thanks. Could you give me more detail on the second point about {topic}?",
    "One more thing about {topic}: what would you recommend for a beginner?",
    "Please summarise everything you told me about {topic} in three bullet points.",
]
TOPICS = ["returns", "sizes", "shipping", "loops", "testing", "typing", "museums", "food", "weather", "trains"]


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="model dir (default: build/reuse .tiny_model)")
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--system-prompts", default=os.path.join(REPO, "examples", "system_prompts.json"))
    p.add_argument("--extra-flags", default="", help="extra launch flags for both servers")
    args = p.parse_args(argv)
    if args.users < 1 or not 1 <= args.turns <= len(USER_TURNS):
        p.error(f"--users must be >= 1 and --turns in [1, {len(USER_TURNS)}]")
    return args


def run_workload(server: ServerProcess, tok, systems, args):
    """Returns per-request records (prompt, cached, ttft_s, output text)."""
    import requests

    histories = [[{"role": "system", "content": systems[u % len(systems)]}] for u in range(args.users)]
    records = []
    for turn in range(args.turns):
        for u in range(args.users):
            topic = TOPICS[u % len(TOPICS)]
            histories[u].append({"role": "user", "content": USER_TURNS[turn].format(topic=topic)})
            text = tok.apply_chat_template(histories[u], tokenize=False, add_generation_prompt=True)
            payload = {
                "text": text,
                "sampling_params": {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True},
                "stream": True,
            }
            t0 = time.perf_counter()
            ttft = None
            last = None
            with requests.post(server.base_url + "/generate", json=payload, stream=True, timeout=300) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if not line or not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    last = json.loads(data)
            meta = last["meta_info"]
            histories[u].append({"role": "assistant", "content": last["text"]})
            records.append((int(meta["prompt_tokens"]), int(meta.get("cached_tokens", 0)), ttft, last["text"]))
    return records


def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def main(argv=None) -> int:
    args = parse_args(argv if argv is not None else sys.argv[1:])
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    model = args.model_path or tiny_model_dir()
    tok = AutoTokenizer.from_pretrained(model)
    with open(args.system_prompts) as f:
        systems = json.load(f)
    extra = args.extra_flags.split()
    runs = {}
    for label, flags in (("mamba-radix", ["--enable-mamba-radix"]), ("no-cache", ["--disable-radix-cache"])):
        server = ServerProcess(model, ["--device", "cpu", *flags, *extra])
        try:
            server.start()
            print(f"[{label}] server up in {server.startup_s:.0f} s (log {server.log_path})", flush=True)
            runs[label] = run_workload(server, tok, systems, args)
        except Exception as e:  # noqa: BLE001 - report and fail the run
            print(f"[{label}] failed: {e}")
            return 1
        finally:
            server.stop()
    computed, ttft_mean = {}, {}
    for label, recs in runs.items():
        prompt = sum(r[0] for r in recs)
        cached = sum(r[1] for r in recs)
        computed[label] = prompt - cached
        ttfts = [r[2] for r in recs]
        ttft_mean[label] = statistics.mean(ttfts)
        print(
            f"[{label}] requests={len(recs)} prompt_tokens={prompt} cached_tokens={cached} "
            f"prefill_tokens_computed={prompt - cached} ttft_mean={1000 * statistics.mean(ttfts):.1f}ms "
            f"ttft_p95={1000 * p95(ttfts):.1f}ms"
        )
    same = [a[3] for a in runs["mamba-radix"]] == [b[3] for b in runs["no-cache"]]
    print(f"greedy outputs identical across the two servers: {same}")
    saved = 1 - computed["mamba-radix"] / max(computed["no-cache"], 1)
    ratio = ttft_mean["mamba-radix"] / ttft_mean["no-cache"]
    print(f"prefill_tokens_saved={saved:.3f} ttft_ratio={ratio:.3f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
