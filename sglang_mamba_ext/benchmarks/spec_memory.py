"""Memory of the speculative SSM/conv buffers as SGLang builds them, snapshot vs deferred, and
what it does to SGLang's pool sizes (issue 15, item 3).

For Kimi-Linear-48B-A3B and Qwen3-Next-80B-A3B (published ``config.json`` fields, cited in
``sglang_mamba_ext/benchmarks/sglang_pools.py``; same shapes as
``speculative/reference/sizing.py``), and Qwen3.5-27B (its ``text_config``) and
Nemotron-Nano-9B-v2 (Mamba2: the deferred pool in the Mamba2 layout, ``plugin/speculative/mamba2_verify.py``)
at a stated per-GPU memory budget and TP size, runs SGLang's
own pool sizing and ``MambaPool`` construction in-process on CPU (device memory query simulated,
tensors on the ``meta`` device; :func:`sglang_mamba_ext.benchmarks.sglang_pools.size_pools`)
once with ``--mamba-spec-state-update snapshot`` (SGLang's path) and once with ``deferred``,
and prints per mode:

- bytes of the speculative buffers the pool holds: snapshot ``intermediate_ssm`` +
  ``intermediate_conv_window`` (allocated for the server's life: resident = peak); deferred
  (``DeferredSpecState``): *resident* = the stash, the only part that carries state from one
  round to the next; *peak* = stash + pending verify activations + the verify variant's node
  buffers. The glue preallocates that workspace (fixed addresses for CUDA graphs), so a
  deferred pool *allocates* its peak for the server's life. Its verify variant is chosen by
  the glue's rule (``speculative/verify_onchip.py``): ``on_chip`` (node states in registers,
  ``ops/verify/fused.py``: no node-state SSM buffer, only one layer's conv windows) where the
  per-rank head dims and tree depth fit — Kimi-Linear and Qwen3-Next do — else ``one_layer``
  (one layer's node SSM states and conv windows, reused by every layer). The other variant is
  built too (``SGLANG_MAMBA_EXT_DEFERRED_VERIFY`` forced for that run) and printed beside it;
- SSM pool slots, KV tokens and ``max_running_requests`` as SGLang resolved them.

Reductions are per request row (both modes size their buffers by ``max_running_requests + 1``
rows): snapshot bytes per row / deferred bytes per row. ``capacity_ratio`` is deferred
``max_running_requests`` / snapshot's at the same budget. By default the runs pass
``--max-running-requests 512`` (a user bound above both modes' memory limits, so memory decides;
without it SGLang resets the bound to 48 for speculative decoding, also printed).

Last line, for Kimi-Linear-48B-A3B (TP 1 on a 140 GiB GPU, 48B bf16 weights), topk=4, steps=3,
draft_token_num=63, bf16 states, conv windows, activations and KV, deferred verify variant as
the glue chooses it (``on_chip``)::

    peak_reduction=<x> resident_reduction=<y> capacity_ratio=<z>

Usage: ``python -m sglang_mamba_ext.benchmarks.spec_memory [--topk 4 --steps 3
--draft-token-num 63 --max-running-requests 512 --total-gib 140 --mem-fraction-static 0.88
--ssm-dtype bf16 --tp N --models ...]`` (or ``python scripts/plan_spec_memory.py``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, Optional

from sglang_mamba_ext.benchmarks.sglang_pools import PUBLISHED, PoolResult, size_pools

HEADLINE = "Kimi-Linear-48B-A3B"
#: default tensor-parallel size per model: the smallest that holds the bf16 weights on a 140 GiB GPU
DEFAULT_TP = {"Kimi-Linear-48B-A3B": 1, "Qwen3-Next-80B-A3B": 2, "Qwen3.5-27B": 1, "Nemotron-Nano-9B-v2": 1}
SSM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def gib(x: float) -> str:
    return f"{x / 2**30:.3f} GiB"


def mib(x: float) -> str:
    return f"{x / 2**20:.2f} MiB"


def weights_gib(name: str, tp: int) -> float:
    """bf16 weight bytes per GPU from the nominal parameter count, in GiB."""
    return PUBLISHED[name].params_b * 1e9 * 2 / tp / 2**30


class ModeRow:
    """Per-row and total speculative bytes of one SGLang-built pool (module docstring);
    ``variant``: ``"snapshot"``, or the deferred verify variant the pool was built for."""

    def __init__(self, r: PoolResult):
        self.r = r
        s, rows = r.spec, max(r.rows, 1)
        self.variant = r.verify or "snapshot"
        self.allocated = self.peak = r.spec_bytes
        self.resident = s["stash"] if "stash" in s else r.spec_bytes
        self.rows = rows

    def per_row(self, x: int) -> float:
        return x / self.rows


def _print_mode(label: str, m: Optional[ModeRow], refused: Optional[str] = None) -> None:
    if m is None:
        print(f"   {label}: {refused}")
        return
    r = m.r
    print(f"   {label:20s} resident {gib(m.resident):>12s}  peak {gib(m.peak):>12s}  "
          f"({r.rows} rows; per row resident {mib(m.per_row(m.resident))}, peak {mib(m.per_row(m.peak))})  "
          f"SSM slots {r.max_mamba_cache_size:5d}  KV tokens {r.max_total_num_tokens:9d}  "
          f"max_running_requests {r.max_running_requests:4d}")


def report(name: str, args, tp: int) -> Dict[str, object]:
    """Run and print one model; returns ``{"snapshot": ModeRow, "deferred": ModeRow | None
    (the variant the glue's rule chooses), "other": ModeRow | None (the other variant, forced),
    "refused": str | None}``."""
    w = weights_gib(name, tp)
    free = args.total_gib - w
    kw = dict(total_gib=args.total_gib, free_gib=free, tp=tp, topk=args.topk, steps=args.steps,
              draft_tokens=args.draft_token_num, mem_fraction_static=args.mem_fraction_static,
              ssm_dtype=SSM_DTYPES[args.ssm_dtype])
    bound = ["--max-running-requests", str(args.max_running_requests)] if args.max_running_requests else []
    print(f"== {name}")
    print(f"   config: {PUBLISHED[name].source}")
    print(f"   budget: TP={tp}, {args.total_gib:.1f} GiB per GPU, weights {w:.1f} GiB "
          f"({PUBLISHED[name].params_b:g}B params, bf16, / TP), free after loading {free:.1f} GiB, "
          f"--mem-fraction-static {args.mem_fraction_static}")
    out: Dict[str, object] = {"snapshot": None, "deferred": None, "other": None, "refused": None}
    snap = size_pools(name, "snapshot", extra_argv=bound, **kw)
    if snap.refused:
        print(f"   snapshot: refused by SGLang: {snap.refused}")
        return out
    print(f"   SGLang split {gib(snap.rest_bytes)} between the Mamba and KV pools "
          f"(Mamba slot {mib(snap.slot_bytes)}, {snap.mamba_ratio} slots per request, KV {snap.kv_cell_bytes} B/token)")
    s = out["snapshot"] = ModeRow(snap)
    _print_mode("snapshot", s)
    dfr = size_pools(name, "deferred", extra_argv=bound, **kw)
    if dfr.refused:
        out["refused"] = dfr.refused
        _print_mode("deferred", None, "refused: " + dfr.refused)
        return out
    d = out["deferred"] = ModeRow(dfr)
    other_variant = "one_layer" if d.variant == "on_chip" else "on_chip"
    o = out["other"] = ModeRow(size_pools(name, "deferred", extra_argv=bound, verify=other_variant, **kw))
    _print_mode(f"deferred [{d.variant}]", d)
    _print_mode(f"deferred [{o.variant}]", o)
    for m, note in ((d, "the glue's rule chooses it"), (o, f"forced: SGLANG_MAMBA_EXT_DEFERRED_VERIFY={o.variant}")):
        print(f"   deferred [{m.variant}] bytes per row: " + ", ".join(f"{k} {mib(v / m.rows)}" for k, v in m.r.spec.items()))
        print(f"   peak reduction per row [{m.variant}] {s.per_row(s.peak) / m.per_row(m.peak):.1f}x ({note})")
    print(f"   resident reduction per row (stash) {s.per_row(s.resident) / d.per_row(d.resident):.1f}x; "
          f"allocated at start-up = peak (the glue preallocates its verify workspace)")
    print(f"   capacity: max_running_requests {snap.max_running_requests} -> {dfr.max_running_requests} "
          f"({dfr.max_running_requests / snap.max_running_requests:.2f}x), SSM slots {snap.max_mamba_cache_size} -> "
          f"{dfr.max_mamba_cache_size}, KV tokens {snap.max_total_num_tokens} -> {dfr.max_total_num_tokens} "
          f"[{d.variant}]; [{o.variant}]: {o.r.max_running_requests} requests, {o.r.max_mamba_cache_size} SSM slots, "
          f"{o.r.max_total_num_tokens} KV tokens")
    if bound:
        s48 = size_pools(name, "snapshot", **kw)
        d48 = size_pools(name, "deferred", **kw)
        if not (s48.refused or d48.refused):
            print(f"   without --max-running-requests (SGLang's speculative default 48): max_running_requests "
                  f"{s48.max_running_requests} -> {d48.max_running_requests}, SSM slots {s48.max_mamba_cache_size} -> "
                  f"{d48.max_mamba_cache_size}, KV tokens {s48.max_total_num_tokens} -> {d48.max_total_num_tokens}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topk", type=int, default=4, help="--speculative-eagle-topk")
    ap.add_argument("--steps", type=int, default=3, help="--speculative-num-steps")
    ap.add_argument("--draft-token-num", type=int, default=63, help="--speculative-num-draft-tokens")
    ap.add_argument("--max-running-requests", type=int, default=512,
                    help="passed to SGLang as a user bound (0: not passed; SGLang then uses 48)")
    ap.add_argument("--total-gib", type=float, default=140.0, help="device memory per GPU before loading, GiB")
    ap.add_argument("--mem-fraction-static", type=float, default=0.88)
    ap.add_argument("--ssm-dtype", choices=sorted(SSM_DTYPES), default="bf16", help="SSM state dtype (conv, KV: bf16)")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel size for every model (default: per model, "
                    + ", ".join(f"{k} {v}" for k, v in DEFAULT_TP.items()) + ")")
    ap.add_argument("--models", default=",".join(PUBLISHED), help="comma-separated subset of " + ", ".join(PUBLISHED))
    args = ap.parse_args(argv)
    for name in args.models.split(","):
        if name not in PUBLISHED:
            ap.error(f"--models: unknown model {name!r}; choose from {', '.join(PUBLISHED)}")
    print(f"speculative buffers as SGLang builds them: topk={args.topk} steps={args.steps} "
          f"draft_token_num={args.draft_token_num} ssm={args.ssm_dtype}, conv/activations/KV bf16, "
          f"--max-running-requests {args.max_running_requests or 'not given (48)'}")
    results = {}
    for name in args.models.split(","):
        results[name] = report(name, args, args.tp or DEFAULT_TP[name])
    if any(r["refused"] for r in results.values()):
        print("note: a refused deferred row means the deferred glue (sglang_mamba_ext/plugin/speculative/hooks.py) "
              "does not support that model's linear layers")
    head = results.get(HEADLINE)
    if head is None or head["deferred"] is None:
        print(f"the headline needs {HEADLINE} in deferred mode", file=sys.stderr)
        return 1
    s, d, o = head["snapshot"], head["deferred"], head["other"]
    print(f"headline: {HEADLINE} TP={args.tp or DEFAULT_TP[HEADLINE]} topk={args.topk} steps={args.steps} "
          f"draft_token_num={args.draft_token_num} {args.ssm_dtype}; deferred verify variant {d.variant} (what the glue "
          f"builds by its rule; {o.variant} gives peak {s.per_row(s.peak) / o.per_row(o.peak):.1f}x); "
          "resident = stash; per request row")
    print(f"peak_reduction={s.per_row(s.peak) / d.per_row(d.peak):.1f} "
          f"resident_reduction={s.per_row(s.resident) / d.per_row(d.resident):.1f} "
          f"capacity_ratio={d.r.max_running_requests / s.r.max_running_requests:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
