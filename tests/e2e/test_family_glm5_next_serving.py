"""End to end (issue 40): GLM-5-Next (``Glm5NextForConditionalGeneration``, SGLang's ``glm5_next``
module, ``--arch glm5_next``) served text-only with ``--device cpu --enable-mamba-radix`` and no
other flag: KDA layers (GLM's low-rank f / g gates, the safe gate) on ``KDAAttnBackend``, DSA
layers (NoPE MLA with a query LoRA, and an indexer), DeepSeek's MoE with GLM's clamped SwiGLU,
hyper-connections (mHC, 4 residual streams), behind a one-block GLM-OCR tower
(``models/hf_tiny_glm5_next.py``).

SGLang lists the class hybrid-cached itself (``_MAMBA_RADIX_CACHE_ARCHS``,
``arg_groups/overrides.py:369-398``); the plugin adds its CPU defaults and the CPU bridges of
``plugin/cpu_bridges_glm5_next.py``: DSA served as dense MLA while every sequence fits
``index_topk`` (4096 here, the checkpoint's ``max_position_embeddings``), the clamped SwiGLU of the
dense MLPs and of the routed experts, and SGLang's torch paths of the mHC mixes.

The resend is also checked against transformers' own ``Glm5NextForConditionalGeneration`` in float32
on the same checkpoint, text-only (``hf_tiny.reference_greedy``; the checkpoint names its layout in
transformers' ``layer_types`` / ``mlp_layer_types`` too): its DSA indexer selects k-pools of 16 plus
the incomplete tail, all of a query's earlier tokens within ``index_topk``, so it computes the dense
MLA served here. Served in float32 with the clamp's bfloat16 rounding off and a float32 conv window,
the server matched it to 6e-6 nats on every step (96 tokens of 6 prompts). In float16 the
log-probabilities differ more than other families' (``REF_ATOL``): the dense clamp rounds its input
to bfloat16 as SGLang's kernel does (``jit/csrc/deepseek_v4/silu_and_mul_masked_post_quant.cuh:40-62``;
8e-2 nats on this resend, 7e-3 without it), and the sigmoid router's top-2 of 4 experts has near-ties
(margins down to 1e-4) that float16 can flip.

- :class:`TestGlm5NextServing` (opt-in, ``SGLANG_MAMBA_EXT_ALL_FAMILIES=1``): resend of 150 tokens
  hits 149, equal to a cold run and to the float32 reference (6 tokens), the branch point 77, the
  next turn ``len + out - 1`` (65), each output equal to a cold run; abort, then SGLang's strict idle
  checks; one image through SGLang's GLM-V processor and the GLM-OCR tower.
"""

import os
import unittest

import pytest
from test_sglang_families_serving import FamilyServing

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@unittest.skipUnless(os.environ.get("SGLANG_MAMBA_EXT_ALL_FAMILIES") == "1",
                     "GLM-5-Next runs the KDA writer of TestKimiK3Serving behind SGLang's VLM wrapper, its DSA "
                     "layers as dense MLA; SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestGlm5NextServing(FamilyServing, unittest.TestCase):
    """``Glm5NextForConditionalGeneration`` (``--arch glm5_next``): launched with the exact-checkpoint
    writer on ``KDAAttnBackend`` and the DSA / clamped-SwiGLU / mHC bridges; the five family tests, the
    bridges' start-up line and one image."""

    STOCK = False
    #: float16 serving against the float32 reference: the dense clamp's bfloat16 rounding and the
    #: router's near-ties (module docstring); the resend's prompt is 8e-2 nats off at most
    REF_ATOL = 0.15
    ARCH, BACKEND, MODEL_CLASS = "glm5_next", "KDAAttnBackend", "Glm5NextForConditionalGeneration"

    def test_0c_dsa_as_dense_mla(self):
        log = self.server.log_text()
        # SGLang lists the class itself (overrides.py:369-398): the plugin declares nothing
        self.assertNotIn(f"mamba-radix: {self.MODEL_CLASS} declared hybrid-cached", log)
        self.assertIn(f"mamba-radix: {self.MODEL_CLASS} on CPU: DSA layers served as dense MLA", log)
        self.assertNotIn("Set DSA backends", log)  # SGLang's DSA resolution (overrides.py:601-753) did not run

    def test_5_image_prompt(self):
        """One image in a ``/generate`` prompt: SGLang's GLM-V processor (``Glm4vImageProcessor``,
        ``multimodal/processors/glm4v.py``) around transformers' ``Glm5NextProcessor``, the GLM-OCR
        tower and merger on CPU. SGLang resizes a 56x56 image to its 112x112 minimum: 8x8 patches of
        14, 2x2 merged to 16 ``<|image|>`` tokens in place of the one placeholder. Two images of other
        colours give other log-probabilities: the feature reaches the text model."""
        import base64
        import io

        from PIL import Image

        def ask(colour):
            buf = io.BytesIO()
            Image.new("RGB", (56, 56), colour).save(buf, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            r = self.server.generate(text="hi <|begin_of_image|><|image|><|end_of_image|> there", image_data=url,
                                     max_new_tokens=2, return_logprob=True)
            return r["meta_info"]["prompt_tokens"], [lp[0] for lp in r["meta_info"]["output_token_logprobs"]]

        red, blue = ask((200, 30, 90)), ask((20, 60, 220))
        # "hi", " ", <|begin_of_image|>, <|image|>, <|end_of_image|>, " there": 6, the placeholder now 16
        self.assertEqual(red[0], 6 - 1 + 16)
        self.assertEqual(blue[0], 6 - 1 + 16)
        self.assertEqual(len(red[1]), 2)
        self.assertNotEqual(red[1][0], blue[1][0])


if __name__ == "__main__":
    unittest.main()
