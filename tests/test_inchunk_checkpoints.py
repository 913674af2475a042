"""In-chunk checkpoint writer (``speculative/ops/inchunk``): the Triton kernels (CPU: Triton's
interpreter) against the torch reference and against fla's naive recurrences, for KDA (decay
per key channel) and Gated DeltaNet (decay per value head)."""

import unittest

import pytest

import torch
import torch.nn.functional as F

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape
from sglang_mamba_ext.speculative.ops.inchunk import plan_writes, write_checkpoints
from sglang_mamba_ext.speculative.replay import ReplayWeights
from sglang_mamba_ext.testing.spec_pair import load_kernel_modules_for_cpu, triton_subprocess_case


_FUSED = "sglang_mamba_ext.speculative.ops.inchunk.fused"
#: The replay kernels (and Triton) interpreted on CPU, then this op's kernels too.
_CAN_RUN = load_kernel_modules_for_cpu([_FUSED], [(_FUSED, "_inchunk_recurrent_kernel")])
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = LinearAttnShape(2, 4, 8, 8, 4)  # H, HV, K, V, W


def _mixers(L, gate, seed=0):
    torch.manual_seed(seed)
    ms = [GatedDeltaRuleMixer(16, SHAPE, conv_bias=True, gate=gate) for _ in range(L)]
    with torch.no_grad():
        for m in ms:
            m.A_log.normal_(0, 0.5)
            m.dt_bias.normal_()
            m.conv_bias.normal_()
    return [m.to(DEV) for m in ms]


def _inputs(L, T, gate, seed=1):
    g = torch.Generator().manual_seed(seed)
    D = SHAPE.conv_dim
    GD = SHAPE.num_v_heads * (1 if gate == "gdn" else SHAPE.head_k_dim)
    mixed = torch.randn(L, T, D, generator=g)
    g_raw = torch.randn(L, T, GD, generator=g)
    b_raw = torch.randn(L, T, SHAPE.num_v_heads, generator=g)
    return mixed.to(DEV), g_raw.to(DEV), b_raw.to(DEV)


def _pools(L, slots, seed=2, transposed=False):
    """conv [L, slots, D, W-1] and temporal [L, slots, HV, K, V]; ``transposed``: views of
    SGLang KDA's [W-1, D] / [HV, V, K] storage."""
    g = torch.Generator().manual_seed(seed)
    s = SHAPE
    if transposed:
        conv = torch.randn(L, slots, s.conv_kernel - 1, s.conv_dim, generator=g).to(DEV).transpose(-1, -2)
        temp = torch.randn(L, slots, s.num_v_heads, s.head_v_dim, s.head_k_dim, generator=g).to(DEV).transpose(-1, -2)
    else:
        conv = torch.randn(L, slots, s.conv_dim, s.conv_kernel - 1, generator=g).to(DEV)
        temp = torch.randn(L, slots, s.num_v_heads, s.head_k_dim, s.head_v_dim, generator=g).to(DEV)
    return conv, temp


@unittest.skipUnless(_CAN_RUN, "kernels already imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestInchunkTriton(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.testing.spec_pair import triton_interpreter_env

        cls.enterClassContext(triton_interpreter_env())

    def _both(self, gate, transposed):
        # one layer (the interpreter's cost is per program): two layers, both gates and the
        # transposed views run through the same kernels in test_chunk_boundaries_match_reference
        L, T = 1, 12
        w = ReplayWeights.from_mixers(_mixers(L, gate))
        mixed, g_raw, b_raw = _inputs(L, T, gate)
        # row 0: tokens 0..5 from slot 1, checkpoints inside (3) and at its end (6); row 1:
        # tokens 6..10 fresh (zeros), offsets 0, 2 (inside the conv window) and 5
        writes = plan_writes([(0, 1, [(3, 3), (6, 4)]), (6, -1, [(2, 5), (0, 6), (5, 7)])], DEV)
        out = {}
        for impl in ("torch", "triton"):
            conv, temp = _pools(L, 9, transposed=transposed)
            write_checkpoints(mixed, g_raw, b_raw, writes, conv, temp, w, impl=impl)
            out[impl] = (conv.clone(), temp.clone())
        ref_conv, ref_temp = _pools(L, 9, transposed=transposed)
        for impl in out:  # untouched slots stay as they were (source included)
            for s in (0, 1, 2, 8):
                torch.testing.assert_close(out[impl][0][:, s], ref_conv[:, s], rtol=0, atol=0)
                torch.testing.assert_close(out[impl][1][:, s], ref_temp[:, s], rtol=0, atol=0)
        torch.testing.assert_close(out["triton"][0], out["torch"][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out["triton"][1], out["torch"][1], atol=1e-4, rtol=1e-4)
        # the offset-0 destination of a fresh row is zeros; a window two tokens in holds them
        self.assertEqual(out["triton"][1][:, 6].abs().max().item(), 0.0)
        torch.testing.assert_close(out["triton"][0][:, 5, :, 1:], mixed[:, 6:8].transpose(-1, -2))
        self.assertEqual(out["triton"][0][:, 5, :, 0].abs().max().item(), 0.0)

    def test_kda_matches_torch(self):
        self._both("kda", transposed=False)

    def test_gdn_matches_torch(self):
        self._both("gdn", transposed=False)

    def test_transposed_pool_views(self):
        self._both("kda", transposed=True)  # the views' strides; the gate is the other tests'

    def test_chunk_boundaries_match_reference(self):
        """Issue 39: the boundary kernel (``tl.dot``) and the per-checkpoint partial scan, over
        several 16-token chunks, against the token scan from the extend start."""
        for gate in ("kda", "gdn"):
            L, T = 2, 90
            w = ReplayWeights.from_mixers(_mixers(L, gate))
            mixed, g_raw, b_raw = _inputs(L, T, gate)
            # offsets 2 (inside the first chunk), 47 (two chunks, then 15 tokens: just before a
            # boundary), 32 (on one) | 33 (just after one), 0
            writes = plan_writes([(0, 1, [(2, 3), (47, 4), (32, 8)]), (50, -1, [(33, 5), (0, 6)])], DEV)
            out = {}
            for impl in ("reference", "triton"):
                conv, temp = _pools(L, 10, transposed=True)
                st = {}
                write_checkpoints(mixed, g_raw, b_raw, writes, conv, temp, w, impl=impl, chunk=16, stats=st)
                out[impl] = (conv, temp)
            self.assertEqual(st["scanned"], [2, 15, 0, 1, 0])
            torch.testing.assert_close(out["triton"][0], out["reference"][0], rtol=0, atol=0)
            torch.testing.assert_close(out["triton"][1], out["reference"][1], atol=1e-5, rtol=1e-5)

    def test_padding_destinations_write_nothing(self):
        from sglang_mamba_ext.speculative.ops.inchunk import CheckpointWrites

        w = ReplayWeights.from_mixers(_mixers(1, "kda"))
        mixed, g_raw, b_raw = _inputs(1, 6, "kda")
        conv, temp = _pools(1, 4)
        ref = (conv.clone(), temp.clone())
        i64 = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)  # noqa: E731
        # a valid offset with no destination, and a destination with a padding offset
        writes = CheckpointWrites(i64([0]), i64([1]), i64([[4, -1]]), i64([[-1, 2]]))
        write_checkpoints(mixed, g_raw, b_raw, writes, conv, temp, w)
        torch.testing.assert_close(conv, ref[0], rtol=0, atol=0)
        torch.testing.assert_close(temp, ref[1], rtol=0, atol=0)

    def _against_fla(self, gate):
        """Independent of the mixer: explicit conv, SiLU, L2 norm, gate activation, then fla's
        naive recurrence from the start state, for the first ``p`` tokens."""
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule
        from fla.ops.kda.naive import naive_recurrent_kda

        L, T, s = 1, 8, SHAPE
        (m,) = _mixers(L, gate, seed=5)
        w = ReplayWeights.from_mixers([m])
        mixed, g_raw, b_raw = _inputs(L, T, gate, seed=6)
        conv, temp = _pools(L, 6, seed=7)
        points = [(1, 2), (4, 3), (7, 4), (8, 5)]
        write_checkpoints(mixed, g_raw, b_raw, plan_writes([(0, 1, points)], DEV), conv, temp, w)
        H, HV, K, V, W = s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim, s.conv_kernel
        x = torch.cat([conv[0, 1].T, mixed[0]]).double()  # [W-1+T, D]: start window, tokens
        cw = w.conv_weight[0].double()
        y = torch.stack([(x[t:t + W].T * cw).sum(-1) for t in range(T)]) + w.conv_bias[0].double()
        y = F.silu(y).float()
        q, k, v = torch.split(y, [H * K, H * K, HV * V], dim=-1)
        k = F.normalize(k.unflatten(-1, (H, K)), dim=-1, eps=1e-6).repeat_interleave(HV // H, dim=1)
        q = torch.zeros_like(k)
        v = v.unflatten(-1, (HV, V))
        f = g_raw[0].float() + w.dt_bias[0].float()
        beta = torch.sigmoid(b_raw[0].float())
        for p, slot in points:
            if gate == "kda":
                g = -w.A_log[0].float().exp()[:, None] * F.softplus(f.unflatten(-1, (HV, K)))
                _, S = naive_recurrent_kda(q[None, :p], k[None, :p], v[None, :p], g[None, :p], beta[None, :p],
                                           initial_state=temp[0, 1][None].clone(), output_final_state=True)
            else:
                g = -w.A_log[0].float().exp() * F.softplus(f)
                _, S = naive_recurrent_gated_delta_rule(q[None, :p], k[None, :p], v[None, :p], beta[None, :p],
                                                        g[None, :p], initial_state=temp[0, 1][None].clone(),
                                                        output_final_state=True)
            torch.testing.assert_close(temp[0, slot], S[0].float(), atol=2e-4, rtol=2e-4)
            torch.testing.assert_close(conv[0, slot], x[p:p + W - 1].T.float(), rtol=0, atol=0)

    def test_kda_matches_fla_naive(self):
        self._against_fla("kda")

    def test_gdn_matches_fla_naive(self):
        self._against_fla("gdn")


class TestChunkedWriter(unittest.TestCase):
    """Issue 39: the torch writer starts each checkpoint from the chunk boundary below it (the
    boundary states from the chunked WY pass) and steps at most ``chunk - 1`` tokens; its
    states equal the old token scan's (``impl="reference"``)."""

    def _case(self, gate, chunk, strong=False):
        L, T = 2, 200
        ms = _mixers(L, gate)
        if strong:  # decays strong enough that e^γ of a chunk would be subnormal
            with torch.no_grad():
                for m in ms:
                    m.A_log.add_(2.0)
        w = ReplayWeights.from_mixers(ms)
        mixed, g_raw, b_raw = _inputs(L, T, gate)
        # row 0 from slot 1: offsets inside the first chunk, on a boundary, deep; row 1 fresh
        writes = plan_writes([(0, 1, [(5, 3), (131, 4), (2 * chunk, 8)]),
                              (110, -1, [(2, 5), (0, 6), (89, 7)])], DEV)
        out, stats = {}, {}
        for impl in ("reference", "torch"):
            conv, temp = _pools(L, 10)
            stats[impl] = {}
            write_checkpoints(mixed, g_raw, b_raw, writes, conv, temp, w, impl=impl, chunk=chunk, stats=stats[impl])
            out[impl] = (conv, temp)
        torch.testing.assert_close(out["torch"][0], out["reference"][0], rtol=0, atol=0)
        torch.testing.assert_close(out["torch"][1], out["reference"][1], atol=2e-5, rtol=2e-5)
        return stats["torch"]

    def test_scanned_tokens_at_most_the_chunk(self):
        st = self._case("kda", 16)
        # offsets 5, 131, 32 | 2, 0, 89 -> 5, 131-128, 0 | 2, 0, 89-80 tokens after their boundary
        self.assertEqual(st["scanned"], [5, 3, 0, 2, 0, 9])
        self.assertEqual(st["chunks"], 8)  # row 0's deepest boundary: 128 = 8 chunks
        self.assertTrue(all(n <= 15 for n in st["scanned"]))
        st = self._case("gdn", 64)
        self.assertEqual(st["scanned"], [5, 3, 0, 2, 0, 25])
        self.assertEqual(st["chunks"], 2)

    def test_strong_decay_matches_reference(self):
        self._case("kda", 32, strong=True)
        self._case("gdn", 32, strong=True)

    def test_triton_chunk_must_suit_tl_dot(self):
        w = ReplayWeights.from_mixers(_mixers(1, "kda"))
        mixed, g_raw, b_raw = _inputs(1, 8, "kda")
        conv, temp = _pools(1, 4)
        with self.assertRaisesRegex(ValueError, "power of two >= 16, not 24"):
            write_checkpoints(mixed, g_raw, b_raw, plan_writes([(0, 1, [(5, 2)])], DEV), conv, temp, w, chunk=24)


class TestInchunkChecks(unittest.TestCase):
    def test_bad_inputs_raise(self):
        w = ReplayWeights.from_mixers(_mixers(1, "kda"))
        mixed, g_raw, b_raw = _inputs(1, 8, "kda")
        conv, temp = _pools(1, 4)
        with self.assertRaisesRegex(ValueError, "past the 8 input tokens"):
            write_checkpoints(mixed, g_raw, b_raw, plan_writes([(4, 1, [(5, 2)])], DEV), conv, temp, w)
        with self.assertRaisesRegex(ValueError, "g_raw width 4 != 32"):
            write_checkpoints(mixed, g_raw[..., :4].contiguous(), b_raw, plan_writes([(0, 1, [(5, 2)])], DEV),
                              conv, temp, w)
        with self.assertRaisesRegex(ValueError, "unknown impl"):
            write_checkpoints(mixed, g_raw, b_raw, plan_writes([(0, 1, [(5, 2)])], DEV), conv, temp, w, impl="x")


# the class name only: "Inchunk" alone also matched this file's name (-k), re-running its GPU check
TestUnderTritonInterpreter = triton_subprocess_case(__file__, "TestInchunkTriton", skip=_CAN_RUN)


if __name__ == "__main__":
    unittest.main()


@pytest.mark.slow  # the Triton interpreter on 2 cores: ~2 min
class TestGpuCheckTinyMode(unittest.TestCase):
    """``scripts/gpu_check.sh``'s in-chunk section in its CPU mode (``--tiny``, interpreted)."""

    def test_tiny_mode_runs(self):
        from sglang_mamba_ext.testing.spec_pair import run_interpreted

        r = run_interpreted("sglang_mamba_ext.speculative.ops.inchunk.gpu_check", ["--tiny"], timeout=900)
        self.assertEqual(r.returncode, 0, (r.stdout + r.stderr)[-3000:])
        self.assertIn("correctness OK", r.stdout)
        self.assertRegex(r.stdout.strip().splitlines()[-1], r"^inchunk_cost_ratio=\d+\.\d{4}$")
