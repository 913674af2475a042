"""Tiny Nemotron-H Nano VL / Omni checkpoints (issue 40): SGLang 0.5.23's ``nano_nemotron_vl``
module (``srt/models/nano_nemotron_vl.py``) serves ``NemotronH_Nano_VL_V2`` and the omni classes
``NemotronH_Nano_Omni_Reasoning_V3`` / ``NemotronH_Omni_Reasoning_V3``: a Nemotron-H (Mamba2 +
attention) language model (``language_model``, SGLang's ``NemotronHForCausalLM``) behind a RADIO
vision tower (``vision_model``) and a ReLU² projector (``mlp1``), served text-only.

How the checkpoint is made (used by :mod:`.hf_tiny`, family key ``writer``):

- **config without the hub**: the released checkpoints load their config through remote code
  (``auto_map``); SGLang registers its own classes under the same ``model_type``
  (``configs/nano_nemotron_vl.py``, ``utils/hf_transformers/common.py:117-186``, registered with
  ``AutoConfig`` at ``:282-288``), so a ``config.json`` without ``auto_map`` loads with SGLang's
  class and nothing is fetched. The language model's config is ``llm_config`` (Nemotron-H's, as
  :mod:`.hf_tiny_families` has it), the vision tower's ``vision_config`` (RADIO's ``args``).
- **vision tower of ViT-Small size, not tinier**: SGLang's ``RadioConfig`` takes the tower's
  width, depth and heads from the timm model name (``configs/radio.py:25-30``, ``:95``), the
  smallest being ``vit_small_patch16_224`` (384 wide, 12 blocks), and its position table is sized
  by ``max_img_size`` 2048 (``models/radio.py:476-478``; ``create_radio_config`` does not pass
  it, ``configs/nano_nemotron_vl.py:158-177``), 16384 rows. The tower is written in full (about
  28 M parameters, 56 MB in float16): the checkpoint fills every parameter of SGLang's class.
- **language model weights**: transformers' own ``NemotronHForCausalLM`` at the tiny sizes (the
  ``nemotron_h`` family's spread and LM-head scale), saved under ``language_model.`` in the names
  transformers saves (``backbone.*``, as released; SGLang strips the prefix,
  ``nano_nemotron_vl.py:403-406``) and, as transformers saves it, in ``hf_reference/`` beside
  the checkpoint: text-only, SGLang's class runs exactly that model (``general_mm_embed_routine``
  with no multimodal input), so it is the float32 reference.
- **tokenizer**: the processor (``multimodal/processors/nano_nemotron_vl.py``), built at start-up
  for a multimodal class, reads the image / video context tokens and the image start / end tokens
  (``:133-166``) and asserts a string ``unk_token`` (``:197-200``): ``<unk>``, ``<image>``,
  ``<video>``, ``<img>``, ``</img>`` take ids 763-767 (:data:`SPECIAL_TOKENS`; ``unk_token`` named
  in ``tokenizer_config.json``, :func:`write_tokenizer_extras`). transformers' ``AutoProcessor``
  knows no processor for the first two classes' model types and returns the tokenizer, which the
  processor takes (``:133-136``): no processor config is written. ``NemotronH_Omni_Reasoning_V3``'s
  model type ``nemotron_h_omni`` is transformers' own, with a processor (image, video, Parakeet
  audio): :func:`write_omni_processor` writes its configs (librosa needed).

Only torch and transformers.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from typing import Dict

import torch

#: the tokens SGLang's processor reads (attribute -> text), ids 763-767 in this order
SPECIAL_TOKENS = {"unk_token": "<unk>", "image_token": "<image>", "video_token": "<video>",
                  "image_start_token": "<img>", "image_end_token": "</img>"}
#: RADIO's smallest tower SGLang knows (``configs/radio.py:25-30``): width, blocks, heads, MLP width
VIT_NAME, VIT_WIDTH, VIT_BLOCKS, VIT_MLP = "vit_small_patch16_224", 384, 12, 1536
#: rows of RADIO's position table: (max_img_size 2048 / patch 16) ** 2 (``models/radio.py:476-478``)
VIT_POSITIONS = (2048 // 16) ** 2
#: RADIO's register tokens: ``register_multiple`` 8 gives 7 registers beside the CLS token
REGISTER_MULTIPLE = 8
#: where the float32 reference's checkpoint (transformers' NemotronHForCausalLM) is kept
REFERENCE_SUBDIR = "hf_reference"


def nano_nemotron_families(hidden: int) -> Dict[str, Dict]:
    """The family entries of :mod:`.hf_tiny` (``--arch nano_nemotron_vl``: ``NemotronH_Nano_VL_V2``,
    ``--arch nano_nemotron_omni``: ``NemotronH_Nano_Omni_Reasoning_V3``, ``--arch
    nano_nemotron_omni_v3``: ``NemotronH_Omni_Reasoning_V3``; SGLang's module
    ``nano_nemotron_vl``) for a language model of width ``hidden``; their ``llm_config`` is filled
    by :mod:`.hf_tiny_families` (Nemotron-H's). Keys beyond the other families':
    ``special_tokens`` (:data:`SPECIAL_TOKENS`), ``tokenizer_extras`` (:func:`write_tokenizer_extras`),
    ``writes_reference`` (the writer also saves ``hf_reference/``), ``processor``
    (:func:`write_omni_processor`) or ``no_processor``."""
    def entry(cls: str, model_type: str, **omni) -> Dict:
        return dict(
            cls=cls, module="nano_nemotron_vl", sub="llm_config", writer=nano_nemotron_weights,
            hf_cls="NemotronHForCausalLM", writes_reference=True, special_tokens=SPECIAL_TOKENS,
            tokenizer_extras=True,
            config=dict(
                model_type=model_type, llm_config=None,
                vision_config=dict(args=dict(model=VIT_NAME, register_multiple=REGISTER_MULTIPLE),
                                   preferred_resolution=[64, 64], image_size=64, patch_size=16,
                                   **omni.get("vision", {})),
                **omni.get("top", {}),
                force_image_size=64, patch_size=16, downsample_ratio=0.5, ps_version="v2",
                vit_hidden_size=VIT_WIDTH, projector_hidden_size=hidden, use_thumbnail=True,
                img_context_token="<image>", video_context_token="<video>", img_start_token="<img>",
                img_end_token="</img>",
            ),
        )

    # nemotron_h_omni is also transformers' own model type (models/nemotron_h_omni, 5.19), whose
    # config class AutoConfig resolves first and validates (SGLang's registration loses to it, and
    # get_config then re-reads the file with SGLang's class, utils/hf_transformers/config.py:281-294):
    # its RADIO fields at the ViT-Small sizes too (one CLS token and 7 registers, as SGLang's
    # register_multiple 8 gives) and the video patch depth, equal in both places (transformers
    # refuses them unequal; SGLang then builds RADIO's video embedder, written too)
    radio_hf = dict(hidden_size=VIT_WIDTH, num_hidden_layers=VIT_BLOCKS, num_attention_heads=VIT_WIDTH // 64,
                    num_cls_tokens=1, num_registers=REGISTER_MULTIPLE - 1, video_temporal_patch_size=2)
    omni = dict(vision=radio_hf, top=dict(video_temporal_patch_size=2))
    # AutoProcessor knows no processor for the first two model types and returns the tokenizer
    # (no processor config written); nemotron_h_omni has transformers' own (write_omni_processor)
    return {"nano_nemotron_vl": dict(entry("NemotronH_Nano_VL_V2", "NemotronH_Nano_VL_V2"), no_processor=True),
            "nano_nemotron_omni": dict(entry("NemotronH_Nano_Omni_Reasoning_V3", "NemotronH_Nano_Omni_Reasoning_V3",
                                             **omni), no_processor=True),
            "nano_nemotron_omni_v3": dict(entry("NemotronH_Omni_Reasoning_V3", "nemotron_h_omni", **omni),
                                          processor=write_omni_processor)}


def _language_model(llm: Dict, seed: int):
    """transformers' ``NemotronHForCausalLM`` for the ``llm_config`` fields ``llm``, float32, with
    the ``nemotron_h`` family's weights (:func:`.hf_tiny._spread_weights`, LM head scaled)."""
    import transformers

    from sglang_mamba_ext.models import hf_tiny

    config = transformers.NemotronHConfig(**{k: v for k, v in llm.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = transformers.NemotronHForCausalLM(config).float().eval()
    hf_tiny._spread_weights(model, seed)
    hf_tiny._scale_lm_head(model)
    return model


def _radio_tower(w: Dict[str, torch.Tensor], gen: torch.Generator, prefix: str, patch: int,
                 video_frames: int = 1) -> None:
    """RADIO's ViT-Small in SGLang's own checkpoint names (``radio_model.model.*``, read by
    ``RadioModel.load_weights``, ``models/radio.py:607-655``): the patch embedder (no bias), the
    position table, the CLS + register tokens, the video embedder where ``video_frames`` > 1,
    :data:`VIT_BLOCKS` InternViT blocks (fused ``qkv``
    with a bias, layer norms, layer scales ``ls1`` / ``ls2``, ``fc1`` / ``fc2``)."""
    d, mlp = VIT_WIDTH, VIT_MLP

    def proj(out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=gen) / math.sqrt(inp)

    p = f"{prefix}.radio_model.model"
    w[f"{p}.patch_generator.embedder.weight"] = proj(d, 3 * patch * patch)
    w[f"{p}.patch_generator.pos_embed"] = torch.randn(1, VIT_POSITIONS, d, generator=gen) * 0.02
    w[f"{p}.patch_generator.cls_token.token"] = torch.randn(REGISTER_MULTIPLE, d, generator=gen) * 0.02
    if video_frames > 1:  # the video embedder over video_frames stacked frames (models/radio.py:221-227)
        w[f"{p}.patch_generator.video_embedder.weight"] = proj(d, 3 * video_frames * patch * patch)
    for b in range(VIT_BLOCKS):
        q = f"{p}.blocks.{b}"
        for norm in ("norm1", "norm2"):
            w[f"{q}.{norm}.weight"] = torch.ones(d)
            w[f"{q}.{norm}.bias"] = torch.zeros(d)
        w[f"{q}.ls1"] = torch.full((d,), 0.1)
        w[f"{q}.ls2"] = torch.full((d,), 0.1)
        for name, (o, i) in (("attn.qkv", (3 * d, d)), ("attn.proj", (d, d)), ("mlp.fc1", (mlp, d)),
                             ("mlp.fc2", (d, mlp))):
            w[f"{q}.{name}.weight"] = proj(o, i)
            w[f"{q}.{name}.bias"] = torch.zeros(o)


def nano_nemotron_weights(cfg: Dict, seed: int, logit_scale: float, out_dir: str) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``NemotronH_Nano_VL_V2`` / ``NemotronH_Omni_Reasoning_V3``
    for the config fields ``cfg``: transformers' Nemotron-H under ``language_model.`` (also saved,
    float16, to ``out_dir/hf_reference`` for the float32 reference), the RADIO tower under
    ``vision_model.`` (:func:`_radio_tower`) and the projector ``mlp1`` (RMSNorm over the
    pixel-shuffled width, two linears). ``logit_scale`` is the LM head's, applied by
    :func:`.hf_tiny._scale_lm_head` on transformers' model."""
    del logit_scale  # the LM head is scaled on transformers' model (hf_tiny.LOGIT_STD)
    llm = cfg["llm_config"]
    model = _language_model(llm, seed)
    ref_dir = os.path.join(out_dir, REFERENCE_SUBDIR)
    model.half().save_pretrained(ref_dir, safe_serialization=True)
    # the names as transformers saves them (backbone.*, the released checkpoints' language_model.backbone.*)
    from safetensors.torch import load_file

    w: Dict[str, torch.Tensor] = {f"language_model.{k}": v.float()
                                  for k, v in load_file(os.path.join(ref_dir, "model.safetensors")).items()}
    gen = torch.Generator().manual_seed(seed + 11)
    _radio_tower(w, gen, "vision_model", cfg["patch_size"], cfg["vision_config"].get("video_temporal_patch_size", 1))
    merged = cfg["vit_hidden_size"] * int(round(1 / cfg["downsample_ratio"])) ** 2
    proj_h, h = cfg["projector_hidden_size"], llm["hidden_size"]
    w["mlp1.0.weight"] = torch.ones(merged)
    w["mlp1.1.weight"] = torch.randn(proj_h, merged, generator=gen) / math.sqrt(merged)
    w["mlp1.3.weight"] = torch.randn(h, proj_h, generator=gen) / math.sqrt(proj_h)
    return w


def write_omni_processor(out_dir: str) -> None:
    """Write transformers' ``NemotronH_Omni_Reasoning_V3Processor`` (image and video processors at
    the checkpoint's patch size and merge ratio, Parakeet's audio feature extractor, the tokenizer)
    to ``out_dir`` (``processor_config.json``). ``nemotron_h_omni`` is transformers' own model
    type, so SGLang's ``get_processor`` (``utils/hf_transformers/processor.py:245``,
    ``AutoProcessor`` at ``:340``) loads that processor at start-up even for text-only serving, and
    fails without these configs ("Can't load image processor"); SGLang's own processor then uses
    only its tokenizer (``multimodal/processors/nano_nemotron_vl.py:133-136``).

    Raises ``RuntimeError`` naming ``pip install librosa`` when librosa is missing (Parakeet's
    feature extractor needs it, here and at the server's start-up)."""
    import transformers
    from transformers.models.nemotron_h_omni import (image_processing_nemotron_h_omni as image,
                                                     processing_nemotron_h_omni as processing,
                                                     video_processing_nemotron_h_omni as video)

    with open(os.path.join(out_dir, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    sizes = dict(patch_size=cfg["patch_size"], downsample_ratio=cfg["downsample_ratio"])
    try:
        extractor = transformers.ParakeetFeatureExtractor()
    except ImportError as e:
        raise RuntimeError(f"--arch nano_nemotron_omni_v3 needs librosa (transformers' Parakeet feature "
                           f"extractor, loaded by SGLang at start-up too): pip install librosa ({e})") from None
    processor = processing.NemotronH_Omni_Reasoning_V3Processor(
        image_processor=image.NemotronH_Omni_Reasoning_V3ImageProcessor(**sizes),
        video_processor=video.NemotronH_Omni_Reasoning_V3VideoProcessor(**sizes),
        tokenizer=transformers.AutoTokenizer.from_pretrained(out_dir), feature_extractor=extractor)
    # only processor_config.json is new: saving the processor in place would re-save the tokenizer
    # with its chat template moved out of tokenizer_config.json
    with tempfile.TemporaryDirectory() as tmp:
        processor.save_pretrained(tmp)
        shutil.copy(os.path.join(tmp, "processor_config.json"), out_dir)


def write_tokenizer_extras(out_dir: str, tokens: Dict[str, str]) -> None:
    """Name the ``unk_token`` of ``tokens`` in ``out_dir``'s ``tokenizer_config.json`` and
    ``special_tokens_map.json`` (SGLang's processor asserts a string ``unk_token``,
    ``multimodal/processors/nano_nemotron_vl.py:197-200``; the project's tokenizer has none)."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        path = os.path.join(out_dir, name)
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        cfg["unk_token"] = tokens["unk_token"]
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, sort_keys=True, ensure_ascii=False)
            f.write("\n")
