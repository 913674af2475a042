"""A tiny GLM-5-Next checkpoint (issue 40): SGLang 0.5.23's ``Glm5NextForConditionalGeneration``
(``sglang/srt/models/glm5_next.py``, config ``Glm5NextConfig``, ``srt/configs/glm5_next.py``),
served text-only. Written by hand in the released checkpoint's names (transformers' layout:
``model.language_model.*``, ``model.visual.*``, ``lm_head.weight``; SGLang's loader strips
``language_model.`` and maps ``model.visual`` to ``visual``, ``glm5_next.py:1231-1240``).

The text model (:func:`glm5_next_family`, hidden 64, 4 layers):

- **KDA layers** 0 and 2 (``linear_attn_config.kda_layers``, 0-based in this class) in GLM's
  layout: q / k / v projections with one short conv each, beta ``b_proj``, the **low-rank decay
  and output gate** (``f_a_proj`` / ``f_b_proj``, ``g_a_proj`` / ``g_b_proj`` of rank
  ``head_dim``; SGLang fuses the six ``*_a`` / q / k / v / b projections into
  ``fused_qkvbfg_a_proj`` and the two ``*_b`` into ``fused_fg_b_proj``), ``A_log [heads]``,
  ``dt_bias [heads * head_dim]``, the sigmoid-gated output norm ``o_norm`` and ``o_proj``, and
  the **safe gate** of the released checkpoints (``gate_lower_bound`` -5: the in-chunk writer
  takes it through ``inchunk_checkpoints.safe_gate_as_raw``, as Kimi-K3's);
- **DSA layers** 1 and 3: MLA with a query LoRA (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``),
  no rope (GLM-5-Next's MLA is NoPE: ``qk_rope_head_dim`` 0, SGLang passes ``skip_rope``), the
  latent ``kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``, ``o_proj``; and the
  **indexer** (``indexer.wq_b``, ``.wk``, ``.k_norm``, ``.weights_proj``: 2 heads of 16).
  ``index_topk`` is 4096, the model's ``max_position_embeddings``: every sequence fits it, so DSA
  computes dense MLA, which is how the plugin serves the class on CPU
  (``plugin/cpu_bridges_glm5_next.py``; the indexer's tensors are then not read);
- a dense SwiGLU first layer (``first_k_dense_replace`` 1), then DeepSeek's MoE (sigmoid router
  with a correction bias, 4 experts, top 2, one shared expert), ``swiglu_limit`` 10 (GLM's
  clamped SwiGLU);
- **hyper-connections** (``mhc``, as every GLM-5-Next: transformers' class always builds them,
  ``Glm5NextTextHyperConnection``): 4 residual streams, each layer's ``hc_attn_*`` / ``hc_ffn_*``
  mixes (:func:`_hyper_connections`), 20 Sinkhorn iterations; the final collapse is an unweighted
  mean (no tensor).

The vision tower (a VLM class: SGLang builds it and its processor at start-up) is GLM-OCR's at the
smallest sizes (:data:`VISION`: one block 32 wide, 2 heads, 14-pixel patches, 2x2 merge, out 64),
written in SGLang's names of ``Glm5NextVisionModel``; its six media tokens (:data:`MEDIA_TOKENS`,
ids 762-767) are the tokenizer's last, and the image / video processors are transformers' GLM-5-Next
ones at the tower's patch and merge sizes. Only torch and transformers; deterministic for a seed.
"""

from __future__ import annotations

import math
from typing import Dict

import torch

from sglang_mamba_ext.models.hf_tiny_written import _deepseek_mlp, _Draw, _swiglu

#: GLM's media tokens (tokenizer attribute -> text), ids 762-767 in this order; the names and
#: texts of SGLang's GLM-V processor (``multimodal/processors/glm4v.py``, ``Glm4vImageProcessor``)
MEDIA_TOKENS = {"image_token": "<|image|>", "video_token": "<|video|>",
                "image_start_token": "<|begin_of_image|>", "image_end_token": "<|end_of_image|>",
                "video_start_token": "<|begin_of_video|>", "video_end_token": "<|end_of_video|>"}
MEDIA_IDS = dict(image_token_id=762, video_token_id=763, image_start_token_id=764, image_end_token_id=765,
                 video_start_token_id=766, video_end_token_id=767)

#: the tiny GLM-OCR vision tower (``Glm5NextVisionConfig``: ``GlmOcrVisionConfig`` + ``swiglu_limit``)
VISION = dict(model_type="glm_ocr_vision", depth=1, hidden_size=32, hidden_act="silu", attention_bias=True,
              num_heads=2, in_channels=3, image_size=28, patch_size=14, rms_norm_eps=1e-5, spatial_merge_size=2,
              temporal_patch_size=2, out_hidden_size=64, intermediate_size=64, swiglu_limit=10.0,
              # transformers sizes the merger's SwiGLU by this (default 10240), SGLang by intermediate_size
              projection_intermediate_size=64)


def _glm_kda(w: Dict[str, torch.Tensor], d: _Draw, a: str, hidden: int, heads: int, dim: int, conv_k: int) -> None:
    """GLM-5-Next's KDA layer (``Glm5NextLinearAttention``) in the checkpoint's names."""
    width = heads * dim
    for x in "qkv":
        w[f"{a}.{x}_proj.weight"] = d.proj(width, hidden)
        w[f"{a}.{x}_conv1d.weight"] = d.normal(width, 1, conv_k, std=1.0 / math.sqrt(conv_k))
    for x in "fg":
        w[f"{a}.{x}_a_proj.weight"] = d.proj(dim, hidden)
        w[f"{a}.{x}_b_proj.weight"] = d.proj(width, dim)
    w[f"{a}.b_proj.weight"] = d.proj(heads, hidden)
    # long memory under the safe gate (decay lower_bound * sigmoid(exp(A_log) * (a + dt_bias)), a
    # about N(0, 1)): dt_bias around -4 and exp(A_log) in 1..4 keep most channels' decay per token
    # far below 1 nat, so a token 130 positions back still moves the next token (as
    # hf_tiny._mamba1_long_memory does for Mamba1); centred on 0, the safe gate forgets in a step
    w[f"{a}.A_log"] = torch.log(d.uniform(1.0, 4.0, heads))
    w[f"{a}.dt_bias"] = d.normal(width, std=0.1) - 4.0
    w[f"{a}.o_norm.weight"] = 1.0 + d.normal(dim, std=0.1)
    w[f"{a}.o_proj.weight"] = d.proj(hidden, width)


def _glm_dsa(w: Dict[str, torch.Tensor], d: _Draw, a: str, cfg: Dict) -> None:
    """A DSA layer: MLA with a query LoRA and no rope, and its indexer."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, vdim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    w[f"{a}.q_a_proj.weight"] = d.proj(q_lora, h)
    w[f"{a}.q_a_layernorm.weight"] = 1.0 + d.normal(q_lora, std=0.1)
    w[f"{a}.q_b_proj.weight"] = d.proj(heads * (nope + rope), q_lora)
    w[f"{a}.kv_a_proj_with_mqa.weight"] = d.proj(kv_lora + rope, h)
    w[f"{a}.kv_a_layernorm.weight"] = 1.0 + d.normal(kv_lora, std=0.1)
    w[f"{a}.kv_b_proj.weight"] = d.proj(heads * (nope + vdim), kv_lora)
    w[f"{a}.o_proj.weight"] = d.proj(h, heads * vdim)
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    w[f"{a}.indexer.wq_b.weight"] = d.proj(ih * idim, q_lora)
    w[f"{a}.indexer.wk.weight"] = d.proj(idim, h)
    w[f"{a}.indexer.k_norm.weight"] = 1.0 + d.normal(idim, std=0.1)
    w[f"{a}.indexer.k_norm.bias"] = d.normal(idim, std=0.02)
    w[f"{a}.indexer.weights_proj.weight"] = d.proj(ih, h)


def _hyper_connections(w: Dict[str, torch.Tensor], d: _Draw, p: str, hidden: int, n: int) -> None:
    """A layer's manifold-constrained hyper-connections (mHC, ``hc_mult`` = ``n`` residual
    streams) before its attention and its FFN, in SGLang's names (``hc_attn_fn``
    ``[(2 + n) * n, n * hidden]``, ``hc_attn_base [(2 + n) * n]``, ``hc_attn_scale [3]``; the same
    for ``hc_ffn_*``), float32 as SGLang keeps them."""
    mix = (2 + n) * n
    for x in ("attn", "ffn"):
        w[f"{p}.hc_{x}_fn"] = d.proj(mix, n * hidden)
        w[f"{p}.hc_{x}_base"] = d.normal(mix, std=0.5)
        w[f"{p}.hc_{x}_scale"] = 1.0 + d.normal(3, std=0.1)


def _glm_vision(w: Dict[str, torch.Tensor], d: _Draw, v: Dict) -> None:
    """The GLM-OCR tower in SGLang's ``Glm5NextVisionModel`` names under ``model.visual.``
    (the checkpoint's ``attn.qkv`` and the MLPs' separate gate / up, which SGLang merges)."""
    p, hid, out, inter = "model.visual", v["hidden_size"], v["out_hidden_size"], v["intermediate_size"]
    patch, tp, c, merge = v["patch_size"], v["temporal_patch_size"], v["in_channels"], v["spatial_merge_size"]
    head = hid // v["num_heads"]
    w[f"{p}.patch_embed.proj.weight"] = d.normal(hid, c, tp, patch, patch, std=(c * tp * patch * patch) ** -0.5)
    w[f"{p}.patch_embed.proj.bias"] = d.normal(hid, std=0.02)
    for i in range(v["depth"]):
        b = f"{p}.blocks.{i}"
        w[f"{b}.norm1.weight"] = 1.0 + d.normal(hid, std=0.1)
        w[f"{b}.norm2.weight"] = 1.0 + d.normal(hid, std=0.1)
        w[f"{b}.attn.q_norm.weight"] = 1.0 + d.normal(head, std=0.1)
        w[f"{b}.attn.k_norm.weight"] = 1.0 + d.normal(head, std=0.1)
        w[f"{b}.attn.qkv.weight"] = d.proj(3 * hid, hid)
        w[f"{b}.attn.qkv.bias"] = d.normal(3 * hid, std=0.02)
        w[f"{b}.attn.proj.weight"] = d.proj(hid, hid)
        w[f"{b}.attn.proj.bias"] = d.normal(hid, std=0.02)
        for x in ("gate_proj", "up_proj"):
            w[f"{b}.mlp.{x}.weight"] = d.proj(inter, hid)
            w[f"{b}.mlp.{x}.bias"] = d.normal(inter, std=0.02)
        w[f"{b}.mlp.down_proj.weight"] = d.proj(hid, inter)
        w[f"{b}.mlp.down_proj.bias"] = d.normal(hid, std=0.02)
    w[f"{p}.post_layernorm.weight"] = 1.0 + d.normal(hid, std=0.1)
    w[f"{p}.downsample.weight"] = d.normal(out, hid, merge, merge, std=(hid * merge * merge) ** -0.5)
    w[f"{p}.downsample.bias"] = d.normal(out, std=0.02)
    w[f"{p}.merger.proj.weight"] = d.proj(out, out)
    w[f"{p}.merger.post_projection_norm.weight"] = 1.0 + d.normal(out, std=0.1)
    w[f"{p}.merger.post_projection_norm.bias"] = d.normal(out, std=0.02)
    _swiglu(w, d, f"{p}.merger", out, inter)


def glm5_next_weights(cfg: Dict, seed: int, logit_scale: float) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``Glm5NextForConditionalGeneration`` for the config
    ``cfg`` (:func:`glm5_next_family`'s, tokenizer fields added): per layer
    (``model.language_model.layers.N``) a KDA layer when ``N`` is in
    ``linear_attn_config.kda_layers`` else a DSA layer (module docstring); a SwiGLU MLP for the
    first ``first_k_dense_replace`` layers, then the MoE (router ``gate`` with
    ``e_score_correction_bias``, experts ``gate_proj`` / ``up_proj`` / ``down_proj``, shared
    experts); the vision tower (drawn from its own seed). ``logit_scale`` multiplies the LM head
    (N(0, 1/hidden) per entry otherwise)."""
    text = cfg["text_config"]
    d = _Draw(seed)
    h, vocab = text["hidden_size"], text["vocab_size"]
    lin = text["linear_attn_config"]
    heads, dim, conv_k = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    m0 = "model.language_model"
    w: Dict[str, torch.Tensor] = {f"{m0}.embed_tokens.weight": d.normal(vocab, h)}
    for i in range(text["num_hidden_layers"]):
        p = f"{m0}.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = 1.0 + d.normal(h, std=0.1)
        w[f"{p}.post_attention_layernorm.weight"] = 1.0 + d.normal(h, std=0.1)
        if text.get("mhc"):
            _hyper_connections(w, d, p, h, text["hc_mult"])
        if i in lin["kda_layers"]:
            _glm_kda(w, d, f"{p}.self_attn", h, heads, dim, conv_k)
        else:
            _glm_dsa(w, d, f"{p}.self_attn", text)
        _deepseek_mlp(w, d, f"{p}.mlp", h, i, text)
    w[f"{m0}.norm.weight"] = 1.0 + d.normal(h, std=0.1)
    w["lm_head.weight"] = d.proj(vocab, h) * logit_scale
    _glm_vision(w, _Draw(seed + 11), cfg["vision_config"])
    return w


def write_processor_configs(out_dir: str) -> None:
    """transformers' GLM-5-Next image and video processors at the tower's patch (14), temporal
    patch (2) and merge (2) sizes, and :data:`MEDIA_TOKENS` as the tokenizer's
    ``extra_special_tokens`` (SGLang's GLM-V processor wraps ``AutoProcessor``'s
    ``Glm5NextProcessor``, ``multimodal/processors/glm4v.py``)."""
    from transformers.models.glm5_next.image_processing_glm5_next import Glm5NextImageProcessor
    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

    from sglang_mamba_ext.models.hf_tiny_minicpmv import add_special_tokens_config

    sizes = dict(patch_size=VISION["patch_size"], temporal_patch_size=VISION["temporal_patch_size"],
                 merge_size=VISION["spatial_merge_size"],
                 size={"shortest_edge": 28 * 28, "longest_edge": 112 * 112})
    Glm5NextImageProcessor(**sizes).save_pretrained(out_dir)
    Glm5NextVideoProcessor(**sizes).save_pretrained(out_dir)
    add_special_tokens_config(out_dir, MEDIA_TOKENS)


def glm5_next_family(hidden: int, layers: int) -> Dict[str, Dict]:
    """The ``glm5_next`` entry of :mod:`.hf_tiny`'s family table (``cls``, ``writer``, ``sub``,
    ``special_tokens``, ``processor``, ``config`` in the released format: a ``text_config`` and a
    ``vision_config``; see the module docstring), for a text model of ``hidden`` width and
    ``layers`` layers alternating KDA / DSA."""
    text = dict(
        architectures=["Glm5NextForConditionalGeneration"], model_type="glm5_next_text",
        hidden_size=hidden, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, hidden_act="silu",
        rms_norm_eps=1e-5, rope_theta=10000.0, attention_bias=False,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.0, scoring_func="sigmoid", topk_method="noaux_tc",
        first_k_dense_replace=1, moe_layer_freq=1, swiglu_limit=10.0, num_nextn_predict_layers=0,
        mhc=True, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16,
        linear_attn_config=dict(kda_layers=list(range(0, layers, 2)), full_attn_layers=list(range(1, layers, 2)),
                                num_heads=4, head_dim=16, short_conv_kernel_size=4, gate_lower_bound=-5.0),
        # the same layout in transformers' fields, which reads neither linear_attn_config nor
        # first_k_dense_replace (its defaults: KDA wherever idx % 4 != 3, the first 3 layers dense)
        layer_types=["linear_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        mlp_layer_types=["dense" if i < 1 else "sparse" for i in range(layers)],
        linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
        # every sequence fits index_topk (max_position_embeddings is 4096, hf_tiny's common fields)
        index_topk=4096, index_head_dim=16, index_n_heads=2,
    )
    return {"glm5_next": dict(
        cls="Glm5NextForConditionalGeneration", writer=glm5_next_weights, sub="text_config",
        special_tokens=MEDIA_TOKENS, processor=write_processor_configs,
        config=dict(model_type="glm5_next", text_config=text, vision_config=dict(VISION), **MEDIA_IDS),
    )}
