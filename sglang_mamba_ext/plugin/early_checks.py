"""Model-level refusals made before any process starts (``docs/design.md``, "SGLang wiring").

Some combinations can only be refused once a model is known: SGLang reads configs inside the
scheduler processes, where an error is a traceback and a killed process group. The ones that
can be decided from the local ``config.json`` files named on the command line are checked
here, on the raw argv, in the launcher's own process, and raised as
:class:`~sglang_mamba_ext.plugin.startup_errors.FlagError` (reported like an argparse error,
exit status 2). Only for the project's tiny model or ``--mamba-spec-state-update deferred``;
every other launch is untouched. The in-process checks (``plugin/speculative/hooks.py``,
``models/tiny_shard.py``) stay for hub models and ``sglang.Engine``.
"""

from __future__ import annotations

from typing import Sequence

from sglang_mamba_ext.plugin.cpu_defaults import TINY_MODEL_TYPE, _flag_value, _int_flag, local_model_config
from sglang_mamba_ext.plugin.startup_errors import FlagError

#: ``model_type`` of SGLang's Mamba2-family hybrids (``configs/hybrid_arch.py::mamba2_config``).
MAMBA2_MODEL_TYPES = frozenset({
    "nemotron_h", "falcon_h1", "mamba2", "mamba", "falcon_mamba", "granitemoehybrid", "lfm2", "lfm2_moe", "zaya",
})
#: Those among them whose linear layers are SGLang's ``MambaMixer2`` (deferred verify:
#: ``plugin/speculative/mamba2_verify.py``).
MAMBA2_MIXER_MODEL_TYPES = frozenset({"nemotron_h", "falcon_h1", "granitemoehybrid", "mamba2"})
_HEADS = ("num_attention_heads", "num_key_value_heads", "linear_num_key_heads", "linear_num_value_heads")


def _check_tiny(cfg: dict, argv: Sequence[str]) -> None:
    from sglang_mamba_ext.models.linear_attn import GATES

    gate = cfg.get("linear_gate", "kda")
    if gate not in GATES:
        raise FlagError(f"--model-path: config.json has linear_gate={gate!r}; use one of {GATES} "
                        "(scripts/make_tiny_model.py --linear-gate)")
    _check_sglang_kernels(cfg, argv)
    _check_kda_heads(cfg)
    tp = _int_flag(argv, "--tp", "--tp-size", "--tensor-parallel-size")
    if _flag_value(argv, "--enable-dp-attention") is not None:
        tp //= max(1, _int_flag(argv, "--dp", "--dp-size", "--data-parallel-size"))
    for name in _HEADS:
        n = cfg.get(name)
        if isinstance(n, int) and tp > 1 and n % tp:
            ok = ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)
            raise FlagError(f"--tp {tp}: the tiny model's {name}={n} is not divisible by it; use --tp {ok} "
                            "(attention and linear-attention heads are split evenly over the ranks)")


def _check_kda_heads(cfg: dict) -> None:
    """``TinyHybridKDAForCausalLM`` (SGLang's KDA backend) needs equal linear key/value heads
    and head dims (Kimi-Linear's pool layout; ``models/tiny_builder.py::check_kda_sglang_heads``)."""
    from sglang_mamba_ext.models.tiny_builder import DEFAULT_CONFIG, check_kda_sglang_heads
    from sglang_mamba_ext.plugin.tiny_hybrid import KDA_SGLANG_ARCHITECTURE

    if KDA_SGLANG_ARCHITECTURE not in (cfg.get("architectures") or []):
        return
    try:
        check_kda_sglang_heads(dict(DEFAULT_CONFIG, **cfg))
    except ValueError as e:
        raise FlagError(f"--model-path: {e}; rebuild it with scripts/make_tiny_model.py --linear-gate kda "
                        "--linear-kernels sglang") from None


def _check_sglang_kernels(cfg: dict, argv: Sequence[str]) -> None:
    """The tiny model built with ``--linear-kernels sglang`` on a host without CUDA: SGLang's
    Triton kernels must run under Triton's interpreter, in float16 (``plugin/triton_interpret.py``)."""
    import os

    import torch

    from sglang_mamba_ext.plugin.cpu_defaults import DISABLE_ENV
    from sglang_mamba_ext.plugin.tiny_hybrid import SGLANG_KERNEL_ARCHITECTURES

    archs = [a for a in (cfg.get("architectures") or []) if a in SGLANG_KERNEL_ARCHITECTURES]
    if not archs or torch.cuda.is_available():
        return
    interp = os.environ.get("TRITON_INTERPRET")
    defaults_off = os.environ.get(DISABLE_ENV, "0") not in ("", "0")
    if (interp is not None and interp != "1") or (interp is None and defaults_off):
        raise FlagError(f"--model-path: {archs[0]} runs SGLang's own Triton kernels, which need CUDA or, on this host "
                        f"without CUDA, Triton's interpreter: set TRITON_INTERPRET=1 (now "
                        f"{'unset' if interp is None else repr(interp)}), or serve a model built without "
                        "--linear-kernels sglang")
    dtype = _flag_value(argv, "--dtype")
    if dtype not in (None, "", "auto", "half", "float16"):
        raise FlagError(f"--dtype {dtype}: {archs[0]} on CPU runs SGLang's kernels under Triton's interpreter, "
                        "served in float16 only (the CPU defaults' float16 conv window must match the model's dtype; "
                        "bfloat16 is untried there; SGLang's chunked GDN kernel refuses float32); "
                        "use --dtype float16 or leave --dtype out")


def _check_deferred(argv: Sequence[str]) -> None:
    algo = (_flag_value(argv, "--speculative-algorithm") or "").upper()
    if algo == "EAGLE3":
        raise FlagError("--mamba-spec-state-update deferred runs with --speculative-algorithm FROZEN_KV_MTP, NEXTN "
                        "or EAGLE; EAGLE3 (its draft reads several target layers' hidden states) is untried with "
                        "it: use --mamba-spec-state-update snapshot")
    target = local_model_config(_flag_value(argv, "--model-path"))
    mt = target.get("model_type")
    if mt in MAMBA2_MODEL_TYPES - MAMBA2_MIXER_MODEL_TYPES:
        raise FlagError(f"--mamba-spec-state-update deferred supports KDA (Kimi-Linear), Gated DeltaNet "
                        f"(Qwen3-Next) and Mamba2 (Nemotron-H, Falcon-H1, GraniteMoeHybrid) hybrids; {mt} (short "
                        "conv, Mamba1 or CCA layers) needs its own replay kernel: use "
                        "--mamba-spec-state-update snapshot")
    if algo in ("NEXTN", "EAGLE"):
        # a model's own MTP draft directory carries the target's hybrid config, yet SGLang
        # builds its MTP class from it (e.g. Qwen3NextForCausalLMMTP: one attention layer);
        # the loaded draft's layers are checked in-process (hooks.model_runner_init_after)
        return
    draft = local_model_config(_flag_value(argv, "--speculative-draft-model-path"))
    dt = draft.get("model_type")
    if dt == TINY_MODEL_TYPE or dt in MAMBA2_MODEL_TYPES or "linear_attention" in (draft.get("layer_types") or []):
        raise FlagError("--speculative-draft-model-path: --mamba-spec-state-update deferred needs a draft without "
                        f"Mamba/linear-attention layers ({dt} has them; a frozen-KV draft reads the target's KV "
                        "only): use another draft or --mamba-spec-state-update snapshot")


def early_model_checks(argv: Sequence[str]) -> None:
    """Raise :class:`FlagError` for the combinations in the module docstring."""
    cfg = local_model_config(_flag_value(argv, "--model-path"))
    if cfg.get("model_type") == TINY_MODEL_TYPE:
        _check_tiny(cfg, argv)
    if _flag_value(argv, "--mamba-spec-state-update") == "deferred":
        _check_deferred(argv)
