"""Tree-ops benchmark: this project's cache vs SGLang 0.5.23's own.

Replays the shared multi-turn trace (../shared/bench/README.md) request by request
through each cache with identical operations and equal pool sizes: "ours" is the plugin's
``MambaRadixCacheAdapter`` (:mod:`.ours`), "upstream" SGLang's ``UnifiedRadixCache``
(:mod:`.upstream`), both driven by the same SGLang scheduler functions
(:mod:`.scheduler`: match, lock, alloc with evict-if-short, checkpoint, release). Prints per
cache: requests per second of the cache cycle, hit rate (matched / prompt tokens) and
the leak check. With both caches the last line is

    speedup=<ours/upstream requests per s> hit_ratio=<ours/upstream hit rate>

"ours" runs the plugin's default eviction policy (``adaptive``); "ours-lru" the same cache
with ``--radix-eviction-policy lru``, and the line before the last compares the two per op
(``policy_cost_ratio`` = time of the cycle under the default over under ``lru``).

Usage (``scripts/bench_tree_ops.py`` takes the same arguments):
    python -m sglang_mamba_ext.benchmarks.tree_ops                  # both caches
    python -m sglang_mamba_ext.benchmarks.tree_ops --only upstream  # SGLang's cache alone
    python -m sglang_mamba_ext.benchmarks.tree_ops --kv-size 50000 --mamba-size 64

Exit status: 0 on success, 1 when a leak check fails, 2 on bad arguments or input.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Optional

from sglang_mamba_ext.benchmarks.common import (
    DEFAULT_MAMBA_SIZE,
    BenchResult,
    CacheDriver,
    add_common_args,
    check_common_args,
    format_comparison,
    format_result,
    load_trace_for,
    median_result,
    run_trace,
)


def _make_upstream(args: argparse.Namespace) -> CacheDriver:
    from sglang_mamba_ext.benchmarks.upstream import make_upstream_driver

    return make_upstream_driver(args)


def _make_ours(args: argparse.Namespace) -> CacheDriver:
    from sglang_mamba_ext.benchmarks.ours import make_ours_driver

    return make_ours_driver(args)


def _make_ours_lru(args: argparse.Namespace) -> CacheDriver:
    from sglang_mamba_ext.benchmarks.ours import make_ours_driver

    return make_ours_driver(args, eviction_policy="lru")


# Order matters: "ours" first, "upstream" second, for the comparison line.
DRIVERS: dict[str, Callable[[argparse.Namespace], CacheDriver]] = {
    "ours": _make_ours,
    "upstream": _make_upstream,
    "ours-lru": _make_ours_lru,
}


def format_policy_cost(default: BenchResult, lru: BenchResult) -> str:
    """The default eviction policy's own cost: mean microseconds per request of each cache
    op (match, alloc with evict-if-short, finish with its insert) under the plugin's default
    policy and under ``lru``, and their ratio (the same trace, pools and protocol)."""
    parts = []
    for op in ("match", "alloc_mamba", "alloc_extend", "alloc_decode", "finish"):
        a = default.op_ns.get(op, 0) / max(default.num_requests, 1) / 1e3
        b = lru.op_ns.get(op, 0) / max(lru.num_requests, 1) / 1e3
        parts.append(f"{op} {a:.1f}/{b:.1f} us")
    ratio = lru.requests_per_s / default.requests_per_s if default.requests_per_s else float("nan")
    return f"policy cost (default/lru, per request): {', '.join(parts)}; policy_cost_ratio={ratio:.3f}"


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(
        p,
        each="cache",
        only=sorted(DRIVERS),
        threads_note="; the cache ops are tiny tensor ops, and spinning worker threads "
        "make timings erratic on a busy machine",
    )
    p.add_argument(
        "--mamba-size",
        type=int,
        default=DEFAULT_MAMBA_SIZE,
        help="SSM (mamba) pool size in slots, for every cache (default: %(default)s)",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="fresh runs per cache, interleaved; the median requests/s is reported "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--cow-copy",
        action="store_true",
        help="also copy SSM state on a hit (deferred to the forward in SGLang; off by default)",
    )
    args = p.parse_args(argv)
    check_common_args(p, args)
    if args.mamba_size < 3:
        p.error(f"--mamba-size {args.mamba_size} must be at least 3 (a running request holds up to 3 SSM slots)")
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat} must be at least 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    records = load_trace_for(args, "tree_ops")
    if records is None:
        return 2
    names = [n for n in DRIVERS if args.only is None or n in args.only]
    import torch

    torch.set_num_threads(args.threads)
    print(
        f"trace={args.trace} requests={len(records)} kv_size={args.kv_size} "
        f"mamba_size={args.mamba_size} page_size=1 cow_copy={args.cow_copy}"
    )

    runs: dict[str, list[BenchResult]] = {name: [] for name in names}
    for rep in range(args.repeat):
        # Interleave the caches so drift of the machine hits both alike.
        for name in names:
            driver = DRIVERS[name](args)
            if rep == 0:
                print(driver.describe())
            runs[name].append(run_trace(driver, records))
            del driver

    results: dict[str, BenchResult] = {}
    for name in names:
        results[name] = median_result(runs[name])
        rates = " ".join(f"{r.requests_per_s:.1f}" for r in runs[name])
        print(format_result(results[name]))
        print(f"[{name}] requests_per_s of each run: {rates} (median reported)")

    leak = any(not r.leak_ok for r in results.values())
    if "ours" in results and "ours-lru" in results:
        print(format_policy_cost(results["ours"], results["ours-lru"]))
    if "ours" in results and "upstream" in results:
        print(format_comparison(results["ours"], results["upstream"]))
    return 1 if leak else 0


if __name__ == "__main__":
    sys.exit(main())
