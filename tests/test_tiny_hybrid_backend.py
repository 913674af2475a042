"""TinyHybridLinearAttnBackend's state handling, without a server.

The backend's SGLang metadata (slots, query_start_loc) is given directly; the Mamba pool is a
pair of tensors shaped like SGLang's (``[slots, conv_dim, W-1]``, ``[slots, HV, K, V]``). The
oracle is the shared mixer run per sequence.
"""

import unittest
from types import SimpleNamespace

import torch

from sglang_mamba_ext.models.linear_attn import LinearAttnShape
from sglang_mamba_ext.plugin.tiny_hybrid.backend import TinyHybridLinearAttnBackend
from conftest import small_mixer


class _Pool:
    def __init__(self, slots, shape: LinearAttnShape, conv_dtype=torch.float32):
        self.conv = torch.zeros(slots, *shape.conv_state_shape, dtype=conv_dtype)
        # stored as SGLang's [slots, HV, V, K] (the tiny pool's layout); tests read and
        # write the mixer's [slots, HV, K, V] through the transposed view
        HV, K, V = shape.temporal_state_shape
        self.temporal_phys = torch.zeros(slots, HV, V, K)
        self.temporal = self.temporal_phys.transpose(-1, -2)

    def mamba2_layer_cache(self, layer_id):
        return SimpleNamespace(conv=[self.conv], temporal=self.temporal_phys)


def _mode(verify=False):
    return SimpleNamespace(is_target_verify=lambda: verify, is_draft_extend_v2=lambda: False)


class TestTinyHybridBackend(unittest.TestCase):
    def setUp(self):
        self.shape, self.mixer = small_mixer()
        self.pool = _Pool(8, self.shape)
        self.backend = object.__new__(TinyHybridLinearAttnBackend)  # no ModelRunner needed
        self.backend.req_to_token_pool = self.pool
        self.backend._plan = {}
        self.layer = SimpleNamespace(layer_id=1, mixer=self.mixer)
        self.x0 = torch.randn(7, 32)  # fresh request
        self.x1 = torch.randn(9, 32)  # request with 5 tokens already in its slot

    def _oracle(self, x, conv=None, ssm=None):
        """Pre-finish mixer output o [T, HV, V] and final states."""
        mixed, g, beta = self.mixer.project(x)
        _, graw, braw = self.mixer.project_raw(x)  # what the backend receives
        y, conv = self.mixer.conv(mixed, conv)
        q, k, v = self.mixer.split_qkv(y)
        o, ssm = self.mixer.recurrence(q, k, v, g, beta, ssm)
        return o, conv, ssm

    def _extend(self, xs, slots, prefix_lens, plan=None):
        x = torch.cat(xs)
        mixed, g, beta = self.mixer.project(x)
        _, graw, braw = self.mixer.project_raw(x)  # what the backend receives
        qsl = [0]
        for t in xs:
            qsl.append(qsl[-1] + t.shape[0])
        self.backend.forward_metadata = SimpleNamespace(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            mamba_cache_indices=torch.tensor(slots, dtype=torch.int64),
        )
        self.backend.checkpoint_plan = lambda fb: plan or {}
        fb = SimpleNamespace(forward_mode=_mode(), extend_prefix_lens_cpu=prefix_lens)
        self.backend._plan = self.backend._validated_plan(fb)
        return self.backend.forward_extend(
            layer=self.layer, forward_batch=fb, mixed_qkv=mixed, a=graw, b=braw
        )

    def test_extend_fresh_and_continued_rows(self):
        _, c5, s5 = self._oracle(self.x1[:5])
        self.pool.conv[2], self.pool.temporal[2] = c5, s5
        self.pool.conv[1].fill_(7.0)  # garbage in a fresh row's slot must be ignored
        out = self._extend([self.x0, self.x1[5:]], slots=[1, 2], prefix_lens=[0, 5])
        self.assertEqual(tuple(out.shape), (1, 11, 4, 12))
        o0, c0, s0 = self._oracle(self.x0)
        o1, c1, s1 = self._oracle(self.x1)
        torch.testing.assert_close(out[0, :7], o0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[0, 7:], o1[5:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(self.pool.conv[1], c0)
        torch.testing.assert_close(self.pool.temporal[1], s0, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(self.pool.conv[2], c1)
        torch.testing.assert_close(self.pool.temporal[2], s1, atol=1e-5, rtol=1e-5)

    def test_checkpoint_plan_copies_state_at_offsets(self):
        plan = {0: [(3, 5), (0, 4), (7, 6)]}
        self.pool.conv[4].fill_(1.0)
        out = self._extend([self.x0], slots=[1], prefix_lens=[0], plan=plan)
        _, c3, s3 = self._oracle(self.x0[:3])
        o, c7, s7 = self._oracle(self.x0)
        torch.testing.assert_close(out[0], o, atol=1e-5, rtol=1e-5)  # cuts do not change output
        self.assertTrue(bool((self.pool.conv[4] == 0).all()) and bool((self.pool.temporal[4] == 0).all()))
        torch.testing.assert_close(self.pool.conv[5], c3)
        torch.testing.assert_close(self.pool.temporal[5], s3, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(self.pool.temporal[6], s7, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(self.pool.temporal[1], s7, atol=1e-5, rtol=1e-5)

    def test_bad_plan_raises(self):
        with self.assertRaises(ValueError):
            self._extend([self.x0], slots=[1], prefix_lens=[0], plan={0: [(8, 5)]})
        with self.assertRaises(ValueError):
            self._extend([self.x0], slots=[1], prefix_lens=[0], plan={3: [(1, 5)]})

    def test_decode_batch_with_checkpoint(self):
        _, ca, sa = self._oracle(self.x0[:6])
        _, cb, sb = self._oracle(self.x1[:8])
        self.pool.conv[3], self.pool.temporal[3] = ca, sa
        self.pool.conv[0], self.pool.temporal[0] = cb, sb
        x = torch.stack([self.x0[6], self.x1[8]])
        mixed, g, beta = self.mixer.project(x)
        _, graw, braw = self.mixer.project_raw(x)  # what the backend receives
        self.backend.forward_metadata = SimpleNamespace(
            query_start_loc=torch.arange(3, dtype=torch.int32),
            mamba_cache_indices=torch.tensor([3, 0]),
        )
        self.backend._plan = {1: [(1, 7)]}
        out = self.backend.forward_decode(layer=self.layer, forward_batch=None, mixed_qkv=mixed, a=graw, b=braw)
        oa, ca2, sa2 = self._oracle(self.x0)
        ob, cb2, sb2 = self._oracle(self.x1)
        torch.testing.assert_close(out[0, 0], oa[6], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[0, 1], ob[8], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(self.pool.conv[3], ca2)
        torch.testing.assert_close(self.pool.temporal[0], sb2, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(self.pool.temporal[7], sb2, atol=1e-5, rtol=1e-5)

    def test_bf16_conv_pool(self):
        self.pool = _Pool(8, self.shape, conv_dtype=torch.bfloat16)
        self.backend.req_to_token_pool = self.pool
        self._extend([self.x0], slots=[1], prefix_lens=[0])
        _, c0, _ = self._oracle(self.x0)
        self.assertEqual(self.pool.conv.dtype, torch.bfloat16)
        torch.testing.assert_close(self.pool.conv[1].float(), c0, atol=1e-2, rtol=1e-2)

    def test_draft_extend_is_refused(self):
        # target verify is implemented (tests/test_spec_cpu.py::TestTargetVerify)
        fb = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: False,
                                                          is_draft_extend_v2=lambda: True))
        with self.assertRaises(NotImplementedError):
            self.backend.forward_extend(layer=self.layer, forward_batch=fb, mixed_qkv=torch.zeros(1, 1), a=None, b=None)


if __name__ == "__main__":
    unittest.main()
