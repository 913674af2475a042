"""CPU prefill of SGLang's linear-layer kernels: the plugin's torch kernels (the CPU bridges of
``plugin/cpu_bridges.py``, :mod:`sglang_mamba_ext.plugin.cpu_kernels`) against SGLang's Triton
kernels run by Triton's interpreter, side by side in one process (issue 40, item 5).

Per family, one prefill of one layer at the shapes of the project's tiny checkpoints
(``models/hf_tiny.py``) through the bridge's dispatch (``make_kernel_around``), as a served
layer calls it: the causal conv over the packed ``qkv`` / ``xBC`` rows
(``causal_conv1d_fn``) then the layer's scan:

- GDN (Qwen3-Next): ``chunk_gated_delta_rule``, 2 key / 4 value heads of 16;
- KDA (Kimi-Linear): ``chunk_kda``, 4 heads of 16, raw gate with ``A_log`` / ``dt_bias``;
- Mamba2 (Nemotron-H): ``mamba_chunk_scan_combined``, 4 heads of 16, 2 groups, state 16;
- conv (LFM2): ``causal_conv1d_fn`` alone, 64 channels, width 3.

The batch packs ``--seqs`` sequences of ``--tokens`` tokens each, every one continuing from a
cached state. Rounds alternate the order (torch first in even rounds, Triton first in odd
ones) so drift in the machine's load falls on both; each path runs once unmeasured first.
torch runs on ``--threads`` intra-op threads (default 1, as the interpreter uses one core). The
environment variable ``SGLANG_MAMBA_EXT_CPU_KERNELS`` (``torch`` / ``triton``) is what
switches the path, as in serving. Prints the median per family and path, then the last line

    ratios triton/torch: GDN=<x> KDA=<x> Mamba2=<x> conv=<x>
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

FAMILIES = ("GDN", "KDA", "Mamba2", "conv")
CONV = "sglang.kernels.ops.mamba.causal_conv1d_triton.causal_conv1d_fn"
TARGETS = {
    "GDN": "sglang.kernels.ops.attention.fla.chunk.chunk_gated_delta_rule",
    "KDA": "sglang.kernels.ops.attention.fla.kda.chunk_kda",
    "Mamba2": "sglang.kernels.ops.mamba.triton_ops.ssd_combined.mamba_chunk_scan_combined",
}


def _resolve(target):
    import pkgutil

    module, name = target.rsplit(".", 1)
    return getattr(pkgutil.resolve_name(module), name)


def build_cases(tokens: int, seqs: int):
    """Family -> a zero-argument callable running one layer's prefill through the bridge."""
    import torch

    from sglang_mamba_ext.plugin.cpu_bridges import make_kernel_around

    def bridged(target):
        around, original = make_kernel_around(target), _resolve(target)
        return lambda *a, **k: around(original, *a, **k)

    conv = bridged(CONV)
    g = torch.Generator().manual_seed(0)
    half = torch.float16
    T = tokens * seqs
    cu = torch.arange(seqs + 1, dtype=torch.int32) * tokens
    slots = torch.arange(1, seqs + 1, dtype=torch.int32)
    has_init = torch.ones(seqs, dtype=torch.bool)

    def conv_rows(dim, width):
        x = torch.randn(T, dim, generator=g).to(half)
        w, b = torch.randn(dim, width, generator=g) * 0.3, torch.randn(dim, generator=g) * 0.1
        states = torch.randn(seqs + 2, dim, width - 1, generator=g).to(half)
        return lambda: conv(x.t(), w, b, conv_states=states, query_start_loc=cu, seq_lens_cpu=[tokens] * seqs,
                            cache_indices=slots, has_initial_state=has_init, activation="silu").t()

    cases = {}
    # GDN: Hk=2, Hv=4, K=V=16 -> qkv 2*32 + 64 = 128 channels
    gdn, gdn_conv = bridged(TARGETS["GDN"]), conv_rows(128, 4)
    gdn_pool = torch.randn(seqs + 2, 4, 16, 16, generator=g) * 0.1
    gdn_g = torch.nn.functional.logsigmoid(torch.randn(1, T, 4, generator=g))
    gdn_beta = torch.rand(1, T, 4, generator=g).to(half)

    def run_gdn():
        qkv = gdn_conv()
        q, k, v = qkv.split([32, 32, 64], dim=-1)
        return gdn(q.reshape(1, T, 2, 16), k.reshape(1, T, 2, 16), v.reshape(1, T, 4, 16), gdn_g, gdn_beta,
                   initial_state=gdn_pool, initial_state_indices=slots, cu_seqlens=cu.long(),
                   use_qk_l2norm_in_kernel=True)

    cases["GDN"] = run_gdn
    # KDA: H=4, K=V=16 -> qkv 192 channels
    kda, kda_conv = bridged(TARGETS["KDA"]), conv_rows(192, 4)
    kda_pool = torch.randn(seqs + 2, 4, 16, 16, generator=g) * 0.1
    kda_gate = torch.randn(1, T, 4, 16, generator=g).to(half)
    kda_beta = torch.randn(1, T, 4, generator=g).to(half)
    A_log, dt_bias = torch.rand(4, generator=g), torch.randn(64, generator=g) * 0.1

    def run_kda():
        qkv = kda_conv()
        q, k, v = (t.reshape(1, T, 4, 16) for t in qkv.split([64, 64, 64], dim=-1))
        return kda(q, k, v, kda_gate, kda_beta, initial_state=kda_pool, initial_state_indices=slots,
                   use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long(), A_log=A_log, dt_bias=dt_bias,
                   beta_is_raw=True)

    cases["KDA"] = run_kda
    # Mamba2: H=4, P=16, G=2, N=16 -> xBC 64 + 2*32 = 128 channels
    ssd, ssd_conv = bridged(TARGETS["Mamba2"]), conv_rows(128, 4)
    ssm_pool = torch.randn(seqs + 2, 4, 16, 16, generator=g) * 0.1
    dt = torch.randn(1, T, 4, generator=g).to(half)
    A, D, dt_bias2 = -torch.rand(4, generator=g) - 0.5, torch.randn(4, generator=g), torch.randn(4, generator=g) * 0.1
    from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata

    seq_idx = torch.repeat_interleave(torch.arange(seqs, dtype=torch.int32), tokens).unsqueeze(0)
    ci, co = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(cu, 64, T)
    out = torch.empty(1, T, 4, 16, dtype=half)

    def run_mamba2():
        from sglang_mamba_ext.plugin.cpu_bridges import cpu_device_module

        xbc = ssd_conv()
        x, B, C = xbc.split([64, 32, 32], dim=-1)
        with cpu_device_module():
            _, varlen, _ = ssd(x.reshape(1, T, 4, 16), dt, A, B.reshape(1, T, 2, 16), C.reshape(1, T, 2, 16), 64,
                               D=D, dt_bias=dt_bias2, seq_idx=seq_idx, chunk_indices=ci, chunk_offsets=co,
                               cu_seqlens=cu, initial_states=ssm_pool[slots.long()], return_varlen_states=True,
                               return_track_states=True, dt_softplus=True, out=out, state_dtype=torch.float32)
        ssm_pool[slots.long()] = varlen
        return out

    cases["Mamba2"] = run_mamba2
    cases["conv"] = conv_rows(64, 3)  # LFM2: hidden 64, conv_L_cache 3
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128, help="tokens per sequence (default 128: two chunks)")
    ap.add_argument("--seqs", type=int, default=2, help="sequences packed in the prefill (default 2)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the interpreter runs on one core; on a busy "
                         "2-core machine more threads made each small torch op wait tens of ms)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("needs TRITON_INTERPRET=1 (a host without CUDA)", file=sys.stderr)
        return 2
    import torch

    if torch.cuda.is_available():
        print("a CPU benchmark: CUDA is available here", file=sys.stderr)
        return 2
    from sglang_mamba_ext.plugin.cpu_bridges import ACTIVE_ENV, KERNELS_ENV, MAMBA_KERNEL_MODULES
    from sglang_mamba_ext.plugin.triton_interpret import install_interpreter_shims

    install_interpreter_shims(extra_modules=MAMBA_KERNEL_MODULES)
    os.environ[ACTIVE_ENV] = "1"
    torch.set_num_threads(max(1, args.threads))
    families = [f for f in args.families.split(",") if f]
    cases = build_cases(args.tokens, args.seqs)
    times = {(f, p): [] for f in families for p in ("torch", "triton")}

    def run(family, path, measured):
        os.environ[KERNELS_ENV] = path
        t0 = time.perf_counter()
        cases[family]()
        if measured:
            times[(family, path)].append(time.perf_counter() - t0)

    print(f"cpu_prefill: {args.seqs} x {args.tokens} tokens per prefill, {args.rounds} rounds, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    for family in families:
        for path in ("torch", "triton"):
            run(family, path, measured=False)
    for r in range(args.rounds):
        order = ("torch", "triton") if r % 2 == 0 else ("triton", "torch")
        for family in families:
            for path in order:
                run(family, path, measured=True)
        print(f"round {r}: " + "  ".join(
            f"{f} torch {times[(f, 'torch')][-1] * 1e3:.1f} ms / triton {times[(f, 'triton')][-1] * 1e3:.0f} ms"
            for f in families), flush=True)
    ratios = {}
    tokens = args.tokens * args.seqs
    for f in families:
        t_torch, t_tri = statistics.median(times[(f, "torch")]), statistics.median(times[(f, "triton")])
        ratios[f] = t_tri / t_torch
        print(f"{f:7s} torch {t_torch * 1e3:9.2f} ms ({tokens / t_torch:9.0f} tok/s)   "
              f"triton-interpreted {t_tri * 1e3:9.1f} ms ({tokens / t_tri:7.1f} tok/s)   x{ratios[f]:.0f}")
    print("ratios triton/torch: " + " ".join(f"{f}={ratios[f]:.1f}" for f in families))
    return 0


if __name__ == "__main__":
    sys.exit(main())
