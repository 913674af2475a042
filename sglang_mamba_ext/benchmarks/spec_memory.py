"""Plan the memory of the speculative SSM/conv buffers: snapshot (SGLang today) vs deferred.

For Kimi-Linear-48B-A3B, Qwen3-Next-80B-A3B and Nemotron-H-8B (a Mamba2 hybrid) — shapes from
their published ``config.json`` files, cited in ``sglang_mamba_ext/speculative/reference/sizing.py`` — and the
given ``--topk / --steps / --draft-token-num / --max-running-requests / --dtype``, prints the
resident and peak bytes of

- snapshot mode: SGLang's per-layer intermediate SSM + conv-window buffers
  ``[L, N+1, T, state]`` (resident for the server's life; peak = resident);
- deferred mode (``docs/design.md``, "Deferred update"): resident = the accepted-token activation stash; peak = stash + the
  verify workspace (all nodes' raw activations until acceptance, one layer of per-node conv
  windows, and the per-node SSM states of the verify variant: ``one_layer`` (``docs/design.md``, "Speculative verify"),
  ``head_chunk`` (one-layer buffer for ``--head-chunk`` value heads at a time) or ``on_chip``
  (Triton kernel keeping node states in registers: no buffer)),

each both from the closed-form formula and from constructing this project's buffer classes on
CPU at a reduced size (1 layer, 2 rows, 2 draft tokens, full per-layer shapes) and scaling; the
two must agree (the script exits non-zero otherwise).

Last line, always for Kimi-Linear-48B-A3B, topk=4, steps=3, draft_token_num=63,
max_running_requests=32, bf16 (states, conv windows and activations), deferred verify variant
``on_chip``::

    peak_reduction=<snapshot peak / deferred peak> resident_reduction=<snapshot / stash>

Usage: ``python -m sglang_mamba_ext.benchmarks.spec_memory [--topk 4 --steps 3 --draft-token-num 63
--max-running-requests 32 --dtype bf16 --ssm-dtype fp32 --head-chunk 1]`` (or
``python scripts/plan_spec_memory.py`` with the same arguments).
"""

from __future__ import annotations

import argparse
import sys

import torch

from sglang_mamba_ext.speculative.reference.sizing import MODELS, VARIANTS, spec_memory_formula, spec_memory_measured

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def gib(x: int) -> str:
    return f"{x / 2**30:10.3f} GiB"


def report(name, args, dtype, ssm_dtype) -> bool:
    m = MODELS[name]
    kw = dict(topk=args.topk, steps=args.steps, draft_token_num=args.draft_token_num, max_running=args.max_running_requests,
              dtype=dtype, ssm_dtype=ssm_dtype, head_chunk=args.head_chunk)
    f = spec_memory_formula(m, **kw)
    c = spec_memory_measured(m, **kw)
    ok = True
    print(f"== {m.name} ({m.kind}, L={m.num_linear_layers} linear layers, shape {m.shape})")
    print(f"   source: {m.source}")
    print(f"   {'':34s}{'formula':>16s}{'constructed':>16s}")

    def row(label, a, b):
        nonlocal ok
        ok &= a == b
        print(f"   {label:34s}{gib(a):>16s}{gib(b):>16s}{'' if a == b else '   MISMATCH'}")

    row("snapshot resident = peak", f.snapshot, c.snapshot)
    row("deferred resident (stash)", f.stash, c.stash)
    row("  verify workspace: pending acts", f.pending, c.pending)
    row("  verify workspace: conv windows", f.conv_windows, c.conv_windows)
    for v in VARIANTS:
        row(f"  node states [{v}]", f.node_states[v], c.node_states[v])
    for v in VARIANTS:
        row(f"deferred peak [{v}]", f.deferred_peak(v), c.deferred_peak(v))
    print(f"   resident reduction: {f.resident_reduction():.1f}x; peak reduction: "
          + ", ".join(f"{v} {f.peak_reduction(v):.1f}x" for v in VARIANTS)
          + f"  (L = {m.num_linear_layers})")
    return ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topk", type=int, default=4, help="--speculative-eagle-topk")
    ap.add_argument("--steps", type=int, default=3, help="--speculative-num-steps")
    ap.add_argument("--draft-token-num", type=int, default=63, help="--speculative-num-draft-tokens")
    ap.add_argument("--max-running-requests", type=int, default=32)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="conv window / activation dtype")
    ap.add_argument("--ssm-dtype", choices=sorted(DTYPES), default=None, help="SSM state dtype (default: --dtype)")
    ap.add_argument("--head-chunk", type=int, default=1, help="value heads per pass of the head_chunk variant")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ", ".join(MODELS))
    args = ap.parse_args(argv)
    dtype = DTYPES[args.dtype]
    ssm_dtype = DTYPES[args.ssm_dtype] if args.ssm_dtype else None
    print(f"topk={args.topk} steps={args.steps} draft_token_num={args.draft_token_num} "
          f"max_running_requests={args.max_running_requests} dtype={args.dtype} ssm_dtype={args.ssm_dtype or args.dtype}")
    ok = True
    for name in args.models.split(","):
        if name not in MODELS:
            ap.error(f"--models: unknown model {name!r}; choose from {', '.join(MODELS)}")
        ok &= report(name, args, dtype, ssm_dtype)
    # the headline configuration (issue 5)
    m = MODELS["Kimi-Linear-48B-A3B"]
    kw = dict(topk=4, steps=3, draft_token_num=63, max_running=32, dtype=torch.bfloat16)
    f = spec_memory_formula(m, **kw)
    c = spec_memory_measured(m, **kw)
    ok &= f.snapshot == c.snapshot and f.deferred_peak("on_chip") == c.deferred_peak("on_chip") and f.stash == c.stash
    print("headline: Kimi-Linear-48B-A3B topk=4 steps=3 draft_token_num=63 max_running=32 bf16, "
          f"deferred verify=on_chip (one_layer would give peak {f.peak_reduction('one_layer'):.1f}x); L={m.num_linear_layers}")
    if not ok:
        print("formula and constructed buffers disagree", file=sys.stderr)
        return 1
    print(f"peak_reduction={f.peak_reduction('on_chip'):.1f} resident_reduction={f.resident_reduction():.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
