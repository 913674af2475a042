"""The Kimi-K3 VLM's processor stand-in (``plugin/cpu_bridges_kimi_k3_vl.py``; issue 40): on a
``kimi_k3`` checkpoint whose processor SGLang cannot load (no remote code), the AROUND hook on
``get_processor`` answers a processor with K3's ``media_processor`` contract; everything else
passes through. No server; SGLang's own preprocessing functions are imported."""

import json
import os
import tempfile
import unittest
from unittest import mock

from sglang_mamba_ext.models.hf_tiny_kimi_k3_vl import MEDIA_PROC_CFG, write_processor_config
from sglang_mamba_ext.plugin import cpu_bridges_kimi_k3_vl as bridge


class _Tok:
    chat_template = None

    def __call__(self, text, **kwargs):
        return {"input_ids": [[len(t) for t in text]], "kwargs": kwargs}


def _checkpoint(tmp: str, model_type: str = "kimi_k3") -> str:
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump({"model_type": model_type}, f)
    with open(os.path.join(tmp, "tokenizer_config.json"), "w") as f:
        json.dump({}, f)
    write_processor_config(tmp)
    return tmp


class TestK3ProcessorStandIn(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)

    def around(self, answer, path, active=True):
        with mock.patch("sglang_mamba_ext.plugin.cpu_bridges.active", return_value=active):
            return bridge.k3_processor_around(lambda *a, **k: answer, path, model_name=path)

    def test_stand_in_for_a_bare_tokenizer(self):
        path = _checkpoint(self.tmp.name)
        tok = _Tok()
        proc = self.around(tok, path)
        self.assertIsInstance(proc, bridge.K3Processor)
        self.assertIs(proc.tokenizer, tok)
        self.assertIs(proc.image_processor, proc.media_processor)
        self.assertEqual(proc.media_processor.media_proc_cfg, MEDIA_PROC_CFG)
        # what SGLang's K3 processor builds from it at start-up (kimi_k3.py:399-401)
        from sglang.srt.multimodal.media_artifacts.kimi_k3 import KimiK3PreprocessConfig

        cfg = KimiK3PreprocessConfig.from_media_processor(proc.media_processor)
        self.assertEqual((cfg.patch_size, cfg.merge_kernel_size, cfg.in_patch_limit), (14, 2, 256))

    def test_unchanged_elsewhere(self):
        path = _checkpoint(self.tmp.name)
        real = mock.Mock(spec=["tokenizer", "media_processor"])
        self.assertIs(self.around(real, path), real)  # the checkpoint's own processor
        tok = _Tok()
        self.assertIs(self.around(tok, path, active=False), tok)  # bridges off
        other = tempfile.TemporaryDirectory()
        self.addCleanup(other.cleanup)
        self.assertIs(self.around(tok, _checkpoint(other.name, "kimi_linear")), tok)  # not K3
        os.remove(os.path.join(path, "preprocessor_config.json"))
        self.assertIs(self.around(tok, path), tok)  # no media_proc_cfg

    def test_image_tokens_and_patches(self):
        """The warmup's 448x448 image (http_server.py): NaViT halves it to 224x224 under a
        256-patch budget, 16x16 patches of 14, 2x2 merged to 64 tokens."""
        from PIL import Image

        proc = bridge.K3Processor(_Tok(), bridge.K3MediaConfig(MEDIA_PROC_CFG))
        image = Image.new("RGBA", (448, 448), (10, 200, 30, 128))
        self.assertEqual(proc.media_processor.media_tokens_calculator({"type": "image", "image": image}), 64)
        out = proc(text=["x"], medias=[{"type": "image", "image": image}])
        self.assertEqual(tuple(out["pixel_values"].shape), (256, 3, 14, 14))
        self.assertEqual(out["grid_thws"].tolist(), [[1, 16, 16]])
        self.assertEqual(out["kwargs"], {"return_tensors": "pt"})
        # normalized with mean / std 0.5: pixels in [-1, 1]
        self.assertLessEqual(float(out["pixel_values"].abs().max()), 1.0)


if __name__ == "__main__":
    unittest.main()
