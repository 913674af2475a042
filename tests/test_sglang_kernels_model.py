"""The tiny model served by SGLang's own linear-attention backends (``--linear-kernels sglang``;
``docs/design.md``, "Tiny hybrid model"): its registration with SGLang, its CPU defaults, and
SGLang's chunked Gated-DeltaNet kernel run under Triton's interpreter with the plugin's shims
(``plugin/triton_interpret.py``) against fla's naive recurrence. The serving test is
``tests/e2e/test_sglang_kernels_serving.py``.
"""

import json
import os
import tempfile
import unittest
from unittest import mock

import torch

from conftest import SGLANG_INSTALLED, requires_sglang
from sglang_mamba_ext.models.tiny_builder import build_tiny_model
from sglang_mamba_ext.testing.spec_pair import triton_subprocess_case

_IN_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
SELECT = "TestSGLangGDNKernelInterpreted"


class TestBuilder(unittest.TestCase):
    def test_sglang_kernels_config(self):
        with tempfile.TemporaryDirectory() as tmp:
            build_tiny_model(os.path.join(tmp, "a"), config_overrides={"linear_gate": "gdn"}, linear_kernels="sglang")
            build_tiny_model(os.path.join(tmp, "b"), config_overrides={"linear_gate": "gdn"})
            with open(os.path.join(tmp, "a", "config.json")) as f:
                a = json.load(f)
            with open(os.path.join(tmp, "b", "config.json")) as f:
                b = json.load(f)
            with open(os.path.join(tmp, "a", "model.safetensors"), "rb") as fa, \
                    open(os.path.join(tmp, "b", "model.safetensors"), "rb") as fb:
                self.assertEqual(fa.read(), fb.read())  # same weights
        self.assertEqual((a["architectures"], a["torch_dtype"]), (["TinyHybridGDNForCausalLM"], "float16"))
        self.assertEqual((b["architectures"], b["torch_dtype"]), (["TinyHybridForCausalLM"], "float32"))
        self.assertEqual({k: v for k, v in a.items() if k not in ("architectures", "torch_dtype")},
                         {k: v for k, v in b.items() if k not in ("architectures", "torch_dtype")})

    def test_unknown_kernels_refused(self):
        with tempfile.TemporaryDirectory() as tmp, self.assertRaisesRegex(ValueError, "linear_kernels"):
            build_tiny_model(tmp, linear_kernels="cuda")


@requires_sglang
class TestRegistration(unittest.TestCase):
    def test_backend_by_architecture(self):
        from sglang.srt.configs.linear_attn_model_registry import get_linear_attn_config, get_linear_attn_spec

        from sglang_mamba_ext.plugin.tiny_hybrid import BACKEND_CLASS, register_tiny_hybrid
        from sglang_mamba_ext.plugin.tiny_hybrid.config import TinyHybridSGLangConfig

        register_tiny_hybrid()
        want = {
            "TinyHybridForCausalLM": (BACKEND_CLASS, 8),
            "TinyHybridGDNForCausalLM": ("sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend", 64),
            "TinyHybridKDAForCausalLM": ("sglang.srt.layers.attention.linear.kda_backend.KDAAttnBackend", 64),
        }
        for arch, (backend, chunk) in want.items():
            cfg = TinyHybridSGLangConfig(architectures=[arch])
            # SGLang's attention registry picks by config class (+ predicate), the arg hooks by name
            spec, _ = get_linear_attn_config(cfg)
            self.assertEqual(spec.backend_class_name, backend, arch)
            self.assertEqual(get_linear_attn_spec(cfg).backend_class_name, backend, arch)
            self.assertEqual(cfg.mamba_chunk_size, chunk, arch)

    def test_direct_construction_keeps_the_base_defaults(self):
        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridConfig
        from sglang_mamba_ext.plugin.tiny_hybrid.config import TinyHybridSGLangConfig

        base, sg = TinyHybridConfig(), TinyHybridSGLangConfig()
        for field in ("hidden_size", "layer_types", "linear_num_value_heads", "linear_gate", "vocab_size"):
            self.assertEqual(getattr(sg, field), getattr(base, field), field)
        self.assertEqual(TinyHybridSGLangConfig(hidden_size=32, linear_gate="gdn").hidden_size, 32)
        with self.assertRaisesRegex(ValueError, "linear_gate"):
            TinyHybridSGLangConfig(linear_gate="mamba")


class TestCpuDefaults(unittest.TestCase):
    def _env_after_hook(self, arch):
        from sglang_mamba_ext.plugin import cpu_defaults

        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump({"model_type": "tiny_hybrid", "architectures": [arch], "torch_dtype": "float16"}, f)
            with mock.patch.dict(os.environ, {cpu_defaults.DISABLE_ENV: "0"}):
                for k in ("TRITON_INTERPRET", cpu_defaults.CONV_DTYPE_ENV):
                    os.environ.pop(k, None)
                with mock.patch("torch.cuda.is_available", return_value=False):
                    cpu_defaults._before_prepare_server_args(["--model-path", tmp, "--device", "cpu"])
                return os.environ.get("TRITON_INTERPRET"), os.environ.get(cpu_defaults.CONV_DTYPE_ENV)

    def test_interpreter_and_float16_window_for_sglang_kernels(self):
        self.assertEqual(self._env_after_hook("TinyHybridGDNForCausalLM"), ("1", "float16"))
        self.assertEqual(self._env_after_hook("TinyHybridForCausalLM"), (None, "float32"))


class TestStartupChecks(unittest.TestCase):
    """``plugin/early_checks.py`` refuses, like argparse, what cannot run on a host without CUDA."""

    def _check(self, argv_extra, env):
        from sglang_mamba_ext.plugin.early_checks import early_model_checks

        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump({"model_type": "tiny_hybrid", "architectures": ["TinyHybridGDNForCausalLM"],
                           "linear_gate": "gdn"}, f)
            with mock.patch.dict(os.environ, env), mock.patch("torch.cuda.is_available", return_value=False):
                for k in ("TRITON_INTERPRET", "SGLANG_MAMBA_EXT_NO_CPU_DEFAULTS"):
                    if k not in env:
                        os.environ.pop(k, None)
                early_model_checks(["--model-path", tmp, "--device", "cpu", *argv_extra])

    def test_interpreter_off_refused(self):
        from sglang_mamba_ext.plugin.startup_errors import FlagError

        for env, now in (({"TRITON_INTERPRET": "0"}, "'0'"), ({"SGLANG_MAMBA_EXT_NO_CPU_DEFAULTS": "1"}, "unset")):
            with self.subTest(env=env), self.assertRaises(FlagError) as cm:
                self._check([], env)
            self.assertEqual(str(cm.exception), (
                "--model-path: TinyHybridGDNForCausalLM runs SGLang's own Triton kernels, which need CUDA or, on "
                f"this host without CUDA, Triton's interpreter: set TRITON_INTERPRET=1 (now {now}), or serve a "
                "model built without --linear-kernels sglang"))
        self._check([], {})  # the CPU defaults will set it
        self._check([], {"TRITON_INTERPRET": "1"})

    def test_dtype_other_than_float16_refused(self):
        from sglang_mamba_ext.plugin.startup_errors import FlagError

        for dtype in ("bfloat16", "float32"):
            with self.subTest(dtype=dtype), self.assertRaisesRegex(FlagError, f"^--dtype {dtype}: .* use --dtype "
                                                                               "float16 or leave --dtype out$"):
                self._check(["--dtype", dtype], {})
        self._check(["--dtype", "float16"], {})


@unittest.skipUnless(SGLANG_INSTALLED and (_IN_INTERP or torch.cuda.is_available()),
                     "needs SGLang and TRITON_INTERPRET=1 (run by TestUnderTritonInterpreter) or CUDA")
class TestSGLangGDNKernelInterpreted(unittest.TestCase):
    """SGLang's ``chunk_gated_delta_rule`` (the GDN backend's extend kernel) on a two-sequence
    varlen batch with initial states read from, and final states written to, pool slots: equal
    to fla's naive recurrence within float16 error; and its per-chunk states ``h`` (what the
    in-chunk writers start tail checkpoints from, ``ops/inchunk/from_chunks.py``) are the states at
    each sequence's 64-token chunk starts, chunks numbered over the sequences in order."""

    def test_chunked_gdn_matches_naive(self):
        from fla.ops.gated_delta_rule.naive import naive_recurrent_gated_delta_rule

        from sglang_mamba_ext.plugin.triton_interpret import install_interpreter_shims

        self.assertEqual(install_interpreter_shims(), not torch.cuda.is_available())
        from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        g = torch.Generator().manual_seed(0)
        T, H, K, V = 150, 2, 16, 16
        q, k, v = (torch.randn(1, T, H, d, generator=g) for d in (K, K, V))
        gate = -torch.rand(1, T, H, generator=g) * 0.2
        beta = torch.rand(1, T, H, generator=g)
        pool = torch.randn(4, H, V, K, generator=g) * 0.3  # SGLang's GDN layout [slots, HV, V, K]
        start = pool.clone()
        pool = pool.to(dev)
        cu, slots = [0, 30, 150], [1, 2]
        out = chunk_gated_delta_rule(
            q=q.half().to(dev), k=k.half().to(dev), v=v.half().to(dev), g=gate.to(dev), beta=beta.to(dev),
            initial_state=pool, initial_state_indices=torch.tensor(slots, dtype=torch.int32, device=dev),
            cu_seqlens=torch.tensor(cu, dtype=torch.int32, device=dev), use_qk_l2norm_in_kernel=True)
        o, pool = out[0].float().cpu(), pool.cpu()  # final states: written into the pool slots
        h = out[2].float().cpu()  # [1, NT, H, V, K]: chunk 0 = sequence 0's start, 1 and 2 sequence 1's
        self.assertEqual(tuple(h.shape), (1, 3, H, V, K))
        torch.testing.assert_close(h[0, 0], start[1], rtol=0, atol=1e-3)
        torch.testing.assert_close(h[0, 1], start[2], rtol=0, atol=1e-3)
        qq, kk = (torch.nn.functional.normalize(x[:, 30:94].half().float(), dim=-1) for x in (q, k))
        _, mid = naive_recurrent_gated_delta_rule(qq, kk, v[:, 30:94].half().float(), beta[:, 30:94], gate[:, 30:94],
                                                  initial_state=start[2].transpose(-1, -2)[None], output_final_state=True)
        torch.testing.assert_close(h[0, 2].transpose(-1, -2), mid[0], rtol=0, atol=3e-3)
        for i, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
            qq, kk = (torch.nn.functional.normalize(x[:, s:e].half().float(), dim=-1) for x in (q, k))
            ref_o, ref_state = naive_recurrent_gated_delta_rule(
                qq, kk, v[:, s:e].half().float(), beta[:, s:e], gate[:, s:e],
                initial_state=start[slots[i]].transpose(-1, -2)[None], output_final_state=True)
            self.assertGreater(float(ref_o.abs().max()), 0.1)
            torch.testing.assert_close(o[:, s:e], ref_o, rtol=0, atol=3e-3)
            torch.testing.assert_close(pool[slots[i]].transpose(-1, -2), ref_state[0], rtol=0, atol=3e-3)
        torch.testing.assert_close(pool[[0, 3]], start[[0, 3]], rtol=0, atol=0)  # other slots untouched


TestUnderTritonInterpreter = triton_subprocess_case(__file__, SELECT, skip=_IN_INTERP or not SGLANG_INSTALLED)


if __name__ == "__main__":
    unittest.main()
