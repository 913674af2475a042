"""A tiny Inkling checkpoint (issue 40): SGLang 0.5.23's ``InklingForConditionalGeneration``
(``sglang/srt/models/inkling.py``, config ``sglang/srt/configs/inkling.py::InklingMMConfig``),
written by hand in the names the class's ``load_weights`` reads (``inkling.py:1405-1520``:
``llm.layers.N.attn.wq_du`` / ``wk_dv`` / ``wv_dv`` / ``wr_du`` fused into ``qkvr``, ``wo_ud``,
the dense MLP's ``gate_proj`` / ``up_proj`` / ``down_proj``). transformers 5.19 has no Inkling
class, so there is no float32 reference (as for the other hand-written families).

The text model (``text_config``, SGLang's ``InklingModelConfig``) has ``use_sconv`` on: every
layer convolves its attention keys and values (``attn.k_sconv`` / ``v_sconv``, width
``kv_heads * head_dim``) and its attention and MLP outputs (``attn_sconv`` / ``mlp_sconv``, width
``hidden``) with a depthwise causal conv of ``sconv_kernel_size`` taps plus the input
(``ShortConvolution``, ``use_residual``: ``y = conv(x) + x``). Its per-request state, in SGLang's
Mamba pool, is the last ``K - 1`` raw inputs of each conv (``configs/inkling.py``,
``mamba2_cache_params``: six streams per layer, ``K_FULL, V_FULL, K_LOCAL, V_LOCAL, ATTN, MLP``;
a full-attention layer uses four of them). Attention is Inkling's: RMS-normed ``q`` / ``k`` per
head, scale ``1 / head_dim``, no rope, plus a learned relative-position bias
``rel_logits[t, h, dist] = r_t @ proj`` for distances below ``rel_extent``.

Tiny choices: no sliding-window layer (``local_layer_ids`` empty; the plugin's cache does not
serve SWA KV pools), dense MLPs in every layer (``dense_mlp_idx`` = layers: no MoE), no towers
(SGLang builds the vision / audio towers only with multimodal on, which it turns off for the
class, ``configs/model_config.py:696``). The conv taps are drawn N(0, 1/2) so the state matters
(the lag-1..3 inputs move each output). Only torch; deterministic for a seed.
"""

from __future__ import annotations

from typing import Dict

import torch

from sglang_mamba_ext.models.hf_tiny_written import _Draw


def inkling_weights(cfg: Dict, seed: int, logit_scale: float) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``InklingForConditionalGeneration`` for the config ``cfg``
    (its ``text_config``: :func:`inkling_family`): ``llm.embed_tokens``, per layer ``N``
    (``llm.layers.N``) ``attn_norm`` / ``mlp_norm``, ``attn.wq_du [H*D, hidden]``,
    ``attn.wk_dv`` / ``wv_dv [Hkv*D, hidden]``, ``attn.wr_du [H*d_rel, hidden]``,
    ``attn.wo_ud [hidden, H*D]``, ``attn.q_norm`` / ``k_norm [D]``,
    ``attn.rel_logits_proj.proj [d_rel, rel_extent]``, the four convs ``[width, 1, K]``
    (``attn.k_sconv``, ``attn.v_sconv``, ``attn_sconv``, ``mlp_sconv``), the SwiGLU MLP; then
    ``llm.norm`` and ``llm.lm_head`` (N(0, 1/hidden) times ``logit_scale``)."""
    t = cfg["text_config"]
    d = _Draw(seed)
    h, vocab, k = t["hidden_size"], t["vocab_size"], t["sconv_kernel_size"]
    heads, kv, dim, d_rel = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"], t["d_rel"]
    w: Dict[str, torch.Tensor] = {"llm.embed_tokens.weight": d.normal(vocab, h)}

    def conv(name: str, width: int) -> None:
        w[name] = d.normal(width, 1, k, std=0.5 ** 0.5)

    for i in range(t["num_hidden_layers"]):
        p = f"llm.layers.{i}"
        w[f"{p}.attn_norm.weight"] = 1.0 + d.normal(h, std=0.1)
        w[f"{p}.mlp_norm.weight"] = 1.0 + d.normal(h, std=0.1)
        a = f"{p}.attn"
        w[f"{a}.wq_du.weight"] = d.proj(heads * dim, h)
        w[f"{a}.wk_dv.weight"] = d.proj(kv * dim, h)
        w[f"{a}.wv_dv.weight"] = d.proj(kv * dim, h)
        w[f"{a}.wr_du.weight"] = d.proj(heads * d_rel, h)
        w[f"{a}.wo_ud.weight"] = d.proj(h, heads * dim)
        w[f"{a}.q_norm.weight"] = 1.0 + d.normal(dim, std=0.1)
        w[f"{a}.k_norm.weight"] = 1.0 + d.normal(dim, std=0.1)
        w[f"{a}.rel_logits_proj.proj"] = d.normal(d_rel, t["rel_extent"], std=0.5)
        conv(f"{a}.k_sconv.weight", kv * dim)
        conv(f"{a}.v_sconv.weight", kv * dim)
        conv(f"{p}.attn_sconv.weight", h)
        conv(f"{p}.mlp_sconv.weight", h)
        inter = t["dense_intermediate_size"]
        w[f"{p}.mlp.gate_proj.weight"] = d.proj(inter, h)
        w[f"{p}.mlp.up_proj.weight"] = d.proj(inter, h)
        w[f"{p}.mlp.down_proj.weight"] = d.proj(h, inter)
    w["llm.norm.weight"] = 1.0 + d.normal(h, std=0.1)
    w["llm.lm_head.weight"] = d.proj(vocab, h) * logit_scale
    return w


def inkling_family(hidden: int, layers: int) -> Dict[str, Dict]:
    """The ``inkling`` entry of :mod:`.hf_tiny`'s family table: ``InklingMMConfig``'s released
    format (``model_type`` ``inkling_mm_model``, the text model under ``text_config``, default
    vision / audio configs without a ``decoder_dmodel``: no towers). ``vocab_size`` and the other
    tokenizer ids go to ``text_config`` only (``sub``): ``InklingMMConfig.vocab_size`` is a
    property without a setter (``configs/inkling.py``)."""
    return {"inkling": dict(
        cls="InklingForConditionalGeneration", writer=inkling_weights, sub="text_config",
        no_processor=True,
        top_level_drop=("vocab_size",),
        config=dict(
            model_type="inkling_mm_model",
            text_config=dict(
                model_type="inkling_model", hidden_size=hidden, intermediate_size=128,
                dense_intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, d_rel=8, rel_extent=256, local_layer_ids=[],
                sliding_window_size=64, use_sconv=True, sconv_kernel_size=4, dense_mlp_idx=layers,
                n_routed_experts=0, rms_norm_eps=1e-6, hidden_act="silu", num_nextn_predict_layers=0,
                torch_dtype="float16", dtype="float16",
            ),
        ),
    )}
