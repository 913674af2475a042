"""A tiny Kimi-K3 text checkpoint (issue 40): SGLang 0.5.23's ``KimiK3LinearForCausalLM``
(``sglang/srt/models/kimi_k3.py``), whose weights transformers cannot produce (transformers 5.19
has no ``KimiK3*`` class), written by hand in the names the class's ``load_weights`` reads.

The config (:func:`kimi_k3_family`) is Kimi-Linear's format (SGLang's ``KimiLinearConfig``,
``model_type`` ``kimi_linear``, as SGLang's own expert-pack tooling writes a K3 text config,
``model_loader/expert_pack_runtime.py``) with K3's features on, each at the tiny sizes:

- KDA layers with the **full-rank output gate** (``linear_attn_config.use_full_rank_gate``:
  ``g_proj`` of ``heads * head_dim`` rows, no low-rank ``g_a`` / ``g_b``), the layout SGLang's
  code calls K3's (``KimiK3DeltaAttention``, "For the full-rank gate (K3)"), and the **safe
  gate** the released checkpoint trains with (``linear_attn_config.gate_lower_bound`` -5, per the
  same file, ``kimi_k3.py:1795-1796``: decay ``lower_bound * sigmoid(exp(A_log) * (a + dt_bias))``;
  the plugin's in-chunk writer takes it through ``inchunk_checkpoints.safe_gate_as_raw``);
- MLA full attention without rope (K3's MLA passes ``skip_rope``), with the sigmoid output gate
  (``mla_use_output_gate``: ``self_attn.g_proj``);
- Latent MoE (``routed_expert_hidden_size``: routed experts run in a narrower latent space
  between ``routed_expert_down_proj``, its RMSNorm and ``routed_expert_up_proj``), DeepSeek's
  router (sigmoid, correction bias), one shared expert, a dense first layer;
- SiTU activation (``hidden_act`` ``situ``, beta 4 and linear beta 25, the constants SGLang's
  MegaMoE kernel bakes in for the released checkpoint);
- Attention Residuals (``attn_res_block_size`` 2: every layer reads its attention and FFN
  inputs as a learned mixture of earlier blocks' outputs, ``*_res_proj`` / ``*_res_norm``).

Only torch; deterministic for a seed. No float32 reference (no transformers class).
"""

from __future__ import annotations

from typing import Dict

import torch

from sglang_mamba_ext.models.hf_tiny_written import _Draw, _kda, _mla, _swiglu


def kimi_k3_weights(cfg: Dict, seed: int, logit_scale: float) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``KimiK3LinearForCausalLM`` for the config ``cfg`` (the
    fields of :func:`kimi_k3_family`): per layer (``model.layers.N``) a KDA layer when ``N + 1``
    is in ``linear_attn_config.kda_layers`` (q / k / v / full-rank g projections, one short conv
    each of ``short_conv_kernel_size``, the low-rank decay ``f_a`` / ``f_b``, beta ``b_proj``,
    ``A_log [heads]``, ``dt_bias [heads * head_dim]``, the gated output norm ``o_norm`` and
    ``o_proj``) else MLA (``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``,
    ``o_proj``, the output gate ``g_proj``); a SwiGLU MLP for the first
    ``first_k_dense_replace`` layers, then the latent MoE (router ``gate`` with
    ``e_score_correction_bias``, experts ``w1`` / ``w3`` ``[inter, latent]`` and ``w2``
    ``[latent, inter]``, the latent projections and norm, shared experts); the attention-residual
    projections ``[1, hidden]`` and norms per layer and at the output. ``logit_scale`` multiplies
    the LM head (N(0, 1/hidden) per entry otherwise)."""
    d = _Draw(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    lin = cfg["linear_attn_config"]
    heads, dim, conv_k = lin["num_heads"], lin["head_dim"], lin["short_conv_kernel_size"]
    mla_heads = cfg["num_attention_heads"]
    nope, rope, vdim, kv_lora = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    latent = cfg["routed_expert_hidden_size"]
    w: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": d.normal(vocab, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = 1.0 + d.normal(h, std=0.1)
        w[f"{p}.post_attention_layernorm.weight"] = 1.0 + d.normal(h, std=0.1)
        for res in ("self_attention_res", "mlp_res"):
            w[f"{p}.{res}_norm.weight"] = 1.0 + d.normal(h, std=0.1)
            w[f"{p}.{res}_proj.weight"] = d.proj(1, h)
        a = f"{p}.self_attn"
        if (i + 1) in lin["kda_layers"]:
            _kda(w, d, a, h, heads, dim, conv_k, full_rank_gate=True)
        else:
            _mla(w, d, a, h, mla_heads, nope, rope, vdim, kv_lora)
            w[f"{a}.g_proj.weight"] = d.proj(mla_heads * vdim, h)
        m = f"{p}.mlp"
        if i < cfg["first_k_dense_replace"]:
            _swiglu(w, d, m, h, cfg["intermediate_size"])
            continue
        n_exp, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
        w[f"{m}.gate.weight"] = d.proj(n_exp, h)
        w[f"{m}.gate.e_score_correction_bias"] = d.normal(n_exp, std=0.1)
        for e in range(n_exp):
            w[f"{m}.experts.{e}.w1.weight"] = d.proj(inter, latent)
            w[f"{m}.experts.{e}.w3.weight"] = d.proj(inter, latent)
            w[f"{m}.experts.{e}.w2.weight"] = d.proj(latent, inter)
        w[f"{m}.routed_expert_down_proj.weight"] = d.proj(latent, h)
        w[f"{m}.routed_expert_norm.weight"] = 1.0 + d.normal(latent, std=0.1)
        w[f"{m}.routed_expert_up_proj.weight"] = d.proj(h, latent)
        _swiglu(w, d, f"{m}.shared_experts", h, inter * cfg["num_shared_experts"])
    w["model.output_attn_res_norm.weight"] = 1.0 + d.normal(h, std=0.1)
    w["model.output_attn_res_proj.weight"] = d.proj(1, h)
    w["model.norm.weight"] = 1.0 + d.normal(h, std=0.1)
    w["lm_head.weight"] = d.proj(vocab, h) * logit_scale
    return w


def kimi_k3_family(hidden: int, layers: int) -> Dict[str, Dict]:
    """The ``kimi_k3`` entry of :mod:`.hf_tiny`'s family table (``cls``, ``module``, ``writer``,
    ``config`` in Kimi-Linear's released format with K3's fields; see the module docstring), for
    a model of ``hidden`` width and ``layers`` layers alternating KDA / MLA."""
    return {"kimi_k3": dict(
        cls="KimiK3LinearForCausalLM", writer=kimi_k3_weights,
        config=dict(
            model_type="kimi_linear", hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
            num_attention_heads=4, num_key_value_heads=4, head_dim=16, hidden_act="situ",
            activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
            kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
            mla_use_nope=True, mla_use_output_gate=True,
            linear_attn_config=dict(kda_layers=list(range(1, layers + 1, 2)),
                                    full_attn_layers=list(range(2, layers + 1, 2)), num_heads=4, head_dim=16,
                                    short_conv_kernel_size=4, use_full_rank_gate=True, gate_lower_bound=-5.0),
            first_k_dense_replace=1, moe_layer_freq=1, num_experts=4, num_experts_per_token=2,
            moe_intermediate_size=32, num_shared_experts=1, moe_router_activation_func="sigmoid",
            moe_renormalize=True, use_grouped_topk=True, num_expert_group=1, topk_group=1,
            topk_method="noaux_tc", routed_scaling_factor=1.0,
            routed_expert_hidden_size=32, latent_moe_use_norm=True, attn_res_block_size=2,
            # 1e-5 as Kimi-Linear's tiny config (its KDA output norm uses 1e-5 whatever the config says)
            rope_theta=10000.0, rms_norm_eps=1e-5,
        ),
    )}
