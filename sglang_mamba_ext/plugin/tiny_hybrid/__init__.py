"""SGLang registration of the project's tiny hybrid test model (config, model class, backend).

:func:`register_tiny_hybrid` is called by the plugin entry point
(``sglang_mamba_ext.plugin.registration:register``, group ``sglang.srt.plugins``) in every
SGLang process; it is idempotent and cheap. It fills in-process registries only (transformers'
``AutoConfig``, SGLang's linear-attention model registry, and a hook that puts the model class
into SGLang's model registry when a config names it); it sets no environment variable and
changes nothing for any other model. Modules: ``config`` (config class with
``mamba2_cache_params``), ``model`` (``TinyHybridForCausalLM``, ``EntryClass``), ``backend``
(the linear-attention backend). Mechanism: ``docs/design.md``, "SGLang wiring".
"""

from __future__ import annotations

import os
import sys

MODEL_TYPE = "tiny_hybrid"
ARCHITECTURE = "TinyHybridForCausalLM"
#: The tiny frozen-KV draft (``sglang_mamba_ext.models.tiny_draft``; FROZEN_KV_MTP).
DRAFT_MODEL_TYPE = "tiny_hybrid_draft"
DRAFT_ARCHITECTURE = "TinyHybridDraftForCausalLM"
BACKEND_CLASS = "sglang_mamba_ext.plugin.tiny_hybrid.backend.TinyHybridLinearAttnBackend"
#: The tiny model served by SGLang's KDA backend (Kimi-Linear's pool layout there:
#: ``config.TinyHybridSGLangConfig.mamba2_cache_params``).
KDA_SGLANG_ARCHITECTURE = "TinyHybridKDAForCausalLM"
#: The tiny model with SGLang's own linear-attention backends (``--linear-kernels sglang`` of
#: ``scripts/make_tiny_model.py``): architecture -> SGLang backend class.
SGLANG_KERNEL_ARCHITECTURES = {
    "TinyHybridGDNForCausalLM": "sglang.srt.layers.attention.linear.gdn_backend.GDNAttnBackend",
    KDA_SGLANG_ARCHITECTURE: "sglang.srt.layers.attention.linear.kda_backend.KDAAttnBackend",
}
_EXTERNAL_PKG_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"
_REGISTRY_MODULE = "sglang.srt.models.registry"
#: Where SGLang's model loader resolves a config's architectures to a model class.
GET_MODEL_ARCHITECTURE = "sglang.srt.model_loader.utils.get_model_architecture"

_registered = False


def register_tiny_hybrid() -> None:
    """Register the tiny hybrid model with SGLang 0.5.23 (idempotent).

    1. ``transformers.AutoConfig.register("tiny_hybrid", TinyHybridSGLangConfig)`` so
       SGLang's config parser loads ``config.json`` into the class exposing
       ``mamba2_cache_params`` (and ``"tiny_hybrid_draft"`` for the frozen-KV draft).
    2. ``register_linear_attn_model(LinearAttnModelSpec(...))``
       (``sglang/srt/configs/linear_attn_model_registry.py``): SGLang then builds a
       ``HybridLinearAttnBackend`` with :class:`TinyHybridLinearAttnBackend` for the linear
       layers and a hybrid (KV + Mamba) request pool; the prefix cache is SGLang's own
       ``MambaRadixCache`` unless ``--enable-mamba-radix`` selects this project's.
    3. A BEFORE hook on ``model_loader/utils.py::get_model_architecture``
       (:func:`get_model_architecture_before`) makes ``TinyHybridForCausalLM`` resolvable by
       ``sglang.srt.models.registry`` when a config names it, and only then.
    """
    global _registered
    if _registered:
        return
    from transformers import AutoConfig

    from sglang.srt.configs.linear_attn_model_registry import (
        LinearAttnModelSpec,
        get_linear_attn_spec_by_arch,
        register_linear_attn_model,
    )
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from sglang_mamba_ext.plugin.tiny_hybrid.config import TinyHybridSGLangConfig

    from sglang_mamba_ext.models.tiny_draft import TinyHybridDraftConfig

    AutoConfig.register(MODEL_TYPE, TinyHybridSGLangConfig, exist_ok=True)
    AutoConfig.register(DRAFT_MODEL_TYPE, TinyHybridDraftConfig, exist_ok=True)
    # (architecture, backend, predicate architectures, match configs without any). None
    # declares extra_buffer support: without --enable-mamba-radix SGLang serves them with
    # no_buffer on CPU (its extra_buffer path needs a GPU platform); under the flag the plugin's
    # own check lets its ping-pong tracking through (args.py::validate_mamba_extra_buffer_around).
    specs = [(ARCHITECTURE, BACKEND_CLASS, [ARCHITECTURE, DRAFT_ARCHITECTURE], True)]
    specs += [(arch, backend, [arch], False) for arch, backend in SGLANG_KERNEL_ARCHITECTURES.items()]
    for arch, backend, predicate_archs, default in specs:
        if get_linear_attn_spec_by_arch(arch) is None:
            register_linear_attn_model(
                LinearAttnModelSpec(
                    config_class=TinyHybridSGLangConfig,
                    backend_class_name=backend,
                    arch_names=[arch],
                    uses_mamba_radix_cache=True,
                    support_mamba_cache=True,
                    config_predicate=_archs_predicate(predicate_archs, default=default),
                )
            )
    HookRegistry.register(GET_MODEL_ARCHITECTURE, get_model_architecture_before, HookType.BEFORE)
    _registered = True


def _archs_predicate(archs, default: bool = False):
    """``config_predicate`` of a ``LinearAttnModelSpec``: SGLang's attention registry picks the
    linear backend by config class (``get_linear_attn_config``), and the tiny model's variants
    share one config class, so each spec also matches on ``config.architectures``."""

    def predicate(config) -> bool:
        names = getattr(config, "architectures", None) or []
        return any(a in archs for a in names) if names else default

    return predicate


def get_model_architecture_before(model_config, *args, **kwargs) -> None:
    """BEFORE hook on ``get_model_architecture(model_config)``: when the config names
    ``TinyHybridForCausalLM`` (or the draft's ``TinyHybridDraftForCausalLM``), put that
    class into ``ModelRegistry.models``.

    If SGLang's model registry is not imported yet, it is imported here with
    ``SGLANG_EXTERNAL_MODEL_PACKAGE`` naming this package for the duration of the import
    (the registry then imports only this package and loads SGLang's own models lazily, on
    the first architecture it does not know), and the variable is restored right after.
    """
    archs = getattr(getattr(model_config, "hf_config", None), "architectures", None) or []
    ours = {ARCHITECTURE, DRAFT_ARCHITECTURE, *SGLANG_KERNEL_ARCHITECTURES}
    if not ours.intersection(archs):
        return None
    if _REGISTRY_MODULE not in sys.modules and not os.environ.get(_EXTERNAL_PKG_ENV):
        os.environ[_EXTERNAL_PKG_ENV] = __name__
        try:
            import sglang.srt.models.registry  # noqa: F401  (reads the variable on import)
        finally:
            os.environ.pop(_EXTERNAL_PKG_ENV, None)
    from sglang.srt.models.registry import ModelRegistry

    if ARCHITECTURE in archs and ARCHITECTURE not in ModelRegistry.models:
        from sglang_mamba_ext.plugin.tiny_hybrid.model import TinyHybridForCausalLM

        ModelRegistry.models[ARCHITECTURE] = TinyHybridForCausalLM
    if DRAFT_ARCHITECTURE in archs and DRAFT_ARCHITECTURE not in ModelRegistry.models:
        from sglang_mamba_ext.plugin.tiny_hybrid.draft_model import TinyHybridDraftForCausalLM

        ModelRegistry.models[DRAFT_ARCHITECTURE] = TinyHybridDraftForCausalLM
    for arch in SGLANG_KERNEL_ARCHITECTURES:
        if arch in archs and arch not in ModelRegistry.models:
            from sglang_mamba_ext.plugin.tiny_hybrid.model import TinyHybridSGLangKernelsForCausalLM

            ModelRegistry.models[arch] = TinyHybridSGLangKernelsForCausalLM
    return None
