"""CPU-safe launch defaults added by the plugin (sglang_mamba_ext.plugin.cpu_defaults)."""

import json
import os
import tempfile
import unittest
from unittest import mock

from sglang_mamba_ext.plugin import cpu_defaults
from sglang_mamba_ext.plugin.cpu_defaults import cpu_default_args


class TestCpuDefaultArgs(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        with open(os.path.join(self.tmp.name, "config.json"), "w") as f:
            json.dump({"torch_dtype": "float32", "model_type": "tiny_hybrid"}, f)
        env = mock.patch.dict(os.environ, {cpu_defaults.DISABLE_ENV: "0"})
        env.start()
        self.addCleanup(env.stop)

    def test_minimal_cpu_launch_gets_all_defaults(self):
        argv = ["--model-path", self.tmp.name, "--device", "cpu", "--port", "30000"]
        new, added = cpu_default_args(argv)
        self.assertEqual(new[: len(argv)], argv)
        self.assertEqual(cpu_defaults._flag_value(new, "--attention-backend"), "torch_native")
        self.assertEqual(cpu_defaults._flag_value(new, "--dtype"), "float32")
        self.assertEqual(cpu_defaults._flag_value(new, "--max-total-tokens"), str(cpu_defaults.DEFAULT_MAX_TOTAL_TOKENS))
        self.assertEqual(
            cpu_defaults._flag_value(new, "--max-mamba-cache-size"), str(cpu_defaults.DEFAULT_MAX_MAMBA_CACHE_SIZE)
        )
        self.assertEqual(len(added), 4)

    def test_user_flags_are_kept(self):
        argv = [
            "--model-path", self.tmp.name, "--device=cpu", "--dtype", "bfloat16",
            "--attention-backend=triton", "--mem-fraction-static", "0.1",
        ]
        new, added = cpu_default_args(argv)
        self.assertEqual(new, argv)
        self.assertEqual(added, [])

    def test_not_cpu_or_config_file_or_opt_out_is_untouched(self):
        for argv in (
            ["--model-path", self.tmp.name],
            ["--model-path", self.tmp.name, "--device", "cuda"],
            ["--model-path", self.tmp.name, "--device", "cpu", "--config", "x.yaml"],
        ):
            self.assertEqual(cpu_default_args(argv), (argv, []))
        with mock.patch.dict(os.environ, {cpu_defaults.DISABLE_ENV: "1"}):
            argv = ["--model-path", self.tmp.name, "--device", "cpu"]
            self.assertEqual(cpu_default_args(argv), (argv, []))

    def test_bf16_checkpoint_keeps_dtype_auto(self):
        with open(os.path.join(self.tmp.name, "config.json"), "w") as f:
            json.dump({"torch_dtype": "bfloat16", "model_type": "tiny_hybrid"}, f)
        new, _ = cpu_default_args(["--model-path", self.tmp.name, "--device", "cpu"])
        self.assertIsNone(cpu_defaults._flag_value(new, "--dtype"))

    def test_other_models_get_defaults_only_under_the_flag(self):
        with open(os.path.join(self.tmp.name, "config.json"), "w") as f:
            json.dump({"torch_dtype": "float32", "model_type": "llama"}, f)
        argv = ["--model-path", self.tmp.name, "--device", "cpu"]
        self.assertEqual(cpu_default_args(argv), (argv, []))
        self.assertEqual(cpu_default_args(["--model-path", "org/hub-name", "--device", "cpu"]),
                         (["--model-path", "org/hub-name", "--device", "cpu"], []))
        with mock.patch.dict(os.environ, {}, clear=False):
            os.environ.pop(cpu_defaults.CONV_DTYPE_ENV, None)
            before = dict(os.environ)
            (new,), _ = cpu_defaults._before_prepare_server_args(argv)
            self.assertEqual(new, argv)
            self.assertEqual(dict(os.environ), before)
        new, added = cpu_default_args(argv + ["--enable-mamba-radix"])
        self.assertEqual(added, [
            "--attention-backend torch_native", "--dtype float32",
            f"--max-total-tokens {cpu_defaults.DEFAULT_MAX_TOTAL_TOKENS}",
            f"--max-mamba-cache-size {cpu_defaults.DEFAULT_MAX_MAMBA_CACHE_SIZE}",
        ])
        self.assertEqual(new, argv + ["--enable-mamba-radix"] + " ".join(added).split())

    def test_hook_sets_conv_dtype_env_only_if_unset(self):
        argv = ["--model-path", self.tmp.name, "--device", "cpu"]
        with mock.patch.dict(os.environ, {}, clear=False):
            os.environ.pop(cpu_defaults.CONV_DTYPE_ENV, None)
            (new,), _ = cpu_defaults._before_prepare_server_args(argv)
            self.assertEqual(os.environ[cpu_defaults.CONV_DTYPE_ENV], "float32")
            self.assertIn("--max-total-tokens", new)
        with mock.patch.dict(os.environ, {cpu_defaults.CONV_DTYPE_ENV: "bfloat16"}):
            cpu_defaults._before_prepare_server_args(argv)
            self.assertEqual(os.environ[cpu_defaults.CONV_DTYPE_ENV], "bfloat16")

    def test_install_registers_before_hook(self):
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        cpu_defaults.install_cpu_defaults()
        hooks = HookRegistry._hooks.get(cpu_defaults.HOOK_TARGET, [])
        self.assertIn((HookType.BEFORE, cpu_defaults._before_prepare_server_args), [(t, h) for t, h, _ in hooks])


class TestTinyHFCheckpoints(unittest.TestCase):
    """The project's tiny checkpoints of SGLang's own classes (``config.json`` key
    ``sglang_mamba_ext_tiny``) get the CPU defaults and the CPU bridges' variable with no flag;
    the same class without the key only under ``--enable-mamba-radix``."""

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.addCleanup(self.tmp.cleanup)
        self.cfg = {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h",
                    "torch_dtype": "float16", cpu_defaults.TINY_HF_MARKER: "nemotron_h"}
        self._write()
        env = mock.patch.dict(os.environ, {cpu_defaults.DISABLE_ENV: "0"})
        env.start()
        self.addCleanup(env.stop)
        cuda = mock.patch("torch.cuda.is_available", return_value=False)
        cuda.start()
        self.addCleanup(cuda.stop)

    def _write(self):
        with open(os.path.join(self.tmp.name, "config.json"), "w") as f:
            json.dump(self.cfg, f)

    def test_marker_detected(self):
        argv = ["--model-path", self.tmp.name, "--device", "cpu"]
        self.assertEqual(cpu_defaults.tiny_hf_arch(argv), "nemotron_h")
        self.cfg.pop(cpu_defaults.TINY_HF_MARKER)
        self._write()
        self.assertIsNone(cpu_defaults.tiny_hf_arch(argv))
        self.assertIsNone(cpu_defaults.tiny_hf_arch(["--model-path", "org/hub", "--device", "cpu"]))

    def test_stock_launch_gets_no_buffer_and_no_overlap(self):
        argv = ["--model-path", self.tmp.name, "--device", "cpu"]
        new, added = cpu_default_args(argv)
        self.assertEqual(added, [
            "--attention-backend torch_native", f"--max-total-tokens {cpu_defaults.DEFAULT_MAX_TOTAL_TOKENS}",
            f"--max-mamba-cache-size {cpu_defaults.DEFAULT_MAX_MAMBA_CACHE_SIZE}",
            "--mamba-radix-cache-strategy no_buffer", "--chunked-prefill-size 64", "--disable-overlap-schedule",
        ])
        # the plugin's flag turns overlap off itself (plugin/args.py)
        new, added = cpu_default_args(argv + ["--enable-mamba-radix"])
        self.assertIn("--mamba-radix-cache-strategy no_buffer", added)
        self.assertNotIn("--disable-overlap-schedule", added)
        new, added = cpu_default_args(argv + ["--mamba-radix-cache-strategy", "extra_buffer"])
        self.assertNotIn("--disable-overlap-schedule", added)

    def test_environment_of_a_marked_checkpoint(self):
        from sglang_mamba_ext.plugin.cpu_bridges import ACTIVE_ENV

        argv = ["--model-path", self.tmp.name, "--device", "cpu"]
        names = (cpu_defaults.CONV_DTYPE_ENV, "TRITON_INTERPRET", ACTIVE_ENV)
        with mock.patch.dict(os.environ, {}, clear=False):
            for n in names:
                os.environ.pop(n, None)
            cpu_defaults._before_prepare_server_args(argv)
            self.assertEqual([os.environ.get(n) for n in names], ["float16", "1", "1"])

    def test_unmarked_checkpoint_only_under_the_flag(self):
        from sglang_mamba_ext.plugin.cpu_bridges import ACTIVE_ENV

        self.cfg.pop(cpu_defaults.TINY_HF_MARKER)
        self._write()
        argv = ["--model-path", self.tmp.name, "--device", "cpu"]
        self.assertEqual(cpu_default_args(argv), (argv, []))
        with mock.patch.dict(os.environ, {}, clear=False):
            for n in (cpu_defaults.CONV_DTYPE_ENV, "TRITON_INTERPRET", ACTIVE_ENV):
                os.environ.pop(n, None)
            before = dict(os.environ)
            cpu_defaults._before_prepare_server_args(argv)
            self.assertEqual(dict(os.environ), before)
            cpu_defaults._before_prepare_server_args(argv + ["--enable-mamba-radix"])
            self.assertEqual(os.environ.get(ACTIVE_ENV), "1")
        with mock.patch("torch.cuda.is_available", return_value=True):
            _, added = cpu_default_args(argv + ["--enable-mamba-radix"])
            self.assertNotIn("--mamba-radix-cache-strategy no_buffer", added)


if __name__ == "__main__":
    unittest.main()
