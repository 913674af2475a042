"""Triton kernels of the deferred verify vs their torch references (CPU: Triton's interpreter).

Without CUDA the kernel modules are imported under ``TRITON_INTERPRET=1``
(:func:`sglang_mamba_ext.testing.spec_pair.load_triton_kernels_for_cpu`); if another test imported
them earlier without it, the tests re-run in a subprocess (``TestUnderTritonInterpreter``).
"""

import unittest

import pytest
import torch
from conftest import full_suite_only

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape, gated_delta_rule
from sglang_mamba_ext.speculative.replay import ReplayWeights, replay
from sglang_mamba_ext.speculative.stash import ActivationStash, StashDims
from sglang_mamba_ext.speculative.ops.verify.naive import tree_conv, tree_recurrence
from sglang_mamba_ext.speculative.tree import TreeIndex, stack_trees
from sglang_mamba_ext.speculative.verify_buffers import OneLayerBuffer

from sglang_mamba_ext.testing.spec_pair import load_triton_kernels_for_cpu, triton_subprocess_case  # noqa: E402

_CAN_RUN = load_triton_kernels_for_cpu()
_CAN_TRITON_INPROC = _CAN_RUN
SELECT = '(Replay or TreeVerify) and not RealShapes'
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def setUpModule():
    torch.set_num_threads(1)


def _mixers(L, shape, hidden=16, seed=0, gate="kda"):
    torch.manual_seed(seed)
    ms = [GatedDeltaRuleMixer(hidden, shape, conv_bias=True, gate=gate) for _ in range(L)]
    with torch.no_grad():
        for m in ms:
            m.A_log.normal_(0, 0.5)
            m.dt_bias.normal_()
            m.conv_bias.normal_()
    return ms


@unittest.skipUnless(_CAN_RUN, "kernels already imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestReplayTriton(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.testing.spec_pair import triton_interpreter_env

        cls.enterClassContext(triton_interpreter_env())

    def _run(self, state_dtype, act_dtype, strided, keep=None, expect_tracked=(True, False, False, False), gate="kda"):
        shape = LinearAttnShape(2, 4, 8, 8, 4)
        L, R, A, SL = 2, 5, 4, 9
        mixers = _mixers(L, shape, gate=gate)
        w = ReplayWeights.from_mixers(mixers)
        self.assertEqual(w.per_head_gate, gate == "gdn")
        st = ActivationStash(L, R, A, StashDims(shape.conv_dim, 32 if gate == "kda" else 4, 4), dtype=act_dtype)
        x = torch.randn(L, R, A, 16)
        with torch.no_grad():
            for l in range(L):
                mq, gr, br = mixers[l].project_raw(x[l])
                st.mixed_qkv[l], st.g_raw[l], st.b_raw[l] = mq.to(act_dtype), gr.to(act_dtype), br.to(act_dtype)
        if strided:  # SGLang-like layouts: conv [.., W-1, D], temporal [.., HV, V, K]
            conv_phys = torch.randn(L, SL, 3, shape.conv_dim).to(act_dtype)
            temp_phys = torch.randn(L, SL, 4, 8, 8).to(state_dtype)
            views = lambda c, t: (c.transpose(-1, -2), t.transpose(-1, -2))  # noqa: E731
        else:
            conv_phys = torch.randn(L, SL, shape.conv_dim, 3).to(act_dtype)
            temp_phys = torch.randn(L, SL, 4, 8, 8).to(state_dtype)
            views = lambda c, t: (c, t)  # noqa: E731
        rows = torch.tensor([1, 2, 3, 4])
        slots = torch.tensor([0, 3, 5, -1])
        tslots = torch.tensor([1, -1, 2, 7])
        counts = torch.tensor([4, 2, 0, 3])
        seqs = torch.tensor([5, 6, 7, 7])
        out = {}
        for impl in ("torch", "triton"):
            st.set_pending(rows, counts, seqs, tslots)
            c, t = conv_phys.clone(), temp_phys.clone()
            cv, tv = views(c, t)
            with torch.no_grad():
                tracked = replay(st, rows, slots, cv, tv, w, 8, keep=keep, impl=impl)
            self.assertEqual(tracked.tolist(), list(expect_tracked))
            self.assertEqual(st.count[rows].tolist(), [0, 0, 0, 0])
            out[impl] = (c, t)
        tol = dict(rtol=1e-5, atol=1e-5) if state_dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(out["triton"][0], out["torch"][0], rtol=0, atol=0)
        torch.testing.assert_close(out["triton"][1].float(), out["torch"][1].float(), **tol)
        # untouched slots: count 0 (slot 5), slot -1 (row 4), and unrelated ones
        for s in (4, 5, 6, 8):
            torch.testing.assert_close(out["triton"][1][:, s], temp_phys[:, s], rtol=0, atol=0)
        # replay really changed the pending slots and the crossing's track slot
        for s in (0, 3, 1) if expect_tracked[0] else (0, 3):
            self.assertFalse(torch.equal(out["triton"][1][:, s], temp_phys[:, s]))
        if not expect_tracked[0]:
            torch.testing.assert_close(out["triton"][1][:, 1], temp_phys[:, 1], rtol=0, atol=0)

    def test_fp32_contiguous(self):
        self._run(torch.float32, torch.float32, strided=False)

    def test_fp32_sglang_layouts(self):
        self._run(torch.float32, torch.float32, strided=True)

    def test_keep_cuts_runs(self):
        # row 1 keeps 2 of its 4 tokens (5 + 2 = 7: no crossing of 8 any more)
        self._run(torch.float32, torch.float32, strided=False, keep=torch.tensor([2, 9, 0, 1]),
                  expect_tracked=(False, False, False, False))

    def test_bf16_activations_state(self):
        self._run(torch.bfloat16, torch.bfloat16, strided=False)

    def test_gdn_per_head_gate(self):
        """Gated DeltaNet (Qwen3-Next): raw gate [.., HV], one decay per value head; the
        Triton replay equals the mixer's own math, in SGLang's GDN/KDA layouts too."""
        self._run(torch.float32, torch.float32, strided=False, gate="gdn")
        self._run(torch.float32, torch.float32, strided=True, gate="gdn")


@unittest.skipUnless(_CAN_RUN, "kernels already imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestTreeVerifyTriton(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.testing.spec_pair import triton_interpreter_env

        cls.enterClassContext(triton_interpreter_env())

    def _inputs(self, per_k=True):
        shape = LinearAttnShape(2, 4, 8, 8, 4)
        (m,) = _mixers(1, shape, seed=3)
        tree = stack_trees([
            ([0] * 7, [-1, 0, 0, 1, 1, 2, 3]),
            ([0] * 7, [-1, 0, 1, 2, 0, 4, 5]),
        ])
        idx = TreeIndex.build(tree, 4)
        x = torch.randn(2, 7, 16)
        with torch.no_grad():
            mq, gr, br = m.project_raw(x)
            g, beta = m.activate_gates(gr, br)
            if not per_k:
                g = g[..., 0]  # per-head scalar gate (GDN)
            y, _ = tree_conv(m, mq, torch.randn(2, *shape.conv_state_shape), idx)
            q, k, v = m.split_qkv(y)
        pool = torch.randn(5, *shape.temporal_state_shape)
        slots = torch.tensor([3, 1])
        return m, idx, q, k, v, g, beta, pool, slots

    def test_onchip_and_buffered_match_torch(self):
        from sglang_mamba_ext.speculative.ops.verify.fused import tree_recurrence_triton

        for per_k in (True, False):
            m, idx, q, k, v, g, beta, pool, slots = self._inputs(per_k)
            scale = m.shape.head_k_dim ** -0.5
            rows = torch.tensor([2, 0])
            ref_buf = OneLayerBuffer(3, 7, m.shape).ssm
            with torch.no_grad():
                o_ref = tree_recurrence(m, q, k, v, g, beta, pool[slots], idx, ref_buf, rows)
            o_chip = tree_recurrence_triton(q, k, v, g, beta, pool, slots, idx, scale)
            torch.testing.assert_close(o_chip, o_ref, rtol=1e-5, atol=1e-5)
            buf = torch.zeros_like(ref_buf)
            o_buf = tree_recurrence_triton(q, k, v, g, beta, pool, slots, idx, scale, node_states=buf, rows=rows)
            torch.testing.assert_close(o_buf, o_ref, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(buf[rows], ref_buf[rows], rtol=1e-5, atol=1e-5)

    def test_fused_pending_replay(self):
        """Folding stashed (post-conv) tokens into the state load == replay then verify."""
        from sglang_mamba_ext.speculative.ops.verify.fused import tree_recurrence_triton

        m, idx, q, k, v, g, beta, pool, slots = self._inputs()
        scale = m.shape.head_k_dim ** -0.5
        A = 3
        pq, pk = torch.nn.functional.normalize(torch.randn(2, A, 2, 8), dim=-1), torch.nn.functional.normalize(torch.randn(2, A, 2, 8), dim=-1)
        pv = torch.randn(2, A, 4, 8)
        pg = -torch.rand(2, A, 4, 8)
        pb = torch.rand(2, A, 4)
        cnt = torch.tensor([2, 0])
        expect_pool = pool.clone()
        with torch.no_grad():
            _, S = gated_delta_rule(pq[0, :2], pk[0, :2], pv[0, :2], pg[0, :2], pb[0, :2], pool[3], scale=scale)
        expect_pool[3] = S
        o_ref = tree_recurrence(m, q, k, v, g, beta, expect_pool[slots], idx, OneLayerBuffer(3, 7, m.shape).ssm, torch.tensor([0, 1]))
        got_pool = pool.clone()
        o = tree_recurrence_triton(q, k, v, g, beta, got_pool, slots, idx, scale, pending=(pq, pk, pv, pg, pb, cnt))
        torch.testing.assert_close(got_pool, expect_pool, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(o, o_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@unittest.skipUnless(_CAN_RUN, "kernels already imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestTreeVerifyOnChipRealShapes(unittest.TestCase):
    """The glue's on-chip verify entry (``speculative/verify_onchip.py::onchip_tree_verify``:
    SGLang's ``target_verify`` arguments, raw gates, pre-norm q/k, states ``[slots, HV, V, K]``)
    against the torch tree recurrence at the real models' per-rank head shapes, reduced batch:
    Kimi-Linear-48B-A3B (KDA, TP 1: H = HV = 32, K = V = 128) and Qwen3-Next-80B-A3B (GDN, TP 2:
    H = 8, HV = 16, K = V = 128), one request's EAGLE tree of topk 2, steps 3 (11 nodes, depth
    4). Slow under the interpreter (every head of the layer)."""

    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.testing.spec_pair import triton_interpreter_env

        cls.enterClassContext(triton_interpreter_env())

    def _check(self, H, HV, gate):
        from sglang_mamba_ext.speculative.tree import DraftTree, eagle_tree_parents
        from sglang_mamba_ext.speculative.verify_onchip import choose_verify, onchip_tree_verify

        torch.manual_seed(0)
        K = V = 128
        shape = LinearAttnShape(H, HV, K, V, 4)
        self.assertEqual(choose_verify(K, V, 4, env="auto")[0], "on_chip")
        parents = eagle_tree_parents(2, 3)
        T, N = len(parents), 1
        index = TreeIndex.build(DraftTree(torch.zeros(N, T, dtype=torch.long), torch.tensor([parents] * N)), 4)
        m = GatedDeltaRuleMixer(8, shape, gate=gate)
        with torch.no_grad():
            m.A_log.normal_(0, 0.5)
            m.dt_bias.normal_()
        q = torch.randn(1, N * T, H, K)
        k = torch.randn(1, N * T, H, K)
        v = torch.randn(1, N * T, HV, V)
        a = torch.randn(N * T, HV * K if gate == "kda" else HV)
        b = torch.randn(1, N * T, HV)
        pool_vk = torch.randn(4, HV, V, K)  # SGLang's [slots, HV, V, K]
        slots = torch.tensor([3])
        o = onchip_tree_verify(q, k, v, a, b, m.A_log, m.dt_bias, pool_vk, slots, T, index.parents, 4,
                               per_head_gate=gate == "gdn")
        self.assertEqual(tuple(o.shape), (1, N * T, HV, V))
        # reference: the mixer's own gates and L2 norm, torch tree recurrence over a node buffer
        with torch.no_grad():
            g, beta = m.activate_gates(a.view(N, T, -1), b.view(N, T, HV))
            from sglang_mamba_ext.models.linear_attn import l2_normalize

            qn, kn = l2_normalize(q.view(N, T, H, K)), l2_normalize(k.view(N, T, H, K))
            buf = OneLayerBuffer(N, T, shape).ssm
            o_ref = tree_recurrence(m, qn, kn, v.view(N, T, HV, V), g, beta, pool_vk[slots].transpose(-1, -2), index,
                                    buf, torch.arange(N))
        self.assertGreater(float(o_ref.abs().max()), 0.1)
        torch.testing.assert_close(o.view(N, T, HV, V), o_ref, rtol=2e-4, atol=2e-4)

    def test_kimi_linear_kda_per_rank(self):
        self._check(32, 32, "kda")

    def test_qwen3_next_gdn_tp2_per_rank(self):
        self._check(8, 16, "gdn")


@pytest.mark.slow
@full_suite_only("scripts/gpu_check.sh's speculative section in its CPU mode: its kernels checked under the interpreter "
                 "by TestUnderTritonInterpreter, the script's in-chunk section by tests/test_inchunk_checkpoints.py's "
                 "TestGpuCheckTinyMode")
class TestGpuCheckTinyMode(unittest.TestCase):
    """``python -m sglang_mamba_ext.speculative.ops.gpu_check --tiny`` (``scripts/gpu_check.sh``'s
    body at toy shapes, CPU, Triton's interpreter) runs to the end with every correctness check
    passing (exit 0), including the glue's on-chip verify and the one-layer timing."""

    def test_tiny_mode_runs(self):
        from sglang_mamba_ext.testing.spec_pair import run_interpreted

        r = run_interpreted("sglang_mamba_ext.speculative.ops.gpu_check", ["--tiny"], timeout=1200)
        self.assertEqual(r.returncode, 0, (r.stdout + r.stderr)[-3000:])
        lines = r.stdout.splitlines()
        self.assertTrue(any(l.startswith("correctness: glue on-chip verify") for l in lines), r.stdout)
        self.assertTrue(any(l.startswith("onchip_vs_one_layer=") for l in lines), r.stdout)
        self.assertTrue(lines[-2].startswith("memory_ratio=") and lines[-1].startswith("replay_overhead="), r.stdout)


TestUnderTritonInterpreter = triton_subprocess_case(__file__, SELECT, skip=_CAN_TRITON_INPROC)
TestUnderTritonInterpreterRealShapes = full_suite_only("the verify kernels at real model shapes, interpreted: "
                                                       "TestUnderTritonInterpreter checks them at small shapes")(
    pytest.mark.slow(triton_subprocess_case(__file__, "RealShapes", skip=_CAN_TRITON_INPROC)))


if __name__ == "__main__":
    unittest.main()
