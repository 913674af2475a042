"""Issue 41: what the plugin adds so that SGLang's own MTP drafts (NEXTN / EAGLE) run on CPU
(``plugin/speculative/cpu_mtp.py``, the CPU default draft attention backend in
``plugin/cpu_defaults.py``), each checked against SGLang's code it works around. The served
path: ``tests/e2e/test_mtp_spec_serving.py``."""

import inspect
import json
import os
import tempfile
import unittest
from unittest import mock

import torch

from sglang_mamba_ext.plugin import cpu_defaults
from sglang_mamba_ext.plugin.speculative import cpu_mtp
from sglang_mamba_ext.plugin.speculative.cpu_routing import CPU_SPEC_ENV


class TestSetEmbedAndHeadBridge(unittest.TestCase):
    def test_sglang_still_calls_cuda_there(self):
        # the gap the bridge covers (models/qwen3_next.py, models/nemotron_h.py)
        from sglang.srt.models.nemotron_h import NemotronHForCausalLM
        from sglang.srt.models.qwen3_next import Qwen3NextForCausalLM

        for cls in (Qwen3NextForCausalLM, NemotronHForCausalLM):
            src = inspect.getsource(cls.set_embed_and_head)
            self.assertIn("torch.cuda.synchronize()", src, cls)

    def test_targets_resolve(self):
        import importlib

        for target, kind, name in cpu_mtp.CPU_MTP_HOOK_TARGETS:
            mod, cls, meth = target.rsplit(".", 2)
            self.assertTrue(callable(getattr(getattr(importlib.import_module(mod), cls), meth)), target)
            self.assertTrue(callable(getattr(cpu_mtp, name)))
            self.assertEqual(kind, "AROUND")

    def _model(self):
        class M:
            def set_embed_and_head(self, embed, head):
                self.embed, self.head = embed, head
                torch.cuda.empty_cache()
                torch.cuda.synchronize()
        return M()

    @unittest.skipIf(torch.cuda.is_available(), "the bridge acts only without CUDA")
    def test_bridge_shares_weights_without_cuda_calls(self):
        m = self._model()
        e, h = torch.zeros(2), torch.ones(2)
        with mock.patch.dict(os.environ, {CPU_SPEC_ENV: "1"}):
            cpu_mtp.set_embed_and_head_around(type(m).set_embed_and_head, m, e, h)
        self.assertIs(m.embed, e)
        self.assertIs(m.head, h)

    @unittest.skipIf(torch.cuda.is_available(), "the bridge acts only without CUDA")
    def test_inert_without_the_routing_env(self):
        m = self._model()
        with mock.patch.dict(os.environ, {CPU_SPEC_ENV: "0"}):
            with self.assertRaises(Exception):  # SGLang's own call: no NVIDIA driver
                cpu_mtp.set_embed_and_head_around(type(m).set_embed_and_head, m, torch.zeros(1), torch.zeros(1))


class TestEagleDraftBackendDefault(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        with open(os.path.join(self.tmp.name, "config.json"), "w") as f:
            json.dump({"torch_dtype": "float16", "model_type": "qwen3_next", "sglang_mamba_ext_tiny": "qwen3_next",
                       "architectures": ["Qwen3NextForCausalLM"]}, f)
        env = mock.patch.dict(os.environ, {cpu_defaults.DISABLE_ENV: "0"})
        env.start()
        self.addCleanup(env.stop)

    def _argv(self, algo, *extra):
        return ["--model-path", self.tmp.name, "--device", "cpu", "--enable-mamba-radix",
                "--speculative-algorithm", algo, *extra]

    @unittest.skipIf(torch.cuda.is_available(), "a CPU default")
    def test_nextn_and_eagle_get_triton_draft_backend(self):
        for algo in ("NEXTN", "EAGLE", "nextn"):
            new, _ = cpu_defaults.cpu_default_args(self._argv(algo))
            self.assertEqual(cpu_defaults._flag_value(new, "--speculative-draft-attention-backend"), "triton", algo)

    @unittest.skipIf(torch.cuda.is_available(), "a CPU default")
    def test_user_choice_and_other_algorithms_kept(self):
        new, _ = cpu_defaults.cpu_default_args(self._argv("NEXTN", "--speculative-draft-attention-backend", "fa3"))
        self.assertEqual(cpu_defaults._flag_value(new, "--speculative-draft-attention-backend"), "fa3")
        new, _ = cpu_defaults.cpu_default_args(self._argv("FROZEN_KV_MTP"))
        self.assertIsNone(cpu_defaults._flag_value(new, "--speculative-draft-attention-backend"))

    def test_sglang_draft_factory_still_lacks_torch_native(self):
        from sglang.srt.speculative import draft_utils

        src = inspect.getsource(draft_utils.DraftBackendFactory.create_decode_backend)
        self.assertIn('"triton"', src)
        self.assertNotIn('"torch_native"', src)



class TestDeferredEarlyChecksForNextn(unittest.TestCase):
    """Deferred mode with NEXTN / EAGLE passes the launcher's early checks although the MTP
    draft directory carries the target's hybrid config (its loaded layers are checked
    in-process); the same draft directory with FROZEN_KV_MTP is still refused by its config,
    and EAGLE3 is refused."""

    def _dirs(self, tmp):
        for d in ("t", "d"):
            os.makedirs(os.path.join(tmp, d))
            with open(os.path.join(tmp, d, "config.json"), "w") as f:
                json.dump({"model_type": "qwen3_next", "layer_types": ["linear_attention", "full_attention"]}, f)
        return os.path.join(tmp, "t"), os.path.join(tmp, "d")

    def test_accepted_with_the_models_own_mtp_head(self):
        from sglang_mamba_ext.plugin.early_checks import early_model_checks
        from sglang_mamba_ext.plugin.startup_errors import FlagError

        with tempfile.TemporaryDirectory() as tmp:
            target, draft = self._dirs(tmp)
            for algo in ("NEXTN", "EAGLE", "FROZEN_KV_MTP", "EAGLE3"):
                argv = ["--model-path", target, "--speculative-algorithm", algo,
                        "--speculative-draft-model-path", draft, "--mamba-spec-state-update", "deferred"]
                if algo in ("NEXTN", "EAGLE"):
                    early_model_checks(argv)
                else:
                    with self.assertRaisesRegex(FlagError, "draft without|EAGLE3"):
                        early_model_checks(argv)


if __name__ == "__main__":
    unittest.main()
