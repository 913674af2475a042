"""The lightning-attention checkpoint writer (``sglang_mamba_ext/plugin/inchunk_lightning.py``,
issue 40: Ling 2.5 on SGLang's ``LightningAttentionBackend``) against the naive recurrence
``S_t = exp(-s) S_{t-1} + k_t^T v_t``, and its BEFORE hook on ``forward_extend`` with a stand-in
backend (the plan's slots written from the row's working slot or zeros, nothing without a plan
or a writer mark). Against SGLang's own ``seg_la`` kernel: ``tests/test_cpu_kernels.py``
(``TestLightningVsTriton``, under Triton's interpreter)."""

import types
import unittest

import torch

from sglang_mamba_ext.plugin.inchunk_lightning import reference_states, write_lightning_checkpoints


def _inputs(T=120, H=3, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(T, H, D, generator=g).half()
    v = torch.randn(T, H, D, generator=g).half()
    slope = torch.tensor([0.5, 0.06, 0.004])[:H]
    pool = torch.randn(10, H, D, D, generator=g)
    return k, v, slope, pool


class TestWriterVsRecurrence(unittest.TestCase):
    def test_rows_offsets_and_start_states(self):
        k, v, slope, pool = _inputs()
        # two packed rows: one from zeros, one from slot 3; offsets unsorted, one at the row's end
        rows = [(0, -1, [(50, 1), (1, 2), (33, 4)]), (50, 3, [(70, 5), (64, 6), (2, 7)])]
        p = pool.clone()
        write_lightning_checkpoints(k, v, slope, p, rows)
        for start, src, items in rows:
            want = reference_states(k[start:], v[start:], slope, None if src < 0 else pool[src], [o for o, _ in items])
            for (o, dst), w in zip(sorted(items), want):
                torch.testing.assert_close(p[dst], w, atol=2e-5, rtol=1e-5, msg=f"row {start} offset {o}")
        untouched = [0, 3, 8, 9]
        torch.testing.assert_close(p[untouched], pool[untouched], atol=0, rtol=0)

    def test_pool_dtype_and_strong_decay(self):
        k, v, slope, pool = _inputs(T=300, seed=1)
        p = pool.half()
        write_lightning_checkpoints(k, v, torch.tensor([20.0, 0.06, 1e-6]), p, [(0, 2, [(300, 0), (299, 1)])])
        want = reference_states(k, v, torch.tensor([20.0, 0.06, 1e-6]), pool.half()[2], [299, 300])
        self.assertEqual(p.dtype, torch.float16)
        torch.testing.assert_close(p[1].float(), want[0].half().float(), atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(p[0].float(), want[1].half().float(), atol=2e-2, rtol=1e-2)
        self.assertTrue(torch.isfinite(p).all())


class _Pool:
    def __init__(self, states, plan):
        self.states, self.plan, self.prefix_checkpoints = states, plan, {0: "planned"}

    def prefix_checkpoint_plan(self, forward_batch):
        return self.plan

    def mamba2_layer_cache(self, layer_id):
        return types.SimpleNamespace(temporal=self.states, conv=[None])


def _backend(states, plan, slots, mark=True):
    from sglang_mamba_ext.plugin.inchunk_checkpoints import WRITER_ATTR

    b = types.SimpleNamespace(req_to_token_pool=_Pool(states, plan), tp_slope=[None, torch.tensor([0.3, 0.01]).reshape(2, 1, 1)],
                              forward_metadata=types.SimpleNamespace(mamba_cache_indices=torch.tensor(slots)))
    if mark:
        setattr(b, WRITER_ATTR, "lightning")
    return b


def _batch(lens, prefix):
    mode = types.SimpleNamespace(is_target_verify=lambda: False)
    return types.SimpleNamespace(forward_mode=mode, extend_seq_lens_cpu=lens, extend_prefix_lens_cpu=prefix)


class TestForwardExtendHook(unittest.TestCase):
    def test_writes_plan_from_working_slot_or_zeros(self):
        from sglang_mamba_ext.plugin.inchunk_lightning import forward_extend_before

        g = torch.Generator().manual_seed(2)
        T, H, D = 40, 2, 8
        q, k, v = (torch.randn(T, H, D, generator=g) for _ in range(3))
        states = torch.randn(8, H, D, D, generator=g)
        before = states.clone()
        # row 0: 25 new tokens after a prefix (working slot 1); row 1: 15 tokens from scratch (slot 2)
        plan = {0: [(10, 5), (25, 6)], 1: [(15, 7)]}
        backend = _backend(states, plan, [1, 2])
        forward_extend_before(backend, q, k, v, types.SimpleNamespace(layer_id=1), _batch([25, 15], [30, 0]))
        slope = backend.tp_slope[1]
        w0 = reference_states(k[:25], v[:25], slope, before[1], [10, 25])
        w1 = reference_states(k[25:], v[25:], slope, None, [15])
        for dst, want in ((5, w0[0]), (6, w0[1]), (7, w1[0])):
            torch.testing.assert_close(states[dst], want, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(states[:5], before[:5], atol=0, rtol=0)  # working slots untouched
        self.assertEqual(backend.req_to_token_pool.inchunk_from_start_state, 3)

    def test_inert_without_mark_or_plan(self):
        from sglang_mamba_ext.plugin.inchunk_lightning import forward_extend_before

        q = k = v = torch.ones(4, 2, 8)
        for backend in (_backend(torch.zeros(3, 2, 8, 8), {0: [(2, 1)]}, [0], mark=False),
                        _backend(torch.zeros(3, 2, 8, 8), {}, [0])):
            forward_extend_before(backend, q, k, v, types.SimpleNamespace(layer_id=1), _batch([4], [0]))
            self.assertEqual(backend.req_to_token_pool.states.abs().sum().item(), 0)


if __name__ == "__main__":
    unittest.main()
