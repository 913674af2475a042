"""CPU cost of the in-chunk checkpoint writers per checkpoint, by offset (issue 39; ``docs/design.md``,
"Prefix checkpoints"; ``docs/benchmarks.md``).

``python -m sglang_mamba_ext.benchmarks.checkpoint_cost [--tokens 2048] [--repeats 5] [--old-repeats 2]``

Times the writers' CPU path (``impl="torch"``, what serving on CPU runs) writing one checkpoint
of one row at offset 63 (a branch point inside the first chunk) and at ``tokens - 1`` (the
prompt-end checkpoint of a ``tokens``-token extend) of a ``tokens``-token extend, for a GDN / KDA
stack (KDA gate) and a Mamba2 stack at layer shapes scaled to the 2-core machine (the real ones'
head count cut, head sizes kept in proportion), three ways:

- from the prefill's chunk states (what serving runs where SGLang's extend kernel returns them:
  its Triton GDN / KDA kernels' ``h``, Mamba2's SSD ``states``; ``ops/inchunk/from_chunks.py``):
  the states are computed once beforehand, as the prefill computes them anyway;
- from the writer's own chunked pass (kernels that return no chunk states);
- the old token scan from the extend start (``impl="reference"``; fewer repeats: slow at the
  deep offset).

Offsets alternate within each repeat; the median of the repeats is kept. Milliseconds per
checkpoint, torch threads as set (``torch.get_num_threads()``).

Output: one line per path, kind of layer and offset, then ``old_inchunk_offset_ratio=..
old_mamba2_offset_ratio=..``, ``selfpass_inchunk_offset_ratio=.. selfpass_mamba2_offset_ratio=..``
and last ``inchunk_offset_ratio=X mamba2_offset_ratio=Y`` (from the chunk states: cost at the
deep offset over the cost at 63; issue 39's target <= 1.5 each). Exit status 0, or 2 on bad
arguments.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape
from sglang_mamba_ext.speculative.ops.inchunk import plan_writes, write_checkpoints
from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_checkpoints
from sglang_mamba_ext.speculative.replay import ReplayWeights

#: KDA stack: Kimi-Linear's 32 heads of 128 cut to 4 heads of 32, conv 4, 2 layers.
KDA_SHAPE = LinearAttnShape(4, 4, 32, 32, 4)
#: Mamba2 stack (Nemotron-H-like): 8 heads of P=16, N=32, one group, conv 4, 2 layers.
MAMBA2_DIMS = dict(HV=8, P=16, N=32, G=1, W=4)
LAYERS = 2
SHALLOW = 63


def _kda_case(T: int):
    torch.manual_seed(0)
    ms = [GatedDeltaRuleMixer(32, KDA_SHAPE, conv_bias=True, gate="kda") for _ in range(LAYERS)]
    with torch.no_grad():
        for m in ms:
            m.A_log.normal_(0, 0.5)
            m.dt_bias.normal_()
    w = ReplayWeights.from_mixers(ms)
    g = torch.Generator().manual_seed(1)
    s = KDA_SHAPE
    mixed = torch.randn(LAYERS, T, s.conv_dim, generator=g)
    g_raw = torch.randn(LAYERS, T, s.num_v_heads * s.head_k_dim, generator=g)
    b_raw = torch.randn(LAYERS, T, s.num_v_heads, generator=g)
    conv = torch.randn(LAYERS, 3, s.conv_dim, s.conv_kernel - 1, generator=g)
    temp = torch.randn(LAYERS, 3, *s.temporal_state_shape, generator=g) * 0.1

    # the prefill's chunk states (SGLang's h): the state at every 64-token chunk start of the row
    nt = (T + 63) // 64
    cconv = torch.cat([conv, conv.new_zeros(LAYERS, nt, *conv.shape[2:])], 1)
    ctemp = torch.cat([temp, temp.new_zeros(LAYERS, nt, *temp.shape[2:])], 1)
    write_checkpoints(mixed, g_raw, b_raw, plan_writes([(0, 1, [(c * 64, 3 + c) for c in range(nt)])], "cpu"),
                      cconv, ctemp, w, impl="torch")
    h = ctemp[:, 3:].clone()

    def run(offset: int, impl: str) -> None:
        kw = {}
        if impl == "chunks":  # the serving path where SGLang's extend kernel returns h
            impl, kw = "torch", dict(chunk_states=h, first_chunks=[0], row_lengths=[T])
        write_checkpoints(mixed, g_raw, b_raw, plan_writes([(0, 1, [(offset, 2)])], "cpu"), conv, temp, w,
                          impl=impl, **kw)
    return run


def _mamba2_case(T: int):
    from sglang_mamba_ext.speculative.ops.inchunk.gpu_check_mamba2 import random_mamba2_weights

    d = MAMBA2_DIMS
    w = random_mamba2_weights(LAYERS, d["HV"], d["P"], d["N"], d["G"], d["W"], seed=0, bias=True)
    D = d["HV"] * d["P"] + 2 * d["G"] * d["N"]
    g = torch.Generator().manual_seed(1)
    xbc = torch.randn(LAYERS, T, D, generator=g)
    dt = torch.randn(LAYERS, T, d["HV"], generator=g)
    conv = torch.randn(LAYERS, 3, D, d["W"] - 1, generator=g)
    ssm = torch.randn(LAYERS, 3, d["HV"], d["P"], d["N"], generator=g) * 0.1

    # the scan's chunk states (SGLang's SSD ``states``): the state at every 64-token grid start
    nt = (T + 63) // 64
    cconv = torch.cat([conv, conv.new_zeros(LAYERS, nt, *conv.shape[2:])], 1)
    cssm = torch.cat([ssm, ssm.new_zeros(LAYERS, nt, *ssm.shape[2:])], 1)
    write_mamba2_checkpoints(xbc, dt, plan_writes([(0, 1, [(c * 64, 3 + c) for c in range(nt)])], "cpu"), cconv, cssm,
                             w, impl="torch")
    states = cssm[:, 3:].clone()

    def run(offset: int, impl: str) -> None:
        kw = {}
        if impl == "chunks":  # the serving path: SGLang's scan returns its chunk states
            impl, kw = "torch", dict(chunk_states=states, row_lengths=[T])
        write_mamba2_checkpoints(xbc, dt, plan_writes([(0, 1, [(offset, 2)])], "cpu"), conv, ssm, w, impl=impl, **kw)
    return run


def time_offsets(run: Callable[[int, str], None], impl: str, offsets: List[int], repeats: int) -> Dict[int, float]:
    """Median milliseconds of ``run(offset, impl)`` per offset; the offsets alternate within each
    repeat (one warm-up call each first)."""
    times: Dict[int, List[float]] = {o: [] for o in offsets}
    with torch.no_grad():
        for o in offsets:
            run(o, impl)
        for r in range(repeats):
            for o in (offsets if r % 2 == 0 else offsets[::-1]):
                t0 = time.perf_counter()
                run(o, impl)
                times[o].append((time.perf_counter() - t0) * 1e3)
    return {o: statistics.median(ts) for o, ts in times.items()}


def parse_args(argv: Optional[List[str]]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m sglang_mamba_ext.benchmarks.checkpoint_cost",
                                description="CPU cost of the in-chunk checkpoint writers per checkpoint, by offset")
    p.add_argument("--tokens", type=int, default=2048, help="extend length; the deep offset is tokens-1 (default 2048)")
    p.add_argument("--repeats", type=int, default=5, help="timed repeats of the writers (default 5)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core machine more threads thrash)")
    p.add_argument("--old-repeats", type=int, default=2,
                   help="timed repeats of the old token-scan writer (default 2; 0 skips it)")
    a = p.parse_args(argv)
    if a.tokens < SHALLOW + 2:
        p.error(f"--tokens must be at least {SHALLOW + 2}")
    if a.repeats < 1 or a.old_repeats < 0 or a.threads < 1:
        p.error("--repeats and --threads must be >= 1 and --old-repeats >= 0")
    return a


def main(argv: Optional[List[str]] = None) -> int:
    try:
        a = parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    torch.set_num_threads(a.threads)
    deep = a.tokens - 1
    offsets = [SHALLOW, deep]
    print(f"checkpoint_cost: one checkpoint of one row of a {a.tokens}-token extend, {LAYERS} layers; KDA {KDA_SHAPE}; "
          f"Mamba2 {MAMBA2_DIMS}; torch threads {torch.get_num_threads()}; median of {a.repeats} "
          f"(old writer: {a.old_repeats}) alternating repeats")
    ratios = {}
    label = {"chunks": "from the prefill's chunk states", "torch": "own chunked pass", "reference": "old token scan"}
    for name, case in (("inchunk", _kda_case(a.tokens)), ("mamba2", _mamba2_case(a.tokens))):
        runs = [("chunks", a.repeats, ""), ("torch", a.repeats, "selfpass_"), ("reference", a.old_repeats, "old_")]
        for impl, reps, tag in runs:
            if reps == 0:
                continue
            t = time_offsets(case, impl, offsets, reps)
            ratios[tag + name] = t[deep] / t[SHALLOW]
            print(f"  {name:8s} {label[impl]:32s} ms per checkpoint: "
                  f"offset {SHALLOW}: {t[SHALLOW]:.3f}  offset {deep}: {t[deep]:.3f}  ratio {ratios[tag + name]:.3f}")
    if "old_inchunk" in ratios:
        print(f"old_inchunk_offset_ratio={ratios['old_inchunk']:.3f} old_mamba2_offset_ratio={ratios['old_mamba2']:.3f}")
    print(f"selfpass_inchunk_offset_ratio={ratios['selfpass_inchunk']:.3f} "
          f"selfpass_mamba2_offset_ratio={ratios['selfpass_mamba2']:.3f}")
    print(f"inchunk_offset_ratio={ratios['inchunk']:.3f} mamba2_offset_ratio={ratios['mamba2']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
