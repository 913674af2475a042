"""The plugin as SGLang finds it: the ``sglang.srt.plugins`` entry point of the installed
package (``pip install -e .``), ``load_plugins()`` in a fresh process, and the flags in
``python -m sglang.launch_server --help``."""

import json
import os
import subprocess
import sys
import unittest
from importlib.metadata import entry_points

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return env


class TestEntryPoint(unittest.TestCase):
    def test_entry_point_is_installed(self):
        eps = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "mamba_radix"]
        self.assertEqual(len(eps), 1, "pip install -e . registers the entry point")
        self.assertEqual(eps[0].value, "sglang_mamba_ext.plugin:register")

    @classmethod
    def fresh_process(cls) -> dict:
        """What ``load_plugins()`` leaves in a fresh interpreter (one SGLang import, ~30 s on 2
        cores, shared by the two tests below): first the model lookup SGLang's loader binds,
        then the registrations."""
        if getattr(cls, "_fresh", None) is None:
            code = (
                "import json, os, sys\n"
                "from types import SimpleNamespace\n"
                "from sglang.srt.plugins import load_plugins\n"
                "from sglang.srt.plugins.hook_registry import HookRegistry\n"
                "load_plugins()\n"
                "after_load = 'SGLANG_EXTERNAL_MODEL_PACKAGE' in os.environ\n"
                "from sglang.srt.configs.model_config import ModelImpl\n"
                "from sglang.srt.model_loader import loader\n"
                "cfg = SimpleNamespace(hf_config=SimpleNamespace(architectures=['TinyHybridForCausalLM']),\n"
                "    quantization=None, model_impl=ModelImpl.AUTO, is_embedding_gemma=False)\n"
                "cls, arch = loader.get_model_architecture(cfg)\n"
                "from sglang.srt.models.registry import ModelRegistry\n"
                "tiny = {'cls': cls.__module__ + '.' + cls.__name__, 'arch': arch,\n"
                "  'env_after_load': after_load, 'env_after': 'SGLANG_EXTERNAL_MODEL_PACKAGE' in os.environ,\n"
                "  'builtin_models_loaded': ModelRegistry._default_models_loaded}\n"
                "from sglang.srt.mem_cache.registry import get_radix_cache_factory\n"
                "from sglang.srt.entrypoints.warmup import _warmup_registry\n"
                "import sglang_mamba_ext.plugin.registration as p\n"
                "print(json.dumps({'tiny': tiny,\n"
                "  'backend': get_radix_cache_factory('mamba_radix_ext') is not None,\n"
                "  'warmup': 'kda_cache' in _warmup_registry,\n"
                "  'patched': sorted(t for t in HookRegistry._patched if t in (p.ADD_CLI_ARGS, p.FROM_CLI_ARGS,\n"
                "      p.VALIDATE_EXTRA_BUFFER, p.HANDLE_MAMBA_RADIX, p.BUILD_HYBRID_REQ_POOL, p.PREPARE_FOR_DECODE,\n"
                "      p.VALIDATE_ONE_REQUEST, p.GET_INTERNAL_STATE, p.CHAT_CONVERT, p.CHAT_RENDER)),\n"
                "  'file': p.__file__}))\n"
            )
            env = _env()
            env["SGLANG_PLUGINS"] = "mamba_radix"
            env.pop("SGLANG_EXTERNAL_MODEL_PACKAGE", None)
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
            if out.returncode != 0:
                raise AssertionError(out.stderr[-3000:])
            cls._fresh = json.loads(out.stdout.strip().splitlines()[-1])
        return cls._fresh

    @pytest.mark.slow  # a fresh interpreter importing SGLang: ~30 s on 2 cores
    def test_load_plugins_in_fresh_process(self):
        got = self.fresh_process()
        self.assertTrue(got["backend"])
        self.assertTrue(got["warmup"])
        self.assertEqual(len(got["patched"]), 10, got["patched"])
        self.assertTrue(got["file"].startswith(REPO), got["file"])

    @pytest.mark.slow  # the same fresh interpreter
    def test_tiny_model_class_is_found_through_the_loader_without_env(self):
        """``get_model_architecture`` as SGLang's model loader binds it resolves
        ``TinyHybridForCausalLM`` (plugin hook), importing SGLang's registry without its
        built-in models, and leaves ``SGLANG_EXTERNAL_MODEL_PACKAGE`` unset."""
        self.assertEqual(self.fresh_process()["tiny"], {
            "cls": "sglang_mamba_ext.plugin.tiny_hybrid.model.TinyHybridForCausalLM",
            "arch": "TinyHybridForCausalLM", "env_after_load": False, "env_after": False,
            "builtin_models_loaded": False,
        })

    # `python -m sglang.launch_server --help` lists the plugin's flags: tests/test_testing_server.py
    # (TestZygote, the same launcher forked from a process that imported SGLang)


if __name__ == "__main__":
    unittest.main()
