"""The Jet-Nemotron checkpoint writer (``plugin/inchunk_jet.py``) and the torch CPU version of the
JetBlock's recurrence (``plugin/cpu_kernels_jet.py``; issue 40).

- :class:`TestJetWriter` (no Triton): a checkpoint written at EVERY offset of a row, with and
  without a start state, equals a plain-torch reference of the JetBlock's state (the delta rule
  stepped in float64, the conv window from the raw values); resuming the recurrence from a
  checkpoint gives bit for bit the outputs and final state of the uninterrupted run (what a
  cached prefix must give); and the torch recurrence is call-independent (a sequence's states
  do not depend on the other sequences of the call or on its position in the packed tensors).
- :class:`TestJetRecurrenceVsTriton`: the torch version against SGLang's Triton kernel
  (``fla/fused_recurrent.py::fused_recurrent_gated_delta_rule_update``) under Triton's
  interpreter at small shapes (outputs and written-back states, with a ``-1`` row), and the
  writer through the Triton kernel: bit-equal resumption too. Runs in a fresh process with
  ``TRITON_INTERPRET=1`` (``TestJetUnderInterpreter``).
"""

import os
import unittest
from unittest import mock

import torch

from conftest import SGLANG_INSTALLED
from sglang_mamba_ext.plugin.cpu_kernels_jet import fused_recurrent_gated_delta_rule_update as torch_recurrent
from sglang_mamba_ext.plugin.inchunk_jet import write_jet_checkpoints
from sglang_mamba_ext.testing.spec_pair import triton_subprocess_case

_IN_INTERP = os.environ.get("TRITON_INTERPRET") == "1"
NO_CUDA = not torch.cuda.is_available()
SELECT = "VsTriton"
H, K, V, W = 2, 16, 32, 3  # heads, key / value head dims, conv window (conv_size 4)
LENS = [37, 5, 21]


def _inputs(T, seed=3, dtype=torch.float16):
    """The recurrence inputs as ``JetBlock.forward`` hands them over (``layer_inputs``): ``q, k``
    after SiLU, the conv output ``v``, float32 ``g`` (negative) and ``beta`` in the model dtype,
    plus the raw conv input ``v_raw [T, H V]``."""
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.silu(torch.randn(T, H, K, generator=g)).to(dtype)
    k = torch.nn.functional.silu(torch.randn(T, H, K, generator=g)).to(dtype)
    v = torch.randn(T, H, V, generator=g).to(dtype)
    v_raw = torch.randn(T, H * V, generator=g).to(dtype)
    gate = -torch.rand(T, H, generator=g) * 0.3
    beta = torch.sigmoid(torch.randn(T, H, generator=g)).to(dtype)
    return q, k, v_raw, v, gate, beta


def _reference_states(q, k, v, gate, beta, h0):
    """float64 state ``[H, V, K]`` after each token (index t: after t + 1 tokens)."""
    h = h0.double().clone()
    out = []
    for t in range(q.shape[0]):
        qt, kt = q[t].double(), k[t].double()
        kt = kt / torch.sqrt((kt * kt).sum(-1, keepdim=True) + 1e-6)
        h = h * torch.exp(gate[t].double())[:, None, None]
        vt = (v[t].double() - torch.einsum("hvk,hk->hv", h, kt)) * beta[t].double()[:, None]
        h = h + vt[:, :, None] * kt[:, None, :]
        out.append(h.clone())
    return out


def _pools(slots=12, seed=5):
    g = torch.Generator().manual_seed(seed)
    conv = torch.randn(slots, 2 * H * K + H * V, W, generator=g).half()
    temporal = torch.randn(slots, H, V, K, generator=g) * 0.1
    return conv, temporal


def _run(recurrent, q, k, v, gate, beta, pool, lens, slots):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    return recurrent(q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=gate.unsqueeze(0), beta=beta.unsqueeze(0),
                     initial_state_source=pool, initial_state_indices=torch.tensor(slots, dtype=torch.int32),
                     cu_seqlens=cu, use_qk_l2norm_in_kernel=True)


class WriterChecks:
    """The writer's checks, for a recurrence function ``RECURRENT`` (torch here, Triton below)."""

    RECURRENT = None
    LENS = LENS
    ATOL = 1e-5

    def _recurrent(self):
        return type(self).RECURRENT

    def test_every_offset_matches_reference(self):
        T = sum(self.LENS)
        q, k, v_raw, v, gate, beta = _inputs(T)
        conv, temporal = _pools()
        temporal[1] = 0  # row 1's working slot: a request without a prefix (cleared)
        conv[1] = 0
        start_slots = [0, 1, 2]
        windows = conv[start_slots, -H * V:, :]
        starts = [0, self.LENS[0], self.LENS[0] + self.LENS[1]]
        for r in range(3):
            a = starts[r]
            refs = _reference_states(q[a:], k[a:], v[a:], gate[a:], beta[a:], temporal[start_slots[r]])
            for off in range(1, self.LENS[r] + 1):
                c, s = conv.clone(), temporal.clone()
                n = write_jet_checkpoints(q, k, v_raw, v, gate, beta, windows, start_slots, c, s,
                                          [(r, starts[r], [(off, 9)])], recurrent=self._recurrent())
                self.assertEqual(n, 1)
                ref = refs[off - 1]
                torch.testing.assert_close(s[9].double(), ref, atol=self.ATOL, rtol=1e-4,
                                           msg=f"row {r} offset {off}")
                seq = torch.cat([windows[r].t(), v_raw[starts[r]:starts[r] + off]])
                self.assertTrue(torch.equal(c[9, -H * V:, :], seq[-W:].t()), (r, off))
                self.assertTrue(torch.equal(c[9, :-H * V], conv[9, :-H * V]))  # other channels untouched
                for other in range(12):
                    if other != 9:
                        self.assertTrue(torch.equal(s[other], temporal[other]), (r, off, other))

    def test_resume_from_checkpoint_is_bit_equal(self):
        T = sum(self.LENS)
        q, k, v_raw, v, gate, beta = _inputs(T, seed=4)
        conv, temporal = _pools(seed=6)
        slots = [0, 1, 2]
        full = temporal.clone()
        out_full = _run(self._recurrent(), q, k, v, gate, beta, full, self.LENS, slots)[0]
        starts = [0, self.LENS[0], self.LENS[0] + self.LENS[1]]
        windows = conv[slots, -H * V:, :]
        # every offset of every row at once (one call, checkpoints of several rows)
        dst, rows = 3, []
        for r in range(3):
            placed = []
            for o in range(1, self.LENS[r]):
                placed.append((o, dst))
                dst += 1
            rows.append((r, starts[r], placed))
        c = torch.zeros(dst, *conv.shape[1:], dtype=conv.dtype)
        s = torch.zeros(dst, *temporal.shape[1:])
        s[:3] = temporal[:3]
        write_jet_checkpoints(q, k, v_raw, v, gate, beta, windows, slots, c, s, rows, recurrent=self._recurrent())
        for r, start, placed in rows:
            for o, d in placed:
                # resume: the rest of the row from the checkpoint
                pool = s.clone()
                out = _run(self._recurrent(), q[start + o:start + self.LENS[r]], k[start + o:start + self.LENS[r]],
                           v[start + o:start + self.LENS[r]], gate[start + o:start + self.LENS[r]],
                           beta[start + o:start + self.LENS[r]], pool, [self.LENS[r] - o], [d])[0]
                self.assertTrue(torch.equal(pool[d], full[slots[r]]), (r, o))
                self.assertTrue(torch.equal(out, out_full[start + o:start + self.LENS[r]]), (r, o))


class TestJetWriter(WriterChecks, unittest.TestCase):
    RECURRENT = staticmethod(torch_recurrent)

    def test_torch_recurrence_is_call_independent(self):
        T = sum(LENS)
        q, k, _, v, gate, beta = _inputs(T, seed=8)
        _, temporal = _pools(seed=9)
        full = temporal.clone()
        out = _run(torch_recurrent, q, k, v, gate, beta, full, LENS, [0, 1, 2])[0]
        # the middle sequence alone, then behind other tokens
        alone = temporal.clone()
        a, b = LENS[0], LENS[0] + LENS[1]
        out1 = _run(torch_recurrent, q[a:b], k[a:b], v[a:b], gate[a:b], beta[a:b], alone, [b - a], [1])[0]
        self.assertTrue(torch.equal(alone[1], full[1]))
        self.assertTrue(torch.equal(out1, out[a:b]))

    def test_no_output_and_negative_rows(self):
        q, k, _, v, gate, beta = _inputs(6, seed=10)
        _, temporal = _pools(seed=11)
        pool = temporal.clone()
        out = _run(torch_recurrent, q, k, v, gate, beta, pool, [3, 3], [-1, 4])
        self.assertTrue(torch.equal(pool[torch.arange(12) != 4], temporal[torch.arange(12) != 4]))  # -1: not stored
        ref = _reference_states(q[:3], k[:3], v[:3], gate[:3], beta[:3], torch.zeros(H, V, K))
        o0 = torch.einsum("hvk,hk->hv", ref[0], (q[0].double() / torch.sqrt((q[0].double() ** 2).sum(-1, keepdim=True)
                                                                             + 1e-6)) * K ** -0.5)
        torch.testing.assert_close(out[0, 0].double(), o0, atol=2e-3, rtol=1e-2)
        pool2 = temporal.clone()
        small = torch_recurrent(q=q.unsqueeze(0), k=k.unsqueeze(0), v=v.unsqueeze(0), g=gate.unsqueeze(0),
                                beta=beta.unsqueeze(0), initial_state_source=pool2,
                                initial_state_indices=torch.tensor([-1, 4], dtype=torch.int32),
                                cu_seqlens=torch.tensor([0, 3, 6]), use_qk_l2norm_in_kernel=True,
                                disable_output_calculation=True)
        self.assertEqual(tuple(small.shape), (1, 1, 1, 1))
        self.assertTrue(torch.equal(pool2, pool))

    def test_bridge_routes(self):
        from sglang_mamba_ext.plugin import cpu_bridges, cpu_bridges_jet_nemotron

        calls = []
        sglang = lambda *a, **kw: calls.append("sglang")  # noqa: E731
        x = torch.zeros(1, 2, H, K)
        with mock.patch.dict(os.environ, {cpu_bridges.ACTIVE_ENV: "1", cpu_bridges.KERNELS_ENV: "torch"}), \
                mock.patch("torch.cuda.is_available", return_value=False), \
                mock.patch("sglang_mamba_ext.plugin.cpu_kernels_jet.fused_recurrent_gated_delta_rule_update",
                           lambda *a, **kw: calls.append("torch")):
            cpu_bridges_jet_nemotron.recurrent_update_around(sglang, q=x, k=x, v=x, g=x[..., 0], beta=x[..., 0])
            # a speculative call with a per-step state cache stays on SGLang's kernel
            cpu_bridges_jet_nemotron.recurrent_update_around(sglang, q=x, k=x, v=x, g=x[..., 0], beta=x[..., 0],
                                                             intermediate_states_buffer=x)
        with mock.patch.dict(os.environ, {cpu_bridges.ACTIVE_ENV: "1", cpu_bridges.KERNELS_ENV: "triton"}), \
                mock.patch("torch.cuda.is_available", return_value=False):
            cpu_bridges_jet_nemotron.recurrent_update_around(sglang, q=x, k=x, v=x, g=x[..., 0], beta=x[..., 0])
        self.assertEqual(calls, ["torch", "sglang", "sglang"])


def _triton_recurrent(*args, **kwargs):
    from sglang.kernels.ops.attention.fla.fused_recurrent import fused_recurrent_gated_delta_rule_update

    return fused_recurrent_gated_delta_rule_update(*args, **kwargs)


@unittest.skipUnless(_IN_INTERP and SGLANG_INSTALLED and NO_CUDA, "needs TRITON_INTERPRET=1 (runs in a subprocess)")
class TestJetRecurrenceVsTriton(WriterChecks, unittest.TestCase):
    """SGLang's Triton kernel (interpreted) as the writer's recurrence, and against the torch one."""

    RECURRENT = staticmethod(_triton_recurrent)
    LENS = [9, 2, 6]  # every offset still; fewer interpreted kernel calls
    test_every_offset_matches_reference = None  # the reference check runs with the torch version (TestJetWriter)

    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.plugin.cpu_bridges import MAMBA_KERNEL_MODULES
        from sglang_mamba_ext.plugin.triton_interpret import install_interpreter_shims

        install_interpreter_shims(extra_modules=MAMBA_KERNEL_MODULES)

    def test_torch_matches_triton(self):
        T = sum(LENS)
        q, k, _, v, gate, beta = _inputs(T, seed=12)
        _, temporal = _pools(seed=13)
        for slots in ([0, -1, 2], [5, 6, 7]):
            pools, outs = [], []
            for fn in (_triton_recurrent, torch_recurrent):
                p = temporal.clone()
                outs.append(_run(fn, q, k, v, gate, beta, p, LENS, slots)[0])
                pools.append(p)
            live = torch.cat([torch.arange(sum(LENS[:i]), sum(LENS[:i + 1])) for i in range(3) if slots[i] >= 0])
            self.assertEqual(outs[0].dtype, outs[1].dtype)
            torch.testing.assert_close(outs[1][live].float(), outs[0][live].float(), atol=2e-3, rtol=1e-2)
            torch.testing.assert_close(pools[1], pools[0], atol=1e-5, rtol=1e-4)


# opt-in (the suite's budget: about 2 minutes interpreted; Jet-Nemotron's served classes are opt-in
# too); the torch writer and recurrence above run in CI
TestJetUnderInterpreter = unittest.skipUnless(
    os.environ.get("SGLANG_MAMBA_EXT_ALL_FAMILIES") == "1",
    "SGLang's Triton recurrence interpreted (about 2 minutes): SGLANG_MAMBA_EXT_ALL_FAMILIES=1 runs it",
)(triton_subprocess_case(__file__, SELECT, skip=_IN_INTERP or not SGLANG_INSTALLED))
