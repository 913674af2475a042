"""The tiny backend writes SGLang's extra_buffer ping-pong checkpoints from SGLang's own
track metadata (``TinyHybridLinearAttnBackend.sglang_track_plan``), as SGLang's GPU backends
do with their kernels. No server."""

import unittest
from types import SimpleNamespace

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_mamba_ext.plugin.tiny_hybrid.backend import TinyHybridLinearAttnBackend
from conftest import small_mixer


class _Pool:
    def __init__(self, slots, shape):
        self.conv = torch.zeros(slots, *shape.conv_state_shape)
        # stored as SGLang's [slots, HV, V, K] (the tiny pool's layout); tests read and
        # write the mixer's [slots, HV, K, V] through the transposed view
        HV, K, V = shape.temporal_state_shape
        self.temporal_phys = torch.zeros(slots, HV, V, K)
        self.temporal = self.temporal_phys.transpose(-1, -2)

    def mamba2_layer_cache(self, layer_id):
        return SimpleNamespace(conv=[self.conv], temporal=self.temporal_phys)


class TestSGLangTrackPlan(unittest.TestCase):
    def setUp(self):
        self.shape, self.mixer = small_mixer()
        self.pool = _Pool(16, self.shape)
        self.backend = object.__new__(TinyHybridLinearAttnBackend)
        self.backend.req_to_token_pool = self.pool
        self.backend._plan = {}
        self.layer = SimpleNamespace(layer_id=1, mixer=self.mixer)

    def _md(self, track, qsl=None, slots=None):
        self.backend.forward_metadata = SimpleNamespace(
            mamba_track_indices=None if track is None else torch.tensor(track),
            query_start_loc=None if qsl is None else torch.tensor(qsl, dtype=torch.int32),
            mamba_cache_indices=None if slots is None else torch.tensor(slots),
        )

    def one_row_extend_tracked_at_8(self):
        """A one-row extend batch (from an empty state) that SGLang tracks after 8 tokens;
        the backend's plan is validated for it."""
        fb = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            extend_prefix_lens_cpu=[0],
            mamba_prefill_track_mask_cpu=[True],
            mamba_track_aligned_lens=lambda: torch.tensor([8]),
        )
        self.backend._plan = self.backend._validated_plan(fb)
        return fb

    def oracle(self, x, n):
        """(conv window, temporal state) of the mixer over the first ``n`` rows of ``x``."""
        m, g, beta = self.mixer.project(x[:n])
        _, graw, braw = self.mixer.project_raw(x[:n])  # what the backend receives
        y, conv = self.mixer.conv(m, None)
        q, k, v = self.mixer.split_qkv(y)
        _, ssm = self.mixer.recurrence(q, k, v, g, beta, None)
        return conv, ssm

    def test_declares_it_writes_track_states(self):
        self.assertTrue(TinyHybridLinearAttnBackend.writes_mamba_track_states)

    def test_extend_plan(self):
        self._md([11, 12, -1])
        fb = SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            mamba_prefill_track_mask_cpu=[True, False, True],
            mamba_track_aligned_lens=lambda: torch.tensor([8, 0, 16]),
        )
        self.assertEqual(self.backend.sglang_track_plan(fb), {0: [(8, 11)]})  # -1: no slot

    def test_decode_plan(self):
        self._md([3, 4, 5])
        fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, mamba_track_mask=torch.tensor([False, True, True]))
        self.assertEqual(self.backend.sglang_track_plan(fb), {1: [(1, 4)], 2: [(1, 5)]})

    def test_no_tracking_no_plan(self):
        self._md(None)
        fb = SimpleNamespace(forward_mode=ForwardMode.EXTEND, mamba_prefill_track_mask_cpu=[True])
        self.assertEqual(self.backend.sglang_track_plan(fb), {})
        self._md([3])
        fb = SimpleNamespace(forward_mode=ForwardMode.DECODE, mamba_track_mask=None)
        self.assertEqual(self.backend.sglang_track_plan(fb), {})

    def test_extend_writes_checkpoint_from_metadata(self):
        x = torch.randn(12, 32)
        mixed, g, beta = self.mixer.project(x)
        _, graw, braw = self.mixer.project_raw(x)  # what the backend receives
        self._md([9], qsl=[0, 12], slots=[2])
        fb = self.one_row_extend_tracked_at_8()
        self.backend.forward_extend(layer=self.layer, forward_batch=fb, mixed_qkv=mixed, a=graw, b=braw)
        conv8, ssm8 = self.oracle(x, 8)
        torch.testing.assert_close(self.pool.conv[9], conv8)
        torch.testing.assert_close(self.pool.temporal[9], ssm8, atol=1e-5, rtol=1e-5)
        self.assertFalse(torch.equal(self.pool.temporal[2], self.pool.temporal[9]))  # working state is at 12

    def test_pool_prefix_checkpoints_join_the_track_plan(self):
        """Under --enable-mamba-radix the pool's planned prefix checkpoints (exact
        positions, here 5 tokens: off SGLang's 8-token grid) are written beside SGLang's
        own track checkpoint, each equal to the mixer over that many tokens."""
        x = torch.randn(12, 32)
        mixed, g, beta = self.mixer.project(x)
        _, graw, braw = self.mixer.project_raw(x)  # what the backend receives
        self._md([9], qsl=[0, 12], slots=[2])
        self.pool.prefix_checkpoint_plan = lambda fb: {0: [(5, 7), (11, 6)]}
        fb = self.one_row_extend_tracked_at_8()
        self.assertEqual(self.backend._plan, {0: [(5, 7), (8, 9), (11, 6)]})
        self.backend.forward_extend(layer=self.layer, forward_batch=fb, mixed_qkv=mixed, a=graw, b=braw)
        for n, slot in ((5, 7), (8, 9), (11, 6)):
            conv, ssm = self.oracle(x, n)
            torch.testing.assert_close(self.pool.conv[slot], conv)
            torch.testing.assert_close(self.pool.temporal[slot], ssm, atol=1e-5, rtol=1e-5)


if __name__ == "__main__":
    unittest.main()
