"""CPU-safe server defaults for the project's own model or ``--enable-mamba-radix`` on CPU.

When the launch is ``--device cpu`` and either the model at ``--model-path`` is the project's
tiny hybrid model (``config.json`` ``model_type`` ``tiny_hybrid``) or one of its tiny
checkpoints of SGLang's own classes (``config.json`` key ``sglang_mamba_ext_tiny``), or
``--enable-mamba-radix`` is given, a few flags the user did not pass are appended to argv, and
``SGLANG_MAMBA_CONV_DTYPE=float32`` is set unless already set. Any other launch (another model
without the flag, another device, a ``--config`` file, or
``SGLANG_MAMBA_EXT_NO_CPU_DEFAULTS=1``) keeps its argv and environment exactly. Why each
default is needed with stock SGLang 0.5.23 on CPU: ``docs/design.md``, "CPU serving".

- ``--attention-backend torch_native``: SGLang's CPU default is ``intel_amx``
  (``sglang/srt/arg_groups/platform_hook.py::handle_cpu_backends``), which needs
  ``sgl_kernel`` CPU ops that PyPI's CUDA-only ``sglang-kernel`` lacks.
- ``--dtype float32`` when the checkpoint is float32: ``--dtype auto`` downcasts a float32
  checkpoint to float16 (``sglang/srt/configs/model_config.py::_get_and_verify_dtype``).
- ``--max-total-tokens`` / ``--max-mamba-cache-size``: unset, SGLang sizes the KV pool and
  the Mamba pool from ~72% of free host memory (14 GB of KV for the tiny model).
- ``SGLANG_MAMBA_CONV_DTYPE=float32``: SGLang keeps the conv window in bf16 by default
  (``sglang/srt/configs/mamba_utils.py::mamba2_state_dtype``), about 2e-3 log-prob drift.
- with ``--speculative-algorithm`` on a host without CUDA: ``--disable-overlap-schedule`` and
  the environment of :func:`cpu_spec_env` (Triton interpreter, no ``torch.compile``, the
  plugin's CPU routing of the speculative path, ``plugin/speculative/cpu_routing.py``); with
  ``NEXTN`` / ``EAGLE`` also ``--speculative-draft-attention-backend triton`` (EAGLE's draft
  backend factory, ``speculative/draft_utils.py``, has no ``torch_native`` entry).
- with the tiny model served by SGLang's own GDN / KDA backends (``--linear-kernels sglang`` of
  ``scripts/make_tiny_model.py``) on a host without CUDA: ``TRITON_INTERPRET=1``, so that their
  Triton kernels run under Triton's interpreter (``plugin/triton_interpret.py``).
- with one of SGLang's own hybrid classes (:data:`SGLANG_HYBRID_ARCHITECTURES`: Qwen3-Next,
  Kimi-Linear, Nemotron-H, Falcon-H1, GraniteMoeHybrid, LFM2, and since issue 40 the Qwen3.5
  text and VLM classes, LFM2 MoE, LFM2-VL, Mamba2, Nemotron-H Puzzle, Falcon-Mamba, Mamba) on a
  host without CUDA,
  when it is the project's tiny checkpoint
  (``config.json`` key ``sglang_mamba_ext_tiny``, :func:`tiny_hf_arch`) or
  ``--enable-mamba-radix`` is given: ``TRITON_INTERPRET=1``, the checkpoint's half dtype for
  the conv window, ``--mamba-radix-cache-strategy no_buffer`` (SGLang refuses extra_buffer
  on CPU for them), ``--chunked-prefill-size 64`` (a cached state at each chunk's end),
  ``--disable-overlap-schedule`` without the plugin's flag (SGLang's no_buffer path needs it)
  and ``SGLANG_MAMBA_EXT_CPU_BRIDGES=1`` (:mod:`.cpu_bridges` in the scheduler processes).
- with more than one rank (``--tp`` / ``--dp`` / ``--pp-size`` > 1): the environment of
  :func:`multi_rank_env` (one CPU core list per rank, PyNccl off).

Mechanism: a BEFORE hook on ``sglang.srt.server_args.prepare_server_args(argv)`` through
SGLang's plugin ``HookRegistry`` (``sglang/srt/plugins/hook_registry.py``); the launchers call
``load_plugins()`` before ``prepare_server_args``, so the hook sees the raw argv.
``sglang.Engine(...)`` (no argv) is not covered.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from typing import List, Mapping, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

HOOK_TARGET = "sglang.srt.server_args.prepare_server_args"
#: Set to 1 to turn the defaults off (e.g. to measure which flags SGLang needs by itself).
DISABLE_ENV = "SGLANG_MAMBA_EXT_NO_CPU_DEFAULTS"
CONV_DTYPE_ENV = "SGLANG_MAMBA_CONV_DTYPE"
ENABLE_FLAG = "--enable-mamba-radix"
#: ``config.json`` ``model_type`` of the project's tiny hybrid model.
TINY_MODEL_TYPE = "tiny_hybrid"
#: ``config.json`` key marking the project's tiny checkpoints of SGLang's own model classes
#: (``models/hf_tiny.py``); its value is the family (``qwen3_next``, ``nemotron_h``, ...).
TINY_HF_MARKER = "sglang_mamba_ext_tiny"
#: SGLang's own hybrid model classes whose CPU gaps the plugin bridges
#: (:mod:`sglang_mamba_ext.plugin.cpu_bridges`), by ``architectures`` entry.
SGLANG_HYBRID_ARCHITECTURES = (
    "Qwen3NextForCausalLM", "KimiLinearForCausalLM", "NemotronHForCausalLM",
    "FalconH1ForCausalLM", "GraniteMoeHybridForCausalLM", "Lfm2ForCausalLM",
    "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Lfm2MoeForCausalLM",
    "Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration", "Lfm2VlForConditionalGeneration",
    "Mamba2ForCausalLM", "NemotronHPuzzleForCausalLM",
    "InternS2PreviewForConditionalGeneration", "GigaChat35ForCausalLM", "BailingMoeV3ForCausalLM",
    "InternS2MobiusForConditionalGeneration", "BailingMoeV3VLForConditionalGeneration",
    "BailingMoeV2_5ForCausalLM", "MiniCPMSALAForCausalLM", "MiniCPMForCausalLM",
    "FalconMambaForCausalLM", "MambaForCausalLM",
    "KimiK3LinearForCausalLM", "MiniCPMV4_6ForConditionalGeneration", "MiniCPMV4_7ForConditionalGeneration",
    "NemotronH_Nano_VL_V2", "NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Omni_Reasoning_V3",
    "KimiK3ForConditionalGeneration",  # Kimi-K3's VLM, text-only (hf_tiny_kimi_k3_vl.py)
    "JetNemotronForCausalLM",
    "JetVLMForConditionalGeneration",  # Jet-Nemotron's VLM, text-only (hf_tiny_jet_vlm.py)
    "Qwen4ExpForConditionalGeneration",
    "ZayaForCausalLM",
    "InklingForConditionalGeneration",
    "Glm5NextForConditionalGeneration",  # GLM-5-Next, text-only (cpu_bridges_glm5_next.py)
)
#: SGLang's Inkling class (``plugin/cpu_bridges_inkling.py``): attention backend ``triton`` and
#: the ``extra_buffer`` strategy instead of ``torch_native`` / ``no_buffer``.
INKLING_ARCHITECTURES = ("InklingForConditionalGeneration",)

#: SGLang's Jet-Nemotron classes (the text model and its VLM, whose ``llm`` is that class,
#: ``models/jet_vlm.py:78``): the JetBlock writes the conv window with an index put of the
#: model's activations, no cast (``models/jet_nemotron.py:307-309``: "Index put requires the source
#: and destination dtypes match" under ``--dtype float32`` with a float16 window), so on CPU the
#: window takes a ``--dtype`` given on the command line.
JET_ARCHITECTURES = ("JetNemotronForCausalLM", "JetVLMForConditionalGeneration")

#: Classes whose MoE runner SGLang sets to ``triton_kernel`` unasked, a layout its CPU MoE path
#: cannot run: on CPU the defaults name ``--moe-runner-backend triton`` (unless given).
CPU_MOE_RUNNER_TRITON = ("InternS2MobiusForConditionalGeneration",)

#: KV tokens: a few thousand-token conversations at once.
DEFAULT_MAX_TOTAL_TOKENS = 16384
#: SSM slots. Under ``--enable-mamba-radix`` with ping-pong tracking one running request
#: holds 3 (its working state and two checkpoints, see ``args_combos._check_mamba_cache_size``)
#: and SGLang keeps one more per request; 128 leaves about 100 slots for cached states at
#: 8 running requests.
DEFAULT_MAX_MAMBA_CACHE_SIZE = 128

#: ``--chunked-prefill-size`` for SGLang's own hybrid classes on CPU under the interpreter.
SGLANG_HYBRID_CHUNKED_PREFILL = 64

_installed = False


def _flag_value(argv: Sequence[str], flag: str) -> Optional[str]:
    """Value of ``flag`` in argv (``--flag v`` or ``--flag=v``); ``""`` for a bare flag;
    None when absent."""
    for i, arg in enumerate(argv):
        if arg == flag:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            return "" if nxt.startswith("--") else nxt
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def local_model_config(model_path: Optional[str]) -> dict:
    """``config.json`` of a local model directory; ``{}`` when there is none or it is not
    JSON (a hub name, a missing file)."""
    if not model_path:
        return {}
    try:
        with open(os.path.join(model_path, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def is_tiny_model(argv: Sequence[str]) -> bool:
    """Whether ``--model-path`` in argv is the project's tiny hybrid model."""
    return local_model_config(_flag_value(argv, "--model-path")).get("model_type") == TINY_MODEL_TYPE


def tiny_hf_arch(argv: Sequence[str]) -> Optional[str]:
    """The family of the project's tiny checkpoint of one of SGLang's own model classes at
    ``--model-path`` (``config.json`` key :data:`TINY_HF_MARKER`), or None for any other model."""
    arch = local_model_config(_flag_value(argv, "--model-path")).get(TINY_HF_MARKER)
    return arch if isinstance(arch, str) and arch else None


def sglang_hybrid_model(argv: Sequence[str]) -> bool:
    """Whether ``--model-path`` names a local checkpoint of one of SGLang's own hybrid classes
    (:data:`SGLANG_HYBRID_ARCHITECTURES`): the project's tiny ones or any other."""
    archs = local_model_config(_flag_value(argv, "--model-path")).get("architectures") or []
    return any(a in SGLANG_HYBRID_ARCHITECTURES for a in archs)


def sglang_kernels_without_cuda(argv: Sequence[str]) -> bool:
    """Whether argv serves the tiny model with SGLang's own linear-attention backends
    (``TinyHybridGDNForCausalLM`` / ``TinyHybridKDAForCausalLM``), or one of SGLang's own
    hybrid classes (:func:`sglang_hybrid_model`: the project's tiny checkpoints, or any under
    ``--enable-mamba-radix``), on ``--device cpu`` on a host without CUDA: their Triton kernels
    then run under Triton's interpreter."""
    import torch

    from sglang_mamba_ext.plugin.tiny_hybrid import SGLANG_KERNEL_ARCHITECTURES

    archs = local_model_config(_flag_value(argv, "--model-path")).get("architectures") or []
    ours = is_tiny_model(argv) and any(a in SGLANG_KERNEL_ARCHITECTURES for a in archs)
    return _active(argv) and (ours or sglang_hybrid_model(argv)) and not torch.cuda.is_available()


def _checkpoint_dtype(model_path: Optional[str]) -> Optional[str]:
    cfg = local_model_config(model_path)
    return cfg.get("dtype") or cfg.get("torch_dtype")


#: A thread's stand-in for ``os.environ`` while it judges another process's launch
#: (:func:`judged_in`); unset: ``os.environ``.
_judged = threading.local()


@contextlib.contextmanager
def judged_in(environ: Mapping[str, str]):
    """Within the block, this thread's checks of a launch (:func:`_active`) read ``environ``
    instead of ``os.environ``, which is left untouched (swapping ``os.environ`` races with
    other threads starting processes: ``fork_exec`` fails with EFAULT)."""
    previous = getattr(_judged, "environ", None)
    _judged.environ = environ
    try:
        yield
    finally:
        _judged.environ = previous


def _environ() -> Mapping[str, str]:
    judged = getattr(_judged, "environ", None)
    return os.environ if judged is None else judged


def _active(argv: Sequence[str]) -> bool:
    return (
        _flag_value(argv, "--device") == "cpu"
        and _flag_value(argv, "--config") is None
        and _environ().get(DISABLE_ENV, "0") in ("", "0")
        and (_flag_value(argv, ENABLE_FLAG) is not None or is_tiny_model(argv) or tiny_hf_arch(argv) is not None)
    )


def cpu_default_args(argv: Sequence[str]) -> Tuple[List[str], List[str]]:
    """Append CPU-safe defaults to a ``launch_server`` argv.

    Only acts when ``--device cpu`` is given, the model is the tiny hybrid model or
    ``--enable-mamba-radix`` is given, no ``--config`` file is used and
    ``SGLANG_MAMBA_EXT_NO_CPU_DEFAULTS`` is not set to 1; never touches
    a flag the user passed (nor its related flags, e.g. ``--mem-fraction-static`` keeps the
    pool sizes SGLang's).

    Returns:
        ``(new_argv, added)``: ``added`` lists the flags appended (for the log).
    """
    argv = list(argv)
    if not _active(argv):
        return argv, []
    added: List[str] = []

    def absent(*flags: str) -> bool:
        return all(_flag_value(argv, f) is None for f in flags)

    def add(*items: str) -> None:
        argv.extend(items)
        added.append(" ".join(items))

    archs = local_model_config(_flag_value(argv, "--model-path")).get("architectures") or []
    inkling = any(a in INKLING_ARCHITECTURES for a in archs)
    if absent("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend"):
        # Inkling's attention asserts the fa4 or triton backend (models/inkling_common/attn.py:744:
        # relative-position score_mod); SGLang's Triton kernels run interpreted on CPU
        add("--attention-backend", "triton" if inkling else "torch_native")
    if absent("--dtype") and _checkpoint_dtype(_flag_value(argv, "--model-path")) == "float32":
        add("--dtype", "float32")
    if absent("--max-total-tokens", "--mem-fraction-static"):
        add("--max-total-tokens", str(DEFAULT_MAX_TOTAL_TOKENS))
    if absent("--max-mamba-cache-size", "--mem-fraction-static", "--mamba-full-memory-ratio"):
        add("--max-mamba-cache-size", str(DEFAULT_MAX_MAMBA_CACHE_SIZE))
    if sglang_kernels_without_cuda(argv) and sglang_hybrid_model(argv) and absent("--mamba-radix-cache-strategy"):
        # SGLang refuses its extra_buffer tracking on CPU for its own classes
        # (arg_groups/mamba_hook.py::validate_mamba_extra_buffer); no_buffer caches without it.
        # Inkling: its model asserts extra_buffer (models/inkling.py:977); its sconv backend writes
        # SGLang's track windows itself, in Triton kernels the interpreter runs (plugin/args.py)
        add("--mamba-radix-cache-strategy", "extra_buffer" if inkling else "no_buffer")
        if inkling and absent("--disable-prefill-cuda-graph", "--cuda-graph-backend-prefill"):
            # SGLang opts Inkling into full-graph prefill capture on every platform
            # (arg_groups/cuda_graph_hook.py:349-372); its capture asks CUDA for a stream on CPU
            add("--disable-prefill-cuda-graph")
        if absent("--chunked-prefill-size"):
            # a prefill chunk as long as the models' SSD chunk: the cache keeps a state at each
            # chunk's end (a resent prompt hits at the last multiple of 64 instead of nothing)
            add("--chunked-prefill-size", str(SGLANG_HYBRID_CHUNKED_PREFILL))
        if _flag_value(argv, ENABLE_FLAG) is None and absent("--disable-overlap-schedule"):
            # SGLang's no_buffer path needs the non-overlap scheduler (the plugin's flag
            # turns it off by itself, plugin/args.py)
            add("--disable-overlap-schedule")
        archs = local_model_config(_flag_value(argv, "--model-path")).get("architectures") or []
        if any(a in CPU_MOE_RUNNER_TRITON for a in archs) and absent("--moe-runner-backend"):
            # SGLang turns "auto" into triton_kernel for this class on every platform
            # (arg_groups/model_overrides/interns2_mobius.py:16); that layout stores the experts
            # transposed (layers/quantization/unquant.py:803-804, 830-831), which SGLang's CPU
            # MoE path multiplies untransposed (layers/moe/fused_moe_native.py:121, 143)
            add("--moe-runner-backend", "triton")
    if speculating_without_cuda(argv) and absent("--disable-overlap-schedule"):
        # FROZEN_KV_MTP on CPU is run (and tested) by SGLang's non-overlap scheduler only.
        add("--disable-overlap-schedule")
    algo = (_flag_value(argv, "--speculative-algorithm") or "").upper()
    if speculating_without_cuda(argv) and algo in ("NEXTN", "EAGLE") and absent("--speculative-draft-attention-backend"):
        # EAGLE's draft backends (speculative/draft_utils.py DraftBackendFactory) have no
        # torch_native entry; SGLang's Triton attention runs under the interpreter (issue 41)
        add("--speculative-draft-attention-backend", "triton")
    return argv, added


def speculating_without_cuda(argv: Sequence[str]) -> bool:
    """Whether argv asks for speculative decoding (``--speculative-algorithm``) on
    ``--device cpu`` on a host without CUDA, under the plugin's model or flag."""
    import torch

    return (
        _active(argv)
        and _flag_value(argv, "--speculative-algorithm") not in (None, "")
        and not torch.cuda.is_available()
    )


def cpu_spec_env() -> List[Tuple[str, str]]:
    """Environment of the CPU speculative path (set only when not already set): SGLang's
    Triton tree build / greedy verify and its start-up KV-copy warm-up run under Triton's
    interpreter (``TRITON_INTERPRET=1``; no Triton driver on CPU), ``torch.compile`` of
    ``speculative/spec_utils.py`` is off (``TORCHDYNAMO_DISABLE=1``), and the plugin's
    routing hooks are on (:data:`sglang_mamba_ext.plugin.speculative.cpu_routing.CPU_SPEC_ENV`)."""
    from sglang_mamba_ext.plugin.speculative.cpu_routing import CPU_SPEC_ENV

    return [("TRITON_INTERPRET", "1"), ("TORCHDYNAMO_DISABLE", "1"), (CPU_SPEC_ENV, "1")]


def _int_flag(argv: Sequence[str], *flags: str) -> int:
    for f in flags:
        v = _flag_value(argv, f)
        if v:
            try:
                return max(1, int(v))
            except ValueError:
                return 1  # SGLang's own parser reports it
    return 1


def num_ranks(argv: Sequence[str]) -> int:
    """Scheduler processes on this node: ``tp * pp``, times ``dp`` without DP attention
    (DP attention splits the ``tp`` ranks)."""
    tp = _int_flag(argv, "--tp", "--tp-size", "--tensor-parallel-size")
    dp = _int_flag(argv, "--dp", "--dp-size", "--data-parallel-size")
    pp = _int_flag(argv, "--pp", "--pp-size", "--pipeline-parallel-size")
    dp_attention = _flag_value(argv, "--enable-dp-attention") is not None
    return tp * pp * (1 if dp_attention else dp)


def multi_rank_env(argv: Sequence[str]) -> List[Tuple[str, str]]:
    """Environment for several ranks on one CPU host (set only when not already set):
    ``SGLANG_CPU_OMP_THREADS_BIND`` gives each rank its share of the cores (SGLang otherwise
    asserts one NUMA node per rank, ``utils/numa_utils.py``; ranks beyond the cores share
    them), and ``SGLANG_NCCL_SO_PATH`` names a library that does not exist so that PyNccl
    disables itself (the CUDA build of torch ships a loadable NCCL, which SGLang then tries to
    use and fails with "Expected a cuda device"), and turns on the CPU multi-rank hook
    (:mod:`sglang_mamba_ext.plugin.multi_rank`). Empty for one rank."""
    n = num_ranks(argv)
    if n <= 1:
        return []
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    if len(cores) >= n:
        per = len(cores) // n
        groups = [cores[i * per:(i + 1) * per] for i in range(n)]
    else:
        groups = [[cores[i % len(cores)]] for i in range(n)]
    bind = "|".join(f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups)
    from sglang_mamba_ext.plugin.multi_rank import ACTIVE_ENV

    return [("SGLANG_CPU_OMP_THREADS_BIND", bind), ("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl-disabled.so"),
            (ACTIVE_ENV, "1")]


def _before_prepare_server_args(argv, *args, **kwargs):
    from sglang_mamba_ext.plugin.early_checks import early_model_checks

    early_model_checks(argv or [])
    new_argv, added = cpu_default_args(argv)
    if _active(new_argv) and CONV_DTYPE_ENV not in os.environ:
        # inherited by the scheduler processes. SGLang's own GDN/KDA backends write the conv
        # window from the model's activations in place, so there it must be the model's dtype.
        conv = "float16" if sglang_kernels_without_cuda(new_argv) else "float32"
        if sglang_kernels_without_cuda(new_argv) and sglang_hybrid_model(new_argv):
            # SGLang's own classes: the checkpoint's half dtype (what the kernels write)
            ckpt = _checkpoint_dtype(_flag_value(new_argv, "--model-path"))
            conv = ckpt if ckpt in ("float16", "bfloat16") else conv
            archs = local_model_config(_flag_value(new_argv, "--model-path")).get("architectures") or []
            served = _flag_value(new_argv, "--dtype")
            if any(a in JET_ARCHITECTURES for a in archs) and served in ("float16", "bfloat16", "float32"):
                conv = served  # the JetBlock stores its window uncast (models/jet_nemotron.py:307-309)
        os.environ[CONV_DTYPE_ENV] = conv
        added.append(f"{CONV_DTYPE_ENV}={conv}")
    if _active(new_argv):
        for name, value in multi_rank_env(new_argv):
            if name not in os.environ:
                os.environ[name] = value
                added.append(f"{name}={value}")
    if sglang_kernels_without_cuda(new_argv) and "TRITON_INTERPRET" not in os.environ:
        # SGLang's GDN / KDA / Mamba2 Triton kernels, interpreted (plugin/triton_interpret.py)
        os.environ["TRITON_INTERPRET"] = "1"
        added.append("TRITON_INTERPRET=1")
    if sglang_kernels_without_cuda(new_argv) and sglang_hybrid_model(new_argv):
        from sglang_mamba_ext.plugin.cpu_bridges import ACTIVE_ENV

        if ACTIVE_ENV not in os.environ:
            # inherited by the scheduler processes: turns on plugin/cpu_bridges.py there
            os.environ[ACTIVE_ENV] = "1"
            added.append(f"{ACTIVE_ENV}=1")
    if speculating_without_cuda(new_argv):
        for name, value in cpu_spec_env():
            if name not in os.environ:
                os.environ[name] = value
                added.append(f"{name}={value}")
    if added:
        # warning: SGLang configures logging only inside prepare_server_args
        logger.warning("sglang-mamba-ext: CPU defaults added: %s", ", ".join(added))
    return (new_argv, *args), kwargs


def install_cpu_defaults() -> None:
    """Register the ``prepare_server_args`` hook (idempotent; applied by SGLang's
    ``load_plugins`` right after the plugins run)."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGET, _before_prepare_server_args, HookType.BEFORE)
    _installed = True
