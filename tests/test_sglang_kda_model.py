"""The KDA variant of the tiny model served by SGLang's own ``KDAAttnBackend``
(``scripts/make_tiny_model.py --linear-gate kda --linear-kernels sglang``, architecture
``TinyHybridKDAForCausalLM``; issue 16, item 1): the builder's head layout, the Kimi-Linear pool
layout its config hands SGLang (``KimiLinearCacheParams``, ``plugin/tiny_hybrid/config.py``), the
raw gates shaped as Kimi-Linear hands them to the backend (``plugin/tiny_hybrid/model.py``), and
SGLang's ``KDAAttnBackend.forward_extend`` / ``forward_decode`` on a pool built from that config,
run under Triton's interpreter (``plugin/triton_interpret.py``), against the model's own
recurrence (``GatedDeltaRuleMixer.run_segments``). The GDN variant's tests:
``tests/test_sglang_kernels_model.py``.
"""

import dataclasses
import json
import os
import tempfile
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from conftest import SGLANG_INSTALLED, requires_sglang
from sglang_mamba_ext.models.tiny_builder import DEFAULT_CONFIG, build_tiny_model
from sglang_mamba_ext.testing.spec_pair import triton_subprocess_case

_IN_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
SELECT = "TestSGLangKDABackendInterpreted"
KDA_ARCH = "TinyHybridKDAForCausalLM"


def _build(tmp, name="m", **overrides):
    path = os.path.join(tmp, name)
    build_tiny_model(path, config_overrides={"linear_gate": "kda", **overrides}, linear_kernels="sglang")
    with open(os.path.join(path, "config.json")) as f:
        return path, json.load(f)


class TestKdaBuilder(unittest.TestCase):
    def test_equal_key_and_value_heads(self):
        with tempfile.TemporaryDirectory() as tmp:
            _, cfg = _build(tmp)
        self.assertEqual((cfg["architectures"], cfg["torch_dtype"], cfg["linear_gate"]), ([KDA_ARCH], "float16", "kda"))
        heads = [cfg[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                  "linear_value_head_dim")]
        self.assertEqual(heads, [4, 4, 16, 16])

    def test_other_variants_keep_the_default_heads(self):
        with tempfile.TemporaryDirectory() as tmp:
            build_tiny_model(os.path.join(tmp, "tiny"))  # the plugin's own backend, KDA gate
            build_tiny_model(os.path.join(tmp, "gdn"), config_overrides={"linear_gate": "gdn"}, linear_kernels="sglang")
            for name in ("tiny", "gdn"):
                with open(os.path.join(tmp, name, "config.json")) as f:
                    cfg = json.load(f)
                for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim"):
                    self.assertEqual(cfg[k], DEFAULT_CONFIG[k], (name, k))

    def test_unequal_heads_refused(self):
        with tempfile.TemporaryDirectory() as tmp:
            with self.assertRaises(ValueError) as cm:
                _build(tmp, linear_num_value_heads=8, linear_value_head_dim=32)
        self.assertEqual(str(cm.exception), (
            "KDA model for SGLang's KDA backend (linear_kernels='sglang'): linear_num_key_heads=4 != "
            "linear_num_value_heads=8, linear_key_head_dim=16 != linear_value_head_dim=32 (SGLang's "
            "Kimi-Linear pool layout needs them equal)"))


class TestStartupRefusal(unittest.TestCase):
    """``plugin/early_checks.py``: a KDA/sglang ``config.json`` with unequal linear heads is
    refused like an argparse error before SGLang starts."""

    def _check(self, cfg):
        from sglang_mamba_ext.plugin.early_checks import early_model_checks

        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(dict({"model_type": "tiny_hybrid", "architectures": [KDA_ARCH]}, **cfg), f)
            with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
                early_model_checks(["--model-path", tmp, "--device", "cpu"])

    def test_unequal_heads_refused(self):
        from sglang_mamba_ext.plugin.startup_errors import FlagError

        with self.assertRaises(FlagError) as cm:
            self._check({})  # DEFAULT_CONFIG's 2/4 heads, 16/32 dims
        self.assertEqual(str(cm.exception), (
            "--model-path: KDA model for SGLang's KDA backend (linear_kernels='sglang'): linear_num_key_heads=2 != "
            "linear_num_value_heads=4, linear_key_head_dim=16 != linear_value_head_dim=32 (SGLang's Kimi-Linear pool "
            "layout needs them equal); rebuild it with scripts/make_tiny_model.py --linear-gate kda --linear-kernels "
            "sglang"))
        self._check({"linear_num_key_heads": 4, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16})


@requires_sglang
class TestKdaCacheParams(unittest.TestCase):
    """What SGLang sizes the Mamba pool from (``config.mamba2_cache_params``)."""

    @classmethod
    def setUpClass(cls):
        tmp = tempfile.TemporaryDirectory()
        cls.addClassCleanup(tmp.cleanup)
        cls.path, _ = _build(tmp.name)

    def _params(self, tp, path=None, **cfg_kwargs):
        import sglang_mamba_ext.plugin.tiny_hybrid.config as config_mod

        with mock.patch.object(config_mod, "linear_attn_tp_size", return_value=tp):
            if cfg_kwargs:  # from_dict, as SGLang's loader builds it (the class's own __init__ is
                # transformers' generated one, which drops TinyHybridConfig's defaults)
                cfg = config_mod.TinyHybridSGLangConfig.from_dict(dict(DEFAULT_CONFIG, **cfg_kwargs))
            else:
                cfg = config_mod.TinyHybridSGLangConfig.from_pretrained(path or self.path)
            return cfg, cfg.mamba2_cache_params

    def test_kimi_linear_layout(self):
        from sglang.srt.configs.mamba_utils import KimiLinearCacheParams

        for tp, heads in ((1, 4), (2, 2)):
            cfg, p = self._params(tp)
            self.assertIsInstance(p, KimiLinearCacheParams)
            self.assertTrue(p.is_kda)
            # conv [W-1, 3 * HV*V / tp] (window axis first), temporal [HV / tp, V, V]
            self.assertEqual((p.shape.conv, p.shape.temporal), ([(3, 3 * heads * 16)], (heads, 16, 16)), tp)
            self.assertEqual(p.layers, [1, 3])

    def test_rank_modules_match_the_pool(self):
        from sglang_mamba_ext.models.tiny_shard import rank_config

        for tp in (1, 2):
            cfg, p = self._params(tp)
            s = rank_config(cfg, tp).linear_attn_shape
            self.assertEqual((p.shape.conv[0][1], p.shape.temporal), (s.conv_dim, (s.num_v_heads, s.head_v_dim, s.head_k_dim)))

    def test_sglang_pool_from_the_params(self):
        from sglang.srt.configs.mamba_utils import Mamba2StateDType
        from sglang.srt.mem_cache.memory_pool import MambaPool

        cfg, p = self._params(1)
        p = dataclasses.replace(p, dtype=Mamba2StateDType(conv=torch.float16, temporal=torch.float32))
        pool = MambaPool(size=5, spec_state_size=0, cache_params=p, mamba_layer_ids=cfg.linear_layer_ids, device="cpu")
        cache = pool.mamba2_layer_cache(0)
        self.assertEqual((tuple(cache.conv[0].shape), tuple(cache.temporal.shape)), ((6, 3, 192), (6, 4, 16, 16)))

    def test_gdn_keeps_the_mamba2_layout(self):
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams

        _, p = self._params(1, architectures=["TinyHybridGDNForCausalLM"], linear_gate="gdn")
        self.assertIsInstance(p, Mamba2CacheParams)
        self.assertEqual((p.shape.conv, p.shape.temporal), ([(192, 3)], (4, 32, 16)))

    def test_unequal_heads_refused(self):
        with self.assertRaisesRegex(ValueError, r"^TinyHybridKDAForCausalLM: SGLang's KDA pool needs linear_num_key_heads "
                                                r"== linear_num_value_heads .* got 2/4 heads and 16/32 dims"):
            self._params(1, architectures=[KDA_ARCH], linear_gate="kda")  # DEFAULT_CONFIG's heads


class _Mode:
    def __init__(self, kind):
        self.kind = kind

    def is_decode(self):
        return self.kind == "decode"

    def is_target_verify(self):
        return self.kind == "verify"

    def is_draft_extend_v2(self):
        return False


@requires_sglang
class TestGateInputs(unittest.TestCase):
    """``TinyHybridSGLangKernelsForCausalLM.linear_gate_inputs``: Kimi-Linear's shapes for KDA,
    Qwen3-Next's (unchanged) for GDN."""

    def test_shapes(self):
        from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape
        from sglang_mamba_ext.plugin.tiny_hybrid.model import TinyHybridSGLangKernelsForCausalLM

        f = TinyHybridSGLangKernelsForCausalLM.linear_gate_inputs
        kda = GatedDeltaRuleMixer(8, LinearAttnShape(2, 2, 4, 4, 4), gate="kda")
        gdn = GatedDeltaRuleMixer(8, LinearAttnShape(2, 2, 4, 4, 4), gate="gdn")
        g, b = torch.arange(5 * 8.0).view(5, 8), torch.arange(10.0).view(5, 2)
        for kind, a_shape in (("extend", (1, 5, 2, 4)), ("decode", (5, 8)), ("verify", (5, 8))):
            fb = SimpleNamespace(forward_mode=_Mode(kind))
            a2, b2 = f(None, fb, kda, g, b)
            self.assertEqual((tuple(a2.shape), tuple(b2.shape)), (a_shape, (1, 5, 2)), kind)
            self.assertTrue(torch.equal(a2.reshape(5, 8), g) and torch.equal(b2[0], b))
            a3, b3 = f(None, fb, gdn, g[:, :2], b)
            self.assertTrue(a3 is not None and torch.equal(a3, g[:, :2]) and torch.equal(b3, b))
        # SGLang's logical mode wins over forward_mode (Kimi-Linear reads logical_forward_mode)
        fb = SimpleNamespace(forward_mode=_Mode("extend"), logical_forward_mode=_Mode("decode"))
        self.assertEqual(tuple(f(None, fb, kda, g, b)[0].shape), (5, 8))


@unittest.skipUnless(SGLANG_INSTALLED and (_IN_INTERP or torch.cuda.is_available()),
                     "needs SGLang and TRITON_INTERPRET=1 (run by TestUnderTritonInterpreter) or CUDA")
class TestSGLangKDABackendInterpreted(unittest.TestCase):
    """SGLang's ``KDAAttnBackend`` (Triton chunked extend, causal conv, packed decode) on one
    linear layer of the KDA model, its pool built by SGLang from the model's config: outputs,
    conv windows and SSM states equal the model's own float32 recurrence within float16
    error. A two-row extend (70 new tokens on a fresh slot, 9 after a 5-token prefix), then one
    decode token per row."""

    def test_extend_and_decode_match_the_model(self):
        from sglang.srt.configs.mamba_utils import Mamba2StateDType
        from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend, KDAKernelDispatcher
        from sglang.srt.layers.attention.linear.utils import LinearAttnKernelBackend
        from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
        from sglang.srt.mem_cache.memory_pool import MambaPool

        import sglang_mamba_ext.plugin.tiny_hybrid.config as config_mod
        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference
        from sglang_mamba_ext.plugin.tiny_hybrid.model import TinyHybridSGLangKernelsForCausalLM
        from sglang_mamba_ext.plugin.triton_interpret import install_interpreter_shims
        from sglang_mamba_ext.speculative.deferred import LAYOUTS

        self.assertEqual(install_interpreter_shims(), not torch.cuda.is_available())
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        with tempfile.TemporaryDirectory() as tmp:
            path, _ = _build(tmp)
            with mock.patch.object(config_mod, "linear_attn_tp_size", return_value=1):
                cfg = config_mod.TinyHybridSGLangConfig.from_pretrained(path)
                params = cfg.mamba2_cache_params
            ref = TinyHybridReference.from_pretrained(path)
            mixer = TinyHybridReference.from_pretrained(path).model.layers[cfg.linear_layer_ids[0]].linear_attn
        params = dataclasses.replace(params, dtype=Mamba2StateDType(conv=torch.float16, temporal=torch.float32))
        layers = cfg.linear_layer_ids
        pool = MambaPool(size=6, spec_state_size=0, cache_params=params, mamba_layer_ids=layers, device=dev)
        lid = layers[0]
        mixer32 = ref.model.layers[lid].linear_attn
        mixer = mixer.half().to(dev)  # the served dtype
        s = mixer.shape
        core = RadixLinearAttention(lid, s.num_k_heads, s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_k_dim,
                                    s.head_v_dim, conv_weights=mixer.conv_weight, bias=mixer.conv_bias,
                                    activation="silu", A_log=mixer.A_log.view(1, 1, -1, 1), dt_bias=mixer.dt_bias)
        backend = KDAAttnBackend.__new__(KDAAttnBackend)  # what forward_extend / forward_decode read
        backend.req_to_token_pool = SimpleNamespace(mamba2_layer_cache=lambda l: pool.mamba2_layer_cache(layers.index(l)))
        backend.prefill_graph_metadata = None
        triton = LinearAttnKernelBackend.TRITON
        backend.kernel_dispatcher = KDAKernelDispatcher(triton, triton, triton)
        lens, prefix, slots = [70, 9], [0, 5], [2, 4]
        gen = torch.Generator().manual_seed(0)
        cache = pool.mamba2_layer_cache(0)
        with torch.no_grad():
            cache.conv[0].copy_(torch.randn(cache.conv[0].shape, generator=gen))
            cache.temporal.copy_(torch.randn(cache.temporal.shape, generator=gen) * 0.3)
            cache.temporal[slots[0]] = 0  # SGLang clears a new request's slot
        views = lambda: [t.clone().float().cpu() for t in LAYOUTS["kda"].replay_views(cache.conv[0], cache.temporal)]
        start = views()
        i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)
        backend.forward_metadata = SimpleNamespace(
            query_start_loc=i32([0, 70, 79]), mamba_cache_indices=i32(slots), logical_num_tokens=None,
            has_mamba_track_mask=False, track_chunk_idx=None, track_ssm_h_src=None, track_ssm_h_batch_src=None,
            state_checkpoint_cu_starts=None, num_state_checkpoints=None, state_checkpoint_every_n_tokens=None,
            state_checkpoint_indices=None)
        fb = SimpleNamespace(forward_mode=_Mode("extend"), extend_prefix_lens=torch.tensor(prefix, device=dev),
                             extend_seq_lens_cpu=lens)
        x = torch.randn(79, cfg.hidden_size, generator=gen).half().to(dev)
        gate_inputs = TinyHybridSGLangKernelsForCausalLM.linear_gate_inputs
        with torch.no_grad():
            mq, g_raw, b_raw = mixer.project_raw(x)
            o = backend.forward_extend(core, fb, mq, *gate_inputs(None, fb, mixer, g_raw, b_raw))
            end = views()
            mq, g_raw, b_raw, o = mq.float().cpu(), g_raw.float().cpu(), b_raw.float().cpu(), o.float().cpu()
            lo = 0
            for i, n in enumerate(lens):
                g, beta = mixer32.activate_gates(g_raw[lo:lo + n], b_raw[lo:lo + n])
                c0, s0 = (start[0][slots[i]], start[1][slots[i]]) if prefix[i] else (None, None)
                want_o, want_conv, want_s = mixer32.run_segments(mq[lo:lo + n], g, beta, c0, s0)
                self.assertGreater(float(want_o.abs().max()), 0.1)
                torch.testing.assert_close(o[0, lo:lo + n], want_o, rtol=0, atol=5e-3)
                torch.testing.assert_close(end[0][slots[i]], want_conv, rtol=0, atol=2e-3)
                torch.testing.assert_close(end[1][slots[i]], want_s, rtol=0, atol=1e-2)
                lo += n
            for other in (0, 1, 3, 5):  # untouched slots
                torch.testing.assert_close(end[1][other], start[1][other], rtol=0, atol=0)

            dfb = SimpleNamespace(forward_mode=_Mode("decode"), mamba_track_mask=None)
            backend.forward_metadata.query_start_loc = i32([0, 1, 2])
            xd = torch.randn(2, cfg.hidden_size, generator=gen).half().to(dev)
            mq, g_raw, b_raw = mixer.project_raw(xd)
            o = backend.forward_decode(core, dfb, mq, *gate_inputs(None, dfb, mixer, g_raw, b_raw)).float().cpu()
            after = views()
            mq, g_raw, b_raw = mq.float().cpu(), g_raw.float().cpu(), b_raw.float().cpu()
            for i in range(2):
                g, beta = mixer32.activate_gates(g_raw[i:i + 1], b_raw[i:i + 1])
                want_o, want_conv, want_s = mixer32.run_segments(mq[i:i + 1], g, beta, end[0][slots[i]], end[1][slots[i]])
                torch.testing.assert_close(o[0, i], want_o[0], rtol=0, atol=1e-3)
                torch.testing.assert_close(after[0][slots[i]], want_conv, rtol=0, atol=2e-3)
                torch.testing.assert_close(after[1][slots[i]], want_s, rtol=0, atol=2e-3)


TestUnderTritonInterpreter = triton_subprocess_case(__file__, SELECT, skip=_IN_INTERP or not SGLANG_INSTALLED)


if __name__ == "__main__":
    unittest.main()
