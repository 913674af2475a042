"""A tiny ZAYA1 checkpoint (issue 40): SGLang 0.5.23's ``ZayaForCausalLM``
(``sglang/srt/models/zaya.py``, config ``sglang/srt/configs/zaya.py::ZayaConfig``), written by hand
in the names the class's ``load_weights`` reads (``zaya.py:1590-1699``: the released ZAYA1-base
layout, ``self_attn.qkv.*`` for CCA, ``zaya_block.experts.local_experts.<e>.linear_fc1`` /
``linear_fc2`` for the experts).

transformers 5.19 does have a ``zaya`` model, but it is a different layout (ZAYA1-8B: one
``layer_types`` list of merged attention + MoE layers, ``mlp.experts.gate_up_proj``, its own config
fields); SGLang's ``configs/zaya.py:306-319`` re-registers ``zaya`` with its own config class. So
there is no float32 reference for this family (as for the other hand-written ones).

Layout (SGLang's ``_layer_class``, ``zaya.py:1414-1420``): even layers are CCA attention, odd layers
the ZAYA MoE block (3-layer router MLP with EDA and the MOD skip expert, SwiGLU experts, top-1). CCA
(``zaya.py:403-877``): ``linear_q`` / ``linear_k`` projections whose concatenation runs through a
two-stage causal conv along time (``conv_qk.0`` depthwise, ``conv_qk.1`` grouped per head, kernel
``cca_time0`` / ``cca_time1`` = 2 each), mixed with the group means of the raw projections,
RMS-normalised with a per-K-head temperature; ``v`` is ``[val_proj1(h_t), val_proj2(h_{t-1})]``.
The per-request state is therefore the last ``(cca_time0 - 1) + (cca_time1 - 1)`` raw ``qk`` inputs
and the previous hidden state (``configs/zaya.py:284-303``), kept in SGLang's Mamba pool beside the
layer's KV cache.

The conv weights are drawn so that the state matters: ``conv_qk`` taps N(0, 1/2) (the lag-1 and
lag-2 tokens move q / k), ``val_proj2`` as large as ``val_proj1``. Only torch; deterministic for a
seed.
"""

from __future__ import annotations

from typing import Dict

import torch

from sglang_mamba_ext.models.hf_tiny_written import _Draw


def zaya_weights(cfg: Dict, seed: int, logit_scale: float) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``ZayaForCausalLM`` for the config ``cfg`` (the fields of
    :func:`zaya_family`). Per even layer ``N`` (``model.layers.N``): ``self_attn.qkv.linear_q``
    ``[Hq*D, H]``, ``linear_k`` ``[Hk*D, H]``, ``val_proj1`` / ``val_proj2`` ``[Hk*D/2, H]``,
    ``conv_qk.0`` (depthwise, ``[C, 1, t0]``) and ``conv_qk.1`` (``Hq + Hk`` groups, ``[C, D, t1]``)
    with biases (``C = (Hq + Hk) * D``), ``temp [Hk]``, ``self_attn.o_proj``; per odd layer the
    router (``down_proj`` with bias, ``rmsnorm_eda``, ``router_states_scale``, ``router_mlp.0/2``
    with biases, ``router_mlp.4`` to ``experts + 1`` logits, ``balancing_biases``) and the experts'
    ``linear_fc1`` ``[2 * inter, H]`` (gate rows first) / ``linear_fc2`` ``[H, inter]``; every layer
    its ``input_norm`` and ``res_scale`` (``residual_*`` from layer 1 on), and at the output
    ``model.final_norm``, ``model.res_scale`` and ``lm_head`` (N(0, 1/hidden) times
    ``logit_scale``)."""
    d = _Draw(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    hq, hk, dim = cfg["num_attention_heads"], cfg["num_query_groups"], cfg["head_dim"]
    t0, t1 = cfg["cca_time0"], cfg["cca_time1"]
    ch = (hq + hk) * dim
    n_exp, inter, exp_r = cfg["num_experts"], cfg["ffn_hidden_size"] // 2, cfg["zaya_mlp_expansion"]
    w: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": d.normal(vocab, h)}

    def res_scale(prefix: str, has_residual: bool) -> None:
        w[f"{prefix}.hidden_states_scale"] = 1.0 + d.normal(h, std=0.1)
        w[f"{prefix}.hidden_states_bias"] = d.normal(h, std=0.05)
        if has_residual:
            w[f"{prefix}.residual_scale"] = 1.0 + d.normal(h, std=0.1)
            w[f"{prefix}.residual_bias"] = d.normal(h, std=0.05)

    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_norm.weight"] = 1.0 + d.normal(h, std=0.1)
        res_scale(f"{p}.res_scale", i != 0)
        if i % 2 == 0:
            q = f"{p}.self_attn.qkv"
            w[f"{q}.linear_q.weight"] = d.proj(hq * dim, h)
            w[f"{q}.linear_k.weight"] = d.proj(hk * dim, h)
            w[f"{q}.val_proj1.weight"] = d.proj(hk * dim // 2, h)
            w[f"{q}.val_proj2.weight"] = d.proj(hk * dim // 2, h)
            w[f"{q}.conv_qk.0.weight"] = d.normal(ch, 1, t0, std=0.7)
            w[f"{q}.conv_qk.0.bias"] = d.normal(ch, std=0.05)
            w[f"{q}.conv_qk.1.weight"] = d.normal(ch, dim, t1, std=0.7 / dim ** 0.5)
            w[f"{q}.conv_qk.1.bias"] = d.normal(ch, std=0.05)
            w[f"{q}.temp"] = d.uniform(0.5, 1.5, hk)
            w[f"{p}.self_attn.o_proj.weight"] = d.proj(h, hq * dim)
            continue
        r = f"{p}.zaya_block.router"
        w[f"{r}.down_proj.weight"] = d.proj(exp_r, h)
        w[f"{r}.down_proj.bias"] = d.normal(exp_r, std=0.05)
        w[f"{r}.rmsnorm_eda.weight"] = 1.0 + d.normal(exp_r, std=0.1)
        w[f"{r}.router_states_scale"] = d.uniform(0.2, 0.8, exp_r)
        w[f"{r}.router_mlp.0.weight"] = d.proj(exp_r, exp_r)
        w[f"{r}.router_mlp.0.bias"] = d.normal(exp_r, std=0.05)
        w[f"{r}.router_mlp.2.weight"] = d.proj(exp_r, exp_r)
        w[f"{r}.router_mlp.2.bias"] = d.normal(exp_r, std=0.05)
        w[f"{r}.router_mlp.4.weight"] = d.proj(n_exp + 1, exp_r) * 3.0
        # the MOD skip expert (the last slot) unbiased, so some tokens take the skip path
        w[f"{r}.balancing_biases"] = torch.zeros(n_exp + 1)
        for e in range(n_exp):
            x = f"{p}.zaya_block.experts.local_experts.{e}"
            w[f"{x}.linear_fc1.weight"] = d.proj(2 * inter, h)
            w[f"{x}.linear_fc2.weight"] = d.proj(h, inter)
    w["model.final_norm.weight"] = 1.0 + d.normal(h, std=0.1)
    res_scale("model.res_scale", True)
    w["lm_head.weight"] = d.proj(vocab, h) * logit_scale
    return w


def zaya_family(hidden: int, layers: int) -> Dict[str, Dict]:
    """The ``zaya`` entry of :mod:`.hf_tiny`'s family table (``cls``, ``writer``, ``config`` in the
    ZAYA1-base format SGLang's ``ZayaConfig`` reads) for a model of ``hidden`` width and ``layers``
    layers (even: CCA attention, odd: MoE)."""
    return {"zaya": dict(
        cls="ZayaForCausalLM", writer=zaya_weights,
        config=dict(
            model_type="zaya", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
            num_query_groups=2, num_key_value_heads=2, head_dim=16, cca=True, cca_time0=2, cca_time1=2,
            clamp_temp=False, attention_bias=False, partial_rotary_factor=0.5, rope_theta=10000.0,
            ffn_hidden_size=128, num_experts=4, moe_router_topk=1, zaya_mlp_expansion=32, zaya_use_mod=True,
            zaya_use_eda=True, zaya_high_prec=True, activation_func="swiglu", gated_linear_unit=True,
            add_bias_linear=False, scale_residual_merge=True, residual_in_fp32=True, normalization="RMSNorm",
            norm_epsilon=1e-5, lm_head_bias=False,
        ),
    )}
