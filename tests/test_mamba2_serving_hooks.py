"""Exact prefix checkpoints with SGLang's Mamba2 and short-conv backends
(``plugin/inchunk_conv_ssd.py``; issue 24, item 3): the hooks on SGLang's own kernels, driven
in-process on SGLang's real ``MambaPool`` (Mamba2 layout) with the pool's real
``prefix_checkpoint_plan``, write into each planned slot the conv window and SSM state that
SGLang's own kernels (``causal_conv1d_fn`` Triton, ``mamba_chunk_scan_combined``) leave after a
prefix ending at that offset, and leave SGLang's own results (the advanced working slots)
unchanged.

The layer is not SGLang's ``MambaMixer2`` (its constructor needs SGLang's parallel state): the
test makes the prefill calls ``MambaMixer2.forward`` makes (conv over the packed ``xBC`` with
``conv_states`` by keyword, then the chunked scan with the raw ``dt``, ``dt_bias``,
``initial_states`` and SGLang's own ``Mamba2Metadata`` chunk bookkeeping, then the SSM store),
each through the plugin's BEFORE hook as SGLang's HookRegistry would wrap it. The kernels run
under Triton's interpreter on CPU: in a subprocess started with ``TRITON_INTERPRET=1`` when
Triton was imported here without it.
"""

import os
import unittest
from types import SimpleNamespace

import torch

from conftest import FULL_SUITE, SGLANG_INSTALLED, requires_sglang
from sglang_mamba_ext.testing.spec_pair import triton_subprocess_case

_INTERPRETED = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
HV, P, N, G, W = 4, 8, 16, 2, 4
D = HV * P + 2 * G * N
CHUNK = 16
LAYER_IDS = (0, 2)
#: SGLang's own results (its kernels alone, no hook), shared by the tests of both classes: the
#: inputs are seeded, so they are the same in every test; keyed by what they depend on.
_SGLANG_RESULTS = {}


def _kernels():
    from sglang.kernels.ops.mamba.causal_conv1d_triton import causal_conv1d_fn
    from sglang.kernels.ops.mamba.triton_ops.ssd_combined import mamba_chunk_scan_combined

    from sglang_mamba_ext.plugin.triton_interpret import install_interpreter_shims

    install_interpreter_shims()
    return causal_conv1d_fn, mamba_chunk_scan_combined


def _hooked(fn, before, after=None):
    """``fn`` wrapped as SGLang's HookRegistry wraps a BEFORE (and an AFTER) hook."""
    def wrapper(*args, **kwargs):
        changed = before(*args, **kwargs)
        if changed is not None:
            args, kwargs = changed
        result = fn(*args, **kwargs)
        if after is not None:
            new = after(result, *args, **kwargs)
            result = result if new is None else new
        return result

    return wrapper


@requires_sglang
@unittest.skipUnless(_INTERPRETED, "kernels imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestMamba2HooksAgainstSGLang(unittest.TestCase):
    """The Triton writers (as on CUDA); ``TestMamba2HooksAgainstSGLangTorchWriter``: the torch
    writers (CPU serving's default, ``inchunk_checkpoints.writer_impl``)."""

    IMPL = "triton"

    def setUp(self):
        from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
        from sglang.srt.layers.attention.hybrid_linear_attn_backend import Mamba2AttnBackend
        from sglang.srt.mem_cache.memory_pool import MambaPool

        from sglang_mamba_ext.plugin import inchunk_checkpoints as ic
        from sglang_glue_fixtures import ExtendMode, planned_pool_standin

        torch.manual_seed(0)
        shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=HV * P, n_groups=G, num_heads=HV,
                                        head_dim=P, state_size=N, conv_kernel=W)
        cp = Mamba2CacheParams(shape=shape, layers=list(LAYER_IDS),
                               dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32))
        self.pool = MambaPool(size=10, spec_state_size=0, cache_params=cp, mamba_layer_ids=list(LAYER_IDS), device=DEV)
        with torch.no_grad():
            self.pool.mamba_cache.temporal.normal_()
            self.pool.mamba_cache.conv[0].normal_()
        self.mixers = []
        for _ in LAYER_IDS:
            self.mixers.append(SimpleNamespace(
                conv1d=SimpleNamespace(weight=torch.randn(D, 1, W, device=DEV) * 0.5,
                                       bias=torch.randn(D, device=DEV) * 0.1),
                A=-torch.rand(HV, device=DEV) - 0.2, dt_bias=torch.randn(HV, device=DEV) * 0.5,
                head_dim=P, ssm_state_size=N, activation="silu"))
        # request row -> planned (seqlen, slot): row 1 (no prefix, 37 new tokens): a branch
        # point at 7 and prompt-1 at 36 (inside SGLang's third 16-token chunk); row 2 (prefix
        # 10, 21 new): 29 inside this extend, 40 beyond it (not written now); row 3: none
        self.rtp = planned_pool_standin(self.pool, LAYER_IDS, {1: [(7, 4), (36, 5)], 2: [(29, 6), (40, 7)]},
                                        writer=True)
        self.backend = Mamba2AttnBackend.__new__(Mamba2AttnBackend)
        self.backend.req_to_token_pool = self.rtp
        setattr(self.backend, ic.WRITER_ATTR, "mamba2")
        setattr(self.backend, ic.IMPL_ATTR, self.IMPL)
        # batch rows: request rows 1, 2, 3 with working slots 2, 3, 1
        self.lens, self.prefix = [37, 21, 5], [0, 10, 0]
        self.slots = torch.tensor([2, 3, 1], dtype=torch.int32, device=DEV)
        self.backend.forward_metadata = SimpleNamespace(mamba_cache_indices=self.slots)
        self.fb = SimpleNamespace(
            forward_mode=ExtendMode(), req_pool_indices=torch.tensor([1, 2, 3], device=DEV),
            extend_prefix_lens_cpu=self.prefix, extend_seq_lens_cpu=self.lens,
            extend_prefix_lens=torch.tensor(self.prefix, device=DEV),
        )
        T = sum(self.lens)
        g = torch.Generator().manual_seed(1)
        self.xbc = [torch.randn(T, D, generator=g).to(DEV) for _ in LAYER_IDS]
        self.dt = [torch.randn(T, HV, generator=g).to(DEV) for _ in LAYER_IDS]
        self.qsl = torch.tensor([0, 37, 58, 63], dtype=torch.int32, device=DEV)
        self.start = (self.pool.mamba_cache.conv[0].clone(), self.pool.mamba_cache.temporal.clone())

    def _prefill(self, li, conv_fn, scan_fn):
        """The prefill calls of ``MambaMixer2.forward`` for layer ``LAYER_IDS[li]``."""
        from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata

        from sglang_mamba_ext.plugin.cpu_bridges import cpu_device_module

        cache = self.rtp.mamba2_layer_cache(LAYER_IDS[li])
        conv_state, ssm_state = cache.conv[0], cache.temporal
        m, T = self.mixers[li], sum(self.lens)
        has_init = self.fb.extend_prefix_lens > 0
        y = conv_fn(self.xbc[li].t(), m.conv1d.weight.view(D, W), m.conv1d.bias, activation="silu",
                    conv_states=conv_state, has_initial_state=has_init, cache_indices=self.slots,
                    query_start_loc=self.qsl, seq_lens_cpu=self.lens).t()
        x, B, C = torch.split(y, [HV * P, G * N, G * N], dim=-1)
        seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32, device=DEV), self.qsl.diff()).unsqueeze(0)
        chunk_indices, chunk_offsets = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(self.qsl, CHUNK, T)
        init = torch.where(has_init[:, None, None, None], ssm_state[self.slots], 0)
        out = torch.empty(1, T, HV, P, device=DEV)
        with cpu_device_module():
            res = scan_fn(x.reshape(1, T, HV, P), self.dt[li].unsqueeze(0), m.A, B.reshape(1, T, G, N),
                          C.reshape(1, T, G, N), chunk_size=CHUNK, D=None, z=None, dt_bias=m.dt_bias,
                          seq_idx=seq_idx, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
                          cu_seqlens=self.qsl, initial_states=init, return_varlen_states=True,
                          return_final_states=False, return_track_states=True, track_seq_idx=None,
                          track_end_locs=None, dt_softplus=True, dt_limit=(0.0, float("inf")), out=out,
                          state_dtype=ssm_state.dtype)
        ssm_state[self.slots] = res[1]  # (intermediate, varlen, track)

    def _forward(self, hooked: bool):
        from sglang_mamba_ext.plugin import inchunk_conv_ssd as ics

        conv_fn, scan_fn = _kernels()
        if hooked:
            conv_fn = _hooked(conv_fn, ics.conv_fn_before)
            scan_fn = _hooked(scan_fn, ics.ssd_scan_before, ics.ssd_scan_after)
        for li, lid in enumerate(LAYER_IDS):
            if hooked:
                ics.mamba2_forward_before(self.backend, self.mixers[li], None, None, lid, self.fb)
            self._prefill(li, conv_fn, scan_fn)
            if hooked:
                ics.mamba2_forward_after(None, self.backend)

    def _expected(self, li, start, row_start, n, src):
        """SGLang's kernels over the row's first ``n`` tokens from slot ``src``'s start states
        (``-1``: none), called as for a one-request prefill: the conv window and SSM state they
        leave (computed once per session: ``_SGLANG_RESULTS``)."""
        key = ("expected", li, row_start, n, src, self._inputs_key())
        if key not in _SGLANG_RESULTS:
            _SGLANG_RESULTS[key] = self._expected_uncached(li, start, row_start, n, src)
        return _SGLANG_RESULTS[key]

    def _inputs_key(self):
        """A fingerprint of the seeded inputs (they are equal in every test)."""
        weights = [t for m in self.mixers for t in (m.conv1d.weight, m.conv1d.bias, m.A, m.dt_bias)]
        return tuple(float(t.double().sum()) for t in (*self.start, *self.xbc, *self.dt, *weights))

    def _expected_uncached(self, li, start, row_start, n, src):
        from sglang.srt.layers.attention.mamba.mamba2_metadata import Mamba2Metadata

        from sglang_mamba_ext.plugin.cpu_bridges import cpu_device_module

        conv_fn, scan_fn = _kernels()
        m = self.mixers[li]
        win = (start[0][li, src].clone() if src >= 0 else torch.zeros(D, W - 1, device=DEV))[None]
        h0 = (start[1][li, src].clone() if src >= 0 else torch.zeros(HV, P, N, device=DEV))[None]
        xs = self.xbc[li][row_start:row_start + n]
        has = torch.tensor([src >= 0], device=DEV)
        y = conv_fn(xs.t().contiguous(), m.conv1d.weight.view(D, W), m.conv1d.bias, activation="silu",
                    conv_states=win, has_initial_state=has, cache_indices=torch.tensor([0], dtype=torch.int32,
                                                                                      device=DEV),
                    query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEV), seq_lens_cpu=[n]).t()
        x, B, C = torch.split(y.contiguous(), [HV * P, G * N, G * N], dim=-1)
        qsl = torch.tensor([0, n], dtype=torch.int32, device=DEV)
        chunk_indices, chunk_offsets = Mamba2Metadata._query_start_loc_to_chunk_indices_offsets(qsl, CHUNK, n)
        with cpu_device_module():
            res = scan_fn(x.reshape(1, n, HV, P).contiguous(), self.dt[li][row_start:row_start + n][None].contiguous(),
                          m.A, B.reshape(1, n, G, N).contiguous(), C.reshape(1, n, G, N).contiguous(),
                          chunk_size=CHUNK, D=None, z=None, dt_bias=m.dt_bias, initial_states=h0,
                          seq_idx=torch.zeros(1, n, dtype=torch.int32, device=DEV), chunk_indices=chunk_indices,
                          chunk_offsets=chunk_offsets, cu_seqlens=qsl, return_varlen_states=True,
                          dt_softplus=True, out=torch.empty(1, n, HV, P, device=DEV))
        return win[0], res[0]  # varlen states [1, HV, P, N]

    def test_planned_slots_hold_sglang_prefix_states_and_sglang_results_unchanged(self, from_chunks="1"):
        """Row 1's 36 and row 2's 19 (packed token 56) lie past a 16-token grid boundary inside
        their rows: written from the scan's own chunk states (issue 39) unless
        ``SGLANG_MAMBA_EXT_INCHUNK_FROM_CHUNKS=0``; the 7 from the row's start state."""
        from unittest import mock

        from sglang_mamba_ext.speculative.ops.inchunk import mamba2 as m2

        conv0, ssm0 = self.start
        key = ("stock", self._inputs_key())
        if key not in _SGLANG_RESULTS:
            self._forward(hooked=False)
            _SGLANG_RESULTS[key] = (self.pool.mamba_cache.conv[0].clone(), self.pool.mamba_cache.temporal.clone())
        stock = _SGLANG_RESULTS[key]
        self.pool.mamba_cache.conv[0].copy_(conv0)
        self.pool.mamba_cache.temporal.copy_(ssm0)
        with mock.patch.dict(os.environ, {"SGLANG_MAMBA_EXT_INCHUNK_FROM_CHUNKS": from_chunks}), \
                mock.patch.object(m2, "write_mamba2_tail_blocks", wraps=m2.write_mamba2_tail_blocks) as spy:
            self._forward(hooked=True)
        self.assertEqual([c.args[0].lay.item_off for c in spy.call_args_list],
                         [[W - 1 + 4, W - 1 + 8]] * len(LAYER_IDS) if from_chunks == "1" else [])
        conv, ssm = self.pool.mamba_cache.conv[0], self.pool.mamba_cache.temporal
        # SGLang's own results: the advanced working slots 2, 3, 1 and every other slot
        untouched = [s for s in range(conv.shape[1]) if s not in (4, 5, 6)]
        torch.testing.assert_close(conv[:, untouched], stock[0][:, untouched], rtol=0, atol=0)
        torch.testing.assert_close(ssm[:, untouched], stock[1][:, untouched], rtol=0, atol=0)
        # the planned slots: row 1 from zeros after 7 and 36 tokens; row 2 from slot 3 after 19
        for li in range(len(LAYER_IDS)):
            for row_start, n, src, slot in ((0, 7, -1, 4), (0, 36, -1, 5), (37, 19, 3, 6)):
                win, h = self._expected(li, self.start, row_start, n, src)
                torch.testing.assert_close(conv[li, slot], win, rtol=0, atol=0)
                torch.testing.assert_close(ssm[li, slot], h, rtol=1e-4, atol=1e-4)

    def test_without_the_scans_chunk_states(self):
        """The hooks' rescan from each row's start (the writer alone): with the torch writer by
        default; with the Triton writer (40 s interpreted) in the full suite, its kernel being
        checked against the reference at these boundaries in ``test_mamba2_inchunk.py``."""
        if self.IMPL == "triton" and not FULL_SUITE:
            self.skipTest("the Triton writer's rescan: SGLANG_MAMBA_EXT_FULL_SUITE=1 (docs/testing.md)")
        self.test_planned_slots_hold_sglang_prefix_states_and_sglang_results_unchanged(from_chunks="0")

    def test_short_conv_windows(self):
        """LFM2's path: ``conv_state_metadata`` opens the context, the conv hook writes the
        planned windows; they equal the windows SGLang's conv leaves after the prefix."""
        from sglang.srt.layers.attention.linear.short_conv_backend import ShortConvAttnBackend

        from sglang_mamba_ext.plugin import inchunk_checkpoints as ic
        from sglang_mamba_ext.plugin import inchunk_conv_ssd as ics

        conv_fn, _ = _kernels()
        backend = ShortConvAttnBackend.__new__(ShortConvAttnBackend)
        backend.req_to_token_pool = self.rtp
        backend.forward_metadata = self.backend.forward_metadata
        setattr(backend, ic.WRITER_ATTR, "shortconv")
        setattr(backend, ic.IMPL_ATTR, self.IMPL)
        hooked = _hooked(conv_fn, ics.conv_fn_before)
        for li, lid in enumerate(LAYER_IDS):
            ics.short_conv_metadata_after(None, backend, lid, self.fb)
            conv_state = self.rtp.mamba2_layer_cache(lid).conv[0]
            hooked(self.xbc[li].t().contiguous(), self.mixers[li].conv1d.weight.view(D, W), None,
                   query_start_loc=self.qsl, cache_indices=self.slots, has_initial_state=self.fb.extend_prefix_lens > 0,
                   conv_states=conv_state, activation=None, seq_lens_cpu=self.lens)
        conv = self.pool.mamba_cache.conv[0]
        for li in range(len(LAYER_IDS)):
            for row_start, n, src, slot in ((0, 7, -1, 4), (0, 36, -1, 5), (37, 19, 3, 6)):
                cols = torch.cat([self.start[0][li, src] if src >= 0 else torch.zeros(D, W - 1, device=DEV),
                                  self.xbc[li][row_start:row_start + n].t()], dim=1)
                torch.testing.assert_close(conv[li, slot], cols[:, -(W - 1):], rtol=0, atol=0)

    def test_no_context_no_plan_inert(self):
        """Without a plan (or on SGLang's own pool, no writer attribute) the hooks do nothing."""
        from sglang_mamba_ext.plugin import inchunk_conv_ssd as ics

        self.rtp.prefix_checkpoints = {}
        ics.mamba2_forward_before(self.backend, self.mixers[0], None, None, LAYER_IDS[0], self.fb)
        self.assertIsNone(ics._current())
        self.assertIsNone(ics.conv_fn_before(self.xbc[0].t(), None, None, conv_states=None))


class TestMamba2HooksAgainstSGLangTorchWriter(TestMamba2HooksAgainstSGLang):
    IMPL = "torch"


@requires_sglang
class TestMamba2HookTargets(unittest.TestCase):
    def test_targets_exist_in_sglang(self):
        import pkgutil

        from sglang_mamba_ext.plugin import inchunk_conv_ssd as ics

        for target, kind, name in ics.HOOK_TARGETS:
            self.assertTrue(callable(pkgutil.resolve_name(target)), target)
            self.assertTrue(callable(getattr(ics, name)))
            self.assertIn(kind, ("AFTER", "BEFORE"))


TestUnderTritonInterpreter = triton_subprocess_case(__file__, "Mamba2HooksAgainstSGLang",
                                                    skip=_INTERPRETED or not SGLANG_INSTALLED)


if __name__ == "__main__":
    unittest.main()
