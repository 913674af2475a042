"""Mamba2 / SSD in-chunk checkpoint writer (``speculative/ops/inchunk/mamba2.py``; issue 24,
item 3): the Triton kernel (CPU: Triton's interpreter) against the torch reference, the
reference against a whole-sequence scan written here independently, and against SGLang's own
chunked Mamba2 kernels (``ssd_combined.mamba_chunk_scan_combined``, ``causal_conv1d_fn`` Triton)
in a subprocess under the interpreter."""

import math
import os
import subprocess
import sys
import textwrap
import unittest

import torch
import torch.nn.functional as F
from conftest import full_suite_only

from sglang_mamba_ext.speculative.ops.inchunk import plan_writes
from sglang_mamba_ext.testing.spec_pair import load_kernel_modules_for_cpu, run_interpreted, triton_subprocess_case

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HV, P, N, G, W = 4, 8, 16, 2, 4
D = HV * P + 2 * G * N


_OPS = "sglang_mamba_ext.speculative.ops.inchunk."
_CAN_RUN = load_kernel_modules_for_cpu([_OPS + "fused", _OPS + "mamba2"],
                                       [(_OPS + "mamba2", "_mamba2_inchunk_kernel"),
                                        (_OPS + "fused", "_inchunk_conv_window_kernel")])


def _weights(L, seed=0, bias=True):
    from sglang_mamba_ext.speculative.ops.inchunk.gpu_check_mamba2 import random_mamba2_weights

    return random_mamba2_weights(L, HV, P, N, G, W, seed=seed, bias=bias)


def _inputs(L, T, seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, T, D, generator=g).to(dtype), torch.randn(L, T, HV, generator=g)


def _pools(L, slots, seed=2):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, slots, D, W - 1, generator=g), torch.randn(L, slots, HV, P, N, generator=g)


def _scan(xbc, dt_raw, w, l, conv0, h0):
    """Whole-sequence Mamba2 scan of layer ``l`` (conv over the padded sequence at once, then
    the SSD recurrence): states after every token, written independently of the writer."""
    seq = torch.cat([conv0, xbc[l].float().t()], dim=1)  # [D, W-1+T]
    y = F.conv1d(seq[None], w.conv_weight[l].float()[:, None, :], w.conv_bias[l].float() if w.conv_bias is not None
                 else None, groups=D)[0]  # [D, T]
    y = F.silu(y).to(xbc.dtype).float().t()
    x, B = y[:, :HV * P].view(-1, HV, P), y[:, HV * P:HV * P + G * N].view(-1, G, N)
    dt = F.softplus(dt_raw[l].float() + w.dt_bias[l])
    states, h = [h0.clone()], h0.clone()
    for t in range(y.shape[0]):
        Bh = B[t].repeat_interleave(HV // G, 0)
        h = torch.exp(dt[t] * w.A[l])[:, None, None] * h + torch.einsum("hp,hn->hpn", dt[t, :, None] * x[t], Bh)
        states.append(h)
    return states, seq


class TestMamba2Reference(unittest.TestCase):
    def test_torch_matches_whole_sequence_scan(self):
        from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_checkpoints

        L, T = 2, 30
        w = _weights(L)
        xbc, dt = _inputs(L, T)
        conv, ssm = _pools(L, 8)
        # row 0: no prefix, tokens 0..19, offsets 0, 7, 19; row 1: from slot 1, tokens 20..29
        writes = plan_writes([(0, -1, [(0, 2), (7, 3), (19, 4)]), (20, 1, [(10, 5), (3, 6)])], "cpu")
        src_conv, src_ssm = conv[:, 1].clone(), ssm[:, 1].clone()
        write_mamba2_checkpoints(xbc, dt, writes, conv, ssm, w, impl="torch")
        for l in range(L):
            st, seq = _scan(xbc[:, :20], dt[:, :20], w, l, torch.zeros(D, W - 1), torch.zeros(HV, P, N))
            for o, d in ((0, 2), (7, 3), (19, 4)):
                torch.testing.assert_close(ssm[l, d], st[o], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(conv[l, d], seq[:, o:o + W - 1])
            st, seq = _scan(xbc[:, 20:], dt[:, 20:], w, l, src_conv[l], src_ssm[l])
            for o, d in ((10, 5), (3, 6)):
                torch.testing.assert_close(ssm[l, d], st[o], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(conv[l, d], seq[:, o:o + W - 1])
            torch.testing.assert_close(ssm[l, 1], src_ssm[l])  # the source is only read

    def test_chunked_scans_at_most_the_chunk(self):
        """Issue 39: each checkpoint adds at most ``chunk - 1`` tokens to the chunk-boundary
        state below it; states equal the whole-sequence scan across several chunks."""
        from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_checkpoints

        L, T = 2, 60
        w = _weights(L)
        xbc, dt = _inputs(L, T)
        conv, ssm = _pools(L, 8)
        writes = plan_writes([(0, 1, [(3, 2), (16, 3), (59, 4)]), (10, -1, [(47, 5)])], "cpu")
        src_conv, src_ssm = conv[:, 1].clone(), ssm[:, 1].clone()
        stats = {}
        write_mamba2_checkpoints(xbc, dt, writes, conv, ssm, w, impl="torch", chunk=8, stats=stats)
        self.assertEqual(stats["scanned"], [3, 0, 3, 7])  # 3-0, 16-16, 59-56, 47-40
        self.assertEqual(stats["chunks"], 7)
        for l in range(L):
            st, seq = _scan(xbc, dt, w, l, src_conv[l], src_ssm[l])
            for o, d in ((3, 2), (16, 3), (59, 4)):
                torch.testing.assert_close(ssm[l, d], st[o], rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(conv[l, d], seq[:, o:o + W - 1])
            st, _ = _scan(xbc[:, 10:], dt[:, 10:], w, l, torch.zeros(D, W - 1), torch.zeros(HV, P, N))
            torch.testing.assert_close(ssm[l, 5], st[47], rtol=1e-5, atol=1e-5)

    def test_bad_inputs_raise(self):
        from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_checkpoints

        w = _weights(1)
        xbc, dt = _inputs(1, 10)
        conv, ssm = _pools(1, 4)
        with self.assertRaisesRegex(ValueError, "reaches past the 10 input tokens"):
            write_mamba2_checkpoints(xbc, dt, plan_writes([(5, -1, [(6, 2)])], "cpu"), conv, ssm, w, impl="torch")
        with self.assertRaisesRegex(ValueError, "shapes disagree"):
            write_mamba2_checkpoints(xbc[:, :, :-1].contiguous(), dt, plan_writes([(0, -1, [(2, 2)])], "cpu"),
                                     conv, ssm, w, impl="torch")
        with self.assertRaisesRegex(ValueError, "unknown impl"):
            write_mamba2_checkpoints(xbc, dt, plan_writes([(0, -1, [(2, 2)])], "cpu"), conv, ssm, w, impl="cuda")


@unittest.skipUnless(_CAN_RUN, "kernels already imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestMamba2Triton(unittest.TestCase):
    def _both(self, dtype, bias):
        from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_checkpoints

        # every offset inside the first 64-token chunk: the kernel scans from the start states;
        # row 1 ends at the last input token, row 2 starts inside row 1
        L, T = 2, 11
        w = _weights(L, bias=bias)
        xbc, dt = _inputs(L, T, dtype=dtype)
        rows = [(0, -1, [(0, 2), (4, 3), (7, 4)]), (7, 1, [(4, 5)]), (9, 0, [(1, 6), (-1, -1)])]
        writes = plan_writes([(s, src, [x for x in items if x[0] >= 0]) for s, src, items in rows], "cpu")
        a_conv, a_ssm = _pools(L, 8)
        b_conv, b_ssm = a_conv.clone(), a_ssm.clone()
        write_mamba2_checkpoints(xbc, dt, writes, a_conv, a_ssm, w, impl="torch")
        write_mamba2_checkpoints(xbc, dt, writes, b_conv, b_ssm, w, impl="triton")
        torch.testing.assert_close(b_ssm, a_ssm, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b_conv, a_conv)
        untouched = [7]
        torch.testing.assert_close(b_ssm[:, untouched], _pools(L, 8)[1][:, untouched])

    def test_chunk_boundaries_match_reference(self):
        """Issue 39: boundary states over 8-token chunks, then the kernel's partial scan (3
        tokens inside the first chunk, none at a boundary, 1 after four chunks, 7 = chunk - 1)."""
        from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_checkpoints

        L, T = 2, 34
        w = _weights(L)
        xbc, dt = _inputs(L, T)
        writes = plan_writes([(0, 1, [(3, 2), (8, 3), (33, 4)]), (10, -1, [(23, 5)])], "cpu")
        a_conv, a_ssm = _pools(L, 8)
        b_conv, b_ssm = a_conv.clone(), a_ssm.clone()
        write_mamba2_checkpoints(xbc, dt, writes, a_conv, a_ssm, w, impl="reference")
        write_mamba2_checkpoints(xbc, dt, writes, b_conv, b_ssm, w, impl="triton", chunk=8)
        torch.testing.assert_close(b_ssm, a_ssm, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b_conv, a_conv)

    def test_float32_with_bias(self):
        self._both(torch.float32, True)

    def test_float16_inputs_without_bias(self):
        self._both(torch.float16, False)


TestUnderTritonInterpreter = triton_subprocess_case(__file__, "Mamba2Triton", skip=_CAN_RUN)  # both classes


_AGAINST_SGLANG = textwrap.dedent(r'''
    import json, torch, torch.nn.functional as F
    from sglang_mamba_ext.plugin.triton_interpret import install_interpreter_shims
    from sglang_mamba_ext.speculative.ops.inchunk import plan_writes
    from sglang_mamba_ext.speculative.ops.inchunk.gpu_check_mamba2 import random_mamba2_weights
    from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_checkpoints
    from sglang.kernels.ops.mamba.triton_ops.ssd_combined import mamba_chunk_scan_combined
    install_interpreter_shims()
    if not hasattr(torch.cpu, "device"):
        import contextlib
        torch.cpu.device = lambda *a, **k: contextlib.nullcontext()
    L, T, HV, P, N, G, W = 1, 50, 4, 8, 16, 2, 4
    D = HV * P + 2 * G * N
    w = random_mamba2_weights(L, HV, P, N, G, W)
    g = torch.Generator().manual_seed(1)
    xbc, dt = torch.randn(L, T, D, generator=g), torch.randn(L, T, HV, generator=g)
    conv, ssm = torch.randn(L, 8, D, W - 1, generator=g), torch.randn(L, 8, HV, P, N, generator=g)
    offsets = [1, 17, 33, 50]
    writes = plan_writes([(0, -1, [(o, 2 + k) for k, o in enumerate(offsets)])], "cpu")
    write_mamba2_checkpoints(xbc, dt, writes, conv, ssm, w, impl="torch")
    seq = torch.cat([torch.zeros(D, W - 1), xbc[0].t()], 1)
    y = F.silu(F.conv1d(seq[None], w.conv_weight[0][:, None, :], w.conv_bias[0], groups=D)[0]).t()
    worst = 0.0
    for k, o in enumerate(offsets):
        x = y[:o, :HV * P].reshape(1, o, HV, P).contiguous()
        B = y[:o, HV * P:HV * P + G * N].reshape(1, o, G, N).contiguous()
        C = y[:o, HV * P + G * N:].reshape(1, o, G, N).contiguous()
        out = torch.empty(1, o, HV, P)
        res = mamba_chunk_scan_combined(x, dt[0, :o].unsqueeze(0).contiguous(), w.A[0].contiguous(), B, C,
                                        chunk_size=16, D=None, z=None, dt_bias=w.dt_bias[0].contiguous(),
                                        return_final_states=True, dt_softplus=True, out=out)
        final = res[-1] if isinstance(res, tuple) else res
        worst = max(worst, (final[0].float() - ssm[0, 2 + k]).abs().max().item())
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_fn
    from sglang_mamba_ext.speculative.ops.inchunk.shortconv import write_conv_window_checkpoints
    Dc, Wc, T2 = 24, 3, 30
    g = torch.Generator().manual_seed(9)
    bx, wt = torch.randn(1, T2, Dc, generator=g), torch.randn(Dc, Wc, generator=g)
    start = torch.randn(1, 2, Dc, Wc - 1, generator=g)
    offs2 = [1, 2, 17, 30]
    conv_worst = 0.0
    for o in offs2:
        mine = start.clone()
        write_conv_window_checkpoints(bx, plan_writes([(0, 1, [(o, 0)])], "cpu"), mine, impl="torch")
        theirs = start[0].clone()
        causal_conv1d_fn(bx[0, :o].t().contiguous(), wt, None, conv_states=theirs,
                         query_start_loc=torch.tensor([0, o], dtype=torch.int32), seq_lens_cpu=[o],
                         cache_indices=torch.tensor([1], dtype=torch.int32),
                         has_initial_state=torch.tensor([True]), activation=None)
        conv_worst = max(conv_worst, (mine[0, 0] - theirs[1]).abs().max().item())
    print(json.dumps({"worst": worst, "conv_worst": conv_worst}))
''')


class TestMamba2AgainstSGLang(unittest.TestCase):
    def test_states_match_sglang_chunked_scan(self):
        """The reference's states after 1, 17, 33 and 50 tokens (inside and across SGLang's
        16-token chunks) equal the final states of SGLang's chunked SSD scan over those prefixes."""
        env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-c", _AGAINST_SGLANG], env=env,
                              capture_output=True, text=True, timeout=900)
        self.assertEqual(proc.returncode, 0, proc.stderr[-4000:])
        res = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
        self.assertLess(res["worst"], 1e-3)
        # LFM2's short conv: the window after 1, 2, 17 and 30 tokens from a start window equals
        # the conv_states SGLang's Triton causal_conv1d_fn leaves after that prefix (exact copy)
        self.assertEqual(res["conv_worst"], 0.0)


@unittest.skipUnless(_CAN_RUN, "kernels already imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestMamba2TritonShortConv(unittest.TestCase):
    def test_conv_window_triton_matches_torch(self):
        """LFM2's short conv (``shortconv.py``): the window after each offset, both paths."""
        from sglang_mamba_ext.speculative.ops.inchunk.shortconv import write_conv_window_checkpoints

        L, T, Dc, Wc = 2, 20, 24, 3
        g = torch.Generator().manual_seed(3)
        bx = torch.randn(L, T, Dc, generator=g).half()
        a = torch.randn(L, 6, Dc, Wc - 1, generator=g).half()
        b = a.clone()
        writes = plan_writes([(0, -1, [(0, 2), (1, 3), (9, 4)]), (9, 1, [(11, 5)])], "cpu")
        write_conv_window_checkpoints(bx, writes, a, impl="torch")
        write_conv_window_checkpoints(bx, writes, b, impl="triton")
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(a[:, 4], bx[:, 7:9].transpose(1, 2))
        torch.testing.assert_close(a[:, 3][:, :, 0], torch.zeros(L, Dc, dtype=torch.half))
        torch.testing.assert_close(a[:, 5], bx[:, 18:20].transpose(1, 2))


@full_suite_only("scripts/gpu_check.sh's Mamba2 in-chunk section in its CPU mode: its kernels checked under the "
                 "interpreter by TestUnderTritonInterpreter, the script's GDN / KDA section by "
                 "tests/test_inchunk_checkpoints.py's TestGpuCheckTinyMode")
class TestMamba2GpuCheckTinyMode(unittest.TestCase):
    def test_tiny_mode_runs(self):
        """``gpu_check_mamba2 --tiny`` (the GPU check's code path at toy shapes, interpreted):
        correctness OK and the last line carries the ratio."""
        proc = run_interpreted("sglang_mamba_ext.speculative.ops.inchunk.gpu_check_mamba2", ["--tiny"], timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stdout[-2000:] + proc.stderr[-2000:])
        self.assertIn(" OK", proc.stdout)
        last = proc.stdout.strip().splitlines()[-1]
        self.assertRegex(last, r"^mamba2_inchunk_cost_ratio=[0-9.]+$")


if __name__ == "__main__":
    unittest.main()
