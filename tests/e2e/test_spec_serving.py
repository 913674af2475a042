"""End to end: speculative decoding through SGLang 0.5.23's own FROZEN_KV_MTP worker on CPU,
the tiny hybrid target + its tiny frozen-KV draft (``scripts/make_tiny_model.py --draft-out``),
with ``--enable-mamba-radix`` (issue 12, first landing: snapshot mode only).

The user passes only SGLang's speculative flags, ``--enable-mamba-radix`` and pool caps; the
plugin's CPU defaults add the rest (``--disable-overlap-schedule``, Triton interpreter, the CPU
routing hooks). Greedy output must equal ``TinyHybridReference.generate_greedy``, token for
token. Accept counts come from ``meta_info`` and are checked for consistency, not trusted from
a verify kernel: every verify round yields one target token plus its accepted drafts, so the
rounds produce ``1 + spec_verify_ct + spec_num_correct_drafts`` tokens (the 1: the token of the
prefill), of which the last round's may be cut at ``max_new_tokens``: that total is
``completion_tokens`` plus at most the last round's accepted drafts (so at most the deepest
non-empty bucket of ``spec_correct_drafts_histogram``, which counts rounds by accepted drafts);
``spec_accept_length == completion_tokens / spec_verify_ct``. One server per
class, killed in the class cleanup; SGLang's strict idle checks (leaks) are on.
"""

import os
import tempfile
import unittest
from concurrent.futures import ThreadPoolExecutor

import pytest

from server_util import CHECKED_ENV, Server, idle_and_checked

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW_TOKENS = 16
PROMPTS = [list(range(5, 13)), [100, 200, 300, 40, 50], list(range(20, 60))]


def _model_pair(root: str):
    from sglang_mamba_ext.models.tiny_builder import build_tiny_draft
    from sglang_mamba_ext.testing import tiny_model_dir

    target = tiny_model_dir()
    draft = os.path.join(root, "draft")
    build_tiny_draft(draft, target)
    return target, draft


class _SpecCase:
    """The tests of one speculative configuration (mixed into a ``unittest.TestCase``)."""

    TOPK = 1
    STEPS = 3
    DRAFT_TOKENS = 4

    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference

        tmp = tempfile.TemporaryDirectory()
        cls.addClassCleanup(tmp.cleanup)
        cls.target, cls.draft = _model_pair(tmp.name)
        cls.ref = TinyHybridReference.from_pretrained(cls.target)
        flags = [
            "--device", "cpu", "--enable-mamba-radix",
            "--speculative-algorithm", "FROZEN_KV_MTP", "--speculative-draft-model-path", cls.draft,
            "--speculative-num-steps", str(cls.STEPS), "--speculative-eagle-topk", str(cls.TOPK),
            "--speculative-num-draft-tokens", str(cls.DRAFT_TOKENS),
            "--max-total-tokens", "4096", "--max-mamba-cache-size", "32", "--max-running-requests", "4",
        ]
        cls.server = Server(cls.target, flags, os.path.join(tmp.name, "server.log"), env=CHECKED_ENV)
        cls.addClassCleanup(cls.server.stop)
        cls.server.wait_healthy()

    def _gen(self, ids, n=NEW_TOKENS, **extra):
        r = self.server.generate(input_ids=ids, max_new_tokens=n, **extra)
        self.assertEqual(r["output_ids"], self.ref.generate_greedy(ids, n), f"prompt {ids}")
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
        return r

    def test_greedy_equals_reference_and_accept_counts(self):
        hist = []
        for p in PROMPTS:
            h = self._gen(p)["meta_info"]["spec_correct_drafts_histogram"]
            hist += [0] * (len(h) - len(hist))
            for i, x in enumerate(h):
                hist[i] += x
        # the draft agrees with the target on some tokens only: accept lengths vary
        self.assertGreaterEqual(sum(1 for x in hist if x > 0), 2, hist)

    def test_concurrent_requests(self):
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            list(pool.map(lambda p: self._gen([7] + p), PROMPTS))

    def test_prefix_hit_while_speculating(self):
        p = list(range(300, 345))
        first = self._gen(p)
        again = self._gen(p)
        self.assertEqual(again["meta_info"]["cached_tokens"], len(p) - 1)
        self.assertEqual(again["output_ids"], first["output_ids"])

    def test_followup_turn_restores_speculated_state(self):
        # the state cached at the end of a speculated request must hold accepted tokens only:
        # the next turn continues from it and must still equal the reference
        p = list(range(400, 437))
        first = self._gen(p)
        out, mi = first["output_ids"], first["meta_info"]
        overshoot = 1 + mi["spec_verify_ct"] + mi["spec_num_correct_drafts"] - len(out)
        nxt = p + out + [9, 10, 11]
        r = self._gen(nxt)
        # The finished request's state covers prompt + output[:-1] unless its last round
        # accepted drafts past max_new_tokens: that state cannot be cut back, and the next
        # turn resumes from the prompt's own len - 1 checkpoint (no track-interval checkpoint
        # in between at these lengths).
        want = len(p) + len(out) - 1 if overshoot == 0 else len(p) - 1
        self.assertEqual(r["meta_info"]["cached_tokens"], want, (overshoot, mi))

    def test_zz_idle_leak_check(self):
        # runs last in the class (alphabetical): every slot back after the requests above
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0)


class TestSpecTopk1(_SpecCase, unittest.TestCase):
    TOPK, STEPS, DRAFT_TOKENS = 1, 3, 4


class TestSpecTopk2(_SpecCase, unittest.TestCase):
    TOPK, STEPS, DRAFT_TOKENS = 2, 3, 6
