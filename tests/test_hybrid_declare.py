"""Hybrid classes SGLang leaves off its hybrid radix-cache path, declared by the plugin under
``--enable-mamba-radix`` (``sglang_mamba_ext.plugin.hybrid_declare``; issue 40). Served end to
end by ``tests/e2e/test_sglang_families_serving.py`` (LFM2-VL, Mamba2)."""

import unittest
from types import SimpleNamespace

from conftest import SGLANG_INSTALLED
from sglang_mamba_ext.plugin import hybrid_declare


def _view(**kw):
    base = dict(uses_mamba_radix_cache=False, disable_radix_cache=False, mamba_radix_cache_strategy="auto")
    base.update(kw)
    return SimpleNamespace(**base)


class TestDeclaration(unittest.TestCase):
    def test_pass_declares_sglangs_auto_choice(self):
        self.assertEqual(hybrid_declare._declaration(_view()), {
            "uses_mamba_radix_cache": True, "mamba_radix_cache_strategy": "no_buffer",
            "disable_overlap_schedule": True})
        # an explicit strategy (the CPU defaults' no_buffer) is left as given
        self.assertEqual(hybrid_declare._declaration(_view(mamba_radix_cache_strategy="no_buffer")),
                         {"uses_mamba_radix_cache": True})
        self.assertEqual(hybrid_declare._declaration(_view(uses_mamba_radix_cache=True)), {})
        self.assertEqual(hybrid_declare._declaration(_view(disable_radix_cache=True)), {})

    def test_minicpm_undoes_sglangs_cache_off(self):
        """MiniCPM-SALA: SGLang's model override turns the radix cache off for every config with
        lightning layers (``model_overrides/minicpm.py:24-27``); the MiniCPM pass turns it back on,
        the plain pass does not."""
        self.assertEqual(hybrid_declare._declaration(_view(disable_radix_cache=True, mamba_radix_cache_strategy="no_buffer"),
                                                     undo_cache_off=True),
                         {"uses_mamba_radix_cache": True, "disable_radix_cache": False})
        self.assertEqual(hybrid_declare._declaration(_view(disable_radix_cache=True), undo_cache_off=False), {})

    def test_other_classes_untouched(self):
        cfg = SimpleNamespace(architectures=["Qwen3NextForCausalLM"])
        self.assertFalse(hybrid_declare.declare_missing_hybrid(object(), cfg))
        self.assertFalse(hybrid_declare.declare_missing_hybrid(object(), SimpleNamespace()))

    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_gap_present_upstream(self):
        """SGLang still leaves these classes out (``overrides.py:369``); once it lists them the
        declaration can go."""
        from sglang.srt.arg_groups.overrides import _MAMBA_RADIX_CACHE_ARCHS
        from sglang.srt.configs import hybrid_arch

        for arch in hybrid_declare.DECLARED_ARCHITECTURES:
            self.assertNotIn(arch, _MAMBA_RADIX_CACHE_ARCHS)
        # and SGLang's hybrid detection takes their configs as Mamba-like (SSM state pool)
        from sglang.srt.configs.lfm2_vl import Lfm2VlConfig
        from sglang.srt.configs.mamba2 import Mamba2Config

        for cfg in (Lfm2VlConfig(), Mamba2Config()):
            probe = SimpleNamespace(hf_config=cfg, hf_text_config=cfg, is_draft_model=False)
            self.assertIsNotNone(hybrid_arch.mambaish_config(probe), type(cfg).__name__)


if __name__ == "__main__":
    unittest.main()
