"""Shared pieces of the prefix-cache benchmarks (:mod:`.tree_ops` and :mod:`.hit_rate`):
trace loading, the :class:`CacheDriver` interface and the tree-ops runner.

Both benchmarks replay the shared multi-turn trace
(``../shared/bench/multiturn-trace-v1.jsonl.gz`` beside the checkout, or the file named by
``SGLANG_MAMBA_EXT_TRACE``; format and op list in ``../shared/bench/README.md``) through
one or more prefix caches. A cache is plugged in through a :class:`CacheDriver`; the tree-ops
runner (:func:`run_trace`) times only the cache cycle of every request:

    match -> lock -> alloc mamba slot -> alloc extend KV -> alloc decode KV
          -> finish (insert) -> unlock

and the hit-rate runner (:func:`.hit_rate.run_hit_trace`) adds the two scheduler hooks
``after_prefill`` / ``after_decode``. Requests run one at a time in ``rid`` order; the
runner is the same for every driver, so two drivers execute the identical operation
sequence.

This module imports neither SGLang nor the rest of the project; the drivers do.
"""

from __future__ import annotations

import abc
import argparse
import contextlib
import dataclasses
import gc
import gzip
import hashlib
import json
import os
import sys
import time
from typing import Any, Iterator, Optional, Sequence

#: Environment variable naming the trace file (overrides the default location).
TRACE_ENV = "SGLANG_MAMBA_EXT_TRACE"
#: The checkout's root: this file is <repo>/sglang_mamba_ext/benchmarks/common.py.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The shared trace lives beside the checkout: <repo>/../shared/bench/ (see its README).
TRACE_PATH = os.environ.get(TRACE_ENV) or os.path.normpath(
    os.path.join(REPO_ROOT, "..", "shared", "bench", "multiturn-trace-v1.jsonl.gz")
)
# sha256 of the gzip file's bytes, as given in ../shared/bench/README.md.
TRACE_SHA256 = "53e130852c0eef6ec9a2e1ecddc3dd613ff3752cd4a576c6abdb8dbcd50e21f0"

# Pool sizes the reference numbers in docs/benchmarks.md were measured with.
DEFAULT_KV_SIZE = 200_000  # KV slots (tokens); slot 0 is reserved and not counted
DEFAULT_MAMBA_SIZE = 64  # SSM (mamba) slots

# Timed operations, in the order the runner issues them.
OPS = ("match", "lock", "alloc_mamba", "alloc_extend", "alloc_decode", "finish", "unlock")


class TraceError(RuntimeError):
    """The trace file is missing, corrupt, or not the file the benchmark expects."""


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRecord:
    """One request of the trace.

    Attributes:
        rid: request id, 0..N-1; requests arrive in this order.
        tokens: the full prompt, token ids in [0, 32000).
        output: the generated tokens; at finish they follow ``tokens``.
        sys: index of the system prompt the conversation started from (informational).
        parent: rid whose ``tokens + output`` this prompt starts with, or None.
    """

    rid: int
    tokens: tuple[int, ...]
    output: tuple[int, ...]
    sys: int
    parent: Optional[int]


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def iter_trace(path: str = TRACE_PATH) -> Iterator[TraceRecord]:
    """Yield the records of a gzip JSON-lines trace, checking each record's shape.

    Raises:
        TraceError: a line is not JSON or lacks a field of the README's format.
    """
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                rec = TraceRecord(
                    rid=int(obj["rid"]),
                    tokens=tuple(obj["tokens"]),
                    output=tuple(obj["output"]),
                    sys=int(obj["sys"]),
                    parent=None if obj["parent"] is None else int(obj["parent"]),
                )
            except (ValueError, KeyError, TypeError) as e:
                raise TraceError(
                    f"{path}:{lineno}: not a trace record ({e!r}); expected "
                    '{"rid","tokens","output","sys","parent"} as in '
                    "../shared/bench/README.md"
                ) from e
            if len(rec.tokens) < 2:
                raise TraceError(
                    f"{path}:{lineno}: rid {rec.rid} has {len(rec.tokens)} prompt "
                    "tokens; the op trace needs at least 2 (match is capped at len-1)"
                )
            yield rec


def load_trace(
    path: str = TRACE_PATH,
    *,
    expected_sha256: Optional[str] = TRACE_SHA256,
    limit: Optional[int] = None,
) -> list[TraceRecord]:
    """Read the trace, after checking the file's sha256.

    Args:
        path: the ``.jsonl.gz`` file.
        expected_sha256: hex digest of the file bytes; None skips the check (only for
            traces other than the shared one).
        limit: keep only the first ``limit`` requests (quick runs); None keeps all.

    Raises:
        TraceError: missing file, checksum mismatch, malformed or out-of-order records.
    """
    if not os.path.isfile(path):
        raise TraceError(
            f"trace file {path!r} not found; pass --trace with the path of "
            f"multiturn-trace-v1.jsonl.gz or set {TRACE_ENV} (see ../shared/bench/README.md)"
        )
    if expected_sha256 is not None:
        got = file_sha256(path)
        if got != expected_sha256:
            raise TraceError(
                f"trace file {path!r} has sha256 {got}, expected {expected_sha256}; "
                "the file is corrupt or a different trace -- fetch the shared "
                "multiturn-trace-v1.jsonl.gz again, or pass --no-verify for another trace"
            )
    records = []
    for rec in iter_trace(path):
        if rec.rid != len(records):
            raise TraceError(
                f"{path}: record {len(records)} has rid {rec.rid}; the trace must list "
                "requests in rid order 0..N-1"
            )
        records.append(rec)
        if limit is not None and len(records) >= limit:
            break
    if not records:
        raise TraceError(f"trace file {path!r} holds no records")
    return records


# ------------------------------------------------------------------ command line


def add_common_args(
    p: argparse.ArgumentParser, *, each: str, only: Sequence[str], threads_note: str = ""
) -> None:
    """The options both benchmarks take: ``--trace``, ``--no-verify``, ``--kv-size``
    (``each``: what the size applies to in the help, "cache" or "variant"), ``--only``
    (one of ``only``, repeatable), ``--limit`` and ``--threads`` (``threads_note``:
    appended to its help). Checked by :func:`check_common_args`."""
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
        help=f"KV pool size in tokens, for every {each} (default: %(default)s)",
    )
    p.add_argument(
        "--only",
        choices=list(only),
        action="append",
        help=f"run only this {each} (repeatable); default: all",
    )
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help=f"torch intra-op threads (default: %(default)s{threads_note})",
    )


def check_common_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``p.error`` (exit 2) for a value of :func:`add_common_args`' options out of range."""
    if args.kv_size < 4096:
        p.error(
            f"--kv-size {args.kv_size} is below 4096; one request of the shared trace needs up "
            "to 3,766 KV slots (the chat workload's fewer), so use at least 4096"
        )
    if args.threads < 1:
        p.error(f"--threads {args.threads} must be at least 1")
    if args.limit is not None and args.limit < 1:
        p.error(f"--limit {args.limit} must be at least 1")


def load_trace_for(args: argparse.Namespace, prog: str) -> Optional[list[TraceRecord]]:
    """:func:`load_trace` of ``args.trace`` (``--no-verify``, ``--limit``); on a
    :class:`TraceError`, prints ``<prog>: <error>`` to stderr and returns None."""
    try:
        return load_trace(
            args.trace,
            expected_sha256=None if args.no_verify else TRACE_SHA256,
            limit=args.limit,
        )
    except TraceError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return None
    except (OSError, EOFError, UnicodeDecodeError) as e:  # not a gzip file, truncated, unreadable
        print(f"{prog}: {args.trace}: not a readable gzip JSON-lines trace ({e})", file=sys.stderr)
        return None


class CacheDriver(abc.ABC):
    """What the runner needs from one prefix-cache implementation.

    The runner calls, for every request in order::

        h = begin(rec)               # untimed: build per-request objects
        p = match(h)                 # timed from here ...
        lock(h)
        alloc_mamba(h)
        alloc_kv(h, len(rec.tokens) - p)   # extend
        alloc_kv(h, len(rec.output))       # decode, one call
        finish(h)
        unlock(h)                    # ... to here
        end(h)                       # untimed

    A driver keeps its per-request state in the handle it returns from ``begin``.
    Every allocation evicts first when its pool lacks room (unlocked LRU entries,
    through the cache's own evict API). ``leak_check`` runs after the last request.
    """

    #: short label for reports, e.g. "upstream" or "ours"
    name: str = "?"

    @abc.abstractmethod
    def begin(self, rec: TraceRecord) -> Any:
        """Build the request's objects (untimed). Returns the handle."""

    @abc.abstractmethod
    def match(self, h: Any) -> int:
        """Longest usable cached prefix of ``rec.tokens``, in tokens.

        Capped at ``len(tokens) - 1`` and usable only up to the deepest point holding
        both KV and an SSM state. On a hit the request gets its own SSM slot holding a
        copy-on-write of the cached state if this cache allocates it here (SGLang's
        ``match_prefix(cow_mamba=True)`` does).
        """

    @abc.abstractmethod
    def lock(self, h: Any) -> None:
        """Protect the matched node (and its path) from eviction."""

    @abc.abstractmethod
    def alloc_mamba(self, h: Any) -> None:
        """Give the request an SSM slot if ``match`` did not; evict first if short."""

    @abc.abstractmethod
    def alloc_kv(self, h: Any, num_tokens: int) -> None:
        """Append ``num_tokens`` KV slots to the request; evict first if short."""

    @abc.abstractmethod
    def finish(self, h: Any) -> None:
        """Insert ``tokens + output`` with all their KV slots and the request's SSM slot
        (the state at the end of that sequence); the tree takes ownership, duplicates
        are freed."""

    @abc.abstractmethod
    def unlock(self, h: Any) -> None:
        """Release what ``lock`` (and ``finish``) took."""

    def end(self, h: Any) -> None:
        """Drop per-request objects (untimed)."""

    def activate(self) -> contextlib.AbstractContextManager:
        """Context the whole replay (and the leak check) runs in, e.g. the SGLang runtime
        context a scheduler process would publish. Default: none."""
        return contextlib.nullcontext()

    # ---- optional hooks of the hit-rate benchmark (:mod:`.hit_rate`) ----
    # ``run_trace`` (the tree-ops benchmark) never calls them, so the README's op list
    # stays exactly what it times. The hit-rate runner calls them in this order:
    # match, kv_match_len, lock, alloc_mamba, alloc_kv(extend), after_prefill,
    # alloc_kv(decode), after_decode, finish, unlock.

    #: SSM state snapshots written by the strategy beyond the live state of the
    #: running request (a post-prefill checkpoint copy, a ping-pong track write).
    #: A copy-on-write into a hit request's own slot is not counted here.
    state_copies: int = 0

    def kv_match_len(self, h: Any) -> int:
        """Tokens of the prompt the last ``match`` found as KV, SSM state or not
        (capped like the match at ``len(tokens) - 1``). Default: the usable match."""
        raise NotImplementedError

    def after_prefill(self, h: Any) -> None:
        """What the scheduler does once the prompt's forward ran (e.g. SGLang's
        ``checkpoint_kv_cache``). Default: nothing (the README's op list)."""

    def after_decode(self, h: Any) -> None:
        """What the scheduler does during decode besides the KV allocation (e.g.
        SGLang's extra_buffer track boundaries). Default: nothing."""

    @abc.abstractmethod
    def leak_check(self) -> tuple[bool, str]:
        """``free + evictable + protected == size`` for the KV and the SSM pool.

        Returns ``(ok, details)``, details naming every count.
        """

    def describe(self) -> str:
        """One line naming the implementation and its configuration."""
        return self.name


@dataclasses.dataclass
class BenchResult:
    """Counters of one driver's run over the trace."""

    name: str
    num_requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    matched_tokens: int = 0  # sum of prefix_len (KV usable with an SSM state)
    hits: int = 0  # requests with prefix_len > 0
    op_ns: dict[str, int] = dataclasses.field(
        default_factory=lambda: {op: 0 for op in OPS}
    )
    prefix_lens: list[int] = dataclasses.field(default_factory=list)
    leak_ok: Optional[bool] = None
    leak_details: str = ""

    @property
    def cache_seconds(self) -> float:
        return sum(self.op_ns.values()) / 1e9

    @property
    def requests_per_s(self) -> float:
        s = self.cache_seconds
        return self.num_requests / s if s > 0 else float("inf")

    @property
    def hit_rate(self) -> float:
        """matched prompt tokens / all prompt tokens."""
        return self.matched_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def run_trace(
    driver: CacheDriver,
    records: Sequence[TraceRecord],
    *,
    disable_gc: bool = True,
) -> BenchResult:
    """Replay ``records`` through ``driver`` and time the cache cycle of each request.

    Only the calls between ``match`` and ``unlock`` are timed (``time.perf_counter_ns``).
    The garbage collector is paused during the run (``disable_gc``) so its pauses do
    not land on one driver and not the other.

    Raises:
        ValueError: the driver returned a prefix length outside ``[0, len(tokens)-1]``.
    """
    res = BenchResult(name=driver.name)
    was_enabled = gc.isenabled()
    gc.collect()
    if disable_gc:
        gc.disable()
    try:
        with driver.activate():
            _replay(driver, records, res)
            res.leak_ok, res.leak_details = driver.leak_check()
    finally:
        if was_enabled:
            gc.enable()
    return res


def _replay(driver: CacheDriver, records: Sequence[TraceRecord], res: BenchResult) -> None:
    """The timed loop of :func:`run_trace`."""
    op_ns = res.op_ns
    clock = time.perf_counter_ns
    for rec in records:
        n_prompt, n_out = len(rec.tokens), len(rec.output)
        h = driver.begin(rec)

        t0 = clock()
        prefix_len = driver.match(h)
        t1 = clock()
        driver.lock(h)
        t2 = clock()
        driver.alloc_mamba(h)
        t3 = clock()
        driver.alloc_kv(h, n_prompt - prefix_len)
        t4 = clock()
        driver.alloc_kv(h, n_out)
        t5 = clock()
        driver.finish(h)
        t6 = clock()
        driver.unlock(h)
        t7 = clock()

        driver.end(h)
        if not 0 <= prefix_len <= n_prompt - 1:
            raise ValueError(
                f"{driver.name}: rid {rec.rid} matched {prefix_len} tokens of a "
                f"{n_prompt}-token prompt; a match must lie in [0, len(tokens)-1]"
            )
        op_ns["match"] += t1 - t0
        op_ns["lock"] += t2 - t1
        op_ns["alloc_mamba"] += t3 - t2
        op_ns["alloc_extend"] += t4 - t3
        op_ns["alloc_decode"] += t5 - t4
        op_ns["finish"] += t6 - t5
        op_ns["unlock"] += t7 - t6
        res.num_requests += 1
        res.prompt_tokens += n_prompt
        res.output_tokens += n_out
        res.matched_tokens += prefix_len
        res.hits += prefix_len > 0
        res.prefix_lens.append(prefix_len)


def format_result(res: BenchResult) -> str:
    """Human-readable block for one driver."""
    total_ns = sum(res.op_ns.values()) or 1
    breakdown = ", ".join(
        f"{op} {100.0 * ns / total_ns:.0f}%" for op, ns in res.op_ns.items()
    )
    lines = [
        f"[{res.name}] requests={res.num_requests} cache_time={res.cache_seconds:.3f}s "
        f"requests_per_s={res.requests_per_s:.1f}",
        f"[{res.name}] prompt_tokens={res.prompt_tokens} matched_tokens={res.matched_tokens} "
        f"hit_rate={100.0 * res.hit_rate:.2f}% requests_with_hit={res.hits}",
        f"[{res.name}] time by op: {breakdown}",
        f"[{res.name}] leak_check={'ok' if res.leak_ok else 'LEAK'} {res.leak_details}",
    ]
    return "\n".join(lines)


def format_comparison(ours: BenchResult, upstream: BenchResult) -> str:
    """The last line of a side-by-side run: ratios ours / upstream."""
    speedup = ours.requests_per_s / upstream.requests_per_s
    hit_ratio = (
        ours.hit_rate / upstream.hit_rate if upstream.hit_rate > 0 else float("inf")
    )
    return f"speedup={speedup:.3f} hit_ratio={hit_ratio:.4f}"


def median_result(runs: Sequence[BenchResult]) -> BenchResult:
    """The run with the median requests/s among repeated runs of one driver.

    Raises:
        ValueError: the runs disagree on what was matched -- a cache whose hits change
            between identical replays is not deterministic and its numbers mean nothing.
    """
    if not runs:
        raise ValueError("median_result needs at least one run")
    first = runs[0]
    for r in runs[1:]:
        if r.prefix_lens != first.prefix_lens:
            raise ValueError(
                f"{first.name}: repeated runs matched different prefixes; "
                "the cache is not deterministic over identical replays"
            )
    ordered = sorted(runs, key=lambda r: r.requests_per_s)
    return ordered[(len(ordered) - 1) // 2]


class VariantUnavailable(RuntimeError):
    """A benchmark variant's driver cannot be built (its feature is not available here);
    the report prints the reason instead of a row."""
