"""Hybrid classes for which SGLang 0.5.23 never declares ``uses_mamba_radix_cache``, declared by
the plugin under ``--enable-mamba-radix`` (issue 40). (SGLang's own cache still keeps their
states, a ``UnifiedRadixCache`` with a Mamba component; the plugin's flag builds on that field.)

SGLang decides whether a model's prefix cache keeps SSM states in one resolution pass,
``_mamba_radix_cache_resolution`` (``sglang/srt/arg_groups/overrides.py:459``): it declares
``uses_mamba_radix_cache`` for the architectures named in ``_MAMBA_RADIX_CACHE_ARCHS``
(``overrides.py:369``) or with a linear-attention registry spec. Some classes whose layers SGLang
serves with its hybrid backends and state pool are missing from that list:

- ``Lfm2VlForConditionalGeneration`` (LFM2-VL: LFM2's short-conv text model behind a vision
  tower; ``Lfm2ForCausalLM`` and ``Lfm2MoeForCausalLM`` are listed);
- ``Mamba2ForCausalLM`` (pure Mamba2, no attention layer);
- ``FalconMambaForCausalLM`` / ``MambaForCausalLM`` (pure Mamba1, no attention layer);
- ``KimiK3LinearForCausalLM`` (Kimi-K3's text model: KDA beside MLA; SGLang lists its VLM,
  ``KimiK3ForConditionalGeneration``, not the text class);
- ``NemotronH_Nano_VL_V2`` / ``NemotronH_Nano_Omni_Reasoning_V3`` (``models/nano_nemotron_vl.py``:
  Nemotron-H behind a RADIO tower; SGLang lists only ``NemotronH_Omni_Reasoning_V3`` of that
  module, though its hybrid detection takes all three configs, ``configs/hybrid_arch.py:96-97``);
- ``MiniCPMSALAForCausalLM`` / ``MiniCPMForCausalLM`` (MiniCPM-SALA: lightning layers on SGLang's
  ``LightningAttentionBackend`` beside dense attention). SGLang's own model override also turns
  its radix cache off for every such config (``arg_groups/model_overrides/minicpm.py:24-27``, so
  ``_mamba_radix_cache_resolution`` returns at ``overrides.py:473``); for a config without
  ``sparse_config`` and without the user's ``--disable-radix-cache`` (the raw argument) the
  plugin's pass turns it back on, since the plugin's cache keeps the lightning states exactly
  (``plugin/inchunk_lightning.py``).

Under the plugin's flag these would stop at start-up (``args.handle_mamba_radix_cache_around``:
"needs a hybrid model"). :func:`declare_missing_hybrid` runs, from that AROUND hook and before
SGLang's handler, one more pass of SGLang's own kind (``overrides.run_post_process_pass``, the
mechanism SGLang's passes use; nothing patched) declaring ``uses_mamba_radix_cache`` for these
classes, with SGLang's ``auto`` choice for an architecture without ``extra_buffer`` support
(``no_buffer`` and overlap scheduling off, ``overrides.py:485-486``). Only with
``--enable-mamba-radix``; only for :data:`DECLARED_ARCHITECTURES` whose config SGLang's hybrid
detection (``configs/hybrid_arch.py::mambaish_config``) accepts; nothing when SGLang has already
declared the field or ``--disable-radix-cache`` is given.
"""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

#: Architectures (``architectures[0]``) declared hybrid-cached by the plugin, with the reason.
DECLARED_ARCHITECTURES = {
    "Lfm2VlForConditionalGeneration": "LFM2-VL: LFM2's short-conv layers behind a vision tower",
    "Mamba2ForCausalLM": "pure Mamba2 (no attention layer)",
    "FalconMambaForCausalLM": "pure Mamba1 (no attention layer)",
    "MambaForCausalLM": "pure Mamba1 (no attention layer)",
    "MiniCPMSALAForCausalLM": "MiniCPM-SALA: lightning layers beside dense attention",
    "MiniCPMForCausalLM": "MiniCPM-SALA: lightning layers beside dense attention",
    "KimiK3LinearForCausalLM": "Kimi-K3's text model: KDA layers beside MLA (its VLM class is listed)",
    "NemotronH_Nano_VL_V2": "Nemotron-H's Mamba2 layers behind a RADIO vision tower (NemotronH_Omni_Reasoning_V3 is listed)",
    "NemotronH_Nano_Omni_Reasoning_V3": "Nemotron-H's Mamba2 layers behind a RADIO vision tower (NemotronH_Omni_Reasoning_V3 is listed)",
}
#: Classes whose SGLang model override turns the radix cache off for every hybrid config
#: (``arg_groups/model_overrides/minicpm.py:24-27``); under the plugin's flag, with dense attention
#: (no ``sparse_config``) and no ``--disable-radix-cache`` from the user, the plugin's cache serves.
CACHE_OFF_BY_SGLANG = ("MiniCPMSALAForCausalLM", "MiniCPMForCausalLM")


def _declaration(view: Any, undo_cache_off: bool = False) -> dict:
    """The pass: SGLang's own ``uses_mamba_radix_cache`` decision for a listed class."""
    if view.uses_mamba_radix_cache or (view.disable_radix_cache and not undo_cache_off):
        return {}
    declared = {"uses_mamba_radix_cache": True}
    if view.disable_radix_cache:
        declared["disable_radix_cache"] = False
    if view.mamba_radix_cache_strategy == "auto":
        declared.update(mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True)
    return declared


def declare_missing_hybrid(server_args: Any, hf_config: Any) -> bool:
    """Declare ``uses_mamba_radix_cache`` for a class of :data:`DECLARED_ARCHITECTURES` (see the
    module docstring); returns whether a declaration was made. Call only under the plugin's flag."""
    arch = (getattr(hf_config, "architectures", None) or [None])[0]
    if arch not in DECLARED_ARCHITECTURES:
        return False
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.arg_groups.overrides import run_post_process_pass
    from sglang.srt.configs import hybrid_arch

    if resolved_view(server_args).uses_mamba_radix_cache:
        return False

    class _Probe:  # the ModelConfig fields mambaish_config reads
        is_draft_model = False

    probe = _Probe()
    probe.hf_config = hf_config
    probe.hf_text_config = getattr(hf_config, "text_config", hf_config)
    try:
        mambaish = hybrid_arch.mambaish_config(probe) is not None
    except Exception:  # noqa: BLE001 - a config shape the probe does not cover: keep SGLang's decision
        mambaish = False
    if not mambaish:
        return False
    undo = (arch in CACHE_OFF_BY_SGLANG and not getattr(server_args, "disable_radix_cache", False)
            and getattr(hf_config, "sparse_config", None) is None)
    if undo:
        def _minicpm_declaration(view: Any) -> dict:
            return _declaration(view, undo_cache_off=True)

        run_post_process_pass(server_args, _minicpm_declaration)
    else:
        run_post_process_pass(server_args, _declaration)
    logger.info("mamba-radix: %s declared hybrid-cached (%s; SGLang's overrides.py:369 does not list it%s)",
                arch, DECLARED_ARCHITECTURES[arch],
                "; SGLang's radix-cache-off override, model_overrides/minicpm.py:24-27, undone" if undo else "")
    return True
