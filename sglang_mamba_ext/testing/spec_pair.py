"""Seeded tiny target + draft-head pair for the speculative-decoding tests and scripts
(``docs/design.md``, "Speculative verify"), and the helpers that run this package's Triton
kernels on CPU under Triton's interpreter. The target is
:class:`~sglang_mamba_ext.models.tiny_hybrid.TinyHybridReference` with random weights whose
mixer contributions are scaled by ``mix_scale``, so the next token depends mostly on the
current one (a "bigram" backbone) plus a state-dependent perturbation; the draft head starts
from the same bigram with small random attention/MLP weights, so drafts are often but not
always right and accept lengths vary from 0 to ``steps``, as the equivalence tests need. No
trained weights are involved.
"""

from __future__ import annotations

import subprocess
from typing import Tuple

import torch

from sglang_mamba_ext.models.tiny_hybrid import TinyHybridConfig, TinyHybridReference
from sglang_mamba_ext.speculative.reference.draft_head import FrozenKVDraftHead

__all__ = ["tiny_spec_pair"]


def tiny_spec_pair(
    seed: int = 0,
    vocab_size: int = 48,
    mix_scale: float = 0.3,
    draft_noise: float = 0.05,
    conv_bias: bool = False,
    embed_scale: float = 3.0,
) -> Tuple[TinyHybridReference, FrozenKVDraftHead]:
    """Build ``(target, draft)`` in fp32, eval mode, deterministic for ``seed``."""
    g = torch.Generator().manual_seed(seed)
    cfg = TinyHybridConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        layer_types=["full_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, linear_gate_rank=8,
    )
    target = TinyHybridReference(cfg)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            elif name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=g) * 0.5 - 1.0)
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            else:
                fan_in = p.shape[-1] if p.dim() > 1 else 1
                p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
        target.model.embed_tokens.weight.mul_(embed_scale)
        for layer in target.layers:
            mixer_out = layer.linear_attn.out_proj if layer.is_linear else layer.self_attn.o_proj
            mixer_out.weight.mul_(mix_scale)
            layer.mlp.down_proj.weight.mul_(mix_scale)
        target.lm_head.weight.copy_(target.model.embed_tokens.weight @ torch.randn(cfg.hidden_size, cfg.hidden_size, generator=g) / cfg.hidden_size ** 0.5 * 4.0)
        draft = FrozenKVDraftHead(cfg, kv_layer_id=cfg.full_attention_layer_ids[-1])
        for name, p in draft.named_parameters():
            if "norm" in name and p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * draft_noise / max(p.shape[-1], 1) ** 0.5)
        h = cfg.hidden_size
        draft.fc.weight[:, :h] += torch.eye(h)
    return target.eval(), draft.eval()


def run_interpreted(module: str, args=(), timeout: float = 1200) -> "subprocess.CompletedProcess":
    """``python -m MODULE ARGS`` in a process that imported Triton and SGLang with
    ``TRITON_INTERPRET=1`` (and this repository on ``PYTHONPATH``): forked from a zygote
    (:mod:`sglang_mamba_ext.testing.zygote`), so the imports are paid once per test session,
    not once per call. Returns what ``subprocess.run(..., capture_output=True, text=True)``
    would.

    Raises:
        subprocess.TimeoutExpired: not done in ``timeout`` seconds (it is killed first).
    """
    import os

    from sglang_mamba_ext.testing import zygote

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return zygote.run(module, list(args), env, timeout=timeout, cwd=root)


def run_tests_with_triton_interpreter(test_file: str, select: str = "") -> "subprocess.CompletedProcess":
    """Run ``pytest test_file [-k select]`` with Triton's interpreter (:func:`run_interpreted`).

    For test modules imported after Triton was already loaded without the interpreter (and
    with no CUDA): Triton reads the variable at import, so the CPU run needs a new process.
    """
    args = ["-q", "-p", "no:cacheprovider", test_file]
    if select:
        args += ["-k", select]
    return run_interpreted("pytest", args)


def load_triton_kernels_for_cpu() -> bool:
    """Import this package's Triton kernel modules so that they can run here: on CUDA as they
    are; without CUDA under Triton's interpreter, which ``@triton.jit`` selects at decoration
    time from ``TRITON_INTERPRET`` — so the variable is set only while these modules are
    imported and restored afterwards (nothing else in the process changes). Returns False when
    they, or Triton itself, were already imported without the interpreter (Triton's own
    ``@triton.jit`` library, ``tl.zeros`` and the like, cannot run inside an interpreted kernel
    then; SGLang imports Triton, so any test module importing SGLang first causes this) — then
    use :func:`run_tests_with_triton_interpreter`.
    """
    import importlib
    import os
    import sys

    import torch

    names = (
        "sglang_mamba_ext.speculative.ops.triton_utils",
        "sglang_mamba_ext.speculative.ops.replay.fused",
        "sglang_mamba_ext.speculative.ops.verify.fused",
        "sglang_mamba_ext.speculative.ops.verify.onchip_raw",
    )
    if torch.cuda.is_available():
        for n in names:
            importlib.import_module(n)
        return True
    if not all(n in sys.modules for n in names):
        old = os.environ.get("TRITON_INTERPRET")
        os.environ["TRITON_INTERPRET"] = "1"
        try:
            for n in names:
                if n not in sys.modules:
                    importlib.import_module(n)
        finally:
            if old is None:
                del os.environ["TRITON_INTERPRET"]
            else:
                os.environ["TRITON_INTERPRET"] = old
    from triton.runtime.interpreter import InterpretedFunction

    import triton.language as tl

    from sglang_mamba_ext.speculative.ops import triton_utils
    from sglang_mamba_ext.speculative.ops.replay import fused as replay_fused
    from sglang_mamba_ext.speculative.ops.verify import fused as verify_fused

    kernels = (tl.zeros, triton_utils.gated_delta_step, replay_fused._replay_recurrent_kernel,
               verify_fused._tree_verify_kernel)
    return all(isinstance(k, InterpretedFunction) for k in kernels)


def load_kernel_modules_for_cpu(modules, kernels) -> bool:
    """:func:`load_triton_kernels_for_cpu`, then import ``modules`` (dotted names of this
    package's Triton kernel modules) the same way: as they are on CUDA, under Triton's
    interpreter otherwise. ``kernels``: ``(module name, attribute)`` pairs that must come out
    interpreted on CPU. Returns whether the kernels can run here (False: Triton was already
    imported without the interpreter; use :func:`triton_subprocess_case`)."""
    import importlib

    import torch

    if not load_triton_kernels_for_cpu():
        return False
    if torch.cuda.is_available():
        for m in modules:
            importlib.import_module(m)
        return True
    from sglang_mamba_ext.speculative.ops.triton_utils import interpreter_env, is_interpreted

    with interpreter_env():
        loaded = {m: importlib.import_module(m) for m in modules}
    return all(is_interpreted(getattr(loaded[m], k)) for m, k in kernels)


def triton_interpreter_env():
    """Context manager: ``TRITON_INTERPRET=1`` while Triton kernels run on CPU (the interpreter
    also reads it at launch); a no-op with CUDA. Restores the previous value on exit."""
    import contextlib

    import torch

    from sglang_mamba_ext.speculative.ops.triton_utils import interpreter_env

    return contextlib.nullcontext() if torch.cuda.is_available() else interpreter_env()


def triton_subprocess_case(test_file: str, select: str, skip: bool):
    """A ``unittest.TestCase`` class that runs the Triton tests of ``test_file`` (``-k
    select``) in a fresh process with ``TRITON_INTERPRET=1`` — for CPU hosts where Triton was
    imported in this process before the interpreter could be switched on. Skipped when
    ``skip`` (the tests already ran in this process)."""
    import os
    import unittest

    @unittest.skipIf(skip, "ran in this process")
    class TestUnderTritonInterpreter(unittest.TestCase):
        def test_in_subprocess(self):
            r = run_tests_with_triton_interpreter(os.path.abspath(test_file), select)
            self.assertEqual(r.returncode, 0, (r.stdout + r.stderr)[-4000:])
            self.assertIn("passed", r.stdout)

    return TestUnderTritonInterpreter
