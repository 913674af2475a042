"""scripts/make_tiny_model.py --arch: tiny checkpoints of SGLang's own hybrid families
(issue 24, item 1; sglang_mamba_ext/models/hf_tiny.py). No server: the checks are on the files
and on transformers' float32 reference."""

import json
import os
import subprocess
import sys
import tempfile
import unittest

from safetensors import safe_open
import torch

from conftest import tiny_arch
from sglang_mamba_ext.testing.server import free_port
from sglang_mamba_ext.models.hf_tiny import ARCHS, MARKER_KEY, reference_greedy

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "make_tiny_model.py")

# Per family: the SGLang architecture, and one weight name only that family's released format has
# (the one SGLang's loader for the class reads), with its shape at the tiny sizes.
EXPECTED = {
    "qwen3_next": ("Qwen3NextForCausalLM", "model.layers.0.linear_attn.in_proj_qkvz.weight", (192, 64)),
    "kimi_linear": ("KimiLinearForCausalLM", "model.layers.0.block_sparse_moe.experts.3.w1.weight", (32, 64)),
    "nemotron_h": ("NemotronHForCausalLM", "backbone.layers.0.mixer.in_proj.weight", (196, 64)),
    "falcon_h1": ("FalconH1ForCausalLM", "model.layers.0.mamba.in_proj.weight", (196, 64)),
    "granitemoehybrid": ("GraniteMoeHybridForCausalLM", "model.layers.0.block_sparse_moe.input_linear.weight",
                         (4, 64, 64)),
    "lfm2": ("Lfm2ForCausalLM", "model.layers.0.conv.in_proj.weight", (192, 64)),
    "qwen3_5_text": ("Qwen3_5ForCausalLM", "model.layers.0.linear_attn.in_proj_qkv.weight", (128, 64)),
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", "model.layers.0.mlp.shared_expert_gate.weight", (1, 64)),
    "lfm2_moe": ("Lfm2MoeForCausalLM", "model.layers.1.feed_forward.expert_bias", (4,)),
    "mamba2": ("Mamba2ForCausalLM", "backbone.layers.0.mixer.in_proj.weight", (164, 64)),
    # the VLMs: the text model under model.language_model, the tiny vision tower beside it
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "model.visual.merger.linear_fc2.weight", (64, 128)),
    "qwen3_5_moe": ("Qwen3_5MoeForConditionalGeneration",
                    "model.language_model.layers.0.mlp.shared_expert_gate.weight", (1, 64)),
    "lfm2_vl": ("Lfm2VlForConditionalGeneration", "model.multi_modal_projector.linear_2.weight", (64, 64)),
    # written by hand (transformers has no GigaChat class): Qwen3-Next's GDN under self_attn
    "gigachat35": ("GigaChat35ForCausalLM", "model.layers.0.self_attn.in_proj_qkvz.weight", (192, 64)),
    # written by hand: Kimi-Linear's KDA names under attention (SGLang's BailingKDA)
    "bailing_moe_v3": ("BailingMoeV3ForCausalLM", "model.layers.0.attention.f_b_proj.weight", (64, 16)),
    # written by hand: Ling 2.5's lightning layers under attention (2 heads of 128: q, k, v rows)
    "bailing_moe_linear": ("BailingMoeV2_5ForCausalLM", "model.layers.0.attention.query_key_value.weight", (768, 64)),
    # written by hand: MiniCPM-SALA's lightning layer (2 heads of 128) and its output gate
    "minicpm": ("MiniCPMSALAForCausalLM", "model.layers.0.self_attn.z_proj.weight", (256, 64)),
    # written by hand: Ling-V3's text model behind Qwen3-VL's vision tower
    "bailing_mm_v3": ("BailingMoeV3VLForConditionalGeneration", "linear_proj.2.weight", (64, 64)),
    # the routed experts once per bank, fused as SGLang's strict Mobius loader reads them
    "interns2_mobius": ("InternS2MobiusForConditionalGeneration",
                        "model.language_model.meta_mlp.1.experts.gate_up_proj", (4, 64, 64)),
    # transformers' Qwen3.5 MoE VLM weights under SGLang's Intern-S2-Preview class
    "interns2preview": ("InternS2PreviewForConditionalGeneration",
                        "model.language_model.layers.1.mlp.shared_expert_gate.weight", (1, 64)),
    # Nemotron-H's weights (transformers has no Puzzle class), its MoE block last
    "nemotron_h_puzzle": ("NemotronHPuzzleForCausalLM", "backbone.layers.3.mixer.gate.weight", (4, 64)),
}

# The layer kinds each family must mix (keys of its config.json in the released format).
LINEAR_AND_FULL = {
    "qwen3_next": lambda c: set(c["layer_types"]) == {"linear_attention", "full_attention"},
    "kimi_linear": lambda c: c["linear_attn_config"]["kda_layers"] == [1, 3]
    and c["linear_attn_config"]["full_attn_layers"] == [2, 4],
    "nemotron_h": lambda c: c["hybrid_override_pattern"] == "M*M-" and "layers_block_type" not in c
    and c["mamba_n_groups"] == c["n_groups"] == 2,
    "falcon_h1": lambda c: c["mamba_n_heads"] == 4 and c["num_attention_heads"] == 4,  # both in every layer
    "granitemoehybrid": lambda c: set(c["layer_types"]) == {"mamba", "attention"},
    "lfm2": lambda c: set(c["layer_types"]) == {"conv", "full_attention"},
    # SGLang places the full-attention layers by full_attention_interval, transformers by layer_types.
    "qwen3_5_text": lambda c: c["layer_types"] == ["linear_attention", "full_attention"] * 2
    and c["full_attention_interval"] == 2,
    "qwen3_5_moe_text": lambda c: c["layer_types"] == ["linear_attention", "full_attention"] * 2
    and c["full_attention_interval"] == 2 and c["num_experts"] == 4,
    "lfm2_moe": lambda c: set(c["layer_types"]) == {"conv", "full_attention"} and c["num_dense_layers"] == 1,
    # no attention layer at all: every layer a Mamba2 mixer
    "mamba2": lambda c: c["num_heads"] * c["head_dim"] == c["intermediate_size"] and "layer_types" not in c,
    # a VLM: its text model's layer kinds in text_config, with the tokenizer's vocabulary there too
    "qwen3_5": lambda c: c["text_config"]["layer_types"] == ["linear_attention", "full_attention"] * 2
    and c["text_config"]["vocab_size"] == 768 and c["vision_config"]["depth"] == 1,
    "qwen3_5_moe": lambda c: c["text_config"]["layer_types"] == ["linear_attention", "full_attention"] * 2
    and c["text_config"]["num_experts"] == 4 and c["text_config"]["model_type"] == "qwen3_5_moe_text",
    "lfm2_vl": lambda c: set(c["text_config"]["layer_types"]) == {"conv", "full_attention"}
    and c["text_config"]["vocab_size"] == 768 and c["vision_config"]["num_hidden_layers"] == 1,
}

LINEAR_AND_FULL["interns2preview"] = lambda c: c["text_config"]["layer_types"] == [
    "linear_attention", "full_attention"] * 2 and c["text_config"]["num_experts"] == 4 and c["vision_config"]["depth"] == 1
LINEAR_AND_FULL["gigachat35"] = lambda c: c["layer_types"] == ["linear_attention", "attention"] * 2 and c[
    "first_k_dense_replace"] == 1 and c["q_lora_rank"] == 32
LINEAR_AND_FULL["bailing_moe_v3"] = lambda c: c["layer_group_size"] == 2 and c["short_conv_kernel_size"] == 4 and c[
    "full_attention_type"] == "mla"
LINEAR_AND_FULL["interns2_mobius"] = lambda c: c["text_config"]["layer_types"] == [
    "linear_attention", "full_attention"] * 2 and c["text_config"]["num_blocks"] == 2 and c["text_config"][
    "dtype"] == "float16"
LINEAR_AND_FULL["bailing_mm_v3"] = lambda c: c["text_config"]["layer_group_size"] == 2 and c["text_config"][
    "vocab_size"] == 768 and c["vision_config"]["depth"] == 1
LINEAR_AND_FULL["nemotron_h_puzzle"] = lambda c: c["hybrid_override_pattern"] == "M*ME" and [
    b["block_type"] for b in c["block_configs"]] == ["mamba", "attention", "mamba", "moe"] and "layers_block_type" not in c

# The VLMs' processor configs, which SGLang's tokenizer manager loads at start-up.
VLM_PROCESSOR_FILES = {"qwen3_5": ("preprocessor_config.json", "video_preprocessor_config.json"),
                       "qwen3_5_moe": ("preprocessor_config.json", "video_preprocessor_config.json"),
                       "lfm2_vl": ("preprocessor_config.json",),
                       # a model_type transformers does not know: the processor class named
                       "interns2preview": ("preprocessor_config.json", "video_preprocessor_config.json",
                                           "processor_config.json"),
                       "bailing_mm_v3": ("preprocessor_config.json", "processor_config.json"),
                       "interns2_mobius": ("preprocessor_config.json", "video_preprocessor_config.json",
                                           "processor_config.json", "hf_reference/model.safetensors")}
#: The config.json model_type where it is not the --arch name (SGLang's config class's).
MODEL_TYPE = {"interns2preview": "intern_s2_preview", "interns2_mobius": "interns2_mobius",
              "gigachat35": "gigachat3_5", "bailing_moe_v3": "bailing_hybrid", "bailing_mm_v3": "bailing_moe_v3_vl"}
#: Families whose weights are written by hand (``hf_tiny_written``) or renamed from transformers'
#: layout (Intern-S2-Mobius's banks): SGLang's class must fill every parameter from the file
#: (``testing/model_load.py``; Mobius's own loader also refuses missing or unexpected names).
WRITTEN = ("gigachat35", "bailing_moe_v3", "interns2_mobius", "bailing_mm_v3")

# Ling 2.5 (issue 40): written by hand; BailingHybridConfig without a short conv (lightning layers)
LINEAR_AND_FULL["bailing_moe_linear"] = lambda c: c["layer_group_size"] == 2 and "short_conv_kernel_size" not in c and c[
    "head_dim"] == 128 and c["full_attention_type"] == "mla"
MODEL_TYPE["bailing_moe_linear"] = "bailing_hybrid"
WRITTEN = WRITTEN + ("bailing_moe_linear",)
# MiniCPM-SALA (issue 40): written by hand; lightning and dense GQA layers alternating
LINEAR_AND_FULL["minicpm"] = lambda c: c["mixer_types"] == ["lightning-attn", "minicpm4"] and c[
    "lightning_head_dim"] == 128 and "sparse_config" not in c
MODEL_TYPE["minicpm"] = "minicpm_sala"
WRITTEN = WRITTEN + ("minicpm",)
# MiniCPMForCausalLM (issue 40): MiniCPM-SALA's alias class, the same config and weights (its own
# load is checked end to end by TestMiniCPMCausalServing, opt-in)
EXPECTED["minicpm_causal"] = ("MiniCPMForCausalLM",) + EXPECTED["minicpm"][1:]
LINEAR_AND_FULL["minicpm_causal"] = LINEAR_AND_FULL["minicpm"]
MODEL_TYPE["minicpm_causal"] = "minicpm_sala"
# Mamba1 (issue 40): no attention layer, every layer a selective-scan mixer (x_proj: dt rank 4 +
# B, C of 16 each); Falcon-Mamba with its B / C / dt RMSNorm epsilon, Mamba without it
EXPECTED["falcon_mamba"] = ("FalconMambaForCausalLM", "backbone.layers.0.mixer.x_proj.weight", (36, 128))
EXPECTED["mamba"] = ("MambaForCausalLM", "backbone.layers.0.mixer.A_log", (128, 16))
LINEAR_AND_FULL["falcon_mamba"] = lambda c: c["intermediate_size"] == 128 and c["time_step_rank"] == 4 and c[
    "mixer_rms_eps"] == 1e-6 and "layer_types" not in c and "num_attention_heads" not in c
LINEAR_AND_FULL["mamba"] = lambda c: c["intermediate_size"] == 128 and c["time_step_rank"] == 4 and (
    "mixer_rms_eps" not in c) and "layer_types" not in c and "num_attention_heads" not in c
# Kimi-K3's text class (issue 40): written by hand, Kimi-Linear's config format with K3's fields
# (full-rank KDA gate, latent MoE, attention residuals)
EXPECTED["kimi_k3"] = ("KimiK3LinearForCausalLM", "model.layers.1.mlp.routed_expert_down_proj.weight", (32, 64))
LINEAR_AND_FULL["kimi_k3"] = lambda c: c["linear_attn_config"]["kda_layers"] == [1, 3] and c["linear_attn_config"][
    "full_attn_layers"] == [2, 4] and c["linear_attn_config"]["use_full_rank_gate"] and c["attn_res_block_size"] == 2 \
    and c["linear_attn_config"]["gate_lower_bound"] == -5.0  # the safe gate, as the released checkpoint
MODEL_TYPE["kimi_k3"] = "kimi_linear"
WRITTEN = WRITTEN + ("kimi_k3",)
# MiniCPM-V 4.6 / 4.7 (issue 40, hf_tiny_minicpmv): Qwen3.5's dense text model behind a one-layer
# vision tower; vocab_size in text_config only (SGLang's config has it as a read-only property),
# the processor's eight special tokens at ids 760-767
for _v, _mt in (("minicpmv", "minicpmv4_6"), ("minicpmv4_7", "minicpmv4_7")):
    EXPECTED[_v] = (f"MiniCPMV{_mt[8:]}ForConditionalGeneration", "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
                    (128, 64))
    LINEAR_AND_FULL[_v] = lambda c: c["text_config"]["layer_types"] == ["linear_attention", "full_attention"] * 2 \
        and "vocab_size" not in c and c["vision_config"]["num_hidden_layers"] == 1
    MODEL_TYPE[_v] = _mt
    VLM_PROCESSOR_FILES[_v] = ("preprocessor_config.json", "video_preprocessor_config.json")
TEXT_VOCAB_ONLY = ("minicpmv", "minicpmv4_7")
# ZAYA1 (issue 40, hf_tiny_zaya): written by hand in the ZAYA1-base names; CCA attention on even
# layers (conv_qk's grouped second stage: head_dim input channels per output), MoE on odd layers
EXPECTED["zaya"] = ("ZayaForCausalLM", "model.layers.0.self_attn.qkv.conv_qk.1.weight", (96, 16, 2))
LINEAR_AND_FULL["zaya"] = lambda c: c["num_hidden_layers"] == 4 and "zaya_layers" not in c and c["cca"] and (
    c["cca_time0"], c["cca_time1"]) == (2, 2) and c["num_query_groups"] == c["num_key_value_heads"] == 2
WRITTEN = WRITTEN + ("zaya",)
# Nemotron-H Nano VL / Omni (issue 40, hf_tiny_nano_nemotron_vl): Nemotron-H's text model under
# language_model (llm_config), a RADIO tower of ViT-Small size (SGLang's RadioConfig knows no
# smaller one: configs/radio.py:25-30) and the projector; the omni class with RADIO's video embedder
EXPECTED["nano_nemotron_vl"] = ("NemotronH_Nano_VL_V2", "language_model.backbone.layers.0.mixer.in_proj.weight", (196, 64))
for _v, _c in (("nano_nemotron_omni", "NemotronH_Nano_Omni_Reasoning_V3"), ("nano_nemotron_omni_v3",
                                                                           "NemotronH_Omni_Reasoning_V3")):
    EXPECTED[_v] = (_c, "vision_model.radio_model.model.patch_generator.video_embedder.weight", (384, 1536))
for _v, _mt in (("nano_nemotron_vl", "NemotronH_Nano_VL_V2"), ("nano_nemotron_omni", "NemotronH_Nano_Omni_Reasoning_V3"),
                ("nano_nemotron_omni_v3", "nemotron_h_omni")):
    LINEAR_AND_FULL[_v] = lambda c: c["llm_config"]["hybrid_override_pattern"] == "M*M-" and c["llm_config"][
        "vocab_size"] == 768 and c["vision_config"]["args"]["model"] == "vit_small_patch16_224"
    MODEL_TYPE[_v] = _mt
    VLM_PROCESSOR_FILES[_v] = ("hf_reference/model.safetensors",)  # transformers' NemotronHForCausalLM
    WRITTEN = WRITTEN + (_v,)
# nemotron_h_omni is transformers' own model type: its processor (image, video, Parakeet audio),
# which SGLang's start-up loads through AutoProcessor, written beside the checkpoint
VLM_PROCESSOR_FILES["nano_nemotron_omni_v3"] += ("processor_config.json",)
#: the LM head's name where it is not lm_head.weight, and checkpoints over 1 MB (the RADIO tower:
#: 28 M parameters at ViT-Small, the smallest SGLang's RadioConfig builds)
LM_HEAD = {_v: "language_model.lm_head.weight" for _v in ("nano_nemotron_vl", "nano_nemotron_omni", "nano_nemotron_omni_v3")}
MAX_BYTES = {_v: 60 << 20 for _v in LM_HEAD}
# Qwen4-Exp (issue 40, hf_tiny_qwen4_exp): transformers' class (its QSA indexer dropped from the served
# files), bfloat16 (SGLang's hyper-connection and n-gram weights are bfloat16 whatever the model's dtype),
# each n-gram table as SGLang's one-shard name; transformers' own files in hf_reference/
EXPECTED["qwen4_exp"] = ("Qwen4ExpForConditionalGeneration",
                         "model.language_model.layers.0.ple.ple_embedding.ngram_embedding.shard_0.weight", (512, 16))
LINEAR_AND_FULL["qwen4_exp"] = lambda c: c["text_config"]["layer_types"] == ["linear_attention", "full_attention"] * 2 \
    and c["text_config"]["ple_layer_ids"] == [1, 3] and not any(k.startswith("indexer_") for k in c["text_config"])
VLM_PROCESSOR_FILES["qwen4_exp"] = ("preprocessor_config.json", "video_preprocessor_config.json",
                                    "hf_reference/model.safetensors")
WRITTEN = WRITTEN + ("qwen4_exp",)
#: checkpoints not in float16
DTYPE = {"qwen4_exp": "bfloat16"}
# Jet-Nemotron (issue 40, hf_tiny_jet_nemotron): written by hand; Qwen2's stack with JetBlocks (the
# dynamic conv's kernel generator w1 / w2) on even layers, GQA attention with q / k / v biases on odd
EXPECTED["jet_nemotron"] = ("JetNemotronForCausalLM",
                            "model.layers.0.self_attn.dynamic_conv1d.kernel_generator.w2.weight", (256, 8))
LINEAR_AND_FULL["jet_nemotron"] = lambda c: c["layer_types"] == ["jet", "attn"] * 2 and c[
    "efficient_attention_config"]["jet"]["conv_size"] == 4 and "swa" not in c["efficient_attention_config"]
WRITTEN = WRITTEN + ("jet_nemotron",)

# Inkling (issue 40, hf_tiny_inkling): written by hand; InklingMMConfig with the text model under
# text_config (vocab_size there only: the MM config's is a read-only property), use_sconv on (four
# convs per layer), no sliding-window layer, dense MLPs, no towers
EXPECTED["inkling"] = ("InklingForConditionalGeneration", "llm.layers.0.attn.k_sconv.weight", (32, 1, 4))
LINEAR_AND_FULL["inkling"] = lambda c: c["text_config"]["use_sconv"] and c["text_config"]["local_layer_ids"] == [] \
    and c["text_config"]["dense_mlp_idx"] == c["text_config"]["num_hidden_layers"] == 2 and "vocab_size" not in c
MODEL_TYPE["inkling"] = "inkling_mm_model"
WRITTEN = WRITTEN + ("inkling",)
INKLING_LM_HEAD = "llm.lm_head.weight"

# Kimi-K3's VLM (issue 40, hf_tiny_kimi_k3_vl): the kimi_k3 text model under language_model. behind
# a one-block MoonViT3d tower; vocab_size in text_config only (KimiK3Config's read-only property),
# K3's media tokens at ids 764-767 (<|media_pad|>: media_placeholder_token_id 767)
EXPECTED["kimi_k3_vl"] = ("KimiK3ForConditionalGeneration", "vision_tower.encoder.blocks.0.wqkv.weight", (96, 32))
LINEAR_AND_FULL["kimi_k3_vl"] = lambda c: LINEAR_AND_FULL["kimi_k3"](c["text_config"]) and "vocab_size" not in c \
    and c["vision_config"]["vt_num_hidden_layers"] == 1 and c["media_placeholder_token_id"] == 767
MODEL_TYPE["kimi_k3_vl"] = "kimi_k3"
VLM_PROCESSOR_FILES["kimi_k3_vl"] = ("preprocessor_config.json",)
TEXT_VOCAB_ONLY = TEXT_VOCAB_ONLY + ("kimi_k3_vl",)
WRITTEN = WRITTEN + ("kimi_k3_vl",)
LM_HEAD = {**globals().get("LM_HEAD", {}), "kimi_k3_vl": "language_model.lm_head.weight"}

# Jet-Nemotron's VLM (issue 40, hf_tiny_jet_vlm): the jet_nemotron text model under llm. behind a
# one-layer SigLIP tower 1152 wide (SGLang's projector takes 4 x MM_HIDDEN_SIZE = 4608 features,
# models/jet_vlm.py:28) and NVILA's projector; <image> / <vila/video> at ids 766 / 767; transformers'
# SiglipProcessor named for SGLang's NVILA processor to wrap
EXPECTED["jet_vlm"] = ("JetVLMForConditionalGeneration", "mm_projector.layers.2.weight", (64, 4608))
LINEAR_AND_FULL["jet_vlm"] = lambda c: LINEAR_AND_FULL["jet_nemotron"](c["text_config"]) and c["vision_config"][
    "hidden_size"] == 1152 and c["vision_config"]["num_hidden_layers"] == 1 and not c["vision_config"][
    "vision_use_head"] and (c["image_token_id"], c["video_token_id"]) == (766, 767)
VLM_PROCESSOR_FILES["jet_vlm"] = ("preprocessor_config.json", "processor_config.json")
WRITTEN = WRITTEN + ("jet_vlm",)
LM_HEAD["jet_vlm"] = "llm.lm_head.weight"
MAX_BYTES["jet_vlm"] = 14 << 20  # the 1152-wide tower: 6.3 M parameters, 13.5 MB in float16

# GLM-5-Next (issue 40, hf_tiny_glm5_next): written by hand in the released names (model.language_model.,
# model.visual.); KDA layers 0 and 2 (0-based) with GLM's low-rank f / g gates and the safe gate, DSA
# layers 1 and 3 (NoPE MLA with a query LoRA, an indexer) whose index_topk covers every position
# (served as dense MLA on CPU, plugin/cpu_bridges_glm5_next.py), mHC of 4 streams; GLM's media tokens
# at ids 762-767; the same layout in transformers' layer_types / mlp_layer_types (its reference model reads
# those, not linear_attn_config / first_k_dense_replace)
EXPECTED["glm5_next"] = ("Glm5NextForConditionalGeneration", "model.language_model.layers.0.self_attn.g_b_proj.weight",
                         (64, 16))
LINEAR_AND_FULL["glm5_next"] = lambda c: c["text_config"]["linear_attn_config"]["kda_layers"] == [0, 2] and c[
    "text_config"]["linear_attn_config"]["full_attn_layers"] == [1, 3] and c["text_config"]["linear_attn_config"][
    "gate_lower_bound"] == -5.0 and c["text_config"]["index_topk"] == c["text_config"]["max_position_embeddings"] == 4096 \
    and c["text_config"]["qk_rope_head_dim"] == 0 and c["text_config"]["mhc"] and c["text_config"]["hc_mult"] == 4 \
    and c["vision_config"]["depth"] == 1 and c["image_token_id"] == 762 \
    and c["text_config"]["layer_types"] == ["linear_attention", "full_attention"] * 2 \
    and c["text_config"]["mlp_layer_types"] == ["dense"] * c["text_config"]["first_k_dense_replace"] + ["sparse"] * 3
VLM_PROCESSOR_FILES["glm5_next"] = ("preprocessor_config.json", "video_preprocessor_config.json")
WRITTEN = WRITTEN + ("glm5_next",)

#: Families whose served class is opt-in (``SGLANG_MAMBA_EXT_ALL_FAMILIES=1``, the suite's budget):
#: their written-weights load check is opt-in with it (their opt-in served classes load them too)
OPT_IN_LOADS = ("zaya", "nano_nemotron_vl", "nano_nemotron_omni", "nano_nemotron_omni_v3", "qwen4_exp", "jet_nemotron",
                "inkling", "kimi_k3_vl", "jet_vlm", "glm5_next")
ALL_FAMILIES = os.environ.get("SGLANG_MAMBA_EXT_ALL_FAMILIES") == "1"

# SGLang's config loader on every checkpoint (a subprocess: SGLang imported, no server): the
# config class it picks, the model class name, and its hybrid-GDN / Mamba-like classification
# (configs/hybrid_arch.py), as the server would see them at start-up.
_SGLANG_CONFIG_PROBE = r"""
import contextlib, json, sys, types
from unittest import mock
from sglang.srt.configs import hybrid_arch
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.utils.hf_transformers import get_config
out = {}
for arch, path in json.loads(sys.argv[1]).items():
    cfg = get_config(path, trust_remote_code=False)
    mc = ModelConfig(path)
    gdn = hybrid_arch.hybrid_gdn_config(mc)
    with contextlib.ExitStack() as stack:
        if cfg.model_type == "inkling_mm_model":
            # Inkling's conv-state shapes read the server's --enable-scattered-sconv from the runtime
            # context (configs/inkling.py:234), which a bare config load has not published: its default
            stack.enter_context(mock.patch("sglang.srt.configs.inkling.get_exec", lambda: types.SimpleNamespace(
                comm=types.SimpleNamespace(enable_scattered_sconv=False))))
        mambaish = hybrid_arch.mambaish_config(mc) is not None
    out[arch] = dict(config_class=type(cfg).__name__, architectures=cfg.architectures,
                     mambaish=mambaish, gdn=gdn is not None,
                     linear=list(gdn.linear_layer_ids) if gdn is not None else None,
                     full=list(gdn.full_attention_layer_ids) if gdn is not None else None,
                     rotary=getattr(cfg, "partial_rotary_factor", None), theta=getattr(cfg, "rope_theta", None))
print(json.dumps(out))
"""


class TestMakeTinyArch(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        # built once per test run in one subprocess, shared with the e2e family classes
        # (conftest.tiny_arch calls build_hf_tiny_models for every arch of ARCHS)
        cls.dirs = {arch: tiny_arch(arch) for arch in ARCHS}

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def _config(self, arch):
        with open(os.path.join(self.dirs[arch], "config.json")) as f:
            return json.load(f)

    def test_config_marker_dtype_tokenizer(self):
        for arch in ARCHS:
            with self.subTest(arch=arch):
                cfg = self._config(arch)
                self.assertEqual(cfg[MARKER_KEY], arch)
                self.assertEqual(cfg["model_type"], MODEL_TYPE.get(arch, arch))
                self.assertEqual(cfg["architectures"], [EXPECTED[arch][0]])
                self.assertEqual(cfg["torch_dtype"], DTYPE.get(arch, "float16"))
                self.assertEqual((cfg["text_config"] if arch in TEXT_VOCAB_ONLY + ("inkling",) else cfg)["vocab_size"], 768)
                self.assertTrue(LINEAR_AND_FULL[arch](cfg), cfg)
                with open(os.path.join(self.dirs[arch], "tokenizer_config.json")) as f:
                    self.assertIn("<|im_start|>", json.load(f)["chat_template"])
                for name in VLM_PROCESSOR_FILES.get(arch, ()):
                    self.assertTrue(os.path.exists(os.path.join(self.dirs[arch], name)), name)
                if arch in TEXT_VOCAB_ONLY and arch.startswith("minicpmv"):  # the processor's special tokens, as transformers reads them
                    with open(os.path.join(self.dirs[arch], "tokenizer_config.json")) as f:
                        self.assertEqual(json.load(f)["extra_special_tokens"]["image_id_end_token"], "</image_id>")
                    with open(os.path.join(self.dirs[arch], "tokenizer.json")) as f:
                        added = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
                    self.assertEqual((added["<image>"], added["</image_id>"]), (cfg["image_token_id"], 767))
                if arch == "jet_vlm":  # what SGLang's NVILA processor reads (multimodal/processors/nvila.py)
                    with open(os.path.join(self.dirs[arch], "tokenizer_config.json")) as f:
                        self.assertEqual(json.load(f)["extra_special_tokens"],
                                         {"image_token": "<image>", "video_token": "<vila/video>"})
                    with open(os.path.join(self.dirs[arch], "tokenizer.json")) as f:
                        added = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
                    self.assertEqual((added["<image>"], added["<vila/video>"]), (766, 767))
                    with open(os.path.join(self.dirs[arch], "processor_config.json")) as f:
                        self.assertEqual(json.load(f), {"processor_class": "SiglipProcessor"})

    def test_weights_released_names_float16(self):
        for arch in ARCHS:
            with self.subTest(arch=arch):
                _, name, shape = EXPECTED[arch]
                with safe_open(os.path.join(self.dirs[arch], "model.safetensors"), "pt") as f:
                    self.assertIn(name, set(f.keys()))
                    self.assertEqual(tuple(f.get_slice(name).get_shape()), shape)
                    self.assertEqual(str(f.get_tensor(name).dtype), "torch." + DTYPE.get(arch, "float16"))
                    head = INKLING_LM_HEAD if arch == "inkling" else LM_HEAD.get(arch, "lm_head.weight")
                    self.assertEqual(tuple(f.get_slice(head).get_shape()), (768, 64))
                self.assertLess(os.path.getsize(os.path.join(self.dirs[arch], "model.safetensors")),
                                MAX_BYTES.get(arch, 1 << 20))

    def test_deterministic_across_processes(self):
        other = os.path.join(self.tmp.name, "again")
        subprocess.run([sys.executable, SCRIPT, "--arch", "lfm2", "--out", other], check=True,
                       capture_output=True, timeout=300, env=dict(os.environ, PYTHONHASHSEED="random"))
        for name in ("model.safetensors", "config.json", "tokenizer.json"):
            with open(os.path.join(other, name), "rb") as a, open(os.path.join(self.dirs["lfm2"], name), "rb") as b:
                self.assertEqual(a.read(), b.read(), name)

    def test_reference_peaked_and_context_dependent(self):
        """The float32 reference (transformers' plain-torch path) gives peaked logits: the greedy
        token's log-probability is far above uniform (-ln 768 = -6.64); and one token changed 20
        positions back moves the next token's log-probability by more than float16 serving noise
        (about 5e-3), so a wrong cached state shows in logprobs even where greedy tokens agree."""
        a = list(range(10, 90))
        b = list(a)
        b[60] = 700
        # one family per kind of linear layer of the default run's served references (Mamba2,
        # Gated DeltaNet, Mamba1): each reference is a fresh transformers process, ~11 s; the
        # other families' served classes compare to their own reference
        for arch in ("nemotron_h", "qwen3_next", "falcon_mamba"):
            with self.subTest(arch=arch):
                ra, rb = reference_greedy(self.dirs[arch], [a, b], 2)
                self.assertEqual(len(ra["tokens"]), 2)
                self.assertGreater(ra["logprobs"][0], -3.0, ra)
                self.assertGreater(abs(ra["logprobs"][0] - rb["logprobs"][0]), 1e-2, (ra, rb))

    def test_sglang_config_loader_accepts(self):
        """SGLang's own loader (``get_config``, ``ModelConfig``) reads every checkpoint with its
        config class for the family and counts it as hybrid; for ``qwen3_5_text`` (serving not
        verified yet) also that SGLang sees the same layer kinds and rotary settings as the
        transformers config that built the weights."""
        proc = subprocess.run([sys.executable, "-c", _SGLANG_CONFIG_PROBE, json.dumps(self.dirs)],
                              capture_output=True, text=True, timeout=300)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
        for arch in ARCHS:
            with self.subTest(arch=arch):
                self.assertEqual(seen[arch]["architectures"], [EXPECTED[arch][0]])
                self.assertTrue(seen[arch]["mambaish"], seen[arch])
        q = seen["qwen3_5_text"]
        self.assertEqual(q["config_class"], "Qwen3_5TextConfig")
        self.assertTrue(q["gdn"])
        self.assertEqual((q["linear"], q["full"]), ([0, 2], [1, 3]))
        self.assertEqual((q["rotary"], q["theta"]), (0.25, 10000.0))

    def test_written_weights_fill_every_sglang_parameter(self):
        """A hand-written checkpoint (no transformers class) loads into SGLang's own class with
        no parameter left unfilled (SGLang's loaders skip unknown names silently). All in one
        process (one SGLang import), each under its own server args. The families of
        :data:`OPT_IN_LOADS` only with ``SGLANG_MAMBA_EXT_ALL_FAMILIES=1``."""
        archs = WRITTEN if ALL_FAMILIES else tuple(a for a in WRITTEN if a not in OPT_IN_LOADS)
        # a free port for its gloo group (the fixed default collided in a CI run: EADDRINUSE)
        from sglang_mamba_ext.testing import zygote

        # in a child of a process that imported SGLang and loaded the plugins (shared, testing/zygote.py)
        proc = zygote.run_plugins_loaded("sglang_mamba_ext.testing.model_load",
                                         [*(self.dirs[arch] for arch in archs), str(free_port())], timeout=600)
        self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
        lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith('{"model"')]
        self.assertEqual([x["model"] for x in lines], [self.dirs[arch] for arch in archs])
        for arch, got in zip(archs, lines):
            with self.subTest(arch=arch):
                self.assertEqual(got["class"], EXPECTED[arch][0])
                self.assertEqual(got["unloaded"], [])
                # MiniCPM-SALA: 37; Inkling: 29 (two layers of 13); Jet-Nemotron: 41
                self.assertGreater(got["parameters"], {"minicpm": 30, "inkling": 25, "jet_nemotron": 35}.get(arch, 50))

    def test_jet_vlm_text_model_is_jet_nemotrons(self):
        """The VLM's ``llm.`` tensors are the jet_nemotron checkpoint's, bit for bit (same seed,
        same text config): its served text-only outputs are that text model's."""
        with safe_open(os.path.join(self.dirs["jet_vlm"], "model.safetensors"), "pt") as v, \
                safe_open(os.path.join(self.dirs["jet_nemotron"], "model.safetensors"), "pt") as t:
            text = sorted(t.keys())
            self.assertEqual(sorted(k[4:] for k in v.keys() if k.startswith("llm.")), text)
            for name in text:
                self.assertTrue(torch.equal(v.get_tensor("llm." + name), t.get_tensor(name)), name)
            others = sorted(k for k in v.keys() if not k.startswith("llm."))
        # the one-layer SigLIP tower (21 tensors, transformers' names) and the projector (6)
        self.assertEqual(len(text), 63)  # SGLang stacks them into 41 parameters
        self.assertEqual(len(others), 27)
        self.assertEqual(others[:6], [f"mm_projector.layers.{i}.{p}" for i in (1, 2, 4) for p in ("bias", "weight")])

    def test_arch_refuses_tiny_only_flags(self):
        proc = subprocess.run([sys.executable, SCRIPT, "--arch", "lfm2", "--out", os.path.join(self.tmp.name, "x"),
                               "--linear-gate", "gdn"], capture_output=True, text=True, timeout=120)
        self.assertEqual(proc.returncode, 2)
        self.assertIn("error: --arch lfm2 cannot be combined with --linear-gate", proc.stderr)
        self.assertFalse(os.path.exists(os.path.join(self.tmp.name, "x")))


if __name__ == "__main__":
    unittest.main()
