"""Qwen4-Exp served with the plugin (issue 40): SGLang 0.5.23's ``Qwen4ExpForConditionalGeneration``
(``srt/models/qwen4_exp.py``) from the tiny checkpoint of ``scripts/make_tiny_model.py --arch
qwen4_exp`` (``models/hf_tiny_qwen4_exp.py``: Qwen3.5's GDN / attention layers and MoE inside gated
hyper-connections, a PLE with a dilated short conv on each GDN layer; bfloat16), text-only, with
``--device cpu --enable-mamba-radix`` and no other flag.

Exact checkpoints need three states per request here, all in SGLang's state pool under the
request's mamba slot: the GDN conv window and SSM state (the in-chunk writer,
``plugin/inchunk_checkpoints.py``), and the PLE's dilated conv window and n-gram history
(``plugin/inchunk_ple.py``). ``TestQwen4ExpServing``: all five family tests (a new kind of state),
opt-in (``SGLANG_MAMBA_EXT_ALL_FAMILIES=1``: the class takes longer than the suite's ~45 s per
class). ``TestQwen4ExpDifferential``: random multi-turn traffic against the same checkpoint without
a cache, small pools; opt-in.
"""

import json
import os
import unittest

import pytest
from test_differential_serving import DifferentialServing
from test_sglang_families_serving import CountsInchunkCheckpoints, FamilyServing

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

_ALL = os.environ.get("SGLANG_MAMBA_EXT_ALL_FAMILIES") == "1"


@unittest.skipUnless(_ALL, "Qwen4-Exp (GDN + PLE dilated short conv, bfloat16): SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestQwen4ExpServing(CountsInchunkCheckpoints, FamilyServing, unittest.TestCase):
    """Qwen4-Exp (``--arch qwen4_exp``): launched (the GDN writer's start-up line), resent
    (149 of 150 cached; against transformers' class in float32), a branch point at 77, the next
    turn (``len + out - 1``), abort and idle checks; each hit's output equal to a cold run's.
    Log-probabilities within 0.1 nats (tokens equal): the next turn's hit reuses the KV and
    states its first turn's decode steps wrote, which differ from a cold extend's by rounding,
    here bfloat16's (measured: 0.033 nats at one of six steps, tokens equal; the resend's and the
    branch point's hits, written by extends, matched their cold runs' log-probabilities to four
    decimals). Kimi-K3's class allows the same for the same reason in float16."""

    STOCK = False
    HIT_ATOL = 0.1
    ARCH, BACKEND, MODEL_CLASS = "qwen4_exp", "GDNAttnBackend", "Qwen4ExpForConditionalGeneration"

    def test_0d_served_checkpoint_is_this_class(self):
        # the checkpoint the server loaded names this class alone (its build wrote the family's
        # config), and the server's log says it served that class with the plugin
        with open(os.path.join(self.model, "config.json")) as f:
            self.assertEqual(json.load(f)["architectures"], [self.MODEL_CLASS])
        self.assertIn(self.MODEL_CLASS, self.server.log_text())


@unittest.skipUnless(_ALL, "Qwen4-Exp differential traffic: SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestQwen4ExpDifferential(DifferentialServing, unittest.TestCase):
    """GDN + PLE side states: 10 SSM slots (each carrying its PLE conv windows and n-gram
    history), 1,200 device KV tokens, a host tier of 2 states per slot (the PLE states ride the
    host copies: ``plugin/pool.py``, ``_slot_sibling_tensors``).

    In bfloat16, not float32 as the other kinds: SGLang builds the hyper-connection weights and
    the n-gram tables in bfloat16 whatever ``--dtype`` says (``layers/hyperconnection.py``
    ``HyperConnectionConfig.params_dtype``, ``models/qwen4_exp.py`` ``Qwen4ExpNGramEmbedding``), so
    a float32 server would mix dtypes. In bfloat16 the batch a prefill runs in moves the rounding:
    a request with nothing cached, batched with others on the plugin's server, differed from the
    same prompt alone on the baseline by 0.063 nats at its first token (measured, 2026-12-06), so
    near-ties and log-probabilities are compared at that scale; tokens must still be equal
    wherever the baseline's top-2 gap is above ``TIE_GAP``. Known to fail (2026-12-06, 4 rounds):
    every compared token equal, but 5 near-ties against the mixin's budget of ``sent // 4`` (3),
    since at a 0.1 gap this random tiny model has many; the budget for bfloat16 is open."""

    ARCH = "qwen4_exp"
    COMMON = ("--device", "cpu")
    TIE_GAP = 0.1
    LP_ATOL = 0.15
    PLUGIN_FLAGS = ("--max-mamba-cache-size", "10", "--max-total-tokens", "1200", "--enable-hierarchical-cache",
                    "--hicache-ratio", "2")
    MUST_MOVE = ("evicted_ssm_states", "host_backups", "host_loads")


if __name__ == "__main__":
    unittest.main()
