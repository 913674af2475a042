"""sglang_mamba_ext.benchmarks.spec_memory (scripts/plan_spec_memory.py): formula == constructed buffers, headline targets, SGLang's sizing."""

import contextlib
import io
import unittest

import torch

from sglang_mamba_ext.speculative.reference.sizing import MODELS, VARIANTS, spec_memory_formula, spec_memory_measured


class TestPlanner(unittest.TestCase):
    def test_formula_matches_constructed_buffers(self):
        for m in MODELS.values():
            for kw in (dict(topk=1, steps=3, draft_token_num=4, max_running=8, dtype=torch.bfloat16),
                       dict(topk=2, steps=2, draft_token_num=7, max_running=3, dtype=torch.bfloat16, ssm_dtype=torch.float32)):
                f, c = spec_memory_formula(m, **kw), spec_memory_measured(m, **kw)
                self.assertEqual(f.snapshot, c.snapshot, m.name)
                self.assertEqual(f.stash, c.stash, m.name)
                for v in VARIANTS:
                    self.assertEqual(f.deferred_peak(v), c.deferred_peak(v), (m.name, v))

    def test_script_last_line_meets_targets(self):
        from sglang_mamba_ext.benchmarks import spec_memory as plan_spec_memory

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = plan_spec_memory.main([])
        self.assertEqual(rc, 0)
        last = out.getvalue().strip().splitlines()[-1]
        parts = dict(p.split("=") for p in last.split())
        self.assertEqual(set(parts), {"peak_reduction", "resident_reduction"})
        self.assertGreaterEqual(float(parts["resident_reduction"]), 500.0)
        self.assertGreaterEqual(float(parts["peak_reduction"]), MODELS["Kimi-Linear-48B-A3B"].num_linear_layers)

    def test_snapshot_matches_sglang_pool_sizing(self):
        """Our snapshot formula uses the per-slot shapes SGLang's KimiLinearStateShape gives
        (``configs/mamba_utils.py``) for the intermediate buffers of ``memory_pool.py``."""
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            self.skipTest("SGLang is not installed")
        from sglang.srt.configs.mamba_utils import KimiLinearStateShape  # a broken SGLang fails here
        shp = KimiLinearStateShape.create(tp_world_size=1, num_heads=32, head_dim=128, conv_kernel_size=4)
        ssm_numel = 1
        for d in shp.temporal:
            ssm_numel *= d
        conv_numel = sum(a * b for a, b in shp.conv)
        L, N, T = 20, 32, 63
        sglang_bytes = L * (N + 1) * T * (ssm_numel * 2 + conv_numel * 2)
        f = spec_memory_formula(MODELS["Kimi-Linear-48B-A3B"], 4, 3, T, N, torch.bfloat16)
        self.assertEqual(f.snapshot, sglang_bytes)


if __name__ == "__main__":
    unittest.main()
