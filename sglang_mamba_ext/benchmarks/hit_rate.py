"""Hit-rate benchmark: usable prefix hits and recomputed prefill of SGLang 0.5.23's
hybrid cache (no_buffer and extra_buffer) and of this project's cache variants.

Replays a workload (the shared multi-turn trace, ../shared/bench/README.md, and a
chat-shaped synthetic one) request by request, with equal pools for every variant (KV
200,000 tokens; SSM 64 slots, and 16), page size 1, and reports per variant:

* hit rate: sum of usable ``prefix_len`` (KV that has an SSM state) / prompt tokens;
* KV ceiling: sum of the KV-only match (KV present whatever the state) / prompt tokens;
* recomputed prefill tokens: sum of ``len(tokens) - prefix_len``;
* requests with a hit, extra SSM state copies (checkpoint snapshots the strategy
  wrote besides the running request's live state), and the leak check
  (``free + evictable + protected == size`` for KV and SSM at the end).

Three workloads (``--workload``): the shared trace, an agent-shaped synthetic one
(:mod:`.agent_workload`: tool loops whose context grows every step, RAG prompts over a
document pool in varying order, regenerations), and a chat-shaped synthetic one generated
from a seed (:mod:`.chat_workload`: a few system prompts, each reused by many interleaved
multi-turn conversations), whose extra lines show the *first-sharer effect*: the first
turn of the second conversation on a system prompt hits nothing of it (the branch-point
checkpoint is planted only by that request), the third conversation's hits it.

The closing lines compare, per SSM pool size, the best variant of each side (best =
highest hit rate; recompute of that same variant) against SGLang's best of its no_buffer
variants (what it serves on CPU) and of all its variants (``--upstream-best-of``, default
``all``: extra_buffer included), the latter with ``oracle_ratio``: ours' best hit rate over
the *offline bound*, the best of the oracle rows, and ``upper_bound_ratio``: ours' best hit
rate over the *upper bound* (the ``upper-bound-lp`` row). The very last line is the shared
trace's (else the chat workload's, else the agent workload's) at the last size of
``--mamba-sizes`` (default 16 slots)::

    hit_ratio=<ours best / upstream best of all> oracle_ratio=<ours best / offline bound> upper_bound_ratio=<ours best / upper bound>
    bytes_hit_ratio=<below> default_hit_ratio=<ours-default / upstream best of all>
    default_overlap_points=<ours-default minus ours-default-overlap, percentage points>

(one line; the ``default_*`` figures are what ``--enable-mamba-radix`` alone gives).

Offline bound (:mod:`.oracle`): the same cache, the same checkpoint placement, but eviction
victims chosen with the trace's future through the core's victim-priority seam
(``MambaRadixCache.set_victim_priority``): Belady (the state, or leaf with its KV, whose
next use is farthest away or never goes first), Belady counting a state's use only by
requests no deeper state serves, and Belady weighted by the tokens a miss would recompute.
Belady is optimal for demand paging of independent, equal-size, equal-cost items; here
states depend on each other (a miss falls back to the nearest ancestor state, a deeper
state shadows a shallower one), a leaf also holds KV, the placement rule creates states no
request asked for (admitted all the same) and an eviction moves later branch-point
checkpoints. So the bound is the best of these offline
rules, not a proof of optimality: it is an upper bound only for victim rules that see no
further than these (an online policy could beat it on some trace; ``oracle_ratio`` would
then exceed 1).

Upper bound (:mod:`.upper_bound`, row ``upper-bound-lp``): a min-cost-flow linear program
over a relaxation of every run of the cache with that many SSM slots -- any eviction policy,
states planted at any depth of a sequence some earlier request computed, KV unlimited --
solved exactly (HiGHS). No run of this cache hits more; ``upper_bound_ratio <= 1`` always.

Op sequence per request (one at a time, rid order): match, lock, alloc_mamba,
alloc_kv(extend), after_prefill, alloc_kv(decode, one call), after_decode, finish,
unlock -- the README's list plus two scheduler hooks (``CacheDriver.after_prefill`` /
``after_decode`` in :mod:`.common`) that a driver may use to do what SGLang's
scheduler does between those ops.

Assumption on chunked prefill: every prompt is prefilled in one chunk. SGLang 0.5.23
defaults ``--chunked-prefill-size`` from the device memory
(``arg_groups/memory_hook.py:88-182``): 2,048 below 20 GiB, 4,096 below 60 GiB or on
an unknown device, 8,192 on H100/H200, 16,384 above; the longest prompt of the trace
is 3,716 tokens, so one chunk holds on every device of 20 GiB or more. (On a smaller
GPU, prompts over 2,048 would be split and SGLang would checkpoint the chunk end too.)

Variants (``--only`` names; see VARIANTS below):

* ``upstream-nobuf``: SGLang no_buffer, the README's op list exactly (as
  the tree-ops benchmark).
* ``upstream-nobuf-ckpt``: SGLang no_buffer plus the post-prefill
  ``checkpoint_kv_cache`` SGLang's scheduler really runs (a state copy per request).
  no_buffer (+ --disable-overlap-schedule) is the only strategy SGLang serves on CPU.
* ``upstream-xbuf``: SGLang extra_buffer with ping-pong tracking, overlap scheduler
  sizing (2 track slots per running request) -- SGLang's default on GPU for the
  supported architectures; SGLang refuses it on a CPU device
  (``arg_groups/mamba_hook.py:101-118``), the tree bookkeeping runs here anyway.
* ``upstream-xbuf-1pp``: the same with --disable-overlap-schedule (1 track slot).
* ``ours-lru``: this project's cache as SGLang serves it (the plugin's
  ``MambaRadixCacheAdapter``, :mod:`.ours`) under the same scheduler functions as the
  upstream variants, no_buffer, LRU, no prefix checkpoints.
* ``ours-branch-lru``: the same with branch-point + prompt-end checkpoints (planned by
  the plugin's pool when a request gets its row, inserted by the finishing
  ``checkpoint``), LRU eviction.
* ``ours-branch-recompute``: branch-point + prompt-end checkpoints, recompute-aware
  eviction (``--radix-eviction-policy recompute``: GreedyDual-Size-Frequency over tokens
  of recompute saved per byte).
* ``ours-branch-adaptive``: branch-point + prompt-end checkpoints, adaptive eviction
  (``--radix-eviction-policy adaptive``: the same, weighted by each state's expected future
  hits, learned online per class of states; ``mem_cache/eviction.py``).
* ``ours-branch-lru-overlap``, ``ours-branch-adaptive-overlap``: the same two under overlap
  scheduling's timing (:class:`.ours.OursOverlapDriver`): each finish is processed after the
  next request's prefill was scheduled (unless that request is the next turn of the same
  conversation). The gap to the rows without overlap is what overlap costs the cache: the
  next request cannot hit the state the previous one donates, and both requests' slots are
  held at that admission.
* ``ours-default``, ``ours-default-overlap``, ``ours-default-overlap-stop``: exactly what
  ``--enable-mamba-radix`` alone selects, parsed by the plugin from that flag (no strategy,
  no policy named: today ``extra_buffer``, whose ping-pong slots planned prefix checkpoints
  replace, and ``adaptive``), prefix checkpoints planned, and SGLang's post-prefill
  ``checkpoint_kv_cache`` run as its result processor does; without overlap scheduling,
  with its timing for requests ending by length (their final states donated before the
  next batch, ``plugin/overlap_publish.py``), and for requests ending on a stop token
  (finish one batch late). These rows follow the default as it changes.
* ``oracle-belady``, ``oracle-belady-cost``, ``oracle-belady-naive``: ``ours-branch-*``
  with offline victims (:class:`.oracle.OracleDriver`): Belady with deeper states
  shadowing shallower ones; the same weighted by the tokens a miss recomputes per request
  of distance; Belady counting every request that extends a state as a use. Not a
  server's policy: they read the workload's future.
* ``upper-bound-lp``: not a cache: the per-request hits of one optimal solution of the
  upper-bound program (:class:`.upper_bound.UpperBoundDriver`); its ``sec`` column is the
  time to build and solve it; KV ceiling n/a.

Usage (``scripts/bench_hit_rate.py`` takes the same arguments):
    python -m sglang_mamba_ext.benchmarks.hit_rate
    python -m sglang_mamba_ext.benchmarks.hit_rate --mamba-sizes 64 --only upstream-xbuf --only ours-lru
    python -m sglang_mamba_ext.benchmarks.hit_rate --limit 300
    python -m sglang_mamba_ext.benchmarks.hit_rate --workload chat   # no trace file needed

Exit status: 0 on success, 1 when a leak check fails, 2 on bad arguments or input.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import sys
import time
from typing import Optional, Sequence

from sglang_mamba_ext.benchmarks.common import (  # VariantUnavailable: re-exported
    CacheDriver,
    VariantUnavailable,
    TraceRecord,
    add_common_args,
    check_common_args,
    load_trace_for,
)
from sglang_mamba_ext.benchmarks.hit_variants import (  # the variants: re-exported
    HOST_RATIO,
    INT8_ACTIVE_SLOTS,
    INT8_REFERENCE_STATE,
    NO_BUFFER_VARIANTS,
    VARIANTS,
    Variant,
    int8_split,
    int8_state_bytes_ratio,
)
from sglang_mamba_ext.benchmarks.hit_report import (  # best_of and the ratios: re-exported
    best_of,
    comparison,
    default_figures,
    format_table,
    oracle_ratio,
    upper_bound_ratio,
)
from sglang_mamba_ext.benchmarks.hit_report import fmt_ratio as _fmt_ratio

DEFAULT_MAMBA_SIZES = (64, 16)




# ---------------------------------------------------------------------------- runner


@dataclasses.dataclass
class HitResult:
    """Counters of one variant's run over the trace."""

    name: str
    side: str  # "upstream" or "ours"
    num_requests: int = 0
    prompt_tokens: int = 0
    matched_tokens: int = 0  # sum of prefix_len (usable: KV with an SSM state)
    kv_matched_tokens: Optional[int] = 0  # sum of KV-only match; None if unknown
    recomputed_tokens: int = 0  # sum of len(tokens) - prefix_len
    hits: int = 0  # requests with prefix_len > 0
    state_copies: int = 0
    prefix_lens: list[int] = dataclasses.field(default_factory=list)
    kv_prefix_lens: list[Optional[int]] = dataclasses.field(default_factory=list)
    leak_ok: Optional[bool] = None
    leak_details: str = ""
    seconds: float = 0.0
    describe: str = ""

    @property
    def hit_rate(self) -> float:
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def kv_ceiling(self) -> Optional[float]:
        if self.kv_matched_tokens is None or not self.prompt_tokens:
            return None
        return self.kv_matched_tokens / self.prompt_tokens


def run_hit_trace(
    driver: CacheDriver, records: Sequence[TraceRecord], *, side: str = "?"
) -> HitResult:
    """Replay ``records`` through ``driver`` in the hit-rate op order and count.

    Raises:
        ValueError: a driver reported a prefix outside ``[0, len(tokens)-1]`` or a
            KV-only match shorter than its usable prefix or longer than the cap.
    """
    res = HitResult(name=driver.name, side=side, describe=driver.describe())
    kv_known = True
    was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    t0 = time.perf_counter()
    try:
        with driver.activate():
            for rec in records:
                n_prompt, n_out = len(rec.tokens), len(rec.output)
                h = driver.begin(rec)
                prefix_len = driver.match(h)
                kv_len: Optional[int] = None
                if kv_known:
                    try:
                        kv_len = driver.kv_match_len(h)
                    except NotImplementedError:
                        kv_known = False
                driver.lock(h)
                driver.alloc_mamba(h)
                driver.alloc_kv(h, n_prompt - prefix_len)
                driver.after_prefill(h)
                driver.alloc_kv(h, n_out)
                driver.after_decode(h)
                driver.finish(h)
                driver.unlock(h)
                driver.end(h)
                if not 0 <= prefix_len <= n_prompt - 1:
                    raise ValueError(
                        f"{driver.name}: rid {rec.rid} matched {prefix_len} tokens of a "
                        f"{n_prompt}-token prompt; a match must lie in [0, len(tokens)-1]"
                    )
                if kv_len is not None and not prefix_len <= kv_len <= n_prompt - 1:
                    raise ValueError(
                        f"{driver.name}: rid {rec.rid} reported a KV-only match of {kv_len} "
                        f"tokens with a usable prefix of {prefix_len} and a "
                        f"{n_prompt}-token prompt; it must lie in [prefix_len, len(tokens)-1]"
                    )
                res.num_requests += 1
                res.prompt_tokens += n_prompt
                res.matched_tokens += prefix_len
                res.recomputed_tokens += n_prompt - prefix_len
                res.hits += prefix_len > 0
                res.prefix_lens.append(prefix_len)
                res.kv_prefix_lens.append(kv_len)
                if kv_len is not None:
                    res.kv_matched_tokens += kv_len
            res.seconds = time.perf_counter() - t0
            res.leak_ok, res.leak_details = driver.leak_check()
    finally:
        if was_enabled:
            gc.enable()
    if not kv_known:
        res.kv_matched_tokens = None
    res.state_copies = int(getattr(driver, "state_copies", 0))
    return res


# -------------------------------------------------------------------------- report


__all__ = ["HitResult", "Variant", "VariantUnavailable", "run_config", "run_workload", "parse_args", "best_of", "comparison", "format_table", "oracle_ratio",
           "upper_bound_ratio", "run_hit_trace", "main"]


# ---------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, each="variant", only=list(VARIANTS))
    p.add_argument(
        "--mamba-sizes",
        default=",".join(str(m) for m in DEFAULT_MAMBA_SIZES),
        help="comma-separated SSM pool sizes in slots; the last line compares at the "
        "last one (default: %(default)s)",
    )
    p.add_argument(
        "--upstream-best-of",
        choices=("all", "no_buffer"),
        default="all",
        help="upstream variants the last lines take the best of: all (default: extra_buffer "
        "included, SGLang's default on GPU, whose tree bookkeeping runs here although "
        "SGLang refuses it on CPU) or no_buffer (the only strategy SGLang 0.5.23 serves on "
        "a CPU device); the other set is always printed just before",
    )
    p.add_argument(
        "--workload",
        choices=("all", "trace", "chat", "agent"),
        default="all",
        help="the shared trace, the chat-shaped synthetic workload (.chat_workload), the "
        "agent-shaped one (.agent_workload: tool loops, RAG, regenerations; neither needs a "
        "file), or all three (default: %(default)s; the last line is the trace's, else the "
        "chat workload's, else the agent workload's)",
    )
    p.add_argument("--chat-seed", type=int, default=0, help="seed of the chat workload (default: %(default)s)")
    p.add_argument("--agent-seed", type=int, default=0, help="seed of the agent workload (default: %(default)s)")
    p.add_argument("--verbose", action="store_true", help="print each driver's describe() and leak details")
    args = p.parse_args(argv)
    try:
        args.mamba_sizes = [int(x) for x in args.mamba_sizes.split(",") if x.strip()]
    except ValueError:
        p.error(f"--mamba-sizes {args.mamba_sizes!r}: give comma-separated integers, e.g. 64,16")
    if not args.mamba_sizes or any(m < MIN_MAMBA_SIZE for m in args.mamba_sizes):
        p.error(
            f"--mamba-sizes {args.mamba_sizes}: each must be at least {MIN_MAMBA_SIZE} (SGLang's "
            "extra_buffer rows hold 3 SSM slots per running request, the overlap rows' "
            "servers need 5, and the int8 rows keep 4 active slots besides their checkpoints)"
        )
    check_common_args(p, args)
    return args


#: The smallest ``--mamba-sizes`` entry every variant runs at (4 and 5 fail in SGLang's
#: extra_buffer and int8 rows and at the plugin's start-up check under overlap).
MIN_MAMBA_SIZE = 6


def run_config(
    names: Sequence[str], kv_size: int, mamba_size: int, records, *, verbose: bool = False
) -> tuple[list[HitResult], dict[str, str]]:
    results, unavailable = [], {}
    for name in names:
        v = VARIANTS[name]
        try:
            if v.side in ("oracle", "bound"):
                driver = v.factory(kv_size, mamba_size, records)
            else:
                driver = v.factory(kv_size, mamba_size)
        except VariantUnavailable as e:
            unavailable[name] = str(e)
            continue
        if verbose:
            print(driver.describe(), flush=True)
        res = run_hit_trace(driver, records, side=v.side)
        res.name = name
        if v.side == "bound":
            res.seconds += driver.bound.seconds  # building and solving the program
        if verbose:
            print(f"[{name}] leak_check={'ok' if res.leak_ok else 'LEAK'} {res.leak_details}")
        results.append(res)
        del driver
    return results, unavailable


def _counted(results: Sequence[HitResult], best_of_set: str) -> list[HitResult]:
    """The results a comparison takes: all, or (``no_buffer``) the upstream no_buffer
    variants beside every ours and oracle row."""
    if best_of_set == "all":
        return list(results)
    return [r for r in results if r.side != "upstream" or r.name in NO_BUFFER_VARIANTS]


def run_workload(
    label: str, names: Sequence[str], records: Sequence[TraceRecord], args: argparse.Namespace
) -> tuple[dict[int, list[HitResult]], bool]:
    """Every variant of ``names`` at every ``--mamba-sizes`` on ``records``, tables
    printed; ``(results by SSM pool size, any leak)``."""
    per_size: dict[int, list[HitResult]] = {}
    leak = False
    for m in args.mamba_sizes:
        results, unavailable = run_config(names, args.kv_size, m, records, verbose=args.verbose)
        per_size[m] = results
        leak |= any(not r.leak_ok for r in results)
        print(f"[{label}] " + format_table(m, args.kv_size, results, unavailable, names))
        for r in results:
            if not r.leak_ok:
                print(f"[{r.name}] LEAK: {r.leak_details}")
    return per_size, leak


def synthetic_workload(label: str, args: argparse.Namespace) -> tuple[list[TraceRecord], str]:
    """``(records, description)`` of the generated workload ``label`` (``chat``:
    :mod:`.chat_workload`, ``agent``: :mod:`.agent_workload`), cut to ``--limit``."""
    if label == "chat":
        from sglang_mamba_ext.benchmarks.chat_workload import DEFAULTS, chat_workload

        return chat_workload(args.chat_seed)[: args.limit], (
            f"seed={args.chat_seed} system_prompts={DEFAULTS['num_system']} "
            f"conversations={DEFAULTS['num_conversations']}")
    from sglang_mamba_ext.benchmarks.agent_workload import DEFAULTS, agent_workload, shape_counts

    recs = agent_workload(args.agent_seed)[: args.limit]
    shapes = " ".join(f"{k}={v}" for k, v in shape_counts(recs).items())
    return recs, (f"seed={args.agent_seed} tool_sets={DEFAULTS['num_toolsets']} "
                  f"agent_sessions={DEFAULTS['agent_sessions']} rag_queries={DEFAULTS['rag_queries']} {shapes}")


def print_sharers(records: Sequence[TraceRecord], per_size: dict[int, list[HitResult]]) -> None:
    """The chat workload's first-sharer lines (:func:`.chat_workload.sharer_hits`): per SSM
    pool size, the tokens the first turn of the 2nd and of the 3rd conversation on each
    system prompt hit, per variant, against what they share with earlier requests."""
    from sglang_mamba_ext.benchmarks.chat_workload import sharer_hits

    for k, what in ((2, "2nd conversation (first sharer)"), (3, "3rd conversation")):
        n, _, shared = sharer_hits(records, [0] * len(records), k)
        for m, results in per_size.items():
            hits = ", ".join(f"{r.name} {sharer_hits(records, r.prefix_lens, k)[1]:,}" for r in results)
            print(
                f"[chat] mamba_size={m} first turn of the {what} on each system prompt "
                f"({n} requests, {shared:,} tokens shared with earlier requests) hit: {hits}"
            )


def bytes_hit_ratio(results: Sequence[HitResult]) -> tuple[float, str, str]:
    """``(ratio, ours best, upstream best)`` at equal device bytes: the best hit rate of this
    cache's rows (full precision and int8) over SGLang's (every upstream row, with and
    without int8); NaN (and "-") where a side has no row."""
    import math

    def best(sides):
        rows = [r for r in results if r.side in sides]
        return max(rows, key=lambda r: r.hit_rate) if rows else None

    ours, up = best(("ours", "ours-bytes")), best(("upstream", "upstream-bytes"))
    if ours is None or up is None:
        return math.nan, ours.name if ours else "-", up.name if up else "-"
    return (ours.hit_rate / up.hit_rate if up.hit_rate > 0 else math.inf), ours.name, up.name


def _bytes_note() -> str:
    r = int8_state_bytes_ratio()
    return f"an int8 state is {r:.3f} of a bf16 one; int8 rows keep {INT8_ACTIVE_SLOTS} active slots"


def summary_lines(label: str, per_size: dict[int, list[HitResult]], best_of_set: str) -> list[str]:
    """Per SSM pool size: ours best against upstream best of both sets, and (main set,
    ``best_of_set``) against the offline bound and the upper bound."""
    lines = []
    other = "no_buffer" if best_of_set == "all" else "all"
    for m, results in per_size.items():
        h, rr, o, u = comparison(_counted(results, other))
        lines.append(
            f"{label}mamba_size={m} against upstream best of {other} ({u}), ours {o}: "
            f"hit_ratio={_fmt_ratio(h)} recompute_ratio={_fmt_ratio(rr)}"
        )
    for m, results in per_size.items():
        h, rr, o, u = comparison(_counted(results, best_of_set))
        orat, bound = oracle_ratio(results)
        lines.append(
            f"{label}mamba_size={m} against upstream best of {best_of_set} ({u}), ours {o}, "
            f"offline bound {bound}: hit_ratio={_fmt_ratio(h)} recompute_ratio={_fmt_ratio(rr)} "
            f"oracle_ratio={_fmt_ratio(orat)} upper_bound_ratio={_fmt_ratio(upper_bound_ratio(results))}"
        )
    return lines


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    records = None
    if args.workload in ("all", "trace"):
        records = load_trace_for(args, "hit_rate")
        if records is None:
            return 2
    import torch

    torch.set_num_threads(args.threads)
    names = [n for n in VARIANTS if args.only is None or n in args.only]
    leak = False
    per_size: dict[int, list[HitResult]] = {}
    if records is not None:
        print(
            f"trace={args.trace} requests={len(records)} "
            f"prompt_tokens={sum(len(r.tokens) for r in records)} kv_size={args.kv_size} "
            f"mamba_sizes={args.mamba_sizes} page_size=1"
        )
        per_size, leak = run_workload("trace", names, records, args)
    synthetic_lines: list[str] = []
    for label in ("chat", "agent"):
        if args.workload not in ("all", label):
            continue
        recs, describe = synthetic_workload(label, args)
        print(f"{label} workload: {describe} requests={len(recs)} prompt_tokens={sum(len(r.tokens) for r in recs)} "
              f"kv_size={args.kv_size} mamba_sizes={args.mamba_sizes} page_size=1")
        sizes, w_leak = run_workload(label, names, recs, args)
        leak |= w_leak
        if label == "chat":
            print_sharers(recs, sizes)
        synthetic_lines += summary_lines(f"{label} ", sizes, args.upstream_best_of)
        if records is None and not per_size:
            per_size = sizes
    for line in synthetic_lines:
        print(line)
    if records is not None:
        for line in summary_lines("", per_size, args.upstream_best_of):
            print(line)
    last = per_size[args.mamba_sizes[-1]]
    h, _, _, _ = comparison(_counted(last, args.upstream_best_of))
    orat, _ = oracle_ratio(last)
    bh, ours_name, up_name = bytes_hit_ratio(last)
    dh, dpoints = default_figures(_counted(last, args.upstream_best_of))
    print(f"mamba_size={args.mamba_sizes[-1]} equal device bytes ({_bytes_note()}): ours {ours_name}, "
          f"upstream {up_name}: bytes_hit_ratio={_fmt_ratio(bh)}")
    print(
        f"hit_ratio={_fmt_ratio(h)} oracle_ratio={_fmt_ratio(orat)} "
        f"upper_bound_ratio={_fmt_ratio(upper_bound_ratio(last))} bytes_hit_ratio={_fmt_ratio(bh)} "
        f"default_hit_ratio={_fmt_ratio(dh)} default_overlap_points={'nan' if math.isnan(dpoints) else f'{dpoints:.2f}'}"
    )
    return 1 if leak else 0


if __name__ == "__main__":
    sys.exit(main())
