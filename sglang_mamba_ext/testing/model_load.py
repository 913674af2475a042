"""Load a tiny checkpoint into SGLang's own model class, in-process on CPU, without a server
(issue 40): for checkpoints whose weights are written by hand (``models/hf_tiny_written.py``),
that every parameter of SGLang's class is filled from the file (SGLang's loaders skip names they
do not know and leave parameters they are not given as they were, so a served check alone would
not notice a misnamed tensor).

``python -m sglang_mamba_ext.testing.model_load MODEL_DIR... [PORT]`` prints one JSON line per
directory, in order: ``{"model": MODEL_DIR, "class": <the class SGLang's registry resolves>,
"unloaded": [parameters still NaN after load_weights], "parameters": <count>}``. Parameters
start as NaN. SGLang is imported once (about 15 s on 2 cores), then each directory is checked in
a child forked from that process, under its own server args (its CPU defaults) and its own
one-rank gloo group (on a free port; PORT is the first one's). (The MTP drafts' version of this
check: :mod:`.mtp_load`.)
"""

from __future__ import annotations

import json
import sys


def load_nan_filled(sa, model_path: str, port: int, weights: dict, is_draft_model: bool = False):
    """``(model_config, model class, model)``: SGLang's class for ``model_path`` under the
    server args ``sa``, built on CPU in float16 with every parameter NaN, then given
    ``weights`` (name -> tensor) through its own ``load_weights``; a one-rank gloo group on
    ``port`` is initialised first (once per process). Shared with :mod:`.mtp_load`."""
    import torch

    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.model_loader.utils import get_model_architecture
    from sglang.srt.runtime_context import create_context, get_parallel, use_context

    with use_context(create_context(sa, role="scheduler")):
        mc = ModelConfig.from_server_args(sa, model_path=model_path, is_draft_model=is_draft_model)
        cls, _ = get_model_architecture(mc)
        init_distributed_environment(backend="gloo", world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}")
        with get_parallel().override(tp_rank=0, pp_rank=0, attn_tp_rank=0, moe_ep_rank=0, moe_tp_rank=0,
                                     attn_dp_rank=0, attn_cp_rank=0):
            initialize_model_parallel()
            torch.set_default_dtype(torch.float16)
            model = cls(config=mc.hf_config)  # keyword: some classes (Ling 2.5) take no positional config
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
            model.load_weights(iter(weights.items()))
    return mc, cls, model


def check(model_dir: str, port: int = 29541) -> dict:
    import torch
    from safetensors.torch import load_file

    from sglang_mamba_ext.benchmarks.scheduler import apply_plugin

    apply_plugin()
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", model_dir, "--device", "cpu"]
    with open(f"{model_dir}/config.json") as f:
        archs = json.load(f).get("architectures") or []
    if "InklingForConditionalGeneration" in archs:
        # the class asserts SGLang's extra_buffer strategy (models/inkling.py:977), which SGLang
        # refuses on CPU; the plugin's flag lets it through (plugin/args.py)
        argv.append("--enable-mamba-radix")
    sa = prepare_server_args(argv)
    _, cls, model = load_nan_filled(sa, model_dir, port, load_file(f"{model_dir}/model.safetensors"))
    params = dict(model.named_parameters())
    unloaded = sorted(n for n, p in params.items() if torch.isnan(p).any())
    return {"model": model_dir, "class": cls.__name__, "unloaded": unloaded, "parameters": len(params)}


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv) -> int:
    """Check each directory in ``argv`` (a trailing number: the first one's gloo port) in a
    forked child; returns the number of children that failed (their tracebacks on stderr)."""
    import os
    import traceback

    port = int(argv.pop()) if len(argv) > 1 and argv[-1].isdigit() else 29541
    # Imported and applied once, before the forks: SGLang's model registry imports every model
    # module (``models/registry.py``), and applying the plugin's hooks walks every imported
    # module once per target (``hook_registry.py::_propagate_patch``); seconds per child else.
    import sglang.srt.model_loader.utils  # noqa: F401
    import sglang.srt.models.registry  # noqa: F401
    import sglang.srt.server_args  # noqa: F401

    from sglang_mamba_ext.benchmarks.scheduler import apply_plugin

    apply_plugin()

    failed = 0
    for i, model_dir in enumerate(argv):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                print(json.dumps(check(model_dir, port if i == 0 else _free_port())), flush=True)
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        failed += os.waitstatus_to_exitcode(status) != 0
    return failed


if __name__ == "__main__":
    sys.exit(1 if main(sys.argv[1:]) else 0)
