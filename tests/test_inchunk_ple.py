"""Qwen4-Exp's PLE side states at any offset (``plugin/inchunk_ple.py``, issue 40): the dilated
short-conv window and the n-gram history the plugin writes into a planned checkpoint slot equal
what SGLang's own extend (``Qwen4ExpPLELayer._short_conv``, ``_commit_ple_batch``,
``srt/models/qwen4_exp.py``) leaves in the working slot after a prefill of exactly that many tokens,
bit for bit, at every offset, and what a token-by-token shift of the window gives. SGLang's
functions run on a stand-in layer and pool (no server, no model)."""

import types
import unittest
from unittest import mock

import torch

from sglang_mamba_ext.plugin import inchunk_ple

#: channels (hidden * hc_count), kernel, dilation (ngram_size), n-gram history (ngram_size - 1)
C, K, D = 8, 4, 3
L = (K - 1) * D
CTX = D - 1
EOS = 2


def _qwen4_exp():
    from sglang.srt.models import qwen4_exp

    return qwen4_exp


class _Pool:
    """SGLang's pool calls the two functions make (``short_conv_layer_cache``,
    ``set_ngram_context``), the plugin's plan, and slot storage."""

    def __init__(self, slots=16, conv_dtype=torch.bfloat16, plan=None):
        self.conv = torch.zeros(slots + 1, C, L, dtype=conv_dtype)
        self.ctx = torch.full((slots + 1, CTX), EOS, dtype=torch.long)
        self.prefix_checkpoint_writer = plan is not None
        self._plan = plan or {}

    def short_conv_layer_cache(self, layer_id):
        return self.conv

    def set_ngram_context(self, idx, context):
        self.ctx[idx.long()] = context.to(self.ctx.dtype)

    def prefix_checkpoint_plan(self, forward_batch):
        return self._plan


def _layer(seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(C, 1, K, generator=gen)
    return types.SimpleNamespace(layer_id=0, conv_channels=C, short_conv_state_len=L, short_conv_dilation=D,
                                 conv1d=types.SimpleNamespace(weight=w))


def _batch(lengths, state_slots, tokens=None, history=None, mode=None):
    """A prefill ``_PLEBatch`` of rows ``lengths`` (packed), their working slots, and (for the
    n-gram history) the rows' tokens and start histories laid out as SGLang does."""
    q = _qwen4_exp()
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    lengths_t = torch.tensor(lengths, dtype=torch.long)
    total = int(lengths_t.sum())
    row_width = max(lengths)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths_t, 0)])
    pos = torch.arange(total)
    req = torch.searchsorted(starts, pos, right=True) - 1
    off = pos - starts[req]
    ctx = None
    if tokens is not None:
        padded = torch.full((len(lengths), row_width), EOS, dtype=torch.long)
        padded[req, off] = tokens
        ctx = torch.cat([history, padded], dim=1)
    return q._PLEBatch(mode=mode or ForwardMode.EXTEND, use_decode_fast_path=False, physical_tokens=total,
                       processed_tokens=total, lengths=lengths_t, row_width=row_width, req_indices=req,
                       token_offsets=off, valid_tokens=off < lengths_t[req],
                       state_indices=torch.tensor(state_slots, dtype=torch.long), ngram_context=ctx,
                       ngram_eos_token_id=EOS)


def _forward_batch(lengths):
    return types.SimpleNamespace(mamba_track_indices=None, mamba_track_mask=None, extend_seq_lens_cpu=list(lengths))


def _patched(pool):
    q = _qwen4_exp()
    from sglang.srt.model_executor import forward_context

    return mock.patch.multiple(q, get_req_to_token_pool=lambda: pool), \
        mock.patch.object(forward_context, "get_req_to_token_pool", lambda: pool)


class TestConvWindow(unittest.TestCase):
    def setUp(self):
        gen = torch.Generator().manual_seed(1)
        self.n = 40
        self.x = torch.randn(self.n, C, generator=gen).to(torch.bfloat16)
        self.start = torch.randn(C, L, generator=gen).to(torch.bfloat16)

    def test_every_offset_equals_token_by_token_shift(self):
        state = self.start.clone()
        for o in range(0, self.n + 1):
            self.assertTrue(torch.equal(inchunk_ple.conv_window_at(self.start, self.x, o), state), o)
            if o < self.n:
                state = torch.cat([state[:, 1:], self.x[o][:, None]], dim=1)

    def test_every_offset_equals_sglang_extend_of_that_length(self):
        """SGLang's own extend of ``o`` tokens from the start window leaves exactly the window the
        plugin writes for offset ``o`` of the whole row (bf16 inputs, bf16 and float32 pools)."""
        q = _qwen4_exp()
        layer = _layer()
        for conv_dtype in (torch.bfloat16, torch.float32):
            for o in range(1, self.n + 1):
                pool = _Pool(conv_dtype=conv_dtype)
                pool.conv[5] = self.start.to(conv_dtype)
                p1, p2 = _patched(pool)
                with p1, p2:
                    q.Qwen4ExpPLELayer._short_conv(layer, self.x[:o], _forward_batch([o]), _batch([o], [5]))
                want = inchunk_ple.conv_window_at(self.start.to(conv_dtype).to(self.x.dtype), self.x, o)
                self.assertTrue(torch.equal(pool.conv[5], want.to(conv_dtype)), (conv_dtype, o))

    def test_hook_writes_planned_slots_and_keeps_sglang_output(self):
        """The AROUND hook on a two-row extend: SGLang's output and working slots as without it,
        and each planned slot holding SGLang's own state after that many tokens of its row."""
        q = _qwen4_exp()
        layer = _layer(2)
        lengths = [23, 17]
        x = torch.cat([self.x[:23], self.x[5:22]])
        plan = {0: [(1, 9), (9, 10), (22, 11)], 1: [(4, 12), (17, 13)]}
        starts = [self.start, self.start.flip(1)]

        def run(with_plan):
            pool = _Pool(plan=plan if with_plan else None)
            pool.conv[3], pool.conv[4] = starts[0], starts[1]
            p1, p2 = _patched(pool)
            with p1, p2:
                out = inchunk_ple.short_conv_around(q.Qwen4ExpPLELayer._short_conv, layer, x,
                                                    _forward_batch(lengths), _batch(lengths, [3, 4]))
            return out, pool

        plain_out, plain = run(False)
        out, pool = run(True)
        self.assertTrue(torch.equal(out, plain_out))
        self.assertTrue(torch.equal(pool.conv[3:5], plain.conv[3:5]))
        rows = [x[:23], x[23:]]
        for row, items in plan.items():
            for o, slot in items:
                ref = _Pool()
                ref.conv[1] = starts[row]
                p1, p2 = _patched(ref)
                with p1, p2:
                    q.Qwen4ExpPLELayer._short_conv(layer, rows[row][:o], _forward_batch([o]), _batch([o], [1]))
                self.assertTrue(torch.equal(pool.conv[slot], ref.conv[1]), (row, o))


class TestNGramHistory(unittest.TestCase):
    def test_every_offset_equals_sglang_commit_of_that_length(self):
        q = _qwen4_exp()
        gen = torch.Generator().manual_seed(3)
        tokens = torch.randint(3, 700, (30,), generator=gen)
        tokens[11] = EOS  # an end of sequence inside the row
        for history in (torch.tensor([EOS, EOS]), torch.tensor([17, 401])):
            for o in range(1, len(tokens) + 1):
                pool = _Pool()
                p1, p2 = _patched(pool)
                with p1, p2:
                    q._commit_ple_batch(_batch([o], [6], tokens[:o], history[None]), _forward_batch([o]))
                self.assertTrue(torch.equal(pool.ctx[6], inchunk_ple.ngram_context_at(history, tokens, o)), o)

    def test_hook_writes_planned_slots(self):
        q = _qwen4_exp()
        gen = torch.Generator().manual_seed(4)
        lengths = [12, 7]
        tokens = torch.randint(3, 700, (19,), generator=gen)
        history = torch.tensor([[EOS, EOS], [33, 44]])
        plan = {0: [(1, 9), (12, 10)], 1: [(1, 11), (2, 12), (6, 13)]}
        pool = _Pool(plan=plan)
        p1, p2 = _patched(pool)
        with p1, p2:
            inchunk_ple.commit_ple_batch_around(q._commit_ple_batch, _batch(lengths, [3, 4], tokens, history),
                                                _forward_batch(lengths))
        rows = [tokens[:12], tokens[12:]]
        self.assertTrue(torch.equal(pool.ctx[3], rows[0][-2:]))  # SGLang's own commit still ran
        for row, items in plan.items():
            for o, slot in items:
                self.assertTrue(torch.equal(pool.ctx[slot], inchunk_ple.ngram_context_at(history[row], rows[row], o)))
        self.assertEqual(pool.ctx[11].tolist(), [44, int(rows[1][0])])


if __name__ == "__main__":
    unittest.main()
