"""plugin/cpu_bridges_glm5_next.py: GLM-5-Next on CPU (issue 40). Its served check is
``tests/e2e/test_family_glm5_next_serving.py::TestGlm5NextServing`` (opt-in)."""

import importlib.util
import os
import unittest
from types import SimpleNamespace
from unittest import mock

import torch
import torch.nn.functional as F

from sglang_mamba_ext.plugin import cpu_bridges, cpu_bridges_glm5_next as g5, cpu_bridges_moe

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None
ARCH = "Glm5NextForConditionalGeneration"


def _sglang_file(*parts):
    spec = importlib.util.find_spec("sglang")
    path = os.path.join(os.path.dirname(spec.origin), *parts)
    with open(path, encoding="utf-8") as f:
        return f.read()


def _config(topk=4096, positions=4096, arch=ARCH, nested=True):
    """A GLM-5-Next config as SGLang's ``Glm5NextConfig`` exposes it (the text fields copied to the
    top level, ``configs/glm5_next.py``), or the text config alone (``nested`` False)."""
    text = SimpleNamespace(architectures=[arch], index_topk=topk, max_position_embeddings=positions)
    if not nested:
        return text
    return SimpleNamespace(architectures=[arch], index_topk=topk, max_position_embeddings=positions, text_config=text)


class TestDsaAsDenseMla(unittest.TestCase):
    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_gap_present_upstream(self):
        """SGLang still calls every GLM-5-Next config with an ``index_topk`` DSA and resolves DSA's
        backends by asking CUDA for the device generation, with no CPU branch."""
        src = _sglang_file("srt", "configs", "model_config.py")
        self.assertIn('"Glm5NextForConditionalGeneration",\n', src)
        self.assertIn('and _hf_attr(config, "index_topk") is not None', src)
        overrides = _sglang_file("srt", "arg_groups", "overrides.py")
        for fn in ("def _dsa_kv_cache_dtype_default(", "def _dsa_split_backend_resolution("):
            body = overrides.split(fn, 1)[1].split("\ndef ", 1)[0]
            self.assertIn("major, _ = torch.cuda.get_device_capability()", body)
            self.assertNotIn("is_cpu", body)
        if not torch.cuda.is_available():
            with self.assertRaises(Exception):
                torch.cuda.get_device_capability()

    def test_dense_within_topk(self):
        self.assertTrue(g5.dense_within_topk(_config()))
        self.assertTrue(g5.dense_within_topk(_config(nested=False)))
        self.assertTrue(g5.dense_within_topk(_config(topk=8192)))
        self.assertFalse(g5.dense_within_topk(_config(positions=4097)))
        self.assertFalse(g5.dense_within_topk(_config(topk=2048, positions=1013760)))  # the released sizes
        self.assertFalse(g5.dense_within_topk(_config(topk=None)))
        self.assertFalse(g5.dense_within_topk(_config(arch="DeepseekV32ForCausalLM")))
        self.assertFalse(g5.dense_within_topk(_config(arch="GlmMoeDsaForCausalLM")))
        self.assertTrue(g5.dense_within_topk(_config(arch="Glm5NextForConditionalGenerationNextN")))
        # a dict (SGLang's helpers take either) and the text config's fields first
        self.assertTrue(g5.dense_within_topk({"architectures": [ARCH], "index_topk": 64, "max_position_embeddings": 64}))
        top = _config()
        top.text_config.max_position_embeddings = 8192
        self.assertFalse(g5.dense_within_topk(top))
        # k-pools: dense only with the incomplete tail always selected (transformers' default)
        base = {"architectures": [ARCH], "index_topk": 64, "max_position_embeddings": 64}
        self.assertTrue(g5.dense_within_topk({**base, "index_kpool": 16}))
        self.assertTrue(g5.dense_within_topk({**base, "index_kpool": 16, "index_kpool_always_select_tail": True}))
        self.assertFalse(g5.dense_within_topk({**base, "index_kpool": 16, "index_kpool_always_select_tail": False}))
        self.assertTrue(g5.dense_within_topk({**base, "index_kpool": 1, "index_kpool_always_select_tail": False}))

    def test_hook_answers_false_only_on_an_active_process_for_a_fitting_config(self):
        def original(config):
            return config.index_topk is not None

        with mock.patch.object(cpu_bridges, "active", return_value=False):
            self.assertIs(g5.is_deepseek_dsa_around(original, _config()), True)
        with mock.patch.object(cpu_bridges, "active", return_value=True):
            self.assertIs(g5.is_deepseek_dsa_around(original, _config()), False)
            self.assertIs(g5.is_deepseek_dsa_around(original, _config(nested=False)), False)
            self.assertIs(g5.is_deepseek_dsa_around(original, _config(positions=1 << 20)), True)
            self.assertIs(g5.is_deepseek_dsa_around(original, _config(arch="DeepseekV32ForCausalLM")), True)
            self.assertIs(g5.is_deepseek_dsa_around(original, _config(topk=None)), False)  # SGLang's False


class TestClampedSwiglu(unittest.TestCase):
    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_gap_present_upstream(self):
        """SGLang's dense MLP still sends a ``swiglu_limit`` to the JIT CUDA kernel off ROCm / NPU,
        and its CPU MoE path still has no clamp."""
        mlp = _sglang_file("srt", "models", "deepseek_v2.py")
        self.assertIn("silu_and_mul_clamp(gate_up, x, float(self.swiglu_limit))", mlp)
        kernel = _sglang_file("kernels", "ops", "activation", "silu_and_mul_clamp.py")
        self.assertIn("module = _jit_silu_and_mul_clamp_module(input.dtype)", kernel)
        native = _sglang_file("srt", "layers", "moe", "fused_moe_native.py")
        self.assertIn("def moe_forward_native(", native)
        self.assertNotIn("swiglu_limit", native)

    def test_clamped_silu_mul_values(self):
        gate_up = torch.tensor([[12.0, -1.0, 3.0, 20.0, -0.5, -30.0]])
        got = g5.clamped_silu_mul(gate_up, 10.0)
        gate = torch.tensor([10.0, -1.0, 3.0])
        up = torch.tensor([10.0, -0.5, -10.0])
        want = (F.silu(gate) * up).unsqueeze(0)
        self.assertEqual(got.dtype, torch.float32)
        self.assertTrue(torch.equal(got, want), (got, want))

    def test_dense_kernel_stand_in_clamps_in_bfloat16(self):
        """1.001 is not a bfloat16: the kernel's clamp reads it as 1.0 (its bfloat16 rounding)."""
        gate_up = torch.tensor([[1.001, 12.0, 2.0, -11.0]], dtype=torch.float16)
        out = torch.full((1, 2), float("nan"), dtype=torch.float16)

        def kernel(*args, **kwargs):
            raise AssertionError("SGLang's kernel must not run for a CPU tensor")

        with mock.patch.object(cpu_bridges, "active", return_value=True):
            self.assertIsNone(g5.silu_and_mul_clamp_around(kernel, gate_up, out, 10.0))
        gate = torch.tensor([1.0, 10.0])  # bfloat16(1.001) == 1.0; 12 clamped to 10
        up = torch.tensor([2.0, -10.0])
        want = (F.silu(gate) * up).to(torch.float16).unsqueeze(0)
        self.assertTrue(torch.equal(out, want), (out, want))
        calls = []
        with mock.patch.object(cpu_bridges, "active", return_value=False):
            g5.silu_and_mul_clamp_around(lambda *a: calls.append(a), gate_up, out, 10.0)
        self.assertEqual(len(calls), 1)

    def test_experts_with_the_clamp(self):
        gen = torch.Generator().manual_seed(0)
        E, H, I, T = 3, 8, 4, 5
        x = torch.randn(T, H, generator=gen) * 4
        w13 = torch.randn(E, 2 * I, H, generator=gen)
        w2 = torch.randn(E, H, I, generator=gen)
        topk_ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1], [2, 0]])
        topk_weights = torch.rand(T, 2, generator=gen)
        got = g5.clamped_swiglu_experts(x, w13, w2, topk_weights, topk_ids, 10.0)
        want = torch.zeros(T, H)
        for t in range(T):
            for s in range(2):
                e = int(topk_ids[t, s])
                gu = w13[e] @ x[t]
                h = F.silu(gu[:I].clamp(max=10.0)) * gu[I:].clamp(-10.0, 10.0)
                want[t] += topk_weights[t, s] * (w2[e] @ h)
        self.assertGreater(float((w13 @ x.T).abs().max()), 10.0)  # the clamp bites
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)

    def test_moe_native_takes_the_clamped_experts_only_with_a_limit(self):
        x = torch.randn(2, 8)
        layer = SimpleNamespace(w13_weight=torch.randn(2, 8, 8), w2_weight=torch.randn(2, 8, 4))
        topk = (torch.ones(2, 1), torch.tensor([[0], [1]]), None)

        def cfg(limit):
            return SimpleNamespace(activation="silu", is_gated=True, apply_router_weight_on_input=False,
                                   gemm1_alpha=None, swiglu_limit=limit)

        def original(*args, **kwargs):
            return "sglang"

        with mock.patch.object(cpu_bridges, "active", return_value=True):
            self.assertEqual(cpu_bridges_moe.moe_native_around(original, layer, x, topk, cfg(None)), "sglang")
            got = cpu_bridges_moe.moe_native_around(original, layer, x, topk, cfg(10.0))
        self.assertTrue(torch.equal(got, g5.clamped_swiglu_experts(x, layer.w13_weight, layer.w2_weight, *topk[:2], 10.0)))
        with mock.patch.object(cpu_bridges, "active", return_value=False):
            self.assertEqual(cpu_bridges_moe.moe_native_around(original, layer, x, topk, cfg(10.0)), "sglang")


class TestHyperConnections(unittest.TestCase):
    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_gap_present_upstream(self):
        """SGLang's mHC still dispatches to TileLang by default (the torch paths only with the
        variables off), and the TileLang pre still asserts bfloat16 first."""
        mhc = _sglang_file("kernels", "ops", "layernorm", "mhc.py")
        self.assertIn("return envs.SGLANG_OPT_USE_TILELANG_MHC_PRE.get() and not is_hip()", mhc)
        self.assertIn("return envs.SGLANG_OPT_USE_TILELANG_MHC_POST.get() and not is_hip()", mhc)
        self.assertIn("    if not _use_tilelang_mhc_pre():\n        post_mix, comb_mix, layer_input = _mhc_pre_torch(", mhc)
        self.assertIn("    if not _use_tilelang_mhc_post():\n        return _mhc_post_torch(", mhc)
        self.assertIn("assert residual.dtype == torch.bfloat16", mhc.split("def mhc_pre(", 1)[1])
        environ = _sglang_file("srt", "environ.py")
        for name in ("SGLANG_OPT_USE_TILELANG_MHC_PRE", "SGLANG_OPT_USE_TILELANG_MHC_POST",
                     "SGLANG_OPT_FUSE_MHC_POST_PRE"):
            self.assertIn(f"    {name} = EnvBool(True)", environ)
        model = _sglang_file("srt", "models", "glm5_next.py")
        self.assertIn("if is_cross_layer_mhc_fusion_enabled()", model)

    def test_false_only_on_an_active_process(self):
        calls = []

        def original():
            calls.append(1)
            return True

        with mock.patch.object(cpu_bridges, "active", return_value=True):
            self.assertIs(g5.no_tilelang_on_cpu_around(original), False)
        self.assertEqual(calls, [])
        with mock.patch.object(cpu_bridges, "active", return_value=False):
            self.assertIs(g5.no_tilelang_on_cpu_around(original), True)
        self.assertEqual(calls, [1])

    def test_registered_targets(self):
        seen = []
        registry = SimpleNamespace(register=lambda target, fn, kind: seen.append((target, fn, kind)))
        g5.register_glm5_next_bridges(registry, SimpleNamespace(AROUND="around"))
        self.assertEqual([(t, f.__name__, k) for t, f, k in seen], [
            ("sglang.srt.configs.model_config.is_deepseek_dsa", "is_deepseek_dsa_around", "around"),
            ("sglang.kernels.ops.activation.silu_and_mul_clamp.silu_and_mul_clamp", "silu_and_mul_clamp_around",
             "around"),
            ("sglang.kernels.ops.layernorm.mhc._use_tilelang_mhc_pre", "no_tilelang_on_cpu_around", "around"),
            ("sglang.kernels.ops.layernorm.mhc._use_tilelang_mhc_post", "no_tilelang_on_cpu_around", "around"),
            ("sglang.srt.models.deepseek_common.amd.deepseek_v4_fused_mhc.is_cross_layer_mhc_fusion_enabled",
             "no_tilelang_on_cpu_around", "around"),
        ])


if __name__ == "__main__":
    unittest.main()
