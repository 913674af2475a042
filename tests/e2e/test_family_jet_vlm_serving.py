"""End to end (issue 40): Jet-Nemotron's VLM (``JetVLMForConditionalGeneration``, SGLang's
``jet_vlm`` module, ``--arch jet_vlm``) served text-only from the project's tiny checkpoint with
``--device cpu --enable-mamba-radix`` and no other flag: the tiny Jet-Nemotron text model
(``models/hf_tiny_jet_nemotron.py``, the same tensors under ``llm.``) behind a one-layer SigLIP
tower 1152 wide and NVILA's projector (``models/hf_tiny_jet_vlm.py``).

The wrapper's ``llm`` is SGLang's ``JetNemotronForCausalLM`` (``models/jet_vlm.py:78``), so its
JetBlocks take the plugin's Jet writer (``plugin/inchunk_jet.py``; ``is_jet_model`` reads the
text config) and, on CPU, the Jet recurrence bridge (``plugin/cpu_bridges_jet_nemotron.py``);
SGLang lists the class hybrid-cached itself (``arg_groups/overrides.py:393``). No transformers
class: outputs checked against cold runs, as ``test_family_jet_nemotron_serving.py`` does.

- :class:`TestJetVlmServing` (opt-in, ``SGLANG_MAMBA_EXT_ALL_FAMILIES=1``): resend of 150 tokens
  hits 149, the branch point 77, the next turn ``len + out - 1`` (65), each output equal to a
  cold run; the Jet writer's counters; one image through SGLang's NVILA processor and the tower;
  abort, then SGLang's strict idle checks.
"""

import os
import unittest

import pytest
from test_family_jet_nemotron_serving import JetWriterCounters
from test_sglang_families_serving import FamilyServing

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ALL_FAMILIES = os.environ.get("SGLANG_MAMBA_EXT_ALL_FAMILIES") == "1"


@unittest.skipUnless(ALL_FAMILIES, "Jet-Nemotron's VLM runs TestJetNemotronServing's JetBlock paths behind SGLang's "
                                   "VLM wrapper; SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestJetVlmServing(JetWriterCounters, FamilyServing, unittest.TestCase):
    """``JetVLMForConditionalGeneration`` (``--arch jet_vlm``): JetBlocks on ``GDNAttnBackend``
    between GQA attention layers, inside SGLang's VLM wrapper; the Jet writer makes the hits
    exact. The five family tests, the writer's counters and one image."""

    STOCK = False
    REFERENCE = False
    ARCH, BACKEND, MODEL_CLASS = "jet_vlm", "GDNAttnBackend", "JetVLMForConditionalGeneration"

    def test_5_image_prompt(self):
        """One image in a ``/generate`` prompt: SGLang's NVILA processor around the checkpoint's
        ``SiglipProcessor`` (a 28x28 image), the SigLIP tower and the projector on CPU: one
        feature for the one ``<image>`` placeholder (4 patches merged 2x2). Two images of other
        colours give other log-probabilities: the feature reaches the text model."""
        import base64
        import io

        from PIL import Image

        def ask(colour):
            buf = io.BytesIO()
            Image.new("RGB", (28, 28), colour).save(buf, format="PNG")
            url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
            r = self.server.generate(text="hi <image> there", image_data=url, max_new_tokens=2,
                                     return_logprob=True)
            return r["meta_info"]["prompt_tokens"], [lp[0] for lp in r["meta_info"]["output_token_logprobs"]]

        red, blue = ask((200, 30, 90)), ask((20, 60, 220))
        self.assertEqual(red[0], 4)  # "hi", " ", "<image>", " there": no BOS, one placeholder
        self.assertEqual(blue[0], 4)
        self.assertEqual(len(red[1]), 2)
        self.assertNotEqual(red[1][0], blue[1][0])


if __name__ == "__main__":
    unittest.main()
