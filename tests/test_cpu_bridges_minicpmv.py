"""plugin/cpu_bridges_minicpmv.py: MiniCPM-V 4.6 / 4.7 on CPU (issue 40). Their served check is
``tests/e2e/test_sglang_families_serving.py::TestMiniCPMV46Serving``."""

import importlib.util
import os
import unittest
from unittest import mock

from sglang_mamba_ext.plugin import cpu_bridges, cpu_bridges_minicpmv

SGLANG_INSTALLED = importlib.util.find_spec("sglang") is not None


def _sglang_file(*parts):
    spec = importlib.util.find_spec("sglang")
    path = os.path.join(os.path.dirname(spec.origin), "srt", *parts)
    with open(path, encoding="utf-8") as f:
        return f.read()


class TestGetDevice(unittest.TestCase):
    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_gap_present_upstream(self):
        """SGLang still moves the 4.6 merger to ``get_device()``, which has no CPU answer."""
        self.assertIn("return merger.to(device=get_device(), dtype=torch.get_default_dtype())",
                      _sglang_file("models", "minicpmv.py"))
        self.assertIn("No accelerator (CUDA, XPU, HPU, NPU, MUSA, MPS) or platform plugin is available.",
                      _sglang_file("utils", "common.py"))

    def test_cpu_only_where_sglang_finds_no_accelerator_on_an_active_process(self):
        def none(device_id=None):
            raise RuntimeError("No accelerator")

        with mock.patch.object(cpu_bridges, "active", return_value=True):
            self.assertEqual(cpu_bridges_minicpmv.get_device_around(none), "cpu")
            self.assertEqual(cpu_bridges_minicpmv.get_device_around(lambda device_id=None: "cuda"), "cuda")
            with self.assertRaises(RuntimeError):  # a device index is not answered
                cpu_bridges_minicpmv.get_device_around(none, 1)
        with mock.patch.object(cpu_bridges, "active", return_value=False):
            with self.assertRaises(RuntimeError):
                cpu_bridges_minicpmv.get_device_around(none)


class _Inner:
    pass


class _Wrapper:  # SGLang's MiniCPMV: a plain object, reads go to .minicpmv
    def __init__(self):
        self.minicpmv = _Inner()

    def __getattr__(self, name):
        return getattr(self.__dict__["minicpmv"], name)


class TestSharedExpertsLayout(unittest.TestCase):
    @unittest.skipUnless(SGLANG_INSTALLED, "needs SGLang")
    def test_gap_present_upstream(self):
        """The loader sets the layout on what it built and returns ``model.eval()``; SGLang's
        MiniCPMV wrapper is no ``nn.Module`` and its version module's ``eval`` returns itself."""
        loader = _sglang_file("model_loader", "loader.py")
        self.assertIn("model.shared_experts_config = shared_experts", loader)
        self.assertIn("return model.eval()", loader)
        minicpmv = _sglang_file("models", "minicpmv.py")
        self.assertIn("class MiniCPMV:", minicpmv)
        self.assertIn("    def eval(self):\n        super().eval()\n        return self", minicpmv)

    def test_inner_module_gets_the_layout_on_an_active_process(self):
        def init(*args, **kwargs):
            model = _Wrapper()
            model.shared_experts_config = "layout"
            return model

        with mock.patch.object(cpu_bridges, "active", return_value=True):
            model = cpu_bridges_minicpmv.initialize_model_around(init)
        self.assertEqual(model.minicpmv.shared_experts_config, "layout")
        with mock.patch.object(cpu_bridges, "active", return_value=False):
            model = cpu_bridges_minicpmv.initialize_model_around(init)
        self.assertFalse(hasattr(model.minicpmv, "shared_experts_config"))

    def test_other_models_untouched(self):
        class Plain:
            pass

        def init(*args, **kwargs):
            m = Plain()
            m.shared_experts_config = "layout"
            return m

        with mock.patch.object(cpu_bridges, "active", return_value=True):
            m = cpu_bridges_minicpmv.initialize_model_around(init)
        self.assertEqual(vars(m), {"shared_experts_config": "layout"})


if __name__ == "__main__":
    unittest.main()
