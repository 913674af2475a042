"""In-chunk checkpoints from the prefill's chunk states (issue 39, item 1;
``speculative/ops/inchunk/from_chunks.py``): a checkpoint past its row's first chunk starts from
the state at the chunk boundary below it, as SGLang's chunked prefill computes it (``h``), and
steps at most ``chunk - 1`` tokens; the states equal the token scan from the extend start
(``impl="reference"``), for KDA and GDN, the torch writer and the Triton one (CPU: interpreted)."""

import unittest

import torch

from sglang_mamba_ext.speculative.ops.inchunk import plan_writes, write_checkpoints
from sglang_mamba_ext.speculative.ops.inchunk.from_chunks import gather_tail_blocks, split_plan
from sglang_mamba_ext.speculative.replay import ReplayWeights
from sglang_mamba_ext.testing.spec_pair import triton_subprocess_case
from conftest import FULL_SUITE
from test_inchunk_checkpoints import _CAN_RUN, DEV, _inputs, _mixers, _pools
from test_mamba2_inchunk import _CAN_RUN as _CAN_RUN_MAMBA2

#: (start, length, source slot, [(offset, destination)]) of the two rows of the packed extend;
#: past the first chunk, a few tokens after a boundary (129, 65, 66: the interpreted kernels'
#: cost is the tokens stepped), on one (32, 64) and at the row's end on the grid (160)
ROWS = [(0, 160, 1, [(3, 3), (129, 4), (32, 8), (64, 2), (160, 9)]), (160, 66, -1, [(2, 5), (0, 6), (65, 7), (66, 0)])]
T = 226


def _chunk_states(mixed, g_raw, b_raw, w, chunk, dtype=torch.float32):
    """``[L, NT, HV, K, V]``: the state at the start of every chunk of every row (rows in order,
    ``ceil(len / chunk)`` chunks each), from the reference scan, as SGLang's ``h`` holds them."""
    L = mixed.shape[0]
    firsts, items = [], []
    for lo, n, src, _ in ROWS:
        firsts.append(sum(len(i) for i in items))
        items.append([(c * chunk, 100 + len(firsts) * 50 + c) for c in range((n + chunk - 1) // chunk)])
    conv, temp = (torch.cat([t, t.new_zeros(L, 290, *t.shape[2:])], 1) for t in _pools(L, 10))  # the test's slot 1
    writes = plan_writes([(lo, src, it) for (lo, _, src, _), it in zip(ROWS, items)], DEV)
    write_checkpoints(mixed, g_raw, b_raw, writes, conv, temp, w, impl="reference")
    slots = [s for it in items for _, s in it]
    return temp[:, slots].to(dtype), firsts


class TestFromChunkStates(unittest.TestCase):
    def _case(self, gate, impl, chunk, dtype=torch.float32, tol=2e-5):
        L = 2
        w = ReplayWeights.from_mixers(_mixers(L, gate))
        mixed, g_raw, b_raw = _inputs(L, T, gate)
        h, firsts = _chunk_states(mixed, g_raw, b_raw, w, chunk, dtype)
        writes = plan_writes([(lo, src, it) for lo, _, src, it in ROWS], DEV)
        out = {}
        stats = {}
        for mode in ("reference", "chunks"):
            conv, temp = _pools(L, 10)
            if mode == "reference":
                write_checkpoints(mixed, g_raw, b_raw, writes, conv, temp, w, impl="reference")
            else:
                write_checkpoints(mixed, g_raw, b_raw, writes, conv, temp, w, impl=impl, chunk=chunk, stats=stats,
                                  chunk_states=h, first_chunks=firsts, row_lengths=[n for _, n, _, _ in ROWS])
            out[mode] = (conv, temp)
        torch.testing.assert_close(out["chunks"][0], out["reference"][0], rtol=0, atol=0)
        torch.testing.assert_close(out["chunks"][1], out["reference"][1], atol=tol, rtol=tol)
        return stats

    def test_torch_kda_and_gdn(self):
        st = self._case("kda", "torch", 16)
        # first-chunk checkpoints (3 | 2, 0) from the start states, then 129, 32, 64, 160 | 65,
        # 66 from h; 160, the row's end, on the grid: from the chunk state at 144 (16 tokens)
        self.assertEqual(st["scanned"], [3, 2, 0, 1, 0, 0, 16, 1, 2])
        self.assertEqual(st["chunks"], 0)  # no chunked pass
        st = self._case("gdn", "torch", 64)
        self.assertEqual(st["scanned"], [3, 32, 2, 0, 1, 0, 32, 1, 2])

    def test_half_precision_chunk_states(self):
        """SGLang's ``h`` is in the activations' dtype: a state rounded to fp16 stays within
        fp16 rounding of the exact one after the steps."""
        self._case("gdn", "torch", 16, torch.float16, tol=5e-3)

    @unittest.skipUnless(_CAN_RUN, "kernels already imported without the Triton interpreter")
    def test_triton_kda_and_gdn(self):
        self._case("kda", "triton", 16)
        if FULL_SUITE or torch.cuda.is_available():  # interpreted, ~30 s of CPU (KDA's ~15; the suite's budget)
            self._case("gdn", "triton", 64)

    def test_split_and_bad_inputs(self):
        now, tail = split_plan([0, 140], [[5, 131, -1], [70, 2, -1]], [[3, 4, -1], [5, 6, -1]], [140, 80], [0, 3],
                               64)
        self.assertEqual(now, ([0, 140], [[5], [2]], [[3], [6]]))
        self.assertEqual(tail, ([0, 140], [131, 70], [4, 5], [2, 4], [128, 64]))
        # a checkpoint at the row's end on the grid (128 of 128): no chunk starts there, so from 64
        now, tail = split_plan([0], [[128, 64]], [[3, 4]], [128], [0], 64)
        self.assertEqual((now[1], tail.offsets, tail.begins, tail.chunk_ids), ([[]], [128, 64], [64, 64], [1, 1]))
        # one grid over the packed tokens (Mamba2): row 1's 70 from the state at token 192 (b = 52)
        now, tail = split_plan([0, 140], [[5, 131, -1], [70, 2, 51]], [[3, 4, -1], [5, 6, 7]], [140, 80], None, 64)
        self.assertEqual(now, ([0, 140], [[5, -1], [2, 51]], [[3, -1], [6, 7]]))
        self.assertEqual(tail, ([0, 140], [131, 70], [4, 5], [2, 3], [128, 52]))
        # row 0's end at 128 (the next row's start): from the state at 64
        now, tail = split_plan([0, 128], [[128], [3]], [[3], [4]], [128, 10], None, 64)
        self.assertEqual((tail.offsets, tail.begins, tail.chunk_ids), ([128], [64], [1]))
        mixed, g_raw, b_raw = _inputs(1, 150, "gdn")
        with self.assertRaisesRegex(ValueError, "must lie in"):
            gather_tail_blocks((mixed, g_raw, b_raw), tail._replace(offsets=[131, 40]), 4, 64)
        w = ReplayWeights.from_mixers(_mixers(1, "gdn"))
        conv, temp = _pools(1, 10)
        with self.assertRaisesRegex(ValueError, "needs first_chunks and row_lengths"):
            write_checkpoints(mixed, g_raw, b_raw, plan_writes([(0, 1, [(70, 2)])], DEV), conv, temp, w,
                              impl="torch", chunk_states=temp[:, :3])



class TestMamba2FromChunkStates(unittest.TestCase):
    """The same for Mamba2, whose SSD scan keeps one chunk grid over the packed tokens: a
    checkpoint starts from the grid state below it when that lies inside its row."""

    def _case(self, impl):
        from test_mamba2_inchunk import _inputs as m2_inputs, _pools as m2_pools, _weights

        from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_checkpoints

        if impl == "triton" and not _CAN_RUN_MAMBA2:
            self.skipTest("kernels already imported without the Triton interpreter")
        L, chunk = 2, 16
        w = _weights(L)
        xbc, dt = m2_inputs(L, T)
        base = m2_pools(L, 10)
        # grid states: chunk c starts at packed token 16c; for c >= 1 the state of the row holding
        # token 16c - 1 after its tokens up to 16c (row 0: 0..160, row 1: 160..226)
        nc = (T + chunk - 1) // chunk
        split = ROWS[1][0]
        owner = [(0, 1, c * chunk) if c * chunk <= split else (1, -1, c * chunk - split) for c in range(nc)]
        conv, ssm = (torch.cat([t, t.new_zeros(L, nc, *t.shape[2:])], 1) for t in base)
        rows = {0: (0, 1, []), 1: (split, -1, [])}
        for c, (r, _, o) in enumerate(owner):
            rows[r][2].append((o, 10 + c))
        write_mamba2_checkpoints(xbc, dt, plan_writes([rows[0], rows[1]], DEV), conv, ssm, w, impl="reference")
        states = ssm[:, 10:].clone()
        writes = plan_writes([(lo, src, it) for lo, _, src, it in ROWS], DEV)
        out, stats = {}, {}
        for mode in ("reference", "chunks"):
            conv, ssm = (t.clone() for t in base)
            kw = dict(impl="reference") if mode == "reference" else dict(impl=impl, chunk=chunk, stats=stats,
                                                                           chunk_states=states,
                                                                           row_lengths=[n for _, n, _, _ in ROWS])
            write_mamba2_checkpoints(xbc, dt, writes, conv, ssm, w, **kw)
            out[mode] = (conv, ssm)
        torch.testing.assert_close(out["chunks"][0], out["reference"][0], rtol=0, atol=0)
        torch.testing.assert_close(out["chunks"][1], out["reference"][1], atol=2e-5, rtol=2e-5)
        return stats

    def test_torch(self):
        st = self._case("torch")
        # row 0 (start 0): 3 | 129 -> 128, 32 -> 32, 64 -> 64, 160 (its end, the grid start of
        # row 1) -> 144; row 1 (start 160): 2, 0 | 65 -> token 225, grid 224 (b = 64), 66 -> 64
        self.assertEqual(st["scanned"], [3, 2, 0, 1, 0, 0, 16, 1, 2])

    def test_triton(self):
        self._case("triton")


class TestBoundaryAtTheLastToken(unittest.TestCase):
    """A checkpoint on a chunk boundary that is also the longest row's last token, beside one
    that steps tokens (a Nemotron-H differential run hit this: an index past the prepared
    tokens): both writers' own pass, against the token scan."""

    def test_gdn_and_mamba2(self):
        from test_mamba2_inchunk import _inputs as m2_inputs, _pools as m2_pools, _weights

        from sglang_mamba_ext.speculative.ops.inchunk.mamba2 import write_mamba2_checkpoints

        writes = plan_writes([(0, -1, [(64, 2), (5, 3)]), (64, 1, [(30, 4)])], DEV)
        w = ReplayWeights.from_mixers(_mixers(1, "gdn"))
        mixed, g_raw, b_raw = _inputs(1, 100, "gdn")
        out = []
        for impl in ("reference", "torch"):
            conv, temp = _pools(1, 6)
            write_checkpoints(mixed, g_raw, b_raw, writes, conv, temp, w, impl=impl)
            out.append(temp)
        torch.testing.assert_close(out[1], out[0], atol=2e-5, rtol=2e-5)
        w2 = _weights(1)
        xbc, dt = m2_inputs(1, 100)
        out = []
        for impl in ("reference", "torch"):
            conv, ssm = m2_pools(1, 6)
            write_mamba2_checkpoints(xbc, dt, writes, conv, ssm, w2, impl=impl)
            out.append(ssm)
        torch.testing.assert_close(out[1], out[0], atol=2e-5, rtol=2e-5)


# the Triton tests, interpreted in a fresh process when Triton was imported here without it
TestUnderTritonInterpreter = triton_subprocess_case(__file__, "FromChunk and triton",
                                                    skip=_CAN_RUN and _CAN_RUN_MAMBA2)


if __name__ == "__main__":
    unittest.main()
