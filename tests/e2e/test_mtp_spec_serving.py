"""End to end (issue 41, item 2): speculative decoding with SGLang 0.5.23's own MTP draft class
on CPU, ``--speculative-algorithm NEXTN`` (SGLang's EAGLE worker with the model's MTP layer),
with ``--enable-mamba-radix``, in SGLang's snapshot mode, topk 1 (a chain) and 2 (a tree).

The tiny Qwen3-Next, Qwen3.5 (dense text) and Nemotron-H targets and their MTP drafts
(``scripts/make_tiny_model.py --arch qwen3_next|qwen3_5_text|nemotron_h --draft-out``: SGLang
loads them as ``Qwen3NextForCausalLMMTP`` / ``Qwen3_5ForCausalLMMTP`` /
``NemotronHForCausalLMMTP``) are built once per test run, shared by the classes, the
workers and ``tests/test_mtp_tiny.py`` (``conftest.mtp_pair``). The user
passes SGLang's speculative flags, ``--enable-mamba-radix`` and pool caps; the plugin's CPU
defaults add the rest (``--disable-overlap-schedule``, the Triton interpreter, the CPU
speculative routing, ``--speculative-draft-attention-backend triton``) and its CPU bridge for
the MTP class (``plugin/speculative/cpu_mtp.py``).

Greedy output must equal, token for token, what the same plugin server without speculation
returned for the same prompts (started first, its outputs kept, stopped before the
speculative server starts: one server at a time; one plain server per architecture per test
run, its outputs shared by the classes and workers through ``conftest.shared_build``). Accept counts come from ``meta_info`` and are
checked for consistency (as ``test_spec_serving.py`` does: ``1 + spec_verify_ct +
spec_num_correct_drafts`` tokens came out of the rounds, at most the last round's accepted
drafts past ``max_new_tokens``), and the draft must have been accepted somewhere. The cache
stays exact across speculative turns: a resent 150-token prompt hits 149, its next turn hits
``len + out - 1`` (``len + out`` when the last round accepted drafts past the stop). SGLang's strict idle checks (leaks) are on.

The deferred classes serve the Qwen3-Next pair with ``--mamba-spec-state-update deferred``: the
stash is replayed at the start of each of EAGLE's rounds (a BEFORE hook on
``EAGLEWorkerV2.forward_batch_generation``), verify runs through the GDN hook with no snapshot
buffers; the same expected outputs (the plain server's), accept counts,
cache hits and idle checks; the server log names the verify variant it built and, after the
requests, the replay point (EAGLE's worker).
"""

import hashlib
import json
import os
import tempfile
import unittest

import pytest
from conftest import full_suite_only

from server_util import CHECKED_ENV, Server, idle_and_checked

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW_TOKENS = 16
PROMPTS = [list(range(5, 13)), [100, 200, 300, 40, 50], list(range(20, 60))]
LONG = list(range(300, 450))  # 150 tokens
TURN_TOKENS = 6
NEXT_TAIL = list(range(10, 20))


def _built(arch):
    """(target dir, draft dir, draft stats): the pair built once per test run, shared by every
    class and worker with ``tests/test_mtp_tiny.py`` (``conftest.mtp_pair``)."""
    from conftest import mtp_pair

    target, draft, _ = mtp_pair(arch)
    with open(os.path.join(draft, "mtp_tiny.json")) as f:
        return target, draft, json.load(f)


class _MtpSpecCase:
    ARCH = "qwen3_next"
    TOPK, STEPS, DRAFT_TOKENS = 1, 3, 4
    PROMPTS = PROMPTS
    CAPS = ["--max-total-tokens", "4096", "--max-mamba-cache-size", "32", "--max-running-requests", "4"]
    #: ``--mamba-spec-state-update`` (None: not given, SGLang's snapshot path)
    MODE = None
    #: the deferred layout the target's pool is built in (``speculative/deferred.py`` LAYOUTS)
    LAYOUT = "gdn"

    @classmethod
    def _expected(cls, base, log_dir):
        """The plain server's greedy outputs for every prompt the tests send (kept per arch)."""
        from conftest import shared_build

        def run_plain(path):
            # the baseline: the same plugin server without speculation, then stopped
            plain = Server(cls.target, base, os.path.join(log_dir, "plain.log"), env=dict(CHECKED_ENV))
            try:
                plain.wait_healthy()
                want = []
                for p in cls.PROMPTS:
                    want.append([p, plain.generate(input_ids=p, max_new_tokens=NEW_TOKENS)["output_ids"]])
                out = plain.generate(input_ids=LONG, max_new_tokens=TURN_TOKENS)["output_ids"]
                want.append([LONG, out])
                nxt = LONG + out + NEXT_TAIL
                want.append([nxt, plain.generate(input_ids=nxt, max_new_tokens=TURN_TOKENS)["output_ids"]])
            finally:
                plain.stop()
            with open(os.path.join(path, "want.json"), "w") as f:
                json.dump(want, f)

        # one plain server per architecture and prompt set per test run, shared by the workers
        key = hashlib.sha1(json.dumps([cls.ARCH, cls.PROMPTS, base]).encode()).hexdigest()[:12]
        with open(os.path.join(shared_build(f"mtp-want-{cls.ARCH}-{key}", run_plain), "want.json")) as f:
            return {tuple(p): out for p, out in json.load(f)}

    @classmethod
    def setUpClass(cls):
        cls._accepts = []
        tmp = tempfile.TemporaryDirectory(prefix=f"{cls.ARCH}-mtp-logs-")
        cls.addClassCleanup(tmp.cleanup)
        cls.target, cls.draft, cls.draft_stats = _built(cls.ARCH)
        base = ["--device", "cpu", "--enable-mamba-radix", *cls.CAPS]
        cls.want = cls._expected(base, tmp.name)
        flags = [*base, "--speculative-algorithm", "NEXTN", "--speculative-draft-model-path", cls.draft,
                 "--speculative-num-steps", str(cls.STEPS), "--speculative-eagle-topk", str(cls.TOPK),
                 "--speculative-num-draft-tokens", str(cls.DRAFT_TOKENS),
                 *(["--mamba-spec-state-update", cls.MODE] if cls.MODE else [])]
        cls.server = Server(cls.target, flags, os.path.join(tmp.name, "spec.log"), env=dict(CHECKED_ENV))
        cls.addClassCleanup(cls.server.stop)
        cls.server.wait_healthy()

    def _gen(self, ids, n):
        r = self.server.generate(input_ids=ids, max_new_tokens=n)
        self.assertEqual(r["output_ids"], self.want[tuple(ids)], f"prompt {ids[:8]}... ({len(ids)} tokens)")
        mi = r["meta_info"]
        self.assertEqual(mi["completion_tokens"], n)
        hist = mi["spec_correct_drafts_histogram"]
        self.assertEqual(sum(hist), mi["spec_verify_ct"], mi)
        self.assertEqual(sum(i * h for i, h in enumerate(hist)), mi["spec_num_correct_drafts"], mi)
        self.assertLessEqual(len(hist), self.STEPS + 1, mi)
        deepest = max(i for i, h in enumerate(hist) if h > 0)
        overshoot = 1 + mi["spec_verify_ct"] + mi["spec_num_correct_drafts"] - n
        self.assertTrue(0 <= overshoot <= deepest, mi)
        self.assertAlmostEqual(mi["spec_accept_length"], n / mi["spec_verify_ct"], places=9)
        type(self)._accepts.append((len(ids), n, mi["spec_accept_length"], mi["spec_num_correct_drafts"]))
        return r, overshoot

    #: (prompt length, new tokens, accept length, accepted drafts) of every request, printed
    #: as one progress line when the class ends (the figures docs/speculative.md quotes)
    _accepts = []

    @classmethod
    def tearDownClass(cls):
        from conftest import progress

        if cls._accepts:
            progress(f"  {cls.__name__}: (prompt len, new tokens, accept length, accepted drafts) "
                     + " ".join(f"({a},{b},{c:.2f},{d})" for a, b, c, d in cls._accepts))
        super().tearDownClass()

    def test_0_launch(self):
        log = self.server.log_text()
        # NEXTN runs as SGLang's EAGLE worker; the plugin's CPU default picked the draft backend
        self.assertIn("'speculative_algorithm': 'EAGLE'", log)
        self.assertIn("'speculative_draft_attention_backend': 'triton'", log)
        if self.MODE == "deferred":
            # the target's Mamba pool was built for deferred mode (no snapshot buffers), with
            # the verify variant it names; SGLANG_MAMBA_EXT_DEFERRED_VERIFY forces one
            forced = os.environ.get("SGLANG_MAMBA_EXT_DEFERRED_VERIFY", "auto")
            want = "on_chip" if forced == "auto" else forced  # the tiny models' head dims fit on chip
            self.assertIn(f"mamba-spec-state-update=deferred ({self.LAYOUT}): no intermediate SSM buffer; "
                          f"verify_variant={want}", log)
        else:
            self.assertNotIn("mamba-spec-state-update=deferred", log)

    def test_greedy_equals_plain_server_and_accept_counts(self):
        accepted = 0
        for p in self.PROMPTS:
            r, _ = self._gen(p, NEW_TOKENS)
            accepted += r["meta_info"]["spec_num_correct_drafts"]
        # the fitted MTP head agrees with the target on some tokens (mtp_tiny.json: ~20% for
        # Qwen3-Next, ~4% for Nemotron-H)
        self.assertGreater(accepted, 0, self.draft_stats)

    def test_resend_and_next_turn_hit_exactly(self):
        first, _ = self._gen(LONG, TURN_TOKENS)
        again, overshoot = self._gen(LONG, TURN_TOKENS)
        self.assertEqual(again["meta_info"]["cached_tokens"], len(LONG) - 1)  # 149
        out = again["output_ids"]
        nxt = LONG + out + NEXT_TAIL
        r, _ = self._gen(nxt, TURN_TOKENS)
        # the finished turn's state covers prompt + output[:-1]; when its last round accepted
        # drafts past the stop, EAGLE's committed state covers prompt + output (the token past
        # the stop is the round's bonus token, never an input), and the whole turn is reused
        want = len(LONG) + len(out) - 1 if overshoot == 0 else len(LONG) + len(out)
        self.assertEqual(r["meta_info"]["cached_tokens"], want, (overshoot, again["meta_info"]))

    def test_sampled_request_is_served(self):
        """A sampled request (``temperature 0.8, top_p 0.9``) is served: on CPU the verify commits
        the target's argmax, as SGLang's own CPU engine does (``plugin/speculative/cpu_routing.py``;
        its CUDA-only sampling kernels stopped the scheduler before), and the server stays up."""
        n = 3  # one speculative round at least, kept short (the suite's budget)
        r = self.server.generate(input_ids=list(range(200, 230)), sampling_params={
            "temperature": 0.8, "top_p": 0.9, "max_new_tokens": n, "ignore_eos": True})
        self.assertEqual(r["meta_info"]["completion_tokens"], n)
        self.assertEqual(len(r["output_ids"]), n)
        self.assertGreaterEqual(r["meta_info"]["spec_verify_ct"], 1)
        self.assertEqual(self.server.generate(input_ids=self.PROMPTS[0], max_new_tokens=n)["output_ids"],
                         self.want[tuple(self.PROMPTS[0])][:n])

    def test_zz_idle_leak_check(self):
        # runs last in the class (alphabetical), after the speculative requests above
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0)
        if self.MODE == "deferred":
            # the stash was replayed at EAGLE's per-round entry (the greedy outputs could not
            # match otherwise: in deferred mode only the replay advances the main state)
            self.assertIn("replay at the start of EAGLEWorkerV2's rounds", self.server.log_text())


#: The suite's time budget (docs/testing.md): CI serves one chain and one tree per mode across
#: the two pairs (snapshot: Nemotron-H chain, Qwen3-Next tree; deferred: Qwen3-Next chain,
#: Nemotron-H tree); SGLANG_MAMBA_EXT_ALL_MTP=1 also runs the other Qwen3-Next configurations
#: and Qwen3.5 (each passed on 2026-12-05: 3.4 / 4.7 / 6.5 min).
_ALL_MTP = unittest.skipUnless(os.environ.get("SGLANG_MAMBA_EXT_ALL_MTP") == "1",
                               "the suite's time budget (docs/testing.md): the same plugin paths run in another "
                               "class of this file; SGLANG_MAMBA_EXT_ALL_MTP=1 runs it")


@_ALL_MTP
class TestQwen3NextMtpTopk1(_MtpSpecCase, unittest.TestCase):
    """Qwen3-Next + Qwen3NextForCausalLMMTP, a chain of 3 drafts (4 tokens verified)."""


@full_suite_only("top-k 2 MTP drafts with SGLang's own verify: TestNemotronHMtpDeferredTopk2 serves top-k 2 with the deferred verify")
class TestQwen3NextMtpTopk2(_MtpSpecCase, unittest.TestCase):
    """Qwen3-Next + Qwen3NextForCausalLMMTP, a tree: topk 2, 3 steps, 6 tokens verified."""

    TOPK, STEPS, DRAFT_TOKENS = 2, 3, 6


@full_suite_only("SGLang's MTP heads with the deferred verify: TestNemotronHMtpDeferredTopk2 (a tree); the deferred "
                 "verify through SGLang's real GDN / KDA backends: tests/test_spec_onchip_glue.py (both the Triton "
                 "kernel and the torch form); a GDN target's deferred replay served: TestSpecDeferredGdn (the tiny pair)")
class TestQwen3NextMtpDeferredTopk1(_MtpSpecCase, unittest.TestCase):
    """Qwen3-Next + its MTP head in deferred mode, a chain of 3 drafts (4 tokens verified)."""

    MODE = "deferred"


@_ALL_MTP
class TestQwen3NextMtpDeferredTopk2(_MtpSpecCase, unittest.TestCase):
    """Qwen3-Next + its MTP head in deferred mode, a tree: topk 2, 3 steps, 6 tokens verified."""

    TOPK, STEPS, DRAFT_TOKENS, MODE = 2, 3, 6, "deferred"


@_ALL_MTP  # Qwen3.5's GDN layers and MTP class run the same plugin paths as Qwen3-Next's
class TestQwen35MtpTopk1(_MtpSpecCase, unittest.TestCase):
    """Qwen3.5 dense text + Qwen3_5ForCausalLMMTP, a chain of 3 drafts."""

    ARCH = "qwen3_5_text"


@full_suite_only("Nemotron-H's MTP heads with SGLang's own verify: its deferred-verify subclass TestNemotronHMtpDeferredTopk2 runs by default")
class TestNemotronHMtpTopk1(_MtpSpecCase, unittest.TestCase):
    """Nemotron-H (Mamba2) + NemotronHForCausalLMMTP (one attention block), a chain of 3
    drafts. The prompt range(5, 13) is left out: its first step is a near-tie (top-2 gap 6e-4
    in float32) that the verify batch and a decode step may break differently in float16."""

    ARCH = "nemotron_h"
    PROMPTS = [[100, 200, 300, 40, 50], list(range(20, 60))]


class TestNemotronHMtpDeferredTopk2(TestNemotronHMtpTopk1):
    """Nemotron-H + its MTP head in deferred mode (issue 41, item 3), a tree: topk 2, 3 steps,
    6 tokens verified. The Mamba2 layers' raw xBC and dt are captured in verify
    (``plugin/speculative/mamba2_verify.py``), the node states are recomputed on chip
    (``ops/verify/mamba2_onchip.py``; with ``SGLANG_MAMBA_EXT_DEFERRED_VERIFY=one_layer``
    SGLang's Mamba2 verify kernel fills the one-layer node buffer), and the stash is replayed
    by the Mamba2 replay kernel (``ops/replay/mamba2.py``)."""

    TOPK, STEPS, DRAFT_TOKENS, MODE, LAYOUT = 2, 3, 6, "deferred", "mamba2"
    __unittest_skip__ = False  # in the default run (its base class is full-suite only)


if __name__ == "__main__":
    unittest.main()
