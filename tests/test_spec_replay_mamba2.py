"""Deferred verify for Mamba2 targets (issue 41, item 3): the Mamba2 replay
(``speculative/ops/replay/mamba2.py``) and the ``mamba2`` layout of ``DeferredSpecState``.

The round is driven as the serving glue drives it (capture every tree node's raw ``xBC`` and
``dt``, commit the accepted nodes, replay into the pool) and the main state must then equal a
Mamba2 scan over the accepted tokens written here independently (conv over the whole window,
then the selective state update per token); the track slot must hold the state at the
``mamba_track_interval`` crossing. The Triton kernel (CPU: Triton's interpreter) must equal the
torch reference, also through SGLang-like strided views and in float16.
"""

import unittest

import torch
import torch.nn.functional as F

from sglang_mamba_ext.models.linear_attn import LinearAttnShape
from sglang_mamba_ext.speculative.deferred import LAYOUTS, DeferredSpecState
from sglang_mamba_ext.speculative.stash import StashDims
from sglang_mamba_ext.testing.spec_pair import load_kernel_modules_for_cpu, triton_subprocess_case

HV, P, N, G, W = 4, 8, 16, 2, 4
D = HV * P + 2 * G * N
L, R, T = 2, 5, 4          # linear layers, request rows, draft tokens per row (chain)
SLOTS = 9

_OPS = "sglang_mamba_ext.speculative.ops.replay."
_CAN_RUN = load_kernel_modules_for_cpu([_OPS + "fused", _OPS + "mamba2"],
                                       [(_OPS + "mamba2", "_replay_mamba2_kernel"),
                                        (_OPS + "fused", "_replay_conv_window_kernel")])


def _weights(seed=0, bias=True):
    from sglang_mamba_ext.speculative.ops.inchunk.gpu_check_mamba2 import random_mamba2_weights

    return random_mamba2_weights(L, HV, P, N, G, W, seed=seed, bias=bias)


def _state(w, act_dtype=torch.float32, ssm_dtype=torch.float32):
    st = DeferredSpecState(
        num_layers=L, num_rows=R, draft_token_num=T, max_accept=T, shape=LinearAttnShape(G, HV, N, P, W),
        dims=StashDims(D, HV, 0), ssm_state_shape=(HV, P, N), conv_state_shape=(D, W - 1),
        ssm_dtype=ssm_dtype, conv_dtype=act_dtype, act_dtype=act_dtype, device="cpu", layout=LAYOUTS["mamba2"],
    )
    for l in range(L):
        st.register_layer(l, w.conv_weight[l], None if w.conv_bias is None else w.conv_bias[l], w.A[l], w.dt_bias[l])
    return st


def _scan(w, l, conv0, h0, xbc, dt_raw):
    """States after each of ``xbc [n, D]``'s tokens from window ``conv0 [D, W-1]`` and state
    ``h0 [HV, P, N]`` (fp32): the whole window convolved at once, then the recurrence."""
    seq = torch.cat([conv0.float(), xbc.float().t()], dim=1)
    bias = None if w.conv_bias is None else w.conv_bias[l].float()
    y = F.silu(F.conv1d(seq[None], w.conv_weight[l].float()[:, None, :], bias, groups=D)[0]).to(xbc.dtype).float().t()
    x, B = y[:, :HV * P].view(-1, HV, P), y[:, HV * P:HV * P + G * N].view(-1, G, N)
    dt = F.softplus(dt_raw.float() + w.dt_bias[l].float())
    h, out = h0.float().clone(), []
    for t in range(y.shape[0]):
        h = torch.exp(dt[t] * w.A[l])[:, None, None] * h + torch.einsum(
            "hp,hn->hpn", dt[t, :, None] * x[t], B[t].repeat_interleave(HV // G, 0))
        out.append(h)
    return out, seq


def _round(st, dtype, seed=3):
    """One verify round of 4 chains: the nodes' raw inputs, captured per layer; accept 4, 2, 1
    and 3 tokens (row 4 is padding). Returns the inputs, rows, accepted lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.tensor([1, 2, 3, 4])
    xbc = torch.randn(L, 4 * T, D, generator=g).to(dtype)
    dt = torch.randn(L, 4 * T, HV, generator=g).to(dtype)
    for l in range(L):
        st.capture(l, xbc[l], dt[l], None)
    lens = torch.tensor([4, 2, 1, 3])
    accept = torch.full((4, T), -1)
    for i, n in enumerate(lens.tolist()):
        accept[i, :n] = torch.arange(n) + i * T
    # seq_lens 13, 6, 7, 20: with interval 8 row 0 (13 + 4 = 17) crosses after token 2, row 2
    # (7 + 1) after token 0, row 3 (20 + 3 = 23) never; row 1 has no track slot
    st.commit(rows, accept, lens, torch.tensor([13, 6, 7, 20]), track_slots=torch.tensor([7, -1, 8, 6]),
              mamba_track_interval=8)
    return xbc, dt, rows, lens


class _ReplayCase:
    impl = "torch"

    def _run(self, act_dtype=torch.float32, ssm_dtype=torch.float32, strided=False, bias=True, keep=None):
        w = _weights(bias=bias)
        st = _state(w, act_dtype, ssm_dtype)
        g = torch.Generator().manual_seed(1)
        conv0 = torch.randn(L, SLOTS, D, W - 1, generator=g).to(act_dtype)
        ssm0 = torch.randn(L, SLOTS, HV, P, N, generator=g).to(ssm_dtype)
        if strided:  # SGLang-like storage seen through views: windows [W-1, D], states [HV, N, P]
            conv = conv0.transpose(-1, -2).contiguous().transpose(-1, -2)
            ssm = ssm0.transpose(-1, -2).contiguous().transpose(-1, -2)
        else:
            conv, ssm = conv0.clone(), ssm0.clone()
        xbc, dt, rows, lens = _round(st, act_dtype)
        slots = torch.tensor([2, 3, -1, 5])  # row 3's request holds no slot: skipped
        tracked = st.replay_pool(rows, slots, conv, ssm, keep=keep, impl=self.impl)
        counts = lens if keep is None else torch.minimum(lens, keep)
        self.assertEqual(st.stash.count[rows].tolist(), [0, 0, 0, 0])
        want_tracked = [keep is None, False, False, False]  # row 2 (slot -1) is skipped
        self.assertEqual(tracked.tolist(), want_tracked)
        tol = dict(rtol=1e-5, atol=1e-5) if act_dtype == torch.float32 and ssm_dtype == torch.float32 else \
            dict(rtol=2e-2, atol=2e-2)
        touched = set()
        for i, s in enumerate(slots.tolist()):
            if s < 0:
                continue
            c = int(counts[i])
            for l in range(L):
                xs = xbc[l, i * T:i * T + c]
                states, seq = _scan(w, l, conv0[l, s], ssm0[l, s], xs, dt[l, i * T:i * T + c])
                torch.testing.assert_close(ssm[l, s].float(), states[c - 1], **tol)
                torch.testing.assert_close(conv[l, s].float(), seq[:, c:c + W - 1], **tol)
                if i == 0 and keep is None:  # crossing after token 2 -> track slot 7
                    torch.testing.assert_close(ssm[l, 7].float(), states[2], **tol)
                    torch.testing.assert_close(conv[l, 7].float(), seq[:, 3:3 + W - 1], **tol)
            touched.add(s)
        if keep is None:
            touched.add(7)
        for s in set(range(SLOTS)) - touched:  # every other slot untouched
            torch.testing.assert_close(ssm[:, s], ssm0[:, s], rtol=0, atol=0)
            torch.testing.assert_close(conv[:, s], conv0[:, s], rtol=0, atol=0)


class TestMamba2ReplayTorch(_ReplayCase, unittest.TestCase):
    def test_matches_independent_scan_and_tracks(self):
        self._run()

    def test_keep_cuts_the_run(self):
        # row 0 keeps 2 of its 4 tokens: no crossing any more (13 + 2 = 15)
        self._run(keep=torch.tensor([2, 9, 9, 9]))

    def test_layout_and_weights(self):
        from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import Mamba2Weights

        st = _state(_weights())
        w = st.weights()
        self.assertIsInstance(w, Mamba2Weights)
        self.assertEqual((w.n_groups, w.head_dim, w.d_state, w.conv_dim, w.conv_kernel), (G, P, N, D, W))
        self.assertEqual(tuple(st.one_layer_ssm.shape), (R, T, HV, P, N))

    def test_shape_mismatch_raises(self):
        from sglang_mamba_ext.speculative.replay import replay

        st = _state(_weights())
        _round(st, torch.float32)
        bad = torch.zeros(L, SLOTS, HV, N, P)  # state axes swapped
        with self.assertRaisesRegex(ValueError, "Mamba2"):
            replay(st.stash, torch.tensor([1]), torch.tensor([2]), torch.zeros(L, SLOTS, D, W - 1), bad,
                   st.weights(), impl="torch")


@unittest.skipUnless(_CAN_RUN, "kernels already imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestMamba2ReplayTriton(_ReplayCase, unittest.TestCase):
    impl = "triton"

    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.testing.spec_pair import triton_interpreter_env

        cls.enterClassContext(triton_interpreter_env())

    def test_fp32(self):
        self._run()

    def test_sglang_strided_views_without_bias(self):
        self._run(strided=True, bias=False)

    def test_fp16_activations_and_state(self):
        self._run(torch.float16, torch.float16)

    def test_keep(self):
        self._run(keep=torch.tensor([2, 9, 9, 9]))


TestUnderTritonInterpreter = triton_subprocess_case(__file__, "Mamba2ReplayTriton", skip=_CAN_RUN)


if __name__ == "__main__":
    unittest.main()
