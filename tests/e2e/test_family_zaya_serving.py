"""ZAYA1 (SGLang's ``ZayaForCausalLM``, ``--arch zaya``; issue 40) served with the plugin from the
project's tiny checkpoint, ``--device cpu --enable-mamba-radix`` and no other flag.

ZAYA1's attention layers are compressed convolutional attention (CCA, ``srt/models/zaya.py``):
besides its KV cache each one keeps a conv state in SGLang's Mamba pool (the last two raw ``q||k``
projections and the previous hidden state), run by ``ShortConvAttnBackend``; the plugin's CCA
writer (``plugin/inchunk_cca.py``) stores that state at any token offset, so the hits are exact
(resend 149, branch point 77, next turn ``len + out - 1``). SGLang declares the class hybrid
itself (``arg_groups/overrides.py:396``) and runs it on CPU without a bridge. No transformers class
of this layout (transformers' ``zaya`` is ZAYA1-8B's merged-layer format): weights written by hand
(``models/hf_tiny_zaya.py``), outputs checked against cold runs.

- :class:`TestZayaServing`: the five family tests (a new kind of linear layer); opt-in
  (``SGLANG_MAMBA_EXT_ALL_FAMILIES=1``): the class takes more than the suite's ~45 s per class.
- :class:`TestZayaDifferential`: random multi-turn traffic against ``--disable-radix-cache``
  (``test_differential_serving.DifferentialServing``), small pools; opt-in likewise.
"""

import os
import unittest

import pytest
from test_differential_serving import DifferentialServing
from test_sglang_families_serving import FamilyServing

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ALL_FAMILIES = os.environ.get("SGLANG_MAMBA_EXT_ALL_FAMILIES") == "1"


@unittest.skipUnless(ALL_FAMILIES, "ZAYA1's CCA served end to end (over the suite's per-class time); "
                                   "SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestZayaServing(FamilyServing, unittest.TestCase):
    """ZAYA1: CCA attention layers (conv state + KV in the same layer) alternating with ZAYA's MoE
    (EDA router, MOD skip expert) on ``ShortConvAttnBackend``; the plugin's CCA writer; all five
    tests (launch and writer, resend 149, branch point 77, next turn, abort and idle checks)."""

    STOCK = False
    REFERENCE = False
    ARCH, BACKEND, MODEL_CLASS = "zaya", "ShortConvAttnBackend", "ZayaForCausalLM"

    def test_0c_loaded_without_unknown_names(self):
        # SGLang's loader warns and skips a checkpoint name it has no parameter for (zaya.py:1680-1690)
        self.assertNotIn("has no matching parameter", self.server.log_text())


@unittest.skipUnless(ALL_FAMILIES, "ZAYA1's CCA differential traffic; SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestZayaDifferential(DifferentialServing, unittest.TestCase):
    """CCA (ZAYA1, the plugin's CCA writer): 10 SSM slots, 1,200 device KV tokens, so states and
    KV are evicted."""

    ARCH = "zaya"
    PLUGIN_FLAGS = ("--max-mamba-cache-size", "10", "--max-total-tokens", "1200")


if __name__ == "__main__":
    unittest.main()
