"""Serving benchmark of the plugin's defaults on CPU, measured with SGLang's own load generator:
the tiny hybrid model served with ``--enable-mamba-radix`` under two or more sets of flags
("sides"), each driven by ``python -m sglang.bench_serving`` (a subprocess per pass; its JSON
result line is read back), in alternating rounds.

Sides (``--side NAME='flags ...'``, repeatable, replaces the defaults; the first side is the
reference, the second the candidate):

- ``old-default``: ``--enable-mamba-radix --radix-eviction-policy lru``
- ``new-default``: ``--enable-mamba-radix`` alone (the plugin's default eviction policy)
- ``no-overlap`` (only with ``--with-no-overlap``): ``--enable-mamba-radix
  --disable-overlap-schedule``, to see what overlap scheduling costs or saves.

Every server also gets ``--device cpu --sleep-on-idle`` (and ``--extra-flags``); the plugin
adds its CPU defaults for the tiny model. Overlap scheduling stays at SGLang's default (on)
unless a side's flags turn it off. Each side's start-up log line ``sglang-mamba-ext:
mamba_radix_ext tree cache (... eviction NAME)`` is parsed and the policy printed.

Workloads (``--workloads``, both by default; the same requests for every side and round):

- ``shared-prefix``: bench_serving's ``generated-shared-prefix`` dataset, 4 groups x 4
  prompts x 3 turns (``--gsp-num-turns 3``): system prompts of 1536 tokens, questions of 64,
  outputs of 16, ``--max-concurrency 4``, through the chat endpoint (``--backend
  sglang-oai-chat``, ``/v1/chat/completions``: bench_serving replays multi-turn rows only on
  chat backends; every turn resends the conversation so far). The lengths are in the
  tokenizer's tokens of randomly drawn ids; decoded to text and re-tokenized by the server
  they grow (about 1.7x with the tiny model's byte-level tokenizer), so the system prompt is
  shrunk, with a note, if twice the longest conversation would not fit the model's
  ``max_position_embeddings``.
- ``no-reuse``: bench_serving's ``random-ids`` dataset sent as token ids (``--backend sglang``,
  ``/generate``, ``--tokenize-prompt``), 32 prompts of 320 tokens, outputs of 16,
  concurrency 4. (``random`` samples its text from ShareGPT, which it would download;
  ``random-ids`` is generated locally.) Its prompt i is a run of consecutive ids starting
  at a random offset + i; the bench_serving ``--seed`` used is the first from ``--seed`` whose
  prompts all start with different tokens (checked with bench_serving's own sampler), so no
  two share even one token of prefix.

Nothing is downloaded: the tokenizer is the model directory and ``HF_HUB_OFFLINE=1`` is set
for the servers and bench_serving.

Rounds: with two sides, one phase; every further side adds a phase of the second side
against it (the first side's server is stopped first: at most two servers are alive, started
one at a time). A phase runs ``--rounds`` rounds; round r sends each workload to the phase's
sides in order A B when r is even and B A when r is odd, each pass after a POST to
``/flush_cache`` (and bench_serving's one warm-up request is flushed again by its own
``--flush-cache``), so every measured pass starts with an empty cache. Each server gets one
unmeasured ``/generate`` request after start-up.

Numbers, per pass, from bench_serving's JSON line: ``output_throughput`` (output tok/s over
the pass), ``mean_ttft_ms``, ``mean_tpot_ms``, and its ``--cache-report``
(``cache_report.total_prompt_tokens`` and ``total_cached_tokens``: per request, the prompt
and cached token counts the server returned, ``usage.prompt_tokens`` and
``sglext.cached_tokens_details`` on the chat route, ``meta_info`` on ``/generate``). Prefill
tokens computed = prompt tokens - cached tokens. Warm-up requests are not in them.

Output: one line per pass as it ends; then per phase, workload and side over all rounds:
output tok/s (total output tokens / total pass time), mean TTFT and mean TPOT (ms, means over
all requests), prompt, cached and computed tokens; and per round the ratios second side /
first side. The last line (new-default over old-default, i.e. second side over first):

    shared_prefix_prefill_ratio=X shared_prefix_throughput_ratio=Y shared_prefix_tpot_ratio=Z
    noreuse_throughput_ratio=U noreuse_tpot_ratio=V [overlap_prefill_ratio=W]

on one line. Prefill ratios are of totals over all rounds (below 1: the new side computes
fewer prefill tokens); throughput and TPOT ratios are medians of the per-round ratios (above
1 is faster for throughput, below 1 faster for TPOT). ``overlap_prefill_ratio`` (with
``--with-no-overlap``) is the new side's shared-prefix prefill computed over the no-overlap
side's, from their phase. A further side named otherwise adds ``<name>_prefill_ratio``.
Keys of a workload not run are left out.

Usage (``scripts/bench_serving_defaults.py`` takes the same arguments):
    python -m sglang_mamba_ext.benchmarks.serving_defaults                  # builds .tiny_model if needed
    python -m sglang_mamba_ext.benchmarks.serving_defaults --rounds 2 --with-no-overlap
    python -m sglang_mamba_ext.benchmarks.serving_defaults --side lru='--enable-mamba-radix --radix-eviction-policy lru' \\
        --side adaptive='--enable-mamba-radix --radix-eviction-policy adaptive' --workloads shared-prefix

Exit status: 0 on success, 1 when a server or a bench_serving pass fails (or loses
requests), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import math
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from sglang_mamba_ext.benchmarks.serving_cpu import flush, send
from sglang_mamba_ext.testing.server import ServerProcess, tiny_model_dir

#: (name, launch flags) of the default sides: reference first, candidate second.
DEFAULT_SIDES = (
    ("old-default", "--enable-mamba-radix --radix-eviction-policy lru"),
    ("new-default", "--enable-mamba-radix"),
)
#: The side ``--with-no-overlap`` adds.
NO_OVERLAP_SIDE = ("no-overlap", "--enable-mamba-radix --disable-overlap-schedule")
#: Flags of every server (overlap scheduling left at SGLang's default).
COMMON_FLAGS = ["--device", "cpu", "--sleep-on-idle"]
WORKLOADS = ("shared-prefix", "no-reuse")
#: bench_serving backend per workload (multi-turn rows need a chat backend).
BACKENDS = {"shared-prefix": "sglang-oai-chat", "no-reuse": "sglang"}
BENCH_MODULE = "sglang.bench_serving"
#: Environment of the servers and of bench_serving: no download.
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
#: The plugin's start-up line naming the tree cache's eviction policy.
EVICTION_RE = re.compile(r"sglang-mamba-ext: \S+ tree cache \(.*?eviction ([\w-]+)\)")
#: Growth allowed for random-token text re-tokenized by the server, and the chat template's
#: tokens, when fitting the shared-prefix conversations to the context length.
RETOKENIZE_FACTOR = 2
TEMPLATE_TOKENS = 64
SIDE_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


def parse_side(text: str):
    """``NAME=flags ...`` -> (name, list of flags). Raises ValueError on a bad form."""
    name, sep, flags = text.partition("=")
    name = name.strip()
    if not sep or not SIDE_NAME_RE.match(name):
        raise ValueError(f"--side {text!r}: expected NAME='flags ...' (NAME of letters, digits, _ . -)")
    return name, shlex.split(flags)


def parse_args(argv):
    """Parsed arguments, with ``sides`` (list of (name, flags)) and ``workloads`` (list) resolved;
    bad arguments exit 2 (argparse's ``error:``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default=None, help="model dir (default: build/reuse .tiny_model)")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds per phase (default 2: A B, B A)")
    p.add_argument("--side", action="append", default=[], metavar="NAME='FLAGS'",
                   help="a side and its launch flags (repeatable; replaces the default sides)")
    p.add_argument("--with-no-overlap", action="store_true",
                   help="add the side no-overlap: --enable-mamba-radix --disable-overlap-schedule")
    p.add_argument("--workloads", default=",".join(WORKLOADS),
                   help=f"comma-separated, of {', '.join(WORKLOADS)} (default both)")
    p.add_argument("--concurrency", type=int, default=4, help="bench_serving --max-concurrency (default 4)")
    p.add_argument("--gsp-num-groups", type=int, default=4)
    p.add_argument("--gsp-prompts-per-group", type=int, default=4)
    p.add_argument("--gsp-num-turns", type=int, default=3)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1536)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=16)
    p.add_argument("--noreuse-prompts", type=int, default=32)
    p.add_argument("--noreuse-input-len", type=int, default=320)
    p.add_argument("--noreuse-output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=42, help="bench_serving --seed (no-reuse: the first from it that fits)")
    p.add_argument("--extra-flags", default="", help="extra launch flags for every server")
    p.add_argument("--work-dir", default=None, help="where bench_serving's result and log files go (default: a temp dir)")
    p.add_argument("--bench-timeout", type=float, default=1800.0, help="seconds allowed to one bench_serving pass")
    args = p.parse_args(argv)
    try:
        sides = [parse_side(s) for s in args.side] if args.side else [(n, shlex.split(f)) for n, f in DEFAULT_SIDES]
    except ValueError as e:
        p.error(str(e))
    if args.with_no_overlap:
        sides.append((NO_OVERLAP_SIDE[0], shlex.split(NO_OVERLAP_SIDE[1])))
    names = [n for n, _ in sides]
    if len(sides) < 2:
        p.error("need at least two sides (give --side twice, or none for the defaults)")
    if len(set(names)) != len(names):
        p.error(f"side names must differ: {' '.join(names)}")
    args.sides = sides
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    bad = [w for w in workloads if w not in WORKLOADS]
    if not workloads or bad or len(set(workloads)) != len(workloads):
        p.error(f"--workloads {args.workloads!r}: a comma-separated subset of {', '.join(WORKLOADS)}")
    args.workloads = [w for w in WORKLOADS if w in workloads]
    if args.rounds < 1 or args.concurrency < 1:
        p.error("--rounds and --concurrency must be >= 1")
    for name in ("gsp_num_groups", "gsp_prompts_per_group", "gsp_num_turns", "gsp_system_prompt_len",
                 "gsp_question_len", "noreuse_prompts", "noreuse_input_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.gsp_output_len < 2 or args.noreuse_output_len < 2:
        p.error("--gsp-output-len and --noreuse-output-len must be >= 2 (TPOT needs a second token)")
    if not math.isfinite(args.bench_timeout) or args.bench_timeout <= 0:
        p.error("--bench-timeout must be a finite number of seconds > 0")
    try:
        shlex.split(args.extra_flags)
    except ValueError as e:
        p.error(f"--extra-flags {args.extra_flags!r}: {e}")
    if args.work_dir is not None and os.path.exists(args.work_dir) and not os.path.isdir(args.work_dir):
        p.error(f"--work-dir {args.work_dir}: exists and is not a directory")
    return args


def phases(sides):
    """[(phase name, (side A, side B))]: the first two sides, then the second against each
    further one (names only)."""
    names = [n for n, _ in sides]
    pairs = [(names[0], names[1])] + [(names[1], n) for n in names[2:]]
    return [(f"{a}-vs-{b}", (a, b)) for a, b in pairs]


def model_context_len(model_dir: str) -> int:
    """``max_position_embeddings`` of ``model_dir/config.json`` (tokens)."""
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["max_position_embeddings"])


def fit_system_prompt_len(context_len: int, system: int, question: int, output: int, turns: int) -> int:
    """The shared-prefix system prompt length (tokens) to use: ``system``, or less so that
    ``RETOKENIZE_FACTOR`` x the last turn's conversation (system + ``turns`` questions +
    ``turns - 1`` outputs) + ``TEMPLATE_TOKENS`` fits ``context_len``. Raises ValueError when
    nothing fits."""
    rest = turns * question + (turns - 1) * output
    if RETOKENIZE_FACTOR * (system + rest) + TEMPLATE_TOKENS <= context_len:
        return system
    fitted = (context_len - TEMPLATE_TOKENS) // RETOKENIZE_FACTOR - rest
    if fitted < 1:
        raise ValueError(f"{turns} turns of {question}-token questions and {output}-token outputs do not fit "
                         f"a context of {context_len} tokens")
    return fitted


def distinct_first_tokens(prompts) -> bool:
    """Whether no two token-id prompts start with the same token (share any prefix)."""
    return len({p[0] for p in prompts}) == len(prompts)


def pick_noreuse_seed(tokenizer, n: int, input_len: int, output_len: int, seed: int, tries: int = 1000) -> int:
    """The first bench_serving ``--seed`` from ``seed`` whose ``random-ids`` prompts (``n`` of
    ``input_len`` ids, range ratio 1) all start with different tokens; drawn with
    bench_serving's own sampler after its own seeding (``random.seed``, ``np.random.seed``).
    Raises ValueError after ``tries`` seeds."""
    import random

    import numpy as np
    from sglang.benchmark.datasets.random import sample_random_requests

    for s in range(seed, seed + tries):
        random.seed(s)
        np.random.seed(s)
        with contextlib.redirect_stdout(io.StringIO()):
            rows = sample_random_requests(input_len, output_len, n, 1.0, tokenizer, "", random_sample=False, return_text=False)
        if distinct_first_tokens([r.prompt for r in rows]):
            return s
    raise ValueError(f"no seed in [{seed}, {seed + tries}) gives {n} random-ids prompts with distinct first tokens")


def bench_command(workload: str, args, port: int, model: str, output_file: str, seed: int) -> list:
    """The ``python -m sglang.bench_serving`` command of one pass of ``workload``."""
    cmd = [sys.executable, "-m", BENCH_MODULE, "--backend", BACKENDS[workload],
           "--host", "127.0.0.1", "--port", str(port), "--tokenizer", model,
           "--max-concurrency", str(args.concurrency), "--seed", str(seed),
           "--cache-report", "--flush-cache", "--warmup-requests", "1", "--disable-tqdm",
           "--output-file", output_file]
    if workload == "shared-prefix":
        cmd += ["--dataset-name", "generated-shared-prefix",
                "--gsp-num-groups", str(args.gsp_num_groups),
                "--gsp-prompts-per-group", str(args.gsp_prompts_per_group),
                "--gsp-num-turns", str(args.gsp_num_turns),
                "--gsp-system-prompt-len", str(args.gsp_system_prompt_len),
                "--gsp-question-len", str(args.gsp_question_len),
                "--gsp-output-len", str(args.gsp_output_len)]
    else:
        cmd += ["--dataset-name", "random-ids", "--tokenize-prompt",
                "--num-prompts", str(args.noreuse_prompts),
                "--random-input-len", str(args.noreuse_input_len),
                "--random-output-len", str(args.noreuse_output_len),
                "--random-range-ratio", "1"]
    return cmd


def expected_requests(workload: str, args) -> int:
    """Requests one pass of ``workload`` sends (a multi-turn row counts once per turn)."""
    if workload == "shared-prefix":
        return args.gsp_num_groups * args.gsp_prompts_per_group * args.gsp_num_turns
    return args.noreuse_prompts


def pass_record(result: dict) -> dict:
    """One pass's numbers from bench_serving's JSON line (with ``--cache-report``):
    completed requests, duration (s), output tokens, out_tok_s (tok/s), ttft_ms, tpot_ms
    (means, ms), prompt/cached/computed tokens. Raises KeyError without a cache report."""
    cache = result["cache_report"]
    prompt, cached = int(cache["total_prompt_tokens"]), int(cache["total_cached_tokens"])
    return {
        "completed": int(result["completed"]),
        "duration_s": float(result["duration"]),
        "out_tokens": int(result["total_output_tokens"]),
        "out_tok_s": float(result["output_throughput"]),
        "ttft_ms": float(result["mean_ttft_ms"]),
        "tpot_ms": float(result["mean_tpot_ms"]),
        "prompt": prompt,
        "cached": cached,
        "computed": prompt - cached,
    }


def summarize(passes) -> dict:
    """Totals over passes (records of :func:`pass_record`): out_tok_s = total output tokens /
    total duration (tok/s); ttft_ms / tpot_ms = means weighted by completed requests (ms);
    prompt, cached, computed token totals."""
    completed = sum(p["completed"] for p in passes)
    duration = sum(p["duration_s"] for p in passes)
    out = sum(p["out_tokens"] for p in passes)

    def weighted(key):
        return sum(p[key] * p["completed"] for p in passes) / completed if completed else float("nan")

    return {
        "passes": len(passes),
        "completed": completed,
        "duration_s": duration,
        "out_tokens": out,
        "out_tok_s": out / duration if duration > 0 else float("nan"),
        "ttft_ms": weighted("ttft_ms"),
        "tpot_ms": weighted("tpot_ms"),
        "prompt": sum(p["prompt"] for p in passes),
        "cached": sum(p["cached"] for p in passes),
        "computed": sum(p["computed"] for p in passes),
    }


def ratio(a, b) -> float:
    """a / b, NaN when b is 0."""
    return a / b if b else float("nan")


def round_ratios(new_passes, old_passes, key: str) -> list:
    """Per-round ratios new / old of ``key``, rounds paired in order."""
    return [ratio(n[key], o[key]) for n, o in zip(new_passes, old_passes)]


def last_line_fields(runs, sides, workloads) -> dict:
    """The last line's ratios (second side over first, see the module docstring) from
    ``runs[phase][side][workload]`` = [pass records per round]."""
    (first, (old, new)), *others = phases(sides)
    fields = {}
    keys = {"shared-prefix": "shared_prefix", "no-reuse": "noreuse"}
    for w in workloads:
        o, n = runs[first][old][w], runs[first][new][w]
        if w == "shared-prefix":
            fields["shared_prefix_prefill_ratio"] = ratio(summarize(n)["computed"], summarize(o)["computed"])
        fields[f"{keys[w]}_throughput_ratio"] = statistics.median(round_ratios(n, o, "out_tok_s"))
        fields[f"{keys[w]}_tpot_ratio"] = statistics.median(round_ratios(n, o, "tpot_ms"))
    if "shared-prefix" in workloads:
        for name, (a, b) in others:
            key = "overlap_prefill_ratio" if b == NO_OVERLAP_SIDE[0] else f"{re.sub(r'[^A-Za-z0-9]', '_', b)}_prefill_ratio"
            fields[key] = ratio(summarize(runs[name][a]["shared-prefix"])["computed"],
                                summarize(runs[name][b]["shared-prefix"])["computed"])
    return fields


def format_fields(fields) -> str:
    """``key=value`` pairs, 3 decimals."""
    return " ".join(f"{k}={v:.3f}" for k, v in fields.items())


def format_pass(rec) -> str:
    """One pass or summary record on one line."""
    return (f"completed={rec['completed']} out_tok_s={rec['out_tok_s']:.1f} ttft_mean={rec['ttft_ms']:.1f}ms "
            f"tpot_mean={rec['tpot_ms']:.2f}ms prompt_tokens={rec['prompt']} cached_tokens={rec['cached']} "
            f"prefill_tokens_computed={rec['computed']}")


def eviction_policy(log_text: str):
    """The eviction policy named in the plugin's tree-cache start-up line, or None."""
    m = EVICTION_RE.search(log_text)
    return m.group(1) if m else None


class BenchError(RuntimeError):
    """A bench_serving pass failed (exit status, no result line, lost requests)."""


def run_pass(workload, args, server, model, seed, work_dir, tag) -> dict:
    """Flushes the server's cache, runs one bench_serving pass of ``workload`` against it and
    returns its :func:`pass_record`. Raises BenchError."""
    flush(server.base_url)
    out_file = os.path.join(work_dir, f"{tag}.jsonl")
    log_file = os.path.join(work_dir, f"{tag}.log")
    cmd = bench_command(workload, args, server.port, model, out_file, seed)
    env = dict(os.environ, **OFFLINE_ENV)
    with open(log_file, "w") as log:
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=args.bench_timeout).returncode
        except subprocess.TimeoutExpired:
            raise BenchError(f"{tag}: bench_serving ran over {args.bench_timeout:.0f} s (log {log_file})")
    with open(log_file, errors="replace") as f:
        tail = f.read()[-3000:]
    if rc != 0 or not os.path.isfile(out_file):
        raise BenchError(f"{tag}: bench_serving exited {rc} without a result (log {log_file}):\n{tail}")
    with open(out_file) as f:
        lines = [line for line in f if line.strip()]
    try:
        rec = pass_record(json.loads(lines[-1]))
    except (IndexError, KeyError, ValueError) as e:
        raise BenchError(f"{tag}: unreadable result {out_file}: {e!r}")
    want = expected_requests(workload, args)
    if rec["completed"] != want:
        raise BenchError(f"{tag}: {rec['completed']} of {want} requests completed (log {log_file}):\n{tail}")
    return rec


def _start(server_factory, model, name, flags, extra):
    """Starts one side's server (one unmeasured warm-up request); stops it on failure."""
    server = server_factory(model, [*COMMON_FLAGS, *flags, *extra])
    try:
        server.start()
        print(f"[{name}] server up in {server.startup_s:.0f} s (log {server.log_path})", flush=True)
        send(server.base_url, {"input_ids": list(range(5, 13)), "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    except BaseException:
        server.stop()
        raise
    return server


def _policy(server):
    try:
        return eviction_policy(server.log_text())
    except OSError:
        return None


def main(argv=None, server_factory=None) -> int:
    """Runs the benchmark; returns the exit status. ``server_factory(model, flags)`` builds a
    server (default :class:`ServerProcess` with ``HF_HUB_OFFLINE=1``)."""
    t_start = time.time()
    args = parse_args(argv if argv is not None else sys.argv[1:])
    os.environ.update(OFFLINE_ENV)
    model = args.model_path or tiny_model_dir()
    try:
        context = model_context_len(model)
        system = fit_system_prompt_len(context, args.gsp_system_prompt_len, args.gsp_question_len,
                                       args.gsp_output_len, args.gsp_num_turns)
        if args.noreuse_input_len + args.noreuse_output_len > context:
            raise ValueError(f"no-reuse prompts of {args.noreuse_input_len}+{args.noreuse_output_len} tokens "
                             f"exceed the context length {context}")
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if system != args.gsp_system_prompt_len:
        print(f"note: system prompt shrunk from {args.gsp_system_prompt_len} to {system} tokens to fit the "
              f"context length {context}", flush=True)
        args.gsp_system_prompt_len = system
    noreuse_seed = args.seed
    if "no-reuse" in args.workloads:
        import transformers
        from transformers import AutoTokenizer

        transformers.logging.set_verbosity_error()
        try:
            noreuse_seed = pick_noreuse_seed(AutoTokenizer.from_pretrained(model), args.noreuse_prompts,
                                             args.noreuse_input_len, args.noreuse_output_len, args.seed)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    seeds = {"shared-prefix": args.seed, "no-reuse": noreuse_seed}
    work_dir = args.work_dir or tempfile.mkdtemp(prefix="bench-serving-defaults-")
    os.makedirs(work_dir, exist_ok=True)
    server_factory = server_factory or (lambda m, flags: ServerProcess(m, flags, env=dict(OFFLINE_ENV)))
    extra = shlex.split(args.extra_flags)
    flags = dict(args.sides)
    plan = phases(args.sides)
    print(f"rounds={args.rounds} concurrency={args.concurrency} workloads={','.join(args.workloads)} "
          f"shared-prefix: {args.gsp_num_groups} groups x {args.gsp_prompts_per_group} prompts x "
          f"{args.gsp_num_turns} turns, system {args.gsp_system_prompt_len} question {args.gsp_question_len} "
          f"output {args.gsp_output_len} (seed {seeds['shared-prefix']}); no-reuse: {args.noreuse_prompts} x "
          f"{args.noreuse_input_len} tokens, output {args.noreuse_output_len} (seed {seeds['no-reuse']}); "
          f"context {context}; bench_serving files in {work_dir}", flush=True)
    for name, f in args.sides:
        print(f"side {name}: {' '.join([*COMMON_FLAGS, *f, *extra])}", flush=True)
    runs = {ph: {side: {w: [] for w in args.workloads} for side in pair} for ph, pair in plan}
    policies = {}
    started = {}
    try:
        for ph, pair in plan:
            for name in list(started):  # at most two servers alive, started one at a time
                if name not in pair:
                    policies[name] = policies.get(name) or _policy(started[name])
                    started.pop(name).stop()
            for name in pair:
                if name not in started:
                    started[name] = _start(server_factory, model, name, flags[name], extra)
                    policies[name] = _policy(started[name])
                    print(f"[{name}] eviction policy (server log): {policies[name] or 'not logged'}", flush=True)
            for rnd in range(args.rounds):
                order = pair if rnd % 2 == 0 else tuple(reversed(pair))
                for w in args.workloads:
                    for name in order:
                        tag = f"{ph}-r{rnd}-{name}-{w}"
                        rec = run_pass(w, args, started[name], model, seeds[w], work_dir, tag)
                        runs[ph][name][w].append(rec)
                        print(f"[{ph} round {rnd} {name} {w}] {format_pass(rec)} duration={rec['duration_s']:.1f}s",
                              flush=True)
        for name in started:
            policies[name] = policies.get(name) or _policy(started[name])
    except Exception as e:  # noqa: BLE001 - report and fail the run
        print(f"failed: {e}", flush=True)
        return 1
    finally:
        for server in started.values():
            server.stop()
    for ph, pair in plan:
        print(f"{ph}, over {args.rounds} rounds:")
        for w in args.workloads:
            for name in pair:
                print(f"[{ph} {w} {name}] {format_pass(summarize(runs[ph][name][w]))} "
                      f"eviction={policies.get(name) or 'not logged'}")
            a, b = (runs[ph][name][w] for name in pair)
            per_round = "  ".join(
                f"{label} " + " ".join(f"{r:.3f}" for r in round_ratios(b, a, key))
                for label, key in (("out_tok_s", "out_tok_s"), ("ttft", "ttft_ms"), ("tpot", "tpot_ms"),
                                   ("prefill", "computed")))
            print(f"[{ph} {w}] {pair[1]}/{pair[0]} per round: {per_round}")
    print("eviction policies: " + " ".join(f"{n}={policies.get(n) or 'not logged'}" for n, _ in args.sides))
    print(f"wall_s={time.time() - t_start:.0f}")
    print(format_fields(last_line_fields(runs, args.sides, args.workloads)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
