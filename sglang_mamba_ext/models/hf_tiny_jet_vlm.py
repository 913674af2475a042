"""A tiny Jet-Nemotron VLM checkpoint (issue 40): SGLang 0.5.23's ``JetVLMForConditionalGeneration``
(``sglang/srt/models/jet_vlm.py``, config ``JetVLMConfig``, ``srt/configs/jet_vlm.py``), served
text-only: the tiny Jet-Nemotron text model of :mod:`.hf_tiny_jet_nemotron` (the same config and,
for the same seed, the same tensors, under ``llm.``) behind a one-layer SigLIP vision tower
(transformers' ``SiglipVisionModel``, which SGLang's wrapper builds as it is) and NVILA's
projector (``mm_projector``: 2x2 patch merge, LayerNorm, Linear, GELU, Linear). Written by hand:
transformers 5.19 has no Jet-Nemotron class.

What the checkpoint needs beyond the text model (used by :mod:`.hf_tiny`):

- **a tower 1152 wide**: the projector's input width is a constant of SGLang's module
  (``MM_HIDDEN_SIZE = 1152``, ``jet_vlm.py:28``: its LayerNorm and first Linear take
  ``4 * 1152`` features), so the tower's ``hidden_size`` is SigLIP-so400m's 1152; everything
  else is tiny (:data:`VISION`: one encoder layer, MLP width 64, a 28x28 image of 14-pixel
  patches, no pooling head: ``vision_use_head`` false, the wrapper reads
  ``hidden_states[-2]`` only). About 6.3 M parameters, 13 MB in float16;
- **the names SGLang's loader reads**: ``llm.*`` is handed to ``JetNemotronForCausalLM.load_weights``
  with the prefix stripped; every other tensor is looked up by its exact name among the
  wrapper's parameters (``jet_vlm.py:124-135``; an unknown name raises ``KeyError`` at
  ``:131``): the tower's are ``vision_tower.`` + the names of transformers' ``SiglipVisionModel``
  of the same config (transformers 5.19 names them without a ``vision_model.`` level), read from
  that class here;
- **the processor SGLang's NVILA processor wraps** (``multimodal/processors/nvila.py:41-48``): its
  constructor reads ``_processor.tokenizer.image_token`` / ``.video_token`` and the config's
  ``image_token_id`` / ``video_token_id``. The released checkpoints ship NVILA's processor as
  remote code; this one names transformers' ``SiglipProcessor`` (``processor_config.json``) with
  a ``SiglipImageProcessor`` at the tower's image size (``preprocessor_config.json``), and the
  tokenizer names ``<image>`` / ``<vila/video>`` (ids 766 / 767, :data:`MEDIA_TOKENS`) as
  ``extra_special_tokens``. The project's ChatML template renders no image part (a string-content
  template: SGLang drops a chat's images for it), so the server's start-up warmup, an image chat,
  runs as text.

Only torch and transformers; deterministic for a seed.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Dict

import torch

from sglang_mamba_ext.models.hf_tiny_jet_nemotron import jet_nemotron_families, jet_nemotron_weights
from sglang_mamba_ext.models.hf_tiny_written import _Draw

#: the projector's input width, a constant of SGLang's module (``jet_vlm.py:28``)
MM_HIDDEN_SIZE = 1152
#: the image / video placeholders (tokenizer attribute -> text), ids 766 / 767 in this order
MEDIA_TOKENS = {"image_token": "<image>", "video_token": "<vila/video>"}
IMAGE_TOKEN_ID, VIDEO_TOKEN_ID = 766, 767

#: the tiny SigLIP tower's config (``SiglipVisionConfig`` fields): 1152 wide (forced), one
#: layer, 16 heads of 72 (so400m's), a 28x28 image = 2x2 patches of 14, merged 2x2 by the
#: projector into one token per image (the one ``<image>`` placeholder ``SiglipProcessor`` leaves
#: in the prompt per image: it expands none)
VISION = dict(model_type="siglip_vision_model", hidden_size=MM_HIDDEN_SIZE, intermediate_size=64,
              num_hidden_layers=1, num_attention_heads=16, num_channels=3, image_size=28, patch_size=14,
              hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, attention_dropout=0.0, vision_use_head=False)


def _siglip_shapes(vision: Dict) -> Dict[str, tuple]:
    """Name -> shape of transformers' ``SiglipVisionModel`` parameters for the config ``vision``
    (the module SGLang's wrapper instantiates, ``jet_vlm.py:76``), built on the meta device."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    cfg = SiglipVisionConfig(**{k: v for k, v in vision.items() if k != "model_type"})
    with torch.device("meta"):
        model = SiglipVisionModel(cfg)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def jet_vlm_weights(cfg: Dict, seed: int, logit_scale: float) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``JetVLMForConditionalGeneration`` for the config ``cfg``
    (:func:`jet_vlm_family`'s, tokenizer fields added): the Jet-Nemotron text model of
    :func:`.hf_tiny_jet_nemotron.jet_nemotron_weights` for ``cfg["text_config"]`` under ``llm.``
    (``llm.model.*``, ``llm.lm_head.weight``), then, drawn from their own seed, the SigLIP tower
    (``vision_tower.<SiglipVisionModel name>``: matrices and the patch kernel ``N(0, 1/fan_in)``,
    position table ``N(0, 0.02)``, LayerNorm weights ``1 + N(0, 0.1)``, biases ``N(0, 0.02)``)
    and the projector (``mm_projector.layers.1`` LayerNorm of ``4 * 1152``, ``.2`` Linear
    ``[hidden, 4 * 1152]``, ``.4`` Linear ``[hidden, hidden]``, with biases)."""
    w = {f"llm.{k}": v for k, v in jet_nemotron_weights(cfg["text_config"], seed, logit_scale).items()}
    d = _Draw(seed + 11)
    for name, shape in sorted(_siglip_shapes(cfg["vision_config"]).items()):
        if name.endswith("position_embedding.weight"):
            t = d.normal(*shape, std=0.02)
        elif len(shape) >= 2:
            t = d.normal(*shape, std=math.prod(shape[1:]) ** -0.5)
        elif name.endswith("bias"):
            t = d.normal(*shape, std=0.02)
        else:  # a LayerNorm's weight
            t = 1.0 + d.normal(*shape, std=0.1)
        w[f"vision_tower.{name}"] = t
    merged, text_h = 4 * MM_HIDDEN_SIZE, cfg["text_config"]["hidden_size"]
    p = "mm_projector.layers"
    w[f"{p}.1.weight"] = 1.0 + d.normal(merged, std=0.1)
    w[f"{p}.1.bias"] = d.normal(merged, std=0.02)
    w[f"{p}.2.weight"] = d.proj(text_h, merged)
    w[f"{p}.2.bias"] = d.normal(text_h, std=0.02)
    w[f"{p}.4.weight"] = d.proj(text_h, text_h)
    w[f"{p}.4.bias"] = d.normal(text_h, std=0.02)
    return w


def write_processor_configs(out_dir: str) -> None:
    """The processor files SGLang's NVILA processor wraps (module docstring):
    ``preprocessor_config.json`` (transformers' ``SiglipImageProcessor``: resize to the tower's
    28x28, rescale, normalize by 0.5 / 0.5 as SigLIP), ``processor_config.json`` naming
    ``SiglipProcessor`` (transformers' ``AutoProcessor`` knows no processor for ``jet_vlm``) and
    :data:`MEDIA_TOKENS` as ``extra_special_tokens`` in ``tokenizer_config.json`` (transformers
    then exposes ``tokenizer.image_token`` / ``tokenizer.video_token``)."""
    from transformers import SiglipImageProcessor

    from sglang_mamba_ext.models.hf_tiny_minicpmv import add_special_tokens_config

    size = VISION["image_size"]
    SiglipImageProcessor(size={"height": size, "width": size}, image_mean=[0.5, 0.5, 0.5],
                         image_std=[0.5, 0.5, 0.5]).save_pretrained(out_dir)
    with open(os.path.join(out_dir, "processor_config.json"), "w", encoding="utf-8") as f:
        json.dump({"processor_class": "SiglipProcessor"}, f, indent=2)
        f.write("\n")
    add_special_tokens_config(out_dir, MEDIA_TOKENS)


def jet_vlm_family(hidden: int, layers: int) -> Dict[str, Dict]:
    """The ``jet_vlm`` entry of :mod:`.hf_tiny`'s family table (SGLang's module ``jet_vlm``):
    ``JetVLMForConditionalGeneration`` with the ``jet_nemotron`` text config (``text_config``, its
    dtype written out) and the tiny SigLIP ``vision_config`` (:data:`VISION`). Keys beyond the
    text family's: ``sub``, ``special_tokens`` (:data:`MEDIA_TOKENS`, ids 766 / 767),
    ``processor`` (:func:`write_processor_configs`)."""
    text = copy.deepcopy(jet_nemotron_families(hidden, layers)["jet_nemotron"]["config"])
    text.update(architectures=["JetNemotronForCausalLM"], torch_dtype="float16", dtype="float16")
    return {"jet_vlm": dict(
        cls="JetVLMForConditionalGeneration", writer=jet_vlm_weights, sub="text_config",
        special_tokens=MEDIA_TOKENS, processor=write_processor_configs,
        config=dict(model_type="jet_vlm", image_token_id=IMAGE_TOKEN_ID, video_token_id=VIDEO_TOKEN_ID,
                    text_config=text, vision_config=dict(VISION)),
    )}
