"""The Mamba1 checkpoint writer (``sglang_mamba_ext/plugin/inchunk_mamba1.py``, issue 40:
Falcon-Mamba / Mamba on SGLang's ``Mamba2AttnBackend``) against transformers' formulation of the
selective scan (all tokens discretized at once, then the recurrence) and, bit for bit, against
SGLang's own scan (``MambaMixer1._selective_scan``); its BEFORE hook's guards; and, in a fresh
process, that SGLang's ``falcon_mamba`` module does not import on CPU until the CPU bridge has
bound the causal-conv names."""

import json
import subprocess
import sys
import types
import unittest

import torch

from conftest import SGLANG_INSTALLED
from sglang_mamba_ext.plugin.inchunk_mamba1 import reference_states, selective_scan_steps, write_mamba1_checkpoints

NO_CUDA = not torch.cuda.is_available()
D, N, W1 = 12, 5, 3  # channels, state size, conv window (conv_kernel - 1)


def _inputs(T=90, seed=0):
    g = torch.Generator().manual_seed(seed)
    conv_in = torch.randn(T, D, generator=g).half()
    conv_out = torch.randn(T, D, generator=g).half()
    dt = torch.randn(T, D, generator=g).half() - 1.0
    B = torch.randn(T, N, generator=g).half()
    A = -torch.exp(torch.randn(D, N, generator=g) * 0.5)
    conv_pool = torch.randn(8, D, W1, generator=g).half()
    ssm_pool = torch.randn(8, D, 1, N, generator=g)
    return conv_in, conv_out, dt, B, A, conv_pool, ssm_pool


class TestWriterVsRecurrence(unittest.TestCase):
    def test_rows_offsets_start_states_and_windows(self):
        conv_in, conv_out, dt, B, A, conv_pool, ssm_pool = _inputs()
        # two packed rows: one from zeros, one from slot 3; offsets unsorted, one shorter than
        # the window, one at the row's end
        rows = [(0, 50, -1, [(50, 1), (1, 2), (33, 4)]), (50, 40, 3, [(40, 5), (2, 6), (17, 7)])]
        cp, sp = conv_pool.clone(), ssm_pool.clone()
        write_mamba1_checkpoints(conv_in, conv_out, dt, B, A, cp, sp, rows, width=W1)
        for start, _, src, items in rows:
            n = max(o for o, _ in items)
            h0 = None if src < 0 else ssm_pool[src, :, 0, :]
            want = reference_states(conv_out[start:start + n], dt[start:start + n], A, B[start:start + n], h0,
                                    [o for o, _ in items])
            win0 = torch.zeros(D, W1).half() if src < 0 else conv_pool[src]
            seq = torch.cat([win0, conv_in[start:start + n].t()], dim=-1)
            for (o, dst), w in zip(sorted(items), want):
                torch.testing.assert_close(sp[dst, :, 0, :], w, atol=2e-5, rtol=1e-5, msg=f"row {start} offset {o}")
                # the window: the last W-1 raw inputs after o tokens, oldest first (the start
                # window's tail for o < W-1)
                torch.testing.assert_close(cp[dst], seq[:, o:o + W1], atol=0, rtol=0)
        untouched = [0, 3]
        torch.testing.assert_close(sp[untouched], ssm_pool[untouched], atol=0, rtol=0)
        torch.testing.assert_close(cp[untouched], conv_pool[untouched], atol=0, rtol=0)

    def test_half_pool_and_no_rows(self):
        conv_in, conv_out, dt, B, A, conv_pool, ssm_pool = _inputs(T=40, seed=1)
        sp = ssm_pool.half()
        write_mamba1_checkpoints(conv_in, conv_out, dt, B, A, conv_pool, sp, [(0, 40, 2, [(40, 0)])], width=W1)
        (want,) = reference_states(conv_out, dt, A, B, ssm_pool.half()[2, :, 0, :], [40])
        self.assertEqual(sp.dtype, torch.float16)
        torch.testing.assert_close(sp[0, :, 0, :].float(), want.half().float(), atol=2e-3, rtol=2e-3)
        before = sp.clone()
        write_mamba1_checkpoints(conv_in, conv_out, dt, B, A, conv_pool, sp, [], width=W1)
        self.assertTrue(torch.equal(sp, before))


@unittest.skipUnless(SGLANG_INSTALLED and NO_CUDA, "needs SGLang on a host without CUDA")
class TestSameAsSGLangScan(unittest.TestCase):
    """The writer's steps are SGLang's ``MambaMixer1._selective_scan`` operations: the state after
    ``o`` tokens equals (bit for bit) SGLang's scan over the first ``o`` tokens."""

    def test_bit_equal_to_sglang(self):
        from sglang_mamba_ext.plugin.cpu_bridges import bind_causal_conv

        bind_causal_conv()  # mamba1.py imports the names SGLang binds only on CUDA / NPU / XPU
        from sglang.srt.layers.attention.mamba.mamba1 import MambaMixer1

        conv_in, conv_out, dt, B, A, _, ssm_pool = _inputs(T=70, seed=2)
        x, dts, Bf = conv_out.float(), torch.nn.functional.softplus(dt.float()), B.float()
        C = torch.randn(70, N)
        for o in (1, 7, 64, 70):
            with self.subTest(offset=o):
                h0 = ssm_pool[4, :, 0, :].float()
                ref, _ = MambaMixer1._selective_scan(x=x[:o], dt=dts[:o], A=A, B=Bf[:o], C=C[:o], h0=h0)
                mine = selective_scan_steps(x, dts, A, Bf, h0, 0, o)
                self.assertTrue(torch.equal(mine, ref))
                cp, sp = torch.zeros(6, D, W1).half(), ssm_pool.clone()
                write_mamba1_checkpoints(conv_in, conv_out, dt, B, A, cp, sp, [(0, 70, 4, [(o, 5)])], width=W1)
                self.assertTrue(torch.equal(sp[5, :, 0, :], ref))


class _Pool:
    prefix_checkpoints = {0: [(5, 2)]}

    def __init__(self, plan):
        self.plan = plan

    def prefix_checkpoint_plan(self, forward_batch):
        return self.plan


class TestHookGuards(unittest.TestCase):
    def _batch(self, verify=False):
        mode = types.SimpleNamespace(is_target_verify=lambda: verify)
        return types.SimpleNamespace(forward_mode=mode)

    def test_inert_without_mark_or_plan(self):
        from sglang_mamba_ext.plugin.inchunk_checkpoints import WRITER_ATTR
        from sglang_mamba_ext.plugin.inchunk_mamba1 import mamba1_forward_before

        backend = types.SimpleNamespace(req_to_token_pool=_Pool({0: [(5, 2)]}))
        # no mark (SGLang's own cache, or a Mamba2 model): nothing read, nothing written
        self.assertIsNone(mamba1_forward_before(backend, None, None, None, 0, self._batch()))
        setattr(backend, WRITER_ATTR, "mamba2")
        self.assertIsNone(mamba1_forward_before(backend, None, None, None, 0, self._batch()))
        setattr(backend, WRITER_ATTR, "mamba1")
        self.assertIsNone(mamba1_forward_before(backend, None, None, None, 0, self._batch(verify=True)))
        backend.req_to_token_pool = _Pool({})
        self.assertIsNone(mamba1_forward_before(backend, None, None, None, 0, self._batch()))

    def test_refuses_a_mixer_that_is_not_mamba1(self):
        from sglang_mamba_ext.plugin.inchunk_checkpoints import WRITER_ATTR
        from sglang_mamba_ext.plugin.inchunk_mamba1 import mamba1_forward_before

        backend = types.SimpleNamespace(req_to_token_pool=_Pool({0: [(5, 2)]}))
        setattr(backend, WRITER_ATTR, "mamba1")
        mixer = types.SimpleNamespace(mamba_type="mamba2")
        with self.assertRaisesRegex(RuntimeError, "layer 3 is not a Mamba1 mixer"):
            mamba1_forward_before(backend, mixer, torch.zeros(4, 8), None, 3, self._batch())

    def test_is_mamba1_model(self):
        from sglang_mamba_ext.plugin.inchunk_mamba1 import is_mamba1_model

        def runner(*archs):
            return types.SimpleNamespace(model_config=types.SimpleNamespace(
                hf_config=types.SimpleNamespace(architectures=list(archs))))

        self.assertTrue(is_mamba1_model(runner("FalconMambaForCausalLM")))
        self.assertTrue(is_mamba1_model(runner("MambaForCausalLM")))
        self.assertFalse(is_mamba1_model(runner("Mamba2ForCausalLM")))
        self.assertFalse(is_mamba1_model(types.SimpleNamespace()))


_IMPORT_PROBE = r"""
import importlib, json
out = {}
try:
    importlib.import_module("sglang.srt.models.falcon_mamba")
    out["upstream"] = "imported"
except ImportError as e:
    out["upstream"] = str(e)
from sglang_mamba_ext.plugin.cpu_bridges import bind_causal_conv
bind_causal_conv()  # what the plugin's ModelRunner.__init__ bridge does before SGLang builds its registry
out["entry"] = [importlib.import_module(f"sglang.srt.models.{m}").EntryClass.__name__ for m in ("falcon_mamba", "mamba")]
print(json.dumps(out))
"""


@unittest.skipUnless(SGLANG_INSTALLED and NO_CUDA, "needs SGLang on a host without CUDA")
class TestMamba1ModulesImport(unittest.TestCase):
    """SGLang's gap: on CPU ``models/falcon_mamba.py`` does not import (its mixer imports the
    causal-conv names ``mamba.py`` binds only on CUDA / NPU / XPU), so its registry skips the
    Mamba1 classes (``models/registry.py:132``); with the names bound (the CPU bridge, before the
    scheduler's first ``get_model_architecture`` builds the registry) both modules import."""

    def test_gap_present_upstream_and_bridged(self):
        proc = subprocess.run([sys.executable, "-c", _IMPORT_PROBE], capture_output=True, text=True, timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        self.assertIn("causal_conv1d_fn", out["upstream"])
        self.assertEqual(out["entry"], ["FalconMambaForCausalLM", "MambaForCausalLM"])


if __name__ == "__main__":
    unittest.main()
