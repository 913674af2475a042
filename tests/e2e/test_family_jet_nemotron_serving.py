"""End to end (issue 40): SGLang's Jet-Nemotron class (``JetNemotronForCausalLM``, ``--arch
jet_nemotron``) served from the project's tiny checkpoint with ``--device cpu
--enable-mamba-radix`` and no other flag.

Its linear layer, the JetBlock (a gated delta rule after an input-generated, "dynamic" short
convolution of ``v``), rides SGLang's ``GDNAttnBackend`` and its state pool but calls none of the
backend's methods, so the GDN in-chunk writer never runs for it: the plugin's Jet writer
(``plugin/inchunk_jet.py``, BEFORE ``JetBlock.forward``) writes the conv window and the
delta-rule state at each planned offset; on CPU the recurrence runs as the plugin's torch
version (``plugin/cpu_bridges_jet_nemotron.py``, ``plugin/cpu_kernels_jet.py``). No
transformers class: weights written by hand (``models/hf_tiny_jet_nemotron.py``), outputs
checked against cold runs.

- :class:`TestJetNemotronServing` (opt-in, ``SGLANG_MAMBA_EXT_ALL_FAMILIES=1``): all five family tests (a new kind of linear layer): resend of
  150 tokens hits 149, the branch point 77, the next turn ``len + out - 1`` (65), each output equal
  to a cold run; abort, then SGLang's strict idle checks.
- :class:`TestJetNemotronDifferential` (opt-in, ``SGLANG_MAMBA_EXT_ALL_FAMILIES=1``): random
  multi-turn traffic against ``--disable-radix-cache`` in float32, small pools (states evicted). The
  plugin's CPU defaults give the conv window the ``--dtype`` asked for (``plugin/cpu_defaults.py``,
  ``JET_ARCHITECTURES``): the JetBlock stores its window uncast (``models/jet_nemotron.py:307-309``).
"""

import os
import unittest

import pytest
from test_differential_serving import DifferentialServing
from test_sglang_families_serving import FamilyServing

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ALL_FAMILIES = os.environ.get("SGLANG_MAMBA_EXT_ALL_FAMILIES") == "1"


class JetWriterCounters:
    """The Jet writer's counters (a mixin of the served Jet classes, here and in
    ``test_family_jet_vlm_serving.py``)."""

    def test_0c_checkpoints_written_by_the_jet_writer(self):
        import requests

        def counters():
            r = requests.get(self.server.base_url + "/server_info", timeout=60)
            r.raise_for_status()
            info = r.json()["internal_states"][0]["mamba_radix"]
            return [info[k] for k in ("inchunk_from_start_state", "inchunk_from_chunk_states", "inchunk_from_own_pass")]

        before = counters()
        self.gen(self.tokens(100))  # prefill chunks 64 + 36: the prompt-end checkpoint (99) is planned
        d = [b - a for a, b in zip(before, counters())]
        print(f"[{self.ARCH}] checkpoint counters moved by {d}")
        # counted by the Jet writer only (the GDN writer's hooks never run for JetBlocks)
        self.assertEqual(d, [1, 0, 0])


@unittest.skipUnless(ALL_FAMILIES, "Jet-Nemotron's served class takes minutes on the shared 2-core machine: "
                                   "SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestJetNemotronServing(JetWriterCounters, FamilyServing, unittest.TestCase):
    """Jet-Nemotron (``JetNemotronForCausalLM``; issue 40): JetBlocks on ``GDNAttnBackend`` between
    GQA attention layers; the Jet writer makes the hits exact. All five tests."""

    STOCK = False
    REFERENCE = False
    ARCH, BACKEND, MODEL_CLASS = "jet_nemotron", "GDNAttnBackend", "JetNemotronForCausalLM"


@unittest.skipUnless(ALL_FAMILIES, "differential Jet-Nemotron traffic: SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestJetNemotronDifferential(DifferentialServing, unittest.TestCase):
    """The JetBlock (dynamic conv + gated delta rule, the plugin's Jet writer): 10 SSM slots."""

    ARCH = "jet_nemotron"
    PLUGIN_FLAGS = ("--max-mamba-cache-size", "10", "--max-total-tokens", "1200")


if __name__ == "__main__":
    unittest.main()
