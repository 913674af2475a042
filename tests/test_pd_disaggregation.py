"""Prefill/decode disaggregation glue on CPU, against real SGLang 0.5.23 objects (no server;
the served path is ``tests/e2e/test_pd_serving.py``):

- ``--disaggregation-mode prefill`` parses with ``--enable-mamba-radix`` and reaches the
  scheduler side; ``decode`` without ``--disaggregation-decode-enable-radix-cache``, and
  ``--enable-pd-role-switch`` without the decode-side tree, are refused naming the flags
  (``decode`` with the tree and ``--enable-hierarchical-cache`` parses) (the served decode side: ``tests/test_pd_decode.py``;
  the role switch: ``tests/e2e/test_pd_role_switch.py``);
- the ``_send_kv_chunk`` hook (``plugin/disaggregation.py``) makes the request's sender take
  SGLang's host-copy branch on a host without CUDA under the flag, and nothing else: with CUDA
  or without the flag the sender is untouched;
- the ``kda_cache`` warm-up's requests (fake bootstrap host) are let into the tree when SGLang
  admits them, other fake-bootstrap requests (SGLang's own warm-up) are not.
"""

import contextlib
import inspect
import unittest
from array import array
from types import SimpleNamespace
from unittest import mock

import sglang_glue_fixtures as F

PREFILL = ("--disaggregation-mode", "prefill")


def _fake_req(supports=True):
    return SimpleNamespace(disagg_kv_sender=SimpleNamespace(supports_host_tensor_indices=supports))


class TestPdFlags(unittest.TestCase):
    def test_prefill_mode_with_the_flag_reaches_the_scheduler(self):
        ctx, sa = F.scheduler_context(F.base_argv("--enable-mamba-radix", *PREFILL))
        self.assertEqual(sa.disaggregation_mode, "prefill")
        self.assertEqual(sa.radix_cache_backend, "mamba_radix_ext")
        from sglang.srt.runtime_context import get_memory

        with F.in_context(ctx):
            self.assertEqual(get_memory().radix_cache_backend, "mamba_radix_ext")

    def test_decode_and_role_switch_refused_naming_the_flags(self):
        cases = [
            (["--disaggregation-mode", "decode"],
             "needs --disaggregation-decode-enable-radix-cache"),
            # a role-switch server may become the decode side: it must be one the plugin serves
            ([*PREFILL, "--enable-pd-role-switch"],
             "--enable-mamba-radix with --enable-pd-role-switch needs --disaggregation-decode-enable-radix-cache"),
        ]
        for extra, needle in cases:
            with self.subTest(extra=extra):
                with self.assertRaises(ValueError) as cm:
                    F.parse_args(F.base_argv("--enable-mamba-radix", *extra))
                self.assertIn(needle, str(cm.exception))
                self.assertIn("drop", str(cm.exception))

    def test_decode_host_tier_accepted(self):
        """Served (``tests/e2e/test_pd_decode_cache.py``, ``test_7``): SGLang 0.5.23
        refuses a decode-side host tier only for SWA models (``kv_cache_builder.py:283``)."""
        sa = F.parse_args(F.base_argv("--enable-mamba-radix", "--disaggregation-mode", "decode",
                                      "--disaggregation-decode-enable-radix-cache", "--enable-hierarchical-cache"))
        self.assertTrue(sa.enable_hierarchical_cache)
        self.assertEqual(sa.radix_cache_backend, "mamba_radix_ext")

    def test_role_switch_accepted_with_the_decode_tree(self):
        """Served (``tests/e2e/test_pd_role_switch.py``): either role, with the decode-side tree;
        on CPU without overlap scheduling, as a PD prefill server runs there."""
        for mode, host in (("prefill", ()), ("decode", ()), ("prefill", ("--enable-hierarchical-cache",))):
            with self.subTest(mode=mode, host=host):
                sa = F.parse_args(F.base_argv("--enable-mamba-radix", "--disaggregation-mode", mode,
                                              "--disaggregation-decode-enable-radix-cache", "--enable-pd-role-switch",
                                              *host))
                self.assertTrue(sa.enable_pd_role_switch)
                self.assertEqual(sa.enable_hierarchical_cache, bool(host))
                self.assertEqual(sa.radix_cache_backend, "mamba_radix_ext")
                self.assertTrue(sa.disable_overlap_schedule)

    def test_decode_without_the_flag_is_sglangs(self):
        sa = F.parse_args(F.base_argv("--disaggregation-mode", "decode"))
        self.assertEqual(sa.disaggregation_mode, "decode")
        self.assertIsNone(sa.radix_cache_backend)


class TestSendKvChunkHook(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        F.apply_plugin_hooks()
        cls.ctx_on, _ = F.scheduler_context(F.base_argv("--enable-mamba-radix", *PREFILL))
        cls.ctx_off, _ = F.scheduler_context(F.base_argv(*PREFILL))

    def _call_hook(self, ctx, req):
        from sglang_mamba_ext.plugin.disaggregation import send_kv_chunk_around

        seen = []

        def original(scheduler, r, *args, **kwargs):
            seen.append(r.disagg_kv_sender.supports_host_tensor_indices)
            return "sent"

        with F.in_context(ctx):
            self.assertEqual(send_kv_chunk_around(original, object(), req, last_chunk=True), "sent")
        return seen

    def test_host_copy_branch_without_cuda_under_the_flag(self):
        with mock.patch("torch.cuda.is_available", return_value=False):
            self.assertEqual(self._call_hook(self.ctx_on, _fake_req()), [False])

    def test_inert_with_cuda_or_without_the_flag(self):
        with mock.patch("torch.cuda.is_available", return_value=True):
            self.assertEqual(self._call_hook(self.ctx_on, _fake_req()), [True])
        with mock.patch("torch.cuda.is_available", return_value=False):
            self.assertEqual(self._call_hook(self.ctx_off, _fake_req()), [True])

    def test_registered_on_sglangs_method(self):
        # The patched method runs the hook before SGLang's body, which then fails on this
        # bare scheduler: the sender was switched first.
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

        req = _fake_req()
        with mock.patch("torch.cuda.is_available", return_value=False), F.in_context(self.ctx_on):
            with self.assertRaises(AttributeError):
                SchedulerDisaggregationPrefillMixin._send_kv_chunk(SimpleNamespace(), req, last_chunk=True)
        self.assertIs(req.disagg_kv_sender.supports_host_tensor_indices, False)

    def test_sglang_branch_is_still_cuda_only(self):
        # When this fails, SGLang's branch no longer pins or records a CUDA event: the hook
        # can go (plugin/disaggregation.py).
        from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin

        src = inspect.getsource(inspect.unwrap(SchedulerDisaggregationPrefillMixin._send_kv_chunk))
        self.assertIn('getattr(sender, "supports_host_tensor_indices", False)', src)
        self.assertIn("pin_memory=True", src)
        self.assertIn("torch.cuda.Event()", src)


class TestWarmupEntersPrefillTree(unittest.TestCase):
    def setUp(self):
        F.apply_plugin_hooks()
        ctx, _ = F.scheduler_context(F.base_argv("--enable-mamba-radix", *PREFILL))
        stack = contextlib.ExitStack()
        stack.enter_context(F.in_context(ctx))
        self.addCleanup(stack.close)
        self.cache, _ = F.build_tree_cache(F.build_req_pool(), 512)

    def _req(self, rid):
        from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        return Req(rid, "", array("q", [5, 6, 7, 8]), SamplingParams(max_new_tokens=1, temperature=0.0),
                   bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_port=0, bootstrap_room=0)

    def test_only_the_plugins_warmup_is_let_in(self):
        from sglang_mamba_ext.plugin.settings import WARMUP_RID_PREFIX

        ours, sglangs = self._req(WARMUP_RID_PREFIX + "abc"), self._req("HEALTH_CHECK_abc")
        for req in (ours, sglangs):
            self.assertTrue(req.skip_radix_cache_insert)  # SGLang's rule for the fake host
            req.init_next_round_input(self.cache)  # the scheduler's admission match
        self.assertFalse(ours.skip_radix_cache_insert)
        self.assertTrue(sglangs.skip_radix_cache_insert)


if __name__ == "__main__":
    unittest.main()
