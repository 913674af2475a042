"""Unit tests of the deferred-verify building blocks (``docs/design.md``, "Deferred update"): tree tables, greedy acceptance,
raw projections, stash, tree conv / recurrence against the sequential mixer math, commit."""

import unittest

import torch

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape
from sglang_mamba_ext.speculative.ops.verify.naive import tree_conv, tree_recurrence
from sglang_mamba_ext.speculative.replay import ReplayWeights, replay, track_steps
from sglang_mamba_ext.speculative.stash import ActivationStash, StashDims
from sglang_mamba_ext.speculative.tree import (
    DraftTree,
    TreeIndex,
    chain_parents,
    eagle_tree_parents,
    greedy_accept,
    max_draft_token_num,
    stack_trees,
)
from sglang_mamba_ext.speculative.verify_buffers import OneLayerBuffer, SnapshotBuffers, commit_snapshot


def setUpModule():
    torch.set_num_threads(1)


def make_mixers(n, shape=LinearAttnShape(2, 4, 8, 8, 4), hidden=16, conv_bias=True, seed=0, gate="kda"):
    torch.manual_seed(seed)
    ms = [GatedDeltaRuleMixer(hidden, shape, conv_bias=conv_bias, gate=gate) for _ in range(n)]
    with torch.no_grad():
        for m in ms:
            m.A_log.normal_(0, 0.5)
            m.dt_bias.normal_()
            if m.conv_bias is not None:
                m.conv_bias.normal_()
    return ms


class TestTree(unittest.TestCase):
    def test_eagle_shape_and_sizes(self):
        self.assertEqual(max_draft_token_num(1, 3), 4)
        self.assertEqual(max_draft_token_num(2, 3), 1 + 2 + 2 * 4)
        self.assertEqual(max_draft_token_num(4, 3), 37)
        p = eagle_tree_parents(2, 2)
        self.assertEqual(p, [-1, 0, 0, 1, 1, 2, 2])
        self.assertEqual(eagle_tree_parents(1, 3), chain_parents(4))
        with self.assertRaises(ValueError):
            eagle_tree_parents(4, 3, 63)

    def test_topological_order_enforced(self):
        with self.assertRaises(ValueError):
            DraftTree(torch.zeros(1, 3, dtype=torch.long), torch.tensor([[-1, 2, 0]]))

    def test_depth_path_mask(self):
        t = stack_trees([([5, 6, 7, 8, 9], [-1, 0, 0, 1, 3])])
        self.assertEqual(t.depth().tolist(), [[1, 2, 2, 3, 4]])
        self.assertEqual(t.path(0, 4), [0, 1, 3, 4])
        m = t.ancestor_mask()[0]
        self.assertEqual(m[4].tolist(), [True, True, False, True, True])
        self.assertEqual(m[2].tolist(), [True, False, True, False, False])
        idx = TreeIndex.build(t, conv_kernel=4)
        # node 4: inputs before it along the path are nodes 0, 1, 3
        self.assertEqual(idx.conv_src[0, 4].tolist(), [0, 1, 3])
        # node 1: main window's last two columns then node 0
        self.assertEqual(idx.conv_src[0, 1].tolist(), [-2, -3, 0])
        # node 0: the whole main window
        self.assertEqual(idx.conv_src[0, 0].tolist(), [-1, -2, -3])

    def test_greedy_accept(self):
        #      0(5)
        #    1(6)  2(7)
        #   3(8)     4(9)
        t = stack_trees([([5, 6, 7, 8, 9], [-1, 0, 0, 1, 2]), ([5, 6, 7, 8, 9], [-1, 0, 0, 1, 2])])
        pred = torch.tensor([[7, 0, 9, 0, 11], [6, 1, 0, 0, 0]])
        a = greedy_accept(t, pred)
        self.assertEqual(a.committed_nodes(0), [0, 2, 4])
        self.assertEqual(int(a.bonus_token[0]), 11)
        self.assertEqual(a.committed_nodes(1), [0, 1])
        self.assertEqual(int(a.bonus_token[1]), 1)
        self.assertEqual(a.accept_length.tolist(), [2, 1])
        self.assertEqual(a.last_node.tolist(), [4, 1])


class TestRawProjection(unittest.TestCase):
    def test_split_equals_project_bitwise(self):
        (m,) = make_mixers(1)
        x = torch.randn(5, 16)
        mq, g, beta = m.project(x)
        mq2, gr, br = m.project_raw(x)
        g2, beta2 = m.activate_gates(gr, br)
        torch.testing.assert_close(mq, mq2, rtol=0, atol=0)
        torch.testing.assert_close(g, g2, rtol=0, atol=0)
        torch.testing.assert_close(beta, beta2, rtol=0, atol=0)


class TestStash(unittest.TestCase):
    def test_only_accepted_nodes_are_stashed(self):
        dims = StashDims(conv_dim=3, gate_dim=2, beta_dim=1)
        st = ActivationStash(num_layers=2, num_rows=4, max_accept=3, dims=dims, dtype=torch.float32)
        T = 5
        # every node's record carries its node id + 100*request
        mq = torch.arange(T).float()[None, :, None].repeat(2, 1, 3) + torch.tensor([0.0, 100.0])[:, None, None]
        gr = mq[..., :2].clone()
        br = mq[..., :1].clone()
        acc = torch.tensor([[0, 2, 4], [0, -1, -1]])
        rows = torch.tensor([3, 1])
        st.write_layer(1, rows, acc, mq, gr, br)
        self.assertEqual(st.mixed_qkv[1, 3, :, 0].tolist(), [0.0, 2.0, 4.0])
        self.assertEqual(st.mixed_qkv[1, 1, :1, 0].tolist(), [100.0])
        # rejected nodes (1, 3 of request 0; 1..4 of request 1) never appear anywhere
        vals = set(st.mixed_qkv.flatten().tolist()) | set(st.g_raw.flatten().tolist())
        self.assertFalse(vals & {1.0, 3.0, 101.0, 102.0, 103.0, 104.0})
        torch.testing.assert_close(st.mixed_qkv[0], torch.zeros_like(st.mixed_qkv[0]), rtol=0, atol=0)
        st.set_pending(rows, torch.tensor([3, 1]), torch.tensor([10, 20]))
        with self.assertRaises(RuntimeError):
            st.set_pending(rows, torch.tensor([1, 1]), torch.tensor([0, 0]))
        with self.assertRaises(ValueError):
            st.write_layer(0, rows, torch.zeros(2, 4, dtype=torch.long), mq, gr, br)
        self.assertEqual(st.nbytes(), ActivationStash.bytes_for(2, 4, 3, dims, torch.float32))

    def test_track_steps(self):
        seq = torch.tensor([6, 6, 7, 5, 8])
        cnt = torch.tensor([2, 1, 1, 4, 0])
        self.assertEqual(track_steps(seq, cnt, 8).tolist(), [1, -1, 0, 2, -1])
        self.assertEqual(track_steps(seq, cnt, None).tolist(), [-1] * 5)


class TestReplayTorch(unittest.TestCase):
    """Replay of a stashed run == the mixer's own forward over those tokens."""

    def test_replay_equals_forward(self):
        L = 2
        mixers = make_mixers(L)
        w = ReplayWeights.from_mixers(mixers)
        s = mixers[0].shape
        st = ActivationStash(L, 3, 4, StashDims(s.conv_dim, s.num_v_heads * s.head_k_dim, s.num_v_heads), dtype=torch.float32)
        conv = torch.randn(L, 6, *s.conv_state_shape)
        temp = torch.randn(L, 6, *s.temporal_state_shape)
        x = torch.randn(L, 4, 16)
        expect = []
        with torch.no_grad():
            for l, m in enumerate(mixers):
                mq, gr, br = m.project_raw(x[l])
                st.mixed_qkv[l, 2], st.g_raw[l, 2], st.b_raw[l, 2] = mq, gr, br
                _, c3, t3 = m(x[l, :3], conv[l, 4], temp[l, 4])  # state after 3 tokens (checkpoint)
                _, c4, t4 = m(x[l], conv[l, 4], temp[l, 4])
                expect.append((c3, t3, c4, t4))
            st.set_pending(torch.tensor([2]), torch.tensor([4]), torch.tensor([13]), torch.tensor([1]))
            tracked = replay(st, torch.tensor([2]), torch.tensor([4]), conv, temp, w, 16, impl="torch")
        self.assertEqual(tracked.tolist(), [True])
        self.assertEqual(int(st.count[2]), 0)
        for l, (c3, t3, c4, t4) in enumerate(expect):
            # (projections of 3 vs 4 rows may round differently: 1 ulp)
            torch.testing.assert_close(conv[l, 4], c4, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(temp[l, 4], t4, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(conv[l, 1], c3, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(temp[l, 1], t3, rtol=1e-5, atol=1e-6)


    def test_replay_from_raw_weights_equals_the_mixers_replay(self):
        """CPU serving's replay (weights from a served model's raw tensors, no mixers: the
        in-chunk writer's torch path) == the mixers' own replay: KDA and GDN gates, a row that
        crosses a track boundary, one that does not, and a skipped slot (-1)."""
        L = 2
        for gate in ("kda", "gdn"):
            with self.subTest(gate=gate):
                mixers = make_mixers(L, seed=1, gate=gate)
                shape = mixers[0].shape
                w = ReplayWeights.from_mixers(mixers)
                raw = ReplayWeights(w.shape, w.conv_weight, w.conv_bias, w.A_log, w.dt_bias,
                                    per_head_gate=w.per_head_gate)
                s = shape
                gw = s.num_v_heads if gate == "gdn" else s.num_v_heads * s.head_k_dim
                conv0 = torch.randn(L, 7, *s.conv_state_shape)
                temp0 = torch.randn(L, 7, *s.temporal_state_shape)
                out = {}
                for name, weights in (("mixers", w), ("raw", raw)):
                    st = ActivationStash(L, 4, 5, StashDims(s.conv_dim, gw, s.num_v_heads), dtype=torch.float32)
                    g = torch.Generator().manual_seed(2)
                    st.mixed_qkv.copy_(torch.randn(st.mixed_qkv.shape, generator=g))
                    st.g_raw.copy_(torch.randn(st.g_raw.shape, generator=g))
                    st.b_raw.copy_(torch.randn(st.b_raw.shape, generator=g))
                    # rows 0, 3, 1: 5 tokens from seq 14 (crosses 16 after step 1 -> track slot 6),
                    # 3 tokens from seq 20 (no crossing), 2 tokens into slot -1 (skipped)
                    rows, slots = torch.tensor([0, 3, 1]), torch.tensor([2, 4, -1])
                    st.set_pending(rows, torch.tensor([5, 3, 2]), torch.tensor([14, 20, 9]), torch.tensor([6, 5, 0]))
                    conv, temp = conv0.clone(), temp0.clone()
                    tracked = replay(st, rows, slots, conv, temp, weights, 16, impl="torch")
                    out[name] = (tracked.tolist(), conv, temp, st.count.tolist())
                self.assertEqual(out["raw"][0], out["mixers"][0])
                self.assertEqual(out["raw"][0][:2], [True, False])
                self.assertEqual(out["raw"][3], [0, 0, 0, 0])
                torch.testing.assert_close(out["raw"][1], out["mixers"][1], rtol=1e-6, atol=1e-6)
                torch.testing.assert_close(out["raw"][2], out["mixers"][2], rtol=1e-5, atol=1e-5)
                self.assertFalse(torch.equal(out["raw"][2][:, 6], temp0[:, 6]))  # the track slot was written
                torch.testing.assert_close(out["raw"][2][:, [0, 1, 3, 5]], temp0[:, [0, 1, 3, 5]], rtol=0, atol=0)


class TestTreeVerifyTorch(unittest.TestCase):
    """Every tree node's output / state == the sequential mixer along the node's path."""

    def _setup(self, seed=0):
        (m,) = make_mixers(1, seed=seed)
        tree = stack_trees([
            ([0] * 7, [-1, 0, 0, 1, 1, 2, 3]),
            ([0] * 7, [-1, 0, 1, 2, 0, 4, 5]),
        ])
        x = torch.randn(2, 7, 16)
        s = m.shape
        conv0 = torch.randn(2, *s.conv_state_shape)
        S0 = torch.randn(2, *s.temporal_state_shape)
        return m, tree, x, conv0, S0

    @staticmethod
    def _node_inputs(m, x, conv0, idx):
        """(raw projections, activated gates g, beta, post-conv (q, k, v), windows) of every node."""
        mq, gr, br = m.project_raw(x)
        g, beta = m.activate_gates(gr, br)
        y, windows = tree_conv(m, mq, conv0, idx)
        return mq, g, beta, m.split_qkv(y), windows

    def _sequential(self, m, tree, mq_all, g_all, beta_all, conv0, S0, n, i):
        # the mixer's sequential steps over the node's path, from the same projections
        path = tree.path(n, i)
        yc, c = m.conv(mq_all[n, path], conv0[n])
        q, k, v = m.split_qkv(yc)
        o, S2 = m.recurrence(q, k, v, g_all[n, path], beta_all[n, path], S0[n])
        return o[-1], c, S2

    def test_tree_conv_and_recurrence(self):
        m, tree, x, conv0, S0 = self._setup()
        idx = TreeIndex.build(tree, 4)
        with torch.no_grad():
            mq, g, beta, (q, k, v), windows = self._node_inputs(m, x, conv0, idx)
            for mode in ("snapshot", "one_layer", "head_chunk"):
                rows = torch.tensor([2, 0])
                if mode == "snapshot":
                    buf = SnapshotBuffers(1, 3, 7, m.shape).layer(0)[0]
                    hc = None
                else:
                    hc = 2 if mode == "head_chunk" else None
                    buf = OneLayerBuffer(3, 7, m.shape, head_chunk=hc).ssm
                o = tree_recurrence(m, q, k, v, g, beta, S0, idx, buf, rows, head_chunk=hc)
                for n in range(2):
                    for i in range(7):
                        o_ref, c_ref, S_ref = self._sequential(m, tree, mq, g, beta, conv0, S0, n, i)
                        torch.testing.assert_close(o[n, i], o_ref.float(), rtol=1e-5, atol=1e-6)
                        torch.testing.assert_close(windows[n, i], c_ref, rtol=0, atol=0)
                        if hc is None:
                            torch.testing.assert_close(buf[rows[n], i], S_ref, rtol=1e-5, atol=1e-6)
                        elif i == 6:  # the buffer holds the last head group only
                            torch.testing.assert_close(buf[rows[n], i], S_ref[2:], rtol=1e-5, atol=1e-6)

    def test_onchip_torch_form_equals_the_buffered_recurrence(self):
        """The on-chip verify's torch form (CPU serving: no node-state buffer, each node stepped
        from the main state along its root path) gives every node's output of the buffered
        reference, which equals the sequential mixer (test above)."""
        from sglang_mamba_ext.speculative.verify_onchip import onchip_tree_recurrence

        m, tree, x, conv0, S0 = self._setup(seed=3)
        idx = TreeIndex.build(tree, 4)
        with torch.no_grad():
            _, g, beta, (q, k, v), _ = self._node_inputs(m, x, conv0, idx)
            buf = OneLayerBuffer(2, 7, m.shape).ssm
            want = tree_recurrence(m, q, k, v, g, beta, S0, idx, buf, torch.tensor([0, 1]))
            pool = torch.cat([torch.randn(1, *S0.shape[1:]), S0])  # main states in slots 1, 2
            got = onchip_tree_recurrence(q, k, v, g, beta, pool, torch.tensor([1, 2]), idx.parents, 4, m.scale,
                                         impl="torch")
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            chain = onchip_tree_recurrence(q[:, :3], k[:, :3], v[:, :3], g[:, :3], beta[:, :3], pool,
                                           torch.tensor([1, 2]), None, 4, m.scale, impl="torch")
            for n in range(2):  # a chain: node i after tokens 0..i
                o, _ = m.recurrence(q[n, :3], k[n, :3], v[n, :3], g[n, :3], beta[n, :3], S0[n])
                torch.testing.assert_close(chain[n], o.float(), rtol=1e-5, atol=1e-6)
            with self.assertRaisesRegex(ValueError, "impl must be"):
                onchip_tree_recurrence(q, k, v, g, beta, pool, torch.tensor([1, 2]), idx.parents, 4, m.scale, impl="x")

    def test_head_chunk_validation(self):
        with self.assertRaises(ValueError):
            OneLayerBuffer(2, 3, LinearAttnShape(2, 4, 8, 8, 4), head_chunk=3)
        with self.assertRaises(ValueError):
            OneLayerBuffer(2, 3, LinearAttnShape(2, 4, 8, 8, 4), head_chunk=1)  # < HV/H

    def test_commit_snapshot(self):
        s = LinearAttnShape(1, 2, 4, 4, 3)
        snap = SnapshotBuffers(2, 3, 4, s)
        snap.ssm.normal_()
        snap.conv.normal_()
        conv = torch.zeros(2, 5, *s.conv_state_shape)
        temp = torch.zeros(2, 5, *s.temporal_state_shape)
        commit_snapshot(snap, torch.tensor([1, 2]), torch.tensor([3, 0]), torch.tensor([2, 0]), conv, temp,
                        torch.tensor([4, 1]), torch.tensor([1, -1]))
        torch.testing.assert_close(temp[:, 3], snap.ssm[:, 1, 2], rtol=0, atol=0)
        torch.testing.assert_close(conv[:, 0], snap.conv[:, 2, 0], rtol=0, atol=0)
        torch.testing.assert_close(temp[:, 4], snap.ssm[:, 1, 1], rtol=0, atol=0)
        torch.testing.assert_close(temp[:, 1], torch.zeros_like(temp[:, 1]), rtol=0, atol=0)


if __name__ == "__main__":
    unittest.main()
