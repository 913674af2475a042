"""GPU check of the in-chunk checkpoint writer (``docs/design.md``, "Prefix checkpoints"), run
by ``scripts/gpu_check.sh`` after the speculative check, or alone as ``python -m
sglang_mamba_ext.speculative.ops.inchunk.gpu_check``; torch + Triton (+ fla, if installed, for
the chunked reference), no SGLang, no network.

(1) Correctness: the Triton writer against the torch reference (KDA and GDN gates, fp32, and
bf16 activations), and on CUDA against fla's chunked kernels (``chunk_kda`` /
``chunk_gated_delta_rule``: the final state after ``p`` tokens from the same start state, the
kind of kernel SGLang's backends run). (2) Cost at Kimi-Linear-48B-A3B layer shapes (``H = HV =
32``, ``K = V = 128``, ``W = 4``, ``L = 20`` KDA layers, ``N = 8`` requests): one writer call
(all layers) for a checkpoint ``p`` tokens after the extend start (``p = 63``: a branch point
inside the first chunk; ``p = 511``; ``p = 2047``: the prompt-end checkpoint of a 2048-token
prompt; a per-offset table: since issue 39 the writer starts from the chunk boundary below ``p``
and steps at most 63 tokens, the boundary states from its chunked pass), against the linear-attention part of
the prefill a grid checkpoint leaves to recompute (up to 63 tokens per request, fla's chunked
kernel over all layers; the real prefill adds attention, MoE and projections, so this
denominator is a lower bound). Last line: ``inchunk_cost_ratio=<write(p=2047) / linear
prefill of 63 tokens>`` (per checkpoint, all layers). ``--tiny``: toy shapes on CPU under
``TRITON_INTERPRET=1`` (the torch reference stands in for the chunked prefill); without CUDA and
without ``--tiny`` it exits with status 2.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape
from sglang_mamba_ext.speculative.ops.gpu_check import check_args
from sglang_mamba_ext.speculative.ops.inchunk import plan_writes, write_checkpoints
from sglang_mamba_ext.speculative.replay import ReplayWeights


def timed(fn, dev, iters: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def _mixers(L, shape, gate, dev, seed=0):
    torch.manual_seed(seed)
    ms = [GatedDeltaRuleMixer(32, shape, conv_bias=True, gate=gate).to(dev) for _ in range(L)]
    with torch.no_grad():
        for m in ms:
            m.A_log.normal_(0, 0.5)
            m.dt_bias.normal_()
            m.conv_bias.normal_(0, 0.1)
    return ms


def _inputs(L, T, shape, gate, dev, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    GD = shape.num_v_heads * (1 if gate == "gdn" else shape.head_k_dim)
    mk = lambda *sz: torch.randn(*sz, generator=g).to(dev, dtype)  # noqa: E731
    return mk(L, T, shape.conv_dim), mk(L, T, GD), mk(L, T, shape.num_v_heads)


def _pools(L, slots, shape, dev, conv_dtype, state_dtype):
    conv = torch.randn(L, slots, shape.conv_dim, shape.conv_kernel - 1, device=dev).to(conv_dtype)
    temp = (torch.randn(L, slots, *shape.temporal_state_shape, device=dev) * 0.1).to(state_dtype)
    return conv, temp


def check_correctness(shape, dev, act_dtype, state_dtype, tiny: bool = False) -> float:
    """Max abs error of Triton vs torch, both gates, two rows (one from a prefix state, one
    fresh: checkpoints inside, at offset 0 and at the row's end). ``tiny``: one layer and half
    the offsets (the interpreter steps each token; ``tests/test_inchunk_checkpoints.py`` checks
    the writer at more shapes)."""
    if tiny:
        L, T, rows = 1, 12, [(0, 1, [(3, 3), (5, 4)]), (6, -1, [(2, 5), (0, 6), (6, 7)])]
    else:
        L, T, rows = 2, 24, [(0, 1, [(7, 3), (11, 4)]), (12, -1, [(2, 5), (0, 6), (12, 7)])]
    err = 0.0
    for gate in ("kda", "gdn"):
        w = ReplayWeights.from_mixers(_mixers(L, shape, gate, dev))
        mixed, g_raw, b_raw = _inputs(L, T, shape, gate, dev, act_dtype)
        writes = plan_writes(rows, dev)
        out = {}
        pools = _pools(L, 9, shape, dev, act_dtype, state_dtype)
        for impl in ("torch", "triton"):
            conv, temp = (x.clone() for x in pools)
            with torch.no_grad():
                write_checkpoints(mixed, g_raw, b_raw, writes, conv, temp, w, impl=impl)
            out[impl] = (conv.float(), temp.float())
        err = max(err, (out["torch"][0] - out["triton"][0]).abs().max().item(),
                  (out["torch"][1] - out["triton"][1]).abs().max().item())
    return err


def _fla_chunk(gate):
    try:
        if gate == "kda":
            from fla.ops.kda import chunk_kda as fn
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fn
        return fn
    except Exception:  # fla not installed / no kernel for this GPU
        return None


def _post_conv(mixer, mixed, g_raw, b_raw, conv0):
    """q, k, v, g, beta of one layer for fla (batch 1), from raw inputs and a start window."""
    with torch.no_grad():
        y, _ = mixer.conv(mixed, conv0)
        y = y.to(mixed.dtype)
        q, k, v = mixer.split_qkv(y)
        g, beta = mixer.activate_gates(g_raw, b_raw)
    return q, k, v, g, beta


def check_against_fla(shape, dev) -> float:
    """Max abs error of the writer's state after ``p`` tokens vs fla's chunked kernel (CUDA)."""
    err = 0.0
    for gate in ("kda", "gdn"):
        fn = _fla_chunk(gate)
        if fn is None:
            print(f"  fla chunk kernel for {gate}: not available, skipped")
            continue
        (m,) = _mixers(1, shape, gate, dev, seed=3)
        w = ReplayWeights.from_mixers([m])
        T = 200
        mixed, g_raw, b_raw = _inputs(1, T, shape, gate, dev, torch.float32, seed=4)
        conv, temp = _pools(1, 4, shape, dev, torch.float32, torch.float32)
        for p in (1, 63, 64, 130, 200):
            with torch.no_grad():
                write_checkpoints(mixed, g_raw, b_raw, plan_writes([(0, 1, [(p, 2)])], dev), conv, temp, w)
            q, k, v, g, beta = _post_conv(m, mixed[0, :p], g_raw[0, :p], b_raw[0, :p], conv[0, 1])
            qk = [x.repeat_interleave(shape.num_v_heads // shape.num_k_heads, dim=1) for x in (q, k)]
            gg = g if gate == "kda" else g[..., 0]
            with torch.no_grad():
                _, S = fn(qk[0][None], qk[1][None], v[None], gg[None], beta[None], scale=shape.head_k_dim ** -0.5,
                          initial_state=temp[0, 1][None].clone(), output_final_state=True)
            err = max(err, (S[0].float() - temp[0, 2].float()).abs().max().item())
    return err


def main(argv=None) -> int:
    parsed = check_args("python -m sglang_mamba_ext.speculative.ops.inchunk.gpu_check", argv, iters=10)
    if parsed is None:
        return 2
    args, dev, sdt = parsed
    act = torch.bfloat16
    if args.tiny:
        # offsets a few tokens past a chunk start (the writer's interpreted token loop is the
        # cost: p=100, 36 tokens past 64, took 8 s per checkpoint; p=70 under 1 s)
        shape, L, N, P_in, P_mid, P_end, iters = LinearAttnShape(2, 2, 8, 8, 4), 1, 2, 3, 66, 70, 1
    else:
        shape, L, N, P_in, P_mid, P_end, iters = LinearAttnShape(32, 32, 128, 128, 4), 20, 8, 63, 511, 2047, args.iters
    s = shape
    print(f"[inchunk] device: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; shape {s}; L={L} N={N}; "
          f"activations bf16, SSM state {args.state_dtype}")
    small = LinearAttnShape(2, 4, 16, 16, 4)
    e32 = check_correctness(small, dev, torch.float32, torch.float32, args.tiny)
    e16 = check_correctness(small, dev, act, sdt, args.tiny)
    ok = e32 < 1e-4 and e16 < 5e-2
    line = f"[inchunk] correctness: triton-vs-torch max|err| fp32={e32:.2e} (tol 1e-4) bf16={e16:.2e} (tol 5e-2)"
    if dev.type == "cuda":
        ef = check_against_fla(small, dev)
        ok &= ef < 5e-3
        line += f"  vs fla chunked kernels={ef:.2e} (tol 5e-3)"
    print(line)

    # ---- cost: one writer call (all L layers, N requests, one checkpoint each)
    gate = "kda"
    w = ReplayWeights.from_mixers(_mixers(L, shape, gate, dev))
    T = N * (P_end + 1)
    mixed, g_raw, b_raw = _inputs(L, T, shape, gate, dev, act)
    conv, temp = _pools(L, 2 * N + 1, shape, dev, act, sdt)

    # the prefill's chunk states (SGLang's h, in the activations' dtype): every 64-token chunk
    # start of every row; values do not change the cost (exactness: tests/test_inchunk_from_chunks.py)
    per_row = (P_end + 1 + 63) // 64
    h = torch.randn(L, N * per_row, s.num_v_heads, s.head_v_dim, s.head_k_dim, device=dev).to(act).transpose(-1, -2)

    def writer(p, from_chunks=True):
        writes = plan_writes([(i * (P_end + 1), i, [(p, N + i)]) for i in range(N)], dev)
        kw = dict(chunk_states=h, first_chunks=[i * per_row for i in range(N)], row_lengths=[P_end + 1] * N) \
            if from_chunks else {}
        return lambda: write_checkpoints(mixed, g_raw, b_raw, writes, conv, temp, w, **kw)

    with torch.no_grad():
        warm = 0 if args.tiny else 2
        times = {p: timed(writer(p), dev, iters, warm) for p in (P_in, P_mid, P_end)}
        own = {p: timed(writer(p, False), dev, iters, warm) for p in (P_in, P_mid, P_end)}
        t_in, t_end = times[P_in], times[P_end]

    # ---- what a grid checkpoint leaves to recompute: up to 63 tokens per request (linear layers)
    saved = P_in
    mixers = w.mixers
    fn = _fla_chunk(gate) if dev.type == "cuda" else None
    if fn is not None:
        HV, K, V = s.num_v_heads, s.head_k_dim, s.head_v_dim
        Ts = N * saved
        q = F.normalize(torch.randn(1, Ts, HV, K, device=dev), dim=-1).to(act)
        k = F.normalize(torch.randn(1, Ts, HV, K, device=dev), dim=-1).to(act)
        v = torch.randn(1, Ts, HV, V, device=dev).to(act)
        g = -torch.rand(1, Ts, HV, K, device=dev) * 0.1
        beta = torch.rand(1, Ts, HV, device=dev).to(act)
        cu = torch.arange(0, Ts + 1, saved, device=dev, dtype=torch.int32).to(torch.long)
        h0 = torch.zeros(N, HV, K, V, device=dev)

        def prefill():
            for _ in range(L):
                fn(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        how = "fla chunk_kda"
    else:
        def prefill():
            for l, m in enumerate(mixers):
                for i in range(N):
                    lo = i * (P_end + 1)
                    gg, bb = m.activate_gates(g_raw[l, lo:lo + saved], b_raw[l, lo:lo + saved])
                    m.run_segments(mixed[l, lo:lo + saved], gg, bb, conv[l, i], temp[l, i].float())
        how = "torch reference (no CUDA)"
    with torch.no_grad():
        t_pre = timed(prefill, dev, iters, warm)
    print(f"[inchunk] time (all {L} layers, {N} requests, one checkpoint each): write(p={P_in})={t_in:.3f} ms  "
          f"write(p={P_end})={t_end:.3f} ms  linear prefill of {saved} tokens/request ({how})={t_pre:.3f} ms")
    print(f"[inchunk] per checkpoint: write(p={P_end})={t_end / N:.4f} ms, write(p={P_in})={t_in / N:.4f} ms; "
          f"correctness {'OK' if ok else 'FAILED'}")
    print("[inchunk] per checkpoint by offset (all layers), from the prefill's chunk states: "
          + "  ".join(f"p={p}: {t / N:.4f} ms" for p, t in times.items())
          + f"  (linear prefill of {saved} tokens per request: {t_pre / N:.4f} ms)")
    print("[inchunk] per checkpoint by offset, boundary states from the writer's own chunked pass (kernels "
          "without h): " + "  ".join(f"p={p}: {t / N:.4f} ms" for p, t in own.items())
          + f"; inchunk_selfpass_cost_ratio={own[P_end] / t_pre:.4f}")
    print(f"inchunk_cost_ratio={t_end / t_pre:.4f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
