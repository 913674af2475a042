"""A tiny Kimi-K3 VLM checkpoint (issue 40): SGLang 0.5.23's ``KimiK3ForConditionalGeneration``
(``sglang/srt/models/kimi_k3.py``, config ``KimiK3Config``, ``configs/kimi_k3.py``), served
text-only: the tiny K3 text model of :mod:`.hf_tiny_kimi_k3` (the same config and, for the same
seed, the same tensors, under ``language_model.``) behind a tiny MoonViT3d tower
(``models/kimi_k3_vl.py``: ``KimiK3VisionTower``, one encoder block of width 32, 2 heads) and K3's
patch-merger projector (``KimiK3MultiModalProjector``: two bias-free linears over 2x2 merged
patches, a post RMSNorm). Written by hand: transformers 5.19 has no ``KimiK3*`` class.

What the checkpoint needs beyond the text model (used by :mod:`.hf_tiny`):

- **no top-level ``vocab_size`` / ``hidden_size``**: ``KimiK3Config`` exposes both as properties of
  its text config without setters (``configs/kimi_k3.py``); they are written in ``text_config``
  only;
- **K3's media tokens** (:data:`MEDIA_TOKENS`): SGLang's K3 processor
  (``multimodal/processors/kimi_k3.py``, ``KimiK3ImageProcessor.__init__``) takes
  ``<|media_pad|>`` at ``media_placeholder_token_id`` and frames each image with
  ``<|media_begin|>``, ``<|media_content|>``, ``<|media_end|>``; the tokenizer is trained 4 ids
  short and these take ids 764-767;
- **the media processor's config** (:func:`write_processor_config`): the K3 processor reads
  ``media_proc_cfg`` (patch size, merge kernel, patch limits, mean / std) from the HF processor's
  ``media_processor`` (``multimodal/media_artifacts/kimi_k3.py``,
  ``KimiK3PreprocessConfig.from_media_processor``). The released checkpoint ships that processor
  as remote code; this one ships only ``preprocessor_config.json`` (``media_proc_cfg``, no
  ``auto_map``), from which the plugin builds the processor
  (``plugin/cpu_bridges_kimi_k3_vl.py``, ``k3_processor_around``);
- **a chat template with the image placeholder** (:data:`CHAT_TEMPLATE`): SGLang's start-up
  warmup sends a VLM one image in a chat.

Only torch; deterministic for a seed.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Dict

import torch

from sglang_mamba_ext.models.hf_tiny_kimi_k3 import kimi_k3_family, kimi_k3_weights
from sglang_mamba_ext.models.hf_tiny_written import _Draw

#: K3's media tokens (name -> text), ids 764-767 in this order (``<|media_pad|>`` is the image
#: placeholder, ``media_placeholder_token_id``)
MEDIA_TOKENS = {
    "media_begin": "<|media_begin|>", "media_content": "<|media_content|>", "media_end": "<|media_end|>",
    "media_pad": "<|media_pad|>",
}
#: the placeholder's id (the last of the 768-token vocabulary)
MEDIA_PAD_ID = 767

#: the K3 media processor's config (the keys ``KimiK3PreprocessConfig`` reads), at the tiny
#: tower's patch size and a small image budget
MEDIA_PROC_CFG = {
    "patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 256, "patch_limit_on_one_side": 16,
    "fixed_output_tokens": None, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}

_VISION = dict(
    model_type="kimi_k3_vision", patch_size=14, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=4,
    pos_emb_type="divided_fixed", vt_num_attention_heads=2, vt_num_hidden_layers=1, vt_hidden_size=32,
    vt_intermediate_size=64, qkv_hidden_size=32, merge_kernel_size=[2, 2], video_attn_type="spatial_temporal",
    merge_type="sd2_tpool", mm_projector_type="patchmergerv2", mm_hidden_size=32, projector_hidden_act="gelu",
    projector_ln_eps=1e-5, norm_type="rmsnorm", attn_bias=False, patch_embed_proj_bias=False, mlp_type="mlp2",
    linear_bias=False, activation_func="gelu_pytorch_tanh", pos_emb_interpolation_mode="bilinear",
)


def kimi_k3_vl_weights(cfg: Dict, seed: int, logit_scale: float) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``KimiK3ForConditionalGeneration`` for the config ``cfg``
    (:func:`kimi_k3_vl_family`'s, tokenizer fields added): the K3 text model of
    :func:`.hf_tiny_kimi_k3.kimi_k3_weights` for ``cfg["text_config"]`` under ``language_model.``
    (``language_model.model.*``, ``language_model.lm_head.weight``; SGLang's wrapper strips the
    prefix and hands them to ``KimiK3LinearForCausalLM.load_weights``), then the vision tower
    (``vision_tower.patch_embed.proj`` / ``.pos_emb``, per block ``norm0`` / ``norm1`` RMSNorms,
    ``wqkv``, ``wo``, ``mlp.fc0`` / ``fc1``, ``encoder.final_layernorm``; no biases, as the
    config says) and the projector (``mm_projector.proj.0`` / ``.2``, ``post_norm``), drawn after
    the text model from their own seed."""
    w = {f"language_model.{k}": v for k, v in kimi_k3_weights(cfg["text_config"], seed, logit_scale).items()}
    d = _Draw(seed + 11)
    vc = cfg["vision_config"]
    width, inter, qkv, patch = vc["vt_hidden_size"], vc["vt_intermediate_size"], vc["qkv_hidden_size"], vc["patch_size"]
    t = "vision_tower"
    w[f"{t}.patch_embed.proj.weight"] = d.normal(width, 3, patch, patch, std=(3 * patch * patch) ** -0.5)
    w[f"{t}.patch_embed.pos_emb.weight"] = d.normal(vc["init_pos_emb_height"], vc["init_pos_emb_width"], width, std=0.1)
    for i in range(vc["vt_num_hidden_layers"]):
        b = f"{t}.encoder.blocks.{i}"
        w[f"{b}.norm0.weight"] = 1.0 + d.normal(width, std=0.1)
        w[f"{b}.norm1.weight"] = 1.0 + d.normal(width, std=0.1)
        w[f"{b}.wqkv.weight"] = d.proj(3 * qkv, width)
        w[f"{b}.wo.weight"] = d.proj(width, qkv)
        w[f"{b}.mlp.fc0.weight"] = d.proj(inter, width)
        w[f"{b}.mlp.fc1.weight"] = d.proj(width, inter)
    w[f"{t}.encoder.final_layernorm.weight"] = 1.0 + d.normal(width, std=0.1)
    merged = vc["mm_hidden_size"] * vc["merge_kernel_size"][0] * vc["merge_kernel_size"][1]
    text_h = cfg["text_config"]["hidden_size"]
    w["mm_projector.proj.0.weight"] = d.proj(merged, merged)
    w["mm_projector.proj.2.weight"] = d.proj(text_h, merged)
    w["mm_projector.post_norm.weight"] = 1.0 + d.normal(text_h, std=0.1)
    return w


#: the project's ChatML template (``tiny_builder.CHAT_TEMPLATE``) with K3's image placeholder: a
#: message whose content is a list of parts renders its text parts and one ``<|media_pad|>`` per
#: image part (SGLang renders K3 chats with the tokenizer's template and the parts list,
#: ``entrypoints/openai/serving_chat.py:747-811``, then expands each placeholder to the image's tokens)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}<|media_pad|>{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_processor_config(out_dir: str) -> None:
    """``preprocessor_config.json`` with K3's ``media_proc_cfg`` (:data:`MEDIA_PROC_CFG`), the
    file the released checkpoint's processor reads (no ``auto_map``: no remote code), and the
    chat template with the image placeholder (:data:`CHAT_TEMPLATE`) in ``tokenizer_config.json``:
    the server's start-up warmup sends a VLM an image in a chat (``entrypoints/http_server.py:2393-2450``)."""
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump({"media_proc_cfg": MEDIA_PROC_CFG}, f, indent=2)
        f.write("\n")
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    cfg["chat_template"] = CHAT_TEMPLATE
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")


def kimi_k3_vl_family(hidden: int, layers: int) -> Dict[str, Dict]:
    """The ``kimi_k3_vl`` entry of :mod:`.hf_tiny`'s family table (SGLang's module ``kimi_k3``):
    ``KimiK3ForConditionalGeneration`` with the ``kimi_k3`` text config (``text_config``) and the
    tiny MoonViT3d ``vision_config`` (module docstring). Keys beyond the text family's:
    ``special_tokens`` (:data:`MEDIA_TOKENS`), ``top_level_drop``, ``processor``
    (:func:`write_processor_config`)."""
    text = copy.deepcopy(kimi_k3_family(hidden, layers)["kimi_k3"]["config"])
    text["architectures"] = ["KimiK3LinearForCausalLM"]
    return {"kimi_k3_vl": dict(
        cls="KimiK3ForConditionalGeneration", module="kimi_k3", writer=kimi_k3_vl_weights, sub="text_config",
        special_tokens=MEDIA_TOKENS, top_level_drop=("vocab_size",), processor=write_processor_config,
        config=dict(
            model_type="kimi_k3", media_placeholder_token_id=MEDIA_PAD_ID, image_placeholder="<|kimi_image_placeholder|>",
            text_config=text, vision_config=dict(_VISION, text_hidden_size=hidden),
        ),
    )}
