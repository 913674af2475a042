"""Inkling (SGLang's ``InklingForConditionalGeneration``, ``--arch inkling``; issue 40) served
text-only with the plugin from the project's tiny checkpoint, ``--device cpu --enable-mamba-radix``
and no other flag.

Inkling's layers are full attention (relative-position bias, no linear layer) whose keys, values,
attention output and MLP output each run through a short causal conv (``use_sconv``); the conv
windows live in SGLang's Mamba pool (``InklingShortConvAttnBackend``, six streams per layer). The
plugin's Inkling writer (``plugin/inchunk_inkling.py``) stores every stream's window at any token
offset, so the hits are exact (resend 149, branch point 77, next turn ``len + out - 1``). On CPU:
SGLang's Triton attention and conv kernels under Triton's interpreter, the ``extra_buffer``
strategy the class asserts, and the bridges of ``plugin/cpu_bridges_inkling.py``. No transformers
class: weights written by hand (``models/hf_tiny_inkling.py``), outputs checked against cold runs.

- :class:`TestInklingServing`: the five family tests (a new kind of conv state); opt-in
  (``SGLANG_MAMBA_EXT_ALL_FAMILIES=1``) when it takes more than the suite's ~45 s per class.
- :class:`TestInklingDifferential`: random multi-turn traffic against cold runs
  (``test_differential_serving.DifferentialServing``); the baseline is the same plugin server
  with a fresh ``cache_salt`` per request, since the class refuses ``--disable-radix-cache``
  (``models/inkling.py:975``); small pools; opt-in likewise.
"""

import os
import unittest

import pytest
from test_differential_serving import DifferentialServing
from test_sglang_families_serving import FamilyServing

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ALL_FAMILIES = os.environ.get("SGLANG_MAMBA_EXT_ALL_FAMILIES") == "1"


@unittest.skipUnless(ALL_FAMILIES, "Inkling's sconv served end to end (over the suite's per-class time: its "
                                   "attention and conv kernels run under Triton's interpreter); "
                                   "SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestInklingServing(FamilyServing, unittest.TestCase):
    """Inkling: full attention with a relative-position bias and four short convs per layer (keys,
    values, attention output, MLP output) on ``InklingShortConvAttnBackend``; the plugin's Inkling
    writer; all five tests (launch and writer, resend 149, branch point 77, next turn, abort and
    idle checks)."""

    STOCK = False
    REFERENCE = False
    ARCH, BACKEND, MODEL_CLASS = "inkling", "InklingShortConvAttnBackend", "InklingForConditionalGeneration"

    def test_0b_cpu_bridges_and_pool(self):
        log = self.server.log_text()
        # one ordinary KV pool (no SWA sub-pool) and SGLang's extra_buffer tracking
        self.assertIn("KV Cache is allocated. dtype: torch.float16", log)
        self.assertNotIn("SWA", log.split("KV Cache is allocated")[1].splitlines()[0])
        self.assertIn("--mamba-radix-cache-strategy extra_buffer", log)


@unittest.skipUnless(ALL_FAMILIES, "Inkling's differential traffic; SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it")
class TestInklingDifferential(DifferentialServing, unittest.TestCase):
    """Inkling's sconv windows (the plugin's Inkling writer): 10 SSM slots, 1,200 device KV tokens,
    so states and KV are evicted; the baseline requests run cold on a second plugin server (fresh
    ``cache_salt`` each)."""

    ARCH = "inkling"
    PLUGIN_FLAGS = ("--max-mamba-cache-size", "10", "--max-total-tokens", "1200")
    salt = 0

    @classmethod
    def setUpClass(cls):
        import tempfile

        from conftest import tiny_arch
        from server_util import CHECKED_ENV, Server, start_together

        tmp = tempfile.TemporaryDirectory(prefix=f"{cls.ARCH}-diff-")
        cls.addClassCleanup(tmp.cleanup)
        cls.model = tiny_arch(cls.ARCH)
        cls.server = Server(cls.model, [*cls.COMMON, "--enable-mamba-radix", *cls.PLUGIN_FLAGS],
                            os.path.join(tmp.name, f"{cls.ARCH}.log"), env=dict(CHECKED_ENV))
        # the class asserts the radix cache on (models/inkling.py:975): cold runs instead
        cls.base = Server(cls.model, [*cls.COMMON, "--enable-mamba-radix"],
                          os.path.join(tmp.name, f"{cls.ARCH}-base.log"), env=dict(CHECKED_ENV))
        start_together(cls, [cls.server, cls.base])

    def _gen(self, server, ids):
        extra = {}
        if server is self.base:
            type(self).salt += 1
            extra["cache_salt"] = f"cold-{self.salt}"
        return server.generate(input_ids=ids, max_new_tokens=self.NEW, return_logprob=True, top_logprobs_num=2,
                               **extra)


if __name__ == "__main__":
    unittest.main()
