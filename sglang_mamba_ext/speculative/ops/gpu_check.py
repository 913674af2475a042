"""GPU check of the speculative kernels at Kimi-Linear-48B-A3B layer shapes (H = HV = 32,
K = V = 128, W = 4), torch + Triton only (no SGLang, no network), run as ``python -m
sglang_mamba_ext.speculative.ops.gpu_check`` (``scripts/gpu_check.sh`` on a GPU machine):
(1) correctness of the Triton replay against the torch reference and of the Triton tree verify
(on-chip and buffered) against the torch tree recurrence, a few requests and layers, and of the
glue's on-chip verify entry (``speculative/verify_onchip.py::onchip_tree_verify``: SGLang's
``target_verify`` arguments, raw gates, states ``[slots, HV, V, K]``) at Kimi-Linear (KDA) and
Qwen3-Next TP-2 (GDN, H = 8, HV = 16) per-rank shapes; (2) time over all ``L = 20`` KDA layers,
``N = 32`` requests, a ``T = 63`` node tree and 4 committed tokens per request of ``verify``
(snapshot mode's buffered recurrence, a buffer per layer), ``verify_one_layer`` (the deferred
mode's one-layer node buffer reused by every layer, what the glue runs where the shapes do not
fit on chip), ``replay`` (2 launches), ``verify_onchip`` (the kernel alone), ``verify_glue``
(the glue's on-chip entry: gates, L2 norm, tree tables and the kernel, per layer) and
``verify_fused`` (the on-chip verify with the pending tokens folded into its state load), with
the line ``onchip_vs_one_layer=<verify_glue / verify_one_layer>``; (3) ``torch.cuda.max_memory_allocated`` above the main pools
during one verify round, snapshot vs deferred (``docs/design.md``, "Deferred update"). Last
lines ``memory_ratio=<snapshot/deferred>`` and ``replay_overhead=<replay/verify>`` (target:
replay <= 2 % of verify). ``--tiny`` runs the same path at toy shapes on CPU with
``TRITON_INTERPRET=1``; without CUDA and without ``--tiny`` it exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape
from sglang_mamba_ext.speculative.ops.verify.fused import tree_recurrence_triton
from sglang_mamba_ext.speculative.ops.verify.naive import tree_recurrence
from sglang_mamba_ext.speculative.replay import ReplayWeights, replay
from sglang_mamba_ext.speculative.stash import ActivationStash, StashDims
from sglang_mamba_ext.speculative.tree import DraftTree, TreeIndex
from sglang_mamba_ext.speculative.verify_buffers import OneLayerBuffer


def heap_tree(N: int, T: int, branching: int) -> DraftTree:
    parents = [-1] + [(i - 1) // branching for i in range(1, T)]
    return DraftTree(torch.zeros(N, T, dtype=torch.long), torch.tensor([parents] * N))


def timed(fn, dev, iters: int) -> float:
    """Median milliseconds of ``fn()``."""
    for _ in range(2):
        fn()
    ts = []
    for _ in range(iters):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            ts.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def make_layers(L, shape, dev, seed=0):
    torch.manual_seed(seed)
    ms = [GatedDeltaRuleMixer(32, shape, conv_bias=True).to(dev) for _ in range(L)]
    with torch.no_grad():
        for m in ms:
            m.A_log.normal_(0, 0.5)
            m.dt_bias.normal_()
            m.conv_bias.normal_(0, 0.1)
    return ms


def fill_stash(stash: ActivationStash, gen):
    with torch.no_grad():
        for t in (stash.mixed_qkv, stash.g_raw, stash.b_raw):
            t.copy_(torch.randn(t.shape, generator=gen, device="cpu").to(t.dtype))


def verify_inputs(N, T, shape, dev, act_dtype):
    s = shape
    q = torch.nn.functional.normalize(torch.randn(N, T, s.num_k_heads, s.head_k_dim, device=dev), dim=-1).to(act_dtype)
    k = torch.nn.functional.normalize(torch.randn(N, T, s.num_k_heads, s.head_k_dim, device=dev), dim=-1).to(act_dtype)
    v = torch.randn(N, T, s.num_v_heads, s.head_v_dim, device=dev).to(act_dtype)
    g = -torch.rand(N, T, s.num_v_heads, s.head_k_dim, device=dev) * 0.1
    beta = torch.rand(N, T, s.num_v_heads, device=dev)
    return q, k, v, g, beta


def check_correctness(shape, dev, act_dtype, state_dtype, tol) -> float:
    """Max abs errors of Triton vs torch for replay and tree verify (small N, L)."""
    L, N, A, T = 2, 3, 4, 13
    mixers = make_layers(L, shape, dev)
    w = ReplayWeights.from_mixers(mixers)
    s = shape
    gen = torch.Generator().manual_seed(1)
    stash = ActivationStash(L, N + 1, A, StashDims(s.conv_dim, s.num_v_heads * s.head_k_dim, s.num_v_heads), dtype=act_dtype, device=dev)
    fill_stash(stash, gen)
    conv = torch.randn(L, 2 * N + 2, s.conv_dim, s.conv_kernel - 1, device=dev).to(act_dtype)
    temp = (torch.randn(L, 2 * N + 2, *s.temporal_state_shape, device=dev) * 0.1).to(state_dtype)
    rows = torch.arange(1, N + 1, device=dev)
    slots = torch.arange(N, device=dev)
    out = {}
    for impl in ("torch", "triton"):
        stash.set_pending(rows, torch.tensor([4, 2, 3], device=dev), torch.tensor([5, 62, 30], device=dev),
                          torch.tensor([N, N + 1, N + 2], device=dev))
        c, t = conv.clone(), temp.clone()
        with torch.no_grad():
            replay(stash, rows, slots, c, t, w, 32, impl=impl)
        out[impl] = (c, t)
    err_replay = max((out["torch"][0].float() - out["triton"][0].float()).abs().max().item(),
                     (out["torch"][1].float() - out["triton"][1].float()).abs().max().item())
    tree = heap_tree(N, T, 4)
    i0 = TreeIndex.build(tree, s.conv_kernel)
    idx = TreeIndex(*(x.to(dev) for x in (i0.parents, i0.depth, i0.path, i0.conv_src)))
    q, k, v, g, beta = verify_inputs(N, T, shape, dev, act_dtype)
    pool = (torch.randn(N, *s.temporal_state_shape, device=dev) * 0.1).float()
    ref_buf = OneLayerBuffer(N, T, shape, device=dev).ssm
    with torch.no_grad():
        o_ref = tree_recurrence(mixers[0], q, k, v, g, beta, pool, idx, ref_buf, torch.arange(N, device=dev))
    o_chip = tree_recurrence_triton(q, k, v, g, beta, pool, torch.arange(N, device=dev), idx, s.head_k_dim ** -0.5)
    buf = torch.zeros_like(ref_buf)
    o_buf = tree_recurrence_triton(q, k, v, g, beta, pool, torch.arange(N, device=dev), idx, s.head_k_dim ** -0.5,
                                   node_states=buf, rows=torch.arange(N, device=dev))
    err_verify = max((o_chip - o_ref).abs().max().item(), (o_buf - o_ref).abs().max().item(), (buf - ref_buf).abs().max().item())
    print(f"correctness: replay triton-vs-torch max|err|={err_replay:.2e}  tree verify max|err|={err_verify:.2e}  (tol {tol})")
    return max(err_replay, err_verify)


def check_glue_onchip(dev, tol, K=128, heads=((32, 32, "kda"), (8, 16, "gdn"))) -> float:
    """Max abs error of the glue's on-chip verify entry against the torch tree recurrence at
    Kimi-Linear (KDA, H = HV = 32) and Qwen3-Next TP 2 (GDN, H = 8, HV = 16) per-rank shapes
    (K = V = 128; ``--tiny``: toy heads), 2 requests of a 37-node topk-4 tree, fp32."""
    from sglang_mamba_ext.models.linear_attn import l2_normalize
    from sglang_mamba_ext.speculative.tree import eagle_tree_parents
    from sglang_mamba_ext.speculative.verify_onchip import onchip_tree_verify

    err = 0.0
    parents = eagle_tree_parents(4, 3)
    N, T = 2, len(parents)
    i0 = TreeIndex.build(DraftTree(torch.zeros(N, T, dtype=torch.long), torch.tensor([parents] * N)), 4)
    idx = TreeIndex(*(x.to(dev) for x in (i0.parents, i0.depth, i0.path, i0.conv_src)))
    for H, HV, gate in heads:
        torch.manual_seed(3)
        shape = LinearAttnShape(H, HV, K, K, 4)
        m = GatedDeltaRuleMixer(8, shape, gate=gate).to(dev)
        with torch.no_grad():
            m.A_log.normal_(0, 0.5)
            m.dt_bias.normal_()
        q, k = torch.randn(1, N * T, H, K, device=dev), torch.randn(1, N * T, H, K, device=dev)
        v = torch.randn(1, N * T, HV, K, device=dev)
        a = torch.randn(N * T, HV * K if gate == "kda" else HV, device=dev)
        b = torch.randn(1, N * T, HV, device=dev)
        pool = torch.randn(4, HV, K, K, device=dev)  # SGLang's [slots, HV, V, K]
        slots = torch.tensor([3, 1], device=dev)
        with torch.no_grad():
            o = onchip_tree_verify(q, k, v, a, b, m.A_log, m.dt_bias, pool, slots, T, idx.parents, 4,
                                   per_head_gate=gate == "gdn")
            g, beta = m.activate_gates(a.view(N, T, -1), b.view(N, T, HV))
            o_ref = tree_recurrence(m, l2_normalize(q.view(N, T, H, K)), l2_normalize(k.view(N, T, H, K)),
                                    v.view(N, T, HV, K), g, beta, pool[slots].transpose(-1, -2), idx,
                                    OneLayerBuffer(N, T, shape, device=dev).ssm, torch.arange(N, device=dev))
        err = max(err, (o.view(N, T, HV, K) - o_ref).abs().max().item())
    print(f"correctness: glue on-chip verify (KDA/GDN heads {[h[:2] for h in heads]}, K=V={K}) vs torch "
          f"max|err|={err:.2e}  (tol {tol})")
    return err


def check_args(prog: str, argv, iters: int):
    """The device checks' shared command line (``--tiny``, ``--state-dtype``, ``--iters``):
    returns ``(args, device, state dtype)``, or None (after a message on stderr) where there
    is no CUDA device and ``--tiny`` was not given."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("--tiny", action="store_true", help="toy shapes (CPU + TRITON_INTERPRET=1)")
    ap.add_argument("--state-dtype", choices=["fp32", "bf16"], default="fp32", help="SSM state dtype (SGLang default fp32)")
    ap.add_argument("--iters", type=int, default=iters)
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type != "cuda" and not args.tiny:
        print("no CUDA device: run with --tiny (and TRITON_INTERPRET=1) to exercise the script on CPU", file=sys.stderr)
        return None
    return args, dev, torch.float32 if args.state_dtype == "fp32" else torch.bfloat16


def main(argv=None) -> int:
    parsed = check_args("python -m sglang_mamba_ext.speculative.ops.gpu_check", argv, iters=20)
    if parsed is None:
        return 2
    args, dev, sdt = parsed
    act = torch.bfloat16
    if args.tiny:
        shape, L, N, T, A, iters = LinearAttnShape(2, 2, 16, 16, 4), 2, 3, 9, 4, 2
    else:
        shape, L, N, T, A, iters = LinearAttnShape(32, 32, 128, 128, 4), 20, 32, 63, 4, args.iters
    s = shape
    if dev.type == "cuda":
        # the snapshot buffers alone: L * (N+1) * T * (state + conv window); halve N until they fit
        per_req = L * T * (s.num_v_heads * s.head_k_dim * s.head_v_dim * (4 if sdt == torch.float32 else 2)
                           + s.conv_dim * (s.conv_kernel - 1) * 2)
        free = torch.cuda.mem_get_info()[0]
        while N > 1 and per_req * (N + 1) > 0.6 * free:
            N //= 2
    print(f"device: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; shape {s}; L={L} N={N} T={T} "
          f"committed/request={A}; activations bf16, SSM state {args.state_dtype}")
    # fp32 everywhere: the kernels must agree with the torch math to float rounding; bf16
    # activations: one-ulp flips of rounded activations give ~1e-2 differences in the state
    ok = check_correctness(shape, dev, torch.float32, torch.float32, 1e-4) < 1e-4
    ok &= check_correctness(shape, dev, act, sdt, 5e-2) < 5e-2
    ok &= (check_glue_onchip(dev, 2e-3, 16, ((2, 2, "kda"), (1, 2, "gdn"))) if args.tiny
           else check_glue_onchip(dev, 2e-3)) < 2e-3

    # main pools (both modes)
    mixers = make_layers(L, shape, dev)
    w = ReplayWeights.from_mixers(mixers)
    R = N + 1
    conv = torch.zeros(L, 3 * R, s.conv_dim, s.conv_kernel - 1, device=dev, dtype=act)
    temp = torch.zeros(L, 3 * R, *s.temporal_state_shape, device=dev, dtype=sdt)
    slots = torch.arange(N, device=dev)
    rows = torch.arange(1, N + 1, device=dev)
    tree = heap_tree(N, T, 4)
    idx0 = TreeIndex.build(tree, s.conv_kernel)
    idx = TreeIndex(*(x.to(dev) for x in (idx0.parents, idx0.depth, idx0.path, idx0.conv_src)))
    q, k, v, g, beta = verify_inputs(N, T, shape, dev, act)
    scale = s.head_k_dim ** -0.5
    dims = StashDims(s.conv_dim, s.num_v_heads * s.head_k_dim, s.num_v_heads)
    per_tok = dims.per_token

    # ---- snapshot mode: per-layer per-node states, resident
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    snap_ssm = torch.zeros(L, R, T, *s.temporal_state_shape, device=dev, dtype=sdt)
    snap_conv = torch.zeros(L, R, T, s.conv_dim, s.conv_kernel - 1, device=dev, dtype=act)

    def verify_snapshot():
        for l in range(L):
            tree_recurrence_triton(q, k, v, g, beta, temp[l], slots, idx, scale, node_states=snap_ssm[l], rows=rows)

    verify_ms = timed(verify_snapshot, dev, iters)
    snap_peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else \
        snap_ssm.numel() * snap_ssm.element_size() + snap_conv.numel() * snap_conv.element_size()
    snap_ssm = snap_conv = None  # free before the deferred run

    # ---- deferred mode: stash (resident) + verify workspace
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    stash = ActivationStash(L, R, A, dims, dtype=act, device=dev)
    fill_stash(stash, torch.Generator().manual_seed(2))
    counts = torch.full((N,), A, device=dev)
    seqs = torch.full((N,), 100, device=dev)

    def do_replay():
        stash.count[rows] = counts.to(torch.int32)
        stash.seq_len[rows] = seqs
        replay(stash, rows, slots, conv, temp, w, 256, impl="triton")

    replay_ms = timed(do_replay, dev, iters)

    def verify_onchip():
        pending = torch.empty(L, N * T, per_tok, device=dev, dtype=act)  # all nodes' raw inputs until acceptance
        conv_win = torch.empty(R, T, s.conv_dim, s.conv_kernel - 1, device=dev, dtype=act)  # one layer
        for l in range(L):
            tree_recurrence_triton(q, k, v, g, beta, temp[l], slots, idx, scale)
        del pending, conv_win

    onchip_ms = timed(verify_onchip, dev, iters)

    def_peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else \
        stash.nbytes() + L * N * T * per_tok * 2 + R * T * s.conv_dim * (s.conv_kernel - 1) * 2

    # the glue's on-chip entry as SGLang's backends call it: raw gates, pre-norm q/k,
    # states [slots, HV, V, K] (a transposed view of the same pool), tree tables per layer
    from sglang_mamba_ext.speculative.verify_onchip import onchip_tree_verify

    w_A = torch.randn(L, s.num_v_heads, device=dev) * 0.5
    w_dt = torch.randn(L, s.num_v_heads * s.head_k_dim, device=dev)
    q1, k1, v1 = q.reshape(1, N * T, s.num_k_heads, -1), k.reshape(1, N * T, s.num_k_heads, -1), v.reshape(1, N * T, s.num_v_heads, -1)
    a1 = torch.randn(N * T, s.num_v_heads * s.head_k_dim, device=dev, dtype=act)
    b1 = torch.randn(1, N * T, s.num_v_heads, device=dev, dtype=act)
    temp_vk = temp.transpose(-1, -2)
    par_dev = idx.parents

    def verify_glue():
        pending = torch.empty(L, N * T, per_tok, device=dev, dtype=act)
        conv_win = torch.empty(R, T, s.conv_dim, s.conv_kernel - 1, device=dev, dtype=act)
        for l in range(L):
            onchip_tree_verify(q1, k1, v1, a1, b1, w_A[l], w_dt[l], temp_vk[l], slots, T, par_dev, 4, per_head_gate=False)
        del pending, conv_win

    glue_ms = timed(verify_glue, dev, iters)

    pq, pk, pv, pg, pb = verify_inputs(N, A, shape, dev, act)
    pc = torch.full((N,), A, device=dev)
    tmp_pool = temp.clone()

    def verify_fused():
        for l in range(L):
            tree_recurrence_triton(q, k, v, g, beta, tmp_pool[l], slots, idx, scale, pending=(pq, pk, pv, pg, pb, pc))

    fused_ms = timed(verify_fused, dev, iters)
    tmp_pool = None

    # ---- deferred mode, one_layer variant: one layer's node-state buffer reused by every layer
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
    one_ssm = torch.zeros(R, T, *s.temporal_state_shape, device=dev, dtype=sdt)

    def verify_one_layer():
        pending = torch.empty(L, N * T, per_tok, device=dev, dtype=act)
        conv_win = torch.empty(R, T, s.conv_dim, s.conv_kernel - 1, device=dev, dtype=act)
        for l in range(L):
            tree_recurrence_triton(q, k, v, g, beta, temp[l], slots, idx, scale, node_states=one_ssm, rows=rows)
        del pending, conv_win

    one_layer_ms = timed(verify_one_layer, dev, iters)
    one_peak = (torch.cuda.max_memory_allocated() - base) if dev.type == "cuda" else \
        stash.nbytes() + one_ssm.numel() * one_ssm.element_size() + L * N * T * per_tok * 2 + R * T * s.conv_dim * (s.conv_kernel - 1) * 2
    if dev.type == "cuda":
        one_peak += stash.nbytes()  # allocated before the reset, alive during the round

    print(f"time: verify(snapshot, buffered)={verify_ms:.3f} ms  replay={replay_ms:.3f} ms  "
          f"verify_onchip={onchip_ms:.3f} ms  verify_onchip+fused_replay={fused_ms:.3f} ms")
    print(f"replay/verify_onchip={replay_ms / onchip_ms:.4f}  fused_replay_overhead={(fused_ms - onchip_ms) / verify_ms:.4f} "
          f"(of snapshot verify)  onchip/snapshot verify={onchip_ms / verify_ms:.3f}")
    print(f"time: verify_one_layer(deferred, one-layer node buffer)={one_layer_ms:.3f} ms  "
          f"verify_glue(on-chip entry as the backends call it)={glue_ms:.3f} ms")
    print(f"onchip_vs_one_layer={glue_ms / one_layer_ms:.3f} (kernel alone {onchip_ms / one_layer_ms:.3f})")
    print(f"memory above pools: snapshot {snap_peak / 2**30:.3f} GiB, deferred {def_peak / 2**30:.3f} GiB "
          f"(on chip; one_layer {one_peak / 2**30:.3f} GiB)")
    print(f"memory_ratio={snap_peak / max(def_peak, 1):.1f}")
    print(f"replay_overhead={replay_ms / verify_ms:.4f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
