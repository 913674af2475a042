"""End to end (issue 40): Kimi-K3's VLM (``KimiK3ForConditionalGeneration``, SGLang's ``kimi_k3``
module, ``--arch kimi_k3_vl``) served text-only with ``--device cpu --enable-mamba-radix`` and no
other flag: the tiny K3 text model (``models/hf_tiny_kimi_k3.py``) behind a one-block MoonViT3d
tower and K3's projector (``models/hf_tiny_kimi_k3_vl.py``). SGLang declares the class
hybrid-cached itself (``_MAMBA_RADIX_CACHE_ARCHS``, ``arg_groups/overrides.py:369-398``); the
plugin adds its CPU defaults, the text class's CPU bridges and a text-only stand-in for the
released checkpoint's remote-code processor (``plugin/cpu_bridges_kimi_k3_vl.py``).
Opt-in (``SGLANG_MAMBA_EXT_ALL_FAMILIES=1``): the KDA / MLA paths are ``TestKimiK3Serving``'s.
"""

import os
import unittest

import pytest
from test_sglang_families_serving import FamilyServing

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@unittest.skipUnless(os.environ.get("SGLANG_MAMBA_EXT_ALL_FAMILIES") == "1",
                     "Kimi-K3's VLM runs TestKimiK3Serving's KDA / MLA paths behind SGLang's VLM wrapper; "
                     "SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestKimiK3VlServing(FamilyServing, unittest.TestCase):
    """``KimiK3ForConditionalGeneration`` (``--arch kimi_k3_vl``): launched with the exact-checkpoint
    writer on ``KDAAttnBackend`` and the processor stand-in, resent (149), next turn (65), abort
    and idle checks. No transformers class: outputs checked against cold runs (logprobs within
    0.1 nats, as the text class: ``TestKimiK3Serving``)."""

    STOCK = False
    REFERENCE = False
    HIT_ATOL = 0.1
    test_2_third_prompt_hits_shared_77 = None
    ARCH, BACKEND, MODEL_CLASS = "kimi_k3_vl", "KDAAttnBackend", "KimiK3ForConditionalGeneration"

    def test_0c_processor_stand_in_and_no_declaration(self):
        log = self.server.log_text()
        # SGLang lists the VLM itself (overrides.py:369-398): the plugin declares nothing
        self.assertNotIn(f"mamba-radix: {self.MODEL_CLASS} declared hybrid-cached", log)
        self.assertIn("mamba-radix: Kimi-K3 processor stand-in", log)

    def test_5_image_chat(self):
        """One image in a chat (what SGLang's start-up warmup sends, http_server.py:2393-2450):
        K3's chat path, the processor stand-in's patches, the MoonViT3d tower on CPU; a 112x112
        image is 8x8 patches of 14, 2x2 merged to 16 tokens, framed by K3's media tokens."""
        import base64
        import io

        import requests
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (112, 112), (200, 30, 90)).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                  {"type": "text", "text": "Describe."}]}]
        r = requests.post(self.server.base_url + "/v1/chat/completions", timeout=300,
                          json={"messages": messages, "max_tokens": 2, "temperature": 0})
        self.assertEqual(r.status_code, 200, r.text)
        text_only = requests.post(self.server.base_url + "/v1/chat/completions", timeout=300,
                                  json={"messages": [{"role": "user", "content": "Describe."}], "max_tokens": 2,
                                        "temperature": 0})
        self.assertEqual(text_only.status_code, 200, text_only.text)
        # 16 image tokens plus the frame "<|media_begin|>image 112x112<|media_content|>" ... "<|media_end|>"
        extra = r.json()["usage"]["prompt_tokens"] - text_only.json()["usage"]["prompt_tokens"]
        self.assertGreaterEqual(extra, 16 + 3, (r.json()["usage"], text_only.json()["usage"]))
