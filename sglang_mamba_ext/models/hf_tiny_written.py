"""Tiny checkpoints for SGLang classes that transformers has no model class for (issue 40): the
weights are written by hand, tensor by tensor, in the names and shapes SGLang's loader for the
class reads (its ``load_weights``), not produced by a transformers model. Used by
:mod:`.hf_tiny` for families whose entry names a ``writer``.

There is no float32 reference for these families (transformers has no class to run), so their
served checks are the cache's own: hits, and outputs equal to a cold run. Their configs (in the
families' released formats) are here too: :func:`written_families`.

- :func:`gigachat35_weights`: SGLang's ``GigaChat35ForCausalLM`` (``models/gigachat35.py``): a
  DeepSeek-V3 layout (MLA attention, DeepSeek MoE, ``model.layers.N.*`` names as its
  ``DeepseekV2WeightLoaderMixin`` reads them) whose linear layers are Qwen3-Next's Gated
  DeltaNet under ``self_attn`` (``in_proj_qkvz``, ``in_proj_ba``, ``conv1d``, ``A_log``,
  ``dt_bias``, ``norm``, ``out_proj``); GigaChat's gated norms (``gate_up_projection`` /
  ``gate_down_projection``, a low rank of 16) everywhere a norm is, and the sigmoid gate of the
  attention output (``self_attn.gate_proj``).

Only torch; deterministic for a seed.
"""

from __future__ import annotations

import math
from typing import Dict

import torch

#: SGLang's GigaChat35GatedRMSNorm's gate bottleneck (``models/gigachat35.py``, _GATED_NORM_LOW_RANK)
GATED_NORM_RANK = 16


class _Draw:
    """Seeded tensors: projections ``N(0, 1/fan_in)`` (as ``hf_tiny._spread_weights``), so each
    block moves the residual stream and outputs depend on the context."""

    def __init__(self, seed: int):
        self.gen = torch.Generator().manual_seed(seed)

    def proj(self, out: int, inp: int) -> torch.Tensor:
        return torch.randn(out, inp, generator=self.gen) / math.sqrt(inp)

    def normal(self, *shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * std

    def uniform(self, lo: float, hi: float, *shape: int) -> torch.Tensor:
        return lo + (hi - lo) * torch.rand(*shape, generator=self.gen)


def _gated_norm(w: Dict[str, torch.Tensor], d: _Draw, prefix: str, size: int) -> None:
    """A zero-centered gated RMSNorm (``norm_type`` ZeroCenteredGatedNorm): its weight (around
    0: the norm scales by 1 + weight) and the low-rank gate, in the checkpoint's names
    (SGLang renames ``gate_*_projection`` to ``gate_*_lowrank`` on load)."""
    w[f"{prefix}.weight"] = d.normal(size, std=0.1)
    w[f"{prefix}.gate_up_projection.weight"] = d.proj(GATED_NORM_RANK, size)
    w[f"{prefix}.gate_down_projection.weight"] = d.proj(size, GATED_NORM_RANK)


def _swiglu(w: Dict[str, torch.Tensor], d: _Draw, prefix: str, hidden: int, inter: int) -> None:
    w[f"{prefix}.gate_proj.weight"] = d.proj(inter, hidden)
    w[f"{prefix}.up_proj.weight"] = d.proj(inter, hidden)
    w[f"{prefix}.down_proj.weight"] = d.proj(hidden, inter)


def _deepseek_mlp(w: Dict[str, torch.Tensor], d: _Draw, m: str, hidden: int, layer: int, cfg: Dict,
                  names=("n_routed_experts", "n_shared_experts", "e_score_correction_bias")) -> None:
    """DeepSeek's MLP block at ``m`` for layer ``layer``: a dense SwiGLU (``intermediate_size``)
    below ``first_k_dense_replace``, else ``cfg[names[0]]`` SwiGLU experts of width
    ``moe_intermediate_size``, the router (``gate.weight`` and its bias ``gate.<names[2]>``) and
    ``cfg[names[1]]`` shared experts fused in one SwiGLU. ``names``: DeepSeek's config fields and
    bias name (SGLang's ``DeepseekV2MoE``); Ling's are ``num_experts``, ``num_shared_experts``,
    ``expert_bias``."""
    if layer < cfg["first_k_dense_replace"]:
        _swiglu(w, d, m, hidden, cfg["intermediate_size"])
        return
    n_exp, inter = cfg[names[0]], cfg["moe_intermediate_size"]
    w[f"{m}.gate.weight"] = d.proj(n_exp, hidden)
    w[f"{m}.gate.{names[2]}"] = d.normal(n_exp, std=0.1)
    for e in range(n_exp):
        _swiglu(w, d, f"{m}.experts.{e}", hidden, inter)
    _swiglu(w, d, f"{m}.shared_experts", hidden, inter * cfg[names[1]])


def gigachat35_weights(cfg: Dict, seed: int, logit_scale: float) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``GigaChat35ForCausalLM`` for the config fields ``cfg``
    (``layer_types`` of ``linear_attention`` / ``attention``, MLA sizes with a ``q_lora_rank``,
    ``first_k_dense_replace`` dense layers then MoE, ``layernorm_type`` pre_post,
    ``gated_attention``). ``logit_scale`` multiplies the LM head (N(0, 1/hidden) per entry
    otherwise), for peaked logits."""
    d = _Draw(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    w: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": d.normal(vocab, h)}
    heads, nope, rope, vdim = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"],
                               cfg["v_head_dim"])
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    nk, nv, dk, dv = (cfg["linear_num_key_heads"], cfg["linear_num_value_heads"], cfg["linear_key_head_dim"],
                      cfg["linear_value_head_dim"])
    conv_k = cfg["linear_conv_kernel_dim"]
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm",
                     "post_feedforward_layernorm"):
            _gated_norm(w, d, f"{p}.{norm}", h)
        a = f"{p}.self_attn"
        if kind == "linear_attention":
            # Qwen3-Next's Gated DeltaNet (SGLang's Qwen3GatedDeltaNet under self_attn)
            key, value = nk * dk, nv * dv
            w[f"{a}.in_proj_qkvz.weight"] = d.proj(2 * key + 2 * value, h)
            w[f"{a}.in_proj_ba.weight"] = d.proj(2 * nv, h)
            w[f"{a}.conv1d.weight"] = d.normal(2 * key + value, 1, conv_k, std=1.0 / math.sqrt(conv_k))
            w[f"{a}.A_log"] = torch.log(d.uniform(1.0, 16.0, nv))
            w[f"{a}.dt_bias"] = torch.ones(nv)
            w[f"{a}.norm.weight"] = torch.ones(dv)
            w[f"{a}.out_proj.weight"] = d.proj(h, value)
        else:
            # DeepSeek's MLA with a query LoRA, gated output (SGLang: self_attn.attn_gate)
            w[f"{a}.q_a_proj.weight"] = d.proj(q_lora, h)
            _gated_norm(w, d, f"{a}.q_a_layernorm", q_lora)
            w[f"{a}.q_b_proj.weight"] = d.proj(heads * (nope + rope), q_lora)
            w[f"{a}.kv_a_proj_with_mqa.weight"] = d.proj(kv_lora + rope, h)
            _gated_norm(w, d, f"{a}.kv_a_layernorm", kv_lora)
            w[f"{a}.kv_b_proj.weight"] = d.proj(heads * (nope + vdim), kv_lora)
            w[f"{a}.o_proj.weight"] = d.proj(h, heads * vdim)
            w[f"{a}.gate_proj.weight"] = d.proj(heads * vdim, h)
        _deepseek_mlp(w, d, f"{p}.mlp", h, i, cfg)
    _gated_norm(w, d, "model.norm", h)
    w["lm_head.weight"] = d.proj(vocab, h) * logit_scale
    return w


def _mla(w: Dict[str, torch.Tensor], d: _Draw, a: str, hidden: int, heads: int, nope: int, rope: int, vdim: int,
         kv_lora: int) -> None:
    """DeepSeek's MLA without a query LoRA in its checkpoint names (``q_proj``,
    ``kv_a_proj_with_mqa`` of ``kv_lora + rope`` rows, ``kv_a_layernorm``, ``kv_b_proj``,
    ``o_proj``): Ling's and Kimi-K3's full-attention layers."""
    w[f"{a}.q_proj.weight"] = d.proj(heads * (nope + rope), hidden)
    w[f"{a}.kv_a_proj_with_mqa.weight"] = d.proj(kv_lora + rope, hidden)
    w[f"{a}.kv_a_layernorm.weight"] = 1.0 + d.normal(kv_lora, std=0.1)
    w[f"{a}.kv_b_proj.weight"] = d.proj(heads * (nope + vdim), kv_lora)
    w[f"{a}.o_proj.weight"] = d.proj(hidden, heads * vdim)


def _kda(w: Dict[str, torch.Tensor], d: _Draw, a: str, hidden: int, heads: int, dim: int, conv_k: int,
         full_rank_gate: bool = False) -> None:
    """Kimi Delta Attention in Kimi-Linear's checkpoint names (SGLang's ``KimiDeltaAttention``,
    which ``BailingKDA`` subclasses): q/k/v projections, one short conv each, the low-rank
    decay (f) and output-gate (g) projections of rank ``dim`` (``full_rank_gate``: one ``g_proj``
    of ``heads * dim`` rows instead, Kimi-K3's), beta, ``A_log`` per head, ``dt_bias`` per
    channel, the gated output norm."""
    width = heads * dim
    for x in "qkv":
        w[f"{a}.{x}_proj.weight"] = d.proj(width, hidden)
        w[f"{a}.{x}_conv1d.weight"] = d.normal(width, 1, conv_k, std=1.0 / math.sqrt(conv_k))
    if full_rank_gate:
        w[f"{a}.g_proj.weight"] = d.proj(width, hidden)
    for x in ("f" if full_rank_gate else "fg"):
        w[f"{a}.{x}_a_proj.weight"] = d.proj(dim, hidden)
        w[f"{a}.{x}_b_proj.weight"] = d.proj(width, dim)
    w[f"{a}.b_proj.weight"] = d.proj(heads, hidden)
    w[f"{a}.A_log"] = torch.log(d.uniform(1.0, 16.0, heads))
    w[f"{a}.dt_bias"] = d.normal(width, std=0.1)
    w[f"{a}.o_norm.weight"] = torch.ones(dim)
    w[f"{a}.o_proj.weight"] = d.proj(hidden, width)


def _lightning(w: Dict[str, torch.Tensor], d: _Draw, a: str, hidden: int, heads: int, dim: int,
               qk_norm: bool) -> None:
    """Ling 2.5's linear attention in its checkpoint names (SGLang's ``BailingMoELinearAttention``,
    ``models/bailing_moe_linear.py``): the fused ``query_key_value`` projection (q, k, v rows,
    ``heads * dim`` each), the per-head q / k RMSNorms when ``qk_norm``, the output gate
    ``g_proj``, its group RMSNorm ``g_norm`` and the output ``dense``. The decay has no weight:
    SGLang builds it from ALiBi slopes per head and layer (``lightning_backend.py``)."""
    width = heads * dim
    w[f"{a}.query_key_value.weight"] = d.proj(3 * width, hidden)
    if qk_norm:
        w[f"{a}.query_layernorm.weight"] = 1.0 + d.normal(dim, std=0.1)
        w[f"{a}.key_layernorm.weight"] = 1.0 + d.normal(dim, std=0.1)
    w[f"{a}.g_proj.weight"] = d.proj(width, hidden)
    w[f"{a}.g_norm.weight"] = 1.0 + d.normal(width, std=0.1)
    w[f"{a}.dense.weight"] = d.proj(hidden, width)


def bailing_moe_linear_weights(cfg: Dict, seed: int, logit_scale: float) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``BailingMoeV2_5ForCausalLM`` (Ling 2.5, SGLang's
    ``models/bailing_moe_linear.py``, config ``BailingHybridConfig`` without a short conv): Ling-V3's
    layout (:func:`bailing_moe_v3_weights`: MLA every ``layer_group_size``-th layer, Bailing's
    MoE) with lightning linear-attention layers (:func:`_lightning`) in place of KDA."""
    return bailing_moe_v3_weights(cfg, seed, logit_scale, linear=lambda w, d, a, h, heads: _lightning(
        w, d, a, h, heads, cfg["head_dim"], cfg.get("use_qk_norm", False)))


def bailing_moe_v3_weights(cfg: Dict, seed: int, logit_scale: float, linear=None) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``BailingMoeV3ForCausalLM`` (Ling-V3, SGLang's
    ``models/bailing_moe_v3.py``) for the config fields ``cfg``: ``layer_group_size`` g puts a
    full-attention layer (DeepSeek's MLA, ``q_lora_rank`` None) at every g-th layer and KDA
    layers between (``short_conv_kernel_size`` set), both under ``attention``; the first
    ``first_k_dense_replace`` layers have a dense MLP, the rest Bailing's MoE (a router with an
    expert bias, routed and shared experts); ``model.word_embeddings`` and ``model.norm``."""
    d = _Draw(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    w: Dict[str, torch.Tensor] = {"model.word_embeddings.weight": d.normal(vocab, h)}
    heads = cfg["num_attention_heads"]
    nope, rope, vdim, kv_lora = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    group = cfg["layer_group_size"]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = 1.0 + d.normal(h, std=0.1)
        w[f"{p}.post_attention_layernorm.weight"] = 1.0 + d.normal(h, std=0.1)
        a = f"{p}.attention"
        if (i + 1) % group != 0:
            if linear is not None:  # Ling 2.5's lightning layers (bailing_moe_linear_weights)
                linear(w, d, a, h, heads)
            else:
                _kda(w, d, a, h, heads, cfg["head_dim"], cfg["short_conv_kernel_size"])
        else:
            _mla(w, d, a, h, heads, nope, rope, vdim, kv_lora)
        _deepseek_mlp(w, d, f"{p}.mlp", h, i, cfg, names=("num_experts", "num_shared_experts", "expert_bias"))
    w["model.norm.weight"] = 1.0 + d.normal(h, std=0.1)
    w["lm_head.weight"] = d.proj(vocab, h) * logit_scale
    return w


def _qwen3_vl_vision(w: Dict[str, torch.Tensor], d: _Draw, prefix: str, vc: Dict) -> None:
    """Qwen3-VL's vision tower (SGLang's ``Qwen3VLMoeVisionModel``; transformers'
    ``Qwen3VLMoeVisionModel`` names): patch embedding, learned positions, ``depth`` blocks, the
    patch merger; no deepstack mergers."""
    hid, inter, out = vc["hidden_size"], vc["intermediate_size"], vc["out_hidden_size"]
    patch, t, ch, merge = vc["patch_size"], vc["temporal_patch_size"], vc["in_channels"], vc["spatial_merge_size"]
    w[f"{prefix}.patch_embed.proj.weight"] = d.normal(hid, ch, t, patch, patch, std=1.0 / math.sqrt(ch * t * patch * patch))
    w[f"{prefix}.patch_embed.proj.bias"] = torch.zeros(hid)
    w[f"{prefix}.pos_embed.weight"] = d.normal(vc["num_position_embeddings"], hid, std=0.02)
    for b in range(vc["depth"]):
        p = f"{prefix}.blocks.{b}"
        for norm in ("norm1", "norm2"):
            w[f"{p}.{norm}.weight"] = torch.ones(hid)
            w[f"{p}.{norm}.bias"] = torch.zeros(hid)
        for name, (o, i) in (("attn.qkv", (3 * hid, hid)), ("attn.proj", (hid, hid)), ("mlp.linear_fc1", (inter, hid)),
                             ("mlp.linear_fc2", (hid, inter))):
            w[f"{p}.{name}.weight"] = d.proj(o, i)
            w[f"{p}.{name}.bias"] = torch.zeros(o)
    merged = hid * merge * merge
    w[f"{prefix}.merger.norm.weight"] = torch.ones(hid)
    w[f"{prefix}.merger.norm.bias"] = torch.zeros(hid)
    w[f"{prefix}.merger.linear_fc1.weight"] = d.proj(merged, merged)
    w[f"{prefix}.merger.linear_fc1.bias"] = torch.zeros(merged)
    w[f"{prefix}.merger.linear_fc2.weight"] = d.proj(out, merged)
    w[f"{prefix}.merger.linear_fc2.bias"] = torch.zeros(out)


def bailing_mm_v3_weights(cfg: Dict, seed: int, logit_scale: float) -> Dict[str, torch.Tensor]:
    """A tiny ``BailingMoeV3VLForConditionalGeneration`` (SGLang's ``models/bailing_mm_v3.py``):
    Ling-V3's text model (:func:`bailing_moe_v3_weights`, its public names ``model.layers``,
    ``model.word_embeddings``, ``model.norm``, ``lm_head``), Qwen3-VL's vision tower under
    ``model.visual`` and the two-layer ``linear_proj`` from the merger's output to the text
    width."""
    w = bailing_moe_v3_weights(cfg["text_config"], seed, logit_scale)
    d = _Draw(seed + 7)
    vc = cfg["vision_config"]
    _qwen3_vl_vision(w, d, "model.visual", vc)
    h = cfg["text_config"]["hidden_size"]
    w["linear_proj.0.weight"] = d.proj(h, vc["out_hidden_size"])
    w["linear_proj.0.bias"] = torch.zeros(h)
    w["linear_proj.2.weight"] = d.proj(h, h)
    w["linear_proj.2.bias"] = torch.zeros(h)
    return w


def minicpm_sala_weights(cfg: Dict, seed: int, logit_scale: float) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``MiniCPMSALAForCausalLM`` (MiniCPM-SALA, SGLang's
    ``models/minicpm.py``, config ``MiniCPMHybridConfig``): per ``mixer_types`` entry a lightning
    layer (``MiniCPMLightningMixer``: q / k / v projections, per-head q / k norms, the output norm
    ``o_norm`` and gate ``z_proj``, ``o_proj``) or a GQA attention layer (``MiniCPMAttention``,
    its output gate ``o_gate``), a SwiGLU MLP each. The embedding is scaled by ``1 / scale_emb``
    (SGLang multiplies it back) and the LM head by ``hidden / dim_model_base`` (SGLang divides the
    final hidden state by ``hidden / dim_model_base``), so ``logit_scale`` keeps its meaning."""
    d = _Draw(seed)
    h, vocab, n = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    w: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": d.normal(vocab, h) / cfg["scale_emb"]}
    kinds = (cfg["mixer_types"] * n)[:n]
    for i, kind in enumerate(kinds):
        p, a = f"model.layers.{i}", f"model.layers.{i}.self_attn"
        w[f"{p}.input_layernorm.weight"] = 1.0 + d.normal(h, std=0.1)
        w[f"{p}.post_attention_layernorm.weight"] = 1.0 + d.normal(h, std=0.1)
        if kind.startswith("lightning"):
            dim, heads = cfg["lightning_head_dim"], cfg["lightning_nh"]
            width = heads * dim
            for x in "qkv":
                w[f"{a}.{x}_proj.weight"] = d.proj(width, h)
            w[f"{a}.q_norm.weight"] = 1.0 + d.normal(dim, std=0.1)
            w[f"{a}.k_norm.weight"] = 1.0 + d.normal(dim, std=0.1)
            w[f"{a}.o_norm.weight"] = 1.0 + d.normal(width, std=0.1)
            w[f"{a}.z_proj.weight"] = d.proj(width, h)
            w[f"{a}.o_proj.weight"] = d.proj(h, width)
        else:
            dim, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
            w[f"{a}.q_proj.weight"] = d.proj(heads * dim, h)
            w[f"{a}.k_proj.weight"] = d.proj(kv * dim, h)
            w[f"{a}.v_proj.weight"] = d.proj(kv * dim, h)
            w[f"{a}.o_proj.weight"] = d.proj(h, heads * dim)
            w[f"{a}.o_gate.weight"] = d.proj(heads * dim, h)
        _swiglu(w, d, f"{p}.mlp", h, cfg["intermediate_size"])
    w["model.norm.weight"] = 1.0 + d.normal(h, std=0.1)
    w["lm_head.weight"] = d.proj(vocab, h) * logit_scale * cfg["hidden_size"] / cfg["dim_model_base"]
    return w


def written_families(hidden: int, layers: int) -> Dict[str, Dict]:
    """The family entries of :mod:`.hf_tiny` (``cls``, ``writer``, ``config`` in the family's
    released format, ...) whose weights this module writes, for a model of ``hidden`` width and
    ``layers`` layers (:mod:`.hf_tiny` merges them into its table)."""
    _HIDDEN, _LAYERS = hidden, layers
    _FAMILIES: Dict[str, Dict] = {}
    # Families transformers has no class for: weights written by hand in the names SGLang's loader
    # reads (``writer``: a function of :mod:`.hf_tiny_written`); no float32 reference.
    # GigaChat 3.5 (SGLang's gigachat35 module): DeepSeek-V3 layers (MLA with a query LoRA and a
    # gated output, DeepSeek MoE with sigmoid routing and a correction bias, first layer dense)
    # whose linear layers are Qwen3-Next's Gated DeltaNet; zero-centered gated norms before and
    # after each sublayer (the released defaults). model_type as SGLang's GigaChat35Config names it.
    _FAMILIES["gigachat35"] = dict(
        cls="GigaChat35ForCausalLM", writer="gigachat35_weights",
        config=dict(
            model_type="gigachat3_5", hidden_size=_HIDDEN, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=_LAYERS, layer_types=["linear_attention", "attention"] * (_LAYERS // 2),
            num_attention_heads=4, num_key_value_heads=4, hidden_act="silu",
            q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, head_dim=8,
            n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, moe_layer_freq=1, first_k_dense_replace=1,
            routed_scaling_factor=1.0, n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid",
            norm_topk_prob=True, linear_attention_type="Qwen3NextGatedDeltaNet",
            linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_sigmoid_gate_scale=2.0,
            output_gate_type="sigmoid", norm_type="ZeroCenteredGatedNorm", layernorm_type="pre_post",
            layernorm_gating_weight=2.0, gated_attention=True, use_mla_scaling_factor=True,
            rope_theta=10000.0, rope_interleave=True, rms_norm_eps=1e-6, attention_bias=False,
            # DeepSeek's YaRN at factor 1 (plain rotary positions): on CPU SGLang builds MLA's rotary
            # embedding only for deepseek_yarn scaling (layers/rotary_embedding/factory.py:478-481)
            rope_scaling=dict(rope_type="deepseek_yarn", type="deepseek_yarn", factor=1.0,
                              original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
                              mscale_all_dim=1.0),
        ),
    )


    # Ling-V3 (SGLang's bailing_moe_v3 module, config BailingHybridConfig with use_kda: a
    # short_conv_kernel_size): KDA layers with a full-attention MLA layer every layer_group_size-th
    # layer, Bailing's MoE (sigmoid router with an expert bias, one shared expert) after a dense
    # first layer. rope_parameters as DeepSeek's YaRN at factor 1 for the same CPU reason as
    # GigaChat's (MLA's rotary embedding on CPU, layers/rotary_embedding/factory.py:478-481).
    # the Bailing hybrid stack both Ling classes share (MLA full attention, Bailing's MoE)
    ling = dict(
        model_type="bailing_hybrid", hidden_size=_HIDDEN, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=_LAYERS, layer_group_size=2, hidden_act="silu",
        full_attention_type="mla", q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
        v_head_dim=16, rope_interleave=True, use_mla_nope=False,
        num_experts=4, num_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, moe_router_enable_expert_bias=True, score_function="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=1.0, use_qkv_bias=False, use_bias=False,
        rms_norm_eps=1e-6, rope_theta=10000.0,
        rope_parameters=dict(rope_type="deepseek_yarn", type="deepseek_yarn", rope_theta=10000.0, factor=1.0,
                             original_max_position_embeddings=4096, beta_fast=32, beta_slow=1, mscale=1.0,
                             mscale_all_dim=1.0),
    )
    _FAMILIES["bailing_moe_v3"] = dict(
        cls="BailingMoeV3ForCausalLM", writer="bailing_moe_v3_weights",
        config=dict(ling, num_attention_heads=4, num_key_value_heads=4, head_dim=16, short_conv_kernel_size=4,
                    no_kda_lora=False, kda_safe_gate=False, use_qk_norm=False),
    )


    # Ling 2.5 (SGLang's bailing_moe_linear module, BailingMoeV2_5ForCausalLM; BailingHybridConfig
    # without a short_conv_kernel_size): Ling-V3's stack with lightning linear attention (a fixed
    # ALiBi-slope decay per head and layer, SGLang's LightningAttentionBackend, seg_la kernels) in
    # place of KDA. head_dim 128 (2 heads), the width SGLang's seg_la decode kernel tiles by
    # (kernels/ops/attention/linear/seg_la.py: K_SPLIT_DIM 128), so the Triton kernels run on this
    # checkpoint too. rope_parameters as Ling-V3's (the MLA layers' CPU rotary embedding).
    _FAMILIES["bailing_moe_linear"] = dict(
        cls="BailingMoeV2_5ForCausalLM", writer="bailing_moe_linear_weights",
        config=dict(ling, num_attention_heads=2, num_key_value_heads=2, head_dim=128, use_qk_norm=True,
                    group_norm_size=1, linear_silu=False),
    )


    # Ling-V3's VLM (SGLang's bailing_mm_v3 module, BailingMoeV3VLConfig): the Ling-V3 text model
    # above behind Qwen3-VL's vision tower (one block of width 32) and a two-layer projection; served
    # text-only. The VL config turns the text model's rope_parameters into M-RoPE of type "default"
    # (configs/bailing_hybrid.py, BailingMoeV3VLConfig), which SGLang's CPU rotary embedding for MLA
    # refuses (layers/rotary_embedding/factory.py:478-481): the plugin's CPU bridge builds it
    # (plugin/cpu_bridges.py, rope_cpu_around).
    _FAMILIES["bailing_mm_v3"] = dict(
        cls="BailingMoeV3VLForConditionalGeneration", writer="bailing_mm_v3_weights", sub="text_config",
        processor_class="Qwen3VLProcessor",
        config=dict(
            model_type="bailing_moe_v3_vl", image_token_id=760, video_token_id=761, vision_start_token_id=762,
            vision_end_token_id=763,
            text_config=dict(_FAMILIES["bailing_moe_v3"]["config"], architectures=["BailingMoeV3ForCausalLM"],
                             rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 1, 1])),
            vision_config=dict(
                depth=1, hidden_size=32, num_heads=2, intermediate_size=64, in_channels=3, patch_size=16,
                spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=_HIDDEN, num_position_embeddings=16,
                hidden_act="gelu_pytorch_tanh", deepstack_visual_indexes=[],
            ),
        ),
    )


    # MiniCPM-SALA (SGLang's minicpm module, MiniCPMSALAForCausalLM; MiniCPMHybridConfig): lightning
    # layers (SGLang's LightningAttentionBackend, as Ling 2.5's; a fixed ALiBi-slope decay per head,
    # the same in every layer unless lightning_layerwise_decay) alternating with GQA attention layers
    # ("minicpm4", dense: no sparse_config), both with output gates; muP-style scales (scale_emb,
    # scale_depth, dim_model_base). Lightning heads of 128 (SGLang's seg_la decode kernel tiles by
    # 128). Written by hand: transformers has no MiniCPM-SALA class.
    _FAMILIES["minicpm"] = dict(
        cls="MiniCPMSALAForCausalLM", writer="minicpm_sala_weights",
        config=dict(
            model_type="minicpm_sala", hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=_LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
            mixer_types=["lightning-attn", "minicpm4"], lightning_nh=2, lightning_nkv=2, lightning_head_dim=128,
            lightning_scale="1/sqrt(d)", lightning_use_rope=True, use_output_gate=True, use_output_norm=True,
            qk_norm=True, attn_use_rope=True, attn_use_output_gate=True, attention_bias=False, scale_emb=12,
            scale_depth=1.4, dim_model_base=256, rms_norm_eps=1e-6, rope_theta=10000.0,
        ),
    )
    # MiniCPMForCausalLM: SGLang's minicpm module registers it as a subclass of
    # MiniCPMSALAForCausalLM with nothing of its own (models/minicpm.py:626-630), so a checkpoint
    # naming it is served by the same code; the same config and weights under that name.
    _FAMILIES["minicpm_causal"] = dict(_FAMILIES["minicpm"], cls="MiniCPMForCausalLM", module="minicpm")
    return _FAMILIES
