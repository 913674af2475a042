"""Speculative decoding through SGLang's FROZEN_KV_MTP on CPU, without a server (issue 12,
items 1-3): the tiny frozen-KV draft pair, the ``pp_proxy_tensors`` workaround, the CPU routing
hooks (``plugin/speculative/cpu_routing.py``) and the tiny backend's target verify in SGLang's
snapshot contract. Oracles: the shared mixer run along each tree path, plain masked softmax
(``models.tiny_hybrid.attention``), direct tensor indexing.
"""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest
from types import SimpleNamespace
from unittest import mock

import torch

from conftest import SGLANG_INSTALLED, requires_sglang, small_mixer

from sglang_mamba_ext.models.tiny_hybrid import attention

if SGLANG_INSTALLED:
    from sglang_mamba_ext.plugin.speculative import cpu_routing
    from sglang_mamba_ext.plugin.tiny_hybrid.backend import TinyHybridLinearAttnBackend

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def _on():
    return mock.patch.object(cpu_routing, "cpu_spec_active", return_value=True)


class TestDraftPair(unittest.TestCase):
    """``scripts/make_tiny_model.py --draft-out`` writes a matching target + draft."""

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.target = os.path.join(cls.tmp.name, "t")
        cls.draft = os.path.join(cls.tmp.name, "d")
        subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "make_tiny_model.py"), "--out", cls.target,
                        "--draft-out", cls.draft], check=True, capture_output=True,
                       env=dict(os.environ, PYTHONPATH=ROOT))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_config_and_tokenizer(self):
        import json

        from sglang_mamba_ext.models.tiny_draft import TinyHybridDraftConfig

        with open(os.path.join(self.target, "config.json")) as f:
            tcfg = json.load(f)
        cfg = TinyHybridDraftConfig.from_pretrained(self.draft)
        self.assertEqual(cfg.model_type, "tiny_hybrid_draft")
        self.assertEqual(cfg.architectures, ["TinyHybridDraftForCausalLM"])
        full = [i for i, t in enumerate(tcfg["layer_types"]) if t == "full_attention"]
        self.assertEqual(cfg.target_layer_ids, full)
        self.assertEqual(cfg.layer_types, ["full_attention"] * len(full))
        self.assertEqual(cfg.backbone_hidden_size, tcfg["hidden_size"])
        self.assertEqual(cfg.vocab_size, tcfg["vocab_size"])
        for name in ("tokenizer.json", "tokenizer_config.json"):
            with open(os.path.join(self.target, name), "rb") as a, open(os.path.join(self.draft, name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)

    def test_weights_from_target(self):
        from safetensors.torch import load_file

        t = load_file(os.path.join(self.target, "model.safetensors"))
        d = load_file(os.path.join(self.draft, "model.safetensors"))
        for i, tl in enumerate((0, 2)):
            for k in [k for k in t if k.startswith(f"model.layers.{tl}.")]:
                torch.testing.assert_close(d[k.replace(f"layers.{tl}.", f"layers.{i}.", 1)], t[k], rtol=0, atol=0)
        for k in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            torch.testing.assert_close(d[k], t[k], rtol=0, atol=0)
        H = t["model.norm.weight"].shape[0]
        w = d["pre_projection.weight"]
        self.assertEqual(tuple(w.shape), (H, 2 * H))
        torch.testing.assert_close(w[:, :H], torch.eye(H), rtol=0, atol=0)
        self.assertEqual(int(w[:, H:].count_nonzero()), 0)
        self.assertFalse(any("linear_attn" in k for k in d))

    def test_linear_layer_refused(self):
        from sglang_mamba_ext.models.tiny_draft import TinyHybridDraftConfig

        with self.assertRaises(ValueError):
            TinyHybridDraftConfig(num_hidden_layers=2, layer_types=["full_attention", "linear_attention"])
        with self.assertRaises(ValueError):
            TinyHybridDraftConfig(num_hidden_layers=2, target_layer_ids=[0])

    @requires_sglang
    def test_sglang_model_frozen_kv_interface(self):
        from safetensors.torch import load_file

        from sglang_mamba_ext.models.tiny_draft import TinyHybridDraftConfig
        from sglang_mamba_ext.plugin.tiny_hybrid.draft_model import TinyHybridDraftForCausalLM

        cfg = TinyHybridDraftConfig.from_pretrained(self.draft)
        with mock.patch("sglang_mamba_ext.plugin.tiny_hybrid.draft_model.LogitsProcessor"):
            m = TinyHybridDraftForCausalLM(cfg)
        m.load_weights(load_file(os.path.join(self.draft, "model.safetensors")).items())
        self.assertEqual(m.backbone_hidden_size, cfg.hidden_size)
        target = SimpleNamespace(config=SimpleNamespace(full_attention_layer_ids=[0, 2]))
        pool = object()
        ctx = m.build_frozen_kv_mtp_context(target_model=target, target_token_to_kv_pool=pool)
        self.assertIs(ctx.target_token_to_kv_pool, pool)
        self.assertEqual(ctx.physical_layer_ids, {0: 0, 1: 2})
        m.bind_frozen_kv_context(ctx)
        self.assertEqual([c.layer_id for c in m.attn_cores], [0, 2])
        with self.assertRaises(ValueError):
            m.build_frozen_kv_mtp_context(target_model=SimpleNamespace(config=SimpleNamespace(
                full_attention_layer_ids=[0, 1])), target_token_to_kv_pool=pool)


@requires_sglang
class TestPpProxyTensors(unittest.TestCase):
    """Upstream defect: the non-overlap scheduler passes ``pp_proxy_tensors=`` to
    ``FrozenKVMTPWorkerV2.forward_batch_generation``, which has no such parameter."""

    class Reached(Exception):
        pass

    def _call(self, fn):
        from sglang.srt.speculative.frozen_kv_mtp_worker_v2 import FrozenKVMTPWorkerV2

        worker = object.__new__(FrozenKVMTPWorkerV2)

        def reached():
            raise self.Reached()

        batch = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=reached))
        return fn(worker, batch, pp_proxy_tensors=None)

    def _original(self):
        from sglang.srt.speculative.frozen_kv_mtp_worker_v2 import FrozenKVMTPWorkerV2

        fn = FrozenKVMTPWorkerV2.forward_batch_generation
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        return fn

    def test_defect_present_upstream(self):
        # If this starts failing, SGLang fixed the signature and the hook can go.
        with self.assertRaises(TypeError):
            self._call(self._original())

    def test_hook_reaches_the_method(self):
        from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

        wrapped = _wrap_fn(self._original(), cpu_routing.drop_pp_proxy_tensors_before, HookType.BEFORE)
        with self.assertRaises(self.Reached):
            self._call(wrapped)

    def test_non_none_value_kept(self):
        self.assertIsNone(cpu_routing.drop_pp_proxy_tensors_before(object(), object(), pp_proxy_tensors=object()))

    def test_registered(self):
        from sglang_mamba_ext.plugin.speculative import cpu_routing as cr

        self.assertIn(("sglang.srt.speculative.frozen_kv_mtp_worker_v2.FrozenKVMTPWorkerV2.forward_batch_generation",
                       "BEFORE", "drop_pp_proxy_tensors_before"), cr.CPU_HOOK_TARGETS)


@requires_sglang
class TestCpuRouting(unittest.TestCase):
    def test_inactive_without_env(self):
        with mock.patch.dict(os.environ, {cpu_routing.CPU_SPEC_ENV: "0"}):
            self.assertFalse(cpu_routing.cpu_spec_active())
            sentinel = object()
            self.assertIs(cpu_routing.build_tree_around(lambda *a, **k: sentinel, 1, x=2), sentinel)

    def test_sampled_verify_is_greedy_on_cpu(self):
        """A verify batch with a sampled request (``temperature > 0``): SGLang takes its sampling
        path unless ``is_cpu`` (``SGLANG_USE_CPU_ENGINE=1``), and on this host that path's
        kernels are None (the gap a fresh user hit: the scheduler died on a TypeError); the hook
        gives SGLang's own CPU answer, the argmax path."""
        import torch as _torch
        from sglang.srt.speculative import eagle_utils

        if _torch.cuda.is_available():
            self.skipTest("the gap is on hosts without CUDA")
        self.assertIsNone(eagle_utils.tree_speculative_sampling_target_only)
        import inspect

        # SGLang's own function (unwrapped: another test in this process may have applied the hooks)
        sglang_rule = inspect.unwrap(eagle_utils._verify_uses_greedy)
        kw = dict(is_all_greedy=False, is_cpu=False, is_hip=False, is_xpu=False, use_rejection_sampling=False)
        self.assertFalse(sglang_rule(**kw))
        with mock.patch.dict(os.environ, {cpu_routing.CPU_SPEC_ENV: "1"}):
            self.assertTrue(cpu_routing.verify_uses_greedy_around(sglang_rule, **kw))
        with mock.patch.dict(os.environ, {cpu_routing.CPU_SPEC_ENV: "0"}):
            self.assertFalse(cpu_routing.verify_uses_greedy_around(sglang_rule, **kw))
        self.assertIn(("sglang.srt.speculative.eagle_utils._verify_uses_greedy", "AROUND", "verify_uses_greedy_around"),
                      cpu_routing.CPU_HOOK_TARGETS)

    def test_assign_extend_cache_locs(self):
        from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs_func as orig

        while hasattr(orig, "__wrapped__"):
            orig = orig.__wrapped__
        rt = torch.arange(5 * 40, dtype=torch.int32).view(5, 40) * 3
        args = dict(req_pool_indices=torch.tensor([3, 1]), req_to_token=rt, start_offset=torch.tensor([7, 12]),
                    end_offset=torch.tensor([11, 16]), batch_size=2, draft_token_num=4, device="cpu")
        self.assertIsNone(orig(**args))  # SGLang has no branch for this host
        with _on():
            out = cpu_routing.assign_extend_cache_locs_around(orig, **args)
        self.assertEqual(out.dtype, torch.int64)
        self.assertEqual(out.tolist(), rt[3, 7:11].tolist() + rt[1, 12:16].tolist())
        with _on(), self.assertRaises(ValueError):
            cpu_routing.assign_extend_cache_locs_around(orig, **dict(args, end_offset=torch.tensor([11, 15])))

    def test_commit_scatter(self):
        L, S, N, T = 2, 6, 3, 4
        g = torch.Generator().manual_seed(0)
        temporal = torch.randn(L, S, 2, 3, 5, generator=g)
        conv = torch.randn(L, S, 7, 3, generator=g)
        inter_ssm = torch.randn(L, N + 1, T, 2, 3, 5, generator=g)
        inter_conv = torch.randn(L, N + 1, T, 7, 3, generator=g)
        caches = SimpleNamespace(temporal=temporal.clone(), conv=[conv.clone()], intermediate_ssm=inter_ssm,
                                 intermediate_conv_window=[inter_conv])
        slots, steps = torch.tensor([4, 0]), torch.tensor([2, 0])
        track, tsteps = torch.tensor([5, -1]), torch.tensor([1, 0])
        with _on():
            cpu_routing.scatter_after_verify_around(None, caches, slots, steps, track, tsteps)
        want_t, want_c = temporal.clone(), conv.clone()
        for row, (slot, step) in enumerate(zip(slots.tolist(), steps.tolist())):
            want_t[:, slot] = inter_ssm[:, row, step]
            want_c[:, slot] = inter_conv[:, row, step]
        want_t[:, 5] = inter_ssm[:, 0, 1]
        want_c[:, 5] = inter_conv[:, 0, 1]
        torch.testing.assert_close(caches.temporal, want_t, rtol=0, atol=0)
        torch.testing.assert_close(caches.conv[0], want_c, rtol=0, atol=0)

    def test_tree_verify_attention(self):
        g = torch.Generator().manual_seed(1)
        NH, NKV, D, T = 4, 2, 8, 3
        kb, vb = torch.randn(64, NKV, D, generator=g), torch.randn(64, NKV, D, generator=g)
        rt = torch.randperm(64, generator=g)[:40].view(2, 20)
        lens = torch.tensor([5, 9])
        rows = torch.tensor([1, 0])
        out_loc = torch.tensor([50, 51, 52, 60, 61, 62])
        q = torch.randn(2 * T, NH, D, generator=g)
        # row 0: chain 0 -> 1 -> 2; row 1: root 0 with children 1 and 2
        tree = [[[1, 0, 0], [1, 1, 0], [1, 1, 1]], [[1, 0, 0], [1, 1, 0], [1, 0, 1]]]
        masks = [torch.cat([torch.ones(T, int(L), dtype=torch.bool), torch.tensor(t, dtype=torch.bool)], 1)
                 for L, t in zip(lens, tree)]
        flat = torch.cat([m.reshape(-1) for m in masks])
        out = cpu_routing.tree_verify_attention(q, kb, vb, rt, rows, lens, out_loc, flat, T, D ** -0.5)
        for i in range(2):
            locs = torch.cat([rt[rows[i], : lens[i]], out_loc[i * T:(i + 1) * T]])
            want = attention(q[i * T:(i + 1) * T], kb[locs], vb[locs], masks[i], D ** -0.5)
            torch.testing.assert_close(out[i * T:(i + 1) * T], want, rtol=1e-5, atol=1e-5)


@requires_sglang
class TestTreeParents(unittest.TestCase):
    def test_chain(self):
        self.assertEqual(TinyHybridLinearAttnBackend.tree_parents(None, None, 4), [-1, 0, 1, 2])

    def test_tree(self):
        # 0 -> {1, 2}; 1 -> {3}; 2 -> {4, 5}
        nt = [1, 3, 4, -1, -1, -1]
        ns = [-1, 2, -1, -1, 5, -1]
        self.assertEqual(TinyHybridLinearAttnBackend.tree_parents(nt, ns, 6), [-1, 0, 0, 1, 2, 2])

    def test_unreachable(self):
        with self.assertRaises(ValueError):
            TinyHybridLinearAttnBackend.tree_parents([1, -1, -1], [-1, -1, -1], 3)


@requires_sglang
class TestTargetVerify(unittest.TestCase):
    """Snapshot contract: node j's state = one step from its parent's, written to the
    intermediate scratch row of its batch row; the main state is untouched."""

    def setUp(self):
        self.shape, self.mixer = small_mixer()
        S, T, bs = 6, 6, 2
        self.T = T
        self.conv = torch.randn(S, *self.shape.conv_state_shape)
        # the pool keeps SGLang's [.., HV, V, K]; the test reads the mixer's [.., HV, K, V]
        HV, K, V = self.shape.temporal_state_shape
        ssm_phys = torch.randn(S, HV, V, K)
        issm_phys = torch.zeros(S + 1, T, HV, V, K)
        self.ssm, self.issm = ssm_phys.transpose(-1, -2), issm_phys.transpose(-1, -2)
        self.iconv = torch.zeros(S + 1, T, *self.shape.conv_state_shape)
        cache = SimpleNamespace(conv=[self.conv], temporal=ssm_phys, intermediate_conv_window=[self.iconv],
                                intermediate_ssm=issm_phys)
        self.backend = object.__new__(TinyHybridLinearAttnBackend)
        self.backend.req_to_token_pool = SimpleNamespace(mamba2_layer_cache=lambda i: cache)
        self.backend.forward_metadata = SimpleNamespace(mamba_cache_indices=torch.tensor([3, 1]))
        self.layer = SimpleNamespace(layer_id=1, mixer=self.mixer)
        self.x = torch.randn(bs * T, 32)

    def _run(self, spec):
        mixed, g, beta = self.mixer.project(self.x)
        _, graw, braw = self.mixer.project_raw(self.x)  # what the backend receives
        fb = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True), spec_info=spec)
        return self.backend.forward_extend(layer=self.layer, forward_batch=fb, mixed_qkv=mixed,
                                           a=graw, b=braw)

    def _check(self, out, parents_per_row, slots):
        mixed, g, beta = self.mixer.project(self.x)
        _, graw, braw = self.mixer.project_raw(self.x)  # what the backend receives
        for row, parents in enumerate(parents_per_row):
            for j in range(self.T):
                path = [j]
                while parents[path[-1]] >= 0:
                    path.append(parents[path[-1]])
                idx = [row * self.T + n for n in reversed(path)]
                y, c = self.mixer.conv(mixed[idx], self.conv0[slots[row]])
                q, k, v = self.mixer.split_qkv(y)
                o, s = self.mixer.recurrence(q, k, v, g[idx], beta[idx], self.ssm0[slots[row]])
                torch.testing.assert_close(self.iconv[row, j], c, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(self.issm[row, j], s, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(out[0, row * self.T + j], o[-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(self.conv, self.conv0, rtol=0, atol=0)
        torch.testing.assert_close(self.ssm, self.ssm0, rtol=0, atol=0)

    def test_chain_and_tree(self):
        self.conv0, self.ssm0 = self.conv.clone(), self.ssm.clone()
        out = self._run(SimpleNamespace(draft_token_num=self.T, topk=1, retrieve_next_token=None,
                                        retrieve_next_sibling=None))
        self._check(out, [[-1, 0, 1, 2, 3, 4]] * 2, [3, 1])
        # topk 2: row 0: 0 -> {1, 2}, 1 -> {3, 4}, 2 -> {5}; row 1: a chain given as a tree
        nt = torch.tensor([[1, 3, 5, -1, -1, -1], [1, 2, 3, 4, 5, -1]])
        ns = torch.tensor([[-1, 2, -1, 4, -1, -1], [-1] * 6])
        out = self._run(SimpleNamespace(draft_token_num=self.T, topk=2, retrieve_next_token=nt,
                                        retrieve_next_sibling=ns))
        self._check(out, [[-1, 0, 0, 1, 1, 2], [-1, 0, 1, 2, 3, 4]], [3, 1])


@requires_sglang
class TestTritonTreeOpsInterpreted(unittest.TestCase):
    """The routed tree build + greedy verify, in a fresh process under Triton's interpreter
    (SGLang's Triton kernels; a chain of 3 drafts of which the first 2 match the target)."""

    def test_chain_accepts_matching_prefix(self):
        code = textwrap.dedent("""
            import os, torch
            os.environ["SGLANG_MAMBA_EXT_CPU_SPEC"] = "1"
            from sglang.kernels.ops.speculative import spec_tree
            from sglang_mamba_ext.plugin.speculative import cpu_routing
            bs, T = 1, 4
            candidates = torch.tensor([[10, 11, 12, 13]])
            ri = torch.arange(T).view(1, T)
            nt = torch.tensor([[1, 2, 3, -1]])
            ns = torch.full((1, T), -1)
            target = torch.tensor([[11, 12, 99, 98]])
            predicts = torch.full((T,), -1, dtype=torch.int32)
            acc = torch.full((1, T), -1, dtype=torch.int32)
            num = torch.zeros(1, dtype=torch.int32)
            p, a, n = cpu_routing.verify_tree_greedy_around(spec_tree.verify_tree_greedy_func, predicts, acc, num,
                                                            candidates, ri, nt, ns, target)
            print(int(n[0]), a[0].tolist(), p.tolist())
        """)
        env = dict(os.environ, TRITON_INTERPRET="1", TORCHDYNAMO_DISABLE="1",
                   PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        self.assertEqual(r.returncode, 0, r.stderr[-3000:])
        line = r.stdout.strip().splitlines()[-1]
        self.assertTrue(line.startswith("2 [0, 1, 2, -1]"), line)


@requires_sglang
class TestCpuDefaults(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        import json

        with open(os.path.join(self.tmp.name, "config.json"), "w") as f:
            json.dump({"model_type": "tiny_hybrid"}, f)

    def test_spec_flags(self):
        from sglang_mamba_ext.plugin.cpu_defaults import cpu_default_args, speculating_without_cuda

        base = ["--model-path", self.tmp.name, "--device", "cpu"]
        spec = base + ["--speculative-algorithm", "FROZEN_KV_MTP"]
        with mock.patch("torch.cuda.is_available", return_value=False):
            self.assertTrue(speculating_without_cuda(spec))
            self.assertFalse(speculating_without_cuda(base))
            self.assertIn("--disable-overlap-schedule", cpu_default_args(spec)[0])
            self.assertNotIn("--disable-overlap-schedule", cpu_default_args(base)[0])
            other = ["--model-path", "/nonexistent", "--device", "cpu", "--speculative-algorithm", "FROZEN_KV_MTP"]
            self.assertFalse(speculating_without_cuda(other))
        with mock.patch("torch.cuda.is_available", return_value=True):
            self.assertFalse(speculating_without_cuda(spec))
