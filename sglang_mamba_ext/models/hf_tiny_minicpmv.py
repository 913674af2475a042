"""Tiny MiniCPM-V 4.6 / 4.7 checkpoints (issue 40): SGLang 0.5.23's
``MiniCPMV4_6ForConditionalGeneration`` / ``MiniCPMV4_7ForConditionalGeneration``
(``srt/models/minicpmv.py``: Qwen3.5's Gated DeltaNet text model, ``llm``, behind a SigLIP-style
vision tower and a window-attention merger), built by transformers' own classes of the same
names at the tiny sizes (float32 reference included), served text-only.

What these families need beyond the other VLMs (used by :mod:`.hf_tiny`):

- **eight special tokens** (:data:`VISION_TOKENS`): SGLang's tokenizer manager loads the processor
  of a multimodal class at start-up, and transformers' ``MiniCPMV4_6Processor.__init__``
  (``models/minicpmv4_6/processing_minicpmv4_6.py:53-63``) reads them from the tokenizer
  (``image_token``, ``video_token``, the image / slice / image-id start and end tokens). The
  tokenizer is trained 8 ids short and these take ids 760-767 (``extra_special_tokens`` in
  ``tokenizer_config.json``, so transformers exposes them as attributes);
- **no top-level ``vocab_size``**: SGLang's ``MiniCPMV4_6Config`` exposes it as a property of its
  text config without a setter (``AttributeError: property 'vocab_size' ... has no setter``);
  it is written in ``text_config`` only;
- **both processors' configs** (:func:`write_processor_configs`): transformers'
  ``MiniCPMV4_6ImageProcessor`` and ``MiniCPMV4_6VideoProcessor`` (4.7 uses the same).

Only torch and transformers.
"""

from __future__ import annotations

import json
import os
from typing import Dict

#: the processor's special tokens (attribute name -> token text), ids 760-767 in this order
VISION_TOKENS = {
    "image_token": "<image>", "video_token": "<video>", "image_start_token": "<im_start_tok>",
    "image_end_token": "<im_end_tok>", "slice_start_token": "<slice_start>", "slice_end_token": "<slice_end>",
    "image_id_start_token": "<image_id>", "image_id_end_token": "</image_id>",
}


def minicpmv_families(hidden: int) -> Dict[str, Dict]:
    """The family entries of :mod:`.hf_tiny` (``--arch minicpmv``: 4.6, ``--arch minicpmv4_7``:
    4.7; SGLang's module ``minicpmv``) for a text model of width ``hidden``; their
    ``text_config`` is filled by :mod:`.hf_tiny` (Qwen3.5's dense text model). Keys beyond the
    other families': ``special_tokens`` (:data:`VISION_TOKENS`), ``top_level_drop`` (config keys
    kept in ``text_config`` only), ``processor`` (:func:`write_processor_configs`)."""
    def entry(version: str) -> Dict:
        return dict(
            cls=f"MiniCPMV{version}ForConditionalGeneration", module="minicpmv", sub="text_config",
            hf_model_type=f"minicpmv{version.lower()}",
            special_tokens=VISION_TOKENS, top_level_drop=("vocab_size",), processor="minicpmv",
            config=dict(
                model_type=f"minicpmv{version.lower()}", image_token_id=760, video_token_id=761,
                insert_layer_id=0, image_size=64, text_config=None,
                vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                   image_size=64, patch_size=16, insert_layer_id=0),
            ),
        )

    return {"minicpmv": entry("4_6"), "minicpmv4_7": entry("4_7")}


def add_special_tokens_config(out_dir: str, tokens: Dict[str, str]) -> None:
    """Name ``tokens`` (attribute -> text) as ``extra_special_tokens`` in ``out_dir``'s
    ``tokenizer_config.json`` (transformers then exposes ``tokenizer.image_token`` and
    ``tokenizer.image_token_id``, ...)."""
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["extra_special_tokens"] = dict(tokens)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def write_processor_configs(out_dir: str) -> None:
    """transformers' MiniCPM-V 4.6 image and video processor configs in ``out_dir`` (their
    defaults; the 4.7 processor reads the same files)."""
    from transformers.models.minicpmv4_6.image_processing_minicpmv4_6 import MiniCPMV4_6ImageProcessor
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor

    MiniCPMV4_6ImageProcessor().save_pretrained(out_dir)
    MiniCPMV4_6VideoProcessor().save_pretrained(out_dir)
