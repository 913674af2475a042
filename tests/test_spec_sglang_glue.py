"""SGLang glue of --mamba-spec-state-update (sglang_mamba_ext/plugin/speculative): flag handling,
start-up refusals, pool construction with one-layer buffers, and the verify -> commit ->
replay -> release path on a real SGLang ``MambaPool`` (KDA layout) with fake batch objects.

The hook functions are called directly (the process-wide HookRegistry is left alone), except
in one subprocess test that applies them to SGLang and parses a real command line.
"""

import os
import subprocess
import sys
import textwrap
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from conftest import SGLANG_INSTALLED, requires_sglang
from sglang_glue_fixtures import small_cache_params

# Skipped only where SGLang is not installed; an installed SGLang that fails to import
# fails this module.
if SGLANG_INSTALLED:
    from sglang.srt.mem_cache.memory_pool import MambaPool

    from sglang_mamba_ext.plugin.speculative import HOOK_TARGETS, hook_function, hooks

from sglang_mamba_ext.models.linear_attn import GatedDeltaRuleMixer, LinearAttnShape
from sglang_mamba_ext.speculative.replay import ReplayWeights, replay
from sglang_mamba_ext.speculative.stash import ActivationStash, StashDims

from sglang_mamba_ext.testing.spec_pair import load_triton_kernels_for_cpu, triton_subprocess_case  # noqa: E402

# With SGLang imported in this process, Triton's interpreter cannot be switched on for our
# kernels alone (SGLang's own Triton modules were set up compiled); on a CPU host the Triton
# part of these tests runs in a fresh process started with TRITON_INTERPRET=1 instead.
_CAN_TRITON = (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1") and load_triton_kernels_for_cpu()
_CAN_TRITON_INPROC = _CAN_TRITON
SELECT = 'CommitReplayPath'
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _deferred(value="deferred"):
    return mock.patch.object(hooks, "_server_args", return_value=SimpleNamespace(_mamba_spec_state_update=value))


class _Mode:
    def __init__(self, idle=False, extend=False):
        self._idle, self._extend = idle, extend

    def is_idle(self):
        return self._idle

    def is_extend(self):
        return self._extend


@requires_sglang
class TestKernelImpl(unittest.TestCase):
    """``hooks.kernel_impl``: the deferred update's Triton kernels on CUDA; on CPU their torch
    forms unless ``SGLANG_MAMBA_EXT_CPU_KERNELS=triton`` (then Triton's interpreter)."""

    def test_cpu_torch_unless_triton_asked_cuda_triton(self):
        with mock.patch.dict(os.environ):
            os.environ.pop(hooks.CPU_KERNELS_ENV, None)
            self.assertEqual(hooks.kernel_impl(torch.zeros(1)), "torch")
            self.assertEqual(hooks.kernel_impl(torch.device("cuda")), "triton")  # by device type
            os.environ[hooks.CPU_KERNELS_ENV] = " Triton "
            self.assertEqual(hooks.kernel_impl(torch.zeros(1)), "triton")
            os.environ[hooks.CPU_KERNELS_ENV] = "torch"
            self.assertEqual(hooks.kernel_impl(torch.device("cpu")), "torch")


@requires_sglang
class TestFlags(unittest.TestCase):
    def sa(self, **kw):
        base = dict(speculative_algorithm="FROZEN_KV_MTP", enable_linear_replayssm_spec=False,
                    enable_linear_replayssm=False, disable_overlap_schedule=True)
        base.update(kw)
        return SimpleNamespace(**base)

    def test_valid_and_default(self):
        hooks.validate_flags(self.sa(), "deferred")
        hooks.validate_flags(self.sa(speculative_algorithm=None, disable_overlap_schedule=False), "snapshot")
        res = self.sa()
        hooks.from_cli_args_after(res, object, SimpleNamespace(mamba_spec_state_update="deferred"))
        self.assertEqual(res._mamba_spec_state_update, "deferred")
        res = self.sa()
        hooks.from_cli_args_after(res, object, SimpleNamespace())  # flag absent -> snapshot, no attribute
        self.assertNotIn("_mamba_spec_state_update", vars(res))
        self.assertEqual(hooks.mode(res), "snapshot")
        self.assertFalse(hooks.deferred_active(res))

    def test_refused_combinations_name_the_flags(self):
        cases = [
            (dict(speculative_algorithm=None), "--speculative-algorithm FROZEN_KV_MTP"),
            (dict(speculative_algorithm="NGRAM"), "--speculative-algorithm FROZEN_KV_MTP, NEXTN or EAGLE only, got NGRAM"),
            (dict(enable_linear_replayssm_spec=True), "--enable-linear-replayssm-spec"),
            (dict(enable_linear_replayssm=True), "--enable-linear-replayssm"),
            (dict(disable_overlap_schedule=False), "--disable-overlap-schedule"),
        ]
        for kw, needle in cases:
            with self.subTest(kw=kw):
                with self.assertRaises(hooks.DeferredSpecConfigError) as cm:
                    hooks.validate_flags(self.sa(**kw), "deferred")
                self.assertIn("--mamba-spec-state-update", str(cm.exception))
                self.assertIn(needle, str(cm.exception))
        with self.assertRaises(hooks.DeferredSpecConfigError):
            hooks.validate_flags(self.sa(), "eager")

    def test_model_checks_at_start_up(self):
        spec = SimpleNamespace(speculative_algorithm="FROZEN_KV_MTP")
        with _deferred(), mock.patch("sglang.srt.runtime_context.get_spec", return_value=spec), \
                mock.patch("sglang.srt.configs.hybrid_arch.mambaish_config", side_effect=lambda c: c.ssm):
            hooks.model_runner_init_after(None, SimpleNamespace(model_config=SimpleNamespace(ssm=object()), is_draft_worker=False))
            hooks.model_runner_init_after(None, SimpleNamespace(model_config=SimpleNamespace(ssm=None), is_draft_worker=True))
            with self.assertRaisesRegex(hooks.DeferredSpecConfigError, "hybrid model"):
                hooks.model_runner_init_after(None, SimpleNamespace(model_config=SimpleNamespace(ssm=None, model_path="m"), is_draft_worker=False))
            with self.assertRaisesRegex(hooks.DeferredSpecConfigError, "draft model without Mamba.*--speculative-draft-model-path"):
                hooks.model_runner_init_after(None, SimpleNamespace(model_config=SimpleNamespace(ssm=object()), is_draft_worker=True))
            # NEXTN resolves to EAGLE (SGLang's EAGLE worker has its replay point too)
            for algo in ("EAGLE", "NEXTN"):
                spec.speculative_algorithm = algo
                hooks.model_runner_init_after(None, SimpleNamespace(model_config=SimpleNamespace(ssm=object()),
                                                                    is_draft_worker=False))
            for algo in ("STANDALONE", "EAGLE3"):
                spec.speculative_algorithm = algo
                with self.assertRaisesRegex(hooks.DeferredSpecConfigError, f"FROZEN_KV_MTP, NEXTN or EAGLE only.*{algo}"):
                    hooks.model_runner_init_after(None, SimpleNamespace(model_config=SimpleNamespace(ssm=object()),
                                                                        is_draft_worker=False))
        # snapshot: nothing is checked
        with _deferred("snapshot"):
            hooks.model_runner_init_after(None, SimpleNamespace(model_config=None, is_draft_worker=False))

    def test_draft_layers_read_off_the_loaded_model(self):
        # a model's own MTP head is loaded with the target's hybrid config (mambaish_config is
        # not None) but builds attention layers only: the loaded modules decide
        from sglang.srt.layers.radix_linear_attention import RadixLinearAttention

        class Attn(torch.nn.Module):
            pass

        mtp = torch.nn.Sequential(torch.nn.Linear(2, 2), Attn())
        linear = torch.nn.Sequential(Attn(), RadixLinearAttention(0, 1, 1, 1, 4, 4, 4))
        spec = SimpleNamespace(speculative_algorithm="EAGLE")
        with _deferred(), mock.patch("sglang.srt.runtime_context.get_spec", return_value=spec), \
                mock.patch("sglang.srt.configs.hybrid_arch.mambaish_config", side_effect=lambda c: c.ssm):
            hooks.model_runner_init_after(None, SimpleNamespace(model_config=SimpleNamespace(ssm=object()), model=mtp,
                                                                is_draft_worker=True))
            with self.assertRaisesRegex(hooks.DeferredSpecConfigError, "draft model without Mamba.*has 1: 1"):
                hooks.model_runner_init_after(None, SimpleNamespace(model_config=SimpleNamespace(ssm=None), model=linear,
                                                                    is_draft_worker=True))
        self.assertEqual(hooks.model_state_layers(linear), ["1"])
        self.assertEqual(hooks.model_state_layers(mtp), [])

    def test_replay_point_on_every_worker_entry(self):
        # one BEFORE hook per speculative worker's round entry, FrozenKVMTP's and EAGLE's;
        # FrozenKVMTPWorkerV2 overrides EAGLE's method (one replay a round, not two)
        from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
        from sglang.srt.speculative.frozen_kv_mtp_worker_v2 import FrozenKVMTPWorkerV2

        hooked = {t for t, kind, name in HOOK_TARGETS if name == "worker_forward_before" and kind == "BEFORE"}
        self.assertEqual(hooked, set(hooks.WORKER_ENTRY_POINTS))
        self.assertIn("forward_batch_generation", FrozenKVMTPWorkerV2.__dict__)
        self.assertTrue(issubclass(FrozenKVMTPWorkerV2, EAGLEWorkerV2))

    def test_hook_targets_exist_in_sglang(self):
        import importlib

        for target, kind, name in HOOK_TARGETS:
            mod_path, _, attr = target.rpartition(".")
            obj = None
            parts = mod_path.split(".")
            for i in range(len(parts), 0, -1):
                try:
                    obj = importlib.import_module(".".join(parts[:i]))
                except ModuleNotFoundError as e:  # an attribute path, not a module
                    if e.name != ".".join(parts[:i]):
                        raise  # a module that exists but fails to import: SGLang is broken
                    continue
                for p in parts[i:]:
                    obj = getattr(obj, p)
                break
            self.assertTrue(hasattr(obj, attr), target)
            self.assertTrue(callable(hook_function(name)), name)

    def test_cli_through_sglang_hooks_subprocess(self):
        code = textwrap.dedent("""
            import argparse, pickle
            from sglang.srt.plugins.hook_registry import HookRegistry
            from sglang_mamba_ext.plugin.speculative import register_spec_hooks
            register_spec_hooks(); HookRegistry.apply_hooks()
            from sglang.srt.server_args import ServerArgs
            p = argparse.ArgumentParser(); ServerArgs.add_cli_args(p)
            base = ["--model-path", "/nonexistent"]
            sa = ServerArgs.from_cli_args(p.parse_args(base))
            from sglang_mamba_ext.plugin.speculative.hooks import mode
            print("default", mode(sa), "_mamba_spec_state_update" in vars(sa))
            sa = ServerArgs.from_cli_args(p.parse_args(base + ["--mamba-spec-state-update", "deferred",
                "--speculative-algorithm", "FROZEN_KV_MTP", "--disable-overlap-schedule"]))
            print("deferred", pickle.loads(pickle.dumps(sa))._mamba_spec_state_update)
            try:
                ServerArgs.from_cli_args(p.parse_args(base + ["--mamba-spec-state-update", "deferred"]))
            except Exception as e:
                print("refused", type(e).__name__)
        """)
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertIn("default snapshot False", out.stdout)
        self.assertIn("deferred deferred", out.stdout)
        self.assertIn("refused DeferredSpecConfigError", out.stdout)


def _make_pool(deferred: bool, T=5, spec_state_size=3, layers=(1, 3), layout="kda", verify="auto"):
    """SGLang's MambaPool with 2 linear layers of H = HV = 2 heads, K = V = 8, W = 4, as
    Kimi-Linear (KDA: conv [W-1, dim]) or Qwen3-Next (GDN: conv [dim, W-1]) sizes it
    (``verify``: the deferred verify variant, ``auto`` = the on-chip rule: on chip here)."""
    cp = small_cache_params(layout, layers)
    kw = dict(size=7, spec_state_size=spec_state_size, cache_params=cp, mamba_layer_ids=list(layers), device="cpu",
              speculative_num_draft_tokens=T, speculative_eagle_topk=2)
    pool = MambaPool.__new__(MambaPool)
    spec = SimpleNamespace(speculative_num_steps=2, speculative_algorithm="FROZEN_KV_MTP")
    with _deferred("deferred" if deferred else "snapshot"), mock.patch("sglang.srt.runtime_context.get_spec", return_value=spec), \
            mock.patch.object(hooks, "_target_layout", None if layout == "kda" else layout), \
            mock.patch.dict(os.environ, {"SGLANG_MAMBA_EXT_DEFERRED_VERIFY": verify}):
        hooks.mamba_pool_init_around(MambaPool.__init__, pool, **kw)
    return pool


@requires_sglang
class TestPoolConstruction(unittest.TestCase):
    def test_deferred_pool_has_one_layer_buffers(self):
        snap = _make_pool(False)
        d = _make_pool(True, verify="one_layer")
        s_int, d_int = snap.mamba_cache.intermediate_ssm, d.mamba_cache.intermediate_ssm
        self.assertEqual(tuple(s_int.shape), tuple(d_int.shape))  # SGLang's kernels see [L, R, T, ...]
        self.assertNotEqual(s_int.stride(0), 0)
        self.assertEqual(d_int.stride(0), 0)  # every layer aliases one buffer
        state = d.mamba_spec_deferred
        self.assertEqual(d_int.data_ptr(), state.one_layer_ssm.data_ptr())
        self.assertEqual(d.mamba_cache.intermediate_conv_window[0].stride(0), 0)
        # per-layer views handed to the verify kernels are the same memory
        self.assertEqual(d.mamba2_layer_cache(0).intermediate_ssm.data_ptr(), d.mamba2_layer_cache(1).intermediate_ssm.data_ptr())
        # main states unchanged in shape; stash sized rows x (steps + 1)
        self.assertEqual(d.mamba_cache.temporal.shape, snap.mamba_cache.temporal.shape)
        self.assertEqual(tuple(state.stash.mixed_qkv.shape), (2, 4, 3, 48))
        self.assertEqual(tuple(state.stash.g_raw.shape), (2, 4, 3, 16))
        snap_bytes = s_int.numel() * s_int.element_size()
        self.assertEqual(state.nbytes()["one_layer_ssm"] * 2, snap_bytes)

    def test_onchip_pool_has_no_node_state_buffer(self):
        """Where the shapes fit on chip (K = V = 8, depth 3) the pool gets no one-layer SSM
        buffer: ``intermediate_ssm`` is a one-element placeholder of SGLang's shape."""
        d = _make_pool(True)
        buffered = _make_pool(True, verify="one_layer")
        state = d.mamba_spec_deferred
        self.assertEqual((state.verify, buffered.mamba_spec_deferred.verify), ("on_chip", "one_layer"))
        self.assertIsNone(state.one_layer_ssm)
        ph = d.mamba_cache.intermediate_ssm
        self.assertEqual(tuple(ph.shape), tuple(buffered.mamba_cache.intermediate_ssm.shape))
        self.assertEqual(ph.untyped_storage().nbytes(), 4)  # one fp32 element
        self.assertEqual(set(ph.stride()), {0})
        nb, nb_buf = state.nbytes(), buffered.mamba_spec_deferred.nbytes()
        self.assertEqual(nb["one_layer_ssm"], 0)
        self.assertEqual(nb_buf["one_layer_ssm"], 4 * 5 * 2 * 8 * 8 * 4)  # R * T * HV * V * K fp32
        self.assertEqual({k: v for k, v in nb.items() if k != "one_layer_ssm"},
                         {k: v for k, v in nb_buf.items() if k != "one_layer_ssm"})  # conv buffer, stash, pending kept
        with mock.patch.dict(os.environ, {"SGLANG_MAMBA_EXT_DEFERRED_VERIFY": "bogus"}), \
                self.assertRaisesRegex(hooks.DeferredSpecConfigError, "SGLANG_MAMBA_EXT_DEFERRED_VERIFY"):
            _make_pool(True, verify="bogus")

    def test_mamba2_pool(self):
        """A Mamba2 target (issue 41, item 3): stash of raw xBC (HV*P + 2*G*N = 96) and dt (HV
        = 4), no b; the on-chip rule reads d_state as K and head_dim as V (here on chip: no
        node-state buffer); forced one_layer, SGLang's verify kernel fills a one-layer node-state
        buffer [R, T, HV, P, N]."""
        onchip = _make_pool(True, layout="mamba2").mamba_spec_deferred
        self.assertEqual((onchip.layout.name, onchip.verify, onchip.one_layer_ssm), ("mamba2", "on_chip", None))
        d = _make_pool(True, layout="mamba2", verify="one_layer")
        state = d.mamba_spec_deferred
        self.assertEqual((state.layout.name, state.verify), ("mamba2", "one_layer"))
        self.assertEqual(tuple(state.stash.mixed_qkv.shape), (2, 4, 3, 96))
        self.assertEqual(tuple(state.stash.g_raw.shape), (2, 4, 3, 4))
        self.assertEqual(state.dims.beta_dim, 0)
        self.assertEqual((state.shape.num_k_heads, state.shape.head_k_dim, state.shape.head_v_dim), (2, 16, 8))
        self.assertEqual(tuple(state.one_layer_ssm.shape), (4, 5, 4, 8, 16))
        self.assertEqual(d.mamba_cache.intermediate_ssm.stride(0), 0)
        self.assertEqual(tuple(state.one_layer_conv.shape[-2:]), (96, 3))

    def test_unknown_layout_refused(self):
        pool = MambaPool.__new__(MambaPool)
        with _deferred(), self.assertRaisesRegex(hooks.DeferredSpecConfigError, "own replay kernel"):
            hooks.mamba_pool_init_around(MambaPool.__init__, pool, cache_params=SimpleNamespace(is_kda=False),
                                         speculative_num_draft_tokens=4)

    def test_gdn_pool(self):
        d = _make_pool(True, layout="gdn")
        state = d.mamba_spec_deferred
        self.assertEqual(state.layout.name, "gdn")
        self.assertEqual(tuple(state.stash.g_raw.shape), (2, 4, 3, 2))  # raw gate per value head
        self.assertEqual(d.mamba_cache.intermediate_ssm.stride(0), 0)
        self.assertEqual(tuple(state.one_layer_conv.shape[-2:]), (48, 3))  # GDN window axis last

    def test_layout_chosen_from_the_model(self):
        from sglang_mamba_ext.models.tiny_hybrid import TinyHybridConfig

        mk = lambda **kw: SimpleNamespace(**{"mambaish_config": object(), "hybrid_kda_config": None,  # noqa: E731
                                             "hybrid_gdn_config": None, **kw})
        self.assertEqual(hooks.layout_name_for(mk(hybrid_kda_config=object())), "kda")
        self.assertEqual(hooks.layout_name_for(mk(hybrid_gdn_config=object())), "gdn")
        for gate in ("kda", "gdn"):
            cfg = SimpleNamespace(hf_config=TinyHybridConfig(linear_gate=gate))
            self.assertEqual(hooks.layout_name_for(mk(model_config=cfg)), f"tiny-{gate}")
        self.assertTrue(hooks.layout_name_for(mk(model_config=SimpleNamespace(hf_config=object()))).startswith("unsupported"))
        self.assertIsNone(hooks.layout_name_for(mk(mambaish_config=None)))  # the draft
        from sglang.srt.configs import FalconH1Config, NemotronHConfig
        from transformers import Lfm2Config

        for cfg in (NemotronHConfig(), FalconH1Config()):  # Mamba2 mixers
            self.assertEqual(hooks.layout_name_for(mk(model_config=SimpleNamespace(hf_config=cfg, is_draft_model=False))),
                             "mamba2")
        lfm2 = SimpleNamespace(hf_config=Lfm2Config(), is_draft_model=False)  # a short conv: no replay kernel
        self.assertTrue(hooks.layout_name_for(mk(model_config=lfm2)).startswith("unsupported"))


@requires_sglang
@unittest.skipUnless(_CAN_TRITON, "kernels already imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestCommitReplayPath(unittest.TestCase):
    """verify capture -> commit -> next-round replay -> release, through the hooks (SGLang's
    KDA backend; :class:`TestCommitReplayPathGdn`: its GDN backend)."""

    LAYOUT = "kda"

    @classmethod
    def setUpClass(cls):
        from sglang_mamba_ext.testing.spec_pair import triton_interpreter_env

        cls.enterClassContext(triton_interpreter_env())

    def setUp(self):
        torch.manual_seed(0)
        self.T = 5
        self.pool = _make_pool(True, T=self.T, layout=self.LAYOUT, verify="one_layer")  # the stand-in verify below uses no dispatcher
        self.state = self.pool.mamba_spec_deferred
        shape = LinearAttnShape(2, 2, 8, 8, 4)
        self.mixers = [GatedDeltaRuleMixer(12, shape, gate=self.LAYOUT) for _ in range(2)]
        with torch.no_grad():
            for m in self.mixers:
                m.A_log.normal_(0, 0.5)
                m.dt_bias.normal_()
        self.slot_of_row = {1: 4, 2: 6, 3: 0}
        self.rtp = SimpleNamespace(
            mamba_pool=self.pool, mamba_map={1: 0, 3: 1},
            get_mamba_indices=lambda idx: torch.tensor([self.slot_of_row[int(i)] for i in idx]),
            mamba2_layer_cache=lambda layer_id: self.pool.mamba2_layer_cache({1: 0, 3: 1}[layer_id]),
        )
        with torch.no_grad():
            self.pool.mamba_cache.temporal.normal_()
            self.pool.mamba_cache.conv[0].normal_()

    def _verify(self, bs, lower_bound=None):
        """Capture every layer's raw inputs of a bs x T verify batch; returns them. The stand-in
        for SGLang's verify scribbles over the main conv windows of the batch, as SGLang's conv
        kernel rolls them in place; the hook must restore them."""
        x = torch.randn(bs * self.T, 12)
        recs = []
        calls = []
        slots = torch.tensor([self.slot_of_row[r] for r in (1, 2, 3)][:bs] + [-1])  # + a padding row
        conv_before = self.pool.mamba_cache.conv[0].clone()

        def sglang_verify(backend, layer, *args):
            calls.append(layer.layer_id)
            self.pool.mamba_cache.conv[0][self.rtp.mamba_map[layer.layer_id], slots[:bs]] = 7.0

        for layer_id, m in zip((1, 3), self.mixers):
            with torch.no_grad():
                mq, a, b = m.project_raw(x)
            layer = SimpleNamespace(layer_id=layer_id, conv_weights=m.conv_weight, bias=None, A_log=m.A_log,
                                    dt_bias=m.dt_bias, lower_bound=lower_bound)
            fb = SimpleNamespace(spec_info=SimpleNamespace(ragged_verify_layout=None, draft_token_num=self.T),
                                 forward_mode=SimpleNamespace(is_target_verify=lambda: True))
            backend = SimpleNamespace(req_to_token_pool=self.rtp, forward_metadata=SimpleNamespace(mamba_cache_indices=slots))
            if self.LAYOUT == "kda":
                hooks.kda_target_verify_around(sglang_verify, backend, layer, fb, mq, a, b.unsqueeze(0))
            else:
                hooks.gdn_forward_extend_around(sglang_verify, backend, layer, fb, mq, a, b)
            recs.append((mq, a, b))
        self.assertEqual(calls, [1, 3])  # SGLang's own verify still runs
        torch.testing.assert_close(self.pool.mamba_cache.conv[0], conv_before, rtol=0, atol=0)  # main windows restored
        return recs

    def test_safe_gate_captured_as_its_raw_form(self):
        """A layer with the KDA safe gate (``lower_bound``) is captured as the raw gate whose
        usual decay equals it (``safe_gate_as_raw``; before: refused at the verify call)."""
        from sglang_mamba_ext.plugin.inchunk_checkpoints import safe_gate_as_raw

        if self.LAYOUT != "kda":
            self.skipTest("the safe gate is KDA's")
        rows = torch.tensor([1, 2, 3])
        recs = self._verify(3, lower_bound=-5.0)
        T = self.T
        batch = SimpleNamespace(forward_mode=_Mode(), req_pool_indices=rows, seq_lens=torch.tensor([14, 9, 30]),
                                mamba_track_indices=torch.tensor([5, 1, 2]), tree_cache=SimpleNamespace(page_size=1))
        worker = SimpleNamespace(model_runner=SimpleNamespace(req_to_token_pool=self.rtp))
        with mock.patch("sglang.srt.runtime_context.mamba_track_grid", return_value=16):
            hooks.commit_around(None, worker, batch, torch.tensor([3, 1, 2]),
                                torch.tensor([[0, 2, 4], [T, -1, -1], [2 * T, 2 * T + 3, -1]]), T)
        st = self.state.stash
        for l, ((_, a, _), m) in enumerate(zip(recs, self.mixers)):
            want = safe_gate_as_raw(a, m.A_log, m.dt_bias, -5.0).reshape(a.shape[0], -1)
            torch.testing.assert_close(st.g_raw[l, 1, :3].float(), want[[0, 2, 4]].to(st.g_raw.dtype).float(),
                                       rtol=0, atol=0)
            torch.testing.assert_close(st.g_raw[l, 3, :2].float(), want[[2 * T, 2 * T + 3]].to(st.g_raw.dtype).float(),
                                       rtol=0, atol=0)

    def test_commit_then_replay_then_release(self):
        rows = torch.tensor([1, 2, 3])
        recs = self._verify(3)
        T = self.T
        accept_lens = torch.tensor([3, 1, 2])
        accept_index = torch.tensor([[0, 2, 4], [T, -1, -1], [2 * T, 2 * T + 3, -1]])
        seq_lens = torch.tensor([14, 9, 30])
        track = torch.tensor([5, 1, 2])
        batch = SimpleNamespace(forward_mode=_Mode(), req_pool_indices=rows, seq_lens=seq_lens,
                                mamba_track_indices=track, tree_cache=SimpleNamespace(page_size=1))
        worker = SimpleNamespace(model_runner=SimpleNamespace(req_to_token_pool=self.rtp))
        before_temporal = self.pool.mamba_cache.temporal.clone()
        with mock.patch("sglang.srt.runtime_context.mamba_track_grid", return_value=16):
            hooks.commit_around(lambda *a, **k: self.fail("snapshot scatter must not run"), worker, batch,
                                accept_lens, accept_index, T)
        st = self.state.stash
        # stash holds exactly the accepted nodes of every layer; main state untouched
        torch.testing.assert_close(self.pool.mamba_cache.temporal, before_temporal, rtol=0, atol=0)
        self.assertEqual(st.count[rows].tolist(), [3, 1, 2])
        self.assertEqual(st.seq_len[rows].tolist(), [14, 9, 30])
        self.assertEqual(st.track_slot[rows].tolist(), [5, 1, 2])
        for l, (mq, _, _) in enumerate(recs):
            torch.testing.assert_close(st.mixed_qkv[l, 1, :3], mq[[0, 2, 4]], rtol=0, atol=0)
            torch.testing.assert_close(st.mixed_qkv[l, 2, :1], mq[[T]], rtol=0, atol=0)
            torch.testing.assert_close(st.mixed_qkv[l, 3, :2], mq[[2 * T, 2 * T + 3]], rtol=0, atol=0)

        # expected main state: torch reference replay on SGLang-layout views of a copy
        ref_conv = self.pool.mamba_cache.conv[0].clone()
        ref_temp = self.pool.mamba_cache.temporal.clone()
        ref_stash = ActivationStash(2, 4, 3, StashDims(48, 16 if self.LAYOUT == "kda" else 2, 2), dtype=torch.float32)
        for name in ("mixed_qkv", "g_raw", "b_raw", "count", "seq_len", "track_slot"):
            getattr(ref_stash, name).copy_(getattr(st, name))
        with torch.no_grad():
            replay(ref_stash, rows, torch.tensor([4, 6, 0]), *self.state.layout.replay_views(ref_conv, ref_temp),
                   ReplayWeights.from_mixers(self.mixers), 16, impl="torch")

        # next round: replay runs before the draft/verify, with each row's slot and count
        seen = []
        orig = self.state.replay

        def spy(rows_, slots_, *a, **k):
            seen.append((rows_.tolist(), slots_.tolist(), self.state.stash.count[rows_].tolist()))
            return orig(rows_, slots_, *a, **k)

        with mock.patch.object(self.state, "replay", side_effect=spy), _deferred():
            hooks.worker_forward_before(SimpleNamespace(req_to_token_pool=self.rtp),
                                        SimpleNamespace(forward_mode=_Mode(), req_pool_indices=rows))
        self.assertEqual(seen, [([1, 2, 3], [4, 6, 0], [3, 1, 2])])
        self.assertEqual(st.count[rows].tolist(), [0, 0, 0])
        torch.testing.assert_close(self.pool.mamba_cache.temporal, ref_temp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(self.pool.mamba_cache.conv[0], ref_conv, rtol=0, atol=0)
        # row 3 crossed 32 (30 + 2): its track slot 2 got the state after both tokens
        torch.testing.assert_close(self.pool.mamba_cache.temporal[:, 2], ref_temp[:, 0], rtol=1e-5, atol=1e-5)
        self.assertFalse(torch.equal(self.pool.mamba_cache.temporal[:, 2], before_temporal[:, 2]))

        # another round; request in row 1 finishes after 1 of its 3 committed tokens
        recs = self._verify(3)
        with mock.patch("sglang.srt.runtime_context.mamba_track_grid", return_value=16):
            hooks.commit_around(None, worker, batch, accept_lens, accept_index, T)
        req = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=1, mamba_pool_idx=torch.tensor(4)),
                              origin_input_ids=list(range(10)), output_ids=list(range(5)))  # 14 tokens cached
        seen.clear()
        with mock.patch.object(self.state, "replay", side_effect=lambda r, s, c, t, keep=None, impl=None: seen.append((r.tolist(), s.tolist(), keep.tolist()))):
            hooks.release_kv_cache_before(req, SimpleNamespace(req_to_token_pool=self.rtp), checkpoint=True)
        self.assertEqual(seen, [([1], [4], [0])])  # seq_len 14 already holds all 14 tokens: keep 0
        self.assertEqual(int(st.count[1]), 0)
        # release without caching and row freeing clear pending records without replay
        req2 = SimpleNamespace(kv=SimpleNamespace(req_pool_idx=2, mamba_pool_idx=None), origin_input_ids=[], output_ids=[])
        hooks.release_kv_cache_before(req2, SimpleNamespace(req_to_token_pool=self.rtp), checkpoint=False)
        self.assertEqual(int(st.count[2]), 0)
        hooks.free_rows_before(self.rtp, [3])
        self.assertEqual(int(st.count[3]), 0)

    def test_gdn_hook_leaves_other_batches_to_sglang(self):
        if self.LAYOUT != "gdn":
            self.skipTest("GDN only")
        called = []
        fb = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: False))
        backend = SimpleNamespace(req_to_token_pool=self.rtp)
        hooks.gdn_forward_extend_around(lambda *a, **k: called.append(a[1].layer_id), backend,
                                        SimpleNamespace(layer_id=1), fb, None, None, None)
        self.assertEqual((called, int(self.state.stash.count.sum())), ([1], 0))

    def test_snapshot_mode_calls_sglang(self):
        pool = _make_pool(False)
        rtp = SimpleNamespace(mamba_pool=pool)
        called = []
        hooks.commit_around(lambda *a, **k: called.append(a), SimpleNamespace(model_runner=SimpleNamespace(req_to_token_pool=rtp)),
                            None, torch.tensor([1]), torch.tensor([[0]]), 4)
        self.assertEqual(len(called), 1)


@requires_sglang
@unittest.skipUnless(_CAN_TRITON, "kernels already imported without the Triton interpreter (see TestUnderTritonInterpreter)")
class TestCommitReplayPathGdn(TestCommitReplayPath):
    LAYOUT = "gdn"


TestUnderTritonInterpreter = triton_subprocess_case(__file__, SELECT, skip=_CAN_TRITON_INPROC)


if __name__ == "__main__":
    unittest.main()
