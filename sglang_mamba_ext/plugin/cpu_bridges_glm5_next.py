"""CPU bridges for SGLang 0.5.23's GLM-5-Next class (``Glm5NextForConditionalGeneration``,
``srt/models/glm5_next.py``; issue 40), beside :mod:`.cpu_bridges` (whose :func:`.cpu_bridges.active`
gates every hook here: inert unless the CPU defaults turned the bridges on and CUDA is absent).

- **DSA as dense MLA within ``index_topk``** (AROUND ``configs.model_config.is_deepseek_dsa``):
  GLM-5-Next's full-attention layers are DeepSeek sparse attention (MLA whose keys an indexer
  narrows to the ``index_topk`` best earlier tokens). SGLang treats every config of the class
  with an ``index_topk`` as DSA (``configs/model_config.py:191-212``), and DSA has no CPU path:
  the server's argument resolution asks CUDA for the device generation
  (``arg_groups/overrides.py:512``, ``_dsa_kv_cache_dtype_default``; ``:631``,
  ``_dsa_split_backend_resolution``: ``RuntimeError: Found no NVIDIA driver``), and past it the
  ``dsa`` attention backend (``layers/attention/attention_registry.py:150``,
  ``DeepseekSparseAttnBackend``) and its indexer run FlashMLA / TileLang / DeepGEMM FP8 kernels
  only. While no sequence is longer than ``index_topk`` the indexer's top-k of a query's earlier
  tokens is all of them, and DSA computes exactly dense MLA. So on CPU, for a GLM-5-Next config
  whose ``max_position_embeddings`` (the longest sequence SGLang admits without an override) is
  at most its ``index_topk``, the predicate answers False: SGLang then builds the layers as plain
  MLA (``models/deepseek_v2.py:2052-2143``: no indexer; the checkpoint's ``indexer.*`` tensors are
  skipped by the class's loader) on its CPU MLA path, the KV pool without the index-key buffer.
  A config with longer positions keeps SGLang's answer (and its CUDA-only path): dense attention
  there would not be DSA. Other classes are SGLang's alone.
- **clamped SwiGLU, dense** (AROUND ``kernels/ops/activation/silu_and_mul_clamp.py::silu_and_mul_clamp``):
  GLM-5-Next's ``swiglu_limit`` (10 in the released config) sends every dense MLP
  (``models/deepseek_v2.py:476-490``, ``DeepseekV2MLP.forward``, the shared experts included) to
  a JIT CUDA kernel off ROCm / NPU, which on CPU fails to build (``nvcc fatal: Unsupported gpu
  architecture 'compute_00'``). For CPU tensors the same function in torch
  (:func:`clamped_silu_mul`): the kernel's clamp in bfloat16 (``gate <= limit``,
  ``-limit <= up <= limit``; ``jit/csrc/deepseek_v4/silu_and_mul_masked_post_quant.cuh:40-62``),
  ``silu(gate) * up`` in float32, written into the caller's output in its dtype.
- **clamped SwiGLU, routed experts** (through :func:`.cpu_bridges_moe.moe_native_around`): SGLang's
  CPU MoE path (``layers/moe/fused_moe_native.py::moe_forward_native``, from
  ``quantization/unquant.py:1385``) ignores ``moe_runner_config.swiglu_limit`` (its GPU runners
  clamp: ``moe_runner/triton.py:173``, ``moe_runner/deep_gemm.py:1694``, gate ``<= limit``, up
  within ``+-limit`` in the activations' dtype). For gated ``silu`` experts with a limit and no
  biases, :func:`clamped_swiglu_experts` runs them with the clamp.
- **hyper-connections** (AROUND ``kernels/ops/layernorm/mhc.py::_use_tilelang_mhc_pre`` and
  ``::_use_tilelang_mhc_post``): GLM-5-Next's mHC residual streams (``mhc``: each layer's
  ``hc_pre`` / ``hc_post``, ``models/glm5_next.py:855-940``) dispatch to TileLang kernels unless
  ``SGLANG_OPT_USE_TILELANG_MHC_PRE`` / ``_POST`` are off (both on by default,
  ``srt/environ.py:1820-1821``; ``mhc.py:227-232``, ``:1986``, ``:2035``); on CPU the first one
  stops at ``assert residual.dtype == torch.bfloat16`` (``mhc.py:1078``) and would need CUDA past
  it. On an active process both answer False, so SGLang's own torch paths run
  (``_mhc_pre_torch``, ``mhc.py:1900``; ``_mhc_post_torch``, ``:1941``: the same RMS-normed
  projection, sigmoid pre / post mixes, Sinkhorn-normalised comb), as with those variables off.
  The layers' cross-layer fusion of the FFN's post and pre mixes reads the same variables itself
  (``is_cross_layer_mhc_fusion_enabled``, ``models/deepseek_common/amd/deepseek_v4_fused_mhc.py:70-101``,
  asked at layer construction, ``models/glm5_next.py:803-806``; its fused TileLang kernel stops at
  ``mhc.py:1643``): AROUND it, False on an active process, so each layer runs its post, then its pre.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

IS_DEEPSEEK_DSA = "sglang.srt.configs.model_config.is_deepseek_dsa"
SILU_AND_MUL_CLAMP = "sglang.kernels.ops.activation.silu_and_mul_clamp.silu_and_mul_clamp"
TILELANG_MHC_PRE = "sglang.kernels.ops.layernorm.mhc._use_tilelang_mhc_pre"
TILELANG_MHC_POST = "sglang.kernels.ops.layernorm.mhc._use_tilelang_mhc_post"
MHC_CROSS_LAYER_FUSION = ("sglang.srt.models.deepseek_common.amd.deepseek_v4_fused_mhc."
                          "is_cross_layer_mhc_fusion_enabled")
#: the classes this bridge serves (``configs/model_config.py:202-203``)
GLM5_NEXT_ARCHS = ("Glm5NextForConditionalGeneration", "Glm5NextForConditionalGenerationNextN")

_logged = set()


def _field(config, name):
    if isinstance(config, dict):
        return config.get(name)
    return getattr(config, name, None)


def dense_within_topk(config) -> bool:
    """Whether ``config`` (a dict or a config object) is a GLM-5-Next config whose every admitted
    sequence fits its ``index_topk`` (``max_position_embeddings <= index_topk``): its DSA layers
    then compute dense MLA. Not with k-pools (``index_kpool`` > 1) whose incomplete tail is not
    always selected. Reads the text config when the object has one."""
    archs = _field(config, "architectures") or ()
    if not archs or archs[0] not in GLM5_NEXT_ARCHS:
        return False
    text = _field(config, "text_config")
    topk = _field(config, "index_topk")
    positions = _field(config, "max_position_embeddings")
    if text is not None:
        topk = _field(text, "index_topk") if _field(text, "index_topk") is not None else topk
        if _field(text, "max_position_embeddings") is not None:
            positions = _field(text, "max_position_embeddings")
    if topk is None or positions is None:
        return False
    # k-pools (transformers' indexer, SGLang's dsa_indexer_kpool.py): only complete pools are
    # scored, so a query's own incomplete pool is attended only through the always-selected tail
    # (transformers' default; SGLang's k-pool indexer asserts it)
    src = text if text is not None and _field(text, "index_kpool") is not None else config
    kpool, tail = _field(src, "index_kpool"), _field(src, "index_kpool_always_select_tail")
    if kpool is not None and int(kpool) > 1 and tail is not None and not tail:
        return False
    return int(positions) <= int(topk)


def is_deepseek_dsa_around(original, config, *args, **kwargs):
    """AROUND ``is_deepseek_dsa(config)``: False on CPU (:func:`.cpu_bridges.active`) for a
    GLM-5-Next config :func:`dense_within_topk` accepts (module docstring); otherwise SGLang's
    answer."""
    answer = original(config, *args, **kwargs)
    if not answer:
        return answer
    from sglang_mamba_ext.plugin.cpu_bridges import active

    if not (active() and dense_within_topk(config)):
        return answer
    arch = (_field(config, "architectures") or ("?",))[0]
    if arch not in _logged:
        _logged.add(arch)
        logger.info("mamba-radix: %s on CPU: DSA layers served as dense MLA (every sequence fits "
                    "index_topk; configs/model_config.py:191-212, arg_groups/overrides.py:512)", arch)
    return False


def clamped_silu_mul(gate_up, limit: float, clamp_dtype=None):
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in float32 for ``gate_up`` =
    ``[..., 2 * n]`` (gate first); the clamp in ``clamp_dtype`` (the inputs' when None)."""
    import torch.nn.functional as F

    n = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :n], gate_up[..., n:]
    if clamp_dtype is not None:
        gate, up = gate.to(clamp_dtype), up.to(clamp_dtype)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return F.silu(gate.float()) * up.float()


def silu_and_mul_clamp_around(original, input, output, swiglu_limit, *args, **kwargs):
    """AROUND ``silu_and_mul_clamp(input [M, 2N], output [M, N], swiglu_limit)``: for a CPU
    tensor on an active process, :func:`clamped_silu_mul` with the kernel's bfloat16 clamp,
    written into ``output`` (module docstring); otherwise SGLang's kernel."""
    from sglang_mamba_ext.plugin.cpu_bridges import active

    if not (active() and input.device.type == "cpu") or args or kwargs:
        return original(input, output, swiglu_limit, *args, **kwargs)
    import torch

    output.copy_(clamped_silu_mul(input, float(swiglu_limit), clamp_dtype=torch.bfloat16).to(output.dtype))
    return None


def clamped_swiglu_experts(x, w13, w2, topk_weights, topk_ids, limit: float):
    """Gated SiLU experts with the clamp (module docstring): :func:`.cpu_bridges_moe.routed_experts`
    with :func:`clamped_silu_mul` (its product cast back to ``x``'s dtype, as SGLang's activation
    returns it). ``w13``: ``[E, 2I, H]`` (gate rows first), ``w2``: ``[E, H, I]``."""
    from sglang_mamba_ext.plugin.cpu_bridges_moe import routed_experts

    return routed_experts(x, w13, w2, topk_weights, topk_ids, lambda gu: clamped_silu_mul(gu, limit).to(x.dtype))


def clamped_experts_apply(layer, x, topk_output, moe_runner_config):
    """For :func:`.cpu_bridges_moe.moe_native_around` (active, CPU tensor): the clamped experts'
    output when ``moe_runner_config`` asks a ``swiglu_limit`` of gated ``silu`` experts without
    biases or an ``alpha`` (GPT-OSS's variant, which SGLang's CPU path handles itself); else None."""
    limit = getattr(moe_runner_config, "swiglu_limit", None)
    if (limit is None or moe_runner_config.activation != "silu" or not moe_runner_config.is_gated
            or moe_runner_config.apply_router_weight_on_input or moe_runner_config.gemm1_alpha is not None
            or getattr(layer, "w13_weight_bias", None) is not None
            or getattr(layer, "w2_weight_bias", None) is not None):
        return None
    topk_weights, topk_ids, _ = topk_output
    return clamped_swiglu_experts(x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, float(limit))


def no_tilelang_on_cpu_around(original, *args, **kwargs):
    """AROUND ``_use_tilelang_mhc_pre()`` / ``_use_tilelang_mhc_post()`` /
    ``is_cross_layer_mhc_fusion_enabled()``: False on an active
    process (no CUDA: TileLang cannot run), so SGLang takes its torch paths (module docstring);
    otherwise SGLang's answer."""
    from sglang_mamba_ext.plugin.cpu_bridges import active

    if active():
        return False
    return original(*args, **kwargs)


def register_glm5_next_bridges(registry, hook_type) -> None:
    """Register this module's hooks on SGLang's ``HookRegistry`` (called from
    :func:`.cpu_bridges.register_cpu_bridges`)."""
    registry.register(IS_DEEPSEEK_DSA, is_deepseek_dsa_around, hook_type.AROUND)
    registry.register(SILU_AND_MUL_CLAMP, silu_and_mul_clamp_around, hook_type.AROUND)
    registry.register(TILELANG_MHC_PRE, no_tilelang_on_cpu_around, hook_type.AROUND)
    registry.register(TILELANG_MHC_POST, no_tilelang_on_cpu_around, hook_type.AROUND)
    registry.register(MHC_CROSS_LAYER_FUSION, no_tilelang_on_cpu_around, hook_type.AROUND)
