"""Exact prefix checkpoints with SGLang's KDA / GDN backends (``plugin/inchunk_checkpoints.py``):
the hooks driven in-process on SGLang's real ``MambaPool`` (KDA and GDN layouts), real
``RadixLinearAttention`` layers and real ``KDAAttnBackend`` / ``GDNAttnBackend`` objects (built
without their ``__init__``), with the pool's real ``prefix_checkpoint_plan``.

What is NOT exercised here: SGLang's own chunked extend (its Triton chunk kernels do not run
under Triton's CPU interpreter — ``kda_gate_chunk_cumsum`` calls device math the interpreter
lacks — and its CPU kernels need ``sgl_kernel``), so a stand-in for SGLang's forward advances
the working slots after the hook wrote the checkpoints; the expected states come from the
tiny model's mixer math from the same start states. The hook functions are called directly
(the process-wide HookRegistry is left alone); the Triton writer runs interpreted on CPU, in
a subprocess started with ``TRITON_INTERPRET=1`` when SGLang was imported first, and the torch
writer (CPU serving's default) in-process.
"""

import os
import unittest
from types import SimpleNamespace
from unittest import mock

import torch
import torch.nn.functional as F

from conftest import SGLANG_INSTALLED, requires_sglang
from sglang_glue_fixtures import ExtendMode, planned_pool_standin, small_cache_params

if SGLANG_INSTALLED:
    from sglang.srt.layers.attention.linear.gdn_backend import GDNAttnBackend
    from sglang.srt.layers.attention.linear.kda_backend import KDAAttnBackend
    from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
    from sglang.srt.mem_cache.memory_pool import MambaPool

    from sglang_mamba_ext.plugin import inchunk_checkpoints as ic
    from sglang_mamba_ext.plugin import inchunk_from_chunks as fc

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape
from sglang_mamba_ext.speculative.deferred import LAYOUTS
from sglang_mamba_ext.testing.spec_pair import load_triton_kernels_for_cpu, triton_subprocess_case


def _kernels_ready() -> bool:
    if not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"):
        return False
    if not load_triton_kernels_for_cpu():
        return False
    import sglang_mamba_ext.speculative.ops.inchunk.fused  # noqa: F401  (interpreted: env set at start)
    return True


_CAN_TRITON = _kernels_ready()
DEV = "cuda" if torch.cuda.is_available() else "cpu"
LAYER_IDS = (1, 3)


def _pool(layout):
    cp = small_cache_params(layout, LAYER_IDS)
    return MambaPool(size=8, spec_state_size=0, cache_params=cp, mamba_layer_ids=list(LAYER_IDS), device=DEV)


def _model_runner(rtp, **kw):
    return SimpleNamespace(req_to_token_pool=rtp, server_args=SimpleNamespace(disable_overlap_schedule=True),
                           device=DEV, model_config=SimpleNamespace(hf_config=SimpleNamespace()), **kw)


@requires_sglang
class TestInchunkHookKda(unittest.TestCase):
    """The writer as served: Triton (``SGLANG_MAMBA_EXT_INCHUNK_IMPL=triton``); the ``Torch``
    subclasses run the torch writer, the CPU default (``ic.writer_impl``)."""

    LAYOUT = "kda"
    IMPL = "triton"

    def setUp(self):
        if self.IMPL == "triton" and not _CAN_TRITON:
            self.skipTest("needs CUDA or TRITON_INTERPRET=1 from the start (see TestUnderTritonInterpreter)")
        env = mock.patch.dict(os.environ, {ic.IMPL_ENV: self.IMPL})
        env.start()
        self.addCleanup(env.stop)
        torch.manual_seed(0)
        self.pool = _pool(self.LAYOUT)
        with torch.no_grad():
            self.pool.mamba_cache.temporal.normal_()
            self.pool.mamba_cache.conv[0].normal_()
        shape = LinearAttnShape(2, 2, 8, 8, 4)
        self.mixers = [GatedDeltaRuleMixer(12, shape, gate=self.LAYOUT).to(DEV) for _ in LAYER_IDS]
        with torch.no_grad():
            for m in self.mixers:
                m.A_log.normal_(0, 0.5)
                m.dt_bias.normal_()
        self.layers = [
            RadixLinearAttention(lid, 2, 2, 2, 8, 8, 8, conv_weights=m.conv_weight.detach().reshape(48, 4), bias=None,
                                 A_log=m.A_log.detach(), dt_bias=m.dt_bias.detach())
            for lid, m in zip(LAYER_IDS, self.mixers)
        ]
        # request row -> planned (seqlen, slot): row 1 (no prefix, 20 new tokens): the
        # branch point at 7 and prompt-1 at 19; row 2 (prefix 10, 9 new): 14 inside this
        # extend, 30 beyond it (not written now)
        self.rtp = planned_pool_standin(self.pool, LAYER_IDS, {1: [(7, 4), (19, 5)], 2: [(14, 6), (30, 7)]},
                                        writer=False)
        cls = KDAAttnBackend if self.LAYOUT == "kda" else GDNAttnBackend
        self.backend = cls.__new__(cls)
        self.backend.req_to_token_pool = self.rtp
        self.backend.prefill_graph_metadata = None
        self.backend.supports_prefill_graph_extend = lambda: False
        # batch rows: request rows 1, 2, 3 with working slots 2, 3, 1
        self.lens, self.prefix = [20, 9, 5], [0, 10, 0]
        self.backend.forward_metadata = SimpleNamespace(
            mamba_cache_indices=torch.tensor([2, 3, 1], dtype=torch.int32, device=DEV))
        self.fb = SimpleNamespace(
            forward_mode=ExtendMode(), req_pool_indices=torch.tensor([1, 2, 3], device=DEV),
            extend_prefix_lens_cpu=self.prefix, extend_seq_lens_cpu=self.lens,
            extend_prefix_lens=torch.tensor(self.prefix, device=DEV),
        )

    def _inputs(self):
        x = torch.randn(sum(self.lens), 12, device=DEV)
        out = []
        with torch.no_grad():
            for m in self.mixers:
                mq, a, b = m.project_raw(x)
                if self.LAYOUT == "kda":  # SGLang's Kimi-Linear layer: a [1, T, HV, K], b [1, T, HV]
                    a, b = a.reshape(1, -1, 2, 8), b.unsqueeze(0)
                out.append((mq, a, b))
        return out

    def _views(self, l):
        c = self.pool.mamba2_layer_cache(l)
        return LAYOUTS[self.LAYOUT].replay_views(c.conv[0], c.temporal)

    def test_planned_checkpoints_written_before_sglang_forward(self):
        self._written_before_sglang_forward()

    def _written_before_sglang_forward(self, lower_bound=None):
        for layer in self.layers:
            layer.lower_bound = lower_bound
        ic.backend_init_after(None, self.backend, _model_runner(self.rtp))
        self.assertTrue(self.rtp.prefix_checkpoint_writer)
        self.assertEqual(getattr(self.backend, ic.WRITER_ATTR), self.LAYOUT)
        self.assertEqual(getattr(self.backend, ic.IMPL_ATTR), self.IMPL)
        before = [tuple(v.clone() for v in self._views(l)) for l in range(2)]
        calls = []

        def sglang_forward(backend, layer, fb, mq, a, b, **kw):
            calls.append((layer.layer_id, kw))
            conv, temp = self._views(LAYER_IDS.index(layer.layer_id))
            conv[[2, 3, 1]] = 9.0  # SGLang advances the working slots
            temp[[2, 3, 1]] = 9.0
            return "out"

        ins = self._inputs()
        for layer, (mq, a, b) in zip(self.layers, ins):
            self.assertIsNone(ic.forward_extend_before(self.backend, layer, self.fb, mq, a, b, linear_attn_output=None))
            self.assertEqual(sglang_forward(self.backend, layer, self.fb, mq, a, b, linear_attn_output=None), "out")
        self.assertEqual(calls, [(1, {"linear_attn_output": None}), (3, {"linear_attn_output": None})])
        starts = [0, 20, 29]
        for l, (m, (mq, a, b)) in enumerate(zip(self.mixers, ins)):
            conv, temp = self._views(l)
            a2, b2 = a.reshape(mq.shape[0], -1), b.reshape(mq.shape[0], -1)
            for row, src, items in ((0, None, [(7, 4), (19, 5)]), (1, 3, [(4, 6)])):
                lo, n = starts[row], self.lens[row]
                g, beta = m.activate_gates(a2[lo:lo + n], b2[lo:lo + n])
                if lower_bound is not None:  # SGLang's safe gate (fla/kda.py:1028), per key channel
                    f = (a2[lo:lo + n].float() + m.dt_bias.float()).unflatten(-1, (2, 8))
                    g = lower_bound * torch.sigmoid(m.A_log.float().exp()[:, None] * f)
                got = {}
                c0 = None if src is None else before[l][0][src]
                s0 = None if src is None else before[l][1][src].float()
                with torch.no_grad():
                    m.run_segments(mq[lo:lo + n], g, beta, c0, s0, cuts=[o for o, _ in items],
                                   on_cut=lambda o, c, S: got.__setitem__(o, (c.clone(), S.clone())))
                for o, slot in items:
                    exp_conv = got[o][0] if got[o][0] is not None else torch.zeros_like(conv[slot])
                    torch.testing.assert_close(conv[slot], exp_conv, atol=1e-5, rtol=1e-5)
                    torch.testing.assert_close(temp[slot], got[o][1], atol=1e-4, rtol=1e-4)
            # slot 7 (planned beyond this extend), 0 and 8 untouched
            for s in (0, 7, 8):
                torch.testing.assert_close(conv[s], before[l][0][s], rtol=0, atol=0)
                torch.testing.assert_close(temp[s], before[l][1][s], rtol=0, atol=0)

    def test_inert_without_the_mamba_radix_pool(self):
        rtp = SimpleNamespace(mamba2_layer_cache=self.rtp.mamba2_layer_cache)  # SGLang's own pool
        self.backend.req_to_token_pool = rtp
        ic.backend_init_after(None, self.backend, _model_runner(rtp))
        self.assertFalse(hasattr(self.backend, ic.WRITER_ATTR))
        before = self.pool.mamba_cache.temporal.clone()
        mq, a, b = self._inputs()[0]
        self.assertIsNone(ic.forward_extend_before(self.backend, self.layers[0], self.fb, mq, a, b))
        torch.testing.assert_close(self.pool.mamba_cache.temporal, before, rtol=0, atol=0)

    def test_refusals_keep_the_grid(self):
        mr = _model_runner(self.rtp)
        self.assertIsNone(ic.why_not_writer(self.backend, mr))
        mr.server_args.disable_overlap_schedule = False
        self.assertIsNone(ic.why_not_writer(self.backend, mr))  # overlap: every write is in a forward
        mr = _model_runner(self.rtp)
        mr.model_config.hf_config.kda_safe_gate = True
        self.assertIsNone(ic.why_not_writer(self.backend, mr))  # written through safe_gate_as_raw
        mr = _model_runner(self.rtp)
        mr.device = "cpu"
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0", ic.IMPL_ENV: "triton"}):
            self.assertIn("needs CUDA", ic.why_not_writer(self.backend, mr))
            ic.backend_init_after(None, self.backend, mr)  # refused: nothing set
        self.assertFalse(self.rtp.prefix_checkpoint_writer)
        self.assertFalse(hasattr(self.backend, ic.WRITER_ATTR))
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0", ic.IMPL_ENV: "auto"}):
            self.assertIsNone(ic.why_not_writer(self.backend, mr))  # the torch writer on CPU
        if self.LAYOUT == "kda":
            self.backend.supports_prefill_graph_extend = lambda: True
            target = "sglang.srt.layers.attention.hybrid_linear_attn_backend.check_cuda_graph_backend"
            with mock.patch(target, return_value=True):
                self.assertIn("breakable prefill CUDA graphs", ic.why_not_writer(self.backend, _model_runner(self.rtp)))
            with mock.patch(target, side_effect=RuntimeError("no context")):
                self.assertIn("could not check", ic.why_not_writer(self.backend, _model_runner(self.rtp)))
            with mock.patch(target, return_value=False):
                self.assertIsNone(ic.why_not_writer(self.backend, _model_runner(self.rtp)))
        base = type(self.backend)
        sub = type("Sub", (base,), {"forward_extend": lambda self, *a, **k: None})
        self.assertIn("overrides forward_extend", ic.why_not_writer(sub.__new__(sub), _model_runner(self.rtp)))

    def test_in_layer_writers_refused_under_prefill_graphs(self):
        """Jet-Nemotron / ZAYA1 / Qwen4-Exp / Inkling write from hooks inside the model's layer
        code, which a captured prefill graph replays without calling: on CUDA with SGLang's
        prefill graphs on (breakable, its default for text models; full, Inkling's) the writer
        is refused; with them disabled, or off CUDA, it is not."""
        from sglang_mamba_ext.plugin import inchunk_inkling

        target = "sglang.srt.model_executor.cuda_graph_config.check_cuda_graph_backend"
        for arch in ic.IN_LAYER_WRITER_CLASSES:
            mr = _model_runner(self.rtp)
            mr.device = "cuda"
            mr.model_config.hf_config.architectures = [arch]
            with self.subTest(arch=arch):
                with mock.patch(target, side_effect=lambda phase, b: b == "breakable"):
                    self.assertIn("breakable prefill CUDA graphs replay the layer", ic.why_not_writer(self.backend, mr))
                with mock.patch(target, side_effect=lambda phase, b: b == "full"):
                    self.assertIn("full prefill CUDA graphs", ic.prefill_graph_reason(mr))
                    self.assertIn("full prefill CUDA graphs", inchunk_inkling.why_not_writer(mr))
                with mock.patch(target, side_effect=lambda phase, b: b == "disabled"):
                    self.assertIsNone(ic.prefill_graph_reason(mr))
                mr.device = "cpu"
                with mock.patch(target, side_effect=AssertionError("not asked off CUDA")):
                    self.assertIsNone(ic.prefill_graph_reason(mr))
        mr = _model_runner(self.rtp)  # any other class: the check is not made here
        mr.device = "cuda"
        mr.model_config.hf_config.architectures = ["Qwen3NextForCausalLM"]
        with mock.patch(target, side_effect=lambda phase, b: b == "breakable"), \
                mock.patch.dict(os.environ, {ic.IMPL_ENV: "torch"}):
            self.assertNotIn("prefill CUDA graphs replay", ic.why_not_writer(self.backend, mr) or "")

    def test_safe_gate_checkpoints_equal_the_token_scan(self):
        """The KDA safe gate (``lower_bound``: Kimi-K3, GLM-5-Next, Ling-V3's ``kda_safe_gate``):
        every planned slot equals the token scan with ``lower_bound * sigmoid(exp(A_log) * (a +
        dt_bias))`` as its decay (the writer reads the raw gate ``safe_gate_as_raw`` gives)."""
        if self.LAYOUT != "kda":
            self.skipTest("the safe gate is KDA's")
        self._written_before_sglang_forward(lower_bound=-5.0)

    def test_safe_gate_as_raw_inverts_the_gate(self):
        torch.manual_seed(1)
        HV, K = 3, 4
        A_log, dt = torch.randn(HV) * 2, torch.randn(HV * K)
        a = torch.cat([torch.randn(50, HV * K) * 4, torch.full((1, HV * K), -80.0), torch.full((1, HV * K), 80.0)])
        for lb in (-5.0, -0.1):
            raw = ic.safe_gate_as_raw(a.half(), A_log, dt, lb)
            self.assertEqual((raw.dtype, raw.shape), (torch.float32, a.shape))
            x = (a.half().float() + dt).unflatten(-1, (HV, K))
            want = lb * torch.sigmoid(A_log.exp()[:, None] * x)
            got = -A_log.exp()[:, None] * F.softplus((raw + dt).unflatten(-1, (HV, K)))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


class TestInchunkHookGdn(TestInchunkHookKda):
    LAYOUT = "gdn"


class TestInchunkHookKdaTorch(TestInchunkHookKda):
    IMPL = "torch"


class TestInchunkHookGdnTorch(TestInchunkHookKda):
    LAYOUT, IMPL = "gdn", "torch"


class _StandinKernel:
    """Stand-in for SGLang's Triton extend kernel (its class name is what the glue checks)."""


@requires_sglang
class TestInchunkFromChunkStates(TestInchunkHookKda):
    """Issue 39: where SGLang's extend kernel returns its chunk states ``h``, checkpoints past a
    row's first chunk are written from ``h`` after the kernel (dispatcher BEFORE / AFTER hooks),
    the others before the forward; every planned slot equals the token scan from the start
    states (``impl="reference"``), and the caller gets the kernel's result as it asked."""

    IMPL = "torch"

    def setUp(self):
        super().setUp()
        # rows 1, 2, 3: 150 new tokens (no prefix), 128 (prefix 10), 5; offsets 7, 140 | 66, 20,
        # 128 (row 2's end, on the 64-token grid: no chunk starts there, so from the state at 64)
        self.lens, self.prefix = [150, 128, 5], [0, 10, 0]
        self.rtp.prefix_checkpoints = {1: [(7, 4), (140, 5)], 2: [(76, 6), (30, 7), (138, 8)]}
        self.fb.extend_seq_lens_cpu, self.fb.extend_prefix_lens_cpu = self.lens, self.prefix
        self.fb.extend_prefix_lens = torch.tensor(self.prefix, device=DEV)
        self.backend.mis_metadata = None

    def _dispatcher(self, kernel_name):
        kernel = type(kernel_name, (_StandinKernel,), {})()
        if self.LAYOUT == "kda":
            return SimpleNamespace(effective_extend_kernel=lambda lb, T, N: kernel, extend_kernel=kernel)
        return SimpleNamespace(extend_kernel=kernel)

    def _reference(self, l, w, mq, a, b, items, start_views):
        """Slots written by the token scan from the start states: ``{slot: (conv, state)}``, and
        ``h [1, NT, HV, V, K]`` (state at every 64-token chunk start of every row)."""
        from sglang_mamba_ext.speculative.ops.inchunk import plan_writes, write_checkpoints

        conv = torch.cat([start_views[0], start_views[0].new_zeros(40, *start_views[0].shape[1:])])
        temp = torch.cat([start_views[1], start_views[1].new_zeros(40, *start_views[1].shape[1:])])
        starts, srcs, rows, hs = [0, 150, 278], [-1, 3, -1], [], []
        for r, n in enumerate(self.lens):
            chunks = [(c * 64, 20 + len(hs) + c) for c in range((n + 63) // 64)]
            hs.extend(s for _, s in chunks)
            rows.append((starts[r], srcs[r], chunks + items.get(r, [])))
        T = mq.shape[0]
        write_checkpoints(mq.unsqueeze(0), a.reshape(T, -1).unsqueeze(0), b.reshape(T, -1).unsqueeze(0),
                          plan_writes(rows, DEV), conv.unsqueeze(0), temp.unsqueeze(0), w, impl="reference")
        return conv, temp, temp[hs].transpose(-1, -2).unsqueeze(0)

    def test_tails_written_from_the_kernels_chunk_states(self):
        self._tails_written_from_chunk_states()

    def test_safe_gate_tails_written_from_the_kernels_chunk_states(self):
        """The KDA safe gate on this path too: every slot equals the token scan fed the raw
        gate :func:`safe_gate_as_raw` gives (whose inversion its own test checks)."""
        if self.LAYOUT != "kda":
            self.skipTest("the safe gate is KDA's")
        self._tails_written_from_chunk_states(lower_bound=-5.0)

    def _tails_written_from_chunk_states(self, lower_bound=None):
        for layer in self.layers:
            layer.lower_bound = lower_bound
        ic.backend_init_after(None, self.backend, _model_runner(self.rtp))
        name = "TritonKDAKernel" if self.LAYOUT == "kda" else "TritonGDNKernel"
        self.backend.kernel_dispatcher = disp = self._dispatcher(name)
        ins = self._inputs()
        items = {0: [(7, 4), (140, 5)], 1: [(66, 6), (20, 7), (128, 8)]}
        for l, (layer, (mq, a, b)) in enumerate(zip(self.layers, ins)):
            before = tuple(v.clone() for v in self._views(l))
            from sglang_mamba_ext.speculative.replay import ReplayWeights

            w = ReplayWeights.from_mixers([self.mixers[l]])
            ref_a = a if lower_bound is None else ic.safe_gate_as_raw(
                a, self.mixers[l].A_log, self.mixers[l].dt_bias, lower_bound)
            ref_conv, ref_temp, h = self._reference(l, w, mq, ref_a, b, items, before)
            ic.forward_extend_before(self.backend, layer, self.fb, mq, a, b)
            self.assertIn(layer.layer_id, fc._pending_map())  # 140 and 66 wait for h
            conv, temp = self._views(l)
            for slot in (4, 7):  # inside the first chunk: written before the forward
                torch.testing.assert_close(temp[slot], ref_temp[slot], atol=1e-4, rtol=1e-4)
            kw = dict(layer_id=layer.layer_id, return_intermediate_states=False)
            got = fc.dispatch_extend_before(disp, "q", layer_id=layer.layer_id, return_intermediate_states=False)
            run_kw = got[1] if got is not None else kw
            self.assertEqual(run_kw["return_intermediate_states"], self.LAYOUT == "kda")
            conv[[2, 3, 1]] = 9.0  # the kernel advances the working slots
            temp[[2, 3, 1]] = 9.0
            result = ("o", h) if self.LAYOUT == "kda" else ("o", None, h)
            out = fc.dispatch_extend_after(result, disp, "q", **kw)
            self.assertEqual(out if out is not None else result, "o" if self.LAYOUT == "kda" else result)
            self.assertNotIn(layer.layer_id, fc._pending_map())
            for slot in (4, 5, 6, 7, 8):
                torch.testing.assert_close(conv[slot], ref_conv[slot].to(conv.dtype), atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(temp[slot], ref_temp[slot].to(temp.dtype), atol=1e-4, rtol=1e-4)
            for s in (0,):
                torch.testing.assert_close(temp[s], before[1][s], rtol=0, atol=0)

    def test_other_kernels_and_the_switch_keep_the_chunked_pass(self):
        ic.backend_init_after(None, self.backend, _model_runner(self.rtp))
        self.backend.kernel_dispatcher = self._dispatcher("FlashInferKernel")
        self.assertFalse(fc._kernel_gives_chunk_states(self.backend, self.layers[0], self.fb))
        self.backend.kernel_dispatcher = self._dispatcher("TritonKDAKernel" if self.LAYOUT == "kda"
                                                          else "TritonGDNKernel")
        self.assertTrue(fc._kernel_gives_chunk_states(self.backend, self.layers[0], self.fb))
        with mock.patch.dict(os.environ, {ic.FROM_CHUNKS_ENV: "0"}):
            self.assertFalse(fc._kernel_gives_chunk_states(self.backend, self.layers[0], self.fb))
        with self.assertRaisesRegex(RuntimeError, "no chunk states"):
            fc._pending_map()[99] = dict(backend=self.backend)
            fc.dispatch_extend_after("o", None, layer_id=99)

    test_planned_checkpoints_written_before_sglang_forward = None
    test_inert_without_the_mamba_radix_pool = None
    test_refusals_keep_the_grid = None
    test_safe_gate_layer_raises = None
    test_safe_gate_checkpoints_equal_the_token_scan = None  # this path's own safe-gate test above


class TestInchunkFromChunkStatesGdn(TestInchunkFromChunkStates):
    LAYOUT = "gdn"


@requires_sglang
class TestWriterImpl(unittest.TestCase):
    def test_auto_is_triton_on_cuda_torch_elsewhere_and_bad_values_fail(self):
        with mock.patch.dict(os.environ, {ic.IMPL_ENV: ""}):
            self.assertEqual(ic.writer_impl("cuda:1"), "triton")
            self.assertEqual(ic.writer_impl("cpu"), "torch")
        with mock.patch.dict(os.environ, {ic.IMPL_ENV: "Triton"}):
            self.assertEqual(ic.writer_impl("cpu"), "triton")
        with mock.patch.dict(os.environ, {ic.IMPL_ENV: "torch"}):
            self.assertEqual(ic.writer_impl("cuda"), "torch")
        with mock.patch.dict(os.environ, {ic.IMPL_ENV: "cuda"}):
            with self.assertRaisesRegex(ValueError, "SGLANG_MAMBA_EXT_INCHUNK_IMPL='cuda': expected one of auto, "
                                                    "triton, torch"):
                ic.writer_impl("cpu")


@requires_sglang
class TestHookTargets(unittest.TestCase):
    @staticmethod
    def _all_targets():
        """``(module, target, kind, name)`` for every writer's hook: this module's and each of
        :data:`KIND_MODULES`' (what ``register_inchunk_hooks`` registers)."""
        import importlib

        mods = [ic] + [importlib.import_module("sglang_mamba_ext.plugin." + m) for m in ic.KIND_MODULES]
        return [(m, *entry) for m in mods for entry in m.HOOK_TARGETS]

    @staticmethod
    def _resolve(target: str):
        """The object a dotted target names: its longest importable module prefix, then
        attributes (a method ``pkg.mod.Class.fn`` or a module function ``pkg.mod.fn``)."""
        import importlib

        parts = target.split(".")
        for i in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:i]))
            except ImportError:
                continue
            for attr in parts[i:]:
                obj = getattr(obj, attr)
            return obj
        raise ImportError(target)

    def test_targets_exist_in_sglang(self):
        entries = self._all_targets()
        self.assertEqual(len({m.__name__ for m, *_ in entries}), 1 + len(ic.KIND_MODULES))
        for m, target, kind, name in entries:
            with self.subTest(target=target, hook=name):
                self.assertTrue(callable(self._resolve(target)), target)
                self.assertTrue(callable(getattr(m, name)))
                self.assertIn(kind, ("AFTER", "BEFORE", "AROUND"))

    def test_one_around_hook_per_target(self):
        """With the deferred verify's hooks, no SGLang target gets two AROUND hooks (SGLang's
        HookRegistry warns at every start-up then)."""
        from collections import Counter

        from sglang_mamba_ext.plugin.speculative import HOOK_TARGETS as SPEC_TARGETS

        ours = [(t, kind) for _, t, kind, _ in self._all_targets()]
        arounds = Counter(t for t, kind in [*ours, *((t, k) for t, k, _ in SPEC_TARGETS)] if kind == "AROUND")
        self.assertEqual([t for t, n in arounds.items() if n > 1], [])


@requires_sglang
class TestMamba2ShortConvBackendLog(unittest.TestCase):
    """Issue 24, item 3: under --enable-mamba-radix a Mamba2 / short-conv backend becomes a
    checkpoint writer (one line naming the backend and the model class); a refusal logs one line
    naming the model class, the reason and the grid; without the flag, nothing."""

    def _runner(self, pool, **kw):
        sa = SimpleNamespace(chunked_prefill_size=64, disable_overlap_schedule=True)
        hf = SimpleNamespace(architectures=["NemotronHForCausalLM"])
        return SimpleNamespace(req_to_token_pool=pool, server_args=sa, device=kw.get("device", "cuda"),
                               model_config=SimpleNamespace(hf_config=hf))

    def _mamba2(self):
        from sglang.srt.layers.attention.hybrid_linear_attn_backend import Mamba2AttnBackend

        backend = Mamba2AttnBackend.__new__(Mamba2AttnBackend)
        backend._mamba_chunk_size = 128  # SGLang reads it from the config on first use
        return backend

    def _init_mamba2(self, env, **runner_kw):
        """Run the init hook on a fresh Mamba2 backend under ``env``; returns ``(backend,
        pool, log lines)``."""
        backend, pool = self._mamba2(), SimpleNamespace(prefix_checkpoint_writer=False)
        with mock.patch.dict(os.environ, env), self.assertLogs(ic.logger, level="INFO") as logs:
            ic.backend_init_after(None, backend, self._runner(pool, **runner_kw))
        return backend, pool, logs.output

    def test_mamba2_becomes_a_writer(self):
        backend, pool, output = self._init_mamba2({ic.IMPL_ENV: "auto"})
        self.assertEqual(output, [
            "INFO:sglang_mamba_ext.plugin.inchunk_checkpoints:mamba-radix: exact prefix checkpoints with "
            "Mamba2AttnBackend (in-chunk Triton writer) for NemotronHForCausalLM"])
        self.assertTrue(pool.prefix_checkpoint_writer)
        self.assertEqual(getattr(backend, ic.WRITER_ATTR), "mamba2")

    def test_mamba2_on_cpu_gets_the_torch_writer(self):
        backend, _, output = self._init_mamba2({"TRITON_INTERPRET": "0", ic.IMPL_ENV: "auto"}, device="cpu")
        self.assertEqual(output, [
            "INFO:sglang_mamba_ext.plugin.inchunk_checkpoints:mamba-radix: exact prefix checkpoints with "
            "Mamba2AttnBackend (in-chunk torch writer) for NemotronHForCausalLM"])
        self.assertEqual(getattr(backend, ic.IMPL_ATTR), "torch")

    def test_mamba2_refusal_names_family_reason_grid(self):
        backend, pool, output = self._init_mamba2({"TRITON_INTERPRET": "0", ic.IMPL_ENV: "triton"}, device="cpu")
        self.assertEqual(output, [
            "INFO:sglang_mamba_ext.plugin.inchunk_checkpoints:mamba-radix: NemotronHForCausalLM: prefix checkpoints "
            "stay on the 128-token grid with Mamba2AttnBackend: device cpu with SGLANG_MAMBA_EXT_INCHUNK_IMPL=triton "
            "(the Triton writer needs CUDA, or TRITON_INTERPRET=1)"])
        self.assertFalse(pool.prefix_checkpoint_writer)
        sub = type("Sub", (type(backend),), {"forward": lambda self, *a, **k: None})
        self.assertIn("overrides forward", ic.why_not_writer(sub.__new__(sub), self._runner(pool)))

    def test_short_conv_writer_grid_is_the_chunk_and_stock_pool_is_silent(self):
        from sglang.srt.layers.attention.linear.short_conv_backend import ShortConvAttnBackend

        backend = ShortConvAttnBackend.__new__(ShortConvAttnBackend)
        pool = SimpleNamespace(prefix_checkpoint_writer=False)
        with mock.patch.dict(os.environ, {"TRITON_INTERPRET": "0", ic.IMPL_ENV: "triton"}), \
                self.assertLogs(ic.logger, level="INFO") as logs:
            ic.backend_init_after(None, backend, self._runner(pool, device="cpu"))
        self.assertIn("on the 64-token grid with ShortConvAttnBackend: device cpu", logs.output[0])
        ic.backend_init_after(None, backend, self._runner(pool))
        self.assertEqual(getattr(backend, ic.WRITER_ATTR), "shortconv")
        with self.assertNoLogs(ic.logger, level="INFO"):  # SGLang's own pool: not the plugin's launch
            ic.backend_init_after(None, backend, self._runner(SimpleNamespace()))


TestUnderTritonInterpreter = triton_subprocess_case(__file__, "InchunkHook", skip=_CAN_TRITON)


if __name__ == "__main__":
    unittest.main()
