"""The Inkling bridges (``plugin/cpu_bridges_inkling.py``, issue 40): hybrid SWA answered False for
an Inkling checkpoint without sliding-window layers (CPU bridges active), the tiny checkpoint's chat
encoding left to SGLang's default path; and that SGLang still has both gaps."""

import types
import unittest
from unittest import mock

from conftest import SGLANG_INSTALLED

ARCH = ["InklingForConditionalGeneration"]


def _text(local=(), mtp_local=()):
    return types.SimpleNamespace(local_layer_ids=list(local), mtp_local_layer_ids=list(mtp_local))


class TestHybridSwa(unittest.TestCase):
    def test_no_sliding_layer_is_not_hybrid_swa_when_active(self):
        from sglang_mamba_ext.plugin import cpu_bridges_inkling as b

        original = mock.Mock(return_value=True)
        with mock.patch("sglang_mamba_ext.plugin.cpu_bridges.active", return_value=True):
            self.assertFalse(b.is_hybrid_swa_around(original, ARCH, _text()))
            original.assert_not_called()
            self.assertTrue(b.is_hybrid_swa_around(original, ARCH, _text(local=[1])))
            self.assertTrue(b.is_hybrid_swa_around(original, ARCH, _text(mtp_local=[0])))
            self.assertTrue(b.is_hybrid_swa_around(original, ["Gemma4ForCausalLM"], _text()))
        with mock.patch("sglang_mamba_ext.plugin.cpu_bridges.active", return_value=False):
            self.assertTrue(b.is_hybrid_swa_around(original, ARCH, _text()))

    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_gap_present_upstream(self):
        from sglang.srt.configs.model_config import is_hybrid_swa_model

        # the plugin's hook (if registered in this process) is inert here: the bridges are off
        with mock.patch("sglang_mamba_ext.plugin.cpu_bridges.active", return_value=False):
            self.assertTrue(is_hybrid_swa_model(ARCH, _text()))


class TestChatEncoding(unittest.TestCase):
    def test_tiny_checkpoint_gets_the_default_path(self):
        from sglang_mamba_ext.plugin import cpu_bridges_inkling as b

        original = mock.Mock(return_value="inkling")
        tiny = types.SimpleNamespace(architectures=ARCH, sglang_mamba_ext_tiny="inkling")
        self.assertIsNone(b.resolve_chat_encoding_spec_around(original, hf_config=tiny, tokenizer=None))
        original.assert_not_called()
        released = types.SimpleNamespace(architectures=ARCH)
        self.assertEqual(b.resolve_chat_encoding_spec_around(original, hf_config=released, tokenizer=None), "inkling")

    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_gap_present_upstream(self):
        from sglang.srt.entrypoints.openai import chat_encoding

        released = types.SimpleNamespace(architectures=ARCH, model_type="inkling_mm_model")
        self.assertEqual(chat_encoding.resolve_chat_encoding_spec(hf_config=released, tokenizer=None), "inkling")


if __name__ == "__main__":
    unittest.main()
