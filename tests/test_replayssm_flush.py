"""The ReplaySSM decode ring's flush (issue 42, item 3; ``plugin/replayssm.py``): the pending
records of a slot folded into its state give the state the step-by-step recurrence gives
(GDN's per-head decay and KDA's per-channel one, key heads shared by value heads), the ring
is emptied, other slots are untouched, and a pool without the decode ring is left alone.
The end-to-end check against SGLang's ReplaySSM kernel is ``tests/e2e/test_replayssm_serving.py``."""

import unittest
from types import SimpleNamespace

import torch

from sglang_mamba_ext.plugin import replayssm

H, HV, K, V, LR = 2, 4, 8, 6, 8


def recurrence(state, ks, vs, gs, betas):
    """The delta rule one token at a time (``S [HV, V, K]``): decay, then the corrected delta
    ``d = beta (v - S k)`` written along ``k``; returns the state and the deltas."""
    s = state.clone()
    ds = []
    for k, v, g, beta in zip(ks, vs, gs, betas):
        kk = k.repeat_interleave(HV // H, dim=0)  # [HV, K]
        decay = torch.exp(g)
        s = s * (decay[:, None, None] if g.dim() == 1 else decay[:, None, :])
        d = beta[:, None] * (v - torch.einsum("hvk,hk->hv", s, kk))
        s = s + d[:, :, None] * kk[:, None, :]
        ds.append(d)
    return s, ds


def pool_with_ring(slots=3, layers=2, kda=False, ring=True):
    cache = SimpleNamespace(
        temporal=torch.zeros(layers, slots + 1, HV, V, K),
        replayssm_d=torch.zeros(layers, slots + 1, HV, LR, V),
        replayssm_k=torch.zeros(layers, slots + 1, H, LR, K),
        replayssm_g=torch.zeros(layers, slots + 1, HV, LR, *((K,) if kda else ())),
    )
    return SimpleNamespace(enable_linear_replayssm=ring, mamba_cache=cache,
                           replayssm_write_pos=torch.zeros(slots + 1, dtype=torch.int32))


class TestFold(unittest.TestCase):
    def check(self, kda):
        g = torch.Generator().manual_seed(7 + kda)
        m = 5
        s0 = torch.randn(HV, V, K, generator=g)
        ks = [torch.nn.functional.normalize(torch.randn(H, K, generator=g), dim=-1) for _ in range(m)]
        vs = [torch.randn(HV, V, generator=g) for _ in range(m)]
        gs = [-torch.rand(HV, *((K,) if kda else ()), generator=g) for _ in range(m)]
        betas = [torch.rand(HV, generator=g) for _ in range(m)]
        want, ds = recurrence(s0, ks, vs, gs, betas)
        pool = pool_with_ring(kda=kda)
        c = pool.mamba_cache
        for layer in range(2):
            c.temporal[layer, 2] = s0 * (layer + 1)
            c.temporal[layer, 1] = 5.0
            for j in range(m):
                c.replayssm_d[layer, 2, :, j] = ds[j] * (layer + 1)
                c.replayssm_k[layer, 2, :, j] = ks[j]
                c.replayssm_g[layer, 2, :, j] = gs[j]
        pool.replayssm_write_pos[2] = m
        pool.replayssm_write_pos[1] = 0
        self.assertEqual(replayssm.flush_slots(pool, [1, 2, None]), m)
        for layer in range(2):
            torch.testing.assert_close(c.temporal[layer, 2], want * (layer + 1), rtol=1e-5, atol=1e-5)
        self.assertTrue(bool((c.temporal[:, 1] == 5.0).all()))  # an empty ring: untouched
        self.assertEqual(pool.replayssm_write_pos.tolist(), [0, 0, 0, 0])
        self.assertEqual(replayssm.flush_slots(pool, [2]), 0)  # flushed once

    def test_gdn_per_head_decay(self):
        self.check(kda=False)

    def test_kda_per_channel_decay(self):
        self.check(kda=True)

    def test_pool_without_the_decode_ring_is_left_alone(self):
        pool = pool_with_ring(ring=False)
        pool.replayssm_write_pos[1] = 3
        pool.mamba_cache.temporal[:, 1] = 2.0
        self.assertIsNone(replayssm.decode_ring(pool))
        self.assertEqual(replayssm.flush_slots(pool, [1]), 0)
        replayssm.reset_cursor(pool, [1])
        self.assertEqual(int(pool.replayssm_write_pos[1]), 3)
        self.assertTrue(bool((pool.mamba_cache.temporal[:, 1] == 2.0).all()))

    def test_reset_cursor_empties_the_ring(self):
        pool = pool_with_ring()
        pool.replayssm_write_pos[1:] = 4
        replayssm.reset_cursor(pool, [1, 3])
        self.assertEqual(pool.replayssm_write_pos.tolist(), [0, 0, 4, 0])


if __name__ == "__main__":
    unittest.main()
