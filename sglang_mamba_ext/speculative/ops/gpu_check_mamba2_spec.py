"""GPU check of the deferred verify for Mamba2 targets (issue 41, item 3), run by
``scripts/gpu_check.sh`` or alone as ``python -m sglang_mamba_ext.speculative.ops.gpu_check_mamba2_spec``;
torch + Triton only (no SGLang).

At Nemotron-Nano-9B-v2's Mamba2 layer shapes per rank (``HV = 128`` heads of ``P = 80``, state
``N = 128``, ``G = 8`` groups, conv 4; its published ``config.json``), 24 Mamba2 layers,
``--speculative-eagle-topk 4 --speculative-num-steps 3`` (a 13-node heap tree, depth 3), 16 requests:

1. correctness: the on-chip tree verify (:mod:`.verify.mamba2_onchip`) and its buffered form
   against the torch reference; the replay (:mod:`.replay.mamba2`) against its torch reference
   (max relative error);
2. time of one layer's verify, on chip against the buffered form (each node stepped once from
   its parent's state read back from a node-state buffer, as snapshot verify does):
   ``mamba2_onchip_vs_buffered=``; and of the round's replay (all layers) against the verify of
   all layers (``mamba2_replay_overhead=``);
3. bytes of the node states: snapshot keeps ``L`` layers' node-state buffers, the on-chip
   variant none (the stash holds the accepted tokens' ``xBC`` and ``dt`` instead):
   ``mamba2_memory_ratio=`` (snapshot node states + conv windows / deferred stash + workspace).

``--tiny``: toy shapes on CPU under ``TRITON_INTERPRET=1`` (timings mean nothing there).
"""

from __future__ import annotations

import sys

import torch

from sglang_mamba_ext.models.linear_attn import LinearAttnShape
from sglang_mamba_ext.speculative.deferred import LAYOUTS, DeferredSpecState
from sglang_mamba_ext.speculative.ops.gpu_check import check_args, heap_tree, timed
from sglang_mamba_ext.speculative.stash import StashDims


def _rel(a, b) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-6)).item()


def main(argv=None) -> int:
    got = check_args("gpu_check_mamba2_spec", argv, iters=20)
    if got is None:
        return 2
    args, dev, sdt = got
    if args.tiny:
        HV, P, N, G, W, L, R, topk, steps = 4, 8, 16, 2, 4, 2, 3, 2, 2
    else:
        HV, P, N, G, W, L, R, topk, steps = 128, 80, 128, 8, 4, 24, 16, 4, 3
    T = 1 + topk * steps if topk > 1 else steps + 1
    D = HV * P + 2 * G * N
    act = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev)  # noqa: E731
    tree = heap_tree(R, T, topk).retrieve_parent_token.to(dev)
    slots = torch.arange(R, device=dev)
    state = (rnd(R + 1, HV, P, N) / 4).to(sdt)
    x, B, C = rnd(R, T, HV, P).to(act), rnd(R, T, G, N).to(act), rnd(R, T, G, N).to(act)
    dt = (rnd(R, T, HV) / 2 - 1).to(act)[..., None].expand(R, T, HV, P)
    A = -torch.exp(rnd(HV).float())[:, None, None].expand(HV, P, N)
    Dv = rnd(HV)[:, None].expand(HV, P)
    dtb = (rnd(HV) / 2)[:, None].expand(HV, P)
    from sglang_mamba_ext.speculative.ops.verify.mamba2_onchip import mamba2_tree_verify

    vargs = (state, x, dt, A, B, C, Dv, dtb, slots, tree, steps + 1)
    want = mamba2_tree_verify(*vargs, impl="torch")
    out = torch.empty(R, T, HV, P, dtype=act, device=dev)
    buf = torch.empty(R, T, HV, P, N, dtype=sdt, device=dev)
    on = mamba2_tree_verify(*vargs, out=out).clone()
    bu = mamba2_tree_verify(*vargs, out=torch.empty_like(out), node_states=buf)
    err_v = max(_rel(on, want), _rel(bu, want))

    # replay: a round's stash for every request (counts 1 .. steps+1), into a pool copy
    st = DeferredSpecState(num_layers=L, num_rows=R + 1, draft_token_num=T, max_accept=steps + 1,
                           shape=LinearAttnShape(G, HV, N, P, W), dims=StashDims(D, HV, 0),
                           ssm_state_shape=(HV, P, N), conv_state_shape=(D, W - 1), ssm_dtype=sdt, conv_dtype=act,
                           act_dtype=act, device=dev, layout=LAYOUTS["mamba2"], verify="on_chip")
    for l in range(L):
        st.register_layer(l, rnd(D, W) / 2, rnd(D) / 4, -torch.exp(rnd(HV)), rnd(HV) / 2 - 2)
    rows = torch.arange(1, R + 1, device=dev)
    st.stash.mixed_qkv.copy_(rnd(*st.stash.mixed_qkv.shape).to(act))
    st.stash.g_raw.copy_(rnd(*st.stash.g_raw.shape).to(act))
    counts = (torch.arange(R, device=dev) % (steps + 1) + 1).to(torch.int32)
    conv0 = rnd(L, R + 1, D, W - 1).to(act)
    ssm0 = (rnd(L, R + 1, HV, P, N) / 4).to(sdt)

    def replay(impl):
        conv, ssm = conv0.clone(), ssm0.clone()
        st.stash.count[rows] = counts
        st.stash.seq_len[rows] = 100
        st.replay(rows, slots, conv, ssm, impl=impl)
        return conv, ssm

    c_t, s_t = replay("triton")
    c_r, s_r = replay("torch")
    err_r = max(_rel(s_t, s_r), _rel(c_t.float(), c_r.float()))
    name = torch.cuda.get_device_name() if dev.type == "cuda" else "cpu"
    print(f"[mamba2-spec] device: {name}; HV={HV} P={P} N={N} G={G} L={L} requests={R} T={T} (topk {topk}, "
          f"steps {steps}); state {sdt}, activations {act}")
    print(f"[mamba2-spec] correctness: tree verify (on chip, buffered) max rel err {err_v:.2e}; replay {err_r:.2e}")

    t_on = timed(lambda: mamba2_tree_verify(*vargs, out=out), dev, args.iters)
    t_bu = timed(lambda: mamba2_tree_verify(*vargs, out=out, node_states=buf), dev, args.iters)
    conv1, ssm1 = conv0.clone(), ssm0.clone()

    def replay_timed():
        st.stash.count[rows] = counts
        st.replay(rows, slots, conv1, ssm1)

    t_rp = timed(replay_timed, dev, args.iters)
    print(f"[mamba2-spec] time per layer: verify on chip {t_on:.3f} ms, buffered {t_bu:.3f} ms; replay (all {L} "
          f"layers) {t_rp:.3f} ms")
    isz = lambda dt_: torch.empty((), dtype=dt_).element_size()  # noqa: E731
    snap = L * (R + 1) * T * (HV * P * N * isz(sdt) + D * (W - 1) * isz(act))
    nb = st.nbytes()
    deferred = sum(nb.values())
    print(f"[mamba2-spec] node-state bytes: snapshot {snap / 2**20:.1f} MiB ({L} layers of node states and conv "
          f"windows), deferred {deferred / 2**20:.1f} MiB {({k: round(v / 2**20, 2) for k, v in nb.items()})}")
    print(f"mamba2_onchip_vs_buffered={t_on / t_bu:.3f}")
    print(f"mamba2_replay_overhead={t_rp / (t_on * L):.4f}")
    print(f"mamba2_memory_ratio={snap / max(deferred, 1):.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
