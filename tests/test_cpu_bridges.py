"""CPU bridges for SGLang's own hybrid model classes (``sglang_mamba_ext.plugin.cpu_bridges``).

Each bridge has a test showing SGLang's gap on this host (so it fails, and the bridge can be
dropped, once SGLang closes the gap) and one showing the bridge gets past it; the bridges act
only with ``SGLANG_MAMBA_EXT_CPU_BRIDGES=1`` on a host without CUDA."""

import os
import unittest
from unittest import mock

import torch

from conftest import SGLANG_INSTALLED
from sglang_mamba_ext.testing.spec_pair import triton_subprocess_case

NO_CUDA = not torch.cuda.is_available()
_IN_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
SELECT = "TestMamba2KernelInterpreted"


def _bridges_on():
    from sglang_mamba_ext.plugin.cpu_bridges import ACTIVE_ENV

    return mock.patch.dict(os.environ, {ACTIVE_ENV: "1"})


@unittest.skipUnless(SGLANG_INSTALLED and NO_CUDA, "needs SGLang on a host without CUDA")
class TestCausalConvNames(unittest.TestCase):
    """gap 6: ``layers/attention/mamba/mamba.py`` binds ``causal_conv1d_*`` only on CUDA / NPU / XPU."""

    def setUp(self):
        import importlib

        self.mamba = importlib.import_module("sglang.srt.layers.attention.mamba.mamba")
        from sglang_mamba_ext.plugin.cpu_bridges import CAUSAL_CONV_NAMES

        saved = {n: getattr(self.mamba, n) for n in CAUSAL_CONV_NAMES if hasattr(self.mamba, n)}

        def restore():
            for n in CAUSAL_CONV_NAMES:
                if n in saved:
                    setattr(self.mamba, n, saved[n])
                elif hasattr(self.mamba, n):
                    delattr(self.mamba, n)

        self.addCleanup(restore)
        for n in CAUSAL_CONV_NAMES:  # as SGLang leaves them here, even if a bridge ran before
            if hasattr(self.mamba, n):
                delattr(self.mamba, n)

    def test_gap_present_upstream(self):
        import sglang.srt.layers.attention.mamba.mamba as m

        src = open(m.__file__).read()
        self.assertIn("if is_cuda():\n    from sglang.kernels.ops.mamba.causal_conv1d_triton import", src)
        self.assertNotIn("\nelse:\n    from sglang.kernels.ops.mamba.causal_conv1d_triton", src)

    def test_bridge_binds_the_triton_kernels(self):
        from sglang.kernels.ops.mamba import causal_conv1d_triton as ct

        from sglang_mamba_ext.plugin.cpu_bridges import bind_causal_conv

        self.assertFalse(hasattr(self.mamba, "causal_conv1d_fn"))
        self.assertEqual(sorted(bind_causal_conv()), sorted(
            ["causal_conv1d_fn", "causal_conv1d_fn_triton", "causal_conv1d_update", "causal_conv1d_update_triton"]))
        self.assertIs(self.mamba.causal_conv1d_fn, ct.causal_conv1d_fn)
        self.assertIs(self.mamba.causal_conv1d_update_triton, ct.causal_conv1d_update)
        self.assertEqual(bind_causal_conv(), [])  # idempotent


@unittest.skipUnless(SGLANG_INSTALLED and NO_CUDA, "needs SGLang on a host without CUDA")
class TestDeviceModule(unittest.TestCase):
    """gaps 2 and 7: ``torch.get_device_module()`` is ``torch.cuda`` without a driver
    (``models/qwen3_next.py``), ``torch.cpu`` has no ``device`` context (Mamba2 SSD kernels)."""

    def test_gap_present_in_torch(self):
        self.assertFalse(hasattr(torch.get_device_module(torch.device("cpu")), "device"))
        with self.assertRaises((RuntimeError, AssertionError, AttributeError)):
            torch.get_device_module().current_device()

    def test_scoped_cpu_device_module(self):
        from sglang_mamba_ext.plugin.cpu_bridges import cpu_device_module

        original = torch.get_device_module
        with cpu_device_module():
            self.assertEqual(torch.get_device_module().current_device(), "cpu")
            with torch.get_device_module(torch.device("cpu")).device(None):
                pass
            with cpu_device_module():  # re-entrant
                self.assertIsNot(torch.get_device_module, original)
            self.assertEqual(torch.get_device_module("cpu").synchronize, torch.cpu.synchronize)
        self.assertIs(torch.get_device_module, original)

    def test_around_hook_is_inert_without_the_variable(self):
        from sglang_mamba_ext.plugin import cpu_bridges

        seen = []

        def call():
            seen.append(torch.get_device_module())
            return 7

        with mock.patch.dict(os.environ, {cpu_bridges.ACTIVE_ENV: "0"}):
            with self.assertRaises((RuntimeError, AssertionError)):
                cpu_bridges.device_module_around(lambda: torch.get_device_module().current_device())
        with _bridges_on():
            self.assertEqual(cpu_bridges.device_module_around(call), 7)
        self.assertIs(seen[0], cpu_bridges.CPU_DEVICE_MODULE)

    def test_qwen3_next_norm_builds(self):
        """The layer's own call: ``FusedRMSNormGated(..., device=torch.get_device_module().current_device())``."""
        from sglang.kernels.ops.attention.fla.fused_norm_gate import FusedRMSNormGated

        from sglang_mamba_ext.plugin.cpu_bridges import cpu_device_module

        with cpu_device_module():
            norm = FusedRMSNormGated(16, eps=1e-6, activation="silu",
                                device=torch.get_device_module().current_device(), dtype=torch.float16)
        self.assertEqual(norm.weight.device.type, "cpu")


@unittest.skipUnless(SGLANG_INSTALLED and NO_CUDA, "needs SGLang on a host without CUDA")
class TestRotary(unittest.TestCase):
    """gap 3: ``layers/rotary_embedding/base.py`` imports ``vllm._custom_ops`` on this host."""

    ARGS = dict(head_size=16, rotary_dim=16, max_position_embeddings=64, base=10000, is_neox_style=True,
                dtype=torch.float32)

    def _init(self):
        from sglang.srt.layers.rotary_embedding.base import RotaryEmbedding

        init = getattr(RotaryEmbedding.__init__, "__wrapped__", RotaryEmbedding.__init__)
        return RotaryEmbedding, init

    def test_gap_present_upstream(self):
        cls, init = self._init()
        with self.assertRaisesRegex(ImportError, "vllm"):
            init(cls.__new__(cls), **self.ARGS)

    def test_bridge_builds_a_native_rope(self):
        from sglang_mamba_ext.plugin import cpu_bridges

        cls, init = self._init()
        rope = cls.__new__(cls)
        with _bridges_on():
            cpu_bridges.rope_init_around(init, rope, **self.ARGS)
        self.assertFalse(rope.use_fallback_kernel)
        import sglang.srt.layers.rotary_embedding.base as base

        self.assertFalse(base._is_cpu)  # restored
        pos = torch.arange(5)
        q, k = torch.randn(5, 4 * 16), torch.randn(5, 2 * 16)
        q2, k2 = rope.forward_native(pos, q.clone(), k.clone())
        self.assertTrue(torch.isfinite(q2).all() and not torch.equal(q2[1:], q[1:]))
        torch.testing.assert_close(q2[0], q[0])  # position 0 is the identity


@unittest.skipUnless(SGLANG_INSTALLED and NO_CUDA, "needs SGLang on a host without CUDA")
class TestGatedNormRows(unittest.TestCase):
    """Qwen3.5's gated RMSNorm (``kernels/ops/attention/fla/layernorm_gated.py``) sizes its
    row blocks by ``torch.cuda.get_device_properties(...).multi_processor_count``."""

    def _sm_count(self):
        import sglang.kernels.ops.attention.fla.layernorm_gated as ln

        fn = getattr(ln._get_sm_count, "__wrapped__", ln._get_sm_count)
        return getattr(fn, "__wrapped__", fn)  # the hook's wrapper, then lru_cache's

    def test_gap_present_upstream(self):
        with self.assertRaises((RuntimeError, AssertionError)):
            self._sm_count()(torch.device("cpu"))

    def test_bridge_answers_the_core_count_for_cpu_only(self):
        from sglang_mamba_ext.plugin import cpu_bridges

        calls = []

        def original(device):
            calls.append(device)
            return 132

        with _bridges_on():
            self.assertEqual(cpu_bridges.sm_count_around(original, torch.device("cpu")), os.cpu_count())
            self.assertEqual(cpu_bridges.sm_count_around(original, torch.device("xpu", 0)), 132)
        self.assertEqual(cpu_bridges.sm_count_around(original, torch.device("cpu")), 132)  # bridges off
        self.assertEqual(len(calls), 2)


@unittest.skipUnless(SGLANG_INSTALLED and NO_CUDA and _IN_INTERP,
                     "needs SGLang, no CUDA and TRITON_INTERPRET=1 (run by TestUnderTritonInterpreter)")
class TestMamba2KernelInterpreted(unittest.TestCase):
    """gaps 4 and 7: a Mamba2 SSD kernel launch (``ssd_chunk_state.py::_chunk_cumsum_fwd``)
    on CPU under Triton's interpreter stops at ``torch.cpu.device``; with the bridges
    (interpreter shims over the Mamba2 modules, CPU device module) it runs and equals the
    torch reference (softplus(dt + bias), clamped, times A, summed within each chunk)."""

    def _inputs(self):
        g = torch.Generator().manual_seed(0)
        dt = torch.randn(1, 70, 4, generator=g)
        A = -torch.rand(4, generator=g) - 0.5
        bias = torch.randn(4, generator=g) * 0.1
        return dt, A, bias

    def test_a_shims_needed(self):
        """Runs first (alphabetical order), before the shims patch Triton in this process:
        with the device module alone, Triton's autotuner looks for a GPU driver."""
        from sglang.kernels.ops.mamba.triton_ops.ssd_chunk_state import _chunk_cumsum_fwd

        from sglang_mamba_ext.plugin import triton_interpret
        from sglang_mamba_ext.plugin.cpu_bridges import cpu_device_module

        if triton_interpret._installed:
            self.skipTest("the shims were installed earlier in this process")
        dt, A, bias = self._inputs()
        with cpu_device_module(), self.assertRaisesRegex(RuntimeError, "active drivers"):
            _chunk_cumsum_fwd(dt, A, 64, dt_bias=bias, dt_softplus=True)

    def test_gap_present_upstream(self):
        from sglang.kernels.ops.mamba.triton_ops.ssd_chunk_state import _chunk_cumsum_fwd

        dt, A, bias = self._inputs()
        with self.assertRaisesRegex(AttributeError, "device"):
            _chunk_cumsum_fwd(dt, A, 64, dt_bias=bias, dt_softplus=True)

    def test_bridged_kernel_matches_torch(self):
        from sglang.kernels.ops.mamba.triton_ops.ssd_chunk_state import _chunk_cumsum_fwd

        from sglang_mamba_ext.plugin import cpu_bridges

        with _bridges_on():
            self.assertTrue(cpu_bridges.install_model_bridges()["shims"])
            dA, dt_out = cpu_bridges.device_module_around(_chunk_cumsum_fwd, *self._inputs()[:2], 64,
                                                          dt_bias=self._inputs()[2], dt_softplus=True)
        dt, A, bias = self._inputs()
        ref_dt = torch.nn.functional.softplus(dt + bias)  # [1, T, H]
        padded = torch.zeros(1, 128, 4)
        padded[:, :70] = ref_dt
        ref_dt = padded.view(1, 2, 64, 4).permute(0, 3, 1, 2)  # [1, H, chunks, chunk]
        ref_dA = torch.cumsum(ref_dt * A[None, :, None, None], dim=-1)
        torch.testing.assert_close(dt_out[:, :, 0], ref_dt[:, :, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dA[:, :, 0], ref_dA[:, :, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dA[:, :, 1, :6], ref_dA[:, :, 1, :6], rtol=1e-5, atol=1e-5)


TestUnderTritonInterpreter = triton_subprocess_case(__file__, SELECT, skip=_IN_INTERP or not SGLANG_INSTALLED)


@unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
class TestTorchNativeMLA(unittest.TestCase):
    """gap 5: SGLang's MLA handler registry has no ``torch_native`` entry, so the ``triton``
    handler answers (the MHA path for a prefill without prefix, which torch_native cannot
    serve from the latent pool)."""

    def setUp(self):
        from sglang.srt.models.deepseek_common import attention_backend_handler as h

        self.registry = h.AttentionBackendRegistry
        saved = dict(self.registry._handlers)
        self.addCleanup(lambda: (self.registry._handlers.clear(), self.registry._handlers.update(saved)))
        self.registry._handlers.pop("torch_native", None)

    def test_gap_present_upstream(self):
        self.assertIs(self.registry.get_handler("torch_native"), self.registry.get_handler("triton"))

    def test_bridge_answers_absorbed_mla(self):
        from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

        from sglang_mamba_ext.plugin.cpu_bridges import register_torch_native_mla

        self.assertTrue(register_torch_native_mla())
        self.assertFalse(register_torch_native_mla())
        self.assertEqual(self.registry.get_handler("torch_native")(object(), object()), AttnForwardMethod.MLA)


@unittest.skipUnless(SGLANG_INSTALLED and NO_CUDA, "needs SGLang on a host without CUDA")
class TestNoAttentionHeads(unittest.TestCase):
    """issue 40: ``configs/update_config.py::adjust_config_with_unaligned_cpu_tp`` (every CPU model
    load) computes ``num_attention_heads % tp_size``; a pure Mamba2 model has no heads (None)."""

    class _Config:
        num_attention_heads = None
        hf_config = hf_text_config = object()
        quantization = None

        def get_total_num_kv_heads(self):
            return 0

    def _original(self):
        import sglang.srt.configs.update_config as uc

        return getattr(uc.adjust_config_with_unaligned_cpu_tp, "__wrapped__", uc.adjust_config_with_unaligned_cpu_tp)

    def test_gap_present_upstream(self):
        from sglang.srt.configs.load_config import LoadConfig

        with mock.patch("sglang.srt.configs.update_config.update_config"), \
                mock.patch("sglang.srt.configs.update_config.may_get_weight_block_size", return_value=None):
            with self.assertRaises(TypeError):
                self._original()(self._Config(), LoadConfig(), 1)

    def test_bridge_returns_the_config_at_one_rank_only(self):
        from sglang_mamba_ext.plugin import cpu_bridges

        calls = []

        def original(model_config, load_config, tp_size):
            calls.append(tp_size)
            return "padded"

        cfg = self._Config()
        with _bridges_on():
            self.assertIs(cpu_bridges.cpu_tp_config_around(original, cfg, None, 1), cfg)
            self.assertEqual(cpu_bridges.cpu_tp_config_around(original, cfg, None, 2), "padded")
            with_heads = self._Config()
            with_heads.num_attention_heads = 4
            self.assertEqual(cpu_bridges.cpu_tp_config_around(original, with_heads, None, 1), "padded")
        self.assertEqual(cpu_bridges.cpu_tp_config_around(original, cfg, None, 1), "padded")  # bridges off
        self.assertEqual(calls, [2, 1, 1])


class TestMmOutDtype(unittest.TestCase):
    """issue 40: Nemotron-H's MoE router (``models/nemotron_h.py:389``) calls
    ``torch.mm(..., out_dtype=torch.float32)``, which torch implements for CUDA only."""

    def setUp(self):
        g = torch.Generator().manual_seed(0)
        self.a = torch.randn(3, 8, generator=g).half()
        self.b = torch.randn(5, 8, generator=g).half()

    @unittest.skipUnless(NO_CUDA, "a host without CUDA")
    def test_gap_present_in_torch(self):
        with self.assertRaises((NotImplementedError, RuntimeError)):
            torch.mm(self.a, self.b.t(), out_dtype=torch.float32)

    def test_bridge_float32_product_scoped(self):
        from sglang_mamba_ext.plugin import cpu_bridges

        before = torch.mm
        with cpu_bridges.cpu_mm_out_dtype():
            with cpu_bridges.cpu_mm_out_dtype():  # re-entrant
                got = torch.mm(self.a, self.b.t(), out_dtype=torch.float32)
            plain = torch.mm(self.a, self.b.t())
        self.assertIs(torch.mm, before)
        self.assertEqual(got.dtype, torch.float32)
        torch.testing.assert_close(got, self.a.float() @ self.b.float().t())
        self.assertEqual(plain.dtype, torch.float16)


class TestRelu2Experts(unittest.TestCase):
    """issue 40: SGLang's CPU MoE path (``layers/moe/fused_moe_native.py:97``) has no non-gated
    ReLU² experts (Nemotron-H's MoE blocks)."""

    def _case(self):
        g = torch.Generator().manual_seed(1)
        x = torch.randn(7, 16, generator=g)
        w13, w2 = torch.randn(4, 8, 16, generator=g), torch.randn(4, 16, 8, generator=g)
        ids = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 3], [1, 0], [2, 1], [0, 3]])
        weights = torch.rand(7, 2, generator=g)
        return x, w13, w2, weights, ids

    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_gap_present_upstream(self):
        from types import SimpleNamespace

        from sglang.srt.layers.moe.fused_moe_native import moe_forward_native

        x, w13, w2, weights, ids = self._case()
        layer = SimpleNamespace(num_experts=4, w13_weight=w13, w2_weight=w2)
        cfg = SimpleNamespace(activation="relu2", is_gated=False, apply_router_weight_on_input=False,
                              gemm1_alpha=None, gemm1_clamp_limit=None)
        fn = getattr(moe_forward_native, "__wrapped__", moe_forward_native)
        with self.assertRaisesRegex(ValueError, "Unsupported activation"):
            fn(layer, x, (weights, ids, None), cfg)

    def test_matches_a_per_token_loop(self):
        from sglang_mamba_ext.plugin.cpu_bridges_moe import relu2_experts

        x, w13, w2, weights, ids = self._case()
        want = torch.zeros(7, 16)
        for t in range(7):
            for k in range(2):
                e = int(ids[t, k])
                want[t] += weights[t, k] * (w2[e] @ torch.relu(w13[e] @ x[t]) ** 2)
        torch.testing.assert_close(relu2_experts(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-4)


@unittest.skipUnless(SGLANG_INSTALLED and NO_CUDA, "needs SGLang on a host without CUDA")
class TestLingRotary(unittest.TestCase):
    """issue 40, Ling 2.5 (``models/bailing_moe_linear.py``): on CPU every rotary embedding is
    DeepSeek's YaRN (``rotary_embedding/factory.py:478-481``), whose native forward mishandles a
    flat ``[T, heads * head]`` query (``rope_variant.py:471-503``); and ``DsV3MLA`` pins its rotary
    to ``forward_cuda`` (``bailing_moe_linear.py:107-111``)."""

    def _rope(self, rotary_dim=16):
        import sglang.srt.layers.rotary_embedding.base as base
        from sglang.srt.layers.rotary_embedding.rope_variant import DeepseekScalingRotaryEmbedding

        with mock.patch.object(base, "_is_cpu", True):  # as the rotary bridge builds it (gap 3)
            return DeepseekScalingRotaryEmbedding(16, rotary_dim, 4096, 10000, True, 1.0, torch.float32, beta_fast=32,
                                                  beta_slow=1, mscale=1.0, mscale_all_dim=1.0, device="cpu")

    def test_flat_query_gap_and_bridge(self):
        from sglang_mamba_ext.plugin import cpu_bridges

        g = torch.Generator().manual_seed(0)
        pos = torch.tensor([0, 3, 7, 100])
        native = lambda rope, *a: type(rope).forward_native.__wrapped__(rope, *a) if hasattr(  # noqa: E731
            type(rope).forward_native, "__wrapped__") else rope.forward_native(*a)
        for rd in (16, 8):
            rope = self._rope(rd)
            q, k = torch.randn(4, 2 * 16, generator=g), torch.randn(4, 2 * 16, generator=g)
            with _bridges_on():
                fq, fk = cpu_bridges.deepseek_rope_flat_around(
                    lambda *a: self.fail("a flat query went to SGLang"), rope, pos, q, k)
            self.assertEqual(fq.shape, q.shape)
            self.assertEqual(fk.shape, k.shape)
            if rd == 16:
                # SGLang's own forward: wrong shape for the flat query, right per head ([T, heads, rot])
                self.assertNotEqual(tuple(native(rope, pos, q, k)[0].shape), tuple(q.shape))
                wq, wk = native(rope, pos, q.reshape(4, 2, 16), k.reshape(4, 2, 16))
                torch.testing.assert_close(fq, wq.reshape(4, 32))
                torch.testing.assert_close(fk, wk.reshape(4, 32))
            else:  # partial rotary: the pass-through half of each head unchanged
                torch.testing.assert_close(fq.reshape(4, 2, 16)[..., 8:], q.reshape(4, 2, 16)[..., 8:])
                self.assertFalse(torch.equal(fq.reshape(4, 2, 16)[1:, :, :8], q.reshape(4, 2, 16)[1:, :, :8]))

    def test_mla_forward_cuda_pin_dropped(self):
        from sglang_mamba_ext.plugin import cpu_bridges

        class Mla:
            def __init__(self, rope):
                self.rotary_emb = rope
                rope.forward = rope.forward_cuda  # what DsV3MLA.__init__ does with rope scaling

        mla = Mla.__new__(Mla)
        with _bridges_on():
            cpu_bridges.dsv3_mla_init_around(Mla.__init__, mla, self._rope())
        self.assertNotIn("forward", mla.rotary_emb.__dict__)


@unittest.skipUnless(SGLANG_INSTALLED and NO_CUDA, "needs SGLang on a host without CUDA")
class TestRopeCpuTypes(unittest.TestCase):
    """issue 40: ``layers/rotary_embedding/factory.py::get_rope_cpu`` (MLA's rotary embedding on
    CPU, ``models/deepseek_v2.py:2167``) asserts DeepSeek's YaRN (``factory.py:478-481``); Ling-V3's
    VLM gives its MLA M-RoPE of type ``default``, other checkpoints no scaling at all."""

    def _original(self):
        import sglang.srt.layers.rotary_embedding.factory as factory

        return getattr(factory.get_rope_cpu, "__wrapped__", factory.get_rope_cpu)

    def test_gap_present_upstream(self):
        for scaling in (None, {"rope_type": "default", "rope_theta": 10000.0}):
            with self.subTest(scaling=scaling), self.assertRaises(AssertionError):
                self._original()(8, 8, 4096, 10000, False, scaling, torch.float16, 1.0, "cpu")

    def test_bridge_builds_other_types_and_leaves_yarn_to_sglang(self):
        from sglang_mamba_ext.plugin import cpu_bridges

        calls = []

        def original(*args):
            calls.append(args[5])
            return "sglang's cpu rope"

        yarn = {"rope_type": "deepseek_yarn", "factor": 1.0, "original_max_position_embeddings": 4096}
        # (in a server the rotary bridge, TestRotary, keeps RotaryEmbedding's constructor off vllm)
        with _bridges_on(), mock.patch("sglang.srt.layers.rotary_embedding.base._is_cpu", True):
            for scaling in (None, {"rope_type": "default", "rope_theta": 10000.0}):
                with self.subTest(scaling=scaling):
                    rope = cpu_bridges.rope_cpu_around(original, 8, 8, 4096, 10000, False, scaling, torch.float32,
                                                       1.0, "cpu")
                    q, k = torch.randn(3, 2 * 8), torch.randn(3, 1 * 8)
                    q2, k2 = rope.forward_native(torch.arange(3), q.clone(), k.clone())
                    self.assertEqual(q2.shape, q.shape)
                    torch.testing.assert_close(q2[0], q[0])  # position 0: no rotation
                    self.assertFalse(torch.allclose(q2[2], q[2]))
            self.assertEqual(cpu_bridges.rope_cpu_around(original, 8, 8, 4096, 10000, False, yarn), "sglang's cpu rope")
        self.assertEqual(cpu_bridges.rope_cpu_around(original, 8, 8, 4096, 10000, False, None), "sglang's cpu rope")
        self.assertEqual(calls, [yarn, None])


class TestRegistration(unittest.TestCase):
    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_hooks_registered(self):
        from sglang.srt.plugins.hook_registry import HookRegistry

        from sglang_mamba_ext.plugin import cpu_bridges, cpu_bridges_moe

        cpu_bridges.register_cpu_bridges()
        for target in (cpu_bridges.MODEL_RUNNER_INIT, cpu_bridges.MAMBA_MIXER_FORWARD,
                       cpu_bridges.QWEN3_NEXT_GDN_INIT, cpu_bridges.ROPE_INIT, cpu_bridges.CPU_TP_CONFIG,
                       cpu_bridges.NEMOTRON_H_MOE_FORWARD, cpu_bridges_moe.MOE_FORWARD_NATIVE,
                       cpu_bridges.DEEPSEEK_ROPE_NATIVE, cpu_bridges.DSV3_MLA_INIT, cpu_bridges.GET_ROPE_CPU):
            self.assertTrue(HookRegistry._hooks.get(target), target)

    def test_inactive_without_variable(self):
        from sglang_mamba_ext.plugin import cpu_bridges

        with mock.patch.dict(os.environ, {cpu_bridges.ACTIVE_ENV: ""}):
            self.assertFalse(cpu_bridges.active())
        with _bridges_on():
            self.assertEqual(cpu_bridges.active(), NO_CUDA)


if __name__ == "__main__":
    unittest.main()
