"""The plain-torch CPU kernels (``sglang_mamba_ext.plugin.cpu_kernels`` / ``cpu_kernels_ssd``)
against SGLang's Triton kernels run by Triton's interpreter, and the bridge that routes SGLang's
calls to them (``cpu_bridges.make_kernel_around``).

Each comparison packs three sequences: one shorter than a chunk, one spanning chunks (two of
GDN / KDA's 64-token chunks, ending two tokens into the second; three of the 32-token chunks the
Mamba2 scan is given here), one more (a full chunk for GDN / KDA; for Mamba2 it starts
mid-chunk), once with initial states (random pool rows, or a ``-1`` row) and once without.
Outputs, written-back states, per-chunk ``h`` (GDN / KDA), ``states`` / ``varlen_states`` /
``track_states`` (Mamba2) and conv windows are asserted. The Triton side needs
``TRITON_INTERPRET=1`` before Triton is imported, so those classes run in a fresh process
(``TestCpuKernelsUnderInterpreter``) unless this one already interprets."""

import os
import unittest
from unittest import mock

import torch

from conftest import SGLANG_INSTALLED
from sglang_mamba_ext.testing.spec_pair import triton_subprocess_case

_IN_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
NO_CUDA = not torch.cuda.is_available()
SELECT = "VsTriton"
LENS = [5, 66, 64]
HALF = torch.float16


def _shims():
    from sglang_mamba_ext.plugin.cpu_bridges import MAMBA_KERNEL_MODULES
    from sglang_mamba_ext.plugin.triton_interpret import install_interpreter_shims

    install_interpreter_shims(extra_modules=MAMBA_KERNEL_MODULES)


def _cu(lens, dtype=torch.long):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=dtype)


def _close(tc, a, b, atol, rtol=1e-2, what=""):
    tc.assertEqual(a.shape, b.shape, what)
    tc.assertEqual(a.dtype, b.dtype, what)
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=rtol, msg=what)


@unittest.skipUnless(_IN_INTERP and SGLANG_INSTALLED and NO_CUDA, "needs TRITON_INTERPRET=1 (runs in a subprocess)")
class TestDeltaRuleVsTriton(unittest.TestCase):
    """GDN ``chunk_gated_delta_rule`` and KDA ``chunk_kda``."""

    @classmethod
    def setUpClass(cls):
        _shims()

    def _inputs(self, H, Hq, K, V, per_channel):
        g = torch.Generator().manual_seed(1)
        T = sum(LENS)
        q = torch.randn(1, T, Hq, K, generator=g).to(HALF)
        k = torch.randn(1, T, Hq, K, generator=g).to(HALF)
        v = torch.randn(1, T, H, V, generator=g).to(HALF)
        if per_channel:
            gate = torch.randn(1, T, H, K, generator=g).to(HALF)  # raw KDA gate
            beta = torch.randn(1, T, H, generator=g).to(HALF)  # raw beta
        else:
            gate = torch.nn.functional.logsigmoid(torch.randn(1, T, H, generator=g)) * 0.5
            beta = torch.rand(1, T, H, generator=g).to(HALF)
        pool = torch.randn(6, H, V, K, generator=g) * 0.1
        return q, k, v, gate, beta, pool

    def _cases(self, pool):
        zero = pool.clone()
        zero[[0, 2, 5]] = 0
        return (("initial states", pool, torch.tensor([3, -1, 1])),
                ("no initial states", zero, torch.tensor([0, 2, 5])))

    def test_gdn(self):
        from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule as triton_fn

        from sglang_mamba_ext.plugin.cpu_kernels import chunk_gated_delta_rule as torch_fn

        q, k, v, g, beta, pool = self._inputs(H=4, Hq=2, K=32, V=32, per_channel=False)
        for name, base, idx in self._cases(pool):
            for inplace in (True, False) if name == "no initial states" else (True,):
                results = []
                for fn in (triton_fn, torch_fn):
                    p = base.clone()
                    o, none, h = fn(q, k, v, g, beta, initial_state=p, initial_state_indices=idx,
                                    cu_seqlens=_cu(LENS), use_qk_l2norm_in_kernel=True, inplace_update=inplace)
                    self.assertIsNone(none)
                    results.append((o, h, p))
                (o1, h1, p1), (o2, h2, p2) = results
                what = f"GDN {name} inplace={inplace}"
                self.assertEqual(tuple(h1.shape), (1, 4, 4, 32, 32), what)  # chunks 1 + 2 + 1
                _close(self, o2, o1, 2e-3, what=what + " o")
                _close(self, h2, h1, 2e-3, what=what + " h")
                _close(self, p2, p1, 2e-3, what=what + " pool")
                if not inplace:
                    torch.testing.assert_close(p2, base)

    def test_kda(self):
        from sglang.kernels.ops.attention.fla.kda import chunk_kda as triton_fn

        from sglang_mamba_ext.plugin.cpu_kernels import chunk_kda as torch_fn

        H, K = 2, 32
        q, k, v, g, beta, pool = self._inputs(H=H, Hq=H, K=K, V=K, per_channel=True)
        gen = torch.Generator().manual_seed(2)
        A_log, dt_bias = torch.rand(H, generator=gen) * 2, torch.randn(H * K, generator=gen) * 0.1
        for name, base, idx in self._cases(pool):
            results = []
            for fn in (triton_fn, torch_fn):
                p, vv = base.clone(), v.clone()
                track = torch.zeros(3, H, K, K)
                o, h = fn(q, k, vv, g, beta, initial_state=p, initial_state_indices=idx, cu_seqlens=_cu(LENS),
                          use_qk_l2norm_in_kernel=True, A_log=A_log, dt_bias=dt_bias, beta_is_raw=True,
                          output_intermediate_states=True, track_state=track,
                          track_chunk_idx=torch.tensor([0, 2, 0], dtype=torch.int32))
                self.assertEqual(o.data_ptr(), vv.data_ptr())  # written into v, as SGLang's kernel
                results.append((o, h, p, track))
            for what, a, b in zip(("o", "h", "pool", "track"), results[1], results[0]):
                _close(self, a, b, 2e-3, what=f"KDA {name} {what}")
        # an activated gate without A_log, plain output
        gate = -torch.nn.functional.softplus(g.float()) * 0.3
        beta_s = beta.float().sigmoid().to(HALF)
        outs = [fn(q, k, v.clone(), gate, beta_s, initial_state=pool.clone(), initial_state_indices=torch.tensor([3, -1, 1]),
                   cu_seqlens=_cu(LENS), use_qk_l2norm_in_kernel=True) for fn in (triton_fn, torch_fn)]
        _close(self, outs[1], outs[0], 2e-3, what="KDA activated gate o")


@unittest.skipUnless(_IN_INTERP and SGLANG_INSTALLED and NO_CUDA, "needs TRITON_INTERPRET=1 (runs in a subprocess)")
class TestMamba2VsTriton(unittest.TestCase):
    """Mamba2's ``mamba_chunk_scan_combined`` (as ``MambaMixer2.forward`` calls it) and the
    causal convolutions."""

    LENS = [5, 66, 20]  # 32-token chunks (CS): the second and third sequences start mid-chunk
    CS = 32

    @classmethod
    def setUpClass(cls):
        _shims()

    def test_ssd_scan(self):
        from sglang.kernels.ops.mamba.triton_ops.ssd_combined import mamba_chunk_scan_combined as triton_fn
        from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata

        from sglang_mamba_ext.plugin.cpu_bridges import cpu_device_module
        from sglang_mamba_ext.plugin.cpu_kernels_ssd import mamba_chunk_scan_combined as torch_fn

        g = torch.Generator().manual_seed(3)
        lens, T, H, P, G, N, cs = self.LENS, sum(self.LENS), 4, 16, 2, 16, self.CS
        x = torch.randn(1, T, H, P, generator=g).to(HALF)
        dt = torch.randn(1, T, H, generator=g).to(HALF)
        A = -torch.rand(H, generator=g) - 0.5
        B = torch.randn(1, T, G, N, generator=g).to(HALF)
        C = torch.randn(1, T, G, N, generator=g).to(HALF)
        D, dt_bias = torch.randn(H, generator=g), torch.randn(H, generator=g) * 0.1
        cu = _cu(lens, torch.int32)
        seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), cu.diff()).unsqueeze(0)
        init = torch.randn(3, H, P, N, generator=g) * 0.1
        init[1] = 0  # as MambaMixer2 passes a sequence without a cached state
        ci, co = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(cu, cs, T)
        # states after 38 tokens of sequence 1 (mid chunk 1), 2 before its end (chunk 2), 3 into sequence 2
        track = dict(track_seq_idx=torch.tensor([1, 1, 2]), track_end_locs=torch.tensor([43, 69, 74]))
        for name, initial, meta in (("initial states", init, dict(chunk_indices=ci, chunk_offsets=co)),
                                    ("no initial states", None, dict(chunk_indices=None, chunk_offsets=None))):
            results = []
            for fn in (triton_fn, torch_fn):
                out = torch.empty(1, T, H, P, dtype=HALF)
                with cpu_device_module():
                    r = fn(x, dt, A, B, C, cs, D=D, z=None, dt_bias=dt_bias, seq_idx=seq_idx, cu_seqlens=cu,
                           initial_states=initial, return_varlen_states=True, return_final_states=False,
                           return_track_states=True, dt_softplus=True, dt_limit=(0.0, float("inf")), out=out,
                           state_dtype=torch.float32, **meta, **track)
                results.append((out, *r))
            for what, a, b in zip(("out", "states", "varlen_states", "track_states"), results[1], results[0]):
                _close(self, a, b, 1e-2 if what != "out" else 6e-2, rtol=2e-3 if what != "out" else 1e-2,
                       what=f"Mamba2 {name} {what}")

    def test_selective_state_update(self):
        from sglang.kernels.ops.mamba.triton_ops import mamba_ssm

        from sglang_mamba_ext.plugin.cpu_bridges import cpu_device_module
        from sglang_mamba_ext.plugin.cpu_kernels_ssd import selective_state_update

        g = torch.Generator().manual_seed(7)
        Bn, H, P, G, N = 3, 4, 16, 2, 16
        pool = torch.randn(5, H, P, N, generator=g)
        x = torch.randn(Bn, H, P, generator=g).to(HALF)
        dt = torch.randn(Bn, H, generator=g).to(HALF)[:, :, None].expand(-1, -1, P)  # as MambaMixer2 passes them
        A = (-torch.rand(H, generator=g) - 0.5)[:, None, None].expand(-1, P, N)
        dt_bias = torch.randn(H, generator=g)[:, None].expand(-1, P)
        D = torch.randn(H, generator=g)[:, None].expand(-1, P)
        B, C = torch.randn(Bn, G, N, generator=g).to(HALF), torch.randn(Bn, G, N, generator=g).to(HALF)
        rows = torch.tensor([2, -1, 0], dtype=torch.int32)
        results = []
        for fn in (mamba_ssm.selective_state_update, selective_state_update):
            p, out = pool.clone(), torch.empty(Bn, H, P, dtype=HALF)
            with cpu_device_module():
                fn(p, x, dt, A, B, C, D, z=None, dt_bias=dt_bias, dt_softplus=True, state_batch_indices=rows, out=out)
            results.append((out, p))
        _close(self, results[1][0], results[0][0], 2e-3, what="ssu out")
        _close(self, results[1][1], results[0][1], 1e-5, what="ssu pool")

    def test_causal_conv(self):
        from sglang.kernels.ops.mamba import causal_conv1d_triton as triton_mod

        from sglang_mamba_ext.plugin import cpu_kernels_ssd as torch_mod

        g = torch.Generator().manual_seed(4)
        lens, dim, W = self.LENS, 48, 4
        x = torch.randn(sum(lens), dim, generator=g).to(HALF).t()  # [dim, T], channel-last as served
        w, b = torch.randn(dim, W, generator=g), torch.randn(dim, generator=g)
        pool = torch.randn(5, dim, W - 1, generator=g).to(HALF)
        slots = torch.tensor([2, 0, 4], dtype=torch.int32)
        for has_init in (torch.tensor([True, False, True]), None):
            outs = []
            for mod in (triton_mod, torch_mod):
                p = pool.clone()
                o = mod.causal_conv1d_fn(x, w, b, conv_states=p, query_start_loc=_cu(lens, torch.int32),
                                         seq_lens_cpu=lens, cache_indices=slots, has_initial_state=has_init,
                                         activation="silu")
                outs.append((o, p))
            _close(self, outs[1][0], outs[0][0], 2e-3, what=f"conv fn out (has_init={has_init})")
            _close(self, outs[1][1], outs[0][1], 0, 0, what="conv fn states")
        xu = torch.randn(3, dim, generator=g).to(HALF)
        outs = []
        for mod in (triton_mod, torch_mod):
            p = pool.clone()
            outs.append((mod.causal_conv1d_update(xu, p, w, b, "silu", conv_state_indices=slots), p))
        _close(self, outs[1][0], outs[0][0], 2e-3, what="conv update out")
        _close(self, outs[1][1], outs[0][1], 0, 0, what="conv update states")


@unittest.skipUnless(_IN_INTERP and SGLANG_INSTALLED and NO_CUDA, "needs TRITON_INTERPRET=1 (runs in a subprocess)")
class TestDecodeAndElementwiseVsTriton(unittest.TestCase):
    """The GDN / KDA packed decode and the small kernels of ``cpu_kernels_elementwise``."""

    @classmethod
    def setUpClass(cls):
        _shims()

    def test_packed_decode(self):
        from sglang.kernels.ops.attention.fla import fused_recurrent as fr

        from sglang_mamba_ext.plugin import cpu_kernels_decode as ck

        g = torch.Generator().manual_seed(5)
        B, H, HV, K, V = 3, 2, 4, 16, 16
        pool = torch.randn(5, HV, V, K, generator=g)
        idx = torch.tensor([1, -1, 3])  # -1: a padded row, zero output and no write
        b = torch.randn(B, HV, generator=g).to(HALF)
        A_log, dt_bias = torch.randn(HV, generator=g), torch.randn(HV, generator=g)
        cases = [("gdn", None, torch.randn(B, 2 * H * K + HV * V, generator=g).to(HALF),
                  torch.randn(B, HV, generator=g).to(HALF), dt_bias)]
        for lb in (None, -5.0):
            cases.append(("kda", lb, torch.randn(B, 2 * HV * K + HV * V, generator=g).to(HALF),
                          torch.randn(B, HV * K, generator=g).to(HALF), torch.randn(HV * K, generator=g)))
        for kind, lb, mixed, a, bias in cases:
            results = []
            for mod in (fr, ck):
                p, out = pool.clone(), torch.empty(B, 1, HV, V, dtype=HALF)
                if kind == "gdn":
                    mod.fused_recurrent_gated_delta_rule_packed_decode(mixed, a, b, A_log, bias, 0.25, p, out, idx, True)
                else:
                    mod.fused_recurrent_kda_packed_decode(mixed, a, b, A_log, bias, 0.25, p, out, idx, True,
                                                          lower_bound=lb)
                results.append((out, p))
            _close(self, results[1][0], results[0][0], 1e-3, what=f"{kind} lb={lb} out")
            _close(self, results[1][1], results[0][1], 1e-5, what=f"{kind} lb={lb} pool")

    def test_elementwise(self):
        from sglang.kernels.ops.attention.linear.fused_gdn_gating import fused_gdn_gating
        from sglang.kernels.ops.attention.triton_gdn_fused_proj import fused_qkvzba_split_reshape_cat
        from sglang.kernels.ops.elementwise import elementwise as ew

        from sglang_mamba_ext.plugin import cpu_kernels_elementwise as ce

        g = torch.Generator().manual_seed(6)
        T, Hqk, Hv, hq, hv = 7, 2, 4, 16, 16
        qkvz = torch.randn(T, Hqk * (2 * hq + 2 * 2 * hv), generator=g).to(HALF)
        ba = torch.randn(T, Hqk * 4, generator=g).to(HALF)
        for a, b in zip(ce.fused_qkvzba_split_reshape_cat(qkvz, ba, Hqk, Hv, hq, hv),
                        fused_qkvzba_split_reshape_cat(qkvz, ba, Hqk, Hv, hq, hv)):
            _close(self, a, b, 0, 0, what="qkvz split")
        A_log, a_, b_, bias = (torch.randn(Hv, generator=g), torch.randn(T, Hv, generator=g).to(HALF),
                               torch.randn(T, Hv, generator=g).to(HALF), torch.randn(Hv, generator=g))
        for a, b in zip(ce.fused_gdn_gating(A_log, a_, b_, bias), fused_gdn_gating(A_log, a_, b_, bias)):
            _close(self, a, b, 1e-5, what="gdn gating")
        h, w, sh, f = (torch.randn(T, 64, generator=g).to(HALF), torch.randn(64, generator=g).to(HALF),
                       torch.randn(T, 64, generator=g).to(HALF), torch.randn(T, 64, generator=g).to(HALF))
        f1, f2 = f.clone(), f.clone()
        ew.fused_gate_sigmoid_mul_add(h, w, sh, f1)
        ce.fused_gate_sigmoid_mul_add(h, w, sh, f2)
        _close(self, f2, f1, 1e-3, what="gate sigmoid mul add")
        _close(self, ce.fused_gate_sigmoid_mul(h, w, sh), ew.fused_gate_sigmoid_mul(h, w, sh), 1e-3, what="gate mul")


@unittest.skipUnless(_IN_INTERP and SGLANG_INSTALLED and NO_CUDA, "needs TRITON_INTERPRET=1 (runs in a subprocess)")
class TestLightningVsTriton(unittest.TestCase):
    """Lightning attention's ``seg_la_fwd`` (Ling 2.5): prefill with and without initial states and
    with the chunk-grid track store, decode with a ``-1`` row; and the lightning checkpoint writer
    (``plugin/inchunk_lightning.py``) against the state SGLang's kernel leaves after a prefix."""

    H, D = 2, 128  # the decode kernel tiles the head by 128 (seg_la.py: K_SPLIT_DIM)
    PD = 64  # prefill head dim: the prefill kernel tiles the head by 32 (K) and 32 or 64 (V), so 64 is
    # still split into tiles, at a quarter of 128's programs

    def _meta(self, lens, slots, scales):
        from sglang.kernels.ops.attention.linear.seg_la import SegLaMeta

        off = _cu(lens, torch.int32)
        return SegLaMeta(batch_size=len(lens), max_q_length=None, q_offsets=off, s_offsets=torch.tensor(slots, dtype=torch.int32),
                         q_lengths=off.diff(), s_scales=torch.tensor(scales, dtype=torch.int32))

    def _inputs(self, T, seed=7, D=None):
        D = self.D if D is None else D
        g = torch.Generator().manual_seed(seed)
        q, k, v = (torch.randn(T, self.H, D, generator=g) * s for s in (1.0, 0.3, 1.0))
        pool = torch.randn(6, self.H, D, D, generator=g) * 0.1
        return q, k, v, pool, torch.tensor([0.0625, 0.0039]).reshape(self.H, 1, 1)

    def test_prefill_and_decode(self):
        from sglang.kernels.ops.attention.linear.seg_la import seg_la_fwd as triton_fn

        from sglang_mamba_ext.plugin.cpu_kernels_lightning import seg_la_fwd as torch_fn

        q, k, v, pool, slope = self._inputs(sum(LENS), D=self.PD)
        off = _cu(LENS)
        for what, slots, scales, track in (("initial states", [3, -1, 1], [1, 1, 1], None),
                                           ("zeros + track", [0, 2, 5], [0, 1, 0], ([0, 64, 64], [4, 4, 0]))):
            outs = []
            for fn in (triton_fn, torch_fn):
                p = pool.clone()
                kw = {} if track is None else dict(track_lens=torch.tensor(track[0], dtype=torch.int32),
                                                   track_state_indices=torch.tensor(track[1], dtype=torch.int32))
                outs.append((fn(q, k, v, p, slope, self._meta(LENS, slots, scales), softmax_scale=self.PD ** -0.5,
                                **kw), p))
            live = torch.cat([torch.arange(off[i], off[i + 1]) for i in range(3) if slots[i] >= 0])
            _close(self, outs[1][0][live], outs[0][0][live], 1e-4, what=f"{what} out")
            _close(self, outs[1][1], outs[0][1], 1e-5, what=f"{what} pool")
        bs = 4
        qd, kd, vd, pool, _ = self._inputs(bs, seed=8)
        meta = self._meta([1] * bs, [2, 0, -1, 5], [1] * bs)
        outs = []
        for fn in (triton_fn, torch_fn):
            p = pool.clone()
            outs.append((fn(qd, kd, vd, p, slope, meta, softmax_scale=self.D ** -0.5), p))
        _close(self, outs[1][0][[0, 1, 3]], outs[0][0][[0, 1, 3]], 1e-5, what="decode out")
        _close(self, outs[1][1], outs[0][1], 1e-5, what="decode pool")

    def test_checkpoint_writer_matches_kernel_prefix(self):
        from sglang.kernels.ops.attention.linear.seg_la import seg_la_fwd as triton_fn

        from sglang_mamba_ext.plugin.inchunk_lightning import write_lightning_checkpoints

        # one token (the decode kernel) at the decode head dim; the prefill kernel's offsets around
        # and across its 32-token blocks at PD
        for D, src, offsets in ((self.D, -1, [1]), (self.PD, -1, [31, 32, 33, 69]), (self.PD, 3, [7, 64, 70])):
            q, k, v, pool, slope = self._inputs(70, seed=9, D=D)
            for o in offsets:
                w = pool.clone()
                write_lightning_checkpoints(k, v, slope, w, [(0, src, [(o, 5)])])
                # SGLang's kernel over the first o tokens, from the same start state (src -1: a
                # zeroed row; one token goes to its decode kernel, which always reads the row)
                t = pool.clone()
                row = max(src, 0)
                if src < 0:
                    t[row] = 0
                triton_fn(q[:o], k[:o], v[:o], t, slope, self._meta([o], [row], [1 if src >= 0 else 0]),
                          softmax_scale=D ** -0.5)
                _close(self, w[5], t[row], 2e-5, what=f"checkpoint at {o} from {src}")


TestCpuKernelsUnderInterpreter = triton_subprocess_case(__file__, SELECT, skip=_IN_INTERP or not SGLANG_INSTALLED)


class TestKernelBridge(unittest.TestCase):
    """``make_kernel_around``: the torch version only for CPU tensors, with the bridges active
    and ``SGLANG_MAMBA_EXT_CPU_KERNELS`` not ``triton``."""

    def _route(self, env, tensor, target="sglang.kernels.ops.attention.fla.chunk.chunk_gated_delta_rule"):
        from sglang_mamba_ext.plugin import cpu_bridges

        calls = []
        around = cpu_bridges.make_kernel_around(target)
        with mock.patch.dict(os.environ, env, clear=False), \
                mock.patch.object(cpu_bridges, "_torch_version", return_value=lambda *a, **k: calls.append("torch")), \
                mock.patch("torch.cuda.is_available", return_value=False):
            around(lambda *a, **k: calls.append("sglang"), tensor, q=tensor)
        return calls

    def test_routes(self):
        from sglang_mamba_ext.plugin.cpu_bridges import ACTIVE_ENV, KERNELS_ENV

        cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
        self.assertEqual(self._route({ACTIVE_ENV: "1", KERNELS_ENV: "torch"}, cpu), ["torch"])
        self.assertEqual(self._route({ACTIVE_ENV: "1", KERNELS_ENV: "triton"}, cpu), ["sglang"])
        self.assertEqual(self._route({ACTIVE_ENV: "0"}, cpu), ["sglang"])
        self.assertEqual(self._route({ACTIVE_ENV: "1", KERNELS_ENV: "torch"}, meta), ["sglang"])  # not a CPU tensor

    def test_conv_update_keeps_speculative_calls_on_sglang(self):
        from sglang_mamba_ext.plugin.cpu_bridges import ACTIVE_ENV, CAUSAL_CONV_TRITON, make_kernel_around

        around = make_kernel_around(CAUSAL_CONV_TRITON + ".causal_conv1d_update")
        calls = []
        with mock.patch.dict(os.environ, {ACTIVE_ENV: "1"}), mock.patch("torch.cuda.is_available", return_value=False):
            around(lambda *a, **k: calls.append("sglang"), torch.zeros(2, 3), torch.zeros(4, 3, 2), torch.zeros(3, 3),
                   intermediate_conv_window=torch.zeros(1))
        self.assertEqual(calls, ["sglang"])

    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_hooks_registered(self):
        from sglang.srt.plugins.hook_registry import HookRegistry

        from sglang_mamba_ext.plugin.cpu_bridges import KERNEL_BRIDGES, register_cpu_bridges

        register_cpu_bridges()
        for target in KERNEL_BRIDGES:
            self.assertTrue(HookRegistry._hooks.get(target), target)
