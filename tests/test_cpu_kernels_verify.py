"""The plain-torch CPU versions of SGLang's speculative-path kernels
(``sglang_mamba_ext.plugin.cpu_kernels_verify``) against SGLang's Triton kernels run by Triton's
interpreter, and their bridge routing.

- ``fused_sigmoid_gating_delta_rule_update``: GDN and KDA (with and without the lower-bound
  gate), as target verify (no state write-back, every step's state in the intermediate buffer)
  on a chain and on an EAGLE tree (each token from its parent's state), and as a plain decode
  (write-back), with a ``-1`` row (zero start, no write) and grouped heads. Outputs, buffers and
  pools are asserted.
- ``decode_attention_fwd``: grouped (GQA) and MHA heads, requests of different lengths over
  scattered slots, with a logit cap and with sinks.

The Triton side needs ``TRITON_INTERPRET=1`` before Triton is imported, so those classes run in
a fresh process (``TestUnderTritonInterpreter``) unless this one already interprets."""

import os
import unittest
from unittest import mock

import torch

from conftest import SGLANG_INSTALLED
from sglang_mamba_ext.testing.spec_pair import triton_subprocess_case

_IN_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
NO_CUDA = not torch.cuda.is_available()
SELECT = "VsTriton"
HALF = torch.float16


def _close(tc, a, b, atol, what=""):
    tc.assertEqual(a.shape, b.shape, what)
    tc.assertEqual(a.dtype, b.dtype, what)
    torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=1e-2, msg=what)


@unittest.skipUnless(_IN_INTERP and SGLANG_INSTALLED and NO_CUDA, "needs TRITON_INTERPRET=1 (runs in a subprocess)")
class TestVerifyKernelsVsTriton(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.plugin.cpu_bridges import MAMBA_KERNEL_MODULES
        from sglang_mamba_ext.plugin.triton_interpret import install_interpreter_shims

        install_interpreter_shims(extra_modules=MAMBA_KERNEL_MODULES)

    def _run_delta(self, fn, kind, lb, mode):
        g = torch.Generator().manual_seed(11)
        N, T, H, HV, K, V = 3, 4, 2, 4, 16, 16
        q = torch.randn(1, N * T, H, K, generator=g).to(HALF)
        k = torch.randn(1, N * T, H, K, generator=g).to(HALF)
        v = torch.randn(1, N * T, HV, V, generator=g).to(HALF)
        b = torch.randn(1, N * T, HV, generator=g).to(HALF)
        A_log = torch.randn(HV, generator=g) * 0.5
        if kind == "kda":
            a = torch.randn(1, N * T, HV * K, generator=g).to(HALF)
            dt_bias = torch.randn(HV * K, generator=g)
        else:
            a = torch.randn(1, N * T, HV, generator=g).to(HALF)
            dt_bias = torch.randn(HV, generator=g)
        pool = torch.randn(6, HV, V, K, generator=g) * 0.1
        cu = torch.arange(0, N * T + 1, T, dtype=torch.int32)
        idx = torch.tensor([4, -1, 1], dtype=torch.int32)
        extra = {}
        if mode != "decode":
            buf = torch.zeros(5, T, HV, V, K, dtype=HALF)
            extra = dict(disable_state_update=True, intermediate_states_buffer=buf,
                         intermediate_state_indices=torch.tensor([2, 0, 3], dtype=torch.int32), cache_steps=T)
            if mode == "tree":  # token 0 root; 1 and 2 its children; 3 child of 2
                extra["retrieve_parent_token"] = torch.tensor([[-1, 0, 0, 2]] * N, dtype=torch.long)
        out = fn(A_log=A_log, a=a, dt_bias=dt_bias, softplus_beta=1.0, softplus_threshold=20.0, q=q, k=k, v=v,
                 b=b, initial_state_source=pool, initial_state_indices=idx, cu_seqlens=cu,
                 use_qk_l2norm_in_kernel=True, is_kda=kind == "kda", lower_bound=lb, scale=0.3, **extra)
        return out, pool, extra.get("intermediate_states_buffer")

    def test_delta_rule_update(self):
        from sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent import \
            fused_sigmoid_gating_delta_rule_update as triton_fn

        from sglang_mamba_ext.plugin.cpu_kernels_verify import fused_sigmoid_gating_delta_rule_update as torch_fn

        for kind, lb in (("gdn", None), ("kda", None), ("kda", -5.0)):
            for mode in ("chain", "tree", "decode"):
                what = f"{kind} lb={lb} {mode}"
                want, got = self._run_delta(triton_fn, kind, lb, mode), self._run_delta(torch_fn, kind, lb, mode)
                _close(self, got[0], want[0], 2e-3, what + " out")
                _close(self, got[1], want[1], 1e-5, what + " pool")
                if mode != "decode":
                    _close(self, got[2], want[2], 2e-3, what + " intermediate states")
                    self.assertGreater(float(got[2].abs().sum()), 0, what)  # the buffer was written

    def test_decode_attention(self):
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd as triton_fn

        from sglang_mamba_ext.plugin.cpu_kernels_verify import decode_attention_fwd as torch_fn

        g = torch.Generator().manual_seed(12)
        lens = [5, 1, 19]
        for hq, hkv, cap, sinks in ((4, 2, 0.0, None), (4, 4, 0.0, None), (8, 2, 30.0, None),
                                    (4, 2, 0.0, torch.randn(4, generator=g))):
            kb = torch.randn(64, hkv, 16, generator=g).to(HALF)
            vb = torch.randn(64, hkv, 8, generator=g).to(HALF)
            q = torch.randn(len(lens), hq, 16, generator=g).to(HALF)
            indices = torch.randperm(60, generator=g)[: sum(lens)].to(torch.int32)
            indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
            outs = []
            for fn in (triton_fn, torch_fn):
                o = torch.zeros(len(lens), hq, 8, dtype=HALF)
                splits = 4
                fn(q, kb, vb, o, indptr, indices, torch.empty(len(lens), hq, splits, 8, dtype=torch.float32),
                   torch.empty(len(lens), hq, splits, dtype=torch.float32),
                   torch.full((len(lens),), splits, dtype=torch.int32), splits, 0.25, 1.0, 1.0,
                   logit_cap=cap, sinks=sinks)
                outs.append(o)
            _close(self, outs[1], outs[0], 2e-3, f"hq={hq} hkv={hkv} cap={cap} sinks={sinks is not None}")


TestUnderTritonInterpreter = triton_subprocess_case(__file__, SELECT, skip=_IN_INTERP or not SGLANG_INSTALLED)


class TestVerifyBridgeRouting(unittest.TestCase):
    """The calls the torch versions do not cover stay on SGLang's kernels."""

    def test_supported(self):
        from sglang_mamba_ext.plugin.cpu_kernels_verify import decode_attention_supported, verify_supported

        pool = torch.zeros(2, 1, 2, 2)
        self.assertTrue(verify_supported(initial_state_source=pool, intermediate_states_buffer=torch.zeros(1, 2, 1, 2, 2)))
        self.assertFalse(verify_supported(initial_state_source=pool, cache_ring=True))
        self.assertFalse(verify_supported(initial_state_source=pool, match_cutedsl_decode=True))
        self.assertFalse(verify_supported(initial_state_source=None))
        q, kv = torch.zeros(1, 2, 4), torch.zeros(3, 1, 4)
        args = (q, kv, kv, torch.zeros(1, 2, 4), torch.tensor([0, 1]), torch.tensor([0]))
        self.assertTrue(decode_attention_supported(*args))
        self.assertFalse(decode_attention_supported(*args, page_size=16))
        self.assertFalse(decode_attention_supported(q, kv.unsqueeze(0), kv, *args[3:]))

    def test_bridge_keeps_unsupported_calls_on_sglang(self):
        from sglang_mamba_ext.plugin.cpu_bridges import ACTIVE_ENV, VERIFY_KERNEL, make_kernel_around

        around = make_kernel_around(VERIFY_KERNEL)
        calls = []
        with mock.patch.dict(os.environ, {ACTIVE_ENV: "1"}), mock.patch("torch.cuda.is_available", return_value=False):
            around(lambda *a, **k: calls.append("sglang"), q=torch.zeros(1, 1, 1, 2),
                   initial_state_source=torch.zeros(1, 1, 2, 2), cache_ring=True)
        self.assertEqual(calls, ["sglang"])


if __name__ == "__main__":
    unittest.main()
