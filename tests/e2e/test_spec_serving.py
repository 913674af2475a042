"""End to end: speculative decoding through SGLang 0.5.23's own FROZEN_KV_MTP worker on CPU,
the tiny hybrid target + its tiny frozen-KV draft (``scripts/make_tiny_model.py --draft-out``),
with ``--enable-mamba-radix`` (issue 12, first landing: snapshot mode only).

The user passes only SGLang's speculative flags, ``--enable-mamba-radix`` and pool caps; the
plugin's CPU defaults add the rest (``--disable-overlap-schedule``, Triton interpreter, the CPU
routing hooks). Greedy output must equal ``TinyHybridReference.generate_greedy``, token for
token. Accept counts come from ``meta_info`` and are checked for consistency, not trusted from
a verify kernel: every verify round yields one target token plus its accepted drafts, so
``completion_tokens == 1 + spec_verify_ct + spec_num_correct_drafts`` (the 1: the token of the
prefill), and ``spec_correct_drafts_histogram`` counts rounds by accepted drafts. One server per
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


class _SpecCase(unittest.TestCase):
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
        self.assertEqual(mi["completion_tokens"], 1 + mi["spec_verify_ct"] + mi["spec_num_correct_drafts"], mi)
        hist = mi["spec_correct_drafts_histogram"]
        self.assertEqual(sum(hist), mi["spec_verify_ct"], mi)
        self.assertEqual(sum(i * h for i, h in enumerate(hist)), mi["spec_num_correct_drafts"], mi)
        self.assertLessEqual(len(hist), self.STEPS + 1, mi)
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
        out = self._gen(p)["output_ids"]
        nxt = p + out + [9, 10, 11]
        r = self._gen(nxt)
        self.assertEqual(r["meta_info"]["cached_tokens"], len(p) + len(out) - 1)

    def test_zz_idle_leak_check(self):
        # runs last in the class (alphabetical): every slot back after the requests above
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0)


class TestSpecTopk1(_SpecCase):
    TOPK, STEPS, DRAFT_TOKENS = 1, 3, 4


class TestSpecTopk2(_SpecCase):
    TOPK, STEPS, DRAFT_TOKENS = 2, 3, 6
