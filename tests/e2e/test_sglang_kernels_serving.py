"""End to end (issue 16, item 1): exact prefix checkpoints with SGLang's OWN linear-attention
backend in serving.

The tiny model is built with ``--linear-kernels sglang``: with ``--linear-gate gdn``
(``TinyHybridGDNForCausalLM``) its linear layers go through SGLang's ``GDNAttnBackend`` —
SGLang's chunked Gated-DeltaNet Triton kernels, causal-conv kernels and packed decode kernel —,
with ``kda`` (``TinyHybridKDAForCausalLM``, Kimi-Linear's pool layout) through its
``KDAAttnBackend``; on CPU under Triton's interpreter (``plugin/triton_interpret.py``), float16. Those kernels keep states only on their 64-token
chunk grid; the plugin's in-chunk writer (``plugin/inchunk_checkpoints.py``) writes the
planned checkpoints before SGLang's forward (the GDN class with the Triton writer,
interpreted; the KDA class with the torch writer, CPU's default), so hits are exact:

- a resent prompt of 100 tokens hits 99 (SGLang's grid would give 64);
- a sibling branching at token 41 of an earlier request hits 41 (the grid would give 0);
- a follow-up turn hits the finished request's state, ``len + outputs - 1``;

with ``--chunked-prefill-size 64``, so the planned checkpoints fall in either chunk of a
prompt. Every output equals the same prompt run cold (no hit; another ``cache_salt``), and the
served log-probabilities match the plain-torch reference model within float16 error. The
server then survives SGLang's strict leak and tree checks when idle. The GDN class runs with
SGLang's overlap scheduler on (the plugin's default), the KDA class with it off (KDA with it
on: Kimi-Linear's family class), with the same exact values.
"""

import os
import random
import tempfile
import unittest

import pytest
from conftest import full_suite_only
import torch
from server_util import CHECKED_ENV, GreedyHits, Server, idle_and_checked

from sglang_mamba_ext.models.tiny_builder import build_tiny_model
from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW = 5
#: float16 serving vs the float32 reference (log-probabilities, nats)
REF_ATOL = 5e-2


@full_suite_only("SGLang's GDN backend with the interpreted Triton writer, spawned: the same hits as TestQwen3NextServing (SGLang's GDN backend, the torch writer), the Triton writer checked under the interpreter in tests/test_inchunk_checkpoints.py")
class TestSGLangGDNBackendServing(GreedyHits, unittest.TestCase):
    GATE = "gdn"
    BACKEND = "GDNAttnBackend"
    SEED = 16
    #: the in-chunk writer (``SGLANG_MAMBA_EXT_INCHUNK_IMPL``): this class serves the Triton
    #: writer (interpreted, as on CUDA but ~1000x slower), the KDA class CPU's default, torch
    WRITER = "Triton"
    #: more server environment (the overlap class)
    EXTRA_ENV = {}
    #: launched as a user does (server_util.Server): the plugin itself turns Triton's
    #: interpreter on for SGLang's kernels (the subclasses' forked launches preset it)
    SPAWN = True

    @classmethod
    def setUpClass(cls):
        tmp = tempfile.TemporaryDirectory(prefix="sglang-kernels-e2e-")
        cls.addClassCleanup(tmp.cleanup)
        cls.model = build_tiny_model(os.path.join(tmp.name, "model"), seed=0,
                                     config_overrides={"linear_gate": cls.GATE}, linear_kernels="sglang")
        cls.ref = TinyHybridReference.from_pretrained(cls.model)
        args = ["--device", "cpu", "--enable-mamba-radix", "--chunked-prefill-size", "64"]
        env = {**CHECKED_ENV, "SGLANG_MAMBA_EXT_INCHUNK_IMPL": cls.WRITER.lower(), **cls.EXTRA_ENV}
        cls.server = Server(cls.model, args, os.path.join(tmp.name, "server.log"), env=env, spawn=cls.SPAWN)
        cls.addClassCleanup(cls.server.stop)
        cls.server.wait_healthy()
        cls.rng = random.Random(cls.SEED)
        cls.salt = 0

    def assert_reference(self, ids, out, logprobs):
        """The served tokens' log-probabilities under the float32 reference model."""
        logits, _ = self.ref.forward_tokens(list(ids) + list(out[:-1]))
        lp = torch.log_softmax(logits[len(ids) - 1:], dim=-1)
        want = lp[torch.arange(len(out)), torch.tensor(out)]
        torch.testing.assert_close(torch.tensor(logprobs), want, rtol=0, atol=REF_ATOL)

    def test_0_backend_is_sglangs(self):
        log = self.server.log_text()
        self.assertIn(f"mamba-radix: exact prefix checkpoints with {self.BACKEND} (in-chunk {self.WRITER} writer)", log)
        self.assertIn("type=TinyHybridSGLangKernelsForCausalLM", log)

    def test_resend_hits_len_minus_1(self):
        p = self.tokens(100)
        first = self.gen(p)
        self.assertEqual(first[1], 0)
        self.assert_reference(p, first[0], first[2])
        again = self.gen(p)
        self.assertEqual(again[1], len(p) - 1)  # 99; SGLang's 64-token grid: 64
        self.assert_same(again, first)

    def test_branch_point_hits_exactly(self):
        a = self.tokens(90)
        self.gen(a)
        b = a[:41] + self.tokens(20)
        self.assertEqual(self.gen(b)[1], 0)  # plants the branch checkpoint at 41
        c = a[:41] + self.tokens(17)
        hit = self.gen(c)
        self.assertEqual(hit[1], 41)  # SGLang's grid: 0
        self.assert_same(hit, self.gen(c, cold=True))

    def test_follow_up_turn_hits_finished_state(self):
        p = self.tokens(50)
        out, cached, _ = self.gen(p)
        self.assertEqual(cached, 0)
        turn = p + out + self.tokens(12)
        hit = self.gen(turn)
        self.assertEqual(hit[1], len(p) + NEW - 1)
        self.assert_same(hit, self.gen(turn, cold=True))

    def test_z_idle_checks(self):
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_running_reqs"], 0)


@full_suite_only("SGLang's KDA backend and Triton kernels interpreted with the overlap scheduler off: the KDA "
                 "torch writer serves in TestKimiLinearServing, the overlap-off finish in the speculative "
                 "classes (test_spec_serving.py), SGLang's interpreted KDA backend with the writer's hooks "
                 "in tests/test_sglang_kda_model.py")
class TestSGLangKDABackendNoOverlap(TestSGLangGDNBackendServing):
    """KDA (Kimi-Linear's pool layout, the torch writer, CPU's default) with SGLang's overlap
    scheduler off (``SGLANG_MAMBA_EXT_CPU_OVERLAP=0``; the GDN class runs it on, the plugin's
    default, issue 25): the same exact hits with the live-state finish
    (``finish_state=working``). KDA with overlap on is Kimi-Linear's family class
    (``test_sglang_families_serving.py``: the same backend and writer, SGLang's own model)."""

    GATE = "kda"
    BACKEND = "KDAAttnBackend"
    #: seed of the prompts: the reference's smallest top-2 log-prob gap over them is 0.02
    #: (some seeds give ~1e-3 near-ties that float16 may flip)
    SEED = 20
    WRITER = "torch"
    SPAWN = False
    EXTRA_ENV = {"SGLANG_MAMBA_EXT_CPU_OVERLAP": "0"}

    def test_0_backend_is_sglangs(self):
        super().test_0_backend_is_sglangs()
        log = self.server.log_text()
        self.assertIn("'disable_overlap_schedule': True", log)
        self.assertIn("finish_state=working", log)


if __name__ == "__main__":
    unittest.main()
