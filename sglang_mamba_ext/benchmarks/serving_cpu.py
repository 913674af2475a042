"""Serving benchmark on CPU: the tiny hybrid model served by SGLang with this plugin's cache
(``--enable-mamba-radix``), with SGLang's own cache for hybrid models (its mamba radix cache,
``--mamba-radix-cache-strategy no_buffer``, the strategy it serves on CPU) and with no prefix
cache (``--disable-radix-cache``, the reference), on two workloads, in alternating rounds.

Workloads (the same requests for every side and round):

- ``multi-turn``: ``--users`` conversations over the example system prompts
  (``examples/system_prompts.json``; several users share each one), ``--turns`` turns each,
  interleaved across users as a server sees them; every follow-up turn extends the previous
  one (system + user + assistant reply + next user message), rendered with the model's chat
  template. Prefixes are shared, so a prefix cache can save prefill.
- ``no-reuse``: ``--users * --turns`` prompts of ``--noreuse-tokens`` random token ids, each
  starting with a different token, so no two share even one token: the cache can only cost.

Rounds, in two phases: first this plugin's server and SGLang's (``vs-sglang``), then this
plugin's and the no-cache one (``vs-no-cache``; SGLang's server is stopped first, so at most
two servers are alive, started one at a time; the plugin's stays up for both phases). A
phase runs ``--rounds`` rounds; round r sends each workload to the phase's two servers in the
order A B when r is even and B A when r is odd, each pass after ``/flush_cache``, so every pass
starts from an empty cache and drift in the machine's load falls on both sides alike (passes
of a few seconds apart, not minutes). Each server gets one unmeasured warm-up request after
start-up. All servers get ``--device cpu --disable-overlap-schedule --sleep-on-idle`` (the
plugin turns overlap off on CPU and SGLang's ``no_buffer`` needs it off; without
``--sleep-on-idle`` SGLang's idle scheduler polls without sleeping and takes a whole core from
the server being measured) and the plugin's CPU defaults for the tiny model;
``--extra-flags`` adds flags to all of them.

Requests are greedy (``ignore_eos``, ``--max-new-tokens``) and streamed to ``/generate``.
With ``--concurrency 1`` (default) they are sent one at a time, so the time to first token
(TTFT) has no queueing in it; with ``--concurrency N`` N client threads send each turn's
requests at once (turn by turn, so a conversation's next turn still follows its reply).

Prints each pass as it ends, then per phase, side and workload over all rounds: output
tokens/s and requests/s (over the passes' wall time), mean and p95 TTFT, mean TPOT (time per
output token after the first), prefill tokens computed (prompt tokens minus
``meta_info.cached_tokens``), whether the greedy outputs equal those of the plugin's first
pass, and the per-round throughput ratios. The last line is

    prefill_tokens_saved=<1 - computed(plugin)/computed(no-cache)> ttft_ratio=<TTFT plugin/no-cache>
    vs_sglang_throughput=<out tok/s plugin/SGLang> vs_sglang_ttft=<TTFT plugin/SGLang>
    vs_sglang_prefill=<computed plugin/SGLang> noreuse_throughput=<plugin/SGLang, no-reuse>
    noreuse_tpot=<TPOT plugin/SGLang, no-reuse>

on one line: the first two from ``vs-no-cache`` on ``multi-turn``, the next three from
``vs-sglang`` on ``multi-turn``, the last two from ``vs-sglang`` on ``no-reuse``; TTFT and
TPOT are means over all requests of all rounds, throughput is total output tokens over total
wall time.

Usage (``scripts/bench_serving_cpu.py`` takes the same arguments):
    python -m sglang_mamba_ext.benchmarks.serving_cpu         # builds .tiny_model if needed
    python -m sglang_mamba_ext.benchmarks.serving_cpu --rounds 2 --concurrency 4

Exit status: 0 on success, 1 when a server fails or the outputs differ, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from sglang_mamba_ext.benchmarks.common import REPO_ROOT as REPO
from sglang_mamba_ext.testing.server import ServerProcess, tiny_model_dir

USER_TURNS = [
    "I have a question about {topic}. Can you help?",
    "Thanks. Could you give me more detail on the second point about {topic}?",
    "One more thing about {topic}: what would you recommend for a beginner?",
    "Please summarise everything you told me about {topic} in three bullet points.",
]
TOPICS = ["returns", "sizes", "shipping", "loops", "testing", "typing", "museums", "food", "weather", "trains"]

#: (label, launch flags): this plugin's cache, SGLang's own, none.
SIDES = (
    ("mamba-radix", ["--enable-mamba-radix"]),
    ("sglang-cache", ["--mamba-radix-cache-strategy", "no_buffer"]),
    ("no-cache", ["--disable-radix-cache"]),
)
COMMON_FLAGS = ["--device", "cpu", "--disable-overlap-schedule", "--sleep-on-idle"]
WORKLOADS = ("multi-turn", "no-reuse")
#: First token id of the no-reuse prompts (ids below are the tokenizer's special tokens).
NOREUSE_FIRST_ID = 5


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="model dir (default: build/reuse .tiny_model)")
    p.add_argument("--users", type=int, default=12)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per phase (default 2: A B, B A)")
    p.add_argument("--concurrency", type=int, default=1, help="client threads sending at once (default 1)")
    p.add_argument("--noreuse-tokens", type=int, default=320, help="prompt length of the no-reuse workload")
    p.add_argument("--seed", type=int, default=0, help="seed of the no-reuse prompts")
    p.add_argument("--system-prompts", default=os.path.join(REPO, "examples", "system_prompts.json"))
    p.add_argument("--extra-flags", default="", help="extra launch flags for every server")
    args = p.parse_args(argv)
    if args.users < 1 or not 1 <= args.turns <= len(USER_TURNS):
        p.error(f"--users must be >= 1 and --turns in [1, {len(USER_TURNS)}]")
    if args.max_new_tokens < 2:
        p.error("--max-new-tokens must be >= 2 (TPOT needs a second token)")
    if args.rounds < 1 or args.concurrency < 1:
        p.error("--rounds and --concurrency must be >= 1")
    if args.noreuse_tokens < 1:
        p.error("--noreuse-tokens must be >= 1")
    return args


def noreuse_prompts(n: int, length: int, seed: int, vocab: int):
    """``n`` prompts of ``length`` random token ids in ``[NOREUSE_FIRST_ID, vocab)``; prompt i
    starts with a token no other prompt starts with (so a radix tree matches nothing)."""
    span = vocab - NOREUSE_FIRST_ID
    if n > span:
        raise ValueError(f"{n} no-reuse prompts need distinct first tokens, the vocabulary has {span}")
    rng = random.Random(seed)
    return [[NOREUSE_FIRST_ID + i] + [rng.randrange(NOREUSE_FIRST_ID, vocab) for _ in range(length - 1)] for i in range(n)]


def send(base_url: str, body: dict) -> dict:
    """One streamed greedy ``/generate``; returns prompt/cached/completion tokens, TTFT,
    latency (s) and the output text."""
    import requests

    payload = dict(body, stream=True)
    t0 = time.perf_counter()
    ttft = None
    last = None
    with requests.post(base_url + "/generate", json=payload, stream=True, timeout=600) as r:
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
    latency = time.perf_counter() - t0
    if last is None:
        raise RuntimeError("empty stream from /generate")
    meta = last["meta_info"]
    return {
        "prompt": int(meta["prompt_tokens"]),
        "cached": int(meta.get("cached_tokens", 0) or 0),
        "out": int(meta["completion_tokens"]),
        "ttft": ttft,
        "latency": latency,
        "text": last["text"],
    }


def flush(base_url: str) -> None:
    import requests

    for _ in range(30):  # refused while requests are still running
        r = requests.post(base_url + "/flush_cache", timeout=60)
        if r.status_code == 200:
            return
        time.sleep(1)
    r.raise_for_status()


def _run_turns(base_url, bodies_by_turn, concurrency, on_done):
    """Sends each turn's bodies (a list per turn; a body may be a callable building it just
    before sending) with ``concurrency`` threads, turn after turn. Returns (records in send
    order, wall seconds)."""
    records = []
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        for bodies in bodies_by_turn:
            def one(i, _bodies=bodies):
                b = _bodies[i]
                rec = send(base_url, b() if callable(b) else b)
                on_done(i, rec)
                return rec

            if concurrency == 1:
                records.extend(one(i) for i in range(len(bodies)))
            else:
                records.extend(ex.map(one, range(len(bodies))))
    return records, time.perf_counter() - t0


def run_multi_turn(base_url, tok, systems, args):
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    histories = [[{"role": "system", "content": systems[u % len(systems)]}] for u in range(args.users)]
    lock = threading.Lock()

    def body(u, turn):
        def build():
            with lock:
                topic = TOPICS[u % len(TOPICS)]
                histories[u].append({"role": "user", "content": USER_TURNS[turn].format(topic=topic)})
                text = tok.apply_chat_template(histories[u], tokenize=False, add_generation_prompt=True)
            return {"text": text, "sampling_params": sampling}

        return build

    def on_done(u, rec):
        with lock:
            histories[u].append({"role": "assistant", "content": rec["text"]})

    turns = [[body(u, t) for u in range(args.users)] for t in range(args.turns)]
    return _run_turns(base_url, turns, args.concurrency, on_done)


def run_no_reuse(base_url, prompts, args):
    sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 0, "ignore_eos": True}
    bodies = [{"input_ids": ids, "sampling_params": sampling} for ids in prompts]
    # Grouped like the multi-turn workload (``--users`` at a time), so concurrency sees
    # batches of the same size.
    turns = [bodies[i:i + args.users] for i in range(0, len(bodies), args.users)]
    return _run_turns(base_url, turns, args.concurrency, lambda i, rec: None)


def summarize(runs):
    """``runs``: list of (records, wall_s). Totals and means over all of them."""
    recs = [r for records, _ in runs for r in records]
    wall = sum(w for _, w in runs)
    prompt = sum(r["prompt"] for r in recs)
    cached = sum(r["cached"] for r in recs)
    out = sum(r["out"] for r in recs)
    ttfts = [r["ttft"] for r in recs]
    tpots = [(r["latency"] - r["ttft"]) / (r["out"] - 1) for r in recs if r["out"] > 1]
    return {
        "requests": len(recs),
        "prompt": prompt,
        "cached": cached,
        "computed": prompt - cached,
        "out": out,
        "wall": wall,
        "tok_s": out / wall if wall > 0 else float("nan"),
        "req_s": len(recs) / wall if wall > 0 else float("nan"),
        "ttft_mean": statistics.mean(ttfts),
        "ttft_p95": p95(ttfts),
        "tpot_mean": statistics.mean(tpots) if tpots else float("nan"),
    }


def format_summary(s) -> str:
    return (
        f"requests={s['requests']} out_tok_s={s['tok_s']:.1f} req_s={s['req_s']:.2f} "
        f"ttft_mean={1000 * s['ttft_mean']:.1f}ms ttft_p95={1000 * s['ttft_p95']:.1f}ms "
        f"tpot_mean={1000 * s['tpot_mean']:.1f}ms prompt_tokens={s['prompt']} cached_tokens={s['cached']} "
        f"prefill_tokens_computed={s['computed']}"
    )


def p95(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.95 * (len(xs) - 1))))]


def _ratio(a, b) -> float:
    return a / b if b else float("nan")


class _Side:
    """A started server of one side, kept up across the rounds of its phase."""

    def __init__(self, label, server):
        self.label, self.server = label, server


def _start(server_factory, model, label, flags, extra, warm_ids):
    server = server_factory(model, [*COMMON_FLAGS, *flags, *extra])
    try:
        server.start()
        print(f"[{label}] server up in {server.startup_s:.0f} s (log {server.log_path})", flush=True)
        send(server.base_url, {"input_ids": warm_ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    except BaseException:
        server.stop()
        raise
    return _Side(label, server)


def run_phase(name, sides, args, tok, systems, prompts, runs):
    """Alternating rounds of one pair of started sides: round r runs each workload on the
    sides in order when r is even and reversed when r is odd (A B, B A, ...), each pass after
    ``/flush_cache``. Appends (records, wall_s) to ``runs[name][label][workload]``."""
    for rnd in range(args.rounds):
        order = sides if rnd % 2 == 0 else list(reversed(sides))
        for w in WORKLOADS:
            for side in order:
                url = side.server.base_url
                flush(url)
                result = run_multi_turn(url, tok, systems, args) if w == "multi-turn" else run_no_reuse(url, prompts, args)
                runs[name][side.label][w].append(result)
                print(f"[{name} round {rnd} {side.label} {w}] {format_summary(summarize([result]))}", flush=True)


def main(argv=None, server_factory=None) -> int:
    """``server_factory(model, flags)`` builds the server object (default
    :class:`ServerProcess`; tests pass a fake with ``start``/``stop``/``base_url``)."""
    args = parse_args(argv if argv is not None else sys.argv[1:])
    import transformers
    from transformers import AutoTokenizer

    transformers.logging.set_verbosity_error()
    model = args.model_path or tiny_model_dir()
    tok = AutoTokenizer.from_pretrained(model)
    with open(args.system_prompts) as f:
        systems = json.load(f)
    try:
        prompts = noreuse_prompts(args.users * args.turns, args.noreuse_tokens, args.seed, len(tok))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    server_factory = server_factory or ServerProcess
    extra = args.extra_flags.split()
    flags = dict(SIDES)
    ours, theirs, none = (label for label, _ in SIDES)
    phases = (("vs-sglang", (ours, theirs)), ("vs-no-cache", (ours, none)))
    # runs[phase][label][workload] = [(records, wall_s) per round]
    runs = {name: {label: {w: [] for w in WORKLOADS} for label in pair} for name, pair in phases}
    print(
        f"rounds={args.rounds} concurrency={args.concurrency} users={args.users} turns={args.turns} "
        f"max_new_tokens={args.max_new_tokens} noreuse_tokens={args.noreuse_tokens}",
        flush=True,
    )
    started = {}
    try:
        for name, pair in phases:
            for label in list(started):  # at most two servers alive, started one at a time
                if label not in pair:
                    started.pop(label).server.stop()
            for label in pair:
                if label not in started:
                    started[label] = _start(server_factory, model, label, flags[label], extra, prompts[0][:8])
            run_phase(name, [started[label] for label in pair], args, tok, systems, prompts, runs)
    except Exception as e:  # noqa: BLE001 - report and fail the run
        print(f"failed: {e!r}")
        return 1
    finally:
        for side in started.values():
            side.server.stop()
    reference = {w: [r["text"] for r in runs["vs-sglang"][ours][w][0][0]] for w in WORKLOADS}
    all_same = True
    summary = {}
    for name, pair in phases:
        print(f"{name}, over {args.rounds} rounds:")
        for w in WORKLOADS:
            for label in pair:
                per_round = runs[name][label][w]
                summary[name, label, w] = summarize(per_round)
                same = all([r["text"] for r in records] == reference[w] for records, _ in per_round)
                all_same &= same
                print(f"[{name} {label} {w}] {format_summary(summary[name, label, w])} same_outputs={same}")
            a, b = (runs[name][label][w] for label in pair)
            tput = " ".join(f"{_ratio(summarize([x])['tok_s'], summarize([y])['tok_s']):.3f}" for x, y in zip(a, b))
            print(f"[{name} {w}] out tok/s {pair[0]}/{pair[1]} per round: {tput}")
    print(f"greedy outputs identical across sides and rounds: {all_same}")

    def get(name, label, w, key):
        return summary[name, label, w][key]

    fields = {
        "prefill_tokens_saved": 1 - _ratio(get("vs-no-cache", ours, "multi-turn", "computed"),
                                           max(get("vs-no-cache", none, "multi-turn", "computed"), 1)),
        "ttft_ratio": _ratio(get("vs-no-cache", ours, "multi-turn", "ttft_mean"), get("vs-no-cache", none, "multi-turn", "ttft_mean")),
    }
    for key, w, metric in (
        ("vs_sglang_throughput", "multi-turn", "tok_s"),
        ("vs_sglang_ttft", "multi-turn", "ttft_mean"),
        ("vs_sglang_prefill", "multi-turn", "computed"),
        ("noreuse_throughput", "no-reuse", "tok_s"),
        ("noreuse_tpot", "no-reuse", "tpot_mean"),
    ):
        fields[key] = _ratio(get("vs-sglang", ours, w, metric), get("vs-sglang", theirs, w, metric))
    print(" ".join(f"{k}={v:.3f}" for k, v in fields.items()))
    return 0 if all_same else 1

if __name__ == "__main__":
    sys.exit(main())
