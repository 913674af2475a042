"""A tiny Jet-Nemotron checkpoint (issue 40): SGLang 0.5.23's ``JetNemotronForCausalLM``
(``sglang/srt/models/jet_nemotron.py``, config ``JetNemotronConfig``,
``srt/configs/jet_nemotron.py``), whose weights transformers cannot produce (transformers 5.19 has
no Jet-Nemotron class), written by hand in the names the class's ``load_weights`` reads.

The model is Qwen2's stack (``JetNemotronModel(Qwen2Model)``: embedding, decoder layers, final
RMSNorm, an untied LM head) whose layers are, by ``layer_types``:

- ``"jet"``: a **JetBlock** (``self_attn``): ``q_proj`` / ``k_proj`` (``heads * head_dim``),
  ``v_proj`` and the output gate ``g_proj`` (``heads * head_dim * expand_v``), ``a_proj`` /
  ``b_proj`` (one per head; SGLang stacks the six into ``qkvabz_proj``), ``A_log`` and
  ``dt_bias`` per head, the **dynamic convolution** (``dynamic_conv1d.kernel_generator``:
  ``w1 [hidden / reduction, hidden]``, SiLU, ``w2 [v_dim * conv_size, hidden / reduction]`` with
  a bias: a per-token, per-channel conv kernel generated from the layer's input, applied to ``v``
  over the last ``conv_size`` tokens), the gated output norm ``o_norm [head_v_dim]`` and
  ``o_proj``;
- ``"attn"``: GQA attention with q / k / v biases (``head_dim = hidden / heads``), rotary
  positions.

Every layer has Qwen2's SwiGLU MLP. Layers alternate jet / attn. Decays ``A = exp(A_log)`` are
drawn small (0.02-0.5) so that the recurrent state carries context far back.

Only torch; deterministic for a seed. No transformers class, so no float32 reference from
transformers; :mod:`.jet_nemotron_reference` holds a plain-torch float32 one.
"""

from __future__ import annotations

import math
from typing import Dict

import torch

from sglang_mamba_ext.models.hf_tiny_written import _Draw, _swiglu


def jet_block_sizes(cfg: Dict):
    """``(heads, head_k_dim, head_v_dim, conv_size, generator hidden)`` of the config's JetBlock."""
    jet = cfg["efficient_attention_config"]["jet"]
    heads, dk = jet["num_heads"], jet["head_dim"]
    dv = int(dk * jet["expand_v"])
    return heads, dk, dv, jet["conv_size"], cfg["hidden_size"] // jet["dconv_generator_reduction"]


def jet_nemotron_weights(cfg: Dict, seed: int, logit_scale: float) -> Dict[str, torch.Tensor]:
    """The float32 state dict of a tiny ``JetNemotronForCausalLM`` for the config ``cfg`` (see the
    module docstring). ``logit_scale`` multiplies the LM head (N(0, 1/hidden) per entry
    otherwise)."""
    d = _Draw(seed)
    h, vocab = cfg["hidden_size"], cfg["vocab_size"]
    heads, dk, dv, conv, gen = jet_block_sizes(cfg)
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // n_heads
    w: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": d.normal(vocab, h)}
    for i, kind in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}"
        w[f"{p}.input_layernorm.weight"] = 1.0 + d.normal(h, std=0.1)
        w[f"{p}.post_attention_layernorm.weight"] = 1.0 + d.normal(h, std=0.1)
        a = f"{p}.self_attn"
        if kind == "jet":
            w[f"{a}.q_proj.weight"] = d.proj(heads * dk, h)
            w[f"{a}.k_proj.weight"] = d.proj(heads * dk, h)
            w[f"{a}.v_proj.weight"] = d.proj(heads * dv, h)
            w[f"{a}.a_proj.weight"] = d.proj(heads, h)
            w[f"{a}.b_proj.weight"] = d.proj(heads, h)
            w[f"{a}.g_proj.weight"] = d.proj(heads * dv, h)
            w[f"{a}.A_log"] = torch.log(d.uniform(0.02, 0.5, heads))
            w[f"{a}.dt_bias"] = d.normal(heads, std=0.1)
            kg = f"{a}.dynamic_conv1d.kernel_generator"
            w[f"{kg}.w1.weight"] = d.proj(gen, h)
            w[f"{kg}.w2.weight"] = d.proj(heads * dv * conv, gen) / math.sqrt(conv)
            w[f"{kg}.w2.bias"] = d.normal(heads * dv * conv, std=1.0 / math.sqrt(conv))
            w[f"{a}.o_norm.weight"] = 1.0 + d.normal(dv, std=0.1)
            w[f"{a}.o_proj.weight"] = d.proj(h, heads * dv)
        else:
            for name, rows in (("q_proj", n_heads * hd), ("k_proj", n_kv * hd), ("v_proj", n_kv * hd)):
                w[f"{a}.{name}.weight"] = d.proj(rows, h)
                w[f"{a}.{name}.bias"] = d.normal(rows, std=0.1)
            w[f"{a}.o_proj.weight"] = d.proj(h, n_heads * hd)
        _swiglu(w, d, f"{p}.mlp", h, cfg["intermediate_size"])
    w["model.norm.weight"] = 1.0 + d.normal(h, std=0.1)
    w["lm_head.weight"] = d.proj(vocab, h) * logit_scale
    return w


def jet_nemotron_config(hidden: int, layers: int) -> Dict:
    """``JetNemotronConfig``'s fields in the released format (``efficient_attention_config`` with
    the JetBlock's eight keys, ``layer_types`` of ``jet`` / ``attn``), tiny sizes."""
    return dict(
        model_type="jet_nemotron", hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, hidden_act="silu",
        layer_types=["jet", "attn"] * (layers // 2),
        efficient_attention_config=dict(jet=dict(
            mode="gdn", expand_v=2.0, num_heads=2, head_dim=16, norm_eps="1e-6", conv_size=4,
            dconv_generator_reduction=8, dconv_implementation="triton")),
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, use_sliding_window=False,
    )


def jet_nemotron_families(hidden: int, layers: int) -> Dict[str, Dict]:
    """The ``jet_nemotron`` entry of :mod:`.hf_tiny`'s family table."""
    return {"jet_nemotron": dict(cls="JetNemotronForCausalLM", writer=jet_nemotron_weights,
                                 config=jet_nemotron_config(hidden, layers))}
