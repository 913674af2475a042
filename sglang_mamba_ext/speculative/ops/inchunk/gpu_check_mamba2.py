"""GPU check of the Mamba2 / SSD in-chunk checkpoint writer (:mod:`.mamba2`), run by
``scripts/gpu_check.sh`` after the GDN / KDA writer's check, or alone as ``python -m
sglang_mamba_ext.speculative.ops.inchunk.gpu_check_mamba2``; torch + Triton only (no SGLang).

(1) Correctness: the Triton writer against the torch reference, and both against a chunked SSD
scan written here in torch (the same decomposition SGLang's ``ssd_combined`` kernels use:
intra-chunk ``(C B^T * decay) (dt x)`` plus the carried state), at offsets inside and across
chunks. (2) Cost at Nemotron-H-8B Mamba2 layer shapes (``HV = 128`` heads, ``P = 64``, ``N = 128``,
``G = 8``, ``W = 4``, ``L = 24`` Mamba2 layers, 8 requests): one writer call (all layers) for a
checkpoint ``p`` tokens after the extend start (``p = 63, 511, 2047``: a per-offset table; the
writer starts from the chunk boundary below ``p``, issue 39), against the SSD part of
the prefill a 64-token-grid checkpoint leaves to recompute (63 tokens per request, the chunked
scan below over all layers: a lower bound of the real prefill). Last line:
``mamba2_inchunk_cost_ratio=<write(p=2047) / SSD prefill of 63 tokens>``. ``--tiny``: toy shapes
on CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from sglang_mamba_ext.speculative.ops.gpu_check import check_args
from sglang_mamba_ext.speculative.ops.inchunk import plan_writes
from sglang_mamba_ext.speculative.ops.inchunk.gpu_check import timed
from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import Mamba2Weights, write_mamba2_checkpoints


def random_mamba2_weights(L, HV, P, N, G, W, dev="cpu", seed=0, bias=True) -> Mamba2Weights:
    """Seeded random :class:`Mamba2Weights` of ``L`` layers (``HV`` heads of ``P``, state ``N``,
    ``G`` groups, conv width ``W``) on ``dev``; ``bias``: with a conv bias. For checks and tests."""
    g = torch.Generator().manual_seed(seed)
    D = HV * P + 2 * G * N
    return Mamba2Weights(
        conv_weight=(torch.randn(L, D, W, generator=g) / 2).to(dev),
        conv_bias=(torch.randn(L, D, generator=g) / 4).to(dev) if bias else None,
        A=(-torch.exp(torch.rand(L, HV, generator=g) * 2)).to(dev),
        dt_bias=(torch.randn(L, HV, generator=g) / 2 - 2).to(dev),
        n_groups=G, head_dim=P, d_state=N,
    )


def chunked_ssd(x, dt, A, B, C, h0, chunk: int = 64):
    """Torch chunked SSD scan of one sequence: ``x [T, HV, P]``, ``dt [T, HV]`` (activated),
    ``A [HV]``, ``B``/``C`` ``[T, HV, N]`` (groups expanded), ``h0 [HV, P, N]``; returns
    ``(y [T, HV, P], final state [HV, P, N])``, fp32."""
    T = x.shape[0]
    ys, h = [], h0
    for s in range(0, T, chunk):
        xs, dts, Bs, Cs = x[s:s + chunk], dt[s:s + chunk], B[s:s + chunk], C[s:s + chunk]
        cum = torch.cumsum(dts * A, dim=0)  # [Q, HV]
        seg = cum[:, None, :] - cum[None, :, :]  # [t, s, HV]
        Q = xs.shape[0]
        mask = torch.tril(torch.ones(Q, Q, dtype=torch.bool, device=x.device))
        decay = torch.where(mask[:, :, None], torch.exp(seg.clamp(max=0)), torch.zeros_like(seg))
        scores = torch.einsum("thn,shn->tsh", Cs, Bs) * decay
        y = torch.einsum("tsh,shp->thp", scores, dts[:, :, None] * xs)
        y = y + torch.einsum("thn,hpn->thp", Cs * torch.exp(cum)[:, :, None], h)
        ys.append(y)
        last = cum[-1]
        w = torch.exp(last[None, :] - cum) * dts  # [Q, HV]
        h = torch.exp(last)[:, None, None] * h + torch.einsum("sh,shp,shn->hpn", w, xs, Bs)
    return torch.cat(ys), h


def _post_conv(w: Mamba2Weights, l, xbc, dt_raw, conv0):
    """SGLang's prefill pre-scan: conv + silu, split, dt activated; ``conv0 [D, W-1]``."""
    HV, P, N, G = w.num_heads, w.head_dim, w.d_state, w.n_groups
    D = w.conv_dim
    seq = torch.cat([conv0.float(), xbc.float().t()], dim=1)
    y = F.silu(F.conv1d(seq[None], w.conv_weight[l].float()[:, None, :], w.conv_bias[l].float(), groups=D)[0]).t()
    y = y.to(xbc.dtype).float()
    T = y.shape[0]
    x = y[:, :HV * P].view(T, HV, P)
    B = y[:, HV * P:HV * P + G * N].view(T, G, N).repeat_interleave(HV // G, 1)
    C = y[:, HV * P + G * N:].view(T, G, N).repeat_interleave(HV // G, 1)
    dt = F.softplus(dt_raw.float() + w.dt_bias[l].float())
    return x, dt, B, C


def check_correctness(dev, shape, T: int = 150) -> float:
    HV, P, N, G, W = shape
    L = 2
    w = random_mamba2_weights(L, HV, P, N, G, W, dev)
    D = w.conv_dim
    g = torch.Generator().manual_seed(1)
    xbc = torch.randn(L, T, D, generator=g).to(dev)
    dt = torch.randn(L, T, HV, generator=g).to(dev)
    slots = 8
    conv = torch.randn(L, slots, D, W - 1, generator=g).to(dev)
    ssm = torch.randn(L, slots, HV, P, N, generator=g).to(dev)
    points = [(1, 2), (min(63, T - 2), 3), (min(64, T - 1), 4), (T * 2 // 3, 5), (T, 6)]
    writes = plan_writes([(0, 1, points)], dev)
    ref_conv, ref_ssm = conv.clone(), ssm.clone()
    write_mamba2_checkpoints(xbc, dt, writes, ref_conv, ref_ssm, w, impl="torch")
    write_mamba2_checkpoints(xbc, dt, writes, conv, ssm, w, impl="triton")
    worst = (ssm - ref_ssm).abs().max().item()
    worst = max(worst, (conv - ref_conv).abs().max().item())
    for l in range(L):
        x, dta, B, C = _post_conv(w, l, xbc[l], dt[l], ref_conv[l, 1])
        for p, slot in points:
            _, h = chunked_ssd(x[:p], dta[:p], w.A[l], B[:p], C[:p], ref_ssm[l, 1].float())
            worst = max(worst, (h - ssm[l, slot].float()).abs().max().item() / max(1.0, h.abs().max().item()))
    return worst


def main(argv=None) -> int:
    parsed = check_args("python -m sglang_mamba_ext.speculative.ops.inchunk.gpu_check_mamba2", argv, iters=10)
    if parsed is None:
        return 2
    args, dev, sdt = parsed
    if args.tiny:
        shape, L, R, P_in, P_mid, P_end, iters = (4, 8, 16, 2, 4), 1, 1, 3, 70, 100, 1
    else:
        shape, L, R, P_in, P_mid, P_end, iters = (128, 64, 128, 8, 4), 24, 8, 63, 511, 2047, args.iters
    HV, P, N, G, W = shape
    err = check_correctness(dev, (4, 8, 16, 2, 4) if args.tiny else (16, 64, 128, 4, 4), T=40 if args.tiny else 150)
    print(f"[mamba2-inchunk] device: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}; "
          f"HV={HV} P={P} N={N} G={G} W={W}; L={L} requests={R}")
    ok = err < 2e-3
    print(f"[mamba2-inchunk] correctness (triton vs torch vs chunked SSD, fp32): max rel err {err:.2e} "
          f"{'OK' if ok else 'FAIL'}")
    w = random_mamba2_weights(L, HV, P, N, G, W, dev)
    D = w.conv_dim
    T = R * (P_end + 1)
    xbc = torch.randn(L, T, D, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    dt = torch.randn(L, T, HV, device=dev)
    slots = 2 * R + 1
    conv = torch.zeros(L, slots, D, W - 1, device=dev, dtype=xbc.dtype)
    ssm = torch.zeros(L, slots, HV, P, N, device=dev, dtype=sdt)

    # the SSD scan's chunk states (fp32, one 64-token grid over the packed tokens); values do not
    # change the cost (exactness: tests/test_inchunk_from_chunks.py)
    states = torch.randn(L, (T + 63) // 64, HV, P, N, device=dev)

    def writer(p, from_chunks=True):
        plan = plan_writes([(r * (P_end + 1), r, [(p, R + r)]) for r in range(R)], dev)
        kw = dict(chunk_states=states, row_lengths=[P_end + 1] * R) if from_chunks else {}
        return lambda: write_mamba2_checkpoints(xbc, dt, plan, conv, ssm, w, check_offsets=False, **kw)

    times = {p: timed(writer(p), dev, iters) for p in (P_in, P_mid, P_end)}
    own = {p: timed(writer(p, False), dev, iters) for p in (P_in, P_mid, P_end)}
    t_in, t_end = times[P_in], times[P_end]
    Q = min(63, P_end)
    pre = [_post_conv(w, l, xbc[l, :Q], dt[l, :Q], conv[l, 0]) for l in range(L)]
    h0 = torch.zeros(HV, P, N, device=dev)

    def prefill():
        for l in range(L):
            x, dta, B, C = pre[l]
            for _ in range(R):
                chunked_ssd(x, dta, w.A[l], B, C, h0)

    t_pre = timed(prefill, dev, iters)
    print(f"[mamba2-inchunk] time (all {L} layers, {R} requests, one checkpoint each): write(p={P_in})={t_in:.3f} ms  "
          f"write(p={P_end})={t_end:.3f} ms  SSD prefill of {Q} tokens={t_pre:.3f} ms")
    print("[mamba2-inchunk] per checkpoint by offset (all layers), from the scan's chunk states: "
          + "  ".join(f"p={p}: {t / R:.4f} ms" for p, t in times.items())
          + f"  (SSD prefill of {Q} tokens per request: {t_pre / R:.4f} ms)")
    print("[mamba2-inchunk] per checkpoint by offset, boundary states from the writer's own pass: "
          + "  ".join(f"p={p}: {t / R:.4f} ms" for p, t in own.items())
          + f"; mamba2_selfpass_cost_ratio={own[P_end] / t_pre:.4f}")
    print(f"mamba2_inchunk_cost_ratio={t_end / t_pre:.4f}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
