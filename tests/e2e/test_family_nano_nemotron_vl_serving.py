"""Nemotron-H Nano VL / Omni (SGLang's ``nano_nemotron_vl`` module; issue 40) served text-only with
the plugin from the project's tiny checkpoints, ``--device cpu --enable-mamba-radix`` and no
other flag.

SGLang's ``NemotronH_Nano_VL_V2`` and the omni classes wrap its
``NemotronHForCausalLM`` (Mamba2 + attention on ``Mamba2AttnBackend``) behind a RADIO vision tower
(``models/hf_tiny_nano_nemotron_vl.py``: ViT-Small, the smallest RADIO tower SGLang's config
knows). The plugin's Mamba2 writer (``plugin/inchunk_conv_ssd.py``) gives exact hits; the branch
point is Nemotron-H's (the same Mamba2 hooks: ``TestNemotronHServing``). Outputs are compared
with transformers' float32 ``NemotronHForCausalLM`` on the same language-model weights (the
checkpoint's ``hf_reference/``): text-only, SGLang's wrapper runs exactly that model.

- :class:`TestNanoNemotronVLServing`: ``NemotronH_Nano_VL_V2``;
- :class:`TestNanoNemotronOmniServing`: ``NemotronH_Nano_Omni_Reasoning_V3`` (a subclass with
  nothing of its own, ``nano_nemotron_vl.py:426-427``; its checkpoint has RADIO's video embedder);
- :class:`TestNanoNemotronOmniV3Serving`: ``NemotronH_Omni_Reasoning_V3`` (model type
  ``nemotron_h_omni``, transformers' own: its checkpoint carries transformers' processor configs,
  which SGLang's start-up loads through ``AutoProcessor``; Parakeet's feature extractor needs librosa,
  a test extra).

SGLang leaves both off its hybrid radix-cache list (``arg_groups/overrides.py:369-398`` lists only
``NemotronH_Omni_Reasoning_V3`` of the module): declared by the plugin (``plugin/hybrid_declare.py``).
No CPU bridge was needed. Both opt-in (``SGLANG_MAMBA_EXT_ALL_FAMILIES=1``): a class took 72-106 s
here (five tests, one server; load 6, other helpers' servers beside it), over the suite's ~45 s per
class. ``NemotronH_Omni_Reasoning_V3`` is on SGLang's list and needs no declaration.
"""

import json
import os
import unittest

import pytest
from test_sglang_families_serving import CountsInchunkCheckpoints, DeclaredHybrid, FamilyServing

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ALL_FAMILIES = os.environ.get("SGLANG_MAMBA_EXT_ALL_FAMILIES") == "1"


class ServedThisClass:
    """The checkpoint the server loaded names ``MODEL_CLASS`` alone (its build wrote the family's
    config), and the server's log says it served that class with the plugin."""

    def test_0d_served_checkpoint_is_this_class(self):
        with open(os.path.join(self.model, "config.json")) as f:
            self.assertEqual(json.load(f)["architectures"], [self.MODEL_CLASS])
        self.assertIn(self.MODEL_CLASS, self.server.log_text())


@unittest.skipUnless(ALL_FAMILIES, "Nemotron-H Nano VL served end to end (72-106 s here, over the suite's ~45 s per "
                                   "class); SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestNanoNemotronVLServing(ServedThisClass, CountsInchunkCheckpoints, DeclaredHybrid, FamilyServing,
                                unittest.TestCase):
    """``NemotronH_Nano_VL_V2`` (``--arch nano_nemotron_vl``): launched (declared hybrid-cached by the
    plugin), resent (149, against the float32 reference), next turn (65), abort and idle checks."""

    STOCK = False
    test_2_third_prompt_hits_shared_77 = None
    ARCH, BACKEND, MODEL_CLASS = "nano_nemotron_vl", "Mamba2AttnBackend", "NemotronH_Nano_VL_V2"


@unittest.skipUnless(ALL_FAMILIES, "NemotronH_Nano_Omni_Reasoning_V3 runs the same language model and plugin paths as "
                                   "TestNanoNemotronVLServing; SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestNanoNemotronOmniServing(ServedThisClass, CountsInchunkCheckpoints, DeclaredHybrid, FamilyServing,
                                  unittest.TestCase):
    """``NemotronH_Nano_Omni_Reasoning_V3`` (``--arch nano_nemotron_omni``); opt-in."""

    STOCK = False
    test_2_third_prompt_hits_shared_77 = None
    ARCH, BACKEND, MODEL_CLASS = "nano_nemotron_omni", "Mamba2AttnBackend", "NemotronH_Nano_Omni_Reasoning_V3"


@unittest.skipUnless(ALL_FAMILIES, "NemotronH_Omni_Reasoning_V3 runs the same language model and plugin paths as "
                                   "TestNanoNemotronVLServing; SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestNanoNemotronOmniV3Serving(ServedThisClass, CountsInchunkCheckpoints, FamilyServing, unittest.TestCase):
    """``NemotronH_Omni_Reasoning_V3`` (``--arch nano_nemotron_omni_v3``), on SGLang's own hybrid
    radix-cache list (``arg_groups/overrides.py:369-398``); opt-in."""

    STOCK = False
    test_2_third_prompt_hits_shared_77 = None
    ARCH, BACKEND, MODEL_CLASS = "nano_nemotron_omni_v3", "Mamba2AttnBackend", "NemotronH_Omni_Reasoning_V3"

    def test_0e_checkpoint_carries_transformers_processor(self):
        # transformers' processor (its image, video and audio parts), which the server's start-up
        # loaded through AutoProcessor (the server is up: test_0d)
        with open(os.path.join(self.model, "processor_config.json")) as f:
            processor = json.load(f)
        self.assertEqual((processor["processor_class"], processor["feature_extractor"]["feature_extractor_type"]),
                         ("NemotronH_Omni_Reasoning_V3Processor", "ParakeetFeatureExtractor"))


if __name__ == "__main__":
    unittest.main()
