"""End to end: speculative decoding through SGLang 0.5.23's own FROZEN_KV_MTP worker on CPU,
the tiny hybrid target + its tiny frozen-KV draft (``scripts/make_tiny_model.py --draft-out``),
with ``--enable-mamba-radix``, in SGLang's snapshot mode and in this project's
``--mamba-spec-state-update deferred`` (KDA and Gated DeltaNet targets: ``--linear-gate``).

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

Deferred classes verify on chip (the tiny model's shapes fit: ``speculative/verify_onchip.py``)
unless ``SGLANG_MAMBA_EXT_DEFERRED_VERIFY=one_layer`` is in the environment (the servers
inherit it); the server log must name the variant. With ``SPEC_ACCEPT_DUMP=<file>`` every
request's prompt, output and ``spec_correct_drafts_histogram`` are written there as JSON at the
end, to compare the two variants' accept counts run against run.
"""

import json

import os
import tempfile
import threading
import time
import unittest
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import full_suite_only

from server_util import CHECKED_ENV, Server, idle_and_checked

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NEW_TOKENS = 16
PROMPTS = [list(range(5, 13)), [100, 200, 300, 40, 50], list(range(20, 60))]


def _model_pair(root: str, gate: str = "kda"):
    from sglang_mamba_ext.models.tiny_builder import build_tiny_draft, build_tiny_model
    from sglang_mamba_ext.testing import tiny_model_dir

    if gate == "kda":
        target = tiny_model_dir()
    else:
        target = build_tiny_model(os.path.join(root, "target"), seed=0, config_overrides={"linear_gate": gate})
    draft = os.path.join(root, "draft")
    build_tiny_draft(draft, target)
    return target, draft


class _SpecCase:
    """The tests of one speculative configuration (mixed into a ``unittest.TestCase``)."""

    TOPK = 1
    STEPS = 3
    DRAFT_TOKENS = 4
    #: ``--mamba-spec-state-update`` (None: flag not given, SGLang's snapshot path)
    MODE = None
    #: decay gate of the tiny target's linear layers (``kda`` or ``gdn``)
    GATE = "kda"
    #: extra server flags
    EXTRA = []
    PAGE = 1

    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridReference

        tmp = tempfile.TemporaryDirectory()
        cls.addClassCleanup(tmp.cleanup)
        cls.target, cls.draft = _model_pair(tmp.name, cls.GATE)
        cls.ref = TinyHybridReference.from_pretrained(cls.target)
        flags = [
            "--device", "cpu", "--enable-mamba-radix",
            "--speculative-algorithm", "FROZEN_KV_MTP", "--speculative-draft-model-path", cls.draft,
            "--speculative-num-steps", str(cls.STEPS), "--speculative-eagle-topk", str(cls.TOPK),
            "--speculative-num-draft-tokens", str(cls.DRAFT_TOKENS),
            "--max-total-tokens", "4096", "--max-mamba-cache-size", "32", "--max-running-requests", "4",
            *(["--mamba-spec-state-update", cls.MODE] if cls.MODE else []), *cls.EXTRA,
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
        _ACCEPTS.append({"class": type(self).__name__, "prompt": list(ids), "n": n, "output": r["output_ids"],
                         "histogram": hist})
        return r

    def test_deferred_verify_variant_in_log(self):
        if self.MODE != "deferred":
            self.skipTest("deferred mode only")
        want = os.environ.get("SGLANG_MAMBA_EXT_DEFERRED_VERIFY", "auto")
        want = "on_chip" if want == "auto" else want  # the tiny model's shapes fit on chip
        self.assertIn(f"verify_variant={want}", self.server.log_text())

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
        # one batch, rows accepting different numbers of drafts per round
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            rs = list(pool.map(lambda p: self._gen([7] + p), PROMPTS))
        hists = {tuple(r["meta_info"]["spec_correct_drafts_histogram"]) for r in rs}
        self.assertGreaterEqual(len(hists), 2, hists)

    def test_short_prompt_past_cached_prefix(self):
        # 1 and 2 tokens beyond a cached prompt: the hit is the deepest len - 1 checkpoint
        # (floored to the page): p's own, then p + [3]'s (= len(p)); the extend of 2 tokens
        # then speculates
        p = list(range(500, 541))
        self._gen(p)
        for tail, hit in (([3], len(p) - 1), ([3, 4], len(p))):
            r = self._gen(p + tail)
            self.assertEqual(r["meta_info"]["cached_tokens"], hit // self.PAGE * self.PAGE, tail)

    def test_prefix_hit_while_speculating(self):
        p = list(range(300, 345))
        first = self._gen(p)
        again = self._gen(p)
        self.assertEqual(again["meta_info"]["cached_tokens"], (len(p) - 1) // self.PAGE * self.PAGE)
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
        # In deferred mode the finishing request's replay stops at the last emitted token's
        # state (prompt + output when the round went past it), so the whole turn is reused.
        want = len(p) - 1
        if overshoot == 0:
            want = len(p) + len(out) - 1
        elif self.MODE == "deferred":
            want = len(p) + len(out)
        self.assertEqual(r["meta_info"]["cached_tokens"], want // self.PAGE * self.PAGE, (overshoot, mi))

    def test_abort_mid_speculation_frees_everything(self):
        import requests

        result = {}

        def run():
            result["out"] = self.server.generate(input_ids=list(range(600, 620)), max_new_tokens=3000,
                                                 rid=f"spec-abort-{self.TOPK}")

        t = threading.Thread(target=run)
        t.start()
        time.sleep(3)
        r = requests.post(self.server.base_url + "/abort_request", json={"rid": f"spec-abort-{self.TOPK}"}, timeout=60)
        self.assertEqual(r.status_code, 200, r.text)
        t.join(timeout=300)
        self.assertFalse(t.is_alive())
        mi = result["out"]["meta_info"]
        self.assertEqual(mi["finish_reason"]["type"], "abort")
        self.assertGreater(mi["spec_verify_ct"], 0, mi)  # it was speculating when aborted
        load = idle_and_checked(self.server)  # every slot and stash row back
        self.assertEqual(load["num_used_tokens"], 0)

    def test_zz_idle_leak_check(self):
        # runs last in the class (alphabetical): every slot back after the requests above
        load = idle_and_checked(self.server)
        self.assertEqual(load["num_used_tokens"], 0)


_ACCEPTS = []


def tearDownModule():
    path = os.environ.get("SPEC_ACCEPT_DUMP")
    if path:
        with open(path, "w") as f:
            json.dump(sorted(_ACCEPTS, key=lambda x: (x["class"], x["prompt"], x["n"])), f, indent=0)


class TestSpecTopk1(_SpecCase, unittest.TestCase):
    TOPK, STEPS, DRAFT_TOKENS = 1, 3, 4


class TestSpecTopk2(_SpecCase, unittest.TestCase):
    TOPK, STEPS, DRAFT_TOKENS = 2, 3, 6


class TestSpecDeferredTopk1(_SpecCase, unittest.TestCase):
    """Deferred mode, KDA target, a chain."""

    TOPK, STEPS, DRAFT_TOKENS, MODE = 1, 3, 4, "deferred"
    # 1 and 2 tokens past a cached prompt in deferred mode: TestSpecDeferredTopk2Paged's; a
    # resend while speculating: the snapshot classes' (the suite's time budget)
    test_short_prompt_past_cached_prefix = test_prefix_hit_while_speculating = None

    def test_followup_after_a_cut_round_reuses_the_whole_turn(self):
        # Find a turn whose last round accepted drafts past max_new_tokens (greedy: the
        # same prompts always give the same rounds); the replay is cut at the last emitted
        # token, so the next turn reuses the whole turn. With the tiny model (seed 0) the
        # prompt starting at 233 is such a turn; the others are tried if it is not.
        for start in [233] + [s for s in range(100, 290, 19) if s != 233]:
            p = list(range(start, start + 21))
            first = self._gen(p, n=13)
            out, mi = first["output_ids"], first["meta_info"]
            if 1 + mi["spec_verify_ct"] + mi["spec_num_correct_drafts"] - len(out) > 0:
                break
        else:
            self.fail("no turn ended inside an accepted run")
        # the KV of every emitted token exists (the round went past them), so the state after
        # all of them is cached: the next turn hits prompt + output
        r = self._gen(p + out + [5])
        self.assertEqual(r["meta_info"]["cached_tokens"], len(p) + len(out), mi)


@full_suite_only("the tiny pair's deferred top-k 2 verify on a paged tree: TestNemotronHMtpDeferredTopk2 (SGLang's MTP heads) serves the deferred top-k 2 verify")
class TestSpecDeferredTopk2Paged(_SpecCase, unittest.TestCase):
    """Deferred mode, KDA target, a tree; pages of 8 tokens and a ping-pong checkpoint every
    8 tokens, so accepted runs cross track-interval boundaries and a finish state off the
    page grid falls back to the checkpoint the replay wrote at the last crossing."""

    TOPK, STEPS, DRAFT_TOKENS, MODE, PAGE = 2, 3, 6, "deferred", 8
    EXTRA = ["--page-size", "8", "--mamba-track-interval", "8"]
    # Deferred verify runs interpreted on CPU (40-70 s a test): this class runs what the tree,
    # paging and track checkpoints add; batching, prefix hits and follow-ups of deferred mode
    # are TestSpecDeferredTopk1's (the suite's time budget, docs/testing.md).
    test_concurrent_requests = test_prefix_hit_while_speculating = None
    test_followup_turn_restores_speculated_state = None

    def test_track_checkpoint_written_by_replay(self):
        # prompt + output - 1 = 41 + 20 - 1 = 60 is off the page grid: the finish state is the
        # newest track checkpoint, at 56, written by a replay (no verify writes the main state)
        p = list(range(640, 681))
        first = self._gen(p, n=20)
        r = self._gen(p + first["output_ids"] + [5, 6])
        self.assertEqual(r["meta_info"]["cached_tokens"], 56, first["meta_info"])


class TestSpecDeferredGdn(_SpecCase, unittest.TestCase):
    """Deferred mode, Gated DeltaNet target (per-head decay gate, Qwen3-Next's layer)."""

    TOPK, STEPS, DRAFT_TOKENS, MODE, GATE = 2, 3, 6, "deferred", "gdn"
    # what the GDN gate adds (greedy output, accept counts, abort, leaks); the rest
    # of deferred mode is TestSpecDeferredTopk1's (the suite's time budget, docs/testing.md)
    test_concurrent_requests = test_prefix_hit_while_speculating = None
    test_short_prompt_past_cached_prefix = test_followup_turn_restores_speculated_state = None
