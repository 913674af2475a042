"""Tree-ops benchmark: this project's cache vs SGLang 0.5.23's own.

Replays the shared multi-turn trace (../shared/bench/README.md) request by request
through each cache with identical operations and equal pool sizes: "ours" is the plugin's
``MambaRadixCacheAdapter`` (:mod:`.ours`), "upstream" SGLang's ``UnifiedRadixCache``
(:mod:`.upstream`), both driven by the same SGLang scheduler functions
(:mod:`.scheduler`: match, lock, alloc with evict-if-short, checkpoint, release). Prints per
cache: requests per second of the cache cycle, hit rate (matched / prompt tokens) and
the leak check. With both caches the last line is

    speedup=<ours/upstream requests per s> hit_ratio=<ours/upstream hit rate>

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
    DEFAULT_KV_SIZE,
    DEFAULT_MAMBA_SIZE,
    TRACE_PATH,
    TRACE_SHA256,
    BenchResult,
    CacheDriver,
    TraceError,
    format_comparison,
    format_result,
    load_trace,
    median_result,
    run_trace,
)


def _make_upstream(args: argparse.Namespace) -> CacheDriver:
    from sglang_mamba_ext.benchmarks.upstream import make_upstream_driver

    return make_upstream_driver(args)


def _make_ours(args: argparse.Namespace) -> CacheDriver:
    from sglang_mamba_ext.benchmarks.ours import make_ours_driver

    return make_ours_driver(args)


# Order matters: "ours" first, "upstream" second, for the comparison line.
DRIVERS: dict[str, Callable[[argparse.Namespace], CacheDriver]] = {
    "ours": _make_ours,
    "upstream": _make_upstream,
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=TRACE_PATH, help="trace .jsonl.gz (default: %(default)s)")
    p.add_argument(
        "--no-verify",
        action="store_true",
        help=f"skip the sha256 check of the trace (expected {TRACE_SHA256[:12]}...)",
    )
    p.add_argument(
        "--kv-size",
        type=int,
        default=DEFAULT_KV_SIZE,
        help="KV pool size in tokens, for every cache (default: %(default)s)",
    )
    p.add_argument(
        "--mamba-size",
        type=int,
        default=DEFAULT_MAMBA_SIZE,
        help="SSM (mamba) pool size in slots, for every cache (default: %(default)s)",
    )
    p.add_argument(
        "--only",
        choices=sorted(DRIVERS),
        action="append",
        help="run only this cache (repeatable); default: all",
    )
    p.add_argument(
        "--limit", type=int, default=None, help="replay only the first N requests"
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="fresh runs per cache, interleaved; the median requests/s is reported "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default: %(default)s; the cache ops are tiny "
        "tensor ops, and spinning worker threads make timings erratic on a busy machine)",
    )
    p.add_argument(
        "--cow-copy",
        action="store_true",
        help="also copy SSM state on a hit (deferred to the forward in SGLang; off by default)",
    )
    args = p.parse_args(argv)
    if args.kv_size < 4096:
        p.error(
            f"--kv-size {args.kv_size} is below 4096; one request of the trace needs up "
            "to 3,766 KV slots, so use at least 4096"
        )
    if args.mamba_size < 1:
        p.error(f"--mamba-size {args.mamba_size} must be at least 1")
    if args.threads < 1:
        p.error(f"--threads {args.threads} must be at least 1")
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat} must be at least 1")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit {args.limit} must be at least 1")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        records = load_trace(
            args.trace,
            expected_sha256=None if args.no_verify else TRACE_SHA256,
            limit=args.limit,
        )
    except TraceError as e:
        print(f"tree_ops: {e}", file=sys.stderr)
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
    if "ours" in results and "upstream" in results:
        print(format_comparison(results["ours"], results["upstream"]))
    return 1 if leak else 0


if __name__ == "__main__":
    sys.exit(main())
