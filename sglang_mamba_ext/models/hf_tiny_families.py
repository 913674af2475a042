"""The family table of :mod:`.hf_tiny` (split from it): per ``--arch`` name, SGLang's class
(``cls``), the config in the family's released format (``config``, the keys SGLang's config
classes read) and how the checkpoint is made (transformers' class, a hand-written ``writer`` of
:mod:`.hf_tiny_written` / :mod:`.hf_tiny_kimi_k3`, a VLM's ``sub`` config, ``drop`` / ``tune`` /
``banks`` / ``special_tokens`` ...; each key read by :mod:`.hf_tiny`'s builder). Sizes: hidden
:data:`_HIDDEN`, :data:`_LAYERS` layers. Data only (torch not needed)."""

from __future__ import annotations

from typing import Dict

from sglang_mamba_ext.models import hf_tiny_minicpmv, hf_tiny_nano_nemotron_vl
from sglang_mamba_ext.models.hf_tiny_jet_nemotron import jet_nemotron_families
from sglang_mamba_ext.models.hf_tiny_kimi_k3 import kimi_k3_family
from sglang_mamba_ext.models.hf_tiny_written import written_families

_HIDDEN = 64
_LAYERS = 4

def _qwen_gdn_layers() -> Dict:
    """The attention and Gated DeltaNet sizes Qwen3-Next and Qwen3.5 share (a fresh dict: the
    families' configs are changed in place by the VLM entries below)."""
    return dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
                full_attention_interval=2, layer_types=["linear_attention", "full_attention"] * (_LAYERS // 2),
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4)


# Per family: transformers class name and the config in the family's released format. Layer
# order alternates linear / full attention so that both kinds sit before and after each other.
_FAMILIES: Dict[str, Dict] = {
    "qwen3_next": dict(
        cls="Qwen3NextForCausalLM",
        config=dict(
            model_type="qwen3_next", hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=_LAYERS,
            **_qwen_gdn_layers(),
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[],
            norm_topk_prob=True, partial_rotary_factor=0.25, rope_theta=10000.0,
            rms_norm_eps=1e-6, attention_bias=False,
        ),
    ),
    "kimi_linear": dict(
        cls="KimiLinearForCausalLM",
        config=dict(
            model_type="kimi_linear", hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=_LAYERS,
            num_attention_heads=4, num_key_value_heads=4, head_dim=16, hidden_act="silu",
            kv_lora_rank=32, q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, mla_use_nope=True,
            linear_attn_config=dict(kda_layers=[1, 3], full_attn_layers=[2, 4], num_heads=4, head_dim=16,
                                    short_conv_kernel_size=4),
            first_k_dense_replace=0, moe_layer_freq=1, num_experts=4, num_experts_per_token=2,
            num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1,
            n_shared_experts=1, moe_router_activation_func="sigmoid", moe_renormalize=True,
            use_grouped_topk=True, num_expert_group=1, n_group=1, topk_group=1, routed_scaling_factor=1.0,
            # 1e-5 as released: SGLang's KimiDeltaAttention builds its gated output norm with
            # eps 1e-5 whatever the config says, transformers' with rms_norm_eps; the KDA
            # outputs are small enough here that 1e-6 against 1e-5 changed greedy tokens.
            rope_theta=10000.0, rms_norm_eps=1e-5,
        ),
    ),
    "nemotron_h": dict(
        cls="NemotronHForCausalLM",
        config=dict(
            model_type="nemotron_h", hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=_LAYERS,
            hybrid_override_pattern="M*M-", num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16, n_groups=2, mamba_n_groups=2, conv_kernel=4,
            expand=1,
            use_conv_bias=True, chunk_size=64, mlp_hidden_act="relu2", mamba_hidden_act="silu",
            layer_norm_epsilon=1e-5, attention_bias=False, mlp_bias=False, use_bias=False,
            residual_in_fp32=False, rescale_prenorm_residual=True,
        ),
        # transformers writes its own layer-kind names here ("linear_attention", ...), which
        # SGLang's NemotronHConfig refuses (configs/nemotron_h.py); both read the pattern above.
        drop=("layers_block_type", "mtp_layers_block_type"),
    ),
    "falcon_h1": dict(
        cls="FalconH1ForCausalLM",
        config=dict(
            model_type="falcon_h1", hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=_LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, hidden_act="silu",
            mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16,
            mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=64, mamba_conv_bias=True, mamba_proj_bias=False,
            mamba_rms_norm=False, mamba_norm_before_gate=False, rope_theta=10000.0, rms_norm_eps=1e-5,
            attention_bias=False, mlp_bias=False, projectors_bias=False,
        ),
    ),
    "granitemoehybrid": dict(
        cls="GraniteMoeHybridForCausalLM",
        # One B/C group (as the released Granite 4.0 checkpoints): with two, SGLang's MambaMixer2
        # normalizes the gated output per group and transformers' GraniteMoeHybridRMSNormGated
        # over the whole width; their outputs then differ (logprobs by ~0.7 nats here).
        config=dict(
            model_type="granitemoehybrid", hidden_size=_HIDDEN, intermediate_size=32, num_hidden_layers=_LAYERS,
            layer_types=["mamba", "attention"] * (_LAYERS // 2), num_attention_heads=4, num_key_value_heads=2,
            hidden_act="silu", mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16,
            mamba_d_conv=4, mamba_expand=1, mamba_chunk_size=64, mamba_conv_bias=True, mamba_proj_bias=False,
            num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64,
            position_embedding_type="nope", attention_multiplier=0.25, embedding_multiplier=1.0,
            residual_multiplier=1.0, logits_scaling=1.0, rms_norm_eps=1e-6, attention_bias=False,
        ),
    ),
    "lfm2": dict(
        cls="Lfm2ForCausalLM",
        config=dict(
            model_type="lfm2", hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=_LAYERS,
            layer_types=["conv", "full_attention"] * (_LAYERS // 2), full_attn_idxs=[1, 3],
            num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, conv_bias=False,
            block_auto_adjust_ff_dim=False, block_multiple_of=16, block_ffn_dim_multiplier=1.0,
            norm_eps=1e-5, rope_theta=10000.0,
        ),
    ),
    # Qwen3.5 dense, text only (SGLang's qwen3_5_text module): Gated DeltaNet as in Qwen3-Next,
    # with separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a projections, a gated
    # attention output and a dense MLP. The rotary settings are given both where transformers
    # reads them (rope_parameters) and where SGLang's Qwen3NextConfig base does (top level).
    "qwen3_5_text": dict(
        cls="Qwen3_5ForCausalLM",
        config=dict(
            model_type="qwen3_5_text", hidden_size=_HIDDEN, intermediate_size=128, num_hidden_layers=_LAYERS,
            **_qwen_gdn_layers(),
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
            partial_rotary_factor=0.25, rope_theta=10000.0, attn_output_gate=True,
            rms_norm_eps=1e-6, attention_bias=False,
        ),
    ),
    # Qwen3.5 MoE, text only: SGLang's qwen3_5_text module, class Qwen3_5MoeForCausalLM (hence
    # an --arch name apart from the module's, the model_type SGLang's Qwen3_5MoeTextConfig
    # reads). Qwen3.5's GDN layers with a routed MoE and a gated shared expert; transformers
    # saves the routed experts fused (experts.gate_up_proj / down_proj), which SGLang's loader
    # maps (models/qwen3_5.py, its expert mapping).
    "qwen3_5_moe_text": dict(
        cls="Qwen3_5MoeForCausalLM", module="qwen3_5_text",
        config=dict(
            model_type="qwen3_5_moe_text", hidden_size=_HIDDEN, num_hidden_layers=_LAYERS,
            **_qwen_gdn_layers(),
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=32, norm_topk_prob=True,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
            partial_rotary_factor=0.25, rope_theta=10000.0, attn_output_gate=True,
            rms_norm_eps=1e-6, attention_bias=False,
        ),
    ),
    # LFM2 MoE: LFM2's gated short conv and attention layers; the first num_dense_layers
    # layers have a dense MLP, the rest a routed MoE (sigmoid router with an expert bias).
    "lfm2_moe": dict(
        cls="Lfm2MoeForCausalLM",
        config=dict(
            model_type="lfm2_moe", hidden_size=_HIDDEN, intermediate_size=128, moe_intermediate_size=32,
            num_hidden_layers=_LAYERS, layer_types=["conv", "full_attention"] * (_LAYERS // 2),
            num_attention_heads=4, num_key_value_heads=2, conv_L_cache=3, conv_bias=False,
            num_dense_layers=1, num_experts=4, num_experts_per_tok=2, use_expert_bias=True,
            routed_scaling_factor=1.0, norm_topk_prob=True, norm_eps=1e-5,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0), rope_theta=10000.0,
        ),
    ),
    # Nemotron-H Puzzle (SGLang's NemotronHPuzzleForCausalLM of its nemotron_h module): the
    # Nemotron-H stack with per-block configs (block_configs, one dict per layer, each
    # overriding the top-level fields for its layer). transformers has no Puzzle class: the
    # weights are its NemotronHForCausalLM's at the same sizes (hf_cls / hf_model_type), a MoE
    # block included (SGLang's loader sizes its expert mapping by the largest MoE block).
    "nemotron_h_puzzle": dict(
        cls="NemotronHPuzzleForCausalLM", module="nemotron_h", hf_cls="NemotronHForCausalLM",
        hf_model_type="nemotron_h", spread_experts=True,
        config=dict(
            model_type="nemotron_h_puzzle", hidden_size=_HIDDEN, intermediate_size=128,
            num_hidden_layers=_LAYERS, hybrid_override_pattern="M*ME", num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, mamba_num_heads=4, mamba_head_dim=16, ssm_state_size=16,
            n_groups=2, mamba_n_groups=2, conv_kernel=4, expand=1, use_conv_bias=True, chunk_size=64,
            mlp_hidden_act="relu2", mamba_hidden_act="silu", layer_norm_epsilon=1e-5, attention_bias=False,
            mlp_bias=False, use_bias=False, residual_in_fp32=False, rescale_prenorm_residual=True,
            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=32, n_shared_experts=1, routed_scaling_factor=1.0,
            n_group=1, topk_group=1, norm_topk_prob=True,
            block_configs=[{"block_type": "mamba"}, {"block_type": "attention"}, {"block_type": "mamba"},
                           {"block_type": "moe", "n_routed_experts": 4}],
        ),
        drop=("layers_block_type", "mtp_layers_block_type"),
    ),
    # The VLM classes (issue 40): the text model of a served family inside its released
    # multimodal wrapper, with a tiny vision tower (one block, width 32); served text-only.
    # ``sub`` names the text sub-config: the tokenizer ids, vocabulary size and context length
    # go there as well as at the top level. Vision token ids sit at the vocabulary's end
    # (760-763), outside the random prompts' range.
    "qwen3_5": None,  # _qwen35_vlm below (dense)
    "qwen3_5_moe": None,  # _qwen35_vlm below (MoE)
    # LFM2-VL: LFM2's text model behind a SigLIP2 (NaFlex) vision tower and a pixel-unshuffle
    # projector (downsample factor 2).
    "lfm2_vl": dict(
        cls="Lfm2VlForConditionalGeneration", sub="text_config",
        config=dict(
            model_type="lfm2_vl", image_token_id=760, downsample_factor=2, projector_hidden_size=64,
            projector_hidden_act="gelu", projector_bias=True, projector_use_layernorm=True,
            text_config=None,  # filled below: LFM2's
            vision_config=dict(
                model_type="siglip2_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_channels=3, patch_size=16, num_patches=16,
                hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
            ),
        ),
    ),
    # Pure Mamba2 (Mamba-Codestral's format: backbone.*, one gated RMSNorm per mixer): every
    # layer is a Mamba2 mixer, there is no attention layer at all. One B/C group. Served under
    # --enable-mamba-radix through the plugin's declaration (plugin/hybrid_declare.py) and the
    # no-attention CPU bridge (plugin/cpu_bridges.py).
    # intermediate_size (= expand * hidden_size) is written out: SGLang's mamba2 module and
    # its Mamba2Config's state shapes read it, transformers derives it.
    "mamba2": dict(
        cls="Mamba2ForCausalLM",
        config=dict(
            model_type="mamba2", hidden_size=_HIDDEN, intermediate_size=_HIDDEN, num_hidden_layers=_LAYERS,
            num_heads=4, head_dim=16,
            expand=1, state_size=16, n_groups=1, conv_kernel=4, chunk_size=64, use_bias=False,
            use_conv_bias=True, hidden_act="silu", rms_norm=True, layer_norm_epsilon=1e-5,
            residual_in_fp32=False, time_step_limit=[0.0, 1e4],
        ),
    ),
    # Pure Mamba1 (issue 40; state-spaces' -hf format: backbone.*, one RMSNorm per layer, no
    # MLP): every layer a selective-scan mixer, no attention layer. Falcon-Mamba adds the
    # weightless RMSNorm on B / C / dt (mixer_rms_eps); plain Mamba is the same layers without
    # it. Served under --enable-mamba-radix through the plugin's declaration
    # (plugin/hybrid_declare.py) and the Mamba1 writer (plugin/inchunk_mamba1.py).
    # intermediate_size and time_step_rank are written out (SGLang's config classes read them).
    "falcon_mamba": dict(
        cls="FalconMambaForCausalLM", tune="_mamba1_long_memory",
        config=dict(
            model_type="falcon_mamba", hidden_size=_HIDDEN, intermediate_size=2 * _HIDDEN, expand=2,
            num_hidden_layers=_LAYERS, state_size=16, conv_kernel=4, time_step_rank=4, use_bias=False,
            use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=1e-5, mixer_rms_eps=1e-6,
            residual_in_fp32=False, use_mambapy=False,
        ),
    ),
    "mamba": dict(
        cls="MambaForCausalLM", tune="_mamba1_long_memory",
        config=dict(
            model_type="mamba", hidden_size=_HIDDEN, intermediate_size=2 * _HIDDEN, expand=2,
            num_hidden_layers=_LAYERS, state_size=16, conv_kernel=4, time_step_rank=4, use_bias=False,
            use_conv_bias=True, hidden_act="silu", layer_norm_epsilon=1e-5, residual_in_fp32=False,
            use_mambapy=False,
        ),
    ),
}

# Families transformers has no class for: weights written by hand in the names SGLang's loader
# reads (``writer``: a function of :mod:`.hf_tiny_written`, which also holds their configs);
# no float32 reference.
_FAMILIES.update(written_families(_HIDDEN, _LAYERS))
_FAMILIES.update(kimi_k3_family(_HIDDEN, _LAYERS))
from sglang_mamba_ext.models.hf_tiny_kimi_k3_vl import kimi_k3_vl_family  # noqa: E402
_FAMILIES.update(kimi_k3_vl_family(_HIDDEN, _LAYERS))  # Kimi-K3's VLM, text-only (hf_tiny_kimi_k3_vl.py)
from sglang_mamba_ext.models.hf_tiny_inkling import inkling_family  # noqa: E402
_FAMILIES.update(inkling_family(_HIDDEN, 2))  # Inkling, sconv (hf_tiny_inkling.py)
from sglang_mamba_ext.models.hf_tiny_zaya import zaya_family  # noqa: E402
_FAMILIES.update(zaya_family(_HIDDEN, _LAYERS))  # ZAYA1's CCA (hf_tiny_zaya.py)
_FAMILIES.update(jet_nemotron_families(_HIDDEN, _LAYERS))  # Jet-Nemotron (hf_tiny_jet_nemotron.py)
from sglang_mamba_ext.models.hf_tiny_jet_vlm import jet_vlm_family  # noqa: E402
_FAMILIES.update(jet_vlm_family(_HIDDEN, _LAYERS))  # Jet-Nemotron's VLM, text-only (hf_tiny_jet_vlm.py)
from sglang_mamba_ext.models.hf_tiny_glm5_next import glm5_next_family  # noqa: E402
_FAMILIES.update(glm5_next_family(_HIDDEN, _LAYERS))  # GLM-5-Next, text-only; DSA dense within index_topk (hf_tiny_glm5_next.py)


def _qwen35_vlm(model_type: str, cls: str, **entry) -> Dict:
    """A Qwen3.5 VLM family entry (dense or MoE): a one-block vision tower in front of the text
    model (filled below), vision token ids at the vocabulary's end (760-763)."""
    return dict(cls=cls, sub="text_config", **entry, config=dict(
        model_type=model_type, image_token_id=760, video_token_id=761, vision_start_token_id=762,
        vision_end_token_id=763,
        text_config=None,  # filled below: the text model's, with an M-RoPE section
        vision_config=dict(
            model_type=model_type, depth=1, hidden_size=32, num_heads=2, intermediate_size=64,
            in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
            out_hidden_size=_HIDDEN, num_position_embeddings=16, hidden_act="gelu_pytorch_tanh",
            deepstack_visual_indexes=[],
        ),
    ))


_FAMILIES["qwen3_5"] = _qwen35_vlm("qwen3_5", "Qwen3_5ForConditionalGeneration")
_FAMILIES["qwen3_5_moe"] = _qwen35_vlm("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", module="qwen3_5")
# Intern-S2-Preview (SGLang's interns2preview module): a Qwen3_5MoeForConditionalGeneration
# subclass with nothing of its own, config InternS2PreviewConfig (model_type intern_s2_preview,
# Qwen3.5 MoE's text sub-config). transformers has no such class: the weights and the float32
# reference are its Qwen3_5MoeForConditionalGeneration's at the same sizes.
# Intern-S2-Mobius (SGLang's interns2_mobius module): Qwen3.5 MoE VLM layers whose routed experts
# live in num_blocks shared banks (model.language_model.meta_mlp.<b>; layer i routes through bank
# i % num_blocks), each layer keeping its own shared expert and gate. transformers has no such
# class: its Qwen3_5MoeForConditionalGeneration builds the weights with every layer's routed
# experts and router set to its bank's, saved beside the checkpoint (hf_reference/) as the float32
# reference, and the checkpoint holds each bank once (``banks``).
_FAMILIES["interns2_mobius"] = _qwen35_vlm("interns2_mobius", "InternS2MobiusForConditionalGeneration",
                                           hf_cls="Qwen3_5MoeForConditionalGeneration", hf_model_type="qwen3_5_moe",
                                           processor_class="Qwen3VLProcessor", banks=2, spread_experts=True)
_FAMILIES["interns2preview"] = _qwen35_vlm("intern_s2_preview", "InternS2PreviewForConditionalGeneration",
                                           hf_cls="Qwen3_5MoeForConditionalGeneration", hf_model_type="qwen3_5_moe",
                                           processor_class="Qwen3VLProcessor")


def _vlm_text(arch: str, **extra) -> Dict:
    cfg = dict(_FAMILIES[arch]["config"])
    cfg.update(extra)
    return cfg


# Qwen3.5's VLMs place rotary positions by M-RoPE (three sections of the rotary half, 4 / 2 =
# 2 frequencies here, interleaved as released); on text-only prompts the three position rows
# are equal, so it is the text model's 1D rotary embedding.
_MROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25, mrope_section=[1, 1, 0],
              mrope_interleaved=True)
_FAMILIES["qwen3_5"]["config"]["text_config"] = _vlm_text("qwen3_5_text", rope_parameters=dict(_MROPE))
_FAMILIES["qwen3_5_moe"]["config"]["text_config"] = _vlm_text("qwen3_5_moe_text", rope_parameters=dict(_MROPE))
_FAMILIES["interns2preview"]["config"]["text_config"] = _vlm_text("qwen3_5_moe_text", rope_parameters=dict(_MROPE))
# (the text config's dtype written out: SGLang's InternS2MobiusTextConfig takes bfloat16 where it
# is missing, configs/interns2_mobius.py:22-23, and the server then runs the model in bfloat16)
_FAMILIES["interns2_mobius"]["config"]["text_config"] = _vlm_text("qwen3_5_moe_text", rope_parameters=dict(_MROPE),
                                                                  num_blocks=_FAMILIES["interns2_mobius"]["banks"],
                                                                  dtype="float16")
_FAMILIES["lfm2_vl"]["config"]["text_config"] = _vlm_text("lfm2")
_FAMILIES.update(hf_tiny_minicpmv.minicpmv_families(_HIDDEN))
for _v in ("minicpmv", "minicpmv4_7"):
    _FAMILIES[_v]["config"]["text_config"] = _vlm_text("qwen3_5_text")
# Nemotron-H Nano VL / Omni (issue 40, hf_tiny_nano_nemotron_vl): Nemotron-H's text model as
# llm_config (its dtype written out: SGLang's wrapper casts the vision tower and projector to
# the language model config's dtype, models/nano_nemotron_vl.py:91-116) behind a RADIO tower.
_FAMILIES.update(hf_tiny_nano_nemotron_vl.nano_nemotron_families(_HIDDEN))
for _v in ("nano_nemotron_vl", "nano_nemotron_omni", "nano_nemotron_omni_v3"):
    _FAMILIES[_v]["config"]["llm_config"] = _vlm_text("nemotron_h", torch_dtype="float16", dtype="float16")
# Qwen4-Exp (issue 40, hf_tiny_qwen4_exp): Qwen3.5's GDN / attention layers and MoE inside gated
# hyper-connections, a PLE (n-gram embedding + dilated short conv) on each linear layer; bfloat16.
from sglang_mamba_ext.models.hf_tiny_qwen4_exp import qwen4_exp_family  # noqa: E402

_FAMILIES.update(qwen4_exp_family(_HIDDEN, _LAYERS, _qwen_gdn_layers(), _MROPE))
