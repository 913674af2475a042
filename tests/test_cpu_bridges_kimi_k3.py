"""plugin/cpu_bridges_kimi_k3.py: Kimi-K3's text class on CPU (issue 40). Its served check is
``tests/e2e/test_sglang_families_serving.py::TestKimiK3Serving``."""

import importlib.util
import os
import unittest
from unittest import mock

import torch

from sglang_mamba_ext.plugin import cpu_bridges, cpu_bridges_kimi_k3

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None


class TestK3SideStreams(unittest.TestCase):
    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_gap_present_upstream(self):
        """SGLang still builds three CUDA streams in ``KimiK3LinearModel.__init__`` on anything
        but ROCm; on this CUDA build of torch without a driver that raises."""
        spec = importlib.util.find_spec("sglang.srt.models")  # a namespace package: no origin
        path = os.path.join(list(spec.submodule_search_locations)[0], "kimi_k3.py")
        with open(path, encoding="utf-8") as f:
            self.assertIn("None if _is_hip else [torch.cuda.Stream() for _ in range(3)]", f.read())
        if not torch.cuda.is_available():
            with self.assertRaises(Exception):
                torch.cuda.Stream()

    def test_no_streams_inside_restored_after(self):
        original = torch.cuda.Stream
        with cpu_bridges_kimi_k3.no_cuda_streams():
            self.assertEqual([torch.cuda.Stream() for _ in range(3)], [None, None, None])
        self.assertIs(torch.cuda.Stream, original)

    def test_hook_inert_unless_active(self):
        seen = []

        def init(*args, **kwargs):
            seen.append(torch.cuda.Stream)
            return "built"

        original = torch.cuda.Stream
        with mock.patch.object(cpu_bridges, "active", return_value=False):
            self.assertEqual(cpu_bridges_kimi_k3.k3_model_init_around(init), "built")
        self.assertIs(seen[-1], original)
        with mock.patch.object(cpu_bridges, "active", return_value=True):
            self.assertEqual(cpu_bridges_kimi_k3.k3_model_init_around(init), "built")
        self.assertIsNot(seen[-1], original)
        self.assertIs(torch.cuda.Stream, original)


class TestAttnResidualMixture(unittest.TestCase):
    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_gap_present_upstream(self):
        """SGLang's Triton mixture tiles the width by 1024 with ``H // _BLOCK_H`` column blocks:
        none for the tiny width 64 (its output would stay ``torch.empty_like``'s)."""
        from sglang.srt.layers import attn_residual

        self.assertEqual(attn_residual._BLOCK_H, 1024)
        self.assertEqual(64 // attn_residual._BLOCK_H, 0)

    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_cpu_mixture_is_the_softmax_over_normed_scores(self):
        gen = torch.Generator().manual_seed(0)
        T, NB, H, nvb = 3, 4, 64, 2
        prefix = torch.randn(T, H, generator=gen)
        bank = torch.randn(T, NB, H, generator=gen)
        w = torch.randn(H, generator=gen)
        norm_w = 1.0 + 0.1 * torch.randn(H, generator=gen)

        def score_norm(x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w

        def score_proj(x):
            return (x @ w[:, None], None)

        def kernel(*args, **kwargs):
            raise AssertionError("SGLang's kernel must not run for a CPU tensor")

        with mock.patch.object(cpu_bridges, "active", return_value=True):
            got = cpu_bridges_kimi_k3.mix_fused_around(kernel, prefix, bank, nvb, score_proj, score_norm)
        rows = torch.cat([bank[:, :nvb], prefix[:, None]], dim=1)  # [T, nvb + 1, H]
        p = torch.softmax(score_norm(rows) @ w, dim=-1)  # [T, nvb + 1]
        torch.testing.assert_close(got, (p[..., None] * rows).sum(1))
        with mock.patch.object(cpu_bridges, "active", return_value=False):
            self.assertEqual(cpu_bridges_kimi_k3.mix_fused_around(lambda *a: "sglang", prefix, bank, nvb,
                                                                   score_proj, score_norm), "sglang")


if __name__ == "__main__":
    unittest.main()
