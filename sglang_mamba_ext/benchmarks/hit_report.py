"""Comparison arithmetic and the table of the hit-rate benchmark (:mod:`.hit_rate`): the best
result per side (``ours`` / ``upstream`` / ``oracle`` / ``bound``), ``hit_ratio``,
``recompute_ratio``, ``oracle_ratio`` and ``upper_bound_ratio`` of a list of ``HitResult`` rows,
and one table per pool size. Plain Python; no cache is run here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

if TYPE_CHECKING:
    from sglang_mamba_ext.benchmarks.hit_rate import HitResult


def best_of(results: Sequence[HitResult], side: str) -> Optional[HitResult]:
    """The result of ``side`` with the highest hit rate (first on ties), or None."""
    best = None
    for r in results:
        if r.side == side and (best is None or r.hit_rate > best.hit_rate):
            best = r
    return best


def comparison(results: Sequence[HitResult]) -> tuple[float, float, str, str]:
    """``(hit_ratio, recompute_ratio, ours_name, upstream_name)`` of the best of each
    side; NaN (and name "-") where a side has no result."""
    ours, up = best_of(results, "ours"), best_of(results, "upstream")
    if ours is None or up is None:
        return (
            math.nan,
            math.nan,
            ours.name if ours else "-",
            up.name if up else "-",
        )
    hit_ratio = ours.hit_rate / up.hit_rate if up.hit_rate > 0 else math.inf
    rec_ratio = (
        ours.recomputed_tokens / up.recomputed_tokens
        if up.recomputed_tokens > 0
        else math.inf
    )
    return hit_ratio, rec_ratio, ours.name, up.name


def format_table(
    mamba_size: int,
    kv_size: int,
    results: Sequence[HitResult],
    unavailable: dict[str, str],
    order: Sequence[str],
) -> str:
    head = (
        f"{'variant':<26} {'hit rate':>8} {'KV ceil':>8} {'recomputed':>11} "
        f"{'req w/ hit':>10} {'state copies':>12} {'leak':>5} {'sec':>6}"
    )
    lines = [f"== SSM pool {mamba_size} slots, KV pool {kv_size} tokens, page_size 1 ==", head]
    by_name = {r.name: r for r in results}
    for name in order:
        if name in unavailable:
            lines.append(f"{name:<26} not available ({unavailable[name]})")
            continue
        r = by_name[name]
        ceil = "n/a" if r.kv_ceiling is None else f"{100 * r.kv_ceiling:.2f}%"
        lines.append(
            f"{r.name:<26} {100 * r.hit_rate:>7.2f}% {ceil:>8} {r.recomputed_tokens:>11,} "
            f"{r.hits:>10} {r.state_copies:>12,} {'ok' if r.leak_ok else 'LEAK':>5} "
            f"{r.seconds:>6.1f}"
        )
    return "\n".join(lines)


def oracle_ratio(results: Sequence[HitResult]) -> tuple[float, str]:
    """``(ours best hit rate / offline bound, bound_name)``: the bound is the best
    ``"oracle"`` row; NaN (and "-") without an ours or an oracle row."""
    ours, bound = best_of(results, "ours"), best_of(results, "oracle")
    if ours is None or bound is None:
        return math.nan, bound.name if bound else "-"
    return (ours.hit_rate / bound.hit_rate if bound.hit_rate > 0 else math.inf), bound.name


def default_figures(results: Sequence[HitResult]) -> tuple[float, float]:
    """``(default_hit_ratio, overlap_points)``: the ``ours-default`` row (what
    ``--enable-mamba-radix`` alone selects) over the best ``"upstream"`` row among
    ``results``, and the hit rate in percentage points it loses under overlap timing
    (``ours-default`` minus ``ours-default-overlap``); NaN where a row is missing."""
    by_name = {r.name: r for r in results}
    ours, up = by_name.get("ours-default"), best_of(results, "upstream")
    ratio = math.nan if ours is None or up is None else (ours.hit_rate / up.hit_rate if up.hit_rate > 0 else math.inf)
    over = by_name.get("ours-default-overlap")
    points = math.nan if ours is None or over is None else 100 * (ours.hit_rate - over.hit_rate)
    return ratio, points


def upper_bound_ratio(results: Sequence[HitResult]) -> float:
    """Ours' best hit rate over the ``"bound"`` row's (:mod:`.upper_bound`); NaN without
    an ours or a bound row."""
    ours, bound = best_of(results, "ours"), best_of(results, "bound")
    if ours is None or bound is None:
        return math.nan
    return ours.hit_rate / bound.hit_rate if bound.hit_rate > 0 else math.inf


def fmt_ratio(x: float) -> str:
    """A ratio with 4 decimals, or ``nan``."""
    return "nan" if math.isnan(x) else f"{x:.4f}"
