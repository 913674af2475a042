"""The CCA checkpoint writer (``sglang_mamba_ext/plugin/inchunk_cca.py``, issue 40: ZAYA1's
compressed convolutional attention on SGLang's ``ShortConvAttnBackend``): the state it stores
after every token offset of a prefill, for a row from zeros and a row from a cached start state,
against the windows by index and, bit for bit, against SGLang's own ``cca_extend``
(``srt/models/zaya.py``) run on the row's first ``offset`` tokens; that an extend resumed from a
checkpoint gives SGLang's outputs of the whole row (and from zeros it does not: the state
matters); and the BEFORE hook's guards."""

import types
import unittest

import torch

from conftest import SGLANG_INSTALLED
from sglang_mamba_ext.plugin.inchunk_cca import cca_extend_before, write_cca_checkpoints
from sglang_mamba_ext.speculative.ops.inchunk import plan_writes

HQ, HK, DIM, H, P = 4, 2, 8, 24, 2  # q / k heads, head dim, hidden, CCA padding (cca_time0 = cca_time1 = 2)
C = (HQ + HK) * DIM
SLOTS = 16
# two packed rows: row 0 (40 tokens) from zeros, row 1 (30 tokens) from slot 3
LENS, SRC = (40, 30), (-1, 3)


def _inputs(dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    qk = torch.randn(T, C, generator=g).to(dtype)
    hs = torch.randn(T, H, generator=g).to(dtype)
    conv_pool = torch.randn(SLOTS, C, P, generator=g).to(dtype)
    prev_pool = torch.randn(SLOTS, H, 1, generator=g).to(dtype)
    return qk, hs, conv_pool, prev_pool


def _writes(plan):
    """CheckpointWrites for ``plan`` = ``[[(offset, dst), ...] per row]`` over the packed rows."""
    starts = [0, LENS[0]]
    w = plan_writes([(s, 0, items) for s, items in zip(starts, plan)], "cpu")
    return w._replace(src_slots=torch.tensor(SRC, dtype=torch.int64))


class TestWriterWindows(unittest.TestCase):
    def test_every_offset_both_rows(self):
        """The stored ``conv[0]`` is the last ``P`` raw ``qk`` rows before the offset (the start
        window's columns where the offset is under ``P``), ``conv[1]`` the hidden row before it."""
        for dtype in (torch.float16, torch.float32):
            qk, hs, conv_pool, prev_pool = _inputs(dtype)
            start_conv, start_prev = conv_pool[3].clone(), prev_pool[3].clone()
            for o0 in range(1, max(LENS) + 1, 6):  # six offsets per row and pass (slots 4-9, 10-15)
                offs = [list(range(o0, min(o0 + 6, n + 1))) for n in LENS]
                plan = [[(o, 4 + k) for k, o in enumerate(offs[0])], [(o, 10 + k) for k, o in enumerate(offs[1])]]
                write_cca_checkpoints(qk, hs, _writes(plan), conv_pool, prev_pool)
                for row, items in enumerate(plan):
                    start = 0 if row == 0 else LENS[0]
                    win = torch.zeros(C, P, dtype=dtype) if row == 0 else start_conv
                    prev = torch.zeros(H, 1, dtype=dtype) if row == 0 else start_prev
                    seq = torch.cat([win, qk[start:start + LENS[row]].t()], dim=1)
                    for o, d in items:
                        with self.subTest(dtype=dtype, row=row, offset=o):
                            self.assertTrue(torch.equal(conv_pool[d], seq[:, o:o + P]))
                            self.assertTrue(torch.equal(prev_pool[d], hs[start + o - 1].unsqueeze(-1)))
            self.assertTrue(torch.equal(conv_pool[3], start_conv))  # the start slot is only read
            self.assertTrue(torch.equal(prev_pool[3], start_prev))


@unittest.skipUnless(SGLANG_INSTALLED, "SGLang is not installed")
class TestWriterVsSGLangCcaExtend(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from sglang.srt.models import zaya

        cls.zaya = zaya
        torch.manual_seed(1)
        cls.conv_qk = torch.nn.Sequential(
            torch.nn.Conv1d(C, C, 2, groups=C), torch.nn.Conv1d(C, C, 2, groups=HQ + HK)).half().eval()

    def _extend(self, qk, hs, conv_pool, prev_pool, slots, has_prefix, lens):
        with torch.no_grad():
            return self.zaya.cca_extend(qk, hs, self.conv_qk, conv_pool, prev_pool, list(slots), list(has_prefix),
                                        list(lens), P)

    def test_every_offset_bit_equal_to_cca_extend(self):
        """Each checkpoint equals the state SGLang's ``cca_extend`` stores after the row's first
        ``offset`` tokens (from the same start), at every offset of both rows."""
        qk, hs, conv_pool, prev_pool = _inputs()
        for row in (0, 1):
            start = 0 if row == 0 else LENS[0]
            for o in range(1, LENS[row] + 1):
                with self.subTest(row=row, offset=o):
                    plan = [[], []]
                    plan[row] = [(o, 5)]
                    mine_c, mine_p = conv_pool.clone(), prev_pool.clone()
                    write_cca_checkpoints(qk, hs, _writes(plan), mine_c, mine_p)
                    ref_c, ref_p = conv_pool.clone(), prev_pool.clone()
                    if row == 1:  # the working slot 6 holds the row's start state
                        ref_c[6], ref_p[6] = ref_c[3], ref_p[3]
                    self._extend(qk[start:start + o], hs[start:start + o], ref_c, ref_p, [6], [row == 1], [o])
                    self.assertTrue(torch.equal(mine_c[5], ref_c[6]))
                    self.assertTrue(torch.equal(mine_p[5], ref_p[6]))

    def test_resume_from_checkpoint_gives_the_whole_rows_outputs(self):
        """Both rows extended at once; then each row's tokens after a checkpoint, extended from
        it, give the same conv output and ``val_proj2`` input as the whole extend (close to the
        last bit: the conv runs over other lengths); from a zero state they differ."""
        qk, hs, conv_pool, prev_pool = _inputs()
        full_c, full_p = conv_pool.clone(), prev_pool.clone()
        full_c[7], full_p[7] = full_c[3], full_p[3]
        out, v2 = self._extend(qk, hs, full_c, full_p, [6, 7], [False, True], LENS)
        offs = [(1, 13, 39), (2, 17, 29)]
        plan = [[(o, 8 + k) for k, o in enumerate(offs[0])], [(o, 11 + k) for k, o in enumerate(offs[1])]]
        ck_c, ck_p = conv_pool.clone(), prev_pool.clone()
        write_cca_checkpoints(qk, hs, _writes(plan), ck_c, ck_p)
        for row, items in enumerate(plan):
            start = 0 if row == 0 else LENS[0]
            for o, d in items:
                with self.subTest(row=row, offset=o):
                    a, b = start + o, start + LENS[row]
                    got, got_v2 = self._extend(qk[a:b], hs[a:b], ck_c.clone(), ck_p.clone(), [d], [True], [b - a])
                    torch.testing.assert_close(got, out[a:b], rtol=0, atol=2e-3)
                    self.assertTrue(torch.equal(got_v2, v2[a:b]))
                    zero_c, zero_p = ck_c.clone(), ck_p.clone()
                    zero_c[d], zero_p[d] = 0, 0
                    cold, cold_v2 = self._extend(qk[a:b], hs[a:b], zero_c, zero_p, [d], [True], [b - a])
                    self.assertGreater((cold[:P] - out[a:a + P]).abs().max().item(), 1e-2)
                    self.assertFalse(torch.equal(cold_v2[0], v2[a]))


class TestHookGuards(unittest.TestCase):
    def test_inert_without_a_context(self):
        qk, hs, conv_pool, prev_pool = _inputs()
        before = conv_pool.clone()
        self.assertIsNone(cca_extend_before(qk, hs, None, conv_pool, prev_pool, [1], [False], [5], P))
        self.assertTrue(torch.equal(conv_pool, before))

    def test_refuses_other_state_tensors(self):
        from sglang_mamba_ext.plugin import inchunk_conv_ssd as ics

        qk, hs, conv_pool, prev_pool = _inputs()
        ctx = types.SimpleNamespace(kind="shortconv", conv_done=False, layer_id=0,
                                    cache=types.SimpleNamespace(conv=[conv_pool, prev_pool]))
        ics._local.ctx = ctx
        try:
            with self.assertRaisesRegex(RuntimeError, "cca_extend call is not the one expected"):
                cca_extend_before(qk, hs, None, conv_pool.clone(), prev_pool, [1], [False], [5], P)
        finally:
            ics._local.ctx = None


if __name__ == "__main__":
    unittest.main()
