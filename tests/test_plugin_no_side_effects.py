"""Installing the plugin changes nothing without its flags (issue 10, item 6).

For a model that is not the project's own and none of ``--enable-mamba-radix``,
``--warmups kda_cache``, ``--mamba-spec-state-update``, SGLang must resolve the same
``ServerArgs`` and leave the same ``os.environ`` with the plugin as without it. Each side runs
in a fresh process the launcher's own path up to the server start (``load_plugins()``,
``prepare_server_args(argv)``, ``ServerArgs.resolve_once()``, as
``sglang/launch_server.py`` does); the plugin is selected with ``SGLANG_PLUGINS``
(``sglang/srt/plugins/__init__.py``): the other installed general plugins with and without
``mamba_radix``. Compared exactly: every record field as parsed, every field as resolved
(``resolved_view``), the record's extra attributes (objects by their attributes, addresses
left out), and the whole environment except ``SGLANG_PLUGINS`` itself.
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest
from importlib.metadata import entry_points

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = "mamba_radix"
MARK = "RESOLVED-JSON:"

# Runs in the child: argv lists come as JSON in sys.argv[1]; prints one JSON line.
_RESOLVE = r"""
import json, os, re, sys
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.srt.arg_groups.arg_utils import record_fields
from sglang.srt.arg_groups.model_override_base import resolved_view

def shown(value, depth=0):
    # an object's default repr holds its address: show its attributes instead (two levels)
    text = repr(value)
    if " object at 0x" in text and depth < 2 and hasattr(value, "__dict__"):
        return {type(value).__name__: {k: shown(v, depth + 1) for k, v in sorted(vars(value).items())}}
    return re.sub(r" at 0x[0-9a-f]+", " at 0x?", text)

load_plugins()
out = []
for argv in json.loads(sys.argv[1]):
    sa = prepare_server_args(argv)
    parsed = {f.name: repr(getattr(sa, f.name)) for f in record_fields(ServerArgs)}
    sa.resolve_once()
    view = resolved_view(sa)
    out.append({
        "parsed": parsed,
        "resolved": {f.name: repr(getattr(view, f.name)) for f in record_fields(ServerArgs)},
        "extra": {k: shown(v) for k, v in vars(sa).items()},
        "env": dict(os.environ),
    })
print(%r + json.dumps(out))
""" % MARK


def _other_plugins():
    return sorted({e.name for e in entry_points(group="sglang.srt.plugins")} - {PLUGIN})


def _write_llama(path):
    os.makedirs(path)
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "vocab_size": 256, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def _write_qwen3_next(path):
    """A Qwen3-Next-shaped hybrid (gated delta-net linear attention + full attention),
    tiny, float32: SGLang's own linear-attention model, not this project's."""
    os.makedirs(path)
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "num_hidden_layers": 4, "full_attention_interval": 4, "vocab_size": 256,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "torch_dtype": "float32",
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
        "decoder_sparse_step": 1, "partial_rotary_factor": 0.25, "rope_theta": 10000.0,
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def _resolve(argvs, with_plugin):
    env = {k: v for k, v in os.environ.items()
           if k not in ("SGLANG_MAMBA_CONV_DTYPE", "SGLANG_EXTERNAL_MODEL_PACKAGE", "SGLANG_MAMBA_EXT_NO_CPU_DEFAULTS")}
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    names = _other_plugins() + ([PLUGIN] if with_plugin else [])
    # an empty SGLANG_PLUGINS would load every plugin: name one that does not exist instead
    env["SGLANG_PLUGINS"] = ",".join(names) or "no-such-plugin"
    out = subprocess.run(
        [sys.executable, "-c", _RESOLVE, json.dumps(argvs)],
        capture_output=True, text=True, env=env, timeout=900, cwd=REPO,
    )
    if out.returncode != 0:
        raise AssertionError(f"resolution failed (plugin={with_plugin}):\n{out.stderr[-4000:]}")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith(MARK)][-1]
    results = json.loads(line[len(MARK):])
    for r in results:
        r["env"].pop("SGLANG_PLUGINS")
    return results


@pytest.mark.slow  # fresh processes importing SGLang: 1-2 min on 2 cores
class TestNoSideEffectsWithoutFlags(unittest.TestCase):
    maxDiff = None

    def test_same_server_args_and_environment_with_and_without_plugin(self):
        tmp = tempfile.TemporaryDirectory(prefix="no-side-effects-")
        self.addCleanup(tmp.cleanup)
        llama = os.path.join(tmp.name, "llama")
        qwen = os.path.join(tmp.name, "qwen3_next")
        _write_llama(llama)
        _write_qwen3_next(qwen)
        # --random-seed: unset, SGLang draws one at resolution
        argvs = [
            ["--model-path", llama, "--device", "cpu", "--random-seed", "0"],
            # stock SGLang refuses its default strategy for this model on CPU (extra_buffer)
            ["--model-path", qwen, "--device", "cpu", "--random-seed", "0",
             "--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"],
        ]
        without = _resolve(argvs, with_plugin=False)
        with_ = _resolve(argvs, with_plugin=True)
        self.assertEqual(len(with_), 2)
        for argv, a, b in zip(argvs, without, with_):
            for part in ("parsed", "resolved", "extra", "env"):
                with self.subTest(model=os.path.basename(argv[1]), part=part):
                    self.assertEqual(b[part], a[part])


if __name__ == "__main__":
    unittest.main()
