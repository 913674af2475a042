"""CPU bridges for SGLang 0.5.23's Inkling class (``InklingForConditionalGeneration``,
``srt/models/inkling.py``; issue 40), beside :mod:`.cpu_bridges` (whose :func:`.cpu_bridges.active`
gates them: inert unless the CPU defaults turned the bridges on and CUDA is absent).

- **hybrid SWA without a sliding-window layer** (AROUND ``configs/model_config.py::is_hybrid_swa_model``):
  SGLang lists the class among its hybrid-SWA architectures (``model_config.py:2676-2677``) and
  answers True for every Inkling checkpoint, also one whose ``local_layer_ids`` is empty
  (``get_hybrid_layer_ids``, ``model_config.py:2781-2797``, then gives every layer to the full
  pool and none to the SWA pool); the plugin's cache does not serve SWA KV pools
  (``plugin/cache.py::build_tree_cache``). As SGLang already does for Beam and Laguna without a
  sliding layer (``model_config.py:2680-2692``), an Inkling checkpoint with no local layer (and no
  banded MTP depth) is answered False on an active process: one ordinary KV pool, every layer
  full attention (``is_local`` False in every ``InklingAttention``).
- **chat encoding of the project's tiny checkpoint** (AROUND
  ``entrypoints/openai/chat_encoding.py::resolve_chat_encoding_spec``): SGLang renders every
  Inkling chat prompt with tml-renderers' ``o200k_base_chat`` tokenizer
  (``chat_encoding.py:50-54``) and, at start-up, refuses a served tokenizer that disagrees with it
  on Inkling's special tokens (``entrypoints/openai/serving_inkling.py:262-281``,
  ``ValueError: The served tokenizer disagrees with tml-renderers' o200k_base_chat``: the HTTP
  server exits). The project's tiny checkpoints carry the project's small tokenizer (768 ids), not
  o200k, so for a checkpoint marked ``sglang_mamba_ext_tiny`` the answer is None (SGLang's default
  path: the checkpoint's own tokenizer; the tests send ``input_ids``). Any other Inkling
  checkpoint keeps SGLang's renderer and check. Not CPU-specific; gated on the marker only.
"""
from __future__ import annotations

#: SGLang's Inkling classes (``configs/model_config.py:2676-2677``).
INKLING_ARCHITECTURES = ("InklingForConditionalGeneration",)
IS_HYBRID_SWA = "sglang.srt.configs.model_config.is_hybrid_swa_model"
CHAT_ENCODING_SPEC = "sglang.srt.entrypoints.openai.chat_encoding.resolve_chat_encoding_spec"


def _no_local_layers(hf_text_config) -> bool:
    return (hf_text_config is not None and not list(getattr(hf_text_config, "local_layer_ids", None) or [])
            and not list(getattr(hf_text_config, "mtp_local_layer_ids", None) or []))


def is_hybrid_swa_around(original, model_architectures, hf_text_config=None, *args, **kwargs):
    """AROUND ``is_hybrid_swa_model(model_architectures, hf_text_config)``: False for an Inkling
    checkpoint without sliding-window layers on an active process (module docstring)."""
    from sglang_mamba_ext.plugin.cpu_bridges import active

    if (active() and any(a in INKLING_ARCHITECTURES for a in (model_architectures or []))
            and _no_local_layers(hf_text_config)):
        return False
    return original(model_architectures, hf_text_config, *args, **kwargs)


def resolve_chat_encoding_spec_around(original, *args, hf_config=None, **kwargs):
    """AROUND ``resolve_chat_encoding_spec(*, hf_config, tokenizer, tool_call_parser)``: None for
    the project's tiny Inkling checkpoint, SGLang's answer otherwise (module docstring)."""
    from sglang_mamba_ext.plugin.cpu_defaults import TINY_HF_MARKER

    archs = getattr(hf_config, "architectures", None) or []
    if any(a in INKLING_ARCHITECTURES for a in archs) and getattr(hf_config, TINY_HF_MARKER, None):
        return None
    return original(*args, hf_config=hf_config, **kwargs)


def register_inkling_bridges(registry, hook_type) -> None:
    """Register this module's hooks on SGLang's ``HookRegistry`` (called from
    :func:`.cpu_bridges.register_cpu_bridges`)."""
    registry.register(IS_HYBRID_SWA, is_hybrid_swa_around, hook_type.AROUND)
    registry.register(CHAT_ENCODING_SPEC, resolve_chat_encoding_spec_around, hook_type.AROUND)
