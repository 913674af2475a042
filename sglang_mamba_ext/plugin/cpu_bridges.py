"""CPU bridges: what SGLang 0.5.23's own hybrid model classes (Qwen3-Next, Kimi-Linear,
Nemotron-H, Falcon-H1, GraniteMoeHybrid, LFM2) lack to run on a host without CUDA, with
their Triton kernels under Triton's interpreter (``TRITON_INTERPRET=1``).

Every hook is inert unless :data:`ACTIVE_ENV` is ``1`` in the process and CUDA is absent.
The CPU defaults (:mod:`.cpu_defaults`) set that variable in the launcher, inherited by the
scheduler processes, only on ``--device cpu`` for a local checkpoint of one of those classes
that is the project's tiny checkpoint (``config.json`` key ``sglang_mamba_ext_tiny``) or is
served with ``--enable-mamba-radix``; any other launch never sees it, and each hook then calls
SGLang's function unchanged. What each bridge works around (paths under ``sglang/``; the list
with line numbers is in ``docs/sglang-hooks.md``):

- **shims** (BEFORE ``srt.model_executor.model_runner.ModelRunner.__init__``): the Triton
  interpreter shims of :mod:`.triton_interpret` (until now installed only by the project's own
  model class), with the Mamba2 and causal-conv kernel modules imported first so their
  aliases are fixed too; then the causal-conv binding below.
- **causal conv** (same hook): ``srt/layers/attention/mamba/mamba.py`` binds
  ``causal_conv1d_fn`` / ``causal_conv1d_update`` (and their ``_triton`` names) only on
  CUDA / NPU / XPU, so a Mamba2 layer raises ``NameError`` on CPU; the missing names are bound
  to SGLang's Triton versions (``kernels/ops/mamba/causal_conv1d_triton.py``), as its XPU
  branch does.
- **device module** (AROUND ``MambaMixer2.forward``, ``Qwen3GatedDeltaNet.__init__`` and
  ``layernorm_gated._layer_norm_fwd``):
  ``torch.get_device_module(...)`` on a CUDA build of torch without a driver: with no device it
  returns ``torch.cuda`` (``current_device()`` then raises), with a CPU device ``torch.cpu``,
  which has no ``device(index)`` context (the Mamba2 SSD kernels' launch wrappers,
  ``kernels/ops/mamba/triton_ops/ssd_*.py``, ``mamba_ssm.py``). For the duration of the call,
  ``torch.get_device_module`` answers a CPU module with a null ``device`` context for no
  device or a CPU device.
- **rotary** (AROUND ``RotaryEmbedding.__init__``): ``srt/layers/rotary_embedding/base.py``
  imports ``vllm._custom_ops`` on a host that is neither CUDA nor SGLang's CPU engine
  (``SGLANG_USE_CPU_ENGINE=1``, which needs ``sgl_kernel`` CPU ops PyPI's build lacks); the
  module's CPU flag is set for the duration of the constructor, so no fallback kernel is
  bound and the layer runs ``forward_native``.
- **gated RMSNorm rows** (AROUND ``kernels/ops/attention/fla/layernorm_gated._get_sm_count``,
  issue 40): Qwen3.5's Gated DeltaNet norm (``srt/models/qwen3_5.py``, the ``RMSNorm`` of
  ``layernorm_gated``) sizes its row blocks by the GPU's SM count,
  ``torch.cuda.get_device_properties``, which fails without a driver; for a CPU tensor the
  CPU's core count stands in (a block-size heuristic only); its launch
  (``_layer_norm_fwd``) enters ``device_context``, which gets the device module bridge below.
- **torch kernels** (AROUND SGLang's linear-layer kernels, issue 40 item 5; the list is
  :data:`KERNEL_BRIDGES`): for CPU tensors, the plain-torch versions run instead of SGLang's
  Triton kernels under the interpreter (a tiny Qwen3-Next prefilled about 8 tokens/s there):
  :mod:`.cpu_kernels` for ``fla/chunk.py::chunk_gated_delta_rule`` (GDN) and ``fla/kda.py::
  chunk_kda`` (KDA), :mod:`.cpu_kernels_decode` for the GDN / KDA packed decode
  (``fla/fused_recurrent.py``);
  :mod:`.cpu_kernels_ssd` for ``mamba/triton_ops/ssd_combined.py::mamba_chunk_scan_combined``
  (Mamba2), its decode ``mamba/triton_ops/mamba_ssm.py::selective_state_update`` (one token per
  row) and ``mamba/causal_conv1d_triton.py::causal_conv1d_fn`` / ``causal_conv1d_update``
  (plain decode only); :mod:`.cpu_kernels_elementwise` for the small kernels that dominated
  once the scans were fast (Qwen3-Next's qkvz split, the GDN gating, Qwen2-MoE's shared-expert
  gate); :mod:`.cpu_kernels_verify` for the speculative path: the GDN / KDA target verify
  (``linear/fused_sigmoid_gating_recurrent.py``) and the Triton attention backend's decode
  (``decode_attention.py``, EAGLE's draft decode); :mod:`.cpu_kernels_lightning` for the
  lightning attention's ``linear/seg_la.py::seg_la_fwd`` (Ling 2.5, prefill and decode). A CUDA tensor, an inactive process, or ``SGLANG_MAMBA_EXT_CPU_KERNELS=triton`` calls
  SGLang's kernel unchanged. Registered before the plugin's own BEFORE hooks on the same
  functions (``plugin/inchunk_conv_ssd.py``), so those still see every call.
- **no attention heads** (AROUND ``srt/configs/update_config.py::
  adjust_config_with_unaligned_cpu_tp``, issue 40): on CPU every model load pads attention
  heads for the TP size, starting with ``num_attention_heads % tp_size``, a ``TypeError`` for a
  model without attention (``Mamba2ForCausalLM``); at one rank with no heads the config is
  returned as it is.
- **mm with out_dtype** (AROUND ``srt/models/nemotron_h.py::NemotronHMoE.forward``, issue 40):
  Nemotron-H's MoE router computes ``torch.mm(x, gate.t(), out_dtype=torch.float32)``, an
  overload torch has only for CUDA (``NotImplementedError: aten::mm.dtype`` on CPU); for the
  call, such a product of CPU tensors is the float32 product of the operands cast to float32.
- **flat queries in DeepSeek's rotary** (AROUND ``srt/layers/rotary_embedding/rope_variant.py::
  DeepseekScalingRotaryEmbedding.forward_native``, issue 40): on CPU every rotary embedding is
  DeepSeek's YaRN (``factory.py:478-481``), whose native forward (``rope_variant.py:471-503``)
  broadcasts wrongly for a flat ``[T, heads * head]`` query (Ling 2.5's lightning and GQA layers,
  ``models/bailing_moe_linear.py:591``, ``:717``); those run per head (:func:`deepseek_rope_flat_around`).
- **Ling 2.5's MLA rotary** (AROUND ``models/bailing_moe_linear.py::DsV3MLA.__init__``, issue
  40): with rope scaling it pins its rotary to ``forward_cuda`` (``bailing_moe_linear.py:107-111``),
  a CUDA kernel on CPU (``rotary_embedding/base.py:468``); the pin is dropped on CPU.
- **ReLU² experts** (AROUND ``srt/layers/moe/fused_moe_native.py::moe_forward_native``, issue
  40): SGLang's CPU MoE path knows gated ``silu`` / ``gelu`` / ``situ`` experts only
  (``fused_moe_native.py:97``); Nemotron-H's non-gated ReLU² experts run
  :func:`.cpu_bridges_moe.relu2_experts` (:mod:`.cpu_bridges_moe`).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import threading

logger = logging.getLogger(__name__)

#: Set to 1 (by the CPU defaults) to turn the bridges on in this process and its children.
ACTIVE_ENV = "SGLANG_MAMBA_EXT_CPU_BRIDGES"

MODEL_RUNNER_INIT = "sglang.srt.model_executor.model_runner.ModelRunner.__init__"
MAMBA_MIXER_FORWARD = "sglang.srt.layers.attention.mamba.mamba.MambaMixer2.forward"
QWEN3_NEXT_GDN_INIT = "sglang.srt.models.qwen3_next.Qwen3GatedDeltaNet.__init__"
ROPE_INIT = "sglang.srt.layers.rotary_embedding.base.RotaryEmbedding.__init__"
GATED_NORM_SM_COUNT = "sglang.kernels.ops.attention.fla.layernorm_gated._get_sm_count"
GATED_NORM_FWD = "sglang.kernels.ops.attention.fla.layernorm_gated._layer_norm_fwd"
CPU_TP_CONFIG = "sglang.srt.configs.update_config.adjust_config_with_unaligned_cpu_tp"
NEMOTRON_H_MOE_FORWARD = "sglang.srt.models.nemotron_h.NemotronHMoE.forward"
DSV3_MLA_INIT = "sglang.srt.models.bailing_moe_linear.DsV3MLA.__init__"
DEEPSEEK_ROPE_NATIVE = "sglang.srt.layers.rotary_embedding.rope_variant.DeepseekScalingRotaryEmbedding.forward_native"
GET_ROPE_CPU = "sglang.srt.layers.rotary_embedding.factory.get_rope_cpu"

MAMBA_MODULE = "sglang.srt.layers.attention.mamba.mamba"
ROPE_MODULE = "sglang.srt.layers.rotary_embedding.base"
CAUSAL_CONV_TRITON = "sglang.kernels.ops.mamba.causal_conv1d_triton"
#: Kernel modules of Mamba2 layers, imported before the interpreter shims fix their aliases.
MAMBA_KERNEL_MODULES = (
    CAUSAL_CONV_TRITON,
    "sglang.kernels.ops.mamba.triton_ops.ssd_combined",
    "sglang.kernels.ops.mamba.triton_ops.ssd_chunk_state",
    "sglang.kernels.ops.mamba.triton_ops.ssd_chunk_scan",
    "sglang.kernels.ops.mamba.triton_ops.ssd_state_passing",
    "sglang.kernels.ops.mamba.triton_ops.ssd_bmm",
    "sglang.kernels.ops.mamba.triton_ops.mamba_ssm",
)

#: ``torch`` (default) or ``triton``: which linear-layer kernels SGLang's classes run on CPU.
KERNELS_ENV = "SGLANG_MAMBA_EXT_CPU_KERNELS"

#: the GDN / KDA decode and target-verify kernel (``TritonGDNKernel.target_verify``)
VERIFY_KERNEL = ("sglang.kernels.ops.attention.linear.fused_sigmoid_gating_recurrent."
                 "fused_sigmoid_gating_delta_rule_update")
#: SGLang's Triton attention backend's decode (EAGLE's draft decode on CPU)
DECODE_ATTENTION = "sglang.kernels.ops.attention.decode_attention.decode_attention_fwd"

#: SGLang's lightning attention kernel (prefill and decode of ``LightningAttentionBackend``)
SEG_LA_FWD = "sglang.kernels.ops.attention.linear.seg_la.seg_la_fwd"

#: SGLang kernel -> (module of the torch version, its name); AROUND hooks (:func:`kernel_around`).
KERNEL_BRIDGES = {
    "sglang.kernels.ops.attention.fla.chunk.chunk_gated_delta_rule": ("cpu_kernels", "chunk_gated_delta_rule"),
    "sglang.kernels.ops.attention.fla.kda.chunk_kda": ("cpu_kernels", "chunk_kda"),
    "sglang.kernels.ops.attention.fla.fused_recurrent.fused_recurrent_gated_delta_rule_packed_decode":
        ("cpu_kernels_decode", "fused_recurrent_gated_delta_rule_packed_decode"),
    "sglang.kernels.ops.attention.fla.fused_recurrent.fused_recurrent_kda_packed_decode":
        ("cpu_kernels_decode", "fused_recurrent_kda_packed_decode"),
    "sglang.kernels.ops.mamba.triton_ops.ssd_combined.mamba_chunk_scan_combined":
        ("cpu_kernels_ssd", "mamba_chunk_scan_combined"),
    CAUSAL_CONV_TRITON + ".causal_conv1d_fn": ("cpu_kernels_ssd", "causal_conv1d_fn"),
    CAUSAL_CONV_TRITON + ".causal_conv1d_update": ("cpu_kernels_ssd", "causal_conv1d_update"),
    "sglang.kernels.ops.mamba.triton_ops.mamba_ssm.selective_state_update":
        ("cpu_kernels_ssd", "selective_state_update"),
    # the small kernels around the scans (Qwen3-Next / Qwen2-MoE; cpu_kernels_elementwise.py)
    "sglang.kernels.ops.attention.triton_gdn_fused_proj.fused_qkvzba_split_reshape_cat":
        ("cpu_kernels_elementwise", "fused_qkvzba_split_reshape_cat"),
    "sglang.kernels.ops.attention.linear.fused_gdn_gating.fused_gdn_gating":
        ("cpu_kernels_elementwise", "fused_gdn_gating"),
    "sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul_add":
        ("cpu_kernels_elementwise", "fused_gate_sigmoid_mul_add"),
    "sglang.kernels.ops.elementwise.elementwise.fused_gate_sigmoid_mul":
        ("cpu_kernels_elementwise", "fused_gate_sigmoid_mul"),
    # the speculative path (cpu_kernels_verify.py): target verify and the draft's decode attention
    VERIFY_KERNEL: ("cpu_kernels_verify", "fused_sigmoid_gating_delta_rule_update"),
    DECODE_ATTENTION: ("cpu_kernels_verify", "decode_attention_fwd"),
    # lightning attention (Ling 2.5's LightningAttentionBackend, seg_la; cpu_kernels_lightning.py)
    SEG_LA_FWD: ("cpu_kernels_lightning", "seg_la_fwd"),
}
#: KERNEL_BRIDGES target -> (module, name of the predicate saying whether the torch version
#: covers a call); a call it does not cover goes to SGLang's kernel
KERNEL_COVERS = {
    CAUSAL_CONV_TRITON + ".causal_conv1d_update": ("cpu_kernels_ssd", "update_supported"),
    "sglang.kernels.ops.mamba.triton_ops.mamba_ssm.selective_state_update": ("cpu_kernels_ssd", "ssu_supported"),
    VERIFY_KERNEL: ("cpu_kernels_verify", "verify_supported"),
    DECODE_ATTENTION: ("cpu_kernels_verify", "decode_attention_supported"),
    SEG_LA_FWD: ("cpu_kernels_lightning", "seg_la_supported"),
}

_installed = False


def active() -> bool:
    """Whether the bridges act in this process: :data:`ACTIVE_ENV` is ``1`` and no CUDA."""
    if os.environ.get(ACTIVE_ENV) != "1":
        return False
    import torch

    return not torch.cuda.is_available()


def torch_kernels() -> bool:
    """Whether the torch kernels stand in for SGLang's Triton ones here: :func:`active` and
    :data:`KERNELS_ENV` is not ``triton``."""
    return active() and os.environ.get(KERNELS_ENV, "torch").strip().lower() != "triton"


def _first_tensor(args, kwargs):
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value
    return None


def _torch_version(target: str):
    module, name = KERNEL_BRIDGES[target]
    return getattr(importlib.import_module(f"sglang_mamba_ext.plugin.{module}"), name)


def make_kernel_around(target: str):
    """The AROUND hook for ``target`` (a key of :data:`KERNEL_BRIDGES`): its torch version for
    a CPU tensor when :func:`torch_kernels`, SGLang's kernel otherwise."""
    conv_fn = target.endswith("causal_conv1d_fn")
    covers = KERNEL_COVERS.get(target)

    def kernel_around(original, *args, **kwargs):
        first = _first_tensor(args, kwargs)
        if first is None or first.device.type != "cpu" or not torch_kernels():
            return original(*args, **kwargs)
        if conv_fn and kwargs.get("block_table") is not None:
            return original(*args, **kwargs)
        if covers is not None:
            module, name = covers
            check = getattr(importlib.import_module(f"sglang_mamba_ext.plugin.{module}"), name)
            if not check(*args, **kwargs):
                return original(*args, **kwargs)
        return _torch_version(target)(*args, **kwargs)

    kernel_around.__name__ = f"kernel_around[{target.rsplit('.', 1)[1]}]"
    return kernel_around


# ---------------------------------------------------------------- causal conv names (gap 6)

#: name in ``mamba.py`` -> name in ``causal_conv1d_triton.py``
CAUSAL_CONV_NAMES = {
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_fn_triton": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
    "causal_conv1d_update_triton": "causal_conv1d_update",
}


def bind_causal_conv(module=None) -> list:
    """Bind the causal-conv names ``mamba.py`` left unbound to SGLang's Triton kernels;
    returns the names bound (none when every name exists)."""
    module = module or importlib.import_module(MAMBA_MODULE)
    missing = [n for n in CAUSAL_CONV_NAMES if not hasattr(module, n)]
    if missing:
        triton_mod = importlib.import_module(CAUSAL_CONV_TRITON)
        for name in missing:
            setattr(module, name, getattr(triton_mod, CAUSAL_CONV_NAMES[name]))
    return missing


# ---------------------------------------------------------------- device module (gaps 2, 7)

class CpuDeviceModule:
    """``torch.cpu`` with what SGLang's callers expect of a device module: a null
    ``device(index)`` context and ``current_device()``; any other attribute is ``torch.cpu``'s."""

    def __getattr__(self, name):
        import torch

        return getattr(torch.cpu, name)

    @staticmethod
    def device(index=None):
        return contextlib.nullcontext()

    @staticmethod
    def current_device():
        return "cpu"


CPU_DEVICE_MODULE = CpuDeviceModule()
_lock = threading.RLock()
_depth = 0


def _is_cpu_request(device) -> bool:
    if device is None:
        return True
    import torch

    try:
        return torch.device(device).type == "cpu"
    except (TypeError, RuntimeError, ValueError):
        return False


@contextlib.contextmanager
def cpu_device_module():
    """For the duration of the block, ``torch.get_device_module()`` (no device) and
    ``torch.get_device_module(<cpu device>)`` return :data:`CPU_DEVICE_MODULE`; other devices
    get torch's answer. Re-entrant."""
    global _depth
    import torch

    with _lock:
        if _depth == 0:
            original = torch.get_device_module

            @functools.wraps(original)  # keeps __wrapped__ (dynamo reads it)
            def get_device_module(device=None):
                return CPU_DEVICE_MODULE if _is_cpu_request(device) else original(device)

            get_device_module._mamba_ext_original = original
            torch.get_device_module = get_device_module
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                torch.get_device_module = torch.get_device_module._mamba_ext_original


def device_module_around(original, *args, **kwargs):
    """AROUND hook (``MambaMixer2.forward``, ``Qwen3GatedDeltaNet.__init__``, and
    ``layernorm_gated._layer_norm_fwd``: Qwen3.5's gated norm enters SGLang's
    ``device_context``, ``srt/utils/common.py``)."""
    if not active():
        return original(*args, **kwargs)
    with cpu_device_module():
        return original(*args, **kwargs)


# ---------------------------------------------------------------- rotary (gap 3)

def rope_init_around(original, *args, **kwargs):
    """AROUND hook on ``RotaryEmbedding.__init__``: its module's ``_is_cpu`` is True for the
    duration of the constructor (no ``vllm._custom_ops`` import, ``forward_native``)."""
    if not active():
        return original(*args, **kwargs)
    mod = importlib.import_module(ROPE_MODULE)
    with _lock:
        saved = mod._is_cpu
        mod._is_cpu = True
        try:
            return original(*args, **kwargs)
        finally:
            mod._is_cpu = saved


def rope_cpu_around(original, head_size, rotary_dim, max_position, base, is_neox_style=True, rope_scaling=None,
                    dtype=None, partial_rotary_factor=1.0, device=None):
    """AROUND ``layers/rotary_embedding/factory.py::get_rope_cpu`` (what ``get_rope_wrapper``
    calls on CPU, e.g. for DeepSeek's MLA, ``models/deepseek_v2.py:2167``): it builds DeepSeek's
    YaRN only and asserts ``rope_scaling`` is given with type ``deepseek_yarn``
    (``factory.py:478-481``). For no scaling or another type, SGLang's own ``get_rope`` (the
    device-neutral factory every other layer uses) builds the embedding; ``deepseek_yarn`` is
    SGLang's CPU path unchanged."""
    kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type"))
    if active() and kind != "deepseek_yarn":
        factory = importlib.import_module("sglang.srt.layers.rotary_embedding.factory")
        return factory.get_rope(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                                partial_rotary_factor)
    return original(head_size, rotary_dim, max_position, base, is_neox_style, rope_scaling, dtype,
                    partial_rotary_factor, device)


def sm_count_around(original, device, *args, **kwargs):
    """AROUND ``layernorm_gated._get_sm_count(device)``: for a CPU device, the CPU's core
    count (the kernel's rows-per-block heuristic); anything else unchanged."""
    if active() and getattr(device, "type", None) == "cpu":
        return os.cpu_count() or 1
    return original(device, *args, **kwargs)


def deepseek_rope_flat_around(original, rope, positions, query, key, offsets=None, *args, **kwargs):
    """AROUND ``DeepseekScalingRotaryEmbedding.forward_native``
    (``srt/layers/rotary_embedding/rope_variant.py:471-503``), the rotary embedding every layer
    gets on CPU (``factory.py:478-481``: ``get_rope_cpu`` builds only DeepSeek's YaRN): it
    broadcasts ``cos [1, T, 1, rot]`` against ``query[..., :rot]``, right for MLA's
    ``[T, heads, rot]`` but wrong for a flat ``[T, heads * head]`` query (``[T, T, rot]`` out), which
    Ling 2.5's lightning and GQA layers pass (``models/bailing_moe_linear.py:591``, ``:717``). A
    flat query / key runs per head here, with the same cache, style and partial rotary dim."""
    if not active() or query.dim() != 2 or args or kwargs:
        return original(rope, positions, query, key, offsets)
    import torch

    from sglang.srt.layers.rotary_embedding.utils import rotate_gptj, rotate_neox

    pos = torch.add(positions, offsets) if offsets is not None else positions
    cos, sin = rope.cos_sin_cache[pos].chunk(2, dim=-1)  # [T, rot / 2]
    if rope.is_neox_style:
        cos, sin = cos.repeat(1, 2), sin.repeat(1, 2)
    else:
        cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    rotate = rotate_neox if rope.is_neox_style else rotate_gptj
    T, hs, rd = query.shape[0], rope.head_size, rope.rotary_dim

    def apply(x):
        x3 = x.reshape(T, -1, hs)
        xr = x3[..., :rd]
        xr = xr * cos + rotate(xr) * sin
        return torch.cat((xr, x3[..., rd:]), dim=-1).reshape(x.shape).to(x.dtype)

    return apply(query), apply(key)


def dsv3_mla_init_around(original, mla, *args, **kwargs):
    """AROUND Ling 2.5's ``DsV3MLA.__init__`` (``models/bailing_moe_linear.py:107-111``): with
    rope scaling it pins its rotary embedding to ``forward_cuda`` (an instance attribute), which
    on CPU calls an unbound CUDA kernel (``rotary_embedding/base.py:468``,
    ``NameError: apply_rope_with_cos_sin_cache_inplace``). On CPU the pin is dropped, so the
    layer's rotary runs SGLang's own CPU dispatch as other MLA classes do."""
    result = original(mla, *args, **kwargs)
    rope = getattr(mla, "rotary_emb", None)
    if active() and rope is not None and "forward" in getattr(rope, "__dict__", {}):
        del rope.__dict__["forward"]
    return result


# ---------------------------------------------------------------- a model without attention (gap 6)

def cpu_tp_config_around(original, model_config, load_config, tp_size, *args, **kwargs):
    """AROUND ``configs/update_config.py::adjust_config_with_unaligned_cpu_tp`` (called on every
    CPU model load, ``model_executor/model_runner.py``): it pads attention heads for a TP size
    that does not divide them, computing ``num_attention_heads % tp_size`` first
    (``update_config.py:245``), a ``TypeError`` for a model without attention layers
    (``Mamba2ForCausalLM``: ``num_attention_heads`` None). With no attention heads and one rank
    there is nothing to pad: the config is returned unchanged; anything else calls SGLang."""
    if active() and getattr(model_config, "num_attention_heads", 0) is None and tp_size == 1:
        return model_config
    return original(model_config, load_config, tp_size, *args, **kwargs)


# ---------------------------------------------------------------- mm with out_dtype (gap 7)

_mm_lock = threading.Lock()
_mm_depth = 0


@contextlib.contextmanager
def cpu_mm_out_dtype():
    """For the duration of the block, ``torch.mm(a, b, out_dtype=d)`` on CPU tensors (an
    overload torch implements for CUDA only: ``aten::mm.dtype``) runs as ``torch.mm`` of the
    operands cast to ``d`` (the float32 product with float32 accumulation it asks for); any
    other call is torch's. Re-entrant."""
    global _mm_depth
    import torch

    with _mm_lock:
        if _mm_depth == 0:
            original = torch.mm

            @functools.wraps(original)
            def mm(a, b, *args, out_dtype=None, **kwargs):
                if out_dtype is not None and a.device.type == "cpu" and not args and not kwargs:
                    return original(a.to(out_dtype), b.to(out_dtype))
                if out_dtype is None:
                    return original(a, b, *args, **kwargs)
                return original(a, b, *args, out_dtype=out_dtype, **kwargs)

            mm._mamba_ext_original = original
            torch.mm = mm
        _mm_depth += 1
    try:
        yield
    finally:
        with _mm_lock:
            _mm_depth -= 1
            if _mm_depth == 0:
                torch.mm = torch.mm._mamba_ext_original


def mm_out_dtype_around(original, *args, **kwargs):
    """AROUND ``NemotronHMoE.forward``: its router runs ``torch.mm(..., out_dtype=torch.float32)``
    (``models/nemotron_h.py:389-391``, also ``:421-423``, ``:446-448``)."""
    if not active():
        return original(*args, **kwargs)
    with cpu_mm_out_dtype():
        return original(*args, **kwargs)


# ---------------------------------------------------------------- MLA under torch_native (gap 5)

MLA_HANDLERS = "sglang.srt.models.deepseek_common.attention_backend_handler"


def torch_native_mla_handler(attn, forward_batch):
    """MLA forward method under ``--attention-backend torch_native``: always the absorbed path
    (``AttnForwardMethod.MLA``), which reads and writes the latent KV pool that
    ``torch_native`` serves."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    return AttnForwardMethod.MLA


def register_torch_native_mla() -> bool:
    """Register :func:`torch_native_mla_handler` for ``torch_native`` in SGLang's MLA handler
    registry when it has none (otherwise its ``triton`` handler answers, which picks the MHA
    path for a prefill without prefix: ``Expected size ... but got ...`` in torch_native);
    returns whether it registered."""
    handlers = importlib.import_module(MLA_HANDLERS)
    registry = handlers.AttentionBackendRegistry
    if "torch_native" in registry._handlers:
        return False
    registry.register("torch_native", torch_native_mla_handler)
    return True


# ---------------------------------------------------------------- shims (gap 4) at model start

def install_model_bridges() -> dict:
    """In a scheduler process about to build its model: the interpreter shims over SGLang's
    GDN / KDA / Mamba2 kernels and the causal-conv names. Returns what was done (for the log)."""
    from sglang_mamba_ext.plugin.triton_interpret import install_interpreter_shims, interpreting

    done = {}
    if interpreting():
        done["shims"] = install_interpreter_shims(extra_modules=MAMBA_KERNEL_MODULES)
    done["causal_conv"] = bind_causal_conv()
    done["torch_native_mla"] = register_torch_native_mla()
    done["torch_kernels"] = torch_kernels()  # SGLANG_MAMBA_EXT_CPU_KERNELS (KERNEL_BRIDGES)
    return done


def model_runner_init_before(*args, **kwargs):
    """BEFORE hook on ``ModelRunner.__init__``."""
    if active():
        done = install_model_bridges()
        logger.info("sglang-mamba-ext: CPU bridges for SGLang's hybrid models: %s", done)
    return None


def register_cpu_bridges() -> None:
    """Register the hooks (idempotent); each is inert unless :func:`active`."""
    global _installed
    if _installed:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(MODEL_RUNNER_INIT, model_runner_init_before, HookType.BEFORE)
    HookRegistry.register(MAMBA_MIXER_FORWARD, device_module_around, HookType.AROUND)
    HookRegistry.register(QWEN3_NEXT_GDN_INIT, device_module_around, HookType.AROUND)
    HookRegistry.register(ROPE_INIT, rope_init_around, HookType.AROUND)
    HookRegistry.register(GATED_NORM_SM_COUNT, sm_count_around, HookType.AROUND)
    HookRegistry.register(GATED_NORM_FWD, device_module_around, HookType.AROUND)
    HookRegistry.register(CPU_TP_CONFIG, cpu_tp_config_around, HookType.AROUND)
    HookRegistry.register(NEMOTRON_H_MOE_FORWARD, mm_out_dtype_around, HookType.AROUND)
    from sglang_mamba_ext.plugin import cpu_bridges_moe

    HookRegistry.register(cpu_bridges_moe.MOE_FORWARD_NATIVE, cpu_bridges_moe.moe_native_around, HookType.AROUND)
    HookRegistry.register(DEEPSEEK_ROPE_NATIVE, deepseek_rope_flat_around, HookType.AROUND)
    HookRegistry.register(GET_ROPE_CPU, rope_cpu_around, HookType.AROUND)
    HookRegistry.register(DSV3_MLA_INIT, dsv3_mla_init_around, HookType.AROUND)
    for target in KERNEL_BRIDGES:  # before install_mamba_radix's BEFORE hooks: theirs wrap these
        HookRegistry.register(target, make_kernel_around(target), HookType.AROUND)
    from sglang_mamba_ext.plugin.cpu_bridges_kimi_k3 import register_kimi_k3_bridges

    register_kimi_k3_bridges(HookRegistry, HookType)  # Kimi-K3's text class (cpu_bridges_kimi_k3.py)
    from sglang_mamba_ext.plugin.cpu_bridges_minicpmv import register_minicpmv_bridges

    register_minicpmv_bridges(HookRegistry, HookType)  # MiniCPM-V 4.6 / 4.7 (cpu_bridges_minicpmv.py)
    from sglang_mamba_ext.plugin.cpu_bridges_inkling import register_inkling_bridges

    register_inkling_bridges(HookRegistry, HookType)  # Inkling (cpu_bridges_inkling.py)
    from sglang_mamba_ext.plugin.cpu_bridges_jet_nemotron import register_jet_nemotron_bridges

    register_jet_nemotron_bridges(HookRegistry, HookType)  # Jet-Nemotron (cpu_bridges_jet_nemotron.py)
    from sglang_mamba_ext.plugin.cpu_bridges_glm5_next import register_glm5_next_bridges

    register_glm5_next_bridges(HookRegistry, HookType)  # GLM-5-Next (cpu_bridges_glm5_next.py)
    _installed = True
