"""Bridge for SGLang 0.5.23's Kimi-K3 VLM (``KimiK3ForConditionalGeneration``,
``srt/models/kimi_k3.py``; issue 40) on a checkpoint without the released processor's remote code,
beside :mod:`.cpu_bridges_kimi_k3` (which registers it; gated like every CPU bridge by
:func:`.cpu_bridges.active`).

- **the HF processor** (AROUND ``utils/hf_transformers/processor.py::get_processor``): for a
  multimodal class SGLang's tokenizer manager loads the checkpoint's processor at start-up
  (``managers/tokenizer_manager.py:612-628``) even when only text is sent, and SGLang's K3
  processor reads ``_processor.media_processor`` in its constructor
  (``multimodal/processors/kimi_k3.py:399-401``: ``media_proc_cfg``, the patch size, merge
  kernel, patch limits, mean / std; ``kimi_common.py:186-188`` and ``kimi_k3.py:262-266`` its
  ``media_tokens_calculator``). transformers has no Kimi processor: the released checkpoint ships
  it as remote code. Without it ``AutoProcessor`` hands back the bare tokenizer
  (``get_processor``, ``processor.py:340-346``) and the server stops at start-up with
  ``AttributeError: ... has no attribute 'media_processor'``. Where SGLang's answer for a
  ``kimi_k3`` checkpoint has no ``media_processor`` and the checkpoint's
  ``preprocessor_config.json`` holds a ``media_proc_cfg`` (the project's tiny checkpoint,
  ``models/hf_tiny_kimi_k3_vl.py``), the answer is :class:`K3Processor`: the tokenizer and a
  :class:`K3MediaConfig` with that config, which counts an image's tokens and makes its patches
  with SGLang's own K3 / K2.5 preprocessing functions on CPU tensors. A checkpoint with its own
  processor (remote code, ``--trust-remote-code``) gets SGLang's answer unchanged.

The server's start-up warmup sends a VLM an image (``entrypoints/http_server.py:2393-2450``,
a 448x448 PNG for K3), so the image path has to run for the server to start at all.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, Optional

logger = logging.getLogger(__name__)

GET_PROCESSOR = "sglang.srt.utils.hf_transformers.processor.get_processor"


class K3MediaConfig:
    """What SGLang's K3 processor reads of the remote code's media processor: ``media_proc_cfg``
    (a dict, as in ``preprocessor_config.json``), ``media_tokens_calculator`` (an image's token
    count: SGLang's ``navit_resize_config``, ``multimodal/processors/kimi_k25.py:34``) and
    ``preprocess`` (pixel patches and ``(t, h, w)`` grids: SGLang's own resize / pad / normalize /
    patchify pipeline, ``kimi_k25.py::_gpu_preprocess_images``, run on CPU tensors, with K3's
    transparent-background fill, ``multimodal/kimi_k3_image_processing.py::fill_transparent_bg``)."""

    def __init__(self, media_proc_cfg: Dict[str, Any]):
        self.media_proc_cfg = dict(media_proc_cfg)

    def _resize(self, image) -> Dict[str, int]:
        from sglang.srt.multimodal.processors.kimi_k25 import _get_image_dimensions, navit_resize_config

        c = self.media_proc_cfg
        width, height = _get_image_dimensions(image)
        return navit_resize_config(width, height, int(c["patch_size"]), int(c["merge_kernel_size"]),
                                   int(c["in_patch_limit"]), int(c["patch_limit_on_one_side"]),
                                   c.get("fixed_output_tokens"))

    def media_tokens_calculator(self, media: Dict[str, Any]) -> int:
        return int(self._resize(media["image"])["num_tokens"])

    def preprocess(self, medias, return_tensors: str = "pt", **kwargs) -> Dict[str, Any]:
        from sglang.srt.multimodal.kimi_k3_image_processing import (fill_transparent_bg, normalization_tensors,
                                                                     to_chw_uint8)
        from sglang.srt.multimodal.processors.kimi_k25 import _gpu_preprocess_images

        c = self.media_proc_cfg
        images = [m["image"] for m in medias]
        scale, bias = normalization_tensors(list(c["image_mean"]), list(c["image_std"]), "cpu")
        bg = c.get("transparent_bg_config")
        pixel_values, grid_thws = _gpu_preprocess_images(
            images, [self._resize(im) for im in images], scale, bias, int(c["patch_size"]),
            to_chw=lambda im: to_chw_uint8(im, device="cpu"), post_resize=lambda x: fill_transparent_bg(x, bg))
        return {"pixel_values": pixel_values, "grid_thws": grid_thws}


class K3Processor:
    """An HF-processor stand-in: ``tokenizer``, ``media_processor`` and ``image_processor``
    (the same :class:`K3MediaConfig`; SGLang's wrapper reads both,
    ``multimodal/processors/kimi_k25.py:384-386``); called with ``text`` (already holding each
    image's expanded placeholders) and ``medias`` it returns the tokenizer's output
    (``return_tensors="pt"``) plus ``pixel_values`` and ``grid_thws``, what SGLang's CPU path reads
    (``multimodal/processors/kimi_k3.py:257-287``)."""

    def __init__(self, tokenizer, media_processor: K3MediaConfig):
        self.tokenizer = tokenizer
        self.media_processor = media_processor
        self.image_processor = media_processor
        self.chat_template = getattr(tokenizer, "chat_template", None)

    def __call__(self, text=None, medias=None, **kwargs):
        kwargs.setdefault("return_tensors", "pt")
        out = self.tokenizer(text, **kwargs)
        if medias:
            out.update(self.media_processor.preprocess(medias))
        return out


def _media_proc_cfg(model_dir: Optional[str]) -> Optional[Dict[str, Any]]:
    """``media_proc_cfg`` of a local checkpoint whose ``config.json`` has ``model_type``
    ``kimi_k3``; None otherwise."""
    if not model_dir or not os.path.isdir(model_dir):
        return None
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
            if json.load(f).get("model_type") != "kimi_k3":
                return None
        with open(os.path.join(model_dir, "preprocessor_config.json"), encoding="utf-8") as f:
            cfg = json.load(f).get("media_proc_cfg")
    except (OSError, ValueError, AttributeError):
        return None
    return cfg if isinstance(cfg, dict) else None


def k3_processor_around(original, tokenizer_name, *args, **kwargs):
    """AROUND ``get_processor(tokenizer_name, *args, model_name=None, **kwargs)``: SGLang's
    processor; for a ``kimi_k3`` checkpoint without a K3 processor on an active process,
    :class:`K3Processor` around the tokenizer SGLang loaded (module docstring)."""
    processor = original(tokenizer_name, *args, **kwargs)
    if hasattr(processor, "media_processor"):
        return processor
    from sglang_mamba_ext.plugin.cpu_bridges import active

    if not active():
        return processor
    cfg = _media_proc_cfg(kwargs.get("model_name") or tokenizer_name)
    if cfg is None:
        return processor
    tokenizer = getattr(processor, "tokenizer", processor)
    logger.info("mamba-radix: Kimi-K3 processor stand-in: the checkpoint has no K3 processor "
                "(remote code); media_proc_cfg from its preprocessor_config.json (multimodal/processors/kimi_k3.py:399-401)")
    return K3Processor(tokenizer, K3MediaConfig(cfg))


def register_kimi_k3_vl_bridges(registry, hook_type) -> None:
    """Register this module's hook on SGLang's ``HookRegistry`` (called from
    :func:`.cpu_bridges_kimi_k3.register_kimi_k3_bridges`)."""
    registry.register(GET_PROCESSOR, k3_processor_around, hook_type.AROUND)
