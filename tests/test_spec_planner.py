"""Memory planning of the speculative buffers: the reference formulas == this project's constructed
buffers (speculative/reference/sizing.py), and scripts/plan_spec_memory.py
(sglang_mamba_ext.benchmarks.spec_memory): SGLang-built pools, headline targets."""

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
        """The last line comes from the pools SGLang built for Kimi-Linear-48B-A3B (the on_chip
        verify variant the glue's rule chooses: no node-state SSM buffer; per request row),
        checked against the published shapes; the forced one_layer variant is printed beside it."""
        import importlib.util

        if importlib.util.find_spec("sglang") is None:
            self.skipTest("SGLang is not installed")
        from sglang_mamba_ext.benchmarks import spec_memory as plan_spec_memory

        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = plan_spec_memory.main(["--models", "Kimi-Linear-48B-A3B"])
        self.assertEqual(rc, 0)
        lines = out.getvalue().strip().splitlines()
        parts = dict(p.split("=") for p in lines[-1].split())
        self.assertEqual(set(parts), {"peak_reduction", "resident_reduction", "capacity_ratio"})
        self.assertIn("deferred verify variant on_chip", lines[-2])
        m = MODELS["Kimi-Linear-48B-A3B"]
        s, L, T, A = m.shape, m.num_linear_layers, 63, 4
        ssm, conv = s.num_v_heads * s.head_k_dim * s.head_v_dim * 2, s.conv_dim * (s.conv_kernel - 1) * 2
        per_tok = (m.stash_dims.conv_dim + m.stash_dims.gate_dim + m.stash_dims.beta_dim) * 2
        snap_row = L * T * (ssm + conv)
        stash_row = L * A * per_tok + 20
        peak_row = stash_row + L * T * per_tok + T * conv  # pending + one layer's conv windows (on chip)
        self.assertEqual(parts["peak_reduction"], f"{snap_row / peak_row:.1f}")
        self.assertGreaterEqual(float(parts["peak_reduction"]), 25.0)
        one_layer = f"{snap_row / (peak_row + T * ssm):.1f}"  # + one layer's node SSM states
        self.assertIn(f"one_layer gives peak {one_layer}x", lines[-2])
        self.assertIn(f"peak reduction per row [one_layer] {one_layer}x", out.getvalue())
        self.assertEqual(parts["resident_reduction"], f"{snap_row / stash_row:.1f}")
        self.assertGreaterEqual(float(parts["resident_reduction"]), 500.0)
        self.assertGreaterEqual(float(parts["capacity_ratio"]), 5.0)
        # the capacity line and the ratio agree
        cap = next(l for l in lines if l.strip().startswith("capacity: max_running_requests"))
        before, after = (int(x) for x in cap.split("max_running_requests ")[1].split(" (")[0].split(" -> "))
        self.assertEqual(parts["capacity_ratio"], f"{after / before:.2f}")

    def test_qwen3_next_rows_from_sglang_pools(self):
        """Qwen3-Next-80B-A3B (Gated DeltaNet) at TP 2, as SGLang builds it: snapshot buffers and
        the deferred stash per request row match the reference formula at per-rank shapes (GDN
        gates: one per value head), and deferred mode serves more requests."""
        import importlib.util
        from types import SimpleNamespace

        if importlib.util.find_spec("sglang") is None:
            self.skipTest("SGLang is not installed")
        from sglang_mamba_ext.benchmarks import spec_memory as plan_spec_memory
        from sglang_mamba_ext.models.linear_attn import LinearAttnShape
        from sglang_mamba_ext.speculative.reference.sizing import HybridSpecModel

        args = SimpleNamespace(topk=4, steps=3, draft_token_num=63, max_running_requests=0, total_gib=140.0,
                               mem_fraction_static=0.88, ssm_dtype="bf16")
        with contextlib.redirect_stdout(io.StringIO()):
            res = plan_spec_memory.report("Qwen3-Next-80B-A3B", args, 2)
        m = MODELS["Qwen3-Next-80B-A3B"]
        s = m.shape
        rank = HybridSpecModel(m.name, m.source, m.num_linear_layers,
                               LinearAttnShape(s.num_k_heads // 2, s.num_v_heads // 2, s.head_k_dim, s.head_v_dim,
                                               s.conv_kernel), m.gate_dim // 2, m.beta_dim // 2, m.kind)
        snap, d, o = res["snapshot"], res["deferred"], res["other"]
        self.assertIsNone(res["refused"])
        self.assertEqual((d.variant, o.variant), ("on_chip", "one_layer"))
        self.assertEqual(snap.allocated, spec_memory_formula(rank, 4, 3, 63, snap.rows - 1, torch.bfloat16).snapshot)
        fd = spec_memory_formula(rank, 4, 3, 63, d.rows - 1, torch.bfloat16)
        self.assertEqual(d.resident, fd.stash)
        self.assertEqual(d.peak - d.resident - fd.conv_windows - fd.node_states["on_chip"],
                         fd.pending * d.rows // (d.rows - 1))  # the glue's workspace has R rows, the formula N
        fo = spec_memory_formula(rank, 4, 3, 63, o.rows - 1, torch.bfloat16)
        self.assertEqual(o.peak - o.resident - fo.conv_windows - fo.node_states["one_layer"],
                         fo.pending * o.rows // (o.rows - 1))
        self.assertGreater(d.r.max_mamba_cache_size, o.r.max_mamba_cache_size)  # both hit SGLang's bound of 48 requests
        self.assertGreater(d.r.max_running_requests, snap.r.max_running_requests)

    def test_qwen35_and_nemotron_h_rows_from_sglang_pools(self):
        """Issue 41 item 5: Qwen3.5-27B (GDN, 48 value heads) and Nemotron-Nano-9B-v2 (Mamba2) as
        SGLang builds their pools at TP 1: the snapshot buffers are L x rows x draft tokens x
        (one token's SSM state + conv window), counted here from the published fields; Qwen3.5's
        and Nemotron-H's deferred rows serve more requests."""
        import importlib.util
        from types import SimpleNamespace

        if importlib.util.find_spec("sglang") is None:
            self.skipTest("SGLang is not installed")
        from sglang_mamba_ext.benchmarks import spec_memory as plan_spec_memory

        args = SimpleNamespace(topk=4, steps=3, draft_token_num=63, max_running_requests=0, total_gib=140.0,
                               mem_fraction_static=0.88, ssm_dtype="bf16")
        with contextlib.redirect_stdout(io.StringIO()):
            q = plan_spec_memory.report("Qwen3.5-27B", args, 1)
            n = plan_spec_memory.report("Nemotron-Nano-9B-v2", args, 1)
        # Qwen3.5-27B: 48 GDN layers, 48 value heads x 128 x 128, conv over q,k (16 heads x 128
        # each) and v (48 x 128), 3 window columns, bf16
        per_token = 48 * 128 * 128 * 2 + (2 * 16 * 128 + 48 * 128) * 3 * 2
        snap = q["snapshot"]
        self.assertEqual(snap.allocated, 48 * snap.rows * 63 * per_token)
        self.assertIsNone(q["refused"])
        self.assertEqual(q["deferred"].variant, "on_chip")
        self.assertGreater(q["deferred"].r.max_running_requests, snap.r.max_running_requests)
        self.assertLess(q["deferred"].per_row(q["deferred"].peak) * 20, snap.per_row(snap.peak))
        # Nemotron-Nano-9B-v2: 27 Mamba2 layers, 128 heads x 80 x state 128, conv over x (128 x 80)
        # and B, C (8 groups x 128 each), 3 window columns, bf16
        per_token = 128 * 80 * 128 * 2 + (128 * 80 + 2 * 8 * 128) * 3 * 2
        snap = n["snapshot"]
        self.assertEqual(snap.allocated, 27 * snap.rows * 63 * per_token)
        # its deferred row (issue 41 item 3): on chip, so per row the stash (4 accepted tokens'
        # xBC + dt + an unused b column, bf16, and its counters), the verify workspace (63
        # tokens of the same) and one layer's 63 conv windows; no node states
        self.assertIsNone(n["refused"])
        d = n["deferred"]
        self.assertEqual(d.variant, "on_chip")
        rec = (12288 + 128 + 1) * 2
        counters = 4 + 8 + 8  # the stash's count, seq_len and track slot per row
        self.assertEqual(d.peak, d.rows * (27 * 4 * rec + 27 * 63 * rec + 63 * 12288 * 3 * 2 + counters))
        self.assertEqual(d.resident, d.rows * (27 * 4 * rec + counters))
        # SGLang's speculative default bound (48 requests) is reached; the snapshot row fits 10
        self.assertEqual((snap.r.max_running_requests, d.r.max_running_requests), (10, 48))

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
