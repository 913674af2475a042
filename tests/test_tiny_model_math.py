"""Layer math and reference model of the tiny hybrid model (no SGLang).

Oracles: fla-core's torch recurrences (``naive_recurrent_kda``,
``naive_recurrent_gated_delta_rule``), torch's ``F.conv1d``, and the model itself run
one-shot vs in pieces (chunked prefill / decode with carried state).
"""

import tempfile
import unittest

import torch
import torch.nn.functional as F
from conftest import small_mixer

from sglang_mamba_ext.models.linear_attn import (
    GatedDeltaRuleMixer,
    LinearAttnShape,
    causal_conv1d_update,
    gated_delta_rule,
    gated_delta_rule_step,
    l2_normalize,
)
from sglang_mamba_ext.models.tiny_builder import build_tiny_model
from sglang_mamba_ext.models.tiny_hybrid import (
    TinyHybridReference,
    apply_rope,
    attention,
    causal_mask,
)


def setUpModule():
    # One intra-op thread: a projection of 7 rows and of 13 rows then round alike, so the conv
    # window (the last W-1 projected inputs) of a chunked run equals the one-shot one exactly;
    # with 2 threads torch splits the matmul differently by row count (1 ulp apart).
    torch.set_num_threads(1)


def _random_inputs(T, H, HV, K, V, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = l2_normalize(torch.randn(T, H, K, generator=g))
    k = l2_normalize(torch.randn(T, H, K, generator=g))
    v = torch.randn(T, HV, V, generator=g)
    gate = -torch.rand(T, HV, K, generator=g) * 2.0
    beta = torch.rand(T, HV, generator=g)
    state = torch.randn(HV, K, V, generator=g)
    return q, k, v, gate, beta, state


class TestGatedDeltaRule(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
        from fla.ops.kda.naive import naive_recurrent_kda

        cls.kda = staticmethod(naive_recurrent_kda)
        cls.gdn = staticmethod(naive_recurrent_gated_delta_rule)

    def test_matches_fla_naive_kda(self):
        for (T, H, HV, K, V) in [(9, 2, 4, 16, 32), (5, 1, 1, 8, 8), (12, 2, 2, 32, 16)]:
            q, k, v, g, beta, S0 = _random_inputs(T, H, HV, K, V, seed=T)
            for scale in (None, 0.3):
                o, S = gated_delta_rule(q, k, v, g, beta, S0, scale=scale)
                o_ref, S_ref = self.kda(
                    q[None], k[None], v[None], g[None], beta[None], scale=scale,
                    initial_state=S0[None].clone(), output_final_state=True,
                )
                torch.testing.assert_close(o, o_ref[0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(S, S_ref[0], atol=1e-5, rtol=1e-5)
                self.assertEqual(S.dtype, torch.float32)

    def test_scalar_gate_matches_fla_gated_delta_rule(self):
        T, H, K, V = 7, 2, 16, 24
        q, k, v, _, beta, S0 = _random_inputs(T, H, H, K, V, seed=3)
        g = -torch.rand(T, H, generator=torch.Generator().manual_seed(4))
        o, S = gated_delta_rule(q, k, v, g, beta, S0)
        o_ref, S_ref = self.gdn(
            q[None], k[None], v[None], beta[None], g[None],
            initial_state=S0[None].clone(), output_final_state=True,
        )
        torch.testing.assert_close(o, o_ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(S, S_ref[0], atol=1e-5, rtol=1e-5)

    def test_zero_state_equals_none_and_input_untouched(self):
        q, k, v, g, beta, S0 = _random_inputs(6, 2, 4, 8, 8, seed=5)
        keep = S0.clone()
        o1, S1 = gated_delta_rule(q, k, v, g, beta, None)
        o2, S2 = gated_delta_rule(q, k, v, g, beta, torch.zeros_like(S0))
        torch.testing.assert_close(o1, o2)
        torch.testing.assert_close(S1, S2)
        gated_delta_rule(q, k, v, g, beta, S0)
        torch.testing.assert_close(S0, keep, rtol=0, atol=0)

    def test_chunked_equals_one_shot(self):
        q, k, v, g, beta, S0 = _random_inputs(11, 2, 4, 16, 32, seed=6)
        o, S = gated_delta_rule(q, k, v, g, beta, S0)
        outs, state = [], S0
        for lo, hi in [(0, 4), (4, 5), (5, 11)]:
            oc, state = gated_delta_rule(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state)
            outs.append(oc)
        torch.testing.assert_close(torch.cat(outs), o, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(state, S, atol=1e-6, rtol=1e-6)

    def test_batched_step_equals_sequences(self):
        # three independent states stepped together == each one alone (draft-tree use)
        ins = [_random_inputs(1, 2, 4, 8, 16, seed=s) for s in (7, 8, 9)]
        stacked = [torch.stack([x[i][0] if i < 5 else x[i] for x in ins]) for i in range(6)]
        o, S = gated_delta_rule_step(*stacked)
        for n, x in enumerate(ins):
            on, Sn = gated_delta_rule(*x)
            torch.testing.assert_close(o[n], on[0], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(S[n], Sn, atol=1e-6, rtol=1e-6)

    def test_bad_shapes_raise(self):
        q, k, v, g, beta, S0 = _random_inputs(4, 2, 4, 8, 8)
        with self.assertRaises(ValueError):
            gated_delta_rule(q, k, v, g, beta, S0.transpose(-1, -2)[:, :4])
        with self.assertRaises(ValueError):
            gated_delta_rule(q, k, v, g[:, :, :3], beta, S0)


class TestGdnGate(unittest.TestCase):
    """``gate="gdn"`` (Gated DeltaNet, Qwen3-Next): one decay per value head from ``a_proj``."""

    def test_mixer_matches_fla_gated_delta_rule(self):
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

        torch.manual_seed(11)
        shape = LinearAttnShape(2, 4, 16, 8, 4)
        m = GatedDeltaRuleMixer(24, shape, gate="gdn")
        with torch.no_grad():
            m.A_log.normal_(0, 0.5)
            m.dt_bias.normal_()
        self.assertEqual((tuple(m.dt_bias.shape), m.gate_dim), ((4,), 4))
        x = torch.randn(9, 24)
        with torch.no_grad():
            mixed, g_raw, b_raw = m.project_raw(x)
            self.assertEqual(tuple(g_raw.shape), (9, 4))
            # the gate written out here, not through the mixer's activate_gates
            g_head = -m.A_log.exp() * F.softplus(x @ m.a_proj.weight.T + m.dt_bias)
            y, _ = m.conv(mixed, None)
            q, k, v = m.split_qkv(y)
            rep = shape.num_v_heads // shape.num_k_heads
            q, k = q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)
            o_ref, S_ref = naive_recurrent_gated_delta_rule(
                q[None], k[None], v[None], torch.sigmoid(b_raw)[None], g_head[None],
                scale=m.scale, output_final_state=True,
            )
            g, beta = m.activate_gates(g_raw, b_raw)
            o, _, S = m.run_segments(mixed, g, beta, None, None)
        torch.testing.assert_close(o, o_ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(S, S_ref[0], atol=1e-5, rtol=1e-5)

    def test_unknown_gate_refused(self):
        with self.assertRaisesRegex(ValueError, "gate must be one of"):
            GatedDeltaRuleMixer(8, LinearAttnShape(1, 1, 4, 4, 2), gate="mamba2")


class TestCausalConv(unittest.TestCase):
    def setUp(self):
        gen = torch.Generator().manual_seed(0)
        self.D, self.W = 12, 4
        self.x = torch.randn(10, self.D, generator=gen)
        self.w = torch.randn(self.D, self.W, generator=gen)
        self.b = torch.randn(self.D, generator=gen)
        self.state = torch.randn(self.D, self.W - 1, generator=gen)

    def test_matches_torch_conv1d(self):
        y, new_state = causal_conv1d_update(self.x, self.state, self.w, self.b)
        u = torch.cat([self.state, self.x.T], dim=1)[None]
        ref = F.silu(F.conv1d(u, self.w[:, None, :], self.b, groups=self.D))[0].T
        torch.testing.assert_close(y, ref, atol=1e-6, rtol=1e-6)
        # window: last W-1 inputs, oldest first
        torch.testing.assert_close(new_state, self.x[-(self.W - 1):].T, rtol=0, atol=0)

    def test_chunked_equals_unchunked(self):
        y, s = causal_conv1d_update(self.x, self.state, self.w, self.b)
        ys, st = [], self.state
        for lo, hi in [(0, 1), (1, 3), (3, 10)]:
            yc, st = causal_conv1d_update(self.x[lo:hi], st, self.w, self.b)
            ys.append(yc)
        torch.testing.assert_close(torch.cat(ys), y, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(st, s, rtol=0, atol=0)

    def test_fresh_state_is_zero_padding(self):
        y, _ = causal_conv1d_update(self.x, None, self.w)
        y0, _ = causal_conv1d_update(self.x, torch.zeros(self.D, self.W - 1), self.w)
        torch.testing.assert_close(y, y0, rtol=0, atol=0)

    def test_batch_dims_and_state_dtype(self):
        xs = self.x.view(2, 5, self.D)
        states = torch.stack([self.state, -self.state]).to(torch.bfloat16)
        y, new = causal_conv1d_update(xs, states, self.w)
        self.assertEqual(new.dtype, torch.bfloat16)
        for n in range(2):
            yn, sn = causal_conv1d_update(xs[n], states[n], self.w)
            torch.testing.assert_close(y[n], yn)
            torch.testing.assert_close(new[n], sn, rtol=0, atol=0)

    def test_bad_state_shape_raises(self):
        with self.assertRaises(ValueError):
            causal_conv1d_update(self.x, self.state.T, self.w)


class TestMixer(unittest.TestCase):
    def setUp(self):
        self.shape, self.mixer = small_mixer()
        self.x = torch.randn(13, 32)

    def test_shape_properties(self):
        s = self.shape
        self.assertEqual(s.conv_dim, 2 * 2 * 8 + 4 * 12)
        self.assertEqual(s.conv_state_shape, (s.conv_dim, 3))
        self.assertEqual(s.temporal_state_shape, (4, 8, 12))
        with self.assertRaises(ValueError):
            LinearAttnShape(num_k_heads=3, num_v_heads=4, head_k_dim=8, head_v_dim=8, conv_kernel=4)

    def test_project_gate_and_beta(self):
        mixed, g, beta = self.mixer.project(self.x)
        self.assertEqual(tuple(mixed.shape), (13, self.shape.conv_dim))
        self.assertEqual(tuple(g.shape), (13, 4, 8))
        self.assertEqual(g.dtype, torch.float32)
        self.assertTrue(bool((g <= 0).all()))
        self.assertTrue(bool(((beta > 0) & (beta < 1)).all()))

    def test_chunked_prefill_with_carried_state_equals_one_shot(self):
        y, conv, ssm = self.mixer(self.x)
        ys, c, s = [], None, None
        for lo, hi in [(0, 5), (5, 6), (6, 13)]:
            yc, c, s = self.mixer(self.x[lo:hi], c, s)
            ys.append(yc)
        torch.testing.assert_close(torch.cat(ys), y, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, conv, atol=0, rtol=0)
        torch.testing.assert_close(s, ssm, atol=1e-5, rtol=1e-5)

    def test_steps_compose_to_forward(self):
        # the step API (used by the SGLang backend and spec verify) == forward
        mixed, g, beta = self.mixer.project(self.x)
        yc, conv = self.mixer.conv(mixed, None)
        q, k, v = self.mixer.split_qkv(yc)
        torch.testing.assert_close(q.norm(dim=-1), torch.ones(13, 2), atol=1e-4, rtol=0)
        o, ssm = self.mixer.recurrence(q, k, v, g, beta, None)
        y, conv2, ssm2 = self.mixer(self.x)
        torch.testing.assert_close(self.mixer.finish(o, self.x), y)
        torch.testing.assert_close(ssm, ssm2)

    def test_run_segments_hands_states_at_cuts(self):
        mixed, g, beta = self.mixer.project(self.x)
        seen = []
        o, conv, ssm = self.mixer.run_segments(
            mixed, g, beta, None, None, cuts=[7, 0, 3, 13, 3],
            on_cut=lambda off, c, s: seen.append((off, None if c is None else c.clone(), None if s is None else s.clone())),
        )
        self.assertEqual([off for off, _, _ in seen], [0, 3, 7, 13])
        self.assertIsNone(seen[0][1])  # a fresh sequence cut at 0: no state yet
        self.assertIsNone(seen[0][2])
        # the state at a cut is the state of a run that stops there (same segments, same ops)
        _, c3, s3 = self.mixer.run_segments(mixed[:3], g[:3], beta[:3], None, None)
        torch.testing.assert_close(seen[1][1], c3, rtol=0, atol=0)
        torch.testing.assert_close(seen[1][2], s3, rtol=0, atol=0)
        _, c7, s7 = self.mixer.run_segments(mixed[:7], g[:7], beta[:7], None, None, cuts=[3])
        torch.testing.assert_close(seen[2][1], c7, rtol=0, atol=0)
        torch.testing.assert_close(seen[2][2], s7, rtol=0, atol=0)
        torch.testing.assert_close(seen[3][1], conv, rtol=0, atol=0)
        torch.testing.assert_close(seen[3][2], ssm, rtol=0, atol=0)
        # and the cut run is the one-pass recurrence to float rounding
        o1, conv1, ssm1 = self.mixer.run_segments(mixed, g, beta, None, None)
        torch.testing.assert_close(o, o1, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(conv, conv1, rtol=0, atol=0)
        torch.testing.assert_close(ssm, ssm1, atol=1e-6, rtol=1e-6)
        self.assertEqual(tuple(o.shape), (13, 4, 12))
        for bad in ([-1], [14]):
            with self.assertRaises(ValueError):
                self.mixer.run_segments(mixed, g, beta, None, None, cuts=bad)


class TestReferenceModel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        build_tiny_model(cls.tmp.name, seed=0)
        cls.model = TinyHybridReference.from_pretrained(cls.tmp.name)
        cls.ids = torch.randint(5, cls.model.config.vocab_size, (23,), generator=torch.Generator().manual_seed(1)).tolist()

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_layout(self):
        cfg = self.model.config
        self.assertEqual(cfg.full_attention_layer_ids, [0, 2])
        self.assertEqual(cfg.linear_layer_ids, [1, 3])
        self.assertNotEqual(cfg.linear_key_head_dim, cfg.linear_value_head_dim)

    def test_prefill_then_decode_equals_full_prefill(self):
        full, _ = self.model.prefill(self.ids)
        logits, cache = self.model.prefill(self.ids[:15])
        torch.testing.assert_close(logits, full[:15], atol=1e-4, rtol=1e-4)
        for t in range(15, len(self.ids)):
            step, cache = self.model.decode_step(self.ids[t], cache)
            torch.testing.assert_close(step, full[t], atol=1e-4, rtol=1e-4)
        self.assertEqual(cache.seq_len, len(self.ids))
        self.assertEqual(tuple(cache.kv[0][0].shape), (len(self.ids), 2, 16))
        self.assertEqual(tuple(cache.temporal[1].shape), (4, 16, 32))
        self.assertEqual(tuple(cache.conv[3].shape), (self.model.config.linear_attn_shape.conv_dim, 3))

    def test_chunked_prefill_from_cache_equals_full(self):
        full, full_cache = self.model.prefill(self.ids)
        _, c1 = self.model.prefill(self.ids[:7])
        snapshot = c1.clone()
        l2, c2 = self.model.prefill(self.ids[7:], c1)
        torch.testing.assert_close(l2, full[7:], atol=1e-4, rtol=1e-4)
        for i in (1, 3):
            torch.testing.assert_close(c2.temporal[i], full_cache.temporal[i], atol=1e-5, rtol=1e-5)
        # the input cache is not modified
        torch.testing.assert_close(c1.temporal[1], snapshot.temporal[1], rtol=0, atol=0)
        self.assertEqual(c1.seq_len, 7)

    def test_tree_mask_building_blocks(self):
        # causal attention through the public blocks == FullAttention.forward
        layer = self.model.layers[0]
        h = self.model.embed(torch.tensor(self.ids[:6]))
        x = layer.input_layernorm(h)
        pos = torch.arange(6)
        q, k, v = layer.self_attn.project_qkv(x, pos)
        o = attention(q, k, v, causal_mask(6, 0))
        y_ref, _, _ = layer.self_attn(x, pos)
        torch.testing.assert_close(layer.self_attn.finish(o), y_ref)
        # RoPE is a rotation: norms are kept, position 0 is the identity
        r = apply_rope(q, pos, 10000.0)
        torch.testing.assert_close(r.norm(dim=-1), q.norm(dim=-1), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r[0], q[0])

    def test_greedy_generation_not_degenerate(self):
        for seed in (2, 3, 4):
            prompt = torch.randint(5, 700, (8,), generator=torch.Generator().manual_seed(seed)).tolist()
            out = self.model.generate_greedy(prompt, 32)
            self.assertEqual(len(out), 32)
            self.assertGreaterEqual(len(set(out)), 12, f"greedy output too repetitive: {out}")
        a = self.model.generate_greedy(self.ids[:8], 16)
        b = self.model.generate_greedy(self.ids[8:16], 16)
        self.assertNotEqual(a, b)

    def test_generation_from_cache_equals_from_scratch(self):
        _, cache = self.model.prefill(self.ids[:10])
        self.assertEqual(
            self.model.generate_greedy(self.ids[10:], 12, cache=cache),
            self.model.generate_greedy(self.ids, 12),
        )

    def test_missing_files_raise(self):
        with tempfile.TemporaryDirectory() as d:
            with self.assertRaises(FileNotFoundError):
                TinyHybridReference.from_pretrained(d)


if __name__ == "__main__":
    unittest.main()


class TestSaveStatesInsideChunk(unittest.TestCase):
    """Issue 6, forward side: a checkpoint requested at position p inside a prefill chunk
    holds the state of an unchunked prefill of the first p tokens."""

    def test_saved_state_equals_prefix_prefill(self):
        import tempfile

        from sglang_mamba_ext.models.tiny_builder import build_tiny_model
        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference

        with tempfile.TemporaryDirectory() as d:
            model = TinyHybridReference.from_pretrained(build_tiny_model(d, seed=3))
        ids = list(range(5, 45))
        _, head = model.prefill(ids[:10])
        logits_plain, full = model.forward_tokens(ids[10:], head)
        logits, full2, saved = model.forward_tokens(ids[10:], head, save_states_at=[17, 33, 40])
        torch.testing.assert_close(logits, logits_plain, rtol=0, atol=1e-5)
        self.assertEqual(sorted(saved), [17, 33, 40])
        for p in (17, 33):
            _, ref = model.prefill(ids[:p])
            for i in model.config.linear_layer_ids:
                torch.testing.assert_close(saved[p].temporal[i], ref.temporal[i], rtol=0, atol=1e-5)
                torch.testing.assert_close(saved[p].conv[i], ref.conv[i], rtol=0, atol=1e-5)
        for i in model.config.linear_layer_ids:
            torch.testing.assert_close(saved[40].temporal[i], full.temporal[i], rtol=0, atol=1e-6)
        with self.assertRaises(ValueError):
            model.forward_tokens(ids[10:], head, save_states_at=[5])
