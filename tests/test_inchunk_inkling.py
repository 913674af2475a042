"""The Inkling sconv checkpoint writer (``sglang_mamba_ext/plugin/inchunk_inkling.py``, issue 40):
at every offset of packed rows, with and without a start window, against a token-by-token torch
recurrence (shift the window, append the input) and, bit for bit, against the window SGLang's own
cache-update kernel (``models/inkling_common/kernels/sconv.py::update_sconv_cache``, Triton, run
under Triton's interpreter in a fresh process on CPU) leaves after the same prefix; and the
BEFORE hook's guards."""

import contextlib
import os
import types
import unittest

import torch

from conftest import SGLANG_INSTALLED
from sglang_mamba_ext.plugin.inchunk_inkling import reference_window, sconv_forward_before, write_sconv_checkpoints
from sglang_mamba_ext.testing.spec_pair import triton_subprocess_case

NO_CUDA = not torch.cuda.is_available()
_IN_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
D, W1 = 24, 3  # channels, conv window (sconv_kernel_size - 1)
SELECT = "TestWriterVsSGLangKernel"


def _inputs(T=70, slots=10, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).half()  # the activations' dtype (float16 served)
    pool = torch.randn(slots, W1, D, generator=g).to(dtype)  # Inkling's conv pool is bfloat16
    return x, pool


class TestWriterVsRecurrence(unittest.TestCase):
    def test_every_offset_from_zeros_and_from_a_window(self):
        x, pool = _inputs()
        for src in (-1, 2):
            start = torch.zeros(W1, D, dtype=pool.dtype) if src < 0 else pool[src].clone()
            for o in range(1, x.shape[0] + 1):
                p = pool.clone()
                write_sconv_checkpoints(x, p, [(0, x.shape[0], src, [(o, 7)])])
                self.assertTrue(torch.equal(p[7], reference_window(start, x, o)), f"offset {o} from {src}")
                others = [s for s in range(p.shape[0]) if s != 7]
                self.assertTrue(torch.equal(p[others], pool[others]), "only the planned slot is written")

    def test_packed_rows_several_checkpoints_each(self):
        x, pool = _inputs(T=90)
        # row 0: 50 tokens from zeros; row 1: 40 tokens from slot 3; offsets unsorted, one shorter
        # than the window, one at each row's end
        rows = [(0, 50, -1, [(50, 1), (1, 2), (33, 4)]), (50, 40, 3, [(40, 5), (2, 6), (17, 7)])]
        p = pool.clone()
        write_sconv_checkpoints(x, p, rows)
        for start, length, src, items in rows:
            base = torch.zeros(W1, D, dtype=pool.dtype) if src < 0 else pool[src]
            for o, dst in items:
                self.assertTrue(torch.equal(p[dst], reference_window(base, x[start:start + length], o)), (start, o))
        self.assertTrue(torch.equal(p[3], pool[3]), "the start window is read, not advanced")

    def test_float32_pool(self):
        x, pool = _inputs(dtype=torch.float32)
        p = pool.clone()
        write_sconv_checkpoints(x, p, [(0, 70, 1, [(5, 0)])])
        self.assertTrue(torch.equal(p[0], reference_window(pool[1], x, 5)))


class TestStoreCast(unittest.TestCase):
    def test_round_to_nearest_even_or_the_interpreters_truncation(self):
        from unittest import mock

        from sglang_mamba_ext.plugin.inchunk_inkling import store_cast

        x = torch.tensor([-1.30859375, 1.2900390625, 3.0], dtype=torch.float16)  # a tie, a round-up, exact
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0"}):
            self.assertTrue(torch.equal(store_cast(x, torch.bfloat16), x.to(torch.bfloat16)))
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "1"}):
            got = store_cast(x, torch.bfloat16)
        self.assertEqual(got.float().tolist(), [-1.3046875, 1.2890625, 3.0])  # toward zero
        self.assertTrue(torch.equal(store_cast(x, torch.float32), x.float()))


class TestHookGuards(unittest.TestCase):
    def _batch(self, extend=True, verify=False, draft=False):
        mode = types.SimpleNamespace(is_extend=lambda: extend, is_target_verify=lambda: verify,
                                     is_draft_extend_v2=lambda: draft)
        return types.SimpleNamespace(forward_mode=mode)

    def test_no_batch_decode_verify_and_draft_extend_return_at_once(self):
        x = torch.zeros(3, D)
        module = types.SimpleNamespace(layer_id=0, sconv_type=types.SimpleNamespace(value=4))
        self.assertIsNone(sconv_forward_before(module, x, None, None))
        for kw in (dict(extend=False), dict(verify=True), dict(draft=True)):
            self.assertIsNone(sconv_forward_before(module, x, None, self._batch(**kw)))  # no backend needed


@unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
class TestWhyNotWriter(unittest.TestCase):
    def test_cpu_writes_cuda_with_the_fused_prologue_does_not(self):
        from unittest import mock

        from sglang_mamba_ext.plugin.inchunk_inkling import why_not_writer

        self.assertIsNone(why_not_writer(types.SimpleNamespace(device="cpu")))
        runner = types.SimpleNamespace(device="cuda", server_args=types.SimpleNamespace(tp_size=1))
        graphs = "sglang.srt.model_executor.cuda_graph_config.check_cuda_graph_backend"
        with mock.patch(graphs, side_effect=lambda phase, b: b == "full"):  # SGLang's default for Inkling
            self.assertIn("full prefill CUDA graphs replay the layer", why_not_writer(runner))
        stack = contextlib.ExitStack()
        self.addCleanup(stack.close)
        stack.enter_context(mock.patch(graphs, side_effect=lambda phase, b: b == "disabled"))
        with mock.patch.dict(os.environ, {"SGLANG_OPT_USE_INKLING_FUSED_ATTN_PROLOGUE": "1"}):
            self.assertIn("fused attention prologue", why_not_writer(runner))
        with mock.patch.dict(os.environ, {"SGLANG_OPT_USE_INKLING_FUSED_ATTN_PROLOGUE": "0"}):
            self.assertIsNone(why_not_writer(runner))
            runner.server_args.tp_size = 2
            self.assertIn("--tp > 1", why_not_writer(runner))


@unittest.skipUnless(_IN_INTERP and SGLANG_INSTALLED and NO_CUDA, "needs TRITON_INTERPRET=1 (runs in a subprocess)")
class TestWriterVsSGLangKernel(unittest.TestCase):
    def test_window_equals_sglang_update_after_each_prefix(self):
        from sglang.srt.models.inkling_common.kernels.sconv import update_sconv_cache

        x, pool = _inputs(T=40, seed=3)
        for src in (-1, 4):
            for o in range(1, x.shape[0] + 1):
                w = pool.clone()
                write_sconv_checkpoints(x, w, [(0, x.shape[0], src, [(o, 8)])])
                # SGLang's update of the row's working slot after an extend of the first o tokens
                t = pool.clone()
                row = max(src, 0)
                update_sconv_cache(x[:o].contiguous(), t, torch.tensor([row], dtype=torch.int32),
                                   torch.tensor([src >= 0]), torch.tensor([0, o], dtype=torch.int32))
                self.assertTrue(torch.equal(w[8], t[row]), f"offset {o} from {src}")

    def test_packed_extend_rows(self):
        from sglang.srt.models.inkling_common.kernels.sconv import update_sconv_cache

        x, pool = _inputs(T=30, seed=4)
        lens, srcs = [12, 2, 16], [1, -1, 6]
        starts = [0, 12, 14]
        t = pool.clone()
        slots = [1, 0, 6]  # the no-prefix row's working slot: 0
        update_sconv_cache(x, t, torch.tensor(slots, dtype=torch.int32), torch.tensor([s >= 0 for s in srcs]),
                           torch.tensor([0, 12, 14, 30], dtype=torch.int32))
        w = pool.clone()
        write_sconv_checkpoints(x, w, [(starts[i], lens[i], srcs[i], [(lens[i], 7 + i)]) for i in range(3)])
        for i in range(3):
            self.assertTrue(torch.equal(w[7 + i], t[slots[i]]), f"row {i}")


# opt-in (the suite's budget; Inkling's served classes are opt-in too); the torch writer above runs in CI
TestInklingWriterUnderInterpreter = unittest.skipUnless(
    os.environ.get("SGLANG_MAMBA_EXT_ALL_FAMILIES") == "1",
    "SGLang's Triton sconv kernel interpreted: SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it",
)(triton_subprocess_case(__file__, SELECT, skip=_IN_INTERP or not SGLANG_INSTALLED))
