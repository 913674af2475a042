"""SGLang registration of the tiny hybrid test model (config, model class, linear backend).

:func:`register_tiny_hybrid` is called by the plugin entry point
(``sglang_mamba_ext.plugin.registration:register``, group ``sglang.srt.plugins``) in every SGLang
process; it is idempotent and cheap (imports no model code unless the model registry is
already loaded). Modules: ``config`` (config class with ``mamba2_cache_params``), ``model``
(``TinyHybridForCausalLM``, ``EntryClass``), ``backend`` (the linear-attention backend).
"""

from __future__ import annotations

import os
import sys

MODEL_TYPE = "tiny_hybrid"
ARCHITECTURE = "TinyHybridForCausalLM"
BACKEND_CLASS = "sglang_mamba_ext.plugin.tiny_hybrid.backend.TinyHybridLinearAttnBackend"
_EXTERNAL_PKG_ENV = "SGLANG_EXTERNAL_MODEL_PACKAGE"

_registered = False


def register_tiny_hybrid() -> None:
    """Register the tiny hybrid model with SGLang 0.5.23 (idempotent).

    1. ``transformers.AutoConfig.register("tiny_hybrid", TinyHybridSGLangConfig)`` so
       SGLang's config parser loads ``config.json`` into the class exposing
       ``mamba2_cache_params``.
    2. ``register_linear_attn_model(LinearAttnModelSpec(...))``
       (``sglang/srt/configs/linear_attn_model_registry.py``): SGLang then builds a
       ``HybridLinearAttnBackend`` with :class:`TinyHybridLinearAttnBackend` for the linear
       layers and a hybrid (KV + Mamba) pool with SGLang's ``MambaRadixCache``.
    3. Make ``TinyHybridForCausalLM`` resolvable by ``sglang.srt.models.registry``: if the
       registry is not imported yet and ``SGLANG_EXTERNAL_MODEL_PACKAGE`` is unset, set it to
       this package (the registry then imports only this package at start-up and loads
       SGLang's built-in models lazily, on the first architecture it does not know);
       otherwise add the class to ``ModelRegistry.models`` directly.
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

    from sglang_mamba_ext.plugin.tiny_hybrid.config import TinyHybridSGLangConfig

    AutoConfig.register(MODEL_TYPE, TinyHybridSGLangConfig, exist_ok=True)
    if get_linear_attn_spec_by_arch(ARCHITECTURE) is None:
        register_linear_attn_model(
            LinearAttnModelSpec(
                config_class=TinyHybridSGLangConfig,
                backend_class_name=BACKEND_CLASS,
                arch_names=[ARCHITECTURE],
                uses_mamba_radix_cache=True,
                support_mamba_cache=True,
            )
        )
    _register_model_class()
    _registered = True


def _register_model_class() -> None:
    if "sglang.srt.models.registry" not in sys.modules and not os.environ.get(_EXTERNAL_PKG_ENV):
        os.environ[_EXTERNAL_PKG_ENV] = __name__
        return
    from sglang.srt.models.registry import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.models:
        from sglang_mamba_ext.plugin.tiny_hybrid.model import TinyHybridForCausalLM

        ModelRegistry.models[ARCHITECTURE] = TinyHybridForCausalLM
