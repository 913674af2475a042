"""On-chip tree verify in the deferred glue (issue 15, item 2): SGLang's real KDA and GDN
verify code (``KDAAttnBackend._forward_target_verify``, ``GDNAttnBackend.forward_extend`` on a
target-verify batch: SGLang's conv kernel, then its recurrent verify kernel) on a real
``MambaPool`` built through the pool hook, once with the one-layer node-state buffer and once
on chip (no node-state buffer): same outputs, same conv-window buffer, main states untouched,
and the on-chip launch is the one that ran; with the Triton kernels and with the torch forms
CPU serving uses. On CPU everything runs under Triton's interpreter in a fresh process
(SGLang's kernels must be imported under it too).
"""

import os
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from conftest import SGLANG_INSTALLED, requires_sglang

from sglang_mamba_ext.testing.spec_pair import triton_subprocess_case

_IN_INTERP = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
SELECT = "OnChipGlue"

if SGLANG_INSTALLED and _IN_INTERP:
    from sglang.srt.configs.mamba_utils import (
        KimiLinearCacheParams,
        KimiLinearStateShape,
        Mamba2CacheParams,
        Mamba2StateDType,
        Mamba2StateShape,
    )
    from sglang.srt.mem_cache.memory_pool import MambaPool

    from sglang_mamba_ext.plugin.speculative import hooks
    from sglang_mamba_ext.speculative import verify_onchip


def _pool(verify, layout, T, H=2, K=8, steps=4, dtype=torch.float32):
    """SGLang's MambaPool (2 linear layers, H = HV heads of K = V, W = 4) through the deferred
    pool hook with the verify variant forced."""
    dt = Mamba2StateDType(conv=dtype, temporal=dtype)
    if layout == "kda":
        shape = KimiLinearStateShape.create(tp_world_size=1, num_heads=H, head_dim=K, conv_kernel_size=4)
        cp = KimiLinearCacheParams(shape=shape, layers=[0, 1], dtype=dt)
    else:
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=H * K, n_groups=H, num_heads=H,
                                        head_dim=K, state_size=K, conv_kernel=4)
        cp = Mamba2CacheParams(shape=shape, layers=[0, 1], dtype=dt)
    pool = MambaPool.__new__(MambaPool)
    spec = SimpleNamespace(speculative_num_steps=steps, speculative_algorithm="FROZEN_KV_MTP")
    with mock.patch.object(hooks, "_server_args", return_value=SimpleNamespace(_mamba_spec_state_update="deferred")), \
            mock.patch("sglang.srt.runtime_context.get_spec", return_value=spec), \
            mock.patch.object(hooks, "_target_layout", None if layout == "kda" else layout), \
            mock.patch.dict(os.environ, {verify_onchip.VERIFY_ENV: verify}):
        hooks.mamba_pool_init_around(MambaPool.__init__, pool, size=6, spec_state_size=3, cache_params=cp,
                                     mamba_layer_ids=[0, 1], device="cpu", speculative_num_draft_tokens=T,
                                     speculative_eagle_topk=2)
    return pool


def _tree_arrays(parents_rows):
    """SGLang's retrieve_next_token / retrieve_next_sibling ([bs, T] int64) of parent lists."""
    bs, T = len(parents_rows), len(parents_rows[0])
    nt = torch.full((bs, T), -1, dtype=torch.int64)
    ns = torch.full((bs, T), -1, dtype=torch.int64)
    for r, par in enumerate(parents_rows):
        last = {}
        for i in range(1, T):
            p = par[i]
            if p in last:
                ns[r, last[p]] = i
            else:
                nt[r, p] = i
            last[p] = i
    return nt, ns


@requires_sglang
@unittest.skipUnless(_IN_INTERP, "needs CUDA or TRITON_INTERPRET=1 when SGLang's kernels are imported (see TestUnderTritonInterpreter)")
class TestOnChipGlue(unittest.TestCase):
    """The glue with the Triton kernels (on CPU: interpreted; ``SGLANG_MAMBA_EXT_CPU_KERNELS``
    ``triton``); :class:`TestOnChipGlueTorchForm`: with the torch forms CPU serving runs."""

    CPU_KERNELS = "triton"
    T = 5

    def setUp(self):
        patch = mock.patch.dict(os.environ, {hooks.CPU_KERNELS_ENV: self.CPU_KERNELS})
        patch.start()
        self.addCleanup(patch.stop)

    PARENTS = [[-1, 0, 0, 1, 1], [-1, 0, 1, 2, 3], [-1, 0, 0, 2, 3]]  # tree, chain, padding row

    def _backend(self, layout, pool, slots, parents):
        from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
        from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend
        from sglang.srt.layers.attention.linear.kernels.gdn_triton import TritonGDNKernel
        from sglang.srt.layers.attention.linear.kernels.kda_triton import TritonKDAKernel

        nt, ns = _tree_arrays(parents)
        rtp = SimpleNamespace(mamba_pool=pool, mamba_map={10: 0, 12: 1}, size=4,
                              mamba2_layer_cache=lambda layer_id: pool.mamba2_layer_cache({10: 0, 12: 1}[layer_id]))
        cls = KDAAttnBackend if layout == "kda" else GDNAttnBackend
        be = cls.__new__(cls)
        be.req_to_token_pool = rtp
        be.forward_metadata = SimpleNamespace(
            query_start_loc=torch.arange(0, len(parents) * self.T + 1, self.T, dtype=torch.int32),
            mamba_cache_indices=slots, retrieve_next_token=nt, retrieve_next_sibling=ns,
            retrieve_parent_token=torch.empty_like(nt))
        be.verify_intermediate_state_indices = torch.arange(5, dtype=torch.int32)
        kern = TritonKDAKernel() if layout == "kda" else TritonGDNKernel()
        be.kernel_dispatcher = SimpleNamespace(verify_backend=SimpleNamespace(is_nv_cutedsl=lambda: False),
                                               target_verify=kern.target_verify)
        be._fused_chain_verify_fn = None
        be.accept_lens_pool = None
        be.mis_metadata = None
        be.requires_contiguous_prefill_state = True
        be._use_strided_target_verify_qkv = False
        return be

    def _run(self, layout, verify, inputs, main):
        from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
        from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend

        T = self.T
        pool = _pool(verify, layout, T)
        pool.mamba_cache.conv[0].copy_(main[0])
        pool.mamba_cache.temporal.copy_(main[1])
        slots = torch.tensor([4, 1, 0], dtype=torch.int32)  # row 3: padding (SGLang: reserved slot 0)
        be = self._backend(layout, pool, slots, self.PARENTS)
        fb = SimpleNamespace(spec_info=SimpleNamespace(ragged_verify_layout=None, draft_token_num=T),
                             forward_mode=SimpleNamespace(is_target_verify=lambda: True),
                             req_pool_indices=torch.tensor([1, 2, 0]))
        launches = []
        real = verify_onchip.onchip_tree_verify
        outs = []
        from sglang_mamba_ext.plugin.speculative import onchip_dispatch

        with mock.patch.object(onchip_dispatch, "onchip_tree_verify", side_effect=lambda *a, **k: launches.append(1) or real(*a, **k)):
            for layer_id, (w, mq, a, b) in zip((10, 12), inputs):
                layer = SimpleNamespace(layer_id=layer_id, conv_weights=w["conv"], bias=w["bias"], A_log=w["A_log"],
                                        dt_bias=w["dt_bias"], lower_bound=None, activation="silu",
                                        q_dim=w["qk"], k_dim=w["qk"], v_dim=w["v"], head_q_dim=8, head_k_dim=8,
                                        head_v_dim=8, num_q_heads=2, num_k_heads=2, num_v_heads=2)
                with torch.no_grad():
                    if layout == "kda":
                        o = hooks.kda_target_verify_around(KDAAttnBackend._forward_target_verify, be, layer, fb,
                                                           mq, a, b.unsqueeze(0))
                    else:
                        o = hooks.gdn_forward_extend_around(GDNAttnBackend.forward_extend, be, layer, fb, mq, a, b)
                outs.append(o.reshape(3, T, 2, 8)[:2].clone())
        self.assertIsInstance(be.kernel_dispatcher, SimpleNamespace)  # the stand-in is put back after each call
        return pool, outs, len(launches), be.forward_metadata.retrieve_parent_token.clone()

    def _check(self, layout):
        torch.manual_seed(0)
        T, n = self.T, 3 * self.T
        conv_dim = 48
        gate = 16 if layout == "kda" else 2
        inputs = []
        for _ in range(2):
            w = dict(conv=torch.randn(conv_dim, 4) * 0.5, bias=torch.randn(conv_dim) * 0.1,
                     A_log=(torch.randn(1, 1, 2, 1) if layout == "kda" else torch.randn(2)) * 0.5,
                     dt_bias=torch.randn(gate), qk=16, v=16)
            inputs.append((w, torch.randn(n, conv_dim), torch.randn(n, gate), torch.randn(n, 2)))
        ref_pool = _pool("one_layer", layout, T)
        main = (torch.randn_like(ref_pool.mamba_cache.conv[0]), torch.randn_like(ref_pool.mamba_cache.temporal) * 0.3)
        buf_pool, buf_out, buf_launch, buf_par = self._run(layout, "one_layer", inputs, main)
        chip_pool, chip_out, chip_launch, chip_par = self._run(layout, "on_chip", inputs, main)
        st = chip_pool.mamba_spec_deferred
        self.assertEqual((buf_launch, chip_launch), (0, 2))  # on-chip launches only in the on-chip pool
        self.assertEqual((buf_pool.mamba_spec_deferred.verify, st.verify), ("one_layer", "on_chip"))
        self.assertIsNone(st.one_layer_ssm)
        self.assertEqual(st.nbytes()["one_layer_ssm"], 0)
        self.assertEqual(chip_pool.mamba_cache.intermediate_ssm.untyped_storage().nbytes(), 4)  # the placeholder
        self.assertEqual(buf_par[:2].tolist()[0][1:], [0, 0, 1, 1])
        for o_b, o_c in zip(buf_out, chip_out):
            self.assertGreater(float(o_b.abs().max()), 0.1)
            torch.testing.assert_close(o_c, o_b, rtol=1e-4, atol=1e-4)
        # same conv-window buffer (SGLang's conv kernel in both), main states untouched
        torch.testing.assert_close(chip_pool.mamba_spec_deferred.one_layer_conv[:2], buf_pool.mamba_spec_deferred.one_layer_conv[:2],
                                   rtol=0, atol=0)
        for pool in (buf_pool, chip_pool):
            torch.testing.assert_close(pool.mamba_cache.conv[0], main[0], rtol=0, atol=0)
            torch.testing.assert_close(pool.mamba_cache.temporal, main[1], rtol=0, atol=0)
        # the replay inputs are captured identically
        torch.testing.assert_close(st.pending_mixed_qkv, buf_pool.mamba_spec_deferred.pending_mixed_qkv, rtol=0, atol=0)

    def _tiny(self, gate, verify, x, main, mixer, spec):
        from sglang_mamba_ext.plugin.tiny_hybrid.backend import TinyHybridLinearAttnBackend

        pool = _pool(verify, "tiny-" + gate, self.T)
        pool.mamba_cache.conv[0].copy_(main[0])
        pool.mamba_cache.temporal.copy_(main[1])
        be = object.__new__(TinyHybridLinearAttnBackend)
        be.req_to_token_pool = SimpleNamespace(mamba_pool=pool, mamba_map={1: 0},
                                               mamba2_layer_cache=lambda layer_id: pool.mamba2_layer_cache(0))
        be.forward_metadata = SimpleNamespace(mamba_cache_indices=torch.tensor([4, 1, -1]))
        fb = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True), spec_info=spec)
        launches = []
        real = verify_onchip.onchip_tree_recurrence
        with torch.no_grad(), mock.patch.object(verify_onchip, "onchip_tree_recurrence",
                                                side_effect=lambda *a, **k: launches.append(1) or real(*a, **k)):
            _, graw, braw = mixer.project_raw(x)
            mixed, _, _ = mixer.project(x)
            out = be.forward_extend(layer=SimpleNamespace(layer_id=1, mixer=mixer), forward_batch=fb, mixed_qkv=mixed,
                                    a=graw, b=braw)
        return pool, out, len(launches)

    def test_tiny_backend(self):
        """The tiny backend's verify (both gates, a tree and a chain row plus a padding row):
        on chip == its torch loop over the one-layer buffer."""
        from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape

        nt, ns = _tree_arrays(self.PARENTS[:2] + [[-1, 0, 1, 2, 3]])
        spec = SimpleNamespace(draft_token_num=self.T, topk=2, retrieve_next_token=nt, retrieve_next_sibling=ns)
        for gate in ("kda", "gdn"):
            with self.subTest(gate=gate):
                torch.manual_seed(1)
                mixer = GatedDeltaRuleMixer(12, LinearAttnShape(2, 2, 8, 8, 4), gate=gate)
                with torch.no_grad():
                    mixer.A_log.normal_(0, 0.5)
                    mixer.dt_bias.normal_()
                ref = _pool("one_layer", "tiny-" + gate, self.T)
                main = (torch.randn_like(ref.mamba_cache.conv[0]), torch.randn_like(ref.mamba_cache.temporal) * 0.3)
                x = torch.randn(3 * self.T, 12)
                buf_pool, buf_out, buf_n = self._tiny(gate, "one_layer", x, main, mixer, spec)
                chip_pool, chip_out, chip_n = self._tiny(gate, "on_chip", x, main, mixer, spec)
                self.assertEqual((buf_n, chip_n), (0, 1))
                self.assertIsNone(chip_pool.mamba_spec_deferred.one_layer_ssm)
                self.assertGreater(float(buf_out.abs().max()), 0.1)
                torch.testing.assert_close(chip_out, buf_out, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(chip_pool.mamba_spec_deferred.one_layer_conv[:2],
                                           buf_pool.mamba_spec_deferred.one_layer_conv[:2], rtol=0, atol=0)
                torch.testing.assert_close(chip_pool.mamba_cache.temporal, main[1], rtol=0, atol=0)

    def test_kda(self):
        self._check("kda")

    def test_gdn(self):
        self._check("gdn")


class TestOnChipGlueTorchForm(TestOnChipGlue):
    """CPU serving's default (``plugin/speculative/hooks.py::kernel_impl``): the on-chip verify's
    torch form through the same glue, the same outputs as the one-layer buffer."""

    CPU_KERNELS = "torch"


TestUnderTritonInterpreter = triton_subprocess_case(__file__, SELECT, skip=_IN_INTERP or not SGLANG_INSTALLED)


if __name__ == "__main__":
    unittest.main()
