"""SGLang's memory budget under --mamba-spec-state-update deferred (issue 15, item 1;
sglang_mamba_ext/plugin/speculative/budget.py): SGLang's own pool sizing
(``KVCacheConfigurator._resolve_memory_pool_config`` and ``_build_req_to_token_pool``, run
in-process by ``sglang_mamba_ext.benchmarks.sglang_pools`` for Kimi-Linear-48B-A3B's and
Qwen3-Next-80B-A3B's published configs, device memory simulated, tensors on ``meta``) charges the deferred state's bytes per
request row instead of the snapshot buffers', and the difference becomes Mamba slots, running
requests and KV tokens by SGLang's own split.

Expected numbers come from the bytes of the buffers SGLang built (snapshot: ``slot_bytes * D``
per row, checked against its ``intermediate_*`` tensors; deferred: ``DeferredSpecState.nbytes()``
per row) and SGLang's split rule for an automatic Mamba pool (``_handle_max_mamba_cache``):
with ``B = rest * r / (1 + r)`` (``r = --mamba-full-memory-ratio``), Mamba slots ``K =
floor((B - slot - row) / (slot + row / ratio))``; rows reserved ``min(max_running_requests,
K // ratio) + 1``; KV bytes ``rest - (K + 1) * slot - rows * row``.
"""

import unittest

from conftest import requires_sglang

MODEL = "Kimi-Linear-48B-A3B"
# an H200 seen as 140 GiB, 48B bf16 weights on one GPU (89.4 GiB): 50.6 GiB free after loading
BUDGET = dict(total_gib=140.0, free_gib=50.6, tp=1, topk=4, steps=3, draft_tokens=63)
D = BUDGET["draft_tokens"]


def _run(mode, *extra):
    from sglang_mamba_ext.benchmarks.sglang_pools import size_pools

    r = size_pools(MODEL, mode, extra_argv=list(extra), **BUDGET)
    assert r.refused is None, r.refused
    return r


def _auto_slots(r, row):
    """SGLang's automatic Mamba pool size for a per-row speculative charge of ``row`` bytes."""
    ratio = 0.9  # SGLang's default --mamba-full-memory-ratio
    B = (r.rest_bytes / (1 << 30)) * ratio / (1 + ratio) * (1 << 30)
    return int((B - r.slot_bytes * 1 - row) // (r.slot_bytes * 1 + row / r.mamba_ratio))


@requires_sglang
class TestDeferredBudget(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.none, cls.snap, cls.dfr = _run(None), _run("snapshot"), _run("deferred")
        cls.row_snap = cls.snap.slot_bytes * D
        cls.row_def, rem = divmod(cls.dfr.spec_bytes, cls.dfr.rows)
        assert rem == 0, rem

    def _kv_bytes(self, r, row, capped):
        return r.rest_bytes - (r.max_mamba_cache_size + 1) * r.slot_bytes - (capped + 1) * row

    def test_inert_without_the_flag(self):
        self.assertEqual(self.none.__dict__ | {"mode": None}, self.snap.__dict__ | {"mode": None})

    def test_snapshot_charge_is_what_sglang_builds(self):
        s = self.snap
        self.assertEqual(s.rows, s.max_running_requests + 1)
        self.assertEqual(s.spec_bytes, self.row_snap * s.rows)  # dense conv windows (topk 4)

    def test_deferred_pool_sizes_grow_by_the_byte_difference(self):
        s, d = self.snap, self.dfr
        self.assertEqual(d.rest_bytes, s.rest_bytes)
        self.assertLess(self.row_def * 12, self.row_snap)
        # Mamba slots: SGLang's rule with each mode's per-row charge
        self.assertEqual(s.max_mamba_cache_size, _auto_slots(s, self.row_snap))
        self.assertEqual(d.max_mamba_cache_size, _auto_slots(d, self.row_def))
        # running requests: min(SGLang's speculative default 48, slots // ratio)
        for r in (s, d):
            self.assertEqual(r.max_running_requests, min(48, r.max_mamba_cache_size // r.mamba_ratio))
        self.assertEqual(d.rows, d.max_running_requests + 1)
        # KV: what neither the Mamba slots nor the reserved rows took
        for r, row in ((s, self.row_snap), (d, self.row_def)):
            capped = min(48, r.max_mamba_cache_size // r.mamba_ratio)
            self.assertAlmostEqual(r.kv_budget_bytes, self._kv_bytes(r, row, capped), delta=1)
            self.assertEqual(r.max_total_num_tokens, r.kv_budget_bytes // r.kv_cell_bytes)
        # at this budget all three grow
        self.assertEqual((s.max_mamba_cache_size, s.max_running_requests), (31, 10))
        self.assertEqual((d.max_mamba_cache_size, d.max_running_requests), (442, 48))
        self.assertGreater(d.max_total_num_tokens, s.max_total_num_tokens)

    def test_user_max_mamba_cache_size_wins(self):
        s, d = _run("snapshot", "--max-mamba-cache-size", "60"), _run("deferred", "--max-mamba-cache-size", "60")
        self.assertEqual((s.max_mamba_cache_size, d.max_mamba_cache_size), (60, 60))
        self.assertEqual((s.max_running_requests, d.max_running_requests), (20, 20))  # 60 // 3
        # the 21 reserved rows cost row_def instead of row_snap; the rest goes to KV
        self.assertAlmostEqual(d.kv_budget_bytes - s.kv_budget_bytes, 21 * (self.row_snap - self.row_def), delta=2)
        self.assertEqual(d.max_total_num_tokens - s.max_total_num_tokens,
                         d.kv_budget_bytes // d.kv_cell_bytes - s.kv_budget_bytes // s.kv_cell_bytes)
        self.assertGreater(d.max_total_num_tokens, s.max_total_num_tokens)

    def test_user_max_running_requests_wins(self):
        s, d = _run("snapshot", "--max-running-requests", "8"), _run("deferred", "--max-running-requests", "8")
        self.assertEqual((s.max_running_requests, d.max_running_requests), (8, 8))
        self.assertEqual(d.rows, 9)
        self.assertEqual(s.max_mamba_cache_size, _auto_slots(s, self.row_snap))
        self.assertEqual(d.max_mamba_cache_size, _auto_slots(d, self.row_def))
        for r, row in ((s, self.row_snap), (d, self.row_def)):
            self.assertAlmostEqual(r.kv_budget_bytes, self._kv_bytes(r, row, 8), delta=1)
        self.assertGreater(d.max_total_num_tokens, s.max_total_num_tokens)

    def test_gated_deltanet_budget(self):
        """Qwen3-Next-80B-A3B (Gated DeltaNet) at TP 2 on the same GPU: the same rule with the
        GDN state's bytes per row (gate per value head)."""
        from sglang_mamba_ext.benchmarks.sglang_pools import size_pools

        kw = dict(BUDGET, tp=2, free_gib=140.0 - 80e9 * 2 / 2 / 2**30)
        s, d = size_pools("Qwen3-Next-80B-A3B", "snapshot", **kw), size_pools("Qwen3-Next-80B-A3B", "deferred", **kw)
        self.assertIsNone(d.refused)
        row_snap = s.slot_bytes * D
        row_def, rem = divmod(d.spec_bytes, d.rows)
        self.assertEqual(rem, 0)
        self.assertEqual(s.spec_bytes, row_snap * s.rows)
        # per rank: 36 layers, conv_dim 2*8*128 + 16*128, 16 value heads of 128 x 128, bf16;
        # verify on chip: no node-state SSM buffer
        per_tok = 4096 + 16 + 16
        self.assertEqual(d.verify, "on_chip")
        self.assertEqual(row_def, 36 * 4 * per_tok * 2 + 20 + 36 * D * per_tok * 2 + D * 4096 * 3 * 2)
        for r, row in ((s, row_snap), (d, row_def)):
            self.assertEqual(r.max_mamba_cache_size, _auto_slots(r, row))
            self.assertEqual(r.max_running_requests, min(48, r.max_mamba_cache_size // r.mamba_ratio))
            capped = min(48, r.max_mamba_cache_size // r.mamba_ratio)
            self.assertAlmostEqual(r.kv_budget_bytes, self._kv_bytes(r, row, capped), delta=1)
        self.assertGreater(d.max_running_requests, s.max_running_requests)
        self.assertGreater(d.max_total_num_tokens, s.max_total_num_tokens)

    def test_deferred_row_bytes_from_published_shapes(self):
        """The deferred state's bytes per row (stash of steps + 1 tokens with 20 B of counters,
        pending activations of D tokens, one layer's D conv windows; on chip no node states,
        with the forced one_layer variant one layer's D node SSM states too) from Kimi-Linear's
        published shapes."""
        from sglang_mamba_ext.benchmarks.sglang_pools import PUBLISHED

        cfg = PUBLISHED[MODEL].config["linear_attn_config"]
        self.assertEqual(len(cfg["kda_layers"]), 20)
        # stash + pending + one-layer buffers, per row, from the published shapes (bf16):
        per_tok = 3 * 32 * 128 + 32 * 128 + 32  # mixed_qkv + g + beta
        expect = (20 * 4 * per_tok * 2 + 20) + 20 * D * per_tok * 2 + D * 3 * 3 * 32 * 128 * 2
        self.assertEqual(self.dfr.verify, "on_chip")
        self.assertEqual(self.row_def, expect)
        from sglang_mamba_ext.benchmarks.sglang_pools import size_pools

        one = size_pools(MODEL, "deferred", verify="one_layer", **BUDGET)
        self.assertEqual(one.verify, "one_layer")
        self.assertEqual(divmod(one.spec_bytes, one.rows), (expect + D * 32 * 128 * 128 * 2, 0))
        self.assertEqual(one.max_mamba_cache_size, _auto_slots(one, expect + D * 32 * 128 * 128 * 2))
        self.assertLess(one.max_mamba_cache_size, self.dfr.max_mamba_cache_size)


if __name__ == "__main__":
    unittest.main()
